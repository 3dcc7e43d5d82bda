"""Ragged paged attention through the native CPU kernel (csrc/ragged_paged_attention.cc).

One call serves a batch mixing decode, prefill and chunked prefill with a cached prefix,
bottom-right causal, with the semantics of `jax_attn.paged_attention` (SPEC section 1). Tested
against the oracle `jax_attn.reference.paged_attention` (float64) in
tests/jax/test_cpu_ragged.py.

    query:  |<---- seq 0: prefill (40) ---->|<- seq 1: chunk (9) ->|s2|s3|pad|
    query_start_loc [0, 40, 49, 50, 51, ...]: seq i owns rows [qsl[i], qsl[i + 1])

The kernel tiles each sequence's tokens (up to 64 query rows: tokens x the query heads of one
kv head) and walks only the keys a tile can see. Output shapes depend only on `T`, `S` and
`max_blocks`, so a jitted step compiles once for all batch lengths; `num_seqs` and every length
are runtime values.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

HANDLER = "jax_attn_cpu_ragged_paged_attention"
QUERY_DTYPES = ("float32", "bfloat16", "float16")


def _require_kernel() -> None:
    from jax_attn.cpu import _build

    reason = _build.unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"jax_attn.cpu kernels are not available: {reason}")
    if not _build.registered(HANDLER):
        raise RuntimeError(f"jax_attn.cpu: the built library has no {HANDLER} handler")


def _check_shapes(query, key_cache, value_cache, query_start_loc, seq_lens, block_tables,
                  num_seqs, alibi_slopes) -> None:
    from jax_attn.cpu import shape_problem

    if query.ndim != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_size], got {query.shape}")
    if key_cache.ndim != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, "
            f"head_size], got {key_cache.shape} and {value_cache.shape}"
        )
    if key_cache.dtype != value_cache.dtype:
        raise TypeError(f"{key_cache.dtype=} must equal {value_cache.dtype=}")
    num_heads, head_size = query.shape[1:]
    _, block_size, num_kv_heads, cache_head_size = key_cache.shape
    if cache_head_size != head_size:
        raise ValueError(f"cache head_size={cache_head_size} must equal query {head_size=}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} must be divisible by {num_kv_heads=}")
    problem = shape_problem(
        query_dtype=query.dtype,
        cache_dtype=key_cache.dtype,
        block_size=block_size,
        head_size=head_size,
    )
    if problem is not None:
        raise ValueError(f"jax_attn.cpu.ragged_paged_attention: {problem}")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks], got {block_tables.shape}")
    num_rows = block_tables.shape[0]
    if seq_lens.shape != (num_rows,):
        raise ValueError(f"seq_lens must be [{num_rows}] like block_tables, got {seq_lens.shape}")
    if query_start_loc.shape != (num_rows + 1,):
        raise ValueError(
            f"query_start_loc must be [{num_rows + 1}] (num_seqs + 1), got {query_start_loc.shape}"
        )
    if jnp.shape(num_seqs) != ():
        raise ValueError(f"num_seqs must be a scalar, got shape {jnp.shape(num_seqs)}")
    for name, x in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                    ("block_tables", block_tables)):
        if x.dtype != jnp.int32:
            raise TypeError(f"{name} must be int32, got {x.dtype}")
    if alibi_slopes is not None and alibi_slopes.shape != (num_heads,):
        raise ValueError(f"alibi_slopes must be [{num_heads}], got {alibi_slopes.shape}")


def _no_grad(fn):
    """fn with a JVP rule that says where gradients live (the kernel is forward-only)."""
    wrapped = jax.custom_jvp(fn)

    def jvp(primals, tangents):
        raise TypeError(
            "jax_attn.cpu.ragged_paged_attention (paged_attention impl='cpu') has no "
            "gradient: differentiate jax_attn.varlen_attention instead"
        )

    wrapped.defjvp(jvp)
    return wrapped


def ragged_paged_attention(
    query: Float[Array, "num_tokens num_heads head_size"],
    key_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    value_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    query_start_loc: Int[Array, " num_seqs_plus_1"],
    seq_lens: Int[Array, " num_seqs"],
    block_tables: Int[Array, "num_seqs max_blocks"],
    num_seqs: Int[Array, ""],
    *,
    scale: float,
    causal: bool = True,
    alibi_slopes: Float[Array, " num_heads"] | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float | Float[Array, ""] = 1.0,
    v_scale: float | Float[Array, ""] = 1.0,
) -> Float[Array, "num_tokens num_heads head_size"]:
    """`jax_attn.paged_attention` on the native CPU kernel; result in `query.dtype`.

    Only the first `num_seqs` rows of the metadata are real; output rows of padding tokens
    (past `query_start_loc[num_seqs]`) are zeros, and so are rows whose keys are all masked.
    Caches may be float32/bfloat16/float16 or fp8 (`float8_e4m3fn`, `float8_e5m2`, read times
    `k_scale` / `v_scale`, which may be traced scalars). Bad metadata (block ids outside the
    cache, `seq_lens` beyond the block table or below the query length, a decreasing
    `query_start_loc`) raises an XlaRuntimeError naming the argument; nothing out of bounds is
    read. Tested against `jax_attn.reference.paged_attention`. Not differentiable (raises
    naming `jax_attn.varlen_attention`); `vmap` runs the calls one after another.
    """
    _require_kernel()
    _check_shapes(query, key_cache, value_cache, query_start_loc, seq_lens, block_tables,
                  num_seqs, alibi_slopes)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{sliding_window=} must be >= 1 (or None)")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"{logits_soft_cap=} must be > 0 (or None)")
    num_heads = query.shape[1]
    slopes = (
        jnp.zeros((0,), jnp.float32)
        if alibi_slopes is None
        else jnp.asarray(alibi_slopes, jnp.float32).reshape(num_heads)
    )
    call = jax.ffi.ffi_call(
        HANDLER,
        jax.ShapeDtypeStruct(query.shape, query.dtype),
        vmap_method="sequential",
    )

    def kernel(query, key_cache, value_cache, k_scale, v_scale, slopes, qsl, lens, tables, n):
        return call(
            query,
            key_cache,
            value_cache,
            qsl,
            lens,
            tables,
            n,
            k_scale,
            v_scale,
            slopes,
            scale=np.float32(scale),
            causal=np.int64(bool(causal)),
            sliding_window=np.int64(sliding_window or 0),
            logits_soft_cap=np.float32(logits_soft_cap or 0.0),
        )

    return _no_grad(kernel)(
        query,
        key_cache,
        value_cache,
        jnp.asarray(k_scale, jnp.float32).reshape(()),
        jnp.asarray(v_scale, jnp.float32).reshape(()),
        slopes,
        query_start_loc,
        seq_lens,
        block_tables,
        jnp.asarray(num_seqs, jnp.int32).reshape(()),
    )

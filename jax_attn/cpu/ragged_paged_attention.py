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

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jax_attn.cpu import _ffi

TARGET = "jax_attn_cpu_ragged_paged_attention"


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _ragged(config, query, key_cache, value_cache, qsl, seq_lens, tables, num_seqs, ks, vs, sl, sk):
    scale, causal, sliding_window, logits_soft_cap = config
    return _ffi.call_like_query(TARGET, query)(
        query,
        key_cache,
        value_cache,
        qsl,
        seq_lens,
        tables,
        num_seqs,
        ks,
        vs,
        sl,
        sk,
        scale=np.float32(scale),
        causal=np.int64(causal),
        sliding_window=np.int64(sliding_window),
        logits_soft_cap=np.float32(logits_soft_cap),
    )


_ragged.defjvp(
    _ffi.grad_refusal(
        "jax_attn.cpu.ragged_paged_attention (the native CPU kernel, paged_attention impl='cpu')"
    )
)


def _check_shapes(
    query,
    key_cache,
    value_cache,
    query_start_loc,
    seq_lens,
    block_tables,
    num_seqs,
    alibi_slopes,
    sinks,
) -> None:
    _ffi.check_caches(
        query,
        key_cache,
        value_cache,
        rows="num_tokens",
        kernel="jax_attn.cpu.ragged_paged_attention",
    )
    num_heads = query.shape[1]
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks], got {block_tables.shape}")
    rows = block_tables.shape[0]
    if seq_lens.shape != (rows,):
        raise ValueError(
            f"seq_lens must be [num_seqs={rows}] (block_tables rows), got {seq_lens.shape}"
        )
    if query_start_loc.shape != (rows + 1,):
        raise ValueError(
            f"query_start_loc must be [num_seqs + 1={rows + 1}], got {query_start_loc.shape}"
        )
    if jnp.shape(num_seqs) != ():
        raise ValueError(f"num_seqs must be a scalar, got shape {jnp.shape(num_seqs)}")
    for name, x in dict(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        num_seqs=jnp.asarray(num_seqs),
    ).items():
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name}.dtype={x.dtype} must be int32")
    _ffi.check_per_head("alibi_slopes", alibi_slopes, num_heads)
    _ffi.check_per_head("sinks", sinks, num_heads)


@functools.partial(
    jax.jit, static_argnames=("scale", "causal", "sliding_window", "logits_soft_cap")
)
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
    sinks: Float[Array, " num_heads"] | None = None,
) -> Float[Array, "num_tokens num_heads head_size"]:
    """`jax_attn.paged_attention` on the native CPU kernel; result in `query.dtype`.

    Only the first `num_seqs` rows of the metadata are real; output rows of padding tokens
    (past `query_start_loc[num_seqs]`) are zeros, and so are rows whose keys are all masked.
    Caches may be float32/bfloat16/float16 or fp8 (`float8_e4m3fn`, `float8_e5m2`, read times
    `k_scale` / `v_scale`, which may be traced scalars). Bad metadata (block ids outside the
    cache, `seq_lens` beyond the block table or below the query length, a `query_start_loc`
    that decreases or leaves [0, num_tokens], `num_seqs` outside [0, rows]) raises an
    XlaRuntimeError naming the argument, under `jit` too: the kernel checks every index before
    it reads the cache or writes the output (issue 22). Tested against
    `jax_attn.reference.paged_attention`. Not differentiable (raises naming
    `jax_attn.varlen_attention`); `vmap` runs the calls one after another.
    """
    _ffi.require_native()
    _check_shapes(
        query,
        key_cache,
        value_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        num_seqs,
        alibi_slopes,
        sinks,
    )
    _ffi.check_bias(sliding_window, logits_soft_cap)
    config = (
        float(scale),
        int(bool(causal)),
        int(sliding_window or 0),
        float(logits_soft_cap or 0),
    )
    return _ragged(
        config,
        query,
        key_cache,
        value_cache,
        query_start_loc.astype(jnp.int32),
        seq_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32),
        jnp.asarray(num_seqs).astype(jnp.int32).reshape(()),
        _ffi.f32_scalar(k_scale),
        _ffi.f32_scalar(v_scale),
        _ffi.f32_per_head(alibi_slopes),
        _ffi.f32_per_head(sinks),
    )

"""Paged decode through the native CPU kernel `csrc/paged_decode.cc` (an XLA FFI handler).

Tested against `jax_attn.reference.paged_decode` (the float64 oracle) in
tests/jax/test_cpu_decode.py. Same semantics as `jax_attn.paged_decode` (SPEC section 1).
"""

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jax_attn.cpu import _build, _ffi, _shapes
from jax_attn.cpu.ragged_paged_attention import ragged_paged_attention

TARGET = "jax_attn_cpu_paged_decode"


def decode_path(
    cache_dtype, query_dtype, block_size: int, group: int, layout: str = "token-major"
) -> str:
    """Which code the native decode runs here for caches of `cache_dtype` under queries of
    `query_dtype` at `block_size` with `group` query heads per kv head: "amx", "vector"
    (AVX-512 or the portable code), or "unavailable" (no native kernels).

    "amx" needs bf16 queries on a bf16 or fp8 cache and a CPU whose AMX tiles this process may
    use. In `layout` "token-major" (jax_attn's caches, `paged_decode`): block sizes that are
    multiples of 16 and groups of at least 5 on bf16 or 4 on fp8 (smaller groups run faster on
    the vector code). In "split" (vLLM's, the torch half's `paged_decode_split`): block sizes
    16, 32 or multiples of 64, every group (its tiles read the cache as it lies).
    `JAX_ATTN_CPU_DECODE_AMX=1` puts every group size on the tiles, `0` none."""
    if layout not in ("token-major", "split"):
        raise ValueError(f"layout={layout!r} must be 'token-major' or 'split'")
    fn = _build.c_function("jax_attn_cpu_decode_on_amx")
    if fn is None:
        return "unavailable"
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    names = (jnp.dtype(cache_dtype).name.encode(), jnp.dtype(query_dtype).name.encode())
    split = int(layout == "split")
    return "amx" if fn(*names, split, int(block_size), int(group)) else "vector"


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _decode(config, query, key_cache, value_cache, block_tables, seq_lens, slopes, sinks, ks, vs):
    scale, sliding_window, logits_soft_cap, split_tokens = config
    return _ffi.call_like_query(TARGET, query)(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        slopes,
        sinks,
        ks,
        vs,
        scale=np.float32(scale),
        sliding_window=np.int64(sliding_window),
        logits_soft_cap=np.float32(logits_soft_cap),
        split_tokens=np.int64(split_tokens),
    )


_decode.defjvp(_ffi.grad_refusal("jax_attn.cpu.paged_decode (the native CPU kernel, impl='cpu')"))


@functools.partial(
    jax.jit, static_argnames=("scale", "sliding_window", "logits_soft_cap", "split_tokens")
)
def paged_decode(
    query: Float[Array, "num_seqs num_heads head_size"],
    key_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    value_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    block_tables: Int[Array, "num_seqs max_blocks"],
    seq_lens: Int[Array, " num_seqs"],
    *,
    scale: float | None = None,
    alibi_slopes: Float[Array, " num_heads"] | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float | Float[Array, ""] = 1.0,
    v_scale: float | Float[Array, ""] = 1.0,
    sinks: Float[Array, " num_heads"] | None = None,
    split_tokens: int | None = None,
) -> Float[Array, "num_seqs num_heads head_size"]:
    """One new query token per sequence, at position `seq_lens[i] - 1`, over the paged cache.

    The native kernel: per sequence (split into parts of whole blocks for long contexts, merged
    in float32), each block read once for all kv heads: float32 and bf16 caches in address
    order, 4 tokens of every kv head at a time, keys and values read in place (widened in
    registers); float16 and fp8 caches kv head by kv head through widened copies. bf16 queries
    on a bf16 or fp8 cache whose block size is a multiple of 16 run both products on AMX tiles
    where the CPU has them and the GQA group is large enough to fill them (`decode_path` says
    which code runs). Online softmax in float32.
    Rows with `seq_lens[i] == 0` give zeros. `scale` defaults to `head_size ** -0.5`.
    `sinks`: attention sinks (see `jax_attn.paged_attention`).
    `split_tokens` (keys per split-K part; None: chosen from the batch)
    exists for tests.

    Head sizes past 256 (up to 512) run on the ragged kernel instead (`_decode_on_ragged`).

    Bad values (block ids outside [0, num_blocks) among the blocks a sequence reads,
    `seq_lens` outside [0, max_blocks * block_size]) raise an XlaRuntimeError naming the
    argument, before anything is read. Not differentiable (see `varlen_attention`); `vmap`
    runs the kernel once per batch element.
    """
    _ffi.require_native()
    _ffi.check_caches(
        query, key_cache, value_cache, rows="num_seqs", kernel="jax_attn.cpu.paged_decode"
    )
    num_seqs, num_heads, _ = query.shape
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be [num_seqs={num_seqs}, max_blocks], got {block_tables.shape}"
        )
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [num_seqs={num_seqs}], got {seq_lens.shape}")
    for name, x in dict(block_tables=block_tables, seq_lens=seq_lens).items():
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name}.dtype={x.dtype} must be int32")
    _ffi.check_bias(sliding_window, logits_soft_cap)
    _ffi.check_per_head("alibi_slopes", alibi_slopes, num_heads)
    _ffi.check_per_head("sinks", sinks, num_heads)
    if query.shape[-1] > _shapes.MAX_DECODE_HEAD_SIZE:
        return _decode_on_ragged(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            scale=float(query.shape[-1] ** -0.5 if scale is None else scale),
            alibi_slopes=alibi_slopes,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            k_scale=k_scale,
            v_scale=v_scale,
            sinks=sinks,
        )
    config = (
        float(query.shape[-1] ** -0.5 if scale is None else scale),
        int(sliding_window or 0),
        float(logits_soft_cap or 0.0),
        int(split_tokens or 0),
    )
    return _decode(
        config,
        query,
        key_cache,
        value_cache,
        block_tables.astype(jnp.int32),
        seq_lens.astype(jnp.int32),
        _ffi.f32_per_head(alibi_slopes),
        _ffi.f32_per_head(sinks),
        _ffi.f32_scalar(k_scale),
        _ffi.f32_scalar(v_scale),
    )


def _decode_on_ragged(query, key_cache, value_cache, block_tables, seq_lens, *, scale, **bias):
    """The decode as a ragged step of one query token per sequence, for head sizes the decode
    kernel does not take. The ragged kernel refuses a sequence shorter than its query, where
    the decode gives a zero row: sequences with keys go first (stable), one token each, and the
    empty ones become padding rows past `query_start_loc[num_seqs]`, which come out zero."""
    num_seqs = query.shape[0]
    seq_lens = seq_lens.astype(jnp.int32)
    order = jnp.argsort(seq_lens == 0, stable=True)
    filled = jnp.sum(seq_lens != 0).astype(jnp.int32)
    out = ragged_paged_attention(
        query[order],
        key_cache,
        value_cache,
        jnp.minimum(jnp.arange(num_seqs + 1, dtype=jnp.int32), filled),
        seq_lens[order],
        block_tables[order],
        filled,
        scale=scale,
        causal=True,
        **bias,
    )
    return out[jnp.argsort(order)]

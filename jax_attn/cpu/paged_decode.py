"""Paged decode through the native CPU kernel `csrc/paged_decode.cc` (an XLA FFI handler).

Tested against `jax_attn.reference.paged_decode` (the float64 oracle) in
tests/jax/test_cpu_decode.py. Same semantics as `jax_attn.paged_decode` (SPEC section 1).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jax_attn.cpu._build import unavailable_reason
from jax_attn.cpu._shapes import shape_problem

TARGET = "jax_attn_cpu_paged_decode"


def _not_differentiable(*_):
    raise TypeError(
        "jax_attn.cpu.paged_decode (the native CPU kernel, impl='cpu') has no gradient: "
        "the paged kernels are inference-only. Differentiate through "
        "jax_attn.varlen_attention (dense ragged attention) instead."
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _decode(config, query, key_cache, value_cache, block_tables, seq_lens, slopes, ks, vs):
    scale, sliding_window, logits_soft_cap, split_tokens = config
    call = jax.ffi.ffi_call(
        TARGET,
        jax.ShapeDtypeStruct(query.shape, query.dtype),
        # A batched call runs the kernel once per batch element (vmap over a batch of caches
        # or tables); vmap over sequences is better written as a bigger num_seqs.
        vmap_method="sequential",
    )
    return call(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        slopes,
        ks,
        vs,
        scale=np.float32(scale),
        sliding_window=np.int64(sliding_window),
        logits_soft_cap=np.float32(logits_soft_cap),
        split_tokens=np.int64(split_tokens),
    )


_decode.defjvp(_not_differentiable)


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
    split_tokens: int | None = None,
) -> Float[Array, "num_seqs num_heads head_size"]:
    """One new query token per sequence, at position `seq_lens[i] - 1`, over the paged cache.

    The native kernel: per sequence (split into parts of whole blocks for long contexts, merged
    in float32), each block read once for all kv heads, all query heads of a GQA group against
    one widened copy of the kv head's keys and values, online softmax in float32. Rows with
    `seq_lens[i] == 0` give zeros. `scale` defaults to `head_size ** -0.5`. `split_tokens`
    (keys per split-K part; None: chosen from the batch) exists for tests.

    Bad values (block ids outside [0, num_blocks) among the blocks a sequence reads,
    `seq_lens` outside [0, max_blocks * block_size]) raise an XlaRuntimeError naming the
    argument, before anything is read. Not differentiable (see `varlen_attention`); `vmap`
    runs the kernel once per batch element.
    """
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"jax_attn.cpu kernels are not available: {reason}")
    if query.ndim != 3:
        raise ValueError(f"query must be [num_seqs, num_heads, head_size], got {query.shape}")
    if key_cache.ndim != 4:
        raise ValueError(
            "key_cache must be [num_blocks, block_size, num_kv_heads, head_size], "
            f"got {key_cache.shape}"
        )
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"value_cache {value_cache.shape} {value_cache.dtype} must match "
            f"key_cache {key_cache.shape} {key_cache.dtype}"
        )
    num_seqs, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, cache_head_size = key_cache.shape
    if cache_head_size != head_size:
        raise ValueError(f"key_cache head_size={cache_head_size} != query {head_size=}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} must be divisible by {num_kv_heads=}")
    problem = shape_problem(
        query_dtype=query.dtype,
        cache_dtype=key_cache.dtype,
        block_size=block_size,
        head_size=head_size,
    )
    if problem is not None:
        raise TypeError(f"jax_attn.cpu.paged_decode: {problem}")
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be [num_seqs={num_seqs}, max_blocks], got {block_tables.shape}"
        )
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [num_seqs={num_seqs}], got {seq_lens.shape}")
    for name, x in dict(block_tables=block_tables, seq_lens=seq_lens).items():
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name}.dtype={x.dtype} must be int32")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{sliding_window=} must be >= 1 (or None)")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"{logits_soft_cap=} must be > 0 (or None)")
    if alibi_slopes is None:
        slopes = jnp.zeros((0,), jnp.float32)
    else:
        if alibi_slopes.shape != (num_heads,):
            raise ValueError(f"alibi_slopes must be [{num_heads=}], got {alibi_slopes.shape}")
        slopes = alibi_slopes.astype(jnp.float32)
    config = (
        float(head_size**-0.5 if scale is None else scale),
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
        slopes,
        jnp.asarray(k_scale).astype(jnp.float32).reshape(()),
        jnp.asarray(v_scale).astype(jnp.float32).reshape(()),
    )

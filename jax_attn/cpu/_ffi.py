"""What the native kernels' wrappers share: the availability check, the cache and bias checks,
the float32 operands, the `ffi_call` and the gradient refusal."""

import jax
import jax.numpy as jnp

from jax_attn.cpu import _build
from jax_attn.cpu._shapes import shape_problem


def require_native() -> None:
    reason = _build.unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"jax_attn.cpu kernels are not available: {reason}")


def grad_refusal(kernel: str):
    """A `custom_jvp` rule that refuses: `kernel` (how the error names it) is inference-only."""

    def refuse(*_):
        raise TypeError(
            f"{kernel} has no gradient: the paged kernels are inference-only. "
            "Differentiate through jax_attn.varlen_attention (dense ragged attention) instead."
        )

    return refuse


def check_caches(query, key_cache, value_cache, *, rows: str, kernel: str) -> None:
    """`query` [rows, num_heads, head_size] against the caches: ranks, matching caches, head
    size, GQA divisibility and the dtypes and sizes the kernel is built for."""
    if query.ndim != 3:
        raise ValueError(f"query must be [{rows}, num_heads, head_size], got {query.shape}")
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
    num_heads, head_size = query.shape[1:]
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
        raise TypeError(f"{kernel}: {problem}")


def check_bias(sliding_window: int | None, logits_soft_cap: float | None) -> None:
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{sliding_window=} must be >= 1 (or None)")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"{logits_soft_cap=} must be > 0 (or None)")


def f32_per_head(x):
    """The kernels' per-head operands (ALiBi slopes, attention sinks): float32 [num_heads],
    or empty for none."""
    if x is None:
        return jnp.zeros((0,), jnp.float32)
    return jnp.asarray(x).astype(jnp.float32)


def check_per_head(name: str, x, num_heads: int) -> None:
    """ValueError unless `x` is None or [num_heads]."""
    if x is not None and jnp.shape(x) != (num_heads,):
        raise ValueError(f"{name} must be [{num_heads=}], got {jnp.shape(x)}")


def f32_scalar(x):
    """A k_scale / v_scale (Python float or traced scalar) as the kernels' float32 [] operand."""
    return jnp.asarray(x).astype(jnp.float32).reshape(())


def call_like_query(target: str, query):
    """`ffi_call` of `target` whose result has the query's shape and dtype. A batched call runs
    the kernel once per batch element (vmap over a batch of caches or tables); vmap over
    sequences is better written as a bigger batch."""
    return jax.ffi.ffi_call(
        target, jax.ShapeDtypeStruct(query.shape, query.dtype), vmap_method="sequential"
    )

"""Converters between the KV cache layouts of the project's halves.

| layout | key cache                 | value cache          | one tensor per layer        |
|--------|---------------------------|----------------------|-----------------------------|
| core   | `[NB, BS, Hkv, D]`        | `[NB, BS, Hkv, D]`   | separate arrays             |
| vLLM   | `[NB, Hkv, D // x, BS, x]`| `[NB, Hkv, D, BS]`   | `kv_cache[2, NB, BS*Hkv*D]` |
| IPEX   | `[NB, Hkv, BS, D]`        | `[NB, Hkv, BS, D]`   | `kv_cache[2, NB, BS*Hkv*D]` |

with `x = 16 // element_size` (16-byte vectors). All converters are pure reshapes and
transposes that work on torch tensors and on JAX arrays alike (they return the same
framework they are given); converting copies, since the element orders differ.
fp8 caches: torch code (vLLM) keeps them as uint8 bit patterns; `fp8_view` reinterprets those
bits as the float8 dtype named by vLLM's `kv_cache_dtype` string, without copying.
"""

import ml_dtypes
import numpy as np

FP8_NAMES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _transpose(x, axes):
    return x.permute(*axes) if _is_torch(x) else x.transpose(axes)


def _contiguous(x):
    return x.contiguous() if _is_torch(x) else x


def _stack(xs):
    if _is_torch(xs[0]):
        import torch

        return torch.stack(xs)
    import jax.numpy as jnp

    return jnp.stack(xs)


def _itemsize(x) -> int:
    return x.element_size() if _is_torch(x) else np.dtype(x.dtype).itemsize


def _check_core(key_cache, value_cache) -> None:
    if key_cache.ndim != 4 or tuple(key_cache.shape) != tuple(value_cache.shape):
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, "
            f"head_size]; got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )


def _check_packed(kv_cache, num_kv_heads: int, head_size: int) -> int:
    """The block size of a packed `[2, NB, BS*Hkv*D]` cache."""
    if kv_cache.ndim != 3 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size * num_kv_heads * "
            f"head_size], got shape {tuple(kv_cache.shape)}"
        )
    per_token = num_kv_heads * head_size
    if kv_cache.shape[2] % per_token:
        raise ValueError(
            f"kv_cache.shape[2]={kv_cache.shape[2]} is not a multiple of "
            f"num_kv_heads * head_size = {per_token}"
        )
    return kv_cache.shape[2] // per_token


def nhd_to_vllm(key_cache, value_cache):
    """Core `[NB, BS, Hkv, D]` caches -> vLLM's packed `kv_cache[2, NB, BS*Hkv*D]`."""
    _check_core(key_cache, value_cache)
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    x = 16 // _itemsize(key_cache)
    if head_size % x:
        raise ValueError(f"head_size={head_size} must be a multiple of x={x} (16 bytes)")
    # [NB, BS, Hkv, D/x, x] -> [NB, Hkv, D/x, BS, x]
    key = _transpose(
        key_cache.reshape(num_blocks, block_size, num_kv_heads, head_size // x, x), (0, 2, 3, 1, 4)
    )
    value = _transpose(value_cache, (0, 2, 3, 1))  # [NB, BS, Hkv, D] -> [NB, Hkv, D, BS]
    return _stack(
        [_contiguous(key).reshape(num_blocks, -1), _contiguous(value).reshape(num_blocks, -1)]
    )


def vllm_to_nhd(kv_cache, num_kv_heads: int, head_size: int):
    """vLLM's packed `kv_cache[2, NB, BS*Hkv*D]` -> core `(key_cache, value_cache)`."""
    block_size = _check_packed(kv_cache, num_kv_heads, head_size)
    num_blocks = kv_cache.shape[1]
    x = 16 // _itemsize(kv_cache)
    key = kv_cache[0].reshape(num_blocks, num_kv_heads, head_size // x, block_size, x)
    value = kv_cache[1].reshape(num_blocks, num_kv_heads, head_size, block_size)
    # [NB, Hkv, D/x, BS, x] -> [NB, BS, Hkv, D/x, x] -> [NB, BS, Hkv, D]
    key = _contiguous(_transpose(key, (0, 3, 1, 2, 4))).reshape(
        num_blocks, block_size, num_kv_heads, head_size
    )
    value = _contiguous(_transpose(value, (0, 3, 1, 2)))  # [NB, BS, Hkv, D]
    return key, value


def nhd_to_ipex(key_cache, value_cache):
    """Core `[NB, BS, Hkv, D]` caches -> IPEX's packed `kv_cache[2, NB, BS*Hkv*D]`
    (each half `[NB, Hkv, BS, D]`)."""
    _check_core(key_cache, value_cache)
    num_blocks = key_cache.shape[0]
    halves = [
        _contiguous(_transpose(c, (0, 2, 1, 3))).reshape(num_blocks, -1)
        for c in (key_cache, value_cache)
    ]
    return _stack(halves)


def ipex_to_nhd(kv_cache, num_kv_heads: int, head_size: int):
    """IPEX's packed `kv_cache[2, NB, BS*Hkv*D]` -> core `(key_cache, value_cache)`."""
    block_size = _check_packed(kv_cache, num_kv_heads, head_size)
    num_blocks = kv_cache.shape[1]
    return tuple(
        _contiguous(
            _transpose(
                kv_cache[i].reshape(num_blocks, num_kv_heads, block_size, head_size), (0, 2, 1, 3)
            )
        )
        for i in range(2)
    )


def fp8_view(cache, kv_cache_dtype: str):
    """A uint8 cache's bits as the float8 dtype of vLLM's `kv_cache_dtype` (no copy);
    the cache itself for "auto"."""
    if kv_cache_dtype == "auto":
        return cache
    if kv_cache_dtype not in FP8_NAMES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not 'auto' or one of {sorted(FP8_NAMES)}"
        )
    name = FP8_NAMES[kv_cache_dtype]
    if _is_torch(cache):
        import torch

        return cache.view(getattr(torch, name))
    import jax

    return jax.lax.bitcast_convert_type(cache, np.dtype(getattr(ml_dtypes, name)))

"""Converters between the KV cache layouts of the core, vLLM's paged ops and IPEX.

| layout | key cache                  | value cache          | storage                       |
|--------|----------------------------|----------------------|-------------------------------|
| core   | `[NB, BS, Hkv, D]`         | `[NB, BS, Hkv, D]`   | two arrays                    |
| vLLM   | `[NB, Hkv, D // x, BS, x]` | `[NB, Hkv, D, BS]`   | `kv_cache[2, NB, BS*Hkv*D]`   |
| IPEX   | `[NB, Hkv, BS, D]`         | `[NB, Hkv, BS, D]`   | `kv_cache[2, NB, BS*Hkv*D]`   |

with `x = 16 // element_size` (vLLM's key cache keeps 16-byte vectors of one token together).
Where element `(block b, offset o, head h, dim d)` lives, as a flat index into `kv_cache[i, b]`:

    core key/value   key_cache[b, o, h, d]
    vLLM key         ((h * (D // x) + d // x) * BS + o) * x + d % x
    vLLM value       (h * D + d) * BS + o
    IPEX key/value   (h * BS + o) * D + d

e.g. D = 64, bf16 (x = 8), BS = 16: vLLM's key for o = 3, h = 0, d = 10 sits at
(1 * 16 + 3) * 8 + 2 = 154.

Every converter is a reshape plus a transpose and returns the framework it was given (torch
tensor, JAX array or NumPy array). The element orders differ, so each one copies once (into
compact memory); nothing is cast.

fp8: vLLM and IPEX store fp8 caches as uint8 bit patterns and name the format in a
`kv_cache_dtype` string: "fp8" and "fp8_e4m3" mean float8_e4m3fn, "fp8_e5m2" float8_e5m2
(IPEX 2.8 supports only "fp8_e5m2"). With an fp8 `kv_cache_dtype`, `*_to_nhd` accept uint8 bits
or a real float8 tensor of that format and return float8 caches (JAX's float8 dtypes), and
`nhd_to_*` accept float8 (or uint8 bits) and return uint8 bits, as vLLM allocates them.
`fp8_view` / `fp8_bits` do the reinterpretation alone.
"""

import jax
import ml_dtypes
import numpy as np
from jaxtyping import Shaped

try:
    import torch
except ImportError:  # JAX- and NumPy-only use
    torch = None

AnyArray = jax.Array | np.ndarray if torch is None else jax.Array | np.ndarray | torch.Tensor

NHDCache = Shaped[AnyArray, "num_blocks block_size num_kv_heads head_size"]
PackedCache = Shaped[AnyArray, "2 num_blocks block_size*num_kv_heads*head_size"]

# vLLM's fp8 `kv_cache_dtype` strings and the float8 format each one stores.
FP8_KV_CACHE_DTYPES = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
_FLOAT8 = ("float8_e4m3fn", "float8_e5m2")


# --- core <-> vLLM ---------------------------------------------------------------------------


def nhd_to_vllm(
    key_cache: NHDCache, value_cache: NHDCache, *, kv_cache_dtype: str = "auto"
) -> PackedCache:
    """Core caches `[NB, BS, Hkv, D]` -> vLLM's `kv_cache[2, NB, BS*Hkv*D]` (a copy).

    `kv_cache_dtype` fp8: the caches are float8 of that format (or uint8 bits) and the result is
    uint8 bits, the way vLLM allocates fp8 caches.
    """
    key_cache, value_cache = _check_nhd(key_cache, value_cache, kv_cache_dtype)
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    x = _vector_width(key_cache, head_size)
    # [NB, BS, Hkv, D // x, x] -> [NB, Hkv, D // x, BS, x]
    key = _permute(
        key_cache.reshape(num_blocks, block_size, num_kv_heads, head_size // x, x),
        (0, 2, 3, 1, 4),
    )
    value = _permute(value_cache, (0, 2, 3, 1))  # [NB, BS, Hkv, D] -> [NB, Hkv, D, BS]
    return _pack(key, value)


def vllm_to_nhd(
    kv_cache: PackedCache, num_kv_heads: int, head_size: int, *, kv_cache_dtype: str = "auto"
) -> tuple[NHDCache, NHDCache]:
    """vLLM's `kv_cache[2, NB, BS*Hkv*D]` -> core `(key_cache, value_cache)` (copies).

    `kv_cache_dtype` fp8: `kv_cache` holds uint8 bits (or float8 of that format) and the caches
    come back as float8.
    """
    block_size = _check_packed(kv_cache, num_kv_heads, head_size)
    num_blocks = kv_cache.shape[1]
    x = _vector_width(kv_cache, head_size)
    key = kv_cache[0].reshape(num_blocks, num_kv_heads, head_size // x, block_size, x)
    value = kv_cache[1].reshape(num_blocks, num_kv_heads, head_size, block_size)
    # [NB, Hkv, D // x, BS, x] -> [NB, BS, Hkv, D // x, x] -> [NB, BS, Hkv, D]
    key = _compact(_permute(key, (0, 3, 1, 2, 4)))
    key = key.reshape(num_blocks, block_size, num_kv_heads, head_size)
    value = _compact(_permute(value, (0, 3, 1, 2)))  # [NB, Hkv, D, BS] -> [NB, BS, Hkv, D]
    return fp8_view(key, kv_cache_dtype), fp8_view(value, kv_cache_dtype)


# --- core <-> IPEX ---------------------------------------------------------------------------


def nhd_to_ipex(
    key_cache: NHDCache, value_cache: NHDCache, *, kv_cache_dtype: str = "auto"
) -> PackedCache:
    """Core caches `[NB, BS, Hkv, D]` -> IPEX's `kv_cache[2, NB, BS*Hkv*D]` (a copy), whose
    halves `IpexAttnBackend.split_kv_cache` views as `[NB, Hkv, BS, D]`.

    `kv_cache_dtype` fp8: as in `nhd_to_vllm`, the result is uint8 bits.
    """
    key_cache, value_cache = _check_nhd(key_cache, value_cache, kv_cache_dtype)
    # [NB, BS, Hkv, D] -> [NB, Hkv, BS, D]
    return _pack(_permute(key_cache, (0, 2, 1, 3)), _permute(value_cache, (0, 2, 1, 3)))


def ipex_to_nhd(
    kv_cache: PackedCache, num_kv_heads: int, head_size: int, *, kv_cache_dtype: str = "auto"
) -> tuple[NHDCache, NHDCache]:
    """IPEX's `kv_cache[2, NB, BS*Hkv*D]` -> core `(key_cache, value_cache)` (copies).

    `kv_cache_dtype` fp8: as in `vllm_to_nhd`, the caches come back as float8.
    """
    block_size = _check_packed(kv_cache, num_kv_heads, head_size)
    num_blocks = kv_cache.shape[1]
    key, value = (
        # [NB, Hkv, BS, D] -> [NB, BS, Hkv, D]
        _compact(
            _permute(
                kv_cache[i].reshape(num_blocks, num_kv_heads, block_size, head_size), (0, 2, 1, 3)
            )
        )
        for i in range(2)
    )
    return fp8_view(key, kv_cache_dtype), fp8_view(value, kv_cache_dtype)


# --- fp8 bits --------------------------------------------------------------------------------


def fp8_view(cache: Shaped[AnyArray, "*shape"], kv_cache_dtype: str) -> Shaped[AnyArray, "*shape"]:
    """uint8 fp8 bits as the float8 format `kv_cache_dtype` names; `cache` itself for "auto"
    or when it already has that float8 dtype.

    torch and NumPy reinterpret the memory (no copy); JAX bit-casts, a new array unless fused
    into a jitted computation.
    """
    name = _fp8_format(kv_cache_dtype)
    dtype = _dtype_name(cache)
    if name is None or dtype == name:
        return cache
    if dtype != "uint8":
        raise TypeError(
            f"cache.dtype={dtype} must be uint8 (fp8 bits) or {name} for "
            f"kv_cache_dtype={kv_cache_dtype!r}"
        )
    return _bitcast(cache, name)


def fp8_bits(cache: Shaped[AnyArray, "*shape"]) -> Shaped[AnyArray, "*shape"]:
    """A float8 cache as its uint8 bit patterns (vLLM's storage); uint8 comes back as is.

    Same copy behaviour as `fp8_view`.
    """
    dtype = _dtype_name(cache)
    if dtype == "uint8":
        return cache
    if dtype not in _FLOAT8:
        raise TypeError(f"cache.dtype={dtype} must be one of {list(_FLOAT8)} or uint8")
    return _bitcast(cache, "uint8")


# --- checks ----------------------------------------------------------------------------------


def _check_nhd(key_cache, value_cache, kv_cache_dtype: str):
    """Both caches of one framework, `[NB, BS, Hkv, D]`, one dtype; as fp8 bits if declared."""
    if _framework(key_cache, "key_cache") != _framework(value_cache, "value_cache"):
        raise TypeError(
            f"key_cache ({type(key_cache).__name__}) and value_cache "
            f"({type(value_cache).__name__}) must come from the same framework"
        )
    if key_cache.ndim != 4 or tuple(key_cache.shape) != tuple(value_cache.shape):
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, "
            f"head_size], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if _dtype_name(key_cache) != _dtype_name(value_cache):
        raise TypeError(
            f"key_cache.dtype={_dtype_name(key_cache)} and "
            f"value_cache.dtype={_dtype_name(value_cache)} must match"
        )
    if _fp8_format(kv_cache_dtype) is not None:
        key_cache = fp8_bits(fp8_view(key_cache, kv_cache_dtype))
        value_cache = fp8_bits(fp8_view(value_cache, kv_cache_dtype))
    return key_cache, value_cache


def _check_packed(kv_cache, num_kv_heads: int, head_size: int) -> int:
    """The block size of a packed `kv_cache[2, NB, BS*Hkv*D]`."""
    _framework(kv_cache, "kv_cache")
    for name, value in (("num_kv_heads", num_kv_heads), ("head_size", head_size)):
        if not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if kv_cache.ndim != 3 or kv_cache.shape[0] != 2:
        raise ValueError(
            "kv_cache must be [2, num_blocks, block_size * num_kv_heads * head_size], "
            f"got shape {tuple(kv_cache.shape)}"
        )
    per_token = num_kv_heads * head_size
    if kv_cache.shape[2] % per_token:
        raise ValueError(
            f"kv_cache.shape[2]={kv_cache.shape[2]} must be a multiple of "
            f"num_kv_heads * head_size = {num_kv_heads} * {head_size} = {per_token}"
        )
    return kv_cache.shape[2] // per_token


def _vector_width(cache, head_size: int) -> int:
    """vLLM's `x`: elements per 16-byte vector of the key cache."""
    itemsize = _itemsize(cache)
    if 16 % itemsize:
        raise TypeError(
            f"cache.dtype={_dtype_name(cache)} has {itemsize}-byte elements: "
            "vLLM's key layout needs sizes dividing 16"
        )
    x = 16 // itemsize
    if head_size % x:
        raise ValueError(
            f"head_size={head_size} must be a multiple of x=16 // element_size={x} "
            f"for dtype {_dtype_name(cache)}"
        )
    return x


def _fp8_format(kv_cache_dtype: str) -> str | None:
    if kv_cache_dtype == "auto":
        return None
    if kv_cache_dtype not in FP8_KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} must be 'auto' or one of "
            f"{sorted(FP8_KV_CACHE_DTYPES)}"
        )
    return FP8_KV_CACHE_DTYPES[kv_cache_dtype]


# --- one spelling for three frameworks -------------------------------------------------------


def _framework(x, name: str) -> str:
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    if isinstance(x, jax.Array):
        return "jax"
    if isinstance(x, np.ndarray):
        return "numpy"
    raise TypeError(
        f"{name} must be a torch.Tensor, jax.Array or numpy.ndarray, got {type(x).__name__}"
    )


def _permute(x, axes: tuple[int, ...]):
    return x.permute(*axes) if _framework(x, "cache") == "torch" else x.transpose(axes)


def _compact(x):
    """A copy of `x` in compact row-major memory, even where `x` already is compact (a result
    must never alias the caller's cache). JAX arrays are immutable: aliasing cannot show."""
    kind = _framework(x, "cache")
    if kind == "torch":
        return x.clone(memory_format=torch.contiguous_format)
    return np.array(x, order="C", copy=True) if kind == "numpy" else x


def _pack(key, value):
    """`kv_cache[2, NB, ...]` holding `key`, `value` (views of any strides, NB leading) in
    row-major order: one copy, written straight into the result for torch and NumPy."""
    num_blocks = key.shape[0]
    per_block = int(np.prod(key.shape[1:]))
    kind = _framework(key, "cache")
    if kind == "jax":
        # [NB, ...] -> [NB, BS*Hkv*D]; XLA fuses the transposes into the stack
        return jax.numpy.stack([c.reshape(num_blocks, per_block) for c in (key, value)])
    if kind == "torch":
        kv_cache = torch.empty((2, num_blocks, per_block), dtype=key.dtype, device=key.device)
    else:
        kv_cache = np.empty((2, num_blocks, per_block), dtype=key.dtype)
    for half, src in enumerate((key, value)):
        kv_cache[half].reshape(src.shape)[...] = src  # a view of the compact half: no copy
    return kv_cache


def _dtype_name(x) -> str:
    if _framework(x, "cache") == "torch":
        return str(x.dtype).removeprefix("torch.")
    return np.dtype(x.dtype).name


def _itemsize(x) -> int:
    return x.element_size() if _framework(x, "cache") == "torch" else np.dtype(x.dtype).itemsize


def _bitcast(x, name: str):
    """Same bits, same shape, another 1-byte dtype."""
    kind = _framework(x, "cache")
    if kind == "torch":
        return x.view(getattr(torch, name))
    dtype = np.dtype(getattr(ml_dtypes, name, name))
    return x.view(dtype) if kind == "numpy" else jax.lax.bitcast_convert_type(x, dtype)


__all__ = [
    "FP8_KV_CACHE_DTYPES",
    "fp8_bits",
    "fp8_view",
    "ipex_to_nhd",
    "nhd_to_ipex",
    "nhd_to_vllm",
    "vllm_to_nhd",
]

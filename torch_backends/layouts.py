"""Cache layouts: how one layer's `kv_cache[2, NB, BS*Hkv*D]` holds keys and values.

One small object per layout owns everything that depends on it: the views (`split`), the slot
scatter (`store`), the read at (block, offset) (`take`), fp8 quantization and the scales.
`PagedCache` binds a layer's two caches to their layout and the step's scales: the checked
`write` through a slot mapping and the `gather` through block tables, written once for all.

    SplitLayout  vLLM's paged layout (TORCH_SDPA, XFORMERS):
                 key [NB, Hkv, D // x, BS, x] with x = 16 // element_size, value [NB, Hkv, D, BS]
    IpexLayout   IPEX's: key and value [NB, Hkv, BS, D]
    NhdLayout    the JAX core's: key and value [NB, BS, Hkv, D] (the "JAX" backend)

fp8 caches (`kv_cache_dtype` "fp8" / "fp8_e4m3" / "fp8_e5m2") hold `saturate(x / scale)` as
`float8_e4m3fn` / `float8_e5m2` bits; reads multiply by the scale. The packed tensor is uint8,
as vLLM allocates it; `SplitLayout` keeps uint8 views (vLLM's kernels took them so), the other
two view the bytes as the float8 dtype their kernels read. Indexing goes through the bytes, so
it works where torch has no float8 indexing (torch 2.8 on CPU).

Slots: `slot = block * BS + offset`; slot_mapping [35, 2, 17] with block size 16: block 2
offset 3, block 0 offset 2, block 1 offset 1; slots < 0 (PAD_SLOT_ID) write nothing.
"""

import dataclasses
from abc import ABC, abstractmethod

import torch
from jaxtyping import Float, Shaped
from torch import Tensor

from torch_backends import native
from torch_backends.checks import check_slot_mapping
from torch_backends.shapes import BlockTables, KeysValues, SlotMapping

# The fp8 cache dtypes by vLLM's `kv_cache_dtype` strings ("fp8" is e4m3, as in vLLM).
FP8_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

Scale = Tensor | float  # a layer's `_k_scale` / `_v_scale` (tensor) or a Python float


def fp8_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The float8 dtype an fp8 `kv_cache_dtype` string stores; None for "auto"."""
    if kv_cache_dtype == "auto":
        return None
    if kv_cache_dtype not in FP8_DTYPES:
        raise ValueError(
            f"Unsupported KV cache type {kv_cache_dtype!r}: expected 'auto' or one of "
            f"{sorted(FP8_DTYPES)}"
        )
    return FP8_DTYPES[kv_cache_dtype]


def _scale(scale: Scale) -> Tensor | float:
    return scale if isinstance(scale, Tensor) else float(scale)


def quantize(
    x: Float[Tensor, "*shape"], kv_cache_dtype: str, scale: Scale
) -> Shaped[Tensor, "*shape"]:
    """What a cache of `kv_cache_dtype` stores for `x`: uint8 fp8 bits, or `x` unchanged."""
    dtype = fp8_dtype(kv_cache_dtype)
    if dtype is None:
        return x
    info = torch.finfo(dtype)
    scaled = x.float() / _scale(scale)
    return scaled.clamp(info.min, info.max).to(dtype).view(torch.uint8)


def dequantize(
    x: Shaped[Tensor, "*shape"], kv_cache_dtype: str, scale: Scale
) -> Float[Tensor, "*shape"]:
    """Cache contents (uint8 bits or float8 for fp8) as float32 values: `stored * scale`."""
    dtype = fp8_dtype(kv_cache_dtype)
    if dtype is None:
        return x.float()
    return x.view(dtype).float() * _scale(scale)


@dataclasses.dataclass(frozen=True)
class CacheLayout(ABC):
    """One layout of `kv_cache[2, NB, BS*Hkv*D]` for given heads and cache dtype."""

    num_kv_heads: int
    head_size: int
    kv_cache_dtype: str = "auto"

    # View fp8 caches as the float8 dtype (True) or keep the packed tensor's uint8 (False).
    fp8_views = True

    def __post_init__(self):
        fp8_dtype(self.kv_cache_dtype)  # raises on an unknown cache dtype

    @property
    def fp8(self) -> torch.dtype | None:
        return fp8_dtype(self.kv_cache_dtype)

    # -- what each layout says ------------------------------------------------------------

    @abstractmethod
    def _views(self, kv_cache: Tensor) -> tuple[Tensor, Tensor]:
        """`kv_cache[2, NB, BS*Hkv*D]` -> (key_cache, value_cache) in this layout."""

    @abstractmethod
    def block_size(self, key_cache: Tensor) -> int: ...

    @abstractmethod
    def put(self, cache: Tensor, block: Tensor, offset: Tensor, x: Tensor, is_key: bool):
        """`cache[block[t], offset[t]] = x[t]` (`x [T, Hkv, D]`) in this layout, in place."""

    @abstractmethod
    def take(self, cache: Tensor, block: Tensor, offset: Tensor, is_key: bool) -> Tensor:
        """`cache[block[s, l], offset[l]]` -> `[S, L, Hkv, D]`."""

    # -- shared by every layout ------------------------------------------------------------

    def split(self, kv_cache: Shaped[Tensor, "2 num_blocks block_numel"]) -> tuple[Tensor, Tensor]:
        """The key and value caches of a packed `kv_cache`, as views (writes go through)."""
        if self.fp8 is not None and self.fp8_views:
            kv_cache = kv_cache.view(self.fp8)
        return self._views(kv_cache)

    def quantize(self, x: Float[Tensor, "*shape"], scale: Scale) -> Shaped[Tensor, "*shape"]:
        return quantize(x, self.kv_cache_dtype, scale)

    def dequantize(self, stored: Shaped[Tensor, "*shape"], scale: Scale) -> Float[Tensor, "*shape"]:
        return dequantize(stored, self.kv_cache_dtype, scale)

    def read_back(self, x: Float[Tensor, "*shape"], scale: Scale) -> Float[Tensor, "*shape"]:
        """`x` as a read from this cache returns it, in `x`'s dtype (`x` itself unless fp8)."""
        if self.fp8 is None:
            return x
        return self.dequantize(self.quantize(x, scale), scale).to(x.dtype)

    def scales(self, k_scale: Scale, v_scale: Scale) -> tuple[float, float]:
        """The (key, value) scales as floats; (1.0, 1.0) for a cache that is not fp8."""
        if self.fp8 is None:
            return 1.0, 1.0
        return float(k_scale), float(v_scale)

    def raw(self, cache: Tensor) -> Tensor:
        """`cache` as its element type for indexing: uint8 bits when fp8."""
        return cache.view(torch.uint8) if self.fp8 is not None else cache

    def store(
        self, key_cache: Tensor, value_cache: Tensor, slots: Tensor, key: Tensor, value: Tensor
    ) -> None:
        """Put already-quantized rows `[T, Hkv, D]` at valid slots (`PagedCache.write`'s
        scatter: the pads are dropped before it)."""
        block_size = self.block_size(key_cache)
        block, offset = slots // block_size, slots % block_size
        for cache, x, is_key in ((key_cache, key, True), (value_cache, value, False)):
            raw = self.raw(cache)
            self.put(raw, block, offset, x.to(raw.dtype), is_key)


class SplitLayout(CacheLayout):
    """vLLM's paged layout: key `[NB, Hkv, D // x, BS, x]`, value `[NB, Hkv, D, BS]`, with
    x = 16 // element_size (16 bytes per vector); the key of token `offset` in block `b`,
    head `h`, dim `d` is `key_cache[b, h, d // x, offset, d % x]`."""

    fp8_views = False  # vLLM's kernels read the uint8 cache

    def _views(self, kv_cache):
        x = 16 // kv_cache.element_size()
        num_blocks, hkv, d = kv_cache.shape[1], self.num_kv_heads, self.head_size
        key_cache = kv_cache[0].view(num_blocks, hkv, d // x, -1, x)
        value_cache = kv_cache[1].view(num_blocks, hkv, d, -1)
        return key_cache, value_cache

    def block_size(self, key_cache):
        return key_cache.shape[3]

    def store(self, key_cache, value_cache, slots, key, value):
        """The native scatter (`torch_backends.native.store_split`) on CPU, else torch's."""
        if (
            key_cache.device.type == "cpu"
            and key.device.type == "cpu"
            and key_cache.is_contiguous()
            and value_cache.is_contiguous()
            and native.available()
        ):
            raw = self.raw(key_cache)
            native.store_split(key.to(raw.dtype), value.to(raw.dtype), raw,
                               self.raw(value_cache), slots)  # fmt: skip
            return
        super().store(key_cache, value_cache, slots, key, value)

    def put(self, cache, block, offset, x, is_key):
        if is_key:  # cache[b, :, :, o, :] is [T, Hkv, D // x, x] under advanced indexing
            cache[block, :, :, offset, :] = x.reshape(*x.shape[:2], -1, cache.shape[-1])
        else:
            cache[block, :, :, offset] = x  # [T, Hkv, D]

    def take(self, cache, block, offset, is_key):
        if is_key:  # [S, L, Hkv, D // x, x] -> [S, L, Hkv, D]
            k = cache[block, :, :, offset[None, :], :]
            return k.reshape(*block.shape, self.num_kv_heads, self.head_size)
        return cache[block, :, :, offset[None, :]]  # [S, L, Hkv, D]


class IpexLayout(CacheLayout):
    """IPEX's layout: key and value `[NB, Hkv, BS, D]` (vLLM's `_IPEXPagedAttention`)."""

    def _views(self, kv_cache):
        shape = (kv_cache.shape[1], self.num_kv_heads, -1, self.head_size)
        return kv_cache[0].view(shape), kv_cache[1].view(shape)

    def block_size(self, key_cache):
        return key_cache.shape[2]

    def put(self, cache, block, offset, x, is_key):
        cache[block, :, offset] = x  # [T, Hkv, D]

    def take(self, cache, block, offset, is_key):
        return cache[block, :, offset]  # advanced indices first: [S, L, Hkv, D]


class NhdLayout(CacheLayout):
    """The JAX core's layout: key and value `[NB, BS, Hkv, D]`."""

    def _views(self, kv_cache):
        shape = (kv_cache.shape[1], -1, self.num_kv_heads, self.head_size)
        return kv_cache[0].view(shape), kv_cache[1].view(shape)

    def block_size(self, key_cache):
        return key_cache.shape[1]

    def put(self, cache, block, offset, x, is_key):
        cache[block, offset] = x  # [T, Hkv, D]

    def take(self, cache, block, offset, is_key):
        return cache[block, offset]  # [S, L, Hkv, D]


@dataclasses.dataclass(frozen=True)
class PagedCache:
    """One layer's key and value caches in their layout, with the step's fp8 scales."""

    layout: CacheLayout
    key_cache: Tensor
    value_cache: Tensor
    k_scale: Scale = 1.0
    v_scale: Scale = 1.0

    @classmethod
    def of(cls, layout: CacheLayout, kv_cache: Tensor, k_scale: Scale = 1.0, v_scale: Scale = 1.0):
        key_cache, value_cache = layout.split(kv_cache)
        return cls(layout, key_cache, value_cache, k_scale, v_scale)

    @property
    def block_size(self) -> int:
        return self.layout.block_size(self.key_cache)

    @property
    def scales(self) -> tuple[float, float]:
        """(k_scale, v_scale) as floats; (1.0, 1.0) for a cache that is not fp8."""
        return self.layout.scales(self.k_scale, self.v_scale)

    def write(
        self, key: KeysValues, value: KeysValues, slot_mapping: SlotMapping, *, check: bool = True
    ) -> None:
        """Scatter `key[t]`, `value[t]` to slot `slot_mapping[t]`, in place (quantized for
        fp8). Slots of -1 (PAD_SLOT_ID) are skipped; nothing else in the caches changes.
        The slots are checked first (`checks.check_slot_mapping`: in range, -1 the only
        negative, none twice) unless `check=False` (the caller checked them already)."""
        layout, num_blocks, block_size = self.layout, self.key_cache.shape[0], self.block_size
        if key.shape[1:] != (layout.num_kv_heads, layout.head_size):
            raise ValueError(
                f"key has shape {tuple(key.shape)}, expected [num_tokens, "
                f"{layout.num_kv_heads}, {layout.head_size}] to match the cache"
            )
        if value.shape != key.shape:
            raise ValueError(f"value has shape {tuple(value.shape)}, key {tuple(key.shape)}")
        if check:
            check_slot_mapping("slot_mapping", slot_mapping, key.shape[0], num_blocks, block_size)
        slots = slot_mapping.flatten().long()
        keep = slots >= 0
        key = layout.quantize(key[keep], self.k_scale)
        value = layout.quantize(value[keep], self.v_scale)
        layout.store(self.key_cache, self.value_cache, slots[keep], key, value)

    def read_back(self, key: KeysValues, value: KeysValues) -> tuple[KeysValues, KeysValues]:
        """The new K/V as this cache returns them (rounded through fp8 when fp8)."""
        return self.layout.read_back(key, self.k_scale), self.layout.read_back(value, self.v_scale)

    def gather(
        self, block_tables: BlockTables, kv_len: int
    ) -> tuple[
        Float[Tensor, "num_seqs kv_len num_kv_heads head_size"],
        Float[Tensor, "num_seqs kv_len num_kv_heads head_size"],
    ]:
        """Keys and values of positions `0..kv_len-1` of every sequence, float32.

        Positions past a sequence's end hold whatever the cache holds there (possibly NaN):
        callers mask them. block_tables [[3, 7]], block size 16, kv_len 20: positions 0-15
        from block 3, 16-19 from block 7 offsets 0-3.
        """
        layout, block_size = self.layout, self.block_size
        pos = torch.arange(kv_len, device=block_tables.device)
        logical = (pos // block_size).clamp(max=max(block_tables.shape[1] - 1, 0))
        block = block_tables.long()[:, logical]  # [S, L]
        offset = pos % block_size  # [L]
        k = layout.take(layout.raw(self.key_cache), block, offset, is_key=True)
        v = layout.take(layout.raw(self.value_cache), block, offset, is_key=False)
        return layout.dequantize(k, self.k_scale), layout.dequantize(v, self.v_scale)

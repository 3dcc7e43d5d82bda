"""The paged KV cache: layout, writes through a slot mapping, block copies and swaps.

Layout ("NHD"): `key_cache` and `value_cache` are separate arrays of shape
`[num_blocks, block_size, num_kv_heads, head_size]`. Token `p` of a sequence whose block table
row is `bt` lives at `cache[bt[p // BS], p % BS]`; its *slot* is `bt[p // BS] * BS + p % BS`.

    slot_mapping [35, 2, 17, -1] with block size 16:
        35 -> block 2 offset 3, 2 -> block 0 offset 2, 17 -> block 1 offset 1, -1 -> no write

An fp8 cache (`float8_e4m3fn`, `float8_e5m2`) stores `saturate(x / scale)` and is read back as
`stored * scale`; every other float cache stores `x` in its own dtype.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jax_attn import value_rules
from jax_attn.shape_rules import check_cache_pair, check_index_array, check_scale, is_fp8

KVCache = Float[Array, "num_blocks block_size num_kv_heads head_size"]


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
) -> tuple[int, ...]:
    """Shape of each of `key_cache` and `value_cache`: `(NB, BS, Hkv, D)`."""
    for name, value in dict(
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
    ).items():
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive int")
    return (num_blocks, block_size, num_kv_heads, head_size)


def _split(a: Array) -> tuple[Array, Array]:
    """Veltkamp's split of float32 `a` into hi + lo, each with at most 12 significant bits."""
    c = a * jnp.float32(4097.0)
    hi = c - (c - a)
    return hi, a - hi


def _divide_exactly(x: Array, s: Array) -> Array:
    """`x / s` rounded as IEEE float32 division rounds it (what NumPy and torch compute).

    XLA:CPU's float32 division is off by an ulp for some operands (-0.170625 / 0.42 gives
    -0.40625, the true quotient is -0.4062500155), and an ulp across a tie between two fp8
    numbers moves the stored value a whole fp8 step (found by `jax-attn fuzz`). One correction
    step with the exact remainder fixes it: q0 * s = p + e exactly (Dekker's product), so
    x - q0 * s = (x - p) - e, and q0 + (x - q0 * s) / s rounds to the IEEE quotient.
    """
    q0 = x / s
    p = q0 * s
    qh, ql = _split(q0)
    sh, sl = _split(s)
    e = ((qh * sh - p) + qh * sl + ql * sh) + ql * sl
    q = q0 + ((x - p) - e) / s
    # Keep q0 where the step cannot help: zeros (their sign) and huge |q0| (the split overflows).
    return jnp.where((q0 == 0) | ~jnp.isfinite(q), q0, q)


def quantize(x: Array, dtype, scale) -> Array:
    """`x` as stored in a cache of `dtype`: `saturate(x / scale)` for fp8, a cast otherwise."""
    dtype = jnp.dtype(dtype)
    if not is_fp8(dtype):
        return x.astype(dtype)
    finfo = jnp.finfo(dtype)
    scaled = _divide_exactly(x.astype(jnp.float32), jnp.asarray(scale, jnp.float32))
    # fp8 has no infinities in e4m3fn and a cast would overflow to NaN: saturate first.
    return jnp.clip(scaled, float(finfo.min), float(finfo.max)).astype(dtype)


def dequantize(x: Array, scale, dtype=jnp.float32) -> Array:
    """Cache contents as `dtype`: `stored * scale` (the scale is 1.0 for non-fp8 caches)."""
    return x.astype(dtype) * jnp.asarray(scale, dtype)


def write_kv(
    key_cache: KVCache,
    value_cache: KVCache,
    key: Float[Array, "num_tokens num_kv_heads head_size"],
    value: Float[Array, "num_tokens num_kv_heads head_size"],
    slot_mapping: Int[Array, " num_tokens"],
    *,
    k_scale: float | Float[Array, ""] = 1.0,
    v_scale: float | Float[Array, ""] = 1.0,
    check: bool | None = None,
) -> tuple[KVCache, KVCache]:
    """Scatter `key[t]`, `value[t]` into slot `slot_mapping[t]`; slots equal to -1 write nothing.

    Returns the updated caches. Jitted callers should donate the caches
    (`jax.jit(..., donate_argnums=(0, 1))`) so the update happens in place.

    `check` (default `jax_attn.config.check`, on): with concrete slots and scales, raise
    `ValueError` before writing anything when a slot is past the cache or below -1, a slot
    appears twice, or a scale is not finite and > 0. Under `jit` the checks run only inside
    `jax_attn.checked`; unchecked, bad slots are dropped (never wrapped).
    """
    if value_rules.wanted(check):
        _check_write_shapes(key_cache, value_cache, key, value, slot_mapping)
        check_scale(k_scale, "k_scale")
        check_scale(v_scale, "v_scale")
        ok = value_rules.run_checks(
            _write_rules,
            dict(slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale),
            check,
            num_slots=key_cache.shape[0] * key_cache.shape[1],
        )
        if ok is not None:  # inside `checked`: a refused step writes nothing
            slot_mapping = jnp.where(ok, slot_mapping, -1)
    return _write_kv(
        key_cache, value_cache, key, value, slot_mapping, k_scale=k_scale, v_scale=v_scale
    )


def _write_rules(xp, *, slot_mapping, k_scale, v_scale, num_slots):
    yield from value_rules.slot_rules(xp, slot_mapping=slot_mapping, num_slots=num_slots)
    yield from value_rules.scale_rules(xp, k_scale=k_scale, v_scale=v_scale)


def _check_write_shapes(key_cache, value_cache, key, value, slot_mapping) -> None:
    check_cache_pair(key_cache, value_cache)
    num_kv_heads, head_size = key_cache.shape[2:]
    if key.shape != value.shape or key.ndim != 3 or key.shape[1:] != (num_kv_heads, head_size):
        raise ValueError(
            f"key/value must be [num_tokens, {num_kv_heads}, {head_size}] to match the cache, "
            f"got key.shape={key.shape}, value.shape={value.shape}"
        )
    check_index_array(slot_mapping, "slot_mapping", [("num_tokens", None)])
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries but key has {key.shape[0]} tokens"
        )


@jax.jit
def _write_kv(key_cache, value_cache, key, value, slot_mapping, *, k_scale, v_scale):
    _check_write_shapes(key_cache, value_cache, key, value, slot_mapping)
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    num_slots = num_blocks * block_size
    # JAX wraps negative indices even with mode="drop": send pads (and, unchecked, any other
    # negative slot) past the end instead.
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping.astype(jnp.int32))

    def scatter(cache, x, scale):
        flat = cache.reshape(num_slots, num_kv_heads, head_size)  # [NB*BS, Hkv, D]
        flat = flat.at[slots].set(quantize(x, cache.dtype, scale), mode="drop")
        return flat.reshape(cache.shape)

    return scatter(key_cache, key, k_scale), scatter(value_cache, value, v_scale)


def copy_blocks(
    key_cache: KVCache,
    value_cache: KVCache,
    src_to_dst: Int[Array, "num_pairs 2"],
    *,
    check: bool | None = None,
) -> tuple[KVCache, KVCache]:
    """Copy whole blocks `src_to_dst[i, 0] -> src_to_dst[i, 1]` in both caches (copy-on-write).

    All sources are read before any destination is written, so chains (a->b, b->c) copy the
    old contents of b. `check` (default on, see `write_kv`): with concrete pairs, raise
    `ValueError` before copying when an id is outside `[0, num_blocks)` (a negative id would
    wrap to the last blocks) or a destination appears twice. Unchecked (under a plain `jit`),
    pairs with an out-of-range id are dropped whole, never wrapped.
    """
    if value_rules.wanted(check):
        check_cache_pair(key_cache, value_cache)
        src_to_dst = _pairs(src_to_dst)
        n = key_cache.shape[0]
        ok = value_rules.run_checks(
            value_rules.pair_rules, dict(src_to_dst=src_to_dst), check, num_src=n, num_dst=n
        )
        if ok is not None:  # inside `checked`: a refused copy copies nothing
            src_to_dst = jnp.where(ok, src_to_dst, -1)
    return _copy_blocks(key_cache, value_cache, src_to_dst)


def _pairs(src_to_dst):
    src_to_dst = jnp.asarray(src_to_dst) if isinstance(src_to_dst, list | tuple) else src_to_dst
    if jnp.ndim(src_to_dst) == 1 and jnp.shape(src_to_dst)[0] == 0:
        src_to_dst = jnp.zeros((0, 2), jnp.int32)
    check_index_array(src_to_dst, "src_to_dst", [("num_pairs", None), ("2", 2)])
    return src_to_dst


@jax.jit
def _copy_blocks(key_cache, value_cache, src_to_dst):
    check_cache_pair(key_cache, value_cache)
    check_index_array(src_to_dst, "src_to_dst", [("num_pairs", None), ("2", 2)])
    num_blocks = key_cache.shape[0]
    src, dst = _valid_pairs(src_to_dst, num_blocks, num_blocks)
    return (
        key_cache.at[dst].set(key_cache[src], mode="drop"),
        value_cache.at[dst].set(value_cache[src], mode="drop"),
    )


def _valid_pairs(src_to_dst, num_src: int, num_dst: int):
    """(src, dst) with every pair that has an id out of range sent past the end of the
    destination (dropped): JAX would wrap a negative id and clamp a large source."""
    src, dst = src_to_dst[:, 0].astype(jnp.int32), src_to_dst[:, 1].astype(jnp.int32)
    ok = (src >= 0) & (src < num_src) & (dst >= 0) & (dst < num_dst)
    return jnp.where(ok, src, 0), jnp.where(ok, dst, num_dst)


def swap_blocks(
    src_cache: KVCache,
    dst_cache: KVCache,
    src_to_dst: Int[Array, "num_pairs 2"],
    *,
    check: bool | None = None,
) -> KVCache:
    """`dst_cache` with blocks `src_to_dst[i, 1]` replaced by `src_cache[src_to_dst[i, 0]]`.

    The caches may live on different devices or memory kinds (e.g. device HBM and pinned host
    memory): the selected source blocks are gathered where they live, moved once to the
    destination's placement, and scattered there. On a single CPU it is a plain copy.
    `check` (default on): as `copy_blocks`, sources in `[0, src_cache.shape[0])` and
    destinations in `[0, dst_cache.shape[0])`, each destination once.
    """
    if src_cache.ndim != dst_cache.ndim or src_cache.shape[1:] != dst_cache.shape[1:]:
        raise ValueError(
            f"src_cache.shape={src_cache.shape} and dst_cache.shape={dst_cache.shape} must "
            "agree except in num_blocks"
        )
    if src_cache.dtype != dst_cache.dtype:
        raise TypeError(f"src_cache.dtype={src_cache.dtype} != dst_cache.dtype={dst_cache.dtype}")
    src_to_dst = _pairs(jnp.asarray(src_to_dst))
    if value_rules.wanted(check):
        value_rules.run_checks(
            value_rules.pair_rules,
            dict(src_to_dst=src_to_dst),
            check,
            num_src=src_cache.shape[0],
            num_dst=dst_cache.shape[0],
        )
    src, dst = _valid_pairs(src_to_dst, src_cache.shape[0], dst_cache.shape[0])
    src_ids = jax.device_put(src, _placement(src_cache))
    blocks = _gather_blocks(src_cache, src_ids)  # [N, BS, Hkv, D] where src lives
    blocks = jax.device_put(blocks, _placement(dst_cache))
    dst_ids = jax.device_put(dst, _placement(dst_cache))
    return _scatter_blocks(dst_cache, dst_ids, blocks)


def _placement(x: Array) -> jax.sharding.Sharding:
    """Where a single-device array lives, memory kind included (device or pinned host)."""
    (device,) = x.devices()
    return jax.sharding.SingleDeviceSharding(device, memory_kind=x.sharding.memory_kind)


@jax.jit
def _gather_blocks(cache: Array, ids: Array) -> Array:
    return cache[ids]


@jax.jit
def _scatter_blocks(cache: Array, ids: Array, blocks: Array) -> Array:
    return cache.at[ids].set(blocks, mode="drop")

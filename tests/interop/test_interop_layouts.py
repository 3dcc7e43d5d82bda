"""interop.layouts: round trips in every framework, the element index rules written out by hand,
agreement with the torch backends' own cache ops, and fp8 bits kept exactly."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from interop import layouts
from torch_backends.paged_attn import PagedAttention

# (NB, BS, Hkv, D): odd block counts, block sizes 1 / 8 / 16, GQA-ish head counts, and head
# sizes that are multiples of 16 (x = 16 for 1-byte dtypes) but not all powers of two.
SHAPES = [(3, 8, 2, 64), (2, 16, 1, 128), (5, 1, 7, 80), (1, 3, 3, 16)]
DTYPES = ["float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "uint8"]
FRAMEWORKS = ["torch", "jax", "numpy"]
CONVERTERS = {
    "vllm": (layouts.nhd_to_vllm, layouts.vllm_to_nhd),
    "ipex": (layouts.nhd_to_ipex, layouts.ipex_to_nhd),
}


def _bits(x) -> np.ndarray:
    """The raw bytes of any cache as uint8 NumPy (exact, NaN patterns included)."""
    if isinstance(x, torch.Tensor):
        return x.contiguous().view(torch.uint8).numpy()
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8)


def _dtype(x) -> str:
    if isinstance(x, torch.Tensor):
        return str(x.dtype).removeprefix("torch.")
    return np.dtype(x.dtype).name


def _cache(rng, shape, dtype: str, framework: str):
    """Random cache values in the requested dtype and framework (NumPy holds the truth)."""
    if dtype == "uint8":
        values = rng.integers(0, 256, size=shape, dtype=np.uint8)
    else:
        values = (rng.standard_normal(shape) * 4).astype(np.dtype(getattr(ml_dtypes, dtype, dtype)))
    if framework == "numpy":
        return values
    if framework == "jax":
        return jnp.asarray(values)
    # torch has no NumPy interop for bf16 / fp8: go through the bits
    bits = torch.from_numpy(values.view(np.uint8).copy())
    return bits.view(getattr(torch, dtype)).reshape(shape)


# Every shape and dtype in torch and NumPy; JAX (slow eagerly: one compile per op and shape)
# on a subset, since its converters run the same code.
ROUND_TRIPS = [
    pytest.param(shape, dtype, framework, id=f"{'x'.join(map(str, shape))}-{dtype}-{framework}")
    for framework in FRAMEWORKS
    for shape in (SHAPES[:2] if framework == "jax" else SHAPES)
    for dtype in (("float32", "bfloat16", "float8_e5m2") if framework == "jax" else DTYPES)
]


@pytest.mark.parametrize("shape, dtype, framework", ROUND_TRIPS)
@pytest.mark.parametrize("layout", sorted(CONVERTERS))
def test_round_trip(layout, shape, dtype, framework, rng):
    to_packed, from_packed = CONVERTERS[layout]
    key, value = (_cache(rng, shape, dtype, framework) for _ in range(2))
    kv = to_packed(key, value)
    num_blocks, block_size, num_kv_heads, head_size = shape
    assert type(kv) is type(key)
    assert tuple(kv.shape) == (2, num_blocks, block_size * num_kv_heads * head_size)
    k2, v2 = from_packed(kv, num_kv_heads, head_size)
    for got, want in ((k2, key), (v2, value)):
        assert tuple(got.shape) == shape and _dtype(got) == dtype
        np.testing.assert_array_equal(_bits(got), _bits(want))
    if framework == "torch":
        assert k2.is_contiguous() and v2.is_contiguous()
        assert k2.data_ptr() != kv.data_ptr()  # documented: a copy, not a view of kv_cache


def _flat_index(layout: str, half: int, shape, x: int, b, o, h, d):
    """Where element (block b, offset o, head h, dim d) sits inside kv_cache[half, b]."""
    _, block_size, _, head_size = shape
    if layout == "ipex":
        return (h * block_size + o) * head_size + d
    if half == 0:  # vLLM key: [Hkv, D // x, BS, x]
        return ((h * (head_size // x) + d // x) * block_size + o) * x + d % x
    return (h * head_size + d) * block_size + o  # vLLM value: [Hkv, D, BS]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "uint8"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layout", sorted(CONVERTERS))
def test_index_rule(layout, shape, dtype, rng):
    key, value = (_cache(rng, shape, dtype, "numpy") for _ in range(2))
    kv = CONVERTERS[layout][0](key, value)
    x = 16 // key.dtype.itemsize
    # every element, by the formula in the module docstring
    b, o, h, d = np.indices(shape).reshape(4, -1)
    for half, cache in enumerate((key, value)):
        flat = _flat_index(layout, half, shape, x, b, o, h, d)
        np.testing.assert_array_equal(kv[half, b, flat], cache[b, o, h, d])


def test_docstring_example():
    shape = (1, 16, 1, 64)
    assert _flat_index("vllm", 0, shape, 8, 0, 3, 0, 10) == 154


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_agrees_with_vllm_split_kv_cache(shape, rng):
    # PagedAttention.split_kv_cache's views index the token the core layout holds.
    key, value = (_cache(rng, shape, "bfloat16", "torch") for _ in range(2))
    kv = layouts.nhd_to_vllm(key, value)
    _, _, num_kv_heads, head_size = shape
    key_view, value_view = PagedAttention.split_kv_cache(kv, num_kv_heads, head_size)
    # [NB, Hkv, D // x, BS, x] -> [NB, BS, Hkv, D]
    assert torch.equal(key_view.permute(0, 3, 1, 2, 4).reshape(shape), key)
    assert torch.equal(value_view.permute(0, 3, 1, 2), value)  # [NB, Hkv, D, BS] -> core


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e5m2"])
def test_agrees_with_vllm_cache_write(kv_cache_dtype, rng):
    # Tokens written by vLLM's op land where the core's layout puts them.
    num_blocks, block_size, num_kv_heads, head_size = 4, 8, 2, 32
    num_tokens = 11
    kv = torch.full(
        (2, num_blocks, block_size * num_kv_heads * head_size),
        255 if kv_cache_dtype != "auto" else 0,
        dtype=torch.uint8 if kv_cache_dtype != "auto" else torch.float32,
    )
    key_view, value_view = PagedAttention.split_kv_cache(kv, num_kv_heads, head_size)
    key = torch.from_numpy(rng.standard_normal((num_tokens, num_kv_heads, head_size))).float()
    value = torch.from_numpy(rng.standard_normal((num_tokens, num_kv_heads, head_size))).float()
    slots = torch.from_numpy(rng.permutation(num_blocks * block_size)[:num_tokens])
    slots[3] = -1  # PAD_SLOT_ID: writes nothing
    PagedAttention.write_to_paged_cache(
        key, value, key_view, value_view, slots, kv_cache_dtype, 1.0, 1.0
    )
    key_cache, value_cache = layouts.vllm_to_nhd(
        kv, num_kv_heads, head_size, kv_cache_dtype=kv_cache_dtype
    )
    dtype = {"auto": torch.float32, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
    assert key_cache.dtype == dtype[kv_cache_dtype]
    for t in range(num_tokens):
        slot = int(slots[t])
        if slot < 0:
            continue
        b, o = divmod(slot, block_size)
        for got, want in ((key_cache[b, o], key[t]), (value_cache[b, o], value[t])):
            assert torch.equal(got, want.to(got.dtype))


@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: "x".join(map(str, s)))
def test_agrees_with_ipex_split_kv_cache(shape, rng):
    key, value = (_cache(rng, shape, "float32", "torch") for _ in range(2))
    kv = layouts.nhd_to_ipex(key, value)
    num_blocks, _, num_kv_heads, head_size = shape
    # IPEX's split (vLLM's _IPEXPagedAttention): each half viewed as [NB, Hkv, BS, D].
    for half, cache in enumerate((key, value)):
        view = kv[half].view(num_blocks, num_kv_heads, -1, head_size)
        assert torch.equal(view.transpose(1, 2), cache)


@pytest.mark.ipex
def test_agrees_with_ipex_backend_split_kv_cache(rng):
    # Runs in the IPEX environment only (torch_backends.ipex_attn needs IPEX 2.8 and torch 2.8).
    ipex_attn = pytest.importorskip("torch_backends.ipex_attn", exc_type=ImportError)
    shape = (3, 8, 2, 64)
    key, value = (_cache(rng, shape, "float32", "torch") for _ in range(2))
    kv = layouts.nhd_to_ipex(key, value)
    _, _, num_kv_heads, head_size = shape
    split = ipex_attn.IpexAttnBackend.split_kv_cache(kv, num_kv_heads, head_size)
    assert torch.equal(split[0].transpose(1, 2), key) and torch.equal(
        split[1].transpose(1, 2), value
    )


@pytest.mark.parametrize("layout", sorted(CONVERTERS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_frameworks_agree(layout, dtype, rng):
    shape = (3, 8, 2, 64)
    key, value = (_cache(rng, shape, dtype, "numpy") for _ in range(2))
    outs = []
    for framework in FRAMEWORKS:
        if framework == "numpy":
            k, v = key, value
        elif framework == "jax":
            k, v = jnp.asarray(key), jnp.asarray(value)
        else:
            k, v = (
                torch.from_numpy(a.view(np.uint8)).view(getattr(torch, dtype)) for a in (key, value)
            )
        outs.append(_bits(CONVERTERS[layout][0](k, v)))
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


@settings(max_examples=40, deadline=None)
@given(
    num_blocks=st.integers(0, 4),
    block_size=st.integers(1, 17),
    num_kv_heads=st.integers(1, 5),
    vectors=st.integers(1, 4),
    dtype=st.sampled_from(["float32", "float16", "uint8"]),
    layout=st.sampled_from(sorted(CONVERTERS)),
)
def test_round_trip_any_shape(num_blocks, block_size, num_kv_heads, vectors, dtype, layout):
    head_size = vectors * 16 // np.dtype(dtype).itemsize
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    rng = np.random.default_rng(sum(shape))
    key, value = (_cache(rng, shape, dtype, "numpy") for _ in range(2))
    to_packed, from_packed = CONVERTERS[layout]
    k2, v2 = from_packed(to_packed(key, value), num_kv_heads, head_size)
    np.testing.assert_array_equal(k2, key)
    np.testing.assert_array_equal(v2, value)


# --- fp8 ---------------------------------------------------------------------------------------

FP8 = [("fp8", "float8_e4m3fn"), ("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")]


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("kv_cache_dtype, fmt", FP8, ids=[n for n, _ in FP8])
def test_fp8_view_and_bits(kv_cache_dtype, fmt, framework, rng):
    bits = _cache(rng, (64,), "uint8", framework)  # every bit pattern, NaNs included
    as_fp8 = layouts.fp8_view(bits, kv_cache_dtype)
    assert _dtype(as_fp8) == fmt
    np.testing.assert_array_equal(_bits(as_fp8), _bits(bits))
    assert layouts.fp8_view(as_fp8, kv_cache_dtype) is as_fp8  # already that format
    back = layouts.fp8_bits(as_fp8)
    assert _dtype(back) == "uint8"
    np.testing.assert_array_equal(_bits(back), _bits(bits))
    assert layouts.fp8_view(bits, "auto") is bits and layouts.fp8_bits(bits) is bits
    if framework == "torch":
        assert as_fp8.data_ptr() == bits.data_ptr()  # a reinterpretation, not a copy


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("kv_cache_dtype, fmt", FP8, ids=[n for n, _ in FP8])
@pytest.mark.parametrize("layout", sorted(CONVERTERS))
def test_fp8_caches_through_layouts(layout, kv_cache_dtype, fmt, framework, rng):
    # float8 core caches -> uint8 bits as vLLM stores them -> float8 core caches, bit-exact;
    # uint8 bits in give the same packed cache as real float8 in.
    shape = (3, 4, 2, 32)
    key, value = (_cache(rng, shape, fmt, framework) for _ in range(2))
    to_packed, from_packed = CONVERTERS[layout]
    kv = to_packed(key, value, kv_cache_dtype=kv_cache_dtype)
    assert _dtype(kv) == "uint8"
    same = to_packed(layouts.fp8_bits(key), layouts.fp8_bits(value), kv_cache_dtype=kv_cache_dtype)
    np.testing.assert_array_equal(_bits(same), _bits(kv))
    k2, v2 = from_packed(kv, 2, 32, kv_cache_dtype=kv_cache_dtype)
    assert _dtype(k2) == fmt and _dtype(v2) == fmt
    np.testing.assert_array_equal(_bits(k2), _bits(key))
    np.testing.assert_array_equal(_bits(v2), _bits(value))
    # "auto" keeps a real float8 cache as float8, with the same bytes
    auto = to_packed(key, value)
    assert _dtype(auto) == fmt
    np.testing.assert_array_equal(_bits(auto), _bits(kv))


# --- errors ------------------------------------------------------------------------------------


def test_errors():
    f32 = torch.zeros(2, 8, 1, 16)
    with pytest.raises(
        ValueError, match=r"kv_cache must be \[2, num_blocks, .*got shape \(3, 2, 8\)"
    ):
        layouts.vllm_to_nhd(torch.zeros(3, 2, 8), 1, 8)
    with pytest.raises(ValueError, match=r"kv_cache\.shape\[2\]=12 must be a multiple of .* = 8"):
        layouts.ipex_to_nhd(torch.zeros(2, 2, 12), 1, 8)
    with pytest.raises(ValueError, match=r"num_kv_heads=0 must be a positive int"):
        layouts.vllm_to_nhd(torch.zeros(2, 2, 8), 0, 8)
    with pytest.raises(ValueError, match=r"head_size=2\.0 must be a positive int"):
        layouts.ipex_to_nhd(torch.zeros(2, 2, 8), 1, 2.0)
    with pytest.raises(ValueError, match=r"must both be .*got \(2, 8, 1, 16\) and \(2, 8, 1, 8\)"):
        layouts.nhd_to_vllm(f32, torch.zeros(2, 8, 1, 8))
    with pytest.raises(ValueError, match=r"must both be \[num_blocks"):
        layouts.nhd_to_ipex(torch.zeros(8, 16), torch.zeros(8, 16))
    with pytest.raises(TypeError, match=r"key_cache\.dtype=float32 and value_cache\.dtype=float16"):
        layouts.nhd_to_vllm(f32, f32.half())
    with pytest.raises(TypeError, match=r"key_cache \(Tensor\) and value_cache \(ndarray\)"):
        layouts.nhd_to_ipex(f32, f32.numpy())
    with pytest.raises(TypeError, match=r"key_cache must be a torch\.Tensor, .* got list"):
        layouts.nhd_to_vllm([[1]], f32)
    with pytest.raises(ValueError, match=r"head_size=6 must be a multiple of x=16 // element"):
        layouts.nhd_to_vllm(torch.zeros(2, 8, 1, 6), torch.zeros(2, 8, 1, 6))
    with pytest.raises(ValueError, match=r"head_size=4 must be a multiple of x=.*=8"):
        layouts.vllm_to_nhd(torch.zeros(2, 2, 8, dtype=torch.bfloat16), 1, 4)
    with pytest.raises(TypeError, match=r"cache\.dtype=void24 has 3-byte elements"):
        layouts.nhd_to_vllm(*(np.zeros((1, 1, 1, 1), dtype="V3"),) * 2)
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8' must be 'auto' or one of"):
        layouts.fp8_view(torch.zeros(3, dtype=torch.uint8), "int8")
    with pytest.raises(TypeError, match=r"cache\.dtype=float8_e5m2 must be uint8 .* float8_e4m3fn"):
        layouts.fp8_view(torch.zeros(3, dtype=torch.float8_e5m2), "fp8")
    with pytest.raises(TypeError, match=r"cache\.dtype=float32 must be uint8"):
        layouts.nhd_to_vllm(f32, f32, kv_cache_dtype="fp8_e4m3")
    with pytest.raises(TypeError, match=r"cache\.dtype=bfloat16 must be one of"):
        layouts.fp8_bits(jnp.zeros(3, jnp.bfloat16))

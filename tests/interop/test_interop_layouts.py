"""interop.layouts: round trips, and agreement with the torch backends' own index rules."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from interop import layouts
from torch_backends.paged_attn import PagedAttention

SHAPES = [(3, 8, 2, 64), (2, 16, 1, 128), (4, 1, 4, 80)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8], ids=str)
def test_vllm_round_trip_and_index_rule(shape, dtype, rng):
    key = torch.from_numpy(rng.integers(0, 200, size=shape)).to(dtype)
    value = torch.from_numpy(rng.integers(0, 200, size=shape)).to(dtype)
    kv = layouts.nhd_to_vllm(key, value)
    nb, bs, hkv, d = shape
    assert kv.shape == (2, nb, bs * hkv * d)
    k2, v2 = layouts.vllm_to_nhd(kv, hkv, d)
    assert torch.equal(k2, key) and torch.equal(v2, value)
    # The split views vLLM's ops use index the same token the core layout holds.
    key_cache, value_cache = PagedAttention.split_kv_cache(kv, hkv, d)
    b, o = nb - 1, bs - 1
    assert torch.equal(key_cache[b, :, :, o, :].reshape(hkv, d), key[b, o])
    assert torch.equal(value_cache[b, :, :, o], value[b, o])


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_ipex_round_trip(shape, rng):
    key = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
    value = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
    kv = layouts.nhd_to_ipex(key, value)
    nb, bs, hkv, d = shape
    assert torch.equal(kv[0].view(nb, hkv, bs, d)[1 % nb, :, 0], key[1 % nb, 0])
    k2, v2 = layouts.ipex_to_nhd(kv, hkv, d)
    assert torch.equal(k2, key) and torch.equal(v2, value)


def test_jax_arrays_round_trip(rng):
    key = jnp.asarray(rng.standard_normal((3, 8, 2, 64)).astype(np.float32))
    value = key + 1
    kv = layouts.nhd_to_vllm(key, value)
    k2, v2 = layouts.vllm_to_nhd(kv, 2, 64)
    np.testing.assert_array_equal(np.asarray(k2), np.asarray(key))
    kv = layouts.nhd_to_ipex(key, value)
    k2, v2 = layouts.ipex_to_nhd(kv, 2, 64)
    np.testing.assert_array_equal(np.asarray(v2), np.asarray(value))
    # Same element order whichever framework did the conversion.
    np.testing.assert_array_equal(
        np.asarray(layouts.nhd_to_vllm(key, value)),
        layouts.nhd_to_vllm(torch.tensor(np.asarray(key)), torch.tensor(np.asarray(value))).numpy(),
    )


@pytest.mark.parametrize(
    "name, dtype", [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)]
)
def test_fp8_view(name, dtype, rng):
    x = torch.from_numpy(rng.standard_normal(64).astype(np.float32)).to(dtype)
    bits = x.view(torch.uint8)
    assert torch.equal(layouts.fp8_view(bits, name).float(), x.float())
    j = layouts.fp8_view(jnp.asarray(bits.numpy()), name)
    np.testing.assert_array_equal(np.asarray(j.astype(jnp.float32)), x.float().numpy())
    assert layouts.fp8_view(bits, "auto") is bits


def test_errors():
    with pytest.raises(ValueError, match=r"kv_cache must be \[2, num_blocks"):
        layouts.vllm_to_nhd(torch.zeros(3, 2, 8), 1, 8)
    with pytest.raises(ValueError, match="is not a multiple of num_kv_heads"):
        layouts.ipex_to_nhd(torch.zeros(2, 2, 12), 1, 8)
    with pytest.raises(ValueError, match="must both be"):
        layouts.nhd_to_vllm(torch.zeros(2, 8, 1, 8), torch.zeros(2, 8, 1, 16))
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        layouts.fp8_view(torch.zeros(3, dtype=torch.uint8), "int8")

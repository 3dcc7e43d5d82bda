"""torch_backends.layouts: each cache layout's write and gather against the index arithmetic
written out by hand in torch_cases.py (`put`), over NaN-poisoned caches."""

import pytest
import torch
from torch_cases import FP8, nan_cache, put, round_like_cache

from torch_backends.layouts import IpexLayout, NhdLayout, PagedCache, SplitLayout

LAYOUTS = {"vllm": SplitLayout, "ipex": IpexLayout, "nhd": NhdLayout}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize(
    "dtype, kv_cache_dtype",
    [(torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.float32, "fp8_e5m2"),
     (torch.bfloat16, "fp8")],
    ids=["f32", "bf16", "f32-e5m2", "bf16-e4m3"],
)  # fmt: skip
def test_write_then_gather(layout, dtype, kv_cache_dtype, rng):
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    num_blocks, block_size, hkv, d = 5, 8, 3, 32
    k_scale, v_scale = (0.5, 0.25) if kv_cache_dtype != "auto" else (1.0, 1.0)
    kv_cache = nan_cache(num_blocks, block_size, hkv, d, dtype, kv_cache_dtype)
    expected = kv_cache.clone()
    cache = PagedCache.of(LAYOUTS[layout](hkv, d, kv_cache_dtype), kv_cache, k_scale, v_scale)
    # Sequence 0: 11 tokens in blocks [4, 1]; sequence 1: 3 tokens in block [2]; one pad slot.
    tables = torch.tensor([[4, 1], [2, 0]])
    slots = [4 * 8 + p for p in range(8)] + [1 * 8 + p for p in range(3)] + [-1, 16, 17, 18]
    key = torch.randn(len(slots), hkv, d, generator=gen).to(dtype)
    value = torch.randn(len(slots), hkv, d, generator=gen).to(dtype)
    cache.write(key, value, torch.tensor(slots))
    for t, slot in enumerate(slots):
        if slot >= 0:
            put(expected, 0, slot, key[t], d, hkv, block_size, kv_cache_dtype, k_scale, layout)
            put(expected, 1, slot, value[t], d, hkv, block_size, kv_cache_dtype, v_scale, layout)
    assert torch.equal(kv_cache.view(torch.uint8), expected.view(torch.uint8))  # NaN bytes too
    k, v = cache.gather(tables, 11)
    assert k.shape == v.shape == (2, 11, hkv, d) and k.dtype == torch.float32
    for got, x, scale in ((k, key, k_scale), (v, value, v_scale)):
        want = round_like_cache(x, kv_cache_dtype, dtype, scale).float()
        torch.testing.assert_close(got[0], want[:11], rtol=0, atol=0)
        torch.testing.assert_close(got[1, :3], want[12:15], rtol=0, atol=0)


def test_write_errors():
    cache = PagedCache.of(NhdLayout(2, 16), torch.zeros(2, 3, 4 * 2 * 16))
    x = torch.zeros(2, 2, 16)
    with pytest.raises(ValueError, match=r"key has shape \(2, 2, 16\), expected \[num_tokens, 3"):
        PagedCache.of(NhdLayout(3, 16), torch.zeros(2, 3, 4 * 3 * 16)).write(
            x, x, torch.tensor([0, 1])
        )
    with pytest.raises(ValueError, match="slot_mapping has 1 entries for 2 tokens"):
        cache.write(x, x, torch.tensor([0]))
    with pytest.raises(ValueError, match="slot_mapping value 12 is out of range: the cache has 12"):
        cache.write(x, x, torch.tensor([0, 12]))
    with pytest.raises(ValueError, match="Unsupported KV cache type 'fp4'"):
        SplitLayout(2, 16, "fp4")


def test_fp8_views():
    """vLLM's split layout keeps the uint8 cache (its kernels took it so); IPEX's and the
    core's layouts view the bytes as the float8 dtype their kernels read."""
    kv_cache = torch.zeros(2, 3, 8 * 2 * 16, dtype=torch.uint8)
    assert SplitLayout(2, 16, "fp8").split(kv_cache)[0].dtype == torch.uint8
    assert IpexLayout(2, 16, "fp8_e5m2").split(kv_cache)[0].dtype == FP8["fp8_e5m2"]
    key_cache, value_cache = NhdLayout(2, 16, "fp8").split(kv_cache)
    assert key_cache.shape == value_cache.shape == (3, 8, 2, 16)
    assert key_cache.dtype == FP8["fp8"]

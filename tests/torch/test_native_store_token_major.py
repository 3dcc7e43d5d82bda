"""The token-major cache write as a torch op (`torch.ops.jax_attn.store_token_major`,
`torch_backends.native.store_token_major`): dense caches `[NB, BS, Hkv, D]` and the vLLM
plugin's pages `[NB, 2, BS, Hkv, D]` seen as two caches with a block stride, against a torch
reference on NaN-poisoned caches; fp8 bytes; refusals by name before any write; `opcheck`."""

import threading

import pytest
import torch

from torch_backends import native

pytestmark = pytest.mark.skipif(
    native.unavailable_reason() is not None,
    reason=f"native torch ops not available: {native.unavailable_reason()}",
)


def _rows(gen, num_tokens, num_kv_heads, head_size, dtype):
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    return key, value


def _reference(key, value, key_cache, value_cache, slots):
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slots.tolist()):  # token order: a repeated slot keeps the last
        if slot >= 0:
            key_cache[slot // block_size, slot % block_size] = key[t]
            value_cache[slot // block_size, slot % block_size] = value[t]


def _fused(key, value, fill):
    """key and value as vLLM hands them over: views of one fused qkv projection `[T, 3 + 2 Hkv,
    D]` (three query heads first), tokens (3 + 2 Hkv) * D elements apart."""
    tokens, heads, size = key.shape
    qkv = torch.full((tokens, 3 + 2 * heads, size), fill, dtype=key.dtype)
    qkv[:, 3 : 3 + heads], qkv[:, 3 + heads :] = key, value
    return qkv[:, 3 : 3 + heads], qkv[:, 3 + heads :]


@pytest.mark.parametrize("fused", [False, True], ids=["rows", "fused-qkv"])
@pytest.mark.parametrize("pages", [False, True], ids=["dense", "pages"])
@pytest.mark.parametrize(
    "dtype, num_kv_heads, head_size, block_size",
    [(torch.float32, 2, 64, 16), (torch.bfloat16, 1, 80, 32), (torch.float16, 3, 32, 1),
     (torch.uint8, 2, 64, 16)],
    ids=["f32", "bf16-mqa", "f16-bs1", "fp8-bytes"],
)  # fmt: skip
def test_matches_the_reference(pages, fused, dtype, num_kv_heads, head_size, block_size, seed,
                               monkeypatch):  # fmt: skip
    monkeypatch.setattr(native, "STAGE_MIN_BYTES", 0)  # would stage any rows copied
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 9
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    if dtype == torch.uint8:
        key = torch.randint(0, 256, (7, num_kv_heads, head_size), generator=gen, dtype=dtype)
        value = torch.randint(0, 256, key.shape, generator=gen, dtype=dtype)
        fill = 0x7F  # e4m3fn NaN
    else:
        key, value = _rows(gen, 7, num_kv_heads, head_size, dtype)
        fill = float("nan")
    if fused:  # read where they lie: nothing staged
        key, value = _fused(key, value, fill)
        monkeypatch.setattr(native, "_staging", threading.local())
    if pages:  # page b: key block b, then value block b
        page = torch.full((num_blocks, 2, *shape[1:]), fill, dtype=dtype)
        key_cache, value_cache = page.unbind(1)
    else:
        key_cache = torch.full(shape, fill, dtype=dtype)
        value_cache = key_cache.clone()
    num_slots = num_blocks * block_size
    slots = torch.randperm(num_slots, generator=gen)[:7]
    slots[2] = -1
    slots[5] = slots[1]  # repeated: the later row stays
    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    _reference(key, value, expected_key, expected_value, slots)
    native.store_token_major(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache.view(torch.uint8), expected_key.view(torch.uint8))
    assert torch.equal(value_cache.view(torch.uint8), expected_value.view(torch.uint8))
    if fused:
        assert not getattr(native._staging, "buffers", {}), "the fused rows were staged"


@pytest.mark.parametrize(
    "case, match",
    [
        ("bad-slot", r"slot_mapping\[1\]=80 must be -1 \(PAD_SLOT_ID\) or in \[0, num_blocks"),
        ("same-cache", "key_cache and value_cache must not overlap"),
        ("shifted-halves", "key_cache and value_cache must not overlap"),
        ("strided-inside", "key_cache must be dense inside a block"),
        ("two-strides", "must have one block stride"),
        ("head-size", r"key_cache and value_cache must be \[num_blocks, block_size, num_kv_heads"),
        ("dtype", "key, value and both caches must have one dtype"),
        ("slots-int32", "slot_mapping must be int64"),
        ("heads-strided", r"value must be contiguous, or a view whose tokens lie at least"),
    ],
)  # fmt: skip
def test_refuses_bad_input_before_any_write(case, match):
    gen = torch.Generator().manual_seed(0)
    key, value = _rows(gen, 3, 2, 8, torch.float32)
    page = torch.full((5, 2, 16, 2, 8), float("nan"))
    key_cache, value_cache = page.unbind(1)
    slots = torch.tensor([0, 17, 33])
    if case == "bad-slot":
        slots = torch.tensor([0, 80, 3])
    elif case == "same-cache":
        value_cache = key_cache
    elif case == "shifted-halves":  # half-pages seen one apart: each cache's blocks meet
        halves = page.view(10, 16, 2, 8)
        key_cache, value_cache = halves[:-1], halves[1:]
    elif case == "strided-inside":
        key_cache = torch.full((5, 2, 16, 8), float("nan")).transpose(1, 2)
        value_cache = key_cache.clone()
    elif case == "two-strides":
        value_cache = torch.full((5, 16, 2, 8), float("nan"))
    elif case == "head-size":
        key, value = _rows(gen, 3, 2, 4, torch.float32)
    elif case == "dtype":
        key = key.double()
        value = value.double()
    elif case in ("slots-int32", "heads-strided"):  # the op itself (native stages such rows)
        if case == "slots-int32":
            slots = slots.to(torch.int32)
        else:
            value = torch.cat([value, value], dim=2)[:, :, :8]
        with pytest.raises(ValueError, match=match):
            torch.ops.jax_attn.store_token_major(key, value, key_cache, value_cache, slots)
        assert page.isnan().all()
        return
    with pytest.raises(ValueError, match=match):
        native.store_token_major(key, value, key_cache, value_cache, slots)
    assert page.isnan().all() or case in ("strided-inside", "two-strides")


def test_opcheck():
    gen = torch.Generator().manual_seed(0)
    key, value = _rows(gen, 4, 2, 16, torch.float32)
    page = torch.zeros(3, 2, 8, 2, 16)
    key_cache, value_cache = page.unbind(1)
    slots = torch.tensor([0, 9, -1, 23])
    torch.library.opcheck(
        torch.ops.jax_attn.store_token_major.default,
        (key, value, key_cache, value_cache, slots),
    )

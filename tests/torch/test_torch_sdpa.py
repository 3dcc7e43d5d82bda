"""TORCH_SDPA's own surface and vLLM's `PagedAttention` ops, against the float64 reference
in torch_cases.py. (Every backend's steps: test_torch_backends.py.)"""

import numpy as np
import pytest
import torch
from tolerances import assert_close
from torch_cases import (  # CASES, alibi: re-exported for tests/interop
    CASES,
    FP8,
    alibi,
    case_dtypes,
    nan_cache,
    put,
    reference_attention,
    round_like_cache,
    run_case,
)

from torch_backends import get_attn_backend
from torch_backends.paged_attn import PagedAttention
from torch_backends.torch_sdpa import (
    TorchSDPABackend,
    TorchSDPAMetadataBuilder,
    _make_alibi_bias,
    _make_sliding_window_bias,
)


def _run(case, rng, layout="vllm"):
    """One random step of `case` for TORCH_SDPA: (step, impl, layer, tolerance dtypes).
    `layout` fills the cache in another backend's layout from the same random draw."""
    step, impl, layer = run_case(case, rng, TorchSDPABackend, layout=layout)
    return step, impl, layer, case_dtypes(case)


@pytest.mark.parametrize("case", CASES[:6], ids=[c[0] for c in CASES[:6]])
def test_write_changes_exactly_the_slots(case, rng):
    step, impl, layer, _ = _run(case, rng)
    before = step.kv_cache.clone()
    impl.forward(layer, step.query, step.key, step.value, step.kv_cache, step.metadata)
    hkv, d, bs = case[4], case[5], case[6]
    key_cache, value_cache = PagedAttention.split_kv_cache(step.kv_cache, hkv, d)
    assert value_cache.shape == (step.kv_cache.shape[1], hkv, d, bs)
    keys, values = step.key.view(-1, hkv, d), step.value.view(-1, hkv, d)
    for t, slot in enumerate(step.slots):
        b, o = divmod(slot, bs)
        got = key_cache[b, :, :, o, :].reshape(hkv, d)
        torch.testing.assert_close(got, keys[t].to(got.dtype), rtol=0, atol=0)
        torch.testing.assert_close(value_cache[b, :, :, o], values[t], rtol=0, atol=0)
    # Every element outside the written slots is untouched (NaN stays NaN).
    written = torch.zeros_like(before)
    key_view, value_view = PagedAttention.split_kv_cache(written, hkv, d)
    for slot in step.slots:
        b, o = divmod(slot, bs)
        key_view[b, :, :, o, :] = 1
        value_view[b, :, :, o] = 1
    untouched = written == 0
    assert torch.equal(
        step.kv_cache[untouched].view(torch.uint8), before[untouched].view(torch.uint8)
    )
    assert 0 < int(untouched.sum()) < untouched.numel()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_write_fp8_and_pad_slots(kv_cache_dtype, rng):
    """fp8 caches hold uint8 bit patterns of `saturate(x / scale)`; slot -1 writes nothing."""
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    hkv, d, bs, scale = 2, 64, 8, 0.3
    kv_cache = nan_cache(3, bs, hkv, d, torch.float32, kv_cache_dtype)
    key_cache, value_cache = PagedAttention.split_kv_cache(kv_cache, hkv, d)
    assert key_cache.shape == (3, hkv, d // 16, bs, 16)  # x = 16 // 1 byte
    before = kv_cache.clone()
    key = torch.randn(3, hkv, d, generator=gen) * 3e4  # most values saturate
    value = torch.randn(3, hkv, d, generator=gen)
    slots = torch.tensor([17, -1, 3])
    PagedAttention.write_to_paged_cache(
        key, value, key_cache, value_cache, slots, kv_cache_dtype, scale, scale
    )
    expected = before.clone()
    for t in (0, 2):
        for half, x in ((0, key[t]), (1, value[t])):
            put(expected, half, int(slots[t]), x, d, hkv, bs, kv_cache_dtype, scale)
    assert torch.equal(kv_cache, expected)
    info = torch.finfo(FP8[kv_cache_dtype])
    stored = key_cache[2, :, :, 1, :].reshape(hkv, d).view(FP8[kv_cache_dtype]).float()
    assert float(stored.abs().max()) == info.max  # saturated, not inf


@pytest.mark.parametrize(
    "kv_cache_dtype, dtype, block_size, group",
    [
        ("auto", torch.float32, 8, 1),
        ("fp8_e4m3", torch.bfloat16, 16, 4),
        ("auto", torch.bfloat16, 32, 8),
    ],
)
def test_forward_decode_and_prefix_vllm_signatures(kv_cache_dtype, dtype, block_size, group, rng):
    """`forward_decode` / `forward_prefix` called positionally as vLLM V0 called them."""
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    hkv, d, scale = 2, 64, 0.9
    hq = hkv * group
    ctx, q_lens = [13, 0, 30], [4, 6, 1]
    seq_lens = [c + q for c, q in zip(ctx, q_lens, strict=True)]
    # Disjoint, shuffled blocks: sequence i uses 3 * [5, 1, 7, 2] + i, as many as it needs.
    tables = [
        [3 * b + i for b in [5, 1, 7, 2][: -(-s // block_size)]] for i, s in enumerate(seq_lens)
    ]
    padded = torch.tensor([t + [0] * (4 - len(t)) for t in tables])  # [S, 4]
    kv_cache = nan_cache(24, block_size, hkv, d, dtype, kv_cache_dtype)
    key_cache, value_cache = PagedAttention.split_kv_cache(kv_cache, hkv, d)
    ks, vs, new_k, new_v = [], [], [], []
    for s, c, table in zip(seq_lens, ctx, tables, strict=True):
        k, v = (torch.randn(s, hkv, d, generator=gen).to(dtype) for _ in "kv")
        for p in range(c):
            slot = table[p // block_size] * block_size + p % block_size
            put(kv_cache, 0, slot, k[p], d, hkv, block_size, kv_cache_dtype, scale)
            put(kv_cache, 1, slot, v[p], d, hkv, block_size, kv_cache_dtype, scale)
        ks.append(
            torch.cat([round_like_cache(k[:c], kv_cache_dtype, dtype, scale), k[c:].double()])
        )
        vs.append(
            torch.cat([round_like_cache(v[:c], kv_cache_dtype, dtype, scale), v[c:].double()])
        )
        new_k.append(k[c:])
        new_v.append(v[c:])
    query = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
    slopes = torch.tensor(alibi(hq))
    out = PagedAttention.forward_prefix(
        query,
        torch.cat(new_k),
        torch.cat(new_v),
        kv_cache_dtype,
        key_cache,
        value_cache,
        padded,
        torch.tensor([0, *np.cumsum(q_lens)]),
        torch.tensor(seq_lens),
        max(q_lens),
        slopes,
        None,
        scale,
        scale,
    )
    expected = reference_attention(
        query, torch.cat(ks), torch.cat(vs), q_lens, seq_lens, causal=True,
        scale=d**-0.5, alibi_slopes=slopes,
    )  # fmt: skip
    dtypes = (dtype, None if kv_cache_dtype == "auto" else FP8[kv_cache_dtype])
    assert_close(out.float(), expected, *dtypes, what="forward_prefix")
    # Decode: sequences 0 and 2 with their cached context only (no new token).
    dq = torch.randn(2, hq, d, generator=gen).to(dtype)
    dec_tables = padded[[0, 2]]
    out = PagedAttention.forward_decode(
        dq, key_cache, value_cache, dec_tables, torch.tensor([13, 30]), 30, kv_cache_dtype,
        hkv, 0.2, None, scale, scale,
    )  # fmt: skip
    ctx_k = torch.cat([ks[0][:13], ks[2][:30]])
    ctx_v = torch.cat([vs[0][:13], vs[2][:30]])
    expected = reference_attention(dq, ctx_k, ctx_v, [1, 1], [13, 30], causal=True, scale=0.2)
    assert_close(out.float(), expected, *dtypes, what="forward_decode")
    assert out.shape == dq.shape and out.dtype == dtype


def test_block_sparse_decode_rejected():
    q = torch.zeros(1, 4, 64)
    cache = torch.zeros(1, 4, 16, 16, 4)
    with pytest.raises(ValueError, match="Block-sparse attention is not supported"):
        PagedAttention.forward_decode(
            q, cache, cache, torch.zeros(1, 1), torch.tensor([3]), 3, "auto", 4, 0.1, None,
            1.0, 1.0, blocksparse_vert_stride=4,
        )  # fmt: skip


def test_vllm_mask_helpers():
    slopes = torch.tensor([0.5, 0.25])
    (bias,) = _make_alibi_bias(slopes, torch.bfloat16, [3])
    assert bias.shape == (2, 3, 3) and bias.dtype == torch.float32
    assert bias[0, 2, 0] == -1.0 and bias[1, 2, 1] == -0.25 and bias[0, 0, 1] == float("-inf")
    (window,) = _make_sliding_window_bias([4], 2, torch.float32)
    keep = window[0] == 0
    assert keep.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [False, True, True, False],
        [False, False, True, True],
    ]


def test_metadata_builder_fields():
    """Decode fields describe only the decodes; prefill fields only the prefills.

    |<-- prefill_0 (3 new, 5 cached) -->|<-- prefill_1 (4) -->|d0|d1|
    """
    md = TorchSDPAMetadataBuilder(None).build(
        [8, 4, 10, 17],
        [3, 4, 1, 1],
        -1,
        -1,
        block_tables=[[2], [0], [4, 5], [6, 7, 3]],
        block_size=8,
    )
    assert (md.num_prefills, md.num_prefill_tokens, md.num_decode_tokens) == (2, 7, 2)
    assert md.slot_mapping.tolist() == [21, 22, 23, 0, 1, 2, 3, 41, 24]
    assert md.seq_lens == [8, 4] and md.seq_lens_tensor.tolist() == [10, 17]
    assert md.block_tables.tolist() == [[4, 5, 0], [6, 7, 3]]
    assert md.query_start_loc.tolist() == [0, 3, 7]
    assert md.kv_start_loc.tolist() == [0, 8, 12]
    assert md.prefill_block_tables.tolist() == [[2], [0]]
    assert md.prefill_metadata is md and md.decode_metadata is md
    with pytest.raises(ValueError, match="prefills first, then decodes"):
        TorchSDPAMetadataBuilder(None).build(
            [5, 3], [1, 3], -1, -1, block_tables=[[0], [1]], block_size=8
        )
    with pytest.raises(ValueError, match=r"query_lens\[0\]=4 must be <= seq_lens\[0\]=3"):
        TorchSDPAMetadataBuilder(None).build([3], [4], -1, -1, block_tables=[[0]], block_size=8)
    with pytest.raises(ValueError, match=r"block_tables\[0\] has 1 blocks of 8 for"):
        TorchSDPAMetadataBuilder(None).build([9], [9], -1, -1, block_tables=[[0]], block_size=8)


def test_registry_and_backend_surface():
    assert get_attn_backend("TORCH_SDPA") is TorchSDPABackend
    assert TorchSDPABackend.get_name() == "TORCH_SDPA"
    assert TorchSDPABackend.get_kv_cache_shape(10, 16, 2, 64) == (2, 10, 16 * 2 * 64)
    with pytest.raises(ValueError, match=r"Unknown attention backend 'FLASH'.*'TORCH_SDPA'"):
        get_attn_backend("FLASH")


def test_swap_and_copy_blocks(rng):
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    src = torch.randn(2, 5, 64, generator=gen)
    dst = torch.randn(2, 3, 64, generator=gen)
    expected = dst.clone()
    expected[:, [0, 2]] = src[:, [4, 1]]
    TorchSDPABackend.swap_blocks(src, dst, torch.tensor([[4, 0], [1, 2]]))
    assert torch.equal(dst, expected)
    caches = [torch.randn(2, 4, 8, generator=gen) for _ in range(2)]
    before = [c.clone() for c in caches]
    # Block 1 is both a source and a destination: sources are read before any write.
    TorchSDPABackend.copy_blocks(caches, torch.tensor([[0, 1], [1, 3]]))
    for c, b in zip(caches, before, strict=True):
        assert torch.equal(c[:, 1], b[:, 0]) and torch.equal(c[:, 3], b[:, 1])
        assert torch.equal(c[:, [0, 2]], b[:, [0, 2]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: CPU<->CUDA swap")
def test_swap_blocks_cpu_to_cuda(rng):
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    src = torch.randn(2, 4, 32, generator=gen)
    dst = torch.zeros(2, 2, 32, device="cuda")
    TorchSDPABackend.swap_blocks(src, dst, torch.tensor([[3, 1]]))
    assert torch.equal(dst[:, 1].cpu(), src[:, 3])
    back = torch.zeros(2, 4, 32)
    TorchSDPABackend.swap_blocks(dst, back, torch.tensor([[1, 0]]))
    assert torch.equal(back[:, 0], src[:, 3])

"""TORCH_SDPA and the paged ops against the float64 reference in tests/torch/torch_cases.py."""

import numpy as np
import pytest
import torch
from tolerances import assert_close
from torch_cases import (
    make_decoder_step,
    reference_attention,
)

from torch_backends import AttentionLayer, AttentionType, get_attn_backend
from torch_backends.paged_attn import PagedAttention
from torch_backends.torch_sdpa import (
    TorchSDPABackend,
    TorchSDPABackendImpl,
    TorchSDPAMetadataBuilder,
    _make_alibi_bias,
    _make_sliding_window_bias,
)


def alibi(num_heads):
    closest = 2 ** int(np.floor(np.log2(num_heads)))
    slopes = [2.0 ** (-8.0 / closest * k) for k in range(1, closest + 1)]
    slopes += [2.0 ** (-4.0 / closest * k) for k in range(1, 2 * (num_heads - closest), 2)]
    return slopes


CASES = [
    # (id, prefills [(q, ctx)], decodes [ctx], Hq, Hkv, D, BS, dtype, kv_cache_dtype, extras)
    ("prefill-only", [(5, 0), (17, 0)], [], 4, 4, 64, 16, torch.float32, "auto", {}),
    ("decode-only", [], [1, 16, 40], 8, 2, 64, 8, torch.float32, "auto", {}),
    ("mixed-gqa4", [(7, 0)], [3, 33], 8, 2, 128, 16, torch.float32, "auto", {}),
    ("chunked-gqa8", [(6, 10), (3, 0)], [20], 16, 2, 80, 8, torch.float32, "auto", {}),
    ("mqa-d256-bs32", [(9, 0)], [40, 2], 8, 1, 256, 32, torch.float32, "auto", {}),
    ("bf16", [(5, 0), (4, 12)], [17], 8, 2, 64, 16, torch.bfloat16, "auto", {}),
    ("alibi", [(9, 0)], [5, 30], 8, 2, 64, 16, torch.float32, "auto", {"alibi": True}),
    ("alibi-chunked", [(4, 9)], [12], 6, 2, 64, 8, torch.float32, "auto", {"alibi": True}),
    ("window", [(12, 0)], [25], 4, 2, 64, 8, torch.float32, "auto", {"sliding_window": 5}),
    (
        "window-chunked-alibi",
        [(5, 11)],
        [20],
        4,
        1,
        64,
        8,
        torch.float32,
        "auto",
        {"sliding_window": 7, "alibi": True},
    ),
    (
        "softcap",
        [(6, 0), (3, 5)],
        [9],
        4,
        2,
        64,
        16,
        torch.float32,
        "auto",
        {"logits_soft_cap": 2.0},
    ),
    ("fp8-e4m3", [(5, 0), (2, 7)], [21], 8, 2, 64, 16, torch.bfloat16, "fp8", {}),
    ("fp8-e5m2", [(4, 0)], [13, 1], 4, 4, 128, 8, torch.float32, "fp8_e5m2", {}),
]


def _run(case, rng, layout="vllm"):
    _name, prefills, decodes, hq, hkv, d, bs, dtype, cache_dtype, extras = case
    fp8 = cache_dtype != "auto"
    k_scale, v_scale = (0.45, 0.7) if fp8 else (1.0, 1.0)
    slopes = alibi(hq) if extras.get("alibi") else None
    bias = dict(
        alibi_slopes=slopes,
        sliding_window=extras.get("sliding_window"),
        logits_soft_cap=extras.get("logits_soft_cap"),
    )
    step = make_decoder_step(
        rng,
        TorchSDPAMetadataBuilder(),
        prefills=prefills,
        decodes=decodes,
        num_heads=hq,
        num_kv_heads=hkv,
        head_size=d,
        block_size=bs,
        dtype=dtype,
        kv_cache_dtype=cache_dtype,
        k_scale=k_scale,
        v_scale=v_scale,
        layout=layout,
        **bias,
    )
    impl = TorchSDPABackendImpl(hq, d, d**-0.5, hkv, kv_cache_dtype=cache_dtype, **bias)
    layer = AttentionLayer(k_scale, v_scale)
    return (
        step,
        impl,
        layer,
        (dtype, "float8_e4m3fn" if cache_dtype == "fp8" else "float8_e5m2" if fp8 else None),
    )


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_decoder_step_matches_float64(case, rng):
    step, impl, layer, dtypes = _run(case, rng)
    out = impl.forward(layer, step.query, step.key, step.value, step.kv_cache, step.metadata)
    hq, d = case[3], case[5]
    assert out.shape == step.query.shape and out.dtype == step.query.dtype
    assert_close(out.view(-1, hq, d).float(), step.expected, *dtypes)


@pytest.mark.parametrize("case", CASES[:6], ids=[c[0] for c in CASES[:6]])
def test_write_changes_exactly_the_slots(case, rng):
    step, impl, layer, _ = _run(case, rng)
    before = step.kv_cache.clone()
    impl.forward(layer, step.query, step.key, step.value, step.kv_cache, step.metadata)
    hkv, d, bs = case[4], case[5], case[6]
    key_cache, value_cache = PagedAttention.split_kv_cache(step.kv_cache, hkv, d)
    keys = step.key.view(-1, hkv, d)
    for t, slot in enumerate(step.slots):
        b, o = divmod(slot, bs)
        got = key_cache[b, :, :, o, :].reshape(hkv, d)
        torch.testing.assert_close(got, keys[t].to(got.dtype), rtol=0, atol=0)
    changed = (step.kv_cache.view(torch.uint8) != before.view(torch.uint8)).any(dim=-1)
    blocks = {s // bs for s in step.slots}
    assert set(changed.nonzero()[:, 1].tolist()) <= blocks
    # Every byte outside the written slots is untouched (NaN stays NaN).
    written = torch.zeros_like(before)  # same dtype, so the same split layout
    key_view, value_view = PagedAttention.split_kv_cache(written, hkv, d)
    for slot in step.slots:
        b, o = divmod(slot, bs)
        key_view[b, :, :, o, :] = 1
        value_view[b, :, :, o] = 1
    untouched = written.view(torch.uint8).view((*written.shape, -1)) == 0
    untouched = untouched.all(dim=-1)
    assert torch.equal(
        step.kv_cache[untouched].view(torch.uint8), before[untouched].view(torch.uint8)
    )
    assert int(untouched.sum()) < untouched.numel()
    assert value_cache.shape == (step.kv_cache.shape[1], hkv, d, bs)


@pytest.mark.parametrize("attn_type", [AttentionType.ENCODER, AttentionType.ENCODER_ONLY])
@pytest.mark.parametrize(
    "extras",
    [{}, {"alibi": True}, {"sliding_window": 3}, {"logits_soft_cap": 3.0}],
    ids=["plain", "alibi", "window", "softcap"],
)
def test_encoder_attention(attn_type, extras, rng):
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    hq, hkv, d = 8, 2, 64
    lens = [5, 1, 12]
    q = torch.randn(sum(lens), hq, d, generator=gen)
    k = torch.randn(sum(lens), hkv, d, generator=gen)
    v = torch.randn(sum(lens), hkv, d, generator=gen)
    slopes = alibi(hq) if extras.get("alibi") else None
    bias = dict(
        alibi_slopes=slopes,
        sliding_window=extras.get("sliding_window"),
        logits_soft_cap=extras.get("logits_soft_cap"),
    )
    impl = TorchSDPABackendImpl(hq, d, 0.1, hkv, attn_type=attn_type, **bias)
    md = TorchSDPAMetadataBuilder().build(
        [], [], block_tables=[], block_size=16, encoder_seq_lens=lens
    )
    out = impl.forward(
        AttentionLayer(),
        q.view(len(q), -1),
        k.view(len(k), -1),
        v.view(len(v), -1),
        torch.empty(0),
        md,
    )
    expected = reference_attention(q, k, v, lens, lens, causal=False, scale=0.1, **bias)
    assert_close(out.view(-1, hq, d), expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_attention_prefill_then_decode(dtype, rng):
    """Decoder queries over encoder keys: written once via cross_slot_mapping, then read from
    the cache through cross_block_tables when key/value are None."""
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    hq, hkv, d, bs = 4, 4, 64, 8
    enc_lens = [11, 4]
    dec_lens = [3, 2]
    cross_tables = [[2, 5], [0]]
    kv_cache = torch.full((2, 7, bs * hkv * d), float("nan"), dtype=dtype)
    enc_k = torch.randn(sum(enc_lens), hkv, d, generator=gen).to(dtype)
    enc_v = torch.randn(sum(enc_lens), hkv, d, generator=gen).to(dtype)
    impl = TorchSDPABackendImpl(hq, d, d**-0.5, hkv, attn_type=AttentionType.ENCODER_DECODER)
    builder = TorchSDPAMetadataBuilder()
    # Step 1: decoder prefill of every sequence, encoder K/V given.
    md = builder.build(
        dec_lens,
        dec_lens,
        block_tables=[[1], [3]],
        block_size=bs,
        encoder_seq_lens=enc_lens,
        cross_block_tables=cross_tables,
    )
    q = torch.randn(sum(dec_lens), hq, d, generator=gen).to(dtype)
    out = impl.forward(
        AttentionLayer(),
        q.view(len(q), -1),
        enc_k.view(len(enc_k), -1),
        enc_v.view(len(enc_v), -1),
        kv_cache,
        md,
    )
    expected = reference_attention(q, enc_k, enc_v, dec_lens, enc_lens, causal=False, scale=d**-0.5)
    assert_close(out.view(-1, hq, d).float(), expected, dtype)
    # Step 2: one decode token per sequence, key/value None: encoder K/V from the cache.
    md = builder.build(
        [4, 3],
        [1, 1],
        block_tables=[[1], [3]],
        block_size=bs,
        encoder_seq_lens=enc_lens,
        cross_block_tables=cross_tables,
    )
    q = torch.randn(2, hq, d, generator=gen).to(dtype)
    out = impl.forward(AttentionLayer(), q.view(2, -1), None, None, kv_cache, md)
    expected = reference_attention(q, enc_k, enc_v, [1, 1], enc_lens, causal=False, scale=d**-0.5)
    assert_close(out.view(-1, hq, d).float(), expected, dtype)


def test_vllm_mask_helpers():
    slopes = torch.tensor([0.5, 0.25])
    (bias,) = _make_alibi_bias(slopes, torch.float32, [3])
    assert bias.shape == (2, 3, 3)
    assert bias[0, 2, 0] == -1.0 and bias[1, 2, 1] == -0.25 and bias[0, 0, 1] == float("-inf")
    (window,) = _make_sliding_window_bias([4], 2, torch.float32)
    keep = window[0] == 0
    assert keep.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [False, True, True, False],
        [False, False, True, True],
    ]


def test_registry_and_backend_surface():
    assert get_attn_backend("TORCH_SDPA") is TorchSDPABackend
    assert TorchSDPABackend.get_name() == "TORCH_SDPA"
    assert TorchSDPABackend.get_kv_cache_shape(10, 16, 2, 64) == (2, 10, 16 * 2 * 64)
    with pytest.raises(ValueError, match=r"Unknown attention backend 'FLASH'.*TORCH_SDPA"):
        get_attn_backend("FLASH")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            dict(head_size=72),
            ValueError,
            r"Head size 72 is not supported by PagedAttention. Supported head sizes are: \[32, ",
        ),
        (dict(blocksparse_params={"x": 1}), ValueError, "does not support block-sparse"),
        (dict(attn_type="decoderr"), NotImplementedError, "Unknown attention type 'decoderr'"),
        (dict(kv_cache_dtype="int4"), ValueError, "Unsupported KV cache type 'int4'"),
        (dict(num_kv_heads=3), ValueError, "num_heads=4 must be divisible by num_kv_heads=3"),
    ],
)
def test_impl_errors(kwargs, error, match):
    args = dict(num_heads=4, head_size=64, scale=0.1, num_kv_heads=2) | kwargs
    with pytest.raises(error, match=match):
        TorchSDPABackendImpl(**args)


def test_missing_metadata_errors(rng):
    impl = TorchSDPABackendImpl(4, 64, 0.1, 4, attn_type=AttentionType.ENCODER_DECODER)
    md = TorchSDPAMetadataBuilder().build([2], [2], block_tables=[[0]], block_size=16)
    x = torch.zeros(2, 256)
    with pytest.raises(AttributeError, match="requires setting cross-attention metadata"):
        impl.forward(AttentionLayer(), x, x, x, torch.zeros(2, 1, 16 * 256), md)
    with pytest.raises(ValueError, match="attn_metadata is required"):
        TorchSDPABackendImpl(4, 64, 0.1).forward(AttentionLayer(), x, x, x, torch.empty(0), None)


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
    TorchSDPABackend.copy_blocks(caches, torch.tensor([[0, 1], [1, 3]]))
    for c, b in zip(caches, before, strict=True):
        assert torch.equal(c[:, 1], b[:, 0]) and torch.equal(c[:, 3], b[:, 1])
        assert torch.equal(c[:, [0, 2]], b[:, [0, 2]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: CPU<->CUDA swap")
def test_swap_blocks_cpu_to_cuda(rng):
    src = torch.randn(2, 4, 32)
    dst = torch.zeros(2, 2, 32, device="cuda")
    TorchSDPABackend.swap_blocks(src, dst, torch.tensor([[3, 1]]))
    assert torch.equal(dst[:, 1].cpu(), src[:, 3])

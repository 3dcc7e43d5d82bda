"""IPEX: the real IPEX 2.8 kernels, against the float64 reference and against TORCH_SDPA.

IPEX 2.8 needs torch 2.8.*, so these run in the IPEX environment (`scripts/test.sh` runs
`pytest -m ipex` there); elsewhere they skip saying why.
"""

import importlib.util

import pytest
import torch
from test_torch_sdpa import CASES, _run, alibi
from tolerances import assert_close
from torch_cases import reference_attention

pytestmark = pytest.mark.ipex

_REASON = None
if not torch.__version__.startswith("2.8"):
    _REASON = (
        f"IPEX 2.8 needs torch 2.8.*, this environment has torch {torch.__version__}; "
        "scripts/test.sh runs these tests in the IPEX environment"
    )
elif importlib.util.find_spec("intel_extension_for_pytorch") is None:
    _REASON = "intel_extension_for_pytorch is not installed (pip install 'jax-attn[ipex]')"
if _REASON:
    pytest.skip(_REASON, allow_module_level=True)

from torch_backends import AttentionLayer, AttentionType, get_attn_backend  # noqa: E402
from torch_backends.ipex_attn import (  # noqa: E402
    IpexAttnBackend,
    IpexAttnBackendImpl,
    IpexAttnMetadataBuilder,
)
from torch_backends.paged_attn import PagedAttention  # noqa: E402

IPEX_CASES = [c for c in CASES if c[8] in ("auto", "fp8_e5m2")]


def _ipex_impl(case):
    _name, _p, _d, hq, hkv, d, _bs, _dtype, cache_dtype, extras = case
    return IpexAttnBackendImpl(
        hq,
        d,
        d**-0.5,
        hkv,
        kv_cache_dtype=cache_dtype,
        alibi_slopes=alibi(hq) if extras.get("alibi") else None,
        sliding_window=extras.get("sliding_window"),
        logits_soft_cap=extras.get("logits_soft_cap"),
    )


@pytest.mark.parametrize("case", IPEX_CASES, ids=[c[0] for c in IPEX_CASES])
def test_ipex_matches_float64_and_sdpa(case, rng):
    seed = int(rng.integers(2**31))
    import numpy as np

    step, _, layer, dtypes = _run(case, np.random.default_rng(seed), layout="ipex")
    impl = _ipex_impl(case)
    out = impl.forward(layer, step.query, step.key, step.value, step.kv_cache, step.metadata)
    hq, hkv, d, bs = case[3], case[4], case[5], case[6]
    assert_close(out.view(-1, hq, d).float(), step.expected, *dtypes)

    # The same step (same random draw) through TORCH_SDPA in vLLM's layout: the same cache
    # contents after the write, slot by slot, and the same outputs.
    sdpa_step, sdpa, _, _ = _run(case, np.random.default_rng(seed))
    sdpa_out = sdpa.forward(
        layer,
        sdpa_step.query,
        sdpa_step.key,
        sdpa_step.value,
        sdpa_step.kv_cache,
        sdpa_step.metadata,
    )
    assert_close(out.float(), sdpa_out.float(), *dtypes)
    ipex_k, ipex_v = impl.split_kv_cache(step.kv_cache)
    vllm_k, vllm_v = PagedAttention.split_kv_cache(sdpa_step.kv_cache, hkv, d)
    for slot in step.slots:
        b, o = divmod(slot, bs)
        pairs = [(ipex_k[b, :, o], vllm_k[b, :, :, o, :]), (ipex_v[b, :, o], vllm_v[b, :, :, o])]
        for a, c in pairs:
            a = a.contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(a, c.contiguous().reshape(-1).view(torch.uint8))


def test_pad_slots_write_nothing(rng):
    impl = IpexAttnBackendImpl(2, 64, 0.125, 2)
    kv_cache = torch.full((2, 3, 8 * 2 * 64), float("nan"))
    key_cache, value_cache = impl.split_kv_cache(kv_cache)
    before = kv_cache.clone()
    x = torch.randn(2, 2, 64)
    impl.write_kv(x, x, key_cache, value_cache, torch.tensor([-1, 9]), 1.0, 1.0)
    changed = ~((kv_cache == before) | (kv_cache.isnan() & before.isnan()))
    assert int(changed.sum()) == 2 * 2 * 64  # slot 9 in both caches, nothing for -1
    assert torch.equal(key_cache[1, :, 1], x[1])


@pytest.mark.parametrize("attn_type", [AttentionType.ENCODER, AttentionType.ENCODER_ONLY])
def test_ipex_encoder(attn_type, rng):
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    hq, hkv, d = 8, 2, 64
    lens = [5, 1, 12]
    q, k, v = (torch.randn(sum(lens), h, d, generator=gen) for h in (hq, hkv, hkv))
    impl = IpexAttnBackendImpl(
        hq, d, 0.1, hkv, attn_type=attn_type, alibi_slopes=alibi(hq), sliding_window=4
    )
    md = IpexAttnMetadataBuilder().build(
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
    expected = reference_attention(
        q, k, v, lens, lens, causal=False, scale=0.1, alibi_slopes=alibi(hq), sliding_window=4
    )
    assert_close(out.view(-1, hq, d), expected, torch.float32)


def test_ipex_cross_attention(rng):
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    hq, hkv, d, bs = 4, 4, 64, 8
    enc_lens, dec_lens, cross_tables = [11, 4], [3, 2], [[2, 5], [0]]
    kv_cache = torch.full((2, 7, bs * hkv * d), float("nan"))
    enc_k, enc_v = (torch.randn(sum(enc_lens), hkv, d, generator=gen) for _ in range(2))
    impl = IpexAttnBackendImpl(hq, d, d**-0.5, hkv, attn_type=AttentionType.ENCODER_DECODER)
    builder = IpexAttnMetadataBuilder()
    md = builder.build(
        dec_lens,
        dec_lens,
        block_tables=[[1], [3]],
        block_size=bs,
        encoder_seq_lens=enc_lens,
        cross_block_tables=cross_tables,
    )
    q = torch.randn(sum(dec_lens), hq, d, generator=gen)
    out = impl.forward(
        AttentionLayer(),
        q.view(len(q), -1),
        enc_k.view(len(enc_k), -1),
        enc_v.view(len(enc_v), -1),
        kv_cache,
        md,
    )
    expected = reference_attention(q, enc_k, enc_v, dec_lens, enc_lens, causal=False, scale=d**-0.5)
    assert_close(out.view(-1, hq, d), expected, torch.float32)
    md = builder.build(
        [4, 3],
        [1, 1],
        block_tables=[[1], [3]],
        block_size=bs,
        encoder_seq_lens=enc_lens,
        cross_block_tables=cross_tables,
    )
    q = torch.randn(2, hq, d, generator=gen)
    out = impl.forward(AttentionLayer(), q.view(2, -1), None, None, kv_cache, md)
    expected = reference_attention(q, enc_k, enc_v, [1, 1], enc_lens, causal=False, scale=d**-0.5)
    assert_close(out.view(-1, hq, d), expected, torch.float32)


def test_ipex_errors():
    assert get_attn_backend("IPEX") is IpexAttnBackend
    with pytest.raises(NotImplementedError, match="supports only 'auto' and 'fp8_e5m2'"):
        IpexAttnBackendImpl(4, 64, 0.1, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="Head size 72 is not supported by PagedAttention"):
        IpexAttnBackendImpl(4, 72, 0.1)
    with pytest.raises(ValueError, match="IPEX does not support block-sparse attention"):
        IpexAttnBackendImpl(4, 64, 0.1, blocksparse_params={})

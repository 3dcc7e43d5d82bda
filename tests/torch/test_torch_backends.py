"""Every torch backend (TORCH_SDPA, XFORMERS, IPEX) on the same steps: against the float64
reference in torch_cases.py, and against TORCH_SDPA on identical inputs (same cache bytes
after the write, same outputs within tolerance).

Each backend builds its own metadata with its own builder and reads its own cache layout.
IPEX runs in the IPEX environment (`pytest -m ipex`, torch 2.8); XFORMERS where xformers is
installed (on CPU through its documented reference execution).
"""

import re
import warnings

import numpy as np
import pytest
import torch
from tolerances import assert_close
from torch_cases import (
    CASES,
    LAYOUTS,
    alibi,
    backend_param,
    cache_bytes_at,
    case_dtypes,
    reference_attention,
    run_case,
)

from torch_backends import AttentionLayer, AttentionType, get_attn_backend

BACKENDS = ["TORCH_SDPA", "XFORMERS", "IPEX"]
# IPEX 2.8 stores only e5m2 fp8 caches (its e4m3 refusal is tested in test_torch_ipex.py).
UNSUPPORTED = {("IPEX", "fp8")}

DECODER_PARAMS = [
    pytest.param(backend.values[0], case, id=f"{backend.id}-{case[0]}", marks=backend.marks)
    for backend in map(backend_param, BACKENDS)
    for case in CASES
    if (backend.values[0], case[8]) not in UNSUPPORTED
]


@pytest.fixture(autouse=True)
def _quiet_xformers_cpu_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "XFORMERS: xformers has no CPU kernel")
        yield


@pytest.mark.parametrize("backend, case", DECODER_PARAMS)
def test_decoder_step(backend, case, rng, inference_mode):
    """Prefill, decode and chunked prefill in one step, over a NaN-poisoned cache; also with
    the metadata, cache and inputs made under torch.inference_mode() (the `inference_mode`
    fixture: inference tensors keep no version counter, which the checked-plan cache,
    `checks.tensor_state`, must do without)."""
    seed = int(rng.integers(2**31))
    backend_cls = get_attn_backend(backend)
    step, impl, layer = run_case(case, np.random.default_rng(seed), backend_cls)
    assert step.metadata.seq_lens_tensor.is_inference() == inference_mode
    out = impl.forward(layer, step.query, step.key, step.value, step.kv_cache, step.metadata)
    _name, _p, _d, hq, hkv, d, bs, dtype, *_ = case
    assert out.shape == step.query.shape and out.dtype == dtype
    assert_close(out.view(-1, hq, d).float(), step.expected, *case_dtypes(case))
    if backend == "TORCH_SDPA":
        return
    # The same step (same random draw) through TORCH_SDPA: same bytes in every written
    # slot, same outputs.
    sdpa_cls = get_attn_backend("TORCH_SDPA")
    ref_step, sdpa, _ = run_case(case, np.random.default_rng(seed), sdpa_cls)
    ref = sdpa.forward(
        layer, ref_step.query, ref_step.key, ref_step.value, ref_step.kv_cache, ref_step.metadata
    )
    assert_close(out.float(), ref.float(), *case_dtypes(case), what=f"{backend} vs TORCH_SDPA")
    assert step.slots == ref_step.slots
    for slot in step.slots:
        got = cache_bytes_at(step.kv_cache, slot, LAYOUTS[backend], hkv, d, bs)
        want = cache_bytes_at(ref_step.kv_cache, slot, "vllm", hkv, d, bs)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), f"cache bytes differ at slot {slot}"


ENCODER_EXTRAS = [{}, {"alibi": True}, {"sliding_window": 3}, {"logits_soft_cap": 3.0}]


@pytest.mark.parametrize("backend", [backend_param(b) for b in BACKENDS])
@pytest.mark.parametrize("attn_type", [AttentionType.ENCODER, AttentionType.ENCODER_ONLY])
@pytest.mark.parametrize(
    "extras, dtype, head_size",
    [
        ({}, torch.float32, 64),
        ({"alibi": True}, torch.float32, 128),
        ({"sliding_window": 3}, torch.bfloat16, 80),
        ({"logits_soft_cap": 3.0}, torch.float32, 256),
    ],
    ids=["plain", "alibi-d128", "window-bf16-d80", "softcap-d256"],
)
def test_encoder_attention(backend, attn_type, extras, dtype, head_size, rng, inference_mode):
    """Bidirectional attention over the given K/V, no cache (an empty kv_cache); also with
    everything made under torch.inference_mode() (the `inference_mode` fixture)."""
    backend_cls = get_attn_backend(backend)
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    hq, hkv, d = 8, 2, head_size
    lens = [5, 1, 12]
    q, k, v = (torch.randn(sum(lens), h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))
    bias = dict(
        alibi_slopes=alibi(hq) if extras.get("alibi") else None,
        sliding_window=extras.get("sliding_window"),
        logits_soft_cap=extras.get("logits_soft_cap"),
    )
    impl = backend_cls.get_impl_cls()(
        hq, d, 0.1, hkv, kv_cache_dtype="auto", attn_type=attn_type, **bias
    )
    md = backend_cls.get_builder_cls()(None).build(
        [], [], -1, -1, block_tables=[], block_size=16, encoder_seq_lens=lens
    )
    flat = [x.reshape(len(x), -1) for x in (q, k, v)]
    out = impl.forward(AttentionLayer(), *flat, torch.empty(0), md)
    expected = reference_attention(q, k, v, lens, lens, causal=False, scale=0.1, **bias)
    assert_close(out.view(-1, hq, d).float(), expected, dtype)


@pytest.mark.parametrize("backend", [backend_param(b) for b in BACKENDS])
@pytest.mark.parametrize(
    "dtype, block_size, num_kv_heads",
    [(torch.float32, 8, 4), (torch.bfloat16, 16, 1)],
    ids=["f32-bs8-mha", "bf16-bs16-mqa"],
)
def test_cross_attention_prefill_then_decode(
    backend, dtype, block_size, num_kv_heads, rng, inference_mode
):
    """Decoder queries over encoder keys: written once through cross_slot_mapping, then read
    back through cross_block_tables when key/value are None (decode); also with everything
    made under torch.inference_mode() (the `inference_mode` fixture)."""
    backend_cls = get_attn_backend(backend)
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    hq, hkv, d, bs = 4, num_kv_heads, 64, block_size
    enc_lens, dec_lens = [11, 4], [3, 2]
    cross_tables = [[2, 5], [0]]
    shape = backend_cls.get_kv_cache_shape(7, bs, hkv, d)
    kv_cache = torch.full(shape, float("nan"), dtype=dtype)
    enc_k, enc_v = (torch.randn(sum(enc_lens), hkv, d, generator=gen).to(dtype) for _ in "kv")
    impl = backend_cls.get_impl_cls()(
        hq,
        d,
        d**-0.5,
        hkv,
        attn_type=AttentionType.ENCODER_DECODER,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
    )
    builder = backend_cls.get_builder_cls()(None)
    tables = dict(block_size=bs, encoder_seq_lens=enc_lens, cross_block_tables=cross_tables)
    # Step 1: the decoder prefill of every sequence, the encoder K/V given.
    md = builder.build(dec_lens, dec_lens, -1, -1, block_tables=[[1], [3]], **tables)
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
    # Step 2: one decode token per sequence; the encoder K/V come from the cache.
    md = builder.build([4, 3], [1, 1], -1, -1, block_tables=[[1], [3]], **tables)
    q = torch.randn(2, hq, d, generator=gen).to(dtype)
    out = impl.forward(AttentionLayer(), q.view(2, -1), None, None, kv_cache, md)
    expected = reference_attention(q, enc_k, enc_v, [1, 1], enc_lens, causal=False, scale=d**-0.5)
    assert_close(out.view(-1, hq, d).float(), expected, dtype)


# -- errors: vLLM's messages where vLLM had them -----------------------------------------

IMPL_ERRORS = [
    pytest.param(
        dict(head_size=72),
        ValueError,
        r"Head size 72 is not supported by PagedAttention\. Supported head sizes are: \[32, ",
        id="head-size",
    ),
    pytest.param(
        dict(blocksparse_params={"local_blocks": 2}),
        ValueError,
        "does not support block-sparse attention",
        id="block-sparse",
    ),
    pytest.param(
        dict(attn_type="decoderr"),
        NotImplementedError,
        "Unknown attention type 'decoderr'",
        id="attn-type",
    ),
    pytest.param(
        dict(kv_cache_dtype="int4"), ValueError, "Unsupported KV cache type 'int4'", id="cache"
    ),
    pytest.param(
        dict(num_kv_heads=3),
        ValueError,
        "num_heads=4 must be divisible by num_kv_heads=3",
        id="gqa",
    ),
    pytest.param(
        dict(alibi_slopes=[0.5]), ValueError, "1 alibi_slopes for num_heads=4", id="alibi"
    ),
]


@pytest.mark.parametrize("backend", [backend_param(b) for b in BACKENDS])
@pytest.mark.parametrize("kwargs, error, match", IMPL_ERRORS)
def test_impl_errors(backend, kwargs, error, match):
    impl_cls = get_attn_backend(backend).get_impl_cls()
    args = (
        dict(num_heads=4, head_size=64, scale=0.1, num_kv_heads=2)
        | dict(alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
        | kwargs
    )
    with pytest.raises(error, match=match):
        impl_cls(**args)


@pytest.mark.parametrize("backend", [backend_param(b) for b in BACKENDS])
def test_missing_metadata_errors(backend):
    backend_cls = get_attn_backend(backend)
    impl_cls, builder = backend_cls.get_impl_cls(), backend_cls.get_builder_cls()(None)
    x = torch.zeros(2, 256)
    kv_cache = torch.zeros(backend_cls.get_kv_cache_shape(2, 16, 4, 64))
    md = builder.build([2], [2], -1, -1, block_tables=[[0]], block_size=16)
    cross = impl_cls(
        4,
        64,
        0.1,
        4,
        attn_type=AttentionType.ENCODER_DECODER,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
    )
    with pytest.raises(AttributeError, match="requires setting cross-attention metadata"):
        cross.forward(AttentionLayer(), x, x, x, kv_cache, md)
    encoder = impl_cls(
        4,
        64,
        0.1,
        4,
        attn_type=AttentionType.ENCODER,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
    )
    with pytest.raises(AttributeError, match="Encoder attention requires setting encoder"):
        encoder.forward(AttentionLayer(), x, x, x, torch.empty(0), md)
    decoder = impl_cls(4, 64, 0.1, 4, alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    with pytest.raises(ValueError, match="attn_metadata is required"):
        decoder.forward(AttentionLayer(), x, x, x, kv_cache, None)
    with pytest.raises(ValueError, match="query has 1 tokens but the metadata describes 2"):
        decoder.forward(AttentionLayer(), x[:1], x[:1], x[:1], kv_cache, md)
    with pytest.raises(ValueError, match="decode needs a kv_cache"):
        md = builder.build([5], [1], -1, -1, block_tables=[[0]], block_size=16)
        decoder.forward(AttentionLayer(), x[:1], x[:1], x[:1], torch.empty(0), md)


# vLLM V0 (v0.8.0 to v0.8.5) head-size checks, per backend: TORCH_SDPA checked against its CPU
# paged ops (vllm/attention/ops/ipex_attn.py: no 120); XFORMERS and IPEX against
# vllm/attention/ops/paged_attn.py. Each impl raises exactly where vLLM's did.
VLLM_HEAD_SIZES = {
    "TORCH_SDPA": [32, 64, 80, 96, 112, 128, 192, 256],
    "XFORMERS": [32, 64, 80, 96, 112, 120, 128, 192, 256],
    "IPEX": [32, 64, 80, 96, 112, 120, 128, 192, 256],
}


@pytest.mark.parametrize("backend", [backend_param(b) for b in BACKENDS])
def test_head_sizes_as_vllm_v0(backend):
    impl_cls = get_attn_backend(backend).get_impl_cls()
    supported = VLLM_HEAD_SIZES[backend]
    assert impl_cls.get_supported_head_sizes() == supported
    for head_size in [16, 32, 48, 64, 72, 80, 96, 112, 120, 128, 160, 192, 256, 512]:
        if head_size in supported:
            impl_cls(
                4, head_size, 0.1, 2, alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto"
            )
            continue
        message = (
            f"Head size {head_size} is not supported by PagedAttention. "
            f"Supported head sizes are: {supported}."
        )
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            impl_cls(
                4, head_size, 0.1, 2, alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto"
            )


@pytest.mark.parametrize("backend", [backend_param(b) for b in BACKENDS])
def test_a_cache_meets_huge_pages_once(backend, monkeypatch, rng):
    """A cache's first step hands it to huge_pages before the write (all of a fresh cache is
    zeros), its later steps do not, and JAX_ATTN_VLLM_HUGE_PAGES=0 never: the outputs and the
    cache bytes are the same either way."""
    from thp import linux_at_least

    from torch_backends import huge_pages

    monkeypatch.setattr(huge_pages, "_SEEN", set())
    calls = []
    real = huge_pages.rebacked_zero_chunks

    def spy(tensor, populate=False):
        done = real(tensor, populate=populate)
        calls.append((tensor.data_ptr(), done))
        return done

    monkeypatch.setattr(huge_pages, "rebacked_zero_chunks", spy)
    backend_cls = get_attn_backend(backend)
    hq, hkv, d, bs, num_blocks = 8, 2, 64, 16, 1024  # 8 MiB per half of a float32 cache
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    lens = [40, 23]
    tables = [[int(b) for b in rng.choice(num_blocks, 3, replace=False)]]
    tables.append([b for b in range(num_blocks) if b not in tables[0]][:2])
    query, key, value = (torch.randn(sum(lens), h * d, generator=gen) for h in (hq, hkv, hkv))
    shape = backend_cls.get_kv_cache_shape(num_blocks, bs, hkv, d)
    results = []
    for switch in (None, "0"):
        if switch is None:
            monkeypatch.delenv(huge_pages.ENV, raising=False)
        else:
            monkeypatch.setenv(huge_pages.ENV, switch)
        cache = torch.zeros(shape)
        impl = backend_cls.get_impl_cls()(hq, d, d**-0.5, hkv, None, None, "auto")
        metadata = backend_cls.get_builder_cls()(None).build(
            lens, lens, -1, -1, block_tables=tables, block_size=bs
        )
        outputs = [
            impl.forward(AttentionLayer(1.0, 1.0), query, key, value, cache, metadata).clone()
            for _ in range(2)  # the same step twice: the second sees the cache again
        ]
        torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
        results.append((outputs[0], cache))
        if switch is None:
            assert [ptr for ptr, _ in calls] == [cache.data_ptr()]
            done = calls[0][1]
            if done.reason is None:  # Linux, private anonymous memory: every chunk was zeros
                assert done.chunks >= 6 and done.zero_chunks == done.chunks
                assert done.populated == linux_at_least(5, 14)  # faulted in up front
        else:
            assert len(calls) == 1
    (out_on, cache_on), (out_off, cache_off) = results
    torch.testing.assert_close(out_on, out_off, rtol=0, atol=0)
    assert torch.equal(cache_on, cache_off) and bool(cache_on.ne(0).any())

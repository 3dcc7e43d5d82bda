"""TORCH_SDPA's prefills on the native ragged kernel (`torch_backends.ragged_prefill`): plain,
chunked over a cached prefix, mixed with decodes, encoder and cross attention, against the
float64 reference on NaN-poisoned caches; the kernel is what runs (SDPA and the torch math
would raise here), and each case the kernel cannot take falls back explicitly, with its
reason, and stays correct; `JAX_ATTN_CPU_DISABLE=1` runs the torch path."""

from functools import partial

import numpy as np
import pytest
import torch
from tolerances import assert_close
from torch_cases import CASES, alibi, case_dtypes, make_decoder_step, reference_attention, run_case

from torch_backends import (
    AttentionLayer,
    AttentionType,
    native,
    paged_backend,
    ragged_prefill,
    torch_sdpa,
)
from torch_backends import paged_attn as paged_attn_module
from torch_backends.paged_attn import PagedAttention
from torch_backends.torch_sdpa import TorchSDPABackend

pytestmark = pytest.mark.skipif(
    native.unavailable_reason() is not None,
    reason=f"native torch ops not available: {native.unavailable_reason()}",
)


class _DecodeCalls:
    """The decode kernel's calls (query rows each), through `native.paged_decode_split`."""

    def __init__(self):
        self.rows: list[int] = []
        self._kernel = native.paged_decode_split

    def count(self, out, query, *args, **kwargs):
        self.rows.append(query.shape[0])
        return self._kernel(out, query, *args, **kwargs)


@pytest.fixture
def decodes():
    return _DecodeCalls()


@pytest.fixture
def native_only(monkeypatch, decodes):
    """Counts the ragged kernel's calls (and the decode kernel's: `decodes`); SDPA and the
    torch attention math raise if reached."""
    calls = []
    kernel = native.ragged_paged_attention

    def counted(*args, **kwargs):
        calls.append(args[1].shape[0])  # query rows
        return kernel(*args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("a prefill fell back to torch while the native kernel is available")

    monkeypatch.setattr(native, "ragged_paged_attention", counted)
    monkeypatch.setattr(native, "paged_decode_split", decodes.count)
    monkeypatch.setattr(torch_sdpa.F, "scaled_dot_product_attention", refuse)
    monkeypatch.setattr(paged_attn_module, "ragged_masked_attention", refuse)
    monkeypatch.setattr(paged_backend, "ragged_masked_attention", refuse)
    return calls


def _forward(step, impl, layer):
    return impl.forward(layer, step.query, step.key, step.value, step.kv_cache, step.metadata)


PREFILL_CASES = [c for c in CASES if c[1]]  # every decoder case with a prefill


@pytest.mark.parametrize("as_decodes", [True, False], ids=["as-decodes", "ragged"])
@pytest.mark.parametrize("case", PREFILL_CASES, ids=[c[0] for c in PREFILL_CASES])
def test_decoder_prefills_run_native(case, as_decodes, rng, native_only, decodes, monkeypatch):
    """Plain, chunked and mixed steps (GQA / MQA, ALiBi, windows, soft cap, fp8 with scales,
    bf16) through one kernel call for the prefills: the ragged kernel, or for short prefills
    over a cached prefix the decode kernel over the split cache in place (`as_decodes`; its
    limit set to 0 to take the ragged path). Decodes stay on the decode kernel."""
    if not as_decodes:
        monkeypatch.setattr(ragged_prefill, "MAX_DECODE_QUERIES", 0)
    step, impl, layer = run_case(case, rng, TorchSDPABackend)
    out = _forward(step, impl, layer)
    prefills, num_decodes = case[1], len(case[2])
    rows = sum(q for q, _ in prefills)
    short = max(q for q, _ in prefills) <= ragged_prefill.MAX_DECODE_QUERIES
    if short and all(c for _, c in prefills):  # as decodes: one decode call, then the decodes'
        assert native_only == [] and decodes.rows == [rows] + [num_decodes] * (num_decodes > 0)
    else:
        assert native_only == [rows] and decodes.rows == [num_decodes] * (num_decodes > 0)
    assert impl.prefill_fallback is None
    assert_close(out.view(step.expected.shape).float(), step.expected, *case_dtypes(case))


# Every prefill case with each prefill over a cached prefix (5 tokens where it had none) and at
# most MAX_DECODE_QUERIES new tokens: speculative decoding's verify step, on every feature the
# cases cover (GQA / MQA, head sizes 64-256, ALiBi, windows, soft cap, e4m3 / e5m2, bf16).
SHORT_CASES = [
    (name + "-short", [(min(q, ragged_prefill.MAX_DECODE_QUERIES), c or 5) for q, c in pre], *rest)
    for name, pre, *rest in PREFILL_CASES
]


@pytest.mark.parametrize("case", SHORT_CASES, ids=[c[0] for c in SHORT_CASES])
def test_short_prefills_over_a_prefix_run_as_decodes(case, rng, native_only, decodes):
    """One decode call for the prefills' queries (each a decode over the split cache, read in
    place), one for the step's decodes; never the ragged kernel's copy."""
    step, impl, layer = run_case(case, rng, TorchSDPABackend)
    out = _forward(step, impl, layer)
    rows, num_decodes = sum(q for q, _ in case[1]), len(case[2])
    assert native_only == [] and decodes.rows == [rows] + [num_decodes] * (num_decodes > 0)
    assert impl.prefill_fallback is None
    assert_close(out.view(step.expected.shape).float(), step.expected, *case_dtypes(case))


# (prefills [(q_len, ctx_len)], decodes, Hq, Hkv, D, BS, dtype, cache, extras): the step's K/V
# viewed in place (lengths sharing a divisor >= 16, one above the 256 cap), copied to blocks
# of 16 (17 and 3), and long chunks over long prefixes, ragged against the block size.
LONG = [
    ("view-b64", [(64, 0), (192, 0)], [], 8, 2, 128, 16, torch.float32, "auto", {}),
    ("view-b150", [(300, 0), (600, 0)], [5], 4, 1, 64, 16, torch.bfloat16, "auto", {"alibi": 1}),
    ("copy-b1", [(17, 0), (3, 0), (40, 0)], [9], 8, 8, 64, 8, torch.float16, "auto", {}),
    (
        "chunk-long",
        [(100, 157), (2, 300), (33, 0)],
        [64, 1],
        8,
        2,
        128,
        16,
        torch.bfloat16,
        "auto",
        {"sliding_window": 90, "logits_soft_cap": 8.0},
    ),
    ("chunk-fp8-bs128", [(70, 200), (16, 128)], [300], 8, 2, 128, 128, torch.bfloat16, "fp8", {}),
]


@pytest.mark.parametrize("case", LONG, ids=[c[0] for c in LONG])
def test_long_prefills_run_native(case, rng, native_only):
    _name, prefills, decodes, hq, hkv, d, bs, dtype, cache_dtype, extras = case
    fp8 = cache_dtype != "auto"
    k_scale, v_scale = (0.45, 0.7) if fp8 else (1.0, 1.0)
    bias = dict(
        alibi_slopes=alibi(hq) if extras.get("alibi") else None,
        sliding_window=extras.get("sliding_window"),
        logits_soft_cap=extras.get("logits_soft_cap"),
    )
    step = make_decoder_step(
        rng,
        TorchSDPABackend.get_builder_cls()(None),
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
        scale=0.1,
        **bias,
    )
    impl = TorchSDPABackend.get_impl_cls()(hq, d, 0.1, hkv, kv_cache_dtype=cache_dtype, **bias)
    out = _forward(step, impl, AttentionLayer(k_scale, v_scale))
    assert len(native_only) == 1 and impl.prefill_fallback is None
    fp8_dtype = None if not fp8 else torch.float8_e4m3fn
    assert_close(out.view(step.expected.shape).float(), step.expected, dtype, fp8_dtype)


# Short prefills over a prefix: the decode kernel reads the strided query in place.
STRIDED = [
    *LONG[:3],
    ("as-decodes", [(4, 20), (2, 9)], [5], 8, 2, 64, 16, torch.bfloat16, "auto", {"alibi": 1}),
]


@pytest.mark.parametrize("case", STRIDED, ids=[c[0] for c in STRIDED])
def test_strided_prefill_inputs_are_staged(case, rng, monkeypatch):
    """vLLM's query, key and value are strided views of its fused qkv projection. Staged in
    reused buffers (the K/V viewed in place or copied to blocks of 16; as decodes, the query
    read in place), the step gives the bits of its contiguous copies, twice over the same
    buffers."""
    _name, prefills, decodes, hq, hkv, d, bs, dtype, cache_dtype, extras = case
    alibi_slopes = alibi(hq) if extras.get("alibi") else None
    step = make_decoder_step(
        rng, TorchSDPABackend.get_builder_cls()(None), prefills=prefills, decodes=decodes,
        num_heads=hq, num_kv_heads=hkv, head_size=d, block_size=bs, dtype=dtype,
        kv_cache_dtype=cache_dtype, scale=0.1, alibi_slopes=alibi_slopes,
    )  # fmt: skip
    impl = TorchSDPABackend.get_impl_cls()(
        hq, d, 0.1, hkv, alibi_slopes=alibi_slopes, sliding_window=None, kv_cache_dtype="auto"
    )
    layer = AttentionLayer(1.0, 1.0)
    parts = (step.query, step.key, step.value)
    fused = torch.cat([x.reshape(x.shape[0], -1) for x in parts], dim=1)
    ends = np.cumsum([x[0].numel() for x in parts])
    views = [
        fused[:, end - x[0].numel() : end].unflatten(1, x.shape[1:])
        for x, end in zip(parts, ends, strict=True)
    ]
    assert not any(v.is_contiguous() for v in views)
    want = _forward(step, impl, layer).clone()
    monkeypatch.setattr(native, "STAGE_MIN_BYTES", 0)
    for _ in range(2):
        got = impl.forward(layer, *views, step.kv_cache, step.metadata)
        assert torch.equal(got, want)


@pytest.mark.parametrize("attn_type", [AttentionType.ENCODER, AttentionType.ENCODER_ONLY])
@pytest.mark.parametrize(
    "lens, bias",
    [([32, 48], {"sliding_window": 5}), ([5, 1, 12], {"alibi": True, "logits_soft_cap": 3.0})],
    ids=["view-window", "copy-alibi-softcap"],
)
def test_encoder_runs_native(attn_type, lens, bias, rng, native_only):
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    hq, hkv, d = 8, 2, 64
    q, k, v = (torch.randn(sum(lens), h, d, generator=gen) for h in (hq, hkv, hkv))
    bias = dict(
        alibi_slopes=alibi(hq) if bias.get("alibi") else None,
        sliding_window=bias.get("sliding_window"),
        logits_soft_cap=bias.get("logits_soft_cap"),
    )
    impl = TorchSDPABackend.get_impl_cls()(
        hq, d, 0.1, hkv, kv_cache_dtype="auto", attn_type=attn_type, **bias
    )
    md = TorchSDPABackend.get_builder_cls()(None).build(
        [], [], -1, -1, block_tables=[], block_size=16, encoder_seq_lens=lens
    )
    flat = [x.reshape(len(x), -1) for x in (q, k, v)]
    out = impl.forward(AttentionLayer(), *flat, torch.empty(0), md)
    expected = reference_attention(q, k, v, lens, lens, causal=False, scale=0.1, **bias)
    assert len(native_only) == 1 and impl.prefill_fallback is None
    assert_close(out.view(-1, hq, d).float(), expected, torch.float32)


def _cross_step(rng, dec_lens, enc_lens, dtype=torch.float32, block_size=8):
    """Cross attention: the encoder K/V written by a first decoder prefill, then a second
    prefill (key=None) that reads them from the NaN-poisoned cache. Returns both outputs and
    their references, and the impl."""
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    hq, hkv, d, bs = 4, 2, 64, block_size
    cross_tables = [[2, 5], [0]]
    kv_cache = torch.full(
        TorchSDPABackend.get_kv_cache_shape(7, bs, hkv, d), float("nan"), dtype=dtype
    )
    enc_k, enc_v = (torch.randn(sum(enc_lens), hkv, d, generator=gen).to(dtype) for _ in "kv")
    impl = TorchSDPABackend.get_impl_cls()(
        hq, d, d**-0.5, hkv, attn_type=AttentionType.ENCODER_DECODER,
        alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto",
    )  # fmt: skip
    builder = TorchSDPABackend.get_builder_cls()(None)
    tables = dict(block_size=bs, encoder_seq_lens=enc_lens, cross_block_tables=cross_tables)
    results = []
    for given in (True, False):
        md = builder.build(dec_lens, dec_lens, -1, -1, block_tables=[[1], [3]], **tables)
        q = torch.randn(sum(dec_lens), hq, d, generator=gen).to(dtype)
        kv = [x.view(len(x), -1) for x in (enc_k, enc_v)] if given else [None, None]
        out = impl.forward(AttentionLayer(), q.view(len(q), -1), *kv, kv_cache, md)
        expected = reference_attention(
            q, enc_k, enc_v, dec_lens, enc_lens, causal=False, scale=d**-0.5
        )
        results.append((out.view(-1, hq, d).float(), expected))
    return results, impl


def test_cross_attention_runs_native(rng, native_only):
    """The first step over the given encoder K/V, the second over the cached ones."""
    results, impl = _cross_step(rng, [3, 2], [11, 4])
    assert native_only == [5, 5] and impl.prefill_fallback is None
    for out, expected in results:
        assert_close(out, expected, torch.float32)


def test_cross_attention_longer_decoder_falls_back(rng):
    """More decoder queries than encoder keys: the kernel needs q_len <= kv_len, so this
    prefill runs in torch, says why, and is still correct."""
    results, impl = _cross_step(rng, [3, 6], [11, 4])
    assert impl.prefill_fallback == (
        "sequence 1 has 6 queries over 4 keys (the kernel needs q <= kv)"
    )
    for out, expected in results:
        assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("slots", ["padded", "swapped"])
def test_short_prefills_as_decodes_only_over_their_written_keys(slots, rng, native_only, decodes):
    """A short prefill over a cached prefix runs as decodes only where this step wrote every new
    key where its block table reads it. A new key padded (-1: not written) or two new keys'
    slots swapped (each written where the other's position is read) leave the cache without
    them there (NaN, or the other's K/V): the step takes the ragged path over the K/V as
    given, and the output is still the reference's."""
    step = make_decoder_step(
        rng, TorchSDPABackend.get_builder_cls()(None), prefills=[(3, 9), (2, 5)], decodes=[7],
        num_heads=8, num_kv_heads=2, head_size=64, block_size=8,
    )  # fmt: skip
    mapping = step.metadata.slot_mapping.clone()
    if slots == "padded":
        mapping[1] = -1
    else:
        mapping[[0, 2]] = mapping[[2, 0]]
    step.metadata.slot_mapping = mapping
    impl = TorchSDPABackend.get_impl_cls()(
        8, 64, 64**-0.5, 2, alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto"
    )
    out = _forward(step, impl, AttentionLayer())
    assert native_only == [5] and decodes.rows == [1]
    assert_close(out.view(step.expected.shape).float(), step.expected, torch.float32)


def test_as_decodes_lengths_and_tables(monkeypatch):
    """Query j of a sequence with q new tokens over kv keys: a decode of length kv - q + j + 1
    through the sequence's table row (sequences of 2, 0 and 3 new tokens)."""
    seen = {}

    def record(out, query, key_cache, value_cache, tables, lens, **kwargs):
        seen.update(tables=tables.tolist(), lens=lens.tolist())
        return out

    monkeypatch.setattr(native, "paged_decode_split", record)
    tables = torch.tensor([[4, 1], [2, 0], [3, 5]], dtype=torch.int32)
    q = torch.zeros(5, 2, 64)
    kw = dict(kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0, scale=0.1, alibi_slopes=None)
    ragged_prefill.as_decodes(
        q, q, None, None, tables, [2, 0, 3], [7, 4, 10],
        sliding_window=None, logits_soft_cap=None, **kw,
    )  # fmt: skip
    assert seen == {"tables": [[4, 1], [4, 1], [3, 5], [3, 5], [3, 5]], "lens": [6, 7, 8, 9, 10]}
    # Positions 5, 6 of sequence 0 (block 4) and 7 (block 3), 8, 9 (block 5) of sequence 2.
    written = torch.tensor([37, 38, 31, 40, 41])
    holds = partial(ragged_prefill.cache_holds_new_keys, block_tables=tables, q_lens=[2, 0, 3])
    assert holds(written, kv_lens=[7, 4, 10], block=8)
    assert not holds(torch.tensor([37, 38, 31, -1, 41]), kv_lens=[7, 4, 10], block=8)
    assert not holds(torch.tensor([37, 38, 40, 31, 41]), kv_lens=[7, 4, 10], block=8)
    assert not holds(written[:4], kv_lens=[7, 4, 10], block=8)  # a new key without a slot
    assert not holds(written, kv_lens=[7, 4, 10], block=4)  # 10 keys past 2 blocks of 4


def test_disabled_native_runs_torch(rng, monkeypatch):
    """`JAX_ATTN_CPU_DISABLE=1`: the vectorized torch path, never the kernel, same results."""
    monkeypatch.setenv("JAX_ATTN_CPU_DISABLE", "1")
    monkeypatch.setattr(native, "_state", {"warned": True, **native._state})  # warned already
    monkeypatch.setattr(native, "ragged_paged_attention", None)  # a call would raise
    for case in [c for c in PREFILL_CASES if c[0] in ("chunked-gqa8", "alibi", "fp8-e4m3")]:
        step, impl, layer = run_case(case, rng, TorchSDPABackend)
        out = _forward(step, impl, layer)
        assert impl.prefill_fallback == "native kernels unavailable: disabled by " + (
            "JAX_ATTN_CPU_DISABLE=1"
        )
        assert_close(out.view(step.expected.shape).float(), step.expected, *case_dtypes(case))


def test_unsupported_reasons():
    q = torch.zeros(4, 2, 64)
    assert ragged_prefill.unsupported(q, [4], [4]) is None
    assert "float64" in ragged_prefill.unsupported(q.double(), [4], [4])
    assert "head size 512" in ragged_prefill.unsupported(torch.zeros(4, 2, 512), [4], [4])
    assert "3 queries over 2 keys" in ragged_prefill.unsupported(q, [1, 3], [1, 2])


def test_forward_prefix_runs_native(rng, native_only):
    """vLLM's `PagedAttention.forward_prefix` (the split-layout ops file) on the kernel."""
    case = next(c for c in CASES if c[0] == "window-chunked-alibi")
    step, impl, layer = run_case(case, rng, TorchSDPABackend)
    _name, prefills, _decodes, hq, hkv, d, _bs, dtype, cache_dtype, extras = case
    impl.forward(layer, step.query, step.key, step.value, step.kv_cache, step.metadata)  # write
    native_only.clear()
    key_cache, value_cache = PagedAttention.split_kv_cache(step.kv_cache, hkv, d)
    n = sum(q for q, _ in prefills)
    md = step.metadata

    def prefix(key_cache, value_cache):
        return PagedAttention.forward_prefix(
            step.query[:n].view(n, hq, d),
            step.key[:n].view(n, hkv, d),
            step.value[:n].view(n, hkv, d),
            cache_dtype,
            key_cache,
            value_cache,
            md.prefill_block_tables,
            md.query_start_loc,
            torch.tensor(md.seq_lens),
            md.max_query_len,
            torch.tensor(alibi(hq)),
            extras["sliding_window"],
            1.0,
            1.0,
            scale=impl.scale,
        )

    out = prefix(key_cache, value_cache)
    assert native_only == [n]
    assert_close(out.float(), step.expected[:n], dtype)
    # Caches that are strided views (the public API takes any): the blocks are gathered by
    # index_select instead of the native gather, the same bits.
    strided = []
    for cache in (key_cache, value_cache):
        wide = torch.full((*cache.shape, 2), float("nan"), dtype=cache.dtype)
        wide[..., 0] = cache
        strided.append(wide[..., 0])
    assert not strided[0].is_contiguous() and not strided[1].is_contiguous()
    assert torch.equal(prefix(*strided), out)


def test_out_rows_of_a_mixed_step_written_in_place(rng):
    """The caller's `output` receives the prefill rows straight from the kernel; poison in it
    never shows (every row is written)."""
    case = next(c for c in CASES if c[0] == "mixed-gqa4")
    step, impl, layer = run_case(case, rng, TorchSDPABackend)
    output = torch.full_like(step.query, float("nan"))
    out = impl.forward(
        layer, step.query, step.key, step.value, step.kv_cache, step.metadata, output=output
    )
    assert out.data_ptr() == output.data_ptr()
    assert_close(output.view(step.expected.shape).float(), step.expected, torch.float32)
    assert not np.isnan(output.numpy()).any()

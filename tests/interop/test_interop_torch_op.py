"""The JAX core as torch ops and the "JAX" backend: float64 agreement, opcheck, compile."""

import dataclasses
import itertools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tolerances import assert_close

sys.path.insert(0, str(Path(__file__).parents[1] / "torch"))
from test_torch_sdpa import CASES, _run, alibi
from torch_cases import case_scale

from interop.torch_op import (
    JaxAttnBackend,
    JaxAttnBackendImpl,
    paged_attention_op,
    varlen_attention_op,
)
from torch_backends import AttentionLayer, AttentionType, get_attn_backend
from torch_backends.torch_sdpa import TorchSDPAMetadataBuilder

JAX_CASES = [
    c
    for c in CASES
    if c[0]
    in (
        "prefill-only",
        "mixed-gqa4",
        "chunked-gqa8",
        "bf16",
        "alibi-chunked",
        "window-chunked-alibi",
        "softcap",
        "fp8-e4m3",
        "fp8-e5m2",
    )
]


def _impl(case):
    _n, _p, _d, hq, hkv, d, _bs, _dt, cache_dtype, extras = case
    return JaxAttnBackendImpl(
        hq,
        d,
        case_scale(case),
        hkv,
        kv_cache_dtype=cache_dtype,
        alibi_slopes=alibi(hq) if extras.get("alibi") else None,
        sliding_window=extras.get("sliding_window"),
        logits_soft_cap=extras.get("logits_soft_cap"),
    )


@pytest.mark.parametrize("case", JAX_CASES, ids=[c[0] for c in JAX_CASES])
def test_jax_backend_matches_float64_and_sdpa(case, rng):
    seed = int(rng.integers(2**31))
    step, sdpa, layer, dtypes = _run(case, np.random.default_rng(seed), layout="nhd")
    out = _impl(case).forward(layer, step.query, step.key, step.value, step.kv_cache, step.metadata)
    hq, d = case[3], case[5]
    assert_close(out.view(-1, hq, d).float(), step.expected, *dtypes)
    s = _run(case, np.random.default_rng(seed))[0]
    ref = sdpa.forward(layer, s.query, s.key, s.value, s.kv_cache, s.metadata)
    assert_close(out.float(), ref.float(), *dtypes)


def test_registry():
    assert get_attn_backend("JAX") is JaxAttnBackend


def test_encoder_through_varlen_op(rng):
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    lens = [4, 9]
    q, k, v = (torch.randn(13, h, 64, generator=gen) for h in (4, 2, 2))
    impl = JaxAttnBackendImpl(
        4,
        64,
        0.125,
        2,
        attn_type=AttentionType.ENCODER_ONLY,
        sliding_window=3,
        alibi_slopes=None,
        kv_cache_dtype="auto",
    )
    md = TorchSDPAMetadataBuilder(None).build(
        [], [], -1, -1, block_tables=[], block_size=16, encoder_seq_lens=lens
    )
    out = impl.forward(
        AttentionLayer(), q.view(13, -1), k.view(13, -1), v.view(13, -1), torch.empty(0), md
    )
    from torch_cases import reference_attention

    expected = reference_attention(q, k, v, lens, lens, causal=False, scale=0.125, sliding_window=3)
    assert_close(out.view(13, 4, 64), expected, torch.float32)


def _op_args(rng):
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    nb, bs, hkv, d = 6, 8, 2, 64
    kc = torch.randn(nb, bs, hkv, d, generator=gen)
    vc = torch.randn(nb, bs, hkv, d, generator=gen)
    q = torch.randn(5, 4, d, generator=gen)
    return (
        q,
        kc,
        vc,
        torch.tensor([0, 4, 5], dtype=torch.int32),
        torch.tensor([4, 12], dtype=torch.int32),
        torch.tensor([[3, 0], [1, 5]], dtype=torch.int32),
        0.125,
        True,
        None,
        -1,
        -1.0,
        1.0,
        1.0,
    )


@pytest.mark.parametrize(
    "index, name", [(3, "query_start_loc"), (4, "seq_lens"), (5, "block_tables")]
)
def test_paged_op_int64_past_int32_raises(index, name, rng):
    """int64 index tensors cross checked: 2**32 + 3 raises instead of becoming 3 (block 3,
    a valid id here); in-range int64 gives the int32 result exactly."""
    args = list(_op_args(rng))
    want = paged_attention_op(*args)
    wide = [a.long() if i in (3, 4, 5) else a for i, a in enumerate(args)]
    torch.testing.assert_close(paged_attention_op(*wide), want, rtol=0, atol=0)
    bad = args[index].long().clone()
    bad.view(-1)[-1] = 2**32 + int(bad.view(-1)[-1])  # wraps to the original value
    wide[index] = bad
    with pytest.raises(OverflowError, match=rf"^{name} holds \d+, outside int32"):
        paged_attention_op(*wide)
    with pytest.raises(OverflowError, match=rf"^{name} holds"):
        torch.ops.jax_attn.paged_attention(*wide)


@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_k"])
def test_varlen_op_int64_past_int32_raises(name, rng):
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    q, k, v = (torch.randn(7, h, 64, generator=gen) for h in (4, 2, 2))
    cu = {n: torch.tensor([0, 3, 7]) for n in ("cu_seqlens_q", "cu_seqlens_k")}
    cu[name] = torch.tensor([0, 2**32 + 3, 7])
    with pytest.raises(OverflowError, match=rf"^{name} holds 4294967299, outside int32"):
        varlen_attention_op(q, k, v, cu["cu_seqlens_q"], cu["cu_seqlens_k"], 0.125, False,
                            None, -1, -1.0)  # fmt: skip


def test_opcheck(rng):
    torch.library.opcheck(paged_attention_op, _op_args(rng))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(7, h, 64, generator=gen) for h in (4, 2, 2))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    torch.library.opcheck(varlen_attention_op, (q, k, v, cu, cu, 0.125, False, None, 4, 5.0))


def test_torch_compile_fullgraph(rng):
    args = _op_args(rng)

    def step(q, kc, vc, qsl, seq_lens, tables):
        return (
            torch.ops.jax_attn.paged_attention(q * 2, kc, vc, qsl, seq_lens, tables, *args[6:]) + 1
        )

    compiled = torch.compile(step, fullgraph=True)  # inductor, the default backend
    eager = step(*args[:6])
    torch.testing.assert_close(compiled(*args[:6]), eager)


@pytest.mark.parametrize("case", [c for c in JAX_CASES if c[1] and c[2]], ids=lambda c: c[0])
def test_jax_backend_one_ragged_call_per_step(case, rng, monkeypatch):
    """Prefills (plain and chunked) and decodes of a step go to the ragged op together, once,
    with the batch's own `query_start_loc`; the varlen op is not called."""
    import interop.torch_op as torch_op

    calls = {"paged": [], "varlen": 0}
    paged, varlen = torch_op.paged_attention_op, torch_op.varlen_attention_op

    def count_paged(*args, **kwargs):
        calls["paged"].append(args)
        return paged(*args, **kwargs)

    def count_varlen(*args, **kwargs):
        calls["varlen"] += 1
        return varlen(*args, **kwargs)

    monkeypatch.setattr(torch_op, "paged_attention_op", count_paged)
    monkeypatch.setattr(torch_op, "varlen_attention_op", count_varlen)
    step, _, layer, dtypes = _run(case, rng, layout="nhd")
    out = _impl(case).forward(layer, step.query, step.key, step.value, step.kv_cache, step.metadata)
    assert len(calls["paged"]) == 1 and calls["varlen"] == 0
    (args,) = calls["paged"]
    # Every row's running query length (TORCH_SDPA's own query_start_loc covers the prefills).
    md = step.metadata
    q_lens = torch.diff(md.query_start_loc).tolist() if md.num_prefills else []
    assert args[3].tolist() == [0, *itertools.accumulate(q_lens + [1] * md.num_decode_tokens)]
    assert args[4].tolist() == step.seq_lens
    assert_close(out.view(-1, case[3], case[5]).float(), step.expected, *dtypes)


def test_jax_backend_prefills_without_tables_use_varlen(rng, monkeypatch):
    """TORCH_SDPA metadata without chunked prefill gives prefills no block tables: they run
    through the varlen op over the given K/V, the decodes through the ragged op."""
    import interop.torch_op as torch_op

    case = next(c for c in JAX_CASES if c[0] == "mixed-gqa4")
    counts = {"paged": 0, "varlen": 0}
    for name in counts:
        op = getattr(torch_op, f"{name}_attention_op")

        def counted(*args, _op=op, _name=name, **kwargs):
            counts[_name] += 1
            return _op(*args, **kwargs)

        monkeypatch.setattr(torch_op, f"{name}_attention_op", counted)
    step, _, layer, dtypes = _run(case, rng, layout="nhd")
    md = dataclasses.replace(step.metadata, chunked_prefill=False)
    out = _impl(case).forward(layer, step.query, step.key, step.value, step.kv_cache, md)
    assert counts == {"paged": 1, "varlen": 1}
    assert_close(out.view(-1, case[3], case[5]).float(), step.expected, *dtypes)

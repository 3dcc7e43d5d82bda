"""Safe by default, torch side: every bad input in reliability_cases.py raises from every
backend with its message and leaves the cache bit-identical; table entries past a sequence's
blocks may hold anything; the same inputs give the same bits; docs/reliability_torch.md is
what the cases give now.

IPEX runs in the IPEX environment (`pytest -m ipex`); JAX is the "JAX" torch backend.
"""

import gc
import weakref

import numpy as np
import pytest
import torch
from reliability_cases import (
    ACCEPTED,
    ACCEPTED_BACKENDS,
    BACKENDS,
    CASES,
    DOC,
    FP8_SCALES,
    HEADER,
    Case,
    Rows,
    backend_class,
    backend_param,
    cache_hash,
    fixed_metadata,
    forward,
    make_step,
    prepare,
    run_accepted,
    section,
    sections,
)
from tolerances import assert_close
from torch_cases import CASES as STEP_CASES
from torch_cases import run_case

from torch_backends import AttentionLayer

PARAMS = [
    pytest.param(backend.values[0], case, id=f"{backend.id}-{case.name}", marks=backend.marks)
    for backend in map(backend_param, BACKENDS)
    for case in CASES
]


@pytest.mark.parametrize("backend, case", PARAMS)
def test_bad_input_raises_and_leaves_the_cache(backend, case):
    kv_cache, call = prepare(case, backend)
    before = cache_hash(kv_cache)
    with pytest.raises(case.error, match=case.match):
        call()
    assert cache_hash(kv_cache) == before, f"{case.name}: the cache changed before the error"


def _checked_then_spoiled(case: Case, backend: str):
    """The fixed step through `backend` once (it passes and is remembered for the step's
    other layers), then `case`'s mistake made in place, in the same metadata object (or in
    the layer's scale tensors, or a key with rows dropped): (kv_cache, the second call)."""
    backend_cls, impl, kv_cache, query, key, value, build = make_step(
        backend, case.kv_cache_dtype, case.block_tables
    )
    md = fixed_metadata(backend_cls, build)
    layer = AttentionLayer(*(FP8_SCALES if case.kv_cache_dtype != "auto" else (1.0, 1.0)))
    assert torch.isfinite(forward(impl, layer, query, key, value, kv_cache, md)).all()
    if case.mutate is not None:
        case.mutate(md, Rows(backend))
    if case.scales is not None:  # in place: the tensors the first call found valid
        layer._k_scale.fill_(case.scales[0])
        layer._v_scale.fill_(case.scales[1])
    rows = key.shape[0] - case.drop_key_rows
    return kv_cache, lambda: forward(impl, layer, query, key[:rows], value[:rows], kv_cache, md)


IN_PLACE_PARAMS = [  # the builder's own refusals (block_tables given to it) left out
    p for p in PARAMS if p.values[1].block_tables is None
]


@pytest.mark.parametrize("backend, case", IN_PLACE_PARAMS)
def test_a_checked_step_spoiled_in_place_raises(backend, case, inference_mode):
    """The layers of a step reuse its checked plan (`checks.CheckedPlans`): a mistake made
    after a call, in place in the same metadata object or scale tensors, is still caught by
    the next layer with the same message, before anything is written. Under
    `torch.inference_mode()` too (the `inference_mode` fixture), where the tensors have no
    version counter to tell the write (their contents do)."""
    kv_cache, call = _checked_then_spoiled(case, backend)
    before = cache_hash(kv_cache)
    with pytest.raises(case.error, match=case.match):
        call()
    assert cache_hash(kv_cache) == before, f"{case.name}: the cache changed before the error"


@pytest.mark.parametrize("backend", [backend_param(b) for b in BACKENDS])
def test_a_step_is_checked_once_for_its_layers(backend, monkeypatch, inference_mode):
    """Four layers (each its own impl and scale tensors) over one step's metadata: the plan
    is checked by the first only, and again for the next step's metadata; every layer's
    output is the one a fresh check gives. The same under `torch.inference_mode()`."""
    from torch_backends import paged_backend

    calls = []
    real = paged_backend.check_step
    monkeypatch.setattr(
        paged_backend, "check_step", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    backend_cls, impl, kv_cache, query, key, value, build = make_step(backend)
    impls = [impl, *(make_step(backend)[1] for _ in range(3))]
    layers = [AttentionLayer(1.0, 1.0) for _ in impls]
    outs = []
    for step in range(2):
        md = fixed_metadata(backend_cls, build)
        for layer_impl, layer in zip(impls, layers, strict=True):
            outs.append(forward(layer_impl, layer, query, key, value, kv_cache, md))
        assert len(calls) == step + 1
    paged_backend._CHECKED_PLANS.clear()
    fresh = forward(impl, layers[0], query, key, value, kv_cache, md)
    assert len(calls) == 3
    for out in outs:
        assert torch.equal(out, fresh)


@pytest.mark.parametrize("backend", [backend_param(b) for b in BACKENDS])
def test_the_checked_plans_keep_no_step_alive(backend):
    """What a step builds on its metadata (TORCH_SDPA's masks: hundreds of MB for long
    prompts) goes with the step: the kept plans hold its field tensors, not the object."""
    backend_cls, impl, kv_cache, query, key, value, build = make_step(backend)
    md = fixed_metadata(backend_cls, build)
    forward(impl, AttentionLayer(1.0, 1.0), query, key, value, kv_cache, md)
    gone = weakref.ref(md)
    del md
    gc.collect()
    assert gone() is None


ACCEPTED_PARAMS = [
    pytest.param(b.values[0], case, marks=b.marks, id=f"{b.id}-{case.name}")
    for case in ACCEPTED
    for b in (backend_param(name) for name in ACCEPTED_BACKENDS[case.name])
]


@pytest.mark.parametrize("backend, case", ACCEPTED_PARAMS)
def test_valid_vllm_metadata_is_accepted(backend, case):
    """Metadata vLLM's runners build runs, with the same output and cache bits."""
    assert run_accepted(case, backend) == "yes"


@pytest.mark.parametrize("backend", [backend_param(b) for b in BACKENDS])
def test_the_unmutated_step_runs(backend):
    """The control: the step every case spoils runs, writes the cache and gives finite
    outputs (so each case's error is its own mistake's)."""
    kv_cache, call = prepare(Case("control", "nothing", None), backend)
    before = cache_hash(kv_cache)
    out = call()
    assert torch.isfinite(out).all()
    assert cache_hash(kv_cache) != before


def _garbage(md, rows: Rows, value):
    """`value` in every table entry past the blocks its sequence uses: prefill_0 (5 tokens)
    and decode 1 (3 tokens) use one block of their two columns."""
    prefill_tables = rows.prefill_tables(md).to(torch.int64)
    decode_tables = md.block_tables.to(torch.int64)
    if rows.backend in ("TORCH_SDPA", "JAX"):
        md.prefill_block_tables, md.block_tables = prefill_tables, decode_tables
    else:
        md.block_tables = prefill_tables = decode_tables
    prefill_tables[0, 1] = value
    decode_tables[rows.decode(1), 1] = value


@pytest.mark.parametrize("backend", [backend_param(b) for b in BACKENDS])
@pytest.mark.parametrize("value", [-1, 12, 10**6, 2**32 + 3])
def test_unused_table_entries_may_hold_anything(backend, value):
    """Entries past a sequence's blocks are never read: the same bits as with zeros there."""
    clean_cache, clean = prepare(Case("clean", "", None), backend)
    dirty_cache, dirty = prepare(Case("dirty", "", lambda md, r: _garbage(md, r, value)), backend)
    out, want = dirty(), clean()
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
    assert cache_hash(dirty_cache) == cache_hash(clean_cache)


@pytest.mark.parametrize("backend", [backend_param(b) for b in BACKENDS])
def test_doc_is_current(backend):
    """docs/reliability_torch.md holds what the cases give now (regenerate it with
    `python tests/torch/reliability_cases.py`, in the IPEX environment for IPEX)."""
    text = DOC.read_text()
    assert text.startswith(HEADER), "the doc's header is stale: regenerate it"
    assert sections(text).get(backend) == section(backend), (
        f"docs/reliability_torch.md's {backend} section differs from what the code gives: "
        "run `python tests/torch/reliability_cases.py`"
    )


# -- determinism ---------------------------------------------------------------------------

DETERMINISM_CASES = [
    "mixed-gqa4",
    "chunked-gqa8",
    "bf16",
    "alibi-chunked",
    "window-chunked-alibi",
    "softcap",
    "fp8-e5m2",
]


@pytest.mark.parametrize("backend", [backend_param(b) for b in BACKENDS])
@pytest.mark.parametrize("name", DETERMINISM_CASES)
def test_same_inputs_same_bits(backend, name, rng):
    """Two calls on the same inputs (a fresh copy of the same cache each) give bit-identical
    outputs and caches: no backend here depends on thread timing or call history."""
    case = next(c for c in STEP_CASES if c[0] == name)
    step, impl, layer = run_case(case, np.random.default_rng(int(rng.integers(2**31))),
                                 backend_class(backend))  # fmt: skip
    results = []
    for _ in range(2):
        kv_cache = step.kv_cache.clone()
        out = impl.forward(layer, step.query, step.key, step.value, kv_cache, step.metadata)
        results.append((out.view(torch.uint8), kv_cache.view(torch.uint8)))
    (out_a, cache_a), (out_b, cache_b) = results
    assert torch.equal(out_a, out_b), f"{backend} {name}: outputs differ between two calls"
    assert torch.equal(cache_a, cache_b), f"{backend} {name}: caches differ between two calls"
    # A fresh impl and layer give the same bits too (no state kept between calls).
    fresh = type(impl)(
        impl.num_heads,
        impl.head_size,
        impl.scale,
        impl.num_kv_heads,
        alibi_slopes=None if impl.alibi_slopes is None else impl.alibi_slopes.tolist(),
        sliding_window=impl.sliding_window,
        kv_cache_dtype=impl.kv_cache_dtype,
        logits_soft_cap=impl.logits_soft_cap,
    )
    kv_cache = step.kv_cache.clone()
    scales = (layer._k_scale_float, layer._v_scale_float)
    out = fresh.forward(
        AttentionLayer(*scales), step.query, step.key, step.value, kv_cache, step.metadata
    )
    assert torch.equal(out.view(torch.uint8), out_a)


# -- the cache write on its own, and cross attention ------------------------------------------


@pytest.mark.parametrize(
    "slots, match",
    [
        ([0, 12], r"slot_mapping value 12 is out of range: the cache has 12 slots"),
        ([-2, 1], r"slot_mapping value -2 is out of range: .* or -1 \(PAD_SLOT_ID\)"),
        ([5, 5], r"slot_mapping writes slot 5 twice \(slot_mapping\[0\] and \[1\]\)"),
    ],
    ids=["past", "below-pad", "twice"],
)
def test_write_to_paged_cache_checks_first(slots, match, rng):
    """vLLM's `write_to_paged_cache` (called without `forward`) checks its slots too."""
    from torch_backends.paged_attn import PagedAttention

    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    kv_cache = torch.randn(2, 3, 4 * 2 * 16, generator=gen)
    key_cache, value_cache = PagedAttention.split_kv_cache(kv_cache, 2, 16)
    x = torch.randn(2, 2, 16, generator=gen)
    before = cache_hash(kv_cache)
    with pytest.raises(ValueError, match=match):
        PagedAttention.write_to_paged_cache(
            x, x, key_cache, value_cache, torch.tensor(slots), "auto", 1.0, 1.0
        )
    assert cache_hash(kv_cache) == before


def _cross_step(backend, rng, decode=False):
    """A decoder prefill over an 11- and a 4-token encoder output, cross tables [[2, 5], [0]]
    of 7 blocks of 8; with `decode`, the next step: one token per sequence, the encoder K/V
    read from the cache through the cross tables (key and value None)."""
    from torch_backends import AttentionType

    backend_cls = backend_class(backend)
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    kv_cache = torch.randn(backend_cls.get_kv_cache_shape(7, 8, 2, 64), generator=gen)
    impl = backend_cls.get_impl_cls()(
        4,
        64,
        0.125,
        2,
        attn_type=AttentionType.ENCODER_DECODER,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
    )
    lens = ([4, 3], [1, 1]) if decode else ([3, 2], [3, 2])
    md = backend_cls.get_builder_cls()(None).build(
        *lens, -1, -1, block_tables=[[1], [3]], block_size=8, encoder_seq_lens=[11, 4],
        cross_block_tables=[[2, 5], [0]],
    )  # fmt: skip
    q = torch.randn(sum(lens[1]), 4 * 64, generator=gen)
    if decode:
        return impl, kv_cache, md, q, None, None
    k, v = (torch.randn(15, 2 * 64, generator=gen) for _ in "kv")
    return impl, kv_cache, md, q, k, v


CROSS_ERRORS = [
    pytest.param(
        False,
        lambda md: md.cross_slot_mapping.__setitem__(4, 56),
        r"attn_metadata.cross_slot_mapping value 56 is out of range: the cache has 56 slots",
        id="cross-slot-past-cache",
    ),
    pytest.param(
        False,
        lambda md: md.cross_slot_mapping.__setitem__(12, 3),
        r"attn_metadata.cross_slot_mapping writes slot 3 twice",
        id="cross-slot-twice",
    ),
    # The first step brings every encoder key (vLLM gives it `[S, 0]` cross tables); the
    # decodes read them through the tables.
    pytest.param(
        True,
        lambda md: md.cross_block_tables.__setitem__((0, 1), 7),
        r"attn_metadata.cross_block_tables\[0, 1\]=7 is out of range",
        id="cross-block-past-cache",
    ),
]


@pytest.mark.parametrize("backend", [backend_param(b) for b in BACKENDS])
@pytest.mark.parametrize("decode, mutate, match", CROSS_ERRORS)
def test_cross_attention_bad_input_leaves_the_cache(backend, decode, mutate, match, rng):
    impl, kv_cache, md, q, k, v = _cross_step(backend, rng, decode)
    mutate(md)
    before = cache_hash(kv_cache)
    with pytest.raises(ValueError, match=match):
        impl.forward(AttentionLayer(), q, k, v, kv_cache, md)
    assert cache_hash(kv_cache) == before


def test_builder_rejects_negative_cross_blocks():
    from torch_backends.torch_sdpa import TorchSDPAMetadataBuilder

    with pytest.raises(ValueError, match=r"cross_block_tables\[1\]\[0\]=-1 must be a block id"):
        TorchSDPAMetadataBuilder(None).build(
            [3, 2], [3, 2], -1, -1, block_tables=[[1], [3]], block_size=8, encoder_seq_lens=[11, 4],
            cross_block_tables=[[2, 5], [-1]],
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"cross_block_tables\[0\] has 1 blocks of 8 for enc"):
        TorchSDPAMetadataBuilder(None).build(
            [3, 2], [3, 2], -1, -1, block_tables=[[1], [3]], block_size=8, encoder_seq_lens=[11, 4],
            cross_block_tables=[[2], [0]],
        )  # fmt: skip


@pytest.mark.parametrize("backend", [backend_param(b) for b in BACKENDS])
def test_wrong_output_buffer_raises_before_the_write(backend):
    # The fixed step with an output buffer one row short.
    from reliability_cases import BLOCK_SIZE, BLOCK_TABLES, QUERY_LENS, SEQ_LENS, make_step

    backend_cls, impl, kv_cache, query, key, value, build = make_step(backend)
    md = backend_cls.get_builder_cls()(None).build(SEQ_LENS, QUERY_LENS, -1, -1, **build)
    assert build == dict(block_tables=BLOCK_TABLES, block_size=BLOCK_SIZE)
    before = cache_hash(kv_cache)
    with pytest.raises(ValueError, match=r"output has shape \(9, 256\), expected \[10, 256\]"):
        impl.forward(AttentionLayer(), query, key, value, kv_cache, md, output=query[:9].clone())
    assert cache_hash(kv_cache) == before


@pytest.mark.parametrize("backend", [backend_param(b) for b in BACKENDS])
def test_empty_sequences_are_valid(backend, rng):
    """A sequence with no tokens, and a prefill with no new token, change nothing for the
    others: the decode's output is the same bits as in a step without them."""
    backend_cls = backend_class(backend)
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    kv_cache = torch.randn(backend_cls.get_kv_cache_shape(12, 8, 2, 64), generator=gen)
    impl = backend_cls.get_impl_cls()(
        4, 64, 0.125, 2, alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto"
    )
    q = torch.randn(1, 256, generator=gen)
    k, v = (torch.randn(1, 128, generator=gen) for _ in "kv")
    builder = backend_cls.get_builder_cls()(None)
    outs = []
    for seq_lens, q_lens, tables in (
        ([0, 4, 11], [0, 0, 1], [[], [7], [4, 10]]),
        ([11], [1], [[4, 10]]),
    ):
        md = builder.build(seq_lens, q_lens, -1, -1, block_tables=tables, block_size=8)
        outs.append(forward(impl, AttentionLayer(), q, k, v, kv_cache.clone(), md))
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0].view(torch.uint8), outs[1].view(torch.uint8))


@pytest.mark.parametrize("backend", [backend_param(b) for b in BACKENDS])
def test_shared_prefix_slots_are_accepted(backend, rng):
    """vLLM's prefix caching gives two prompts of one step that share whole blocks the same
    slots (same positions, the same K/V up to rounding): accepted, the later write kept, the
    output as if each prompt ran alone. The same slots at different positions still raise
    before the write."""
    import warnings

    backend_cls = backend_class(backend)
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    kv_cache = torch.randn(backend_cls.get_kv_cache_shape(6, 8, 2, 64), generator=gen)
    impl = backend_cls.get_impl_cls()(4, 64, 0.125, 2, None, None, "auto")
    q1 = torch.randn(8, 256, generator=gen)
    k1, v1 = (torch.randn(8, 128, generator=gen) for _ in "kv")
    builder = backend_cls.get_builder_cls()(None)
    both = builder.build([8, 8], [8, 8], -1, -1, block_tables=[[2], [2]], block_size=8)
    alone = builder.build([8], [8], -1, -1, block_tables=[[2]], block_size=8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "XFORMERS: xformers has no CPU kernel")
        cache2 = kv_cache.clone()
        out2 = impl.forward(AttentionLayer(), q1.repeat(2, 1), k1.repeat(2, 1), v1.repeat(2, 1),
                            cache2, both)  # fmt: skip
        cache1 = kv_cache.clone()
        out1 = impl.forward(AttentionLayer(), q1, k1, v1, cache1, alone)
        if backend == "XFORMERS":
            # Its CPU path (no xformers kernel) is one dense einsum over the whole step under
            # the materialized block-diagonal bias: BLAS blocks a 16-key product differently
            # from an 8-key one (bits differ on the Zen 5 VM), so "as if alone" holds to float32
            # rounding, not bit for bit. Every other backend attends per sequence.
            for half in (out2[:8], out2[8:]):
                assert_close(half.numpy(), out1.numpy(), "float32")
        else:
            assert torch.equal(out2[:8], out1) and torch.equal(out2[8:], out1)
        assert cache_hash(cache2) == cache_hash(cache1)
        both.slot_mapping[8:] = both.slot_mapping[8:].roll(1)  # slot 16 at positions 0 and 1
        before = cache_hash(kv_cache)
        with pytest.raises(
            ValueError, match=r"writes slot 16 twice \(attn_metadata.slot_mapping\[0\] and \[9\]\)"
        ):
            impl.forward(AttentionLayer(), q1.repeat(2, 1), k1.repeat(2, 1), v1.repeat(2, 1),
                         kv_cache, both)  # fmt: skip
        assert cache_hash(kv_cache) == before

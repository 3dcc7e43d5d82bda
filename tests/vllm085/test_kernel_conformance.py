"""Kernel conformance with vLLM 0.8.5: the same random step through vLLM's own
`vllm.attention.backends.torch_sdpa.TorchSDPABackendImpl` and through ours
(`torch_backends.torch_sdpa.TorchSDPABackendImpl`).

Each backend gets its metadata from its own `TorchSDPAMetadataBuilder`, both fed the same
stand-in for vLLM's CPU model runner: an object with `chunked_prefill=False` and `input_data`,
vLLM's `ModelInputForCPUBuilder.ModelInputData` filled as `_compute_prompt_input_tokens` /
`_compute_decode_input_tokens` fill it (a decode's table and length already cut to the sliding
window's blocks). Encoder and cross-attention fields are then set on both metadata as
`CPUEncoderDecoderModelRunner._prepare_encoder_model_input_tensors` sets them. Per case:

- the two builders give the same metadata (every dataclass field of vLLM's class; tensors with
  the same dtype, shape and values);
- the outputs agree within the one tolerance rule (`tolerances.assert_close`: against each
  other as peers, `peer=True`), and each agrees with the float64 oracle
  (`torch_cases.reference_attention`) where vLLM is exact;
- the caches after the step are bit-identical (vLLM's split layout `[2, NB, BS*Hkv*D]`).
  Every byte of ours that the step does not write is NaN, so a stray read shows. vLLM's copy
  holds a large finite value there instead (`VLLM_FILL`): vLLM's CPU decode kernel multiplies
  the unused tail of a sequence's last block by a zero weight, and 0 * NaN made its output NaN.

Not compared: chunked prefill (a prefill over a cached prefix). vLLM 0.8.5's CPU backend runs
it only through IPEX's `flash_attn_varlen_func`, and IPEX is not installed here; so every
prefill here is a whole prompt. Mixed prefill + decode steps do run: vLLM's CPU runner makes
them only with chunked prefill, but its backend handles them unchunked too (prefills through
SDPA, decodes through the paged kernel).

Where vLLM 0.8.5 is not exact, a test per deviation reproduces vLLM's output with the float64
oracle under vLLM's rule and checks ours against the exact oracle (docs/torch_backends.md,
"Where we differ from vLLM 0.8.5, and why").

vLLM is imported only inside fixtures: the main environment collects this file and skips it.
"""

import dataclasses
import sys
from pathlib import Path

import engine_harness
import numpy as np
import pytest
import torch
from tolerances import assert_close, bound_ratio, dtype_name, max_error

sys.path.insert(0, str(Path(__file__).parents[1] / "torch"))
from torch_cases import alibi, nan_cache, put, reference_attention

pytestmark = pytest.mark.vllm085

BLOCK_SIZE = 16  # the only block size vLLM 0.8.5's CPU path takes without IPEX
DECODER, ENCODER, ENCODER_ONLY, CROSS = "decoder", "encoder", "encoder_only", "encoder_decoder"
# vLLM's cache copy holds this where ours holds NaN (every byte nothing wrote): vLLM's CPU
# `paged_attention_v1` weighs the unused tail of a decode's last block by 0 and still adds it
# in (0 * NaN = NaN), so NaN there turns its output NaN. Large, so a read with weight != 0 shows.
VLLM_FILL = 1024.0

# Measured over the module, for the terminal summary (and the docs' conformance table).
_figures = {
    "cases": 0,
    "max |ours - vLLM|": {},
    "caches bit-identical": 0,
    "caches": 0,
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One step. `prefills`: whole prompts (their lengths); `decodes`: decode sequences (their
    lengths, the new token included). Cross attention and ENCODER attention: `encoder_lens`,
    one encoder sequence per decoder sequence."""

    id: str
    prefills: tuple = ()
    decodes: tuple = ()
    num_heads: int = 4
    num_kv_heads: int = 4
    head_size: int = 64
    dtype: torch.dtype = torch.float32
    alibi: bool = False
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    attn_type: str = DECODER
    encoder_lens: tuple = ()

    @property
    def scale(self) -> float:
        return 0.8 * self.head_size**-0.5  # not the default 1/sqrt(D): a dropped scale shows

    @property
    def alibi_slopes(self) -> list[float] | None:
        return alibi(self.num_heads) if self.alibi else None


F32, BF16 = torch.float32, torch.bfloat16
# Sizes: seq lens 1..150 (odd ones, block-aligned ones, one past a block); GQA groups 1 and 4;
# head sizes 64, 80, 128; float32 and bfloat16. Windows here are ones vLLM decodes exactly
# (a decode's length <= window, or length - window a multiple of 16: test_deviation_window_decode
# covers the rest).
CASES = [
    Case("prefill-mha-d64-f32", prefills=(1, 3, 17, 100)),
    Case("prefill-gqa4-d128-bf16", prefills=(3, 17, 130), num_heads=8, num_kv_heads=2,
         head_size=128, dtype=BF16),
    Case("decode-gqa4-d80-f32", decodes=(2, 3, 17, 100, 129), num_heads=8, num_kv_heads=2,
         head_size=80),
    Case("decode-mha-d64-bf16", decodes=(2, 16, 17, 33, 150), dtype=BF16),
    Case("mixed-gqa4-d128-f32", prefills=(17, 1, 3), decodes=(5, 100, 48), num_heads=8,
         num_kv_heads=2, head_size=128),
    Case("mixed-gqa4-d80-bf16", prefills=(100, 3), decodes=(17, 2, 65), num_heads=8,
         num_kv_heads=2, head_size=80, dtype=BF16),
    Case("mixed-mha-d128-bf16", prefills=(1, 31), decodes=(129, 3), head_size=128, dtype=BF16),
    Case("alibi-mixed-gqa4-d64-f32", prefills=(3, 17, 100), decodes=(2, 40, 130), num_heads=8,
         num_kv_heads=2, alibi=True),
    Case("alibi-mixed-mha-d80-bf16", prefills=(3, 17, 40), decodes=(2, 40, 130), head_size=80,
         dtype=BF16, alibi=True),
    Case("window-mixed-gqa4-d64-f32", prefills=(3, 17, 100), decodes=(2, 20, 40, 88),
         num_heads=8, num_kv_heads=2, sliding_window=24),
    Case("window-mixed-mha-d128-bf16", prefills=(100, 5), decodes=(30, 69), head_size=128,
         dtype=BF16, sliding_window=37),
    Case("window-alibi-decode-gqa4-d64-f32", decodes=(3, 12, 28, 60), num_heads=8,
         num_kv_heads=2, alibi=True, sliding_window=12),
    Case("encoder-only-mha-d64-f32", prefills=(1, 3, 17, 100), attn_type=ENCODER_ONLY),
    Case("encoder-only-gqa4-d80-bf16", prefills=(5, 17, 120), num_heads=8, num_kv_heads=2,
         head_size=80, dtype=BF16, attn_type=ENCODER_ONLY),
    Case("encoder-gqa4-d64-f32", prefills=(1, 2), encoder_lens=(17, 100), num_heads=8,
         num_kv_heads=2, attn_type=ENCODER),
    Case("cross-prefill-mha-d64-f32", prefills=(1, 3), encoder_lens=(17, 100),
         attn_type=CROSS),
    Case("cross-prefill-gqa4-d128-bf16", prefills=(1, 5), encoder_lens=(3, 33), num_heads=8,
         num_kv_heads=2, head_size=128, dtype=BF16, attn_type=CROSS),
    Case("cross-decode-gqa4-d80-f32", decodes=(4, 9), encoder_lens=(3, 100), num_heads=8,
         num_kv_heads=2, head_size=80, attn_type=CROSS),
    Case("cross-decode-mha-d64-bf16", decodes=(2, 7, 3), encoder_lens=(17, 1, 64), dtype=BF16,
         attn_type=CROSS),
]  # fmt: skip


# -- the step: random data, the runner's input data, the caches ------------------------------


@dataclasses.dataclass
class Step:
    case: Case
    input_data: object  # vLLM's ModelInputForCPUBuilder.ModelInputData
    encoder_fields: dict | None  # what the enc-dec runner sets on the metadata after build
    query: torch.Tensor  # [T, Hq*D]
    key: torch.Tensor | None  # [T_kv, Hkv*D], the step's new keys (None: cross decode)
    value: torch.Tensor | None
    kv_cache: torch.Tensor  # [2, NB, BS*Hkv*D], NaN where nothing was written; [0] if unused
    q_lens: list[int]  # per sequence, for the oracle
    keys: list[torch.Tensor]  # per sequence, float64 `[L, Hkv, D]` as attended
    values: list[torch.Tensor]
    kv_starts: list[int]  # per sequence: vLLM's first key (the window's block), else 0


class RunnerInputs:
    """What a metadata builder reads from vLLM's CPU model runner (`ModelInputForCPUBuilder`):
    `chunked_prefill` (False: chunked prefill needs IPEX) and the step's `input_data`."""

    chunked_prefill = False

    def __init__(self, input_data):
        self.input_data = input_data


def _blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def make_step(case: Case, rng: np.random.Generator, model_input_data_cls) -> Step:
    """Random data for `case`, and the runner's `input_data` for it."""
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    hq, hkv, d, dtype = case.num_heads, case.num_kv_heads, case.head_size, case.dtype
    seq_lens = list(case.prefills) + list(case.decodes)  # decoder sequences
    kv_lens = list(case.encoder_lens) if case.encoder_lens else seq_lens  # what is attended
    uses_cache = case.attn_type in (DECODER, CROSS)
    # Blocks: each decoder sequence's own, then (cross attention) each encoder sequence's,
    # drawn from a shuffled pool with spares, so tables are scattered and unused blocks exist.
    wanted = [_blocks(n) for n in seq_lens]
    if case.encoder_lens:  # the enc-dec runner gives each encoder sequence cross blocks
        wanted += [_blocks(n) for n in case.encoder_lens]
    pool = rng.permutation(sum(wanted) + 3).tolist()
    tables = []
    for n in wanted:
        tables.append(pool[:n])
        pool = pool[n:]
    self_tables, cross_tables = tables[: len(seq_lens)], tables[len(seq_lens) :]
    if uses_cache:
        kv_cache = nan_cache(sum(wanted) + 3, BLOCK_SIZE, hkv, d, dtype, "auto")
    else:
        kv_cache = torch.empty(0, dtype=dtype)  # ENCODER / ENCODER_ONLY: no cache

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    # The runner's input data, filled as vLLM's CPU runner fills it.
    data = model_input_data_cls(use_mrope=False)
    for seq_len, table in zip(case.prefills, self_tables[: len(case.prefills)], strict=True):
        # _compute_prompt_input_tokens; encoder-only models have no block table and no slots
        if case.attn_type == ENCODER_ONLY:
            data.prefill_block_tables.append(None)
        else:
            data.slot_mapping.extend(
                table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len)
            )
            data.prefill_block_tables.append(table)
        data.num_prefills += 1
        data.num_prefill_tokens += seq_len
        data.query_lens.append(seq_len)
        data.seq_lens.append(seq_len)
    kv_starts = [0] * len(seq_lens)
    for i, seq_len in enumerate(case.decodes, start=len(case.prefills)):
        # _compute_decode_input_tokens: the slot through the whole table, then (window) the
        # table and length cut to start at the block holding the window's first key
        table = self_tables[i]
        pos = seq_len - 1
        data.slot_mapping.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        if case.sliding_window and case.attn_type == DECODER:
            start = max(0, seq_len - case.sliding_window) // BLOCK_SIZE * BLOCK_SIZE
            seq_len, table, kv_starts[i] = seq_len - start, table[start // BLOCK_SIZE :], start
        data.max_decode_seq_len = max(data.max_decode_seq_len, seq_len)
        data.num_decode_tokens += 1
        data.decode_block_tables.append(table)
        data.query_lens.append(1)
        data.seq_lens.append(seq_len)

    # Keys/values: per attended sequence, all of them; the cached ones written into the cache
    # by index arithmetic (torch_cases.put), the new ones passed to forward.
    keys, values, new_k, new_v = [], [], [], []
    n_prefills = len(case.prefills)
    for i, kv_len in enumerate(kv_lens):
        k, v = randn(kv_len, hkv, d), randn(kv_len, hkv, d)
        keys.append(k.double())
        values.append(v.double())
        if case.attn_type == CROSS:
            cached = 0 if i < n_prefills else kv_len  # the encoder output, cached at prefill
            table = cross_tables[i]
        else:
            cached = 0 if i < n_prefills else kv_len - 1  # a decode's new token is the last
            table = self_tables[i] if uses_cache else None
        for p in range(cached):
            slot = table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            put(kv_cache, 0, slot, k[p], d, hkv, BLOCK_SIZE, "auto", 1.0)
            put(kv_cache, 1, slot, v[p], d, hkv, BLOCK_SIZE, "auto", 1.0)
        new_k.append(k[cached:])
        new_v.append(v[cached:])
    if case.attn_type in (ENCODER, CROSS):
        q_lens = list(case.encoder_lens) if case.attn_type == ENCODER else data.query_lens
    else:
        q_lens = list(data.query_lens)
    key = torch.cat(new_k).reshape(-1, hkv * d)
    value = torch.cat(new_v).reshape(-1, hkv * d)
    if case.attn_type == CROSS and not case.prefills:
        key = value = None  # cross-attention decode: the encoder's keys are all cached

    encoder_fields = None
    if case.encoder_lens:  # CPUEncoderDecoderModelRunner._prepare_encoder_model_input_tensors
        enc = list(case.encoder_lens)
        if case.prefills:  # prefill: the encoder's slots; an empty [S, 0] table
            cross_slots = torch.tensor(
                [
                    t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                    for n, t in zip(enc, cross_tables, strict=True)
                    for p in range(n)
                ],
                dtype=torch.long,
            )
            cross_block_tables = torch.tensor([], dtype=torch.int32).view(len(enc), -1)
        else:  # decode: no slots, each sequence's cross table
            cross_slots = torch.tensor([], dtype=torch.long)
            width = max(len(t) for t in cross_tables)
            cross_block_tables = torch.tensor(
                [t + [0] * (width - len(t)) for t in cross_tables], dtype=torch.int32
            )
        encoder_fields = dict(
            num_encoder_tokens=sum(enc),
            encoder_seq_lens=enc,
            encoder_seq_lens_tensor=torch.tensor(enc, dtype=torch.int32),
            max_encoder_seq_len=max(enc),
            cross_slot_mapping=cross_slots,
            cross_block_tables=cross_block_tables,
        )
    return Step(
        case=case,
        input_data=data,
        encoder_fields=encoder_fields,
        query=randn(sum(q_lens), hq * d),
        key=key,
        value=value,
        kv_cache=kv_cache,
        q_lens=q_lens,
        keys=keys,
        values=values,
        kv_starts=kv_starts,
    )


def oracle(step: Step, *, trimmed: bool = False, **overrides) -> torch.Tensor:
    """float64 attention of the step, `[T, Hq, D]`. `trimmed`: each sequence over the keys
    vLLM's runner leaves it (a decode's from its window's block on). `overrides` replace the
    case's causal / alibi_slopes / sliding_window / logits_soft_cap."""
    case = step.case
    starts = step.kv_starts if trimmed else [0] * len(step.keys)
    keys = [k[s:] for k, s in zip(step.keys, starts, strict=True)]
    values = [v[s:] for v, s in zip(step.values, starts, strict=True)]
    kwargs = dict(
        causal=case.attn_type == DECODER,
        alibi_slopes=case.alibi_slopes,
        sliding_window=case.sliding_window,
        logits_soft_cap=case.logits_soft_cap,
    )
    kwargs.update(overrides)
    return reference_attention(
        step.query.reshape(-1, case.num_heads, case.head_size),
        torch.cat(keys),
        torch.cat(values),
        step.q_lens,
        [len(k) for k in keys],
        scale=case.scale,
        **kwargs,
    )


# -- running a backend -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def backends():
    """{name: (builder class, impl class)} for vLLM's TORCH_SDPA and ours, and vLLM's
    ModelInputData (imported here: the main environment has no vLLM)."""
    from vllm.attention.backends import torch_sdpa as theirs
    from vllm.worker.cpu_model_runner import ModelInputForCPUBuilder

    from torch_backends import torch_sdpa as ours

    return {
        "vllm": (theirs.TorchSDPAMetadataBuilder, theirs.TorchSDPABackendImpl),
        "ours": (ours.TorchSDPAMetadataBuilder, ours.TorchSDPABackendImpl),
        "ModelInputData": ModelInputForCPUBuilder.ModelInputData,
    }


@dataclasses.dataclass
class Run:
    metadata: object
    metadata_fields: dict  # the dataclass fields, read before forward
    output: torch.Tensor  # [T, Hq, D]
    kv_cache: torch.Tensor


def run(backends, name: str, step: Step, **impl_overrides) -> Run:
    """`step` through one backend: its builder fed the runner's inputs, its impl's forward on
    its own copy of the cache."""
    from torch_backends import AttentionLayer

    builder_cls, impl_cls = backends[name]
    case = step.case
    builder = builder_cls(RunnerInputs(step.input_data))
    builder.prepare()
    data = step.input_data
    md = builder.build(data.seq_lens, data.query_lens, -1, -1)
    for field, value in (step.encoder_fields or {}).items():
        setattr(md, field, value)
    fields = {f.name: getattr(md, f.name) for f in dataclasses.fields(md)}
    params = dict(
        alibi_slopes=case.alibi_slopes,
        sliding_window=case.sliding_window,
        kv_cache_dtype="auto",
        logits_soft_cap=case.logits_soft_cap,
        attn_type=case.attn_type,
    )
    params.update(impl_overrides)
    impl = impl_cls(case.num_heads, case.head_size, case.scale, case.num_kv_heads, **params)
    kv_cache = step.kv_cache.clone()
    if name == "vllm":
        kv_cache = kv_cache.nan_to_num(VLLM_FILL)
    out = impl.forward(
        AttentionLayer(1.0, 1.0),
        step.query.clone(),
        None if step.key is None else step.key.clone(),
        None if step.value is None else step.value.clone(),
        kv_cache,
        md,
    )
    out = out.view(-1, case.num_heads, case.head_size)
    return Run(metadata=md, metadata_fields=fields, output=out, kv_cache=kv_cache)


def same_value(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    return type(a) is type(b) and a == b


def assert_same_metadata(ours: Run, theirs: Run) -> None:
    """Every dataclass field of vLLM's metadata, equal in ours."""
    for field, value in theirs.metadata_fields.items():
        assert field in ours.metadata_fields, f"our metadata lacks vLLM's field {field}"
        assert same_value(ours.metadata_fields[field], value), (
            f"{field}: ours {ours.metadata_fields[field]!r} != vLLM's {value!r}"
        )


def assert_within(
    out: torch.Tensor, expected: torch.Tensor, dtype, what: str, *, peer: bool = False
) -> None:
    """`out` within the one tolerance rule for `dtype` of `expected` (the float64 oracle, or
    with `peer=True` the other backend's output), elementwise, and finite."""
    assert_close(out.double().numpy(), expected.double().numpy(), dtype, what=what, peer=peer)


def record(case: Case, ours: Run, theirs: Run) -> None:
    diff = max_error(ours.output.double(), theirs.output.double())
    per_dtype = _figures["max |ours - vLLM|"]
    name = dtype_name(case.dtype)
    per_dtype[name] = max(per_dtype.get(name, 0.0), diff)
    _figures["cases"] += 1


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if _figures["cases"]:
        engine_harness.record("kernel conformance (vLLM's TorchSDPABackendImpl vs ours)", _figures)


# -- random cases: same metadata, same outputs, same cache bits -------------------------------


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_conformance(case, backends, rng):
    step = make_step(case, rng, backends["ModelInputData"])
    theirs = run(backends, "vllm", step)
    ours = run(backends, "ours", step)

    # (a) the same metadata from the same runner inputs
    assert_same_metadata(ours, theirs)

    # (b) outputs: ours against vLLM, and each against the float64 oracle
    record(case, ours, theirs)
    assert torch.isfinite(theirs.output).all(), "vLLM's output is not finite"
    assert_within(ours.output, theirs.output, case.dtype, "ours vs vLLM", peer=True)
    expected = oracle(step)
    assert_within(theirs.output, expected, case.dtype, "vLLM vs float64 oracle")
    assert_within(ours.output, expected, case.dtype, "ours vs float64 oracle")

    # (c) the caches after the step, byte for byte
    if step.kv_cache.numel():
        assert_same_caches(ours, theirs)


def assert_same_caches(ours: Run, theirs: Run) -> None:
    """The caches after the step are bit-identical; what neither wrote (NaN in ours,
    VLLM_FILL in vLLM's) is mapped back to the same NaN first."""
    _figures["caches"] += 1
    untouched = theirs.kv_cache == VLLM_FILL
    assert torch.equal(untouched, ours.kv_cache.isnan()), "the steps wrote different slots"
    theirs_nan = theirs.kv_cache.masked_fill(untouched, float("nan"))
    same = torch.equal(ours.kv_cache.view(torch.uint8), theirs_nan.view(torch.uint8))
    assert same, "caches differ after the step"
    _figures["caches bit-identical"] += 1


# -- where vLLM 0.8.5 is not exact: its rule reproduced in the oracle, ours exact ----------------


def run_deviation(case: Case, backends, rng) -> tuple[Step, Run, Run]:
    """`case` through both backends, their metadata and caches compared (outputs are the
    test's)."""
    step = make_step(case, rng, backends["ModelInputData"])
    theirs, ours = run(backends, "vllm", step), run(backends, "ours", step)
    assert_same_metadata(ours, theirs)
    if step.kv_cache.numel():
        assert_same_caches(ours, theirs)
    return step, theirs, ours


def assert_departs(name: str, theirs: Run, ours: Run, exact: torch.Tensor, dtype) -> None:
    """vLLM's output is off the exact answer by several times the one tolerance rule's bound
    (so the rule the test reproduces is what makes the difference); the figures go to the
    summary."""
    off = max_error(theirs.output.double(), exact)
    _figures.setdefault("deviations: max |vLLM - exact|, |ours - exact|", {})[name] = [
        off,
        max_error(ours.output.double(), exact),
    ]
    ratio = bound_ratio(theirs.output.double().numpy(), exact.double().numpy(), dtype)
    assert ratio > 5, f"vLLM is only {off:.3g} off the exact answer ({ratio:.3g}x the bound)"


def test_deviation_window_decode(backends, rng):
    """(i) A decode under a sliding window: vLLM's CPU runner cuts the block table to start at
    the block holding the window's first key, and its paged kernel applies no window, so a
    decode of length L attends to the last `L - (L - W) // 16 * 16` keys (up to W + 15)."""
    case = Case("window-decode", decodes=(20, 40, 61, 130), num_heads=8, num_kv_heads=2,
                sliding_window=12)  # fmt: skip
    step, theirs, ours = run_deviation(case, backends, rng)
    assert step.kv_starts == [0, 16, 48, 112]  # keys seen: 20, 24, 13, 18 (window 12)
    exact = oracle(step)
    assert_within(theirs.output, oracle(step, trimmed=True, sliding_window=None), F32, "vLLM")
    assert_within(ours.output, exact, F32, "ours")
    assert_departs("window-decode", theirs, ours, exact, F32)


def alibi_bias_bf16(slopes: list[float], seq_len: int) -> torch.Tensor:
    """vLLM 0.8.5's `_make_alibi_bias` rule in bfloat16, `[H, L, L]` as float64: positions
    counted in bfloat16 (`torch.arange(seq_len, dtype=bf16)`: 257 -> 256, 259 -> 260, ...),
    their difference and its product with the slope each rounded to bfloat16; causal."""
    pos = torch.arange(seq_len, dtype=BF16)
    distance = pos[None, :] - pos[:, None]  # [L, L] in bf16
    bias = distance[None].repeat(len(slopes), 1, 1)
    bias.mul_(torch.tensor(slopes, dtype=torch.float32)[:, None, None])  # rounded to bf16
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    return bias.double().masked_fill(~causal, float("-inf"))


def biased_attention(q, k, v, bias, scale) -> torch.Tensor:
    """float64 softmax(q k^T * scale + bias) v for one sequence: q `[L, Hq, D]`, k/v
    `[L, Hkv, D]`, bias `[Hq, L, L]`."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(group, dim=1) for x in (k, v))
    logits = torch.einsum("qhd,khd->hqk", q.double(), k) * scale + bias  # [Hq, L, L]
    return torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), v)


def test_deviation_alibi_bf16_positions(backends, rng):
    """(ii) ALiBi prefill in bfloat16: vLLM's `_make_alibi_bias` counts positions with
    `torch.arange(seq_len, dtype=bf16)`, which above 256 rounds them to even numbers (above
    512 to multiples of 4), and rounds the bias to bfloat16."""
    case = Case("alibi-bf16-300", prefills=(300,), num_heads=4, num_kv_heads=1, dtype=BF16,
                alibi=True)  # fmt: skip
    step, theirs, ours = run_deviation(case, backends, rng)
    q = step.query.reshape(-1, case.num_heads, case.head_size)
    bias = alibi_bias_bf16(case.alibi_slopes, 300)
    vllm_rule = biased_attention(q, step.keys[0], step.values[0], bias, case.scale)
    exact = oracle(step)
    assert_within(theirs.output, vllm_rule, BF16, "vLLM")
    assert_within(ours.output, exact, BF16, "ours")
    assert_departs("alibi-bf16-positions", theirs, ours, exact, BF16)


def test_deviation_alibi_window_prefill(backends, rng):
    """(iii) ALiBi and a sliding window in one prefill: vLLM's `_run_sdpa_forward` builds the
    ALiBi mask when there are slopes, else the window's, never both: the window is dropped."""
    case = Case("alibi-window-prefill", prefills=(40, 100), num_heads=8, num_kv_heads=2,
                alibi=True, sliding_window=16)  # fmt: skip
    step, theirs, ours = run_deviation(case, backends, rng)
    exact = oracle(step)
    assert_within(theirs.output, oracle(step, sliding_window=None), F32, "vLLM")
    assert_within(ours.output, exact, F32, "ours")
    assert_departs("alibi+window-prefill", theirs, ours, exact, F32)


def test_deviation_soft_cap(backends, rng):
    """(iv) The logits soft cap: vLLM's `TorchSDPABackendImpl.__init__` warns ("Torch SPDA does
    not support logits soft cap") and ignores it, in prefill and decode."""
    case = Case("soft-cap", prefills=(17, 50), decodes=(33, 100), num_heads=8, num_kv_heads=2,
                logits_soft_cap=1.0)  # fmt: skip
    step, theirs, ours = run_deviation(case, backends, rng)
    exact = oracle(step)
    assert_within(theirs.output, oracle(step, logits_soft_cap=None), F32, "vLLM")
    assert_within(ours.output, exact, F32, "ours")
    assert_departs("soft-cap", theirs, ours, exact, F32)


def test_deviation_encoder_only_alibi(backends, rng):
    """(v) ENCODER_ONLY attention with ALiBi: vLLM's `_run_sdpa_forward` takes the mask from
    `_make_alibi_bias`, which is causal (-inf above the diagonal), so the bidirectional layer
    attends only to earlier tokens."""
    case = Case("encoder-only-alibi", prefills=(3, 17, 60), num_heads=8, num_kv_heads=2,
                alibi=True, attn_type=ENCODER_ONLY)  # fmt: skip
    step, theirs, ours = run_deviation(case, backends, rng)
    exact = oracle(step)
    assert_within(theirs.output, oracle(step, causal=True), F32, "vLLM")
    assert_within(ours.output, exact, F32, "ours")
    assert_departs("encoder-only-alibi", theirs, ours, exact, F32)

"""Bad inputs to the torch backends, as data: each case is one mistake in one step's
metadata (or layer, or key), run through a backend's builder and `impl.forward` over a cache
whose bytes are hashed before and after.

`run(case, backend)` gives the error type, the message and both hashes;
test_torch_reliability.py asserts on them, and `python tests/torch/reliability_cases.py`
writes docs/reliability_torch.md from the same runs (a test fails when the committed file
differs from what the code gives now).

The step, the same for every case and backend (fixed numbers, so the messages are too):

    |<- prefill_0 (5) ->|<- prefill_1 (3 new after 6 cached) ->|d0|d1|
    seq_lens [5, 9, 10, 3], block size 8, num_blocks 12 (96 slots)
    block_tables [[3], [7, 1], [4, 10], [6]]
    slot_mapping [24..28 | 14, 15, 8 | 81 | 50]

Rows differ by backend: TORCH_SDPA (and JAX, on TORCH_SDPA's metadata) keep the decodes'
`block_tables` / `seq_lens_tensor` and the prefills' `prefill_block_tables` apart; XFORMERS
and IPEX keep one row per sequence, prefills first. The mutations below go through `Rows`.
"""

import dataclasses
import hashlib
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 4, 2, 64
BLOCK_SIZE, NUM_BLOCKS = 8, 12
SEQ_LENS, QUERY_LENS = [5, 9, 10, 3], [5, 3, 1, 1]
BLOCK_TABLES = [[3], [7, 1], [4, 10], [6]]
FP8_SCALES = (0.5, 0.75)
WRAPS = 2**32 + 3  # an int64 value that a cast to int32 turns into 3

BACKENDS = ["TORCH_SDPA", "XFORMERS", "JAX", "IPEX"]
SPLIT_METADATA = ("TORCH_SDPA", "JAX")  # decode and prefill fields kept apart


@dataclasses.dataclass(frozen=True)
class Rows:
    """Where sequence rows live in `backend`'s metadata."""

    backend: str
    num_prefills: int = 2

    def decode(self, i: int) -> int:
        """Row of decode `i` in `block_tables` / `seq_lens_tensor`."""
        return i if self.backend in SPLIT_METADATA else self.num_prefills + i

    def prefill_tables(self, md) -> torch.Tensor:
        return md.prefill_block_tables if self.backend in SPLIT_METADATA else md.block_tables

    def starve_last_row(self, md) -> None:
        """`query_start_loc` with no token for its last sequence: decode 0 where it covers
        every sequence; prefill 1 where (TORCH_SDPA, JAX) it covers the prefills only."""
        last = len(md.query_start_loc) - 2
        md.query_start_loc[last + 1] = md.query_start_loc[last]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    bad: str  # what is wrong, in words
    mutate: Callable  # (metadata, Rows) -> None, in place; or None
    error: type[Exception] = ValueError
    match: str = ""  # regex the message must contain
    kv_cache_dtype: str = "auto"
    scales: tuple[float, float] | None = None  # the layer's (k_scale, v_scale)
    block_tables: list[list[int]] | None = None  # given to the builder instead
    drop_key_rows: int = 0


def _set(tensor: torch.Tensor, index, value) -> None:
    tensor[index] = value


def _int64(md, name: str) -> torch.Tensor:
    """The field as int64 (in the metadata), so it can hold values past int32."""
    setattr(md, name, getattr(md, name).to(torch.int64))
    return getattr(md, name)


CASES = [
    Case(
        "slot-past-cache",
        "a slot_mapping entry = num_blocks * block_size",
        lambda md, r: _set(md.slot_mapping, 0, NUM_BLOCKS * BLOCK_SIZE),
        match=r"slot_mapping value 96 is out of range: the cache has 96 slots",
    ),
    Case(
        "slot-negative",
        "a slot_mapping entry = -2 (only -1 pads)",
        lambda md, r: _set(md.slot_mapping, 2, -2),
        match=r"slot_mapping value -2 is out of range.*or -1 \(PAD_SLOT_ID\)",
    ),
    Case(
        "slot-int64-wraps",
        "a slot_mapping entry = 2**32 + 3 (int32 would wrap it to 3)",
        lambda md, r: _set(md.slot_mapping, 0, WRAPS),
        match=r"slot_mapping value 4294967299 is out of range",
    ),
    Case(
        "slot-twice",
        "two tokens write the same slot",
        lambda md, r: _set(md.slot_mapping, 1, int(md.slot_mapping[0])),
        match=r"slot_mapping writes slot 24 twice",
    ),
    Case(
        "slot-float",
        "slot_mapping is a float tensor",
        lambda md, r: setattr(md, "slot_mapping", md.slot_mapping.float()),
        error=TypeError,
        match=r"slot_mapping must be an integer tensor",
    ),
    Case(
        "decode-block-past-cache",
        "a used decode block_tables entry = num_blocks",
        lambda md, r: _set(md.block_tables, (r.decode(0), 1), NUM_BLOCKS),
        match=r"block_tables\[\d, 1\]=12 is out of range: block ids must be in \[0, num_blocks=12",
    ),
    Case(
        "decode-block-negative",
        "a used decode block_tables entry = -1",
        lambda md, r: _set(md.block_tables, (r.decode(1), 0), -1),
        match=r"block_tables\[\d, 0\]=-1 is out of range",
    ),
    Case(
        "decode-block-int64-wraps",
        "a used decode block_tables entry = 2**32 + 3",
        lambda md, r: _set(_int64(md, "block_tables"), (r.decode(0), 0), WRAPS),
        match=r"block_tables\[\d, 0\]=4294967299 is out of range",
    ),
    Case(
        "prefix-block-past-cache",
        "a used block of the chunked prefill's table = num_blocks",
        lambda md, r: _set(r.prefill_tables(md), (1, 0), NUM_BLOCKS),
        match=r"block_tables\[1, 0\]=12 is out of range",
    ),
    Case(
        "decode-seq-len-past-table",
        "a decode's seq_len needs more blocks than its table row has",
        lambda md, r: _set(md.seq_lens_tensor, r.decode(0), 17),
        match=r"seq_lens_tensor\[\d\]=17 needs 3 blocks of 8, but attn_metadata.block_tables has 2",
    ),
    Case(
        "decode-seq-len-int64-wraps",
        "a decode's seq_len = 2**32 + 3",
        lambda md, r: _set(_int64(md, "seq_lens_tensor"), r.decode(1), WRAPS),
        match=r"seq_lens_tensor\[\d\]=4294967299 needs 536870913 blocks",
    ),
    Case(
        "decode-seq-len-zero",
        "a decode's seq_len = 0 (it counts the new token)",
        lambda md, r: _set(md.seq_lens_tensor, r.decode(1), 0),
        match=r"seq_lens_tensor\[\d\]=0 must be >= 1",
    ),
    Case(
        "max-decode-seq-len-short",
        "max_decode_seq_len below a decode's seq_len",
        lambda md, r: setattr(md, "max_decode_seq_len", 5),
        match=r"seq_lens_tensor\[\d\]=10 exceeds attn_metadata.max_decode_seq_len=5",
    ),
    Case(
        "prefill-seq-len-below-query",
        "a prefill's seq_len < its query length",
        lambda md, r: _set(md.seq_lens, 1, 2),
        match=r"seq_lens\[1\]=2 must be >= its query length 3",
    ),
    Case(
        "query-start-loc-int64-wraps",
        "query_start_loc[1] = 2**32 + 5 (int32 would wrap it to the right value, 5)",
        lambda md, r: _set(_int64(md, "query_start_loc"), 1, 2**32 + 5),
        match=r"query_start_loc|query length",
    ),
    Case(
        "query-start-loc-not-running-sum",
        "query_start_loc gives its last sequence no token",
        lambda md, r: r.starve_last_row(md),
        match=r"query_start_loc=\[0, 5, 8, 9, 9\] must be the running sum|prefill query "
        r"lengths \[5, 0\] sum to 5",
    ),
    Case(
        "query-start-loc-wrong-sum",
        "query_start_loc[2] = 9: the prefills' query lengths [5, 4] sum past num_prefill_tokens",
        lambda md, r: _set(md.query_start_loc, 2, 9),
        match=r"the prefill query lengths \[5, 4\] sum to 9, but attn_metadata.num_prefill_toke",
    ),
    Case(
        "num-prefill-tokens-wrong",
        "num_prefill_tokens = 9 (the query has 8 prefill rows)",
        lambda md, r: setattr(md, "num_prefill_tokens", 9),
        match=r"query has 10 tokens but the metadata describes 9 prefill \+ 2 decode tokens",
    ),
    Case(
        "num-prefills-wrong",
        "num_prefills = 1 (there are 2)",
        lambda md, r: setattr(md, "num_prefills", 1),
        match=r"num_prefills|block_tables has|prefill query lengths \[5\] sum to 5",
    ),
    Case(
        "key-rows-short",
        "key has one row less than the query",
        None,
        drop_key_rows=1,
        match=r"key has 9 tokens but query has 10",
    ),
    Case(
        "k-scale-nan",
        "layer._k_scale = nan (fp8_e5m2 cache)",
        None,
        kv_cache_dtype="fp8_e5m2",
        scales=(float("nan"), 0.75),
        match=r"layer._k_scale=nan must be finite and > 0",
    ),
    Case(
        "k-scale-zero",
        "layer._k_scale = 0 (fp8_e5m2 cache)",
        None,
        kv_cache_dtype="fp8_e5m2",
        scales=(0.0, 0.75),
        match=r"layer._k_scale=0.0 must be finite and > 0",
    ),
    Case(
        "v-scale-negative",
        "layer._v_scale = -0.75 (fp8_e5m2 cache)",
        None,
        kv_cache_dtype="fp8_e5m2",
        scales=(0.5, -0.75),
        match=r"layer._v_scale=-0.75 must be finite and > 0",
    ),
    Case(
        "v-scale-inf",
        "layer._v_scale = inf (fp8_e5m2 cache)",
        None,
        kv_cache_dtype="fp8_e5m2",
        scales=(0.5, float("inf")),
        match=r"layer._v_scale=inf must be finite and > 0",
    ),
    Case(
        "builder-block-negative",
        "the builder is given block_tables with -1 for prefill_0",
        None,
        block_tables=[[-1], *BLOCK_TABLES[1:]],
        match=r"block_tables\[0\]\[0\]=-1 must be a block id >= 0",
    ),
    Case(
        "builder-table-short",
        "the builder is given one block for a 10-token decode",
        None,
        block_tables=[*BLOCK_TABLES[:2], [4], BLOCK_TABLES[3]],
        match=r"block_tables\[2\] has 1 blocks of 8 for seq_lens\[2\]=10 tokens",
    ),
]


@dataclasses.dataclass(frozen=True)
class Outcome:
    error: str  # exception type name, or "none"
    message: str
    hash_before: str
    hash_after: str

    @property
    def cache_unchanged(self) -> bool:
        return self.hash_before == self.hash_after


def cache_hash(kv_cache: torch.Tensor) -> str:
    return hashlib.sha256(kv_cache.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def backend_class(name: str):
    """The backend class: "JAX" straight from `interop.torch_op` (the registry finds it
    through package metadata, which a source checkout may not have installed)."""
    if name == "JAX":
        from interop.torch_op import JaxAttnBackend

        return JaxAttnBackend
    from torch_backends import get_attn_backend

    return get_attn_backend(name)


def backend_param(name: str):
    """A pytest param for backend `name`: marked `ipex` for IPEX, skipped saying why where it
    cannot be imported."""
    import pytest

    marks = [pytest.mark.ipex] if name == "IPEX" else []
    try:
        backend_class(name)
    except ImportError as e:
        marks.append(pytest.mark.skip(reason=f"{name} not importable here: {e}"))
    return pytest.param(name, marks=marks, id=name)


def make_step(backend: str, kv_cache_dtype: str = "auto", block_tables=None):
    """(impl, kv_cache, query, key, value, builder kwargs) of the fixed step for `backend`;
    the cache filled with fixed random bytes (every layout and dtype alike)."""
    backend_cls = backend_class(backend)
    impl = backend_cls.get_impl_cls()(
        NUM_HEADS,
        HEAD_SIZE,
        HEAD_SIZE**-0.5,
        NUM_KV_HEADS,
        kv_cache_dtype=kv_cache_dtype,
        alibi_slopes=None,
        sliding_window=None,
    )
    gen = torch.Generator().manual_seed(0)
    shape = backend_cls.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    if kv_cache_dtype == "auto":
        kv_cache = torch.randn(shape, generator=gen)
    else:  # e5m2 bytes of values in [-4, 4)
        kv_cache = (torch.rand(shape, generator=gen) * 8 - 4).to(torch.float8_e5m2)
        kv_cache = kv_cache.view(torch.uint8)
    num_tokens = sum(QUERY_LENS)
    query = torch.randn(num_tokens, NUM_HEADS * HEAD_SIZE, generator=gen)
    key = torch.randn(num_tokens, NUM_KV_HEADS * HEAD_SIZE, generator=gen)
    value = torch.randn(num_tokens, NUM_KV_HEADS * HEAD_SIZE, generator=gen)
    build = dict(block_tables=block_tables or BLOCK_TABLES, block_size=BLOCK_SIZE)
    return backend_cls, impl, kv_cache, query, key, value, build


def prepare(case: Case, backend: str) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """(kv_cache, call): `call()` runs `case` through `backend` (the builder, the mutation,
    `impl.forward`) and returns the output; `kv_cache` is the cache it writes to."""
    from torch_backends import AttentionLayer

    backend_cls, impl, kv_cache, query, key, value, build = make_step(
        backend, case.kv_cache_dtype, case.block_tables
    )
    if case.drop_key_rows:
        key, value = key[: -case.drop_key_rows], value[: -case.drop_key_rows]
    scales = case.scales or (FP8_SCALES if case.kv_cache_dtype != "auto" else (1.0, 1.0))

    def call() -> torch.Tensor:
        md = fixed_metadata(backend_cls, build)
        if case.mutate is not None:
            case.mutate(md, Rows(backend))
        return forward(impl, AttentionLayer(*scales), query, key, value, kv_cache, md)

    return kv_cache, call


def fixed_metadata(backend_cls, build: dict):
    """The fixed step's metadata from `backend_cls`'s builder (`build`: make_step's keywords)."""
    return backend_cls.get_builder_cls()(None).build(SEQ_LENS, QUERY_LENS, -1, -1, **build)


def forward(impl, layer, query, key, value, kv_cache, md) -> torch.Tensor:
    """`impl.forward`, without XFORMERS' once-per-process warning that it has no CPU kernel."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "XFORMERS: xformers has no CPU kernel")
        return impl.forward(layer, query, key, value, kv_cache, md)


# Valid metadata as vLLM's runners build it, which the backends must accept: each runs and
# gives the unmutated step's output and cache, bit for bit. The zero-padded prefill row below
# comes from vLLM's GPU-side builders (XFORMERS' CommonMetadataBuilder). JAX, and IPEX in a
# step with a chunked prefill, read every prefill whole through its table (one paged kernel
# call), so there a row must list its blocks, as vLLM's CPU runner gives them; a zero-padded
# row cannot be told from one that names block 0.
ACCEPTED = [
    Case(
        "plain-prefill-empty-row",
        "prefill_0 (no cached prefix) has an all-zero table row, as vLLM's GPU builders leave it",
        lambda md, r: _set(r.prefill_tables(md), 0, 0),
    ),
]
ACCEPTED_BACKENDS = {"plain-prefill-empty-row": ("TORCH_SDPA", "XFORMERS")}


def run_accepted(case: Case, backend: str) -> str:
    """`case` and the unmutated step through `backend`: "yes" when both give the same
    output and cache bits, else what differs (or the error raised)."""
    cache, call = prepare(case, backend)
    clean_cache, clean = prepare(Case("clean", "", None), backend)
    try:
        out = call()
    except Exception as e:  # recorded: the caller asserts on it
        return f"raised {type(e).__name__}: {e}"
    want = clean()
    if not torch.equal(out.view(torch.uint8), want.view(torch.uint8)):
        return "output differs"
    if cache_hash(cache) != cache_hash(clean_cache):
        return "cache differs"
    return "yes"


def run(case: Case, backend: str) -> Outcome:
    """`case` through `backend`: the error type and message, and the cache's hashes."""
    kv_cache, call = prepare(case, backend)
    before = cache_hash(kv_cache)
    try:
        call()
    except Exception as e:  # recorded: the caller asserts on it
        return Outcome(type(e).__name__, str(e), before, cache_hash(kv_cache))
    return Outcome("none", "", before, cache_hash(kv_cache))


# -- docs/reliability_torch.md -------------------------------------------------------------

DOC = Path(__file__).parents[2] / "docs" / "reliability_torch.md"
HEADER = """# Bad inputs to the torch backends

Generated by `python tests/torch/reliability_cases.py` from the cases in
`tests/torch/reliability_cases.py` (test_torch_reliability.py fails when this file differs
from what the code gives); do not edit by hand. Each case is one mistake in one step of
seq_lens [5, 9, 10, 3] (two prefills, one of them over a cached prefix, then two decodes),
block size 8, 12 blocks, run through the backend's builder and `impl.forward`. "Cache
unchanged": the SHA-256 of the whole `kv_cache` is the same before and after the call.
Each backend's section is written in an environment where it runs (IPEX: torch 2.8 + IPEX).
"""


def available(backend: str) -> bool:
    try:
        backend_class(backend)
    except ImportError:
        return False
    return True


def section(backend: str) -> str:
    """The doc's section for `backend`, from running every case now."""
    lines = [
        f"## {backend}",
        "",
        "| case | what is bad | error | message | cache unchanged |",
        "|---|---|---|---|---|",
    ]
    for case in CASES:
        out = run(case, backend)
        message = out.message.replace("|", "\\|").replace("\n", " ")
        unchanged = "yes" if out.cache_unchanged else "**no**"
        lines.append(f"| {case.name} | {case.bad} | {out.error} | {message} | {unchanged} |")
    accepted = [c for c in ACCEPTED if backend in ACCEPTED_BACKENDS[c.name]]
    if accepted:
        lines += [
            "",
            "Accepted (valid metadata as vLLM builds it; the same output and cache bits as "
            "the unmutated step):",
            "",
            "| case | what differs | accepted |",
            "|---|---|---|",
        ]
        for case in accepted:
            lines.append(f"| {case.name} | {case.bad} | {run_accepted(case, backend)} |")
    return "\n".join(lines) + "\n"


def sections(text: str) -> dict[str, str]:
    """`## BACKEND` sections of the doc, by backend."""
    parts = re.split(r"^(?=## )", text, flags=re.M)
    return {p.split("\n", 1)[0][3:].strip(): p.rstrip("\n") + "\n" for p in parts[1:]}


def generate(existing: str = "") -> str:
    """The doc, with the sections of the backends that run here regenerated and the others
    kept from `existing` (written in their own environment)."""
    kept = sections(existing)
    parts = [HEADER]
    for backend in BACKENDS:
        if available(backend):
            parts.append(section(backend))
        elif backend in kept:
            parts.append(kept[backend])
    return "\n".join(parts)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parents[2]))
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(generate(DOC.read_text() if DOC.exists() else ""))
    print(f"wrote {DOC}")

"""Named benchmark workloads and the data every backend runs on.

A workload is one step of a serving engine: prefill sequences first, then decode sequences
(vLLM's token order), every key and value already in the paged cache. Backends time attention
only; writing the new tokens into the cache is not part of any measurement.

    tokens:  |<-- prefill_0 -->|<-- prefill_1 -->|d0|d1|...|d27|

The cache is filled with finite random values everywhere (no NaN poisoning: the tests do that;
here NaN or denormal slow paths would only distort the timings), and blocks are assigned to
sequences in random order, as a long-running engine's block manager would.
"""

import dataclasses
import fnmatch
import re

import ml_dtypes
import numpy as np

_DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}
_SHORT = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str
    query_lens: tuple[int, ...]  # prefills (q_len == seq_len) first, then decodes (q_len 1)
    seq_lens: tuple[int, ...]  # total keys per sequence, the new tokens included
    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    dtype: str = "float32"  # query and output; the cache too unless `cache_dtype` says
    reps: int = 15  # timed rounds (every peer once per round), unless --rounds says otherwise
    cache_dtype: str | None = None  # e.g. "float8_e4m3fn": an fp8 cache with the scales below
    k_scale: float = 1.0  # a cached key reads as fp8 value * k_scale (vLLM's convention)
    v_scale: float = 1.0

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_prefills(self) -> int:
        return sum(q > 1 or q == s for q, s in zip(self.query_lens, self.seq_lens, strict=True))

    @property
    def has_cached_prefix(self) -> bool:
        """Some prefill reads keys cached by earlier steps (a chunk of a chunked prefill)."""
        return any(1 < q < s for q, s in zip(self.query_lens, self.seq_lens, strict=True))

    @property
    def is_decode(self) -> bool:
        return all(q == 1 for q in self.query_lens) and self.num_prefills == 0

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype].itemsize

    @property
    def cache_itemsize(self) -> int:
        return _DTYPES[self.cache_dtype or self.dtype].itemsize

    @property
    def kv_bytes(self) -> int:
        """Every cached key and value read once."""
        return 2 * sum(self.seq_lens) * self.num_kv_heads * self.head_size * self.cache_itemsize

    @property
    def bytes_moved(self) -> int:
        """The least traffic a step needs: K/V read once, queries read, outputs written."""
        return self.kv_bytes + 2 * self.num_tokens * self.num_heads * self.head_size * self.itemsize

    @property
    def flops(self) -> int:
        """Multiply-adds x 2 of q.k and p.v over the keys each query may see (causal)."""
        pairs = 0
        for q, s in zip(self.query_lens, self.seq_lens, strict=True):
            pairs += sum(s - q + 1 + i for i in range(q))
        return 4 * pairs * self.num_heads * self.head_size

    def describe(self) -> str:
        decodes = self.num_seqs - self.num_prefills
        parts = []
        if self.num_prefills:
            lens = sorted(set(self.query_lens[: self.num_prefills]))
            kind = "chunk" if self.has_cached_prefix else "prefill"
            parts.append(f"{self.num_prefills} {kind} x {'/'.join(map(str, lens))}")
            if self.has_cached_prefix:
                ctx = sorted(set(self.seq_lens[: self.num_prefills]))
                parts[-1] += f" @ ctx {'/'.join(map(str, ctx))}"
        if decodes:
            ctx = sorted(set(self.seq_lens[self.num_prefills :]))
            parts.append(f"{decodes} decode @ ctx {'/'.join(map(str, ctx))}")
        return (
            " + ".join(parts)
            + f", Hq{self.num_heads}/Hkv{self.num_kv_heads} D{self.head_size}"
            + f" BS{self.block_size} {self.dtype}"
            + (f"/{_SHORT[self.cache_dtype]} cache" if self.cache_dtype else "")
        )


def _decode(name, batch, ctx, dtype, **kw) -> Spec:
    return Spec(name, (1,) * batch, (ctx,) * batch, dtype=dtype, **kw)


def _prefill(name, num, length, **kw) -> Spec:
    return Spec(name, (length,) * num, (length,) * num, **kw)


def _chunked(name, num, chunk, prefix, **kw) -> Spec:
    return Spec(name, (chunk,) * num, (prefix + chunk,) * num, **kw)


def _mixed(name, prefills, prefill_len, decodes, ctx, **kw) -> Spec:
    query_lens = (prefill_len,) * prefills + (1,) * decodes
    seq_lens = (prefill_len,) * prefills + (ctx,) * decodes
    return Spec(name, query_lens, seq_lens, **kw)


# Every workload runs at these block sizes, the block size in its name (`decode-bf16-bs128`):
# 16, where most paged kernels started, and 128, vLLM's CPU default (its engine refuses block
# sizes that are not multiples of 32, and vLLM 0.32's CPU attention picks its instruction set
# from the block size: vec16 at 16, vec or amx at multiples of 32). The decodes also run at
# 32, the smallest block vLLM's CPU engine takes.
BLOCK_SIZES = (16, 128)
EXTRA_BLOCK_SIZES = {"decode-f32": (32,), "decode-bf16": (32,)}
_BLOCK_SUFFIX = re.compile(r"-bs(\d+)$")


def workload_name(base: str, block_size: int) -> str:
    """`decode-bf16`, 128 -> `decode-bf16-bs128`."""
    return f"{base}-bs{block_size}"


def split_name(name: str) -> tuple[str, int | None]:
    """`decode-bf16-bs128` -> (`decode-bf16`, 128); a name without the suffix (the names before
    the block size was in them, all at block 16) -> (name, None)."""
    match = _BLOCK_SUFFIX.search(name)
    if match is None:
        return name, None
    return name[: match.start()], int(match.group(1))


def canonical_name(name: str, block_size: int = 16) -> str:
    """A workload's name with its block size: the older names without one (`decode-bf16`) were
    every one of them at block 16, so they stand for `-bs16` (or `block_size`, where a record's
    spec says otherwise)."""
    return name if split_name(name)[1] is not None else workload_name(name, block_size)


def _base_workloads(quick: bool) -> list[Spec]:
    fp8 = dict(cache_dtype="float8_e4m3fn", k_scale=0.8, v_scale=1.3)
    if quick:
        small = dict(num_heads=8, num_kv_heads=2, head_size=64, reps=3)
        return [
            _decode("decode-f32", 4, 64, "float32", **small),
            _decode("decode-bf16", 4, 64, "bfloat16", **small),
            _decode("decode-fp8", 4, 64, "bfloat16", **fp8, **small),
            _decode("decode-8x8192", 2, 256, "float32", **small),
            _decode("decode-8x8192-bf16", 2, 256, "bfloat16", **small),
            _prefill("prefill-8x512", 2, 32, **small),
            _prefill("prefill-bf16", 2, 32, dtype="bfloat16", **small),
            _chunked("chunked-prefill", 2, 16, 48, **small),
            _chunked("chunked-prefill-bf16", 2, 16, 48, dtype="bfloat16", **small),
            _mixed("mixed", 2, 16, 3, 40, **small),
            _mixed("mixed-bf16", 2, 16, 3, 40, dtype="bfloat16", **small),
            _chunked("spec-decode", 4, 4, 60, **small),
            _chunked("spec-decode-bf16", 4, 4, 60, dtype="bfloat16", **small),
        ]
    return [
        _decode("decode-f32", 32, 1024, "float32", reps=15),
        _decode("decode-bf16", 32, 1024, "bfloat16", reps=15),
        _decode("decode-fp8", 32, 1024, "bfloat16", reps=15, **fp8),
        _decode("decode-8x8192", 8, 8192, "float32", reps=11),
        _decode("decode-8x8192-bf16", 8, 8192, "bfloat16", reps=11),
        _prefill("prefill-8x512", 8, 512, reps=9),
        _prefill("prefill-bf16", 8, 512, dtype="bfloat16", reps=9),
        _chunked("chunked-prefill", 8, 256, 2048, reps=9),
        _chunked("chunked-prefill-bf16", 8, 256, 2048, dtype="bfloat16", reps=9),
        _mixed("mixed", 4, 256, 28, 1024, reps=11),
        _mixed("mixed-bf16", 4, 256, 28, 1024, dtype="bfloat16", reps=11),
        _chunked("spec-decode", 32, 4, 1020, reps=15),
        _chunked("spec-decode-bf16", 32, 4, 1020, dtype="bfloat16", reps=15),
    ]


def named_workloads(quick: bool = False) -> dict[str, Spec]:
    """The suite, by name: every workload at each of `BLOCK_SIZES` (and `EXTRA_BLOCK_SIZES`),
    one after the other (`decode-bf16-bs16`, `decode-bf16-bs32`, `decode-bf16-bs128`, ...).
    `quick` keeps the names and shrinks every size (a smoke run).

    decode-fp8 reads an e4m3 cache (a quarter of decode-f32's bytes) with bf16 queries;
    decode-8x8192 is the long-context decode: 8 sequences at 8192 keys (537 MB of K/V), and
    decode-8x8192-bf16 the same in bfloat16; prefill-bf16 is prefill-8x512 in bfloat16;
    chunked-prefill is 8 chunks of 256 new tokens, each over a 2048-token cached prefix;
    chunked-prefill-bf16 and mixed-bf16 are those steps in bfloat16; spec-decode is the verify
    step of speculative decoding (or multi-token prediction): 32 sequences of 4 new tokens each
    over 1020 cached ones, short causal tiles that read as much cache as decode-f32 with 4x its
    math (spec-decode-bf16 the same in bfloat16).
    """
    specs = {}
    for base in _base_workloads(quick):
        for block_size in sorted(BLOCK_SIZES + EXTRA_BLOCK_SIZES.get(base.name, ())):
            name = workload_name(base.name, block_size)
            specs[name] = dataclasses.replace(base, name=name, block_size=block_size)
    return specs


def select(patterns: list[str], specs: dict[str, Spec]) -> tuple[dict[str, Spec], list[str]]:
    """(the specs `patterns` name, in the suite's order; the patterns that name none). A pattern
    is a workload's name, a shell-style pattern (`'*-bs128'`, `'decode-bf16-*'`), or a name from
    before the block size was in the names (`decode-bf16`: its block-16 workload)."""
    chosen, unknown = set(), []
    for pattern in patterns:
        hits = fnmatch.filter(specs, pattern) or [
            n for n in (canonical_name(pattern),) if n in specs
        ]
        if not hits:
            unknown.append(pattern)
        chosen.update(hits)
    return {n: s for n, s in specs.items() if n in chosen}, unknown


@dataclasses.dataclass(frozen=True)
class Data:
    """Host arrays of one workload, in the core's layout."""

    spec: Spec
    query: np.ndarray  # [T, Hq, D]
    key_cache: np.ndarray  # [NB, BS, Hkv, D] in the cache dtype
    value_cache: np.ndarray
    block_tables: np.ndarray  # [S, max_blocks] int32, 0 where unused
    seq_lens: np.ndarray  # [S] int32
    query_lens: np.ndarray  # [S] int32

    @property
    def context_lens(self) -> np.ndarray:
        return self.seq_lens - self.query_lens

    def prefill_kv(self, new_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The prefill sequences' keys and values, contiguous `[sum(prefill seq_lens), Hkv, D]`
        (read back from the cache, so every backend sees the same numbers); `new_only`: only
        the step's own tokens (the last q_len of each), `[sum(prefill query_lens), Hkv, D]`."""
        spec = self.spec
        first = self.context_lens if new_only else np.zeros_like(self.seq_lens)
        slots = [
            self.block_tables[i, pos // spec.block_size].astype(np.int64) * spec.block_size
            + pos % spec.block_size
            for i in range(spec.num_prefills)
            for pos in [np.arange(first[i], self.seq_lens[i])]
        ]
        slots = np.concatenate(slots) if slots else np.zeros(0, np.int64)
        rows = (-1, spec.num_kv_heads, spec.head_size)
        return self.key_cache.reshape(rows)[slots], self.value_cache.reshape(rows)[slots]


def _cache(rng: np.random.Generator, shape, spec: Spec, scale: float) -> np.ndarray:
    """Random normals as the cache stores them: fp8 caches hold `x / scale` (reading back
    fp8 * scale gives values of the same O(1) size as the float caches)."""
    x = rng.standard_normal(shape, dtype=np.float32)
    if spec.cache_dtype is None:
        return x.astype(_DTYPES[spec.dtype])
    return (x / np.float32(scale)).astype(_DTYPES[spec.cache_dtype])


def make_data(spec: Spec, rng: np.random.Generator, extra_blocks: int = 4) -> Data:
    dtype = _DTYPES[spec.dtype]
    blocks_per_seq = [-(-n // spec.block_size) for n in spec.seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    order = rng.permutation(num_blocks).astype(np.int32)
    tables = np.zeros((spec.num_seqs, max(blocks_per_seq)), np.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = order[used : used + n]
        used += n
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    q_shape = (spec.num_tokens, spec.num_heads, spec.head_size)
    return Data(
        spec=spec,
        query=rng.standard_normal(q_shape, dtype=np.float32).astype(dtype),
        key_cache=_cache(rng, shape, spec, spec.k_scale),
        value_cache=_cache(rng, shape, spec, spec.v_scale),
        block_tables=tables,
        seq_lens=np.asarray(spec.seq_lens, np.int32),
        query_lens=np.asarray(spec.query_lens, np.int32),
    )

"""jax_attn.cpu.paged_decode (the native FFI kernel) against the float64 oracles.

Every case: random block placement, NaN in unused blocks and tail slots, the new tokens
written through `write_kv` (fp8 scales included), two padding rows with seq_len 0 and NaN
queries that must come out as zeros, odd lengths (1, 3, 17, 513), and split-K forced on.
"""

import dataclasses
import os
import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import CaseId, assert_native_output, bias_and_expected, run_fresh, workload
from tolerances import assert_close

import jax_attn
from jax_attn import cpu
from jax_attn.cpu import _build

REASON = cpu.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"native CPU kernels: {REASON}")

CONTEXT_LENS = [0, 2, 16, 512]  # + 1 new token each: seq lens 1, 3, 17, 513


@dataclasses.dataclass(frozen=True)
class Case(CaseId):
    block_size: int = 16
    head_size: int = 64
    num_heads: int = 8
    num_kv_heads: int = 2
    dtype: str = "float32"
    cache_dtype: str | None = None
    alibi: bool = False
    sliding_window: int | None = None
    soft_cap: float | None = None
    split_tokens: int | None = None  # None: the kernel's choice


CASES = [
    *(Case(block_size=bs) for bs in (1, 8, 16, 32, 128)),
    Case(block_size=8, split_tokens=8),  # split-K with one block per part
    Case(block_size=32, split_tokens=64),
    *(Case(num_heads=h, num_kv_heads=kv) for h, kv in [(4, 4), (8, 2), (7, 1), (16, 2)]),
    *(Case(head_size=d) for d in (32, 72, 80, 128, 256)),
    # Past the decode kernel's 256: the ragged kernel, one token per sequence (seq_len 0 rows
    # as its padding).
    Case(head_size=512, alibi=True, sliding_window=40),
    Case(head_size=320, block_size=32, num_heads=6, num_kv_heads=1),
    Case(dtype="bfloat16", cache_dtype="float8_e5m2", head_size=512, soft_cap=3.0),
    # Head sizes that are not a multiple of 8: the AVX2 decode widens such rows into tiles
    # (decode_avx2.h); the AVX-512 one masks its last chunk.
    Case(head_size=36, num_heads=6, num_kv_heads=2, alibi=True),
    Case(dtype="bfloat16", head_size=100, num_heads=5, num_kv_heads=1, block_size=8),
    Case(dtype="bfloat16", cache_dtype="float8_e4m3fn", head_size=20, soft_cap=3.0),
    Case(head_size=128, num_heads=32, num_kv_heads=8, split_tokens=128),
    *(Case(dtype=d) for d in ("bfloat16", "float16")),
    # bf16 queries on a bf16 cache take the vdpbf16ps path: odd 32-element tails, GQA 7 / 1,
    # block sizes 1 and 32, split-K, window and ALiBi.
    Case(dtype="bfloat16", head_size=80, num_heads=7, num_kv_heads=1),
    Case(dtype="bfloat16", head_size=72, block_size=1),
    Case(dtype="bfloat16", head_size=40, num_heads=4, num_kv_heads=4, block_size=32),
    Case(dtype="bfloat16", head_size=256, num_heads=16, num_kv_heads=2, split_tokens=32),
    Case(dtype="bfloat16", head_size=128, sliding_window=5, alibi=True, block_size=8),
    Case(dtype="bfloat16", cache_dtype="float8_e4m3fn"),
    # bf16 queries on fp8 caches take the vdpbf16ps path too (keys and values converted by
    # table lookups, 64 codes at a time): tails of 8/16/40 elements, block sizes 1/8/32/128,
    # GQA 7/1, split-K, window, ALiBi and soft cap.
    Case(dtype="bfloat16", cache_dtype="float8_e5m2", head_size=80, num_heads=7, num_kv_heads=1),
    Case(dtype="bfloat16", cache_dtype="float8_e4m3fn", head_size=40, block_size=1),
    Case(
        dtype="bfloat16",
        cache_dtype="float8_e4m3fn",
        head_size=256,
        num_heads=16,
        num_kv_heads=2,
        block_size=32,
        split_tokens=32,
    ),
    Case(
        dtype="bfloat16",
        cache_dtype="float8_e5m2",
        head_size=72,
        sliding_window=5,
        alibi=True,
        soft_cap=3.0,
        block_size=8,
    ),
    Case(
        dtype="bfloat16", cache_dtype="float8_e4m3fn", num_heads=32, num_kv_heads=8, block_size=128
    ),
    Case(dtype="float32", cache_dtype="float8_e5m2"),
    Case(dtype="float16", cache_dtype="float8_e5m2", alibi=True, block_size=8),
    Case(dtype="float32", cache_dtype="float8_e4m3fn", head_size=80, num_heads=7, num_kv_heads=1),
    Case(alibi=True),
    Case(num_heads=6, num_kv_heads=2, alibi=True, split_tokens=32),
    *(Case(sliding_window=w) for w in (1, 5, 16, 40)),
    Case(sliding_window=100, block_size=8, split_tokens=16),
    Case(soft_cap=2.0),
    Case(soft_cap=3.0, alibi=True, sliding_window=7, dtype="bfloat16"),
    Case(soft_cap=5.0, alibi=True, sliding_window=33, split_tokens=16, block_size=1),
]


def _run(case: Case, rng: np.random.Generator):
    w, k_scale, v_scale = workload(case, rng, [1] * len(CONTEXT_LENS), CONTEXT_LENS)
    kc, vc = jax_attn.write_kv(
        jnp.asarray(w.key_cache),
        jnp.asarray(w.value_cache),
        jnp.asarray(w.new_key),
        jnp.asarray(w.new_value),
        jnp.asarray(w.slot_mapping),
        k_scale=k_scale,
        v_scale=v_scale,
    )
    # Two padding rows: seq_len 0, NaN queries, garbage (but in-range) tables.
    num_seqs = len(CONTEXT_LENS)
    pad_q = np.full((2, case.num_heads, case.head_size), np.nan, np.float32)
    query = jnp.asarray(np.concatenate([w.query, pad_q.astype(w.query.dtype)]))
    tables = np.concatenate([w.block_tables, np.zeros((2, w.block_tables.shape[1]), np.int32)])
    seq_lens = np.array([*w.seq_lens, 0, 0], np.int32)
    slopes, bias, expected = bias_and_expected(case, w, has_causal=False)
    kwargs = dict(alibi_slopes=slopes, k_scale=k_scale, v_scale=v_scale, **bias)
    assert len(expected) == num_seqs
    return query, kc, vc, jnp.asarray(tables), jnp.asarray(seq_lens), kwargs, expected


def _check_against_float64(case: Case, rng) -> None:
    query, kc, vc, tables, seq_lens, kwargs, expected = _run(case, rng)
    kc_before, vc_before = np.asarray(kc).copy(), np.asarray(vc).copy()
    out = cpu.paged_decode(
        query,
        kc,
        vc,
        tables,
        seq_lens,
        scale=case.head_size**-0.5,
        split_tokens=case.split_tokens,
        **kwargs,
    )
    assert_native_output(out, query, expected, case, (kc, vc), (kc_before, vc_before))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_cpu_paged_decode_matches_float64(case: Case, rng):
    _check_against_float64(case, rng)


@pytest.mark.parametrize(
    "case", [Case(alibi=True, sliding_window=9, soft_cap=4.0), Case(dtype="bfloat16")], ids=str
)
def test_cpu_paged_decode_matches_jax_oracle(case: Case, rng):
    """The JAX oracle named in the wrapper's docstring, in float64."""
    query, kc, vc, tables, seq_lens, kwargs, _ = _run(case, rng)
    out = cpu.paged_decode(query, kc, vc, tables, seq_lens, scale=0.1, **kwargs)
    with jax.enable_x64(True):
        expected = jax_attn.reference.paged_decode(
            query, kc, vc, tables, seq_lens, scale=0.1, **kwargs
        )
    assert_close(out, expected, case.dtype)


@pytest.mark.parametrize("case", [c for c in CASES if c.dtype == "bfloat16"], ids=str)
def test_bf16_widened_keys_match_float64(case: Case, rng, monkeypatch):
    """bf16 queries over bf16 and fp8 caches with the keys widened to float32
    (JAX_ATTN_CPU_BF16_DOT=0), the path the cases above take on CPUs without AVX512_BF16 (or,
    for fp8, AVX512_VBMI); here they take the vdpbf16ps path."""
    monkeypatch.setenv("JAX_ATTN_CPU_BF16_DOT", "0")
    _check_against_float64(case, rng)


# Without AMX, bf16 queries on a token-major bf16 or fp8 cache with 4 query rows or more per kv
# head and a head size that is a multiple of 8 take the quads (decode_quads.h): the cases above
# with GQA 4, 7 and 8, and these: groups of 5 and 6 (a quad of 1 or 2 rows after a full one),
# 12 (three quads), head sizes of an odd number of 8-element pieces (40, 120) and of a last
# 32-element chunk of 16 (112), tiles of 1-8 tokens and of 9-15 (odd: a token pair's second
# row is a stand-in), windows, ALiBi, soft cap and split-K parts.
QUAD_CASES = [
    Case(dtype="bfloat16", num_heads=5, num_kv_heads=1, head_size=120, block_size=8),
    Case(dtype="bfloat16", num_heads=12, num_kv_heads=2, head_size=112, sliding_window=13),
    Case(dtype="bfloat16", num_heads=12, num_kv_heads=1, head_size=96, alibi=True, soft_cap=3.0),
    Case(
        dtype="bfloat16",
        cache_dtype="float8_e4m3fn",
        num_heads=6,
        num_kv_heads=1,
        head_size=40,
        block_size=32,
        split_tokens=64,
    ),
    Case(
        dtype="bfloat16",
        cache_dtype="float8_e5m2",
        num_heads=16,
        num_kv_heads=2,
        head_size=120,
        block_size=128,
        sliding_window=150,
        alibi=True,
    ),
]


@pytest.mark.parametrize("case", QUAD_CASES, ids=str)
def test_quads_match_float64(case: Case, rng):
    _check_against_float64(case, rng)


@pytest.mark.parametrize("split_tokens", [None, 96])
@pytest.mark.parametrize(
    "dtype,cache_dtype,quads",
    [
        ("bfloat16", "bfloat16", "1"),  # attend_tile_quads
        ("bfloat16", "float8_e4m3fn", "1"),
        ("bfloat16", "float8_e4m3fn", "0"),  # attend_tile, bf16 value pairs
        ("float32", "float8_e4m3fn", "1"),  # attend_tile, float32 values
        ("float16", "float16", "1"),
    ],
)
def test_decode_follows_logits_that_climb_and_fall(
    dtype, cache_dtype, quads, split_tokens, rng, monkeypatch
):
    """The decode's softmax reference is lazy (decode_kernel.h, kDecodeLazyMargin): a row's max
    moves only when a tile's logits pass it by the margin, and then its running sum and output
    are rescaled. Keys with a shared offset that climbs ~0.4 logits per token over the first
    half of each sequence and falls back make every row's reference move many times, within
    one part and across split parts (split_tokens 96); NaN fills every slot no sequence owns.
    Against float64 on the cache's own values."""
    monkeypatch.setenv("JAX_ATTN_CPU_DECODE_QUADS", quads)
    hq, hkv, d, bs = 8, 2, 64, 16
    seq_lens = [300, 160, 513]
    num_blocks = sum(-(-n // bs) for n in seq_lens) + 3
    query = np.abs(rng.standard_normal((len(seq_lens), hq, d))).astype(dtype)
    key_cache = np.full((num_blocks, bs, hkv, d), np.nan, np.float32).astype(cache_dtype)
    value_cache = key_cache.copy()
    tables = np.zeros((len(seq_lens), -(-max(seq_lens) // bs)), np.int32)
    perm, used = rng.permutation(num_blocks), 0
    scale = d**-0.5
    expected = np.zeros((len(seq_lens), hq, d))
    for i, n in enumerate(seq_lens):
        nb = -(-n // bs)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
        # q >= 0, so q . (noise + c) grows with c by ~c * sum(q) / sqrt(d) ~ 6.4 c.
        climb = np.minimum(np.arange(n), n - np.arange(n)) * (0.4 / 6.4)
        k = (rng.standard_normal((n, hkv, d)) + climb[:, None, None]).astype(cache_dtype)
        v = rng.standard_normal((n, hkv, d)).astype(cache_dtype)
        for t in range(n):
            key_cache[tables[i, t // bs], t % bs] = k[t]
            value_cache[tables[i, t // bs], t % bs] = v[t]
        q64 = query[i].astype(np.float64).reshape(hkv, hq // hkv, d)
        logits = np.einsum("hgd,thd->hgt", q64, k.astype(np.float64)) * scale
        assert logits.max() - logits[..., :16].max() > 2 * 5.5  # the reference must move
        p = np.exp(logits - logits.max(-1, keepdims=True))
        out = np.einsum("hgt,thd->hgd", p / p.sum(-1, keepdims=True), v.astype(np.float64))
        expected[i] = out.reshape(hq, d)
    out = cpu.paged_decode(
        jnp.asarray(query),
        jnp.asarray(key_cache),
        jnp.asarray(value_cache),
        jnp.asarray(tables),
        jnp.asarray(np.array(seq_lens, np.int32)),
        scale=scale,
        split_tokens=split_tokens,
    )
    fp8 = ("float8_e4m3fn",) if "float8" in cache_dtype else ()
    assert_close(out, expected, dtype, *fp8)


@pytest.mark.parametrize("case", [c for c in CASES + QUAD_CASES if c.dtype == "bfloat16"], ids=str)
def test_bf16_without_quads_match_float64(case: Case, rng, monkeypatch):
    """The same cases with the quads off (JAX_ATTN_CPU_DECODE_QUADS=0): the tile path that
    groups of fewer than 4 rows take, for every group size."""
    monkeypatch.setenv("JAX_ATTN_CPU_DECODE_QUADS", "0")
    _check_against_float64(case, rng)


@pytest.mark.parametrize("dot", ["1", "0"])
@pytest.mark.parametrize("query_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("cache_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_every_fp8_code_is_read_exactly(cache_dtype, query_dtype, dot, rng, monkeypatch):
    """All 256 codes of the cache dtype as values of one-key sequences: a single key gets
    weight 1 whatever its logit, so each output is the code's value exactly (NaN and inf
    included), on the lookup-table path (bf16 queries) and the widening ones."""
    monkeypatch.setenv("JAX_ATTN_CPU_BF16_DOT", dot)
    fp8 = jnp.dtype(cache_dtype)
    codes = rng.permutation(256).astype(np.uint8).view(fp8).reshape(4, 64)  # 4 seqs x D=64
    block_size = 16
    values = np.full((4, block_size, 1, 64), np.nan, np.float32).astype(fp8)  # unused: NaN
    values[:, 0, 0, :] = codes  # token 0 of block s holds sequence s's value
    keys = values.copy()
    keys[:, 0, 0, :] = rng.standard_normal((4, 64)).astype(fp8)  # finite logits
    query = jnp.asarray(rng.standard_normal((4, 1, 64)), query_dtype)
    out = cpu.paged_decode(
        query,
        jnp.asarray(keys),
        jnp.asarray(values),
        jnp.arange(4, dtype=jnp.int32).reshape(4, 1),
        jnp.ones((4,), jnp.int32),
    )
    expected = codes.astype(np.float32)
    got = np.asarray(out.astype(jnp.float32))[:, 0, :]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    finite = ~np.isnan(expected)
    np.testing.assert_array_equal(got[finite], expected[finite])


def _l1d_bytes() -> int | None:
    """The first level-1 data cache's size from sysfs (the kernel's CPUID reading), or None."""
    import glob

    for index in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
        try:
            fields = {
                name: open(f"{index}/{name}").read().strip() for name in ("level", "type", "size")
            }
        except OSError:
            continue
        if fields["level"] == "1" and fields["type"] == "Data" and fields["size"].endswith("K"):
            return int(fields["size"][:-1]) * 1024
    return None


def test_isa_names_the_prefetch_rule():
    """Decode prefetches a next tile NTA up to 1.5x the L1d where the L1d holds 48 KiB or more
    (a bf16 tile of 64 KiB ran faster NTA on a 48 KiB-L1d Zen 5), into L2 beyond it, and always
    into L2 on Intel and on smaller L1ds (on a 32 KiB-L1d Zen 4 every tile ran as fast or faster
    into L2): `cpu.isa()` names the limit this CPU got."""
    with open("/proc/cpuinfo") as f:
        vendor = next((line.split(":")[1] for line in f if line.startswith("vendor_id")), "")
    isa = cpu.isa()
    prefetch = isa.split("; prefetch: ")[1].split(";")[0]
    if vendor.strip() == "GenuineIntel":
        assert prefetch == "L2", isa
        return
    l1d = _l1d_bytes()
    if l1d is None:
        pytest.skip("sysfs gives no L1d size here to check the rule against")
    if l1d < 48 * 1024:
        assert prefetch == "L2", isa
    else:
        assert prefetch == f"NTA for tiles up to {l1d * 3 // 2 // 1024} KiB, else L2", isa


# The AMX path (bf16 queries on a token-major bf16 or fp8 cache, block size a multiple of 16,
# on CPUs with AMX tiles): query row groups of 1-16 (padded to 1/2/4/8/16 lanes) and over 16 (two
# groups), head sizes that pad the last 32 dims, block sizes of one to eight key tiles, windows
# that start inside a key tile or a 128-key step, ALiBi, soft cap, split-K parts. By default the
# tiles take only groups of 5 or more (4 on fp8); these tests put every group on them
# (JAX_ATTN_CPU_DECODE_AMX=1, read per call).
AMX = cpu.decode_path("bfloat16", "bfloat16", 16, 16) == "amx"
amx_only = pytest.mark.skipif(not AMX, reason=f"decode runs no AMX tiles here ({cpu.isa()})")
AMX_CASES = [
    *(
        Case(dtype="bfloat16", num_heads=h, num_kv_heads=kv, block_size=bs)
        for h, kv, bs in [
            (4, 4, 16),
            (8, 4, 32),
            (32, 8, 128),
            (7, 1, 48),
            (16, 1, 16),
            (40, 2, 64),
            (32, 1, 128),
            (12, 2, 256),
        ]
    ),
    *(Case(dtype="bfloat16", head_size=d, block_size=32) for d in (64, 72, 80, 96, 112, 120, 256)),
    *(Case(dtype="bfloat16", sliding_window=w, block_size=16) for w in (1, 5, 40, 130)),
    Case(dtype="bfloat16", alibi=True, soft_cap=3.0, sliding_window=100, block_size=128),
    Case(dtype="bfloat16", num_heads=20, num_kv_heads=1, alibi=True, block_size=32),
    *(
        Case(dtype="bfloat16", block_size=bs, split_tokens=t)
        for bs, t in [(16, 16), (32, 96), (128, 128)]
    ),
    # fp8 caches (scales from the case), converted to bf16 as the tiles are staged.
    Case(
        dtype="bfloat16", cache_dtype="float8_e4m3fn", num_heads=32, num_kv_heads=8, block_size=128
    ),
    Case(dtype="bfloat16", cache_dtype="float8_e5m2", head_size=80, num_heads=7, num_kv_heads=1),
    Case(
        dtype="bfloat16", cache_dtype="float8_e4m3fn", head_size=72, alibi=True, sliding_window=40
    ),
    Case(dtype="bfloat16", cache_dtype="float8_e5m2", head_size=120, soft_cap=3.0, block_size=32),
    Case(
        dtype="bfloat16", cache_dtype="float8_e4m3fn", head_size=256, num_heads=40, num_kv_heads=2
    ),
]


@amx_only
@pytest.mark.parametrize("case", AMX_CASES, ids=str)
def test_cpu_paged_decode_amx_matches_float64(case: Case, rng, monkeypatch):
    monkeypatch.setenv("JAX_ATTN_CPU_DECODE_AMX", "1")
    group = case.num_heads // case.num_kv_heads
    path = cpu.decode_path(case.cache_dtype or case.dtype, case.dtype, case.block_size, group)
    assert path == "amx"
    _check_against_float64(case, rng)


@pytest.mark.parametrize("case", AMX_CASES, ids=str)
def test_cpu_paged_decode_bf16_grid_matches_float64(case: Case, rng):
    """The AMX grid through whichever path this CPU runs (on AVX-512 machines without AMX the
    vector path: for a bf16 cache, keys by vdpbf16ps and values in token pairs by vdpbf16ps,
    accumulate_value_pairs; odd token counts and head sizes that end inside a 32-element chunk
    exercise the pairs' tails)."""
    _check_against_float64(case, rng)


def test_decode_path_names_amx_exactly_where_it_runs(monkeypatch):
    """AMX for bf16 queries on a bf16 cache with groups of 5 or more and on fp8 with 4 or more,
    at block sizes that are multiples of 16, where the ragged kernel's tiles run too (the CPU
    has them and the process may use them); on the split layout every group at blocks of 16, 32
    or multiples of 64; never for other dtypes. JAX_ATTN_CPU_DECODE_AMX=1
    takes every group, 0 none."""
    tiles = "amx-bf16" in (cpu.isa() or "")
    monkeypatch.delenv("JAX_ATTN_CPU_DECODE_AMX", raising=False)
    for cache, smallest in (("bfloat16", 5), ("float8_e4m3fn", 4), ("float8_e5m2", 4)):
        for bs in (16, 32, 128, 256):
            for group in (1, 2, 3, 4, 5, 7, 8, 16, 40):
                on_tiles = tiles and group >= smallest
                got = cpu.decode_path(cache, "bfloat16", bs, group)
                assert (got == "amx") == on_tiles, (cache, bs, group, got)
    for cache, query, bs in [
        ("bfloat16", "bfloat16", 8),
        ("bfloat16", "bfloat16", 24),
        ("float32", "float32", 16),
        ("bfloat16", "float32", 16),
        ("float16", "float16", 16),
        ("float8_e4m3fn", "float32", 16),
        ("float8_e5m2", "bfloat16", 8),
    ]:
        assert cpu.decode_path(cache, query, bs, 16) == "vector", (cache, query, bs)
    # vLLM's split layout (the torch half's decode): every group, blocks of 16, 32 or k * 64.
    for cache in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        for bs in (16, 32, 64, 128, 192, 256):
            for group in (1, 3, 4, 8):
                got = cpu.decode_path(cache, "bfloat16", bs, group, layout="split")
                assert (got == "amx") == tiles, (cache, bs, group, got)
        for bs in (8, 48, 96):
            assert cpu.decode_path(cache, "bfloat16", bs, 4, layout="split") == "vector"
    for cache, query in [("bfloat16", "float32"), ("float32", "float32"), ("float16", "float16")]:
        assert cpu.decode_path(cache, query, 128, 4, layout="split") == "vector", (cache, query)
    with pytest.raises(ValueError, match="layout='nhd' must be"):
        cpu.decode_path("bfloat16", "bfloat16", 128, 4, layout="nhd")
    monkeypatch.setenv("JAX_ATTN_CPU_DECODE_AMX", "1")
    assert (cpu.decode_path("bfloat16", "bfloat16", 128, 1) == "amx") == tiles
    assert cpu.decode_path("bfloat16", "bfloat16", 24, 1) == "vector"
    monkeypatch.setenv("JAX_ATTN_CPU_DECODE_AMX", "0")
    assert cpu.decode_path("bfloat16", "bfloat16", 128, 16) == "vector"
    assert cpu.decode_path("bfloat16", "bfloat16", 128, 4, layout="split") == "vector"


def test_bf16_decode_without_amx_matches_float64():
    """JAX_ATTN_CPU_AMX=0 (read once per process): the vector path, in a fresh process, on cases
    the AMX path takes here."""
    run_fresh(
        """
        import numpy as np
        import test_cpu_decode as t
        from jax_attn import cpu
        assert cpu.decode_path("bfloat16", "bfloat16", 128, 16) == "vector"
        for case in (t.Case(dtype="bfloat16", num_heads=32, num_kv_heads=8, block_size=128),
                     t.Case(dtype="bfloat16", head_size=80, alibi=True, sliding_window=40),
                     t.Case(dtype="bfloat16", cache_dtype="float8_e4m3fn", block_size=32)):
            t._check_against_float64(case, np.random.default_rng(7))
        print("ok")
        """,
        JAX_ATTN_CPU_AMX="0",
    )


def test_threads_and_splits_agree(rng, monkeypatch):
    """One worker, the default workers, and split-K parts of one block give the same rows."""
    query, kc, vc, tables, seq_lens, kwargs, expected = _run(Case(block_size=8), rng)
    outs = []
    for threads, split in [("1", None), ("", None), ("3", 8)]:
        if threads:
            monkeypatch.setenv("JAX_ATTN_CPU_THREADS", threads)
        else:
            monkeypatch.delenv("JAX_ATTN_CPU_THREADS", raising=False)
        outs.append(cpu.paged_decode(query, kc, vc, tables, seq_lens, split_tokens=split, **kwargs))
    for out in outs:
        assert_close(out[: len(expected)], expected, "float32")
    np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))


def test_bad_block_id_is_an_error_naming_block_tables(rng):
    query, kc, vc, tables, seq_lens, _, _ = _run(Case(), rng)
    num_blocks = kc.shape[0]
    for bad in (num_blocks, -1, 2**31 - 1):
        broken = tables.at[3, 1].set(bad)
        with pytest.raises(Exception, match=r"block_tables\[3, 1\]=.*num_blocks"):
            jax.block_until_ready(cpu.paged_decode(query, kc, vc, broken, seq_lens))
    # An out-of-range id in a block the sequence never reads (past seq_len) is padding.
    unused = tables.at[0, 5].set(num_blocks + 7)
    out = cpu.paged_decode(query, kc, vc, unused, seq_lens)
    np.testing.assert_array_equal(
        np.asarray(out), np.asarray(cpu.paged_decode(query, kc, vc, tables, seq_lens))
    )


def test_seq_len_beyond_the_table_is_an_error(rng):
    query, kc, vc, tables, seq_lens, _, _ = _run(Case(), rng)
    too_long = seq_lens.at[1].set(tables.shape[1] * kc.shape[1] + 1)
    with pytest.raises(Exception, match=r"seq_lens\[1\]=.*max_blocks \* block_size"):
        jax.block_until_ready(cpu.paged_decode(query, kc, vc, tables, too_long))
    with pytest.raises(Exception, match=r"seq_lens\[2\]=-1"):
        jax.block_until_ready(cpu.paged_decode(query, kc, vc, tables, seq_lens.at[2].set(-1)))


def test_shape_and_dtype_errors(rng):
    query, kc, vc, tables, seq_lens, _, _ = _run(Case(), rng)
    with pytest.raises(ValueError, match="num_heads=8 must be divisible by num_kv_heads=3"):
        cpu.paged_decode(
            query, kc[:, :, :1].repeat(3, 2), vc[:, :, :1].repeat(3, 2), tables, seq_lens
        )
    with pytest.raises(TypeError, match="query dtype int32"):
        cpu.paged_decode(query.astype(jnp.int32), kc, vc, tables, seq_lens)
    with pytest.raises(ValueError, match=r"seq_lens must be \[num_seqs=6\]"):
        cpu.paged_decode(query, kc, vc, tables, seq_lens[:3])
    with pytest.raises(TypeError, match=r"block_tables\.dtype=float32 must be int32"):
        cpu.paged_decode(query, kc, vc, tables.astype(jnp.float32), seq_lens)


def test_jit_traces_once_for_new_values(rng):
    query, kc, vc, tables, seq_lens, _, _ = _run(Case(), rng)
    fn = jax.jit(lambda q, t, s: cpu.paged_decode(q, kc, vc, t, s, scale=0.125))
    fn(query, tables, seq_lens)
    fn(query * 2, tables, jnp.maximum(seq_lens - 1, 0))
    assert fn._cache_size() == 1


def test_vmap_runs_the_kernel_per_batch_element(rng):
    query, kc, vc, tables, seq_lens, kwargs, _ = _run(Case(), rng)
    queries = jnp.stack([query, -query])
    out = jax.vmap(lambda q: cpu.paged_decode(q, kc, vc, tables, seq_lens, **kwargs))(queries)
    for i in range(2):
        np.testing.assert_array_equal(
            np.asarray(out[i]),
            np.asarray(cpu.paged_decode(queries[i], kc, vc, tables, seq_lens, **kwargs)),
        )


def test_grad_names_the_differentiable_path(rng):
    query, kc, vc, tables, seq_lens, _, _ = _run(Case(), rng)
    loss = lambda q: cpu.paged_decode(q, kc, vc, tables, seq_lens).sum()
    with pytest.raises(TypeError, match="varlen_attention"):
        jax.grad(loss)(query)


def _kernel_asm(function: str, flags: tuple[str, ...]) -> str:
    """The disassembly of the first kernel function whose name contains `function`, in the
    library built here; skips (naming what is missing) where that code is not built for this
    CPU's AVX-512 or objdump is missing."""
    have = _build.cpu_flags()  # the flags the build is keyed on
    missing = [f for f in flags if f not in have]
    if missing:
        pytest.skip(f"the CPU has no {', '.join(missing)}: {function} is not built here")
    extra = os.environ.get(_build.EXTRA_FLAGS_ENV, "")
    if "-march=" in extra:
        pytest.skip(f"the kernels are built for {extra!r}, not for this CPU's AVX-512")
    if shutil.which("objdump") is None:
        pytest.skip("no objdump (binutils) on PATH to read the built kernels")
    library = _build.library_path()
    asm = subprocess.run(
        ["objdump", "-d", "-C", "--no-show-raw-insn", str(library)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    name = re.escape(function)
    body = re.search(r"^[0-9a-f]+ <[^\n]*" + name + r"[^\n]*>:\n(.*?)\n\n", asm, re.S | re.M)
    assert body is not None, f"{function} not found in {library}"
    return body.group(1)


def test_codegen_float32_rows_decode_loads_each_chunk_once():
    """Codegen, not speed: the float32 token-major decode (attend_tile_rows) reads each key,
    query and value chunk into a register once. GCC used to fold them into every FMA that
    reads them as memory operands (20 loads per 16 FMAs at GQA 8: the loads set the pace);
    kernel_common.h's pin_register stops it. Broadcasts ({1to16}) and constants (rip-relative)
    are single-use operands and allowed."""
    body = _kernel_asm("attend_tile_rows<float, 8, false>", ("avx512f",))
    fmas = [line for line in body.splitlines() if re.search(r"\tvfn?madd\d+ps ", line)]
    folded = [f for f in fmas if "(" in f and "rip" not in f and "{1to" not in f]
    assert len(fmas) > 100, fmas  # the function's math, not a stub
    assert folded == [], f"{len(folded)} of {len(fmas)} FMAs read memory:\n" + "\n".join(folded[:8])


def test_codegen_float32_rows_decode_stores_no_chunk_it_loads():
    """Codegen, not speed: no key or value chunk that the float32 token-major decode loads is
    stored to the stack right after. GCC 12 compiled each masked load whose mask unrolling made
    all ones into a load plus a dead store of the register to one stack slot (35 in this
    function, float32 GQA 8 decode 1.06-1.13x slower); kernel_common.h's load_chunk gives
    whole chunks a plain load."""
    body = _kernel_asm("attend_tile_rows<float, 8, false>", ("avx512f",)).splitlines()
    stored = []
    for i, line in enumerate(body):
        load = re.search(r"\tvmovu?p[sd]\s+(?:-?0x[0-9a-f]+)?\((%r\w+)[^)]*\),(%zmm\d+)$", line)
        if load is None or load.group(1) in ("%rbp", "%rsp"):
            continue
        spill = re.compile(r"\tvmov\w+\s+" + load.group(2) + r",-?0x[0-9a-f]+\(%r[bs]p\)")
        stored += [(line, after) for after in body[i + 1 : i + 5] if spill.search(after)]
    loads = [line for line in body if re.search(r"\tvmovu?ps\s+[^%]*\(%r\w+\),%zmm", line)]
    assert len(loads) > 32, loads  # the chunk loads of the math, not a stub
    assert stored == [], f"{len(stored)} loaded chunks stored to the stack:\n" + "\n".join(
        f"{a.strip()} / {b.strip()}" for a, b in stored[:8]
    )


def test_codegen_fp8_widening_keeps_its_tables_in_registers():
    """Codegen, not speed: the fp8 decode's byte lookups (decode_fp8.h, 128-byte tables in two
    registers) overwrite their index (VPERMI2B), not a table, and no two-source byte permute
    reads an operand from memory. With the intrinsic, GCC picked VPERMT2B, which overwrites
    a table, and reloaded both tables from memory for every 64 codes (the bf16-query e4m3
    decode ran 1.05-1.10x faster without those loads)."""
    body = _kernel_asm(
        "attend_tile_quads<jax_attn_cpu::e4m3_t, 8>", ("avx512f", "avx512_bf16", "avx512vbmi")
    )
    permutes = [line for line in body.splitlines() if re.search(r"\tvperm[it]2b ", line)]
    lookups = [line for line in permutes if "vpermi2b" in line]
    from_memory = [line for line in permutes if "(" in line]
    assert len(lookups) >= 8, permutes  # the widening of keys and values, not a stub
    assert from_memory == [], "\n".join(from_memory[:8])

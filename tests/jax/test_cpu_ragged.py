"""jax_attn.cpu.ragged_paged_attention (the native FFI kernel) against the float64 oracles.

Every case: random block placement, NaN in unused blocks and tail slots, the new tokens written
through `write_kv` (fp8 scales included), padded metadata (`num_seqs` below the rows, padding
tokens with NaN queries that must come out as zeros), odd lengths, and batches mixing decode,
prefill and chunked prefill. Long prefills cross several tiles and several tasks per
(sequence, kv head), so tile edges, the causal diagonal inside a tile and the windows of the
tiles' first rows are all exercised.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import (
    CaseId,
    assert_native_output,
    bias_and_expected,
    padded_ragged_inputs,
    run_fresh,
    workload,
)
from tolerances import assert_close

import jax_attn
from jax_attn import cpu

REASON = cpu.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"native CPU kernels: {REASON}")

BATCHES = {
    # name: (query_lens, context_lens)
    "decode": ([1, 1, 1, 1], [0, 2, 16, 512]),  # seq lens 1, 3, 17, 513
    "prefill": ([1, 3, 17, 33], [0, 0, 0, 0]),
    "chunked": ([3, 17, 8], [16, 496, 8]),  # 19, 513, 16 (block boundary)
    "mixed": ([17, 1, 3, 1, 16, 70], [0, 31, 14, 0, 16, 45]),
    # 577 new tokens: at G = 4, 19 tiles of 32 tokens (128 rows), three tasks of one (sequence,
    # kv head); at G = 1, 5 tiles of 128 tokens.
    "long": ([577, 1, 130], [0, 700, 67]),
    # A run of 12 decodes (4 or more in a row go to the decode kernel), then two short chunks.
    "decodes": ([1] * 12 + [20, 2], [5, 17, 0, 100, 31, 64, 2, 9, 200, 15, 40, 77, 3, 30]),
    # Decodes between 2-token chunks (no run): enough small tiles that one item takes several
    # kv heads (each key's heads read as one run).
    "interleaved": ([1, 2] * 8, [5, 17, 0, 100, 31, 64, 2, 9, 200, 15, 40, 77, 3, 30, 8, 1]),
    # An output over 8 MiB at Hq 8, D 256 float32 (huge pages asked for), then 4 decodes.
    "large": ([600, 420, 3, 1, 1, 1, 1], [0, 0, 9, 40, 7, 300, 2]),
    # Short decode runs with many keys (decode kernel: 512 keys or more in a run) between a
    # prefill and a chunk, a short one (small tiles), then a run of 10 (staged): a lone decode
    # over 900 keys, a pair over 600 in all, one over 60 keys.
    "lone": (
        [1, 40, 1, 1, 5, 1, 3] + [1] * 10,
        [899, 0, 250, 350, 60, 59, 7, 700, 650, 900, 20, 1000, 3, 750, 800, 600, 710],
    ),
    # A chunk of 40 over 4100 cached keys: its task's keys and values (4 MiB and more at D 128
    # in float32) too many to copy once for its tiles (kSharedRowsBytes), read in place; in
    # bf16 its value pairs (1 MiB) packed once for its tiles (kSharedPairsBytes).
    "past_copy": ([40, 3], [4100, 20]),
    # Prefill tiles and a run of 10 long decodes: the decodes run beside the prefill tasks
    # (run_beside; or, staged, in groups of about 4 MiB of K/V: 2-3 sequences each at Hkv 4,
    # D 128, float32).
    "staged": (
        [40, 33] + [1] * 10,
        [0, 5, 700, 650, 900, 20, 1000, 3, 750, 800, 600, 710],
    ),
}


@dataclasses.dataclass(frozen=True)
class Case(CaseId):
    batch: str = "mixed"
    block_size: int = 16
    head_size: int = 64
    num_heads: int = 8
    num_kv_heads: int = 2
    dtype: str = "float32"
    cache_dtype: str | None = None
    causal: bool = True
    alibi: bool = False
    sliding_window: int | None = None
    soft_cap: float | None = None


# Mixed steps whose decode run goes beside the prefill tiles (run_beside), f32 and bf16.
STAGED = [
    Case(batch="staged", head_size=128, num_heads=16, num_kv_heads=4),
    Case(
        batch="staged",
        head_size=128,
        num_heads=8,
        num_kv_heads=4,
        dtype="bfloat16",
        sliding_window=300,
        alibi=True,
    ),
]

CASES = [
    *(Case(batch=b) for b in BATCHES),
    *(Case(block_size=bs) for bs in (1, 8, 32, 128)),
    Case(batch="chunked", block_size=1),
    Case(batch="long", block_size=128, num_heads=4, num_kv_heads=4),
    # GQA groups 1, 4, 7, 8 (rows per tile 128, 128, 126, 128), MQA.
    *(Case(num_heads=h, num_kv_heads=kv) for h, kv in [(4, 4), (8, 2), (7, 1), (16, 2), (8, 1)]),
    Case(batch="decodes", num_heads=16, num_kv_heads=4, block_size=8),
    Case(batch="interleaved", num_heads=16, num_kv_heads=8, alibi=True, sliding_window=9),
    Case(batch="interleaved", num_heads=8, num_kv_heads=8, dtype="bfloat16", soft_cap=3.0),
    Case(batch="decodes", num_heads=8, num_kv_heads=8, dtype="bfloat16", head_size=128),
    Case(batch="decodes", num_heads=12, num_kv_heads=4, alibi=True, sliding_window=33),
    Case(batch="decodes", num_heads=16, num_kv_heads=4, cache_dtype="float8_e4m3fn", soft_cap=3.0),
    *(Case(head_size=d) for d in (32, 72, 80, 128, 256)),
    # Head sizes that are not whole 8-float vectors: the AVX2 query transpose's partial block.
    Case(batch="long", head_size=36, num_heads=6, num_kv_heads=2, alibi=True),
    Case(dtype="bfloat16", head_size=100, num_heads=5, num_kv_heads=1, block_size=8),
    Case(batch="long", head_size=128, num_heads=32, num_kv_heads=8),
    Case(batch="past_copy", head_size=128, num_heads=4, num_kv_heads=2),
    Case(batch="past_copy", head_size=128, num_heads=4, num_kv_heads=1, dtype="bfloat16"),
    Case(batch="large", head_size=256, num_heads=8, num_kv_heads=2),
    # The same over 8 MiB in bf16 (1027 tokens x 16 heads x 256), on the vdpbf16ps path (AMX,
    # where the CPU has it: there its rows are streamed).
    Case(batch="large", dtype="bfloat16", head_size=256, num_heads=16, num_kv_heads=4),
    *STAGED,
    Case(batch="lone", head_size=128, num_heads=16, num_kv_heads=4, block_size=32),
    # Head sizes past the decode kernel's 256 (vLLM's CPU_ATTN takes 512): decode runs stay in
    # the ragged kernel's tiles. f32, bf16 (vdpbf16ps), fp8, 320 (not a power of two).
    Case(batch="decodes", head_size=512, num_heads=8, num_kv_heads=2, alibi=True),
    Case(batch="lone", head_size=512, num_heads=8, num_kv_heads=2, dtype="bfloat16"),
    Case(
        batch="long",
        head_size=512,
        num_heads=4,
        num_kv_heads=1,
        dtype="bfloat16",
        cache_dtype="float8_e4m3fn",
        sliding_window=300,
        soft_cap=4.0,
    ),
    Case(batch="chunked", head_size=320, num_heads=6, num_kv_heads=3, block_size=32),
    Case(
        batch="lone",
        head_size=128,
        num_heads=8,
        num_kv_heads=2,
        dtype="bfloat16",
        cache_dtype="float8_e4m3fn",
        sliding_window=700,
        alibi=True,
    ),
    *(Case(dtype=d) for d in ("bfloat16", "float16")),
    Case(dtype="bfloat16", cache_dtype="bfloat16", batch="chunked"),
    # bf16 x bf16 (both products through vdpbf16ps where the CPU has it): head sizes that are
    # not whole 32-element runs, and odd key counts per step (the last value pair half empty).
    Case(dtype="bfloat16", batch="long", head_size=80, num_heads=12, num_kv_heads=3),
    Case(dtype="bfloat16", head_size=72, alibi=True, block_size=8),
    Case(dtype="bfloat16", batch="chunked", head_size=256, sliding_window=5, soft_cap=3.0),
    Case(dtype="float32", cache_dtype="bfloat16"),
    Case(dtype="bfloat16", cache_dtype="float8_e4m3fn"),
    Case(dtype="float32", cache_dtype="float8_e5m2"),
    Case(dtype="float16", cache_dtype="float8_e5m2", batch="decode", block_size=8, alibi=True),
    Case(dtype="float32", cache_dtype="float8_e4m3fn", head_size=80, num_heads=7, num_kv_heads=1),
    # A task's keys and values copied once and shared by its tiles, widened from a narrower
    # cache, head size not a whole number of vectors.
    Case(batch="long", cache_dtype="float16", head_size=72, num_heads=4, num_kv_heads=2),
    Case(alibi=True),
    Case(num_heads=6, num_kv_heads=2, alibi=True),  # non-power-of-two head count
    *(Case(sliding_window=w) for w in (1, 5, 16, 40)),
    Case(batch="long", sliding_window=100, block_size=8, num_heads=4, num_kv_heads=1),
    Case(batch="chunked", sliding_window=40, block_size=8),
    Case(soft_cap=2.0),
    Case(causal=False),
    Case(batch="long", causal=False, block_size=32, num_heads=4, num_kv_heads=2),
    Case(batch="chunked", causal=False, alibi=True, sliding_window=20, soft_cap=5.0),
    Case(batch="decode", alibi=True, sliding_window=7, soft_cap=3.0, dtype="bfloat16"),
    Case(
        batch="long",
        alibi=True,
        sliding_window=70,
        soft_cap=4.0,
        num_heads=14,
        num_kv_heads=2,
        head_size=80,
        block_size=1,
    ),
]

PAD_SEQS, PAD_TOKENS = 2, 5


def _run(case: Case, rng: np.random.Generator):
    w, k_scale, v_scale = workload(case, rng, *BATCHES[case.batch])
    md, query, kc, vc = padded_ragged_inputs(
        case, w, k_scale, v_scale, pad_seqs=PAD_SEQS, pad_tokens=PAD_TOKENS
    )
    slopes, bias, expected = bias_and_expected(case, w)
    kwargs = dict(alibi_slopes=slopes, k_scale=k_scale, v_scale=v_scale, **bias)
    return md, query, kc, vc, kwargs, expected


def _call(query, kc, vc, md, **kwargs):
    kwargs.setdefault("scale", query.shape[-1] ** -0.5)
    return cpu.ragged_paged_attention(
        query,
        kc,
        vc,
        md.query_start_loc,
        md.seq_lens,
        md.block_tables,
        md.num_seqs,
        **kwargs,
    )


def _check_against_float64(case: Case, rng):
    md, query, kc, vc, kwargs, expected = _run(case, rng)
    kc_before, vc_before = np.asarray(kc).copy(), np.asarray(vc).copy()
    out = _call(query, kc, vc, md, **kwargs)
    assert_native_output(out, query, expected, case, (kc, vc), (kc_before, vc_before))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_cpu_ragged_matches_float64(case: Case, rng):
    _check_against_float64(case, rng)


@pytest.mark.parametrize(
    "case",
    [Case(alibi=True, sliding_window=9, soft_cap=4.0), Case(dtype="bfloat16", causal=False)],
    ids=str,
)
def test_cpu_ragged_matches_jax_oracle(case: Case, rng):
    """The JAX oracle named in the wrapper's docstring, in float64, with a non-default scale."""
    md, query, kc, vc, kwargs, _ = _run(case, rng)
    out = _call(query, kc, vc, md, scale=0.1, **kwargs)
    with jax.enable_x64(True):
        expected = jax_attn.reference.paged_attention(query, kc, vc, md, scale=0.1, **kwargs)
    assert_close(out, expected, case.dtype)


def test_threads_agree(rng, monkeypatch):
    """One worker and the default workers give the same rows, bit for bit; so do more workers
    than cores (tasks taken ahead by a worker off its core are claimed by another)."""
    md, query, kc, vc, kwargs, expected = _run(Case(batch="long", num_heads=4), rng)
    outs = []
    for threads in ("1", "", "3", "8"):
        if threads:
            monkeypatch.setenv("JAX_ATTN_CPU_THREADS", threads)
        else:
            monkeypatch.delenv("JAX_ATTN_CPU_THREADS", raising=False)
        outs.append(_call(query, kc, vc, md, **kwargs))
    assert_close(outs[0][: len(expected)], expected, "float32")
    for out in outs[1:]:
        np.testing.assert_array_equal(np.asarray(out), np.asarray(outs[0]))


@pytest.mark.parametrize("case", STAGED, ids=str)
def test_mixed_step_schedules_agree(case: Case, rng, monkeypatch):
    """A mixed step's decode run beside its prefill tasks (the default), staged behind them
    ($JAX_ATTN_CPU_MIXED_SCHEDULE=staged) and on one worker: every row within tolerance of the
    float64 oracle, and the same bits in all three (each decode is one item either way)."""
    md, query, kc, vc, kwargs, expected = _run(case, rng)
    outs = []
    for schedule, threads in [(None, None), ("staged", None), (None, "1")]:
        for name, value in [
            ("JAX_ATTN_CPU_MIXED_SCHEDULE", schedule),
            ("JAX_ATTN_CPU_THREADS", threads),
        ]:
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        outs.append(np.asarray(_call(query, kc, vc, md, **kwargs)))
    for out in outs:
        assert_close(out[: len(expected)], expected, case.dtype)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_long_lone_decodes_run_on_the_decode_kernel(dtype, rng):
    """A decode run of fewer than 4 sequences but 512 keys or more goes to the decode kernel
    (split over the workers, every kv head of a token at once) rather than the small tiles: each
    such row has the bits `cpu.paged_decode` gives its run alone; a lone decode over 60 keys
    stays a small tile (here only within tolerance)."""
    case = Case(batch="lone", head_size=128, num_heads=16, num_kv_heads=4, dtype=dtype)
    md, query, kc, vc, kwargs, expected = _run(case, rng)
    out = np.asarray(_call(query, kc, vc, md, **kwargs))
    assert_close(out[: len(expected)], expected, dtype)
    qsl, lens = np.asarray(md.query_start_loc), np.asarray(md.seq_lens)
    kwargs.setdefault("scale", case.head_size**-0.5)
    kwargs.pop("causal", None)  # a decode sees its keys either way
    for first, last in [(0, 1), (2, 4)]:  # the lone decode at 900 keys, the pair (600)
        rows = qsl[first:last]
        alone = cpu.paged_decode(
            query[rows], kc, vc, md.block_tables[first:last], md.seq_lens[first:last], **kwargs
        )
        assert lens[first:last].sum() >= 512
        np.testing.assert_array_equal(out[rows], np.asarray(alone))


def test_num_seqs_zero_gives_zeros(rng):
    md, query, kc, vc, kwargs, _ = _run(Case(), rng)
    out = _call(query, kc, vc, dataclasses.replace(md, num_seqs=jnp.int32(0)), **kwargs)
    np.testing.assert_array_equal(np.asarray(out), 0.0)


def _broken(md, **fields):
    return dataclasses.replace(md, **{k: jnp.asarray(v) for k, v in fields.items()})


def test_bad_metadata_is_an_error_naming_the_argument(rng):
    md, query, kc, vc, _, _ = _run(Case(), rng)
    num_blocks, block_size = kc.shape[:2]
    tables, lens, qsl = md.block_tables, md.seq_lens, md.query_start_loc
    cases = [
        (dict(block_tables=tables.at[5, 4].set(num_blocks)), r"block_tables\[5, 4\]=.*num_blocks"),
        (dict(block_tables=tables.at[0, 0].set(-1)), r"block_tables\[0, 0\]=-1"),
        (dict(block_tables=tables.at[1, 1].set(2**31 - 1)), r"block_tables\[1, 1\]=2147483647"),
        (
            dict(seq_lens=lens.at[1].set(tables.shape[1] * block_size + 1)),
            r"seq_lens\[1\]=.*max_blocks \* block_size",
        ),
        (dict(seq_lens=lens.at[2].set(2)), r"seq_lens\[2\]=2 .*q_len=3"),
        (dict(seq_lens=lens.at[3].set(-1)), r"seq_lens\[3\]=-1"),
        (dict(query_start_loc=qsl.at[2].set(0)), r"query_start_loc.*non-decreasing"),
        (dict(query_start_loc=qsl.at[6].set(10_000)), r"query_start_loc\[6\]=10000 .*query tokens"),
        (dict(num_seqs=jnp.int32(99)), r"num_seqs=99"),
        (dict(num_seqs=jnp.int32(-1)), r"num_seqs=-1"),
    ]
    for fields, message in cases:
        with pytest.raises(Exception, match=message):
            jax.block_until_ready(_call(query, kc, vc, _broken(md, **fields)))
    # Out-of-range ids in blocks no sequence reads (past seq_len, or past num_seqs) are padding.
    unused = _broken(md, block_tables=tables.at[1, 7].set(num_blocks + 7).at[-1, 0].set(-5))
    np.testing.assert_array_equal(
        np.asarray(_call(query, kc, vc, unused)), np.asarray(_call(query, kc, vc, md))
    )


def test_shape_and_dtype_errors(rng):
    md, query, kc, vc, _, _ = _run(Case(), rng)
    with pytest.raises(ValueError, match="num_heads=8 must be divisible by num_kv_heads=3"):
        _call(query, kc[:, :, :1].repeat(3, 2), vc[:, :, :1].repeat(3, 2), md)
    with pytest.raises(TypeError, match="query dtype int32"):
        _call(query.astype(jnp.int32), kc, vc, md)
    with pytest.raises(ValueError, match=r"seq_lens must be \[num_seqs=8\]"):
        _call(query, kc, vc, dataclasses.replace(md, seq_lens=md.seq_lens[:3]))
    with pytest.raises(ValueError, match=r"query_start_loc must be \[num_seqs \+ 1=9\]"):
        _call(query, kc, vc, dataclasses.replace(md, query_start_loc=md.query_start_loc[:3]))
    with pytest.raises(TypeError, match=r"block_tables\.dtype=float32 must be int32"):
        _call(query, kc, vc, _broken(md, block_tables=md.block_tables.astype(jnp.float32)))
    with pytest.raises(ValueError, match=r"alibi_slopes must be \[num_heads=8\]"):
        _call(query, kc, vc, md, alibi_slopes=jnp.ones(3, jnp.float32))
    with pytest.raises(ValueError, match="sliding_window=0 must be >= 1"):
        _call(query, kc, vc, md, sliding_window=0)


def test_jit_compiles_once_across_batch_lengths(rng):
    """Shapes depend only on T, S and max_blocks: new lengths and num_seqs reuse the program."""
    md, query, kc, vc, _, _ = _run(Case(), rng)
    fn = jax.jit(
        lambda q, qsl, lens, tables, n: cpu.ragged_paged_attention(
            q, kc, vc, qsl, lens, tables, n, scale=0.125
        )
    )
    fn(query, md.query_start_loc, md.seq_lens, md.block_tables, md.num_seqs)
    # Same shapes, other lengths: 3 sequences of 4 tokens each, decodes at other positions.
    qsl = jnp.asarray([0, 4, 8, 12, 12, 12, 12, 12, 12], jnp.int32)
    lens = jnp.asarray([4, 20, 9, 0, 0, 0, 0, 0], jnp.int32)
    out = fn(query, qsl, lens, md.block_tables, jnp.int32(3))
    assert fn._cache_size() == 1
    np.testing.assert_array_equal(np.asarray(out[12:], np.float32), 0.0)


def test_vmap_runs_the_kernel_per_batch_element(rng):
    md, query, kc, vc, kwargs, _ = _run(Case(), rng)
    queries = jnp.stack([query, -query])
    out = jax.vmap(lambda q: _call(q, kc, vc, md, **kwargs))(queries)
    for i in range(2):
        np.testing.assert_array_equal(
            np.asarray(out[i]), np.asarray(_call(queries[i], kc, vc, md, **kwargs))
        )


def test_grad_names_the_differentiable_path(rng):
    md, query, kc, vc, _, _ = _run(Case(), rng)
    with pytest.raises(TypeError, match="varlen_attention"):
        jax.grad(lambda q: _call(q, kc, vc, md).sum())(query)


# ---------------------------------------------------------------------------------------------
# The AMX path (bf16 queries on a bf16 or fp8 cache, on CPUs with AMX tiles): every feature and
# the head sizes and block sizes that pad or split its tiles, against the float64 oracle.


def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "amx_tile" in flags and "amx_bf16" in flags


AMX = cpu.isa() is not None and "amx-bf16" in cpu.isa()
amx_only = pytest.mark.skipif(
    not AMX, reason=f"the CPU or the kernels run no AMX tiles here ({cpu.isa()})"
)

AMX_CASES = [
    *(Case(batch=b, dtype="bfloat16", cache_dtype="bfloat16") for b in BATCHES),
    # GQA groups 1, 4, 7, MQA; block sizes that split 16-key tiles across blocks.
    *(
        Case(batch="long", dtype="bfloat16", num_heads=h, num_kv_heads=kv, block_size=bs)
        for h, kv, bs in [(4, 4, 128), (8, 2, 16), (7, 1, 8), (8, 1, 1), (16, 2, 32)]
    ),
    # Head sizes padded to 32 (80, 96 whole, 112, 120, 72) and the largest, 256.
    *(
        Case(batch="chunked", dtype="bfloat16", head_size=d, num_heads=8, num_kv_heads=2)
        for d in (64, 80, 96, 112, 120, 72, 256)
    ),
    Case(batch="long", dtype="bfloat16", head_size=128, num_heads=8, num_kv_heads=2),
    Case(batch="mixed", dtype="bfloat16", alibi=True),
    Case(batch="long", dtype="bfloat16", alibi=True, sliding_window=70, soft_cap=4.0),
    *(Case(batch="chunked", dtype="bfloat16", sliding_window=w) for w in (1, 5, 40)),
    Case(batch="interleaved", dtype="bfloat16", num_heads=16, num_kv_heads=8, soft_cap=3.0),
    Case(batch="long", dtype="bfloat16", causal=False, block_size=32),
    Case(batch="chunked", dtype="bfloat16", causal=False, alibi=True, sliding_window=20),
    # A bf16 output over 8 MiB (1027 tokens x 16 heads x 256): its rows are streamed.
    Case(batch="large", dtype="bfloat16", head_size=256, num_heads=16, num_kv_heads=4),
    # fp8 caches (scales from the case) widened to bf16 for the tiles.
    Case(batch="long", dtype="bfloat16", cache_dtype="float8_e4m3fn", head_size=80),
    Case(batch="mixed", dtype="bfloat16", cache_dtype="float8_e5m2", alibi=True, block_size=8),
    Case(batch="chunked", dtype="bfloat16", cache_dtype="float8_e4m3fn", soft_cap=2.0),
]


def test_isa_names_amx_where_the_cpu_has_it():
    """`cpu.isa()` reports AMX exactly where /proc/cpuinfo has the tiles, in the native build
    (-march=native) unless turned off; a build with emulated tiles (-DJAX_ATTN_AMX_EMULATE=1)
    reports them as emulated on any CPU."""
    import os

    assert cpu.isa() is not None and cpu.isa().startswith("bf16 products: ")
    flags = os.environ.get("JAX_ATTN_CPU_EXTRA_FLAGS", "")
    on = os.environ.get("JAX_ATTN_CPU_AMX", "") != "0"
    if "-DJAX_ATTN_AMX_EMULATE=1" in flags.split():
        assert AMX == on and (("(emulated)" in cpu.isa()) == on), cpu.isa()
        return
    assert "(emulated)" not in cpu.isa()
    native = "-march" not in flags
    if native and on:
        assert AMX == _cpu_has_amx()
    if not native:
        assert not AMX


@amx_only
@pytest.mark.parametrize("case", AMX_CASES, ids=str)
def test_cpu_ragged_amx_matches_float64(case: Case, rng):
    _check_against_float64(case, rng)


@amx_only
@pytest.mark.parametrize("scale", [-0.2, 0.0])
def test_cpu_ragged_amx_non_positive_scale(scale, rng):
    """A scale <= 0 cannot be folded into the row max: the logits are scaled before it."""
    case = Case(batch="long", dtype="bfloat16", alibi=True, num_heads=4, num_kv_heads=1)
    md, query, kc, vc, kwargs, _ = _run(case, rng)
    out = _call(query, kc, vc, md, scale=scale, **kwargs)
    with jax.enable_x64(True):
        expected = jax_attn.reference.paged_attention(query, kc, vc, md, scale=scale, **kwargs)
    assert_close(out, expected, case.dtype)


@amx_only
def test_cpu_ragged_amx_rising_logits(rng):
    """Logits that rise along the keys (ALiBi slopes from 0.01 to 0.6 per key, natural units):
    the AMX path's lazy reference moves on some steps and not others, from a few per item to
    every step, and the output still matches float64."""
    case = Case(batch="long", dtype="bfloat16", alibi=True, num_heads=8, num_kv_heads=2)
    md, query, kc, vc, kwargs, _ = _run(case, rng)
    kwargs["alibi_slopes"] = jnp.asarray(np.geomspace(0.01, 0.6, 8), jnp.float32)
    out = _call(query, kc, vc, md, **kwargs)
    with jax.enable_x64(True):
        expected = jax_attn.reference.paged_attention(
            query, kc, vc, md, scale=query.shape[-1] ** -0.5, **kwargs
        )
    assert_close(out, expected, case.dtype)


def test_cpu_ragged_bf16_without_amx_matches_float64():
    """JAX_ATTN_CPU_AMX=0 (read once per process): the vdpbf16ps path, in a fresh process, on a
    case the AMX path would take here."""
    run_fresh(
        """
        import numpy as np
        import test_cpu_ragged as t
        from jax_attn import cpu
        assert "amx" not in cpu.isa(), cpu.isa()
        for case in (t.Case(batch="long", dtype="bfloat16", alibi=True),
                     t.Case(batch="chunked", dtype="bfloat16", head_size=80, sliding_window=5)):
            md, query, kc, vc, kwargs, expected = t._run(case, np.random.default_rng(7))
            out = t._call(query, kc, vc, md, **kwargs)
            t.assert_native_output(out, query, expected, case, (kc, vc), (kc, vc))
        print("ok")
        """,
        JAX_ATTN_CPU_AMX="0",
    )

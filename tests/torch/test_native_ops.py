"""The native CPU kernels as torch ops (`torch_backends.native`): the decode over vLLM's split
cache against the float64 oracle, bad input refused before any write, `opcheck`,
`torch.compile` without a graph break, and the torch fallback where the C++ is not built."""

import contextlib
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from tolerances import assert_close
from torch_cases import FP8, alibi, nan_cache, put, reference_attention, round_like_cache

from torch_backends import native
from torch_backends.cpu_paged_attn import PagedAttention as CpuPagedAttention
from torch_backends.paged_attn import PagedAttention

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    native.unavailable_reason() is not None,
    reason=f"native torch ops not available: {native.unavailable_reason()}",
)


def split_decode_case(
    gen,
    *,
    num_seqs,
    num_heads,
    num_kv_heads,
    head_size,
    block_size,
    dtype,
    kv_cache_dtype="auto",
    max_len=70,
    k_scale=1.0,
    v_scale=1.0,
):
    """A decode step over a NaN-poisoned split cache filled by index arithmetic: (query, key
    cache, value cache, block tables, seq lens, the keys and values the cache holds as float64
    [sum(seq_lens), Hkv, D])."""
    seq_lens = torch.randint(1, max_len + 1, (num_seqs,), generator=gen).tolist()
    seq_lens[0] = max_len  # one full-length sequence: the tables' width
    seq_lens[-1] = 0 if num_seqs > 2 else seq_lens[-1]  # an empty row gives zeros
    max_blocks = -(-max_len // block_size)
    num_blocks = num_seqs * max_blocks + 2
    ids = torch.randperm(num_blocks, generator=gen)[: num_seqs * max_blocks]
    tables = ids.reshape(num_seqs, max_blocks).to(torch.int32)
    cache_dtype = torch.float32 if kv_cache_dtype in FP8 else dtype
    kv_cache = nan_cache(num_blocks, block_size, num_kv_heads, head_size, cache_dtype,
                         kv_cache_dtype)  # fmt: skip
    keys, values = [], []
    for s, n in enumerate(seq_lens):
        k, v = (torch.randn(n, num_kv_heads, head_size, generator=gen) for _ in "kv")
        for p in range(n):
            slot = int(tables[s, p // block_size]) * block_size + p % block_size
            args = (head_size, num_kv_heads, block_size, kv_cache_dtype)
            put(kv_cache, 0, slot, k[p], *args, k_scale)
            put(kv_cache, 1, slot, v[p], *args, v_scale)
        keys.append(round_like_cache(k, kv_cache_dtype, cache_dtype, k_scale))
        values.append(round_like_cache(v, kv_cache_dtype, cache_dtype, v_scale))
    key_cache, value_cache = PagedAttention.split_kv_cache(kv_cache, num_kv_heads, head_size)
    query = torch.randn(num_seqs, num_heads, head_size, generator=gen).to(dtype)
    return (query, key_cache, value_cache, tables, torch.tensor(seq_lens, dtype=torch.int32),
            torch.cat(keys), torch.cat(values))  # fmt: skip


GRID = [
    # dtype, kv_cache_dtype, head_size, block_size, group, bias
    (torch.float32, "auto", 128, 16, 4, None),
    (torch.float32, "auto", 64, 8, 1, "alibi"),
    (torch.float32, "auto", 80, 32, 2, "window"),
    (torch.float32, "auto", 120, 16, 4, "softcap"),
    (torch.float32, "auto", 256, 16, 8, None),
    (torch.bfloat16, "auto", 128, 16, 4, None),
    (torch.bfloat16, "auto", 96, 16, 2, "alibi"),
    (torch.bfloat16, "auto", 64, 32, 1, "window"),
    (torch.float16, "auto", 64, 16, 4, "softcap"),
    (torch.bfloat16, "fp8", 128, 16, 4, None),
    (torch.float32, "fp8_e4m3", 64, 16, 2, "window"),
    (torch.bfloat16, "fp8_e5m2", 128, 16, 4, "alibi"),
    # Several tiles per block, walked head block by head block; windows start inside a block.
    (torch.float32, "auto", 128, 128, 4, "window"),
    (torch.bfloat16, "auto", 128, 128, 4, "alibi"),
    (torch.bfloat16, "fp8", 64, 64, 2, "window"),
    (torch.bfloat16, "fp8_e5m2", 80, 32, 4, "softcap"),  # an odd number of 16-dim pieces
    (torch.float16, "auto", 80, 128, 2, None),
    # bf16 values as token pairs (transpose_split_value_pairs): 3 and 5 query rows per kv head
    # (a partial group of 4), head sizes of 5 and 7 16-dim pieces.
    (torch.bfloat16, "auto", 80, 32, 3, "softcap"),
    (torch.bfloat16, "auto", 112, 16, 5, None),
    # Blocks of 128: values read as they lie, per dimension (decode_split.h): 3 and 5 query rows
    # per kv head, head sizes of 5 and 7 16-dim pieces, every bias.
    (torch.float32, "auto", 80, 128, 3, "softcap"),
    (torch.float32, "auto", 112, 128, 5, "alibi"),
    (torch.bfloat16, "auto", 80, 128, 5, "window"),
    (torch.bfloat16, "auto", 112, 128, 3, "softcap"),
    # fp8 keys of 4 or more query rows per kv head: the quads' logits (decode_quads.h) on the
    # widened key tile; a partial quad, a last 32-dim chunk of 16, two quads.
    (torch.bfloat16, "fp8", 112, 128, 5, "window"),
    (torch.bfloat16, "fp8_e5m2", 96, 16, 8, "alibi"),
    # bf16 queries on CPUs with AMX tiles (decode_amx_split.h): a last value tile of 8 dims,
    # blocks of 64 and 256 (one and four key tiles), 8 and 9 query rows (two and three groups).
    (torch.bfloat16, "auto", 120, 64, 8, "window"),
    (torch.bfloat16, "fp8", 128, 256, 9, "alibi"),
    (torch.bfloat16, "fp8_e5m2", 64, 64, 1, "softcap"),
    # float32 head sizes that are not a multiple of 8 (x = 4): on AVX2 builds the keys and values
    # go through float32 tiles (decode_avx2.h) instead of being read in place.
    (torch.float32, "auto", 36, 128, 3, "alibi"),
    (torch.float32, "auto", 100, 16, 4, "softcap"),
]


@pytest.mark.parametrize("dtype,kv_cache_dtype,head_size,block_size,group,bias", GRID)
def test_decode_matches_the_float64_oracle(
    dtype, kv_cache_dtype, head_size, block_size, group, bias, rng
):
    _decode_against_oracle(dtype, kv_cache_dtype, head_size, block_size, group, bias, rng)


# The blocks of 128 in float32 and bf16 again, on the per-dimension lanes (decode_split.h), which
# the kernel takes only under JAX_ATTN_CPU_SPLIT_LANES=1; head sizes the sanitizer's quick build
# (JAX_ATTN_CPU_FEW_HEAD_SIZES: 32, 64, 80, 128, 256) runs on the vector kernel, the others
# there on the scalar one, which has no lanes.
LANE_GRID = [
    g for g in GRID
    if g[1] == "auto" and g[3] >= 128 and g[0] != torch.float16 and g[2] in (32, 64, 80, 128, 256)
]  # fmt: skip


@pytest.mark.parametrize("dtype,kv_cache_dtype,head_size,block_size,group,bias", LANE_GRID)
def test_decode_on_the_lanes_matches_the_float64_oracle(
    dtype, kv_cache_dtype, head_size, block_size, group, bias, rng, monkeypatch
):
    case = (dtype, kv_cache_dtype, head_size, block_size, group, bias)
    seed = int(rng.integers(2**31))
    tiles = _decode_against_oracle(*case, np.random.default_rng(seed))
    monkeypatch.setenv("JAX_ATTN_CPU_SPLIT_LANES", "1")
    lanes = _decode_against_oracle(*case, np.random.default_rng(seed))
    if native.split_decode_path(dtype, kv_cache_dtype, block_size, group) == "amx":
        # bf16 queries on this CPU's AMX tiles: the switch must not move them off the tiles.
        assert torch.equal(lanes, tiles)
    elif "vectors: avx512" not in native.isa():
        # The lanes are AVX-512 code: a build without it has one split path (decode_avx2.h).
        # (isa() names the vector code apart from the bf16 products: an emulated-AMX build's
        # products say "amx-bf16 (emulated)" over AVX-512 lanes.)
        assert torch.equal(lanes, tiles)
    else:
        # The same inputs summed in another order: the switch reached another path.
        assert not torch.equal(lanes, tiles)


def _decode_against_oracle(dtype, kv_cache_dtype, head_size, block_size, group, bias, rng):
    """One random split-layout decode through CpuPagedAttention.forward_decode, checked against
    the float64 reference; returns its output."""
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    hkv = 2
    scales = (0.7, 1.3) if kv_cache_dtype in FP8 else (1.0, 1.0)
    q, kc, vc, tables, lens, keys, values = split_decode_case(
        gen, num_seqs=5, num_heads=hkv * group, num_kv_heads=hkv, head_size=head_size,
        block_size=block_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
        k_scale=scales[0], v_scale=scales[1], max_len=max(70, 2 * block_size + 37),
    )  # fmt: skip
    bias_kwargs = {
        None: {},
        "alibi": dict(alibi_slopes=torch.tensor(alibi(hkv * group))),
        "window": dict(sliding_window=19),
        "softcap": dict(logits_soft_cap=3.0),
    }[bias]
    out = torch.full_like(q, float("nan"))
    CpuPagedAttention.forward_decode(
        out, q, kc, vc, tables, lens, int(lens.max()), kv_cache_dtype, hkv, 0.3,
        bias_kwargs.get("alibi_slopes"), *scales,
        sliding_window=bias_kwargs.get("sliding_window"),
        logits_soft_cap=bias_kwargs.get("logits_soft_cap"),
    )  # fmt: skip
    expected = reference_attention(
        q, keys, values, [1] * len(lens), lens.tolist(), causal=True, scale=0.3, **bias_kwargs
    )
    assert_close(out.float(), expected, dtype, FP8.get(kv_cache_dtype), what="native decode")
    return out


@pytest.mark.parametrize(
    "kv_cache_dtype,block_size,window",
    [("auto", 128, None), ("fp8", 16, 700), ("auto", 32, 901), ("fp8_e5m2", 128, 333)],
)
def test_long_sequences_in_split_k_parts_match_the_float64_oracle(
    kv_cache_dtype, block_size, window, rng
):
    """Sequences of up to 1800 keys: the kernel cuts them into parts of at least 512 keys
    (split-K), whose softmax states merge in the part that finishes last. bf16 queries: on CPUs
    with AMX tiles the split AMX decode's parts, elsewhere the vector ones; windows that start
    inside a block (at block 128, fp8 values converted 64 tokens at a time from there)."""
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    scales = (0.7, 1.3) if kv_cache_dtype in FP8 else (1.0, 1.0)
    q, kc, vc, tables, lens, keys, values = split_decode_case(
        gen, num_seqs=3, num_heads=8, num_kv_heads=2, head_size=128, block_size=block_size,
        dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype, k_scale=scales[0],
        v_scale=scales[1], max_len=1800,
    )  # fmt: skip
    assert int(lens[0]) == 1800  # at least 3 parts whatever the thread count
    out = torch.full_like(q, float("nan"))
    CpuPagedAttention.forward_decode(
        out, q, kc, vc, tables, lens, int(lens.max()), kv_cache_dtype, 2, 0.3, None, *scales,
        sliding_window=window,
    )  # fmt: skip
    expected = reference_attention(
        q, keys, values, [1] * len(lens), lens.tolist(), causal=True, scale=0.3,
        sliding_window=window,
    )  # fmt: skip
    assert_close(out.float(), expected, torch.bfloat16, FP8.get(kv_cache_dtype),
                 what="native decode, split-K")  # fmt: skip


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_a_fused_projections_query_is_read_where_it_lies(kv_cache_dtype, rng, monkeypatch):
    """vLLM's query, a view of the fused qkv projection (tokens (Hq + 2 Hkv) * D apart, each
    token's heads dense), is read in place, nothing staged, and gives the bits of its
    contiguous copy: bf16 queries (the quads, or AMX tiles where the CPU has them), split-K
    parts of a long sequence included."""
    monkeypatch.setattr(native, "STAGE_MIN_BYTES", 0)  # would stage this small query
    monkeypatch.setattr(native, "_staging", threading.local())
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    q, kc, vc, tables, lens = split_decode_case(
        gen, num_seqs=5, num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
        dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype, max_len=1800,
    )[:5]  # fmt: skip
    fused = torch.randn(q.shape[0], 12, 128, generator=gen).to(torch.bfloat16)
    fused[:, :8] = q
    outs = []
    for query in (q, fused[:, :8]):
        out = torch.full_like(q, 7.0)
        native.paged_decode_split(
            out, query, kc, vc, tables, lens, scale=0.125, alibi_slopes=None, k_scale=0.8,
            v_scale=1.3, sliding_window=None, logits_soft_cap=None,
            kv_cache_dtype=kv_cache_dtype,
        )  # fmt: skip
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert not getattr(native._staging, "buffers", {}), "the strided query was staged"


def _small_case(rng, dtype=torch.float32):
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    return split_decode_case(
        gen, num_seqs=3, num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype
    )[:5]


def _call(out, q, kc, vc, tables, lens):
    native.paged_decode_split(
        out, q, kc, vc, tables, lens, scale=0.125, alibi_slopes=None, k_scale=1.0,
        v_scale=1.0, sliding_window=None, logits_soft_cap=None, kv_cache_dtype="auto",
    )  # fmt: skip


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda t, n: t.__setitem__((0, 1), 10_000), r"block_tables\[0, 1\]=10000 must be in"),
        (lambda t, n: t.__setitem__((0, 0), -1), r"block_tables\[0, 0\]=-1 must be in"),
        (lambda t, n: n.__setitem__(1, 10_000), r"seq_lens\[1\]=10000 must be in \[0, max_"),
        (lambda t, n: n.__setitem__(2, -4), r"seq_lens\[2\]=-4 must be in"),
    ],
)
def test_bad_values_raise_before_any_write(damage, message, rng):
    q, kc, vc, tables, lens = _small_case(rng)
    damage(tables, lens)
    out = torch.full_like(q, 7.0)
    snapshot = (kc.clone(), vc.clone())
    with pytest.raises(ValueError, match=message):
        _call(out, q, kc, vc, tables, lens)
    assert torch.equal(out, torch.full_like(q, 7.0))  # not one row written
    for before, after in zip(snapshot, (kc, vc), strict=True):  # the caches' bytes unchanged
        assert torch.equal(before.view(torch.uint8), after.view(torch.uint8))


def test_bad_shapes_and_dtypes_name_the_argument(rng):
    q, kc, vc, tables, lens = _small_case(rng)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        torch.ops.jax_attn.paged_decode_split(
            out, q, kc, vc, tables.long(), lens, None, 0.1, torch.ones(1), torch.ones(1), 0,
            0.0, "auto",
        )  # fmt: skip
    with pytest.raises(ValueError, match="out must have the query's shape and dtype"):
        _call(out[:2], q, kc, vc, tables, lens)
    with pytest.raises(ValueError, match=r"value_cache .* must be \[num_blocks, num_kv_heads"):
        _call(out, q, kc, vc[:, :1].contiguous(), tables, lens)
    with pytest.raises(ValueError, match="kv_cache_dtype=fp9 must be auto, fp8"):
        kc8 = torch.zeros(kc.shape[0], 2, 64 // 16, 16, 16, dtype=torch.uint8)
        vc8 = torch.zeros(kc.shape[0], 2, 64, 16, dtype=torch.uint8)
        native.paged_decode_split(
            out, q, kc8, vc8, tables, lens,
            scale=0.1, alibi_slopes=None, k_scale=1.0, v_scale=1.0, sliding_window=None,
            logits_soft_cap=None, kv_cache_dtype="fp9",
        )  # fmt: skip


def test_opcheck(rng):
    q, kc, vc, tables, lens = _small_case(rng, torch.bfloat16)
    args = (torch.empty_like(q), q, kc, vc, tables, lens, torch.rand(4), 0.125,
            torch.ones(1), torch.ones(1), 0, 0.0, "auto")  # fmt: skip
    torch.library.opcheck(torch.ops.jax_attn.paged_decode_split.default, args)


def test_torch_compile_traces_a_decode_without_a_graph_break(rng):
    q, kc, vc, tables, lens = _small_case(rng)

    def step(query, out):
        CpuPagedAttention.forward_decode(
            out, query * 2.0, kc, vc, tables, lens, 64, "auto", 2, 0.125, None, 1.0, 1.0,
            sliding_window=24,
        )  # fmt: skip
        return out + 1.0

    eager = step(q, torch.empty_like(q))
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)  # inductor; fullgraph: no graph break
    assert torch.equal(compiled(q, torch.empty_like(q)), eager)


def _run_child(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), full_env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=full_env, timeout=600)  # fmt: skip


DECODE_IN_A_CHILD = """
    import sys, warnings
    import torch
    from torch_backends import get_attn_backend, AttentionLayer, native
    backend = get_attn_backend("TORCH_SDPA")
    impl = backend.get_impl_cls()(4, 64, 0.125, 2, None, None, "auto")
    md = backend.get_builder_cls()(None).build(
        [20, 7], [1, 1], -1, -1, block_tables=[[1, 0], [2]], block_size=16)
    kv = torch.randn(2, 3, 16 * 2 * 64)
    q = torch.randn(2, 4 * 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = impl.forward(AttentionLayer(1.0, 1.0), q, None, None, kv, md)
        b = impl.forward(AttentionLayer(1.0, 1.0), q, None, None, kv, md)
    print("REASON:", native.unavailable_reason())
    print("WARNINGS:", sum("native CPU kernels are not available" in str(w.message)
                           for w in caught))
    print("EQUAL:", torch.equal(a, b), "FINITE:", bool(a.isfinite().all()))
    print("JAX:", "jax" in sys.modules)
"""


def test_without_the_library_decode_runs_in_torch_and_says_so_once():
    result = _run_child(DECODE_IN_A_CHILD, JAX_ATTN_CPU_DISABLE="1")
    assert result.returncode == 0, result.stderr
    assert "REASON: disabled by JAX_ATTN_CPU_DISABLE=1" in result.stdout
    assert "WARNINGS: 1" in result.stdout  # two decodes, one warning
    assert "EQUAL: True FINITE: True" in result.stdout


def test_the_kernel_units_compile_as_the_xla_librarys():
    """Only torch_ops.cc gets torch's flags of its own (OpenMP): the kernels' units compile with
    the XLA library's code-generation flags, so the two libraries share their objects."""
    build = native._builder()
    lib = native._torch_library(build)
    items = {p.name for p in build.CSRC.glob("decode_items_*.cc")}  # the decode kernel's
    assert len(items) == 4  # one unit per cache dtype: f32, bf16, e4m3, e5m2
    assert {u.name for u in lib.units()} >= {"paged_decode.cc", "torch_ops.cc", *items}
    for unit in lib.units():
        flags = lib.unit_flags(unit)
        assert flags == [] or unit.name == "torch_ops.cc", (unit.name, flags)
        codegen = build._codegen_args([*lib.compile_flags(), *flags])
        if unit.name != "torch_ops.cc":
            assert codegen == [], (unit.name, codegen)  # preprocessor flags only


def test_the_torch_half_runs_native_without_importing_jax():
    result = _run_child(DECODE_IN_A_CHILD)
    assert result.returncode == 0, result.stderr
    assert "REASON: None" in result.stdout and "WARNINGS: 0" in result.stdout
    assert "JAX: False" in result.stdout


COMPILE_FIRST_IN_A_CHILD = """
    import warnings
    import torch
    from torch_backends import native
    from torch_backends.cpu_paged_attn import PagedAttention

    kv = torch.randn(2, 3, 16 * 2 * 64)
    kc, vc = (c.view(3, 2, 64, 16) for c in kv)
    key_cache = kc.reshape(3, 2, 16, 4, 16).transpose(2, 3).contiguous().view(3, 2, 16, 16, 4)
    tables = torch.tensor([[1, 0], [2, 0]], dtype=torch.int32)
    lens = torch.tensor([20, 7], dtype=torch.int32)
    graphs = []

    def record(gm, example_inputs):  # a torch.compile backend that keeps the traced graph
        graphs.append(gm)
        return gm.forward

    def step(query, out):
        PagedAttention.forward_decode(
            out, query * 2.0, key_cache, vc, tables, lens, 32, "auto", 2, 0.125, None, 1.0,
            1.0)
        return out + 1.0

    q = torch.randn(2, 4, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(step, backend=record, fullgraph=True)(q, torch.empty_like(q))
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes]
    print("NATIVE_IN_GRAPH:", any("jax_attn.paged_decode_split" in t for t in targets))
    print("WARNINGS:", sum("native CPU kernels are not available" in str(w.message)
                           for w in caught))
    print("MATCHES_EAGER:", torch.allclose(compiled, step(q, torch.empty_like(q))))
"""


def test_torch_compile_first_in_a_fresh_process_traces_the_native_op():
    """Compiling before any eager call (the library not loaded yet) still puts the native
    decode in the graph, not the vectorized-torch fallback."""
    result = _run_child(COMPILE_FIRST_IN_A_CHILD)
    assert result.returncode == 0, result.stderr
    assert "NATIVE_IN_GRAPH: True" in result.stdout, result.stdout
    assert "WARNINGS: 0" in result.stdout and "MATCHES_EAGER: True" in result.stdout


def test_torch_compile_without_the_library_traces_torch_and_says_so():
    result = _run_child(COMPILE_FIRST_IN_A_CHILD, JAX_ATTN_CPU_DISABLE="1")
    assert result.returncode == 0, result.stderr
    assert "NATIVE_IN_GRAPH: False" in result.stdout, result.stdout
    assert "WARNINGS: 1" in result.stdout and "MATCHES_EAGER: True" in result.stdout


def test_native_and_torch_paths_agree(rng):
    """The same decode through the kernel and through the vectorized-torch fallback."""
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    q, kc, vc, tables, lens, *_ = split_decode_case(
        gen, num_seqs=4, num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
        dtype=torch.float32, max_len=300,
    )  # fmt: skip
    out = torch.empty_like(q)
    _call(out, q, kc, vc, tables, lens)
    with _torch_path():
        fallback = PagedAttention.forward_decode(
            q, kc, vc, tables, lens, int(lens.max()), "auto", 2, 0.125, None, 1.0, 1.0
        )
    np.testing.assert_allclose(out.numpy(), fallback.numpy(), rtol=2e-6, atol=2e-6)


@contextlib.contextmanager
def _torch_path():
    """A context in which `native.available()` is False (the vectorized-torch fallback)."""
    saved = dict(native._state)
    native._state.update(reason="forced for this test", warned=True)
    try:
        yield
    finally:
        native._state.clear()
        native._state.update(saved)


@pytest.mark.parametrize("kv_cache_dtype,dtype", [("auto", torch.float32),
                                                  ("auto", torch.bfloat16),
                                                  ("fp8", torch.bfloat16),
                                                  ("fp8_e5m2", torch.float16)])  # fmt: skip
@pytest.mark.parametrize("fused", [False, True], ids=["rows", "fused-qkv"])
def test_cache_write_is_byte_identical_to_the_torch_path(kv_cache_dtype, dtype, fused, rng):
    """fused: key and value as vLLM hands them over, views of one qkv projection (tokens
    (4 + 2 Hkv) * D apart), which the native write reads where they lie."""
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    num_blocks, block_size, hkv, d, tokens = 12, 16, 2, 64, 40
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::7] = -1  # PAD_SLOT_ID: skipped
    key, value = (torch.randn(tokens, hkv, d, generator=gen).to(dtype) for _ in "kv")
    if fused:
        qkv = torch.randn(tokens, 4 + 2 * hkv, d, generator=gen).to(dtype)
        qkv[:, 4 : 4 + hkv], qkv[:, 4 + hkv :] = key, value
        key, value = qkv[:, 4 : 4 + hkv], qkv[:, 4 + hkv :]
        assert not key.is_contiguous() and not value.is_contiguous()
    _assert_native_write_is_torchs(key, value, slots, num_blocks, block_size, kv_cache_dtype)


def _assert_native_write_is_torchs(key, value, slots, num_blocks, block_size, kv_cache_dtype):
    """The native write and the torch path's into NaN caches are byte-identical, and (unquantized
    caches) exactly the given slots' rows became finite."""
    hkv, d = key.shape[1:]
    caches = []
    for use_torch in (False, True):
        kv_cache = nan_cache(num_blocks, block_size, hkv, d, key.dtype, kv_cache_dtype)
        key_cache, value_cache = PagedAttention.split_kv_cache(kv_cache, hkv, d)
        with _torch_path() if use_torch else contextlib.nullcontext():
            PagedAttention.write_to_paged_cache(
                key, value, key_cache, value_cache, slots, kv_cache_dtype, 0.8, 1.2
            )
        caches.append(kv_cache.view(torch.uint8))
    assert torch.equal(caches[0], caches[1])
    if kv_cache_dtype == "auto":
        written = int((slots >= 0).sum())
        assert int(caches[0].view(key.dtype).isfinite().sum()) == 2 * written * hkv * d


@pytest.mark.parametrize("kv_cache_dtype,dtype,head_size,block_size",
                         [("auto", torch.float32, 120, 16),
                          ("auto", torch.bfloat16, 80, 32),
                          ("auto", torch.float32, 64, 128),
                          ("fp8", torch.bfloat16, 80, 16),
                          ("fp8_e5m2", torch.float16, 256, 8)])  # fmt: skip
def test_cache_write_of_prefill_runs_is_byte_identical_to_the_torch_path(
    kv_cache_dtype, dtype, head_size, block_size, rng
):
    """A prefill's slots follow each other through its blocks, which the native write takes
    as runs (a dimension of many tokens at a time): runs that start mid-block and cross into
    the next, longer than one 16-token tile, and a pad inside a run."""
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    num_blocks, hkv = 160 // block_size + 2, 2
    third = num_blocks * block_size // 3  # run k starts anywhere in third k that it fits
    runs = [(k * third + int(torch.randint(0, third - n + 1, (), generator=gen)), n)
            for k, n in enumerate((37, 5, 21))]  # fmt: skip
    slots = torch.cat([torch.arange(start, start + n) for start, n in runs])
    slots[9] = -1
    tokens = len(slots)
    key, value = (torch.randn(tokens, hkv, head_size, generator=gen).to(dtype) for _ in "kv")
    _assert_native_write_is_torchs(key, value, slots, num_blocks, block_size, kv_cache_dtype)


def test_cache_write_refuses_a_bad_slot_before_any_write(rng):
    kv_cache = nan_cache(4, 16, 2, 64, torch.float32, "auto")
    key_cache, value_cache = PagedAttention.split_kv_cache(kv_cache, 2, 64)
    key = torch.randn(3, 2, 64)
    before = kv_cache.clone()
    with pytest.raises(ValueError, match=r"slot_mapping\[2\]=64 must be -1 \(PAD_SLOT_ID\) or"):
        native.store_split(key, key, key_cache, value_cache, torch.tensor([0, 5, 64]))
    assert torch.equal(before.isnan(), kv_cache.isnan())  # still all NaN: nothing written


def test_a_repeated_slot_keeps_the_later_row():
    """Also where the repeats are runs of following slots (the native write's runs)."""
    kv_cache = torch.zeros(2, 2, 16 * 1 * 16)
    key_cache, value_cache = PagedAttention.split_kv_cache(kv_cache, 1, 16)
    rows = torch.arange(9.0)[:, None, None].expand(9, 1, 16).contiguous()
    slots = torch.tensor([3, 3, -1, 5, 6, 7, 6, 7, 8])
    native.store_split(rows, rows, key_cache, value_cache, slots)
    for slot, row in {3: 1, 5: 3, 6: 6, 7: 7, 8: 8}.items():
        assert torch.equal(value_cache[0, 0, :, slot], torch.full((16,), float(row)))
        assert torch.equal(key_cache[0, 0, :, slot].reshape(16), torch.full((16,), float(row)))


@pytest.mark.parametrize("use_torch", [False, True])
def test_copy_blocks_reads_every_source_before_writing(use_torch, rng):
    caches = [torch.randn(2, 6, 32) for _ in range(3)]
    originals = [c.clone() for c in caches]
    chain = torch.tensor([[0, 1], [1, 2], [5, 0]])  # 1 <- 0, 2 <- old 1, 0 <- 5
    with _torch_path() if use_torch else contextlib.nullcontext():
        CpuPagedAttention.copy_blocks(caches, chain)
    for cache, orig in zip(caches, originals, strict=True):
        expected = orig.clone()
        expected[:, [1, 2, 0]] = orig[:, [0, 1, 5]]
        assert torch.equal(cache, expected)


@pytest.mark.parametrize("use_torch", [False, True])
def test_swap_and_copy_refuse_bad_block_ids_before_any_copy(use_torch):
    caches = [torch.randn(2, 6, 32) for _ in range(2)]
    originals = [c.clone() for c in caches]
    with _torch_path() if use_torch else contextlib.nullcontext():
        with pytest.raises(ValueError, match=r"src_to_dists\[1, 1\]=6 is out of range"):
            CpuPagedAttention.copy_blocks(caches, torch.tensor([[0, 1], [2, 6]]))
        with pytest.raises(ValueError, match=r"src_to_dst\[0, 0\]=-1 is out of range"):
            PagedAttention.swap_blocks(caches[0], caches[1], torch.tensor([[-1, 2]]))
    assert all(torch.equal(c, o) for c, o in zip(caches, originals, strict=True))


def test_opcheck_cache_ops():
    kv_cache = torch.randn(2, 4, 16 * 2 * 64)
    key_cache, value_cache = PagedAttention.split_kv_cache(kv_cache, 2, 64)
    key = torch.randn(5, 2, 64)
    torch.library.opcheck(
        torch.ops.jax_attn.store_split.default,
        (key, key.clone(), key_cache, value_cache, torch.tensor([0, 9, -1, 40, 63])),
    )
    caches = [torch.randn(2, 4, 32), torch.randn(2, 4, 32)]
    torch.library.opcheck(
        torch.ops.jax_attn.copy_blocks.default, (caches, caches, torch.tensor([[0, 3], [1, 2]]))
    )
    blocks = (torch.empty(3, 16, 2, 64), torch.empty(3, 16, 2, 64))
    torch.library.opcheck(
        torch.ops.jax_attn.gather_split_blocks.default,
        (key_cache, value_cache, torch.tensor([3, 0]), *blocks),
    )


@pytest.mark.parametrize(
    "dtype,head_size,block_size,num_ids",
    [
        (torch.float32, 128, 16, 9),
        (torch.float32, 80, 128, 3),
        (torch.bfloat16, 64, 32, 5),
        (torch.float16, 96, 8, 7),
        (torch.uint8, 128, 128, 4),  # fp8 bit patterns
        (torch.float32, 64, 16, 0),
    ],
)
def test_gather_split_blocks_is_the_permuted_copy(dtype, head_size, block_size, num_ids, rng):
    """Blocks of the split layout in token-major order, byte for byte as torch's permuted
    index_select makes them (the path it replaced), into the first num_ids blocks of the
    outputs; the rest of them untouched."""
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    num_blocks, hkv = 11, 2
    if dtype == torch.uint8:
        raw = torch.randint(0, 256, (2, num_blocks, hkv * head_size * block_size), generator=gen)
        kv_cache = raw.to(torch.uint8)
    else:
        kv_cache = torch.randn(2, num_blocks, hkv * head_size * block_size, generator=gen)
        kv_cache = kv_cache.to(dtype)
    key_cache, value_cache = PagedAttention.split_kv_cache(kv_cache, hkv, head_size)
    ids = torch.randint(0, num_blocks, (num_ids,), generator=gen)
    x = key_cache.shape[-1]
    keys = torch.full((num_ids + 2, block_size, hkv, head_size), 7, dtype=dtype)
    values = keys.clone()
    native.gather_split_blocks(key_cache, value_cache, ids, keys, values)
    want_k = key_cache.permute(0, 3, 1, 2, 4)[ids].reshape(num_ids, block_size, hkv, head_size)
    want_v = value_cache.permute(0, 3, 1, 2)[ids]
    assert x * key_cache.element_size() == 16
    assert torch.equal(keys[:num_ids], want_k) and torch.equal(values[:num_ids], want_v)
    assert bool((keys[num_ids:] == 7).all()) and bool((values[num_ids:] == 7).all())


def test_gather_split_blocks_refuses_bad_input_before_any_write():
    kv_cache = torch.randn(2, 4, 2 * 64 * 16)
    key_cache, value_cache = PagedAttention.split_kv_cache(kv_cache, 2, 64)
    keys, values = torch.full((3, 16, 2, 64), 7.0), torch.full((3, 16, 2, 64), 7.0)
    op = torch.ops.jax_attn.gather_split_blocks
    cases = [
        ((key_cache, value_cache, torch.tensor([0, 4]), keys, values),
         r"block_ids\[1\]=4 must be in \[0, num_blocks=4\)"),
        ((key_cache, value_cache, torch.tensor([-1]), keys, values), r"block_ids\[0\]=-1"),
        ((key_cache, value_cache, torch.tensor([0, 1], dtype=torch.int32), keys, values),
         r"block_ids must be int64"),
        ((key_cache, value_cache, torch.tensor([0, 1, 2, 3]), keys, values),
         r"keys must be \[at least num_ids=4, block_size=16"),
        ((key_cache, value_cache, torch.tensor([0]), keys, values.double()),
         r"must have one dtype"),
        ((key_cache, value_cache, torch.tensor([0]), keys, keys), r"keys must not share memory"),
        ((key_cache, value_cache[:, :1].contiguous(), torch.tensor([0]), keys, values),
         r"value_cache .* must be \[num_blocks, num_kv_heads, head_size, block_size\]"),
    ]  # fmt: skip
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            op(*args)
    assert bool((keys == 7.0).all()) and bool((values == 7.0).all())


def test_the_ops_share_torchs_openmp_runtime():
    """One OpenMP runtime in the process (torch's): a second would bring a second pool of
    threads fighting torch's over the cores, and without -fopenmp at::parallel_for ran on
    the calling thread alone (2.3x slower decodes, seen before this test)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc/self/maps on this OS to list the loaded libraries")
    loaded = {line.split()[-1] for line in maps.read_text().splitlines() if "gomp" in line}
    torch_dir = Path(torch.__file__).parent / "lib"
    assert loaded, "no OpenMP runtime loaded: at::parallel_for would run single-threaded"
    assert all(Path(p).parent == torch_dir for p in loaded), loaded

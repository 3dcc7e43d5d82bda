"""The Pallas TPU kernels compiled for a v5e, a v6e and a v5p that are not here
(`pallas.tpu_compile`), beside JAX's own TPU kernels.

Tests marked `tpu_aot` need libtpu, `JAX_PLATFORMS=cpu` and the TPU_* variables of docs/tpu.md:
the tpu-aot environment (`bash scripts/env.sh tpu-aot`), which `scripts/test.sh` runs them in.
Each compiles one kernel configuration through Mosaic and XLA:TPU for a described chip and
fails on a compile error or VMEM over the chip's capacity; an oversized plan must fail that
compile with the chip's own VMEM figure. The other tests (chip figures, the grid, the roofline
arithmetic) run in every environment.
"""

import os
import re

import pytest

from jax_attn.pallas import tpu_compile

REASON = tpu_compile.unavailable_reason()
# scripts/test.sh sets this in the tpu-aot environment: there "cannot compile" is a failure.
REQUIRED = bool(os.environ.get("JAX_ATTN_REQUIRE_TPU_AOT"))
needs_aot = pytest.mark.skipif(
    REASON is not None and not REQUIRED, reason=f"no TPU compile here: {REASON}"
)
MiB = 1024**2


@pytest.fixture(autouse=True)
def _aot_ready(request):
    if request.node.get_closest_marker("tpu_aot") is not None:
        assert REASON is None, f"JAX_ATTN_REQUIRE_TPU_AOT is set but: {REASON}"


def test_targets_carry_jax_published_figures():
    v5e, v6e, v5p = (tpu_compile.TARGETS[n] for n in ("v5e", "v6e", "v5p"))
    assert (v5e.topology, v6e.topology, v5p.topology) == ("v5e:2x2", "v6e:2x2", "v5p:2x2x1")
    assert v5e.vmem_capacity == v6e.vmem_capacity == 128 * MiB
    assert v5p.vmem_capacity == 64 * MiB  # per TensorCore
    assert v5e.hbm_bandwidth == pytest.approx(8.2e11)
    assert v6e.bf16_flops == pytest.approx(9.2e14)
    # v5p: one JAX device is a megacore of two TensorCores, the chip's whole figures.
    assert v5p.hbm_bandwidth == pytest.approx(2.46e12, rel=1e-6)
    assert v5p.bf16_flops == pytest.approx(4.59e14, rel=1e-6)


def test_grid_covers_the_issue():
    """Every value of every axis of issue 23 is compiled somewhere: both kernels x bf16/f32
    queries x bf16/e4m3 caches in full, each such combination with D=256 on page 128 (the
    VMEM worst case), and every head size, page size, group and bias feature."""
    grid = tpu_compile.default_grid()
    assert 30 <= len(grid) <= 40
    assert len({c.id for c in grid}) == len(grid)
    combos = {(c.kernel, c.query_dtype, c.cache_dtype) for c in grid}
    assert combos == {
        (k, q, kv)
        for k in ("decode", "ragged")
        for q in ("bfloat16", "float32")
        for kv in ("bfloat16", "float8_e4m3fn")
    }
    assert {c.head_size for c in grid} == {64, 128, 256}
    assert {c.block_size for c in grid} == {16, 32, 64, 128}
    assert {c.group for c in grid} == {1, 4, 8}
    for combo in combos:
        configs = [c for c in grid if (c.kernel, c.query_dtype, c.cache_dtype) == combo]
        assert any((c.head_size, c.block_size) == (256, 128) for c in configs)
    for kernel in ("decode", "ragged"):
        configs = [c for c in grid if c.kernel == kernel]
        assert any(c.alibi for c in configs)
        assert any(c.sliding_window for c in configs)
        assert any(c.logits_soft_cap for c in configs)
        assert any(c.features == "-" for c in configs)


def test_roofline_by_hand():
    """Decode of 32 sequences x 1024 keys, Hkv=8, G=4, D=128, bf16, on a v5e."""
    config = tpu_compile.KernelConfig("decode", "bfloat16", "bfloat16", 128, 16, 4)
    v5e = tpu_compile.TARGETS["v5e"]
    r = tpu_compile.roofline(config, v5e, num_seqs=32, seq_len=1024, q_len=1)
    kv = 2 * 32 * 1024 * 8 * 128 * 2  # K and V of every key, bf16
    q_out = 2 * 32 * 32 * 128 * 2  # the queries in, the output out
    assert r.bytes == kv + q_out == 134_742_016
    assert r.flops == 4 * 32 * 1024 * 32 * 128 == 536_870_912
    assert r.seconds_memory == pytest.approx(134_742_016 / 8.2e11)  # 164.3 us
    assert r.seconds_compute == pytest.approx(536_870_912 / 1.97e14)  # 2.7 us
    assert r.bound == "memory" and r.seconds == r.seconds_memory
    # float32 dots: six bf16 passes (an estimate); an e4m3 cache halves the K/V bytes.
    f32 = tpu_compile.KernelConfig("ragged", "float32", "bfloat16", 128, 16, 4)
    prefill = tpu_compile.roofline(f32, v5e, num_seqs=8, seq_len=2048, q_len=2048)
    assert prefill.seconds_compute == pytest.approx(prefill.flops * 6 / 1.97e14)
    assert prefill.bound == "compute"
    e4m3 = tpu_compile.KernelConfig("decode", "bfloat16", "float8_e4m3fn", 128, 16, 4)
    half = tpu_compile.roofline(e4m3, v5e, num_seqs=32, seq_len=1024, q_len=1)
    assert half.bytes == kv // 2 + q_out


def test_roofline_table_lists_every_chip_and_workload():
    table = tpu_compile.roofline_table()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + len(tpu_compile.WORKLOADS) * 2 * len(tpu_compile.TARGETS)
    assert "| decode 32 x 1024 | bfloat16 | v5e | 820 | 197 | 134.7 | 0.54 | 164.3 | memory |" in (
        table
    )


def test_environment_names_what_libtpu_needs():
    env = tpu_compile.tpu_environment()
    assert env["JAX_PLATFORMS"] == "cpu"
    assert env["TPU_SKIP_MDS_QUERY"] == "1"
    assert env["ALLOW_MULTIPLE_LIBTPU_LOAD"] == "1"


def peer_problems(config, peer) -> list[str]:
    """Why `peer`, JAX's kernel compiled for `config`'s problem, is not a fair comparison: a
    feature JAX's kernel lacks not refused (JAX would compile a different problem), or a plain
    problem that never reached JAX's kernel, or a compile without its grid and time. JAX's own
    refusals of a problem it has every feature for (Mosaic, VMEM) are its verdict, shown."""
    lacks = tpu_compile.jax_peer_lacks(config)
    if lacks is not None:
        wanted = f"NotImplementedError: {lacks}"
        return [] if peer.error == wanted else [f"{wanted} expected, got {peer.error!r}"]
    name = "jax:paged_attention" if config.kernel == "decode" else "jax:ragged_paged_attention"
    problems = [] if peer.kernel == name else [f"the peer is {peer.kernel!r}, not {name!r}"]
    if peer.ok and not (peer.grid and peer.seconds > 0):
        problems.append(f"compiled without a grid or a time: {peer.grid}, {peer.seconds} s")
    return problems


def test_peer_problems_can_fail():
    """The check on JAX's peer tells a fair comparison from one that is not (no TPU needed)."""
    plain = tpu_compile.KernelConfig("ragged", "bfloat16", "bfloat16", 128, 32, 4)
    alibi = tpu_compile.KernelConfig("ragged", "bfloat16", "bfloat16", 128, 32, 4, alibi=True)
    window = tpu_compile.KernelConfig("decode", "bfloat16", "bfloat16", 128, 32, 4,
                                      sliding_window=100)  # fmt: skip
    compiled = tpu_compile.CompileReport(
        plain, "v5e", kernel="jax:ragged_paged_attention", grid=(1, 2), seconds=3.0
    )
    refused = tpu_compile.CompileReport(
        plain, "v5e", kernel="jax:ragged_paged_attention", error="MosaicError: VMEM"
    )
    no_alibi = "NotImplementedError: JAX's TPU paged kernels have no ALiBi"
    lacks = tpu_compile.CompileReport(alibi, "v5e", kernel="jax", error=no_alibi)
    assert peer_problems(plain, compiled) == peer_problems(plain, refused) == []
    assert peer_problems(alibi, lacks) == []
    # JAX's kernel compiled without the ALiBi asked for: a different problem
    assert peer_problems(alibi, compiled) == [f"{no_alibi} expected, got None"]
    assert "no sliding window expected, got None" in peer_problems(window, compiled)[0]
    assert peer_problems(plain, lacks) == ["the peer is 'jax', not 'jax:ragged_paged_attention'"]
    no_grid = tpu_compile.CompileReport(plain, "v5e", kernel="jax:ragged_paged_attention")
    assert peer_problems(plain, no_grid) == ["compiled without a grid or a time: (), 0.0 s"]


# ---- compiled for a described TPU (the tpu-aot environment) ----

GRID = [
    pytest.param(target, config, id=f"{target}-{config.id}")
    for target in tpu_compile.TARGETS
    for config in tpu_compile.default_grid()
]


@pytest.mark.tpu_aot
@needs_aot
@pytest.mark.parametrize(("target", "config"), GRID)
def test_kernel_compiles_within_the_chip(target, config):
    """Ours must compile within the chip's VMEM; JAX's kernel for the same problem is compiled
    beside it and shown: it must refuse exactly the features it lacks, and reach JAX's kernel
    otherwise (JAX's refusals there are JAX's verdict, not failures here: `peer_problems`)."""
    chip = tpu_compile.TARGETS[target]
    ours = tpu_compile.compile_kernel(config, chip)
    peer = tpu_compile.compile_jax_peer(config, chip)
    table = tpu_compile.format_table([ours, peer])
    print(table)
    assert ours.problems() == [], table
    assert ours.grid and ours.vmem_limit is not None
    assert ours.vmem_plan <= ours.vmem_limit <= chip.vmem_capacity
    assert peer_problems(config, peer) == [], table


@pytest.mark.tpu_aot
@needs_aot
@pytest.mark.parametrize("kernel", ["decode", "ragged"])
@pytest.mark.parametrize("target", list(tpu_compile.TARGETS))
def test_jax_peer_compiles_the_plain_case(target, kernel):
    """JAX's own kernels compile the plain problem (bf16, D=128, page 32, G=4) on every chip,
    so a refusal elsewhere in the grid is JAX's verdict, not a broken comparison."""
    config = tpu_compile.KernelConfig(kernel, "bfloat16", "bfloat16", 128, 32, 4)
    chip = tpu_compile.TARGETS[target]
    reports = [tpu_compile.compile_kernel(config, chip), tpu_compile.compile_jax_peer(config, chip)]
    table = tpu_compile.format_table(reports)
    assert all(r.problems() == [] for r in reports), table
    assert reports[1].kernel.startswith("jax:") and reports[1].grid, table


@pytest.mark.tpu_aot
@needs_aot
# Two chips of different capacities (128 and 64 MiB): a refused compile takes about a minute.
@pytest.mark.parametrize("target", ["v5e", "v5p"])
def test_oversized_plan_fails_with_the_chips_vmem(target):
    """9 pages of [128, 32, 256] float32 per step: 4 slots of 36 MiB, over any chip's VMEM
    (32 kv heads keep the step's keys, and the compile, small). The compile itself must refuse
    it, naming the chip's capacity: the compile is real."""
    config = tpu_compile.KernelConfig(
        "decode", "float32", "float32", 256, 128, 1, num_kv_heads=32, pages_per_step=9
    )
    chip = tpu_compile.TARGETS[target]
    report = tpu_compile.compile_kernel(config, chip)
    assert report.error is not None, tpu_compile.format_table([report])
    capacity = chip.vmem_capacity
    assert "vmem" in report.error and "RESOURCE_EXHAUSTED" in report.error, report.error
    # XLA:TPU words it "Used 152.94M of 127.94M vmem" (v6e keeps a little back) or "would
    # exceed memory (size=67108864)".
    used_of = re.search(r"of ([\d.]+)M vmem", report.error)
    if used_of is not None:
        assert capacity / MiB - 1 <= float(used_of[1]) <= capacity / MiB, report.error
    else:
        assert f"size={capacity})" in report.error, report.error


@pytest.mark.tpu_aot
@needs_aot
def test_auto_picks_the_tpu_kernels_and_falls_back_for_what_they_refuse():
    """On a described v5e, `impl="auto"` resolves to the Pallas TPU kernels, and the entries'
    compiled step holds Mosaic's custom call; a float16 query (no load for it on these chips)
    takes the XLA path under "auto" and is refused, naming the rule, under "pallas"."""
    import jax
    import jax.numpy as jnp

    import jax_attn
    from jax_attn import paged

    device = tpu_compile.compile_device("v5e")
    query, cache, f16, tables, lens = tpu_compile._structs(
        device,
        ((32, 8, 128), jnp.bfloat16),
        ((64, 16, 2, 128), jnp.bfloat16),
        ((32, 8, 128), jnp.float16),
        ((32, 8), jnp.int32),
        ((32,), jnp.int32),
    )
    assert paged.resolve_impl("auto", query, cache) == "pallas"
    assert paged.resolve_impl("auto", f16, cache) == "xla"
    with jax.default_device(device):
        step = jax.jit(lambda q, k, v, t, s: jax_attn.paged_decode(q, k, v, t, s))
        assert "tpu_custom_call" in step.lower(query, cache, cache, tables, lens).as_text()
        with pytest.raises(ValueError, match="query dtype float16 must be bfloat16 or float32"):
            jax_attn.paged_decode(f16, cache, cache, tables, lens, impl="pallas", check=False)


@pytest.mark.tpu_aot
@needs_aot
@pytest.mark.parametrize("kind", ["ragged", "decode"])
def test_sharded_over_a_2x2_v5e_with_tp4(kind):
    """`PagedSharding` runs the TPU kernels per shard under `shard_map` on a 2x2 v5e mesh
    (tp=4, Hq 32 / Hkv 8: two kv heads per chip), and the step compiles with no collective."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    from jax_attn.metadata import RaggedMetadata
    from jax_attn.sharding import PagedSharding

    topology = tpu_compile.topology("v5e")
    mesh = Mesh(np.array(topology.devices).reshape(4), ("tp",))
    layout = PagedSharding(mesh, num_heads=32, num_kv_heads=8)

    def struct(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    tokens, seqs, blocks = 64, 8, 16
    cache = struct(layout.kv_cache_shape(128, 16, 128), jnp.bfloat16, layout.cache_spec)
    with jax.default_device(topology.devices[0]):
        if kind == "ragged":
            spec = layout.metadata_spec
            md = RaggedMetadata(
                query_start_loc=struct((seqs + 1,), jnp.int32, spec.query_start_loc),
                seq_lens=struct((seqs,), jnp.int32, spec.seq_lens),
                block_tables=struct((seqs, blocks), jnp.int32, spec.block_tables),
                slot_mapping=struct((tokens,), jnp.int32, spec.slot_mapping),
                num_seqs=struct((), jnp.int32, spec.num_seqs),
            )
            query = struct((tokens, 32, 128), jnp.bfloat16, layout.heads_spec)
            step = jax.jit(lambda q, k, v, m: layout.paged_attention(q, k, v, m, impl="pallas"))
            lowered = step.lower(query, cache, cache, md)
        else:
            query = struct((seqs, 32, 128), jnp.bfloat16, layout.heads_spec)
            tables = struct((seqs, blocks), jnp.int32, layout.batch_spec)
            lens = struct((seqs,), jnp.int32, layout.batch_spec)
            step = jax.jit(lambda q, k, v, t, s: layout.paged_decode(q, k, v, t, s, impl="pallas"))
            lowered = step.lower(query, cache, cache, tables, lens)
        assert "tpu_custom_call" in lowered.as_text()
        text = lowered.compile().as_text()
    assert not re.search(r"all-reduce|all-gather|all-to-all|collective-permute", text)

"""Sharded paged attention on 8 simulated CPU devices (issue 11, items 1-3).

The device count is fixed when JAX starts, so the cases run in one subprocess
(`sharded_cases.py`, `--xla_force_host_platform_device_count=8`); this process keeps one
device. Each case compares the mesh's output with the single-device path of the same `impl`
(the one tolerance rule against a peer, `bound_ratio(..., peer=True)`; NaN in unused cache
memory) and asserts on the compiled HLO: no collective at all under `shard_map`; under plain
`jit` (GSPMD) none that moves floating-point data. Two cases shard the cache the wrong way
(over blocks) and must fail.
`JAX_ATTN_SHARDING_FULL=1` runs the whole grid (every tp/GQA/impl pairing).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from sharded_cases import cases  # noqa: E402  (sets no flags when imported)

DEFAULT = [
    "tp2-hq8-hkv8-xla",  # GQA 1
    "tp4-hq8-hkv2-xla",  # GQA 4, kv heads replicated twice
    "tp8-hq8-hkv1-reference",  # GQA 8 (MQA), one kv head on all 8 devices
    "tp4-hq16-hkv4-reference",
    "dp2xtp4-hq8-hkv4-xla",
    "dp2xtp4-hq8-hkv1-xla-decode",
    "tp4-hq8-hkv4-xla-fp8",
    "dp2xtp4-hq8-hkv2-xla-fp8-decode",
    "tp2-hq8-hkv2-pallas",
    "tp4-hq8-hkv4-pallas-decode",
    "tp4-hq8-hkv2-pallas-tpu",
    "tp2-hq8-hkv2-pallas-tpu-decode-fp8",
    "tp4-hq8-hkv4-cpu",
    "tp4-hq8-hkv4-cpu-decode",
    "dp2xtp4-hq8-hkv2-cpu",
    "tp8-hq8-hkv1-cpu-decode-fp8",
    "tp4-hq8-hkv2-xla-sinks",
    "dp2xtp4-hq8-hkv2-cpu-decode-sinks",
    "gspmd-tp4-hq8-hkv4",
    "gspmd-tp8-hq8-hkv8",
    "refuse-pallas-on-sharded-arrays",
]
WRONG = ["wrong-tp4-cache-over-blocks", "gspmd-wrong-tp4-cache-over-blocks"]
FULL = os.environ.get("JAX_ATTN_SHARDING_FULL") == "1"
RUN = [c for c in cases() if c not in WRONG] if FULL else DEFAULT
# One worker runs the module: its `results` subprocess (every case, ~1 min) then runs once.
pytestmark = pytest.mark.xdist_group("sharding")


@pytest.fixture(scope="module")
def results(mesh_seed) -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, str(HERE / "sharded_cases.py"), str(mesh_seed), *RUN, *WRONG],
        capture_output=True,
        text=True,
        timeout=1500,
        env=env,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    got = {r["case"]: r for r in lines}
    if proc.returncode or len(got) != len(RUN) + len(WRONG):
        pytest.fail(f"sharded_cases.py exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return got


@pytest.fixture(scope="module")
def mesh_seed(run_seed) -> int:  # one subprocess for the module: the run's seed
    return run_seed


@pytest.mark.parametrize("case", RUN)
def test_sharded_matches_single_device(results, case):
    r = results[case]
    if "skipped" in r:
        pytest.skip(r["skipped"])
    assert "error" not in r, f"{r['error']}\n{r.get('traceback', '')}"
    if "message" in r:  # the refusal: names the impl and points at the shard_map API
        assert "impl='pallas'" in r["message"] and "PagedSharding" in r["message"], r["message"]
        return
    if "float_collectives" in r:  # plain jit: XLA's partitioner must not move float data
        assert not any(r["float_collectives"].values()), r["float_collectives"]
    else:  # shard_map: nothing at all crosses devices
        assert r["collectives"] == [], r["collectives"]
        assert r["finite"]
    assert r["bound_ratio"] <= 1, f"max error {r['err']}, {r['bound_ratio']:.3g}x the bound"


def test_cache_sharded_over_blocks_fails(results):
    """Splitting the cache over blocks instead of kv heads must be caught: under shard_map
    each device attends a quarter of the blocks with the wrong kv heads (the output differs
    from one device's); under plain jit XLA keeps the answer right by all-reducing the
    gathered K/V every step, which the HLO check catches."""
    mapped = results["wrong-tp4-cache-over-blocks"]
    assert "error" not in mapped, mapped.get("traceback")
    assert not mapped["ok"]
    assert mapped["bound_ratio"] > 1, mapped  # (inf where not finite)
    gspmd = results["gspmd-wrong-tp4-cache-over-blocks"]
    assert not gspmd["ok"]
    moved = [op for ops in gspmd["float_collectives"].values() for op, _ in ops]
    assert moved, gspmd


def test_collective_regex_sees_a_real_all_reduce():
    from sharded_cases import collectives, float_collectives

    hlo = (
        "  %all-reduce.16 = (f32[3,4,16,32]{3,2,1,0}, f32[3,4,16,32]{3,2,1,0}) all-reduce(%a, %b)\n"
        "  %all-gather.12 = s32[3,4,16,2]{3,2,0,1} all-gather(%c), dimensions={1}\n"
    )
    assert [op for op, _ in collectives(hlo)] == ["all-reduce", "all-gather"]
    assert [op for op, _ in float_collectives(hlo)] == ["all-reduce"]

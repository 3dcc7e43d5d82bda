"""benchmarks.paired: two warm workers, one per side, alternate slices of calls and the result
pairs their slice medians. Speed is never asserted: only that both sides ran, the pairing, the
record, and that each side gets its own environment."""

import json
import statistics
from pathlib import Path

import pytest

pytest.importorskip("jax")

from benchmarks import backends, paired

ROOT = str(Path(__file__).resolve().parents[2])


@pytest.fixture(autouse=True)
def _jax_cpu_runs():
    why = backends._cpu_available()
    if why is not None:
        pytest.skip(f"jax-cpu: {why}")


def test_both_sides_run_and_their_slices_are_paired(tmp_path):
    out = tmp_path / "paired.json"
    args = ["decode-f32-bs16", ROOT, "--quick", "--seconds", "0.3", "--slice", "0.01"]
    result = paired.compare(
        paired.parse([*args, "--env-b", "JAX_ATTN_PAIRED_B=1", "--json", str(out)])
    )
    a, b = result["slice_medians_s"]
    assert result["slices"] >= 4 and len(a) == len(b) == result["slices"]
    assert min(a + b) > 0
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    assert result["a_over_b"] == pytest.approx(statistics.median(ratios))
    assert result["quartiles"][0] <= result["a_over_b"] <= result["quartiles"][1]
    assert result["a"]["median_ms"] == pytest.approx(1e3 * statistics.median(a))
    assert result["b"]["env"] == ["JAX_ATTN_PAIRED_B=1"] and result["a"]["env"] == []
    assert result["workload_b"] == result["workload"] == "decode-f32-bs16"
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))


def test_pairs_of_fresh_workers_take_turns_starting_first():
    """--pairs 3: three pairs of workers, B's started first in the second; every pair's slices
    are pooled into the result and each pair's own median is kept."""
    args = ["decode-f32-bs16", ROOT, "--quick", "--seconds", "0.3", "--slice", "0.01"]
    result = paired.compare(paired.parse([*args, "--pairs", "3"]))
    pairs = result["pairs"]
    assert [p["b_started_first"] for p in pairs] == [False, True, False]
    assert all(p["slices"] >= 4 for p in pairs)
    assert sum(p["slices"] for p in pairs) == result["slices"]
    a, b = result["slice_medians_s"]
    start = 0
    for p in pairs:  # each pair's median is over its own run of pooled slices
        ratios = [x / y for x, y in zip(a[start : start + p["slices"]], b[start:], strict=False)]
        assert p["a_over_b"] == pytest.approx(statistics.median(ratios))
        start += p["slices"]
    with pytest.raises(SystemExit):
        paired.parse([*args, "--pairs", "0"])


def test_side_b_runs_its_own_workload():
    """--workload-b: B prepares and times another workload of the suite (a name the suite
    lacks stops B's worker, so B really looks it up)."""
    args = ["decode-f32-bs16", ROOT, "--quick", "--seconds", "0.2", "--slice", "0.01"]
    result = paired.compare(paired.parse([*args, "--workload-b", "decode-bf16-bs16"]))
    assert (result["workload"], result["workload_b"]) == ("decode-f32-bs16", "decode-bf16-bs16")
    assert result["slices"] >= 4 and min(result["slice_medians_s"][1]) > 0
    with pytest.raises(SystemExit, match="did not start"):
        paired.compare(paired.parse([*args, "--workload-b", "no-such-workload"]))


def test_side_b_runs_its_own_peer(capfd):
    """--peer-b: B times another peer (one that is not a peer stops B's worker by name)."""
    args = ["decode-f32-bs16", ROOT, "--quick", "--seconds", "0.2", "--slice", "0.01"]
    result = paired.compare(paired.parse([*args, "--peer-b", backends.BASELINE]))
    assert (result["peer"], result["peer_b"]) == ("jax-cpu", backends.BASELINE)
    assert result["slices"] >= 4 and min(result["slice_medians_s"][1]) > 0
    with pytest.raises(SystemExit, match="did not start"):
        paired.compare(paired.parse([*args, "--peer-b", "no-such-peer"]))
    assert "peer 'no-such-peer' is not one of" in capfd.readouterr().err


def test_each_side_gets_its_own_environment(capfd):
    """Side A starts; side B, with the native kernels switched off, does not, and says why."""
    off = ["--env-b", "JAX_ATTN_CPU_DISABLE=1"]
    args = paired.parse(["decode-f32-bs16", ROOT, "--quick", "--seconds", "0.1", *off])
    with pytest.raises(SystemExit, match=f"the worker for {ROOT} did not start"):
        paired.compare(args)
    err = capfd.readouterr().err
    assert "jax-cpu does not run here" in err and "JAX_ATTN_CPU_DISABLE=1" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["decode-f32-bs16", ROOT, "--env-a", "NOVALUE"], "take NAME=VALUE, not 'NOVALUE'"),
        (["decode-f32-bs16", "/nonexistent-tree"], "is not a jax-attn tree"),
        (["no-such-workload", ROOT, "--quick"], "did not start"),
    ],
)
def test_bad_arguments_are_refused_by_name(argv, message):
    with pytest.raises(SystemExit, match=message):
        paired.compare(paired.parse(argv))

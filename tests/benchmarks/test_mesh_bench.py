"""`jax-attn bench --mesh tp=2 --quick`: the strong-scaling record on simulated CPU devices.
Speed is never asserted; the step must hold no collective and agree with tp = 1."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("jax")

from benchmarks.mesh import parse_mesh


def test_mesh_bench_quick_on_simulated_devices(tmp_path):
    path = tmp_path / "mesh.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.mesh", "--mesh", "tp=2", "--quick", "--reps", "2",
         "--json", str(path)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(path.read_text())
    assert record["simulated"] and "CPU simulation" in record["label"]
    assert "not speed-up" in proc.stdout
    assert [m["tp"] for m in record["meshes"]] == [1, 2]
    for m in record["meshes"]:
        assert m["collectives"] == [] and m["agrees"], m
        assert m["median_s"] > 0 and m["kv_heads_per_device"] * m["tp"] == 8


@pytest.mark.parametrize("text", ["dp=2", "tp=0", "tp=2,tp=4", "pp=2", "tp=x"])
def test_mesh_argument_errors(text):
    with pytest.raises(ValueError, match="--mesh="):
        parse_mesh(text)


def test_mesh_argument():
    assert parse_mesh("tp=4") == {"tp": 4, "dp": 1}
    assert parse_mesh("tp=4,dp=2") == {"tp": 4, "dp": 2}

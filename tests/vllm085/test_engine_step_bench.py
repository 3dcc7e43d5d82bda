"""`python -m benchmarks.engine_step --quick` (vLLM 0.8.5's engine, every backend, each OpenMP
setting in its own process): the record is complete and every backend produced vLLM's own
tokens, so the benchmark cannot rot. Speed is never asserted."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import engine_step

pytestmark = pytest.mark.vllm085

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    out = tmp_path_factory.mktemp("engine_step") / "engine_step.json"
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    }
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine_step", "--quick", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "vLLM TORCH_SDPA" in proc.stdout  # the table was printed
    return json.loads(out.read_text())


def test_every_setting_and_backend_ran_in_its_own_process(record):
    assert record["quick"] is True
    assert list(record["settings"]) == list(engine_step.QUICK_SETTINGS)
    pairs = {(r["setting"], r["backend"]) for r in record["runs"]}
    assert pairs == {(s, b) for s in engine_step.QUICK_SETTINGS for b in engine_step.BACKENDS}
    assert len(record["runs"]) == len(pairs)
    for run in record["runs"]:
        # the process saw exactly its setting's variables, none of the others'
        assert run["env"] == engine_step.SETTINGS[run["setting"]], run["setting"]
        assert "libgomp" in run["omp_runtime"] or run["torch_threads"] == 1


def test_every_decode_step_timed(record):
    # the first token of each generation comes from the prefill step
    steps = (record["size"]["max_tokens"] - 1) * record["repeats"]
    prompts = len(record["size"]["prompt_lengths"])
    for run in record["runs"]:
        what = (run["setting"], run["backend"])
        assert len(run["decode_step_s"]) == steps, what
        assert all(0 < t < 60 for t in run["decode_step_s"]), what
        assert len(run["tokens"]) == prompts, what
        assert all(len(t) == record["size"]["max_tokens"] for t in run["tokens"]), what
    for setting, rows in record["table"].items():
        assert set(rows) == set(engine_step.BACKENDS), setting
        for row in rows.values():
            assert math.isfinite(row["x_vllm"]) and row["median_s"] > 0
        assert rows[engine_step.BASELINE]["x_vllm"] == 1.0


def test_tokens_equal_across_backends_and_settings(record):
    assert record["mismatches"] == []
    want = next(r["tokens"] for r in record["runs"] if r["backend"] == engine_step.BASELINE)
    for run in record["runs"]:
        assert run["tokens"] == want, (run["setting"], run["backend"])
        assert not run.get("tokens_changed"), (run["setting"], run["backend"])

"""scripts/test.sh itself, with its environments and runs stubbed: its exit status is 0 exactly
when every stage passed, and every stage runs (the later ones two at a time, from one queue)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STAGE_ENVS = ["main", "vllm085", "gpu-aot", "ipex", "vllm", "tpu-aot"]

# Stubs: env.sh logs the environment asked for; run.sh logs the stage's environment and fails
# where $FAIL_ENV names it.
ENV_STUB = 'echo "env $1" >> "$STUB_LOG"; echo /nonexistent/venv\n'
RUN_STUB = (
    'echo "run ${JAX_ATTN_ENV:-main}" >> "$STUB_LOG"\n'
    'if [ "${JAX_ATTN_ENV:-main}" = "${SLOW_ENV:-}" ]; then sleep 3; fi\n'
    'echo "done ${JAX_ATTN_ENV:-main}" >> "$STUB_LOG"\n'
    'if [ "${JAX_ATTN_ENV:-main}" = "${FAIL_ENV:-}" ]; then exit 1; fi\n'
)


def _run(
    tmp_path, fail_env: str = "", slow_env: str = ""
) -> tuple[subprocess.CompletedProcess, list[str]]:
    scripts = tmp_path / "repo" / "scripts"
    scripts.mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "test.sh", scripts / "test.sh")
    (scripts / "env.sh").write_text(ENV_STUB)
    (scripts / "run.sh").write_text(RUN_STUB)
    log = tmp_path / "stub.log"
    env = {**os.environ, "STUB_LOG": str(log), "FAIL_ENV": fail_env, "SLOW_ENV": slow_env}
    proc = subprocess.run(["bash", str(scripts / "test.sh")], capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip
    return proc, log.read_text().split("\n")


def test_every_stage_runs_and_the_suite_exits_zero(tmp_path):
    proc, log = _run(tmp_path)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    runs = [line.split()[1] for line in log if line.startswith("run ")]
    assert sorted(runs) == sorted(STAGE_ENVS)
    assert runs[0] == "main"  # the main stage first, the others after it
    assert {line.split()[1] for line in log if line.startswith("env ")} >= set(STAGE_ENVS) - {
        "main"
    }  # every other environment built (in the background) from the start
    assert "-- all stages:" in proc.stdout


@pytest.mark.parametrize("fail_env", STAGE_ENVS)
def test_a_failed_stage_fails_the_suite(tmp_path, fail_env):
    proc, log = _run(tmp_path, fail_env)
    assert proc.returncode != 0, proc.stdout[-2000:]
    runs = [line.split()[1] for line in log if line.startswith("run ")]
    assert fail_env in runs
    if fail_env == "main":
        assert runs == ["main"]  # nothing runs after a failed main stage


def test_a_free_lane_takes_the_next_stage(tmp_path):
    """While the first stage after main runs long, the other lane runs every other stage: the
    stages wait in one queue, not in two fixed lanes."""
    proc, log = _run(tmp_path, slow_env="vllm085")
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    events = [line for line in log if line.startswith(("run ", "done "))]
    assert events[-1] == "done vllm085", events
    assert sorted(e.split()[1] for e in events if e.startswith("done ")) == sorted(STAGE_ENVS)

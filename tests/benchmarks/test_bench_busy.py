"""`jax-attn bench --busy`: the spinners it starts run only while a busy call is timed, each
peer's row gets its loaded times beside the quiet ones, and the shared-core targets are judged
only on a run that had them. Speed is never asserted."""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("jax")
pytest.importorskip("rich")

from benchmarks import run
from benchmarks.busy import Spinners, fair_share


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]  # R running, S sleeping, T stopped


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux's /proc")
def test_spinners_spin_only_inside_running_and_end_with_close():
    with Spinners(2) as busy:
        pids = [p.pid for p in busy._procs]
        assert [_state(pid) for pid in pids] == ["T", "T"]
        before = [_cpu_ticks(pid) for pid in pids]
        time.sleep(0.3)
        assert [_cpu_ticks(pid) for pid in pids] == before  # stopped: no CPU time
        with busy.running():
            time.sleep(0.5)
            assert all(_state(pid) in "RS" for pid in pids)
        assert [_state(pid) for pid in pids] == ["T", "T"]
        assert all(_cpu_ticks(p) > b for p, b in zip(pids, before, strict=True))
    assert not any(os.path.exists(f"/proc/{pid}") and _state(pid) != "Z" for pid in pids)


_KILLED_WHILE_SPINNING = """
import os, signal, sys
from benchmarks.busy import Spinners
busy = Spinners(1)
print(busy._procs[0].pid, flush=True)
with busy.running():
    os.kill(os.getpid(), signal.SIGKILL)  # as a bench killed mid-call: no finally, no close
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_spinner_ends_with_a_bench_killed_while_it_spins():
    bench = subprocess.run(
        [sys.executable, "-c", _KILLED_WHILE_SPINNING], capture_output=True, text=True,
        timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )  # fmt: skip
    assert bench.returncode == -signal.SIGKILL, bench.stderr
    pid = int(bench.stdout.split()[0])
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and _state(pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}") or _state(pid) == "Z", "the spinner outlived it"


def test_spinners_refuse_a_count_below_one():
    with pytest.raises(ValueError, match="--busy needs at least 1 process"):
        Spinners(0)


def test_fair_share_is_the_cores_over_the_cores_left():
    assert fair_share(2, 1) == 1.5 and fair_share(4, 4) == 2.0 and fair_share(8, 2) == 1.25


def test_busy_run_records_loaded_times_beside_quiet_ones(tmp_path):
    path = tmp_path / "bench.json"
    args = argparse.Namespace(
        quick=True, workloads="decode-f32-bs128", reps=2, json=str(path), busy=1
    )
    assert run.main(args) == 0
    record = json.loads(path.read_text())
    cores = len(os.sched_getaffinity(0))
    assert record["busy"] == dict(processes=1, cores=cores, fair_share=fair_share(cores, 1))
    rows = record["workloads"]["decode-f32-bs128"]["backends"]
    timed = [row for row in rows.values() if row["status"] == "ok"]
    assert len(timed) >= 2
    for row in timed:
        loaded = row["busy"]
        assert loaded["processes"] == 1
        assert len(loaded["times_s"]) == loaded["reps"] == run.BUSY_CALLS * row["reps"]
        assert min(loaded["times_s"]) > 0
        assert loaded["ratio"] == pytest.approx(loaded["median_s"] / row["median_s"])


def _rows(quiet_s: float, busy_s: float, vllm_busy_s: float | None = None) -> dict:
    def row(q, b):
        return dict(status="ok", median_s=q, busy=dict(median_s=b, ratio=b / q))

    results = {w: {"backends": {run.CPU: row(quiet_s, busy_s)}} for w in run.SHARED_CORE_WORKLOADS}
    if vllm_busy_s is not None:
        results["decode-f32-bs128"]["backends"][run.VLLM] = row(quiet_s, vllm_busy_s)
    return results


def _shared(targets: list[dict]) -> dict:
    return {t["target"]: t for t in targets if "beside busy processes" in t["target"]}


def test_shared_core_targets_judge_the_ratio_against_the_fair_share():
    busy = dict(processes=1, cores=2, fair_share=1.5)
    within = _shared(run.check_targets(_rows(0.010, 0.014, vllm_busy_s=0.016), busy=busy))
    assert len(within) == len(run.SHARED_CORE_WORKLOADS) + 1
    assert all(t["met"] is True for t in within.values()), within
    over = _shared(run.check_targets(_rows(0.010, 0.020, vllm_busy_s=0.016), busy=busy))
    assert all(t["met"] is False for t in over.values()), over  # 2.0x, and behind vLLM


def test_shared_core_targets_are_not_expected_from_a_quiet_run():
    results = {w: {"backends": {run.CPU: dict(status="ok", median_s=0.01)}}
               for w in run.SHARED_CORE_WORKLOADS}  # fmt: skip
    targets = run.judge_targets(run.check_targets(results), results, {})
    shared = _shared(targets)
    assert shared and {t["verdict"] for t in shared.values()} == {"not measured"}

"""The worker protocol of the `vllm085-TORCH_SDPA` peer (`benchmarks/vllm085.py`), against
stand-in children (plain Python: no vLLM needed): a child that crashes or hangs is reported
with the end of its stderr within the timeout, never waited on forever; a peer that fails
mid-rounds is reported as an error while the other peers are still timed; the interpreter is
found only where it exists."""

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from benchmarks import run, vllm085
from benchmarks.backends import Peer, Prepared
from benchmarks.workloads import named_workloads

ROOT = Path(__file__).resolve().parents[2]
HELLO = '{"ok": true, "hello": {"pid": 0}}'


def child(body: str) -> list[str]:
    """argv of a stand-in worker: says hello, then runs `body`."""
    script = f"import sys, time\nprint({HELLO!r}, flush=True)\n" + textwrap.dedent(body)
    return [sys.executable, "-c", script]


def test_a_reply_comes_back():
    worker = vllm085.Worker(child('sys.stdin.readline(); print(\'{"ok": true, "s": 0.5}\')'))
    assert worker.request(5.0, op="call") == {"ok": True, "s": 0.5}
    worker.close()
    assert worker.process.returncode is not None


def test_a_crash_is_reported_with_its_stderr():
    worker = vllm085.Worker(
        child("""
        sys.stdin.readline()
        sys.stderr.write("Fatal Python error: Segmentation fault in paged_attention_v1\\n")
        sys.exit(139)
        """)
    )
    start = time.monotonic()
    with pytest.raises(
        vllm085.WorkerCrashed,
        match=r"exited while answering 'call' \(exit "
        r"status 139\); its stderr ends: .*Segmentation fault in paged_attention",
    ):
        worker.request(30.0, op="call")
    assert time.monotonic() - start < 10


def test_a_hang_times_out_and_the_child_is_killed():
    worker = vllm085.Worker(child("sys.stderr.write('stuck\\n'); sys.stderr.flush(); "
                                  "time.sleep(600)"))  # fmt: skip
    start = time.monotonic()
    with pytest.raises(vllm085.WorkerCrashed, match=r"no reply within 0.5 s while answering "
                       r"'call'.*stderr ends: stuck"):  # fmt: skip
        worker.request(0.5, op="call")
    assert time.monotonic() - start < 10
    assert worker.process.returncode is not None  # killed and reaped


def test_a_child_that_cannot_start_names_why():
    argv = [sys.executable, "-c", "import sys; sys.exit('No module named vllm')"]
    with pytest.raises(vllm085.WorkerCrashed, match=r"exited while starting.*No module named vllm"):
        vllm085.Worker(argv)
    refuse = [sys.executable, "-c", 'print(\'{"ok": false, "error": "vLLM does not import"}\')']
    with pytest.raises(vllm085.WorkerCrashed, match="did not start: vLLM does not import"):
        vllm085.Worker(refuse)


def test_a_peer_crashing_mid_rounds_is_an_error_and_the_others_are_timed(progress):
    calls = []

    def crashing() -> float:
        calls.append(1)
        if len(calls) > 4:  # warm-up and a couple of rounds, then the child dies
            raise vllm085.WorkerCrashed("the vllm085 worker exited (exit status 139)")
        return 0.001

    spec = named_workloads(quick=True)["decode-f32-bs16"]
    shape = (spec.num_tokens, spec.num_heads * spec.head_size)

    def peer(name, timed=None):
        prepared = Prepared(call=lambda: None, output=lambda _: np.zeros(shape, np.float32),
                            timed=timed)  # fmt: skip
        return Peer(name, lambda: None, lambda data: prepared)

    copier = run.Copier(1 << 20, 1)
    result = run.run_workload(
        spec, [peer("steady"), peer("crashing", crashing)], copier, reps=5, budget_s=None,
        rng=np.random.default_rng(0), progress=progress, settle_s=0.0,
    )  # fmt: skip
    rows = result["backends"]
    assert rows["crashing"]["status"] == "error"
    assert "WorkerCrashed" in rows["crashing"]["note"] and "139" in rows["crashing"]["note"]
    assert rows["steady"]["status"] == "ok" and rows["steady"]["reps"] == 5


def test_the_interpreter_given_comes_first(monkeypatch, tmp_path):
    monkeypatch.setenv(vllm085.ENV_VAR, sys.executable)
    assert vllm085.find_python() == (sys.executable, vllm085.ENV_VAR)
    missing = str(tmp_path / "python")
    vllm085.use_python(missing)
    try:
        python, why = vllm085.find_python()
        assert python is None and why == f"--vllm085-python={missing} is not an executable"
    finally:
        vllm085.use_python(None)


def test_a_missing_environment_is_named_and_never_built(monkeypatch, tmp_path):
    monkeypatch.delenv(vllm085.ENV_VAR, raising=False)
    monkeypatch.setenv("JAX_ATTN_ENV_DIR", str(tmp_path))
    python, why = vllm085.find_python()
    assert python is None
    assert re.search(r"no --vllm085-python or \$JAX_ATTN_VLLM085_PYTHON, and the 'vllm085' "
                     r"environment is not built .*\.ready is missing", why)  # fmt: skip
    assert list(tmp_path.iterdir()) == []  # nothing built, nothing locked
    vllm085.close()
    assert vllm085.why_unavailable() == f"not available: {why}"
    vllm085.close()


def test_env_path_names_the_environment_this_test_runs_in():
    """scripts/env_path.sh computes the key scripts/env.sh computes (the two must agree)."""
    prefix = Path(sys.prefix)
    match = re.fullmatch(r"(main|ipex|gpu-aot|tpu-aot|vllm085|vllm)-[0-9a-f]{12}", prefix.name)
    if not match:
        pytest.skip(f"not run in an environment of scripts/env.sh ({prefix})")
    found = subprocess.run(
        ["bash", str(ROOT / "scripts" / "env_path.sh"), match[1]],
        capture_output=True, text=True, env=dict(os.environ),
    )  # fmt: skip
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()).resolve() == prefix.resolve()

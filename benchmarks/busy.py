"""Busy processes for `jax-attn bench --busy N`: a kernel timed beside other work on its cores.

Serving shares cores: the engine's Python, tokenizers, other processes. `--busy N` starts N
processes that spin in pure Python (no memory traffic, no syscalls: all they take is CPU time)
and keeps them stopped (SIGSTOP) except while a peer's busy call is timed, so each round times
every peer quiet and then beside the spinners, side by side. With N spinners beside a kernel
that uses every one of C cores, a fair share of the cores is C / (C + N) of them: the kernel's
time grows by (C + N) / C (1.5x for one spinner on 2 cores).
"""

import contextlib
import os
import signal
import subprocess
import sys
import time

# The spinner: ends with the bench (Linux's PR_SET_PDEATHSIG: SIGKILL when its parent dies), so
# a bench killed while the spinners run (a SIGTERM skips `close`) leaves none spinning. Its
# argument is the bench's pid: a parent gone before the prctl is seen by the check after it.
SPIN = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):  # not Linux
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(0)
print("spinning", flush=True)
while True:
    pass
"""


class Spinners:
    """N spinning processes, stopped until `running()`; `close()` ends them."""

    def __init__(self, count: int):
        if count < 1:
            raise ValueError(f"--busy needs at least 1 process, got {count}")
        self.count = count
        self._procs = [
            subprocess.Popen(
                [sys.executable, "-c", SPIN, str(os.getpid())],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(count)
        ]
        for p in self._procs:  # each past its prctl before it is stopped
            if p.stdout.readline().strip() != "spinning":
                self.close()
                raise RuntimeError(f"a busy process (pid {p.pid}) did not start spinning")
        self._stop()

    def _signal(self, sig: int) -> None:
        for p in self._procs:
            if p.poll() is not None:
                raise RuntimeError(f"a busy process (pid {p.pid}) exited: {p.returncode}")
            os.kill(p.pid, sig)

    def _stop(self) -> None:
        """SIGSTOP, and wait until each spinner has stopped (a signal is acted on when its
        process next runs: a quiet call right after the kill could still share the cores)."""
        self._signal(signal.SIGSTOP)
        for p in self._procs:
            _, status = os.waitpid(p.pid, os.WUNTRACED)
            if not os.WIFSTOPPED(status):
                raise RuntimeError(f"a busy process (pid {p.pid}) ended instead of stopping")

    @contextlib.contextmanager
    def running(self, warm_s: float = 0.02):
        """The spinners run inside the block (after `warm_s`, so they hold their cores when it
        starts) and are stopped again when it ends."""
        self._signal(signal.SIGCONT)
        try:
            time.sleep(warm_s)
            yield
        finally:
            self._stop()

    def close(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()  # SIGKILL ends a stopped process too
                p.wait()
            p.stdout.close()
        self._procs = []

    def __enter__(self) -> "Spinners":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fair_share(cores: int, busy: int) -> float:
    """The time factor of a kernel that uses all `cores` when `busy` spinners share them."""
    return (cores + busy) / cores

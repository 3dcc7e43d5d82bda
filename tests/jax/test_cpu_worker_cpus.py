"""WorkerCpus (csrc/kernel_common.h): the workers of one parallel call do not stay on one CPU.

Linux can wake a pool thread onto its waker's CPU when every CPU is busy, and leaves it there;
each worker of a call therefore moves itself off a CPU an earlier worker of the same call is on.
The probe (csrc/worker_cpus.cc) starts two threads of one call on the same CPU: the second must
end on another one with its affinity as it was, and stay where it is when bound there. What the
move is worth beside a busy process is measured by `jax-attn bench --busy` (NOTES.md).
"""

import ctypes
import os

import pytest

from jax_attn import cpu
from jax_attn.cpu import _build

REASON = cpu.unavailable_reason()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"native CPU kernels: {REASON}"),
    pytest.mark.skipif(
        len(os.sched_getaffinity(0)) < 2, reason="needs a process allowed on at least 2 CPUs"
    ),
]


def _probe(bound: bool) -> tuple[list[int], bool]:
    fn = _build.c_function("jax_attn_cpu_worker_cpus_probe")
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
    cpus = (ctypes.c_int * 2)(-1, -1)
    restored = ctypes.c_int(-1)
    assert fn(int(bound), cpus, ctypes.byref(restored)) == 0, "an affinity call failed"
    return list(cpus), restored.value == 1


def test_second_worker_leaves_a_shared_cpu():
    (first, second), restored = _probe(bound=False)
    assert first in os.sched_getaffinity(0)
    assert second != first and second in os.sched_getaffinity(0)
    assert restored, "the worker's affinity was not restored after the move"


def test_worker_bound_to_the_cpu_stays():
    (first, second), restored = _probe(bound=True)
    assert second == first
    assert restored

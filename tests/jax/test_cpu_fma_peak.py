"""jax_attn.cpu.fma_peak: the FMA loop that `jax-attn bench` measures the compute peak with.

Its speed is never asserted; what is: every worker ran every FMA the count claims (each chain
adds 2^-20 exactly once per iteration, so its final value is iterations * 2^-20 exactly, and a
skipped worker or a shortened loop lowers the mean), the worker count follows `threads` and
`JAX_ATTN_CPU_THREADS`, and bad arguments raise naming the rule.
"""

import pytest

from jax_attn import cpu
from jax_attn.cpu import fma_peak

REASON = cpu.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"native CPU kernels: {REASON}")


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("iterations", [0, 1, 777, 1 << 16])
def test_every_fma_runs_on_every_worker(threads, iterations):
    out, seconds = fma_peak.run(iterations, threads)
    workers, per_iteration, bits, mean = out.tolist()
    assert workers == threads
    assert bits in (32, 256, 512)
    assert per_iteration == 24 * bits // 32  # 24 chains of bits / 32 float32 lanes
    assert mean == iterations * 2.0**-20  # exact: every step of every chain ran
    assert seconds > 0


def test_default_threads_follow_jax_attn_cpu_threads(monkeypatch):
    monkeypatch.setenv("JAX_ATTN_CPU_THREADS", "3")
    out, _ = fma_peak.run(100)
    assert out[0] == 3


def test_measure_reports_the_flops_it_ran():
    peak = fma_peak.measure(threads=1, seconds=0.005, repeats=2)
    assert peak.threads == 1
    assert peak.gflop_s > 0
    flops = 2 * peak.fmas_per_iteration * peak.iterations
    assert peak.gflop_s == pytest.approx(flops / peak.seconds / 1e9)
    assert peak.per_thread_gflop_s == peak.gflop_s


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(iterations=-1), r"iterations=-1 must be in \[0, 16777216\]"),
        (dict(iterations=2**24 + 1), r"must be in \[0, 16777216\]"),
        (dict(iterations=10, threads=-2), r"threads=-2 must be >= 0"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fma_peak.run(**kwargs)

"""jax_attn.cpu.fma_peak: the FMA loop that `jax-attn bench` measures the compute peak with.

Its speed is never asserted; what is: every item ran every FMA the count claims (each chain
adds 2^-20 exactly once per iteration, so its final value is iterations * 2^-20 exactly, and
a skipped item or a shortened loop lowers the mean), the worker and item counts follow
`threads`, `items` and `JAX_ATTN_CPU_THREADS`, and bad arguments raise naming the rule.
"""

import pytest

from jax_attn import cpu
from jax_attn.cpu import fma_peak

REASON = cpu.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"native CPU kernels: {REASON}")


@pytest.mark.parametrize("threads, items", [(1, 1), (2, 2), (3, 7), (2, 0)])
@pytest.mark.parametrize("iterations", [0, 1, 777, 1 << 16])
def test_every_fma_of_every_item_runs(threads, items, iterations):
    result = fma_peak.run(iterations, threads, items)
    assert result.workers == threads
    assert result.items == (items or 8 * threads)
    assert result.vector_bits in (32, 256, 512)
    chains = {512: 24, 256: 12, 32: 12}[result.vector_bits]  # as the registers allow
    assert result.fmas_per_iteration == chains * result.vector_bits // 32  # chains x lanes
    assert result.chain_value == iterations * 2.0**-20  # exact: every step of every chain ran
    assert result.flops == 2 * result.items * result.fmas_per_iteration * iterations
    assert result.seconds > 0


def test_default_threads_follow_jax_attn_cpu_threads(monkeypatch):
    monkeypatch.setenv("JAX_ATTN_CPU_THREADS", "3")
    result = fma_peak.run(100)
    assert (result.workers, result.items) == (3, 24)


def test_measure_returns_its_fastest_sized_run():
    result = fma_peak.measure(threads=1, seconds=0.005, repeats=2)
    assert result.workers == 1 and result.items == 8
    assert result.iterations > 1 << 10  # sized up from the probe
    assert result.chain_value == result.iterations * 2.0**-20
    assert result.gflop_s == pytest.approx(result.flops / result.seconds / 1e9)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(iterations=-1), r"iterations=-1 must be in \[0, 16777216\]"),
        (dict(iterations=2**24 + 1), r"must be in \[0, 16777216\]"),
        (dict(iterations=10, threads=-2), r"threads=-2 must be >= 0"),
        (dict(iterations=10, items=-1), r"items=-1 must be >= 0"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fma_peak.run(**kwargs)

"""jax_attn.cpu.amx_peak: the AMX tile loop that `jax-attn bench` measures the bf16 peak with.

Its speed is only bounded, never asserted; what is: every item ran every tile product the count
claims (each product adds 32 * 1 * 2^-20 to every accumulator element exactly, so the final
mean is iterations * 2^-15 exactly, and a skipped item, product or tile lowers it), the worker
and item counts follow `threads`, `items` and `JAX_ATTN_CPU_THREADS`, and bad arguments raise
naming the rule. Where the tiles cannot run, `unavailable_reason()` says why (and the tests that
need them are skipped with it), and a call raises naming the reason instead of dying on SIGILL.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

from jax_attn import cpu
from jax_attn.cpu import amx_peak

REASON = cpu.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"native CPU kernels: {REASON}")
AMX_REASON = amx_peak.unavailable_reason() if REASON is None else REASON
# Whether the library was built with the tiles (a portable build names that as its reason).
JAX_ATTN_AMX_BUILT = AMX_REASON is None or "built without AMX-BF16" not in AMX_REASON
needs_amx = pytest.mark.skipif(AMX_REASON is not None, reason=f"AMX tiles: {AMX_REASON}")

PER_PRODUCT = 32 * amx_peak.A * amx_peak.B  # 2^-15: what a product adds to each C element
# No core retires more than 2048 bf16 flops per cycle on its tiles (Sapphire Rapids: 1024),
# nor runs above 6 GHz.
MAX_GFLOP_S_PER_WORKER = 2048 * 6.0


@needs_amx
@pytest.mark.parametrize("threads, items", [(1, 1), (2, 2), (3, 7), (2, 0)])
@pytest.mark.parametrize("iterations", [0, 1, 777, 1 << 14])
def test_every_tile_product_of_every_item_runs(threads, items, iterations):
    result = amx_peak.run(iterations, threads, items)
    assert result.workers == threads
    assert result.items == (items or 8 * threads)
    assert result.products_per_iteration == 4  # independent accumulator tiles
    assert result.flops_per_product == 2 * 16 * 16 * 32
    assert result.tile_value == iterations * PER_PRODUCT  # exact: every product of every item
    assert result.flops == result.items * 4 * 16384 * iterations
    assert result.seconds > 0


@needs_amx
def test_default_threads_follow_jax_attn_cpu_threads(monkeypatch):
    monkeypatch.setenv("JAX_ATTN_CPU_THREADS", "3")
    result = amx_peak.run(100)
    assert (result.workers, result.items) == (3, 24)
    assert result.tile_value == 100 * PER_PRODUCT


@needs_amx
def test_measure_returns_its_fastest_sized_run_below_the_physical_bound():
    result = amx_peak.measure(threads=1, seconds=0.005, repeats=2)
    assert result.workers == 1 and result.items == 8
    assert result.iterations > 1 << 8  # sized up from the probe
    assert result.tile_value == result.iterations * PER_PRODUCT
    assert result.gflop_s == pytest.approx(result.flops / result.seconds / 1e9)
    assert 0 < result.gflop_s < MAX_GFLOP_S_PER_WORKER * result.workers


@needs_amx
def test_available_where_the_tiles_run():
    assert amx_peak.available() and amx_peak.unavailable_reason() is None


@pytest.mark.skipif(AMX_REASON is None, reason="the AMX tiles run here")
def test_elsewhere_a_call_names_why_the_tiles_do_not_run():
    assert not amx_peak.available()
    with pytest.raises(RuntimeError, match="AMX peak: " + re.escape(AMX_REASON)):
        amx_peak.run(10)


def test_tiles_turned_off_the_handler_itself_refuses_naming_why():
    """JAX_ATTN_CPU_AMX=0 (read once per process), in a fresh process: the reason says so, and
    the handler, called past the Python check, returns that error rather than running a tile
    instruction (SIGILL where Linux has not granted the tile state)."""
    script = textwrap.dedent(
        """
        import jax
        from jax_attn.cpu import amx_peak
        print(amx_peak.unavailable_reason())
        try:
            jax.block_until_ready(amx_peak._compiled(10, 0, 0)())
        except Exception as e:
            print("raised:", e)
        """
    )
    env = dict(os.environ, JAX_ATTN_CPU_AMX="0")
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, rest = proc.stdout.split("\n", 1)
    expected = (
        "turned off by JAX_ATTN_CPU_AMX=0" if JAX_ATTN_AMX_BUILT else "built without AMX-BF16"
    )
    assert expected in first, proc.stdout
    assert "raised:" in rest and f"AMX peak: {first}" in rest, proc.stdout


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
        amx_peak.run(**kwargs)

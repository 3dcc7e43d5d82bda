"""The machine's vector FMA peak through the native library (csrc/fma_peak.cc).

`jax-attn bench` reports compute-bound steps (the prefill) in GFLOP/s against this peak,
measured in the same run: a tight loop of fused multiply-adds on independent register chains,
in work items over the same workers (XLA's intra-op pool, `JAX_ATTN_CPU_THREADS`) the
attention kernels use. Tested in tests/jax/test_cpu_fma_peak.py (the chains' exact final
values show that every item ran every FMA the count claims).
"""

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_attn.cpu import _ffi, _peak

TARGET = "jax_attn_cpu_fma_peak"
# The chains run x = x * 1 + 2^-20: exact while x < 2^4, i.e. for up to 2^24 iterations.
_ADDEND = 2.0**-20
MAX_ITERATIONS = 2**24


@dataclasses.dataclass(frozen=True)
class Run:
    """One call's result (the kernel's float32 [5] output) and its wall time."""

    workers: int
    items: int
    fmas_per_iteration: int  # per item: vector lanes x independent chains
    vector_bits: int  # 512 (AVX-512), 256 (AVX2 + FMA) or 32 (scalar)
    chain_value: float  # mean final lane value: iterations * 2**-20 when every FMA ran
    iterations: int  # per item
    seconds: float

    @property
    def flops(self) -> float:
        return 2.0 * self.items * self.fmas_per_iteration * self.iterations  # an FMA counts 2

    @property
    def gflop_s(self) -> float:
        return self.flops / self.seconds / 1e9


@functools.lru_cache(maxsize=64)
def _compiled(iterations: int, items: int, threads: int):
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((5,), jnp.float32))
    attrs = dict(
        iterations=np.int64(iterations),
        items=np.int64(items),
        threads=np.int64(threads),
        multiplier=np.float32(1.0),
        addend=np.float32(_ADDEND),
    )
    return jax.jit(lambda: call(**attrs)).lower().compile()


def run(iterations: int, threads: int = 0, items: int = 0) -> Run:
    """One call: `items` work items (0: 8 per worker) of `iterations` steps each, handed out
    one at a time to `threads` workers (0: as the kernels run)."""
    _ffi.require_native()
    _peak.check_run_args(iterations, threads, items, MAX_ITERATIONS)
    compiled = _compiled(iterations, items, threads)
    start = time.perf_counter()
    out = np.asarray(jax.block_until_ready(compiled()))
    seconds = time.perf_counter() - start
    workers, n_items, per_iteration, bits = (int(v) for v in out[:4])
    return Run(workers, n_items, per_iteration, bits, float(out[4]), iterations, seconds)


def measure(threads: int = 0, seconds: float = 0.05, repeats: int = 5) -> Run:
    """The fastest of `repeats` calls on `threads` workers (0: as the kernels run), each sized
    to take about `seconds` (a peak: machine noise only ever slows a call down)."""
    return _peak.fastest(run, 1 << 10, MAX_ITERATIONS, threads, seconds, repeats)

"""The machine's vector FMA peak through the native library (csrc/fma_peak.cc).

`jax-attn bench` reports compute-bound steps (the prefill) in GFLOP/s against this peak,
measured in the same run: a tight loop of fused multiply-adds on independent register chains,
on the same workers (XLA's intra-op pool, `JAX_ATTN_CPU_THREADS`) the attention kernels use.
Tested in tests/jax/test_cpu_fma_peak.py (the chains' exact final values show that every
worker ran every FMA the count claims).
"""

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_attn.cpu import _ffi

TARGET = "jax_attn_cpu_fma_peak"
# The chains run x = x * 1 + 2^-20: exact while x < 2^4, i.e. for up to 2^24 iterations.
_ADDEND = 2.0**-20
MAX_ITERATIONS = 2**24


@dataclasses.dataclass(frozen=True)
class FmaPeak:
    """One measurement: the best of `repeats` timed calls."""

    gflop_s: float  # float32 FLOP/s over all workers (an FMA counts 2), / 1e9
    threads: int  # workers that ran
    vector_bits: int  # 512 (AVX-512), 256 (AVX2 + FMA) or 32 (scalar)
    fmas_per_iteration: int  # per worker: lanes x independent chains
    iterations: int  # per worker and call
    seconds: float  # the best call's wall time

    @property
    def per_thread_gflop_s(self) -> float:
        return self.gflop_s / self.threads


@functools.lru_cache(maxsize=64)
def _compiled(iterations: int, threads: int):
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((4,), jnp.float32))
    attrs = dict(
        iterations=np.int64(iterations),
        threads=np.int64(threads),
        multiplier=np.float32(1.0),
        addend=np.float32(_ADDEND),
    )
    return jax.jit(lambda: call(**attrs)).lower().compile()


def run(iterations: int, threads: int = 0) -> tuple[np.ndarray, float]:
    """One call: (the kernel's float32 [4] result, wall seconds). `threads` 0: the kernels'
    worker count. The result is [workers, FMAs per worker per iteration, vector bits, the mean
    final chain value], the last exactly `iterations * 2**-20` when every FMA ran."""
    _ffi.require_native()
    if not 0 <= iterations <= MAX_ITERATIONS:
        raise ValueError(f"{iterations=} must be in [0, {MAX_ITERATIONS}]")
    if threads < 0:
        raise ValueError(f"{threads=} must be >= 0 (0: the kernels' worker count)")
    compiled = _compiled(iterations, threads)
    start = time.perf_counter()
    out = np.asarray(jax.block_until_ready(compiled()))
    return out, time.perf_counter() - start


def measure(threads: int = 0, seconds: float = 0.05, repeats: int = 5) -> FmaPeak:
    """The FMA peak on `threads` workers (0: as the kernels run): iterations sized so that one
    call takes about `seconds`, the best of `repeats` calls (a peak: machine noise only ever
    slows a call down)."""
    iterations = 1 << 12
    out, elapsed = run(iterations, threads)
    while elapsed < seconds / 4 and iterations < MAX_ITERATIONS:
        iterations = min(MAX_ITERATIONS, iterations * 4)
        out, elapsed = run(iterations, threads)
    iterations = int(min(MAX_ITERATIONS, max(iterations, iterations * seconds / elapsed)))
    best = min(run(iterations, threads)[1] for _ in range(repeats))
    workers, per_iteration, bits, _ = (int(v) for v in out)
    flops = 2.0 * workers * per_iteration * iterations
    return FmaPeak(
        gflop_s=flops / best / 1e9,
        threads=workers,
        vector_bits=bits,
        fmas_per_iteration=per_iteration,
        iterations=iterations,
        seconds=best,
    )

"""The machine's AMX tile peak through the native library (csrc/amx_peak.cc).

`jax-attn bench` reports the bf16 prefill (whose products run on the AMX tiles where the CPU
has them, csrc/amx_tiles.h) in GFLOP/s against this peak, measured in the same run beside the
FMA peak (`fma_peak`): bf16 tile dot products (TDPBF16PS, 16 x 16 x 32 multiply-adds each) into
four independent accumulator tiles, in work items over the same workers (XLA's intra-op pool,
`JAX_ATTN_CPU_THREADS`) the attention kernels use. `unavailable_reason()` says why the tiles
cannot run here (a build without AMX-BF16, a CPU without it, Linux refusing the tile state,
`JAX_ATTN_CPU_AMX=0`). Tested in tests/jax/test_cpu_amx_peak.py (the accumulators' exact final
values show that every item ran every tile product the count claims).
"""

import ctypes
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_attn.cpu import _build, _ffi, _peak

TARGET = "jax_attn_cpu_amx_peak"
# Every A element 1, every B element 2^-20: a product adds 32 * 2^-20 = 2^-15 to each C
# element, exact while C < 2^9, i.e. for up to 2^24 iterations.
A = 1.0
B = 2.0**-20
MAX_ITERATIONS = 2**24


@dataclasses.dataclass(frozen=True)
class Run:
    """One call's result (the kernel's float32 [5] output) and its wall time."""

    workers: int
    items: int
    products_per_iteration: int  # per item: independent accumulator tiles
    flops_per_product: int  # 2 x 16 x 16 x 32
    tile_value: float  # mean final C element: iterations * 32 * A * B when every product ran
    iterations: int  # per item
    seconds: float

    @property
    def flops(self) -> float:
        return float(
            self.items * self.products_per_iteration * self.flops_per_product * self.iterations
        )

    @property
    def gflop_s(self) -> float:
        return self.flops / self.seconds / 1e9


def unavailable_reason() -> str | None:
    """None when the AMX tiles run here, else a one-line reason. Never raises."""
    reason = _build.unavailable_reason()
    if reason is not None:
        return f"native CPU kernels: {reason}"
    if not _build.registered(TARGET):
        return f"the native library has no {TARGET} (built from older sources)"
    fn = _build.c_function("jax_attn_cpu_amx_unavailable")
    if fn is None:
        return "the native library has no jax_attn_cpu_amx_unavailable"
    fn.restype = ctypes.c_char_p
    why = fn()
    return None if why is None else why.decode()


def available() -> bool:
    """Whether the AMX tiles run here (building the native kernels on first call)."""
    return unavailable_reason() is None


@functools.lru_cache(maxsize=64)
def _compiled(iterations: int, items: int, threads: int):
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((5,), jnp.float32))
    attrs = dict(
        iterations=np.int64(iterations),
        items=np.int64(items),
        threads=np.int64(threads),
        a=np.float32(A),
        b=np.float32(B),
    )
    return jax.jit(lambda: call(**attrs)).lower().compile()


def run(iterations: int, threads: int = 0, items: int = 0) -> Run:
    """One call: `items` work items (0: 8 per worker) of `iterations` steps of 4 tile products
    each, handed out one at a time to `threads` workers (0: as the kernels run). Raises
    RuntimeError naming why where the tiles cannot run."""
    _ffi.require_native()
    _peak.check_run_args(iterations, threads, items, MAX_ITERATIONS)
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"AMX peak: {reason}")
    compiled = _compiled(iterations, items, threads)
    start = time.perf_counter()
    out = np.asarray(jax.block_until_ready(compiled()))
    seconds = time.perf_counter() - start
    workers, n_items, per_iteration, per_product = (int(v) for v in out[:4])
    return Run(workers, n_items, per_iteration, per_product, float(out[4]), iterations, seconds)


def measure(threads: int = 0, seconds: float = 0.05, repeats: int = 5) -> Run:
    """The fastest of `repeats` calls on `threads` workers (0: as the kernels run), each sized
    to take about `seconds` (a peak: machine noise only ever slows a call down)."""
    return _peak.fastest(run, 1 << 8, MAX_ITERATIONS, threads, seconds, repeats)

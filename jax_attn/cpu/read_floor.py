"""The machine's streaming-read floor through the native library (csrc/read_floor.cc).

`jax-attn bench` reports each peer's bandwidth against this floor ("of read"), measured in the
same run over the workload's own K/V cache: every byte read once with the widest vector loads
the build has, on the same workers (XLA's intra-op pool, `JAX_ATTN_CPU_THREADS`) the attention
kernels use, nothing gathered or written. XLA's jitted sum over the same arrays, which the
bench reports beside it, measures XLA's reduction rather than the machine.

The read returns a checksum (the wrapping sum of the bytes as little-endian uint64 words,
`checksum_reference` in NumPy) so that it cannot be optimized away, and so that a test can see
every byte was read. Tested in tests/jax/test_cpu_read_floor.py.
"""

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_attn.cpu import _ffi

TARGET = "jax_attn_cpu_read_floor"


@dataclasses.dataclass(frozen=True)
class Run:
    """One call's result (the kernel's uint32 [5] output) and its wall time."""

    checksum: int  # the bytes as uint64 words, summed mod 2**64
    workers: int
    chunks: int  # work items: 512 KiB pieces of the operands, handed out one at a time
    vector_bits: int  # 512 (AVX-512), 256 (AVX2) or 64 (scalar)
    bytes: int  # read: every byte of every operand
    seconds: float

    @property
    def gb_s(self) -> float:
        return self.bytes / self.seconds / 1e9


@functools.lru_cache(maxsize=64)
def _compiled(avals: tuple[jax.ShapeDtypeStruct, ...], threads: int):
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((5,), jnp.uint32))
    read = jax.jit(lambda *arrays: call(*arrays, threads=np.int64(threads)))
    return read.lower(*avals).compile()


class Reader:
    """Every byte of `arrays` read once per call, on `threads` workers (0: as the kernels run).

    The arrays are placed on the CPU device and the read compiled once, here; each call then
    runs the read alone and returns a `Run` with its wall time. The read is of bytes: NumPy
    arrays of a dtype JAX would narrow (float64, int64 without x64) are read as their bytes.
    """

    def __init__(self, *arrays, threads: int = 0) -> None:
        _ffi.require_native()
        if not arrays:
            raise ValueError("arrays: give at least one array to read")
        if threads < 0:
            raise ValueError(f"{threads=} must be >= 0 (0: the kernels' worker count)")
        self.arrays = tuple(jnp.asarray(_same_bytes(a)) for a in arrays)
        self.bytes = sum(a.nbytes for a in self.arrays)
        avals = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self.arrays)
        self.compiled = _compiled(avals, threads)

    def __call__(self) -> Run:
        start = time.perf_counter()
        out = np.asarray(jax.block_until_ready(self.compiled(*self.arrays)))
        seconds = time.perf_counter() - start
        low, high, workers, chunks, bits = (int(v) for v in out)
        return Run(low | high << 32, workers, chunks, bits, self.bytes, seconds)


def _same_bytes(a):
    """`a`, or for a NumPy array whose dtype JAX would narrow (64-bit types without x64), its
    bytes as uint8: the read is of the bytes, which must reach the device unchanged."""
    if isinstance(a, jax.Array) or jax.dtypes.canonicalize_dtype(a.dtype) == a.dtype:
        return a
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def read(*arrays, threads: int = 0) -> Run:
    """One read of every byte of `arrays` (compiling it first; see `Reader`)."""
    return Reader(*arrays, threads=threads)()


def checksum_reference(*arrays) -> int:
    """What the read returns as `checksum`: each array's bytes as little-endian uint64 words
    (the last partial word padded with zero bytes), all summed mod 2**64."""
    total = 0
    for a in arrays:
        raw = np.ascontiguousarray(np.asarray(a)).reshape(-1).view(np.uint8)
        whole = raw.size // 8 * 8
        tail = np.zeros(8, np.uint8)
        tail[: raw.size - whole] = raw[whole:]
        total += int(raw[:whole].view("<u8").sum(dtype=np.uint64))  # wraps mod 2**64
        total += int(tail.view("<u8")[0])
    return total % 2**64

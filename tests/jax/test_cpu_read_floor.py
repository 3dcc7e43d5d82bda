"""jax_attn.cpu.read_floor: the streaming read that `jax-attn bench` measures the read floor with.

Its speed is never asserted; what is: the checksum equals NumPy's sum of the same bytes as
uint64 words (every byte of every operand was read, none twice, the odd tails included: sizes
around the vector width and the 512 KiB chunk), for every dtype a cache may have, the worker
count follows `threads` and `JAX_ATTN_CPU_THREADS`, and bad arguments raise naming the rule.
"""

import ml_dtypes
import numpy as np
import pytest

from jax_attn import cpu
from jax_attn.cpu import read_floor

REASON = cpu.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"native CPU kernels: {REASON}")

CHUNK = 512 << 10  # csrc/read_floor.cc's kChunkBytes


def _bytes(rng, n: int) -> np.ndarray:
    return rng.integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize(
    "nbytes", [0, 1, 7, 8, 63, 64, 65, 255, 256, 257, 4099, CHUNK - 8, CHUNK, 3 * CHUNK + 13]
)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_checksum_counts_every_byte_once(nbytes, threads):
    data = _bytes(np.random.default_rng(nbytes), nbytes)
    run = read_floor.read(data, threads=threads)
    assert run.checksum == read_floor.checksum_reference(data)
    assert run.bytes == nbytes
    assert run.chunks == -(-nbytes // CHUNK)  # ceil: the last chunk shorter
    assert run.workers == max(1, min(threads, run.chunks))
    assert run.vector_bits in (64, 256, 512)


def test_checksum_of_a_byte_is_its_place_in_the_word():
    """Little-endian words: byte i of a word adds value << 8 * (i % 8); a tail is zero-padded."""
    for i in range(11):
        data = np.zeros(11, np.uint8)
        data[i] = 3
        assert read_floor.read(data).checksum == 3 << 8 * (i % 8)


def test_checksum_wraps_mod_2_64():
    data = np.full(4 * CHUNK // 8, np.iinfo(np.uint64).max, np.uint64)  # many -1s
    expected = (data.size * (2**64 - 1)) % 2**64
    assert read_floor.read(data, threads=2).checksum == expected
    assert read_floor.checksum_reference(data) == expected


@pytest.mark.parametrize(
    "dtype", [np.float32, ml_dtypes.bfloat16, np.float16, ml_dtypes.float8_e4m3fn, np.int32]
)
def test_several_caches_of_any_dtype(dtype):
    """A K/V cache pair [NB, BS, Hkv, D] of each cache dtype, odd sizes: the checksum covers
    both operands' bytes."""
    rng = np.random.default_rng(1)
    key, value = (rng.standard_normal((5, 3, 2, 37)).astype(dtype) for _ in range(2))
    reader = read_floor.Reader(key, value, threads=2)
    run = reader()
    assert run.checksum == read_floor.checksum_reference(key, value)
    assert run.bytes == key.nbytes + value.nbytes
    assert reader().checksum == run.checksum  # compiled once, read again
    assert run.seconds > 0 and run.gb_s == pytest.approx(run.bytes / run.seconds / 1e9)


def test_default_threads_follow_jax_attn_cpu_threads(monkeypatch):
    monkeypatch.setenv("JAX_ATTN_CPU_THREADS", "3")
    data = _bytes(np.random.default_rng(2), 5 * CHUNK)
    run = read_floor.read(data)
    assert (run.workers, run.chunks) == (3, 5)
    assert run.checksum == read_floor.checksum_reference(data)


@pytest.mark.parametrize(
    "arrays, kwargs, match",
    [
        ((), {}, "give at least one array"),
        ((np.zeros(4, np.float32),), dict(threads=-1), r"threads=-1 must be >= 0"),
    ],
)
def test_bad_arguments_raise(arrays, kwargs, match):
    with pytest.raises(ValueError, match=match):
        read_floor.Reader(*arrays, **kwargs)

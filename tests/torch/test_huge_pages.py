"""torch_backends.huge_pages: a tensor's all-zero 2 MiB chunks handed back for huge pages, no value
changed, nothing else touched."""

import ctypes
import mmap
import os
import sys

import numpy as np
import pytest
import torch
from thp import linux_at_least, thp_eligible, thp_mode

from torch_backends import huge_pages

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason=f"madvise and mincore are Linux's ({sys.platform})"
)

CHUNK = huge_pages.CHUNK
PAGE = mmap.PAGESIZE


def _resident_pages(begin: int, size: int) -> int:
    """Resident pages of [begin, begin + size) (page-aligned), by mincore(2)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    vec = ctypes.create_string_buffer(size // PAGE)
    assert libc.mincore(begin, size, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw)


def _chunked_tensor(rng, data_chunks, chunks=12):
    """A float32 tensor of `chunks` 2 MiB chunks plus a ragged 12 KiB + 4 byte tail, started 64
    bytes into a chunk, all zeros but random values in the whole chunks `data_chunks` (by index
    of the tensor's whole chunks) and in both partial ends. Returns it and its whole chunks'
    first address."""
    size = chunks * CHUNK + 3 * PAGE + 4
    base = torch.zeros((size + 2 * CHUNK) // 4, dtype=torch.float32)  # room to pick the start
    offset = ((-base.data_ptr()) % CHUNK + 64) // 4  # 64 bytes past a 2 MiB boundary
    x = base[offset : offset + size // 4]
    first = (x.data_ptr() + CHUNK - 1) // CHUNK * CHUNK
    per = CHUNK // 4
    head = (first - x.data_ptr()) // 4
    x[:head] = torch.from_numpy(rng.standard_normal(head, dtype=np.float32))
    for c in data_chunks:
        x[head + c * per : head + (c + 1) * per] = torch.from_numpy(
            rng.standard_normal(per, dtype=np.float32)
        )
    x[head + (chunks - 1) * per :] = torch.from_numpy(
        rng.standard_normal(x.numel() - head - (chunks - 1) * per, dtype=np.float32)
    )
    return base, x, first


def test_values_stay_and_only_zero_chunks_leave_memory():
    rng = np.random.default_rng()
    data = sorted(rng.choice(11, size=4, replace=False).tolist())  # of the 11 whole chunks
    base, x, first = _chunked_tensor(rng, data)
    before = x.clone()
    whole = (x.data_ptr() + x.numel() * 4 - first) // CHUNK
    zero = [c for c in range(whole) if not torch.any(_chunk(x, first, c))]
    assert set(zero).isdisjoint(data) and len(zero) >= 5

    done = huge_pages.rebacked_zero_chunks(x)

    assert done.reason is None
    assert (done.chunks, done.zero_chunks, done.bytes) == (whole, len(zero), len(zero) * CHUNK)
    for c in range(whole):  # before any read: a read maps the zero page, which counts here
        resident = _resident_pages(first + c * CHUNK, CHUNK)
        if c in zero:
            assert resident == 0, f"zero chunk {c} still holds {resident} pages"
        else:
            assert resident == CHUNK // PAGE, f"data chunk {c}: {resident} pages"
    assert torch.equal(x, before)  # every value, the partial ends included
    # Read back as zeros, written as usual.
    c = zero[0]
    assert not torch.any(_chunk(x, first, c))
    _chunk(x, first, c).fill_(2.5)
    assert torch.all(_chunk(x, first, c) == 2.5)
    del base


@pytest.mark.skipif(
    not linux_at_least(5, 14), reason=f"MADV_POPULATE_WRITE is Linux 5.14's ({os.uname().release})"
)
def test_populate_faults_the_zero_chunks_in_again():
    rng = np.random.default_rng()
    data = sorted(rng.choice(11, size=3, replace=False).tolist())
    base, x, first = _chunked_tensor(rng, data)
    before = x.clone()
    whole = (x.data_ptr() + x.numel() * 4 - first) // CHUNK
    zero = [c for c in range(whole) if not torch.any(_chunk(x, first, c))]

    done = huge_pages.rebacked_zero_chunks(x, populate=True)

    assert done.reason is None and done.populated and done.zero_chunks == len(zero) >= 5
    for c in range(whole):  # before any read: every page of every chunk is there
        resident = _resident_pages(first + c * CHUNK, CHUNK)
        assert resident == CHUNK // PAGE, (
            f"chunk {c} ({'zero' if c in zero else 'data'}): {resident}"
        )
    if thp_mode() != "never":
        assert thp_eligible(first + zero[0] * CHUNK)
    assert torch.equal(x, before)
    del base


def test_first_sight_populates_what_it_hands_back(monkeypatch):
    monkeypatch.delenv(huge_pages.ENV, raising=False)
    monkeypatch.setattr(huge_pages, "_SEEN", set())  # an earlier cache may have had this address
    memory = mmap.mmap(-1, 5 * CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    x = torch.frombuffer(memory, dtype=torch.float32).zero_()
    done = huge_pages.rebacked_on_first_sight(x)
    assert done is not None and done.zero_chunks >= 4
    assert done.populated == linux_at_least(5, 14)
    assert huge_pages.rebacked_on_first_sight(x) is None  # once per cache
    assert not bool(x.any())
    del x
    memory.close()


def _chunk(x, first, c):
    """Whole chunk c (from `first`) of x, as a view."""
    start = (first - x.data_ptr()) // 4 + c * (CHUNK // 4)
    return x[start : start + CHUNK // 4]


@pytest.mark.skipif(thp_mode() == "never", reason="transparent huge pages are off here (never)")
def test_the_chunks_are_marked_for_huge_pages():
    # A mapping of its own: memory from torch's allocator may lie where an earlier test's cache
    # was marked (the torch backends mark every cache they meet), and stay marked after a free.
    memory = mmap.mmap(-1, 7 * CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    x = torch.frombuffer(memory, dtype=torch.float32).zero_()  # faulted in, as a memset does
    first = (x.data_ptr() + CHUNK - 1) // CHUNK * CHUNK
    if thp_mode() == "madvise":
        assert not thp_eligible(first)  # as the memset left it
    assert huge_pages.rebacked_zero_chunks(x).zero_chunks >= 6
    assert thp_eligible(first)
    assert not bool(x.any())
    del x
    memory.close()


def test_a_private_file_mapping_is_left_alone(tmp_path):
    path = tmp_path / "cache.bin"
    size = 5 * CHUNK
    path.write_bytes(np.random.default_rng().integers(1, 255, size, dtype=np.uint8).tobytes())
    mapped = np.memmap(path, dtype=np.uint8, mode="c")  # MAP_PRIVATE: writes stay in memory
    mapped[:] = 0  # all zeros in this process; the file still holds the bytes
    x = torch.from_numpy(mapped)

    done = huge_pages.rebacked_zero_chunks(x)

    assert done.zero_chunks == 0 and "not private anonymous" in done.reason
    assert not torch.any(x)  # MADV_DONTNEED here would have brought the file's bytes back


def test_small_tensors_do_nothing():
    done = huge_pages.rebacked_zero_chunks(torch.zeros(1000))
    assert (done.chunks, done.zero_chunks) == (0, 0) and "no whole 2 MiB chunk" in done.reason


def test_refuses_what_it_cannot_read_as_one_range():
    x = torch.zeros(4, CHUNK // 4)
    with pytest.raises(ValueError, match="must be a contiguous CPU tensor"):
        huge_pages.rebacked_zero_chunks(x.t())

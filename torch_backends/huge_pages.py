"""A cache tensor's all-zero memory moved onto transparent huge pages, contents unchanged.

Why: a paged-attention step reads the KV cache block by block, all over a multi-GB buffer. On 4 KiB
pages every 4 KiB of it costs a TLB miss, and in a virtual machine each miss is a two-level page
walk. Measured on the 2-core Intel Xeon VM (Sapphire Rapids class; NOTES.md, 2026-11-30 15:38-): the
plugin's decode step (32 x 1088 keys in a 1 GiB cache) ran 7.69 ms on 4 KiB pages and 6.15 on 2 MiB
ones in bf16, 16.06 vs 12.25 in f32; on the Zen 5 VM huge pages gave 3% or nothing. Linux gives huge
pages to `madvise(MADV_HUGEPAGE)` regions where transparent huge pages are in `madvise` mode
(Ubuntu's default), but vLLM allocates its cache with `torch.zeros`, whose memset faults it in on
4 KiB pages first. Collapsing them in place (`MADV_COLLAPSE`) took 5.1 s per GiB there.

What `rebacked_zero_chunks` does instead: every 2 MiB-aligned chunk of the tensor that is all
zeros is handed back to the kernel (`MADV_DONTNEED`) after the range is marked `MADV_HUGEPAGE`,
so the next write into it faults in one fresh zeroed 2 MiB page. A private anonymous page read
after `MADV_DONTNEED` is zero-filled, which is what the chunk held: no byte of the tensor
changes. Chunks holding any data, the partial chunks at either end, and memory that is not
private anonymous (a file or shared mapping, where `MADV_DONTNEED` would bring back other bytes)
are left as they are. It reads the whole tensor once (0.27 s per GiB on that VM) and must not
run while another thread writes the tensor. Linux only; elsewhere it does nothing.
"""

import ctypes
import ctypes.util
import os
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

CHUNK = 2 << 20  # bytes: an x86-64 transparent huge page
# "0": caches keep the pages they came with (`rebacked_on_first_sight` does nothing).
ENV = "JAX_ATTN_VLLM_HUGE_PAGES"
_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; refused (EINVAL) before
_SCAN_CHUNKS = 32  # chunks tested per torch call (a 64 MiB view, 32 booleans out)
# Caches already seen by `rebacked_on_first_sight`, by data pointer.
_SEEN: set[int] = set()


@dataclass(frozen=True)
class Rebacked:
    """What `rebacked_zero_chunks` did: whole chunks in the tensor, and those handed back."""

    chunks: int
    zero_chunks: int
    reason: str | None = None  # why nothing was done, when nothing was
    populated: bool = False  # the handed-back chunks faulted in again at once (`populate`)

    @property
    def bytes(self) -> int:
        return self.zero_chunks * CHUNK


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def private_anonymous(begin: int, end: int) -> bool:
    """Whether [begin, end) lies in private anonymous mappings only (/proc/self/maps: no path,
    or [heap], and 'p' in the permissions), where MADV_DONTNEED'd pages read back as zeros."""
    covered = begin
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if hi <= covered or lo > covered:
                continue
            path = fields[5] if len(fields) > 5 else ""
            if fields[1][3] != "p" or path not in ("", "[heap]"):
                return False
            covered = hi
            if covered >= end:
                return True
    return False


def _zero_chunks(chunks: Tensor) -> list[bool]:
    """Per row of `chunks` ([n, CHUNK // 8] int64): whether it is all zeros."""
    zero: list[bool] = []
    for first in range(0, chunks.shape[0], _SCAN_CHUNKS):
        zero.extend((~chunks[first : first + _SCAN_CHUNKS].any(dim=1)).tolist())
    return zero


def rebacked_zero_chunks(tensor: Tensor, populate: bool = False) -> Rebacked:
    """Moves the all-zero 2 MiB chunks of a contiguous CPU tensor onto transparent huge pages
    (module docstring); returns what it did. The tensor's values do not change. `populate`:
    fault the handed-back chunks in again at once (`MADV_POPULATE_WRITE`, fresh zeroed huge
    pages where Linux has them), so that the first writes into them later find their pages
    there, as they found the ones `torch.zeros` had faulted in; where Linux refuses
    (before 5.14), `populated` is False and they fault in on first write."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"tensor must be a contiguous CPU tensor, got device {tensor.device} "
            f"and strides {tensor.stride()}"
        )
    libc = _libc()
    if libc is None:
        return Rebacked(0, 0, f"madvise is Linux's ({sys.platform})")
    start = tensor.data_ptr()
    first = (start + CHUNK - 1) // CHUNK * CHUNK
    last = (start + tensor.numel() * tensor.element_size()) // CHUNK * CHUNK
    if last <= first:
        return Rebacked(0, 0, "the tensor holds no whole 2 MiB chunk")
    n = (last - first) // CHUNK
    if not private_anonymous(first, last):
        return Rebacked(n, 0, "the memory is not private anonymous (a file or shared mapping)")
    flat = tensor.view(-1).view(torch.uint8)[first - start : last - start]
    zero = _zero_chunks(flat.view(torch.int64).view(n, CHUNK // 8))
    if libc.madvise(first, last - first, _MADV_HUGEPAGE) != 0:
        return Rebacked(n, 0, f"madvise(MADV_HUGEPAGE) failed: errno {ctypes.get_errno()}")
    i = 0
    populated = populate
    while i < n:
        if not zero[i]:
            i += 1
            continue
        j = i
        while j < n and zero[j]:
            j += 1
        if libc.madvise(first + i * CHUNK, (j - i) * CHUNK, _MADV_DONTNEED) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed on zero chunks")
        if populated:
            populated = libc.madvise(first + i * CHUNK, (j - i) * CHUNK, _MADV_POPULATE_WRITE) == 0
        i = j
    return Rebacked(n, sum(zero), populated=populated and any(zero))


def rebacked_on_first_sight(cache: Tensor) -> Rebacked | None:
    """`rebacked_zero_chunks(cache, populate=True)` the first time this cache (by data pointer)
    comes by, as a serving step first meets a freshly made, still all-zero cache; None when it
    did nothing: seen before, `$JAX_ATTN_VLLM_HUGE_PAGES` is "0", or not a contiguous CPU tensor
    (the torch backends' caches, V0 and V1, call this before their first write). Populated at
    once, the cache's pages are zeroed here, once, as `torch.zeros` had zeroed the ones it
    replaces, and not by the steps that first write each block: in vLLM's engine those faults
    had been most of the plugin's system time (float32, 2-core Zen 5 VM, NOTES.md)."""
    ptr = cache.data_ptr()
    if ptr in _SEEN or cache.device.type != "cpu" or not cache.is_contiguous():
        return None
    _SEEN.add(ptr)
    if os.environ.get(ENV) == "0":
        return None
    return rebacked_zero_chunks(cache, populate=True)

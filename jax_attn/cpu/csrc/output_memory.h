// A large output's memory, made ready before the kernel writes it.
//
// A large output is fresh memory on every call: XLA allocates it per execution (as a torch
// caller does per call, vLLM's attention layer included) and glibc maps anything past its mmap
// threshold (at most 32 MiB) anew, so the kernel's first writes fault it in 4 KiB at a time
// (16k faults for prefill-8x512's 64 MiB of float32, a fifth of the call, measured) and the
// next call's free unmaps it again. Two remedies, both hints that change no byte:
// - transparent huge pages on the 2 MiB aligned inside of the buffer: one fault per 2 MiB
//   (`advise_huge_pages`);
// - the pages faulted in up front, a share per worker (`prefault_output`).
//
// Huge pages lose where the host takes freed guest memory back and has taken those blocks (a
// virtio balloon with free page reporting hands free 2 MiB blocks to the host, exactly the blocks
// a huge page needs; each then faults on the host again), while 4 KiB pages mostly come from
// smaller free pieces the host still backs. On the 2-core Zen 5 VM (NOTES.md) prefill-8x512
// took 45-53 ms on huge pages while the host backed them and ~155 ms once it had taken them,
// 60-96 ms on 4 KiB pages either way; in back-to-back calls huge pages won (44 ms against 54,
// paired); in vLLM's engine they won one day (prefill 1.15x vLLM's own CPU_ATTN against 1.06x
// on 4 KiB pages, whole runs 1.01x against 0.97x) and lost the day before. Timing the prefault
// to choose does not work: 4 KiB pages fault in faster (185 against 40-1000 us per MiB) yet make
// the call slower (59 against 45 ms: what the timing misses is freeing 16k pages). So huge pages
// it is, unless $JAX_ATTN_CPU_HUGE_OUTPUT=0 (read once per process).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "kernel_common.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace jax_attn_cpu {

// Whether large outputs go on transparent huge pages: yes unless $JAX_ATTN_CPU_HUGE_OUTPUT is
// "0". Read once per process.
inline bool huge_output_pages() {
  static const bool huge = [] {
    const char* env = std::getenv("JAX_ATTN_CPU_HUGE_OUTPUT");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }();
  return huge;
}

// MADV_HUGEPAGE on the 2 MiB aligned inside of an output of at least 8 MiB, where
// huge_output_pages(). Where THP is off, or "always", it does nothing.
inline void advise_huge_pages(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < 4 * kHuge || !huge_output_pages()) return;  // small: a syscall for little
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

// advise_huge_pages, then a large output's pages faulted in up front, a share per worker
// (MADV_POPULATE_WRITE: page tables filled as a write would, no byte written; Linux 5.14+,
// elsewhere a refused hint and the kernel's first stores fault them in as before). Measured on
// prefill-8x512 (64 MiB of float32 output, 2-core Zen 5 VM, 8 rounds alternated): 47.1-49.3 ms
// vs 48.3-50.2 in half the rounds and 60.7-61.8 in the other half, when faulted in by the
// kernel's stores.
inline void prefault_output(const Workers& workers, void* data, size_t bytes) {
  advise_huge_pages(data, bytes);
#if defined(__linux__)
  constexpr int kPopulateWrite = 23;  // MADV_POPULATE_WRITE, for headers older than the kernel
  constexpr size_t kPage = 4096;
  // Only outputs past glibc's largest mmap threshold (32 MiB), which are fresh mappings on every
  // call; smaller ones are often reused heap memory, already faulted in, where the walk costs
  // more than it saves (mixed, 17 MiB: 12.7-14.7 vs 12.5-12.8 ms with an 8 MiB threshold).
  if (bytes < (size_t{32} << 20)) return;
  const int64_t shares = std::max<int64_t>(1, workers.count);
  const size_t share = ((bytes + shares - 1) / shares + kPage - 1) & ~(kPage - 1);
  const uintptr_t first = reinterpret_cast<uintptr_t>(data);
  const uintptr_t last = first + bytes;
  run_items(workers, shares, [&](int64_t w) {
    // Whole pages only: a page shared with the buffer's neighbours is left to fault as usual.
    const uintptr_t lo = (first + w * share + kPage - 1) & ~uintptr_t{kPage - 1};
    const uintptr_t hi = std::min<uintptr_t>(first + (w + 1) * share, last) & ~uintptr_t{kPage - 1};
    if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, kPopulateWrite);
  });
#else
  (void)workers;
#endif
}

}  // namespace jax_attn_cpu

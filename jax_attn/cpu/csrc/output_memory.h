// A large output's memory, made ready before the kernel writes it.
//
// A large output is fresh memory on every call: XLA allocates it per execution (as a torch
// caller does per call, vLLM's attention layer included) and glibc maps anything past its mmap
// threshold (at most 32 MiB) anew, so the kernel's first writes fault it in 4 KiB at a time
// (16k faults for prefill-8x512's 64 MiB of float32, a fifth of the call, measured) and the
// next call's free unmaps it again. Two remedies, both hints that change no byte, both in
// `prefault_output`:
// - transparent huge pages on the 2 MiB aligned inside of the buffer: one fault per 2 MiB;
// - the pages faulted in up front, a share per worker.
//
// Huge pages lose where the host takes freed guest memory back: a virtio balloon with free page
// reporting (order 9 on the Firecracker VMs this project runs on) hands free 2 MiB blocks to the
// host a second or two after they are freed, exactly the blocks a huge page needs, and each then
// faults on the host again; 4 KiB pages mostly come from smaller free pieces the host still
// backs. On the 2-core Zen 4 VM (2026-12-04, NOTES.md), faulting in a fresh 64 MiB mapping one
// 2 MiB chunk at a time: on huge pages 180-400 us a chunk (7-9 ms in all, 0.25 ms to unmap), on
// 4 KiB pages 0.7-1.7 ms a chunk (30-40 ms, 6-8 ms to unmap); but with 1.5 s between mappings,
// three times in five, 5-20 huge chunks took 1-33 ms each (88-337 ms in all). prefill-8x512 f32
// as single calls of two processes alternating took a median of 97-107 ms on huge pages against
// 113-125 on 4 KiB pages with no pause, 269-292 against 119-124 with the calls 1.3-3.3 s apart.
// Timing a whole prefault to choose between the two does not work (4 KiB pages fault in faster
// than that, yet freeing them costs what the timing misses), but a huge chunk that takes longer
// than kSlowHugeChunkNs is slower than its 512 small pages would be, and it says the host is
// taking them: so each worker faults its share in on huge pages a chunk at a time, and after a
// slow chunk the rest of its share goes on 4 KiB pages (`prefault_output`). The next call starts
// on huge pages again. $JAX_ATTN_CPU_HUGE_OUTPUT=1: huge pages throughout, 0: 4 KiB pages (read
// once per process).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "kernel_common.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace jax_attn_cpu {

// Which pages large outputs go on ($JAX_ATTN_CPU_HUGE_OUTPUT, read once per process).
enum class HugeOutputs { kUntilSlow, kAlways, kNever };
inline HugeOutputs huge_output_policy() {
  static const HugeOutputs policy = [] {
    const char* env = std::getenv("JAX_ATTN_CPU_HUGE_OUTPUT");
    if (env == nullptr || *env == '\0') return HugeOutputs::kUntilSlow;
    return std::strcmp(env, "0") == 0 ? HugeOutputs::kNever : HugeOutputs::kAlways;
  }();
  return policy;
}

// What `isa()` reports of huge_output_policy().
inline const char* huge_output_text() {
  switch (huge_output_policy()) {
    case HugeOutputs::kAlways: return "huge pages";
    case HugeOutputs::kNever: return "4 KiB pages";
    default: return "huge pages, 4 KiB pages after a slow one";
  }
}

constexpr uintptr_t kHugePage = uintptr_t{2} << 20;  // an x86-64 transparent huge page
constexpr uintptr_t kSmallPage = 4096;

// A huge chunk slower than this to fault in: twice what 512 small pages took (above).
constexpr int64_t kSlowHugeChunkNs = 2'000'000;

// kSlowHugeChunkNs, or $JAX_ATTN_CPU_SLOW_HUGE_CHUNK_US in microseconds (exists for tests: 0
// makes every chunk slow; read once per process).
inline int64_t slow_huge_chunk_ns() {
  static const int64_t ns = [] {
    const char* env = std::getenv("JAX_ATTN_CPU_SLOW_HUGE_CHUNK_US");
    return env != nullptr && *env != '\0' ? std::atoll(env) * 1000 : kSlowHugeChunkNs;
  }();
  return ns;
}

#if defined(__linux__)
constexpr int kPopulateWrite = 23;  // MADV_POPULATE_WRITE, for headers older than the kernel

inline int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// [lo, hi) faulted in, 2 MiB chunk by chunk while they are fast (lo and hi on chunk bounds,
// the range advised MADV_HUGEPAGE); after a chunk slower than slow_huge_chunk_ns() the rest is
// advised MADV_NOHUGEPAGE and faulted in on 4 KiB pages.
inline void populate_huge_until_slow(uintptr_t lo, uintptr_t hi) {
  for (uintptr_t at = lo; at < hi; at += kHugePage) {
    const int64_t start = steady_ns();
    madvise(reinterpret_cast<void*>(at), kHugePage, kPopulateWrite);
    if (steady_ns() - start > slow_huge_chunk_ns() && at + kHugePage < hi) {
      void* rest = reinterpret_cast<void*>(at + kHugePage);
      madvise(rest, hi - at - kHugePage, MADV_NOHUGEPAGE);
      madvise(rest, hi - at - kHugePage, kPopulateWrite);
      return;
    }
  }
}
#endif

// A large output's pages made ready before the kernel writes them, a share per worker: outputs
// of at least 8 MiB advised onto huge pages (unless huge_output_policy() says 4 KiB pages), and
// those of at least 32 MiB faulted in up front (MADV_POPULATE_WRITE: page tables filled as a
// write would, no byte written; Linux 5.14+, elsewhere a refused hint and the kernel's first
// stores fault them in as before), in 2 MiB chunks as populate_huge_until_slow says under the
// default policy. Measured on prefill-8x512 (64 MiB of float32 output, 2-core Zen 5 VM, 8 rounds
// alternated): faulted in up front 47.1-49.3 ms vs 48.3-50.2 in half the rounds and 60.7-61.8 in
// the other half, when faulted in by the kernel's stores. Where THP is off, or "always", the
// advice does nothing.
inline void prefault_output(const Workers& workers, void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const HugeOutputs policy = huge_output_policy();
  if (bytes < 4 * kHugePage) return;  // small: a syscall for little
  const uintptr_t first = reinterpret_cast<uintptr_t>(data);
  const uintptr_t last = first + bytes;
  // The 2 MiB aligned inside [begin, end).
  const uintptr_t begin = (first + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = last & ~(kHugePage - 1);
  if (policy != HugeOutputs::kNever && end > begin) {
    madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
  }
  // Only outputs past glibc's largest mmap threshold (32 MiB), which are fresh mappings on every
  // call; smaller ones are often reused heap memory, already faulted in, where the walk costs
  // more than it saves (mixed, 17 MiB: 12.7-14.7 vs 12.5-12.8 ms with an 8 MiB threshold).
  if (bytes < (size_t{32} << 20)) return;
  const int64_t shares = std::max<int64_t>(1, workers.count);
  if (policy == HugeOutputs::kUntilSlow && end > begin) {
    // Shares of whole chunks; the partial pages before `begin` and after `end` with the first
    // and the last share, on 4 KiB pages.
    const uintptr_t chunks = (end - begin) / kHugePage;
    run_items(workers, shares, [&](int64_t w) {
      const uintptr_t lo = begin + chunks * w / shares * kHugePage;
      const uintptr_t hi = begin + chunks * (w + 1) / shares * kHugePage;
      if (w == 0) {
        const uintptr_t page = (first + kSmallPage - 1) & ~(kSmallPage - 1);
        if (begin > page) madvise(reinterpret_cast<void*>(page), begin - page, kPopulateWrite);
      }
      if (w == shares - 1) {
        const uintptr_t page = last & ~(kSmallPage - 1);
        if (page > end) madvise(reinterpret_cast<void*>(end), page - end, kPopulateWrite);
      }
      populate_huge_until_slow(lo, hi);
    });
    return;
  }
  const uintptr_t share = ((bytes + shares - 1) / shares + kSmallPage - 1) & ~(kSmallPage - 1);
  run_items(workers, shares, [&](int64_t w) {
    // Whole pages only: a page shared with the buffer's neighbours is left to fault as usual.
    const uintptr_t lo = (first + w * share + kSmallPage - 1) & ~(kSmallPage - 1);
    const uintptr_t hi = std::min<uintptr_t>(first + (w + 1) * share, last) & ~(kSmallPage - 1);
    if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, kPopulateWrite);
  });
#else
  (void)workers;
  (void)data;
  (void)bytes;
#endif
}

}  // namespace jax_attn_cpu

// What the CPU running the kernels offers, decided once per process at run time (the library is
// built with -march=native, so the instructions are there; these are the choices the build
// cannot make): whether software prefetches should go to L2, and whether the AMX tiles may be
// used (Linux hands out the tile state only on request).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#endif
#include <unistd.h>

namespace jax_attn_cpu {

// Intel cores put a PREFETCHNTA line in L1 only (not L2): a tile prefetched one tile ahead that
// outgrows L1 beside the tile being computed is evicted before it is read, and the kernel reads
// memory twice. On Sapphire Rapids (2-core VM, block 128, 32 x 1024 keys bf16) the decode took
// 17.0 ms with NTA and 5.9 ms with T1; AMD's NTA keeps lines in L2 and was faster there
// (NOTES.md). True on Intel: prefetch into L2 (PREFETCHT1).
inline bool prefetch_to_l2() {
  static const bool intel = [] {
#if defined(__x86_64__)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid(0, &a, &b, &c, &d) == 0) return false;
    char vendor[13] = {};
    std::memcpy(vendor, &b, 4);
    std::memcpy(vendor + 4, &d, 4);
    std::memcpy(vendor + 8, &c, 4);
    return std::strcmp(vendor, "GenuineIntel") == 0;
#else
    return false;
#endif
  }();
  return intel;
}

// The largest next tile (its keys and values together, bytes) that decode prefetches with NTA
// rather than into L2: 1.5x the L1d where the L1d holds 48 KiB or more (Zen 5), fitted there
// (block 128, 32 x 1024 keys, GQA 4: a 64 KiB bf16 tile ran faster with NTA; NOTES.md).
// 0 where it is smaller, and on Intel (prefetch_to_l2). On the 32 KiB L1d of Zen 4 every tile
// still under the old 48 KiB limit there (fp8's) ran faster into L2: vLLM's split layout
// (TORCH_SDPA) 1.28x at block 128 and 1.32x at block 16, from memory (1.03x with the cache
// resident), jax_attn's own 1.05x at block 16 and level at 128 (paired workers, 2026-12-06;
// on 12-04 the fp8 tile had run 10% faster NTA; the requests' pacing has changed since); a
// 64 KiB bf16 tile there ran 10-14% faster into L2. The L1d size from glibc (CPUID);
// 48 KiB where it gives none.
inline int64_t nta_limit_bytes() {
  static const int64_t limit = [] {
    if (prefetch_to_l2()) return int64_t{0};
    long l1d = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    if (l1d <= 0) l1d = 48 * 1024;
    return l1d < 48 * 1024 ? int64_t{0} : static_cast<int64_t>(l1d) * 3 / 2;
  }();
  return limit;
}

}  // namespace jax_attn_cpu

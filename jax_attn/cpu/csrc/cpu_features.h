// What the CPU running the kernels offers, decided once per process at run time (the library is
// built with -march=native, so the instructions are there; these are the choices the build
// cannot make): whether software prefetches should go to L2, and whether the AMX tiles may be
// used (Linux hands out the tile state only on request).
#pragma once

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

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

}  // namespace jax_attn_cpu

// What the built kernels run on this CPU, decided at run time (cpu_features.h, amx_tiles.h), for
// `jax_attn.cpu.isa()`, `jax-attn info` and the bench record: the instruction set of the bf16
// products (bf16 queries on a bf16 or fp8 cache) and where software prefetches go.
#include "amx_tiles.h"
#include "cpu_features.h"
#include "kernel_common.h"

extern "C" __attribute__((visibility("default"))) const char* jax_attn_cpu_isa() {
  using namespace jax_attn_cpu;
  const char* products = JAX_ATTN_AMX && amx_available() ? "amx-bf16"
#if defined(__AVX512BF16__) && JAX_ATTN_AVX512
                         : "avx512-bf16";
#elif JAX_ATTN_AVX512
                         : "avx512";
#else
                         : "portable";
#endif
  static const std::string text =
      std::string("bf16 products: ") + products + "; prefetch: " + (prefetch_to_l2() ? "L2" : "NTA");
  return text.c_str();
}

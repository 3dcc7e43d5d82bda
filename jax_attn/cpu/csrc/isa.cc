// What the built kernels run on this CPU, decided at run time (cpu_features.h, amx_tiles.h), for
// `jax_attn.cpu.isa()`, `jax-attn info` and the bench record: the instruction set of the bf16
// products (bf16 queries on a bf16 or fp8 cache), the vector code built, where software
// prefetches go, and which pages a large output goes on (output_memory.h).
#include "amx_tiles.h"
#include "cpu_features.h"
#include "kernel_common.h"
#include "output_memory.h"
#include "paged_decode.h"
#include "vec_avx2.h"

#include <cstring>
#include <string>

extern "C" __attribute__((visibility("default"))) const char* jax_attn_cpu_isa() {
  using namespace jax_attn_cpu;
  const char* products = JAX_ATTN_AMX && amx_available()
                             ? (JAX_ATTN_AMX_EMULATED ? "amx-bf16 (emulated)" : "amx-bf16")
#if defined(__AVX512BF16__) && JAX_ATTN_AVX512
                         : "avx512-bf16";
#elif JAX_ATTN_AVX512
                         : "avx512";
#elif JAX_ATTN_AVX2
                         : "avx2 (widened to float32)";
#else
                         : "portable";
#endif
  // The vector code the kernels were built with (an emulated-AMX build's products say "amx").
  const char* vectors =
#if JAX_ATTN_AVX512
      "avx512";
#elif JAX_ATTN_AVX2
      "avx2";
#else
      "portable";
#endif
  const int64_t nta = nta_limit_bytes();
  static const std::string text =
      std::string("bf16 products: ") + products + "; vectors: " + vectors + "; prefetch: " +
      (nta == 0 ? std::string("L2")
                : "NTA for tiles up to " + std::to_string(nta / 1024) + " KiB, else L2") +
      "; large outputs: " + huge_output_text();
  return text.c_str();
}

// Whether jax_attn.cpu.paged_decode runs a step of this kind on the AMX tiles here (dtypes by
// name, as dtype_name spells them; layout 0 token-major, 1 vLLM's split; `group` query heads
// per kv head): 1, else 0.
extern "C" __attribute__((visibility("default"))) int jax_attn_cpu_decode_on_amx(
    const char* cache_dtype, const char* query_dtype, int split_layout, int64_t block_size,
    int64_t group) {
  using namespace jax_attn_cpu;
  const auto parse = [](const char* name) {
    for (DType dt : {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3FN, DType::kF8E5M2}) {
      if (std::strcmp(name, dtype_name(dt)) == 0) return dt;
    }
    return DType::kOther;
  };
  return decode_on_amx(split_layout ? CacheLayout::kSplit : CacheLayout::kTokenMajor,
                       parse(cache_dtype), parse(query_dtype), block_size, group)
             ? 1
             : 0;
}

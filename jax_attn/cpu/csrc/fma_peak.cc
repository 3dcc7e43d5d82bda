// The machine's vector FMA peak, as the attention kernels can reach it: a tight loop of fused
// multiply-adds on independent register chains, `items` work items over `threads` workers of
// XLA's intra-op pool (the kernels' own `parallel_for`, items handed out one at a time, so a
// worker that starts late still takes its share). `jax-attn bench` reports compute-bound
// steps (prefill) against it, measured in the same run.
//
// Each item runs `iterations` steps of kChains independent chains x = x * m + c (m, c runtime
// values, so the compiler can neither fold nor shorten the loop): enough chains to cover the
// FMA latency times the FMA ports. Widths: 512-bit on AVX-512 builds, 256-bit with AVX2 + FMA,
// scalar otherwise. With m = 1 and c = 2^-k every step is exact (while the chain value fits
// 24 bits): every lane of every chain ends at exactly iterations * c, and the result's mean
// over all of them shows that every item ran every step.
//
// Output (float32 [5]): workers, items, FMAs per item per iteration (lanes x chains), vector
// width in bits, the mean final lane value over all chains and items.

#include <vector>

#include "attention_common.h"

#if !JAX_ATTN_AVX512 && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace jax_attn_cpu {
namespace {

constexpr int64_t kItemsPerWorker = 8;  // the default item count, per worker
// The chains' start value (0), read anew by every item: the compiler must not see that items
// compute the same thing and run the loop once for all of them.
volatile float kStart = 0.0f;

// One vector of float32 lanes and its FMA, at the widest width the build has.
#if JAX_ATTN_AVX512
using Vec = __m512;
constexpr int kBits = 512;
inline Vec splat(float v) { return _mm512_set1_ps(v); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
constexpr int kChains = 24;  // of AVX-512's 32 registers
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
constexpr int kBits = 256;
inline Vec splat(float v) { return _mm256_set1_ps(v); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
constexpr int kChains = 12;  // of AVX2's 16 registers (24 would spill)
#else
using Vec = float;
constexpr int kBits = 32;
inline Vec splat(float v) { return v; }
inline Vec fma(Vec a, Vec b, Vec c) { return std::fma(a, b, c); }
constexpr int kChains = 12;
#endif
constexpr int kLanes = kBits / 32;

// kChains chains of `iterations` FMAs each; returns the sum of all their final lanes.
double run_chains(int64_t iterations, float m, float c) {
  Vec x[kChains];
  const Vec vm = splat(m), vc = splat(c);
  for (Vec& v : x) v = splat(kStart);
  for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 24
    for (int i = 0; i < kChains; ++i) x[i] = fma(x[i], vm, vc);
  }
  double sum = 0.0;
  float lanes[kLanes];
  for (const Vec& v : x) {
    std::memcpy(lanes, &v, sizeof(lanes));
    for (float lane : lanes) sum += lane;
  }
  return sum;
}

ffi::Error FmaPeak(ffi::ThreadPool pool, ffi::Result<ffi::BufferR1<ffi::F32>> out,
                   int64_t iterations, int64_t items, int64_t threads, float multiplier,
                   float addend) {
  if (out->element_count() != 5) {
    return ffi::Error::InvalidArgument("output must be float32[5]");
  }
  if (iterations < 0) {
    return ffi::Error::InvalidArgument("iterations=" + std::to_string(iterations) +
                                       " must be >= 0");
  }
  int64_t workers = threads > 0 ? threads : num_workers(pool);
  if (items <= 0) items = kItemsPerWorker * workers;
  workers = std::min(workers, items);
  std::vector<double> sums(static_cast<size_t>(items), 0.0);
  parallel_for(pool, items, workers,
               [&](int64_t i) { sums[i] = run_chains(iterations, multiplier, addend); });
  double total = 0.0;
  for (double s : sums) total += s;
  float* o = out->typed_data();
  o[0] = static_cast<float>(workers);
  o[1] = static_cast<float>(items);
  o[2] = static_cast<float>(kLanes * kChains);
  o[3] = static_cast<float>(kBits);
  o[4] = static_cast<float>(total / static_cast<double>(items * kLanes * kChains));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_attn_cpu

// No operands; attributes: iterations (per item), items (0: 8 per worker), threads (0: as the
// kernels choose), multiplier and addend of the chains. Result: float32 [5] (see the top).
JAX_ATTN_EXPORT_HANDLER(jax_attn_cpu_fma_peak);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_attn_cpu_fma_peak, jax_attn_cpu::FmaPeak,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Ret<xla::ffi::BufferR1<xla::ffi::F32>>()  // output
                                  .Attr<int64_t>("iterations")
                                  .Attr<int64_t>("items")
                                  .Attr<int64_t>("threads")
                                  .Attr<float>("multiplier")
                                  .Attr<float>("addend"));

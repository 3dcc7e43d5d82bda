// The machine's AMX tile peak, as the ragged kernel's bf16 products can reach it (amx_tiles.h):
// bf16 tile dot products (TDPBF16PS) back to back, `items` work items over `threads` workers of
// XLA's intra-op pool (the kernels' own `parallel_for`, as csrc/fma_peak.cc runs its FMA
// chains). `jax-attn bench` reports the bf16 prefill against it, measured in the same run.
//
// Each item configures the tiles (TileScope), loads A (tiles 4, 5: 16 x 32 bf16, every element
// a) and B (tiles 6, 7: 16 x 16 bf16 pairs, every element b) once from memory, then runs
// `iterations` steps of kChains tile products into independent accumulators C 0-3
// (C[2i + j] += A[4 + i] B[6 + j]): enough of them to cover the product's latency with its
// throughput (one per 16 cycles on Sapphire Rapids). Each product adds 32 a b to every element
// of its C (16 x 16 x 32 multiply-adds, 16384 flops); with a = 1 and b = 2^-k every sum is exact
// (while C fits 24 bits), so every element ends at exactly iterations * 32 a b and the result's
// mean over all of them shows that every item ran every product.
//
// In a build with emulated tiles (amx_tiles.h, a test build) the probe runs them in software:
// its exact sums then check the emulation, and its GFLOP/s are no peak.
//
// Where the tiles cannot run (a build without AMX-BF16, a CPU without it, Linux refusing the
// tile state, $JAX_ATTN_CPU_AMX=0) the handler returns an error naming why, and
// `jax_attn_cpu_amx_unavailable()` says the same without a call (what `amx_peak.available()`
// reads): never a tile instruction, which would die with SIGILL.
//
// Output (float32 [5]): workers, items, tile products per item per iteration (kChains), flops
// per tile product, the mean final element over all C tiles and items.

#include <string>
#include <vector>

#include "amx_tiles.h"
#include "attention_common.h"

namespace jax_attn_cpu {
namespace {

constexpr int64_t kItemsPerWorker = 8;  // the default item count, per worker
constexpr int kChains = 4;              // C tiles 0-3, of the 8 (A 4-5, B 6-7)
constexpr int64_t kFlopsPerProduct = 2 * 16 * 16 * 32;

// Why the tiles cannot run here; empty when they can.
std::string amx_unavailable_reason() {
#if JAX_ATTN_AMX
  if (amx_available()) return "";
  const char* env = std::getenv("JAX_ATTN_CPU_AMX");
  // (emulated tiles are off only by that variable)
  if (JAX_ATTN_AMX_EMULATED || (env != nullptr && std::strcmp(env, "0") == 0)) {
    return "turned off by JAX_ATTN_CPU_AMX=0";
  }
#if !JAX_ATTN_AMX_EMULATED
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0 || (d & (1u << 24)) == 0 ||
      (d & (1u << 22)) == 0) {
    return "this CPU has no AMX-TILE / AMX-BF16 (CPUID leaf 7)";
  }
  return "Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA)";
#endif
#else
  return "the kernels were built without AMX-BF16 (the compiler flags give no "
         "-mamx-tile -mamx-bf16 -mavx512bf16, e.g. -march=x86-64-v3)";
#endif
}

// The bf16 bit pattern of `v`, or -1 where v is not exactly a bf16 (its low 16 bits set).
int32_t bf16_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return (bits & 0xFFFFu) == 0 ? static_cast<int32_t>(bits >> 16) : -1;
}

#if JAX_ATTN_AMX

// One item: kChains independent accumulators, `iterations` products each; returns the sum of
// every element of every C tile.
double run_tiles(int64_t iterations, uint16_t a, uint16_t b) {
  alignas(64) uint16_t A[16][32], B[16][32];  // A: [16 rows][32 k]; B: [16 k-pairs][16 n x 2]
  alignas(64) float C[kChains][16][16];
  for (int r = 0; r < 16; ++r) {
    for (int k = 0; k < 32; ++k) A[r][k] = a, B[r][k] = b;
  }
  TileScope tiles;
  JAX_ATTN_TILE_LOAD(4, A, 64);
  JAX_ATTN_TILE_LOAD(5, A, 64);
  JAX_ATTN_TILE_LOAD(6, B, 64);
  JAX_ATTN_TILE_LOAD(7, B, 64);
  JAX_ATTN_TILE_ZERO(0);
  JAX_ATTN_TILE_ZERO(1);
  JAX_ATTN_TILE_ZERO(2);
  JAX_ATTN_TILE_ZERO(3);
  for (int64_t it = 0; it < iterations; ++it) {
    JAX_ATTN_TILE_DPBF16PS(0, 4, 6);
    JAX_ATTN_TILE_DPBF16PS(1, 4, 7);
    JAX_ATTN_TILE_DPBF16PS(2, 5, 6);
    JAX_ATTN_TILE_DPBF16PS(3, 5, 7);
  }
  JAX_ATTN_TILE_STORE(0, C[0], 64);
  JAX_ATTN_TILE_STORE(1, C[1], 64);
  JAX_ATTN_TILE_STORE(2, C[2], 64);
  JAX_ATTN_TILE_STORE(3, C[3], 64);
  double sum = 0.0;
  for (const auto& tile : C) {
    for (const auto& row : tile) {
      for (float v : row) sum += v;
    }
  }
  return sum;
}

#endif  // JAX_ATTN_AMX

ffi::Error AmxPeak(ffi::ThreadPool pool, ffi::Result<ffi::BufferR1<ffi::F32>> out,
                   int64_t iterations, int64_t items, int64_t threads, float a, float b) {
  if (out->element_count() != 5) {
    return ffi::Error::InvalidArgument("output must be float32[5]");
  }
  if (iterations < 0) {
    return ffi::Error::InvalidArgument("iterations=" + std::to_string(iterations) +
                                       " must be >= 0");
  }
  const int32_t a_bits = bf16_bits(a), b_bits = bf16_bits(b);
  if (a_bits < 0 || b_bits < 0) {
    return ffi::Error::InvalidArgument("a=" + std::to_string(a) + " and b=" + std::to_string(b) +
                                       " must both be exact bf16 values");
  }
  const std::string reason = amx_unavailable_reason();
  if (!reason.empty()) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented, "AMX peak: " + reason);
  }
  int64_t workers = threads > 0 ? threads : num_workers(pool);
  if (items <= 0) items = kItemsPerWorker * workers;
  workers = std::min(workers, items);
  std::vector<double> sums(static_cast<size_t>(items), 0.0);
#if JAX_ATTN_AMX
  parallel_for(pool, items, workers, [&](int64_t i) {
    sums[i] = run_tiles(iterations, static_cast<uint16_t>(a_bits), static_cast<uint16_t>(b_bits));
  });
#endif
  double total = 0.0;
  for (double s : sums) total += s;
  float* o = out->typed_data();
  o[0] = static_cast<float>(workers);
  o[1] = static_cast<float>(items);
  o[2] = static_cast<float>(kChains);
  o[3] = static_cast<float>(kFlopsPerProduct);
  o[4] = static_cast<float>(total / static_cast<double>(items * kChains * 16 * 16));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_attn_cpu

// Why the AMX peak cannot run here (a one-line reason), or nullptr where it can.
extern "C" __attribute__((visibility("default"))) const char* jax_attn_cpu_amx_unavailable() {
  static const std::string reason = jax_attn_cpu::amx_unavailable_reason();
  return reason.empty() ? nullptr : reason.c_str();
}

// No operands; attributes: iterations (per item), items (0: 8 per worker), threads (0: as the
// kernels choose), a and b (every element of the A and B tiles, exact bf16 values). Result:
// float32 [5] (see the top).
JAX_ATTN_EXPORT_HANDLER(jax_attn_cpu_amx_peak);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_attn_cpu_amx_peak, jax_attn_cpu::AmxPeak,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Ret<xla::ffi::BufferR1<xla::ffi::F32>>()  // output
                                  .Attr<int64_t>("iterations")
                                  .Attr<int64_t>("items")
                                  .Attr<int64_t>("threads")
                                  .Attr<float>("a")
                                  .Attr<float>("b"));

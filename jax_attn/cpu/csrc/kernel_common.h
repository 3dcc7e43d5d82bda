// The framework-free core of the native CPU attention kernels: what the kernels share whether
// XLA (the FFI handlers, attention_common.h) or torch (torch_ops.cc) calls them.
//
// - Element types of the cache and the query (bf16, fp16, fp8 e4m3fn / e5m2) and their
//   widening to float32: `widen(x)` for one element, `load16<T>(ptr, mask)` for 16 elements
//   into an AVX-512 register (bf16 -> f32 by a 16-bit shift; fp8 through the fp16 converter);
//   `DType` names them at run time.
// - `narrow<T>(float)`: the output store (round to nearest even).
// - `exp16`, `tanh16`: vector exp / tanh accurate to a few ulp in float32; `exp2_bf16_16`, a
//   cheaper 2^y for probabilities rounded to bf16 next.
// - `OnlineSoftmaxRow`: the running max / sum of one query row (flash-attention's state),
//   and `merge_partial` for split-K partials.
// - Logit helpers: `soft_cap`, ALiBi distance, `visible_keys` (the causal + sliding-window
//   key range of a query position).
// - `Workers`: the threads a kernel runs its items on, provided by the caller (XLA's intra-op
//   pool, or torch's); `run_items` hands items out one at a time.
// - `round_up`, `Scratch`: a thread's scratch memory, grown on demand.
//
// Everything lives in namespace jax_attn_cpu. No XLA or torch header is included here.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <type_traits>

#if defined(__linux__)
#include <sched.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define JAX_ATTN_AVX512 1
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
// GCC 12 warns about the deliberately undefined pass-through operand inside its own
// AVX-512 intrinsics (GCC bug 105593, fixed in 13): a false positive in the system header,
// reported as "maybe" or, depending on inlining, as certain.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#else
#define JAX_ATTN_AVX512 0
#endif

namespace jax_attn_cpu {

// Element types the kernels take, named at run time (each front end maps its own dtype enum).
enum class DType { kF32, kBF16, kF16, kF8E4M3FN, kF8E5M2, kOther };

inline const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
    case DType::kF8E4M3FN: return "float8_e4m3fn";
    case DType::kF8E5M2: return "float8_e5m2";
    default: return "unsupported";
  }
}

inline int64_t element_bytes(DType dt) {
  switch (dt) {
    case DType::kF32: return 4;
    case DType::kBF16:
    case DType::kF16: return 2;
    default: return 1;
  }
}

// Largest head size the ragged kernel takes (its loops run over the row at run time; vLLM's
// CPU_ATTN takes 512, hence the V1 plugin's need).
constexpr int64_t kMaxHeadSize = 512;
// Largest head size the decode kernel takes (its vector code is instantiated per number of
// 16-float chunks, 1 to 16). The ragged kernel keeps decodes of larger heads in its own tiles.
constexpr int64_t kMaxDecodeHeadSize = 256;

// ---------------------------------------------------------------------------------------------
// Element types: storage wrappers, one byte pattern each, no arithmetic.
// ---------------------------------------------------------------------------------------------
struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};
struct e4m3_t {  // float8_e4m3fn: bias 7, no infinities, 0x7f / 0xff are NaN
  uint8_t bits;
};
struct e5m2_t {  // float8_e5m2: the high byte of an IEEE fp16
  uint8_t bits;
};

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// IEEE fp16 bits -> float, exact, independent of the FPU's denormal flags.
inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (mant << 13));  // inf / nan
  if (exp != 0) return bits_to_float(sign | ((exp + 112) << 23) | (mant << 13));
  const float mag = static_cast<float>(mant) * (1.0f / 16777216.0f);  // mant * 2^-24, exact
  return sign ? -mag : mag;
}

// float -> IEEE fp16 bits, round to nearest even, overflow to inf, NaN kept NaN.
inline uint16_t float_to_half_bits(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) return sign | (abs > 0x7f800000u ? 0x7e00u : 0x7c00u);
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {                        // below 2^-14: fp16 subnormal or zero
    // Scale into the subnormal grid (2^-24 units) and round to nearest even in float.
    const float mag = bits_to_float(abs) * 16777216.0f;
    const float r = std::nearbyint(mag);  // default rounding mode: nearest even
    return sign | static_cast<uint16_t>(r);
  }
  const uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);  // round to nearest even
  return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);
}

inline float widen(float x) { return x; }
inline float widen(bf16_t x) { return bits_to_float(static_cast<uint32_t>(x.bits) << 16); }
inline float widen(f16_t x) { return half_bits_to_float(x.bits); }
inline float widen(e5m2_t x) { return half_bits_to_float(static_cast<uint16_t>(x.bits << 8)); }
inline float widen(e4m3_t x) {
  const uint32_t b = x.bits;
  if ((b & 0x7fu) == 0x7fu) return std::numeric_limits<float>::quiet_NaN();
  // As fp16: sign to bit 15, exponent+mantissa to bits 13..7; the value is then 2^-8 of
  // the e4m3 value (bias 15 vs 7), subnormals included.
  const uint16_t h = static_cast<uint16_t>(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));
  return half_bits_to_float(h) * 256.0f;
}

template <typename T>
inline T narrow(float x);
template <>
inline float narrow<float>(float x) {
  return x;
}
template <>
inline bf16_t narrow<bf16_t>(float x) {
  const uint32_t u = float_to_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{static_cast<uint16_t>((u >> 16) | 0x40u)};
  return bf16_t{static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
template <>
inline f16_t narrow<f16_t>(float x) {
  return f16_t{float_to_half_bits(x)};
}

// ---------------------------------------------------------------------------------------------
// Logit helpers (scalar; the vector kernels use the same formulas).
// ---------------------------------------------------------------------------------------------

// `cap * tanh(x / cap)`; cap <= 0 means no soft cap.
inline float soft_cap(float x, float cap) { return cap > 0.0f ? cap * std::tanh(x / cap) : x; }

// tanh on |x| < kTanhSmall, for the vector kernels: x + x^3 P(x^2), P of degree 4 (a weighted
// least-squares fit of (tanh(x) - x) / x^3 toward minimax relative error, done for this file):
// relative error 8.7e-8 (1.5 ulp) in float32. Above it, 1 - 2 / (exp(2|x|) + 1) keeps ~2e-7
// relative. That formula alone near 0 is exact only to ~1e-7 absolute, which a soft cap turns
// into cap x 1e-7 of every logit (5.5e-6 off the float64 oracle against XLA's 1.5e-6, cap 30,
// float32): logits well inside the cap are where attention's weight is.
constexpr float kTanhSmall = 0.625f;
constexpr float kTanhPoly[5] = {-3.33332977e-1f, 1.33318516e-1f, -5.37733603e-2f,
                                2.07485859e-2f, -5.82784110e-3f};

// ALiBi term for query position q_pos and key position k_pos: slope * (k_pos - q_pos).
inline float alibi_bias(float slope, int64_t k_pos, int64_t q_pos) {
  return slope * static_cast<float>(k_pos - q_pos);
}

// Keys a query at q_pos sees, as the half-open position range [begin, end): causal
// (k_pos <= q_pos), inside the sequence (k_pos < seq_len), inside the sliding window
// (q_pos - k_pos < window; window <= 0 means none). Empty when begin >= end.
struct KeyRange {
  int64_t begin, end;
};
inline KeyRange visible_keys(int64_t q_pos, int64_t seq_len, int64_t window, bool causal = true) {
  int64_t end = causal ? std::min(q_pos + 1, seq_len) : seq_len;
  int64_t begin = window > 0 ? std::max<int64_t>(0, q_pos - window + 1) : 0;
  return KeyRange{begin, std::max(begin, end)};
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// A float scratch array of its own thread, grown on demand and reused across calls (64-byte
// aligned; zeroed when it grows, so a kernel may rely on padding it never writes being zero).
// Each kernel keeps its own `thread_local` ones.
struct Scratch {
  float* data = nullptr;
  size_t size = 0;
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { std::free(data); }
  float* get(size_t floats) {
    if (floats > size) {
      std::free(data);
      size = static_cast<size_t>(round_up(static_cast<int64_t>(floats), 1024));
      data = static_cast<float*>(std::aligned_alloc(64, size * sizeof(float)));
      if (data == nullptr) throw std::bad_alloc();
      std::memset(data, 0, size * sizeof(float));
    }
    return data;
  }
};

// ---------------------------------------------------------------------------------------------
// Attention sinks (gpt-oss; vLLM's `sinks`): one learned logit per query head that joins the
// softmax of each of the head's rows as a key with no value. Only the denominator changes:
// out = sum_j exp(l_j - m) v_j / (sum_j exp(l_j - m) + exp(sink - m)), for the row's running
// max m (natural-log logits). `sink` nullptr: none (share 0). A row with no visible key keeps
// zeros (its sum is 0 and is tested first); a sink far above m drives the row to zeros.
// ---------------------------------------------------------------------------------------------
inline float sink_share(const float* sink, float max) {
  return sink == nullptr ? 0.0f : std::exp(*sink - max);
}

// ---------------------------------------------------------------------------------------------
// Online softmax: the running state of one query row over chunks of keys. The accumulator
// (sum of p * v, D floats) lives with the caller; `rescale` says what to multiply it by.
// ---------------------------------------------------------------------------------------------
struct OnlineSoftmaxRow {
  float max = -std::numeric_limits<float>::infinity();
  float sum = 0.0f;

  // Take a chunk whose largest logit is chunk_max; returns the factor exp(old_max - new_max)
  // the accumulator must be multiplied by before adding this chunk's p * v, and sets `max`.
  // Probabilities of the chunk are then exp(logit - max). Call add_sum with their total.
  float rescale(float chunk_max) {
    const float new_max = std::max(max, chunk_max);
    const float factor = (max == new_max) ? 1.0f : std::exp(max - new_max);  // -inf -> 0
    max = new_max;
    sum *= factor;
    return factor;
  }
  void add_sum(float chunk_sum) { sum += chunk_sum; }
  // 1 / sum, or 0 for a row that saw no key (all masked): its output is zeros, never NaN.
  // With an attention sink (`sink`: its logit, or nullptr for none), 1 / (sum + exp(sink -
  // max)): see sink_share.
  float inverse_sum(const float* sink = nullptr) const {
    return sum > 0.0f ? 1.0f / (sum + sink_share(sink, max)) : 0.0f;
  }
};

// Merge split-K partials of one row: (max_i, sum_i, acc_i[D]) -> acc[D] / sum, times `out_scale`.
// acc_i are unnormalized (sum of exp(logit - max_i) * v). Rows with no key anywhere give zeros.
// `sink`: the row's attention sink (sink_share), or nullptr; counted once, here.
inline void merge_partials(int num_parts, const float* maxes, const float* sums,
                           const float* const* accs, int head_size, float out_scale,
                           float* out, const float* sink = nullptr) {
  float m = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < num_parts; ++i) m = std::max(m, maxes[i]);
  for (int d = 0; d < head_size; ++d) out[d] = 0.0f;
  if (m == -std::numeric_limits<float>::infinity()) return;
  float total = 0.0f;
  for (int i = 0; i < num_parts; ++i) {
    if (sums[i] <= 0.0f) continue;  // a part that saw no key adds nothing (and is never read)
    const float w = std::exp(maxes[i] - m);
    total += sums[i] * w;
    for (int d = 0; d < head_size; ++d) out[d] += w * accs[i][d];
  }
  const float inv = total > 0.0f ? out_scale / (total + sink_share(sink, m)) : 0.0f;
  for (int d = 0; d < head_size; ++d) out[d] *= inv;
}

// ---------------------------------------------------------------------------------------------
// Threads.
// ---------------------------------------------------------------------------------------------

// The threads a kernel may use, provided by its caller: `parallel_for(self, n, count, item,
// item_ctx)` calls item(item_ctx, i) once for every i in [0, n) on up to `count` threads (the
// calling thread included) and returns when all n calls have returned.
struct Workers {
  int64_t count = 1;
  void (*parallel_for)(void* self, int64_t n, int64_t count, void (*item)(void*, int64_t),
                       void* item_ctx) = nullptr;
  void* self = nullptr;
};

// The CPUs the workers of one parallel call run on. Linux places a woken pool thread on its
// waker's CPU when every CPU is busy (wake-affine), and with another process holding the other
// core, both of a call's workers can then share one CPU for the whole call: 2 workers, a
// spinner and 2 cores gave the call one core instead of its fair 1.5 (a quarter of the samples
// saw both on one CPU; NOTES.md). The load balancer leaves that alone, since moving either
// thread leaves two on one CPU. So each worker, as it starts its share, notes its CPU; a worker
// that finds an earlier one of the same call there moves itself to a CPU none of them holds
// (its affinity narrowed for the move, then restored as it was: a thread bound to one CPU, as
// OMP_PROC_BIND or vLLM's thread binding does, stays where it is). Elsewhere nothing happens.
class WorkerCpus {
 public:
  WorkerCpus() {
    for (auto& c : cpu_) c.store(-1, std::memory_order_relaxed);
  }
  // Called by each worker as it starts its share of the call.
  void settle() {
#if defined(__linux__)
    const int here = sched_getcpu();
    const int slot = count_.fetch_add(1, std::memory_order_acq_rel);
    if (here < 0 || here >= CPU_SETSIZE || slot >= kSlots) return;
    cpu_[slot].store(here, std::memory_order_release);
    bool taken = false;
    for (int j = 0; j < slot; ++j) taken = taken || cpu_[j].load(std::memory_order_acquire) == here;
    if (!taken) return;
    cpu_set_t allowed, free;
    if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return;
    free = allowed;
    const int workers = std::min(count_.load(std::memory_order_acquire), kSlots);
    for (int j = 0; j < workers; ++j) {
      const int c = cpu_[j].load(std::memory_order_acquire);
      if (j != slot && c >= 0) CPU_CLR(c, &free);
    }
    if (CPU_COUNT(&free) == 0 || sched_setaffinity(0, sizeof(free), &free) != 0) return;
    cpu_[slot].store(sched_getcpu(), std::memory_order_release);
    sched_setaffinity(0, sizeof(allowed), &allowed);
#endif
  }

 private:
  static constexpr int kSlots = 64;
  std::atomic<int> count_{0};
  std::array<std::atomic<int>, kSlots> cpu_;
};

// One worker's share of a parallel call, the same loop on XLA's pool and torch's: settle onto a
// CPU of its own (when items are left), then take items [0, n) from `next` one at a time,
// fn(i) each, until none is left. Returns how many it ran.
template <typename F>
int64_t take_items(std::atomic<int64_t>& next, int64_t n, WorkerCpus& cpus, F&& fn) {
  if (next.load(std::memory_order_relaxed) < n) cpus.settle();
  int64_t ran = 0;
  for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n; ++ran) fn(i);
  return ran;
}

// $JAX_ATTN_CPU_THREADS if set (>= 1), else `available` (at least 1).
inline int64_t worker_count(int64_t available) {
  if (const char* env = std::getenv("JAX_ATTN_CPU_THREADS")) {
    const long v = std::strtol(env, nullptr, 10);
    if (v >= 1) return v;
  }
  return std::max<int64_t>(1, available);
}

// fn(i) for i in [0, n) on up to `count` of the workers' threads (inline when that is one).
template <typename F>
void run_items(const Workers& workers, int64_t n, int64_t count, F&& fn) {
  if (n <= 0) return;
  count = std::min(count, n);
  if (count <= 1 || workers.parallel_for == nullptr) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  using Fn = std::remove_reference_t<F>;
  workers.parallel_for(
      workers.self, n, count, [](void* ctx, int64_t i) { (*static_cast<Fn*>(ctx))(i); }, &fn);
}

// fn(i) for i in [0, n) on the workers (inline when there is one worker or one item).
template <typename F>
void run_items(const Workers& workers, int64_t n, F&& fn) {
  if (n <= 0) return;
  if (workers.count <= 1 || n == 1 || workers.parallel_for == nullptr) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  using Fn = std::remove_reference_t<F>;
  workers.parallel_for(
      workers.self, n, std::min(workers.count, n),
      [](void* ctx, int64_t i) { (*static_cast<Fn*>(ctx))(i); }, &fn);
}

// ---------------------------------------------------------------------------------------------
// AVX-512 vector helpers (16 floats per register).
// ---------------------------------------------------------------------------------------------
#if JAX_ATTN_AVX512

// The vpermt2w index that interleaves two rows' 32 bf16 elements a, b into pairs: words 2i and
// 2i + 1 of the result are a[i] and b[i] for i < 16 (hi: a[16 + i] and b[16 + i]). The p.v of
// the vdpbf16ps paths takes two keys' values as such (a, b) words.
inline __m512i pair_index(bool hi) {
  alignas(64) static constexpr auto kIndex = [] {
    std::array<uint16_t, 64> idx{};
    for (int i = 0; i < 32; ++i) {
      idx[2 * i] = static_cast<uint16_t>(i);  // a[i]: table words 0..31
      idx[2 * i + 1] = static_cast<uint16_t>(32 + i);  // b[i]: 32..63
    }
    return idx;
  }();
  return _mm512_load_si512(kIndex.data() + (hi ? 32 : 0));
}

// Pins v to a register at this point. GCC folds a vector that several FMAs read into each of
// them as a memory operand: one load per FMA where one load would do, and at 512 bits the loads,
// not the FMAs, then set the pace (float32 decode at GQA 8, Zen 4: 20 loads per 16 FMAs).
__attribute__((always_inline)) inline void pin_register(__m512& v) { __asm__("" : "+v"(v)); }

inline __mmask16 tail_mask(int64_t n) {  // lanes [0, n) of 16
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
}

// 16 elements widened to float32, per element type: `masked` reads lanes in `m` (the others
// read nothing and are 0), `whole` reads all 16. A mask that unrolling makes all ones is no
// substitute for `whole`: GCC 12 compiled such masked loads into a load plus a dead store of
// the register to the stack (float32 decode, attend_tile_rows at D 128: one per key and value
// chunk, GQA 7-8 1.06-1.09x slower; NOTES.md).
template <typename T>
struct Load16;
template <>
struct Load16<float> {
  static __m512 masked(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
  static __m512 whole(const float* p) { return _mm512_loadu_ps(p); }
};
template <>
struct Load16<bf16_t> {
  static __m512 widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static __m512 masked(const bf16_t* p, __mmask16 m) {
    return widen(_mm256_maskz_loadu_epi16(m, p));
  }
  static __m512 whole(const bf16_t* p) {
    return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
};
template <>
struct Load16<f16_t> {
  static __m512 masked(const f16_t* p, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
  }
  static __m512 whole(const f16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
};
template <>
struct Load16<e5m2_t> {
  static __m512 widen(__m128i b) {
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
  }
  static __m512 masked(const e5m2_t* p, __mmask16 m) { return widen(_mm_maskz_loadu_epi8(m, p)); }
  static __m512 whole(const e5m2_t* p) {
    return widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
};
template <>
struct Load16<e4m3_t> {
  static __m512 widen(__m128i b) {
    const __m256i w = _mm256_cvtepu8_epi16(b);
    const __m256i mag = _mm256_and_si256(w, _mm256_set1_epi16(0x7f));
    // fp16 bits: sign to bit 15, exponent+mantissa to bits 13..7 (see widen(e4m3_t)).
    const __m256i h =
        _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                        _mm256_slli_epi16(mag, 7));
    const __m512 f = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(mag, _mm256_set1_epi16(0x7f));
    return _mm512_mask_blend_ps(nan, f, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
  }
  static __m512 masked(const e4m3_t* p, __mmask16 m) { return widen(_mm_maskz_loadu_epi8(m, p)); }
  static __m512 whole(const e4m3_t* p) {
    return widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
};
template <typename T>
inline __m512 load16(const T* p, __mmask16 m) {
  return Load16<T>::masked(p, m);
}
template <typename T>
inline __m512 load16(const T* p) {
  return Load16<T>::whole(p);
}

// Chunk c of a row of NC 16-element chunks: the last under last_mask, the others whole.
template <typename T, int NC>
__attribute__((always_inline)) inline __m512 load_chunk(const T* row, int c, __mmask16 last_mask) {
  return c == NC - 1 ? load16<T>(row + 16 * c, last_mask) : load16<T>(row + 16 * c);
}

// exp(x) in float32, ~1-2 ulp over the normal range; exp(-inf) = 0, large x -> inf.
inline __m512 exp16(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f);
  const __m512 ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
  r = _mm512_fnmadd_ps(n, ln2_lo, r);
  // exp(r) on |r| <= ln2/2: degree-6 polynomial (Cephes expf coefficients).
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 r2 = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);  // p * 2^n, underflows to 0 cleanly
}

// 2^y for probabilities that are rounded to bf16 next (relative step 2^-8): a degree-3 fit on
// [-1/2, 1/2], relative error 7.5e-5, two FMAs fewer than a float32-accurate one. The caller
// sums the same values it rounds, so only the rounding tells numerator and denominator apart.
// y = -1e30 gives exactly 0; y must not be -inf or NaN (r would be NaN).
inline __m512 exp2_bf16_16(__m512 y) {
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(5.5171650e-2f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4261114e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9326097e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.9992806e-1f));
  return _mm512_scalef_ps(p, n);
}

// tanh(x) = sign(x) * tanh(|x|): the polynomial below kTanhSmall, else
// 1 - 2 / (exp(2|x|) + 1); relative error ~2e-7 everywhere. Logits well inside a soft cap are
// all small: the exp and the division only run for a vector with a lane at or past kTanhSmall.
inline __m512 tanh16(__m512 x) {
  const __m512 ax = _mm512_abs_ps(x);
  const __m512 z = _mm512_mul_ps(ax, ax);
  __m512 poly = _mm512_set1_ps(kTanhPoly[4]);
  for (int k = 3; k >= 0; --k) poly = _mm512_fmadd_ps(poly, z, _mm512_set1_ps(kTanhPoly[k]));
  __m512 t = _mm512_fmadd_ps(_mm512_mul_ps(ax, z), poly, ax);
  const __mmask16 small = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(kTanhSmall), _CMP_LT_OQ);
  if (small != 0xFFFF) {  // (NaN lanes are not small: they take exp's NaN)
    const __m512 e = exp16(_mm512_add_ps(ax, ax));
    const __m512 large = _mm512_sub_ps(
        _mm512_set1_ps(1.0f),
        _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
    t = _mm512_mask_blend_ps(small, large, t);
  }
  // copy the sign of x
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign));
}

// cap * tanh(x / cap), vectorized; cap > 0.
inline __m512 soft_cap16(__m512 x, float cap) {
  return _mm512_mul_ps(_mm512_set1_ps(cap), tanh16(_mm512_mul_ps(x, _mm512_set1_ps(1.0f / cap))));
}

// Sums of 16 vectors as one vector: result lane t = horizontal sum of a[t].
// A transpose-and-add tree: 15 adds and 30 shuffles instead of 16 separate reductions.
inline __m512 transpose_sum16(const __m512* a) {
  // Feed order such that the tree's output lands in lane order: the tree leaves
  // sum(a'[k + 4j]) in lane 4k + j, so a'[m] = a[4 * (m % 4) + m / 4].
  __m512 x[8];
  for (int i = 0; i < 8; ++i) {
    const int m0 = 2 * i, m1 = 2 * i + 1;
    const __m512 a0 = a[4 * (m0 % 4) + m0 / 4], a1 = a[4 * (m1 % 4) + m1 / 4];
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xee));
  }
  __m512 y[4];
  for (int i = 0; i < 4; ++i) {
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xdd));
  }
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x44), _mm512_shuffle_ps(y[0], y[1], 0xee));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_ps(y[2], y[3], 0x44), _mm512_shuffle_ps(y[2], y[3], 0xee));
  return _mm512_add_ps(_mm512_shuffle_ps(z0, z1, 0x88), _mm512_shuffle_ps(z0, z1, 0xdd));
}

// In-register transpose of a 16 x 16 float block: on return r[c] lane i holds what r[i] lane c
// held on entry.
inline void transpose16x16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int g = 0; g < 4; ++g) {  // rows 4g .. 4g+3
    const __m512 lo01 = _mm512_unpacklo_ps(r[4 * g], r[4 * g + 1]);
    const __m512 hi01 = _mm512_unpackhi_ps(r[4 * g], r[4 * g + 1]);
    const __m512 lo23 = _mm512_unpacklo_ps(r[4 * g + 2], r[4 * g + 3]);
    const __m512 hi23 = _mm512_unpackhi_ps(r[4 * g + 2], r[4 * g + 3]);
    // u[4g + m], 128-bit lane L: element 4L + m of rows 4g .. 4g+3.
    u[4 * g + 0] = _mm512_shuffle_ps(lo01, lo23, 0x44);
    u[4 * g + 1] = _mm512_shuffle_ps(lo01, lo23, 0xee);
    u[4 * g + 2] = _mm512_shuffle_ps(hi01, hi23, 0x44);
    u[4 * g + 3] = _mm512_shuffle_ps(hi01, hi23, 0xee);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512 a_even = _mm512_shuffle_f32x4(u[m], u[4 + m], 0x88);
    const __m512 a_odd = _mm512_shuffle_f32x4(u[m], u[4 + m], 0xdd);
    const __m512 b_even = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0x88);
    const __m512 b_odd = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0xdd);
    t[m] = _mm512_shuffle_f32x4(a_even, b_even, 0x88);       // column m      (lane 0)
    t[8 + m] = _mm512_shuffle_f32x4(a_even, b_even, 0xdd);   // column 8 + m  (lane 2)
    t[4 + m] = _mm512_shuffle_f32x4(a_odd, b_odd, 0x88);     // column 4 + m  (lane 1)
    t[12 + m] = _mm512_shuffle_f32x4(a_odd, b_odd, 0xdd);    // column 12 + m (lane 3)
  }
  for (int c = 0; c < 16; ++c) r[c] = t[c];
}

#endif  // JAX_ATTN_AVX512

}  // namespace jax_attn_cpu

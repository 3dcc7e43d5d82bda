// Part of the ragged kernel (ragged_paged_attention.cc), not a header of its own: included by
// that file inside its namespaces (jax_attn_cpu and the anonymous one), after its constants,
// WarmLines and JAX_ATTN_HOT, which it uses (kKeys in the static_assert below). It includes
// nothing itself.
//
// The vector type and the float32 inner products of every build:
// - `Vec` (V, W) with `widen_row`: AVX-512, 16 floats, where JAX_ATTN_AVX512 (kernel_common.h:
//   built with AVX-512F/BW/VL), else GCC vectors of 8 floats (AVX2 + FMA on such machines);
// - the register blocking of both products (kQkKeys1, kQkKeys2, kPvRows, kPvVecs);
// - the FMA products, on Vec: qk_block<RV, KB> (S^T = K Q^T for RV row vectors x KB keys, with
//   block_max, the step's row max) and pv_block<R, DV> (O = alpha O + P V for R rows x DV
//   vectors, the last step's normalized rows straight to the output).
// The interface the kernel calls: Vec throughout (the softmax, the query transpose); widen_row
// (run_item, a cache row to float32); qk_block from head_logits, pv_block from pv_call; and
// block_max from ragged_bf16.h's qk_block_bf16.
#pragma once

// ---------------------------------------------------------------------------------------------
// Vector type: AVX-512 (16 floats) when built for it, else GCC vectors of 8 floats: AVX2 + FMA
// (with vec_avx2.h's exp2 and soft cap) on such machines, plain SSE or scalar code elsewhere.
// ---------------------------------------------------------------------------------------------
#if JAX_ATTN_AVX512
struct Vec {
  using T = __m512;
  static constexpr int W = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  // A streaming (non-temporal) store: p 64-byte aligned; stream_fence() before others read it.
  static void stream(float* p, T v) { _mm512_stream_ps(p, v); }
  static void stream_fence() { _mm_sfence(); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T fmsub(T a, T b, T c) { return _mm512_fmsub_ps(a, b, c); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  // 2^x for x <= 0 (logits live in base 2 here); x = -1e30 (masked) gives exactly 0.
  // Degree-5 fit on [-1/2, 1/2], relative error 2.4e-7 in float32.
  static T exp2(T x) {
    const T n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const T r = _mm512_sub_ps(x, n);
    T p = _mm512_set1_ps(1.327647129e-3f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.675540961e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.550713092e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.402212024e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.931469440e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.000000119f));
    return _mm512_scalef_ps(p, n);
  }
  // exp2 for probabilities that are rounded to bf16 next (kernel_common.h's exp2_bf16_16: a
  // degree-3 fit, relative error 7.5e-5). Numerator and denominator take the same values, so
  // only the bf16 rounding of the numerator's copy tells them apart.
  static T exp2_bf16(T x) { return exp2_bf16_16(x); }
  static T soft_cap(T x, float cap) { return soft_cap16(x, cap); }
  // a <= b ? x : y, a < b ? x : y
  static void pin(T&) {}  // (see the 8-float Vec's)
  static T if_le(T a, T b, T x, T y) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LE_OQ), y, x);
  }
  static T if_lt(T a, T b, T x, T y) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), y, x);
  }
};

// One row of D cache elements widened to float32 into dst[0, Dp) (lanes D..Dp zero).
template <typename CT>
inline void widen_row(const CT* src, float* dst, int64_t D, int64_t Dp) {
  for (int64_t d = 0; d < Dp; d += 16) {
    _mm512_storeu_ps(dst + d, load16<CT>(src + d, tail_mask(D - d)));
  }
}
#else
struct Vec {
  typedef float T __attribute__((vector_size(32)));
  typedef int32_t I __attribute__((vector_size(32)));
  static constexpr int W = 8;
  static T zero() { return T{}; }
  static T load(const float* p) {
    T v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  static void store(float* p, T v) { std::memcpy(p, &v, sizeof(v)); }
  static void stream(float* p, T v) { store(p, v); }
  static void stream_fence() {}
#if JAX_ATTN_AVX2
  // A broadcast (from memory where x lives there); `T{} + x` compiled to an add and then a
  // broadcast, a dependent pair in every q.k step.
  static T set1(float x) { return (T)_mm256_set1_ps(x); }
  static T fmadd(T a, T b, T c) { return (T)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
  static T fmsub(T a, T b, T c) { return (T)_mm256_fmsub_ps((__m256)a, (__m256)b, (__m256)c); }
  // vec_avx2.h's pin8: q.k's query vectors were otherwise folded into every FMA that reads
  // them (12 loads per 12 FMAs instead of 3 with 3 row vectors x 4 keys, the loads setting the
  // pace: prefill-8x512 1.17x faster pinned on a Zen 3).
  __attribute__((always_inline)) static void pin(T& v) { pin8(reinterpret_cast<__m256&>(v)); }
#else
  static void pin(T&) {}
  static T set1(float x) { return T{} + x; }
  static T fmadd(T a, T b, T c) { return a * b + c; }
  static T fmsub(T a, T b, T c) { return a * b - c; }
#endif
  static T mul(T a, T b) { return a * b; }
  static T add(T a, T b) { return a + b; }
  static T sub(T a, T b) { return a - b; }
  static T max(T a, T b) { return a > b ? a : b; }
#if JAX_ATTN_AVX2  // vec_avx2.h: the polynomials of the AVX-512 Vec, on 8 lanes
  static T exp2(T x) { return (T)exp2_nonpositive8<5>((__m256)x); }
  static T soft_cap(T x, float cap) { return (T)soft_cap8((__m256)x, cap); }
#else
  static T exp2(T x) {
    for (int i = 0; i < W; ++i) x[i] = std::exp2(x[i]);
    return x;
  }
  static T soft_cap(T x, float cap) {
    for (int i = 0; i < W; ++i) x[i] = cap * std::tanh(x[i] / cap);
    return x;
  }
#endif
  static T exp2_bf16(T x) { return exp2(x); }
  static T if_le(T a, T b, T x, T y) { return a <= b ? x : y; }
  static T if_lt(T a, T b, T x, T y) { return a < b ? x : y; }
};

template <typename CT>
inline void widen_row(const CT* src, float* dst, int64_t D, int64_t Dp) {
#if JAX_ATTN_AVX2
  widen_span(src, D, dst);
#else
  for (int64_t d = 0; d < D; ++d) dst[d] = widen(src[d]);
#endif
  for (int64_t d = D; d < Dp; ++d) dst[d] = 0.0f;
}
#endif
using V = Vec::T;
constexpr int W = Vec::W;

// Register blocking. QK: RV row vectors x KB keys of accumulators; PV: R rows x DV vectors.
// One row vector takes 8 keys in every build (AVX-512 took 16): a block of keys holds a
// pointer per key, and GCC kept the 8 that found no free general register in vector registers,
// moving one back before each broadcast (perf annotate); and a float32 cache lays a kv head's
// rows 4 KiB apart (Hkv 8 x D 128), so 16 rows share one L1 set of 8 ways. Tiles of one row
// vector are the short ones, e.g. speculative decoding's verify step (32 sequences x 4 new
// tokens over 1024 keys, GQA 4: 16 rows per kv head): paired on the 2-core Zen 4 VM, float32
// 1.23x faster at block 128 and 1.27x at 16, bf16 1.04x (NOTES.md 2026-12-06 12:59). 4 keys:
// level with 8.
constexpr int kQkKeys1 = 8;  // with 1 row vector: 8 accumulators
#if JAX_ATTN_AVX512
// With 2 row vectors: 16 accumulators (4 keys: 0.88x on 32 sequences x 8 new tokens).
constexpr int kQkKeys2 = 8;
constexpr int kPvRows = 6;  // 6 rows x 4 vectors: 24 accumulators
constexpr int kPvVecs = 4;
#else
constexpr int kQkKeys2 = 4;
constexpr int kPvRows = 6;  // 6 rows x 2 vectors: 12 accumulators of 16 registers
constexpr int kPvVecs = 2;
#endif
static_assert(kKeys % kQkKeys1 == 0 && kKeys % kQkKeys2 == 0, "key step must hold key blocks");

// Steps without a mask or a logit transform keep each row's largest logit as q.k writes them
// (step_max, [Mp]), so the softmax does not read the logits twice: keys j < valid of a block
// (the rest are the zero-row stand-ins past the step's keys) into rows [r0, r0 + RV * W).
template <int RV, int KB>
inline void block_max(const V (&acc)[KB][RV], int64_t valid, float* __restrict step_max,
                      int64_t r0) {
#pragma GCC unroll 4
  for (int v = 0; v < RV; ++v) {
    V m = Vec::load(step_max + r0 + v * W);
#pragma GCC unroll 16
    for (int j = 0; j < KB; ++j) {
      if (j < valid) m = Vec::max(m, acc[j][v]);
    }
    Vec::store(step_max + r0 + v * W, m);
  }
}

// S^T[n][r] for keys [n0, n0 + KB) and rows [r0, r0 + RV * W):
// Qt: [D][Mp] (row-contiguous per d), kr[n]: key n's D floats (a cache row, or its widened
// copy); the d loop streams one Qt line per step and broadcasts one float of each of the KB keys.
template <int RV, int KB>
JAX_ATTN_HOT void qk_block(const float* __restrict Qt, int64_t Mp, const float* const* kr,
                           int64_t D, float* __restrict St, int64_t r0, int64_t n0,
                           float* __restrict step_max, int64_t nv) {
  V acc[KB][RV];
#pragma GCC unroll 16
  for (int j = 0; j < KB; ++j) {
#pragma GCC unroll 4
    for (int v = 0; v < RV; ++v) acc[j][v] = Vec::zero();
  }
  const float* k[KB];
#pragma GCC unroll 16
  for (int j = 0; j < KB; ++j) k[j] = kr[n0 + j];
  for (int64_t d = 0; d < D; ++d) {
    V q[RV];
#pragma GCC unroll 4
    for (int v = 0; v < RV; ++v) {
      q[v] = Vec::load(Qt + d * Mp + r0 + v * W);
      Vec::pin(q[v]);
    }
#pragma GCC unroll 16
    for (int j = 0; j < KB; ++j) {
      const V kb = Vec::set1(k[j][d]);
#pragma GCC unroll 4
      for (int v = 0; v < RV; ++v) acc[j][v] = Vec::fmadd(q[v], kb, acc[j][v]);
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < KB; ++j) {
#pragma GCC unroll 4
    for (int v = 0; v < RV; ++v) Vec::store(St + (n0 + j) * Mp + r0 + v * W, acc[j][v]);
  }
  if (step_max != nullptr) block_max<RV, KB>(acc, nv - n0, step_max, r0);
}

// O[r][d0 .. d0 + DV*W) = alpha[r] * O[r][..] + sum_{n < nv} P^T[n][r] * vr[n][..] for rows
// [r0, r0 + R): walks keys n in order; per key DV vector loads of vr[n] (value n's Dp floats:
// a cache row, or its widened copy) and R broadcasts of P.
template <int R, int DV>
JAX_ATTN_HOT void pv_block(float* __restrict O, int64_t ldo, const float* __restrict Pt, int64_t Mp,
                     const float* const* vr, int64_t nv, int64_t r0, int64_t d0,
                     const float* __restrict alpha, bool first, float* const* out_rows,
                     const float* inv, bool stream, WarmCursor* warm) {
  V acc[R][DV];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    const V a = Vec::set1(alpha[r0 + i]);
#pragma GCC unroll 4
    for (int v = 0; v < DV; ++v) {
      acc[i][v] = first ? Vec::zero() : Vec::mul(Vec::load(O + (r0 + i) * ldo + d0 + v * W), a);
    }
  }
  WarmLines lines(warm);
  for (int64_t n = 0; n < nv; ++n) {
    lines.request_next();
    V x[DV];
#pragma GCC unroll 4
    for (int v = 0; v < DV; ++v) x[v] = Vec::load(vr[n] + d0 + v * W);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const V p = Vec::set1(Pt[n * Mp + r0 + i]);
#pragma GCC unroll 4
      for (int v = 0; v < DV; ++v) acc[i][v] = Vec::fmadd(p, x[v], acc[i][v]);
    }
  }
  lines.done();
  if (out_rows != nullptr) {  // the item's last step: normalized rows straight to the output
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const V f = Vec::set1(inv[r0 + i]);
#pragma GCC unroll 4
      for (int v = 0; v < DV; ++v) {
        if (stream) {
          Vec::stream(out_rows[r0 + i] + d0 + v * W, Vec::mul(acc[i][v], f));
        } else {
          Vec::store(out_rows[r0 + i] + d0 + v * W, Vec::mul(acc[i][v], f));
        }
      }
    }
    return;
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < DV; ++v) Vec::store(O + (r0 + i) * ldo + d0 + v * W, acc[i][v]);
  }
}

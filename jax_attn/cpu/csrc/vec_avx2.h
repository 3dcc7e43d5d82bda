// AVX2 vector helpers (8 floats per register) for builds with AVX2, FMA and F16C but not
// AVX-512 (AMD Zen 2 / Zen 3, Intel Haswell to Skylake client; `-march=x86-64-v3`):
// JAX_ATTN_AVX2 is 1 there, else 0 and nothing below is compiled. kernel_common.h's AVX-512
// helpers are the 16-float twins; the formulas are the same (exp's polynomial, tanh through exp,
// the fp8 widening through fp16), only 2^n is built from exponent bits instead of vscalefps.
#pragma once

#include "kernel_common.h"

#if !JAX_ATTN_AVX512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define JAX_ATTN_AVX2 1
#include <immintrin.h>
#else
#define JAX_ATTN_AVX2 0
#endif

#if JAX_ATTN_AVX2
namespace jax_attn_cpu {

// 8 elements widened to float32, per element type.
template <typename T>
struct Load8;
template <>
struct Load8<float> {
  static __m256 whole(const float* p) { return _mm256_loadu_ps(p); }
};
template <>
struct Load8<bf16_t> {
  static __m256 whole(const bf16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
};
template <>
struct Load8<f16_t> {
  static __m256 whole(const f16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
};
template <>
struct Load8<e5m2_t> {  // the high byte of an fp16
  static __m256 whole(const e5m2_t* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(b), 8));
  }
};
// e4m3 codes as fp16 bits (sign to bit 15, exponent and mantissa to bits 13..7: 2^-8 of the
// e4m3 value, subnormals included; see widen(e4m3_t)), the NaN codes 0x7f / 0xff as 0xffff.
// From the sign-extended code w: w << 7 has the sign in bits 15..14 and the rest in 13..7;
// w << 9 is 0xfe00 exactly for the two NaN codes. Six integer operations on lanes of 16 bits,
// where separate sign and magnitude masks and a float32 blend for the NaNs took eight and the
// blend (decode-fp8-bs128 on the Zen 3 VM: 1.25x, paired A/B; NOTES.md).
inline __m128i e4m3_as_half8(const e4m3_t* p) {
  const __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(static_cast<short>(0xbf80)));
  const __m128i nan =
      _mm_cmpeq_epi16(_mm_slli_epi16(w, 9), _mm_set1_epi16(static_cast<short>(0xfe00)));
  return _mm_or_si128(h, nan);
}
template <>
struct Load8<e4m3_t> {
  static __m256 whole(const e4m3_t* p) {
    return _mm256_mul_ps(_mm256_cvtph_ps(e4m3_as_half8(p)), _mm256_set1_ps(256.0f));
  }
};

// e4m3 codes read as 2^-8 times their value (exact: the fp16 value of e4m3_as_half8), for a
// kernel that folds the 2^8 into its scales (the decode: decode_item_avx2) and so saves a
// multiply per 8 elements on the FMA pipes.
struct e4m3_folded_t {
  uint8_t bits;
};
constexpr float kE4m3Fold = 256.0f;
template <>
struct Load8<e4m3_folded_t> {
  static __m256 whole(const e4m3_folded_t* p) {
    return _mm256_cvtph_ps(e4m3_as_half8(reinterpret_cast<const e4m3_t*>(p)));
  }
};
inline float widen(e4m3_folded_t x) { return widen(e4m3_t{x.bits}) * (1.0f / kE4m3Fold); }

// 16 e4m3 codes as fp16 bits: e4m3_as_half8 on 16 lanes (one sign-extending load, one set of
// its 16-bit operations; the caller takes the upper half out for its conversion).
inline __m256i e4m3_as_half16(const e4m3_t* p) {
  const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h =
      _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(static_cast<short>(0xbf80)));
  const __m256i nan =
      _mm256_cmpeq_epi16(_mm256_slli_epi16(w, 9), _mm256_set1_epi16(static_cast<short>(0xfe00)));
  return _mm256_or_si256(h, nan);
}

// Elements [0, 16) of p widened: x0 = [0, 8), x1 = [8, 16). kLoadsInPairs<T>: whether that
// costs less than two Load8s (the kernels then read their chunks in pairs).
template <typename T>
constexpr bool kLoadsInPairs = false;
template <>
constexpr bool kLoadsInPairs<e4m3_folded_t> = true;
template <typename T>
__attribute__((always_inline)) inline void load8x2(const T* p, __m256& x0, __m256& x1) {
  x0 = Load8<T>::whole(p);
  x1 = Load8<T>::whole(p + 8);
}
__attribute__((always_inline)) inline void load8x2(const e4m3_folded_t* p, __m256& x0,
                                                   __m256& x1) {
  const __m256i h = e4m3_as_half16(reinterpret_cast<const e4m3_t*>(p));
  x0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  x1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// n elements of src widened into dst[0, n): 8 at a time, the rest one by one.
template <typename T>
inline void widen_span(const T* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, Load8<T>::whole(src + i));
  if constexpr (std::is_same_v<T, float>) {
    if (i + 4 <= n) {
      _mm_storeu_ps(dst + i, _mm_loadu_ps(src + i));
      i += 4;
    }
  }
  for (; i < n; ++i) dst[i] = widen(src[i]);
}

// Pins v to a register at this point: GCC otherwise folds a vector that several FMAs read into
// each of them as a memory operand, one load per FMA where one load would do.
__attribute__((always_inline)) inline void pin8(__m256& v) { __asm__("" : "+x"(v)); }

// 2^n for integer-valued n in [-127, 127] (n = -127 gives exactly 0).
inline __m256 pow2i8(__m256 n) {
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}

// exp(x) in float32, ~1-2 ulp over the normal range (exp16's polynomial); 0 below -87.3 (exp16
// gives denormals down to -104 there), -inf -> 0, NaN stays NaN.
inline __m256 exp8(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ);  // NaN: false
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.37f)), _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256 e = _mm256_and_ps(_mm256_mul_ps(p, pow2i8(n)), tiny);
  return _mm256_or_ps(e, nan);  // a NaN lane: all ones, a NaN
}

// 2^x for x <= 0 (the ragged kernel's base-2 logits); x <= -127 (masked: -1e30) gives exactly 0.
// `degree` 5: relative error 2.4e-7; 3: 7.5e-5, for probabilities rounded to bf16 next.
template <int kDegree>
inline __m256 exp2_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-127.0f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(x, n);
  __m256 p;
  if constexpr (kDegree == 5) {
    p = _mm256_set1_ps(1.327647129e-3f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(9.675540961e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.550713092e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(2.402212024e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(6.931469440e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.000000119f));
  } else {
    static_assert(kDegree == 3, "degree 5 or 3");
    p = _mm256_set1_ps(5.5171650e-2f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(2.4261114e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(6.9326097e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(9.9992806e-1f));
  }
  return _mm256_mul_ps(p, pow2i8(n));
}

// tanh(x) = sign(x) * tanh(|x|), tanh16's formulas and shortcut (kernel_common.h: the
// polynomial below kTanhSmall); relative error ~2e-7.
inline __m256 tanh8(__m256 x) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  const __m256 ax = _mm256_andnot_ps(sign_bit, x);
  const __m256 z = _mm256_mul_ps(ax, ax);
  __m256 poly = _mm256_set1_ps(kTanhPoly[4]);
  for (int k = 3; k >= 0; --k) poly = _mm256_fmadd_ps(poly, z, _mm256_set1_ps(kTanhPoly[k]));
  __m256 t = _mm256_fmadd_ps(_mm256_mul_ps(ax, z), poly, ax);
  const __m256 small = _mm256_cmp_ps(ax, _mm256_set1_ps(kTanhSmall), _CMP_LT_OQ);
  if (_mm256_movemask_ps(small) != 0xFF) {
    const __m256 e = exp8(_mm256_add_ps(ax, ax));
    const __m256 large = _mm256_sub_ps(
        _mm256_set1_ps(1.0f),
        _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
    t = _mm256_blendv_ps(large, t, small);
  }
  return _mm256_or_ps(t, _mm256_and_ps(x, sign_bit));
}

// cap * tanh(x / cap); cap > 0.
inline __m256 soft_cap8(__m256 x, float cap) {
  return _mm256_mul_ps(_mm256_set1_ps(cap), tanh8(_mm256_mul_ps(x, _mm256_set1_ps(1.0f / cap))));
}

// Sums of 8 vectors as one: lane i = the horizontal sum of a[i].
inline __m256 transpose_sum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  // u0 = [a0..a3 low halves' sums | their high halves'], u1 the same for a4..a7.
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// In-register transpose of an 8 x 8 float block: on return r[c] lane i holds what r[i] lane c
// held on entry.
inline void transpose8x8(__m256 r[8]) {
  __m256 u[8], s[8];
  for (int i = 0; i < 8; i += 2) {
    u[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    u[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    s[i] = _mm256_shuffle_ps(u[i], u[i + 2], 0x44);
    s[i + 1] = _mm256_shuffle_ps(u[i], u[i + 2], 0xee);
    s[i + 2] = _mm256_shuffle_ps(u[i + 1], u[i + 3], 0x44);
    s[i + 3] = _mm256_shuffle_ps(u[i + 1], u[i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(s[i], s[4 + i], 0x20);
    r[4 + i] = _mm256_permute2f128_ps(s[i], s[4 + i], 0x31);
  }
}

}  // namespace jax_attn_cpu
#endif  // JAX_ATTN_AVX2

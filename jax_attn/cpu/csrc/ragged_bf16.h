// Part of the ragged kernel (ragged_paged_attention.cc), not a header of its own: included by
// that file inside its namespaces right after ragged_vec.h, whose block_max it uses (and the
// kernel's WarmLines and JAX_ATTN_HOT). It includes nothing itself.
//
// The inner products of bf16 queries on a bf16 cache through vdpbf16ps (AVX512_BF16: bf16
// pairs multiplied exactly, summed in float32). Defines JAX_ATTN_BF16_DOT: 1 where the build
// has AVX-512 (JAX_ATTN_AVX512) and __AVX512BF16__, and then compiles what follows; else 0,
// and the kernel compiles none of its calls (every use sits under `#if JAX_ATTN_BF16_DOT`).
// The interface the kernel calls: qk_block_bf16 (head_logits), pv_block_bf16 (pv_call),
// pack_value_pair (run_item: the value pairs of a step or a task), probability_pair
// (softmax_rows under kPairs) and narrow16_bf16 (the bf16 output rows here).
#pragma once

#if JAX_ATTN_AVX512 && defined(__AVX512BF16__)
#define JAX_ATTN_BF16_DOT 1
// bf16 queries and a bf16 cache: S^T[n][r] = qk_scale * sum over d pairs with vdpbf16ps, which
// multiplies bf16 pairs exactly and accumulates in float32: half the instructions of the f32
// kernel and no widened copy of the keys. Qt2: [D/2][Mp] pairs (q[r][2i], q[r][2i+1]);
// keys: kp[n] points at key n's [D] bf16 row in the cache, read as D/2 pairs (broadcast).
template <int RV, int KB>
JAX_ATTN_HOT void qk_block_bf16(const uint32_t* __restrict Qt2, int64_t Mp,
                                const uint32_t* const* kp, int64_t D2, float qk_scale,
                                float* __restrict St, int64_t r0, int64_t n0,
                                float* __restrict step_max, int64_t nv) {
  __m512 acc[KB][RV];
#pragma GCC unroll 16
  for (int j = 0; j < KB; ++j) {
#pragma GCC unroll 4
    for (int v = 0; v < RV; ++v) acc[j][v] = _mm512_setzero_ps();
  }
  const uint32_t* k[KB];
#pragma GCC unroll 16
  for (int j = 0; j < KB; ++j) k[j] = kp[n0 + j];
  for (int64_t i = 0; i < D2; ++i) {
    __m512bh q[RV];
#pragma GCC unroll 4
    for (int v = 0; v < RV; ++v) {
      q[v] = (__m512bh)_mm512_loadu_si512(Qt2 + i * Mp + r0 + v * 16);
    }
#pragma GCC unroll 16
    for (int j = 0; j < KB; ++j) {
      const __m512bh kb = (__m512bh)_mm512_set1_epi32(static_cast<int>(k[j][i]));
#pragma GCC unroll 4
      for (int v = 0; v < RV; ++v) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], q[v], kb);
    }
  }
  const __m512 sc = _mm512_set1_ps(qk_scale);
#pragma GCC unroll 16
  for (int j = 0; j < KB; ++j) {
#pragma GCC unroll 4
    for (int v = 0; v < RV; ++v) {
      acc[j][v] = _mm512_mul_ps(acc[j][v], sc);
      _mm512_storeu_ps(St + (n0 + j) * Mp + r0 + v * 16, acc[j][v]);
    }
  }
  if (step_max != nullptr) block_max<RV, KB>(acc, nv - n0, step_max, r0);
}

// 16 floats to bf16 exactly as narrow<bf16_t> (kernel_common.h) rounds each: to nearest even,
// NaNs kept quiet.
inline __m256i narrow16_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f800000));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
}

// The p.v side of the same path: O[r][d0 .. d0 + DV*16) = alpha[r] * O[r][..] +
// sum over key pairs i of P[2i][r] V[2i][d] + P[2i+1][r] V[2i+1][d], with vdpbf16ps.
// Pp: [np][Mp] pairs (P[2i][r], P[2i+1][r]) rounded to bf16; Vp: [np][Dp] pairs
// (V[2i][d], V[2i+1][d]) straight from the cache. Probabilities in bf16 (8 significant bits,
// as flash attention's bf16 kernels keep them) against float32 in the row sums.
template <int R, int DV>
JAX_ATTN_HOT void pv_block_bf16(float* __restrict O, int64_t ldo, const uint32_t* __restrict Pp,
                                int64_t Mp, const uint32_t* __restrict Vp, int64_t ldv,
                                int64_t np, int64_t r0, int64_t d0,
                                const float* __restrict alpha, bool first,
                                bf16_t* const* out_rows, const float* inv, WarmCursor* warm) {
  __m512 acc[R][DV];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    const __m512 a = _mm512_set1_ps(alpha[r0 + i]);
#pragma GCC unroll 4
    for (int v = 0; v < DV; ++v) {
      acc[i][v] = first ? _mm512_setzero_ps()
                        : _mm512_mul_ps(_mm512_loadu_ps(O + (r0 + i) * ldo + d0 + v * 16), a);
    }
  }
  WarmLines lines(warm);
  for (int64_t n = 0; n < np; ++n) {
    lines.request_next();
    __m512bh x[DV];
#pragma GCC unroll 4
    for (int v = 0; v < DV; ++v) {
      x[v] = (__m512bh)_mm512_loadu_si512(Vp + n * ldv + d0 + v * 16);
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(Pp[n * Mp + r0 + i]));
#pragma GCC unroll 4
      for (int v = 0; v < DV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], pb, x[v]);
    }
  }
  lines.done();
  if (out_rows != nullptr) {  // the item's last step: normalized rows straight to the output
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m512 f = _mm512_set1_ps(inv[r0 + i]);
#pragma GCC unroll 4
      for (int v = 0; v < DV; ++v) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_rows[r0 + i] + d0 + v * 16),
                            narrow16_bf16(_mm512_mul_ps(acc[i][v], f)));
      }
    }
    return;
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < DV; ++v) _mm512_storeu_ps(O + (r0 + i) * ldo + d0 + v * 16, acc[i][v]);
  }
}

// Values 2i and 2i+1 (b: nullptr past the last key, read as zeros) of D bf16 each, interleaved
// into Vp[d] = (a[d], b[d]) for d in [0, Dp) (zeros past D).
inline void pack_value_pair(const bf16_t* a, const bf16_t* b, int64_t D, int64_t Dp,
                            uint32_t* __restrict Vp) {
  const __m512i lo = pair_index(false), hi = pair_index(true);
  for (int64_t d = 0; d < Dp; d += 32) {
    const int64_t left = D - d;
    const __mmask32 m = left >= 32 ? ~__mmask32{0} : (__mmask32{1} << left) - 1;
    const __m512i x = _mm512_maskz_loadu_epi16(m, a + d);
    const __m512i y = b ? _mm512_maskz_loadu_epi16(m, b + d) : _mm512_setzero_si512();
    _mm512_storeu_si512(Vp + d, _mm512_permutex2var_epi16(x, lo, y));
    if (d + 16 < Dp) _mm512_storeu_si512(Vp + d + 16, _mm512_permutex2var_epi16(x, hi, y));
  }
}

// Probabilities p0 = P[2i][r..r+16), p1 = P[2i+1][r..] as the words (p0, p1) rounded to bf16:
// both rounded by one vcvtne2ps2bf16 (p0 in the low 16 halves, p1 in the high), then
// interleaved by one vpermw (the same roundings as two vcvtneps2bf16, fewer instructions).
inline __m512i probability_pair(__m512 p0, __m512 p1) {
  alignas(64) static const uint16_t kInterleave[32] = {
      0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
  return _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), both);
}
#else
#define JAX_ATTN_BF16_DOT 0
#endif

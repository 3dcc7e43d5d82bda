// Part of the decode kernel (paged_decode.cc), not a header of its own: included by
// decode_kernel.h inside its namespaces (jax_attn_cpu and the anonymous one) and inside its
// `#if JAX_ATTN_AVX512`, after TilePrefetcher, Problem and RowsState, which it uses. It includes
// nothing itself.
//
// The AVX-512 tile helpers of the vector decode (JAX_ATTN_AVX512, kernel_common.h: built with
// AVX-512F/BW/VL): widen_tile (a kv head's rows of a tile widened to float32),
// gather_split_keys and transpose_split_values (vLLM's split layout into token rows, through
// transpose16x16), accumulate_values (acc = acc * factor + P V, FMAs for 4 rows x 4 chunks).
// Then the bf16 products: defines JAX_ATTN_DECODE_BF16_DOT, 1 where the build has
// __AVX512BF16__, and then compiles dot_keys_bf16 (one query row against a bf16 key tile by
// vdpbf16ps), accumulate_pairs (P V by vdpbf16ps from a tile of token pairs),
// transpose_split_value_pairs (the split layout's bf16 values into that tile) and
// accumulate_value_pairs (P V by vdpbf16ps straight from a token-major bf16 tile); else 0.
// The interface the kernel calls: accumulate_values, accumulate_pairs and dot_keys_bf16 from
// attend_tile; accumulate_value_pairs from attend_tile_rows; widen_tile, gather_split_keys,
// transpose_split_values and transpose_split_value_pairs from decode_item.
#pragma once

// Widen one kv head's rows [0, n) of a tile into dst [16, DP] float32 (rows >= n: zeros, so
// unused cache bytes never reach the math).
template <typename KV, int NC>
inline void widen_tile(const KV* src, int64_t row_stride, int64_t n, __mmask16 last_mask,
                       float* dst) {
  constexpr int64_t DP = NC * 16;
  const bool full = n == 16 && last_mask == static_cast<__mmask16>(0xffff);
  for (int64_t t = 0; t < 16; ++t) {
    const KV* row = src + t * row_stride;
    if (full) {
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) {
        _mm512_store_ps(dst + t * DP + 16 * c, load16<KV>(row + 16 * c));
      }
    } else {
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) {
        const __mmask16 m = t >= n ? static_cast<__mmask16>(0)
                            : c == NC - 1 ? last_mask
                                          : static_cast<__mmask16>(0xffff);
        _mm512_store_ps(dst + t * DP + 16 * c, load16<KV>(row + 16 * c, m));
      }
    }
  }
}

// Split layout (vLLM's), one kv head of one block: keys [D / x, BS, x] with x elements per 16
// bytes, values [D, BS]. The kernel's tiles are token rows, so a tile's keys are gathered
// (16 bytes of x dims per token and chunk) and its values transposed.

// Keys of tokens [t0, t0 + n) of one head's block `src` into rows of dst (dst_stride elements
// apart): row t gets the D elements of token t0 + t; rows [n, 16) get zeros. Columns past D are
// not written (the caller keeps them zero). Requires D % x == 0.
template <typename T>
inline void gather_split_keys(const T* src, int64_t block_size, int64_t t0, int64_t n,
                              int64_t head_size, T* dst, int64_t dst_stride) {
  constexpr int64_t x = 16 / sizeof(T);
  const int64_t chunks = head_size / x;
  for (int64_t t = 0; t < n; ++t) {
    const T* from = src + (t0 + t) * x;
    T* to = dst + t * dst_stride;
    for (int64_t c = 0; c < chunks; ++c) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(to + c * x),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + c * block_size * x)));
    }
  }
  for (int64_t t = n; t < 16; ++t) std::memset(dst + t * dst_stride, 0, head_size * sizeof(T));
}

// r[i][j] <- r[j][i] for a 16 x 16 float32 block in 16 registers (64 shuffles). Inlined: as a
// call, its 16 rows went through memory and the callers spilled around it (split f32 decode at
// blocks 16 and 32 1.24x faster inlined, Zen 4; NOTES.md).
__attribute__((always_inline)) inline void transpose16x16(__m512* r) {
  __m512 t[16];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane L: t[2i] = a[4L], b[4L], a[4L+1], b[4L+1]
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // r[4i + k], lane L: column 4L + k of rows 4i .. 4i + 3
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
  }
  __m512 u[16];
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {  // a 4 x 4 transpose of 128-bit lanes over r[k], r[4 + k], ...
    u[4 * k] = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x44);
    u[4 * k + 1] = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xee);
    u[4 * k + 2] = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x44);
    u[4 * k + 3] = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xee);
  }
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm512_shuffle_f32x4(u[4 * k], u[4 * k + 2], 0x88);
    r[4 + k] = _mm512_shuffle_f32x4(u[4 * k], u[4 * k + 2], 0xdd);
    r[8 + k] = _mm512_shuffle_f32x4(u[4 * k + 1], u[4 * k + 3], 0x88);
    r[12 + k] = _mm512_shuffle_f32x4(u[4 * k + 1], u[4 * k + 3], 0xdd);
  }
}

// Values of tokens [t0, t0 + n) of one head's block `src` ([D, BS]) widened and transposed
// into the float32 tile dst [16, NC * 16] (rows >= n and columns >= D: zeros; only the n
// tokens' elements are read).
template <typename KV, int NC, typename Pf>
inline void transpose_split_values(const KV* src, int64_t block_size, int64_t t0, int64_t n,
                                   int64_t head_size, float* dst, Pf& pf,
                                   int64_t per_step) {
  const __mmask16 m = tail_mask(n);
#pragma GCC unroll 1
  for (int j = 0; j < NC; ++j) {
    pf.issue(per_step);
    __m512 r[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      const int64_t d = 16 * j + i;
      r[i] = d < head_size ? load16<KV>(src + d * block_size + t0, m) : _mm512_setzero_ps();
    }
    transpose16x16(r);
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) _mm512_store_ps(dst + t * NC * 16 + 16 * j, r[t]);
  }
}

// acc[r] = acc[r] * factor[r] + sum_t probs[r][t] * v[t] for RG query rows at once, so each
// value chunk is loaded (and widened) once per RG rows: 4 chunks x RG rows of accumulators in
// registers. Values: rows [0, n) of a float32 tile at v_rows, `stride` elements apart; only the
// first lanes of the last chunk (last_mask) are read. Each token's step also requests
// `per_step` lines of a later tile (pf).
template <int NC, int RG, typename Pf>
inline void accumulate_values(const float* v_rows, int64_t stride, __mmask16 last_mask, int64_t n,
                              const float (*probs)[16], const float* factor, float* const* acc,
                              Pf& pf, int64_t per_step) {
#pragma GCC unroll 4
  for (int cb = 0; cb < NC; cb += 4) {
    constexpr int kMaxCB = 4;
    __m512 o[RG][kMaxCB];
#pragma GCC unroll 4
    for (int r = 0; r < RG; ++r) {
      const __m512 f = _mm512_set1_ps(factor[r]);
      const bool scale = factor[r] != 1.0f;  // most tiles under a lazy reference (attend_tile)
#pragma GCC unroll 4
      for (int j = 0; j < kMaxCB; ++j) {
        if (cb + j < NC) {
          o[r][j] = _mm512_load_ps(acc[r] + 16 * (cb + j));
          if (scale) o[r][j] = _mm512_mul_ps(o[r][j], f);
        }
      }
    }
    for (int64_t t = 0; t < n; ++t) {
      pf.issue(per_step);
      __m512 v[kMaxCB];
#pragma GCC unroll 4
      for (int j = 0; j < kMaxCB; ++j) {
        if (cb + j < NC) {
          v[j] = load_chunk<float, NC>(v_rows + t * stride, cb + j, last_mask);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < RG; ++r) {
        const __m512 pr = _mm512_set1_ps(probs[r][t]);
#pragma GCC unroll 4
        for (int j = 0; j < kMaxCB; ++j) {
          if (cb + j < NC) o[r][j] = _mm512_fmadd_ps(pr, v[j], o[r][j]);
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < RG; ++r) {
#pragma GCC unroll 4
      for (int j = 0; j < kMaxCB; ++j) {
        if (cb + j < NC) _mm512_store_ps(acc[r] + 16 * (cb + j), o[r][j]);
      }
    }
  }
}

#if defined(__AVX512BF16__)
#define JAX_ATTN_DECODE_BF16_DOT 1
// Logits of one query row against a bf16 key tile: dots[t] = sum over d pairs of q[d] * k[t][d]
// by vdpbf16ps (bf16 products are exact, accumulated in float32): half the instructions of the
// float32 dot, on half the tile. q2: the row's unscaled bf16 query, ktile2: [16, NC2 * 32]
// (fp8 keys converted by convert_tile_fp8_bf16), both zero beyond the head size. Each chunk
// after the first also requests `per_step` lines of a later tile (pf).
template <int NC2, typename Pf>
inline void dot_keys_bf16(const bf16_t* q2, const bf16_t* ktile2, __m512* dots,
                          Pf& pf, int64_t per_step) {
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) dots[t] = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int c = 0; c < NC2; ++c) {
    if (c > 0) pf.issue(per_step);
    const __m512bh qc = (__m512bh)_mm512_load_si512(q2 + 32 * c);
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) {
      const __m512bh kc = (__m512bh)_mm512_load_si512(ktile2 + (t * NC2 + c) * 32);
      dots[t] = _mm512_dpbf16_ps(dots[t], qc, kc);
    }
  }
}

// Values as bf16 pairs (the vdpbf16ps path's p.v on a tile): acc[r] = acc[r] * factor[r] +
// sum over token pairs k of p[r][2k] v[2k] + p[r][2k + 1] v[2k + 1], RG query rows at once.
// vpairs: [8][NC * 16] words (v[2k][d], v[2k + 1][d]), pairs k < (n + 1) / 2 read;
// pp[r][k]: the probability pair (p[2k], p[2k + 1]) rounded to bf16. Half the instructions of
// accumulate_values' float32 FMAs on half the tile bytes. Each pair's step also requests
// `per_step` lines of a later tile (pf).
template <int NC, int RG, typename Pf>
inline void accumulate_pairs(const uint32_t* vpairs, int64_t n, const uint32_t (*pp)[8],
                             const float* factor, float* const* acc, Pf& pf,
                             int64_t per_step) {
  constexpr int64_t DP = NC * 16;
  const int64_t num_pairs = (n + 1) / 2;
#pragma GCC unroll 4
  for (int cb = 0; cb < NC; cb += 4) {
    constexpr int kMaxCB = 4;
    __m512 o[RG][kMaxCB];
#pragma GCC unroll 4
    for (int r = 0; r < RG; ++r) {
      const __m512 f = _mm512_set1_ps(factor[r]);
      const bool scale = factor[r] != 1.0f;  // most tiles under a lazy reference (attend_tile)
#pragma GCC unroll 4
      for (int j = 0; j < kMaxCB; ++j) {
        if (cb + j < NC) {
          o[r][j] = _mm512_load_ps(acc[r] + 16 * (cb + j));
          if (scale) o[r][j] = _mm512_mul_ps(o[r][j], f);
        }
      }
    }
    for (int64_t k = 0; k < num_pairs; ++k) {
      pf.issue(per_step);
      __m512bh v[kMaxCB];
#pragma GCC unroll 4
      for (int j = 0; j < kMaxCB; ++j) {
        if (cb + j < NC) v[j] = (__m512bh)_mm512_load_si512(vpairs + k * DP + 16 * (cb + j));
      }
#pragma GCC unroll 4
      for (int r = 0; r < RG; ++r) {
        const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[r][k]));
#pragma GCC unroll 4
        for (int j = 0; j < kMaxCB; ++j) {
          if (cb + j < NC) o[r][j] = _mm512_dpbf16_ps(o[r][j], pb, v[j]);
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < RG; ++r) {
#pragma GCC unroll 4
      for (int j = 0; j < kMaxCB; ++j) {
        if (cb + j < NC) _mm512_store_ps(acc[r] + 16 * (cb + j), o[r][j]);
      }
    }
  }
}

// The split layout's bf16 values of tokens [t0, t0 + n) of one head's block ([D, BS]) as the
// pair tile of accumulate_pairs: in that layout a token pair of one dimension is already one
// 32-bit word, so per 16 dimensions their rows' 8 words (16 x 8) are transposed into the 8
// pairs' vectors. Two rows share a register (dims i and i + 4 of each 8), so the transpose is
// 4 x 4 in-lane steps and one 128-bit lane shuffle per output: 24 shuffles, against 64 for a
// 16 x 16 transpose with its upper half zero (which took 17% of the block-16 split decode's
// math; NOTES.md). Tokens >= n read as zeros (masked loads).
template <int NC, typename Pf>
inline void transpose_split_value_pairs(const bf16_t* src, int64_t block_size, int64_t t0,
                                        int64_t n, int64_t head_size, uint32_t* dst,
                                        Pf& pf, int64_t per_step) {
  constexpr int64_t DP = NC * 16;
  const __mmask16 m = tail_mask(n);
  const int64_t num_pairs = (n + 1) / 2;
  const auto row = [&](int64_t d) {  // dimension d's 8 words, zeros past the head
    return d < head_size ? _mm256_maskz_loadu_epi16(m, src + d * block_size + t0)
                         : _mm256_setzero_si256();
  };
#pragma GCC unroll 1
  for (int j = 0; j < NC; ++j) {
    pf.issue(per_step);
    // r[4h + i]: dims 16j + 8h + i (low 256 bits) and 16j + 8h + i + 4 (high), i < 4.
    __m512 r[8];
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      const int64_t d = 16 * j + 8 * (k / 4) + k % 4;
      r[k] = _mm512_castsi512_ps(
          _mm512_inserti64x4(_mm512_castsi256_si512(row(d)), row(d + 4), 1));
    }
    // a[4h + w], 128-bit lane L: word w + 4 (L % 2) of dims 16j + 8h + 4 (L / 2) + 0..3.
    __m512 a[8];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512* x = r + 4 * h;
      const __m512 t0 = _mm512_unpacklo_ps(x[0], x[1]), t1 = _mm512_unpackhi_ps(x[0], x[1]);
      const __m512 t2 = _mm512_unpacklo_ps(x[2], x[3]), t3 = _mm512_unpackhi_ps(x[2], x[3]);
      a[4 * h + 0] = _mm512_shuffle_ps(t0, t2, 0x44);
      a[4 * h + 1] = _mm512_shuffle_ps(t0, t2, 0xEE);
      a[4 * h + 2] = _mm512_shuffle_ps(t1, t3, 0x44);
      a[4 * h + 3] = _mm512_shuffle_ps(t1, t3, 0xEE);
    }
    // Pair w: lanes 0 and 2 of a[w] (dims 0-3, 4-7) then of a[4 + w] (8-11, 12-15); pair
    // w + 4: lanes 1 and 3.
    float* out = reinterpret_cast<float*>(dst) + 16 * j;
#pragma GCC unroll 4
    for (int w = 0; w < 4; ++w) {
      if (w < num_pairs) _mm512_store_ps(out + w * DP, _mm512_shuffle_f32x4(a[w], a[4 + w], 0x88));
      if (w + 4 < num_pairs) {
        _mm512_store_ps(out + (w + 4) * DP, _mm512_shuffle_f32x4(a[w], a[4 + w], 0xDD));
      }
    }
  }
}


// Values of a bf16 token-major tile under bf16 queries (attend_tile_rows' kDot path), by
// vdpbf16ps: acc[row] = acc[row] * factor[row] + sum_t p[row][t] v[t], the tile's tokens taken
// in pairs. Two tokens' value rows are interleaved by vpermt2w into (v[2k][d], v[2k+1][d])
// words, so one vdpbf16ps adds p[2k] v[2k][d] + p[2k+1] v[2k+1][d] for 16 d, against the
// probability pair broadcast as one 32-bit word (pairs: [Hq][16] floats' room, the first 8 words
// of a row the row's pairs, rounded to bf16 as the ragged kernel's p.v and the AMX paths round
// them; the row sums stay float32). Per kv head and 4 query rows, 64 dimensions at a time: 16
// accumulators held in registers over the whole tile (the float32 path reloads them every 4
// tokens), each pair of rows loaded once for the 4 query rows. Half the instructions of
// widening the values and one FMA per token (2-core Zen 5 VM, NOTES.md).
// v_rows: the tile's first token (kv head 0); rows of tokens >= n are never read (zero_row).
template <int NC, typename Pf>
inline void accumulate_value_pairs(const Problem& p, RowsState& st, const bf16_t* v_rows,
                                   int64_t row_stride, int64_t n, const bf16_t* zero_row,
                                   const uint32_t* pairs, const float* factor,
                                   Pf& pf, int64_t per_step) {
  constexpr int64_t DP = NC * 16;
  constexpr int NC2 = (NC + 1) / 2;
  const int64_t D = p.head_size, G = p.group, Hkv = p.num_kv_heads;
  const int64_t tail2 = D - (NC2 - 1) * 32;
  const __mmask32 last_mask2 = tail2 >= 32 ? static_cast<__mmask32>(0xffffffffu)
                                           : static_cast<__mmask32>((1u << tail2) - 1u);
  const __m512i lo = pair_index(false), hi = pair_index(true);
  const int64_t num_pairs = (n + 1) / 2;
  // kv head h: its tile rows [16][D], Hkv * D elements apart; 64 dimensions per block.
  for (int64_t h = 0; h < Hkv; ++h) {
    const bf16_t* v[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) v[i] = i < n ? v_rows + i * row_stride + h * D : zero_row;
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      const int rg = static_cast<int>(std::min<int64_t>(4, G - g0));
      const int64_t row0 = h * G + g0;
#pragma GCC unroll 4
      for (int cb = 0; cb < NC; cb += 4) {
        __m512 o[4][4];
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) {
          if (r >= rg) break;
          const float* a = st.acc.get() + (row0 + r) * DP + 16 * cb;
          const __m512 f = _mm512_set1_ps(factor[row0 + r]);
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) {
            if (cb + j < NC) o[r][j] = _mm512_mul_ps(_mm512_load_ps(a + 16 * j), f);
          }
        }
        for (int64_t k = 0; k < num_pairs; ++k) {
          pf.issue(per_step);
          __m512i x[4];
#pragma GCC unroll 2
          for (int c = 0; c < 2; ++c) {
            const int c2 = cb / 2 + c;  // the 32-element chunk
            if (2 * c2 < NC) {
              const __mmask32 m = c2 == NC2 - 1 ? last_mask2 : static_cast<__mmask32>(~0u);
              const __m512i a = _mm512_maskz_loadu_epi16(m, v[2 * k] + 32 * c2);
              const __m512i b = _mm512_maskz_loadu_epi16(m, v[2 * k + 1] + 32 * c2);
              x[2 * c] = _mm512_permutex2var_epi16(a, lo, b);
              if (2 * c2 + 1 < NC) x[2 * c + 1] = _mm512_permutex2var_epi16(a, hi, b);
            }
          }
#pragma GCC unroll 4
          for (int r = 0; r < 4; ++r) {
            if (r >= rg) break;
            const __m512bh pb = (__m512bh)_mm512_set1_epi32(
                static_cast<int>(pairs[(row0 + r) * 16 + k]));
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {
              if (cb + j < NC) o[r][j] = _mm512_dpbf16_ps(o[r][j], pb, (__m512bh)x[j]);
            }
          }
        }
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) {
          if (r >= rg) break;
          float* a = st.acc.get() + (row0 + r) * DP + 16 * cb;
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) {
            if (cb + j < NC) _mm512_store_ps(a + 16 * j, o[r][j]);
          }
        }
      }
    }
  }
}
#else
#define JAX_ATTN_DECODE_BF16_DOT 0
#endif

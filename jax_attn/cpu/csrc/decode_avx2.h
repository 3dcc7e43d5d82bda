// Part of the decode kernel (decode_kernel.h), not a header of its own: included by that file
// inside its namespaces, after Problem, Item, FloatBuffer, load_query_row, RowsState and
// finish_item, which it uses. Compiled where the build has AVX2 + FMA + F16C and not AVX-512
// (JAX_ATTN_AVX2, vec_avx2.h): there it is the decode's item function for every cache dtype,
// layout and head size (before it, such machines ran decode_item_scalar, a token at a time).
//
// One item (a sequence, or a part of one): the blocks in table order.
// - Token-major: tiles of up to 16 tokens outer, kv heads inner, per tile and kv head:
//   - the G x n logits of the head's query rows, 8 dot products at a time (rows x tokens 4 x 2,
//     2 x 4 or 1 x 8), their 8 accumulators summed into one vector by a transpose tree; the
//     keys read in place and widened as loaded (RowKeys), or from a float32 tile where the head
//     size is not a multiple of 8;
//   - one online-softmax step per row (soft cap, ALiBi, tokens past n masked), probabilities by
//     exp8;
//   - acc = factor * acc + P V, 4 rows x 3 vectors of accumulators per pass over the tile, the
//     values read in place or from a float32 tile.
//   The next tile's rows (all kv heads) are requested a line pair per q.k and p.v step
//   (LineCursor).
// - vLLM's split layout: kv heads outer (a head's block is contiguous), the next head block
//   requested the same way; per kv head, the block's tokens in one step
//   (attend_split_block_avx2): the logits in tiles of 16 from the keys' 16-byte pieces in place
//   (SplitKeys), one softmax step over the block, and the p.v in the dot form: the values
//   [D, BS] are D rows over the tokens, so dots8 takes probability rows for query rows and
//   value rows for keys (pv_split_rows_avx2). Against transposing each tile's values into
//   token rows first, that took the TORCH_SDPA decode at block 128 from 18.9 to 10.9 ms in
//   bf16 and from 34.3 to 27.7 in float32 (Zen 3 VM; 1.04-1.52x at blocks 16 and 32; NOTES.md).
//   Head sizes that are not a multiple of 8 (float32 only: x = 4) keep the tiles.
#pragma once

constexpr int kAvx2Tile = 16;  // tokens per tile

// The keys of a tile, token j's chunk c (8 elements widened to float32) on request; tokens past
// the tile's repeat its last one (their logits are masked whatever they hold).
// - RowKeys: token rows of contiguous elements (token-major, or a float32 tile);
// - SplitKeys: vLLM's split layout read in place, [D / x, BS, x] per kv head with x elements in
//   16 bytes: token j's pieces `piece` (BS * x) elements apart from rows[j] (head + t * x).
template <typename T>
struct RowKeys {
  const T* const* rows;
  static constexpr bool kPairs = kLoadsInPairs<T>;
  __attribute__((always_inline)) __m256 chunk(int64_t j, int64_t c) const {
    return Load8<T>::whole(rows[j] + 8 * c);
  }
  __attribute__((always_inline)) void chunks2(int64_t j, int64_t c, __m256& x0, __m256& x1) const {
    load8x2(rows[j] + 8 * c, x0, x1);
  }
};
template <typename KV>
struct SplitKeys {
  const KV* const* rows;
  int64_t piece;
  static constexpr bool kPairs = kLoadsInPairs<KV> && sizeof(KV) == 1;  // c even: one piece
  __attribute__((always_inline)) void chunks2(int64_t j, int64_t c, __m256& x0, __m256& x1) const {
    load8x2(rows[j] + (c / 2) * piece, x0, x1);
  }
  __attribute__((always_inline)) __m256 chunk(int64_t j, int64_t c) const {
    if constexpr (sizeof(KV) == 4) {  // two pieces of 4
      const float* r = reinterpret_cast<const float*>(rows[j]) + 2 * c * piece;
      return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(r)), _mm_loadu_ps(r + piece),
                                  1);
    } else if constexpr (sizeof(KV) == 2) {  // one piece of 8
      return Load8<KV>::whole(rows[j] + c * piece);
    } else {  // half a piece of 16
      return Load8<KV>::whole(rows[j] + (c / 2) * piece + (c % 2) * 8);
    }
  }
};

// Adds chunks [c0, c1) of the 8 dot products of rows q[0, RG) x keys t0 + [0, TK) to acc
// (acc[i * TK + j]: q[i] . k[t0 + j], lane-wise partial sums).
template <int RG, int TK, typename Keys>
__attribute__((always_inline)) inline void accumulate8(__m256 (&acc)[8], const float* const* q,
                                                       const Keys& k, int64_t t0, int64_t c0,
                                                       int64_t c1) {
  static_assert(RG * TK == 8, "8 dot products");
  int64_t c = c0;
  if constexpr (Keys::kPairs && TK <= 2) {  // two chunks per load (c0 even)
    for (; c + 2 <= c1; c += 2) {
      __m256 kv[TK][2];
#pragma GCC unroll 2
      for (int j = 0; j < TK; ++j) k.chunks2(t0 + j, c, kv[j][0], kv[j][1]);
#pragma GCC unroll 2
      for (int e = 0; e < 2; ++e) {
#pragma GCC unroll 4
        for (int i = 0; i < RG; ++i) {
          __m256 qv = _mm256_loadu_ps(q[i] + 8 * (c + e));
          if (TK > 1) pin8(qv);
#pragma GCC unroll 2
          for (int j = 0; j < TK; ++j) {
            acc[i * TK + j] = _mm256_fmadd_ps(qv, kv[j][e], acc[i * TK + j]);
          }
        }
      }
    }
  }
  for (; c < c1; ++c) {
    __m256 kv[TK];
#pragma GCC unroll 8
    for (int j = 0; j < TK; ++j) kv[j] = k.chunk(t0 + j, c);
#pragma GCC unroll 4
    for (int i = 0; i < RG; ++i) {
      __m256 qv = _mm256_loadu_ps(q[i] + 8 * c);
      if (TK > 1) pin8(qv);
#pragma GCC unroll 8
      for (int j = 0; j < TK; ++j) acc[i * TK + j] = _mm256_fmadd_ps(qv, kv[j], acc[i * TK + j]);
    }
  }
}

// The 8 dot products of rows q[0, RG) x keys t0 + [0, TK) over nc chunks of 8, as one vector:
// lane i * TK + j = q[i] . k[t0 + j].
template <int RG, int TK, typename Keys>
__attribute__((always_inline)) inline __m256 dots8(const float* const* q, const Keys& k,
                                                   int64_t t0, int64_t nc) {
  __m256 acc[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  accumulate8<RG, TK>(acc, q, k, t0, 0, nc);
  return transpose_sum8(acc);
}

// Logits [G][ld] of query rows q[0, G) against the tile's 16 keys: rows in fours (tokens in
// pairs), then a pair, then one. pf takes a step per 8 dot products (tile_logit_steps(G)
// steps), so that the next tile's lines are asked for over the q.k as well as over the p.v, and
// the pairs are paced evenly over all those steps (LineCursor::pace). Requested over the p.v
// alone, `per` at a time (ending well before the tile did), they left the memory idle for much
// of the time. Paired A/B on the Zen 3 VM: over the q.k too, decode-bf16-bs128 1.06-1.09x,
// decode-f32-bs128 1.03-1.07x (6 or 12 steps' requests per q.k step: 0.98x and 0.86x); paced,
// another 1.05-1.13x for bf16, 1.05-1.06x for f32, 1.16x for fp8 (ending at 70% of the steps:
// 0.96x, 0.89x, 0.99x; NOTES.md).
constexpr int64_t tile_logit_steps(int64_t G) {
  return G / 4 * (kAvx2Tile / 2) + (G % 4 >= 2 ? kAvx2Tile / 4 : 0) + G % 2 * (kAvx2Tile / 8);
}
template <typename Keys>
inline void tile_logits_avx2(const float* const* q, int64_t G, const Keys& k, int64_t nc,
                             float* logits, int64_t ld, LineCursor& pf) {
  alignas(32) float lanes[8];
  int64_t g = 0;
  for (; g + 4 <= G; g += 4) {
    for (int t = 0; t < kAvx2Tile; t += 2) {
      pf.paced_step();
      _mm256_store_ps(lanes, dots8<4, 2>(q + g, k, t, nc));
      for (int i = 0; i < 4; ++i) {
        logits[(g + i) * ld + t] = lanes[2 * i];
        logits[(g + i) * ld + t + 1] = lanes[2 * i + 1];
      }
    }
  }
  for (; g + 2 <= G; g += 2) {
    for (int t = 0; t < kAvx2Tile; t += 4) {
      pf.paced_step();
      _mm256_store_ps(lanes, dots8<2, 4>(q + g, k, t, nc));
      for (int i = 0; i < 2; ++i) {
        for (int j = 0; j < 4; ++j) logits[(g + i) * ld + t + j] = lanes[4 * i + j];
      }
    }
  }
  if (g < G) {
    for (int t = 0; t < kAvx2Tile; t += 8) {
      pf.paced_step();
      _mm256_storeu_ps(logits + g * ld + t, dots8<1, 8>(q + g, k, t, nc));
    }
  }
}

// acc[i][c0 .. c0 + 8 DV) = factor[i] * acc[i][..] + sum_{t < n} probs[i][t] * v[t][..] for R
// rows (acc rows `acc_stride` floats apart, probs rows kAvx2Tile apart; value row t at
// v + t * v_stride, element type T, widened as loaded); pf's next requests go out one step
// per token.
template <int R, int DV, typename T>
__attribute__((always_inline)) inline void pv_avx2(float* acc, int64_t acc_stride,
                                                   const float* probs, const float* factor,
                                                   const T* v, int64_t v_stride, int64_t n,
                                                   int64_t c0, LineCursor& pf) {
  __m256 a[R][DV];
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i) {
    const __m256 f = _mm256_set1_ps(factor[i]);
#pragma GCC unroll 3
    for (int d = 0; d < DV; ++d) {
      a[i][d] = _mm256_mul_ps(_mm256_load_ps(acc + i * acc_stride + c0 + 8 * d), f);
    }
  }
  const T* row = v + c0;
  for (int64_t t = 0; t < n; ++t, row += v_stride) {
    pf.paced_step();
    __m256 x[DV];
    if constexpr (kLoadsInPairs<T> && DV % 2 == 0) {
#pragma GCC unroll 2
      for (int d = 0; d < DV; d += 2) load8x2(row + 8 * d, x[d], x[d + 1]);
    } else {
#pragma GCC unroll 3
      for (int d = 0; d < DV; ++d) x[d] = Load8<T>::whole(row + 8 * d);
    }
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      const __m256 pr = _mm256_broadcast_ss(probs + i * kAvx2Tile + t);
#pragma GCC unroll 3
      for (int d = 0; d < DV; ++d) a[i][d] = _mm256_fmadd_ps(pr, x[d], a[i][d]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 3
    for (int d = 0; d < DV; ++d) _mm256_store_ps(acc + i * acc_stride + c0 + 8 * d, a[i][d]);
  }
}

// pv_avx2 for R rows over every chunk of the row (nc chunks: threes, then a pair or one).
template <int R, typename T>
inline void pv_rows_avx2(float* acc, int64_t acc_stride, const float* probs, const float* factor,
                         const T* v, int64_t v_stride, int64_t n, int64_t nc, LineCursor& pf) {
  int64_t c = 0;
  if constexpr (kLoadsInPairs<T>) {  // passes of two chunks, read by one load
    for (; c + 2 <= nc; c += 2) {
      pv_avx2<R, 2>(acc, acc_stride, probs, factor, v, v_stride, n, 8 * c, pf);
    }
  }
  for (; c + 3 <= nc; c += 3) {
    pv_avx2<R, 3>(acc, acc_stride, probs, factor, v, v_stride, n, 8 * c, pf);
  }
  if (c + 2 <= nc) {
    pv_avx2<R, 2>(acc, acc_stride, probs, factor, v, v_stride, n, 8 * c, pf);
    c += 2;
  }
  if (c < nc) pv_avx2<R, 1>(acc, acc_stride, probs, factor, v, v_stride, n, 8 * c, pf);
}

// acc = factor * acc + P V for the G rows of one kv head (acc rows DP apart): fours, then the
// rest.
template <typename T>
inline void head_values_avx2(float* acc, int64_t DP, int64_t G, const float* probs,
                             const float* factor, const T* v, int64_t v_stride, int64_t n,
                             int64_t nc, LineCursor& pf) {
  int64_t g = 0;
  for (; g + 4 <= G; g += 4) {
    pv_rows_avx2<4>(acc + g * DP, DP, probs + g * kAvx2Tile, factor + g, v, v_stride, n, nc, pf);
  }
  float* a = acc + g * DP;
  const float* pr = probs + g * kAvx2Tile;
  switch (G - g) {
    case 3: pv_rows_avx2<3>(a, DP, pr, factor + g, v, v_stride, n, nc, pf); break;
    case 2: pv_rows_avx2<2>(a, DP, pr, factor + g, v, v_stride, n, nc, pf); break;
    case 1: pv_rows_avx2<1>(a, DP, pr, factor + g, v, v_stride, n, nc, pf); break;
    default: break;
  }
}

// One kv head's split-layout values [D, BS] (tokens [t0, t0 + n) of the block) as token rows
// dst[t][0, D) (rows DP apart): 8 x 8 blocks through registers, the edges one by one.
template <typename KV>
inline void transpose_split_values_avx2(const KV* head, int64_t BS, int64_t t0, int64_t n,
                                        int64_t D, float* dst, int64_t DP) {
  const int64_t n8 = n / 8 * 8, d8 = D / 8 * 8;
  for (int64_t d = 0; d < d8; d += 8) {
    for (int64_t t = 0; t < n8; t += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = Load8<KV>::whole(head + (d + i) * BS + t0 + t);
      transpose8x8(r);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + (t + i) * DP + d, r[i]);
    }
  }
  for (int64_t d = 0; d < D; ++d) {
    const KV* row = head + d * BS + t0;
    for (int64_t t = d < d8 ? n8 : 0; t < n; ++t) dst[t * DP + d] = widen(row[t]);
  }
}

// The split layout's values as the "keys" of dots8: value row d of a kv head's block, chunk c
// = its elements [8c, 8c + 8) from base + d * stride (tokens t_begin + 8c onwards).
template <typename T>
struct StridedRows {
  const T* base;
  int64_t stride;
  static constexpr bool kPairs = kLoadsInPairs<T>;
  __attribute__((always_inline)) __m256 chunk(int64_t j, int64_t c) const {
    return Load8<T>::whole(base + j * stride + 8 * c);
  }
  __attribute__((always_inline)) void chunks2(int64_t j, int64_t c, __m256& x0, __m256& x1) const {
    load8x2(base + j * stride + 8 * c, x0, x1);
  }
};

// acc[i][0, D) = factor[i] * acc[i][..] + sum_t probs[i][t] v[t][..] for RG rows, the values in
// vLLM's split layout ([D, BS] per kv head, from v = the first token's column) read in place as
// D rows over the tokens: dots8 with probability rows for query rows and value rows for keys,
// 8 sums at a time. `full` chunks of 8 tokens come from the cache; a partial last chunk from
// `tail` ([D][8], zero past the tokens; nullptr for none), its probabilities zero past n. The
// sums of RG rows x 8 / RG value rows come out interleaved and are put in d order in registers.
template <int RG, typename KV>
inline void pv_split_rows_avx2(float* acc, int64_t acc_stride, const float* const* probs,
                               const float* factor, const KV* v, int64_t BS, int64_t full,
                               const float* tail, int64_t D, LineCursor& pf) {
  constexpr int TK = 8 / RG;
  const StridedRows<KV> values{v, BS};
  const StridedRows<float> tails{tail, 8};
  const float* tail_probs[RG];
  __m256 f[RG];
  for (int i = 0; i < RG; ++i) {
    tail_probs[i] = probs[i] + 8 * full;
    f[i] = _mm256_set1_ps(factor[i]);
  }
  for (int64_t d = 0; d < D; d += 8) {
    __m256 r[RG];  // r[k] lane i * TK + j: row i against value row d + k * TK + j
#pragma GCC unroll 4
    for (int k = 0; k < RG; ++k) {
      pf.paced_step();
      __m256 a[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
      accumulate8<RG, TK>(a, probs, values, d + k * TK, 0, full);
      if (tail) accumulate8<RG, TK>(a, tail_probs, tails, d + k * TK, 0, 1);
      r[k] = transpose_sum8(a);
    }
    __m256 out[RG];  // row i's sums for value rows d .. d + 7
    if constexpr (RG == 4) {  // a 4 x 4 transpose of (row, value-row pair) elements
      const __m256d r0 = _mm256_castps_pd(r[0]), r1 = _mm256_castps_pd(r[1]);
      const __m256d r2 = _mm256_castps_pd(r[2]), r3 = _mm256_castps_pd(r[3]);
      const __m256d lo01 = _mm256_unpacklo_pd(r0, r1), hi01 = _mm256_unpackhi_pd(r0, r1);
      const __m256d lo23 = _mm256_unpacklo_pd(r2, r3), hi23 = _mm256_unpackhi_pd(r2, r3);
      out[0] = _mm256_castpd_ps(_mm256_permute2f128_pd(lo01, lo23, 0x20));
      out[1] = _mm256_castpd_ps(_mm256_permute2f128_pd(hi01, hi23, 0x20));
      out[2] = _mm256_castpd_ps(_mm256_permute2f128_pd(lo01, lo23, 0x31));
      out[3] = _mm256_castpd_ps(_mm256_permute2f128_pd(hi01, hi23, 0x31));
    } else if constexpr (RG == 2) {
      out[0] = _mm256_permute2f128_ps(r[0], r[1], 0x20);
      out[1] = _mm256_permute2f128_ps(r[0], r[1], 0x31);
    } else {
      out[0] = r[0];
    }
#pragma GCC unroll 4
    for (int i = 0; i < RG; ++i) {
      float* a = acc + i * acc_stride + d;
      _mm256_store_ps(a, _mm256_fmadd_ps(_mm256_load_ps(a), f[i], out[i]));
    }
  }
}

// One online-softmax step per row for the G rows of kv head h over n tokens whose first key is
// `dist0` positions after the query: logits[g * ld + t] (t < n) get the soft cap and ALiBi,
// tokens past n are masked, factor[g] takes the accumulator's rescale, and probs[g * ld + t]
// the probabilities (zero past n, up to n rounded up to 8); the logits are overwritten.
inline void softmax_rows_avx2(const Problem& p, RowsState& st, int64_t h, float* logits,
                              float* probs, float* factor, int64_t ld, int64_t n, float dist0) {
  const int64_t G = p.group, chunks = (n + 7) / 8;
  const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 n_lanes = _mm256_set1_ps(static_cast<float>(n));
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t g = 0; g < G; ++g) {
    const int64_t row = h * G + g;
    float* l = logits + g * ld;
    __m256 mx = minus_inf;
    for (int64_t c = 0; c < chunks; ++c) {
      const __m256 lane = _mm256_add_ps(iota, _mm256_set1_ps(8.0f * static_cast<float>(c)));
      __m256 v = _mm256_loadu_ps(l + 8 * c);
      if (p.cap > 0.0f) v = soft_cap8(v, p.cap);
      if (p.alibi) {
        const __m256 dist = _mm256_add_ps(lane, _mm256_set1_ps(dist0));
        v = _mm256_fmadd_ps(_mm256_set1_ps(p.alibi[row]), dist, v);
      }
      v = _mm256_blendv_ps(minus_inf, v, _mm256_cmp_ps(lane, n_lanes, _CMP_LT_OQ));
      _mm256_storeu_ps(l + 8 * c, v);
      mx = _mm256_max_ps(mx, v);
    }
    OnlineSoftmaxRow& state = st.rows[row];
    factor[g] = state.rescale(hmax8(mx));
    const __m256 m = _mm256_set1_ps(state.max);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m256 pr = exp8(_mm256_sub_ps(_mm256_loadu_ps(l + 8 * c), m));
      _mm256_storeu_ps(probs + g * ld + 8 * c, pr);
      sum = _mm256_add_ps(sum, pr);
    }
    state.add_sum(hsum8(sum));
  }
}

// The scratch of the split layout's block step: logits and probabilities [G][ld] (ld = the
// block size rounded up to 16), factors [G], the partial chunk's values [D][8], and the query
// and probability rows of the kv head.
struct SplitBlockScratch {
  float* logits;
  float* probs;
  float* factor;
  float* tail;
  int64_t ld;
  const float** qrows;
  const float** prows;
};

// One kv head's tokens [t_begin, t_begin + n) of a block in vLLM's split layout (khead / vhead:
// the head's [D / x, BS, x] keys and [D, BS] values; D a multiple of 8 and of x), both read in
// place: the G rows' logits in tiles of 16 (SplitKeys), one online-softmax step per row over
// all n tokens, then acc = factor * acc + P V in the dot form (pv_split_rows_avx2). The first
// key is `dist0` positions after the query (ALiBi).
template <typename KV>
inline void attend_split_block_avx2(const Problem& p, RowsState& st, const float* q, int64_t DP,
                                    int64_t nc, int64_t h, const KV* khead, const KV* vhead,
                                    int64_t t_begin, int64_t n, float dist0,
                                    const SplitBlockScratch& s, LineCursor& pf) {
  const int64_t G = p.group, BS = p.block_size, D = p.head_size, x = p.x, ld = s.ld;
  for (int64_t g = 0; g < G; ++g) {
    s.qrows[g] = q + (h * G + g) * DP;
    s.prows[g] = s.probs + g * ld;
  }
  // pf.paced_step()s: the logits' (tile_logit_steps per tile), then pv_split_rows_avx2's.
  const int64_t tiles = (n + kAvx2Tile - 1) / kAvx2Tile;
  const int64_t steps = tiles * tile_logit_steps(G) +
                        (G / 4 * 4 + (G % 4 >= 2 ? 2 : 0) + G % 2) * (D / 8);
  pf.pace(steps);
  const KV* rows[kAvx2Tile];
  for (int64_t t0 = 0; t0 < n; t0 += kAvx2Tile) {
    const int64_t m = std::min<int64_t>(kAvx2Tile, n - t0);
    for (int64_t t = 0; t < kAvx2Tile; ++t) {
      rows[t] = khead + (t_begin + t0 + std::min(t, m - 1)) * x;
    }
    tile_logits_avx2(s.qrows, G, SplitKeys<KV>{rows, BS * x}, nc, s.logits + t0, ld, pf);
  }
  softmax_rows_avx2(p, st, h, s.logits, s.probs, s.factor, ld, n, dist0);
  const int64_t full = n / 8, rem = n % 8;
  const float* tail = nullptr;
  if (rem > 0) {
    for (int64_t d = 0; d < D; ++d) {
      const KV* src = vhead + d * BS + t_begin + 8 * full;
      for (int64_t t = 0; t < 8; ++t) s.tail[d * 8 + t] = t < rem ? widen(src[t]) : 0.0f;
    }
    tail = s.tail;
  }
  float* acc = st.acc.get() + h * G * DP;
  const KV* v = vhead + t_begin;
  int64_t g = 0;
  for (; g + 4 <= G; g += 4) {
    pv_split_rows_avx2<4>(acc + g * DP, DP, s.prows + g, s.factor + g, v, BS, full, tail, D, pf);
  }
  if (g + 2 <= G) {
    pv_split_rows_avx2<2>(acc + g * DP, DP, s.prows + g, s.factor + g, v, BS, full, tail, D, pf);
    g += 2;
  }
  if (g < G) {
    pv_split_rows_avx2<1>(acc + g * DP, DP, s.prows + g, s.factor + g, v, BS, full, tail, D, pf);
  }
}

// The scratch of one item's head steps: logits and probabilities [G][16], factors [G], and
// the kv head's query rows.
struct HeadScratchAvx2 {
  float* logits;
  float* probs;
  float* factor;
  const float** qrows;
};

// One kv head's step over a tile of n tokens whose first key is `dist0` positions after the
// query (k_pos - q_pos, for ALiBi): the G rows' logits against the keys (RowKeys or
// SplitKeys), one online-softmax step per row (soft cap, ALiBi, tokens past n masked), and
// acc = factor * acc + P V (value row t at v + t * v_stride, element type T).
template <typename Keys, typename T>
inline void attend_head_avx2(const Problem& p, RowsState& st, const float* q, int64_t DP,
                             int64_t nc, int64_t h, const Keys& k, const T* v, int64_t v_stride,
                             int64_t n, float dist0, const HeadScratchAvx2& s, LineCursor& pf) {
  const int64_t G = p.group;
  for (int64_t g = 0; g < G; ++g) s.qrows[g] = q + (h * G + g) * DP;
  tile_logits_avx2(s.qrows, G, k, nc, s.logits, kAvx2Tile, pf);
  softmax_rows_avx2(p, st, h, s.logits, s.probs, s.factor, kAvx2Tile, n, dist0);
  head_values_avx2(st.acc.get() + h * G * DP, DP, G, s.probs, s.factor, v, v_stride, n, nc, pf);
}

// One item's blocks for cache element type KV (e4m3 as e4m3_folded_t: decode_item_avx2).
template <typename KV>
void decode_item_avx2_as(const Problem& p, const Item& it, float* scratch,
                         std::atomic<int32_t>* arrivals) {
  const int64_t D = p.head_size, G = p.group, Hq = p.num_heads, Hkv = p.num_kv_heads;
  const int64_t BS = p.block_size;
  const int64_t DP = round_up(D, 16);  // finish_item's and the scratch rows' padding
  const int64_t nc = (D + 7) / 8;      // chunks of 8 elements the math reads
  const int64_t q_pos = p.seq_lens[it.seq] - 1;
  const int32_t* table = p.tables + it.seq * p.max_blocks;
  const KV* kc = static_cast<const KV*>(p.key_cache);
  const KV* vc = static_cast<const KV*>(p.value_cache);
  const bool split = p.layout == CacheLayout::kSplit;
  // Keys and values are read in place (widened as loaded) when every chunk of 8 lies inside the
  // row (the split layout's D is a multiple of x: paged_decode.cc); else they go through float32
  // tiles, the split layout's values transposed.
  const bool in_place = D % 8 == 0;

  FloatBuffer q(static_cast<size_t>(Hq * DP));  // scaled by qk_scale, zero-padded
  for (int64_t r = 0; r < Hq; ++r) load_query_row(p, it.seq, r, q.get() + r * DP);
  RowsState st(Hq, DP);
  // Float32 key and value tiles [16][DP] (columns past D stay zero), logits and probabilities
  // [G][16], factors [G].
  FloatBuffer tiles(static_cast<size_t>(2 * kAvx2Tile * DP + 2 * G * kAvx2Tile + G));
  float* ktile = tiles.get();
  float* vtile = ktile + kAvx2Tile * DP;
  std::vector<const float*> qrows(G);
  const HeadScratchAvx2 hs{vtile + kAvx2Tile * DP, vtile + kAvx2Tile * DP + G * kAvx2Tile,
                           vtile + kAvx2Tile * DP + 2 * G * kAvx2Tile, qrows.data()};
  // The split layout's block step (attend_split_block_avx2).
  const int64_t ld = round_up(BS, kAvx2Tile);
  const bool split_blocks = split && in_place;
  FloatBuffer split_buffer(split_blocks ? static_cast<size_t>(2 * G * ld + G + 8 * D) : 0);
  std::vector<const float*> prows(split_blocks ? G : 0);
  float* const sb = split_buffer.get();
  const SplitBlockScratch split_scratch{
      sb, sb + G * ld, sb + 2 * G * ld, sb + 2 * G * ld + G, ld, qrows.data(), prows.data()};
  const KV* rows[kAvx2Tile];       // the keys in place: token rows, or split-layout pieces
  const float* tile_rows[kAvx2Tile];  // through the tile
  for (int t = 0; t < kAvx2Tile; ++t) tile_rows[t] = ktile + t * DP;

  const int64_t elem = static_cast<int64_t>(sizeof(KV));
  const int64_t row_stride = Hkv * D;  // token-major: token t -> t + 1 inside a block
  const int64_t x = p.x;               // split: key elements per 16 bytes
  const int64_t head_elems = D * BS;   // split: one kv head's block in either cache
  // p.v passes per kv head and tile (pv_rows_avx2: chunks in threes, or in pairs); a kv head's
  // tile of n tokens takes tile_logit_steps(G) + passes * n pf.paced_step()s.
  const int64_t passes = (G + 3) / 4 * (kLoadsInPairs<KV> ? (nc + 1) / 2 : (nc + 2) / 3);
  const int64_t first_block = it.begin / BS, last_block = (it.end - 1) / BS;
  for (int64_t b = first_block; b <= last_block; ++b) {
    const int64_t t_begin = std::max(it.begin, b * BS) - b * BS;
    const int64_t t_end = std::min(it.end, (b + 1) * BS) - b * BS;
    if (split) {
      // Kv heads outer: a head's block is contiguous in each cache and is read through before
      // the next, whose blocks (keys and values) are requested over this one's q.k and p.v
      // steps.
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t head = (table[b] * Hkv + h) * head_elems;
        LineCursor pf;
        if (p.prefetch_tiles > 0 && (h + 1 < Hkv || b < last_block)) {
          const int64_t next = h + 1 < Hkv ? head + head_elems : table[b + 1] * Hkv * head_elems;
          pf = LineCursor(kc + next, vc + next, head_elems * elem,
                          2 * head_elems * elem > p.nta_limit);
        }
        if (split_blocks) {
          attend_split_block_avx2(p, st, q.get(), DP, nc, h, kc + head, vc + head, t_begin,
                                  t_end - t_begin, static_cast<float>(b * BS + t_begin - q_pos),
                                  split_scratch, pf);
          continue;
        }
        // D not a multiple of 8: keys widened and values transposed into float32 tiles.
        const int64_t tiles = (t_end - t_begin + kAvx2Tile - 1) / kAvx2Tile;
        pf.pace(tiles * tile_logit_steps(G) + passes * (t_end - t_begin));
        for (int64_t t0 = t_begin; t0 < t_end; t0 += kAvx2Tile) {
          const int64_t n = std::min<int64_t>(kAvx2Tile, t_end - t0);
          const float dist0 = static_cast<float>(b * BS + t0 - q_pos);
          transpose_split_values_avx2(vc + head, BS, t0, n, D, vtile, DP);
          for (int64_t t = 0; t < n; ++t) {
            for (int64_t j = 0; j < D; j += x) {
              widen_span(kc + head + (j / x) * BS * x + (t0 + t) * x, std::min(x, D - j),
                         ktile + t * DP + j);
            }
          }
          for (int64_t t = n; t < kAvx2Tile; ++t) tile_rows[t] = ktile + (n - 1) * DP;
          attend_head_avx2(p, st, q.get(), DP, nc, h, RowKeys<float>{tile_rows}, vtile, DP, n,
                           dist0, hs, pf);
          for (int64_t t = n; t < kAvx2Tile; ++t) tile_rows[t] = ktile + t * DP;
        }
      }
      continue;
    }
    // Token-major [NB, BS, Hkv, D]: tiles outer, kv heads inner; the next tile's
    // [next_n, Hkv, D] of each cache requested over this tile's q.k and p.v steps, into L2 when
    // the two together outgrow L1 (nta_limit_bytes).
    for (int64_t t0 = t_begin; t0 < t_end; t0 += kAvx2Tile) {
      const int64_t n = std::min<int64_t>(kAvx2Tile, t_end - t0);
      const float dist0 = static_cast<float>(b * BS + t0 - q_pos);
      int64_t next_b = b, next_t0 = t0 + kAvx2Tile;
      if (next_t0 >= t_end) {
        next_b = b + 1;
        next_t0 = 0;
      }
      LineCursor pf;
      if (next_b <= last_block && p.prefetch_tiles > 0) {
        const int64_t next_n =
            std::min<int64_t>(kAvx2Tile, std::min(it.end - next_b * BS, BS) - next_t0);
        const int64_t off = (table[next_b] * BS + next_t0) * row_stride;
        const int64_t bytes = next_n * row_stride * elem;
        pf = LineCursor(kc + off, vc + off, bytes, 2 * bytes > p.nta_limit);
      }
      pf.pace(Hkv * (tile_logit_steps(G) + passes * n));
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t row0 = (table[b] * BS + t0) * row_stride + h * D;
        if (in_place) {
          for (int64_t t = 0; t < kAvx2Tile; ++t) {
            rows[t] = kc + row0 + std::min(t, n - 1) * row_stride;
          }
          attend_head_avx2(p, st, q.get(), DP, nc, h, RowKeys<KV>{rows}, vc + row0, row_stride,
                           n, dist0, hs, pf);
        } else {
          for (int64_t t = 0; t < n; ++t) {
            widen_span(kc + row0 + t * row_stride, D, ktile + t * DP);
            widen_span(vc + row0 + t * row_stride, D, vtile + t * DP);
          }
          for (int64_t t = n; t < kAvx2Tile; ++t) tile_rows[t] = ktile + (n - 1) * DP;
          attend_head_avx2(p, st, q.get(), DP, nc, h, RowKeys<float>{tile_rows}, vtile, DP, n,
                           dist0, hs, pf);
          for (int64_t t = n; t < kAvx2Tile; ++t) tile_rows[t] = ktile + t * DP;
        }
      }
    }
  }
  finish_item(p, it, st, DP, scratch, arrivals);
}

// The item function of AVX2 builds. An e4m3 cache is read as 2^-8 of its values
// (e4m3_folded_t), the 2^8 folded into the query's scale and the output's: powers of two, so
// the logits and outputs round exactly as with the values themselves.
template <typename KV>
void decode_item_avx2(const Problem& p, const Item& it, float* scratch,
                      std::atomic<int32_t>* arrivals) {
  if constexpr (std::is_same_v<KV, e4m3_t>) {
    Problem folded = p;
    folded.qk_scale *= kE4m3Fold;
    folded.v_scale *= kE4m3Fold;
    decode_item_avx2_as<e4m3_folded_t>(folded, it, scratch, arrivals);
  } else {
    decode_item_avx2_as<KV>(p, it, scratch, arrivals);
  }
}

// Part of the decode kernel (paged_decode.cc), not a header of its own: included by
// decode_kernel.h inside its namespaces and inside its `#if JAX_ATTN_AVX512`, after
// decode_vec.h and decode_fp8.h, after split_logits (it uses Problem, Queries, RowsState,
// LineCursor and split_logits). It includes nothing itself.
//
// vLLM's split layout, one kv head's block at a time, with the values read as they lie.
// A head's values in that layout are [D, BS]: dimension d of the block's tokens is one
// contiguous row. The tile path (attend_tile) transposes them 16 tokens at a time into token
// rows, which costs more than the p.v products themselves. Here a dimension's row is a vector
// over tokens instead, multiplied lane by lane by the probabilities of the same tokens:
//   lanes[r][d][i] += sum over the block's token vectors j of p[r][16j + i] v[d][16j + i]
// (bf16 values: vdpbf16ps over 32 tokens per vector, a lane holding a token pair). The
// 16 lanes of each (row, dim) are added only once, at the item's end (reduce_lanes): no
// transpose, no broadcast, one FMA (or vdpbf16ps) per 16 (32) products. The softmax steps
// over the whole visible part of a block: one max, one rescale of the lanes per block.
// The lanes, [Hq][DP][16] float32 per item, live in per-thread scratch; a kv head's share
// ([G][DP][16], 32 KiB at G 4, D 128) stays in L1/L2 while its block is read.
// Keys are dotted in place as on the tile path (split_logits).
// For float32 caches under float32 queries and bf16 caches under bf16 queries with
// vdpbf16ps, at blocks of kMinLaneBlock tokens or more (fp8 values this way, converted 64
// tokens at a time, gained nothing: its time goes to the keys), and only where
// $JAX_ATTN_CPU_SPLIT_LANES=1 (read per call). The lanes are faster with the cache in L2 and
// slower from memory, which is where a decode reads it: their 32 KiB per kv head of lanes,
// read and written per block beside the block's keys and values, overlap worse with the
// prefetched reads. Lanes / tile path, one process, alternated calls (2-core Zen 4 VM, 32 x
// 1024 keys, block 128, after the tile path's spills were fixed; NOTES.md): bf16 from memory
// 6.46 / 5.39 ms, from L2 2.68 / 3.30; f32 10.50 / 8.91 and 4.82 / 6.08; 8 x 8192 bf16 11.56 /
// 9.38, f32 19.58 / 15.29; mixed bf16 12.69 / 11.87, f32 22.14 / 20.90. Kept as the A/B
// switch for other CPUs.
#pragma once

// Blocks of at least this many tokens take the lanes. At 32 and 64 the lanes' reload and
// rescale per block cost more than they save (split decode from memory, 2-core Zen 5 VM,
// NOTES.md).
constexpr int64_t kMinLaneBlock = 128;

// Per-thread lane scratch (a head's first block writes its lanes without reading them).
thread_local Scratch tls_lanes;

// The p.v of RG query rows against 4 dimensions [d0, d0 + 4) of one head block's values:
// lanes[r][d] = lanes[r][d] * factor[r] (or nothing read when `first`) + the block's products.
// Values: row d at values + d * BS, tokens [0, nb) of it from `values` (already offset to the
// first visible token); probabilities: float32 prob[r][nb_padded] (kDot: bf16 pairs, one vector
// per 32 tokens). Tokens past nb are masked to zeros in the values too (a NaN there times a
// zero probability would still be NaN).
template <typename KV, int RG, bool kDot>
inline void lanes_pv(const KV* values, int64_t BS, int64_t nb, int64_t d0, const void* prob,
                     int64_t prob_stride, const float* factor, bool first, float* const* lanes) {
  __m512 acc[RG][4];
#pragma GCC unroll 4
  for (int r = 0; r < RG; ++r) {
    const __m512 f = _mm512_set1_ps(factor[r]);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      acc[r][j] = first ? _mm512_setzero_ps()
                        : _mm512_mul_ps(_mm512_load_ps(lanes[r] + 16 * (d0 + j)), f);
    }
  }
  if constexpr (!kDot) {
    const float* pr = static_cast<const float*>(prob);
    for (int64_t t = 0; t < nb; t += 16) {
      const __mmask16 m = tail_mask(nb - t);
      __m512 v[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) v[j] = _mm512_maskz_loadu_ps(m, values + (d0 + j) * BS + t);
#pragma GCC unroll 4
      for (int r = 0; r < RG; ++r) {
        const __m512 p = _mm512_load_ps(pr + r * prob_stride + t);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(p, v[j], acc[r][j]);
      }
    }
  } else {
#if JAX_ATTN_DECODE_BF16_DOT
    const __m512i* pp = static_cast<const __m512i*>(prob);  // [RG][prob_stride] vectors
    for (int64_t t = 0; t < nb; t += 32) {
      const __mmask32 m = nb - t >= 32 ? static_cast<__mmask32>(0xffffffffu)
                                       : static_cast<__mmask32>((1u << (nb - t)) - 1u);
      __m512i v[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm512_maskz_loadu_epi16(m, reinterpret_cast<const bf16_t*>(values) +
                                               (d0 + j) * BS + t);
      }
#pragma GCC unroll 4
      for (int r = 0; r < RG; ++r) {
        const __m512bh p = (__m512bh)_mm512_load_si512(pp + r * prob_stride + t / 32);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], p, (__m512bh)v[j]);
      }
    }
#endif
  }
#pragma GCC unroll 4
  for (int r = 0; r < RG; ++r) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) _mm512_store_ps(lanes[r] + 16 * (d0 + j), acc[r][j]);
  }
}

// Scratch of attend_head_block_lanes for one item: the G rows' logits of a block (float32,
// [G][logit_stride]), their probabilities (float32 [G][prob_stride], or under kDot bf16 pairs,
// [G][prob_stride] vectors of 32 tokens each) and the rows' rescale factors ([G]).
struct LaneBlockScratch {
  float* logits;
  void* prob;
  float* factor;
  int64_t logit_stride, prob_stride;
};

// One kv head h of block `b`: its visible tokens [t_begin, t_end) of the block (head block
// offset `head` elements into either cache), for the G query rows of the head.
template <typename KV, int NC, bool kDot>
__attribute__((noinline)) void attend_head_block_lanes(
    const Problem& p, const Queries& q, RowsState& st, float* lanes, int64_t head, int64_t h,
    int64_t t_begin, int64_t t_end, float first_distance, bool first, LineCursor prefetcher,
    const LaneBlockScratch& s) {
  constexpr int64_t DP = NC * 16;
  const int64_t G = p.group, D = p.head_size, BS = p.block_size;
  const int64_t nb = t_end - t_begin;
  const KV* kc = static_cast<const KV*>(p.key_cache) + head;
  const KV* vc = static_cast<const KV*>(p.value_cache) + head;
  LineCursor pf = prefetcher;  // a local copy: kept in registers
  // The prefetches, spread over the logits' chunks and the p.v's (dims, rows) steps.
  const int64_t tiles = (nb + 15) / 16, row_groups = (G + 3) / 4;
  const int64_t key_steps = tiles * row_groups * (D * static_cast<int64_t>(sizeof(KV)) / 16);
  const int64_t steps = std::max<int64_t>(1, key_steps + D / 4 * row_groups);
  const int64_t per_step = (pf.left + steps - 1) / steps;
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());

  // Logits of the block's tiles, 16 tokens at a time, into s.logits[g][t - t_begin].
  __m512 pre[4];
  for (int64_t t0 = t_begin; t0 < t_end; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, t_end - t0);
    const __m512 distance =
        _mm512_add_ps(iota, _mm512_set1_ps(first_distance + static_cast<float>(t0 - t_begin)));
    const auto store = [&](int64_t g, __m512 x) {
      const int64_t row = h * G + g;
      if (p.cap > 0.0f) x = soft_cap16(x, p.cap);
      if (p.alibi) x = _mm512_fmadd_ps(_mm512_set1_ps(p.alibi[row]), distance, x);
      _mm512_storeu_ps(s.logits + g * s.logit_stride + (t0 - t_begin),
                       _mm512_mask_mov_ps(neg_inf, tail_mask(n), x));
    };
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      const int rg = static_cast<int>(std::min<int64_t>(4, G - g0));
      split_logits<NC, kDot>(p, q, kc, t0, n, h * G + g0, rg, pre, pf, per_step);
      for (int r = 0; r < rg; ++r) store(g0 + r, pre[r]);
    }
  }

  // The softmax over the block, row by row: one max, one rescale factor, the probabilities
  // (kDot: rounded to bf16, tokens in order, 32 per vector, as the tile path rounds them).
  float* factor = s.factor;
  for (int64_t g = 0; g < G; ++g) {
    const float* x = s.logits + g * s.logit_stride;
    __m512 m = neg_inf;
    for (int64_t t = 0; t < nb; t += 16) {
      m = _mm512_max_ps(m, _mm512_mask_loadu_ps(neg_inf, tail_mask(nb - t), x + t));
    }
    OnlineSoftmaxRow& state = st.rows[h * G + g];
    factor[g] = state.rescale(_mm512_reduce_max_ps(m));
    const __m512 max = _mm512_set1_ps(state.max);
    __m512 sum = _mm512_setzero_ps();
    [[maybe_unused]] __m512 prev = _mm512_setzero_ps();  // kDot: the previous 16 tokens
    for (int64_t t = 0; t < round_up(nb, kDot ? 32 : 16); t += 16) {
      const __mmask16 valid = t < nb ? tail_mask(nb - t) : static_cast<__mmask16>(0);
      const __m512 pr = _mm512_maskz_mov_ps(
          valid, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, x + t), max)));
      sum = _mm512_add_ps(sum, pr);
      if constexpr (kDot) {
#if JAX_ATTN_DECODE_BF16_DOT
        if (t % 32 == 16) {  // tokens t - 16 .. t + 15 as one vector of bf16, in order
          static_cast<__m512i*>(s.prob)[g * s.prob_stride + t / 32] =
              (__m512i)_mm512_cvtne2ps_pbh(pr, prev);
        }
        prev = pr;
#endif
      } else {
        _mm512_store_ps(static_cast<float*>(s.prob) + g * s.prob_stride + t, pr);
      }
    }
    state.add_sum(_mm512_reduce_add_ps(sum));
  }

  // p.v: 4 dims x 4 rows of lanes at a time, every visible token of the block per step.
  const KV* values = vc + t_begin;
  for (int64_t d0 = 0; d0 < D; d0 += 4) {
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      pf.issue(per_step);
      const int64_t row0 = h * G + g0;
      const int rg = static_cast<int>(std::min<int64_t>(4, G - g0));
      float* rows[4] = {};
      for (int r = 0; r < rg; ++r) rows[r] = lanes + (row0 + r) * DP * 16;
      const void* prob = kDot ? static_cast<const void*>(static_cast<const __m512i*>(s.prob) +
                                                         g0 * s.prob_stride)
                              : static_cast<const void*>(static_cast<const float*>(s.prob) +
                                                         g0 * s.prob_stride);
      switch (rg) {
        case 4:
          lanes_pv<KV, 4, kDot>(values, BS, nb, d0, prob, s.prob_stride, factor + g0, first, rows);
          break;
        case 3:
          lanes_pv<KV, 3, kDot>(values, BS, nb, d0, prob, s.prob_stride, factor + g0, first, rows);
          break;
        case 2:
          lanes_pv<KV, 2, kDot>(values, BS, nb, d0, prob, s.prob_stride, factor + g0, first, rows);
          break;
        default:
          lanes_pv<KV, 1, kDot>(values, BS, nb, d0, prob, s.prob_stride, factor + g0, first, rows);
          break;
      }
    }
  }
  pf.issue(pf.left);
}

// The item's end: each row's lanes added up into RowsState::acc ([Hq][DP], dims >= D zeros).
template <int NC>
inline void reduce_lanes(const float* lanes, int64_t Hq, int64_t D, float* acc) {
  constexpr int64_t DP = NC * 16;
  for (int64_t r = 0; r < Hq; ++r) {
    for (int64_t d0 = 0; d0 < DP; d0 += 16) {
      __m512 v[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        v[i] = d0 + i < D ? _mm512_load_ps(lanes + (r * DP + d0 + i) * 16) : _mm512_setzero_ps();
      }
      _mm512_store_ps(acc + r * DP + d0, transpose_sum16(v));
    }
  }
}

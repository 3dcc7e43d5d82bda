// A part of the decode kernel of its own (included by decode_kernel.h inside its namespaces, after
// attend_tile_rows): bf16 queries on jax_attn's token-major bf16 or fp8 cache, every product
// by vdpbf16ps, for GQA groups of 4 query rows or more (attend_tile_quads). It uses Problem,
// RowsState, OnlineSoftmaxRow and decode_fp8.h's conversions.
//
// Why: attend_tile_rows' logits come from one vdpbf16ps chain per (query row, token), 16 lanes
// each, summed across lanes by a 16-vector transpose tree; the tree, the per-tile softmax of
// every row and the scalar bookkeeping around them took two thirds of its time (67 cycles per
// token and kv head from L2, against ~16 for the products; 2-core Zen 5 VM, NOTES.md).
//
// The q.k: a quad is 4 query rows of one kv head, one per 128-bit lane. A 16-byte piece s of
// a key row (8 bf16: pairs 4s .. 4s + 3) is broadcast to all four lanes and dotted with the
// quad's piece s (lane g: row g's pairs 4s .. 4s + 3), so one vdpbf16ps does 4 rows x 4 pairs
// and a token's whole row is one chain of D / 8 of them (two, even and odd s, for latency).
// The 4 partial sums per (row, token) are then added by an in-lane 4 x 4 transpose per 4
// tokens: 9 instructions per 16 logits, against ~45 for the tree.
// The p.v: token pairs of a value chunk interleaved by vpunpck{l,h}wd (in-lane, no permute
// index) and dotted with the pair's two probabilities (rounded to bf16, as attend_tile_rows
// does); the dimensions then lie permuted inside each 32 (lo: lane L holds dims 8L .. 8L + 3,
// hi: 8L + 4 .. 8L + 7), in that order in RowsState's rows (round_up(D, 32) floats apart)
// until unpermute_quad_rows puts them back at the end of the item.
// A tile's kv heads go in turn: the head's 16 key rows (Hkv * D elements apart), its rows'
// softmax, its values; fp8 keys are first widened into a bf16 tile, and fp8 values straight
// into the p.v's interleaved pairs (convert_pairs_fp8 in quad_pair_index's order; decode_fp8.h).
//
// Measured (2-core Zen 5 VM, 32 x 1024 keys, Hkv 8, D 128, block 128; NOTES.md): from L2 at
// G = 4, 55-57 cycles per token and kv head against 66 (logits ~17, p.v ~17, softmax ~11, the
// rest the tile walk); a vdpbf16ps fed by a 128-bit broadcast load issues at 1.34 per cycle
// against 2 from registers, which bounds the logits. From memory at G = 8: bf16 2.9-3.3 ms
// against 3.7-3.8, fp8 3.3-3.4 against 3.6-3.8; at G = 4 the step is memory-bound and the
// two paths are level within the VM's drift (bf16 3.1-3.3 / 3.1, fp8 2.2 / 2.2-2.35 ms).
// The softmax's lazy reference (decode_kernel.h's kDecodeLazyMargin) and per-lane sums
// (before: a max and a sum across lanes, two exp16 and a rescale of every row's output per
// tile), 2-core Zen 4 VM, paired workers, G = 4, block 128: from L2 bf16 1.14x faster, e4m3
// 1.04x; e4m3 from memory 1.045x (NOTES.md 2026-12-04 15:56).
#pragma once

// Scratch of attend_tile_quads for one item: logits [G][16], probabilities (bf16 pairs)
// [G][8] words, rescale factors [G], each query row's running sum of probabilities per lane
// ([Hq][16], zeros at the item's start; fold_quad_sums adds the lanes up at its end), and for
// fp8 the head's widened key and value tiles.
struct QuadScratch {
  float* logits;
  uint32_t* probs;
  float* factor;
  float* sums;
  bf16_t* keys;    // fp8: [16][DP2]
  bf16_t* values;  // fp8: [8][DP2] words, the head's token pairs as the p.v reads them
};

// The item's end: each row's lane sums (QuadScratch::sums) into its OnlineSoftmaxRow.
inline void fold_quad_sums(const float* sums, RowsState& st, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    st.rows[r].sum = _mm512_reduce_add_ps(_mm512_load_ps(sums + 16 * r));
  }
}

// The queries of one item for the quads: per kv head h and quad u (query rows h * G + 4u ..
// + 3; rows past G are zeros), D / 8 vectors; vector s, lane group g = row 4u + g's elements
// [8s, 8s + 8). dst: Hkv * ceil(G / 4) * D / 8 vectors.
inline void pack_query_quads(const bf16_t* q, int64_t Hkv, int64_t G, int64_t D, bf16_t* dst) {
  const int64_t U = (G + 3) / 4, D8 = D / 8;
  for (int64_t h = 0; h < Hkv; ++h) {
    for (int64_t u = 0; u < U; ++u) {
      for (int64_t s = 0; s < D8; ++s) {
        bf16_t* v = dst + ((h * U + u) * D8 + s) * 32;
        for (int64_t g = 0; g < 4; ++g) {
          const int64_t r = 4 * u + g;
          if (r < G) {
            std::memcpy(v + 8 * g, q + (h * G + r) * D + 8 * s, 8 * sizeof(bf16_t));
          } else {
            std::memset(v + 8 * g, 0, 8 * sizeof(bf16_t));
          }
        }
      }
    }
  }
}

// Kv head h's quads in pack_query_quads' output.
inline const bf16_t* quads_of_head(const bf16_t* quads, int64_t h, int64_t G, int64_t D) {
  return quads + h * ((G + 3) / 4) * (D / 8) * 32;
}

#if JAX_ATTN_DECODE_BF16_DOT

// Lane group g of the result: (sum of a0's group g, of a1's, of a2's, of a3's).
inline __m512 sum_quads4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  return _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44), _mm512_shuffle_ps(s01, s23, 0xEE));
}

// Where a token's key pieces lie: piece s (8 bf16) of token i at k[i] + (s / 2) * kPair +
// (s % 2) * kOdd. Token rows (D elements): RowPieces. The split layout's fp8 keys converted as
// they lie, 64 codes (4 tokens x 16 dims of a piece) at a time with no reordering
// (split_keys_fp8_pieces): SplitPieces, per 16 dims c and 4 tokens 4j .. 4j + 3 a 64-element
// run of dims 0..7 of the 4 tokens, then dims 8..15, so token i at 64 (i / 4) + 8 (i % 4).
struct RowPieces {
  static constexpr int64_t kPair = 16, kOdd = 8;
};
struct SplitPieces {
  static constexpr int64_t kPair = 256, kOdd = 32;
};

// Key rows of a tile the kernel wrote itself, at fixed offsets from one base: token i at
// base + Layout::offset(i), with offset(i + 8) = offset(i) + offset(8). The q.k then addresses
// all 8 tokens of a block from one register (constant displacements), where an array of 16 row
// pointers kept 8 of them in registers and reloaded the rest from the stack in every step.
template <typename Layout>
struct FixedRows {
  const bf16_t* base;
  const bf16_t* operator[](int i) const { return base + Layout::offset(i); }
  FixedRows operator+(int j) const { return FixedRows{base + Layout::offset(j)}; }
};
// Token rows kStride elements apart (the fp8 keys' bf16 tile of attend_tile_quads).
template <int64_t kStride>
struct StridedRows {
  static constexpr int64_t offset(int i) { return i * kStride; }
};
// SplitPieces' tokens (split_keys_fp8_pieces' tile).
struct SplitPieceRows {
  static constexpr int64_t offset(int i) { return 64 * (i / 4) + 8 * (i % 4); }
};

// Logits of one quad against 8 tokens: out[j] lane group g = row g, tokens 4j .. 4j + 3.
// k[i]: token i's bf16 key pieces (D elements, D % 8 == 0, where Pieces says): an array of row
// pointers, or FixedRows.
template <typename Pieces, typename Rows>
__attribute__((always_inline)) inline void quad_logits8(const bf16_t* qv, Rows k, int64_t D8,
                                                        __m512* out, LineCursor& pf) {
  __m512 even[8], odd[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) even[i] = odd[i] = _mm512_setzero_ps();
  int64_t s = 0;
  for (; s + 1 < D8; s += 2) {
    pf.paced_step();
    const __m512bh q0 = (__m512bh)_mm512_load_si512(qv + 32 * s);
    const __m512bh q1 = (__m512bh)_mm512_load_si512(qv + 32 * s + 32);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const __m512i k0 = _mm512_broadcast_i32x4(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(k[i] + s / 2 * Pieces::kPair)));
      const __m512i k1 = _mm512_broadcast_i32x4(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(k[i] + s / 2 * Pieces::kPair + Pieces::kOdd)));
      even[i] = _mm512_dpbf16_ps(even[i], q0, (__m512bh)k0);
      odd[i] = _mm512_dpbf16_ps(odd[i], q1, (__m512bh)k1);
    }
  }
  if (s < D8) {
    const __m512bh q0 = (__m512bh)_mm512_load_si512(qv + 32 * s);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const __m512i k0 = _mm512_broadcast_i32x4(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(k[i] + s / 2 * Pieces::kPair)));
      even[i] = _mm512_dpbf16_ps(even[i], q0, (__m512bh)k0);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) even[i] = _mm512_add_ps(even[i], odd[i]);
  out[0] = sum_quads4(even[0], even[1], even[2], even[3]);
  out[1] = sum_quads4(even[4], even[5], even[6], even[7]);
}

// Logits of one kv head's G query rows (its quads from pack_query_quads, at qh) against up to
// 16 bf16 token rows k[i] (D elements; D % 8 == 0; rows >= n not read when n <= 8): out[r][t],
// row r, token t, times qk_scale (tokens >= n: whatever the stand-in rows give).
template <typename Pieces = RowPieces, typename Rows = const bf16_t* const*>
__attribute__((always_inline)) inline void quad_head_logits_inline(
    const bf16_t* qh, Rows k, int64_t n, int64_t D8, int64_t G, __m512 qk_scale, float* out,
    LineCursor& pf) {
  const int64_t U = (G + 3) / 4;
  for (int64_t u = 0; u < U; ++u) {
    const bf16_t* qv = qh + u * D8 * 32;
    __m512 t[4];
    quad_logits8<Pieces>(qv, k, D8, t, pf);
    if (n > 8) {
      quad_logits8<Pieces>(qv, k + 8, D8, t + 2, pf);
    } else {
      t[2] = t[3] = _mm512_setzero_ps();
    }
    // Lane groups (row g, tokens 4j .. 4j + 3) of t[j] to rows: row g = (t0.g, t1.g, t2.g, t3.g).
    const __m512 x0 = _mm512_shuffle_f32x4(t[0], t[1], 0x44);
    const __m512 x1 = _mm512_shuffle_f32x4(t[0], t[1], 0xEE);
    const __m512 x2 = _mm512_shuffle_f32x4(t[2], t[3], 0x44);
    const __m512 x3 = _mm512_shuffle_f32x4(t[2], t[3], 0xEE);
    const __m512 rows[4] = {
        _mm512_shuffle_f32x4(x0, x2, 0x88), _mm512_shuffle_f32x4(x0, x2, 0xDD),
        _mm512_shuffle_f32x4(x1, x3, 0x88), _mm512_shuffle_f32x4(x1, x3, 0xDD)};
    const int64_t rg = std::min<int64_t>(4, G - 4 * u);
    for (int64_t g = 0; g < rg; ++g) {
      _mm512_store_ps(out + (4 * u + g) * 16, _mm512_mul_ps(rows[g], qk_scale));
    }
  }
}

// quad_head_logits_inline as a call of its own (GCC's choice for the split layout's tiles and
// the bf16 quads; see attend_tile_quads for why the fp8 quads inline it).
template <typename Pieces = RowPieces, typename Rows = const bf16_t* const*>
inline void quad_head_logits(const bf16_t* qh, Rows k, int64_t n, int64_t D8, int64_t G,
                             __m512 qk_scale, float* out, LineCursor& pf) {
  quad_head_logits_inline<Pieces, Rows>(qh, k, n, D8, G, qk_scale, out, pf);
}

// Back to natural order: each row's 32-dimension chunks as p.v left them (lo 16 then hi 16),
// rows round_up(D, 32) floats apart, to rows NC * 16 floats apart (in place: a row is read
// whole before it is written, and never past the next row's start).
template <int NC>
inline void unpermute_quad_rows(float* acc, int64_t rows) {
  constexpr int NC2 = (NC + 1) / 2;
  constexpr int64_t DP = NC * 16, DP2 = NC2 * 32;
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t r = 0; r < rows; ++r) {
    __m512 natural[2 * NC2];
#pragma GCC unroll 8
    for (int c = 0; c < NC2; ++c) {
      const __m512 lo = _mm512_load_ps(acc + r * DP2 + 32 * c);
      const __m512 hi = _mm512_load_ps(acc + r * DP2 + 32 * c + 16);
      natural[2 * c] = _mm512_permutex2var_ps(lo, first, hi);
      natural[2 * c + 1] = _mm512_permutex2var_ps(lo, second, hi);
    }
#pragma GCC unroll 16
    for (int j = 0; j < NC; ++j) _mm512_storeu_ps(acc + r * DP + 16 * j, natural[j]);
  }
}

// One token-major tile (n <= 16 tokens from k_rows / v_rows, tokens row_stride elements
// apart, kv head h at h * D), every kv head, for bf16 queries packed by pack_query_quads.
// Keys and values of tokens >= n are never read (zero_row, DP2 zeros, stands in; their logits
// are masked). st: rows round_up(D, 32) floats apart, permuted (unpermute_quad_rows).
template <typename KV, int NC>
__attribute__((noinline)) void attend_tile_quads(const Problem& p, const bf16_t* quads,
                                                 RowsState& st, const KV* k_rows,
                                                 const KV* v_rows, int64_t row_stride,
                                                 int64_t n, __m512 distance,
                                                 LineCursor& cursor,
                                                 const bf16_t* zero_row, const QuadScratch& s,
                                                 [[maybe_unused]] const void* fp8_tables) {
  constexpr int NC2 = (NC + 1) / 2;
  constexpr int64_t DP2 = NC2 * 32;
  constexpr bool kFp8 = !std::is_same_v<KV, bf16_t>;
  const int64_t D = p.head_size, D8 = D / 8, G = p.group, Hkv = p.num_kv_heads;
  const int64_t U = (G + 3) / 4, pairs = (n + 1) / 2;
  // fp8: the prefetch cursor in registers for the tile (a local copy, the head's logits inlined
  // so that it stays there); bf16: in the caller's memory, as before. Each request of the fp8
  // tile then costs a few register operations instead of loads and stores of the cursor's
  // fields, which also made GCC reload the scratch pointers after each. decode-fp8-bs128
  // (paired, 2-core Zen 5 VM): 1.096x faster from memory, 1.119x with the cache resident.
  // The same for the bf16 tile gained 1.033x resident but lost 1.5-3.7% from memory (the VM's
  // memory in a slow phase), and the logits inlined for every caller slowed the split layout's
  // fp8 decode (TORCH_SDPA 0.975), so only here (NOTES.md 2026-12-05 20:49).
  LineCursor local = cursor;
  LineCursor& pf = kFp8 ? local : cursor;
  // Steps that request lines: the logits' pairs of pieces, the values' token pairs, and one
  // per head and widening.
  const int64_t steps = std::max<int64_t>(
      1, Hkv * (U * ((n > 8 ? 2 : 1) * (D8 / 2) + (NC2 + 1) / 2 * pairs) + 1 + (kFp8 ? 2 : 0)));
  // bf16: the next tile's lines paced evenly over the steps (from memory, 2-core Zen 5 VM,
  // paired against ceil(left / steps) a step: decode-bf16 1.050 [1.027, 1.072], 8 x 8192 bf16
  // 1.052, block 16 1.015); fp8, whose tile is half as many lines: ceil(left / steps) a step,
  // done early (paced evenly it was 0.975 [0.967, 0.980]; NOTES.md).
  if constexpr (kFp8) {
    pf.pace_ahead(steps);
  } else {
    pf.pace(steps);
  }
  const __mmask16 valid = tail_mask(n);
  const int64_t tail = D - (NC2 - 1) * 32;  // bf16 elements in the last 32-element chunk
  const __mmask32 last_mask = tail >= 32 ? static_cast<__mmask32>(0xffffffffu)
                                         : static_cast<__mmask32>((1u << tail) - 1u);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 qk_scale = _mm512_set1_ps(p.qk_scale);

#if JAX_ATTN_DECODE_FP8_DOT
  // fp8: the values' pair order, found once per tile.
  [[maybe_unused]] const PairIndex* value_order = kFp8 ? &quad_pair_index() : nullptr;
#endif
  for (int64_t h = 0; h < Hkv; ++h) {
    const bf16_t* k[16];
    const bf16_t* v[16] = {};
    // fp8: the head's values already in the p.v's pairs ([8][DP2] words, below).
    uint32_t* value_pairs = reinterpret_cast<uint32_t*>(s.values);
    if constexpr (kFp8) {
#if JAX_ATTN_DECODE_FP8_DOT
      const Fp8Tables& tables = *static_cast<const Fp8Tables*>(fp8_tables);
      pf.paced_step();
      convert_tile_fp8_bf16<KV, NC>(tables, k_rows + h * D, row_stride, n, D, s.keys);
      pf.paced_step();
      convert_pairs_fp8<KV, DP2>(tables, *value_order, v_rows + h * D, row_stride, n, D,
                                 value_pairs);
#endif
    } else {
      for (int i = 0; i < 16; ++i) {
        const bool in = i < n;
        k[i] = in ? reinterpret_cast<const bf16_t*>(k_rows + i * row_stride + h * D) : zero_row;
        v[i] = in ? reinterpret_cast<const bf16_t*>(v_rows + i * row_stride + h * D) : zero_row;
      }
    }

    // Logits of the head's rows, [G][16].
    if constexpr (kFp8) {
      quad_head_logits_inline(quads_of_head(quads, h, G, D), FixedRows<StridedRows<DP2>>{s.keys},
                              n, D8, G, qk_scale, s.logits, pf);
    } else {
      quad_head_logits(quads_of_head(quads, h, G, D), k, n, D8, G, qk_scale, s.logits, pf);
    }

    // The online softmax of each row over the tile against its lazy reference (the row's
    // `max`, kDecodeLazyMargin): a quad at a time, with no call between its rows (the
    // prefetcher's issue is one). Only a quad with a row whose logits pass its reference by
    // the margin takes the max across lanes and rescales (bit u of `rescaled`; quads past 64
    // always multiply by their factors, 1 where nothing moved). Sums stay per lane.
    pf.paced_step();
    uint64_t rescaled = 0;
    for (int64_t u = 0; u < U; ++u) {
      const int rg = static_cast<int>(std::min<int64_t>(4, G - 4 * u));
      OnlineSoftmaxRow* state = st.rows.data() + h * G + 4 * u;
      float* sums = s.sums + (h * G + 4 * u) * 16;
      float* factor = s.factor + 4 * u;
      __m512 x[4];
      __mmask16 above[4] = {};
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        if (g >= rg) break;
        x[g] = _mm512_load_ps(s.logits + (4 * u + g) * 16);
        if (p.cap > 0.0f) x[g] = soft_cap16(x[g], p.cap);
        if (p.alibi) {
          x[g] = _mm512_fmadd_ps(_mm512_set1_ps(p.alibi[h * G + 4 * u + g]), distance, x[g]);
        }
        x[g] = _mm512_mask_mov_ps(neg_inf, valid, x[g]);
        above[g] = _mm512_cmp_ps_mask(x[g], _mm512_set1_ps(state[g].max + kDecodeLazyMargin),
                                      _CMP_GT_OQ);
        factor[g] = 1.0f;
      }
      if ((above[0] | above[1] | above[2] | above[3]) != 0 || u >= 64) {
        if (u < 64) rescaled |= uint64_t{1} << u;
        for (int g = 0; g < rg; ++g) {
          if (above[g] == 0) continue;
          // exp(old - new): 0 from -inf (the row's first finite logits).
          const float new_max = _mm512_reduce_max_ps(x[g]);
          factor[g] = std::exp(state[g].max - new_max);
          state[g].max = new_max;
          _mm512_store_ps(sums + 16 * g,
                          _mm512_mul_ps(_mm512_load_ps(sums + 16 * g), _mm512_set1_ps(factor[g])));
        }
      }
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        if (g >= rg) break;
        const float ref = lazy_reference(state[g]) * 1.44269504088896341f;
        const __m512 pr = _mm512_maskz_mov_ps(valid, exp_bf16_probs(x[g], _mm512_set1_ps(ref)));
        _mm512_store_ps(sums + 16 * g, _mm512_add_ps(_mm512_load_ps(sums + 16 * g), pr));
        _mm256_store_si256(reinterpret_cast<__m256i*>(s.probs + (4 * u + g) * 8),
                           (__m256i)_mm512_cvtneps_pbh(pr));
      }
    }

    // Values: acc[row] = acc[row] * factor[row] + sum over token pairs of (p, p') . (v, v'),
    // 4 rows x 2 chunks of 32 dimensions (4 vectors per row) per register block.
    for (int64_t u = 0; u < U; ++u) {
      const int rg = static_cast<int>(std::min<int64_t>(4, G - 4 * u));
      const bool scale = u >= 64 || ((rescaled >> u) & 1) != 0;
#pragma GCC unroll 4
      for (int c0 = 0; c0 < NC2; c0 += 2) {
        const bool two = c0 + 1 < NC2;
        const __mmask32 m0 = c0 == NC2 - 1 ? last_mask : static_cast<__mmask32>(0xffffffffu);
        const __mmask32 m1 = c0 + 1 == NC2 - 1 ? last_mask : static_cast<__mmask32>(0xffffffffu);
        __m512 o[4][4];
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) {
          if (r >= rg) break;
          float* a = st.acc.get() + (h * G + 4 * u + r) * DP2 + 32 * c0;
          const __m512 f = _mm512_set1_ps(s.factor[4 * u + r]);
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) {
            if (j < 2 || two) {
              o[r][j] = _mm512_load_ps(a + 16 * j);
              if (scale) o[r][j] = _mm512_mul_ps(o[r][j], f);
            }
          }
        }
        for (int64_t k2 = 0; k2 < pairs; ++k2) {
          pf.paced_step();
          __m512i w[4];
          if constexpr (kFp8) {
            const uint32_t* pw = value_pairs + k2 * DP2 + 32 * c0;
            w[0] = _mm512_load_si512(pw);
            w[1] = _mm512_load_si512(pw + 16);
            if (two) {
              w[2] = _mm512_load_si512(pw + 32);
              w[3] = _mm512_load_si512(pw + 48);
            }
          } else {
            const bf16_t* va = v[2 * k2];
            const bf16_t* vb = v[2 * k2 + 1];
            const __m512i a0 = _mm512_maskz_loadu_epi16(m0, va + 32 * c0);
            const __m512i b0 = _mm512_maskz_loadu_epi16(m0, vb + 32 * c0);
            w[0] = _mm512_unpacklo_epi16(a0, b0);
            w[1] = _mm512_unpackhi_epi16(a0, b0);
            if (two) {
              const __m512i a1 = _mm512_maskz_loadu_epi16(m1, va + 32 * c0 + 32);
              const __m512i b1 = _mm512_maskz_loadu_epi16(m1, vb + 32 * c0 + 32);
              w[2] = _mm512_unpacklo_epi16(a1, b1);
              w[3] = _mm512_unpackhi_epi16(a1, b1);
            }
          }
#pragma GCC unroll 4
          for (int r = 0; r < 4; ++r) {
            if (r >= rg) break;
            const __m512bh pr = (__m512bh)_mm512_set1_epi32(
                static_cast<int>(s.probs[(4 * u + r) * 8 + k2]));
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {
              if (j < 2 || two) o[r][j] = _mm512_dpbf16_ps(o[r][j], (__m512bh)w[j], pr);
            }
          }
        }
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) {
          if (r >= rg) break;
          float* a = st.acc.get() + (h * G + 4 * u + r) * DP2 + 32 * c0;
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) {
            if (j < 2 || two) _mm512_store_ps(a + 16 * j, o[r][j]);
          }
        }
      }
    }
  }
  // The rest from the caller's cursor: a call with the local copy's address would keep that
  // copy in memory throughout (GCC does not inline this issue).
  if constexpr (kFp8) cursor = local;
  cursor.issue(cursor.left);
}

#endif  // JAX_ATTN_DECODE_BF16_DOT

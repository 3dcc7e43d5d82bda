// Part of the decode kernel (paged_decode.cc), not a header of its own: included by
// decode_kernel.h inside its namespaces and inside its `#if JAX_ATTN_AVX512`, after
// decode_amx.h. It uses the kernel's Problem, Item, FloatBuffer, RowsState and finish_item,
// amx_tiles.h's tile loads, decode_quads.h's LineCursor, decode_fp8.h's fp8 to bf16
// conversions and decode_amx.h's amx_step_softmax; it includes nothing itself.
//
// The AMX decode on vLLM's split layout (the torch half's caches): bf16 queries on a bf16 or fp8
// cache (fp8 blocks widened to bf16 as they are staged), key [NB, Hkv, D / 8, BS, 8], value
// [NB, Hkv, D, BS]. Both products take their tiles straight from the cache; nothing is packed
// (the token-major AMX decode packs every value pair, its largest cost after the logits):
//   logits   A 64-byte row of a head block's 8-dim slice c holds 4 tokens x 8 dims, so a tile
//            of 16 such rows (1 KiB, contiguous) is 64 tokens x 8 dims. Against a
//            block-diagonal B (K pair 4j + p, N column 4j' + r: query row r's dims 8c + 2p,
//            8c + 2p + 1 where j == j', zeros elsewhere), C[m][4j + r] is the slice's share
//            of the logit of token 4m + j and row r: C stored whole is the flat [token][4]
//            layout amx_step_softmax takes. D / 8 products per 64 tokens.
//   values   A head block's values are [D][BS], a dim's tokens in a row: A = 16 dims x 32
//            tokens as they lie, B = the probabilities in token pairs x 4 rows (bf16), C =
//            O^T, 16 dims x 4 rows, kept in memory between blocks ([D][4] float32).
// Query rows go 4 at a time (a product costs the same whatever N): a kv head's G rows in
// ceil(G / 4) groups. Kv heads go in turn, and each walks the item's blocks: a head's query
// tiles (D / 8 KiB a group) stay in L1 over its blocks. A block where some tokens are not
// visible (the sequence's last block, the edges of a window or of a split-K part) is staged
// first with those tokens zeroed: a NaN there (unwritten cache memory) would reach the visible
// tokens of its 4-token row through B's zeros (NaN x 0), and the values' products likewise.
#pragma once

#if JAX_ATTN_AMX && JAX_ATTN_DECODE_BF16_DOT

// Block sizes whose key tiles are whole (64 tokens, or the block) and whose value products
// take 32 tokens (or the block of 16).
inline bool split_amx_block_ok(int64_t BS) {
  return BS == 16 || BS == 32 || (BS >= 64 && BS % 64 == 0);
}

inline TileConfig split_tile_config(int64_t key_rows, int64_t value_tokens) {
  TileConfig cfg = {};
  cfg.bytes[0] = 1;  // palette
  const auto set = [&](int t, int64_t rows, int64_t colsb) {
    cfg.bytes[16 + 2 * t] = static_cast<uint8_t>(colsb);
    cfg.bytes[48 + t] = static_cast<uint8_t>(rows);
  };
  set(0, key_rows, 64);  // C: logits of key tiles 0 and 1 of a pair, [rows][16] float32
  set(1, key_rows, 64);
  set(2, 16, 64);        // B: a slice's block-diagonal query tile
  set(3, key_rows, 64);  // A: key tiles, rows of 4 tokens x 8 dims
  set(4, key_rows, 64);
  set(5, 16, 2 * value_tokens);  // A: 16 dims x value_tokens tokens of the values
  set(6, value_tokens / 2, 16);  // B: token pairs x 4 rows of probabilities
  set(7, 16, 16);                // C: O^T, 16 dims x 4 rows
  return cfg;
}

// A bf16 head block (keys [D / 8][BS][8], values [D][BS]) into staged_k / staged_v with the
// tokens outside [vlo, vhi) zeros: keys 4 tokens (a 64-byte row) at a time, values 32.
inline void stage_bf16_block(const bf16_t* kb, const bf16_t* vb, int64_t D, int64_t BS,
                             int64_t vlo, int64_t vhi, bf16_t* staged_k, bf16_t* staged_v) {
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t off = 0, t = 0; off < D * BS; off += 32, t = (t + 4) % BS) {
    const __mmask32 m = mask32(8 * std::clamp<int64_t>(vhi - t, 0, 4)) &
                        ~mask32(8 * std::clamp<int64_t>(vlo - t, 0, 4));
    _mm512_store_si512(staged_k + off, m ? _mm512_maskz_loadu_epi16(m, kb + off) : zero);
  }
  for (int64_t d = 0; d < D; ++d) {
    for (int64_t t = 0; t < BS; t += 32) {
      const int64_t n = std::min<int64_t>(32, BS - t);
      const __mmask32 m =
          mask32(std::clamp<int64_t>(vhi - t, 0, n)) & ~mask32(std::clamp<int64_t>(vlo - t, 0, n));
      const __m512i x = m ? _mm512_maskz_loadu_epi16(m, vb + d * BS + t) : zero;
      _mm512_mask_storeu_epi16(staged_v + d * BS + t, mask32(n), x);
    }
  }
}

#if JAX_ATTN_DECODE_FP8_DOT
inline __mmask64 mask64(int64_t n) {  // lanes [0, n) of 64
  return n >= 64 ? ~__mmask64{0} : (__mmask64{1} << n) - 1;
}

// An fp8 head block (keys [D / 16][BS][16], values [D][BS] codes) into the bf16 split layout's
// staged_k ([D / 8][BS][8]) / staged_v ([D][BS]), exactly (decode_fp8.h's table lookups), the
// tokens outside [vlo, vhi) zeros. 4 tokens of a 16-dim key slice (64 codes) become one 64-byte
// row of each of the two 8-dim slices: 128-bit quarters 0 and 2 of the converted pair, then
// quarters 1 and 3.
inline void stage_fp8_block(const uint8_t* kb, const uint8_t* vb, int64_t D, int64_t BS,
                            int64_t vlo, int64_t vhi, const Fp8Tables& fp8, bf16_t* staged_k,
                            bf16_t* staged_v) {
  for (int64_t c = 0; c < D / 16; ++c) {
    for (int64_t t = 0; t < BS; t += 4) {
      const __mmask64 m = mask64(16 * std::clamp<int64_t>(vhi - t, 0, 4)) &
                          ~mask64(16 * std::clamp<int64_t>(vlo - t, 0, 4));
      __m512i out[2];
      fp8_to_bf16_64(kb + (c * BS + t) * 16, m, fp8, out);
      _mm512_store_si512(staged_k + (2 * c * BS + t) * 8,
                         _mm512_shuffle_i64x2(out[0], out[1], 0x88));
      _mm512_store_si512(staged_k + ((2 * c + 1) * BS + t) * 8,
                         _mm512_shuffle_i64x2(out[0], out[1], 0xDD));
    }
  }
  // The values' [D][BS] block is contiguous: 64 codes at a time over all of it (a block of 16
  // or 32 tokens puts 4 or 2 dims' rows in one conversion, with the same tokens visible in each).
  auto visible = [&](int64_t t, int64_t n) {  // tokens [t, t + n) of the block, n <= 64
    return mask64(std::clamp<int64_t>(vhi - t, 0, n)) & ~mask64(std::clamp<int64_t>(vlo - t, 0, n));
  };
  __mmask64 rows_mask = 0;
  if (BS < 64) {
    for (int64_t k = 0; k < 64; k += BS) rows_mask |= visible(0, BS) << k;
  }
  for (int64_t off = 0; off < D * BS; off += 64) {
    __m512i out[2];
    fp8_to_bf16_64(vb + off, BS < 64 ? rows_mask : visible(off % BS, 64), fp8, out);
    _mm512_store_si512(staged_v + off, out[0]);
    _mm512_store_si512(staged_v + off + 32, out[1]);
  }
}
#endif

template <typename KV>
void decode_item_amx_split(const Problem& p, const Item& it, float* scratch,
                           std::atomic<int32_t>* arrivals) {
  constexpr bool kFp8 = !std::is_same_v<KV, bf16_t>;  // e4m3fn / e5m2: every block staged
  constexpr int W = 4;  // query rows per product
  const int64_t D = p.head_size, Hq = p.num_heads, Hkv = p.num_kv_heads, G = p.group;
  const int64_t BS = p.block_size, D8 = D / 8;
  const int64_t groups = (G + W - 1) / W;
  const int64_t q_pos = p.seq_lens[it.seq] - 1;
  const int32_t* table = p.tables + it.seq * p.max_blocks;
  const KV* kc = static_cast<const KV*>(p.key_cache);
  const KV* vc = static_cast<const KV*>(p.value_cache);
#if JAX_ATTN_DECODE_FP8_DOT
  Fp8Tables fp8{};
  if constexpr (kFp8) fp8 = fp8_tables<KV>();
#endif
  const int64_t head_elems = D * BS;  // one kv head's block in either cache
  const int64_t key_rows = std::min<int64_t>(16, BS / 4), tile_tokens = 4 * key_rows;
  const int64_t key_tiles = BS / tile_tokens;
  const int64_t value_tokens = std::min<int64_t>(32, BS);

  // qbd[(h groups + grp) D8 + c][k][n] (bf16 pairs): k = 4j + p, n = 4j + r, row r of the
  // group's pair p of slice c; zeros off the diagonal blocks and for rows past G.
  const int64_t hg_count = Hkv * groups;
  FloatBuffer qbd_buf(static_cast<size_t>(hg_count * D8 * 256));
  uint32_t* qbd = reinterpret_cast<uint32_t*>(qbd_buf.get());
  const uint16_t* query = reinterpret_cast<const uint16_t*>(static_cast<const bf16_t*>(p.query)) +
                          it.seq * p.query_stride;
  for (int64_t h = 0; h < Hkv; ++h) {
    for (int64_t grp = 0; grp < groups; ++grp) {
      for (int64_t r = 0; r < std::min<int64_t>(W, G - W * grp); ++r) {
        const uint16_t* q = query + (h * G + W * grp + r) * D;
        uint32_t* dst = qbd + (h * groups + grp) * D8 * 256;
        for (int64_t c = 0; c < D8; ++c) {
          for (int64_t pr = 0; pr < 4; ++pr) {
            const uint32_t pair = q[8 * c + 2 * pr] | (uint32_t{q[8 * c + 2 * pr + 1]} << 16);
            for (int64_t j = 0; j < 4; ++j) dst[(c * 16 + 4 * j + pr) * 16 + 4 * j + r] = pair;
          }
        }
      }
    }
  }
  // Per (kv head, group): O^T [DT][4], the rows' max and sum (lane l: row l % 4).
  const int64_t DT = (D + 15) / 16 * 16, tail = D % 16 ? D - D % 16 : D;  // tail: first dim of a
  FloatBuffer ot_buf(static_cast<size_t>(hg_count * DT * W));             // part tile of values
  FloatBuffer tail_buf(static_cast<size_t>(16 * BS / 2));  // its 16 rows, zeros past D
  FloatBuffer row_max(static_cast<size_t>(hg_count * 16));
  FloatBuffer row_sum(static_cast<size_t>(hg_count * 16));
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < hg_count; ++i) _mm512_store_ps(row_max.get() + 16 * i, neg_inf);
  // Per block: logits / probabilities [BS][4] float32, P^T [BS / 2][4][2] bf16, and a staged
  // key and value block.
  FloatBuffer logits_buf(static_cast<size_t>(BS * W));
  FloatBuffer pt_buf(static_cast<size_t>(BS * W / 2));
  FloatBuffer staged_buf(static_cast<size_t>(head_elems));
  float* logits = logits_buf.get();
  bf16_t* tail_rows = reinterpret_cast<bf16_t*>(tail_buf.get());
  bf16_t* pt = reinterpret_cast<bf16_t*>(pt_buf.get());
  bf16_t* staged_k = reinterpret_cast<bf16_t*>(staged_buf.get());
  bf16_t* staged_v = staged_k + head_elems;
  // P^T's order inside each 8 bf16 (two tokens x 4 rows): row r's (token 0, token 1) pair.
  alignas(64) uint16_t pt_order[32];
  for (int i = 0; i < 32; ++i) {
    pt_order[i] = static_cast<uint16_t>((i & ~7) + (i & 7) / 2 + 4 * (i & 1));
  }
  const __m512i pt_perm = _mm512_load_si512(pt_order);

  const TileConfig tiles = split_tile_config(key_rows, value_tokens);
  load_tile_config(tiles);
  const int64_t first_block = it.begin / BS, last_block = (it.end - 1) / BS;
  // Tile products per head block: the prefetch's lines are spread over them.
  const int64_t slots = groups * (D8 * ((key_tiles + 1) / 2) + (D + 15) / 16 * (BS / value_tokens));
  for (int64_t h = 0; h < Hkv; ++h) {
    for (int64_t b = first_block; b <= last_block; ++b) {
      const int64_t pos0 = b * BS;
      const int64_t vlo = std::max(it.begin, pos0) - pos0, vhi = std::min(it.end, pos0 + BS) - pos0;
      const int64_t block_offset = (static_cast<int64_t>(table[b]) * Hkv + h) * head_elems;
      const bf16_t* kb = reinterpret_cast<const bf16_t*>(kc + block_offset);
      const bf16_t* vb = reinterpret_cast<const bf16_t*>(vc + block_offset);
      // The next head block's keys and values requested into L2 over this one's products.
      LineCursor ahead;
      if (p.prefetch_tiles > 0 && (b < last_block || h + 1 < Hkv)) {
        const int64_t nb = b < last_block ? b + 1 : first_block, nh = b < last_block ? h : h + 1;
        const int64_t next = (static_cast<int64_t>(table[nb]) * Hkv + nh) * head_elems;
        ahead = LineCursor(kc + next, vc + next, head_elems * int64_t{sizeof(KV)}, true);
        ahead.per = (ahead.left + slots - 1) / slots;
      }
      if constexpr (kFp8) {
#if JAX_ATTN_DECODE_FP8_DOT
        stage_fp8_block(reinterpret_cast<const uint8_t*>(kc + block_offset),
                        reinterpret_cast<const uint8_t*>(vc + block_offset), D, BS, vlo, vhi, fp8,
                        staged_k, staged_v);
        kb = staged_k;
        vb = staged_v;
#endif
      } else if (vlo > 0 || vhi < BS) {
        stage_bf16_block(kb, vb, D, BS, vlo, vhi, staged_k, staged_v);
        kb = staged_k;
        vb = staged_v;
      }
      if (tail < D) std::memcpy(tail_rows, vb + tail * BS, (D - tail) * BS * sizeof(bf16_t));
      for (int64_t grp = 0; grp < groups; ++grp) {
        const int64_t hg = h * groups + grp;
        const uint32_t* qg = qbd + hg * D8 * 256;
        for (int64_t kt = 0; kt < key_tiles; kt += 2) {
          const bool pair = kt + 1 < key_tiles;
          JAX_ATTN_TILE_ZERO(0);
          if (pair) JAX_ATTN_TILE_ZERO(1);
          for (int64_t c = 0; c < D8; ++c) {
            ahead.step();
            const bf16_t* slice = kb + (c * BS + kt * tile_tokens) * 8;
            JAX_ATTN_TILE_LOAD(2, qg + c * 256, 64);
            JAX_ATTN_TILE_LOAD(3, slice, 64);
            JAX_ATTN_TILE_DPBF16PS(0, 3, 2);
            if (pair) {
              JAX_ATTN_TILE_LOAD(4, slice + tile_tokens * 8, 64);
              JAX_ATTN_TILE_DPBF16PS(1, 4, 2);
            }
          }
          JAX_ATTN_TILE_STORE(0, logits + kt * tile_tokens * W, 64);
          if (pair) JAX_ATTN_TILE_STORE(1, logits + (kt + 1) * tile_tokens * W, 64);
        }

        alignas(64) float slope[16] = {};
        if (p.alibi) {
          for (int l = 0; l < 16; ++l) {
            if (W * grp + l % W < G) slope[l] = p.alibi[h * G + W * grp + l % W];
          }
        }
        const __m512 alpha =
            amx_step_softmax(p, logits, BS * W / 16, W, vlo, vhi, pos0 - q_pos,
                             _mm512_load_ps(slope), row_max.get() + 16 * hg,
                             row_sum.get() + 16 * hg);
        float* ot = ot_buf.get() + hg * DT * W;
        if (_mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) != 0) {
          for (int64_t z = 0; z < D * W; z += 16) {
            _mm512_store_ps(ot + z, _mm512_mul_ps(_mm512_load_ps(ot + z), alpha));
          }
        }
        for (int64_t z = 0; z < BS * W; z += 32) {
          const __m512 lo = _mm512_load_ps(logits + z), hi = _mm512_load_ps(logits + z + 16);
          _mm512_store_si512(pt + z, _mm512_permutexvar_epi16(
                                         pt_perm, (__m512i)_mm512_cvtne2ps_pbh(hi, lo)));
        }
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
          const bf16_t* rows = d0 < tail ? vb + d0 * BS : tail_rows;
          JAX_ATTN_TILE_LOAD(7, ot + d0 * W, 16);
          for (int64_t t = 0; t < BS; t += value_tokens) {
            ahead.step();
            JAX_ATTN_TILE_LOAD(5, rows + t, 2 * BS);
            JAX_ATTN_TILE_LOAD(6, pt + t * W, 16);
            JAX_ATTN_TILE_DPBF16PS(7, 5, 6);
          }
          JAX_ATTN_TILE_STORE(7, ot + d0 * W, 16);
        }
      }
    }
  }
  JAX_ATTN_TILE_RELEASE();

  // The item's state, in the vector path's form, for finish_item.
  const int64_t DP = (D + 15) / 16 * 16;
  RowsState st(Hq, DP);
  for (int64_t hg = 0; hg < hg_count; ++hg) {
    const int64_t h = hg / groups, grp = hg % groups;
    const float* ot = ot_buf.get() + hg * DT * W;
    for (int64_t r = 0; r < std::min<int64_t>(W, G - W * grp); ++r) {
      const int64_t row = h * G + W * grp + r;
      st.rows[row].max = row_max.get()[16 * hg + r];
      st.rows[row].sum = row_sum.get()[16 * hg + r];
      float* acc = st.acc.get() + row * DP;
      for (int64_t d = 0; d < D; ++d) acc[d] = ot[d * W + r];  // DP >= D; the rest unread
    }
  }
  finish_item(p, it, st, DP, scratch, arrivals);
}
#endif  // JAX_ATTN_AMX && JAX_ATTN_DECODE_BF16_DOT

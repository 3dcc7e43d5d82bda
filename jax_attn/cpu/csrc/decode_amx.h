// Part of the decode kernel (paged_decode.cc), not a header of its own: included by
// decode_kernel.h inside its namespaces and inside its `#if JAX_ATTN_AVX512`, after
// decode_item. It uses the kernel's Problem, Item, FloatBuffer, RowsState and finish_item,
// decode_fp8.h's conversions and amx_tiles.h's tile configuration and loads; it includes
// nothing itself.
//
// The AMX decode (AMX-TILE and AMX-BF16, beside AVX512_BF16), compiled only under
// `#if JAX_ATTN_AMX && JAX_ATTN_DECODE_BF16_DOT` (JAX_ATTN_AMX: amx_tiles.h, built with
// -mamx-tile -mamx-bf16 -mavx512bf16, e.g. -march=sapphirerapids); its fp8 caches under
// JAX_ATTN_DECODE_FP8_DOT too. The interface the kernel calls: decode_item_amx<KV>, the item
// function paged_decode picks where decode_on_amx says so.
#pragma once

#if JAX_ATTN_AMX && JAX_ATTN_DECODE_BF16_DOT
// ---------------------------------------------------------------------------------------------
// The AMX decode: bf16 queries on a token-major bf16 or fp8 cache, on CPUs with AMX-BF16
// (amx_tiles.h; block sizes that are multiples of 16). fp8 codes are converted to bf16 (exact)
// by table lookups as they are staged or packed. vdpbf16ps costs four FMAs' time on Sapphire
// Rapids, and there the vector decode's math alone took about what reading the cache takes
// (decode-bf16 from L2: 36 ns of one core per key and kv head; here 25-27). From DRAM both are
// bound by the memory: measured, AMX gains 10-15% on bf16 and nothing on fp8 (NOTES.md).
//
// An item walks its keys in steps of up to 128 (8 key tiles of 16, each inside one block); per
// step and kv head, for each group of up to 16 of its query rows (W lanes: G rounded up to a
// power of 2, zero-padded):
//   logits   S^T[16 keys][W] = K Q^T on tiles: A = 16 key rows straight from the cache (rows
//            Hkv * D apart; an fp8 key tile, one partly outside the visible range, or one whose
//            head size is not a multiple of 32 is staged first, once for every group: zeros
//            outside the range and past D),
//            B = the queries' dim pairs (Qt2, once per item);
//   softmax  on the flat [keys][W] float32 logits: lane l is query row l % W, so every step is
//            a vertical vector op and a row's max and sum fold lanes l and l ^ s (s >= W);
//   values   O[W][d] += P V on tiles: A = P [W][32 keys] bf16 (the probabilities transposed by
//            word permutes), B = values in pairs of keys (VNNI), interleaved by vpunpck[lh]wd,
//            which puts dims 8L..8L+3 in lane L of the low half and 8L+4..8L+7 of the high: O's
//            columns come out in that order and are put back in order at the end.
// The online-softmax state (row max, sum, O) stays per item and ends in finish_item, as on the
// vector path. The next step's keys and values (every head) are requested into L2 over the
// current step's work.
// Tiles: one configuration for the logits, another for the values (loaded once per step each).
// Operands come in two sets used on alternate chunks, so that the next chunk's loads need not
// wait for the products still reading the current one (tile registers are not renamed; the
// change measured within the noise, from L2).
//   logits  0, 1  S^T of two key tiles              16 rows x 4W bytes
//           2-5   key tiles (A), [tile][set]        16 x 64
//           6, 7  a Qt2 chunk (B), per set          16 x 4W
//   values  0-3   packed values (B), [set][half]    16 x 64
//           4, 5  a P chunk (A), per set            W x 64
//           6, 7  O columns (C)                     W x 64

constexpr int64_t kAmxStepTiles = 8;    // key tiles of 16 per step
constexpr int64_t kAmxValueChunks = 2;  // chunks of 32 keys per pass of the values' tiles

inline TileConfig decode_tile_config(int W, bool values) {
  TileConfig cfg = {};
  cfg.bytes[0] = 1;  // palette
  const auto set = [&](int t, int rows, int colsb) {
    cfg.bytes[16 + 2 * t] = static_cast<uint8_t>(colsb);  // colsb (uint16, < 256 here)
    cfg.bytes[48 + t] = static_cast<uint8_t>(rows);
  };
  for (int t = 0; t < 8; ++t) {
    if (values) {
      t < 4 ? set(t, 16, 64) : set(t, W, 64);
    } else {
      t < 2 ? set(t, 16, 4 * W) : t < 6 ? set(t, 16, 64) : set(t, 16, 4 * W);
    }
  }
  return cfg;
}

// The dim of O's column n (0..15) of column tile j (the order vpunpck[lh]wd leaves them in).
inline int64_t amx_o_dim(int64_t j, int64_t n) {
  return 32 * (j / 2) + 8 * (n / 4) + 4 * (j % 2) + n % 4;
}


// Contiguous runs of keys and of values (the same offsets in either cache) requested into L2
// in address order, a few lines at a time.
class RunPrefetcher {
 public:
  void add(const void* k, const void* v, int64_t bytes) {
    k_[runs_] = static_cast<const char*>(k);
    v_[runs_] = static_cast<const char*>(v);
    lines_[runs_] = (bytes + 63) / 64;
    total_ += lines_[runs_++];
  }
  int64_t lines_left() const { return total_ - done_; }
  inline void issue(int64_t n) {
    for (; n > 0 && run_ < runs_; --n) {
      _mm_prefetch(k_[run_] + 64 * line_, _MM_HINT_T1);
      _mm_prefetch(v_[run_] + 64 * line_, _MM_HINT_T1);
      ++done_;
      if (++line_ == lines_[run_]) {
        line_ = 0;
        ++run_;
      }
    }
  }

 private:
  static constexpr int kMaxRuns = 2 * kAmxStepTiles;
  const char* k_[kMaxRuns] = {};
  const char* v_[kMaxRuns] = {};
  int64_t lines_[kMaxRuns] = {};
  int64_t runs_ = 0, run_ = 0, line_ = 0, total_ = 0, done_ = 0;
};

// One step of the AMX decodes' online softmax, for W query rows (W a power of 2 <= 16) on the
// flat [key][W] float32 logits x (vecs vectors; lane l of a vector: row l % W, its key l / W):
// scaled by qk_scale, capped, ALiBi-biased (slopes lane l: row l % W's; a key's distance from
// the query is its index + dist0), -inf outside the step's visible keys [vlo, vhi); then each
// replaced by exp(x - new max), and the rows' max and sum (lanes l < W of row_max / row_sum,
// every lane kept) moved on. Returns alpha, the factor the rows' O must be multiplied by (lane
// l: row l % W; zeros for a row that had seen no key).
inline __m512 amx_step_softmax(const Problem& p, float* x, int64_t vecs, int W, int64_t vlo,
                               int64_t vhi, int64_t dist0, __m512 slopes, float* row_max,
                               float* row_sum) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(64) float lane_key[16];
  for (int l = 0; l < 16; ++l) lane_key[l] = static_cast<float>(l / W);
  const __m512 lane_keys = _mm512_load_ps(lane_key);
  const int64_t keys_per_vec = 16 / W;
  auto fold = [&](__m512 v, bool is_max) {
    for (int s = 8; s >= W; s >>= 1) {
      const __m512i idx = _mm512_xor_si512(
          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
          _mm512_set1_epi32(s));
      const __m512 u = _mm512_permutexvar_ps(idx, v);
      v = is_max ? _mm512_max_ps(v, u) : _mm512_add_ps(v, u);
    }
    return v;
  };
  __m512 step_max = neg_inf;
  for (int64_t z = 0; z < vecs; ++z) {
    const int64_t key0 = z * keys_per_vec;
    const __m512 keys = _mm512_add_ps(lane_keys, _mm512_set1_ps(static_cast<float>(key0)));
    const __mmask16 valid =
        _mm512_cmp_ps_mask(keys, _mm512_set1_ps(static_cast<float>(vlo)), _CMP_GE_OQ) &
        _mm512_cmp_ps_mask(keys, _mm512_set1_ps(static_cast<float>(vhi)), _CMP_LT_OQ);
    __m512 v = _mm512_mul_ps(_mm512_load_ps(x + 16 * z), _mm512_set1_ps(p.qk_scale));
    if (p.cap > 0.0f) v = soft_cap16(v, p.cap);
    if (p.alibi) {
      const __m512 dist = _mm512_add_ps(keys, _mm512_set1_ps(static_cast<float>(dist0)));
      v = _mm512_fmadd_ps(slopes, dist, v);
    }
    v = _mm512_mask_mov_ps(neg_inf, valid, v);
    _mm512_store_ps(x + 16 * z, v);
    step_max = _mm512_max_ps(step_max, v);
  }
  const __m512 old_max = _mm512_load_ps(row_max);
  const __m512 new_max = _mm512_max_ps(old_max, fold(step_max, true));
  const __mmask16 seen = _mm512_cmp_ps_mask(old_max, neg_inf, _CMP_NEQ_OQ);
  const __m512 alpha = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(old_max, new_max)));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t z = 0; z < vecs; ++z) {
    const __m512 v = _mm512_load_ps(x + 16 * z);
    const __mmask16 live = _mm512_cmp_ps_mask(v, neg_inf, _CMP_NEQ_UQ);
    const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(v, new_max)));
    _mm512_store_ps(x + 16 * z, e);
    sum = _mm512_add_ps(sum, e);
  }
  _mm512_store_ps(row_max, new_max);
  _mm512_store_ps(row_sum, _mm512_fmadd_ps(_mm512_load_ps(row_sum), alpha, fold(sum, false)));
  return alpha;
}

template <typename KV>
void decode_item_amx(const Problem& p, const Item& it, float* scratch,
                     std::atomic<int32_t>* arrivals) {
  constexpr bool kFp8 = !std::is_same_v<KV, bf16_t>;  // e4m3fn / e5m2: converted to bf16
  const int64_t D = p.head_size, Hq = p.num_heads, Hkv = p.num_kv_heads, G = p.group;
  const int64_t BS = p.block_size;
  const int64_t Dc = (D + 31) / 32, DO = Dc * 32, DP = (D + 15) / 16 * 16;
  int W = 1;
  while (W < std::min<int64_t>(G, 16)) W *= 2;
  const int64_t groups = (G + 15) / 16;  // query row groups of a kv head
  const int64_t q_pos = p.seq_lens[it.seq] - 1;
  const int32_t* table = p.tables + it.seq * p.max_blocks;
  const KV* kc = static_cast<const KV*>(p.key_cache);
  const KV* vc = static_cast<const KV*>(p.value_cache);
  const int64_t row_stride = Hkv * D, block_stride = BS * row_stride;
  const int64_t row_bytes = row_stride * static_cast<int64_t>(sizeof(KV));
  auto row_at = [&](const KV* cache, int64_t pos, int64_t h) {
    return cache + table[pos / BS] * block_stride + (pos % BS) * row_stride + h * D;
  };
  // One kv head's row (D elements) as bf16 in Dc vectors of 32 (zeros past D; a null row:
  // zeros). fp8 codes are exact in bf16 (table lookups, 64 codes at a time).
#if JAX_ATTN_DECODE_FP8_DOT
  Fp8Tables fp8{};
  if constexpr (kFp8) fp8 = fp8_tables<KV>();
#endif
  auto load_row = [&](const KV* row, __m512i* x) {
    if (row == nullptr) {
      for (int64_t dc = 0; dc < Dc; ++dc) x[dc] = _mm512_setzero_si512();
      return;
    }
    if constexpr (kFp8) {
#if JAX_ATTN_DECODE_FP8_DOT
      for (int64_t c = 0; c < D; c += 64) {
        __m512i out[2];
        fp8_to_bf16_64(reinterpret_cast<const uint8_t*>(row) + c, fp8_chunk_mask(0, 1, D - c), fp8,
                       out);
        x[c / 32] = out[0];
        if (c + 32 < DO) x[c / 32 + 1] = out[1];
      }
#endif
    } else {
      for (int64_t dc = 0; dc < Dc; ++dc) {
        x[dc] = _mm512_maskz_loadu_epi16(mask32(D - 32 * dc), row + 32 * dc);
      }
    }
  };

  // Qt2[h, group][chunk][i][r] = (q[row][32 chunk + 2i], q[row][32 chunk + 2i + 1]) as a bf16
  // pair, row = h G + 16 group + r; zeros past G and past D.
  const int64_t qt_size = Hkv * groups * Dc * 16 * W;
  FloatBuffer qt_buf(static_cast<size_t>(qt_size));
  uint32_t* qt = reinterpret_cast<uint32_t*>(qt_buf.get());
  const uint16_t* query = reinterpret_cast<const uint16_t*>(static_cast<const bf16_t*>(p.query)) +
                          it.seq * p.query_stride;
  for (int64_t h = 0; h < Hkv; ++h) {
    for (int64_t grp = 0; grp < groups; ++grp) {
      const int64_t rows = std::min<int64_t>(16, G - 16 * grp);
      uint32_t* dst = qt + (h * groups + grp) * Dc * 16 * W;
      for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* q = query + (h * G + 16 * grp + r) * D;
        for (int64_t d = 0; d < D; d += 2) {
          const uint32_t hi = d + 1 < D ? q[d + 1] : 0;
          dst[((d / 32) * 16 + (d % 32) / 2) * W + r] = q[d] | (hi << 16);
        }
      }
    }
  }
  // Per (kv head, group): O [W][DO] (columns in amx_o_dim order), the rows' max and sum as
  // vectors (lane l: row l % W).
  FloatBuffer o_buf(static_cast<size_t>(Hkv * groups * W * DO));
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  FloatBuffer row_max(static_cast<size_t>(Hkv * groups * 16));  // 16 lanes per (head, group)
  FloatBuffer row_sum(static_cast<size_t>(Hkv * groups * 16));
  for (int64_t i = 0; i < Hkv * groups; ++i) _mm512_store_ps(row_max.get() + 16 * i, neg_inf);
  // Per step: logits / probabilities [128][W] float32, P [4][W][32] bf16, packed values
  // [4][2 Dc][16][32] bf16, two staged key tiles [16][DO] bf16.
  const int64_t logits_size = kAmxStepTiles * 16 * W;           // per (kv head, group)
  FloatBuffer logits_buf(static_cast<size_t>(Hkv * groups * logits_size));
  FloatBuffer probs_buf(static_cast<size_t>(Hkv * groups * kAmxStepTiles / 2 * W * 16));
  FloatBuffer packed_buf(static_cast<size_t>(kAmxValueChunks * 2 * Dc * 16 * 16));
  FloatBuffer staged_buf(static_cast<size_t>(2 * 16 * DO / 2));
  bf16_t* probs = reinterpret_cast<bf16_t*>(probs_buf.get());
  bf16_t* packed = reinterpret_cast<bf16_t*>(packed_buf.get());
  bf16_t* staged = reinterpret_cast<bf16_t*>(staged_buf.get());

  // P's transpose: row g of a 32-key chunk takes flat element 32 W c + j W + g for key j, from
  // the pair of bf16 vectors holding flat [64 q, 64 q + 64).
  alignas(64) uint16_t perm_idx[16][32];
  for (int g = 0; g < W; ++g) {
    for (int j = 0; j < 32; ++j) perm_idx[g][j] = static_cast<uint16_t>((j * W + g) & 63);
  }

  const TileConfig logits_tiles = decode_tile_config(W, false);
  const TileConfig value_tiles = decode_tile_config(W, true);

  const int64_t first_tile = it.begin / 16, last_tile = (it.end - 1) / 16;
  for (int64_t s0 = first_tile; s0 <= last_tile; s0 += kAmxStepTiles) {
    const int64_t ntiles = std::min<int64_t>(kAmxStepTiles, last_tile + 1 - s0);
    const int64_t pos0 = s0 * 16;
    const int64_t vlo = std::max(it.begin, pos0) - pos0;                  // visible keys of
    const int64_t vhi = std::min(it.end, pos0 + ntiles * 16) - pos0;      // the step: [vlo, vhi)
    const int64_t chunks = (ntiles + 1) / 2;                              // 32 keys each
    // Element offset of each key's row in either cache (no division per row below).
    int64_t key_off[kAmxStepTiles * 16];
    for (int64_t t = 0; t < ntiles * 16; ++t) {
      key_off[t] = table[(pos0 + t) / BS] * block_stride + (pos0 + t) % BS * row_stride;
    }

    // Prefetch into L2, in address order (every head of a key tile: one contiguous run per
    // cache): the next step's keys and values, a share at each slice of this step's work.
    RunPrefetcher ahead;
    if (p.prefetch_tiles > 0) {
      const auto add_step = [&](int64_t first) {
        const int64_t n = std::min<int64_t>(kAmxStepTiles, last_tile + 1 - first);
        for (int64_t i = 0; i < n; ++i) {
          const int64_t pos = (first + i) * 16;
          ahead.add(row_at(kc, pos, 0), row_at(vc, pos, 0), 16 * row_bytes);
        }
      };
      add_step(s0 + kAmxStepTiles);
    }
    const int64_t slices = Hkv * (16 * chunks + groups * ((ntiles + 1) / 2 * Dc +
                                                          Dc * ((chunks + 1) / kAmxValueChunks)));
    const int64_t per_slice = (ahead.lines_left() + slices - 1) / slices;
    auto prefetch = [&]() { ahead.issue(per_slice); };

    // Logits in the cache's address order (a key tile's rows hold every kv head): key tiles
    // two at a time, kv heads, query row groups. Read head by head instead (each head's rows
    // 2 KiB apart at Hkv 8, D 128), tile loads from memory ran at a third of the speed.
    load_tile_config(logits_tiles);
    for (int64_t t = 0; t < ntiles; t += 2) {
      const bool pair = t + 1 < ntiles;
      for (int64_t h = 0; h < Hkv; ++h) {
        // A key tile is read in place (bf16, every key visible, D a multiple of 32) or staged
        // once for the head's groups: converted from fp8, rows outside [vlo, vhi) and dims past
        // D zeros.
        const bf16_t* key_src[2] = {staged, staged};
        int64_t key_stride[2] = {64, 64};
        for (int u = 0; u < (pair ? 2 : 1); ++u) {
          const int64_t k0 = (t + u) * 16;  // the key tile's first key in the step
          if (!kFp8 && k0 >= vlo && k0 + 16 <= vhi && D % 32 == 0) {
            key_src[u] = reinterpret_cast<const bf16_t*>(kc + key_off[k0] + h * D);
            key_stride[u] = row_bytes;
            continue;
          }
          bf16_t* st = staged + u * 16 * DO;
          for (int64_t r = 0; r < 16; ++r) {
            const bool in = k0 + r >= vlo && k0 + r < vhi;
            __m512i x[8];
            load_row(in ? kc + key_off[k0 + r] + h * D : nullptr, x);
            for (int64_t dc = 0; dc < Dc; ++dc) _mm512_store_si512(st + r * DO + 32 * dc, x[dc]);
          }
          key_src[u] = st;
          key_stride[u] = DO * 2;
        }
        for (int64_t grp = 0; grp < groups; ++grp) {
          const int64_t hg = h * groups + grp;
          const uint32_t* q_tiles = qt + hg * Dc * 16 * W;
          JAX_ATTN_TILE_ZERO(0);
          if (pair) JAX_ATTN_TILE_ZERO(1);
          for (int64_t dc = 0; dc < Dc; ++dc) {
            prefetch();
            const bf16_t* k0 = key_src[0] + 32 * dc;
            const bf16_t* k1 = key_src[1] + 32 * dc;
            if (dc & 1) {
              JAX_ATTN_TILE_LOAD(7, q_tiles + dc * 16 * W, 4 * W);
              JAX_ATTN_TILE_LOAD(3, k0, key_stride[0]);
              JAX_ATTN_TILE_DPBF16PS(0, 3, 7);
              if (pair) {
                JAX_ATTN_TILE_LOAD(5, k1, key_stride[1]);
                JAX_ATTN_TILE_DPBF16PS(1, 5, 7);
              }
            } else {
              JAX_ATTN_TILE_LOAD(6, q_tiles + dc * 16 * W, 4 * W);
              JAX_ATTN_TILE_LOAD(2, k0, key_stride[0]);
              JAX_ATTN_TILE_DPBF16PS(0, 2, 6);
              if (pair) {
                JAX_ATTN_TILE_LOAD(4, k1, key_stride[1]);
                JAX_ATTN_TILE_DPBF16PS(1, 4, 6);
              }
            }
          }
          float* l = logits_buf.get() + hg * logits_size;
          JAX_ATTN_TILE_STORE(0, l + t * 16 * W, 4 * W);
          if (pair) JAX_ATTN_TILE_STORE(1, l + (t + 1) * 16 * W, 4 * W);
        }
      }
    }

    // Per (kv head, group): the softmax over the step, P, and O rescaled by alpha.
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t grp = 0; grp < groups; ++grp) {
        const int64_t hg = h * groups + grp;
        // Softmax over the step (lane l: row l % W, key l / W of its vector).
        const int64_t rows = std::min<int64_t>(16, G - 16 * grp);
        alignas(64) float slope[16] = {};
        if (p.alibi) {
          for (int l = 0; l < 16; ++l) {
            if (l % W < rows) slope[l] = p.alibi[h * G + 16 * grp + l % W];
          }
        }
        const __m512 slopes = _mm512_load_ps(slope);
        const int64_t vecs = ntiles * W;  // 16 keys x W rows per key tile
        float* x_all = logits_buf.get() + hg * logits_size;
        const __m512 alpha =
            amx_step_softmax(p, x_all, vecs, W, vlo, vhi, pos0 - q_pos, slopes,
                             row_max.get() + 16 * hg, row_sum.get() + 16 * hg);

        // P chunks [W][32] bf16: row g, key j = flat element (32 c + j) W + g.
        for (int64_t c = 0; c < chunks; ++c) {
          __m512i flat[16];
          for (int q = 0; q < W; ++q) {
            const int64_t z = (32 * c) * W / 16 + 2 * q;  // two float vectors per bf16 one
            const __m512 lo = z < vecs ? _mm512_load_ps(x_all + 16 * z) : _mm512_setzero_ps();
            const __m512 hi =
                z + 1 < vecs ? _mm512_load_ps(x_all + 16 * (z + 1)) : _mm512_setzero_ps();
            flat[q] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
          }
          bf16_t* dst = probs + (hg * kAmxStepTiles / 2 + c) * W * 32;
          if (W == 1) {
            _mm512_store_si512(dst, flat[0]);
            continue;
          }
          for (int g = 0; g < W; ++g) {
            const __m512i idx = _mm512_load_si512(perm_idx[g]);
            __m512i row = _mm512_setzero_si512();
            for (int q = 0; q < W / 2; ++q) {
              const __m512i full = _mm512_permutex2var_epi16(flat[2 * q], idx, flat[2 * q + 1]);
              const int per = 64 / W;  // keys of row g from each pair
              const __mmask32 m = mask32(per * (q + 1)) & ~mask32(per * q);
              row = _mm512_mask_mov_epi16(row, m, full);
            }
            _mm512_store_si512(dst + g * 32, row);
          }
        }

        // O *= alpha (P V is added below).
        float* o = o_buf.get() + hg * W * DO;
        alignas(64) float alphas[16];
        _mm512_store_ps(alphas, alpha);
        if (_mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) != 0) {
          for (int r = 0; r < W; ++r) {
            const __m512 f = _mm512_set1_ps(alphas[r]);
            for (int64_t d = 0; d < DO; d += 16) {
              _mm512_store_ps(o + r * DO + d, _mm512_mul_ps(_mm512_load_ps(o + r * DO + d), f));
            }
          }
        }
      }
    }

    // O += P V, kAmxValueChunks chunks of 32 keys at a time per kv head: the head's values of
    // those keys packed in key pairs (L1-resident), then every group's O two column tiles at
    // a time. packed[c][j][i] = the dims of column tile j of keys 32c + 2i and 32c + 2i + 1,
    // interleaved (zeros for keys outside [vlo, vhi)).
    load_tile_config(value_tiles);
    for (int64_t c0 = 0; c0 < chunks; c0 += kAmxValueChunks) {
      const int64_t nc = std::min<int64_t>(kAmxValueChunks, chunks - c0);
      for (int64_t h = 0; h < Hkv; ++h) {
        for (int64_t c = 0; c < nc; ++c) {
          for (int64_t i = 0; i < 16; ++i) {
            prefetch();
            const int64_t t0 = 32 * (c0 + c) + 2 * i, t1 = t0 + 1;
            const KV* a = t0 >= vlo && t0 < vhi ? vc + key_off[t0] + h * D : nullptr;
            const KV* b = t1 >= vlo && t1 < vhi ? vc + key_off[t1] + h * D : nullptr;
            __m512i x[8], y[8];
            load_row(a, x);
            load_row(b, y);
            for (int64_t dc = 0; dc < Dc; ++dc) {
              bf16_t* dst = packed + ((c * 2 * Dc + 2 * dc) * 16 + i) * 32;
              _mm512_store_si512(dst, _mm512_unpacklo_epi16(x[dc], y[dc]));
              _mm512_store_si512(dst + 16 * 32, _mm512_unpackhi_epi16(x[dc], y[dc]));
            }
          }
        }
        for (int64_t grp = 0; grp < groups; ++grp) {
          const int64_t hg = h * groups + grp;
          float* o = o_buf.get() + hg * W * DO;
          const bf16_t* pr = probs + (hg * kAmxStepTiles / 2 + c0) * W * 32;
          for (int64_t j = 0; j < 2 * Dc; j += 2) {
            prefetch();
            JAX_ATTN_TILE_LOAD(6, o + 16 * j, 4 * DO);
            JAX_ATTN_TILE_LOAD(7, o + 16 * (j + 1), 4 * DO);
            for (int64_t c = 0; c < nc; ++c) {
              const bf16_t* b = packed + (c * 2 * Dc + j) * 16 * 32;
              if (c & 1) {
                JAX_ATTN_TILE_LOAD(5, pr + c * W * 32, 64);
                JAX_ATTN_TILE_LOAD(2, b, 64);
                JAX_ATTN_TILE_DPBF16PS(6, 5, 2);
                JAX_ATTN_TILE_LOAD(3, b + 16 * 32, 64);
                JAX_ATTN_TILE_DPBF16PS(7, 5, 3);
              } else {
                JAX_ATTN_TILE_LOAD(4, pr + c * W * 32, 64);
                JAX_ATTN_TILE_LOAD(0, b, 64);
                JAX_ATTN_TILE_DPBF16PS(6, 4, 0);
                JAX_ATTN_TILE_LOAD(1, b + 16 * 32, 64);
                JAX_ATTN_TILE_DPBF16PS(7, 4, 1);
              }
            }
            JAX_ATTN_TILE_STORE(6, o + 16 * j, 4 * DO);
            JAX_ATTN_TILE_STORE(7, o + 16 * (j + 1), 4 * DO);
          }
        }
      }
    }
    ahead.issue(ahead.lines_left());
  }
  JAX_ATTN_TILE_RELEASE();

  // The item's state, in the vector path's form, for finish_item.
  RowsState st(Hq, DP);
  for (int64_t h = 0; h < Hkv; ++h) {
    for (int64_t grp = 0; grp < groups; ++grp) {
      const int64_t hg = h * groups + grp;
      const float* mx = row_max.get() + 16 * hg;
      const float* sm = row_sum.get() + 16 * hg;
      const float* o = o_buf.get() + hg * W * DO;
      for (int64_t r = 0; r < std::min<int64_t>(16, G - 16 * grp); ++r) {
        const int64_t row = h * G + 16 * grp + r;
        st.rows[row].max = mx[r];
        st.rows[row].sum = sm[r];
        float* acc = st.acc.get() + row * DP;
        for (int64_t j = 0; j < 2 * Dc; ++j) {
          for (int64_t n = 0; n < 16; ++n) {
            const int64_t d = amx_o_dim(j, n);
            if (d < D) acc[d] = o[r * DO + 16 * j + n];
          }
        }
      }
    }
  }
  finish_item(p, it, st, DP, scratch, arrivals);
}
#endif  // JAX_ATTN_AMX && JAX_ATTN_DECODE_BF16_DOT

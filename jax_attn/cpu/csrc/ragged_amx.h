// Part of the ragged kernel (ragged_paged_attention.cc), not a header of its own: included by
// that file inside its namespaces after run_task. It uses the kernel's Problem, Item, Scratch,
// key_span, keys_seen, step_masks, step_visible, alibi_origin, alibi_shift, output_factor,
// transpose_queries and softmax_step, and amx_tiles.h's tile products; it includes nothing
// itself.
//
// The AMX path (AMX-TILE and AMX-BF16, beside AVX512_BF16), compiled only under
// `#if JAX_ATTN_AMX && JAX_ATTN_BF16_DOT` (JAX_ATTN_AMX: amx_tiles.h, built with
// -mamx-tile -mamx-bf16 -mavx512bf16, e.g. -march=sapphirerapids). The interface the kernel
// calls: run_task_amx<CT>, from run_all, for tasks of bf16 queries on a bf16 or fp8 cache
// where Problem::amx is set (the CPU has the tiles and Linux grants them).
#pragma once

#if JAX_ATTN_AMX && JAX_ATTN_BF16_DOT
// ---------------------------------------------------------------------------------------------
// The AMX path (bf16 queries on a bf16 or fp8 cache, where the CPU has AMX-BF16 and Linux grants
// the tiles): both products on tiles (amx_tiles.h), the softmax and the masks the vdpbf16ps
// path's own (softmax_step with probability pairs, a lazy reference). Per item, one kv head at a
// time, 32 query rows at a time, keys in steps of kAmxKeys:
//   keys   -> Kp [nv][Dk] bf16 (packed; fp8 widened; zeros past D and past the step's keys)
//   values -> VT [Dp][32-key chunks] bf16 (transposed)
//   S^T = Kp Qt2 (tiles), * qk_scale, row max -> softmax -> Pp pairs in place
//   O^T = alpha O^T + VT Pp (tiles; alpha is 1 on most steps, and then no rescale)
// and the block's output rows from O^T, transposed, at the end. Keys and values are packed once
// per task (tiles of one kv head's key prefixes) or per item (AmxPacked).
// ---------------------------------------------------------------------------------------------

// Keys per step and query rows per block of the AMX path. A block's running output (O^T, [Dp][32]
// floats: 16 KiB at D 128) and its query pairs stay in L1 while it walks all its keys (blocks
// outer, steps inner). 256 keys a step against 128: each p.v block product runs 8 chunks of 32
// keys per load and store of its C tiles instead of 4 (prefill-bf16 20.7 -> 19.3 ms, chunked
// 58.7 -> 54.8, medians of 3 alternated; 512: no better).
constexpr int64_t kAmxKeys = 256;
constexpr int64_t kAmxRows = 32;

// Packed keys and values of one kv head: keys [base, base + rows), key k at row k - base of
// `keys` (ldk bf16 apart), its values at column k - base of `values` (transposed, rows ldv
// apart: a multiple of 32 plus 32, off a 4 KiB row stride). A task's tiles that all read key
// prefixes share one (base 0, run_task_amx); an item with several row blocks and no such task
// packs its own range once (run_item_amx's item_pack).
struct AmxPacked {
  bf16_t* keys = nullptr;
  bf16_t* values = nullptr;
  int64_t ldk = 0, ldv = 0;
  int64_t base = 0, rows = 0;
};
thread_local Scratch tls_amx;
thread_local Scratch tls_amx_item;

// Packs keys and values [k0, k0 + nv) of kv head kvh of sequence item.seq: keys into
// keys[j][Dk] for j in [0, round_up(nv, 16)), values into VT[d][j] for j in [0, round_up(nv, 32))
// (rows and columns past nv zeros).
template <typename CT>
void amx_pack(const Problem& p, const int32_t* table, int64_t kvh, int64_t k0, int64_t nv,
              bf16_t* keys, int64_t ldk, bf16_t* values, int64_t ldv) {
  const CT* kc = static_cast<const CT*>(p.key_cache);
  const CT* vc = static_cast<const CT*>(p.value_cache);
  const int64_t chunks = (nv + 31) / 32;
  for (int64_t c = 0; c < chunks; ++c) {
    const CT* krows[32];
    const CT* vrows[32];
    for (int64_t j = 0; j < 32; ++j) {
      const int64_t pos = k0 + 32 * c + j;
      if (32 * c + j < nv) {
        const int64_t slot = static_cast<int64_t>(table[pos / p.BS]) * p.BS + pos % p.BS;
        krows[j] = kc + (slot * p.Hkv + kvh) * p.D;
        vrows[j] = vc + (slot * p.Hkv + kvh) * p.D;
      } else {
        krows[j] = vrows[j] = nullptr;
      }
    }
    pack_key_rows<CT>(krows, std::min<int64_t>(32, round_up(nv, 16) - 32 * c), p.D, ldk,
                      keys + 32 * c * ldk);
    pack_value_columns<CT>(vrows, p.D, p.Dp, values + 32 * c, ldv);
  }
}

// Packs what `packed` lacks of keys [packed.base, end) (from its last whole 32-key chunk on).
template <typename CT>
void amx_pack_to(const Problem& p, const int32_t* table, int64_t kvh, int64_t end,
                 AmxPacked& packed) {
  if (end <= packed.base + packed.rows) return;
  const int64_t from = packed.rows / 32 * 32;
  amx_pack<CT>(p, table, kvh, packed.base + from, end - packed.base - from,
               packed.keys + from * packed.ldk, packed.ldk, packed.values + from, packed.ldv);
  packed.rows = end - packed.base;
}

// Buffers for packed keys [0, rows) at head size D (Dp: D padded to the vector width).
inline AmxPacked amx_buffers(Scratch& scratch, int64_t rows, int64_t D, int64_t Dp) {
  AmxPacked packed;
  packed.ldk = round_up(D, 32);
  packed.ldv = round_up(rows, 32) + 32;
  const int64_t key_rows = round_up(rows, 32);
  const int64_t bf16s = key_rows * packed.ldk + Dp * packed.ldv;
  packed.keys = reinterpret_cast<bf16_t*>(scratch.get(static_cast<size_t>(bf16s / 2 + 16)));
  packed.values = packed.keys + key_rows * packed.ldk;
  return packed;
}

// O^T[d][r] *= alpha[r] for dims [d0, d0 + 16 DT) and rows [0, 16 RT) (rows ld floats apart):
// the running output's rescale, on the block the tiles load next (it is in L1 for them).
template <int DT, int RT>
inline void amx_rescale(float* OT, int64_t ld, const float* alpha, int64_t d0) {
  __m512 a[RT];
  for (int v = 0; v < RT; ++v) a[v] = _mm512_loadu_ps(alpha + 16 * v);
  for (int64_t d = d0; d < d0 + 16 * DT; ++d) {
    for (int v = 0; v < RT; ++v) {
      float* o = OT + d * ld + 16 * v;
      _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), a[v]));
    }
  }
}

// Whether any of the 16 rt factors alpha[0, 16 rt) differs from 1 (the lazy reference leaves
// most steps' factors at exactly 1: no rescale then).
inline bool amx_rescales(const float* alpha, int rt) {
  const __m512 one = _mm512_set1_ps(1.0f);
  __mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(alpha), one, _CMP_NEQ_UQ);
  if (rt > 1) m |= _mm512_cmp_ps_mask(_mm512_loadu_ps(alpha + 16), one, _CMP_NEQ_UQ);
  return m != 0;
}

// Output rows [r0, r0 + rows) of kv head kvh: O^T ([Dp][kAmxRows]) transposed 16 x 16 at a
// time, times v_scale / row_sum (0: no visible key), 32 dims (one 64-byte line) per store. With
// Problem::stream_out and D a multiple of 32 every piece is a whole aligned line, streamed: a
// large output is not read for ownership first (prefill-8x512: 33.5 MB of bf16 output).
inline void amx_write_rows(const Problem& p, const Item& it, int64_t kvh, int64_t r0,
                           int64_t rows, const float* OT, const float* row_sum,
                           const float* row_max, const float* q_pos, const float* slope) {
  const int64_t G = p.G, D = p.D, Dp = p.Dp, Hq = p.Hq;
  bf16_t* out = static_cast<bf16_t*>(p.out);
  const bool stream = p.stream_out && D % 32 == 0;
  const bool any_key = it.k_end > it.k_begin;
  const float alibi_from = alibi_origin(p, it);
  for (int64_t b0 = 0; b0 < rows; b0 += 16) {
    __m512 f[16];
    for (int i = 0; i < 16; ++i) {
      const int64_t r = r0 + b0 + i;
      f[i] = _mm512_set1_ps(b0 + i < rows
                                ? output_factor(p, row_sum[r], row_max[r], kvh * G + r % G,
                                                alibi_shift(alibi_from, slope[r], q_pos[r]))
                                : 0.0f);
    }
    for (int64_t d0 = 0; d0 < Dp; d0 += 32) {
      __m512 lo[16], hi[16];  // dims [d0, d0 + 16) and [d0 + 16, d0 + 32) of rows b0 + i
      for (int i = 0; i < 16; ++i) {
        lo[i] = any_key ? _mm512_loadu_ps(OT + (d0 + i) * kAmxRows + b0) : _mm512_setzero_ps();
        hi[i] = any_key && d0 + 16 < Dp ? _mm512_loadu_ps(OT + (d0 + 16 + i) * kAmxRows + b0)
                                        : _mm512_setzero_ps();
      }
      transpose16x16(lo);  // lo[j]: row b0 + j
      transpose16x16(hi);
      const __mmask32 m = mask32(D - d0);
      for (int64_t j = 0; j < std::min<int64_t>(16, rows - b0); ++j) {
        const int64_t r = r0 + b0 + j;
        bf16_t* o = out + ((it.t0 + r / G) * Hq + kvh * G + r % G) * D + d0;
        const __m512i x = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi[j], f[j]),
                                                       _mm512_mul_ps(lo[j], f[j]));
        if (stream) {
          _mm512_stream_si512(reinterpret_cast<__m512i*>(o), x);
        } else {
          _mm512_mask_storeu_epi16(o, m, x);
        }
      }
    }
  }
}

// One item: per kv head, its rows in blocks of kAmxRows, each block through all its keys in
// steps of kAmxKeys (q.k, softmax, p.v) and then out. A single-block item without packed keys
// (decodes, short chunks) packs each step's keys as it reaches them. The tiles and the vector
// units do not work at once on one core here (NOTES.md: a q.k issued ahead of the softmax, in
// the softmax's gaps, saved nothing), so the steps simply run in order.
template <typename CT>
void run_item_amx(const Problem& p, const Item& it, AmxPacked* task_packed) {
  const int64_t G = p.G, D = p.D, Dp = p.Dp;
  const int64_t Dk = round_up(D, 32);
  const int64_t M = it.nt * G, Mp = round_up(M, W);
  const bool item_pack = task_packed == nullptr && Mp > kAmxRows;
  const bool step_pack = task_packed == nullptr && !item_pack;
  // Scratch (floats): Qt2 [Dk / 2][Mp], O^T [Dp][32], logits St [kAmxKeys][32], 5 row vectors
  // [Mp], and when packing per step the step's keys [kAmxKeys][Dk] and values
  // [Dp][kAmxKeys + 32] in bf16.
  const int64_t ldv_step = kAmxKeys + 32;
  const int64_t floats = Dk / 2 * Mp + Dp * kAmxRows + kAmxKeys * kAmxRows + 5 * Mp +
                         (step_pack ? kAmxKeys * Dk / 2 + Dp * ldv_step / 2 : 0);
  float* base = tls_scratch.get(static_cast<size_t>(floats));
  uint32_t* Qt2 = reinterpret_cast<uint32_t*>(base);
  float* OT = base + Dk / 2 * Mp;
  float* St = OT + Dp * kAmxRows;
  float* row_max = St + kAmxKeys * kAmxRows;
  float* row_sum = row_max + Mp;
  float* alpha = row_sum + Mp;
  float* q_pos = alpha + Mp;
  float* slope = q_pos + Mp;
  bf16_t* step_keys = reinterpret_cast<bf16_t*>(slope + Mp);
  bf16_t* step_values = step_keys + kAmxKeys * Dk;

  const bf16_t* query = static_cast<const bf16_t*>(p.query);
  const int32_t* table = p.block_tables + it.seq * p.MB;
  const bool transform = p.cap > 0.0f || p.slopes != nullptr;
  const float alibi_from = alibi_origin(p, it);
  const bool scaled = p.qk_scale > 0.0f;  // the softmax applies the scale (kScaled)
  const __m512 scale = _mm512_set1_ps(p.qk_scale);
  AmxPacked own;
  if (item_pack) own = amx_buffers(tls_amx_item, it.k_end - it.k_begin, D, Dp);
  AmxPacked* packed = item_pack ? &own : task_packed;
  TileScope tiles;
  for (int64_t kvh = it.kvh; kvh < it.kvh + it.num_kv; ++kvh) {
    const auto row = [&](int64_t r) {
      return query + (it.t0 + r / G) * p.q_stride + (kvh * G + r % G) * D;
    };
    transpose_queries<bf16_t, true>(row, M, Mp, D, 0.0f, reinterpret_cast<float*>(Qt2));
    std::memset(Qt2 + D / 2 * Mp, 0, sizeof(uint32_t) * (Dk - D) / 2 * Mp);  // pairs past D
    for (int64_t r = 0; r < Mp; ++r) {
      q_pos[r] = r < M ? static_cast<float>(it.pos0 + r / G) : 0.0f;
      slope[r] = r < M && p.slopes ? p.slopes[kvh * G + r % G] * kLog2e : 0.0f;
      row_max[r] = kMasked;
      row_sum[r] = 0.0f;
    }
    if (item_pack) {
      own.base = it.k_begin;
      own.rows = 0;
    }
    if (packed != nullptr) amx_pack_to<CT>(p, table, kvh, it.k_end, *packed);
    const int64_t ldk = packed != nullptr ? packed->ldk : Dk;
    const int64_t ldv = packed != nullptr ? packed->ldv : ldv_step;
    const auto keys_at = [&](int64_t k0) {
      return packed != nullptr ? packed->keys + (k0 - packed->base) * ldk : step_keys;
    };
    const auto values_at = [&](int64_t k0) {
      return packed != nullptr ? packed->values + (k0 - packed->base) : step_values;
    };

    for (int64_t r0 = 0; r0 < Mp; r0 += kAmxRows) {
      const int rt = Mp - r0 >= 32 ? 2 : 1;
      const int64_t rows = std::min<int64_t>(kAmxRows, M - r0);  // real rows of the block
      // Keys of step k0 that the block's last row sees (it sees the most: causal limits grow
      // with the row), at most the step's.
      const auto seen_at = [&](int64_t k0) {
        const int64_t nv = std::min<int64_t>(kAmxKeys, it.k_end - k0);
        return std::min(nv, keys_seen(step_visible(p, it, k0), G, r0 + rows - 1));
      };
      const auto logits = [&](int64_t k0) {  // S^T = K Qt2, unscaled
        const int64_t nk = round_up(seen_at(k0), 16);
        const bf16_t* keys = keys_at(k0);
        for (int64_t n0 = 0; n0 < nk; n0 += 32) {
          with_tiles(nk - n0 >= 32 ? 2 : 1, rt, [&](auto kt, auto rtc) {
            amx_block<decltype(kt)::value, decltype(rtc)::value>(
                keys + n0 * ldk, ldk, Qt2 + r0, Mp, Dk / 32, St + n0 * kAmxRows, kAmxRows, true);
          });
        }
      };
      for (int64_t k0 = it.k_begin; k0 < it.k_end; k0 += kAmxKeys) {
        const int64_t seen = seen_at(k0);
        const bool first = k0 == it.k_begin;
        if (seen <= 0 && !first) break;  // later steps are past the block's causal limit
        if (step_pack) {
          const int64_t nv = std::min<int64_t>(kAmxKeys, it.k_end - k0);
          amx_pack<CT>(p, table, kvh, k0, nv, step_keys, Dk, step_values, ldv_step);
        }
        logits(k0);
        const bool mask = step_masks(p, it, k0, seen);
        if (scaled) {
          softmax_step<true, true, true>(p, St, kAmxRows, rows, seen, k0, transform, mask,
                                         q_pos + r0, slope + r0, alibi_from, nullptr,
                                         row_max + r0, row_sum + r0, alpha + r0);
        } else {  // qk_scale <= 0: scaled here (max(s * scale) is not max(s) * scale)
          for (int64_t n = 0; n < round_up(seen, 16); ++n) {
            for (int v = 0; v < rt; ++v) {
              float* x = St + n * kAmxRows + 16 * v;
              _mm512_storeu_ps(x, _mm512_mul_ps(_mm512_loadu_ps(x), scale));
            }
          }
          softmax_step<true, false, true>(p, St, kAmxRows, rows, seen, k0, transform, mask,
                                          q_pos + r0, slope + r0, alibi_from, nullptr,
                                          row_max + r0, row_sum + r0, alpha + r0);
        }
        // Pairs past the block's last key, up to the end of its 32-key chunk, hold stale
        // logits: zeros (the chunk's values there are zeros or finite, never read as such).
        const int64_t pairs = (seen + 1) / 2;
        for (int64_t i = pairs; i < round_up(pairs, 16); ++i) {
          std::memset(St + i * kAmxRows, 0, sizeof(float) * 16 * rt);
        }
        const uint32_t* Pp = reinterpret_cast<const uint32_t*>(St);
        const int64_t chunks = (seen + 31) / 32;
        const bool rescale = !first && amx_rescales(alpha + r0, rt);
        const bf16_t* values = values_at(k0);
        for (int64_t d0 = 0; d0 < Dp; d0 += 32) {  // O^T = alpha O^T + VT Pp
          with_tiles(Dp - d0 >= 32 ? 2 : 1, rt, [&](auto dt, auto rtc) {
            constexpr int kD = decltype(dt)::value, kR = decltype(rtc)::value;
            if (rescale) amx_rescale<kD, kR>(OT, kAmxRows, alpha + r0, d0);
            amx_block<kD, kR>(values + d0 * ldv, ldv, Pp, kAmxRows, chunks,
                              OT + d0 * kAmxRows, kAmxRows, first);
          });
        }
      }
      amx_write_rows(p, it, kvh, r0, rows, OT, row_sum, row_max, q_pos, slope);
    }
  }
  if (p.stream_out) _mm_sfence();  // the streamed rows land before the task reports
}

// run_task's AMX counterpart: items in order; a task of key-prefix tiles of one kv head shares
// its packed keys and values (AmxPacked), whatever their size: past the L2 they come from L3,
// which still beats packing them again for every item (chunked-prefill-bf16 at 2304 keys,
// 1.2 MB packed: NOTES.md).
template <typename CT>
void run_task_amx(const Problem& p, const Item* items, int64_t num_items) {
  const KeySpan span = key_span(items, num_items);
  AmxPacked packed;
  if (span.prefixes) packed = amx_buffers(tls_amx, span.end, p.D, p.Dp);
  for (int64_t i = 0; i < num_items; ++i) {
    run_item_amx<CT>(p, items[i], packed.keys != nullptr ? &packed : nullptr);
  }
}
#endif  // JAX_ATTN_AMX && JAX_ATTN_BF16_DOT

// Part of the ragged kernel (ragged_paged_attention.cc), not a header of its own: included by
// that file inside its namespaces after run_task. It uses the kernel's Problem, Item, Scratch,
// key_prefixes, step_masks, step_visible, transpose_queries and softmax_step, ragged_bf16.h's
// narrow16_bf16, and amx_tiles.h's tile products; it includes nothing itself.
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
// path's own (softmax_step with probability pairs). Per item, one kv head at a time, keys in
// steps of kKeys:
//   keys   -> Kp [nv][Dk] bf16 (packed; fp8 widened; zeros past D and past the step's keys)
//   values -> VT [Dp][32-key chunks] bf16 (transposed)
//   S^T = Kp Qt2 (tiles), * qk_scale, row max -> softmax -> Pp pairs in place
//   O^T = alpha O^T + VT Pp (tiles)
// and the output rows from O^T, transposed, at the end. A task whose tiles all read key
// prefixes of one kv head packs its keys and values once (AmxPacked), for all its items.
// ---------------------------------------------------------------------------------------------

// A task's packed keys and values: keys [0, rows) of one kv head, keys ldk bf16 apart, values
// transposed with keys ldv apart (a multiple of 32 plus 32: off a 4 KiB row stride).
struct AmxPacked {
  bf16_t* keys = nullptr;
  bf16_t* values = nullptr;
  int64_t ldk = 0, ldv = 0;
  int64_t rows = 0;
};
thread_local Scratch tls_amx;

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

// O^T[d][r] *= alpha[r] for dims [d0, d0 + 16 DT) and rows [r0, r0 + 16 RT): the running
// output's rescale, on the block the tiles load next (it is in L1 for them).
template <int DT, int RT>
inline void amx_rescale(float* OT, int64_t Mp, const float* alpha, int64_t d0, int64_t r0) {
  __m512 a[RT];
  for (int v = 0; v < RT; ++v) a[v] = _mm512_loadu_ps(alpha + r0 + 16 * v);
  for (int64_t d = d0; d < d0 + 16 * DT; ++d) {
    for (int v = 0; v < RT; ++v) {
      float* o = OT + d * Mp + r0 + 16 * v;
      _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), a[v]));
    }
  }
}

template <typename CT>
void run_item_amx(const Problem& p, const Item& it, AmxPacked* packed) {
  const int64_t G = p.G, D = p.D, Dp = p.Dp, Hq = p.Hq;
  const int64_t Dk = round_up(D, 32);
  const int64_t M = it.nt * G, Mp = round_up(M, W);
  // Scratch (floats): Qt2 [Dk / 2][Mp], O^T [Dp][Mp], St [kKeys][Mp], 5 row vectors [Mp], and
  // without a task's packing the step's keys [kKeys][Dk] and values [Dp][kKeys + 32] in bf16.
  const int64_t ldv_step = kKeys + 32;
  const int64_t floats = Dk / 2 * Mp + Dp * Mp + kKeys * Mp + 5 * Mp +
                         (packed ? 0 : kKeys * Dk / 2 + Dp * ldv_step / 2);
  float* base = tls_scratch.get(static_cast<size_t>(floats));
  uint32_t* Qt2 = reinterpret_cast<uint32_t*>(base);
  float* OT = base + Dk / 2 * Mp;
  float* St = OT + Dp * Mp;
  float* row_max = St + kKeys * Mp;
  float* row_sum = row_max + Mp;
  float* alpha = row_sum + Mp;
  float* q_pos = alpha + Mp;
  float* slope = q_pos + Mp;
  bf16_t* step_keys = reinterpret_cast<bf16_t*>(slope + Mp);
  bf16_t* step_values = step_keys + kKeys * Dk;

  const bf16_t* query = static_cast<const bf16_t*>(p.query);
  bf16_t* out = static_cast<bf16_t*>(p.out);
  const int32_t* table = p.block_tables + it.seq * p.MB;
  const bool transform = p.cap > 0.0f || p.slopes != nullptr;
  const bool scaled = p.qk_scale > 0.0f;  // the softmax applies the scale (kScaled)
  const __m512 scale = _mm512_set1_ps(p.qk_scale);
  TileScope tiles;
  for (int64_t kvh = it.kvh; kvh < it.kvh + it.num_kv; ++kvh) {
    const auto row = [&](int64_t r) {
      return query + ((it.t0 + r / G) * Hq + kvh * G + r % G) * D;
    };
    transpose_queries<bf16_t, true>(row, M, Mp, D, 0.0f, reinterpret_cast<float*>(Qt2));
    std::memset(Qt2 + D / 2 * Mp, 0, sizeof(uint32_t) * (Dk - D) / 2 * Mp);  // pairs past D
    for (int64_t r = 0; r < Mp; ++r) {
      q_pos[r] = r < M ? static_cast<float>(it.pos0 + r / G) : 0.0f;
      slope[r] = r < M && p.slopes ? p.slopes[kvh * G + r % G] * kLog2e : 0.0f;
      row_max[r] = kMasked;
      row_sum[r] = 0.0f;
    }
    for (int64_t k0 = it.k_begin; k0 < it.k_end; k0 += kKeys) {
      const int64_t nv = std::min<int64_t>(kKeys, it.k_end - k0);
      const bf16_t* keys;
      const bf16_t* values;
      int64_t ldv;
      if (packed != nullptr) {  // one kv head, keys from 0 (run_task_amx): pack what is missing
        if (k0 + nv > packed->rows) {
          const int64_t from = packed->rows / 32 * 32;
          amx_pack<CT>(p, table, kvh, from, k0 + nv - from, packed->keys + from * packed->ldk,
                       packed->ldk, packed->values + from, packed->ldv);
          packed->rows = k0 + nv;
        }
        keys = packed->keys + k0 * packed->ldk;
        values = packed->values + k0;
        ldv = packed->ldv;
      } else {
        amx_pack<CT>(p, table, kvh, k0, nv, step_keys, Dk, step_values, ldv_step);
        keys = step_keys;
        values = step_values;
        ldv = ldv_step;
      }
      const int64_t ldk = packed != nullptr ? packed->ldk : Dk;
      const bool mask = step_masks(p, it, k0, nv);
      const int64_t visible = step_visible(p, it, k0);
      const bool first = k0 == it.k_begin;
      const int64_t nc = round_up(nv, 16), pairs = (nv + 1) / 2;
      // Blocks of 32 rows, each through q.k, softmax and p.v while its logits ([kKeys][32]
      // floats) and its O^T columns stay in L1. A block's keys stop at its last row's (the
      // softmax masks the key blocks q.k skips, without reading them). The next block's q.k
      // is issued before this block's softmax: the tiles compute while the vector units run
      // the softmax, whose logits were stored a block earlier (a load right behind a tile
      // store waits for it).
      const auto row_tiles = [&](int64_t r0) { return Mp - r0 >= 32 ? 2 : 1; };
      const auto keys_of = [&](int64_t r0) {  // keys the block's last row sees
        return std::min(nv, keys_seen(visible, G, r0 + 16 * row_tiles(r0) - 1));
      };
      const auto logits = [&](int64_t r0) {  // S^T = K Qt2, unscaled
        const int64_t nk = std::min(nc, round_up(keys_of(r0), 16));
        for (int64_t n0 = 0; n0 < nk; n0 += 32) {
          with_tiles(nk - n0 >= 32 ? 2 : 1, row_tiles(r0), [&](auto kt, auto rt) {
            amx_block<decltype(kt)::value, decltype(rt)::value>(
                keys + n0 * ldk, ldk, Qt2 + r0, Mp, Dk / 32, St + n0 * Mp + r0, Mp, true);
          });
        }
      };
      const auto softmax_and_values = [&](int64_t r0) {
        const int rt = row_tiles(r0);
        const int64_t seen = keys_of(r0);
        if (scaled) {
          softmax_step<true, true>(p, St + r0, Mp, std::min<int64_t>(32, M - r0), nv, k0,
                                   transform, mask, q_pos + r0, slope + r0, nullptr,
                                   row_max + r0, row_sum + r0, alpha + r0);
        } else {  // qk_scale <= 0: scaled here (max(s * scale) is not max(s) * scale)
          for (int64_t n = 0; n < std::min(nc, round_up(seen, 16)); ++n) {
            for (int v = 0; v < rt; ++v) {
              float* x = St + n * Mp + r0 + 16 * v;
              _mm512_storeu_ps(x, _mm512_mul_ps(_mm512_loadu_ps(x), scale));
            }
          }
          softmax_step<true>(p, St + r0, Mp, std::min<int64_t>(32, M - r0), nv, k0, transform,
                             mask, q_pos + r0, slope + r0, nullptr, row_max + r0,
                             row_sum + r0, alpha + r0);
        }
        // Pairs past the step's last key, up to the end of its 32-key chunk, hold stale
        // logits: zeros (the chunk's values there are zeros or finite, never read as such).
        for (int64_t i = pairs; i < round_up(pairs, 16); ++i) {
          std::memset(St + i * Mp + r0, 0, sizeof(float) * 16 * rt);
        }
        const uint32_t* Pp = reinterpret_cast<const uint32_t*>(St);
        const int64_t chunks = (seen + 31) / 32;
        for (int64_t d0 = 0; d0 < Dp; d0 += 32) {  // O^T = alpha O^T + VT Pp
          with_tiles(Dp - d0 >= 32 ? 2 : 1, rt, [&](auto dt, auto rtc) {
            constexpr int kD = decltype(dt)::value, kR = decltype(rtc)::value;
            if (!first) amx_rescale<kD, kR>(OT, Mp, alpha, d0, r0);
            amx_block<kD, kR>(values + d0 * ldv, ldv, Pp + r0, Mp, chunks, OT + d0 * Mp + r0,
                              Mp, first);
          });
        }
      };
      logits(0);
      for (int64_t r0 = 0; r0 < Mp; r0 += 32) {
        if (r0 + 32 < Mp) logits(r0 + 32);
        softmax_and_values(r0);
      }
    }
    // Output rows: O^T transposed 16 x 16 at a time, * v_scale / row_sum (0: no visible key).
    for (int64_t r0 = 0; r0 < M; r0 += 16) {
      alignas(64) float f[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t r = r0 + i;
        f[i] = r < M ? output_factor(p, row_sum[r], row_max[r], kvh * G + r % G) : 0.0f;
      }
      for (int64_t d0 = 0; d0 < Dp; d0 += 16) {
        __m512 x[16];
        for (int i = 0; i < 16; ++i) {
          x[i] = it.k_end > it.k_begin ? _mm512_loadu_ps(OT + (d0 + i) * Mp + r0)
                                       : _mm512_setzero_ps();
        }
        transpose16x16(x);  // x[j]: row r0 + j, dims [d0, d0 + 16)
        const __mmask16 m = tail_mask(D - d0);
        for (int64_t j = 0; j < std::min<int64_t>(16, M - r0); ++j) {
          const int64_t r = r0 + j;
          bf16_t* o = out + ((it.t0 + r / G) * Hq + kvh * G + r % G) * D + d0;
          _mm256_mask_storeu_epi16(o, m, narrow16_bf16(_mm512_mul_ps(x[j], _mm512_set1_ps(f[j]))));
        }
      }
    }
  }
}

// run_task's AMX counterpart: items in order; a task of key-prefix tiles of one kv head shares
// its packed keys and values (AmxPacked), whatever their size: past the L2 they come from L3,
// which still beats packing them again for every item (chunked-prefill-bf16 at 2304 keys,
// 1.2 MB packed: NOTES.md).
template <typename CT>
void run_task_amx(const Problem& p, const Item* items, int64_t num_items) {
  const auto [prefixes, max_end] = key_prefixes(items, num_items);
  AmxPacked packed;
  packed.ldk = round_up(p.D, 32);
  packed.ldv = round_up(max_end, 32) + 32;
  const int64_t key_rows = round_up(max_end, 32);
  const int64_t bytes = 2 * (key_rows * packed.ldk + p.Dp * packed.ldv);
  if (prefixes) {
    packed.keys = reinterpret_cast<bf16_t*>(tls_amx.get(static_cast<size_t>(bytes / 4 + 16)));
    packed.values = packed.keys + key_rows * packed.ldk;
  }
  for (int64_t i = 0; i < num_items; ++i) {
    run_item_amx<CT>(p, items[i], packed.keys != nullptr ? &packed : nullptr);
  }
}
#endif  // JAX_ATTN_AMX && JAX_ATTN_BF16_DOT

// The decode kernel's code shared by its units: paged_decode.cc (its description, the checks,
// the work split, the AMX decode) and decode_items_*.cc (the vector kernel's item functions,
// one cache dtype per unit, so that the instantiations compile in parallel). Not a header of
// general use: the kernel's functions are in an anonymous namespace, one copy per unit; the
// types the units pass between them (Problem, Item, ItemFn) are in jax_attn_cpu::decode.
#pragma once

#include <array>
#include <cstdio>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "cpu_features.h"
#include "paged_decode.h"
#include "vec_avx2.h"

namespace jax_attn_cpu {
namespace decode {

struct Problem {
  int64_t num_seqs, num_heads, num_kv_heads, group, head_size;
  int64_t num_blocks, block_size, max_blocks;
  const int32_t* tables;    // [S, max_blocks]
  const int32_t* seq_lens;  // [S]
  const float* alibi;       // [Hq] or nullptr
  const float* sinks;       // [Hq] or nullptr (kernel_common.h's sink_share)
  float qk_scale;           // scale * k_scale (* the fp8 widening factor, already in load16)
  float v_scale;
  int64_t window;  // <= 0: none
  float cap;       // <= 0: none
  int64_t prefetch_tiles;
  int64_t nta_limit;  // a next tile of more bytes is prefetched into L2, else NTA (cpu_features.h)
  bool quads;        // attend_tile_quads where it applies ($JAX_ATTN_CPU_DECODE_QUADS=0: never)
  bool split_lanes;  // decode_split.h's lanes at blocks of 128+ ($JAX_ATTN_CPU_SPLIT_LANES=1)
  DType query_type;
  CacheLayout layout;
  int64_t x;  // kSplit: key elements per 16 bytes (the innermost key dimension)
  const void* query;
  int64_t query_stride;  // elements from sequence s's query rows [Hq, D] to s + 1's (>= Hq * D)
  void* out;
  const void* key_cache;
  const void* value_cache;
};

struct Item {
  int64_t seq;
  int64_t part, num_parts;
  int64_t begin, end;   // key positions of this part
  int64_t scratch_row;  // first scratch row of this sequence's parts (num_parts > 1)
};

using ItemFn = void (*)(const Problem&, const Item&, float*, std::atomic<int32_t>*);

// The vector kernel's item function for a cache dtype and head size (nullptr: head size not
// supported), each defined in a unit of its own (decode_items_<dtype>.cc).
ItemFn item_fn_f32(int64_t head_size);  // float32 caches
ItemFn item_fn_f16(int64_t head_size);  // float16 caches
ItemFn item_fn_bf16(DType query_type, int64_t head_size);
ItemFn item_fn_e4m3(DType query_type, int64_t head_size);
ItemFn item_fn_e5m2(DType query_type, int64_t head_size);

}  // namespace decode

namespace {

using decode::Item;
using decode::ItemFn;
using decode::Problem;


// An aligned float scratch array (64-byte aligned, zero-initialized).
class FloatBuffer {
 public:
  explicit FloatBuffer(size_t n) : raw_(new float[n + 16]()) {
    const auto addr = reinterpret_cast<uintptr_t>(raw_.get());
    data_ = reinterpret_cast<float*>((addr + 63) & ~static_cast<uintptr_t>(63));
  }
  float* get() const { return data_; }

 private:
  std::unique_ptr<float[]> raw_;
  float* data_;
};

// How far ahead (in kv-head tiles of 16 tokens, in processing order) the kernel prefetches
// keys (values: twice as far); $JAX_ATTN_CPU_PREFETCH overrides (0: no software prefetch).
constexpr int64_t kPrefetchTiles = 4;


// Query row `row` of sequence `seq`, widened and multiplied by `scale`, into dst[D].
inline void load_query_row(const Problem& p, int64_t seq, int64_t row, float* dst) {
  const int64_t offset = seq * p.query_stride + row * p.head_size;
  const int64_t D = p.head_size;
  switch (p.query_type) {
    case DType::kF32: {
      const float* q = static_cast<const float*>(p.query) + offset;
      for (int64_t d = 0; d < D; ++d) dst[d] = q[d] * p.qk_scale;
      break;
    }
    case DType::kBF16: {
      const bf16_t* q = static_cast<const bf16_t*>(p.query) + offset;
      for (int64_t d = 0; d < D; ++d) dst[d] = widen(q[d]) * p.qk_scale;
      break;
    }
    default: {
      const f16_t* q = static_cast<const f16_t*>(p.query) + offset;
      for (int64_t d = 0; d < D; ++d) dst[d] = widen(q[d]) * p.qk_scale;
      break;
    }
  }
}

// out[seq, row, :] = vals[:] * factor, narrowed to the query's dtype.
inline void store_output_row(const Problem& p, int64_t seq, int64_t row, const float* vals,
                      float factor) {
  const int64_t offset = (seq * p.num_heads + row) * p.head_size;
  const int64_t D = p.head_size;
  switch (p.query_type) {
    case DType::kF32: {
      float* o = static_cast<float*>(p.out) + offset;
      for (int64_t d = 0; d < D; ++d) o[d] = vals[d] * factor;
      break;
    }
    case DType::kBF16: {
      bf16_t* o = static_cast<bf16_t*>(p.out) + offset;
      for (int64_t d = 0; d < D; ++d) o[d] = narrow<bf16_t>(vals[d] * factor);
      break;
    }
    default: {
      f16_t* o = static_cast<f16_t*>(p.out) + offset;
      for (int64_t d = 0; d < D; ++d) o[d] = narrow<f16_t>(vals[d] * factor);
      break;
    }
  }
}

// Per-item accumulators: for each query row, the online-softmax state and sum p * v.
struct RowsState {
  FloatBuffer acc;  // [Hq, DP]
  std::vector<OnlineSoftmaxRow> rows;
  RowsState(int64_t num_heads, int64_t padded_d)
      : acc(static_cast<size_t>(num_heads * padded_d)), rows(num_heads) {}
};


// The end of an item: a whole sequence writes its output rows; a part of a split sequence
// stores its state in `scratch`, and the last part to arrive merges all parts (float32) and
// writes the output. Scratch rows: [max, sum, 14 unused, acc[DP]] per (part, query row).
inline void finish_item(const Problem& p, const Item& it, RowsState& st, int64_t padded_d,
                 float* scratch, std::atomic<int32_t>* arrivals) {
  const int64_t Hq = p.num_heads;
  if (it.num_parts == 1) {
    for (int64_t r = 0; r < Hq; ++r) {
      store_output_row(p, it.seq, r, st.acc.get() + r * padded_d,
                       st.rows[r].inverse_sum(p.sinks ? p.sinks + r : nullptr) * p.v_scale);
    }
    return;
  }
  const int64_t stride = padded_d + 16;
  float* mine = scratch + (it.scratch_row + it.part * Hq) * stride;
  for (int64_t r = 0; r < Hq; ++r) {
    mine[r * stride] = st.rows[r].max;
    mine[r * stride + 1] = st.rows[r].sum;
    std::memcpy(mine + r * stride + 16, st.acc.get() + r * padded_d, padded_d * sizeof(float));
  }
  if (arrivals[it.seq].fetch_add(1, std::memory_order_acq_rel) + 1 < it.num_parts) return;
  // Last part in: every other part's scratch rows are visible (acq_rel on the counter).
  const int64_t parts = it.num_parts;
  std::vector<float> maxes(parts), sums(parts), merged(padded_d);
  std::vector<const float*> accs(parts);
  const float* all = scratch + it.scratch_row * stride;
  for (int64_t r = 0; r < Hq; ++r) {
    for (int64_t i = 0; i < parts; ++i) {
      const float* row = all + (i * Hq + r) * stride;
      maxes[i] = row[0];
      sums[i] = row[1];
      accs[i] = row + 16;
    }
    merge_partials(static_cast<int>(parts), maxes.data(), sums.data(), accs.data(),
                   static_cast<int>(p.head_size), p.v_scale, merged.data(),
                   p.sinks ? p.sinks + r : nullptr);
    store_output_row(p, it.seq, r, merged.data(), 1.0f);
  }
}

// One item, portable scalar code (machines without AVX-512 or AVX2; same algorithm and order).
template <typename KV>
void decode_item_scalar(const Problem& p, const Item& it, float* scratch,
                        std::atomic<int32_t>* arrivals) {
  const int64_t D = p.head_size, G = p.group, Hq = p.num_heads, Hkv = p.num_kv_heads;
  const int64_t BS = p.block_size;
  const int64_t DP = (D + 15) / 16 * 16;
  const int64_t q_pos = p.seq_lens[it.seq] - 1;
  const int32_t* table = p.tables + it.seq * p.max_blocks;
  const KV* kc = static_cast<const KV*>(p.key_cache);
  const KV* vc = static_cast<const KV*>(p.value_cache);
  FloatBuffer q(static_cast<size_t>(Hq * DP));
  for (int64_t r = 0; r < Hq; ++r) load_query_row(p, it.seq, r, q.get() + r * DP);
  RowsState st(Hq, DP);
  std::vector<float> kv(2 * D);
  const bool split = p.layout == CacheLayout::kSplit;
  const int64_t x = p.x;
  // Blocks in table order, then tokens, then kv heads.
  for (int64_t pos = it.begin; pos < it.end; ++pos) {
    const int64_t b = pos / BS, t = pos - b * BS;
    for (int64_t h = 0; h < Hkv; ++h) {
      if (split) {  // key [NB, Hkv, D / x, BS, x], value [NB, Hkv, D, BS]
        const int64_t head = (table[b] * Hkv + h) * D * BS;
        for (int64_t d = 0; d < D; ++d) {
          kv[d] = widen(kc[head + (d / x) * BS * x + t * x + d % x]);
          kv[D + d] = widen(vc[head + d * BS + t]);
        }
      } else {  // [NB, BS, Hkv, D]
        const int64_t row = ((table[b] * BS + t) * Hkv + h) * D;
        for (int64_t d = 0; d < D; ++d) {
          kv[d] = widen(kc[row + d]);
          kv[D + d] = widen(vc[row + d]);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const int64_t row = h * G + g;
        const float* qrow = q.get() + row * DP;
        float logit = 0.0f;
        for (int64_t d = 0; d < D; ++d) logit += qrow[d] * kv[d];
        logit = soft_cap(logit, p.cap);
        if (p.alibi) logit += alibi_bias(p.alibi[row], pos, q_pos);
        OnlineSoftmaxRow& state = st.rows[row];
        const float factor = state.rescale(logit);
        const float prob = std::exp(logit - state.max);
        state.add_sum(prob);
        float* arow = st.acc.get() + row * DP;
        for (int64_t d = 0; d < D; ++d) arow[d] = arow[d] * factor + prob * kv[D + d];
      }
    }
  }
  finish_item(p, it, st, DP, scratch, arrivals);
}

#if JAX_ATTN_AVX512 || JAX_ATTN_AVX2


// Prefetches rows of keys and of values (non-temporal by default: each line is read once), a
// few cache lines at a time, so that the requests are spread over the current tile's math:
// issued in one burst they fill the core's miss buffers and the math that follows runs with
// the memory idle (figures: the top of this file).
class TilePrefetcher {
 public:
  TilePrefetcher() = default;
  // `rows` rows of keys from `key` and of values from `value` (nullptr: keys only), rows
  // `row_stride` bytes apart and `row_bytes` long; a row's requests cover every line it
  // touches, in keys and in values, whatever their alignments.
  // `to_l2`: PREFETCHT1 (into L2) instead of PREFETCHNTA.
  TilePrefetcher(const void* key, const void* value, int64_t row_stride, int64_t rows,
                 int64_t row_bytes, bool to_l2 = false)
      : k_(static_cast<const char*>(key)),
        v_(static_cast<const char*>(value ? value : key)),
        stride_(row_stride),
        row_bytes_(row_bytes),
        rows_(rows),
        to_l2_(to_l2) {
    if (rows_ > 0) start_row();
  }
  // Lines (of each cache) not yet requested; rows after the current one counted like the first.
  int64_t remaining() const { return rows_ > 0 ? (rows_ - 1) * lines_per_row_ + left_ : 0; }
  // Request the next n lines of each cache. GCC keeps this out of line, and that matters: its
  // state then goes through memory and each request waits on the one before, about one K + V
  // pair per 13 cycles, which on the Zen 5 VM paces the requests near one core's share of the
  // memory. Forced inline (state in registers) the math ran faster from L2 but the decode from
  // memory slower (f32 8.3-8.4 vs 7.2-8.0 ms, bf16 no gain); forced noinline it changed other
  // inlining and was no faster (NOTES.md, 2026-11-26 06:37).
  inline void issue(int64_t n) {
    if (to_l2_) {
      issue_with<_MM_HINT_T1>(n);
    } else {
      issue_with<_MM_HINT_NTA>(n);
    }
  }

 private:
  template <int kHint>
  inline void issue_with(int64_t n) {
    for (; n > 0 && rows_ > 0; --n) {
      _mm_prefetch(k_line_ + offset_, static_cast<_mm_hint>(kHint));
      _mm_prefetch(v_line_ + offset_, static_cast<_mm_hint>(kHint));
      offset_ += 64;
      if (--left_ == 0) {
        k_ += stride_;
        v_ += stride_;
        if (--rows_ > 0) start_row();
      }
    }
  }

  void start_row() {
    const auto k_mis = static_cast<int64_t>(reinterpret_cast<uintptr_t>(k_) & 63);
    const auto v_mis = static_cast<int64_t>(reinterpret_cast<uintptr_t>(v_) & 63);
    k_line_ = k_ - k_mis;
    v_line_ = v_ - v_mis;
    offset_ = 0;
    left_ = (std::max(k_mis, v_mis) + row_bytes_ + 63) / 64;
    if (lines_per_row_ == 0) lines_per_row_ = left_;
  }
  const char* k_ = nullptr;  // the current rows' first bytes
  const char* v_ = nullptr;
  const char* k_line_ = nullptr;  // ... and the lines that hold them
  const char* v_line_ = nullptr;
  int64_t stride_ = 0, row_bytes_ = 0, rows_ = 0;
  int64_t offset_ = 0, left_ = 0, lines_per_row_ = 0;
  bool to_l2_ = false;
};

// One contiguous run of lines in each cache (the next tile's [rows, Hkv, D], or a head block
// of the split layout), requested `per` K + V pairs at a time (step) from inside math loops,
// its state in registers: TilePrefetcher::issue is a call there, and around a call every
// accumulator is spilled (all zmm registers are caller-saved). Used by the AMX split decode,
// the split layout's tiles (split_tile in decode_item) and lanes (decode_split.h). On the
// tiles, TilePrefetcher's call per key chunk and per value pair spilled split_logits' 16
// accumulators: TORCH_SDPA's e4m3 decode took 1.19-1.21x as long from memory (block 16 and
// 128), bf16 1.10x with the cache in L3 (2-core Zen 5 VM, paired; NOTES.md 2026-12-05).
// The AVX2 decode and the quads pace it instead (pace, paced_step): the pairs spread evenly
// over a number of steps, one at a time, by an integer credit (decode_avx2.h,
// decode_quads.h). In the quads a request per head step (48 per tile) instead sent them in
// bursts (from memory the bf16 decode then took 5.0 ms against 3.2; NOTES.md).
struct LineCursor {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t left = 0;  // K + V line pairs not yet requested
  int64_t per = 0;
  int64_t num = 0, den = 1, credit = 0;  // pace: num pairs per den steps (paced_step)
  bool to_l2 = false;
  LineCursor() = default;
  LineCursor(const void* key, const void* value, int64_t bytes, bool l2) : to_l2(l2) {
    const auto ka = reinterpret_cast<uintptr_t>(key), va = reinterpret_cast<uintptr_t>(value);
    const int64_t mis = static_cast<int64_t>(std::max(ka & 63, va & 63));
    k = reinterpret_cast<const char*>(ka & ~static_cast<uintptr_t>(63));
    v = reinterpret_cast<const char*>(va & ~static_cast<uintptr_t>(63));
    left = (mis + bytes + 63) / 64;
  }
  // Pairs not yet requested (TilePrefetcher's name for it).
  int64_t remaining() const { return left; }
  // The next `per` pairs (set per tile from the tile's number of steps).
  inline void step() { issue(per); }
  // Under pace: the pairs this step's share of the credit adds up to (compare and subtract: a
  // division per step cost the AVX2 fp8 decode 8%). Forced inline: AVX2 builds called it out of
  // line at every step, spilling the math's ymm registers around each call (the AVX2 build on
  // the Zen 5 VM, paired: decode-fp8-bs128 1.024x, bf16 1.015x; AVX-512 builds inlined it).
  __attribute__((always_inline)) inline void paced_step() {
    for (credit += num; credit >= den; credit -= den) issue(1);
  }
  // The pairs left, spread evenly over the next `steps` steps.
  inline void pace(int64_t steps) {
    num = left;
    den = std::max<int64_t>(steps, 1);
    credit = 0;
  }
  // The pairs left, ceil(left / steps) at each of the next steps (done early, by up to a step's
  // share per step).
  inline void pace_ahead(int64_t steps) {
    num = (left + std::max<int64_t>(steps, 1) - 1) / std::max<int64_t>(steps, 1);
    den = 1;
    credit = 0;
  }
  inline void issue(int64_t n) {
    for (; n > 0 && left > 0; --n, --left, k += 64, v += 64) {
      if (to_l2) {
        _mm_prefetch(k, _MM_HINT_T1);
        _mm_prefetch(v, _MM_HINT_T1);
      } else {
        _mm_prefetch(k, _MM_HINT_NTA);
        _mm_prefetch(v, _MM_HINT_NTA);
      }
    }
  }
};

#endif  // JAX_ATTN_AVX512 || JAX_ATTN_AVX2

#if JAX_ATTN_AVX2
#include "decode_avx2.h"  // decode_item_avx2: the item function of AVX2 builds
#endif

#if JAX_ATTN_AVX512

// The AVX-512 tile helpers and the bf16 key dot (decode_vec.h; JAX_ATTN_DECODE_BF16_DOT), and
// the fp8 conversions of the vdpbf16ps path (decode_fp8.h; JAX_ATTN_DECODE_FP8_DOT): parts of
// this kernel of their own, included here inside this file's namespaces (they use
// TilePrefetcher).
#include "decode_vec.h"
#include "decode_fp8.h"

// The query rows of one item: float32 scaled by qk_scale ([Hq, DP], zero-padded), and for the
// bf16 dot path the unscaled bf16 rows ([Hq, DP2], zero-padded; DP2 = NC2 * 32).
struct Queries {
  const float* f32;
  const bf16_t* bf16;
};

// The split layout's logits without a key tile: rows [row0, row0 + rg) of kv head's keys at
// `keys` ([D / x, BS, x], x = 16 bytes), tokens [t0, t0 + n) of the block. Each 16-byte piece
// of 4 tokens x (4 float32 | 8 bf16 dims) is one lane group of a register, multiplied by the
// row's matching 16 query bytes broadcast to every group (fma, or vdpbf16ps under kDot), so
// the cache is read in place; the 4 partial sums of each token are added at the end. Tokens
// >= n are never read (masked loads: zeros). logits[r]: lane t = token t0 + t, times qk_scale.
// RG rows at compile time: with a runtime row count, GCC kept the 16 accumulators on the stack
// (a load and a store around every vdpbf16ps). With RG fixed and the lanes' prefetches in
// registers (LineCursor), the split bf16 decode at block 128 took 2.81 ms from L2 against 3.65,
// 5.70 from memory against 7.19 (2-core Zen 4 VM, 32 x 1024 keys; NOTES.md).
// Pf: TilePrefetcher or LineCursor (issue(n)).
template <int NC, bool kDot, int RG, typename Pf>
inline void split_logits_rows(const Problem& p, const Queries& q, const void* keys, int64_t t0,
                              int64_t n, int64_t row0, __m512* logits, Pf& pf, int64_t per_step) {
  constexpr int64_t DP = NC * 16;
  [[maybe_unused]] constexpr int64_t DP2 = (NC + 1) / 2 * 32;  // the kDot rows (bf16 builds)
  const int64_t BS = p.block_size;
  __m512 acc[RG][4];
#pragma GCC unroll 4
  for (int r = 0; r < RG; ++r) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  // Valid lanes of register j (tokens 4j .. 4j + 3): 4 float32 / 8 bf16 lanes per token.
  uint32_t valid[4];
  for (int j = 0; j < 4; ++j) {
    valid[j] = 0;
    for (int k = 0; k < 4; ++k) {
      if (4 * j + k < n) valid[j] |= (kDot ? 0xffu : 0xfu) << ((kDot ? 8 : 4) * k);
    }
  }
  if constexpr (kDot) {
#if JAX_ATTN_DECODE_BF16_DOT
    const bf16_t* k = static_cast<const bf16_t*>(keys) + t0 * 8;
#pragma GCC unroll 2
    for (int64_t c = 0; c < p.head_size / 8; ++c) {
      pf.issue(per_step);
      __m512i kv[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        kv[j] = _mm512_maskz_loadu_epi16(valid[j], k + c * BS * 8 + 32 * j);
      }
#pragma GCC unroll 4
      for (int r = 0; r < RG; ++r) {
        const auto* qr = reinterpret_cast<const __m128i*>(q.bf16 + (row0 + r) * DP2 + 8 * c);
        const __m512i qb = _mm512_broadcast_i32x4(_mm_loadu_si128(qr));
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)qb, (__m512bh)kv[j]);
        }
      }
    }
#endif
  } else {
    const float* k = static_cast<const float*>(keys) + t0 * 4;
#pragma GCC unroll 2
    for (int64_t c = 0; c < p.head_size / 4; ++c) {
      pf.issue(per_step);
      __m512 kv[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        kv[j] = _mm512_maskz_loadu_ps(static_cast<__mmask16>(valid[j]), k + c * BS * 4 + 16 * j);
      }
#pragma GCC unroll 4
      for (int r = 0; r < RG; ++r) {
        const __m512 qb = _mm512_broadcast_f32x4(_mm_load_ps(q.f32 + (row0 + r) * DP + 4 * c));
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(kv[j], qb, acc[r][j]);
      }
    }
  }
  // acc[r][j], 128-bit lane L: the 4 partial sums of token 4j + L. Pairs, then quads, leave
  // token 4k + L at position 4L + k; one permute puts token t at lane t.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
#pragma GCC unroll 4
  for (int r = 0; r < RG; ++r) {
    const __m512* a = acc[r];
    const __m512 x01 = _mm512_add_ps(_mm512_shuffle_ps(a[0], a[1], 0x88),
                                     _mm512_shuffle_ps(a[0], a[1], 0xdd));
    const __m512 x23 = _mm512_add_ps(_mm512_shuffle_ps(a[2], a[3], 0x88),
                                     _mm512_shuffle_ps(a[2], a[3], 0xdd));
    const __m512 y = _mm512_add_ps(_mm512_shuffle_ps(x01, x23, 0x88),
                                   _mm512_shuffle_ps(x01, x23, 0xdd));
    logits[r] = _mm512_permutexvar_ps(order, y);
    if constexpr (kDot) logits[r] = _mm512_mul_ps(logits[r], _mm512_set1_ps(p.qk_scale));
  }
}

// Rows [row0, row0 + rg) of split_logits_rows, rg in [1, 4].
template <int NC, bool kDot, typename Pf>
inline void split_logits(const Problem& p, const Queries& q, const void* keys, int64_t t0,
                         int64_t n, int64_t row0, int rg, __m512* logits, Pf& pf,
                         int64_t per_step) {
  switch (rg) {
    case 4: return split_logits_rows<NC, kDot, 4>(p, q, keys, t0, n, row0, logits, pf, per_step);
    case 3: return split_logits_rows<NC, kDot, 3>(p, q, keys, t0, n, row0, logits, pf, per_step);
    case 2: return split_logits_rows<NC, kDot, 2>(p, q, keys, t0, n, row0, logits, pf, per_step);
    default:
      return split_logits_rows<NC, kDot, 1>(p, q, keys, t0, n, row0, logits, pf, per_step);
  }
}

// The decode's softmax reference is lazy: a row's `max` (OnlineSoftmaxRow) moves only when a
// tile's logit passes it by more than kDecodeLazyMargin (natural log units), so most tiles
// leave the row's running sum and output unscaled (factor exactly 1: accumulate_* skip the
// multiply) and skip the max's reduction across lanes. Any reference at or below the true max
// gives the same softmax; probabilities then stay below e^kDecodeLazyMargin (~245), far inside
// float32 and bf16 range, with the same relative rounding. (attend_tile, and decode_quads.h's
// attend_tile_quads.)
constexpr float kDecodeLazyMargin = 5.5f;

// A row's reference for exp: its max, or 0 while it has seen no finite logit (every lane of
// its tile is then -inf, and exp(-inf - 0) = 0).
inline float lazy_reference(const OnlineSoftmaxRow& state) {
  return state.max == -std::numeric_limits<float>::infinity() ? 0.0f : state.max;
}

// The factor a row's running sum and output take for a tile's logits (1: its reference stays),
// moving the reference when a logit passes it by the margin.
inline float lazy_rescale(OnlineSoftmaxRow& state, __m512 logits) {
  const __m512 limit = _mm512_set1_ps(state.max + kDecodeLazyMargin);
  if (_mm512_cmp_ps_mask(logits, limit, _CMP_GT_OQ) == 0) return 1.0f;
  return state.rescale(_mm512_reduce_max_ps(logits));
}

// exp(x - ref) for probabilities that are rounded to bf16 next (exp2_bf16_16, relative error
// 7.5e-5): the running sum takes the same values, so only the bf16 rounding of the p.v's copy
// tells numerator and denominator apart. ref_log2 = ref * log2(e); x = -inf (a lane past the
// tile) gives 0.
inline __m512 exp_bf16_probs(__m512 x, __m512 ref_log2) {
  // (max_ps returns its second operand where either is NaN: a NaN logit stays NaN.)
  return exp2_bf16_16(_mm512_max_ps(
      _mm512_set1_ps(-1e30f), _mm512_fmsub_ps(x, _mm512_set1_ps(1.44269504088896341f), ref_log2)));
}

// All G query rows of kv head h against one tile of n tokens: logits, online softmax, values.
// Keys: the widened tile ktile ([16, DP] float32), or with kDot the bf16 tile ktile2 ([16, DP2]);
// values: rows [0, n) of a float32 tile at v_rows, v_stride elements apart. The prefetches of
// a later tile (pf) are spread evenly over the steps of the math (each key chunk of each query
// row's logits, each token of the value sums: ~16 FMAs apart); what is left is issued at the
// end. Pf: TilePrefetcher (token-major caches) or LineCursor (the split layout).
template <int NC, bool kDot, typename Pf>
__attribute__((noinline)) void attend_tile(const Problem& p, const Queries& q, RowsState& st,
                                           const float* ktile,
                                           [[maybe_unused]] const bf16_t* ktile2,
                                           const float* v_rows, int64_t v_stride, int64_t h,
                                           int64_t n, __m512 distance,
                                           Pf& prefetcher,
                                           const __m512* pre = nullptr,
                                           const uint32_t* vpairs = nullptr) {
  constexpr int64_t DP = NC * 16;
  constexpr int NC2 = (NC + 1) / 2;
  const int64_t G = p.group;
  Pf pf = prefetcher;  // a local copy: kept in registers
  const int64_t key_steps = pre ? 0 : G * (kDot ? NC2 : NC);
  const int64_t value_steps = vpairs ? (n + 1) / 2 : n;  // per group of 4 rows and 4 chunks
  const int64_t steps =
      std::max<int64_t>(1, key_steps + (G + 3) / 4 * ((NC + 3) / 4) * value_steps);
  const int64_t per_step = (pf.remaining() + steps - 1) / steps;
  const __mmask16 valid = tail_mask(n);
  const __mmask16 last_mask = tail_mask(p.head_size - (NC - 1) * 16);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(64) float probs[4][16];
  // The G query rows of this kv head, up to 4 at a time.
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int rg = static_cast<int>(std::min<int64_t>(4, G - g0));
    float factor[4];
    float* acc[4];
    for (int r = 0; r < rg; ++r) {
      pf.issue(per_step);
      const int64_t row = h * G + g0 + r;
      // logits[t] = q . k[t]: 16 independent accumulators, one per key (or given: `pre`,
      // the G rows' logits of this tile already computed from the split layout's keys).
      __m512 dots[16];
      __m512 logits;
      if (pre) {
        logits = pre[g0 + r];
      } else
#if JAX_ATTN_DECODE_BF16_DOT
      if constexpr (kDot) {
        dot_keys_bf16<NC2>(q.bf16 + row * NC2 * 32, ktile2, dots, pf, per_step);
        logits = _mm512_mul_ps(transpose_sum16(dots), _mm512_set1_ps(p.qk_scale));
      } else
#endif
      {
        const float* qrow = q.f32 + row * DP;
#pragma GCC unroll 16
        for (int t = 0; t < 16; ++t) dots[t] = _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) {
          if (c > 0) pf.issue(per_step);
          const __m512 qc = _mm512_load_ps(qrow + 16 * c);
#pragma GCC unroll 16
          for (int t = 0; t < 16; ++t) {
            dots[t] = _mm512_fmadd_ps(_mm512_load_ps(ktile + t * DP + 16 * c), qc, dots[t]);
          }
        }
        logits = transpose_sum16(dots);
      }
      if (p.cap > 0.0f) logits = soft_cap16(logits, p.cap);
      if (p.alibi) logits = _mm512_fmadd_ps(_mm512_set1_ps(p.alibi[row]), distance, logits);
      logits = _mm512_mask_mov_ps(neg_inf, valid, logits);
      OnlineSoftmaxRow& state = st.rows[row];
      factor[r] = lazy_rescale(state, logits);
      const float ref = lazy_reference(state);
      // bf16 value pairs take the probabilities rounded to bf16: exp_bf16_probs.
      const __m512 pr = _mm512_maskz_mov_ps(
          valid, vpairs ? exp_bf16_probs(logits, _mm512_set1_ps(ref * 1.44269504088896341f))
                        : exp16(_mm512_sub_ps(logits, _mm512_set1_ps(ref))));
      state.add_sum(_mm512_reduce_add_ps(pr));
      _mm512_store_ps(probs[r], pr);
      acc[r] = st.acc.get() + row * DP;
    }
#if JAX_ATTN_DECODE_BF16_DOT
    if (vpairs) {  // kDot with a pair tile: the probabilities as bf16 pairs
      alignas(64) uint32_t pp[4][8];
      for (int r = 0; r < rg; ++r) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(pp[r]),
                           (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(probs[r])));
      }
      switch (rg) {
        case 4: accumulate_pairs<NC, 4>(vpairs, n, pp, factor, acc, pf, per_step); break;
        case 3: accumulate_pairs<NC, 3>(vpairs, n, pp, factor, acc, pf, per_step); break;
        case 2: accumulate_pairs<NC, 2>(vpairs, n, pp, factor, acc, pf, per_step); break;
        default: accumulate_pairs<NC, 1>(vpairs, n, pp, factor, acc, pf, per_step); break;
      }
      continue;
    }
#endif
    switch (rg) {
      case 4:
        accumulate_values<NC, 4>(v_rows, v_stride, last_mask, n, probs, factor, acc, pf,
                                 per_step);
        break;
      case 3:
        accumulate_values<NC, 3>(v_rows, v_stride, last_mask, n, probs, factor, acc, pf,
                                 per_step);
        break;
      case 2:
        accumulate_values<NC, 2>(v_rows, v_stride, last_mask, n, probs, factor, acc, pf,
                                 per_step);
        break;
      default:
        accumulate_values<NC, 1>(v_rows, v_stride, last_mask, n, probs, factor, acc, pf,
                                 per_step);
        break;
    }
  }
  pf.issue(pf.remaining());
}

// A token-major tile of a float32 or bf16 cache, every kv head at once, in the cache's address
// order: tokens in groups of 4, each group's rows (Hkv * D elements per token, contiguous) read
// head by head, so the tile's keys, then its values, stream through in runs of 4 rows. The
// per-head walk of attend_tile reads a head's 16 rows Hkv * D elements apart instead: every
// row on the same L1 sets, and the memory sees 16 short runs per head. (Decode B=32 ctx=1024
// Hq=32 Hkv=8 D=128 float32 on the 2-core Zen 5 VM, 4 rounds alternated: 5.7-6.3 ms vs
// 7.4-7.7; NOTES.md.)
// Per kv head and 4 query rows, the logits of 4 tokens are 16 accumulators summed by one
// transpose-and-add tree (kDot: bf16 pairs through vdpbf16ps, as dot_keys_bf16; else the keys
// widened in registers); values are summed for 4 rows x 4 chunks per register block, the
// accumulators going through memory between token groups. Per output element the float
// operations come in attend_tile's order.
// k_rows / v_rows: the tile's first token (kv head 0) in each cache; n <= 16 tokens: rows of
// tokens >= n are never read (zero_row, D zeros, stands in for them; their logits are masked).
// q: the scaled float32 query rows [Hq][DP], or under kDot the bf16 rows [Hq][DP2].
// logits: [Hq][16] scratch; probs: [Hq][16] and then Hq factors.
template <typename KV, int NC, bool kDot>
__attribute__((noinline)) void attend_tile_rows(const Problem& p, const void* q, RowsState& st,
                                                const KV* k_rows, const KV* v_rows,
                                                int64_t row_stride, int64_t n, __m512 distance,
                                                TilePrefetcher& prefetcher, const KV* zero_row,
                                                float* logits, float* probs) {
  constexpr int64_t DP = NC * 16;
  constexpr int NC2 = (NC + 1) / 2;
  [[maybe_unused]] constexpr int64_t DP2 = NC2 * 32;  // kDot (bf16 builds)
  constexpr int kKeyChunks = kDot ? NC2 : NC;
  constexpr int kValueBlocks = (NC + 3) / 4;
  constexpr bool kPairs = kDot && std::is_same_v<KV, bf16_t>;  // values by accumulate_value_pairs
  const int64_t D = p.head_size, G = p.group, Hkv = p.num_kv_heads, Hq = p.num_heads;
  TilePrefetcher pf = prefetcher;  // a local copy: kept in registers
  const int64_t groups = (n + 3) / 4, row_groups = (G + 3) / 4;
  const int64_t pairs = (n + 1) / 2;  // kPairs: the values' token pairs
  const int64_t value_steps = kPairs ? Hkv * row_groups * kValueBlocks * pairs
                                   : groups * Hkv * row_groups * 4 * kValueBlocks;
  const int64_t steps =
      std::max<int64_t>(1, groups * Hkv * row_groups * kKeyChunks + value_steps + Hq);
  const int64_t per_step = (pf.remaining() + steps - 1) / steps;
  const __mmask16 valid = tail_mask(n);
  const __mmask16 last_mask = tail_mask(D - (NC - 1) * 16);
  const int64_t tail2 = D - (NC2 - 1) * 32;  // bf16 elements in the last 32-element chunk
  [[maybe_unused]] const __mmask32 last_mask2 =
      tail2 >= 32 ? static_cast<__mmask32>(0xffffffffu)
                  : static_cast<__mmask32>((1u << tail2) - 1u);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());

  // Logits: lane 4r + i of the tree's sum is query row g0 + r, token t0 + i.
  for (int64_t t0 = 0; t0 < n; t0 += 4) {
    for (int64_t h = 0; h < Hkv; ++h) {
      const KV* k[4];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        k[i] = t0 + i < n ? k_rows + (t0 + i) * row_stride + h * D : zero_row;
      }
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int rg = static_cast<int>(std::min<int64_t>(4, G - g0));
        // Float32: this block's requests before its accumulators go live. issue is a call,
        // and a call takes every vector register with it: a request per chunk spilled and
        // reloaded all 16 (bf16, whose math is half as long, keeps the finer spread: in bursts
        // its decode from memory ran slower; NOTES.md).
        if constexpr (!kDot) pf.issue(kKeyChunks * per_step);
        __m512 acc[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int c = 0; c < kKeyChunks; ++c) {
          if constexpr (kDot) {
            pf.issue(per_step);
#if JAX_ATTN_DECODE_BF16_DOT
            const __mmask32 m = c == NC2 - 1 ? last_mask2 : static_cast<__mmask32>(0xffffffffu);
            const bf16_t* qh = static_cast<const bf16_t*>(q) + (h * G + g0) * DP2;
            __m512i kc[4];
#pragma GCC unroll 4
            for (int i = 0; i < 4; ++i) kc[i] = _mm512_maskz_loadu_epi16(m, k[i] + 32 * c);
#pragma GCC unroll 4
            for (int r = 0; r < 4; ++r) {
              if (r >= rg) break;
              const __m512bh qc = (__m512bh)_mm512_load_si512(qh + r * DP2 + 32 * c);
#pragma GCC unroll 4
              for (int i = 0; i < 4; ++i) {
                acc[4 * r + i] = _mm512_dpbf16_ps(acc[4 * r + i], qc, (__m512bh)kc[i]);
              }
            }
#endif
          } else {
            const float* qh = static_cast<const float*>(q) + (h * G + g0) * DP;
            __m512 kc[4];
#pragma GCC unroll 4
            for (int i = 0; i < 4; ++i) {
              kc[i] = load_chunk<KV, NC>(k[i], c, last_mask);
              pin_register(kc[i]);  // each read by up to 4 rows: one load, not 4
            }
#pragma GCC unroll 4
            for (int r = 0; r < 4; ++r) {
              if (r >= rg) break;
              __m512 qc = _mm512_load_ps(qh + r * DP + 16 * c);
              pin_register(qc);
#pragma GCC unroll 4
              for (int i = 0; i < 4; ++i) {
                acc[4 * r + i] = _mm512_fmadd_ps(kc[i], qc, acc[4 * r + i]);
              }
            }
          }
        }
        __m512 sums = transpose_sum16(acc);
        if constexpr (kDot) sums = _mm512_mul_ps(sums, _mm512_set1_ps(p.qk_scale));
        float* out = logits + (h * G + g0) * 16 + t0;
        _mm_store_ps(out, _mm512_extractf32x4_ps(sums, 0));
        if (rg > 1) _mm_store_ps(out + 16, _mm512_extractf32x4_ps(sums, 1));
        if (rg > 2) _mm_store_ps(out + 32, _mm512_extractf32x4_ps(sums, 2));
        if (rg > 3) _mm_store_ps(out + 48, _mm512_extractf32x4_ps(sums, 3));
      }
    }
  }

  // The online softmax of each row over the tile (attend_tile's steps).
  float* factor = probs + Hq * 16;
  for (int64_t row = 0; row < Hq; ++row) {
    pf.issue(per_step);
    __m512 x = _mm512_load_ps(logits + row * 16);
    if (p.cap > 0.0f) x = soft_cap16(x, p.cap);
    if (p.alibi) x = _mm512_fmadd_ps(_mm512_set1_ps(p.alibi[row]), distance, x);
    x = _mm512_mask_mov_ps(neg_inf, valid, x);
    OnlineSoftmaxRow& state = st.rows[row];
    factor[row] = state.rescale(_mm512_reduce_max_ps(x));
    const __m512 pr =
        _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(x, _mm512_set1_ps(state.max))));
    state.add_sum(_mm512_reduce_add_ps(pr));
    if constexpr (kPairs) {  // (p[2k], p[2k+1]) rounded to bf16: 8 words of 32 bits per row
#if JAX_ATTN_DECODE_BF16_DOT
      _mm256_store_si256(reinterpret_cast<__m256i*>(probs + row * 16),
                         (__m256i)_mm512_cvtneps_pbh(pr));
#endif
    } else {
      _mm512_store_ps(probs + row * 16, pr);
    }
  }

  if constexpr (kPairs) {
#if JAX_ATTN_DECODE_BF16_DOT
    accumulate_value_pairs<NC>(p, st, v_rows, row_stride, n, zero_row,
                               reinterpret_cast<const uint32_t*>(probs), factor, pf, per_step);
#endif
    pf.issue(pf.remaining());
    return;
  }

  // Values: acc[row] = acc[row] * factor[row] (first group) + sum_t probs[row][t] * v[t].
  for (int64_t t0 = 0; t0 < n; t0 += 4) {
    const int nt = static_cast<int>(std::min<int64_t>(4, n - t0));
    for (int64_t h = 0; h < Hkv; ++h) {
      const KV* v[4];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        v[i] = t0 + i < n ? v_rows + (t0 + i) * row_stride + h * D : zero_row;
      }
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int rg = static_cast<int>(std::min<int64_t>(4, G - g0));
        const int64_t row0 = h * G + g0;
#pragma GCC unroll 4
        for (int cb = 0; cb < NC; cb += 4) {
          pf.issue(nt * per_step);  // before the accumulators go live (see the logits)
          __m512 o[4][4];
#pragma GCC unroll 4
          for (int r = 0; r < 4; ++r) {
            if (r >= rg) break;
            const float* a = st.acc.get() + (row0 + r) * DP + 16 * cb;
            const __m512 f = _mm512_set1_ps(factor[row0 + r]);
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {
              if (cb + j < NC) {
                o[r][j] = t0 == 0 ? _mm512_mul_ps(_mm512_load_ps(a + 16 * j), f)
                                  : _mm512_load_ps(a + 16 * j);
              }
            }
          }
          for (int i = 0; i < nt; ++i) {
            __m512 x[4];
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {
              if (cb + j < NC) {
                x[j] = load_chunk<KV, NC>(v[i], cb + j, last_mask);
                pin_register(x[j]);  // read by up to 4 rows
              }
            }
#pragma GCC unroll 4
            for (int r = 0; r < 4; ++r) {
              if (r >= rg) break;
              const __m512 pr = _mm512_set1_ps(probs[(row0 + r) * 16 + t0 + i]);
#pragma GCC unroll 4
              for (int j = 0; j < 4; ++j) {
                if (cb + j < NC) o[r][j] = _mm512_fmadd_ps(pr, x[j], o[r][j]);
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
  pf.issue(pf.remaining());
}

// vLLM's split layout a head block at a time, its values read as they lie (decode_split.h:
// attend_head_block_lanes, reduce_lanes), a part of this kernel of its own, included here inside
// this file's namespaces: it uses Problem, Queries, RowsState, TilePrefetcher and split_logits.
#include "decode_split.h"

// bf16 queries on a token-major bf16 or fp8 cache, GQA groups of 4 rows or more, a quad of rows
// per 128-bit lane group (decode_quads.h: attend_tile_quads), a part of this kernel of its own.
#include "decode_quads.h"

// One item on AVX-512. NC = ceil(D / 16) 16-float chunks per row; the last may be partial.
// kDot: bf16 queries on a bf16 or fp8 cache, keys dotted by vdpbf16ps (attend_tile_rows for a
// token-major bf16 cache, else dot_keys_bf16 or split_logits).
template <typename KV, int NC, bool kDot>
void decode_item(const Problem& p, const Item& it, float* scratch, std::atomic<int32_t>* arrivals) {
  constexpr int64_t DP = NC * 16;
  constexpr bool kFp8 = std::is_same_v<KV, e4m3_t> || std::is_same_v<KV, e5m2_t>;
  const int64_t D = p.head_size, Hq = p.num_heads, Hkv = p.num_kv_heads;
  const int64_t BS = p.block_size;
  const __mmask16 last_mask = tail_mask(D - (NC - 1) * 16);
  const int64_t q_pos = p.seq_lens[it.seq] - 1;
  const int32_t* table = p.tables + it.seq * p.max_blocks;
  const KV* kc = static_cast<const KV*>(p.key_cache);
  const KV* vc = static_cast<const KV*>(p.value_cache);
  const int64_t row_stride = Hkv * D;            // token t -> t + 1 inside a block
  const int64_t block_stride = BS * row_stride;  // one physical block
  const int64_t tiles_per_block = (BS + 15) / 16;

  FloatBuffer q(kDot ? 0 : static_cast<size_t>(Hq * DP));  // [Hq, DP], scaled, zero-padded
  constexpr int64_t DP2 = (NC + 1) / 2 * 32;  // bf16 elements per row of q2
  FloatBuffer q2(kDot ? static_cast<size_t>(Hq * DP2 / 2) : 0);  // [Hq, DP2] bf16, zero-padded
  if constexpr (kDot) {
    bf16_t* dst = reinterpret_cast<bf16_t*>(q2.get());
    const bf16_t* src = static_cast<const bf16_t*>(p.query) + it.seq * p.query_stride;
    for (int64_t r = 0; r < Hq; ++r) std::memcpy(dst + r * DP2, src + r * D, D * sizeof(bf16_t));
  } else {
    for (int64_t r = 0; r < Hq; ++r) load_query_row(p, it.seq, r, q.get() + r * DP);
  }
  const Queries queries{q.get(), reinterpret_cast<const bf16_t*>(q2.get())};
  // bf16 queries on a token-major bf16 or fp8 cache, groups of 4 rows or more, head sizes that
  // are multiples of 8: attend_tile_quads, its rows DP2 floats apart until the item's end.
  // The split layout's fp8 keys, widened into a tile of token rows, take the quads' logits
  // (quad_head_logits) under the same conditions.
  constexpr bool kQuadsBuilt = kDot && (std::is_same_v<KV, bf16_t> || kFp8);
  const bool quad_logits = kQuadsBuilt && p.quads && p.group >= 4 && D % 8 == 0;
  const bool quads = quad_logits && p.layout == CacheLayout::kTokenMajor;
  const int64_t quad_vectors = quad_logits ? Hkv * ((p.group + 3) / 4) * (D / 8) : 0;
  FloatBuffer quad_q(static_cast<size_t>(quad_vectors * 16));  // 32 bf16 per vector
  // Logits [G][16], probabilities [G][8], factors [G]; the rows' lane sums [Hq][16]; fp8: key
  // and value tiles [16][DP2].
  const int64_t quad_tiles = round_up(p.group * 25, 16);
  FloatBuffer quad_scratch(
      quads ? static_cast<size_t>(quad_tiles + Hq * 16 + (kFp8 ? 16 * DP2 : 0)) : 0);
  QuadScratch quad_s{};
  if (quad_logits) {
    pack_query_quads(static_cast<const bf16_t*>(p.query) + it.seq * p.query_stride, Hkv, p.group, D,
                     reinterpret_cast<bf16_t*>(quad_q.get()));
  }
  if (quads) {
    float* f = quad_scratch.get();
    bf16_t* tiles = reinterpret_cast<bf16_t*>(f + quad_tiles + Hq * 16);
    quad_s = QuadScratch{f, reinterpret_cast<uint32_t*>(f + p.group * 16), f + p.group * 24,
                         f + quad_tiles, tiles, tiles + 16 * DP2};
  }
  RowsState st(Hq, quads ? DP2 : DP);
  // One kv head's keys as an L1-resident tile, reused by the G query rows of its group: widened
  // [16, DP] (with kDot: bf16 [16, DP2]).
  alignas(64) float ktile[kDot ? 16 : 16 * DP];
  alignas(64) bf16_t ktile2[kDot ? 16 * DP2 : 32] = {};  // columns past D stay zero
  // Float32 and bf16 caches in jax_attn's token-major layout take attend_tile_rows (every kv
  // head of a tile at once, in address order); other token-major caches go kv head by kv head,
  // keys and values widened into float32 tiles first (one instantiation of the math for all).
  constexpr bool kRowsTiles = std::is_same_v<KV, float> || std::is_same_v<KV, bf16_t>;
  alignas(64) float vtile[kRowsTiles ? 16 : 16 * DP];
  // The split layout: values transposed a tile at a time into vtile_split (float32, or bf16
  // token pairs under kDot), fp8 under kDot 64 tokens at a time into vchunk (the pair rows of
  // 4 tiles: split_value_pairs_fp8); keys read in place (kKeysDirect: float32, bf16 under kDot)
  // or gathered into knative and widened from there.
  const bool split = p.layout == CacheLayout::kSplit;
  constexpr bool kKeysDirect = std::is_same_v<KV, float> || (kDot && !kFp8);
  alignas(64) float vtile_split[16 * DP];
  constexpr bool kChunkValues = kDot && kFp8;
  alignas(64) uint32_t vchunk[kChunkValues ? 32 * DP : 1];
  alignas(64) KV knative[kKeysDirect ? 1 : 16 * DP];
  // kKeysDirect: the G rows' logits of the current tile (split_logits), for attend_tile; fp8
  // under quad_logits: quad_head_logits'.
  FloatBuffer split_pre_rows(
      static_cast<size_t>((kKeysDirect || kQuadsBuilt ? p.group + 3 : 1) * 16));
  __m512* split_pre = reinterpret_cast<__m512*>(split_pre_rows.get());  // 64-byte aligned

  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#if JAX_ATTN_DECODE_FP8_DOT
  // The fp8 lookup tables, in registers for the whole item.
  Fp8Tables fp8{};
  if constexpr (kDot && kFp8) fp8 = fp8_tables<KV>();
#endif

  const int64_t first_block = it.begin / BS, last_block = (it.end - 1) / BS;
  // Memory order: the sequence's blocks in table order. Block b: [BS, Hkv, D] contiguous, in
  // tiles of <= 16 tokens; kv heads in turn read their tile's 16 rows (D elements, Hkv * D
  // apart), while later rows (through the block table) are prefetched:
  // - token-major: the next tile's keys and values, [rows, Hkv, D] each, contiguous. Head step
  //   h requests the h-th of each, so over a tile's Hkv steps every line of the next tile is
  //   requested once, in address order. (Before: each head's own 16 rows, 4 head steps ahead
  //   for keys and 8 for values, strided: DRAM pages opened 16 at a time. On the Zen 5 VM the
  //   address order took decode-bf16 from 4.4-4.8 to 3.9-4.0 ms, decode-f32 8.5-8.8 to
  //   7.7-8.5, 8 x 8192 f32 16.2-18.9 to 14.7-16.5; 3 rounds alternated.)
  // - split: kv heads outer (a head's block is contiguous in each cache and is read through
  //   before the next); the head block kPrefetchTiles tiles ahead (in whole head blocks, at
  //   least the next) for keys and twice as far for values, a share per tile. Before, tiles
  //   outer and heads inner, as for token-major: at block 128 each head block was visited 8
  //   times, 16 strided pieces each time, and its whole block requested in one tile's math.
  //
  // Token-major: the offset and rows of the tile after (block b, tile t0); rows 0 past the end.
  struct TileRows {
    int64_t offset, rows;
  };
  auto next_tile = [&](int64_t b, int64_t t0) {
    int64_t tt = t0 / 16 + 1, bb = b;
    if (tt >= tiles_per_block || b * BS + tt * 16 >= it.end) {
      tt = 0;
      ++bb;
    }
    if (bb > last_block) return TileRows{0, 0};
    return TileRows{table[bb] * block_stride + tt * 16 * row_stride,
                    std::min<int64_t>(16, BS - tt * 16)};
  };
  const int64_t elem = static_cast<int64_t>(sizeof(KV));
  // Scratch of attend_tile_rows: D zeros (a stand-in row), logits, probabilities and factors.
  alignas(64) float zero_row[kRowsTiles ? DP : 1] = {};
  FloatBuffer tile_logits(kRowsTiles ? static_cast<size_t>(Hq * 16) : 0);
  FloatBuffer tile_probs(kRowsTiles ? static_cast<size_t>(Hq * 17) : 0);
  // Split layout: tile (t0, n) of kv head h in block b, the `sub`-th of its 64-token chunk
  // (chunk_n tokens: the values are converted at sub 0); pf's requests spread over its math.
  auto split_tile = [&](int64_t b, int64_t t0, int64_t h, int64_t n, int64_t sub,
                        int64_t chunk_n, __m512 distance, LineCursor& pf) {
    const int64_t head = (table[b] * Hkv + h) * D * BS;  // [D / x, BS, x] and [D, BS]
    if constexpr (kKeysDirect) {  // float32, or bf16 under kDot: keys read in place
      // The prefetches, spread over every step here and in attend_tile (its value steps: per
      // group of 4 rows, 4 chunks x n tokens).
      const int64_t G = p.group;
      const int64_t value_steps = kDot ? (n + 1) / 2 : n;  // attend_tile's, per 4 chunks
      const int64_t steps = (G + 3) / 4 * (D * static_cast<int64_t>(sizeof(KV)) / 16 +
                                           (NC + 3) / 4 * value_steps) + NC;
      const int64_t per_step = (pf.remaining() + steps - 1) / steps;
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        split_logits<NC, kDot>(p, queries, kc + head, t0, n, h * G + g0,
                               static_cast<int>(std::min<int64_t>(4, G - g0)),
                               split_pre + g0, pf, per_step);
      }
      if constexpr (kDot) {  // bf16 values as pairs (transpose_split_value_pairs)
#if JAX_ATTN_DECODE_BF16_DOT
        uint32_t* vpairs = reinterpret_cast<uint32_t*>(vtile_split);
        transpose_split_value_pairs<NC>(vc + head, BS, t0, n, D, vpairs, pf, per_step);
        attend_tile<NC, kDot>(p, queries, st, ktile, ktile2, vtile_split, DP, h, n, distance,
                              pf, split_pre, vpairs);
#endif
      } else {
        transpose_split_values<KV, NC>(vc + head, BS, t0, n, D, vtile_split, pf, per_step);
        attend_tile<NC, kDot>(p, queries, st, ktile, ktile2, vtile_split, DP, h, n, distance,
                              pf, split_pre);
      }
    } else {
      if constexpr (kDot) {  // fp8 under bf16 queries: converted 64 codes at a time
#if JAX_ATTN_DECODE_FP8_DOT
        if (BS == 16) {
          split_value_pairs_fp8_16<KV, NC>(fp8, vc + head, t0, n, D, vchunk);
        } else if (sub == 0) {
          split_value_pairs_fp8<KV, NC>(fp8, vc + head, BS, t0, chunk_n, D, vchunk);
        }
        const uint32_t* vpairs = vchunk + 8 * sub * DP;
        const __m512* pre = nullptr;
        if (quad_logits) {  // keys in the layout's piece order; the tile's rows >= n are zeros
          split_keys_fp8_pieces(fp8, kc + head, BS, t0, n, D, ktile2);
          LineCursor no_lines;
          quad_head_logits<SplitPieces>(
              quads_of_head(reinterpret_cast<const bf16_t*>(quad_q.get()), h, p.group, D),
              FixedRows<SplitPieceRows>{ktile2}, n, D / 8, p.group, _mm512_set1_ps(p.qk_scale),
              split_pre_rows.get(), no_lines);
          pre = split_pre;
        } else {  // token rows for attend_tile's dot_keys_bf16
          split_keys_fp8_bf16(fp8, kc + head, BS, t0, n, D, DP2, ktile2);
        }
        attend_tile<NC, kDot>(p, queries, st, ktile, ktile2, vtile_split, DP, h, n, distance,
                              pf, pre, vpairs);
#endif
      } else {
        TilePrefetcher none;  // this path leaves the prefetches to attend_tile
        gather_split_keys(kc + head, BS, t0, n, D, knative, D);
        widen_tile<KV, NC>(knative, D, n, last_mask, ktile);
        transpose_split_values<KV, NC>(vc + head, BS, t0, n, D, vtile_split, none, 0);
        attend_tile<NC, kDot>(p, queries, st, ktile, ktile2, vtile_split, DP, h, n, distance,
                              pf);
      }
    }
  };
  // Split layout, head-major: kv head blocks in turn ((block, head) in table then head order);
  // the head block `steps` of them after (b, h) starts at this element offset of either cache
  // (-1 past the item's last block).
  auto head_block_ahead = [&](int64_t b, int64_t h, int64_t steps) -> int64_t {
    const int64_t k = (b - first_block) * Hkv + h + steps;
    const int64_t bb = first_block + k / Hkv;
    return bb > last_block ? -1 : (table[bb] * Hkv + k % Hkv) * D * BS;
  };
  // kPrefetchTiles tiles ahead for keys, twice as far for values, in whole head blocks.
  const int64_t keys_ahead = std::max<int64_t>(1, (p.prefetch_tiles + tiles_per_block - 1) /
                                                      tiles_per_block);
  const int64_t values_ahead = std::max<int64_t>(
      1, (2 * p.prefetch_tiles + tiles_per_block - 1) / tiles_per_block);
  const int64_t head_bytes = D * BS * elem;  // one kv head's block in either cache
  // The split layout's values as they lie (decode_split.h): float32, and bf16 under
  // vdpbf16ps, at blocks of kMinLaneBlock tokens or more, under $JAX_ATTN_CPU_SPLIT_LANES=1.
  constexpr bool kLaneValues = (std::is_same_v<KV, float> && !kDot) ||
                               (kDot && std::is_same_v<KV, bf16_t>);
  const bool lane_values = kLaneValues && split && p.split_lanes && BS >= kMinLaneBlock;
  const int64_t lane_rows = lane_values ? p.group : 0;
  const int64_t lane_stride = round_up(BS, 64);
  FloatBuffer lane_buffer(static_cast<size_t>(lane_rows * (2 * lane_stride + 1)));
  const LaneBlockScratch lane_scratch{
      lane_buffer.get(), lane_buffer.get() + lane_rows * lane_stride,
      lane_buffer.get() + 2 * lane_rows * lane_stride, lane_stride,
      kDot ? lane_stride / 32 : lane_stride};
  float* lanes = lane_values ? tls_lanes.get(static_cast<size_t>(Hq * DP * 16)) : nullptr;
  for (int64_t b = first_block; b <= last_block; ++b) {
    const int64_t t_begin = std::max(it.begin, b * BS) - b * BS;
    const int64_t t_end = std::min(it.end, b * BS + BS) - b * BS;
    const int64_t block_offset = table[b] * block_stride;
    if (split) {
      // A head block (contiguous in each cache) is read through whole before the next, whose
      // keys and values (keys_ahead / values_ahead head blocks on) are requested a share per
      // tile. Each query row's tiles still come in key order: the rows' results are the same.
      const int64_t tiles = (t_end - t_begin + 15) / 16;
      const int64_t share = ((head_bytes + tiles - 1) / tiles + 63) / 64 * 64;
      // NTA while what must stay in L1 between a request and its read fits the limit: the
      // head blocks requested ahead (keys_ahead of keys, values_ahead of values) and what is
      // left of the one being read (half of its two caches, on average). At blocks of 16 and
      // 32 that is 4 + 8 + 1 and 2 + 4 + 1 head blocks, 104-112 KiB in float32: with NTA the
      // lines fell out of a 32 KiB L1d before their reads and came again from memory (the next
      // head block alone, as before, stayed under the limit). TORCH_SDPA decode, 2-core Zen 4
      // VM, NTA / L2 (JAX_ATTN_CPU_NTA_LIMIT=49152 / 0, calls alternated in one process):
      // float32 11.8 / 8.9 ms at block 16, 12.7 / 10.0 at 32, 8 x 8192 25.1 / 19.8; bf16 5.47 /
      // 5.07 and 5.81 / 5.07; mixed 23.5 / 21.4. fp8 at block 128 (48 KiB) stays NTA: 4.68-4.71
      // vs 4.72-4.78. At blocks of 64 tokens or more the head block being read is not counted:
      // its lines were requested a head block earlier and every tile reads a slice of each of
      // them. bf16 at block 128 (64 KiB ahead) then takes NTA where L1d is 48 KiB: TORCH_SDPA
      // decode, 2-core Zen 5 VM, paired workers, L2 / NTA time 1.62 [1.24, 1.73] (32 x 1024),
      // 1.26 [1.22, 1.35] (8 x 8192); float32 there (128 KiB ahead) 1.03 [0.99, 1.05] either
      // way, so it stays L2 (NOTES.md 2026-12-04 22:35). On Zen 4 the limit is now 0
      // (nta_limit_bytes): its fp8 head blocks, which had stayed NTA, ran 1.28-1.32x faster
      // into L2 at 2026-12-06's kernels (level on 12-04).
      const int64_t being_read = BS >= 64 ? 0 : 1;
      const bool to_l2 = (keys_ahead + values_ahead + being_read) * head_bytes > p.nta_limit;
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t keys = p.prefetch_tiles > 0 ? head_block_ahead(b, h, keys_ahead) : -1;
        const int64_t values = p.prefetch_tiles > 0 ? head_block_ahead(b, h, values_ahead) : -1;
        if (lane_values) {  // the head block in one step, the blocks ahead requested meanwhile
          // (Into L2: with NTA, lines the lanes push out of L1 come again from memory. Further
          // ahead than the next head block ran slower; NOTES.md.)
          LineCursor pf;
          if (keys >= 0) {
            pf = LineCursor(kc + keys, vc + (values >= 0 ? values : keys), head_bytes, true);
          }
          attend_head_block_lanes<KV, NC, kDot>(
              p, queries, st, lanes, (table[b] * Hkv + h) * D * BS, h, t_begin, t_end,
              static_cast<float>(b * BS + t_begin - q_pos), b == first_block, pf, lane_scratch);
          continue;
        }
        for (int64_t i = 0, t0 = t_begin; t0 < t_end; ++i, t0 += 16) {
          const int64_t n = std::min<int64_t>(16, t_end - t0);
          const __m512 distance = _mm512_add_ps(
              iota, _mm512_set1_ps(static_cast<float>(b * BS + t0 - q_pos)));  // p_k - p_q
          LineCursor pf;
          const int64_t lo = i * share, bytes = std::min(share, head_bytes - lo);
          if (keys >= 0 && bytes > 0) {
            const char* k = reinterpret_cast<const char*>(kc + keys) + lo;
            const char* v = values >= 0 ? reinterpret_cast<const char*>(vc + values) + lo : k;
            pf = LineCursor(k, v, bytes, to_l2);
          }
          split_tile(b, t0, h, n, i % 4, std::min<int64_t>(64, t_end - t0), distance, pf);
        }
      }
      continue;
    }
    for (int64_t t0 = t_begin; t0 < t_end; t0 += 16) {
      const int64_t n = std::min<int64_t>(16, t_end - t0);
      const __m512 distance = _mm512_add_ps(
          iota, _mm512_set1_ps(static_cast<float>(b * BS + t0 - q_pos)));  // p_k - p_q
      if (kRowsTiles || quads) {
        // The next tile's keys and values ([rows, Hkv, D] each, contiguous), requested in
        // address order over this tile's steps. A tile that outgrows L1 beside the tile being
        // computed (float32's 128 KiB at Hkv 8, D 128; bf16's 64 KiB where L1d is 32 KiB) goes
        // to L2 (T1), smaller ones with NTA (nta_limit_bytes in cpu_features.h).
        const TileRows next = next_tile(b, t0);
        const bool ahead = p.prefetch_tiles > 0 && next.rows > 0;
        const int64_t next_bytes = next.rows * row_stride * elem;
        const bool to_l2 = 2 * next_bytes > p.nta_limit;
        const int64_t first = block_offset + t0 * row_stride;
        if constexpr (kQuadsBuilt) {
          if (quads) {
#if JAX_ATTN_DECODE_BF16_DOT
            const void* tables = nullptr;
#if JAX_ATTN_DECODE_FP8_DOT
            tables = &fp8;
#endif
            LineCursor lines;
            if (ahead) lines = LineCursor(kc + next.offset, vc + next.offset, next_bytes, to_l2);
            attend_tile_quads<KV, NC>(p, reinterpret_cast<const bf16_t*>(quad_q.get()), st,
                                      kc + first, vc + first, row_stride, n, distance, lines,
                                      reinterpret_cast<const bf16_t*>(zero_row), quad_s, tables);
#endif
            continue;
          }
        }
        const void* q_rows = kDot ? static_cast<const void*>(queries.bf16)
                                  : static_cast<const void*>(queries.f32);
        if constexpr (kRowsTiles) {
          TilePrefetcher pf;
          if (ahead) {
            pf = TilePrefetcher(kc + next.offset, vc + next.offset, 0, 1, next_bytes, to_l2);
          }
          attend_tile_rows<KV, NC, kDot>(p, q_rows, st, kc + first, vc + first, row_stride, n,
                                         distance, pf, reinterpret_cast<const KV*>(zero_row),
                                         tile_logits.get(), tile_probs.get());
        }
        continue;
      }
      for (int64_t h = 0; h < Hkv; ++h) {
        // This head step's share of the next tile (address order over the tile's head steps).
        TilePrefetcher pf;
        if (p.prefetch_tiles > 0) {
          const TileRows next = next_tile(b, t0);
          const int64_t chunk = next.rows * D;  // elements: this step's h-th of the tile
          if (next.rows > 0) {
            pf = TilePrefetcher(kc + next.offset + h * chunk, vc + next.offset + h * chunk, 0, 1,
                                chunk * elem,
                                2 * Hkv * chunk * elem > p.nta_limit);
          }
        }
        // Token-major float16 and fp8 caches: the head's rows widened into the tiles.
        if constexpr (!kRowsTiles) {
          const int64_t offset = block_offset + t0 * row_stride + h * D;
          if constexpr (kDot) {  // fp8 under bf16 queries
#if JAX_ATTN_DECODE_FP8_DOT
            convert_tile_fp8_bf16<KV, NC>(fp8, kc + offset, row_stride, n, D, ktile2);
            uint32_t* vpairs = reinterpret_cast<uint32_t*>(vtile);  // values as bf16 pairs
            convert_value_pairs_fp8<KV, NC>(fp8, vc + offset, row_stride, n, D, vpairs);
            attend_tile<NC, kDot>(p, queries, st, ktile, ktile2, vtile, DP, h, n, distance, pf,
                                  nullptr, vpairs);
#endif
          } else {
            widen_tile<KV, NC>(kc + offset, row_stride, n, last_mask, ktile);
            widen_tile<KV, NC>(vc + offset, row_stride, n, last_mask, vtile);
            attend_tile<NC, kDot>(p, queries, st, ktile, ktile2, vtile, DP, h, n, distance, pf);
          }
        }
      }
    }
  }
  if (lane_values && it.end > it.begin) reduce_lanes<NC>(lanes, Hq, D, st.acc.get());
#if JAX_ATTN_DECODE_BF16_DOT
  if (quads) {
    unpermute_quad_rows<NC>(st.acc.get(), Hq);
    fold_quad_sums(quad_s.sums, st, Hq);
  }
#endif
  finish_item(p, it, st, DP, scratch, arrivals);
}

// The AMX decode (decode_item_amx, under JAX_ATTN_AMX && JAX_ATTN_DECODE_BF16_DOT), a part of
// this kernel of its own, included here inside this file's namespaces: it uses Problem, Item,
// RowsState and finish_item above.
#include "decode_amx.h"
#include "decode_amx_split.h"

#endif  // JAX_ATTN_AVX512


// The item function for a cache dtype, head size and path, chosen once per call. Building
// with -DJAX_ATTN_CPU_FEW_HEAD_SIZES instantiates the vector kernel for head sizes 32, 64, 80,
// 128, 256 only (others run the scalar kernel): for quick sanitizer builds.
template <typename KV, bool kDot>
ItemFn pick_item_fn(int64_t head_size) {
  if (head_size < 1 || head_size > kMaxDecodeHeadSize) return nullptr;
#if JAX_ATTN_AVX512
  switch ((head_size + 15) / 16) {
#ifdef JAX_ATTN_CPU_FEW_HEAD_SIZES
    case 2: return decode_item<KV, 2, kDot>;
    case 4: return decode_item<KV, 4, kDot>;
    case 5: return decode_item<KV, 5, kDot>;
    case 8: return decode_item<KV, 8, kDot>;
    case 16: return decode_item<KV, 16, kDot>;
    default: return decode_item_scalar<KV>;
#else
    case 1: return decode_item<KV, 1, kDot>;
    case 2: return decode_item<KV, 2, kDot>;
    case 3: return decode_item<KV, 3, kDot>;
    case 4: return decode_item<KV, 4, kDot>;
    case 5: return decode_item<KV, 5, kDot>;
    case 6: return decode_item<KV, 6, kDot>;
    case 7: return decode_item<KV, 7, kDot>;
    case 8: return decode_item<KV, 8, kDot>;
    case 9: return decode_item<KV, 9, kDot>;
    case 10: return decode_item<KV, 10, kDot>;
    case 11: return decode_item<KV, 11, kDot>;
    case 12: return decode_item<KV, 12, kDot>;
    case 13: return decode_item<KV, 13, kDot>;
    case 14: return decode_item<KV, 14, kDot>;
    case 15: return decode_item<KV, 15, kDot>;
    default: return decode_item<KV, 16, kDot>;
#endif
  }
#elif JAX_ATTN_AVX2
  return decode_item_avx2<KV>;
#else
  return decode_item_scalar<KV>;
#endif
}

// A per-call on/off switch: `unset` without the variable, else whether it is a nonzero number.
inline bool env_switch(const char* name, bool unset) {
  const char* env = std::getenv(name);
  return env == nullptr ? unset : std::atoi(env) != 0;
}

// $JAX_ATTN_CPU_BF16_DOT=0 turns the vdpbf16ps paths off (keys widened to float32 instead).
inline bool dot_enabled() { return env_switch("JAX_ATTN_CPU_BF16_DOT", true); }

// The quads (attend_tile_quads, quad_head_logits) where they apply; $JAX_ATTN_CPU_DECODE_QUADS=0:
// never (the A/B switch of their measurements).
inline bool quads_enabled() { return env_switch("JAX_ATTN_CPU_DECODE_QUADS", true); }

// The lanes (decode_split.h) on vLLM's split layout at blocks of kMinLaneBlock or more, only
// where $JAX_ATTN_CPU_SPLIT_LANES=1: from memory the tile path is faster (decode_split.h).
inline bool split_lanes_enabled() { return env_switch("JAX_ATTN_CPU_SPLIT_LANES", false); }

#if JAX_ATTN_AVX512 && JAX_ATTN_DECODE_BF16_DOT
constexpr bool kBf16DotBuilt = true;
#else
constexpr bool kBf16DotBuilt = false;
#endif
#if JAX_ATTN_AVX512 && JAX_ATTN_DECODE_FP8_DOT
constexpr bool kFp8DotBuilt = true;
#else
constexpr bool kFp8DotBuilt = false;
#endif

// The item function for cache elements KV: the vdpbf16ps path for bf16 queries where this
// build has it (kDotBuilt) and $JAX_ATTN_CPU_BF16_DOT allows it, else the widening one.
template <typename KV, bool kDotBuilt>
ItemFn pick_item_fn_dot(DType query_type, int64_t head_size) {
  if constexpr (kDotBuilt) {
    if (query_type == DType::kBF16 && dot_enabled()) {
      return pick_item_fn<KV, true>(head_size);
    }
  }
  return pick_item_fn<KV, false>(head_size);
}

}  // namespace
}  // namespace jax_attn_cpu

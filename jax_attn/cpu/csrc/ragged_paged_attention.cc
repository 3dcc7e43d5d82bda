// Ragged paged attention on CPU: one call for a batch mixing prefill, chunked prefill with a
// cached prefix and decode (SPEC section 1, `paged_attention`), tiled flash-attention style.
//
//   batch:  |<---- seq 0: prefill (40) ---->|<- seq 1: chunk (9) ->|s2|s3|pad|
//   tiles (G = 4: 32 tokens x the 4 query heads of one kv head, per kv head):
//           [0..31]            [32..39]      [40..48]               [49] [50]
//
// A work item is (tile, kv head); decode-sized tiles (at most kSmallRows rows) take several kv
// heads, so each key's rows of those heads are read as one run. Per kv head, the rows are the
// tile's tokens x the G query heads that read it (row r = token r / G, head r % G: the query's
// own memory order). An item walks the keys it can see, kKeys at a time, with an online
// softmax in float32 (base 2: log2(e) folded into the scale):
//   S^T[n][r] = q_r . k_n            (queries transposed once per item, keys broadcast)
//   P = exp2(S - running max)        (vectorized over rows: max and sum are vertical)
//   O[r][:] = alpha_r * O[r][:] + sum_n P^T[n][r] v_n
// Causal tiles stop at their last query's position, sliding-window tiles start at their first
// query's window: the upper triangle outside a tile's own diagonal is never computed, and on
// the diagonal's step each block of rows stops at its last row's keys. Keys and values are
// widened to float32 (k_scale folded into the query, v_scale into the output). A task whose
// tiles all read key prefixes copies its kv head's keys and values once, each row padded by a
// cache line (off the cache's 4 KiB stride: PackedRows), and all its tiles read that copy; other
// items widen a step at a time into a small per-thread buffer, or read a float32 cache in
// place. Large float32 outputs are written by the last step's p.v blocks with streaming stores.
// bf16 queries on a bf16 cache run both products through vdpbf16ps where the CPU has it
// (AVX512_BF16): q.k with the keys straight from the cache, p.v with the probabilities rounded
// to bf16 and the values interleaved in key pairs, packed once per task (about 1.8x the
// float32 prefill's speed).
// Vectors: AVX-512 when built for it (-march=native on such a CPU), else 8-float GCC vectors
// (AVX2 + FMA code on such machines).
//
// Files: this one holds the tiling, the scheduling, the softmax, the checks and the dispatch,
// written once; the inner products per instruction set are parts of this kernel of their own,
// included below inside its namespaces: ragged_vec.h (the Vec type and the float32 FMA products
// qk_block, pv_block: AVX-512 or GCC vectors), ragged_bf16.h (the vdpbf16ps products
// qk_block_bf16, pv_block_bf16 and their packing: AVX512_BF16, JAX_ATTN_BF16_DOT) and
// ragged_amx.h (the AMX tile path run_task_amx: JAX_ATTN_AMX, over amx_tiles.h's products).
//
// Decodes: a run of consecutive sequences of one query token goes to the decode kernel
// (paged_decode.cc, after the tiles here) when it has kMinDecodeRun sequences or more, or
// kMinDecodeRunKeys keys or more in all: memory-bound work, which that kernel streams faster
// than the small tiles here, every kv head of a token at once, and a long sequence split over
// the workers (28 decodes at 1024 keys, float32: 7.8 vs 10.2 ms; one decode at 16384 keys, bf16:
// 1.5 vs 6.5 ms; 2-core Zen 5 VM, NOTES.md). Same semantics: a decode is the sequence's last
// position, so causal or not it sees keys [window start, seq_len). In a step that also has
// prefill tiles, its largest decode run runs beside them (run_beside): half the workers start
// on its memory-bound decodes while the others start on the compute-bound tiles, so the memory
// streams while the FMAs run ($JAX_ATTN_CPU_MIXED_SCHEDULE=staged: the older schedule, where
// the prefill math requests the decodes' blocks into L2 and the decodes follow group by group).
//
// Threads: tasks (runs of up to kTilesPerTask tiles of one sequence and kv head, which share
// their keys in L2) go longest first over the caller's `Workers` (XLA's intra-op pool for the
// FFI handler, ragged_paged_attention_xla.cc; torch's for the op, torch_ops.cc), one loop per
// worker taking tasks from one queue; JAX_ATTN_CPU_THREADS overrides the worker count.
// Framework-free (ragged_paged_attention.h): no XLA or torch header is included here.
//
// Only keys below seq_len are ever read, so unused cache memory (NaN included) never reaches
// an output. Bad metadata (ids outside the cache, lengths beyond the block table, a
// non-monotone query_start_loc, num_seqs beyond the rows) is an error naming the argument,
// checked before any read.

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx_tiles.h"
#include "cpu_features.h"
#include "output_memory.h"
#include "paged_decode.h"
#include "ragged_paged_attention.h"
#include "vec_avx2.h"

namespace jax_attn_cpu {
namespace {

// Keys per online-softmax step: 128 against 64, 4 rounds alternated: prefill-8x512 46.3-46.8 ms
// vs 47.8-48.9, mixed 11.0-11.4 vs 11.5-11.6, prefill-bf16 unchanged (half the steps: half
// the O rescales and per-step setup for the same math).
constexpr int kKeys = 128;
// Query rows (tokens x G) per tile, 128 against 64 (each key row and value pair loaded for
// twice the rows, half the per-step setup), alternated rounds: float32 with PackedRows,
// prefill-8x512 43.7-44.5 ms vs 45.1-47.5 and chunked-prefill 177-179 vs 185-188; the bf16 dot
// path, prefill-bf16 26.8-27.8 vs 27.9-29.2 (192 and 256 rows no better than 128).
constexpr int kTargetRows = 128;
constexpr int kTilesPerTask = 8;  // tiles of one (sequence, kv head) per thread task
// Tiles of at most kSmallRows rows per kv head (decode, short chunks) are memory-bound: one
// item takes up to kMaxHeadsPerItem kv heads, so each key's rows are read as one run.
constexpr int kSmallRows = 16;
constexpr int kMaxHeadsPerItem = 16;
// Runs of consecutive decode sequences (one query token each, the step's last token: vLLM puts
// a step's decodes together) go to the decode kernel when they have at least this many
// sequences, or this many visible keys in all. Shorter runs stay small tiles here, where they
// cost no call of their own (one decode at 256 keys: level; at 384: bf16 98 vs 71 us, float32
// 141 vs 85 us through the decode kernel).
constexpr int64_t kMinDecodeRun = 4;
constexpr int64_t kMinDecodeRunKeys = 512;
// A task's keys and values up to this size stay in the core's L2 for its later items.
constexpr int64_t kKeysInL2Bytes = 512 * 1024;
// A float32-path task's copied keys and values (PackedRows) up to this size. Past the core's
// L2 the copy still pays: its rows are off the cache's 4 KiB stride (PackedRows), and the later
// tiles read it from L3 as they would the cache itself. 4 MiB against 640 KiB, float32, block
// 128, 2-core Zen 5 VM: chunked-prefill (2304 keys a task) paired 1.015 [1.004, 1.027]; 4 x
// 1024 (vLLM's engine's prefill step) 81.5-83.7 ms against 83.2-85.8 and 2 x 2048 151-160
// against 152-168 in 3 alternated rounds each. At most 4 MiB a worker (tls_packed).
constexpr int64_t kSharedRowsBytes = 4096 * 1024;
// The vdpbf16ps path's value pairs packed once per task (PackedValues) up to this size, likewise
// past L2 (was kKeysInL2Bytes): chunked-prefill-bf16 (2304 keys a task, 590 KB of pairs), paired,
// 1.025 [1.014, 1.035] at block 128, 1.020 at 16, TORCH_SDPA's 1.019 (Zen 5).
constexpr int64_t kSharedPairsBytes = 4096 * 1024;
// Rows (tokens x G) up to which a float32 item's last step writes the output itself.
constexpr int64_t kMaxFusedRows = 256;
// ... with streaming stores when the whole output has at least this many bytes (and is 64-byte
// aligned): output lines are not read for ownership first, and far more output than the L2s
// hold does not push the task's keys and values out of them. 3 rounds alternated, twice:
// prefill-8x512 45.8 / 46.4 ms vs 46.1 / 47.4 / 48.4, then 45.7 / 46.8 / 47.5 vs 47.7 / 48.6 /
// 52.3; mixed (17 MiB) 11.1-11.2 vs 11.3-11.8, then 11.3-11.9 vs 11.3-12.2.
constexpr int64_t kStreamOutputBytes = 8 << 20;
// A mixed step's decode run goes beside its prefill tiles (run_beside) when it has at least
// kStageMinSeqsPerWorker sequences per worker (one item per sequence there: no split-K to
// balance long ones); the staged schedule takes it in groups of about kStageBytes of K and V
// (2, 4 and 8 MiB measured: 4 best).
constexpr int64_t kStageBytes = 4 << 20;
constexpr int64_t kStageMinSeqsPerWorker = 4;
// Lines of the next item's query requested before each q.k register block (8, 16, 32, 64
// measured: 16 best by a little).
constexpr int64_t kLinesPerBlock = 16;
// Logits are kept in base 2 (log2(e) folded into the query scale, the soft cap and the ALiBi
// slopes), so the softmax needs exp2 only. Masked logits are kMasked, a finite stand-in for
// -inf: exp2(kMasked - anything real) is exactly 0 and no lane ever sees inf - inf. A row
// whose running max is still below kNoKey has seen no visible key: it exponentiates against
// kNoKey, so its masked entries give 0 as well and its sum stays 0 (output zeros).
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kMasked = -1e30f;
constexpr float kNoKey = -1e29f;
// PvArgs::visible of a step without a causal limit: more keys than any step has.
constexpr int64_t kAllVisible = int64_t{1} << 40;

// Keys that row `row` of a causal step sees: n < visible + row / G (PvArgs::visible), at
// least none. The q.k key-block skip and the p.v stop both use it, so they cannot drift apart.
inline int64_t keys_seen(int64_t visible, int64_t G, int64_t row) {
  return std::max<int64_t>(0, visible + row / G);
}

// Decode data staged during a mixed step's prefill (run_beside's staged schedule): a group's
// decode blocks, handed out whole to the threads that compute the group's prefill tasks
// (WarmCursor), whose p.v blocks request one line per key step into L2 (PREFETCHT1) while their
// FMAs run.
struct WarmList {
  const char* key = nullptr;    // the caches
  const char* value = nullptr;
  int64_t block_bytes = 0;      // one physical block of one cache
  std::vector<int32_t> blocks;  // the group's decode blocks
  std::atomic<int64_t> next{0};  // next unit to hand out: 2 per block (its keys, its values)
};

// One thread's share of a WarmList: the lines [at, end) still to request.
struct WarmCursor {
  const char* at = nullptr;
  const char* end = nullptr;
  WarmList* list = nullptr;  // where the next unit comes from (nullptr: none left)
  // Take the next unit of the list when this one is done.
  void refill() {
    if (at < end || list == nullptr) return;
    const int64_t u = list->next.fetch_add(1, std::memory_order_relaxed);
    if (u >= 2 * static_cast<int64_t>(list->blocks.size())) {
      list = nullptr;
      return;
    }
    at = (u % 2 == 0 ? list->key : list->value) +
         static_cast<int64_t>(list->blocks[u / 2]) * list->block_bytes;
    end = at + list->block_bytes;
  }
};

// What one p.v block requests of a WarmCursor, one line per key step: a local copy of the
// cursor's current unit (kept in registers), written back by done().
struct WarmLines {
  const char* at = nullptr;
  const char* end = nullptr;
  WarmCursor* cursor;
  explicit WarmLines(WarmCursor* c) : cursor(c) {
    if (c != nullptr) {
      c->refill();
      at = c->at;
      end = c->end;
    }
  }
  void request_next() {
    if (at < end) {
      __builtin_prefetch(at, 0, 2);  // PREFETCHT1
      at += 64;
    }
  }
  void done() const {
    if (cursor != nullptr) cursor->at = at;
  }
};

// The inner kernels, inlined; -DJAX_ATTN_PROFILE keeps them apart for `perf`.
#ifdef JAX_ATTN_PROFILE
#define JAX_ATTN_HOT __attribute__((noinline))
#else
#define JAX_ATTN_HOT inline
#endif

// The inner products, per instruction set, in parts of this kernel of their own: the vector
// type and the float32 FMA products (ragged_vec.h: Vec, widen_row, qk_block, pv_block), and
// the vdpbf16ps ones (ragged_bf16.h: qk_block_bf16, pv_block_bf16, pack_value_pair,
// probability_pair; JAX_ATTN_BF16_DOT). Included here, inside this file's namespaces: they use
// kKeys, WarmLines and JAX_ATTN_HOT above.
#include "ragged_vec.h"
#include "ragged_bf16.h"

// The p.v operands of one head and step: the float32 path reads Pt[n][r] and value rows vr[n]
// for n < count; the bf16 dot path reads pairs, Pt as uint32 [count][Mp] and Vp [count][ldv]
// for count key pairs.
struct PvArgs {
  float* O;  // [M][ldo] unnormalized output rows
  int64_t ldo;
  const float* Pt;
  int64_t Mp;
  const float* const* vr;
  const uint32_t* Vp;
  int64_t ldv;
  int64_t count;
  // Causal steps: row r sees only keys n < visible + r / G (later keys have probability 0,
  // so each block of rows stops at its last row's limit); else visible is kAllVisible.
  int64_t visible;
  int64_t G;
  const float* alpha;
  bool first;              // the item's first step: O starts from zeros (not read)
  // The item's last step (float32 output, or bf16 on the bf16 dot path): row r's output, else
  // nullptr.
  void* const* out_rows;
  const float* inv;        // ... and its factor v_scale / row_sum (0: no visible key)
  bool stream;             // ... written with streaming stores (Problem::stream_out)
  WarmCursor* warm;        // decode lines to request meanwhile (the staged schedule), or nullptr
};

template <int R, int DV, bool kDot>
JAX_ATTN_HOT void pv_call(const PvArgs& a, int64_t r0, int64_t d0) {
  // Keys the block's last row sees (bf16 dot: key pairs, below).
  const int64_t keys = keys_seen(a.visible, a.G, r0 + R - 1);
  if constexpr (kDot) {
#if JAX_ATTN_BF16_DOT
    pv_block_bf16<R, DV>(a.O, a.ldo, reinterpret_cast<const uint32_t*>(a.Pt), a.Mp, a.Vp, a.ldv,
                         std::min(a.count, (keys + 1) / 2), r0, d0, a.alpha, a.first,
                         reinterpret_cast<bf16_t* const*>(a.out_rows), a.inv, a.warm);
#endif
  } else {
    pv_block<R, DV>(a.O, a.ldo, a.Pt, a.Mp, a.vr, std::min(a.count, keys), r0, d0, a.alpha, a.first,
                    reinterpret_cast<float* const*>(a.out_rows), a.inv, a.stream, a.warm);
  }
}

// All rows [0, M) for the vectors [d0, d0 + DV*W): blocks of kPvRows rows, then the rest.
template <int DV, bool kDot>
inline void pv_rows(const PvArgs& a, int64_t M, int64_t d0) {
  int64_t r0 = 0;
  for (; r0 + kPvRows <= M; r0 += kPvRows) pv_call<kPvRows, DV, kDot>(a, r0, d0);
  switch (M - r0) {
    case 5:
      pv_call<5, DV, kDot>(a, r0, d0);
      break;
    case 4:
      pv_call<4, DV, kDot>(a, r0, d0);
      break;
    case 3:
      pv_call<3, DV, kDot>(a, r0, d0);
      break;
    case 2:
      pv_call<2, DV, kDot>(a, r0, d0);
      break;
    case 1:
      pv_call<1, DV, kDot>(a, r0, d0);
      break;
    default:
      break;
  }
}

// ---------------------------------------------------------------------------------------------
// Problem description and work items.
// ---------------------------------------------------------------------------------------------
struct Problem {
  const void* query;      // [T, Hq, D], tokens q_stride elements apart
  int64_t q_stride;       // >= Hq * D
  const void* key_cache;  // [NB, BS, Hkv, D]
  const void* value_cache;
  void* out;              // [T, Hq, D]
  const int32_t* block_tables;  // [S, MB]
  const float* slopes;          // [Hq] or nullptr
  const float* sinks;           // [Hq] or nullptr: output_factor
  int64_t Hq, Hkv, G, D, Dp, BS, MB;
  float qk_scale;  // scale * k_scale * log2(e), folded into the queries
  float v_scale;   // folded into the output
  float cap;       // soft cap * log2(e), <= 0: none
  int64_t window;  // sliding window, <= 0: none
  bool causal;
  bool dot;  // bf16 queries on a bf16 cache, both products through vdpbf16ps (needs an even D)
  bool amx;  // bf16 queries on a bf16 or fp8 cache, both products on AMX tiles (run_item_amx)
  bool stream_out;  // output rows streamed (fused float32, AMX bf16): kStreamOutputBytes
};

// What a finished row's p.v sum is multiplied by: v_scale / its softmax denominator, 0 for a
// row that saw no visible key. The denominator is row_sum, plus the head's attention sink
// (kernel_common.h) where there is one; logits here are base 2, so the sink's share is
// 2^(sink * log2(e) - shift - row_max), shift being what the row's logits here fall short of
// the spec's (alibi_shift).
inline float output_factor(const Problem& p, float row_sum, float row_max, int64_t head,
                           float shift = 0.0f) {
  if (!(row_sum > 0.0f)) return 0.0f;
  const float sink = p.sinks ? std::exp2(p.sinks[head] * kLog2e - shift - row_max) : 0.0f;
  return p.v_scale / (row_sum + sink);
}

struct Item {
  int64_t seq;
  int64_t t0;      // first token (row of query/out)
  int64_t nt;      // tokens in the tile
  int64_t kvh;     // first kv head
  int64_t num_kv;  // kv heads [kvh, kvh + num_kv), processed together
  int64_t pos0;    // position of the first token in its sequence
  int64_t k_begin, k_end;  // keys the tile reads: [k_begin, k_end)
};

// The position an item's ALiBi distances are measured from, or -1 for each row's own. The
// spec's bias slope * (p_k - p_q) and slope * (p_k - origin) differ by a per-row constant,
// which the softmax cancels (the sink moves with it: alibi_shift). Causal rows see no key past
// p_q: their own. A non-causal row sees to its sequence's end (k_end, the item's last key):
// measured from there, the keys that carry the weight have logits near the unbiased ones,
// while from p_q the keys ahead carry slope x distance (~140 at 280 tokens), whose float32
// rounding shows in every probability (varlen's XLA path, 280-token bidirectional ALiBi:
// 2.3e-5 from the float64 oracle, 1.4e-6 measured from the end).
inline float alibi_origin(const Problem& p, const Item& it) {
  return p.causal || p.slopes == nullptr ? -1.0f : static_cast<float>(it.k_end - 1);
}

// What a row's base-2 logits fall short of the spec's under alibi_origin: slope (base 2) x how
// far the origin lies past the row.
inline float alibi_shift(float origin, float slope, float q_pos) {
  return origin < 0.0f ? 0.0f : slope * (origin - q_pos);
}

struct Task {  // items [first, first + num_items), run in order by one thread
  int64_t first, num_items, cost;
};

// One online-softmax step over keys [k0, k0 + nv) for rows [0, M), a vector of rows at a time:
// St[n][r] (base-2 logits in, probabilities out) walked key by key for each row vector, so the
// row max and row sum are vertical vector ops. alpha[r] gets the factor for the row's
// accumulator. Template flags drop the soft cap / ALiBi / mask code when a step needs none
// (interior steps of a causal tile are fully visible).
// kPairs (bf16 dot path): the probabilities leave as pairs Pp[i][r] = (P[2i][r], P[2i+1][r])
// rounded to bf16 (see pv_block_bf16), in place: row i of Pp overwrites St's row i <= 2i,
// whose columns were already read; a missing key 2i + 1 = nv counts as probability 0.
// kScaled (AMX path): St holds unscaled logits and p.qk_scale (> 0) is applied here: in the
// first pass where a mask or transform rewrites the logits anyway, else folded into the row max
// and the exponent (exp2(s * scale - max): one FMA, no pass that writes St).
// kLazy (AMX path): a row's reference (row_max) moves only when the step's max passes it by more
// than kLazyMargin, so most steps leave alpha at exactly 1 and the running output unscaled. Any
// reference works for the softmax (output and sum share it); this one keeps every probability
// below 2^kLazyMargin, far inside float32 and bf16 range, with the same relative rounding.
constexpr float kLazyMargin = 8.0f;
template <bool kTransform, bool kMask, bool kPairs, bool kScaled = false, bool kLazy = false>
JAX_ATTN_HOT void softmax_rows(const Problem& p, float* __restrict St, int64_t Mp, int64_t M,
                               int64_t nv, int64_t k0, const float* q_pos, const float* slope,
                               float alibi_from, const float* step_max, float* row_max,
                               float* row_sum, float* alpha) {
  const V masked = Vec::set1(kMasked);
  const V window = Vec::set1(static_cast<float>(p.window));
  const V scale = Vec::set1(p.qk_scale);
  for (int64_t rv = 0; rv < M; rv += W) {
    const V pq = Vec::load(q_pos + rv);
    const V pa = alibi_from < 0.0f ? pq : Vec::set1(alibi_from);  // alibi_origin
    const V sl = Vec::load(slope + rv);
    // The step's largest logit per row: kept by q.k (no mask, no transform), else found here.
    V chunk_max = step_max != nullptr ? Vec::load(step_max + rv) : masked;
    for (int64_t n = 0; step_max == nullptr && n < nv; ++n) {
      V s = Vec::load(St + n * Mp + rv);
      if (kTransform || kMask) {
        if (kScaled) s = Vec::mul(s, scale);
        const V pk = Vec::set1(static_cast<float>(k0 + n));
        if (kTransform) {
          if (p.cap > 0.0f) s = Vec::soft_cap(s, p.cap);
          if (p.slopes) s = Vec::fmadd(sl, Vec::sub(pk, pa), s);
        }
        if (kMask) {
          if (p.causal) s = Vec::if_le(pk, pq, s, masked);                        // p_k <= p_q
          if (p.window > 0) s = Vec::if_lt(Vec::sub(pq, pk), window, s, masked);  // p_q - p_k < W
        }
        Vec::store(St + n * Mp + rv, s);
      }
      chunk_max = Vec::max(chunk_max, s);
    }
    // Unscaled logits (kScaled without a rewrite): the max of s * scale is the max * scale.
    if (kScaled && !(kTransform || kMask)) chunk_max = Vec::mul(chunk_max, scale);
    const V old_max = Vec::load(row_max + rv);
    const V new_max =
        kLazy ? Vec::if_lt(Vec::add(old_max, Vec::set1(kLazyMargin)), chunk_max, chunk_max, old_max)
              : Vec::max(old_max, chunk_max);
    const V ref = Vec::max(new_max, Vec::set1(kNoKey));
    const V a = Vec::exp2(Vec::sub(old_max, ref));
    V sum = Vec::zero();
    if constexpr (kPairs) {
#if JAX_ATTN_BF16_DOT
      uint32_t* Pp = reinterpret_cast<uint32_t*>(St);
      // A logit of the step minus the reference: s - ref, or s * scale - ref when unscaled.
      const auto shifted = [&](V s) {
        if constexpr (kScaled && !(kTransform || kMask)) return Vec::fmsub(s, scale, ref);
        return Vec::sub(s, ref);
      };
      for (int64_t i = 0; 2 * i < nv; ++i) {
        const V e0 = Vec::exp2_bf16(shifted(Vec::load(St + 2 * i * Mp + rv)));
        sum = Vec::add(sum, e0);
        V e1 = Vec::zero();
        if (2 * i + 1 < nv) {
          e1 = Vec::exp2_bf16(shifted(Vec::load(St + (2 * i + 1) * Mp + rv)));
          sum = Vec::add(sum, e1);
        }
        _mm512_storeu_si512(Pp + i * Mp + rv, probability_pair(e0, e1));
      }
#endif
    } else {
      for (int64_t n = 0; n < nv; ++n) {
        const V e = Vec::exp2(Vec::sub(Vec::load(St + n * Mp + rv), ref));
        Vec::store(St + n * Mp + rv, e);
        sum = Vec::add(sum, e);
      }
    }
    Vec::store(row_max + rv, new_max);
    Vec::store(row_sum + rv, Vec::fmadd(Vec::load(row_sum + rv), a, sum));
    Vec::store(alpha + rv, a);
  }
}

// transform: the call has a soft cap or ALiBi; mask: the step masks logits.
template <bool kPairs, bool kScaled = false, bool kLazy = false>
inline void softmax_step(const Problem& p, float* St, int64_t Mp, int64_t M, int64_t nv,
                         int64_t k0, bool transform, bool mask, const float* q_pos,
                         const float* slope, float alibi_from, const float* step_max,
                         float* row_max, float* row_sum, float* alpha) {
  const auto rows = [&](auto transform, auto masked) {
    softmax_rows<decltype(transform)::value, decltype(masked)::value, kPairs, kScaled, kLazy>(
        p, St, Mp, M, nv, k0, q_pos, slope, alibi_from, step_max, row_max, row_sum, alpha);
  };
  const std::true_type yes;
  const std::false_type no;
  if (transform) {
    mask ? rows(yes, yes) : rows(yes, no);
  } else {
    mask ? rows(no, yes) : rows(no, no);
  }
}

thread_local Scratch tls_scratch;

// The vdpbf16ps path's value pairs of one task (run_task), packed once and read by all its
// items: pair j = keys 2j and 2j + 1 as [Dp] words. A task's causal tiles read key prefixes
// [0, k_end) of one kv head, last tile first, so the first item packs every pair the others
// read (each item used to pack the same pairs again).
struct PackedValues {
  uint32_t* data = nullptr;  // [capacity][Dp]
  int64_t pairs = 0;         // pairs [0, pairs) hold both their keys
};
// The float32 path's keys and values of one task, likewise: copied (widened) from the cache
// once, by the first item, and read by all. Rows are ld = Dp + kRowPad floats apart: in the
// cache a head's rows lie Hkv * D elements apart (4 KiB for 8 x 128 floats), all on the same
// L1 sets, so a step's value rows never stay in L1 between its p.v row blocks. prefill-8x512,
// 3 rounds alternated: 43.5-44.7 ms vs 45.2-46.5 read in place, 44.3-46.1 with rows Dp apart
// (a C++ model of one step's p.v: 95% of the FMA peak vs 88% in place, 93% Dp apart).
constexpr int64_t kRowPad = 16;
struct PackedRows {
  float* key = nullptr;  // [capacity][ld]
  float* value = nullptr;
  int64_t ld = 0;
  int64_t rows = 0;  // keys [0, rows) are copied
};
thread_local Scratch tls_packed;

// The running state of one kv head's rows in an item, in the thread's scratch.
struct HeadState {
  float* Qt;       // [D][Mp] scaled queries, transposed (bf16 dot: [D/2][Mp] bf16 pairs)
  float* O;        // [M][Dp] unnormalized output rows
  float* Kw;       // [kKeys][Dp] widened keys (bf16 dot: kKeys pointers to cache rows)
  float* Vw;       // [kKeys][Dp] widened values (bf16 dot: [kKeys / 2][Dp] value pairs)
  float* row_max;  // [Mp] each below
  float* row_sum;
  float* alpha;
  float* q_pos;
  float* slope;
  float* step_max;  // the step's largest logit per row (block_max)
  const float** kr;  // [kKeys] key n's row: in Kw, or the cache's own row (f32 cache)
  const float** vr;  // [kKeys] value n's row, likewise (bf16 dot: the cache's bf16 row)
};

inline int64_t head_state_floats(int64_t D, int64_t Dp, int64_t M, int64_t Mp) {
  return D * Mp + M * Dp + 2 * kKeys * Dp + 6 * Mp + 2 * kKeys * 2;  // 2 floats per pointer
}

// What the next item reads first, requested a few lines at a time (issue) between register
// blocks, so the requests trickle out instead of leaving in one burst (prefill-8x512 f32 and
// bf16 1-3% faster than one burst at the item's start): its query rows (`rows` runs of
// `run_bytes`, `stride` bytes apart from `base`), then, for the first item of another task,
// its first step's key and value runs (`keys` keys from `k_begin`, through the block table).
struct NextLines {
  const char* base = nullptr;
  int64_t stride = 0, run_bytes = 0, rows = 0;
  const char* key_cache = nullptr;  // the item's kv head in key slot 0 (bytes)
  const char* value_cache = nullptr;
  const int32_t* table = nullptr;
  int64_t block_size = 0, slot_bytes = 0, kv_run_bytes = 0, k_begin = 0, keys = 0;
  int64_t row = 0, offset = 0;  // runs [0, rows) are query rows, then K, V of each key
  const char* run = nullptr;    // the current run's first byte
  void issue(int64_t n) {
    for (; n > 0; --n) {
      if (offset == 0) {
        if (row < rows) {
          run = base + row * stride;
        } else if (row < rows + 2 * keys) {
          const int64_t pos = k_begin + (row - rows) / 2;
          const int64_t slot = static_cast<int64_t>(table[pos / block_size]) * block_size +
                               pos % block_size;
          run = ((row - rows) % 2 == 0 ? key_cache : value_cache) + slot * slot_bytes;
        } else {
          return;
        }
      }
      __builtin_prefetch(run + offset);
      offset += 64;
      if (offset >= (row < rows ? run_bytes : kv_run_bytes)) {
        offset = 0;
        ++row;
      }
    }
  }
  void issue_all() { issue(std::numeric_limits<int64_t>::max()); }
};

// S^T = K Q^T for one head: row-vector pairs outer (their Qt slice stays in L1), key blocks
// inner. Keys nv..nc of the last block are computed from zero rows and never read. visible:
// as PvArgs::visible; key blocks wholly past a row group's last row are skipped (the softmax
// masks those logits without reading them).
template <bool kDot>
inline void head_logits(const Problem& p, HeadState& h, float* St, int64_t Mp, int64_t nv,
                        int64_t visible, const float* zero_row, NextLines& lines,
                        float* step_max) {
  const int64_t nc1 = round_up(nv, kQkKeys1), nc2 = round_up(nv, kQkKeys2);
  if (step_max != nullptr) std::fill(step_max, step_max + Mp, kMasked);
  // Keys to compute for rows [r0, r0 + rows), in blocks of kb keys.
  const auto keys = [&](int64_t r0, int64_t rows, int64_t nc, int64_t kb) {
    return std::min(nc, round_up(keys_seen(visible, p.G, r0 + rows - 1), kb));
  };
  int64_t r0 = 0;
  if constexpr (kDot) {
#if JAX_ATTN_BF16_DOT
    const uint32_t* Qt2 = reinterpret_cast<const uint32_t*>(h.Qt);
    const uint32_t** kp = reinterpret_cast<const uint32_t**>(h.Kw);
    for (int64_t n = nv; n < nc1; ++n) kp[n] = reinterpret_cast<const uint32_t*>(zero_row);
    for (; r0 + 2 * W <= Mp; r0 += 2 * W) {
      for (int64_t n0 = 0; n0 < keys(r0, 2 * W, nc2, kQkKeys2); n0 += kQkKeys2) {
        lines.issue(kLinesPerBlock);
        qk_block_bf16<2, kQkKeys2>(Qt2, Mp, kp, p.D / 2, p.qk_scale, St, r0, n0, step_max, nv);
      }
    }
    for (; r0 < Mp; r0 += W) {
      for (int64_t n0 = 0; n0 < keys(r0, W, nc1, kQkKeys1); n0 += kQkKeys1) {
        lines.issue(kLinesPerBlock);
        qk_block_bf16<1, kQkKeys1>(Qt2, Mp, kp, p.D / 2, p.qk_scale, St, r0, n0, step_max, nv);
      }
    }
#endif
  } else {
    for (int64_t n = nv; n < nc1; ++n) h.kr[n] = zero_row;
#if !JAX_ATTN_AVX512
    for (; r0 + 3 * W <= Mp; r0 += 3 * W) {
      for (int64_t n0 = 0; n0 < keys(r0, 3 * W, nc2, kQkKeys2); n0 += kQkKeys2) {
        lines.issue(kLinesPerBlock);
        qk_block<3, kQkKeys2>(h.Qt, Mp, h.kr, p.D, St, r0, n0, step_max, nv);
      }
    }
#endif
    for (; r0 + 2 * W <= Mp; r0 += 2 * W) {
      for (int64_t n0 = 0; n0 < keys(r0, 2 * W, nc2, kQkKeys2); n0 += kQkKeys2) {
        lines.issue(kLinesPerBlock);
        qk_block<2, kQkKeys2>(h.Qt, Mp, h.kr, p.D, St, r0, n0, step_max, nv);
      }
    }
    for (; r0 < Mp; r0 += W) {
      for (int64_t n0 = 0; n0 < keys(r0, W, nc1, kQkKeys1); n0 += kQkKeys1) {
        lines.issue(kLinesPerBlock);
        qk_block<1, kQkKeys1>(h.Qt, Mp, h.kr, p.D, St, r0, n0, step_max, nv);
      }
    }
  }
}

// O = alpha O + P V for one head: vector columns of O outer (their slice of the values stays
// in L1), rows inner.
template <bool kDot>
inline void head_values(const PvArgs& a, int64_t Dp, int64_t M) {
  int64_t d0 = 0;
  for (; d0 + kPvVecs * W <= Dp; d0 += kPvVecs * W) pv_rows<kPvVecs, kDot>(a, M, d0);
  switch ((Dp - d0) / W) {
#if JAX_ATTN_AVX512
    case 3:
      pv_rows<3, kDot>(a, M, d0);
      break;
    case 2:
      pv_rows<2, kDot>(a, M, d0);
      break;
#endif
    case 1:
      pv_rows<1, kDot>(a, M, d0);
      break;
    default:
      break;
  }
}

// Whether the step over keys [k0, k0 + nv) of item `it` masks any logit: some key past a
// row's causal limit, or before a row's window.
inline bool step_masks(const Problem& p, const Item& it, int64_t k0, int64_t nv) {
  return (p.causal && k0 + nv - 1 > it.pos0) ||
         (p.window > 0 && k0 <= it.pos0 + it.nt - 1 - p.window);
}

// PvArgs::visible of the step from key k0: the keys row 0 sees (row r: r / G more), else
// kAllVisible without a causal limit.
inline int64_t step_visible(const Problem& p, const Item& it, int64_t k0) {
  return p.causal ? it.pos0 - k0 + 1 : kAllVisible;
}

// Query rows [0, M) of one kv head (row(r): a pointer to its D elements) transposed into Qt:
// scaled float32 Qt[d][r] ([D][Mp]), or under kDot unscaled bf16 pairs Qt2[i][r] = (q[r][2i],
// q[r][2i + 1]) ([D / 2][Mp]); rows [M, Mp) are zeros. Read row-major (d fastest), 16 rows x
// 16 columns at a time through registers (AVX2: 8 x 8; a scalar loop, strided stores, had taken
// ~9% of the f32 prefill's time on a Zen 3).
template <typename QT, bool kDot, typename RowFn>
inline void transpose_queries(RowFn row, int64_t M, int64_t Mp, int64_t D, float scale,
                              float* Qt) {
#if JAX_ATTN_AVX512
  const int64_t cols = kDot ? D / 2 : D;  // 32-bit columns: floats, or bf16 pairs
  const __m512 qk_scale = _mm512_set1_ps(scale);
  for (int64_t r0 = 0; r0 < Mp; r0 += 16) {
    const QT* rows[16];
    for (int i = 0; i < 16; ++i) rows[i] = r0 + i < M ? row(r0 + i) : nullptr;
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
      const __mmask16 m = tail_mask(cols - c0);
      __m512 x[16];
      for (int i = 0; i < 16; ++i) {
        if (rows[i] == nullptr) {
          x[i] = _mm512_setzero_ps();
        } else if constexpr (kDot) {
          x[i] = _mm512_castsi512_ps(
              _mm512_maskz_loadu_epi32(m, reinterpret_cast<const uint32_t*>(rows[i]) + c0));
        } else {
          x[i] = _mm512_mul_ps(load16<QT>(rows[i] + c0, m), qk_scale);
        }
      }
      transpose16x16(x);
      for (int64_t j = 0; j < std::min<int64_t>(16, cols - c0); ++j) {
        _mm512_storeu_ps(Qt + (c0 + j) * Mp + r0, x[j]);
      }
    }
  }
#else
#if JAX_ATTN_AVX2
  // 8 rows x 8 columns at a time (Mp is a multiple of 8); a last partial column block goes
  // through a zero-padded copy of each row's tail. Products as the loop below: q[d] * scale.
  // (The bf16 dot form is AVX-512 code: never run here.)
  if constexpr (!kDot) {
    const __m256 qk_scale = _mm256_set1_ps(scale);
    for (int64_t r0 = 0; r0 < Mp; r0 += 8) {
      const QT* rows[8];
      for (int i = 0; i < 8; ++i) rows[i] = r0 + i < M ? row(r0 + i) : nullptr;
      for (int64_t c0 = 0; c0 < D; c0 += 8) {
        const int64_t n = std::min<int64_t>(8, D - c0);
        __m256 x[8];
        for (int i = 0; i < 8; ++i) {
          if (rows[i] == nullptr) {
            x[i] = _mm256_setzero_ps();
          } else if (n == 8) {
            x[i] = _mm256_mul_ps(Load8<QT>::whole(rows[i] + c0), qk_scale);
          } else {
            alignas(32) float tail[8] = {};
            widen_span(rows[i] + c0, n, tail);
            x[i] = _mm256_mul_ps(_mm256_load_ps(tail), qk_scale);
          }
        }
        transpose8x8(x);
        for (int64_t j = 0; j < n; ++j) _mm256_storeu_ps(Qt + (c0 + j) * Mp + r0, x[j]);
      }
    }
    return;
  }
#endif
  for (int64_t r = 0; r < Mp; ++r) {
    const QT* q = r < M ? row(r) : nullptr;
    for (int64_t d = 0; d < D; ++d) Qt[d * Mp + r] = q ? widen(q[d]) * scale : 0.0f;
  }
#endif
}

// One work item: a tile of tokens x the G query heads of each of the kv heads
// [kvh, kvh + num_kv), keys [k_begin, k_end) in steps of kKeys.
// kDot: bf16 x bf16 logits through vdpbf16ps (see qk_block_bf16); needs an even head size.
// next: the item this thread runs next (its queries are requested meanwhile), or nullptr;
// next_task: it starts another task (its first step's keys are requested too).
// keys_in_l2: no next-step K/V prefetch: an earlier item of the task read all of this item's
// keys, or on Intel the task's keys outgrow the L2 (run_task). warm: decode lines the p.v
// blocks request meanwhile (run_beside's staged schedule), or nullptr.
template <typename QT, typename CT, bool kDot>
void run_item(const Problem& p, const Item& it, const Item* next, bool next_task,
              bool keys_in_l2, WarmCursor* warm, PackedValues* packed, PackedRows* shared) {
  const int64_t G = p.G, D = p.D, Dp = p.Dp, Hq = p.Hq, nh = it.num_kv;
  const int64_t M = it.nt * G;        // real rows per kv head
  const int64_t Mp = round_up(M, W);  // rows padded to whole vectors
  const int64_t per_head = head_state_floats(D, Dp, M, Mp);
  float* base = tls_scratch.get(static_cast<size_t>(nh * per_head + kKeys * Mp + Dp + 64));
  float* St = base;              // [kKeys][Mp]: logits, then probabilities (one head at a time)
  float* zero_row = St + kKeys * Mp;  // [Dp] zeros: the q.k blocks' stand-in for missing keys
  std::memset(zero_row, 0, sizeof(float) * Dp);
  HeadState heads[kMaxHeadsPerItem];
  for (int64_t h = 0; h < nh; ++h) {
    float* hb = zero_row + Dp + h * per_head;
    heads[h] = HeadState{hb,
                         hb + D * Mp,
                         hb + D * Mp + M * Dp,
                         hb + D * Mp + M * Dp + kKeys * Dp,
                         hb + D * Mp + M * Dp + 2 * kKeys * Dp,
                         nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
    heads[h].row_sum = heads[h].row_max + Mp;
    heads[h].alpha = heads[h].row_sum + Mp;
    heads[h].q_pos = heads[h].alpha + Mp;
    heads[h].slope = heads[h].q_pos + Mp;
    heads[h].step_max = heads[h].slope + Mp;
    heads[h].kr = reinterpret_cast<const float**>(heads[h].step_max + Mp);
    heads[h].vr = heads[h].kr + kKeys;
  }

  const QT* query = static_cast<const QT*>(p.query);
  // Per kv head h: query rows [t0, t0 + nt) x heads [h*G, h*G + G): row r -> token r / G,
  // head r % G; read row-major (d fastest), written transposed into Qt[d][r] (bf16 dot:
  // Qt2[d/2][r], unscaled bf16 pairs), 16 rows x 16 columns at a time through registers.
  for (int64_t h = 0; h < nh; ++h) {
    HeadState& hs = heads[h];
    const int64_t kvh = it.kvh + h;
    const auto row = [&](int64_t r) {
      return query + (it.t0 + r / G) * p.q_stride + (kvh * G + r % G) * D;
    };
    for (int64_t r = 0; r < Mp; ++r) {
      hs.q_pos[r] = r < M ? static_cast<float>(it.pos0 + r / G) : 0.0f;
      hs.slope[r] = r < M && p.slopes ? p.slopes[kvh * G + r % G] * kLog2e : 0.0f;
      hs.row_max[r] = kMasked;
      hs.row_sum[r] = 0.0f;
    }
    transpose_queries<QT, kDot>(row, M, Mp, D, p.qk_scale, hs.Qt);
    // The first key step writes every row of O without reading it; an item with no key step
    // still needs zeros there for the output loop.
    if (it.k_end <= it.k_begin) std::memset(hs.O, 0, sizeof(float) * M * Dp);
  }
  // Float32 outputs (bf16 on the dot path) whose rows are whole vectors are written by the last
  // step's p.v blocks.
  QT* out = static_cast<QT*>(p.out);
  const bool fused_out = (kDot || std::is_same_v<QT, float>) && D == Dp && M <= kMaxFusedRows;
  QT* out_rows[kMaxFusedRows];
  float inv[kMaxFusedRows];

  const CT* kc = static_cast<const CT*>(p.key_cache);
  const CT* vc = static_cast<const CT*>(p.value_cache);
  const int32_t* table = p.block_tables + it.seq * p.MB;
  const int64_t run_bytes = nh * D * static_cast<int64_t>(sizeof(CT));
  // A float32 cache whose rows are whole vectors is read in place (no widened copy).
  const bool direct = std::is_same_v<CT, float> && D == Dp;
  alignas(64) uint32_t saved_pair[kMaxHeadSize];  // a shared pair put back (Dp <= kMaxHeadSize)
  // The next item's query rows (nt tokens x its kv heads' G rows, each a run of
  // num_kv * G * D elements), and the next task's first keys, requested between this item's
  // q.k register blocks.
  NextLines next_query;
  if (next != nullptr) {
    next_query.base =
        reinterpret_cast<const char*>(query + next->t0 * p.q_stride + next->kvh * G * D);
    next_query.stride = p.q_stride * static_cast<int64_t>(sizeof(QT));
    next_query.run_bytes = next->num_kv * G * D * static_cast<int64_t>(sizeof(QT));
    next_query.rows = next->nt;
    if (next_task) {
      next_query.key_cache = reinterpret_cast<const char*>(kc + next->kvh * D);
      next_query.value_cache = reinterpret_cast<const char*>(vc + next->kvh * D);
      next_query.table = p.block_tables + next->seq * p.MB;
      next_query.block_size = p.BS;
      next_query.slot_bytes = p.Hkv * D * static_cast<int64_t>(sizeof(CT));
      next_query.kv_run_bytes = next->num_kv * D * static_cast<int64_t>(sizeof(CT));
      next_query.k_begin = next->k_begin;
      next_query.keys = std::clamp<int64_t>(next->k_end - next->k_begin, 0, kKeys);
    }
  }
  // Logits changed after q.k (soft cap, ALiBi): the softmax applies them, and finds the max.
  const bool transform = p.cap > 0.0f || p.slopes != nullptr;
  const float alibi_from = alibi_origin(p, it);
  for (int64_t k0 = it.k_begin; k0 < it.k_end; k0 += kKeys) {
    const int64_t nv = std::min<int64_t>(kKeys, it.k_end - k0);
    // Keys k0 .. k0+nv through the block table: key n's slot holds [Hkv, D]; the item's kv
    // heads [kvh, kvh + nh) are one contiguous run of nh * D elements, read in order.
    for (int64_t n = 0; n < nv; ++n) {
      const int64_t pos = k0 + n;
      const int64_t slot = static_cast<int64_t>(table[pos / p.BS]) * p.BS + pos % p.BS;
      const int64_t off = (slot * p.Hkv + it.kvh) * D;
      if (shared != nullptr) {  // one kv head (run_task): the task's copy, made on first use
        float* k = shared->key + pos * shared->ld;
        float* v = shared->value + pos * shared->ld;
        if (pos >= shared->rows) {
          widen_row<CT>(kc + off, k, D, Dp);
          widen_row<CT>(vc + off, v, D, Dp);
        }
        heads[0].kr[n] = k;
        heads[0].vr[n] = v;
        continue;
      }
      for (int64_t h = 0; h < nh; ++h) {
        HeadState& hs = heads[h];
        if constexpr (kDot) {
          reinterpret_cast<const uint32_t**>(hs.Kw)[n] =
              reinterpret_cast<const uint32_t*>(kc + off + h * D);
        } else if (direct) {
          hs.kr[n] = reinterpret_cast<const float*>(kc + off + h * D);
        } else {
          widen_row<CT>(kc + off + h * D, hs.Kw + n * Dp, D, Dp);
          hs.kr[n] = hs.Kw + n * Dp;
        }
        if (kDot || direct) {
          // The cache's own row (bf16 dot: packed into key pairs below, once both are known).
          hs.vr[n] = reinterpret_cast<const float*>(vc + off + h * D);
        } else {
          widen_row<CT>(vc + off + h * D, hs.Vw + n * Dp, D, Dp);
          hs.vr[n] = hs.Vw + n * Dp;
        }
      }
    }
    if (shared != nullptr) shared->rows = std::max(shared->rows, k0 + nv);
    // Ask for the next step's key and value runs now; they arrive while this step computes
    // (runs of different keys are Hkv * D apart: the hardware prefetcher does not follow).
    // Only rows the next step reads from the cache: keys the task's float32 copy holds are
    // read from the copy, and values whose bf16 pairs are packed from the pairs (an earlier
    // item made them). Requesting those rows too cost a later item of a chunk over a long
    // prefix its whole span from memory again, unread: float32 chunked-prefill (2304 keys a
    // task) paired 1.03-1.04x faster without them at blocks 128 and 16 (Zen 4, NOTES.md).
    const int64_t next_end = keys_in_l2 ? 0 : std::min<int64_t>(k0 + nv + kKeys, it.k_end);
    const int64_t next_begin = shared != nullptr ? std::max(k0 + nv, shared->rows) : k0 + nv;
    const int64_t packed_keys = packed != nullptr ? 2 * packed->pairs : 0;
    for (int64_t pos = next_begin; pos < next_end; ++pos) {
      const int64_t slot = static_cast<int64_t>(table[pos / p.BS]) * p.BS + pos % p.BS;
      const char* kr = reinterpret_cast<const char*>(kc + (slot * p.Hkv + it.kvh) * D);
      const char* vr = reinterpret_cast<const char*>(vc + (slot * p.Hkv + it.kvh) * D);
      const bool values = pos >= packed_keys;
      for (int64_t b = 0; b < run_bytes; b += 64) {
        __builtin_prefetch(kr + b);
        if (values) __builtin_prefetch(vr + b);
      }
    }
    // The bf16 dot path's value pairs of this step: packed into each head's Vw, or (a task's
    // shared pairs, nh == 1) taken from `packed`, packing the ones it lacks. A last pair
    // without its second key is packed over the shared one for this step and put back after.
    const uint32_t* step_pairs[kMaxHeadsPerItem] = {};
    uint32_t* partial = nullptr;
#if JAX_ATTN_BF16_DOT
    if constexpr (kDot) {
      if (packed != nullptr) {
        const bf16_t* const* rows = reinterpret_cast<const bf16_t* const*>(heads[0].vr);
        const int64_t j0 = k0 / 2, full = nv / 2;
        uint32_t* pairs = packed->data + j0 * Dp;
        for (int64_t i = std::max<int64_t>(0, packed->pairs - j0); i < full; ++i) {
          pack_value_pair(rows[2 * i], rows[2 * i + 1], D, Dp, pairs + i * Dp);
        }
        packed->pairs = std::max(packed->pairs, j0 + full);
        if (nv % 2 != 0) {
          if (j0 + full < packed->pairs) {
            partial = pairs + full * Dp;
            std::memcpy(saved_pair, partial, sizeof(uint32_t) * Dp);
          }
          pack_value_pair(rows[nv - 1], nullptr, D, Dp, pairs + full * Dp);
        }
        step_pairs[0] = pairs;
      } else {
        for (int64_t h = 0; h < nh; ++h) {
          const bf16_t* const* rows = reinterpret_cast<const bf16_t* const*>(heads[h].vr);
          uint32_t* Vp = reinterpret_cast<uint32_t*>(heads[h].Vw);
          for (int64_t i = 0; 2 * i < nv; ++i) {
            pack_value_pair(rows[2 * i], 2 * i + 1 < nv ? rows[2 * i + 1] : nullptr, D, Dp,
                            Vp + i * Dp);
          }
          step_pairs[h] = Vp;
        }
      }
    }
#else
    static_cast<void>(packed);  // only the vdpbf16ps path shares value pairs
#endif
    const bool mask = step_masks(p, it, k0, nv);
    for (int64_t h = 0; h < nh; ++h) {
      HeadState& hs = heads[h];
      const int64_t visible = step_visible(p, it, k0);
      float* step_max = mask || transform ? nullptr : hs.step_max;
      head_logits<kDot>(p, hs, St, Mp, nv, visible, zero_row, next_query, step_max);
      softmax_step<kDot>(p, St, Mp, M, nv, k0, transform, mask, hs.q_pos, hs.slope, alibi_from,
                         step_max, hs.row_max, hs.row_sum, hs.alpha);
      const bool last = k0 + kKeys >= it.k_end;
      if (fused_out && last) {
        for (int64_t r = 0; r < M; ++r) {
          const int64_t head = (it.kvh + h) * G + r % G;
          inv[r] = output_factor(p, hs.row_sum[r], hs.row_max[r], head,
                                 alibi_shift(alibi_from, hs.slope[r], hs.q_pos[r]));
          out_rows[r] = out + ((it.t0 + r / G) * Hq + head) * D;
        }
      }
      PvArgs pv{hs.O,
                Dp,
                St,
                Mp,
                hs.vr,
                step_pairs[h],
                Dp,
                nv,
                visible,
                G,
                hs.alpha,
                k0 == it.k_begin,
                fused_out && last ? reinterpret_cast<void* const*>(out_rows) : nullptr,
                inv,
                p.stream_out,
                warm};
      if constexpr (kDot) pv.count = (nv + 1) / 2;  // the softmax left probability pairs
      head_values<kDot>(pv, Dp, M);
    }
    if (partial != nullptr) std::memcpy(partial, saved_pair, sizeof(uint32_t) * Dp);
  }

  next_query.issue_all();  // what q.k left
  // Output rows: O * output_factor; rows that saw no key (sum 0) are zeros.
  if (fused_out && it.k_end > it.k_begin) {
    if (p.stream_out) Vec::stream_fence();  // the streamed rows land before the task reports
    return;
  }
  for (int64_t h = 0; h < nh; ++h) {
    const HeadState& hs = heads[h];
    for (int64_t r = 0; r < M; ++r) {
      const int64_t head = (it.kvh + h) * G + r % G;
      const float inv = output_factor(p, hs.row_sum[r], hs.row_max[r], head,
                                      alibi_shift(alibi_from, hs.slope[r], hs.q_pos[r]));
      QT* o = out + ((it.t0 + r / G) * Hq + head) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = narrow<QT>(hs.O[r * Dp + d] * inv);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Metadata checks: every index the kernel reads is validated before any read of the caches and
// before any write of the output. Under jit no eager check runs, so these are the only guard:
// garbage metadata must come back as an error naming the argument (InvalidArgument from XLA,
// ValueError from torch), never as a write past the output or a read outside the cache.
// ---------------------------------------------------------------------------------------------
std::string str(int64_t x) { return std::to_string(x); }

// num_seqs in [0, S]; query_start_loc[0] in [0, T] and non-decreasing up to
// query_start_loc[num_seqs] <= T (so every row the kernel zeroes or computes is inside the
// T query tokens); per real sequence q_len <= seq_len <= max_blocks * block_size and every
// block id of its first ceil(seq_len / block_size) table entries in [0, num_blocks).
std::string check_metadata(const int32_t* qsl, const int32_t* seq_lens, const int32_t* tables,
                           int64_t num_seqs, int64_t S, int64_t T, int64_t NB, int64_t BS,
                           int64_t MB) {
  if (num_seqs < 0 || num_seqs > S) {
    return "num_seqs=" + str(num_seqs) + " must be in [0, " + str(S) +
           "] (the rows of seq_lens and block_tables)";
  }
  if (qsl[0] < 0 || qsl[0] > T) {
    return "query_start_loc[0]=" + str(qsl[0]) + " must be in [0, num_tokens=" + str(T) + "]";
  }
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t start = qsl[i], end = qsl[i + 1], seq_len = seq_lens[i];
    if (end < start) {
      return "query_start_loc must be non-decreasing: query_start_loc[" + str(i) + "]=" +
             str(start) + " > query_start_loc[" + str(i + 1) + "]=" + str(end);
    }
    if (end > T) {
      return "query_start_loc[" + str(i + 1) + "]=" + str(end) + " is beyond the " + str(T) +
             " query tokens (num_tokens)";
    }
    if (seq_len < end - start || seq_len > MB * BS) {
      return "seq_lens[" + str(i) + "]=" + str(seq_len) + " must be in [q_len=" +
             str(end - start) + ", max_blocks * block_size=" + str(MB * BS) + "]";
    }
    for (int64_t b = 0; b < (seq_len + BS - 1) / BS; ++b) {
      const int64_t id = tables[i * MB + b];
      if (id < 0 || id >= NB) {
        return "block_tables[" + str(i) + ", " + str(b) + "]=" + str(id) +
               " is not a block id in [0, num_blocks=" + str(NB) + ")";
      }
    }
  }
  return "";
}

bool supported_query(DType t) {
  return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16;
}

bool supported_cache(DType t) {
  return supported_query(t) || t == DType::kF8E4M3FN || t == DType::kF8E5M2;
}

// The sizes and dtypes the kernel takes, or the rule one breaks.
std::string check_args(const RaggedArgs& a) {
  if (a.num_heads < 1 || a.head_size < 1 || a.block_size < 1) {
    return "num_heads=" + str(a.num_heads) + ", head_size=" + str(a.head_size) +
           " and block_size=" + str(a.block_size) + " must all be >= 1";
  }
  if (a.num_kv_heads < 1 || a.num_heads % a.num_kv_heads != 0) {
    return "num_heads=" + str(a.num_heads) + " must be divisible by num_kv_heads=" +
           str(a.num_kv_heads) + " (>= 1)";
  }
  if (a.head_size > kMaxHeadSize) {
    return "head_size=" + str(a.head_size) + " must be at most " + str(kMaxHeadSize);
  }
  if (a.num_tokens < 0 || a.num_blocks < 0 || a.seq_rows < 0 || a.max_blocks < 0) {
    return "num_tokens=" + str(a.num_tokens) + ", num_blocks=" + str(a.num_blocks) +
           ", the rows of seq_lens=" + str(a.seq_rows) + " and max_blocks=" +
           str(a.max_blocks) + " must all be >= 0";
  }
  if (a.query_stride != 0 && a.query_stride < a.num_heads * a.head_size) {
    return "query's row stride=" + str(a.query_stride) +
           " must be 0 (dense) or at least num_heads * head_size=" +
           str(a.num_heads * a.head_size) + " elements";
  }
  if (!supported_query(a.query_type)) {
    return std::string("query dtype ") + dtype_name(a.query_type) +
           " is not supported (float32, bfloat16, float16)";
  }
  if (!supported_cache(a.cache_type)) {
    return std::string("key_cache dtype ") + dtype_name(a.cache_type) +
           " is not supported (float32, bfloat16, float16, float8_e4m3fn, float8_e5m2)";
  }
  return "";
}

// A step's tasks, handed out in order (longest first) from one counter. A worker takes its
// next task as it starts the current one's last item, which then requests the next task's
// first queries and keys while it computes (NextLines). Taking only reserves: a task runs
// where it is claimed (`claim`, once per task), so a task taken ahead by a worker that lost its
// core (another process on it) is claimed by whichever worker runs out of tasks first
// (`take_unstarted`) instead of waiting for that worker.
struct TaskQueue {
  std::atomic<int64_t> next{0};
  const Item* items = nullptr;
  const Task* tasks = nullptr;
  int64_t num_tasks = 0;
  std::unique_ptr<std::atomic<bool>[]> started;  // [num_tasks]
  int64_t take() { return next.fetch_add(1, std::memory_order_relaxed); }
  bool claim(int64_t t) { return !started[t].exchange(true, std::memory_order_relaxed); }
  // Once the counter is spent: a task taken ahead but not started, claimed; -1 when none.
  int64_t take_unstarted() {
    for (int64_t t = 0; t < num_tasks; ++t) {
      if (!started[t].load(std::memory_order_relaxed) && claim(t)) return t;
    }
    return -1;
  }
};
// One worker's place in a TaskQueue: `taken`, the task it took ahead (-1: none yet).
struct TaskChain {
  TaskQueue* queue;
  int64_t taken = -1;
  const Item* take_next() {  // the first item of the task taken, or nullptr when none is left
    taken = queue->take();
    return taken < queue->num_tasks ? queue->items + queue->tasks[taken].first : nullptr;
  }
};

// The keys a task's items read: [begin, end), the union of their key ranges; `prefixes`:
// whether they (more than one) all read key prefixes [0, k_end) of one kv head, so that what
// the first packs or copies serves them all.
struct KeySpan {
  bool prefixes;
  int64_t begin, end;
};
inline KeySpan key_span(const Item* items, int64_t num_items) {
  KeySpan span{num_items > 1, num_items > 0 ? items[0].k_begin : 0, 0};
  for (int64_t i = 0; i < num_items; ++i) {
    span.prefixes = span.prefixes && items[i].k_begin == 0 && items[i].num_kv == 1;
    span.begin = std::min(span.begin, items[i].k_begin);
    span.end = std::max(span.end, items[i].k_end);
  }
  return span;
}

// The items of one task, in order. An item whose keys lie inside [lo, hi), the span of keys
// the task's earlier items read, skips the next-step K/V prefetch when that span's keys and
// values fit in kKeysInL2Bytes: they are still in this core's L2. Causal tiles without a window
// qualify (a task's tiles run last first, so each later tile's keys are a prefix of the first
// one's); with a window each tile starts lower and keeps its prefetch. The same tasks share
// their bf16 value pairs (PackedValues) up to kSharedPairsBytes.
// On Intel, no item of a task whose keys and values outgrow kKeysInL2Bytes makes that burst:
// there it cost more than it saved (Sapphire Rapids, float32, medians of 3 alternated: chunked
// 8 x 256 over 2048 318.8 -> 286.9 ms, prefill 8 x 1024 298.4 -> 278.5; at 8 x 512, 512 KiB,
// the burst is kept: 73.2 ms with it against 76.7 without, 7 rounds; NOTES.md). Those figures
// predate the burst leaving out the rows read from the task's copy (run_item): not measured
// since.
template <typename QT, typename CT, bool kDot>
void run_task(const Problem& p, const Item* items, int64_t num_items, WarmCursor* warm,
              TaskChain* chain) {
  const int64_t kv_bytes_per_key = 2 * p.D * static_cast<int64_t>(sizeof(CT));
  const KeySpan span = key_span(items, num_items);
  PackedValues packed;
  PackedRows shared;
  if constexpr (kDot) {
    const int64_t words = (span.end / 2 + 1) * p.Dp;
    if (span.prefixes && words * static_cast<int64_t>(sizeof(uint32_t)) <= kSharedPairsBytes) {
      packed.data = reinterpret_cast<uint32_t*>(tls_packed.get(static_cast<size_t>(words)));
    }
  } else {
    shared.ld = p.Dp + kRowPad;
    const int64_t floats = span.end * shared.ld;
    if (span.prefixes && 2 * floats * static_cast<int64_t>(sizeof(float)) <= kSharedRowsBytes) {
      shared.key = tls_packed.get(static_cast<size_t>(2 * floats));
      shared.value = shared.key + floats;
    }
  }
  const bool burst =
      !prefetch_to_l2() || (span.end - span.begin) * kv_bytes_per_key <= kKeysInL2Bytes;
  int64_t lo = 0, hi = 0;
  for (int64_t i = 0; i < num_items; ++i) {
    const Item& it = items[i];
    const bool in_l2 = i > 0 && it.num_kv == 1 && lo <= it.k_begin && it.k_end <= hi &&
                       (hi - lo) * kv_bytes_per_key <= kKeysInL2Bytes;
    const bool last = i + 1 == num_items;
    const Item* next = !last ? &items[i + 1] : chain != nullptr ? chain->take_next() : nullptr;
    run_item<QT, CT, kDot>(p, it, next, last, in_l2 || !burst, warm,
                           packed.data != nullptr ? &packed : nullptr,
                           shared.key != nullptr ? &shared : nullptr);
    lo = i == 0 ? it.k_begin : std::min(lo, it.k_begin);
    hi = i == 0 ? it.k_end : std::max(hi, it.k_end);
  }
}

// The AMX path (run_task_amx, under JAX_ATTN_AMX && JAX_ATTN_BF16_DOT), a part of this kernel
// of its own, included here inside this file's namespaces: it uses Problem, Item, the softmax
// and the task helpers above.
#include "ragged_amx.h"

// A mixed step's decode run beside its prefill tasks: memory-bound decodes and compute-bound
// tiles in one step. By default half the workers start on the decodes (one item per sequence)
// while the others start on the tasks, each taking from the other queue once its own is
// empty: the decodes stream from memory while the tiles' FMAs run. Measured on the 2-core Zen 4
// VM (the torch op, calls alternated in one process, 5 runs of 10-15 s; NOTES.md), against the
// staged schedule below: 4 x 256 prefill + 28 decodes at 1024 keys, float32 1.06x faster
// (median of the runs' ratios; 1.005-1.105), bfloat16 1.05x; 4 x 1024 + 27 at 1088 (the
// engine's mixed step) 1.05x and 1.03x.
// $JAX_ATTN_CPU_MIXED_SCHEDULE=staged (read per call) takes the staged schedule instead: the
// decode run's sequences form groups of about kStageBytes of K and V, and the prefill tasks are
// dealt round-robin to the groups. The workers walk one list, [group 0's prefill tasks, group
// 0's decodes, group 1's prefill tasks, ...]. While a group's prefill tasks compute, their p.v
// blocks request the group's decode blocks into L2 (WarmCursor), so the decodes that follow
// read them from L2 or L3 rather than from DRAM. Measured on the 2-core Zen 5 VM (4 x 256
// prefill + 28 decodes at 1024 keys, float32): 13.2-13.3 ms vs 14.0-15.6 with the decodes
// after all the prefill tiles; level with that on the Zen 4 VM (NOTES.md).
struct StageGroup {
  WarmList warm;
  std::vector<int64_t> tasks;
  int64_t item_begin = 0, item_end = 0;  // the group's decode items
};
struct Staging {
  DecodeArgs args;                // the decode run, one item per non-empty sequence
  int64_t num_items = 0;          // decode items (the run's non-empty sequences)
  bool staged = false;            // the staged schedule; else beside, and `groups` stays empty
  std::deque<StageGroup> groups;  // a WarmList holds an atomic: not movable
};

// Whether a mixed step takes the staged schedule: $JAX_ATTN_CPU_MIXED_SCHEDULE=staged, read per
// call so that one process can compare both.
inline bool staged_schedule() {
  const char* schedule = std::getenv("JAX_ATTN_CPU_MIXED_SCHEDULE");
  return schedule != nullptr && std::strcmp(schedule, "staged") == 0;
}

// Runs the prefill tasks (run_task(t, warm)) and the decode run together. paged_decode builds
// its items and hands them to `Workers`; ours runs them beside the tasks instead (or walks the
// staged list), on the caller's workers. Should paged_decode ask for another item count than
// planned, or run its items inline (one worker, one item), the tasks simply run after the
// decodes.
template <typename RunTask>
std::string run_beside(const Workers& base, Staging& st, int64_t num_tasks, RunTask& run_task) {
  struct Entry {
    int64_t group, task, item;  // task >= 0: that prefill task; else decode item `item`
  };
  std::vector<Entry> entries;
  for (int64_t g = 0; g < static_cast<int64_t>(st.groups.size()); ++g) {
    for (int64_t t : st.groups[g].tasks) entries.push_back(Entry{g, t, -1});
    for (int64_t i = st.groups[g].item_begin; i < st.groups[g].item_end; ++i) {
      entries.push_back(Entry{g, -1, i});
    }
  }
  struct Ctx {
    const Workers* base;
    Staging* st;
    const std::vector<Entry>* entries;
    std::function<void(int64_t, WarmCursor*)> run_task;
    int64_t num_tasks;
    bool tasks_ran = false;
  } ctx{&base, &st, &entries, [&](int64_t t, WarmCursor* w) { run_task(t, w); }, num_tasks};
  Workers workers;
  workers.count = base.count;
  workers.self = &ctx;
  workers.parallel_for = [](void* self, int64_t n, int64_t count, void (*item)(void*, int64_t),
                            void* item_ctx) {
    Ctx& c = *static_cast<Ctx*>(self);
    if (n != c.st->num_items) {  // not the planned items: the decodes as asked
      run_items(*c.base, n, count, [&](int64_t i) { item(item_ctx, i); });
      return;
    }
    c.tasks_ran = true;
    if (!c.st->staged) {  // half the workers start on the decodes, the others on the tasks
      std::atomic<int64_t> next_item{0}, next_task{0};
      const int64_t loops = std::min<int64_t>(count, n + c.num_tasks);
      run_items(*c.base, loops, loops, [&](int64_t w) {
        const bool decodes_first = w < (loops + 1) / 2;
        for (int pass = 0; pass < 2; ++pass) {
          if (decodes_first == (pass == 0)) {
            for (int64_t i; (i = next_item.fetch_add(1)) < n;) item(item_ctx, i);
          } else {
            for (int64_t t; (t = next_task.fetch_add(1)) < c.num_tasks;) c.run_task(t, nullptr);
          }
        }
      });
      return;
    }
    run_items(*c.base, static_cast<int64_t>(c.entries->size()), count, [&](int64_t e) {
      const Entry& en = (*c.entries)[e];
      if (en.task >= 0) {
        WarmCursor warm{nullptr, nullptr, &c.st->groups[en.group].warm};
        c.run_task(en.task, &warm);
      } else {
        item(item_ctx, en.item);
      }
    });
  };
  const std::string error = paged_decode(st.args, workers);
  if (!error.empty()) return error;
  if (!ctx.tasks_ran) {
    run_items(base, num_tasks, [&](int64_t t) { run_task(t, nullptr); });
  }
  return "";
}

template <typename QT, typename CT>
std::string run_all(const Workers& workers, const Problem& p, const std::vector<Item>& items,
                    const std::vector<Task>& tasks, Staging* staging) {
  constexpr bool kBf16 = std::is_same_v<QT, bf16_t> && std::is_same_v<CT, bf16_t>;
  auto task_fn = [&](int64_t t, WarmCursor* warm, TaskChain* chain = nullptr) {
    const Item* first = items.data() + tasks[t].first;
#if JAX_ATTN_AMX && JAX_ATTN_BF16_DOT
    if constexpr (std::is_same_v<QT, bf16_t> && !std::is_same_v<CT, float> &&
                  !std::is_same_v<CT, f16_t>) {
      if (p.amx) return run_task_amx<CT>(p, first, tasks[t].num_items);
    }
#endif
    if (kBf16 && p.dot) {
      run_task<QT, CT, kBf16>(p, first, tasks[t].num_items, warm, chain);
    } else {
      run_task<QT, CT, false>(p, first, tasks[t].num_items, warm, chain);
    }
  };
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  if (staging != nullptr) return run_beside(workers, *staging, num_tasks, task_fn);
  TaskQueue queue;
  queue.items = items.data();
  queue.tasks = tasks.data();
  queue.num_tasks = num_tasks;
  queue.started.reset(new std::atomic<bool>[num_tasks]);
  for (int64_t t = 0; t < num_tasks; ++t) queue.started[t].store(false, std::memory_order_relaxed);
  // One loop per worker (at most one per task), each taking tasks until none is left.
  const int64_t loops = std::min(workers.count, num_tasks);
  run_items(workers, loops, [&](int64_t) {
    TaskChain chain{&queue};
    for (int64_t t = queue.take();;) {
      if (t >= num_tasks) {
        t = queue.take_unstarted();
        if (t < 0) break;
      } else if (!queue.claim(t)) {  // taken ahead, then claimed by another worker
        t = queue.take();
        continue;
      }
      chain.taken = -1;
      task_fn(t, nullptr, &chain);
      t = chain.taken >= 0 ? chain.taken : queue.take();
    }
  });
  return "";
}


template <typename QT>
std::string dispatch_cache(DType cache_type, const Workers& workers, const Problem& p,
                           const std::vector<Item>& items, const std::vector<Task>& tasks,
                           Staging* staging) {
  switch (cache_type) {
    case DType::kF32: return run_all<QT, float>(workers, p, items, tasks, staging);
    case DType::kBF16: return run_all<QT, bf16_t>(workers, p, items, tasks, staging);
    case DType::kF16: return run_all<QT, f16_t>(workers, p, items, tasks, staging);
    case DType::kF8E4M3FN: return run_all<QT, e4m3_t>(workers, p, items, tasks, staging);
    case DType::kF8E5M2: return run_all<QT, e5m2_t>(workers, p, items, tasks, staging);
    default: return "unreachable: key_cache dtype checked";
  }
}

}  // namespace

std::string ragged_paged_attention(const RaggedArgs& a, const Workers& workers) {
  if (std::string error = check_args(a); !error.empty()) return error;
  const int64_t T = a.num_tokens, Hq = a.num_heads, D = a.head_size;
  const int64_t NB = a.num_blocks, BS = a.block_size, Hkv = a.num_kv_heads;
  const int64_t S = a.seq_rows, MB = a.max_blocks;

  // Values: every index read below, before any read of the caches or write of the output.
  const int64_t num_seqs = a.num_seqs;
  const int32_t* qsl = a.query_start_loc;
  const int32_t* lens = a.seq_lens;
  const int32_t* tables = a.block_tables;
  if (std::string error = check_metadata(qsl, lens, tables, num_seqs, S, T, NB, BS, MB);
      !error.empty()) {
    return error;
  }

  // Rows outside the real sequences (padding tokens) are zeros.
  const size_t row_bytes = static_cast<size_t>(Hq * D) * element_bytes(a.query_type);
  const size_t out_size = row_bytes * static_cast<size_t>(T);
  prefault_output(workers, a.out, out_size);
  char* out_bytes = static_cast<char*>(a.out);
  const int64_t first = qsl[0], last = qsl[num_seqs];  // 0 <= first <= last <= T: checked
  if (first > 0) std::memset(out_bytes, 0, row_bytes * first);
  if (last < T) std::memset(out_bytes + row_bytes * last, 0, row_bytes * (T - last));

  Problem p;
  p.query = a.query;
  p.q_stride = a.query_stride != 0 ? a.query_stride : Hq * D;
  p.key_cache = a.key_cache;
  p.value_cache = a.value_cache;
  p.out = a.out;
  p.block_tables = tables;
  p.slopes = a.alibi_slopes;
  p.sinks = a.sinks;
  p.Hq = Hq;
  p.Hkv = Hkv;
  p.G = Hq / Hkv;
  p.D = D;
  p.Dp = round_up(D, W);
  p.BS = BS;
  p.MB = MB;
  p.qk_scale = a.scale * a.k_scale * kLog2e;
  p.v_scale = a.v_scale;
  p.cap = a.logits_soft_cap > 0.0f ? a.logits_soft_cap * kLog2e : 0.0f;
  p.window = a.sliding_window;
  p.causal = a.causal;
  const DType qt = a.query_type, ct = a.cache_type;
  p.dot = JAX_ATTN_BF16_DOT && qt == DType::kBF16 && ct == DType::kBF16 && D % 2 == 0;
  // (Head sizes past kMaxDecodeHeadSize stay on the vector path: never measured on tiles.)
  p.amx = JAX_ATTN_AMX && JAX_ATTN_BF16_DOT && qt == DType::kBF16 &&
          (ct == DType::kBF16 || ct == DType::kF8E4M3FN || ct == DType::kF8E5M2) &&
          D % 2 == 0 && D <= kMaxDecodeHeadSize && amx_available();
  p.stream_out = JAX_ATTN_AVX512 && out_size >= static_cast<size_t>(kStreamOutputBytes) &&
                 reinterpret_cast<uintptr_t>(p.out) % 64 == 0;

  // Tiles: up to tile_tokens tokens of one sequence x the G heads of one kv head. A task is a
  // run of up to kTilesPerTask tiles of the same (sequence, kv head), last tile first: they
  // read the same keys, which the first one leaves in this core's L2 for the others.
  // A sequence whose only tile has at most kSmallRows rows (a decode) instead gets items of
  // heads_per_small kv heads each: as many heads as keep every worker busy.
  const int64_t tile_tokens = std::max<int64_t>(1, kTargetRows / p.G);
  const int64_t num_workers = workers.count;
  // Maximal runs [s0, s1) of decode sequences long enough for the decode kernel.
  std::vector<std::pair<int64_t, int64_t>> decode_runs;
  std::vector<char> in_run(static_cast<size_t>(num_seqs), 0);
  for (int64_t s = 0; s < num_seqs;) {
    int64_t e = s, keys = 0;
    while (e < num_seqs && qsl[e + 1] - qsl[e] == 1) {
      const KeyRange r = visible_keys(lens[e] - 1, lens[e], p.window);
      keys += std::max<int64_t>(0, r.end - r.begin);
      ++e;
    }
    if (D <= kMaxDecodeHeadSize && (e - s >= kMinDecodeRun || keys >= kMinDecodeRunKeys)) {
      decode_runs.emplace_back(s, e);
      std::fill(in_run.begin() + s, in_run.begin() + e, 1);
    }
    s = std::max(e, s + 1);
  }
  int64_t num_small = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = qsl[s + 1] - qsl[s];
    num_small += (!in_run[s] && q_len > 0 && q_len * p.G <= kSmallRows) ? 1 : 0;
  }
  const int64_t heads_per_small = std::clamp<int64_t>(
      num_small * Hkv / std::max<int64_t>(1, 4 * num_workers), 1,
      std::min<int64_t>(Hkv, kMaxHeadsPerItem));
  std::vector<Item> items;
  std::vector<Task> tasks;
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (in_run[s]) continue;
    const int64_t q_len = qsl[s + 1] - qsl[s], seq_len = lens[s];
    const int64_t num_tiles = (q_len + tile_tokens - 1) / tile_tokens;
    const bool small = q_len * p.G <= kSmallRows;
    const int64_t heads_per_item = small ? heads_per_small : 1;
    for (int64_t h = 0; h < Hkv; h += heads_per_item) {
      const int64_t num_kv = std::min(heads_per_item, Hkv - h);
      for (int64_t j = num_tiles - 1; j >= 0; --j) {
        const int64_t j0 = j * tile_tokens, nt = std::min(tile_tokens, q_len - j0);
        const int64_t pos0 = seq_len - q_len + j0, pos_last = pos0 + nt - 1;
        const int64_t k_end = p.causal ? pos_last + 1 : seq_len;
        const int64_t k_begin = p.window > 0 ? std::max<int64_t>(0, pos0 - p.window + 1) : 0;
        const int64_t cost = (std::max<int64_t>(0, k_end - k_begin) + kKeys) * nt * num_kv;
        if ((num_tiles - 1 - j) % kTilesPerTask == 0) {
          tasks.push_back(Task{static_cast<int64_t>(items.size()), 0, 0});
        }
        items.push_back(
            Item{s, qsl[s] + j0, nt, h, num_kv, pos0, k_begin, std::max(k_begin, k_end)});
        tasks.back().num_items += 1;
        tasks.back().cost += cost;
      }
    }
  }
  // Longest first, so the last tasks handed out are short ones (balance across threads).
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.cost > b.cost; });

  // The decode run's arguments (query and output rows qsl[s0] .. qsl[s0] + (s1 - s0)).
  const auto decode_args = [&](int64_t s0, int64_t s1) {
    DecodeArgs d;
    d.num_seqs = s1 - s0;
    d.num_heads = Hq;
    d.head_size = D;
    d.num_kv_heads = Hkv;
    d.num_blocks = NB;
    d.block_size = BS;
    d.max_blocks = MB;
    d.layout = CacheLayout::kTokenMajor;
    d.query_type = qt;
    d.cache_type = ct;
    d.query = static_cast<const char*>(p.query) +
              qsl[s0] * p.q_stride * static_cast<int64_t>(element_bytes(qt));
    d.query_stride = p.q_stride;
    d.out = out_bytes + qsl[s0] * row_bytes;
    d.key_cache = p.key_cache;
    d.value_cache = p.value_cache;
    d.block_tables = tables + s0 * MB;
    d.seq_lens = lens + s0;
    d.alibi_slopes = p.slopes;
    d.sinks = p.sinks;
    d.scale = a.scale;
    d.k_scale = a.k_scale;
    d.v_scale = p.v_scale;
    d.sliding_window = p.window;
    d.logits_soft_cap = a.logits_soft_cap;
    return d;
  };
  // A step with prefill tiles and a decode run of several sequences per worker runs its largest
  // such run beside the tiles (run_beside): one item per sequence (in groups of about
  // kStageBytes for the staged schedule); the other runs follow it.
  std::unique_ptr<Staging> staging;
  int64_t staged_run = -1, staged_seqs = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(decode_runs.size()); ++i) {
    int64_t seqs = 0;
    for (int64_t s = decode_runs[i].first; s < decode_runs[i].second; ++s) {
      seqs += lens[s] > 0 ? 1 : 0;
    }
    if (seqs > staged_seqs) staged_run = i, staged_seqs = seqs;
  }
  if (staged_run >= 0 && !tasks.empty() &&
      staged_seqs >= kStageMinSeqsPerWorker * num_workers) {
    staging = std::make_unique<Staging>();
    const auto [s0, s1] = decode_runs[staged_run];
    staging->args = decode_args(s0, s1);
    staging->args.split_tokens = MB * BS + 1;  // one item per non-empty sequence
    staging->num_items = staged_seqs;
    staging->staged = staged_schedule();
    if (staging->staged) {  // groups of about kStageBytes, tasks dealt round-robin
      const int64_t block_bytes = BS * Hkv * D * element_bytes(ct);
      int64_t bytes = kStageBytes, item = 0;
      for (int64_t s = s0; s < s1; ++s) {
        if (lens[s] <= 0) continue;
        if (bytes >= kStageBytes) {
          StageGroup& g = staging->groups.emplace_back();
          g.warm.key = static_cast<const char*>(p.key_cache);
          g.warm.value = static_cast<const char*>(p.value_cache);
          g.warm.block_bytes = block_bytes;
          g.item_begin = g.item_end = item;
          bytes = 0;
        }
        StageGroup& g = staging->groups.back();
        const KeyRange r = visible_keys(lens[s] - 1, lens[s], p.window);
        for (int64_t b = r.begin / BS; b <= (r.end - 1) / BS; ++b) {
          g.warm.blocks.push_back(tables[s * MB + b]);
          bytes += 2 * block_bytes;
        }
        g.item_end = ++item;
      }
      const int64_t ng = static_cast<int64_t>(staging->groups.size());  // > 0: staged_seqs > 0
      for (int64_t t = 0; t < static_cast<int64_t>(tasks.size()); ++t) {
        staging->groups[t % ng].tasks.push_back(t);
      }
    }
  }

  std::string error;
  switch (qt) {
    case DType::kF32:
      error = dispatch_cache<float>(ct, workers, p, items, tasks, staging.get());
      break;
    case DType::kBF16:
      error = dispatch_cache<bf16_t>(ct, workers, p, items, tasks, staging.get());
      break;
    case DType::kF16:
      error = dispatch_cache<f16_t>(ct, workers, p, items, tasks, staging.get());
      break;
    default: return "unreachable: query dtype checked";
  }
  if (!error.empty()) return error;

  // The decode runs (the staged one already ran).
  for (int64_t i = 0; i < static_cast<int64_t>(decode_runs.size()); ++i) {
    if (staging && i == staged_run) continue;
    const auto [s0, s1] = decode_runs[i];
    const DecodeArgs d = decode_args(s0, s1);
    if (std::string e = paged_decode(d, workers); !e.empty()) return e;
  }
  return "";
}

}  // namespace jax_attn_cpu

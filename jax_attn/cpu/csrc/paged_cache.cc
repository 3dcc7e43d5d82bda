// Cache writes, block gathers and block copies (paged_cache.h): checked first, then plain byte
// copies.

#include "paged_cache.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace jax_attn_cpu {
namespace {

// Below this many bytes a call runs on the calling thread: waking workers costs more.
constexpr int64_t kParallelBytes = 1 << 20;

// Tokens per run of the split layout's store (store_head): one 16 x 16 transpose tile.
constexpr int64_t kRunTokens = 16;

// dst[c * dst_stride + r] = src[r * src_stride + c] for r < rows, c < cols (both <= 16), for
// kBytes-byte elements. AVX-512: rows widened to 32-bit words, transposed in registers
// (transpose16x16) and narrowed back, so each side is one masked load or store per row.
template <int kBytes, typename Elem>
void transpose_tile(const Elem* src, int64_t src_stride, int64_t rows, int64_t cols, Elem* dst,
                    int64_t dst_stride) {
#if JAX_ATTN_AVX512
  const __mmask16 in = static_cast<__mmask16>((1u << cols) - 1u);
  const __mmask16 out = static_cast<__mmask16>((1u << rows) - 1u);
  __m512 r[16];
  for (int64_t i = 0; i < 16; ++i) {
    const Elem* row = src + i * src_stride;
    __m512i x = _mm512_setzero_si512();
    if (i < rows) {
      if constexpr (kBytes == 4) {
        x = _mm512_maskz_loadu_epi32(in, row);
      } else if constexpr (kBytes == 2) {
        x = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(in, row));
      } else {
        x = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(in, row));
      }
    }
    r[i] = _mm512_castsi512_ps(x);
  }
  transpose16x16(r);
  for (int64_t c = 0; c < cols; ++c) {
    Elem* row = dst + c * dst_stride;
    const __m512i x = _mm512_castps_si512(r[c]);
    if constexpr (kBytes == 4) {
      _mm512_mask_storeu_epi32(row, out, x);
    } else if constexpr (kBytes == 2) {
      _mm256_mask_storeu_epi16(row, out, _mm512_cvtepi32_epi16(x));
    } else {
      _mm_mask_storeu_epi8(row, out, _mm512_cvtepi32_epi8(x));
    }
  }
#else
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t r = 0; r < rows; ++r) dst[c * dst_stride + r] = src[r * src_stride + c];
  }
#endif
}

template <int kBytes>
void store_head(const StoreArgs& a, int64_t h) {
  struct Elem {
    unsigned char b[kBytes];
  };
  const int64_t D = a.head_size, Hkv = a.num_kv_heads, BS = a.block_size;
  const auto* key = static_cast<const Elem*>(a.key);
  const auto* value = static_cast<const Elem*>(a.value);
  const int64_t key_stride = a.key_stride > 0 ? a.key_stride : Hkv * D;
  const int64_t value_stride = a.value_stride > 0 ? a.value_stride : Hkv * D;
  auto* kc = static_cast<Elem*>(a.key_cache);
  auto* vc = static_cast<Elem*>(a.value_cache);
  if (a.layout == CacheLayout::kSplit) {
    // A token at a time, the split layout puts a value row's elements BS elements apart (and a
    // key row's 16-byte chunks BS * 16 bytes apart): with BS a power of two those lines share
    // a few L1 sets and evict each other (float32 at BS 128: 8x the token-major store's time).
    // So tokens whose slots follow each other inside one block (a prefill's) go as one run,
    // written a dimension (a key chunk) at a time: each store run contiguous in the cache.
    // Runs follow token order, so a slot given twice still keeps the later row.
    constexpr int64_t x = 16 / kBytes;
    for (int64_t t = 0; t < a.num_tokens;) {
      const int64_t slot = a.slots[t];
      if (slot < 0) {
        ++t;
        continue;
      }
      const int64_t b = slot / BS, o = slot % BS;
      int64_t n = 1;
      while (n < kRunTokens && t + n < a.num_tokens && o + n < BS && a.slots[t + n] == slot + n) {
        ++n;
      }
      const Elem* k = key + t * key_stride + h * D;
      const Elem* v = value + t * value_stride + h * D;
      Elem* kdst = kc + (b * Hkv + h) * D * BS + o * x;  // [D / x, BS, x]
      for (int64_t c = 0; c < D / x; ++c) {
        for (int64_t i = 0; i < n; ++i) {
          std::memcpy(kdst + c * BS * x + i * x, k + i * key_stride + c * x, 16);
        }
      }
      Elem* vdst = vc + (b * Hkv + h) * D * BS + o;  // [D, BS]
      for (int64_t d0 = 0; d0 < D; d0 += 16) {
        transpose_tile<kBytes>(v + d0, value_stride, n, std::min<int64_t>(16, D - d0),
                               vdst + d0 * BS, BS);
      }
      t += n;
    }
    return;
  }
  const int64_t stride = a.block_stride > 0 ? a.block_stride : BS * Hkv * D;
  for (int64_t t = 0; t < a.num_tokens; ++t) {  // token order: a repeated slot keeps the last
    const int64_t slot = a.slots[t];
    if (slot < 0) continue;
    const int64_t b = slot / BS, o = slot % BS;
    const int64_t row = b * stride + (o * Hkv + h) * D;  // block b: [BS, Hkv, D]
    std::memcpy(kc + row, key + t * key_stride + h * D, D * kBytes);
    std::memcpy(vc + row, value + t * value_stride + h * D, D * kBytes);
  }
}

}  // namespace

std::string store_rows(const StoreArgs& a, const Workers& workers) {
  const int64_t num_slots = a.num_blocks * a.block_size;
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    if (a.slots[t] < -1 || a.slots[t] >= num_slots) {
      return "slot_mapping[" + std::to_string(t) + "]=" + std::to_string(a.slots[t]) +
             " must be -1 (PAD_SLOT_ID) or in [0, num_blocks * block_size = " +
             std::to_string(num_slots) + ")";
    }
  }
  if (a.layout == CacheLayout::kSplit && a.head_size * a.elem_bytes % 16 != 0) {
    return "head_size=" + std::to_string(a.head_size) +
           " must fill whole 16-byte vectors in the split cache layout";
  }
  for (const auto& [stride, name] : {std::pair{a.key_stride, "key"}, {a.value_stride, "value"}}) {
    if (stride != 0 && stride < a.num_kv_heads * a.head_size) {
      return std::string(name) + "'s row stride=" + std::to_string(stride) +
             " must be 0 (dense) or at least num_kv_heads * head_size=" +
             std::to_string(a.num_kv_heads * a.head_size) + " elements";
    }
  }
  const int64_t block_elems = a.block_size * a.num_kv_heads * a.head_size;
  if (a.layout == CacheLayout::kTokenMajor && a.block_stride != 0 &&
      a.block_stride < block_elems) {
    return "block stride " + std::to_string(a.block_stride) +
           " must be at least block_size * num_kv_heads * head_size = " +
           std::to_string(block_elems) + " (blocks of one cache must not overlap)";
  }
  void (*head_fn)(const StoreArgs&, int64_t) = nullptr;
  switch (a.elem_bytes) {
    case 4: head_fn = store_head<4>; break;
    case 2: head_fn = store_head<2>; break;
    case 1: head_fn = store_head<1>; break;
    default: return "element size " + std::to_string(a.elem_bytes) + " must be 1, 2 or 4 bytes";
  }
  if (a.num_kv_heads == 0 || a.head_size == 0) return "";  // rows of no bytes: nothing to do
  const int64_t bytes = 2 * a.num_tokens * a.num_kv_heads * a.head_size * a.elem_bytes;
  Workers w = workers;
  if (bytes < kParallelBytes) w.count = 1;
  run_items(w, a.num_kv_heads, [&](int64_t h) { head_fn(a, h); });  // heads never overlap
  return "";
}

namespace {

// Tokens [t0, t0 + n) of block ids[i] of both split caches, every kv head, into block i of
// the token-major outputs, n = one cache line of a value row (64 / kBytes tokens) or the rest
// of the block: each source line is read once and whole, and the item's destination rows
// [n, Hkv, D] are written whole, head after head. Keys: a chunk's n 16-byte pieces to n rows;
// values: [D, n] -> [n, D] in 16 x 16 tiles (transpose_tile).
template <int kBytes>
void gather_tile(const GatherArgs& a, int64_t i, int64_t t0) {
  struct Elem {
    unsigned char b[kBytes];
  };
  constexpr int64_t x = 16 / kBytes;
  const int64_t D = a.head_size, Hkv = a.num_kv_heads, BS = a.block_size;
  const int64_t n = std::min<int64_t>(64 / kBytes, BS - t0);
  Elem* kd = static_cast<Elem*>(a.keys) + (i * BS + t0) * Hkv * D;  // row t: + t * Hkv * D
  Elem* vd = static_cast<Elem*>(a.values) + (i * BS + t0) * Hkv * D;
  for (int64_t h = 0; h < Hkv; ++h) {
    const int64_t head = (a.ids[i] * Hkv + h) * D * BS;  // [D / x, BS, x] and [D, BS]
    const Elem* ks = static_cast<const Elem*>(a.key_cache) + head + t0 * x;
    const Elem* vs = static_cast<const Elem*>(a.value_cache) + head + t0;
    for (int64_t c = 0; c < D / x; ++c) {
      for (int64_t t = 0; t < n; ++t) {
        std::memcpy(kd + t * Hkv * D + h * D + c * x, ks + (c * BS + t) * x, 16);
      }
    }
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      for (int64_t u = 0; u < n; u += 16) {
        transpose_tile<kBytes>(vs + d0 * BS + u, BS, std::min<int64_t>(16, D - d0),
                               std::min<int64_t>(16, n - u), vd + u * Hkv * D + h * D + d0,
                               Hkv * D);
      }
    }
  }
}

}  // namespace

std::string gather_split_blocks(const GatherArgs& a, const Workers& workers) {
  for (int64_t i = 0; i < a.num_ids; ++i) {
    if (a.ids[i] < 0 || a.ids[i] >= a.num_blocks) {
      return "block_ids[" + std::to_string(i) + "]=" + std::to_string(a.ids[i]) +
             " must be in [0, num_blocks=" + std::to_string(a.num_blocks) + ")";
    }
  }
  void (*tile_fn)(const GatherArgs&, int64_t, int64_t) = nullptr;
  switch (a.elem_bytes) {
    case 4: tile_fn = gather_tile<4>; break;
    case 2: tile_fn = gather_tile<2>; break;
    case 1: tile_fn = gather_tile<1>; break;
    default: return "element size " + std::to_string(a.elem_bytes) + " must be 1, 2 or 4 bytes";
  }
  if (a.head_size * a.elem_bytes % 16 != 0) {
    return "head_size=" + std::to_string(a.head_size) +
           " must fill whole 16-byte vectors in the split cache layout";
  }
  const int64_t Hkv = a.num_kv_heads;
  if (Hkv == 0 || a.head_size == 0 || a.block_size == 0) return "";  // no bytes to move
  const int64_t bytes = 2 * a.num_ids * a.block_size * Hkv * a.head_size * a.elem_bytes;
  Workers w = workers;
  if (bytes < kParallelBytes) w.count = 1;
  const int64_t run = 64 / a.elem_bytes, tiles = (a.block_size + run - 1) / run;
  run_items(w, a.num_ids * tiles, [&](int64_t j) { tile_fn(a, j / tiles, j % tiles * run); });
  return "";
}

namespace {

// A byte range [begin, end) as integers: ranges of different caches are compared.
struct Span {
  std::uintptr_t begin = 0, end = 0;
  bool overlaps(const Span& o) const {
    return begin < end && o.begin < o.end && begin < o.end && o.begin < end;
  }
};

Span span(const void* base, int64_t bytes) {
  const auto begin = reinterpret_cast<std::uintptr_t>(base);
  return Span{begin, begin + static_cast<std::uintptr_t>(bytes)};
}

// The same request twice (one cache listed twice as its own source): the second adds nothing.
bool same_copy(const BlockCopy& c, const BlockCopy& d) {
  return c.dst == d.dst && c.src == d.src && c.dst_blocks == d.dst_blocks &&
         c.src_blocks == d.src_blocks && c.block_bytes == d.block_bytes && c.halves == d.halves;
}

// One block to move: `bytes` from `from` to `to`. A staged move's source is read into the
// staging buffer (at `staged`) before any block is written.
struct Move {
  const char* from = nullptr;
  char* to = nullptr;
  int64_t bytes = 0;
  int64_t staged = -1;  // offset in the staging buffer, or -1: `from` is never written
};

// The rules, checked before anything is read or written: "" or the first one broken.
std::string check_copies(const BlockCopy* copies, int64_t num_copies, const int64_t* pairs,
                         int64_t num_pairs) {
  const auto str = [](int64_t v) { return std::to_string(v); };
  for (int64_t c = 0; c < num_copies; ++c) {
    for (int64_t i = 0; i < num_pairs; ++i) {
      const int64_t src = pairs[2 * i], dst = pairs[2 * i + 1];
      if (src < 0 || src >= copies[c].src_blocks || dst < 0 || dst >= copies[c].dst_blocks) {
        return "block_pairs[" + str(i) + "]=(" + str(src) + ", " + str(dst) +
               ") must be a source block in [0, " + str(copies[c].src_blocks) + ") of src[" +
               str(c) + "] and a destination block in [0, " + str(copies[c].dst_blocks) +
               ") of dst[" + str(c) + "]";
      }
    }
  }
  // Each destination once: pairs ordered by (destination, index), the earliest repeat named.
  std::vector<int64_t> order(num_pairs);
  for (int64_t i = 0; i < num_pairs; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return pairs[2 * a + 1] != pairs[2 * b + 1] ? pairs[2 * a + 1] < pairs[2 * b + 1] : a < b;
  });
  int64_t first = -1, again = num_pairs;
  for (int64_t k = 1; k < num_pairs; ++k) {
    if (pairs[2 * order[k] + 1] == pairs[2 * order[k - 1] + 1] && order[k] < again) {
      first = order[k - 1];
      again = order[k];
    }
  }
  if (first >= 0) {
    return "block_pairs[:, 1] has block " + str(pairs[2 * again + 1]) + " more than once " +
           "(block_pairs[" + str(first) + "] and [" + str(again) + "]): destinations must be " +
           "distinct (a repeated destination leaves which write wins undefined)";
  }
  // Destination caches apart (or the very same copy listed again, which copies nothing more).
  for (int64_t c = 0; c < num_copies; ++c) {
    const BlockCopy& a = copies[c];
    for (int64_t d = 0; d < c; ++d) {
      const BlockCopy& b = copies[d];
      if (same_copy(a, b)) continue;
      if (span(a.dst, a.halves * a.dst_blocks * a.block_bytes)
              .overlaps(span(b.dst, b.halves * b.dst_blocks * b.block_bytes))) {
        return "dst[" + str(d) + "] and dst[" + str(c) + "] share memory: destination caches "
               "must not overlap (a byte written twice leaves which write wins undefined) "
               "unless the same cache is listed with the same source";
      }
    }
  }
  return "";
}

// The moves of every copy (a repeated copy once), sources that a move writes marked staged.
std::vector<Move> plan_moves(const BlockCopy* copies, int64_t num_copies, const int64_t* pairs,
                             int64_t num_pairs, int64_t* staged_bytes) {
  std::vector<Move> moves;
  for (int64_t c = 0; c < num_copies; ++c) {
    const BlockCopy& cp = copies[c];
    if (cp.block_bytes == 0 || std::any_of(copies, copies + c, [&](const BlockCopy& d) {
          return same_copy(cp, d);
        })) {
      continue;
    }
    // half h of a cache: blocks [h * num_blocks, (h + 1) * num_blocks) of block_bytes each
    for (int64_t h = 0; h < cp.halves; ++h) {
      for (int64_t i = 0; i < num_pairs; ++i) {
        Move m;
        m.from = cp.src + (h * cp.src_blocks + pairs[2 * i]) * cp.block_bytes;
        m.to = cp.dst + (h * cp.dst_blocks + pairs[2 * i + 1]) * cp.block_bytes;
        m.bytes = cp.block_bytes;
        moves.push_back(m);
      }
    }
  }
  // The written blocks never overlap (check_copies): sorted by start, their ends are sorted
  // too, so the one block a read could overlap first is found by binary search.
  std::vector<Span> written(moves.size());
  for (size_t k = 0; k < moves.size(); ++k) written[k] = span(moves[k].to, moves[k].bytes);
  std::sort(written.begin(), written.end(),
            [](const Span& a, const Span& b) { return a.begin < b.begin; });
  *staged_bytes = 0;
  for (Move& m : moves) {
    const Span read = span(m.from, m.bytes);
    const auto hit = std::upper_bound(written.begin(), written.end(), read.begin,
                                      [](std::uintptr_t x, const Span& w) { return x < w.end; });
    if (hit != written.end() && hit->overlaps(read)) {
      m.staged = *staged_bytes;
      *staged_bytes += m.bytes;
    }
  }
  return moves;
}

}  // namespace

std::string copy_blocks(const BlockCopy* copies, int64_t num_copies, const int64_t* pairs,
                        int64_t num_pairs, const Workers& workers) {
  const std::string error = check_copies(copies, num_copies, pairs, num_pairs);
  if (!error.empty()) return error;
  int64_t staged_bytes = 0;
  const std::vector<Move> moves = plan_moves(copies, num_copies, pairs, num_pairs,
                                             &staged_bytes);
  int64_t bytes = staged_bytes;
  for (const Move& m : moves) bytes += m.bytes;
  Workers w = workers;
  if (bytes < kParallelBytes) w.count = 1;
  constexpr int64_t kMovesPerItem = 16;
  const int64_t num_moves = static_cast<int64_t>(moves.size());
  const int64_t items = (num_moves + kMovesPerItem - 1) / kMovesPerItem;
  const auto each_move = [&](int64_t item, auto&& fn) {
    const int64_t end = std::min(num_moves, (item + 1) * kMovesPerItem);
    for (int64_t k = item * kMovesPerItem; k < end; ++k) fn(moves[k]);
  };
  // Sources that some move overwrites are read first (run_items returns when every item is
  // done); the other sources are never written, so they are read in place.
  std::vector<char> staging(static_cast<size_t>(staged_bytes));
  if (staged_bytes > 0) {
    run_items(w, items, [&](int64_t item) {
      each_move(item, [&](const Move& m) {
        if (m.staged >= 0) std::memcpy(staging.data() + m.staged, m.from, m.bytes);
      });
    });
  }
  run_items(w, items, [&](int64_t item) {
    each_move(item, [&](const Move& m) {
      std::memcpy(m.to, m.staged >= 0 ? staging.data() + m.staged : m.from, m.bytes);
    });
  });
  return "";
}

}  // namespace jax_attn_cpu

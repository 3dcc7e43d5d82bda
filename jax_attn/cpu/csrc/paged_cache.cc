// Cache writes and block copies (paged_cache.h): checked first, then plain byte copies.

#include "paged_cache.h"

#include <cstring>
#include <set>
#include <vector>

namespace jax_attn_cpu {
namespace {

// Below this many bytes a call runs on the calling thread: waking workers costs more.
constexpr int64_t kParallelBytes = 1 << 20;

template <int kBytes>
void store_head(const StoreArgs& a, int64_t h) {
  struct Elem {
    unsigned char b[kBytes];
  };
  const int64_t D = a.head_size, Hkv = a.num_kv_heads, BS = a.block_size;
  const auto* key = static_cast<const Elem*>(a.key);
  const auto* value = static_cast<const Elem*>(a.value);
  auto* kc = static_cast<Elem*>(a.key_cache);
  auto* vc = static_cast<Elem*>(a.value_cache);
  for (int64_t t = 0; t < a.num_tokens; ++t) {  // token order: a repeated slot keeps the last
    const int64_t slot = a.slots[t];
    if (slot < 0) continue;
    const int64_t b = slot / BS, o = slot % BS;
    const Elem* k = key + (t * Hkv + h) * D;
    const Elem* v = value + (t * Hkv + h) * D;
    if (a.layout == CacheLayout::kSplit) {
      constexpr int64_t x = 16 / kBytes;
      Elem* kdst = kc + (b * Hkv + h) * D * BS + o * x;  // [D / x, BS, x]
      for (int64_t c = 0; c < D / x; ++c) std::memcpy(kdst + c * BS * x, k + c * x, 16);
      Elem* vdst = vc + (b * Hkv + h) * D * BS + o;  // [D, BS]
      for (int64_t d = 0; d < D; ++d) vdst[d * BS] = v[d];
    } else {
      const int64_t row = ((b * BS + o) * Hkv + h) * D;
      std::memcpy(kc + row, k, D * kBytes);
      std::memcpy(vc + row, v, D * kBytes);
    }
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
  void (*head_fn)(const StoreArgs&, int64_t) = nullptr;
  switch (a.elem_bytes) {
    case 4: head_fn = store_head<4>; break;
    case 2: head_fn = store_head<2>; break;
    case 1: head_fn = store_head<1>; break;
    default: return "element size " + std::to_string(a.elem_bytes) + " must be 1, 2 or 4 bytes";
  }
  const int64_t bytes = 2 * a.num_tokens * a.num_kv_heads * a.head_size * a.elem_bytes;
  Workers w = workers;
  if (bytes < kParallelBytes) w.count = 1;
  run_items(w, a.num_kv_heads, [&](int64_t h) { head_fn(a, h); });  // heads never overlap
  return "";
}

std::string copy_blocks(const BlockCopy* copies, int64_t num_copies, const int64_t* pairs,
                        int64_t num_pairs, const Workers& workers) {
  for (int64_t c = 0; c < num_copies; ++c) {
    for (int64_t i = 0; i < num_pairs; ++i) {
      const int64_t src = pairs[2 * i], dst = pairs[2 * i + 1];
      if (src < 0 || src >= copies[c].src_blocks || dst < 0 || dst >= copies[c].dst_blocks) {
        return "block pair " + std::to_string(i) + " (" + std::to_string(src) + " -> " +
               std::to_string(dst) + ") must be in [0, " + std::to_string(copies[c].src_blocks) +
               ") -> [0, " + std::to_string(copies[c].dst_blocks) + ")";
      }
    }
  }
  // Sources go through a staging copy where a destination of the same cache is also read.
  std::vector<int64_t> sources(num_pairs), targets(num_pairs);
  for (int64_t i = 0; i < num_pairs; ++i) {
    sources[i] = pairs[2 * i];
    targets[i] = pairs[2 * i + 1];
  }
  const std::set<int64_t> read(sources.begin(), sources.end());
  bool overlap = false;
  for (int64_t t : targets) overlap = overlap || read.count(t) > 0;
  int64_t bytes = 0;
  for (int64_t c = 0; c < num_copies; ++c) bytes += copies[c].halves * copies[c].block_bytes;
  bytes *= num_pairs;
  Workers w = workers;
  if (bytes < kParallelBytes) w.count = 1;
  run_items(w, num_copies, [&](int64_t c) {
    const BlockCopy& cp = copies[c];
    const bool stage = overlap && static_cast<const char*>(cp.dst) == cp.src;
    std::vector<char> staged(stage ? static_cast<size_t>(num_pairs * cp.block_bytes) : 0);
    for (int64_t half = 0; half < cp.halves; ++half) {
      const char* src = cp.src + half * cp.src_blocks * cp.block_bytes;
      char* dst = cp.dst + half * cp.dst_blocks * cp.block_bytes;
      if (stage) {
        for (int64_t i = 0; i < num_pairs; ++i) {
          std::memcpy(staged.data() + i * cp.block_bytes, src + sources[i] * cp.block_bytes,
                      cp.block_bytes);
        }
      }
      for (int64_t i = 0; i < num_pairs; ++i) {
        const char* from = stage ? staged.data() + i * cp.block_bytes
                                 : src + sources[i] * cp.block_bytes;
        std::memcpy(dst + targets[i] * cp.block_bytes, from, cp.block_bytes);
      }
    }
  });
  return "";
}

}  // namespace jax_attn_cpu

// Cache writes and block copies on the CPU, framework-free (torch_ops.cc binds them as torch
// ops for torch_backends; the JAX core writes through XLA scatters). Raw bytes: the caller
// hands rows already in the cache's element type (fp8: their bit patterns).
#pragma once

#include <cstdint>
#include <string>

#include "kernel_common.h"
#include "paged_decode.h"

namespace jax_attn_cpu {

// Rows [T, Hkv, D] of `elem_bytes`-byte elements written to their slots (block * BS + offset)
// in a cache of `layout` (the split layout: key [NB, Hkv, D / x, BS, x], value [NB, Hkv, D, BS];
// token-major: [NB, BS, Hkv, D]). A slot of -1 (PAD_SLOT_ID) writes nothing; a slot given twice
// keeps the later token's row.
struct StoreArgs {
  CacheLayout layout = CacheLayout::kSplit;
  int64_t num_tokens = 0, num_kv_heads = 0, head_size = 0;
  int64_t num_blocks = 0, block_size = 0, elem_bytes = 0;
  // Token-major only: elements from one block of a cache to the next, the same for both
  // caches; 0 means BS * Hkv * D (dense caches). Larger strides let two caches interleave
  // block by block in one buffer (the vLLM V1 plugin's page: its key block, then its value
  // block).
  int64_t block_stride = 0;
  const int64_t* slots = nullptr;  // [T]
  const void* key = nullptr;       // [T, Hkv, D], tokens key_stride elements apart
  const void* value = nullptr;     // likewise, value_stride
  int64_t key_stride = 0, value_stride = 0;  // 0: Hkv * D (dense rows)
  void* key_cache = nullptr;
  void* value_cache = nullptr;
};

// Returns "" or a message naming the first bad slot (outside [-1, NB * BS)), before any write.
std::string store_rows(const StoreArgs& args, const Workers& workers);

// Blocks of vLLM's split caches (key [NB, Hkv, D / x, BS, x], value [NB, Hkv, D, BS], x = 16
// bytes of `elem_bytes`-byte elements) in the token-major order [BS, Hkv, D]: block ids[i] of
// each cache into block i of `keys` / `values` (dense [num_ids, BS, Hkv, D] each). For the
// torch half's prefills over a cached prefix, which the ragged kernel reads token-major.
struct GatherArgs {
  int64_t num_ids = 0, num_blocks = 0, block_size = 0, num_kv_heads = 0, head_size = 0;
  int64_t elem_bytes = 0;
  const int64_t* ids = nullptr;  // [num_ids]
  const void* key_cache = nullptr;
  const void* value_cache = nullptr;
  void* keys = nullptr;
  void* values = nullptr;
};

// Returns "" or a message naming the first id outside [0, NB), before any write.
std::string gather_split_blocks(const GatherArgs& args, const Workers& workers);

// One cache (or pair of caches) whose blocks are copied: `num_blocks` blocks of `block_bytes`,
// in `halves` contiguous runs (vLLM's kv_cache [2, NB, ...]: the key and value halves).
struct BlockCopy {
  char* dst = nullptr;
  const char* src = nullptr;
  int64_t dst_blocks = 0, src_blocks = 0, block_bytes = 0, halves = 1;
};

// For every copy and each half: block pairs[i][1] of dst <- block pairs[i][0] of src, as if
// every source were read before any destination is written, whatever the caches share: dst ==
// src, views that partly overlap, a destination of one copy that is a source of another, a
// chain (0 -> 1, 1 -> 2 copies the old block 1). Sources that a copy overwrites go through a
// staging buffer; the rest are read in place. Nothing is written twice, by rule: the
// destination ids are distinct, and destination caches do not overlap (a copy listed again
// with the same dst and src is done once). Returns "" or a message naming the first
// broken rule (a block id out of range, a repeated destination, overlapping destination
// caches), before any read or write.
std::string copy_blocks(const BlockCopy* copies, int64_t num_copies, const int64_t* pairs,
                        int64_t num_pairs, const Workers& workers);

}  // namespace jax_attn_cpu

// Paged decode on the CPU, callable from any front end: the XLA FFI handler
// (paged_decode_xla.cc, jax_attn.cpu.paged_decode) and the torch op (torch_ops.cc,
// torch_backends' TORCH_SDPA decode) run this one kernel.
#pragma once

#include <string>

#include "kernel_common.h"

namespace jax_attn_cpu {

// Where a cache element (block, token in the block, kv head, dim) lives.
enum class CacheLayout {
  // key and value [NB, BS, Hkv, D]: jax_attn's caches.
  kTokenMajor,
  // vLLM's: key [NB, Hkv, D / x, BS, x] with x = 16 bytes / element size, value
  // [NB, Hkv, D, BS] (torch_backends' PagedAttention.split_kv_cache).
  kSplit,
};

// One decode step: query [S, Hq, D] at position seq_lens[s] - 1 of each sequence over its
// paged cache. All arrays are dense, row-major, in the layout and dtypes named here.
struct DecodeArgs {
  int64_t num_seqs = 0, num_heads = 0, head_size = 0, num_kv_heads = 0;
  int64_t num_blocks = 0, block_size = 0, max_blocks = 0;
  CacheLayout layout = CacheLayout::kTokenMajor;
  DType query_type = DType::kF32;  // query and output: f32, bf16 or f16
  DType cache_type = DType::kF32;  // both caches: f32, bf16, f16, e4m3fn or e5m2
  const void* query = nullptr;
  int64_t query_stride = 0;  // elements from one sequence's query row to the next; 0: dense
  void* out = nullptr;
  const void* key_cache = nullptr;
  const void* value_cache = nullptr;
  const int32_t* block_tables = nullptr;  // [S, max_blocks]
  const int32_t* seq_lens = nullptr;      // [S]
  const float* alibi_slopes = nullptr;    // [Hq], or nullptr for none
  const float* sinks = nullptr;           // [Hq] attention sinks' logits, or nullptr for none
  float scale = 1.0f, k_scale = 1.0f, v_scale = 1.0f;
  int64_t sliding_window = 0;  // <= 0: none
  float logits_soft_cap = 0.0f;  // <= 0: none
  int64_t split_tokens = 0;      // keys per split-K part; 0: chosen from the batch
};

// Whether a step of this kind runs on the AMX tiles here (bf16 queries on a bf16 or fp8 cache,
// on a CPU whose tiles this process may use; token-major: block size a multiple of 16, `group`
// query heads per kv head of at least 5 on bf16 or 4 on fp8; split: block size 16, 32 or a
// multiple of 64, any group); else on AVX-512 (or the portable code).
bool decode_on_amx(CacheLayout layout, DType cache_type, DType query_type, int64_t block_size,
                   int64_t group);

// Runs the step on `workers`. Returns "" on success, else a message naming the argument and
// the rule (sizes, dtypes, seq_lens outside [0, max_blocks * block_size], a block id outside
// [0, num_blocks) among the blocks a sequence reads): then nothing was read or written.
std::string paged_decode(const DecodeArgs& args, const Workers& workers);

}  // namespace jax_attn_cpu

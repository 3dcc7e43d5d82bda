// Ragged paged attention on the CPU, callable from any front end: the XLA FFI handler
// (ragged_paged_attention_xla.cc, jax_attn.cpu.ragged_paged_attention) and the torch op
// (torch_ops.cc, jax_attn::ragged_paged_attention) run this one kernel.
#pragma once

#include <string>

#include "kernel_common.h"

namespace jax_attn_cpu {

// One step of a ragged batch (SPEC section 1, `paged_attention`): query [T, Hq, D], sequence s
// owning rows [query_start_loc[s], query_start_loc[s + 1]) at the last q_len positions of its
// seq_lens[s] keys, over caches [NB, BS, Hkv, D]. Only the first num_seqs of the seq_rows rows
// of the metadata are real; output rows outside them are zeros. All arrays are dense,
// row-major, in the dtypes named here, but for the query's tokens, which may lie query_stride
// elements apart (a view of a fused qkv projection: each token's [Hq, D] dense).
//
//   query_start_loc [0, 40, 49, 50, 51]: seq 0 rows 0..39 (prefill), seq 1 rows 40..48 (a
//   chunk after its cached prefix), seqs 2 and 3 one row each (decodes).
struct RaggedArgs {
  int64_t num_tokens = 0, num_heads = 0, head_size = 0;
  int64_t num_blocks = 0, block_size = 0, num_kv_heads = 0;
  int64_t seq_rows = 0;    // S: rows of seq_lens and block_tables
  int64_t max_blocks = 0;  // block_tables [S, max_blocks]
  int64_t num_seqs = 0;    // real sequences, in [0, S]
  DType query_type = DType::kF32;  // query and output: f32, bf16 or f16
  DType cache_type = DType::kF32;  // both caches: f32, bf16, f16, e4m3fn or e5m2
  const void* query = nullptr;
  int64_t query_stride = 0;  // elements from one token's query row to the next; 0: Hq * D
  void* out = nullptr;
  const void* key_cache = nullptr;
  const void* value_cache = nullptr;
  const int32_t* query_start_loc = nullptr;  // [S + 1]
  const int32_t* seq_lens = nullptr;         // [S]
  const int32_t* block_tables = nullptr;     // [S, max_blocks]
  const float* alibi_slopes = nullptr;       // [Hq], or nullptr for none
  const float* sinks = nullptr;  // [Hq] attention sinks' logits (kernel_common.h), or nullptr
  float scale = 1.0f, k_scale = 1.0f, v_scale = 1.0f;
  bool causal = true;
  int64_t sliding_window = 0;    // <= 0: none
  float logits_soft_cap = 0.0f;  // <= 0: none
};

// Runs the step on `workers`. Returns "" on success, else a message naming the argument and
// the rule (sizes, dtypes, num_seqs outside [0, S], a query_start_loc that decreases or leaves
// [0, num_tokens], seq_lens outside [q_len, max_blocks * block_size], a block id outside
// [0, num_blocks) among the blocks a sequence reads): then nothing was read or written.
std::string ragged_paged_attention(const RaggedArgs& args, const Workers& workers);

}  // namespace jax_attn_cpu

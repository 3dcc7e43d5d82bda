// The torch side of the native CPU kernels: torch ops (namespace `jax_attn`) over the same
// kernels the XLA handlers run, on torch's intra-op threads (at::parallel_for), for
// torch_backends (torch_backends/native.py builds and loads this library; it registers the
// ops' fake kernels). Shapes and dtypes are checked here, values in the kernels; a bad
// argument raises ValueError naming it, before anything is read or written. Tensors are
// contiguous, but for the rows [tokens, heads, head_size] (query; key and value of the
// stores), which may be views whose tokens lie apart, each token's heads dense (vLLM's views
// of its fused qkv projection: token_stride).
//
//   paged_decode_split(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache,
//       Tensor block_tables, Tensor seq_lens, Tensor? alibi_slopes, float scale,
//       Tensor k_scale, Tensor v_scale, int sliding_window, float logits_soft_cap,
//       str kv_cache_dtype) -> ()
//     vLLM's decode (`paged_attention_v1`) on its split cache layout: key [NB, Hkv, D/x, BS, x],
//     value [NB, Hkv, D, BS]; out [S, Hq, D] is written. fp8 caches are uint8 tensors holding
//     float8 bit patterns, named by kv_cache_dtype ("fp8" / "fp8_e4m3": e4m3fn, "fp8_e5m2").
//
//   ragged_paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache,
//       Tensor query_start_loc, Tensor seq_lens, Tensor block_tables, Tensor num_seqs,
//       Tensor? alibi_slopes, float scale, bool causal, int sliding_window,
//       float logits_soft_cap, Tensor k_scale, Tensor v_scale, str kv_cache_dtype,
//       Tensor? sinks=None) -> ()
//     jax_attn.paged_attention's ragged step (prefill, chunked prefill, decode, mixed) over the
//     token-major caches [NB, BS, Hkv, D]: query and out [T, Hq, D]; int32 query_start_loc
//     [S + 1], seq_lens [S], block_tables [S, max_blocks], num_seqs (one value: the real rows);
//     out is written (rows past query_start_loc[num_seqs] as zeros). The XLA handler's kernel
//     (ragged_paged_attention.h), its checks included. fp8 caches as in paged_decode_split.
//     sinks: float32 [Hq], one attention-sink logit per query head (kernel_common.h), or none.
//
//   store_split(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache,
//       Tensor slot_mapping) -> ()
//     vLLM's `reshape_and_cache`: rows [T, Hkv, D] (already the cache's element type: fp8 as
//     uint8 bits) to slot_mapping[t] (int64; -1 skips; a repeated slot keeps the later row).
//
//   store_token_major(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache,
//       Tensor slot_mapping) -> ()
//     The same write into the token-major caches [NB, BS, Hkv, D] that ragged_paged_attention
//     reads. Each cache dense inside a block, with any block stride (one for both): the vLLM
//     V1 plugin's page [2, BS, Hkv, D] (key block, value block) is kv.unbind(1). The two
//     caches' blocks must not overlap.
//
//   gather_split_blocks(Tensor key_cache, Tensor value_cache, Tensor block_ids,
//       Tensor(a!) keys, Tensor(b!) values) -> ()
//     Blocks block_ids[i] (int64) of vLLM's split caches in token-major order: keys[i] and
//     values[i] ([M >= num_ids, BS, Hkv, D], the caches' dtype) hold them (paged_cache.h).
//
//   copy_blocks(Tensor(a!)[] dst, Tensor[] src, Tensor block_pairs) -> ()
//     dst[i][:, pairs[:, 1]] = src[i][:, pairs[:, 0]] for caches [2, NB, ...] (vLLM's
//     copy_blocks with dst = src, swap_blocks with one pair of caches), as if every source
//     were read before any destination is written, however dst and src share memory.
//     Refused: a destination id twice, destination caches that overlap (unless the same
//     dst[i], src[i] are listed again: copied once) (paged_cache.h).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "paged_cache.h"
#include "paged_decode.h"
#include "ragged_paged_attention.h"

namespace jax_attn_cpu {
namespace {

// The kernels' threads: up to at::get_num_threads() of torch's pool, items handed out one at
// a time ($JAX_ATTN_CPU_THREADS overrides the count).
Workers torch_workers() {
  Workers w;
  w.count = worker_count(at::get_num_threads());
  w.parallel_for = [](void*, int64_t n, int64_t count, void (*item)(void*, int64_t),
                      void* ctx) {
    std::atomic<int64_t> next{0};
    WorkerCpus cpus;
    at::parallel_for(0, count, 1, [&](int64_t, int64_t) {
      take_items(next, n, cpus, [&](int64_t i) { item(ctx, i); });
    });
  };
  return w;
}

DType query_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kF32;
    case at::kBFloat16: return DType::kBF16;
    case at::kHalf: return DType::kF16;
    default: return DType::kOther;
  }
}

// The cache's element type: the tensor's own for kv_cache_dtype "auto", else the fp8 format
// named (the tensor holds its bit patterns as uint8).
DType cache_dtype(const at::Tensor& t, const std::string& kv_cache_dtype) {
  if (kv_cache_dtype == "auto") {
    if (t.scalar_type() == at::kFloat8_e4m3fn) return DType::kF8E4M3FN;
    if (t.scalar_type() == at::kFloat8_e5m2) return DType::kF8E5M2;
    return query_dtype(t);
  }
  TORCH_CHECK_VALUE(t.element_size() == 1, "kv_cache_dtype=", kv_cache_dtype,
                    " needs a 1-byte cache (uint8 bit patterns), got ", t.scalar_type());
  if (kv_cache_dtype == "fp8" || kv_cache_dtype == "fp8_e4m3") return DType::kF8E4M3FN;
  if (kv_cache_dtype == "fp8_e5m2") return DType::kF8E5M2;
  TORCH_CHECK_VALUE(false, "kv_cache_dtype=", kv_cache_dtype,
                    " must be auto, fp8, fp8_e4m3 or fp8_e5m2");
  return DType::kOther;
}

using Named = std::pair<const at::Tensor*, const char*>;

// Each tensor on the CPU and contiguous, or ValueError naming it.
void check_cpu_contiguous(std::initializer_list<Named> tensors) {
  for (const auto& [t, name] : tensors) {
    TORCH_CHECK_VALUE(t->device().is_cpu(), name, " must be a CPU tensor, got ", t->device());
    TORCH_CHECK_VALUE(t->is_contiguous(), name, " must be contiguous");
  }
}

// Rows [tokens, heads, head_size] on the CPU whose tokens may lie apart (vLLM's query, key and
// value are views of the fused qkv projection), each token's heads dense: the token stride in
// elements, or ValueError naming the tensor and the rule.
int64_t token_stride(const at::Tensor& rows, const char* name) {
  TORCH_CHECK_VALUE(rows.device().is_cpu(), name, " must be a CPU tensor, got ", rows.device());
  const int64_t heads = rows.size(1), size = rows.size(2);
  if (rows.numel() == 0 || rows.is_contiguous()) return heads * size;  // strides of no matter
  const bool dense = (size <= 1 || rows.stride(2) == 1) && (heads <= 1 || rows.stride(1) == size);
  const int64_t stride = rows.size(0) <= 1 ? heads * size : rows.stride(0);
  TORCH_CHECK_VALUE(dense && stride >= heads * size, name,
                    " must be contiguous, or a view whose tokens lie at least heads * head_size=",
                    heads * size, " elements apart, each token's [heads, head_size] dense; got "
                    "strides ", rows.strides());
  return stride;
}

// Whether out's bytes overlap the span of a query read through query_token_stride (the gaps
// between its tokens included).
bool overlaps_query(const at::Tensor& out, const at::Tensor& query, int64_t stride) {
  if (query.numel() == 0 || out.numel() == 0) return false;
  const auto begin_q = reinterpret_cast<std::uintptr_t>(query.data_ptr());
  const auto end_q = begin_q + static_cast<std::uintptr_t>(
      ((query.size(0) - 1) * stride + query.size(1) * query.size(2)) * query.element_size());
  const auto begin_o = reinterpret_cast<std::uintptr_t>(out.data_ptr());
  const auto end_o = begin_o + static_cast<std::uintptr_t>(out.nbytes());
  return begin_q < end_o && begin_o < end_q;
}

// An optional float32 [num_heads] argument (ALiBi slopes, attention sinks): its data, nullptr
// when absent, or ValueError naming it.
const float* per_head(const std::optional<at::Tensor>& t, int64_t num_heads, const char* name) {
  if (!t.has_value()) return nullptr;
  const at::Tensor& s = *t;
  TORCH_CHECK_VALUE(s.dim() == 1 && s.size(0) == num_heads && s.scalar_type() == at::kFloat, name,
                    " must be float32 [num_heads=", num_heads, "], got ", s.scalar_type(), " ",
                    s.sizes());
  check_cpu_contiguous({{&s, name}});
  return s.data_ptr<float>();
}

// vLLM's split key cache [num_blocks, num_kv_heads, head_size / x, block_size, x]: its x,
// which must hold 16 bytes, or ValueError.
int64_t split_x(const at::Tensor& key_cache) {
  const int64_t x = key_cache.size(4);
  TORCH_CHECK_VALUE(x * key_cache.element_size() == 16, "key_cache's last dimension x=", x,
                    " must hold 16 bytes (x = 16 / element size)");
  return x;
}

// vLLM's split value cache: [num_blocks, num_kv_heads, head_size, block_size], or ValueError.
void check_split_value_shape(const at::Tensor& value_cache, int64_t num_blocks,
                             int64_t num_kv_heads, int64_t head_size, int64_t block_size) {
  const std::vector<int64_t> shape{num_blocks, num_kv_heads, head_size, block_size};
  TORCH_CHECK_VALUE(value_cache.sizes() == at::IntArrayRef(shape), "value_cache ",
                    value_cache.sizes(), " must be [num_blocks, num_kv_heads, head_size, "
                    "block_size] = ", at::IntArrayRef(shape));
}

// Whether the bytes of two contiguous tensors overlap.
bool shares_memory(const at::Tensor& a, const at::Tensor& b) {
  const auto begin_a = reinterpret_cast<std::uintptr_t>(a.data_ptr());
  const auto begin_b = reinterpret_cast<std::uintptr_t>(b.data_ptr());
  const auto end_a = begin_a + static_cast<std::uintptr_t>(a.nbytes());
  const auto end_b = begin_b + static_cast<std::uintptr_t>(b.nbytes());
  return begin_a < end_a && begin_b < end_b && begin_a < end_b && begin_b < end_a;
}

// A double as float: NaN and the infinities kept, finite values past float's range to the
// infinities (a plain cast of those is undefined behaviour).
float to_float(double v) {
  constexpr double kMax = std::numeric_limits<float>::max();
  if (v > kMax) return std::numeric_limits<float>::infinity();
  if (v < -kMax) return -std::numeric_limits<float>::infinity();
  return static_cast<float>(v);
}

// A one-element tensor's value (any real dtype; torch's own float conversion raises on
// values past float's range).
float scalar(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.numel() == 1, name, " must hold one value, got shape ", t.sizes());
  TORCH_CHECK_VALUE(!t.is_complex(), name, " must be real, got ", t.scalar_type());
  return to_float(t.item<double>());
}

void paged_decode_split(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, const std::optional<at::Tensor>& alibi_slopes,
                        double scale, const at::Tensor& k_scale, const at::Tensor& v_scale,
                        int64_t sliding_window, double logits_soft_cap,
                        const std::string& kv_cache_dtype) {
  TORCH_CHECK_VALUE(query.dim() == 3, "query must be [num_seqs, num_heads, head_size], got ",
                    query.sizes());
  TORCH_CHECK_VALUE(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
                    "out must have the query's shape and dtype: ", out.sizes(), " ",
                    out.scalar_type(), " vs ", query.sizes(), " ", query.scalar_type());
  TORCH_CHECK_VALUE(key_cache.dim() == 5,
                    "key_cache must be [num_blocks, num_kv_heads, head_size / x, block_size, x], "
                    "got ", key_cache.sizes());
  TORCH_CHECK_VALUE(value_cache.dim() == 4,
                    "value_cache must be [num_blocks, num_kv_heads, head_size, block_size], got ",
                    value_cache.sizes());
  check_cpu_contiguous({{&out, "out"}, {&key_cache, "key_cache"}, {&value_cache, "value_cache"},
                        {&block_tables, "block_tables"}, {&seq_lens, "seq_lens"}});
  const int64_t query_stride = token_stride(query, "query");
  TORCH_CHECK_VALUE(!overlaps_query(out, query, query_stride),
                    "out must not share memory with query (the kernel reads it while writing out)");
  DecodeArgs a;
  a.layout = CacheLayout::kSplit;
  a.num_seqs = query.size(0);
  a.num_heads = query.size(1);
  a.head_size = query.size(2);
  a.num_blocks = key_cache.size(0);
  a.num_kv_heads = key_cache.size(1);
  a.block_size = key_cache.size(3);
  const int64_t x = split_x(key_cache);
  TORCH_CHECK_VALUE(key_cache.size(2) * x == a.head_size, "key_cache head_size=",
                    key_cache.size(2) * x, " must equal query head_size=", a.head_size);
  check_split_value_shape(value_cache, a.num_blocks, a.num_kv_heads, a.head_size, a.block_size);
  TORCH_CHECK_VALUE(value_cache.scalar_type() == key_cache.scalar_type(), "value_cache dtype ",
                    value_cache.scalar_type(), " must match key_cache ", key_cache.scalar_type());
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.size(0) == a.num_seqs &&
                        block_tables.scalar_type() == at::kInt,
                    "block_tables must be int32 [num_seqs=", a.num_seqs, ", max_blocks], got ",
                    block_tables.scalar_type(), " ", block_tables.sizes());
  TORCH_CHECK_VALUE(seq_lens.dim() == 1 && seq_lens.size(0) == a.num_seqs &&
                        seq_lens.scalar_type() == at::kInt,
                    "seq_lens must be int32 [num_seqs=", a.num_seqs, "], got ",
                    seq_lens.scalar_type(), " ", seq_lens.sizes());
  a.max_blocks = block_tables.size(1);
  a.alibi_slopes = per_head(alibi_slopes, a.num_heads, "alibi_slopes");
  a.query_type = query_dtype(query);
  a.cache_type = cache_dtype(key_cache, kv_cache_dtype);
  a.query = query.data_ptr();
  a.query_stride = query_stride;
  a.out = out.data_ptr();
  a.key_cache = key_cache.data_ptr();
  a.value_cache = value_cache.data_ptr();
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.seq_lens = seq_lens.data_ptr<int32_t>();
  a.scale = to_float(scale);
  a.k_scale = scalar(k_scale, "k_scale");
  a.v_scale = scalar(v_scale, "v_scale");
  a.sliding_window = sliding_window;
  a.logits_soft_cap = to_float(logits_soft_cap);
  const std::string error = paged_decode(a, torch_workers());
  TORCH_CHECK_VALUE(error.empty(), error);
}

void ragged_paged_attention_op(at::Tensor out, const at::Tensor& query,
                               const at::Tensor& key_cache, const at::Tensor& value_cache,
                               const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                               const at::Tensor& block_tables, const at::Tensor& num_seqs,
                               const std::optional<at::Tensor>& alibi_slopes, double scale,
                               bool causal, int64_t sliding_window, double logits_soft_cap,
                               const at::Tensor& k_scale, const at::Tensor& v_scale,
                               const std::string& kv_cache_dtype,
                               const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK_VALUE(query.dim() == 3, "query must be [num_tokens, num_heads, head_size], got ",
                    query.sizes());
  TORCH_CHECK_VALUE(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
                    "out must have the query's shape and dtype: ", out.sizes(), " ",
                    out.scalar_type(), " vs ", query.sizes(), " ", query.scalar_type());
  TORCH_CHECK_VALUE(key_cache.dim() == 4 && key_cache.size(3) == query.size(2),
                    "key_cache must be [num_blocks, block_size, num_kv_heads, head_size=",
                    query.size(2), "], got ", key_cache.sizes());
  TORCH_CHECK_VALUE(value_cache.sizes() == key_cache.sizes(), "value_cache ",
                    value_cache.sizes(), " must match key_cache ", key_cache.sizes());
  TORCH_CHECK_VALUE(value_cache.scalar_type() == key_cache.scalar_type(), "value_cache dtype ",
                    value_cache.scalar_type(), " must match key_cache ", key_cache.scalar_type());
  check_cpu_contiguous({{&out, "out"}, {&key_cache, "key_cache"}, {&value_cache, "value_cache"},
                        {&query_start_loc, "query_start_loc"}, {&seq_lens, "seq_lens"},
                        {&block_tables, "block_tables"}, {&num_seqs, "num_seqs"}});
  const int64_t query_stride = token_stride(query, "query");
  TORCH_CHECK_VALUE(!overlaps_query(out, query, query_stride),
                    "out must not share memory with query (the kernel reads it while writing out)");
  for (const auto& [t, name] : std::initializer_list<Named>{
           {&key_cache, "key_cache"}, {&value_cache, "value_cache"}}) {
    TORCH_CHECK_VALUE(!shares_memory(out, *t), "out must not share memory with ", name,
                      " (the kernel reads it while writing out)");
  }
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt,
                    "block_tables must be int32 [num_seqs, max_blocks], got ",
                    block_tables.scalar_type(), " ", block_tables.sizes());
  const int64_t rows = block_tables.size(0);
  TORCH_CHECK_VALUE(seq_lens.dim() == 1 && seq_lens.size(0) == rows &&
                        seq_lens.scalar_type() == at::kInt,
                    "seq_lens must be int32 [num_seqs=", rows, "] (block_tables rows), got ",
                    seq_lens.scalar_type(), " ", seq_lens.sizes());
  TORCH_CHECK_VALUE(query_start_loc.dim() == 1 && query_start_loc.size(0) == rows + 1 &&
                        query_start_loc.scalar_type() == at::kInt,
                    "query_start_loc must be int32 [num_seqs + 1=", rows + 1, "], got ",
                    query_start_loc.scalar_type(), " ", query_start_loc.sizes());
  TORCH_CHECK_VALUE(num_seqs.numel() == 1 && num_seqs.scalar_type() == at::kInt,
                    "num_seqs must be one int32 value, got ", num_seqs.scalar_type(), " ",
                    num_seqs.sizes());
  RaggedArgs a;
  a.num_tokens = query.size(0);
  a.num_heads = query.size(1);
  a.head_size = query.size(2);
  a.num_blocks = key_cache.size(0);
  a.block_size = key_cache.size(1);
  a.num_kv_heads = key_cache.size(2);
  a.seq_rows = rows;
  a.max_blocks = block_tables.size(1);
  a.num_seqs = num_seqs.data_ptr<int32_t>()[0];
  a.alibi_slopes = per_head(alibi_slopes, a.num_heads, "alibi_slopes");
  a.sinks = per_head(sinks, a.num_heads, "sinks");
  a.query_type = query_dtype(query);
  TORCH_CHECK_VALUE(a.query_type != DType::kOther, "query dtype ", query.scalar_type(),
                    " must be float32, bfloat16 or float16");
  a.cache_type = cache_dtype(key_cache, kv_cache_dtype);
  TORCH_CHECK_VALUE(a.cache_type != DType::kOther, "key_cache dtype ", key_cache.scalar_type(),
                    " must be float32, bfloat16, float16 or float8 (e4m3fn, e5m2)");
  a.query = query.data_ptr();
  a.query_stride = query_stride;
  a.out = out.data_ptr();
  a.key_cache = key_cache.data_ptr();
  a.value_cache = value_cache.data_ptr();
  a.query_start_loc = query_start_loc.data_ptr<int32_t>();
  a.seq_lens = seq_lens.data_ptr<int32_t>();
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.scale = to_float(scale);
  a.k_scale = scalar(k_scale, "k_scale");
  a.v_scale = scalar(v_scale, "v_scale");
  a.causal = causal;
  a.sliding_window = sliding_window;
  a.logits_soft_cap = to_float(logits_soft_cap);
  const std::string error = ragged_paged_attention(a, torch_workers());
  TORCH_CHECK_VALUE(error.empty(), error);
}

void gather_split_blocks_op(const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_ids, at::Tensor keys, at::Tensor values) {
  TORCH_CHECK_VALUE(key_cache.dim() == 5 && value_cache.dim() == 4,
                    "key_cache must be [num_blocks, num_kv_heads, head_size / x, block_size, x] "
                    "and value_cache [num_blocks, num_kv_heads, head_size, block_size], got ",
                    key_cache.sizes(), " and ", value_cache.sizes());
  check_cpu_contiguous({{&key_cache, "key_cache"}, {&value_cache, "value_cache"},
                        {&block_ids, "block_ids"}, {&keys, "keys"}, {&values, "values"}});
  GatherArgs a;
  a.num_blocks = key_cache.size(0);
  a.num_kv_heads = key_cache.size(1);
  a.block_size = key_cache.size(3);
  a.elem_bytes = key_cache.element_size();
  a.head_size = key_cache.size(2) * split_x(key_cache);
  check_split_value_shape(value_cache, a.num_blocks, a.num_kv_heads, a.head_size, a.block_size);
  TORCH_CHECK_VALUE(block_ids.dim() == 1 && block_ids.scalar_type() == at::kLong,
                    "block_ids must be int64 [num_ids], got ", block_ids.scalar_type(), " ",
                    block_ids.sizes());
  a.num_ids = block_ids.size(0);
  for (const auto& [t, name] : std::initializer_list<Named>{{&keys, "keys"}, {&values, "values"}}) {
    TORCH_CHECK_VALUE(t->dim() == 4 && t->size(0) >= a.num_ids && t->size(1) == a.block_size &&
                          t->size(2) == a.num_kv_heads && t->size(3) == a.head_size,
                      name, " must be [at least num_ids=", a.num_ids, ", block_size=",
                      a.block_size, ", num_kv_heads=", a.num_kv_heads, ", head_size=",
                      a.head_size, "], got ", t->sizes());
  }
  for (const at::Tensor* t : {&value_cache, static_cast<const at::Tensor*>(&keys),
                              static_cast<const at::Tensor*>(&values)}) {
    TORCH_CHECK_VALUE(t->scalar_type() == key_cache.scalar_type(),
                      "both caches, keys and values must have one dtype (the cache's: fp8 as "
                      "uint8), got ", t->scalar_type(), " and ", key_cache.scalar_type());
  }
  for (const auto& [o, o_name] :
       std::initializer_list<Named>{{&keys, "keys"}, {&values, "values"}}) {
    for (const auto& [t, name] : std::initializer_list<Named>{
             {&key_cache, "key_cache"}, {&value_cache, "value_cache"}}) {
      TORCH_CHECK_VALUE(!shares_memory(*o, *t), o_name, " must not share memory with ", name);
    }
  }
  TORCH_CHECK_VALUE(!shares_memory(keys, values), "keys must not share memory with values");
  a.ids = block_ids.data_ptr<int64_t>();
  a.key_cache = key_cache.data_ptr();
  a.value_cache = value_cache.data_ptr();
  a.keys = keys.data_ptr();
  a.values = values.data_ptr();
  const std::string error = gather_split_blocks(a, torch_workers());
  TORCH_CHECK_VALUE(error.empty(), error);
}

// The two cache writes (store_split, store_token_major) share these: the rows' shapes, one
// dtype for all four tensors, and the slot mapping's check before the write itself.
void check_store_rows(const at::Tensor& key, const at::Tensor& value) {
  TORCH_CHECK_VALUE(key.dim() == 3, "key must be [num_tokens, num_kv_heads, head_size], got ",
                    key.sizes());
  TORCH_CHECK_VALUE(value.sizes() == key.sizes(), "value ", value.sizes(), " must match key ",
                    key.sizes());
}

void check_store_dtypes(const at::Tensor& key, const at::Tensor& value,
                        const at::Tensor& key_cache, const at::Tensor& value_cache) {
  for (const at::Tensor* t : {&key, &value, static_cast<const at::Tensor*>(&value_cache)}) {
    TORCH_CHECK_VALUE(t->scalar_type() == key_cache.scalar_type(),
                      "key, value and both caches must have one dtype (the cache's: fp8 as "
                      "uint8), got ", t->scalar_type(), " and ", key_cache.scalar_type());
  }
}

// a: everything but the pointers, filled in by the caller's own checks.
void run_store(StoreArgs& a, const at::Tensor& key, const at::Tensor& value,
               at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == a.num_tokens &&
                        slot_mapping.scalar_type() == at::kLong,
                    "slot_mapping must be int64 [num_tokens=", a.num_tokens, "], got ",
                    slot_mapping.scalar_type(), " ", slot_mapping.sizes());
  a.slots = slot_mapping.data_ptr<int64_t>();
  a.key = key.data_ptr();
  a.value = value.data_ptr();
  a.key_stride = token_stride(key, "key");
  a.value_stride = token_stride(value, "value");
  a.key_cache = key_cache.data_ptr();
  a.value_cache = value_cache.data_ptr();
  const std::string error = store_rows(a, torch_workers());
  TORCH_CHECK_VALUE(error.empty(), error);
}

void store_split(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache,
                 at::Tensor value_cache, const at::Tensor& slot_mapping) {
  check_store_rows(key, value);
  TORCH_CHECK_VALUE(key_cache.dim() == 5 && value_cache.dim() == 4,
                    "key_cache must be [num_blocks, num_kv_heads, head_size / x, block_size, x] "
                    "and value_cache [num_blocks, num_kv_heads, head_size, block_size], got ",
                    key_cache.sizes(), " and ", value_cache.sizes());
  check_cpu_contiguous({{&key_cache, "key_cache"}, {&value_cache, "value_cache"},
                        {&slot_mapping, "slot_mapping"}});
  token_stride(key, "key");  // the rows' layouts, checked before any write
  token_stride(value, "value");
  TORCH_CHECK_VALUE(!shares_memory(key_cache, value_cache),
                    "key_cache and value_cache must not share memory (each row would be "
                    "written over by the other cache's)");
  check_store_dtypes(key, value, key_cache, value_cache);
  StoreArgs a;
  a.layout = CacheLayout::kSplit;
  a.num_tokens = key.size(0);
  a.num_kv_heads = key.size(1);
  a.head_size = key.size(2);
  a.num_blocks = key_cache.size(0);
  a.block_size = key_cache.size(3);
  a.elem_bytes = key_cache.element_size();
  const std::vector<int64_t> key_shape{a.num_blocks, a.num_kv_heads,
                                       a.head_size * a.elem_bytes / 16, a.block_size,
                                       16 / a.elem_bytes};
  const std::vector<int64_t> value_shape{a.num_blocks, a.num_kv_heads, a.head_size,
                                         a.block_size};
  TORCH_CHECK_VALUE(key_cache.sizes() == at::IntArrayRef(key_shape) &&
                        value_cache.sizes() == at::IntArrayRef(value_shape),
                    "caches ", key_cache.sizes(), " and ", value_cache.sizes(),
                    " must be ", at::IntArrayRef(key_shape), " and ",
                    at::IntArrayRef(value_shape), " for rows ", key.sizes());
  run_store(a, key, value, key_cache, value_cache, slot_mapping);
}

void store_token_major(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache,
                       at::Tensor value_cache, const at::Tensor& slot_mapping) {
  check_store_rows(key, value);
  TORCH_CHECK_VALUE(key_cache.dim() == 4 && key_cache.size(2) == key.size(1) &&
                        key_cache.size(3) == key.size(2) &&
                        value_cache.sizes() == key_cache.sizes(),
                    "key_cache and value_cache must be [num_blocks, block_size, num_kv_heads=",
                    key.size(1), ", head_size=", key.size(2), "], got ", key_cache.sizes(),
                    " and ", value_cache.sizes());
  check_cpu_contiguous({{&slot_mapping, "slot_mapping"}});
  token_stride(key, "key");  // the rows' layouts, checked before any write
  token_stride(value, "value");
  const int64_t BS = key_cache.size(1), Hkv = key.size(1), D = key.size(2);
  const int64_t block_elems = BS * Hkv * D, num_blocks = key_cache.size(0);
  for (const auto& [t, name] : std::initializer_list<Named>{{&key_cache, "key_cache"},
                                                            {&value_cache, "value_cache"}}) {
    TORCH_CHECK_VALUE(t->device().is_cpu(), name, " must be a CPU tensor, got ", t->device());
    // Dense inside a block: [BS, Hkv, D] row-major (dimensions of size 1 take any stride).
    TORCH_CHECK_VALUE((D == 1 || t->stride(3) == 1) && (Hkv == 1 || t->stride(2) == D) &&
                          (BS == 1 || t->stride(1) == Hkv * D),
                      name, " must be dense inside a block ([block_size, num_kv_heads, "
                      "head_size] row-major), got strides ", t->strides());
  }
  // One block stride for both caches (a single block: the dense one).
  const int64_t stride = num_blocks > 1 ? key_cache.stride(0) : block_elems;
  TORCH_CHECK_VALUE(num_blocks <= 1 || value_cache.stride(0) == stride,
                    "key_cache and value_cache must have one block stride, got ",
                    key_cache.stride(0), " and ", value_cache.stride(0));
  TORCH_CHECK_VALUE(num_blocks <= 1 || block_elems == 0 || stride >= block_elems,
                    "key_cache's block stride ", stride, " must be at least block_size * "
                    "num_kv_heads * head_size = ", block_elems, " (blocks must not overlap)");
  check_store_dtypes(key, value, key_cache, value_cache);
  if (block_elems > 0 && num_blocks > 0) {
    // No key block may overlap a value block: |d + m * stride| >= block_elems for every block
    // distance m in (-NB, NB), d the value cache's offset from the key cache's (elements).
    // |d + m * stride| is V-shaped in m: its least value sits at the m nearest -d / stride.
    const int64_t elem = key_cache.element_size();
    const int64_t d = (reinterpret_cast<std::intptr_t>(value_cache.data_ptr()) -
                       reinterpret_cast<std::intptr_t>(key_cache.data_ptr()));
    TORCH_CHECK_VALUE(d % elem == 0, "value_cache must sit a whole number of elements from "
                      "key_cache");
    const int64_t de = d / elem;
    const int64_t floor_m = de >= 0 ? -((de + stride - 1) / stride) : (-de) / stride;
    bool overlap = false;
    for (int64_t m : {floor_m, floor_m + 1}) {
      m = std::min(std::max(m, -(num_blocks - 1)), num_blocks - 1);
      const int64_t gap = de + m * stride;
      overlap = overlap || (gap > -block_elems && gap < block_elems);
    }
    TORCH_CHECK_VALUE(!overlap, "key_cache and value_cache must not overlap (each row would "
                      "be written over by the other cache's)");
  }
  StoreArgs a;
  a.layout = CacheLayout::kTokenMajor;
  a.num_tokens = key.size(0);
  a.num_kv_heads = Hkv;
  a.head_size = D;
  a.num_blocks = num_blocks;
  a.block_size = BS;
  a.elem_bytes = key_cache.element_size();
  a.block_stride = stride;
  run_store(a, key, value, key_cache, value_cache, slot_mapping);
}

void copy_blocks_op(at::TensorList dst, at::TensorList src, const at::Tensor& block_pairs) {
  TORCH_CHECK_VALUE(dst.size() == src.size(), "dst and src must list as many caches, got ",
                    dst.size(), " and ", src.size());
  check_cpu_contiguous({{&block_pairs, "block_pairs"}});
  TORCH_CHECK_VALUE(block_pairs.dim() == 2 && block_pairs.size(1) == 2 &&
                        block_pairs.scalar_type() == at::kLong,
                    "block_pairs must be int64 [num_pairs, 2], got ", block_pairs.scalar_type(),
                    " ", block_pairs.sizes());
  std::vector<BlockCopy> copies(dst.size());
  for (size_t i = 0; i < dst.size(); ++i) {
    const at::Tensor &d = dst[i], &s = src[i];
    const std::string dst_name = "dst[" + std::to_string(i) + "]";
    const std::string src_name = "src[" + std::to_string(i) + "]";
    check_cpu_contiguous({{&d, dst_name.c_str()}, {&s, src_name.c_str()}});
    TORCH_CHECK_VALUE(d.dim() >= 2 && d.size(0) == 2 && s.dim() == d.dim() && s.size(0) == 2 &&
                          d.scalar_type() == s.scalar_type() &&
                          d.sizes().slice(2) == s.sizes().slice(2),
                      dst_name, " and ", src_name, " must be caches [2, num_blocks, ...] with "
                      "one block shape and dtype, got ", d.sizes(), " ", d.scalar_type(),
                      " and ", s.sizes(), " ", s.scalar_type());
    int64_t block_bytes = d.element_size();
    for (int64_t size : d.sizes().slice(2)) block_bytes *= size;
    copies[i].dst = static_cast<char*>(d.data_ptr());
    copies[i].src = static_cast<const char*>(s.data_ptr());
    copies[i].dst_blocks = d.size(1);
    copies[i].src_blocks = s.size(1);
    copies[i].block_bytes = block_bytes;
    copies[i].halves = 2;
  }
  const std::string error =
      copy_blocks(copies.data(), static_cast<int64_t>(copies.size()),
                  block_pairs.data_ptr<int64_t>(), block_pairs.size(0), torch_workers());
  TORCH_CHECK_VALUE(error.empty(), error);
}

}  // namespace
}  // namespace jax_attn_cpu

TORCH_LIBRARY(jax_attn, m) {
  m.def(
      "paged_decode_split(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor? alibi_slopes, float scale, "
      "Tensor k_scale, Tensor v_scale, int sliding_window, float logits_soft_cap, "
      "str kv_cache_dtype) -> ()");
  m.def(
      "ragged_paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, "
      "Tensor value_cache, Tensor query_start_loc, Tensor seq_lens, Tensor block_tables, "
      "Tensor num_seqs, Tensor? alibi_slopes, float scale, bool causal, int sliding_window, "
      "float logits_soft_cap, Tensor k_scale, Tensor v_scale, str kv_cache_dtype, "
      "Tensor? sinks=None) -> ()");
  m.def(
      "store_split(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
  m.def(
      "store_token_major(Tensor key, Tensor value, Tensor(a!) key_cache, "
      "Tensor(b!) value_cache, Tensor slot_mapping) -> ()");
  m.def("copy_blocks(Tensor(a!)[] dst, Tensor[] src, Tensor block_pairs) -> ()");
  m.def(
      "gather_split_blocks(Tensor key_cache, Tensor value_cache, Tensor block_ids, "
      "Tensor(a!) keys, Tensor(b!) values) -> ()");
}

TORCH_LIBRARY_IMPL(jax_attn, CPU, m) {
  m.impl("paged_decode_split", &jax_attn_cpu::paged_decode_split);
  m.impl("ragged_paged_attention", &jax_attn_cpu::ragged_paged_attention_op);
  m.impl("store_split", &jax_attn_cpu::store_split);
  m.impl("store_token_major", &jax_attn_cpu::store_token_major);
  m.impl("copy_blocks", &jax_attn_cpu::copy_blocks_op);
  m.impl("gather_split_blocks", &jax_attn_cpu::gather_split_blocks_op);
}

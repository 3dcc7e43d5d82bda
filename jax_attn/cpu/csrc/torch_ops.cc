// The torch side of the native CPU kernels: torch ops (namespace `jax_attn`) over the same
// kernels the XLA handlers run, on torch's intra-op threads (at::parallel_for), for
// torch_backends (torch_backends/native.py builds and loads this library; it registers the
// ops' fake kernels). Shapes and dtypes are checked here, values in the kernels; a bad
// argument raises ValueError naming it, before anything is read or written.
//
//   paged_decode_split(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache,
//       Tensor block_tables, Tensor seq_lens, Tensor? alibi_slopes, float scale,
//       Tensor k_scale, Tensor v_scale, int sliding_window, float logits_soft_cap,
//       str kv_cache_dtype) -> ()
//     vLLM's decode (`paged_attention_v1`) on its split cache layout: key [NB, Hkv, D/x, BS, x],
//     value [NB, Hkv, D, BS]; out [S, Hq, D] is written. fp8 caches are uint8 tensors holding
//     float8 bit patterns, named by kv_cache_dtype ("fp8" / "fp8_e4m3": e4m3fn, "fp8_e5m2").

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <atomic>
#include <string>

#include "paged_decode.h"

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
    at::parallel_for(0, count, 1, [&](int64_t, int64_t) {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) item(ctx, i);
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

void check_cpu_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
}

float scalar(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.numel() == 1, name, " must hold one value, got shape ", t.sizes());
  return t.item<float>();
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
  using Named = std::pair<const at::Tensor*, const char*>;
  for (const Named& t : {Named{&out, "out"}, Named{&query, "query"},
                         Named{&key_cache, "key_cache"}, Named{&value_cache, "value_cache"},
                         Named{&block_tables, "block_tables"}, Named{&seq_lens, "seq_lens"}}) {
    check_cpu_contiguous(*t.first, t.second);
  }
  DecodeArgs a;
  a.layout = CacheLayout::kSplit;
  a.num_seqs = query.size(0);
  a.num_heads = query.size(1);
  a.head_size = query.size(2);
  a.num_blocks = key_cache.size(0);
  a.num_kv_heads = key_cache.size(1);
  a.block_size = key_cache.size(3);
  const int64_t x = key_cache.size(4);
  TORCH_CHECK_VALUE(x * key_cache.element_size() == 16, "key_cache's last dimension x=", x,
                    " must hold 16 bytes (x = 16 / element size)");
  TORCH_CHECK_VALUE(key_cache.size(2) * x == a.head_size, "key_cache head_size=",
                    key_cache.size(2) * x, " must equal query head_size=", a.head_size);
  const std::vector<int64_t> value_shape{a.num_blocks, a.num_kv_heads, a.head_size,
                                         a.block_size};
  TORCH_CHECK_VALUE(value_cache.sizes() == at::IntArrayRef(value_shape), "value_cache ",
                    value_cache.sizes(), " must be [num_blocks, num_kv_heads, head_size, "
                    "block_size] = ", at::IntArrayRef(value_shape));
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
  if (alibi_slopes.has_value()) {
    const at::Tensor& s = *alibi_slopes;
    TORCH_CHECK_VALUE(s.dim() == 1 && s.size(0) == a.num_heads && s.scalar_type() == at::kFloat,
                      "alibi_slopes must be float32 [num_heads=", a.num_heads, "], got ",
                      s.scalar_type(), " ", s.sizes());
    check_cpu_contiguous(s, "alibi_slopes");
    a.alibi_slopes = s.data_ptr<float>();
  }
  a.query_type = query_dtype(query);
  a.cache_type = cache_dtype(key_cache, kv_cache_dtype);
  a.query = query.data_ptr();
  a.out = out.data_ptr();
  a.key_cache = key_cache.data_ptr();
  a.value_cache = value_cache.data_ptr();
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.seq_lens = seq_lens.data_ptr<int32_t>();
  a.scale = static_cast<float>(scale);
  a.k_scale = scalar(k_scale, "k_scale");
  a.v_scale = scalar(v_scale, "v_scale");
  a.sliding_window = sliding_window;
  a.logits_soft_cap = static_cast<float>(logits_soft_cap);
  const std::string error = paged_decode(a, torch_workers());
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
}

TORCH_LIBRARY_IMPL(jax_attn, CPU, m) {
  m.impl("paged_decode_split", &jax_attn_cpu::paged_decode_split);
}

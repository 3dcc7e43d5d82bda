// The XLA FFI handler of the paged decode kernel (paged_decode.cc): jax_attn.cpu.paged_decode.
// Caches in jax_attn's layout [NB, BS, Hkv, D]; the kernel runs on XLA's intra-op pool. Shapes
// and dtypes are checked here, values in the kernel; either failure is InvalidArgument, before
// anything is read or written.

#include <string>

#include "attention_common.h"
#include "paged_decode.h"

namespace jax_attn_cpu {
namespace {

std::string dims_str(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + (dims.size() == 1 ? ",)" : ")");
}

ffi::Error PagedDecode(ffi::ThreadPool pool, ffi::AnyBuffer query, ffi::AnyBuffer key_cache,
                       ffi::AnyBuffer value_cache, ffi::Buffer<ffi::S32> block_tables,
                       ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::F32> alibi_slopes,
                       ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::F32> k_scale,
                       ffi::Buffer<ffi::F32> v_scale,
                       ffi::Result<ffi::AnyBuffer> out, float scale, int64_t sliding_window,
                       float logits_soft_cap, int64_t split_tokens) {
  const auto qd = query.dimensions();
  const auto kd = key_cache.dimensions();
  if (qd.size() != 3) {
    return ffi::Error::InvalidArgument("query must be [num_seqs, num_heads, head_size], got " +
                                       dims_str(qd));
  }
  if (kd.size() != 4) {
    return ffi::Error::InvalidArgument(
        "key_cache must be [num_blocks, block_size, num_kv_heads, head_size], got " +
        dims_str(kd));
  }
  const auto vd = value_cache.dimensions();
  if (dims_str(vd) != dims_str(kd) || value_cache.element_type() != key_cache.element_type()) {
    return ffi::Error::InvalidArgument("value_cache must match key_cache: shape " +
                                       dims_str(vd) + " vs " + dims_str(kd));
  }
  DecodeArgs a;
  a.num_seqs = qd[0];
  a.num_heads = qd[1];
  a.head_size = qd[2];
  a.num_blocks = kd[0];
  a.block_size = kd[1];
  a.num_kv_heads = kd[2];
  if (kd[3] != a.head_size) {
    return ffi::Error::InvalidArgument("key_cache head_size=" + std::to_string(kd[3]) +
                                       " must equal query head_size=" +
                                       std::to_string(a.head_size));
  }
  const auto td = block_tables.dimensions();
  if (td.size() != 2 || td[0] != a.num_seqs) {
    return ffi::Error::InvalidArgument("block_tables must be [num_seqs, max_blocks], got " +
                                       dims_str(td));
  }
  a.max_blocks = td[1];
  if (seq_lens.element_count() != static_cast<size_t>(a.num_seqs)) {
    return ffi::Error::InvalidArgument("seq_lens must be [num_seqs], got " +
                                       dims_str(seq_lens.dimensions()));
  }
  const size_t num_slopes = alibi_slopes.element_count();
  if (num_slopes != 0 && num_slopes != static_cast<size_t>(a.num_heads)) {
    return ffi::Error::InvalidArgument("alibi_slopes must be [num_heads] or empty, got " +
                                       dims_str(alibi_slopes.dimensions()));
  }
  const size_t num_sinks = sinks.element_count();
  if (num_sinks != 0 && num_sinks != static_cast<size_t>(a.num_heads)) {
    return ffi::Error::InvalidArgument("sinks must be [num_heads] or empty, got " +
                                       dims_str(sinks.dimensions()));
  }
  if (k_scale.element_count() != 1 || v_scale.element_count() != 1) {
    return ffi::Error::InvalidArgument("k_scale and v_scale must be scalars");
  }
  if (out->element_type() != query.element_type() ||
      dims_str(out->dimensions()) != dims_str(qd)) {
    return ffi::Error::InvalidArgument("output must have the query's shape and dtype");
  }
  a.layout = CacheLayout::kTokenMajor;
  a.query_type = to_dtype(query.element_type());
  a.cache_type = to_dtype(key_cache.element_type());
  a.query = query.untyped_data();
  a.out = out->untyped_data();
  a.key_cache = key_cache.untyped_data();
  a.value_cache = value_cache.untyped_data();
  a.block_tables = block_tables.typed_data();
  a.seq_lens = seq_lens.typed_data();
  a.alibi_slopes = num_slopes ? alibi_slopes.typed_data() : nullptr;
  a.sinks = num_sinks ? sinks.typed_data() : nullptr;
  a.scale = scale;
  a.k_scale = k_scale.typed_data()[0];
  a.v_scale = v_scale.typed_data()[0];
  a.sliding_window = sliding_window;
  a.logits_soft_cap = logits_soft_cap;
  a.split_tokens = split_tokens;
  const std::string error = paged_decode(a, xla_workers(pool));
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_attn_cpu

// Arguments: query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes and sinks
// ([Hq], or [0] for none), k_scale, v_scale (f32 scalars); attributes: scale, sliding_window
// (0: none), logits_soft_cap (0: none), split_tokens (keys per split-K part; 0: automatic).
JAX_ATTN_EXPORT_HANDLER(jax_attn_cpu_paged_decode);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_attn_cpu_paged_decode, jax_attn_cpu::PagedDecode,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()  // query
                                  .Arg<xla::ffi::AnyBuffer>()  // key_cache
                                  .Arg<xla::ffi::AnyBuffer>()  // value_cache
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // block_tables
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // seq_lens
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // alibi_slopes
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // sinks
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // k_scale
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // v_scale
                                  .Ret<xla::ffi::AnyBuffer>()              // output
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("logits_soft_cap")
                                  .Attr<int64_t>("split_tokens"));

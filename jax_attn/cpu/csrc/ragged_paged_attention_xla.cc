// The XLA FFI handler of the ragged paged attention kernel (ragged_paged_attention.cc):
// jax_attn.cpu.ragged_paged_attention. Caches in jax_attn's layout [NB, BS, Hkv, D]; the kernel
// runs on XLA's intra-op pool. Shapes and element counts are checked here, sizes, dtypes and
// values in the kernel; either failure is InvalidArgument, before anything is read or written.

#include <string>

#include "attention_common.h"
#include "ragged_paged_attention.h"

namespace jax_attn_cpu {
namespace {

ffi::Error invalid(const std::string& message) { return ffi::Error::InvalidArgument(message); }

std::string str(int64_t x) { return std::to_string(x); }

bool supported_query(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

bool supported_cache(ffi::DataType t) {
  return supported_query(t) || t == ffi::DataType::F8E4M3FN || t == ffi::DataType::F8E5M2;
}

ffi::Error RaggedPagedAttention(ffi::ThreadPool pool, ffi::AnyBuffer query,
                                ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache,
                                ffi::Buffer<ffi::S32> query_start_loc,
                                ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> block_tables,
                                ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::F32> k_scale,
                                ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::F32> alibi_slopes,
                                ffi::Buffer<ffi::F32> sinks, ffi::Result<ffi::AnyBuffer> out,
                                float scale, int64_t causal, int64_t sliding_window,
                                float logits_soft_cap) {
  // Shapes and element counts first: the kernel reads no element of a buffer whose size was
  // not checked here. (Its own checks repeat the size and dtype rules for other callers; these
  // keep the handler's messages and their order.)
  const auto qd = query.dimensions();
  const auto kd = key_cache.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || !(value_cache.dimensions() == kd)) {
    return invalid("query must be [T, Hq, D] and key_cache/value_cache the same [NB, BS, Hkv, D]");
  }
  if (key_cache.element_type() != value_cache.element_type()) {
    return invalid("key_cache and value_cache must have the same dtype");
  }
  const int64_t T = qd[0], Hq = qd[1], D = qd[2];
  const int64_t NB = kd[0], BS = kd[1], Hkv = kd[2];
  const auto td = block_tables.dimensions();
  if (kd[3] != D || Hkv <= 0 || Hq % Hkv != 0 || td.size() != 2) {
    return invalid("shapes: query [T, Hq, D], caches [NB, BS, Hkv, D] with Hq % Hkv == 0, "
                   "block_tables [S, max_blocks]");
  }
  if (Hq < 1 || D < 1 || BS < 1) {
    return invalid("num_heads=" + str(Hq) + ", head_size=" + str(D) + " and block_size=" +
                   str(BS) + " must all be >= 1");
  }
  const int64_t S = td[0], MB = td[1];
  if (seq_lens.element_count() != static_cast<size_t>(S)) {
    return invalid("seq_lens must have num_seqs=" + str(S) + " entries (block_tables rows), got " +
                   str(static_cast<int64_t>(seq_lens.element_count())));
  }
  if (query_start_loc.element_count() != static_cast<size_t>(S + 1)) {
    return invalid("query_start_loc must have num_seqs + 1=" + str(S + 1) + " entries, got " +
                   str(static_cast<int64_t>(query_start_loc.element_count())));
  }
  if (num_seqs.element_count() != 1) {
    return invalid("num_seqs must be a scalar (1 element), got " +
                   str(static_cast<int64_t>(num_seqs.element_count())) + " elements");
  }
  if (k_scale.element_count() != 1 || v_scale.element_count() != 1) {
    return invalid("k_scale and v_scale must be scalars (1 element), got " +
                   str(static_cast<int64_t>(k_scale.element_count())) + " and " +
                   str(static_cast<int64_t>(v_scale.element_count())));
  }
  const size_t num_slopes = alibi_slopes.element_count();
  if (num_slopes != 0 && num_slopes != static_cast<size_t>(Hq)) {
    return invalid("alibi_slopes must have num_heads=" + str(Hq) + " entries, got " +
                   str(static_cast<int64_t>(num_slopes)));
  }
  const size_t num_sinks = sinks.element_count();
  if (num_sinks != 0 && num_sinks != static_cast<size_t>(Hq)) {
    return invalid("sinks must have num_heads=" + str(Hq) + " entries, got " +
                   str(static_cast<int64_t>(num_sinks)));
  }
  const ffi::DataType qt = query.element_type();
  if (!supported_query(qt)) {
    return invalid(std::string("query dtype ") + dtype_name(qt) +
                   " is not supported (float32, bfloat16, float16)");
  }
  if (!supported_cache(key_cache.element_type())) {
    return invalid(std::string("key_cache dtype ") + dtype_name(key_cache.element_type()) +
                   " is not supported (float32, bfloat16, float16, float8_e4m3fn, "
                   "float8_e5m2)");
  }
  if (out->element_type() != qt || !(out->dimensions() == qd)) {
    return invalid("the output must have the query's shape and dtype");
  }

  RaggedArgs a;
  a.num_tokens = T;
  a.num_heads = Hq;
  a.head_size = D;
  a.num_blocks = NB;
  a.block_size = BS;
  a.num_kv_heads = Hkv;
  a.seq_rows = S;
  a.max_blocks = MB;
  a.num_seqs = num_seqs.typed_data()[0];
  a.query_type = to_dtype(qt);
  a.cache_type = to_dtype(key_cache.element_type());
  a.query = query.untyped_data();
  a.out = out->untyped_data();
  a.key_cache = key_cache.untyped_data();
  a.value_cache = value_cache.untyped_data();
  a.query_start_loc = query_start_loc.typed_data();
  a.seq_lens = seq_lens.typed_data();
  a.block_tables = block_tables.typed_data();
  a.alibi_slopes = num_slopes ? alibi_slopes.typed_data() : nullptr;
  a.sinks = num_sinks ? sinks.typed_data() : nullptr;
  a.scale = scale;
  a.k_scale = k_scale.typed_data()[0];
  a.v_scale = v_scale.typed_data()[0];
  a.causal = causal != 0;
  a.sliding_window = sliding_window;
  a.logits_soft_cap = logits_soft_cap;
  const std::string error = ragged_paged_attention(a, xla_workers(pool));
  if (!error.empty()) return invalid(error);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_attn_cpu

// query [T, Hq, D], key_cache/value_cache [NB, BS, Hkv, D], query_start_loc i32[S + 1],
// seq_lens i32[S], block_tables i32[S, max_blocks], num_seqs i32[], k_scale f32[], v_scale f32[],
// alibi_slopes f32[Hq] or f32[0], sinks (attention sinks' logits) f32[Hq] or f32[0] -> out
// [T, Hq, D] in the query dtype; attributes: scale, causal (0 / 1), sliding_window (0: none),
// logits_soft_cap (0: none).
JAX_ATTN_EXPORT_HANDLER(jax_attn_cpu_ragged_paged_attention);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_attn_cpu_ragged_paged_attention,
                              jax_attn_cpu::RaggedPagedAttention,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()              // query
                                  .Arg<xla::ffi::AnyBuffer>()              // key_cache
                                  .Arg<xla::ffi::AnyBuffer>()              // value_cache
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // query_start_loc
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // seq_lens
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // block_tables
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // num_seqs
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // k_scale
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // v_scale
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // alibi_slopes
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // sinks
                                  .Ret<xla::ffi::AnyBuffer>()              // output
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("causal")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("logits_soft_cap"));

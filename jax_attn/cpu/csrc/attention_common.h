// The XLA side of the native CPU kernels: the FFI handlers' shared glue over kernel_common.h
// (XLA element types as `DType` and storage types, the export macro, and `Workers` on XLA's
// intra-op pool, `ffi::ThreadPool`, the calling thread working too).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>

#include "kernel_common.h"
#include "xla/ffi/api/ffi.h"

// The library is built with -fvisibility=hidden: a handler is exported by declaring it with
// this before XLA_FFI_DEFINE_HANDLER_SYMBOL defines it.
#define JAX_ATTN_EXPORT_HANDLER(fn) \
  extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* fn(XLA_FFI_CallFrame*)

namespace jax_attn_cpu {

namespace ffi = xla::ffi;

inline DType to_dtype(ffi::DataType dt) {
  switch (dt) {
    case ffi::DataType::F32: return DType::kF32;
    case ffi::DataType::BF16: return DType::kBF16;
    case ffi::DataType::F16: return DType::kF16;
    case ffi::DataType::F8E4M3FN: return DType::kF8E4M3FN;
    case ffi::DataType::F8E5M2: return DType::kF8E5M2;
    default: return DType::kOther;
  }
}

inline const char* dtype_name(ffi::DataType dt) { return dtype_name(to_dtype(dt)); }

// The storage type of an XLA element type (float, bf16_t, ...), for dispatch at the top.
template <ffi::DataType dt>
struct StorageOf;
template <>
struct StorageOf<ffi::DataType::F32> {
  using type = float;
};
template <>
struct StorageOf<ffi::DataType::BF16> {
  using type = bf16_t;
};
template <>
struct StorageOf<ffi::DataType::F16> {
  using type = f16_t;
};
template <>
struct StorageOf<ffi::DataType::F8E4M3FN> {
  using type = e4m3_t;
};
template <>
struct StorageOf<ffi::DataType::F8E5M2> {
  using type = e5m2_t;
};


// ---------------------------------------------------------------------------------------------
// Threads.
// ---------------------------------------------------------------------------------------------

// Workers to use: $JAX_ATTN_CPU_THREADS if set (>= 1), else the pool's threads (>= 1).
inline int64_t num_workers(ffi::ThreadPool& pool) { return worker_count(pool.num_threads()); }

// Run fn(i) for i in [0, n) on `workers` threads: the caller plus workers-1 tasks on XLA's
// pool, items handed out one at a time. Returns when every item is done. Tasks the pool starts
// late (or never) are harmless: they find no item left and touch nothing of the caller's, since
// the caller itself takes any item nobody else took (so no deadlock on a busy pool).
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, int64_t workers, F&& fn) {
  if (n <= 0) return;
  workers = std::min(workers, n);
  if (workers <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    int64_t n = 0;
    std::mutex mu;
    std::condition_variable cv;
    WorkerCpus cpus;
  };
  auto shared = std::make_shared<Shared>();
  shared->n = n;
  F* f = &fn;  // valid while items remain: the caller waits for all of them
  auto work = [shared, f]() {
    const int64_t finished = take_items(shared->next, shared->n, shared->cpus, *f);
    if (finished == 0) return;
    if (shared->done.fetch_add(finished, std::memory_order_acq_rel) + finished == shared->n) {
      std::lock_guard<std::mutex> lock(shared->mu);
      shared->cv.notify_all();
    }
  };
  for (int64_t t = 1; t < workers; ++t) pool.Schedule([work] { work(); });
  work();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load(std::memory_order_acquire) == n; });
}

// `Workers` over XLA's pool (valid while `pool` is).
inline Workers xla_workers(ffi::ThreadPool& pool) {
  Workers w;
  w.count = num_workers(pool);
  w.self = &pool;
  w.parallel_for = [](void* self, int64_t n, int64_t count, void (*item)(void*, int64_t),
                      void* ctx) {
    parallel_for(*static_cast<ffi::ThreadPool*>(self), n, count,
                 [item, ctx](int64_t i) { item(ctx, i); });
  };
  return w;
}

}  // namespace jax_attn_cpu

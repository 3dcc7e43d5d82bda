// The machine's streaming-read floor, as the attention kernels can reach it: every byte of the
// operands (a workload's K/V cache) read once, with the widest vector loads the build has, on
// the workers of XLA's intra-op pool (the kernels' own `parallel_for`, chunks handed out one at
// a time, so a worker that starts late still takes its share). Nothing is gathered or written:
// no attention step can read its cache faster. `jax-attn bench` reports each peer's bandwidth
// against it, beside XLA's jitted sum over the same arrays (which measures XLA, not the
// machine).
//
// So that the loads cannot be optimized away, the read returns a checksum: the wrapping sum
// (mod 2^64) of the operands' bytes taken as little-endian uint64 words, each operand's last
// partial word padded with zero bytes. One integer add per loaded vector: the loop stays bound
// by memory, and the result is exact, so a test can check that every byte was read.
//
// Output (uint32 [5]): the checksum's low and high 32 bits, workers, chunks (work items), and
// the vector width in bits.

#include <vector>

#include "attention_common.h"

#if !JAX_ATTN_AVX512 && defined(__AVX2__)
#include <immintrin.h>
#endif

namespace jax_attn_cpu {
namespace {

// A work item: one contiguous chunk of one operand. A multiple of every vector width, so each
// chunk starts on a word boundary of its operand; large enough that the hardware prefetcher
// streams it, small enough that a late worker still finds chunks left.
constexpr int64_t kChunkBytes = int64_t{512} << 10;

#if JAX_ATTN_AVX512
constexpr int kBits = 512;
#elif defined(__AVX2__)
constexpr int kBits = 256;
#else
constexpr int kBits = 64;
#endif

// The wrapping sum of the uint64 words of [p, p + n), the last partial word zero-padded.
uint64_t sum_words(const uint8_t* p, int64_t n) {
  uint64_t sum = 0;
  int64_t i = 0;
#if JAX_ATTN_AVX512
  // 4 x 64 bytes per step on 4 accumulators (the loads overlap; the adds never wait).
  __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                    _mm512_setzero_si512()};
  for (; i + 256 <= n; i += 256) {
    for (int k = 0; k < 4; ++k) {
      acc[k] = _mm512_add_epi64(acc[k], _mm512_loadu_si512(p + i + 64 * k));
    }
  }
  for (; i + 64 <= n; i += 64) acc[0] = _mm512_add_epi64(acc[0], _mm512_loadu_si512(p + i));
  const __m512i total =
      _mm512_add_epi64(_mm512_add_epi64(acc[0], acc[1]), _mm512_add_epi64(acc[2], acc[3]));
  uint64_t lanes[8];
  _mm512_storeu_si512(lanes, total);
  for (uint64_t lane : lanes) sum += lane;
#elif defined(__AVX2__)
  __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                    _mm256_setzero_si256()};
  for (; i + 128 <= n; i += 128) {
    for (int k = 0; k < 4; ++k) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32 * k));
      acc[k] = _mm256_add_epi64(acc[k], v);
    }
  }
  const __m256i total =
      _mm256_add_epi64(_mm256_add_epi64(acc[0], acc[1]), _mm256_add_epi64(acc[2], acc[3]));
  uint64_t lanes[4];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), total);
  for (uint64_t lane : lanes) sum += lane;
#endif
  for (; i + 8 <= n; i += 8) {
    uint64_t word;
    std::memcpy(&word, p + i, 8);  // memcpy: p + i need not be 8-byte aligned
    sum += word;
  }
  if (i < n) {
    uint64_t word = 0;  // little-endian: the tail's bytes are the word's low bytes
    std::memcpy(&word, p + i, static_cast<size_t>(n - i));
    sum += word;
  }
  return sum;
}

struct Chunk {
  const uint8_t* data;
  int64_t bytes;
};

ffi::Error ReadFloor(ffi::ThreadPool pool, ffi::RemainingArgs operands,
                     ffi::Result<ffi::BufferR1<ffi::U32>> out, int64_t threads) {
  if (out->element_count() != 5) {
    return ffi::Error::InvalidArgument("output must be uint32[5]");
  }
  if (threads < 0) {
    return ffi::Error::InvalidArgument("threads=" + std::to_string(threads) + " must be >= 0");
  }
  // operand k: bytes [0, size) in chunks of kChunkBytes, the last one shorter
  std::vector<Chunk> chunks;
  for (size_t k = 0; k < operands.size(); ++k) {
    ffi::ErrorOr<ffi::AnyBuffer> buffer = operands.get<ffi::AnyBuffer>(k);
    if (buffer.has_error()) return buffer.error();
    const auto* data = static_cast<const uint8_t*>(buffer->untyped_data());
    const auto size = static_cast<int64_t>(buffer->size_bytes());
    for (int64_t start = 0; start < size; start += kChunkBytes) {
      chunks.push_back({data + start, std::min(kChunkBytes, size - start)});
    }
  }
  const auto items = static_cast<int64_t>(chunks.size());
  const int64_t workers = std::max<int64_t>(
      1, std::min(threads > 0 ? threads : num_workers(pool), std::max<int64_t>(items, 1)));
  std::vector<uint64_t> sums(chunks.size(), 0);
  parallel_for(pool, items, workers,
               [&](int64_t i) { sums[i] = sum_words(chunks[i].data, chunks[i].bytes); });
  uint64_t total = 0;
  for (uint64_t s : sums) total += s;  // wraps mod 2^64, like the words' sum in any order
  uint32_t* o = out->typed_data();
  o[0] = static_cast<uint32_t>(total);
  o[1] = static_cast<uint32_t>(total >> 32);
  o[2] = static_cast<uint32_t>(workers);
  o[3] = static_cast<uint32_t>(items);
  o[4] = static_cast<uint32_t>(kBits);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_attn_cpu

// Operands: any number of arrays of any dtype (read as bytes); attribute: threads (0: as the
// kernels choose). Result: uint32 [5] (see the top).
JAX_ATTN_EXPORT_HANDLER(jax_attn_cpu_read_floor);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jax_attn_cpu_read_floor, jax_attn_cpu::ReadFloor,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .RemainingArgs()                           // operands
                                  .Ret<xla::ffi::BufferR1<xla::ffi::U32>>()  // output
                                  .Attr<int64_t>("threads"));

// The AMX inner products of the ragged kernel (ragged_paged_attention.cc): Intel's tile
// registers (AMX-TILE) and bf16 tile dot products (AMX-BF16, TDPBF16PS: a 16 x 32 bf16 tile
// times a 32 x 16 one into 16 x 16 float32, each product exact, sums in float32). The tiling,
// the online softmax and the scheduling stay in the kernel; this header holds what is
// AMX-specific: the tile state request, the tile configuration, the operand layouts the tiles
// read and the block product both products run on.
//
// Operands of one kv head and key step (row r = token x query head of the GQA group, n = key):
//   S^T[n][r] = sum_d K[n][d] Q[r][d]      A = keys   [16 n][32 d] bf16, rows Dk apart
//                                           B = Qt2    [16 d-pairs][16 r] (q[r][2i], q[r][2i+1])
//   O^T[d][r] += sum_n V[n][d] P[n][r]     A = values transposed, VT [16 d][32 n] bf16
//                                           B = Pp     [16 n-pairs][16 r] (p[2i][r], p[2i+1][r])
// Qt2 and Pp are exactly the layouts of the vdpbf16ps path (the softmax writes Pp), so the
// logits come out key-major (S^T, as the softmax reads them) and the output transposed (O^T:
// a row's rescale by its alpha is a vector multiply per d). Head sizes that are not a multiple
// of 32 are padded with zeros to Dk = round_up(D, 32) in every operand (never read from the
// cache: the padding is written, not loaded).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "kernel_common.h"

// JAX_ATTN_AMX: the tile paths are compiled in. Natively where the compiler targets AMX-TILE and
// AMX-BF16; emulated (JAX_ATTN_AMX_EMULATED) in a test build made with -DJAX_ATTN_AMX_EMULATE=1 on
// any AVX-512 BF16 CPU, where every tile instruction below is done in software on per-thread
// tile registers: the AMX paths' tiling, operand layouts and masking then run, under the
// correctness tests and the sanitizers, on CPUs without tiles (tests/jax/test_cpu_build.py).
#if JAX_ATTN_AVX512 && defined(JAX_ATTN_AMX_EMULATE) && defined(__AVX512BF16__)
#if JAX_ATTN_AMX_EMULATE
#define JAX_ATTN_AMX 1
#define JAX_ATTN_AMX_EMULATED 1
#endif
#endif
#if !defined(JAX_ATTN_AMX) && JAX_ATTN_AVX512 && defined(__AMX_TILE__) && \
    defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__x86_64__)
#define JAX_ATTN_AMX 1
#define JAX_ATTN_AMX_EMULATED 0
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if !defined(JAX_ATTN_AMX)
#define JAX_ATTN_AMX 0
#define JAX_ATTN_AMX_EMULATED 0
#endif

namespace jax_attn_cpu {

#if JAX_ATTN_AMX

struct alignas(64) TileConfig {
  uint8_t bytes[64];  // palette (byte 0), colsb[8] (uint16 at 16 + 2t), rows[8] (byte 48 + t)
};

#if JAX_ATTN_AMX_EMULATED

// $JAX_ATTN_CPU_AMX=0 turns the (emulated) tiles off as it does the real ones.
inline bool amx_available() {
  static const bool ok = [] {
    const char* env = std::getenv("JAX_ATTN_CPU_AMX");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }();
  return ok;
}

// The tile registers of the calling thread and their configuration, as the instructions define
// them: a load zeroes the bytes past a tile's configured rows and columns, a dot product writes
// only its destination's configured part, and an operand that does not fit the configuration
// (where the hardware faults) stops the process.
namespace amx_emulation {

struct Tiles {
  alignas(64) uint8_t data[8][16][64];
  uint8_t rows[8];
  uint16_t colsb[8];
};

inline Tiles& tiles() {
  thread_local Tiles t = {};
  return t;
}

inline void configure(const TileConfig& cfg) {  // LDTILECFG: the tiles start zeroed
  Tiles& t = tiles();
  for (int i = 0; i < 8; ++i) {
    std::memcpy(&t.colsb[i], cfg.bytes + 16 + 2 * i, sizeof(uint16_t));
    t.rows[i] = cfg.bytes[48 + i];
    if (t.rows[i] > 16 || t.colsb[i] > 64 || t.colsb[i] % 4 != 0) __builtin_trap();
  }
  std::memset(t.data, 0, sizeof(t.data));
}

inline void release() {  // TILERELEASE: back to the initial, unconfigured state
  Tiles& t = tiles();
  std::memset(&t, 0, sizeof(t));
}

inline void load(int i, const void* base, long stride) {
  Tiles& t = tiles();
  if (t.rows[i] == 0) __builtin_trap();
  std::memset(t.data[i], 0, sizeof(t.data[i]));
  for (int r = 0; r < t.rows[i]; ++r) {
    std::memcpy(t.data[i][r], static_cast<const uint8_t*>(base) + r * stride, t.colsb[i]);
  }
}

inline void store(int i, void* base, long stride) {
  const Tiles& t = tiles();
  if (t.rows[i] == 0) __builtin_trap();
  for (int r = 0; r < t.rows[i]; ++r) {
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, t.data[i][r], t.colsb[i]);
  }
}

inline void zero(int i) { std::memset(tiles().data[i], 0, sizeof(tiles().data[i])); }

// TDPBF16PS c, a, b: c[m][n] += a[m][2k] b[k][2n] + a[m][2k + 1] b[k][2n + 1] over k, in the
// order and rounding of vdpbf16ps (the instruction's own definition: float32 products of bf16,
// round to nearest even, denormals flushed), one vdpbf16ps per (m, k).
inline void dpbf16ps(int c, int a, int b) {
  Tiles& t = tiles();
  const int M = t.rows[c], N = t.colsb[c] / 4, K = t.colsb[a] / 4;
  if (M == 0 || t.rows[a] != M || t.rows[b] != K || t.colsb[b] != t.colsb[c]) __builtin_trap();
  const __mmask16 lanes = tail_mask(N);
  for (int m = 0; m < M; ++m) {
    __m512 acc = _mm512_maskz_loadu_ps(lanes, t.data[c][m]);
    for (int k = 0; k < K; ++k) {
      uint32_t pair;
      std::memcpy(&pair, t.data[a][m] + 4 * k, sizeof(pair));
      const __m512i bk = _mm512_maskz_loadu_epi32(lanes, t.data[b][k]);
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)),
                             (__m512bh)bk);
    }
    _mm512_storeu_ps(t.data[c][m], _mm512_maskz_mov_ps(lanes, acc));
  }
}

}  // namespace amx_emulation

inline void load_tile_config(const TileConfig& cfg) { amx_emulation::configure(cfg); }
#define JAX_ATTN_TILE_LOAD(tile, base, stride) \
  ::jax_attn_cpu::amx_emulation::load(tile, base, static_cast<long>(stride))
#define JAX_ATTN_TILE_STORE(tile, base, stride) \
  ::jax_attn_cpu::amx_emulation::store(tile, base, static_cast<long>(stride))
#define JAX_ATTN_TILE_ZERO(tile) ::jax_attn_cpu::amx_emulation::zero(tile)
#define JAX_ATTN_TILE_DPBF16PS(c, a, b) ::jax_attn_cpu::amx_emulation::dpbf16ps(c, a, b)
#define JAX_ATTN_TILE_RELEASE() ::jax_attn_cpu::amx_emulation::release()

#else  // the tiles themselves

// Whether this process may run tile instructions: the CPU has AMX-TILE and AMX-BF16 (CPUID
// leaf 7: EDX bits 24 and 22), Linux granted the tile data state (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; without it the first tile instruction raises
// SIGILL), and $JAX_ATTN_CPU_AMX is not "0". Asked once per process; the grant is
// process-wide, so every thread (XLA's pool, torch's) may then use the tiles.
inline bool amx_available() {
  static const bool ok = [] {
    const char* env = std::getenv("JAX_ATTN_CPU_AMX");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
    if ((d & (1u << 24)) == 0 || (d & (1u << 22)) == 0) return false;
    constexpr long kReqXcompPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kXtiledata = 18;         // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

// GCC 12's <amxtileintrin.h> tells the compiler that LDTILECFG reads 8 bytes and that
// TILELOADD reads no memory at all, so stores to a tile's source may be dropped as dead or moved
// past the load (seen: a tile configuration built on the stack, half of it never stored, and a
// #GP). These two say what the instructions read; every tile load here goes through them.
#define JAX_ATTN_TILE_LOAD(tile, base, stride)                                            \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #tile ::"r"((const void*)(base)),         \
                   "r"(static_cast<long>(stride))                                          \
                   : "memory")
// TILESTORED with the memory it writes declared (GCC 12's _tile_stored declares none, so reads
// of the destination may be moved before it).
#define JAX_ATTN_TILE_STORE(tile, base, stride)                                           \
  __asm__ volatile("tilestored %%tmm" #tile ", (%0,%1,1)" ::"r"((void*)(base)),            \
                   "r"(static_cast<long>(stride))                                          \
                   : "memory")
#define JAX_ATTN_TILE_ZERO(tile) _tile_zero(tile)
#define JAX_ATTN_TILE_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)
#define JAX_ATTN_TILE_RELEASE() _tile_release()
inline void load_tile_config(const TileConfig& cfg) {
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

#endif  // JAX_ATTN_AMX_EMULATED

// Eight tiles of 16 rows x 64 bytes (palette 1), loaded on construction and released on
// destruction (the tile state returns to its initial, cheap-to-switch form). One per item:
// other code on the thread (oneDNN, another library) may configure the tiles differently.
class TileScope {
 public:
  TileScope() {
    TileConfig cfg = {};
    cfg.bytes[0] = 1;  // palette
    for (int t = 0; t < 8; ++t) {
      cfg.bytes[16 + 2 * t] = 64;  // colsb[t] (little-endian uint16)
      cfg.bytes[48 + t] = 16;      // rows[t]
    }
    load_tile_config(cfg);
  }
  ~TileScope() { JAX_ATTN_TILE_RELEASE(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// Both products are one block product: C[16 MT][16 NT] (+)= A B over `chunks` chunks of 32
// bf16 (the K dimension: dims for q.k, keys for p.v). A: [16 MT][32 chunks] bf16 rows lda
// elements apart (chunk c at column 32 c); B: [16 chunks][16 NT] bf16 pairs, rows ldb words
// apart; C: float32 rows ldc apart, read first unless `zero` (the block starts from zeros).
//   q.k: A = keys (n0: K + n0 ldk), B = Qt2 + r0, C = S^T + n0 Mp + r0, zero
//   p.v: A = VT + d0 ldv, B = Pp + r0, C = O^T + d0 Mp + r0, zero on the item's first step
// Tiles: C 0-3 (A tile i, B tile j: 2i + j), A 4-5, B 6-7.
template <int MT, int NT>
inline void amx_block(const bf16_t* A, int64_t lda, const uint32_t* B, int64_t ldb,
                      int64_t chunks, float* C, int64_t ldc, bool zero) {
  static_assert(MT >= 1 && MT <= 2 && NT >= 1 && NT <= 2, "at most 2 x 2 C tiles");
  const int64_t ab = lda * 2, bb = ldb * 4, cb = ldc * 4;
  if (zero) {
    JAX_ATTN_TILE_ZERO(0);
    if constexpr (NT > 1) JAX_ATTN_TILE_ZERO(1);
    if constexpr (MT > 1) JAX_ATTN_TILE_ZERO(2);
    if constexpr (MT > 1 && NT > 1) JAX_ATTN_TILE_ZERO(3);
  } else {
    JAX_ATTN_TILE_LOAD(0, C, cb);
    if constexpr (NT > 1) JAX_ATTN_TILE_LOAD(1, C + 16, cb);
    if constexpr (MT > 1) JAX_ATTN_TILE_LOAD(2, C + 16 * ldc, cb);
    if constexpr (MT > 1 && NT > 1) JAX_ATTN_TILE_LOAD(3, C + 16 * ldc + 16, cb);
  }
  for (int64_t c = 0; c < chunks; ++c) {
    JAX_ATTN_TILE_LOAD(4, A + 32 * c, ab);
    if constexpr (MT > 1) JAX_ATTN_TILE_LOAD(5, A + 16 * lda + 32 * c, ab);
    const uint32_t* b = B + 16 * c * ldb;
    JAX_ATTN_TILE_LOAD(6, b, bb);
    if constexpr (NT > 1) JAX_ATTN_TILE_LOAD(7, b + 16, bb);
    JAX_ATTN_TILE_DPBF16PS(0, 4, 6);
    if constexpr (NT > 1) JAX_ATTN_TILE_DPBF16PS(1, 4, 7);
    if constexpr (MT > 1) JAX_ATTN_TILE_DPBF16PS(2, 5, 6);
    if constexpr (MT > 1 && NT > 1) JAX_ATTN_TILE_DPBF16PS(3, 5, 7);
  }
  JAX_ATTN_TILE_STORE(0, C, cb);
  if constexpr (NT > 1) JAX_ATTN_TILE_STORE(1, C + 16, cb);
  if constexpr (MT > 1) JAX_ATTN_TILE_STORE(2, C + 16 * ldc, cb);
  if constexpr (MT > 1 && NT > 1) JAX_ATTN_TILE_STORE(3, C + 16 * ldc + 16, cb);
}

// fn(std::integral_constant<int, mt>, std::integral_constant<int, nt>) for mt, nt in {1, 2}:
// the run-time tile counts of a block (a remainder of 16 rows, keys or dims) as template ones.
template <typename Fn>
inline void with_tiles(int mt, int nt, Fn&& fn) {
  using one = std::integral_constant<int, 1>;
  using two = std::integral_constant<int, 2>;
  if (mt == 2) {
    nt == 2 ? fn(two{}, two{}) : fn(two{}, one{});
  } else {
    nt == 2 ? fn(one{}, two{}) : fn(one{}, one{});
  }
}

// ---------------------------------------------------------------------------------------------
// Operand layouts (AVX-512): cache rows into the tiles' bf16 forms. fp8 codes are exact in
// bf16 (e4m3fn and e5m2 alike, NaN kept NaN), so an fp8 cache runs the same products.
// ---------------------------------------------------------------------------------------------

// 32 cache elements (lanes outside m: zeros) as bf16 bit patterns.
template <typename CT>
inline __m512i load32_bf16(const CT* src, __mmask32 m) {
  if constexpr (std::is_same_v<CT, bf16_t>) {
    return _mm512_maskz_loadu_epi16(m, src);
  } else {
    const __m512 lo = load16<CT>(src, static_cast<__mmask16>(m));
    const __m512 hi = load16<CT>(src + 16, static_cast<__mmask16>(m >> 16));
    const __m256i a = (__m256i)_mm512_cvtneps_pbh(lo);  // exact: every code is a bf16
    const __m256i b = (__m256i)_mm512_cvtneps_pbh(hi);
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
  }
}

inline __mmask32 mask32(int64_t n) {  // lanes [0, n) of 32
  return n >= 32 ? ~__mmask32{0} : (__mmask32{1} << n) - 1;
}

// Key rows into the A layout of amx_logits: dst[j][0, Dk) = row j's D elements, zeros past D;
// rows[j] == nullptr gives a zero row (a key past the step's last).
template <typename CT>
inline void pack_key_rows(const CT* const* rows, int64_t n, int64_t D, int64_t Dk,
                          bf16_t* __restrict dst) {
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t d = 0; d < Dk; d += 32) {
      const __m512i x =
          rows[j] != nullptr ? load32_bf16<CT>(rows[j] + d, mask32(D - d)) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + j * Dk + d, x);
    }
  }
}

// Value rows [0, 32) (rows[j] == nullptr: zeros) into the A layout of amx_values, transposed:
// dst[d][j] for d in [0, Dp) (zeros past D), rows ldv elements apart. Per 32 dims: the rows as
// 16 x 16 blocks of dim pairs, transposed (keys 0-15 and 16-31 apart), then each pair's even
// and odd dims gathered into rows 2i and 2i + 1.
template <typename CT>
inline void pack_value_columns(const CT* const* rows, int64_t D, int64_t Dp,
                               bf16_t* __restrict dst, int64_t ldv) {
  alignas(64) static const uint16_t kEven[32] = {0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20,
                                                 22, 24, 26, 28, 30, 32, 34, 36, 38, 40, 42,
                                                 44, 46, 48, 50, 52, 54, 56, 58, 60, 62};
  alignas(64) static const uint16_t kOdd[32] = {1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21,
                                                23, 25, 27, 29, 31, 33, 35, 37, 39, 41, 43,
                                                45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
  const __m512i even = _mm512_load_si512(kEven), odd = _mm512_load_si512(kOdd);
  for (int64_t d = 0; d < Dp; d += 32) {
    const __mmask32 m = mask32(D - d);
    __m512 lo[16], hi[16];  // keys 0-15, 16-31: lane i = dims (2i, 2i + 1) of [d, d + 32)
    for (int j = 0; j < 16; ++j) {
      lo[j] = _mm512_castsi512_ps(rows[j] ? load32_bf16<CT>(rows[j] + d, m)
                                          : _mm512_setzero_si512());
      hi[j] = _mm512_castsi512_ps(rows[16 + j] ? load32_bf16<CT>(rows[16 + j] + d, m)
                                               : _mm512_setzero_si512());
    }
    transpose16x16(lo);  // lo[i] lane j: dims (2i, 2i + 1) of key j
    transpose16x16(hi);
    for (int i = 0; i < 16 && d + 2 * i < Dp; ++i) {
      const __m512i a = _mm512_castps_si512(lo[i]), b = _mm512_castps_si512(hi[i]);
      _mm512_storeu_si512(dst + (d + 2 * i) * ldv, _mm512_permutex2var_epi16(a, even, b));
      _mm512_storeu_si512(dst + (d + 2 * i + 1) * ldv, _mm512_permutex2var_epi16(a, odd, b));
    }
  }
}

#else

inline bool amx_available() { return false; }

#endif  // JAX_ATTN_AMX

}  // namespace jax_attn_cpu

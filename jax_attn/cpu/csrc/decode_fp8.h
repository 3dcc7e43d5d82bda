// Part of the decode kernel (paged_decode.cc), not a header of its own: included by
// decode_kernel.h inside its namespaces and inside its `#if JAX_ATTN_AVX512`, right after
// decode_vec.h (it uses JAX_ATTN_DECODE_BF16_DOT and the kernel's TilePrefetcher). It includes
// nothing itself.
//
// The fp8 conversions of the vdpbf16ps path: fp8 codes (e4m3fn, e5m2) to bf16 by lookup tables
// (vpermi2b, AVX512_VBMI), 64 codes at a time. Defines JAX_ATTN_DECODE_FP8_DOT: 1 where
// JAX_ATTN_DECODE_BF16_DOT is 1 and the build has __AVX512VBMI__, and then compiles what
// follows; else 0.
// The interface the kernel calls: fp8_tables<F8> (once per item, kept in registers);
// convert_tile_fp8_bf16 and convert_value_pairs_fp8 (token-major keys, and values as the bf16
// pair tile of decode_vec.h's accumulate_pairs), split_keys_fp8_bf16, split_keys_fp8_pieces,
// split_value_pairs_fp8 and split_value_pairs_fp8_16 (the split layout's) from decode_item;
// convert_tile_fp8_bf16 and convert_pairs_fp8 in quad_pair_index's order from decode_quads.h's
// attend_tile_quads;
// fp8_to_bf16_64 and fp8_chunk_mask from decode_amx.h's decode_item_amx.
#pragma once

#if JAX_ATTN_DECODE_BF16_DOT && defined(__AVX512VBMI__)
#define JAX_ATTN_DECODE_FP8_DOT 1
// fp8 caches under bf16 queries: every fp8 value (e4m3fn, e5m2; NaN and inf included) is
// exact in bf16, so the keys go into the bf16 tile of the vdpbf16ps path and the values into
// the bf16 pair tile of accumulate_pairs, converted 64 at a time by table lookups (vpermi2b
// over the 128 magnitude codes, the sign ORed back) instead of 16 at a time through the fp16
// converter.
struct Fp8Tables {
  __m512i lo0, lo1, hi0, hi1;  // low / high byte of the bf16 pattern of codes 0..63, 64..127
  __m512i spread;              // kFp8Spread
};

// Byte order that makes the in-lane unpacks below produce codes in order: lane L (16 bytes)
// gets codes 8L..8L+7, then 32+8L..32+8L+7.
alignas(64) constexpr uint8_t kFp8Spread[64] = {
    0,  1,  2,  3,  4,  5,  6,  7,  32, 33, 34, 35, 36, 37, 38, 39,  //
    8,  9,  10, 11, 12, 13, 14, 15, 40, 41, 42, 43, 44, 45, 46, 47,  //
    16, 17, 18, 19, 20, 21, 22, 23, 48, 49, 50, 51, 52, 53, 54, 55,  //
    24, 25, 26, 27, 28, 29, 30, 31, 56, 57, 58, 59, 60, 61, 62, 63};

template <typename F8>
const Fp8Tables& fp8_tables() {
  static const Fp8Tables tables = [] {
    alignas(64) uint8_t lo[128], hi[128];
    for (int code = 0; code < 128; ++code) {
      const uint32_t bits = float_to_bits(widen(F8{static_cast<uint8_t>(code)}));
      lo[code] = static_cast<uint8_t>(bits >> 16);  // exact: the low 16 bits are zero
      hi[code] = static_cast<uint8_t>(bits >> 24);
    }
    return Fp8Tables{_mm512_load_si512(lo), _mm512_load_si512(lo + 64), _mm512_load_si512(hi),
                     _mm512_load_si512(hi + 64), _mm512_load_si512(kFp8Spread)};
  }();
  return tables;
}

// Bytes of the 128-byte table (t0: entries 0..63, t1: 64..127) at bits 0..6 of idx's bytes:
// VPERMI2B, which overwrites its index register. Written as an asm statement because for
// _mm512_permutex2var_epi8 GCC picks VPERMT2B, which overwrites a table register, and then
// reloads both tables from memory for every lookup (4 of the 6 loads per 64 codes in the
// decode's widening); a copy of the index costs a register move instead.
inline __m512i lookup_bytes128(__m512i idx, __m512i t0, __m512i t1) {
  __asm__("vpermi2b %2, %1, %0" : "+v"(idx) : "v"(t0), "v"(t1));
  return idx;
}

// The 64 fp8 codes at src (lanes outside m read nothing: zeros) as bf16 bit patterns, in
// order: out[0] codes 0..31, out[1] codes 32..63.
// `x`: 64 codes already in kFp8Spread order (x[i] = code kFp8Spread[i]).
// The loops below take a copy of the tables (a local that nothing aliases), so that they stay
// in registers across the loop's stores.
inline void fp8_spread_codes_to_bf16(__m512i x, const Fp8Tables& t, __m512i* out) {
  const __m512i lo = lookup_bytes128(x, t.lo0, t.lo1);  // index bits 0..6: magnitude
  const __m512i hi = _mm512_ternarylogic_epi32(lookup_bytes128(x, t.hi0, t.hi1), x,
                                               _mm512_set1_epi8(static_cast<char>(0x80)),
                                               0xF8);  // hi | (x & 0x80): the sign
  out[0] = _mm512_unpacklo_epi8(lo, hi);
  out[1] = _mm512_unpackhi_epi8(lo, hi);
}
inline void fp8_to_bf16_64(const uint8_t* src, __mmask64 m, const Fp8Tables& t, __m512i* out) {
  fp8_spread_codes_to_bf16(_mm512_permutexvar_epi8(t.spread, _mm512_maskz_loadu_epi8(m, src)), t,
                           out);
}
// The same without the kFp8Spread permute: 128-bit lane L of out[0] holds codes 16L .. 16L + 7,
// of out[1] codes 16L + 8 .. 16L + 15.
inline void fp8_lanes_to_bf16_64(const uint8_t* src, __mmask64 m, const Fp8Tables& t,
                                 __m512i* out) {
  fp8_spread_codes_to_bf16(_mm512_maskz_loadu_epi8(m, src), t, out);
}

inline __mmask64 fp8_chunk_mask(int64_t t, int64_t n, int64_t left) {
  if (t >= n || left <= 0) return 0;
  return left >= 64 ? ~static_cast<__mmask64>(0) : (static_cast<__mmask64>(1) << left) - 1;
}

// Walks one kv head's fp8 rows [0, n) of a tile, 64 codes at a time up to `row_elems` (rows
// >= n and codes past head_size: zeros); store(t, c, out) puts row t's codes c..c+63 (as
// bf16, out[0] and out[1]).
template <typename F8, int NC, typename Store>
inline void convert_tile_fp8(const Fp8Tables& shared_tables, const F8* src, int64_t row_stride,
                             int64_t n, int64_t head_size, int64_t row_elems, Store&& store) {
  const Fp8Tables tables = shared_tables;
  for (int64_t t = 0; t < 16; ++t) {
    const uint8_t* row = reinterpret_cast<const uint8_t*>(src + t * row_stride);
#pragma GCC unroll 4
    for (int64_t c = 0; c < row_elems; c += 64) {
      __m512i out[2];
      fp8_to_bf16_64(row + c, fp8_chunk_mask(t, n, head_size - c), tables, out);
      store(t, c, out);
    }
  }
}

// Keys: into the bf16 tile dst [16, NC2 * 32] of the vdpbf16ps path.
template <typename F8, int NC>
inline void convert_tile_fp8_bf16(const Fp8Tables& tables, const F8* src, int64_t row_stride,
                                  int64_t n, int64_t head_size, bf16_t* dst) {
  constexpr int64_t DP2 = (NC + 1) / 2 * 32;
  convert_tile_fp8<F8, NC>(tables, src, row_stride, n, head_size, DP2,
                           [dst](int64_t t, int64_t c, const __m512i* out) {
                             _mm512_store_si512(dst + t * DP2 + c, out[0]);
                             if (c + 32 < DP2) _mm512_store_si512(dst + t * DP2 + c + 32, out[1]);
                           });
}

// Byte indexes for one vpermt2b over a token pair's 64 + 64 codes (row a's, then row b's:
// index bit 6 picks b) that put each code where fp8_spread_codes_to_bf16 turns it into the bf16
// element wanted there: index[0] for the pair's first 32 dimensions of the 64, index[1] for the
// other 32. fp8_spread_codes_to_bf16 makes byte 16L + i of its input (lane L, i < 8) element
// 8L + i of out[0], and byte 16L + 8 + i element 8L + i of out[1].
struct PairIndex {
  __m512i index[2];
};

// A PairIndex from `source(half, j)`, the byte index for position j of index[half].
template <typename Source>
PairIndex make_pair_index(Source source) {
  alignas(64) uint8_t idx[128];
  for (int half = 0; half < 2; ++half) {
    for (int j = 0; j < 64; ++j) idx[64 * half + j] = static_cast<uint8_t>(source(half, j));
  }
  return PairIndex{{_mm512_load_si512(idx), _mm512_load_si512(idx + 64)}};
}

// accumulate_pairs' order: words (v[2k][d], v[2k + 1][d]) for d in order (the kFp8Spread
// order of the interleaved elements e: e even row a's code e / 2, odd row b's).
inline const PairIndex& natural_pair_index() {
  static const PairIndex index = make_pair_index([](int half, int j) {
    const int e = 64 * half + kFp8Spread[j];
    return (e % 2) * 64 + e / 2;
  });
  return index;
}

// decode_quads.h's order, what vpunpck{l,h}wd make of two bf16 rows: per 32 dimensions, out[0]
// lane L holds the pairs of dimensions 8L .. 8L + 3, out[1] those of 8L + 4 .. 8L + 7.
inline const PairIndex& quad_pair_index() {
  static const PairIndex index = make_pair_index([](int half, int j) {
    const int lane = j / 16, i = j % 8, second = j % 16 / 8;
    return (i % 2) * 64 + 32 * half + 8 * lane + 4 * second + i / 2;
  });
  return index;
}

// Values of one kv head's fp8 rows [0, n) of a tile as bf16 pairs of tokens (2k, 2k + 1): row
// k of dst (kRowWords words, zeros past n and past head_size) holds per 64 dimensions the 4
// vectors of words that `order` puts there; per token pair and 64 dimensions, the two rows'
// codes are interleaved by one vpermt2b per 32 and looked up as fp8_to_bf16_64 does, with no
// float32 or bf16 row tile between.
template <typename F8, int64_t kRowWords>
inline void convert_pairs_fp8(const Fp8Tables& shared_tables, const PairIndex& order,
                              const F8* src, int64_t row_stride, int64_t n, int64_t head_size,
                              uint32_t* dst) {
  const Fp8Tables tables = shared_tables;
  const __m512i idx0 = order.index[0], idx1 = order.index[1];
  for (int64_t k = 0; 2 * k < n; ++k) {
    const uint8_t* a = reinterpret_cast<const uint8_t*>(src + 2 * k * row_stride);
    const uint8_t* b = reinterpret_cast<const uint8_t*>(src + (2 * k + 1) * row_stride);
    uint32_t* row = dst + k * kRowWords;
#pragma GCC unroll 4
    for (int64_t c = 0; c < kRowWords; c += 64) {
      const __m512i x = _mm512_maskz_loadu_epi8(fp8_chunk_mask(2 * k, n, head_size - c), a + c);
      const __m512i y =
          _mm512_maskz_loadu_epi8(fp8_chunk_mask(2 * k + 1, n, head_size - c), b + c);
      __m512i out[2];
      fp8_spread_codes_to_bf16(_mm512_permutex2var_epi8(x, idx0, y), tables, out);
      _mm512_store_si512(row + c, out[0]);
      if (c + 16 < kRowWords) _mm512_store_si512(row + c + 16, out[1]);
      if (c + 32 < kRowWords) {
        fp8_spread_codes_to_bf16(_mm512_permutex2var_epi8(x, idx1, y), tables, out);
        _mm512_store_si512(row + c + 32, out[0]);
        if (c + 48 < kRowWords) _mm512_store_si512(row + c + 48, out[1]);
      }
    }
  }
}

// The pair tile of accumulate_pairs (dst [8][NC * 16] words (v[2k][d], v[2k + 1][d])).
template <typename F8, int NC>
inline void convert_value_pairs_fp8(const Fp8Tables& tables, const F8* src, int64_t row_stride,
                                    int64_t n, int64_t head_size, uint32_t* dst) {
  convert_pairs_fp8<F8, NC * 16>(tables, natural_pair_index(), src, row_stride, n, head_size,
                                 dst);
}

// Walks the split layout's fp8 keys of tokens [t0, t0 + n) of one head's block ([D / 16, BS,
// 16]): per 16-dim piece c, 4 tokens' codes (64 contiguous bytes) converted at once, tokens
// past n as zero codes; store(c, t, out) puts tokens t .. t + 3 of piece c (as bf16: out[0]
// tokens t, t + 1, out[1] tokens t + 2, t + 3, 16 elements each; kSpread false: lane L of
// out[0] token t + L's dims 0..7, of out[1] its dims 8..15). Requires D % 16 == 0.
template <typename F8, bool kSpread = true, typename Store>
inline void convert_split_keys_fp8(const Fp8Tables& shared_tables, const F8* src,
                                   int64_t block_size, int64_t t0, int64_t n, int64_t head_size,
                                   Store&& store) {
  const Fp8Tables tables = shared_tables;
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(src);
  for (int64_t c = 0; c < head_size / 16; ++c) {
    const uint8_t* piece = codes + c * block_size * 16 + t0 * 16;
#pragma GCC unroll 4
    for (int64_t t = 0; t < 16; t += 4) {
      __m512i out[2];
      if constexpr (kSpread) {
        fp8_to_bf16_64(piece + 16 * t, fp8_chunk_mask(t, n, 16 * (n - t)), tables, out);
      } else {
        fp8_lanes_to_bf16_64(piece + 16 * t, fp8_chunk_mask(t, n, 16 * (n - t)), tables, out);
      }
      store(c, t, out);
    }
  }
}

// Those keys into the bf16 tile dst [16, DP2] (token rows). Rows >= n get zeros; columns >= D
// are not written (the caller keeps them zero).
template <typename F8>
inline void split_keys_fp8_bf16(const Fp8Tables& tables, const F8* src, int64_t block_size,
                                int64_t t0, int64_t n, int64_t head_size, int64_t dp2,
                                bf16_t* dst) {
  convert_split_keys_fp8(
      tables, src, block_size, t0, n, head_size, [dst, dp2](int64_t c, int64_t t, __m512i* out) {
        bf16_t* row = dst + t * dp2 + 16 * c;
        _mm256_store_si256(reinterpret_cast<__m256i*>(row), _mm512_castsi512_si256(out[0]));
        _mm256_store_si256(reinterpret_cast<__m256i*>(row + dp2),
                           _mm512_extracti64x4_epi64(out[0], 1));
        _mm256_store_si256(reinterpret_cast<__m256i*>(row + 2 * dp2),
                           _mm512_castsi512_si256(out[1]));
        _mm256_store_si256(reinterpret_cast<__m256i*>(row + 3 * dp2),
                           _mm512_extracti64x4_epi64(out[1], 1));
      });
}

// Those keys as bf16 in the layout's own order, as the quads read them (decode_quads.h's
// SplitPieces): per 16-dim piece c and 4 tokens t .. t + 3, the 4 tokens' dims 0..7 at
// 256 c + 16 t, their dims 8..15 32 elements on; whole stores, no permutes. Tokens >= n get
// zeros.
template <typename F8>
inline void split_keys_fp8_pieces(const Fp8Tables& tables, const F8* src, int64_t block_size,
                                  int64_t t0, int64_t n, int64_t head_size, bf16_t* dst) {
  convert_split_keys_fp8<F8, false>(tables, src, block_size, t0, n, head_size,
                                    [dst](int64_t c, int64_t t, __m512i* out) {
                                      _mm512_store_si512(dst + 256 * c + 16 * t, out[0]);
                                      _mm512_store_si512(dst + 256 * c + 16 * t + 32, out[1]);
                                    });
}

// The split layout's fp8 values, up to 64 tokens of a head block ([D, BS]) at a time: dimension
// d's codes of tokens [t0, t0 + 64) are one 64-byte load, a dword of it 4 tokens. Per 16
// dimensions the 16 rows are a 16 x 16 transpose of dwords (unpacks by 32 and 64 bits in-lane,
// then 128-bit lanes), whose output q holds tokens 4q .. 4q + 3 of the 16 dimensions; its last
// step is one vpermi2b that also puts the bytes in kFp8Spread order for the conversion, so the
// converted halves are the pair vectors of tokens (4q, 4q + 1) and (4q + 2, 4q + 3)
// (accumulate_pairs). Per 1024 codes: 16 loads and 64 shuffles, against 64 masked 16-byte
// loads, 64 inserts, 32 vpermi2b and 16 blends a tile at a time before. TORCH_SDPA's e4m3
// decode at block 128, paired workers: 1.064x faster from memory, 1.082x from L2 (2-core
// Zen 4 VM; NOTES.md).
//
// After the in-lane unpacks, register X[g][s] holds in 128-bit lane L dims 4g .. 4g + 3 of
// tokens 4(4L + s) .. + 3; Y01 = lanes (0, 1) of X[0][s] and X[1][s], Y23 = the same of X[2][s],
// X[3][s] (lanes (2, 3): the other two outputs). Output 4L + s, lane g = X[g][s] lane L, taken
// from the 128 bytes (Y01 | Y23) by index[L % 2] (a PairIndex: two vpermi2b indexes).

// A byte index for 64 bytes in kFp8Spread order of 4 tokens x 16 dims: position i (code
// kFp8Spread[i] = 32 (u / 2) + 2e + u % 2) takes byte source(u, e), the one that holds token u's
// code of dim e.
template <typename Source>
__m512i spread_order_index(Source source) {
  alignas(64) uint8_t index[64];
  for (int i = 0; i < 64; ++i) {
    const int c = kFp8Spread[i];
    index[i] = static_cast<uint8_t>(source(2 * (c / 32) + c % 2, c % 32 / 2));
  }
  return _mm512_load_si512(index);
}

inline const PairIndex& split_value_index() {
  static const PairIndex value_index = [] {
    PairIndex s{};
    for (int odd = 0; odd < 2; ++odd) {
      // Lane g = e / 4 of the output: lane 2 (g % 2) + odd of Y01 (g < 2) or Y23.
      s.index[odd] = spread_order_index([odd](int u, int e) {
        return 64 * (e / 8) + 32 * (e / 4 % 2) + 16 * odd + 4 * (e % 4) + u;
      });
    }
    return s;
  }();
  return value_index;
}

// Values of tokens [t0, t0 + n), n <= 64, of one head's fp8 block `src` ([D, BS]) as the pair
// tile of accumulate_pairs: dst [32][NC * 16] words (v[2k][d], v[2k + 1][d]) in bf16, pair rows
// [0, ceil(n / 4) * 2) written (tokens >= n and columns >= D zeros), no float32 tile between.
// Only the n tokens' bytes are read.
template <typename F8, int NC>
inline void split_value_pairs_fp8(const Fp8Tables& shared_tables, const F8* src,
                                  int64_t block_size, int64_t t0, int64_t n, int64_t head_size,
                                  uint32_t* dst) {
  const Fp8Tables tables = shared_tables;
  constexpr int64_t DP = NC * 16;
  const PairIndex& index = split_value_index();
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(src) + t0;
  const __mmask64 m = n >= 64 ? ~__mmask64{0} : (__mmask64{1} << n) - 1;
  const int64_t groups = (n + 15) / 16;  // outputs 4L + s for L < groups
#pragma GCC unroll 1
  for (int j = 0; j < NC; ++j) {
    __m512i r[16];
#pragma GCC unroll 16
    for (int e = 0; e < 16; ++e) {
      const int64_t d = 16 * j + e;
      r[e] = d < head_size ? _mm512_maskz_loadu_epi8(m, codes + d * block_size)
                           : _mm512_setzero_si512();
    }
    __m512i x[4][4];  // x[g][s]
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      const __m512i a0 = _mm512_unpacklo_epi32(r[4 * g], r[4 * g + 1]);
      const __m512i a1 = _mm512_unpackhi_epi32(r[4 * g], r[4 * g + 1]);
      const __m512i b0 = _mm512_unpacklo_epi32(r[4 * g + 2], r[4 * g + 3]);
      const __m512i b1 = _mm512_unpackhi_epi32(r[4 * g + 2], r[4 * g + 3]);
      x[g][0] = _mm512_unpacklo_epi64(a0, b0);
      x[g][1] = _mm512_unpackhi_epi64(a0, b0);
      x[g][2] = _mm512_unpacklo_epi64(a1, b1);
      x[g][3] = _mm512_unpackhi_epi64(a1, b1);
    }
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {  // lanes (0, 1), then (2, 3)
        if (2 * half >= groups) break;
        // (Immediates in both branches: at -O1, in the sanitizer builds, this loop is not
        // unrolled.)
        const __m512i y01 = half == 0 ? _mm512_shuffle_i32x4(x[0][s], x[1][s], 0x44)
                                      : _mm512_shuffle_i32x4(x[0][s], x[1][s], 0xEE);
        const __m512i y23 = half == 0 ? _mm512_shuffle_i32x4(x[2][s], x[3][s], 0x44)
                                      : _mm512_shuffle_i32x4(x[2][s], x[3][s], 0xEE);
#pragma GCC unroll 2
        for (int odd = 0; odd < 2; ++odd) {
          const int64_t q = 4 * (2 * half + odd) + s;  // tokens 4q .. 4q + 3
          if (4 * q >= n) continue;
          __m512i out[2];
          fp8_spread_codes_to_bf16(_mm512_permutex2var_epi8(y01, index.index[odd], y23), tables,
                                   out);
          _mm512_store_si512(dst + 2 * q * DP + 16 * j, out[0]);
          _mm512_store_si512(dst + (2 * q + 1) * DP + 16 * j, out[1]);
        }
      }
    }
  }
}
// Blocks of 16 tokens: a head block's value rows (16 codes each) lie back to back, so one
// 64-byte load is dims 4q .. 4q + 3 of the tile, one 128-bit lane each, tokens in order (bytes
// past n and lanes past head_size masked to zeros). The 4 loads of 16 dims are then transposed
// as bytes into 4 registers of 4 tokens x 16 dims, in kFp8Spread order: register p, byte i =
// the code of token 4p + u, dim e, where kFp8Spread[i] = 32 (u / 2) + 2e + u % 2. Bytes of dims
// 0..7 come from loads 0 and 1, of dims 8..15 from 2 and 3, by one vpermi2b each with the same
// index (a pair of registers is one 128-byte table), then one blend: 4 loads and 12 shuffles a
// tile. The 64-token transpose above takes 16 loads and 44 shuffles for a tile of 16: with it
// TORCH_SDPA's e4m3 decode at block 16 ran 0.934x the speed of the tile-at-a-time inserts,
// with this 1.033x (paired workers, 2-core Zen 4 VM; NOTES.md).
struct Block16ValueShuffle {
  __m512i index[4];   // per p
  __mmask64 from_hi;  // bytes of dims 8..15
};

inline const Block16ValueShuffle& block16_value_shuffle() {
  static const Block16ValueShuffle shuffle = [] {
    Block16ValueShuffle s{};
    for (int p = 0; p < 4; ++p) {
      // Dim e sits in load e / 4, lane e % 4, at token 4p + u; the pair's second load from
      // byte 64.
      s.index[p] = spread_order_index(
          [p](int u, int e) { return (e / 4 % 2) * 64 + 16 * (e % 4) + 4 * p + u; });
    }
    for (int i = 0; i < 64; ++i) {
      if (kFp8Spread[i] % 32 >= 16) s.from_hi |= __mmask64{1} << i;  // dims 8..15
    }
    return s;
  }();
  return shuffle;
}

// split_value_pairs_fp8 for block_size 16: pair rows [0, ceil(n / 4) * 2) of dst [8][NC * 16].
template <typename F8, int NC>
inline void split_value_pairs_fp8_16(const Fp8Tables& shared_tables, const F8* src, int64_t t0,
                                     int64_t n, int64_t head_size, uint32_t* dst) {
  const Fp8Tables tables = shared_tables;
  constexpr int64_t DP = NC * 16;
  const Block16ValueShuffle& shuffle = block16_value_shuffle();
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(src) + t0;
  const __mmask64 tokens = static_cast<__mmask64>(tail_mask(n)) * 0x0001000100010001ull;
#pragma GCC unroll 1
  for (int j = 0; j < NC; ++j) {
    __m512i x[4];
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      const int64_t d = 16 * j + 4 * q, dims = std::min<int64_t>(4, head_size - d);
      const __mmask64 m = dims <= 0 ? 0 : dims >= 4 ? tokens : tokens & ((1ull << 16 * dims) - 1);
      x[q] = _mm512_maskz_loadu_epi8(m, codes + d * 16);
    }
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {  // tokens 4p .. 4p + 3: pairs 2p and 2p + 1
      if (4 * p >= n) break;
      const __m512i lo = _mm512_permutex2var_epi8(x[0], shuffle.index[p], x[1]);
      const __m512i hi = _mm512_permutex2var_epi8(x[2], shuffle.index[p], x[3]);
      __m512i out[2];
      fp8_spread_codes_to_bf16(_mm512_mask_blend_epi8(shuffle.from_hi, lo, hi), tables, out);
      _mm512_store_si512(dst + 2 * p * DP + 16 * j, out[0]);
      _mm512_store_si512(dst + (2 * p + 1) * DP + 16 * j, out[1]);
    }
  }
}
#else
#define JAX_ATTN_DECODE_FP8_DOT 0
#endif

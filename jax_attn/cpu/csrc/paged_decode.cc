// Paged decode on the CPU: one new query token per sequence against its paged KV cache.
//
// Semantics are jax_attn.paged_decode's (SPEC section 1): query [S, Hq, D] at position
// seq_len - 1 of each sequence, caches [NB, BS, Hkv, D] (jax_attn's) or vLLM's split layout
// (paged_decode.h), block_tables [S, max_blocks], seq_lens [S]; soft cap, ALiBi, sliding
// window; rows with seq_len 0 give zeros. Framework-free: paged_decode_xla.cc (XLA FFI) and
// torch_ops.cc (a torch op) call `paged_decode` with their own arrays and threads.
//
// Work split: an item is one sequence, or one part of a long sequence (split-K: the parts'
// online-softmax states are merged in float32 by whichever part finishes last); items go to
// the caller's `Workers` (XLA's intra-op pool, or torch's). Inside an item the kernel
// walks the sequence's blocks in table order, each block in tiles of up to 16 tokens. Logits
// of a tile come out as one 16-lane vector per query row (a transpose-and-add tree), so the
// online softmax (max, exp, sum) runs on whole vectors; values are accumulated for 4 query rows
// x 4 chunks per register block, so each value chunk is loaded (and widened) once per 4 rows.
// - Float32 and bf16 caches in jax_attn's token-major layout (attend_tile_rows): every kv head
//   of a tile at once, in address order, 4 tokens at a time: the 16 accumulators of a kv
//   head's 4 query rows x 4 tokens make one tree; keys and values are read in place and
//   widened in registers (bf16 queries on a bf16 cache, on CPUs with AVX512_BF16: keys dotted
//   as bf16 pairs by vdpbf16ps, half the instructions, and values taken in token pairs, two
//   rows interleaved by a permute into (v[t][d], v[t+1][d]) words for vdpbf16ps against the
//   probabilities rounded to bf16: accumulate_value_pairs; $JAX_ATTN_CPU_BF16_DOT=0 widens
//   both).
// - Other caches and vLLM's split layout (attend_tile): kv heads in turn; a head's 16 key rows
//   go once into an L1-resident tile (widened to float32: fp16 by the converter; bf16 pairs for
//   the vdpbf16ps path), which serves all G query rows of its GQA group. bf16 queries on an fp8
//   cache (AVX512_VBMI too) take the vdpbf16ps path: keys to bf16 by table lookups (vpermi2b),
//   64 codes at a time, every fp8 value being exact in bf16, and values to a bf16 pair tile
//   (token pairs interleaved by dim: accumulate_pairs), the same way; bf16 values of the split
//   layout, whose token pairs are already 32-bit words, go to that pair tile by a transpose.
//   The vdpbf16ps values took the bf16 decode's math from L2 from 2.57 to 1.93 ms and the fp8
//   decode's from 2.83 to 2.13 (32 x 1024 keys, block 128, 2-core Zen 5 VM; NOTES.md).
// - bf16 queries on a token-major bf16 or fp8 cache at block sizes that are multiples of 16,
//   on CPUs with AMX-BF16, for GQA groups of 5 rows or more (bf16 caches) or 4 or more (fp8):
//   both products on AMX tiles (decode_item_amx). Smaller groups fill too little of a tile, and
//   there the vector path below is faster (Sapphire Rapids VM, 32 x 1024 keys, block 128, ms,
//   tiles / vector: bf16 G 1 14.2 / 9.6, G 2 4.8 / 3.7, G 4 5.4-5.9 / 4.6-5.0, G 5 6.1 /
//   6.8-7.2, G 8 5.7-6.7 / 7.5-7.8, G 16 1.6 / 3.4; fp8 G 1 8.9 / 5.8, G 2 3.5 / 3.5, G 3
//   4.5 / 4.5, G 4 4.3 / 5.3; NOTES.md).
// - bf16 queries on vLLM's split layout, bf16 or fp8 cache, at blocks of 16, 32 or multiples
//   of 64, on CPUs with AMX-BF16, any group: decode_item_amx_split (decode_amx_split.h), both
//   products on tiles read from the cache as it lies (a head block's 8-dim key slices are
//   64-token tiles against a block-diagonal query tile; its [D][BS] values are the A operand
//   of O^T). Faster than the vector split path at every group (Sapphire Rapids VM, 32 x 1024
//   keys, block 128, ms, tiles / vector: bf16 G 1 11.6 / 12.3, G 2 4.4 / 5.9, G 4 4.3-4.8 /
//   6.2-7.6, G 8 6.1 / 11.1; fp8 G 4 4.7 / 5.6-6.0; NOTES.md).
// - Elsewhere (AVX512_BF16), bf16 queries on a token-major bf16 or fp8 cache with GQA groups of
//   4 rows or more and head sizes that are multiples of 8: the quads (attend_tile_quads), 4
//   query rows to a vector, one per 128-bit lane, so a key's 16-byte pieces are broadcast and
//   a (row, token) logit needs no 16-lane sum; a kv head at a time per tile. Math from L2
//   -17% at G = 4, decode from memory at G = 8 -15-23% (bf16) and -7-12% (fp8); at G = 4 from
//   memory within the VM's drift (NOTES.md). The split layout's fp8 keys, once widened into a
//   tile of token rows, take the quads' logits too (quad_head_logits; split fp8 decode from
//   memory -3-5%).
// Keys outside the visible range (past seq_len, before the sliding window) are never loaded:
// tiles cover only the visible range, rows of a tile's missing tokens are zeros (a zero row or
// the widened tile's zeroed rows) and their logits are masked, so NaN in unused cache memory
// cannot reach an output.
//
// Memory: while a tile is computed, later cache lines are prefetched, the requests spread over
// the tile's math (TilePrefetcher): on jax_attn's token-major cache the next tile's keys and
// values in address order (into L2 for float32, whose 128 KiB tile at Hkv 8 outgrows L1 beside
// the one being computed; PREFETCHNTA for the others: each line is read once, soon); on vLLM's
// split layout a head's whole block, kPrefetchTiles kv-head steps ahead for keys and twice as
// far for values (decode_item). Measured on the 2-core Zen 5 VM (B=32 ctx=1024 Hq=32 Hkv=8
// D=128 BS=16, NOTES.md), alternated rounds:
// - the token-major walk by kv head (a head's 16 rows Hkv * D elements apart, the same L1 sets)
//   against every head of 4 tokens at a time in address order (attend_tile_rows): decode-f32
//   7.1-7.3 ms vs 6.2-6.3, mixed 12.6-13.4 vs 11.5-11.8, 8 x 8192 f32 14.1-14.4 vs 11.1-13.5,
//   bf16 unchanged (3.4-3.6 vs 3.4-3.6), block size 8 f32 13.1-13.8 vs 7.3-7.5;
// - by kv head, before: NTA over T1 took decode-bf16 from 4.7-5.2 to 4.0-4.6 ms; the next tile
//   in address order over each head's own 16 strided rows (16 DRAM pages open at a time) from
//   4.4-4.8 to 3.9-4.0 (f32 8.5-8.8 to 7.7-8.5); a float32 next tile into L2 (T1) rather than
//   NTA: decode-f32 7.5-8.3 vs 7.7-8.3, 8 x 8192 f32 14.2-15.5 vs 14.0-18.9.
// Earlier, on the 2-core Zen 4 dev VM: one thread, f32, the math alone (cache in L2) ~10 ms,
// from DRAM 25 ms with the prefetches issued in one burst per tile (memory and math additive),
// 20 ms spread at each query row, 16-18 ms spread at each key chunk (the finer, the better the
// overlap). Every cache line must be requested (one request per 128 bytes ran as slowly as
// none).
//
// The split layout's tiles: a kv head's keys of one block are [D / x, BS, x], so a tile's
// key rows are gathered 16 bytes at a time (float32 and the bf16 dot path straight into the
// tile, others into a native-dtype copy that is then widened as above); its values [D, BS]
// are widened 16 tokens at a time and transposed 16 x 16 in registers into a float32 tile.
// The prefetcher requests a head's whole block (contiguous in this layout) ahead.
//
// Files: this one holds the checks, the work split and the dispatch (which item function runs);
// decode_kernel.h the item functions (the tiles' walk and prefetching, the online softmax) and
// the types the units share; decode_items_<dtype>.cc instantiate the vector kernel for one
// cache dtype each (units of their own: they compile in parallel, 114 s for the kernel as one
// unit on a Sapphire Rapids core). The instruction-set parts are parts of this kernel of their
// own, included by decode_kernel.h inside its namespaces: decode_vec.h (the AVX-512 tile
// helpers: widen_tile, the split layout's gather and transpose, accumulate_values; and the
// vdpbf16ps key dot dot_keys_bf16: AVX512_BF16, JAX_ATTN_DECODE_BF16_DOT), decode_fp8.h (fp8 to
// bf16 by table lookups for the vdpbf16ps path: AVX512_VBMI, JAX_ATTN_DECODE_FP8_DOT),
// decode_amx.h and decode_amx_split.h (the AMX decodes decode_item_amx and
// decode_item_amx_split: JAX_ATTN_AMX; instantiated in this unit), decode_quads.h (the quads,
// attend_tile_quads: JAX_ATTN_DECODE_BF16_DOT) and decode_split.h (vLLM's split layout at
// blocks of 128 or more, float32 and bf16 under vdpbf16ps: a head block per step, its values
// read per dimension as they lie instead of transposed into tiles; faster from L2, slower from
// memory, so only under $JAX_ATTN_CPU_SPLIT_LANES=1; NOTES.md).
//
// Bad input (block ids outside [0, NB) among the blocks a sequence reads, seq_len outside
// [0, max_blocks * BS], wrong sizes or dtypes) returns a message before anything is read or
// written.

#include "decode_kernel.h"

namespace jax_attn_cpu {
namespace {

ItemFn pick_item_fn(DType cache_type, DType query_type, int64_t head_size) {
  switch (cache_type) {
    case DType::kF32: return decode::item_fn_f32(head_size);
    case DType::kBF16: return decode::item_fn_bf16(query_type, head_size);
    case DType::kF16: return decode::item_fn_f16(head_size);
    case DType::kF8E4M3FN: return decode::item_fn_e4m3(query_type, head_size);
    case DType::kF8E5M2: return decode::item_fn_e5m2(query_type, head_size);
    default: return nullptr;
  }
}

}  // namespace

// $JAX_ATTN_CPU_DECODE_AMX (read at every call): "1" tiles at every group size (the AMX
// decodes' own tests), "0" never.
inline bool amx_decode_forced(const char* value) {
  const char* env = std::getenv("JAX_ATTN_CPU_DECODE_AMX");
  return env != nullptr && std::strcmp(env, value) == 0;
}

// The smallest GQA group (query rows per kv head) the token-major AMX decode takes on this
// cache dtype: where it beats the vector path (measured, see the top of this file).
inline int64_t amx_decode_min_group(DType cache_type) {
  if (amx_decode_forced("1")) return 1;
  return cache_type == DType::kBF16 ? 5 : 4;
}

bool decode_on_amx(CacheLayout layout, DType cache_type, DType query_type, int64_t block_size,
                   int64_t group) {
#if JAX_ATTN_AMX && JAX_ATTN_DECODE_BF16_DOT
  const bool cache_ok = cache_type == DType::kBF16 ||
                        (JAX_ATTN_DECODE_FP8_DOT &&
                         (cache_type == DType::kF8E4M3FN || cache_type == DType::kF8E5M2));
  if (layout == CacheLayout::kSplit) {
    return cache_ok && query_type == DType::kBF16 &&
           split_amx_block_ok(block_size) && !amx_decode_forced("0") && dot_enabled() &&
           amx_available();
  }
  return cache_ok && query_type == DType::kBF16 && block_size % 16 == 0 &&
         group >= amx_decode_min_group(cache_type) && !amx_decode_forced("0") && dot_enabled() &&
         amx_available();
#else
  (void)layout, (void)cache_type, (void)query_type, (void)block_size, (void)group;
  return false;
#endif
}

std::string paged_decode(const DecodeArgs& a, const Workers& workers) {
  const auto str = [](int64_t v) { return std::to_string(v); };
  if (a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads != 0) {
    return "num_heads=" + str(a.num_heads) + " must be divisible by num_kv_heads=" +
           str(a.num_kv_heads);
  }
  if (a.num_heads < 1 || a.block_size < 1) {
    return "num_heads=" + str(a.num_heads) + " and block_size=" + str(a.block_size) +
           " must be >= 1";
  }
  if (a.query_type != DType::kF32 && a.query_type != DType::kBF16 &&
      a.query_type != DType::kF16) {
    return std::string("query dtype ") + dtype_name(a.query_type) +
           " must be float32, bfloat16 or float16";
  }
  if (a.query_stride != 0 && a.query_stride < a.num_heads * a.head_size) {
    return "query's row stride=" + str(a.query_stride) +
           " must be 0 (dense) or at least num_heads * head_size=" +
           str(a.num_heads * a.head_size) + " elements";
  }
  ItemFn item_fn = pick_item_fn(a.cache_type, a.query_type, a.head_size);
#if JAX_ATTN_AMX && JAX_ATTN_DECODE_BF16_DOT
  if (item_fn != nullptr && decode_on_amx(a.layout, a.cache_type, a.query_type, a.block_size,
                                          a.num_heads / a.num_kv_heads)) {
    const bool split = a.layout == CacheLayout::kSplit;
    switch (a.cache_type) {
      case DType::kBF16:
        item_fn = split ? decode_item_amx_split<bf16_t> : decode_item_amx<bf16_t>;
        break;
#if JAX_ATTN_DECODE_FP8_DOT
      case DType::kF8E4M3FN:
        item_fn = split ? decode_item_amx_split<e4m3_t> : decode_item_amx<e4m3_t>;
        break;
      case DType::kF8E5M2:
        item_fn = split ? decode_item_amx_split<e5m2_t> : decode_item_amx<e5m2_t>;
        break;
#endif
      default: break;
    }
  }
#endif
  if (item_fn == nullptr) {
    return std::string("unsupported key_cache dtype ") + dtype_name(a.cache_type) +
           " or head_size=" + str(a.head_size) + " (1.." + str(kMaxDecodeHeadSize) + ")";
  }
  Problem p{};
  p.num_seqs = a.num_seqs;
  p.num_heads = a.num_heads;
  p.num_kv_heads = a.num_kv_heads;
  p.group = a.num_heads / a.num_kv_heads;
  p.head_size = a.head_size;
  p.num_blocks = a.num_blocks;
  p.block_size = a.block_size;
  p.max_blocks = a.max_blocks;
  p.layout = a.layout;
  p.x = 16 / element_bytes(a.cache_type);
  if (p.layout == CacheLayout::kSplit && p.head_size % p.x != 0) {
    return "head_size=" + str(p.head_size) + " must be a multiple of x=" + str(p.x) +
           " (16 bytes of " + dtype_name(a.cache_type) + ") in the split cache layout";
  }
  p.tables = a.block_tables;
  p.seq_lens = a.seq_lens;
  p.alibi = a.alibi_slopes;
  p.sinks = a.sinks;
  p.qk_scale = a.scale * a.k_scale;
  p.v_scale = a.v_scale;
  p.window = a.sliding_window;
  p.cap = a.logits_soft_cap;
  p.prefetch_tiles = kPrefetchTiles;
  if (const char* env = std::getenv("JAX_ATTN_CPU_PREFETCH")) p.prefetch_tiles = std::atol(env);
  p.nta_limit = nta_limit_bytes();
  if (const char* env = std::getenv("JAX_ATTN_CPU_NTA_LIMIT")) p.nta_limit = std::atol(env);
  p.quads = quads_enabled();
  p.split_lanes = split_lanes_enabled();
  p.query_type = a.query_type;
  p.query = a.query;
  p.query_stride = a.query_stride != 0 ? a.query_stride : a.num_heads * a.head_size;
  p.out = a.out;
  p.key_cache = a.key_cache;
  p.value_cache = a.value_cache;

  // Value checks, all before any read of the caches: lengths, then every block id read.
  const int64_t BS = p.block_size;
  std::vector<KeyRange> ranges(p.num_seqs);
  int64_t total_keys = 0;
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const int64_t len = p.seq_lens[s];
    if (len < 0 || len > p.max_blocks * BS) {
      return "seq_lens[" + str(s) + "]=" + str(len) +
             " must be in [0, max_blocks * block_size = " + str(p.max_blocks * BS) + "]";
    }
    ranges[s] = len > 0 ? visible_keys(len - 1, len, p.window) : KeyRange{0, 0};
    if (ranges[s].end <= ranges[s].begin) continue;
    for (int64_t b = ranges[s].begin / BS; b <= (ranges[s].end - 1) / BS; ++b) {
      const int32_t id = p.tables[s * p.max_blocks + b];
      if (id < 0 || id >= p.num_blocks) {
        return "block_tables[" + str(s) + ", " + str(b) + "]=" + str(id) +
               " must be in [0, num_blocks=" + str(p.num_blocks) +
               ") (the block holds keys of seq_lens[" + str(s) + "]=" + str(len) + ")";
      }
    }
    total_keys += ranges[s].end - ranges[s].begin;
  }

  // Items: each sequence, long ones in parts of whole blocks (split-K) so every worker has
  // several items; rows of empty sequences are zeros right away.
  // split_tokens may be any int64: at most the longest possible sequence, so the rounding
  // below cannot overflow.
  const int64_t part_keys =
      a.split_tokens > 0 ? std::min(a.split_tokens, p.max_blocks * BS + 1)
                         : std::max<int64_t>(512, total_keys / (4 * workers.count) + 1);
  const int64_t part_blocks = std::max<int64_t>(1, (part_keys + BS - 1) / BS);
  std::vector<Item> items;
  items.reserve(p.num_seqs);
  int64_t scratch_rows = 0;
  const int64_t DP = (p.head_size + 15) / 16 * 16;
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const KeyRange r = ranges[s];
    if (r.end <= r.begin) {
      const std::vector<float> zeros(p.head_size, 0.0f);
      for (int64_t h = 0; h < p.num_heads; ++h) store_output_row(p, s, h, zeros.data(), 0.0f);
      continue;
    }
    const int64_t first = r.begin / BS, last = (r.end - 1) / BS;
    const int64_t parts = (last - first + 1 + part_blocks - 1) / part_blocks;
    for (int64_t i = 0; i < parts; ++i) {
      const int64_t begin = std::max(r.begin, (first + i * part_blocks) * BS);
      const int64_t end = std::min(r.end, (first + (i + 1) * part_blocks) * BS);
      items.push_back(Item{s, i, parts, begin, end, scratch_rows});
    }
    if (parts > 1) scratch_rows += parts * p.num_heads;
  }
  std::vector<float> scratch(static_cast<size_t>(scratch_rows * (DP + 16)));
  std::unique_ptr<std::atomic<int32_t>[]> arrivals(new std::atomic<int32_t>[p.num_seqs]);
  for (int64_t s = 0; s < p.num_seqs; ++s) arrivals[s].store(0, std::memory_order_relaxed);
  run_items(workers, static_cast<int64_t>(items.size()),
            [&](int64_t i) { item_fn(p, items[i], scratch.data(), arrivals.get()); });
  return "";
}

}  // namespace jax_attn_cpu

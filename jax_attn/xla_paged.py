"""The XLA path of paged attention (`impl="xla"`): portable blockwise jnp.

It tiles the queries (each tile holds up to `tile_q` query rows of one sequence), then walks
each tile's keys block-chunk by block-chunk through its block table with an online softmax
(`_online_softmax`). Only the blocks a tile can see are read: causal tiles stop at their last
query's position, sliding-window tiles start at their first query's window.

    batch:   |<------ seq 0: prefill (7) ------>|<- seq 1: chunk (4) ->|s2|s3|pad|
    tiles (tile_q = 4):  [0 1 2 3] [4 5 6 .] [7 8 9 10] [11 . . .] [12 . . .]

The number of tiles is bounded statically by `(T + S * (tile_q - 1)) // tile_q`, so shapes only
depend on `T`, `S` and `max_blocks`, and a jitted step never recompiles when lengths change.

Three choices keep the CPU path near its measured best (NOTES.md has the figures):
- decode rows of a mixed batch get one-row tiles of their own (one pass for them, one for the
  rest), so a decode never pays for a `tile_q`-row tile;
- memory-bound (decode-like) steps gather at most `KV_CHUNK_BYTES` of keys and values per step,
  so the chunk stays in cache; compute-bound ones take `KV_CHUNK_TOKENS` per step;
- compute-bound steps sort their tiles by how many chunks they need and run `TILE_GROUPS`
  loops, so the first tiles of a causal prefill stop early instead of masking.

The tiling helpers (`tile_queries`, `key_range`, `num_chunks`) also serve `varlen.py`.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jax_attn import _online_softmax as online_softmax
from jax_attn.metadata import RaggedMetadata, sequence_of

# Keys per online-softmax step. Prefill-like tiles (many query rows per kv head) are
# compute-bound and want large products: KV_CHUNK_TOKENS. Decode-like tiles read each key for
# a handful of rows, so the step is memory-bound and fastest when the keys and values it
# gathers (float32, all tiles) stay in cache: at most KV_CHUNK_BYTES, at least one block.
# Measured on the 2-core AVX2 dev VM, decode B=32 ctx=1024 Hkv=8 D=128 float32, one process:
# 16-token chunks (4 MiB) 48 ms, 32: 72 ms, 64: 88 ms, 128: 114 ms; prefill 8x512 causal:
# 16-token chunks 2.2 s, 64: 0.98 s, 128: 1.08 s.
KV_CHUNK_TOKENS = 128
KV_CHUNK_BYTES = 4 << 20
# Query rows per kv head in a tile from which a step counts as compute-bound.
COMPUTE_BOUND_ROWS = 16
# Compute-bound steps run their tiles in this many loops, grouped by how many chunks they need.
TILE_GROUPS = 4


def chunk_blocks(
    num_tiles: int, rows_per_kv_head: int, num_kv_heads: int, head_size: int, block_size: int
) -> int:
    """Blocks per online-softmax step (static): see KV_CHUNK_TOKENS / KV_CHUNK_BYTES."""
    if rows_per_kv_head >= COMPUTE_BOUND_ROWS:
        tokens = KV_CHUNK_TOKENS
    else:
        per_token = num_tiles * num_kv_heads * head_size * 4 * 2  # gathered K and V, float32
        tokens = min(KV_CHUNK_TOKENS, KV_CHUNK_BYTES // per_token)
    return max(1, tokens // block_size)


def paged_attention_xla(
    query: Float[Array, "num_tokens num_heads head_size"],
    key_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    value_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    md: RaggedMetadata,
    *,
    scale: float,
    **bias,
) -> Float[Array, "num_tokens num_heads head_size"]:
    """`paged_attention` on the XLA path, arguments already checked; `bias` holds its causal /
    ALiBi / window / soft cap / k_scale / v_scale keywords, handed on to `_paged_tiles`."""
    num_tokens, num_seqs = query.shape[0], md.seq_lens.shape[0]
    if num_tokens == 0:  # a batch of empty sequences: nothing to gather from (static shape)
        return jnp.zeros(query.shape, query.dtype)
    real = jnp.arange(num_seqs, dtype=jnp.int32) < md.num_seqs
    q_lens = jnp.where(real, md.query_lens, 0)
    seq_lens = jnp.where(real, md.seq_lens, 0)
    tile_q = tile_size(num_tokens, num_seqs)
    if tile_q == 1:
        passes = [(q_lens, {})]
    else:
        # A tile of `tile_q` rows holding one decode row would compute `tile_q` rows for it:
        # decode rows get a pass of their own, one row per tile (at most one per sequence).
        decode = q_lens == 1
        passes = [
            (jnp.where(decode, 0, q_lens), {}),
            (jnp.where(decode, 1, 0), dict(tile_q=1, num_tiles=num_seqs)),
        ]
    # Every real token sits in exactly one tile of one pass; padding rows go to index T and
    # are dropped.
    result = jnp.zeros(query.shape, query.dtype)
    for pass_q_lens, shape in passes:
        tiles = tile_queries(md.query_start_loc, pass_q_lens, num_tokens, **shape)
        # Bottom-right aligned: query j of a sequence sits at seq_len - q_len + j.
        q_pos = (seq_lens - q_lens)[tiles.seq][:, None] + tiles.row  # [N, Q]
        q = query[jnp.minimum(tiles.token, num_tokens - 1)]  # [N, Q, Hq, D]
        out = _paged_tiles(
            q,
            q_pos,
            tiles.valid,
            tiles.seq,
            seq_lens,
            md.block_tables,
            key_cache,
            value_cache,
            scale=scale,
            **bias,
        )
        result = result.at[tiles.token].set(out.astype(query.dtype), mode="drop")
    return result


def paged_decode_xla(
    query: Float[Array, "num_seqs num_heads head_size"],
    key_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    value_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    block_tables: Int[Array, "num_seqs max_blocks"],
    seq_lens: Int[Array, " num_seqs"],
    *,
    scale: float,
    **bias,
) -> Float[Array, "num_seqs num_heads head_size"]:
    """`paged_decode` on the XLA path: one one-row tile per sequence, at `seq_len - 1`."""
    num_seqs = query.shape[0]
    if num_seqs == 0:  # an empty batch (static shape)
        return jnp.zeros(query.shape, query.dtype)
    seq_lens = seq_lens.astype(jnp.int32)
    q_valid = (seq_lens > 0)[:, None]  # [S, 1]: one query row per tile
    out = _paged_tiles(
        query[:, None],
        (seq_lens - 1)[:, None],
        q_valid,
        jnp.arange(num_seqs, dtype=jnp.int32),
        seq_lens,
        block_tables,
        key_cache,
        value_cache,
        scale=scale,
        causal=True,
        **bias,
    )
    return out[:, 0].astype(query.dtype)


def _gather_rows(flat_cache: Array, slot: Array) -> Array:
    """`flat_cache[slot]` as float32 `[N, Hkv, K, D]` (head-major), reading only those rows.

    The gather is vmapped over the kv head: it slices each row's heads whole (an offset
    dimension of the gather) instead of indexing them with an iota, so XLA's partitioner
    keeps a head-sharded cache on its own devices (with the iota index it all-reduced every
    gathered chunk). On CPU, XLA fuses the gather and the move of the head axis to second
    place into one loop that writes the head-major `[N, Hkv, K, D]` chunk the batched products
    want (same speed as the iota-indexed gather it replaces, NOTES.md).
    XLA on CPU has no native bf16/fp8 gather and would convert the whole cache to float32 to
    gather a chunk of it: gathering the same bits as unsigned integers reads just the chunk
    in its own width.
    """
    dtype = flat_cache.dtype
    if dtype != jnp.float32:
        flat_cache = jax.lax.bitcast_convert_type(
            flat_cache, jnp.dtype(f"uint{8 * dtype.itemsize}")
        )
    # per kv head: [NB*BS, D][N, K] -> [N, K, D]; batched over the head -> [N, Hkv, K, D]
    rows = jax.vmap(lambda cache: cache[slot], in_axes=1, out_axes=1)(flat_cache)
    if dtype == jnp.float32:
        return rows
    return jax.lax.bitcast_convert_type(rows, dtype).astype(jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _TileSet:
    """Per-tile inputs of one online-softmax loop (`[n, ...]` each)."""

    q: Array  # [n, tile_q, Hq, D] float32, scales folded in
    q_pos: Array  # [n, tile_q]
    q_valid: Array  # [n, tile_q]
    first_block: Array  # [n] first logical block the tile reads
    kv_len: Array  # [n]
    tables: Array  # [n, max_blocks]
    iters: Array  # [n] chunks the tile needs


def _key_chunk(
    tiles: _TileSet, it: Array, flat_k: Array, flat_v: Array, *, block_size: int, chunk: int
) -> online_softmax.KeyChunk:
    """Chunk `it` of every tile's keys, gathered through the tile's block table."""
    max_blocks = tiles.tables.shape[1]
    # Keys outside a sequence are read from its last key's slot instead: written data (when the
    # sequence has any key) whose weight is exactly 0, so no pass over the values is needed
    # to scrub NaN from unused memory. Not its first slot: under a sliding window the blocks
    # before the window may hold anything (vLLM V1 frees them and points their table entries
    # at its null block), and 0 x NaN would reach the output.
    last = jnp.maximum(tiles.kv_len - 1, 0)  # [n]
    last_block = jnp.take_along_axis(tiles.tables, (last // block_size)[:, None], axis=1)[:, 0]
    safe_slot = last_block * block_size + last % block_size  # [n]
    start = tiles.first_block * block_size
    pos = start[:, None] + it * chunk + jnp.arange(chunk, dtype=jnp.int32)[None, :]  # [n, K]
    valid = (pos >= 0) & (pos < tiles.kv_len[:, None])
    logical = jnp.clip(pos // block_size, 0, max_blocks - 1)
    physical = jnp.take_along_axis(tiles.tables, logical, axis=1)  # [n, K]
    slot = jnp.where(valid, physical * block_size + pos % block_size, safe_slot[:, None])
    return online_softmax.KeyChunk(
        key=_gather_rows(flat_k, slot),  # [n, Hkv, K, D] float32
        value=_gather_rows(flat_v, slot),
        pos=pos,
        valid=valid,
    )


def _paged_tiles(
    q,
    q_pos,
    q_valid,
    tile_seq,
    seq_lens,
    block_tables,
    key_cache,
    value_cache,
    *,
    scale,
    causal,
    alibi_slopes,
    sliding_window,
    logits_soft_cap,
    k_scale,
    v_scale,
    sinks=None,
):
    """Blockwise attention of query tiles against their sequences' paged keys; float32."""
    _, block_size, num_kv_heads, head_size = key_cache.shape
    num_tiles, tile_q, num_heads, _ = q.shape
    max_blocks = block_tables.shape[1]
    rows = tile_q * (num_heads // num_kv_heads)
    blocks = chunk_blocks(num_tiles, rows, num_kv_heads, head_size, block_size)
    chunk = min(blocks, max_blocks) * block_size

    kv_len = seq_lens[tile_seq]  # [N]
    lo, hi = key_range(q_pos, q_valid, kv_len, causal=causal, sliding_window=sliding_window)
    first_block = lo // block_size  # windows skip whole blocks before the first visible key
    iters = num_chunks(first_block * block_size, hi, chunk)
    tables = block_tables[tile_seq]  # [N, max_blocks]
    k_scale = jnp.asarray(k_scale, jnp.float32)
    v_scale = jnp.asarray(v_scale, jnp.float32)
    flat_k = key_cache.reshape(-1, num_kv_heads, head_size)  # [NB*BS, Hkv, D]: slot-major
    flat_v = value_cache.reshape(-1, num_kv_heads, head_size)

    def attend(tiles: _TileSet):
        queries = online_softmax.group_queries(
            tiles.q,
            tiles.q_pos,
            tiles.q_valid,
            num_kv_heads=num_kv_heads,
            alibi_slopes=alibi_slopes,
            alibi_from=online_softmax.alibi_origin(tiles.q_pos, tiles.kv_len, causal=causal),
        )

        def step(it, state):
            keys = _key_chunk(tiles, it, flat_k, flat_v, block_size=block_size, chunk=chunk)
            return online_softmax.update(
                state,
                queries,
                keys,
                causal=causal,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
            )

        state = online_softmax.initial_state(queries, tiles, flat_k, flat_v)
        # A while loop of as many steps as the tiles' longest need (not reverse-differentiable).
        state = jax.lax.fori_loop(0, tiles.iters.max(), step, state)
        return online_softmax.finish(state, sinks, queries)

    # logit = scale * q.(k * k_scale): fold both scales into the queries once.
    tiles = _TileSet(
        q=q.astype(jnp.float32) * (scale * k_scale),
        q_pos=q_pos,
        q_valid=q_valid,
        first_block=first_block,
        kv_len=kv_len,
        tables=tables,
        iters=iters,
    )
    groups = TILE_GROUPS if rows >= COMPUTE_BOUND_ROWS else 1
    groups = min(groups, num_tiles)
    if groups == 1:
        return attend(tiles) * v_scale
    # All tiles of one loop run as many chunks as its longest: causal prefill tiles need from
    # one chunk (the first queries) to all of them (the last). Sorted by their chunk count and
    # cut into groups, each with its own loop, the tiles skip most of the masked-out work.
    order = jnp.argsort(iters)
    by_work = jax.tree.map(lambda x: x[order], tiles)
    bounds = [num_tiles * g // groups for g in range(groups + 1)]
    out = jnp.concatenate(
        [
            attend(jax.tree.map(lambda x, a=a, b=b: x[a:b], by_work))
            for a, b in itertools.pairwise(bounds)
        ]
    )
    return out[jnp.argsort(order)] * v_scale


# Query tiles and key ranges, shared with `varlen.py`.


def key_range(
    q_pos: Int[Array, "num_tiles tile_q"],
    q_valid: Bool[Array, "num_tiles tile_q"],
    kv_len: Int[Array, " num_tiles"],
    *,
    causal: bool,
    sliding_window: int | None,
) -> tuple[Int[Array, " num_tiles"], Int[Array, " num_tiles"]]:
    """[lo, hi): the keys any valid row of each tile may see. Empty (lo >= hi) if none."""
    big = jnp.iinfo(jnp.int32).max
    first = jnp.where(q_valid, q_pos, big).min(axis=1)
    last = jnp.where(q_valid, q_pos, -1).max(axis=1)
    lo = jnp.zeros_like(kv_len)
    if sliding_window is not None:
        lo = jnp.maximum(lo, first - (sliding_window - 1))
    hi = jnp.minimum(kv_len, last + 1) if causal else kv_len
    # Tiles without a valid row read nothing (and must not overflow `first - window`).
    any_valid = q_valid.any(axis=1)
    return jnp.where(any_valid, lo, 0), jnp.where(any_valid, hi, 0)


def num_chunks(lo: Array, hi: Array, chunk: int) -> Array:
    """Chunks of `chunk` keys from `lo` (already aligned) to cover `[lo, hi)`; 0 if empty."""
    return jnp.where(hi > lo, (hi - lo + chunk - 1) // chunk, 0)


def tile_size(num_tokens: int, num_seqs: int) -> int:
    """Static query-tile height: about the mean query length, a power of two in [1, 64]."""
    mean = -(-num_tokens // max(num_seqs, 1))
    return min(64, 1 << max(mean - 1, 0).bit_length())


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Query rows grouped into tiles of `tile_q` rows of a single sequence each."""

    seq: Int[Array, " num_tiles"]  # the sequence of each tile
    row: Int[Array, "num_tiles tile_q"]  # each row's query index within its sequence
    valid: Bool[Array, "num_tiles tile_q"]  # a real query token
    token: Int[Array, "num_tiles tile_q"]  # its index in the batch; num_tokens if not valid


def tile_queries(
    q_starts: Array,
    q_lens: Array,
    num_tokens: int,
    *,
    tile_q: int | None = None,
    num_tiles: int | None = None,
) -> Tiles:
    """Cut each sequence's queries into tiles; shapes depend only on `T` and `S`.

    Example, tile_q 4, q_lens [7, 4, 1, 1]: tiles per sequence [2, 1, 1, 1], so
    tile_starts [0, 2, 3, 4, 5] and tile.seq [0, 0, 1, 2, 3, <padding tiles>...]. A sequence
    of q_len needs ceil(q_len / tile_q) tiles, so `(T + S * (tile_q - 1)) // tile_q` always
    suffice (the default `num_tiles`; a caller that bounds the tiles better may pass fewer).
    `tile_q` defaults to `tile_size(T, S)`.
    """
    num_seqs = q_lens.shape[0]
    tile_q = tile_size(num_tokens, num_seqs) if tile_q is None else tile_q
    if num_tiles is None:
        num_tiles = max((num_tokens + num_seqs * (tile_q - 1)) // tile_q, 1)
    tiles_per_seq = (q_lens + tile_q - 1) // tile_q  # [S]
    tile_starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(tiles_per_seq)])
    tile_ids = jnp.arange(num_tiles, dtype=jnp.int32)
    seq, real_tile = sequence_of(tile_starts, tile_ids)  # [N]
    tile_in_seq = tile_ids - tile_starts[seq]  # [N]
    row = tile_in_seq[:, None] * tile_q + jnp.arange(tile_q, dtype=jnp.int32)[None, :]  # [N, Q]
    valid = real_tile[:, None] & (row < q_lens[seq][:, None])
    token = jnp.where(valid, q_starts[seq][:, None] + row, num_tokens)
    return Tiles(seq=seq, row=row, valid=valid, token=token)

"""Ragged paged attention: decode, prefill and chunked prefill of many sequences in one launch.

Token order of a batch (query_start_loc = [0, 5, 6, 9, 10], num_seqs = 3, T = 12):

    |<- prefill_0 ->|d1|<- chunk_2 ->|pad pad pad|
     0  1  2  3  4   5   6  7  8      9 10 11

Design (Triton-backed Pallas on GPU; the same code runs on CPU with `interpret=True`):

- The wrapper cuts every sequence's queries into tiles of `block_q` tokens and lists the tiles
  of all sequences one after the other (`_tile_table`); the grid is
  `(cdiv(T, block_q) + S, num_kv_heads)`, an upper bound on the number of tiles, and spare
  programs find an empty tile and only write zeros.
  With block_q = 4 the batch above has tiles (seq 0, tokens 0-3), (seq 0, token 4),
  (seq 1, token 5), (seq 2, tokens 6-8).
- A program computes one tile against one kv head for all `G` query heads of that head's
  group: its `block_q * G_pad` rows (token-major) share every K/V tile it loads.
- Keys are visited in compute blocks of `block_k` keys (whole pages, or a part of one page
  when a page is larger than the tile budget), from the first block the sliding window
  reaches to the last key the tile's last query may see (bottom-right causal), so blocks
  wholly outside the window or above the diagonal are never loaded, nor any past the block
  table's end.
- Queries are read at any token offset (tiles need not be aligned), so the query is padded by
  `block_q` tokens; outputs are written per tile, never across a sequence boundary, and the
  wrapper gathers each token's row back, zeros for padding tokens.
- Unused memory never reaches the output: masked logits are replaced (not offset) by a
  finite mask value, their weights are exactly zero, and value rows past `seq_len` are zeroed
  before the second dot. Block ids past the sequence's last page read block 0, and every id is
  clamped into range.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int32

from jax_attn import shape_rules
from jax_attn._online_softmax import output_struct
from jax_attn.metadata import sequence_of
from jax_attn.pallas import _online_softmax as softmax

# Rows (query tokens x heads of a group) per program: a 128 x 64 logits tile is the usual
# Triton flash-attention shape on Hopper/Ampere for bf16 D <= 128. Larger heads and float32
# take fewer rows (`_max_rows`) and keys (`softmax.max_block_k`).
_TARGET_ROWS = 128
_TARGET_BLOCK_K = 64

# Columns of the per-tile table the wrapper hands the kernel (padded to 8, a power of two).
_SEQ, _Q_START, _NUM_TOKENS, _FIRST_POS, _SEQ_LEN = range(5)
_TILE_FIELDS = 8


def _window_start(first_pos, sliding_window):
    """The first key a tile's first query (at `first_pos`) may see under the window."""
    return 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)


def _key_block_range(
    first_pos, num_tokens, seq_len, *, block_k: int, causal: bool, sliding_window, kv_len=None
):
    """Compute blocks `[lo, hi)` holding the keys a tile may see: its queries sit at
    `first_pos .. first_pos + num_tokens - 1`; an empty tile visits none. Of the sequence's
    `seq_len` keys the first `kv_len` (default: all) are in its block table; none past the
    table's end is visited, whatever `seq_len` says.

    The range starts at the block holding the first query's window start, so blocks wholly
    outside the window are never loaded (not just masked), and a causal range ends at the block
    holding the last query's own key. Example: first_pos 100, 4 tokens, seq_len 120, causal,
    W 40, block_k 16: keys [61, 104) are visible, blocks [3, 7) are visited.
    """
    kv_len = seq_len if kv_len is None else kv_len
    last_pos = first_pos + num_tokens - 1
    kv_end = jnp.minimum(last_pos + 1, kv_len) if causal else kv_len
    lo = _window_start(first_pos, sliding_window) // block_k
    return lo, jnp.where(num_tokens > 0, pl.cdiv(kv_end, block_k), lo)


def _ragged_kernel(
    tile_ref,  # [8] int32: seq, q_start, num_tokens, first_pos, seq_len (see _tile_table)
    scales_ref,  # [2] float32: scale * k_scale, v_scale
    q_ref,  # [T + block_q, G_pad, D] this kv head's query heads, every token
    k_ref,  # [NB, BS, D] this kv head's key pages
    v_ref,  # [NB, BS, D]
    block_tables_ref,  # [S, max_blocks_padded]
    slopes_ref,  # [G_pad] ALiBi slopes, or None
    o_ref,  # [block_q, G_pad, D] this tile's output
    *,
    block_q: int,
    block_k: int,
    table_keys: int,
    chunk: int,
    causal: bool,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    compute_dtype,
):
    head_size = k_ref.shape[2]
    group_pad = q_ref.shape[1]
    rows = block_q * group_pad

    seq = tile_ref[_SEQ]
    q_start = tile_ref[_Q_START]
    num_tokens = tile_ref[_NUM_TOKENS]
    first_pos = tile_ref[_FIRST_POS]
    seq_len = tile_ref[_SEQ_LEN]
    logit_scale = scales_ref[0]
    v_scale = scales_ref[1]

    # Row r is token r // G_pad of the tile, query head r % G_pad of the group.
    token = jnp.arange(rows) // group_pad  # [rows]
    q_pos = first_pos + token
    row_valid = token < num_tokens

    # Keys past the table's end (`seq_len` too large for it) are never read, only skipped:
    # natively an unbounded table read would fault or read another sequence's row.
    kv_len = jnp.minimum(seq_len, table_keys)
    cb_lo, cb_hi = _key_block_range(
        first_pos,
        num_tokens,
        seq_len,
        block_k=block_k,
        causal=causal,
        sliding_window=sliding_window,
        kv_len=kv_len,
    )

    columns = [slice(c, c + chunk) for c in range(0, head_size, chunk)]
    # [block_q, G_pad, chunk] -> [rows, chunk], one per column chunk
    q = tuple(
        q_ref[pl.ds(q_start, block_q), :, cols].reshape(rows, chunk).astype(compute_dtype)
        for cols in columns
    )
    if slopes_ref is None:
        slopes = None
    else:
        # [G_pad] -> [block_q, G_pad] -> [rows]
        slopes = jnp.broadcast_to(slopes_ref[...][None, :], (block_q, group_pad)).reshape(rows)
        # Each row's bias is measured from the last key it sees (the spec's bias up to a
        # per-row constant, which the softmax cancels: jax_attn._online_softmax.alibi_origin).
        origin = q_pos if causal else jnp.broadcast_to(kv_len - 1, q_pos.shape)  # [rows]

    window_start = _window_start(first_pos, sliding_window)

    def table(start, size):
        return block_tables_ref[seq, pl.ds(start, size)]

    def body(cb, state):
        k, v, key_valid = softmax.load_kv(
            k_ref,
            v_ref,
            table,
            cb,
            block_k=block_k,
            kv_len=kv_len,
            chunk=chunk,
            dtype=compute_dtype,
        )
        key_pos = cb * block_k + jnp.arange(block_k)  # [block_k]
        # Value rows no row sees: unused slots, and a first block's keys before the window
        # (vLLM's engines free the pages wholly before it: they may hold anything).
        value_valid = key_valid & (key_pos >= window_start)
        valid = row_valid[:, None] & key_valid[None, :]  # [rows, block_k]
        if causal:
            valid = valid & (key_pos[None, :] <= q_pos[:, None])
        if sliding_window is not None:
            valid = valid & (q_pos[:, None] - key_pos[None, :] < sliding_window)
        bias = None
        if slopes is not None:
            rel = (key_pos[None, :] - origin[:, None]).astype(jnp.float32)
            bias = slopes[:, None] * rel  # [rows, block_k]
        return softmax.step(
            state,
            q,
            k,
            v,
            valid=valid,
            value_valid=value_valid,
            logit_scale=logit_scale,
            bias=bias,
            logits_soft_cap=logits_soft_cap,
        )

    state = softmax.initial_state(rows, head_size, chunk)
    o, _, row_sum = jax.lax.fori_loop(cb_lo, cb_hi, body, state)

    # Fully-masked rows (and rows of spare tiles) have row_sum == 0 and give zeros.
    has_keys = row_sum > 0
    safe_sum = jnp.where(has_keys, row_sum, 1.0)[:, None]
    for cols, o_c in zip(columns, o, strict=True):
        out = jnp.where(has_keys[:, None], o_c / safe_sum * v_scale, 0.0)
        # [rows, chunk] -> [block_q, G_pad, chunk]
        o_ref[:, :, cols] = out.reshape(block_q, group_pad, chunk).astype(o_ref.dtype)


def _tile_table(query_start_loc, seq_lens, num_seqs, *, num_tiles: int, block_q: int):
    """Which sequence and tokens each program handles: i32[num_tiles, 8] plus the per-sequence
    first tile `cu_tiles` i32[S+1].

    Example (block_q = 4, query_start_loc = [0, 5, 6, 9], seq_lens = [5, 12, 7]):
    tiles per sequence [2, 1, 1], cu_tiles [0, 2, 3, 4]; tile 1 is seq 0, q_start 4,
    num_tokens 1, first_pos 4; tile 2 is seq 1, q_start 5, num_tokens 1, first_pos 11.
    """
    max_seqs = seq_lens.shape[0]
    real = jnp.arange(max_seqs) < num_seqs
    q_lens = jnp.where(real, query_start_loc[1:] - query_start_loc[:-1], 0)
    tiles_per_seq = pl.cdiv(q_lens, block_q)
    cu_tiles = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(tiles_per_seq)])
    cu_tiles = cu_tiles.astype(jnp.int32)

    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    seq, tile_valid = sequence_of(cu_tiles, tile)
    tok0 = (tile - cu_tiles[seq]) * block_q
    q_len = q_lens[seq]
    num_tokens = jnp.where(tile_valid, jnp.clip(q_len - tok0, 0, block_q), 0)
    q_start = jnp.where(tile_valid, query_start_loc[seq] + tok0, 0)
    seq_len = jnp.where(tile_valid, seq_lens[seq], 0)
    first_pos = seq_len - q_len + tok0
    zeros = jnp.zeros_like(seq)
    fields = [seq, q_start, num_tokens, first_pos, seq_len]
    fields += [zeros] * (_TILE_FIELDS - len(fields))
    return jnp.stack(fields, axis=1), cu_tiles  # [num_tiles, 8], [S+1]


def _ragged_pallas(
    query,
    key_cache,
    value_cache,
    query_start_loc,
    seq_lens,
    block_tables,
    num_seqs,
    alibi_slopes,
    scales,
    *,
    causal,
    sliding_window,
    logits_soft_cap,
    block_q,
    block_k,
    interpret,
):
    num_tokens, num_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    max_seqs = block_tables.shape[0]
    group = num_heads // num_kv_heads
    group_pad = softmax.next_pow2(group)
    dtype = softmax.compute_dtype(query.dtype, key_cache.dtype)
    num_tiles = pl.cdiv(num_tokens, block_q) + max_seqs

    tiles, cu_tiles = _tile_table(
        query_start_loc, seq_lens, num_seqs, num_tiles=num_tiles, block_q=block_q
    )

    # [T, Hq, D] -> [T, Hkv, G, D] -> [T + block_q, Hkv, G_pad, D]: a tile starting at any
    # token may read block_q tokens without running off the end.
    q = query.astype(dtype).reshape(num_tokens, num_kv_heads, group, head_size)
    q = jnp.pad(q, ((0, block_q), (0, 0), (0, group_pad - group), (0, 0)))

    tables = softmax.pad_tables(block_tables, block_k, block_size)
    max_blocks_pad = tables.shape[1]

    if alibi_slopes is None:
        slopes, slopes_spec = None, None
    else:
        slopes = softmax.group_slopes(alibi_slopes, num_kv_heads, group_pad)  # [Hkv, G_pad]
        slopes_spec = pl.BlockSpec((None, group_pad), lambda t, h: (h, 0))

    kernel = functools.partial(
        _ragged_kernel,
        block_q=block_q,
        block_k=block_k,
        table_keys=block_tables.shape[1] * block_size,
        chunk=softmax.head_chunk(head_size, dtype),
        causal=causal,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        compute_dtype=dtype,
    )
    cache_spec = pl.BlockSpec((num_blocks, block_size, None, head_size), lambda t, h: (0, 0, h, 0))
    num_warps = _num_warps(block_q * group_pad, block_k, head_size, dtype)
    operands = (tiles, scales, q, key_cache, value_cache, tables, slopes)
    out_tiles = pl.pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads),
        in_specs=[
            pl.BlockSpec((None, _TILE_FIELDS), lambda t, h: (t, 0)),
            pl.BlockSpec((2,), lambda t, h: (0,)),
            pl.BlockSpec(
                (num_tokens + block_q, None, group_pad, head_size), lambda t, h: (0, h, 0, 0)
            ),
            cache_spec,
            cache_spec,
            pl.BlockSpec((max_seqs, max_blocks_pad), lambda t, h: (0, 0)),
            slopes_spec,
        ],
        out_specs=pl.BlockSpec(
            (None, block_q, None, group_pad, head_size), lambda t, h: (t, 0, h, 0, 0)
        ),
        out_shape=output_struct(
            (num_tiles, block_q, num_kv_heads, group_pad, head_size), query.dtype, *operands
        ),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        name="ragged_paged_attention",
    )(*operands)

    # Token i of sequence s is row (i - qsl[s]) % block_q of tile cu_tiles[s] + (...) // block_q.
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq, is_real = sequence_of(query_start_loc, token, num_seqs=num_seqs)
    local = token - query_start_loc[seq]
    tile = jnp.clip(cu_tiles[seq] + local // block_q, 0, num_tiles - 1)
    # [num_tiles, block_q, Hkv, G_pad, D][T], [T] -> [T, Hkv, G_pad, D]
    out = out_tiles[tile, local % block_q]
    out = jnp.where(is_real[:, None, None, None], out, jnp.zeros_like(out))
    # [T, Hkv, G_pad, D] -> [T, Hkv, G, D] -> [T, Hq, D]
    return out[:, :, :group].reshape(num_tokens, num_heads, head_size)


def _num_warps(rows: int, block_k: int, head_size: int, dtype) -> int:
    """Warps per program: 8 for float32 (FMA dots hold their operands in registers) and for
    large tiles, else 4 (measured with `gpu_compile`: 4 warps on a 128 x 64 bf16 tile sit at
    255 registers on sm_90, 8 take 155)."""
    if jnp.dtype(dtype) == jnp.float32 or rows * max(head_size, block_k) >= 128 * 64:
        return 8
    return 4


def _max_rows(head_size: int, dtype) -> int:
    """Query rows per program: 128 for 16-bit heads up to 128, 32 for larger heads and for
    float32, whose dots keep more in registers (64 rows of a D=256 bf16 head sit at 255
    registers on sm_90, 32 take 163)."""
    if jnp.dtype(dtype) == jnp.float32 or head_size > 128:
        return 32
    return _TARGET_ROWS


def _default_block_q(group_pad: int, head_size: int, dtype) -> int:
    rows = _max_rows(head_size, dtype)
    # At least 16 rows per program: Triton's dot needs them.
    return max(1, rows // group_pad, pl.cdiv(shape_rules.MIN_DOT, group_pad))


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "causal",
        "sliding_window",
        "logits_soft_cap",
        "block_q",
        "pages_per_compute_block",
        "interpret",
    ),
)
def ragged_paged_attention(
    query: Float[Array, "num_tokens num_heads head_size"],
    key_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    value_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    query_start_loc: Int32[Array, " num_seqs_plus_1"],
    seq_lens: Int32[Array, " num_seqs"],
    block_tables: Int32[Array, "num_seqs max_blocks"],
    num_seqs: Int32[Array, ""],
    *,
    scale: float,
    causal: bool = True,
    alibi_slopes: Float[Array, " num_heads"] | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale=1.0,
    v_scale=1.0,
    block_q: int | None = None,
    pages_per_compute_block: int | None = None,
    interpret: bool = False,
) -> Float[Array, "num_tokens num_heads head_size"]:
    """Attention of a ragged batch of queries over a paged cache (Pallas kernel).

    Sequence i (for i < num_seqs) owns tokens `query_start_loc[i]:query_start_loc[i+1]`; its
    `q_len` queries sit at positions `seq_lens[i] - q_len + j` (bottom-right aligned, so decode,
    prefill and chunked prefill are one case) and its `seq_lens[i]` keys are in the blocks
    `block_tables[i]`, which must already hold the new tokens. Math as in SPEC.md. Tokens at or
    past `query_start_loc[num_seqs]` are padding and give zeros; so do fully-masked rows.
    Caches of any float dtype, or fp8, are read as `stored * k_scale` / `stored * v_scale`.

    `block_q` (query tokens per program) and `pages_per_compute_block` (pages per loop step)
    default to a heuristic. On GPU `block_size` and `head_size` must be powers of two;
    `interpret=True` runs the same kernel on CPU with no such limit.
    """
    shape_rules.check_kernel_args(
        query,
        key_cache,
        value_cache,
        query_axis="num_tokens",
        alibi_slopes=alibi_slopes,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        interpret=interpret,
    )
    num_heads, head_size = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1:3]
    shape_rules.check_ragged_arrays(
        query_start_loc, seq_lens, block_tables, num_seqs, int32_only=True
    )
    shape_rules.check_positive_int(block_q, "block_q")
    shape_rules.check_positive_int(pages_per_compute_block, "pages_per_compute_block")
    group_pad = softmax.next_pow2(num_heads // num_kv_heads)
    if not interpret:
        shape_rules.check_native_tile(block_q, "block_q", width=group_pad, width_name="group_pad")
        shape_rules.check_native_tile(
            pages_per_compute_block, "pages_per_compute_block", width=block_size
        )
    dtype = softmax.compute_dtype(query.dtype, key_cache.dtype)
    if block_q is None:
        block_q = _default_block_q(group_pad, head_size, dtype)
    if pages_per_compute_block is None:
        block_k = softmax.default_block_k(
            block_size,
            max(block_tables.shape[1], 1),
            head_size,
            dtype,
            target=_TARGET_BLOCK_K,
        )
    else:
        block_k = pages_per_compute_block * block_size
    k_scale = shape_rules.scale_array(k_scale, "k_scale")
    scales = jnp.stack([jnp.float32(scale) * k_scale, shape_rules.scale_array(v_scale, "v_scale")])
    return _ragged_pallas(
        query,
        key_cache,
        value_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        num_seqs,
        alibi_slopes,
        scales,
        causal=causal,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        block_q=block_q,
        block_k=block_k,
        interpret=interpret,
    )


@functools.partial(
    jax.jit, static_argnames=("scale", "causal", "sliding_window", "logits_soft_cap")
)
def ragged_paged_attention_reference(
    query: Float[Array, "num_tokens num_heads head_size"],
    key_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    value_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    query_start_loc: Int32[Array, " num_seqs_plus_1"],
    seq_lens: Int32[Array, " num_seqs"],
    block_tables: Int32[Array, "num_seqs max_blocks"],
    num_seqs: Int32[Array, ""],
    *,
    scale: float,
    causal: bool = True,
    alibi_slopes: Float[Array, " num_heads"] | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale=1.0,
    v_scale=1.0,
) -> Float[Array, "num_tokens num_heads head_size"]:
    """`ragged_paged_attention` in plain jnp: every token against its sequence's gathered keys."""
    num_tokens, num_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    max_seqs, max_blocks = block_tables.shape
    group = num_heads // num_kv_heads
    max_len = max_blocks * block_size
    k_scale = shape_rules.scale_array(k_scale, "k_scale")
    v_scale = shape_rules.scale_array(v_scale, "v_scale")

    # Each token's sequence; tokens past query_start_loc[num_seqs] are padding.
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq, is_real = sequence_of(query_start_loc, token, num_seqs=num_seqs)  # [T]
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    seq_len = seq_lens[seq]
    q_pos = seq_len - q_len + (token - query_start_loc[seq])  # [T]

    tables = jnp.clip(block_tables, 0, num_blocks - 1)
    # [NB, BS, Hkv, D][S, MB] -> [S, MB, BS, Hkv, D] -> [S, L, Hkv, D]
    k = key_cache[tables].reshape(max_seqs, max_len, num_kv_heads, head_size)
    v = value_cache[tables].reshape(max_seqs, max_len, num_kv_heads, head_size)
    k = k.astype(jnp.float32) * k_scale
    v = v.astype(jnp.float32) * v_scale
    key_pos = jnp.arange(max_len, dtype=jnp.int32)
    # Rows past num_seqs are junk: they own no keys (padding tokens map to row num_seqs).
    real_seq = jnp.arange(max_seqs) < num_seqs
    in_seq = (key_pos[None, :] < seq_lens[:, None]) & real_seq[:, None]  # [S, L]
    v = jnp.where(in_seq[:, :, None, None], v, 0.0)

    valid = in_seq[seq] & is_real[:, None]  # [T, L]
    if causal:
        valid = valid & (key_pos[None, :] <= q_pos[:, None])
    if sliding_window is not None:
        valid = valid & (q_pos[:, None] - key_pos[None, :] < sliding_window)

    # [T, Hq, D] -> [T, Hkv, G, D]
    q = query.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_size)
    # [T, Hkv, G, D] x [T, L, Hkv, D] -> [T, Hkv, G, L]
    logits = jnp.einsum("thgd,tlhd->thgl", q, k[seq], precision="highest") * scale
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.astype(jnp.float32).reshape(1, num_kv_heads, group, 1)
        rel = (key_pos[None, :] - q_pos[:, None]).astype(jnp.float32)[:, None, None, :]
        logits = logits + slopes * rel
    mask = valid[:, None, None, :]
    logits = jnp.where(mask, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.where(mask, jnp.exp(logits - row_max), 0.0)
    denom = p.sum(axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    # Values a token does not see are zeros (a window's freed blocks may hold anything).
    v_seen = jnp.where(valid[:, :, None, None], v[seq], 0.0)  # [T, L, Hkv, D]
    # [T, Hkv, G, L] x [T, L, Hkv, D] -> [T, Hkv, G, D] -> [T, Hq, D]
    out = jnp.einsum("thgl,tlhd->thgd", p, v_seen, precision="highest")
    return out.reshape(num_tokens, num_heads, head_size).astype(query.dtype)

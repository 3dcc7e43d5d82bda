"""Paged decode attention: one new query token per sequence against its paged KV cache.

Design (Triton-backed Pallas on GPU; the same code runs on CPU with `interpret=True`):

- Grid `(num_seqs, num_kv_heads, num_kv_splits)`. One program owns one kv head of one
  sequence and every query head of that GQA group, so each cache block is read once per group
  rather than once per query head. The group is padded to `max(16, next_pow2(G))` rows because
  Triton's dot needs at least 16 rows; the extra rows are zeros and are sliced away.
- The cache keeps its own `[NB, BS, Hkv, D]` layout: the BlockSpec squeezes the kv-head axis,
  so the kernel sees this head's `[NB, BS, D]` pages (strided, no transposed copy).
- Keys are visited in compute blocks of `block_k` keys: whole pages (`pages_per_compute_block`
  of them), or a part of one page when a page is larger than the tile budget (block 128 with
  D=256 in float32 walks each page 32 keys at a time). The block table entries of a compute
  block are read inside the loop, never past the table's end (`seq_len` larger than the table
  can hold ends the loop at the table's last key). float32 dots reduce over at most 32 values
  (see `_online_softmax`), so that IEEE float32 FMA loops do not spill.
- Split-K: a sequence's compute blocks are shared out evenly among the splits, sized by that
  sequence's own length. With a sliding window only the blocks that touch the window are
  shared out (`_split_block_range`): blocks wholly before it are never loaded, not just
  masked. Each split writes an unnormalized float32 partial with its running max and sum;
  `_merge_splits` combines them.
- Unused memory never reaches the output: keys past `seq_len` (or before the window) get a
  finite mask logit and an exactly zero weight, and their value rows are replaced by zeros
  before the second dot, so `0 * NaN` never happens. Block ids past the sequence's last page
  are replaced by 0 and all ids are clamped into range, so no load can fault.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int32

from jax_attn import shape_rules
from jax_attn._online_softmax import output_struct
from jax_attn.pallas import _online_softmax as softmax

# Tokens per compute block when the caller does not say: 128 keys keep the K/V tiles of one
# loop step at 32 KiB each for D=128 bf16, which pipelines well with two stages. Larger heads
# and float32 take fewer (`softmax.max_block_k`).
_TARGET_BLOCK_K = 128
# Aim for this many programs in flight (an H100 has 132 SMs, several CTAs each) before
# splitting sequences along the keys.
_TARGET_PROGRAMS = 512
_MAX_KV_SPLITS = 16


def _first_visible_key(seq_len, sliding_window):
    """The first key the decode query (at `seq_len - 1`) may see: the window start, else 0."""
    return 0 if sliding_window is None else jnp.maximum(seq_len - sliding_window, 0)


def _split_block_range(
    seq_len, split, *, block_k: int, num_kv_splits: int, sliding_window, kv_len=None
):
    """Compute blocks `[lo, hi)` that split `split` visits for a sequence of `seq_len` keys,
    of which the first `kv_len` (default: all) are in its block table.

    Only the blocks that touch the keys the query may see, `[seq_len - W, seq_len)` with a
    sliding window `W`, are shared out, so blocks wholly before the window are never loaded;
    none past the table's end is visited, whatever `seq_len` says.
    Example: seq_len 300, W 50, block_k 32, 2 splits: the window [250, 300) touches blocks 7-9;
    split 0 visits [7, 9), split 1 visits [9, 10).
    """
    kv_len = seq_len if kv_len is None else kv_len
    cb_lo = _first_visible_key(seq_len, sliding_window) // block_k
    cb_hi = pl.cdiv(kv_len, block_k)
    per_split = pl.cdiv(jnp.maximum(cb_hi - cb_lo, 0), num_kv_splits)
    lo = cb_lo + split * per_split
    return lo, jnp.minimum(lo + per_split, cb_hi)


def _paged_decode_kernel(
    seq_len_ref,  # [1] this sequence's seq_len
    logit_scale_ref,  # [1] scale * k_scale
    q_ref,  # [G_pad, D] the group's query heads, zero rows past G
    k_ref,  # [NB, BS, D] this kv head's key pages
    v_ref,  # [NB, BS, D]
    block_table_ref,  # [max_blocks_padded]
    slopes_ref,  # [G_pad] ALiBi slopes, or None
    o_ref,  # [G_pad, D] float32, unnormalized partial of this split
    m_ref,  # [G_pad] running max of this split
    l_ref,  # [G_pad] running sum of this split
    *,
    block_k: int,
    table_keys: int,
    chunk: int,
    num_kv_splits: int,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    compute_dtype,
):
    split = pl.program_id(2)
    head_size = k_ref.shape[2]

    seq_len = seq_len_ref[0]
    # Keys past the table's end (`seq_len` too large for it) are never read, only skipped:
    # natively an unbounded table read would fault or read another sequence's row.
    kv_len = jnp.minimum(seq_len, table_keys)
    logit_scale = logit_scale_ref[0]
    q_pos = seq_len - 1  # the decode token is the sequence's last position
    first_key = _first_visible_key(seq_len, sliding_window)
    my_lo, my_hi = _split_block_range(
        seq_len,
        split,
        block_k=block_k,
        num_kv_splits=num_kv_splits,
        sliding_window=sliding_window,
        kv_len=kv_len,
    )

    columns = [slice(c, c + chunk) for c in range(0, head_size, chunk)]
    q = tuple(q_ref[:, cols].astype(compute_dtype) for cols in columns)  # [G_pad, chunk] each
    slopes = None if slopes_ref is None else slopes_ref[...]

    def table(start, size):
        return block_table_ref[pl.ds(start, size)]

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
        key_pos = cb * block_k + jnp.arange(block_k)
        valid = key_valid & (key_pos >= first_key)  # [block_k]
        bias = None
        if slopes is not None:
            rel = (key_pos - q_pos).astype(jnp.float32)
            bias = slopes[:, None] * rel[None, :]  # [G_pad, block_k]
        return softmax.step(
            state,
            q,
            k,
            v,
            valid=valid[None, :],
            value_valid=valid,
            logit_scale=logit_scale,
            bias=bias,
            logits_soft_cap=logits_soft_cap,
        )

    state = softmax.initial_state(q_ref.shape[0], head_size, chunk)
    o, row_max, row_sum = jax.lax.fori_loop(my_lo, my_hi, body, state)
    for cols, o_c in zip(columns, o, strict=True):
        o_ref[:, cols] = o_c
    m_ref[...] = row_max
    l_ref[...] = row_sum


def _merge_splits(o, row_max, row_sum, v_scale):
    """Combine split-K partials in float32.

    o: [S, Hkv, K, G_pad, D] unnormalized; row_max, row_sum: [S, Hkv, K, G_pad]. An empty
    split has row_max = MASK_VALUE, row_sum = 0, o = 0, so its weight is 0 whenever any split
    saw a key, and a sequence with no keys at all ends with a zero sum and gives zeros.
    """
    m_max = row_max.max(axis=2, keepdims=True)  # [S, Hkv, 1, G_pad]
    w = jnp.exp(row_max - m_max)  # [S, Hkv, K, G_pad]
    l_sum = (w * row_sum).sum(axis=2)  # [S, Hkv, G_pad]
    o_sum = (w[..., None] * o).sum(axis=2)  # [S, Hkv, G_pad, D]
    safe_l = jnp.where(l_sum > 0, l_sum, 1.0)
    out = jnp.where((l_sum > 0)[..., None], o_sum / safe_l[..., None], 0.0)
    # The value scale is linear in the output, so it is applied once here.
    return out * v_scale


def _num_warps(group_pad: int, head_size: int, dtype) -> int:
    """Warps per program: 4, or 8 where the output tile would crowd 4 warps' registers."""
    del dtype
    return 8 if group_pad * head_size >= 16 * 256 else 4


def _default_num_kv_splits(num_seqs: int, num_kv_heads: int, num_compute_blocks: int) -> int:
    splits = pl.cdiv(_TARGET_PROGRAMS, num_seqs * num_kv_heads)
    return max(1, min(splits, _MAX_KV_SPLITS, num_compute_blocks))


def _paged_decode_pallas(
    query,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    alibi_slopes,
    logit_scale,
    v_scale,
    *,
    sliding_window,
    logits_soft_cap,
    block_k,
    num_kv_splits,
    interpret,
):
    num_seqs, num_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    group_pad = max(shape_rules.MIN_DOT, softmax.next_pow2(group))
    dtype = softmax.compute_dtype(query.dtype, key_cache.dtype)

    # [S, Hq, D] -> [S, Hkv, G, D] -> [S, Hkv, G_pad, D]
    q = query.astype(dtype).reshape(num_seqs, num_kv_heads, group, head_size)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, group_pad - group), (0, 0)))

    tables = softmax.pad_tables(block_tables, block_k, block_size)
    max_blocks_pad = tables.shape[1]

    if alibi_slopes is None:
        slopes, slopes_spec = None, None
    else:
        slopes = softmax.group_slopes(alibi_slopes, num_kv_heads, group_pad)  # [Hkv, G_pad]
        slopes_spec = pl.BlockSpec((None, group_pad), lambda s, h, k: (h, 0))

    kernel = functools.partial(
        _paged_decode_kernel,
        block_k=block_k,
        table_keys=block_tables.shape[1] * block_size,
        chunk=softmax.head_chunk(head_size, dtype),
        num_kv_splits=num_kv_splits,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        compute_dtype=dtype,
    )
    cache_spec = pl.BlockSpec(
        (num_blocks, block_size, None, head_size), lambda s, h, k: (0, 0, h, 0)
    )
    partial_shape = (num_seqs, num_kv_heads, num_kv_splits, group_pad)
    operands = (seq_lens, logit_scale.reshape(1), q, key_cache, value_cache, tables, slopes)
    o, row_max, row_sum = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, num_kv_splits),
        in_specs=[
            pl.BlockSpec((1,), lambda s, h, k: (s,)),  # seq_lens
            pl.BlockSpec((1,), lambda s, h, k: (0,)),  # logit scale
            pl.BlockSpec((None, None, group_pad, head_size), lambda s, h, k: (s, h, 0, 0)),
            cache_spec,
            cache_spec,
            pl.BlockSpec((None, max_blocks_pad), lambda s, h, k: (s, 0)),
            slopes_spec,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, group_pad, head_size), lambda s, h, k: (s, h, k, 0, 0)),
            pl.BlockSpec((None, None, None, group_pad), lambda s, h, k: (s, h, k, 0)),
            pl.BlockSpec((None, None, None, group_pad), lambda s, h, k: (s, h, k, 0)),
        ],
        out_shape=[
            output_struct((*partial_shape, head_size), jnp.float32, *operands),
            output_struct(partial_shape, jnp.float32, *operands),
            output_struct(partial_shape, jnp.float32, *operands),
        ],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(
            num_warps=_num_warps(group_pad, head_size, dtype), num_stages=2
        ),
        name="paged_decode",
    )(*operands)

    out = _merge_splits(o, row_max, row_sum, v_scale)  # [S, Hkv, G_pad, D]
    # [S, Hkv, G_pad, D] -> [S, Hkv, G, D] -> [S, Hq, D]
    out = out[:, :, :group].reshape(num_seqs, num_heads, head_size)
    return out.astype(query.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "sliding_window",
        "logits_soft_cap",
        "pages_per_compute_block",
        "num_kv_splits",
        "interpret",
    ),
)
def paged_decode(
    query: Float[Array, "num_seqs num_heads head_size"],
    key_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    value_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    block_tables: Int32[Array, "num_seqs max_blocks"],
    seq_lens: Int32[Array, " num_seqs"],
    *,
    scale: float,
    alibi_slopes: Float[Array, " num_heads"] | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale=1.0,
    v_scale=1.0,
    pages_per_compute_block: int | None = None,
    num_kv_splits: int | None = None,
    interpret: bool = False,
) -> Float[Array, "num_seqs num_heads head_size"]:
    """Decode attention of one query token per sequence over a paged cache (Pallas kernel).

    Sequence i's keys are `seq_lens[i]` tokens in the blocks `block_tables[i]`; its query sits
    at position `seq_lens[i] - 1`. Math as in SPEC.md (scale, soft cap, ALiBi, sliding window,
    softmax in float32). Caches of any float dtype, or fp8 (`float8_e4m3fn` / `float8_e5m2`),
    are read as `stored * k_scale` / `stored * v_scale`. Sequences with `seq_len == 0` give
    zeros. Nothing in unused blocks or past `seq_len` affects the output, NaN included.

    `pages_per_compute_block` (pages per loop step) and `num_kv_splits` (split-K programs per
    sequence and kv head) default to a heuristic. On GPU, `block_size` and `head_size` must be
    powers of two; `interpret=True` runs the same kernel on CPU with no such limit.
    """
    shape_rules.check_kernel_args(
        query,
        key_cache,
        value_cache,
        query_axis="num_seqs",
        alibi_slopes=alibi_slopes,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        interpret=interpret,
    )
    num_seqs = query.shape[0]
    block_size, num_kv_heads = key_cache.shape[1:3]
    shape_rules.check_decode_arrays(block_tables, seq_lens, num_seqs, int32_only=True)
    shape_rules.check_positive_int(pages_per_compute_block, "pages_per_compute_block")
    shape_rules.check_positive_int(num_kv_splits, "num_kv_splits")
    if not interpret:
        shape_rules.check_native_tile(
            pages_per_compute_block, "pages_per_compute_block", width=block_size
        )
    if num_seqs == 0:  # an empty batch: a grid of no programs
        return jnp.zeros(query.shape, query.dtype)
    max_blocks = max(block_tables.shape[1], 1)
    if pages_per_compute_block is None:
        block_k = softmax.default_block_k(
            block_size,
            max_blocks,
            query.shape[2],
            softmax.compute_dtype(query.dtype, key_cache.dtype),
            target=_TARGET_BLOCK_K,
        )
    else:
        block_k = pages_per_compute_block * block_size
    if num_kv_splits is None:
        num_compute_blocks = pl.cdiv(max_blocks * block_size, block_k)
        num_kv_splits = _default_num_kv_splits(num_seqs, num_kv_heads, num_compute_blocks)
    logit_scale = jnp.float32(scale) * shape_rules.scale_array(k_scale, "k_scale")
    return _paged_decode_pallas(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        alibi_slopes,
        logit_scale,
        shape_rules.scale_array(v_scale, "v_scale"),
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        block_k=block_k,
        num_kv_splits=num_kv_splits,
        interpret=interpret,
    )


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "logits_soft_cap"))
def paged_decode_reference(
    query: Float[Array, "num_seqs num_heads head_size"],
    key_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    value_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    block_tables: Int32[Array, "num_seqs max_blocks"],
    seq_lens: Int32[Array, " num_seqs"],
    *,
    scale: float,
    alibi_slopes: Float[Array, " num_heads"] | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale=1.0,
    v_scale=1.0,
) -> Float[Array, "num_seqs num_heads head_size"]:
    """`paged_decode` in plain jnp: gather every sequence's pages, one dense softmax."""
    num_seqs, num_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    max_len = block_tables.shape[1] * block_size
    k_scale = shape_rules.scale_array(k_scale, "k_scale")
    v_scale = shape_rules.scale_array(v_scale, "v_scale")

    tables = jnp.clip(block_tables, 0, num_blocks - 1)
    # [NB, BS, Hkv, D][S, MB] -> [S, MB, BS, Hkv, D] -> [S, L, Hkv, D]
    k = key_cache[tables].reshape(num_seqs, max_len, num_kv_heads, head_size)
    v = value_cache[tables].reshape(num_seqs, max_len, num_kv_heads, head_size)
    k = k.astype(jnp.float32) * k_scale
    v = v.astype(jnp.float32) * v_scale

    key_pos = jnp.arange(max_len, dtype=jnp.int32)[None, :]  # [1, L]
    q_pos = (seq_lens - 1)[:, None]  # [S, 1]
    valid = key_pos < seq_lens[:, None]  # [S, L]
    if sliding_window is not None:
        valid = valid & (q_pos - key_pos < sliding_window)
    v = jnp.where(valid[:, :, None, None], v, 0.0)

    # [S, Hq, D] -> [S, Hkv, G, D]
    q = query.astype(jnp.float32).reshape(num_seqs, num_kv_heads, group, head_size)
    # [S, Hkv, G, D] x [S, L, Hkv, D] -> [S, Hkv, G, L]
    logits = jnp.einsum("shgd,slhd->shgl", q, k, precision="highest") * scale
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.astype(jnp.float32).reshape(1, num_kv_heads, group, 1)
        rel = (key_pos - q_pos).astype(jnp.float32)[:, None, None, :]  # [S, 1, 1, L]
        logits = logits + slopes * rel
    mask = valid[:, None, None, :]
    logits = jnp.where(mask, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.where(mask, jnp.exp(logits - row_max), 0.0)
    denom = p.sum(axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    # [S, Hkv, G, L] x [S, L, Hkv, D] -> [S, Hkv, G, D] -> [S, Hq, D]
    out = jnp.einsum("shgl,slhd->shgd", p, v, precision="highest")
    return out.reshape(num_seqs, num_heads, head_size).astype(query.dtype)

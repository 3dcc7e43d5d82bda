"""What the Pallas kernels share: one online-softmax step over a block of keys, the dtype it
computes in, and how many keys a step takes.

A kernel keeps, for each of its `rows` query rows, an unnormalized float32 output `o`, the
running max `m` and the running sum `l` (`initial_state`), and folds in `block_k` keys per loop
step (`step`): whole pages, or a part of one page when a page is larger than the tile budget.
Every `[*, D]` operand is a tuple of column chunks of `head_chunk` columns (one chunk, all of D,
for 16-bit dots; 32 columns for float32, see `FLOAT32_DOT_REDUCTION`):

    chunk = head_chunk(head_size, dtype)
    state = initial_state(rows, head_size, chunk)
    for cb in the visible loop steps:
        k, v, key_valid = load_kv(k_ref, v_ref, table, cb, ...)   # chunks of [block_k, D]
        state = step(state, q, k, v, valid=..., ...)
    o, m, l = state      # the decode kernel merges split partials, the ragged one divides
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax_attn.shape_rules import FP8_DTYPES, MIN_DOT

# A finite "minus infinity": masked logits and the running max of an empty row. With a finite
# value `m_prev - m_next` is never `-inf - -inf`, so an all-masked block gives no NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

# Pallas-Triton lowers a DEFAULT-precision dot of float32 operands to TF32 (a 10-bit mantissa,
# errors ~1e-3); HIGHEST asks for IEEE float32. It changes nothing for 16-bit operands.
DOT_PRECISION = jax.lax.Precision.HIGHEST

# Bytes of one K (or V) tile per loop step (in the dot's dtype). Triton's pipeliner may stage
# the K and V loads through shared memory (num_stages=2: two of each resident) and an H100 has
# 227 KiB of it per block (an A100 163 KiB); 32 KiB tiles leave room for the query tile and the
# dot operands, where 128 keys of a D=256 bf16 or D=128 float32 head would not. Large heads and
# float32 therefore step over fewer keys (and the ragged kernel takes fewer query rows), and a
# step may be part of a page: a 128-token page of a D=256 float32 head is walked 32 keys at a
# time (`load_kv`), so the budget holds for every page size.
MAX_KV_TILE_BYTES = 32 * 1024

# float32 stays IEEE (no TF32), and an IEEE float32 dot has no tensor-core instruction: Triton
# lowers it to a loop of FMAs whose operands sit in registers, so the registers a thread needs
# grow with the dot's reduction length. float32 dots therefore reduce over at most 32 values:
# q.k is summed over chunks of 32 head columns (`head_chunk`), p.v over steps of 32 keys.
# Without this a D=128 float32 kernel spills kilobytes per thread.
FLOAT32_DOT_REDUCTION = 32


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def max_block_k(head_size: int, dtype) -> int:
    """The most keys per loop step whose `[block_k, head_size]` tile of `dtype` fits the budget
    (a power of two, at least 16; at most 32 for float32, see `FLOAT32_DOT_REDUCTION`)."""
    keys = MAX_KV_TILE_BYTES // (head_size * jnp.dtype(dtype).itemsize)
    keys = max(MIN_DOT, 1 << max(0, keys.bit_length() - 1))
    if jnp.dtype(dtype) == jnp.float32:
        keys = min(keys, FLOAT32_DOT_REDUCTION)
    return keys


def head_chunk(head_size: int, dtype) -> int:
    """Head columns per dot: all of them for 16-bit dots (tensor cores), 32 for float32."""
    if jnp.dtype(dtype) == jnp.float32:
        return min(head_size, FLOAT32_DOT_REDUCTION)
    return head_size


def default_block_k(block_size: int, max_blocks: int, head_size: int, dtype, *, target: int):
    """Keys per loop step when the caller does not say: about `target`, fewer for large heads
    and float32 (`max_block_k`), at least 16 (Triton's dot needs 16 columns). Either a part of
    one page (`block_size % block_k == 0`: a page larger than the budget) or whole pages, no
    more than the tables hold (`block_k % block_size == 0`; block sizes that are not powers of
    two, which only interpret mode takes, always step in whole pages)."""
    block_k = min(target, max_block_k(head_size, dtype))
    if block_k < block_size and block_size % block_k == 0:
        return block_k
    pages = max(1, block_k // block_size)
    pages = min(pages, next_pow2(max_blocks))
    pages = max(pages, next_pow2(-(-MIN_DOT // block_size)))
    return pages * block_size


def pages_per_step(block_k: int, block_size: int) -> int:
    """Table entries one loop step reads: `block_k // block_size`, or 1 for part of a page."""
    return max(1, block_k // block_size)


def compute_dtype(query_dtype, cache_dtype):
    """The dtype both dot operands are cast to: the query's for fp8 caches (an fp8 x bf16 dot
    has no Triton lowering), else the wider of the two so a float32 cache keeps its bits."""
    if jnp.dtype(cache_dtype) in FP8_DTYPES:
        return jnp.dtype(query_dtype)
    query_dtype, cache_dtype = jnp.dtype(query_dtype), jnp.dtype(cache_dtype)
    # Spelled out rather than `promote_types`, which strict promotion refuses for bf16 x f32.
    if query_dtype == cache_dtype:
        return query_dtype
    return jnp.dtype(jnp.float32)


def pad_tables(block_tables, block_k: int, block_size: int):
    """Block tables padded to whole loop steps; padded entries are never used as pages."""
    per_step = pages_per_step(block_k, block_size)
    max_blocks = block_tables.shape[1]
    max_blocks_pad = -(-max_blocks // per_step) * per_step
    return jnp.pad(block_tables, ((0, 0), (0, max_blocks_pad - max_blocks)))


def group_slopes(alibi_slopes, num_kv_heads: int, group_pad: int):
    """ALiBi slopes by kv head, each group padded with zeros: `[Hkv, G_pad]` float32."""
    group = alibi_slopes.shape[0] // num_kv_heads
    # [Hq] -> [Hkv, G] -> [Hkv, G_pad]
    slopes = alibi_slopes.astype(jnp.float32).reshape(num_kv_heads, group)
    return jnp.pad(slopes, ((0, 0), (0, group_pad - group)))


def load_kv(k_ref, v_ref, table, cb, *, block_k: int, kv_len, chunk: int, dtype):
    """Keys and values of loop step `cb` (keys `cb * block_k` onwards) as column chunks
    `[block_k, chunk]` of `dtype` (see `head_chunk`), and which keys hold the sequence's data.

    `table(start, size)` reads `size` entries of the sequence's block table from `start`;
    `kv_len` is how many keys the sequence has within its table. A step covers whole pages
    (`block_k >= block_size`) or a part of one page. Entries past the last page the sequence
    uses may be stale or junk ids: those pages read block 0 instead, and every id is clamped,
    so a bad one can never fault; the caller's loop stays within the table.
    """
    num_blocks, block_size, head_size = k_ref.shape
    num_pages = pl.cdiv(kv_len, block_size)
    key_pos = cb * block_k + jnp.arange(block_k)  # [block_k]
    columns = [slice(c, c + chunk) for c in range(0, head_size, chunk)]
    if block_k >= block_size:
        per_step = block_k // block_size
        page_idx = cb * per_step + jnp.arange(per_step)
        pages = jnp.where(page_idx < num_pages, table(cb * per_step, per_step), 0)
        pages = jnp.clip(pages, 0, num_blocks - 1)

        def load(ref, cols):
            # [P, BS, chunk] -> [block_k, chunk]
            return ref[pages, :, cols].reshape(block_k, chunk).astype(dtype)
    else:
        # Part of one page: page `cb * block_k // BS`, tokens from `cb * block_k % BS`.
        # (lax.div / lax.rem: both operands are >= 0, and Triton lowers jnp's floored
        # `%` of signed ints only for some shapes.)
        page_idx = jax.lax.div(cb * block_k, block_size)
        page = jnp.where(page_idx < num_pages, table(page_idx, 1)[0], 0)
        page = jnp.clip(page, 0, num_blocks - 1)
        tokens = pl.ds(jax.lax.rem(cb * block_k, block_size), block_k)

        def load(ref, cols):
            return ref[page, tokens, cols].astype(dtype)  # [block_k, chunk]

    k = tuple(load(k_ref, cols) for cols in columns)
    v = tuple(load(v_ref, cols) for cols in columns)
    return k, v, key_pos < kv_len


def initial_state(rows: int, head_size: int, chunk: int):
    """(o, m, l) of rows that have seen no key: zeros (`[rows, chunk]` column chunks of the
    `[rows, head_size]` output), MASK_VALUE, zeros."""
    return (
        tuple(jnp.zeros((rows, chunk), jnp.float32) for _ in range(head_size // chunk)),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def _dot(a, b, contract):
    return jax.lax.dot_general(
        a,
        b,
        (((1,), (contract,)), ((), ())),
        precision=DOT_PRECISION,
        preferred_element_type=jnp.float32,
    )


def step(state, q, k, v, *, valid, value_valid, logit_scale, bias, logits_soft_cap):
    """Fold one loop step of keys into the running softmax of every query row.

    q, k, v: column chunks (see `head_chunk`) `[rows, chunk]` and `[block_k, chunk]` in the
    compute dtype; `valid` (broadcastable to `[rows, block_k]`) says which logits count;
    `value_valid` `[block_k]` which value rows hold the sequence's data; `bias` (ALiBi,
    broadcastable) is added after the soft cap. The output in `state` is chunked like q.
    """
    o_prev, m_prev, l_prev = state
    # sum over chunks c of [rows, chunk] x [block_k, chunk] -> [rows, block_k]
    logits = None
    for q_c, k_c in zip(q, k, strict=True):
        part = _dot(q_c, k_c, 1)
        logits = part if logits is None else logits + part
    logits = logits * logit_scale
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
    if bias is not None:
        logits = logits + bias
    # `where`, not an additive mask: a NaN key gives a NaN logit that must not survive.
    logits = jnp.where(valid, logits, MASK_VALUE)

    m_next = jnp.maximum(m_prev, logits.max(axis=1))
    correction = jnp.exp(m_prev - m_next)
    p = jnp.where(valid, jnp.exp(logits - m_next[:, None]), 0.0)
    l_next = correction * l_prev + p.sum(axis=1)
    # A zero weight times a NaN value is NaN: zero the rows of unused slots first.
    v = tuple(jnp.where(value_valid[:, None], v_c, jnp.zeros_like(v_c)) for v_c in v)
    p = p.astype(v[0].dtype)
    # per chunk c: [rows, block_k] x [block_k, chunk] -> [rows, chunk]
    o_next = tuple(
        correction[:, None] * o_c + _dot(p, v_c, 0) for o_c, v_c in zip(o_prev, v, strict=True)
    )
    return o_next, m_next, l_next

"""What the Pallas kernels share: one online-softmax step over a block of keys, the dtype it
computes in, and how many keys (pages) a step takes.

A kernel keeps, for each of its `rows` query rows, an unnormalized float32 output `o`, the
running max `m` and the running sum `l` (`initial_state`), and folds in one compute block of
`block_k = pages_per_compute_block * block_size` keys per loop step (`step`):

    state = initial_state(rows, head_size)
    for cb in visible compute blocks:
        k, v = load_pages(k_ref, v_ref, pages, ...)       # [block_k, D] each
        state = step(state, q, k, v, valid=..., ...)
    o, m, l = state      # the decode kernel merges split partials, the ragged one divides
"""

import jax
import jax.numpy as jnp

from jax_attn.checks import FP8_DTYPES, MIN_DOT

# A finite "minus infinity": masked logits and the running max of an empty row. With a finite
# value `m_prev - m_next` is never `-inf - -inf`, so an all-masked block gives no NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

# Pallas-Triton lowers a DEFAULT-precision dot of float32 operands to TF32 (a 10-bit mantissa,
# errors ~1e-3); HIGHEST asks for IEEE float32. It changes nothing for 16-bit operands.
DOT_PRECISION = jax.lax.Precision.HIGHEST

# Bytes of one K (or V) tile per loop step (in the dot's dtype). Triton's pipeliner may stage
# the K and V loads through shared memory (num_stages=2: two of each resident) and an H100 has
# 227 KiB of it per block; 32 KiB tiles leave room for the query tile and the dot operands,
# where 128 keys of a D=256 bf16 or D=128 float32 head would not. Large heads and float32
# therefore step over fewer keys (and the ragged kernel takes fewer query rows).
MAX_KV_TILE_BYTES = 32 * 1024


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def max_block_k(head_size: int, dtype) -> int:
    """The most keys per loop step whose `[block_k, head_size]` tile of `dtype` fits the budget
    (a power of two, at least 16)."""
    keys = MAX_KV_TILE_BYTES // (head_size * jnp.dtype(dtype).itemsize)
    return max(MIN_DOT, 1 << max(0, keys.bit_length() - 1))


def pages_per_compute_block(
    block_size: int, max_blocks: int, head_size: int, dtype, *, target_block_k: int
) -> int:
    """Pages per loop step when the caller does not say: about `target_block_k` keys, fewer
    for large heads and float32 (`max_block_k`), no more than the tables hold."""
    block_k = min(target_block_k, max_block_k(head_size, dtype))
    pages = max(1, block_k // block_size)
    pages = min(pages, next_pow2(max_blocks))
    # At least 16 keys per step: Triton's dot needs 16 columns.
    return max(pages, next_pow2(-(-MIN_DOT // block_size)))


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


def pad_tables(block_tables, pages_per_compute_block: int):
    """Block tables padded to whole compute blocks; padded entries are never used as pages."""
    max_blocks = block_tables.shape[1]
    max_blocks_pad = -(-max_blocks // pages_per_compute_block) * pages_per_compute_block
    return jnp.pad(block_tables, ((0, 0), (0, max_blocks_pad - max_blocks)))


def group_slopes(alibi_slopes, num_kv_heads: int, group_pad: int):
    """ALiBi slopes by kv head, each group padded with zeros: `[Hkv, G_pad]` float32."""
    group = alibi_slopes.shape[0] // num_kv_heads
    # [Hq] -> [Hkv, G] -> [Hkv, G_pad]
    slopes = alibi_slopes.astype(jnp.float32).reshape(num_kv_heads, group)
    return jnp.pad(slopes, ((0, 0), (0, group_pad - group)))


def load_pages(k_ref, v_ref, pages, page_idx, num_pages, dtype):
    """The keys and values of `pages` (logical pages `page_idx`) as `[block_k, D]` of `dtype`.

    Pages past the sequence's end may be stale or junk ids: they read block 0 instead, and
    every id is clamped so that a bad one can never fault.
    """
    num_blocks, block_size, head_size = k_ref.shape
    pages = jnp.where(page_idx < num_pages, pages, 0)
    pages = jnp.clip(pages, 0, num_blocks - 1)
    # [P, BS, D] -> [block_k, D]
    block_k = pages.shape[0] * block_size
    k = k_ref[pages].reshape(block_k, head_size).astype(dtype)
    v = v_ref[pages].reshape(block_k, head_size).astype(dtype)
    return k, v


def initial_state(rows: int, head_size: int):
    """(o, m, l) of rows that have seen no key: zeros, MASK_VALUE, zeros."""
    return (
        jnp.zeros((rows, head_size), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def step(state, q, k, v, *, valid, value_valid, logit_scale, bias, logits_soft_cap):
    """Fold one compute block of keys into the running softmax of every query row.

    q `[rows, D]`, k and v `[block_k, D]` in the compute dtype; `valid` (broadcastable to
    `[rows, block_k]`) says which logits count; `value_valid` `[block_k]` which value rows
    hold the sequence's data; `bias` (ALiBi, broadcastable) is added after the soft cap.
    """
    o_prev, m_prev, l_prev = state
    # [rows, D] x [block_k, D] -> [rows, block_k]
    logits = jax.lax.dot_general(
        q,
        k,
        (((1,), (1,)), ((), ())),
        precision=DOT_PRECISION,
        preferred_element_type=jnp.float32,
    )
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
    v = jnp.where(value_valid[:, None], v, jnp.zeros_like(v))
    # [rows, block_k] x [block_k, D] -> [rows, D]
    pv = jax.lax.dot_general(
        p.astype(v.dtype),
        v,
        (((1,), (0,)), ((), ())),
        precision=DOT_PRECISION,
        preferred_element_type=jnp.float32,
    )
    return correction[:, None] * o_prev + pv, m_next, l_next

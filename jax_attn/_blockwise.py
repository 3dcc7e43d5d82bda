"""Online softmax over key chunks: the loop shared by the paged and the varlen XLA paths.

Queries come in *tiles*: `[num_tiles, tile_q, num_heads, head_size]`, each tile holding query
rows of a single sequence. For every tile the loop walks that sequence's keys chunk by chunk
(`fetch(it)` returns the chunk), keeping a running max `m`, normalizer `denom` and accumulator
`acc` in float32, so nothing of size `[queries, all keys]` is ever materialized and every key
chunk is read once for all query heads of its kv head (GQA).

Masked logits are replaced (`where`, never multiplied) by -inf. A NaN value times a zero
weight is still NaN, so fetchers must return finite data at invalid key positions: they read
a slot known to hold the sequence's own data instead of the unused memory there.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


@dataclasses.dataclass(frozen=True)
class KeyChunk:
    """One chunk of keys for every tile, with the key positions and validity."""

    # Head-major, so both products batch over (tile, kv head) with no transposes.
    key: Float[Array, "num_tiles num_kv_heads chunk head_size"]  # float32
    value: Float[Array, "num_tiles num_kv_heads chunk head_size"]  # float32, finite where invalid
    pos: Int[Array, "num_tiles chunk"]  # position of each key in its sequence
    valid: Bool[Array, "num_tiles chunk"]  # inside the sequence's keys


def attend(
    q: Float[Array, "num_tiles tile_q num_heads head_size"],
    q_pos: Int[Array, "num_tiles tile_q"],
    q_valid: Bool[Array, "num_tiles tile_q"],
    fetch: Callable[[Array], KeyChunk],
    num_iters: Int[Array, ""],
    *,
    max_iters: int | None,
    num_kv_heads: int,
    causal: bool,
    alibi_slopes: Float[Array, " num_heads"] | None,
    sliding_window: int | None,
    logits_soft_cap: float | None,
) -> Float[Array, "num_tiles tile_q num_heads head_size"]:
    """Attention of the query tiles over `num_iters` key chunks; float32 result.

    `q` is float32 with the softmax scale (and the key scale) already folded in. Rows whose
    keys are all masked, and invalid rows, come out as zeros.

    `max_iters=None` runs a while loop of `num_iters` steps (not reverse-differentiable).
    An int runs a scan of that many steps that skips (`cond`) those past `num_iters`, which
    `jax.grad` can differentiate.
    """
    num_tiles, tile_q, num_heads, head_size = q.shape
    group = num_heads // num_kv_heads
    # [N, Q, Hq, D] -> [N, Q, Hkv, G, D] -> [N, Hkv, G, Q, D], once, outside the loop
    q = q.reshape(num_tiles, tile_q, num_kv_heads, group, head_size).transpose(0, 2, 3, 1, 4)
    if alibi_slopes is not None:
        slopes = alibi_slopes.astype(jnp.float32).reshape(1, num_kv_heads, group, 1, 1)

    def step(it, carry):
        m, denom, acc = carry  # [N, Hkv, G, Q], [N, Hkv, G, Q], [N, Hkv, G, Q, D]
        chunk = fetch(it)
        # [N, Hkv, G, Q, D] x [N, Hkv, K, D] -> [N, Hkv, G, Q, K]
        s = jnp.einsum("nhgqd,nhkd->nhgqk", q, chunk.key, preferred_element_type=jnp.float32)
        if logits_soft_cap is not None:
            s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
        delta = q_pos[:, :, None] - chunk.pos[:, None, :]  # [N, Q, K], how far back the key is
        if alibi_slopes is not None:
            s = s - slopes * delta[:, None, None].astype(jnp.float32)
        keep = q_valid[:, :, None] & chunk.valid[:, None, :]  # [N, Q, K]
        if causal:
            keep &= delta >= 0
        if sliding_window is not None:
            keep &= delta < sliding_window
        s = jnp.where(keep[:, None, None], s, -jnp.inf)

        # The result does not depend on m, so it carries no gradient.
        m_new = jax.lax.stop_gradient(jnp.maximum(m, s.max(axis=-1)))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # all-masked rows so far
        p = jnp.exp(s - m_safe[..., None])  # [N, Hkv, G, Q, K]
        correction = jnp.exp(m - m_safe)
        denom = denom * correction + p.sum(axis=-1)
        # [N, Hkv, G, Q, K] x [N, Hkv, K, D] -> [N, Hkv, G, Q, D]
        pv = jnp.einsum("nhgqk,nhkd->nhgqd", p, chunk.value, preferred_element_type=jnp.float32)
        acc = acc * correction[..., None] + pv
        return m_new, denom, acc

    stats_shape = (num_tiles, num_kv_heads, group, tile_q)
    carry = (
        jnp.full(stats_shape, -jnp.inf, jnp.float32),
        jnp.zeros(stats_shape, jnp.float32),
        jnp.zeros((*stats_shape, head_size), jnp.float32),
    )
    if max_iters is None:
        _, denom, acc = jax.lax.fori_loop(0, num_iters, step, carry)
    else:

        def scan_step(it, carry):
            return jax.lax.cond(it < num_iters, step, lambda _, c: c, it, carry)

        _, denom, acc = jax.lax.fori_loop(0, max_iters, scan_step, carry)
    # Rows that saw no key give zeros (their acc may hold NaN from a keyless tile's reads).
    seen = (denom > 0)[..., None]
    out = jnp.where(seen, acc / jnp.where(seen, denom[..., None], 1.0), 0.0)
    # [N, Hkv, G, Q, D] -> [N, Q, Hkv, G, D] -> [N, Q, Hq, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(num_tiles, tile_q, num_heads, head_size)


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
    tile_end [2, 3, 4, 5] and tile.seq [0, 0, 1, 2, 3, <padding tiles>...]. A sequence of
    q_len needs ceil(q_len / tile_q) tiles, so `(T + S * (tile_q - 1)) // tile_q` always suffice
    (the default `num_tiles`; a caller that bounds the tiles better may pass fewer).
    `tile_q` defaults to `tile_size(T, S)`.
    """
    num_seqs = q_lens.shape[0]
    tile_q = tile_size(num_tokens, num_seqs) if tile_q is None else tile_q
    if num_tiles is None:
        num_tiles = max((num_tokens + num_seqs * (tile_q - 1)) // tile_q, 1)
    tiles_per_seq = (q_lens + tile_q - 1) // tile_q  # [S]
    tile_end = jnp.cumsum(tiles_per_seq)
    tile_ids = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(tile_end, tile_ids, side="right"), num_seqs - 1)
    tile_in_seq = tile_ids - (tile_end[seq] - tiles_per_seq[seq])  # [N]
    row = tile_in_seq[:, None] * tile_q + jnp.arange(tile_q, dtype=jnp.int32)[None, :]  # [N, Q]
    valid = (tile_ids < tile_end[-1])[:, None] & (row < q_lens[seq][:, None])
    token = jnp.where(valid, q_starts[seq][:, None] + row, num_tokens)
    return Tiles(seq=seq, row=row, valid=valid, token=token)

"""Dense ragged attention without a cache: encoder, encoder-only, cross attention, prefill.

Sequences are concatenated: sequence `i` has queries `cu_seqlens_q[i]:cu_seqlens_q[i+1]` and
keys `cu_seqlens_k[i]:cu_seqlens_k[i+1]`. Causal masks are bottom-right aligned as in the
paged path (query `j` of a sequence sits at `k_len - q_len + j`).

It reuses the query tiles of the paged XLA path (`xla_paged`) and the same online softmax with
a contiguous key fetch, as a fixed-length loop whose steps past the longest sequence are
skipped (`cond`), so `jax.grad` works.
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jax_attn import _online_softmax as online_softmax
from jax_attn import value_rules
from jax_attn.shape_rules import check_bias_args
from jax_attn.xla_paged import key_range, num_chunks, tile_queries

KV_CHUNK_TOKENS = 128


def varlen_attention(
    query: Float[Array, "q_tokens num_heads head_size"],
    key: Float[Array, "kv_tokens num_kv_heads head_size"],
    value: Float[Array, "kv_tokens num_kv_heads head_size"],
    cu_seqlens_q: Int[Array, " num_seqs_plus_1"],
    cu_seqlens_k: Int[Array, " num_seqs_plus_1"],
    *,
    causal: bool,
    scale: float | None = None,
    alibi_slopes: Float[Array, " num_heads"] | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    check: bool | None = None,
) -> Float[Array, "q_tokens num_heads head_size"]:
    """Attention of each sequence's queries over its own keys; differentiable.

    Query tokens past `cu_seqlens_q[-1]` (padding) give zero rows. `scale` defaults to
    `head_size ** -0.5`. Output in the query dtype. `check` (default
    `jax_attn.config.check`, on): with concrete `cu_seqlens_*`, raise `ValueError` unless
    each starts at 0, never decreases and ends within its tokens; under `jit` only inside
    `jax_attn.checked`.
    """
    if value_rules.wanted(check):
        _check_shapes(query, key, value, cu_seqlens_q, cu_seqlens_k)
        value_rules.run_checks(
            _cu_rules,
            dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k),
            check,
            q_tokens=query.shape[0],
            kv_tokens=key.shape[0],
        )
    return _varlen_attention(
        query,
        key,
        value,
        cu_seqlens_q,
        cu_seqlens_k,
        causal=causal,
        scale=scale,
        alibi_slopes=alibi_slopes,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )


def _cu_rules(xp, *, cu_seqlens_q, cu_seqlens_k, q_tokens: int, kv_tokens: int):
    yield from value_rules.cu_seqlens_rules(
        xp, cu_seqlens=cu_seqlens_q, num_tokens=q_tokens, name="cu_seqlens_q"
    )
    yield from value_rules.cu_seqlens_rules(
        xp, cu_seqlens=cu_seqlens_k, num_tokens=kv_tokens, name="cu_seqlens_k"
    )


def _check_shapes(query, key, value, cu_seqlens_q, cu_seqlens_k) -> None:
    if query.ndim != 3 or key.ndim != 3 or value.shape != key.shape:
        raise ValueError(
            "query must be [q_tokens, num_heads, head_size] and key, value "
            f"[kv_tokens, num_kv_heads, head_size]; got query {query.shape}, key {key.shape}, "
            f"value {value.shape}"
        )
    for name, x in dict(query=query, key=key, value=value).items():
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name}.dtype={x.dtype} must be a float dtype")
    num_heads, head_size = query.shape[1:]
    num_kv_heads = key.shape[1]
    if key.shape[2] != head_size:
        raise ValueError(f"key head_size={key.shape[2]} != query head_size={head_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} must be divisible by {num_kv_heads=}")
    if cu_seqlens_q.ndim != 1 or cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_q {cu_seqlens_q.shape} and cu_seqlens_k {cu_seqlens_k.shape} must be "
            "1-D of the same length num_seqs + 1"
        )
    for name, x in dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k).items():
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name}.dtype={x.dtype} must be int32")


@functools.partial(
    jax.jit, static_argnames=("causal", "scale", "sliding_window", "logits_soft_cap")
)
def _varlen_attention(
    query: Float[Array, "q_tokens num_heads head_size"],
    key: Float[Array, "kv_tokens num_kv_heads head_size"],
    value: Float[Array, "kv_tokens num_kv_heads head_size"],
    cu_seqlens_q: Int[Array, " num_seqs_plus_1"],
    cu_seqlens_k: Int[Array, " num_seqs_plus_1"],
    *,
    causal: bool,
    scale: float | None = None,
    alibi_slopes: Float[Array, " num_heads"] | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> Float[Array, "q_tokens num_heads head_size"]:
    _check_shapes(query, key, value, cu_seqlens_q, cu_seqlens_k)
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key.shape[1]
    check_bias_args(num_heads, alibi_slopes, sliding_window, logits_soft_cap)
    scale = head_size**-0.5 if scale is None else float(scale)

    kv_tokens = key.shape[0]
    cu_q = cu_seqlens_q.astype(jnp.int32)
    cu_k = cu_seqlens_k.astype(jnp.int32)
    q_lens, k_lens = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    tiles = tile_queries(cu_q, q_lens, num_tokens)
    tile_seq, q_valid = tiles.seq, tiles.valid
    q_pos = (k_lens - q_lens)[tile_seq][:, None] + tiles.row  # [N, Q], bottom-right aligned

    kv_len = k_lens[tile_seq]
    lo, hi = key_range(q_pos, q_valid, kv_len, causal=causal, sliding_window=sliding_window)
    chunk = max(1, min(KV_CHUNK_TOKENS, kv_tokens))
    iters = num_chunks(lo, hi, chunk)
    k_start = cu_k[tile_seq]  # [N]

    def fetch(it) -> online_softmax.KeyChunk:
        pos = lo[:, None] + it * chunk + jnp.arange(chunk, dtype=jnp.int32)[None, :]  # [N, K]
        valid = (pos >= 0) & (pos < kv_len[:, None])
        # Outside the sequence, read its first key (finite, weight 0) rather than a neighbour.
        index = jnp.clip(k_start[:, None] + jnp.where(valid, pos, 0), 0, kv_tokens - 1)
        heads = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :, None]
        return online_softmax.KeyChunk(
            key=key[index[:, None, :], heads].astype(jnp.float32),  # [N, Hkv, K, D]
            value=value[index[:, None, :], heads].astype(jnp.float32),
            pos=pos,
            valid=valid,
        )

    q = query[jnp.minimum(tiles.token, num_tokens - 1)].astype(jnp.float32) * scale  # [N, Q, Hq, D]
    queries = online_softmax.group_queries(
        q,
        q_pos,
        q_valid,
        num_kv_heads=num_kv_heads,
        alibi_slopes=alibi_slopes,
        alibi_from=online_softmax.alibi_origin(q_pos, kv_len, causal=causal),
    )
    num_iters = iters.max()

    def step(it, state):
        def attend_chunk(state):
            return online_softmax.update(
                state,
                queries,
                fetch(it),
                causal=causal,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
            )

        return jax.lax.cond(it < num_iters, attend_chunk, lambda state: state, state)

    # A scan of a static number of steps (the most any sequence may need) that skips those
    # past `num_iters`: unlike a while loop, `jax.grad` differentiates it.
    max_iters = -(-kv_tokens // chunk)
    state = jax.lax.fori_loop(
        0, max_iters, step, online_softmax.initial_state(queries, key, value, k_start, lo)
    )
    out = online_softmax.finish(state)
    result = jnp.zeros(query.shape, query.dtype)
    return result.at[tiles.token].set(out.astype(query.dtype), mode="drop")

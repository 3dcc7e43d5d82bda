"""The oracle: dense, per-sequence attention written for obviousness, not speed.

It shares no paging, tiling or masking code with the fast paths: for each sequence it gathers
that sequence's whole key/value history position by position, builds the full
`[queries, keys]` logit matrix, applies the spec's math term by term, and takes a plain softmax.
It computes in float64 when x64 is enabled (`with jax.enable_x64(True):`), else float32;
`dtype=` forces one.

All functions are jit-able: sequences are visited with `lax.map`, each one computing every
query token of the batch against its own keys and keeping only its own rows.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jax_attn.metadata import RaggedMetadata


def default_dtype():
    return jnp.float64 if jax.config.jax_enable_x64 else jnp.float32


def _dense_rows(
    q,
    k,
    v,
    q_pos,
    k_pos,
    allowed,
    *,
    scale,
    causal,
    alibi_slopes,
    sliding_window,
    logits_soft_cap,
    dtype,
    sinks=None,
):
    """softmax(bias(scale * q.k)) v for rows `[T, Hq, D]` against keys `[L, Hkv, D]`.

    `allowed[t, j]` says whether query t and key j belong together at all (same sequence,
    key inside the sequence); causality and the window are applied here on top. `sinks`
    `[Hq]`: each head's attention-sink logit joins every row's softmax with no value.
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    kv_head = jnp.arange(num_heads, dtype=jnp.int32) // (num_heads // num_kv_heads)
    k = k[:, kv_head]  # [L, Hq, D]: each query head sees its kv head
    v = v[:, kv_head]
    logits = scale * jnp.einsum("thd,lhd->htl", q, k)  # [Hq, T, L]
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
    distance = (k_pos[None, :] - q_pos[:, None]).astype(dtype)  # [T, L], p_k - p_q
    if alibi_slopes is not None:
        logits = logits + alibi_slopes.astype(dtype)[:, None, None] * distance[None]
    keep = allowed
    if causal:
        keep = keep & (distance <= 0)
    if sliding_window is not None:
        keep = keep & (-distance < sliding_window)
    logits = jnp.where(keep[None], logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    if sinks is not None:
        sink = jnp.broadcast_to(jnp.asarray(sinks).astype(dtype)[:, None, None], row_max.shape)
        row_max = jnp.maximum(row_max, sink)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(logits - row_max)
    weights = jnp.where(keep[None], weights, 0.0)  # exact zeros where masked
    total = weights.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total = total + jnp.exp(sink - row_max)
    probs = weights / jnp.where(total > 0, total, 1.0)  # rows with no key stay all-zero
    # Values no row keeps are never read: unused memory, and blocks before every row's window
    # (vLLM's engines free those; they may hold anything).
    v = jnp.where(keep.any(axis=0)[:, None, None], v, 0.0)
    return jnp.einsum("htl,lhd->thd", probs, v)


def _gather_sequence(cache, table, block_size, length, dtype, scale):
    """Keys (or values) of one sequence, position by position: `[max_blocks * BS, Hkv, D]`."""
    positions = jnp.arange(table.shape[0] * block_size, dtype=jnp.int32)
    rows = cache[table[positions // block_size], positions % block_size]
    return rows.astype(dtype) * jnp.asarray(scale, dtype), positions, positions < length


def paged_attention(
    query: Float[Array, "num_tokens num_heads head_size"],
    key_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    value_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    metadata: RaggedMetadata,
    *,
    scale: float | None = None,
    causal: bool = True,
    alibi_slopes: Float[Array, " num_heads"] | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float | Float[Array, ""] = 1.0,
    v_scale: float | Float[Array, ""] = 1.0,
    sinks: Float[Array, " num_heads"] | None = None,
    dtype=None,
) -> Float[Array, "num_tokens num_heads head_size"]:
    """Oracle for `jax_attn.paged_attention`; result in `dtype` (float64 with x64)."""
    dtype = dtype or default_dtype()
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    block_size = key_cache.shape[1]
    num_tokens = query.shape[0]
    q = query.astype(dtype)
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    md = metadata

    def one_sequence(i):
        start, end = md.query_start_loc[i], md.query_start_loc[i + 1]
        seq_len = md.seq_lens[i]
        mine = (token >= start) & (token < end) & (i < md.num_seqs)  # [T]
        k, k_pos, k_in = _gather_sequence(
            key_cache, md.block_tables[i], block_size, seq_len, dtype, k_scale
        )
        v, _, _ = _gather_sequence(
            value_cache, md.block_tables[i], block_size, seq_len, dtype, v_scale
        )
        q_pos = seq_len - (end - start) + (token - start)  # bottom-right aligned
        out = _dense_rows(
            q,
            k,
            v,
            q_pos,
            k_pos,
            mine[:, None] & k_in[None, :],
            scale=scale,
            causal=causal,
            alibi_slopes=alibi_slopes,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            dtype=dtype,
            sinks=sinks,
        )
        return jnp.where(mine[:, None, None], out, 0.0)

    per_seq = jax.lax.map(
        one_sequence, jnp.arange(md.seq_lens.shape[0], dtype=jnp.int32)
    )  # [S, T, Hq, D]
    return per_seq.sum(axis=0)


def paged_decode(
    query: Float[Array, "num_seqs num_heads head_size"],
    key_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    value_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    block_tables: Int[Array, "num_seqs max_blocks"],
    seq_lens: Int[Array, " num_seqs"],
    *,
    scale: float | None = None,
    alibi_slopes: Float[Array, " num_heads"] | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float | Float[Array, ""] = 1.0,
    v_scale: float | Float[Array, ""] = 1.0,
    sinks: Float[Array, " num_heads"] | None = None,
    dtype=None,
) -> Float[Array, "num_seqs num_heads head_size"]:
    """Oracle for `jax_attn.paged_decode`: one query at position `seq_len - 1` per sequence."""
    dtype = dtype or default_dtype()
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    block_size = key_cache.shape[1]

    def one_sequence(args):
        q, table, seq_len = args
        k, k_pos, k_in = _gather_sequence(key_cache, table, block_size, seq_len, dtype, k_scale)
        v, _, _ = _gather_sequence(value_cache, table, block_size, seq_len, dtype, v_scale)
        out = _dense_rows(
            q[None].astype(dtype),
            k,
            v,
            (seq_len - 1)[None],
            k_pos,
            k_in[None, :],
            scale=scale,
            causal=True,
            alibi_slopes=alibi_slopes,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            dtype=dtype,
            sinks=sinks,
        )
        return out[0]

    return jax.lax.map(one_sequence, (query, block_tables, seq_lens))


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
    dtype=None,
) -> Float[Array, "q_tokens num_heads head_size"]:
    """Oracle for `jax_attn.varlen_attention` (bottom-right causal alignment)."""
    dtype = dtype or default_dtype()
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = query.astype(dtype), key.astype(dtype), value.astype(dtype)
    q_token = jnp.arange(query.shape[0], dtype=jnp.int32)
    k_token = jnp.arange(key.shape[0], dtype=jnp.int32)

    def one_sequence(i):
        q0, q1 = cu_seqlens_q[i], cu_seqlens_q[i + 1]
        k0, k1 = cu_seqlens_k[i], cu_seqlens_k[i + 1]
        mine_q = (q_token >= q0) & (q_token < q1)
        mine_k = (k_token >= k0) & (k_token < k1)
        q_pos = (k1 - k0) - (q1 - q0) + (q_token - q0)
        out = _dense_rows(
            q,
            k,
            v,
            q_pos,
            k_token - k0,
            mine_q[:, None] & mine_k[None, :],
            scale=scale,
            causal=causal,
            alibi_slopes=alibi_slopes,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            dtype=dtype,
        )
        return jnp.where(mine_q[:, None, None], out, 0.0)

    return jax.lax.map(one_sequence, jnp.arange(cu_seqlens_q.shape[0] - 1, dtype=jnp.int32)).sum(
        axis=0
    )

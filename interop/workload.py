"""Random ragged workloads for tests, benchmarks, notebooks and the cross-check harness.

A workload is a batch of sequences, each with `context_len` keys already cached and `query_len`
new tokens, laid out in a paged cache whose blocks are assigned in random order. Everything
the caller did not put there is poisoned: unused blocks and the tail slots past each
sequence's end hold NaN, so any stray read shows up in the output (`free_before_window`: the
blocks a sliding window leaves behind too, freed as vLLM's engines free them).

The new tokens' keys and values are *not* in the cache: they are returned as `new_key` /
`new_value` with their `slot_mapping`, so callers exercise their own cache write.
"""

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jax_attn.metadata import RaggedMetadata


@dataclasses.dataclass(frozen=True)
class Workload:
    """Host (NumPy) arrays of one random batch; see the module docstring."""

    query: np.ndarray  # [T, Hq, D] in `dtype`
    new_key: np.ndarray  # [T, Hkv, D] in `dtype`
    new_value: np.ndarray
    key_cache: np.ndarray  # [NB, BS, Hkv, D] in `cache_dtype`, context written, NaN elsewhere
    value_cache: np.ndarray
    keys: list[np.ndarray]  # per sequence [seq_len, Hkv, D] float64, as the cache will hold them
    values: list[np.ndarray]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: np.ndarray  # [S, max_blocks] int32 (0 where unused)
    slot_mapping: np.ndarray  # [T] int32
    block_size: int
    k_scale: float
    v_scale: float

    @property
    def seq_lens(self) -> list[int]:
        return [q + c for q, c in zip(self.query_lens, self.context_lens, strict=True)]

    def metadata(self, pad_to=None) -> RaggedMetadata:
        return RaggedMetadata.build(
            self.query_lens, self.context_lens, self.block_tables, self.block_size, pad_to=pad_to
        )


def _nan_fill(shape, dtype) -> np.ndarray:
    return np.full(shape, np.nan, dtype=np.float32).astype(dtype)


def round_to(x: np.ndarray, dtype, scale: float = 1.0) -> np.ndarray:
    """`x` as a cache of `dtype` stores it (saturating fp8 of `x / scale`), back in float64."""
    dtype = np.dtype(dtype)
    if dtype in (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)):
        # Bit for bit what every writer stores: x / scale in float32, saturated, then cast
        # (a float64 division would round a few values to the neighbouring fp8 number).
        stored = _store(x, dtype, scale)
        return stored.astype(np.float64) * scale
    return x.astype(dtype).astype(np.float64)


def make_workload(
    rng: np.random.Generator,
    query_lens: list[int],
    context_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype=np.float32,
    cache_dtype=None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    extra_blocks: int = 3,
    free_before_window: int | None = None,
) -> Workload:
    """A random batch; `cache_dtype` defaults to `dtype` (pass an fp8 dtype for an fp8 cache).

    `free_before_window=W`: a sliding window of W, and each sequence's blocks that lie wholly
    before its first new token's window (positions < context_len - W + 1, keys no query of the
    step sees) freed as vLLM's engines free them: their memory back to NaN and their table
    entries pointing at one shared unused block (the engines' null block), NaN too.
    """
    if free_before_window is not None and extra_blocks < 1:
        raise ValueError("free_before_window needs extra_blocks >= 1 (the null block)")
    dtype = np.dtype(jnp.dtype(dtype))
    cache_dtype = dtype if cache_dtype is None else np.dtype(jnp.dtype(cache_dtype))
    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    order = rng.permutation(num_blocks)  # physical blocks in random order, some unused
    max_blocks = max(max(blocks_per_seq, default=1), 1)
    tables = np.zeros((len(seq_lens), max_blocks), np.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache, value_cache = _nan_fill(shape, cache_dtype), _nan_fill(shape, cache_dtype)
    keys, values, queries, new_keys, new_values, slots = [], [], [], [], [], []
    used = 0
    for i, (q_len, ctx_len) in enumerate(zip(query_lens, context_lens, strict=True)):
        n = blocks_per_seq[i]
        tables[i, :n] = order[used : used + n]
        used += n
        seq_len = q_len + ctx_len
        # Keys and values drawn in the query dtype, then rounded as the cache stores them.
        k = rng.standard_normal((seq_len, num_kv_heads, head_size)).astype(dtype)
        v = rng.standard_normal((seq_len, num_kv_heads, head_size)).astype(dtype)
        pos = np.arange(seq_len)
        slot = tables[i, pos // block_size].astype(np.int64) * block_size + pos % block_size
        ctx = slice(0, ctx_len)
        key_cache.reshape(-1, num_kv_heads, head_size)[slot[ctx]] = _store(
            k[ctx], cache_dtype, k_scale
        )
        value_cache.reshape(-1, num_kv_heads, head_size)[slot[ctx]] = _store(
            v[ctx], cache_dtype, v_scale
        )
        keys.append(round_to(k.astype(np.float64), cache_dtype, k_scale))
        values.append(round_to(v.astype(np.float64), cache_dtype, v_scale))
        queries.append(rng.standard_normal((q_len, num_heads, head_size)).astype(dtype))
        new_keys.append(k[ctx_len:])
        new_values.append(v[ctx_len:])
        slots.append(slot[ctx_len:])
        if free_before_window is not None and q_len > 0:
            # order[-1]: never handed to a sequence (extra_blocks >= 1)
            free_blocks_before(
                key_cache, value_cache, tables[i], ctx_len - free_before_window + 1, order[-1]
            )
    return Workload(
        query=np.concatenate(queries) if queries else np.zeros((0, num_heads, head_size), dtype),
        new_key=np.concatenate(new_keys),
        new_value=np.concatenate(new_values),
        key_cache=key_cache,
        value_cache=value_cache,
        keys=keys,
        values=values,
        query_lens=list(query_lens),
        context_lens=list(context_lens),
        block_tables=tables,
        slot_mapping=np.concatenate(slots).astype(np.int32),
        block_size=block_size,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def free_blocks_before(key_cache, value_cache, table, first_seen: int, null_block: int) -> None:
    """A sequence's blocks wholly before key `first_seen` freed as vLLM's engines free them
    behind a sliding window: their memory NaN, their entries of `table` (the sequence's row,
    changed in place) pointing at `null_block`, a block no sequence owns."""
    freed = max(first_seen, 0) // key_cache.shape[1]  # blocks [0, freed)
    for b in range(freed):
        key_cache[table[b]] = value_cache[table[b]] = np.nan
    table[:freed] = null_block


def _store(x: np.ndarray, cache_dtype, scale: float) -> np.ndarray:
    if cache_dtype in (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)):
        info = ml_dtypes.finfo(cache_dtype)
        scaled = x.astype(np.float32) / np.float32(scale)
        return np.clip(scaled, float(info.min), float(info.max)).astype(cache_dtype)
    return x.astype(cache_dtype)


def dense_reference(
    w: Workload,
    *,
    scale: float | None = None,
    causal: bool = True,
    alibi_slopes=None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks=None,
) -> np.ndarray:
    """float64 NumPy attention of the workload's queries over its (cache-rounded) keys.

    Written straight from the spec, one sequence at a time, with no paging at all: the
    simplest possible statement of the math, for checking both the JAX oracle and the
    fast paths. Query rows are `query.astype(float64)`. `sinks` `[Hq]`: attention sinks, one
    logit per head that joins every row's softmax with no value.
    """
    num_heads, head_size = w.query.shape[1:]
    scale = head_size**-0.5 if scale is None else scale
    out = np.zeros(w.query.shape, np.float64)
    start = 0
    for q_len, k, v in zip(w.query_lens, w.keys, w.values, strict=True):
        q = w.query[start : start + q_len].astype(np.float64)  # [Q, Hq, D]
        group = num_heads // k.shape[1]
        k = np.repeat(k, group, axis=1)  # [L, Hq, D]
        v = np.repeat(v, group, axis=1)
        seq_len = k.shape[0]
        logits = scale * np.einsum("qhd,khd->hqk", q, k)
        if logits_soft_cap is not None:
            logits = logits_soft_cap * np.tanh(logits / logits_soft_cap)
        p_q = np.arange(seq_len - q_len, seq_len)[:, None]
        p_k = np.arange(seq_len)[None, :]
        if alibi_slopes is not None:
            logits = logits + np.asarray(alibi_slopes, np.float64)[:, None, None] * (p_k - p_q)
        keep = np.ones((q_len, seq_len), bool)
        if causal:
            keep &= p_k <= p_q
        if sliding_window is not None:
            keep &= p_q - p_k < sliding_window
        logits = np.where(keep[None], logits, -np.inf)
        row_max = logits.max(axis=-1, keepdims=True, initial=-np.inf)
        if sinks is not None:
            sink = np.broadcast_to(np.asarray(sinks, np.float64)[:, None, None], row_max.shape)
            row_max = np.maximum(row_max, sink)
        row_max = np.where(np.isfinite(row_max), row_max, 0.0)
        weights = np.where(keep[None], np.exp(logits - row_max), 0.0)
        total = weights.sum(axis=-1, keepdims=True)
        if sinks is not None:
            total = total + np.exp(sink - row_max)
        probs = weights / np.where(total > 0, total, 1.0)
        out[start : start + q_len] = np.einsum("hqk,khd->qhd", probs, v)
        start += q_len
    return out

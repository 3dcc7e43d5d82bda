"""Paged attention: the unified ragged entry (`paged_attention`) and the decode fast path.

The XLA path tiles the queries (each tile holds up to `tile_q` query rows of one sequence),
then walks each tile's keys block-chunk by block-chunk through its block table with an online
softmax (`_blockwise.attend`). Only the blocks a tile can see are read: causal tiles stop at
their last query's position, sliding-window tiles start at their first query's window.

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
"""

import dataclasses
import functools
import itertools
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jax_attn import _blockwise
from jax_attn.cache import check_cache_dtype
from jax_attn.metadata import RaggedMetadata

Impl = Literal["auto", "xla", "pallas", "reference"]
IMPLS = ("auto", "xla", "pallas", "reference")

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


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def resolve_impl(impl: str, query=None, key_cache=None) -> str:
    """The implementation `impl` names; "auto" is the Pallas kernel on GPU where it takes these
    shapes and dtypes (power-of-two block and head sizes, 16/32-bit queries), else XLA."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
    if impl != "auto":
        return impl
    if not _on_gpu():
        return "xla"
    if query is not None and key_cache is not None:
        from jax_attn.pallas._checks import FLOAT_DTYPES, native_shape_problem

        _, block_size, _, head_size = key_cache.shape
        if query.dtype not in FLOAT_DTYPES or native_shape_problem(block_size, head_size):
            return "xla"
    return "pallas"


def check_attention_args(
    query: Array,
    key_cache: Array,
    value_cache: Array,
    *,
    query_rank_name: str,
    alibi_slopes: Array | None,
    sliding_window: int | None,
    logits_soft_cap: float | None,
) -> None:
    """Trace-time shape and dtype checks shared by the paged entry points."""
    if query.ndim != 3:
        raise ValueError(
            f"query must be 3-D [{query_rank_name}, num_heads, head_size], got shape {query.shape}"
        )
    if not jnp.issubdtype(query.dtype, jnp.floating):
        raise TypeError(f"query.dtype={query.dtype} must be a float dtype")
    if key_cache.ndim != 4:
        raise ValueError(
            "key_cache must be 4-D [num_blocks, block_size, num_kv_heads, head_size], "
            f"got shape {key_cache.shape}"
        )
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache.shape={value_cache.shape} must equal key_cache.shape={key_cache.shape}"
        )
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(
            f"value_cache.dtype={value_cache.dtype} must equal key_cache.dtype={key_cache.dtype}"
        )
    check_cache_dtype(key_cache.dtype)
    num_heads, head_size = query.shape[1:]
    num_kv_heads, cache_head_size = key_cache.shape[2:]
    if cache_head_size != head_size:
        raise ValueError(f"query head_size={head_size} != cache head_size={cache_head_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} must be divisible by {num_kv_heads=}")
    check_bias_args(num_heads, alibi_slopes, sliding_window, logits_soft_cap)


def check_bias_args(num_heads, alibi_slopes, sliding_window, logits_soft_cap) -> None:
    if alibi_slopes is not None and jnp.shape(alibi_slopes) != (num_heads,):
        raise ValueError(
            f"alibi_slopes must have shape ({num_heads},) (one per query head), "
            f"got {jnp.shape(alibi_slopes)}"
        )
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window <= 0):
        raise ValueError(f"sliding_window={sliding_window!r} must be a positive int or None")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap={logits_soft_cap!r} must be positive or None")


def _check_metadata(metadata: RaggedMetadata, num_tokens: int) -> None:
    if not isinstance(metadata, RaggedMetadata):
        raise TypeError(f"metadata must be a RaggedMetadata, got {type(metadata).__name__}")
    num_seqs = metadata.seq_lens.shape[0] if metadata.seq_lens.ndim == 1 else None
    expected = {
        "query_start_loc": (None if num_seqs is None else num_seqs + 1,),
        "seq_lens": (num_seqs,),
        "block_tables": (num_seqs, metadata.block_tables.shape[-1]),
        "slot_mapping": (num_tokens,),
        "num_seqs": (),
    }
    for name, shape in expected.items():
        x = getattr(metadata, name)
        if x.ndim != len(shape) or any(
            e is not None and e != a for e, a in zip(shape, x.shape, strict=True)
        ):
            raise ValueError(
                f"metadata.{name} has shape {x.shape}, expected {shape} "
                f"for {num_tokens} tokens and {num_seqs} sequences"
            )
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"metadata.{name}.dtype={x.dtype} must be int32")


@functools.partial(
    jax.jit,
    static_argnames=("scale", "causal", "sliding_window", "logits_soft_cap", "impl", "interpret"),
)
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
    impl: Impl = "auto",
    interpret: bool | None = None,
) -> Float[Array, "num_tokens num_heads head_size"]:
    """Attention of a ragged batch mixing decode, prefill and chunked prefill over a paged cache.

    Sequence `i` owns query tokens `query_start_loc[i]:query_start_loc[i+1]` and keys at
    positions `0..seq_lens[i]-1` (the new tokens' keys must already be written with
    `write_kv`); its query `j` sits at position `seq_len - q_len + j`. Only the first
    `metadata.num_seqs` sequences are real; output rows of tokens past
    `query_start_loc[num_seqs]` are zeros, as are rows whose keys are all masked.

    `impl`: "xla" (portable blockwise jnp), "pallas" (GPU kernel; `interpret` runs it on CPU,
    by default when no GPU is present), "reference" (the dense oracle), "auto" (pallas on GPU,
    xla elsewhere). `scale` defaults to `head_size ** -0.5`.
    """
    check_attention_args(
        query,
        key_cache,
        value_cache,
        query_rank_name="num_tokens",
        alibi_slopes=alibi_slopes,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )
    _check_metadata(metadata, query.shape[0])
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    bias = dict(
        causal=causal,
        alibi_slopes=alibi_slopes,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    impl = resolve_impl(impl, query, key_cache)
    if impl == "reference":
        from jax_attn import reference

        return reference.paged_attention(
            query, key_cache, value_cache, metadata, scale=scale, **bias
        ).astype(query.dtype)
    if impl == "pallas":
        from jax_attn.pallas import ragged_paged_attention

        return ragged_paged_attention(
            query,
            key_cache,
            value_cache,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            metadata.num_seqs,
            scale=scale,
            interpret=(not _on_gpu()) if interpret is None else interpret,
            **bias,
        )
    return _paged_attention_xla(query, key_cache, value_cache, metadata, scale=scale, **bias)


def _paged_attention_xla(query, key_cache, value_cache, md: RaggedMetadata, *, scale, **bias):
    """The XLA path; `bias` holds `paged_attention`'s causal / ALiBi / window / soft cap /
    k_scale / v_scale keywords, handed on to `_paged_tiles` unchanged."""
    num_tokens, num_seqs = query.shape[0], md.seq_lens.shape[0]
    real = jnp.arange(num_seqs, dtype=jnp.int32) < md.num_seqs
    q_lens = jnp.where(real, md.query_lens, 0)
    seq_lens = jnp.where(real, md.seq_lens, 0)
    tile_q = _blockwise.tile_size(num_tokens, num_seqs)
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
        tiles = _blockwise.tile_queries(md.query_start_loc, pass_q_lens, num_tokens, **shape)
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


def _gather_rows(flat_cache: Array, slot: Array) -> Array:
    """`flat_cache[slot]` as float32 `[N, Hkv, K, D]` (head-major), reading only those rows.

    One gather indexed by (slot, kv head) writes the chunk directly in the head-major layout
    the batched products want, so XLA inserts no transposes. XLA on CPU has no native
    bf16/fp8 gather and would convert the whole cache to float32 to gather a chunk of it:
    gathering the same bits as unsigned integers reads just the chunk in its own width.
    """
    num_kv_heads = flat_cache.shape[1]
    heads = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :, None]  # [1, Hkv, 1]
    dtype = flat_cache.dtype
    if dtype == jnp.float32:
        return flat_cache[slot[:, None, :], heads]
    bits = jax.lax.bitcast_convert_type(flat_cache, jnp.dtype(f"uint{8 * dtype.itemsize}"))
    rows = bits[slot[:, None, :], heads]  # [N, Hkv, K, D]
    return jax.lax.bitcast_convert_type(rows, dtype).astype(jnp.float32)


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
):
    """Blockwise attention of query tiles against their sequences' paged keys; float32."""
    _, block_size, num_kv_heads, head_size = key_cache.shape
    num_tiles, tile_q, num_heads, _ = q.shape
    max_blocks = block_tables.shape[1]
    rows = tile_q * (num_heads // num_kv_heads)
    blocks = chunk_blocks(num_tiles, rows, num_kv_heads, head_size, block_size)
    chunk = min(blocks, max_blocks) * block_size

    kv_len = seq_lens[tile_seq]  # [N]
    lo, hi = _blockwise.key_range(
        q_pos, q_valid, kv_len, causal=causal, sliding_window=sliding_window
    )
    first_block = lo // block_size  # windows skip whole blocks before the first visible key
    iters = _blockwise.num_chunks(first_block * block_size, hi, chunk)
    tables = block_tables[tile_seq]  # [N, max_blocks]
    k_scale = jnp.asarray(k_scale, jnp.float32)
    v_scale = jnp.asarray(v_scale, jnp.float32)
    flat_k = key_cache.reshape(-1, num_kv_heads, head_size)  # [NB*BS, Hkv, D]: slot-major
    flat_v = value_cache.reshape(-1, num_kv_heads, head_size)

    def attend(tiles: _TileSet):
        # Keys outside a sequence are read from its first slot instead: finite data (when
        # the sequence has any key) whose weight is exactly 0, so no pass over the values is
        # needed to scrub NaN from unused memory.
        safe_slot = tiles.tables[:, 0] * block_size  # [n]
        start = tiles.first_block * block_size

        def fetch(it):
            pos = start[:, None] + it * chunk + jnp.arange(chunk, dtype=jnp.int32)[None, :]
            valid = (pos >= 0) & (pos < tiles.kv_len[:, None])  # [n, K]
            logical = jnp.clip(pos // block_size, 0, max_blocks - 1)
            physical = jnp.take_along_axis(tiles.tables, logical, axis=1)  # [n, K]
            slot = jnp.where(valid, physical * block_size + pos % block_size, safe_slot[:, None])
            return _blockwise.KeyChunk(
                key=_gather_rows(flat_k, slot),  # [n, Hkv, K, D] float32
                value=_gather_rows(flat_v, slot),
                pos=pos,
                valid=valid,
            )

        return _blockwise.attend(
            tiles.q,
            tiles.q_pos,
            tiles.q_valid,
            fetch,
            tiles.iters.max(),
            max_iters=None,
            num_kv_heads=num_kv_heads,
            causal=causal,
            alibi_slopes=alibi_slopes,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )

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


@functools.partial(
    jax.jit,
    static_argnames=("scale", "sliding_window", "logits_soft_cap", "impl", "interpret"),
)
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
    impl: Impl = "auto",
    interpret: bool | None = None,
) -> Float[Array, "num_seqs num_heads head_size"]:
    """One new query token per sequence, at position `seq_lens[i] - 1`, over the paged cache.

    Rows with `seq_lens[i] == 0` (padding) give zeros. Same keywords as `paged_attention`.
    """
    check_attention_args(
        query,
        key_cache,
        value_cache,
        query_rank_name="num_seqs",
        alibi_slopes=alibi_slopes,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )
    num_seqs = query.shape[0]
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be [num_seqs={num_seqs}, max_blocks], "
            f"got shape {block_tables.shape}"
        )
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [num_seqs={num_seqs}], got shape {seq_lens.shape}")
    for name, x in dict(block_tables=block_tables, seq_lens=seq_lens).items():
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name}.dtype={x.dtype} must be int32")
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    bias = dict(
        alibi_slopes=alibi_slopes,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    impl = resolve_impl(impl, query, key_cache)
    if impl == "reference":
        from jax_attn import reference

        return reference.paged_decode(
            query, key_cache, value_cache, block_tables, seq_lens, scale=scale, **bias
        ).astype(query.dtype)
    if impl == "pallas":
        from jax_attn.pallas import paged_decode as pallas_decode

        return pallas_decode(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            scale=scale,
            interpret=(not _on_gpu()) if interpret is None else interpret,
            **bias,
        )
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

"""vLLM V0's `PagedAttention` ops (`vllm/attention/ops/paged_attn.py`) in vectorized torch.

Cache layout (vLLM's "split" layout): one tensor `kv_cache[2, NB, BS * Hkv * D]` per layer,
viewed as
    key_cache   [NB, Hkv, D // x, BS, x]   with x = 16 // element_size (16 bytes per vector)
    value_cache [NB, Hkv, D, BS]
so the key of token `offset` in block `b`, head `h`, dim `d` is
`key_cache[b, h, d // x, offset, d % x]` and its value `value_cache[b, h, d, offset]`.

fp8 caches (`kv_cache_dtype` "fp8" / "fp8_e4m3" / "fp8_e5m2") are stored as uint8 bit
patterns of `float8_e4m3fn` / `float8_e5m2` holding `saturate(x / scale)`; reads multiply by
the scale. Decode and the prefix prefill on CPU run the project's native kernels
(`torch_backends.native`, the C++ shared with `jax_attn.cpu`: decode over this layout in place,
`forward_prefix` on the ragged kernel over the step's blocks copied token-major,
`ragged_prefill`) where they are built; everything else, and those where they are not, is
vectorized torch: the layout's writes and gathers (`layouts.SplitLayout`), then float32
attention math (`masked_attention`).

Where this differs from vLLM V0: `forward_decode` and `forward_prefix` take optional
`sliding_window` / `logits_soft_cap` keywords (vLLM's kernels had neither), and both apply them.
"""

import dataclasses

import torch
from jaxtyping import Float, Int
from torch import Tensor

from torch_backends import native, ragged_prefill
from torch_backends.layouts import PagedCache, Scale, SplitLayout
from torch_backends.masked_attention import masked_attention, ragged_masked_attention
from torch_backends.shapes import BlockTables, KeysValues, Queries, SlotMapping

# Supported head sizes, as vLLM's paged attention kernels list them
# (vllm/attention/ops/paged_attn.py, v0.8.x).
_SUPPORTED_HEAD_SIZES = [32, 64, 80, 96, 112, 120, 128, 192, 256]


def _cache(key_cache: Tensor, value_cache: Tensor, kv_cache_dtype: str, k_scale, v_scale):
    """Caches `[NB, Hkv, D // x, BS, x]` / `[NB, Hkv, D, BS]` in the split layout."""
    layout = SplitLayout(key_cache.shape[1], value_cache.shape[2], kv_cache_dtype)
    return PagedCache(layout, key_cache, value_cache, k_scale, v_scale)


@dataclasses.dataclass
class PagedAttentionMetadata:
    """Metadata for the decode phase of a paged backend."""

    # Total kv length of each decode sequence (context + the new token).
    seq_lens_tensor: Tensor | None
    # Longest decode sequence in the batch.
    max_decode_seq_len: int
    # [num_seqs, max_blocks]: physical blocks of each sequence in order; unused entries 0.
    # block_tables [[3, 7], [1, 0]] with block size 16: seq 0 positions 0-15 in block 3 and
    # 16-31 in block 7; seq 1 (<= 16 tokens) in block 1.
    block_tables: Tensor | None


class PagedAttention:
    @staticmethod
    def get_supported_head_sizes() -> list[int]:
        return list(_SUPPORTED_HEAD_SIZES)

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size * num_kv_heads * head_size)

    @staticmethod
    def split_kv_cache(
        kv_cache: Tensor, num_kv_heads: int, head_size: int
    ) -> tuple[
        Float[Tensor, "num_blocks num_kv_heads head_size_over_x block_size x"],
        Float[Tensor, "num_blocks num_kv_heads head_size block_size"],
    ]:
        """`kv_cache[2, NB, BS*Hkv*D]` -> key `[NB, Hkv, D // x, BS, x]`, value
        `[NB, Hkv, D, BS]` (views), x = 16 // element_size."""
        return SplitLayout(num_kv_heads, head_size).split(kv_cache)

    @staticmethod
    def write_to_paged_cache(
        key: KeysValues,
        value: KeysValues,
        key_cache: Tensor,
        value_cache: Tensor,
        slot_mapping: SlotMapping,
        kv_cache_dtype: str,
        k_scale: Scale,
        v_scale: Scale,
    ) -> None:
        """Scatter `key[t]`, `value[t]` to slot `slot_mapping[t]`, in place.

        Slots of -1 (PAD_SLOT_ID) are skipped; nothing else in the caches changes. A slot
        past the cache, below -1 or given twice raises `ValueError` before anything is
        written (vLLM's kernel wrote out of bounds, or let one of the writes win).
        """
        _cache(key_cache, value_cache, kv_cache_dtype, k_scale, v_scale).write(
            key, value, slot_mapping
        )

    @staticmethod
    def forward_decode(
        query: Float[Tensor, "num_seqs num_heads head_size"],
        key_cache: Tensor,
        value_cache: Tensor,
        block_tables: BlockTables,
        seq_lens: Int[Tensor, " num_seqs"],
        max_seq_len: int,
        kv_cache_dtype: str,
        num_kv_heads: int,
        scale: float,
        alibi_slopes: Float[Tensor, " num_heads"] | None,
        k_scale: Scale,
        v_scale: Scale,
        tp_rank: int = 0,
        blocksparse_local_blocks: int = 0,
        blocksparse_vert_stride: int = 0,
        blocksparse_block_size: int = 64,
        blocksparse_head_sliding_step: int = 0,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> Float[Tensor, "num_seqs num_heads head_size"]:
        """One query per sequence at position `seq_lens[i] - 1`."""
        if blocksparse_vert_stride > 1:
            raise ValueError("Block-sparse attention is not supported by this backend")
        return decode(
            query, key_cache, value_cache, block_tables, seq_lens, max_seq_len, kv_cache_dtype,
            scale, alibi_slopes, k_scale, v_scale,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
        )  # fmt: skip

    @staticmethod
    def forward_prefix(
        query: Queries,
        key: KeysValues,
        value: KeysValues,
        kv_cache_dtype: str,
        key_cache: Tensor,
        value_cache: Tensor,
        block_tables: BlockTables,
        query_start_loc: Int[Tensor, " num_seqs_plus_1"],
        seq_lens_tensor: Int[Tensor, " num_seqs"],
        max_query_len: int,
        alibi_slopes: Float[Tensor, " num_heads"] | None,
        sliding_window: int | None,
        k_scale: Scale,
        v_scale: Scale,
        *,
        scale: float | None = None,
        logits_soft_cap: float | None = None,
    ) -> Queries:
        """Chunked prefill: new tokens over their cached prefix plus themselves, causally: on
        the native ragged kernel (`ragged_prefill.from_split_cache`) where it takes them, else
        a torch gather and `masked_attention`.

        vLLM's prefix kernel always used `head_size ** -0.5`; `scale=` overrides it.

        Sequence i's `q_len = query_start_loc[i+1] - query_start_loc[i]` new tokens sit at
        positions `seq_len - q_len ...`; its first `seq_len - q_len` keys come from the cache
        through `block_tables[i]`, the rest from `key` / `value`.
        """
        q_lens = torch.diff(query_start_loc.long()).tolist()
        seq_lens = seq_lens_tensor.long().tolist()
        ctx_lens = [s - q for q, s in zip(q_lens, seq_lens, strict=True)]
        for i, ctx_len in enumerate(ctx_lens):
            if ctx_len < 0:
                raise ValueError(
                    f"sequence {i} has {q_lens[i]} new tokens but "
                    f"seq_lens_tensor[{i}]={seq_lens[i]}"
                )
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        if ragged_prefill.unsupported(query, q_lens, seq_lens) is None:
            return ragged_prefill.from_split_cache(
                torch.empty_like(query),
                query,
                key_cache,
                value_cache,
                block_tables,
                q_lens,
                seq_lens,
                ctx_lens,
                key,
                value,
                kv_cache_dtype=kv_cache_dtype,
                k_scale=k_scale,
                v_scale=v_scale,
                round_new=False,
                scale=scale,
                causal=True,
                alibi_slopes=alibi_slopes,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
            )
        cache = _cache(key_cache, value_cache, kv_cache_dtype, k_scale, v_scale)
        ctx_k, ctx_v = cache.gather(block_tables, max(ctx_lens, default=0))
        starts = query_start_loc.long().tolist()
        keys, values = [], []
        for i, ctx_len in enumerate(ctx_lens):  # [prefix_i (cache) | new_i] per sequence
            keys += [ctx_k[i, :ctx_len], key[starts[i] : starts[i + 1]].float()]
            values += [ctx_v[i, :ctx_len], value[starts[i] : starts[i + 1]].float()]
        return ragged_masked_attention(
            query,
            torch.cat(keys),
            torch.cat(values),
            q_lens,
            seq_lens,
            scale=scale,
            causal=True,
            alibi_slopes=alibi_slopes,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )

    @staticmethod
    def swap_blocks(src_kv_cache: Tensor, dst_kv_cache: Tensor, src_to_dst: Tensor) -> None:
        """Copy blocks `src_to_dst[i, 0]` of src to `src_to_dst[i, 1]` of dst, for both the
        key and value halves; src and dst may be on different devices (CPU <-> CUDA), or be
        one cache (or overlapping views of one): every source is read before any block is
        written. Block ids outside either cache, or a destination given twice, raise
        ValueError before anything is copied."""
        pairs = _block_pairs("src_to_dst", src_to_dst, src_kv_cache.shape[1],
                             dst_kv_cache.shape[1])  # fmt: skip
        if _native_copies([dst_kv_cache, src_kv_cache]):
            native.copy_blocks([dst_kv_cache], [src_kv_cache], pairs)
            return
        src_ids = pairs[:, 0].to(src_kv_cache.device)
        dst_ids = pairs[:, 1].to(dst_kv_cache.device)
        blocks = src_kv_cache.index_select(1, src_ids)  # [2, N, ...]: a copy, read first
        dst_kv_cache.index_copy_(1, dst_ids, blocks.to(dst_kv_cache.device))

    @staticmethod
    def copy_blocks(kv_caches: list[Tensor], src_to_dists: Tensor) -> None:
        """For every layer's `kv_cache`, copy block `src_to_dists[i, 0]` to `[i, 1]`, as if
        every source of every layer were read before any block is written: chains
        (`[[0, 1], [1, 2]]` copies the old block 1 to 2) and swaps come out whole. Refused
        with ValueError before anything is copied: a block id outside a cache, a destination
        given twice (which write would win is undefined), two caches that share memory
        (unless it is the same tensor listed again, which is copied once)."""
        if not kv_caches:
            return
        num_blocks = min(kv_cache.shape[1] for kv_cache in kv_caches)
        pairs = _block_pairs("src_to_dists", src_to_dists, num_blocks, num_blocks)
        _check_caches_apart("kv_caches", kv_caches)
        if _native_copies(kv_caches):
            native.copy_blocks(kv_caches, kv_caches, pairs)
            return
        ids = [(pairs[:, 0].to(c.device), pairs[:, 1].to(c.device)) for c in kv_caches]
        blocks = [c[:, src] for c, (src, _) in zip(kv_caches, ids, strict=True)]  # copies
        for kv_cache, (_, dst), block in zip(kv_caches, ids, blocks, strict=True):
            kv_cache[:, dst] = block


def decode(
    query: Float[Tensor, "num_seqs num_heads head_size"],
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: BlockTables,
    seq_lens: Int[Tensor, " num_seqs"],
    max_seq_len: int,
    kv_cache_dtype: str,
    scale: float,
    alibi_slopes: Float[Tensor, " num_heads"] | None,
    k_scale: Scale,
    v_scale: Scale,
    *,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    out: Float[Tensor, "num_seqs num_heads head_size"] | None = None,
) -> Float[Tensor, "num_seqs num_heads head_size"]:
    """Both ops files' decode, into `out` when given (contiguous, the query's dtype): the
    native kernel on CPU where it is built, else the torch gather and masked attention."""
    if native.decode_supported(query, key_cache) and native.available():
        return native.paged_decode_split(
            torch.empty_like(query) if out is None else out,
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            scale=scale,
            alibi_slopes=alibi_slopes,
            k_scale=k_scale,
            v_scale=v_scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            kv_cache_dtype=kv_cache_dtype,
        )
    num_seqs = query.shape[0]
    max_seq_len = int(max_seq_len) if num_seqs else 0
    if num_seqs == 0 or max_seq_len == 0:
        result = torch.zeros_like(query)
        return result if out is None else out.copy_(result)
    seq_lens = seq_lens.to(torch.long)
    cache = _cache(key_cache, value_cache, kv_cache_dtype, k_scale, v_scale)
    k, v = cache.gather(block_tables, max_seq_len)
    k_pos = torch.arange(max_seq_len, device=query.device)
    attended = masked_attention(
        query[:, None].float(),  # [S, 1, Hq, D]
        k,
        v,
        q_pos=(seq_lens - 1)[:, None],
        k_pos=k_pos[None, :].expand(num_seqs, -1),
        k_valid=k_pos[None, :] < seq_lens[:, None],
        scale=scale,
        causal=True,
        alibi_slopes=alibi_slopes,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )
    result = attended[:, 0].to(query.dtype)
    return result if out is None else out.copy_(result)


def _block_pairs(name: str, pairs: Tensor, src_blocks: int, dst_blocks: int) -> Tensor:
    """`pairs` as int64 `[N, 2]` on the CPU, (src, dst) ids checked against both caches and
    the destinations distinct."""
    pairs = pairs.to("cpu", torch.long).reshape(-1, 2)
    for column, limit, what in ((0, src_blocks, "source"), (1, dst_blocks, "destination")):
        ids = pairs[:, column]
        bad = (ids < 0) | (ids >= limit)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"{name}[{i}, {column}]={int(ids[i])} is out of range: {what} block ids must be "
                f"in [0, {limit})"
            )
    first: dict[int, int] = {}
    for i, block in enumerate(pairs[:, 1].tolist()):
        if block in first:
            raise ValueError(
                f"{name}[:, 1] has block {block} more than once ({name}[{first[block]}] and "
                f"[{i}]): destinations must be distinct (a repeated destination leaves which "
                "write wins undefined)"
            )
        first[block] = i
    return pairs


def _check_caches_apart(name: str, caches: list[Tensor]) -> None:
    """ValueError if two of `caches` share memory (a block would be written twice), unless
    they are the same tensor listed again (same data, shape and strides: copied once)."""
    spans = [_byte_span(c) for c in caches]
    for j, b in enumerate(caches):
        for i in range(j):
            a = caches[i]
            same = (a.data_ptr(), a.shape, a.stride(), a.dtype) == (
                b.data_ptr(), b.shape, b.stride(), b.dtype
            )  # fmt: skip
            (key_a, lo_a, hi_a), (key_b, lo_b, hi_b) = spans[i], spans[j]
            if not same and key_a == key_b and lo_a < hi_b and lo_b < hi_a:
                raise ValueError(
                    f"{name}[{i}] and {name}[{j}] share memory: destination caches must not "
                    "overlap (a byte written twice leaves which write wins undefined) unless "
                    "the same cache is listed again"
                )


def _byte_span(t: Tensor) -> tuple[tuple, int, int]:
    """(storage identity, first byte, one past the last byte) of `t` in its storage; an empty
    tensor spans nothing."""
    key = (t.device, t.untyped_storage().data_ptr())
    if t.numel() == 0:
        return key, 0, 0
    first = t.storage_offset()  # elements
    last = first + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return key, first * t.element_size(), (last + 1) * t.element_size()


def _native_copies(caches: list[Tensor]) -> bool:
    """Whether the native block copy takes these caches (CPU, contiguous, one dtype)."""
    return (
        all(c.device.type == "cpu" and c.is_contiguous() and c.dim() >= 2 for c in caches)
        and len({c.dtype for c in caches}) == 1
        and native.available()
    )

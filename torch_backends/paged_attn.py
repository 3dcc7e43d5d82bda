"""vLLM V0's `PagedAttention` ops (`vllm/attention/ops/paged_attn.py`) in vectorized torch.

Cache layout (vLLM's "split" layout): one tensor `kv_cache[2, NB, BS * Hkv * D]` per layer,
viewed as
    key_cache   [NB, Hkv, D // x, BS, x]   with x = 16 // element_size (16 bytes per vector)
    value_cache [NB, Hkv, D, BS]
so the key of token `offset` in block `b`, head `h`, dim `d` is
`key_cache[b, h, d // x, offset, d % x]` and its value `value_cache[b, h, d, offset]`.

fp8 caches (`kv_cache_dtype` "fp8" / "fp8_e4m3" / "fp8_e5m2") are stored as uint8 bit
patterns of `float8_e4m3fn` / `float8_e5m2` holding `saturate(x / scale)`; reads multiply by
the scale. Everything here is plain torch (no compiled extension): gathers through block
tables, then float32 attention math in `torch_backends._math`.

Where this differs from vLLM V0: `forward_decode` and `forward_prefix` take optional
`sliding_window` / `logits_soft_cap` keywords (vLLM's kernels had neither), and both apply them.
"""

import dataclasses

import torch

from torch_backends import _math

# Supported head sizes, as vLLM's paged attention kernels list them.
_SUPPORTED_HEAD_SIZES = [32, 64, 80, 96, 112, 120, 128, 192, 256]

_FP8 = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def fp8_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The float8 dtype an fp8 `kv_cache_dtype` string stores; None for "auto"."""
    if kv_cache_dtype == "auto":
        return None
    if kv_cache_dtype not in _FP8:
        raise ValueError(
            f"Unsupported KV cache type {kv_cache_dtype!r}: expected 'auto' or one of "
            f"{sorted(_FP8)}"
        )
    return _FP8[kv_cache_dtype]


def _scale(scale) -> torch.Tensor | float:
    return scale if isinstance(scale, torch.Tensor) else float(scale)


def quantize(x: torch.Tensor, kv_cache_dtype: str, scale) -> torch.Tensor:
    """What a cache of `kv_cache_dtype` stores for `x`: uint8 fp8 bits, or `x` unchanged."""
    dtype = fp8_dtype(kv_cache_dtype)
    if dtype is None:
        return x
    info = torch.finfo(dtype)
    scaled = x.float() / _scale(scale)
    return scaled.clamp(info.min, info.max).to(dtype).view(torch.uint8)


def dequantize(x: torch.Tensor, kv_cache_dtype: str, scale) -> torch.Tensor:
    """Cache contents as float32 values (`stored * scale` for fp8)."""
    dtype = fp8_dtype(kv_cache_dtype)
    if dtype is None:
        return x.float()
    return x.view(dtype).float() * _scale(scale)


@dataclasses.dataclass
class PagedAttentionMetadata:
    """Metadata for the decode phase of a paged backend."""

    # Total kv length of each decode sequence (context + the new token).
    seq_lens_tensor: torch.Tensor | None
    # Longest decode sequence in the batch.
    max_decode_seq_len: int
    # [num_seqs, max_blocks]: physical blocks of each sequence in order; unused entries 0.
    # block_tables [[3, 7], [1, 0]] with block size 16: seq 0 positions 0-15 in block 3 and
    # 16-31 in block 7; seq 1 (<= 16 tokens) in block 1.
    block_tables: torch.Tensor | None


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
        kv_cache: torch.Tensor, num_kv_heads: int, head_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = 16 // kv_cache.element_size()
        num_blocks = kv_cache.shape[1]
        key_cache = kv_cache[0].view(num_blocks, num_kv_heads, head_size // x, -1, x)
        value_cache = kv_cache[1].view(num_blocks, num_kv_heads, head_size, -1)
        return key_cache, value_cache

    @staticmethod
    def write_to_paged_cache(
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        k_scale: torch.Tensor | float = 1.0,
        v_scale: torch.Tensor | float = 1.0,
    ) -> None:
        """Scatter `key[t]`, `value[t]` (`[T, Hkv, D]`) to slot `slot_mapping[t]`, in place.

        Slots < 0 (PAD_SLOT_ID) are skipped; nothing else in the caches changes.
        """
        num_blocks, num_kv_heads, _, block_size, x = key_cache.shape
        head_size = value_cache.shape[2]
        if key.shape[1:] != (num_kv_heads, head_size):
            raise ValueError(
                f"key has shape {tuple(key.shape)}, expected [num_tokens, {num_kv_heads}, "
                f"{head_size}] to match the cache"
            )
        slots = slot_mapping.flatten().long()
        if slots.numel() != key.shape[0]:
            raise ValueError(f"slot_mapping has {slots.numel()} entries for {key.shape[0]} tokens")
        if slots.numel() and int(slots.max()) >= num_blocks * block_size:
            raise ValueError(
                f"slot_mapping value {int(slots.max())} is out of range: the cache has "
                f"{num_blocks * block_size} slots"
            )
        keep = slots >= 0
        slots = slots[keep]
        block, offset = slots // block_size, slots % block_size
        k = quantize(key[keep], kv_cache_dtype, k_scale).to(key_cache.dtype)
        v = quantize(value[keep], kv_cache_dtype, v_scale).to(value_cache.dtype)
        # key_cache[b, :, :, o, :] has shape [T, Hkv, D // x, x] under advanced indexing.
        key_cache[block, :, :, offset, :] = k.reshape(-1, num_kv_heads, head_size // x, x)
        value_cache[block, :, :, offset] = v  # [T, Hkv, D]

    @staticmethod
    def gather_kv(
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        kv_len: int,
        kv_cache_dtype: str,
        k_scale=1.0,
        v_scale=1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions `0..kv_len-1` of every sequence, float32.

        Returns `[S, kv_len, Hkv, D]` each. Positions past a sequence's end hold whatever
        the cache holds there (possibly NaN): callers mask them.
        """
        _num_blocks, num_kv_heads, _, block_size, _x = key_cache.shape
        head_size = value_cache.shape[2]
        pos = torch.arange(kv_len, device=block_tables.device)
        logical = (pos // block_size).clamp(max=max(block_tables.shape[1] - 1, 0))
        block = block_tables.long()[:, logical]  # [S, L]
        offset = pos % block_size  # [L]
        # key_cache[block, :, :, offset, :]: [S, L, Hkv, D // x, x] -> [S, L, Hkv, D]
        k = key_cache[block, :, :, offset[None, :], :].reshape(
            *block.shape, num_kv_heads, head_size
        )
        v = value_cache[block, :, :, offset[None, :]]  # [S, L, Hkv, D]
        return (dequantize(k, kv_cache_dtype, k_scale), dequantize(v, kv_cache_dtype, v_scale))

    @staticmethod
    def forward_decode(
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        kv_cache_dtype: str,
        num_kv_heads: int,
        scale: float,
        alibi_slopes: torch.Tensor | None,
        k_scale: torch.Tensor | float = 1.0,
        v_scale: torch.Tensor | float = 1.0,
        tp_rank: int = 0,
        blocksparse_local_blocks: int = 0,
        blocksparse_vert_stride: int = 0,
        blocksparse_block_size: int = 64,
        blocksparse_head_sliding_step: int = 0,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """One query per sequence (`[S, Hq, D]`) at position `seq_lens[i] - 1`."""
        if blocksparse_vert_stride > 1:
            raise ValueError("Block-sparse attention is not supported by this backend")
        num_seqs = query.shape[0]
        max_seq_len = int(max_seq_len) if num_seqs else 0
        if num_seqs == 0 or max_seq_len == 0:
            return torch.zeros_like(query)
        seq_lens = seq_lens.to(torch.long)
        k, v = PagedAttention.gather_kv(
            key_cache, value_cache, block_tables, max_seq_len, kv_cache_dtype, k_scale, v_scale
        )
        k_pos = torch.arange(max_seq_len, device=query.device)
        out = _math.attend(
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
        return out[:, 0].to(query.dtype)

    @staticmethod
    def forward_prefix(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache_dtype: str,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens_tensor: torch.Tensor,
        max_query_len: int,
        alibi_slopes: torch.Tensor | None,
        sliding_window: int | None,
        k_scale: torch.Tensor | float = 1.0,
        v_scale: torch.Tensor | float = 1.0,
        *,
        scale: float | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Chunked prefill: new tokens over their cached prefix plus themselves, causally.

        vLLM's prefix kernel always used `head_size ** -0.5`; `scale=` overrides it.

        Sequence i's `q_len = query_start_loc[i+1] - query_start_loc[i]` new tokens sit at
        positions `seq_len - q_len ...`; its first `seq_len - q_len` keys come from the cache
        through `block_tables[i]`, the rest from `key` / `value` (`[T, Hkv, D]`).
        """
        num_seqs = seq_lens_tensor.shape[0]
        starts = query_start_loc.long().tolist()
        seq_lens = seq_lens_tensor.long().tolist()
        max_ctx = max((s - (starts[i + 1] - starts[i]) for i, s in enumerate(seq_lens)), default=0)
        if max_ctx > 0:
            ctx_k, ctx_v = PagedAttention.gather_kv(
                key_cache, value_cache, block_tables, max_ctx, kv_cache_dtype, k_scale, v_scale
            )
        output = torch.empty_like(query)
        for i in range(num_seqs):
            q0, q1 = starts[i], starts[i + 1]
            q_len, seq_len = q1 - q0, seq_lens[i]
            ctx_len = seq_len - q_len
            if q_len == 0:
                continue
            if ctx_len < 0:
                raise ValueError(
                    f"sequence {i} has {q_len} new tokens but seq_lens_tensor[{i}]={seq_len}"
                )
            keys = [key[q0:q1].float()]
            values = [value[q0:q1].float()]
            if ctx_len:
                keys.insert(0, ctx_k[i, :ctx_len])
                values.insert(0, ctx_v[i, :ctx_len])
            k = torch.cat(keys)[None]  # [1, seq_len, Hkv, D]
            v = torch.cat(values)[None]
            k_pos = torch.arange(seq_len, device=query.device)[None]
            out = _math.attend(
                query[None, q0:q1].float(),
                k,
                v,
                q_pos=torch.arange(ctx_len, seq_len, device=query.device)[None],
                k_pos=k_pos,
                k_valid=torch.ones_like(k_pos, dtype=torch.bool),
                scale=query.shape[-1] ** -0.5 if scale is None else scale,
                causal=True,
                alibi_slopes=alibi_slopes,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
            )
            output[q0:q1] = out[0].to(query.dtype)
        return output

    @staticmethod
    def swap_blocks(
        src_kv_cache: torch.Tensor, dst_kv_cache: torch.Tensor, src_to_dst: torch.Tensor
    ) -> None:
        """Copy blocks `src_to_dst[i, 0]` of src to `src_to_dst[i, 1]` of dst, for both the
        key and value halves; src and dst may be on different devices (CPU <-> CUDA)."""
        pairs = src_to_dst.to("cpu", torch.long)
        src_ids = pairs[:, 0].to(src_kv_cache.device)
        dst_ids = pairs[:, 1].to(dst_kv_cache.device)
        for half in range(2):
            blocks = src_kv_cache[half].index_select(0, src_ids)
            dst_kv_cache[half].index_copy_(0, dst_ids, blocks.to(dst_kv_cache.device))

    @staticmethod
    def copy_blocks(kv_caches: list[torch.Tensor], src_to_dists: torch.Tensor) -> None:
        """For every layer's `kv_cache`, copy block `src_to_dists[i, 0]` to `[i, 1]`."""
        pairs = src_to_dists.long()
        for kv_cache in kv_caches:
            src, dst = pairs[:, 0].to(kv_cache.device), pairs[:, 1].to(kv_cache.device)
            blocks = kv_cache[:, src].clone()  # read every source before any write
            kv_cache[:, dst] = blocks

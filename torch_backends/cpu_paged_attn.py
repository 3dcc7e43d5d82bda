"""vLLM V0's CPU paged-attention ops (`vllm/attention/ops/ipex_attn.py`'s `_PagedAttention`,
what vLLM's TORCH_SDPA calls on a CPU without IPEX), standalone.

The same cache layout and math as `paged_attn.PagedAttention` (the GPU-side file), with the
CPU file's signatures: every static method takes trailing `*args` (vLLM passes extras some
backends ignore), `forward_decode(output, query, ...)` fills `output` and returns None, and
the head-size list has no 120. `copy_blocks` takes vLLM's `[N, 2]` int64 tensor of
(src, dst) block pairs, which is what vLLM's CPU worker passes (the annotation in vLLM says
a dict, from an older API; a `{src: [dst, ...]}` dict is accepted too).

Where this differs from vLLM V0: `forward_decode` takes keyword-only `sliding_window` and
`logits_soft_cap` (vLLM's CPU kernel had neither) and applies them.
"""

import torch
from jaxtyping import Float, Int
from torch import Tensor

from torch_backends.layouts import Scale
from torch_backends.paged_attn import PagedAttention as _GpuFileOps
from torch_backends.paged_attn import decode
from torch_backends.shapes import BlockTables, KeysValues, SlotMapping

# vLLM V0's CPU paged ops list (no 120, unlike the GPU kernels').
_CPU_HEAD_SIZES = [32, 64, 80, 96, 112, 128, 192, 256]


class PagedAttention:
    @staticmethod
    def get_supported_head_sizes() -> list[int]:
        return list(_CPU_HEAD_SIZES)

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, *args
    ) -> tuple[int, ...]:
        return _GpuFileOps.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def split_kv_cache(
        kv_cache: Tensor, num_kv_heads: int, head_size: int, *args
    ) -> tuple[
        Float[Tensor, "num_blocks num_kv_heads head_size_over_x block_size x"],
        Float[Tensor, "num_blocks num_kv_heads head_size block_size"],
    ]:
        """`kv_cache[2, NB, BS*Hkv*D]` -> key `[NB, Hkv, D // x, BS, x]`, value
        `[NB, Hkv, D, BS]` (views), x = 16 // element_size."""
        return _GpuFileOps.split_kv_cache(kv_cache, num_kv_heads, head_size)

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
        *args,
    ) -> None:
        """Scatter `key[t]`, `value[t]` to slot `slot_mapping[t]` (-1 skips), in place; bad
        slots raise before anything is written (`paged_attn.PagedAttention`)."""
        _GpuFileOps.write_to_paged_cache(
            key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale
        )

    @staticmethod
    def forward_decode(
        output: Float[Tensor, "num_seqs num_heads head_size"],
        query: Float[Tensor, "num_seqs num_heads head_size"],
        key_cache: Tensor,
        value_cache: Tensor,
        block_tables: BlockTables,
        context_lens: Int[Tensor, " num_seqs"],
        max_context_len: int,
        kv_cache_dtype: str,
        num_kv_heads: int,
        scale: float,
        alibi_slopes: Float[Tensor, " num_heads"] | None,
        k_scale: Scale,
        v_scale: Scale,
        *args,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        """One query per sequence at position `context_lens[i] - 1`, written into `output`
        (in place by the native kernel where `output` is contiguous in the query's dtype)."""
        direct = output.is_contiguous() and output.dtype == query.dtype
        result = decode(
            query, key_cache, value_cache, block_tables, context_lens, max_context_len,
            kv_cache_dtype, scale, alibi_slopes, k_scale, v_scale,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
            out=output.view(query.shape) if direct else None,
        )  # fmt: skip
        if not direct:
            output.copy_(result.view(output.shape))

    @staticmethod
    def copy_blocks(
        kv_caches: list[Tensor], src_to_dists: Tensor | dict[int, list[int]], *args
    ) -> None:
        """For every layer's `kv_cache`, copy block `src_to_dists[i, 0]` to `[i, 1]` (or
        each `src` to every `dst` of a `{src: [dst, ...]}` dict)."""
        if isinstance(src_to_dists, dict):
            pairs = [(s, d) for s, dsts in src_to_dists.items() for d in dsts]
            src_to_dists = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)
        _GpuFileOps.copy_blocks(kv_caches, src_to_dists)

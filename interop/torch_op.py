"""The JAX core as torch ops, and the "JAX" torch backend built on them.

`torch.ops.jax_attn.paged_attention` and `torch.ops.jax_attn.varlen_attention` are
`torch.library.custom_op`s: tensors cross to JAX through DLPack (zero-copy where the layout
allows), `jax_attn` runs jitted, and the result comes back through DLPack. Each op has a fake
(meta) implementation, so `torch.compile(fullgraph=True)` traces through it and
`torch.library.opcheck` passes.

`JaxAttnBackend` ("JAX" in `get_attn_backend`) puts them behind vLLM V0's `AttentionImpl` API.
Its cache is the core's layout: `kv_cache[2, NB, BS*Hkv*D]` viewed as key and value caches of
`[NB, BS, Hkv, D]`. The cache write stays in torch (`index_put_`, in place): a JAX write
returns a new array, which would copy the whole cache every step.
"""

import jax.numpy as jnp
import torch

import jax_attn
from interop.dlpack import to_jax, to_torch
from torch_backends._step import PagedImpl
from torch_backends.abstract import AttentionImpl
from torch_backends.paged_attn import fp8_dtype
from torch_backends.torch_sdpa import (
    TorchSDPABackend,
    TorchSDPAMetadata,
    TorchSDPAMetadataBuilder,
)

# Sentinels for "off" in op schemas (custom ops take no Optional[int] defaults of None well
# under every torch version): sliding_window <= 0 and logits_soft_cap <= 0 mean none.


def _opt(value, off):
    return None if value is None or value <= off else value


@torch.library.custom_op("jax_attn::paged_attention", mutates_args=())
def paged_attention_op(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    causal: bool,
    alibi_slopes: torch.Tensor | None,
    sliding_window: int,
    logits_soft_cap: float,
    k_scale: float,
    v_scale: float,
) -> torch.Tensor:
    """`jax_attn.paged_attention` over torch tensors (caches `[NB, BS, Hkv, D]`)."""
    num_seqs = seq_lens.shape[0]
    md = jax_attn.RaggedMetadata(
        query_start_loc=to_jax(query_start_loc.to(torch.int32)),
        seq_lens=to_jax(seq_lens.to(torch.int32)),
        block_tables=to_jax(block_tables.to(torch.int32)),
        slot_mapping=jnp.full((query.shape[0],), -1, jnp.int32),  # already written
        num_seqs=jnp.asarray(num_seqs, jnp.int32),
    )
    out = jax_attn.paged_attention(
        to_jax(query),
        to_jax(key_cache),
        to_jax(value_cache),
        md,
        scale=scale,
        causal=causal,
        alibi_slopes=None if alibi_slopes is None else to_jax(alibi_slopes.float()),
        sliding_window=_opt(sliding_window, 0),
        logits_soft_cap=_opt(logits_soft_cap, 0.0),
        k_scale=k_scale,
        v_scale=v_scale,
        impl="auto",
    )
    # A fresh torch tensor: outputs of custom ops must not alias JAX-owned memory.
    return to_torch(out).clone()


@paged_attention_op.register_fake
def _(
    query,
    key_cache,
    value_cache,
    query_start_loc,
    seq_lens,
    block_tables,
    scale,
    causal,
    alibi_slopes,
    sliding_window,
    logits_soft_cap,
    k_scale,
    v_scale,
):
    return torch.empty_like(query)


@torch.library.custom_op("jax_attn::varlen_attention", mutates_args=())
def varlen_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    causal: bool,
    alibi_slopes: torch.Tensor | None,
    sliding_window: int,
    logits_soft_cap: float,
) -> torch.Tensor:
    """`jax_attn.varlen_attention` over torch tensors."""
    out = jax_attn.varlen_attention(
        to_jax(query),
        to_jax(key),
        to_jax(value),
        to_jax(cu_seqlens_q.to(torch.int32)),
        to_jax(cu_seqlens_k.to(torch.int32)),
        causal=causal,
        scale=scale,
        alibi_slopes=None if alibi_slopes is None else to_jax(alibi_slopes.float()),
        sliding_window=_opt(sliding_window, 0),
        logits_soft_cap=_opt(logits_soft_cap, 0.0),
    )
    return to_torch(out).clone()


@varlen_attention_op.register_fake
def _(
    query,
    key,
    value,
    cu_seqlens_q,
    cu_seqlens_k,
    scale,
    causal,
    alibi_slopes,
    sliding_window,
    logits_soft_cap,
):
    return torch.empty_like(query)


class JaxAttnBackend(TorchSDPABackend):
    """The JAX core behind vLLM V0's backend API; cache in the core's `[NB, BS, Hkv, D]`."""

    @staticmethod
    def get_name() -> str:
        return "JAX"

    @staticmethod
    def get_impl_cls() -> type["JaxAttnBackendImpl"]:
        return JaxAttnBackendImpl

    @staticmethod
    def get_metadata_cls() -> type[TorchSDPAMetadata]:
        return TorchSDPAMetadata

    @staticmethod
    def get_builder_cls() -> type[TorchSDPAMetadataBuilder]:
        return TorchSDPAMetadataBuilder


class JaxAttnBackendImpl(PagedImpl, AttentionImpl[TorchSDPAMetadata]):
    backend_name = "JAX"

    def _bias(self) -> dict:
        return dict(
            alibi_slopes=self.alibi_slopes,
            sliding_window=self.sliding_window or 0,
            logits_soft_cap=self.logits_soft_cap or 0.0,
        )

    def _scales(self, k_scale, v_scale) -> tuple[float, float]:
        if self.kv_cache_dtype == "auto":
            return 1.0, 1.0
        return float(k_scale), float(v_scale)

    def split_kv_cache(self, kv_cache):
        fp8 = fp8_dtype(self.kv_cache_dtype)
        if fp8 is not None:
            kv_cache = kv_cache.view(fp8)
        num_blocks = kv_cache.shape[1]
        shape = (num_blocks, -1, self.num_kv_heads, self.head_size)
        return kv_cache[0].view(shape), kv_cache[1].view(shape)

    def write_kv(self, key, value, key_cache, value_cache, slots, k_scale, v_scale) -> None:
        slots = slots.flatten().long()
        keep = slots >= 0
        block_size = key_cache.shape[1]
        block, offset = slots[keep] // block_size, slots[keep] % block_size
        k_scale, v_scale = self._scales(k_scale, v_scale)
        for cache, x, scale in ((key_cache, key, k_scale), (value_cache, value, v_scale)):
            x = x[keep]
            if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                info = torch.finfo(cache.dtype)
                x = (x.float() / scale).clamp(info.min, info.max)
            cache[block, offset] = x.to(cache.dtype)

    def gather_kv(self, key_cache, value_cache, block_tables, kv_len, k_scale, v_scale):
        k_scale, v_scale = self._scales(k_scale, v_scale)
        block_size = key_cache.shape[1]
        pos = torch.arange(kv_len)
        logical = (pos // block_size).clamp(max=max(block_tables.shape[1] - 1, 0))
        block = block_tables.long()[:, logical]  # [S, L]
        return (
            key_cache[block, pos % block_size].float() * k_scale,
            value_cache[block, pos % block_size].float() * v_scale,
        )

    def _paged(
        self, query, key_cache, value_cache, q_lens, seq_lens, tables, k_scale, v_scale
    ) -> torch.Tensor:
        k_scale, v_scale = self._scales(k_scale, v_scale)
        query_start_loc = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.as_tensor(q_lens).cumsum(0)
        return paged_attention_op(
            query.contiguous(),
            key_cache,
            value_cache,
            query_start_loc,
            torch.as_tensor(seq_lens, dtype=torch.int32),
            tables.to(torch.int32),
            self.scale,
            True,
            k_scale=k_scale,
            v_scale=v_scale,
            **self._bias(),
        )

    def decode(
        self, query, key_cache, value_cache, block_tables, seq_lens, max_len, k_scale, v_scale
    ) -> torch.Tensor:
        return self._paged(
            query,
            key_cache,
            value_cache,
            [1] * query.shape[0],
            seq_lens,
            block_tables,
            k_scale,
            v_scale,
        )

    def prefix(
        self, query, key, value, key_cache, value_cache, md, q_lens, kv_lens, k_scale, v_scale
    ) -> torch.Tensor:
        return self._paged(
            query,
            key_cache,
            value_cache,
            q_lens,
            kv_lens,
            md.prefill_block_tables,
            k_scale,
            v_scale,
        )

    def prefill(self, query, key, value, q_lens, kv_lens, causal) -> torch.Tensor:
        cu = [torch.zeros(len(q_lens) + 1, dtype=torch.int32) for _ in range(2)]
        cu[0][1:] = torch.as_tensor(q_lens).cumsum(0)
        cu[1][1:] = torch.as_tensor(kv_lens).cumsum(0)
        return varlen_attention_op(
            query.contiguous(),
            key.contiguous(),
            value.contiguous(),
            cu[0],
            cu[1],
            self.scale,
            causal,
            **self._bias(),
        )

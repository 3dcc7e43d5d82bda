"""The JAX core as torch ops, and the "JAX" torch backend built on them.

`torch.ops.jax_attn.paged_attention` and `torch.ops.jax_attn.varlen_attention` are
`torch.library.custom_op`s: tensors cross to JAX through DLPack (zero-copy where the layout
allows), `jax_attn` runs jitted, and the result comes back through DLPack. Each op has a fake
(meta) implementation, so `torch.compile(fullgraph=True)` traces through it and
`torch.library.opcheck` passes.

`JaxAttnBackend` ("JAX" in `get_attn_backend`) puts them behind vLLM V0's `AttentionImpl` API.
Its cache is the core's layout (`layouts.NhdLayout`): `kv_cache[2, NB, BS*Hkv*D]` viewed as key
and value caches of `[NB, BS, Hkv, D]`. The cache write stays in torch (`index_put_`, in
place): a JAX write returns a new array, which would copy the whole cache every step. A step
that uses the cache is one call of the ragged op over all its tokens, decodes and prefills
together, with the batch's own `query_start_loc`:

    |<---- prefill_0 ---->|<- prefill_1 ->|d0|d1|d2|   query_start_loc [0, 5, 8, 9, 10, 11]

Cache-less attention (encoder, encoder-only, vLLM's profiling run) goes through the varlen op.

On CPU, the first call warns (once) when torch's OpenMP workers will spin through the XLA calls
(`interop.omp`): set `GOMP_SPINCOUNT` before torch is imported (docs/interop.md, "Threads").
"""

import jax.numpy as jnp
import torch
from torch import Tensor

import jax_attn
from interop.dlpack import index_to_jax, to_jax, to_torch
from interop.omp import warn_if_spinning
from torch_backends.abstract import AttentionType
from torch_backends.host_batch import cumsum
from torch_backends.layouts import NhdLayout, PagedCache
from torch_backends.paged_backend import PagedBackend, PagedImpl, Step
from torch_backends.plan import StepPlan
from torch_backends.shapes import Queries
from torch_backends.torch_sdpa import TorchSDPAMetadata, TorchSDPAMetadataBuilder

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
    """`jax_attn.paged_attention` over torch tensors: query `[T, Hq, D]`, caches
    `[NB, BS, Hkv, D]`, query_start_loc i32 `[S + 1]`, seq_lens i32 `[S]`, block_tables i32
    `[S, max_blocks]` (any integer dtype: int64 values outside int32 raise `OverflowError`
    rather than wrap), alibi_slopes f32 `[Hq]`; returns `[T, Hq, D]`. (torch.library infers
    the op's schema from plain `torch.Tensor` annotations: the shapes live here.)"""
    if query.device.type == "cpu":
        warn_if_spinning()  # once: torch's OpenMP wait policy (interop/omp.py)
    num_seqs = seq_lens.shape[0]
    metadata = jax_attn.RaggedMetadata(
        query_start_loc=index_to_jax(query_start_loc, "query_start_loc"),
        seq_lens=index_to_jax(seq_lens, "seq_lens"),
        block_tables=index_to_jax(block_tables, "block_tables"),
        slot_mapping=jnp.full((query.shape[0],), -1, jnp.int32),  # already written
        num_seqs=jnp.asarray(num_seqs, jnp.int32),
    )
    out = jax_attn.paged_attention(
        to_jax(query),
        to_jax(key_cache),
        to_jax(value_cache),
        metadata,
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
    """`jax_attn.varlen_attention` over torch tensors: query `[Tq, Hq, D]`, key/value
    `[Tk, Hkv, D]`, cu_seqlens_q / cu_seqlens_k i32 `[S + 1]`; returns `[Tq, Hq, D]`."""
    if query.device.type == "cpu":
        warn_if_spinning()
    out = jax_attn.varlen_attention(
        to_jax(query),
        to_jax(key),
        to_jax(value),
        index_to_jax(cu_seqlens_q, "cu_seqlens_q"),
        index_to_jax(cu_seqlens_k, "cu_seqlens_k"),
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


class JaxAttnBackendImpl(PagedImpl[TorchSDPAMetadata]):
    backend_name = "JAX"
    layout_cls = NhdLayout

    @staticmethod
    def _one_call(plan: StepPlan, cache: PagedCache | None) -> bool:
        """Whether the whole step runs as one ragged call over the cache: every sequence
        has a table row covering all its keys (vLLM gives prefills rows only with chunked
        prefill or prefix caching; cross attention's first step gets `[S, 0]`), and every
        query fits bottom-right (cross attention may have decoder prefills longer than
        their encoder outputs, which only the varlen op takes)."""
        if cache is None or plan.block_tables is None or min(plan.ctx_lens, default=0) < 0:
            return False
        if not plan.num_prefills:
            return True
        width = plan.prefill_block_tables.shape[1]
        return max(plan.kv_lens, default=0) <= width * cache.block_size

    def prefill_cache_reads(
        self, plan: StepPlan, key: Tensor | None, cache: PagedCache | None
    ) -> list[int]:
        """In one ragged call, each prefill reads all of its keys from the cache."""
        if self._one_call(plan, cache):
            return plan.kv_lens
        return super().prefill_cache_reads(plan, key, cache)

    def attend(self, step: Step) -> Queries:
        plan, cache = step.plan, step.cache
        if self._one_call(plan, cache):
            return self._ragged(
                step.query, cache, plan.query_start_loc, plan.seq_lens, plan.block_tables
            )
        out = step.out
        if plan.num_prefill_tokens:  # no cache, or prefills without tables
            key, value = step.prefill_kv()
            out[plan.prefill_tokens] = varlen_attention_op(
                step.prefill_query.contiguous(),
                key.contiguous(),
                value.contiguous(),
                plan.prefill_query_start_loc,
                cumsum(plan.kv_lens),
                self.scale,
                plan.causal,
                **self._bias(),
            )
        if plan.num_decode_tokens:
            p = plan.num_prefills
            decode_loc = plan.query_start_loc[p:] - plan.num_prefill_tokens  # [0, 1, ..., D]
            out[plan.decode_tokens] = self._ragged(
                step.decode_query, cache, decode_loc, plan.decode_seq_lens, plan.decode_block_tables
            )
        return out

    def _ragged(
        self, query: Tensor, cache: PagedCache, query_start_loc, seq_lens, block_tables
    ) -> Tensor:
        """`query` (the tokens `query_start_loc` describes) over the cache, in one call; causal
        for decoder self-attention only (cross attention's queries see every encoder key)."""
        k_scale, v_scale = cache.scales
        return paged_attention_op(
            query.contiguous(),
            cache.key_cache,
            cache.value_cache,
            query_start_loc,
            seq_lens,
            block_tables,
            self.scale,
            self.attn_type == AttentionType.DECODER,
            k_scale=k_scale,
            v_scale=v_scale,
            **self._bias(),
        )

    def _bias(self) -> dict:
        return dict(
            alibi_slopes=self.alibi_slopes,
            sliding_window=self.sliding_window or 0,
            logits_soft_cap=self.logits_soft_cap or 0.0,
        )


class JaxAttnBackend(PagedBackend):
    """The JAX core behind vLLM V0's backend API; cache in the core's `[NB, BS, Hkv, D]`,
    metadata and builder TORCH_SDPA's."""

    @staticmethod
    def get_name() -> str:
        return "JAX"

    @staticmethod
    def get_impl_cls() -> type[JaxAttnBackendImpl]:
        return JaxAttnBackendImpl

    @staticmethod
    def get_metadata_cls() -> type[TorchSDPAMetadata]:
        return TorchSDPAMetadata

    @staticmethod
    def get_builder_cls() -> type[TorchSDPAMetadataBuilder]:
        return TorchSDPAMetadataBuilder

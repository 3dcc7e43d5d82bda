"""TORCH_SDPA: vLLM V0's CPU attention backend, standalone.

Prefill runs `torch.nn.functional.scaled_dot_product_attention` per sequence (with an additive
mask for ALiBi and sliding windows); prefill with a cached prefix (chunked prefill) and decode
read the paged cache through `PagedAttention`. Every attention type: DECODER (causal, paged),
ENCODER and ENCODER_ONLY (bidirectional, no cache), ENCODER_DECODER (decoder queries over the
encoder's keys, cached through `cross_slot_mapping` / `cross_block_tables`).

Token order in a step: prefill tokens first, then one token per decode sequence:

    |<---- prefill_0 ---->|<- prefill_1 ->|d0|d1|d2|

Where this differs from vLLM V0: the logits soft cap is applied (vLLM warned and ignored it;
SDPA cannot express it, so those prefills run the same math without SDPA), fp8 caches work
(vLLM's CPU backend refused them), and sliding windows also apply to decode and chunked
prefill rather than relying on the block manager dropping old blocks.
"""

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from torch_backends.abstract import (
    AttentionMetadata,
    AttentionType,
    check_attn_type,
)
from torch_backends.host_batch import HostBatch, HostBatchBuilder, cumsum, pad_tables
from torch_backends.layouts import SplitLayout
from torch_backends.paged_attn import PagedAttention, PagedAttentionMetadata
from torch_backends.paged_backend import PagedBackend, PagedImpl, Step, forward_decode
from torch_backends.plan import (
    SPLIT_FIELDS,
    CrossAttentionMetadata,
    StepPlan,
    cross_plan,
    encoder_plan,
    query_start_loc,
    require,
)
from torch_backends.shapes import KeysValues, Queries

PAD_SLOT_ID = -1

# vLLM V0 (v0.8.x) TORCH_SDPA: `PagedAttention.get_supported_head_sizes()` of its CPU paged ops.
_CPU_HEAD_SIZES = [32, 64, 80, 96, 112, 128, 192, 256]


@dataclasses.dataclass
class TorchSDPAMetadata(AttentionMetadata, PagedAttentionMetadata, CrossAttentionMetadata):
    """Metadata of one step. Decode fields (`seq_lens_tensor`, `max_decode_seq_len`,
    `block_tables`) describe only the decode sequences; prefill fields only the prefills."""

    # True when prefills may have a cached prefix (q_len < seq_len): then the prefill reads
    # the cache through `prefill_block_tables`.
    chunked_prefill: bool
    # Total length of each prefill sequence (cached prefix + new tokens).
    seq_lens: list[int] | None = None
    # Chunked prefill only:
    max_query_len: int | None = None
    max_kv_len: int | None = None
    prefill_query_start_loc: Tensor | None = None  # [num_prefills + 1]
    kv_start_loc: Tensor | None = None  # [num_prefills + 1]
    prefill_block_tables: Tensor | None = None  # [num_prefills, max_blocks]
    query_start_loc: Tensor | None = None
    # Encoder and encoder/decoder cross attention:
    encoder_seq_lens: list[int] | None = None
    encoder_seq_lens_tensor: Tensor | None = None
    max_encoder_seq_len: int | None = None
    num_encoder_tokens: int | None = None
    # Where the encoder's keys/values go in the cache, and where each decoder sequence's
    # encoder keys live (one table row per decoder sequence, all sequences).
    cross_slot_mapping: Tensor | None = None
    cross_block_tables: Tensor | None = None

    @property
    def is_all_encoder_attn_metadata_set(self) -> bool:
        return self.encoder_seq_lens is not None and self.num_encoder_tokens is not None

    @property
    def prefill_metadata(self) -> "TorchSDPAMetadata | None":
        return self if self.num_prefill_tokens > 0 or self.num_encoder_tokens else None

    @property
    def decode_metadata(self) -> "TorchSDPAMetadata | None":
        return self if self.num_decode_tokens > 0 else None

    def get_seq_lens(self, attn_type: str) -> tuple[list[int], list[int]]:
        """(query lengths, key lengths) of the prefill sequences for `attn_type`."""
        attn_type = check_attn_type(attn_type)
        if attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY):
            require(self.encoder_seq_lens, "encoder_seq_lens", attn_type)
            return self.encoder_seq_lens, self.encoder_seq_lens
        require(self.seq_lens, "seq_lens", attn_type)
        q_lens = self.seq_lens
        if self.prefill_query_start_loc is not None:
            q_lens = torch.diff(self.prefill_query_start_loc).tolist()
        if attn_type == AttentionType.ENCODER_DECODER:
            require(self.encoder_seq_lens, "encoder_seq_lens", attn_type)
            return q_lens, self.encoder_seq_lens[: self.num_prefills]
        return q_lens, self.seq_lens

    def step_plan(self, attn_type: str) -> StepPlan:
        """This step in the shared vocabulary (`plan.StepPlan`): decode fields describe the
        decode sequences only; prefills read a cached prefix through `prefill_block_tables`
        when `chunked_prefill` is set."""
        attn_type = check_attn_type(attn_type)
        if attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY):
            return encoder_plan(self, attn_type)
        # Prefills with no new token (empty sequences) still count: their rows are in the tables.
        prefills = self.num_prefill_tokens or self.num_prefills
        q_lens, kv_lens = self.get_seq_lens(attn_type) if prefills else ([], [])
        if attn_type == AttentionType.ENCODER_DECODER:
            return cross_plan(self, attn_type, q_lens)
        return StepPlan(
            attn_type=attn_type,
            num_prefills=self.num_prefills,
            num_prefill_tokens=self.num_prefill_tokens,
            num_decode_tokens=self.num_decode_tokens,
            slot_mapping=self.slot_mapping,
            q_lens=q_lens,
            kv_lens=kv_lens,
            query_start_loc=query_start_loc(self.query_start_loc, q_lens, self.num_decode_tokens),
            prefill_block_tables=self.prefill_block_tables if self.chunked_prefill else None,
            decode_block_tables=self.block_tables,
            decode_seq_lens=self.seq_lens_tensor,
            max_decode_seq_len=self.max_decode_seq_len,
            fields=SPLIT_FIELDS,
        )


class TorchSDPAMetadataBuilder(HostBatchBuilder[TorchSDPAMetadata]):
    """Builds `TorchSDPAMetadata` from per-sequence lengths and block tables (`build`'s
    keywords: see `HostBatchBuilder`). Decode fields describe only the decodes, prefill
    fields only the prefills; `chunked_prefill` (vLLM's runner setting) lets prefills read a
    cached prefix."""

    def __init__(self, input_builder: Any = None, *, chunked_prefill: bool = True) -> None:
        super().__init__(input_builder)
        self.chunked_prefill = chunked_prefill

    def metadata(self, batch: HostBatch) -> TorchSDPAMetadata:
        num_prefills = batch.num_prefills
        prefill_q, prefill_s = batch.query_lens[:num_prefills], batch.seq_lens[:num_prefills]
        decode_s = batch.seq_lens[num_prefills:]
        return TorchSDPAMetadata(
            **batch.common_fields(),
            seq_lens_tensor=torch.tensor(decode_s, dtype=torch.int32),
            max_decode_seq_len=max(decode_s, default=0),
            block_tables=pad_tables(batch.block_tables[num_prefills:]),
            chunked_prefill=self.chunked_prefill,
            seq_lens=prefill_s,
            max_query_len=max(prefill_q, default=0),
            max_kv_len=max(prefill_s, default=0),
            prefill_query_start_loc=cumsum(prefill_q),
            kv_start_loc=cumsum(prefill_s),
            prefill_block_tables=pad_tables(batch.block_tables[:num_prefills]),
            query_start_loc=cumsum(batch.query_lens),
            **batch.encoder_fields(),
        )


class TorchSDPABackendImpl(PagedImpl[TorchSDPAMetadata]):
    """Prefills through `scaled_dot_product_attention`, chunked prefill through
    `PagedAttention.forward_prefix`, decodes through `PagedAttention.forward_decode`."""

    backend_name = "Torch SPDA"  # vLLM's spelling, kept so its error messages match
    layout_cls = SplitLayout

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        """vLLM V0's TORCH_SDPA checked against its CPU paged ops
        (`vllm/attention/ops/ipex_attn.py`), whose list lacks 120."""
        return list(_CPU_HEAD_SIZES)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.need_mask = self.alibi_slopes is not None or self.sliding_window is not None

    def attend(self, step: Step) -> Queries:
        plan, out = step.plan, torch.empty_like(step.query)
        if plan.num_prefill_tokens and plan.has_cached_prefix:
            out[plan.prefill_tokens] = self._prefix(step)
        elif plan.num_prefill_tokens:
            out[plan.prefill_tokens] = self.prefill(step.prefill_query, *step.prefill_kv(), plan)
        if plan.num_decode_tokens:
            out[plan.decode_tokens] = forward_decode(self, step)
        return out

    def _prefix(self, step: Step) -> Queries:
        """Chunked prefill: the step's prefills over their cached prefix and themselves."""
        plan, cache, pre = step.plan, step.cache, step.plan.prefill_tokens
        return PagedAttention.forward_prefix(
            step.prefill_query,
            step.key[pre],
            step.value[pre],
            self.kv_cache_dtype,
            cache.key_cache,
            cache.value_cache,
            plan.prefill_block_tables,
            plan.prefill_query_start_loc,
            torch.tensor(plan.kv_lens),
            plan.max_query_len,
            self.alibi_slopes,
            self.sliding_window,
            cache.k_scale,
            cache.v_scale,
            scale=self.scale,
            logits_soft_cap=self.logits_soft_cap,
        )

    def prefill(
        self, query: Queries, key: KeysValues, value: KeysValues, plan: StepPlan
    ) -> Queries:
        """Per-sequence SDPA over the given keys (no cached prefix)."""
        q_lens, kv_lens, causal = plan.q_lens, plan.kv_lens, plan.causal
        if self.logits_soft_cap is not None or (self.need_mask and not causal):
            # SDPA takes no soft cap, and its masks here are causal: the same math without it.
            return self.masked_prefill(query, key, value, plan)
        output = torch.empty_like(query)
        q0 = k0 = 0
        masks = None
        if self.need_mask:  # causal here
            masks = (
                _make_alibi_bias(self.alibi_slopes, q_lens)
                if self.alibi_slopes is not None
                else _make_sliding_window_bias(q_lens, self.sliding_window, query.dtype)
            )
            if self.alibi_slopes is not None and self.sliding_window is not None:
                windows = _make_sliding_window_bias(q_lens, self.sliding_window, torch.float32)
                masks = [a + w for a, w in zip(masks, windows, strict=True)]
        for i, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
            q = query[q0 : q0 + q_len].movedim(0, 1)  # [Hq, q_len, D]
            k = key[k0 : k0 + kv_len].movedim(0, 1)  # [Hkv, kv_len, D]
            v = value[k0 : k0 + kv_len].movedim(0, 1)
            if kv_len == 0:
                out = torch.zeros_like(q)
            else:
                out = F.scaled_dot_product_attention(
                    q,
                    k,
                    v,
                    attn_mask=None if masks is None else masks[i],
                    is_causal=causal and masks is None,
                    scale=self.scale,
                    enable_gqa=self.num_queries_per_kv > 1,
                )
            output[q0 : q0 + q_len] = out.movedim(1, 0)
            q0, k0 = q0 + q_len, k0 + kv_len
        return output


def _make_alibi_bias(alibi_slopes: Tensor, seq_lens: list[int]) -> list[Tensor]:
    """Per prefill sequence: `[Hq, L, L]` ALiBi bias `slope * (p_k - p_q)`, -inf above the
    diagonal (causal). Float32 whatever the query dtype (SDPA adds a float32 mask to 16-bit
    logits): vLLM rounds it to the query dtype, which in bfloat16 moves a bias of 20 by up to
    0.06 and the output past bfloat16's tolerance (found by `jax-attn fuzz`)."""
    biases = []
    for seq_len in seq_lens:
        pos = torch.arange(seq_len, dtype=torch.float32)
        distance = pos[None, :] - pos[:, None]  # [L, L]: p_k - p_q
        bias = alibi_slopes.float()[:, None, None] * distance[None]
        biases.append(bias.masked_fill(distance[None] > 0, float("-inf")))
    return biases


def _make_sliding_window_bias(
    seq_lens: list[int], window_size: int | None, dtype: torch.dtype
) -> list[Tensor]:
    """Per prefill sequence: `[1, L, L]` of 0 where a query may attend (causal, within the
    window) and -inf elsewhere."""
    biases = []
    for seq_len in seq_lens:
        pos = torch.arange(seq_len)
        delta = pos[:, None] - pos[None, :]  # [L, L]: p_q - p_k
        keep = delta >= 0
        if window_size is not None:
            keep &= delta < window_size
        bias = torch.zeros(1, seq_len, seq_len, dtype=torch.float32)
        biases.append(bias.masked_fill(~keep[None], float("-inf")).to(dtype))
    return biases


class TorchSDPABackend(PagedBackend):
    """vLLM's paged split layout; prefills through SDPA."""

    name = "TORCH_SDPA"
    impl_cls = TorchSDPABackendImpl
    metadata_cls = TorchSDPAMetadata
    builder_cls = TorchSDPAMetadataBuilder

"""TORCH_SDPA: vLLM V0's CPU attention backend, standalone.

On the CPU every step runs the project's native kernels as torch ops: prefill, prefill over a
cached prefix (chunked prefill) and the prefills of a mixed step on the ragged kernel
(`ragged_prefill`: the step's own K/V read in place, or this step's blocks copied out of the
split cache token-major), decodes on the split-layout decode kernel (`PagedAttention`).
Where the native kernel cannot take a prefill (`ragged_prefill.unsupported`: the library not
built or `JAX_ATTN_CPU_DISABLE=1`, a device other than the CPU, another query dtype, a head size
above 256, cross attention with more decoder queries than encoder keys; the reason in
`impl.prefill_fallback`), it runs as vLLM's did: `torch.nn.functional.scaled_dot_product_attention`
per sequence (with an additive mask for ALiBi and sliding windows), a cached prefix through
`PagedAttention.forward_prefix`. Every attention type: DECODER (causal, paged),
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

from torch_backends import native, ragged_prefill
from torch_backends.abstract import (
    AttentionMetadata,
    AttentionType,
    check_attn_type,
)
from torch_backends.cpu_paged_attn import PagedAttention as CpuPagedAttention
from torch_backends.host_batch import HostBatch, HostBatchBuilder, cumsum, pad_tables
from torch_backends.layouts import SplitLayout
from torch_backends.paged_attn import PagedAttention, PagedAttentionMetadata
from torch_backends.paged_backend import PagedBackend, PagedImpl, Step, forward_decode
from torch_backends.plan import (
    SPLIT_FIELDS,
    CrossAttentionMetadata,
    StepPlan,
    cross_plan,
    encoder_only_lens,
    encoder_plan,
    query_start_loc,
    require,
)
from torch_backends.shapes import KeysValues, Queries

PAD_SLOT_ID = -1


@dataclasses.dataclass
class TorchSDPAMetadata(AttentionMetadata, PagedAttentionMetadata, CrossAttentionMetadata):
    """vLLM V0's `TorchSDPAMetadata`, field for field (order, defaults, meaning).

    Decode fields (`seq_lens_tensor`, `max_decode_seq_len`, `block_tables`) describe only the
    decode sequences; in a step without decodes vLLM's builder puts the prefills' lengths in
    `seq_lens_tensor` and an empty tensor in `block_tables`. Prefill fields describe only the
    prefills: `seq_lens` their total lengths and, when `chunked_prefill` is set (vLLM: chunked
    prefill or prefix caching enabled), `query_start_loc` / `kv_start_loc` the running sums of
    their query and kv lengths and `prefill_block_tables` their tables, through which a prefill
    reads its cached prefix.

        seq_lens [7, 3], query_start_loc [0, 2, 5]: prefill 0 has 5 cached + 2 new tokens,
        prefill 1 is a plain prefill of 3.

    ENCODER_ONLY attention reads `seq_lens`, ENCODER `encoder_seq_lens`, cross attention
    decoder `seq_lens` over `encoder_seq_lens`. `attn_bias` (set by `__post_init__`, as in
    vLLM) caches each attention type's prefill masks for the step.
    """

    chunked_prefill: bool
    seq_lens: list[int] | None = None  # For non-chunked prefill

    # For chunked prefill only
    max_query_len: int | None = None
    max_kv_len: int | None = None
    query_start_loc: Tensor | None = None  # [num_prefills + 1]
    kv_start_loc: Tensor | None = None  # [num_prefills + 1]
    prefill_block_tables: Tensor | None = None  # [num_prefills, max_blocks]

    # Encoder and encoder/decoder cross attention:
    encoder_seq_lens: list[int] | None = None
    encoder_seq_lens_tensor: Tensor | None = None
    max_encoder_seq_len: int | None = None
    num_encoder_tokens: int | None = None
    # Where the encoder's keys/values go in the cache (first step only), and each decoder
    # sequence's cross blocks (`[S, 0]` in the first step: nothing is read from the cache).
    cross_slot_mapping: Tensor | None = None
    cross_block_tables: Tensor | None = None

    def __post_init__(self):
        # Per attention type, the step's prefill masks, built by the first layer that needs
        # them (vLLM's fields; not part of __init__ or __repr__).
        self.attn_bias: list[Tensor | None] | None = None
        self.encoder_attn_bias: list[Tensor | None] | None = None
        self.cross_attn_bias: list[Tensor | None] | None = None

    @property
    def is_all_encoder_attn_metadata_set(self) -> bool:
        return (
            self.encoder_seq_lens is not None
            and self.encoder_seq_lens_tensor is not None
            and self.max_encoder_seq_len is not None
        )

    @property
    def prefill_metadata(self) -> "TorchSDPAMetadata | None":
        if self.num_prefill_tokens == 0:
            return None
        return self

    @property
    def decode_metadata(self) -> "TorchSDPAMetadata | None":
        if self.num_decode_tokens == 0:
            return None
        return self

    def get_seq_lens(self, attn_type: str) -> tuple[list[int] | None, list[int] | None]:
        """(query lengths, key lengths) of the prefill sequences of `attn_type`, as vLLM
        reads them (a chunked prefill's query length: `plan.StepPlan.q_lens`)."""
        attn_type = check_attn_type(attn_type)
        if attn_type in (AttentionType.DECODER, AttentionType.ENCODER_ONLY):
            return self.seq_lens, self.seq_lens
        if attn_type == AttentionType.ENCODER:
            return self.encoder_seq_lens, self.encoder_seq_lens
        return self.seq_lens, self.encoder_seq_lens

    def get_attn_bias(self, attn_type: str) -> list[Tensor | None] | None:
        """The prefill masks cached for `attn_type` this step (None until set)."""
        return getattr(self, _BIAS_FIELD[check_attn_type(attn_type)])

    def set_attn_bias(self, attn_bias: list[Tensor | None], attn_type: str) -> None:
        setattr(self, _BIAS_FIELD[check_attn_type(attn_type)], attn_bias)

    def get_seq_len_block_table_args(self, attn_type: str) -> tuple:
        """(seq_lens tensor, max seq len, block tables) the decode of `attn_type` reads:
        decoder self-attention its own fields, cross attention the encoder lengths and cross
        tables, encoder attention no tables."""
        attn_type = check_attn_type(attn_type)
        if attn_type in (AttentionType.DECODER, AttentionType.ENCODER_ONLY):
            return self.seq_lens_tensor, self.max_decode_seq_len, self.block_tables
        if attn_type == AttentionType.ENCODER_DECODER:
            return (
                self.encoder_seq_lens_tensor,
                self.max_encoder_seq_len,
                self.cross_block_tables,
            )
        return self.encoder_seq_lens_tensor, self.max_encoder_seq_len, None

    def step_plan(self, attn_type: str) -> StepPlan:
        """This step in the shared vocabulary (`plan.StepPlan`)."""
        attn_type = check_attn_type(attn_type)
        if attn_type == AttentionType.ENCODER:
            return encoder_plan(self, attn_type, self.encoder_seq_lens)
        if attn_type == AttentionType.ENCODER_ONLY:
            return encoder_plan(self, attn_type, encoder_only_lens(self))
        # Prefills with no new token (empty sequences) still count: their rows are in the tables.
        prefills = self.num_prefill_tokens or self.num_prefills
        kv_lens, q_lens = [], []
        if prefills:
            require(self.seq_lens, "seq_lens", attn_type)
            kv_lens = q_lens = list(self.seq_lens[: self.num_prefills])
            if self.chunked_prefill and self.query_start_loc is not None:
                q_lens = torch.diff(self.query_start_loc[: self.num_prefills + 1]).tolist()
        if attn_type == AttentionType.ENCODER_DECODER:
            return cross_plan(self, attn_type, q_lens)
        decodes = self.num_decode_tokens
        return StepPlan(
            attn_type=attn_type,
            num_prefills=self.num_prefills,
            num_prefill_tokens=self.num_prefill_tokens,
            num_decode_tokens=decodes,
            slot_mapping=self.slot_mapping,
            q_lens=q_lens,
            kv_lens=kv_lens,
            query_start_loc=query_start_loc(None, q_lens, decodes),
            prefill_block_tables=self.prefill_block_tables if self.chunked_prefill else None,
            decode_block_tables=self.block_tables if decodes else None,
            decode_seq_lens=self.seq_lens_tensor if decodes else None,
            max_decode_seq_len=self.max_decode_seq_len,
            fields=SPLIT_FIELDS,
        )


_BIAS_FIELD = {
    AttentionType.DECODER: "attn_bias",
    AttentionType.ENCODER_ONLY: "attn_bias",
    AttentionType.ENCODER: "encoder_attn_bias",
    AttentionType.ENCODER_DECODER: "cross_attn_bias",
}


class TorchSDPAMetadataBuilder(HostBatchBuilder[TorchSDPAMetadata]):
    """vLLM V0's builder: inside vLLM's engine it reads the CPU model runner's step
    (`input_builder.input_data`) and builds the same metadata vLLM's did; standalone
    (`input_builder=None`) `build` takes the block tables and block size as keywords.
    `chunked_prefill` is the runner's setting (chunked prefill or prefix caching): only then
    do prefills get `prefill_block_tables` and can read a cached prefix. Standalone it
    defaults to True."""

    def __init__(self, input_builder: Any, *, chunked_prefill: bool | None = None) -> None:
        super().__init__(input_builder)
        if chunked_prefill is not None:
            self.chunked_prefill = chunked_prefill

    def metadata(self, batch: HostBatch) -> TorchSDPAMetadata:
        p = batch.num_prefills
        prefill_q, prefill_s = batch.query_lens[:p], batch.seq_lens[:p]
        # vLLM's builder tests num_prefill_tokens; prefills with no new token (which its runner
        # never makes) need their query lengths too.
        chunked = self.chunked_prefill and batch.num_prefills != 0
        if batch.num_decode_tokens:
            seq_lens_tensor = torch.tensor(batch.seq_lens[p:], dtype=torch.int32)
            block_tables = pad_tables(batch.block_tables[p:])
        else:  # vLLM's builder: the prefills' lengths, no tables
            seq_lens_tensor = torch.tensor(prefill_s, dtype=torch.int32)
            block_tables = torch.tensor([])
        return TorchSDPAMetadata(
            **batch.common_fields(),
            seq_lens_tensor=seq_lens_tensor,
            max_decode_seq_len=max(batch.seq_lens[p:], default=0),
            block_tables=block_tables,
            chunked_prefill=self.chunked_prefill,
            seq_lens=prefill_s,
            max_query_len=max(prefill_q) if chunked else None,
            max_kv_len=max(prefill_s) if chunked else None,
            query_start_loc=cumsum(prefill_q) if chunked else None,
            kv_start_loc=cumsum(prefill_s) if chunked else None,
            prefill_block_tables=pad_tables(batch.block_tables[:p]) if chunked else None,
            **batch.encoder_fields(),
        )


class TorchSDPABackendImpl(PagedImpl[TorchSDPAMetadata]):
    """Prefills on the native ragged kernel (`native_prefill`), else through
    `scaled_dot_product_attention` and chunked prefill through `PagedAttention.forward_prefix`;
    decodes through `PagedAttention.forward_decode` (the math behind `cpu_paged_attn`, the ops
    file vLLM's TORCH_SDPA used)."""

    backend_name = "Torch SPDA"  # vLLM's spelling, kept so its error messages match
    layout_cls = SplitLayout

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        """vLLM V0's TORCH_SDPA checked against its CPU paged ops
        (`vllm/attention/ops/ipex_attn.py`), whose list lacks 120."""
        return CpuPagedAttention.get_supported_head_sizes()

    def configure(self) -> None:
        # Why the last step's prefills ran in torch rather than the native kernel (None: they
        # ran natively, or no step has run).
        self.prefill_fallback: str | None = None

    @property
    def need_mask(self) -> bool:
        return self.alibi_slopes is not None or self.sliding_window is not None

    def attend(self, step: Step) -> Queries:
        plan, out = step.plan, step.out
        if plan.num_prefill_tokens and self.native_prefill(step):
            pass  # written into out[prefill_tokens] by the native kernel
        elif plan.num_prefill_tokens and plan.has_cached_prefix:
            out[plan.prefill_tokens] = self._prefix(step)
        elif plan.num_prefill_tokens:
            out[plan.prefill_tokens] = self.prefill(step.prefill_query, *step.prefill_kv(), plan)
        if plan.num_decode_tokens:
            forward_decode(self, step)
        return out

    def native_prefill(self, step: Step) -> bool:
        """The step's prefills on the native ragged kernel (`ragged_prefill`), into their rows
        of `step.out`; False (nothing written) where the kernel cannot take them, the reason
        kept in `self.prefill_fallback` (None after a native step): then SDPA and
        `masked_attention` run them, as before the kernel was bound.

            |<- prefill_0 ->|<- prefill_1 ->|d0|d1|   the prefills here, decodes after

        A prefill with no cached prefix reads the step's own K/V in place; one over a cached
        prefix, or cross attention over the cached encoder, copies this step's blocks out
        of the split cache into token-major blocks first."""
        plan = step.plan
        reason = ragged_prefill.unsupported(step.query, plan.q_lens, plan.kv_lens)
        self.prefill_fallback = reason
        if reason is not None:
            return False
        attn = dict(
            scale=self.scale,
            causal=plan.causal,
            alibi_slopes=self.alibi_slopes,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
        )
        out, query = step.out[plan.prefill_tokens], step.prefill_query
        if step.key is not None and not plan.has_cached_prefix:
            kv = slice(0, sum(plan.kv_lens))  # the prefills' keys lead; decode tokens' follow
            ragged_prefill.from_kv(
                out, query, step.key[kv], step.value[kv], plan.q_lens, plan.kv_lens, **attn
            )
            return True
        cache, new = step.cache, step.key is not None
        if new and self._as_decodes(step, out, query, attn):
            return True
        ragged_prefill.from_split_cache(
            out,
            query,
            cache.key_cache,
            cache.value_cache,
            plan.prefill_block_tables,
            plan.q_lens,
            plan.kv_lens,
            plan.ctx_lens if new else plan.kv_lens,
            step.key[plan.prefill_tokens] if new else None,
            step.value[plan.prefill_tokens] if new else None,
            kv_cache_dtype=self.kv_cache_dtype,
            k_scale=cache.k_scale,
            v_scale=cache.v_scale,
            **attn,
        )
        return True

    def _as_decodes(self, step: Step, out: Queries, query: Queries, attn: dict) -> bool:
        """A step whose prefills all have a cached prefix and at most
        `ragged_prefill.MAX_DECODE_QUERIES` new tokens (speculative decoding's verify step; a
        prompt's last token after a prefix-cache hit) as decodes over the split cache in
        place, where this step wrote their keys where the tables read them; False (nothing
        written) otherwise. A step with a plain prefill takes the ragged kernel whole, so a
        plain prefill's output never depends on what its table row holds (vLLM's GPU
        builders leave it zeros)."""
        plan, cache = step.plan, step.cache
        block = cache.key_cache.shape[3]
        if not (
            plan.causal
            and plan.slot_mapping is not None
            and plan.prefill_block_tables is not None
            and all(plan.ctx_lens)
            and plan.max_query_len <= ragged_prefill.MAX_DECODE_QUERIES
            and native.decode_supported(query, cache.key_cache)
            and ragged_prefill.cache_holds_new_keys(
                plan.slot_mapping[plan.prefill_tokens],
                plan.prefill_block_tables,
                plan.q_lens,
                plan.kv_lens,
                block,
            )
        ):
            return False
        attn = {k: v for k, v in attn.items() if k != "causal"}
        ragged_prefill.as_decodes(
            out,
            query,
            cache.key_cache,
            cache.value_cache,
            plan.prefill_block_tables,
            plan.q_lens,
            plan.kv_lens,
            kv_cache_dtype=self.kv_cache_dtype,
            k_scale=cache.k_scale,
            v_scale=cache.v_scale,
            **attn,
        )
        return True

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
                _make_alibi_bias(self.alibi_slopes, query.dtype, q_lens)
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


def _make_alibi_bias(alibi_slopes: Tensor, dtype: torch.dtype, seq_lens: list[int]) -> list[Tensor]:
    """Per prefill sequence: `[Hq, L, L]` ALiBi bias `slope * (p_k - p_q)`, -inf above the
    diagonal (causal). Float32 whatever the query `dtype` (SDPA adds a float32 mask to 16-bit
    logits): vLLM counted positions in `dtype` (bfloat16 has no integer above 256 exactly) and
    rounded the bias to it, which in bfloat16 moves a bias of 20 by up to 0.06 and the output
    past bfloat16's tolerance (found by `jax-attn fuzz`). `dtype` stays in the signature."""
    del dtype  # vLLM's parameter; the bias is float32 on purpose (above)
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

    @staticmethod
    def get_name() -> str:
        return "TORCH_SDPA"

    @staticmethod
    def get_impl_cls() -> type[TorchSDPABackendImpl]:
        return TorchSDPABackendImpl

    @staticmethod
    def get_metadata_cls() -> type[TorchSDPAMetadata]:
        return TorchSDPAMetadata

    @staticmethod
    def get_builder_cls() -> type[TorchSDPAMetadataBuilder]:
        return TorchSDPAMetadataBuilder

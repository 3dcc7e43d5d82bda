"""IPEX: vLLM V0's Intel Extension for PyTorch backend, standalone, on IPEX's own kernels.

Kernels (IPEX 2.8, Intel's last release, CPU):
- cache write: `ipex.llm.modules.PagedAttention.reshape_and_cache`
- decode: `PagedAttention.single_query_cached_kv_attention`
- prefill: `ipex.llm.functional.varlen_attention` (float32), `flash_attn_varlen_func` over a
  scratch cache (bfloat16 / float16, window, soft cap)
- chunked prefill over a cached prefix: `PagedAttention.flash_attn_varlen_func`

Cache layout: `kv_cache[2, NB, BS * Hkv * D]` viewed as key and value caches of
`[NB, Hkv, BS, D]` each (IPEX's layout, as vLLM V0's IPEX backend viewed it).

Where this differs from vLLM V0 (on purpose, and tested):
- prefill honours ALiBi, the sliding window and the soft cap (vLLM V0 ignored them there),
  and bfloat16 / float16 prefills take their softmax in float32 (vLLM V0's varlen_attention
  kept it in the input dtype);
- what IPEX 2.8's kernels refuse or get wrong runs in float32 torch (`masked_attention`):
  ALiBi in prefill, a window together with a soft cap (the kernels assert), a window of 1
  (`window_size_left == 0` reads as no window); float16 queries over an e5m2 cache (which the
  e5m2 kernels refuse) read dequantized blocks;
- PAD_SLOT_ID (-1) entries are dropped before `reshape_and_cache`, which would otherwise
  write them into block 0 (measured with IPEX 2.8);
- fp8: IPEX 2.8 supports only `fp8_e5m2` caches and does not apply `k_scale`/`v_scale`
  consistently, so the scales are applied here (values stored as `x / scale`, the key scale
  folded into the softmax scale, the value scale into the output); `fp8`/`fp8_e4m3` raise.

IPEX 2.8 needs torch 2.8.*: this module checks the torch version before importing IPEX (on a
mismatch IPEX's own import fails in confusing ways) and raises an `ImportError` saying how to
get a working environment.
"""

import dataclasses

import torch
from torch import Tensor

from torch_backends.abstract import AttentionMetadata, check_attn_type
from torch_backends.host_batch import HostBatch, HostBatchBuilder, cumsum, pad_tables
from torch_backends.layouts import IpexLayout
from torch_backends.masked_attention import masked_attention
from torch_backends.paged_attn import PagedAttentionMetadata
from torch_backends.paged_backend import PagedBackend, PagedImpl, Step
from torch_backends.plan import CrossAttentionMetadata, StepPlan, per_sequence_plan
from torch_backends.shapes import KeysValues, Queries

_INSTALL = (
    "install it in its own environment: pip install 'jax-attn[ipex]' (torch 2.8.* + "
    "intel-extension-for-pytorch 2.8.0), e.g. `bash scripts/env.sh ipex`"
)
if not torch.__version__.startswith("2.8"):
    raise ImportError(
        f"The IPEX backend needs intel_extension_for_pytorch 2.8, which requires torch 2.8.*, "
        f"but torch {torch.__version__} is installed; {_INSTALL}"
    )
try:
    import intel_extension_for_pytorch as ipex  # noqa: F401 - registers the kernels
    from intel_extension_for_pytorch.llm import functional as ipex_functional
    from intel_extension_for_pytorch.llm.modules import PagedAttention as IpexPagedAttention
except ImportError as e:
    raise ImportError(f"The IPEX backend needs intel_extension_for_pytorch: {_INSTALL}") from e


@dataclasses.dataclass
class IpexAttnMetadata(AttentionMetadata, PagedAttentionMetadata, CrossAttentionMetadata):
    """vLLM V0's `IpexAttnMetadata` fields (`is_prompt`, `seq_lens`, `seqlen_q`,
    `max_seqlen`), plus optional fields vLLM's IPEX backend did not have, for what it did not
    support: chunked prefill, mixed prefill/decode steps, encoder and cross attention.

    vLLM's IPEX steps were all prompts (`is_prompt`, empty `block_tables`) or all decodes
    (`block_tables`, `seq_lens_tensor` per decode). Here `block_tables` / `seq_lens_tensor`
    have one row per sequence, prefills first, which is the same thing in both of those
    cases; prefills with block table rows read their cached prefix through them (vLLM raised
    "IPEX backend doesn't support prefix decoding").
    """

    # True if every sequence of the step is a prompt (informational here: the step is read
    # from the counts and lengths).
    is_prompt: bool
    # Prompt lengths (total kv length of each prefill; all sequences may be listed).
    seq_lens: list[int] | None
    # [num_prefills + 1] cumulative prompt lengths: seq_lens [3, 5] -> [0, 3, 8].
    seqlen_q: torch.Tensor | None
    max_seqlen: int | None
    # Extensions, keyword-only after vLLM's fields:
    _: dataclasses.KW_ONLY
    # Chunked prefill: [S + 1] cumulative new-token counts (query_lens [2, 5] -> [0, 2, 7]);
    # without it a prefill's query length is its seq_len.
    query_start_loc: torch.Tensor | None = None
    # Encoder and encoder/decoder cross attention (vLLM's IPEX backend had none):
    encoder_seq_lens: list[int] | None = None
    encoder_seq_lens_tensor: torch.Tensor | None = None
    max_encoder_seq_len: int | None = None
    num_encoder_tokens: int | None = None
    cross_slot_mapping: torch.Tensor | None = None
    cross_block_tables: torch.Tensor | None = None

    def __post_init__(self):
        # vLLM's per-step mask cache (not part of __init__); the masks are rebuilt per call.
        self.attn_bias: list[torch.Tensor] | None = None

    @property
    def is_all_encoder_attn_metadata_set(self) -> bool:
        return self.encoder_seq_lens is not None

    @property
    def prefill_metadata(self) -> "IpexAttnMetadata | None":
        return self if self.num_prefills > 0 else None

    @property
    def decode_metadata(self) -> "IpexAttnMetadata | None":
        return self if self.num_decode_tokens > 0 else None

    def step_plan(self, attn_type: str) -> StepPlan:
        return per_sequence_plan(self, check_attn_type(attn_type))


class IpexAttnMetadataBuilder(HostBatchBuilder[IpexAttnMetadata]):
    """Builds `IpexAttnMetadata` (vLLM V0 had no IPEX builder: its XPU runner filled the
    fields). Same `build` keywords as TORCH_SDPA's builder. A step of plain prompts gets
    empty `block_tables`, as in vLLM."""

    def metadata(self, batch: HostBatch) -> IpexAttnMetadata:
        p = batch.num_prefills
        plain_prompts = batch.num_decode_tokens == 0 and batch.seq_lens == batch.query_lens
        return IpexAttnMetadata(
            **batch.common_fields(),
            seq_lens_tensor=torch.tensor(batch.seq_lens, dtype=torch.int32),
            max_decode_seq_len=max(batch.seq_lens[p:], default=0),
            block_tables=pad_tables([] if plain_prompts else batch.block_tables),
            is_prompt=p > 0 and batch.num_decode_tokens == 0,
            seq_lens=batch.seq_lens,
            seqlen_q=cumsum(batch.seq_lens[:p]),
            max_seqlen=max(batch.seq_lens[:p], default=0),
            query_start_loc=cumsum(batch.query_lens),
            **batch.encoder_fields(),
        )


class IpexKernelLayout(IpexLayout):
    """IPEX's layout, written by IPEX's own `reshape_and_cache` kernel (pad slots are dropped
    before it: IPEX 2.8 would write them into block 0)."""

    def store(self, key_cache, value_cache, slots, key, value) -> None:
        if self.fp8 is not None:
            # Quantized as every backend does (torch's round-to-nearest-even, saturating), then
            # handed to IPEX as values it stores exactly: its own float -> e5m2 conversion
            # rounds some ties differently, and the cache bytes must match the other backends'.
            key, value = key.view(self.fp8).float(), value.view(self.fp8).float()
        IpexPagedAttention.reshape_and_cache(
            key.contiguous(), value.contiguous(), key_cache, value_cache, slots, self.kv_cache_dtype
        )


class IpexAttnBackendImpl(PagedImpl[IpexAttnMetadata]):
    backend_name = "IPEX"
    layout_cls = IpexKernelLayout

    def configure(self) -> None:
        if self.kv_cache_dtype not in ("auto", "fp8_e5m2"):
            raise NotImplementedError(
                f"IPEX 2.8 supports only 'auto' and 'fp8_e5m2' KV caches, got "
                f"kv_cache_dtype={self.kv_cache_dtype!r}"
            )
        self.fp8 = self.kv_cache_dtype == "fp8_e5m2"
        # Query head h reads kv head h // (Hq / Hkv).
        self.head_mapping = torch.arange(self.num_kv_heads, dtype=torch.int32)
        self.head_mapping = self.head_mapping.repeat_interleave(self.num_queries_per_kv)
        # What IPEX 2.8's kernels get wrong or refuse, run by the float32 torch math instead:
        # ALiBi in prefill (no kernel takes it); a window together with a soft cap (every
        # kernel asserts `!(window_size > 0 && use_softcap)`); a window of 1, i.e.
        # `window_size_left == 0`, which the kernels read as "no window".
        window = self.sliding_window
        self._window_unsupported = window is not None and (
            window == 1 or self.logits_soft_cap is not None
        )

    def _reads_fp8_natively(self, dtype: torch.dtype) -> bool:
        """IPEX 2.8's fp8_e5m2 kernels take float32 and bfloat16 queries; a float16 query
        over an e5m2 cache raises "expected scalar type Half but found Float8_e5m2"."""
        return self.fp8 and dtype != torch.float16

    def split_kv_cache(
        self, kv_cache: Tensor, num_kv_heads: int, head_size: int
    ) -> tuple[Tensor, Tensor]:
        """`[2, NB, BS*Hkv*D]` -> key, value caches `[NB, Hkv, BS, D]` (views)."""
        return IpexLayout(num_kv_heads, head_size).split(kv_cache)

    def prefill_cache_reads(self, plan: StepPlan, key, cache) -> list[int]:
        """A chunked prefill runs IPEX's paged varlen kernel, which reads every key of the
        sequence from the cache (its new ones written first)."""
        if plan.num_prefill_tokens and plan.has_cached_prefix:
            return plan.kv_lens
        return super().prefill_cache_reads(plan, key, cache)

    def attend(self, step: Step) -> Queries:
        """Prefills through `varlen_attention` (`flash_attn_varlen_func` over a scratch cache
        in bfloat16 / float16 or with a window or soft cap, float32 torch for what no kernel
        takes); chunked prefill and decodes through the paged kernels over the cache."""
        plan, out = step.plan, step.out
        if plan.num_prefill_tokens and plan.has_cached_prefix:
            out[plan.prefill_tokens] = self._prefix(step)
        elif plan.num_prefill_tokens:
            out[plan.prefill_tokens] = self.prefill(step.prefill_query, *step.prefill_kv(), plan)
        if plan.num_decode_tokens:
            out[plan.decode_tokens] = self._decode(step)
        return out

    def _decode(self, step: Step) -> Tensor:
        """One query per decode sequence over the cache; the scales kept out of the kernels
        (`k_scale` folded into the softmax scale, `v_scale` into the output)."""
        plan, cache, query = step.plan, step.cache, step.decode_query
        key_cache, value_cache, tables = (
            cache.key_cache,
            cache.value_cache,
            plan.decode_block_tables,
        )
        if self._window_unsupported:
            return self._masked_decode(step)
        lens = plan.decode_seq_lens.tolist()
        tables, lens = _from_window(
            tables, lens, [1] * len(lens), key_cache.shape[2], self.sliding_window
        )
        seq_lens = torch.tensor(lens, dtype=plan.decode_seq_lens.dtype)
        max_len = max(lens, default=0)
        k_scale, v_scale = cache.scales
        out = torch.empty_like(query)
        if self._reads_fp8_natively(query.dtype) and self.alibi_slopes is None:
            # single_query_cached_kv_attention needs the cache in the query's dtype; the
            # chunked-prefill kernel reads e5m2 and serves one query per sequence as well.
            num_seqs = query.shape[0]
            self._flash_varlen(
                out, query, key_cache, value_cache, torch.arange(num_seqs + 1, dtype=torch.int32),
                cumsum(seq_lens.tolist()), 1, max_len, k_scale, True, tables, self.kv_cache_dtype,
            )  # fmt: skip
            return _times(out, v_scale)
        if self.fp8:
            # The only kernel with ALiBi (single_query_cached_kv_attention) reads caches in the
            # query's dtype (and the e5m2 one refuses float16 queries): give it the blocks
            # this step reads, dequantized.
            key_cache, value_cache, tables = self._dequantized_blocks(cache, tables, query.dtype)
            k_scale = v_scale = 1.0
        IpexPagedAttention.single_query_cached_kv_attention(
            out,
            query.contiguous(),
            key_cache,
            value_cache,
            self.head_mapping,
            self.scale * k_scale,
            tables.int(),
            seq_lens.int(),
            key_cache.shape[2],
            max_len,
            self.alibi_slopes,
            self.sliding_window if self.sliding_window is not None else -1,
            1.0,
            1.0,
            self._soft_cap,
        )
        return _times(out, v_scale)

    def _prefix(self, step: Step) -> Tensor:
        """Chunked prefill: the new tokens' K/V are already in the cache (written first)."""
        plan, cache = step.plan, step.cache
        if (
            self.alibi_slopes is not None
            or self._window_unsupported
            or (self.fp8 and not self._reads_fp8_natively(step.query.dtype))
        ):  # no IPEX kernel: the same math in torch
            key, value = step.prefill_kv(torch.float32)
            return self.masked_prefill(step.prefill_query, key, value, plan)
        k_scale, v_scale = cache.scales
        out = torch.empty_like(step.prefill_query)
        tables, kv_lens = _from_window(
            plan.prefill_block_tables, plan.kv_lens, plan.q_lens, cache.key_cache.shape[2],
            self.sliding_window,
        )  # fmt: skip
        self._flash_varlen(
            out, step.prefill_query, cache.key_cache, cache.value_cache,
            plan.prefill_query_start_loc.int(), cumsum(kv_lens), max(plan.q_lens),
            max(kv_lens), k_scale, True, tables, self.kv_cache_dtype,
        )  # fmt: skip
        return _times(out, v_scale)

    def prefill(
        self, query: Queries, key: KeysValues, value: KeysValues, plan: StepPlan
    ) -> Queries:
        """Prefill without a cached prefix.

        IPEX's `varlen_attention` has no ALiBi, window or soft cap on CPU (it asserts), which
        is why vLLM V0's IPEX prefill ignored them. Plain float32 prefills use it; the others
        put the given K/V in a scratch paged cache and run `flash_attn_varlen_func`, which has
        all three but ALiBi (no IPEX CPU kernel takes ALiBi in prefill, nor a window together
        with a soft cap, nor a window of 1: the same math in float32 torch).
        """
        q_lens, kv_lens, causal = plan.q_lens, plan.kv_lens, plan.causal
        if sum(kv_lens) == 0:
            return torch.zeros_like(query)
        if self.alibi_slopes is not None or self._window_unsupported:
            return self.masked_prefill(query, key, value, plan)
        out = torch.empty_like(query)
        plain = self.sliding_window is None and self.logits_soft_cap is None
        if plain and query.dtype == torch.float32:
            # varlen_attention takes one kv head per query head (as vLLM V0 fed it), and on
            # CPU it ignores `softmax_scale` and uses 1/sqrt(head_size): the queries carry
            # the ratio instead. In bfloat16 / float16 it keeps the logits and softmax in
            # the input dtype (bfloat16 3e-2 off the float64 oracle, past the table's row;
            # measured), so those go through flash_attn_varlen_func below, which
            # accumulates in float32 (and measured no slower).
            group = self.num_queries_per_kv
            default = self.head_size**-0.5
            ipex_functional.varlen_attention(
                (query * (self.scale / default)).contiguous(),
                key.repeat_interleave(group, dim=1).contiguous(),  # [Tk, Hq, D]
                value.repeat_interleave(group, dim=1).contiguous(),
                out,
                cumsum(q_lens),
                cumsum(kv_lens),
                None,
                max(q_lens),
                max(kv_lens),
                0.0,
                self.scale,
                False,
                causal,
                False,
                None,
            )
        else:
            key_cache, value_cache, tables = self._scratch_cache(key, value, kv_lens)
            self._flash_varlen(
                out, query, key_cache, value_cache, cumsum(q_lens), cumsum(kv_lens),
                max(q_lens), max(kv_lens), 1.0, causal, tables, "auto",
            )  # fmt: skip
        # Sequences without keys (cross attention to an empty encoder) give zeros.
        q0 = 0
        for q_len, kv_len in zip(q_lens, kv_lens, strict=True):
            if kv_len == 0:
                out[q0 : q0 + q_len] = 0
            q0 += q_len
        return out

    def _masked_decode(self, step: Step) -> Tensor:
        """The decode tokens in float32 torch over the gathered (dequantized) cache."""
        plan, cache, query = step.plan, step.cache, step.decode_query
        seq_lens = plan.decode_seq_lens.long()
        keys, values = cache.gather(plan.decode_block_tables, int(plan.max_decode_seq_len))
        k_pos = torch.arange(keys.shape[1])[None].expand(len(seq_lens), -1)
        out = masked_attention(
            query.float()[:, None],
            keys,
            values,
            q_pos=(seq_lens - 1)[:, None],
            k_pos=k_pos,
            k_valid=k_pos < seq_lens[:, None],
            scale=self.scale,
            causal=True,
            alibi_slopes=self.alibi_slopes,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
        )
        return out[:, 0].to(query.dtype)

    @property
    def _soft_cap(self) -> float:
        return self.logits_soft_cap if self.logits_soft_cap is not None else -1.0

    def _flash_varlen(
        self, out, query, key_cache, value_cache, cu_q, cu_k, max_q, max_k, k_scale, causal,
        block_tables, kv_cache_dtype,
    ) -> None:  # fmt: skip
        """`flash_attn_varlen_func` into `out`, with this impl's window, soft cap and scale
        (times `k_scale`; the kernel's own k/v scales stay 1: IPEX 2.8 applies them
        inconsistently). ALiBi never reaches it (those paths run in torch)."""
        # IPEX's (window_size_left, window_size_right): keys `p_q - left .. p_q + right`.
        left = -1 if self.sliding_window is None else self.sliding_window - 1
        IpexPagedAttention.flash_attn_varlen_func(
            out,
            query.contiguous(),
            key_cache,
            value_cache,
            cu_q,
            cu_k,
            max_q,
            max_k,
            self.scale * k_scale,
            causal,
            block_tables.int(),
            None,
            left,
            0 if causal else -1,
            kv_cache_dtype,
            1.0,
            1.0,
            self._soft_cap,
        )

    def _scratch_cache(self, key, value, kv_lens, block_size: int = 16):
        """K/V `[Tk, Hkv, D]` laid out in a fresh `[NB, Hkv, BS, D]` cache, sequence after
        sequence, with the matching block tables."""
        blocks = [-(-n // block_size) for n in kv_lens]
        shape = (max(sum(blocks), 1), self.num_kv_heads, block_size, self.head_size)
        key_cache = torch.zeros(shape, dtype=key.dtype)
        value_cache = torch.zeros(shape, dtype=value.dtype)
        starts = [0, *torch.tensor(blocks).cumsum(0).tolist()]
        tables = torch.zeros(len(kv_lens), max(max(blocks), 1), dtype=torch.int32)
        slots = []
        for i, (n, first) in enumerate(zip(kv_lens, starts, strict=False)):
            tables[i, : blocks[i]] = torch.arange(first, first + blocks[i])
            slots += range(first * block_size, first * block_size + n)
        scratch = IpexKernelLayout(self.num_kv_heads, self.head_size)
        scratch.store(key_cache, value_cache, torch.tensor(slots), key, value)
        return key_cache, value_cache, tables

    def _dequantized_blocks(self, cache, block_tables, dtype):
        """The blocks `block_tables` reads, as `dtype` values (`stored * scale`), in a compact
        cache, with the tables renumbered into it.

        block_tables [[7, 2], [2, 0]] -> blocks [0, 2, 7] copied, tables [[2, 1], [1, 0]].
        """
        layout = cache.layout
        used, tables = torch.unique(block_tables.long(), return_inverse=True)
        k_scale, v_scale = cache.scales
        keys = layout.dequantize(layout.raw(cache.key_cache)[used], k_scale).to(dtype)
        values = layout.dequantize(layout.raw(cache.value_cache)[used], v_scale).to(dtype)
        return keys, values, tables.to(torch.int32)


def _times(out: Tensor, v_scale: float) -> Tensor:
    """The kernels' output times the value scale they did not apply."""
    return out if v_scale == 1.0 else (out.float() * v_scale).to(out.dtype)


def _from_window(
    tables: Tensor, kv_lens: list[int], q_lens: list[int], block_size: int, window: int | None
) -> tuple[Tensor, list[int]]:
    """Each sequence's table from its first block that holds a key of its first query's
    window, and its kv length shortened by the blocks left out: IPEX's paged kernels read
    whole blocks before the window (a zero weight times their values), and vLLM's engines free
    those blocks, pointing their table entries at a null block that may hold anything (NaN
    reached the output, found by NaN-filling them). Moving a sequence's positions by whole
    blocks changes no output: causality, the window and ALiBi see only p_q - p_k.

    window 4, block 4, kv_lens [13], q_lens [1]: keys 9-12 seen, blocks [0, 1] left out,
    table [[7, 3, 5, 1]] -> [[5, 1, 0, 0]], kv_lens [5].
    """
    if window is None:
        return tables, kv_lens
    skip = [
        max(kv - q - window + 1, 0) // block_size for kv, q in zip(kv_lens, q_lens, strict=True)
    ]
    if not any(skip):
        return tables, kv_lens
    shifted = torch.zeros_like(tables)
    for i, s in enumerate(skip):
        shifted[i, : tables.shape[1] - s] = tables[i, s:]
    return shifted, [kv - s * block_size for kv, s in zip(kv_lens, skip, strict=True)]


class IpexAttnBackend(PagedBackend):
    """IPEX's layout (`[NB, Hkv, BS, D]` key and value caches) and kernels."""

    @staticmethod
    def get_name() -> str:
        return "IPEX"

    @staticmethod
    def get_impl_cls() -> type[IpexAttnBackendImpl]:
        return IpexAttnBackendImpl

    @staticmethod
    def get_metadata_cls() -> type[IpexAttnMetadata]:
        return IpexAttnMetadata

    @staticmethod
    def get_builder_cls() -> type[IpexAttnMetadataBuilder]:
        """Not in vLLM V0 (its XPU runner filled the metadata itself)."""
        return IpexAttnMetadataBuilder

    @staticmethod
    def split_kv_cache(kv_cache: Tensor, num_kv_heads: int, head_size: int):
        """`[2, NB, BS*Hkv*D]` -> key, value caches `[NB, Hkv, BS, D]` (vLLM's
        `_IPEXPagedAttention.split_kv_cache`)."""
        return IpexLayout(num_kv_heads, head_size).split(kv_cache)

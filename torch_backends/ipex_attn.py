"""IPEX: vLLM V0's Intel Extension for PyTorch backend, standalone, on IPEX's own kernels.

Kernels (IPEX 2.8, Intel's last release, CPU):
- cache write: `ipex.llm.modules.PagedAttention.reshape_and_cache`
- decode: `PagedAttention.single_query_cached_kv_attention`
- prefill: `ipex.llm.functional.varlen_attention`
- chunked prefill over a cached prefix: `PagedAttention.flash_attn_varlen_func`

Cache layout: `kv_cache[2, NB, BS * Hkv * D]` viewed as key and value caches of
`[NB, Hkv, BS, D]` each (IPEX's layout, as vLLM V0's IPEX backend viewed it).

Where this differs from vLLM V0 (on purpose, and tested):
- prefill honours ALiBi, the sliding window and the soft cap (vLLM V0 ignored them there);
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
from typing import Any

import torch

from torch_backends import _math
from torch_backends._batch import (
    HostBatch,
    StepPlan,
    all_seqs_plan,
    cumsum,
    encoder_plan,
    pad_tables,
    require,
)
from torch_backends._step import PagedImpl
from torch_backends.abstract import (
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    check_attn_type,
)
from torch_backends.paged_attn import PagedAttentionMetadata, quantize
from torch_backends.torch_sdpa import TorchSDPABackend

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


class IpexAttnBackend(TorchSDPABackend):
    @staticmethod
    def get_name() -> str:
        return "IPEX"

    @staticmethod
    def get_impl_cls() -> type["IpexAttnBackendImpl"]:
        return IpexAttnBackendImpl

    @staticmethod
    def get_metadata_cls() -> type["IpexAttnMetadata"]:
        return IpexAttnMetadata

    @staticmethod
    def get_builder_cls() -> type["IpexAttnMetadataBuilder"]:
        return IpexAttnMetadataBuilder

    @staticmethod
    def split_kv_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int):
        """`[2, NB, BS*Hkv*D]` -> key, value caches `[NB, Hkv, BS, D]`."""
        num_blocks = kv_cache.shape[1]
        key_cache = kv_cache[0].view(num_blocks, num_kv_heads, -1, head_size)
        value_cache = kv_cache[1].view(num_blocks, num_kv_heads, -1, head_size)
        return key_cache, value_cache


@dataclasses.dataclass
class IpexAttnMetadata(AttentionMetadata, PagedAttentionMetadata):
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

    @property
    def is_all_encoder_attn_metadata_set(self) -> bool:
        return self.encoder_seq_lens is not None

    @property
    def is_all_cross_attn_metadata_set(self) -> bool:
        return (
            self.is_all_encoder_attn_metadata_set
            and self.cross_slot_mapping is not None
            and self.cross_block_tables is not None
        )

    @property
    def prefill_metadata(self) -> "IpexAttnMetadata | None":
        return self if self.num_prefills > 0 else None

    @property
    def decode_metadata(self) -> "IpexAttnMetadata | None":
        return self if self.num_decode_tokens > 0 else None

    def step_plan(self, attn_type: str) -> StepPlan:
        attn_type = check_attn_type(attn_type)
        if attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY):
            return encoder_plan(self, attn_type)
        p = self.num_prefills
        q_lens = seq_lens = []
        if self.num_prefill_tokens:
            require(self.seq_lens, "seq_lens", attn_type)
            seq_lens = list(self.seq_lens[:p])
            q_lens = seq_lens
            if self.query_start_loc is not None:
                q_lens = torch.diff(self.query_start_loc[: p + 1]).tolist()
        return all_seqs_plan(self, attn_type, q_lens, seq_lens)


class IpexAttnMetadataBuilder(AttentionMetadataBuilder[IpexAttnMetadata]):
    """Builds `IpexAttnMetadata` (vLLM V0 had no IPEX builder: its XPU runner filled the
    fields). Same `build` keywords as TORCH_SDPA's builder. A step of plain prompts gets
    empty `block_tables`, as in vLLM."""

    def __init__(self, input_builder: Any = None) -> None:
        self.input_builder = input_builder

    def build(
        self,
        seq_lens: list[int],
        query_lens: list[int],
        cuda_graph_pad_size: int = -1,
        batch_size: int = -1,
        *,
        block_tables: list[list[int]],
        block_size: int,
        encoder_seq_lens: list[int] | None = None,
        cross_block_tables: list[list[int]] | None = None,
    ) -> IpexAttnMetadata:
        batch = HostBatch.from_lists(
            seq_lens, query_lens, block_tables, block_size, encoder_seq_lens, cross_block_tables
        )
        p = batch.num_prefills
        plain_prompts = batch.num_decode_tokens == 0 and batch.seq_lens == batch.query_lens
        return IpexAttnMetadata(
            num_prefills=p,
            num_prefill_tokens=batch.num_prefill_tokens,
            num_decode_tokens=batch.num_decode_tokens,
            slot_mapping=torch.tensor(batch.slot_mapping, dtype=torch.long),
            multi_modal_placeholder_index_maps=None,
            enable_kv_scales_calculation=False,
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


_E5M2 = torch.float8_e5m2


class IpexAttnBackendImpl(PagedImpl, AttentionImpl[IpexAttnMetadata]):
    backend_name = "IPEX"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.kv_cache_dtype not in ("auto", "fp8_e5m2"):
            raise NotImplementedError(
                f"IPEX 2.8 supports only 'auto' and 'fp8_e5m2' KV caches, got "
                f"kv_cache_dtype={self.kv_cache_dtype!r}"
            )
        self.fp8 = self.kv_cache_dtype == "fp8_e5m2"
        # Query head h reads kv head h // (Hq / Hkv).
        self.head_mapping = torch.arange(self.num_kv_heads, dtype=torch.int32)
        self.head_mapping = self.head_mapping.repeat_interleave(self.num_queries_per_kv)

    # -- cache hooks ------------------------------------------------------------------------

    def split_kv_cache(self, kv_cache):
        if self.fp8:
            kv_cache = kv_cache.view(_E5M2)
        return IpexAttnBackend.split_kv_cache(kv_cache, self.num_kv_heads, self.head_size)

    def _scales(self, k_scale, v_scale) -> tuple[float, float]:
        """(key, value) scales the kernels must not see: 1.0 unless the cache is fp8."""
        if not self.fp8:
            return 1.0, 1.0
        return float(k_scale), float(v_scale)

    def write_kv(self, key, value, key_cache, value_cache, slots, k_scale, v_scale) -> None:
        slots = slots.flatten().long()
        keep = slots >= 0  # IPEX writes pad slots into block 0: drop them here
        key, value, slots = key[keep], value[keep], slots[keep]
        k_scale, v_scale = self._scales(k_scale, v_scale)
        if self.fp8:
            # Quantize as the other backends do (torch's round-to-nearest-even, saturating)
            # and hand IPEX values it stores exactly: its own float -> e5m2 conversion rounds
            # some ties differently, and the cache bytes must match the other backends'.
            key = quantize(key, "fp8_e5m2", k_scale).view(_E5M2).float()
            value = quantize(value, "fp8_e5m2", v_scale).view(_E5M2).float()
        IpexPagedAttention.reshape_and_cache(
            key.contiguous(),
            value.contiguous(),
            key_cache,
            value_cache,
            slots,
            self.kv_cache_dtype,
        )

    def gather_kv(self, key_cache, value_cache, block_tables, kv_len, k_scale, v_scale):
        """`[S, kv_len, Hkv, D]` float32 keys/values through the block tables."""
        k_scale, v_scale = self._scales(k_scale, v_scale)
        block_size = key_cache.shape[2]
        pos = torch.arange(kv_len)
        logical = (pos // block_size).clamp(max=max(block_tables.shape[1] - 1, 0))
        block = block_tables.long()[:, logical]  # [S, L]
        k = _index(key_cache, (block, slice(None), pos % block_size))  # [S, L, Hkv, D]
        v = _index(value_cache, (block, slice(None), pos % block_size))
        return k.float() * k_scale, v.float() * v_scale

    def decode(
        self, query, key_cache, value_cache, block_tables, seq_lens, max_len, k_scale, v_scale
    ) -> torch.Tensor:
        k_scale, v_scale = self._scales(k_scale, v_scale)
        out = torch.empty_like(query)
        if self.fp8 and self.alibi_slopes is not None:
            # The only kernel with ALiBi (single_query_cached_kv_attention) reads caches in the
            # query's dtype: give it the blocks this step reads, dequantized.
            key_cache, value_cache, block_tables = _dequantized_blocks(
                key_cache, value_cache, block_tables, query.dtype, k_scale, v_scale
            )
            k_scale = v_scale = 1.0
        elif self.fp8:
            # single_query_cached_kv_attention needs the cache in the query's dtype; the
            # chunked-prefill kernel reads e5m2 and serves one query per sequence as well.
            num_seqs = query.shape[0]
            left, right = self._window(causal=True)
            IpexPagedAttention.flash_attn_varlen_func(
                out,
                query.contiguous(),
                key_cache,
                value_cache,
                torch.arange(num_seqs + 1, dtype=torch.int32),
                cumsum(seq_lens.tolist()),
                1,
                int(max_len),
                self.scale * k_scale,
                True,
                block_tables.int(),
                None,
                left,
                right,
                self.kv_cache_dtype,
                1.0,
                1.0,
                self.logits_soft_cap if self.logits_soft_cap is not None else -1.0,
            )
            return (out.float() * v_scale).to(query.dtype)
        IpexPagedAttention.single_query_cached_kv_attention(
            out,
            query.contiguous(),
            key_cache,
            value_cache,
            self.head_mapping,
            self.scale * k_scale,
            block_tables.int(),
            seq_lens.int(),
            key_cache.shape[2],
            int(max_len),
            self.alibi_slopes,
            self.sliding_window if self.sliding_window is not None else -1,
            1.0,
            1.0,
            self.logits_soft_cap if self.logits_soft_cap is not None else -1.0,
        )
        return out if v_scale == 1.0 else (out.float() * v_scale).to(query.dtype)

    def prefix(
        self, query, key, value, key_cache, value_cache, md, q_lens, kv_lens, k_scale, v_scale
    ) -> torch.Tensor:
        """Chunked prefill: the new tokens' K/V are already in the cache (written first)."""
        k_scale, v_scale = self._scales(k_scale, v_scale)
        if self.alibi_slopes is not None:  # no IPEX kernel: the same math in torch
            ctx_lens = [k - q for q, k in zip(q_lens, kv_lens, strict=True)]
            ctx_k, ctx_v = self.gather_kv(
                key_cache, value_cache, md.prefill_block_tables, max(ctx_lens), 1.0, 1.0
            )
            keys, values, q0 = [], [], 0
            for i, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens, strict=True)):
                keys += [ctx_k[i, :ctx] * k_scale, key[q0 : q0 + q_len].float()]
                values += [ctx_v[i, :ctx] * v_scale, value[q0 : q0 + q_len].float()]
                q0 += q_len
            return _reference_prefill(
                self, query, torch.cat(keys), torch.cat(values), q_lens, kv_lens, causal=True
            )
        out = torch.empty_like(query)
        left, right = self._window(causal=True)
        IpexPagedAttention.flash_attn_varlen_func(
            out,
            query.contiguous(),
            key_cache,
            value_cache,
            md.prefill_query_start_loc.int(),
            cumsum(kv_lens),
            max(q_lens),
            max(kv_lens),
            self.scale * k_scale,
            True,
            md.prefill_block_tables.int(),
            None,  # ALiBi took the torch path above
            left,
            right,
            self.kv_cache_dtype,
            1.0,
            1.0,
            self.logits_soft_cap if self.logits_soft_cap is not None else -1.0,
        )
        return out if v_scale == 1.0 else (out.float() * v_scale).to(query.dtype)

    def prefill(self, query, key, value, q_lens, kv_lens, causal) -> torch.Tensor:
        """Prefill without a cached prefix.

        IPEX's `varlen_attention` has no ALiBi, window or soft cap on CPU (it asserts), which
        is why vLLM V0's IPEX prefill ignored them. Plain prefills use it; the others put the
        given K/V in a scratch paged cache and run `flash_attn_varlen_func`, which has all
        three.
        """
        if sum(kv_lens) == 0:
            return torch.zeros_like(query)
        out = torch.empty_like(query)
        if (
            self.alibi_slopes is None
            and self.sliding_window is None
            and (self.logits_soft_cap is None)
        ):
            # varlen_attention takes one kv head per query head (as vLLM V0 fed it), and on
            # CPU it ignores `softmax_scale` and uses 1/sqrt(head_size): the queries carry
            # the ratio instead.
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
        elif self.alibi_slopes is not None:
            # No IPEX CPU kernel takes ALiBi in prefill: the same math in torch.
            return _reference_prefill(self, query, key, value, q_lens, kv_lens, causal)
        else:
            key_cache, value_cache, tables = self._scratch_cache(key, value, kv_lens)
            left, right = self._window(causal)
            IpexPagedAttention.flash_attn_varlen_func(
                out,
                query.contiguous(),
                key_cache,
                value_cache,
                cumsum(q_lens),
                cumsum(kv_lens),
                max(q_lens),
                max(kv_lens),
                self.scale,
                causal,
                tables,
                None,  # ALiBi took the torch path above
                left,
                right,
                "auto",
                1.0,
                1.0,
                self.logits_soft_cap if self.logits_soft_cap is not None else -1.0,
            )
        # Sequences without keys (cross attention to an empty encoder) give zeros.
        q0 = 0
        for q_len, kv_len in zip(q_lens, kv_lens, strict=True):
            if kv_len == 0:
                out[q0 : q0 + q_len] = 0
            q0 += q_len
        return out

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
        IpexPagedAttention.reshape_and_cache(
            key.contiguous(),
            value.contiguous(),
            key_cache,
            value_cache,
            torch.tensor(slots),
            "auto",
        )
        return key_cache, value_cache, tables

    def _window(self, causal: bool) -> tuple[int, int]:
        """IPEX's (window_size_left, window_size_right): keys `p_q - left .. p_q + right`."""
        left = -1 if self.sliding_window is None else self.sliding_window - 1
        return left, 0 if causal else -1


def _index(cache: torch.Tensor, index) -> torch.Tensor:
    """`cache[index]`; torch 2.8 has no CPU indexing for float8, so fp8 goes through bytes."""
    if cache.dtype == _E5M2:
        return cache.view(torch.uint8)[index].view(_E5M2)
    return cache[index]


def _dequantized_blocks(key_cache, value_cache, block_tables, dtype, k_scale, v_scale):
    """The blocks `block_tables` reads, as `dtype` values (`stored * scale`), in a compact
    cache, with the tables renumbered into it.

    block_tables [[7, 2], [2, 0]] -> blocks [0, 2, 7] copied, tables [[2, 1], [1, 0]].
    """
    used, tables = torch.unique(block_tables.long(), return_inverse=True)
    keys = (_index(key_cache, used).float() * k_scale).to(dtype)  # [U, Hkv, BS, D]
    values = (_index(value_cache, used).float() * v_scale).to(dtype)
    return keys, values, tables.to(torch.int32)


def _reference_prefill(impl, query, key, value, q_lens, kv_lens, causal) -> torch.Tensor:
    """Prefill in float32 torch (`torch_backends._math`), for what IPEX has no kernel for."""
    out = torch.empty_like(query)
    q0 = k0 = 0
    for q_len, kv_len in zip(q_lens, kv_lens, strict=True):
        k_pos = torch.arange(kv_len)[None]
        out[q0 : q0 + q_len] = _math.attend(
            query[None, q0 : q0 + q_len].float(),
            key[None, k0 : k0 + kv_len].float(),
            value[None, k0 : k0 + kv_len].float(),
            q_pos=torch.arange(kv_len - q_len, kv_len)[None],
            k_pos=k_pos,
            k_valid=torch.ones_like(k_pos, dtype=torch.bool),
            scale=impl.scale,
            causal=causal,
            alibi_slopes=impl.alibi_slopes,
            sliding_window=impl.sliding_window,
            logits_soft_cap=impl.logits_soft_cap,
        )[0].to(query.dtype)
        q0, k0 = q0 + q_len, k0 + kv_len
    return out

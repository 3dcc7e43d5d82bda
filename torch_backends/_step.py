"""`PagedImpl`: the step logic shared by the torch backends' `AttentionImpl`s.

One `forward` routes a step for every attention type:

    DECODER          write new K/V -> prefills (prefill / chunked `prefix`) -> decodes
    ENCODER(_ONLY)   no cache: bidirectional prefill over the given K/V
    ENCODER_DECODER  write the encoder K/V (cross_slot_mapping) when given -> decoder
                     prefills over them -> decodes over the cached encoder K/V

A backend provides `prefill` and may override the cache hooks (`split_kv_cache`, `write_kv`,
`gather_kv`, `decode`, `prefix`); the defaults use vLLM's split layout (`PagedAttention`).
"""

from typing import Any

import torch

from torch_backends._batch import StepPlan
from torch_backends.abstract import AttentionLayer, AttentionType, check_attn_type
from torch_backends.paged_attn import PagedAttention, dequantize, fp8_dtype, quantize


def check_impl_args(
    backend: str,
    supported_head_sizes: list[int],
    num_heads: int,
    head_size: int,
    num_kv_heads: int | None,
    alibi_slopes,
    blocksparse_params,
    kv_cache_dtype: str,
) -> int:
    """The checks every backend's impl makes, with vLLM's messages; returns num_kv_heads."""
    if blocksparse_params is not None:
        raise ValueError(f"{backend} does not support block-sparse attention.")
    if head_size not in supported_head_sizes:
        raise ValueError(
            f"Head size {head_size} is not supported by PagedAttention. "
            f"Supported head sizes are: {supported_head_sizes}."
        )
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be divisible by {num_kv_heads=}")
    if alibi_slopes is not None and len(alibi_slopes) != num_heads:
        raise ValueError(f"{len(alibi_slopes)} alibi_slopes for num_heads={num_heads}")
    fp8_dtype(kv_cache_dtype)  # raises on an unknown cache dtype
    return num_kv_heads


class PagedImpl:
    backend_name = "paged"

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        blocksparse_params: dict[str, Any] | None = None,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
    ) -> None:
        self.num_kv_heads = check_impl_args(
            self.backend_name,
            self.get_supported_head_sizes(),
            num_heads,
            head_size,
            num_kv_heads,
            alibi_slopes,
            blocksparse_params,
            kv_cache_dtype,
        )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.alibi_slopes = (
            None if alibi_slopes is None else torch.as_tensor(alibi_slopes, dtype=torch.float32)
        )
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = logits_soft_cap
        self.attn_type = check_attn_type(attn_type)
        self.num_queries_per_kv = num_heads // self.num_kv_heads

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        """The head sizes vLLM V0's backend accepted: its paged kernels' list."""
        return PagedAttention.get_supported_head_sizes()

    # -- hooks a backend may override ------------------------------------------------------

    def as_cached(self, x: torch.Tensor, scale) -> torch.Tensor:
        """`x` as a read from this cache returns it (in `x`'s dtype); `x` if not fp8."""
        if self.kv_cache_dtype == "auto":
            return x
        return dequantize(quantize(x, self.kv_cache_dtype, scale), self.kv_cache_dtype, scale).to(
            x.dtype
        )

    def split_kv_cache(self, kv_cache: torch.Tensor):
        return PagedAttention.split_kv_cache(kv_cache, self.num_kv_heads, self.head_size)

    def write_kv(self, key, value, key_cache, value_cache, slots, k_scale, v_scale) -> None:
        PagedAttention.write_to_paged_cache(
            key, value, key_cache, value_cache, slots, self.kv_cache_dtype, k_scale, v_scale
        )

    def gather_kv(self, key_cache, value_cache, block_tables, kv_len, k_scale, v_scale):
        return PagedAttention.gather_kv(
            key_cache, value_cache, block_tables, kv_len, self.kv_cache_dtype, k_scale, v_scale
        )

    def decode(
        self, query, key_cache, value_cache, block_tables, seq_lens, max_len, k_scale, v_scale
    ) -> torch.Tensor:
        return PagedAttention.forward_decode(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            max_len,
            self.kv_cache_dtype,
            self.num_kv_heads,
            self.scale,
            self.alibi_slopes,
            k_scale,
            v_scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
        )

    def prefix(
        self, query, key, value, key_cache, value_cache, md, q_lens, kv_lens, k_scale, v_scale
    ) -> torch.Tensor:
        """Prefills with a cached prefix; `md` is the step's `StepPlan` (its
        `prefill_block_tables`, `prefill_query_start_loc`, `max_query_len`)."""
        return PagedAttention.forward_prefix(
            query,
            key,
            value,
            self.kv_cache_dtype,
            key_cache,
            value_cache,
            md.prefill_block_tables,
            md.prefill_query_start_loc,
            torch.tensor(kv_lens),
            md.max_query_len,
            self.alibi_slopes,
            self.sliding_window,
            k_scale,
            v_scale,
            scale=self.scale,
            logits_soft_cap=self.logits_soft_cap,
        )

    def prefill(self, query, key, value, q_lens, kv_lens, causal) -> torch.Tensor:
        raise NotImplementedError

    # -- the step --------------------------------------------------------------------------

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query `[T, Hq*D]`; key/value `[T or encoder tokens, Hkv*D]`, or None when their K/V
        are already cached (cross attention after the first step, or decodes); kv_cache
        `[2, NB, BS*Hkv*D]` (empty: write nothing, as in vLLM's profiling run). Returns
        `[T, Hq*D]`: prefill tokens first, then one per decode sequence."""
        md, attn_type = attn_metadata, self.attn_type
        num_heads, head_size, num_kv_heads = self.num_heads, self.head_size, self.num_kv_heads
        if md is None:
            raise ValueError("attn_metadata is required")
        encoder = attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY)
        # vLLM's messages (and exception type) for missing encoder / cross metadata.
        if attn_type == AttentionType.ENCODER_DECODER and not md.is_all_cross_attn_metadata_set:
            raise AttributeError(
                "Encoder/decoder cross-attention requires setting "
                "cross-attention metadata attributes."
            )
        if encoder and not md.is_all_encoder_attn_metadata_set:
            raise AttributeError("Encoder attention requires setting encoder metadata attributes.")
        plan: StepPlan = md.step_plan(attn_type)
        query = query.view(-1, num_heads, head_size)
        if (key is None) != (value is None):
            raise ValueError("key and value must both be given or both be None")
        if key is not None:
            key = key.view(-1, num_kv_heads, head_size)
            value = value.view(-1, num_kv_heads, head_size)
        k_scale = getattr(layer, "_k_scale", 1.0)
        v_scale = getattr(layer, "_v_scale", 1.0)

        num_prefill_tokens, num_decode_tokens = plan.num_prefill_tokens, plan.num_decode_tokens
        if query.shape[0] != num_prefill_tokens + num_decode_tokens:
            raise ValueError(
                f"query has {query.shape[0]} tokens but the metadata describes "
                f"{num_prefill_tokens} prefill + {num_decode_tokens} decode tokens"
            )

        uses_cache = kv_cache.numel() > 0 and not encoder
        if uses_cache:
            key_cache, value_cache = self.split_kv_cache(kv_cache)
            if key is not None:
                self.write_kv(
                    key, value, key_cache, value_cache, plan.slot_mapping, k_scale, v_scale
                )
                # Attention reads what the cache holds: with an fp8 cache the new tokens'
                # K/V are rounded the same way, so prefill, chunked prefill and decode (and
                # every backend) see identical keys. vLLM V0 used the unrounded new K/V.
                key = self.as_cached(key, k_scale)
                value = self.as_cached(value, v_scale)

        if any(c < 0 for c in plan.ctx_lens) and attn_type != AttentionType.ENCODER_DECODER:
            raise ValueError(
                f"prefill query lengths {plan.q_lens} exceed kv lengths {plan.kv_lens}"
            )
        out = torch.empty_like(query) if output is None else output.view(-1, num_heads, head_size)
        causal = attn_type == AttentionType.DECODER

        if num_prefill_tokens:
            q_lens, kv_lens, pre = plan.q_lens, plan.kv_lens, slice(0, num_prefill_tokens)
            if causal and any(plan.ctx_lens):  # chunked prefill: a cached prefix
                if not uses_cache or plan.prefill_block_tables is None or key is None:
                    raise ValueError(
                        "prefill with a cached prefix (query_len < seq_len) needs a kv_cache, "
                        "the new key/value and block tables for the prefill sequences"
                    )
                out[pre] = self.prefix(
                    query[pre],
                    key[pre],
                    value[pre],
                    key_cache,
                    value_cache,
                    plan,
                    q_lens,
                    kv_lens,
                    k_scale,
                    v_scale,
                )
            elif key is None:  # K/V from the cache (cross attention after its first step)
                if not uses_cache or plan.prefill_block_tables is None:
                    raise ValueError("prefill without key/value needs a kv_cache and block tables")
                k_pre, v_pre = self._cached_kv(
                    plan, key_cache, value_cache, k_scale, v_scale, query.dtype
                )
                out[pre] = self.prefill(query[pre], k_pre, v_pre, q_lens, kv_lens, causal)
            else:  # the prefills' keys lead (decode tokens' keys follow)
                kv = slice(0, sum(kv_lens))
                out[pre] = self.prefill(query[pre], key[kv], value[kv], q_lens, kv_lens, causal)
        if num_decode_tokens:
            if not uses_cache:
                raise ValueError("decode needs a kv_cache")
            out[num_prefill_tokens:] = self.decode(
                query[num_prefill_tokens:],
                key_cache,
                value_cache,
                plan.decode_block_tables,
                plan.decode_seq_lens,
                plan.max_decode_seq_len,
                k_scale,
                v_scale,
            )
        return out.view(-1, num_heads * head_size)

    def _cached_kv(self, plan, key_cache, value_cache, k_scale, v_scale, dtype):
        """The prefill sequences' K/V read back from the cache, concatenated `[Tk, Hkv, D]`."""
        kv_lens = plan.kv_lens
        k, v = self.gather_kv(
            key_cache,
            value_cache,
            plan.prefill_block_tables,
            max(kv_lens, default=0),
            k_scale,
            v_scale,
        )
        keys = [k[i, :n] for i, n in enumerate(kv_lens)]
        values = [v[i, :n] for i, n in enumerate(kv_lens)]
        return torch.cat(keys).to(dtype), torch.cat(values).to(dtype)

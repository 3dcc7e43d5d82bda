"""`PagedBackend` and `PagedImpl`: the abstract base of every torch backend here.

A backend names its layout (`torch_backends.layouts`) and implements one method,
`attend(step)`, over the whole step. `PagedImpl.forward` (vLLM's `AttentionImpl.forward`)
does what is the same everywhere:

    plan the step (`StepPlan`) -> check it against the cache (`checks.check_step`: every
    check runs before the write, so a bad step leaves the cache bit-identical) -> write the
    new K/V into the cache -> attend(step) -> [T, Hq * D]

for every attention type:

    DECODER          causal self-attention; prefills (plain or over a cached prefix), decodes
    ENCODER(_ONLY)   no cache: bidirectional attention over the given K/V
    ENCODER_DECODER  the encoder K/V written once (cross_slot_mapping), then decoder queries
                     over them, from the cache when key/value are None

No backend inherits from another: each is `PagedBackend` + its metadata, builder and impl.

Huge pages: the first step that reaches a CPU cache (by data pointer) hands its all-zero 2 MiB
chunks to `torch_backends.huge_pages` before anything is written, as vLLM V1's plugin does
(`vllm_v1`). vLLM 0.8.5 makes its CPU caches with `torch.empty`, on 4 KiB pages; in a
VM every 4 KiB of cache read is then a TLB miss with a two-level page walk. No value changes;
`JAX_ATTN_VLLM_HUGE_PAGES=0` leaves the pages as they are.
"""

import dataclasses
import logging
import warnings
from abc import abstractmethod
from typing import Any, ClassVar

import torch
from jaxtyping import Float
from torch import Tensor

from torch_backends import huge_pages
from torch_backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionType,
    CommonAttentionState,
    T,
    check_attn_type,
)
from torch_backends.checks import CheckedPlans, check_step, step_key
from torch_backends.cpu_paged_attn import PagedAttention as CpuPagedAttention
from torch_backends.layouts import CacheLayout, PagedCache, fp8_dtype
from torch_backends.masked_attention import ragged_masked_attention
from torch_backends.paged_attn import PagedAttention
from torch_backends.plan import StepPlan
from torch_backends.shapes import FlatKeysValues, FlatQueries, KeysValues, Queries

logger = logging.getLogger(__name__)
# The checked plans of the last steps, shared by every impl (a step's layers, each an impl).
_CHECKED_PLANS = CheckedPlans()


class PagedBackend(AttentionBackend):
    """The packed cache `kv_cache[2, NB, BS*Hkv*D]` every backend here allocates (each views
    it in its own layout) and the block ops on it, which do not depend on the layout. Each
    backend names itself and its classes with vLLM's static methods (`get_name()`,
    `get_impl_cls()`, `get_metadata_cls()`, `get_builder_cls()`)."""

    accept_output_buffer: bool = False

    @staticmethod
    def get_state_cls() -> type[CommonAttentionState]:
        return CommonAttentionState

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return PagedAttention.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def swap_blocks(src_kv_cache: Tensor, dst_kv_cache: Tensor, src_to_dst: Tensor) -> None:
        PagedAttention.swap_blocks(src_kv_cache, dst_kv_cache, src_to_dst)

    @staticmethod
    def copy_blocks(kv_caches: list[Tensor], src_to_dists: Tensor) -> None:
        PagedAttention.copy_blocks(kv_caches, src_to_dists)


@dataclasses.dataclass(frozen=True)
class Step:
    """One `forward`'s inputs, per head, after the cache write: what `attend` reads.

    `key` / `value` are the new K/V as the cache returns them (rounded through fp8 with an fp8
    cache, so every path and every backend sees the same keys), or None when they are already
    cached (cross attention after its first step). `cache` is None when no cache is used
    (encoder attention, or vLLM's profiling run with an empty `kv_cache`).
    """

    plan: StepPlan
    query: Queries
    key: KeysValues | None
    value: KeysValues | None
    cache: PagedCache | None
    # Where `attend` writes: the caller's `output` viewed [T, Hq, D] when it has the query's
    # dtype, else a fresh tensor. `attend` returns it (or another tensor `forward` copies).
    out: Queries

    @property
    def prefill_query(self) -> Float[Tensor, "num_prefill_tokens num_heads head_size"]:
        return self.query[self.plan.prefill_tokens]

    @property
    def decode_query(self) -> Float[Tensor, "num_decode_tokens num_heads head_size"]:
        return self.query[self.plan.decode_tokens]

    def prefill_kv(
        self, dtype: torch.dtype | None = None
    ) -> tuple[
        Float[Tensor, "num_prefill_kv_tokens num_kv_heads head_size"],
        Float[Tensor, "num_prefill_kv_tokens num_kv_heads head_size"],
    ]:
        """Each prefill's whole K/V, sequence after sequence (`sum(kv_lens)` rows), in `dtype`
        (the query's by default): the new K/V; with a cached prefix, the prefix gathered from
        the cache before them; with no new K/V, everything from the cache.

            kv_lens [7, 3], q_lens [2, 3]: |<- prefix_0 (5) ->|new_0 (2)|new_1 (3)|
        """
        plan = self.plan
        dtype = self.query.dtype if dtype is None else dtype
        if self.key is not None and not plan.has_cached_prefix:
            kv = slice(0, sum(plan.kv_lens))  # the prefills' keys lead; decode tokens' follow
            return self.key[kv].to(dtype), self.value[kv].to(dtype)
        cached = plan.ctx_lens if self.key is not None else plan.kv_lens
        k, v = self.cache.gather(plan.prefill_block_tables, max(cached, default=0))
        keys, values, q0 = [], [], 0
        for i, (q_len, n) in enumerate(zip(plan.q_lens, cached, strict=True)):
            keys.append(k[i, :n].to(dtype))
            values.append(v[i, :n].to(dtype))
            if self.key is not None:
                keys.append(self.key[q0 : q0 + q_len].to(dtype))
                values.append(self.value[q0 : q0 + q_len].to(dtype))
            q0 += q_len
        return torch.cat(keys), torch.cat(values)


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


class PagedImpl(AttentionImpl[T]):
    """vLLM's `AttentionImpl` over a paged cache; a backend sets `backend_name` (as vLLM spelled
    it in its messages) and `layout_cls`, and implements `attend`."""

    backend_name: ClassVar[str]
    layout_cls: ClassVar[type[CacheLayout]]

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        blocksparse_params: dict[str, Any] | None = None,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        use_irope: bool = False,
    ) -> None:
        """vLLM V0's parameters (`num_kv_heads=None` means as many as `num_heads`).
        `use_irope` (Llama 4's interleaved local attention) is accepted and, as in vLLM's CPU
        backends, runs global attention with a warning."""
        if use_irope:
            warnings.warn(
                f"{self.backend_name}: use_irope is not supported; running global attention",
                RuntimeWarning,
                stacklevel=2,
            )
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
        self.layout = self.layout_cls(self.num_kv_heads, head_size, kv_cache_dtype)
        self.configure()

    def configure(self) -> None:
        """A backend's own checks and set-up after the common ones (its kernels' limits)."""

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        """The head sizes vLLM V0's backend accepted: its paged kernels' list."""
        return PagedAttention.get_supported_head_sizes()

    def masked_prefill(
        self, query: Queries, key: KeysValues, value: KeysValues, plan: StepPlan
    ) -> Queries:
        """This impl's attention (scale, ALiBi, window, soft cap) in float32 torch, for what a
        backend's kernel cannot express."""
        return ragged_masked_attention(
            query,
            key,
            value,
            plan.q_lens,
            plan.kv_lens,
            scale=self.scale,
            causal=plan.causal,
            alibi_slopes=self.alibi_slopes,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
        )

    def prefill_cache_reads(
        self, plan: StepPlan, key: Tensor | None, cache: PagedCache | None
    ) -> list[int]:
        """How many tokens of each prefill `attend` reads from the cache (after the write):
        its cached prefix when the new K/V are given (none for a plain prefill, whose table
        row vLLM's runners may leave empty), else all of it."""
        return plan.kv_lens if key is None else plan.cached_lens

    @abstractmethod
    def attend(self, step: Step) -> Queries:
        """The step's attention output, prefill tokens first, then one per decode sequence."""

    def forward(
        self,
        layer: AttentionLayer,
        query: FlatQueries,
        key: FlatKeysValues | None,
        value: FlatKeysValues | None,
        kv_cache: Tensor,
        attn_metadata: T,
        output: FlatQueries | None = None,
    ) -> FlatQueries:
        """query `[T, Hq*D]`; key/value `[T or encoder tokens, Hkv*D]`, or None when their K/V
        are already cached (cross attention after the first step, or decodes); kv_cache
        `[2, NB, BS*Hkv*D]` (empty: write nothing, as in vLLM's profiling run). Returns
        `[T, Hq*D]`: prefill tokens first, then one per decode sequence.

        Metadata that does not fit the cache (`checks.check_step`: slots, block tables,
        lengths, token counts, scales) raises `ValueError` / `TypeError` before anything is
        written: a step either runs whole or leaves the cache bit-identical."""
        attn_type = self.attn_type
        num_heads, head_size, num_kv_heads = self.num_heads, self.head_size, self.num_kv_heads
        if attn_metadata is None:
            raise ValueError("attn_metadata is required")
        encoder = attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY)
        # vLLM's messages (and exception type) for missing encoder / cross metadata
        # (ENCODER_ONLY reads `seq_lens`, which vLLM's pooling runner fills).
        if (
            attn_type == AttentionType.ENCODER_DECODER
            and not attn_metadata.is_all_cross_attn_metadata_set
        ):
            raise AttributeError(
                "Encoder/decoder cross-attention requires setting "
                "cross-attention metadata attributes."
            )
        if (
            attn_type == AttentionType.ENCODER
            and not attn_metadata.is_all_encoder_attn_metadata_set
        ):
            raise AttributeError("Encoder attention requires setting encoder metadata attributes.")
        # The layers of a step share its metadata: the first plans and checks it, the others
        # reuse that plan (checks.CheckedPlans) unless anything it was computed from changed.
        uses_cache = kv_cache.numel() > 0 and not encoder
        k_scale = getattr(layer, "_k_scale", 1.0) if uses_cache else 1.0
        v_scale = getattr(layer, "_v_scale", 1.0) if uses_cache else 1.0
        memo_key, keep = step_key(
            attn_metadata,
            type(self),
            attn_type,
            num_kv_heads,
            head_size,
            tuple(kv_cache.shape) if uses_cache else None,
            None if key is None else tuple(key.shape),
        )
        checked = _CHECKED_PLANS.get(memo_key)
        plan: StepPlan = attn_metadata.step_plan(attn_type) if checked is None else checked
        query = query.view(-1, num_heads, head_size)
        if (key is None) != (value is None):
            raise ValueError("key and value must both be given or both be None")
        if key is not None:
            key = key.view(-1, num_kv_heads, head_size)
            value = value.view(-1, num_kv_heads, head_size)
        num_tokens = plan.num_prefill_tokens + plan.num_decode_tokens
        if query.shape[0] != num_tokens:
            raise ValueError(
                f"query has {query.shape[0]} tokens but the metadata describes "
                f"{plan.num_prefill_tokens} prefill + {plan.num_decode_tokens} decode tokens"
            )
        if (output is not None and output.shape[0] != num_tokens) or (
            output is not None and output.numel() != query.numel()
        ):
            raise ValueError(
                f"output has shape {tuple(output.shape)}, expected [{num_tokens}, "
                f"{num_heads * head_size}] like the query"
            )
        cache = PagedCache.of(self.layout, kv_cache, k_scale, v_scale) if uses_cache else None
        # Every check before the write: a step that raises leaves the cache bit-identical.
        if checked is None:
            reads = self.prefill_cache_reads(plan, key, cache)
            plan = check_step(plan, cache, key, k_scale, v_scale, reads)
            _CHECKED_PLANS.put(memo_key, keep, plan, k_scale, v_scale)
        else:
            _CHECKED_PLANS.check_scales(k_scale, v_scale)
        if cache is not None:
            # A cache's first step: its all-zero 2 MiB chunks onto huge pages (module docstring).
            done = huge_pages.rebacked_on_first_sight(kv_cache)
            if done is not None:
                logger.info("%s: %d of %d 2 MiB chunks of the cache onto huge pages%s",
                            self.backend_name, done.zero_chunks, done.chunks,
                            f" ({done.reason})" if done.reason else "")  # fmt: skip
        if cache is not None and key is not None:
            cache.write(key, value, plan.slot_mapping, check=False)
            # Attention reads what the cache holds: with an fp8 cache the new tokens'
            # K/V are rounded the same way, so prefill, chunked prefill and decode (and
            # every backend) see identical keys. vLLM V0 used the unrounded new K/V.
            key, value = cache.read_back(key, value)
        target = None if output is None else output.view(-1, num_heads, head_size)
        direct = target is not None and target.dtype == query.dtype
        out = self.attend(
            Step(plan, query, key, value, cache, target if direct else torch.empty_like(query))
        )
        if target is not None and out is not target:
            out = target.copy_(out)
        return out.view(-1, num_heads * head_size)


def forward_decode(impl: PagedImpl, step: Step) -> None:
    """The step's decode tokens through vLLM's CPU `PagedAttention.forward_decode` (split
    layout), written into their rows of `step.out` (in place by the native kernel)."""
    plan, cache = step.plan, step.cache
    CpuPagedAttention.forward_decode(
        step.out[plan.decode_tokens],
        step.decode_query,
        cache.key_cache,
        cache.value_cache,
        plan.decode_block_tables,
        plan.decode_seq_lens,
        plan.max_decode_seq_len,
        impl.kv_cache_dtype,
        impl.num_kv_heads,
        impl.scale,
        impl.alibi_slopes,
        cache.k_scale,
        cache.v_scale,
        sliding_window=impl.sliding_window,
        logits_soft_cap=impl.logits_soft_cap,
    )

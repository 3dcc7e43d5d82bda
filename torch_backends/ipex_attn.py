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

import torch

from torch_backends import _math
from torch_backends._step import PagedImpl
from torch_backends.abstract import AttentionImpl
from torch_backends.torch_sdpa import (
    TorchSDPABackend,
    TorchSDPAMetadata,
    TorchSDPAMetadataBuilder,
)

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


class IpexAttnMetadata(TorchSDPAMetadata):
    """The step metadata (same fields as TORCH_SDPA's)."""


class IpexAttnMetadataBuilder(TorchSDPAMetadataBuilder):
    def build(self, *args, **kwargs) -> IpexAttnMetadata:
        md = super().build(*args, **kwargs)
        return IpexAttnMetadata(**{f: getattr(md, f) for f in md.__dataclass_fields__})


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
            finfo = torch.finfo(_E5M2)
            key = (key.float() / k_scale).clamp(finfo.min, finfo.max)
            value = (value.float() / v_scale).clamp(finfo.min, finfo.max)
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
        k = key_cache[block, :, pos % block_size]  # [S, L, Hkv, D]
        v = value_cache[block, :, pos % block_size]
        return k.float() * k_scale, v.float() * v_scale

    def decode(
        self, query, key_cache, value_cache, block_tables, seq_lens, max_len, k_scale, v_scale
    ) -> torch.Tensor:
        k_scale, v_scale = self._scales(k_scale, v_scale)
        out = torch.empty_like(query)
        if self.fp8:
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
                _cumsum(seq_lens.tolist()),
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
            _cumsum(kv_lens),
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
            ipex_functional.varlen_attention(
                query.contiguous(),
                key.contiguous(),
                value.contiguous(),
                out,
                _cumsum(q_lens),
                _cumsum(kv_lens),
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
                _cumsum(q_lens),
                _cumsum(kv_lens),
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


def _cumsum(lens) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(list(lens)).cumsum(0).tolist()], dtype=torch.int32)


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

"""XFORMERS: vLLM V0's xFormers backend, standalone.

Masks are xformers' own `attn_bias` objects, built from the step's sequence lengths:
- decoder prefill: `BlockDiagonalCausalMask` (`.make_local_attention(W)` with a window);
- chunked prefill over a cached prefix: `BlockDiagonalCausalFromBottomRightMask`
  (`BlockDiagonalCausalLocalAttentionFromBottomRightMask` with a window), the prefix gathered
  from the paged cache;
- encoder / encoder-only: `BlockDiagonalMask`; cross attention: `BlockDiagonalMask` over
  (decoder lengths, encoder lengths);
- ALiBi: per sequence, `LowerTriangularMaskWithTensorBias` (causal) or a plain tensor bias.
Decode reads the paged cache through `PagedAttention.forward_decode`.

On CUDA the prefill runs `xformers.ops.memory_efficient_attention_forward`. xformers ships no
CPU kernel, so on CPU the *same bias objects* are executed by a reference path:
`bias.materialize(...)` added to `scale * q.k`, softmax in float32, times v. The backend says
so once with a warning. xformers has no logits soft cap either: with a soft cap the reference
path runs on every device (vLLM V0 ignored the cap).
"""

import dataclasses
import warnings

import torch
from torch import Tensor

from torch_backends.abstract import AttentionMetadata, check_attn_type
from torch_backends.host_batch import HostBatch, HostBatchBuilder, cumsum, pad_tables
from torch_backends.layouts import SplitLayout
from torch_backends.paged_attn import PagedAttentionMetadata
from torch_backends.paged_backend import PagedBackend, PagedImpl, Step, forward_decode
from torch_backends.plan import CrossAttentionMetadata, StepPlan, per_sequence_plan
from torch_backends.shapes import KeysValues, Queries

try:
    from xformers.ops import fmha, memory_efficient_attention_forward
    from xformers.ops.fmha import attn_bias as xbias
except ImportError as e:  # pragma: no cover - exercised only without xformers
    raise ImportError(
        "The XFORMERS backend needs xformers (>= 0.0.35 with torch >= 2.10): "
        "pip install 'jax-attn[xformers]'"
    ) from e

_warned_cpu = False


def compiled_ops_problem() -> str | None:
    """Why xformers' compiled (C++/CUDA) ops did not load here, or None when they did.

    Each xformers wheel is built against one torch: 0.0.35's against torch 2.10 with CUDA 12.8
    (its `cpp_lib.json`). With another torch its extension fails to load, xformers logs a
    warning and goes on without kernels: on a CUDA host the XFORMERS prefill would then fail at
    the first call. Install the pair it was built for (the `xformers-cuda` extra)."""
    from xformers import _cpp_lib

    error = _cpp_lib._cpp_library_load_exception
    if error is None:
        return None
    info = getattr(error, "build_info", None)
    built = (
        "" if info is None else f" (built for torch {info.torch_version}, CUDA {info.cuda_version})"
    )
    return (
        f"xformers {xformers_version()}'s compiled ops did not load{built} with torch "
        f"{torch.__version__}: {type(error).__name__}. XFORMERS runs its CPU reference path "
        "only; on a CUDA host install the torch it was built for: pip install "
        "'jax-attn[xformers-cuda]' (torch 2.10 + xformers 0.0.35)"
    )


def xformers_version() -> str:
    import xformers

    return getattr(xformers, "__version__", "?")


def _warn_cpu_once() -> None:
    global _warned_cpu
    if not _warned_cpu:
        _warned_cpu = True
        warnings.warn(
            "XFORMERS: xformers has no CPU kernel; running its attention biases through the "
            "reference execution (materialized bias, float32 softmax) instead",
            RuntimeWarning,
            stacklevel=3,
        )


@dataclasses.dataclass
class XFormersMetadata(AttentionMetadata, PagedAttentionMetadata, CrossAttentionMetadata):
    """vLLM V0's `XFormersMetadata` fields. Unlike TORCH_SDPA's, `block_tables`,
    `seq_lens_tensor`, `seq_lens` and `context_lens_tensor` have one entry per sequence,
    prefills first; `prefill_metadata` / `decode_metadata` slice them.

        |---------- context_len ----------|-- query_len --|
        |-------------------- seq_len --------------------|

    Prefills with block table rows read their cached prefix through them (vLLM:
    `prefill_meta.block_tables.numel() != 0`). vLLM's lazily cached `attn_bias` fields are
    left out: the masks are rebuilt per call from the lengths.
    """

    # Longest prefill / decode sequence (0 when there is none).
    max_prefill_seq_len: int
    use_cuda_graph: bool
    # seq_lens [5, 17, 9] with query_lens [5, 3, 1]: a plain prefill, a chunked prefill with
    # 14 cached tokens, a decode with 8.
    seq_lens: list[int] | None = None
    seq_start_loc: Tensor | None = None  # [S + 1], cumulative seq_lens
    context_lens_tensor: Tensor | None = None  # [S], seq_len - query_len
    max_query_len: int | None = None
    max_decode_query_len: int | None = None
    query_start_loc: Tensor | None = None  # [S + 1], cumulative query_lens
    # vLLM's lazily built prefill / decode views, kept as fields so that positional
    # construction lines up with vLLM's; the views here are cheap and built on each access.
    _cached_prefill_metadata: "XFormersMetadata | None" = None
    _cached_decode_metadata: "XFormersMetadata | None" = None
    # Encoder and encoder/decoder cross attention:
    encoder_seq_lens: list[int] | None = None
    encoder_seq_lens_tensor: Tensor | None = None
    encoder_seq_start_loc: Tensor | None = None
    max_encoder_seq_len: int | None = None
    num_encoder_tokens: int | None = None
    cross_slot_mapping: Tensor | None = None
    cross_block_tables: Tensor | None = None

    def __post_init__(self):
        # vLLM's per-step mask caches (not part of __init__); the masks are rebuilt per call.
        self.attn_bias = None
        self.encoder_attn_bias = None
        self.cross_attn_bias = None

    @property
    def is_all_encoder_attn_metadata_set(self) -> bool:
        return (
            self.encoder_seq_lens is not None
            and self.encoder_seq_lens_tensor is not None
            and self.max_encoder_seq_len is not None
        )

    @property
    def prefill_metadata(self) -> "XFormersMetadata | None":
        if self.num_prefills == 0:
            return None
        p, t = self.num_prefills, self.num_prefill_tokens
        return dataclasses.replace(
            self,
            num_decode_tokens=0,
            slot_mapping=_cut(self.slot_mapping, stop=t),
            seq_lens=_cut(self.seq_lens, stop=p),
            seq_lens_tensor=_cut(self.seq_lens_tensor, stop=p),
            context_lens_tensor=_cut(self.context_lens_tensor, stop=p),
            block_tables=_cut(self.block_tables, stop=p),
            query_start_loc=_cut(self.query_start_loc, stop=p + 1),
            seq_start_loc=_cut(self.seq_start_loc, stop=p + 1),
            max_decode_seq_len=0,
            use_cuda_graph=False,
        )

    @property
    def decode_metadata(self) -> "XFormersMetadata | None":
        if self.num_decode_tokens == 0:
            return None
        p, t = self.num_prefills, self.num_prefill_tokens
        return dataclasses.replace(
            self,
            num_prefills=0,
            num_prefill_tokens=0,
            slot_mapping=_cut(self.slot_mapping, start=t),
            seq_lens=None,
            seq_lens_tensor=_cut(self.seq_lens_tensor, start=p),
            context_lens_tensor=None,
            block_tables=_cut(self.block_tables, start=p),
            query_start_loc=None,
            seq_start_loc=None,
            max_prefill_seq_len=0,
        )

    def step_plan(self, attn_type: str) -> StepPlan:
        return per_sequence_plan(self, check_attn_type(attn_type))


def _cut(x, start=None, stop=None):
    return None if x is None else x[start:stop]


class XFormersMetadataBuilder(HostBatchBuilder[XFormersMetadata]):
    """Builds `XFormersMetadata` from per-sequence lengths and block tables.

    vLLM's builder read its inputs from the model runner (`input_builder`); standalone, the
    block tables and block size are given to `build` as keywords, as for TORCH_SDPA.
    """

    def metadata(self, batch: HostBatch) -> XFormersMetadata:
        p = batch.num_prefills
        enc = batch.encoder_fields()
        if batch.encoder_seq_lens is not None:
            enc["encoder_seq_start_loc"] = cumsum(batch.encoder_seq_lens)
        return XFormersMetadata(
            **batch.common_fields(),
            seq_lens_tensor=torch.tensor(batch.seq_lens, dtype=torch.int32),
            max_prefill_seq_len=max(batch.seq_lens[:p], default=0),
            max_decode_seq_len=max(batch.seq_lens[p:], default=0),
            block_tables=pad_tables(batch.block_tables),
            use_cuda_graph=False,
            seq_lens=batch.seq_lens,
            seq_start_loc=cumsum(batch.seq_lens),
            context_lens_tensor=torch.tensor(
                [s - q for s, q in zip(batch.seq_lens, batch.query_lens, strict=True)],
                dtype=torch.int32,
            ),
            max_query_len=max(batch.query_lens, default=0),
            max_decode_query_len=1 if batch.num_decode_tokens else 0,
            query_start_loc=cumsum(batch.query_lens),
            **enc,
        )


class XFormersImpl(PagedImpl[XFormersMetadata]):
    """vLLM V0's `XFormersImpl`: `forward(layer, query, key, value, kv_cache, metadata)`."""

    backend_name = "XFormers"
    layout_cls = SplitLayout

    # -- masks ---------------------------------------------------------------------------

    def make_attn_bias(
        self,
        q_lens: list[int],
        kv_lens: list[int],
        causal: bool,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        """The xformers bias of a prefill (one object), or a list (one per sequence) with
        ALiBi or a non-causal window, as vLLM built them. Tensor biases are what xformers'
        CUDA kernel takes: `[1, Hq, Tq, Tk]` in the query's `dtype` on its `device`, with
        strides aligned to 8 elements (`_aligned_bias`)."""
        if self.alibi_slopes is not None:
            return _make_alibi_bias(
                self.alibi_slopes,
                self.num_kv_heads,
                q_lens,
                kv_lens,
                causal,
                self.sliding_window,
                dtype=dtype,
                device=device,
            )
        bottom_right = any(k != q for q, k in zip(q_lens, kv_lens, strict=True))
        if not causal:
            if self.sliding_window is not None:
                return [
                    _window_tensor_bias(
                        q, k, self.sliding_window, self.num_heads, dtype=dtype, device=device
                    )
                    for q, k in zip(q_lens, kv_lens, strict=True)
                ]
            return xbias.BlockDiagonalMask.from_seqlens(q_lens, kv_lens)
        if bottom_right:
            if self.sliding_window is not None:
                mask = xbias.BlockDiagonalCausalFromBottomRightMask.from_seqlens(q_lens, kv_lens)
                return mask.make_local_attention_from_bottomright(self.sliding_window)
            return xbias.BlockDiagonalCausalFromBottomRightMask.from_seqlens(q_lens, kv_lens)
        mask = xbias.BlockDiagonalCausalMask.from_seqlens(q_lens)
        if self.sliding_window is not None:
            mask = mask.make_local_attention(self.sliding_window)
        return mask

    # -- execution -----------------------------------------------------------------------

    def attend(self, step: Step) -> Queries:
        """Prefills under their xformers bias over their whole K/V (a cached prefix gathered
        first, under a bottom-right mask); decodes through `PagedAttention.forward_decode`."""
        plan, out = step.plan, step.out
        if plan.num_prefill_tokens:
            out[plan.prefill_tokens] = self.prefill(step.prefill_query, *step.prefill_kv(), plan)
        if plan.num_decode_tokens:
            forward_decode(self, step)
        return out

    def prefill(
        self, query: Queries, key: KeysValues, value: KeysValues, plan: StepPlan
    ) -> Queries:
        q_lens, kv_lens, causal = plan.q_lens, plan.kv_lens, plan.causal
        # xformers' CUDA kernel takes a tensor bias only in the query's dtype; `_run`'s other
        # path (CPU, soft cap) materializes it, in float32 (a bfloat16 ALiBi bias of 10 is off
        # by up to 0.03: found by `jax-attn fuzz`).
        kernel = query.is_cuda and self.logits_soft_cap is None
        dtype = query.dtype if kernel else torch.float32
        bias = self.make_attn_bias(q_lens, kv_lens, causal, dtype=dtype, device=query.device)
        if not isinstance(bias, list):
            return self._run(query, key, value, bias)
        output = torch.empty_like(query)
        q0 = k0 = 0
        for q_len, kv_len, seq_bias in zip(q_lens, kv_lens, bias, strict=True):
            output[q0 : q0 + q_len] = self._run(
                query[q0 : q0 + q_len], key[k0 : k0 + kv_len], value[k0 : k0 + kv_len], seq_bias
            )
            q0, k0 = q0 + q_len, k0 + kv_len
        return output

    def _run(self, query, key, value, bias) -> Tensor:
        """Attention of `[Tq, Hq, D]` over `[Tk, Hkv, D]` under an xformers bias."""
        if query.is_cuda and self.logits_soft_cap is None:
            # BMHK layout with the kv heads repeated for GQA (vLLM V0 did the same).
            group = self.num_queries_per_kv
            k = key.repeat_interleave(group, dim=1)[None]
            v = value.repeat_interleave(group, dim=1)[None]
            out = memory_efficient_attention_forward(
                query[None], k, v, attn_bias=bias, scale=self.scale
            )
            return out[0]
        if not query.is_cuda:
            _warn_cpu_once()
        return execute_reference(
            query, key, value, bias, scale=self.scale, logits_soft_cap=self.logits_soft_cap
        )


def execute_reference(query, key, value, bias, *, scale, logits_soft_cap=None):
    """Run an xformers attention bias without xformers' kernels: the documented CPU path.

    `bias` is an `AttentionBias` (materialized to `[Hq, Tq, Tk]`) or a tensor broadcastable to
    `[1, Hq, Tq, Tk]`. Rows whose keys are all masked give zeros; keys masked for every row are
    not read.

    Each row's bias is taken relative to its largest finite entry (a per-row constant, which the
    softmax cancels): a bidirectional ALiBi row's keys ahead carry biases of slope x distance,
    and added to the logits at that size their float32 rounding reached every probability
    (a 24-head encoder batch of 280 tokens 2.3e-5 from the float64 oracle, past float32's row;
    1.7e-5 relative to the row's largest, what remains being the rounding of the float32
    products slope x distance in the bias as `_make_alibi_bias` builds it, vLLM's values).
    """
    num_tokens, num_heads, _head_size = query.shape
    num_keys, num_kv_heads = key.shape[:2]
    shape = (1, num_heads, num_tokens, num_keys)  # BHMN, as xformers materializes it
    if isinstance(bias, fmha.attn_bias.AttentionBias):
        dense = bias.materialize(shape, dtype=torch.float32, device=query.device)[0]
    elif bias is None:
        dense = None
    else:
        dense = bias.float().expand(shape)[0]
    if dense is not None:
        top = torch.where(torch.isfinite(dense), dense, -torch.inf).amax(dim=-1, keepdim=True)
        dense = dense - torch.where(torch.isfinite(top), top, 0.0)
    group = num_heads // num_kv_heads
    k, v = key.float(), value.float()
    if dense is not None:
        # Keys the bias masks for every row are never read: a cached prefix's blocks before
        # every row's window may hold anything (vLLM's engines free them), NaN included.
        seen = torch.isfinite(dense).any(dim=1).any(dim=0)[:, None, None]  # [Tk, 1, 1]
        k, v = torch.where(seen, k, 0.0), torch.where(seen, v, 0.0)
    k = k.repeat_interleave(group, dim=1)  # [Tk, Hq, D]
    v = v.repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    if logits_soft_cap is not None:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    if dense is not None:
        logits = logits + dense
    row_max = logits.amax(dim=-1, keepdim=True)
    weights = torch.exp(logits - torch.where(torch.isfinite(row_max), row_max, 0.0))
    total = weights.sum(dim=-1, keepdim=True)
    probs = weights / torch.where(total > 0, total, 1.0)
    return torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)


def _aligned_bias(bias: Tensor, dtype: torch.dtype, device) -> Tensor:
    """`bias [Hq, Tq, Tk]` as xformers' CUDA kernel takes a tensor bias: `[1, Hq, Tq, Tk]`
    (BMHK's `(B, H, Mq, Mk)`) in `dtype` on `device`, every stride but the last a multiple of
    8 elements. Like vLLM, a buffer whose rows are padded to a multiple of 8 keys, sliced back
    to `Tk` (a view: the padding is never read). Example: Tk = 5 gives strides
    `(Hq * Tq * 8, Tq * 8, 8, 1)`."""
    num_heads, q_len, kv_len = bias.shape
    padded = -(-kv_len // 8) * 8
    buffer = torch.empty(1, num_heads, q_len, padded, dtype=dtype, device=device)
    view = buffer[..., :kv_len]
    view.copy_(bias[None])
    return view


def _window_tensor_bias(
    q_len: int,
    kv_len: int,
    window: int,
    num_heads: int,
    *,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> Tensor:
    """Non-causal window (encoders): keys within `window` of the query, on either side, as
    an aligned `[1, Hq, Tq, Tk]` tensor bias (`_aligned_bias`)."""
    p_q = torch.arange(kv_len - q_len, kv_len)[:, None]
    p_k = torch.arange(kv_len)[None, :]
    keep = (p_q - p_k) < window  # the spec's window rule; keys ahead stay visible
    bias = torch.zeros(q_len, kv_len).masked_fill(~keep, float("-inf"))
    return _aligned_bias(bias.expand(num_heads, q_len, kv_len), dtype, device)


def _make_alibi_bias(
    alibi_slopes: Tensor,
    num_kv_heads: int,
    q_lens: list[int],
    kv_lens: list[int] | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> list:
    """One ALiBi bias per sequence: `slope_h * (p_k - p_q)` as a `[1, Hq, Tq, Tk]` tensor of
    `dtype` on `device` with aligned strides (`_aligned_bias`), wrapped in
    `LowerTriangularMaskWithTensorBias` when causal (vLLM's choice). Bottom-right positions
    when `kv_lens` differ from `q_lens` (chunked prefill, cross attention). The bias is
    computed in float32 and rounded once to `dtype` (xformers needs the query's dtype)."""
    kv_lens = q_lens if kv_lens is None else kv_lens
    biases = []
    for q_len, kv_len in zip(q_lens, kv_lens, strict=True):
        p_q = torch.arange(kv_len - q_len, kv_len, dtype=torch.float32)[:, None]
        p_k = torch.arange(kv_len, dtype=torch.float32)[None, :]
        bias = alibi_slopes.float()[:, None, None] * (p_k - p_q)[None]  # [Hq, Tq, Tk]
        keep = torch.ones(q_len, kv_len, dtype=torch.bool)
        if causal:
            keep &= p_k <= p_q
        if sliding_window is not None:
            keep &= (p_q - p_k) < sliding_window
        bias = _aligned_bias(bias.masked_fill(~keep[None], float("-inf")), dtype, device)
        if causal and q_len == kv_len and sliding_window is None:
            biases.append(xbias.LowerTriangularMaskWithTensorBias(bias))
        else:
            biases.append(bias)
    return biases


class XFormersBackend(PagedBackend):
    """vLLM's paged split layout (as TORCH_SDPA); prefills through xformers."""

    @staticmethod
    def get_name() -> str:
        return "XFORMERS"

    @staticmethod
    def get_impl_cls() -> type[XFormersImpl]:
        return XFormersImpl

    @staticmethod
    def get_metadata_cls() -> type[XFormersMetadata]:
        return XFormersMetadata

    @staticmethod
    def get_builder_cls() -> type[XFormersMetadataBuilder]:
        return XFormersMetadataBuilder

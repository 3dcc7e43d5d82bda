"""`masked_attention`: the attention math of the torch backends' non-kernel paths, in float32.

`logit = scale * q.k`; `cap * tanh(logit / cap)` with a soft cap; `+ slope_h * (p_k - p_q)`
with ALiBi; causal keeps `p_k <= p_q`; a window `W` keeps `p_q - p_k < W`; rows with no key
give zeros. Keys/values at invalid positions, or before every row's window, may hold anything
(NaN from unused or freed cache memory): they are excluded with `where`, never by multiplying
with a zero weight.
"""

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from torch_backends.shapes import KeysValues, Queries


def masked_attention(
    q: Float[Tensor, "batch num_q num_heads head_size"],
    k: Float[Tensor, "batch num_k num_kv_heads head_size"],
    v: Float[Tensor, "batch num_k num_kv_heads head_size"],
    *,
    q_pos: Int[Tensor, "batch num_q"],
    k_pos: Int[Tensor, "batch num_k"],
    k_valid: Bool[Tensor, "batch num_k"],
    scale: float,
    causal: bool,
    alibi_slopes: Float[Tensor, " num_heads"] | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> Float[Tensor, "batch num_q num_heads head_size"]:
    """Batched attention of `q` over `k`, `v` (float32 inputs); returns float32."""
    batch, num_q, num_heads, head_size = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    # [B, Q, Hkv, G, D] x [B, K, Hkv, D] -> [B, Hkv, G, Q, K]
    qg = q.view(batch, num_q, num_kv_heads, group, head_size)
    logits = torch.einsum("bqhgd,bkhd->bhgqk", qg, k) * scale
    if logits_soft_cap is not None:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    delta = q_pos[:, :, None] - k_pos[:, None, :]  # [B, Q, K]: how far back each key is
    if alibi_slopes is not None:
        slopes = alibi_slopes.float().to(q.device).view(1, num_kv_heads, group, 1, 1)
        logits = logits - slopes * delta[:, None, None].float()
    keep = k_valid[:, None, :].expand(batch, num_q, -1)
    if causal:
        keep = keep & (delta >= 0)
    if sliding_window is not None:
        keep = keep & (delta < sliding_window)
    logits = torch.where(keep[:, None, None], logits, float("-inf"))
    # Values no row keeps are never read: invalid positions, and a cached prefix's blocks
    # before every row's window, which vLLM's engines free.
    v = torch.where(keep.any(dim=1)[:, :, None, None], v, 0.0)
    row_max = logits.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    weights = torch.exp(logits - row_max)  # exactly 0 where masked
    total = weights.sum(dim=-1, keepdim=True)
    probs = weights / torch.where(total > 0, total, 1.0)
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v)  # [B, Q, Hkv, G, D]
    return out.reshape(batch, num_q, num_heads, head_size)


def ragged_masked_attention(
    query: Queries,
    key: KeysValues,
    value: KeysValues,
    q_lens: list[int],
    kv_lens: list[int],
    *,
    scale: float,
    causal: bool,
    alibi_slopes: Float[Tensor, " num_heads"] | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> Queries:
    """`masked_attention` per sequence of a ragged batch, in `query`'s dtype.

    Sequence i's `q_lens[i]` queries sit bottom-right over its `kv_lens[i]` keys: query j at
    position `kv_len - q_len + j`. q_lens [2, 3], kv_lens [5, 3]: queries 0-1 over keys 0-4
    (positions 3, 4), queries 2-4 over keys 5-7 (positions 0-2).
    """
    out = torch.empty_like(query)
    q0 = k0 = 0
    for q_len, kv_len in zip(q_lens, kv_lens, strict=True):
        if q_len == 0 or kv_len == 0:  # no query (empty sequence), or no key: zeros
            out[q0 : q0 + q_len] = 0
            q0, k0 = q0 + q_len, k0 + kv_len
            continue
        k_pos = torch.arange(kv_len, device=query.device)[None]
        out[q0 : q0 + q_len] = masked_attention(
            query[None, q0 : q0 + q_len].float(),
            key[None, k0 : k0 + kv_len].float(),
            value[None, k0 : k0 + kv_len].float(),
            q_pos=torch.arange(kv_len - q_len, kv_len, device=query.device)[None],
            k_pos=k_pos,
            k_valid=torch.ones_like(k_pos, dtype=torch.bool),
            scale=scale,
            causal=causal,
            alibi_slopes=alibi_slopes,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )[0].to(query.dtype)
        q0, k0 = q0 + q_len, k0 + kv_len
    return out

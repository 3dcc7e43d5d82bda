"""The attention math shared by the torch backends' non-SDPA paths, in float32.

`logit = scale * q.k`; `cap * tanh(logit / cap)` with a soft cap; `+ slope_h * (p_k - p_q)`
with ALiBi; causal keeps `p_k <= p_q`; a window `W` keeps `p_q - p_k < W`; rows with no key
give zeros. Keys/values at invalid positions may hold anything (NaN from unused cache memory):
they are excluded with `where`, never by multiplying with a zero weight.
"""

import torch


def attend(
    q: torch.Tensor,  # [B, Q, Hq, D] float32
    k: torch.Tensor,  # [B, K, Hkv, D] float32
    v: torch.Tensor,  # [B, K, Hkv, D] float32
    *,
    q_pos: torch.Tensor,  # [B, Q]
    k_pos: torch.Tensor,  # [B, K]
    k_valid: torch.Tensor,  # [B, K] bool
    scale: float,
    causal: bool,
    alibi_slopes: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Batched attention of `q` over `k`, `v`; returns `[B, Q, Hq, D]` float32."""
    batch, num_q, num_heads, head_size = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    v = torch.where(k_valid[:, :, None, None], v, 0.0)
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
    row_max = logits.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    weights = torch.exp(logits - row_max)  # exactly 0 where masked
    total = weights.sum(dim=-1, keepdim=True)
    probs = weights / torch.where(total > 0, total, 1.0)
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v)  # [B, Q, Hkv, G, D]
    return out.reshape(batch, num_q, num_heads, head_size)

"""`masked_attention`, the torch backends' float32 path where no kernel takes a step: keys and
values no row may see are never read into an output.

Under a sliding window, vLLM's engines free a sequence's blocks that lie wholly before its
window and point their table entries at a null block: gathered from the cache, those rows may
hold anything, NaN included. A zero weight times NaN is NaN, so the values must be left out,
not weighted by zero.
"""

import numpy as np
import pytest
import torch
from tolerances import assert_close

from torch_backends.masked_attention import masked_attention


def _oracle(q, k, v, q_pos, k_pos, window, slopes):
    """float64 attention of each batch row's queries over its keys, straight from the spec."""
    q, k, v = (x.double().numpy() for x in (q, k, v))
    batch, _, num_heads, _ = q.shape
    group = num_heads // k.shape[2]
    out = np.zeros(q.shape)
    for b in range(batch):
        kh, vh = np.repeat(k[b], group, axis=1), np.repeat(v[b], group, axis=1)
        logits = 0.125 * np.einsum("qhd,khd->hqk", q[b], kh)
        delta = q_pos[b].numpy()[:, None] - k_pos[b].numpy()[None, :]  # p_q - p_k
        if slopes is not None:
            logits = logits - slopes.double().numpy()[:, None, None] * delta[None]
        keep = (delta >= 0) & (delta < window)
        logits = np.where(keep[None], logits, -np.inf)
        weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
        weights = np.where(keep[None], weights, 0.0)
        out[b] = np.einsum("hqk,khd->qhd", weights / weights.sum(-1, keepdims=True), vh)
    return out


@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
@pytest.mark.parametrize("window", [1, 5, 13])
def test_keys_before_every_window_are_not_read(window, alibi, rng):
    """Decodes and a chunk over 40 keys: every key before the first row's window is NaN (as a
    freed block reads); the output matches the float64 oracle of the finite data."""
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    batch, num_q, num_k, num_heads, num_kv_heads, head_size = 3, 4, 40, 4, 2, 16
    q = torch.randn(batch, num_q, num_heads, head_size, generator=gen)
    k = torch.randn(batch, num_k, num_kv_heads, head_size, generator=gen)
    v = torch.randn(batch, num_k, num_kv_heads, head_size, generator=gen)
    last = torch.tensor([39, 30, 17])  # each row's last query position
    q_pos = last[:, None] - torch.arange(num_q - 1, -1, -1)[None]  # 4 new tokens per row
    k_pos = torch.arange(num_k)[None].expand(batch, -1)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]) if alibi else None
    first_seen = q_pos[:, :1] - window + 1  # the first row's window start
    stale = k_pos < first_seen  # [B, K]: no row sees these
    assert stale.any()
    k_nan = torch.where(stale[:, :, None, None], float("nan"), k)
    v_nan = torch.where(stale[:, :, None, None], float("nan"), v)
    out = masked_attention(
        q, k_nan, v_nan, q_pos=q_pos, k_pos=k_pos, k_valid=k_pos <= last[:, None], scale=0.125,
        causal=True, alibi_slopes=slopes, sliding_window=window,
    )  # fmt: skip
    assert_close(out.numpy(), _oracle(q, k, v, q_pos, k_pos, window, slopes), "float32")

"""Attention biases and masks as values: ALiBi slopes and `AttentionBias`.

`AttentionBias` is one small object with independent fields (causal, sliding window, ALiBi,
soft cap) built from sequence lengths (`from_seqlens`). `materialize()` gives the dense additive
bias for tests and pictures; the fast paths apply the same rules blockwise without
materializing anything.
"""

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from jaxtyping import Float


def alibi_slopes(num_heads: int) -> Float[np.ndarray, " num_heads"]:
    """The ALiBi slopes of Press et al.: a geometric sequence per head, as float32.

    For a power-of-two head count n the slopes are `2**(-8/n * k)` for k = 1..n. Otherwise the
    slopes of the nearest lower power of two m come first, then every other slope of 2m
    (`2**(-4/m * k)` for k = 1, 3, 5, ...) until there are `num_heads`.
    """
    if not isinstance(num_heads, int | np.integer) or num_heads <= 0:
        raise ValueError(f"num_heads={num_heads!r} must be a positive int")
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 / closest * k) for k in range(1, closest + 1)]
    extra = num_heads - closest
    slopes += [2.0 ** (-4.0 / closest * k) for k in range(1, 2 * extra, 2)]
    return np.asarray(slopes, dtype=np.float32)


@dataclasses.dataclass(frozen=True)
class AttentionBias:
    """The bias of a ragged batch, as the spec's math defines it.

    For query token at position `p_q` (bottom-right aligned: `seq_len_k - seq_len_q + i`) and
    key at `p_k`: `logit = scale * q.k`; `cap * tanh(logit / cap)` with a soft cap; then
    `+ slope_h * (p_k - p_q)` with ALiBi; causal keeps `p_k <= p_q`; a window `W` keeps
    `p_q - p_k < W`.
    """

    q_seqlens: tuple[int, ...]
    kv_seqlens: tuple[int, ...]
    causal: bool = True
    sliding_window: int | None = None
    alibi_slopes: tuple[float, ...] | None = None
    logits_soft_cap: float | None = None

    @classmethod
    def from_seqlens(
        cls,
        q_seqlens: Sequence[int],
        kv_seqlens: Sequence[int] | None = None,
        *,
        causal: bool = True,
        sliding_window: int | None = None,
        alibi_slopes: Sequence[float] | np.ndarray | None = None,
        logits_soft_cap: float | None = None,
    ) -> "AttentionBias":
        q = tuple(int(x) for x in q_seqlens)
        kv = q if kv_seqlens is None else tuple(int(x) for x in kv_seqlens)
        if len(q) != len(kv):
            raise ValueError(f"q_seqlens ({len(q)}) and kv_seqlens ({len(kv)}) differ in length")
        if causal:
            bad = [i for i, (a, b) in enumerate(zip(q, kv, strict=True)) if a > b]
            if bad:
                i = bad[0]
                raise ValueError(
                    f"causal attention needs q_len <= kv_len, but sequence {i} has "
                    f"q_len={q[i]} > kv_len={kv[i]}"
                )
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window={sliding_window} must be positive or None")
        if logits_soft_cap is not None and logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap={logits_soft_cap} must be positive or None")
        slopes = None if alibi_slopes is None else tuple(float(s) for s in alibi_slopes)
        return cls(q, kv, causal, sliding_window, slopes, logits_soft_cap)

    def positions(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(p_q [q_len], p_k [kv_len]) of sequence i, bottom-right aligned."""
        q_len, kv_len = self.q_seqlens[i], self.kv_seqlens[i]
        return np.arange(kv_len - q_len, kv_len), np.arange(kv_len)

    def mask(self, i: int) -> np.ndarray:
        """bool[q_len, kv_len]: which keys sequence i's queries may attend to."""
        p_q, p_k = self.positions(i)
        keep = np.ones((p_q.size, p_k.size), dtype=bool)
        delta = p_q[:, None] - p_k[None, :]  # [q_len, kv_len], how far back the key is
        if self.causal:
            keep &= delta >= 0
        if self.sliding_window is not None:
            keep &= delta < self.sliding_window
        return keep

    def materialize(self, num_heads: int = 1, dtype=np.float32) -> np.ndarray:
        """Dense additive bias `[num_heads, sum(q_seqlens), sum(kv_seqlens)]`.

        Block-diagonal over sequences; `-inf` where masked; the ALiBi term where kept. The soft
        cap is not additive (it transforms the logits) and is applied by the attention itself.
        """
        if self.alibi_slopes is not None and len(self.alibi_slopes) != num_heads:
            raise ValueError(f"{num_heads=} but {len(self.alibi_slopes)} ALiBi slopes")
        out = np.full((num_heads, sum(self.q_seqlens), sum(self.kv_seqlens)), -np.inf, dtype)
        q0 = k0 = 0
        for i, (q_len, kv_len) in enumerate(zip(self.q_seqlens, self.kv_seqlens, strict=True)):
            p_q, p_k = self.positions(i)
            block = np.zeros((num_heads, q_len, kv_len), dtype)
            if self.alibi_slopes is not None:
                slopes = np.asarray(self.alibi_slopes, dtype)[:, None, None]
                block += slopes * (p_k[None, None, :] - p_q[None, :, None]).astype(dtype)
            block[:, ~self.mask(i)] = -np.inf
            out[:, q0 : q0 + q_len, k0 : k0 + kv_len] = block
            q0, k0 = q0 + q_len, k0 + kv_len
        return out

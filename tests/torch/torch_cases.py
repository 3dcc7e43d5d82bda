"""Test helpers for the torch backends: a float64 reference and random paged steps.

The reference is written here from the spec's math, independently of the backends' code, and
the cache layout is filled by explicit index arithmetic (not the backends' write), so a bug in
either shows up as a mismatch.
"""

import dataclasses

import numpy as np
import torch

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def reference_attention(
    q,
    k,
    v,
    q_lens,
    k_lens,
    *,
    causal,
    scale,
    alibi_slopes=None,
    sliding_window=None,
    logits_soft_cap=None,
):
    """float64 attention per sequence; q `[Tq, Hq, D]`, k/v `[Tk, Hkv, D]`, bottom-right."""
    q, k, v = (torch.as_tensor(x).double() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    q0 = k0 = 0
    for q_len, k_len in zip(q_lens, k_lens, strict=True):
        qi = q[q0 : q0 + q_len]
        ki = k[k0 : k0 + k_len].repeat_interleave(group, dim=1)
        vi = v[k0 : k0 + k_len].repeat_interleave(group, dim=1)
        logits = torch.einsum("qhd,khd->hqk", qi, ki) * scale
        if logits_soft_cap is not None:
            logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
        p_q = torch.arange(k_len - q_len, k_len, dtype=torch.float64)[:, None]
        p_k = torch.arange(k_len, dtype=torch.float64)[None, :]
        if alibi_slopes is not None:
            logits = logits + torch.as_tensor(alibi_slopes).double()[:, None, None] * (p_k - p_q)
        keep = torch.ones(q_len, k_len, dtype=torch.bool)
        if causal:
            keep &= p_k <= p_q
        if sliding_window is not None:
            keep &= (p_q - p_k) < sliding_window
        logits = logits.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # rows with no key -> 0
        out[q0 : q0 + q_len] = torch.einsum("hqk,khd->qhd", probs, vi)
        q0, k0 = q0 + q_len, k0 + k_len
    return out


def round_like_cache(x: torch.Tensor, kv_cache_dtype: str, dtype: torch.dtype, scale: float):
    """What reading `x` back from the cache gives: fp8-saturated / scaled, or `dtype`."""
    if kv_cache_dtype in FP8:
        info = torch.finfo(FP8[kv_cache_dtype])
        return (x.float() / scale).clamp(info.min, info.max).to(
            FP8[kv_cache_dtype]
        ).double() * scale
    return x.to(dtype).double()


def nan_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, kv_cache_dtype):
    """A `[2, NB, BS*Hkv*D]` cache of NaN: every byte the test does not write is poison."""
    shape = (2, num_blocks, block_size * num_kv_heads * head_size)
    if kv_cache_dtype in FP8:
        nan_byte = 0x7F if FP8[kv_cache_dtype] == torch.float8_e4m3fn else 0xFF
        return torch.full(shape, nan_byte, dtype=torch.uint8)
    return torch.full(shape, float("nan"), dtype=dtype)


def put(
    kv_cache,
    half,
    slot,
    x,
    head_size,
    num_kv_heads,
    block_size,
    kv_cache_dtype,
    scale,
    layout="vllm",
):
    """Write `x [Hkv, D]` at `slot` by explicit index arithmetic in vLLM's split layout
    (key `[NB, Hkv, D/x, BS, x]`, value `[NB, Hkv, D, BS]`) or IPEX's (`[NB, Hkv, BS, D]`)."""
    elem = kv_cache.element_size()
    xw = 16 // elem
    block, offset = divmod(slot, block_size)
    flat = kv_cache[half, block]
    if kv_cache_dtype in FP8:
        info = torch.finfo(FP8[kv_cache_dtype])
        x = (x.float() / scale).clamp(info.min, info.max).to(FP8[kv_cache_dtype]).view(torch.uint8)
    else:
        x = x.to(kv_cache.dtype)
    h = torch.arange(num_kv_heads)[:, None]
    d = torch.arange(head_size)[None, :]
    if layout == "ipex":  # key and value blocks viewed as [Hkv, BS, D]
        index = (h * block_size + offset) * head_size + d
    elif layout == "nhd":  # the JAX core's [BS, Hkv, D]
        index = (offset * num_kv_heads + h) * head_size + d
    elif half == 0:  # key block viewed as [Hkv, D/x, BS, x]
        index = ((h * (head_size // xw) + d // xw) * block_size + offset) * xw + d % xw
    else:  # value block viewed as [Hkv, D, BS]
        index = (h * head_size + d) * block_size + offset
    flat[index] = x


@dataclasses.dataclass
class Step:
    query: torch.Tensor  # [T, Hq*D]
    key: torch.Tensor  # [T, Hkv*D] new tokens
    value: torch.Tensor
    kv_cache: torch.Tensor
    metadata: object
    expected: torch.Tensor  # float64 [T, Hq, D]
    q_lens: list
    seq_lens: list
    block_tables: list
    slots: list
    all_keys: list  # per sequence, float64 as the cache holds them
    all_values: list


def make_decoder_step(
    rng: np.random.Generator,
    builder,
    *,
    prefills,
    decodes,
    num_heads,
    num_kv_heads,
    head_size,
    block_size,
    dtype=torch.float32,
    kv_cache_dtype="auto",
    k_scale=1.0,
    v_scale=1.0,
    scale=None,
    alibi_slopes=None,
    sliding_window=None,
    logits_soft_cap=None,
    layout="vllm",
) -> Step:
    """prefills: [(q_len, ctx_len)], decodes: [ctx_len]; prefills come first in the step."""
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    seqs = list(prefills) + [(1, c) for c in decodes]
    seq_lens = [q + c for q, c in seqs]
    q_lens = [q for q, _ in seqs]
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    order = rng.permutation(num_blocks).tolist()
    tables, used = [], 0
    for n in blocks_needed:
        tables.append(order[used : used + n])
        used += n
    kv_cache = nan_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, kv_cache_dtype)
    query = torch.randn(sum(q_lens), num_heads, head_size, generator=gen).to(dtype)
    new_k, new_v, all_k, all_v, slots = [], [], [], [], []
    for (q_len, ctx), table in zip(seqs, tables, strict=True):
        k = torch.randn(q_len + ctx, num_kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(q_len + ctx, num_kv_heads, head_size, generator=gen).to(dtype)
        for p in range(q_len + ctx):
            slot = table[p // block_size] * block_size + p % block_size
            if p < ctx:
                put(
                    kv_cache,
                    0,
                    slot,
                    k[p],
                    head_size,
                    num_kv_heads,
                    block_size,
                    kv_cache_dtype,
                    k_scale,
                    layout,
                )
                put(
                    kv_cache,
                    1,
                    slot,
                    v[p],
                    head_size,
                    num_kv_heads,
                    block_size,
                    kv_cache_dtype,
                    v_scale,
                    layout,
                )
            else:
                slots.append(slot)
        new_k.append(k[ctx:])
        new_v.append(v[ctx:])
        all_k.append(round_like_cache(k, kv_cache_dtype, dtype, k_scale))
        all_v.append(round_like_cache(v, kv_cache_dtype, dtype, v_scale))
    scale = head_size**-0.5 if scale is None else scale
    expected = reference_attention(
        query,
        torch.cat(all_k),
        torch.cat(all_v),
        q_lens,
        seq_lens,
        causal=True,
        scale=scale,
        alibi_slopes=alibi_slopes,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )
    md = builder.build(seq_lens, q_lens, -1, -1, block_tables=tables, block_size=block_size)
    return Step(
        query=query.reshape(len(query), -1),
        key=torch.cat(new_k).reshape(len(query), -1),
        value=torch.cat(new_v).reshape(len(query), -1),
        kv_cache=kv_cache,
        metadata=md,
        expected=expected,
        q_lens=q_lens,
        seq_lens=seq_lens,
        block_tables=tables,
        slots=slots,
        all_keys=all_k,
        all_values=all_v,
    )

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
    sinks=None,
):
    """float64 attention per sequence; q `[Tq, Hq, D]`, k/v `[Tk, Hkv, D]`, bottom-right.
    `sinks` `[Hq]`: each head's attention-sink logit, a key with no value in every row's
    softmax (its column dropped after the softmax)."""
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
        if sinks is not None:
            sink = torch.as_tensor(sinks).double()[:, None, None].expand(-1, q_len, 1)
            logits = torch.cat([logits, sink], dim=-1)
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # rows with no key -> 0
        probs = probs[..., :k_len]  # the sinks' column, if any, dropped
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


# -- the decoder cases every backend runs --------------------------------------------------


def alibi(num_heads):
    """The standard ALiBi slopes (written here, not taken from the code under test)."""
    closest = 2 ** int(np.floor(np.log2(num_heads)))
    slopes = [2.0 ** (-8.0 / closest * k) for k in range(1, closest + 1)]
    slopes += [2.0 ** (-4.0 / closest * k) for k in range(1, 2 * (num_heads - closest), 2)]
    return slopes


# (id, prefills [(q_len, ctx_len)], decodes [ctx_len], Hq, Hkv, D, BS, dtype, kv_cache_dtype,
#  extras). Together they cover GQA groups 1, 3, 4, 8; head sizes 64, 80, 128, 256; block
# sizes 8, 16, 32; float32 and bfloat16; e4m3 and e5m2 caches; ALiBi, windows, soft cap.
CASES = [
    ("prefill-only", [(5, 0), (17, 0)], [], 4, 4, 64, 16, torch.float32, "auto", {}),
    ("decode-only", [], [1, 16, 40], 8, 2, 64, 8, torch.float32, "auto", {}),
    ("mixed-gqa4", [(7, 0)], [3, 33], 8, 2, 128, 16, torch.float32, "auto", {}),
    ("chunked-gqa8", [(6, 10), (3, 0)], [20], 16, 2, 80, 8, torch.float32, "auto", {}),
    ("mqa-d256-bs32", [(9, 0)], [40, 2], 8, 1, 256, 32, torch.float32, "auto", {}),
    ("bf16", [(5, 0), (4, 12)], [17], 8, 2, 64, 16, torch.bfloat16, "auto", {}),
    ("alibi", [(9, 0)], [5, 30], 8, 2, 64, 16, torch.float32, "auto", {"alibi": True}),
    ("alibi-chunked", [(4, 9)], [12], 6, 2, 64, 8, torch.float32, "auto", {"alibi": True}),
    ("window", [(12, 0)], [25], 4, 2, 64, 8, torch.float32, "auto", {"sliding_window": 5}),
    (
        "window-chunked-alibi",
        [(5, 11)],
        [20],
        4,
        1,
        64,
        8,
        torch.float32,
        "auto",
        {"sliding_window": 7, "alibi": True},
    ),
    (
        "softcap",
        [(6, 0), (3, 5)],
        [9],
        4,
        2,
        64,
        16,
        torch.float32,
        "auto",
        {"logits_soft_cap": 2.0},
    ),
    ("fp8-e4m3", [(5, 0), (2, 7)], [21], 8, 2, 64, 16, torch.bfloat16, "fp8", {}),
    ("fp8-e5m2", [(4, 0)], [13, 1], 4, 4, 128, 8, torch.float32, "fp8_e5m2", {}),
    (
        "fp8-e5m2-alibi-bf16-bs32",
        [(3, 6)],
        [30],
        8,
        2,
        80,
        32,
        torch.bfloat16,
        "fp8_e5m2",
        {"alibi": True},
    ),
]

# Cache layout of each backend's `kv_cache[2, NB, BS*Hkv*D]`, for `put`.
LAYOUTS = {"TORCH_SDPA": "vllm", "XFORMERS": "vllm", "IPEX": "ipex", "JAX": "nhd"}


def bias_kwargs(case) -> dict:
    extras, num_heads = case[9], case[3]
    return dict(
        alibi_slopes=alibi(num_heads) if extras.get("alibi") else None,
        sliding_window=extras.get("sliding_window"),
        logits_soft_cap=extras.get("logits_soft_cap"),
    )


def case_scale(case) -> float:
    """The softmax scale of `case`: not the default 1/sqrt(D), so a kernel that ignores the
    scale it is given fails (IPEX's CPU `varlen_attention` does)."""
    return 0.8 * case[5] ** -0.5


def case_dtypes(case) -> tuple:
    """The dtypes whose tolerance applies: the query dtype and, with fp8, the cache's."""
    dtype, cache_dtype = case[7], case[8]
    return (dtype, None if cache_dtype == "auto" else FP8[cache_dtype])


def run_case(case, rng, backend_cls, layout=None):
    """One random decoder step of `case` for `backend_cls` (its builder and impl; its cache
    layout unless `layout` names another).

    Returns (step, impl, layer). The same `rng` state gives the same numbers for every
    backend, so two backends can be compared on identical inputs.
    """
    from torch_backends import AttentionLayer

    _name, prefills, decodes, hq, hkv, d, bs, dtype, cache_dtype, _extras = case
    fp8 = cache_dtype != "auto"
    k_scale, v_scale = (0.45, 0.7) if fp8 else (1.0, 1.0)
    scale = case_scale(case)
    step = make_decoder_step(
        rng,
        backend_cls.get_builder_cls()(None),
        prefills=prefills,
        decodes=decodes,
        num_heads=hq,
        num_kv_heads=hkv,
        head_size=d,
        block_size=bs,
        dtype=dtype,
        kv_cache_dtype=cache_dtype,
        k_scale=k_scale,
        v_scale=v_scale,
        scale=scale,
        layout=layout or LAYOUTS[backend_cls.get_name()],
        **bias_kwargs(case),
    )
    impl = backend_cls.get_impl_cls()(
        hq, d, scale, hkv, kv_cache_dtype=cache_dtype, **bias_kwargs(case)
    )
    return step, impl, AttentionLayer(k_scale, v_scale)


def backend_unavailable(name: str) -> str | None:
    """Why backend `name` cannot be imported here (None if it can)."""
    from torch_backends import get_attn_backend

    try:
        get_attn_backend(name)
    except ImportError as e:
        reason = f"{name} backend not importable here: {str(e).split(';')[0]}"
        if name == "IPEX":
            reason += "; scripts/test.sh runs these tests in the IPEX environment"
        return reason
    return None


def backend_param(name: str):
    """A pytest param for backend `name`: marked `ipex` for IPEX, skipped with the reason
    where it cannot be imported (IPEX needs torch 2.8: scripts/test.sh runs those tests in
    the IPEX environment)."""
    import pytest

    marks = [pytest.mark.ipex] if name == "IPEX" else []
    reason = backend_unavailable(name)
    if reason:
        marks.append(pytest.mark.skip(reason=reason))
    return pytest.param(name, marks=marks, id=name)


def cache_bytes_at(kv_cache, slot, layout, num_kv_heads, head_size, block_size):
    """The bytes of `slot`'s key and value in a `kv_cache` of `layout`, in `[Hkv, D]` order,
    so caches of different layouts can be compared slot by slot."""
    elem = kv_cache.element_size()
    xw = 16 // elem
    block, offset = divmod(slot, block_size)
    h = torch.arange(num_kv_heads)[:, None]
    d = torch.arange(head_size)[None, :]
    if layout == "ipex":
        key_index = value_index = (h * block_size + offset) * head_size + d
    elif layout == "nhd":
        key_index = value_index = (offset * num_kv_heads + h) * head_size + d
    else:
        key_index = ((h * (head_size // xw) + d // xw) * block_size + offset) * xw + d % xw
        value_index = (h * head_size + d) * block_size + offset
    raw = kv_cache.view(torch.uint8).view(2, kv_cache.shape[1], -1, elem)
    return raw[0, block][key_index], raw[1, block][value_index]

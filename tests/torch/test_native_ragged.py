"""The ragged paged-attention kernel as a torch op (`torch.ops.jax_attn.ragged_paged_attention`,
`torch_backends.native.ragged_paged_attention`): prefill, chunked prefill with a cached prefix,
decodes and mixed steps over NaN-poisoned token-major caches against the float64 oracle; bad
input refused by name before any write; `opcheck`; `torch.compile` without a graph break. (The
op against the XLA handler, bit for bit: tests/interop/test_interop_native_ragged.py.)"""

import threading

import pytest
import torch
from tolerances import assert_close
from torch_cases import FP8, alibi, reference_attention

from torch_backends import native

pytestmark = pytest.mark.skipif(
    native.unavailable_reason() is not None,
    reason=f"native torch ops not available: {native.unavailable_reason()}",
)

NAN_BYTE = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0xFF}


def ragged_case(
    gen,
    batch,
    *,
    num_heads,
    num_kv_heads,
    head_size,
    block_size,
    dtype,
    cache_dtype,
    k_scale=1.0,
    v_scale=1.0,
    pad_tokens=3,
    pad_rows=2,
):
    """A ragged step over NaN-poisoned caches `[NB, BS, Hkv, D]` filled by index arithmetic.

    batch [(q_len, seq_len)]: each sequence's last q_len positions are queries, e.g.
    [(40, 40), (9, 45), (1, 17)]: a prefill, a chunk after 36 cached tokens, a decode.

        query rows |<- s0 (40) ->|<- s1 (9) ->|s2|pad pad pad|
        query_start_loc [0, 40, 49, 50, 50, 50]   (two padding rows past num_seqs = 3)

    Blocks are shuffled and a spare one stays NaN, as do the slots past seq_len in each last
    block. Returns the op's arguments, and the keys and values the caches hold as float64
    `[sum(seq_lens), Hkv, D]` (fp8: as read back, times the scale)."""
    q_lens = [q for q, _ in batch]
    seq_lens = [n for _, n in batch]
    max_blocks = max(-(-n // block_size) for n in seq_lens) + 1  # a spare column of zeros
    used = sum(-(-n // block_size) for n in seq_lens)
    num_blocks = used + 2
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(batch) + pad_rows, max_blocks, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    if cache_dtype in FP8.values():
        key_cache = torch.full(shape, NAN_BYTE[cache_dtype], dtype=torch.uint8).view(cache_dtype)
    else:
        key_cache = torch.full(shape, float("nan"), dtype=cache_dtype)
    value_cache = key_cache.clone()
    keys, values = [], []
    next_id = 0
    for s, n in enumerate(seq_lens):
        nb = -(-n // block_size)
        tables[s, :nb] = ids[next_id : next_id + nb].to(torch.int32)
        next_id += nb
        pos = torch.arange(n)
        blocks, offsets = tables[s, pos // block_size].long(), pos % block_size
        for cache, rows, scale in ((key_cache, keys, k_scale), (value_cache, values, v_scale)):
            x = torch.randn(n, num_kv_heads, head_size, generator=gen)
            if cache_dtype in FP8.values():
                info = torch.finfo(cache_dtype)
                stored = (x / scale).clamp(info.min, info.max).to(cache_dtype)
                rows.append(stored.double() * scale)
            else:
                stored = x.to(cache_dtype)
                rows.append(stored.double())
            cache[blocks, offsets] = stored
    num_tokens = sum(q_lens) + pad_tokens
    query = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(dtype)
    starts = torch.tensor([0, *q_lens]).cumsum(0).tolist()
    qsl = torch.tensor(starts + [starts[-1]] * pad_rows, dtype=torch.int32)
    lens = torch.tensor(seq_lens + [0] * pad_rows, dtype=torch.int32)
    meta = dict(
        query_start_loc=qsl,
        seq_lens=lens,
        block_tables=tables,
        num_seqs=torch.tensor(len(batch), dtype=torch.int32),
    )
    return query, key_cache, value_cache, meta, torch.cat(keys), torch.cat(values)


PREFILL = [(37, 37), (1, 1), (17, 17)]
CHUNKED = [(9, 45), (16, 200), (3, 130)]  # chunks after cached prefixes
# Prefill, a chunk, then nine decodes (a run the decode kernel takes, staged behind the tiles
# when there are enough per worker).
MIXED = [(33, 33), (5, 71), *[(1, n) for n in (1, 2, 17, 64, 129, 200, 31, 96, 150)]]
MIX_SHORT = [(1, 50), (20, 20), (1, 3), (4, 90), (1, 1)]  # lone decodes among the tiles
# Few long decodes: the decode kernel splits each sequence's keys into parts (split-K).
LONG_DECODES = [(1, 2900), (1, 2100), (1, 3000), (1, 1700)]

F32, BF16, F16, E4M3 = torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn
# id, batch, Hq, Hkv, D, BS, query dtype, cache dtype, bias, causal
GRID = [
    ("prefill-f32", PREFILL, 8, 2, 128, 16, F32, F32, None, True),
    ("prefill-noncausal", PREFILL, 4, 4, 64, 16, F32, F32, None, False),
    ("chunked-mqa-window", CHUNKED, 4, 1, 64, 16, F32, F32, "window", True),
    ("chunked-bf16-alibi-g7", CHUNKED, 7, 1, 80, 128, BF16, F32, "alibi", True),
    ("mixed-bf16", MIXED, 8, 2, 128, 128, BF16, BF16, "alibi", True),
    ("mixed-bf16-d64", MIX_SHORT, 4, 2, 64, 16, BF16, BF16, "window", True),
    ("mixed-f16-softcap", MIXED, 4, 2, 80, 16, F16, F16, "softcap", True),
    ("mixed-f32-all", MIXED, 8, 1, 128, 128, F32, F32, "all", True),
    ("mixed-fp8-bf16q", MIXED, 8, 2, 128, 16, BF16, E4M3, None, True),
    ("prefill-fp8-f32q", PREFILL, 2, 2, 64, 128, F32, E4M3, "window", True),
    ("chunked-fp8-f16q", CHUNKED, 8, 2, 80, 16, F16, E4M3, "alibi", True),
    ("mixed-f32-sinks", MIXED, 8, 2, 128, 16, F32, F32, "sinks", True),
    ("mixed-bf16-sinks-all", MIXED, 8, 2, 128, 128, BF16, BF16, "sinks-all", True),
    ("mixed-fp8-sinks", MIX_SHORT, 4, 1, 64, 16, BF16, E4M3, "sinks", True),
    ("prefill-noncausal-sinks", PREFILL, 4, 2, 96, 16, F16, F16, "sinks", False),
    ("split-decodes-f32-sinks", LONG_DECODES, 8, 2, 64, 128, F32, F32, "sinks", True),
    ("split-decodes-bf16-sinks", LONG_DECODES, 8, 2, 128, 128, BF16, BF16, "sinks", True),
]


def bias_kwargs(bias, num_heads, gen=None):
    slopes = torch.tensor(alibi(num_heads), dtype=torch.float32)
    # Sinks from well below a row's logits to well above them (gpt-oss's lie within +-5).
    sinks = 3.0 * torch.randn(num_heads, generator=gen)
    return {
        None: {},
        "alibi": dict(alibi_slopes=slopes),
        "window": dict(sliding_window=23),
        "softcap": dict(logits_soft_cap=2.5),
        "all": dict(alibi_slopes=slopes, sliding_window=40, logits_soft_cap=4.0),
        "sinks": dict(sinks=sinks),
        "sinks-all": dict(sinks=sinks, alibi_slopes=slopes, sliding_window=40,
                          logits_soft_cap=4.0),
    }[bias]  # fmt: skip


@pytest.mark.parametrize(
    "batch,num_heads,num_kv_heads,head_size,block_size,dtype,cache_dtype,bias,causal",
    [case[1:] for case in GRID],
    ids=[case[0] for case in GRID],
)
def test_ragged_op_matches_the_float64_oracle(
    batch, num_heads, num_kv_heads, head_size, block_size, dtype, cache_dtype, bias, causal, rng
):
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    fp8 = cache_dtype in FP8.values()
    scales = (0.7, 1.3) if fp8 else (1.0, 1.0)
    query, key_cache, value_cache, meta, keys, values = ragged_case(
        gen, batch, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        block_size=block_size, dtype=dtype, cache_dtype=cache_dtype, k_scale=scales[0],
        v_scale=scales[1],
    )  # fmt: skip
    kwargs = bias_kwargs(bias, num_heads, gen)
    scale = head_size**-0.5
    out = torch.full_like(query, float("nan"))
    result = native.ragged_paged_attention(
        out, query, key_cache, value_cache, **meta, scale=scale, causal=causal,
        k_scale=scales[0], v_scale=scales[1], **kwargs,
    )  # fmt: skip
    assert result is out
    real = sum(q for q, _ in batch)
    expected = reference_attention(
        query[:real], keys, values, [q for q, _ in batch], [n for _, n in batch],
        causal=causal, scale=scale, **kwargs,
    )  # fmt: skip
    assert_close(out[:real].float(), expected, dtype, cache_dtype, what="native ragged")
    assert torch.equal(out[real:], torch.zeros_like(out[real:]))  # padding rows: zeros


def test_uint8_fp8_cache_named_by_kv_cache_dtype(rng):
    """vLLM's form of an fp8 cache: uint8 bit patterns, the format in kv_cache_dtype; the same
    bits as a float8 tensor give the same output."""
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    query, kc, vc, meta, _, _ = ragged_case(
        gen, MIX_SHORT, num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
        dtype=torch.bfloat16, cache_dtype=torch.float8_e5m2, k_scale=0.5, v_scale=2.0,
    )  # fmt: skip
    outs = []
    as_bits = (kc.view(torch.uint8), vc.view(torch.uint8))
    for caches, kv_cache_dtype in (((kc, vc), "auto"), (as_bits, "fp8_e5m2")):
        out = torch.empty_like(query)
        native.ragged_paged_attention(
            out, query, *caches, **meta, scale=0.125, k_scale=0.5, v_scale=2.0,
            kv_cache_dtype=kv_cache_dtype,
        )  # fmt: skip
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_num_seqs_as_an_int_and_threads_agree(rng):
    """A Python int num_seqs works like the tensor; 1 and 3 torch threads give the same bits
    (the tiles' work split changes, their per-row math does not; no decode run here, whose
    split-K parts follow the thread count)."""
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    query, kc, vc, meta, _, _ = ragged_case(
        gen, [*PREFILL, *CHUNKED], num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
        dtype=torch.float32, cache_dtype=torch.float32,
    )  # fmt: skip
    threads = torch.get_num_threads()
    outs = []
    try:
        for n, num_seqs in ((1, meta["num_seqs"]), (3, int(meta["num_seqs"]))):
            torch.set_num_threads(n)
            out = torch.empty_like(query)
            native.ragged_paged_attention(
                out, query, kc, vc, **{**meta, "num_seqs": num_seqs}, scale=0.125
            )
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize(
    "dtype,cache_dtype", [(F32, F32), (BF16, BF16), (BF16, E4M3)], ids=["f32", "bf16", "fp8"]
)
def test_queries_of_a_fused_projection_are_read_where_they_lie(dtype, cache_dtype, rng,
                                                               monkeypatch):  # fmt: skip
    """vLLM's query is a view of the fused qkv projection: its tokens (Hq + 2 Hkv) * D apart,
    each token's heads dense. The kernels read it in place (nothing staged) and give the bits
    of its contiguous copy, for prefills, chunks and a run of decodes (the decode kernel's path
    inside the ragged step). (The split decode op's: tests/torch/test_native_ops.py.)"""
    monkeypatch.setattr(native, "STAGE_MIN_BYTES", 0)  # would stage these small queries
    monkeypatch.setattr(native, "_staging", threading.local())
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    query, kc, vc, meta, _, _ = ragged_case(
        gen, MIXED, num_heads=8, num_kv_heads=2, head_size=128, block_size=16, dtype=dtype,
        cache_dtype=cache_dtype,
    )  # fmt: skip
    tokens, heads, size = query.shape
    fused = torch.randn(tokens, heads + 4, size, generator=gen).to(dtype)
    fused[:, :heads] = query
    strided = fused[:, :heads]
    assert not strided.is_contiguous() and strided.stride(0) == (heads + 4) * size
    want, got = torch.full_like(query, 7.0), torch.full_like(query, 7.0)
    native.ragged_paged_attention(want, query, kc, vc, **meta, scale=0.125)
    native.ragged_paged_attention(got, strided, kc, vc, **meta, scale=0.125)
    assert torch.equal(got, want)
    assert not getattr(native._staging, "buffers", {}), "the strided query was staged"


def test_queries_with_strided_heads_are_staged_in_a_reused_buffer(rng, monkeypatch):
    """A query whose heads are not dense within a token is staged in one buffer per thread,
    reused by the next call, which sees its own rows (a smaller step after a larger one too),
    not the last call's; the bits are its contiguous copy's."""
    monkeypatch.setattr(native, "STAGE_MIN_BYTES", 0)  # stage these small queries as well
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    buffers = []
    for batch in ([*PREFILL, *CHUNKED], [(5, 20), (1, 9)]):
        query, kc, vc, meta, _, _ = ragged_case(
            gen, batch, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
            dtype=torch.float32, cache_dtype=torch.float32,
        )  # fmt: skip
        wide = torch.cat([query, torch.randn(query.shape, generator=gen)], dim=2)
        strided = wide[:, :, : query.shape[2]]
        assert strided.stride(1) != query.shape[2]
        want, got = torch.empty_like(query), torch.empty_like(query)
        native.ragged_paged_attention(want, query, kc, vc, **meta, scale=0.125)
        native.ragged_paged_attention(got, strided, kc, vc, **meta, scale=0.125)
        assert torch.equal(got, want)
        buffers.append(native._staging.buffers[("query", torch.float32)])
    assert buffers[0] is buffers[1]


# --------------------------------------------------------------------------------------------
# Refusals: ValueError naming the argument and the rule; nothing written.


def _small(rng, **kw):
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    query, kc, vc, meta, _, _ = ragged_case(
        gen, [(5, 20), (1, 9), (3, 3)], num_heads=4, num_kv_heads=2, head_size=64,
        block_size=16, dtype=torch.float32, cache_dtype=torch.float32, **kw,
    )  # fmt: skip
    return query, kc, vc, meta


def _op_args(tensors, **over):
    """The op's positional arguments: `tensors` (out, query, key_cache, value_cache, metadata)
    with defaults for the rest, any of them replaced by name."""
    out, query, kc, vc, meta = tensors
    args = dict(
        out=out, query=query, key_cache=kc, value_cache=vc, **meta, alibi_slopes=None,
        scale=0.125, causal=True, sliding_window=0, logits_soft_cap=0.0,
        k_scale=torch.ones(1), v_scale=torch.ones(1), kv_cache_dtype="auto", sinks=None,
    )  # fmt: skip
    args.update(over)
    return tuple(args.values())


def _damage(name, index, value):
    def apply(meta):
        meta[name][index] = value

    return apply


@pytest.mark.parametrize(
    "damage,message",
    [
        (_damage("block_tables", (0, 1), 10_000),
         r"block_tables\[0, 1\]=10000 is not a block id in \[0, num_blocks="),
        (_damage("block_tables", (1, 0), -1), r"block_tables\[1, 0\]=-1 is not a block id"),
        (_damage("seq_lens", 0, 4), r"seq_lens\[0\]=4 must be in \[q_len=5, "),
        (_damage("seq_lens", 1, 10_000), r"seq_lens\[1\]=10000 must be in \[q_len=1, max_"),
        (_damage("query_start_loc", 2, 2),
         r"query_start_loc must be non-decreasing: query_start_loc\[1\]=5 > "),
        (_damage("query_start_loc", 3, 500), r"query_start_loc\[3\]=500 is beyond the 12 query"),
        (_damage("query_start_loc", 0, -1), r"query_start_loc\[0\]=-1 must be in \[0, num_tok"),
        (lambda meta: meta["num_seqs"].fill_(6), r"num_seqs=6 must be in \[0, 5\]"),
        (lambda meta: meta["num_seqs"].fill_(-1), r"num_seqs=-1 must be in \[0, 5\]"),
    ],
)  # fmt: skip
def test_bad_metadata_raises_before_any_write(damage, message, rng):
    query, kc, vc, meta = _small(rng)
    damage(meta)
    out = torch.full_like(query, 7.0)
    snapshot = (kc.clone(), vc.clone())
    with pytest.raises(ValueError, match=message):
        torch.ops.jax_attn.ragged_paged_attention(*_op_args((out, query, kc, vc, meta)))
    assert torch.equal(out, torch.full_like(query, 7.0))  # not one row written
    for before, after in zip(snapshot, (kc, vc), strict=True):
        assert torch.equal(before.view(torch.uint8), after.view(torch.uint8))


def test_bad_shapes_and_dtypes_name_the_argument(rng):
    query, kc, vc, meta = _small(rng)
    out = torch.full_like(query, 7.0)
    op = torch.ops.jax_attn.ragged_paged_attention
    cases = [
        (dict(out=out[:3]), r"out must have the query's shape and dtype"),
        (dict(out=out.double()), r"out must have the query's shape and dtype"),
        (dict(out=query), r"out must not share memory with query"),
        (dict(query=query[:, :, :32].contiguous(), out=out[:, :, :32].contiguous()),
         r"key_cache must be \[num_blocks, block_size, num_kv_heads, head_size=32\]"),
        (dict(value_cache=vc[:, :, :1].contiguous()), r"value_cache .* must match key_cache"),
        (dict(value_cache=vc.half()), r"value_cache dtype Half must match key_cache Float"),
        (dict(block_tables=meta["block_tables"].long()), r"block_tables must be int32"),
        (dict(seq_lens=meta["seq_lens"][:2]), r"seq_lens must be int32 \[num_seqs=5\]"),
        (dict(query_start_loc=meta["query_start_loc"][:3]),
         r"query_start_loc must be int32 \[num_seqs \+ 1=6\]"),
        (dict(num_seqs=torch.tensor([3, 3], dtype=torch.int32)), r"num_seqs must be one int32"),
        (dict(alibi_slopes=torch.ones(3)), r"alibi_slopes must be float32 \[num_heads=4\]"),
        (dict(sinks=torch.ones(5)), r"sinks must be float32 \[num_heads=4\]"),
        (dict(sinks=torch.ones(4, dtype=torch.float64)), r"sinks must be float32"),
        (dict(k_scale=torch.ones(2)), r"k_scale must hold one value"),
        (dict(kv_cache_dtype="fp9"), r"kv_cache_dtype=fp9 needs a 1-byte cache"),
        (dict(query=query.to(torch.int32), out=out.to(torch.int32)),
         r"query dtype Int must be float32, bfloat16 or float16"),
        (dict(key_cache=kc.double(), value_cache=vc.double()),
         r"key_cache dtype Double must be float32, bfloat16, float16 or float8"),
        (dict(query=query.transpose(0, 1).contiguous().transpose(0, 1)),
         r"query must be contiguous"),
    ]  # fmt: skip
    for over, message in cases:
        with pytest.raises(ValueError, match=message):
            op(*_op_args((out, query, kc, vc, meta), **over))
    assert torch.equal(out, torch.full_like(query, 7.0))


def test_gqa_rule_and_head_size_limit_are_the_kernels():
    """Sizes the kernel refuses: a group that does not divide, a head size past 512."""
    op = torch.ops.jax_attn.ragged_paged_attention
    meta = dict(
        query_start_loc=torch.tensor([0, 2], dtype=torch.int32),
        seq_lens=torch.tensor([2], dtype=torch.int32),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        num_seqs=torch.tensor(1, dtype=torch.int32),
    )
    for num_heads, num_kv_heads, head_size, message in (
        (6, 4, 64, r"num_heads=6 must be divisible by num_kv_heads=4"),
        (2, 1, 544, r"head_size=544 must be at most 512"),
    ):
        query = torch.randn(2, num_heads, head_size)
        cache = torch.randn(1, 16, num_kv_heads, head_size)
        out = torch.full_like(query, 7.0)
        with pytest.raises(ValueError, match=message):
            op(*_op_args((out, query, cache, cache.clone(), meta)))
        assert torch.equal(out, torch.full_like(query, 7.0))


def test_opcheck(rng):
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    query, kc, vc, meta, _, _ = ragged_case(
        gen, MIX_SHORT, num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
        dtype=torch.bfloat16, cache_dtype=torch.bfloat16,
    )  # fmt: skip
    kc, vc = (c.nan_to_num(0.0) for c in (kc, vc))  # opcheck compares outputs with NaN as unequal
    args = _op_args((torch.empty_like(query), query, kc, vc, meta), alibi_slopes=torch.rand(4),
                    sliding_window=17, logits_soft_cap=5.0, sinks=torch.randn(4))  # fmt: skip
    torch.library.opcheck(torch.ops.jax_attn.ragged_paged_attention.default, args)


def test_torch_compile_traces_the_op_without_a_graph_break(rng):
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    query, kc, vc, meta, _, _ = ragged_case(
        gen, MIXED, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
        dtype=torch.float32, cache_dtype=torch.float32,
    )  # fmt: skip

    def step(query, out):
        native.ragged_paged_attention(
            out, query * 2.0, kc, vc, **meta, scale=0.125, sliding_window=24
        )
        return out + 1.0

    eager = step(query, torch.empty_like(query))
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)  # inductor; fullgraph: no graph break
    assert torch.equal(compiled(query, torch.empty_like(query)), eager)

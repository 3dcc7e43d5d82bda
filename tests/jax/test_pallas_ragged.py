"""Pallas ragged paged attention kernel against a NumPy float64 oracle.

Each case is a batch mixing decode, prefill and chunked prefill: cache blocks in random
order, NaN in unused blocks, tail slots and padding query tokens, junk ids in unused
block-table entries, and two padding rows of junk metadata past `num_seqs`. The kernel runs in
interpret mode everywhere and natively when a GPU is present; its
`ragged_paged_attention_reference` is checked against the same oracle. The kernel is also
lowered for CUDA (to Triton IR, not compiled), which needs no GPU and catches what the Triton
lowering refuses (non-power-of-two tiles, unsupported primitives).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import LOWERING_GRID, CaseId, error_dtypes, nan_paged_cache
from pallas_lowering import lower_for_cuda, lowers_for_cuda
from tolerances import assert_close

from jax_attn.pallas import ragged_paged_attention, ragged_paged_attention_reference
from jax_attn.pallas.ragged_paged_attention import _key_block_range

pytestmark = pytest.mark.pallas

ON_GPU = jax.devices()[0].platform == "gpu"
INTERPRET = [True, False] if ON_GPU else [True]

BATCHES = {
    # name: (query_lens, context_lens); seq_len = query_len + context_len
    "decode": ((1, 1, 1, 1), (0, 2, 16, 512)),  # seq lens 1, 3, 17, 513
    "prefill": ((1, 3, 17, 33), (0, 0, 0, 0)),
    "chunked": ((3, 17, 8), (16, 100, 8)),  # 19, 117, 16 (a block boundary)
    "mixed": ((17, 1, 3, 1, 16), (0, 31, 14, 0, 16)),
}
NUM_PAD_SEQS = 2  # metadata rows past num_seqs, filled with junk
NUM_PAD_TOKENS = 3  # query tokens past query_start_loc[num_seqs], filled with NaN


@dataclasses.dataclass(frozen=True)
class Case(CaseId):
    batch: str = "mixed"
    block_size: int = 16
    head_size: int = 64
    num_heads: int = 8
    num_kv_heads: int = 2
    dtype: str = "float32"
    cache_dtype: str | None = None
    causal: bool = True
    alibi: bool = False
    sliding_window: int | None = None
    soft_cap: float | None = None
    scales: tuple[float, float] = (1.0, 1.0)
    block_q: int | None = None
    pages_per_compute_block: int | None = None


# Interpret mode compiles each case for seconds: the grid combines features rather than
# crossing them, and every feature and size the issue names appears at least once. Every case
# is also valid natively: power-of-two tiles with >= 16 rows and >= 16 keys per dot.
CASES = [
    Case(batch="decode", block_size=8),
    Case(batch="prefill", block_size=32),
    Case(batch="chunked"),
    Case(batch="mixed", block_size=8),
    Case(num_heads=4, num_kv_heads=4, block_size=32),  # GQA group 1
    Case(num_heads=16, num_kv_heads=2, batch="chunked"),  # group 8
    *(Case(head_size=d, batch="chunked", num_heads=8, num_kv_heads=1) for d in (128, 256)),
    Case(dtype="bfloat16", scales=(0.5, 2.0)),  # a bf16 cache also multiplies by its scales
    Case(dtype="float16", block_size=8),
    Case(dtype="bfloat16", cache_dtype="float8_e4m3fn", scales=(0.37, 0.61)),
    Case(dtype="float32", cache_dtype="float8_e5m2", scales=(0.8, 1.3), batch="chunked"),
    Case(alibi=True, sliding_window=16),
    Case(sliding_window=1),
    Case(sliding_window=5, soft_cap=2.0),
    Case(batch="chunked", sliding_window=40, block_size=8),
    Case(causal=False),
    Case(batch="chunked", causal=False, alibi=True, sliding_window=20, soft_cap=5.0),
    Case(batch="decode", alibi=True, sliding_window=7, soft_cap=3.0, dtype="bfloat16"),
    # Small tiles: sequences span several tiles and tiles start mid-block.
    Case(block_q=1, num_heads=32, num_kv_heads=2),  # a tile per token; GQA group 16
    Case(block_q=4, pages_per_compute_block=1, batch="chunked"),
    Case(block_q=2, sliding_window=9, batch="prefill", num_heads=8, num_kv_heads=1),
]


def make_ragged_batch(case: Case, rng: np.random.Generator):
    q_lens, ctx_lens = BATCHES[case.batch]
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens, strict=True)]
    num_seqs = len(q_lens)
    d = case.head_size
    max_blocks = -(-max(seq_lens) // case.block_size) + 1  # one spare column of junk
    window = case.sliding_window
    first_seen = None if window is None else [c - window + 1 for c in ctx_lens]
    rows = num_seqs + NUM_PAD_SEQS
    key_cache, value_cache, tables, keys, values = nan_paged_cache(
        case, rng, seq_lens, max_blocks=max_blocks, rows=rows, first_seen=first_seen
    )

    num_real = sum(q_lens)
    num_tokens = num_real + NUM_PAD_TOKENS
    query = rng.standard_normal((num_tokens, case.num_heads, d)).astype(jnp.dtype(case.dtype))
    query[num_real:] = np.nan
    # Junk in the padding rows: lengths, and non-monotone start offsets.
    qsl = np.concatenate([[0], np.cumsum(q_lens), rng.integers(0, num_tokens, NUM_PAD_SEQS)])
    lens = np.concatenate([seq_lens, rng.integers(0, 1000, NUM_PAD_SEQS)])
    slopes = rng.uniform(0.05, 1.0, case.num_heads).astype(np.float32) if case.alibi else None
    meta = (qsl.astype(np.int32), lens.astype(np.int32), tables, np.int32(num_seqs))
    return query, key_cache, value_cache, meta, keys, values, q_lens, slopes


def ragged_oracle(query, keys, values, q_lens, *, scale, causal, slopes, window, cap):
    """Per sequence, in float64, straight from the math in SPEC.md; padding tokens give 0."""
    num_tokens, num_heads, d = query.shape
    out = np.zeros((num_tokens, num_heads, d))
    start = 0
    for k, v, q_len in zip(keys, values, q_lens, strict=True):
        seq_len = k.shape[0]
        group = num_heads // k.shape[1]
        k = np.repeat(k, group, axis=1)  # [L, Hq, D]
        v = np.repeat(v, group, axis=1)
        q = query[start : start + q_len].astype(np.float64)  # [Q, Hq, D]
        logits = scale * np.einsum("qhd,lhd->hql", q, k)
        if cap is not None:
            logits = cap * np.tanh(logits / cap)
        q_pos = seq_len - q_len + np.arange(q_len)
        k_pos = np.arange(seq_len)
        rel = k_pos[None, :] - q_pos[:, None]  # [Q, L]
        if slopes is not None:
            logits = logits + slopes.astype(np.float64)[:, None, None] * rel[None]
        keep = np.ones_like(rel, bool)
        if causal:
            keep &= rel <= 0
        if window is not None:
            keep &= -rel < window
        logits = np.where(keep[None], logits, -np.inf)
        m = logits.max(axis=2, keepdims=True)
        w = np.where(keep[None], np.exp(logits - np.where(np.isfinite(m), m, 0.0)), 0.0)
        denom = w.sum(axis=2, keepdims=True)
        w = w / np.where(denom > 0, denom, 1.0)
        out[start : start + q_len] = np.einsum("hql,lhd->qhd", w, v)
        start += q_len
    return out


def case_ragged_oracle(case: Case, query, keys, values, q_lens, slopes):
    """`ragged_oracle` with the case's mask and bias and the default scale."""
    return ragged_oracle(
        query,
        keys,
        values,
        q_lens,
        scale=case.head_size**-0.5,
        causal=case.causal,
        slopes=slopes,
        window=case.sliding_window,
        cap=case.soft_cap,
    )


def _run(case: Case, rng, interpret: bool):
    query, kc, vc, meta, keys, values, q_lens, slopes = make_ragged_batch(case, rng)
    scale = case.head_size**-0.5
    kwargs = dict(
        scale=scale,
        causal=case.causal,
        alibi_slopes=None if slopes is None else jnp.asarray(slopes),
        sliding_window=case.sliding_window,
        logits_soft_cap=case.soft_cap,
        k_scale=case.scales[0],
        v_scale=case.scales[1],
    )
    args = [jnp.asarray(x) for x in (query, kc, vc, *meta)]
    out = ragged_paged_attention(
        *args,
        **kwargs,
        block_q=case.block_q,
        pages_per_compute_block=case.pages_per_compute_block,
        interpret=interpret,
    )
    ref = ragged_paged_attention_reference(*args, **kwargs)
    expected = case_ragged_oracle(case, query, keys, values, q_lens, slopes)
    return out, ref, expected, query


@pytest.mark.parametrize("interpret", INTERPRET, ids=lambda i: "interpret" if i else "native")
@pytest.mark.parametrize("case", CASES, ids=str)
def test_ragged_matches_oracle(case: Case, interpret: bool, rng):
    out, ref, expected, query = _run(case, rng, interpret)
    assert out.dtype == query.dtype and out.shape == query.shape
    assert_close(out, expected, *error_dtypes(case), what=f"ragged_paged_attention {case}")
    assert_close(ref, expected, *error_dtypes(case), what=f"reference {case}")
    # Padding tokens give exact zeros.
    assert not np.any(np.asarray(out[-NUM_PAD_TOKENS:], dtype=np.float32))


TILES = [
    # (seq_len, first_pos, num_tokens) of one tile
    (1, 0, 1),
    (17, 16, 1),
    (33, 0, 16),
    (33, 16, 16),
    (64, 60, 4),
    (120, 100, 4),
    (120, 100, 20),
    (40, 0, 0),  # a spare tile
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ragged_visits_only_visible_blocks(causal):
    """A tile visits exactly the compute blocks from the first to the last holding a key one of
    its queries may see: blocks wholly outside the window or past the diagonal are skipped,
    not just masked."""
    block_k = 16
    for seq_len, first_pos, num_tokens in TILES:
        for window in (None, 1, 7, 16, 40):
            visible = {
                k
                for q in range(first_pos, first_pos + num_tokens)
                for k in range(seq_len)
                if (not causal or k <= q) and (window is None or q - k < window)
            }
            blocks = sorted({k // block_k for k in visible})
            lo, hi = _key_block_range(
                first_pos,
                num_tokens,
                seq_len,
                block_k=block_k,
                causal=causal,
                sliding_window=window,
            )
            expected = list(range(blocks[0], blocks[-1] + 1)) if blocks else []
            assert list(range(int(lo), int(hi))) == expected, f"{seq_len=} {first_pos=} {window=}"


@LOWERING_GRID
def test_ragged_lowers_for_gpu(dtype, cache_dtype, head_size, block_size, group, features):
    """The native kernel lowers to Triton IR (checked without a GPU; not compiled to PTX)."""
    if not lowers_for_cuda():
        pytest.skip("this JAX cannot lower Pallas-Triton kernels for CUDA without a GPU")
    num_tokens, num_seqs, num_kv_heads, num_blocks = 37, 4, 2, 20
    num_heads = num_kv_heads * group
    cache = jax.ShapeDtypeStruct((num_blocks, block_size, num_kv_heads, head_size), cache_dtype)
    args = (
        jax.ShapeDtypeStruct((num_tokens, num_heads, head_size), dtype),
        cache,
        cache,
        jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32),
        jax.ShapeDtypeStruct((num_seqs,), jnp.int32),
        jax.ShapeDtypeStruct((num_seqs, 7), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.ShapeDtypeStruct((num_heads,), jnp.float32),
    )

    def run(q, kc, vc, qsl, lens, tables, n, slopes):
        return ragged_paged_attention(
            q,
            kc,
            vc,
            qsl,
            lens,
            tables,
            n,
            scale=0.1,
            causal=not features,
            alibi_slopes=slopes if features else None,
            sliding_window=9 if features else None,
            logits_soft_cap=5.0 if features else None,
            k_scale=0.5,
            v_scale=2.0,
            interpret=False,
        )

    assert "triton" in lower_for_cuda(run, *args)


def _args(num_tokens=5, num_heads=4, num_kv_heads=2, head_size=16, block_size=8):
    query = jnp.ones((num_tokens, num_heads, head_size), jnp.float32)
    cache = jnp.ones((5, block_size, num_kv_heads, head_size), jnp.float32)
    qsl = jnp.array([0, 2, 5], jnp.int32)
    lens = jnp.array([2, 3], jnp.int32)
    tables = jnp.zeros((2, 3), jnp.int32)
    return query, cache, cache, qsl, lens, tables, jnp.int32(2)


def _replace(i, fn):
    return lambda a: (*a[:i], fn(a[i]), *a[i + 1 :])


ERRORS = [
    ("query rank", _replace(0, lambda x: x[0]), {}, ValueError, r"\[num_tokens, num_heads"),
    ("cache dtype", _replace(1, lambda x: x.astype(jnp.int8)), {}, TypeError, "key_cache.dtype"),
    ("value shape", _replace(2, lambda x: x[:, :4]), {}, ValueError, "value_cache.shape"),
    ("gqa", _replace(0, lambda x: x[:, :3]), {}, ValueError, "divisible by num_kv_heads"),
    ("qsl shape", _replace(3, lambda x: x[:2]), {}, ValueError, r"query_start_loc.shape"),
    (
        "qsl dtype",
        _replace(3, lambda x: x.astype(jnp.float32)),
        {},
        TypeError,
        "query_start_loc.dtype",
    ),
    ("lens shape", _replace(4, lambda x: x[:1]), {}, ValueError, r"seq_lens.shape"),
    ("tables rank", _replace(5, lambda x: x[0]), {}, ValueError, "block_tables must be"),
    (
        "num_seqs shape",
        _replace(6, lambda x: jnp.array([2], jnp.int32)),
        {},
        ValueError,
        r"num_seqs.shape",
    ),
    (
        "alibi shape",
        lambda a: a,
        {"alibi_slopes": jnp.ones((2,), jnp.float32)},
        ValueError,
        "alibi_slopes.shape",
    ),
    ("window", lambda a: a, {"sliding_window": -3}, ValueError, "sliding_window=-3"),
    ("block_q", lambda a: a, {"block_q": 0}, ValueError, "block_q=0"),
]


@pytest.mark.parametrize(
    ("edit", "kwargs", "error", "match"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS]
)
def test_ragged_argument_errors(edit, kwargs, error, match):
    with pytest.raises(error, match=match):
        ragged_paged_attention(*edit(_args()), scale=1.0, interpret=True, **kwargs)


@pytest.mark.parametrize(
    ("shape_kwargs", "kwargs", "match"),
    [
        ({"block_size": 24}, {}, "block_size=24 must be a power of two"),
        ({"head_size": 96}, {}, "head_size=96 must be a power of two"),
        ({}, {"block_q": 3}, "block_q=3 must be a power of two"),
        ({}, {"block_q": 4}, "block_q=4 must be a power of two with"),
        ({"block_size": 8}, {"pages_per_compute_block": 1}, "pages_per_compute_block=1"),
    ],
    ids=["block_size", "head_size", "block_q_pow2", "block_q_dot", "pages_dot"],
)
def test_ragged_native_shape_errors(shape_kwargs, kwargs, match):
    """Triton needs power-of-two tiles with >= 16 rows and keys; interpret mode does not."""
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(*_args(**shape_kwargs), scale=1.0, interpret=False, **kwargs)

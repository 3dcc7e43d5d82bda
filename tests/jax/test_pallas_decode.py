"""Pallas paged decode kernel against a NumPy float64 oracle.

Each case builds a paged cache with blocks in random order, NaN in every unused block and in
the tail slots past each sequence's end, and random (in-range) junk in unused block-table
entries, so any stray read shows. The kernel runs in interpret mode everywhere and natively
when a GPU is present; its `paged_decode_reference` is checked against the same oracle. On a
machine without a GPU the kernel is also lowered for CUDA (to Triton IR, not compiled), which
catches what the Triton lowering refuses (non-power-of-two tiles, unsupported primitives).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import LOWERING_GRID, CaseId, error_dtypes, nan_paged_cache
from pallas_lowering import lower_for_cuda, lowers_for_cuda
from tolerances import assert_close

from jax_attn.pallas import paged_decode, paged_decode_reference
from jax_attn.pallas.paged_decode import _split_block_range

pytestmark = pytest.mark.pallas

ON_GPU = jax.devices()[0].platform == "gpu"
INTERPRET = [True, False] if ON_GPU else [True]


@dataclasses.dataclass(frozen=True)
class Case(CaseId):
    seq_lens: tuple[int, ...] = (1, 3, 17, 0, 40)
    block_size: int = 16
    head_size: int = 64
    num_heads: int = 8
    num_kv_heads: int = 2
    dtype: str = "float32"
    cache_dtype: str | None = None
    alibi: bool = False
    sliding_window: int | None = None
    soft_cap: float | None = None
    scales: tuple[float, float] = (1.0, 1.0)
    pages_per_compute_block: int | None = None
    num_kv_splits: int | None = None


# Every case is also valid natively: power-of-two tiles with >= 16 keys per loop step.
CASES = [
    *(Case(block_size=bs, seq_lens=(1, 3, 17, 513)) for bs in (8, 16, 32)),
    *(Case(num_heads=h, num_kv_heads=kv) for h, kv in [(4, 4), (8, 2), (8, 1), (16, 2)]),
    *(Case(head_size=d, num_heads=8, num_kv_heads=1) for d in (128, 256)),
    Case(dtype="bfloat16"),
    Case(dtype="float16", block_size=8),
    Case(dtype="bfloat16", scales=(0.5, 2.0)),  # a bf16 cache also multiplies by its scales
    Case(dtype="bfloat16", cache_dtype="float8_e4m3fn", scales=(0.37, 0.61)),
    Case(dtype="float32", cache_dtype="float8_e5m2", scales=(0.8, 1.3), block_size=8),
    Case(dtype="bfloat16", cache_dtype="float32"),
    Case(alibi=True),
    *(Case(sliding_window=w, seq_lens=(1, 17, 300)) for w in (1, 5, 16)),
    Case(soft_cap=2.0),
    Case(alibi=True, sliding_window=7, soft_cap=3.0, dtype="bfloat16", num_heads=16),
    *(Case(num_kv_splits=k, seq_lens=(1, 3, 130, 257)) for k in (1, 3, 8)),
    Case(pages_per_compute_block=1, seq_lens=(9, 33, 0)),  # one page per step
    Case(pages_per_compute_block=4, num_kv_splits=2, sliding_window=50, seq_lens=(100, 7)),
]


def make_decode_batch(case: Case, rng: np.random.Generator):
    seq_lens = np.array(case.seq_lens, np.int32)
    num_seqs = len(seq_lens)
    d = case.head_size
    max_blocks = max(1, -(-int(seq_lens.max()) // case.block_size)) + 1  # a spare column of junk
    window = case.sliding_window
    first_seen = None if window is None else [n - window for n in seq_lens.tolist()]
    key_cache, value_cache, tables, keys, values = nan_paged_cache(
        case, rng, seq_lens, max_blocks=max_blocks, rows=num_seqs, first_seen=first_seen
    )
    query = rng.standard_normal((num_seqs, case.num_heads, d)).astype(jnp.dtype(case.dtype))
    slopes = rng.uniform(0.05, 1.0, case.num_heads).astype(np.float32) if case.alibi else None
    return query, key_cache, value_cache, tables, seq_lens, keys, values, slopes


def decode_oracle(query, keys, values, seq_lens, *, scale, slopes, window, cap):
    """Per sequence, in float64, straight from the math in SPEC.md."""
    num_seqs, num_heads, d = query.shape
    out = np.zeros((num_seqs, num_heads, d))
    for i, n in enumerate(seq_lens):
        if n == 0:
            continue
        group = num_heads // keys[i].shape[1]
        k = np.repeat(keys[i], group, axis=1)  # [L, Hq, D]
        v = np.repeat(values[i], group, axis=1)
        q = query[i].astype(np.float64)  # [Hq, D]
        logits = scale * np.einsum("hd,lhd->hl", q, k)
        if cap is not None:
            logits = cap * np.tanh(logits / cap)
        pos = np.arange(n)
        q_pos = n - 1
        if slopes is not None:
            logits = logits + slopes.astype(np.float64)[:, None] * (pos - q_pos)[None, :]
        keep = np.ones(n, bool) if window is None else (q_pos - pos < window)
        logits = np.where(keep[None, :], logits, -np.inf)
        w = np.exp(logits - logits.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        out[i] = np.einsum("hl,lhd->hd", w, v)
    return out


def case_decode_oracle(case: Case, query, keys, values, seq_lens, slopes):
    """`decode_oracle` with the case's bias and the default scale."""
    return decode_oracle(
        query,
        keys,
        values,
        seq_lens,
        scale=case.head_size**-0.5,
        slopes=slopes,
        window=case.sliding_window,
        cap=case.soft_cap,
    )


@pytest.mark.parametrize("interpret", INTERPRET, ids=lambda i: "interpret" if i else "native")
@pytest.mark.parametrize("case", CASES, ids=str)
def test_decode_matches_oracle(case: Case, interpret: bool, rng):
    query, kc, vc, tables, seq_lens, keys, values, slopes = make_decode_batch(case, rng)
    scale = case.head_size**-0.5
    k_scale, v_scale = case.scales
    kwargs = dict(
        scale=scale,
        alibi_slopes=None if slopes is None else jnp.asarray(slopes),
        sliding_window=case.sliding_window,
        logits_soft_cap=case.soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    args = [jnp.asarray(x) for x in (query, kc, vc, tables, seq_lens)]
    out = paged_decode(
        *args,
        **kwargs,
        pages_per_compute_block=case.pages_per_compute_block,
        num_kv_splits=case.num_kv_splits,
        interpret=interpret,
    )
    ref = paged_decode_reference(*args, **kwargs)
    expected = case_decode_oracle(case, query, keys, values, seq_lens, slopes)
    assert out.dtype == query.dtype and out.shape == query.shape
    assert_close(out, expected, *error_dtypes(case), what=f"paged_decode {case}")
    assert_close(ref, expected, *error_dtypes(case), what=f"paged_decode_reference {case}")


@pytest.mark.parametrize("interpret", INTERPRET, ids=lambda i: "interpret" if i else "native")
def test_decode_traced_scales(interpret: bool, rng):
    """k_scale / v_scale may be traced f32 scalars (e.g. a layer's calibrated scales)."""
    case = Case(dtype="bfloat16", cache_dtype="float8_e4m3fn", scales=(0.4, 1.7))
    query, kc, vc, tables, seq_lens, keys, values, _ = make_decode_batch(case, rng)
    args = [jnp.asarray(x) for x in (query, kc, vc, tables, seq_lens)]

    @jax.jit
    def run(k_scale, v_scale):
        return paged_decode(
            *args, scale=0.125, k_scale=k_scale, v_scale=v_scale, interpret=interpret
        )

    out = run(jnp.float32(0.4), jnp.float32(1.7))
    expected = decode_oracle(
        query, keys, values, seq_lens, scale=0.125, slopes=None, window=None, cap=None
    )
    assert_close(out, expected, *error_dtypes(case))


@pytest.mark.parametrize("num_kv_splits", [1, 2, 3, 8])
def test_decode_visits_only_window_blocks(num_kv_splits):
    """The splits together visit exactly the compute blocks holding a key the query may see,
    each block once: blocks wholly before the sliding window are skipped, not just masked."""
    block_k = 16
    for seq_len in (0, 1, 15, 16, 17, 100, 257):
        for window in (None, 1, 5, 16, 17, 40, 1000):
            first = 0 if window is None else max(seq_len - window, 0)
            expected = sorted({k // block_k for k in range(first, seq_len)})
            visited = []
            for split in range(num_kv_splits):
                lo, hi = _split_block_range(
                    seq_len,
                    split,
                    block_k=block_k,
                    num_kv_splits=num_kv_splits,
                    sliding_window=window,
                )
                visited += range(int(lo), int(hi))
            assert visited == expected, f"{seq_len=} {window=}"


@LOWERING_GRID
def test_decode_lowers_for_gpu(dtype, cache_dtype, head_size, block_size, group, features):
    """The native kernel lowers to Triton IR (checked without a GPU; not compiled to PTX)."""
    if not lowers_for_cuda():
        pytest.skip("this JAX cannot lower Pallas-Triton kernels for CUDA without a GPU")
    num_seqs, num_kv_heads, num_blocks = 3, 2, 20
    num_heads = num_kv_heads * group
    cache = jax.ShapeDtypeStruct((num_blocks, block_size, num_kv_heads, head_size), cache_dtype)
    args = (
        jax.ShapeDtypeStruct((num_seqs, num_heads, head_size), dtype),
        cache,
        cache,
        jax.ShapeDtypeStruct((num_seqs, 7), jnp.int32),
        jax.ShapeDtypeStruct((num_seqs,), jnp.int32),
        jax.ShapeDtypeStruct((num_heads,), jnp.float32),
    )

    def run(q, kc, vc, tables, lens, slopes):
        return paged_decode(
            q,
            kc,
            vc,
            tables,
            lens,
            scale=0.1,
            alibi_slopes=slopes if features else None,
            sliding_window=9 if features else None,
            logits_soft_cap=5.0 if features else None,
            k_scale=0.5,
            v_scale=2.0,
            interpret=False,
        )

    assert "triton" in lower_for_cuda(run, *args)


def _args(num_seqs=2, num_heads=4, num_kv_heads=2, head_size=16, block_size=8, dtype=jnp.float32):
    query = jnp.ones((num_seqs, num_heads, head_size), dtype)
    cache = jnp.ones((5, block_size, num_kv_heads, head_size), dtype)
    tables = jnp.zeros((num_seqs, 3), jnp.int32)
    lens = jnp.ones((num_seqs,), jnp.int32)
    return query, cache, cache, tables, lens


ERRORS = [
    ("query rank", lambda a: (a[0][0], *a[1:]), {}, ValueError, r"query must be 3-D \[num_seqs"),
    ("cache rank", lambda a: (a[0], a[1][0], a[2], *a[3:]), {}, ValueError, "key_cache must be"),
    (
        "value shape",
        lambda a: (a[0], a[1], a[2][:, :4], *a[3:]),
        {},
        ValueError,
        "value_cache.shape",
    ),
    (
        "value dtype",
        lambda a: (a[0], a[1], a[2].astype(jnp.bfloat16), *a[3:]),
        {},
        TypeError,
        "value_cache.dtype",
    ),
    ("query dtype", lambda a: (a[0].astype(jnp.int32), *a[1:]), {}, TypeError, "query.dtype"),
    (
        "cache dtype",
        lambda a: (a[0], a[1].astype(jnp.int8), a[2].astype(jnp.int8), *a[3:]),
        {},
        TypeError,
        "key_cache.dtype",
    ),
    ("head size", lambda a: (a[0][..., :8], *a[1:]), {}, ValueError, "head_size"),
    ("gqa", lambda a: (a[0][:, :3], *a[1:]), {}, ValueError, "divisible by num_kv_heads"),
    (
        "tables dtype",
        lambda a: (*a[:3], a[3].astype(jnp.float32), a[4]),
        {},
        TypeError,
        "block_tables.dtype",
    ),
    ("tables rows", lambda a: (*a[:3], a[3][:1], a[4]), {}, ValueError, r"block_tables.shape"),
    ("lens shape", lambda a: (*a[:4], a[4][:1]), {}, ValueError, r"seq_lens.shape"),
    ("lens dtype", lambda a: (*a[:4], a[4].astype(jnp.float32)), {}, TypeError, "seq_lens.dtype"),
    (
        "alibi shape",
        lambda a: a,
        {"alibi_slopes": jnp.ones((3,), jnp.float32)},
        ValueError,
        "alibi_slopes.shape",
    ),
    ("window", lambda a: a, {"sliding_window": 0}, ValueError, "sliding_window=0"),
    ("soft cap", lambda a: a, {"logits_soft_cap": -1.0}, ValueError, "logits_soft_cap"),
    ("pages", lambda a: a, {"pages_per_compute_block": 0}, ValueError, "pages_per_compute_block"),
    ("splits", lambda a: a, {"num_kv_splits": 0}, ValueError, "num_kv_splits"),
    (
        "k_scale shape",
        lambda a: a,
        {"k_scale": jnp.ones((2,), jnp.float32)},
        ValueError,
        "k_scale must be a scalar",
    ),
]


@pytest.mark.parametrize(
    ("edit", "kwargs", "error", "match"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS]
)
def test_decode_argument_errors(edit, kwargs, error, match):
    with pytest.raises(error, match=match):
        paged_decode(*edit(_args()), scale=1.0, interpret=True, **kwargs)


@pytest.mark.parametrize(
    ("shape_kwargs", "kwargs", "match"),
    [
        ({"block_size": 12}, {}, "block_size=12 must be a power of two"),
        ({"head_size": 80}, {}, "head_size=80 must be a power of two"),
        ({"block_size": 8}, {"pages_per_compute_block": 3}, "pages_per_compute_block=3"),
        ({"block_size": 8}, {"pages_per_compute_block": 1}, ">= 16 on GPU"),
    ],
    ids=["block_size", "head_size", "pages_pow2", "pages_dot"],
)
def test_decode_native_shape_errors(shape_kwargs, kwargs, match):
    """Triton needs power-of-two tiles with >= 16 keys; interpret mode does not."""
    with pytest.raises(ValueError, match=match):
        paged_decode(*_args(**shape_kwargs), scale=1.0, interpret=False, **kwargs)

"""paged_attention / paged_decode against the float64 oracles, over a grid of odd shapes.

Every case: random block placement, NaN in unused blocks and tail slots, padded `num_seqs`
and padded tokens, the new tokens written through `write_kv` (fp8 scales included), then
the XLA path and the JAX oracle compared with a NumPy float64 statement of the math.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from paged_cases import CaseId, bias_and_expected, padded_ragged_inputs, workload
from tolerances import assert_close

import jax_attn
from interop.workload import make_workload

BATCHES = {
    # name: (query_lens, context_lens) -> seq lens
    "decode": ([1, 1, 1, 1], [0, 2, 16, 512]),  # 1, 3, 17, 513
    "prefill": ([1, 3, 17, 33], [0, 0, 0, 0]),
    "chunked": ([3, 17, 8], [16, 496, 8]),  # 19, 513, 16 (block boundary)
    "mixed": ([17, 1, 3, 1, 16], [0, 31, 14, 0, 16]),  # 17, 32, 17, 1, 32
}


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


CASES = [
    *(Case(batch=b, block_size=bs) for b in BATCHES for bs in (1, 8, 16, 32)),
    *(Case(head_size=d) for d in (80, 128, 256)),
    *(Case(num_heads=h, num_kv_heads=kv) for h, kv in [(4, 4), (8, 2), (8, 1), (7, 1), (16, 2)]),
    *(Case(dtype=d) for d in ("bfloat16", "float16")),
    Case(dtype="bfloat16", cache_dtype="float8_e4m3fn"),
    Case(dtype="float32", cache_dtype="float8_e5m2"),
    Case(batch="decode", dtype="bfloat16", cache_dtype="float8_e4m3fn", block_size=8),
    Case(alibi=True),
    Case(num_heads=6, num_kv_heads=2, alibi=True),  # non-power-of-two head count
    *(Case(sliding_window=w) for w in (1, 5, 16)),
    Case(batch="chunked", sliding_window=40, block_size=8),
    Case(soft_cap=2.0),
    Case(causal=False),
    Case(batch="chunked", causal=False, alibi=True, sliding_window=20, soft_cap=5.0),
    Case(batch="decode", alibi=True, sliding_window=7, soft_cap=3.0, dtype="bfloat16"),
]


def _run(case: Case, rng: np.random.Generator):
    w, k_scale, v_scale = workload(case, rng, *BATCHES[case.batch])
    md, query, kc, vc = padded_ragged_inputs(case, w, k_scale, v_scale, pad_seqs=2, pad_tokens=5)
    slopes, bias, expected = bias_and_expected(case, w)
    kwargs = dict(
        alibi_slopes=None if slopes is None else jnp.asarray(slopes),
        k_scale=k_scale,
        v_scale=v_scale,
        **bias,
    )
    return w, md, query, kc, vc, kwargs, expected


def _tolerance_dtypes(case: Case):
    return (case.dtype, case.cache_dtype)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_paged_attention_xla_matches_float64(case: Case, rng):
    w, md, query, kc, vc, kwargs, expected = _run(case, rng)
    jax_attn.validate(query, kc, vc, md)
    out = jax_attn.paged_attention(query, kc, vc, md, impl="xla", **kwargs)
    assert out.dtype == query.dtype and out.shape == query.shape
    num_real = len(w.slot_mapping)
    assert_close(out[:num_real], expected, *_tolerance_dtypes(case))
    np.testing.assert_array_equal(np.asarray(out[num_real:], np.float32), 0.0)


@pytest.mark.parametrize("case", CASES[::3], ids=str)
def test_reference_impl_is_float64_exact(case: Case, rng):
    """The JAX oracle under x64 agrees with the NumPy statement of the math to ~1e-10."""
    w, md, query, kc, vc, kwargs, expected = _run(case, rng)
    with jax.enable_x64(True):
        out = jax_attn.reference.paged_attention(query, kc, vc, md, **kwargs)
        assert out.dtype == jnp.float64
        assert_close(out[: len(w.slot_mapping)], expected, "float64")
    # Through the public entry (impl="reference"), output comes back in the query dtype.
    out = jax_attn.paged_attention(query, kc, vc, md, impl="reference", **kwargs)
    assert_close(out[: len(w.slot_mapping)], expected, *_tolerance_dtypes(case))


DECODE_CASES = [c for c in CASES if c.batch == "decode"] + [
    Case(batch="decode", head_size=256, num_heads=8, num_kv_heads=1),
    Case(batch="decode", head_size=80, num_heads=7, num_kv_heads=7, sliding_window=3),
    Case(batch="decode", cache_dtype="float8_e5m2", dtype="float16", alibi=True),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_paged_decode_matches_float64(case: Case, impl: str, rng):
    w, md, query, kc, vc, kwargs, expected = _run(case, rng)
    kwargs.pop("causal")
    num_seqs = len(w.query_lens)
    # Two padding rows with seq_len 0 and NaN queries must give zeros.
    seq_lens = jnp.concatenate([md.seq_lens[:num_seqs], jnp.zeros(2, jnp.int32)])
    q = jnp.concatenate([query[:num_seqs], query[-2:]])
    out = jax_attn.paged_decode(q, kc, vc, md.block_tables, seq_lens, impl=impl, **kwargs)
    assert out.dtype == q.dtype
    assert_close(out[:num_seqs], expected, *_tolerance_dtypes(case))
    np.testing.assert_array_equal(np.asarray(out[num_seqs:], np.float32), 0.0)


@pytest.mark.parametrize(
    "case",
    [
        Case(batch="chunked", block_size=8, sliding_window=20, alibi=True),
        Case(batch="decode", dtype="bfloat16", soft_cap=3.0),
        Case(batch="mixed", block_size=1, num_heads=8, num_kv_heads=1),
    ],
    ids=str,
)
def test_one_block_chunks(case: Case, rng, monkeypatch):
    """The chunk size is a static choice (xla_paged.chunk_blocks): force one block per online-
    softmax step, the size large decode batches get, on batches of every kind."""
    from jax_attn import paged, xla_paged

    monkeypatch.setattr(xla_paged, "KV_CHUNK_BYTES", 1)
    monkeypatch.setattr(xla_paged, "COMPUTE_BOUND_ROWS", 10**9)
    assert xla_paged.chunk_blocks(1, 1, 1, 8, case.block_size) == 1
    w, md, query, kc, vc, kwargs, expected = _run(case, rng)
    # A fresh trace of the unjitted entry, so the patched constants apply.
    fresh = jax.jit(
        paged.paged_attention.__wrapped__,
        static_argnames=("causal", "sliding_window", "logits_soft_cap", "impl"),
    )
    out = fresh(query, kc, vc, md, impl="xla", **kwargs)
    assert_close(out[: len(w.slot_mapping)], expected, *_tolerance_dtypes(case))


def test_decode_and_unified_entry_agree(rng):
    case = Case(batch="decode", alibi=True, sliding_window=9)
    w, md, query, kc, vc, kwargs, _ = _run(case, rng)
    num_seqs = len(w.query_lens)
    unified = jax_attn.paged_attention(query, kc, vc, md, impl="xla", **kwargs)
    kwargs.pop("causal")
    decode = jax_attn.paged_decode(
        query[:num_seqs],
        kc,
        vc,
        md.block_tables[:num_seqs],
        md.seq_lens[:num_seqs],
        impl="xla",
        **kwargs,
    )
    np.testing.assert_allclose(np.asarray(decode), np.asarray(unified[:num_seqs]), atol=1e-6)


@pytest.mark.parametrize("impl", ["xla", "reference", "pallas", "cpu"])
def test_empty_batches_give_empty_outputs(impl: str):
    """Zero tokens (a batch of empty sequences) and zero decode rows: empty outputs of the
    query's shape, under jit too (the XLA path gathered from the empty query and failed:
    found by `jax-attn fuzz`)."""
    if impl == "cpu" and not jax_attn.cpu.available():
        pytest.skip(f"native CPU kernels: {jax_attn.cpu.unavailable_reason()}")
    interpret = dict(interpret=True) if impl == "pallas" else {}
    kc = jnp.full((3, 1, 1, 8), jnp.nan)
    md = jax_attn.RaggedMetadata.build(
        query_lens=[0], context_lens=[0], block_tables=np.zeros((1, 1), np.int32), block_size=1
    )
    query = jnp.zeros((0, 2, 8), jnp.bfloat16)
    out = jax_attn.paged_attention(query, kc, kc, md, scale=0.3, impl=impl, **interpret)
    assert out.shape == (0, 2, 8) and out.dtype == jnp.bfloat16
    tables, lens = jnp.zeros((0, 1), jnp.int32), jnp.zeros((0,), jnp.int32)
    decode = jax.jit(jax_attn.paged_decode, static_argnames=("scale", "impl", "interpret"))
    out = decode(query, kc, kc, tables, lens, scale=0.3, impl=impl, **interpret)
    assert out.shape == (0, 2, 8) and out.dtype == jnp.bfloat16


def test_nan_in_unused_memory_is_what_we_think(rng):
    """Guard the guard: the workload really poisons unused blocks and tail slots."""
    w = make_workload(rng, [3], [14], num_heads=2, num_kv_heads=1, head_size=8, block_size=8)
    kc = w.key_cache
    used = set(w.block_tables[0, :3].tolist())
    unused = [b for b in range(kc.shape[0]) if b not in used]
    assert np.isnan(kc[unused]).all()
    last = w.block_tables[0, 2]
    assert np.isnan(kc[last, 1:]).all()  # seq_len 17: slot 16 is offset 0 of the third block
    assert np.isnan(kc[last, 0]).all()  # the new token: not written yet


def test_no_recompilation_when_metadata_values_change(rng):
    """Shapes fixed by padding: a new batch with other lengths reuses the compiled step."""
    traces = []

    @jax.jit
    def step(query, kc, vc, md):
        traces.append(1)
        return jax_attn.paged_attention(query, kc, vc, md, impl="xla")

    for q_lens, ctx_lens in [([5, 1, 1], [0, 9, 30]), ([1, 2, 1], [40, 3, 0]), ([7], [0])]:
        w = make_workload(
            rng,
            q_lens,
            ctx_lens,
            num_heads=4,
            num_kv_heads=2,
            head_size=16,
            block_size=8,
            extra_blocks=12 - sum(-(-(q + c) // 8) for q, c in zip(q_lens, ctx_lens, strict=True)),
        )
        md = jax_attn.RaggedMetadata.build(
            q_lens,
            ctx_lens,
            np.pad(w.block_tables, ((0, 0), (0, 6 - w.block_tables.shape[1]))),
            8,
            pad_to=(4, 8),
        )
        query = np.zeros((8, 4, 16), np.float32)
        query[: len(w.query)] = w.query
        out = step(
            jnp.asarray(query),
            jnp.asarray(np.nan_to_num(w.key_cache)),
            jnp.asarray(np.nan_to_num(w.value_cache)),
            md,
        )
        assert np.isfinite(np.asarray(out)).all()
    assert len(traces) == 1


def test_fp8_cache_reads_scaled_values(rng):
    """A cache stores x / scale in fp8; attention reads stored * scale."""
    x = rng.standard_normal((4, 1, 8)).astype(np.float32) * 3
    kc = jnp.zeros((2, 4, 1, 8), jnp.float8_e4m3fn)
    kc, _ = jax_attn.write_kv(
        kc, kc, jnp.asarray(x), jnp.asarray(x), jnp.arange(4, dtype=jnp.int32), k_scale=0.5
    )
    stored = np.asarray(kc[0]).astype(np.float64)
    expected = (x / 0.5).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    np.testing.assert_array_equal(stored, expected)

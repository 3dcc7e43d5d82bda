"""Attention sinks (gpt-oss: one logit per query head, a key with no value in every row's
softmax) through `paged_attention` and `paged_decode`: the XLA path, the native CPU kernel and
the JAX oracle against the NumPy float64 statement of the math (`interop.workload.
dense_reference(sinks=...)`), over NaN-poisoned caches with padded metadata; Pallas refuses
them by name and "auto" does not pick it; a sink at -inf is no sink at all."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import CaseId, padded_ragged_inputs, workload
from tolerances import assert_close

import jax_attn
from interop.workload import dense_reference
from jax_attn import cpu

BATCHES = {
    "mixed": ([17, 1, 3, 1, 16], [0, 31, 14, 0, 16]),
    # A run of decodes the native kernel hands to its decode kernel, one long (split-K).
    "decodes": ([1] * 6 + [9], [3000, 17, 0, 100, 31, 2500, 4]),
    "prefill": ([1, 3, 17, 40], [0, 0, 0, 0]),
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
    sliding_window: int | None = None
    soft_cap: float | None = None
    alibi: bool = False


CASES = [
    Case(),
    Case(batch="decodes", block_size=128),
    Case(batch="prefill", causal=False),
    # ALiBi measured from each row's last visible key moves the sinks (alibi_origin).
    Case(batch="prefill", causal=False, alibi=True, sliding_window=12),
    Case(dtype="bfloat16", sliding_window=9, soft_cap=4.0, alibi=True),
    Case(batch="decodes", dtype="bfloat16", cache_dtype="float8_e4m3fn"),
]
IMPLS = ["xla", "reference"] + ([] if cpu.unavailable_reason() else ["cpu"])


def _run(case: Case, rng: np.random.Generator):
    w, k_scale, v_scale = workload(case, rng, *BATCHES[case.batch])
    md, query, kc, vc = padded_ragged_inputs(case, w, k_scale, v_scale, pad_seqs=2, pad_tokens=5)
    # From well below the rows' logits to well above them.
    sinks = (3.0 * rng.standard_normal(case.num_heads)).astype(np.float32)
    slopes = jax_attn.alibi_slopes(case.num_heads) if case.alibi else None
    bias = dict(sliding_window=case.sliding_window, logits_soft_cap=case.soft_cap)
    expected = dense_reference(w, causal=case.causal, alibi_slopes=slopes, sinks=sinks, **bias)
    kwargs = dict(
        alibi_slopes=None if slopes is None else jnp.asarray(slopes),
        k_scale=k_scale,
        v_scale=v_scale,
        sinks=jnp.asarray(sinks),
        **bias,
    )
    return w, md, query, kc, vc, kwargs, expected


def _dtypes(case: Case) -> tuple:
    return (case.dtype,) + ((case.cache_dtype,) if case.cache_dtype else ())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_paged_attention_with_sinks_matches_float64(case: Case, impl: str, rng):
    w, md, query, kc, vc, kwargs, expected = _run(case, rng)
    out = jax_attn.paged_attention(query, kc, vc, md, causal=case.causal, impl=impl, **kwargs)
    num_real = len(w.slot_mapping)
    assert_close(out[:num_real], expected, *_dtypes(case), what=f"paged_attention {impl}")
    np.testing.assert_array_equal(np.asarray(out[num_real:], np.float32), 0.0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", [c for c in CASES if c.batch == "decodes"], ids=str)
def test_paged_decode_with_sinks_matches_float64(case: Case, impl: str, rng):
    case = dataclasses.replace(case, batch="decodes")
    w, k_scale, v_scale = workload(case, rng, [1] * 5, [3000, 17, 0, 100, 2500])
    md, query, kc, vc = padded_ragged_inputs(case, w, k_scale, v_scale, pad_seqs=0, pad_tokens=0)
    sinks = (3.0 * rng.standard_normal(case.num_heads)).astype(np.float32)
    expected = dense_reference(w, sinks=sinks)
    out = jax_attn.paged_decode(
        query, kc, vc, md.block_tables, md.seq_lens, k_scale=k_scale, v_scale=v_scale,
        sinks=jnp.asarray(sinks), impl=impl,
    )  # fmt: skip
    assert_close(out, expected, *_dtypes(case), what=f"paged_decode {impl}")


def test_the_oracle_under_x64_agrees_with_numpy(rng):
    w, md, query, kc, vc, kwargs, expected = _run(Case(alibi=True), rng)
    with jax.enable_x64(True):
        out = jax_attn.reference.paged_attention(query, kc, vc, md, **kwargs)
        assert_close(out[: len(w.slot_mapping)], expected, "float64")


@pytest.mark.parametrize("impl", IMPLS)
def test_a_sink_at_minus_infinity_is_no_sink(impl: str, rng):
    _, md, query, kc, vc, kwargs, _ = _run(Case(), rng)
    without = jax_attn.paged_attention(query, kc, vc, md, impl=impl, **(kwargs | {"sinks": None}))
    minus_inf = jnp.full(query.shape[1], -jnp.inf, jnp.float32)
    out = jax_attn.paged_attention(query, kc, vc, md, impl=impl, **(kwargs | {"sinks": minus_inf}))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(without))


def test_sinks_under_jit_are_traced(rng):
    """One compiled step serves any sink values."""
    _, md, query, kc, vc, kwargs, _ = _run(Case(), rng)
    sinks = kwargs.pop("sinks")

    @jax.jit
    def step(s):
        return jax_attn.paged_attention(query, kc, vc, md, impl="xla", sinks=s, **kwargs)

    a, b = step(sinks), step(sinks + 1.0)
    assert step._cache_size() == 1
    assert not np.array_equal(np.asarray(a), np.asarray(b))
    moved = jax_attn.paged_attention(query, kc, vc, md, impl="reference", sinks=sinks + 1.0,
                                     **kwargs)  # fmt: skip
    assert_close(b, moved, "float32", peer=True, what="the second call's sinks")


def test_pallas_refuses_sinks_by_name(rng):
    _, md, query, kc, vc, kwargs, _ = _run(Case(), rng)
    with pytest.raises(ValueError, match=r"impl='pallas' does not take attention sinks"):
        jax_attn.paged_attention(query, kc, vc, md, impl="pallas", **kwargs)


@pytest.mark.parametrize(
    "bad, error", [(jnp.zeros(3), ValueError), (jnp.zeros(8, jnp.int32), TypeError)]
)
def test_bad_sinks_name_the_argument(bad, error, rng):
    _, md, query, kc, vc, kwargs, _ = _run(Case(), rng)
    with pytest.raises(error, match="sinks"):
        jax_attn.paged_attention(query, kc, vc, md, impl="xla", **(kwargs | {"sinks": bad}))

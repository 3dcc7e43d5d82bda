"""float32 logits far from zero, where the kernels' own rounding, not float32's, could set the
error: bidirectional ALiBi over long sequences, and soft caps well above the logits.

ALiBi: each path measures a row's ALiBi distances from the last key the row sees, not from its
own position (`_online_softmax.alibi_origin`, the native kernel's `alibi_origin`). The two
differ by a per-row constant the softmax cancels; from the row's position, the keys ahead carry
biases of slope x distance (up to 750 at 1500 tokens), and their float32 rounding shows in every
probability: 3.9e-5 to 5e-5 from the float64 oracle in these cases before the change, twice
float32's row of the tolerance table. Sinks move with the constant (tests/jax/
test_core_sinks.py checks them non-causal).

Soft cap: the native kernels' vector tanh (kernel_common.h's tanh16, vec_avx2.h's tanh8) was
exact to ~1e-7 absolute near 0, so cap * tanh(x / cap) was off by ~cap x 1e-7 in every logit:
at cap 1000, 8.6e-5 from the oracle (4x float32's row), at cap 200 2.0e-5; XLA's 1e-6. With a
polynomial near 0 the error is ~1e-6 whatever the cap."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import CaseId, padded_ragged_inputs, workload
from test_core_varlen import _numpy_varlen
from tolerances import assert_close

import jax_attn
from interop.workload import dense_reference
from jax_attn import cpu

# Two prefills: 1500 tokens (the largest biases) and 333 (a tile boundary off the key steps').
Q_LENS, CONTEXT_LENS = [1500, 333], [0, 0]


@dataclasses.dataclass(frozen=True)
class Case(CaseId):
    block_size: int = 32
    head_size: int = 64
    num_heads: int = 8  # slopes 2^-1 .. 2^-8
    num_kv_heads: int = 2
    dtype: str = "float32"
    cache_dtype: str | None = None
    sliding_window: int | None = None
    soft_cap: float | None = None


CASES = [Case(), Case(sliding_window=100, soft_cap=30.0)]
IMPLS = ["xla"] + ([] if cpu.unavailable_reason() else ["cpu"])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_paged_bidirectional_alibi_float32(case: Case, impl: str, rng):
    w, k_scale, v_scale = workload(case, rng, Q_LENS, CONTEXT_LENS)
    md, query, kc, vc = padded_ragged_inputs(case, w, k_scale, v_scale, pad_seqs=1, pad_tokens=3)
    slopes = jax_attn.alibi_slopes(case.num_heads)
    bias = dict(sliding_window=case.sliding_window, logits_soft_cap=case.soft_cap)
    expected = dense_reference(w, causal=False, alibi_slopes=slopes, **bias)
    out = jax_attn.paged_attention(
        query, kc, vc, md, causal=False, alibi_slopes=jnp.asarray(slopes), impl=impl, **bias
    )
    num_real = len(w.slot_mapping)
    assert_close(np.asarray(out[:num_real], np.float64), expected, "float32")
    assert np.all(np.asarray(out[num_real:]) == 0)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_varlen_bidirectional_alibi_float32(case: Case, rng):
    q = rng.standard_normal((sum(Q_LENS), case.num_heads, case.head_size)).astype(np.float32)
    k, v = (
        rng.standard_normal((sum(Q_LENS), case.num_kv_heads, case.head_size)).astype(np.float32)
        for _ in range(2)
    )
    cu = np.concatenate([[0], np.cumsum(Q_LENS)]).astype(np.int32)
    slopes = jax_attn.alibi_slopes(case.num_heads)
    bias = dict(sliding_window=case.sliding_window)
    out = jax_attn.varlen_attention(
        *(jnp.asarray(x) for x in (q, k, v, cu, cu)),
        causal=False,
        alibi_slopes=jnp.asarray(slopes),
        logits_soft_cap=case.soft_cap,
        **bias,
    )
    expected = _numpy_varlen(q, k, v, cu, cu, causal=False, alibi=slopes, cap=case.soft_cap, **bias)
    assert_close(np.asarray(out, np.float64), expected, "float32")


# A prefill, a chunk, and a run of four decodes (the native decode kernel's), causal.
CAP_Q_LENS, CAP_CONTEXT_LENS = [242, 6, 1, 1, 1, 1], [0, 50, 300, 900, 40, 700]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cap", [200.0, 1000.0])
def test_soft_cap_far_above_the_logits_float32(cap: float, impl: str, rng):
    case = Case(head_size=128, block_size=16, soft_cap=cap)
    w, k_scale, v_scale = workload(case, rng, CAP_Q_LENS, CAP_CONTEXT_LENS)
    md, query, kc, vc = padded_ragged_inputs(case, w, k_scale, v_scale, pad_seqs=1, pad_tokens=3)
    expected = dense_reference(w, causal=True, logits_soft_cap=cap)
    out = jax_attn.paged_attention(query, kc, vc, md, logits_soft_cap=cap, impl=impl)
    num_real = len(w.slot_mapping)
    assert_close(np.asarray(out[:num_real], np.float64), expected, "float32")

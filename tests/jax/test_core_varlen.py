"""varlen_attention: forward against float64, all-masked rows, and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import assert_close

import jax_attn

CASES = {
    # name: (q_lens, k_lens)
    "encoder": ([1, 3, 17, 130], [1, 3, 17, 130]),
    "cross": ([5, 1, 9], [17, 3, 40]),
    "q_longer_than_k": ([6, 2], [3, 2]),  # bottom-right causal: first rows see nothing
    "empty_keys": ([4, 2], [0, 5]),
}


def _inputs(rng, q_lens, k_lens, num_heads=4, num_kv_heads=2, head_size=32, dtype=np.float32):
    q = rng.standard_normal((sum(q_lens) + 3, num_heads, head_size)).astype(dtype)  # 3 pads
    k = rng.standard_normal((sum(k_lens), num_kv_heads, head_size)).astype(dtype)
    v = rng.standard_normal((sum(k_lens), num_kv_heads, head_size)).astype(dtype)
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    return [jnp.asarray(x) for x in (q, k, v, cu_q, cu_k)]


def _numpy_varlen(q, k, v, cu_q, cu_k, *, causal, sliding_window=None, alibi=None, cap=None):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    out = np.zeros_like(q)
    for i in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        qi, ki, vi = q[qs], np.repeat(k[ks], group, 1), np.repeat(v[ks], group, 1)
        logits = np.einsum("qhd,khd->hqk", qi, ki) / np.sqrt(q.shape[-1])
        if cap is not None:
            logits = cap * np.tanh(logits / cap)
        p_q = np.arange(len(ki) - len(qi), len(ki))[:, None]
        p_k = np.arange(len(ki))[None, :]
        if alibi is not None:
            logits = logits + np.asarray(alibi, np.float64)[:, None, None] * (p_k - p_q)
        keep = np.ones(logits.shape[1:], bool)
        if causal:
            keep &= p_k <= p_q
        if sliding_window:
            keep &= p_q - p_k < sliding_window
        row_max = np.max(np.where(keep, logits, -np.inf), -1, keepdims=True, initial=-np.inf)
        w = np.where(keep, np.exp(logits - np.where(np.isfinite(row_max), row_max, 0.0)), 0.0)
        total = w.sum(-1, keepdims=True)
        out[qs] = np.einsum("hqk,khd->qhd", w / np.where(total > 0, total, 1), vi)
    return out


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_varlen_matches_float64(name, causal, dtype, rng):
    q_lens, k_lens = CASES[name]
    q, k, v, cu_q, cu_k = _inputs(rng, q_lens, k_lens, dtype=dtype)
    alibi = jax_attn.alibi_slopes(4)
    out = jax_attn.varlen_attention(
        q,
        k,
        v,
        cu_q,
        cu_k,
        causal=causal,
        sliding_window=9,
        alibi_slopes=jnp.asarray(alibi),
        logits_soft_cap=4.0,
    )
    expected = _numpy_varlen(
        q[: cu_q[-1]], k, v, cu_q, cu_k, causal=causal, sliding_window=9, alibi=alibi, cap=4.0
    )
    assert out.dtype == q.dtype
    assert_close(out[: int(cu_q[-1])], expected, dtype)
    np.testing.assert_array_equal(np.asarray(out[int(cu_q[-1]) :], np.float32), 0.0)
    with jax.enable_x64(True):
        ref = jax_attn.reference.varlen_attention(
            q,
            k,
            v,
            cu_q,
            cu_k,
            causal=causal,
            sliding_window=9,
            alibi_slopes=alibi,
            logits_soft_cap=4.0,
        )
        assert_close(ref[: int(cu_q[-1])], expected, "float64" if dtype == "float32" else dtype)


def test_all_masked_rows_are_zero_not_nan(rng):
    q, k, v, cu_q, cu_k = _inputs(rng, [6, 2], [3, 0])
    out = np.asarray(jax_attn.varlen_attention(q, k, v, cu_q, cu_k, causal=True))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[:3], 0.0)  # positions -3..-1 see no key
    assert np.abs(out[3:6]).sum() > 0
    np.testing.assert_array_equal(out[6:8], 0.0)  # a sequence with no keys at all


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_grad_matches_reference_grad(causal, rng):
    q, k, v, cu_q, cu_k = _inputs(rng, [3, 17, 1], [3, 20, 5])
    cotangent = jnp.asarray(rng.standard_normal(q.shape).astype(np.float32))
    slopes = jnp.asarray(jax_attn.alibi_slopes(4))

    def loss(fn):
        def f(q, k, v):
            out = fn(
                q,
                k,
                v,
                cu_q,
                cu_k,
                causal=causal,
                alibi_slopes=slopes,
                sliding_window=11,
                logits_soft_cap=6.0,
            )
            return jnp.sum(out.astype(jnp.float64) * cotangent.astype(jnp.float64))

        return f

    with jax.enable_x64(True):
        expected = jax.grad(loss(jax_attn.reference.varlen_attention), argnums=(0, 1, 2))(
            q.astype(jnp.float64), k.astype(jnp.float64), v.astype(jnp.float64)
        )
        actual = jax.grad(loss(jax_attn.varlen_attention), argnums=(0, 1, 2))(q, k, v)
    for name, a, e in zip("qkv", actual, expected, strict=True):
        assert_close(a, e, "float32", what=f"d loss / d {name}")


def test_grad_matches_finite_differences(rng):
    """Central differences along random unit directions of (q, k, v).

    The fast path accumulates in float32, so the loss carries ~1e-6 of rounding noise; a
    step of 1e-2 along a unit direction keeps that noise (~1e-4 in the quotient) and the
    truncation error (~1e-5) well under the tolerance while the derivative itself is O(1).
    """
    q, k, v, cu_q, cu_k = _inputs(rng, [2, 3], [4, 3], num_heads=2, num_kv_heads=1, head_size=8)

    def f(q, k, v):
        out = jax_attn.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
        return jnp.sum(jnp.sin(out.astype(jnp.float32)))

    grads = jax.grad(f, argnums=(0, 1, 2))(q, k, v)
    eps = 1e-2
    for _ in range(4):
        direction = [rng.standard_normal(x.shape) for x in (q, k, v)]
        norm = np.sqrt(sum(np.sum(u**2) for u in direction))
        direction = [u / norm for u in direction]
        shifted = [
            [jnp.asarray(np.asarray(x, np.float64) + sign * eps * u, jnp.float32)
             for x, u in zip((q, k, v), direction, strict=True)]
            for sign in (1, -1)
        ]  # fmt: skip
        numeric = (float(f(*shifted[0])) - float(f(*shifted[1]))) / (2 * eps)
        analytic = sum(
            float(np.sum(np.asarray(g, np.float64) * u))
            for g, u in zip(grads, direction, strict=True)
        )
        np.testing.assert_allclose(analytic, numeric, rtol=5e-3, atol=1e-3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(key_heads=3), "num_heads=4 must be divisible by num_kv_heads=3"),
        (dict(cu_dtype=np.float32), "cu_seqlens_q.dtype=float32 must be int32"),
        (dict(sliding_window=0), "sliding_window=0 must be a positive int"),
    ],
)
def test_varlen_errors(kwargs, match):
    q = jnp.zeros((4, 4, 8))
    k = jnp.zeros((4, kwargs.get("key_heads", 2), 8))
    cu = jnp.asarray([0, 4], kwargs.get("cu_dtype", np.int32))
    with pytest.raises((ValueError, TypeError), match=match):
        jax_attn.varlen_attention(
            q, k, k, cu, cu, causal=True, sliding_window=kwargs.get("sliding_window")
        )

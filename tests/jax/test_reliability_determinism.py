"""Determinism (issue 12 item 7): the same inputs give bit-identical outputs across calls and
between eager calls and calls inside the caller's `jit`, for every JAX impl that runs here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_attn
from interop.workload import make_workload
from jax_attn import cpu


def _impls():
    """Every impl, "cpu" included: where the native kernels are not built its cases skip (and
    the test command, which requires them, fails), never vanish."""
    return ["xla", "reference", "pallas", "cpu"]


def _require(impl: str) -> None:
    if impl == "cpu" and not cpu.available():
        pytest.skip(f"native CPU kernels: {cpu.unavailable_reason()}")


def _problem(rng):
    w = make_workload(
        rng,
        [5, 1, 3],
        [0, 17, 9],
        num_heads=4,
        num_kv_heads=2,
        head_size=16,
        block_size=8,
    )
    md = w.metadata(pad_to=(4, 11))
    kc, vc = jax_attn.write_kv(
        jnp.asarray(w.key_cache),
        jnp.asarray(w.value_cache),
        jnp.asarray(w.new_key),
        jnp.asarray(w.new_value),
        md.slot_mapping[: len(w.slot_mapping)],
    )
    query = jnp.asarray(np.concatenate([w.query, np.ones((2, 4, 16), np.float32)]))
    return query, kc, vc, md


def _bits(x) -> bytes:
    return np.asarray(x).tobytes()


@pytest.mark.parametrize("impl", _impls())
def test_paged_attention_bit_identical(impl, rng):
    _require(impl)
    query, kc, vc, md = _problem(rng)
    kw = dict(impl=impl, alibi_slopes=jax_attn.alibi_slopes(4), logits_soft_cap=20.0)
    first = jax_attn.paged_attention(query, kc, vc, md, **kw)
    again = jax_attn.paged_attention(query, kc, vc, md, **kw)
    jitted = jax.jit(lambda *a: jax_attn.paged_attention(*a, **kw))(query, kc, vc, md)
    assert _bits(first) == _bits(again)
    assert _bits(first) == _bits(jitted)


@pytest.mark.parametrize("impl", _impls())
def test_paged_decode_bit_identical(impl, rng):
    _require(impl)
    query, kc, vc, md = _problem(rng)
    args = (query[:4], kc, vc, md.block_tables, md.seq_lens)
    kw = dict(impl=impl, sliding_window=7)
    first = jax_attn.paged_decode(*args, **kw)
    again = jax_attn.paged_decode(*args, **kw)
    jitted = jax.jit(lambda *a: jax_attn.paged_decode(*a, **kw))(*args)
    assert _bits(first) == _bits(again)
    assert _bits(first) == _bits(jitted)


def test_write_kv_and_varlen_bit_identical(rng):
    query, kc, vc, md = _problem(rng)
    key = jnp.asarray(rng.standard_normal((11, 2, 16)).astype(np.float32))
    slots = md.slot_mapping
    eager = jax_attn.write_kv(kc, vc, key, key, slots)
    jitted = jax.jit(jax_attn.write_kv)(kc, vc, key, key, slots)
    assert _bits(eager[0]) == _bits(jitted[0]) and _bits(eager[1]) == _bits(jitted[1])
    cu = jnp.asarray([0, 5, 6, 9], jnp.int32)
    run = lambda q, k: jax_attn.varlen_attention(q, k, k, cu, cu, causal=True)
    first, again = run(query, key), run(query, key)
    assert _bits(first) == _bits(again) == _bits(jax.jit(run)(query, key))

"""Bad input raises, from every entry that can see it, eagerly and inside `checked` under jit,
with the same message, and the caches stay bit-identical (issue 12, items 1, 2 and 4)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reliability_jax as rj

import jax_attn
from jax_attn import value_rules

CASE_IDS = [f"{c.entry}-{c.name}" for c in rj.CASES]
# One worker runs them all: the doc and the per-case tests share the runs (`rj.outcome`).
pytestmark = pytest.mark.xdist_group("reliability")


@pytest.fixture(scope="module")
def x():
    return rj.inputs()


@pytest.mark.parametrize("index", range(len(rj.CASES)), ids=CASE_IDS)
def test_bad_input_raises_and_writes_nothing(index):
    case = rj.CASES[index]
    eager = rj.outcome(index, "eager")
    assert eager.error == "ValueError", eager
    assert case.match and re.search(case.match, eager.message), eager.message
    assert eager.before == eager.after
    if rj.runs_in(case, "checked jit"):
        jitted = rj.outcome(index, "checked jit")
        assert jitted.error == "JaxRuntimeError", jitted
        assert jitted.message == eager.message  # one table of rules, one text
        assert jitted.before == jitted.after


def test_the_doc_is_generated():
    """docs/reliability.md is what `python tests/jax/reliability_jax.py` writes."""
    assert rj.DOC.read_text() == rj.generate(), (
        "docs/reliability.md differs from the cases: run `python tests/jax/reliability_jax.py`"
    )


def test_good_inputs_pass_every_mode(x):
    md = x.metadata
    args = (x.query, x.key_cache, x.value_cache, md)
    eager = jax_attn.paged_attention(*args, impl="xla")
    checked = jax_attn.checked(lambda *a: jax_attn.paged_attention(*a, impl="xla"))(*args)
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(checked))
    kc, vc = jax_attn.write_kv(x.key_cache, x.value_cache, x.key, x.key, md.slot_mapping)
    assert rj.cache_hash(kc, vc) != rj.cache_hash(x.key_cache, x.value_cache)
    jax_attn.copy_blocks(x.key_cache, x.value_cache, jnp.zeros((0, 2), jnp.int32))
    jax_attn.copy_blocks(x.key_cache, x.value_cache, [[0, 5], [5, 0]])  # a swap of two blocks


def test_check_false_and_config_turn_it_off(x, monkeypatch):
    bad = jnp.asarray([[0, -1]], jnp.int32)
    with pytest.raises(ValueError, match=r"src_to_dst\[0, 1\]=-1 is out of range"):
        jax_attn.copy_blocks(x.key_cache, x.value_cache, bad)
    # Off: the pair is dropped (never wrapped onto the last block).
    kc, vc = jax_attn.copy_blocks(x.key_cache, x.value_cache, bad, check=False)
    assert rj.cache_hash(kc, vc) == rj.cache_hash(x.key_cache, x.value_cache)
    monkeypatch.setattr(jax_attn.config, "check", False)
    jax_attn.copy_blocks(x.key_cache, x.value_cache, bad)
    with pytest.raises(ValueError, match="out of range"):
        jax_attn.copy_blocks(x.key_cache, x.value_cache, bad, check=True)


def test_env_var_turns_it_off():
    import subprocess
    import sys

    code = "import jax_attn; print(jax_attn.config.check)"
    env = dict(__import__("os").environ, JAX_ATTN_CHECK="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def test_plain_jit_pays_nothing(x):
    """Under a plain jit the values are tracers: no check (no host sync), no error."""
    md = dataclasses.replace(x.metadata, seq_lens=jnp.asarray([2, 9, 0], jnp.int32))
    jitted = jax.jit(lambda q, kc, vc, md: jax_attn.paged_attention(q, kc, vc, md, impl="xla"))
    jitted(x.query, x.key_cache, x.value_cache, md)  # no error: the caller asked for no checks
    jaxpr = str(jax.make_jaxpr(jitted)(x.query, x.key_cache, x.value_cache, md))
    assert "check" not in jaxpr


def test_unchecked_swap_and_write_never_wrap(x):
    """With the checks off, bad ids are dropped, not wrapped onto other blocks or slots."""
    dst = x.value_cache[:4]
    out = jax_attn.swap_blocks(x.key_cache, dst, [[0, -1], [7, 0]], check=False)
    assert rj.cache_hash(out) == rj.cache_hash(dst)
    slots = jnp.asarray([-2, -5, 24, 999], jnp.int32)
    kc, vc = jax_attn.write_kv(x.key_cache, x.value_cache, x.key, x.key, slots, check=False)
    assert rj.cache_hash(kc, vc) == rj.cache_hash(x.key_cache, x.value_cache)


def test_checked_refused_write_keeps_donated_caches(x):
    """Inside `checked` a refused write writes nothing: the donated caches come back intact in
    the error's `outputs`, so a serving loop can go on after reporting the error."""
    step = jax_attn.checked(
        lambda kc, vc, k, s: jax_attn.write_kv(kc, vc, k, k, s), donate_argnums=(0, 1)
    )
    expected = rj.cache_hash(x.key_cache, x.value_cache)
    kc, vc = jnp.array(x.key_cache), jnp.array(x.value_cache)  # copies to donate
    with pytest.raises(Exception, match="has slot 5 more than once") as info:
        step(kc, vc, x.key, jnp.asarray([4, 5, 5, -1], jnp.int32))
    assert rj.cache_hash(*info.value.outputs) == expected


def test_checked_with_concrete_values_raises_eagerly(x):
    """Values closed over by the checked function are concrete while tracing: eager error."""
    bad = jnp.asarray([[0, -1]], jnp.int32)
    step = jax_attn.checked(lambda kc, vc: jax_attn.copy_blocks(kc, vc, bad))
    with pytest.raises(ValueError, match=r"src_to_dst\[0, 1\]=-1"):
        step(x.key_cache, x.value_cache)


def test_rules_agree_between_numpy_and_jnp(rng):
    """The same rule table, evaluated by NumPy and by jax.numpy, breaks on the same rule with
    the same values, on random metadata with one random corruption."""
    for _ in range(6):
        n = int(rng.integers(1, 5))
        tables = rng.integers(-2, 8, size=(n, 3))
        values = dict(
            query_start_loc=np.concatenate([[0], np.cumsum(rng.integers(-1, 3, n))]),
            seq_lens=rng.integers(-1, 14, n),
            block_tables=tables,
            slot_mapping=rng.integers(-2, 26, 5),
            num_seqs=np.asarray(rng.integers(0, n + 2)),
        )
        static = dict(num_tokens=5, num_blocks=6, block_size=4)
        eager = _first_broken(value_rules.ragged_rules(np, **values, **static))
        traced_values = {k: jnp.asarray(v) for k, v in values.items()}
        traced = _first_broken(value_rules.ragged_rules(jnp, **traced_values, **static))
        assert eager == traced


def _first_broken(violations):
    for bad, template, args in violations:
        if bool(bad):
            return value_rules.format_message(template, args)
    return None


@pytest.mark.parametrize("entry", ["paged_attention", "paged_decode"])
def test_check_keyword_on_attention(entry, x):
    md = dataclasses.replace(x.metadata, block_tables=jnp.asarray([[1, 0], [2, 6], [0, 0]]))
    if entry == "paged_attention":
        call = lambda **kw: jax_attn.paged_attention(
            x.query, x.key_cache, x.value_cache, md, impl="xla", **kw
        )
    else:
        call = lambda **kw: jax_attn.paged_decode(
            x.query[:3],
            x.key_cache,
            x.value_cache,
            md.block_tables,
            md.seq_lens,
            impl="xla",
            **kw,
        )
    with pytest.raises(ValueError, match=r"block_tables\[1, 1\]=6 is out of range"):
        call()
    call(check=False)  # off: no error (the gather clamps: the caller opted out)

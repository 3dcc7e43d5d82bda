"""The tolerance scales with the output (issue 22): in bfloat16 and float16, a decode over 513
keys that drops one key fails, while the right answer passes. Under bfloat16's old absolute
row (1.6e-2) the dropped key passed: the outputs are ~0.07 and one key moves them by 5e-3 to
1.7e-2, depending on the draw. The same rule serves every comparison against the oracle or a
peer (a peer: the bound doubled), the bench's output check included."""

import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import TOLERANCES, assert_close, error_bound, tolerance

import jax_attn
from jax_attn import cpu, reference


def _decode_513(rng, dtype):
    # 32 heads: the last key's weight, p_k = exp(l_k) / Z, is large in some head whatever
    # the draw (in 8 heads all 8 logits fall below 0 once in 256 draws).
    num_heads, head_size, block_size, seq_len = 32, 128, 16, 513
    num_blocks = -(-seq_len // block_size)
    tables = rng.permutation(num_blocks + 3)[:num_blocks].astype(np.int32)[None]
    shape = (num_blocks + 3, block_size, 1, head_size)
    kc = jnp.asarray(rng.standard_normal(shape), dtype)
    vc = jnp.asarray(rng.standard_normal(shape), dtype)
    query = jnp.asarray(rng.standard_normal((1, num_heads, head_size)), dtype)
    return query, kc, vc, jnp.asarray(tables)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("impl", ["xla", "cpu"])
def test_one_dropped_key_of_513_fails(rng, dtype, impl):
    if impl == "cpu" and not cpu.available():
        pytest.skip(f"native CPU kernels: {cpu.unavailable_reason()}")
    query, kc, vc, tables = _decode_513(rng, dtype)
    lens = jnp.asarray([513], jnp.int32)
    expected = np.asarray(
        reference.paged_decode(
            query.astype(jnp.float32), kc.astype(jnp.float32), vc.astype(jnp.float32),
            tables, lens,
        ),
        np.float64,
    )  # fmt: skip
    right = jax_attn.paged_decode(query, kc, vc, tables, lens, impl=impl)
    assert_close(right, expected, dtype)  # the right answer passes
    # seq_lens 512: the same query position's keys minus the last one (key 512 of 513).
    dropped = np.asarray(
        jax_attn.paged_decode(query, kc, vc, tables, lens - 1, impl=impl).astype(jnp.float32),
        np.float64,
    )
    with pytest.raises(AssertionError, match="beyond the error bound"):
        assert_close(dropped, expected, dtype)


def _right_and_dropped(rng, dtype, impl):
    """The 513-key decode's output through `impl`, and the same with key 512 dropped, [1, Hq*D]
    float64 as the bench holds outputs; and the output of impl='xla' for the peer rule."""
    query, kc, vc, tables = _decode_513(rng, dtype)
    lens = jnp.asarray([513], jnp.int32)

    def run(impl, lens):
        out = jax_attn.paged_decode(query, kc, vc, tables, lens, impl=impl)
        return np.asarray(out.astype(jnp.float32), np.float64).reshape(1, -1)

    return run(impl, lens), run(impl, lens - 1), run("xla", lens)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_one_dropped_key_of_513_fails_against_a_peer(rng, dtype):
    """Against a peer (here impl='xla') the bound doubles, and the dropped key still fails."""
    impl = "cpu" if cpu.available() else "reference"
    right, dropped, xla = _right_and_dropped(rng, dtype, impl)
    assert_close(right, xla, dtype, peer=True)
    with pytest.raises(AssertionError, match=r"beyond the error bound.*against a peer"):
        assert_close(dropped, xla, dtype, peer=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_bench_refuses_one_dropped_key(rng, dtype):
    """The bench's output check (`benchmarks.run._verify`, against jax-xla) is the same rule:
    its doubled absolute rows (bfloat16 3.2e-2) let the dropped key agree."""
    pytest.importorskip("rich")
    from benchmarks import run
    from benchmarks.workloads import Spec

    impl = "cpu" if cpu.available() else "reference"
    right, dropped, xla = _right_and_dropped(rng, dtype, impl)
    spec = Spec("d513", (1,), (513,), num_heads=32, num_kv_heads=1, head_size=128, dtype=dtype)
    rows = {name: {} for name in (run.BASELINE, "right", "dropped")}
    run._verify(spec, {run.BASELINE: xla, "right": right, "dropped": dropped}, rows)
    assert rows["right"]["agrees"] is True and rows[run.BASELINE]["agrees"] is True
    assert rows["dropped"]["agrees"] is False, rows["dropped"]


def test_a_peers_documented_deviation_is_shown_but_fails_nothing(capsys):
    """A row beyond the rule fails the bench run, unless the peer documents it as a deviation
    (vLLM 0.32's amx kernel over fp8): then it is shown and said, and the run passes."""
    pytest.importorskip("rich")
    import argparse

    from rich.console import Console

    from benchmarks import run

    def record(**row):
        return {"workloads": {"w": {"backends": {"peer": dict(status="ok", note="", **row)}}}}

    console, args = Console(), argparse.Namespace(json=None)
    assert run.write_and_judge(console, record(agrees=False), args, baseline="jax-xla") == 1
    known = record(agrees=False, deviation="off by design")
    assert run.write_and_judge(console, known, args, baseline="jax-xla") == 0
    assert "known deviation w/peer: off by design" in capsys.readouterr().out


def test_bound_scales_with_the_row():
    """Rows 100x smaller get a 100x tighter bound; float32 keeps its absolute row; an fp8
    cache doubles the query dtype's bound; an all-zero row is held to ~u * 1e-3."""
    row = np.random.default_rng(0).standard_normal((2, 64))
    big, small = error_bound(row, "bfloat16"), error_bound(row / 100, "bfloat16")
    np.testing.assert_allclose(small[0], big[0] / 100, rtol=0.05)  # (the floor)
    np.testing.assert_allclose(error_bound(row, "float32"), 2e-5 + 2e-5 * np.abs(row))
    np.testing.assert_allclose(
        error_bound(row, "bfloat16", "float8_e4m3fn"), 2 * error_bound(row, "bfloat16")
    )
    assert np.all(error_bound(np.zeros((1, 8)), "bfloat16") < 1e-5)
    assert tolerance("bfloat16") == TOLERANCES["bfloat16"]  # the table itself is unchanged

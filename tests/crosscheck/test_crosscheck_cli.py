"""The cross-check harness and the `jax-attn` command."""

import dataclasses

import numpy as np
import pytest

from interop import cli, crosscheck


def test_check_quick_passes(capsys):
    assert cli.main(["check", "--quick", "--backends", "jax-reference,jax-xla"]) == 0
    out = capsys.readouterr().out
    assert "all within tolerance" in out and "jax-xla" in out


def test_info_lists_backends(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for name in ("jax-reference", "jax-xla", "jax-pallas"):
        assert name in out


@pytest.mark.parametrize("spec", crosscheck.default_specs(), ids=lambda s: s.name)
def test_every_default_workload_within_tolerance_on_xla(spec, rng):
    problem = crosscheck.make_problem(spec, rng)
    backend = next(b for b in crosscheck.JAX_BACKENDS if b.name == "jax-xla")
    cell = crosscheck.check_cell(backend, problem)
    assert cell.ok, cell.note  # within the one tolerance rule
    assert cell.error is not None


def test_a_wrong_backend_is_caught(rng, monkeypatch, capsys):
    """The harness must be able to fail: a backend that drops the ALiBi bias is flagged."""
    spec = crosscheck.default_specs()[1]
    assert spec.alibi
    xla = next(b for b in crosscheck.JAX_BACKENDS if b.name == "jax-xla")

    def no_alibi(problem):
        return xla.run(dataclasses.replace(problem, alibi_slopes=None))

    broken = crosscheck.Backend("broken", lambda: None, no_alibi)
    cell = crosscheck.check_cell(broken, crosscheck.make_problem(spec, rng))
    assert not cell.ok and cell.error is not None  # beyond the one tolerance rule

    crashing = crosscheck.Backend("crashing", lambda: None, lambda p: 1 / 0)
    assert not crosscheck.check_cell(crashing, crosscheck.make_problem(spec, rng)).ok

    monkeypatch.setattr(crosscheck, "all_backends", lambda: [broken])
    assert cli.main(["check", "--quick"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_nan_output_fails(rng):
    spec = crosscheck.default_specs()[0]
    problem = crosscheck.make_problem(spec, rng)
    nan_backend = crosscheck.Backend(
        "nan", lambda: None, lambda p: np.full(p.expected.shape, np.nan)
    )
    cell = crosscheck.check_cell(nan_backend, problem)
    assert not cell.ok and cell.note == "non-finite output"

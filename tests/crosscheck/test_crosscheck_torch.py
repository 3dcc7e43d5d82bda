"""Every default cross-check workload through every torch backend available here."""

import pytest

from interop import crosscheck

torch_runners = pytest.importorskip(
    "interop.torch_runners", reason="torch is not installed in this environment"
)

SPECS = crosscheck.default_specs()


def _backend(name):
    backend = next(b for b in torch_runners.TORCH_BACKENDS if b.name == name)
    reason = backend.why_unavailable()
    if reason:
        pytest.skip(f"{name} does not run here: {reason}")
    return backend


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("name", ["TORCH_SDPA", "XFORMERS", "JAX-via-torch"])
def test_torch_backend_within_tolerance(name, spec, rng):
    cell = crosscheck.check_cell(_backend(name), crosscheck.make_problem(spec, rng))
    assert cell.ok, cell.note
    assert cell.error is not None or cell.note.startswith("n/a")


@pytest.mark.ipex
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_ipex_within_tolerance(spec, rng):
    cell = crosscheck.check_cell(_backend("IPEX"), crosscheck.make_problem(spec, rng))
    assert cell.ok, cell.note

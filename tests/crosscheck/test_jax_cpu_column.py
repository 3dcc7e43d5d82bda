"""The `jax-cpu` column of the cross-check and the bench's `jax-cpu` peer: run through
`impl="cpu"` when `jax_attn.cpu` is built, and otherwise say why, with the package's reason."""

import sys
import types

import pytest

pytest.importorskip("jax")

import jax_attn
from interop import crosscheck, jax_runners


def _fake_cpu(monkeypatch, reason=None, problem=None):
    fake = types.ModuleType("jax_attn.cpu")
    fake.unavailable_reason = lambda: reason
    fake.available = lambda: reason is None
    fake.shape_problem = lambda **kw: problem
    monkeypatch.setitem(sys.modules, "jax_attn.cpu", fake)
    monkeypatch.setattr(jax_attn, "cpu", fake, raising=False)
    return fake


def _cpu_backend():
    return next(b for b in crosscheck.all_backends() if b.name == "jax-cpu")


def test_unbuilt_kernels_give_their_reason(monkeypatch, rng):
    _fake_cpu(monkeypatch, reason="no C++ compiler found (tried $CXX, c++, g++)")
    backend = _cpu_backend()
    assert "no C++ compiler found" in backend.why_unavailable()
    problem = crosscheck.make_problem(crosscheck.default_specs()[0], rng)
    cell = crosscheck.check_cell(backend, problem)
    assert cell.ok and cell.error is None and "no C++ compiler found" in cell.note


def test_refused_shapes_are_unsupported_not_failures(monkeypatch, rng):
    _fake_cpu(monkeypatch, problem="head_size=64 is not supported")
    assert _cpu_backend().why_unavailable() is None
    cell = crosscheck.check_cell(
        _cpu_backend(), crosscheck.make_problem(crosscheck.default_specs()[0], rng)
    )
    assert cell.ok and cell.note == "n/a: head_size=64 is not supported"


def test_cache_less_types_are_unsupported(monkeypatch, rng):
    _fake_cpu(monkeypatch)
    encoder = next(s for s in crosscheck.default_specs() if s.name == "encoder")
    cell = crosscheck.check_cell(_cpu_backend(), crosscheck.make_problem(encoder, rng))
    assert cell.ok and "varlen has no native kernel" in cell.note


def test_missing_package_is_reported(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax_attn.cpu", None)
    monkeypatch.delattr(jax_attn, "cpu", raising=False)
    assert jax_runners.cpu_unavailable().startswith("jax_attn.cpu does not import")


def test_bench_peer_follows_the_same_rule(monkeypatch):
    from benchmarks import backends

    peer = next(p for p in backends.PEERS if p.name == "jax-cpu")
    _fake_cpu(monkeypatch, reason="build failed: error: x")
    assert peer.why_unavailable() == "not available: build failed: error: x"
    _fake_cpu(monkeypatch)
    assert peer.why_unavailable() is None
    monkeypatch.setitem(sys.modules, "jax_attn.cpu", None)
    monkeypatch.delattr(jax_attn, "cpu", raising=False)
    assert "jax_attn.cpu does not import" in peer.why_unavailable()

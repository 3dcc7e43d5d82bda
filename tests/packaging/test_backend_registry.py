"""`get_attn_backend`: built-in backends by name, "JAX" through the installed package's entry
point (group `torch_backends.backends`), unknown names refused with the known ones listed."""

import importlib.metadata

import pytest

from torch_backends import registry


def _jax_registered() -> bool:
    group = importlib.metadata.entry_points(group=registry.ENTRY_POINT_GROUP)
    return any(ep.name == "JAX" for ep in group)


def test_the_distribution_declares_the_jax_entry_point():
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    group = pyproject["project"]["entry-points"][registry.ENTRY_POINT_GROUP]
    assert group == {"JAX": "interop.torch_op:JaxAttnBackend"}


def test_jax_backend_through_the_entry_point():
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    if not _jax_registered():
        pytest.skip("this environment's installed metadata predates the entry point")
    from interop.torch_op import JaxAttnBackend
    from torch_backends import get_attn_backend

    assert get_attn_backend("JAX") is JaxAttnBackend
    assert "JAX" in registry.known_backends()


def test_a_plugin_is_found_and_listed(monkeypatch):
    class Fake:
        pass

    class FakeEntryPoint:
        name = "FAKE"

        def load(self):
            return Fake

    class Shadow(FakeEntryPoint):
        name = "TORCH_SDPA"  # a plugin never overrides a built-in

        def load(self):
            raise AssertionError("a built-in name must not load a plugin")

    def entry_points(group):
        assert group == registry.ENTRY_POINT_GROUP
        return [FakeEntryPoint(), Shadow()]

    monkeypatch.setattr(registry.importlib.metadata, "entry_points", entry_points)
    assert registry.get_attn_backend("FAKE") is Fake
    assert registry.known_backends() == ["FAKE", "IPEX", "TORCH_SDPA", "XFORMERS"]
    with pytest.raises(ValueError, match=r"Unknown attention backend 'NOPE'.*'FAKE'.*'XFORMERS'"):
        registry.get_attn_backend("NOPE")


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(
        ValueError, match=r"Unknown attention backend 'FLASH'.*'IPEX'.*'TORCH_SDPA'"
    ):
        registry.get_attn_backend("FLASH")

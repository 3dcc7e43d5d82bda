"""Cross-check runners for the JAX core: a `harness.Problem` through `jax_attn`'s public entries.

| backend       | what runs                                                                  |
|---------------|----------------------------------------------------------------------------|
| jax-reference | `paged_attention(impl="reference")` in float64 (`reference.varlen_attention` |
|               | for the cache-less types): the JAX oracle against the NumPy one             |
| jax-xla       | `write_kv` then `paged_attention(impl="xla")`; `varlen_attention`           |
| jax-pallas    | the Pallas kernels (interpret mode on CPU); paged types only                |
| jax-cpu       | the native CPU kernels through XLA's FFI (`impl="cpu"`); paged types only   |

jax and the kernels are imported when a runner runs, never at import.
"""

import importlib.util
from collections.abc import Callable

import numpy as np

from interop.harness import Backend, Problem, Unsupported
from torch_backends.attention_type import AttentionType


def _jax_paged(impl: str) -> Callable[[Problem], np.ndarray]:
    def run(p: Problem) -> np.ndarray:
        import jax.numpy as jnp

        import jax_attn

        w, spec = p.workload, p.spec
        if spec.attn_type is not AttentionType.DECODER:
            return _jax_varlen(p, impl)
        if impl == "cpu":
            _cpu_supports(p)
        md = w.metadata()
        kc, vc = jax_attn.write_kv(
            jnp.asarray(w.key_cache),
            jnp.asarray(w.value_cache),
            jnp.asarray(w.new_key),
            jnp.asarray(w.new_value),
            md.slot_mapping,
            k_scale=w.k_scale,
            v_scale=w.v_scale,
        )
        bias = dict(p.bias)
        slopes = bias.pop("alibi_slopes")
        out = jax_attn.paged_attention(
            jnp.asarray(w.query),
            kc,
            vc,
            md,
            impl=impl,
            scale=p.spec.softmax_scale,
            k_scale=w.k_scale,
            v_scale=w.v_scale,
            alibi_slopes=None if slopes is None else jnp.asarray(slopes),
            **bias,
        )
        return np.asarray(out.astype(jnp.float32), np.float64)

    return run


def _jax_varlen(p: Problem, impl: str) -> np.ndarray:
    """Encoder / encoder-only / cross attention: dense varlen over the sequences' keys."""
    import jax
    import jax.numpy as jnp

    import jax_attn

    if impl == "pallas":
        raise Unsupported("the Pallas kernels are paged; varlen has no Pallas kernel")
    if impl == "cpu":
        raise Unsupported("the native CPU kernels are paged; varlen has no native kernel")
    w = p.workload
    keys = np.concatenate(w.keys).astype(w.query.dtype)
    values = np.concatenate(w.values).astype(w.query.dtype)
    cu_q = np.concatenate([[0], np.cumsum(w.query_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(w.seq_lens)]).astype(np.int32)
    bias = dict(p.bias)
    slopes = bias.pop("alibi_slopes")
    args = (
        jnp.asarray(w.query),
        jnp.asarray(keys),
        jnp.asarray(values),
        jnp.asarray(cu_q),
        jnp.asarray(cu_k),
    )
    if impl == "reference":
        with jax.enable_x64(True):
            out = jax_attn.reference.varlen_attention(
                *args, scale=p.spec.softmax_scale, alibi_slopes=slopes, **bias
            )
            return np.asarray(out, np.float64)
    out = jax_attn.varlen_attention(
        *args,
        scale=p.spec.softmax_scale,
        alibi_slopes=None if slopes is None else jnp.asarray(slopes),
        **bias,
    )
    return np.asarray(out.astype(jnp.float32), np.float64)


def _jax_reference(p: Problem) -> np.ndarray:
    import jax

    with jax.enable_x64(True):
        return _jax_paged("reference")(p)


def _jax_missing() -> str | None:
    if importlib.util.find_spec("jax") is None:
        return "jax is not installed (pip install jax)"
    return None


def _pallas_unavailable() -> str | None:
    reason = _jax_missing()
    if reason:
        return reason
    try:
        from jax_attn import pallas
    except ImportError as e:
        return f"jax_attn.pallas does not import: {e}"
    if not hasattr(pallas, "ragged_paged_attention"):
        return "jax_attn.pallas has no ragged_paged_attention kernel yet"
    return None


def cpu_unavailable() -> str | None:
    """Why the native CPU kernels do not run here (None: they do). Builds them on first call."""
    reason = _jax_missing()
    if reason:
        return reason
    try:
        from jax_attn import cpu
    except ImportError as e:
        return f"jax_attn.cpu does not import: {e}"
    reason = cpu.unavailable_reason()
    return None if reason is None else f"native CPU kernels unavailable: {reason}"


def _cpu_supports(p: Problem) -> None:
    """Raise `Unsupported` when the native kernels cannot take this problem here."""
    reason = cpu_unavailable()
    if reason:
        raise Unsupported(reason)
    from jax_attn import cpu

    spec = p.spec
    problem = cpu.shape_problem(
        query_dtype=np.dtype(p.workload.query.dtype),
        cache_dtype=np.dtype(p.workload.key_cache.dtype),
        block_size=spec.block_size,
        head_size=spec.head_size,
    )
    if problem:
        raise Unsupported(problem)


JAX_BACKENDS = [
    Backend("jax-reference", _jax_missing, _jax_reference, label="ref"),
    Backend("jax-xla", _jax_missing, _jax_paged("xla"), label="xla"),
    Backend("jax-pallas", _pallas_unavailable, _jax_paged("pallas"), label="pallas"),
    Backend("jax-cpu", cpu_unavailable, _jax_paged("cpu"), label="cpu"),
]

"""The choice of implementation (`paged.resolve_impl`) and the `impl="cpu"` route.

The native CPU kernels (`jax_attn.cpu`) may or may not be built on this machine, so every test
here puts a fake of that package into `sys.modules` (or blocks it) to say which case it checks.
"""

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import assert_close

import jax_attn
from jax_attn import paged

QUERY = jax.ShapeDtypeStruct((3, 4, 64), jnp.bfloat16)
CACHE = jax.ShapeDtypeStruct((5, 16, 2, 64), jnp.bfloat16)


def fake_cpu(*, reason=None, problem=None, calls=None):
    """A stand-in for `jax_attn.cpu`: unavailable for `reason`, refusing shapes for `problem`;
    its kernels record their arguments in `calls` and return sevens."""
    module = types.ModuleType("jax_attn.cpu")
    module.unavailable_reason = lambda: reason
    module.available = lambda: reason is None
    module.shape_problem = lambda **kwargs: problem

    def kernel(name):
        def run(query, *args, **kwargs):
            if calls is not None:
                calls.append((name, len(args), kwargs))
            return jnp.full(query.shape, 7.0, query.dtype)

        return run

    module.paged_decode = kernel("paged_decode")
    module.ragged_paged_attention = kernel("ragged_paged_attention")
    return module


@pytest.fixture
def no_cpu_kernels(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax_attn.cpu", None)  # `import jax_attn.cpu` fails


def on_default_backend(monkeypatch, platform):
    monkeypatch.setattr(jax, "default_backend", lambda: platform)


def test_arrays_on_cpu_decide_not_the_default_backend(monkeypatch, no_cpu_kernels):
    """Concrete arrays on a CPU device never get the GPU kernel, whatever the default says."""
    on_default_backend(monkeypatch, "gpu")
    query = jnp.zeros(QUERY.shape, QUERY.dtype)
    cache = jnp.zeros(CACHE.shape, CACHE.dtype)
    assert paged.array_platform(query) == "cpu"
    assert paged.resolve_impl("auto", query, cache) == "xla"
    # Shape structs (and tracers) carry no device: the default backend decides.
    assert paged.resolve_impl("auto", QUERY, CACHE) == "pallas"


def test_tracers_fall_back_to_the_default_backend(monkeypatch, no_cpu_kernels):
    on_default_backend(monkeypatch, "gpu")
    seen = []

    @jax.jit
    def f(query, cache):
        seen.append(paged.resolve_impl("auto", query, cache))
        return query

    f(jnp.zeros(QUERY.shape, QUERY.dtype), jnp.zeros(CACHE.shape, CACHE.dtype))
    assert seen == ["pallas"]


def test_pallas_interprets_where_the_arrays_are_not_on_a_gpu(monkeypatch):
    on_default_backend(monkeypatch, "gpu")
    query = jnp.zeros(QUERY.shape, QUERY.dtype)
    cache = jnp.zeros(CACHE.shape, CACHE.dtype)
    assert paged._resolve("pallas", None, query, cache) == ("pallas", True)
    assert paged._resolve("pallas", False, query, cache) == ("pallas", False)
    assert paged._resolve("pallas", None, QUERY, CACHE) == ("pallas", False)
    assert paged._resolve("xla", True, query, cache) == ("xla", None)


def test_auto_takes_the_cpu_kernels_where_they_work(monkeypatch):
    on_default_backend(monkeypatch, "cpu")
    monkeypatch.setitem(sys.modules, "jax_attn.cpu", fake_cpu())
    assert paged.resolve_impl("auto", QUERY, CACHE) == "cpu"
    assert paged.resolve_impl("cpu", QUERY, CACHE) == "cpu"
    assert paged.resolve_impl("xla", QUERY, CACHE) == "xla"
    on_default_backend(monkeypatch, "gpu")
    assert paged.resolve_impl("auto", QUERY, CACHE) == "pallas"


def test_cpu_kernels_refusing_the_shapes(monkeypatch):
    on_default_backend(monkeypatch, "cpu")
    fake = fake_cpu(problem="head_size=72 is not supported by the native CPU kernels")
    monkeypatch.setitem(sys.modules, "jax_attn.cpu", fake)
    assert paged.resolve_impl("auto", QUERY, CACHE) == "xla"
    with pytest.raises(ValueError, match=r"impl=.cpu. cannot take .*head_size=72 is not supported"):
        paged.resolve_impl("cpu", QUERY, CACHE)


def test_cpu_kernels_not_built(monkeypatch):
    on_default_backend(monkeypatch, "cpu")
    fake = fake_cpu(reason="no C++ compiler found (tried $CXX, c++, g++)")
    monkeypatch.setitem(sys.modules, "jax_attn.cpu", fake)
    assert paged.resolve_impl("auto", QUERY, CACHE) == "xla"
    with pytest.raises(
        RuntimeError, match=r"native CPU kernels are not available: no C\+\+ compiler found"
    ):
        paged.resolve_impl("cpu", QUERY, CACHE)


def test_cpu_package_missing(monkeypatch, no_cpu_kernels):
    on_default_backend(monkeypatch, "cpu")
    assert paged.resolve_impl("auto", QUERY, CACHE) == "xla"
    with pytest.raises(RuntimeError, match=r"native CPU kernels are not available: jax_attn\.cpu"):
        paged.resolve_impl("cpu", QUERY, CACHE)


def _problem():
    md = jax_attn.RaggedMetadata.build([2, 1], [0, 6], [[1], [2, 0]], 4, pad_to=(3, 5))
    rng = np.random.default_rng(0)
    query = jnp.asarray(rng.standard_normal((5, 6, 16)), jnp.float32)
    cache = jnp.asarray(rng.standard_normal((3, 4, 3, 16)), jnp.float32)
    return query, cache, md


def test_impl_cpu_calls_the_native_kernels(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "jax_attn.cpu", fake_cpu(calls=calls))
    query, cache, md = _problem()
    out = jax_attn.paged_attention(query, cache, cache, md, impl="cpu", sliding_window=3)
    np.testing.assert_array_equal(out, 7.0)
    decode = jax_attn.paged_decode(
        query[:2], cache, cache, md.block_tables[:2], md.seq_lens[:2], impl="cpu", scale=0.5
    )
    np.testing.assert_array_equal(decode, 7.0)
    (name, num_args, kwargs), (decode_name, decode_args, decode_kwargs) = calls
    assert (name, num_args) == ("ragged_paged_attention", 6)  # caches, qsl, lens, tables, n
    assert kwargs["scale"] == 16**-0.5 and kwargs["sliding_window"] == 3 and kwargs["causal"]
    assert (decode_name, decode_args, decode_kwargs["scale"]) == ("paged_decode", 4, 0.5)


def test_impl_cpu_never_falls_back(monkeypatch):
    fake = fake_cpu(reason="build failed: csrc/paged_decode.cc:1: error")
    monkeypatch.setitem(sys.modules, "jax_attn.cpu", fake)
    query, cache, md = _problem()
    with pytest.raises(RuntimeError, match=r"not available: build failed: csrc/paged_decode\.cc"):
        jax_attn.paged_attention(query, cache, cache, md, impl="cpu")
    # "auto" goes to XLA, and gives what XLA gives.
    auto = jax_attn.paged_attention(query, cache, cache, md)
    xla = jax_attn.paged_attention(query, cache, cache, md, impl="xla")
    np.testing.assert_array_equal(auto, xla)


def test_auto_inside_a_callers_jit(monkeypatch, no_cpu_kernels):
    query, cache, md = _problem()
    jitted = jax.jit(lambda q, c, m: jax_attn.paged_attention(q, c, c, m))
    expected = jax_attn.paged_attention(query, cache, cache, md, impl="reference")
    assert_close(jitted(query, cache, md), expected, "float32")


def test_scales_must_be_scalars():
    query, cache, md = _problem()
    with pytest.raises(ValueError, match=r"k_scale must be a scalar; got shape \(2,\)"):
        jax_attn.paged_attention(query, cache, cache, md, impl="xla", k_scale=jnp.ones(2))
    with pytest.raises(ValueError, match=r"v_scale must be a scalar; got shape \(1, 1\)"):
        jax_attn.paged_decode(
            query[:2], cache, cache, md.block_tables[:2], md.seq_lens[:2], v_scale=jnp.ones((1, 1))
        )


def test_kernel_dtypes():
    from jax_attn import shape_rules

    shape_rules.check_kernel_dtypes(jnp.bfloat16, jnp.float8_e4m3fn)
    with pytest.raises(
        TypeError, match=r"query\.dtype=float64 must be float32, bfloat16 or float16"
    ):
        shape_rules.check_kernel_dtypes(jnp.float64, jnp.float32)
    with pytest.raises(
        TypeError, match=r"key_cache\.dtype=float64 must be float32, bfloat16, float16"
    ):
        shape_rules.check_kernel_dtypes(jnp.float32, jnp.float64)

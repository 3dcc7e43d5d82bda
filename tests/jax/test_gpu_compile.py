"""The Pallas kernels compiled for an H100 and an A100 that are not here (`pallas.gpu_compile`).

Tests marked `gpu_aot` need the CUDA PJRT plugin, ptxas and `JAX_PLATFORMS=cpu`: the gpu-aot
environment (`bash scripts/env.sh gpu-aot`), which `scripts/test.sh` runs them in. Each
compiles one kernel configuration through XLA's GPU pipeline (Triton, then ptxas) and fails on
a compile error, shared memory over the GPU's opt-in limit, any spill, or registers at the
255 ceiling. The other tests (target descriptions, the grid, the dispatch's refusal of e4m3
before sm_89) run in every environment.
"""

import os
import types

import jax
import jax.numpy as jnp
import pytest

from jax_attn import paged, shape_rules
from jax_attn.pallas import gpu_compile

REASON = gpu_compile.unavailable_reason()
# scripts/test.sh sets this in the gpu-aot environment: there "cannot compile" is a failure.
REQUIRED = bool(os.environ.get("JAX_ATTN_REQUIRE_GPU_AOT"))
needs_aot = pytest.mark.skipif(
    REASON is not None and not REQUIRED, reason=f"no GPU compile here: {REASON}"
)


@pytest.fixture(autouse=True)
def _aot_ready(request):
    if request.node.get_closest_marker("gpu_aot") is not None:
        assert REASON is None, f"JAX_ATTN_REQUIRE_GPU_AOT is set but: {REASON}"


def test_target_descriptions_carry_the_published_figures():
    h100, a100 = gpu_compile.TARGETS["h100"], gpu_compile.TARGETS["a100"]
    text = h100.target_config()
    assert "core_count: 132" in text
    assert "shared_memory_per_block_optin: 232448" in text  # 227 KiB
    assert "cuda_compute_capability { major: 9 minor: 0 }" in text
    assert "memory_bandwidth: 3350000000000" in text
    assert "core_count: 108" in a100.target_config()
    assert a100.shared_memory_per_block_optin == 163 * 1024


def test_grid_covers_the_issue():
    """Every kernel x dtype x head size x block size named in issue 13 compiles somewhere in
    the grid, every bias feature meets every dtype, and D=256 meets block 128 (the shared
    memory worst case) for every dtype."""
    h100 = gpu_compile.default_grid(gpu_compile.TARGETS["h100"])
    seen = {(c.kernel, c.dtype) for c in h100}
    assert seen == {(k, d) for k in ("decode", "ragged") for d in gpu_compile.GRID_DTYPES}
    assert {c.head_size for c in h100} == {64, 128, 256}
    assert {c.block_size for c in h100} == {16, 32, 128}
    for dtype in gpu_compile.GRID_DTYPES:
        configs = [c for c in h100 if c.dtype == dtype]
        assert any(c.alibi for c in configs)
        assert any(c.sliding_window for c in configs)
        assert any(c.logits_soft_cap for c in configs)
        assert any((c.head_size, c.block_size) == (256, 128) for c in configs)
    a100 = gpu_compile.default_grid(gpu_compile.TARGETS["a100"])
    assert not any(c.dtype == "float8_e4m3fn" for c in a100)
    assert any(c.dtype == "float8_e5m2" for c in a100)


@pytest.mark.parametrize(
    ("capability", "dtype", "refused"),
    [
        ((8, 0), "float8_e4m3fn", True),
        ((8, 6), "float8_e4m3fn", True),
        ((8, 9), "float8_e4m3fn", False),
        ((9, 0), "float8_e4m3fn", False),
        ((8, 0), "float8_e5m2", False),
        ((8, 0), "bfloat16", False),
        (None, "float8_e4m3fn", False),  # not a CUDA device: nothing to refuse
    ],
)
def test_native_dtype_problem(capability, dtype, refused):
    problem = shape_rules.native_dtype_problem(jnp.dtype(dtype), capability)
    assert (problem is not None) == refused
    if refused:
        assert "float8_e4m3fn needs compute capability >= 8.9" in problem


def _on_fake_gpu(monkeypatch, capability: str):
    """Arrays that say they live on a CUDA GPU of `capability`."""
    device = types.SimpleNamespace(platform="gpu", compute_capability=capability)
    monkeypatch.setattr(paged, "array_device", lambda x: device)


@pytest.mark.parametrize(("capability", "expected"), [("8.0", "xla"), ("9.0", "pallas")])
def test_auto_refuses_e4m3_before_sm89(monkeypatch, capability, expected):
    _on_fake_gpu(monkeypatch, capability)
    query = jax.ShapeDtypeStruct((4, 8, 128), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((16, 16, 2, 128), jnp.float8_e4m3fn)
    assert paged.resolve_impl("auto", query, cache) == expected
    e5m2 = jax.ShapeDtypeStruct((16, 16, 2, 128), jnp.float8_e5m2)
    assert paged.resolve_impl("auto", query, e5m2) == "pallas"


def test_explicit_pallas_refuses_e4m3_before_sm89(monkeypatch):
    _on_fake_gpu(monkeypatch, "8.0")
    query = jax.ShapeDtypeStruct((4, 8, 128), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((16, 16, 2, 128), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"impl='pallas'.*e4m3fn needs compute capability"):
        paged._resolve("pallas", None, query, cache)
    # Interpret mode runs on the CPU: nothing to refuse.
    assert paged._resolve("pallas", True, query, cache) == ("pallas", True)


# ---- compiled for a described GPU (the gpu-aot environment) ----

GRID = [
    pytest.param(target, config, id=f"{target}-{config.id}")
    for target in gpu_compile.TARGETS
    for config in gpu_compile.default_grid(gpu_compile.TARGETS[target])
]


@pytest.mark.gpu_aot
@needs_aot
@pytest.mark.parametrize(("target", "config"), GRID)
def test_kernel_compiles_within_the_gpu(target, config):
    report = gpu_compile.compile_kernel(config, gpu_compile.TARGETS[target])
    assert report.problems() == [], gpu_compile.format_table([report])
    assert report.grid and report.threads in (128, 256)


@pytest.mark.gpu_aot
@needs_aot
@pytest.mark.parametrize("kernel", ["decode", "ragged"])
@pytest.mark.parametrize("target", list(gpu_compile.TARGETS))
def test_budget_holds_for_the_largest_page(kernel, target):
    """Block 128 with D=256 in float32: a whole page would be a 128 KiB K tile (and ~420 KiB
    of shared memory, over any GPU's limit); steps of 32 keys keep it within budget."""
    config = gpu_compile.KernelConfig(kernel, "float32", 256, 128)
    gpu = gpu_compile.TARGETS[target]
    report = gpu_compile.compile_kernel(config, gpu)
    assert report.problems() == [], gpu_compile.format_table([report])
    assert report.shared_memory <= gpu.shared_memory_per_block_optin


@pytest.mark.gpu_aot
@needs_aot
def test_dispatch_on_compile_only_devices():
    """`auto` reads the device from the shape structs' sharding: the Pallas kernel on an H100,
    XLA for an e4m3 cache on an A100 (Triton's fp8e4nv needs sm_89), whatever JAX's default
    backend (here the CPU) says."""
    assert jax.default_backend() == "cpu"

    def structs(target, cache_dtype):
        sharding = jax.sharding.SingleDeviceSharding(gpu_compile.compile_device(target))
        query = jax.ShapeDtypeStruct((4, 8, 128), jnp.bfloat16, sharding=sharding)
        cache = jax.ShapeDtypeStruct((16, 16, 2, 128), cache_dtype, sharding=sharding)
        return query, cache

    assert paged.compute_capability(gpu_compile.compile_device("h100")) == (9, 0)
    assert paged.resolve_impl("auto", *structs("h100", jnp.float8_e4m3fn)) == "pallas"
    assert paged.resolve_impl("auto", *structs("a100", jnp.float8_e4m3fn)) == "xla"
    assert paged.resolve_impl("auto", *structs("a100", jnp.float8_e5m2)) == "pallas"
    with pytest.raises(ValueError, match=r"needs compute capability >= 8\.9"):
        paged._resolve("pallas", None, *structs("a100", jnp.float8_e4m3fn))

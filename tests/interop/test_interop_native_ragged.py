"""The ragged kernel's two front ends, one kernel: the torch op
(`torch.ops.jax_attn.ragged_paged_attention`, torch_ops.cc) and the XLA FFI handler
(`jax_attn.cpu.ragged_paged_attention`, ragged_paged_attention_xla.cc) give the same bits on
the same inputs and the same worker count."""

import sys
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "torch"))
from test_native_ragged import GRID, bias_kwargs, ragged_case

from jax_attn import cpu as jax_cpu
from torch_backends import native

pytestmark = pytest.mark.skipif(
    native.unavailable_reason() is not None or jax_cpu.unavailable_reason() is not None,
    reason=(
        f"native torch ops not available: {native.unavailable_reason()}; "
        f"native CPU kernels: {jax_cpu.unavailable_reason()}"
    ),
)

# Each path of the kernel once: f32 tiles, GQA-1 with a window, the AMX bf16 tiles and the
# decode run staged behind them, fp8 under bf16 queries, all biases over f32, f16.
CASES = [
    case
    for case in GRID
    if case[0]
    in (
        "prefill-f32",
        "chunked-mqa-window",
        "mixed-bf16",
        "mixed-fp8-bf16q",
        "mixed-f32-all",
        "mixed-f16-softcap",
        "prefill-noncausal",
    )
]

_BITS = {
    torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
    torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2),
}


def _jnp(t: torch.Tensor):
    """The same bytes as a JAX array (through NumPy; bf16 and fp8 by their bit patterns)."""
    if t.dtype in _BITS:
        bits, dtype = _BITS[t.dtype]
        return jnp.asarray(t.view(bits).numpy().view(dtype))
    return jnp.asarray(t.numpy())


def _bits(x) -> np.ndarray:
    a = np.asarray(x)
    return a.view(f"u{a.dtype.itemsize}")


@pytest.mark.parametrize(
    "batch,num_heads,num_kv_heads,head_size,block_size,dtype,cache_dtype,bias,causal",
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_torch_op_equals_the_xla_handler_bit_for_bit(
    batch, num_heads, num_kv_heads, head_size, block_size, dtype, cache_dtype, bias, causal,
    rng, monkeypatch,
):  # fmt: skip
    monkeypatch.setenv("JAX_ATTN_CPU_THREADS", "2")  # one work split for both front ends
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    scales = (0.7, 1.3) if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else (1, 1)
    query, kc, vc, meta, _, _ = ragged_case(
        gen, batch, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        block_size=block_size, dtype=dtype, cache_dtype=cache_dtype, k_scale=scales[0],
        v_scale=scales[1],
    )  # fmt: skip
    kwargs = bias_kwargs(bias, num_heads)
    scale = head_size**-0.5
    out = torch.empty_like(query)
    native.ragged_paged_attention(
        out, query, kc, vc, **meta, scale=scale, causal=causal, k_scale=scales[0],
        v_scale=scales[1], **kwargs,
    )  # fmt: skip
    slopes = kwargs.pop("alibi_slopes", None)
    expected = jax_cpu.ragged_paged_attention(
        _jnp(query), _jnp(kc), _jnp(vc), *(_jnp(meta[name]) for name in meta),
        scale=scale, causal=causal, alibi_slopes=None if slopes is None else _jnp(slopes),
        k_scale=float(scales[0]), v_scale=float(scales[1]), **kwargs,
    )  # fmt: skip
    np.testing.assert_array_equal(_bits(_jnp(out)), _bits(expected))


@pytest.mark.parametrize(
    "query,cache,block_size,group",
    [
        ("bfloat16", "auto", 128, 4),
        ("bfloat16", "fp8", 16, 1),
        ("bfloat16", "fp8_e5m2", 48, 8),
        ("bfloat16", "auto", 64, 9),
        ("float32", "auto", 128, 4),
        ("float16", "auto", 16, 4),
    ],
)
def test_both_libraries_name_the_same_split_decode_path(query, cache, block_size, group):
    """`native.split_decode_path` (the torch library) and `cpu.decode_path(..., "split")` (the
    XLA one) ask the same rule of one source: they agree, and float queries never take the
    tiles."""
    cache_dtype = {"auto": query, "fp8": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[cache]
    torch_path = native.split_decode_path(getattr(torch, query), cache, block_size, group)
    xla_path = jax_cpu.decode_path(cache_dtype, query, block_size, group, layout="split")
    assert torch_path == xla_path
    assert torch_path in ("amx", "vector")
    if query != "bfloat16" or block_size == 48:
        assert torch_path == "vector"

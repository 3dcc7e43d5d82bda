"""interop.dlpack: every covered case, zero-copy proven by data pointers where claimed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from interop.dlpack import to_jax, to_torch


def _same_memory(t: torch.Tensor, a: jax.Array) -> bool:
    return t.data_ptr() == a.unsafe_buffer_pointer()


def _values(t: torch.Tensor) -> np.ndarray:
    if t.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        return t.float().numpy()
    return t.numpy()


@pytest.mark.parametrize(
    "dtype",
    [
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.int32,
        torch.bool,
        torch.uint8,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    ],
    ids=str,
)
def test_round_trip_zero_copy(dtype, rng):
    # torch.tensor copies into torch's own (64-byte aligned) allocation
    t = torch.tensor(rng.standard_normal((64, 16)).astype(np.float32) * 4).to(dtype)
    a = to_jax(t)
    assert _same_memory(t, a), "compact aligned tensors must not be copied"
    assert a.shape == (64, 16) and str(a.dtype) == str(dtype).removeprefix("torch.")
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), _values(t).astype(np.float32))
    back = to_torch(a)
    assert back.dtype == dtype and back.data_ptr() == t.data_ptr()


def test_int64_fits_goes_to_int32(rng):
    t = torch.from_numpy(rng.integers(-(2**31), 2**31 - 1, size=100))
    a = to_jax(t)
    assert a.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(a), t.numpy())


def test_int64_overflow_raises():
    t = torch.tensor([1, 2**40])
    with pytest.raises(OverflowError, match="holds 1099511627776, which does not fit int32"):
        to_jax(t)
    with pytest.raises(OverflowError, match=r"holds -2147483649"):
        to_jax(torch.tensor([-(2**31) - 1]))


def test_int64_exact_with_x64():
    t = torch.tensor([1, 2**40, -(2**50)])
    with jax.enable_x64(True):
        a = to_jax(t)
        assert a.dtype == jnp.int64
        assert _same_memory(t, a)
        np.testing.assert_array_equal(np.asarray(a), t.numpy())


def test_transposed_view_zero_copy_and_correct(rng):
    base = torch.tensor(rng.standard_normal((32, 48)).astype(np.float32))
    t = base.t()
    a = to_jax(t)
    assert a.shape == (48, 32) and _same_memory(base, a)
    np.testing.assert_array_equal(np.asarray(a), t.numpy())


def test_non_compact_view_is_copied(rng):
    base = torch.from_numpy(rng.standard_normal((32, 48)).astype(np.float32))
    t = base[:, 3:17]
    a = to_jax(t)
    assert not _same_memory(t, a)
    np.testing.assert_array_equal(np.asarray(a), t.numpy())
    t3 = torch.from_numpy(rng.standard_normal((4, 5, 6)).astype(np.float32)).permute(2, 0, 1)
    np.testing.assert_array_equal(np.asarray(to_jax(t3)), t3.numpy())


def test_misaligned_offset(rng):
    base = torch.from_numpy(rng.standard_normal(1025).astype(np.float32))
    t = base[1:]  # 4 bytes past a 64-byte boundary
    assert t.data_ptr() % 64 != 0
    a = to_jax(t)
    np.testing.assert_array_equal(np.asarray(a), t.numpy())
    base[1] = 123.0  # JAX copied on import: later writes to torch do not show
    assert float(a[0]) != 123.0


def test_requires_grad_is_detached(rng):
    t = torch.randn(8, 4, requires_grad=True)
    a = to_jax(t)
    assert _same_memory(t, a)
    np.testing.assert_array_equal(np.asarray(a), t.detach().numpy())


@pytest.mark.parametrize("shape", [(0,), (0, 4), (3, 0, 2)])
def test_zero_size(shape):
    a = to_jax(torch.zeros(shape, dtype=torch.bfloat16))
    assert a.shape == shape and a.dtype == jnp.bfloat16
    t = to_torch(jnp.zeros(shape, jnp.float32))
    assert tuple(t.shape) == shape and t.dtype == torch.float32


def test_to_torch_zero_copy(rng):
    a = jnp.asarray(rng.standard_normal((16, 8)).astype(np.float32))
    t = to_torch(a)
    assert t.data_ptr() == a.unsafe_buffer_pointer()
    np.testing.assert_array_equal(t.numpy(), np.asarray(a))


def test_type_errors():
    with pytest.raises(TypeError, match=r"to_jax expects a torch\.Tensor, got ndarray"):
        to_jax(np.zeros(3))
    with pytest.raises(TypeError, match=r"to_torch expects a jax\.Array, got Tensor"):
        to_torch(torch.zeros(3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: stream sync test")
def test_cuda_stream_synchronized():
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        t = torch.full((1 << 20,), 3.0, device="cuda")
        t.mul_(2)
        a = to_jax(t)
    assert float(a[-1]) == 6.0

"""interop.dlpack: every covered case; zero-copy is proven by equal data pointers where claimed,
and every copy is checked for values and for not aliasing the source."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from interop.dlpack import (
    FLOAT8_ZERO_COPY,
    copy_reason,
    index_to_jax,
    shares_memory,
    to_jax,
    to_torch,
)

# dtypes that cross both ways unchanged and without a copy
SHARED_DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def _random(rng, shape, dtype: torch.dtype) -> torch.Tensor:
    """Fresh values in torch's own allocation (64-byte aligned), never all zeros."""
    values = torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * 8)
    if dtype == torch.bool:
        return values > 0
    return values.clone().to(dtype)


def _as_f32(x) -> np.ndarray:
    """Values of a torch tensor or JAX array as float32 NumPy (bf16 / fp8 have no NumPy twin)."""
    if isinstance(x, torch.Tensor):
        return x.resolve_conj().to(torch.float32).numpy()
    return np.asarray(x.astype(jnp.float32))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _zero_copy(dtype: torch.dtype) -> bool:
    """float8 crosses DLPack only on torch versions that support it (not 2.8, IPEX's)."""
    return FLOAT8_ZERO_COPY or dtype not in (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.mark.parametrize("dtype", SHARED_DTYPES, ids=_name)
def test_round_trip_is_zero_copy(dtype, rng):
    t = _random(rng, (33, 16), dtype)
    assert copy_reason(t) is None
    a = to_jax(t)
    assert shares_memory(t, a) == _zero_copy(dtype), "compact, aligned: no copy"
    assert a.shape == (33, 16) and np.dtype(a.dtype).name == _name(dtype)
    np.testing.assert_array_equal(_as_f32(a), _as_f32(t))
    back = to_torch(a)
    assert back.dtype == dtype and (back.data_ptr() == t.data_ptr()) == _zero_copy(dtype)
    assert torch.equal(back.to(torch.float32), t.to(torch.float32))


@pytest.mark.parametrize("dtype", SHARED_DTYPES, ids=_name)
def test_to_torch_from_jax_allocation(dtype, rng):
    a = jnp.asarray(rng.standard_normal((7, 5)).astype(np.float32) * 8).astype(dtype=_name(dtype))
    t = to_torch(a)
    assert shares_memory(t, a) == _zero_copy(dtype)
    assert t.dtype == dtype and tuple(t.shape) == (7, 5)
    np.testing.assert_array_equal(_as_f32(t), _as_f32(a))
    c = to_torch(a, copy=True)
    assert not shares_memory(c, a)
    np.testing.assert_array_equal(_as_f32(c), _as_f32(a))


def test_zero_copy_aliases_writes(rng):
    # The documented hazard of zero-copy: torch writes show in the JAX array; copy=True stops it.
    t = _random(rng, (16,), torch.float32)
    shared, private = to_jax(t), to_jax(t, copy=True)
    assert not shares_memory(t, private)
    before = float(t[0])
    t[0] = before + 1
    after = float(t[0])  # before + 1 rounded to float32, as stored
    assert after != before
    assert float(shared[0]) == after and float(private[0]) == before


# --- int64 and the other 64-bit types ---------------------------------------------------------


def test_int64_that_fits_becomes_int32(rng):
    t = torch.from_numpy(rng.integers(-(2**31), 2**31, size=257))
    t[0], t[1] = -(2**31), 2**31 - 1  # both ends of the range
    a = to_jax(t)
    assert a.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(a), t.numpy())


@pytest.mark.parametrize(
    "value, shown", [(2**31, "2147483648"), (-(2**31) - 1, "-2147483649"), (2**40, "1099511627776")]
)
def test_int64_that_does_not_fit_raises(value, shown, rng):
    t = torch.from_numpy(rng.integers(-100, 100, size=50))
    t[17] = value
    with pytest.raises(OverflowError, match=rf"tensor \(int64\) holds {shown}, outside int32"):
        to_jax(t)


def test_int64_exact_with_x64(rng):
    t = torch.from_numpy(rng.integers(-(2**62), 2**62, size=64)).clone()  # torch-aligned
    t[0] = 2**63 - 1
    with jax.enable_x64(True):
        a = to_jax(t)
        assert a.dtype == jnp.int64 and shares_memory(t, a)
        np.testing.assert_array_equal(np.asarray(a), t.numpy())
        assert to_torch(a).data_ptr() == t.data_ptr()


def test_uint64_checked_like_int64():
    ok = torch.tensor([0, 7, 2**32 - 1]).to(torch.uint64)
    a = to_jax(ok)
    assert a.dtype == jnp.uint32
    np.testing.assert_array_equal(np.asarray(a), [0, 7, 2**32 - 1])
    with pytest.raises(OverflowError, match=r"tensor \(uint64\) holds 4294967296, outside uint32"):
        to_jax(torch.tensor([1, 2**32]).to(torch.uint64))
    huge = torch.tensor([-1]).view(torch.uint64)  # 2**64 - 1
    with pytest.raises(OverflowError, match=r"holds 18446744073709551615"):
        to_jax(huge)


@pytest.mark.parametrize("x64", [False, True], ids=["x64-off", "x64-on"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int16, torch.uint8, torch.int32], ids=_name)
def test_index_to_jax_is_int32_exact(dtype, x64, rng):
    """Index tensors (ids, lengths) cross as int32 whatever their dtype and x64 say."""
    info = torch.iinfo(dtype)
    t = torch.from_numpy(rng.integers(max(info.min, -(2**31)), min(info.max, 2**31 - 1), 99))
    t = t.to(dtype)
    with jax.enable_x64(x64):
        a = index_to_jax(t, "block_tables")
    assert a.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(a), t.long().numpy())
    if dtype == torch.int32:
        assert shares_memory(t, a)


@pytest.mark.parametrize("x64", [False, True], ids=["x64-off", "x64-on"])
@pytest.mark.parametrize(
    "value, shown, wrapped",
    [(2**32 + 3, "4294967299", "3"), (2**31, "2147483648", "-2147483648"),
     (-(2**31) - 1, "-2147483649", "2147483647")],
)  # fmt: skip
def test_index_to_jax_past_int32_raises(value, shown, wrapped, x64, rng):
    """A cast would wrap 2**32 + 3 to 3 (a valid-looking id): it raises instead, naming the
    argument, with x64 on as well (where `to_jax` itself would keep int64)."""
    t = torch.from_numpy(rng.integers(0, 100, size=20))
    t[11] = value
    with (
        jax.enable_x64(x64),
        pytest.raises(
            OverflowError,
            match=rf"seq_lens holds {shown}, outside int32 .* a cast would wrap it to {wrapped}$",
        ),
    ):
        index_to_jax(t, "seq_lens")
    big = torch.tensor([2**32 + 3]).to(torch.uint64)
    with pytest.raises(OverflowError, match="slot_mapping holds 4294967299"):
        index_to_jax(big, "slot_mapping")
    with pytest.raises(TypeError, match=r"block_tables must be an integer tensor, got torch"):
        index_to_jax(t.float(), "block_tables")


def test_float64_without_and_with_x64(rng):
    t = torch.from_numpy(rng.standard_normal(40)).clone()
    a = to_jax(t)
    assert a.dtype == jnp.float32  # narrowed explicitly, as jnp.asarray would
    np.testing.assert_array_equal(np.asarray(a), t.numpy().astype(np.float32))
    with jax.enable_x64(True):
        a = to_jax(t)
        assert a.dtype == jnp.float64 and shares_memory(t, a)


# --- views, strides, alignment ----------------------------------------------------------------


def test_transposed_view_is_zero_copy(rng):
    base = _random(rng, (32, 48), torch.float32)
    t = base.t()
    assert not t.is_contiguous() and copy_reason(t) is None
    a = to_jax(t)
    assert a.shape == (48, 32) and shares_memory(base, a)
    np.testing.assert_array_equal(np.asarray(a), t.numpy())
    # Exported back, torch sees the same permuted strides over the same memory.
    back = to_torch(a)
    assert back.data_ptr() == base.data_ptr() and torch.equal(back, t)


@pytest.mark.parametrize("perm", [(2, 0, 1), (1, 0, 2), (2, 1, 0)], ids=str)
def test_permuted_view_is_zero_copy(perm, rng):
    base = _random(rng, (4, 5, 6), torch.bfloat16)
    t = base.permute(*perm)
    a = to_jax(t)
    assert shares_memory(base, a)
    np.testing.assert_array_equal(_as_f32(a), _as_f32(t))
    np.testing.assert_array_equal(_as_f32(jax.jit(lambda x: x * 2)(a)), _as_f32(t * 2))


@pytest.mark.parametrize(
    "view",
    [
        lambda x: x[:, 3:17],  # column slice
        lambda x: x[::2],  # step
        lambda x: x[:, :1].expand(32, 5),  # broadcast (stride 0)
        lambda x: x.t()[5:9, ::3],  # transposed then sliced
    ],
    ids=["column-slice", "step", "expand", "transposed-slice"],
)
def test_non_compact_view_is_copied(view, rng):
    base = _random(rng, (32, 48), torch.float16)
    t = view(base)
    assert copy_reason(t).startswith("non-compact strides")
    a = to_jax(t)
    assert a.unsafe_buffer_pointer() != t.data_ptr()
    np.testing.assert_array_equal(_as_f32(a), _as_f32(t))
    base.fill_(1.0)  # a copy: later torch writes do not show
    assert not bool((a == 1).all())


def test_row_slice_keeping_alignment_is_zero_copy(rng):
    base = _random(rng, (64, 16), torch.float32)  # 64-byte rows
    t = base[5:40]
    assert copy_reason(t) is None and shares_memory(t, to_jax(t))


@pytest.mark.parametrize("offset", [1, 3, 4, 8], ids=lambda o: f"{4 * o}B")
def test_misaligned_offset_is_copied(offset, rng):
    base = _random(rng, (1025,), torch.float32)
    t = base[offset:]
    assert t.data_ptr() % 64 != 0
    assert "not 64-byte aligned" in copy_reason(t)
    a = to_jax(t)
    assert a.unsafe_buffer_pointer() % 64 == 0 and not shares_memory(t, a)
    np.testing.assert_array_equal(np.asarray(a), t.numpy())


def test_misaligned_fp8_bytes_are_copied(rng):
    base = _random(rng, (4, 129), torch.float8_e4m3fn)
    t = base[:, 1:].contiguous()[1:]  # compact rows of 128 bytes, offset 128: aligned
    assert copy_reason(t) is None
    t = base.reshape(-1)[3:]  # offset 3 bytes
    a = to_jax(t)
    assert not shares_memory(t, a)
    np.testing.assert_array_equal(_as_f32(a), _as_f32(t))


def test_conjugate_and_negative_views_are_resolved(rng):
    z = torch.complex(_random(rng, (8,), torch.float32), _random(rng, (8,), torch.float32))
    c = z.conj()
    assert c.is_conj() and "conjugate" in copy_reason(c)
    np.testing.assert_array_equal(np.asarray(to_jax(c)), np.conj(z.numpy()))
    n = c.imag  # a negative-bit view with stride 2
    np.testing.assert_array_equal(np.asarray(to_jax(n)), -z.imag.numpy())


# --- autograd, sizes, devices, errors ---------------------------------------------------------


def test_requires_grad_is_detached_without_copy(rng):
    t = _random(rng, (8, 4), torch.float32).requires_grad_()
    a = to_jax(t)
    assert shares_memory(t, a) and t.requires_grad  # the caller's tensor is untouched
    np.testing.assert_array_equal(np.asarray(a), t.detach().numpy())
    y = (t * 3).sum(0)  # a non-leaf with a graph
    np.testing.assert_array_equal(np.asarray(to_jax(y)), y.detach().numpy())


@pytest.mark.parametrize("shape", [(0,), (0, 4), (3, 0, 2)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int64, torch.bool], ids=_name)
def test_zero_size(shape, dtype):
    a = to_jax(torch.empty(shape, dtype=dtype))
    expected = "int32" if dtype == torch.int64 else _name(dtype)
    assert a.shape == shape and np.dtype(a.dtype).name == expected
    t = to_torch(jnp.zeros(shape, dtype=jnp.float32))
    assert tuple(t.shape) == shape and t.dtype == torch.float32
    assert to_jax(torch.empty(4, 0).t()).shape == (0, 4)


def test_scalar(rng):
    t = torch.tensor(float(rng.standard_normal()))
    a = to_jax(t)
    assert a.shape == () and float(a) == float(t)
    assert to_torch(a).shape == ()


def test_errors():
    with pytest.raises(TypeError, match=r"tensor must be a torch\.Tensor, got ndarray"):
        to_jax(np.zeros(3))
    with pytest.raises(ValueError, match=r"tensor\.layout=torch\.sparse_coo must be"):
        to_jax(torch.eye(3).to_sparse())
    with pytest.raises(ValueError, match=r"tensor\.device=meta must be a cpu or cuda device"):
        to_jax(torch.empty(3, device="meta"))
    with pytest.raises(TypeError, match=r"array must be a jax\.Array, got Tensor"):
        to_torch(torch.zeros(3))
    with pytest.raises(TypeError, match="got a tracer"):
        jax.jit(to_torch)(jnp.ones(3))
    gone = jnp.ones(3)
    gone.delete()
    with pytest.raises(ValueError, match="array was deleted"):
        to_torch(gone)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch)")
def test_cuda_streams_are_synchronized():
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("needs a JAX GPU backend")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t = torch.full((1 << 24,), 3.0, device="cuda")
        for _ in range(20):  # keep the stream busy so an unsynchronized read would see 3.0
            t.mul_(2).div_(2)
        t.mul_(2)
        a = to_jax(t)
    assert shares_memory(t, a)
    assert float(a[-1]) == 6.0 and float(a.min()) == 6.0
    back = to_torch(a * 2)
    assert back.is_cuda and float(back[0]) == 12.0

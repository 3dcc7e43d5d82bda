"""Cache ops: shape, slot-mapped writes (pads, fp8 saturation), block copies and swaps."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_attn


def test_kv_cache_shape():
    assert jax_attn.kv_cache_shape(10, 16, 2, 64) == (10, 16, 2, 64)
    with pytest.raises(ValueError, match="block_size=0 must be a positive int"):
        jax_attn.kv_cache_shape(10, 0, 2, 64)


@settings(max_examples=40, deadline=None)
@given(
    num_blocks=st.integers(1, 6),
    block_size=st.sampled_from([1, 2, 8]),
    data=st.data(),
)
def test_write_kv_changes_exactly_the_named_slots(num_blocks, block_size, data):
    num_slots = num_blocks * block_size
    # Distinct real slots (a serving engine never writes one slot twice in a step) and pads.
    real = data.draw(st.lists(st.integers(0, num_slots - 1), unique=True, max_size=num_slots))
    pads = data.draw(st.integers(0, 4))
    slots = np.array(real + [-1] * pads, np.int32)
    np.random.default_rng(data.draw(st.integers(0, 2**31))).shuffle(slots)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    shape = (num_blocks, block_size, 2, 4)
    kc = rng.standard_normal(shape).astype(np.float32)
    vc = rng.standard_normal(shape).astype(np.float32)
    k = rng.standard_normal((slots.size, 2, 4)).astype(np.float32)
    v = rng.standard_normal((slots.size, 2, 4)).astype(np.float32)

    new_k, new_v = jax_attn.write_kv(
        jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots)
    )
    expected_k, expected_v = kc.reshape(num_slots, 2, 4).copy(), vc.reshape(num_slots, 2, 4).copy()
    for t, slot in enumerate(slots):
        if slot >= 0:
            expected_k[slot], expected_v[slot] = k[t], v[t]
    np.testing.assert_array_equal(np.asarray(new_k).reshape(num_slots, 2, 4), expected_k)
    np.testing.assert_array_equal(np.asarray(new_v).reshape(num_slots, 2, 4), expected_v)


def test_pad_slot_does_not_write_the_last_slot(rng):
    """JAX wraps -1 to the last index even with mode='drop': the pad must not land there."""
    kc = jnp.asarray(rng.standard_normal((2, 4, 1, 8)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((1, 1, 8)).astype(np.float32))
    new_k, _ = jax_attn.write_kv(kc, kc, x, x, jnp.asarray([-1], jnp.int32))
    np.testing.assert_array_equal(np.asarray(new_k), np.asarray(kc))


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_write_saturates_and_scales(dtype, rng):
    x = rng.standard_normal((6, 2, 8)).astype(np.float32) * 50
    x[0, 0, 0] = 1e6  # beyond fp8's range: saturates, never inf/NaN
    x[0, 0, 1] = -1e6
    kc = jnp.zeros((1, 8, 2, 8), dtype)
    scale = 0.8
    new_k, new_v = jax_attn.write_kv(
        kc,
        kc,
        jnp.asarray(x),
        jnp.asarray(-x),
        jnp.arange(6, dtype=jnp.int32),
        k_scale=scale,
        v_scale=2.0,
    )
    np_dtype = np.dtype(dtype)
    finfo = ml_dtypes.finfo(np_dtype)
    expected = np.clip(x / np.float32(scale), float(finfo.min), float(finfo.max)).astype(np_dtype)
    stored = np.asarray(new_k[0, :6])
    assert np.isfinite(stored.astype(np.float32)).all()
    np.testing.assert_array_equal(stored.astype(np.float32), expected.astype(np.float32))
    assert stored[0, 0, 0].astype(np.float32) == float(finfo.max)
    expected_v = np.clip(-x / np.float32(2.0), float(finfo.min), float(finfo.max)).astype(np_dtype)
    np.testing.assert_array_equal(
        np.asarray(new_v[0, :6]).astype(np.float32), expected_v.astype(np.float32)
    )


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("scale", [0.42, 0.57, 1.3, 3.7e-3])
def test_fp8_write_rounds_the_ieee_quotient(dtype, scale, rng):
    """`x / scale` as IEEE float32 division rounds it (NumPy, torch), bit for bit, under jit:
    XLA:CPU's own float32 division is an ulp off for a quarter to half of these values, and
    an ulp across a tie moves the fp8 value a whole step (-0.170625 / 0.42 in e5m2: found by
    `jax-attn fuzz`)."""
    n = 1 << 16
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-12, 12, n))).astype(np.float32)
    x[:3] = [-0.170625, 0.0, -0.0]
    kc = jnp.zeros((n // 16, 16, 1, 1), dtype)
    write = jax.jit(jax_attn.write_kv, static_argnames=("k_scale", "v_scale"))
    new_k, _ = write(kc, kc, jnp.asarray(x)[:, None, None], jnp.asarray(x)[:, None, None],
                     jnp.arange(n, dtype=jnp.int32), k_scale=scale, v_scale=scale)  # fmt: skip
    finfo = ml_dtypes.finfo(np.dtype(dtype))
    quotient = x / np.float32(scale)
    expected = np.clip(quotient, float(finfo.min), float(finfo.max)).astype(np.dtype(dtype))
    stored = np.asarray(new_k).reshape(-1)
    np.testing.assert_array_equal(stored.view(np.uint8), expected.view(np.uint8))


def test_write_kv_under_jit_with_donation(rng):
    kc = jnp.asarray(rng.standard_normal((4, 8, 2, 16)).astype(np.float32))
    vc = kc + 1
    step = jax.jit(jax_attn.write_kv, donate_argnums=(0, 1))
    x = jnp.asarray(rng.standard_normal((3, 2, 16)).astype(np.float32))
    expected = np.asarray(kc).reshape(32, 2, 16).copy()
    expected[[5, 31, 0]] = np.asarray(x)
    new_k, _ = step(kc, vc, x, x, jnp.asarray([5, 31, 0], jnp.int32))
    np.testing.assert_array_equal(np.asarray(new_k).reshape(32, 2, 16), expected)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(key=np.zeros((3, 3, 16), np.float32)), r"key/value must be \[num_tokens, 2, 16\]"),
        (dict(slots=np.zeros((2,), np.int32)), "slot_mapping has 2 entries but key has 3"),
        (dict(slots=np.zeros((3,), np.float32)), "slot_mapping.dtype=float32 must be an integer"),
        (dict(cache=np.zeros((4, 8, 2, 16), np.int8)), "not a supported cache dtype"),
    ],
)
def test_write_kv_errors(bad, match):
    cache = jnp.asarray(bad.get("cache", np.zeros((4, 8, 2, 16), np.float32)))
    key = jnp.asarray(bad.get("key", np.zeros((3, 2, 16), np.float32)))
    slots = jnp.asarray(bad.get("slots", np.zeros((3,), np.int32)))
    with pytest.raises((ValueError, TypeError), match=match):
        jax_attn.write_kv(cache, cache, key, key, slots)


def test_copy_blocks_reads_before_writing(rng):
    kc = rng.standard_normal((5, 4, 1, 8)).astype(np.float32)
    vc = rng.standard_normal((5, 4, 1, 8)).astype(np.float32)
    pairs = np.array([[0, 1], [1, 2], [4, 3]], np.int32)  # a chain: 2 gets the old 1
    new_k, new_v = jax_attn.copy_blocks(jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(pairs))
    exp_k, exp_v = kc.copy(), vc.copy()
    exp_k[[1, 2, 3]], exp_v[[1, 2, 3]] = kc[[0, 1, 4]], vc[[0, 1, 4]]
    np.testing.assert_array_equal(np.asarray(new_k), exp_k)
    np.testing.assert_array_equal(np.asarray(new_v), exp_v)


def test_swap_blocks(rng):
    src = rng.standard_normal((6, 4, 2, 8)).astype(np.float32)
    dst = rng.standard_normal((3, 4, 2, 8)).astype(np.float32)
    pairs = np.array([[5, 0], [2, 2]], np.int32)
    out = jax_attn.swap_blocks(jnp.asarray(src), jnp.asarray(dst), jnp.asarray(pairs))
    expected = dst.copy()
    expected[[0, 2]] = src[[5, 2]]
    np.testing.assert_array_equal(np.asarray(out), expected)
    with pytest.raises(ValueError, match="must agree except in num_blocks"):
        jax_attn.swap_blocks(jnp.asarray(src), jnp.zeros((3, 4, 2, 4)), jnp.asarray(pairs))


def test_swap_blocks_across_memory_kinds(rng):
    """Device memory -> pinned host memory (both exist on GPU and, in recent JAX, on CPU)."""
    device = jax.devices()[0]
    kinds = {m.kind for m in device.addressable_memories()}
    if "pinned_host" not in kinds:
        pytest.skip(
            f"{device.platform} has memory kinds {sorted(kinds)}; no pinned_host to swap to"
        )
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    src = jnp.asarray(rng.standard_normal((4, 2, 1, 8)).astype(np.float32))
    dst = jax.device_put(jnp.zeros((2, 2, 1, 8), jnp.float32), host)
    out = jax_attn.swap_blocks(src, dst, jnp.asarray([[3, 1]], jnp.int32))
    assert out.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(out)[1], np.asarray(src)[3])

"""The one tolerance table, keyed by dtype name, for every comparison with the float64 oracle.

`atol`/`rtol` apply to outputs whose inputs are O(1) random normals; a comparison takes the
loosest row among the dtypes that touch the data (query and cache).

The fp8 rows cover only what the oracle does not model. The oracle reads the K/V exactly as an
fp8 cache stores them (`workload.round_to`: x / scale in float32, saturated, cast), so what is
left is the dequantized K/V rounded into a 16-bit compute dtype (float16: 2^-11 relative, seen
at 2.4e-3 on TORCH_SDPA's float16 path) and the attention's own arithmetic. A backend that
attends over the new tokens' unrounded K/V is off by an fp8 step (measured 0.12-0.14 for
e4m3, 0.20-0.32 for e5m2, which the old rows 0.125 / 0.25 let through) and now fails
(tests/jax/test_reliability_fp8.py).
"""

TOLERANCES: dict[str, tuple[float, float]] = {
    #                atol   rtol
    "float64": (1e-10, 1e-10),
    "float32": (2e-5, 2e-5),
    "float16": (2e-3, 2e-3),
    "bfloat16": (1.6e-2, 1.6e-2),
    "float8_e4m3fn": (4e-3, 4e-3),  # what the oracle does not model: see above
    "float8_e5m2": (4e-3, 4e-3),
}


def dtype_name(dtype) -> str:
    """'float32' for numpy/jax dtypes and for torch dtypes (torch.float32 -> 'float32')."""
    name = getattr(dtype, "name", None) or str(dtype)
    return name.removeprefix("torch.")


def tolerance(*dtypes) -> tuple[float, float]:
    """The loosest (atol, rtol) among the given dtypes."""
    pairs = [TOLERANCES[dtype_name(d)] for d in dtypes if d is not None]
    return max(p[0] for p in pairs), max(p[1] for p in pairs)


def max_error(actual, expected) -> float:
    import numpy as np

    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    return float(np.max(np.abs(a - e))) if a.size else 0.0


def assert_close(actual, expected, *dtypes, what: str = "output") -> None:
    import numpy as np

    atol, rtol = tolerance(*dtypes)
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert np.all(np.isfinite(a)), (
        f"{what}: non-finite values at {np.argwhere(~np.isfinite(a))[:5]}"
    )
    np.testing.assert_allclose(a, e, atol=atol, rtol=rtol, err_msg=what)

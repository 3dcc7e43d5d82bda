"""The one tolerance table, keyed by dtype name, for every comparison with the float64 oracle.

`atol`/`rtol` apply to outputs whose inputs are O(1) random normals; a comparison takes the
loosest row among the dtypes that touch the data (query and cache).

An fp8 cache: the oracle reads the K/V exactly as the cache stores them (`workload.round_to`:
x / scale in float32, saturated, cast), so what it does not model is the dequantized K/V
rounded into the compute (query) dtype, once more: `tolerance` gives the query dtype's row,
doubled (the fp8 rows below are that for a float32 query). Seen by the fuzzer: float16 over
e4m3 on TORCH_SDPA 2.4e-3 (float16's row is 2e-3), bfloat16 over e4m3 on XFORMERS 1.9e-2
(bfloat16's is 1.6e-2). A backend that attends over the new tokens' unrounded K/V is off by
an fp8 step (measured 0.12-0.14 for e4m3, 0.20-0.32 for e5m2, which the old rows keyed to the
cache dtype, 0.125 / 0.25, let through) and now fails (tests/jax/test_reliability_fp8.py).
"""

TOLERANCES: dict[str, tuple[float, float]] = {
    #                atol   rtol
    "float64": (1e-10, 1e-10),
    "float32": (2e-5, 2e-5),
    "float16": (2e-3, 2e-3),
    "bfloat16": (1.6e-2, 1.6e-2),
    "float8_e4m3fn": (4e-5, 4e-5),  # float32 query over an fp8 cache: see above
    "float8_e5m2": (4e-5, 4e-5),
}


def dtype_name(dtype) -> str:
    """'float32' for numpy/jax dtypes and for torch dtypes (torch.float32 -> 'float32')."""
    name = getattr(dtype, "name", None) or str(dtype)
    return name.removeprefix("torch.")


def tolerance(*dtypes) -> tuple[float, float]:
    """The loosest (atol, rtol) among the given dtypes; with an fp8 cache among them, the
    loosest of the others (float32 if none) doubled (see the module docstring)."""
    names = [dtype_name(d) for d in dtypes if d is not None]
    fp8 = [n for n in names if n.startswith("float8")]
    others = [n for n in names if not n.startswith("float8")] or ["float32"]
    atol = max(TOLERANCES[n][0] for n in others)
    rtol = max(TOLERANCES[n][1] for n in others)
    return (2 * atol, 2 * rtol) if fp8 else (atol, rtol)


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

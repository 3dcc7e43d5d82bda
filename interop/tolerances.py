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

16-bit queries (and fp8 caches under them) are held to a bound that scales with the output
(issue 22), not the absolute rows below: attention over N keys averages N values, so its
outputs shrink like 1 / sqrt(N) (about 0.04 at 513 keys) while bfloat16's absolute row is
1.6e-2, and one dropped key of 513 (5.7e-3) passed. `error_bound` gives, per element,

    |actual - expected| <= u * |expected| + SCALED_K * u * rms(expected row) + u * 1e-3

with u the dtype's unit roundoff (bfloat16 2^-8, float16 2^-11; doubled over an fp8 cache as
above) and the row the last axis (head_size; a torch backend's [T, Hq * D] row spans the
heads of one token). The first term is the output's own rounding; the second what rounding
inside the kernel (16-bit logits, probabilities or values) leaves, which is a rounding-sized
fraction of the row's magnitude; the last keeps exact-zero rows (all keys masked) exact up to
a negligible floor. Rounding a logit l to 16 bits moves it by u |l| and the output by about
that fraction of the row, so logits up to ~10 (scale times |q||k|) need SCALED_K = 8; the
fuzzer's kept 16-bit-over-fp8 cases (tests/fuzz) reach 0.5 of the bound. One dropped key of
513 moves elements by ~p_k |v_k| (5e-3 - 2.6e-2 at bfloat16 over 32 heads of 128 dims),
above 8 u rms + u |e| (~3e-3): it fails (tests/jax/test_tolerance_scaling.py; 12 seeds:
the dropped key at 6.5-45x the bound, the right answer at 0.2-0.3 of it). float32 and float64
keep their absolute rows, which are already below one key's share.

This is the rule for every comparison against the oracle or a peer: the cross-check, the
tests, the bench's output check, the sharded cases, the vLLM conformance tests. Against a
peer (another implementation's output, itself rounded: the bench's jax-xla, vLLM's own
backend, the one-device run of a sharded step) instead of the float64 oracle, `peer=True`
doubles the bound: each side is within its bound of the oracle, so their difference is within
the two bounds added, and the bound at the peer's output is the oracle's up to a rounding of a
rounding. One dropped key of 513 stays outside it (bfloat16, the same 12 seeds: 3.0-25x the
doubled bound, rows per head or per token).
`tests/packaging/test_tolerance_rule.py` refuses a comparison with tolerances of its own.
An engine's logprobs are not an attention output (linear layers, norms and a log-softmax in
the model's dtype lie between): tests/torch/test_vllm_v1_engine.py holds the plugin's bf16 to
vLLM's own bf16 distance from vLLM's f32 run, measured in the same test.
"""

import numpy as np

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


# Unit roundoff of the 16-bit compute dtypes held to the scaled bound.
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
# Multiples of u * rms(row): see the module docstring. 8: the worst cases the fuzzer kept
# (16-bit queries over fp8 caches: the dequantized keys and values rounded to the query dtype,
# logits ~ 10) reach ~9 u rms, inside the doubled fp8 bound's 16 u rms with room.
SCALED_K = 8.0


def scaled_roundoff(*dtypes) -> float | None:
    """u for the scaled bound (the loosest 16-bit dtype among the non-fp8 ones, doubled with
    an fp8 cache), or None when the absolute rows apply (float32 / float64 compute)."""
    names = [dtype_name(d) for d in dtypes if d is not None]
    fp8 = any(n.startswith("float8") for n in names)
    sixteen = [UNIT_ROUNDOFF[n] for n in names if n in UNIT_ROUNDOFF]
    if not sixteen:
        return None
    return max(sixteen) * (2 if fp8 else 1)


def error_bound(expected, *dtypes, peer: bool = False) -> np.ndarray:
    """The allowed |actual - expected| per element of `expected` (the float64 oracle's output,
    or with `peer=True` another implementation's) for a computation in `dtypes`: the scaled
    bound for 16-bit dtypes, else the absolute row `atol + rtol * |expected|`; doubled against
    a peer (see the module docstring)."""
    e = np.abs(np.asarray(expected, dtype=np.float64))
    u = scaled_roundoff(*dtypes)
    sides = 2.0 if peer else 1.0
    if u is None:
        atol, rtol = tolerance(*dtypes)
        return sides * (atol + rtol * e)
    if e.ndim == 0 or e.size == 0:
        return sides * (u * e + u * 1e-3)
    rms = np.sqrt(np.mean(np.where(np.isfinite(e), e, 0.0) ** 2, axis=-1, keepdims=True))
    return sides * (u * e + SCALED_K * u * rms + u * 1e-3)


def bound_ratio(actual, expected, *dtypes, peer: bool = False) -> float:
    """The worst |actual - expected| / `error_bound` over the elements (<= 1: within); inf
    where `actual` is not finite or the shapes differ, 0 for empty arrays."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape or not np.all(np.isfinite(a)):
        return float("inf")
    if a.size == 0:
        return 0.0
    ratio = np.abs(a - e) / error_bound(e, *dtypes, peer=peer)
    return float(np.max(np.where(np.isnan(ratio), np.inf, ratio)))


def within(actual, expected, *dtypes, peer: bool = False) -> bool:
    """Whether `actual` is finite and every element within `error_bound` of `expected`."""
    return bound_ratio(actual, expected, *dtypes, peer=peer) <= 1.0


def max_error(actual, expected) -> float:
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    return float(np.max(np.abs(a - e))) if a.size else 0.0


def assert_close(actual, expected, *dtypes, what: str = "output", peer: bool = False) -> None:
    """`actual` within `error_bound(expected, *dtypes, peer=peer)` everywhere (and finite)."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert np.all(np.isfinite(a)), (
        f"{what}: non-finite values at {np.argwhere(~np.isfinite(a))[:5]}"
    )
    bound = error_bound(e, *dtypes, peer=peer)
    err = np.abs(a - e)
    bad = ~(err <= bound)
    if np.any(bad):
        worst = np.unravel_index(np.argmax(np.where(bad, err / bound, 0.0)), err.shape)
        against = "; against a peer: doubled" if peer else ""
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.size} elements beyond the error bound "
            f"({', '.join(map(dtype_name, dtypes))}{against}); max |error| {err.max():.3g}; "
            f"worst at {tuple(int(i) for i in worst)}: {a[worst]:.6g} vs {e[worst]:.6g}, "
            f"|error| {err[worst]:.3g} > bound {bound[worst]:.3g}"
        )

"""The tests' handle on the one tolerance table, which ships in `interop.tolerances` (the
cross-check harness and the bench use the same one): `from tolerances import assert_close`."""

from interop.tolerances import (
    TOLERANCES,
    assert_close,
    bound_ratio,
    dtype_name,
    error_bound,
    max_error,
    tolerance,
    within,
)

__all__ = [
    "TOLERANCES",
    "assert_close",
    "bound_ratio",
    "dtype_name",
    "error_bound",
    "max_error",
    "tolerance",
    "within",
]

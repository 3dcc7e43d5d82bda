"""The cross-check harness: one random workload through every backend, each against float64.

A `Spec` names a workload (ragged batch shape, heads, dtypes, biases, attention type);
`make_problem` draws it with NaN-poisoned unused cache memory and computes the NumPy float64
oracle once; `check_cell` runs one backend on it and reports the max absolute error and
whether it is within the tolerance of the workload's dtypes (`interop.tolerances`).

Modules: `interop.harness` (Spec, Problem, Backend, Cell, check_cell), the runners
`interop.jax_runners` and `interop.torch_runners` (built on the harness only), and this module,
which puts them together: `all_backends()` and the default grid `default_specs()`.
Importing it needs neither JAX nor torch (each backend says why it does not run here).
"""

from interop.harness import (
    Backend,
    Cell,
    Problem,
    Spec,
    Unsupported,
    check_cell,
    make_problem,
)
from interop.jax_runners import JAX_BACKENDS
from interop.tolerances import TOLERANCES
from interop.torch_runners import TORCH_BACKENDS
from torch_backends.attention_type import AttentionType

__all__ = [
    "JAX_BACKENDS",
    "TOLERANCES",
    "TORCH_BACKENDS",
    "AttentionType",
    "Backend",
    "Cell",
    "Problem",
    "Spec",
    "Unsupported",
    "all_backends",
    "check_cell",
    "default_specs",
    "make_problem",
]


def all_backends() -> list[Backend]:
    """Every backend this installation knows, available or not."""
    return [*JAX_BACKENDS, *TORCH_BACKENDS]


def default_specs(quick: bool = False) -> list[Spec]:
    """The grid of `jax-attn check`; names stay <= 9 characters (they label the table's rows)."""
    specs = [
        Spec("mixed", (17, 1, 3, 1), (0, 31, 14, 40), scale=0.1),
        Spec("dec-alibi", (1, 1, 1), (0, 16, 200), alibi=True, num_heads=8, num_kv_heads=2),
        # Chunks and decodes whose first blocks lie wholly before their windows (freed: NaN).
        Spec("chunk-win", (5, 9, 1, 1), (30, 7, 40, 23), sliding_window=12, block_size=8),
        Spec(
            "cap-bf16",
            (6, 1, 1),
            (0, 20, 33),
            logits_soft_cap=8.0,
            dtype="bfloat16",
            head_size=128,
            num_heads=4,
            num_kv_heads=4,
        ),
        Spec(
            "fp8-e4m3",
            (3, 1),
            (13, 50),
            dtype="bfloat16",
            cache_dtype="float8_e4m3fn",
            block_size=8,
        ),
        Spec("fp8-e5m2", (1, 4), (27, 0), cache_dtype="float8_e5m2", num_heads=8, num_kv_heads=1),
        Spec("encoder", (7, 3), (0, 0), attn_type=AttentionType.ENCODER, alibi=True, scale=0.2),
        Spec(
            "enc-only",
            (9, 2),
            (0, 0),
            attn_type=AttentionType.ENCODER_ONLY,
            scale=0.09,
            head_size=80,
            num_heads=4,
            num_kv_heads=4,
        ),
        Spec("cross", (3, 1), (9, 11), attn_type=AttentionType.ENCODER_DECODER),
    ]
    return specs[:4] if quick else specs

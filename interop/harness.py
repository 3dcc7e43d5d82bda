"""The cross-check harness's pieces: a workload `Spec`, the drawn `Problem`, a `Backend`, and
`check_cell`, one backend's output on one problem against the float64 oracle.

`interop.crosscheck` assembles them (the backends, the default grid); the runners
(`interop.jax_runners`, `interop.torch_runners`) build on this module and nothing else of the
harness, so the imports point one way. Importing it needs neither JAX nor torch.
"""

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from interop.tolerances import error_bound, tolerance
from torch_backends.attention_type import AttentionType

if TYPE_CHECKING:
    from interop.workload import Workload


_SHORT_DTYPES = {
    "float64": "f64",
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "float8_e4m3fn": "e4m3",
    "float8_e5m2": "e5m2",
}


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str  # short (it labels a row of the `jax-attn check` table): <= 9 characters
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    num_heads: int = 8
    num_kv_heads: int = 2
    head_size: int = 64
    block_size: int = 16
    dtype: str = "float32"
    cache_dtype: str | None = None
    alibi: bool = False
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    attn_type: AttentionType = AttentionType.DECODER
    scale: float | None = None  # softmax scale; None: head_size ** -0.5

    @property
    def softmax_scale(self) -> float:
        return self.head_size**-0.5 if self.scale is None else self.scale

    @property
    def causal(self) -> bool:
        return self.attn_type is AttentionType.DECODER

    @property
    def fp8(self) -> bool:
        return self.cache_dtype is not None and self.cache_dtype.startswith("float8")

    @property
    def tolerance(self) -> tuple[float, float]:
        return tolerance(self.dtype, self.cache_dtype)  # the table's row (check_cell: error_bound)

    def describe(self) -> str:
        lens = "+".join(
            f"{q}/{q + c}" for q, c in zip(self.query_lens, self.context_lens, strict=True)
        )
        dtypes = [self.dtype] + ([self.cache_dtype] if self.cache_dtype else [])
        extras = [
            "/".join(_SHORT_DTYPES.get(d, d) for d in dtypes),
            f"Hq{self.num_heads}/Hkv{self.num_kv_heads} D{self.head_size}",
        ]
        extras += [
            x
            for x, on in (
                ("alibi", self.alibi),
                (f"win{self.sliding_window}", self.sliding_window),
                (f"cap{self.logits_soft_cap}", self.logits_soft_cap),
            )
            if on
        ]
        return f"{self.attn_type.value}: q/kv {lens}, " + ", ".join(extras)


@dataclasses.dataclass(frozen=True)
class Problem:
    """A drawn workload plus what every backend needs to run it."""

    spec: Spec
    workload: "Workload"
    alibi_slopes: np.ndarray | None
    expected: np.ndarray  # float64 [T, Hq, D]

    @property
    def bias(self) -> dict:
        return dict(
            causal=self.spec.causal,
            alibi_slopes=self.alibi_slopes,
            sliding_window=self.spec.sliding_window,
            logits_soft_cap=self.spec.logits_soft_cap,
        )


class Unsupported(Exception):
    """A backend cannot run this workload (a documented limitation, not a failure)."""


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    why_unavailable: Callable[[], str | None]  # None when it runs here
    run: Callable[[Problem], np.ndarray]
    label: str | None = None  # column header in `jax-attn check` (<= 7 characters); else name

    @property
    def short(self) -> str:
        return self.label or self.name


def make_problem(spec: Spec, rng: np.random.Generator) -> Problem:
    from interop.workload import dense_reference, make_workload
    from jax_attn.bias import alibi_slopes

    # For cache-less types `context_lens` is the key length minus the query length: the
    # encoder's extra tokens for cross attention, zero for encoders.
    scales = (0.42, 0.57) if spec.fp8 else (1.0, 1.0)
    w = make_workload(
        rng,
        list(spec.query_lens),
        list(spec.context_lens),
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        block_size=spec.block_size,
        dtype=spec.dtype,
        cache_dtype=spec.cache_dtype,
        k_scale=scales[0],
        v_scale=scales[1],
        # A decoder's blocks before its window freed, as vLLM's engines free them (NaN behind
        # null-block table entries): no backend may read them into an output.
        free_before_window=spec.sliding_window if spec.causal else None,
    )
    slopes = alibi_slopes(spec.num_heads) if spec.alibi else None
    expected = dense_reference(
        w,
        scale=spec.softmax_scale,
        causal=spec.causal,
        alibi_slopes=slopes,
        sliding_window=spec.sliding_window,
        logits_soft_cap=spec.logits_soft_cap,
    )
    return Problem(spec, w, slopes, expected)


@dataclasses.dataclass(frozen=True)
class Cell:
    """One backend on one workload."""

    error: float | None  # max |out - float64 oracle|; None when it did not run
    ok: bool
    note: str = ""  # why it did not run, or the exception


def check_cell(backend: Backend, problem: Problem) -> Cell:
    try:
        out = backend.run(problem)
    except Unsupported as e:
        return Cell(None, True, f"n/a: {e}")
    except Exception as e:  # a crash is a failure, reported in the table
        return Cell(None, False, f"{type(e).__name__}: {e}")
    expected = problem.expected
    if out.shape != expected.shape:
        return Cell(None, False, f"shape {out.shape} != {expected.shape}")
    if not np.isfinite(out).all():
        return Cell(float("nan"), False, "non-finite output")
    error = float(np.max(np.abs(out - expected))) if out.size else 0.0
    spec = problem.spec
    ok = bool(np.all(np.abs(out - expected) <= error_bound(expected, spec.dtype, spec.cache_dtype)))
    return Cell(error, ok)

"""The cross-check harness: one random workload through every backend, each against float64.

A `Spec` names a workload (ragged batch shape, heads, dtypes, biases, attention type); `run`
draws it with NaN-poisoned unused cache memory, computes the NumPy float64 oracle once, runs
each available backend on the same data and reports the max absolute error and whether it is
within the tolerance of the workload's dtypes.

Backends register as `Backend(name, why_unavailable, run)`; the JAX ones live here, the torch
ones are added by `interop.torch_runners` when torch is importable.
"""

import dataclasses
import enum
import importlib
import importlib.util
from collections.abc import Callable

import numpy as np

from jax_attn.workload import Workload, dense_reference, make_workload

# (atol, rtol) by the lowest-precision dtype that touches the data; same table as the tests.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-10, 1e-10),
    "float32": (2e-5, 2e-5),
    "float16": (2e-3, 2e-3),
    "bfloat16": (1.6e-2, 1.6e-2),
    "float8_e4m3fn": (1.25e-1, 1.25e-1),
    "float8_e5m2": (2.5e-1, 2.5e-1),
}


class AttnType(enum.Enum):
    DECODER = "decoder"  # paged, causal, mixed prefill/decode
    ENCODER = "encoder"  # no cache, bidirectional (encoder of an encoder/decoder model)
    ENCODER_ONLY = "encoder_only"  # no cache, bidirectional (BERT-like)
    ENCODER_DECODER = "cross"  # decoder queries over the encoder's keys, non-causal


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str
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
    attn_type: AttnType = AttnType.DECODER
    scale: float | None = None  # softmax scale; None: head_size ** -0.5

    @property
    def softmax_scale(self) -> float:
        return self.head_size**-0.5 if self.scale is None else self.scale

    @property
    def causal(self) -> bool:
        return self.attn_type is AttnType.DECODER

    @property
    def fp8(self) -> bool:
        return self.cache_dtype is not None and self.cache_dtype.startswith("float8")

    @property
    def tolerance(self) -> tuple[float, float]:
        names = [self.dtype] + ([self.cache_dtype] if self.cache_dtype else [])
        return max(TOLERANCES[n][0] for n in names), max(TOLERANCES[n][1] for n in names)

    def describe(self) -> str:
        lens = "+".join(
            f"{q}/{q + c}" for q, c in zip(self.query_lens, self.context_lens, strict=True)
        )
        extras = [
            self.dtype if not self.cache_dtype else f"{self.dtype}/{self.cache_dtype}",
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
    workload: Workload
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


def make_problem(spec: Spec, rng: np.random.Generator) -> Problem:
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


# ---------------------------------------------------------------------------------------------
# JAX backends


def _jax_paged(impl: str) -> Callable[[Problem], np.ndarray]:
    def run(p: Problem) -> np.ndarray:
        import jax.numpy as jnp

        import jax_attn

        w, spec = p.workload, p.spec
        if spec.attn_type is not AttnType.DECODER:
            return _jax_varlen(p, impl)
        md = w.metadata()
        kc, vc = jax_attn.write_kv(
            jnp.asarray(w.key_cache),
            jnp.asarray(w.value_cache),
            jnp.asarray(w.new_key),
            jnp.asarray(w.new_value),
            md.slot_mapping,
            k_scale=w.k_scale,
            v_scale=w.v_scale,
        )
        bias = dict(p.bias)
        slopes = bias.pop("alibi_slopes")
        out = jax_attn.paged_attention(
            jnp.asarray(w.query),
            kc,
            vc,
            md,
            impl=impl,
            scale=p.spec.softmax_scale,
            k_scale=w.k_scale,
            v_scale=w.v_scale,
            alibi_slopes=None if slopes is None else jnp.asarray(slopes),
            **bias,
        )
        return np.asarray(out.astype(jnp.float32), np.float64)

    return run


def _jax_varlen(p: Problem, impl: str) -> np.ndarray:
    """Encoder / encoder-only / cross attention: dense varlen over the sequences' keys."""
    import jax
    import jax.numpy as jnp

    import jax_attn

    w = p.workload
    keys = np.concatenate(w.keys).astype(w.query.dtype)
    values = np.concatenate(w.values).astype(w.query.dtype)
    cu_q = np.concatenate([[0], np.cumsum(w.query_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(w.seq_lens)]).astype(np.int32)
    bias = dict(p.bias)
    slopes = bias.pop("alibi_slopes")
    args = (
        jnp.asarray(w.query),
        jnp.asarray(keys),
        jnp.asarray(values),
        jnp.asarray(cu_q),
        jnp.asarray(cu_k),
    )
    if impl == "reference":
        with jax.enable_x64(True):
            out = jax_attn.reference.varlen_attention(
                *args, scale=p.spec.softmax_scale, alibi_slopes=slopes, **bias
            )
            return np.asarray(out, np.float64)
    if impl == "pallas":
        raise Unsupported("the Pallas kernels are paged; varlen has no Pallas kernel")
    out = jax_attn.varlen_attention(
        *args,
        scale=p.spec.softmax_scale,
        alibi_slopes=None if slopes is None else jnp.asarray(slopes),
        **bias,
    )
    return np.asarray(out.astype(jnp.float32), np.float64)


def _jax_reference(p: Problem) -> np.ndarray:
    import jax

    with jax.enable_x64(True):
        return _jax_paged("reference")(p)


def _needs(module: str, what: str) -> Callable[[], str | None]:
    def check() -> str | None:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed ({what})"
        return None

    return check


def _pallas_available() -> str | None:
    if importlib.util.find_spec("jax_attn.pallas") is None:
        return "jax_attn.pallas is missing"
    try:
        pallas = importlib.import_module("jax_attn.pallas")
    except ImportError as e:
        return f"jax_attn.pallas does not import: {e}"
    if not hasattr(pallas, "ragged_paged_attention"):
        return "jax_attn.pallas has no ragged_paged_attention kernel yet"
    return None


JAX_BACKENDS = [
    Backend("jax-reference", _needs("jax", "pip install jax"), _jax_reference),
    Backend("jax-xla", _needs("jax", "pip install jax"), _jax_paged("xla")),
    Backend("jax-pallas", _pallas_available, _jax_paged("pallas")),
]


def all_backends() -> list[Backend]:
    """Every backend this installation knows, available or not."""
    backends = list(JAX_BACKENDS)
    if importlib.util.find_spec("torch") is not None:
        try:
            runners = importlib.import_module("interop.torch_runners")
            backends += runners.TORCH_BACKENDS
        except ImportError:
            pass
    return backends


# ---------------------------------------------------------------------------------------------
# The default grid


def default_specs(quick: bool = False) -> list[Spec]:
    specs = [
        Spec("mixed", (17, 1, 3, 1), (0, 31, 14, 40), scale=0.1),
        Spec("decode-gqa4-alibi", (1, 1, 1), (0, 16, 200), alibi=True, num_heads=8, num_kv_heads=2),
        Spec("chunked-window", (5, 9), (30, 7), sliding_window=12, block_size=8),
        Spec(
            "softcap-bf16",
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
        Spec(
            "fp8-e5m2-mqa", (1, 4), (27, 0), cache_dtype="float8_e5m2", num_heads=8, num_kv_heads=1
        ),
        Spec("encoder", (7, 3), (0, 0), attn_type=AttnType.ENCODER, alibi=True, scale=0.2),
        Spec(
            "encoder-only",
            (9, 2),
            (0, 0),
            attn_type=AttnType.ENCODER_ONLY,
            scale=0.09,
            head_size=80,
            num_heads=4,
            num_kv_heads=4,
        ),
        Spec("cross", (3, 1), (9, 11), attn_type=AttnType.ENCODER_DECODER),
    ]
    return specs[:4] if quick else specs


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
    atol, rtol = problem.spec.tolerance
    error = float(np.max(np.abs(out - expected))) if out.size else 0.0
    ok = bool(np.all(np.abs(out - expected) <= atol + rtol * np.abs(expected)))
    return Cell(error, ok)

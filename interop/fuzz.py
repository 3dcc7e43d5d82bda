"""Property-based fuzzing of every backend against the float64 oracle (hypothesis).

An `Example` is a drawn workload (`harness.Spec`: ragged batch of decodes, prefills, chunked
prefills and, for the JAX core, empty sequences; GQA ratio, block size, head size, dtypes, fp8,
ALiBi, window, soft cap, attention type) plus a data seed, padding of the batch (extra
sequence rows and tokens, for the JAX core) and the poison in unused cache memory (NaN, +-Inf
or both). `check_example(backend, example)` runs one backend on it and returns the harness's
`Cell` (max error vs the oracle, within the one tolerance rule or not: `error_bound`).

- the bounded slice in the tests (tests/fuzz/) runs a fixed number of derandomized examples;
- `jax-attn fuzz --minutes N [--backend NAME]` runs batches of seeded examples until the time
  is up and prints any counterexample (shrunk by hypothesis) as a ready-to-paste pytest test.

Two sizes of example (`SIZES`): "unit" (the default: sequences up to 70 tokens, blocks up to 32,
so each example is quick and many run) and "serving" (`--sizes serving`): sequences that cross
the kernels' inner boundaries (decodes over up to 2500 keys, split over the workers; prefills
past the ragged kernel's 128-key steps and 32-token tiles; chunks over 1000-token prefixes),
blocks 16-256, head sizes 64-256 (80, 96, 112, 120, 192 too) and 512 for the JAX core (past the
decode kernel's 256), up to 8 kv heads and 32 query heads. Interpret-mode backends (`SMALL`)
keep their small sizes in both.

Imports hypothesis, JAX and torch only when used.
"""

import dataclasses
import sys
import time

import numpy as np

from interop.harness import Backend, Cell, Problem, Spec, check_cell, make_problem
from torch_backends.attention_type import AttentionType

# Backend families: what the drawn workloads may hold.
JAX_PREFIX = "jax-"
SMALL = ("jax-pallas",)  # interpret mode on CPU: small shapes only
SIZES = ("unit", "serving")
# Softmax scales other than the default 1 / sqrt(D), drawn as the spread they give the logits
# of unit-normal queries and keys (scale * sqrt(D), the logits' standard deviation), so that a
# head size's scale is as sharp as another's. The float32 row of the tolerance table holds for
# logits of this size: a logit's rounding grows with the sum of its |q_i k_i| (about
# scale * D * 2 / pi), so a fixed scale of 0.3 at D 512 (spread 6.8) put every float32
# implementation at the row (2.0-2.5e-5 for the native kernel and XLA alike, 3 seeds; at
# spread 3.4, scale 0.15: 0.7-1.0e-5, 4 seeds). 3.4 is the old draw's 0.3 at the bench's
# head size, 128.
LOGIT_SPREADS = (0.4, 3.4)


@dataclasses.dataclass(frozen=True)
class Example:
    spec: Spec
    seed: int
    pad_seqs: int = 0  # extra padding rows in the metadata (JAX core only)
    pad_tokens: int = 0  # extra padding query tokens (JAX core only)
    poison: str = "nan"  # what unused cache memory holds: "nan", "inf", "mixed"


def spec_source(spec: Spec) -> str:
    """`spec` as Python source (for a pasted test)."""
    fields = []
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if value == f.default and f.name != "name":
            continue
        text = f"AttentionType.{value.name}" if isinstance(value, AttentionType) else repr(value)
        fields.append(f"{f.name}={text}")
    return f"Spec({', '.join(fields)})"


def example_source(example: Example) -> str:
    spec = spec_source(example.spec)
    return (
        f"Example(spec={spec}, seed={example.seed}, pad_seqs={example.pad_seqs}, "
        f"pad_tokens={example.pad_tokens}, poison={example.poison!r})"
    )


def pytest_source(backend: str, example: Example, cell: Cell) -> str:
    """A ready-to-paste regression test for a counterexample."""
    name = "".join(c if c.isalnum() else "_" for c in backend.lower())
    note = (cell.note or f"max |error| {cell.error}").replace('"""', "'''")
    return f'''
from interop.fuzz import Example, check_example
from interop.harness import Spec
from torch_backends.attention_type import AttentionType


def test_fuzz_counterexample_{name}_{example.seed}():
    """Found by `jax-attn fuzz`: {note}"""
    example = {example_source(example)}
    cell = check_example("{backend}", example)
    assert cell.ok, cell
'''


# --------------------------------------------------------------------------------------------
# Strategies


def examples(backend: str, sizes: str = "unit"):
    """The hypothesis strategy of examples `backend` can take, of `sizes` (one of `SIZES`)."""
    from hypothesis import strategies as st

    if sizes not in SIZES:
        raise ValueError(f"sizes={sizes!r} must be one of {SIZES}")
    jax_core = backend.startswith(JAX_PREFIX)
    small = backend in SMALL
    serving = sizes == "serving" and not small

    def lengths(draw, kind: str) -> tuple[int, int]:
        """(q_len, context) of a decoder sequence of `kind`, serving-sized."""
        if kind == "decode":
            return 1, draw(st.integers(1, 300))
        if kind == "long-decode":  # past the 512 keys one worker takes whole: split
            return 1, draw(st.integers(513, 2500))
        if kind == "prefill":
            return draw(st.integers(1, 400)), 0
        if kind == "chunked":
            return draw(st.integers(2, 300)), draw(st.integers(1, 1000))
        return 0, draw(st.integers(0, 1000))

    @st.composite
    def draw_example(draw):
        attn_type = draw(
            st.sampled_from(
                [AttentionType.DECODER] * 4
                + [AttentionType.ENCODER, AttentionType.ENCODER_ONLY, AttentionType.ENCODER_DECODER]
            )
        )
        max_seqs = 3 if small else 6 if serving else 5
        max_len = 20 if small else 600 if serving else 70
        kinds = ["decode", "prefill", "chunked"] + (["empty"] if jax_core else [])
        n = draw(st.integers(1, max_seqs))  # (make_workload needs one sequence)
        query_lens, context_lens = [], []
        for _ in range(n):
            if attn_type is not AttentionType.DECODER:
                q = draw(st.integers(1, max_len // 2))
                extra = 0 if attn_type is not AttentionType.ENCODER_DECODER else None
                c = extra if extra is not None else draw(st.integers(1, max_len // 2))
            elif serving:
                q, c = lengths(draw, draw(st.sampled_from(["long-decode", *kinds])))
            else:
                kind = draw(st.sampled_from(kinds))
                if kind == "decode":
                    q, c = 1, draw(st.integers(1, max_len))
                elif kind == "prefill":
                    q, c = draw(st.integers(1, max_len)), 0
                elif kind == "chunked":
                    q, c = draw(st.integers(2, max_len // 2)), draw(st.integers(1, max_len // 2))
                else:
                    q, c = 0, draw(st.integers(0, max_len // 2))
            query_lens.append(q)
            context_lens.append(c)
        if serving:
            num_kv_heads = draw(st.sampled_from([1, 2, 3, 8]))
            group = draw(st.sampled_from([g for g in (1, 2, 4, 5, 8) if g * num_kv_heads <= 32]))
            head_sizes = (  # the JAX core past the decode kernel's 256 too (ragged: 512)
                [64, 80, 96, 112, 120, 128, 192, 256, 512]
                if jax_core
                else [64, 80, 96, 112, 128, 192, 256]
            )
            block_sizes = [16, 32, 64, 128, 256] if jax_core else [16, 32, 64, 128]
        else:
            num_kv_heads = draw(st.integers(1, 2 if small else 3))
            group = draw(st.sampled_from([1, 2, 4] if small else [1, 2, 3, 4, 7]))
            head_sizes = [16, 32] if small else [8, 16, 32, 64, 80, 128]
            if not jax_core:
                head_sizes = [32, 64, 80, 128]  # vLLM's supported sizes
            block_sizes = [1, 2, 4, 8, 16] if jax_core else [8, 16, 32]
        dtype = draw(st.sampled_from(["float32", "bfloat16", "float16"]))
        fp8 = attn_type is AttentionType.DECODER and draw(st.booleans())
        cache_dtype = draw(st.sampled_from(["float8_e4m3fn", "float8_e5m2"])) if fp8 else None
        sliding_window = draw(st.none() | st.integers(1, max_len))
        logits_soft_cap = draw(st.none() | st.sampled_from([5.0, 30.0]))
        head_size = draw(st.sampled_from(head_sizes))
        spread = draw(st.none() | st.sampled_from(LOGIT_SPREADS))
        spec = Spec(
            name="fuzz",
            query_lens=tuple(query_lens),
            context_lens=tuple(context_lens),
            num_heads=num_kv_heads * group,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            block_size=draw(st.sampled_from(block_sizes)),
            dtype=dtype,
            cache_dtype=cache_dtype,
            alibi=draw(st.booleans()),
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            attn_type=attn_type,
            scale=None if spread is None else round(spread / head_size**0.5, 4),
        )
        padded = jax_core and attn_type is AttentionType.DECODER
        return Example(
            spec=spec,
            seed=draw(st.integers(0, 2**31 - 1)),
            pad_seqs=draw(st.integers(0, 2)) if padded else 0,
            pad_tokens=draw(st.integers(0, 3)) if padded else 0,
            poison=draw(st.sampled_from(["nan", "inf", "mixed"])),
        )

    return draw_example()


# --------------------------------------------------------------------------------------------
# Running one example


def backends() -> dict[str, Backend]:
    from interop.crosscheck import all_backends

    return {b.name: b for b in all_backends()}


def make_example_problem(example: Example) -> Problem:
    rng = np.random.default_rng(example.seed)
    problem = make_problem(example.spec, rng)
    if example.poison == "nan":
        return problem
    w = problem.workload
    caches = []
    for cache in (w.key_cache, w.value_cache):
        c = cache.astype(np.float32)
        unused = np.isnan(c)
        if example.poison == "inf":
            fill = np.full(c.shape, np.inf, np.float32)
        else:
            fill = np.where(rng.random(c.shape) < 0.5, np.inf, -np.inf).astype(np.float32)
            fill = np.where(rng.random(c.shape) < 0.3, np.nan, fill)
        # fp8 e4m3fn has no infinity: casting inf gives NaN, which is still poison.
        caches.append(np.where(unused, fill, c).astype(cache.dtype))
    w = dataclasses.replace(w, key_cache=caches[0], value_cache=caches[1])
    return dataclasses.replace(problem, workload=w)


def not_applicable(cell: Cell) -> bool:
    """Whether `cell` is an example the backend did not run (unavailable here, or a
    documented limitation): never a pass, counted apart."""
    return cell.error is None and cell.note.startswith("n/a")


def check_example(backend_name: str, example: Example) -> Cell:
    """One backend on one example, against the float64 oracle (`Cell.ok`: within tolerance;
    a backend's documented limitation is `Unsupported`, reported ok with a note)."""
    backend = backends()[backend_name]
    reason = backend.why_unavailable()
    if reason is not None:
        return Cell(None, True, f"n/a: {reason}")
    problem = make_example_problem(example)
    if backend_name.startswith(JAX_PREFIX) and (example.pad_seqs or example.pad_tokens):
        impl = backend_name.removeprefix(JAX_PREFIX)
        backend = Backend(backend_name, lambda: None, _padded_runner(impl, example))
    return check_cell(backend, problem)


def _padded_runner(impl: str, example: Example):
    """The JAX core on the batch padded with extra sequence rows and query tokens (random
    queries; their rows must come back zero), as a jitted serving loop sees it."""

    def run(p: Problem) -> np.ndarray:
        import jax
        import jax.numpy as jnp

        import jax_attn
        from interop.jax_runners import _cpu_supports

        if impl == "cpu":
            _cpu_supports(p)
        w, spec = p.workload, p.spec
        num_seqs, num_tokens = len(w.query_lens), w.query.shape[0]
        md = w.metadata(pad_to=(num_seqs + example.pad_seqs, num_tokens + example.pad_tokens))
        rng = np.random.default_rng(example.seed + 1)
        pad = rng.standard_normal((example.pad_tokens, *w.query.shape[1:])).astype(w.query.dtype)
        query = np.concatenate([w.query, pad])
        kc, vc = jax_attn.write_kv(
            jnp.asarray(w.key_cache),
            jnp.asarray(w.value_cache),
            jnp.asarray(w.new_key),
            jnp.asarray(w.new_value),
            md.slot_mapping[:num_tokens],
            k_scale=w.k_scale,
            v_scale=w.v_scale,
        )
        bias = dict(p.bias)
        slopes = bias.pop("alibi_slopes")
        call = dict(
            impl=impl,
            scale=spec.softmax_scale,
            k_scale=w.k_scale,
            v_scale=w.v_scale,
            alibi_slopes=None if slopes is None else jnp.asarray(slopes),
            **bias,
        )
        if impl == "reference":
            with jax.enable_x64(True):
                out = jax_attn.paged_attention(jnp.asarray(query), kc, vc, md, **call)
        else:
            out = jax_attn.paged_attention(jnp.asarray(query), kc, vc, md, **call)
        out = np.asarray(out.astype(jnp.float32), np.float64)
        if np.any(out[num_tokens:] != 0):
            raise AssertionError("padding tokens' output rows are not zero")
        return out[:num_tokens]

    return run


# --------------------------------------------------------------------------------------------
# The long run


@dataclasses.dataclass
class FuzzReport:
    backend: str
    examples: int = 0  # examples the backend really ran (n/a ones not included)
    not_applicable: int = 0  # examples it did not take (counted apart, never as passes)
    seconds: float = 0.0
    counterexample: Example | None = None
    cell: Cell | None = None


class _Failed(AssertionError):
    pass


def _drop_compiled_programs() -> None:
    """Free JAX's compiled programs between batches. Nearly every example is a new shape, so a
    new XLA program: kept for half an hour they exhaust the process's memory mappings
    (vm.max_map_count), and XLA's JIT then fails ("LLVM compilation error: Cannot allocate
    memory") and the process dies (seen after 22-27 minutes on jax-reference / jax-pallas)."""
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.clear_caches()


def fuzz_backend(
    name: str, seconds: float, *, seed: int = 0, batch: int = 20, sizes: str = "unit"
) -> FuzzReport:
    """Run seeded hypothesis batches of `batch` examples of `sizes` on one backend until
    `seconds` pass or a counterexample is found (shrunk)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed

    report = FuzzReport(name)
    start = time.monotonic()
    last: dict = {}
    strategy = examples(name, sizes)
    run_seed = seed
    while time.monotonic() - start < seconds:

        @hypothesis_seed(run_seed)
        @settings(
            max_examples=batch,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(strategy)
        def body(example):
            cell = check_example(name, example)
            if not_applicable(cell):
                report.not_applicable += 1
                return
            report.examples += 1
            if not cell.ok:
                last["example"], last["cell"] = example, cell
                raise _Failed(cell)

        try:
            body()
        except _Failed:
            report.counterexample, report.cell = last["example"], last["cell"]
            break
        except Exception as e:  # a crash of the runner itself: keep what we have
            if "example" in last:
                report.counterexample, report.cell = last["example"], last["cell"]
            else:
                raise e
            break
        run_seed += 1
        _drop_compiled_programs()
    report.seconds = time.monotonic() - start
    return report

"""Bad-metadata fuzzing of the native CPU kernels (issue 22): garbage in, an error out, never a
crash.

Under `jax.jit` no eager check runs: the FFI handlers (`jax_attn/cpu/csrc/*.cc`) are the only
guard between a serving loop's metadata and the process. Each example here draws a valid
ragged (or decode) batch on one of a few fixed shapes (each compiles once), then breaks 0-3 of
its values: `query_start_loc` entries (out of [0, T], decreasing), `num_seqs` (negative,
beyond the rows), `seq_lens` (negative, below the query length, beyond the block table),
block ids (negative, `num_blocks`, int32 extremes) in the rows the kernel reads, the fp8
scales (NaN, inf, 0, negative, huge) and the ALiBi slopes (NaN). Unused table entries and
padding rows always hold garbage: the kernels must ignore them. The values come from int32's
extremes, the boundaries (`-1`, `T`, `T + 1`, `num_blocks`) and random draws.

An example's verdict is predicted in numpy from the kernel's documented rules (the
docstrings of `jax_attn.cpu.ragged_paged_attention` / `paged_decode`), then checked:

- predicted bad: the call must raise, naming the first offending argument;
- predicted good: it must run; with finite, moderate scales its rows match `impl="xla"` within
  the one tolerance rule against a peer (and padding rows are zeros).

Anything else is a failure (`Report.failures`); a crash ends the process, so run long
sessions in a child process (`jax-attn fuzz --bad-metadata` does, and with `--sanitize` under
an ASan + UBSan build of the kernels, where any out-of-bounds access aborts the child).
"""

import dataclasses
import os
import subprocess
import sys
from collections import Counter

import numpy as np

from interop import bad_input
from interop.bad_input import Report, run_for
from interop.tolerances import bound_ratio

KERNELS = ("ragged", "decode")
# Examples per kernel in the test suite's slice (tests/jax/test_cpu_bad_metadata.py), which
# asks that at least a quarter were refused and a tenth ran. Per 60 draws the decode refused
# 19-31 (12 seeds; mean 25.6) and a CI run saw 13: 60 left the quarter 2.8 standard deviations
# away. At 240 (about 5 s) it is 5.6; the ragged draws (23-40 of 60 refused, mean 31.8) keep 60.
SLICE_EXAMPLES = {"ragged": 60, "decode": 240}
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Shape:
    """One compiled program: sizes, dtypes and the static attention options."""

    T: int  # query tokens (ragged) or sequences (decode: T == S)
    S: int
    MB: int  # max_blocks
    NB: int
    BS: int
    Hq: int
    Hkv: int
    D: int
    dtype: str = "float32"
    cache_dtype: str = "float32"
    causal: bool = True
    window: int | None = None
    soft_cap: float | None = None
    alibi: bool = False
    split_tokens: int | None = None  # decode only


SHAPES = {
    "ragged": (
        Shape(T=8, S=3, MB=4, NB=6, BS=4, Hq=4, Hkv=2, D=16),
        # Several tiles per sequence (G = 2: 32 tokens a tile), bf16 (the vdpbf16ps path).
        Shape(T=70, S=4, MB=8, NB=20, BS=16, Hq=2, Hkv=1, D=32, dtype="bfloat16",
              cache_dtype="bfloat16", window=5, soft_cap=30.0, alibi=True),
        # Decode-sized items taking several kv heads, fp8 cache, not causal.
        Shape(T=5, S=6, MB=3, NB=4, BS=2, Hq=8, Hkv=8, D=8, cache_dtype="float8_e4m3fn",
              causal=False),
    ),
    "decode": (
        Shape(T=4, S=4, MB=4, NB=6, BS=4, Hq=4, Hkv=2, D=16),
        Shape(T=3, S=3, MB=8, NB=20, BS=16, Hq=8, Hkv=1, D=64, dtype="bfloat16",
              cache_dtype="bfloat16", window=7, soft_cap=30.0, alibi=True, split_tokens=16),
        Shape(T=5, S=5, MB=3, NB=4, BS=2, Hq=2, Hkv=2, D=8, dtype="float16",
              cache_dtype="float8_e5m2", split_tokens=2),
    ),
}  # fmt: skip


# --------------------------------------------------------------------------------------------
# Drawing examples


def _garbage(rng, *, T: int, NB: int) -> int:
    """A bad-looking int32: extremes, boundaries, or random."""
    choices = [INT32_MIN, INT32_MAX, -1, -2, T, T + 1, NB, NB + 1, 10**8, -(10**8)]
    if rng.random() < 0.3:
        return int(rng.integers(INT32_MIN, INT32_MAX, endpoint=True))
    return int(rng.choice(choices))


BAD_SCALES = (float("nan"), float("inf"), -float("inf"), 0.0, -1.0, 1e30, 1e-30)


def _valid_batch(rng, s: Shape, kernel: str) -> dict:
    """A valid batch on shape `s`, with garbage in every entry the kernel must ignore."""
    cap = s.MB * s.BS
    tables = rng.integers(INT32_MIN, INT32_MAX, size=(s.S, s.MB), endpoint=True)
    seq_lens = rng.integers(INT32_MIN, INT32_MAX, size=(s.S,), endpoint=True)
    if kernel == "decode":
        num_seqs = s.S
        seq_lens = rng.integers(0, cap + 1, size=(s.S,))
        qsl = np.arange(s.S + 1)
    else:
        num_seqs = int(rng.integers(0, s.S + 1))
        budget = s.T
        qsl = [int(rng.integers(0, 3)) if rng.random() < 0.2 else 0]  # may start past 0
        budget -= qsl[0]
        for i in range(num_seqs):
            q_len = int(rng.integers(0, min(budget, cap) + 1)) if budget > 0 else 0
            budget -= q_len
            qsl.append(qsl[-1] + q_len)
            seq_lens[i] = int(rng.integers(q_len, cap + 1))
        # Rows past num_seqs: anything (never read), usually the last value repeated.
        tail = qsl[-1] if rng.random() < 0.7 else _garbage(rng, T=s.T, NB=s.NB)
        qsl = np.asarray(qsl + [tail] * (s.S - num_seqs))
    for i in range(num_seqs):
        used = -(-int(seq_lens[i]) // s.BS)
        tables[i, :used] = rng.integers(0, s.NB, size=used)
    return dict(
        query_start_loc=qsl.astype(np.int32),
        seq_lens=np.asarray(seq_lens).astype(np.int32),
        block_tables=tables.astype(np.int32),
        num_seqs=np.int32(num_seqs),
        k_scale=np.float32(rng.choice([1.0, 0.5, 2.0])),
        v_scale=np.float32(rng.choice([1.0, 0.5, 2.0])),
        slopes=(rng.random(s.Hq) * 0.5).astype(np.float32) if s.alibi else None,
    )


def _mutate(rng, s: Shape, kernel: str, md: dict, counts: Counter) -> None:
    """Break 0-3 values of `md` in place (each kind counted in `counts`)."""
    kinds = ["seq_lens", "block_tables", "scale"]
    if kernel == "ragged":
        kinds += ["query_start_loc", "query_start_loc_order", "num_seqs"]
    if s.alibi:
        kinds.append("slopes")
    real = int(md["num_seqs"]) if kernel == "ragged" else s.S
    for _ in range(int(rng.choice([0, 1, 1, 2, 3]))):
        kind = str(rng.choice(kinds))
        counts[kind] += 1
        if kind == "seq_lens":
            i = int(rng.integers(0, s.S))
            md["seq_lens"][i] = (
                _garbage(rng, T=s.T, NB=s.NB) if rng.random() < 0.7 else (s.MB * s.BS + 1)
            )
        elif kind == "block_tables":
            i = int(rng.integers(0, max(real, 1)))
            j = int(rng.integers(0, s.MB))
            md["block_tables"][i, j] = _garbage(rng, T=s.T, NB=s.NB)
        elif kind == "scale":
            md[str(rng.choice(["k_scale", "v_scale"]))] = np.float32(rng.choice(BAD_SCALES))
        elif kind == "slopes":
            md["slopes"][int(rng.integers(0, s.Hq))] = np.nan
        elif kind == "query_start_loc":
            md["query_start_loc"][int(rng.integers(0, s.S + 1))] = _garbage(rng, T=s.T, NB=s.NB)
        elif kind == "query_start_loc_order" and real > 0:
            i = int(rng.integers(0, real))
            qsl = md["query_start_loc"]
            qsl[i], qsl[i + 1] = qsl[i + 1] + 1, qsl[i]
        elif kind == "num_seqs":
            md["num_seqs"] = np.int32(
                rng.choice([-1, s.S + 1, INT32_MIN, INT32_MAX, int(rng.integers(0, s.S + 1))])
            )


def first_problem(kernel: str, s: Shape, md: dict) -> str | None:
    """The argument the kernel must name, in the order its handler checks; None: it must run.
    The rules are the kernels' documented ones (scales and slopes are not checked: they are
    values, not indices)."""
    qsl, lens, tables = md["query_start_loc"], md["seq_lens"], md["block_tables"]
    cap = s.MB * s.BS
    if kernel == "decode":
        for i in range(s.S):
            n = int(lens[i])
            if not 0 <= n <= cap:
                return "seq_lens"
            begin = max(0, n - s.window) if s.window else 0
            for b in range(begin // s.BS, -(-n // s.BS)):
                if not 0 <= tables[i, b] < s.NB:
                    return "block_tables"
        return None
    n = int(md["num_seqs"])
    if not 0 <= n <= s.S:
        return "num_seqs"
    if not 0 <= qsl[0] <= s.T:
        return "query_start_loc"
    for i in range(n):
        start, end, length = int(qsl[i]), int(qsl[i + 1]), int(lens[i])
        if end < start or end > s.T:
            return "query_start_loc"
        if not end - start <= length <= cap:
            return "seq_lens"
        for b in range(-(-length // s.BS)):
            if not 0 <= tables[i, b] < s.NB:
                return "block_tables"
    return None


# --------------------------------------------------------------------------------------------
# Running


class _Programs:
    """The jitted kernel and its impl='xla' twin per shape, compiled on first use."""

    def __init__(self, kernel: str):
        self.kernel = kernel
        self.cache: dict = {}

    def get(self, s: Shape):
        if s not in self.cache:
            self.cache[s] = self._build(s)
        return self.cache[s]

    def _build(self, s: Shape):
        import jax
        import jax.numpy as jnp

        import jax_attn
        from jax_attn import cpu

        bias = dict(sliding_window=s.window, logits_soft_cap=s.soft_cap)
        if self.kernel == "ragged":

            def native(q, kc, vc, qsl, lens, tables, n, ks, vs, slopes):
                return cpu.ragged_paged_attention(
                    q, kc, vc, qsl, lens, tables, n, scale=0.3, causal=s.causal,
                    alibi_slopes=slopes, k_scale=ks, v_scale=vs, **bias,
                )  # fmt: skip

            def xla(q, kc, vc, qsl, lens, tables, n, ks, vs, slopes):
                md = jax_attn.RaggedMetadata(
                    query_start_loc=qsl,
                    seq_lens=lens,
                    block_tables=tables,
                    slot_mapping=jnp.full((s.T,), -1, jnp.int32),
                    num_seqs=n,
                )
                return jax_attn.paged_attention(
                    q, kc, vc, md, scale=0.3, causal=s.causal, alibi_slopes=slopes,
                    k_scale=ks, v_scale=vs, impl="xla", **bias,
                )  # fmt: skip

        else:

            def native(q, kc, vc, qsl, lens, tables, n, ks, vs, slopes):
                return cpu.paged_decode(
                    q, kc, vc, tables, lens, scale=0.3, alibi_slopes=slopes, k_scale=ks,
                    v_scale=vs, split_tokens=s.split_tokens, **bias,
                )  # fmt: skip

            def xla(q, kc, vc, qsl, lens, tables, n, ks, vs, slopes):
                return jax_attn.paged_decode(
                    q, kc, vc, tables, lens, scale=0.3, alibi_slopes=slopes, k_scale=ks,
                    v_scale=vs, impl="xla", **bias,
                )  # fmt: skip

        return jax.jit(native), jax.jit(xla)


def _data(rng, s: Shape):
    import jax.numpy as jnp

    q = rng.standard_normal((s.T, s.Hq, s.D)).astype(np.float32)
    shape = (s.NB, s.BS, s.Hkv, s.D)
    kc = rng.standard_normal(shape).astype(np.float32)
    vc = rng.standard_normal(shape).astype(np.float32)
    return (
        jnp.asarray(q, s.dtype),
        jnp.asarray(kc).astype(s.cache_dtype),
        jnp.asarray(vc).astype(s.cache_dtype),
    )


def run_example(kernel: str, seed: int, index: int, programs: _Programs, report: Report) -> None:
    """Draw, run and judge one example; a wrong verdict is appended to report.failures."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng((seed, index))
    shapes = SHAPES[kernel]
    s = shapes[int(rng.integers(0, len(shapes)))]
    md = _valid_batch(rng, s, kernel)
    _mutate(rng, s, kernel, md, report.mutations)
    expected = first_problem(kernel, s, md)
    q, kc, vc = _data(np.random.default_rng((seed, index, 1)), s)
    args = (
        q,
        kc,
        vc,
        jnp.asarray(md["query_start_loc"]),
        jnp.asarray(md["seq_lens"]),
        jnp.asarray(md["block_tables"]),
        jnp.asarray(md["num_seqs"]),
        jnp.asarray(md["k_scale"]),
        jnp.asarray(md["v_scale"]),
        None if md["slopes"] is None else jnp.asarray(md["slopes"]),
    )
    native, xla = programs.get(s)
    report.examples += 1

    def fail(what: str) -> None:
        report.failures.append((seed, index, f"{what} [{s}, {md}]"))

    try:
        out = np.asarray(jax.block_until_ready(native(*args)).astype(jnp.float32))
    except Exception as e:  # XlaRuntimeError carrying the handler's InvalidArgument
        message = str(e)
        if expected is None:
            fail(f"refused valid metadata: {message.splitlines()[0][:300]}")
        elif expected not in message or "INVALID_ARGUMENT" not in message:
            fail(f"error does not name {expected}: {message.splitlines()[0][:300]}")
        else:
            report.refused += 1
        return
    if expected is not None:
        fail(f"ran although {expected} is bad")
        return
    report.ran += 1
    scales = np.asarray([md["k_scale"], md["v_scale"]], np.float64)
    slopes_ok = md["slopes"] is None or np.all(np.isfinite(md["slopes"]))
    if not (np.all((scales >= 1 / 16) & (scales <= 16)) and slopes_ok):
        return  # garbage scales: no crash is all that is asked
    want = np.asarray(jax.block_until_ready(xla(*args)).astype(jnp.float32))
    rows = np.zeros(s.T, bool)
    if kernel == "ragged":
        qsl = md["query_start_loc"]
        rows[int(qsl[0]) : int(qsl[int(md["num_seqs"])])] = True
    else:
        rows[:] = True
    if np.any(out[~rows] != 0):
        fail("padding rows are not zero")
        return
    err = float(np.max(np.abs(out[rows] - want[rows]), initial=0.0))
    # The one tolerance rule against a peer (impl='xla' rounds too, differently).
    ratio = bound_ratio(out[rows], want[rows], s.dtype, s.cache_dtype, peer=True)
    if not ratio <= 1:
        fail(f"rows differ from impl='xla' by {err:.3g}, {ratio:.3g}x the tolerance rule's bound")
        return
    report.compared += 1


def fuzz(
    kernel: str,
    *,
    examples: int | None = None,
    seconds: float | None = None,
    seed: int = 0,
    progress=None,
) -> Report:
    """Run `examples` examples (or until `seconds` pass) of `kernel` ("ragged" or "decode").
    `progress(report)` is called every 200 examples (the long run prints there)."""
    if kernel not in KERNELS:
        raise ValueError(f"{kernel=} must be one of {KERNELS}")
    report = Report(kernel, "impl='xla'")
    programs = _Programs(kernel)
    return run_for(
        report,
        lambda index: run_example(kernel, seed, index, programs, report),
        examples=examples,
        seconds=seconds,
        progress=progress,
        every=200,
    )


# --------------------------------------------------------------------------------------------
# The sanitizer build


# -Werror too: the kernels build warning-free, natively and portably (and the tests'
# sanitizer builds, tests/jax/test_cpu_build.py, share this cache key).
# -O1 (after the build's -O3): a third of -O2's compile time (the native build's units: 209
# against 671 CPU-seconds on Sapphire Rapids; the portable one's 108 against 176), and the
# sanitized tests ran no slower (test_cpu_bad_metadata.py 101 s against 103).
# asan-instrumentation-with-call-threshold=0: ASan checks each access through a call into its
# runtime instead of inline code; the same checks, half the compile time (decode_items_bf16.cc:
# 86 -> 42 s on one Sapphire Rapids core), slower only in the small sanitized runs.
SANITIZE_FLAGS = (
    "-fsanitize=address,undefined -fno-sanitize-recover=all -O1 -DJAX_ATTN_CPU_FEW_HEAD_SIZES"
    " --param=asan-instrumentation-with-call-threshold=0 -Werror"
)
PORTABLE_FLAGS = "-march=x86-64-v3"  # no AVX-512: the AVX2 kernels (vec_avx2.h, decode_avx2.h)


def sanitizer_env(extra_flags: str = "") -> dict:
    """The environment for a child process that builds and loads the kernels with ASan + UBSan
    (`extra_flags` appended, e.g. PORTABLE_FLAGS). Raises RuntimeError when the compiler has
    no sanitizer runtime."""
    from jax_attn.cpu import _build

    cxx = _build.find_compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found")
    preload = []
    for lib in ("libasan.so", "libstdc++.so.6"):
        path = subprocess.run(
            [cxx, f"-print-file-name={lib}"], capture_output=True, text=True
        ).stdout.strip()
        if not os.path.isabs(path):
            raise RuntimeError(f"{cxx} has no {lib} (needed for the sanitizer build)")
        preload.append(path)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {
        **os.environ,
        "JAX_ATTN_CPU_EXTRA_FLAGS": f"{SANITIZE_FLAGS} {extra_flags}".strip(),
        # libstdc++ too: without it ASan cannot intercept __cxa_throw in a Python process and
        # aborts at the first C++ exception.
        "LD_PRELOAD": " ".join(preload),
        "ASAN_OPTIONS": "detect_leaks=0",
        "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]),
    }


def main(argv: list[str]) -> int:
    """`python -m interop.bad_metadata KERNEL SECONDS SEED`: one run, progress on stdout;
    exit 1 on a failure (a crash exits with the signal)."""
    return bad_input.child_main(argv, fuzz)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

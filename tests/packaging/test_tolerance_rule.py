"""One tolerance rule (issue 37, item 4): every comparison against the float64 oracle or a peer
goes through `interop.tolerances` (`error_bound`, `within`, `bound_ratio`, `assert_close`; with
`peer=True` against another implementation's output), never through a tolerance of its own.
An absolute row of its own let one dropped key of 513 pass in bfloat16
(tests/jax/test_tolerance_scaling.py shows the rule refusing it, the bench's check included).

This scans the source for the marks of a tolerance of one's own (`atol`, `rtol`, `allclose`,
`isclose`, `torch.testing.assert_close`, the table's rows through `TOLERANCES` / `tolerance(`,
an error held to a literal) and refuses any that `KEPT` does not list with its reason: checks
that compare no attention output with the oracle or a peer, or hold it tighter than the rule
(bitwise, or two paths of one implementation).
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("benchmarks", "interop", "jax_attn", "torch_backends", "tests")
THE_RULE = {
    "interop/tolerances.py",
    "tests/tolerances.py",
    "tests/packaging/test_tolerance_rule.py",
}
MARKS = re.compile(
    r"\b(atol|rtol)\b|allclose|isclose|testing\.assert_close|\bTOLERANCES\b"
    r"|(?<![\w.])_?tolerance\(|\.tolerance\b|\b(err|error|diff)\w*\s*<=?\s*[\d.]+e-\d"
)
EXACT = "rtol=0, atol=0"  # bitwise equality: stricter than any rule

# path -> {substring of the line (None: every line of the file): why it is not the rule's}
KEPT: dict[str, dict[str | None, str]] = {
    "tests/jax/test_tolerance_scaling.py": {None: "the rule's own tests"},
    "tests/jax/test_reliability_fp8.py": {
        'tolerance("float32", cache_dtype)[0] * 10 < error': "the old fp8 rows shown letting "
        "a wrong backend through: a test of the rule",
    },
    "tests/jax/test_core_metadata.py": {None: "ALiBi slopes against their formula"},
    "tests/jax/test_core_varlen.py": {
        "assert_allclose(analytic, numeric": "a gradient against finite differences",
    },
    "tests/jax/test_core_paged.py": {
        "np.asarray(unified[:num_seqs]), atol=1e-6": "two entries of one impl, held tighter "
        "than the rule",
    },
    "tests/torch/test_native_ops.py": {
        "rtol=2e-6, atol=2e-6": "the native op and its torch fallback in float32, held tighter "
        "than the rule",
        "torch.allclose(compiled": "a compiled step against the same step eager",
    },
    "tests/interop/test_interop_torch_op.py": {
        "assert_close(compiled(*args[:6]), eager)": "a compiled step against the same step "
        "eager (torch's float32 defaults, tighter than the rule)",
    },
    "tests/vllm085/test_engine_dropin.py": {
        None: "end-to-end logprobs and hidden states of float32 models through vLLM's engine, "
        "not attention outputs",
    },
    "tests/vllm085/engine_harness.py": {None: "compare_greedy: end-to-end logprobs"},
    "interop/harness.py": {
        "def tolerance(self)": "Spec.tolerance, the table's row shown in `jax-attn check`'s "
        "legend (check_cell judges with error_bound)",
        "return tolerance(self.dtype": "the same",
    },
    "interop/cli.py": {"spec.tolerance[0]": "the legend of `jax-attn check`"},
    "interop/crosscheck.py": {"TOLERANCES": "re-exported for the harness's users"},
}


def _marked_lines() -> list[tuple[str, int, str]]:
    found = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in THE_RULE:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if MARKS.search(line):
                    found.append((rel, number, line.strip()))
    return found


def _kept(rel: str, line: str) -> bool:
    kept = KEPT.get(rel, {})
    return EXACT in line or None in kept or any(s and s in line for s in kept)


def test_every_comparison_goes_through_the_one_rule():
    own = [f"{rel}:{n}: {line}" for rel, n, line in _marked_lines() if not _kept(rel, line)]
    assert not own, (
        "a comparison with a tolerance of its own: use interop.tolerances (assert_close, "
        "within, bound_ratio; peer=True against another implementation), or add it to KEPT "
        "with the reason it is not an oracle or peer comparison:\n" + "\n".join(own)
    )


def test_every_kept_line_is_still_there():
    """A reason for a line that is gone would let the next one through unread."""
    lines = _marked_lines()
    for rel, kept in KEPT.items():
        assert (ROOT / rel).exists(), rel
        for substring in kept:
            if substring is not None:
                assert any(r == rel and substring in line for r, _, line in lines), (
                    rel,
                    substring,
                )


def test_the_scan_sees_the_old_absolute_rows():
    """The forms the rule replaced (the bench's, the conformance tests', the sharded cases')."""
    for line in (
        "agrees = finite and bool(np.all(diff <= atol + rtol * np.abs(expected)))",
        "atol, rtol = TOLERANCES[data.spec.dtype]",
        "tol=tolerance(dtype, cache_dtype)[0],",
        "if not err <= _tolerance(s):",
        "agrees=err <= 2e-5,",
        "np.testing.assert_allclose(out, expected, atol=atol, rtol=rtol)",
    ):
        assert MARKS.search(line), line

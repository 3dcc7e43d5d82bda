"""The frame both bad-input fuzzers share: `interop.bad_metadata` (garbage metadata into the
XLA handlers under jit) and `interop.bad_torch_ops` (bad arguments into the torch ops).

Each fuzzer draws examples and runs them (`run_example(index)`), counting into one `Report`;
`run_for` is the loop, timed or counted. A fuzzer runs in a child process (`run_child`, whose
entry point is `child_main`), so that a crash, a sanitizer's abort included, is a return code
the parent reports (`run_children`, behind `jax-attn fuzz --bad-metadata / --torch-ops`)
rather than the end of the parent. Nothing here imports JAX or torch.
"""

import dataclasses
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable

PROGRESS = "progress:"  # the prefix of a child's progress lines (left out of the summary)


@dataclasses.dataclass
class Report:
    subject: str  # the kernel or op fuzzed
    oracle: str  # what the examples that ran are compared with, for the summary
    examples: int = 0
    refused: int = 0  # raised, as predicted, naming the argument (and nothing written)
    ran: int = 0  # ran, as predicted
    compared: int = 0  # of those, checked against the oracle
    seconds: float = 0.0
    mutations: Counter = dataclasses.field(default_factory=Counter)
    failures: list = dataclasses.field(default_factory=list)  # (seed, index, what)

    def summary(self) -> str:
        top = ", ".join(f"{k} {v}" for k, v in sorted(self.mutations.items()))
        text = (
            f"{self.subject}: {self.examples} examples in {self.seconds:.1f} s: "
            f"{self.refused} refused (as predicted), {self.ran} ran ({self.compared} compared "
            f"with {self.oracle}), {len(self.failures)} failures; mutations: {top}"
        )
        for seed, index, what in self.failures[:5]:
            text += f"\n  FAILURE seed={seed} example={index}: {what}"
        return text


def require_limit(examples: int | None, seconds: float | None) -> None:
    """A run needs `examples` or `seconds` (or both); checked by `run_for`, and first by a
    fuzzer with set-up work before its loop."""
    if examples is None and seconds is None:
        raise ValueError("give examples or seconds (or both)")


def run_for(
    report: Report,
    run_example: Callable[[int], None],
    *,
    examples: int | None,
    seconds: float | None,
    progress: Callable[[Report], None] | None,
    every: int,
) -> Report:
    """`run_example(index)` for index 0, 1, ... until `examples` ran or `seconds` passed (at
    least one of them given); `progress(report)` every `every` examples."""
    require_limit(examples, seconds)
    start = time.monotonic()
    index = 0
    while (examples is None or index < examples) and (
        seconds is None or time.monotonic() - start < seconds
    ):
        run_example(index)
        index += 1
        if progress is not None and index % every == 0:
            report.seconds = time.monotonic() - start
            progress(report)
    report.seconds = time.monotonic() - start
    return report


def run_child(
    module: str, subject: str, *, seconds: float, seed: int, env: dict
) -> tuple[int, str]:
    """`python -m MODULE SUBJECT SECONDS SEED` (the module's `child_main`) in a child process;
    returns (its return code, its output: all of stdout, the end of stderr)."""
    proc = subprocess.run(
        [sys.executable, "-m", module, subject, str(seconds), str(seed)],
        capture_output=True,
        text=True,
        env=env,
    )
    return proc.returncode, proc.stdout + proc.stderr[-5000:]


def child_main(argv: list[str], fuzz: Callable[..., Report]) -> int:
    """A child's run: argv is SUBJECT SECONDS SEED; progress lines on stdout, then the summary;
    exit 1 on a failure (a crash exits with its signal)."""
    subject, seconds, seed = argv[0], float(argv[1]), int(argv[2])

    def progress(report: Report) -> None:
        print(PROGRESS, report.summary().splitlines()[0], flush=True)

    report = fuzz(subject, seconds=seconds, seed=seed, progress=progress)
    print(report.summary(), flush=True)
    return 1 if report.failures else 0


def run_children(
    module: str, subjects: list[str], *, backend: str | None, minutes: float, seed: int, env: dict
) -> int:
    """Each subject (or only `backend`, which must be one of them) for `minutes` in its own
    child process; prints each one's summary (and the end of its output when it did not exit
    0) under the build's flags. Returns 0, 1 when any child failed, 2 for an unknown backend."""
    if backend:
        if backend not in subjects:
            print(f"--backend={backend!r} is not one of {subjects}", file=sys.stderr)
            return 2
        subjects = [backend]
    build = env.get("JAX_ATTN_CPU_EXTRA_FLAGS") or "default flags"
    failures = 0
    for subject in subjects:
        rc, output = run_child(module, subject, seconds=minutes * 60.0, seed=seed, env=env)
        lines = [ln for ln in output.splitlines() if not ln.startswith(PROGRESS)]
        summary = [ln for ln in lines if ln.startswith(f"{subject}:") or "FAILURE" in ln]
        print(f"[{build}] " + ("\n".join(summary) if summary else f"{subject}: no summary"))
        if rc != 0:
            failures += 1
            print(f"{subject}: child exited {rc}:\n" + "\n".join(lines[-40:]))
    return 1 if failures else 0

"""The `jax-attn` command: `info`, `check`, `bench`."""

import argparse
import importlib
import importlib.metadata
import json
import platform
import sys

import numpy as np


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _console():
    from rich.console import Console

    return Console()


def cmd_info(args) -> int:
    from rich.markup import escape
    from rich.table import Table

    from interop import crosscheck

    console = _console()
    versions = Table(title="jax-attn: versions", show_header=False)
    versions.add_row("python", platform.python_version())
    for dist in ("jax-attn", "jax", "jaxlib", "torch", "xformers", "intel-extension-for-pytorch"):
        versions.add_row(dist, _version(dist))
    try:
        import jax

        versions.add_row("jax devices", ", ".join(str(d) for d in jax.devices()))
    except Exception as e:
        versions.add_row("jax devices", f"unavailable: {e}")
    console.print(versions)

    backends = Table(title="backends on this machine")
    backends.add_column("backend")
    backends.add_column("runs here")
    backends.add_column("why not / how")
    for backend in crosscheck.all_backends():
        reason = backend.why_unavailable()
        backends.add_row(backend.name, "yes" if reason is None else "no", escape(reason or ""))
    console.print(backends)
    return 0


def cmd_check(args) -> int:
    from rich.markup import escape
    from rich.progress import track
    from rich.table import Table

    from interop import crosscheck

    console = _console()
    rng = np.random.default_rng(args.seed)
    backends = crosscheck.all_backends()
    if args.backends:
        wanted = set(args.backends.split(","))
        backends = [b for b in backends if b.name in wanted]
    runnable, skipped = [], []
    for backend in backends:
        reason = backend.why_unavailable()
        (runnable if reason is None else skipped).append((backend, reason))
    specs = crosscheck.default_specs(quick=args.quick)

    results: dict[str, dict[str, crosscheck.Cell]] = {}
    jobs = [(spec, backend) for spec in specs for backend, _ in runnable]
    problems = {}
    for spec, backend in track(jobs, description="cross-checking", console=console, transient=True):
        if spec.name not in problems:
            problems[spec.name] = crosscheck.make_problem(spec, rng)
        results.setdefault(spec.name, {})[backend.name] = crosscheck.check_cell(
            backend, problems[spec.name]
        )

    table = Table(title="max |error| against the float64 oracle (FAIL: beyond tolerance)")
    table.add_column("workload")
    table.add_column("atol")
    for backend, _ in runnable:
        table.add_column(backend.name, justify="right")
    failures = 0
    for spec in specs:
        cells = []
        for backend, _ in runnable:
            cell = results[spec.name][backend.name]
            failures += not cell.ok
            if cell.error is None:
                text = cell.note.split(":")[0] if cell.ok else f"[red]FAIL {cell.note[:40]}"
            else:
                text = f"{cell.error:.1e}" + ("" if cell.ok else " [red]FAIL")
            cells.append(text)
        table.add_row(f"{spec.name}\n[dim]{spec.describe()}", f"{spec.tolerance[0]:.0e}", *cells)
    console.print(table)
    for backend, reason in skipped:
        console.print(f"[yellow]not run[/]: {backend.name}: {escape(reason)}")
    for spec in specs:
        for name, cell in results[spec.name].items():
            if not cell.ok:
                console.print(f"[red]FAIL[/] {spec.name} / {name}: {cell.note}")
    if args.json:
        record = {
            spec.name: {name: dataclasses_asdict(cell) for name, cell in results[spec.name].items()}
            for spec in specs
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    console.print(
        f"{len(specs)} workloads x {len(runnable)} backends: "
        f"{'all within tolerance' if not failures else f'{failures} FAILED'}"
    )
    return 1 if failures else 0


def dataclasses_asdict(cell) -> dict:
    return {"error": cell.error, "ok": cell.ok, "note": cell.note}


def cmd_bench(args) -> int:
    gpu = getattr(args, "gpu", False)
    module = "benchmarks.gpu_decode" if gpu else "benchmarks.run"
    try:
        bench = importlib.import_module(module)
    except ImportError as e:
        print(f"jax-attn bench: the benchmark suite is not available here ({e})", file=sys.stderr)
        return 2
    return bench.run(args) if gpu else bench.main(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jax-attn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, devices, which backends run here and why not")
    check = sub.add_parser("check", help="cross-check every backend against the float64 oracle")
    check.add_argument("--seed", type=int, default=None, help="random seed (default: fresh)")
    check.add_argument("--quick", action="store_true", help="a smaller grid")
    check.add_argument("--backends", help="comma-separated backend names to run")
    check.add_argument("--json", help="also write the results to this JSON file")
    bench = sub.add_parser("bench", help="side-by-side timings with the memory-copy floor")
    bench.add_argument("--workloads", help="comma-separated workload names")
    bench.add_argument("--reps", type=int, default=None)
    bench.add_argument("--json", help="write the results to this JSON file")
    bench.add_argument("--quick", action="store_true")
    bench.add_argument(
        "--gpu", action="store_true", help="the GPU suite (benchmarks/gpu_decode.py) instead"
    )
    args = parser.parse_args(argv)
    return {"info": cmd_info, "check": cmd_check, "bench": cmd_bench}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())

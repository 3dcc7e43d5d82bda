"""The `jax-attn` command: `info`, `check`, `bench`, `fuzz`.

`info`, `check` and `fuzz` live here. Other subcommands come from installed packages through
the entry-point group `jax_attn.commands` (a module with `add_parser(subparsers)` and
`run(args)`), the way the "JAX" torch backend reaches `torch_backends`: this distribution
registers `bench` there (`benchmarks.command`), so `interop` never imports the benchmarks,
which sit a floor above it and may import everything.
"""

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
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
    versions.add_row("xformers compiled ops", escape(_xformers_ops()))
    versions.add_row("native kernels", escape(_native_kernels()))
    console.print(versions)
    if getattr(args, "gpu_compile", False):
        return _gpu_compile_report(console)
    if getattr(args, "tpu_compile", False):
        return _tpu_compile_report(console)

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
        if reason is None:
            runnable.append(backend)
        else:
            skipped.append((backend, reason))
    specs = crosscheck.default_specs(quick=args.quick)

    results: dict[str, dict[str, crosscheck.Cell]] = {}
    jobs = [(spec, backend) for spec in specs for backend in runnable]
    problems = {}
    for spec, backend in track(jobs, description="cross-checking", console=console, transient=True):
        if spec.name not in problems:
            problems[spec.name] = crosscheck.make_problem(spec, rng)
        results.setdefault(spec.name, {})[backend.name] = crosscheck.check_cell(
            backend, problems[spec.name]
        )

    console.print(check_table(specs, runnable, results))
    for line in check_legend(specs, runnable):
        console.print(line, highlight=False)
    for backend, reason in skipped:
        console.print(f"[yellow]not run[/]: {backend.name}: {escape(reason)}")
    failures = 0
    for spec in specs:
        for name, cell in results[spec.name].items():
            if not cell.ok:
                failures += 1
                error = "" if cell.error is None else f" (max |error| {cell.error:.2e})"
                console.print(f"[red]FAIL[/] {spec.name} / {name}{error}: {escape(cell.note)}")
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


def _cell_text(cell) -> str:
    """At most 7 characters, so that the table fits 80 columns with 8 backends."""
    if cell.error is None:
        return "n/a" if cell.ok else "[red]ERROR"
    if not cell.ok:
        return "[red]FAIL"
    return f"{cell.error:.0e}"


def check_table(specs, backends, results):
    """The `jax-attn check` table: one line per workload, one short column per backend (the
    details, the column names and the failures are printed under it)."""
    from rich import box
    from rich.table import Table

    table = Table(
        title="max |error| vs the float64 oracle",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    table.add_column("workload", no_wrap=True)
    for backend in backends:
        table.add_column(backend.short, justify="right", no_wrap=True)
    for spec in specs:
        table.add_row(spec.name, *[_cell_text(results[spec.name][b.name]) for b in backends])
    return table


def check_legend(specs, backends) -> list[str]:
    """Lines under the table: what each workload is, its tolerance, and the column names."""
    width = max(len(s.name) for s in specs)
    lines = [
        f"[dim]{spec.name:<{width}}[/] {spec.describe()}, tol {spec.tolerance[0]:.0e}"
        for spec in specs
    ]
    named = [f"{b.short}={b.name}" for b in backends if b.short != b.name]
    if named:
        lines.append("[dim]columns:[/] " + ", ".join(named) + "; n/a: not supported there")
    return lines


def _native_kernels() -> str:
    """Whether the native CPU kernels load here: jax_attn.cpu's XLA library and
    torch_backends.native's torch ops (each built on first use)."""
    try:
        from jax_attn import cpu

        xla = cpu.unavailable_reason()
    except ImportError as e:
        xla = f"does not import ({e})"
    try:
        from torch_backends import native

        torch_ops = native.unavailable_reason()
    except ImportError as e:
        torch_ops = f"does not import ({e})"
    text = "; ".join(
        f"{label}: " + ("built" if reason is None else reason)
        for label, reason in (("XLA", xla), ("torch ops", torch_ops))
    )
    isa = cpu.isa() if xla is None else None
    return text + (f" ({isa})" if isa else "")


def _xformers_ops() -> str:
    """Whether xformers' C++/CUDA ops loaded, and what to do when they did not."""
    try:
        from torch_backends import xformers
    except ImportError as e:
        return f"not available: {e}"
    problem = xformers.compiled_ops_problem()
    return "loaded" if problem is None else f"NOT loaded: {problem}"


def _gpu_compile_report(console) -> int:
    """`info --gpu-compile`: compile both Pallas kernels over the grid for an H100 and an
    A100 description (no GPU needed) and print grid, warps, shared memory, registers, spills."""
    from jax_attn.pallas import gpu_compile

    reason = gpu_compile.unavailable_reason()
    if reason is not None:
        console.print(f"[red]no GPU compile here:[/red] {reason}")
        return 2
    reports = []
    for target in gpu_compile.TARGETS.values():
        for config in gpu_compile.default_grid(target):
            reports.append(gpu_compile.compile_kernel(config, target))
            # Plain print: rich would wrap the 120-column rows at the terminal's width.
            print(gpu_compile.format_table(reports[-1:]).splitlines()[-1], flush=True)
    print()
    print(gpu_compile.format_table(reports))
    bad = [r for r in reports if r.problems()]
    console.print(f"{len(reports) - len(bad)} of {len(reports)} compiles within the limits")
    return 1 if bad else 0


def _tpu_compile_report(console) -> int:
    """`info --tpu-compile`: compile both Pallas TPU kernels over the grid for a v5e, v6e and
    v5p description (no TPU needed), each beside JAX's own kernel for the same problem, and
    print grid, blocks and VMEM (plan estimate, traced buffers, limit asked, chip capacity)."""
    from jax_attn.pallas import tpu_compile

    reason = tpu_compile.unavailable_reason()
    if reason is not None:
        console.print(f"[red]no TPU compile here:[/red] {reason}")
        return 2
    ours, peers = [], []
    for target in tpu_compile.TARGETS.values():
        for config in tpu_compile.default_grid():
            ours.append(tpu_compile.compile_kernel(config, target))
            peers.append(tpu_compile.compile_jax_peer(config, target))
            # Plain print: rich would wrap the wide rows at the terminal's width.
            rows = tpu_compile.format_table([ours[-1], peers[-1]]).splitlines()[-2:]
            print("\n".join(rows), flush=True)
    print()
    print(tpu_compile.format_table([r for pair in zip(ours, peers, strict=True) for r in pair]))
    bad = [r for r in ours if r.problems()]
    taken = sum(p.ok for p in peers)
    console.print(
        f"{len(ours) - len(bad)} of {len(ours)} compiles within the chips' VMEM; JAX's own "
        f"kernels compiled {taken} of the same {len(peers)} problems"
    )
    return 1 if bad else 0


def cmd_fuzz(args) -> int:
    """Fuzz each backend (or the one named) for `--minutes`; print counterexamples as tests.
    With `--sanitize` and/or `--portable` the campaign runs in a child process whose native
    kernels are built that way (valid input: the serving sizes' long rows and large heads under
    ASan + UBSan)."""
    if args.bad_metadata:
        return cmd_fuzz_bad_metadata(args)
    if args.torch_ops:
        return cmd_fuzz_torch_ops(args)
    if args.sanitize or args.portable:
        argv = ["fuzz", "--minutes", str(args.minutes), "--seed", str(args.seed)]
        argv += ["--sizes", args.sizes] + (["--backend", args.backend] if args.backend else [])
        return _run_child([sys.executable, "-m", "interop.cli", *argv], _fuzz_child_env(args))
    from interop import crosscheck, fuzz

    names = [b.name for b in crosscheck.all_backends()]
    if args.backend:
        if args.backend not in names:
            print(f"--backend={args.backend!r} is not one of {names}", file=sys.stderr)
            return 2
        names = [args.backend]
    runnable = []
    for name in names:
        reason = fuzz.backends()[name].why_unavailable()
        if reason is None:
            runnable.append(name)
        else:
            print(f"not run: {name}: {reason}")
    failures = 0
    for name in runnable:
        report = fuzz.fuzz_backend(name, args.minutes * 60.0, seed=args.seed, sizes=args.sizes)
        print(
            f"{name}: {report.examples} examples ran in {report.seconds / 60:.1f} min "
            f"(and {report.not_applicable} n/a, not counted), "
            + ("no counterexample" if report.counterexample is None else "COUNTEREXAMPLE:")
        )
        if report.counterexample is not None:
            failures += 1
            print(fuzz.pytest_source(name, report.counterexample, report.cell))
    return 1 if failures else 0


def cmd_fuzz_bad_metadata(args) -> int:
    """`--bad-metadata`: garbage metadata into the native kernels under jit, each kernel (or
    `--backend ragged|decode`) for `--minutes` in a child process, optionally built with ASan +
    UBSan (`--sanitize`) and without AVX-512 (`--portable`). A crash is the child's exit."""
    from interop import bad_input, bad_metadata

    return bad_input.run_children(
        "interop.bad_metadata", list(bad_metadata.KERNELS), backend=args.backend,
        minutes=args.minutes, seed=args.seed, env=_fuzz_child_env(args),
    )  # fmt: skip


def _run_child(argv: list, env: dict) -> int:
    """Runs `argv` with `env` in a child process; its exit status."""
    return subprocess.run(argv, env=env).returncode


def _fuzz_child_env(args) -> dict:
    """A fuzzer child's environment (bad input or the backends' campaign): the kernels built
    with ASan + UBSan (`--sanitize`) and/or without AVX-512 (`--portable`), else as they are."""
    from interop import bad_metadata

    extra = bad_metadata.PORTABLE_FLAGS if args.portable else ""
    if args.sanitize:
        env = bad_metadata.sanitizer_env(extra)
    else:
        env = {**os.environ, "JAX_ATTN_CPU_EXTRA_FLAGS": extra} if extra else dict(os.environ)
    return env


def cmd_fuzz_torch_ops(args) -> int:
    """`--torch-ops`: bad input into the native torch ops, each op (or `--backend OP`) for
    `--minutes` in a child process, optionally built with ASan + UBSan (`--sanitize`) and
    without AVX-512 (`--portable`). A crash is the child's exit."""
    from interop import bad_input, bad_torch_ops

    return bad_input.run_children(
        "interop.bad_torch_ops", list(bad_torch_ops.OPS), backend=args.backend,
        minutes=args.minutes, seed=args.seed, env=_fuzz_child_env(args),
    )  # fmt: skip


def dataclasses_asdict(cell) -> dict:
    return {"error": cell.error, "ok": cell.ok, "note": cell.note}


COMMANDS_GROUP = "jax_attn.commands"


def plugin_commands() -> dict:
    """Subcommand name -> its module, from the installed entry points (`COMMANDS_GROUP`)."""
    return {ep.name: ep.load() for ep in importlib.metadata.entry_points(group=COMMANDS_GROUP)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jax-attn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, devices, which backends run here and why not")
    info.add_argument(
        "--gpu-compile",
        action="store_true",
        help="also compile the Pallas kernels for an H100 and an A100 description (no GPU "
        "needed; the gpu-aot environment) and print launch, shared memory, registers, spills",
    )
    info.add_argument(
        "--tpu-compile",
        action="store_true",
        help="also compile the Pallas TPU kernels for a v5e, v6e and v5p description beside "
        "JAX's own (no TPU needed; the tpu-aot environment) and print grid, blocks and VMEM",
    )
    check = sub.add_parser("check", help="cross-check every backend against the float64 oracle")
    check.add_argument("--seed", type=int, default=None, help="random seed (default: fresh)")
    check.add_argument("--quick", action="store_true", help="a smaller grid")
    check.add_argument("--backends", help="comma-separated backend names to run")
    check.add_argument("--json", help="also write the results to this JSON file")
    plugins = plugin_commands()
    for plugin in plugins.values():
        plugin.add_parser(sub)
    fuzz = sub.add_parser(
        "fuzz", help="property-based fuzzing of every backend against the float64 oracle"
    )
    fuzz.add_argument("--minutes", type=float, default=5.0, help="per backend (default 5)")
    fuzz.add_argument("--backend", help="one backend name (default: every one that runs here)")
    fuzz.add_argument("--seed", type=int, default=0, help="first hypothesis seed (default 0)")
    fuzz.add_argument(
        "--sizes",
        choices=["unit", "serving"],
        default="unit",
        help="example sizes: unit (short sequences, quick; the default) or serving (long "
        "sequences, blocks to 256, head sizes to 256 and 512 for the JAX core: the kernels' "
        "split and multi-step paths)",
    )
    fuzz.add_argument(
        "--bad-metadata",
        action="store_true",
        help="fuzz the native CPU kernels with garbage metadata under jit instead "
        "(--backend ragged|decode; interop/bad_metadata.py)",
    )
    fuzz.add_argument(
        "--torch-ops",
        action="store_true",
        help="fuzz the native torch ops (torch.ops.jax_attn.*) with bad input instead "
        "(--backend store_split|store_token_major|copy_blocks|gather_split_blocks|"
        "paged_decode_split|ragged_paged_attention; "
        "interop/bad_torch_ops.py)",
    )
    fuzz.add_argument(
        "--sanitize",
        action="store_true",
        help="the native kernels built with ASan + UBSan (for the backends' fuzzing as well as "
        "--bad-metadata and --torch-ops)",
    )
    fuzz.add_argument(
        "--portable",
        action="store_true",
        help="the native kernels' portable build (-march=x86-64-v3, no AVX-512), as --sanitize",
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"] and "bench" not in plugins:
        parser.error(
            "`bench` comes from the installed package's entry points (group "
            f"{COMMANDS_GROUP!r}): install the project, e.g. pip install -e ."
        )
    args = parser.parse_args(argv)
    commands = {"info": cmd_info, "check": cmd_check, "fuzz": cmd_fuzz}
    commands |= {name: plugin.run for name, plugin in plugins.items()}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())

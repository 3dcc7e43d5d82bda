"""`jax-attn bench`: the subcommand's arguments and entry, beside the suites it runs.

Registered as the `bench` subcommand of `jax-attn` through the entry-point group
`jax_attn.commands` (pyproject.toml): `interop.cli` finds it there, adds this parser and calls
`run`, and no module imports the benchmarks. Importing this module is cheap: the suites
(`benchmarks.run` on CPU, `benchmarks.gpu_decode` with `--gpu`,
`benchmarks.mesh` with `--mesh`, `benchmarks.plot` with `--plot`) load when the command runs.
"""

import argparse

from benchmarks.engine_v1 import DTYPES as ENGINE_DTYPES
from benchmarks.sentinels import CHECK_RUN, DEFAULT_JSON


def add_parser(subparsers) -> argparse.ArgumentParser:
    bench = subparsers.add_parser(
        "bench", help="side-by-side timings with the memory-copy and read floors"
    )
    bench.add_argument(
        "--workloads",
        help="comma-separated workload names (`decode-bf16-bs128`) or shell-style patterns "
        "(`'*-bs128'`); a name without its block size (`decode-bf16`) is its block-16 workload",
    )
    # dest "reps": the GPU and mesh suites read the same attribute.
    bench.add_argument(
        "--rounds",
        "--reps",
        dest="reps",
        type=int,
        default=None,
        metavar="N",
        help="N alternated rounds per workload, every peer once per round in a rotated order; "
        "the record keeps every round (default: each workload's own, cut short past 45 s once "
        "5 are done)",
    )
    bench.add_argument(
        "--json",
        nargs="?",
        const=DEFAULT_JSON,
        metavar="PATH",
        help="write the record to PATH; without PATH, to benchmarks/results/"
        "cpu-ENV-env-KIND.json, named for the environment and the CPU kind "
        "(e.g. cpu-vllm-env-intel-sapphire-rapids.json)",
    )
    bench.add_argument("--quick", action="store_true")
    bench.add_argument(
        "--busy",
        nargs="?",
        const=1,
        type=int,
        metavar="N",
        help="also time every peer beside N busy processes (default 1) that the bench starts: "
        "pure-CPU spinners, stopped except while a busy call is timed, so each round times "
        "each peer quiet and then loaded; the record keeps both and their ratio, judged "
        "against the fair share of the cores (benchmarks/busy.py)",
    )
    bench.add_argument(
        "--no-guard",
        action="store_true",
        help="time every sample as it comes: no FMA probe readings around each one, none "
        "taken again when a reading shows the machine short of its cores (benchmarks/guard.py)",
    )
    bench.add_argument(
        "--check",
        nargs="?",
        const=CHECK_RUN,
        metavar="RECORD",
        help="judge the targets on the medians and exit 1 naming each one missed; with "
        "RECORD (a --json file), judge that record instead of running",
    )
    bench.add_argument(
        "--vllm085-python",
        metavar="PATH",
        help="the vllm085 environment's python, for the vllm085-TORCH_SDPA peer (default: "
        "$JAX_ATTN_VLLM085_PYTHON, else the cached env scripts/env.sh vllm085 built, if any)",
    )
    bench.add_argument(
        "--gpu", action="store_true", help="the GPU suite (benchmarks/gpu_decode.py) instead"
    )
    bench.add_argument(
        "--engine",
        action="store_true",
        help="vLLM 0.32's engine with its CPU_ATTN, with the jax-attn plugin and with no "
        "attention, A/B alternated, tokens/s (benchmarks/engine_v1.py; the vllm env)",
    )
    bench.add_argument(
        "--huge-pages-ab",
        action="store_true",
        help="with --engine: also the plugin on the 4 KiB pages vLLM gives its cache "
        "(JAX_ATTN_VLLM_HUGE_PAGES=0) and vLLM's CPU_ATTN on torch's huge-page allocator "
        "(THP_MEM_ALLOC_ENABLE=1)",
    )
    bench.add_argument(
        "--keep-freed-ab",
        action="store_true",
        help="with --engine: also both engines with glibc keeping freed blocks for reuse "
        "(MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ raised), where vLLM's per-step outputs "
        "come back as fresh pages otherwise",
    )
    bench.add_argument(
        "--output-pages-ab",
        action="store_true",
        help="with --engine: also the plugin with the kernels' large outputs on huge pages and "
        "on 4 KiB pages (JAX_ATTN_CPU_HUGE_OUTPUT=1 / 0), beside the default (huge pages, 4 KiB "
        "pages after a slow one)",
    )
    bench.add_argument(
        "--compiled",
        action="store_true",
        help="with --engine: vLLM's default compiled model (inductor) instead of enforce_eager",
    )
    bench.add_argument(
        "--dtypes",
        metavar="LIST",
        help="with --engine: the model dtypes to run, comma-separated, from "
        f"{','.join(ENGINE_DTYPES)} (default: both)",
    )
    bench.add_argument(
        "--speculative",
        type=int,
        metavar="N",
        help="with --engine: speculative decoding, N draft tokens a step by n-gram lookup "
        "(vLLM's ngram method): the steps after the prefill verify up to N + 1 tokens a request",
    )
    bench.add_argument(
        "--mesh",
        help="strong scaling of a decode step over a mesh, e.g. tp=4 or tp=4,dp=2 "
        "(benchmarks/mesh.py; simulated CPU devices where the host has too few)",
    )
    bench.add_argument(
        "--plot",
        metavar="RECORD",
        help="draw a recorded run (a --json file, e.g. benchmarks/results/*.json) as a PNG "
        "instead of running: peers side by side per workload, time and fraction of the floor "
        "(benchmarks/plot.py; needs matplotlib)",
    )
    bench.add_argument(
        "--out", metavar="PNG", help="with --plot: the image (default: RECORD with .png)"
    )
    return bench


def run(args: argparse.Namespace) -> int:
    cpu_only = [
        flag
        for flag, given in (
            ("--json without a PATH", getattr(args, "json", None) == DEFAULT_JSON),
            ("--check", getattr(args, "check", None) is not None),
        )
        if given
    ]
    other = next((f for f in ("gpu", "mesh", "plot", "engine") if getattr(args, f, None)), None)
    if cpu_only and other:
        print(f"{cpu_only[0]} is for the CPU suite, not with --{other}")
        return 2
    engine_flags = ("huge_pages_ab", "keep_freed_ab", "output_pages_ab", "compiled", "dtypes",
                    "speculative")  # fmt: skip
    for flag in engine_flags:
        if getattr(args, flag, None) not in (None, False) and other != "engine":
            print(f"--{flag.replace('_', '-')} is for the engine bench: use it with --engine")
            return 2
    if getattr(args, "plot", None):
        from benchmarks import plot

        return plot.main(args)
    if getattr(args, "mesh", None):
        from benchmarks import mesh

        return mesh.run(args)
    if getattr(args, "engine", False):
        from benchmarks import engine_v1

        return engine_v1.run(args)
    if getattr(args, "gpu", False):
        from benchmarks import gpu_decode

        return gpu_decode.run(args)
    from benchmarks import run as cpu_suite

    return cpu_suite.main(args)

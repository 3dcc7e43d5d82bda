"""`jax-attn bench`: the subcommand's arguments and entry, beside the suites it runs.

Registered as the `bench` subcommand of `jax-attn` through the entry-point group
`jax_attn.commands` (pyproject.toml): `interop.cli` finds it there, adds this parser and calls
`run`, and no module imports the benchmarks. Importing this module is cheap: the suites
(`benchmarks.run` on CPU, `benchmarks.gpu_decode` with `--gpu`,
`benchmarks.mesh` with `--mesh`, `benchmarks.plot` with `--plot`) load when the command runs.
"""

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    bench = subparsers.add_parser(
        "bench", help="side-by-side timings with the memory-copy and read floors"
    )
    bench.add_argument("--workloads", help="comma-separated workload names")
    bench.add_argument("--reps", type=int, default=None)
    bench.add_argument("--json", help="write the results to this JSON file")
    bench.add_argument("--quick", action="store_true")
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
    if getattr(args, "plot", None):
        from benchmarks import plot

        return plot.main(args)
    if getattr(args, "mesh", None):
        from benchmarks import mesh

        return mesh.run(args)
    if getattr(args, "gpu", False):
        from benchmarks import gpu_decode

        return gpu_decode.run(args)
    from benchmarks import run as cpu_suite

    return cpu_suite.main(args)

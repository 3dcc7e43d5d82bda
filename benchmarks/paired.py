"""Paired A/B of one workload between two source trees, or two settings of one tree.

    python -m benchmarks.paired WORKLOAD TREE_A TREE_B [--seconds 30] [--pairs 2]
        [--peer jax-cpu] [--env-a NAME=VALUE] [--env-b NAME=VALUE] [--cache-resident]
        [--json PATH]

Each side gets a warm worker process that imports `benchmarks` (and so the kernels, built from
that tree's sources) from its own tree, with its own extra environment. The two take turns
running slices of about `--slice` seconds of calls, with a short pause before each, so that
the machine's drift falls on both alike: on the 2-core VMs this project is measured on, the
same step drifted 4-7 ms between rounds of whole processes, while neighbouring slices
differ by a few percent. Each slice's median over its calls is divided by the other side's
neighbouring slice; the answer is the median of those paired ratios, A's time over B's (above
1: B is faster), with its quartiles. The order the two workers start in tells: two workers of
one tree and one setting (A/A) on decode-f32-bs128, four pairs, gave 1.041 and 1.027 with A's
worker started first, 0.984 and 0.977 with B's (the later one ~3% faster; 2-core Zen 5 VM,
2026-12-03). So the time is shared among `--pairs` pairs of fresh workers (default 2), started
A first, then B first, and so on; the slices of all pairs are pooled (that A/A: 0.998), and each
pair's own median is kept and printed. It is a development tool for one change's effect
on this machine; `jax-attn bench` makes the records against the peers.

WORKLOAD is a name from the bench's suite (`decode-f32-bs128`, `prefill-8x512-bs16`, ...).
`--cache-resident` points every block table at the first sequence's blocks: the same math
over keys that stay in the caches (the kernel's compute alone). `--env-a` / `--env-b` compare
two settings of one tree (e.g. `JAX_ATTN_CPU_NTA_LIMIT=0`); `--workload-b` gives B another
workload of the suite (e.g. `prefill-bf16-bs128` against `prefill-8x512-bs128`), and
`--peer-b` another peer (e.g. `TORCH_SDPA` against `jax-cpu` on one workload).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PAUSE_S = 0.05  # before each slice: the other side's worker threads go idle


def _worker(tree: str, workload: str, peer: str, resident: bool, quick: bool) -> None:
    """Serves slices: reads a call count per line, answers the calls' durations (JSON)."""
    sys.path.insert(0, tree)
    import numpy as np

    from benchmarks import backends, workloads

    specs = workloads.named_workloads(quick=quick)
    if workload not in specs:
        raise SystemExit(f"paired: workload {workload!r} is not in the suite: {sorted(specs)}")
    data = workloads.make_data(specs[workload], np.random.default_rng(0))
    if resident:
        data.block_tables[:] = data.block_tables[0]
    peers = {p.name: p for p in backends.PEERS}
    if peer not in peers:
        raise SystemExit(f"paired: peer {peer!r} is not one of {sorted(peers)}")
    why = peers[peer].why_unavailable()
    if why is not None:
        raise SystemExit(f"paired: {peer} does not run here: {why}")
    prepared = peers[peer].prepare(data)
    prepared.call()
    prepared.call()
    print("ready", flush=True)
    for line in sys.stdin:
        times = []
        for _ in range(int(line)):
            start = time.perf_counter()
            prepared.call()
            times.append(time.perf_counter() - start)
        print(json.dumps(times), flush=True)


def _start(tree: str, workload: str, peer: str, args, env_pairs: list[str]) -> subprocess.Popen:
    env = dict(os.environ)
    for pair in env_pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"paired: --env-a / --env-b take NAME=VALUE, not {pair!r}")
        env[name] = value
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", tree]
    command += [workload, "--peer", peer] + ["--cache-resident"] * args.cache_resident
    command += ["--quick"] * args.quick
    worker = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    if worker.stdout.readline().strip() != "ready":
        worker.kill()
        raise SystemExit(f"paired: the worker for {tree} did not start (its error is above)")
    return worker


def _slice(worker: subprocess.Popen, calls: int) -> float:
    time.sleep(PAUSE_S)
    worker.stdin.write(f"{calls}\n")
    worker.stdin.flush()
    return statistics.median(json.loads(worker.stdout.readline()))


def _pair(args, seconds: float, b_first: bool) -> tuple[list[float], list[float], int]:
    """One pair of fresh workers, B's started first when `b_first`, alternating slices for
    `seconds` (at least 4 each): A's and B's slice medians, and the calls per slice."""
    sides = ((args.tree_a, args.workload, args.peer, args.env_a),
             (args.tree_b, args.workload_b, args.peer_b, args.env_b))  # fmt: skip
    workers: list[subprocess.Popen | None] = [None, None]
    try:
        for side in (1, 0) if b_first else (0, 1):
            tree, workload, peer, env = sides[side]
            workers[side] = _start(tree, workload, peer, args, env)
        calls = max(1, round(args.slice / _slice(workers[0], 3)))
        medians: tuple[list[float], list[float]] = ([], [])
        end = time.monotonic() + seconds
        turn = 0
        while time.monotonic() < end or len(medians[1]) < 4:
            for side in (0, 1) if turn % 2 == 0 else (1, 0):  # each side first in turn
                medians[side].append(_slice(workers[side], calls))
            turn += 1
    finally:
        for worker in workers:
            if worker is not None:
                worker.stdin.close()
                worker.wait()
    return medians[0], medians[1], calls


def compare(args) -> dict:
    """Runs the alternation, `--pairs` pairs of fresh workers in turn (the first with A's worker
    started first, the next with B's, ...); the result as a dict (also printed)."""
    for tree in (args.tree_a, args.tree_b):
        if not (Path(tree) / "benchmarks" / "workloads.py").is_file():
            raise SystemExit(f"paired: {tree} is not a jax-attn tree (no benchmarks/workloads.py)")
    medians: tuple[list[float], list[float]] = ([], [])
    pairs = []
    for i in range(args.pairs):
        a, b, calls_i = _pair(args, args.seconds / args.pairs, b_first=i % 2 == 1)
        medians[0].extend(a)
        medians[1].extend(b)
        pair_ratios = [x / y for x, y in zip(a, b, strict=True)]
        pairs.append({"b_started_first": i % 2 == 1, "a_over_b": statistics.median(pair_ratios),
                      "slices": len(pair_ratios), "calls_per_slice": calls_i})  # fmt: skip
    calls = pairs[0]["calls_per_slice"]
    ratios = [a / b for a, b in zip(*medians, strict=True)]
    q1, q2, q3 = statistics.quantiles(ratios, n=4)
    result = {
        "workload": args.workload,
        "workload_b": args.workload_b,
        "peer": args.peer,
        "peer_b": args.peer_b,
        "cache_resident": args.cache_resident,
        "quick": args.quick,
        "a": {
            "tree": args.tree_a,
            "env": args.env_a,
            "median_ms": 1e3 * statistics.median(medians[0]),
        },
        "b": {
            "tree": args.tree_b,
            "env": args.env_b,
            "median_ms": 1e3 * statistics.median(medians[1]),
        },
        "a_over_b": q2,
        "quartiles": [q1, q3],
        "slices": len(ratios),
        "calls_per_slice": calls,
        "pairs": pairs,
        "slice_medians_s": [list(m) for m in medians],
    }
    workloads = args.workload + (
        "" if args.workload_b == args.workload else f" vs {args.workload_b}"
    )
    peers = args.peer + ("" if args.peer_b == args.peer else f" vs {args.peer_b}")
    print(
        f"{workloads} ({peers}{', cache-resident' if args.cache_resident else ''}): "
        f"A {result['a']['median_ms']:.3f} ms, B {result['b']['median_ms']:.3f} ms; A/B paired "
        f"median {q2:.3f} [quartiles {q1:.3f}, {q3:.3f}], {len(ratios)} slices of {calls} calls"
        + (
            "; per pair of workers: "
            + ", ".join(
                f"{p['a_over_b']:.3f} ({'B' if p['b_started_first'] else 'A'} started first)"
                for p in pairs
            )
            if len(pairs) > 1
            else ""
        )
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.paired", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("workload")
    ap.add_argument("tree_a")
    ap.add_argument("tree_b", nargs="?", help="default: tree_a (two settings of one tree)")
    ap.add_argument(
        "--seconds",
        type=float,
        default=30.0,
        help="alternation time, shared among the --pairs (each at least 4 slices a side)",
    )
    ap.add_argument("--slice", type=float, default=0.3, help="seconds of calls per slice")
    ap.add_argument(
        "--pairs",
        type=int,
        default=2,
        help="pairs of fresh workers, --seconds shared among them (each its own memory)",
    )
    ap.add_argument("--peer", default="jax-cpu")
    ap.add_argument("--peer-b", help="B's peer (default: --peer), e.g. TORCH_SDPA against jax-cpu")
    ap.add_argument(
        "--workload-b", help="B's workload (default: WORKLOAD), e.g. bf16 against float32"
    )
    ap.add_argument("--env-a", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--env-b", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--cache-resident", action="store_true")
    ap.add_argument("--quick", action="store_true", help="the suite's smoke sizes")
    ap.add_argument("--json", help="write the result, every slice's median included")
    args = ap.parse_args(argv)
    args.tree_b = args.tree_b or args.tree_a
    args.workload_b = args.workload_b or args.workload
    args.peer_b = args.peer_b or args.peer
    args.tree_a, args.tree_b = (str(Path(t).resolve()) for t in (args.tree_a, args.tree_b))
    if args.seconds <= 0 or args.slice <= 0 or args.pairs < 1:
        ap.error("--seconds and --slice must be positive, --pairs at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        ap = argparse.ArgumentParser()
        ap.add_argument("tree")
        ap.add_argument("workload")
        ap.add_argument("--peer")
        ap.add_argument("--cache-resident", action="store_true")
        ap.add_argument("--quick", action="store_true")
        w = ap.parse_args(argv[1:])
        _worker(w.tree, w.workload, w.peer, w.cache_resident, w.quick)
        return
    compare(parse(argv))


if __name__ == "__main__":
    main()

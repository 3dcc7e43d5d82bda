"""Sharded paged attention on a simulated mesh, run in a subprocess by test_sharding.py.

The device count is fixed when JAX starts, so these checks run in their own process with
`--xla_force_host_platform_device_count=8`; the rest of the suite keeps one device. Each
case prints one JSON line `{"case": ..., "ok": ..., ...}`; the parent test asserts per case.

    python tests/jax/sharded_cases.py SEED [CASE_ID ...]
"""

import os
import sys

if __name__ == "__main__":  # imported by the test module for `cases()`: leave its JAX alone
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import json
import re
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tolerances
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository

from tolerances import bound_ratio, max_error

import jax_attn
from jax_attn import RaggedMetadata
from jax_attn.sharding import PagedSharding

if __name__ == "__main__":
    jax.config.update("jax_numpy_dtype_promotion", "strict")

COLLECTIVE = re.compile(
    r"=\s*(\(?[^=]*?)\s(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
    r"(-start)?\("
)
FLOAT_TYPES = re.compile(r"\b(f8e4m3fn|f8e5m2|bf16|f16|f32|f64)\[")


def collectives(hlo: str) -> list[tuple[str, str]]:
    """(op, result type) of every collective in compiled HLO text."""
    return [(m.group(2), m.group(1).strip()) for m in COLLECTIVE.finditer(hlo)]


def float_collectives(hlo: str) -> list[tuple[str, str]]:
    """The collectives that move floating-point data (cache, K/V, queries, outputs)."""
    return [(op, ty) for op, ty in collectives(hlo) if FLOAT_TYPES.search(ty)]


def mesh_of(tp: int, dp: int) -> Mesh:
    devices = np.array(jax.devices()[: tp * dp])
    if dp == 1:
        return Mesh(devices, ("tp",))
    return Mesh(devices.reshape(dp, tp), ("dp", "tp"))


# A mixed batch: decode (q 1), prefill (q == seq), chunked prefill, decode past a block edge.
MIXED = [(1, 20), (7, 0), (3, 9), (1, 33)]
DECODE = [(1, 20), (1, 1), (1, 17), (1, 40)]


def build_group(rng, steps, *, hkv, head_size, block_size, num_blocks, kv_dtype):
    """One dp group's workload: block tables over a shuffled pool, the keys/values of every
    position (context + new tokens) and their slots, and the step's metadata."""
    q_lens = [q for q, _ in steps]
    ctx = [c for _, c in steps]
    need = [-(-(q + c) // block_size) for q, c in steps]
    pool = rng.permutation(num_blocks)[: sum(need)]
    tables, at = [], 0
    for n in need:
        tables.append(pool[at : at + n].tolist())
        at += n
    max_blocks = max(need)
    seq = len(steps)
    md = RaggedMetadata.build(
        q_lens, ctx, tables, block_size, pad_to=(seq + 1, sum(q_lens) + 2), max_blocks=max_blocks
    )
    # Every position written once: a "prefill" of whole sequences gives their slots.
    full = RaggedMetadata.build(
        [q + c for q, c in steps], [0] * seq, tables, block_size, max_blocks=max_blocks
    )
    total = int(full.slot_mapping.shape[0])
    k = jnp.asarray(rng.standard_normal((total, hkv, head_size)), kv_dtype)
    v = jnp.asarray(rng.standard_normal((total, hkv, head_size)), kv_dtype)
    return md, full.slot_mapping, k, v


def run_case(case: dict, seed: int) -> dict:
    tp, dp = case["tp"], case.get("dp", 1)
    hq, hkv = case["hq"], case["hkv"]
    d, bs, nb = case.get("head_size", 16), case.get("block_size", 8), case.get("num_blocks", 24)
    impl, kind = case["impl"], case.get("kind", "ragged")
    dtype = jnp.dtype(case.get("dtype", "float32"))
    cache_dtype = jnp.dtype(case.get("cache_dtype", dtype.name))
    rng = np.random.default_rng(seed)
    mesh = mesh_of(tp, dp)
    layout = PagedSharding(mesh, hq, hkv, tp_axis="tp", dp_axis="dp" if dp > 1 else None)
    steps = DECODE if kind == "decode" else MIXED
    groups = [
        build_group(rng, steps, hkv=hkv, head_size=d, block_size=bs, num_blocks=nb, kv_dtype=dtype)
        for _ in range(dp)
    ]
    scale_kw = {}
    if cache_dtype.itemsize == 1:
        scale_kw = dict(k_scale=jnp.float32(0.7), v_scale=jnp.float32(1.3))
    kw = dict(impl=impl)
    if impl == "pallas":
        # The GPU kernels through Pallas' generic interpreter, or the TPU kernels through its
        # TPU interpreter (DMAs and semaphores per device).
        kw["interpret"] = pltpu.InterpretParams() if case.get("tpu") else True
    if case.get("alibi"):
        kw["alibi_slopes"] = jax_attn.alibi_slopes(hq)
    if case.get("sinks"):  # attention sinks, [Hq] split over tp like the heads
        kw["sinks"] = jnp.asarray(3.0 * rng.standard_normal(hq), jnp.float32)
    cache_shape = (nb, bs, hkv, d)

    # One device, one dp group at a time.
    expected, queries, single_caches = [], [], []
    for md, slots, k, v in groups:
        kc = jnp.full(cache_shape, jnp.nan, cache_dtype)
        kc, vc = jax_attn.write_kv(kc, kc, k, v, slots, **scale_kw)
        single_caches.append((kc, vc))
        if kind == "decode":
            q = jnp.asarray(rng.standard_normal((md.seq_lens.shape[0], hq, d)), dtype)
            out = jax_attn.paged_decode(q, kc, vc, md.block_tables, md.seq_lens, **scale_kw, **kw)
        else:
            q = jnp.asarray(rng.standard_normal((md.slot_mapping.shape[0], hq, d)), dtype)
            out = jax_attn.paged_attention(q, kc, vc, md, **scale_kw, **kw)
        queries.append(q)
        expected.append(np.asarray(out.astype(jnp.float32)))
    expected = np.concatenate(expected)

    # The mesh: every group's pool and batch end to end, heads split over tp.
    wrong = case.get("wrong") == "cache_over_blocks"
    if wrong:  # the mistake the tests must catch: blocks split over tp instead of heads
        layout = _BlocksOverTp(mesh, hq, hkv, tp_axis="tp", dp_axis=layout.dp_axis)
        # The one-device caches, every head on every device, a quarter of the blocks each.
        kc, vc = (layout.put_cache(jnp.concatenate(c)) for c in zip(*single_caches, strict=True))
    else:
        kc = layout.put_cache(jnp.full(layout.kv_cache_shape(nb, bs, d), jnp.nan, cache_dtype))
        k = layout.put_heads(jnp.concatenate([layout.expand_kv_heads(g[2]) for g in groups]))
        v = layout.put_heads(jnp.concatenate([layout.expand_kv_heads(g[3]) for g in groups]))
        slots = jax.device_put(
            jnp.concatenate([g[1] for g in groups]), layout.sharding(layout.batch_spec)
        )
        kc, vc = layout.write_kv(kc, jnp.copy(kc), k, v, slots, **scale_kw)
    md = layout.put_metadata(layout.stack_metadata([g[0] for g in groups]))
    q = layout.put_heads(jnp.concatenate(queries))
    t0 = time.perf_counter()
    if kind == "decode":
        bt, sl = md.block_tables, md.seq_lens
        out = layout.paged_decode(q, kc, vc, bt, sl, **scale_kw, **kw)
        fn = layout_fn(layout, "paged_decode")
        hlo_args = (q, kc, vc, bt, sl)
    else:
        out = layout.paged_attention(q, kc, vc, md, **scale_kw, **kw)
        fn = layout_fn(layout, "paged_attention")
        hlo_args = (q, kc, vc, md)
    out.block_until_ready()
    first_s = time.perf_counter() - t0
    got = np.asarray(out.astype(jnp.float32))
    result = dict(
        out_spec=str(out.sharding.spec),
        err=max_error(got, expected),
        # The one tolerance rule against a peer (the one-device run): <= 1 is within.
        bound_ratio=bound_ratio(got, expected, dtype, cache_dtype, peer=True),
        finite=bool(np.isfinite(got).all()),
        first_call_s=round(first_s, 3),
    )
    hlo = fn(kw, scale_kw).lower(*hlo_args).compile().as_text()
    result["collectives"] = collectives(hlo)
    result["ok"] = result["bound_ratio"] <= 1 and not result["collectives"]
    return result


class _BlocksOverTp(PagedSharding):
    """The wrong layout: the cache split over its blocks on tp (every kv head on every
    device), the queries still over heads. With Hq / tp == Hkv the shapes still fit: each
    device pairs its query heads with the wrong kv heads, over a quarter of the blocks."""

    @property
    def cache_spec(self):
        return P(self.tp_axis, None, None, None)


def layout_fn(layout, kind):
    """The jitted shard_map the entry runs, for its HLO."""

    def get(kw, scale_kw):
        from jax_attn import sharding

        impl = kw["impl"]
        interpret = kw.get("interpret")
        per_head = ("alibi_slopes" in kw, "sinks" in kw)
        return sharding._sharded(layout, kind, impl, interpret, per_head, {})

    def lowered(kw, scale_kw):
        fn = get(kw, scale_kw)
        extra = (kw.get("alibi_slopes"), kw.get("sinks"), scale_kw.get("k_scale", 1.0),
                 scale_kw.get("v_scale", 1.0))  # fmt: skip
        return _Bound(fn, extra)

    return lowered


class _Bound:
    def __init__(self, fn, extra):
        self.fn, self.extra = fn, extra

    def lower(self, *args):
        return self.fn.lower(*args, *self.extra)


def run_gspmd(case: dict, seed: int) -> dict:
    """Plain `jax.jit` with NamedSharding inputs (no shard_map): what XLA's partitioner moves."""
    tp, hq, hkv = case["tp"], case["hq"], case["hkv"]
    d, bs, nb = 16, 8, 24
    rng = np.random.default_rng(seed)
    mesh = mesh_of(tp, 1)
    wrong = case.get("wrong") == "cache_over_blocks"
    cache_spec = P("tp", None, None, None) if wrong else P(None, None, "tp", None)
    heads = P(None, None, None) if wrong else P(None, "tp", None)
    md, slots, k, v = build_group(
        rng, MIXED, hkv=hkv, head_size=d, block_size=bs, num_blocks=nb, kv_dtype=jnp.float32
    )
    cs, hs, rs = (NamedSharding(mesh, s) for s in (cache_spec, heads, P()))
    kc = jax.device_put(jnp.full((nb, bs, hkv, d), jnp.nan, jnp.float32), cs)
    write = jax.jit(jax_attn.write_kv, out_shardings=(cs, cs))
    kc, vc = write(kc, jnp.copy(kc), jax.device_put(k, hs), jax.device_put(v, hs), slots)
    md = jax.device_put(md, rs)
    q = jax.device_put(
        jnp.asarray(rng.standard_normal((md.slot_mapping.shape[0], hq, d)), jnp.float32), hs
    )
    attend = jax.jit(
        lambda q, kc, vc, md: jax_attn.paged_attention(q, kc, vc, md, impl="xla"),
        out_shardings=hs,
    )
    decode = jax.jit(
        lambda q, kc, vc, bt, sl: jax_attn.paged_decode(q, kc, vc, bt, sl, impl="xla"),
        out_shardings=hs,
    )
    out = attend(q, kc, vc, md)
    local = jax_attn.paged_attention(
        jax.device_put(q, jax.devices()[0]),
        jax.device_put(kc, jax.devices()[0]),
        jax.device_put(vc, jax.devices()[0]),
        jax.device_put(md, jax.devices()[0]),
        impl="xla",
    )
    hlos = dict(
        write_kv=write.lower(kc, vc, k, v, slots).compile().as_text(),
        paged_attention=attend.lower(q, kc, vc, md).compile().as_text(),
        paged_decode=decode.lower(q[:4], kc, vc, md.block_tables[:4], md.seq_lens[:4])
        .compile()
        .as_text(),
    )
    result = dict(
        err=max_error(out, local),
        bound_ratio=bound_ratio(out, local, "float32", peer=True),
        float_collectives={n: float_collectives(h) for n, h in hlos.items()},
        index_collectives={
            n: [c for c in collectives(h) if c not in float_collectives(h)] for n, h in hlos.items()
        },
    )
    result["ok"] = result["bound_ratio"] <= 1 and not any(result["float_collectives"].values())
    return result


def run_refusal(case: dict, seed: int) -> dict:
    """A kernel XLA cannot partition, handed head-sharded arrays outside shard_map: refused."""
    layout = PagedSharding(mesh_of(4, 1), 8, 4)
    rng = np.random.default_rng(seed)
    md, _, _, _ = build_group(
        rng, MIXED, hkv=4, head_size=16, block_size=16, num_blocks=24, kv_dtype=jnp.float32
    )
    kc = layout.put_cache(jnp.asarray(rng.standard_normal((24, 16, 4, 16)), jnp.float32))
    q = layout.put_heads(jnp.asarray(rng.standard_normal((md.slot_mapping.shape[0], 8, 16))))
    # "auto" would pick a kernel XLA cannot partition: it takes the XLA path instead.
    auto = jax_attn.paged_attention(q, kc, kc, md)
    xla = jax_attn.paged_attention(q, kc, kc, md, impl="xla")
    if not np.array_equal(np.asarray(auto), np.asarray(xla)):
        return dict(ok=False, error="impl='auto' on sharded arrays differs from impl='xla'")
    try:
        jax_attn.paged_attention(q, kc, kc, md, impl="pallas")
    except ValueError as e:
        return dict(ok=True, message=str(e))
    return dict(ok=False, error="no ValueError for sharded arrays with impl='pallas'")


def cases() -> dict[str, dict]:
    out = {}
    for tp, hq, hkv in [(2, 8, 8), (4, 8, 2), (8, 8, 8), (4, 16, 4), (8, 8, 1), (4, 4, 4)]:
        for impl in ("xla", "reference"):
            out[f"tp{tp}-hq{hq}-hkv{hkv}-{impl}"] = dict(tp=tp, hq=hq, hkv=hkv, impl=impl)
    out["dp2xtp4-hq8-hkv4-xla"] = dict(tp=4, dp=2, hq=8, hkv=4, impl="xla")
    out["dp2xtp4-hq8-hkv1-xla-decode"] = dict(tp=4, dp=2, hq=8, hkv=1, impl="xla", kind="decode")
    out["dp2xtp4-hq8-hkv8-reference"] = dict(tp=4, dp=2, hq=8, hkv=8, impl="reference")
    out["tp4-hq8-hkv4-xla-decode"] = dict(tp=4, hq=8, hkv=4, impl="xla", kind="decode")
    out["tp4-hq8-hkv4-xla-alibi"] = dict(tp=4, hq=8, hkv=4, impl="xla", alibi=True)
    out["tp4-hq8-hkv2-xla-sinks"] = dict(tp=4, hq=8, hkv=2, impl="xla", sinks=True, alibi=True)
    out["tp4-hq8-hkv4-xla-bf16"] = dict(tp=4, hq=8, hkv=4, impl="xla", dtype="bfloat16")
    out["tp4-hq8-hkv4-xla-fp8"] = dict(tp=4, hq=8, hkv=4, impl="xla", cache_dtype="float8_e4m3fn")
    out["dp2xtp4-hq8-hkv2-xla-fp8-decode"] = dict(
        tp=4, dp=2, hq=8, hkv=2, impl="xla", cache_dtype="float8_e5m2", kind="decode"
    )
    out["tp2-hq8-hkv2-pallas"] = dict(tp=2, hq=8, hkv=2, impl="pallas", block_size=16)
    out["tp4-hq8-hkv4-pallas-decode"] = dict(
        tp=4, hq=8, hkv=4, impl="pallas", kind="decode", block_size=16
    )
    out["tp4-hq4-hkv1-pallas-decode"] = dict(
        tp=4, hq=4, hkv=1, impl="pallas", kind="decode", block_size=16
    )
    out["tp4-hq8-hkv2-pallas-tpu"] = dict(tp=4, hq=8, hkv=2, impl="pallas", tpu=True)
    out["tp2-hq8-hkv2-pallas-tpu-decode-fp8"] = dict(
        tp=2, hq=8, hkv=2, impl="pallas", tpu=True, kind="decode", cache_dtype="float8_e4m3fn"
    )
    out["tp4-hq8-hkv4-cpu"] = dict(tp=4, hq=8, hkv=4, impl="cpu", needs_cpu=True)
    out["tp4-hq8-hkv4-cpu-decode"] = dict(
        tp=4, hq=8, hkv=4, impl="cpu", kind="decode", needs_cpu=True
    )
    out["dp2xtp4-hq8-hkv2-cpu"] = dict(tp=4, dp=2, hq=8, hkv=2, impl="cpu", needs_cpu=True)
    out["dp2xtp4-hq8-hkv2-cpu-decode-sinks"] = dict(
        tp=4, dp=2, hq=8, hkv=2, impl="cpu", kind="decode", sinks=True, needs_cpu=True
    )
    out["tp8-hq8-hkv1-cpu-decode-fp8"] = dict(
        tp=8, hq=8, hkv=1, impl="cpu", kind="decode", cache_dtype="float8_e4m3fn", needs_cpu=True
    )
    out["wrong-tp4-cache-over-blocks"] = dict(
        tp=4, hq=16, hkv=4, impl="xla", wrong="cache_over_blocks"
    )
    for tp, hq, hkv in [(2, 8, 8), (4, 8, 4), (8, 8, 8), (4, 32, 4)]:
        out[f"gspmd-tp{tp}-hq{hq}-hkv{hkv}"] = dict(tp=tp, hq=hq, hkv=hkv, gspmd=True)
    out["refuse-pallas-on-sharded-arrays"] = dict(refusal=True)
    out["gspmd-wrong-tp4-cache-over-blocks"] = dict(
        tp=4, hq=8, hkv=4, gspmd=True, wrong="cache_over_blocks"
    )
    return out


def cpu_unavailable() -> str | None:
    from jax_attn import paged

    try:
        paged.cpu_kernels()
    except RuntimeError as e:
        return str(e)
    return None


def main(argv: list[str]) -> int:
    seed = int(argv[0])
    table = cases()
    names = argv[1:] or list(table)
    for name in names:
        case = table[name]
        t0 = time.perf_counter()
        try:
            if case.get("needs_cpu") and (why := cpu_unavailable()):
                # A skip, never an ok: the parent reports it as skipped (and the test command,
                # which requires the native kernels, fails on it).
                result = dict(skipped=f"native CPU kernels: {why}", ok=False)
            elif case.get("refusal"):
                result = run_refusal(case, seed)
            elif case.get("gspmd"):
                result = run_gspmd(case, seed)
            else:
                result = run_case(case, seed)
        except Exception as e:  # reported to the parent, which shows it
            result = dict(
                ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:]
            )
        result["case"] = name
        result["wall_s"] = round(time.perf_counter() - t0, 3)
        print(json.dumps(result, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

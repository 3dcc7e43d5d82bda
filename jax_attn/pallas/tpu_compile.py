"""Compile the Pallas TPU kernels for a TPU that is not here, beside JAX's own TPU kernels.

libtpu (the `libtpu` wheel) holds the whole TPU compiler: Mosaic for Pallas kernels and XLA:TPU
around them. With it installed and JAX started with `JAX_PLATFORMS=cpu`,
`jax.experimental.topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")`
describes a slice of chips whose devices compile but never run. Lowering a kernel with shape
structs on such a device, inside `jax.default_device(device)` (the Pallas TPU lowering reads the
chip from the default device), and compiling it runs Mosaic and XLA:TPU as a TPU host would:
VMEM over the chip's capacity fails that compile ("Ran out of memory in memory space vmem").

    target = TARGETS["v5e"]
    report = compile_kernel(KernelConfig("ragged", "bfloat16", "bfloat16", 128, 16), target)
    report.problems()   # [] when it compiled and its VMEM fits the chip

Before JAX starts, libtpu also needs to be kept from looking for a real TPU: `TPU_SKIP_MDS_QUERY=1
TPU_ACCELERATOR_TYPE=v5litepod-4 TPU_WORKER_HOSTNAMES=localhost TPU_WORKER_ID=0` (no metadata
server), and `ALLOW_MULTIPLE_LIBTPU_LOAD=1` where several processes compile at once (pytest -n),
which libtpu's lockfile otherwise forbids. `scripts/test.sh` sets them; so must a caller.

A report carries what the kernel asked of the chip, read from the traced `pallas_call` (grid,
scratch buffers, `vmem_limit_bytes`) and from the kernel's `Plan`, and the chip's published
figures from JAX (`pltpu.get_tpu_info_for_chip`). `compile_jax_peer` compiles JAX's own TPU
kernels (`jax.experimental.pallas.ops.tpu`) for the same problem. Nothing here runs a kernel:
these are compile-time facts, and `roofline` gives time floors from published figures, never
timings.
"""

import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_attn.pallas import tpu_attention

KiB, MiB = 1024, 1024**2


@dataclasses.dataclass(frozen=True)
class TpuTarget:
    """A TPU slice that libtpu can describe (`topology`) and the chip JAX's figures name."""

    name: str
    topology: str  # get_topology_desc(topology_name=...)
    chip: str  # pltpu.ChipVersion value
    tensor_cores: int  # TensorCores behind one JAX device (2: v5p's megacore)

    def info(self):
        """JAX's published figures for this chip (`pltpu.get_tpu_info_for_chip`), per
        TensorCore."""
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.get_tpu_info_for_chip(pltpu.ChipVersion(self.chip), self.tensor_cores)

    @property
    def vmem_capacity(self) -> int:
        """VMEM of one TensorCore: what one kernel instance may use."""
        return self.info().vmem_capacity_bytes

    @property
    def hbm_bandwidth(self) -> float:
        """Bytes / s of one JAX device (all its TensorCores)."""
        return self.info().mem_bw_bytes_per_second * self.tensor_cores

    @property
    def bf16_flops(self) -> float:
        """bf16 MXU operations / s of one JAX device."""
        return self.info().bf16_ops_per_second * self.tensor_cores


TARGETS = {
    t.name: t
    for t in (
        TpuTarget("v5e", "v5e:2x2", "v5e", 1),
        TpuTarget("v6e", "v6e:2x2", "v6e", 1),
        TpuTarget("v5p", "v5p:2x2x1", "v5p", 2),
    )
}


def unavailable_reason() -> str | None:
    """Why kernels cannot be compiled for a described TPU here, or None when they can."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return (
            "libtpu is not installed (libtpu 0.0.42.* with jax 0.10.2; `bash scripts/env.sh "
            "tpu-aot` builds an environment with it)"
        )
    try:
        compile_device(TARGETS["v5e"].name)
    except Exception as e:  # libtpu did not start (JAX_PLATFORMS unset, lockfile, ...): say why
        return (
            f"no compile-only TPU device ({type(e).__name__}: {' '.join(str(e).split())[:200]}); "
            "JAX must start with JAX_PLATFORMS=cpu and the TPU_* variables of docs/tpu.md"
        )
    return None


@functools.cache
def topology(target: str):
    """`TARGETS[target]`'s slice, described (its `.devices` compile, no TPU needed)."""
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name=TARGETS[target].topology, platform="tpu")


def compile_device(target: str):
    """A compile-only device of `TARGETS[target]`'s slice (no TPU needed)."""
    return topology(target).devices[0]


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One kernel instance to compile. `pages_per_step` and `block_q` override the kernel's
    plan (None: its own choice)."""

    kernel: str  # "decode" | "ragged"
    query_dtype: str  # bfloat16 | float32
    cache_dtype: str  # bfloat16 | float8_e4m3fn | ...
    head_size: int
    block_size: int
    group: int = 4  # query heads per kv head
    alibi: bool = False
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    num_kv_heads: int = 8
    pages_per_step: int | None = None
    block_q: int | None = None

    @property
    def features(self) -> str:
        names = [
            name
            for name, on in (
                ("alibi", self.alibi),
                ("window", self.sliding_window is not None),
                ("softcap", self.logits_soft_cap is not None),
            )
            if on
        ]
        return "+".join(names) or "-"

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.group

    @property
    def id(self) -> str:
        short = {"bfloat16": "bf16", "float32": "f32", "float8_e4m3fn": "e4m3"}
        q, c = (short.get(d, d) for d in (self.query_dtype, self.cache_dtype))
        plan = "" if self.pages_per_step is None else f"-P{self.pages_per_step}"
        return (
            f"{self.kernel}-q{q}-kv{c}-D{self.head_size}-BS{self.block_size}-G{self.group}-"
            f"H{self.num_kv_heads}-{self.features}{plan}"
        )


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """What compiling one kernel for one `TpuTarget` gave. `kernel` names whose kernel it is
    ("jax-attn", or JAX's `ragged_paged_attention` / `paged_attention`)."""

    config: KernelConfig
    target: str
    kernel: str = "jax-attn"
    error: str | None = None
    grid: tuple[int, ...] = ()
    block_q: int = 0  # query tokens per program
    block_k: int = 0  # keys per loop step
    pages_per_step: int = 0
    vmem_plan: int | None = None  # Plan.vmem_bytes (our kernels only)
    vmem_traced: int = 0  # the traced pallas_call's VMEM buffers, (8, 128)-padded
    vmem_limit: int | None = None  # vmem_limit_bytes asked; None: Mosaic's default
    vmem_capacity: int = 0  # the chip's VMEM per TensorCore
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None

    def problems(self) -> list[str]:
        """Why this compile is not good enough to ship: a compile error, or VMEM (asked or
        estimated) over the chip's capacity."""
        if self.error is not None:
            return [f"compile failed: {self.error}"]
        out = []
        for what, size in (("vmem_limit", self.vmem_limit), ("VMEM plan", self.vmem_plan)):
            if size is not None and size > self.vmem_capacity:
                out.append(f"{what} {size / MiB:.1f} MiB > {self.vmem_capacity / MiB:.0f} MiB")
        return out


# Sizes of the compiled instances: small (compile time hardly depends on them), with more
# blocks than one table row holds so that the page loop is a real loop. _MAX_BLOCKS is a power
# of two so that JAX's paged_attention (pages per step must divide it) takes our step.
_NUM_BLOCKS, _NUM_SEQS, _MAX_BLOCKS, _NUM_TOKENS = 64, 4, 16, 64
_WINDOW, _SOFT_CAP = 100, 30.0


def _structs(device, *shapes_dtypes):
    sharding = jax.sharding.SingleDeviceSharding(device)
    return [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in shapes_dtypes]


def kernel_args(config: KernelConfig, device):
    """Shape structs on `device` for our kernel's positional arguments."""
    c = config
    cache = ((_NUM_BLOCKS, c.block_size, c.num_kv_heads, c.head_size), c.cache_dtype)
    tables = ((_NUM_SEQS, _MAX_BLOCKS), jnp.int32)
    seq_lens = ((_NUM_SEQS,), jnp.int32)
    if c.kernel == "decode":
        query = ((_NUM_SEQS, c.num_heads, c.head_size), c.query_dtype)
        return _structs(device, query, cache, cache, tables, seq_lens)
    query = ((_NUM_TOKENS, c.num_heads, c.head_size), c.query_dtype)
    query_start_loc = ((_NUM_SEQS + 1,), jnp.int32)
    return _structs(device, query, cache, cache, query_start_loc, seq_lens, tables, ((), jnp.int32))


def kernel_fn(config: KernelConfig):
    """Our compiled (non-interpret) kernel of `config` as a function of `kernel_args`."""
    c = config
    slopes = jnp.asarray(np.linspace(0.5, 0.01, c.num_heads), jnp.float32) if c.alibi else None
    keywords = dict(
        scale=c.head_size**-0.5,
        alibi_slopes=slopes,
        sliding_window=c.sliding_window,
        logits_soft_cap=c.logits_soft_cap,
        pages_per_compute_block=c.pages_per_step,
        interpret=False,
    )
    if c.kernel == "decode":
        return functools.partial(tpu_attention.paged_decode, **keywords)
    return functools.partial(tpu_attention.ragged_paged_attention, block_q=c.block_q, **keywords)


def kernel_plan(config: KernelConfig) -> tpu_attention.Plan:
    """The plan our kernel makes for `config`'s compiled instance."""
    c = config
    return tpu_attention.make_plan(
        block_size=c.block_size,
        num_kv_heads=c.num_kv_heads,
        group=c.group,
        head_size=c.head_size,
        cache_dtype=c.cache_dtype,
        query_dtype=c.query_dtype,
        max_blocks=_MAX_BLOCKS,
        block_q=1 if c.kernel == "decode" else c.block_q,
        pages_per_step=c.pages_per_step,
    )


def _pallas_call(fn, args):
    """The params of the (first) `pallas_call` that tracing `fn(*args)` makes."""
    from jax.extend.core import jaxprs_in_params

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                return eqn.params
            for sub in jaxprs_in_params(eqn.params):
                found = walk(sub)
                if found is not None:
                    return found
        return None

    params = walk(jax.make_jaxpr(fn)(*args).jaxpr)
    if params is None:
        raise RuntimeError("no pallas_call in the traced kernel")
    return params


def _padded_bytes(shape, dtype) -> int:
    """Bytes of a VMEM buffer in Mosaic's tiling: the last dim in 128 lanes, the one before in
    8 sublanes of 32 bits (16 rows for 16-bit, 32 for 8-bit dtypes)."""
    dtype = jnp.dtype(dtype)
    shape = list(shape) or [1]
    shape[-1] = -(-shape[-1] // 128) * 128
    if len(shape) >= 2:
        rows = 8 * max(1, 4 // dtype.itemsize)
        shape[-2] = -(-shape[-2] // rows) * rows
    return int(np.prod(shape)) * dtype.itemsize


def _traced_vmem(params) -> tuple[tuple[int, ...], int, int | None]:
    """(grid, VMEM bytes, vmem_limit_bytes asked) of a traced `pallas_call`: its VMEM scratch
    plus two pipeline buffers for each operand and output blocked into VMEM (SMEM and HBM
    operands take none). The same rule for our kernels and JAX's."""
    mapping = params["grid_mapping"]
    kernel_avals = [v.aval for v in params["jaxpr"].invars]
    scratch = kernel_avals[len(kernel_avals) - mapping.num_scratch_operands :]
    total = 0
    for aval in scratch:
        if str(getattr(aval, "memory_space", "")) == "vmem":
            total += _padded_bytes(aval.shape, aval.dtype)
    for block in mapping.block_mappings:
        aval = block.block_aval
        if str(getattr(aval, "memory_space", "default")) in ("default", "vmem"):
            total += 2 * _padded_bytes(aval.shape, aval.dtype)
    compiler_params = params.get("compiler_params")
    if isinstance(compiler_params, dict):  # older JAX: keyed by backend
        compiler_params = compiler_params.get("mosaic_tpu") or compiler_params.get("mosaic")
    limit = getattr(compiler_params, "vmem_limit_bytes", None)
    return tuple(int(g) for g in mapping.grid), total, limit


def _compile(fn, args, device) -> float:
    start = time.perf_counter()
    with jax.default_device(device):
        jax.jit(fn).lower(*args).compile()
    return time.perf_counter() - start


def _error_text(e: Exception) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"


def compile_kernel(config: KernelConfig, target: TpuTarget) -> CompileReport:
    """Compile our kernel of `config` for `target` (Mosaic, then XLA:TPU) and report its grid,
    blocks and VMEM. A failed compile gives a report with `error` set rather than raising."""
    device = compile_device(target.name)
    args = kernel_args(config, device)
    fn = kernel_fn(config)
    plan = kernel_plan(config)
    report = CompileReport(
        config,
        target.name,
        block_q=plan.block_q,
        block_k=plan.block_k,
        pages_per_step=plan.pages_per_step,
        vmem_plan=plan.vmem_bytes,
        vmem_limit=plan.vmem_limit,
        vmem_capacity=target.vmem_capacity,
    )
    try:
        with jax.default_device(device):
            grid, traced, limit = _traced_vmem(_pallas_call(fn, args))
        report = dataclasses.replace(report, grid=grid, vmem_traced=traced, vmem_limit=limit)
        seconds = _compile(fn, args, device)
    except Exception as e:  # the compile's verdict is the result
        return dataclasses.replace(report, error=_error_text(e))
    return dataclasses.replace(report, seconds=seconds)


# ---- JAX's own TPU kernels, for the same problems ----


def _jax_ragged_blocks(config: KernelConfig, device) -> tuple[int, int]:
    """(kv pages per block, queries per block) that JAX's ragged_paged_attention would pick on
    `device`: its tuned table looked up with the described chip's name (its own lookup reads
    `jax.devices()`, here the CPU, and gives up)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel, tuned_block_sizes

    c = config
    heads, combined = kernel.get_min_heads_per_blk(
        c.num_heads, 2 * c.num_kv_heads, jnp.dtype(c.query_dtype), jnp.dtype(c.cache_dtype)
    )
    key = tuned_block_sizes.simplify_key(
        (c.query_dtype, c.cache_dtype, heads, combined // 2, c.head_size, c.block_size,
         _NUM_TOKENS, _MAX_BLOCKS)
    )  # fmt: skip
    name = " ".join(device.device_kind.split()[:2])  # "TPU v5 lite" -> "TPU v5"
    pages, queries = tuned_block_sizes.TUNED_BLOCK_SIZES.get(name, {}).get(key, (128, 32))
    return min(_MAX_BLOCKS, pages), min(_NUM_TOKENS, queries)


def jax_peer_lacks(config: KernelConfig) -> str | None:
    """The feature of `config` that JAX's TPU kernel for its problem lacks, or None."""
    if config.alibi:
        return "JAX's TPU paged kernels have no ALiBi"
    if config.kernel == "decode" and config.sliding_window is not None:
        return "JAX's paged_attention has no sliding window"
    return None


def _jax_peer(config: KernelConfig, device):
    """(name, fn, args, block_q, pages per step) of JAX's kernel for `config`, or raise
    `NotImplementedError` naming the feature it lacks."""
    c = config
    if (lacks := jax_peer_lacks(c)) is not None:
        raise NotImplementedError(lacks)
    cache = (c.block_size, c.num_kv_heads, c.head_size)
    if c.kernel == "decode":
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

        pages = c.pages_per_step or kernel_plan(c).pages_per_step
        fn = functools.partial(
            paged_attention, attn_logits_soft_cap=c.logits_soft_cap, pages_per_compute_block=pages
        )
        # Head-major pages: [Hkv, NB, BS, D]
        kv = ((c.num_kv_heads, _NUM_BLOCKS, c.block_size, c.head_size), c.cache_dtype)
        query = ((_NUM_SEQS, c.num_heads, c.head_size), c.query_dtype)
        args = _structs(
            device, query, kv, kv, ((_NUM_SEQS,), jnp.int32), ((_NUM_SEQS, _MAX_BLOCKS), jnp.int32)
        )
        return "paged_attention", fn, args, 1, pages
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    pages, queries = _jax_ragged_blocks(c, device)
    fn = functools.partial(
        ragged_paged_attention,
        sm_scale=c.head_size**-0.5,
        sliding_window=c.sliding_window,
        soft_cap=c.logits_soft_cap,
        num_kv_pages_per_block=pages,
        num_queries_per_block=queries,
    )
    # K and V heads interleaved in one cache: [NB, BS, 2 * Hkv, D]
    kv = ((_NUM_BLOCKS, cache[0], 2 * c.num_kv_heads, c.head_size), c.cache_dtype)
    args = _structs(
        device,
        ((_NUM_TOKENS, c.num_heads, c.head_size), c.query_dtype),
        kv,
        ((_NUM_SEQS,), jnp.int32),
        ((_NUM_SEQS, _MAX_BLOCKS), jnp.int32),
        ((_NUM_SEQS + 1,), jnp.int32),
        ((1,), jnp.int32),
    )
    return "ragged_paged_attention", fn, args, queries, pages


def compile_jax_peer(config: KernelConfig, target: TpuTarget) -> CompileReport:
    """Compile JAX's own TPU kernel for `config`'s problem (`ragged_paged_attention` for
    "ragged", `paged_attention` for "decode"), with JAX's block choices, and report it like
    ours. A feature JAX's kernel lacks, or its refusal of the shapes, is the report's error."""
    device = compile_device(target.name)
    report = CompileReport(config, target.name, kernel="jax", vmem_capacity=target.vmem_capacity)
    try:
        name, fn, args, block_q, pages = _jax_peer(config, device)
    except Exception as e:
        return dataclasses.replace(report, error=_error_text(e))
    report = dataclasses.replace(
        report,
        kernel=f"jax:{name}",
        block_q=block_q,
        pages_per_step=pages,
        block_k=pages * config.block_size,
    )
    try:
        # JAX's paged_attention mixes float32 and bfloat16 without casts: it traces only under
        # standard promotion, not the strict promotion this project's tests run under.
        with jax.default_device(device), jax.numpy_dtype_promotion("standard"):
            grid, traced, limit = _traced_vmem(_pallas_call(fn, args))
            report = dataclasses.replace(report, grid=grid, vmem_traced=traced, vmem_limit=limit)
            seconds = _compile(fn, args, device)
    except Exception as e:
        return dataclasses.replace(report, error=_error_text(e))
    return dataclasses.replace(report, seconds=seconds)


# ---- The grid the tests and `jax-attn info --tpu-compile` compile ----

# Every kernel x query dtype x cache dtype meets four shapes that together take every head
# size, page size and GQA group of issue 23; D=256 with page 128 and G=8 (the VMEM worst case)
# is in every combination. The bias features take turns so each meets every combination.
_SHAPES = (  # (head_size, block_size, group)
    (64, 16, 1),
    (128, 32, 4),
    (128, 64, 8),
    (256, 128, 8),
)
_FEATURES = (
    dict(),
    dict(alibi=True),
    dict(sliding_window=_WINDOW),
    dict(logits_soft_cap=_SOFT_CAP),
    dict(alibi=True, sliding_window=_WINDOW, logits_soft_cap=_SOFT_CAP),
)
QUERY_DTYPES = ("bfloat16", "float32")
CACHE_DTYPES = ("bfloat16", "float8_e4m3fn")


def default_grid() -> list[KernelConfig]:
    """The covering grid (the same for every chip): 2 kernels x 2 query x 2 cache dtypes x 4
    shapes, 32 configurations."""
    configs = []
    combos = [(k, q, c) for k in ("decode", "ragged") for q in QUERY_DTYPES for c in CACHE_DTYPES]
    for i, (kernel, query_dtype, cache_dtype) in enumerate(combos):
        for s, (head_size, block_size, group) in enumerate(_SHAPES):
            features = _FEATURES[(i + s) % len(_FEATURES)]
            configs.append(
                KernelConfig(
                    kernel, query_dtype, cache_dtype, head_size, block_size, group, **features
                )
            )
    return configs


def format_table(reports: list[CompileReport]) -> str:
    """One line per compile: chip, whose kernel, config, grid, blocks, VMEM (plan estimate,
    traced buffers, limit asked, chip capacity, MiB), seconds, verdict."""
    header = (
        f"{'chip':4} {'kernel':26} {'k':6} {'q':4} {'kv':4} {'D':>3} {'BS':>3} {'G':>1} "
        f"{'bias':20} {'grid':6} {'bq':>3} {'bk':>4} {'plan':>6} {'traced':>6} {'limit':>6} "
        f"{'cap':>4} {'s':>4}  verdict"
    )
    short = {"bfloat16": "bf16", "float32": "f32", "float8_e4m3fn": "e4m3"}
    lines = [header, "-" * len(header)]

    def mib(x):
        return "dflt" if x is None else f"{x / MiB:.1f}"

    for r in reports:
        c = r.config
        row = (
            f"{r.target:4} {r.kernel:26} {c.kernel:6} {short.get(c.query_dtype, c.query_dtype):4} "
            f"{short.get(c.cache_dtype, c.cache_dtype):4} {c.head_size:3} {c.block_size:3} "
            f"{c.group:1} {c.features:20} "
        )
        if r.error is not None:
            lines.append(row + "; ".join(r.problems()))
            continue
        grid = "x".join(str(g) for g in r.grid)
        plan = "-" if r.vmem_plan is None else mib(r.vmem_plan)
        lines.append(
            row + f"{grid:6} {r.block_q:3} {r.block_k:4} {plan:>6} {mib(r.vmem_traced):>6} "
            f"{mib(r.vmem_limit):>6} {r.vmem_capacity // MiB:4} {r.seconds:4.1f}  "
            + ("; ".join(r.problems()) or "ok")
        )
    return "\n".join(lines)


# ---- Time floors from published figures ----

# float32 dots at Precision.HIGHEST run as about six bf16 passes on the MXU (an estimate: the
# split of each operand into three bf16 parts, of which six products are kept).
F32_PASSES = 6


@dataclasses.dataclass(frozen=True)
class Roofline:
    bytes: int
    flops: int
    seconds_memory: float
    seconds_compute: float

    @property
    def seconds(self) -> float:
        return max(self.seconds_memory, self.seconds_compute)

    @property
    def bound(self) -> str:
        return "memory" if self.seconds_memory >= self.seconds_compute else "compute"


def roofline(
    config: KernelConfig, target: TpuTarget, *, num_seqs: int, seq_len: int, q_len: int
) -> Roofline:
    """The time floor of one call on `target`: `num_seqs` sequences of `seq_len` keys, `q_len`
    new tokens each. Bytes: every sequence's K and V pages read once, the queries read and the
    output written once. FLOPs: 4 T L Hq D (two dots, each 2 T L Hq D; causal masking not
    subtracted). Peak: the chip's bf16 ops/s, divided by `F32_PASSES` when the dots run in
    float32 (a float32 query over a float32 or 16-bit cache)."""
    c = config
    cache_itemsize = jnp.dtype(c.cache_dtype).itemsize
    query_itemsize = jnp.dtype(c.query_dtype).itemsize
    tokens = num_seqs * q_len
    kv_bytes = 2 * num_seqs * seq_len * c.num_kv_heads * c.head_size * cache_itemsize
    q_bytes = 2 * tokens * c.num_heads * c.head_size * query_itemsize
    flops = 4 * tokens * seq_len * c.num_heads * c.head_size
    peak = target.bf16_flops
    if jnp.dtype(c.query_dtype) == jnp.float32:
        peak /= F32_PASSES
    return Roofline(
        bytes=kv_bytes + q_bytes,
        flops=flops,
        seconds_memory=(kv_bytes + q_bytes) / target.hbm_bandwidth,
        seconds_compute=flops / peak,
    )


# (name, kernel, num_seqs, seq_len, q_len); "mixed" is 32 decodes over 2048 keys and two
# 512-token prefills, counted as two workloads of the same call.
WORKLOADS = (
    ("decode 32 x 1024", "decode", 32, 1024, 1),
    ("decode 8 x 8192", "decode", 8, 8192, 1),
    ("prefill 8 x 512", "ragged", 8, 512, 512),
    ("mixed 32 x 2048 decode + 2 x 512 prefill", "ragged", None, None, None),
)


def workload_roofline(name: str, config: KernelConfig, target: TpuTarget) -> Roofline:
    if name.startswith("mixed"):
        parts = [
            roofline(config, target, num_seqs=32, seq_len=2048, q_len=1),
            roofline(config, target, num_seqs=2, seq_len=512, q_len=512),
        ]
        byte_sum = sum(p.bytes for p in parts)
        flop_sum = sum(p.flops for p in parts)
        return Roofline(
            byte_sum,
            flop_sum,
            sum(p.seconds_memory for p in parts),
            sum(p.seconds_compute for p in parts),
        )
    _, _, num_seqs, seq_len, q_len = next(w for w in WORKLOADS if w[0] == name)
    return roofline(config, target, num_seqs=num_seqs, seq_len=seq_len, q_len=q_len)


def roofline_table(
    *, head_size: int = 128, num_kv_heads: int = 8, group: int = 4, query_dtype="bfloat16"
) -> str:
    """A markdown table of time floors per chip for `WORKLOADS` (bf16 and e4m3 caches), from
    JAX's published per-chip figures."""
    lines = [
        f"Hkv={num_kv_heads}, G={group} (Hq={num_kv_heads * group}), D={head_size}, "
        f"{query_dtype} queries.",
        "",
        "| workload | cache | chip | HBM GB/s | peak TFLOP/s | MB moved | GFLOP | floor us "
        "| bound |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, kernel, *_ in WORKLOADS:
        for cache_dtype in CACHE_DTYPES:
            config = KernelConfig(
                kernel, query_dtype, cache_dtype, head_size, 16, group, num_kv_heads=num_kv_heads
            )
            for target in TARGETS.values():
                r = workload_roofline(name, config, target)
                peak = target.bf16_flops / (F32_PASSES if query_dtype == "float32" else 1)
                lines.append(
                    f"| {name} | {cache_dtype} | {target.name} | {target.hbm_bandwidth / 1e9:.0f} "
                    f"| {peak / 1e12:.0f} | {r.bytes / 1e6:.1f} | {r.flops / 1e9:.2f} "
                    f"| {r.seconds * 1e6:.1f} | {r.bound} |"
                )
    return "\n".join(lines)


def tpu_environment() -> dict[str, str]:
    """The variables libtpu needs to compile without a TPU (see the module docstring); set them
    before JAX starts."""
    return {
        "JAX_PLATFORMS": "cpu",
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_ACCELERATOR_TYPE": "v5litepod-4",
        "TPU_WORKER_HOSTNAMES": "localhost",
        "TPU_WORKER_ID": "0",
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    }


def missing_environment() -> list[str]:
    """The variables of `tpu_environment` that this process lacks."""
    return [k for k, v in tpu_environment().items() if os.environ.get(k) != v]

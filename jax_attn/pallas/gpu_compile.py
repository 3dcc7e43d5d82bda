"""Compile the Pallas kernels for a GPU that is not here, and read what the compile produced.

XLA can run its whole GPU pipeline without a GPU: with the CUDA PJRT plugin installed
(`jax-cuda12-plugin`, `jax-cuda12-pjrt`, no CUDA runtime needed) and `JAX_PLATFORMS=cpu` set
before JAX starts, `jax.experimental.topologies.get_topology_desc(platform="cuda",
target_config=...)` gives a compile-only device described by a `GpuTargetConfigProto` (text
written below from each GPU's published figures). Lowering a kernel with shape structs on that
device and compiling it makes the Pallas call XLA's `__gpu$xla.gpu.triton` custom call, which
XLA compiles with its own Triton and ptxas: the compile a real GPU host runs. Too much shared
memory fails that compile ("Shared memory size limit exceeded").

    target = TARGETS["h100"]
    report = compile_kernel(KernelConfig("ragged", "bfloat16", 128, 16), target)
    report.problems()   # [] when it compiled within the limits, without spills

`compile_kernel` dumps XLA's output (`xla_dump_to`) to read each kernel's launch (grid,
threads, dynamic shared memory) and its PTX, then runs `ptxas -v` (from the
`nvidia-cuda-nvcc-cu12` wheel, or `$PTXAS`, or the PATH) for registers and spills. Nothing here
runs a kernel: these are compile-time facts, never timings.
"""

import dataclasses
import functools
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_attn import shape_rules

# Registers a thread may use on every NVIDIA GPU since Kepler: a kernel at this many is at
# the ceiling, where ptxas spills instead of growing.
MAX_REGISTERS = 255


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """A GPU described by its published figures, enough for XLA to compile for it."""

    name: str
    device_description: str
    compute_capability: tuple[int, int]
    core_count: int  # streaming multiprocessors
    fpus_per_core: int  # FP32 lanes per SM
    clock_rate_ghz: float  # boost clock
    memory_bandwidth: int  # bytes / s
    device_memory_size: int  # bytes
    l2_cache_size: int  # bytes
    shared_memory_per_core: int  # bytes per SM
    shared_memory_per_block_optin: int  # bytes a block may opt in to

    def target_config(self) -> str:
        """The `GpuTargetConfigProto` text XLA takes (`xla/stream_executor/device_description
        .proto`: `GpuDeviceInfoProto` inside `GpuTargetConfigProto`)."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_memory_per_core}
  threads_per_core_limit: 2048
  core_count: {self.core_count}
  fpus_per_core: {self.fpus_per_core}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {self.memory_bandwidth}
  l2_cache_size: {self.l2_cache_size}
  clock_rate_ghz: {self.clock_rate_ghz}
  device_memory_size: {self.device_memory_size}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
device_description_str: "{self.device_description}"
"""


KiB, GiB = 1024, 1024**3

# NVIDIA's H100 datasheet and the Hopper tuning guide: SXM5, 132 SMs, 1.98 GHz boost, 80 GB
# HBM3 at 3.35 TB/s, 50 MiB L2, 228 KiB shared memory per SM of which 227 KiB per block.
H100_SXM = GpuTarget(
    name="h100",
    device_description="NVIDIA H100 80GB HBM3",
    compute_capability=(9, 0),
    core_count=132,
    fpus_per_core=128,
    clock_rate_ghz=1.98,
    memory_bandwidth=3_350_000_000_000,
    device_memory_size=80 * GiB,
    l2_cache_size=50 * 1024 * KiB,
    shared_memory_per_core=228 * KiB,
    shared_memory_per_block_optin=227 * KiB,
)

# The A100 datasheet and the Ampere tuning guide: SXM4 80 GB, 108 SMs, 1.41 GHz boost,
# 2.04 TB/s, 40 MiB L2, 164 KiB shared memory per SM of which 163 KiB per block.
A100_SXM = GpuTarget(
    name="a100",
    device_description="NVIDIA A100-SXM4-80GB",
    compute_capability=(8, 0),
    core_count=108,
    fpus_per_core=64,
    clock_rate_ghz=1.41,
    memory_bandwidth=2_039_000_000_000,
    device_memory_size=80 * GiB,
    l2_cache_size=40 * 1024 * KiB,
    shared_memory_per_core=164 * KiB,
    shared_memory_per_block_optin=163 * KiB,
)

TARGETS = {t.name: t for t in (H100_SXM, A100_SXM)}


def ptxas_path() -> str | None:
    """`$PTXAS`, else the `nvidia-cuda-nvcc-cu12` wheel's, else the PATH's ptxas."""
    if os.environ.get("PTXAS"):
        return os.environ["PTXAS"]
    for root in sys.path:
        candidate = os.path.join(root, "nvidia", "cuda_nvcc", "bin", "ptxas")
        if os.path.isfile(candidate):
            return candidate
    return shutil.which("ptxas")


def unavailable_reason() -> str | None:
    """Why kernels cannot be compiled for a described GPU here, or None when they can."""
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        return (
            "the CUDA PJRT plugin is not installed (jax-cuda12-plugin and jax-cuda12-pjrt "
            "0.10.x; `bash scripts/env.sh gpu-aot` builds an environment with them)"
        )
    if ptxas_path() is None:
        return "no ptxas (install nvidia-cuda-nvcc-cu12 12.9, or set $PTXAS)"
    try:
        compile_device(H100_SXM.name)
    except Exception as e:  # the plugin did not register (JAX_PLATFORMS unset, ...): say why
        return (
            f"no compile-only CUDA device ({type(e).__name__}: {str(e)[:200]}); JAX must "
            "start with JAX_PLATFORMS=cpu and the CUDA plugin installed"
        )
    return None


@functools.cache
def compile_device(target: str):
    """A compile-only device for `TARGETS[target]` (no GPU needed)."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="cuda", target_config=TARGETS[target].target_config(), topology="1x1x1"
    )
    return topology.devices[0]


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One kernel instance to compile: the cache dtype (the query is bf16 for fp8 caches),
    the head and block size, and which bias features are on."""

    kernel: str  # "decode" | "ragged"
    dtype: str  # cache dtype: float32 | bfloat16 | float16 | float8_e4m3fn | float8_e5m2
    head_size: int
    block_size: int
    alibi: bool = False
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    group: int = 4  # query heads per kv head

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
    def id(self) -> str:
        return (
            f"{self.kernel}-{self.dtype}-D{self.head_size}-BS{self.block_size}-G{self.group}-"
            f"{self.features}"
        )

    @property
    def query_dtype(self):
        dtype = jnp.dtype(self.dtype)
        return jnp.dtype(jnp.bfloat16) if dtype.itemsize == 1 else dtype


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """What compiling one `KernelConfig` for one `GpuTarget` gave."""

    config: KernelConfig
    target: str
    error: str | None = None
    grid: tuple[int, ...] = ()
    threads: int = 0
    shared_memory: int = 0  # dynamic shared memory of the launch, bytes
    registers: int = 0
    spill_stores: int = 0  # bytes per thread
    spill_loads: int = 0
    seconds: float = 0.0

    @property
    def warps(self) -> int:
        return self.threads // 32

    def problems(self) -> list[str]:
        """Why this compile is not good enough to ship: a compile error, shared memory over
        the target's opt-in limit, spills, or registers at the ceiling."""
        if self.error is not None:
            return [f"compile failed: {self.error}"]
        out = []
        limit = TARGETS[self.target].shared_memory_per_block_optin
        if self.shared_memory > limit:
            out.append(f"shared memory {self.shared_memory} B > {limit} B")
        if self.spill_stores or self.spill_loads:
            out.append(f"spills {self.spill_stores} B stored, {self.spill_loads} B loaded")
        if self.registers >= MAX_REGISTERS:
            out.append(f"{self.registers} registers: at the ceiling")
        return out


# Sizes of the compiled instances: small (compile time does not depend on them), with more
# blocks than one table row holds so that the page loop is a real loop.
_NUM_BLOCKS, _NUM_KV_HEADS, _NUM_SEQS, _MAX_BLOCKS, _NUM_TOKENS = 64, 2, 4, 16, 64
_KERNEL_NAMES = {"decode": "paged_decode", "ragged": "ragged_paged_attention"}


def kernel_args(config: KernelConfig, device):
    """Shape structs on `device` for the kernel's positional arguments."""
    sharding = jax.sharding.SingleDeviceSharding(device)

    def struct(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    num_heads = _NUM_KV_HEADS * config.group
    cache = struct((_NUM_BLOCKS, config.block_size, _NUM_KV_HEADS, config.head_size), config.dtype)
    tables = struct((_NUM_SEQS, _MAX_BLOCKS), jnp.int32)
    seq_lens = struct((_NUM_SEQS,), jnp.int32)
    if config.kernel == "decode":
        query = struct((_NUM_SEQS, num_heads, config.head_size), config.query_dtype)
        return (query, cache, cache, tables, seq_lens)
    query = struct((_NUM_TOKENS, num_heads, config.head_size), config.query_dtype)
    query_start_loc = struct((_NUM_SEQS + 1,), jnp.int32)
    num_seqs = struct((), jnp.int32)
    return (query, cache, cache, query_start_loc, seq_lens, tables, num_seqs)


def kernel_fn(config: KernelConfig):
    """The native kernel of `config` as a function of `kernel_args`."""
    from jax_attn import pallas

    num_heads = _NUM_KV_HEADS * config.group
    slopes = jnp.asarray(np.linspace(0.5, 0.01, num_heads), jnp.float32) if config.alibi else None
    keywords = dict(
        scale=config.head_size**-0.5,
        alibi_slopes=slopes,
        sliding_window=config.sliding_window,
        logits_soft_cap=config.logits_soft_cap,
        interpret=False,
    )
    kernel = pallas.paged_decode if config.kernel == "decode" else pallas.ragged_paged_attention
    return functools.partial(kernel, **keywords)


def compile_kernel(
    config: KernelConfig, target: GpuTarget, *, dump_dir: str | None = None
) -> CompileReport:
    """Compile `config`'s kernel for `target` and read its launch, registers and spills.

    A failed compile (shared memory over the limit, a Triton or ptxas error) gives a report
    with `error` set rather than raising. `dump_dir` keeps XLA's dump (else a temporary one).
    """
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="jax-attn-gpu-") as tmp:
        dump = dump_dir or tmp
        args = kernel_args(config, compile_device(target.name))
        try:
            lowered = jax.jit(kernel_fn(config)).lower(*args)
            lowered.compile({"xla_dump_to": dump})
        except Exception as e:  # the compile's verdict is the result
            message = " ".join(str(e).split())
            return CompileReport(config, target.name, error=f"{type(e).__name__}: {message[:300]}")
        name = _KERNEL_NAMES[config.kernel]
        grid, threads, smem = _launch(dump, name)
        registers, stores, loads = _ptxas_usage(_ptx_file(dump, name))
    return CompileReport(
        config,
        target.name,
        grid=grid,
        threads=threads,
        shared_memory=smem,
        registers=registers,
        spill_stores=stores,
        spill_loads=loads,
        seconds=time.perf_counter() - start,
    )


def _launch(dump: str, name: str) -> tuple[tuple[int, ...], int, int]:
    """(grid, threads per block, dynamic shared memory) of kernel `name` in XLA's thunk dump:
    `paged_decode grid: [4, 2, 2] threads: [128, 1, 1]  shared_memory: 106496 bytes`."""
    pattern = re.compile(
        rf"\b{name}\b grid: \[([\d, ]+)\] threads: \[([\d, ]+)\]\s+shared_memory: (\d+) bytes"
    )
    for path in glob.glob(os.path.join(dump, "*thunk_sequence.txt")):
        with open(path) as f:
            match = pattern.search(f.read())
        if match:
            grid = tuple(int(x) for x in match.group(1).split(","))
            threads = int(np.prod([int(x) for x in match.group(2).split(",")]))
            return grid, threads, int(match.group(3))
    raise RuntimeError(f"no launch of {name!r} in XLA's thunk dump under {dump}")


def _ptx_file(dump: str, name: str) -> str:
    for path in sorted(glob.glob(os.path.join(dump, "*.ptx"))):
        with open(path) as f:
            if re.search(rf"\.entry {name}\(", f.read()):
                return path
    raise RuntimeError(f"no PTX entry {name!r} in XLA's dump under {dump}")


def _ptxas_usage(ptx: str) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) that `ptxas -v` reports."""
    with open(ptx) as f:
        arch = re.search(r"^\.target (sm_\w+)", f.read(), re.M).group(1)
    ptxas = ptxas_path()
    if ptxas is None:
        raise RuntimeError("no ptxas: install nvidia-cuda-nvcc-cu12 12.9 or set $PTXAS")
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [ptxas, f"-arch={arch}", "-v", ptx, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True,
            text=True,
        )
    if done.returncode:
        raise RuntimeError(f"ptxas failed on {ptx}: {done.stderr[-500:]}")
    registers = re.search(r"Used (\d+) registers", done.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", done.stderr)
    if registers is None or spills is None:
        raise RuntimeError(f"cannot read ptxas -v: {done.stderr[-500:]}")
    return int(registers.group(1)), int(spills.group(1)), int(spills.group(2))


# The grid the tests and `jax-attn info --gpu-compile` compile: every kernel x dtype x head
# size, each (kernel, dtype) meeting every block size, D=256 with block 128 (the largest page,
# the shared-memory worst case) and with block 16 (the register worst case), GQA groups of 1,
# 4 and 8, and the bias features taking turns so that each appears with every dtype.
_SHAPES = (  # (head_size, block_size, group)
    (64, 32, 1),
    (128, 16, 4),
    (256, 128, 4),
    (256, 16, 4),
    (128, 128, 8),
)
_FEATURES = (
    dict(),
    dict(alibi=True),
    dict(sliding_window=100),
    dict(logits_soft_cap=30.0),
    dict(alibi=True, sliding_window=100, logits_soft_cap=30.0),
)
GRID_DTYPES = ("bfloat16", "float32", "float8_e4m3fn", "float8_e5m2")


def default_grid(target: GpuTarget) -> list[KernelConfig]:
    """The covering grid for `target`; e4m3 caches are left out where the dispatch refuses
    them (`shape_rules.native_dtype_problem`: before sm_89; the tests check that refusal)."""
    configs = []
    for kernel in ("decode", "ragged"):
        for d, dtype in enumerate(GRID_DTYPES):
            if shape_rules.native_dtype_problem(dtype, target.compute_capability):
                continue
            for s, (head_size, block_size, group) in enumerate(_SHAPES):
                features = _FEATURES[(d + s) % len(_FEATURES)]
                configs.append(
                    KernelConfig(kernel, dtype, head_size, block_size, group=group, **features)
                )
    return configs


def format_table(reports: list[CompileReport]) -> str:
    """One line per compile: target, config, grid, warps, shared memory, registers, spills."""
    header = (
        f"{'gpu':5} {'kernel':7} {'dtype':14} {'D':>4} {'BS':>4} {'G':>2} {'bias':21} {'grid':12} "
        f"{'warps':>5} {'smem KiB':>8} {'regs':>4} {'spill B':>8} {'s':>5}  verdict"
    )
    lines = [header, "-" * len(header)]
    for r in reports:
        c = r.config
        verdict = "; ".join(r.problems()) or "ok"
        if r.error is not None:
            lines.append(
                f"{r.target:5} {c.kernel:7} {c.dtype:14} {c.head_size:4} {c.block_size:4} "
                f"{c.group:2} {c.features:21} {verdict}"
            )
            continue
        grid = "x".join(str(g) for g in r.grid)
        lines.append(
            f"{r.target:5} {c.kernel:7} {c.dtype:14} {c.head_size:4} {c.block_size:4} "
            f"{c.group:2} {c.features:21} {grid:12} {r.warps:5} {r.shared_memory / KiB:8.1f} "
            f"{r.registers:4} {r.spill_stores + r.spill_loads:8} {r.seconds:5.1f}  {verdict}"
        )
    return "\n".join(lines)

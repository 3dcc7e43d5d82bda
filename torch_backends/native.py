"""The project's native CPU kernels as torch ops (`torch.ops.jax_attn.*`), for the torch half.

The C++ is `jax_attn/cpu/csrc` (one source with `jax_attn.cpu`'s XLA kernels): torch_ops.cc
binds the kernels as torch ops through `TORCH_LIBRARY`, compiled on first use against the
running torch's headers into `libjax_attn_torch.so`, cached like the XLA library (the
builder, `jax_attn/cpu/_build.py`, is loaded by path: nothing here imports JAX). Each op has
a fake (meta) kernel registered here, so `torch.compile` traces through it and
`torch.library.opcheck` passes.

    paged_decode_split      vLLM's decode over its split cache layout (`paged_attention_v1`)
    ragged_paged_attention  a ragged step (prefill, chunked prefill, decode, mixed) over the
                            token-major caches `[NB, BS, Hkv, D]` (jax_attn.paged_attention's)
    store_split             vLLM's cache write into that layout (`reshape_and_cache`)
    store_token_major       the same write into the token-major caches (any block stride)
    gather_split_blocks     blocks of the split layout in token-major order (a prefix for the
                            ragged kernel)
    copy_blocks             whole blocks between caches (vLLM's `copy_blocks`, `swap_blocks`)

Where the library cannot be built (no compiler, a failed build, `JAX_ATTN_CPU_DISABLE=1`),
`unavailable_reason()` says why, the callers run their vectorized-torch path, and a warning
says so once per process.
"""

import ctypes
import importlib.util
import math
import sys
import threading
import warnings
from pathlib import Path

import torch
from jaxtyping import Float, Int
from torch import Tensor

Scale = Tensor | float  # a layer's k_scale / v_scale (as torch_backends.layouts.Scale)

LIB_NAME = "libjax_attn_torch.so"
# The C++ units of the torch library, as glob patterns in csrc/ (every csrc header is part of
# its cache key).
UNITS = (
    "isa.cc",  # what the kernels run on this CPU (split_decode_path)
    "paged_decode.cc",
    "decode_items_*.cc",  # the decode kernel's items, one unit per cache dtype
    "ragged_paged_attention.cc",
    "paged_cache.cc",
    "torch_ops.cc",
)

_lock = threading.Lock()
_state: dict = {}  # "reason" (str | None), "path", "build_seconds", "warned" (bool)


def _csrc_dir() -> Path:
    """jax_attn's csrc directory, found without importing jax_attn (which imports JAX)."""
    spec = importlib.util.find_spec("jax_attn")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the jax_attn package (which holds the C++ sources) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "cpu" / "csrc"


def _builder():
    """jax_attn/cpu/_build.py as a module of its own (stdlib only at import)."""
    name = "torch_backends._kernel_build"
    if name not in sys.modules:
        path = _csrc_dir().parent / "_build.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules[name]


def _openmp_flags(include: Path, lib_dir: Path) -> tuple[list[str], list[str]]:
    """(compile, link) flags that put `at::parallel_for` on torch's own OpenMP pool.

    With an OpenMP torch (ATen/Config.h: AT_PARALLEL_OPENMP 1), `at::parallel_for` is a header
    template around `#pragma omp parallel`: compiled without -fopenmp it runs on the calling
    thread alone. And the OpenMP runtime must be torch's: the wheels bundle a libgomp (named
    libgomp.so.1 or libgomp-<hash>.so.1), so the library links that file, never the system's
    (two runtimes would mean two thread pools fighting over the cores)."""
    config = (include / "ATen" / "Config.h").read_text()
    if "#define AT_PARALLEL_OPENMP 1" not in config:
        return [], []  # torch's native pool: at::parallel_for calls into libtorch
    bundled = sorted(lib_dir.glob("libgomp*.so*"))
    return ["-fopenmp"], [str(bundled[0])] if bundled else ["-fopenmp"]


def _torch_library(build):
    torch_dir = Path(torch.__file__).parent
    lib_dir = torch_dir / "lib"
    include = torch_dir / "include"
    omp_compile, omp_link = _openmp_flags(include, lib_dir)
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return build.Library(
        LIB_NAME,
        units=lambda: [path for unit in UNITS for path in sorted(build.CSRC.glob(unit))],
        include_dirs=lambda: [str(include), str(include / "torch" / "csrc" / "api" / "include")],
        version=lambda: "torch " + torch.__version__,
        # the kernels' own units run on their own workers: only torch_ops.cc (at::parallel_for)
        # needs OpenMP, so the others compile as the XLA library's and share its objects
        compile_flags=lambda: [abi],
        unit_flags=lambda unit: omp_compile if unit.name == "torch_ops.cc" else [],
        link_flags=lambda: [
            f"-L{lib_dir}",
            f"-Wl,-rpath,{lib_dir}",
            "-lc10",
            "-ltorch_cpu",
            *omp_link,
        ],
    )


def build(verbose: bool = False) -> tuple[Path, float]:
    """Build (or find cached) the torch library; (path, seconds compiling: 0 if cached).
    Raises RuntimeError with a one-line reason."""
    builder = _builder()
    return builder.build(verbose=verbose, lib=_torch_library(builder))


def unavailable_reason() -> str | None:
    """None when the ops are loaded (building them on first call), else a one-line reason.
    Never raises. `JAX_ATTN_CPU_DISABLE=1` forces a reason (to test the fallback)."""
    import os

    disable = os.environ.get("JAX_ATTN_CPU_DISABLE", "")
    if disable not in ("", "0"):
        return f"disabled by JAX_ATTN_CPU_DISABLE={disable}"
    with _lock:
        if "reason" not in _state:
            try:
                path, seconds = build()
                torch.ops.load_library(str(path))
                _register_fakes()
                _state.update(reason=None, path=path, build_seconds=seconds)
            except Exception as e:  # the contract: a reason, never an exception
                _state["reason"] = str(e).splitlines()[0] if str(e) else type(e).__name__
        return _state["reason"]


def available() -> bool:
    """Whether the native ops run here; the first `False` in a process warns with the reason.
    Under `torch.compile` the answer is taken once, at trace time, as a constant: the library
    is loaded then if nothing loaded it before, so a step compiled before any eager call
    traces the native op too (and a missing library warns then, as eagerly)."""
    if torch.compiler.is_compiling():
        return _available_while_tracing()
    return _available()


def _available() -> bool:
    reason = unavailable_reason()
    if reason is not None and not _state.get("warned"):
        _state["warned"] = True
        warnings.warn(
            f"torch_backends: the native CPU kernels are not available ({reason}); paged "
            "decode runs in vectorized torch instead (several times slower)",
            RuntimeWarning,
            stacklevel=4,
        )
    return reason is None


# Dynamo runs this eagerly while tracing and puts its result in the graph as a constant (no
# guard): the build, the lock and the library load stay out of the traced code.
_available_while_tracing = torch.compiler.assume_constant_result(_available)


# --------------------------------------------------------------------------------------------
# Fake kernels: what torch.compile and opcheck see (the ops write `out` and return nothing).


def _register_fakes() -> None:
    ops = (
        "paged_decode_split",
        "ragged_paged_attention",
        "store_split",
        "store_token_major",
        "copy_blocks",
        "gather_split_blocks",
    )
    for op in ops:
        torch.library.register_fake(f"jax_attn::{op}")(lambda *args: None)


# --------------------------------------------------------------------------------------------
# Calls


def _scale_tensor(scale: Scale) -> Tensor:
    if isinstance(scale, Tensor):
        return scale.detach().to(torch.float32).reshape(1)
    value = float(scale)
    tensor = _SCALES.get(value)
    if tensor is None:  # one tensor per value (1.0 nearly always): the ops only read it
        if len(_SCALES) >= 64:
            _SCALES.clear()
        tensor = _SCALES[value] = torch.tensor([value], dtype=torch.float32)
    return tensor


_SCALES: dict[float, Tensor] = {}


# x = 16 bytes of the cache's element: key_cache [NB, Hkv, D // x, BS, x].
_QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def decode_supported(query: Tensor, key_cache: Tensor) -> bool:
    """Whether `paged_decode_split` takes these tensors (CPU, dtypes, head size <= 256)."""
    return (
        query.device.type == "cpu"
        and key_cache.device.type == "cpu"
        and query.dtype in _QUERY_DTYPES
        and query.dim() == 3
        and 1 <= query.shape[-1] <= 256
        and key_cache.dim() == 5
        and key_cache.shape[-1] * key_cache.element_size() == 16
    )


_CACHE_DTYPE_NAMES = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def isa() -> str | None:
    """What the torch library's kernels run on this CPU (csrc/isa.cc, the same text as
    `jax_attn.cpu.isa()`), e.g. "bf16 products: avx2 (widened to float32); vectors: avx2;
    prefetch: ..."; None without the native ops."""
    if unavailable_reason() is not None:
        return None
    fn = ctypes.CDLL(str(_state["path"])).jax_attn_cpu_isa
    fn.restype = ctypes.c_char_p
    return fn().decode()


def split_decode_path(
    query_dtype: torch.dtype, kv_cache_dtype: str, block_size: int, group: int
) -> str:
    """Which code `paged_decode_split` runs here for `query_dtype` queries on a cache of
    `kv_cache_dtype` ("auto": the queries' dtype, or vLLM's fp8 names) at `block_size` with
    `group` query heads per kv head: "amx" (bf16 queries on a bf16 or fp8 cache, on a CPU whose
    AMX tiles this process may use, at block sizes 16, 32 or multiples of 64), "vector", or
    "unavailable" (no native ops). `jax_attn.cpu.decode_path(..., layout="split")` answers the
    same for the XLA library."""
    if unavailable_reason() is not None:
        return "unavailable"
    fn = ctypes.CDLL(str(_state["path"])).jax_attn_cpu_decode_on_amx
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    query = str(query_dtype).removeprefix("torch.")
    cache = query if kv_cache_dtype == "auto" else _CACHE_DTYPE_NAMES.get(kv_cache_dtype, "")
    amx = fn(cache.encode(), query.encode(), 1, int(block_size), int(group))
    return "amx" if amx else "vector"


def paged_decode_split(
    out: Tensor,
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    *,
    scale: float,
    alibi_slopes: Tensor | None,
    k_scale: Scale,
    v_scale: Scale,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    kv_cache_dtype: str,
) -> Tensor:
    """`out[s] = ` one query per sequence at position `seq_lens[s] - 1` over vLLM's split
    cache (the native kernel); returns `out`. Bad values raise ValueError before any read.
    The scales apply to fp8 caches only (vLLM's rule: an "auto" cache stores the values)."""
    if not available():
        raise RuntimeError(f"torch_backends.native is not available: {unavailable_reason()}")
    if kv_cache_dtype == "auto":
        k_scale = v_scale = 1.0
    torch.ops.jax_attn.paged_decode_split(
        out,
        token_rows(query, "query"),
        key_cache,
        value_cache,
        block_tables.to(torch.int32).contiguous(),
        seq_lens.to(torch.int32).contiguous(),
        None if alibi_slopes is None else alibi_slopes.to(torch.float32).contiguous(),
        float(scale),
        _scale_tensor(k_scale),
        _scale_tensor(v_scale),
        int(sliding_window or 0),
        float(logits_soft_cap or 0.0),
        kv_cache_dtype,
    )
    return out


def _int32(x: Tensor | int) -> Tensor:
    return torch.as_tensor(x).to(torch.int32).contiguous()


# Inputs at least this large that are not contiguous are staged in a buffer kept per thread.
STAGE_MIN_BYTES = 4 << 20
_staging = threading.local()


def staged_empty(like: Tensor, shape: tuple[int, ...], slot: str) -> Tensor:
    """An uninitialized tensor of `like`'s dtype and device of `shape`: for a large one on the
    CPU, a view of this thread's buffer for `slot` (grown as needed and kept for the next call),
    else `like.new_empty(shape)` (also under `torch.compile`). A large fresh tensor is a fresh
    mapping from glibc on every call, which Linux must fault in and zero: `.contiguous()` of a
    4096 x 32 x 128 float32 query took 13.1 ms, the copy into memory already in use 3.7 (2-core
    Zen 5 VM, NOTES.md). One buffer per slot, as a call stages several inputs at once; a later
    call with the same slot reuses it, so the tensor is valid until then."""
    numel = math.prod(shape)
    if (like.device.type != "cpu" or numel * like.element_size() < STAGE_MIN_BYTES
            or torch.compiler.is_compiling()):  # fmt: skip
        return like.new_empty(shape)
    buffers = getattr(_staging, "buffers", None)
    if buffers is None:
        buffers = _staging.buffers = {}
    buf = buffers.get((slot, like.dtype))
    if buf is None or buf.numel() < numel:
        buf = buffers[(slot, like.dtype)] = torch.empty(numel, dtype=like.dtype)
    return buf[:numel].view(shape)


def dense(x: Tensor, slot: str) -> Tensor:
    """`x` contiguous: vLLM hands attention its query, key and value as strided views of the
    fused qkv projection; a strided one is copied into `staged_empty(x, ..., slot)`."""
    if x.is_contiguous():
        return x
    return staged_empty(x, tuple(x.shape), slot).copy_(x)


def token_rows(rows: Tensor, slot: str) -> Tensor:
    """`rows` `[tokens, heads, head_size]` as the kernels read them: as they are when each
    token's `[heads, head_size]` is dense and tokens lie at least that far apart (vLLM's query,
    key and value, views of the fused qkv projection, whose tokens are `(Hq + 2 Hkv) * D`
    apart: the kernels take the token stride, so a prefill's 64 MiB float32 query is not
    copied), else `dense(rows, slot)`."""
    tokens, heads, size = rows.shape
    if rows.numel() == 0 or rows.is_contiguous():
        return rows
    heads_dense = (size <= 1 or rows.stride(2) == 1) and (heads <= 1 or rows.stride(1) == size)
    if heads_dense and (tokens <= 1 or rows.stride(0) >= heads * size):
        return rows
    return dense(rows, slot)


def ragged_paged_attention(
    out: Float[Tensor, "num_tokens num_heads head_size"],
    query: Float[Tensor, "num_tokens num_heads head_size"],
    key_cache: Float[Tensor, "num_blocks block_size num_kv_heads head_size"],
    value_cache: Float[Tensor, "num_blocks block_size num_kv_heads head_size"],
    query_start_loc: Int[Tensor, " num_seqs_plus_1"],
    seq_lens: Int[Tensor, " num_seqs"],
    block_tables: Int[Tensor, "num_seqs max_blocks"],
    num_seqs: Int[Tensor, ""] | int,
    *,
    scale: float,
    causal: bool = True,
    alibi_slopes: Float[Tensor, " num_heads"] | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
    kv_cache_dtype: str = "auto",
    sinks: Float[Tensor, " num_heads"] | None = None,
) -> Float[Tensor, "num_tokens num_heads head_size"]:
    """`jax_attn.paged_attention`'s ragged step on the native kernel (the XLA handler's, bit for
    bit) into `out`; returns `out`. Sequence `s` owns query rows
    `[query_start_loc[s], query_start_loc[s + 1])`, the last of its `seq_lens[s]` positions:

        |<- prefill_0 (40) ->|<- chunk_1 (9) ->|d2|d3|pad|   query_start_loc [0, 40, 49, 50, 51]

    Only the first `num_seqs` rows of the metadata are real; rows past
    `query_start_loc[num_seqs]`, and rows whose keys are all masked, are zeros. Caches are
    `[NB, BS, Hkv, D]` in any float dtype, or fp8 (torch's float8 dtypes with
    `kv_cache_dtype="auto"`, or uint8 bit patterns named by `kv_cache_dtype`: "fp8" /
    "fp8_e4m3", "fp8_e5m2"), read times `k_scale` / `v_scale`, which apply to fp8 caches only
    (vLLM's rule). `sinks`: one attention-sink logit per query head (gpt-oss's; vLLM's
    `sinks`), a key with no value in every row's softmax: the output is
    `sum_j p_j v_j / (sum_j p_j + exp(sinks[h] - max))`, not transformed by the scale, soft cap
    or ALiBi. Bad shapes or values raise ValueError naming the argument before any read or
    write."""
    if not available():
        raise RuntimeError(f"torch_backends.native is not available: {unavailable_reason()}")
    if kv_cache_dtype == "auto" and key_cache.element_size() != 1:
        k_scale = v_scale = 1.0
    torch.ops.jax_attn.ragged_paged_attention(
        out,
        token_rows(query, "query"),
        key_cache,
        value_cache,
        _int32(query_start_loc),
        _int32(seq_lens),
        _int32(block_tables),
        _int32(num_seqs),
        None if alibi_slopes is None else alibi_slopes.to(torch.float32).contiguous(),
        float(scale),
        bool(causal),
        int(sliding_window or 0),
        float(logits_soft_cap or 0.0),
        _scale_tensor(k_scale),
        _scale_tensor(v_scale),
        kv_cache_dtype,
        None if sinks is None else sinks.detach().to(torch.float32).contiguous(),
    )
    return out


def store_split(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slots: Tensor
) -> None:
    """Rows `[T, Hkv, D]`, already in the cache's element type (fp8: uint8 bits), to their
    slots in vLLM's split layout; -1 skips. Bad slots raise ValueError before any write."""
    torch.ops.jax_attn.store_split(
        token_rows(key, "key"),
        token_rows(value, "value"),
        key_cache,
        value_cache,
        slots.to(torch.int64),
    )


def store_token_major(
    key: Float[Tensor, "num_tokens num_kv_heads head_size"],
    value: Float[Tensor, "num_tokens num_kv_heads head_size"],
    key_cache: Float[Tensor, "num_blocks block_size num_kv_heads head_size"],
    value_cache: Float[Tensor, "num_blocks block_size num_kv_heads head_size"],
    slots: Int[Tensor, " num_tokens"],
) -> None:
    """Rows `[T, Hkv, D]`, already in the cache's element type (fp8: its float8 dtype or uint8
    bits), to their slots in token-major caches `[NB, BS, Hkv, D]`; -1 skips, a repeated slot
    keeps the later row. Each cache dense inside a block, any block stride (one for both, the
    two never overlapping), so a page `[NB, 2, BS, Hkv, D]` is written through
    `page.unbind(1)`:

        slot_mapping [35, -1, 70] with block size 32: block 1 offset 3, skipped, block 2
        offset 6

    Bad slots or shapes raise ValueError before any write."""
    if not available():
        raise RuntimeError(f"torch_backends.native is not available: {unavailable_reason()}")
    torch.ops.jax_attn.store_token_major(
        token_rows(key, "key"),
        token_rows(value, "value"),
        key_cache,
        value_cache,
        slots.to(torch.int64),
    )


def gather_split_blocks(
    key_cache: Tensor, value_cache: Tensor, block_ids: Tensor, keys: Tensor, values: Tensor
) -> None:
    """`keys[i]`, `values[i]` (`[BS, Hkv, D]`) = block `block_ids[i]` of vLLM's split caches
    (key `[NB, Hkv, D // x, BS, x]`, value `[NB, Hkv, D, BS]`), in token-major order, on the
    kernels' threads: the torch half's prefills over a cached prefix, which the ragged kernel
    reads token-major. `index_select` of the permuted caches did the same at a tenth of the
    speed (NOTES.md). Ids outside the cache raise ValueError before any write."""
    torch.ops.jax_attn.gather_split_blocks(
        key_cache, value_cache, block_ids.to(torch.int64).contiguous(), keys, values
    )


def copy_blocks(dst: list[Tensor], src: list[Tensor], block_pairs: Tensor) -> None:
    """`dst[i][:, pairs[:, 1]] = src[i][:, pairs[:, 0]]` for caches `[2, NB, ...]`, every
    source read before any write. Bad block ids raise ValueError before any write."""
    torch.ops.jax_attn.copy_blocks(dst, src, block_pairs.to(torch.int64).contiguous())

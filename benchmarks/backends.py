"""The peers a workload runs on, each prepared once and then called many times.

| peer          | what one call runs                                                         |
|---------------|----------------------------------------------------------------------------|
| jax-xla       | `jax_attn.paged_decode` (decode-only steps) or `paged_attention`, impl xla  |
| jax-reference | the same entry with impl="reference" (the dense oracle), where it fits     |
| jax-cpu       | the same entry with impl="cpu": the native CPU kernels through XLA's FFI   |
| TORCH_SDPA    | this project's `TorchSDPABackendImpl.forward` (`torch_backends`, vLLM V0's |
|               | API, not vLLM's code): prefills on the native ragged kernel as a torch op  |
|               | (`torch.ops.jax_attn.ragged_paged_attention`) over their contiguous K/V    |
|               | (a chunk's cached prefix: its blocks copied token-major from the paged     |
|               | cache), decodes on the native split-layout decode                          |
|               | (`torch.ops.jax_attn.paged_decode_split`) over the paged cache             |
| IPEX          | IPEX 2.8's kernels directly: `PagedAttention.flash_attn_varlen_func` for   |
|               | prefills, `PagedAttention.single_query_cached_kv_attention` for decodes    |
| XFORMERS      | `XFormersImpl.forward` as TORCH_SDPA, on CUDA only (no CPU kernel)         |
| vllm085-      | vLLM 0.8.5's own `TorchSDPABackendImpl.forward` (decode: its C++           |
|   TORCH_SDPA  | `paged_attention_v1`) in a worker process in the vllm085 env (torch 2.6),  |
|               | timed there, one request per call (`benchmarks/vllm085.py`)                |
| vllm-cpu-attn | vLLM 0.32's CPU_ATTN kernel, `torch.ops._C.cpu_attention_with_kv_cache`,   |
|               | one call for the whole step, in this process (the vllm env)                |

`prepare` does all conversion, layout changes, metadata building and (for JAX) compilation,
so a call is the attention step and nothing else. Every call returns only when its result is
ready (`block_until_ready` for JAX, `torch.cuda.synchronize` on CUDA).
"""

import dataclasses
import functools
import importlib
import importlib.util
import re
import sys
import time
from collections.abc import Callable

import numpy as np

from benchmarks.prepared import Prepared, Skip
from benchmarks.workloads import Data, Spec

# The dense oracle materializes [Hq, T, L] logits per sequence for every token of the batch:
# past these sizes one call takes many seconds, so it is skipped with a note.
REFERENCE_MAX_FLOPS = 20e9
REFERENCE_MAX_BYTES = 4e9


@dataclasses.dataclass(frozen=True)
class Peer:
    name: str
    why_unavailable: Callable[[], str | None]  # None when it runs here
    prepare: Callable[[Data], Prepared]


# ---------------------------------------------------------------------------------------------
# JAX


def _jax_available() -> str | None:
    return None if importlib.util.find_spec("jax") else "jax is not installed"


def reference_cost(spec: Spec) -> tuple[float, float]:
    """(flops, peak bytes) of one call of the dense oracle on `spec` (float32)."""
    max_len = -(-max(spec.seq_lens) // spec.block_size) * spec.block_size
    heads, size, word = spec.num_heads, spec.head_size, 4
    if spec.is_decode:  # one query per sequence, sequences one at a time
        flops = spec.num_seqs * 4 * heads * max_len * size
        peak = 2 * max_len * (heads + spec.num_kv_heads) * size * word
        return flops, peak
    tokens = spec.num_tokens  # every sequence against every token of the batch
    flops = spec.num_seqs * 4 * heads * tokens * max_len * size
    peak = 4 * heads * tokens * max_len * word + spec.num_seqs * tokens * heads * size * word
    return flops, peak


def _cpu_available() -> str | None:
    """None when `jax_attn.cpu`'s kernels run here (building them on first call)."""
    reason = _jax_available()
    if reason:
        return reason
    try:
        from jax_attn import cpu
    except ImportError as e:
        return f"not available: jax_attn.cpu does not import ({e})"
    reason = cpu.unavailable_reason()
    return None if reason is None else f"not available: {reason}"


def _prepare_jax_cpu(data: Data) -> Prepared:
    from jax_attn import cpu

    spec = data.spec
    problem = cpu.shape_problem(
        query_dtype=data.query.dtype,
        cache_dtype=data.key_cache.dtype,
        block_size=spec.block_size,
        head_size=spec.head_size,
    )
    if problem:
        raise Skip(f"skipped: {problem}")
    prepared = _prepare_jax(data, impl="cpu")
    prepared.info["path"] = cpu_path(spec)
    return prepared


def cpu_path(spec: Spec) -> str:
    """What the native kernels run for `spec` here, as the record and the table note say it:
    the bf16 products' instruction set of the ragged kernel (prefills) and the decode kernel's
    path (decodes: AMX tiles only for GQA groups that fill them, `jax_attn.cpu.decode_path`)."""
    from jax_attn import cpu

    bf16 = spec.dtype == "bfloat16"
    cache = spec.cache_dtype or spec.dtype
    parts = []
    if spec.num_prefills:
        amx = bf16 and "amx-bf16" in (cpu.isa() or "")
        parts.append("prefill on " + ("amx" if amx else "vector"))
    if spec.num_prefills < spec.num_seqs:
        group = spec.num_heads // spec.num_kv_heads
        path = cpu.decode_path(cache, spec.dtype, spec.block_size, group)
        parts.append(f"decode on {path} (group {group})")
    return ", ".join(parts)


def _prepare_jax(data: Data, impl: str) -> Prepared:
    import jax
    import jax.numpy as jnp

    import jax_attn

    spec = data.spec
    scales = dict(k_scale=spec.k_scale, v_scale=spec.v_scale)
    if impl == "reference":
        flops, peak = reference_cost(spec)
        if flops > REFERENCE_MAX_FLOPS or peak > REFERENCE_MAX_BYTES:
            raise Skip(
                f"skipped: the dense oracle needs {flops / 1e9:.0f} GFLOP and "
                f"{peak / 1e9:.1f} GB per call"
            )
    query = jnp.asarray(data.query)
    key_cache, value_cache = jnp.asarray(data.key_cache), jnp.asarray(data.value_cache)
    if spec.is_decode:
        fn = functools.partial(jax_attn.paged_decode, impl=impl, **scales)
        args = (query, key_cache, value_cache, jnp.asarray(data.block_tables),
                jnp.asarray(data.seq_lens))  # fmt: skip
        entry = "paged_decode"
    else:
        metadata = jax_attn.RaggedMetadata.build(
            data.query_lens, data.context_lens, data.block_tables, spec.block_size
        )
        fn = functools.partial(jax_attn.paged_attention, causal=True, impl=impl, **scales)
        args = (query, key_cache, value_cache, metadata)
        entry = "paged_attention"
    start = time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    traced = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()

    def call():
        return compiled(*args).block_until_ready()

    def output(result) -> np.ndarray:
        return np.asarray(result.astype(jnp.float32)).reshape(result.shape[0], -1)

    info = dict(entry=entry, lower_s=traced - start, compile_s=done - traced)
    return Prepared(call, output, info)


# ---------------------------------------------------------------------------------------------
# torch: vLLM V0's backends through their public `forward`


def _torch_tensor(x: np.ndarray):
    """NumPy (bfloat16 included) -> torch, bit for bit; fp8 as its uint8 bits, as vLLM
    stores an fp8 cache."""
    import torch

    if x.dtype.name == "bfloat16":
        bits = torch.from_numpy(np.ascontiguousarray(x).view(np.int16))
        return bits.view(torch.bfloat16)
    if x.dtype.name.startswith("float8"):
        return torch.from_numpy(np.ascontiguousarray(x).view(np.uint8))
    return torch.from_numpy(np.ascontiguousarray(x))


def _torch_output(result) -> np.ndarray:
    return result.float().cpu().numpy().reshape(result.shape[0], -1)


def _torch_available() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    return None


def _backend_available(name: str) -> Callable[[], str | None]:
    def check() -> str | None:
        reason = _torch_available()
        if reason:
            return reason
        from torch_backends import get_attn_backend

        try:
            get_attn_backend(name)
        except ImportError as e:
            return f"not available: the {name} backend does not import ({e})"
        return None

    return check


def _xformers_available() -> str | None:
    reason = _torch_available()
    if reason:
        return reason
    import torch

    if not torch.cuda.is_available():
        return "not available: needs CUDA (xformers has no CPU kernel)"
    return _backend_available("XFORMERS")()


def _prepare_vllm(data: Data, backend_name: str, device: str = "cpu") -> Prepared:
    import torch

    from interop import layouts
    from torch_backends import AttentionLayer, get_attn_backend

    spec = data.spec
    backend = get_attn_backend(backend_name)
    kv_cache_dtype = {None: "auto", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8_e5m2"}
    impl = backend.get_impl_cls()(
        spec.num_heads,
        spec.head_size,
        spec.head_size**-0.5,
        spec.num_kv_heads,
        kv_cache_dtype=kv_cache_dtype[spec.cache_dtype],
        alibi_slopes=None,
        sliding_window=None,
    )
    layer = AttentionLayer(spec.k_scale, spec.v_scale)
    builder = backend.get_builder_cls()(None)
    hidden = spec.num_heads * spec.head_size
    query = _torch_tensor(data.query).reshape(spec.num_tokens, hidden).to(device)
    output = torch.empty_like(query)
    num_pre = spec.num_prefills
    pre_tokens = int(data.query_lens[:num_pre].sum())
    tables = [row[: -(-n // spec.block_size)].tolist() for row, n in
              zip(data.block_tables, data.seq_lens.tolist(), strict=True)]  # fmt: skip
    steps = []  # (query, key, value, kv_cache, metadata, output) per forward call
    kv_cache = filled = None
    if num_pre < spec.num_seqs or spec.has_cached_prefix:
        filled = layouts.nhd_to_vllm(
            _torch_tensor(data.key_cache), _torch_tensor(data.value_cache)
        ).to(device)
        # The cache's life in vLLM 0.8.5's engine: made empty, met by the backend's first step
        # while still all zeros (the step onto which the backend moves it to huge pages:
        # torch_backends.paged_backend), filled by later steps. Here: zeros, one untimed call,
        # then the workload's contents.
        kv_cache = torch.zeros_like(filled)
    if num_pre:
        # A prefill without a cached prefix reads its own contiguous K/V (vLLM's prefill); an
        # empty kv_cache tells forward to write nothing. Chunks over a cached prefix read it
        # from the paged cache (`forward_prefix`); forward takes the chunk's own K/V and writes
        # them into their slots first: the same values, so the write (a few percent of this
        # peer's time) changes nothing between calls.
        chunks = spec.has_cached_prefix
        keys, values = (_torch_tensor(x).reshape(x.shape[0], -1).to(device)
                        for x in data.prefill_kv(new_only=chunks))  # fmt: skip
        md = builder.build(
            data.seq_lens[:num_pre].tolist(),
            data.query_lens[:num_pre].tolist(),
            -1,
            -1,
            block_tables=tables[:num_pre],
            block_size=spec.block_size,
        )
        cache = kv_cache if chunks else torch.empty(0, device=device)
        steps.append((query[:pre_tokens], keys, values, cache, md, output[:pre_tokens]))
    if num_pre < spec.num_seqs:
        # Decodes read the paged cache; key=None: their keys are already cached.
        md = builder.build(
            data.seq_lens[num_pre:].tolist(),
            data.query_lens[num_pre:].tolist(),
            -1,
            -1,
            block_tables=tables[num_pre:],
            block_size=spec.block_size,
        )
        steps.append((query[pre_tokens:], None, None, kv_cache, md, output[pre_tokens:]))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def call():
        for q, k, v, cache, md, out in steps:
            impl.forward(layer, q, k, v, cache, md, output=out)
        sync()
        return output

    if filled is not None:
        call()
        kv_cache.copy_(filled)
        del filled
    info = dict(torch_threads=torch.get_num_threads(), device=device)
    if device == "cpu":
        from torch_backends import native

        reason = native.unavailable_reason()
        info["decode"] = "native op" if reason is None else "vectorized torch"
        info["prefill"] = "native ragged op" if reason is None else "torch SDPA"
        if reason is not None:
            info["note"] = f"decode in vectorized torch, prefill in SDPA: native ops {reason}"
    return Prepared(call, _torch_output, info)


# ---------------------------------------------------------------------------------------------
# IPEX: the kernels themselves


def _ipex_available() -> str | None:
    reason = _torch_available()
    if reason:
        return reason
    import torch

    if not torch.__version__.startswith("2.8"):
        return (
            f"not available: IPEX 2.8 needs torch 2.8.* (this is torch {torch.__version__}); "
            "run the bench in the IPEX env: JAX_ATTN_ENV=ipex bash scripts/run.sh jax-attn bench"
        )
    try:
        importlib.import_module("intel_extension_for_pytorch")
    except ImportError as e:
        return f"not available: intel_extension_for_pytorch does not import ({e})"
    return None


def _prepare_ipex(data: Data) -> Prepared:
    """IPEX 2.8's paged kernels over one cache in IPEX's layout: prefills through
    `PagedAttention.flash_attn_varlen_func`, decodes through
    `PagedAttention.single_query_cached_kv_attention`.

    Not `ipex.llm.functional.varlen_attention` for the prefills (vLLM V0's IPEX prefill):
    measured in the bench's process on the mixed step (4 x 256 prefill + 28 decodes, float32,
    2 threads, a loaded VM) it took the step to ~800 ms where the flash kernel's takes ~100,
    and standalone it was 1.5-3x slower than the flash kernel on its own (benchmarks/README.md,
    "IPEX's prefill"). The flash kernel over the whole step (decodes too) was slower than
    splitting off the decodes to their own kernel."""
    import torch
    from intel_extension_for_pytorch.llm.modules import PagedAttention as IpexPagedAttention

    from interop import layouts

    spec = data.spec
    if spec.cache_dtype is not None:
        if spec.cache_dtype == "float8_e4m3fn":
            raise Skip("skipped: IPEX 2.8 has fp8_e5m2 caches only")
        raise Skip(
            f"skipped: the bench calls IPEX's kernels with float caches, not {spec.cache_dtype}"
        )
    scale = spec.head_size**-0.5
    query = _torch_tensor(data.query)  # [T, Hq, D]
    output = torch.empty_like(query)
    kv_cache = layouts.nhd_to_ipex(
        _torch_tensor(data.key_cache), _torch_tensor(data.value_cache)
    )  # [2, NB, BS*Hkv*D], each half [NB, Hkv, BS, D]
    shape = (kv_cache.shape[1], spec.num_kv_heads, spec.block_size, spec.head_size)
    key_cache, value_cache = kv_cache[0].view(shape), kv_cache[1].view(shape)
    tables = torch.from_numpy(data.block_tables.copy())  # [S, max_blocks] int32
    seq_lens = torch.from_numpy(data.seq_lens.copy())
    num_pre = spec.num_prefills
    pre_tokens = int(data.query_lens[:num_pre].sum())
    steps, calls = [], {}
    if num_pre:
        # cu_seqlens_q [0, 256, 512, ...] and cu_seqlens_k the same for a prefill without a
        # cached prefix (q_len == seq_len), its keys already in the cache.
        cu_q = torch.from_numpy(np.concatenate([[0], np.cumsum(data.query_lens[:num_pre])]))
        cu_k = torch.from_numpy(np.concatenate([[0], np.cumsum(data.seq_lens[:num_pre])]))
        cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
        max_q, max_k = int(data.query_lens[:num_pre].max()), int(data.seq_lens[:num_pre].max())
        q_pre, out_pre, tables_pre = query[:pre_tokens], output[:pre_tokens], tables[:num_pre]

        def prefill():
            # (window_size_left, window_size_right) (-1, 0): no window, causal; kv_cache_dtype
            # "auto", k/v scales 1, soft cap -1 (none).
            IpexPagedAttention.flash_attn_varlen_func(
                out_pre, q_pre, key_cache, value_cache, cu_q, cu_k, max_q, max_k, scale, True,
                tables_pre, None, -1, 0, "auto", 1.0, 1.0, -1.0,
            )  # fmt: skip

        steps.append(prefill)
        calls["prefill"] = "PagedAttention.flash_attn_varlen_func"
    if num_pre < spec.num_seqs:
        # Query head h reads kv head h // (Hq / Hkv).
        group = spec.num_heads // spec.num_kv_heads
        head_mapping = torch.arange(spec.num_kv_heads, dtype=torch.int32)
        head_mapping = head_mapping.repeat_interleave(group)
        tables_dec, seq_lens_dec = tables[num_pre:], seq_lens[num_pre:]
        max_len = int(seq_lens_dec.max())
        q_dec, out_dec = query[pre_tokens:], output[pre_tokens:]

        def decode():
            IpexPagedAttention.single_query_cached_kv_attention(
                out_dec, q_dec, key_cache, value_cache, head_mapping, scale, tables_dec,
                seq_lens_dec, spec.block_size, max_len, None,
            )  # fmt: skip

        steps.append(decode)
        calls["decode"] = "PagedAttention.single_query_cached_kv_attention"

    def call():
        for step in steps:
            step()
        return output

    import intel_extension_for_pytorch as ipex

    info = dict(torch_threads=torch.get_num_threads(), ipex=ipex.__version__, **calls)
    return Prepared(call, _torch_output, info)


# ---------------------------------------------------------------------------------------------
# vLLM 0.32's CPU_ATTN: its C++ kernels, in this process (the vllm env)

VLLM_CPU_ATTN_VERSION = "0.32"
# What vLLM 0.32's CPU_ATTN backend declares it takes (`CPUAttentionBackend.supported_dtypes`,
# `get_supported_head_sizes`); its kernels have templates for these only.
_VLLM_CPU_ATTN_DTYPES = ("float32", "bfloat16", "float16")
_VLLM_CPU_ATTN_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# The bench's cache dtypes as vLLM names them (`kv_cache_dtype`; vLLM's "fp8" is e4m3).
_VLLM_KV_CACHE_DTYPE = {None: "auto", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8_e5m2"}
# Measured on a Sapphire Rapids VM (bfloat16 queries over an e4m3 cache, k_scale 0.8, v_scale
# 1.3; tests/benchmarks/test_vllm_cpu_attn.py::test_amx_fp8_deviation): the same step through
# vLLM's "vec" kernel is at 0.04 of the tolerance rule's bound against jax-xla, through "amx"
# at 4.4x (decode-fp8-bs128: 32 decodes over 1024 keys), where one dropped key of 513 lands.
# The values are read right (uniform weights: within the rule; each e4m3 subnormal reads as 0);
# the weights are not: two keys' output is 0.018 off.
VLLM_AMX_FP8_DEVIATION = (
    "vLLM 0.32's amx kernel over an fp8 cache: its attention weights are off by more than the "
    "tolerance rule allows (4.4x the bound against jax-xla at 1024 keys; its vec kernel 0.04x)"
)


# vLLM 0.32 refuses fp8 caches on x86 CPUs without AVX-512 or AMX (AMD Zen 3, say) with this
# message; the peer passes it on as its skip.
VLLM_FP8_REFUSED = "FP8 KV cache on CPU requires x86 with AVX-512 or AMX"


def vllm_takes_fp8() -> bool:
    """Whether vLLM 0.32 takes fp8 caches on this CPU (its rule: AVX-512 or AMX)."""
    from jax_attn.cpu import _build

    return bool(_build.cpu_flags() & {"avx512f", "amx_tile"})


def why_vllm_cpu_attn_unavailable() -> str | None:
    """None where vLLM 0.32's CPU attention kernels run in this process; else why not (what is
    missing, and where to find it)."""
    reason = _torch_available()
    if reason:
        return reason
    if importlib.util.find_spec("vllm") is None:
        return (
            f"not available: vLLM is not installed (vLLM {VLLM_CPU_ATTN_VERSION} is in the vllm "
            "env: JAX_ATTN_ENV=vllm bash scripts/run.sh jax-attn bench)"
        )
    try:
        import vllm
    except Exception as e:  # e.g. its compiled extension or a sibling of torch failing to load
        return f"not available: vllm does not import ({type(e).__name__}: {e})"
    if not vllm.__version__.startswith(VLLM_CPU_ATTN_VERSION + "."):
        return (
            f"not available: needs vLLM {VLLM_CPU_ATTN_VERSION} (this is vLLM "
            f"{vllm.__version__}; the vllm env has it: JAX_ATTN_ENV=vllm bash scripts/run.sh "
            "jax-attn bench)"
        )
    try:
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends import cpu_attn  # noqa: F401

        current_platform.import_kernels()  # vllm._C (or _C_AVX512 / _C_AVX2): torch.ops._C
    except Exception as e:
        return (
            f"not available: vLLM's CPU attention backend does not import ({type(e).__name__}: {e})"
        )
    import torch

    if not hasattr(torch.ops._C, "cpu_attention_with_kv_cache"):
        return "not available: vLLM registered no torch.ops._C.cpu_attention_with_kv_cache"
    return None


def _prepare_vllm_cpu_attn(data: Data) -> Prepared:
    """vLLM 0.32's `CPUAttentionBackendImpl.forward` without the layer around it: the one
    `torch.ops._C.cpu_attention_with_kv_cache` call it makes, over the whole step (prefills and
    decodes in one call, as vLLM V1 runs a step), with the scheduler metadata that
    `CPUAttentionMetadataBuilder.build` makes (`torch.ops._C.get_scheduler_metadata`), built
    here, before timing. The ISA is vLLM's own choice, the string its backend passes to the
    kernels (`_get_attn_isa`: "vec16" for block 16, "vec" for multiples of 32 in float32 or
    without AMX, "amx" for bfloat16 at multiples of 32 where the CPU has AMX tiles), and the
    cache is written once, here, by vLLM's `cpu_attn_reshape_and_cache` for that ISA (the
    kernels keep keys in a packed, ISA-specific order inside each block, so no plain copy of
    our cache would do). The AMX tile state is requested first, as vLLM's engine has it. The
    row records the ISA, the vLLM extension libraries loaded (`vllm_extensions`) and whether
    the tile state was granted, and its note shows them."""
    import torch
    import vllm
    from vllm import envs
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    amx_tiles = request_amx_tiles()
    spec = data.spec
    if spec.dtype not in _VLLM_CPU_ATTN_DTYPES:
        raise Skip(f"skipped: vLLM's CPU_ATTN takes {'/'.join(_VLLM_CPU_ATTN_DTYPES)} queries")
    if spec.head_size not in _VLLM_CPU_ATTN_HEAD_SIZES:
        raise Skip(f"skipped: vLLM's CPU_ATTN has no kernel for head size {spec.head_size}")
    kv_cache_dtype = _VLLM_KV_CACHE_DTYPE[spec.cache_dtype]
    query = _torch_tensor(data.query)  # [T, Hq, D]
    dtype = query.dtype
    try:
        isa = _get_attn_isa(dtype, spec.block_size, spec.head_size, kv_cache_dtype)
    except NotImplementedError as e:
        raise Skip(f"skipped: vLLM 0.32: {e}") from None
    if isa == "amx" and amx_tiles is not True:
        # Measured here (amx_bf16, amx_int8): without the tile state the write and the scheduler
        # metadata pass and the attention call dies with SIGILL, taking the bench with it
        # (bfloat16 and fp8 caches alike; the fp8 skip this peer had until issue 35 was that).
        raise Skip(
            "skipped: vLLM 0.32 picks its amx kernel here, but this process has no AMX tile "
            f"state (torch.cpu._init_amx: {amx_tiles}); the kernel would die with SIGILL"
        )
    if kv_cache_dtype != "auto" and isa == "vec16":
        # What cpu_attn_reshape_and_cache answers (measured): "FP8 KV cache is only supported
        # on x86 (AMX_FP8/AMX/VEC) ISA".
        raise Skip(
            f"skipped: vLLM 0.32's CPU kernels take an fp8 cache only with the vec/amx ISAs "
            f"(block sizes that are multiples of 32); block {spec.block_size} runs vec16"
        )

    # The cache, as vLLM allocates it for CPU_ATTN: [NB, Hkv, BS, 2 * D] (uint8 bits for fp8),
    # viewed as [NB, Hkv, 2 * BS, D]: per block and kv head, BS packed keys then BS values.
    num_blocks, block_size, num_kv_heads, head_size = data.key_cache.shape
    cache_dtype = torch.uint8 if kv_cache_dtype != "auto" else dtype
    kv_cache = torch.zeros((num_blocks, num_kv_heads, block_size, 2 * head_size), dtype=cache_dtype)
    key_cache, value_cache = kv_cache.view(
        (num_blocks, num_kv_heads, 2 * block_size, head_size)
    ).chunk(2, dim=2)

    def tokens(cache: np.ndarray):
        # Every slot of the core's cache, [NB * BS, Hkv, D], in the query dtype. An fp8 cache
        # goes in as its own fp8 values (exact in bfloat16 and float32) written with scale 1:
        # each is on the fp8 grid, so vLLM's quantization keeps it bit for bit (writing
        # fp8 * scale with the scale does not: vLLM's division and conversion land some
        # entries a step lower; measured, outputs up to 0.16 off). The attention call applies
        # k_scale and v_scale on reading, as for any fp8 cache.
        x = cache.reshape(-1, num_kv_heads, head_size)
        if spec.cache_dtype is not None:
            return torch.from_numpy(x.astype(np.float32)).to(dtype)
        return _torch_tensor(x)

    # Slot s = block * BS + offset: slot_mapping [0, 1, ..., NB * BS - 1] writes the core's
    # cache block for block, so the block tables carry over as they are.
    torch.ops._C.cpu_attn_reshape_and_cache(
        tokens(data.key_cache),
        tokens(data.value_cache),
        key_cache,
        value_cache,
        torch.arange(num_blocks * block_size, dtype=torch.int64),
        isa,
        1.0,  # k_scale
        1.0,  # v_scale
        kv_cache_dtype,
    )

    # query_start_loc [0, 256, 512, 768, 1024, 1025, ...]: 4 prefills of 256, then decodes.
    query_start_loc = torch.from_numpy(
        np.concatenate([[0], np.cumsum(data.query_lens)]).astype(np.int32)
    )
    seq_lens = torch.from_numpy(data.seq_lens.astype(np.int32))
    block_table = torch.from_numpy(data.block_tables.astype(np.int32))
    # CPU_ATTN's `enable_kv_split` is vLLM's VLLM_CPU_ATTN_SPLIT_KV (whatever this process's
    # environment says, as in vLLM).
    kv_split = bool(envs.VLLM_CPU_ATTN_SPLIT_KV)
    scheduler_metadata = torch.ops._C.get_scheduler_metadata(
        spec.num_seqs,
        spec.num_heads,
        num_kv_heads,
        head_size,
        seq_lens,
        dtype,
        query_start_loc,
        True,  # causal
        -1,  # sliding_window_size: none
        isa,
        kv_split,
        None,  # dynamic_causal
        kv_cache_dtype,
    )
    output = torch.empty_like(query)
    scale = head_size**-0.5

    def call():
        # Causal, no ALiBi, no window (-1), no soft cap (0.0), no sinks, no dynamic causal.
        torch.ops._C.cpu_attention_with_kv_cache(
            query, key_cache, value_cache, output, query_start_loc, seq_lens, scale,
            True, None, -1, block_table, 0.0, scheduler_metadata, None, None,
            spec.k_scale, spec.v_scale, kv_cache_dtype,
        )  # fmt: skip
        return output

    extensions = vllm_extensions()
    tiles = {True: "AMX tiles granted", False: "AMX tiles refused", None: "no _init_amx"}
    note = f"ISA {isa}; {' '.join(extensions) or 'no vllm._C*'}; {tiles[amx_tiles]}"
    deviation = None
    if isa == "amx" and kv_cache_dtype != "auto":
        deviation = VLLM_AMX_FP8_DEVIATION
        note += "; beyond the tolerance rule over fp8 (a known deviation)"
    info = dict(
        torch_threads=torch.get_num_threads(),
        vllm=vllm.__version__,
        isa=isa,
        extensions=extensions,
        amx_tiles=amx_tiles,
        kv_split=kv_split,
        call="torch.ops._C.cpu_attention_with_kv_cache",
        deviation=deviation,
        note=note,
    )
    return Prepared(call, _torch_output, info)


_VLLM_EXTENSION = re.compile(r"/vllm/(_C\w*?)\.[^/]*so$")


def vllm_extensions() -> list[str]:
    """The vLLM extension libraries loaded in this process (`vllm._C`, `vllm._C_AVX512`,
    `vllm._C_AVX2`): which of its builds `torch.ops._C` comes from. Read from the process's
    memory map rather than `sys.modules`: vLLM loads `_C_AVX512` / `_C_AVX2` with `import`, which
    registers the ops and then fails ("dynamic module does not define module export function",
    their module name is `_C`), so they never appear there."""
    found = {name for name in sys.modules if re.fullmatch(r"vllm\._C\w*", name)}
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                match = _VLLM_EXTENSION.search(line.rstrip())
                if match:
                    found.add(f"vllm.{match.group(1)}")
    except OSError:
        pass
    return sorted(found)


_amx_tiles: list[bool | None] = []  # the answer, once asked


def request_amx_tiles() -> bool | None:
    """Ask Linux for the AMX tile state for this process, as vLLM's CPU engine has it before its
    kernels run (`torch.cpu._init_amx()`: `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`;
    without it the first tile instruction dies with SIGILL). True when granted, False when
    refused (no AMX here), None where this torch has no `_init_amx`. Once per process: the
    permission is the process's, so it holds for every peer in it from then on."""
    if not _amx_tiles:
        import torch

        init = getattr(torch.cpu, "_init_amx", None)
        _amx_tiles.append(None if init is None else bool(init()))
    return _amx_tiles[0]


# ---------------------------------------------------------------------------------------------
# vLLM 0.8.5's own TORCH_SDPA: another environment, a worker process (benchmarks/vllm085.py)


def _vllm085_available() -> str | None:
    from benchmarks import vllm085

    return vllm085.why_unavailable()


def _prepare_vllm085(data: Data) -> Prepared:
    from benchmarks import vllm085

    return vllm085.prepare(data)


PEERS = [
    Peer("jax-xla", _jax_available, functools.partial(_prepare_jax, impl="xla")),
    Peer("jax-reference", _jax_available, functools.partial(_prepare_jax, impl="reference")),
    Peer("jax-cpu", _cpu_available, _prepare_jax_cpu),
    Peer(
        "TORCH_SDPA",
        _backend_available("TORCH_SDPA"),
        functools.partial(_prepare_vllm, backend_name="TORCH_SDPA"),
    ),
    Peer("IPEX", _ipex_available, _prepare_ipex),
    Peer(
        "XFORMERS",
        _xformers_available,
        functools.partial(_prepare_vllm, backend_name="XFORMERS", device="cuda"),
    ),
    Peer("vllm085-TORCH_SDPA", _vllm085_available, _prepare_vllm085),
    Peer("vllm-cpu-attn", why_vllm_cpu_attn_unavailable, _prepare_vllm_cpu_attn),
]

BASELINE = "jax-xla"

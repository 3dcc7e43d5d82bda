"""GPU benchmark: our Pallas kernels against JAX's and torch's on the same device arrays.

    python -m benchmarks.gpu_decode [--json PATH] [--reps N] [--workloads a,b] [--smoke]
    jax-attn bench --gpu [--json PATH] [--reps N] [--workloads a,b] [--quick]

Written for one H100; with no GPU it runs a smoke version (tiny sizes, Pallas kernels in
interpret mode, a few rounds) that checks the plumbing and the outputs, never the speed.

Workloads (`--smoke` keeps the names and shrinks the sizes):

| name              | step                                                | what it asks         |
|-------------------|-----------------------------------------------------|----------------------|
| `decode-bs16`     | 64 decodes at 4096 keys, Hq 32 / Hkv 8, D 128, bf16 | GB/s vs the copy     |
| `decode-bs128`    | the same with 128-token blocks                      | BS16 within 10%      |
| `prefill-16x1024` | 16 causal prefills of 1024 tokens, bf16, BS 16      | TFLOP/s              |

Peers (all read the same device arrays; torch's through `interop.dlpack.to_torch`, zero-copy):

| peer                | one call                                                                 |
|---------------------|--------------------------------------------------------------------------|
| `pallas`            | `jax_attn.paged_decode` / `paged_attention`, impl="pallas": the baseline |
|                     | of every `x pallas` ratio                                                |
| `pallas-ragged`     | decode through the unified ragged kernel (`paged_attention`, pallas)     |
| `xla`               | the same entry, impl="xla": every peer's output is checked against it    |
| `jax-pallas-op`     | `jax.experimental.pallas.ops.gpu.paged_attention.paged_attention`, its   |
|                     | defaults, on head-major `[Hkv, NB, BS, D]` copies of the caches and a    |
|                     | pre-scaled query (it takes no scale), both made once outside timing      |
| `torch-sdpa+gather` | torch gathers each sequence's blocks (`cache[block_tables]`), then SDPA: |
|                     | the gather is INSIDE the timing (what a torch backend pays)              |
| `torch-sdpa-dense`  | SDPA alone on K/V gathered once OUTSIDE the timing (contiguous           |
|                     | `[S, Hkv, L, D]`): torch's dense lower bound, not a paged kernel         |
| `torch-flex-paged`  | `torch.compile(flex_attention)` over the physical cache (the head-major  |
|                     | copy, viewed `[1, Hkv, NB*BS, D]`) with a block mask made from the block |
|                     | tables, as torch's own `experimental._paged_attention` does              |
| `jax-dpa`           | prefill: `jax.nn.dot_product_attention(implementation="cudnn")` on the   |
|                     | contiguous q/k/v (plain XLA when there is no GPU)                        |
| `torch-sdpa-flash`  | prefill: SDPA with the flash backend on the same contiguous q/k/v        |

Method (as in `benchmarks/run.py`, adapted to an asynchronous device):
1. Copy floor: a jitted `x + 1` over a 1 GiB float32 buffer (JAX) and `dst.copy_(src)` (torch),
   interleaved; the faster is the floor and also runs as one more peer in every workload's
   rounds, so each "of copy" uses a copy measured under the same conditions. Bytes counted:
   read + written.
2. Per workload: host data from `benchmarks.workloads.make_data` (finite random values in every
   slot, blocks in random order), moved to the device once; each peer prepared (layouts,
   metadata, compilation, never timed; JAX compile time reported).
3. Warm-up (two calls), then each peer's output checked against `xla` (max |diff|, and the
   one tolerance rule against a peer, `benchmarks.run._agrees`) and printed before any timing.
4. One sample of a peer = `inner` back-to-back calls, then one wait (`block_until_ready` for
   JAX, `torch.cuda.synchronize` for torch), divided by `inner`; `inner` is calibrated per peer
   so that a sample lasts about 10 ms, which hides the host's launch and sync overhead the same
   way for both frameworks. Each round samples every peer once, in an order rotated each round.
5. Report: median and IQR per call, bytes moved (every cached K/V read once + queries +
   outputs), GB/s, fraction of the copy bandwidth, TFLOP/s, `x pallas` = median / pallas median
   (> 1: our Pallas kernel is faster). `--json` writes every raw time.

JAX preallocates 75% of GPU memory on start-up, which would leave torch none: this module turns
that off (`XLA_PYTHON_CLIENT_PREALLOCATE=false`) before JAX starts, so run it as its own process.
"""

import argparse
import dataclasses
import datetime
import functools
import gc
import importlib
import importlib.util
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np

from benchmarks import run as cpu_bench
from benchmarks.workloads import Data, Spec, make_data

BASELINE = "pallas"  # every `x pallas` ratio divides by its median
REFERENCE = "xla"  # every output is compared with its output

COPY_BYTES = 1 << 30  # far beyond the 50 MB L2 of an H100
SMOKE_COPY_BYTES = 16 << 20
TARGET_SAMPLE_S = 10e-3  # one sample: enough back-to-back calls to last this long
MAX_INNER = 200
WORKLOAD_BUDGET_S = 60.0  # timed rounds stop early past this (after MIN_REPS rounds)
MIN_REPS = 5
# Goal of issue 6: block size 16 costs at most 10% more than block size 128 (pallas decode).
BS16_OVER_BS128_GOAL = 1.10


# ---------------------------------------------------------------------------------------------
# Workloads


def named_workloads(smoke: bool) -> dict[str, Spec]:
    """The three workloads by name; `smoke` keeps the names and shrinks every size."""
    if smoke:
        small = dict(num_heads=8, num_kv_heads=2, head_size=64, dtype="bfloat16", reps=3)
        specs = [
            Spec("decode-bs16", (1,) * 4, (256,) * 4, block_size=16, **small),
            Spec("decode-bs128", (1,) * 4, (256,) * 4, block_size=128, **small),
            Spec("prefill-16x1024", (64,) * 2, (64,) * 2, block_size=16, **small),
        ]
    else:
        full = dict(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16")
        specs = [
            Spec("decode-bs16", (1,) * 64, (4096,) * 64, block_size=16, reps=30, **full),
            Spec("decode-bs128", (1,) * 64, (4096,) * 64, block_size=128, reps=30, **full),
            Spec("prefill-16x1024", (1024,) * 16, (1024,) * 16, block_size=16, reps=20, **full),
        ]
    return {s.name: s for s in specs}


def _on_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


class DeviceData:
    """One workload's arrays on the device, plus the layouts some peers need, made once."""

    def __init__(self, data: Data) -> None:
        import jax.numpy as jnp

        self.spec = spec = data.spec
        self.host = data
        self.scale = spec.head_size**-0.5
        self.query = jnp.asarray(data.query)  # [T, Hq, D]
        self.key_cache = jnp.asarray(data.key_cache)  # [NB, BS, Hkv, D]
        self.value_cache = jnp.asarray(data.value_cache)
        self.block_tables = jnp.asarray(data.block_tables)  # [S, max_blocks] int32
        self.seq_lens = jnp.asarray(data.seq_lens)  # [S] int32
        self._head_major = None
        self._contiguous = None

    def head_major(self):
        """Both caches as `[Hkv, NB, BS, D]` (one transposed copy each, shared by peers)."""
        if self._head_major is None:
            import jax
            import jax.numpy as jnp

            to_hm = jax.jit(lambda c: jnp.transpose(c, (2, 0, 1, 3)))
            self._head_major = tuple(
                to_hm(c).block_until_ready() for c in (self.key_cache, self.value_cache)
            )
        return self._head_major

    def contiguous_qkv(self):
        """Equal-length prefills as batched `[S, L, H, D]` query, key, value (read back from the
        cache on the host, so every peer sees the same numbers)."""
        if self._contiguous is None:
            import jax.numpy as jnp

            spec = self.spec
            lens = set(spec.query_lens) | set(spec.seq_lens)
            if spec.num_prefills != spec.num_seqs or len(lens) != 1:
                raise Skip("dense peers need equal-length prefills (q_len == seq_len)")
            length = lens.pop()
            keys, values = self.host.prefill_kv()  # [T, Hkv, D]
            shape = (spec.num_seqs, length, -1, spec.head_size)
            self._contiguous = (
                self.query.reshape(shape),
                jnp.asarray(keys).reshape(shape),
                jnp.asarray(values).reshape(shape),
            )
        return self._contiguous


# ---------------------------------------------------------------------------------------------
# Peers


class Skip(Exception):
    """This peer does not run this workload here (the message says why)."""


@dataclasses.dataclass
class Prepared:
    launch: Callable[[], Any]  # enqueue one step; returns its (maybe unfinished) result
    wait: Callable[[Any], None]  # block until that result, and all launched before it, is ready
    output: Callable[[Any], np.ndarray]  # a result as float32 [T, Hq * D] on the host
    info: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Peer:
    name: str
    kinds: tuple[str, ...]  # "decode" and/or "prefill"
    why_unavailable: Callable[[], str | None]  # None when it runs here
    prepare: Callable[[DeviceData], Prepared]


def _jax_wait(result) -> None:
    result.block_until_ready()


def _jax_output(result) -> np.ndarray:
    import jax.numpy as jnp

    return np.asarray(result.astype(jnp.float32)).reshape(result.shape[0], -1)


def _compile_jax(fn: Callable, *args, **info) -> Prepared:
    """`jax.jit(fn)` compiled ahead for `args` (compile time reported, never timed)."""
    import jax

    start = time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    traced = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
    info.update(lower_s=traced - start, compile_s=done - traced)
    return Prepared(lambda: compiled(*args), _jax_wait, _jax_output, info)


def _available_always() -> str | None:
    return None


def _prepare_ours(d: DeviceData, impl: str, entry: str) -> Prepared:
    import jax_attn

    spec = d.spec
    interpret = {"interpret": not _on_gpu()} if impl == "pallas" else {}
    if entry == "paged_decode":
        if not spec.is_decode:
            raise Skip("paged_decode is the decode-only entry")
        fn = functools.partial(jax_attn.paged_decode, scale=d.scale, impl=impl, **interpret)
        args = (d.query, d.key_cache, d.value_cache, d.block_tables, d.seq_lens)
    else:
        metadata = jax_attn.RaggedMetadata.build(
            d.host.query_lens, d.host.context_lens, d.host.block_tables, spec.block_size
        )
        fn = functools.partial(
            jax_attn.paged_attention, scale=d.scale, causal=True, impl=impl, **interpret
        )
        args = (d.query, d.key_cache, d.value_cache, metadata)
    return _compile_jax(fn, *args, entry=f"{entry}(impl={impl!r})", **interpret)


def _prepare_ours_by_kind(d: DeviceData, impl: str) -> Prepared:
    """The decode fast path for decode steps, the ragged entry otherwise."""
    return _prepare_ours(d, impl, "paged_decode" if d.spec.is_decode else "paged_attention")


# JAX's own GPU decode kernel --------------------------------------------------------------------


def _jax_op_available() -> str | None:
    try:
        importlib.import_module("jax.experimental.pallas.ops.gpu.paged_attention")
    except ImportError as e:
        return f"not available: no jax.experimental.pallas.ops.gpu.paged_attention here ({e})"
    return None


def jax_op_tables(block_tables: np.ndarray, k_splits: int = 16, pages_per_compute_block: int = 8):
    """Block tables padded for the JAX op, and the `k_splits` / `pages_per_compute_block` to pass.

    The op asserts `pages_per_sequence % k_splits == 0` and that each split's pages are a whole
    number of compute blocks (`min(pages_per_partition, pages_per_compute_block)`). Padding
    entries are block 0: the op masks their keys by length (see `_prepare_jax_op` on why the
    memory they point to must be finite).
    E.g. 256 pages (BS 16, 4096 keys): 16 splits of 16 pages, 8 per step; 32 pages (BS 128):
    16 splits of 2 pages, 2 per step; 3 pages: 3 splits of 1 page.
    """
    max_blocks = block_tables.shape[1]
    k_splits = min(k_splits, max_blocks)
    per_split = -(-max_blocks // k_splits)
    if per_split > pages_per_compute_block:
        per_split = -(-per_split // pages_per_compute_block) * pages_per_compute_block
    padded = np.zeros((block_tables.shape[0], per_split * k_splits), np.int32)
    padded[:, :max_blocks] = block_tables
    return padded, k_splits, min(per_split, pages_per_compute_block)


def _prepare_jax_op(d: DeviceData) -> Prepared:
    """`jax.experimental.pallas.ops.gpu.paged_attention.paged_attention(q, k_pages, v_pages,
    block_tables, lengths, k_scales_pages=None, v_scales_pages=None, *, block_h=16,
    pages_per_compute_block=8, k_splits=16, num_warps=8, num_stages=2, interpret=False, ...)`
    (the signature in jax 0.10; q [S, Hq, D], pages [Hkv, NB, BS, D], no scale argument).

    The op masks logits past `lengths` but multiplies the masked (zero) weights with whatever
    the value rows hold, so a NaN anywhere in an unused tail slot, or in the blocks a padded
    table entry points to, makes the output NaN. `make_data` fills every slot of the cache with
    finite random values, which this peer relies on; SPEC.md's "unused memory may hold NaN"
    is not honoured by it.
    """
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

    spec = d.spec
    if not spec.is_decode:
        raise Skip("decode only")
    k_pages, v_pages = d.head_major()  # [Hkv, NB, BS, D], made once outside timing
    tables, k_splits, pages_per_step = jax_op_tables(d.host.block_tables)
    # No scale argument: fold it into the query once, outside timing (rounded to bf16, which
    # moves logits by ~0.4% relative: far inside the bf16 tolerance).
    query = (d.query.astype(jnp.float32) * d.scale).astype(d.query.dtype)
    fn = functools.partial(
        jax_paged.paged_attention,
        k_splits=k_splits,
        pages_per_compute_block=pages_per_step,
        interpret=not _on_gpu(),
    )
    return _compile_jax(
        fn,
        query,
        k_pages,
        v_pages,
        jnp.asarray(tables),
        d.seq_lens,
        entry="jax.experimental.pallas.ops.gpu.paged_attention",
        k_splits=k_splits,
        pages_per_compute_block=pages_per_step,
        interpret=not _on_gpu(),
    )


def _prepare_jax_dpa(d: DeviceData) -> Prepared:
    """`jax.nn.dot_product_attention` on the contiguous prefill (cuDNN flash on GPU)."""
    import jax

    if d.spec.is_decode:
        raise Skip("prefill only")
    q, k, v = d.contiguous_qkv()  # [S, L, H, D]
    implementation = "cudnn" if _on_gpu() else None

    def fn(q, k, v):
        # JAX's own XLA path mixes bf16 with f32 inside, which strict dtype promotion (the
        # test suite's setting) refuses; the promotion mode only matters while tracing.
        with jax.numpy_dtype_promotion("standard"):
            return jax.nn.dot_product_attention(
                q, k, v, scale=d.scale, is_causal=True, implementation=implementation
            )

    prepared = _compile_jax(
        fn, q, k, v, entry="jax.nn.dot_product_attention", implementation=implementation or "xla"
    )
    # [S, L, Hq, D] -> [S * L, Hq * D]
    prepared.output = lambda result: _jax_output(result.reshape(-1, *result.shape[2:]))
    return prepared


# torch, on the same device memory ---------------------------------------------------------------


def _torch_available() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if _on_gpu() and not torch.cuda.is_available():
        return (
            f"torch {torch.__version__} has no CUDA, so it cannot read JAX's GPU arrays "
            "(install a CUDA build of torch)"
        )
    return None


def _flex_available() -> str | None:
    reason = _torch_available()
    if reason:
        return reason
    try:
        importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError as e:
        return f"not available: this torch has no FlexAttention ({e})"
    return None


def _torch_wait_fn(tensor) -> Callable[[Any], None]:
    import torch

    if tensor.is_cuda:
        return lambda result: torch.cuda.synchronize()
    return lambda result: None


def _torch_output_bhld(result) -> np.ndarray:
    """[S, Hq, L, D] -> float32 [S * L, Hq * D] (token-major, as the JAX peers give it)."""
    out = result.transpose(1, 2)  # [S, L, Hq, D]
    return out.float().cpu().numpy().reshape(out.shape[0] * out.shape[1], -1)


def _torch_info(tensor) -> dict:
    import torch

    info = dict(torch=torch.__version__, device=str(tensor.device))
    if tensor.is_cuda:
        info["cuda"] = torch.version.cuda
    return info


def _decode_sdpa_inputs(d: DeviceData):
    """(query [S, Hq, 1, D], key cache, value cache [NB, BS, Hkv, D], block tables int64,
    attention mask or None), all sharing the JAX arrays' memory except the int64 tables."""
    import torch

    from interop.dlpack import to_torch

    spec = d.spec
    if not spec.is_decode:
        raise Skip("decode only")
    query = to_torch(d.query).unsqueeze(2)  # [S, Hq, D] -> [S, Hq, 1, D]
    tables = to_torch(d.block_tables).long()
    max_len = tables.shape[1] * spec.block_size
    mask = None
    if any(n != max_len for n in spec.seq_lens):
        # Keys past seq_len inside the gathered blocks; a mask rules out SDPA's flash backend.
        pos = torch.arange(max_len, device=query.device)
        mask = (pos[None, :] < to_torch(d.seq_lens).long()[:, None])[:, None, None, :]
    return query, to_torch(d.key_cache), to_torch(d.value_cache), tables, mask


def _gather(cache, tables):
    """[NB, BS, Hkv, D][S, MB] -> [S, MB, BS, Hkv, D] -> [S, L, Hkv, D] -> [S, Hkv, L, D]"""
    num_seqs, max_blocks = tables.shape
    _, block_size, num_kv_heads, head_size = cache.shape
    rows = cache[tables].view(num_seqs, max_blocks * block_size, num_kv_heads, head_size)
    return rows.transpose(1, 2)


def _prepare_sdpa_gather(d: DeviceData) -> Prepared:
    import torch.nn.functional as F

    query, key_cache, value_cache, tables, mask = _decode_sdpa_inputs(d)

    def launch():
        # The gather is part of the step: a torch backend has no paged SDPA.
        k, v = _gather(key_cache, tables), _gather(value_cache, tables)
        return F.scaled_dot_product_attention(
            query, k, v, attn_mask=mask, scale=d.scale, enable_gqa=True
        )

    info = dict(_torch_info(query), gather="inside timing", mask=mask is not None)
    return Prepared(launch, _torch_wait_fn(query), _torch_output_bhld, info)


def _prepare_sdpa_dense(d: DeviceData) -> Prepared:
    import torch.nn.functional as F

    query, key_cache, value_cache, tables, mask = _decode_sdpa_inputs(d)
    # Gathered once, outside timing, contiguous [S, Hkv, L, D].
    k = _gather(key_cache, tables).contiguous()
    v = _gather(value_cache, tables).contiguous()

    def launch():
        return F.scaled_dot_product_attention(
            query, k, v, attn_mask=mask, scale=d.scale, enable_gqa=True
        )

    info = dict(_torch_info(query), gather="outside timing", mask=mask is not None)
    return Prepared(launch, _torch_wait_fn(query), _torch_output_bhld, info)


def flex_block_mask_arrays(
    block_tables: np.ndarray, seq_lens: np.ndarray, num_blocks: int, bs: int
):
    """FlexAttention block-mask arrays for a decode batch over the physical cache.

    Returns (kv_num_blocks [S,1,1], kv_indices [S,1,1,NB], full_kv_num_blocks [S,1,1],
    full_kv_indices [S,1,1,NB], physical_to_logical [S, NB]). Full blocks (every slot a key of
    the sequence) skip the mask; the last, partial block is the one masked block. The index
    arrays are NB wide because BlockMask realizes them densely over the physical columns.
    physical_to_logical[s, b] is the logical block of physical block b in sequence s, or -1.

    E.g. seq_lens [40], tables [[7, 2, 5]], BS 16: full blocks [7, 2] (2 of them), partial [5]
    (1), physical_to_logical[0] = {7: 0, 2: 1, 5: 2, else -1}.
    """
    num_seqs = block_tables.shape[0]
    full = seq_lens // bs
    partial = (seq_lens % bs > 0).astype(np.int32)
    full_indices = np.zeros((num_seqs, 1, 1, num_blocks), np.int32)
    full_indices[:, 0, 0, : block_tables.shape[1]] = block_tables
    last = np.minimum(full, block_tables.shape[1] - 1)
    indices = np.zeros((num_seqs, 1, 1, num_blocks), np.int32)
    indices[:, 0, 0, 0] = np.where(partial > 0, block_tables[np.arange(num_seqs), last], 0)
    p2l = np.full((num_seqs, num_blocks), -1, np.int32)
    for s in range(num_seqs):
        n = -(-int(seq_lens[s]) // bs)
        p2l[s, block_tables[s, :n]] = np.arange(n, dtype=np.int32)
    return (
        partial.reshape(num_seqs, 1, 1),
        indices,
        full.astype(np.int32).reshape(num_seqs, 1, 1),
        full_indices,
        p2l,
    )


def _prepare_flex_paged(d: DeviceData) -> Prepared:
    import torch
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    from interop.dlpack import to_torch

    spec = d.spec
    if not spec.is_decode:
        raise Skip("decode only")
    bs, num_kv_heads, head_size = spec.block_size, spec.num_kv_heads, spec.head_size
    k_hm, v_hm = d.head_major()  # [Hkv, NB, BS, D]: the physical cache, head-major
    num_blocks = k_hm.shape[1]
    # [Hkv, NB, BS, D] -> [1, Hkv, NB * BS, D]: one batch row, broadcast to every query row.
    key = to_torch(k_hm).view(1, num_kv_heads, num_blocks * bs, head_size)
    value = to_torch(v_hm).view(1, num_kv_heads, num_blocks * bs, head_size)
    query = to_torch(d.query).unsqueeze(2)  # [S, Hq, D] -> [S, Hq, 1, D]
    device = query.device
    arrays = flex_block_mask_arrays(d.host.block_tables, d.host.seq_lens, num_blocks, bs)
    num_part, part_idx, num_full, full_idx, p2l = (torch.from_numpy(a).to(device) for a in arrays)
    seq_lens = to_torch(d.seq_lens)

    def mask_mod(b, h, q_idx, kv_idx):
        # Exact on its own (eager flex on CPU applies it to every physical slot).
        logical = p2l[b, kv_idx // bs]
        return (logical >= 0) & (logical * bs + kv_idx % bs < seq_lens[b])

    block_mask = BlockMask.from_kv_blocks(
        num_part,
        part_idx,
        num_full,
        full_idx,
        BLOCK_SIZE=(128, bs),
        mask_mod=mask_mod,
        seq_lengths=(1, num_blocks * bs),
    )
    if query.is_cuda:
        flex, mode = torch.compile(flex_attention, dynamic=False), "torch.compile"
    else:
        flex, mode = flex_attention, "eager (math reference: no fused CPU kernel without compile)"

    def launch():
        return flex(query, key, value, block_mask=block_mask, scale=d.scale, enable_gqa=True)

    info = dict(_torch_info(query), mode=mode, block_size=(128, bs))
    return Prepared(launch, _torch_wait_fn(query), _torch_output_bhld, info)


def _prepare_sdpa_flash(d: DeviceData) -> Prepared:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from interop.dlpack import to_torch

    if d.spec.is_decode:
        raise Skip("prefill only")
    # [S, L, H, D] -> [S, H, L, D] views of the JAX arrays' memory (the last dim stays unit
    # stride, which is all the flash kernel asks).
    q, k, v = (to_torch(x).transpose(1, 2) for x in d.contiguous_qkv())
    info = dict(_torch_info(q), backend="flash", gqa="enable_gqa")

    def sdpa(key, value):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(
                q, key, value, is_causal=True, scale=d.scale, enable_gqa=key.shape[1] != q.shape[1]
            )

    try:
        sdpa(k, v)
        args = (k, v)
    except RuntimeError as e:
        # A torch whose flash kernel refuses GQA: repeat K/V heads once, outside timing.
        group = q.shape[1] // k.shape[1]
        args = (k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))
        info["gqa"] = f"K/V heads repeated outside timing ({str(e).splitlines()[0][:80]})"
    return Prepared(lambda: sdpa(*args), _torch_wait_fn(q), _torch_output_bhld, info)


PEERS = [
    Peer(
        "pallas",
        ("decode", "prefill"),
        _available_always,
        functools.partial(_prepare_ours_by_kind, impl="pallas"),
    ),
    Peer(
        "pallas-ragged",
        ("decode",),
        _available_always,
        functools.partial(_prepare_ours, impl="pallas", entry="paged_attention"),
    ),
    Peer(
        "xla",
        ("decode", "prefill"),
        _available_always,
        functools.partial(_prepare_ours_by_kind, impl="xla"),
    ),
    Peer("jax-pallas-op", ("decode",), _jax_op_available, _prepare_jax_op),
    Peer("torch-sdpa+gather", ("decode",), _torch_available, _prepare_sdpa_gather),
    Peer("torch-sdpa-dense", ("decode",), _torch_available, _prepare_sdpa_dense),
    Peer("torch-flex-paged", ("decode",), _flex_available, _prepare_flex_paged),
    Peer("jax-dpa", ("prefill",), _available_always, _prepare_jax_dpa),
    Peer("torch-sdpa-flash", ("prefill",), _torch_available, _prepare_sdpa_flash),
]


# ---------------------------------------------------------------------------------------------
# Timing


def sample(p: Prepared, inner: int) -> float:
    """Seconds per call over `inner` back-to-back calls and one wait at the end."""
    start = time.perf_counter()
    result = None
    for _ in range(inner):
        result = p.launch()
    p.wait(result)
    return (time.perf_counter() - start) / inner


def calibrate(p: Prepared, smoke: bool) -> int:
    """Calls per sample so that a sample lasts about TARGET_SAMPLE_S (1 in smoke mode)."""
    if smoke:
        return 1
    once = min(sample(p, 1) for _ in range(3))
    return int(np.clip(round(TARGET_SAMPLE_S / max(once, 1e-7)), 1, MAX_INNER))


def _copy_methods(nbytes: int) -> dict[str, Prepared]:
    """Device copies of `nbytes` (read + written = 2 * nbytes): JAX, and torch where it runs."""
    import jax
    import jax.numpy as jnp

    src = jnp.ones((nbytes // 4,), jnp.float32).block_until_ready()
    plus_one = jax.jit(lambda x: x + jnp.float32(1))
    methods = {
        "jax x+1 (jit)": Prepared(lambda: plus_one(src), _jax_wait, _jax_output, {"bytes": nbytes})
    }
    if _torch_available() is None:
        import torch

        from interop.dlpack import to_torch

        t_src = to_torch(src)
        t_dst = torch.empty_like(t_src)
        methods["torch copy_"] = Prepared(
            lambda: t_dst.copy_(t_src), _torch_wait_fn(t_src), lambda r: np.zeros(0), {}
        )
    return methods


def measure_copy(nbytes: int, reps: int, smoke: bool) -> tuple[Prepared, dict]:
    """Every copy method interleaved; the fastest becomes the floor (and the per-workload copy)."""
    methods = _copy_methods(nbytes)
    inner = {}
    for name, p in methods.items():
        p.wait(p.launch())  # warm-up (compiles, allocates)
        inner[name] = calibrate(p, smoke)
    times = {name: [] for name in methods}
    for r in range(reps):
        names = list(methods)
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(sample(methods[name], inner[name]))
    record: dict = {"bytes": 2 * nbytes}
    for name, ts in times.items():
        stats = cpu_bench._stats(ts)
        record[name] = dict(stats, inner=inner[name], gb_s=2 * nbytes / stats["median_s"] / 1e9)
    best = max(times, key=lambda name: record[name]["gb_s"])
    record.update(method=best, gb_s=record[best]["gb_s"])
    best_copy = methods[best]
    best_copy.info.update(inner=inner[best], bytes=2 * nbytes)
    return best_copy, record


# ---------------------------------------------------------------------------------------------
# One workload


def _kind(spec: Spec) -> str:
    return "decode" if spec.is_decode else "prefill"


def _verify(spec: Spec, outputs: dict[str, np.ndarray], rows: dict[str, dict], console) -> None:
    """Each output against the xla path's: max |diff| and whether it is within the one
    tolerance rule against a peer (`benchmarks.run._agrees`)."""
    if REFERENCE not in outputs:
        for name in outputs:
            rows[name].update(max_abs_err_vs_xla=None, agrees=None)
        return
    expected = outputs[REFERENCE]
    for name, out in outputs.items():
        if out.shape != expected.shape:
            rows[name].update(max_abs_err_vs_xla=None, agrees=False)
            rows[name]["note"] = f"output shape {out.shape} != {expected.shape}"
            console.print(f"  {spec.name}: {name}: [red]output shape {out.shape}")
            continue
        diff = np.abs(out - expected)
        finite = bool(np.isfinite(out).all())
        error = float(diff.max()) if diff.size and finite else (0.0 if finite else float("nan"))
        agrees = cpu_bench._agrees(spec, out, expected)
        rows[name].update(max_abs_err_vs_xla=error, agrees=agrees)
        verdict = "ok" if agrees else "[red]WRONG"
        console.print(f"  {spec.name}: {name:18s} max |diff| vs xla {error:.2e} {verdict}")


def run_workload(
    spec: Spec,
    peers: list[Peer],
    copy: Prepared,
    reps: int,
    budget_s: float | None,
    smoke: bool,
    rng: np.random.Generator,
    console,
) -> dict:
    console.print(f"[bold]{spec.name}[/]: {spec.describe()}")
    data = DeviceData(make_data(spec, rng))
    rows: dict[str, dict] = {}
    prepared: dict[str, Prepared] = {}
    for peer in peers:
        if _kind(spec) not in peer.kinds:
            continue
        try:
            prepared[peer.name] = peer.prepare(data)
            rows[peer.name] = dict(status="ok", note="", **prepared[peer.name].info)
        except Skip as e:
            rows[peer.name] = dict(status="skipped", note=str(e))
        except Exception as e:  # reported in the table; the other peers still run
            rows[peer.name] = dict(status="error", note=f"{type(e).__name__}: {e}"[:300])

    # Warm-up (twice: the first call may compile, autotune or allocate), keep the first output.
    outputs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention's "use torch.compile" on CPU
        for name, p in list(prepared.items()):
            try:
                first = p.launch()
                p.wait(first)
                outputs[name] = p.output(first)
                p.wait(p.launch())
            except Exception as e:
                rows[name].update(status="error", note=f"{type(e).__name__}: {e}"[:300])
                del prepared[name]
    _verify(spec, outputs, rows, console)
    del outputs

    inner = {name: calibrate(p, smoke) for name, p in prepared.items()}
    inner["copy"] = copy.info["inner"]
    calls = dict(prepared, copy=copy)
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for r in range(reps):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                times[name].append(sample(calls[name], inner[name]))
            if budget_s and r + 1 >= MIN_REPS and time.perf_counter() - started > budget_s:
                break
    del prepared, calls, data
    gc.collect()

    copy_times = times.pop("copy")
    copy_stats = cpu_bench._stats(copy_times)
    copy_gb_s = copy.info["bytes"] / copy_stats["median_s"] / 1e9
    base = float(np.median(times[BASELINE])) if BASELINE in times else None
    for name, ts in times.items():
        row = rows[name]
        row.update(cpu_bench._stats(ts))
        row.update(
            inner=inner[name],
            times_s=[round(t, 9) for t in ts],
            bytes=spec.bytes_moved,
            flops=spec.flops,
            gb_s=spec.bytes_moved / row["median_s"] / 1e9,
            tflop_s=spec.flops / row["median_s"] / 1e12,
        )
        row["fraction_of_copy"] = row["gb_s"] / copy_gb_s
        row["ratio_vs_pallas"] = None if base is None else row["median_s"] / base
    return dict(
        spec=cpu_bench._spec_record(spec),
        bytes=spec.bytes_moved,
        flops=spec.flops,
        copy=dict(copy_stats, gb_s=copy_gb_s, inner=inner["copy"]),
        backends=rows,
    )


# ---------------------------------------------------------------------------------------------
# Record, table, entry point


def check_targets(results: dict) -> list[dict]:
    bs16 = cpu_bench._median(results, "decode-bs16", BASELINE)
    bs128 = cpu_bench._median(results, "decode-bs128", BASELINE)
    value = bs16 / bs128 if bs16 and bs128 else None
    return [
        dict(
            target="decode: pallas BS16 time / BS128 time",
            goal=f"<= {BS16_OVER_BS128_GOAL:.2f}",
            value=value,
            met=None if value is None else bool(value <= BS16_OVER_BS128_GOAL),
        )
    ]


def device_info() -> dict:
    import jax

    info = dict(jax_backend=jax.default_backend())
    device = jax.devices()[0]
    info["jax_device"] = f"{device.platform}: {getattr(device, 'device_kind', device)}"
    if importlib.util.find_spec("torch") is not None:
        import torch

        info["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["torch_device"] = torch.cuda.get_device_name(0)
    return info


def _fmt_rate(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


def render(console, record: dict) -> None:
    copy, fmt = record["copy"], cpu_bench._fmt
    table = cpu_bench.results_table(
        f"jax-attn GPU bench ({record['date']}, {record['device']['jax_device']}"
        f"{', SMOKE: sizes and times mean nothing' if record['smoke'] else ''}): "
        f"copy floor {copy['gb_s']:.1f} GB/s ({copy['method']})",
        ["workload", "peer", "median ms", "IQR ms", "GB/s", "of copy", "TFLOP/s", "x pallas",
         "max diff vs xla", "note"],
    )  # fmt: skip
    for name, result in record["workloads"].items():
        label = (
            f"[bold]{name}[/]\n[dim]{result['spec']['description']}\n"
            f"{result['bytes'] / 1e6:.4g} MB, {result['flops'] / 1e9:.4g} GFLOP"
        )
        shown = [(p, r) for p, r in result["backends"].items() if r["status"] != "unavailable"]
        for i, (peer, row) in enumerate(shown):
            if row["status"] != "ok":
                cells, note = [""] * 7, row["note"]
            else:
                err = fmt(row.get("max_abs_err_vs_xla"), ".1e", "-")
                cells = [
                    f"{row['median_s'] * 1e3:.3f}",
                    f"{row['iqr_s'] * 1e3:.3f}",
                    _fmt_rate(row["gb_s"]),
                    f"{row['fraction_of_copy']:.0%}",
                    _fmt_rate(row["tflop_s"]),
                    fmt(row["ratio_vs_pallas"], ".2f", "-"),
                    err + (" [red]WRONG" if row.get("agrees") is False else ""),
                ]
                note = "; ".join(
                    f"compile {row[k]:.1f} s" if k == "compile_s" else f"{k}: {row[k]}"
                    for k in ("compile_s", "gather", "mode", "gqa", "implementation")
                    if k in row
                )
            table.add_row(label if i == 0 else "", peer, *cells, note)
        c = result["copy"]
        table.add_row(
            "", "[dim]copy", f"[dim]{c['median_s'] * 1e3:.3f}", f"[dim]{c['iqr_s'] * 1e3:.3f}",
            f"[dim]{_fmt_rate(c['gb_s'])}", "[dim]100%", "", "", "", "", end_section=True,
        )  # fmt: skip
    console.print(table)
    console.print(
        "[dim]x pallas: median / pallas median (> 1: our Pallas kernel is faster). GB/s: bytes "
        "moved (K/V read once + queries + outputs) / median. Times are per call, from samples "
        "of back-to-back calls ending in one device sync."
    )
    cpu_bench.print_unavailable_and_targets(console, record, ".3f")


def run(args: argparse.Namespace, peers: list[Peer] | None = None) -> int:
    """The benchmark for parsed arguments (`jax-attn bench --gpu` passes its own namespace:
    `quick` there means `smoke` here)."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 170))
    on_gpu = _on_gpu()
    smoke = bool(getattr(args, "smoke", False) or getattr(args, "quick", False)) or not on_gpu
    if not on_gpu:
        console.print("[yellow]no GPU: smoke mode (tiny sizes, Pallas in interpret mode)")
    specs = named_workloads(smoke)
    specs = cpu_bench.select_workloads(args, specs, console)
    if specs is None:
        return 2
    reps_arg = getattr(args, "reps", None)

    runnable, unavailable = cpu_bench.available_peers(PEERS if peers is None else peers)
    record = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        smoke=smoke,
        machine=cpu_bench.machine_info(),
        device=device_info(),
        unavailable=unavailable,
        workloads={},
    )
    copy, record["copy"] = measure_copy(
        SMOKE_COPY_BYTES if smoke else COPY_BYTES, 3 if smoke else 10, smoke
    )
    console.print(f"copy floor: {record['copy']['gb_s']:.1f} GB/s ({record['copy']['method']})")
    rng = np.random.default_rng(0)
    for spec in specs.values():
        reps = reps_arg or spec.reps
        budget = None if reps_arg or smoke else WORKLOAD_BUDGET_S
        result = run_workload(spec, runnable, copy, reps, budget, smoke, rng, console)
        cpu_bench.mark_unavailable(result, unavailable)
        record["workloads"][spec.name] = result
    del copy
    record["targets"] = [] if smoke else check_targets(record["workloads"])
    render(console, record)
    return cpu_bench.write_and_judge(console, record, args, baseline="xla")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_decode", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--smoke", "--quick", action="store_true", dest="smoke",
                        help="tiny sizes, few rounds (automatic without a GPU)")  # fmt: skip
    parser.add_argument("--workloads", help="comma-separated workload names")
    parser.add_argument("--reps", type=int, default=None, help="timed rounds per workload")
    parser.add_argument("--json", help="write the record to this JSON file")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

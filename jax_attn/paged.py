"""Paged attention: the unified ragged entry (`paged_attention`), the decode fast path
(`paged_decode`), and the dispatch between their implementations.

    paged_attention(..., impl="auto")       not jitted: checks values (value_rules.py) and
                                            picks the implementation
      resolve_impl(impl, query, key_cache)  -> "xla" | "pallas" | "cpu" | "reference"
      jitted body, `impl` static: checks (shape_rules.py), then one of
        xla_paged.paged_attention_xla       portable blockwise jnp (xla_paged.py)
        pallas.ragged_paged_attention       Triton-backed Pallas kernel (pallas/)
        jax_attn.cpu.ragged_paged_attention native CPU kernel through XLA's FFI (cpu/)
        reference.paged_attention           the dense oracle (reference.py)

`paged_decode` is laid out the same way. The choice is made outside `jit` because it depends
on where the arrays live (`_resolves_impl`).
"""

import dataclasses
import functools
import sys
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jax_attn import shape_rules, value_rules
from jax_attn.metadata import RaggedMetadata
from jax_attn.validate import metadata_values
from jax_attn.xla_paged import paged_attention_xla, paged_decode_xla

Impl = Literal["auto", "xla", "pallas", "cpu", "reference"]
IMPLS = ("auto", "xla", "pallas", "cpu", "reference")


def array_device(x):
    """The device holding `x`: a concrete array's (its first), or the device a shape struct's
    sharding names (e.g. a compile-only GPU, `pallas.gpu_compile`); None for tracers, NumPy
    arrays and structs without a sharding."""
    if isinstance(x, jax.core.Tracer):
        return None
    try:
        if isinstance(x, jax.Array):
            return next(iter(x.devices()))
        sharding = getattr(x, "sharding", None) if isinstance(x, jax.ShapeDtypeStruct) else None
        return None if sharding is None else next(iter(sharding.device_set))
    except Exception:  # deleted or otherwise unreadable: the caller asks the backend
        return None


def array_platform(x) -> str:
    """The platform ("cpu", "gpu", "tpu", ...) of the device holding `x` (`array_device`);
    else (tracers, NumPy arrays, shape structs without a sharding) the platform of
    `jax.default_device` where one is set (a compile-only TPU, `pallas.tpu_compile`), else the
    default backend's."""
    device = array_device(x)
    if device is None:
        device = jax.config.jax_default_device
    platform = jax.default_backend() if device is None else _platform_of(device)
    return "gpu" if platform in ("cuda", "rocm") else platform


def _platform_of(device) -> str:
    # `jax.default_device` also takes a platform name ("cpu").
    return device if isinstance(device, str) else device.platform


def compute_capability(device) -> tuple[int, int] | None:
    """A CUDA device's compute capability, `(9, 0)` for an H100; None for other devices."""
    cc = getattr(device, "compute_capability", None) if device is not None else None
    major, _, minor = str(cc or "").partition(".")
    if not major.isdigit():
        return None
    return int(major), int(minor) if minor.isdigit() else 0


# Why `import jax_attn.cpu` failed, once it has: "auto" asks on every eager call, and a failed
# import searches the path again each time (~65 us).
_cpu_import_error: str | None = None


def cpu_kernels():
    """The `jax_attn.cpu` module when its native kernels are available here.

    Raises `RuntimeError` saying why not (the package does not import, or
    `unavailable_reason()`); never falls back silently.
    """
    global _cpu_import_error
    cpu = sys.modules.get("jax_attn.cpu")
    if cpu is None:
        reason = _cpu_import_error
        if "jax_attn.cpu" in sys.modules:  # blocked on purpose (a None entry)
            reason = "import of jax_attn.cpu halted; None in sys.modules"
        elif reason is None:
            try:
                from jax_attn import cpu
            except Exception as e:  # not built into this install, or broken: say so
                reason = _cpu_import_error = f"{type(e).__name__}: {e}"
        if cpu is None:
            raise RuntimeError(
                f"the native CPU kernels are not available: jax_attn.cpu does not import ({reason})"
            )
    if not cpu.available():
        raise RuntimeError(f"the native CPU kernels are not available: {cpu.unavailable_reason()}")
    return cpu


def _cpu_shape_problem(cpu, query, key_cache) -> str | None:
    _, block_size, _, head_size = key_cache.shape
    return cpu.shape_problem(
        query_dtype=query.dtype,
        cache_dtype=key_cache.dtype,
        block_size=block_size,
        head_size=head_size,
    )


def _pallas_problem(query, key_cache) -> str | None:
    """Why the native Pallas kernels would refuse these dtypes or shapes on the GPU holding
    `query`, or None."""
    try:
        shape_rules.check_kernel_dtypes(query.dtype, key_cache.dtype)
    except TypeError as e:
        return str(e)
    _, block_size, _, head_size = key_cache.shape
    problem = shape_rules.native_shape_problem(block_size, head_size)
    if problem is None:
        capability = compute_capability(array_device(query))
        problem = shape_rules.native_dtype_problem(key_cache.dtype, capability)
    return problem


def _tpu_problem(query, key_cache) -> str | None:
    """Why the Pallas TPU kernels would refuse these dtypes or shapes, or None."""
    from jax_attn.pallas import tpu_attention

    _, block_size, _, head_size = key_cache.shape
    return tpu_attention.tpu_problem(query.dtype, key_cache.dtype, block_size, head_size)


def pallas_on_tpu(query, interpret) -> bool:
    """Whether `impl="pallas"` means the TPU kernels (`pallas.tpu_attention`): on a TPU, or
    anywhere with `interpret` a `pltpu.InterpretParams` (Pallas' TPU interpreter, on CPU);
    otherwise the GPU kernels (`interpret=True` runs those on CPU)."""
    if interpret is None or isinstance(interpret, bool):
        return not interpret and array_platform(query) == "tpu"
    return True


def resolve_impl(impl: str, query, key_cache) -> str:
    """The implementation `impl` names, deciding "auto"; `query` and `key_cache` are arrays,
    tracers or `jax.ShapeDtypeStruct`s.

    "auto" looks at the platform where `query` lives (`array_platform`), never at JAX's
    default backend when the array can tell (CPU arrays on a CUDA host stay on the CPU):
    - gpu: "pallas" where the native kernels take these dtypes and shapes on this GPU (16/32-bit
      queries, power-of-two block and head sizes, no e4m3 cache before sm_89), else "xla";
    - tpu: "pallas" (the Pallas TPU kernels) where they take these dtypes and shapes
      (`tpu_attention.tpu_problem`: bf16/f32 queries, bf16/f32/fp8 caches), else "xla";
    - cpu: "cpu" where `jax_attn.cpu` imports, its kernels are available and its
      `shape_problem` is None, else "xla";
    - anything else: "xla".
    "cpu" raises `RuntimeError` when the native kernels are not available (with the reason)
    and `ValueError` when they refuse these shapes. The other names are returned as they are.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
    well_formed = len(query.shape) == 3 and len(key_cache.shape) == 4
    if impl == "cpu":
        problem = _cpu_shape_problem(cpu_kernels(), query, key_cache) if well_formed else None
        if problem is not None:
            raise ValueError(f"impl='cpu' cannot take these arguments: {problem}")
        return impl
    if impl != "auto":
        return impl
    if not well_formed:
        return "xla"  # the entry's checks say what is wrong
    platform = array_platform(query)
    if platform == "gpu":
        return "pallas" if _pallas_problem(query, key_cache) is None else "xla"
    if platform == "tpu":
        return "pallas" if _tpu_problem(query, key_cache) is None else "xla"
    if platform == "cpu":
        try:
            cpu = cpu_kernels()
        except RuntimeError:
            return "xla"
        return "cpu" if _cpu_shape_problem(cpu, query, key_cache) is None else "xla"
    return "xla"


def _resolves_impl(static_argnames: tuple[str, ...], check_values):
    """Make `body` a public entry that checks values and picks `impl` outside `jit`, then runs
    `body` jitted.

    `impl` depends on where the arrays live, which only a concrete array can tell (inside a
    caller's `jit` they are tracers, and the default backend decides), so it is resolved
    before the jitted body, which takes it (and `interpret`) as static arguments. The value
    checks (`check_values(query, key_cache, *args, check=..., **kwargs)`, see
    `jax_attn.value_rules`) run here too, un-jitted: eagerly on concrete values, through checkify
    inside `checked`, not at all in a plain `jit` (whose callers pay nothing). They return the
    arguments for the body: inside `checked`, a refused step's metadata is emptied (no
    sequence, no key), so no kernel reads out of range or fails before checkify reports. The
    entry keeps the body's signature and docstring; `__wrapped__` is the body, not jitted.
    """

    def decorate(body):
        jitted = jax.jit(body, static_argnames=static_argnames)

        @functools.wraps(body)
        def entry(query, key_cache, *args, impl="auto", interpret=None, check=None, **kwargs):
            args, kwargs = check_values(query, key_cache, *args, check=check, **kwargs)
            asked = impl
            impl, interpret = _resolve_with_sinks(
                impl, interpret, query, key_cache, kwargs.get("sinks")
            )
            if impl in ("pallas", "cpu") and (sharded := _partitioned(query, key_cache)):
                # One kernel per device, which XLA cannot partition: "auto" takes the XLA path
                # (partitioned by kv head), an explicit kernel is refused.
                if asked != "auto":
                    raise ValueError(
                        f"impl={impl!r} runs one kernel per device and XLA cannot partition "
                        f"it, but an argument is sharded over {sharded}: use "
                        "jax_attn.sharding.PagedSharding (the kernel per shard under "
                        "shard_map), or impl='xla', which plain jit partitions by kv head"
                    )
                impl, interpret = "xla", None
            return jitted(query, key_cache, *args, impl=impl, interpret=interpret, **kwargs)

        return entry

    return decorate


def _resolve_with_sinks(impl: str, interpret, query, key_cache, sinks):
    """`_resolve` for a call that may have attention sinks: the Pallas kernels have none yet,
    so "auto" takes the XLA path there and an explicit impl="pallas" is refused by name."""
    asked = impl
    impl, interpret = _resolve(impl, interpret, query, key_cache)
    if impl != "pallas" or sinks is None:
        return impl, interpret
    if asked != "auto":
        raise ValueError(
            "impl='pallas' does not take attention sinks (sinks=...) yet: use impl='xla' (or "
            "'auto', which picks it), or impl='cpu' on a CPU"
        )
    return "xla", None


def _partitioned(*arrays) -> str | None:
    """How a concrete argument is split over several devices ("4 devices (NamedSharding...)"),
    or None when every one lives whole on each of its devices (tracers: unknown, None)."""
    for x in arrays:
        sharding = getattr(x, "sharding", None)
        if (
            isinstance(x, jax.Array)
            and not isinstance(x, jax.core.Tracer)
            and sharding is not None
            and len(sharding.device_set) > 1
            and not sharding.is_fully_replicated
        ):
            return f"{len(sharding.device_set)} devices ({sharding})"
    return None


def _check_paged_attention(
    query, key_cache, value_cache, metadata, *, check=None, k_scale=1.0, v_scale=1.0, **rest
):
    args, kwargs = (value_cache, metadata), dict(k_scale=k_scale, v_scale=v_scale, **rest)
    if not value_rules.wanted(check):
        return args, kwargs
    # Shapes first (they raise at trace time anyway), so the value rules read sound arrays.
    shape_rules.check_query_and_cache(query, key_cache, value_cache, query_axis="num_tokens")
    shape_rules.check_metadata(metadata, query.shape[0])
    shape_rules.check_scale(k_scale, "k_scale")
    shape_rules.check_scale(v_scale, "v_scale")
    ok = value_rules.run_checks(
        _paged_rules,
        dict(**metadata_values(metadata), k_scale=k_scale, v_scale=v_scale),
        check,
        num_tokens=query.shape[0],
        num_blocks=key_cache.shape[0],
        block_size=key_cache.shape[1],
    )
    if ok is None:
        return args, kwargs
    md = metadata
    refused = dataclasses.replace(
        md,
        query_start_loc=jnp.where(ok, md.query_start_loc, 0).astype(md.query_start_loc.dtype),
        seq_lens=jnp.where(ok, md.seq_lens, 0).astype(md.seq_lens.dtype),
        block_tables=jnp.where(ok, md.block_tables, 0).astype(md.block_tables.dtype),
        slot_mapping=jnp.where(ok, md.slot_mapping, -1).astype(md.slot_mapping.dtype),
        num_seqs=jnp.where(ok, md.num_seqs, 0).astype(md.num_seqs.dtype),
    )
    kwargs.update(_safe_scales(ok, k_scale, v_scale))
    return (value_cache, refused), kwargs


def _safe_scales(ok, k_scale, v_scale) -> dict:
    """Inside `checked`: scales as traced f32 scalars, 1.0 where the step was refused."""
    return {
        name: jnp.where(ok, shape_rules.scale_array(s, name), jnp.float32(1.0))
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale))
    }


def _paged_rules(xp, *, k_scale, v_scale, **ragged):
    yield from value_rules.ragged_rules(xp, **ragged)
    yield from value_rules.scale_rules(xp, k_scale=k_scale, v_scale=v_scale)


def _check_paged_decode(
    query,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    *,
    check=None,
    k_scale=1.0,
    v_scale=1.0,
    **rest,
):
    args = (value_cache, block_tables, seq_lens)
    kwargs = dict(k_scale=k_scale, v_scale=v_scale, **rest)
    if not value_rules.wanted(check):
        return args, kwargs
    shape_rules.check_query_and_cache(query, key_cache, value_cache, query_axis="num_seqs")
    shape_rules.check_decode_arrays(block_tables, seq_lens, query.shape[0])
    shape_rules.check_scale(k_scale, "k_scale")
    shape_rules.check_scale(v_scale, "v_scale")
    ok = value_rules.run_checks(
        _decode_rules,
        dict(block_tables=block_tables, seq_lens=seq_lens, k_scale=k_scale, v_scale=v_scale),
        check,
        num_blocks=key_cache.shape[0],
        block_size=key_cache.shape[1],
    )
    if ok is None:
        return args, kwargs
    kwargs.update(_safe_scales(ok, k_scale, v_scale))
    tables = jnp.where(ok, block_tables, 0).astype(block_tables.dtype)
    return (value_cache, tables, jnp.where(ok, seq_lens, 0).astype(seq_lens.dtype)), kwargs


def _decode_rules(xp, *, k_scale, v_scale, **tables):
    yield from value_rules.table_rules(xp, **tables)
    yield from value_rules.scale_rules(xp, k_scale=k_scale, v_scale=v_scale)


def _resolve(impl, interpret, query, key_cache) -> tuple[str, bool | None]:
    """(impl, interpret) as the jitted bodies take them (both static)."""
    impl = resolve_impl(impl, query, key_cache)
    if impl != "pallas":
        return impl, None  # one compiled version whatever `interpret` says
    if pallas_on_tpu(query, interpret):
        if not interpret and (problem := _tpu_problem(query, key_cache)) is not None:
            raise ValueError(f"impl='pallas' cannot take these arguments on a TPU: {problem}")
        return impl, interpret or False
    interpret = array_platform(query) != "gpu" if interpret is None else interpret
    if not interpret:
        problem = shape_rules.native_dtype_problem(
            key_cache.dtype, compute_capability(array_device(query))
        )
        if problem is not None:
            raise ValueError(f"impl='pallas' cannot take these arguments: {problem}")
    return impl, interpret


def _pallas_kernels(query, interpret):
    """The module holding the Pallas kernels `impl="pallas"` runs (`pallas_on_tpu`)."""
    if pallas_on_tpu(query, interpret):
        from jax_attn.pallas import tpu_attention

        return tpu_attention
    from jax_attn import pallas

    return pallas


@_resolves_impl(
    static_argnames=("scale", "causal", "sliding_window", "logits_soft_cap", "impl", "interpret"),
    check_values=_check_paged_attention,
)
def paged_attention(
    query: Float[Array, "num_tokens num_heads head_size"],
    key_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    value_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    metadata: RaggedMetadata,
    *,
    scale: float | None = None,
    causal: bool = True,
    alibi_slopes: Float[Array, " num_heads"] | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float | Float[Array, ""] = 1.0,
    v_scale: float | Float[Array, ""] = 1.0,
    sinks: Float[Array, " num_heads"] | None = None,
    impl: Impl = "auto",
    interpret: bool | None = None,
) -> Float[Array, "num_tokens num_heads head_size"]:
    """Attention of a ragged batch mixing decode, prefill and chunked prefill over a paged cache.

    Sequence `i` owns query tokens `query_start_loc[i]:query_start_loc[i+1]` and keys at
    positions `0..seq_lens[i]-1` (the new tokens' keys must already be written with
    `write_kv`); its query `j` sits at position `seq_len - q_len + j`. Only the first
    `metadata.num_seqs` sequences are real; output rows of tokens past
    `query_start_loc[num_seqs]` are zeros, as are rows whose keys are all masked.

    `impl`: "xla" (portable blockwise jnp), "pallas" (the GPU kernel, or the TPU kernel on a
    TPU; `interpret=True` runs the GPU kernel on CPU, by default when the arrays are not on a
    GPU or TPU, and `interpret=pltpu.InterpretParams()` the TPU kernel), "cpu" (native CPU
    kernel; `RuntimeError` when it is not available here), "reference" (the dense oracle),
    "auto" (the fastest that takes these shapes where the arrays live: pallas on GPU and TPU,
    cpu on CPU, else xla; see `resolve_impl`). `scale` defaults to `head_size ** -0.5`.
    Jitted inside (the choice of `impl` is made before), and jit-able from outside.

    `sinks` `[num_heads]` (gpt-oss's attention sinks): one logit per query head that joins
    every row's softmax as a key with no value, so a row's output is
    `sum_j p_j v_j / (sum_j p_j + exp(sinks[h] - max))` (not scaled, capped or biased). Taken
    by "xla", "cpu" and "reference"; "pallas" refuses it ("auto" then picks "xla").

    `check` (keyword of the entry, default `jax_attn.config.check`, on): when the metadata
    and scales are concrete, the rules of `validate` plus finite positive scales are checked
    before anything runs, raising `ValueError`; under `jit` they are checked only inside
    `jax_attn.checked` (checkify). See `jax_attn.value_rules`.
    """
    bias = dict(
        alibi_slopes=alibi_slopes,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    shape_rules.check_attention_args(query, key_cache, value_cache, query_axis="num_tokens", **bias)
    shape_rules.check_metadata(metadata, query.shape[0])
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    bias["causal"] = causal
    shape_rules.check_sinks(sinks, query.shape[1])
    md = metadata
    ragged = (md.query_start_loc, md.seq_lens, md.block_tables, md.num_seqs)
    if impl == "pallas":
        ragged_paged_attention = _pallas_kernels(query, interpret).ragged_paged_attention
        return ragged_paged_attention(
            query, key_cache, value_cache, *ragged, scale=scale, interpret=interpret, **bias
        )
    bias["sinks"] = sinks
    if impl == "reference":
        from jax_attn import reference

        return reference.paged_attention(
            query, key_cache, value_cache, md, scale=scale, **bias
        ).astype(query.dtype)
    if impl == "cpu":
        return cpu_kernels().ragged_paged_attention(
            query, key_cache, value_cache, *ragged, scale=scale, **bias
        )
    return paged_attention_xla(query, key_cache, value_cache, md, scale=scale, **bias)


@_resolves_impl(
    static_argnames=("scale", "sliding_window", "logits_soft_cap", "impl", "interpret"),
    check_values=_check_paged_decode,
)
def paged_decode(
    query: Float[Array, "num_seqs num_heads head_size"],
    key_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    value_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    block_tables: Int[Array, "num_seqs max_blocks"],
    seq_lens: Int[Array, " num_seqs"],
    *,
    scale: float | None = None,
    alibi_slopes: Float[Array, " num_heads"] | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float | Float[Array, ""] = 1.0,
    v_scale: float | Float[Array, ""] = 1.0,
    sinks: Float[Array, " num_heads"] | None = None,
    impl: Impl = "auto",
    interpret: bool | None = None,
) -> Float[Array, "num_seqs num_heads head_size"]:
    """One new query token per sequence, at position `seq_lens[i] - 1`, over the paged cache.

    Rows with `seq_lens[i] == 0` (padding) give zeros. Same keywords as `paged_attention`
    (`sinks` included); the value checks (`check`) cover the block tables, `seq_lens` and the
    scales.
    """
    bias = dict(
        alibi_slopes=alibi_slopes,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    shape_rules.check_attention_args(query, key_cache, value_cache, query_axis="num_seqs", **bias)
    shape_rules.check_decode_arrays(block_tables, seq_lens, query.shape[0])
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    shape_rules.check_sinks(sinks, query.shape[1])
    args = (query, key_cache, value_cache, block_tables, seq_lens)
    if impl == "pallas":
        pallas_decode = _pallas_kernels(query, interpret).paged_decode
        return pallas_decode(*args, scale=scale, interpret=interpret, **bias)
    bias["sinks"] = sinks
    if impl == "reference":
        from jax_attn import reference

        return reference.paged_decode(*args, scale=scale, **bias).astype(query.dtype)
    if impl == "cpu":
        return cpu_kernels().paged_decode(*args, scale=scale, **bias)
    return paged_decode_xla(*args, scale=scale, **bias)

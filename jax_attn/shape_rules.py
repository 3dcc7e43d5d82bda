"""Shape and dtype rules: the trace-time argument checks shared by every entry and kernel.

Everything here looks only at shapes, dtypes and static configuration, so it runs while
tracing (and on concrete arrays alike) and raises `TypeError` / `ValueError` naming the
argument, the rule and the value. The rules on values (ids in range, lengths consistent) need
concrete arrays or checkify and live in `value_rules.py`; `validate.py` holds the public
`jax_attn.validate`, which runs them eagerly on a metadata. (Issue 22: the three modules were
`checks.py`, `checking.py` and `validate.py`; now each is named for what it checks.)

The rules that differ on purpose:
- the core entries take any float query and cache dtype (fp8 included) and any integer dtype
  for index arrays; the Pallas kernels take 16/32-bit float queries, 16/32-bit float or fp8
  caches and int32 index arrays (`check_kernel_dtypes`, `int32_only=True`);
- the native (Triton) kernels also need power-of-two tiles (`native_shape_problem`).
"""

from collections.abc import Sequence

import jax.numpy as jnp

from jax_attn.metadata import RaggedMetadata

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
# The float dtypes the kernels compute in (queries) and read (caches, besides fp8).
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# Triton's `tl.dot` needs at least 16 rows and 16 columns.
MIN_DOT = 16

# An axis of an expected shape: its name and its size (None: any size).
Axis = tuple[str, int | None]


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in FP8_DTYPES


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_rank(x, name: str, axes: Sequence[str]) -> None:
    """`x` has one dimension per named axis: `query must be 3-D [num_tokens, ...]`."""
    if x.ndim == len(axes):
        return
    if not axes:
        raise ValueError(f"{name}.shape={tuple(x.shape)} must be a scalar ()")
    raise ValueError(
        f"{name} must be {len(axes)}-D [{', '.join(axes)}], got shape {tuple(x.shape)}"
    )


def check_index_array(x, name: str, axes: Sequence[Axis], *, int32_only: bool = False) -> None:
    """An index array of the shape `axes` describes, with an integer dtype (int32).

    `axes` pairs each axis name with its size, or None where any size goes:
    `check_index_array(seq_lens, "seq_lens", [("num_seqs", 4)])`.
    """
    check_rank(x, name, [axis for axis, _ in axes])
    sizes = [size for _, size in axes]
    if any(s is not None and s != actual for s, actual in zip(sizes, x.shape, strict=True)):
        expected = ", ".join(
            axis if size is None or axis == str(size) else f"{axis}={size}" for axis, size in axes
        )
        raise ValueError(f"{name}.shape={tuple(x.shape)} must be [{expected}]")
    if int32_only and x.dtype != jnp.int32:
        raise TypeError(f"{name}.dtype={x.dtype} must be int32")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name}.dtype={x.dtype} must be an integer dtype (int32)")


def check_positive_int(value, name: str) -> None:
    """A static size or option: a positive int, or None for the default."""
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{name}={value!r} must be a positive int or None")


def check_cache_dtype(dtype, argname: str = "key_cache") -> None:
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"{argname}.dtype={dtype} is not a supported cache dtype: use a float dtype or "
            "float8_e4m3fn / float8_e5m2"
        )


def check_cache_pair(key_cache, value_cache) -> None:
    """Two `[num_blocks, block_size, num_kv_heads, head_size]` caches of one float dtype."""
    check_rank(key_cache, "key_cache", ["num_blocks", "block_size", "num_kv_heads", "head_size"])
    check_same_shape(value_cache, key_cache)
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(
            f"value_cache.dtype={value_cache.dtype} must equal key_cache.dtype={key_cache.dtype}"
        )
    check_cache_dtype(key_cache.dtype)


def check_same_shape(value_cache, key_cache) -> None:
    if tuple(value_cache.shape) != tuple(key_cache.shape):
        raise ValueError(
            f"value_cache.shape={tuple(value_cache.shape)} must equal "
            f"key_cache.shape={tuple(key_cache.shape)}"
        )


def check_query_and_cache(query, key_cache, value_cache, *, query_axis: str) -> None:
    """`query [query_axis, num_heads, head_size]` against the caches: float dtypes, one head
    size, and whole GQA groups (`num_heads % num_kv_heads == 0`)."""
    check_rank(query, "query", [query_axis, "num_heads", "head_size"])
    if not jnp.issubdtype(query.dtype, jnp.floating):
        raise TypeError(f"query.dtype={query.dtype} must be a float dtype")
    check_cache_pair(key_cache, value_cache)
    num_heads, head_size = query.shape[1:]
    num_kv_heads, cache_head_size = key_cache.shape[2:]
    if cache_head_size != head_size:
        raise ValueError(f"query head_size={head_size} != cache head_size={cache_head_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} must be divisible by {num_kv_heads=}")


def check_sinks(sinks, num_heads: int) -> None:
    """Attention sinks: None, or one float logit per query head."""
    if sinks is None:
        return
    if jnp.shape(sinks) != (num_heads,):
        raise ValueError(f"sinks must be [num_heads={num_heads}], got shape {jnp.shape(sinks)}")
    if not jnp.issubdtype(jnp.asarray(sinks).dtype, jnp.floating):
        raise TypeError(f"sinks.dtype={jnp.asarray(sinks).dtype} must be a float dtype")


def check_bias_args(num_heads: int, alibi_slopes, sliding_window, logits_soft_cap) -> None:
    """ALiBi slopes one per query head, a positive window and soft cap (or None)."""
    if alibi_slopes is not None and tuple(jnp.shape(alibi_slopes)) != (num_heads,):
        raise ValueError(
            f"alibi_slopes must have shape ({num_heads},) (one per query head), "
            f"got alibi_slopes.shape={tuple(jnp.shape(alibi_slopes))}"
        )
    check_positive_int(sliding_window, "sliding_window")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap={logits_soft_cap!r} must be positive or None")


def check_attention_args(
    query,
    key_cache,
    value_cache,
    *,
    query_axis: str,
    alibi_slopes=None,
    sliding_window=None,
    logits_soft_cap=None,
    k_scale=1.0,
    v_scale=1.0,
) -> None:
    """Every check of a paged entry's query, caches and bias keywords."""
    check_query_and_cache(query, key_cache, value_cache, query_axis=query_axis)
    check_bias_args(query.shape[1], alibi_slopes, sliding_window, logits_soft_cap)
    check_scale(k_scale, "k_scale")
    check_scale(v_scale, "v_scale")


def check_metadata_type(metadata) -> None:
    if not isinstance(metadata, RaggedMetadata):
        raise TypeError(f"metadata must be a RaggedMetadata, got {type(metadata).__name__}")


def check_ragged_arrays(
    query_start_loc,
    seq_lens,
    block_tables,
    num_seqs,
    *,
    prefix: str = "",
    int32_only: bool = False,
) -> None:
    """The arrays of a ragged batch agree on the number of (padded) sequences."""
    check_index_array(
        block_tables,
        f"{prefix}block_tables",
        [("num_seqs", None), ("max_blocks", None)],
        int32_only=int32_only,
    )
    max_seqs = block_tables.shape[0]
    check_index_array(
        seq_lens, f"{prefix}seq_lens", [("num_seqs", max_seqs)], int32_only=int32_only
    )
    check_index_array(
        query_start_loc,
        f"{prefix}query_start_loc",
        [("num_seqs + 1", max_seqs + 1)],
        int32_only=int32_only,
    )
    check_index_array(num_seqs, f"{prefix}num_seqs", [], int32_only=int32_only)


def check_metadata(metadata, num_tokens: int) -> None:
    """A `RaggedMetadata` whose arrays fit each other and `num_tokens` query tokens."""
    check_metadata_type(metadata)
    md = metadata
    check_ragged_arrays(
        md.query_start_loc, md.seq_lens, md.block_tables, md.num_seqs, prefix="metadata."
    )
    check_index_array(md.slot_mapping, "metadata.slot_mapping", [("num_tokens", num_tokens)])


def check_decode_arrays(block_tables, seq_lens, num_seqs: int, *, int32_only=False) -> None:
    """A decode batch's block tables and lengths, one row per query."""
    check_index_array(
        block_tables,
        "block_tables",
        [("num_seqs", num_seqs), ("max_blocks", None)],
        int32_only=int32_only,
    )
    check_index_array(seq_lens, "seq_lens", [("num_seqs", num_seqs)], int32_only=int32_only)


def check_kernel_dtypes(query_dtype, cache_dtype) -> None:
    """What the Pallas kernels compute with: 16/32-bit float queries; 16/32-bit float or fp8
    caches."""
    query_dtype, cache_dtype = jnp.dtype(query_dtype), jnp.dtype(cache_dtype)
    if query_dtype not in FLOAT_DTYPES:
        raise TypeError(f"query.dtype={query_dtype} must be float32, bfloat16 or float16")
    if cache_dtype not in FLOAT_DTYPES + FP8_DTYPES:
        raise TypeError(
            f"key_cache.dtype={cache_dtype} must be float32, bfloat16, float16 or float8 "
            "(e4m3fn / e5m2) for the Pallas kernels"
        )


def native_shape_problem(block_size: int, head_size: int) -> str | None:
    """Why the native (Triton) kernels cannot take these cache shapes, or None if they can.

    Triton loads whole power-of-two tiles and has no masked path over the head dimension here,
    so head sizes such as 80 or 96 need the XLA path (or `interpret=True`). A caller picking an
    implementation automatically can test this before choosing the Pallas kernels.
    """
    if not is_pow2(block_size):
        return f"{block_size=} must be a power of two for the native GPU kernel"
    if not is_pow2(head_size) or head_size < MIN_DOT:
        return f"{head_size=} must be a power of two >= 16 for the native GPU kernel"
    return None


def native_dtype_problem(cache_dtype, capability: tuple[int, int] | None) -> str | None:
    """Why a GPU of compute `capability` (None: unknown) cannot run the native kernels on a
    cache of `cache_dtype`, or None: Triton's e4m3 (fp8e4nv) needs sm_89 or newer (Ada,
    Hopper), so an A100 (8.0) takes e5m2 caches but not e4m3 ones."""
    if capability is None or jnp.dtype(cache_dtype) != jnp.dtype(jnp.float8_e4m3fn):
        return None
    if tuple(capability) < (8, 9):
        major, minor = capability
        return (
            f"key_cache.dtype=float8_e4m3fn needs compute capability >= 8.9 for the native GPU "
            f"kernel; this GPU has {major}.{minor}"
        )
    return None


def check_native_shapes(block_size: int, head_size: int, interpret: bool) -> None:
    """Triton loads whole power-of-two tiles; interpret mode has no such limit."""
    problem = None if interpret else native_shape_problem(block_size, head_size)
    if problem is not None:
        raise ValueError(problem)


def check_native_tile(
    value: int | None, name: str, *, width: int, width_name: str = "block_size"
) -> None:
    """A tile option of a native kernel: a power of two with `value * width >= 16` (tl.dot)."""
    if value is not None and (not is_pow2(value) or value * width < MIN_DOT):
        raise ValueError(
            f"{name}={value} must be a power of two with {name} * {width_name}={width} >= 16 on GPU"
        )


def check_kernel_args(
    query, key_cache, value_cache, *, query_axis: str, interpret: bool, **bias
) -> None:
    """`check_attention_args` (with the `bias` keywords), and what the Pallas kernels add:
    their dtypes, and the native shapes unless they run in interpret mode."""
    check_attention_args(query, key_cache, value_cache, query_axis=query_axis, **bias)
    check_kernel_dtypes(query.dtype, key_cache.dtype)
    block_size, head_size = key_cache.shape[1], key_cache.shape[3]
    check_native_shapes(block_size, head_size, interpret)


def check_scale(value, name: str) -> None:
    """A cache scale: a Python float or an f32 scalar (`()` or `(1,)`), possibly traced."""
    shape = tuple(jnp.shape(value))
    if shape not in ((), (1,)):
        raise ValueError(f"{name} must be a scalar; got shape {shape}")


def scale_array(value, name: str):
    """A Python float or an f32 scalar array (possibly traced) as an f32 scalar array."""
    check_scale(value, name)
    return jnp.asarray(value, dtype=jnp.float32).reshape(())

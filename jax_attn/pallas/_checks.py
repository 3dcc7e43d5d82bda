"""Trace-time argument checks and small helpers shared by the Pallas kernels.

Everything here looks only at shapes, dtypes and static configuration, so it runs while
tracing and raises `TypeError` / `ValueError` naming the argument and the rule.
"""

import jax
import jax.numpy as jnp

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# A finite "minus infinity": masked logits and the running max of an empty row. With a finite
# value `m_prev - m_next` is never `-inf - -inf`, so an all-masked block gives no NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

# Triton's `tl.dot` needs at least 16 rows and 16 columns.
MIN_DOT = 16

# Pallas-Triton lowers a DEFAULT-precision dot of float32 operands to TF32 (a 10-bit mantissa,
# errors ~1e-3); HIGHEST asks for IEEE float32. It changes nothing for 16-bit operands.
DOT_PRECISION = jax.lax.Precision.HIGHEST

# Bytes of one K (or V) tile per loop step (in the dot's dtype). Triton's pipeliner may stage
# the K and V loads through shared memory (num_stages=2: two of each resident) and an H100 has
# 227 KiB of it per block; 32 KiB tiles leave room for the query tile and the dot operands,
# where 128 keys of a D=256 bf16 or D=128 float32 head would not. Large heads and float32
# therefore step over fewer keys (and the ragged kernel takes fewer query rows).
MAX_KV_TILE_BYTES = 32 * 1024


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def max_block_k(head_size: int, dtype) -> int:
    """The most keys per loop step whose `[block_k, head_size]` tile of `dtype` fits the budget
    (a power of two, at least 16)."""
    keys = MAX_KV_TILE_BYTES // (head_size * jnp.dtype(dtype).itemsize)
    return max(MIN_DOT, 1 << max(0, keys.bit_length() - 1))


def compute_dtype(query_dtype, cache_dtype):
    """The dtype both dot operands are cast to: the query's for fp8 caches (an fp8 x bf16 dot
    has no Triton lowering), else the wider of the two so a float32 cache keeps its bits."""
    if jnp.dtype(cache_dtype) in FP8_DTYPES:
        return jnp.dtype(query_dtype)
    query_dtype, cache_dtype = jnp.dtype(query_dtype), jnp.dtype(cache_dtype)
    # Spelled out rather than `promote_types`, which strict promotion refuses for bf16 x f32.
    if query_dtype == cache_dtype:
        return query_dtype
    return jnp.dtype(jnp.float32)


def check_query_and_cache(query, key_cache, value_cache, *, query_axis: str) -> None:
    if query.ndim != 3:
        raise ValueError(f"query must be [{query_axis}, num_heads, head_size]; got {query.shape}")
    if key_cache.ndim != 4:
        raise ValueError(
            "key_cache must be [num_blocks, block_size, num_kv_heads, head_size]; "
            f"got {key_cache.shape}"
        )
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"{value_cache.shape=} must equal {key_cache.shape=}")
    if jnp.dtype(query.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"query.dtype={query.dtype} must be float32, bfloat16 or float16")
    cache_dtypes = FLOAT_DTYPES + FP8_DTYPES
    if jnp.dtype(key_cache.dtype) not in cache_dtypes:
        raise TypeError(
            f"key_cache.dtype={key_cache.dtype} must be a float or float8 (e4m3fn / e5m2) dtype"
        )
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(f"{value_cache.dtype=} must equal {key_cache.dtype=}")
    num_heads, head_size = query.shape[1:]
    num_kv_heads, cache_head_size = key_cache.shape[2:]
    if cache_head_size != head_size:
        raise ValueError(f"key_cache head_size={cache_head_size} must equal query {head_size=}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} must be divisible by {num_kv_heads=}")


def check_int_array(x, name: str, shape: tuple[int, ...], shape_text: str) -> None:
    if x.dtype != jnp.int32:
        raise TypeError(f"{name}.dtype={x.dtype} must be int32")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name}.shape={tuple(x.shape)} must be {shape_text} = {shape}")


def check_features(alibi_slopes, sliding_window, logits_soft_cap, num_heads: int) -> None:
    if alibi_slopes is not None and tuple(alibi_slopes.shape) != (num_heads,):
        raise ValueError(f"alibi_slopes.shape={alibi_slopes.shape} must be ({num_heads=},)")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"{sliding_window=} must be a positive int or None")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"{logits_soft_cap=} must be positive or None")


def check_positive(value, name: str) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{name}={value!r} must be a positive int or None")


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


def check_native_shapes(block_size: int, head_size: int, interpret: bool) -> None:
    """Triton loads whole power-of-two tiles; interpret mode has no such limit."""
    problem = None if interpret else native_shape_problem(block_size, head_size)
    if problem is not None:
        raise ValueError(problem)


def scale_array(value, name: str):
    """A Python float or an f32 scalar array (possibly traced) as an f32 scalar array."""
    x = jnp.asarray(value, dtype=jnp.float32)
    if x.ndim != 0 and x.shape != (1,):
        raise ValueError(f"{name} must be a scalar; got shape {x.shape}")
    return x.reshape(())

"""What the native CPU kernels take: dtypes and sizes, checked at trace time."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np

QUERY_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))
CACHE_DTYPES = (
    *QUERY_DTYPES,
    np.dtype(ml_dtypes.float8_e4m3fn),
    np.dtype(ml_dtypes.float8_e5m2),
)
MAX_HEAD_SIZE = 512  # csrc/kernel_common.h kMaxHeadSize (the ragged kernel's)
# csrc/kernel_common.h kMaxDecodeHeadSize: the decode kernel's; `paged_decode` runs larger heads
# on the ragged kernel.
MAX_DECODE_HEAD_SIZE = 256
MAX_BLOCK_SIZE = 256


def shape_problem(*, query_dtype, cache_dtype, block_size: int, head_size: int) -> str | None:
    """Why the native kernels refuse these (None: supported). Any GQA group size is taken."""
    qd, cd = np.dtype(query_dtype), np.dtype(cache_dtype)
    if qd not in QUERY_DTYPES:
        return f"query dtype {qd.name} is not one of float32, bfloat16, float16"
    if cd not in CACHE_DTYPES:
        return (
            f"cache dtype {cd.name} is not one of float32, bfloat16, float16, "
            "float8_e4m3fn, float8_e5m2"
        )
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        return f"block_size={block_size} is not in 1..{MAX_BLOCK_SIZE}"
    if not 1 <= head_size <= MAX_HEAD_SIZE:
        return f"head_size={head_size} is not in 1..{MAX_HEAD_SIZE}"
    return None

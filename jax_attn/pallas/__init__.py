"""Pallas kernels (Triton-backed on GPU; `interpret=True` runs them on CPU).

One kernel per file, each with its plain-jnp `*_reference` beside it:

- `paged_decode`: one query token per sequence, split-K over the keys.
- `ragged_paged_attention`: a mixed batch of decode, prefill and chunked prefill in one launch.
"""

from jax_attn.pallas.paged_decode import paged_decode, paged_decode_reference
from jax_attn.pallas.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

__all__ = [
    "paged_decode",
    "paged_decode_reference",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
]

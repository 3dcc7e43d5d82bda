"""jax_attn: paged attention as pure JAX functions (see SPEC section 1)."""

from jax_attn import reference
from jax_attn.bias import AttentionBias, alibi_slopes
from jax_attn.cache import copy_blocks, kv_cache_shape, swap_blocks, write_kv
from jax_attn.metadata import RaggedMetadata
from jax_attn.paged import paged_attention, paged_decode
from jax_attn.validate import validate
from jax_attn.value_rules import checked, config
from jax_attn.varlen import varlen_attention

PAD_SLOT_ID = -1

__all__ = [
    "PAD_SLOT_ID",
    "AttentionBias",
    "RaggedMetadata",
    "alibi_slopes",
    "checked",
    "config",
    "copy_blocks",
    "kv_cache_shape",
    "paged_attention",
    "paged_decode",
    "reference",
    "swap_blocks",
    "validate",
    "varlen_attention",
    "write_kv",
]

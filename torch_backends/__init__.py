"""vLLM V0's attention backends for PyTorch (TORCH_SDPA, XFORMERS, IPEX), standalone."""

from torch_backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
)
from torch_backends.registry import get_attn_backend

__all__ = [
    "AttentionBackend",
    "AttentionImpl",
    "AttentionLayer",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "AttentionType",
    "get_attn_backend",
]

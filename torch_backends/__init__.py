"""vLLM V0's attention backends for PyTorch (TORCH_SDPA, XFORMERS, IPEX), standalone.

The names below are imported on first use, so `import torch_backends` (and
`torch_backends.AttentionType`, `torch_backends.get_attn_backend`) works without torch; the
interface classes need torch.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch_backends.abstract import (
        AttentionBackend,
        AttentionImpl,
        AttentionLayer,
        AttentionMetadata,
        AttentionMetadataBuilder,
    )
    from torch_backends.attention_type import AttentionType
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


def __getattr__(name: str):
    if name == "AttentionType":
        from torch_backends.attention_type import AttentionType

        return AttentionType
    if name == "get_attn_backend":
        from torch_backends.registry import get_attn_backend

        return get_attn_backend
    if name in __all__:
        from torch_backends import abstract

        return getattr(abstract, name)
    raise AttributeError(f"module 'torch_backends' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])

"""`AttentionType`: vLLM V0's attention types, in a module that needs no torch.

The cross-check harness and the `jax-attn` command name attention types without importing
torch; `torch_backends.abstract` re-exports this same class, so there is one enum.
"""

import enum


class AttentionType(enum.StrEnum):
    """A `str` Enum: members compare equal to vLLM's strings, a typo fails loudly."""

    DECODER = "decoder"  # causal self-attention over the paged cache
    ENCODER = "encoder"  # bidirectional, no cache (encoder of an encoder/decoder model)
    ENCODER_ONLY = "encoder_only"  # bidirectional, no cache (BERT-like models)
    ENCODER_DECODER = "encoder_decoder"  # decoder queries over the cached encoder keys

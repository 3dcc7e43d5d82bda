"""The backend interfaces of vLLM V0 (`vllm.attention.backends.abstract`), standalone.

Class and method names, signatures and defaults follow vLLM v0.8 so code written against
vLLM's backends runs after changing the import. Differences, on purpose:
- `AttentionType` is a `str` Enum: its members compare equal to vLLM's strings ("decoder",
  "encoder", "encoder_only", "encoder_decoder") but a typo fails loudly.
- `AttentionLayer` is a small concrete class (vLLM only had a Protocol), so callers without
  vLLM's `Attention` module can pass the k/v scales.
"""

import dataclasses
from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

import torch

from torch_backends.attention_type import AttentionType


def check_attn_type(attn_type) -> "AttentionType":
    try:
        return AttentionType(attn_type)
    except ValueError:
        raise NotImplementedError(
            f"Unknown attention type {attn_type!r}: expected one of "
            f"{[t.value for t in AttentionType]}"
        ) from None


class AttentionLayer:
    """What `AttentionImpl.forward` reads from the calling layer: the fp8 cache scales.

    `_k_scale` / `_v_scale` are float32 tensors (as vLLM keeps them, so a layer can update
    them in place) and `_k_scale_float` / `_v_scale_float` their Python twins.
    """

    def __init__(self, k_scale: float = 1.0, v_scale: float = 1.0):
        self._k_scale = torch.tensor(float(k_scale), dtype=torch.float32)
        self._v_scale = torch.tensor(float(v_scale), dtype=torch.float32)
        self._k_scale_float = float(k_scale)
        self._v_scale_float = float(v_scale)


@dataclasses.dataclass
class AttentionMetadata:
    """Per-step metadata shared by every backend.

    Token order in a step: prefill tokens first, then one token per decode sequence:

        |<---- prefill_0 ---->|<- prefill_1 ->|d0|d1|d2|
        num_prefill_tokens ----------------->|<-- num_decode_tokens -->|
    """

    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    # Cache slot of each new token's key/value; -1 (PAD_SLOT_ID) writes nothing.
    # slot_mapping [35, 2, 17] with block size 16: block 2 offset 3, block 0 offset 2,
    # block 1 offset 1.
    slot_mapping: torch.Tensor
    multi_modal_placeholder_index_maps: dict | None
    enable_kv_scales_calculation: bool

    @property
    def prefill_metadata(self) -> "AttentionMetadata | None":
        raise NotImplementedError

    @property
    def decode_metadata(self) -> "AttentionMetadata | None":
        raise NotImplementedError

    def asdict_zerocopy(self, skip_fields: set[str] | None = None) -> dict[str, Any]:
        skip = skip_fields or set()
        return {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip
        }


T = TypeVar("T", bound=AttentionMetadata)


class AttentionState(ABC, Generic[T]):
    """Objects a backend keeps for the model runner's lifetime (vLLM: CUDA graph buffers)."""

    @abstractmethod
    def __init__(self, runner: Any): ...

    @abstractmethod
    @contextmanager
    def graph_capture(self, max_batch_size: int):
        yield

    @abstractmethod
    def graph_clone(self, batch_size: int) -> "AttentionState[T]": ...

    @abstractmethod
    def graph_capture_get_metadata_for_batch(
        self, batch_size: int, is_encoder_decoder_model: bool = False
    ) -> T: ...

    @abstractmethod
    def get_graph_input_buffers(
        self, attn_metadata: T, is_encoder_decoder_model: bool = False
    ) -> dict[str, Any]: ...

    @abstractmethod
    def prepare_graph_input_buffers(
        self,
        input_buffers: dict[str, Any],
        attn_metadata: T,
        is_encoder_decoder_model: bool = False,
    ) -> None: ...

    @abstractmethod
    def begin_forward(self, model_input: Any) -> None: ...


class CommonAttentionState(AttentionState):
    """The state vLLM's runners create through `get_state_cls()`. The backends here run eagerly
    (CPU, or CUDA without graphs): a step needs no state, and graph capture is refused with
    what to do instead (vLLM's CPU runner never captures; on CUDA pass `enforce_eager=True`)."""

    def __init__(self, runner: Any):
        self.runner = runner

    @contextmanager
    def graph_capture(self, max_batch_size: int):
        raise NotImplementedError(_NO_GRAPHS)
        yield  # pragma: no cover - a generator, for @contextmanager

    def graph_clone(self, batch_size: int) -> "CommonAttentionState":
        raise NotImplementedError(_NO_GRAPHS)

    def graph_capture_get_metadata_for_batch(
        self, batch_size: int, is_encoder_decoder_model: bool = False
    ):
        raise NotImplementedError(_NO_GRAPHS)

    def get_graph_input_buffers(
        self, attn_metadata, is_encoder_decoder_model: bool = False
    ) -> dict[str, Any]:
        raise NotImplementedError(_NO_GRAPHS)

    def prepare_graph_input_buffers(
        self, input_buffers: dict[str, Any], attn_metadata, is_encoder_decoder_model: bool = False
    ) -> None:
        raise NotImplementedError(_NO_GRAPHS)

    def begin_forward(self, model_input: Any) -> None:
        pass


_NO_GRAPHS = (
    "torch_backends run eagerly: CUDA graph capture is not supported (vLLM: enforce_eager=True)"
)


class AttentionMetadataBuilder(ABC, Generic[T]):
    """Builds a backend's metadata for one step."""

    @abstractmethod
    def __init__(self, input_builder: Any) -> None: ...

    @abstractmethod
    def prepare(self) -> None:
        """Reset per-step state (vLLM calls it before adding sequences)."""

    @abstractmethod
    def build(
        self,
        seq_lens: list[int],
        query_lens: list[int],
        cuda_graph_pad_size: int,
        batch_size: int,
    ) -> T: ...


class AttentionBackend(ABC):
    """A backend: names the impl, metadata and builder classes and owns the cache layout."""

    accept_output_buffer: bool = False

    @staticmethod
    @abstractmethod
    def get_name() -> str: ...

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type["AttentionImpl"]: ...

    @staticmethod
    @abstractmethod
    def get_metadata_cls() -> type[AttentionMetadata]: ...

    @staticmethod
    @abstractmethod
    def get_state_cls() -> type[AttentionState]: ...

    @classmethod
    def make_metadata(cls, *args, **kwargs) -> AttentionMetadata:
        return cls.get_metadata_cls()(*args, **kwargs)

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]: ...

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]: ...

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        raise NotImplementedError

    @staticmethod
    @abstractmethod
    def swap_blocks(
        src_kv_cache: torch.Tensor, dst_kv_cache: torch.Tensor, src_to_dst: torch.Tensor
    ) -> None: ...

    @staticmethod
    @abstractmethod
    def copy_blocks(kv_caches: list[torch.Tensor], src_to_dists: torch.Tensor) -> None: ...

    def advance_step(
        self,
        model_input: Any,
        sampled_token_ids: torch.Tensor | None,
        block_size: int,
        num_seqs: int,
        num_queries: int,
    ) -> None:
        """Multi-step scheduling (vLLM's GPU runners); none of the backends here has it."""
        raise NotImplementedError(f"{type(self).__name__} has no multi-step advance_step")


class AttentionImpl(ABC, Generic[T]):
    @abstractmethod
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        blocksparse_params: dict[str, Any] | None = None,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
    ) -> None: ...

    @abstractmethod
    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: T,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


def is_quantized_kv_cache(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype != "auto"

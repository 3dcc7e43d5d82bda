"""`HostBatch`: one step described by per-sequence Python lists, what the builders start from,
and the small host-side helpers that turn such lists into tensors.

Sequences come prefills first, then decodes; a decode is a sequence with one new token after
a cached prefix:

    |<---- prefill_0 ---->|<- prefill_1 ->|d0|d1|d2|
    |<------- num_prefill_tokens ------->|<-- num_decode_tokens -->|
"""

import dataclasses
import itertools
from abc import abstractmethod
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from torch_backends.abstract import AttentionMetadataBuilder, T
from torch_backends.shapes import BlockTables


def cumsum(lens) -> Int[Tensor, " n_plus_1"]:
    """`[0, l0, l0+l1, ...]` as int32: lens [4, 6] -> [0, 4, 10]."""
    return torch.tensor([0, *itertools.accumulate(int(n) for n in lens)], dtype=torch.int32)


def pad_tables(tables: list[list[int]]) -> BlockTables:
    """Ragged per-sequence block lists -> `[S, max_blocks]` int32, padded with 0."""
    width = max((len(t) for t in tables), default=0)
    rows = [list(t) + [0] * (width - len(t)) for t in tables]
    return torch.tensor(rows, dtype=torch.int32).reshape(len(tables), width)


def slots_of(table: list[int], positions, block_size: int) -> list[int]:
    """Cache slots of token positions through one block table.

    table [3, 7], block size 16, positions 14..17 -> [62, 63, 112, 113] (block 3 offsets
    14-15, then block 7 offsets 0-1).
    """
    return [table[p // block_size] * block_size + p % block_size for p in positions]


def _check_tables(
    name: str, tables: list[list[int]], len_name: str, lens: list[int], block_size: int
) -> None:
    """Each sequence's table covers its tokens with block ids >= 0 (the cache's size is not
    known here: the impl checks ids against it). A -1 would otherwise become a negative slot,
    a pad that writes nothing, and the sequence would read back another block."""
    for i, (n, table) in enumerate(zip(lens, tables, strict=True)):
        if n < 0:
            raise ValueError(f"{len_name}[{i}]={n} must be >= 0")
        needed = -(-n // block_size)
        if len(table) < needed:
            raise ValueError(
                f"{name}[{i}] has {len(table)} blocks of {block_size} for "
                f"{len_name}[{i}]={n} tokens (needs {needed})"
            )
        for j, block in enumerate(table[:needed]):
            if block < 0:
                raise ValueError(
                    f"{name}[{i}][{j}]={block} must be a block id >= 0 (sequence {i} uses its "
                    f"first {needed} blocks)"
                )


@dataclasses.dataclass(frozen=True)
class HostBatch:
    """One step described by per-sequence Python lists, validated; what builders start from.

    Sequences come prefills first, then decodes; a decode is a sequence with one new token
    after a cached prefix.
    """

    num_prefills: int
    seq_lens: list[int]
    query_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: list[int]
    encoder_seq_lens: list[int] | None
    cross_block_tables: list[list[int]] | None
    cross_slot_mapping: list[int] | None

    @classmethod
    def from_lists(
        cls,
        seq_lens,
        query_lens,
        block_tables,
        block_size: int,
        encoder_seq_lens=None,
        cross_block_tables=None,
    ) -> "HostBatch":
        seq_lens, query_lens = [int(s) for s in seq_lens], [int(q) for q in query_lens]
        block_tables = [list(map(int, t)) for t in block_tables]
        if len(seq_lens) != len(query_lens) or len(block_tables) != len(seq_lens):
            raise ValueError(
                f"seq_lens ({len(seq_lens)}), query_lens ({len(query_lens)}) and "
                f"block_tables ({len(block_tables)}) need one entry per sequence"
            )
        if int(block_size) < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        for i, (s, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
            if q < 0:
                raise ValueError(f"query_lens[{i}]={q} must be >= 0")
            if q > s:
                raise ValueError(f"query_lens[{i}]={q} must be <= seq_lens[{i}]={s}")
        _check_tables("block_tables", block_tables, "seq_lens", seq_lens, block_size)
        is_decode = [q == 1 and s > 1 for q, s in zip(query_lens, seq_lens, strict=True)]
        num_prefills = is_decode.index(True) if any(is_decode) else len(seq_lens)
        if not all(is_decode[num_prefills:]):
            raise ValueError(
                f"sequences must come prefills first, then decodes (query_lens={query_lens})"
            )
        slots = [
            slot
            for s, q, table in zip(seq_lens, query_lens, block_tables, strict=True)
            for slot in slots_of(table, range(s - q, s), block_size)
        ]
        cross_slots = None
        if cross_block_tables is not None:
            if encoder_seq_lens is None:
                raise ValueError("cross_block_tables needs encoder_seq_lens")
            cross_block_tables = [list(map(int, t)) for t in cross_block_tables]
            encoder_seq_lens = [int(n) for n in encoder_seq_lens]
            if len(cross_block_tables) != len(encoder_seq_lens):
                raise ValueError(
                    f"cross_block_tables ({len(cross_block_tables)}) and encoder_seq_lens "
                    f"({len(encoder_seq_lens)}) need one entry per sequence"
                )
            _check_tables(
                "cross_block_tables",
                cross_block_tables,
                "encoder_seq_lens",
                encoder_seq_lens,
                block_size,
            )
            cross_slots = [
                slot
                for n, table in zip(encoder_seq_lens, cross_block_tables, strict=True)
                for slot in slots_of(table, range(n), block_size)
            ]
        return cls(
            num_prefills=num_prefills,
            seq_lens=seq_lens,
            query_lens=query_lens,
            block_tables=block_tables,
            slot_mapping=slots,
            encoder_seq_lens=None if encoder_seq_lens is None else list(encoder_seq_lens),
            cross_block_tables=cross_block_tables,
            cross_slot_mapping=cross_slots,
        )

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.query_lens[: self.num_prefills])

    @property
    def num_decode_tokens(self) -> int:
        return len(self.seq_lens) - self.num_prefills

    def common_fields(self) -> dict:
        """The fields of `AttentionMetadata` itself, which every metadata class has."""
        return dict(
            num_prefills=self.num_prefills,
            num_prefill_tokens=self.num_prefill_tokens,
            num_decode_tokens=self.num_decode_tokens,
            slot_mapping=torch.tensor(self.slot_mapping, dtype=torch.long),
            multi_modal_placeholder_index_maps=None,
            enable_kv_scales_calculation=False,
        )

    def encoder_fields(self) -> dict:
        """The encoder / cross-attention fields every metadata class shares."""
        if self.encoder_seq_lens is None:
            return {}
        fields = dict(
            encoder_seq_lens=self.encoder_seq_lens,
            encoder_seq_lens_tensor=torch.tensor(self.encoder_seq_lens, dtype=torch.int32),
            max_encoder_seq_len=max(self.encoder_seq_lens, default=0),
            num_encoder_tokens=sum(self.encoder_seq_lens),
        )
        if self.cross_block_tables is not None:
            fields["cross_slot_mapping"] = torch.tensor(self.cross_slot_mapping, dtype=torch.long)
            fields["cross_block_tables"] = pad_tables(self.cross_block_tables)
        return fields


def runner_batch(input_builder: Any) -> HostBatch:
    """The step vLLM's CPU model runner prepared (`ModelInputForCPUBuilder.input_data`), as a
    `HostBatch`. Taken as the runner built it: decode tables and lengths already trimmed to the
    sliding window's blocks, prefill tables that may be empty (encoder-only models have none),
    the runner's own slots. `PagedImpl.forward` checks the step against the cache before use.
    """
    data = getattr(input_builder, "input_data", None)
    if data is None:
        raise TypeError(
            f"input_builder ({type(input_builder).__name__}) has no input_data: the builders "
            "read vLLM's CPU model runner (ModelInputForCPUBuilder, after prepare()); "
            "standalone, pass block_tables= and block_size= to build()"
        )
    prefill_tables = [list(t) if t is not None else [] for t in data.prefill_block_tables]
    return HostBatch(
        num_prefills=data.num_prefills,
        seq_lens=list(data.seq_lens),
        query_lens=list(data.query_lens),
        block_tables=prefill_tables + [list(t) for t in data.decode_block_tables],
        slot_mapping=list(data.slot_mapping),
        encoder_seq_lens=None,
        cross_block_tables=None,
        cross_slot_mapping=None,
    )


def placeholder_index_maps(input_builder: Any) -> dict | None:
    """vLLM's multi-modal placeholder index maps of the runner's step (None without inputs)."""
    data = getattr(input_builder, "input_data", None)
    if data is None or not getattr(data, "multi_modal_inputs_list", None):
        return None
    return {
        modality: placeholder_map.index_map()
        for modality, placeholder_map in data.multi_modal_placeholder_maps.items()
    }


class HostBatchBuilder(AttentionMetadataBuilder[T]):
    """A metadata builder with vLLM's interface (`__init__(input_builder)`, `prepare()`,
    `build(seq_lens, query_lens, cuda_graph_pad_size, batch_size)`).

    Inside vLLM's engine, `input_builder` is its CPU model runner's input builder and `build`
    reads the step's tables and slots from it, as vLLM's own builders do. Standalone, pass
    `input_builder=None` and give the block tables and block size to `build` as keywords;
    sequences then come prefills first, then decodes (a decode has one new token after a
    cached prefix).
    """

    def __init__(self, input_builder: Any) -> None:
        self.input_builder = input_builder
        self.chunked_prefill = bool(getattr(input_builder, "chunked_prefill", True))

    def prepare(self) -> None:
        """Nothing to reset: each `build` reads the runner's current step."""

    def build(
        self,
        seq_lens: list[int],
        query_lens: list[int],
        cuda_graph_pad_size: int,
        batch_size: int,
        *,
        block_tables: list[list[int]] | None = None,
        block_size: int | None = None,
        encoder_seq_lens: list[int] | None = None,
        cross_block_tables: list[list[int]] | None = None,
    ) -> T:
        if block_tables is None and self.input_builder is not None:
            batch = runner_batch(self.input_builder)
            if batch.seq_lens != list(seq_lens) or batch.query_lens != list(query_lens):
                raise ValueError(
                    f"build(seq_lens={list(seq_lens)}, query_lens={list(query_lens)}) does "
                    f"not match the runner's step (seq_lens={batch.seq_lens}, "
                    f"query_lens={batch.query_lens})"
                )
            md = self.metadata(batch)
            md.multi_modal_placeholder_index_maps = placeholder_index_maps(self.input_builder)
            return md
        if block_tables is None or block_size is None:
            raise TypeError(
                "build() without a model runner (input_builder=None) needs the keywords "
                "block_tables= and block_size="
            )
        batch = HostBatch.from_lists(
            seq_lens, query_lens, block_tables, block_size, encoder_seq_lens, cross_block_tables
        )
        return self.metadata(batch)

    @abstractmethod
    def metadata(self, batch: HostBatch) -> T:
        """This backend's metadata of a batch."""

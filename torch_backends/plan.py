"""`StepPlan`: what one `forward` computes, in one vocabulary for every backend.

vLLM V0's backends each name the same facts differently: TORCH_SDPA keeps decode-only
`block_tables` and separate `prefill_block_tables`; XFORMERS (and IPEX here) keep one
`block_tables` row per sequence, prefills first. Each metadata class turns its own fields into
one `StepPlan` (`metadata.step_plan(attn_type)`), which is all an impl's `attend` reads.

Token order in a step: prefill tokens first, then one token per decode sequence:

    |<---- prefill_0 ---->|<- prefill_1 ->|d0|d1|d2|
    |<------- num_prefill_tokens ------->|<-- num_decode_tokens -->|
"""

import dataclasses
import itertools

import torch
from jaxtyping import Int
from torch import Tensor

from torch_backends.abstract import AttentionType
from torch_backends.host_batch import cumsum
from torch_backends.shapes import BlockTables, SlotMapping


@dataclasses.dataclass(frozen=True)
class MetadataFields:
    """Which metadata field each of a plan's tensors came from, and the field's row of the
    plan's first row (an int, or "num_prefills"), so an error names what the caller wrote:
    `attn_metadata.block_tables[3, 1]=-1`, not a position in an internal tensor."""

    slot_mapping: str = "slot_mapping"
    prefill_block_tables: tuple[str, int | str] = ("block_tables", 0)
    decode_block_tables: tuple[str, int | str] = ("block_tables", "num_prefills")
    kv_lens: str = "seq_lens"
    decode_seq_lens: tuple[str, int | str] = ("seq_lens_tensor", "num_prefills")


# vLLM XFORMERS' (and IPEX's here): one row per sequence, prefills first.
PER_SEQUENCE_FIELDS = MetadataFields()
# TORCH_SDPA's: decode fields describe only the decodes, prefill fields only the prefills.
SPLIT_FIELDS = MetadataFields(
    prefill_block_tables=("prefill_block_tables", 0),
    decode_block_tables=("block_tables", 0),
    decode_seq_lens=("seq_lens_tensor", 0),
)
# Cross attention: the encoder's slots, tables and lengths.
CROSS_FIELDS = MetadataFields(
    slot_mapping="cross_slot_mapping",
    prefill_block_tables=("cross_block_tables", 0),
    decode_block_tables=("cross_block_tables", "num_prefills"),
    kv_lens="encoder_seq_lens",
    decode_seq_lens=("encoder_seq_lens_tensor", "num_prefills"),
)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One step for one attention type.

    The prefill sequences' lengths come as lists (they size Python loops and masks); the
    decode side as tensors (they go to kernels). For cross attention (`ENCODER_DECODER`) the
    "kv" side is the encoder: `kv_lens` / `decode_seq_lens` are encoder lengths and the tables
    are cross tables.
    """

    attn_type: AttentionType
    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    # Cache slot of each new K/V row (cross_slot_mapping for cross attention); None: no cache.
    slot_mapping: SlotMapping | None
    # Prefill sequences: new query tokens and total kv length (cached prefix + new).
    # q_lens [3, 5], kv_lens [3, 12]: sequence 1 has 7 cached tokens before its 5 new ones.
    q_lens: list[int]
    kv_lens: list[int]
    # Every sequence's first query token, prefills then decodes: q_lens [3, 5] and two decodes
    # -> [0, 3, 8, 9, 10]. The metadata's own tensor where it has one.
    query_start_loc: Int[Tensor, " num_seqs_plus_1"]
    # [num_prefills, max_blocks] tables the prefills read their cached K/V through, or None
    # when the step gives no tables for prefills (then they must have no cached prefix).
    prefill_block_tables: Int[Tensor, "num_prefills max_blocks"] | None
    # Decode sequences (one query each): tables, total kv lengths and their maximum.
    decode_block_tables: Int[Tensor, "num_decodes max_blocks"] | None
    decode_seq_lens: Int[Tensor, " num_decodes"] | None
    max_decode_seq_len: int
    # Where these came from in the metadata (for error messages).
    fields: MetadataFields = PER_SEQUENCE_FIELDS

    @property
    def causal(self) -> bool:
        return self.attn_type == AttentionType.DECODER

    @property
    def num_seqs(self) -> int:
        return self.num_prefills + self.num_decode_tokens

    @property
    def prefill_tokens(self) -> slice:
        return slice(0, self.num_prefill_tokens)

    @property
    def decode_tokens(self) -> slice:
        return slice(self.num_prefill_tokens, self.num_prefill_tokens + self.num_decode_tokens)

    @property
    def ctx_lens(self) -> list[int]:
        """Cached prefix length of each prefill (0 for a plain prefill)."""
        return [k - q for q, k in zip(self.q_lens, self.kv_lens, strict=True)]

    @property
    def cached_lens(self) -> list[int]:
        """Keys each prefill reads from the cache when its new K/V are given: the cached
        prefix for decoder self-attention, none for cross attention (its first step brings
        every encoder key)."""
        return self.ctx_lens if self.causal else [0] * len(self.q_lens)

    @property
    def has_cached_prefix(self) -> bool:
        """Chunked prefill: some decoder prefill reads keys cached by earlier steps."""
        return self.causal and any(self.ctx_lens)

    @property
    def prefill_query_start_loc(self) -> Int[Tensor, " num_prefills_plus_1"]:
        return self.query_start_loc[: self.num_prefills + 1]

    @property
    def max_query_len(self) -> int:
        return max(self.q_lens, default=0)

    @property
    def seq_lens(self) -> Int[Tensor, " num_seqs"]:
        """Every sequence's kv length, prefills then decodes, int32."""
        parts = [torch.tensor(self.kv_lens, dtype=torch.int32)]
        if self.num_decode_tokens:
            parts.append(self.decode_seq_lens.to(torch.int32))
        return torch.cat(parts)

    @property
    def block_tables(self) -> BlockTables | None:
        """Every sequence's table row, prefills then decodes (padded with 0 to one width), or
        None when the prefills have no tables."""
        parts = []
        if self.num_prefills:
            parts.append(self.prefill_block_tables)
        if self.num_decode_tokens:
            parts.append(self.decode_block_tables)
        if not parts or any(p is None for p in parts):
            return None
        if len(parts) == 1:
            return parts[0].to(torch.int32)
        width = max(p.shape[1] for p in parts)
        return torch.cat(
            [torch.nn.functional.pad(p.to(torch.int32), (0, width - p.shape[1])) for p in parts]
        )


class CrossAttentionMetadata:
    """Cross attention needs every encoder field (each metadata class says which in its
    `is_all_encoder_attn_metadata_set`, as vLLM's did) plus the cross slots and tables."""

    @property
    def is_all_cross_attn_metadata_set(self) -> bool:
        return (
            self.is_all_encoder_attn_metadata_set
            and self.cross_slot_mapping is not None
            and self.cross_block_tables is not None
        )


def require(value, name: str, attn_type: AttentionType) -> None:
    if value is None:
        raise ValueError(f"attn_metadata.{name} is required for {attn_type.value} attention")


def query_start_loc(given: Tensor | None, q_lens: list[int], num_decodes: int) -> Tensor:
    """The step's `query_start_loc`: the metadata's when it covers every sequence, else
    built from the prefill lengths and one token per decode."""
    if given is not None and given.shape[0] == len(q_lens) + num_decodes + 1:
        return given
    starts = [0, *itertools.accumulate([*q_lens, *[1] * num_decodes])]
    # int64 when a (bad) length overflows int32: the checks then name the length.
    fits = all(-(2**31) <= s < 2**31 for s in starts)
    return torch.tensor(starts, dtype=torch.int32 if fits else torch.int64)


def encoder_only_lens(attn_metadata) -> list[int] | None:
    """The sequence lengths of ENCODER_ONLY attention: `seq_lens`, as vLLM's runners fill
    them (every sequence a prefill), or `encoder_seq_lens` in metadata that has no decoder
    sequences (`num_prefills == 0`), as the standalone builders make an encoder batch."""
    if attn_metadata.num_prefills == 0 and attn_metadata.encoder_seq_lens is not None:
        return attn_metadata.encoder_seq_lens
    return attn_metadata.seq_lens


def encoder_plan(attn_metadata, attn_type: AttentionType, lens: list[int] | None) -> StepPlan:
    """ENCODER / ENCODER_ONLY: every token is a bidirectional prefill token, no cache.
    `lens`: the sequences' lengths (vLLM: `encoder_seq_lens` for ENCODER, `seq_lens` for
    ENCODER_ONLY)."""
    name = "encoder_seq_lens" if attn_type == AttentionType.ENCODER else "seq_lens"
    require(lens, name, attn_type)
    lens = list(lens)
    return StepPlan(
        attn_type=attn_type,
        num_prefills=len(lens),
        num_prefill_tokens=sum(lens),
        num_decode_tokens=0,
        slot_mapping=None,
        q_lens=lens,
        kv_lens=lens,
        query_start_loc=cumsum(lens),
        prefill_block_tables=None,
        decode_block_tables=None,
        decode_seq_lens=None,
        max_decode_seq_len=0,
    )


def cross_plan(attn_metadata, attn_type: AttentionType, q_lens: list[int]) -> StepPlan:
    """ENCODER_DECODER: decoder queries over the cached encoder K/V; `cross_block_tables` has
    one row per decoder sequence, prefills first. `q_lens`: the decoder prefills'."""
    require(attn_metadata.encoder_seq_lens, "encoder_seq_lens", attn_type)
    num_prefills, cross = attn_metadata.num_prefills, attn_metadata.cross_block_tables
    enc = attn_metadata.encoder_seq_lens_tensor
    if enc is None:
        enc = torch.tensor(attn_metadata.encoder_seq_lens, dtype=torch.int32)
    decode_lens = enc[num_prefills:]
    return StepPlan(
        attn_type=attn_type,
        num_prefills=num_prefills,
        num_prefill_tokens=attn_metadata.num_prefill_tokens,
        num_decode_tokens=attn_metadata.num_decode_tokens,
        slot_mapping=attn_metadata.cross_slot_mapping,
        q_lens=q_lens,
        kv_lens=list(attn_metadata.encoder_seq_lens[:num_prefills]),
        query_start_loc=query_start_loc(
            attn_metadata.query_start_loc, q_lens, attn_metadata.num_decode_tokens
        ),
        prefill_block_tables=None if cross is None else cross[:num_prefills],
        decode_block_tables=None if cross is None else cross[num_prefills:],
        decode_seq_lens=decode_lens,
        max_decode_seq_len=int(decode_lens.max()) if attn_metadata.num_decode_tokens else 0,
        fields=CROSS_FIELDS,
    )


def per_sequence_plan(attn_metadata, attn_type: AttentionType) -> StepPlan:
    """The plan of metadata whose `block_tables`, `seq_lens_tensor` and `seq_lens` have one
    entry per sequence, prefills first (vLLM's XFORMERS; IPEX here). A prefill's query length
    comes from `query_start_loc` when given, else it equals its `seq_lens` entry. In a
    decode-only step (vLLM IPEX's only decode case) the rows are the decodes.

    Prefills read a cached prefix through `block_tables[:num_prefills]` when those rows are
    there (vLLM: `prefill_meta.block_tables.numel() != 0`).
    """
    if attn_type == AttentionType.ENCODER:
        return encoder_plan(attn_metadata, attn_type, attn_metadata.encoder_seq_lens)
    if attn_type == AttentionType.ENCODER_ONLY:
        return encoder_plan(attn_metadata, attn_type, encoder_only_lens(attn_metadata))
    num_prefills, num_decodes = attn_metadata.num_prefills, attn_metadata.num_decode_tokens
    q_lens = seq_lens = []
    if attn_metadata.num_prefill_tokens or num_prefills:  # empty sequences count too
        require(attn_metadata.seq_lens, "seq_lens", attn_type)
        seq_lens = q_lens = list(attn_metadata.seq_lens[:num_prefills])
        if attn_metadata.query_start_loc is not None:
            q_lens = torch.diff(attn_metadata.query_start_loc[: num_prefills + 1]).tolist()
    if attn_type == AttentionType.ENCODER_DECODER:
        return cross_plan(attn_metadata, attn_type, q_lens)
    tables = attn_metadata.block_tables
    has_rows = tables is not None and tables.numel() > 0
    if has_rows and tables.shape[0] != num_prefills + num_decodes:
        raise ValueError(
            f"attn_metadata.block_tables has {tables.shape[0]} rows, expected one per sequence "
            f"({num_prefills} prefills + {num_decodes} decodes), prefills first"
        )
    decode_tables = decode_lens = None
    if num_decodes:
        require(tables, "block_tables", attn_type)
        require(attn_metadata.seq_lens_tensor, "seq_lens_tensor", attn_type)
        decode_tables = tables[num_prefills:]
        decode_lens = attn_metadata.seq_lens_tensor[num_prefills:]
    return StepPlan(
        attn_type=attn_type,
        num_prefills=num_prefills,
        num_prefill_tokens=attn_metadata.num_prefill_tokens,
        num_decode_tokens=num_decodes,
        slot_mapping=attn_metadata.slot_mapping,
        q_lens=q_lens,
        kv_lens=seq_lens,
        query_start_loc=query_start_loc(attn_metadata.query_start_loc, q_lens, num_decodes),
        prefill_block_tables=tables[:num_prefills] if has_rows and num_prefills else None,
        decode_block_tables=decode_tables,
        decode_seq_lens=decode_lens,
        max_decode_seq_len=attn_metadata.max_decode_seq_len,
    )

"""Host-side batch bookkeeping shared by the torch backends' metadata and builders.

vLLM V0's backends each name the same facts differently: TORCH_SDPA keeps decode-only
`block_tables` and separate `prefill_block_tables`; XFORMERS (and IPEX) keep one
`block_tables` row per sequence, prefills first. Each metadata class turns its own fields into
one `StepPlan`, which is all `PagedImpl.forward` reads.

Token order in a step: prefill tokens first, then one token per decode sequence:

    |<---- prefill_0 ---->|<- prefill_1 ->|d0|d1|d2|
    |<------- num_prefill_tokens ------->|<-- num_decode_tokens -->|
"""

import dataclasses
import itertools

import torch

from torch_backends.abstract import AttentionType


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one `forward` computes, in one vocabulary for every backend.

    The prefill sequences' lengths come as lists (they size Python loops and masks); the
    decode side as tensors (they go to kernels). For cross attention (`ENCODER_DECODER`) the
    "kv" side is the encoder: `kv_lens` are encoder lengths and the tables are cross tables.
    """

    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    # Cache slot of each new K/V row (cross_slot_mapping for cross attention).
    slot_mapping: torch.Tensor | None
    # Prefill sequences: new query tokens and total kv length (cached prefix + new).
    # q_lens [3, 5], kv_lens [3, 12]: sequence 1 has 7 cached tokens before its 5 new ones.
    q_lens: list[int]
    kv_lens: list[int]
    # [num_prefills, max_blocks] tables the prefills read their cached K/V through, or None
    # when the step gives no tables for prefills (then they must have no cached prefix).
    prefill_block_tables: torch.Tensor | None
    # Decode sequences (one query each): tables, total kv lengths and their maximum.
    decode_block_tables: torch.Tensor | None
    decode_seq_lens: torch.Tensor | None
    max_decode_seq_len: int

    @property
    def ctx_lens(self) -> list[int]:
        """Cached prefix length of each prefill (0 for a plain prefill)."""
        return [k - q for q, k in zip(self.q_lens, self.kv_lens, strict=True)]

    @property
    def prefill_query_start_loc(self) -> torch.Tensor:
        return cumsum(self.q_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.q_lens, default=0)


def cumsum(lens) -> torch.Tensor:
    """`[0, l0, l0+l1, ...]` as int32: lens [4, 6] -> [0, 4, 10]."""
    return torch.tensor([0, *itertools.accumulate(int(n) for n in lens)], dtype=torch.int32)


def pad_tables(tables: list[list[int]]) -> torch.Tensor:
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
        for i, (s, q, table) in enumerate(zip(seq_lens, query_lens, block_tables, strict=True)):
            if q > s:
                raise ValueError(f"query_lens[{i}]={q} must be <= seq_lens[{i}]={s}")
            if len(table) * block_size < s:
                raise ValueError(
                    f"block_tables[{i}] has {len(table)} blocks of {block_size} for "
                    f"seq_lens[{i}]={s} tokens"
                )
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
            cross_slots = [
                slot
                for n, table in zip(encoder_seq_lens, cross_block_tables, strict=True)
                for slot in slots_of(table, range(n), block_size)
            ]
            cross_block_tables = [list(map(int, t)) for t in cross_block_tables]
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


def require(value, name: str, attn_type) -> None:
    if value is None:
        raise ValueError(f"attn_metadata.{name} is required for {attn_type.value} attention")


def encoder_plan(md, attn_type) -> StepPlan:
    """ENCODER / ENCODER_ONLY: every token is a bidirectional prefill token, no cache."""
    require(md.encoder_seq_lens, "encoder_seq_lens", attn_type)
    lens = list(md.encoder_seq_lens)
    return StepPlan(
        num_prefills=len(lens),
        num_prefill_tokens=sum(lens),
        num_decode_tokens=0,
        slot_mapping=None,
        q_lens=lens,
        kv_lens=lens,
        prefill_block_tables=None,
        decode_block_tables=None,
        decode_seq_lens=None,
        max_decode_seq_len=0,
    )


def all_seqs_plan(md, attn_type, q_lens: list[int], seq_lens: list[int]) -> StepPlan:
    """The plan of metadata whose `block_tables` / `seq_lens_tensor` have one row per
    sequence, prefills first (vLLM's XFORMERS; IPEX here). `q_lens`, `seq_lens`: the
    prefills'. In a decode-only step (vLLM IPEX's only decode case) the rows are the decodes.

    Prefills read a cached prefix through `block_tables[:num_prefills]` when those rows are
    there (vLLM: `prefill_meta.block_tables.numel() != 0`).
    """
    num_prefills, num_seqs = md.num_prefills, md.num_prefills + md.num_decode_tokens
    tables = md.block_tables
    has_rows = tables is not None and tables.numel() > 0
    if has_rows and tables.shape[0] != num_seqs and attn_type != AttentionType.ENCODER_DECODER:
        raise ValueError(
            f"attn_metadata.block_tables has {tables.shape[0]} rows, expected one per sequence "
            f"({num_prefills} prefills + {md.num_decode_tokens} decodes), prefills first"
        )
    prefill_tables = tables[:num_prefills] if has_rows and num_prefills else None
    if attn_type == AttentionType.ENCODER_DECODER:
        require(md.encoder_seq_lens, "encoder_seq_lens", attn_type)
        cross = md.cross_block_tables
        enc = md.encoder_seq_lens_tensor
        if enc is None:
            enc = torch.tensor(md.encoder_seq_lens, dtype=torch.int32)
        return StepPlan(
            num_prefills=num_prefills,
            num_prefill_tokens=md.num_prefill_tokens,
            num_decode_tokens=md.num_decode_tokens,
            slot_mapping=md.cross_slot_mapping,
            q_lens=q_lens,
            kv_lens=list(md.encoder_seq_lens[:num_prefills]),
            prefill_block_tables=None if cross is None else cross[:num_prefills],
            decode_block_tables=None if cross is None else cross[num_prefills:],
            decode_seq_lens=enc[num_prefills:],
            max_decode_seq_len=int(enc[num_prefills:].max()) if md.num_decode_tokens else 0,
        )
    decode_tables = decode_lens = None
    if md.num_decode_tokens:
        require(tables, "block_tables", attn_type)
        require(md.seq_lens_tensor, "seq_lens_tensor", attn_type)
        decode_tables = tables[num_prefills:]
        decode_lens = md.seq_lens_tensor[num_prefills:]
    return StepPlan(
        num_prefills=num_prefills,
        num_prefill_tokens=md.num_prefill_tokens,
        num_decode_tokens=md.num_decode_tokens,
        slot_mapping=md.slot_mapping,
        q_lens=q_lens,
        kv_lens=seq_lens,
        prefill_block_tables=prefill_tables,
        decode_block_tables=decode_tables,
        decode_seq_lens=decode_lens,
        max_decode_seq_len=md.max_decode_seq_len,
    )

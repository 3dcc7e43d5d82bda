"""`RaggedMetadata`: where each sequence's queries and keys live in a mixed batch.

Token order in a batch (any mix; the core does not require prefills first):

    |<---- seq 0: prefill ---->|<- seq 1: chunk ->|s2|s3|<- padding ->|
    query_start_loc = [0,       7,                 11, 12, 13]  (num_seqs = 4)

A sequence with `q_len` new tokens and `seq_len` keys in total (cached prefix + new tokens)
places its query `i` at position `seq_len - q_len + i`: decode (q_len 1), prefill
(q_len == seq_len) and chunked prefill (q_len < seq_len) are the same rule.
"""

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedMetadata:
    """Metadata of a ragged batch; a pytree whose leaves are the arrays below.

    Attributes:
      query_start_loc: i32[S+1], cumulative query lengths from 0. Rows past `num_seqs` repeat
        the last real value (they hold no tokens).
      seq_lens: i32[S], total kv length of each sequence (0 for padding rows).
      block_tables: i32[S, max_blocks], each row the sequence's physical blocks in order;
        unused entries are 0.
      slot_mapping: i32[T], the cache slot of each new token's key/value (-1 for padding).
      num_seqs: i32[], how many leading rows are real. Padding rows and tokens keep shapes
        fixed across steps, so a jitted step does not recompile when the batch changes.
    """

    query_start_loc: Int[Array, " num_seqs_plus_1"]
    seq_lens: Int[Array, " num_seqs"]
    block_tables: Int[Array, "num_seqs max_blocks"]
    slot_mapping: Int[Array, " num_tokens"]
    num_seqs: Int[Array, ""]

    @property
    def query_lens(self) -> Int[Array, " num_seqs"]:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    @property
    def context_lens(self) -> Int[Array, " num_seqs"]:
        """Keys already cached before this step: `seq_len - q_len`."""
        return self.seq_lens - self.query_lens

    @property
    def positions(self) -> Int[Array, " num_tokens"]:
        """Each new token's position in its sequence (`context_len + i`; 0 for padding
        tokens), e.g. for rotary embeddings. Computed on device, so it works under `jit`.

        query_start_loc [0, 3, 4], seq_lens [3, 18] -> positions [0, 1, 2, 17].
        """
        token = jnp.arange(self.slot_mapping.shape[0], dtype=jnp.int32)
        seq, real = sequence_of(self.query_start_loc, token, num_seqs=self.num_seqs)
        pos = self.context_lens[seq] + token - self.query_start_loc[seq]
        return jnp.where(real, pos, 0).astype(jnp.int32)

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int] | np.ndarray,
        context_lens: Sequence[int] | np.ndarray,
        block_tables: Sequence[Sequence[int]] | np.ndarray,
        block_size: int,
        *,
        pad_to: int | tuple[int, int] | None = None,
        max_blocks: int | None = None,
    ) -> "RaggedMetadata":
        """Build the metadata on the host from Python or NumPy values.

        Args:
          query_lens: new tokens per sequence.
          context_lens: tokens already in the cache per sequence (0 for a fresh prefill).
          block_tables: a 2-D array or a list of per-sequence block lists (padded with 0).
          block_size: tokens per cache block; used to compute `slot_mapping` for the new tokens.
          pad_to: pad the batch to fixed sizes: an int pads the number of sequences;
            a pair `(num_seqs, num_tokens)` pads both. Padding sequences have no tokens and
            length 0; padding tokens have slot -1.
          max_blocks: pad the block tables to this many columns (with 0), so a serving loop
            whose sequences grow keeps one `block_tables` shape, and one compiled step.

        Example: query_lens [3, 1], context_lens [0, 17], block size 16, block tables
        [[4], [7, 2]] -> seq_lens [3, 18], query_start_loc [0, 3, 4],
        slot_mapping [64, 65, 66, 33] (seq 1's new token is position 17: block 2, offset 1).
        """
        q_lens = np.asarray(query_lens, dtype=np.int64).reshape(-1)
        ctx_lens = np.asarray(context_lens, dtype=np.int64).reshape(-1)
        if q_lens.shape != ctx_lens.shape:
            raise ValueError(
                f"query_lens ({q_lens.size} sequences) and context_lens ({ctx_lens.size}) "
                "must have one entry per sequence"
            )
        if np.any(q_lens < 0) or np.any(ctx_lens < 0):
            raise ValueError(
                f"query_lens={q_lens.tolist()} and context_lens={ctx_lens.tolist()} must be >= 0"
            )
        if not isinstance(block_size, int | np.integer) or block_size <= 0:
            raise ValueError(f"block_size={block_size!r} must be a positive int")
        num_seqs = q_lens.size
        tables = _pad_block_tables(block_tables, num_seqs)
        if max_blocks is not None:
            if tables.shape[1] > max_blocks:
                raise ValueError(
                    f"max_blocks={max_blocks} is smaller than the block tables' width "
                    f"{tables.shape[1]}"
                )
            tables = np.pad(tables, ((0, 0), (0, max_blocks - tables.shape[1])))
        seq_lens = q_lens + ctx_lens
        needed = -(-seq_lens // block_size)
        short = np.nonzero(needed > tables.shape[1])[0]
        if short.size:
            i = int(short[0])
            raise ValueError(
                f"block_tables row {i} has {tables.shape[1]} entries but seq_lens[{i}]="
                f"{seq_lens[i]} needs {needed[i]} blocks of {block_size}"
            )
        query_start_loc = np.concatenate([[0], np.cumsum(q_lens)])
        num_tokens = int(query_start_loc[-1])

        # slot of every new token: its position p -> table[p // BS] * BS + p % BS
        seq_of_token = np.repeat(np.arange(num_seqs), q_lens)  # [T]
        pos = ctx_lens[seq_of_token] + (np.arange(num_tokens) - query_start_loc[seq_of_token])
        slots = tables[seq_of_token, pos // block_size] * block_size + pos % block_size

        padded_seqs, padded_tokens = _pad_sizes(pad_to, num_seqs, num_tokens)
        pad_s = padded_seqs - num_seqs
        return cls(
            query_start_loc=_i32(np.pad(query_start_loc, (0, pad_s), mode="edge")),
            seq_lens=_i32(np.pad(seq_lens, (0, pad_s))),
            block_tables=_i32(np.pad(tables, ((0, pad_s), (0, 0)))),
            slot_mapping=_i32(np.pad(slots, (0, padded_tokens - num_tokens), constant_values=-1)),
            num_seqs=jnp.asarray(num_seqs, jnp.int32),
        )


def sequence_of(
    starts: Int[Array, " num_seqs_plus_1"],
    index: Int[Array, " n"],
    *,
    num_seqs: Int[Array, ""] | None = None,
) -> tuple[Int[Array, " n"], Bool[Array, " n"]]:
    """Which sequence owns each index, where sequence `i` owns `[starts[i], starts[i+1])`.

    With `query_start_loc` it maps tokens to their sequence; with cumulative tile counts it maps
    tiles. Only the first `num_seqs` sequences are real (default: all of them): the rows past
    it may hold anything, and indices at or past `starts[num_seqs]` belong to none. Returns the
    sequence, clipped into `[0, S)` so it can always index, and whether the index is owned.

    starts [0, 3, 3, 5], index [0, 1, 2, 3, 4, 5] -> sequence [0, 0, 0, 2, 2, 2],
    owned [T, T, T, T, T, F] (sequence 1 is empty).
    """
    max_seqs = starts.shape[0] - 1
    starts = starts.astype(jnp.int32)
    if num_seqs is None:
        end = starts[max_seqs]
    else:
        # Padding rows start at "infinity", so no index lands in them whatever they hold.
        real = jnp.arange(max_seqs + 1) <= num_seqs
        starts = jnp.where(real, starts, jnp.iinfo(jnp.int32).max)
        end = starts[jnp.clip(num_seqs, 0, max_seqs)]
    seq = jnp.searchsorted(starts, index, side="right").astype(jnp.int32) - 1
    return jnp.clip(seq, 0, max_seqs - 1), index < end


def _i32(x: np.ndarray) -> Array:
    if x.size and (x.max() > np.iinfo(np.int32).max or x.min() < np.iinfo(np.int32).min):
        raise OverflowError(f"metadata value {x.max()} does not fit int32")
    return jnp.asarray(x.astype(np.int32))


def _pad_block_tables(block_tables, num_seqs: int) -> np.ndarray:
    if isinstance(block_tables, np.ndarray | jax.Array):
        tables = np.asarray(block_tables)
        if tables.ndim != 2:
            raise ValueError(f"block_tables must be 2-D, got shape {tables.shape}")
    else:
        rows = [np.asarray(row, dtype=np.int64).reshape(-1) for row in block_tables]
        width = max((r.size for r in rows), default=0)
        tables = np.zeros((len(rows), max(width, 1)), dtype=np.int64)
        for i, row in enumerate(rows):
            tables[i, : row.size] = row
    if tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {tables.shape[0]} rows for {num_seqs} sequences")
    if tables.size and tables.min() < 0:
        raise ValueError(f"block_tables entries must be >= 0, got {tables.min()}")
    return tables.astype(np.int64)


def _pad_sizes(pad_to, num_seqs: int, num_tokens: int) -> tuple[int, int]:
    if pad_to is None:
        return num_seqs, num_tokens
    seqs, tokens = (pad_to, num_tokens) if isinstance(pad_to, int) else pad_to
    if seqs < num_seqs or tokens < num_tokens:
        raise ValueError(
            f"pad_to={pad_to} is smaller than the batch ({num_seqs} sequences, {num_tokens} tokens)"
        )
    return seqs, tokens

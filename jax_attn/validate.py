"""Eager value checks of the metadata against the cache.

Shape and dtype problems raise when a function is traced; the values inside the metadata can
only be checked eagerly, on concrete arrays, before a step is launched. A bad block id would
otherwise be clamped silently by JAX's gather and read another sequence's keys.
"""

import numpy as np

from jax_attn.checks import check_metadata_type, check_same_shape
from jax_attn.metadata import RaggedMetadata


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def validate(query, key_cache, value_cache, metadata: RaggedMetadata) -> None:
    """Raise `ValueError` naming the argument, the rule and the offending value.

    Checks: `num_seqs` within the padded rows; `query_start_loc` starts at 0, never decreases
    and stays within the query tokens; `seq_lens >= q_len` for every real sequence; each real
    sequence's block table covers its length with ids in `[0, num_blocks)`; every slot in
    `slot_mapping` is a pad (< 0) or inside the cache.
    """
    check_metadata_type(metadata)
    check_same_shape(value_cache, key_cache)
    num_tokens = np.shape(query)[0]
    num_blocks, block_size = np.shape(key_cache)[:2]
    qsl = np.asarray(metadata.query_start_loc, dtype=np.int64)
    seq_lens = np.asarray(metadata.seq_lens, dtype=np.int64)
    tables = np.asarray(metadata.block_tables, dtype=np.int64)
    slots = np.asarray(metadata.slot_mapping, dtype=np.int64)
    num_seqs = int(metadata.num_seqs)

    if not 0 <= num_seqs <= seq_lens.shape[0]:
        raise ValueError(f"metadata.num_seqs={num_seqs} must be in [0, {seq_lens.shape[0]}]")
    qsl = qsl[: num_seqs + 1]
    if qsl[0] != 0:
        raise ValueError(f"metadata.query_start_loc must start at 0, got {qsl[0]}")
    steps = np.diff(qsl)
    if np.any(steps < 0):
        i = _first(steps < 0)
        raise ValueError(
            "metadata.query_start_loc must be non-decreasing (monotone), but "
            f"query_start_loc[{i + 1}]={qsl[i + 1]} < query_start_loc[{i}]={qsl[i]}"
        )
    if qsl[-1] > num_tokens:
        raise ValueError(
            f"metadata.query_start_loc[num_seqs]={qsl[-1]} exceeds the {num_tokens} query tokens"
        )
    seq_lens = seq_lens[:num_seqs]
    if np.any(seq_lens < steps):
        i = _first(seq_lens < steps)
        raise ValueError(
            f"q_len <= seq_len must hold, but sequence {i} has q_len={steps[i]} > "
            f"seq_lens[{i}]={seq_lens[i]}"
        )
    needed = -(-seq_lens // block_size)
    if np.any(needed > tables.shape[1]):
        i = _first(needed > tables.shape[1])
        raise ValueError(
            f"metadata.seq_lens[{i}]={seq_lens[i]} needs {needed[i]} blocks of {block_size} "
            f"but block_tables has {tables.shape[1]} columns"
        )
    used = np.arange(tables.shape[1])[None, :] < needed[:, None]  # [S, max_blocks]
    bad = used & ((tables[:num_seqs] < 0) | (tables[:num_seqs] >= num_blocks))
    if np.any(bad):
        i, j = np.argwhere(bad)[0]
        raise ValueError(
            f"metadata.block_tables[{i}, {j}]={tables[i, j]} is out of range: block ids must be "
            f"in [0, num_blocks={num_blocks})"
        )
    if np.any(slots >= num_blocks * block_size):
        t = _first(slots >= num_blocks * block_size)
        raise ValueError(
            f"metadata.slot_mapping[{t}]={slots[t]} is out of range: slots must be < "
            f"num_blocks * block_size = {num_blocks * block_size} (or < 0 for padding)"
        )

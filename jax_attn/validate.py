"""Eager value checks of the metadata against the cache.

Shape and dtype problems raise when a function is traced; the values inside the metadata can
only be checked on concrete arrays. A bad block id would otherwise be clamped silently by JAX's
gather and read another sequence's keys. The rules live in `value_rules.py` (one table, shared
with the checks every entry runs by default and with `checked`'s checkify path).
"""

import numpy as np

from jax_attn import value_rules
from jax_attn.metadata import RaggedMetadata
from jax_attn.shape_rules import check_metadata_type, check_same_shape


def metadata_values(metadata: RaggedMetadata) -> dict:
    """The metadata's arrays, by the names `value_rules.ragged_rules` takes."""
    return dict(
        query_start_loc=metadata.query_start_loc,
        seq_lens=metadata.seq_lens,
        block_tables=metadata.block_tables,
        slot_mapping=metadata.slot_mapping,
        num_seqs=metadata.num_seqs,
    )


def validate(query, key_cache, value_cache, metadata: RaggedMetadata) -> None:
    """Raise `ValueError` naming the argument, the rule and the offending value.

    Checks: `num_seqs` within the padded rows; `query_start_loc` starts at 0, never decreases
    and stays within the query tokens; `seq_lens >= q_len` for every real sequence; each real
    sequence's block table covers its length with ids in `[0, num_blocks)`; every slot in
    `slot_mapping` is -1 (padding) or inside the cache, and no slot appears twice.

    `paged_attention` runs these checks itself whenever its arguments are concrete (see
    `jax_attn.value_rules`); calling `validate` is for code that wants them earlier.
    """
    check_metadata_type(metadata)
    check_same_shape(value_cache, key_cache)
    num_blocks, block_size = np.shape(key_cache)[:2]
    values = {k: np.asarray(v, np.int64) for k, v in metadata_values(metadata).items()}
    value_rules.enforce(
        value_rules.ragged_rules(
            np,
            **values,
            num_tokens=int(np.shape(query)[0]),
            num_blocks=int(num_blocks),
            block_size=int(block_size),
        )
    )

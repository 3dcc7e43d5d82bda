"""How the Pallas kernels tile the keys, in interpret mode and as pure functions:

- the tile budget holds for every page size: a page larger than one loop step is walked in
  parts (`load_kv`'s sub-page path), checked against the float64 oracle;
- float32 dots reduce over at most 32 values (head chunks), same oracle;
- a block table too short for `seq_len` (validation off: the kernels never validate) bounds the
  loop: keys past the table's end are skipped, never read from another row or past the table.

The native side of the same rules (shared memory, spills, registers for an H100 and an A100)
is `test_gpu_compile.py`.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from test_pallas_decode import Case as DecodeCase
from test_pallas_decode import case_decode_oracle, decode_oracle, make_decode_batch
from test_pallas_ragged import Case as RaggedCase
from test_pallas_ragged import case_ragged_oracle, make_ragged_batch
from tolerances import assert_close

from jax_attn.pallas import _online_softmax as softmax
from jax_attn.pallas import (
    paged_decode,
    paged_decode_reference,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from jax_attn.pallas.paged_decode import _split_block_range
from jax_attn.pallas.ragged_paged_attention import _key_block_range
from jax_attn.shape_rules import MIN_DOT

pytestmark = pytest.mark.pallas


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("head_size", [16, 64, 128, 256, 512])
@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 64, 128, 256])
def test_tile_budget_holds_for_every_page_size(block_size, head_size, dtype):
    """A loop step's K (or V) tile stays within MAX_KV_TILE_BYTES whatever the page size (only
    Triton's 16-key minimum may exceed it), and a step is whole pages or a part of one."""
    block_k = softmax.default_block_k(block_size, 64, head_size, dtype, target=128)
    tile_bytes = block_k * head_size * jnp.dtype(dtype).itemsize
    assert tile_bytes <= softmax.MAX_KV_TILE_BYTES or block_k == MIN_DOT, (block_k, tile_bytes)
    assert block_k % block_size == 0 or block_size % block_k == 0
    assert block_k >= MIN_DOT
    if dtype == "float32":
        assert block_k <= softmax.FLOAT32_DOT_REDUCTION
        assert softmax.head_chunk(head_size, dtype) <= softmax.FLOAT32_DOT_REDUCTION
    else:
        assert softmax.head_chunk(head_size, dtype) == head_size


@pytest.mark.parametrize("block_size", [3, 12, 24, 80, 100])
def test_odd_block_sizes_step_in_whole_pages(block_size):
    """Interpret mode takes any block size: a step is then whole pages, never a part."""
    for dtype in ("float32", "bfloat16"):
        block_k = softmax.default_block_k(block_size, 7, 64, dtype, target=128)
        assert block_k % block_size == 0 and block_k >= MIN_DOT, (block_size, dtype, block_k)


# Pages larger than a loop step (float32: 32 keys; bf16 D=256: 64 keys), float32 heads in
# several 32-column chunks.
DECODE_CASES = [
    DecodeCase(block_size=128, head_size=128, seq_lens=(1, 130, 300, 0)),
    DecodeCase(block_size=128, head_size=256, dtype="bfloat16", seq_lens=(5, 129), alibi=True),
    DecodeCase(block_size=64, sliding_window=40, seq_lens=(200, 63), soft_cap=4.0),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_decode_sub_page_steps(case, rng):
    query, kc, vc, tables, seq_lens, keys, values, slopes = make_decode_batch(case, rng)
    block_k = softmax.default_block_k(
        case.block_size, tables.shape[1], case.head_size, case.dtype, target=128
    )
    assert block_k < case.block_size  # the case exercises the sub-page path
    scale = case.head_size**-0.5
    kwargs = dict(
        scale=scale,
        alibi_slopes=None if slopes is None else jnp.asarray(slopes),
        sliding_window=case.sliding_window,
        logits_soft_cap=case.soft_cap,
    )
    args = [jnp.asarray(x) for x in (query, kc, vc, tables, seq_lens)]
    out = paged_decode(*args, **kwargs, interpret=True)
    expected = case_decode_oracle(case, query, keys, values, seq_lens, slopes)
    assert_close(out, expected, case.dtype, what=f"paged_decode {case}")


RAGGED_CASES = [
    RaggedCase(batch="chunked", block_size=128, head_size=128),
    RaggedCase(batch="mixed", block_size=64, sliding_window=20, alibi=True),
    RaggedCase(batch="chunked", block_size=128, head_size=256, dtype="bfloat16", soft_cap=5.0),
]


@pytest.mark.parametrize("case", RAGGED_CASES, ids=str)
def test_ragged_sub_page_steps(case, rng):
    query, kc, vc, meta, keys, values, q_lens, slopes = make_ragged_batch(case, rng)
    block_k = softmax.default_block_k(
        case.block_size, meta[2].shape[1], case.head_size, case.dtype, target=64
    )
    assert block_k < case.block_size  # the case exercises the sub-page path
    scale = case.head_size**-0.5
    kwargs = dict(
        scale=scale,
        causal=case.causal,
        alibi_slopes=None if slopes is None else jnp.asarray(slopes),
        sliding_window=case.sliding_window,
        logits_soft_cap=case.soft_cap,
    )
    args = [jnp.asarray(x) for x in (query, kc, vc, *meta)]
    out = ragged_paged_attention(*args, **kwargs, interpret=True)
    expected = case_ragged_oracle(case, query, keys, values, q_lens, slopes)
    assert_close(out, expected, case.dtype, what=f"ragged_paged_attention {case}")


# A table of 3 pages of 16 keys (48 keys) for sequences of up to 300 keys.
SHORT_TABLE = 3


@pytest.mark.parametrize("pages_per_compute_block", [None, 2])
def test_decode_short_table_is_bounded(pages_per_compute_block, rng):
    """seq_len past the table's end: the kernel attends to the keys the table holds and no
    others (without ALiBi or a window the query position does not matter, so the float64
    oracle over those keys is exact). Interpret mode clamps an out-of-range table read, so an
    unbounded loop would re-read the last pages as extra keys and fail here."""
    case = DecodeCase(seq_lens=(300, 47, 49, 100), block_size=16)
    query, kc, vc, tables, seq_lens, keys, values, _ = make_decode_batch(case, rng)
    short = np.ascontiguousarray(tables[:, :SHORT_TABLE])
    table_keys = SHORT_TABLE * case.block_size
    args = [jnp.asarray(x) for x in (query, kc, vc, short, seq_lens)]
    out = paged_decode(
        *args, scale=0.125, pages_per_compute_block=pages_per_compute_block, interpret=True
    )
    visible = [k[:table_keys] for k in keys]
    expected = decode_oracle(
        query,
        visible,
        [v[:table_keys] for v in values],
        [k.shape[0] for k in visible],
        scale=0.125,
        slopes=None,
        window=None,
        cap=None,
    )
    assert_close(out, expected, case.dtype, what="paged_decode with a short table")
    assert_close(paged_decode_reference(*args, scale=0.125), expected, case.dtype)


@pytest.mark.parametrize("pages_per_compute_block", [None, 1])
def test_ragged_short_table_is_bounded(pages_per_compute_block, rng):
    """As for decode, with ALiBi and chunked prefill: the kernel equals the jnp reference,
    which gathers only the table's pages (keys past its end do not exist for it)."""
    case = RaggedCase(batch="chunked", alibi=True, block_size=16)
    query, kc, vc, meta, *_, slopes = make_ragged_batch(case, rng)
    qsl, lens, tables, num_seqs = meta
    short = np.ascontiguousarray(tables[:, :SHORT_TABLE])
    assert int(lens[: int(num_seqs)].max()) > SHORT_TABLE * case.block_size
    args = [jnp.asarray(x) for x in (query, kc, vc, qsl, lens, short, num_seqs)]
    kwargs = dict(scale=0.125, alibi_slopes=jnp.asarray(slopes))
    out = ragged_paged_attention(
        *args, **kwargs, pages_per_compute_block=pages_per_compute_block, interpret=True
    )
    expected = ragged_paged_attention_reference(*args, **kwargs)
    assert_close(out, expected, case.dtype, what="ragged_paged_attention with a short table")


def test_loop_ranges_stop_at_the_table():
    """The loop ranges never pass the keys the table holds (`kv_len`), whatever seq_len."""
    block_k = 16
    for seq_len in (1, 40, 300):
        for kv_len in (0, 16, 48, seq_len):
            kv_len = min(kv_len, seq_len)
            for window in (None, 5, 100):
                his = [
                    _split_block_range(
                        seq_len,
                        split,
                        block_k=block_k,
                        num_kv_splits=3,
                        sliding_window=window,
                        kv_len=kv_len,
                    )[1]
                    for split in range(3)
                ]
                _, hi = _key_block_range(
                    seq_len - 4,
                    4,
                    seq_len,
                    block_k=block_k,
                    causal=False,
                    sliding_window=window,
                    kv_len=kv_len,
                )
                limit = -(-kv_len // block_k)
                assert max(int(h) for h in [*his, hi]) <= limit, (seq_len, kv_len, window)

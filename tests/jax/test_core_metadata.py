"""RaggedMetadata.build, alibi_slopes, AttentionBias, and the eager `validate` errors."""

import dataclasses
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_attn


def test_build_worked_example():
    md = jax_attn.RaggedMetadata.build([3, 1], [0, 17], [[4], [7, 2]], 16)
    np.testing.assert_array_equal(md.seq_lens, [3, 18])
    np.testing.assert_array_equal(md.query_start_loc, [0, 3, 4])
    np.testing.assert_array_equal(md.slot_mapping, [64, 65, 66, 33])
    np.testing.assert_array_equal(md.block_tables, [[4, 0], [7, 2]])
    assert int(md.num_seqs) == 2 and md.slot_mapping.dtype == jnp.int32


def test_build_padding_and_pytree():
    md = jax_attn.RaggedMetadata.build([2, 1], [0, 5], np.array([[3, 0], [1, 2]]), 4, pad_to=(4, 6))
    np.testing.assert_array_equal(md.query_start_loc, [0, 2, 3, 3, 3])
    np.testing.assert_array_equal(md.seq_lens, [2, 6, 0, 0])
    np.testing.assert_array_equal(md.slot_mapping, [12, 13, 9, -1, -1, -1])
    leaves, treedef = jax.tree_util.tree_flatten(md)
    assert len(leaves) == 5
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    np.testing.assert_array_equal(rebuilt.block_tables, md.block_tables)
    with pytest.raises(dataclasses.FrozenInstanceError):
        md.num_seqs = 3
    moved = jax.jit(lambda m: m)(md)
    np.testing.assert_array_equal(moved.slot_mapping, md.slot_mapping)


@pytest.mark.parametrize(
    "args, match",
    [
        (([1, 2], [0], [[0], [1]], 4), "one entry per sequence"),
        (([1], [-1], [[0]], 4), "must be >= 0"),
        (([5], [0], [[0]], 4), r"block_tables row 0 has 1 entries but seq_lens\[0\]=5 needs 2"),
        (([1], [0], [[0]], 0), "block_size=0 must be a positive int"),
        (([1], [0], [[-3]], 4), "block_tables entries must be >= 0"),
    ],
)
def test_build_errors(args, match):
    with pytest.raises(ValueError, match=match):
        jax_attn.RaggedMetadata.build(*args)


def test_build_pad_too_small():
    with pytest.raises(ValueError, match=r"pad_to=\(1, 9\) is smaller than the batch"):
        jax_attn.RaggedMetadata.build([1, 1], [0, 0], [[0], [1]], 4, pad_to=(1, 9))


def test_positions(rng):
    """Per-token positions, checked against the build's own slot arithmetic, under jit."""
    q_lens = rng.integers(0, 6, size=5)
    ctx_lens = rng.integers(0, 40, size=5)
    tables = [list(range(10 * i, 10 * i + 10)) for i in range(5)]
    md = jax_attn.RaggedMetadata.build(
        q_lens, ctx_lens, tables, 8, pad_to=(7, int(q_lens.sum()) + 3)
    )
    expected = [c + i for q, c in zip(q_lens, ctx_lens, strict=True) for i in range(q)] + [0] * 3
    np.testing.assert_array_equal(jax.jit(lambda m: m.positions)(md), expected)
    # The slot of each real token is block_tables[seq][pos // 8] * 8 + pos % 8.
    real = np.asarray(md.slot_mapping) >= 0
    pos = np.asarray(md.positions)[real]
    np.testing.assert_array_equal(np.asarray(md.slot_mapping)[real] % 8, pos % 8)


def test_build_max_blocks_fixes_the_table_width():
    """Sequences grow step by step; with max_blocks the table keeps one shape."""
    shapes = set()
    for ctx in (0, 5, 13):
        md = jax_attn.RaggedMetadata.build([3], [ctx], [list(range(-(-(ctx + 3) // 4)))], 4,
                                           max_blocks=6)  # fmt: skip
        shapes.add(md.block_tables.shape)
        np.testing.assert_array_equal(md.block_tables[0, -(-(ctx + 3) // 4) :], 0)
    assert shapes == {(1, 6)}
    with pytest.raises(ValueError, match="max_blocks=1 is smaller than the block tables' width 2"):
        jax_attn.RaggedMetadata.build([5], [0], [[0, 1]], 4, max_blocks=1)


@pytest.mark.parametrize("num_heads", [1, 2, 5, 6, 8, 12, 32, 40])
def test_alibi_slopes(num_heads):
    slopes = jax_attn.alibi_slopes(num_heads)
    assert slopes.shape == (num_heads,) and slopes.dtype == np.float32
    closest = 2 ** math.floor(math.log2(num_heads))
    ratio = 2.0 ** (-8.0 / closest)
    np.testing.assert_allclose(slopes[:closest], ratio ** np.arange(1, closest + 1), rtol=1e-6)
    if num_heads > closest:  # interleaved slopes of 2 * closest heads
        extra = (2.0 ** (-4.0 / closest)) ** np.arange(1, 2 * (num_heads - closest), 2)
        np.testing.assert_allclose(slopes[closest:], extra, rtol=1e-6)
    assert len(set(slopes.tolist())) == num_heads


def test_alibi_slopes_known_values():
    np.testing.assert_allclose(jax_attn.alibi_slopes(8), [2.0**-k for k in range(1, 9)])
    # 12 heads: the 8 slopes of 8 heads, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5
    np.testing.assert_allclose(jax_attn.alibi_slopes(12)[8:], [2.0 ** -(k + 0.5) for k in range(4)])


def test_attention_bias_materialize():
    bias = jax_attn.AttentionBias.from_seqlens([2, 1], [3, 4], sliding_window=2, alibi_slopes=[0.5])
    dense = bias.materialize(num_heads=1)
    assert dense.shape == (1, 3, 7)
    inf = -np.inf
    expected = np.array(
        [
            # seq 0: queries at positions 1, 2 over keys 0..2; seq 1: query at 3 over keys 0..3
            [-0.5, 0.0, inf, inf, inf, inf, inf],
            [inf, -0.5, 0.0, inf, inf, inf, inf],
            [inf, inf, inf, inf, inf, -0.5, 0.0],
        ]
    )
    np.testing.assert_array_equal(dense[0], expected)
    with pytest.raises(ValueError, match="q_len=5 > kv_len=2"):
        jax_attn.AttentionBias.from_seqlens([5], [2])


def _problem(rng):
    md = jax_attn.RaggedMetadata.build([2, 1], [0, 6], [[1], [2, 0]], 4, pad_to=(3, 4))
    q = jnp.zeros((4, 4, 8))
    cache = jnp.zeros((3, 4, 2, 8))
    return q, cache, md


@pytest.mark.parametrize(
    "field, value, match",
    [
        (
            "block_tables",
            [[1, 0], [2, 7], [0, 0]],
            r"block_tables\[1, 1\]=7 is out of range: block ids must be in \[0, num_blocks=3\)",
        ),
        ("query_start_loc", [0, 2, 1, 3], r"non-decreasing \(monotone\).*query_start_loc\[2\]=1"),
        ("query_start_loc", [1, 2, 3, 3], "must start at 0, got 1"),
        ("query_start_loc", [0, 2, 9, 9], r"query_start_loc\[num_seqs\]=9 exceeds the 4 query"),
        ("seq_lens", [1, 7, 0], r"q_len <= seq_len.*sequence 0 has q_len=2 > seq_lens\[0\]=1"),
        ("seq_lens", [2, 9, 0], r"seq_lens\[1\]=9 needs 3 blocks of 4 but block_tables has 2"),
        ("slot_mapping", [4, 5, 12, -1], r"slot_mapping\[2\]=12 is out of range"),
        ("num_seqs", 4, r"num_seqs=4 must be in \[0, 3\]"),
    ],
)
def test_validate_errors(field, value, match, rng):
    q, cache, md = _problem(rng)
    jax_attn.validate(q, cache, cache, md)  # the unmodified problem is valid
    bad = dataclasses.replace(md, **{field: jnp.asarray(value, jnp.int32)})
    with pytest.raises(ValueError, match=match):
        jax_attn.validate(q, cache, cache, bad)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(query=jnp.zeros((4, 8))), r"query must be 3-D \[num_tokens, num_heads, head_size\]"),
        (dict(query=jnp.zeros((4, 3, 8))), "num_heads=3 must be divisible by num_kv_heads=2"),
        (dict(query=jnp.zeros((4, 4, 16))), "query head_size=16 != cache head_size=8"),
        (dict(query=jnp.zeros((4, 4, 8), jnp.int32)), "query.dtype=int32 must be a float dtype"),
        (dict(cache=jnp.zeros((3, 4, 2, 8), jnp.int8)), "int8 is not a supported cache dtype"),
        (dict(cache=jnp.zeros((3, 4, 8))), "key_cache must be 4-D"),
        (dict(alibi=jnp.zeros(3)), r"alibi_slopes must have shape \(4,\)"),
    ],
)
def test_trace_time_errors(change, match, rng):
    q, cache, md = _problem(rng)
    q = change.get("query", q)
    cache = change.get("cache", cache)
    with pytest.raises((ValueError, TypeError), match=match):
        jax_attn.paged_attention(q, cache, cache, md, impl="xla", alibi_slopes=change.get("alibi"))


def test_unknown_impl(rng):
    q, cache, md = _problem(rng)
    with pytest.raises(ValueError, match="impl='cuda' is not one of"):
        jax_attn.paged_attention(q, cache, cache, md, impl="cuda")


@pytest.mark.parametrize(
    "on_gpu, head_size, block_size, dtype, expected",
    [
        (False, 128, 16, "bfloat16", "xla"),
        (True, 128, 16, "bfloat16", "pallas"),
        (True, 80, 16, "bfloat16", "xla"),  # the native kernels take power-of-two heads
        (True, 128, 12, "float32", "xla"),
        (True, 64, 8, "float64", "xla"),
    ],
)
def test_auto_impl_falls_back_where_the_kernel_cannot(
    on_gpu, head_size, block_size, dtype, expected, monkeypatch
):
    from jax_attn import paged

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu" if on_gpu else "cpu")
    monkeypatch.setitem(sys.modules, "jax_attn.cpu", None)  # no native CPU kernels here
    query = jax.ShapeDtypeStruct((3, 4, head_size), jnp.dtype(dtype))
    cache = jax.ShapeDtypeStruct((5, block_size, 2, head_size), jnp.bfloat16)
    assert paged.resolve_impl("auto", query, cache) == expected
    assert paged.resolve_impl("xla", query, cache) == "xla"

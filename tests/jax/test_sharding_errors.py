"""`PagedSharding`'s argument errors and its layout arithmetic, on abstract meshes (no
devices needed: this process keeps one). The sharded runs are in test_sharding.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jax_attn import RaggedMetadata
from jax_attn.sharding import PagedSharding


def mesh(tp=4, dp=None):
    if dp is None:
        return AbstractMesh((tp,), ("tp",))
    return AbstractMesh((dp, tp), ("dp", "tp"))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(tp_axis="model"), r"tp_axis='model' is not an axis of the mesh"),
        (dict(dp_axis="data"), r"dp_axis='data' is not an axis of the mesh"),
        (dict(num_heads=6, num_kv_heads=4), r"num_heads=6 must be a positive multiple"),
        (dict(num_heads=6, num_kv_heads=2), r"num_heads=6 must be divisible by the tp size 4"),
        (dict(num_heads=24, num_kv_heads=6), r"num_kv_heads=6 and the tp size 4 must divide"),
    ],
    ids=["tp-axis", "dp-axis", "gqa", "heads-over-tp", "kv-heads-vs-tp"],
)
def test_layout_errors(kwargs, match):
    args = dict(mesh=mesh(4), num_heads=8, num_kv_heads=4) | kwargs
    with pytest.raises(ValueError, match=match):
        PagedSharding(**args)


def test_same_axis_for_tp_and_dp():
    with pytest.raises(ValueError, match="tp_axis and dp_axis must differ"):
        PagedSharding(mesh(4), 8, 4, tp_axis="tp", dp_axis="tp")


@pytest.mark.parametrize(
    ("tp", "hkv", "replicas", "cache_heads"),
    [(4, 8, 1, 8), (4, 4, 1, 4), (4, 2, 2, 4), (8, 1, 8, 8), (2, 1, 2, 2)],
)
def test_kv_heads_replicated_when_fewer_than_tp(tp, hkv, replicas, cache_heads):
    layout = PagedSharding(mesh(tp), 8, hkv)
    assert layout.kv_replicas == replicas
    assert layout.cache_kv_heads == cache_heads
    x = jnp.arange(3 * hkv * 2, dtype=jnp.float32).reshape(3, hkv, 2)
    wide = layout.expand_kv_heads(x)
    assert wide.shape == (3, cache_heads, 2)
    # Expanded head e holds kv head e // replicas; query head h of device r reads it.
    for e in range(cache_heads):
        np.testing.assert_array_equal(wide[:, e], x[:, e // replicas])
    group = 8 // hkv
    for r in range(tp):
        local_q = range(r * 8 // tp, (r + 1) * 8 // tp)
        local_kv = range(r * cache_heads // tp, (r + 1) * cache_heads // tp)
        local_group = len(local_q) // len(local_kv)
        for i, h in enumerate(local_q):
            assert local_kv[i // local_group] // replicas == h // group


def test_specs_and_shapes_with_dp():
    layout = PagedSharding(mesh(4, 2), 8, 2, dp_axis="dp")
    assert layout.cache_spec == P("dp", None, "tp", None)
    assert layout.heads_spec == P("dp", "tp", None)
    assert layout.batch_spec == P("dp")
    assert layout.kv_cache_shape(12, 16, 64) == (24, 16, 4, 64)
    assert PagedSharding(mesh(4), 8, 2).batch_spec == P()


def test_expand_kv_heads_error():
    with pytest.raises(ValueError, match="must have num_kv_heads=2 on axis -2"):
        PagedSharding(mesh(4), 8, 2).expand_kv_heads(jnp.zeros((3, 4, 2)))


def test_cache_and_query_shape_errors():
    layout = PagedSharding(mesh(4), 8, 2)  # cache heads: 4 (each kv head on 2 devices)
    kc = jax.ShapeDtypeStruct((12, 16, 2, 64), jnp.float32)
    q = jax.ShapeDtypeStruct((5, 8, 64), jnp.float32)
    md = RaggedMetadata.build([5], [0], [[0]], 16)
    with pytest.raises(ValueError, match=r"key_cache.shape=\(12, 16, 2, 64\) must be .* 4, head"):
        layout.paged_attention(q, kc, kc, md)
    kc = jax.ShapeDtypeStruct((12, 16, 4, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"query.shape=\(5, 4, 64\) must have num_heads=8"):
        layout.paged_attention(jax.ShapeDtypeStruct((5, 4, 64), jnp.float32), kc, kc, md)
    with pytest.raises(ValueError, match=r"key.shape=\(5, 2, 64\) must have 4 heads on axis 1"):
        k = jax.ShapeDtypeStruct((5, 2, 64), jnp.float32)
        layout.write_kv(kc, kc, k, k, md.slot_mapping)


def test_stack_metadata():
    layout = PagedSharding(mesh(4, 2), 8, 2, dp_axis="dp")
    a = RaggedMetadata.build([3, 1], [0, 5], [[1], [2]], 8, pad_to=(2, 6))
    b = RaggedMetadata.build([2], [4], [[0]], 8, pad_to=(2, 6))
    md = layout.stack_metadata([a, b])
    assert md.num_seqs.tolist() == [2, 1]
    assert md.query_start_loc.tolist() == [0, 3, 4, 0, 2, 2]
    assert md.slot_mapping.shape == (12,)
    with pytest.raises(ValueError, match="1 metadata for dp=2"):
        layout.stack_metadata([a])
    c = RaggedMetadata.build([2], [4], [[0]], 8, pad_to=(3, 6))
    with pytest.raises(ValueError, match="the groups' metadata shapes differ"):
        layout.stack_metadata([a, c])

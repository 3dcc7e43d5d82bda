"""Online softmax over key chunks, in float32: the update shared by the XLA paths.

Queries come in *tiles*: `[num_tiles, tile_q, num_heads, head_size]`, each tile holding query
rows of a single sequence. A caller walks each tile's keys chunk by chunk in its own loop and
folds every chunk in with `update`, keeping a running max `m`, normalizer `denom` and
accumulator `acc` in float32, so nothing of size `[queries, all keys]` is ever materialized and
every key chunk is read once for all query heads of its kv head (GQA).

    queries = group_queries(q, q_pos, q_valid, num_kv_heads=Hkv, alibi_slopes=None)
    state = initial_state(queries)
    state = update(state, queries, chunk, causal=..., ...)   # once per key chunk
    out = finish(state)                                      # [N, Q, Hq, D]

Masked logits are replaced (`where`, never multiplied) by -inf. A NaN value times a zero
weight is still NaN, so callers must hand in finite data at invalid key positions: they read
a slot known to hold the sequence's own data instead of the unused memory there.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

# (m, denom, acc): [N, Hkv, G, Q], [N, Hkv, G, Q], [N, Hkv, G, Q, D], float32.
State = tuple[Array, Array, Array]


@dataclasses.dataclass(frozen=True)
class KeyChunk:
    """One chunk of keys for every tile, with the key positions and validity."""

    # Head-major, so both products batch over (tile, kv head) with no transposes.
    key: Float[Array, "num_tiles num_kv_heads chunk head_size"]  # float32
    value: Float[Array, "num_tiles num_kv_heads chunk head_size"]  # float32, finite where invalid
    pos: Int[Array, "num_tiles chunk"]  # position of each key in its sequence
    valid: Bool[Array, "num_tiles chunk"]  # inside the sequence's keys


@dataclasses.dataclass(frozen=True)
class Queries:
    """Query tiles grouped by kv head, ready for `update` (built once, outside the loop)."""

    q: Float[Array, "num_tiles num_kv_heads group tile_q head_size"]  # float32, scaled
    pos: Int[Array, "num_tiles tile_q"]  # position of each query in its sequence
    valid: Bool[Array, "num_tiles tile_q"]  # a real query row
    slopes: Float[Array, "1 num_kv_heads group 1 1"] | None  # ALiBi
    # Where each row's ALiBi distances are measured from (`alibi_origin`); None: `pos`.
    alibi_from: Int[Array, "num_tiles tile_q"] | None = None


def group_queries(
    q: Float[Array, "num_tiles tile_q num_heads head_size"],
    q_pos: Int[Array, "num_tiles tile_q"],
    q_valid: Bool[Array, "num_tiles tile_q"],
    *,
    num_kv_heads: int,
    alibi_slopes: Float[Array, " num_heads"] | None,
    alibi_from: Int[Array, "num_tiles tile_q"] | None = None,
) -> Queries:
    """`q` is float32 with the softmax scale (and the key scale) already folded in;
    `alibi_from`: `alibi_origin`'s positions (None: the queries' own)."""
    num_tiles, tile_q, num_heads, head_size = q.shape
    group = num_heads // num_kv_heads
    # [N, Q, Hq, D] -> [N, Q, Hkv, G, D] -> [N, Hkv, G, Q, D]
    q = q.reshape(num_tiles, tile_q, num_kv_heads, group, head_size).transpose(0, 2, 3, 1, 4)
    slopes = None
    if alibi_slopes is not None:
        slopes = alibi_slopes.astype(jnp.float32).reshape(1, num_kv_heads, group, 1, 1)
    return Queries(q=q, pos=q_pos, valid=q_valid, slopes=slopes, alibi_from=alibi_from)


def alibi_origin(
    q_pos: Int[Array, "num_tiles tile_q"], kv_len: Int[Array, " num_tiles"], *, causal: bool
) -> Int[Array, "num_tiles tile_q"] | None:
    """The position each row's ALiBi distances are measured from: the last key it can see.

    The spec's bias `slope * (p_k - p_q)` and `slope * (p_k - origin)` differ by a per-row
    constant, which the softmax cancels (`finish` moves the sinks by it). Measured from the
    last visible key, the logits that carry the weight stay near the unbiased ones, where
    float32 is fine; from `p_q`, a non-causal row's keys ahead carry biases of slope x distance
    (~140 at 280 tokens), whose rounding (~1e-5) then shows in every probability (bidirectional
    ALiBi, float32: 2.3e-5 from the float64 oracle against 1.3e-6 without ALiBi). Causal rows
    see no key past `p_q`: None, their own positions."""
    if causal:
        return None
    return jnp.broadcast_to((kv_len - 1)[:, None], q_pos.shape).astype(q_pos.dtype)


def initial_state(queries: Queries, *inputs) -> State:
    """The empty running softmax. Under `jax.shard_map` the loop carry must vary over every
    mesh axis the chunks' results will vary over: pass the other arrays the loop reads (the
    caches, the block tables) as `inputs`, and the state is typed like all of them together."""
    stats_shape = queries.q.shape[:-1]  # [N, Hkv, G, Q]
    state = (
        jnp.full(stats_shape, -jnp.inf, jnp.float32),
        jnp.zeros(stats_shape, jnp.float32),
        jnp.zeros(queries.q.shape, jnp.float32),
    )
    sources = (queries.q, queries.pos, queries.valid, queries.slopes, queries.alibi_from, inputs)
    return tuple(vary_like(x, *sources) for x in state)


def varying_axes(x) -> frozenset:
    """The mesh axes `x` varies over inside `jax.shard_map` (empty outside, and with
    `check_vma=False`)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))  # older jax


def output_struct(shape, dtype, *refs) -> jax.ShapeDtypeStruct:
    """The `out_shape` of a kernel (`pallas_call`, `ffi_call`) whose result is computed from
    the arrays in `refs`: under `jax.shard_map` with `check_vma`, it varies over every mesh
    axis they vary over (a kernel's output type must say so)."""
    axes = frozenset().union(*(varying_axes(r) for r in jax.tree.leaves(refs)))
    if not axes:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(
        shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=axes)
    )


def vary_like(x: Array, *refs) -> Array:
    """`x` typed as varying over every mesh axis any array in `refs` (pytrees) varies over.

    A value built from constants (`zeros`, `full`) is invariant across devices; a loop whose
    body mixes it with per-device data returns a varying value, and `check_vma` rejects a carry
    whose type changes. A no-op outside `shard_map`."""
    axes = frozenset().union(*(varying_axes(r) for r in jax.tree.leaves(refs)))
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def update(
    state: State,
    queries: Queries,
    chunk: KeyChunk,
    *,
    causal: bool,
    sliding_window: int | None,
    logits_soft_cap: float | None,
) -> State:
    """Fold one chunk of keys into the running softmax of every query row."""
    m, denom, acc = state  # [N, Hkv, G, Q], [N, Hkv, G, Q], [N, Hkv, G, Q, D]
    q = queries.q
    # [N, Hkv, G, Q, D] x [N, Hkv, K, D] -> [N, Hkv, G, Q, K]
    s = jnp.einsum("nhgqd,nhkd->nhgqk", q, chunk.key, preferred_element_type=jnp.float32)
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    delta = queries.pos[:, :, None] - chunk.pos[:, None, :]  # [N, Q, K], how far back the key is
    if queries.slopes is not None:
        origin = queries.pos if queries.alibi_from is None else queries.alibi_from
        distance = origin[:, :, None] - chunk.pos[:, None, :]
        s = s - queries.slopes * distance[:, None, None].astype(jnp.float32)
    keep = queries.valid[:, :, None] & chunk.valid[:, None, :]  # [N, Q, K]
    if causal:
        keep &= delta >= 0
    if sliding_window is not None:
        keep &= delta < sliding_window
    s = jnp.where(keep[:, None, None], s, -jnp.inf)

    # The result does not depend on m, so it carries no gradient.
    m_new = jax.lax.stop_gradient(jnp.maximum(m, s.max(axis=-1)))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # all-masked rows so far
    p = jnp.exp(s - m_safe[..., None])  # [N, Hkv, G, Q, K]
    correction = jnp.exp(m - m_safe)
    denom = denom * correction + p.sum(axis=-1)
    # [N, Hkv, G, Q, K] x [N, Hkv, K, D] -> [N, Hkv, G, Q, D]
    pv = jnp.einsum("nhgqk,nhkd->nhgqd", p, chunk.value, preferred_element_type=jnp.float32)
    acc = acc * correction[..., None] + pv
    return m_new, denom, acc


def finish(
    state: State,
    sinks: Float[Array, " num_heads"] | None = None,
    queries: Queries | None = None,
) -> Float[Array, "num_tiles tile_q num_heads head_size"]:
    """The normalized float32 output; rows whose keys are all masked, and invalid rows, are
    zeros. `sinks` (attention sinks, one logit per query head): a key with no value in every
    row's softmax, so each row's normalizer gains exp(sink - m). With sinks, pass the
    `queries`: ALiBi measured from `alibi_from` left each row's logits short of the spec's by
    slope * (alibi_from - pos), and the sink moves with them."""
    m, denom, acc = state
    num_tiles, num_kv_heads, group, tile_q, head_size = acc.shape
    # Rows that saw no key give zeros (their acc may hold NaN from a keyless tile's reads).
    seen = denom > 0
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(1, num_kv_heads, group, 1)
        if queries is not None and queries.slopes is not None and queries.alibi_from is not None:
            ahead = (queries.alibi_from - queries.pos).astype(jnp.float32)  # [N, Q]
            sink = sink - queries.slopes[..., 0] * ahead[:, None, None, :]
        denom = denom + jnp.exp(sink - jnp.where(seen, m, 0.0))
    seen = seen[..., None]
    out = jnp.where(seen, acc / jnp.where(seen, denom[..., None], 1.0), 0.0)
    # [N, Hkv, G, Q, D] -> [N, Q, Hkv, G, D] -> [N, Q, Hq, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(num_tiles, tile_q, num_kv_heads * group, head_size)

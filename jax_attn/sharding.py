"""Paged attention over a device mesh: tensor parallel over kv heads, data parallel over batches.

Attention never mixes kv heads, so a cache sharded over its kv-head axis needs no
communication: each device attends its own query heads over its own kv heads. `PagedSharding`
names the `PartitionSpec`s of every argument and runs the core's entries (`paged_attention`,
`paged_decode`, `write_kv`) per shard under `jax.shard_map`, with any `impl` the core has.

Layout on a mesh with a tensor-parallel axis `tp` (size `n`) and an optional data-parallel
axis `dp` (size `m`):

    array                         global shape              PartitionSpec
    key_cache, value_cache        [m*NB, BS, Hc, D]         P(dp, None, tp, None)
    query (ragged or decode)      [m*T, Hq, D]              P(dp, tp, None)
    key, value (write_kv)         [m*T, Hc, D]              P(dp, tp, None)
    alibi_slopes, sinks           [Hq]                      P(tp)
    metadata arrays, slot_mapping [m*(S+1)], [m*S, ...], .. P(dp)       (P() without dp)
    metadata.num_seqs             [m]                       P(dp)       (scalar P() without dp)

- tp: device `r` holds kv heads `[r*Hc/n, (r+1)*Hc/n)` and query heads `[r*Hq/n, (r+1)*Hq/n)`,
  exactly the query heads that read those kv heads (whole GQA groups). Metadata is
  replicated over tp: every device of a dp group walks the same block tables.
- dp: each dp group owns a block pool of its own (`NB` blocks), a batch of its own (`T`
  tokens, `S` sequences) and metadata of its own, laid end to end along the leading axis.
  Block ids and slots in a group's metadata index its own pool (0..NB-1), so a group's
  metadata is exactly what it would be on one device (`stack_metadata` lays them out).
- Fewer kv heads than tp devices (`Hkv < n`, MQA/GQA): as in vLLM, each kv head is
  replicated on `n / Hkv` devices, so every device holds one kv head (`Hc = n`) and the `Hq/n`
  query heads that read it. The cache is allocated with `Hc = max(Hkv, n)` heads and new
  keys/values are written with their heads repeated (`expand_kv_heads`): device `r` holds
  kv head `r // (n / Hkv)`. The cache costs `n / Hkv` times the memory of an unreplicated
  one, the price vLLM pays too for never moving keys between devices.

Nothing in the per-shard step communicates: no collective ever touches the cache, and the
output stays sharded like the query. The per-shard function is the core's own entry, so
whatever `impl` runs on one device runs per shard ("xla", "pallas", "cpu", "reference";
"auto" decides from the arrays' platform as on one device).
"""

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from jax_attn import _online_softmax as online_softmax
from jax_attn import cache, paged
from jax_attn.metadata import RaggedMetadata

# Static keywords of the entries: part of the compiled function's identity.
_STATIC = ("scale", "causal", "sliding_window", "logits_soft_cap")


@dataclasses.dataclass(frozen=True)
class PagedSharding:
    """Where paged attention's arrays live on `mesh`, and the entries that run there.

    `num_heads` / `num_kv_heads` are the model's (Hq / Hkv). `tp_axis` names the mesh axis
    that splits heads; `dp_axis` (optional) the one that splits batches and block pools.
    """

    mesh: Mesh
    num_heads: int
    num_kv_heads: int
    tp_axis: str = "tp"
    dp_axis: str | None = None

    def __post_init__(self):
        names = self.mesh.axis_names
        for arg in ("tp_axis", "dp_axis"):
            axis = getattr(self, arg)
            if axis is not None and axis not in names:
                raise ValueError(f"{arg}={axis!r} is not an axis of the mesh {names}")
        if self.tp_axis == self.dp_axis:
            raise ValueError(f"tp_axis and dp_axis must differ, both are {self.tp_axis!r}")
        hq, hkv, tp = self.num_heads, self.num_kv_heads, self.tp_size
        if hkv <= 0 or hq % hkv:
            raise ValueError(f"num_heads={hq} must be a positive multiple of num_kv_heads={hkv}")
        if hq % tp:
            raise ValueError(f"num_heads={hq} must be divisible by the tp size {tp}")
        if hkv % tp and tp % hkv:
            raise ValueError(
                f"num_kv_heads={hkv} and the tp size {tp} must divide one another (each device "
                "holds whole kv heads, or one kv head replicated on tp/num_kv_heads devices)"
            )

    # Sizes.

    @property
    def tp_size(self) -> int:
        return self.mesh.shape[self.tp_axis]

    @property
    def dp_size(self) -> int:
        return 1 if self.dp_axis is None else self.mesh.shape[self.dp_axis]

    @property
    def kv_replicas(self) -> int:
        """Devices holding each kv head: `tp / Hkv` when `Hkv < tp`, else 1."""
        return max(1, self.tp_size // self.num_kv_heads)

    @property
    def cache_kv_heads(self) -> int:
        """Hc, the kv-head axis of the sharded cache: `Hkv * kv_replicas = max(Hkv, tp)`."""
        return self.num_kv_heads * self.kv_replicas

    def kv_cache_shape(self, num_blocks: int, block_size: int, head_size: int) -> tuple:
        """Global shape of each cache, `num_blocks` blocks per dp group:
        `(dp * num_blocks, block_size, Hc, head_size)`."""
        nb = cache.kv_cache_shape(num_blocks, block_size, self.cache_kv_heads, head_size)[0]
        return (self.dp_size * nb, block_size, self.cache_kv_heads, head_size)

    # PartitionSpecs and shardings.

    @property
    def cache_spec(self) -> P:
        return P(self.dp_axis, None, self.tp_axis, None)

    @property
    def heads_spec(self) -> P:
        """Token-major arrays with a head axis: queries, outputs, new keys and values."""
        return P(self.dp_axis, self.tp_axis, None)

    @property
    def batch_spec(self) -> P:
        """Index arrays (metadata, block tables, seq_lens, slot_mapping): split by dp only."""
        return P(self.dp_axis) if self.dp_axis is not None else P()

    @property
    def metadata_spec(self) -> RaggedMetadata:
        """A `RaggedMetadata` of specs (a pytree prefix for `jax.device_put` / `shard_map`)."""
        b = self.batch_spec
        return RaggedMetadata(
            query_start_loc=b, seq_lens=b, block_tables=b, slot_mapping=b, num_seqs=b
        )

    def sharding(self, spec) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def put_cache(self, x: Array) -> Array:
        return jax.device_put(x, self.sharding(self.cache_spec))

    def put_heads(self, x: Array) -> Array:
        return jax.device_put(x, self.sharding(self.heads_spec))

    def put_metadata(self, md: RaggedMetadata) -> RaggedMetadata:
        specs = self.metadata_spec
        return jax.tree.map(lambda x, s: jax.device_put(x, self.sharding(s)), md, specs)

    def device_heads(self) -> dict:
        """Which heads each device holds: {device id: (query heads, kv heads of the model)}
        (replicated kv heads appear on several devices)."""
        hq, hc, tp = self.num_heads, self.cache_kv_heads, self.tp_size
        out = {}
        for idx in np.ndindex(self.mesh.devices.shape):
            device = self.mesh.devices[idx]
            r = idx[self.mesh.axis_names.index(self.tp_axis)]
            q = range(r * hq // tp, (r + 1) * hq // tp)
            kv = sorted({h // self.kv_replicas for h in range(r * hc // tp, (r + 1) * hc // tp)})
            out[device.id] = (list(q), kv)
        return out

    # Host-side helpers.

    def expand_kv_heads(self, x: Float[Array, "... num_kv_heads head_size"]) -> Array:
        """`x` with each kv head repeated `kv_replicas` times on axis -2 (Hkv -> Hc): the
        layout of the sharded cache and of the keys/values `write_kv` takes. A no-op when
        `Hkv >= tp`."""
        if x.shape[-2] != self.num_kv_heads:
            raise ValueError(
                f"expand_kv_heads: x.shape={x.shape} must have num_kv_heads={self.num_kv_heads}"
                " on axis -2"
            )
        return x if self.kv_replicas == 1 else jnp.repeat(x, self.kv_replicas, axis=-2)

    def stack_metadata(self, per_group: Sequence[RaggedMetadata]) -> RaggedMetadata:
        """One `RaggedMetadata` from each dp group's own (same shapes; block ids local to the
        group's pool), laid end to end; `num_seqs` becomes `[dp]`."""
        if len(per_group) != self.dp_size:
            raise ValueError(f"stack_metadata: {len(per_group)} metadata for dp={self.dp_size}")
        if self.dp_axis is None:
            return per_group[0]
        shapes = {tuple(x.shape for x in jax.tree.leaves(md)) for md in per_group}
        if len(shapes) != 1:
            raise ValueError(f"stack_metadata: the groups' metadata shapes differ: {shapes}")
        return jax.tree.map(
            lambda *xs: jnp.concatenate([jnp.atleast_1d(x) for x in xs]), *per_group
        )

    # The entries.

    def paged_attention(
        self,
        query: Float[Array, "num_tokens num_heads head_size"],
        key_cache: Float[Array, "num_blocks block_size cache_kv_heads head_size"],
        value_cache: Float[Array, "num_blocks block_size cache_kv_heads head_size"],
        metadata: RaggedMetadata,
        *,
        alibi_slopes: Float[Array, " num_heads"] | None = None,
        k_scale: float | Float[Array, ""] = 1.0,
        v_scale: float | Float[Array, ""] = 1.0,
        sinks: Float[Array, " num_heads"] | None = None,
        impl: paged.Impl = "auto",
        interpret: bool | None = None,
        **static,
    ) -> Float[Array, "num_tokens num_heads head_size"]:
        """`jax_attn.paged_attention` per shard (same keywords); output sharded like `query`."""
        self._check(query, key_cache, value_cache)
        impl, interpret = paged._resolve_with_sinks(impl, interpret, query, key_cache, sinks)
        per_head = (alibi_slopes is not None, sinks is not None)
        fn = _sharded(self, "paged_attention", impl, interpret, per_head, static)
        return fn(query, key_cache, value_cache, metadata, alibi_slopes, sinks, k_scale, v_scale)

    def paged_decode(
        self,
        query: Float[Array, "num_seqs num_heads head_size"],
        key_cache: Float[Array, "num_blocks block_size cache_kv_heads head_size"],
        value_cache: Float[Array, "num_blocks block_size cache_kv_heads head_size"],
        block_tables: Int[Array, "num_seqs max_blocks"],
        seq_lens: Int[Array, " num_seqs"],
        *,
        alibi_slopes: Float[Array, " num_heads"] | None = None,
        k_scale: float | Float[Array, ""] = 1.0,
        v_scale: float | Float[Array, ""] = 1.0,
        sinks: Float[Array, " num_heads"] | None = None,
        impl: paged.Impl = "auto",
        interpret: bool | None = None,
        **static,
    ) -> Float[Array, "num_seqs num_heads head_size"]:
        """`jax_attn.paged_decode` per shard (same keywords); output sharded like `query`."""
        self._check(query, key_cache, value_cache)
        impl, interpret = paged._resolve_with_sinks(impl, interpret, query, key_cache, sinks)
        per_head = (alibi_slopes is not None, sinks is not None)
        fn = _sharded(self, "paged_decode", impl, interpret, per_head, static)
        return fn(
            query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes, sinks, k_scale,
            v_scale,
        )  # fmt: skip

    def write_kv(
        self,
        key_cache: Float[Array, "num_blocks block_size cache_kv_heads head_size"],
        value_cache: Float[Array, "num_blocks block_size cache_kv_heads head_size"],
        key: Float[Array, "num_tokens cache_kv_heads head_size"],
        value: Float[Array, "num_tokens cache_kv_heads head_size"],
        slot_mapping: Int[Array, " num_tokens"],
        *,
        k_scale: float | Float[Array, ""] = 1.0,
        v_scale: float | Float[Array, ""] = 1.0,
    ):
        """`jax_attn.write_kv` per shard: every device writes its own heads into its own pool
        (slots local to the dp group's pool). The caches are donated: update in place."""
        self._check(None, key_cache, value_cache)
        if key.shape[1:2] != (self.cache_kv_heads,):
            raise ValueError(
                f"key.shape={key.shape} must have {self.cache_kv_heads} heads on axis 1, like "
                "the sharded cache (expand_kv_heads repeats Hkv heads when Hkv < tp)"
            )
        fn = _sharded(self, "write_kv", None, None, (False, False), {})
        return fn(key_cache, value_cache, key, value, slot_mapping, k_scale, v_scale)

    def _check(self, query, key_cache, value_cache):
        for name, x in dict(key_cache=key_cache, value_cache=value_cache).items():
            if x.ndim != 4 or x.shape[2] != self.cache_kv_heads:
                raise ValueError(
                    f"{name}.shape={x.shape} must be [num_blocks, block_size, "
                    f"{self.cache_kv_heads}, head_size]: Hc = max(num_kv_heads, tp) heads "
                    "(kv heads repeated tp/num_kv_heads times when fewer than tp; see "
                    "expand_kv_heads)"
                )
        if query is not None and (query.ndim != 3 or query.shape[1] != self.num_heads):
            raise ValueError(f"query.shape={query.shape} must have num_heads={self.num_heads}")


def _local_metadata(md: RaggedMetadata) -> RaggedMetadata:
    """A dp group's metadata inside `shard_map`: `num_seqs` back to a scalar."""
    return dataclasses.replace(md, num_seqs=md.num_seqs.reshape(()))


@functools.lru_cache(maxsize=256)
def _sharded_cached(layout, kind, impl, interpret, per_head, static_items):
    static = dict(static_items)
    heads, cache_spec, batch = layout.heads_spec, layout.cache_spec, layout.batch_spec
    # ALiBi slopes and attention sinks, [Hq] each: split over tp like the query's heads.
    has_alibi, has_sinks = per_head
    alibi_spec = P(layout.tp_axis) if has_alibi else None
    sinks_spec = P(layout.tp_axis) if has_sinks else None
    if kind == "write_kv":

        def body(kc, vc, k, v, slots, k_scale, v_scale):
            return cache.write_kv(kc, vc, k, v, slots, k_scale=k_scale, v_scale=v_scale)

        in_specs = (cache_spec, cache_spec, heads, heads, batch, P(), P())
        out_specs = (cache_spec, cache_spec)
        donate = (0, 1)
    else:
        entry = getattr(paged, kind)
        run = dict(impl=impl, interpret=interpret, **static)
        if kind == "paged_attention":

            def body(q, kc, vc, md, slopes, sinks, k_scale, v_scale):
                return entry(
                    q,
                    kc,
                    vc,
                    _local_metadata(md),
                    alibi_slopes=slopes,
                    sinks=sinks,
                    k_scale=k_scale,
                    v_scale=v_scale,
                    **run,
                )

            in_specs = (heads, cache_spec, cache_spec, layout.metadata_spec, alibi_spec,
                        sinks_spec, P(), P())  # fmt: skip
        else:

            def body(q, kc, vc, bt, sl, slopes, sinks, k_scale, v_scale):
                return entry(
                    q, kc, vc, bt, sl, alibi_slopes=slopes, sinks=sinks, k_scale=k_scale,
                    v_scale=v_scale, **run,
                )  # fmt: skip

            in_specs = (heads, cache_spec, cache_spec, batch, batch, alibi_spec, sinks_spec, P(),
                        P())  # fmt: skip
        out_specs = heads
        donate = ()
    if impl != "pallas":
        # Every argument typed as varying over the whole mesh (a no-op at run time): a kernel
        # whose inputs must agree in type (`ffi_call`'s rule) then sees them agree, even where
        # an argument is replicated (metadata over tp, scales everywhere). Not for Pallas:
        # its interpreter would then slice varying blocks with replicated grid indices.
        axes = tuple(layout.mesh.axis_names)
        per_shard = body

        def body(*args):
            return per_shard(*jax.tree.map(lambda x: _vary(x, axes), args))

    # JAX's Pallas interpreter evaluates the ragged kernel's body with device-varying blocks
    # and replicated indices, which `check_vma` rejects (jax 0.10); natively on GPU the kernel
    # is one custom call and the check holds. Only that combination runs unchecked.
    check_vma = not (kind == "paged_attention" and impl == "pallas" and interpret)
    mapped = jax.shard_map(
        body, mesh=layout.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma
    )
    return jax.jit(mapped, donate_argnums=donate)


def _vary(x, axes: tuple[str, ...]):
    x = jnp.asarray(x)
    missing = tuple(a for a in axes if a not in online_softmax.varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _sharded(layout, kind, impl, interpret, per_head, static):
    """per_head: (ALiBi slopes given, sinks given)."""
    unknown = set(static) - set(_STATIC)
    if unknown:
        raise TypeError(f"{kind}: unexpected keyword arguments {sorted(unknown)}")
    items = tuple(sorted(static.items()))
    return _sharded_cached(layout, kind, impl, interpret, per_head, items)

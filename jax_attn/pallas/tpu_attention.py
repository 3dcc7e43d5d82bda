"""Paged attention as Pallas TPU (Mosaic) kernels: decode, and ragged batches of decode, prefill
and chunked prefill. `interpret=True` runs the same kernels on CPU through Pallas' TPU
interpreter (DMAs, semaphores and scalar memory included).

Layout on the TPU (the cache keeps the core's `[NB, BS, Hkv, D]`, no copy):

- A program owns one tile of queries (the decode kernel: one sequence's token; the ragged
  kernel: up to `block_q` tokens of one sequence, listed by the GPU kernel's `_tile_table`) and
  every kv head. Per loop step it fetches `block_k` keys, whole pages `[BS, Hkv, D]` or a run of
  one page's tokens when a page is larger than the step, of K and of V from HBM by async DMA
  into one of two VMEM slots, the next step's keys landing while this step computes (double
  buffering). A page is one contiguous DMA for all heads: copying one
  head's `[BS, D]` out of a 16-bit or fp8 page would slice the HBM tiling of `(Hkv, D)`, which
  Mosaic refuses.
- In VMEM the step's keys `[block_k, Hkv, D]` are swapped to `[Hkv, block_k, D]` and every query
  row of a kv head's group meets them in one batched MXU dot, `[Hkv, rows, D] x [Hkv, block_k,
  D]` (rows = G x tokens, group-major), with float32 results. Online softmax in float32 on the
  VPU; its state (`acc`, `m`, `l`) lives in VMEM scratch across the steps.
- The ragged kernel reads its tile's query rows and writes its output rows by DMA at any token
  offset, as a sum of power-of-two row runs (`_copy_rows`), so a tile never writes a row of
  another sequence and the batch needs no padded copy. Tiles of at most `SMALL_TILE` tokens
  (decodes) take a short path of `SMALL_TILE` rows, so a decode in a mixed batch does not pay
  for `block_q` rows on the MXU.
- Steps run from the step holding the first key the sliding window reaches to the last key the
  tile's last query may see; steps wholly before the window or past the diagonal are never
  fetched. Table entries past the sequence's last page fetch page 0 and every id is clamped
  into range, so no DMA can fault; keys past `seq_len` or before the window get an exactly zero
  weight and their value rows are zeroed before the second dot, so unused memory and the pages
  an engine freed behind the window (NaN included) never reach an output.

What the Mosaic compile takes (`tpu_problem`): bfloat16 or float32 queries; bf16, f32 or fp8
caches (float16 has no load on these chips); every page size and head size (a head that is not
a multiple of 128 lanes is padded in VMEM). Interpret mode takes any dtype.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int32

from jax_attn import shape_rules
from jax_attn._online_softmax import output_struct
from jax_attn.pallas import _online_softmax as softmax
from jax_attn.pallas.ragged_paged_attention import _TILE_FIELDS, _tile_table

MASK_VALUE = softmax.MASK_VALUE

# A tile of at most this many tokens runs the short path (decodes in a mixed batch). Eight rows
# is one float32 sublane tile.
SMALL_TILE = 8
# Keys per loop step when the caller does not say, and query rows (tokens x heads of a group)
# per ragged tile.
_TARGET_BLOCK_K = 256
_TARGET_ROWS = 256
# Bytes the default plans may put in VMEM (`Plan.buffers`): pages per step and query rows
# shrink until they fit, so a default plan stays inside the 16 MiB a v5e kernel gets by
# default (v6e: 32 MiB) with room for Mosaic's own temporaries.
_VMEM_BUDGET = 10 * 1024 * 1024
# The scoped VMEM a kernel asks for: what its buffers need (`Plan.vmem_bytes`) with room for
# Mosaic's own temporaries, at least the 16 MiB a v5e kernel gets by default.
_VMEM_FLOOR = 16 * 1024 * 1024


# What the compiled kernels take: the TPU's float types (float16 has no VPU/MXU support on
# the chips this targets), and fp8 caches, which are widened in VMEM before the dots.
QUERY_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
CACHE_DTYPES = (*QUERY_DTYPES, *shape_rules.FP8_DTYPES)


def tpu_problem(query_dtype, cache_dtype, block_size: int, head_size: int) -> str | None:
    """Why the compiled TPU kernels refuse these dtypes or shapes, or None. Every block and
    head size compiles (Mosaic pads a head that is not a multiple of 128 lanes); the dtypes
    are the rule."""
    if jnp.dtype(query_dtype) not in QUERY_DTYPES:
        return f"query dtype {jnp.dtype(query_dtype).name} must be bfloat16 or float32 on a TPU"
    if jnp.dtype(cache_dtype) not in CACHE_DTYPES:
        names = ", ".join(d.name for d in CACHE_DTYPES)
        return f"cache dtype {jnp.dtype(cache_dtype).name} must be one of {names} on a TPU"
    if block_size < 1 or head_size < 1:
        return f"block_size={block_size} and head_size={head_size} must be >= 1"
    return None


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a kernel walks a problem: query tokens per tile, pages per step, and what sits in
    VMEM (bytes, the double-buffered K/V slots included)."""

    block_q: int
    block_k: int  # keys per step: whole pages, or a divisor of a page
    block_size: int
    num_kv_heads: int
    group: int
    head_size: int
    cache_itemsize: int
    query_itemsize: int

    @property
    def copy_keys(self) -> int:
        """Keys per DMA: a whole page, or the step's run of one page."""
        return min(self.block_k, self.block_size)

    @property
    def copies(self) -> int:
        return self.block_k // self.copy_keys

    @property
    def pages_per_step(self) -> int:
        """Pages a step reads: `block_k // block_size`, 1 for a run of one page."""
        return self.copies

    @property
    def rows(self) -> int:
        return self.group * self.block_q

    def buffers(self) -> dict[str, int]:
        """Bytes of each VMEM buffer the kernel allocates (padded to the (8, 128) tiling)."""
        lanes = -(-self.head_size // 128) * 128
        heads = -(-self.num_kv_heads // 8) * 8
        rows = -(-self.rows // 8) * 8
        slot = self.block_k * heads * lanes * self.cache_itemsize
        tile = self.block_q * (-(-self.group * self.num_kv_heads // 8) * 8) * lanes
        return {
            "kv slots (2 x K, 2 x V)": 4 * slot,
            "query + output tiles": 2 * tile * self.query_itemsize,
            "acc (f32)": self.num_kv_heads * rows * lanes * 4,
            "m, l (f32)": 2 * self.num_kv_heads * rows * 128 * 4,
            "logits (f32)": self.num_kv_heads * rows * self.block_k * 4,
        }

    @property
    def vmem_bytes(self) -> int:
        return sum(self.buffers().values())

    @property
    def vmem_limit(self) -> int:
        return max(_VMEM_FLOOR, 2 * self.vmem_bytes)


def make_plan(
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_size: int,
    cache_dtype,
    query_dtype,
    max_blocks: int,
    block_q: int | None,
    pages_per_step: int | None,
) -> Plan:
    """The defaults for what the caller left as None: about `_TARGET_BLOCK_K` keys per step
    (whole pages, no more than the table holds, or a run of a page larger than that) and
    `_TARGET_ROWS` query rows in tiles of a multiple of 8 tokens, both halved until the buffers
    fit `_VMEM_BUDGET`: first the rows, then the keys (down to one 8-token tile and 8 keys).
    Example: 128-token pages of 32 float32 heads of 256 take 16 keys per step."""

    def plan(q, k):
        return Plan(
            block_q=q,
            block_k=k,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            group=group,
            head_size=head_size,
            cache_itemsize=jnp.dtype(cache_dtype).itemsize,
            query_itemsize=jnp.dtype(query_dtype).itemsize,
        )

    if pages_per_step is not None:
        keys = pages_per_step * block_size
    elif block_size > _TARGET_BLOCK_K and block_size % _TARGET_BLOCK_K == 0:
        keys = _TARGET_BLOCK_K
    else:
        pages = max(1, _TARGET_BLOCK_K // block_size)
        keys = min(pages, softmax.next_pow2(max(max_blocks, 1))) * block_size
    q = block_q
    if q is None:
        q = max(SMALL_TILE, _TARGET_ROWS // group // SMALL_TILE * SMALL_TILE)
    while plan(q, keys).vmem_bytes > _VMEM_BUDGET:
        if block_q is None and q > SMALL_TILE:
            q = max(SMALL_TILE, q // 2 // SMALL_TILE * SMALL_TILE)
        elif pages_per_step is None and _can_halve(keys, block_size):
            keys //= 2
        else:
            break
    return plan(q, keys)


def _can_halve(keys: int, block_size: int) -> bool:
    """Whether a step of `keys` keys may take half as many: whole pages, or a run of at least 8
    that still divides a page."""
    if keys > block_size:
        return keys % (2 * block_size) == 0
    return keys % 2 == 0 and keys // 2 >= 8 and block_size % (keys // 2) == 0


def interpret_params(interpret):
    """What `pallas_call(interpret=...)` takes: the TPU interpreter for `True`."""
    if interpret is True:
        return pltpu.InterpretParams()
    return interpret or False


# ----------------------------------------------------------------------------------------
# What both kernels share: the page pipeline and one online-softmax step over it.


class _Pages:
    """The K/V keys of one sequence, fetched one step at a time into two VMEM slots
    `[2, copies, copy_keys, Hkv, D]`: `copies` whole pages, or one run of `copy_keys` tokens
    of a page (`Plan.copy_keys`). `kv_len`: the keys of the sequence its table holds (at most
    `max_blocks` pages, whatever `seq_len` says)."""

    def __init__(self, k_hbm, v_hbm, k_buf, v_buf, sems, table_ref, *, seq, max_blocks, seq_len):
        self.k_hbm, self.v_hbm, self.k_buf, self.v_buf = k_hbm, v_hbm, k_buf, v_buf
        self.sems, self.table_ref = sems, table_ref
        self.seq, self.max_blocks = seq, max_blocks
        self.num_blocks, self.block_size = k_hbm.shape[:2]
        self.kv_len = jnp.minimum(seq_len, max_blocks * self.block_size)
        self.num_pages = pl.cdiv(self.kv_len, self.block_size)

    def _copies(self, step, slot):
        copies, keys = self.k_buf.shape[1:3]
        descriptors = []
        for c in range(copies):
            if keys == self.block_size:  # whole pages
                index, tokens = step * copies + c, slice(None)
            else:  # a run of one page (`copies == 1`); lax.div: both operands are >= 0
                index = jax.lax.div(step * keys, self.block_size)
                tokens = pl.ds(jax.lax.rem(step * keys, self.block_size), keys)
            used = (index < self.num_pages) & (index < self.max_blocks)
            row = self.seq * self.max_blocks + jnp.minimum(index, self.max_blocks - 1)
            page = jnp.clip(jnp.where(used, self.table_ref[row], 0), 0, self.num_blocks - 1)
            for hbm, buf, which in ((self.k_hbm, self.k_buf, 0), (self.v_hbm, self.v_buf, 1)):
                descriptors.append(
                    pltpu.make_async_copy(
                        hbm.at[page, tokens], buf.at[slot, c], self.sems.at[which, slot]
                    )
                )
        return descriptors

    def start(self, step, slot):
        for copy in self._copies(step, slot):
            copy.start()

    def wait(self, step, slot):
        for copy in self._copies(step, slot):
            copy.wait()


def _attend(q, row_pos, row_valid, slopes, pages, scratch, *, lo, hi, cfg):
    """Softmax attention of the query rows `q` `[Hkv, R, D]` (compute dtype) over the keys
    `[lo, hi)` of one sequence, fetched through `pages`; returns `[Hkv, R, D]` float32, zeros
    for rows that saw no key. `row_pos` `[R, 1]` are the rows' positions, `row_valid` `[R, 1]`
    whether a row is a real query, `slopes` `[Hkv, R, 1]` float32 or None."""
    acc_ref, m_ref, l_ref = scratch
    num_kv_heads, rows, head_size = q.shape
    block_k = cfg.block_k
    acc_ref[:, :rows] = jnp.zeros((num_kv_heads, rows, head_size), jnp.float32)
    m_ref[:, :rows] = jnp.full((num_kv_heads, rows, 1), MASK_VALUE, jnp.float32)
    l_ref[:, :rows] = jnp.zeros((num_kv_heads, rows, 1), jnp.float32)
    first = lo // block_k
    last = pl.cdiv(hi, block_k)
    # ALiBi is measured from the last key a row sees (the spec's bias up to a per-row constant,
    # which the softmax cancels: jax_attn._online_softmax.alibi_origin).
    origin = row_pos if cfg.causal else hi - 1

    @pl.when(first < last)
    def _():
        pages.start(first, 0)

    def body(step, carry):
        slot = jax.lax.rem(step - first, 2)

        @pl.when(step + 1 < last)
        def _():
            pages.start(step + 1, 1 - slot)

        pages.wait(step, slot)
        # [copies, copy_keys, Hkv, D] -> [block_k, Hkv, D] -> [Hkv, block_k, D]
        k = pages.k_buf[slot].reshape(block_k, num_kv_heads, head_size)
        v = pages.v_buf[slot].reshape(block_k, num_kv_heads, head_size)
        k = jnp.swapaxes(k.astype(cfg.dtype), 0, 1)
        v = jnp.swapaxes(v.astype(cfg.dtype), 0, 1)
        key_pos = step * block_k + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        valid = row_valid & (key_pos >= lo) & (key_pos < hi)  # [R, block_k]
        if cfg.causal:
            valid = valid & (key_pos <= row_pos)
        if cfg.sliding_window is not None:
            valid = valid & (row_pos - key_pos < cfg.sliding_window)
        logits = jnp.einsum(
            "hrd,hkd->hrk",
            q,
            k,
            precision=cfg.precision,
            preferred_element_type=jnp.float32,
        )
        logits = logits * cfg.logit_scale()
        if cfg.logits_soft_cap is not None:
            logits = cfg.logits_soft_cap * jnp.tanh(logits / cfg.logits_soft_cap)
        if slopes is not None:
            logits = logits + slopes * (key_pos - origin).astype(jnp.float32)[None]
        # `where`, not an additive mask: a NaN key gives a NaN logit that must not survive.
        logits = jnp.where(valid[None], logits, MASK_VALUE)
        m_prev = m_ref[:, :rows]
        m_next = jnp.maximum(m_prev, logits.max(axis=2, keepdims=True))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.where(valid[None], jnp.exp(logits - m_next), 0.0)
        l_ref[:, :rows] = correction * l_ref[:, :rows] + p.sum(axis=2, keepdims=True)
        m_ref[:, :rows] = m_next
        # A zero weight times a NaN value is NaN: zero the value rows of unused slots first, and
        # those before `lo` (a step of several pages can start on pages before the window,
        # which vLLM's engines free: they may hold anything).
        key_rows = step * block_k + jax.lax.broadcasted_iota(jnp.int32, (1, block_k, 1), 1)
        key_in_range = (key_rows >= lo) & (key_rows < pages.kv_len)  # [1, block_k, 1]
        v = jnp.where(key_in_range, v, jnp.zeros_like(v))
        pv = jnp.einsum(
            "hrk,hkd->hrd",
            p.astype(cfg.dtype),
            v,
            precision=cfg.precision,
            preferred_element_type=jnp.float32,
        )
        acc_ref[:, :rows] = correction * acc_ref[:, :rows] + pv
        return carry

    jax.lax.fori_loop(first, last, body, 0)
    row_sum = l_ref[:, :rows]
    safe = jnp.where(row_sum > 0, row_sum, 1.0)
    return jnp.where(row_sum > 0, acc_ref[:, :rows] / safe, 0.0) * cfg.v_scale()


@dataclasses.dataclass(frozen=True)
class _Config:
    """What a kernel body closes over: the static options and the two scales' refs."""

    block_k: int
    dtype: jnp.dtype
    causal: bool
    sliding_window: int | None
    logits_soft_cap: float | None
    scales_ref: object = None

    @property
    def precision(self):
        """IEEE float32 dots for float32 (the MXU's default takes bf16 passes); 16-bit
        operands take the default, which Mosaic requires for them."""
        if self.dtype == jnp.float32:
            return jax.lax.Precision.HIGHEST
        return jax.lax.Precision.DEFAULT

    def logit_scale(self):
        return self.scales_ref[0]

    def v_scale(self):
        return self.scales_ref[1]


def _key_range(first_pos, last_pos, kv_len, *, causal, sliding_window):
    """Keys `[lo, hi)` that queries at positions `first_pos..last_pos` may see."""
    hi = jnp.minimum(last_pos + 1, kv_len) if causal else kv_len
    lo = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
    return lo, jnp.maximum(hi, lo)


def _kv_scratch(plan: Plan, cache_dtype):
    slot = (2, plan.copies, plan.copy_keys, plan.num_kv_heads, plan.head_size)
    return [
        pltpu.VMEM(slot, cache_dtype),
        pltpu.VMEM(slot, cache_dtype),
        pltpu.SemaphoreType.DMA((2, 2)),
    ]


def _state_scratch(num_kv_heads: int, rows: int, head_size: int):
    return [
        pltpu.VMEM((num_kv_heads, rows, head_size), jnp.float32),
        pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
        pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
    ]


def _scales(scale, k_scale, v_scale):
    k_scale = shape_rules.scale_array(k_scale, "k_scale")
    v_scale = shape_rules.scale_array(v_scale, "v_scale")
    return jnp.stack([jnp.float32(scale) * k_scale, v_scale]).astype(jnp.float32)


def _group_slopes(alibi_slopes, num_kv_heads: int):
    """`[Hkv, G, 1]` float32 slopes, each kv head's group in order."""
    group = alibi_slopes.shape[0] // num_kv_heads
    return alibi_slopes.astype(jnp.float32).reshape(num_kv_heads, group, 1)


def _compiler_params(plan: Plan, semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=plan.vmem_limit)


# ----------------------------------------------------------------------------------------
# Decode: one query token per sequence.


def _decode_kernel(
    seq_lens_ref,  # SMEM [S]
    tables_ref,  # SMEM [S * max_blocks]
    scales_ref,  # SMEM [2]: scale * k_scale, v_scale
    q_ref,  # VMEM [Hkv, G, D]: this sequence's query
    slopes_ref,  # VMEM [Hkv, G, 1] or None
    k_hbm,  # HBM [NB, BS, Hkv, D]
    v_hbm,
    o_ref,  # VMEM [Hkv, G, D]
    k_buf,
    v_buf,
    sems,
    acc_ref,
    m_ref,
    l_ref,
    *,
    max_blocks: int,
    cfg: _Config,
):
    seq = pl.program_id(0)
    seq_len = seq_lens_ref[seq]
    cfg = dataclasses.replace(cfg, scales_ref=scales_ref)
    pages = _Pages(
        k_hbm,
        v_hbm,
        k_buf,
        v_buf,
        sems,
        tables_ref,
        seq=seq,
        max_blocks=max_blocks,
        seq_len=seq_len,
    )
    lo, hi = _key_range(
        seq_len - 1, seq_len - 1, pages.kv_len, causal=True, sliding_window=cfg.sliding_window
    )
    group = q_ref.shape[1]
    row_pos = jnp.full((group, 1), seq_len - 1, jnp.int32)
    row_valid = jnp.full((group, 1), True)
    slopes = None if slopes_ref is None else slopes_ref[...]
    out = _attend(
        q_ref[...].astype(cfg.dtype),
        row_pos,
        row_valid,
        slopes,
        pages,
        (acc_ref, m_ref, l_ref),
        lo=lo,
        hi=hi,
        cfg=cfg,
    )
    o_ref[...] = out.astype(o_ref.dtype)


def _setup(query, key_cache, block_tables, *, block_q, pages_per_step, causal, **bias):
    """What both wrappers derive before their `pallas_call`: the block tables (an empty table
    becomes one column of page 0, never read), the table width, `make_plan` for these arrays
    (the decode kernel's tiles are one token: `block_q=1`) and the kernel's `_Config`."""
    num_heads, head_size = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1:3]
    max_blocks = max(block_tables.shape[1], 1)
    if block_tables.shape[1] == 0:
        block_tables = jnp.zeros((block_tables.shape[0], 1), jnp.int32)
    plan = make_plan(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        group=num_heads // num_kv_heads,
        head_size=head_size,
        cache_dtype=key_cache.dtype,
        query_dtype=query.dtype,
        max_blocks=max_blocks,
        block_q=block_q,
        pages_per_step=pages_per_step,
    )
    cfg = _Config(
        block_k=plan.block_k,
        dtype=jnp.dtype(softmax.compute_dtype(query.dtype, key_cache.dtype)),
        causal=causal,
        **bias,
    )
    return block_tables, max_blocks, plan, cfg


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "sliding_window",
        "logits_soft_cap",
        "pages_per_compute_block",
        "interpret",
    ),
)
def paged_decode(
    query: Float[Array, "num_seqs num_heads head_size"],
    key_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    value_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    block_tables: Int32[Array, "num_seqs max_blocks"],
    seq_lens: Int32[Array, " num_seqs"],
    *,
    scale: float,
    alibi_slopes: Float[Array, " num_heads"] | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale=1.0,
    v_scale=1.0,
    pages_per_compute_block: int | None = None,
    interpret=False,
) -> Float[Array, "num_seqs num_heads head_size"]:
    """One query token per sequence against its paged cache (Pallas TPU kernel).

    Sequence i's query sits at position `seq_lens[i] - 1` and sees its `seq_lens[i]` keys in
    the blocks `block_tables[i]` (at most the table's keys). Math as in SPEC.md; a sequence of
    length 0 gives zeros. `pages_per_compute_block` pages are fetched per loop step (default:
    about 256 keys). `interpret=True` (or `pltpu.InterpretParams`) runs it on CPU.
    """
    shape_rules.check_kernel_args(
        query,
        key_cache,
        value_cache,
        query_axis="num_seqs",
        alibi_slopes=alibi_slopes,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        interpret=True,
    )
    shape_rules.check_decode_arrays(block_tables, seq_lens, query.shape[0], int32_only=True)
    shape_rules.check_positive_int(pages_per_compute_block, "pages_per_compute_block")
    _check_tpu_shapes(query, key_cache, interpret)
    num_seqs, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    block_tables, max_blocks, plan, cfg = _setup(
        query,
        key_cache,
        block_tables,
        block_q=1,
        pages_per_step=pages_per_compute_block,
        causal=True,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )
    q = query.reshape(num_seqs, num_kv_heads, group, head_size)
    slopes = None if alibi_slopes is None else _group_slopes(alibi_slopes, num_kv_heads)
    head_block = pl.BlockSpec((None, num_kv_heads, group, head_size), lambda s, *_: (s, 0, 0, 0))
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    operands = (
        seq_lens,
        block_tables.reshape(-1),
        _scales(scale, k_scale, v_scale),
        q,
        slopes,
        key_cache,
        value_cache,
    )
    out = pl.pallas_call(
        functools.partial(_decode_kernel, max_blocks=max_blocks, cfg=cfg),
        grid=(num_seqs,),
        in_specs=[
            smem,
            smem,
            smem,
            head_block,
            None if slopes is None else pl.BlockSpec((num_kv_heads, group, 1), lambda s: (0, 0, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=head_block,
        out_shape=output_struct(q.shape, query.dtype, *operands),
        scratch_shapes=_kv_scratch(plan, key_cache.dtype)
        + _state_scratch(num_kv_heads, group, head_size),
        compiler_params=_compiler_params(plan, ("parallel",)),
        interpret=interpret_params(interpret),
        name="tpu_paged_decode",
    )(*operands)
    return out.reshape(num_seqs, num_heads, head_size)


def _check_tpu_shapes(query, key_cache, interpret) -> None:
    if interpret:
        return
    problem = tpu_problem(query.dtype, key_cache.dtype, key_cache.shape[1], key_cache.shape[3])
    if problem is not None:
        raise ValueError(f"the TPU kernels cannot take these arguments: {problem}")


# ----------------------------------------------------------------------------------------
# Ragged: a mixed batch of decode, prefill and chunked prefill.


def _copy_rows(src, dst, *, src_start, dst_start, count, max_rows: int, sem):
    """Copy rows `src[src_start : src_start + count]` to `dst[dst_start:]` along the leading
    axis, `count <= max_rows` not known until run time: one DMA per set bit of `count`
    (runs of 2^b rows, largest first), each of a static size, so exactly `count` rows move."""
    bit = 1 << (max_rows.bit_length() - 1)
    while bit:
        offset = count & ~(2 * bit - 1)  # the rows the larger runs took

        @pl.when((count & bit) != 0)
        def _(bit=bit, offset=offset):
            copy = pltpu.make_async_copy(
                src.at[pl.ds(src_start + offset, bit)], dst.at[pl.ds(dst_start + offset, bit)], sem
            )
            copy.start()
            copy.wait()

        bit //= 2


def _ragged_kernel(
    tiles_ref,  # SMEM [num_tiles * 8]: seq, q_start, num_tokens, first_pos, seq_len per tile
    tables_ref,  # SMEM [S * max_blocks]
    scales_ref,  # SMEM [2]
    slopes_ref,  # VMEM [Hkv, G, 1] or None
    q_hbm,  # HBM [T, Hq, D]
    k_hbm,  # HBM [NB, BS, Hkv, D]
    v_hbm,
    o_hbm,  # HBM [T, Hq, D]
    q_buf,  # VMEM [block_q, Hq, D]
    o_buf,
    row_sem,
    k_buf,
    v_buf,
    sems,
    acc_ref,
    m_ref,
    l_ref,
    *,
    max_blocks: int,
    num_kv_heads: int,
    cfg: _Config,
):
    base = pl.program_id(0) * _TILE_FIELDS
    seq, q_start, num_tokens = tiles_ref[base], tiles_ref[base + 1], tiles_ref[base + 2]
    first_pos, seq_len = tiles_ref[base + 3], tiles_ref[base + 4]
    block_q, num_heads, head_size = q_buf.shape
    group = num_heads // num_kv_heads
    cfg = dataclasses.replace(cfg, scales_ref=scales_ref)
    pages = _Pages(
        k_hbm,
        v_hbm,
        k_buf,
        v_buf,
        sems,
        tables_ref,
        seq=seq,
        max_blocks=max_blocks,
        seq_len=seq_len,
    )
    lo, hi = _key_range(
        first_pos,
        first_pos + num_tokens - 1,
        pages.kv_len,
        causal=cfg.causal,
        sliding_window=cfg.sliding_window,
    )

    def tile(tokens: int):
        """The tile as `tokens` query rows per head (`num_tokens <= tokens`)."""
        _copy_rows(
            q_hbm,
            q_buf,
            src_start=q_start,
            dst_start=0,
            count=num_tokens,
            max_rows=tokens,
            sem=row_sem,
        )
        rows = group * tokens
        # [t, Hq, D] -> [Hq, t, D] -> [Hkv, G * t, D] (float32 while rearranging: one
        # sublane per row, so the merge of G and t is aligned for every dtype)
        q = jnp.swapaxes(q_buf[:tokens].astype(jnp.float32), 0, 1)
        q = q.reshape(num_kv_heads, rows, head_size).astype(cfg.dtype)
        token = jax.lax.rem(jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), tokens)
        row_pos = first_pos + token
        row_valid = token < num_tokens
        slopes = None
        if slopes_ref is not None:
            slopes = jnp.broadcast_to(slopes_ref[...][:, :, None], (num_kv_heads, group, tokens, 1))
            slopes = slopes.reshape(num_kv_heads, rows, 1)
        out = _attend(
            q,
            row_pos,
            row_valid,
            slopes,
            pages,
            (acc_ref, m_ref, l_ref),
            lo=lo,
            hi=hi,
            cfg=cfg,
        )
        # [Hkv, G * t, D] -> [Hq, t, D] -> [t, Hq, D]
        out = jnp.swapaxes(out.reshape(num_heads, tokens, head_size), 0, 1)
        o_buf[:tokens] = out.astype(o_buf.dtype)
        _copy_rows(
            o_buf,
            o_hbm,
            src_start=0,
            dst_start=q_start,
            count=num_tokens,
            max_rows=tokens,
            sem=row_sem,
        )

    small = min(SMALL_TILE, block_q)

    @pl.when((num_tokens > 0) & (num_tokens <= small))
    def _():
        tile(small)

    if block_q > small:

        @pl.when(num_tokens > small)
        def _():
            tile(block_q)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "causal",
        "sliding_window",
        "logits_soft_cap",
        "block_q",
        "pages_per_compute_block",
        "interpret",
    ),
)
def ragged_paged_attention(
    query: Float[Array, "num_tokens num_heads head_size"],
    key_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    value_cache: Float[Array, "num_blocks block_size num_kv_heads head_size"],
    query_start_loc: Int32[Array, " num_seqs_plus_1"],
    seq_lens: Int32[Array, " num_seqs"],
    block_tables: Int32[Array, "num_seqs max_blocks"],
    num_seqs: Int32[Array, ""],
    *,
    scale: float,
    causal: bool = True,
    alibi_slopes: Float[Array, " num_heads"] | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale=1.0,
    v_scale=1.0,
    block_q: int | None = None,
    pages_per_compute_block: int | None = None,
    interpret=False,
) -> Float[Array, "num_tokens num_heads head_size"]:
    """Attention of a ragged batch of queries over a paged cache (Pallas TPU kernel).

    The arguments and the math are those of `jax_attn.pallas.ragged_paged_attention` (the GPU
    kernel): sequence i owns tokens `query_start_loc[i]:query_start_loc[i+1]`, bottom-right
    aligned against its `seq_lens[i]` keys; tokens past `query_start_loc[num_seqs]` give zeros.
    `block_q` (query tokens per tile, a multiple of 8) and `pages_per_compute_block` default to
    `make_plan`'s choice. `interpret=True` (or `pltpu.InterpretParams`) runs it on CPU.
    """
    shape_rules.check_kernel_args(
        query,
        key_cache,
        value_cache,
        query_axis="num_tokens",
        alibi_slopes=alibi_slopes,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        interpret=True,
    )
    shape_rules.check_ragged_arrays(
        query_start_loc, seq_lens, block_tables, num_seqs, int32_only=True
    )
    shape_rules.check_positive_int(block_q, "block_q")
    shape_rules.check_positive_int(pages_per_compute_block, "pages_per_compute_block")
    if block_q is not None and block_q % SMALL_TILE:
        raise ValueError(f"block_q={block_q} must be a multiple of {SMALL_TILE}")
    _check_tpu_shapes(query, key_cache, interpret)
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    max_seqs = block_tables.shape[0]
    block_tables, max_blocks, plan, cfg = _setup(
        query,
        key_cache,
        block_tables,
        block_q=block_q,
        pages_per_step=pages_per_compute_block,
        causal=causal,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )
    num_tiles = pl.cdiv(num_tokens, plan.block_q) + max_seqs
    tiles, _ = _tile_table(
        query_start_loc, seq_lens, num_seqs, num_tiles=num_tiles, block_q=plan.block_q
    )
    slopes = None if alibi_slopes is None else _group_slopes(alibi_slopes, num_kv_heads)
    group = num_heads // num_kv_heads
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    operands = (
        tiles.reshape(-1),
        block_tables.reshape(-1),
        _scales(scale, k_scale, v_scale),
        slopes,
        query,
        key_cache,
        value_cache,
    )
    out = pl.pallas_call(
        functools.partial(
            _ragged_kernel, max_blocks=max_blocks, num_kv_heads=num_kv_heads, cfg=cfg
        ),
        grid=(num_tiles,),
        in_specs=[
            smem,
            smem,
            smem,
            None if slopes is None else pl.BlockSpec((num_kv_heads, group, 1), lambda t: (0, 0, 0)),
            hbm,
            hbm,
            hbm,
        ],
        out_specs=hbm,
        out_shape=output_struct(query.shape, query.dtype, *operands),
        scratch_shapes=[
            pltpu.VMEM((plan.block_q, num_heads, head_size), query.dtype),
            pltpu.VMEM((plan.block_q, num_heads, head_size), query.dtype),
            pltpu.SemaphoreType.DMA(()),
            *_kv_scratch(plan, key_cache.dtype),
            *_state_scratch(num_kv_heads, plan.rows, head_size),
        ],
        compiler_params=_compiler_params(plan, ("parallel",)),
        interpret=interpret_params(interpret),
        name="tpu_ragged_paged_attention",
    )(*operands)
    # Rows of padding tokens were never written.
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    is_real = token < query_start_loc[jnp.clip(num_seqs, 0, max_seqs)]
    return jnp.where(is_real[:, None, None], out, jnp.zeros_like(out))

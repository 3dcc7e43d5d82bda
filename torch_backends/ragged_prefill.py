"""`ragged_prefill`: the V0 backends' prefill steps on the native ragged kernel.

The kernel (`torch.ops.jax_attn.ragged_paged_attention`, `native.ragged_paged_attention`) reads
token-major caches `[NB, BS, Hkv, D]`; vLLM's split layout (key `[NB, Hkv, D // x, BS, x]`,
value `[NB, Hkv, D, BS]`) is not a strided view of that order (a key's `D` is cut into pieces
of x, a value's runs across the block). So a prefill reaches a kernel one of three ways:

    from_kv           no cached prefix (a plain prefill; encoder, encoder-only and the first
                      cross-attention step): the step's own K/V `[sum(kv_lens), Hkv, D]` are
                      a token-major cache as they are, viewed `[sum(kv_lens) / B, B, Hkv, D]`
                      with B the largest block (<= MAX_VIEW_BLOCK) dividing every sequence's
                      length, so that each sequence starts a block. No copy:
                          kv_lens [512, 256]: B 256, tables [[0, 1], [2]]
                          kv_lens [17, 3]:    B 1,   tables [[0 .. 16], [17, 18, 19]]
    from_split_cache  a cached prefix (chunked prefill), or every key already cached (cross
                      attention after its first step): the blocks of this step's prefills,
                      and only those, copied out of the split cache into token-major blocks
                      (`native.gather_split_blocks`: `sum(ceil(ctx_len / BS))` blocks), the
                      new tokens written after their prefix:
                          ctx_lens [5, 0], q_lens [2, 3], BS 4: seq 0 gathers its cached
                          blocks [b0, b1] -> temp [0, 1], new tokens at positions 5-6 (temp
                          block 1 offsets 1-2); seq 1 gets a fresh temp block [2].
    as_decodes        a few new tokens per sequence over a cached prefix (speculative
                      decoding's verify step; a prompt's last token recomputed after a
                      prefix-cache hit), whose keys this step wrote where the tables read them
                      (`cache_holds_new_keys`): each query a decode on the decode kernel,
                      which reads the split layout in place (`native.paged_decode_split`):
                          q_lens [2, 1], kv_lens [7, 3]: decodes of lengths [6, 7, 3]
                      No copy; each query reads its sequence's keys again, cheaper than the
                      copy for at most MAX_DECODE_QUERIES new tokens a sequence.

Decodes keep the decode kernel over the split cache.

What the kernel cannot take (`unsupported` says why, and the callers then run their torch
path: SDPA or `masked_attention`): the native library not built or disabled
(`JAX_ATTN_CPU_DISABLE=1`), tensors off the CPU, a query dtype other than float32 / bfloat16 /
float16, a head size above 256, and a sequence with more queries than keys (cross attention
whose decoder prompt is longer than the encoder's: the kernel puts queries bottom-right over
the keys, so q_len <= kv_len).
"""

import math

import torch
from jaxtyping import Int
from torch import Tensor

from torch_backends import native
from torch_backends.layouts import Scale, dequantize, quantize
from torch_backends.shapes import BlockTables, KeysValues, Queries

# The largest block `from_kv` views the step's K/V in (the sequences' common divisor above it
# is cut down to a divisor at most this size).
MAX_VIEW_BLOCK = 256
# Below this block `from_kv` copies the K/V into blocks of COPY_BLOCK instead of viewing them
# (a block of 1 or 3 tokens costs a table lookup per key or three; a copy is one pass over the
# step's K/V).
MIN_VIEW_BLOCK = 16
COPY_BLOCK = 16
# A step whose prefills all have a cached prefix and at most this many new tokens runs them as
# decodes (`as_decodes`). Against the copy and the ragged kernel, 32 sequences over ~1024 keys
# (2-core Zen 4, alternated, medians): 4 new tokens 1.8x faster in float32, 2.1x in bf16; 8:
# 1.19x / 1.55x (and 1.01x / 1.27x over 4096 keys); 12: 1.01x / 1.11x; 16: 0.91x / 1.07x.
MAX_DECODE_QUERIES = 8
_QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def unsupported(query: Queries, q_lens: list[int], kv_lens: list[int]) -> str | None:
    """Why the native kernel cannot run this prefill, or None when it can (builds the library
    on first use; its absence warns once, from `native.available`)."""
    if query.device.type != "cpu":
        return f"query on {query.device.type}: the native kernel runs on the CPU"
    if query.dtype not in _QUERY_DTYPES:
        return f"query dtype {query.dtype}: the native kernel takes float32, bfloat16, float16"
    if query.shape[-1] > 256:
        return f"head size {query.shape[-1]} > 256"
    for i, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
        if q_len > kv_len:
            return f"sequence {i} has {q_len} queries over {kv_len} keys (the kernel needs q <= kv)"
    if not native.available():
        return f"native kernels unavailable: {native.unavailable_reason()}"
    return None


def _run(
    out: Queries,
    query: Queries,
    key_cache: Tensor,
    value_cache: Tensor,
    tables: BlockTables,
    q_lens: list[int],
    kv_lens: list[int],
    attn: dict,
    **cache_kw,
) -> Queries:
    """The kernel over token-major caches, into `out` when it can write there directly."""
    starts = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    target = out
    if not out.is_contiguous() or _overlaps(out, query):
        target = torch.empty_like(query)
    native.ragged_paged_attention(
        target,
        query,
        key_cache,
        value_cache,
        starts,
        torch.tensor(kv_lens, dtype=torch.int32),
        tables,
        len(q_lens),
        **attn,
        **cache_kw,
    )
    return target if target is out else out.copy_(target)


def _overlaps(a: Tensor, b: Tensor) -> bool:
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _view_block(kv_lens: list[int]) -> int:
    """The largest block <= MAX_VIEW_BLOCK that divides every length (0 when all are 0)."""
    g = math.gcd(*kv_lens) if kv_lens else 0
    if g <= MAX_VIEW_BLOCK:
        return g
    return max(b for b in range(1, MAX_VIEW_BLOCK + 1) if g % b == 0)


def from_kv(
    out: Queries,
    query: Queries,
    key: KeysValues,
    value: KeysValues,
    q_lens: list[int],
    kv_lens: list[int],
    **attn,
) -> Queries:
    """Each sequence's `q_lens[i]` queries (bottom-right) over its `kv_lens[i]` rows of `key` /
    `value` (`[sum(kv_lens), Hkv, D]`, sequence after sequence), written into `out`; `attn`:
    the kernel's keywords (scale, causal, alibi_slopes, sliding_window, logits_soft_cap).
    The caller checked `unsupported(...) is None`."""
    total = sum(kv_lens)
    if total == 0 or query.shape[0] == 0:
        return out.zero_()
    num_kv_heads, head_size = key.shape[1:]
    block = _view_block(kv_lens)
    if block >= MIN_VIEW_BLOCK:
        # [sum(kv_lens), Hkv, D] -> [sum(kv_lens) / B, B, Hkv, D]: sequence i's blocks in order
        # (vLLM's key and value are strided views of its qkv projection: native.dense)
        key_cache = native.dense(key[:total], "key").view(-1, block, num_kv_heads, head_size)
        value_cache = native.dense(value[:total], "value").view(-1, block, num_kv_heads, head_size)
        first = [k // block for k in _starts(kv_lens)]
    else:
        # Each sequence padded to whole blocks of COPY_BLOCK; the pad rows are never read.
        block = COPY_BLOCK
        num_blocks = [-(-k // block) for k in kv_lens]
        first = _starts(num_blocks)
        rows = torch.cat([torch.arange(k) + b * block for k, b in zip(kv_lens, first, strict=True)])
        shape = (sum(num_blocks) * block, num_kv_heads, head_size)
        key_cache = native.staged_empty(key, shape, "key").index_copy_(0, rows, key[:total])
        value_cache = native.staged_empty(value, shape, "value").index_copy_(0, rows, value[:total])
        key_cache = key_cache.view(-1, block, num_kv_heads, head_size)
        value_cache = value_cache.view(-1, block, num_kv_heads, head_size)
    tables = _tables(first, [-(-k // block) for k in kv_lens])
    return _run(out, query, key_cache, value_cache, tables, q_lens, kv_lens, attn)


def from_split_cache(
    out: Queries,
    query: Queries,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: BlockTables,
    q_lens: list[int],
    kv_lens: list[int],
    cached_lens: list[int],
    new_key: KeysValues | None,
    new_value: KeysValues | None,
    *,
    kv_cache_dtype: str,
    k_scale: Scale,
    v_scale: Scale,
    round_new: bool = True,
    **attn,
) -> Queries:
    """Sequence i's `q_lens[i]` queries over `kv_lens[i]` keys: its first `cached_lens[i]` from
    vLLM's split cache (key `[NB, Hkv, D // x, BS, x]`, value `[NB, Hkv, D, BS]`; uint8 bits
    for fp8) through `block_tables[i]`, the rest the rows of `new_key` / `new_value`
    (`[sum(kv_lens - cached_lens), Hkv, D]`), into `out`. With an fp8 cache the new rows are
    quantized like the cache (`round_new`, for K/V already read back through it: the same
    bytes), or kept as given (`round_new=False`, vLLM's `forward_prefix`, whose new tokens
    bypass the cache), the copied blocks then widened to float32 times their scale."""
    if sum(kv_lens) == 0 or query.shape[0] == 0:
        return out.zero_()
    _, num_kv_heads, _, block, x = key_cache.shape
    head_size = value_cache.shape[2]
    gathered = [-(-c // block) for c in cached_lens]
    needed = [max(-(-k // block), g) for k, g in zip(kv_lens, gathered, strict=True)]
    # Temp blocks: every sequence's gathered blocks first (one copy), then its fresh ones.
    src = torch.cat(
        [block_tables[i, :g].long() for i, g in enumerate(gathered)] + [torch.zeros(0).long()]
    )
    num_gathered = src.numel()
    fresh = [n - g for n, g in zip(needed, gathered, strict=True)]
    fresh_first = [num_gathered + s for s in _starts(fresh)]
    gathered_first = _starts(gathered)
    tables = torch.zeros(len(kv_lens), max(needed, default=0), dtype=torch.int32)
    for i, (g, f) in enumerate(zip(gathered, fresh, strict=True)):
        tables[i, :g] = torch.arange(gathered_first[i], gathered_first[i] + g)
        tables[i, g : g + f] = torch.arange(fresh_first[i], fresh_first[i] + f)
    total_blocks = num_gathered + sum(fresh)
    raw = key_cache.dtype
    # Split -> token-major, gathered blocks only:
    #   key   [NB, Hkv, D/x, BS, x] -> [NB, BS, Hkv, D/x, x] (= [.., Hkv, D])
    #   value [NB, Hkv, D, BS]      -> [NB, BS, Hkv, D]
    # into buffers kept per thread (native.staged_empty: a fresh tensor this size is fresh
    # pages every step), by the native gather where the caches are dense CPU tensors.
    shape = (total_blocks, block, num_kv_heads, head_size)
    keys = native.staged_empty(key_cache, shape, "prefix_keys")
    values = native.staged_empty(value_cache, shape, "prefix_values")
    if num_gathered and key_cache.is_contiguous() and value_cache.is_contiguous():
        native.gather_split_blocks(key_cache, value_cache, src, keys, values)
    elif num_gathered:
        split_keys = keys.view(total_blocks, block, num_kv_heads, head_size // x, x)
        torch.index_select(key_cache.permute(0, 3, 1, 2, 4), 0, src, out=split_keys[:num_gathered])
        torch.index_select(value_cache.permute(0, 3, 1, 2), 0, src, out=values[:num_gathered])
    fp8 = kv_cache_dtype != "auto"
    if fp8 and not round_new and new_key is not None:
        keys, values = (
            dequantize(keys, kv_cache_dtype, k_scale),
            dequantize(values, kv_cache_dtype, v_scale),
        )
        fp8, raw, k_scale, v_scale, kv_cache_dtype = False, torch.float32, 1.0, 1.0, "auto"
    if new_key is not None and new_key.shape[0]:
        # Row of new token j of sequence i: temp block tables[i][p // BS], offset p % BS,
        # p = cached_lens[i] + j.
        rows = []
        for i, (c, k) in enumerate(zip(cached_lens, kv_lens, strict=True)):
            p = torch.arange(c, k)
            rows.append(tables[i, p // block].long() * block + p % block)
        rows = torch.cat(rows)
        k_new = quantize(new_key, kv_cache_dtype, k_scale) if fp8 else new_key.to(raw)
        v_new = quantize(new_value, kv_cache_dtype, v_scale) if fp8 else new_value.to(raw)
        keys.view(-1, num_kv_heads, head_size).index_copy_(0, rows, k_new)
        values.view(-1, num_kv_heads, head_size).index_copy_(0, rows, v_new)
    return _run(
        out, query, keys, values, tables, q_lens, kv_lens, attn,
        k_scale=k_scale, v_scale=v_scale, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip


def cache_holds_new_keys(
    slots: Tensor, block_tables: BlockTables, q_lens: list[int], kv_lens: list[int], block: int
) -> bool:
    """Whether the step wrote every new key where `block_tables` reads its position: sequence
    i's new keys (positions `kv_lens[i] - q_lens[i]` on, in order in `slots`) at slot
    `block_tables[i][p // block] * block + p % block`, none skipped (-1: a pad, or the earlier
    of two writes to one shared slot). Only then may `as_decodes` read them from the cache."""
    if sum(q_lens) != slots.numel() or block_tables.shape[0] < len(q_lens):
        return False
    if block_tables.shape[1] * block < max(kv_lens, default=0):
        return False
    seq, pos = _query_positions(q_lens, kv_lens)
    expected = block_tables[seq, pos // block].long() * block + pos % block
    return torch.equal(expected, slots.flatten().long())


def _query_positions(q_lens: list[int], kv_lens: list[int]) -> tuple[Tensor, Tensor]:
    """Each new token's sequence and position: sequence i's `q_lens[i]` tokens are the last of
    its `kv_lens[i]`. q_lens [2, 0, 1], kv_lens [7, 4, 3] -> ([0, 0, 2], [5, 6, 2])."""
    q = torch.tensor(q_lens, dtype=torch.long)
    seq = torch.repeat_interleave(torch.arange(len(q_lens)), q)
    first = torch.tensor(kv_lens, dtype=torch.long) - q  # each sequence's first new position
    return seq, first[seq] + torch.arange(seq.numel()) - (q.cumsum(0) - q)[seq]


def as_decodes(
    out: Queries,
    query: Queries,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: BlockTables,
    q_lens: list[int],
    kv_lens: list[int],
    *,
    kv_cache_dtype: str,
    k_scale: Scale,
    v_scale: Scale,
    scale: float,
    alibi_slopes: Tensor | None,
    sliding_window: int | None,
    logits_soft_cap: float | None,
) -> Queries:
    """Sequence i's `q_lens[i]` causal queries over its `kv_lens[i]` keys, all in vLLM's split
    cache, as that many decodes on the decode kernel, which reads the split layout in place
    (`native.paged_decode_split`): query j of sequence i is a decode at position
    `kv_lens[i] - q_lens[i] + j`, over the keys up to it through `block_tables[i]`.

        q_lens [2, 1], kv_lens [7, 3] -> decodes with seq_lens [6, 7, 3], tables rows [0, 0, 1]

    Each query reads its sequence's keys again (mostly from the CPU's caches: a sequence's
    queries are neighbours in the call), where `from_split_cache` copies the blocks out once
    for all its queries: the cheaper of the two for a few queries per sequence
    (MAX_DECODE_QUERIES). The caller checked `unsupported(...) is None`,
    `native.decode_supported` and `cache_holds_new_keys`."""
    seq, pos = _query_positions(q_lens, kv_lens)
    target = out
    if not out.is_contiguous() or _overlaps(out, query):
        target = torch.empty_like(query)
    native.paged_decode_split(
        target,
        query,
        key_cache,
        value_cache,
        block_tables.index_select(0, seq),
        pos + 1,  # a decode's length: the keys up to and including its own
        scale=scale,
        alibi_slopes=alibi_slopes,
        k_scale=k_scale,
        v_scale=v_scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        kv_cache_dtype=kv_cache_dtype,
    )
    return target if target is out else out.copy_(target)


def _starts(lengths: list[int]) -> list[int]:
    """[3, 5, 2] -> [0, 3, 8]."""
    starts, total = [], 0
    for n in lengths:
        starts.append(total)
        total += n
    return starts


def _tables(first: list[int], counts: list[int]) -> Int[Tensor, "num_seqs max_blocks"]:
    """Row i: blocks first[i], first[i] + 1, ... (counts[i] of them), padded with 0."""
    column = torch.arange(max(counts, default=0), dtype=torch.int32)
    first_t, counts_t = torch.tensor([first, counts], dtype=torch.int32)
    tables = first_t[:, None] + column
    return tables.masked_fill_(column >= counts_t[:, None], 0)

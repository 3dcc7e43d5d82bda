"""Bad-input fuzzing of the native torch ops (issue 37): garbage in, a ValueError out naming
the argument, never a crash, and nothing written.

`torch.ops.jax_attn.*` (jax_attn/cpu/csrc/torch_ops.cc over paged_cache.cc and
paged_decode.cc) are called directly, past `torch_backends`' Python checks, so the C++ checks
are what is tested. Each example draws a valid call of one op on small random sizes, then
breaks 0-3 things:

- store_split: a slot (int64 extremes, -2, NB * BS), the slot tensor's dtype or length, a
  tensor's dtype, rank or shape, a view that is not contiguous, a value cache that shares
  memory with the key cache, head sizes that do not fill 16 bytes;
- store_token_major (the vLLM V1 plugin's write): the same slot and tensor breaks, over the
  plugin's pages (key block then value block), pages with a gap block, or two dense caches;
  value blocks over key blocks (the same cache, or shifted by part of a block), a cache that
  is not dense inside a block, another block stride, another shape;
- copy_blocks: a block id (extremes, -1, NB), a destination given twice, the pairs' dtype or
  shape, lists of different lengths, a cache of another dtype, block shape or leading size,
  destination caches that overlap; and, valid or not, caches that are views of one buffer at
  random offsets (whole blocks, fractions of one), so sources overlap destinations in every way;
- paged_decode_split: seq_lens and block ids (extremes, boundaries), the tables' and lengths'
  dtype and shape, the output's shape or dtype, the scales' element count, kv_cache_dtype
  (unknown names, fp8 on a 2-byte cache, "auto" on uint8 bits), ALiBi slopes of another length,
  head counts that do not divide, and values that are legal but extreme (NaN / inf scale, soft
  cap and slopes, any sliding window);
- gather_split_blocks (the split cache's blocks in token-major order, for the torch half's
  prefills over a cached prefix): a block id (extremes, -1, NB), the ids' dtype or rank, outputs
  with too few blocks or another block / head shape, another dtype, a view that is not
  contiguous, outputs that share memory with a cache or with each other, a value cache of
  another shape, head sizes that do not fill 16 bytes;
- ragged_paged_attention (prefill, chunked prefill, decode and mixed steps over the token-major
  caches): the decode breaks, and query_start_loc (decreasing, past the tokens, a negative
  start), num_seqs (extremes, past the rows, its element count), seq_lens shorter than a
  sequence's queries, padding rows, the output sharing the query's memory, non-causal steps.

The verdict is predicted here from the ops' documented rules (torch_ops.cc's header,
paged_cache.h, paged_decode.h), then checked:

- predicted bad: the op raises ValueError whose message names one of the broken arguments, and
  every byte of every tensor it was given is as before;
- predicted good: it runs, and the result matches a plain torch reference (store_split,
  store_token_major, copy_blocks and gather_split_blocks bit for bit over whole buffers,
  paged_decode_split and
  ragged_paged_attention against float64 on a NaN-poisoned cache, for finite, moderate
  scales).

A crash ends the process: run long sessions in a child (`jax-attn fuzz --torch-ops`, with
`--sanitize` under ASan + UBSan, where an out-of-bounds access aborts the child). Only torch
and torch_backends are imported here (the sanitizer environment comes from
`interop.bad_metadata`, imported when asked for).
"""

import dataclasses
import math
import re
import sys
from collections import Counter

import torch

from interop import bad_input
from interop.bad_input import Report, run_for

OPS = (
    "store_split",
    "store_token_major",
    "copy_blocks",
    "gather_split_blocks",
    "paged_decode_split",
    "ragged_paged_attention",
)
SLICE_EXAMPLES = 300  # per op in the test suite (tests/torch/test_torch_ops_bad_inputs.py)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
NOT_COMPARED = "legal but extreme values: not compared"
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
NAN_BYTE = 0x7F  # a NaN in both float8 formats


@dataclasses.dataclass
class Call:
    """One op call: its arguments, the buffers every tensor argument views (all compared
    byte for byte after a refusal), and the rules it breaks (regexes one of which the error
    must match); `check(args)` judges a call that ran: None (matches the reference),
    NOT_COMPARED, or what is wrong."""

    args: list
    buffers: list
    broken: list
    check: object = None
    note: str = ""


# --------------------------------------------------------------------------------------------
# Helpers


def _int(gen: torch.Generator, low: int, high: int) -> int:
    """An int in [low, high)."""
    return int(torch.randint(low, high, (1,), generator=gen))


def _pick(gen: torch.Generator, choices):
    return choices[_int(gen, 0, len(choices))]


def _chance(gen: torch.Generator, p: float) -> bool:
    return float(torch.rand(1, generator=gen)) < p


def _garbage(gen: torch.Generator, limit: int, *, bits: int = 64) -> int:
    """A bad-looking index: the type's extremes, the boundaries around [0, limit), or random."""
    lo, hi = (INT64_MIN, INT64_MAX) if bits == 64 else (INT32_MIN, INT32_MAX)
    choices = [lo, hi, -1, -2, limit, limit + 1, 10**8, -(10**8)]
    if _chance(gen, 0.3):
        return _int(gen, -(2**31), 2**31)
    return _pick(gen, choices)


def _random(gen: torch.Generator, shape, dtype: torch.dtype) -> torch.Tensor:
    """Random values of `dtype` (uint8: float8 e4m3 bit patterns of normal draws)."""
    x = torch.randn(shape, generator=gen)
    if dtype == torch.uint8:
        return x.to(torch.float8_e4m3fn).view(torch.uint8)
    return x.to(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # A fresh row-major copy: `contiguous()` keeps a size-1 dimension's odd stride, which
    # `view(torch.uint8)` refuses.
    dense = torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t.detach())
    return dense.reshape(-1).view(torch.uint8)


def _noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values in a view that is not contiguous (every other element of a buffer)."""
    wide = torch.empty((*t.shape, 2), dtype=t.dtype)
    wide[..., 0] = t
    return wide[..., 0]


def _break_tensor(gen, t: torch.Tensor, name: str, kinds: Counter) -> torch.Tensor:
    """`t` broken one way: another dtype, another rank, or a view that is not contiguous.
    (Not another device: a meta tensor among CPU ones dispatches to the fake kernel, before
    the op's checks, and this machine has no other.)"""
    how = _pick(gen, ["dtype", "rank", "noncontiguous"])
    kinds[f"{name}-{how}"] += 1
    if how == "dtype":
        other = _pick(gen, [torch.float64, torch.int32, torch.int64, torch.float16, torch.uint8])
        if other == t.dtype:
            other = torch.float32 if t.dtype != torch.float32 else torch.bfloat16
        return t.to(other)
    if how == "rank" or t.numel() <= 1:
        return t.reshape(-1) if t.dim() != 1 else t.reshape(1, -1)
    return _noncontiguous(t)


def _token_rows_ok(rows: torch.Tensor) -> bool:
    """torch_ops.cc's `token_stride` rule for rows [tokens, heads, head_size]: on the CPU, and
    contiguous or with each token's heads dense and tokens at least heads * head_size apart (a
    token-strided view whose rows are one element each, Hkv = D = 1, keeps it)."""
    if rows.device.type != "cpu":
        return False
    if rows.numel() == 0 or rows.is_contiguous():
        return True
    _, heads, size = rows.shape
    dense = (size <= 1 or rows.stride(2) == 1) and (heads <= 1 or rows.stride(1) == size)
    stride = heads * size if rows.shape[0] <= 1 else rows.stride(0)
    return dense and stride >= heads * size


def _rows_broken(key: torch.Tensor, value: torch.Tensor) -> list:
    """A cache write's key and value rows that break the op's token_stride rule (named)."""
    return [re.escape(name) for x, name in ((key, "key"), (value, "value"))
            if not _token_rows_ok(x)]  # fmt: skip


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes of two CPU tensors overlap (the views here are contiguous)."""
    if a.device.type != "cpu" or b.device.type != "cpu" or not a.numel() or not b.numel():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


def _cpu_contiguous(named: list, broken: list) -> bool:
    """Append the device / contiguity rule of each (tensor, name); True if all hold."""
    ok = True
    for t, name in named:
        if t.device.type != "cpu" or not t.is_contiguous():
            broken.append(re.escape(name))
            ok = False
    return ok


# --------------------------------------------------------------------------------------------
# store_split and store_token_major: the breaks they share


def _break_row_args(gen, kind: str, args: dict, slots, num_slots: int, kinds: Counter) -> bool:
    """One break of a cache write's rows and slots (kind "slot": a garbage slot value;
    "slot-tensor": the slots' dtype, length or rank; "tensor": any argument's dtype, rank or
    contiguity), in place in `args`; False for the other kinds (or a slot break with nothing
    to break), which the caller handles."""
    sm = args["slot_mapping"]  # (what the other breaks left of it)
    if kind == "slot" and sm.numel() and sm.dtype in (torch.int64, torch.int32):
        kinds["slot"] += 1
        bits = 64 if sm.dtype == torch.int64 else 32
        sm.view(-1)[_int(gen, 0, sm.numel())] = _garbage(gen, num_slots, bits=bits)
    elif kind == "slot-tensor":
        kinds["slot-tensor"] += 1
        how = _pick(gen, ["int32", "length", "2-d"])
        args["slot_mapping"] = {"int32": slots.to(torch.int32),
                                "length": torch.cat([slots, slots[:1] * 0]),
                                "2-d": slots.reshape(1, -1)}[how]  # fmt: skip
    elif kind == "tensor":
        name = _pick(gen, list(args))
        args[name] = _break_tensor(gen, args[name], name, kinds)
    else:
        return False
    return True


# --------------------------------------------------------------------------------------------
# store_split


def draw_store(gen: torch.Generator, kinds: Counter) -> Call:
    dtype = _pick(gen, [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
    x = 16 // torch.tensor([], dtype=dtype).element_size()
    hkv, bs, nb = _pick(gen, [0, 1, 2, 3]), _pick(gen, [1, 2, 5, 16]), _pick(gen, [1, 3, 6])
    d = x * _pick(gen, [0, 1, 2, 3, 8])
    if _chance(gen, 0.1):
        d += _pick(gen, [1, x // 2 or 1])  # rows that do not fill whole 16-byte vectors
        kinds["head_size-not-x"] += 1
    t = _pick(gen, [0, 1, 5, 17])
    dx = d * torch.tensor([], dtype=dtype).element_size() // 16  # the op's D / x (floored)
    kv = _random(gen, (2, nb, hkv * max(dx * x, d) * bs), dtype)
    buffers = [kv]
    key_cache = kv[0].view(-1)[: nb * hkv * dx * bs * x].view(nb, hkv, dx, bs, x)
    value_cache = kv[1].view(-1)[: nb * hkv * d * bs].view(nb, hkv, d, bs)
    rows = _random(gen, (2, t, hkv, d), dtype)
    buffers.append(rows)
    key, value = rows[0], rows[1]
    num_slots = nb * bs
    slots = torch.randint(-1, num_slots, (t,), generator=gen)
    if t > 1 and _chance(gen, 0.3):
        slots[-1] = slots[0]  # a slot given twice: the later row wins
    buffers.append(slots)
    args = {"key": key, "value": value, "key_cache": key_cache, "value_cache": value_cache,
            "slot_mapping": slots}  # fmt: skip
    for _ in range(_pick(gen, [0, 1, 1, 2, 3])):
        kind = _pick(gen, ["slot", "slot", "slot-tensor", "tensor", "alias", "shape"])
        if _break_row_args(gen, kind, args, slots, num_slots, kinds):
            continue
        if kind == "alias" and nb * hkv * d * bs > 0:
            kinds["caches-share-memory"] += 1
            args["value_cache"] = kv[0].view(-1)[: nb * hkv * d * bs].view(nb, hkv, d, bs)
        elif kind == "shape":
            kinds["cache-shape"] += 1
            args["key_cache"] = key_cache.reshape(nb * bs, hkv, dx, 1, x)  # block size 1
    call = Call(list(args.values()), buffers, _store_rules(args))
    if not call.broken:
        # reference: the rows written in token order into a copy of the cache buffer
        # reference: the rows written in token order into copies of the caches passed (a
        # cache given another dtype and back is a copy of the buffer: that copy is written)
        kc, vc = args["key_cache"].clone(), args["value_cache"].clone()
        block_size = kc.shape[3]
        for i, slot in enumerate(args["slot_mapping"].tolist()):
            if slot >= 0:
                b, o = divmod(slot, block_size)
                kc[b, :, :, o, :] = args["key"][i].reshape(kc.shape[1], kc.shape[2], kc.shape[4])
                vc[b, :, :, o] = args["value"][i]

        def check(a, kc=kc, vc=vc) -> str | None:
            if not (
                torch.equal(_bytes(a[2]), _bytes(kc)) and torch.equal(_bytes(a[3]), _bytes(vc))
            ):
                return "the caches differ from the reference write"
            return None

        call.check = check
    return call


def _store_rules(a: dict) -> list:
    """The rules store_split's arguments break (regexes of the errors that may name them)."""
    broken = []
    key, value, kc, vc, slots = (a[n] for n in ("key", "value", "key_cache", "value_cache",
                                                "slot_mapping"))  # fmt: skip
    if key.dim() != 3:
        broken.append("key must be")
    if value.shape != key.shape:
        broken.append("value")
    if kc.dim() != 5 or vc.dim() != 4:
        broken.append("key_cache must be")
    if broken:
        return broken
    # The caches and slots contiguous; key and value by the op's token_stride rule (a
    # token-strided view of one-element rows, Hkv = D = 1, is valid: _token_rows_ok).
    _cpu_contiguous([(kc, "key_cache"), (vc, "value_cache"), (slots, "slot_mapping")], broken)
    broken += _rows_broken(key, value)
    if broken:
        return broken
    if _shares_memory(kc, vc):
        return ["key_cache and value_cache must not share memory"]
    if any(t.dtype != kc.dtype for t in (key, value, vc)):
        broken.append("must have one dtype")
    t, hkv, d = key.shape
    es = kc.element_size()
    nb, bs = kc.shape[0], kc.shape[3]
    key_shape, value_shape = (nb, hkv, d * es // 16, bs, 16 // es), (nb, hkv, d, bs)
    if tuple(kc.shape) != key_shape or tuple(vc.shape) != value_shape:
        broken.append("caches")
    if slots.dim() != 1 or slots.shape[0] != t or slots.dtype != torch.int64:
        broken.append("slot_mapping must be int64")
    if broken:
        return broken
    bad = [i for i, s in enumerate(slots.tolist()) if not -1 <= s < nb * bs]
    if bad:
        return [rf"slot_mapping\[{bad[0]}\]"]
    if d * es % 16 != 0:
        return ["head_size"]
    if es not in (1, 2, 4):
        return ["element size"]
    return []


# --------------------------------------------------------------------------------------------
# store_token_major


def draw_store_tm(gen: torch.Generator, kinds: Counter) -> Call:
    dtype = _pick(gen, [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
    hkv, bs, nb = _pick(gen, [0, 1, 2, 3]), _pick(gen, [1, 2, 5, 16]), _pick(gen, [1, 2, 3, 6])
    d, t = _pick(gen, [0, 1, 3, 8, 16]), _pick(gen, [0, 1, 5, 17])
    # The caches: the plugin's pages [NB, 2, BS, Hkv, D] (key block, value block), pages with
    # a gap block between them, or two dense caches.
    layout = _pick(gen, ["pages", "pages", "gap", "dense"])
    kinds[f"layout-{layout}"] += 1
    if layout == "dense":
        buf = _random(gen, (2, nb, bs, hkv, d), dtype)
        key_cache, value_cache = buf[0], buf[1]
    else:
        buf = _random(gen, (nb, 3 if layout == "gap" else 2, bs, hkv, d), dtype)
        key_cache, value_cache = buf[:, 0], buf[:, -1]
    rows = _random(gen, (2, t, hkv, d), dtype)
    slots = torch.randint(-1, nb * bs, (t,), generator=gen)
    if t > 1 and _chance(gen, 0.3):
        slots[-1] = slots[0]  # a slot given twice: the later row wins
    args = {"key": rows[0], "value": rows[1], "key_cache": key_cache,
            "value_cache": value_cache, "slot_mapping": slots}  # fmt: skip
    for _ in range(_pick(gen, [0, 1, 1, 2, 3])):
        kind = _pick(gen, ["slot", "slot", "slot-tensor", "tensor", "alias", "layout"])
        if _break_row_args(gen, kind, args, slots, nb * bs, kinds):
            continue
        if kind == "alias":
            # value blocks over key blocks: the same cache, or shifted by part of a block
            kinds["caches-overlap"] += 1
            flat = buf.reshape(-1)
            shift = _pick(gen, [0, 1, d, hkv * d, bs * hkv * d // 2])
            kc = args["key_cache"]
            if kc.dtype == buf.dtype and kc.dim() == 4 and kc.data_ptr() == buf.data_ptr():
                need = shift + (nb - 1) * kc.stride(0) + bs * hkv * d if nb else 0
                if need <= flat.numel():
                    args["value_cache"] = flat.as_strided(kc.shape, kc.stride(), shift)
        elif kind == "layout":
            how = _pick(gen, ["transposed", "stride", "shape"])
            kinds[f"cache-{how}"] += 1
            name = _pick(gen, ["key_cache", "value_cache"])
            c = args[name]
            if c.dim() != 4:
                continue
            if how == "transposed":  # not dense inside a block
                args[name] = c.transpose(1, 2).contiguous().transpose(1, 2)
            elif how == "stride":  # a dense copy: another block stride than the other's
                args[name] = c.contiguous() if layout != "dense" else c.clone()[:, :, :, :]
            else:
                args[name] = c.reshape(c.shape[0] * c.shape[1], 1, *c.shape[2:])
    call = Call(list(args.values()), [buf, rows, slots], _store_tm_rules(args))
    if not call.broken:
        call.check = _store_tm_reference(args, buf)
    return call


def _store_tm_reference(a: dict, buf: torch.Tensor):
    """The rows written in token order into copies: of `buf` where a cache views it (so the
    rest of it, a gap block included, must be as before), else of the cache."""
    ref_buf = buf.clone()
    refs = []
    for name in ("key_cache", "value_cache"):
        c = a[name]
        if c.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr():
            refs.append(ref_buf.as_strided(c.shape, c.stride(), c.storage_offset()))
        else:
            refs.append(c.clone())
    try:
        bs = a["key_cache"].shape[1]
        for i, slot in enumerate(a["slot_mapping"].tolist()):
            if slot >= 0:
                b, o = divmod(slot, bs)
                refs[0][b, o] = a["key"][i]
                refs[1][b, o] = a["value"][i]
    except (IndexError, RuntimeError, TypeError) as e:  # a wrong prediction: a failure
        problem = f"the reference cannot take a call predicted valid: {e}"
        return lambda args, problem=problem: problem

    def check(args, refs=refs, ref_buf=ref_buf) -> str | None:
        if not torch.equal(_bytes(buf), _bytes(ref_buf)):
            return "the cache buffer differs from the reference write"
        for got, want in zip(args[2:4], refs, strict=True):
            if not torch.equal(_bytes(got), _bytes(want)):
                return "a cache differs from the reference write"
        return None

    return check


def _store_tm_rules(a: dict) -> list:
    """The rules store_token_major's arguments break, in the order torch_ops.cc checks them
    (regexes of the error that names the first)."""
    key, value, kc, vc, slots = (a[n] for n in ("key", "value", "key_cache", "value_cache",
                                                "slot_mapping"))  # fmt: skip
    if key.dim() != 3:
        return ["key must be"]
    if value.shape != key.shape:
        return ["value"]
    t, hkv, d = key.shape
    if kc.dim() != 4 or kc.shape[2] != hkv or kc.shape[3] != d or vc.shape != kc.shape:
        return ["key_cache and value_cache must be"]
    broken = _rows_broken(key, value)
    if not _cpu_contiguous([(slots, "slot_mapping")], broken) or broken:
        return broken
    nb, bs = kc.shape[0], kc.shape[1]
    block = bs * hkv * d
    for c, name in ((kc, "key_cache"), (vc, "value_cache")):
        dense = ((d == 1 or c.stride(3) == 1) and (hkv == 1 or c.stride(2) == d)
                 and (bs == 1 or c.stride(1) == hkv * d))  # fmt: skip
        if not dense:
            return [f"{name} must be dense"]
    stride = kc.stride(0) if nb > 1 else block
    if nb > 1 and vc.stride(0) != stride:
        return ["one block stride"]
    if nb > 1 and block and stride < block:
        return ["block stride"]
    if any(x.dtype != kc.dtype for x in (key, value, vc)):
        return ["one dtype"]
    if block and nb:
        elem = kc.element_size()
        gap = vc.data_ptr() - kc.data_ptr()
        if gap % elem:
            return ["whole number of elements"]
        if any(abs(gap // elem + m * stride) < block for m in range(-(nb - 1), nb)):
            return ["must not overlap"]
    if slots.dim() != 1 or slots.shape[0] != t or slots.dtype != torch.int64:
        return ["slot_mapping must be int64"]
    bad = [i for i, s in enumerate(slots.tolist()) if not -1 <= s < nb * bs]
    if bad:
        return [rf"slot_mapping\[{bad[0]}\]"]
    if kc.element_size() not in (1, 2, 4):
        return ["element size"]
    return []


# --------------------------------------------------------------------------------------------
# copy_blocks


def draw_copy(gen: torch.Generator, kinds: Counter) -> Call:
    dtype = _pick(gen, [torch.float32, torch.bfloat16, torch.uint8])
    block = _pick(gen, [(1,), (4,), (3, 5), (0,), (2, 8)])
    per_block = math.prod(block)
    num_copies = _pick(gen, [0, 1, 1, 2, 3])
    nb = [_pick(gen, [1, 2, 3, 6]) for _ in range(2 * num_copies)]
    # every cache a view of one buffer, at offsets in blocks (fractions too) or well apart
    shared = _chance(gen, 0.6)
    total = sum(2 * n * per_block for n in nb)
    buffer = _random(gen, (2 * total + 2 * per_block + 8,), dtype)
    caches, cursor = [], 0
    for n in nb:
        size = 2 * n * per_block
        if shared:
            start = _int(gen, 0, total + 1) if per_block else 0
        else:
            start, cursor = cursor, cursor + size
        caches.append(buffer[start : start + size].view(2, n, *block))
    dst, src = caches[:num_copies], caches[num_copies:]
    if num_copies and _chance(gen, 0.3):
        src = list(dst)  # vLLM's copy_blocks: each cache its own source
        kinds["src-is-dst"] += 1
    if num_copies > 1 and _chance(gen, 0.15):
        dst[1], src[1] = dst[0], src[0]  # one copy listed twice: done once
        kinds["copy-listed-twice"] += 1
    limit_src = min((c.shape[1] for c in src), default=4)
    limit_dst = min((c.shape[1] for c in dst), default=4)
    num_pairs = _pick(gen, [0, 1, 2, 3, 5])
    num_pairs = min(num_pairs, limit_dst) if num_copies else num_pairs
    dst_ids = torch.randperm(limit_dst, generator=gen)[:num_pairs]
    src_ids = torch.randint(0, limit_src, (len(dst_ids),), generator=gen)
    pairs = torch.stack([src_ids, dst_ids], dim=1).to(torch.int64).reshape(-1, 2)
    args = {"dst": dst, "src": src, "block_pairs": pairs}
    for _ in range(_pick(gen, [0, 1, 1, 2, 3])):
        kind = _pick(gen, ["id", "id", "twice", "pairs-tensor", "lists", "cache", "overlap"])
        if kind == "id" and len(pairs):
            kinds["block-id"] += 1
            pairs[_int(gen, 0, len(pairs)), _int(gen, 0, 2)] = _garbage(gen, limit_dst)
        elif kind == "twice" and len(pairs) > 1:
            kinds["destination-twice"] += 1
            pairs[-1, 1] = pairs[0, 1]
        elif kind == "pairs-tensor":
            kinds["pairs-tensor"] += 1
            how = _pick(gen, ["int32", "three", "1-d", "noncontiguous"])
            args["block_pairs"] = {"int32": pairs.to(torch.int32),
                                   "three": torch.cat([pairs, pairs[:, :1]], dim=1),
                                   "1-d": pairs.reshape(-1),
                                   "noncontiguous": _noncontiguous(pairs)}[how]  # fmt: skip
        elif kind == "lists" and num_copies:
            kinds["list-lengths"] += 1
            args["src"] = list(src[:-1])
        elif kind == "cache" and len(args["src"]):
            which = _pick(gen, ["dst", "src"])
            i = _int(gen, 0, len(args[which]))
            how = _pick(gen, ["dtype", "block-shape", "leading", "rank-1", "noncontiguous"])
            kinds[f"cache-{how}"] += 1
            c = args[which][i]
            intact = c.dim() == 2 + len(block) and c.shape[0] == 2 and c.is_contiguous()
            if intact and tuple(c.shape[2:]) == block and c.dtype in _SAME_SIZE:
                args[which] = list(args[which])
                args[which][i] = _break_cache(c, how, block)
        elif kind == "overlap" and num_copies > 1 and per_block:
            kinds["destinations-overlap"] += 1
            a = args["dst"][0]
            inside = 0 <= a.data_ptr() - buffer.data_ptr() < buffer.nbytes
            if a.dim() != 2 + len(block) or not a.is_contiguous() or not inside:
                continue  # already broken
            n = a.shape[1]
            start = (a.data_ptr() - buffer.data_ptr()) // buffer.element_size()
            args["dst"] = list(args["dst"])
            args["dst"][1] = buffer[start + per_block // 2 : start + per_block // 2
                                    + 2 * n * per_block].view(2, n, *block)  # fmt: skip
    call = Call([args["dst"], args["src"], args["block_pairs"]], [buffer, pairs], [])
    call.broken = _copy_rules(args)
    if not call.broken:
        expected = buffer.clone()

        def again(t: torch.Tensor) -> torch.Tensor:  # the same view of `expected`
            start = (t.data_ptr() - buffer.data_ptr()) // buffer.element_size()
            return expected[start : start + t.numel()].view(t.shape)

        p = args["block_pairs"]
        blocks = [again(s)[:, p[:, 0]].clone() for s in args["src"]]  # every source first
        for d, b in zip(args["dst"], blocks, strict=True):
            again(d)[:, p[:, 1]] = b

        def check(_args, expected=expected, buffer=buffer) -> str | None:
            if not torch.equal(_bytes(buffer), _bytes(expected)):
                return "the caches differ from the reference copy"
            return None

        call.check = check
    return call


_SAME_SIZE = {torch.float32: torch.int32, torch.bfloat16: torch.float16, torch.uint8: torch.int8}


def _break_cache(c: torch.Tensor, how: str, block: tuple) -> torch.Tensor:
    """Cache `c [2, n, *block]` broken `how`; a view of the same bytes where one exists (so
    a call that breaks both halves of a copy alike stays valid and checkable)."""
    n = c.shape[1]
    if how == "dtype":
        return c.view(_SAME_SIZE[c.dtype])
    if how == "block-shape":
        return c.reshape(2, n, 1, 1, *block)
    if how == "leading":
        return c.reshape(1, 2 * n, *block)
    if how == "rank-1":
        return c.reshape(-1)
    return _noncontiguous(c)


def _copy_rules(a: dict) -> list:
    dst, src, pairs = a["dst"], a["src"], a["block_pairs"]
    if len(dst) != len(src):
        return ["dst and src must list as many caches"]
    broken = []
    if not _cpu_contiguous([(pairs, "block_pairs")], broken):
        return broken
    if pairs.dim() != 2 or pairs.shape[1] != 2 or pairs.dtype != torch.int64:
        return ["block_pairs must be int64"]
    for i, (d, s) in enumerate(zip(dst, src, strict=True)):
        names = [(d, f"dst[{i}]"), (s, f"src[{i}]")]
        if not _cpu_contiguous(names, broken):
            return broken
        if not (d.dim() >= 2 and d.shape[0] == 2 and s.dim() == d.dim() and s.shape[0] == 2
                and d.dtype == s.dtype and d.shape[2:] == s.shape[2:]):  # fmt: skip
            return [re.escape(f"dst[{i}] and src[{i}] must be caches")]
    bad = [i for i, (sid, did) in enumerate(pairs.tolist())
           if any(not (0 <= sid < s.shape[1] and 0 <= did < d.shape[1])
                  for d, s in zip(dst, src, strict=True))]  # fmt: skip
    if bad:  # (the op names the first bad pair of the first cache where one is bad)
        return [rf"block_pairs\[({'|'.join(map(str, bad))})\]="]
    seen = {}
    for i, did in enumerate(pairs[:, 1].tolist()):
        if did in seen:
            return [rf"block_pairs\[:, 1\] has block {did} more than once"]
        seen[did] = i

    def key(d, s):
        return (
            d.data_ptr(),
            s.data_ptr(),
            d.shape[1],
            s.shape[1],
            math.prod(d.shape[2:]) * d.element_size(),
        )

    for j in range(len(dst)):
        for i in range(j):
            if key(dst[i], src[i]) != key(dst[j], src[j]) and _shares_memory(dst[i], dst[j]):
                return [rf"dst\[{i}\] and dst\[{j}\] share memory"]
    return []


# --------------------------------------------------------------------------------------------
# paged_decode_split


def _place_keys(gen, row: torch.Tensor, begin: int, n: int, bs: int, nb: int):
    """A sequence's keys [begin, n) given blocks: the table `row`'s entries for their blocks
    set to random ids in [0, nb) (in place); returns (positions, block ids, offsets)."""
    used = torch.arange(begin // bs, -(-n // bs))
    row[used] = torch.randint(0, nb, (len(used),), generator=gen, dtype=torch.int32)
    pos = torch.arange(begin, n)
    return pos, row[pos // bs].long(), pos % bs


def _break_attention_args(gen, kind: str, args: dict, query, out, index_names, kinds) -> None:
    """The breaks both attention ops' drawers share, in place in `args`: an index tensor's
    dtype, rows or rank (one of `index_names`), a tensor's dtype, rank or contiguity, a scale's
    element count or type, kv_cache_dtype, ALiBi slopes, legal but extreme scale and soft cap,
    one query head too few."""
    hq = query.shape[1]
    if kind == "index-tensor":
        name = _pick(gen, index_names)
        t = args[name]
        how = _pick(gen, ["int64", "rows", "rank"])
        rank = t.reshape(-1, 1) if t.dim() == 1 else t.reshape(-1)
        args[name] = {"int64": t.to(torch.int64), "rows": torch.cat([t, t[:1]]),
                      "rank": rank}[how]  # fmt: skip
    elif kind == "tensor":
        name = _pick(gen, ["out", "query", "key_cache", "value_cache"])
        args[name] = _break_tensor(gen, args[name], name, kinds)
    elif kind == "scale":
        name = _pick(gen, ["k_scale", "v_scale"])
        args[name] = _pick(
            gen,
            [
                torch.ones(0),
                torch.ones(2),
                torch.tensor(float("nan")),
                torch.tensor([1e300], dtype=torch.float64),
                torch.tensor([3]),
                torch.ones(1, dtype=torch.complex64),
            ],
        )
    elif kind == "kv_cache_dtype":
        args["kv_cache_dtype"] = _pick(gen, ["fp9", "", "auto", "fp8", "FP8", "fp8_e4m3"])
    elif kind == "slopes":
        args["alibi_slopes"] = _pick(gen, [torch.ones(hq + 1), torch.ones(hq).double(),
                                           torch.full((hq,), float("nan"))])  # fmt: skip
    elif kind == "extreme":
        args[_pick(gen, ["scale", "logits_soft_cap"])] = _pick(
            gen, [float("nan"), float("inf"), -float("inf"), -1.0, 1e30, -1e300]
        )
    elif kind == "heads":
        args["query"] = query[:, : max(hq - 1, 0)].contiguous()
        args["out"] = out[:, : max(hq - 1, 0)].contiguous()


def draw_decode(gen: torch.Generator, kinds: Counter) -> Call:
    qdtype = _pick(gen, [torch.float32, torch.bfloat16, torch.float16])
    kv_dtype = _pick(gen, ["auto", "auto", "fp8", "fp8_e5m2"])
    cdtype = torch.uint8 if kv_dtype in FP8 else _pick(gen, [qdtype, torch.float32])
    es = torch.tensor([], dtype=cdtype).element_size()
    x = 16 // es
    d = _pick(gen, [16, 32, 64, 80])  # multiples of every x (16 bytes of the cache's type)
    hkv, group = _pick(gen, [1, 2]), _pick(gen, [1, 3])
    hq = hkv * group
    # 128: the tile path at the lanes' block size (decode_split.h: JAX_ATTN_CPU_SPLIT_LANES=1)
    bs, nb, mb, s = _pick(gen, [1, 4, 16, 128]), _int(gen, 1, 9), _int(gen, 1, 5), _int(gen, 0, 5)
    window = _pick(gen, [0, 0, 3, 17, -5, 150, INT64_MAX, INT64_MIN])
    lens = torch.randint(0, mb * bs + 1, (s,), generator=gen).to(torch.int32)
    tables = torch.randint(INT32_MIN, INT32_MAX, (s, mb), generator=gen, dtype=torch.int64)
    tables = tables.to(torch.int32)
    # the cache all NaN but the keys some sequence reads
    kv = torch.full((2, nb, bs * hkv * d), float("nan"), dtype=torch.float32)
    kv = kv.to(cdtype) if cdtype != torch.uint8 else torch.full(kv.shape, NAN_BYTE, dtype=cdtype)
    key_cache = kv[0].view(nb, hkv, d // x, bs, x)
    value_cache = kv[1].view(nb, hkv, d, bs)
    for i in range(s):
        n = int(lens[i])
        begin = max(0, n - window) if window > 0 else 0
        pos, blocks, offsets = _place_keys(gen, tables[i], begin, n, bs, nb)
        key_cache[blocks, :, :, offsets, :] = _random(gen, (len(pos), hkv, d // x, x), cdtype)
        value_cache[blocks, :, :, offsets] = _random(gen, (len(pos), hkv, d), cdtype)
    query = _random(gen, (s, hq, d), qdtype)
    out = torch.full((s, hq, d), float("nan"), dtype=qdtype)
    slopes = (torch.rand(hq, generator=gen) * 0.5) if _chance(gen, 0.3) else None
    args = {
        "out": out, "query": query, "key_cache": key_cache, "value_cache": value_cache,
        "block_tables": tables, "seq_lens": lens, "alibi_slopes": slopes,
        "scale": _pick(gen, [0.125, 0.3, 1.0]), "k_scale": torch.tensor([_pick(gen, [1.0, 0.5])]),
        "v_scale": torch.tensor([_pick(gen, [1.0, 2.0])]), "sliding_window": window,
        "logits_soft_cap": _pick(gen, [0.0, 0.0, 30.0, 2.0]), "kv_cache_dtype": kv_dtype,
    }  # fmt: skip
    for _ in range(_pick(gen, [0, 1, 1, 2, 3])):
        kind = _pick(gen, ["seq_lens", "block_tables", "index-tensor", "tensor", "scale",
                           "kv_cache_dtype", "slopes", "extreme", "heads"])  # fmt: skip
        kinds[kind] += 1
        if kind == "seq_lens" and s:
            lens[_int(gen, 0, s)] = _garbage(gen, mb * bs + 1, bits=32)
        elif kind == "block_tables" and s:
            tables[_int(gen, 0, s), _int(gen, 0, mb)] = _garbage(gen, nb, bits=32)
        else:
            _break_attention_args(gen, kind, args, query, out, ["block_tables", "seq_lens"],
                                  kinds)  # fmt: skip
    call = Call(list(args.values()), [kv, query, out, tables, lens], _decode_rules(args))
    if not call.broken:
        call.check = lambda _args, a=args: _check_decode(a)
    return call


def _decode_rules(a: dict) -> list:
    q, out, kc, vc = a["query"], a["out"], a["key_cache"], a["value_cache"]
    tables, lens, slopes = a["block_tables"], a["seq_lens"], a["alibi_slopes"]
    if q.dim() != 3:
        return ["query must be"]
    if out.shape != q.shape or out.dtype != q.dtype:
        return ["out must have the query's shape"]
    if kc.dim() != 5:
        return ["key_cache must be"]
    if vc.dim() != 4:
        return ["value_cache must be"]
    broken = []
    names = [(out, "out"), (q, "query"), (kc, "key_cache"), (vc, "value_cache"),
             (tables, "block_tables"), (lens, "seq_lens")]  # fmt: skip
    if not _cpu_contiguous(names, broken):
        return broken
    s, hq, d = q.shape
    nb, hkv, _, bs, x = kc.shape
    if x * kc.element_size() != 16:
        return ["key_cache's last dimension"]
    if kc.shape[2] * x != d:
        return ["key_cache head_size"]
    if tuple(vc.shape) != (nb, hkv, d, bs):
        return ["value_cache"]
    if vc.dtype != kc.dtype:
        return ["value_cache dtype"]
    if tables.dim() != 2 or tables.shape[0] != s or tables.dtype != torch.int32:
        return ["block_tables must be int32"]
    if lens.dim() != 1 or lens.shape[0] != s or lens.dtype != torch.int32:
        return ["seq_lens must be int32"]
    if slopes is not None:
        if slopes.dim() != 1 or slopes.shape[0] != hq or slopes.dtype != torch.float32:
            return ["alibi_slopes must be"]
    kv_dtype = a["kv_cache_dtype"]
    if kv_dtype != "auto":
        if kc.element_size() != 1:
            return ["kv_cache_dtype="]
        if kv_dtype not in FP8:
            return ["kv_cache_dtype="]
    for name in ("k_scale", "v_scale"):
        if a[name].numel() != 1:
            return [f"{name} must hold one value"]
        if a[name].is_complex():
            return [f"{name} must be real"]
    if hkv <= 0 or hq % hkv != 0:
        return ["num_heads"]
    if hq < 1 or bs < 1:
        return ["num_heads"]
    cache_ok = kv_dtype in FP8 or kc.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if not cache_ok or not 1 <= d <= 256:
        return ["key_cache dtype|head_size"]
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return ["query dtype"]
    if d % x != 0:
        return ["head_size"]
    mb, window = tables.shape[1], a["sliding_window"]
    for i in range(s):
        n = int(lens[i])
        if not 0 <= n <= mb * bs:
            return [rf"seq_lens\[{i}\]"]
        begin = max(0, n - window) if window > 0 else 0
        for b in range(begin // bs, -(-n // bs)):
            if not 0 <= int(tables[i, b]) < nb:
                return [rf"block_tables\[{i}, {b}\]"]
    return []


def _dequantize(cache: torch.Tensor, kv_dtype: str, scale: float) -> torch.Tensor:
    if kv_dtype in FP8:
        cache = cache.view(FP8[kv_dtype])
    return cache.double() * scale


def _comparable(a: dict) -> bool:
    """Whether an attention call that ran is compared with float64: finite, moderate scales,
    soft cap and slopes, and logits of the size the tolerance rows are set for (else running
    without a crash is all that is asked). The draws' queries and keys are normal, so a logit's
    typical size is |scale * k_scale| * sqrt(D); at most 10 here (every draw without a scale
    mutation: 1.0 * sqrt(96) = 9.8). Above it, a float32 logit's rounding moves the output
    past float32's absolute row: k_scale 3 at scale 1 and D 96 (logits ~29) gave 5.4e-5
    against 3.2e-5 (seed 29, example 320358)."""
    scale, cap, slopes = a["scale"], a["logits_soft_cap"], a["alibi_slopes"]
    k_scale, v_scale = float(a["k_scale"].reshape(-1)[0]), float(a["v_scale"].reshape(-1)[0])
    moderate = all(1 / 16 <= v <= 16 for v in (k_scale, v_scale))
    finite = math.isfinite(scale) and abs(scale) < 1e3 and math.isfinite(cap) and cap < 1e3
    if not (moderate and finite and (slopes is None or bool(slopes.isfinite().all()))):
        return False
    return abs(scale * k_scale) * math.sqrt(a["query"].shape[-1]) <= 10.0


def _against_float64(a: dict, want: torch.Tensor) -> str | None:
    """None, or how `a["out"]` differs from the float64 `want` beyond the one tolerance rule
    (interop.tolerances): the query's dtype over the cache's (fp8 by its kv_cache_dtype). A
    fixed 5e-2 refused bf16 outputs of magnitude ~20 off by less than half their ulp (0.0625
    there)."""
    from interop.tolerances import bound_ratio

    out = a["out"]
    dtypes = (out.dtype, FP8.get(a["kv_cache_dtype"], a["key_cache"].dtype))
    ratio = bound_ratio(out.double().numpy(), want.numpy(), *dtypes) if out.numel() else 0.0
    if not ratio <= 1.0:  # NaN and inf fail too
        err = float((out.double() - want).abs().max())
        return f"output differs from float64 attention by {err:.3g} ({ratio:.3g} x the bound)"
    return None


def _check_decode(a: dict) -> str | None:
    """None, or how the output differs from float64 attention over the visible keys."""
    scale, cap, slopes = a["scale"], a["logits_soft_cap"], a["alibi_slopes"]
    k_scale, v_scale = float(a["k_scale"].reshape(-1)[0]), float(a["v_scale"].reshape(-1)[0])
    if not _comparable(a):
        return NOT_COMPARED  # running without a crash is all that is asked
    q = a["query"].double()
    s, hq, d = q.shape
    nb, hkv, _, bs, _ = a["key_cache"].shape
    keys = _dequantize(a["key_cache"], a["kv_cache_dtype"], k_scale)
    keys = keys.permute(0, 3, 1, 2, 4).reshape(nb, bs, hkv, d)  # [NB, BS, Hkv, D]
    values = _dequantize(a["value_cache"], a["kv_cache_dtype"], v_scale).permute(0, 3, 1, 2)
    want = torch.zeros(s, hq, d, dtype=torch.float64)
    window = a["sliding_window"]
    for i in range(s):
        n = int(a["seq_lens"][i])
        begin = max(0, n - window) if window > 0 else 0
        if n <= begin:
            continue
        pos = torch.arange(begin, n)
        blocks = a["block_tables"][i, pos // bs].long()
        k = keys[blocks, pos % bs].repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
        v = values[blocks, pos % bs].repeat_interleave(hq // hkv, dim=1)
        logits = torch.einsum("hd,lhd->hl", q[i], k) * scale
        if cap > 0:
            logits = cap * torch.tanh(logits / cap)
        if slopes is not None:
            logits = logits + slopes.double()[:, None] * (pos - (n - 1)).double()[None, :]
        want[i] = torch.einsum("hl,lhd->hd", torch.softmax(logits, dim=-1), v)
    return _against_float64(a, want)


# --------------------------------------------------------------------------------------------
# ragged_paged_attention


def draw_ragged(gen: torch.Generator, kinds: Counter) -> Call:
    """A ragged step over token-major caches `[NB, BS, Hkv, D]` (NaN but the keys a sequence
    reads): sequences of q_len 0..9 over seq_len >= q_len keys, then padding rows."""
    qdtype = _pick(gen, [torch.float32, torch.bfloat16, torch.float16])
    kv_dtype = _pick(gen, ["auto", "auto", "fp8", "fp8_e5m2"])
    cdtype = torch.uint8 if kv_dtype in FP8 else _pick(gen, [qdtype, torch.float32])
    d = _pick(gen, [16, 32, 64, 80, 96])
    hkv, group = _pick(gen, [1, 2]), _pick(gen, [1, 3, 4])
    hq = hkv * group
    bs, nb, mb = _pick(gen, [1, 4, 16]), _int(gen, 1, 9), _int(gen, 1, 5)
    rows = _int(gen, 0, 5)
    num_seqs = _int(gen, 0, rows + 1)
    window = _pick(gen, [0, 0, 3, 17, -5, INT64_MAX, INT64_MIN])
    causal = _chance(gen, 0.8)
    q_lens = [_pick(gen, [0, 1, 1, 2, 5, 9]) for _ in range(rows)]
    lens = torch.tensor([_int(gen, q, mb * bs + 1) if q <= mb * bs else mb * bs
                         for q in q_lens], dtype=torch.int32).reshape(rows)  # fmt: skip
    q_lens = [min(q, int(n)) for q, n in zip(q_lens, lens.tolist(), strict=True)]
    pad = _int(gen, 0, 3)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    tokens = starts[-1] + pad
    qsl = torch.tensor(starts, dtype=torch.int32)
    tables = torch.randint(INT32_MIN, INT32_MAX, (rows, mb), generator=gen, dtype=torch.int64)
    tables = tables.to(torch.int32)
    shape = (nb, bs, hkv, d)
    if cdtype == torch.uint8:
        key_cache = torch.full(shape, NAN_BYTE, dtype=cdtype)
    else:
        key_cache = torch.full(shape, float("nan"), dtype=cdtype)
    value_cache = key_cache.clone()
    for i in range(num_seqs):  # a real sequence's blocks: ids in range, its keys finite
        n = int(lens[i])
        _, blocks, offsets = _place_keys(gen, tables[i], 0, n, bs, nb)
        key_cache[blocks, offsets] = _random(gen, (n, hkv, d), cdtype)
        value_cache[blocks, offsets] = _random(gen, (n, hkv, d), cdtype)
    query = _random(gen, (tokens, hq, d), qdtype)
    out = torch.full((tokens, hq, d), float("nan"), dtype=qdtype)
    slopes = (torch.rand(hq, generator=gen) * 0.5) if _chance(gen, 0.3) else None
    args = {
        "out": out, "query": query, "key_cache": key_cache, "value_cache": value_cache,
        "query_start_loc": qsl, "seq_lens": lens, "block_tables": tables,
        "num_seqs": torch.tensor([num_seqs], dtype=torch.int32), "alibi_slopes": slopes,
        "scale": _pick(gen, [0.125, 0.3, 1.0]), "causal": causal, "sliding_window": window,
        "logits_soft_cap": _pick(gen, [0.0, 0.0, 30.0, 2.0]),
        "k_scale": torch.tensor([_pick(gen, [1.0, 0.5])]),
        "v_scale": torch.tensor([_pick(gen, [1.0, 2.0])]), "kv_cache_dtype": kv_dtype,
        "sinks": (torch.randn(hq, generator=gen) * 3.0) if _chance(gen, 0.3) else None,
    }  # fmt: skip
    for _ in range(_pick(gen, [0, 1, 1, 2, 3])):
        kind = _pick(gen, ["seq_lens", "block_tables", "query_start_loc", "num_seqs",
                           "index-tensor", "tensor", "scale", "kv_cache_dtype", "slopes",
                           "extreme", "heads", "aliased-out", "sinks"])  # fmt: skip
        kinds[kind] += 1
        if kind == "seq_lens" and rows:
            i = _int(gen, 0, rows)
            lens[i] = _pick(gen, [_garbage(gen, mb * bs + 1, bits=32), max(q_lens[i] - 1, -1)])
        elif kind == "block_tables" and rows:
            tables[_int(gen, 0, rows), _int(gen, 0, mb)] = _garbage(gen, nb, bits=32)
        elif kind == "query_start_loc":
            qsl[_int(gen, 0, rows + 1)] = _pick(
                gen, [_garbage(gen, tokens + 1, bits=32), tokens + 1, -1, 0]
            )
        elif kind == "num_seqs":
            args["num_seqs"] = _pick(gen, [torch.tensor([rows + 1], dtype=torch.int32),
                                           torch.tensor([-1], dtype=torch.int32),
                                           torch.tensor([INT32_MIN], dtype=torch.int32),
                                           torch.tensor([1, 1], dtype=torch.int32),
                                           torch.tensor([num_seqs])])  # fmt: skip
        elif kind == "aliased-out" and tokens:
            args["out"] = args["query"]
        elif kind == "sinks":
            args["sinks"] = _pick(gen, [torch.ones(hq + 1), torch.ones(hq).double(),
                                        torch.ones(2 * hq)[::2], torch.ones(1, hq)])  # fmt: skip
        elif kind != "aliased-out":
            _break_attention_args(
                gen, kind, args, query, out, ["block_tables", "seq_lens", "query_start_loc"], kinds
            )
    buffers = [key_cache, value_cache, query, out, tables, lens, qsl]
    call = Call(list(args.values()), buffers, _ragged_rules(args))
    if not call.broken:
        call.check = lambda _args, a=args: _check_ragged(a)
    return call


def _ragged_rules(a: dict) -> list:
    """The first rule a ragged call breaks, in the order torch_ops.cc and the kernel's
    check_args / check_metadata test them (ragged_paged_attention.h)."""
    q, out, kc, vc = a["query"], a["out"], a["key_cache"], a["value_cache"]
    qsl, lens, tables, ns = a["query_start_loc"], a["seq_lens"], a["block_tables"], a["num_seqs"]
    slopes = a["alibi_slopes"]
    if q.dim() != 3:
        return ["query must be"]
    if out.shape != q.shape or out.dtype != q.dtype:
        return ["out must have the query's shape"]
    if kc.dim() != 4 or kc.shape[3] != q.shape[2]:
        return ["key_cache must be"]
    if vc.shape != kc.shape:
        return ["value_cache"]
    if vc.dtype != kc.dtype:
        return ["value_cache dtype"]
    broken = []
    names = [(out, "out"), (q, "query"), (kc, "key_cache"), (vc, "value_cache"),
             (qsl, "query_start_loc"), (lens, "seq_lens"), (tables, "block_tables"),
             (ns, "num_seqs")]  # fmt: skip
    if not _cpu_contiguous(names, broken):
        return broken
    for t, name in ((q, "query"), (kc, "key_cache"), (vc, "value_cache")):
        if _shares_memory(out, t):
            return [f"out must not share memory with {name}"]
    if tables.dim() != 2 or tables.dtype != torch.int32:
        return ["block_tables must be int32"]
    rows = tables.shape[0]
    if lens.dim() != 1 or lens.shape[0] != rows or lens.dtype != torch.int32:
        return ["seq_lens must be int32"]
    if qsl.dim() != 1 or qsl.shape[0] != rows + 1 or qsl.dtype != torch.int32:
        return ["query_start_loc must be int32"]
    if ns.numel() != 1 or ns.dtype != torch.int32:
        return ["num_seqs must be one int32"]
    tokens, hq, d = q.shape
    nb, bs, hkv, _ = kc.shape
    if slopes is not None:
        if slopes.dim() != 1 or slopes.shape[0] != hq or slopes.dtype != torch.float32:
            return ["alibi_slopes must be"]
    sinks = a["sinks"]
    if sinks is not None:
        if sinks.dim() != 1 or sinks.shape[0] != hq or sinks.dtype != torch.float32:
            return ["sinks must be float32"]
        if not _cpu_contiguous([(sinks, "sinks")], broken):
            return broken
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return ["query dtype"]
    kv_dtype = a["kv_cache_dtype"]
    if kv_dtype != "auto":
        if kc.element_size() != 1 or kv_dtype not in FP8:
            return ["kv_cache_dtype="]
    elif kc.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                          torch.float8_e5m2):  # fmt: skip
        return ["key_cache dtype"]
    for name in ("k_scale", "v_scale"):
        if a[name].numel() != 1:
            return [f"{name} must hold one value"]
        if a[name].is_complex():
            return [f"{name} must be real"]
    # the kernel's check_args
    if hq < 1 or d < 1 or bs < 1:
        return ["num_heads=.* must all be >= 1"]
    if hkv < 1 or hq % hkv != 0:
        return ["num_heads=.* must be divisible"]
    if d > 512:  # kMaxHeadSize (the ragged kernel's)
        return ["head_size=.* must be at most"]
    # check_metadata
    num_seqs = int(ns.reshape(-1)[0])
    if not 0 <= num_seqs <= rows:
        return [rf"num_seqs={num_seqs} must be in"]
    if not 0 <= int(qsl[0]) <= tokens:
        return [r"query_start_loc\[0\]"]
    mb = tables.shape[1]
    for i in range(num_seqs):
        start, end, n = int(qsl[i]), int(qsl[i + 1]), int(lens[i])
        if end < start:
            return ["query_start_loc must be non-decreasing"]
        if end > tokens:
            return [rf"query_start_loc\[{i + 1}\]=.* is beyond"]
        if n < end - start or n > mb * bs:
            return [rf"seq_lens\[{i}\]"]
        for b in range(-(-n // bs)):
            if not 0 <= int(tables[i, b]) < nb:
                return [rf"block_tables\[{i}, {b}\]"]
    return []


def _check_ragged(a: dict) -> str | None:
    """None, or how the output differs from float64 attention (rows outside the real
    sequences, and rows that see no key, zeros)."""
    scale, cap, slopes = a["scale"], a["logits_soft_cap"], a["alibi_slopes"]
    k_scale, v_scale = float(a["k_scale"].reshape(-1)[0]), float(a["v_scale"].reshape(-1)[0])
    if not _comparable(a):
        return NOT_COMPARED  # running without a crash is all that is asked
    kv_dtype, kc = a["kv_cache_dtype"], a["key_cache"]
    # The op applies the scales it is given to any cache (torch_backends.native passes 1.0
    # for a float cache, vLLM's rule).
    keys = _dequantize(kc, kv_dtype, k_scale)
    values = _dequantize(a["value_cache"], kv_dtype, v_scale)
    q = a["query"].double()
    tokens, hq, d = q.shape
    _, bs, hkv, _ = kc.shape
    want = torch.zeros(tokens, hq, d, dtype=torch.float64)
    qsl, lens, tables = a["query_start_loc"], a["seq_lens"], a["block_tables"]
    window, causal = a["sliding_window"], a["causal"]
    for i in range(int(a["num_seqs"].reshape(-1)[0])):
        start, end, n = int(qsl[i]), int(qsl[i + 1]), int(lens[i])
        if end == start or n == 0:
            continue
        pos = torch.arange(n)
        blocks = tables[i, pos // bs].long()
        k = keys[blocks, pos % bs].repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
        v = values[blocks, pos % bs].repeat_interleave(hq // hkv, dim=1)
        q_pos = torch.arange(n - (end - start), n)  # the queries: the last q_len positions
        logits = torch.einsum("thd,lhd->thl", q[start:end], k) * scale
        if cap > 0:
            logits = cap * torch.tanh(logits / cap)
        rel = (pos[None, :] - q_pos[:, None]).double()  # [q, n]: p_k - p_q
        if slopes is not None:
            logits = logits + slopes.double()[None, :, None] * rel[:, None, :]
        seen = torch.ones_like(rel, dtype=torch.bool)
        if causal:
            seen &= rel <= 0
        if window > 0:
            seen &= rel > -window
        logits = logits.masked_fill(~seen[:, None, :], -math.inf)
        if a["sinks"] is not None:  # one more logit per head, for a key with no value
            sink = a["sinks"].double()[None, :, None].expand(end - start, hq, 1)
            logits = torch.cat([logits, sink], dim=-1)
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # rows seeing no key: zeros
        want[start:end] = torch.einsum("thl,lhd->thd", probs[..., :n], v)
    return _against_float64(a, want)


# --------------------------------------------------------------------------------------------
# gather_split_blocks


def draw_gather(gen: torch.Generator, kinds: Counter) -> Call:
    dtype = _pick(gen, [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
    es = torch.tensor([], dtype=dtype).element_size()
    x = 16 // es
    hkv, bs, nb = _pick(gen, [0, 1, 2, 3]), _pick(gen, [1, 2, 5, 16]), _pick(gen, [1, 3, 6])
    dx = _pick(gen, [0, 1, 2, 3, 8])  # 16-byte pieces per head
    n = _pick(gen, [0, 1, 2, 5])
    kv = _random(gen, (2, nb, hkv * dx * x * bs), dtype)
    key_cache = kv[0].view(nb, hkv, dx, bs, x)
    value_cache = kv[1].view(nb, hkv, dx * x, bs)
    ids = torch.randint(0, nb, (n,), generator=gen)
    spare = _pick(gen, [0, 0, 1, 3])  # output blocks past the ids: left as they are
    out = _random(gen, (2, n + spare, bs, hkv, dx * x), dtype)
    buffers = [kv, ids, out]
    args = {"key_cache": key_cache, "value_cache": value_cache, "block_ids": ids,
            "keys": out[0], "values": out[1]}  # fmt: skip
    for _ in range(_pick(gen, [0, 1, 1, 2, 3])):
        kind = _pick(gen, ["id", "id", "ids-tensor", "tensor", "alias", "shape"])
        if kind == "id" and args["block_ids"].numel() and args["block_ids"].dtype in (
            torch.int64, torch.int32
        ):  # fmt: skip
            kinds["id"] += 1
            bits = 64 if args["block_ids"].dtype == torch.int64 else 32
            t = args["block_ids"].view(-1)
            t[_int(gen, 0, t.numel())] = _garbage(gen, nb, bits=bits)
        elif kind == "ids-tensor":
            kinds["ids-tensor"] += 1
            how = _pick(gen, ["int32", "2-d"])
            args["block_ids"] = ids.to(torch.int32) if how == "int32" else ids.reshape(1, -1)
        elif kind == "tensor":
            name = _pick(gen, list(args))
            args[name] = _break_tensor(gen, args[name], name, kinds)
        elif kind == "alias":
            kinds["outputs-share-memory"] += 1
            target = _pick(gen, ["keys", "cache"])
            if target == "keys":
                args["values"] = args["keys"]
            elif hkv * dx * x * bs and nb >= n + spare:
                args["keys"] = (
                    kv[0]
                    .view(-1)[: (n + spare) * bs * hkv * dx * x]
                    .view(n + spare, bs, hkv, dx * x)
                )
        elif kind == "shape":
            kinds["shape"] += 1
            how = _pick(gen, ["value-cache", "too-few", "block"])
            if how == "value-cache":
                args["value_cache"] = value_cache.reshape(nb, 1, hkv * dx * x, bs)
            elif how == "too-few" and n:
                args["keys"] = out[0][: n - 1]
            else:
                args["values"] = out[1].reshape(n + spare, 1, bs * hkv, dx * x)
    call = Call(list(args.values()), buffers, _gather_rules(args))
    if not call.broken:
        a = args
        want_k, want_v = a["keys"].clone(), a["values"].clone()
        ids_ = a["block_ids"].long()
        k = a["key_cache"].permute(0, 3, 1, 2, 4)[ids_]
        want_k[: len(ids_)] = k.reshape(len(ids_), *want_k.shape[1:])
        want_v[: len(ids_)] = a["value_cache"].permute(0, 3, 1, 2)[ids_]

        def check(args_, want_k=want_k, want_v=want_v) -> str | None:
            if not (torch.equal(_bytes(args_[3]), _bytes(want_k))
                    and torch.equal(_bytes(args_[4]), _bytes(want_v))):  # fmt: skip
                return "the gathered blocks differ from the permuted copy"
            return None

        call.check = check
    return call


def _gather_rules(a: dict) -> list:
    """The rules gather_split_blocks' arguments break, in torch_ops.cc's order."""
    kc, vc, ids, keys, values = (a[n] for n in ("key_cache", "value_cache", "block_ids", "keys",
                                                "values"))  # fmt: skip
    if kc.dim() != 5 or vc.dim() != 4:
        return ["key_cache must be"]
    broken = []
    names = [(kc, "key_cache"), (vc, "value_cache"), (ids, "block_ids"), (keys, "keys"),
             (values, "values")]  # fmt: skip
    if not _cpu_contiguous(names, broken):
        return broken
    es = kc.element_size()
    nb, hkv, bs = kc.shape[0], kc.shape[1], kc.shape[3]
    d = kc.shape[2] * kc.shape[4]
    if kc.shape[4] * es != 16:
        return ["key_cache's last dimension"]
    if tuple(vc.shape) != (nb, hkv, d, bs):
        return ["value_cache"]
    if ids.dim() != 1 or ids.dtype != torch.int64:
        return ["block_ids must be int64"]
    n = ids.shape[0]
    for t, name in ((keys, "keys"), (values, "values")):
        if t.dim() != 4 or t.shape[0] < n or tuple(t.shape[1:]) != (bs, hkv, d):
            return [f"{name} must be"]
    if any(t.dtype != kc.dtype for t in (vc, keys, values)):
        return ["must have one dtype"]
    for o, o_name in ((keys, "keys"), (values, "values")):
        for t, name in ((kc, "key_cache"), (vc, "value_cache")):
            if _shares_memory(o, t):
                return [f"{o_name} must not share memory with {name}"]
    if _shares_memory(keys, values):
        return ["keys must not share memory with values"]
    bad = [i for i, b in enumerate(ids.tolist()) if not 0 <= b < nb]
    if bad:
        return [rf"block_ids\[{bad[0]}\]"]
    if es not in (1, 2, 4):
        return ["element size"]
    return []


# --------------------------------------------------------------------------------------------
# Running

DRAW = {"store_split": draw_store, "store_token_major": draw_store_tm, "copy_blocks": draw_copy,
        "gather_split_blocks": draw_gather, "paged_decode_split": draw_decode,
        "ragged_paged_attention": draw_ragged}  # fmt: skip


def run_example(op: str, seed: int, index: int, report: Report) -> None:
    """Draw, run and judge one example; a wrong verdict is appended to report.failures."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
    call = DRAW[op](gen, report.mutations)
    # every CPU tensor the op was given, and the buffers they view: all as before if refused
    given = [t for a in call.args for t in (a if isinstance(a, list) else [a])
             if isinstance(t, torch.Tensor)]  # fmt: skip
    call.buffers = call.buffers + given
    before = [_bytes(b) for b in call.buffers]
    report.examples += 1

    def fail(what: str) -> None:
        report.failures.append((seed, index, what))

    try:
        getattr(torch.ops.jax_attn, op)(*call.args)
    except Exception as e:  # any type: judged below
        message = str(e).splitlines()[0][:400] if str(e) else type(e).__name__
        if not call.broken:
            fail(f"refused a valid call: {type(e).__name__}: {message}")
        elif not isinstance(e, ValueError):
            fail(f"{type(e).__name__} instead of ValueError: {message}")
        elif not any(re.search(rule, str(e)) for rule in call.broken):
            fail(f"error names none of {call.broken}: {message}")
        elif any(not torch.equal(b, _bytes(t)) for b, t in zip(before, call.buffers,
                                                                strict=True)):  # fmt: skip
            fail(f"refused ({message}) but wrote to its tensors")
        else:
            report.refused += 1
        return
    if call.broken:
        fail(f"ran although it breaks {call.broken}")
        return
    report.ran += 1
    problem = call.check(call.args)
    if problem == NOT_COMPARED:
        return
    if problem is not None:
        fail(problem)
        return
    report.compared += 1


def fuzz(
    op: str,
    *,
    examples: int | None = None,
    seconds: float | None = None,
    seed: int = 0,
    progress=None,
) -> Report:
    """Run `examples` examples (or until `seconds` pass) of `op` (one of OPS).
    `progress(report)` is called every 500 examples."""
    if op not in OPS:
        raise ValueError(f"{op=} must be one of {OPS}")
    bad_input.require_limit(examples, seconds)  # before the library's load (or build)
    from torch_backends import native

    reason = native.unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"the native torch ops are not available: {reason}")
    report = Report(op, "the reference")
    return run_for(
        report,
        lambda index: run_example(op, seed, index, report),
        examples=examples,
        seconds=seconds,
        progress=progress,
        every=500,
    )


def sanitizer_env(extra_flags: str = "") -> dict:
    """The ASan + UBSan child environment (`interop.bad_metadata.sanitizer_env`: the same
    flags, so the torch library's sanitized build sits beside the XLA one's)."""
    from interop import bad_metadata

    return bad_metadata.sanitizer_env(extra_flags)


def main(argv: list[str]) -> int:
    """`python -m interop.bad_torch_ops OP SECONDS SEED`: one run, progress on stdout; exit 1
    on a failure (a crash exits with the signal)."""
    return bad_input.child_main(argv, fuzz)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`check_step`: one step's metadata checked against the cache before anything is written.

vLLM's kernels trusted the metadata: a slot or block id past the cache wrote or read another
sequence's memory, a -1 in a block table read the last block, a seq_len longer than its table
read a neighbour's block. Here `PagedImpl.forward` runs every check below before the cache
write, so a bad step raises (naming the field, the rule and the value) and leaves the cache
bit-identical; a step that passes cannot fail half-way.

    slot_mapping       every entry -1 (PAD_SLOT_ID) or a slot in [0, num_blocks * block_size);
                       no slot twice in one step (which write wins would be unspecified)
    block_tables       the blocks a sequence uses, its first ceil(seq_len / block_size)
                       entries, are ids in [0, num_blocks); entries past them may hold
                       anything: they are replaced by 0 before any kernel reads the table
    seq_lens           query_len <= seq_len <= max_blocks * block_size; a decode's
                       seq_len >= 1 (the new token) and <= max_decode_seq_len
    token counts       num_prefill_tokens + num_decode_tokens == query rows (checked in
                       `forward`), the prefills' query lengths sum to num_prefill_tokens,
                       query_start_loc is their running sum, one slot per new key
    k_scale, v_scale   finite and > 0

    block_tables [[3, 7], [5, 99]], seq_lens [20, 4], block size 16: sequence 0 uses blocks
    3 and 7, sequence 1 only block 5 (its 99 is never read and becomes 0).

Cost: the tensor checks are vectorized over the metadata and read back together, one host
sync per step; the rest are Python comparisons over the per-sequence lists the plan already
holds. Details (which entry, which value) are computed only once a check has failed.
Measured (`tests/torch/measure_check_cost.py`, CPU, one thread, a shared 2-core machine): a
decode step of 32 sequences (seq_len 200..1000, Hq 32, Hkv 8, D 128) spends about 130 us in
`check_step`: 0.24% of the JAX backend's step (53 ms), 0.09% of IPEX's (159 ms).

Once per step, not per layer: every layer of a step gets the same metadata object, so
`CheckedPlans` keeps the checked plan of the last few steps for the layers after the first,
keyed by everything planning and checking read (`step_key`). With the native decode op the
checks were no longer small: TORCH_SDPA's decode of 32 x 1024 keys (fp8 cache, block 128)
took 3.02 ms a layer with them and 2.81 ms with the plan reused (2-core AMD Zen 5 VM,
5 rounds, medians; NOTES.md), the native op itself 2.7 ms.
"""

import collections
import dataclasses
import weakref
from collections.abc import Callable, Hashable
from typing import Protocol

import torch
from torch import Tensor

from torch_backends.abstract import AttentionType
from torch_backends.plan import StepPlan


class CacheGeometry(Protocol):
    """What the checks read of a `layouts.PagedCache` (a protocol: layouts imports this module)."""

    key_cache: Tensor
    block_size: int


PAD_SLOT_ID = -1


def check_step(
    plan: StepPlan,
    cache: CacheGeometry | None,
    key: Tensor | None,
    k_scale: Tensor | float = 1.0,
    v_scale: Tensor | float = 1.0,
    prefill_reads: list[int] | None = None,
) -> StepPlan:
    """Raise `ValueError` / `TypeError` if the step cannot run as described; else the plan,
    with table entries past each sequence's used blocks replaced by 0 where any is not a
    block id. `cache` is the step's `PagedCache` (None: no cache is read or written).
    `prefill_reads`: the tokens each prefill reads from the cache (default: its cached
    prefix when its new K/V are given, else all of it); its table must cover those.

    Two new keys may name the same slot only from the same position of their sequences:
    vLLM's prefix caching gives prompts of one step that share whole blocks the same slots,
    and both compute the same K/V there. Only the later write is kept (a deterministic
    last-write-wins; the plan's slot_mapping gets -1 for the earlier ones)."""
    _check_counts(plan, key)
    _check_needs(plan, cache, key)
    if cache is None:
        return plan
    num_blocks, block_size = cache.key_cache.shape[0], cache.block_size
    checks = _Checks()
    writes = key is not None and plan.slot_mapping is not None
    if writes:
        name = f"attn_metadata.{plan.fields.slot_mapping}"
        positions = _new_key_positions(plan, key.shape[0])
        kept_slots = _check_slots(
            checks, name, plan.slot_mapping, key.shape[0], num_blocks, block_size, positions
        )
    # A prefill reads from the cache only what it is not given: its cached prefix (none for a
    # plain prefill, nor for cross attention's first step), or everything when key is None.
    # Rows past what is read may be empty or zero-padded, as vLLM's runners build them.
    if prefill_reads is None:
        prefill_reads = plan.kv_lens if key is None else plan.cached_lens
    tables = _check_tables(checks, plan, prefill_reads, num_blocks, block_size)
    _check_decode_lens(checks, plan)
    _check_scales(checks, k_scale, v_scale)
    dirty = checks.run()
    replaced = {"slot_mapping": kept_slots.view_as(plan.slot_mapping)} if writes else {}
    # Entries past the used blocks that are not block ids: 0, so no kernel indexes with them.
    for (kind, (table, used)), is_dirty in zip(tables.items(), dirty, strict=True):
        if is_dirty:
            replaced[kind] = torch.where(used, table, torch.zeros_like(table))
    return dataclasses.replace(plan, **replaced)


def _check_scales(checks: "_Checks", k_scale, v_scale) -> None:
    checks.scale("layer._k_scale", k_scale)
    checks.scale("layer._v_scale", v_scale)


class _Checks:
    """Vectorized checks collected as boolean scalars (True: violated) and read back in one
    sync; `run` raises the first violation's error, built only then. Flags added with
    `dirty` are returned instead of raising."""

    def __init__(self) -> None:
        self.flags: list[Tensor] = []
        self.errors: list[Callable[[], Exception]] = []
        self.dirty: list[Tensor] = []

    def add(self, violated: Tensor, error: Callable[[], Exception]) -> None:
        self.flags.append(violated.reshape(()))
        self.errors.append(error)

    def scale(self, name: str, scale) -> None:
        if isinstance(scale, Tensor):
            bad = ~(torch.isfinite(scale) & (scale > 0)).all()
            self.add(bad, lambda: _scale_error(name, scale))
        elif not (float(scale) > 0 and float(scale) != float("inf")):
            raise _scale_error(name, scale)

    def run(self) -> list[bool]:
        flags = self.flags + self.dirty
        if not flags:
            return []
        device = flags[0].device
        values = torch.stack([f.to(device) for f in flags]).tolist()  # the one host sync
        for violated, error in zip(values[: len(self.flags)], self.errors, strict=True):
            if violated:
                raise error()
        return values[len(self.flags) :]


def _scale_error(name: str, scale) -> ValueError:
    value = scale.tolist() if isinstance(scale, Tensor) else scale
    return ValueError(f"{name}={value} must be finite and > 0 (the fp8 cache scale)")


def _row(plan: StepPlan, first) -> int:
    return plan.num_prefills if first == "num_prefills" else first


def _check_counts(plan: StepPlan, key: Tensor | None) -> None:
    """The per-sequence lists against the token counts (host values, no sync)."""
    q_lens, kv_lens, fields = plan.q_lens, plan.kv_lens, plan.fields
    if plan.num_prefills < 0 or plan.num_prefill_tokens < 0 or plan.num_decode_tokens < 0:
        raise ValueError(
            f"attn_metadata.num_prefills={plan.num_prefills}, num_prefill_tokens="
            f"{plan.num_prefill_tokens} and num_decode_tokens={plan.num_decode_tokens} "
            "must be >= 0"
        )
    if len(q_lens) != plan.num_prefills:
        raise ValueError(
            f"attn_metadata.num_prefills={plan.num_prefills} but the metadata gives "
            f"{len(q_lens)} prefill query lengths"
        )
    if len(kv_lens) != len(q_lens):
        raise ValueError(
            f"attn_metadata.{fields.kv_lens} gives {len(kv_lens)} lengths for "
            f"{len(q_lens)} prefills"
        )
    for i, q_len in enumerate(q_lens):
        if q_len < 0:
            raise ValueError(
                f"prefill {i} has query length {q_len} (from attn_metadata.query_start_loc): "
                "query lengths must be >= 0"
            )
    if sum(q_lens) != plan.num_prefill_tokens:
        raise ValueError(
            f"the prefill query lengths {q_lens} sum to {sum(q_lens)}, but "
            f"attn_metadata.num_prefill_tokens={plan.num_prefill_tokens}"
        )
    cross = plan.attn_type == AttentionType.ENCODER_DECODER
    for i, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
        if kv_len < 0 or (not cross and kv_len < q_len):
            rule = ">= 0" if cross else f">= its query length {q_len} (query_len <= seq_len)"
            raise ValueError(f"attn_metadata.{fields.kv_lens}[{i}]={kv_len} must be {rule}")
    qsl = plan.query_start_loc
    num_seqs = plan.num_prefills + plan.num_decode_tokens
    if qsl.dtype.is_floating_point or qsl.dtype == torch.bool:
        raise TypeError(f"attn_metadata.query_start_loc must be an integer tensor, got {qsl.dtype}")
    if qsl.shape != (num_seqs + 1,):
        raise ValueError(
            f"attn_metadata.query_start_loc has shape {tuple(qsl.shape)}, expected "
            f"[{num_seqs + 1}] (num_seqs + 1)"
        )
    if key is not None and plan.attn_type == AttentionType.DECODER:
        num_tokens = plan.num_prefill_tokens + plan.num_decode_tokens
        if key.shape[0] != num_tokens:
            raise ValueError(f"key has {key.shape[0]} tokens but query has {num_tokens}")


def _check_needs(plan: StepPlan, cache, key: Tensor | None) -> None:
    """What `attend` relies on: every K/V it needs is either given or cached."""
    if plan.num_prefill_tokens and plan.has_cached_prefix:
        if cache is None or plan.prefill_block_tables is None or key is None:
            raise ValueError(
                "prefill with a cached prefix (query_len < seq_len) needs a kv_cache, "
                "the new key/value and block tables for the prefill sequences"
            )
    elif plan.num_prefill_tokens and key is None:
        if cache is None or plan.prefill_block_tables is None:
            raise ValueError("prefill without key/value needs a kv_cache and block tables")
    if plan.num_decode_tokens and cache is None:
        raise ValueError("decode needs a kv_cache")


def _integer(name: str, x: Tensor) -> None:
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"attn_metadata.{name} must be an integer tensor, got {x.dtype}")


def _first(mask: Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in torch.nonzero(mask)[0])


def _new_key_positions(plan: StepPlan, num_keys: int) -> Tensor | None:
    """Position in its sequence of each new key (decoder: the new tokens of each prefill,
    then each decode's last; cross attention: every encoder token of each prefill), or None
    when the counts do not add up (the other checks name that)."""
    cross = plan.attn_type == AttentionType.ENCODER_DECODER
    # Per prefill: how many new keys, and the position of the first.
    counts = torch.tensor(plan.kv_lens if cross else plan.q_lens, dtype=torch.long)
    firsts = torch.zeros_like(counts) if cross else torch.tensor(plan.ctx_lens, dtype=torch.long)
    if (counts < 0).any():
        return None
    starts = torch.cumsum(counts, 0) - counts  # [num_prefills]: first key row of each
    rows = torch.arange(int(counts.sum()))
    parts = [rows - starts.repeat_interleave(counts) + firsts.repeat_interleave(counts)]
    if plan.attn_type == AttentionType.DECODER and plan.num_decode_tokens:
        if plan.decode_seq_lens is None:
            return None
        parts.append(plan.decode_seq_lens.to("cpu", torch.long).flatten() - 1)
    positions = torch.cat(parts)
    return positions if positions.numel() == num_keys else None


def check_slot_mapping(
    name: str, slots: Tensor, num_keys: int, num_blocks: int, block_size: int
) -> None:
    """`slots` (`name` in messages) for `num_keys` new keys in a cache of `num_blocks` blocks
    of `block_size`: each -1 (PAD_SLOT_ID) or in range, none twice. One host sync."""
    checks = _Checks()
    _check_slots(checks, name, slots, num_keys, num_blocks, block_size)
    checks.run()


def _check_slots(
    checks: _Checks, name: str, slots: Tensor, num_keys, num_blocks, block_size, positions=None
) -> Tensor:
    """Slots in range, -1 the only pad, no slot twice, except from the same position of two
    sequences (`positions`, per new key: prefix caching's shared blocks). Returns the flat
    slots with the earlier of each such shared write replaced by -1 (the later one is kept,
    deterministically)."""
    if slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {slots.dtype}")
    slots = slots.flatten()
    if slots.numel() != num_keys:
        raise ValueError(f"{name} has {slots.numel()} entries for {num_keys} tokens")
    num_slots = num_blocks * block_size
    for bad in (slots < PAD_SLOT_ID, slots >= num_slots):
        checks.add(
            bad.any(),
            lambda bad=bad: ValueError(
                slot_error(name, slots, _first(bad)[0], num_blocks, block_size)
            ),
        )
    ordered, order = torch.sort(slots, stable=True)
    repeated = (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)
    twice = repeated
    if positions is not None:
        positions = positions.to(slots.device)
        twice = twice & (positions[order[:-1]] != positions[order[1:]])

    def duplicate():
        slot = int(ordered[1:][twice][0])
        where = torch.nonzero(slots == slot).flatten().tolist()
        return ValueError(
            f"{name} writes slot {slot} twice ({name}[{where[0]}] and [{where[1]}]): the "
            "destination slots of one step must be distinct (apart from -1, PAD_SLOT_ID), "
            "or hold the same position of two sequences sharing a block"
        )

    checks.add(twice.any(), duplicate)
    kept = slots.clone()
    kept[order[:-1][repeated]] = PAD_SLOT_ID
    return kept


def slot_error(name: str, slots: Tensor, i: int, num_blocks: int, block_size: int) -> str:
    num_slots = num_blocks * block_size
    return (
        f"{name} value {int(slots[i])} is out of range: the cache has {num_slots} slots "
        f"({num_blocks} blocks of {block_size}), and a slot must be in [0, {num_slots}) or "
        f"-1 (PAD_SLOT_ID); at {name}[{i}]"
    )


def _check_tables(
    checks: _Checks, plan: StepPlan, prefill_reads: list[int], num_blocks: int, block_size: int
) -> dict:
    """Every sequence's used table entries in [0, num_blocks) (a prefill uses the blocks of
    the `prefill_reads` tokens it reads from the cache), its length within its table;
    query_start_loc the running sum of the query lengths. Returns, per table, (table, used
    entries) with a dirty flag queued in `checks` (unused entries that are not block ids)."""
    qsl = plan.query_start_loc
    expected = torch.tensor(
        [0, *torch.tensor([*plan.q_lens, *[1] * plan.num_decode_tokens]).cumsum(0).tolist()],
        device=qsl.device,
    )
    checks.add(
        (qsl.long() != expected).any(),
        lambda: ValueError(
            f"attn_metadata.query_start_loc={qsl.tolist()} must be the running sum of the query "
            f"lengths (prefills' {plan.q_lens}, then 1 per decode): {expected.tolist()}"
        ),
    )
    parts = {}
    for kind, lens, rows in (
        ("prefill_block_tables", prefill_reads, plan.num_prefills),
        ("decode_block_tables", plan.decode_seq_lens, plan.num_decode_tokens),
    ):
        table = getattr(plan, kind)
        if table is None or rows == 0:
            continue
        field, first = getattr(plan.fields, kind)
        first = _row(plan, first)
        _integer(field, table)
        if table.dim() != 2 or table.shape[0] != rows:
            raise ValueError(
                f"attn_metadata.{field} has shape {tuple(table.shape)} for these {rows} "
                f"sequences: expected [{rows}, max_blocks]"
            )
        lens = torch.as_tensor(lens, device=table.device).long()
        width = table.shape[1]
        needed = (lens + block_size - 1) // block_size  # [rows]; negative lens: checked apart
        used = torch.arange(width, device=table.device)[None, :] < needed[:, None]
        invalid = (table < 0) | (table >= num_blocks)

        def too_long(lens=lens, width=width, field=field, first=first, kind=kind):
            i = _first(lens > width * block_size)[0]
            len_name = f"{_len_name(plan, kind, first + i)}={int(lens[i])}"
            if kind == "prefill_block_tables" and prefill_reads != plan.kv_lens:
                len_name = f"prefill {first + i}'s cached prefix of {int(lens[i])} tokens"
            return ValueError(
                f"{len_name} needs {-(-int(lens[i]) // block_size)} blocks of "
                f"{block_size}, but attn_metadata.{field} has {width} columns "
                f"(seq_len <= max_blocks * block_size)"
            )

        def out_of_range(bad=used & invalid, table=table, field=field, first=first, lens=lens):
            i, j = _first(bad)
            return ValueError(
                f"attn_metadata.{field}[{first + i}, {j}]={int(table[i, j])} is out of range: "
                f"block ids must be in [0, num_blocks={num_blocks}) for the "
                f"{-(-int(lens[i]) // block_size)} blocks the sequence's "
                f"{int(lens[i])} tokens use"
            )

        checks.add((lens > width * block_size).any(), too_long)
        checks.add((used & invalid).any(), out_of_range)
        checks.dirty.append((~used & invalid).any().reshape(()))
        parts[kind] = (table, used)
    return parts


def _len_name(plan: StepPlan, kind: str, row: int) -> str:
    if kind == "prefill_block_tables":
        return f"attn_metadata.{plan.fields.kv_lens}[{row}]"
    return f"attn_metadata.{plan.fields.decode_seq_lens[0]}[{row}]"


def _check_decode_lens(checks: _Checks, plan: StepPlan) -> None:
    """A decode's seq_len counts its new token (>= 1; cross attention: encoder length >= 0)
    and is at most max_decode_seq_len, which sizes the gather."""
    lens = plan.decode_seq_lens
    if not plan.num_decode_tokens or lens is None:
        return
    field, first = plan.fields.decode_seq_lens
    first = _row(plan, first)
    _integer(field, lens)
    if lens.shape != (plan.num_decode_tokens,):
        raise ValueError(
            f"attn_metadata.{field} gives {tuple(lens.shape)} lengths for "
            f"{plan.num_decode_tokens} decodes"
        )
    least = 0 if plan.attn_type == AttentionType.ENCODER_DECODER else 1
    short = lens < least
    checks.add(
        short.any(),
        lambda: ValueError(
            f"attn_metadata.{field}[{first + _first(short)[0]}]={int(lens[_first(short)[0]])} "
            f"must be >= {least}" + (" (a decode's seq_len counts its new token)" if least else "")
        ),
    )
    most = plan.max_decode_seq_len
    long = lens > most
    checks.add(
        long.any(),
        lambda: ValueError(
            f"attn_metadata.{field}[{first + _first(long)[0]}]={int(lens[_first(long)[0]])} "
            f"exceeds attn_metadata.max_decode_seq_len={most}"
        ),
    )


def step_key(attn_metadata, *context: Hashable) -> tuple[tuple, list]:
    """(key, keep): what a step's checked plan is computed from, as a hashable key, and the
    objects the key names by identity, which the caller keeps alive while the key is in use
    (so no other object can take their ids). The key is `context` (what the caller's planning
    reads besides the metadata: the attention type, the impl class, the cache's shape) and
    every dataclass field of `attn_metadata`: a tensor by identity and state (`tensor_state`:
    its version counter, which every in-place write bumps, or an inference tensor's contents),
    a list or tuple by its items, a number, string, bool or None
    by value, anything else by identity. A new step, a field assigned anew or a tensor
    written in place gives a new key. The metadata object itself is named by its class only
    and not kept: what a step builds on it (TORCH_SDPA's masks) is freed with the step, and
    another object with the same fields has the same plan."""
    cls = type(attn_metadata)
    parts: list = [cls, *context]
    keep: list = []
    for name in _field_names(cls):
        parts.append(_key_part(getattr(attn_metadata, name), keep))
    return tuple(parts), keep


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    """`cls`'s dataclass field names, found once per class (every layer's forward asks)."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


class _Contents:
    """An inference tensor's contents at one moment (a copy): equal to another snapshot of the
    same shape, dtype and values (`torch.equal`). It stands in for the version counter that
    such tensors lack. Copies and comparisons are memory passes: for a [256, 256] int32 block
    table, two snapshots and their comparison took 40 us, one blake2b digest of it 290 (2-core
    AMD Zen 4 VM)."""

    __slots__ = ("_copy", "_hash")

    def __init__(self, t: Tensor) -> None:
        self._copy = t.detach().clone()
        self._hash = hash((tuple(t.shape), t.dtype))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        if not isinstance(other, _Contents):
            return NotImplemented
        a, b = self._copy, other._copy
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def tensor_state(t: Tensor):
    """What changes when `t` is written in place: its version counter; or, for an inference
    tensor (made under `torch.inference_mode()`, which keeps no version counter: reading
    `_version` raises), a snapshot of its contents (`_Contents`)."""
    return _Contents(t) if t.is_inference() else t._version


def _key_part(value, keep: list):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Tensor):
        keep.append(value)
        return ("tensor", id(value), tensor_state(value))
    if isinstance(value, (list, tuple)):
        return ("seq", tuple(_key_part(v, keep) for v in value))
    keep.append(value)
    return ("object", id(value))


class CheckedPlans:
    """The plans that passed `check_step` in the last `size` steps, by `step_key`, and the
    scale tensors found valid (each by identity and version: the layers of a step share its
    plan, but each has its own scales)."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._plans: collections.OrderedDict = collections.OrderedDict()
        self._scales: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, key: tuple) -> StepPlan | None:
        """The plan checked for `key`, or None."""
        entry = self._plans.get(key)
        if entry is None:
            return None
        try:
            self._plans.move_to_end(key)
        except KeyError:  # evicted meanwhile by another thread's put: still a valid plan
            pass
        return entry[0]

    def put(self, key: tuple, keep: list, plan: StepPlan, k_scale, v_scale) -> None:
        """Remember a plan that passed `check_step` with these scales."""
        self._plans[key] = (plan, keep)
        self._plans.move_to_end(key)
        while len(self._plans) > self.size:
            self._plans.popitem(last=False)
        self._remember(k_scale, v_scale)

    def check_scales(self, k_scale, v_scale) -> None:
        """`check_step`'s scale checks, for scales not yet found valid (a reused plan's)."""
        if self._known(k_scale) and self._known(v_scale):
            return
        checks = _Checks()
        _check_scales(checks, k_scale, v_scale)
        checks.run()
        self._remember(k_scale, v_scale)

    def clear(self) -> None:
        self._plans.clear()
        self._scales.clear()

    def _remember(self, *scales) -> None:
        for scale in scales:
            if isinstance(scale, Tensor):
                self._scales[scale] = tensor_state(scale)

    def _known(self, scale) -> bool:
        if not isinstance(scale, Tensor):  # floats are cheap to check again
            return False
        return self._scales.get(scale) == tensor_state(scale)

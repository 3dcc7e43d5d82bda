"""Value rules: one table of rules on the values of metadata, slots, pairs and scales, run
eagerly (NumPy) or under `jit` (`checkify`). Shape and dtype rules, checked while tracing, are
in `shape_rules.py`; the public eager entry `jax_attn.validate` in `validate.py`.

Every rule below is written once, against an array module `xp` that is NumPy for concrete
values and `jax.numpy` for traced ones, and *yields* `(bad, template, args)`: a boolean
scalar that is true when the rule is broken, and a message template whose `{}` take `args`
(the offending index and value). The two ways of running them:

- eager (`enforce`): NumPy on the host, stopping at the first broken rule with a `ValueError`
  whose text is `template.format(*args)`;
- under `jit` inside `checked(fn)` (`enforce_checkify`): each rule becomes
  `checkify.check(~bad, template, *args)`, so the error `checked` raises carries the same text.

When each applies (see docs/reliability.md):

    values concrete (NumPy, Python, jax.Array outside jit) -> eager, by default, before anything
        is computed or written; turned off per call (`check=False`) or for the process
        (`jax_attn.config.check = False`, or JAX_ATTN_CHECK=0 in the environment)
    values traced (inside jax.jit, vmap, scan ...)        -> nothing, unless the function is
        run through `jax_attn.checked(fn)`: then checkify checks, raised after the call

Rules are generators so that the eager path stops before computing a later rule over values an
earlier one rejected; under checkify every rule is computed and the first broken one in this
order is the one reported, as eagerly.
"""

import contextlib
import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

Violation = tuple[object, str, tuple]  # (bad: bool scalar, template, args)


@dataclasses.dataclass
class Config:
    """Process-wide switches: `jax_attn.config.check = False` turns the eager checks off (the
    environment variable JAX_ATTN_CHECK=0 does the same at import)."""

    check: bool = os.environ.get("JAX_ATTN_CHECK", "1").strip().lower() not in ("0", "false", "no")


config = Config()

_state = threading.local()


def _checkify_active() -> bool:
    return getattr(_state, "checkify", False)


@contextlib.contextmanager
def _checkify_mode():
    previous = _checkify_active()
    _state.checkify = True
    try:
        yield
    finally:
        _state.checkify = previous


def is_concrete(*values) -> bool:
    """No traced value among `values` (pytrees: metadata, scales, Python numbers)."""
    leaves = jax.tree_util.tree_leaves(values)
    return not any(isinstance(x, jax.core.Tracer) for x in leaves)


def wanted(check: bool | None) -> bool:
    """Whether value checks run for a call: its `check` keyword, else `config.check`."""
    return config.check if check is None else bool(check)


def run_checks(
    rules: Callable[..., Iterator[Violation]], values: dict, check: bool | None, **static
):
    """Run `rules(xp, **values, **static)` as the values allow: eagerly when they are all
    concrete (and checks are on), through checkify when traced inside `checked`, else not.

    `values` holds the arrays the rules read (pulled to the host eagerly); `static` holds
    Python ints (sizes) and names. Returns, inside `checked`, a traced bool that is true when
    every rule holds (entries that write use it to write nothing on a refused step); else None.
    """
    if not wanted(check):
        return None
    if is_concrete(values):
        host = jax.tree_util.tree_map(_host, values)
        enforce(rules(np, **host, **static))
    elif _checkify_active():
        traced = jax.tree_util.tree_map(jnp.asarray, values)
        return enforce_checkify(rules(jnp, **traced, **static))
    return None


def _host(x):
    x = np.asarray(x)
    if np.issubdtype(x.dtype, np.integer):
        return x.astype(np.int64)
    return x.astype(np.float64)


def enforce(violations: Iterator[Violation]) -> None:
    """Raise `ValueError` for the first broken rule (NumPy values)."""
    for bad, template, args in violations:
        if bool(bad):
            raise ValueError(format_message(template, args))


def format_message(template: str, args) -> str:
    return template.format(*[_scalar(a) for a in args])


def _scalar(a):
    a = np.asarray(a)
    if np.issubdtype(a.dtype, np.integer):
        return int(a)
    if np.issubdtype(a.dtype, np.floating):
        return float(a)
    return a


def enforce_checkify(violations: Iterator[Violation]):
    """`checkify.check` each rule; returns a traced bool, true when all of them hold."""
    from jax.experimental import checkify

    ok = jnp.asarray(True)
    for bad, template, args in violations:
        # checkify formats `args` with str.format too; ints and floats print as eagerly.
        checkify.check(jnp.logical_not(bad), template, *[_traced_scalar(a) for a in args])
        ok = ok & jnp.logical_not(bad)
    return ok


def _traced_scalar(a):
    a = jnp.asarray(a)
    if jnp.issubdtype(a.dtype, jnp.integer):
        return a.astype(jnp.int32)
    return a.astype(jnp.float32)


def checked(fn=None, **jit_kwargs):
    """`fn` jitted with the value checks on: `checkify` carries them through `jit`, and a
    broken rule raises after the call with the eager message.

        step = jax_attn.checked(serve_step, donate_argnums=(1, 2))
        out, kc, vc = step(params, kc, vc, metadata)   # raises JaxRuntimeError on bad ids

    `jit_kwargs` go to `jax.jit` (static_argnames, donate_argnums...). Pass the plain
    function, not one already jitted: `checked` traces it itself, with the checks inserted
    by the entries (`paged_attention`, `paged_decode`, `write_kv`, `copy_blocks`,
    `varlen_attention`) it calls. Raises `jax.experimental.checkify`'s `JaxRuntimeError`
    (a `ValueError` where the values were concrete while tracing); the error's `outputs`
    holds what `fn` returned. A refused `write_kv` / `copy_blocks` writes nothing, so the
    caches in `outputs` equal the inputs even when those were donated.
    """
    if fn is None:
        return functools.partial(checked, **jit_kwargs)
    from jax.experimental import checkify

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with _checkify_mode():
            return fn(*args, **kwargs)

    jitted = jax.jit(checkify.checkify(traced, errors=checkify.user_checks), **jit_kwargs)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        err, out = jitted(*args, **kwargs)
        try:
            err.throw()
        except checkify.JaxRuntimeError as e:
            e.outputs = out
            raise
        return out

    run.checkified = jitted  # (error, out) without raising, for callers that batch errors
    return run


# --------------------------------------------------------------------------------------------
# The rules. `xp` is numpy or jax.numpy; arrays are integer (int64 eagerly, int32 traced).


def _first(xp, mask):
    """Index of the first true entry of a mask, flattened (0 when none, or when empty)."""
    flat = mask.reshape(-1)
    return xp.argmax(flat) if flat.shape[0] else xp.zeros((), xp.int32)


def _at(xp, x, i):
    """`x.reshape(-1)[i]` (clipped into range), or 0 for an empty `x`: only a broken rule's
    index is printed, and it is always in range; the others must merely not fail."""
    flat = x.reshape(-1)
    n = flat.shape[0]
    return flat[xp.minimum(i, n - 1)] if n else xp.zeros((), flat.dtype)


def ragged_rules(
    xp,
    *,
    query_start_loc,
    seq_lens,
    block_tables,
    slot_mapping,
    num_seqs,
    num_tokens: int,
    num_blocks: int,
    block_size: int,
    prefix: str = "metadata.",
) -> Iterator[Violation]:
    """A ragged batch's metadata against `num_tokens` queries and a cache of `num_blocks`
    blocks of `block_size` (the rules of `validate`, plus the slot rules)."""
    qsl, p = query_start_loc, prefix
    max_seqs = block_tables.shape[0]
    yield (
        (num_seqs < 0) | (num_seqs > max_seqs),
        f"{p}num_seqs={{}} must be in [0, {max_seqs}]",
        (num_seqs,),
    )
    ns = xp.clip(num_seqs, 0, max_seqs)
    yield qsl[0] != 0, f"{p}query_start_loc must start at 0, got {{}}", (qsl[0],)
    real = xp.arange(max_seqs) < ns  # [S]
    steps = qsl[1:] - qsl[:-1]  # q_len per sequence
    bad = real & (steps < 0)
    i = _first(xp, bad)
    yield (
        xp.any(bad),
        f"{p}query_start_loc must be non-decreasing (monotone), but "
        "query_start_loc[{}]={} < query_start_loc[{}]={}",
        (i + 1, _at(xp, qsl, i + 1), i, qsl[i]),
    )
    yield (
        qsl[ns] > num_tokens,
        f"{p}query_start_loc[num_seqs]={{}} exceeds the {num_tokens} query tokens",
        (qsl[ns],),
    )
    bad = real & (seq_lens < steps)
    i = _first(xp, bad)
    yield (
        xp.any(bad),
        "q_len <= seq_len must hold, but sequence {} has q_len={} > seq_lens[{}]={}",
        (i, _at(xp, steps, i), i, _at(xp, seq_lens, i)),
    )
    yield from table_rules(
        xp,
        block_tables=block_tables,
        seq_lens=xp.where(real, seq_lens, 0),
        num_blocks=num_blocks,
        block_size=block_size,
        prefix=p,
    )
    yield from slot_rules(
        xp,
        slot_mapping=slot_mapping,
        num_slots=num_blocks * block_size,
        name=f"{p}slot_mapping",
    )


def table_rules(
    xp, *, block_tables, seq_lens, num_blocks: int, block_size: int, prefix: str = ""
) -> Iterator[Violation]:
    """Each sequence's block table covers its `seq_len` with ids in `[0, num_blocks)` (only
    the entries it uses: the rest may hold anything)."""
    p = prefix
    max_blocks = block_tables.shape[1]
    bad = seq_lens < 0
    i = _first(xp, bad)
    yield xp.any(bad), f"{p}seq_lens[{{}}]={{}} must be >= 0", (i, _at(xp, seq_lens, i))
    needed = (seq_lens + block_size - 1) // block_size  # [S]
    bad = needed > max_blocks
    i = _first(xp, bad)
    yield (
        xp.any(bad),
        f"{p}seq_lens[{{}}]={{}} needs {{}} blocks of {block_size} but block_tables has "
        f"{max_blocks} columns",
        (i, _at(xp, seq_lens, i), _at(xp, needed, i)),
    )
    used = xp.arange(max_blocks)[None, :] < needed[:, None]  # [S, max_blocks]
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
    flat = _first(xp, bad)
    i, j = flat // max_blocks, flat % max_blocks
    yield (
        xp.any(bad),
        f"{p}block_tables[{{}}, {{}}]={{}} is out of range: block ids must be in "
        f"[0, num_blocks={num_blocks})",
        (i, j, _at(xp, block_tables, flat)),
    )


def slot_rules(xp, *, slot_mapping, num_slots: int, name: str = "slot_mapping"):
    """Slots are -1 (PAD_SLOT_ID: write nothing) or inside the cache, each at most once."""
    slots = slot_mapping
    bad = (slots < -1) | (slots >= num_slots)
    t = _first(xp, bad)
    yield (
        xp.any(bad),
        f"{name}[{{}}]={{}} is out of range: slots must be < num_blocks * block_size = "
        f"{num_slots} and >= -1 (PAD_SLOT_ID, no write)",
        (t, _at(xp, slots, t)),
    )
    yield from _distinct(xp, slots, what=f"{name} has slot", rule="slots must be distinct")


def _distinct(xp, ids, *, what: str, rule: str):
    """No id >= 0 twice."""
    s = xp.sort(ids.reshape(-1))
    dup = (s[1:] == s[:-1]) & (s[1:] >= 0)
    yield (
        xp.any(dup),
        f"{what} {{}} more than once: {rule} (a repeated destination leaves which write wins "
        "undefined)",
        (_at(xp, s, _first(xp, dup) + 1),),
    )


def scale_rules(xp, *, k_scale, v_scale) -> Iterator[Violation]:
    """Cache scales are finite and > 0 (an fp8 cache stores x / scale and reads stored * scale)."""
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        s = s.reshape(-1)[0] if s.ndim else s
        yield ~(xp.isfinite(s) & (s > 0)), f"{name}={{}} must be finite and > 0", (s,)


def pair_rules(xp, *, src_to_dst, num_src: int, num_dst: int, name: str = "src_to_dst"):
    """Block pairs `[src, dst]` with `src` in `[0, num_src)`, `dst` in `[0, num_dst)` (no
    negative ids: they would wrap to the last blocks), each destination once."""
    for col, what, n in ((0, "source", num_src), (1, "destination", num_dst)):
        ids = src_to_dst[:, col]
        bad = (ids < 0) | (ids >= n)
        i = _first(xp, bad)
        yield (
            xp.any(bad),
            f"{name}[{{}}, {col}]={{}} is out of range: {what} block ids must be in "
            f"[0, num_blocks={n})",
            (i, _at(xp, ids, i)),
        )
    yield from _distinct(
        xp, src_to_dst[:, 1], what=f"{name}[:, 1] has block", rule="destinations must be distinct"
    )


def cu_seqlens_rules(xp, *, cu_seqlens, num_tokens: int, name: str) -> Iterator[Violation]:
    """Cumulative lengths: start at 0, never decrease, end within the tokens."""
    cu = cu_seqlens
    yield cu[0] != 0, f"{name} must start at 0, got {{}}", (cu[0],)
    steps = cu[1:] - cu[:-1]
    bad = steps < 0
    i = _first(xp, bad)
    yield (
        xp.any(bad),
        f"{name} must be non-decreasing (monotone), but {name}[{{}}]={{}} < {name}[{{}}]={{}}",
        (i + 1, _at(xp, cu, i + 1), i, cu[i]),
    )
    yield cu[-1] > num_tokens, f"{name}[-1]={{}} exceeds the {num_tokens} tokens", (cu[-1],)

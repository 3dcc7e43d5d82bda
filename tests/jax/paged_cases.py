"""Case builders shared by the paged-attention kernel tests (`from paged_cases import ...`).

- `CaseId`: readable test ids for a frozen dataclass of case fields (only what differs from
  the defaults: `block_size=8-alibi=True`, or `base`).
- `workload` / `padded_ragged_inputs` / `bias_and_expected`: a `make_workload` batch for a case,
  its new tokens written through `write_kv`, padding tokens with NaN queries, the float64 oracle.
- `stored` / `nan_paged_cache`: the Pallas tests' own paged cache, NaN in every unused block
  and tail slot and junk (in-range) ids in unused block-table entries.
- `run_fresh`: a script in a fresh Python process (for settings read once per process, such as
  `JAX_ATTN_CPU_AMX`), these test modules importable.
"""

import dataclasses
import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from tolerances import assert_close

import jax_attn
from interop.workload import dense_reference, free_blocks_before, make_workload

FP8_SCALES = (0.37, 0.61)  # k_scale, v_scale of an fp8 cache

# The Pallas kernels' lowering for CUDA, one grid for both kernels:
# (dtype, cache_dtype, head_size, block_size, GQA group, features: ALiBi, window and soft cap
# on, and for the ragged kernel causal off)
LOWERING = [
    ("bfloat16", "bfloat16", 128, 16, 4, False),
    ("float32", "float32", 64, 8, 1, True),
    ("bfloat16", "float8_e4m3fn", 256, 32, 8, True),
    ("float16", "float8_e5m2", 128, 16, 2, False),
]
LOWERING_GRID = pytest.mark.parametrize(
    ("dtype", "cache_dtype", "head_size", "block_size", "group", "features"),
    LOWERING,
    ids=["-".join(map(str, c)) for c in LOWERING],
)


class CaseId:
    """`str(case)`: the fields that differ from the defaults, `name=value` joined by `-`."""

    def __str__(self):
        base = type(self)()
        parts = [
            f"{f.name}={getattr(self, f.name)}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(base, f.name)
        ]
        return "-".join(parts).replace(" ", "") or "base"


def fp8_scales(cache_dtype: str | None) -> tuple[float, float]:
    fp8 = cache_dtype is not None and "float8" in cache_dtype
    return FP8_SCALES if fp8 else (1.0, 1.0)


def workload(case, rng: np.random.Generator, query_lens, context_lens):
    """A `make_workload` batch of the case's sizes and dtypes; returns (w, k_scale, v_scale)."""
    k_scale, v_scale = fp8_scales(case.cache_dtype)
    w = make_workload(
        rng,
        query_lens,
        context_lens,
        num_heads=case.num_heads,
        num_kv_heads=case.num_kv_heads,
        head_size=case.head_size,
        block_size=case.block_size,
        dtype=case.dtype,
        cache_dtype=case.cache_dtype,
        k_scale=k_scale,
        v_scale=v_scale,
        free_before_window=getattr(case, "sliding_window", None),
    )
    return w, k_scale, v_scale


def padded_ragged_inputs(case, w, k_scale, v_scale, *, pad_seqs: int, pad_tokens: int):
    """Metadata padded by `pad_seqs` rows and `pad_tokens` tokens, the query with NaN in the
    padding tokens, and the caches with the new tokens written (padding slots included)."""
    num_tokens, num_seqs = len(w.slot_mapping), len(w.query_lens)
    md = w.metadata(pad_to=(num_seqs + pad_seqs, num_tokens + pad_tokens))
    # Padding tokens carry NaN queries: their rows must come out as zeros anyway.
    pad = np.full((pad_tokens, case.num_heads, case.head_size), np.nan, np.float32)
    pad = pad.astype(w.query.dtype)
    query = jnp.asarray(np.concatenate([w.query, pad]))
    kc, vc = jax_attn.write_kv(
        jnp.asarray(w.key_cache),
        jnp.asarray(w.value_cache),
        jnp.asarray(np.concatenate([w.new_key, pad[:, : case.num_kv_heads]])),
        jnp.asarray(np.concatenate([w.new_value, pad[:, : case.num_kv_heads]])),
        md.slot_mapping,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return md, query, kc, vc


def bias_and_expected(case, w, *, has_causal: bool = True):
    """(slopes, bias keywords, float64 oracle output). Decode cases have no `causal` field
    (`has_causal=False`): their bias keywords leave it out."""
    slopes = jax_attn.alibi_slopes(case.num_heads) if case.alibi else None
    bias = dict(sliding_window=case.sliding_window, logits_soft_cap=case.soft_cap)
    if has_causal:
        bias = dict(causal=case.causal, **bias)
    expected = dense_reference(w, alibi_slopes=slopes, **bias)
    return slopes, bias, expected


def stored(x: np.ndarray, dtype: str, scale: float) -> np.ndarray:
    """`x` as a cache of `dtype` holds it: saturated `x / scale` (fp8) or `x / scale` rounded."""
    y = x / scale
    if "float8" in dtype:
        info = ml_dtypes.finfo(dtype)
        y = np.clip(y, float(info.min), float(info.max))
    return y.astype(jnp.dtype(dtype))


def nan_paged_cache(
    case, rng: np.random.Generator, seq_lens, *, max_blocks: int, rows: int, first_seen=None
):
    """A paged cache of `case.num_kv_heads` x `case.head_size`, NaN everywhere but the live
    slots, blocks in random order; `rows` block-table rows (unused entries: junk ids in range,
    often blocks full of NaN or another sequence's). Returns (key_cache, value_cache, tables,
    keys, values), keys/values per sequence in float64 as the cache holds them, scales applied.
    `first_seen` (per sequence, under a sliding window: the first key any of its queries sees):
    the blocks wholly before it freed as vLLM's engines free them, NaN, their table entries
    pointing at one shared block of NaN (the engines' null block)."""
    num_blocks = len(seq_lens) * max_blocks + 3
    bs, hkv, d = case.block_size, case.num_kv_heads, case.head_size
    cache_dtype = case.cache_dtype or case.dtype
    k_scale, v_scale = case.scales

    # NaN everywhere, then only the live slots are written.
    key_cache = np.full((num_blocks, bs, hkv, d), np.nan, np.float32)
    key_cache = key_cache.astype(jnp.dtype(cache_dtype))
    value_cache = key_cache.copy()
    perm = rng.permutation(num_blocks)
    tables = rng.integers(0, num_blocks, (rows, max_blocks)).astype(np.int32)
    keys, values = [], []
    used = 0
    for i, n in enumerate(seq_lens):
        nb = -(-int(n) // bs)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
        k = stored(rng.standard_normal((n, hkv, d)), cache_dtype, k_scale)
        v = stored(rng.standard_normal((n, hkv, d)), cache_dtype, v_scale)
        for p in range(n):
            key_cache[tables[i, p // bs], p % bs] = k[p]
            value_cache[tables[i, p // bs], p % bs] = v[p]
        keys.append(k.astype(np.float64) * k_scale)
        values.append(v.astype(np.float64) * v_scale)
        if first_seen is not None:  # perm[-1]: never a sequence's (3 spare blocks)
            free_blocks_before(key_cache, value_cache, tables[i], int(first_seen[i]), perm[-1])
    return key_cache, value_cache, tables, keys, values


def error_dtypes(case):
    """The dtypes whose tolerance applies: the query's, and an fp8 cache's."""
    cache = case.cache_dtype or case.dtype
    return (case.dtype, cache) if "float8" in cache else (case.dtype,)


def assert_native_output(out, query, expected, case, caches, caches_before):
    """A native kernel's output: the query's shape and dtype, the first `len(expected)` rows
    within the case's tolerance, the padding rows past them exact zeros, and the caches (inputs
    only, NaN poison included) unchanged bit for bit."""
    # (a helper module's asserts are not rewritten by pytest: the message says what differs)
    same = out.dtype == query.dtype and out.shape == query.shape
    assert same, f"out {out.dtype}{out.shape} != query {query.dtype}{query.shape}"
    num_real = len(expected)
    assert_close(out[:num_real], expected, case.dtype, case.cache_dtype)
    np.testing.assert_array_equal(np.asarray(out[num_real:], np.float32), 0.0)
    for cache, before in zip(caches, caches_before, strict=True):
        np.testing.assert_array_equal(np.asarray(cache).view(np.uint8), before.view(np.uint8))


def run_fresh(script: str, **env: str) -> None:
    """Runs `script` (dedented) in a fresh Python process with `env` added, this directory and
    the repository on its path; asserts it exits 0 and prints "ok" last."""
    here = os.path.dirname(os.path.abspath(__file__))
    full = dict(os.environ, **env)
    full["PYTHONPATH"] = os.pathsep.join([here, os.path.dirname(here), full.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=full,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]

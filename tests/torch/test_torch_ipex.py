"""IPEX-specific checks on the real IPEX 2.8 kernels (every backend's steps, IPEX included:
test_torch_backends.py).

IPEX 2.8 needs torch 2.8.*, so these run in the IPEX environment (`scripts/test.sh` runs
`pytest -m ipex` there); elsewhere they skip saying why.
"""

import importlib.util

import pytest
import torch
from tolerances import assert_close
from torch_cases import alibi, reference_attention

pytestmark = pytest.mark.ipex

_REASON = None
if not torch.__version__.startswith("2.8"):
    _REASON = (
        f"IPEX 2.8 needs torch 2.8.*, this environment has torch {torch.__version__}; "
        "scripts/test.sh runs these tests in the IPEX environment"
    )
elif importlib.util.find_spec("intel_extension_for_pytorch") is None:
    _REASON = "intel_extension_for_pytorch is not installed (pip install 'jax-attn[ipex]')"
if _REASON:
    pytest.skip(_REASON, allow_module_level=True)

from torch_backends import AttentionLayer, AttentionType, get_attn_backend  # noqa: E402
from torch_backends.ipex_attn import (  # noqa: E402
    IpexAttnBackend,
    IpexAttnBackendImpl,
    IpexAttnMetadataBuilder,
)
from torch_backends.layouts import PagedCache  # noqa: E402


def test_pad_slots_write_nothing(rng):
    impl = IpexAttnBackendImpl(
        2, 64, 0.125, 2, alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto"
    )
    kv_cache = torch.full((2, 3, 8 * 2 * 64), float("nan"))
    key_cache, value_cache = impl.layout.split(kv_cache)
    before = kv_cache.clone()
    x = torch.randn(2, 2, 64)
    PagedCache(impl.layout, key_cache, value_cache).write(x, x, torch.tensor([-1, 9]))
    changed = ~((kv_cache == before) | (kv_cache.isnan() & before.isnan()))
    assert int(changed.sum()) == 2 * 2 * 64  # slot 9 in both caches, nothing for -1
    assert torch.equal(key_cache[1, :, 1], x[1])


@pytest.mark.parametrize("attn_type", [AttentionType.ENCODER, AttentionType.ENCODER_ONLY])
def test_ipex_encoder(attn_type, rng):
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    hq, hkv, d = 8, 2, 64
    lens = [5, 1, 12]
    q, k, v = (torch.randn(sum(lens), h, d, generator=gen) for h in (hq, hkv, hkv))
    impl = IpexAttnBackendImpl(
        hq,
        d,
        0.1,
        hkv,
        attn_type=attn_type,
        alibi_slopes=alibi(hq),
        sliding_window=4,
        kv_cache_dtype="auto",
    )
    md = IpexAttnMetadataBuilder(None).build(
        [], [], -1, -1, block_tables=[], block_size=16, encoder_seq_lens=lens
    )
    out = impl.forward(
        AttentionLayer(),
        q.view(len(q), -1),
        k.view(len(k), -1),
        v.view(len(v), -1),
        torch.empty(0),
        md,
    )
    expected = reference_attention(
        q, k, v, lens, lens, causal=False, scale=0.1, alibi_slopes=alibi(hq), sliding_window=4
    )
    assert_close(out.view(-1, hq, d), expected, torch.float32)


def test_ipex_errors():
    assert get_attn_backend("IPEX") is IpexAttnBackend
    with pytest.raises(NotImplementedError, match="supports only 'auto' and 'fp8_e5m2'"):
        IpexAttnBackendImpl(
            4, 64, 0.1, kv_cache_dtype="fp8", num_kv_heads=4, alibi_slopes=None, sliding_window=None
        )
    with pytest.raises(ValueError, match="Head size 72 is not supported by PagedAttention"):
        IpexAttnBackendImpl(
            4,
            72,
            0.1,
            num_kv_heads=4,
            alibi_slopes=None,
            sliding_window=None,
            kv_cache_dtype="auto",
        )
    with pytest.raises(ValueError, match="IPEX does not support block-sparse attention"):
        IpexAttnBackendImpl(
            4,
            64,
            0.1,
            blocksparse_params={},
            num_kv_heads=4,
            alibi_slopes=None,
            sliding_window=None,
            kv_cache_dtype="auto",
        )


# Counterexamples found by `jax-attn fuzz` (each failed before the fix), against the float64
# oracle with the tolerance table through the cross-check harness.
_FUZZ = dict(num_heads=1, num_kv_heads=1, head_size=32, block_size=8)
_FUZZ_CASES = {
    # float16 queries over an fp8_e5m2 cache: IPEX raised "expected scalar type Half but
    # found Float8_e5m2" (the decode kernel reads the cache in the query's dtype).
    "f16_query_fp8_cache": dict(
        query_lens=(1,), context_lens=(1,), dtype="float16", cache_dtype="float8_e5m2", **_FUZZ
    ),
    "bf16_query_fp8_cache_prefill": dict(
        query_lens=(3, 1),
        context_lens=(2, 4),
        dtype="bfloat16",
        cache_dtype="float8_e5m2",
        **_FUZZ,
    ),
    "f16_query_fp8_cache_mixed": dict(
        query_lens=(3, 2, 1),
        context_lens=(0, 5, 9),
        dtype="float16",
        cache_dtype="float8_e5m2",
        **_FUZZ,
    ),
    # A window with a soft cap: IPEX raised "Expected !(window_size > 0 && use_softcap)".
    "window_soft_cap_decode": dict(
        query_lens=(1,), context_lens=(1,), sliding_window=1, logits_soft_cap=5.0, **_FUZZ
    ),
    "window_soft_cap_mixed": dict(
        query_lens=(5, 3, 1),
        context_lens=(0, 4, 9),
        sliding_window=3,
        logits_soft_cap=5.0,
        **_FUZZ,
    ),
    "window_soft_cap_encoder": dict(
        query_lens=(4, 2),
        context_lens=(0, 0),
        sliding_window=2,
        logits_soft_cap=5.0,
        attn_type=AttentionType.ENCODER,
        **_FUZZ,
    ),
    # Cross attention with a window: the window was not applied (1.66 off).
    "cross_window": dict(
        query_lens=(1,),
        context_lens=(1,),
        sliding_window=1,
        attn_type=AttentionType.ENCODER_DECODER,
        **_FUZZ,
    ),
    "cross_window_longer": dict(
        query_lens=(3, 2),
        context_lens=(6, 0),
        sliding_window=2,
        attn_type=AttentionType.ENCODER_DECODER,
        **_FUZZ,
    ),
    # A prefill without a cached prefix ignored the window (1.18 off).
    "prefill_window": dict(query_lens=(2,), context_lens=(0,), sliding_window=1, **_FUZZ),
    "window_one_mixed": dict(
        query_lens=(3, 4, 1), context_lens=(0, 2, 6), sliding_window=1, **_FUZZ
    ),
    "prefill_window_gqa": dict(
        query_lens=(7, 20),
        context_lens=(0, 0),
        num_heads=4,
        num_kv_heads=2,
        head_size=64,
        sliding_window=5,
    ),
    # bfloat16 encoder: logits in bfloat16 (3.0e-2 off, bfloat16's row is 1.6e-2).
    "bf16_encoder": dict(
        query_lens=(2, 1),
        context_lens=(0, 0),
        num_heads=12,
        num_kv_heads=3,
        head_size=128,
        block_size=8,
        dtype="bfloat16",
        attn_type=AttentionType.ENCODER,
        scale=0.3,
    ),
    # The same in a causal prefill, and in float16 (past their rows: 3.2e-2 and 4.6e-3).
    "bf16_prefill": dict(
        query_lens=(19, 20, 30),
        context_lens=(0, 0, 0),
        num_heads=12,
        num_kv_heads=3,
        head_size=128,
        block_size=8,
        dtype="bfloat16",
        scale=0.3,
    ),
    "f16_prefill": dict(
        query_lens=(34, 25, 20),
        context_lens=(0, 0, 0),
        num_heads=12,
        num_kv_heads=3,
        head_size=128,
        dtype="float16",
        scale=0.3,
    ),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", list(_FUZZ_CASES))
def test_ipex_fuzz_counterexamples(case, seed):
    import numpy as np

    from interop.harness import Spec, check_cell, make_problem
    from interop.torch_runners import TORCH_BACKENDS

    (ipex,) = [b for b in TORCH_BACKENDS if b.name == "IPEX"]
    problem = make_problem(Spec(name="fuzz", **_FUZZ_CASES[case]), np.random.default_rng(seed))
    cell = check_cell(ipex, problem)
    assert cell.ok, f"{case}: {problem.spec.describe()}: {cell}"

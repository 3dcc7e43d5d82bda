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
    impl = IpexAttnBackendImpl(2, 64, 0.125, 2)
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
        hq, d, 0.1, hkv, attn_type=attn_type, alibi_slopes=alibi(hq), sliding_window=4
    )
    md = IpexAttnMetadataBuilder().build(
        [], [], block_tables=[], block_size=16, encoder_seq_lens=lens
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
        IpexAttnBackendImpl(4, 64, 0.1, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="Head size 72 is not supported by PagedAttention"):
        IpexAttnBackendImpl(4, 72, 0.1)
    with pytest.raises(ValueError, match="IPEX does not support block-sparse attention"):
        IpexAttnBackendImpl(4, 64, 0.1, blocksparse_params={})

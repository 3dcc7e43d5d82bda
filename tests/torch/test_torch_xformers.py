"""XFORMERS' own surface: xformers' bias objects and their documented CPU reference execution.
(Every backend's steps, XFORMERS included: test_torch_backends.py.)"""

import warnings

import pytest
import torch
from tolerances import assert_close
from torch_cases import alibi, reference_attention

xformers = pytest.importorskip("xformers", reason="xformers is not installed in this environment")

from xformers.ops.fmha import attn_bias as xbias  # noqa: E402

from torch_backends import AttentionLayer, AttentionType, get_attn_backend  # noqa: E402
from torch_backends.torch_sdpa import TorchSDPAMetadataBuilder  # noqa: E402
from torch_backends.xformers import (  # noqa: E402
    XFormersBackend,
    XFormersImpl,
    XFormersMetadataBuilder,
    execute_reference,
)


def test_cpu_execution_warns_once(rng):
    import torch_backends.xformers as xf

    xf._warned_cpu = False
    impl = XFormersImpl(
        2,
        64,
        0.125,
        attn_type=AttentionType.ENCODER_ONLY,
        num_kv_heads=2,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
    )
    md = TorchSDPAMetadataBuilder(None).build(
        [], [], -1, -1, block_tables=[], block_size=16, encoder_seq_lens=[3]
    )
    x = torch.randn(3, 128)
    with pytest.warns(RuntimeWarning, match="xformers has no CPU kernel"):
        impl.forward(AttentionLayer(), x, x, x, torch.empty(0), md)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        impl.forward(AttentionLayer(), x, x, x, torch.empty(0), md)  # no second warning


def test_masks_are_xformers_objects():
    impl = XFormersImpl(
        4, 64, 0.1, 2, alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto"
    )
    assert isinstance(impl.make_attn_bias([3, 5], [3, 5], True), xbias.BlockDiagonalCausalMask)
    assert isinstance(
        impl.make_attn_bias([2], [7], True), xbias.BlockDiagonalCausalFromBottomRightMask
    )
    assert isinstance(impl.make_attn_bias([2], [7], False), xbias.BlockDiagonalMask)
    local = XFormersImpl(4, 64, 0.1, 2, sliding_window=4, alibi_slopes=None, kv_cache_dtype="auto")
    assert isinstance(
        local.make_attn_bias([3, 5], [3, 5], True), xbias.BlockDiagonalCausalLocalAttentionMask
    )
    with_alibi = XFormersImpl(
        4, 64, 0.1, 2, alibi_slopes=alibi(4), sliding_window=None, kv_cache_dtype="auto"
    )
    biases = with_alibi.make_attn_bias([3, 5], [3, 5], True)
    assert all(isinstance(b, xbias.LowerTriangularMaskWithTensorBias) for b in biases)


def test_reference_execution_of_a_bias_object(rng):
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    q = torch.randn(7, 4, 32, generator=gen)
    k = torch.randn(7, 2, 32, generator=gen)
    v = torch.randn(7, 2, 32, generator=gen)
    bias = xbias.BlockDiagonalCausalMask.from_seqlens([3, 4])
    out = execute_reference(q, k, v, bias, scale=0.2)
    expected = reference_attention(q, k, v, [3, 4], [3, 4], causal=True, scale=0.2)
    assert_close(out, expected, torch.float32)


def test_registry_and_builder():
    assert get_attn_backend("XFORMERS") is XFormersBackend
    assert XFormersBackend.get_name() == "XFORMERS"
    md = XFormersMetadataBuilder(None).build(
        [3, 9], [3, 1], -1, -1, block_tables=[[0], [1]], block_size=16
    )
    assert type(md).__name__ == "XFormersMetadata" and md.num_decode_tokens == 1


def test_block_sparse_rejected():
    with pytest.raises(ValueError, match="XFormers does not support block-sparse attention"):
        XFormersImpl(
            4,
            64,
            0.1,
            blocksparse_params={"local_blocks": 2},
            num_kv_heads=4,
            alibi_slopes=None,
            sliding_window=None,
            kv_cache_dtype="auto",
        )

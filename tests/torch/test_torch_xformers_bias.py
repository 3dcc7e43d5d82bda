"""XFORMERS' tensor biases as xformers' CUDA kernel takes them, checked by xformers' own input
validation (it runs on CPU tensors, without a kernel):

- `fmha.Inputs.validate_inputs()`: a tensor bias (or the tensor inside
  `LowerTriangularMaskWithTensorBias`) must be `(B, H, Mq, Mk)` for BMHK inputs;
- cutlass' `_check_bias_alignment`: every stride but the last a multiple of 8 elements (16
  bytes of a 16-bit bias), the last 1; and the bias must be in the query's dtype, on its device,
  of a bias type the cutlass op supports.

Every attention type (decoder prefill, chunked prefill, encoder / encoder-only, cross
attention) meets every bias (plain mask, ALiBi, window, ALiBi with a window), with lengths
that are not multiples of 8. Before this, ALiBi and window biases were `[H, Tq, Tk]` float32
on the CPU without padding, and xformers on CUDA refused them.
"""

import pytest
import torch
from torch_cases import alibi

pytest.importorskip("xformers", reason="xformers is not installed in this environment")

from xformers.ops import fmha
from xformers.ops.fmha import cutlass
from xformers.ops.fmha.attn_bias import LowerTriangularMaskWithTensorBias

from torch_backends.xformers import XFormersImpl

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 6, 2, 64

# (attention type, causal, q_lens, kv_lens)
STEPS = [
    ("decoder-prefill", True, [5, 17, 1], [5, 17, 1]),
    ("chunked-prefill", True, [3, 9], [19, 9]),
    ("encoder", False, [7, 13], [7, 13]),
    ("cross", False, [3, 6], [11, 5]),
]
BIASES = {
    "mask": {},
    "alibi": {"alibi_slopes": alibi(NUM_HEADS)},
    "window": {"sliding_window": 4},
    "alibi-window": {"alibi_slopes": alibi(NUM_HEADS), "sliding_window": 4},
}


def _tensor_of(bias):
    if isinstance(bias, LowerTriangularMaskWithTensorBias):
        return bias._bias
    return bias if isinstance(bias, torch.Tensor) else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bias_name", list(BIASES))
@pytest.mark.parametrize(("step", "causal", "q_lens", "kv_lens"), STEPS, ids=[s[0] for s in STEPS])
def test_biases_pass_xformers_input_checks(step, causal, q_lens, kv_lens, bias_name, dtype):
    biases = dict(alibi_slopes=None, sliding_window=None) | BIASES[bias_name]
    impl = XFormersImpl(NUM_HEADS, HEAD_SIZE, 0.125, NUM_KV_HEADS, kv_cache_dtype="auto", **biases)
    device = torch.device("cpu")
    bias = impl.make_attn_bias(q_lens, kv_lens, causal, dtype=dtype, device=device)
    # One bias for the whole step (a block-diagonal mask), or one per sequence.
    pieces = bias if isinstance(bias, list) else [bias]
    lens = list(zip(q_lens, kv_lens, strict=True)) if isinstance(bias, list) else None
    if lens is None:
        lens = [(sum(q_lens), sum(kv_lens))]
    assert len(pieces) == len(lens)
    tensors = 0
    for piece, (q_len, kv_len) in zip(pieces, lens, strict=True):
        # BMHK, kv heads repeated for GQA, as XFormersImpl._run calls the kernel.
        query = torch.randn(1, q_len, NUM_HEADS, HEAD_SIZE, dtype=dtype)
        key = torch.randn(1, kv_len, NUM_HEADS, HEAD_SIZE, dtype=dtype)
        inputs = fmha.Inputs(query, key, key.clone(), attn_bias=piece, scale=0.125)
        inputs.validate_inputs()  # raises on a wrong bias shape
        assert type(piece) in cutlass.FwOp.SUPPORTED_ATTN_BIAS_TYPES, type(piece)
        reasons: list[str] = []
        cutlass._check_bias_alignment(reasons, piece)
        assert reasons == [], reasons
        tensor = _tensor_of(piece)
        if tensor is not None:
            tensors += 1
            assert tensor.shape == (1, NUM_HEADS, q_len, kv_len)
            assert tensor.dtype == dtype and tensor.device == device
            assert all(s % 8 == 0 for s in tensor.stride()[:-1]), tensor.stride()
    if bias_name == "mask" or (bias_name == "window" and causal):
        assert tensors == 0  # xformers' own mask objects, no tensor
    else:
        assert tensors == len(pieces)


def test_alibi_bias_values(rng):
    """The padded, sliced bias holds `slope_h * (p_k - p_q)` where kept and -inf elsewhere,
    bottom-right aligned (a chunk of 3 queries over 10 keys)."""
    slopes = alibi(NUM_HEADS)
    impl = XFormersImpl(
        NUM_HEADS,
        HEAD_SIZE,
        0.125,
        NUM_KV_HEADS,
        alibi_slopes=slopes,
        sliding_window=None,
        kv_cache_dtype="auto",
    )
    (bias,) = impl.make_attn_bias([3], [10], True)
    tensor = _tensor_of(bias)
    assert tensor.shape == (1, NUM_HEADS, 3, 10) and tensor.stride() == (NUM_HEADS * 48, 48, 16, 1)
    p_q = torch.arange(7, 10)[:, None]
    p_k = torch.arange(10)[None, :]
    expected = torch.tensor(slopes)[:, None, None] * (p_k - p_q)[None].float()
    expected = expected.masked_fill((p_k > p_q)[None], float("-inf"))
    torch.testing.assert_close(tensor[0], expected, rtol=0, atol=0)


def test_compiled_ops_problem_says_what_to_install(monkeypatch):
    """`jax-attn info` says when xformers' C++/CUDA ops did not load, and which pair to
    install; nothing when they did."""
    from xformers import _cpp_lib

    from torch_backends import xformers as xf

    build = _cpp_lib._BuildInfo({"version": {"torch": "2.10.0+cu128", "cuda": 1208}})
    monkeypatch.setattr(
        _cpp_lib, "_cpp_library_load_exception", _cpp_lib.xFormersInvalidLibException(build)
    )
    problem = xf.compiled_ops_problem()
    assert "compiled ops did not load (built for torch 2.10.0+cu128, CUDA 1208)" in problem
    assert "jax-attn[xformers-cuda]" in problem
    monkeypatch.setattr(_cpp_lib, "_cpp_library_load_exception", None)
    assert xf.compiled_ops_problem() is None

"""The builders fed by vLLM's CPU model runner (`input_builder.input_data`, as
`ModelInputForCPUBuilder` fills it) give the metadata the standalone path gives for the same
step, and the runner's own quirks are taken as they come: prefill tables that are None
(encoder-only models), decode tables trimmed to the sliding window's blocks."""

import types

import pytest
import torch

from torch_backends import AttentionLayer, get_attn_backend

# |<- prefill_0 (5) ->|<- prefill_1 (3 new after 6 cached) ->|d0|d1|, block size 8
SEQ_LENS, QUERY_LENS = [5, 9, 10, 3], [5, 3, 1, 1]
TABLES = [[3], [7, 1], [4, 10], [6]]


def runner(chunked_prefill: bool, prefill_tables=None, decode_tables=None, seq_lens=SEQ_LENS):
    """What vLLM's CPU runner hands a builder: `chunked_prefill` and the step's input_data."""
    slots = (
        [3 * 8 + i for i in range(5)] + [7 * 8 + 6, 7 * 8 + 7, 1 * 8 + 0] + [10 * 8 + 1, 6 * 8 + 2]
    )
    data = types.SimpleNamespace(
        seq_lens=list(seq_lens),
        query_lens=list(QUERY_LENS),
        prefill_block_tables=prefill_tables if prefill_tables is not None else TABLES[:2],
        decode_block_tables=decode_tables if decode_tables is not None else TABLES[2:],
        max_decode_seq_len=max(seq_lens[2:], default=0),
        num_prefills=2,
        num_prefill_tokens=8,
        num_decode_tokens=2,
        slot_mapping=slots,
        multi_modal_inputs_list=[],
    )
    return types.SimpleNamespace(chunked_prefill=chunked_prefill, input_data=data)


def _fields(md) -> dict:
    return {
        k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in md.asdict_zerocopy().items()
    }


@pytest.mark.parametrize("backend", ["TORCH_SDPA", "XFORMERS", "JAX"])
def test_runner_and_standalone_builds_agree(backend):
    if backend == "XFORMERS":
        pytest.importorskip("xformers", reason="xformers is not installed here")
    if backend == "JAX":
        pytest.importorskip("jax", reason="jax is not installed here")
    builder_cls = get_attn_backend(backend).get_builder_cls()
    from_runner = builder_cls(runner(True)).build(SEQ_LENS, QUERY_LENS, -1, -1)
    standalone = builder_cls(None).build(
        SEQ_LENS, QUERY_LENS, -1, -1, block_tables=TABLES, block_size=8
    )
    assert _fields(from_runner) == _fields(standalone)


def test_runner_without_chunked_prefill_gives_prefills_no_tables():
    builder_cls = get_attn_backend("TORCH_SDPA").get_builder_cls()
    md = builder_cls(runner(False)).build(SEQ_LENS, QUERY_LENS, -1, -1)
    assert md.prefill_block_tables is None and md.query_start_loc is None
    assert md.seq_lens == [5, 9] and md.seq_lens_tensor.tolist() == [10, 3]


def test_runner_encoder_only_step_has_no_tables():
    """vLLM's pooling runner: every sequence a prefill, block tables None, no slots."""
    data = types.SimpleNamespace(
        seq_lens=[4, 2], query_lens=[4, 2], prefill_block_tables=[None, None],
        decode_block_tables=[], max_decode_seq_len=0, num_prefills=2, num_prefill_tokens=6,
        num_decode_tokens=0, slot_mapping=[], multi_modal_inputs_list=[],
    )  # fmt: skip
    builder = get_attn_backend("TORCH_SDPA").get_builder_cls()(
        types.SimpleNamespace(chunked_prefill=False, input_data=data)
    )
    md = builder.build([4, 2], [4, 2], -1, -1)
    assert md.seq_lens == [4, 2] and md.slot_mapping.numel() == 0


def test_build_must_match_the_runner():
    builder = get_attn_backend("TORCH_SDPA").get_builder_cls()(runner(True))
    with pytest.raises(ValueError, match=r"does not match the runner's step"):
        builder.build([5, 9, 10], QUERY_LENS[:3], -1, -1)


def test_window_trimmed_decode_is_exact(rng):
    """vLLM's CPU runner trims a decode's table and length to the sliding window's blocks:
    the decode's output is the same as from the whole table (the window is relative)."""
    backend_cls = get_attn_backend("TORCH_SDPA")
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    kv_cache = torch.randn(backend_cls.get_kv_cache_shape(12, 8, 2, 64), generator=gen)
    impl = backend_cls.get_impl_cls()(4, 64, 0.125, 2, None, 5, "auto")
    q = torch.randn(1, 256, generator=gen)
    # seq_len 20, window 5: keys 15..19; the runner starts the table at block 1 (position 8).
    whole = runner(False, prefill_tables=[], decode_tables=[[4, 10, 6]], seq_lens=[20])
    trimmed = runner(False, prefill_tables=[], decode_tables=[[10, 6]], seq_lens=[12])
    outs = []
    for r, seq_len in ((whole, 20), (trimmed, 12)):
        data = r.input_data
        data.query_lens, data.num_prefills, data.num_prefill_tokens = [1], 0, 0
        data.num_decode_tokens, data.slot_mapping = 1, [-1]
        data.max_decode_seq_len = seq_len
        md = backend_cls.get_builder_cls()(r).build([seq_len], [1], -1, -1)
        outs.append(impl.forward(AttentionLayer(), q, None, None, kv_cache, md))
    assert torch.equal(outs[0], outs[1])

"""The vLLM plugin's pieces without an engine (torch_backends/vllm_plugin.py, vllm_v1.py): the
switch (`JAX_ATTN_VLLM`), the builder and impl against the float64 oracle over vLLM-shaped,
NaN-poisoned caches (a cached prefix written by an earlier step, then one mixed step: prefill,
chunk over the prefix, decodes, padding rows), encoder-only attention, and the refusals, each
naming the feature. Runs in the vllm env (vLLM 0.32); engine runs: test_vllm_v1_engine.py."""

import tomllib
import types
from pathlib import Path

import pytest
import torch

# vLLM 0.32 (the vllm env); elsewhere none, or vLLM 0.8.5 (the vllm085 env), whose vllm.v1 lacks
# what this imports.
pytest.importorskip("vllm", minversion="0.32", reason="vLLM 0.32 is not installed here")

import vllm
from tolerances import assert_close
from torch_cases import reference_attention
from vllm.config import VllmConfig
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
)

from torch_backends import native, vllm_plugin, vllm_v1

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not vllm.__version__.startswith("0.32."),
        reason=f"vLLM 0.32 is needed (this is vLLM {vllm.__version__})",
    ),
    pytest.mark.skipif(
        native.unavailable_reason() is not None,
        reason=f"native torch ops not available: {native.unavailable_reason()}",
    ),
]

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# The switch


def test_entry_point_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    plugins = project["entry-points"]["vllm.general_plugins"]
    assert plugins == {"jax_attn": "torch_backends.vllm_plugin:register"}


def test_register_only_with_the_variable(monkeypatch):
    cpu_attn = AttentionBackendEnum.CPU_ATTN
    cpu_attn.clear_override()
    try:
        for value in (None, "0", "", "true"):
            if value is None:
                monkeypatch.delenv(vllm_plugin.ENV, raising=False)
            else:
                monkeypatch.setenv(vllm_plugin.ENV, value)
            vllm_plugin.register()
            assert not cpu_attn.is_overridden(), value
        monkeypatch.setenv(vllm_plugin.ENV, "1")
        vllm_plugin.register()
        vllm_plugin.register()  # vLLM may call it again
        assert cpu_attn.get_class() is vllm_v1.NativeCPUAttentionBackend
        assert cpu_attn.get_class().get_name() == "CPU_ATTN"
    finally:
        cpu_attn.clear_override()
    assert cpu_attn.get_path() == "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"


# ---------------------------------------------------------------------------------------------
# Builder and impl against the oracle

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
NAN_BYTE = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0xFF}


def _builder(block_size, num_kv_heads, head_size, dtype, spec=FullAttentionSpec):
    kv_spec = spec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype
    )
    return vllm_v1.NativeCPUAttentionMetadataBuilder(
        kv_spec, ["layer"], VllmConfig(), torch.device("cpu")
    )


def _common(q_lens, seq_lens, block_table, slots, pad_tokens, causal=True):
    """vLLM's CommonAttentionMetadata for one step (the query padded by `pad_tokens` rows)."""
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    num_tokens = sum(q_lens)
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(q_lens),
        num_actual_tokens=num_tokens,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=block_table,
        slot_mapping=torch.cat([slots, torch.full((pad_tokens,), -1, dtype=torch.int64)]),
        causal=causal,
    )


def _slots(block_table, seq, positions, block_size):
    """slot = page * BS + offset: positions [30, 31, 32] of a row [3, 8] with block size 32 are
    slots [126, 127, 256]."""
    positions = torch.as_tensor(positions)
    return block_table[seq, positions // block_size].long() * block_size + positions % block_size


def _block_table(seq_lens, block_size, gen, spare, width=0):
    """Each sequence's blocks drawn at random from a cache of its blocks plus `spare`; a table
    `width` columns wider than the longest sequence needs (zeros past each one's blocks)."""
    nb_used = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(nb_used) + spare
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_table = torch.zeros(len(seq_lens), max(nb_used) + width, dtype=torch.int32)
    start = 0
    for s, nb in enumerate(nb_used):
        block_table[s, :nb] = ids[start : start + nb]
        start += nb
    return block_table, num_blocks


def _poisoned_cache(num_blocks, num_kv_heads, block_size, head_size, dtype, kv_cache_dtype):
    """vLLM's cache for a layer ([NB, Hkv, BS, 2 * D], fp8 as uint8), every byte NaN."""
    cache_dtype = torch.uint8 if kv_cache_dtype in FP8 else dtype
    fill = NAN_BYTE[FP8[kv_cache_dtype]] if kv_cache_dtype in FP8 else float("nan")
    shape = (num_blocks, num_kv_heads, block_size, 2 * head_size)
    return cache_dtype, torch.full(shape, fill, dtype=cache_dtype)


def _as_stored(x, scale, kv_cache_dtype):
    """What the cache holds for rows `x`, read back as float64 (fp8: saturated x / scale)."""
    if kv_cache_dtype in FP8:
        fp8 = FP8[kv_cache_dtype]
        limit = torch.finfo(fp8).max
        return (x.float() / scale).clamp(-limit, limit).to(fp8).double() * scale
    return x.double()


CASES = {
    "f32-gqa4-bs16": dict(dtype=torch.float32, block_size=16),
    "bf16-gqa4-bs32": dict(dtype=torch.bfloat16, block_size=32),
    "f16-mqa-bs16": dict(dtype=torch.float16, block_size=16, num_kv_heads=1),
    "f32-window": dict(dtype=torch.float32, block_size=16, sliding_window=11),
    "f32-alibi-softcap": dict(dtype=torch.float32, block_size=32, alibi=True, soft_cap=9.0),
    "bf16-fp8-e4m3": dict(dtype=torch.bfloat16, block_size=32, kv_cache_dtype="fp8"),
    "f32-fp8-e5m2-bs16": dict(dtype=torch.float32, block_size=16, kv_cache_dtype="fp8_e5m2"),
    "f32-non-causal": dict(dtype=torch.float32, block_size=16, causal=False),
    "bf16-sinks-window": dict(dtype=torch.bfloat16, block_size=32, sinks=True, sliding_window=20),
    "f32-sinks-fp8": dict(dtype=torch.float32, block_size=16, sinks=True, kv_cache_dtype="fp8"),
    # The engine's shapes: block 128, Hq 32 / Hkv 8, D 128; a 300-token prefill (three key
    # steps of the ragged kernel), a chunk over a 1000-token prefix, and four decodes of which
    # three pass 512 keys (the decode kernel, split over the workers); soft cap, ALiBi.
    "bf16-serving-shapes": dict(dtype=torch.bfloat16, block_size=128, serving=True),
    "f32-serving-shapes-cap-alibi": dict(
        dtype=torch.float32, block_size=128, serving=True, soft_cap=30.0, alibi=True),
    # Head size 512 (CPU_ATTN's largest): past the decode kernel's 256, so the step's decodes
    # stay in the ragged kernel's tiles.
    "bf16-serving-head-512": dict(
        dtype=torch.bfloat16, block_size=128, serving=True, num_heads=8, num_kv_heads=2,
        head_size=512),
    "f32-head-512-fp8-window": dict(
        dtype=torch.float32, block_size=32, head_size=512, kv_cache_dtype="fp8",
        sliding_window=20),
}  # fmt: skip
SERVING = dict(
    num_heads=32, num_kv_heads=8, head_size=128,
    q_lens=[1, 1, 1, 1, 300, 40], seq_lens=[700, 2100, 90, 1301, 300, 1040],
)  # fmt: skip


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_step_matches_the_oracle(case, seed):
    kw = CASES[case]
    dtype, block_size = kw["dtype"], kw["block_size"]
    shapes = SERVING if kw.get("serving") else {}
    shapes = shapes | {k: kw[k] for k in ("num_heads", "num_kv_heads", "head_size") if k in kw}
    num_heads, head_size = shapes.get("num_heads", 8), shapes.get("head_size", 64)
    num_kv_heads = shapes.get("num_kv_heads", 2)
    kv_cache_dtype = kw.get("kv_cache_dtype", "auto")
    causal = kw.get("causal", True)
    k_scale, v_scale = (0.8, 1.3) if kv_cache_dtype != "auto" else (1.0, 1.0)
    gen = torch.Generator().manual_seed(seed)
    # A prefill, a chunk of 9 over a 31-token prefix, two decodes (one at a block's first slot).
    q_lens, seq_lens = [17, 9, 1, 1], [17, 40, 33, 2 * block_size + 1]
    if kw.get("serving"):  # decodes first, as vLLM orders a step (reorder_batch_threshold)
        q_lens, seq_lens = shapes["q_lens"], shapes["seq_lens"]
    pad_tokens = 3

    block_table, num_blocks = _block_table(seq_lens, block_size, gen, spare=3, width=1)
    cache_dtype, kv_cache = _poisoned_cache(
        num_blocks, num_kv_heads, block_size, head_size, dtype, kv_cache_dtype
    )
    alibi = (
        torch.linspace(0.05, 0.5, num_heads).tolist() if kw.get("alibi") else None
    )  # fmt: skip
    # gpt-oss's sinks: a bf16 parameter per head, filled after the layer is built.
    sinks = torch.empty(num_heads, dtype=torch.bfloat16) if kw.get("sinks") else None
    impl = vllm_v1.NativeCPUAttentionImpl(
        num_heads, head_size, head_size**-0.5, num_kv_heads, alibi, kw.get("sliding_window"),
        kv_cache_dtype, kw.get("soft_cap"), sinks=sinks,
    )  # fmt: skip
    if sinks is not None:
        sinks.copy_(3.0 * torch.randn(num_heads, generator=gen))
    layer = types.SimpleNamespace(_k_scale_float=k_scale, _v_scale_float=v_scale)
    keys = [torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype) for n in seq_lens]
    values = [torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype) for n in seq_lens]

    # An earlier step wrote each cached prefix (the tokens before this step's queries).
    prefix = [
        (s, torch.arange(n - q)) for s, (q, n) in enumerate(zip(q_lens, seq_lens, strict=True))
    ]
    slots = torch.cat([_slots(block_table, s, p, block_size) for s, p in prefix])
    impl.do_kv_cache_update(
        layer,
        torch.cat([keys[s][p] for s, p in prefix]),
        torch.cat([values[s][p] for s, p in prefix]),
        kv_cache,
        slots,
    )
    # This step: its rows, then padding rows the engine may add (slot -1, never written).
    new = [
        (s, torch.arange(n - q, n)) for s, (q, n) in enumerate(zip(q_lens, seq_lens, strict=True))
    ]
    slots = torch.cat([_slots(block_table, s, p, block_size) for s, p in new])
    pad = torch.randn(pad_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    step_keys = torch.cat([*(keys[s][p] for s, p in new), pad])
    step_values = torch.cat([*(values[s][p] for s, p in new), pad])
    common = _common(q_lens, seq_lens, block_table, slots, pad_tokens, causal=causal)
    metadata = _builder(block_size, num_kv_heads, head_size, cache_dtype).build(0, common)
    impl.do_kv_cache_update(layer, step_keys, step_values, kv_cache, common.slot_mapping)
    query = torch.randn(sum(q_lens) + pad_tokens, num_heads, head_size, generator=gen).to(dtype)
    output = torch.full_like(query, 7.0)
    impl.forward(layer, query, step_keys, step_values, kv_cache, metadata, output)

    expected = reference_attention(
        query[: sum(q_lens)],
        _as_stored(torch.cat(keys), k_scale, kv_cache_dtype),
        _as_stored(torch.cat(values), v_scale, kv_cache_dtype),
        q_lens,
        seq_lens,
        causal=causal,
        scale=head_size**-0.5,
        alibi_slopes=alibi,
        sliding_window=kw.get("sliding_window"),
        logits_soft_cap=kw.get("soft_cap"),
        sinks=sinks,
    )
    fp8 = FP8.get(kv_cache_dtype)
    assert_close(output[: sum(q_lens)].double(), expected, dtype, fp8)
    assert (output[sum(q_lens) :] == 7.0).all()  # padding rows are left alone


@pytest.mark.parametrize(
    "dtype, kv_cache_dtype", [(torch.float32, "auto"), (torch.bfloat16, "fp8")]
)
def test_cross_attention_reads_the_encoders_keys(dtype, kv_cache_dtype, seed):
    """Encoder-decoder cross-attention as vLLM drives it: the encoder's keys and values written
    into the layer's cache by the first decoder step (the encoder's slots), read without a
    causal mask by that step's decoder tokens and by a later decode step that writes nothing;
    against the float64 oracle over a NaN-poisoned cache."""
    num_heads, num_kv_heads, head_size, block_size = 8, 2, 64, 16
    enc_lens, q_lens = [40, 75, 16], [3, 5, 1]
    k_scale, v_scale = (0.8, 1.3) if kv_cache_dtype != "auto" else (1.0, 1.0)
    gen = torch.Generator().manual_seed(seed)
    block_table, num_blocks = _block_table(enc_lens, block_size, gen, spare=2)
    cache_dtype, kv_cache = _poisoned_cache(
        num_blocks, num_kv_heads, block_size, head_size, dtype, kv_cache_dtype
    )
    impl = vllm_v1.NativeCPUAttentionImpl(
        num_heads, head_size, head_size**-0.5, num_kv_heads, None, None, kv_cache_dtype,
        attn_type=AttentionType.ENCODER_DECODER,
    )  # fmt: skip
    layer = types.SimpleNamespace(_k_scale_float=k_scale, _v_scale_float=v_scale)
    keys = torch.randn(sum(enc_lens), num_kv_heads, head_size, generator=gen).to(dtype)
    values = torch.randn(sum(enc_lens), num_kv_heads, head_size, generator=gen).to(dtype)
    slots = torch.cat([_slots(block_table, s, torch.arange(n), block_size)
                       for s, n in enumerate(enc_lens)])  # fmt: skip
    builder = _builder(block_size, num_kv_heads, head_size, cache_dtype, CrossAttentionSpec)
    fp8 = FP8.get(kv_cache_dtype)
    for lens, key, value in [(q_lens, keys, values), ([1, 1, 1], None, None)]:
        common = _common(lens, enc_lens, block_table, slots, 0, causal=True)
        metadata = builder.build(0, common)
        assert metadata.causal is False
        if key is not None:  # vLLM updates the cache only where the step brings keys
            impl.do_kv_cache_update(layer, key, value, kv_cache, slots)
        query = torch.randn(sum(lens), num_heads, head_size, generator=gen).to(dtype)
        output = torch.full_like(query, 7.0)
        impl.forward(layer, query, key, value, kv_cache, metadata, output)
        expected = reference_attention(
            query, _as_stored(keys, k_scale, kv_cache_dtype),
            _as_stored(values, v_scale, kv_cache_dtype), lens, enc_lens,
            causal=False, scale=head_size**-0.5,
        )  # fmt: skip
        assert_close(output.double(), expected, dtype, fp8)


def test_cross_attention_refuses_more_decoder_tokens_than_encoder_tokens():
    builder = _builder(16, 2, 64, torch.float32, CrossAttentionSpec)
    common = _common([5, 9], [8, 4], torch.zeros(2, 1, dtype=torch.int32), torch.arange(12), 0)
    with pytest.raises(NotImplementedError, match=r"JAX_ATTN_VLLM=1.*more decoder tokens"):
        builder.build(0, common)


def test_builder_asks_for_a_steps_decodes_first():
    """vLLM reorders the persistent batch so that requests of at most this many new tokens come
    first: a step's decodes then reach the ragged kernel as one run (one decode-kernel call)."""
    assert _builder(16, 2, 32, torch.float32).reorder_batch_threshold == 1


@pytest.mark.parametrize("layout", ["separate", "fused-qkv"])
@pytest.mark.parametrize("attn_type", [AttentionType.ENCODER_ONLY, AttentionType.ENCODER])
def test_encoder_attention_reads_the_step_itself(attn_type, layout, seed):
    """The step's keys and values as its cache; as vLLM hands them over (the k and v slices of
    one fused qkv projection, rows (Hq + 2 Hkv) * D apart) they are read where they lie, with
    the bits of dense copies. The two rows past the step's tokens are NaN: never read."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, head_size, q_lens = 4, 2, 32, [5, 1, 12]
    impl = vllm_v1.NativeCPUAttentionImpl(
        num_heads, head_size, 0.2, num_kv_heads, None, None, "auto", attn_type=attn_type
    )
    layer = types.SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0)
    T = sum(q_lens)
    widths = [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size]
    if layout == "fused-qkv":
        parts = torch.randn(T + 2, sum(widths), generator=gen).split(widths, dim=1)
    else:
        parts = [torch.randn(T + 2, w, generator=gen) for w in widths]
    query, key, value = (x.view(T + 2, -1, head_size) for x in parts)
    key[T:] = value[T:] = float("nan")
    key_cache, value_cache, step = vllm_v1._encoder_caches(key, value, T)
    if layout == "fused-qkv":  # views of the projection: nothing copied
        assert step == num_heads // num_kv_heads + 2
        assert key_cache.data_ptr() == key.data_ptr()
        assert value_cache.data_ptr() == value.data_ptr()
    assert torch.equal(key_cache[::step, 0], key[:T])
    assert torch.equal(value_cache[::step, 0], value[:T])
    common = _common(q_lens, q_lens, torch.zeros(3, 1, dtype=torch.int32),
                     torch.full((T,), -1, dtype=torch.int64), 2, causal=False)  # fmt: skip
    builder = _builder(16, num_kv_heads, head_size, torch.float32, EncoderOnlyAttentionSpec)
    metadata = builder.build(0, common)
    output = torch.zeros_like(query)
    empty = torch.empty(0)  # encoder layers have no cache
    impl.do_kv_cache_update(layer, key, value, empty, common.slot_mapping)
    impl.forward(layer, query, key, value, empty, metadata, output)
    expected = reference_attention(query[:T], key[:T], value[:T], q_lens, q_lens, causal=False,
                                   scale=0.2)  # fmt: skip
    assert_close(output[:T], expected, torch.float32)
    dense = torch.zeros_like(query)
    impl.forward(layer, query.contiguous(), key.contiguous(), value.contiguous(), empty, metadata,
                 dense)  # fmt: skip
    assert torch.equal(output, dense)


# ---------------------------------------------------------------------------------------------
# Refusals, by name


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(attn_type="bidirectional-ish"), r"attention type bidirectional-ish"),
        (dict(head_size=640), "head size 640"),
        (dict(kv_cache_dtype="fp8_inc"), "kv_cache_dtype='fp8_inc'"),
        (dict(use_alibi_sqrt=True), r"attention arguments \['use_alibi_sqrt'\]"),
    ],
    ids=["attention-type", "head-640", "fp8-inc", "extra-argument"],
)
def test_refuses_what_it_cannot_run(kw, match):
    args = dict(num_heads=8, head_size=64, scale=0.1, num_kv_heads=2) | kw
    with pytest.raises(NotImplementedError, match=f"JAX_ATTN_VLLM=1.*{match}"):
        vllm_v1.NativeCPUAttentionImpl(**args)


def test_sinks_must_be_one_per_head():
    with pytest.raises(ValueError, match=r"sinks must be \[num_heads=8\], got \(4,\)"):
        vllm_v1.NativeCPUAttentionImpl(8, 64, 0.1, 2, sinks=torch.zeros(4))


def test_refuses_block_size_not_a_multiple_of_16():
    with pytest.raises(ValueError, match="block size 8 is not supported"):
        _builder(8, 2, 64, torch.float32)
    assert vllm_v1.NativeCPUAttentionBackend.supports_block_size(16)
    assert not vllm_v1.NativeCPUAttentionBackend.supports_block_size(8)


def test_refuses_per_request_causal_masks():
    common = _common([3], [3], torch.zeros(1, 1, dtype=torch.int32),
                     torch.arange(3, dtype=torch.int64), 0)  # fmt: skip
    common.causal = torch.ones(1, dtype=torch.bool)
    with pytest.raises(NotImplementedError, match="per-request causal masks"):
        _builder(16, 2, 64, torch.float32).build(0, common)


def test_refuses_a_cache_that_is_not_dense_pages():
    impl = vllm_v1.NativeCPUAttentionImpl(4, 32, 0.1, 2)
    layer = types.SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0)
    # LBNHC seen through vLLM's logical [NB, Hkv, BS, 2D] view: not dense in that order.
    kv_cache = torch.zeros(3, 16, 2, 64).permute(0, 2, 1, 3)
    key = torch.zeros(1, 2, 32)
    with pytest.raises(ValueError, match=r"dense pages .* \(the LBHNC layout\)"):
        impl.do_kv_cache_update(layer, key, key, kv_cache, torch.zeros(1, dtype=torch.int64))


def test_refuses_at_build_where_the_native_ops_do_not_run(monkeypatch):
    monkeypatch.setenv("JAX_ATTN_CPU_DISABLE", "1")
    vllm_v1._announce_native_kernels.cache_clear()
    with pytest.raises(RuntimeError, match="do not run here: disabled by JAX_ATTN_CPU_DISABLE=1"):
        vllm_v1.NativeCPUAttentionImpl(4, 32, 0.1, 2)


def test_the_first_layer_says_what_runs(monkeypatch):
    said = []
    monkeypatch.setattr(vllm_v1.logger, "info", lambda *a: said.append(a[0] % a[1:]))
    vllm_v1._announce_native_kernels.cache_clear()
    for _ in range(3):
        vllm_v1.NativeCPUAttentionImpl(4, 32, 0.1, 2)
    assert said == [f"jax-attn: CPU_ATTN runs on jax-attn's native kernels ({native.isa()})"]
    assert "vectors:" in said[0]


# ---------------------------------------------------------------------------------------------
# Huge pages


@pytest.mark.parametrize("switch", [None, "0"])
def test_a_cache_meets_huge_pages_once(monkeypatch, switch):
    """The first update of a layer's cache hands its zero chunks to huge_pages, populated at
    once, once per cache; JAX_ATTN_VLLM_HUGE_PAGES=0 never. The stored rows are the same either
    way."""
    monkeypatch.setattr(vllm_v1.huge_pages, "_SEEN", set())
    if switch is None:
        monkeypatch.delenv(vllm_v1.HUGE_PAGES_ENV, raising=False)
    else:
        monkeypatch.setenv(vllm_v1.HUGE_PAGES_ENV, switch)
    calls = []
    real = vllm_v1.huge_pages.rebacked_zero_chunks

    def spy(tensor, populate=False):
        calls.append((tensor.data_ptr(), populate))
        return real(tensor, populate=populate)

    monkeypatch.setattr(vllm_v1.huge_pages, "rebacked_zero_chunks", spy)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    impl = vllm_v1.NativeCPUAttentionImpl(8, 64, 0.125, 2)
    layer = types.SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0)
    caches = [torch.zeros(96, 2, 128, 128) for _ in range(2)]  # 96 blocks of 128 slots: 12 MiB each
    expected = [torch.zeros_like(c) for c in caches]
    for _ in range(3):  # three steps
        for cache, want in zip(caches, expected, strict=True):
            slots = torch.randperm(96 * 128, generator=gen)[:5]
            key = torch.randn(5, 2, 64, generator=gen)
            value = torch.randn(5, 2, 64, generator=gen)
            impl.do_kv_cache_update(layer, key, value, cache, slots)
            pages = want.view(96, 2, 128, 2, 64)
            pages[slots // 128, 0, slots % 128] = key
            pages[slots // 128, 1, slots % 128] = value
    assert calls == ([] if switch == "0" else [(c.data_ptr(), True) for c in caches])
    for cache, want in zip(caches, expected, strict=True):
        assert torch.equal(cache, want)

"""The Pallas TPU kernels (`pallas.tpu_attention`) through Pallas' TPU interpreter, on CPU.

The interpreter runs the kernels' own DMAs, semaphores, scalar memory and double buffering,
so these are the kernels a TPU compiles (tests/jax/test_tpu_compile.py compiles them for
described chips), checked against the NumPy float64 oracles of the GPU kernels' tests on the
same batches: blocks in random order, NaN in unused blocks, in tail slots and in padding
query tokens, junk ids in unused block-table entries, junk metadata rows past `num_seqs`.
The grid combines features rather than crossing them (each case costs seconds); every dtype,
page size, head size, GQA group and bias appears at least once. JAX's own TPU paged attention
runs beside ours in the same interpreter where it takes the shapes.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from paged_cases import bias_and_expected, error_dtypes, padded_ragged_inputs, workload
from test_pallas_decode import Case as DecodeCase
from test_pallas_decode import case_decode_oracle, make_decode_batch
from test_pallas_ragged import NUM_PAD_TOKENS, case_ragged_oracle, make_ragged_batch
from test_pallas_ragged import Case as RaggedCase
from tolerances import assert_close

import jax_attn
from jax_attn import paged
from jax_attn.pallas import tpu_attention

pytestmark = pytest.mark.pallas

TPU_INTERPRET = pltpu.InterpretParams()

DECODE_CASES = [
    DecodeCase(),
    *(DecodeCase(block_size=bs, seq_lens=(1, 3, 17, 300)) for bs in (8, 32, 64, 128)),
    DecodeCase(num_heads=4, num_kv_heads=4),  # GQA 1
    DecodeCase(num_heads=8, num_kv_heads=1, head_size=128),  # GQA 8 (MQA)
    DecodeCase(head_size=256, dtype="bfloat16"),
    DecodeCase(dtype="bfloat16", scales=(0.5, 2.0)),
    DecodeCase(dtype="bfloat16", cache_dtype="float8_e4m3fn", scales=(0.37, 0.61)),
    DecodeCase(dtype="float32", cache_dtype="float8_e5m2", scales=(0.8, 1.3), block_size=8),
    DecodeCase(dtype="bfloat16", cache_dtype="float32"),
    DecodeCase(alibi=True),
    *(DecodeCase(sliding_window=w, seq_lens=(1, 17, 300)) for w in (1, 16)),
    DecodeCase(soft_cap=2.0),
    DecodeCase(alibi=True, sliding_window=7, soft_cap=3.0, dtype="bfloat16", num_heads=16),
    DecodeCase(pages_per_compute_block=1, seq_lens=(9, 33, 0)),  # one page per step, empty row
    DecodeCase(pages_per_compute_block=4, sliding_window=50, seq_lens=(100, 7)),
]

RAGGED_CASES = [
    RaggedCase(),
    RaggedCase(batch="decode", block_size=8),
    RaggedCase(batch="prefill", block_size=32),
    RaggedCase(batch="chunked", block_size=64),
    RaggedCase(batch="chunked", block_size=128, head_size=128, dtype="bfloat16"),
    RaggedCase(num_heads=4, num_kv_heads=4),  # GQA 1
    RaggedCase(num_heads=16, num_kv_heads=2, batch="chunked"),  # GQA 8
    RaggedCase(head_size=256, batch="chunked", num_heads=8, num_kv_heads=1, dtype="bfloat16"),
    RaggedCase(dtype="bfloat16", scales=(0.5, 2.0)),
    RaggedCase(dtype="bfloat16", cache_dtype="float8_e4m3fn", scales=(0.37, 0.61)),
    RaggedCase(dtype="float32", cache_dtype="float8_e5m2", scales=(0.8, 1.3), batch="chunked"),
    RaggedCase(alibi=True, sliding_window=16),
    RaggedCase(sliding_window=1),
    RaggedCase(batch="chunked", sliding_window=40, block_size=8, soft_cap=2.0),
    RaggedCase(causal=False),
    RaggedCase(batch="chunked", causal=False, alibi=True, sliding_window=20, soft_cap=5.0),
    # Small tiles: sequences span several tiles, tiles start mid-page, one page per step.
    RaggedCase(block_q=8, pages_per_compute_block=1, batch="chunked"),
    RaggedCase(block_q=16, sliding_window=9, batch="prefill", num_heads=8, num_kv_heads=1),
]


def _bias(case, slopes):
    return dict(
        scale=case.head_size**-0.5,
        alibi_slopes=None if slopes is None else jnp.asarray(slopes),
        sliding_window=case.sliding_window,
        logits_soft_cap=case.soft_cap,
        k_scale=case.scales[0],
        v_scale=case.scales[1],
    )


@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_decode_matches_oracle(case, rng):
    query, kc, vc, tables, seq_lens, keys, values, slopes = make_decode_batch(case, rng)
    args = [jnp.asarray(x) for x in (query, kc, vc, tables, seq_lens)]
    out = tpu_attention.paged_decode(
        *args,
        **_bias(case, slopes),
        pages_per_compute_block=case.pages_per_compute_block,
        interpret=True,
    )
    expected = case_decode_oracle(case, query, keys, values, seq_lens, slopes)
    assert out.dtype == query.dtype and out.shape == query.shape
    assert_close(out, expected, *error_dtypes(case), what=f"TPU paged_decode {case}")


@pytest.mark.parametrize("case", RAGGED_CASES, ids=str)
def test_ragged_matches_oracle(case, rng):
    query, kc, vc, meta, keys, values, q_lens, slopes = make_ragged_batch(case, rng)
    args = [jnp.asarray(x) for x in (query, kc, vc, *meta)]
    out = tpu_attention.ragged_paged_attention(
        *args,
        **_bias(case, slopes),
        causal=case.causal,
        block_q=case.block_q,
        pages_per_compute_block=case.pages_per_compute_block,
        interpret=True,
    )
    expected = case_ragged_oracle(case, query, keys, values, q_lens, slopes)
    assert out.dtype == query.dtype and out.shape == query.shape
    assert_close(out, expected, *error_dtypes(case), what=f"TPU ragged {case}")
    # Padding tokens (NaN queries, never written by the kernel) give exact zeros.
    assert not np.any(np.asarray(out[-NUM_PAD_TOKENS:], dtype=np.float32))


@dataclasses.dataclass(frozen=True)
class EntryCase:
    num_heads: int = 8
    num_kv_heads: int = 2
    head_size: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"
    cache_dtype: str | None = None
    causal: bool = True
    alibi: bool = False
    sliding_window: int | None = None
    soft_cap: float | None = None


@pytest.mark.parametrize(
    "case",
    [EntryCase(), EntryCase(cache_dtype="float8_e4m3fn", alibi=True, sliding_window=24)],
    ids=["bf16", "fp8-alibi-window"],
)
def test_entries_run_the_tpu_kernels(case, rng):
    """`jax_attn.paged_attention` / `paged_decode` with `impl="pallas"` and the TPU interpreter
    run these kernels: a `make_workload` mixed batch (written through `write_kv`, NaN in
    padding tokens and unused memory) against the dense float64 reference."""
    w, k_scale, v_scale = workload(case, rng, [1, 37, 5, 1], [40, 0, 60, 130])
    md, query, kc, vc = padded_ragged_inputs(case, w, k_scale, v_scale, pad_seqs=2, pad_tokens=3)
    slopes, bias, expected = bias_and_expected(case, w)
    kw = dict(alibi_slopes=slopes, k_scale=k_scale, v_scale=v_scale, **bias)
    out = jax_attn.paged_attention(query, kc, vc, md, impl="pallas", interpret=TPU_INTERPRET, **kw)
    n = len(expected)
    assert_close(out[:n], expected, *error_dtypes(case), what="paged_attention pallas (TPU)")
    assert not np.any(np.asarray(out[n:], dtype=np.float32))

    decode = [i for i, q in enumerate(w.query_lens) if q == 1]
    rows = np.asarray(md.query_start_loc)[decode]
    bias.pop("causal")
    out = jax_attn.paged_decode(
        query[rows],
        kc,
        vc,
        md.block_tables[np.array(decode)],
        md.seq_lens[np.array(decode)],
        impl="pallas",
        interpret=TPU_INTERPRET,
        alibi_slopes=slopes,
        k_scale=k_scale,
        v_scale=v_scale,
        **bias,
    )
    assert_close(out, expected[rows], *error_dtypes(case), what="paged_decode pallas (TPU)")


def test_jax_tpu_paged_attention_agrees(rng):
    """JAX's own TPU paged attention (`jax.experimental.pallas.ops.tpu.paged_attention`, a
    head-major `[Hkv, NB, BS, D]` cache) in the same interpreter, on the same decode batch:
    both match the oracle and each other. Its cache is the same data transposed, unused
    memory zeroed (it multiplies masked weights into whatever the tail slots hold)."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as jax_paged

    case = DecodeCase(dtype="bfloat16", head_size=128, seq_lens=(1, 17, 64, 200), block_size=16)
    query, kc, vc, tables, seq_lens, keys, values, _ = make_decode_batch(case, rng)
    args = [jnp.asarray(x) for x in (query, kc, vc, tables, seq_lens)]
    ours = tpu_attention.paged_decode(*args, scale=case.head_size**-0.5, interpret=True)

    def head_major(cache):
        return jnp.transpose(jnp.nan_to_num(jnp.asarray(cache), nan=0.0), (2, 0, 1, 3))

    # JAX's kernel applies no scale: the query comes pre-scaled.
    scaled = (jnp.asarray(query, jnp.float32) * case.head_size**-0.5).astype(query.dtype)
    # Its table width must be a multiple of the pages per step: pad with page 0.
    width = -(-tables.shape[1] // 4) * 4
    padded = np.pad(tables, ((0, 0), (0, width - tables.shape[1])))
    # (JAX's kernel mixes float32 and bf16 in an einsum, which strict promotion refuses.)
    with (
        pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()),
        jax.numpy_dtype_promotion("standard"),
    ):
        theirs = jax_paged(
            scaled,
            head_major(kc),
            head_major(vc),
            jnp.asarray(seq_lens),
            jnp.asarray(padded),
            pages_per_compute_block=4,
        )
    expected = case_decode_oracle(case, query, keys, values, seq_lens, None)
    assert_close(ours, expected, "bfloat16", what="ours")
    assert_close(theirs, expected, "bfloat16", what="JAX's TPU paged_attention")
    assert_close(ours, np.asarray(theirs, np.float64), "bfloat16", what="ours vs JAX's")


@pytest.mark.parametrize("window", [None, 1, 5, 16, 17, 40, 1000])
@pytest.mark.parametrize("block_k", [16, 64])
def test_steps_visit_only_reachable_pages(window, block_k):
    """The steps a tile runs cover exactly the pages holding a key some query of the tile may
    see: pages wholly before the sliding window or past the diagonal are never fetched."""
    for seq_len in (1, 15, 16, 17, 100, 257):
        for q_len in (1, 5, seq_len):
            for first in range(seq_len - q_len, seq_len, 4):
                last = min(first + 3, seq_len - 1)
                lo, hi = tpu_attention._key_range(
                    first, last, seq_len, causal=True, sliding_window=window
                )
                seen = {
                    k
                    for p in range(first, last + 1)
                    for k in range(seq_len)
                    if k <= p and (window is None or p - k < window)
                }
                steps = set(range(lo // block_k, -(-hi // block_k)))
                assert steps == {k // block_k for k in seen}, (seq_len, first, last, window)


def test_plans_stay_within_the_vmem_budget():
    """Default plans: whole pages per step, query tiles a multiple of 8 tokens, and buffers well
    inside the 16 MiB a v5e kernel gets by default (each kernel also asks for its own limit)."""
    for block_size in (8, 16, 32, 64, 128):
        for hkv, group in ((1, 8), (8, 4), (32, 1)):
            for head_size, dtype in ((64, jnp.float32), (128, jnp.bfloat16), (256, jnp.float32)):
                plan = tpu_attention.make_plan(
                    block_size=block_size,
                    num_kv_heads=hkv,
                    group=group,
                    head_size=head_size,
                    cache_dtype=dtype,
                    query_dtype=dtype,
                    max_blocks=64,
                    block_q=None,
                    pages_per_step=None,
                )
                assert plan.block_q % tpu_attention.SMALL_TILE == 0
                assert plan.block_k % plan.block_size == 0 or plan.block_size % plan.block_k == 0
                assert plan.vmem_bytes <= tpu_attention._VMEM_BUDGET, plan
                assert plan.vmem_limit >= plan.vmem_bytes


def test_bad_arguments_name_the_rule(rng):
    case = RaggedCase()
    query, kc, vc, meta, *_ = make_ragged_batch(case, rng)
    args = [jnp.asarray(x) for x in (query, kc, vc, *meta)]
    with pytest.raises(ValueError, match="block_q=12 must be a multiple of 8"):
        tpu_attention.ragged_paged_attention(*args, scale=0.1, block_q=12, interpret=True)
    f16 = [args[0].astype(jnp.float16), *args[1:]]
    with pytest.raises(ValueError, match="query dtype float16 must be bfloat16 or float32"):
        tpu_attention.ragged_paged_attention(*f16, scale=0.1, interpret=False)
    assert tpu_attention.tpu_problem(jnp.bfloat16, jnp.float16, 16, 128) is not None
    assert tpu_attention.tpu_problem(jnp.bfloat16, jnp.float8_e4m3fn, 16, 96) is None


def test_pallas_on_tpu_picks_the_kernel_family():
    """impl="pallas" on CPU: `interpret=True` is the GPU kernels' interpreter, a
    `pltpu.InterpretParams` the TPU kernels'."""
    x = jnp.zeros((1, 1, 8))
    assert not paged.pallas_on_tpu(x, True)
    assert not paged.pallas_on_tpu(x, None)
    assert paged.pallas_on_tpu(x, TPU_INTERPRET)
    assert paged._pallas_kernels(x, TPU_INTERPRET) is tpu_attention
    with jax.default_device(jax.devices("cpu")[0]):
        assert paged.array_platform(jax.ShapeDtypeStruct((1,), jnp.float32)) == "cpu"


@pytest.mark.parametrize("kernel", ["decode", "ragged"])
def test_runs_of_a_page_when_a_page_is_larger_than_the_budget(kernel, monkeypatch, rng):
    """With no room for a whole page per step, a step fetches a run of one page's tokens (8 of
    each 32 here: four steps per page), and the outputs still match the oracle."""
    monkeypatch.setattr(tpu_attention, "_VMEM_BUDGET", 1)
    jax.clear_caches()  # the plan is made at trace time
    assert (
        tpu_attention.make_plan(
            block_size=32,
            num_kv_heads=2,
            group=4,
            head_size=64,
            cache_dtype=jnp.float32,
            query_dtype=jnp.float32,
            max_blocks=8,
            block_q=None,
            pages_per_step=None,
        ).block_k
        == 8
    )
    if kernel == "decode":
        case = DecodeCase(block_size=32, seq_lens=(1, 31, 70), sliding_window=40)
        test_decode_matches_oracle(case, rng)
    else:
        case = RaggedCase(batch="chunked", block_size=32, alibi=True)
        test_ragged_matches_oracle(case, rng)
    jax.clear_caches()

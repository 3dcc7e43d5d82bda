"""The native kernels on bad metadata (issue 22): under `jax.jit` no eager check runs, so the
FFI handlers are the only guard. Every bad index must come back as an error naming the
argument; none may crash the process, read outside a buffer or write past the output.

The crash repro runs in a subprocess (a crash there fails the test instead of killing pytest);
the rest calls the handlers directly through `jax.ffi.ffi_call`, past the wrappers' trace-time
shape checks, so the handlers' own element-count checks are what is tested. The seeded
bad-metadata fuzzer (`interop.bad_metadata`) runs a bounded slice here.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_attn
from interop import bad_metadata
from jax_attn import cpu
from jax_attn.cpu.paged_decode import TARGET as DECODE_TARGET
from jax_attn.cpu.ragged_paged_attention import TARGET as RAGGED_TARGET

REPO = Path(__file__).resolve().parents[2]
REASON = cpu.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"native CPU kernels: {REASON}")

# The issue's repro: T = 4 tokens, num_seqs = 0 and query_start_loc beyond the tokens. The
# handler zeroed `row_bytes * query_start_loc[0]` bytes before any check ran: glibc aborted
# ("malloc(): invalid size") on [5, 5], and [1e8, 1e8] was a SIGSEGV.
REPRO = """
    import jax, jax.numpy as jnp, numpy as np
    import jax_attn

    query = jnp.asarray(np.random.default_rng(0).standard_normal((4, 2, 8)), jnp.float32)
    cache = jnp.zeros((2, 4, 1, 8), jnp.float32)
    fn = jax.jit(lambda q, md: jax_attn.paged_attention(q, cache, cache, md, impl="cpu"))
    for start in ({starts},):
        md = jax_attn.RaggedMetadata(
            query_start_loc=jnp.asarray([start, start], jnp.int32),
            seq_lens=jnp.zeros((1,), jnp.int32),
            block_tables=jnp.zeros((1, 1), jnp.int32),
            slot_mapping=jnp.full((4,), -1, jnp.int32),
            num_seqs=jnp.int32(0),
        )
        try:
            jax.block_until_ready(fn(query, md))
            print("NO ERROR", start, flush=True)
        except Exception as e:
            print("ERROR", start, type(e).__name__, str(e).splitlines()[0][:300], flush=True)
"""


@pytest.mark.parametrize("starts", ["5", "10**8", "-3", "2**31 - 1"])
def test_issue_repro_raises_instead_of_crashing(starts):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(REPRO.format(starts=starts))],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    # A crash is a negative return code (SIGSEGV, SIGABRT) and no ERROR line.
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith("ERROR"), result.stdout
    assert "query_start_loc[0]=" in line and "num_tokens=4" in line, line


def _repro_metadata(qsl) -> jax_attn.RaggedMetadata:
    """The issue's metadata for T = 4 tokens: `num_seqs = 0`, `query_start_loc = qsl`."""
    return jax_attn.RaggedMetadata(
        query_start_loc=qsl,
        seq_lens=jnp.zeros((1,), jnp.int32),
        block_tables=jnp.zeros((1, 1), jnp.int32),
        slot_mapping=jnp.full((4,), -1, jnp.int32),
        num_seqs=jnp.int32(0),
    )


def test_issue_repro_in_process():
    """The same, in this process: under jit, and under vmap of jit (the sequential batch rule
    runs the handler once per element)."""
    query = jnp.ones((4, 2, 8), jnp.float32)
    cache = jnp.zeros((2, 4, 1, 8), jnp.float32)

    def run(qsl):
        return jax_attn.paged_attention(query, cache, cache, _repro_metadata(qsl), impl="cpu")

    with pytest.raises(Exception, match=r"query_start_loc\[0\]=5 must be in \[0, num_tokens=4\]"):
        jax.block_until_ready(jax.jit(run)(jnp.asarray([5, 5], jnp.int32)))
    batch = jnp.asarray([[0, 0], [100_000_000, 100_000_000]], jnp.int32)
    with pytest.raises(Exception, match=r"query_start_loc\[0\]=100000000"):
        jax.block_until_ready(jax.jit(jax.vmap(run))(batch))
    # Good metadata still runs: num_seqs = 0 gives zeros.
    out = jax.jit(run)(jnp.asarray([4, 4], jnp.int32))
    np.testing.assert_array_equal(np.asarray(out), 0.0)


def test_issue_repro_under_shard_map():
    """The handler sees each device's shard: under `shard_map` (a one-device mesh here; the
    sharded suites run eight) the same metadata is refused, not a crash."""
    from jax.sharding import Mesh, PartitionSpec

    mesh = Mesh(np.asarray(jax.devices()[:1]), ("tp",))
    query = jnp.ones((4, 2, 8), jnp.float32)
    cache = jnp.zeros((2, 4, 1, 8), jnp.float32)

    def run(q, kc, vc, qsl):
        return jax_attn.paged_attention(q, kc, vc, _repro_metadata(qsl), impl="cpu")

    spec = PartitionSpec(None, "tp")  # heads over "tp" (one device: the whole array)
    mapped = jax.jit(
        jax.shard_map(
            run,
            mesh=mesh,
            in_specs=(spec, PartitionSpec(None, None, "tp"), PartitionSpec(None, None, "tp"),
                      PartitionSpec()),
            out_specs=spec,
        )
    )  # fmt: skip
    with pytest.raises(Exception, match=r"query_start_loc\[0\]=100000000"):
        jax.block_until_ready(mapped(query, cache, cache, jnp.asarray([10**8] * 2, jnp.int32)))
    out = mapped(query, cache, cache, jnp.asarray([0, 0], jnp.int32))
    np.testing.assert_array_equal(np.asarray(out), 0.0)


# --------------------------------------------------------------------------------------------
# Element counts, straight into the handlers (the wrappers refuse these shapes at trace time).


def _ragged_operands(**replace):
    ops = dict(
        query=jnp.ones((4, 2, 8), jnp.float32),
        key_cache=jnp.zeros((2, 4, 1, 8), jnp.float32),
        value_cache=jnp.zeros((2, 4, 1, 8), jnp.float32),
        query_start_loc=jnp.asarray([0, 4], jnp.int32),
        seq_lens=jnp.asarray([4], jnp.int32),
        block_tables=jnp.asarray([[1]], jnp.int32),
        num_seqs=jnp.asarray(1, jnp.int32),
        k_scale=jnp.ones((), jnp.float32),
        v_scale=jnp.ones((), jnp.float32),
        alibi_slopes=jnp.zeros((0,), jnp.float32),
        sinks=jnp.zeros((0,), jnp.float32),
    )
    ops.update(replace)
    return ops


def _call_ragged(ops):
    call = jax.ffi.ffi_call(
        RAGGED_TARGET, jax.ShapeDtypeStruct(ops["query"].shape, ops["query"].dtype)
    )
    return jax.block_until_ready(
        jax.jit(lambda *a: call(*a, scale=np.float32(0.3), causal=np.int64(1),
                                sliding_window=np.int64(0), logits_soft_cap=np.float32(0)))(
            *ops.values()
        )
    )  # fmt: skip


def test_ragged_handler_checks_element_counts():
    """(A query with no heads is an empty output: XLA never calls the handler.)"""
    out = _call_ragged(_ragged_operands())  # the baseline runs
    assert out.shape == (4, 2, 8)
    cases = [
        (dict(num_seqs=jnp.zeros((0,), jnp.int32)), r"num_seqs must be a scalar.*got 0"),
        (dict(num_seqs=jnp.ones((3,), jnp.int32)), r"num_seqs must be a scalar.*got 3"),
        (dict(k_scale=jnp.zeros((0,), jnp.float32)), r"k_scale and v_scale must be scalars"),
        (dict(v_scale=jnp.ones((2,), jnp.float32)), r"k_scale and v_scale must be scalars"),
        (dict(seq_lens=jnp.asarray([4, 4], jnp.int32)), r"seq_lens must have num_seqs=1"),
        (dict(query_start_loc=jnp.asarray([0], jnp.int32)), r"query_start_loc must have num_"),
        (dict(alibi_slopes=jnp.ones((3,), jnp.float32)), r"alibi_slopes must have num_heads=2"),
        (dict(sinks=jnp.ones((3,), jnp.float32)), r"sinks must have num_heads=2 entries, got 3"),
        (
            dict(
                key_cache=jnp.zeros((2, 0, 1, 8), jnp.float32),
                value_cache=jnp.zeros((2, 0, 1, 8), jnp.float32),
            ),
            r"block_size=0 must all be >= 1",
        ),
        (dict(query=jnp.ones((4, 2, 8), jnp.int32)), r"query dtype \w+ is not supported"),
    ]
    for replace, message in cases:
        with pytest.raises(Exception, match=message):
            _call_ragged(_ragged_operands(**replace))


def test_decode_handler_checks_element_counts():
    query = jnp.ones((2, 2, 8), jnp.float32)
    cache = jnp.zeros((2, 4, 1, 8), jnp.float32)
    call = jax.ffi.ffi_call(DECODE_TARGET, jax.ShapeDtypeStruct(query.shape, query.dtype))

    def run(**replace):
        ops = dict(
            query=query,
            key_cache=cache,
            value_cache=cache,
            block_tables=jnp.asarray([[1], [0]], jnp.int32),
            seq_lens=jnp.asarray([3, 4], jnp.int32),
            alibi_slopes=jnp.zeros((0,), jnp.float32),
            sinks=jnp.zeros((0,), jnp.float32),
            k_scale=jnp.ones((), jnp.float32),
            v_scale=jnp.ones((), jnp.float32),
        )
        ops.update(replace)
        fn = jax.jit(
            lambda *a: call(*a, scale=np.float32(0.3), sliding_window=np.int64(0),
                            logits_soft_cap=np.float32(0), split_tokens=np.int64(2**62))
        )  # fmt: skip
        return jax.block_until_ready(fn(*ops.values()))

    assert run().shape == (2, 2, 8)  # split_tokens near int64's max: one part, no overflow
    cases = [
        (dict(k_scale=jnp.zeros((0,), jnp.float32)), r"k_scale and v_scale must be scalars"),
        (dict(seq_lens=jnp.asarray([3], jnp.int32)), r"seq_lens must be \[num_seqs\]"),
        (dict(seq_lens=jnp.asarray([3, 2**31 - 1], jnp.int32)), r"seq_lens\[1\]=2147483647"),
        (dict(block_tables=jnp.asarray([[1], [-(2**31)]], jnp.int32)), r"block_tables\[1, 0\]"),
        (dict(alibi_slopes=jnp.ones((3,), jnp.float32)), r"alibi_slopes must be \[num_heads\]"),
        (dict(sinks=jnp.ones((1,), jnp.float32)), r"sinks must be \[num_heads\] or empty"),
    ]
    for replace, message in cases:
        with pytest.raises(Exception, match=message):
            run(**replace)


# --------------------------------------------------------------------------------------------
# The bounded slice of the bad-metadata fuzzer.


@pytest.mark.parametrize("kernel", bad_metadata.KERNELS)
def test_bad_metadata_fuzz_slice(kernel, seed):
    examples = bad_metadata.SLICE_EXAMPLES[kernel]
    report = bad_metadata.fuzz(kernel, examples=examples, seed=seed)
    assert report.failures == [], report.summary()
    # Both outcomes were exercised: garbage refused, and valid draws run and checked.
    assert report.refused >= examples // 4, report.summary()
    assert report.ran >= examples // 10, report.summary()

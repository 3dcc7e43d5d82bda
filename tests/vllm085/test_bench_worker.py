"""The bench's `vllm085-TORCH_SDPA` worker (`benchmarks/vllm085_worker.py`) in the vllm085
environment, started directly with this interpreter: each quick workload goes through vLLM
0.8.5's own `TorchSDPABackendImpl.forward` in the child, and its output must match a float64
oracle computed here from the same arrays. What vLLM 0.8.5 cannot run on CPU without IPEX is
a skip with the reason, and the decode really is vLLM's C++ `paged_attention_v1`.
"""

import dataclasses
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.vllm085


@pytest.fixture(scope="module")
def worker():
    from benchmarks import vllm085

    worker = vllm085.Worker(
        [sys.executable, "-m", "benchmarks.vllm085_worker"], env=vllm085.worker_env()
    )
    yield worker
    worker.close()


def oracle(data) -> np.ndarray:
    """float64 causal attention, bottom-right aligned, `[T, Hq*D]`, read from the core cache."""
    spec = data.spec
    group = spec.num_heads // spec.num_kv_heads
    rows = (-1, spec.num_kv_heads, spec.head_size)
    keys = data.key_cache.astype(np.float64).reshape(rows)
    values = data.value_cache.astype(np.float64).reshape(rows)
    query = data.query.astype(np.float64)  # [T, Hq, D]
    out, start = [], 0
    for i, (q_len, seq_len) in enumerate(zip(data.query_lens, data.seq_lens, strict=True)):
        pos = np.arange(seq_len)
        slots = (
            data.block_tables[i, pos // spec.block_size] * spec.block_size + pos % spec.block_size
        )
        k = np.repeat(keys[slots], group, axis=1)  # [L, Hq, D]
        v = np.repeat(values[slots], group, axis=1)
        q = query[start : start + q_len]  # [q_len, Hq, D]
        logits = np.einsum("qhd,khd->hqk", q, k) * spec.head_size**-0.5
        q_pos = seq_len - q_len + np.arange(q_len)
        logits = np.where(pos[None, None, :] <= q_pos[None, :, None], logits, -np.inf)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out.append(np.einsum("hqk,khd->qhd", p, v).reshape(q_len, -1))
        start += q_len
    return np.concatenate(out)


@pytest.mark.parametrize(
    "name", ["decode-f32-bs16", "decode-bf16-bs16", "prefill-8x512-bs16", "mixed-bs16"]
)
def test_vllm_forward_in_the_worker_matches_the_oracle(worker, name):
    from benchmarks import vllm085
    from benchmarks.workloads import make_data, named_workloads
    from interop.tolerances import assert_close

    data = make_data(named_workloads(quick=True)[name], np.random.default_rng(1))
    prepared = vllm085.prepare(data, worker)
    assert prepared.timed() > 0
    prepared.call()
    out = prepared.output(None)
    expected = oracle(data)
    assert_close(out, expected, data.spec.dtype, data.spec.cache_dtype, what=name)
    info = prepared.info
    assert info["impl"] == "vllm.attention.backends.torch_sdpa.TorchSDPABackendImpl.forward"
    assert info["decode"] == (
        "vllm.attention.ops.ipex_attn._PagedAttention.forward_decode"
        " -> torch.ops._C.paged_attention_v1"
    )
    assert info["ipex"] is False and info["jax_imported"] is False
    assert info["vllm"].startswith("0.8.5") and info["torch"].startswith("2.6")
    prepared.close()


def test_what_vllm_cannot_run_here_is_skipped_with_the_reason(worker):
    from benchmarks import vllm085
    from benchmarks.backends import Skip
    from benchmarks.workloads import make_data, named_workloads

    specs = named_workloads(quick=True)
    fp8 = make_data(specs["decode-fp8-bs16"], np.random.default_rng(1))
    fp8_why = r"FP8 KV cache requires intel_extension_for_pytorch.*IPEX is not in the vllm085 env"
    with pytest.raises(Skip, match=fp8_why):
        vllm085.prepare(fp8, worker)
    block8 = dataclasses.replace(specs["decode-f32-bs16"], block_size=8)
    with pytest.raises(Skip, match=r"block size 16 only .*this workload: 8.*need IPEX"):
        vllm085.prepare(make_data(block8, np.random.default_rng(1)), worker)
    # The worker still serves after the skips.
    data = make_data(specs["decode-f32-bs16"], np.random.default_rng(2))
    assert vllm085.prepare(data, worker).timed() > 0

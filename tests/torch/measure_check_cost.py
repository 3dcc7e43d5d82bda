"""The cost of `checks.check_step` on a decode step, against the step itself.

    python tests/torch/measure_check_cost.py [BACKEND ...]

A decode-only step of 32 sequences (seq_len 200..1000, block size 16, Hq 32, Hkv 8, D 128,
float32), through each backend's builder: the median time of `check_step` alone and of the
whole `impl.forward` (which runs it), side by side in one process.
"""

import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2]))
sys.path.insert(0, str(Path(__file__).parent))

from reliability_cases import backend_class

from torch_backends import AttentionLayer
from torch_backends.checks import check_step
from torch_backends.layouts import PagedCache

NUM_SEQS, HQ, HKV, D, BS = 32, 32, 8, 128, 16


def measure(backend: str, repeats: int = 30) -> tuple[float, float]:
    """(check_step seconds, forward seconds), medians."""
    gen = torch.Generator().manual_seed(0)
    backend_cls = backend_class(backend)
    seq_lens = torch.randint(200, 1001, (NUM_SEQS,), generator=gen).tolist()
    blocks = [-(-s // BS) for s in seq_lens]
    order = torch.randperm(sum(blocks), generator=gen).tolist()
    tables, used = [], 0
    for n in blocks:
        tables.append(order[used : used + n])
        used += n
    shape = backend_cls.get_kv_cache_shape(sum(blocks), BS, HKV, D)
    kv_cache = torch.randn(shape, generator=gen)
    md = backend_cls.get_builder_cls()(None).build(
        seq_lens, [1] * NUM_SEQS, -1, -1, block_tables=tables, block_size=BS
    )
    impl = backend_cls.get_impl_cls()(HQ, D, D**-0.5, HKV)
    layer = AttentionLayer()
    q = torch.randn(NUM_SEQS, HQ * D, generator=gen)
    k, v = (torch.randn(NUM_SEQS, HKV * D, generator=gen) for _ in "kv")
    plan = md.step_plan(impl.attn_type)
    cache = PagedCache.of(impl.layout, kv_cache, layer._k_scale, layer._v_scale)
    key = k.view(-1, HKV, D)

    def check():
        check_step(plan, cache, key, layer._k_scale, layer._v_scale)

    def forward():
        impl.forward(layer, q, k, v, kv_cache, md)

    times = {}
    for name, fn in (("check", check), ("forward", forward)):
        for _ in range(3):
            fn()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        times[name] = statistics.median(samples)
    return times["check"], times["forward"]


if __name__ == "__main__":
    warnings.filterwarnings("ignore", "XFORMERS: xformers has no CPU kernel")
    torch.set_num_threads(1)
    for backend in sys.argv[1:] or ["TORCH_SDPA", "XFORMERS", "JAX"]:
        check, forward = measure(backend)
        print(
            f"{backend:>10}: check_step {check * 1e6:7.0f} us, decode step (B={NUM_SEQS}) "
            f"{forward * 1e3:7.2f} ms: {check / forward:6.2%}"
        )

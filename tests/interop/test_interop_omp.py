"""`interop.omp`: when the JAX backend warns that torch's OpenMP workers will spin through its
XLA calls, and that it warns once, from the first CPU call of the op."""

import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("jax")

from interop import omp  # noqa: E402

GOMP = ["libgomp-a34b3233.so.1"]


@pytest.mark.parametrize(
    "env, openmp, threads, warns",
    [
        ({}, GOMP, 2, "libgomp's default of 300000 spins"),
        ({"GOMP_SPINCOUNT": "100000"}, GOMP, 2, "GOMP_SPINCOUNT=100000"),
        ({"GOMP_SPINCOUNT": "10001"}, GOMP, 2, "GOMP_SPINCOUNT=10001"),
        ({"GOMP_SPINCOUNT": "300k"}, GOMP, 2, "GOMP_SPINCOUNT=300k"),
        ({"GOMP_SPINCOUNT": "infinite"}, GOMP, 2, "GOMP_SPINCOUNT=infinite"),
        ({"OMP_WAIT_POLICY": "active"}, GOMP, 8, "OMP_WAIT_POLICY=ACTIVE"),
        ({"GOMP_SPINCOUNT": "1000"}, GOMP, 2, None),
        ({"GOMP_SPINCOUNT": "10k"}, GOMP, 2, None),
        ({"GOMP_SPINCOUNT": "0"}, GOMP, 2, None),
        ({"OMP_WAIT_POLICY": "passive"}, GOMP, 2, None),
        ({}, GOMP, 1, None),  # one thread: no workers to spin
        ({}, ["libiomp5.so"], 2, None),  # Intel's runtime: KMP_BLOCKTIME, not this
        ({}, [], 2, None),
    ],
    ids=[
        "default", "spin100000", "spin10001", "spin300k", "infinite", "active", "spin1000",
        "spin10k", "spin0", "passive", "one-thread", "iomp", "no-openmp",
    ],
)  # fmt: skip
def test_spin_problem(env, openmp, threads, warns):
    problem = omp.spin_problem(env, openmp, threads)
    if warns is None:
        assert problem is None
    else:
        assert warns in problem
        assert omp.RECOMMENDED in problem and "before torch is imported" in problem


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps (Linux)")
def test_loaded_openmp_sees_torchs_runtime():
    torch.ones(64, 64) @ torch.ones(64, 64)
    libs = omp.loaded_openmp()
    if torch.get_num_threads() > 1 and "OpenMP" in torch.__config__.parallel_info():
        assert libs, torch.__config__.parallel_info()


def test_op_warns_once_on_cpu(monkeypatch):
    from interop.torch_op import paged_attention_op

    monkeypatch.setattr(omp, "_warned", False)
    monkeypatch.setattr(omp, "spin_problem", lambda: "the workers spin")
    query = torch.randn(2, 4, 64)
    cache = torch.randn(3, 16, 2, 64)
    args = (
        query,
        cache,
        cache,
        torch.tensor([0, 1, 2], dtype=torch.int32),
        torch.tensor([5, 17], dtype=torch.int32),
        torch.tensor([[0, 0], [1, 2]], dtype=torch.int32),
        0.125,
        True,
        None,
        0,
        0.0,
        1.0,
        1.0,
    )
    with pytest.warns(RuntimeWarning, match="JAX backend: the workers spin"):
        paged_attention_op(*args)
    with omp.warnings.catch_warnings():
        omp.warnings.simplefilter("error")
        paged_attention_op(*args)  # once per process

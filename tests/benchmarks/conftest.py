"""The bench tests marked `vllm` run the `vllm-cpu-attn` peer, vLLM 0.32's own CPU attention
kernels, in the vllm environment (`scripts/env.sh vllm`; the vllm stage of scripts/test.sh).

- Elsewhere (no vLLM, or another vLLM) they are skipped with the peer's own reason, which names
  what is missing (`benchmarks.backends`' availability check for the peer).
- With JAX_ATTN_REQUIRE_VLLM=1 (scripts/test.sh) that reason fails them instead, and
  tests/conftest.py's skip audit fails the session unless at least one `vllm` test passed and
  none was skipped.
"""

import os

import pytest

REQUIRE = os.environ.get("JAX_ATTN_REQUIRE_VLLM") == "1"


@pytest.fixture(autouse=True)
def _vllm_available(request):
    if request.node.get_closest_marker("vllm") is None:
        return
    from benchmarks import backends

    problem = backends.why_vllm_cpu_attn_unavailable()
    if problem is not None:
        if REQUIRE:
            pytest.fail(f"JAX_ATTN_REQUIRE_VLLM=1 but vllm-cpu-attn is {problem}", pytrace=False)
        pytest.skip(f"vllm-cpu-attn: {problem}")


class _NullProgress:
    """The calls the bench's loops make on a `rich.progress.Progress`, doing nothing."""

    def add_task(self, *a, **k):
        return 0

    def update(self, *a, **k):
        pass

    def advance(self, *a, **k):
        pass

    def remove_task(self, *a, **k):
        pass


@pytest.fixture
def progress():
    """A progress display for calling run_workload and its kin directly: shows nothing."""
    return _NullProgress()

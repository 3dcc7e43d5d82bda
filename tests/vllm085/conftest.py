"""The vLLM 0.8.5 tests (marked `vllm085`) run inside the real vLLM, in the `vllm085`
environment (`scripts/env.sh vllm085`; the vllm085 stage of scripts/test.sh).

- Elsewhere (the main environment has no vLLM) every test here is skipped, with a reason naming
  what is missing. Nothing imports vLLM at collection: the check runs in a fixture, and
  `importlib.util.find_spec` answers "not installed" without importing anything.
- With JAX_ATTN_REQUIRE_VLLM085=1 (scripts/test.sh) the same problem fails the tests instead,
  and tests/conftest.py's skip audit fails the session unless at least one `vllm085` test
  passed and none was skipped.
- The terminal summary lists, per comparison, the tokens compared and the largest logprob (or
  hidden-state) difference: the figures the drop-in note quotes.
"""

import importlib.util
import os

import engine_harness
import pytest

REQUIRE = os.environ.get("JAX_ATTN_REQUIRE_VLLM085") == "1"


def _vllm_problem() -> str | None:
    """Why vLLM 0.8.5 cannot run here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return (
            "vLLM is not installed in this environment; the vllm085 environment has vLLM 0.8.5 "
            "(JAX_ATTN_ENV=vllm085 bash scripts/run.sh python -m pytest -m vllm085 tests)"
        )
    engine_harness.set_engine_env()
    try:
        import vllm
    except Exception as e:  # e.g. its compiled extension failing to load
        return f"vLLM is installed but does not import: {type(e).__name__}: {e}"
    if not vllm.__version__.startswith("0.8.5"):
        return f"these tests need vLLM 0.8.5, this environment has {vllm.__version__}"
    return None


@pytest.fixture(scope="session", autouse=True)
def _vllm085_available():
    problem = _vllm_problem()
    if problem is not None:
        if REQUIRE:
            pytest.fail(f"JAX_ATTN_REQUIRE_VLLM085=1 but {problem}", pytrace=False)
        pytest.skip(problem)


def pytest_terminal_summary(terminalreporter):
    if engine_harness.FIGURES:
        terminalreporter.section("vLLM 0.8.5 engine comparisons")
        for line in engine_harness.FIGURES:
            terminalreporter.write_line(line)

"""Shared test configuration.

- JAX runs with strict dtype promotion and rank promotion raising, so an accidental upcast or
  broadcast in the core fails a test instead of silently costing memory or precision.
- Every test draws fresh random data: the run seed is random unless JAX_ATTN_TEST_SEED is set,
  and is printed in the header so a failure can be replayed.
- Test modules have unique basenames (no __init__.py: a `tests/jax` package would shadow jax).
- IPEX is never skipped quietly: with JAX_ATTN_REQUIRE_IPEX=1 (scripts/test.sh's IPEX half)
  the session fails unless IPEX imports, at least one `ipex` test passed and none skipped;
  in any environment, a test skipped for want of IPEX that is not marked `ipex` (so the IPEX
  half would never run it) fails the session.
- The native CPU kernels are never skipped quietly either: with JAX_ATTN_REQUIRE_NATIVE=1
  (scripts/test.sh's main and vllm085 stages) the session fails at once unless the kernels
  build and load here (jax_attn.cpu's, and torch_backends.native's where torch imports), and
  fails at the end if any test skipped for want of them (a skip reason naming the native
  kernels: "native CPU kernels: ...", "jax-cpu does not run here: ...", "native torch ops").
"""

import hashlib
import os
import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # for `from tolerances import ...`

try:
    import jax

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_numpy_rank_promotion", "raise")
except ImportError:  # the torch-only tests run without JAX
    jax = None

RUN_SEED = int(os.environ.get("JAX_ATTN_TEST_SEED", random.SystemRandom().randrange(2**31)))


def pytest_report_header(config):
    return f"jax-attn test seed: {RUN_SEED} (replay with JAX_ATTN_TEST_SEED={RUN_SEED})"


def _test_seed(request) -> int:
    digest = hashlib.sha256(f"{RUN_SEED}:{request.node.nodeid}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


@pytest.fixture
def seed(request) -> int:
    """A per-test seed derived from the run seed and the test id."""
    return _test_seed(request)


@pytest.fixture
def rng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def run_seed() -> int:
    """The run's seed itself, for module- or session-scoped data (a `conftest` import would
    find whichever conftest module was imported last: tests/vllm085 has one too)."""
    return RUN_SEED


@pytest.fixture
def key(seed):
    if jax is None:
        pytest.skip("jax is not installed in this environment")
    return jax.random.key(seed)


REQUIRE_IPEX = os.environ.get("JAX_ATTN_REQUIRE_IPEX") == "1"
_ipex_runs = {"passed": 0, "skipped": [], "unmarked": []}
REQUIRE_NATIVE = os.environ.get("JAX_ATTN_REQUIRE_NATIVE") == "1"
# Skip reasons that mean "the native CPU kernels are not here".
NATIVE_SKIP = re.compile(
    r"native CPU kernels|jax-cpu does not run here|jax_attn\.cpu kernels|native torch ops"
)
_native_skips: list[str] = []


def native_unavailable_reason() -> str | None:
    """Why the native CPU kernels cannot run here (None: they build and load): jax_attn.cpu's
    XLA library, and where torch imports, torch_backends.native's torch ops."""
    try:
        from jax_attn import cpu
    except Exception as e:  # no JAX in this environment
        return f"jax_attn.cpu does not import: {e}"
    if (reason := cpu.unavailable_reason()) is not None:
        return f"jax_attn.cpu: {reason}"
    try:
        from torch_backends import native
    except ImportError:  # no torch here: the JAX half alone
        return None
    if (reason := native.unavailable_reason()) is not None:
        return f"torch_backends.native: {reason}"
    return None


def pytest_sessionstart(session):
    if REQUIRE_IPEX:
        try:
            import intel_extension_for_pytorch  # noqa: F401
        except Exception as e:
            pytest.exit(f"JAX_ATTN_REQUIRE_IPEX=1 but IPEX does not import: {e}", returncode=1)
    if REQUIRE_NATIVE and (reason := native_unavailable_reason()) is not None:
        pytest.exit(
            f"JAX_ATTN_REQUIRE_NATIVE=1 but the native CPU kernels are not available: {reason}",
            returncode=1,
        )


def pytest_runtest_logreport(report):
    marked = "ipex" in report.keywords
    if report.skipped:
        reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""
        if NATIVE_SKIP.search(reason) and "xfail" not in report.keywords:
            _native_skips.append(f"{report.nodeid}: {reason}")
        if marked:
            _ipex_runs["skipped"].append(f"{report.nodeid}: {reason}")
        elif "ipex" in reason.lower() and "xfail" not in report.keywords:
            _ipex_runs["unmarked"].append(f"{report.nodeid}: {reason}")
    elif marked and report.when == "call" and report.passed:
        _ipex_runs["passed"] += 1


def pytest_sessionfinish(session, exitstatus):
    problems = [
        f"skipped for want of IPEX but not marked `ipex` (the IPEX half never runs it): {n}"
        for n in _ipex_runs["unmarked"]
    ]
    if REQUIRE_IPEX:
        if _ipex_runs["passed"] == 0:
            problems.append("JAX_ATTN_REQUIRE_IPEX=1 but no `ipex` test passed")
        problems += [
            f"`ipex` test skipped in the IPEX environment: {n}" for n in _ipex_runs["skipped"]
        ]
    if REQUIRE_NATIVE:
        problems += [f"skipped for want of the native CPU kernels: {n}" for n in _native_skips]
    if problems:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        for line in problems:
            if reporter is not None:
                reporter.write_line(f"SKIP AUDIT: {line}", red=True)
        session.exitstatus = 1

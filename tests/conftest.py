"""Shared test configuration.

- JAX runs with strict dtype promotion and rank promotion raising, so an accidental upcast or
  broadcast in the core fails a test instead of silently costing memory or precision.
- Every test draws fresh random data: the run seed is random unless JAX_ATTN_TEST_SEED is set,
  and is printed in the header so a failure can be replayed.
- Test modules have unique basenames (no __init__.py: a `tests/jax` package would shadow jax).
- No environment is skipped quietly (the skip audit, `STAGES`): each stage of scripts/test.sh
  provides environments (IPEX, vLLM 0.8.5, the vllm085-TORCH_SDPA peer, vLLM 0.32, the GPU and
  TPU compilers, the native CPU kernels) and sets a JAX_ATTN_REQUIRE_* variable for each. In any
  run, a test skipped for want of an environment fails the session unless it carries the marker
  of a stage that provides it (else no stage ever runs it); with a stage's variable set to 1,
  the session fails if a test carrying its marker skipped, or a module skipped for want of it,
  or no test carrying its marker passed. JAX_ATTN_REQUIRE_IPEX=1 also fails at once unless IPEX
  imports.
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
from dataclasses import dataclass
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
# pytest-xdist's workers import this module again: they inherit the seed the header names
# (else each drew its own, and a failure under -n could not be replayed).
os.environ["JAX_ATTN_TEST_SEED"] = str(RUN_SEED)


def pytest_configure(config):
    # `--dist loadgroup` that groups under pytest 9.2 too (tests/xdist_groups.py says why),
    # where xdist runs (not under `-p no:xdist`, nor without pytest-xdist installed).
    if config.pluginmanager.hasplugin("xdist"):
        from xdist_groups import GroupSchedulerPlugin

        config.pluginmanager.register(GroupSchedulerPlugin(), "jax-attn-xdist-groups")


def pytest_collection_modifyitems(session, config, items):
    # The tests marked `long` first, then the modules that run on one worker (a minute-long
    # module fixture; xdist_groups.py): pytest-xdist hands tests out in collection order, so
    # each starts early on a worker of its own instead of closing the session alone.
    items.sort(key=lambda item: (item.get_closest_marker("long") is None,
                                 item.get_closest_marker("xdist_group") is None))  # fmt: skip


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


# Skip reasons that mean "the native CPU kernels are not here".
NATIVE_SKIP = re.compile(
    r"native CPU kernels|jax-cpu does not run here|jax_attn\.cpu kernels|native torch ops"
)


@dataclass(frozen=True)
class Stage:
    """An environment that a stage of scripts/test.sh provides, as the skip audit sees it."""

    name: str  # what the audit's lines call it
    marker: str | None  # the marker that selects its tests (None: the stage runs every test)
    require: str  # the variable that stage sets to 1
    reason: re.Pattern  # skip reasons that mean "that environment is not here"


STAGES = (
    Stage("IPEX", "ipex", "JAX_ATTN_REQUIRE_IPEX", re.compile("ipex", re.IGNORECASE)),
    Stage("vLLM 0.8.5", "vllm085", "JAX_ATTN_REQUIRE_VLLM085",
          re.compile(r"vLLM 0\.8\.5|vllm085 environment")),
    # The bench's peer runs from the main environment through the vllm085 environment's
    # interpreter: the main stage, once the vllm085 environment is built.
    Stage("the vllm085-TORCH_SDPA peer", "vllm085_peer", "JAX_ATTN_REQUIRE_VLLM085_PEER",
          re.compile("vllm085-TORCH_SDPA")),
    # The bench's vllm-cpu-attn peer, and the vLLM plugin's tests (tests/torch/test_vllm_v1_*).
    Stage("vLLM 0.32's CPU attention", "vllm", "JAX_ATTN_REQUIRE_VLLM",
          re.compile(r"vllm-cpu-attn: |vLLM 0\.32")),
    Stage("a GPU compiler", "gpu_aot", "JAX_ATTN_REQUIRE_GPU_AOT", re.compile("no GPU compile")),
    Stage("a TPU compiler", "tpu_aot", "JAX_ATTN_REQUIRE_TPU_AOT", re.compile("no TPU compile")),
    Stage("the native CPU kernels", None, "JAX_ATTN_REQUIRE_NATIVE", NATIVE_SKIP),
)  # fmt: skip
REQUIRED = [stage for stage in STAGES if os.environ.get(stage.require) == "1"]
REQUIRE_IPEX = os.environ.get("JAX_ATTN_REQUIRE_IPEX") == "1"
REQUIRE_NATIVE = os.environ.get("JAX_ATTN_REQUIRE_NATIVE") == "1"
_audit = {"passed": {}, "problems": []}


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


def _skip_reason(report) -> str:
    return str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""


def pytest_runtest_logreport(report):
    # report.keywords holds the test's markers (and its parents' names: tests/vllm085's tests
    # carry "vllm085" twice over); it reaches the xdist controller, unlike the item.
    if report.skipped and "xfail" not in report.keywords:
        reason = _skip_reason(report)
        wanted = [stage for stage in STAGES if stage.reason.search(reason)]
        # A stage without a marker (the main stage) runs every test: nothing to check there.
        if wanted and not any(stage.marker in (None, *report.keywords) for stage in wanted):
            names = " or ".join(stage.name for stage in wanted)
            _audit["problems"].append(
                f"skipped for want of {names}, but carries no marker of a stage that has it "
                f"(no stage of scripts/test.sh runs it): {report.nodeid}: {reason}"
            )
        for stage in REQUIRED:
            marked = stage.marker is not None and stage.marker in report.keywords
            if marked or stage.reason.search(reason):
                _audit["problems"].append(
                    f"skipped for want of {stage.name} where {stage.require}=1: "
                    f"{report.nodeid}: {reason}"
                )
    elif report.when == "call" and report.passed:
        for stage in REQUIRED:
            if stage.marker in report.keywords:
                _audit["passed"][stage.marker] = _audit["passed"].get(stage.marker, 0) + 1


def pytest_collectreport(report):
    # A module skipped as a whole (pytest.importorskip, a module-level skip) has no test
    # reports and no markers: it counts where its reason names the environment or it sits in
    # the stage's own directory (tests/vllm085).
    if not report.skipped:
        return
    reason = _skip_reason(report)
    parts = re.split(r"[/:]", report.nodeid)
    for stage in REQUIRED:
        if stage.reason.search(reason) or stage.marker in parts:
            _audit["problems"].append(
                f"module skipped for want of {stage.name} where {stage.require}=1: "
                f"{report.nodeid}: {reason}"
            )


def pytest_sessionfinish(session, exitstatus):
    problems = _audit["problems"]
    for stage in REQUIRED:
        if stage.marker is not None and not _audit["passed"].get(stage.marker):
            problems.append(f"{stage.require}=1 but no `{stage.marker}` test passed")
    if problems:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    # After the session's last line of progress (pytest_sessionfinish runs before it ends).
    if _audit["problems"]:
        terminalreporter.section("skip audit", red=True)
        for line in _audit["problems"]:
            terminalreporter.write_line(f"SKIP AUDIT: {line}", red=True)

"""The test command cannot go green without the native CPU kernels (issue 22): with
JAX_ATTN_REQUIRE_NATIVE=1 (scripts/test.sh sets it) a session fails when the kernels do not
build, and when any test skipped for want of them. Checked on a copy of tests/conftest.py in a
scratch directory, with one test that skips the way the native tests do."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SKIPPING = """
import pytest

def test_runs():
    pass

def test_native():
    pytest.skip("native CPU kernels: pretend they did not build")
"""


def _session(tmp_path, **env) -> subprocess.CompletedProcess:
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_skipping.py").write_text(SKIPPING)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_ATTN_REQUIRE")}
    full_env.update(env)
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=tmp_path,
        timeout=600,
    )  # fmt: skip


def test_a_native_skip_fails_the_required_session(tmp_path):
    from jax_attn import cpu

    if cpu.unavailable_reason() is not None:
        pytest.skip(f"native CPU kernels: {cpu.unavailable_reason()}")
    relaxed = _session(tmp_path)
    assert relaxed.returncode == 0, relaxed.stdout[-2000:]
    assert "1 passed, 1 skipped" in relaxed.stdout
    required = _session(tmp_path, JAX_ATTN_REQUIRE_NATIVE="1")
    assert required.returncode == 1, required.stdout[-2000:]
    assert "SKIP AUDIT: skipped for want of the native CPU kernels" in required.stdout
    assert "test_skipping.py::test_native" in required.stdout


@pytest.mark.parametrize(
    "env, reason",
    [
        (dict(JAX_ATTN_CPU_DISABLE="1"), "disabled by JAX_ATTN_CPU_DISABLE=1"),
        (dict(CXX="/bin/false"), "compiler /bin/false --version failed"),
    ],
    ids=["disabled", "cxx-false"],
)
def test_kernels_that_do_not_build_fail_the_required_session(tmp_path, env, reason):
    cache = tmp_path / "empty-cache"  # nothing cached: the build must run (and fail)
    required = _session(tmp_path, JAX_ATTN_REQUIRE_NATIVE="1", JAX_ATTN_CACHE_DIR=str(cache), **env)
    assert required.returncode == 1, required.stdout[-2000:]
    out = required.stdout + required.stderr
    assert "JAX_ATTN_REQUIRE_NATIVE=1 but the native CPU kernels are not available" in out
    assert reason in out
    assert "passed" not in required.stdout  # it stopped before running anything

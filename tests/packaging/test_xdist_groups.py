"""`--dist loadgroup` keeps a grouped module on one worker (tests/xdist_groups.py): the suite's
minute-long module fixtures run once, not once per worker."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("xdist", reason="pytest-xdist is not installed in this environment")
from xdist_groups import module_group

TESTS = Path(__file__).resolve().parents[1]

CONFTEST = """
from xdist_groups import GroupSchedulerPlugin

def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(GroupSchedulerPlugin())
"""

GROUPED = """
    import os
    import pytest

    pytestmark = pytest.mark.xdist_group("slow-fixture")

    @pytest.fixture(scope="module")
    def shared(tmp_path_factory):
        with open(os.environ["GROUP_LOG"], "a") as f:
            f.write("setup " + os.environ["PYTEST_XDIST_WORKER"] + "\\n")
        return 1

    @pytest.mark.parametrize("i", range(12))
    def test_grouped(shared, i):
        with open(os.environ["GROUP_LOG"], "a") as f:
            f.write("run " + os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""

LOOSE = """
    import pytest

    @pytest.mark.parametrize("i", range(40))
    def test_loose(i):
        pass
"""


def test_a_grouped_module_runs_on_one_worker_and_sets_up_once(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_grouped.py").write_text(textwrap.dedent(GROUPED))
    (tmp_path / "test_loose.py").write_text(textwrap.dedent(LOOSE))
    log = tmp_path / "log"
    path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_ATTN_REQUIRE_")}
    env |= {"GROUP_LOG": str(log), "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
           "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "52 passed" in result.stdout, result.stdout[-3000:]
    lines = log.read_text().splitlines()
    setups = [line for line in lines if line.startswith("setup ")]
    workers = {line.split()[1] for line in lines if line.startswith("run ")}
    assert len(setups) == 1, lines
    assert len(workers) == 1 and len(lines) == 13, lines


def test_every_grouped_module_of_the_suite_is_read():
    """A module whose `xdist_group` mark the scheduler cannot read would be dealt out test by
    test again: every module that names the mark must give its group."""
    here = Path(__file__).resolve()
    marked = [
        p for p in TESTS.rglob("test_*.py")
        if p != here and "pytest.mark.xdist_group(" in p.read_text(encoding="utf-8")
    ]  # fmt: skip
    assert len(marked) >= 4, marked  # the sharded cases, the bench smokes, the fuzz slice, ...
    assert {p.name: module_group(p) for p in marked if module_group(p) is None} == {}
    assert module_group(TESTS / "jax" / "test_sharding.py") == "sharding"
    assert module_group(TESTS / "jax" / "test_cpu_ragged.py") is None


@pytest.mark.parametrize("xdist", [["-p", "no:xdist"], ["-n", "2", "--dist", "loadgroup"]],
                         ids=["without-xdist", "loadgroup"])  # fmt: skip
def test_the_suite_config_loads_with_and_without_xdist(xdist):
    """tests/conftest.py registers the scheduler only where xdist runs: the sanitizer builds'
    child runs (`-p no:xdist`) would otherwise die on an unknown hook before any test."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *xdist,
           str(TESTS / "packaging" / "test_xdist_groups.py"), "-k", "every_grouped"]  # fmt: skip
    # Without the stages' skip-audit variables: a child that runs one module needs no stage's
    # tests to pass.
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_ATTN_REQUIRE_")}
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=TESTS.parent, env=env,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "1 passed" in result.stdout, result.stdout[-3000:]

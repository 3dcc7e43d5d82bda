"""No environment is skipped quietly (issue 37 item 5): tests/conftest.py's skip audit, for each
environment a stage of scripts/test.sh provides. A test skipped for want of one fails every
session unless it carries the marker of the stage that has it; in that stage (its
JAX_ATTN_REQUIRE_* set to 1) a marked test that skips, or none passing, fails the session.
Checked on a copy of tests/conftest.py in a scratch directory, as test_cpu_required.py does."""

import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# marker, its stage's variable, a skip reason as the tests give it where the environment is not
STAGES = [
    ("ipex", "JAX_ATTN_REQUIRE_IPEX", "IPEX 2.8 needs torch 2.8.*, this environment has 2.13"),
    ("vllm085", "JAX_ATTN_REQUIRE_VLLM085",
     "vLLM is not installed in this environment; the vllm085 environment has vLLM 0.8.5"),
    ("vllm085_peer", "JAX_ATTN_REQUIRE_VLLM085_PEER",
     "vllm085-TORCH_SDPA: not available: no --vllm085-python or $JAX_ATTN_VLLM085_PYTHON"),
    ("vllm", "JAX_ATTN_REQUIRE_VLLM", "vllm-cpu-attn: not available: no module named 'vllm'"),
    ("gpu_aot", "JAX_ATTN_REQUIRE_GPU_AOT", "no GPU compile here: no CUDA plugin"),
    ("tpu_aot", "JAX_ATTN_REQUIRE_TPU_AOT", "no TPU compile here: no libtpu"),
]  # fmt: skip

UNMARKED = """
import pytest

def test_unmarked_skips():
    pytest.skip({reason!r})
"""

MARKED = """
import pytest

@pytest.mark.{marker}
def test_marked_passes():
    pass

@pytest.mark.{marker}
def test_marked_skips():
    pytest.skip({reason!r})
"""


def _session(tmp_path, files, **env) -> subprocess.CompletedProcess:
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
    # JAX_ATTN_REQUIRE_IPEX=1 stops the session at once unless IPEX imports: a stand-in.
    stubs = tmp_path / "stubs"
    stubs.mkdir(exist_ok=True)
    (stubs / "intel_extension_for_pytorch.py").write_text("")
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_ATTN_REQUIRE")}
    full_env.update(env)
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(stubs), str(REPO), os.environ.get("PYTHONPATH", "")]
    )
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "--rootdir", str(tmp_path), *(str(tmp_path / f) for f in files)],
        capture_output=True, text=True, env=full_env, cwd=tmp_path, timeout=600,
    )  # fmt: skip


def _audit_lines(result) -> list[str]:
    return [line for line in result.stdout.splitlines() if line.startswith("SKIP AUDIT: ")]


@pytest.mark.parametrize("marker, require, reason", STAGES, ids=[s[0] for s in STAGES])
def test_an_environment_skip_runs_in_its_stage_or_fails(tmp_path, marker, require, reason):
    (tmp_path / "test_unmarked.py").write_text(UNMARKED.format(reason=reason))
    (tmp_path / "test_marked.py").write_text(MARKED.format(marker=marker, reason=reason))

    anywhere = _session(tmp_path, ["test_marked.py", "test_unmarked.py"])
    assert anywhere.returncode == 1, anywhere.stdout[-2000:]
    audit = _audit_lines(anywhere)
    assert len(audit) == 1 and "test_unmarked.py::test_unmarked_skips" in audit[0], audit
    assert "no stage of scripts/test.sh runs it" in audit[0]  # the marked skip is not named

    required = _session(tmp_path, ["test_marked.py"], **{require: "1"})
    assert required.returncode == 1, required.stdout[-2000:]
    audit = _audit_lines(required)
    assert len(audit) == 1 and "test_marked.py::test_marked_skips" in audit[0], audit
    assert f"where {require}=1" in audit[0]


def test_a_stage_where_nothing_ran_fails(tmp_path):
    (tmp_path / "test_nothing.py").write_text("def test_other():\n    pass\n")
    required = _session(tmp_path, ["test_nothing.py"], JAX_ATTN_REQUIRE_VLLM085_PEER="1")
    assert required.returncode == 1, required.stdout[-2000:]
    assert _audit_lines(required) == [
        "SKIP AUDIT: JAX_ATTN_REQUIRE_VLLM085_PEER=1 but no `vllm085_peer` test passed"
    ]


def test_every_stage_is_required_by_scripts_test_sh():
    """Each environment the audit knows is required by a stage of scripts/test.sh, and each
    stage marker is registered; the vllm085 peer's in the main stage, with that environment
    built before it."""
    spec = importlib.util.spec_from_file_location("audited_conftest", REPO / "tests/conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    script = (REPO / "scripts" / "test.sh").read_text()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    markers = {m.split(":")[0] for m in pyproject["tool"]["pytest"]["ini_options"]["markers"]}
    assert {(s.marker, s.require) for s in conftest.STAGES if s.marker} == {
        (marker, require) for marker, require, _ in STAGES
    }
    for stage in conftest.STAGES:
        assert f"{stage.require}=1" in script, stage
        assert stage.marker is None or stage.marker in markers, stage
    main_stage = script[script.index("main_stage() {") : script.index("ipex_stage() {")]
    assert main_stage.index("scripts/env.sh vllm085") < main_stage.index(
        "JAX_ATTN_REQUIRE_VLLM085_PEER=1"
    )

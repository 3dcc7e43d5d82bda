"""Half of the dependencies missing: `jax-attn info` still runs, `from interop import to_jax`
still resolves lazily, and `AttentionType` / the harness import without torch."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, blocked: tuple[str, ...]) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter where importing any of `blocked` fails (as if it
    were not installed: `sys.modules[name] = None` makes `import name` raise ImportError)."""
    prelude = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in blocked)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    env["COLUMNS"] = "200"
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )


INFO = "from interop import cli\nsys.exit(cli.main(['info']))\n"


@pytest.mark.parametrize(
    "blocked",
    [("torch",), ("jax", "jaxlib")],
    ids=["without-torch", "without-jax"],
)
def test_info_runs_with_half_the_dependencies(blocked):
    pytest.importorskip("rich")
    done = _python(INFO, blocked)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    for name in ("jax-xla", "TORCH_SDPA", "JAX-via-torch", "jax-cpu"):
        row = next((line for line in lines if f" {name} " in line), None)
        assert row is not None, (name, done.stdout)
    if blocked == ("torch",):
        sdpa = next(line for line in lines if " TORCH_SDPA " in line)
        assert " no " in sdpa and "torch is not installed" in sdpa
    else:
        xla = next(line for line in lines if " jax-xla " in line)
        assert " no " in xla and "jax is not installed" in xla


def test_the_harness_imports_without_torch_or_jax():
    code = (
        "from interop import crosscheck\n"
        "from torch_backends import AttentionType, get_attn_backend\n"
        "import interop, torch_backends\n"
        "assert crosscheck.Spec('x', (1,), (2,)).attn_type is AttentionType.DECODER\n"
        "assert len(crosscheck.all_backends()) >= 8\n"
        "assert 'torch' not in sys.modules or sys.modules['torch'] is None\n"
        "print('ok')\n"
    )
    done = _python(code, ("torch", "jax", "jaxlib"))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_interop_exports_the_bridge_lazily():
    code = (
        "import interop\n"
        "assert 'interop.dlpack' not in sys.modules, 'imported eagerly'\n"
        "from interop import to_jax, to_torch\n"
        "from interop import dlpack\n"
        "assert to_jax is dlpack.to_jax and to_torch is dlpack.to_torch\n"
        "assert {'to_jax', 'to_torch'} <= set(dir(interop))\n"
        "try:\n"
        "    interop.nope\n"
        "except AttributeError as e:\n"
        "    assert 'nope' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
        "print('ok')\n"
    )
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    done = _python(code, ())
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_without_torch_the_bridge_says_so():
    done = _python("from interop import to_jax\n", ("torch",))
    assert done.returncode != 0 and "torch" in done.stderr


def test_one_attention_type_enum():
    torch_backends = pytest.importorskip("torch_backends.abstract")
    from interop import crosscheck
    from torch_backends.attention_type import AttentionType

    assert torch_backends.AttentionType is AttentionType is crosscheck.AttentionType
    assert [t.value for t in AttentionType] == [
        "decoder", "encoder", "encoder_only", "encoder_decoder",
    ]  # fmt: skip
    assert not hasattr(crosscheck, "AttnType")

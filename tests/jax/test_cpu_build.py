"""The lazy build of the native CPU kernels: cached, and a reason (never an exception) when
there is no working compiler or the kernels are disabled."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jax_attn import cpu
from jax_attn.cpu import _build

REPO = Path(__file__).resolve().parents[2]


def _run_fresh(tmp_path, code: str, **env) -> subprocess.CompletedProcess:
    """`code` in a new interpreter with a fresh cache dir and `env` on top."""
    full_env = {**os.environ, "JAX_ATTN_CACHE_DIR": str(tmp_path / "cache"), **env}
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), full_env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=300,
    )


REPORT = """
    from jax_attn import cpu
    reason = cpu.unavailable_reason()
    print("REASON:", reason)
    print("AVAILABLE:", cpu.available())
"""


def test_build_is_cached():
    if cpu.unavailable_reason() is not None:
        pytest.skip(f"native CPU kernels: {cpu.unavailable_reason()}")
    path, _ = _build.build()
    mtime = path.stat().st_mtime_ns
    again, seconds = _build.build()
    assert again == path and seconds == 0.0
    assert path.stat().st_mtime_ns == mtime  # not rewritten
    assert _build.registered("jax_attn_cpu_paged_decode")


def test_broken_compiler_gives_a_reason(tmp_path):
    result = _run_fresh(tmp_path, REPORT, CXX="/bin/false")
    assert result.returncode == 0, result.stderr
    assert "REASON: compiler /bin/false --version failed" in result.stdout
    assert "AVAILABLE: False" in result.stdout


def test_missing_compiler_gives_a_reason(tmp_path):
    result = _run_fresh(tmp_path, REPORT, CXX=str(tmp_path / "no-such-c++"))
    assert result.returncode == 0, result.stderr
    assert "REASON: no C++ compiler found (tried $CXX=" in result.stdout


def test_failing_build_gives_its_first_error_line(tmp_path):
    fake = tmp_path / "fake-c++"
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "fake 1.0"; exit 0; fi\n'
        'echo "kernel.cc:1:1: error: no such thing" >&2\nexit 1\n'
    )
    fake.chmod(0o755)
    result = _run_fresh(tmp_path, REPORT, CXX=str(fake))
    assert result.returncode == 0, result.stderr
    assert "REASON: build failed (fake-c++): kernel.cc:1:1: error: no such thing" in result.stdout
    assert not list((tmp_path / "cache").rglob("*.so"))  # no half-written library left behind


def test_disable_gives_a_reason_and_the_wrapper_says_it(tmp_path):
    code = (
        REPORT
        + """
    import jax.numpy as jnp
    try:
        cpu.paged_decode(jnp.zeros((1, 2, 8)), jnp.zeros((1, 4, 1, 8)), jnp.zeros((1, 4, 1, 8)),
                         jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32))
    except RuntimeError as e:
        print("ERROR:", e)
    """
    )
    result = _run_fresh(tmp_path, code, JAX_ATTN_CPU_DISABLE="1")
    assert result.returncode == 0, result.stderr
    assert "REASON: disabled by JAX_ATTN_CPU_DISABLE=1" in result.stdout
    assert "ERROR: jax_attn.cpu kernels are not available: disabled" in result.stdout
    assert not (tmp_path / "cache").exists()  # nothing was built


def test_disable_in_process(monkeypatch):
    monkeypatch.setenv("JAX_ATTN_CPU_DISABLE", "1")
    assert cpu.unavailable_reason() == "disabled by JAX_ATTN_CPU_DISABLE=1"
    assert not cpu.available()


def test_shape_problem():
    assert (
        cpu.shape_problem(
            query_dtype="bfloat16", cache_dtype="float8_e4m3fn", block_size=256, head_size=80
        )
        is None
    )
    assert "block_size=512" in cpu.shape_problem(
        query_dtype="float32", cache_dtype="float32", block_size=512, head_size=64
    )
    assert "head_size=320" in cpu.shape_problem(
        query_dtype="float32", cache_dtype="float32", block_size=16, head_size=320
    )
    assert "int8" in cpu.shape_problem(
        query_dtype="float32", cache_dtype="int8", block_size=16, head_size=64
    )


@pytest.mark.slow
def test_sanitizer_build_runs_a_small_grid():
    """ASan + UBSan build of the kernels (the native AVX-512 one and the portable one), each
    running a slice of test_cpu_decode and the FMA-peak loop in a subprocess: any
    out-of-bounds read or undefined behaviour aborts it. Two builds of ~1.5 min each (cached
    across runs)."""
    if cpu.unavailable_reason() is not None:
        pytest.skip(f"native CPU kernels: {cpu.unavailable_reason()}")
    cxx = _build.find_compiler()
    runtime = {}
    for lib in ("libasan.so", "libstdc++.so.6"):
        path = subprocess.run(
            [cxx, f"-print-file-name={lib}"], capture_output=True, text=True
        ).stdout.strip()
        if not os.path.isabs(path):
            pytest.skip(f"native CPU kernels: {cxx} has no {lib} (the sanitizer build)")
        runtime[lib] = path
    # -Werror too: the kernels build warning-free, natively and portably.
    sanitize = (
        "-fsanitize=address,undefined -fno-sanitize-recover=all -DJAX_ATTN_CPU_FEW_HEAD_SIZES"
        " -Werror"
    )
    for extra in (sanitize, f"-march=x86-64-v3 {sanitize}"):
        env = {
            **os.environ,
            "JAX_ATTN_CPU_EXTRA_FLAGS": extra,
            # libstdc++ too: without it ASan cannot intercept __cxa_throw in a Python process
            # and aborts at the first C++ exception, before any test runs.
            "LD_PRELOAD": f"{runtime['libasan.so']} {runtime['libstdc++.so.6']}",
            "ASAN_OPTIONS": "detect_leaks=0",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-x",
                "-rs",  # a failed build shows as skips: print their reason
                "-s",  # the sanitizer's report goes to fd 2: keep it out of pytest's capture
                "-p",
                "no:cacheprovider",
                str(REPO / "tests" / "jax" / "test_cpu_decode.py"),
                str(REPO / "tests" / "jax" / "test_cpu_fma_peak.py"),
                "-k",
                "block_size or window or split or head_size or bad_block or float8 or bfloat16"
                " or every_fma",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=1800,
        )
        assert result.returncode == 0, (extra, result.stdout[-3000:], result.stderr[-3000:])
        assert " passed" in result.stdout and "skipped" not in result.stdout.split("\n")[-2]

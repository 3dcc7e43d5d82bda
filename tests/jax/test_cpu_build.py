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
    before = path.stat()
    again, seconds = _build.build()
    assert again == path and seconds == 0.0
    after = path.stat()  # not rewritten (a build renames a new file into place: a new inode);
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
    assert after.st_mtime_ns >= before.st_mtime_ns  # a hit marks it used (the cache's pruning)
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


# A stand-in compiler: `-E` prints the unit's text, `-c` logs the unit to $FAKE_LOG and writes
# a placeholder object, a link writes a placeholder library.
FAKE_CXX = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "fake 1.0"; exit 0; fi
out=""; unit=""; pre=0
while [ $# -gt 0 ]; do
  case "$1" in
    -o) out="$2"; shift ;;
    -E) pre=1 ;;
    *.cc) unit="$1" ;;
  esac
  shift
done
if [ $pre = 1 ]; then cat "$unit"; exit 0; fi
if [ -n "$unit" ]; then echo "$(basename "$unit")" >> "$FAKE_LOG"; fi
echo "built from $unit" > "$out"
"""


def test_objects_are_shared_by_preprocessed_text_and_codegen_flags(tmp_path, monkeypatch):
    fake = tmp_path / "fake-c++"
    fake.write_text(FAKE_CXX)
    fake.chmod(0o755)
    log = tmp_path / "compiled.log"
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("JAX_ATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(_build.EXTRA_FLAGS_ENV, raising=False)
    src = tmp_path / "src"
    src.mkdir()
    for name in ("kernel.cc", "xla_glue.cc", "torch_glue.cc"):
        (src / name).write_text(f"// {name}\n")

    def library(name, glue, **kw):
        return _build.Library(name, lambda: [src / "kernel.cc", src / glue], lambda: [],
                              lambda: "framework 1", **kw)  # fmt: skip

    def compiled():
        units = log.read_text().split() if log.exists() else []
        log.write_text("")
        return sorted(units)

    xla = library("libx.so", "xla_glue.cc")

    def openmp_glue(unit):
        return ["-fopenmp"] if unit.name == "torch_glue.cc" else []

    torch_lib = library("libt.so", "torch_glue.cc", compile_flags=lambda: ["-DABI=1"],
                        unit_flags=openmp_glue)  # fmt: skip
    _build.build(lib=xla)
    assert compiled() == ["kernel.cc", "xla_glue.cc"]
    # another library: a preprocessor flag and a flag of its own unit do not split the kernel
    _build.build(lib=torch_lib)
    assert compiled() == ["torch_glue.cc"]
    # a changed text compiles again (a header's change reaches the preprocessed text)
    (src / "kernel.cc").write_text("// kernel.cc, changed\n")
    _build.build(lib=xla)
    assert compiled() == ["kernel.cc"]
    _build.build(lib=torch_lib)
    assert compiled() == []
    # a code-generation flag is a different object
    monkeypatch.setenv(_build.EXTRA_FLAGS_ENV, "-O2")
    _build.build(lib=torch_lib)
    assert compiled() == ["kernel.cc", "torch_glue.cc"]
    objects = sorted(p.name.split("-")[0] for p in (tmp_path / "cache" / "cpu-kernels" /
                                                    "objects").glob("*.o"))  # fmt: skip
    assert objects == ["kernel"] * 3 + ["torch_glue"] * 2 + ["xla_glue"]


def test_prune_removes_the_least_recently_used_down_to_the_cap(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_ATTN_CACHE_DIR", str(tmp_path / "cache"))
    root = _build.cache_root()
    now = 1_000_000_000.0
    hour, day = 3600.0, 86400.0

    def entry(rel, size, age):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * size)
        os.utime(path, (now - age, now - age))
        return path

    entry("key-old/libx.so", 1000, 3 * day)
    entry("key-old/.lock", 0, 3 * day)
    entry("key-new/libx.so", 1000, 2 * hour)
    entry("key-recent/libx.so", 1000, 10 * 60)  # inside the grace: stays whatever the cap
    entry("objects/a-1.o", 500, 5 * day)
    lock = entry("objects/.a-1.lock", 0, 5 * day)
    entry("objects/b-2.o", 500, day)
    # 4000 bytes against 2500: the oldest object, then the oldest library
    removed = _build.prune(max_bytes=2500, now=now)
    assert [p.relative_to(root).as_posix() for p in removed] == ["objects/a-1.o", "key-old"]
    assert not lock.exists()  # its object's lock goes with it
    assert (root / "key-new" / "libx.so").exists() and (root / "objects" / "b-2.o").exists()
    assert _build.prune(max_bytes=2500, now=now) == []  # at the cap: nothing more
    removed = _build.prune(max_bytes=0, now=now)
    assert [p.relative_to(root).as_posix() for p in removed] == ["objects/b-2.o", "key-new"]
    assert (root / "key-recent" / "libx.so").exists()


def test_a_cached_build_marks_its_library_and_objects_used(tmp_path, monkeypatch):
    fake = tmp_path / "fake-c++"
    fake.write_text(FAKE_CXX)
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "compiled.log"))
    monkeypatch.setenv("JAX_ATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(_build.EXTRA_FLAGS_ENV, raising=False)
    unit = tmp_path / "kernel.cc"
    unit.write_text("// kernel\n")
    lib = _build.Library("libx.so", lambda: [unit], lambda: [], lambda: "framework 1")
    path, _ = _build.build(lib=lib)
    obj = next((_build.cache_root() / "objects").glob("kernel-*.o"))
    old = path.stat().st_mtime - 30 * 86400
    for f in (path, obj):
        os.utime(f, (old, old))
    assert _build.build(lib=lib) == (path, 0.0)  # a cached library
    assert path.stat().st_mtime > old + 86400
    # another library of the same unit links the cached object
    other = _build.Library("liby.so", lambda: [unit], lambda: [], lambda: "framework 1")
    _build.build(lib=other)
    assert obj.stat().st_mtime > old + 86400


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
    assert "head_size=640" in cpu.shape_problem(
        query_dtype="float32", cache_dtype="float32", block_size=16, head_size=640
    )
    assert "int8" in cpu.shape_problem(
        query_dtype="float32", cache_dtype="int8", block_size=16, head_size=64
    )


# What the sanitizer builds run: slices of both kernels' correctness tests (odd block and head
# sizes, windows, fp8 and bf16, the multi-head decode items, split-K), every bad-metadata test
# (the issue's repro, the handlers' element counts, the bounded bad-metadata fuzz slice),
# the FMA-peak loop, and the read floor's loads.
SANITIZED_TESTS = (
    ("test_cpu_decode.py", "block_size or window or split or head_size or bad_block or float8"
     " or bfloat16"),
    ("test_cpu_ragged.py", "block_size or window or head_size or float8 or bfloat16 or decodes"
     " or causal or bad or num_seqs or vmap"),
    ("test_cpu_bad_metadata.py", None),
    ("test_cpu_fma_peak.py", "every_fma"),
    ("test_cpu_read_floor.py", "checksum or dtype"),
)  # fmt: skip


# The tests that skip where the kernels run no AMX tiles (-k names to leave out there).
NOT_HERE_WITHOUT_AMX = {
    "test_cpu_ragged.py": "cpu_ragged_amx",
    "test_cpu_decode.py": "paged_decode_amx",
}


def _pytest_in_child(env: dict, tests) -> subprocess.CompletedProcess:
    """`tests` ((file, -k expression or None), ...) in one child pytest run, one file at a time
    so each keeps its own -k (a file of tests/jax, or a path under tests/ with its folder);
    returns the last failing run or the last run. The stages' skip
    audit variables stay behind (a child runs a few files: no stage's tests need pass there);
    JAX_ATTN_REQUIRE_NATIVE goes on, so a child that cannot build the kernels fails."""
    env = {k: v for k, v in env.items()
           if not k.startswith("JAX_ATTN_REQUIRE_") or k == "JAX_ATTN_REQUIRE_NATIVE"}  # fmt: skip
    last = None
    for name, keyword in tests:
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
               "-p", "no:xdist",
               "-rs",  # a failed build shows as skips: print their reason
               "-s",  # the sanitizer's report goes to fd 2: keep it out of pytest's capture
               str(REPO / "tests" / (name if "/" in name else f"jax/{name}"))]  # fmt: skip
        if keyword:
            cmd += ["-k", keyword]
        last = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=2400)
        tail = last.stdout.strip().splitlines()[-1] if last.stdout.strip() else ""
        if last.returncode != 0 or " passed" not in tail or "skipped" in tail:
            return last
    return last


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_sanitizer_build_runs_both_kernels(portable):
    """ASan + UBSan build of the kernels (the native AVX-512 one, and the portable one:
    -march=x86-64-v3, 8-wide vectors), running SANITIZED_TESTS in a child process: any
    out-of-bounds access or undefined behaviour aborts it. A build of ~1.5-3 min each (cached
    across runs)."""
    if cpu.unavailable_reason() is not None:
        pytest.skip(f"native CPU kernels: {cpu.unavailable_reason()}")
    from interop import bad_metadata

    try:  # (the sanitizer flags include -Werror: the kernels build warning-free)
        env = bad_metadata.sanitizer_env(bad_metadata.PORTABLE_FLAGS if portable else "")
    except RuntimeError as e:
        pytest.skip(f"native CPU kernels: {e}")
    tests = SANITIZED_TESTS
    if portable or "amx-bf16" not in (cpu.isa() or ""):
        # no AMX here (portable: no AVX-512 at all): the AMX cases skip by design
        tests = tuple((n, f"({k}) and not {NOT_HERE_WITHOUT_AMX[n]}" if n in NOT_HERE_WITHOUT_AMX
                       else k) for n, k in tests)  # fmt: skip
    result = _pytest_in_child(env, tests)
    tail = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, (env["JAX_ATTN_CPU_EXTRA_FLAGS"], result.stdout[-3000:],
                                    result.stderr[-3000:])  # fmt: skip
    assert " passed" in tail and "skipped" not in tail, result.stdout[-3000:]


# What the build with emulated AMX tiles runs: every AMX case of both kernels (token-major and,
# through the torch ops, vLLM's split layout), and the AMX peak probe's exact sums.
EMULATED_AMX_TESTS = (
    ("test_cpu_ragged.py", "amx"),
    ("test_cpu_decode.py", "amx"),
    ("test_cpu_amx_peak.py", "every_tile or available_where"),
    ("torch/test_native_ops.py", "not opcheck"),
)


@pytest.mark.slow
@pytest.mark.long
def test_emulated_amx_build_runs_the_amx_tests_under_the_sanitizers():
    """The AMX paths on any AVX-512 BF16 CPU: a build with -DJAX_ATTN_AMX_EMULATE=1
    (amx_tiles.h: every tile instruction done in software on per-thread tile registers, a
    configuration the hardware would fault on stops the process) and ASan + UBSan, running
    EMULATED_AMX_TESTS in a child process, no case skipped. The tiles' tiling, operand packing
    and masking are then checked against the float64 oracle on CPUs without tiles, and their
    memory accesses by the sanitizers, which cannot see inside a real tile load."""
    if cpu.unavailable_reason() is not None:
        pytest.skip(f"native CPU kernels: {cpu.unavailable_reason()}")
    missing = {"avx512f", "avx512bw", "avx512_bf16", "avx512vbmi"} - _build.cpu_flags()
    if missing:
        pytest.skip(f"the emulated tiles need AVX-512 with {', '.join(sorted(missing))}")
    pytest.importorskip("torch", reason="the split layout's AMX decode runs as a torch op")
    from interop import bad_metadata

    try:
        env = bad_metadata.sanitizer_env("-DJAX_ATTN_AMX_EMULATE=1")
    except RuntimeError as e:
        pytest.skip(f"native CPU kernels: {e}")
    check = subprocess.run(
        [sys.executable, "-c", "from jax_attn import cpu; print(cpu.isa())"],
        capture_output=True, text=True, env=env, timeout=1200,
    )  # fmt: skip
    assert "amx-bf16 (emulated)" in check.stdout, (check.stdout, check.stderr[-3000:])
    result = _pytest_in_child(env, EMULATED_AMX_TESTS)
    tail = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    assert " passed" in tail and "skipped" not in tail, result.stdout[-3000:]


# The builds without AVX-512 (flags, the test files each runs):
# - avx2: -march=x86-64-v3, the AVX2 + FMA + F16C kernels (vec_avx2.h: the ragged kernel's
#   8-wide vectors, decode_avx2.h) of AMD Zen 2 / 3 and Intel's client cores, through both
#   kernels' whole correctness files, the bad-metadata tests and the read floor's (its AVX2
#   loads);
# - generic: the same without AVX2 and FMA, the code any other CPU compiles (GCC's generic
#   vectors, the decode's scalar item), through both kernels' correctness files.
PORTABLE_BUILDS = {
    "avx2": ("-march=x86-64-v3", ("test_cpu_ragged.py", "test_cpu_decode.py",
                                  "test_cpu_bad_metadata.py", "test_cpu_read_floor.py")),
    "generic": ("-march=x86-64-v3 -mno-avx2 -mno-fma", ("test_cpu_ragged.py",
                                                        "test_cpu_decode.py")),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("build", sorted(PORTABLE_BUILDS))
def test_portable_build_runs_the_correctness_tests(build):
    """The kernels built without AVX-512 (PORTABLE_BUILDS) through the correctness tests,
    without sanitizers (full speed, every case)."""
    if cpu.unavailable_reason() is not None:
        pytest.skip(f"native CPU kernels: {cpu.unavailable_reason()}")
    flags, files = PORTABLE_BUILDS[build]
    missing = {"avx", "avx2", "fma", "f16c"} - _build.cpu_flags()
    if missing:
        pytest.skip(f"the {build} build needs {', '.join(sorted(missing))}")
    env = {
        **os.environ,
        "JAX_ATTN_CPU_EXTRA_FLAGS": f"{flags} -Werror",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    check = subprocess.run(
        [sys.executable, "-c", "from jax_attn import cpu; print(cpu.isa())"],
        capture_output=True, text=True, env=env, timeout=1200,
    )  # fmt: skip
    assert ("avx2" in check.stdout) == (build == "avx2"), (check.stdout, check.stderr[-3000:])
    # The AMX cases skip without AVX-512 by design (the isa and decode_path tests cover that),
    # and so do the checks of the AVX-512 decode's code (they read what that build emits).
    keyword = {n: f"not {k}" for n, k in NOT_HERE_WITHOUT_AMX.items()}
    keyword["test_cpu_decode.py"] += " and not codegen"
    result = _pytest_in_child(env, [(name, keyword.get(name)) for name in files])
    tail = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    assert " passed" in tail and "skipped" not in tail, result.stdout[-3000:]

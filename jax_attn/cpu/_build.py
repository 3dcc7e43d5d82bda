"""Build the native CPU kernels (csrc/) into shared libraries, lazily, cached.

One source tree, two libraries:
- `libjax_attn_cpu.so` (`XLA`): every csrc/*.cc except torch_*.cc, the kernels with their XLA
  FFI handlers, registered as FFI targets for `jax_attn.cpu`;
- `libjax_attn_torch.so` (`torch_backends/native.py`): the kernels torch_ops.cc binds as torch
  ops, compiled against the running torch's headers (never JAX's).

A library is compiled with the system C++ compiler ($CXX, else c++, else g++) on first use,
for the building machine (`-march=native`), into
`${JAX_ATTN_CACHE_DIR:-~/.cache/jax-attn}/cpu-kernels/<key>/`, where the key hashes the
sources, the flags, the compiler's version, the framework's version and the CPU's feature
flags: any change rebuilds, nothing else does. The compiler writes a temporary file that is
renamed into place, under a file lock, so concurrent processes (pytest-xdist workers) build at
most once and never load a half-written library.

Objects are cached too, in `cpu-kernels/objects/`, keyed by what the compiler is given: the
unit's preprocessed text, the flags that are not preprocessor flags, the compiler's version and
the CPU's feature flags. The kernels' units include no framework header, so the XLA library and
every torch library with the same flags (torch's ABI macro at the compiler's default) link the
same kernel objects: a sanitized build of the torch ops reuses the XLA one's, and another torch
version compiles only torch_ops.cc.

The cache is bounded: after each build, libraries and objects not used for the longest time go
until the cache holds at most `JAX_ATTN_CACHE_MAX_MB` (default 1024; a sanitized set of the
libraries takes ~150 MB). A hit marks its entry used; nothing used in the last hour goes (another
process may be about to link it).

Only the standard library is imported at module level: torch_backends, which must not import
JAX, loads this file by path for its own library.

`python -m jax_attn.cpu._build` builds the XLA library eagerly and prints its path and build
time.
"""

import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
FLAGS = (
    "-O3",
    "-march=native",
    "-std=c++17",
    "-fPIC",
    "-shared",
    "-fvisibility=hidden",
    "-Wall",
    "-Wextra",
)
LIB_NAME = "libjax_attn_cpu.so"
DISABLE_ENV = "JAX_ATTN_CPU_DISABLE"
# Extra compiler flags, appended (part of the cache key): e.g. "-march=x86-64-v3" to build the
# AVX2 (no AVX-512) kernels on an AVX-512 machine, or "-fsanitize=address,undefined".
EXTRA_FLAGS_ENV = "JAX_ATTN_CPU_EXTRA_FLAGS"
MAX_MB_ENV = "JAX_ATTN_CACHE_MAX_MB"
DEFAULT_MAX_MB = 1024
PRUNE_GRACE_S = 3600.0  # an entry used this recently is never pruned

# Handler symbols exported by csrc/*.cc, registered as XLA FFI targets of the same name.
# A kernel file adds its symbol here; a symbol missing from the library is skipped (so the
# list can name kernels that land on another branch first).
HANDLERS = (
    "jax_attn_cpu_paged_decode",
    "jax_attn_cpu_ragged_paged_attention",
    "jax_attn_cpu_fma_peak",
    "jax_attn_cpu_amx_peak",
    "jax_attn_cpu_read_floor",
)


@dataclass(frozen=True)
class Library:
    """One shared library built from csrc/: which units, against which framework."""

    name: str  # file name, e.g. libjax_attn_cpu.so
    units: Callable[[], list[Path]]  # the .cc files compiled (every csrc/*.h is in the key)
    include_dirs: Callable[[], list[str]]  # the framework's headers (-isystem)
    version: Callable[[], str]  # the framework's version, part of the cache key
    compile_flags: Callable[[], list[str]] = field(default=lambda: [])
    link_flags: Callable[[], list[str]] = field(default=lambda: [])
    # flags for one unit only (e.g. -fopenmp for the unit that calls at::parallel_for)
    unit_flags: Callable[[Path], list[str]] = field(default=lambda unit: [])


def _xla_units() -> list[Path]:
    return sorted(p for p in CSRC.glob("*.cc") if not p.name.startswith("torch_"))


def _jax_include_dirs() -> list[str]:
    import jax

    return [jax.ffi.include_dir()]


def _jaxlib_version() -> str:
    import jaxlib

    return "jaxlib " + jaxlib.__version__


XLA = Library(LIB_NAME, _xla_units, _jax_include_dirs, _jaxlib_version)

_lock = threading.Lock()
_state: dict = {}  # "reason" (str | None), "lib", "path", "registered" (set)


def cache_root() -> Path:
    root = os.environ.get("JAX_ATTN_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "jax-attn"
    )
    return Path(root) / "cpu-kernels"


def find_compiler() -> str | None:
    """$CXX if set (its first word must be on PATH or a path), else c++, else g++."""
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else []
    candidates += ["c++", "g++"]
    for cand in candidates:
        found = shutil.which(cand.split()[0]) if cand.split() else None
        if found:
            return found
        if os.environ.get("CXX") == cand:
            return None  # an explicit $CXX that does not exist: say so, do not guess
    return None


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if "error" in line.lower():
            return line.strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else "(no output)"


@functools.cache
def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (`avx2`, `avx512f`, `amx_tile`...):
    the set the build is keyed on."""
    return frozenset(_cpu_flags().split())


@functools.cache
def _compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"compiler {cxx} does not run: {e}") from e
    if out.returncode != 0:
        raise RuntimeError(f"compiler {cxx} --version failed: {_first_line(out.stderr)}")
    return out.stdout


def flags() -> tuple[str, ...]:
    return (*FLAGS, *os.environ.get(EXTRA_FLAGS_ENV, "").split())


def sources(lib: Library = XLA) -> list[Path]:
    """The files `lib` is built from: its units and every header."""
    return sorted([*lib.units(), *CSRC.glob("*.h")])


def build_key(cxx: str, lib: Library = XLA) -> str:
    h = hashlib.sha256()
    h.update(lib.name.encode())
    for src in sources(lib):
        h.update(src.name.encode())
        h.update(src.read_bytes())
    unit_flags = [f for unit in lib.units() for f in (unit.name, *lib.unit_flags(unit))]
    h.update(" ".join([*flags(), *lib.compile_flags(), *lib.link_flags(), *unit_flags]).encode())
    h.update(_compiler_version(cxx).encode())
    h.update(lib.version().encode())
    h.update(_cpu_flags().encode())
    return h.hexdigest()[:20]


def build(verbose: bool = False, lib: Library = XLA) -> tuple[Path, float]:
    """Build (or find cached) `lib`; returns (path, seconds spent compiling: 0 if cached).

    Raises RuntimeError with a one-line reason when no compiler is found or the build fails.
    """
    cxx = find_compiler()
    if cxx is None:
        tried = f"$CXX={os.environ['CXX']!r}, " if os.environ.get("CXX") else "$CXX (unset), "
        raise RuntimeError(f"no C++ compiler found (tried {tried}c++, g++)")
    out_dir = cache_root() / build_key(cxx, lib)
    lib_path = out_dir / lib.name
    if lib_path.exists():
        _mark_used(lib_path)
        return lib_path, 0.0
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
        if lib_path.exists():
            return lib_path, 0.0
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=".build-", dir=out_dir) as tmp_dir:
            tmp = os.path.join(tmp_dir, lib.name)
            _compile_and_link(cxx, lib, tmp, verbose)
            seconds = time.perf_counter() - start
            os.replace(tmp, lib_path)  # atomic: readers see no library or a whole one
    prune()
    return lib_path, seconds


def _mark_used(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:  # a read-only cache: nothing is pruned from it either
        pass


def prune(max_bytes: int | None = None, now: float | None = None) -> list[Path]:
    """Removes the cache's least recently used libraries (`<key>/` directories) and objects
    until it holds at most `max_bytes` (default: $JAX_ATTN_CACHE_MAX_MB MiB, else 1024), never
    an entry used in the last PRUNE_GRACE_S seconds. Returns what it removed."""
    if max_bytes is None:
        max_bytes = int(float(os.environ.get(MAX_MB_ENV) or DEFAULT_MAX_MB) * 2**20)
    now = time.time() if now is None else now
    root = cache_root()
    entries = []  # (last use, bytes, path)
    try:
        for entry in root.iterdir():
            if entry.name == "objects":
                entries += [(st.st_mtime, st.st_size, o)
                            for o in entry.glob("*.o") for st in (o.stat(),)]  # fmt: skip
            elif entry.is_dir():
                files = [f.stat() for f in entry.rglob("*") if f.is_file()]
                if files:
                    entries.append((max(f.st_mtime for f in files),
                                    sum(f.st_size for f in files), entry))  # fmt: skip
    except OSError:  # another process pruned or built at the same time: try next build
        return []
    total = sum(size for _, size, _ in entries)
    removed = []
    for used, size, path in sorted(entries, key=lambda e: e[0]):
        if total <= max_bytes or used > now - PRUNE_GRACE_S:
            break
        try:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
                (path.parent / f".{path.stem}.lock").unlink(missing_ok=True)
        except OSError:
            continue
        total -= size
        removed.append(path)
    return removed


def _run_tool(cmd: list[str], cxx: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"build failed ({Path(cxx).name}): {e}") from e


def _failed(proc: subprocess.CompletedProcess, cxx: str) -> RuntimeError:
    message = _first_line(proc.stderr + proc.stdout)
    return RuntimeError(f"build failed ({Path(cxx).name}): {message}")


# Preprocessor arguments: they reach the object only through the preprocessed text.
_PREPROCESSOR_ARGS = ("-I", "-isystem", "-D", "-U")


def _codegen_args(command: list[str]) -> list[str]:
    """`command`'s arguments less the preprocessor's (and their values)."""
    out, skip = [], False
    for arg in command:
        if skip:
            skip = False
        elif arg in _PREPROCESSOR_ARGS:
            skip = True
        elif not arg.startswith(_PREPROCESSOR_ARGS):
            out.append(arg)
    return out


def _object(cxx: str, compiler: str, command: list[str], unit: Path) -> tuple[Path, str]:
    """The object of `unit` compiled by `command` (`cxx` + flags, without -c/-o), from the
    object cache or compiled into it; returns (path, compiler's stderr: "" when cached).
    Raises RuntimeError with the first error line."""
    pre = _run_tool([*command, "-E", "-P", str(unit)], cxx)
    if pre.returncode != 0:
        raise _failed(pre, cxx)
    h = hashlib.sha256()
    for part in (compiler, _cpu_flags(), "\0".join(_codegen_args(command[1:])), pre.stdout):
        h.update(part.encode())
        h.update(b"\0")
    objects = cache_root() / "objects"
    objects.mkdir(parents=True, exist_ok=True)
    path = objects / f"{unit.stem}-{h.hexdigest()[:24]}.o"
    if path.exists():
        _mark_used(path)
        return path, ""
    with open(objects / f".{path.stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another library may be compiling the same object
        if path.exists():
            return path, ""
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".o", dir=objects)
        os.close(fd)
        try:
            proc = _run_tool([*command, "-c", str(unit), "-o", tmp], cxx)
            if proc.returncode != 0:
                raise _failed(proc, cxx)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)  # atomic: no reader links a half-written object
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path, proc.stderr


def _compile_and_link(cxx: str, lib: Library, out: str, verbose: bool) -> None:
    """Each .cc into an object (from the object cache where it holds one), all at once (the
    units compile in parallel), then one shared library at `out`. Raises RuntimeError with the
    first error line."""
    from concurrent.futures import ThreadPoolExecutor

    units = lib.units()
    compiler = _compiler_version(cxx)
    includes = [arg for d in lib.include_dirs() for arg in ("-isystem", d)]
    common = [cxx, *flags(), *lib.compile_flags(), *includes, f"-I{CSRC}"]

    def compile_unit(unit: Path) -> tuple[Path, str]:
        return _object(cxx, compiler, [*common, *lib.unit_flags(unit)], unit)

    with ThreadPoolExecutor(max_workers=max(1, min(len(units), os.cpu_count() or 1))) as pool:
        futures = [pool.submit(compile_unit, unit) for unit in units]
        results = [f.result() for f in futures]  # the first unit's error, in unit order
    for _, stderr in results:
        if verbose and stderr.strip():
            print(stderr, file=sys.stderr)
    link = [cxx, *flags(), *(str(obj) for obj, _ in results), "-o", out, *lib.link_flags()]
    proc = _run_tool(link, cxx)
    if proc.returncode != 0:
        raise _failed(proc, cxx)
    if not os.path.exists(out) or os.path.getsize(out) == 0:
        raise RuntimeError(f"build failed ({Path(cxx).name}): no library written")


def _load_and_register() -> None:
    import jax

    path, seconds = build()
    lib = ctypes.cdll.LoadLibrary(str(path))
    registered = set()
    for name in HANDLERS:
        try:
            symbol = getattr(lib, name)
        except AttributeError:
            continue
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(symbol), platform="cpu")
        registered.add(name)
    _state.update(lib=lib, path=path, build_seconds=seconds, registered=registered)


def unavailable_reason() -> str | None:
    """None when the kernels are built and registered (building them on first call), else a
    one-line reason. Never raises. `JAX_ATTN_CPU_DISABLE=1` forces a reason (to test the
    fallback)."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return f"disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]}"
    with _lock:
        if "reason" not in _state:
            try:
                _load_and_register()
                _state["reason"] = None
            except Exception as e:  # the contract: a reason, never an exception
                _state["reason"] = str(e).splitlines()[0] if str(e) else type(e).__name__
        return _state["reason"]


def registered(name: str) -> bool:
    """Whether handler `name` is in the built library (after unavailable_reason() is None)."""
    return unavailable_reason() is None and name in _state["registered"]


def isa() -> str | None:
    """What the built kernels run on this CPU (csrc/isa.cc), e.g. "bf16 products: amx-bf16;
    vectors: avx512; prefetch: L2"; None when the kernels are not available."""
    if unavailable_reason() is not None:
        return None
    fn = getattr(_state["lib"], "jax_attn_cpu_isa", None)
    if fn is None:
        return None
    fn.restype = ctypes.c_char_p
    return fn().decode()


def c_function(name: str):
    """The built library's exported C function `name` (a ctypes function), or None when the
    kernels are not available or the library has no such symbol."""
    if unavailable_reason() is not None:
        return None
    return getattr(_state["lib"], name, None)


def library_path() -> Path | None:
    return _state.get("path") if unavailable_reason() is None else None


def main() -> int:
    start = time.perf_counter()
    try:
        path, seconds = build(verbose=True)
    except RuntimeError as e:
        print(f"jax_attn.cpu: {e}", file=sys.stderr)
        return 1
    total = time.perf_counter() - start
    status = f"built in {seconds:.1f} s" if seconds else f"cached (checked in {total:.2f} s)"
    print(f"{path}\n{status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

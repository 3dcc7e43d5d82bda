"""torch's OpenMP workers and the JAX backend's CPU calls (issue 20).

torch's CPU wheels run their parallel ops on GNU OpenMP (the `libgomp` they bundle). When a
parallel op ends, libgomp's workers do not sleep at once: each spins `GOMP_SPINCOUNT` times
(300 000 by default, milliseconds of a core) waiting for the next op. In a model step the JAX
backend's attention comes right after torch ops (the projections, the rotary embedding), so its
XLA call starts while torch's workers still spin on the cores XLA's pool and the native kernels'
workers need. With more runnable threads than cores (XLA's pool beside torch's on a small
machine, or any other load) it gets far worse: workers spin on cores that the thread they wait
for needs, and a whole step can run several times slower (measured: docs/interop.md).

libgomp reads its wait policy once, when torch loads, from the environment; nothing can change it
afterwards. So the backend cannot fix it for the user without touching their torch code: it says
so, once, with what to set (`spin_problem`, `warn_if_spinning`). The setting and its measured
effect on vLLM 0.8.5's engine step are in docs/interop.md ("Threads: torch's OpenMP and XLA").
"""

import os
import warnings

# What the warning recommends: spin briefly (~0.1 ms, longer than the Python between a model's
# torch ops, far shorter than the default), then sleep. Back-to-back torch ops still find their
# workers awake; a JAX call after a torch op finds the cores free. Spin counts up to this are
# taken as short enough (measured in vLLM's engine step: docs/interop.md).
RECOMMENDED_SPINCOUNT = 10_000
RECOMMENDED = f"GOMP_SPINCOUNT={RECOMMENDED_SPINCOUNT}"

_warned = False


def loaded_openmp() -> list[str]:
    """File names of the OpenMP runtimes mapped into this process (libgomp, libiomp5, libomp)."""
    names = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                name = os.path.basename(line.split()[-1])
                if name.startswith(("libgomp", "libiomp", "libomp")):
                    names.add(name)
    except OSError:  # no /proc (not Linux): nothing known
        pass
    return sorted(names)


def _spincount(value: str) -> int | None:
    """libgomp's GOMP_SPINCOUNT: a count with an optional k/M/G/T suffix, or "infinite"."""
    value = value.strip().lower()
    if value == "infinite" or value == "infinity":
        return None
    scale = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}.get(value[-1:], 1)
    digits = value[:-1] if scale > 1 else value
    try:
        return int(digits) * scale
    except ValueError:
        return None


def spin_problem(
    environ=None, openmp: list[str] | None = None, torch_threads: int | None = None
) -> str | None:
    """Why torch's OpenMP workers will spin through the JAX backend's CPU calls, or None.

    None when torch runs one thread (no workers), when its OpenMP is not GNU's (Intel's
    libiomp5 has its own `KMP_BLOCKTIME`, which vLLM sets to 1 ms), or when the environment
    already holds a passive wait policy or a short `GOMP_SPINCOUNT`. The environment read is
    this process's now: libgomp read it when torch loaded, so a value set after that has no
    effect (and is taken here as set)."""
    env = os.environ if environ is None else environ
    if torch_threads is None:
        import torch

        torch_threads = torch.get_num_threads()
    if torch_threads <= 1:
        return None
    libs = loaded_openmp() if openmp is None else openmp
    if not any(name.startswith("libgomp") for name in libs):
        return None
    policy = env.get("OMP_WAIT_POLICY", "").strip().upper()
    if policy == "PASSIVE":
        return None
    count = env.get("GOMP_SPINCOUNT")
    if count is not None:
        n = _spincount(count)
        if n is not None and n <= RECOMMENDED_SPINCOUNT:
            return None
        spin = f"GOMP_SPINCOUNT={count}"
    elif policy == "ACTIVE":
        spin = "OMP_WAIT_POLICY=ACTIVE (30 billion spins)"
    else:
        spin = "libgomp's default of 300000 spins"
    return (
        f"torch's {torch_threads} OpenMP threads (GNU libgomp) spin after every torch op "
        f"({spin}) on the cores the JAX backend's next XLA call needs; with more runnable threads "
        "than cores (XLA's pool beside torch's, or any other load) a model step can run several "
        f"times slower. Set {RECOMMENDED} (or OMP_WAIT_POLICY=PASSIVE, which slows small torch "
        "ops more) in the environment before torch is imported; see docs/interop.md, 'Threads: "
        "torch's OpenMP and XLA'"
    )


def warn_if_spinning() -> None:
    """`spin_problem` as a `RuntimeWarning`, once per process (the first CPU call)."""
    global _warned
    if _warned:
        return
    _warned = True
    problem = spin_problem()
    if problem is not None:
        warnings.warn(f"JAX backend: {problem}", RuntimeWarning, stacklevel=3)

"""What the two peak probes (`fma_peak`, `amx_peak`) share: their arguments' checks, and the
sizing of a measurement (a call long enough to time, the fastest of several: machine noise only
ever slows a call down)."""

from collections.abc import Callable


def check_run_args(iterations: int, threads: int, items: int, max_iterations: int) -> None:
    if not 0 <= iterations <= max_iterations:
        raise ValueError(f"{iterations=} must be in [0, {max_iterations}]")
    if threads < 0:
        raise ValueError(f"{threads=} must be >= 0 (0: the kernels' worker count)")
    if items < 0:
        raise ValueError(f"{items=} must be >= 0 (0: 8 per worker)")


def fastest(run: Callable, first: int, max_iterations: int, threads: int, seconds: float,
            repeats: int):  # fmt: skip
    """The fastest of `repeats` calls `run(iterations, threads)`, `iterations` grown from
    `first` until a call takes about `seconds` (`run`'s result has `.seconds`)."""
    iterations = first
    probe = run(iterations, threads)
    while probe.seconds < seconds / 4 and iterations < max_iterations:
        iterations = min(max_iterations, iterations * 4)
        probe = run(iterations, threads)
    iterations = int(min(max_iterations, max(iterations, iterations * seconds / probe.seconds)))
    return min((run(iterations, threads) for _ in range(repeats)), key=lambda r: r.seconds)

"""`jax-attn bench`'s machine guard: a timed sample is taken again when the machine lacked its
cores while it ran.

The 2-core VMs this project is measured on at times give their two vCPUs one physical core's
vector throughput for seconds on end, with no steal time in /proc/stat: the FMA probe on both
workers then reads what one worker reads alone. Measured on the AMD Zen 4 VM (2026-12-04,
NOTES.md): over 90 s of alternated prefill calls, a 7 ms probe on both workers read 113-116
GFLOP/s (one worker's rate) around 1 call in 12, in runs of one to twenty seconds, and 190-230
otherwise; TORCH_SDPA's float32 prefill-8x512 took 157-172 ms beside such a reading and 88-117
ms beside the others. One such sample among 5 moves no median; two do. The peaks and floors the
times are judged against (the FMA and read floors, the fastest of several) are measured on the
machine at its best, so a sample of the machine at half its cores is not the workload's.

So, where the FMA probe runs, every timed sample is bracketed by short probes on all workers
(`probe` after `pause_s`, by which torch's OpenMP workers have stopped spinning): a sample
with a reading below `least_gflop_s` before or after it is kept aside and taken again, up to
`attempts` times in all; the last attempt stands either way. Before a take whose last reading
was low, the guard reads again until a reading is not (for `wait_s` at most): the machine's
short spells end within seconds. The reading before a sample is the one after the sample
before it, when there was one since `reset`. A machine that stays short (other work on its
cores: more than half of the last `window` readings low) is no spell to wait out: there each
sample stands as it comes (counted in `low_kept`), until the readings recover. The record keeps
each set-aside sample (`retaken`), the samples that stood with a low reading (`low_kept`), and
the guard's readings and threshold; the rule is the same for every peer, floor and workload.
"""

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import Any

# The probe: FMA chains on every worker for about this long (long enough that the dispatch does
# not drag the reading: 2 ms probes read 0.8 of the peak on a healthy VM, 7 ms ones 0.9-0.98).
PROBE_S = 0.008
PAUSE_S = 0.01  # before each probe (torch's OpenMP workers spin ~2-5 ms after an op)
# A reading below this fraction of the run's FMA peak (workers x one worker's) is low: a healthy
# VM read 0.82-0.99 of it, one at one core's throughput 0.49-0.51.
LEAST_FRACTION = 0.7
ATTEMPTS = 3  # takes of one sample at most
WAIT_S = 3.0  # before a take, readings while the last one is low, for this long at most
WINDOW = 40  # readings that say whether the machine stays short (more than half of them low)


@dataclasses.dataclass
class Taken:
    """A guarded sample: `result` is what stands; `retaken` the results set aside, each with
    the readings around it; `low` whether the standing one had a low reading beside it."""

    result: Any
    retaken: list[dict]
    low: bool


@dataclasses.dataclass
class Guard:
    probe: Callable[[], float]  # one short probe: GFLOP/s on all workers
    least_gflop_s: float  # a reading below this is low
    attempts: int = ATTEMPTS
    pause_s: float = PAUSE_S
    wait_s: float = WAIT_S
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.perf_counter
    window: int = WINDOW
    readings: int = 0
    low_readings: int = 0
    _last: float | None = None
    _recent: collections.deque = dataclasses.field(init=False)  # low or not, the last `window`

    def __post_init__(self) -> None:
        self._recent = collections.deque(maxlen=self.window)

    def reset(self) -> None:
        """Forget the last reading: the next sample gets a probe of its own before it (after
        a gap in the rounds, such as a workload's preparation)."""
        self._last = None

    def reading(self) -> float:
        self.sleep(self.pause_s)
        value = float(self.probe())
        low = value < self.least_gflop_s
        self.readings += 1
        self.low_readings += low
        self._last = value
        self._recent.append(low)
        return value

    def stays_short(self) -> bool:
        """More than half of the last `window` readings (a full window) were low: the cores
        are taken by other work, not in a passing spell."""
        return len(self._recent) == self.window and 2 * sum(self._recent) > self.window

    def _ready(self) -> float:
        """The reading before a take: the last one if there is one and it is not low (or the
        machine stays short), else new readings until one is not low, `wait_s` has passed or
        the machine stays short; the last of them."""
        value = self._last
        if value is not None and (value >= self.least_gflop_s or self.stays_short()):
            return value
        deadline = self.clock() + self.wait_s
        value = self.reading()
        while value < self.least_gflop_s and self.clock() < deadline and not self.stays_short():
            value = self.reading()
        return value

    def take(self, measure: Callable[[], Any], seconds: Callable[[Any], float]) -> Taken:
        """`measure()` (its settling calls and its timed one) until no reading beside it is
        low, `attempts` times at most; `seconds(result)` is the timed call's time, which the
        set-aside samples keep."""
        if self.attempts < 1:
            raise ValueError(f"attempts={self.attempts} must be >= 1")
        retaken = []
        for attempt in range(self.attempts):
            before = self._ready()
            result = measure()
            after = self.reading()
            low = min(before, after) < self.least_gflop_s
            if not low or attempt == self.attempts - 1 or self.stays_short():
                return Taken(result, retaken, low)
            retaken.append(
                dict(s=round(seconds(result), 6), before=round(before, 1), after=round(after, 1))
            )
        raise AssertionError("unreachable")  # the last attempt returns

    def record(self) -> dict:
        return dict(
            status="on",
            least_gflop_s=self.least_gflop_s,
            least_fraction=LEAST_FRACTION,
            probe_s=PROBE_S,
            pause_s=self.pause_s,
            wait_s=self.wait_s,
            window=self.window,
            attempts=self.attempts,
            readings=self.readings,
            low_readings=self.low_readings,
        )


def fma_guard(fma_peak: dict) -> tuple[Guard | None, str]:
    """A Guard over the native FMA probe, judged against the run's FMA peak record
    (`benchmarks.run.measure_fma_peak`); (None, why) where either is missing."""
    if fma_peak.get("status") != "ok" or not fma_peak.get("gflop_s"):
        return None, f"no FMA peak in this run ({fma_peak.get('note', 'not measured')})"
    from jax_attn.cpu import fma_peak as probe_module

    # Size the probe: iterations grown until a call takes a measurable time, then scaled.
    iterations = 1 << 12
    run = probe_module.run(iterations)
    while run.seconds < PROBE_S / 8 and iterations < probe_module.MAX_ITERATIONS // 4:
        iterations *= 4
        run = probe_module.run(iterations)
    scaled = int(iterations * PROBE_S / max(run.seconds, 1e-6))
    iterations = max(1, min(probe_module.MAX_ITERATIONS, scaled))
    probe_module.run(iterations)  # compiled before the first reading

    def probe() -> float:
        return probe_module.run(iterations).gflop_s

    return Guard(probe, LEAST_FRACTION * fma_peak["gflop_s"]), ""

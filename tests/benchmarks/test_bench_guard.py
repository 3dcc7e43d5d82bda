"""The bench's machine guard (benchmarks/guard.py): a sample beside a low FMA probe reading is
taken again, the set-aside ones are kept, and the rule is the same for every peer."""

import argparse

import numpy as np
import pytest

from benchmarks import command, report, run
from benchmarks.backends import Peer
from benchmarks.guard import Guard
from benchmarks.prepared import Prepared
from benchmarks.workloads import named_workloads


def _guard(readings, attempts=3, wait_s=10.0, window=40):
    """A Guard whose probe returns `readings` in turn (a low one is below 100), on a clock that
    moves 1 s per look."""
    readings = list(readings)
    used = []
    now = [0.0]

    def probe():
        used.append(readings[len(used)])
        return used[-1]

    def clock():
        now[0] += 1.0
        return now[0]

    guard = Guard(probe, least_gflop_s=100.0, attempts=attempts, wait_s=wait_s,
                  window=window, sleep=lambda s: None, clock=clock)  # fmt: skip
    return guard, used


def _counter(times):
    times = list(times)
    calls = []

    def measure():
        calls.append(times[len(calls)])
        return calls[-1]

    return measure, calls


def test_a_sample_beside_a_low_reading_is_taken_again_and_kept_aside():
    # before, after the 1st take (low), two while waiting (low, then not), after the 2nd
    guard, used = _guard([200, 50, 60, 205, 210])
    measure, calls = _counter([0.9, 0.5])
    taken = guard.take(measure, seconds=lambda t: t)
    assert taken.result == 0.5 and not taken.low
    assert taken.retaken == [dict(s=0.9, before=200.0, after=50.0)]
    assert calls == [0.9, 0.5] and used == [200, 50, 60, 205, 210]
    assert (guard.readings, guard.low_readings) == (5, 2)


def test_a_low_reading_before_the_first_take_waits_for_the_machine():
    guard, used = _guard([40, 30, 200, 200])
    measure, calls = _counter([0.7])
    taken = guard.take(measure, seconds=lambda t: t)
    assert taken.result == 0.7 and taken.retaken == [] and not taken.low and len(calls) == 1
    assert used == [40, 30, 200, 200]


def test_the_last_take_stands_when_every_reading_is_low():
    # wait_s 0.5 on a clock moving 1 s per look: one reading per wait.
    guard, used = _guard([50] * 6, attempts=3, wait_s=0.5)
    measure, calls = _counter([0.3, 0.2, 0.1])
    taken = guard.take(measure, seconds=lambda t: t)
    assert taken.result == 0.1 and taken.low
    assert [r["s"] for r in taken.retaken] == [0.3, 0.2]
    assert len(calls) == 3 and len(used) == 6  # a wait's one reading and the after, per take


def test_the_reading_after_a_sample_is_the_next_ones_before_until_reset():
    guard, used = _guard([200] * 5)
    measure, _ = _counter([0.1, 0.2, 0.3])
    guard.take(measure, seconds=lambda t: t)
    assert len(used) == 2  # before and after
    guard.take(measure, seconds=lambda t: t)
    assert len(used) == 3  # after only
    guard.reset()
    guard.take(measure, seconds=lambda t: t)
    assert len(used) == 5  # a probe of its own before it again


def test_attempts_below_one_are_refused():
    guard, _ = _guard([200], attempts=0)
    with pytest.raises(ValueError, match="attempts=0 must be >= 1"):
        guard.take(lambda: 0.1, seconds=lambda t: t)


def test_run_workload_takes_again_the_samples_a_low_reading_brackets(progress):
    spec = named_workloads(quick=True)["decode-f32-bs16"]
    shape = (spec.num_tokens, spec.num_heads * spec.head_size)
    calls = []
    state = dict(low=False)

    def peer(name, goes_low):
        def call():
            calls.append(name)
            # b's first timed call (its 2nd call after the 2 warm-ups) makes the next reading
            # low, as the machine would going short of a core during it.
            if goes_low and calls.count(name) == 4:
                state["low"] = True

        prepared = Prepared(call=call, output=lambda _: np.zeros(shape, np.float32))
        return Peer(name, lambda: None, lambda data: prepared)

    def probe():
        low, state["low"] = state["low"], False
        return 10.0 if low else 200.0

    guard = Guard(probe, least_gflop_s=100.0, sleep=lambda s: None, wait_s=0.0)
    copier = run.Copier(1 << 20, 1)
    try:
        result = run.run_workload(
            spec, [peer("a", False), peer("b", True)], copier, reps=3, budget_s=None,
            rng=np.random.default_rng(0), progress=progress, settle_s=0.0, guard=guard,
        )  # fmt: skip
    finally:
        copier.close()
    rows = result["backends"]
    assert len(rows["b"]["retaken"]) == 1 and rows["b"]["retaken"][0]["after"] == 10.0
    assert rows["a"]["retaken"] == [] and rows["a"]["low_kept"] == rows["b"]["low_kept"] == 0
    for name in "ab":
        assert len(rows[name]["times_s"]) == 3
    # b: 2 warm-ups, 3 rounds of a settling call and a timed one, and one more such pair.
    assert calls.count("b") == 2 + 2 * 3 + 2 and calls.count("a") == 2 + 2 * 3


def test_the_table_says_what_the_guard_did():
    record = dict(
        guard=dict(
            status="on",
            readings=40,
            low_readings=3,
            least_gflop_s=160.0,
            least_fraction=0.7,
            attempts=3,
        ),
        workloads=dict(
            w=dict(backends=dict(a=dict(retaken=[dict(s=0.2)], low_kept=1), b=dict(status="x")))
        ),
        floor_pairs=dict(w=dict(retaken=dict(kernel=[dict(s=0.1)], read=[]), low_kept={})),
    )
    line = report.guard_line(record)
    assert "40 FMA probe readings" in line and "3 below 160 GFLOP/s" in line
    assert "2 samples beside a low reading taken again" in line and "1 standing" in line
    assert report.guard_line(dict(guard=dict(status="off", note="--no-guard"))).startswith(
        "Machine guard off: --no-guard"
    )
    assert report.guard_line(dict()) is None  # a record from before the guard


def test_no_guard_is_a_flag():
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers())
    assert parser.parse_args(["bench", "--no-guard"]).no_guard is True
    assert parser.parse_args(["bench"]).no_guard is False


def test_the_fma_guard_reads_the_native_probe_or_says_why_not():
    from benchmarks.guard import LEAST_FRACTION, fma_guard

    guard, why = fma_guard(dict(status="unavailable", note="JAX is not installed"))
    assert guard is None and "JAX is not installed" in why
    from jax_attn import cpu

    if cpu.unavailable_reason() is not None:
        pytest.skip(f"the native FMA probe is not built here: {cpu.unavailable_reason()}")
    guard, why = fma_guard(dict(status="ok", gflop_s=50.0))
    assert why == "" and guard.least_gflop_s == LEAST_FRACTION * 50.0
    assert guard.reading() > 0 and guard.readings == 1


def test_a_machine_that_stays_short_is_not_waited_for():
    # Every reading low: once a full window of them is in, a take neither waits nor repeats.
    guard, used = _guard([50] * 1000, attempts=3, wait_s=1e9, window=4)
    measure, calls = _counter([0.1] * 100)
    for _ in range(3):
        guard.take(measure, seconds=lambda t: t)
    assert guard.stays_short()
    before = (len(used), len(calls))
    taken = guard.take(measure, seconds=lambda t: t)
    assert taken.low and taken.retaken == []
    assert (len(used), len(calls)) == (before[0] + 1, before[1] + 1)  # the after reading only
    # The readings recover: the window empties of low ones, and retakes come back.
    guard.probe = lambda: 200.0
    for _ in range(4):
        guard.reading()
    assert not guard.stays_short()

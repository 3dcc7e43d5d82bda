"""The bench's harness without timing anything that matters: workload names with their block
sizes, `--rounds`, `--check` on synthetic records, the per-machine record name."""

import argparse
import json

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("rich")

from benchmarks import command, report, run
from benchmarks.backends import Peer
from benchmarks.prepared import Prepared
from benchmarks.workloads import (
    BLOCK_SIZES,
    named_workloads,
    select,
    split_name,
)

# ---------------------------------------------------------------------------------------------
# Workload names


@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_every_workload_name_ends_with_its_block_size(quick):
    specs = named_workloads(quick)
    for name, spec in specs.items():
        base, block = split_name(name)
        assert block == spec.block_size and name == f"{base}-bs{block}", name
    bases = {split_name(n)[0] for n in specs}
    for base in bases:  # every workload at 16 and 128, the decodes at 32 too
        assert {f"{base}-bs{bs}" for bs in BLOCK_SIZES} <= set(specs), base
    assert {"decode-bf16-bs32", "decode-f32-bs32"} <= set(specs)
    assert {"mixed-bf16-bs128", "chunked-prefill-bf16-bs128", "decode-bf16-bs128"} <= set(specs)


def test_quick_keeps_every_name_and_shrinks_the_sizes():
    full, quick = named_workloads(False), named_workloads(True)
    assert list(full) == list(quick)
    for name in full:
        assert quick[name].num_tokens < full[name].num_tokens or quick[name].kv_bytes < (
            full[name].kv_bytes
        ), name
        assert quick[name].block_size == full[name].block_size


@pytest.mark.parametrize(
    "patterns, expected",
    [
        (["decode-bf16"], ["decode-bf16-bs16"]),  # a name from before: its block-16 workload
        (["decode-bf16-bs128"], ["decode-bf16-bs128"]),
        (["decode-bf16-*"], ["decode-bf16-bs16", "decode-bf16-bs32", "decode-bf16-bs128"]),
        (["mixed*-bs128"], ["mixed-bs128", "mixed-bf16-bs128"]),
    ],
    ids=["old-name", "exact", "family", "pattern"],
)
def test_select_by_name_pattern_or_old_name(patterns, expected):
    chosen, unknown = select(patterns, named_workloads(quick=True))
    assert list(chosen) == expected and unknown == []


def test_select_names_what_matches_nothing():
    chosen, unknown = select(["decode-bf16-bs64", "nope*"], named_workloads(quick=True))
    assert chosen == {} and unknown == ["decode-bf16-bs64", "nope*"]


# ---------------------------------------------------------------------------------------------
# Arguments


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def test_rounds_is_the_flag_and_reps_its_alias():
    assert _parse("--rounds", "7").reps == 7
    assert _parse("--reps", "3").reps == 3
    args = _parse()
    assert args.reps is None and args.check is None and args.json is None


def test_check_and_json_with_and_without_a_value():
    args = _parse("--check", "--json")
    assert args.check == command.CHECK_RUN and args.json == command.DEFAULT_JSON
    args = _parse("--check", "old.json", "--json", "out.json")
    assert args.check == "old.json" and args.json == "out.json"


def test_rounds_below_one_is_refused(capsys):
    args = argparse.Namespace(quick=True, workloads="decode-f32-bs16", reps=0, json=None)
    assert run.main(args) == 2
    assert "--rounds=0 must be >= 1" in capsys.readouterr().out


@pytest.mark.parametrize("flag", [["--check"], ["--json"]])
def test_cpu_only_flags_are_refused_with_other_suites(flag, capsys):
    assert command.run(_parse(*flag, "--mesh", "tp=2")) == 2
    assert "is for the CPU suite, not with --mesh" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# --rounds: every round kept


@pytest.mark.parametrize("rounds", [1, 6])
def test_every_round_is_kept_for_every_peer(rounds, progress):
    spec = named_workloads(quick=True)["decode-f32-bs16"]
    shape = (spec.num_tokens, spec.num_heads * spec.head_size)
    calls = []

    def peer(name):
        def call():
            calls.append(name)

        prepared = Prepared(call=call, output=lambda _: np.zeros(shape, np.float32))
        return Peer(name, lambda: None, lambda data: prepared)

    copier = run.Copier(1 << 20, 1)
    try:
        result = run.run_workload(
            spec, [peer("a"), peer("b"), peer("c")], copier, reps=rounds, budget_s=None,
            rng=np.random.default_rng(0), progress=progress, settle_s=0.0,
        )  # fmt: skip
    finally:
        copier.close()
    for name in "abc":
        row = result["backends"][name]
        assert row["reps"] == rounds and len(row["times_s"]) == rounds, row
        assert len(row["after_other_s"]) == rounds
        assert row["min_s"] <= row["median_s"] <= row["max_s"]
        # warm-up (2 calls), then per round one untimed and one timed call
        assert calls.count(name) == 2 + 2 * rounds
    # The order rotates by one each round (the copy and the read floors after the peers): the
    # first peer called in rounds 0, 1, 2 is a, b, c.
    per_round = [calls[6 + 6 * r : 12 + 6 * r] for r in range(rounds)]
    assert [chunk[0] for chunk in per_round[:3]] == ["a", "b", "c"][: min(rounds, 3)]
    assert all(sorted(chunk) == ["a", "a", "b", "b", "c", "c"] for chunk in per_round)


def test_the_spread_is_min_to_max_of_the_rounds():
    from benchmarks import report

    row = dict(median_s=0.002, iqr_s=0.0005, times_s=[0.0021, 0.0019, 0.0035, 0.002])
    assert report.spread_ms(row) == "1.9-3.5"
    assert report.spread_ms(dict(median_s=0.002, iqr_s=0.0005)) == "IQR 0.5"  # an old record


# ---------------------------------------------------------------------------------------------
# --check


def _row(median_s, **extra):
    return dict(status="ok", note="", median_s=median_s, **extra)


def _record(tmp_path, workloads, unavailable=None, quick=False, **fields):
    record = dict(
        **fields,
        date="2026-12-01T00:00:00+00:00",
        quick=quick,
        machine=dict(cpu="Test CPU", kind="intel-sapphire-rapids"),
        unavailable=unavailable or {},
        workloads={
            name: dict(spec=dict(block_size=int(name.rsplit("bs", 1)[1])), backends=rows)
            for name, rows in workloads.items()
        },
    )
    path = tmp_path / "record.json"
    path.write_text(json.dumps(record))
    return str(path)


def _check(path) -> int:
    return run.main(argparse.Namespace(check=path))


def test_check_names_each_missed_target_and_exits_1(tmp_path, capsys):
    path = _record(
        tmp_path,
        {
            # vLLM twice as fast as jax-cpu: issue 35 asks >= 1.0 on decode-bf16-bs128
            "decode-bf16-bs128": {
                run.VLLM: _row(0.005),
                run.CPU: _row(0.010, fraction_of_read=0.95),
            },
            # met: vLLM 2.5x slower on prefill-bf16-bs128 (>= 2.0)
            "prefill-bf16-bs128": {run.VLLM: _row(0.025), run.CPU: _row(0.010)},
        },
        unavailable={"IPEX": "not available: another env"},
    )
    assert _check(path) == 1
    out = capsys.readouterr().out
    assert "MISSED decode-bf16-bs128: vllm-cpu-attn time / jax-cpu time: 0.5 (goal >= 1.0)" in out
    assert "MISSED prefill-bf16-bs128" not in out
    assert "target prefill-bf16-bs128: vllm-cpu-attn time / jax-cpu time: 2.50" in out


def test_check_passes_when_every_measured_target_is_met(tmp_path, capsys):
    path = _record(
        tmp_path,
        {"decode-bf16-bs128": {run.VLLM: _row(0.020), run.CPU: _row(0.010, fraction_of_read=0.9)}},
        unavailable={"IPEX": "not available: another env"},
    )
    assert _check(path) == 0
    assert "none of" in capsys.readouterr().out


@pytest.mark.parametrize(
    "vllm_row, unavailable, fails",
    [
        (dict(status="error", note="RuntimeError: boom"), {}, True),  # expected here, broke
        (dict(status="skipped", note="skipped: vec16 takes no fp8 cache"), {}, False),
        (dict(status="unavailable", note="not available"), {run.VLLM: "not available"}, False),
    ],
    ids=["errored", "skipped", "other-env"],
)
def test_not_measured_fails_check_only_where_the_peer_was_expected(
    tmp_path, capsys, vllm_row, unavailable, fails
):
    path = _record(
        tmp_path,
        {"mixed-bf16-bs128": {run.VLLM: vllm_row, run.CPU: _row(0.010)}},
        unavailable={"IPEX": "not available: another env", **unavailable},
    )
    assert _check(path) == (1 if fails else 0)
    out = capsys.readouterr().out
    missed = "MISSED mixed-bf16-bs128: vllm-cpu-attn time / jax-cpu time: not measured"
    assert (missed in out) is fails, out


AMX_OK = dict(status="ok", gflop_s=6000.0, threads=2, one_thread_gflop_s=3000.0)
NO_AMX = dict(status="unavailable", note="not available: this CPU has no AMX-TILE / AMX-BF16")
AMX_TARGET = "prefill-bf16-bs128: jax-cpu fraction of the AMX peak"


@pytest.mark.parametrize(
    "amx_peak, fraction, fails, verdict",
    [
        (AMX_OK, 0.10, True, "not met"),  # the tiles ran, the prefill too slow
        (AMX_OK, 0.30, False, "met"),
        (NO_AMX, None, False, "not measured"),  # no tiles here: never expected
        (None, None, False, "not measured"),  # a record from before the AMX peak
        (dict(status="error", note="RuntimeError: boom"), None, True, "expected here"),
    ],
    ids=["missed", "met", "no-amx", "old-record", "probe-failed"],
)
def test_amx_peak_target_is_judged_only_where_the_tiles_run(
    tmp_path, capsys, amx_peak, fraction, fails, verdict
):
    extra = {} if fraction is None else dict(fraction_of_amx_peak=fraction)
    fields = {} if amx_peak is None else dict(amx_peak=amx_peak)
    path = _record(
        tmp_path,
        {"prefill-bf16-bs128": {run.CPU: _row(0.010, **extra)}},
        unavailable={"IPEX": "another env", run.VLLM: "another env"},
        **fields,
    )
    assert _check(path) == (1 if fails else 0)
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith(f"target {AMX_TARGET}:"))
    assert "(goal >= 0.25)" in line and verdict in line, line
    assert (f"MISSED {AMX_TARGET}" in out) is fails, out
    if amx_peak is NO_AMX:
        assert "this CPU has no AMX-TILE" in line  # the reason it was not judged


def test_amx_fractions_only_on_bf16_prefill_rows():
    def result(dtype, query_lens):
        spec = dict(dtype=dtype, num_prefills=sum(q > 1 for q in query_lens))
        rows = {run.CPU: _row(0.01, gflop_s=1500.0), "IPEX": dict(status="unavailable")}
        return dict(spec=spec, backends=rows)

    bf16_prefill, f32_prefill = result("bfloat16", [512, 1]), result("float32", [512])
    bf16_decode = result("bfloat16", [1, 1])
    for r in (bf16_prefill, f32_prefill, bf16_decode):
        run.add_amx_fractions(r, AMX_OK)
    assert bf16_prefill["backends"][run.CPU]["fraction_of_amx_peak"] == 0.25
    assert "fraction_of_amx_peak" not in bf16_prefill["backends"]["IPEX"]
    assert "fraction_of_amx_peak" not in f32_prefill["backends"][run.CPU]
    assert "fraction_of_amx_peak" not in bf16_decode["backends"][run.CPU]
    run.add_amx_fractions(bf16_prefill, NO_AMX)
    assert bf16_prefill["backends"][run.CPU]["fraction_of_amx_peak"] is None


def test_the_amx_peak_shows_beside_the_fma_peak():
    fma = dict(status="ok", method="m", gflop_s=200.0, threads=2, one_thread_gflop_s=100.0,
               all_threads_gflop_s=190.0)  # fmt: skip
    workloads = {
        "prefill-bf16-bs128": dict(
            spec=dict(num_prefills=8),
            backends={
                run.CPU: _row(
                    0.01, gflop_s=1500.0, fraction_of_fma_peak=7.5, fraction_of_amx_peak=0.25
                )
            },
        )
    }
    amx = dict(AMX_OK, method="TDPBF16PS loop", all_threads_gflop_s=5900.0)
    lines = report.compute_lines(dict(fma_peak=fma, amx_peak=amx, workloads=workloads))
    assert lines[0].startswith("FMA peak (same run")
    assert lines[1] == (
        "AMX peak (same run, TDPBF16PS loop): 6000 GFLOP/s bf16 = 2 x one thread's 3000 "
        "(5900 measured on 2 threads together)."
    )
    assert (
        lines[2]
        == "prefill-bf16-bs128, GFLOP/s (of the FMA peak): jax-cpu 1500 (750%, 25% of AMX)."
    )
    lines = report.compute_lines(dict(fma_peak=fma, amx_peak=NO_AMX, workloads={}))
    assert lines[1] == "AMX peak: not available: this CPU has no AMX-TILE / AMX-BF16."


def _peak(one: float, together: float, workers: int = 2) -> dict:
    return dict(status="ok", method="m", gflop_s=workers * one, threads=workers,
                one_thread_gflop_s=one, all_threads_gflop_s=together)  # fmt: skip


def _cores_free(targets: list[dict]) -> dict:
    (target,) = [t for t in targets if t["target"].startswith("machine:")]
    return target


def test_a_record_made_while_the_cores_were_not_all_free_misses_a_target():
    rng = np.random.default_rng()
    one = float(rng.uniform(50.0, 300.0))
    free, taken = float(rng.uniform(0.86, 1.05)), float(rng.uniform(0.3, 0.84))
    # Free before and after: met, the lower fraction judged.
    target = run.cores_free_target(_peak(one, 2 * one * free), _peak(one, 2 * one * 1.05))
    assert target["met"] is True and target["value"] == pytest.approx(min(free, 1.05))
    assert "before and after the workloads" in target["target"]
    # Taken before, or after only: missed.
    for before, after in ((taken, free), (free, taken)):
        target = run.cores_free_target(_peak(one, 2 * one * before), _peak(one, 2 * one * after))
        assert target["met"] is False and target["value"] == pytest.approx(taken)
    # A record from before the second probe is judged on the first.
    target = run.cores_free_target(_peak(one, 2 * one * taken), None)
    assert target["met"] is False and "before the workloads" in target["target"]
    assert "after" not in target["target"]
    # No probe (no native kernels): not measured, and never expected.
    unavailable = dict(status="unavailable", note="native CPU kernels: not built")
    target = run.cores_free_target(unavailable, unavailable)
    assert target["met"] is None and target["not_here"]
    (judged,) = run.judge_targets([target], {}, {})
    assert judged["verdict"] == "not measured"
    # A second probe that did not run is not named as judged.
    target = run.cores_free_target(_peak(one, 2 * one * free), unavailable)
    assert target["met"] is True and "after" not in target["target"]
    # The same target in check_targets, on a record with the first probe only.
    targets = run.check_targets({}, fma_peak=_peak(one, one * 1.0), fma_peak_after=None)
    assert _cores_free(targets)["met"] is False  # together = one worker's: half the cores


def test_check_names_a_record_made_on_taken_cores(tmp_path, capsys):
    path = _record(tmp_path, {}, fma_peak=_peak(110.0, 200.0), fma_peak_after=_peak(110.0, 116.0))
    assert _check(path) == 1
    out = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert "MISSED machine: FMA probe on every worker together" in out
    assert "0.527 (goal >= 0.85)" in out


def test_the_second_fma_probe_shows_beside_the_first():
    lines = report.compute_lines(
        dict(fma_peak=_peak(100.0, 195.0), fma_peak_after=_peak(98.0, 120.0), workloads={})
    )
    assert lines[1] == (
        "FMA peak again after the workloads: 196 GFLOP/s float32 = 2 x one thread's 98 "
        "(120 measured on 2 threads together)."
    )


def test_check_reads_old_names_as_block_16(tmp_path, capsys):
    """Records from before the block size was in the names (every workload at block 16)."""
    path = _record(tmp_path, {"decode-f32-bs16": {}})
    record = json.loads(open(path).read())
    record["workloads"] = {
        "decode-f32": dict(
            spec=dict(block_size=16),
            backends={run.VLLM: _row(0.010), run.CPU: _row(0.010), "TORCH_SDPA": _row(0.011)},
        )
    }
    record["unavailable"] = {"IPEX": "x", run.VLLM085: "x"}
    with open(path, "w") as f:
        json.dump(record, f)
    assert _check(path) == 1  # issue 21 asks vLLM time / jax-cpu time >= 1.6 at block 16
    out = capsys.readouterr().out
    assert "MISSED decode-f32-bs16: vllm-cpu-attn time / jax-cpu time: 1 (goal >= 1.6)" in out


def test_check_refuses_a_quick_record_and_a_file_that_is_not_one(tmp_path, capsys):
    assert _check(_record(tmp_path, {}, quick=True)) == 2
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert _check(str(bad)) == 2
    out = capsys.readouterr().out
    assert "a --quick record" in out and "not a bench record" in out


def test_bf16_twins_are_judged_side_by_side_where_the_record_has_them():
    """The workloads' own medians say bf16 is slower (0.9); the side-by-side rounds say 1.08:
    the target takes the side-by-side ratio and keeps the other beside it; without them, the
    medians' ratio."""
    rows = {
        "prefill-8x512-bs128": {"backends": {run.CPU: _row(0.018)}},
        "prefill-bf16-bs128": {"backends": {run.CPU: _row(0.020)}},
    }
    name = "prefill-8x512-bs128 / prefill-bf16-bs128: jax-cpu time"

    def judged(twins):
        return next(t for t in run.check_targets(rows, twins=twins) if t["target"] == name)

    alone = judged(None)
    assert alone["value"] == pytest.approx(0.9) and alone["met"] is False
    assert "side_by_side" not in alone
    twins = {"prefill-8x512-bs128 / prefill-bf16-bs128": dict(status="ok", ratio=1.08)}
    paired = judged(twins)
    assert paired["value"] == 1.08 and paired["met"] is True and paired["side_by_side"]
    assert paired["separate_rounds"] == pytest.approx(0.9)
    failed = {"prefill-8x512-bs128 / prefill-bf16-bs128": dict(status="error", note="boom")}
    assert judged(failed)["value"] == pytest.approx(0.9)


def test_read_floor_fractions_are_judged_beside_the_floor_where_the_record_has_them():
    """The workload's own medians give 0.8 of the floor; the rounds beside the floor give 0.93:
    the target takes the side-by-side fraction and keeps the other beside it; without them (or
    where that run failed), the medians' fraction."""
    rows = {"decode-bf16-bs128": {"backends": {run.CPU: dict(_row(0.004), fraction_of_read=0.8)}}}
    name = "decode-bf16-bs128: jax-cpu fraction of the read floor"

    def judged(pairs):
        return next(t for t in run.check_targets(rows, floor_pairs=pairs) if t["target"] == name)

    alone = judged(None)
    assert alone["value"] == pytest.approx(0.8) and alone["met"] is False
    assert "side_by_side" not in alone
    paired = judged({"decode-bf16-bs128": dict(status="ok", fraction=0.93)})
    assert paired["value"] == 0.93 and paired["met"] is True and paired["side_by_side"]
    assert paired["separate_rounds"] == pytest.approx(0.8)
    assert judged({"decode-bf16-bs128": dict(status="ok", fraction=0.85)})["met"] is False
    failed = judged({"decode-bf16-bs128": dict(status="error", note="boom")})
    assert failed["value"] == pytest.approx(0.8) and failed["met"] is False


def test_floor_decodes_are_the_read_floor_targets():
    """Every read-floor fraction target of check_targets has its workload in floor_decodes."""
    targets = [t for t in run.check_targets({}) if "fraction of the read floor" in t["target"]]
    names = {w for t in targets for w in _workloads(t)}
    assert targets and set(run.floor_decodes(names)) == names


def test_twin_pairs_are_the_bf16_time_targets():
    """Every float32 / bfloat16 time target of check_targets has its pair in twin_pairs."""
    names = [t["target"] for t in run.check_targets({})]
    pairs = run.twin_pairs({w for t in run.check_targets({}) for w in _workloads(t)})
    for a, b in pairs:
        assert f"{a} / {b}: {run.CPU} time" in names
    twin_targets = [n for n in names if " / " in n.split(":")[0] and "bf16" in n]
    assert len(twin_targets) == len(pairs)


def _workloads(target: dict) -> list[str]:
    return [need.rsplit("/", 1)[0] for need in target["needs"]]


def test_every_target_names_the_rows_it_needs():
    for target in run.check_targets({}):
        if target["target"].startswith("machine:"):  # judged on the probes, not on rows
            assert target["met"] is None and not target["needs"] and target["not_here"], target
            continue
        assert target["met"] is None and target["needs"], target
        for need in target["needs"]:
            workload, peer = need.rsplit("/", 1)
            assert split_name(workload)[1] is not None and peer, need
    names = [t["target"] for t in run.check_targets({})]
    assert len(names) == len(set(names))
    assert all(f"{w}: {run.VLLM} time / {run.CPU} time" in names for w, _ in run.VLLM_TARGETS)
    assert all(w.endswith("-bs128") for w, _ in run.VLLM_TARGETS)


# ---------------------------------------------------------------------------------------------
# One record per machine kind

SAPPHIRE = """processor	: 0
vendor_id	: GenuineIntel
cpu family	: 6
model		: 167
model name	: Intel(R) Xeon(R) Processor
flags		: fpu avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8

processor	: 1
vendor_id	: GenuineIntel
"""


@pytest.mark.parametrize(
    "vendor, family, name, flags, kind",
    [
        ("GenuineIntel", 6, "Intel(R) Xeon(R) Processor", "avx2 avx512f amx_bf16 amx_tile",
         "intel-sapphire-rapids"),
        ("GenuineIntel", 6, "Intel(R) Xeon(R) 6980P", "avx512f amx_tile amx_fp16",
         "intel-granite-rapids"),
        ("GenuineIntel", 6, "Intel(R) Core(TM) i7", "avx2 fma", "intel-avx2"),
        ("AuthenticAMD", 25, "AMD EPYC", "avx2 avx512f avx512_bf16", "amd-zen4"),
        ("AuthenticAMD", 25, "AMD EPYC 7763 64-Core Processor", "avx2", "amd-zen3"),
        ("AuthenticAMD", 26, "AMD EPYC", "avx2 avx512f avx512_bf16", "amd-zen5"),
        ("AuthenticAMD", 23, "AMD EPYC 7B12", "avx2", "amd-zen2"),
    ],
    ids=["spr", "gnr", "core", "zen4", "zen3", "zen5", "zen2"],
)  # fmt: skip
def test_cpu_kind_from_vendor_family_and_flags(vendor, family, name, flags, kind):
    text = (
        f"vendor_id\t: {vendor}\ncpu family\t: {family}\nmodel name\t: {name}\nflags\t: {flags}\n"
    )
    assert run.cpu_kind(run.cpuinfo_fields(text)) == kind


def test_cpuinfo_fields_reads_the_first_processor():
    fields = run.cpuinfo_fields(SAPPHIRE)
    assert fields["model"] == "167" and "amx_tile" in fields["flags"].split()
    assert run.cpu_kind(fields) == "intel-sapphire-rapids"
    assert run.cpu_kind({}, machine="aarch64") == "aarch64"


def test_default_record_path_is_per_environment_and_kind(tmp_path):
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    path = run.default_record_path("amd-zen4", env="vllm", root=str(tmp_path))
    assert path == str(tmp_path / "benchmarks" / "results" / "cpu-vllm-env-amd-zen4.json")
    elsewhere = run.default_record_path("amd-zen4", env="main", root=str(tmp_path / "x"))
    assert elsewhere.endswith("/x/cpu-main-env-amd-zen4.json")
    args = argparse.Namespace(json=command.DEFAULT_JSON)
    path = run.record_path(args, dict(kind="intel-sapphire-rapids"))
    assert path.endswith(f"cpu-{run.environment_name()}-env-intel-sapphire-rapids.json")
    assert run.record_path(argparse.Namespace(json="x.json"), {}) == "x.json"


def test_machine_info_names_this_machines_kind():
    with open("/proc/cpuinfo") as f:
        kind = run.cpu_kind(run.cpuinfo_fields(f.read()))
    info = run.machine_info()
    assert info["kind"] == kind and info["environment"] == run.environment_name()


def test_jax_cpu_rows_name_the_kernel_path_they_ran(monkeypatch):
    """The record says which code the native kernels ran per workload: the decode kernel's
    path (AMX tiles only for groups that fill them) as `jax_attn.cpu.decode_path` decides it,
    and the ragged kernel's bf16 products."""
    cpu = pytest.importorskip("jax_attn.cpu")
    if not cpu.available():
        pytest.skip(f"native CPU kernels: {cpu.unavailable_reason()}")
    from benchmarks.backends import cpu_path

    monkeypatch.delenv("JAX_ATTN_CPU_DECODE_AMX", raising=False)
    specs = named_workloads(False)
    tiles = "amx" if "amx-bf16" in (cpu.isa() or "") else "vector"  # where the tiles run
    for name, group in (("decode-bf16-bs128", 4), ("decode-fp8-bs128", 4)):
        spec = specs[name]
        assert spec.num_heads // spec.num_kv_heads == group
        path = cpu.decode_path(spec.cache_dtype or spec.dtype, spec.dtype, 128, group)
        assert cpu_path(spec) == f"decode on {path} (group {group})"
    assert cpu_path(specs["decode-fp8-bs128"]) == f"decode on {tiles} (group 4)"
    assert cpu_path(specs["decode-bf16-bs128"]) == "decode on vector (group 4)"
    assert cpu_path(specs["decode-f32-bs16"]) == "decode on vector (group 4)"
    assert cpu_path(specs["prefill-bf16-bs128"]) == f"prefill on {tiles}"
    assert cpu_path(specs["prefill-8x512-bs128"]) == "prefill on vector"
    assert cpu_path(specs["mixed-bf16-bs128"]) == f"prefill on {tiles}, decode on vector (group 4)"
    monkeypatch.setenv("JAX_ATTN_CPU_DECODE_AMX", "1")
    assert cpu_path(specs["decode-bf16-bs128"]) == f"decode on {tiles} (group 4)"

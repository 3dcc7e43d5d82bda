"""A bench record (the JSON of `jax-attn bench --json`) as Markdown, for the README and NOTES:
`python -m benchmarks.report benchmarks/results/cpu-ipex-env.json`.
"""

import json
import sys


def _cell(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def spread_ms(row: dict) -> str:
    """A timed row's spread over its rounds, "min-max" in ms (the IQR for a record without
    every time, as the floors of records before the spread was kept)."""
    times = row.get("times_s")
    low, high = (min(times), max(times)) if times else (row.get("min_s"), row.get("max_s"))
    if low is None or high is None:
        return f"IQR {row['iqr_s'] * 1e3:.1f}"
    return f"{low * 1e3:.1f}-{high * 1e3:.1f}"


def read_floors(result: dict) -> list[tuple[str, dict, str]]:
    """A workload's read floors as (label, floor record, what it is): the native streaming read
    that "of read" is against, then XLA's jitted sum over the same cache beside it. A record
    from before the native read (or from a machine without the native kernels) has the jitted
    sum alone."""
    read, read_xla = result.get("read"), result.get("read_xla")
    if not read:
        return []
    mb = f"{read['bytes'] / 1e6:.3g} MB"
    if read.get("kind") != "native":
        return [("read (jitted sum)", read, f"jitted sum of the K/V, {mb}")]
    floors = [("read (native)", read, f"native streaming read of the K/V, {mb}")]
    if read_xla:
        floors.append(("read (jitted sum)", read_xla, f"XLA's jitted sum of the same K/V, {mb}"))
    return floors


def _peak_line(label: str, peak: dict, dtype: str) -> str:
    """A peak probe's record (`benchmarks.run._peak_record`) as one line."""
    return (
        f"{label}: {peak['gflop_s']:.0f} GFLOP/s {dtype} = "
        f"{peak['threads']} x one thread's {peak['one_thread_gflop_s']:.0f} "
        f"({peak['all_threads_gflop_s']:.0f} measured on {peak['threads']} threads together)."
    )


def guard_line(record: dict) -> str | None:
    """What the machine guard (benchmarks/guard.py) did in the run, as one line; None for a
    record from before it."""
    guard = record.get("guard")
    if not guard:
        return None
    if guard.get("status") != "on":
        return f"Machine guard off: {guard.get('note', '')}; every sample stands as it came."
    samples = [
        row for result in record.get("workloads", {}).values()
        for row in result["backends"].values() if "retaken" in row
    ]  # fmt: skip
    side = [
        pair for group in ("twins", "floor_pairs") for pair in record.get(group, {}).values()
        if "retaken" in pair
    ]  # fmt: skip
    retaken = sum(len(row["retaken"]) for row in samples)
    retaken += sum(len(v) for pair in side for v in pair["retaken"].values())
    low_kept = sum(row["low_kept"] for row in samples)
    low_kept += sum(sum(pair["low_kept"].values()) for pair in side)
    return (
        f"Machine guard: {guard['readings']} FMA probe readings around the samples, "
        f"{guard['low_readings']} below {guard['least_gflop_s']:.0f} GFLOP/s "
        f"({guard['least_fraction']:.0%} of the FMA peak: the machine short of its cores); "
        f"{retaken} samples beside a low reading taken again (kept in the record as `retaken`), "
        f"{low_kept} standing with one after {guard['attempts']} takes."
    )


def compute_lines(record: dict) -> list[str]:
    """The FMA peak measured in the run (and the AMX peak, or why it was not), and the GFLOP/s
    of each peer on every workload with prefill tokens (the compute-bound steps) as a fraction
    of it (and of the AMX peak on the bf16 ones)."""
    peak = record.get("fma_peak")
    if not peak:
        return []
    if peak["status"] != "ok":
        return [f"FMA peak: not measured ({peak['note']})."]
    lines = [_peak_line(f"FMA peak (same run, {peak['method']})", peak, "float32")]
    after = record.get("fma_peak_after")
    if after and after["status"] == "ok":
        lines.append(_peak_line("FMA peak again after the workloads", after, "float32"))
    amx = record.get("amx_peak")
    if amx and amx["status"] == "ok":
        lines.append(_peak_line(f"AMX peak (same run, {amx['method']})", amx, "bf16"))
    elif amx:
        lines.append(f"AMX peak: {amx['note']}.")
    for name, result in record["workloads"].items():
        if not result["spec"].get("num_prefills"):
            continue
        cells = [
            f"{peer} {row['gflop_s']:.0f} ({row['fraction_of_fma_peak']:.0%}"
            + (
                f", {row['fraction_of_amx_peak']:.0%} of AMX)"
                if row.get("fraction_of_amx_peak") is not None
                else ")"
            )
            for peer, row in result["backends"].items()
            if row["status"] == "ok" and row.get("fraction_of_fma_peak") is not None
        ]
        lines.append(f"{name}, GFLOP/s (of the FMA peak): " + ", ".join(cells) + ".")
    return lines


def met_cell(target: dict) -> str:
    """A target's verdict for the table, with why a miss is out of reach on this machine."""
    met = {True: "yes", False: "**no**", None: "not measured"}[target["met"]]
    if target.get("verdict") == "not measured, expected here":
        met = "**not measured, expected here**"
    if target["met"] is False and "out_of_reach" in target:
        met += f" ({target['out_of_reach']})"
    return met


def markdown(record: dict) -> str:
    machine, copy = record["machine"], record["copy"]
    versions = ", ".join(f"{k} {v}" for k, v in machine["versions"].items() if v)
    kind = f"{machine['kind']}: " if machine.get("kind") else ""
    lines = [
        f"Run {record['date']}, {kind}{machine['cpu']} ({machine['cores_usable']} cores, "
        f"{'/'.join(machine['simd'])}), torch threads {machine.get('torch_threads')}; {versions}.",
        f"Copy floor: {copy['gb_s']:.1f} GB/s ({copy['method']}, "
        f"{copy['bytes'] / 2**20:.0f} MiB read + written). Medians over the rounds, the spread "
        "min-max.",
        "",
        "| workload | peer | median ms | min-max ms | GB/s | of copy | of read | x jax "
        "| max err vs jax | note |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for name, result in record["workloads"].items():
        rounds = max((r.get("reps", 0) for r in result["backends"].values()), default=0)
        label = (
            f"**{name}** {result['spec']['description']}, {result['bytes'] / 1e6:.3g} MB, "
            f"{rounds} rounds"
        )
        first = True
        for peer, row in result["backends"].items():
            if row["status"] == "unavailable":
                continue
            if row["status"] == "ok":
                note = f"compile {row['compile_s']:.2f} s" if "compile_s" in row else row["note"]
                if row.get("agrees") is False:
                    note = "WRONG OUTPUT " + note
                cells = [
                    f"{row['median_s'] * 1e3:.1f}",
                    spread_ms(row),
                    f"{row['gb_s']:.2f}",
                    f"{row['fraction_of_copy']:.0%}",
                    _cell(row.get("fraction_of_read"), ".0%"),
                    _cell(row["ratio_vs_jax"], ".2f"),
                    _cell(row.get("max_abs_err_vs_jax"), ".1e"),
                    note,
                ]
            else:
                cells = ["", "", "", "", "", "", "", row["note"]]
            lines.append("| " + " | ".join([label if first else "", peer, *cells]) + " |")
            first = False
        c, r = result["copy"], result.get("read")
        of_read = f"{c['gb_s'] / r['gb_s']:.0%}" if r else ""
        lines.append(
            f"| | copy | {c['median_s'] * 1e3:.1f} | {spread_ms(c)} | "
            f"{c['gb_s']:.2f} | 100% | {of_read} | | | |"
        )
        for label, f, _ in read_floors(result):
            lines.append(
                f"| | {label} | {f['median_s'] * 1e3:.1f} | {spread_ms(f)} | "
                f"{f['gb_s']:.2f} | {f['gb_s'] / c['gb_s']:.0%} | {f['gb_s'] / r['gb_s']:.0%} "
                "| | | |"
            )
    compute = compute_lines(record)
    if compute:
        lines += ["", *compute]
    if guard := guard_line(record):
        lines += ["", guard]
    unavailable = record.get("unavailable", {})
    if unavailable:
        lines.append("")
        lines += [f"Not run: {peer}: {reason}." for peer, reason in unavailable.items()]
    if record.get("targets"):
        lines += ["", "| target | goal | measured | met |", "|---|---|--:|---|"]
        for t in record["targets"]:
            lines.append(
                f"| {t['target']} | {t['goal']} | {_cell(t['value'], '.2f')} | {met_cell(t)} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        sys.stdout.write(markdown(json.load(f)))

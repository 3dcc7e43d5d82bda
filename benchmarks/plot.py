"""`jax-attn bench --plot RECORD`: a recorded run (the JSON of `jax-attn bench --json`) as a chart.

One row of panels per workload, every peer that ran side by side in both:
- time: median per call (log scale: peers differ by 100x), the bar's whisker from the 25th to
  the 75th percentile of its timed calls, and the read floor's time as a line (no step that
  reads its cache can be faster);
- fraction of the floor the step is bound by: the read floor for steps that only decode
  (memory-bound: "of read", against the native streaming read where the record has one), the
  FMA peak for steps with prefill tokens (compute-bound), the copy floor where the record has
  neither (a GPU record, or one from before either floor).

A peer that was skipped or failed shows its status in place of a bar; one whose output
disagreed with the JAX xla path is drawn hatched and marked WRONG. matplotlib is imported when
the command runs (it is in the `notebooks` extra); the figure is built without pyplot, so
nothing depends on the interactive backend.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

# Each peer keeps its color from chart to chart (matplotlib's C0..C9 in this order).
PEER_ORDER = ("jax-cpu", "jax-xla", "jax-reference", "TORCH_SDPA", "IPEX", "vllm085-TORCH_SDPA",
              "vllm-cpu-attn", "XFORMERS")  # fmt: skip
# The fields a timed row needs to be drawn; a record without them is not a bench record.
ROW_FIELDS = ("median_s", "iqr_s")


def load_record(path: str | Path) -> dict:
    """The record at `path`, checked for what the chart reads; `ValueError` saying what is
    wrong with the file otherwise."""
    path = Path(path)
    what = "a bench record (the JSON of `jax-attn bench --json`)"
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not {what}: not JSON ({e})") from None
    if not isinstance(record, dict) or not isinstance(record.get("workloads"), dict):
        raise ValueError(f"{path} is not {what}: it has no 'workloads' mapping")
    if not record["workloads"]:
        raise ValueError(f"{path} has no workloads to draw")
    for name, result in record["workloads"].items():
        backends = result.get("backends") if isinstance(result, dict) else None
        if not isinstance(backends, dict):
            raise ValueError(f"{path}: workload {name!r} has no 'backends' mapping")
        for peer, row in backends.items():
            if not isinstance(row, dict) or "status" not in row:
                raise ValueError(f"{path}: {name}/{peer} has no 'status'")
            missing = [f for f in ROW_FIELDS if f not in row]
            if row["status"] == "ok" and missing:
                raise ValueError(f"{path}: {name}/{peer} is timed but lacks {missing}")
    return record


def _bound(result: dict, ok: dict[str, dict]) -> tuple[str, str, dict | None]:
    """(row field, axis label, floor record or None) of the floor this workload is set
    against (see the module docstring)."""
    if result.get("spec", {}).get("num_prefills") and any(
        row.get("fraction_of_fma_peak") is not None for row in ok.values()
    ):
        return "fraction_of_fma_peak", "of the FMA peak (GFLOP/s)", None
    read = result.get("read")
    if read and any(row.get("fraction_of_read") is not None for row in ok.values()):
        how = "native read" if read.get("kind") == "native" else "jitted sum"
        return "fraction_of_read", f"of the read floor ({how}, GB/s)", read
    return "fraction_of_copy", "of the copy floor (GB/s)", None


def _whiskers(row: dict) -> tuple[float, float]:
    """(below, above) the median, in ms: to the 25th and 75th percentiles of the timed calls
    (half the IQR each way where the record has no raw times)."""
    median = row["median_s"] * 1e3
    if row.get("times_s"):
        q25, q75 = np.percentile(np.asarray(row["times_s"]) * 1e3, [25, 75])
        return max(median - q25, 0.0), max(q75 - median, 0.0)
    return row["iqr_s"] * 1e3 / 2, row["iqr_s"] * 1e3 / 2


def _ms(ms: float) -> str:
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.3g} ms"


def figure(record: dict):
    """The chart of a record (see the module docstring), as a matplotlib `Figure`."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    workloads = record["workloads"]
    shown = {
        name: [(p, row) for p, row in result["backends"].items() if row["status"] != "unavailable"]
        for name, result in workloads.items()
    }
    others = sorted({p for rows in shown.values() for p, _ in rows} - set(PEER_ORDER))
    colors = {p: f"C{i % 10}" for i, p in enumerate([*PEER_ORDER, *others])}
    heights = [0.45 * max(len(rows), 1) + 0.9 for rows in shown.values()]
    fig = Figure(figsize=(12, sum(heights) + 0.8), layout="constrained")
    axes = fig.subplots(len(workloads), 2, squeeze=False, gridspec_kw=dict(height_ratios=heights))
    machine = record.get("machine", {})
    where = machine.get("cpu") or record.get("device", {}).get("jax_device", "")
    cores = f", {machine['cores_usable']} cores" if machine.get("cores_usable") else ""
    quick = ", --quick sizes: times mean nothing" if record.get("quick") else ""
    fig.suptitle(f"jax-attn bench, {record.get('date', '')}: {where}{cores}{quick}")

    for (name, result), (ax_time, ax_frac) in zip(workloads.items(), axes, strict=True):
        rows = shown[name]
        ok = {p: row for p, row in rows if row["status"] == "ok"}
        field, label, floor = _bound(result, ok)
        y = np.arange(len(rows))[::-1]  # the record's order, top to bottom
        description = result.get("spec", {}).get("description", "")
        ax_time.set_title(f"{name}: {description}", loc="left", fontsize=10)
        for yi, (peer, row) in zip(y, rows, strict=True):
            if row["status"] != "ok":
                ax_time.text(0.01, yi, row["status"], transform=ax_time.get_yaxis_transform(),
                             va="center", color="0.4", fontsize=8)  # fmt: skip
                continue
            wrong = row.get("agrees") is False
            style = dict(color=colors[peer], hatch="//" if wrong else None, edgecolor="red" if
                         wrong else colors[peer])  # fmt: skip
            ms = row["median_s"] * 1e3
            below, above = _whiskers(row)
            ax_time.barh(yi, ms, xerr=[[below], [above]], capsize=2, **style)
            ax_time.text(ms + above, yi, f" {_ms(ms)}" + (" WRONG" if wrong else ""),
                         va="center", fontsize=8, color="red" if wrong else "black")  # fmt: skip
            fraction = row.get(field)
            if fraction is not None:
                ax_frac.barh(yi, fraction * 100, **style)
                ax_frac.text(fraction * 100, yi, f" {fraction:.0%}", va="center", fontsize=8)
        # The floors' times as lines, named in the axis label (a legend would hide bars).
        floors = [("dashed: read floor", result.get("read"), "k", "--")]
        if result.get("read_xla") and result.get("read_xla") != result.get("read"):
            floors.append(("dotted: XLA's jitted sum", result["read_xla"], "0.4", ":"))
        lines = []
        for what, f, color, line in floors:
            if f:
                ax_time.axvline(f["median_s"] * 1e3, color=color, ls=line, lw=1.2)
                lines.append(f"{what} {_ms(f['median_s'] * 1e3)}")
        ax_time.set_xscale("log")
        # Decades only: on an axis spanning less than two decades matplotlib labels the minor
        # ticks too, and their labels overlap.
        ax_time.xaxis.set_minor_formatter(NullFormatter())
        right = max([row["median_s"] * 1e3 for row in ok.values()], default=1.0)
        ax_time.set_xlim(right=right * 4)  # room for the labels
        ax_time.set_xlabel("; ".join(["median ms per call (log)", *lines]), fontsize=8)
        ax_frac.axvline(100, color="k", ls="--", lw=1)
        ax_frac.set_xlabel(f"% {label}", fontsize=8)
        top = max([100.0] + [row.get(field) * 100 for row in ok.values() if row.get(field)])
        ax_frac.set_xlim(0, top * 1.25)
        if floor is not None:
            ax_frac.set_title(f"floor {floor['gb_s']:.3g} GB/s", loc="right", fontsize=8)
        for ax in (ax_time, ax_frac):
            ax.set_yticks(y, [p for p, _ in rows], fontsize=8)
            ax.set_ylim(-0.6, len(rows) - 0.4)
            ax.tick_params(axis="x", labelsize=8)
            ax.grid(axis="x", alpha=0.3)
        ax_frac.tick_params(axis="y", labelleft=False)
    return fig


def plot(record_path: str | Path, out: str | Path | None = None) -> Path:
    """Draw the record at `record_path` into a PNG at `out` (default: beside the record, the
    same name with .png); returns its path. `ValueError` for a file that is not a record."""
    record = load_record(record_path)
    out = Path(out) if out else Path(record_path).with_suffix(".png")
    figure(record).savefig(out, dpi=90)
    return out


def main(args: argparse.Namespace) -> int:
    """`jax-attn bench --plot RECORD [--out PNG]`: 0 once written, 2 (with the reason on
    stderr) for a file that is not a bench record or without matplotlib."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("--plot needs matplotlib: pip install 'jax-attn[notebooks]'", file=sys.stderr)
        return 2
    try:
        out = plot(args.plot, getattr(args, "out", None))
    except ValueError as e:
        print(f"jax-attn bench --plot: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0

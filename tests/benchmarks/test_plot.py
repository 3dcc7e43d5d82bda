"""`jax-attn bench --plot RECORD`: a recorded run drawn as a PNG (benchmarks/plot.py).

A small hand-made record (a decode step set against the read floor, a prefill against the FMA
peak, a skipped and a wrong peer) and every committed record are drawn through the command's
own entry; a file that is not a record is refused with exit code 2 and a message that says why.
"""

import argparse
import json
from pathlib import Path

import pytest

matplotlib = pytest.importorskip("matplotlib")

from benchmarks import command, plot  # noqa: E402

RESULTS = sorted((Path(__file__).resolve().parents[2] / "benchmarks" / "results").glob("*.json"))


def _row(median_s: float, **extra) -> dict:
    times = [median_s * f for f in (0.9, 1.0, 1.3)]
    return dict(status="ok", note="", median_s=median_s, iqr_s=0.2 * median_s, times_s=times,
                agrees=True, **extra)  # fmt: skip


def _floor(median_s: float, kind: str) -> dict:
    return dict(median_s=median_s, iqr_s=0.0, reps=3, bytes=10**7, gb_s=0.01 / median_s,
                kind=kind, method=kind)  # fmt: skip


SMALL = dict(
    date="2026-11-25T00:00:00+00:00",
    quick=True,
    machine=dict(cpu="test CPU", cores_usable=2),
    workloads={
        "decode-f32": dict(
            spec=dict(description="2 decode @ ctx 64", num_prefills=0),
            read=_floor(0.001, "native"),
            read_xla=_floor(0.0015, "xla"),
            backends={
                "jax-xla": _row(0.004, fraction_of_read=0.25, fraction_of_fma_peak=0.01),
                "jax-cpu": _row(0.0012, fraction_of_read=0.8, fraction_of_fma_peak=0.03),
                "IPEX": dict(status="skipped", note="not this dtype"),
                "XFORMERS": dict(status="unavailable", note="needs CUDA"),
            },
        ),
        "prefill-8x512": dict(
            spec=dict(description="2 prefill x 16", num_prefills=2),
            read=_floor(0.0001, "native"),
            backends={
                "jax-xla": _row(0.05, fraction_of_read=0.01, fraction_of_fma_peak=0.1),
                "TORCH_SDPA": dict(_row(0.07, fraction_of_fma_peak=0.08), agrees=False),
            },
        ),
    },
)


def _bench(tmp_path, record_path, out=None) -> int:
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers())
    argv = ["bench", "--plot", str(record_path)] + (["--out", str(out)] if out else [])
    return command.run(parser.parse_args(argv))


def _is_png(path: Path) -> tuple[int, int]:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    return image.shape[:2]


def test_small_record_is_drawn_beside_itself(tmp_path, capsys):
    path = tmp_path / "small.json"
    path.write_text(json.dumps(SMALL))
    assert _bench(tmp_path, path) == 0
    png = tmp_path / "small.png"  # no --out: the record's name with .png
    assert f"wrote {png}" in capsys.readouterr().out
    height, width = _is_png(png)
    assert width > 500 and height > 300


def test_each_workload_is_set_against_its_floor():
    fig = plot.figure(SMALL)
    axes = fig.get_axes()
    assert len(axes) == 2 * len(SMALL["workloads"])  # time and fraction per workload
    decode_time, decode_frac, _, prefill_frac = axes
    assert "read floor (native read" in decode_frac.get_xlabel()
    assert "FMA peak" in prefill_frac.get_xlabel()  # compute-bound: prefill tokens
    assert "read floor 1 ms" in decode_time.get_xlabel()
    assert "jitted sum 1.5 ms" in decode_time.get_xlabel()
    ticks = [t.get_text() for t in decode_time.get_yticklabels()]
    assert ticks == ["jax-xla", "jax-cpu", "IPEX"]  # the record's order; unavailable not shown
    assert list(decode_time.get_yticks()) == [2, 1, 0]  # top to bottom
    texts = [t.get_text() for ax in axes for t in ax.texts]
    assert "skipped" in texts and any("WRONG" in t for t in texts)
    assert " 80%" in texts and " 8%" in texts


@pytest.mark.parametrize("record", RESULTS, ids=lambda p: p.name)
def test_committed_records_are_drawn(tmp_path, record):
    out = tmp_path / "chart.png"
    assert _bench(tmp_path, record, out) == 0
    _is_png(out)


@pytest.mark.parametrize(
    "content, match",
    [
        (None, "cannot read .*missing.json"),
        ("not json {", "is not a bench record .*: not JSON"),
        ("[1, 2]", "has no 'workloads' mapping"),
        ('{"workloads": {}}', "has no workloads to draw"),
        ('{"workloads": {"w": {"spec": {}}}}', "workload 'w' has no 'backends' mapping"),
        ('{"workloads": {"w": {"backends": {"p": {"status": "ok"}}}}}',
         r"w/p is timed but lacks \['median_s', 'iqr_s'\]"),
    ],
)  # fmt: skip
def test_a_file_that_is_not_a_record_is_refused(tmp_path, capsys, content, match):
    path = tmp_path / "missing.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=match):
        plot.load_record(path)
    assert _bench(tmp_path, path) == 2
    err = capsys.readouterr().err
    assert err.startswith("jax-attn bench --plot: ")
    assert not (tmp_path / "missing.png").exists()

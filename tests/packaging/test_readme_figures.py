"""The README's speed tables quote bench records (issue 37 item 6): each table's caption names
one record in benchmarks/results/, written by the current bench (both read floors), and the
machine and the time it ran; every time in the table is that record's median for the row's
workload and the column's peer, and every decode row is set against the read floor."""

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()

# Row labels of the speed tables -> the bench's workload (before its block-size suffix).
WORKLOADS = {
    "decode, 32 x ctx 1024, float32": "decode-f32",
    "decode, same, bfloat16": "decode-bf16",
    "decode, same, bf16 queries, e4m3 cache": "decode-fp8",
    "decode, 8 x ctx 8192, float32": "decode-8x8192",
    "decode, 8 x ctx 8192, bfloat16": "decode-8x8192-bf16",
    "prefill, 8 x 512, causal, float32": "prefill-8x512",
    "prefill, same, bfloat16": "prefill-bf16",
    "chunked prefill, 8 x 256 over 2048 cached, float32": "chunked-prefill",
    "chunked prefill, same, bfloat16": "chunked-prefill-bf16",
    "mixed: 4 x 256 prefill + 28 decodes, float32": "mixed",
    "mixed, bfloat16": "mixed-bf16",
    "spec-decode: 32 x 4 new tokens over 1020 cached, float32": "spec-decode",
    "spec-decode, bfloat16": "spec-decode-bf16",
}
# Column headers -> the record's peer.
PEERS = {
    "jax-cpu": "jax-cpu",
    "jax-xla": "jax-xla",
    "IPEX 2.8": "IPEX",
    "TORCH_SDPA (ours)": "TORCH_SDPA",
    "vLLM 0.8.5 TORCH_SDPA": "vllm085-TORCH_SDPA",
    "vLLM 0.32 CPU_ATTN": "vllm-cpu-attn",
    "vLLM 0.32 (ISA)": "vllm-cpu-attn",
}
# Columns of fractions -> (whose, of what).
FRACTIONS = {
    "jax-cpu, of the read floor": ("jax-cpu", "fraction_of_read"),
    "jax-cpu, of the FMA peak": ("jax-cpu", "fraction_of_fma_peak"),
    "ours, of the read floor": ("TORCH_SDPA", "fraction_of_read"),
}
RECORD = re.compile(r"`(benchmarks/results/[\w.-]+\.json)`")


def speed_tables() -> list[tuple[str, list[str]]]:
    """(the paragraph before it, its lines) for every table of the "Speed on CPU" section."""
    section = README[README.index("## Speed on CPU") :]
    section = section[: section.index("\n## ", 1)]
    tables, paragraph, caption, lines = [], [], [], []
    for line in [*section.splitlines(), ""]:
        if line.startswith("|"):
            lines.append(line)
        elif lines:
            tables.append((" ".join(caption), lines))
            lines = []
        elif line.strip():
            paragraph.append(line)
        elif paragraph:
            caption, paragraph = paragraph, []
    return tables


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


TABLES = speed_tables()


def test_the_speed_section_has_its_tables():
    assert len(TABLES) >= 4
    assert all(len(RECORD.findall(caption)) == 1 for caption, _ in TABLES), [
        caption for caption, _ in TABLES
    ]


def test_decode_rows_are_set_against_the_read_floor():
    """One floor for every decode: the read floor (a decode reads its cache, it writes nothing
    of that size); the copy floor (read + write) flatters a decode by up to 2x."""
    rows = [line for _, lines in TABLES for line in lines if line.startswith("| decode")]
    assert rows
    for row in rows:
        assert "copy" not in row, row


def _machine_words(machine: dict) -> str:
    """The record's CPU model without its marks: "AMD EPYC", "Intel Xeon"."""
    return " ".join(w for w in re.sub(r"\(R\)|\(TM\)", "", machine["cpu"]).split()
                    if w != "Processor")  # fmt: skip


@pytest.mark.parametrize("table", TABLES, ids=[RECORD.findall(c)[0] for c, _ in TABLES])
def test_each_table_quotes_its_record(table):
    caption, lines = table
    (path,) = RECORD.findall(caption)
    record = json.loads((REPO / path).read_text())
    workloads = record["workloads"]
    # Written by the current bench: both read floors beside every workload.
    assert all({"read", "read_xla"} <= set(w) for w in workloads.values()), path
    date = record["date"][:16].replace("T", " ")  # "2026-11-26 23:58"
    assert f"{date} UTC" in caption, (path, date)
    assert _machine_words(record["machine"]) in caption, (path, record["machine"]["cpu"])
    assert f"{record['machine']['cpu_count']}-core" in caption, path

    header = cells(lines[0])
    block = int(re.search(r"block (\d+)", header[0])[1])
    checked = 0
    for line in lines[2:]:
        row = cells(line)
        base = WORKLOADS[row[0]]
        name = f"{base}-bs{block}" if f"{base}-bs{block}" in workloads else base
        # Records from before issue 35 name block-16 workloads without their block size.
        assert name in workloads and (name != base or block == 16), (path, name)
        for column, cell in zip(header[1:], row[1:], strict=True):
            figure = re.match(r"(\d+(?:\.(\d+))?)( ms)?( \[|$)", cell)
            if column in PEERS and figure:
                median = workloads[name]["backends"][PEERS[column]]["median_s"] * 1e3
                half_unit = 0.5 * 10.0 ** -len(figure[2] or "")
                assert abs(float(figure[1]) - median) <= half_unit + 1e-9, (
                    path, row[0], column, cell, median,
                )  # fmt: skip
                checked += 1
            elif column in FRACTIONS and cell:
                peer, key = FRACTIONS[column]
                fraction = workloads[name]["backends"][peer][key]
                assert cell == f"{fraction:.0%}", (path, row[0], column, cell, fraction)
                checked += 1
    assert checked >= len(lines) - 2, path  # at least one figure a row

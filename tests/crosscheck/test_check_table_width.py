"""`jax-attn check` reads at 80 columns: one line per workload, no cell wrapped, with every
backend column this project has (even ones that do not run here)."""

import io

import pytest

pytest.importorskip("rich")

from rich.console import Console

from interop import cli, crosscheck


def _render(renderable, width: int) -> list[str]:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None, legacy_windows=False).print(renderable)
    return out.getvalue().splitlines()


def _table(cell: crosscheck.Cell):
    specs = crosscheck.default_specs()
    backends = crosscheck.all_backends()
    results = {s.name: {b.name: cell for b in backends} for s in specs}
    return specs, backends, cli.check_table(specs, backends, results)


def _problems(lines: list[str], specs, width: int) -> list[str]:
    """Why a rendered table does not read at `width` (empty: it does)."""
    problems = []
    if max(len(line) for line in lines) > width:
        problems.append("a line is wider than the terminal")
    if any("\u2026" in line for line in lines):
        problems.append("a cell is cut short (ellipsis)")
    # title, blank, header, rule, one line per workload, blank: a wrapped cell adds lines
    if len(lines) != len(specs) + 5:
        problems.append(f"{len(lines)} lines for {len(specs)} workloads: a cell wrapped")
    names = [line.split()[0] for line in lines[4:-1] if line.strip()]
    if names != [s.name for s in specs]:
        problems.append(f"rows {names}")
    return problems


@pytest.mark.parametrize(
    "cell",
    [
        crosscheck.Cell(1.234e-7, True),
        crosscheck.Cell(3.2e-1, False),
        crosscheck.Cell(None, True, "n/a: the Pallas kernels are paged"),
        crosscheck.Cell(None, False, "RuntimeError: something long " * 5),
    ],
    ids=["ok", "fail", "n/a", "crash"],
)
def test_table_fits_80_columns_without_wrapping(cell):
    specs, backends, table = _table(cell)
    lines = _render(table, 80)
    assert _problems(lines, specs, 80) == [], "\n".join(lines)
    header = lines[2]
    for backend in backends:
        assert backend.short in header.split(), (backend.short, header)


def test_a_table_that_does_not_fit_is_noticed():
    """The check above can fail: at 50 columns the same table no longer reads."""
    specs, _, table = _table(crosscheck.Cell(1.234e-7, True))
    assert _problems(_render(table, 50), specs, 50)


def test_names_and_labels_stay_short():
    assert all(len(s.name) <= 9 for s in crosscheck.default_specs())
    assert all(len(b.short) <= 7 for b in crosscheck.all_backends())
    assert len({b.short for b in crosscheck.all_backends()}) == len(crosscheck.all_backends())


def test_legend_explains_rows_and_columns():
    specs, backends = crosscheck.default_specs(), crosscheck.all_backends()
    legend = cli.check_legend(specs, backends)
    for spec in specs:
        assert any(line.startswith(f"[dim]{spec.name}") and "tol" in line for line in legend)
    assert "ref=jax-reference" in legend[-1] and "SDPA=TORCH_SDPA" in legend[-1]

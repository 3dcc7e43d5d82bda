"""Execute the notebooks in place, so that they are committed with their outputs and plots.

Usage: `bash scripts/run.sh python scripts/execute_notebooks.py [notebooks/X.ipynb ...]`
(default: every notebooks/*.ipynb). Each runs in its own directory, as nbmake runs them in the
test command, with `JAX_ATTN_SEED=0` (the notebooks draw a fresh seed otherwise, which nbmake
keeps doing) so that a re-run changes only what depends on the machine: timings, device names.
No per-cell timestamps are recorded, so the diff shows only outputs that changed.
"""

import os
import sys
import time
from pathlib import Path

import nbclient
import nbformat

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600  # per cell


def execute(path: Path) -> float:
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    nbclient.NotebookClient(
        nb,
        timeout=TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
        record_timing=False,
    ).execute()
    nbformat.write(nb, path)
    return time.perf_counter() - start


def main(argv: list[str]) -> int:
    os.environ.setdefault("JAX_ATTN_SEED", "0")
    paths = [Path(p).resolve() for p in argv] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    for path in paths:
        seconds = execute(path)
        print(f"{path.relative_to(ROOT)}: executed in {seconds:.0f} s, "
              f"{path.stat().st_size / 1e3:.0f} kB")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The README's jitted serving step with checks on runs as written and refuses a bad block."""

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).parents[2] / "README.md"


def _serving_step_source() -> str:
    text = README.read_text()
    section = text[text.index("## Safe by default") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_serving_step():
    printed = io.StringIO()
    namespace: dict = {}
    with contextlib.redirect_stdout(printed):
        exec(compile(_serving_step_source(), "README.md", "exec"), namespace)
    assert "metadata.block_tables[1, 1]=99 is out of range" in printed.getvalue()
    assert namespace["out"].shape == (8, 8, 64)
    # The refused step wrote nothing: the caches hold the first step's keys only.
    assert float(abs(namespace["key_cache"].astype("float32")).sum()) == 4 * 2 * 64

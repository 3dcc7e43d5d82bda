"""Which pages the ragged kernel's large outputs go on (jax_attn/cpu/csrc/output_memory.h): by
default transparent huge pages, faulted in 2 MiB at a time by each worker until one is slow, the
rest of its share then on 4 KiB pages; huge pages throughout with $JAX_ATTN_CPU_HUGE_OUTPUT=1,
none with 0; as `isa()` reports and as the kernel's madvise leaves real outputs (the THPeligible
line of their mappings)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from thp import thp_mode

from torch_backends import native

pytestmark = pytest.mark.skipif(
    native.unavailable_reason() is not None or not sys.platform.startswith("linux"),
    reason=f"native torch ops on Linux ({sys.platform}): {native.unavailable_reason()}",
)

REPO = Path(__file__).resolve().parents[2]


# In a fresh interpreter (the settings are read once per process): CALLS 64 MiB float32 outputs
# of 4096 one-token sequences written by the kernel, each kept; then per call the THPeligible
# lines of the output's mapping at its first and second 2 MiB boundaries (MADV_HUGEPAGE marks
# them in THP's "madvise" mode, MADV_NOHUGEPAGE unmarks them), each output's values, and isa().
PROBE = """
    import torch
    from interop.tolerances import assert_close
    from thp import thp_eligible
    from torch_backends import native

    T, H, D, BS = 4096, 32, 128, 16
    query = torch.randn(T, H, D)
    cache = torch.randn(T, BS, 8, D)
    qsl = torch.arange(T + 1, dtype=torch.int32)
    lens = torch.ones(T, dtype=torch.int32)
    tables = torch.arange(T, dtype=torch.int32)[:, None]
    outs = []
    for call in range(CALLS):
        out = torch.empty(T, H, D)
        outs.append(out)
        native.ragged_paged_attention(out, query, cache, cache, qsl, lens, tables, T, scale=D**-0.5)
    # one visible key per sequence: its value, for each of the 4 query heads per kv head
    expected = cache[:, 0].repeat_interleave(4, dim=1).double().numpy()
    for call, out in enumerate(outs):
        assert_close(out.numpy(), expected, torch.float32)
        chunk = (out.data_ptr() + (2 << 20) - 1) // (2 << 20) * (2 << 20)
        print("CALL", call, int(thp_eligible(chunk)), int(thp_eligible(chunk + (2 << 20))))
    print("ISA", native.isa())
"""


def _probe(env_settings: dict[str, str], calls: int) -> tuple[list[tuple[int, int]], str]:
    """THPeligible at each output's first two chunks, and isa(), in a fresh interpreter with
    the settings."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(REPO), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
        ),
    }
    for name in ("JAX_ATTN_CPU_HUGE_OUTPUT", "JAX_ATTN_CPU_SLOW_HUGE_CHUNK_US"):
        env.pop(name, None)
    env.update(env_settings)
    code = textwrap.dedent(PROBE).replace("CALLS", str(calls))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    eligible = [tuple(map(int, line.split()[2:4])) for line in lines if line.startswith("CALL ")]
    isa = next(line for line in lines if line.startswith("ISA "))
    assert len(eligible) == calls, proc.stdout
    return eligible, isa.removeprefix("ISA ")


DEFAULT = "huge pages, 4 KiB pages after a slow one"
CASES = {
    # setting: (THPeligible at the first and second chunk, isa's words)
    "set-1": ({"JAX_ATTN_CPU_HUGE_OUTPUT": "1"}, (1, 1), "huge pages"),
    "set-0": ({"JAX_ATTN_CPU_HUGE_OUTPUT": "0"}, (0, 0), "4 KiB pages"),
    # a 64 MiB output's chunks fault in within the 2 ms limit on a healthy machine: all huge
    "unset": ({}, (1, 1), DEFAULT),
    # every chunk slow: each worker's first chunk stays huge, the rest of its share is not
    "unset-every-chunk-slow": ({"JAX_ATTN_CPU_SLOW_HUGE_CHUNK_US": "0"}, (1, 0), DEFAULT),
    # ... unless huge pages are asked for throughout
    "set-1-every-chunk-slow": (
        {"JAX_ATTN_CPU_HUGE_OUTPUT": "1", "JAX_ATTN_CPU_SLOW_HUGE_CHUNK_US": "0"},
        (1, 1),
        "huge pages",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_large_outputs_go_on_the_pages_the_setting_names(case):
    mode = thp_mode()
    if mode != "madvise":
        pytest.skip(f"THP is {mode!r} here: only its 'madvise' mode shows the kernel's advice")
    settings, expected, text = CASES[case]
    eligible, isa = _probe(settings, calls=3)
    if case == "unset" and eligible != [expected] * 3:
        # the host took a chunk back while it was faulted in (slower than the limit): the rest
        # of that share went on 4 KiB pages, as it should; only the first chunk is certain
        assert [first for first, _ in eligible] == [1] * 3, (eligible, isa)
    else:
        assert eligible == [expected] * 3, isa
    assert isa.endswith("large outputs: " + text), isa

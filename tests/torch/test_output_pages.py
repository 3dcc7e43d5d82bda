"""Which pages the ragged kernel's large outputs go on (jax_attn/cpu/csrc/output_memory.h):
transparent huge pages unless $JAX_ATTN_CPU_HUGE_OUTPUT=0, as `isa()` reports and as the
kernel's madvise leaves real outputs (the THPeligible line of their mappings)."""

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


# In a fresh interpreter (the setting is read once per process): CALLS 64 MiB float32 outputs of
# 4096 one-token sequences written by the kernel, each kept, and per call the THPeligible line
# of the mapping at the output's first 2 MiB boundary (MADV_HUGEPAGE marks it in THP's
# "madvise" mode); then isa().
PROBE = """
    import torch
    from interop.tolerances import assert_close
    from thp import thp_eligible
    from torch_backends import native

    T, H, D, BS = 4096, 32, 128, 16
    query = torch.randn(T, H, D)
    cache = torch.randn(T, BS, 8, D)
    qsl = torch.arange(T + 1, dtype=torch.int32)
    outs = []
    for call in range(CALLS):
        out = torch.empty(T, H, D)
        outs.append(out)
        native.ragged_paged_attention(
            out, query, cache, cache, qsl, torch.ones(T, dtype=torch.int32),
            torch.arange(T, dtype=torch.int32)[:, None], T, scale=D**-0.5)
        # one visible key per sequence: its value, for each of the 4 query heads per kv head
        expected = cache[:, 0].repeat_interleave(4, dim=1).double().numpy()
        assert_close(out.numpy(), expected, torch.float32)
        inside = (out.data_ptr() + (2 << 20) - 1) // (2 << 20) * (2 << 20)
        print("CALL", call, int(thp_eligible(inside)))
    print("ISA", native.isa())
"""


def _probe(setting: str | None, calls: int) -> tuple[list[int], str]:
    """THPeligible per call, and isa(), in a fresh interpreter with the setting."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(REPO), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
        ),
    }
    env.pop("JAX_ATTN_CPU_HUGE_OUTPUT", None)
    if setting is not None:
        env["JAX_ATTN_CPU_HUGE_OUTPUT"] = setting
    code = textwrap.dedent(PROBE).replace("CALLS", str(calls))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    eligible = [int(line.split()[2]) for line in lines if line.startswith("CALL ")]
    isa = next(line for line in lines if line.startswith("ISA "))
    assert len(eligible) == calls, proc.stdout
    return eligible, isa.removeprefix("ISA ")


@pytest.mark.parametrize("setting", ["1", "0", None], ids=["set-1", "set-0", "unset"])
def test_large_outputs_go_on_the_pages_the_setting_names(setting):
    mode = thp_mode()
    if mode != "madvise":
        pytest.skip(f"THP is {mode!r} here: only its 'madvise' mode shows the kernel's advice")
    huge = setting != "0"
    eligible, isa = _probe(setting, calls=3)
    assert eligible == [int(huge)] * 3, isa
    assert isa.endswith("large outputs: " + ("huge pages" if huge else "4 KiB pages")), isa

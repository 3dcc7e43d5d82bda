"""Transparent huge pages as this process sees them: the system's mode, whether a mapping may
hold them, and the kernel's version (for the tests of torch_backends.huge_pages and of the
kernels' output pages)."""

import os
import sys
from pathlib import Path


def thp_mode() -> str:
    """ "always", "madvise" or "never" (also where sysfs has no THP at all)."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    text = path.read_text() if path.exists() else "[never]"
    return text[text.index("[") + 1 : text.index("]")]


def thp_eligible(address: int) -> bool:
    """The THPeligible line of the /proc/self/smaps mapping that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


def linux_at_least(major: int, minor: int) -> bool:
    """Whether the running Linux kernel is at least major.minor (False elsewhere)."""
    if not sys.platform.startswith("linux"):
        return False
    release = os.uname().release.split("-")[0].split(".")
    return (int(release[0]), int(release[1])) >= (major, minor)

"""pytest-xdist's `--dist loadgroup`, with the group read where pytest 9.2 still lets it be read.

A module marked `pytestmark = pytest.mark.xdist_group("name")` runs on one worker, so that its
module-scoped fixture (a minute-long subprocess: the sharded cases, the bench smoke runs) runs
once. xdist 3.8 carries the group to its scheduler by appending "@name" to the test's node id
(`item._nodeid`); pytest 9.2 builds node ids from a structured id and ignores that field, so the
suffix never arrives and every grouped test is dealt out on its own (pytest-xdist issue 1386):
each worker then ran the sharded cases' fixture, 60-90 s of the suite twice.

`GroupScheduling` takes the group from the test module's own `pytestmark = ...xdist_group(...)`
line, read by the scheduler (it sees node ids only, never the items); a node id that does carry
the suffix (pytest before 9.2, or a fixed xdist) keeps xdist's own reading. Marks on single
tests or classes are not read: this suite groups whole modules only.

tests/conftest.py registers GroupSchedulerPlugin where xdist runs: it puts this scheduler in
place of xdist's for `--dist loadgroup`.
"""

import functools
import re
from pathlib import Path

from xdist.scheduler import LoadGroupScheduling

MODULE_GROUP = re.compile(r"""^pytestmark\s*=\s*pytest\.mark\.xdist_group\(\s*["']([^"']+)["']""",
                          re.MULTILINE)  # fmt: skip


@functools.cache
def module_group(path: Path) -> str | None:
    """The group a test module's `pytestmark` line names, or None."""
    try:
        found = MODULE_GROUP.search(path.read_text(encoding="utf-8"))
    except OSError:  # not a file here (a notebook's or a doctest's id): no group
        return None
    return found.group(1) if found else None


class GroupScheduling(LoadGroupScheduling):
    """xdist's loadgroup scheduler, with a grouped module's tests one work unit whether or not
    their node ids carry the group suffix. Units go out in collection order (tests/conftest.py
    puts the `long` tests first, then the grouped modules), not largest first."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        self.rootpath = config.rootpath
        config.option.loadscopereorder = False

    def _split_scope(self, nodeid: str) -> str:
        if nodeid.rfind("@") > nodeid.rfind("]"):  # the suffix arrived: xdist's own rule
            return super()._split_scope(nodeid)
        group = module_group(self.rootpath / nodeid.split("::", 1)[0])
        return group if group is not None else nodeid


class GroupSchedulerPlugin:
    """The hook, as a plugin to register only where xdist is active (a run with `-p no:xdist`
    has no such hook, and pytest refuses an unknown one)."""

    @staticmethod
    def pytest_xdist_make_scheduler(config, log):
        if config.getvalue("dist") == "loadgroup":
            return GroupScheduling(config, log)
        return None

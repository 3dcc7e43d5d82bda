"""The frame both bad-input fuzzers share (`interop/bad_input.py`): the timed loop, the child
process a campaign runs in, and the per-subject runs behind `jax-attn fuzz --bad-metadata` and
`--torch-ops`, with a stand-in fuzzer module (no kernels needed) so each outcome is forced."""

import os
import sys
import textwrap

import pytest

from interop import bad_input

# A fuzzer module for the child processes: subject "clean" passes, "failing" reports a failure,
# "crashing" dies the way a sanitizer's abort does (a signal, no summary).
STAND_IN = textwrap.dedent(
    """
    import os, signal, sys
    from interop import bad_input

    def fuzz(subject, *, seconds, seed, progress=None):
        report = bad_input.Report(subject, "nothing")
        if subject == "crashing":
            os.kill(os.getpid(), signal.SIGABRT)

        def one(index):
            report.examples += 1
            report.ran += 1
            report.mutations["m"] += 1
            if subject == "failing" and index == 2:
                report.failures.append((seed, index, "a wrong row"))

        return bad_input.run_for(report, one, examples=5, seconds=None, progress=progress,
                                 every=2)

    if __name__ == "__main__":
        sys.exit(bad_input.child_main(sys.argv[1:], fuzz))
    """
)


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """The stand-in module on this process's path and the child environment's."""
    (tmp_path / "stand_in_fuzzer.py").write_text(STAND_IN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "stand_in_fuzzer", raising=False)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), repo])}


def test_run_for_counts_examples_and_reports_progress():
    report = bad_input.Report("k", "the oracle")
    seen, progress = [], []
    bad_input.run_for(
        report,
        seen.append,
        examples=7,
        seconds=None,
        progress=lambda r: progress.append(r.seconds),
        every=3,
    )
    assert seen == list(range(7))
    assert len(progress) == 2  # after examples 3 and 6
    assert report.seconds >= progress[-1] >= 0


def test_run_for_needs_a_limit():
    with pytest.raises(ValueError, match="examples or seconds"):
        bad_input.run_for(
            bad_input.Report("k", "x"), print, examples=None, seconds=None, progress=None, every=1
        )


def test_summary_names_subject_oracle_and_failures():
    report = bad_input.Report("decode", "impl='xla'", examples=4, refused=1, ran=3, compared=2)
    report.failures.append((7, 3, "rows differ"))
    text = report.summary()
    assert text.startswith("decode: 4 examples")
    assert "1 refused" in text and "3 ran (2 compared with impl='xla')" in text
    assert "FAILURE seed=7 example=3: rows differ" in text


@pytest.mark.parametrize(
    "subject, rc, expect",
    [
        ("clean", 0, "clean: 5 examples"),
        ("failing", 1, "FAILURE seed=3 example=2: a wrong row"),
        ("crashing", 1, "crashing: no summary"),
    ],
)
def test_run_children_reports_each_outcome(stand_in, capsys, subject, rc, expect):
    got = bad_input.run_children(
        "stand_in_fuzzer",
        ["clean", "failing", "crashing"],
        backend=subject,
        minutes=0.01,
        seed=3,
        env=stand_in,
    )
    out = capsys.readouterr().out
    assert got == rc, out
    assert expect in out
    assert bad_input.PROGRESS not in out  # progress lines stay out of the summary
    if rc:
        assert f"{subject}: child exited" in out


def test_run_children_refuses_an_unknown_backend(capsys):
    got = bad_input.run_children(
        "stand_in_fuzzer", ["a", "b"], backend="c", minutes=0.01, seed=0, env=dict(os.environ)
    )
    assert got == 2
    assert "--backend='c' is not one of ['a', 'b']" in capsys.readouterr().err


def test_child_main_exit_code(stand_in, capsys):
    import stand_in_fuzzer

    assert bad_input.child_main(["clean", "1", "0"], stand_in_fuzzer.fuzz) == 0
    assert bad_input.child_main(["failing", "1", "0"], stand_in_fuzzer.fuzz) == 1
    out = capsys.readouterr().out
    assert out.count(bad_input.PROGRESS) == 4  # 2 per run of 5 examples, every 2

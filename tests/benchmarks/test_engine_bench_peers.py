"""`jax-attn bench --engine`'s peers without an engine: what each child's environment says, the
rotation over the peers `--huge-pages-ab`, `--keep-freed-ab` and `--output-pages-ab` add, the
medians and ratios of the record, `--compiled` on every child's command line, and what the
no-attention peer writes."""

import argparse
import json
import subprocess

import pytest

from benchmarks import command, engine_v1

SWITCHES = (
    "JAX_ATTN_VLLM",
    "JAX_ATTN_VLLM_HUGE_PAGES",
    "THP_MEM_ALLOC_ENABLE",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "JAX_ATTN_CPU_HUGE_OUTPUT",
)


class _FakeChildren:
    """subprocess.run for the bench's children: records each child's peer and environment and
    answers with made-up times (prefill and whole run grow with the peer's index in `peers`)."""

    def __init__(self, peers):
        self.peers = peers
        self.calls = []
        self.compiled = []
        self.speculative = []

    def __call__(self, cmd, env, cwd, capture_output, text, timeout):
        peer = cmd[cmd.index("--child") + 1]
        self.calls.append((peer, {k: env.get(k) for k in SWITCHES}))
        self.compiled.append("--compiled" in cmd)
        self.speculative.append(
            int(cmd[cmd.index("--speculative") + 1]) if "--speculative" in cmd else None
        )
        slow = 1.0 + self.peers.index(peer) + len(self.calls) / 100
        result = dict(impl=engine_v1.EXPECTED_IMPL[peer], prefill_s=slow, whole_s=2 * slow + 1,
                      generated=64)  # fmt: skip
        return subprocess.CompletedProcess(cmd, 0, "RESULT " + json.dumps(result), "")


@pytest.mark.parametrize(
    ("page_peers", "keep_peers", "output_peers"),
    [(False, False, False), (True, False, False), (False, True, False), (False, False, True)],
)
def test_peers_and_their_switches(monkeypatch, tmp_path, page_peers, keep_peers, output_peers):
    for name in SWITCHES:  # the caller's own settings never reach a child
        monkeypatch.setenv(name, "7")
    peers = engine_v1.PEERS + (engine_v1.PAGE_PEERS if page_peers else ())
    peers += engine_v1.KEEP_PEERS if keep_peers else ()
    peers += engine_v1.OUTPUT_PEERS if output_peers else ()
    children = _FakeChildren(peers)
    monkeypatch.setattr(engine_v1.subprocess, "run", children)
    out = tmp_path / "engine.json"
    args = argparse.Namespace(quick=True, reps=2, dtypes="float32", json=str(out),
                              huge_pages_ab=page_peers, keep_freed_ab=keep_peers,
                              output_pages_ab=output_peers)  # fmt: skip
    assert engine_v1.run(args) == 0

    n = len(peers)
    assert [p for p, _ in children.calls] == list(peers) + list(peers[1:] + peers[:1])
    envs = dict(children.calls)
    none = dict.fromkeys(SWITCHES)
    assert envs["vllm-cpu-attn"] == none and envs["no-attention"] == none
    assert envs["jax-attn-plugin"] == {**none, "JAX_ATTN_VLLM": "1"}
    if page_peers:
        assert envs["jax-attn-plugin-4k"] == {
            **none, "JAX_ATTN_VLLM": "1", "JAX_ATTN_VLLM_HUGE_PAGES": "0"
        }  # fmt: skip
        assert envs["vllm-cpu-attn-thp"] == {**none, "THP_MEM_ALLOC_ENABLE": "1"}
    if keep_peers:
        keep = {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**32)}
        assert envs["vllm-cpu-attn-keep"] == {**none, **keep}
        assert envs["jax-attn-plugin-keep"] == {**none, "JAX_ATTN_VLLM": "1", **keep}
    if output_peers:
        for peer, value in (("jax-attn-plugin-huge-out", "1"), ("jax-attn-plugin-4k-out", "0")):
            assert envs[peer] == {**none, "JAX_ATTN_VLLM": "1", "JAX_ATTN_CPU_HUGE_OUTPUT": value}

    record = json.loads(out.read_text())
    assert record["peers"] == list(peers)
    results = record["results"]["float32"]
    assert set(results) == set(peers)
    tokens = engine_v1.QUICK["prompts"] * engine_v1.QUICK["prompt_len"]
    for i, peer in enumerate(peers):
        # Round 0 is call i + 1, round 1 call n + (i - 1) % n + 1 (rotated by one).
        times = [1.0 + i + (i + 1) / 100, 1.0 + i + (n + (i - 1) % n + 1) / 100]
        assert results[peer]["prefill_tok_s"] == pytest.approx(
            (tokens / times[0] + tokens / times[1]) / 2
        )
        # The generation: 64 tokens in the whole run's time past the prefill's (slow + 1).
        assert results[peer]["generation_tok_s"] == pytest.approx(
            (64 / (times[0] + 1) + 64 / (times[1] + 1)) / 2
        )
        if peer != "vllm-cpu-attn":
            own = results["vllm-cpu-attn"]
            for part in ("prefill", "whole", "generation"):
                assert results[peer][f"{part}_speedup"] == pytest.approx(
                    results[peer][f"{part}_tok_s"] / own[f"{part}_tok_s"]
                )
        else:
            assert "prefill_speedup" not in results[peer]


@pytest.mark.parametrize("compiled", [False, True])
def test_compiled_reaches_every_child(monkeypatch, tmp_path, compiled):
    children = _FakeChildren(engine_v1.PEERS)
    monkeypatch.setattr(engine_v1.subprocess, "run", children)
    out = tmp_path / "engine.json"
    args = argparse.Namespace(quick=True, reps=1, dtypes="bfloat16,float32", json=str(out),
                              compiled=compiled)  # fmt: skip
    assert engine_v1.run(args) == 0
    assert children.compiled == [compiled] * 2 * len(engine_v1.PEERS)
    assert json.loads(out.read_text())["mode"] == ("compiled" if compiled else "eager")


@pytest.mark.parametrize("speculative", [None, 3])
def test_speculative_reaches_every_child(monkeypatch, tmp_path, capsys, speculative):
    children = _FakeChildren(engine_v1.PEERS)
    monkeypatch.setattr(engine_v1.subprocess, "run", children)
    out = tmp_path / "engine.json"
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers())
    argv = ["bench", "--engine", "--quick", "--rounds", "1", "--dtypes", "float32"]
    argv += ["--json", str(out)] + (["--speculative", str(speculative)] if speculative else [])
    assert command.run(parser.parse_args(argv)) == 0
    assert children.speculative == [speculative] * len(engine_v1.PEERS)
    config = json.loads(out.read_text())["speculative"]
    if speculative:
        assert config == engine_v1._speculative_config(speculative)
        assert config["method"] == "ngram" and config["num_speculative_tokens"] == speculative
        assert "3 draft tokens a step (ngram)" in capsys.readouterr().out
    else:
        assert config is None and engine_v1._speculative_config(None) is None


@pytest.mark.parametrize("argv", [["--engine", "--speculative", "0"], ["--speculative", "2"]])
def test_bad_speculative_is_refused(capsys, argv):
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers())
    assert command.run(parser.parse_args(["bench", *argv])) == 2
    out = capsys.readouterr().out
    assert ("at least 1" in out) if "--engine" in argv else ("is for the engine bench" in out)


@pytest.mark.vllm
def test_no_attention_writes_zeros():
    pytest.importorskip("vllm", minversion="0.32", reason="vLLM 0.32 is not installed here")
    import torch

    impl = engine_v1._no_attention_backend().get_impl_cls()(4, 32, 0.1, 2)
    output = torch.full((3, 4 * 32), float("nan"))
    assert impl.forward(None, None, None, None, None, None, output) is output
    assert torch.equal(output, torch.zeros_like(output))


@pytest.mark.parametrize(
    "flag", ["--huge-pages-ab", "--keep-freed-ab", "--compiled", "--dtypes=float32"]
)
def test_page_peers_need_the_engine_bench(capsys, flag):
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers())
    assert command.run(parser.parse_args(["bench", flag])) == 2
    assert f"{flag.split('=')[0]} is for the engine bench" in capsys.readouterr().out


def test_dtypes_reach_the_engine_bench(monkeypatch, tmp_path):
    children = _FakeChildren(engine_v1.PEERS)
    monkeypatch.setattr(engine_v1.subprocess, "run", children)
    out = tmp_path / "engine.json"
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--engine", "--dtypes", "float32", "--rounds", "1",
                              "--quick", "--json", str(out)])  # fmt: skip
    assert command.run(args) == 0
    assert list(json.loads(out.read_text())["results"]) == ["float32"]
    assert len(children.calls) == len(engine_v1.PEERS)


@pytest.mark.parametrize("dtypes", ["float16", "float32,float32", "bf16", "float32,"])
def test_bad_dtypes_are_refused_by_name(capsys, dtypes):
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers())
    assert command.run(parser.parse_args(["bench", "--engine", "--dtypes", dtypes])) == 2
    out = capsys.readouterr().out
    assert f"--dtypes {dtypes!r}" in out and "bfloat16, float32" in out
    # python -m benchmarks.engine_v1 takes the same flag, checked by the same rule.
    assert engine_v1.main(["--dtypes", dtypes]) == 2
    assert f"--dtypes {dtypes!r}" in capsys.readouterr().out

"""A decode step of vLLM 0.8.5's own V0 engine (CPU), per attention backend, per threading setting.

Issue 20: the JAX backend timed inside a torch model, not only in isolation. In a model step
every attention call comes right after torch ops (projections, norms, rotary embedding), and
torch's OpenMP workers keep spinning for a while after each op, on the same cores XLA's pool
needs. This runs the real engine (`vllm.LLM`, `VLLM_USE_V1=0`, CPU, float32) on a random-weight
Llama with each backend substituted through `tests/vllm085/engine_harness.py`, and times its
decode steps under each OpenMP setting in `SETTINGS`:

    python -m benchmarks.engine_step                      # inside the vllm085 environment
    JAX_ATTN_ENV=vllm085 bash scripts/run.sh python -m benchmarks.engine_step --rounds 3
    ... --quick --json out.json                           # smoke run (tests/vllm085)

The settings are environment variables that torch's OpenMP runtime reads once, when torch loads,
so each runs in processes of its own (`--child`), started with its variables and without the
others'. One process per setting, backend and round: a deployment runs one backend, so vLLM's
own is never timed beside XLA's threads (which, in one process, slow every backend: see
docs/interop.md). The pairs run in an order rotated by round. Per process: an engine, one untimed
generation (JAX compiles each new shape; vLLM warms up), then `--repeats` generations timed step
by step (`LLMEngine.step`). A step is a decode step when every request already had its first
token before it: every sequence (8 in the full size), one new token each, nothing else scheduled.

Reported: per setting and backend, the median decode step (median over rounds of each round's
median), and ratios to vLLM's own TORCH_SDPA in the same setting and to the same backend under
the default setting; the load average before and after. Every backend must produce vLLM's own
tokens (greedy, float32): the exit code is 1 when one does not.
"""

import argparse
import datetime
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The variables a setting may set; each child starts with none of them but its own.
OMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "JAX_ATTN_CPU_THREADS")

SETTINGS = {
    "default": {},  # libgomp's own: spin ~300k pauses after each parallel region, then sleep
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},  # workers sleep at once
    "spin10k": {"GOMP_SPINCOUNT": "10000"},  # what the JAX backend recommends (interop.omp)
    "spin1k": {"GOMP_SPINCOUNT": "1000"},
    "jax1thread": {"JAX_ATTN_CPU_THREADS": "1"},  # the native kernels on the calling thread
}
DEFAULT_SETTINGS = ("default", "passive", "spin10k")
QUICK_SETTINGS = ("default", "spin10k")  # libgomp's own and the recommended one

BACKENDS = {
    "vLLM TORCH_SDPA": "vllm.attention.backends.torch_sdpa.TorchSDPABackend",
    "TORCH_SDPA": "torch_backends.torch_sdpa.TorchSDPABackend",
    "JAX": "interop.torch_op.JaxAttnBackend",
}
BASELINE = "vLLM TORCH_SDPA"

# The timed model: GQA 8 query / 2 kv heads of 64, 4 layers, 8 sequences of ~1000 tokens, so
# attention reads a real cache every step (8 x 1000 x 2 x 64 x 2 x 4 B = 8 MB per layer).
FULL = dict(
    layers=4, hidden=512, heads=8, kv_heads=2, intermediate=1024,
    prompt_lengths=(1000, 960, 1010, 900, 990, 1020, 940, 980), max_model_len=1280, max_tokens=17,
)  # fmt: skip
# --quick: the drop-in tests' llama size, short prompts, a few steps.
QUICK = dict(
    layers=2, hidden=256, heads=4, kv_heads=2, intermediate=512,
    prompt_lengths=(5, 17, 33, 40), max_model_len=256, max_tokens=4,
)  # fmt: skip


def harness():
    """tests/vllm085/engine_harness.py: the engine, the model builder, the backend swap. It
    lives with the drop-in tests; this benchmark runs from a checkout."""
    here = Path(__file__).resolve().parents[1] / "tests" / "vllm085"
    if not (here / "engine_harness.py").exists():
        raise SystemExit(f"benchmarks.engine_step needs a checkout: {here}/engine_harness.py")
    sys.path.insert(0, str(here))
    return importlib.import_module("engine_harness")


def build_llama(root: Path, size: dict, *, seed: int) -> Path:
    """A random-weight Llama of `size` saved in `root/llama_bench` (float32 safetensors and the
    harness's word-level tokenizer); returns its path. The prompts go beside it."""
    import numpy as np
    import torch
    import transformers as tf

    h = harness()
    torch.manual_seed(seed)
    path = root / "llama_bench"
    config = tf.LlamaConfig(
        vocab_size=h.VOCAB_SIZE,
        hidden_size=size["hidden"],
        intermediate_size=size["intermediate"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"],
        head_dim=size["hidden"] // size["heads"],
        max_position_embeddings=size["max_model_len"],
        tie_word_embeddings=False,
        pad_token_id=h.PAD_ID,
        bos_token_id=h.BOS_ID,
        eos_token_id=h.EOS_ID,
        torch_dtype="float32",
        initializer_range=0.1,  # clear greedy choices (engine_harness.build_model says why)
    )
    h._save(tf.LlamaForCausalLM(config), path, max_len=size["max_model_len"])
    prompts = h.random_prompts(np.random.default_rng(seed), size["prompt_lengths"])
    (path / "prompts.json").write_text(json.dumps(prompts))
    return path


def omp_runtime() -> str:
    """The OpenMP runtime torch loaded (torch's wheels bundle their own libgomp)."""
    libs = set()
    for line in open("/proc/self/maps"):
        name = line.split()[-1]
        if any(k in os.path.basename(name) for k in ("libgomp", "libiomp", "libomp")):
            libs.add(os.path.basename(name))
    return ", ".join(sorted(libs)) or "none"


# ---------------------------------------------------------------------------------------------
# One process: one setting, every backend


def generate(llm, prompts, max_tokens: int) -> tuple[list[float], list[list[int]]]:
    """One greedy generation stepped by hand: (decode step times in s, tokens per prompt)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    started, decode_s, tokens = set(), [], {}
    while engine.has_unfinished_requests():
        decode = len(started) == len(prompts)  # everyone had a first token: a decode step
        t0 = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - t0
        if decode:
            decode_s.append(elapsed)
        for out in outputs:
            if out.outputs and out.outputs[0].token_ids:
                started.add(out.request_id)
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return decode_s, [tokens[str(i)] for i in range(len(prompts))]


def child(args) -> None:
    h = harness()
    h.set_engine_env()
    import torch

    model_dir = Path(args.model)
    prompts = json.loads((model_dir / "prompts.json").read_text())
    model = h.TinyModel("llama_bench", model_dir, "generate", tuple(prompts))
    result = {
        "setting": args.child,
        "backend": args.backend,
        "env": {v: os.environ[v] for v in OMP_VARIABLES if v in os.environ},
        "round": args.round,
        "torch_threads": torch.get_num_threads(),
    }
    with h.engine(model, BACKENDS[args.backend], max_model_len=args.max_model_len) as llm:
        generate(llm, prompts, args.max_tokens)  # untimed: JAX compiles, vLLM warms up
        result["decode_step_s"], result["tokens"] = [], None
        for _ in range(args.repeats or 1):
            steps, tokens = generate(llm, prompts, args.max_tokens)
            result["decode_step_s"] += steps
            if result["tokens"] not in (None, tokens):
                result["tokens_changed"] = True
            result["tokens"] = tokens
    result["omp_runtime"] = omp_runtime()
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------
# The parent: build, run the children, summarize


def run_child(setting: str, backend: str, round_: int, model: Path, size: dict, repeats: int):
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARIABLES} | SETTINGS[setting]
    cmd = [sys.executable, "-m", "benchmarks.engine_step", "--child", setting,
           "--backend", backend, "--round", str(round_), "--model", str(model),
           "--max-model-len", str(size["max_model_len"]),
           "--max-tokens", str(size["max_tokens"]), "--repeats", str(repeats)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"{setting!r} {backend!r} round {round_}: exit {proc.returncode}\n{proc.stderr[-4000:]}"
        )
    return json.loads(lines[-1].removeprefix("RESULT "))


def summarize(runs: list[dict], settings: list[str]) -> dict:
    """Per setting and backend: the median over rounds of each round's median decode step."""
    table = {}
    want = next(r["tokens"] for r in runs if r["backend"] == BASELINE)
    mismatches = [
        f"{r['setting']} round {r['round']} {r['backend']}"
        for r in runs
        if r["tokens"] != want or r.get("tokens_changed")
    ]
    for s in settings:
        table[s] = {}
        for name in BACKENDS:
            per_round = [
                statistics.median(r["decode_step_s"])
                for r in runs
                if r["setting"] == s and r["backend"] == name
            ]
            table[s][name] = {"median_s": statistics.median(per_round), "rounds_s": per_round}
    for s in settings:
        for name, row in table[s].items():
            row["x_vllm"] = row["median_s"] / table[s][BASELINE]["median_s"]
            row["x_default"] = (
                row["median_s"] / table["default"][name]["median_s"] if "default" in table else None
            )
    return {"table": table, "mismatches": mismatches}


def print_table(summary: dict) -> None:
    print(f"{'setting':<11} {'backend':<16} {'step ms':>8} {'x vLLM':>7} {'x default':>9}  rounds")
    for s, rows in summary["table"].items():
        for name, row in rows.items():
            xd = "" if row["x_default"] is None else f"{row['x_default']:.2f}"
            rounds = " ".join(f"{t * 1e3:.1f}" for t in row["rounds_s"])
            print(
                f"{s:<11} {name:<16} {row['median_s'] * 1e3:8.2f} {row['x_vllm']:7.2f} "
                f"{xd:>9}  {rounds}"
            )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--quick", action="store_true", help="tiny model, few steps, one round")
    p.add_argument("--settings", help=f"comma-separated, of {', '.join(SETTINGS)}")
    p.add_argument("--rounds", type=int, help="children per setting (default 2; quick 1)")
    p.add_argument("--json", help="write the record here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--max-model-len", type=int, help=argparse.SUPPRESS)
    p.add_argument("--max-tokens", type=int, help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, help="timed generations per child (default 2; quick 1)")
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0

    size = QUICK if args.quick else FULL
    default = QUICK_SETTINGS if args.quick else DEFAULT_SETTINGS
    settings = args.settings.split(",") if args.settings else list(default)
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        p.error(f"unknown settings {unknown} (known: {', '.join(SETTINGS)})")
    rounds = args.rounds or (1 if args.quick else 2)
    repeats = args.repeats or (1 if args.quick else 2)
    load = [os.getloadavg()]
    runs = []
    with tempfile.TemporaryDirectory(prefix="engine_step_") as tmp:
        model = build_llama(Path(tmp), size, seed=args.seed)
        pairs = [(s, b) for s in settings for b in BACKENDS]
        for r in range(rounds):
            k = (r * len(BACKENDS) + r) % len(pairs)  # a different start (setting, backend)
            for s, b in pairs[k:] + pairs[:k]:
                print(f"[engine_step] round {r + 1}/{rounds}: {s} {b}", file=sys.stderr, flush=True)
                runs.append(run_child(s, b, r, model, size, repeats))
                load.append(os.getloadavg())
                step = statistics.median(runs[-1]["decode_step_s"]) * 1e3
                print(f"[engine_step]   median {step:.2f} ms; load {load[-1][0]:.2f}",
                      file=sys.stderr, flush=True)  # fmt: skip
    summary = summarize(runs, settings)
    print_table(summary)
    print(f"load average (1, 5, 15 min) before: {load[0]}, after: {load[-1]}")
    print(f"OpenMP runtime: {runs[0]['omp_runtime']}; torch threads {runs[0]['torch_threads']}")
    if summary["mismatches"]:
        print(f"TOKENS DIFFER from vLLM's own: {summary['mismatches']}")
    if args.json:
        record = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "quick": args.quick,
            "size": size,
            "repeats": repeats,
            "settings": {s: SETTINGS[s] for s in settings},
            "load": load,
            "runs": runs,
            **summary,
        }
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 1 if summary["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())

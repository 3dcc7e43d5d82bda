"""`jax-attn bench --engine`: vLLM 0.32's V1 engine on CPU with its own CPU_ATTN and with this
project's plugin (JAX_ATTN_VLLM=1), and with no attention at all (the upper bound a perfect
kernel could reach), A/B alternated, in the vllm environment:

    JAX_ATTN_ENV=vllm bash scripts/run.sh jax-attn bench --engine --rounds 3 \
        --json benchmarks/results/engine/engine-v1-<cpu kind>.json   # one record per machine
    ... --engine --quick                                   # a small smoke run

The model is issue 36's attention-heavy tiny Llama (Hq 32 / Hkv 8 / D 128, hidden 256, 4
layers, random weights: `config.json` and `load_format="dummy"`), served 32 prompts x 1024
tokens + 64 greedy tokens each, block 128, in bfloat16 and float32 (`--quick`: 4 x 256 + 8).
Each peer runs in a child process of its own (a deployment runs one backend; vLLM's plugins
and thread pools are per process), started in a rotated order each round. Per child: an engine
(in-process core, `VLLM_CPU_OMP_THREADS_BIND=nobind`: every core, as the kernels' own bench),
one untimed warm-up generation at full size (every prompt, 2 tokens: the engine's first batch
of that size allocates its activations and pages in its buffers, about a second of the first
timed prefill otherwise, in every peer alike; before, the no-attention run's prefill alone took
longer than its whole run), then two timed ones on fresh prompts (no prefix caching):
`max_tokens=1` (the prefill) and the whole run.

Each engine runs eagerly (`enforce_eager=True`), as the records so far; `--compiled` runs vLLM's
default instead (its CPU compilation: the model's forward traced once by Dynamo and compiled by
inductor, attention left to the backend as an opaque op), which the warm-up compiles.

`--speculative N` serves with speculative decoding: N draft tokens a step from n-gram lookup
(vLLM's `ngram` method, matches of 1-3 tokens in the request's own context), so that after the
prefill each step verifies up to N + 1 new tokens per request over its cache (the kernels'
`spec-decode` workload). The random-weight model soon repeats a short cycle of tokens, so
nearly every draft is accepted; each child records vLLM's draft and acceptance counters of its
whole run, which tell whether both engines drafted alike.

Reported per dtype and peer: medians over rounds of prefill tokens/s (prompt tokens / prefill
time) and whole-run tokens/s ((prompt + generated tokens) / time), the plugin's speed-up over
vLLM's CPU_ATTN, and the no-attention run's (the ceiling); and the generation's tokens/s
(generated tokens / (whole-run time - prefill time): the steps after the prefill).
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PEERS = ("vllm-cpu-attn", "jax-attn-plugin", "no-attention")
DTYPES = ("bfloat16", "float32")  # the model dtypes, in run order (`--dtypes` picks some)
# `--huge-pages-ab`: what the plugin's huge-page cache (torch_backends.huge_pages) is worth, as
# the plugin without it and vLLM's CPU_ATTN on torch's huge-page allocator (every torch
# allocation of 2 MiB or more, its cache included, asks for huge pages before it is touched).
PAGE_PEERS = ("jax-attn-plugin-4k", "vllm-cpu-attn-thp")
# `--keep-freed-ab`: both engines with glibc keeping the blocks it frees for reuse (its mmap and
# trim thresholds raised: a deployment's process-wide knob, docs/torch_backends.md). vLLM
# allocates each layer's output per step, past glibc's default mmap threshold: fresh pages to
# zero every time, whichever backend writes them.
KEEP_FREED = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}
KEEP_PEERS = ("vllm-cpu-attn-keep", "jax-attn-plugin-keep")
# `--output-pages-ab`: the plugin with the kernels' large outputs on huge pages and on 4 KiB
# pages, whatever they choose here (JAX_ATTN_CPU_HUGE_OUTPUT, jax_attn/cpu/csrc/output_memory.h).
OUTPUT_PEERS = ("jax-attn-plugin-huge-out", "jax-attn-plugin-4k-out")
PEER_ENV = {
    "jax-attn-plugin": {"JAX_ATTN_VLLM": "1"},
    "jax-attn-plugin-4k": {"JAX_ATTN_VLLM": "1", "JAX_ATTN_VLLM_HUGE_PAGES": "0"},
    "vllm-cpu-attn-thp": {"THP_MEM_ALLOC_ENABLE": "1"},
    "vllm-cpu-attn-keep": KEEP_FREED,
    "jax-attn-plugin-keep": {"JAX_ATTN_VLLM": "1", **KEEP_FREED},
    "jax-attn-plugin-huge-out": {"JAX_ATTN_VLLM": "1", "JAX_ATTN_CPU_HUGE_OUTPUT": "1"},
    "jax-attn-plugin-4k-out": {"JAX_ATTN_VLLM": "1", "JAX_ATTN_CPU_HUGE_OUTPUT": "0"},
}
MODEL = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=256,
    intermediate_size=512, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
    hidden_act="silu", tie_word_embeddings=False, torch_dtype="bfloat16",
)  # fmt: skip
FULL = dict(prompts=32, prompt_len=1024, generated=64, block_size=128)
QUICK = dict(prompts=4, prompt_len=256, generated=8, block_size=128)


# ---------------------------------------------------------------------------------------------
# The child: one engine, one peer


def _no_attention_backend():
    """CPU_ATTN with neither attention nor cache writes: the engine's time without attention."""
    from torch_backends import vllm_v1

    class NoAttentionImpl(vllm_v1.NativeCPUAttentionImpl):
        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
            return None

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **k):
            # Zeros, not what the buffer held: vLLM hands over an uninitialized tensor, and the
            # layers after it ran slower on those stray values (denormals, NaNs) than on any
            # attention output (compiled, bf16: 2.67 s a prefill against the plugin's 2.5).
            return output.zero_()

    class NoAttentionBackend(vllm_v1.NativeCPUAttentionBackend):
        @staticmethod
        def get_impl_cls():
            return NoAttentionImpl

    return NoAttentionBackend


# The child's module-level name for the no-attention backend (vLLM resolves it by path).
NoAttentionBackend = None


def _child(args: argparse.Namespace) -> None:
    global NoAttentionBackend
    if args.child == "no-attention":
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        NoAttentionBackend = _no_attention_backend()
        register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.NoAttentionBackend")
    import numpy as np
    from vllm import LLM, SamplingParams

    size = json.loads(args.size)
    speculative = _speculative_config(args.speculative)
    llm = LLM(model=args.model, dtype=args.dtype, load_format="dummy", skip_tokenizer_init=True,
              block_size=size["block_size"], enable_prefix_caching=False,
              enforce_eager=not args.compiled, speculative_config=speculative,
              disable_log_stats=speculative is None,  # the draft counters are statistics
              max_model_len=size["prompt_len"] + size["generated"] + 8, seed=0)  # fmt: skip
    impl = llm.apply_model(lambda m: sorted({type(x.impl).__name__ for x in m.modules()
                                             if hasattr(x, "impl")}))[0]  # fmt: skip
    rng = np.random.default_rng(0)

    def prompts(n):
        return [{"prompt_token_ids": rng.integers(100, 30000, size["prompt_len"]).tolist()}
                for _ in range(n)]  # fmt: skip

    def timed(batch, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return seconds, sum(len(o.outputs[0].token_ids) for o in outs)

    timed(prompts(size["prompts"]), 2)  # warm-up at full size (the module docstring)
    prefill, _ = timed(prompts(size["prompts"]), 1)
    before = draft_counters(llm) if speculative else None
    whole, generated = timed(prompts(size["prompts"]), size["generated"])
    result = dict(impl=impl, prefill_s=prefill, whole_s=whole, generated=generated)
    if speculative:
        after = draft_counters(llm)
        result["drafts"] = {name: after[name] - before[name] for name in after}
    print("RESULT " + json.dumps(result), flush=True)


def _speculative_config(tokens: int | None) -> dict | None:
    """`--speculative N`'s speculative decoding: N draft tokens a step by n-gram lookup."""
    if not tokens:
        return None
    return dict(method="ngram", num_speculative_tokens=tokens, prompt_lookup_min=1,
                prompt_lookup_max=3)  # fmt: skip


DRAFT_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}


def draft_counters(llm) -> dict:
    """vLLM's speculative-decoding counters over the engine's life so far (its statistics:
    the engine must be made with `disable_log_stats=False`). Also read by the engine test's
    runner (tests/torch/vllm_v1_engine_run.py)."""
    counters = dict.fromkeys(DRAFT_COUNTERS.values(), 0)
    for metric in llm.get_metrics():
        if metric.name in DRAFT_COUNTERS:
            counters[DRAFT_COUNTERS[metric.name]] += int(metric.value)
    return counters


# ---------------------------------------------------------------------------------------------
# The parent: rounds, medians, the record


def _run_child(
    peer: str, model: str, dtype: str, size: dict, compiled: bool, speculative: int | None = None
) -> dict:
    env = dict(os.environ)
    for name in {name for switches in PEER_ENV.values() for name in switches}:
        env.pop(name, None)  # the caller's own settings reach no child
    env.update(PEER_ENV.get(peer, {}))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind")
    # Started beside the model, with no checkout on its path: vLLM finds the plugin through the
    # installed package's entry point (a stale `jax_attn.egg-info` in a checkout would hide it).
    env.pop("PYTHONPATH", None)
    cmd = [sys.executable, "-m", "benchmarks.engine_v1", "--child", peer, "--model", model,
           "--dtype", dtype, "--size", json.dumps(size)] + ["--compiled"] * compiled  # fmt: skip
    if speculative:
        cmd += ["--speculative", str(speculative)]
    proc = subprocess.run(cmd, env=env, cwd=model, capture_output=True, text=True, timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{peer} ({dtype}) failed:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


EXPECTED_IMPL = {
    "vllm-cpu-attn": ["CPUAttentionBackendImpl"],
    "jax-attn-plugin": ["NativeCPUAttentionImpl"],
    "no-attention": ["NoAttentionImpl"],
    "jax-attn-plugin-4k": ["NativeCPUAttentionImpl"],
    "vllm-cpu-attn-thp": ["CPUAttentionBackendImpl"],
    "vllm-cpu-attn-keep": ["CPUAttentionBackendImpl"],
    "jax-attn-plugin-keep": ["NativeCPUAttentionImpl"],
    "jax-attn-plugin-huge-out": ["NativeCPUAttentionImpl"],
    "jax-attn-plugin-4k-out": ["NativeCPUAttentionImpl"],
}


def _dtypes(text: str | None) -> list[str] | str:
    """`--dtypes`: the names it lists (every one of DTYPES when not given), or why not."""
    if text is None:
        return list(DTYPES)
    names = text.split(",")
    unknown = [n for n in names if n not in DTYPES]
    if unknown or len(set(names)) != len(names):
        wrong = ", ".join(map(repr, unknown)) or "repeats"
        return (f"--dtypes {text!r}: a comma-separated list of distinct names from "
                f"{', '.join(DTYPES)} (not {wrong})")  # fmt: skip
    return names


def run(args: argparse.Namespace) -> int:
    dtypes = _dtypes(getattr(args, "dtypes", None))
    if isinstance(dtypes, str):
        print(dtypes)
        return 2
    speculative = getattr(args, "speculative", None)
    if speculative is not None and speculative < 1:
        print(f"--speculative {speculative}: the number of draft tokens a step, at least 1")
        return 2
    size = QUICK if args.quick else FULL
    rounds = args.reps or (1 if args.quick else 3)
    compiled = getattr(args, "compiled", False)
    peers = PEERS + (PAGE_PEERS if getattr(args, "huge_pages_ab", False) else ())
    peers += KEEP_PEERS if getattr(args, "keep_freed_ab", False) else ()
    peers += OUTPUT_PEERS if getattr(args, "output_pages_ab", False) else ()
    record = dict(
        cpu=_cpu_model(), cores=os.cpu_count(), date=datetime.datetime.now().isoformat(),
        size=size, rounds=rounds, model=MODEL, peers=peers, load_before=os.getloadavg(),
        mode="compiled" if compiled else "eager",
        speculative=_speculative_config(speculative),
        results={},
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as model:
        Path(model, "config.json").write_text(json.dumps(MODEL))
        for dtype in dtypes:
            runs = {peer: [] for peer in peers}
            for r in range(rounds):
                order = peers[r % len(peers) :] + peers[: r % len(peers)]
                for peer in order:
                    result = _run_child(peer, model, dtype, size, compiled, speculative)
                    if result["impl"] != EXPECTED_IMPL[peer]:
                        raise RuntimeError(f"{peer}: the layers hold {result['impl']}")
                    runs[peer].append(result)
                    print(f"{dtype} round {r} {peer}: prefill {result['prefill_s']:.2f} s, "
                          f"whole {result['whole_s']:.2f} s", flush=True)  # fmt: skip
            record["results"][dtype] = _summary(runs, size)
    record["load_after"] = os.getloadavg()
    _print(record)
    if getattr(args, "json", None):
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 0


def _summary(runs: dict, size: dict) -> dict:
    prompt_tokens = size["prompts"] * size["prompt_len"]
    out = {}
    for peer, results in runs.items():
        prefill = statistics.median(prompt_tokens / r["prefill_s"] for r in results)
        whole = statistics.median((prompt_tokens + r["generated"]) / r["whole_s"] for r in results)
        generation = statistics.median(
            r["generated"] / (r["whole_s"] - r["prefill_s"]) for r in results
        )
        out[peer] = dict(prefill_tok_s=prefill, whole_tok_s=whole, generation_tok_s=generation,
                         rounds=results)  # fmt: skip
    own = out["vllm-cpu-attn"]
    for peer in (p for p in out if p != "vllm-cpu-attn"):
        for part in ("prefill", "whole", "generation"):
            out[peer][f"{part}_speedup"] = out[peer][f"{part}_tok_s"] / own[f"{part}_tok_s"]
    return out


def _print(record: dict) -> None:
    speculative = record.get("speculative")
    drafting = (f", {speculative['num_speculative_tokens']} draft tokens a step "
                f"({speculative['method']})" if speculative else "")  # fmt: skip
    print(f"\n{record['cpu']}, {record['cores']} cores, {record['date'][:16]}, "
          f"{record.get('mode', 'eager')}{drafting}, {record['rounds']} rounds (medians), "
          f"load {record['load_before']}")  # fmt: skip
    for dtype, peers in record["results"].items():
        for peer, r in peers.items():
            ratio = (f"  {r['prefill_speedup']:.2f}x / {r['whole_speedup']:.2f}x / "
                     f"{r['generation_speedup']:.2f}x vs vllm"
                     if "prefill_speedup" in r else "")  # fmt: skip
            drafts = [x["drafts"] for x in r["rounds"] if "drafts" in x]
            accepted = (f"  drafts accepted {sum(d['accepted_tokens'] for d in drafts)} of "
                        f"{sum(d['draft_tokens'] for d in drafts)}" if drafts else "")  # fmt: skip
            print(f"  {dtype:9} {peer:20} prefill {r['prefill_tok_s']:8.0f} tok/s  "
                  f"whole {r['whole_tok_s']:8.0f} tok/s  generation "
                  f"{r['generation_tok_s']:7.0f} tok/s{ratio}{accepted}")  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", choices=PEERS + PAGE_PEERS + KEEP_PEERS + OUTPUT_PEERS)
    parser.add_argument("--huge-pages-ab", action="store_true")
    parser.add_argument("--keep-freed-ab", action="store_true")
    parser.add_argument("--output-pages-ab", action="store_true")
    parser.add_argument("--model")
    parser.add_argument("--dtype")
    parser.add_argument("--size")
    parser.add_argument("--rounds", dest="reps", type=int)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--dtypes")
    parser.add_argument("--speculative", type=int)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.child:
        _child(args)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())

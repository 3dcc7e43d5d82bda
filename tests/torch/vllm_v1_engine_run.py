"""Runs vLLM 0.32's engine over a list of runs and writes what it generated, for
test_vllm_v1_engine.py (which starts this twice, with and without JAX_ATTN_VLLM=1).

    python vllm_v1_engine_run.py SPEC.json OUT.json

SPEC: {"runs": [{"name", "model", "dtype", "engine": {LLM keywords}, "rounds": [[prompt token
ids, ...], ...], "max_tokens", "scored": [token ids, ...] (optional)}]}; each round is one
`generate` call, after the previous one (a later round can hit the prefix cache an earlier one
filled). OUT: per run, the attention impls the model's layers hold (class path, sliding
window), per request the greedy tokens, their logprobs, the runner-up's logprobs and the prompt
tokens served from the prefix cache; and, teacher-forced, the logprob of every token of each
`scored` sequence after the first given the ones before it (one `generate` call with
`prompt_logprobs`, after the rounds).

A run whose engine has a `speculative_config` (speculative decoding: a draft model or n-gram
proposals, verified `num_speculative_tokens + 1` tokens a step) also records vLLM's
speculative-decoding counters over its rounds (drafts, draft tokens, accepted tokens) and the
impl of every attention layer the worker holds, a draft model's among them.

A run with `"embed": true` is an encoder-only embedding model (vLLM's pooling runner, its own
tokenizer saved beside it): each round is one `embed` call, and OUT has per request its
embedding instead of tokens.

A run with `"audio": {"seed", "seconds": [...]}` is an encoder/decoder model (Whisper, its
processor saved beside it): each round's prompts are decoder prompts, each paired with the next
clip of random 16 kHz audio of the given lengths (drawn from the seed, the same clips in either
process).
"""

import gc
import json
import sys

SAMPLE_RATE = 16000  # Hz: Whisper's feature extractor's


def _layers(model) -> list:
    from vllm.model_executor.layers.attention import Attention

    return [m for m in model.modules() if isinstance(m, Attention)]


def _impl_path(impl) -> str:
    """The backend's impl class: cross-attention layers hold a subclass vLLM defines inside a
    function (`create_cross_attention_backend`) over the backend's own."""
    cls = next(c for c in type(impl).__mro__ if "<locals>" not in c.__qualname__)
    return f"{cls.__module__}.{cls.__name__}"


def _impls(model):
    return sorted({(_impl_path(m.impl), m.impl.sliding_window) for m in _layers(model)}, key=str)


def _attn_types(model):
    return sorted({m.attn_type.value for m in _layers(model)})


def _heads(model):
    """The query and kv heads each of a worker's attention impls attends (its tensor-parallel
    share of the model's)."""
    return sorted({(m.impl.num_heads, m.impl.num_kv_heads) for m in _layers(model)})


def _layer_facts(llm) -> dict:
    """What the first worker's attention layers hold (impl classes and their attention types),
    and per worker its impls and their heads (one worker unless tensor-parallel)."""
    impls, heads = llm.apply_model(_impls), llm.apply_model(_heads)
    return {
        "impls": impls[0],
        "attn_types": llm.apply_model(_attn_types)[0],
        "workers": [{"impls": i, "heads": h} for i, h in zip(impls, heads, strict=True)],
    }


def _all_impls(worker) -> list:
    """Every attention layer the worker's runner holds (a draft model's too), by name: its
    impl class."""
    context = worker.model_runner.compilation_config.static_forward_context
    return sorted((name, _impl_path(layer.impl)) for name, layer in context.items()
                  if hasattr(layer, "impl"))  # fmt: skip


def _clips(run: dict):
    """The audio run's clips, in the order its requests take them; none for a text model."""
    if "audio" not in run:
        return iter(())
    import numpy as np

    rng = np.random.default_rng(run["audio"]["seed"])
    return iter([0.1 * rng.standard_normal(SAMPLE_RATE * s).astype(np.float32)
                 for s in run["audio"]["seconds"]])  # fmt: skip


def _prompts(run: dict, prompts: list, clips) -> list:
    if "audio" not in run:
        return [{"prompt_token_ids": p} for p in prompts]
    return [
        {
            "encoder_prompt": {
                "prompt": "",
                "multi_modal_data": {"audio": (next(clips), SAMPLE_RATE)},
            },
            "decoder_prompt": {"prompt_token_ids": p},
        }
        for p in prompts
    ]


def _embed(run: dict) -> dict:
    from vllm import LLM

    llm = LLM(model=run["model"], dtype=run["dtype"], runner="pooling", seed=0, enforce_eager=True,
              **run["engine"])  # fmt: skip
    result = _layer_facts(llm)
    result["rounds"] = [
        [{"embedding": list(out.outputs.embedding)} for out in
         llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)]
        for prompts in run["rounds"]
    ]  # fmt: skip
    del llm
    gc.collect()
    return result


def _run(run: dict) -> dict:
    from vllm import LLM, SamplingParams

    if run.get("embed"):
        return _embed(run)
    speculative = "speculative_config" in run["engine"]
    # Whisper's processor (its tokenizer among them) shapes the audio prompts. The counters of
    # speculative decoding come through the engine's statistics.
    llm = LLM(model=run["model"], dtype=run["dtype"], skip_tokenizer_init="audio" not in run,
              seed=0, enforce_eager=True, disable_log_stats=not speculative,
              **run["engine"])  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=run["max_tokens"], logprobs=2)
    result = _layer_facts(llm)
    if speculative:
        result["all_impls"] = llm.collective_rpc(_all_impls)[0]
    rounds, clips = [], _clips(run)
    for prompts in run["rounds"]:
        outs = llm.generate(_prompts(run, prompts, clips), params, use_tqdm=False)
        requests = []
        for out in outs:
            completion = out.outputs[0]
            chosen, runner_up = [], []
            for token, logprobs in zip(completion.token_ids, completion.logprobs, strict=True):
                chosen.append(logprobs[token].logprob)
                others = [lp.logprob for t, lp in logprobs.items() if t != token]
                runner_up.append(max(others) if others else None)
            requests.append(
                {
                    "tokens": list(completion.token_ids),
                    "logprobs": chosen,
                    "runner_up": runner_up,
                    "cached_tokens": out.num_cached_tokens or 0,
                }
            )
        rounds.append(requests)
    result["rounds"] = rounds
    if speculative:
        from benchmarks.engine_v1 import draft_counters  # the installed package's

        result["speculative"] = draft_counters(llm)
    if run.get("scored"):
        result["scored"] = _score(llm, run["scored"])
    del llm
    gc.collect()
    return result


def _score(llm, sequences: list) -> list:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    return [
        [lps[token].logprob for token, lps in zip(seq[1:], out.prompt_logprobs[1:], strict=True)]
        for seq, out in zip(sequences, outs, strict=True)
    ]


def main() -> None:
    spec_path, out_path = sys.argv[1:3]
    with open(spec_path) as f:
        spec = json.load(f)
    out = {run["name"]: _run(run) for run in spec["runs"]}
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()

"""Run vLLM 0.8.5's own V0 engine (`vllm.LLM`, CPU) on tiny random-weight models, with its
attention backend optionally replaced by any class named by a qualname.

Nothing here downloads: each model is a `transformers` model built from a small config with
random weights and saved in float32 safetensors next to a word-level tokenizer built with the
`tokenizers` library, in a local directory that `vllm.LLM(model=dir)` loads like any checkpoint.

    model = build_model("llama", tmp_dir, seed=0)
    ref = generate(model, model.prompts, max_tokens=8)                    # vLLM's own backend
    ours = generate(model, model.prompts, max_tokens=8,
                    backend="torch_backends.torch_sdpa.TorchSDPABackend")

How the backend is replaced. vLLM 0.8.5 asks the platform which class to use: every
`Attention` layer, the CPU model runners and the CPU worker call
`vllm.attention.selector.get_attn_backend`, which calls
`current_platform.get_attn_backend_cls(...)` (`CpuPlatform`: always vLLM's TORCH_SDPA) and
imports the qualname it returns. `attention_backend(qualname)` swaps that classmethod for one
returning our qualname, and clears the selector's `functools.cache` on entry and exit so no
class chosen outside the block leaks in or out. This works because the V0 engine runs the
model in this process: with `VLLM_USE_V1=0` and one worker, the executor (vLLM's CPU platform
turns the `"uni"` executor into `"mp"`, which for a world size of 1 starts no process) keeps its
driver worker here, so the patched class is what the worker sees. `engine` checks that the
model runner really holds the requested class before any output is trusted.

vLLM is imported only inside the functions: this module is imported at collection in every
environment, and the main environment has no vLLM.
"""

import contextlib
import gc
import importlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# vLLM's own CPU backend, named explicitly: passing it as the replacement exercises the same
# substitution path as the project's backends.
VLLM_TORCH_SDPA = "vllm.attention.backends.torch_sdpa.TorchSDPABackend"

# Set before vLLM is imported (its `envs` reads them lazily, but the engine reads some early).
ENGINE_ENV = {
    "VLLM_USE_V1": "0",  # the V0 engine: the one whose backends this project mirrors
    "HF_HUB_OFFLINE": "1",  # never download: every model is a local directory
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache (default 4); tiny models need little
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_LEVEL": "WARNING",  # vLLM logs every engine start at INFO
}

# Engine settings shared by every run. float32 so that backends can be compared tightly;
# block_size 16 is the only size vLLM 0.8.5's CPU platform accepts without IPEX.
ENGINE_DEFAULTS = dict(
    dtype="float32",
    device="cpu",
    enforce_eager=True,
    block_size=16,
    swap_space=0,
    seed=0,
    max_model_len=256,
    max_num_seqs=8,
    disable_log_stats=True,
)

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
VOCAB_SIZE = 512


def set_engine_env() -> None:
    for name, value in ENGINE_ENV.items():
        os.environ.setdefault(name, value)


@dataclass(frozen=True)
class TinyModel:
    """A saved random-weight model and the prompts its tests use."""

    name: str  # "llama" | "mistral_window" | "bart" | "bert"
    path: Path
    task: str  # vLLM's task: "generate" or "embed"
    prompts: tuple[str, ...]
    sliding_window: int | None = None
    # prompts sharing a prefix of whole blocks with the last prompt (prefix-caching hits)
    prefix_prompts: tuple[str, ...] = ()
    engine_kwargs: dict = field(default_factory=dict)  # model-specific LLM(...) settings


# ---------------------------------------------------------------------------------------------
# Models


def save_tokenizer(
    path: Path, vocab_size: int = VOCAB_SIZE, max_len: int = ENGINE_DEFAULTS["max_model_len"]
) -> None:
    """A word-level tokenizer: the words `w4 .. w{vocab_size-1}` are one token each, whitespace
    separated, after 4 special tokens. No post-processor: a prompt of n words is n tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab |= {f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=max_len,
    )
    fast.save_pretrained(path)


def random_prompts(rng: np.random.Generator, lengths: Sequence[int]) -> tuple[str, ...]:
    # Ordinary words only (never a special token), so each prompt is exactly `n` tokens.
    return tuple(
        " ".join(f"w{i}" for i in rng.integers(len(SPECIAL_TOKENS), VOCAB_SIZE, n)) for n in lengths
    )


def _save(model, path: Path, max_len: int = ENGINE_DEFAULTS["max_model_len"]) -> None:
    import torch

    model.to(dtype=torch.float32).save_pretrained(path, safe_serialization=True)
    save_tokenizer(path, max_len=max_len)


def _drop_zero_tensor(file: Path, name: str) -> None:
    """Remove an all-zero tensor from a safetensors file. vLLM 0.8.5's BART has no
    `final_logits_bias` (its loader raises KeyError on it); transformers saves it, as zeros, so
    leaving it out changes nothing the model computes."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    assert not tensors[name].any(), f"{name} is not zero: dropping it would change the model"
    del tensors[name]
    save_file(tensors, file, metadata={"format": "pt"})


def build_model(name: str, root: Path, *, seed: int) -> TinyModel:
    """Build, save and describe one tiny model. `root / name` holds the checkpoint.

    Weights are drawn with a larger spread than transformers' default (`initializer_range`
    0.02 makes every logit nearly equal, so greedy choices would hinge on rounding); with 0.1
    the top-2 logprob gap is usually well above any backend difference.
    """
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    path = root / name
    common = dict(
        vocab_size=VOCAB_SIZE,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        torch_dtype="float32",
        initializer_range=0.1,
    )
    if name in ("llama", "mistral_window"):
        # GQA 4 query / 2 kv heads, head_size 64 (one of vLLM's CPU paged-attention sizes).
        decoder = dict(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=ENGINE_DEFAULTS["max_model_len"],
            tie_word_embeddings=False,
            **common,
        )
        if name == "llama":
            model = tf.LlamaForCausalLM(tf.LlamaConfig(**decoder))
            window, lengths = None, (5, 17, 33, 40)
        else:
            # A window of 12: smaller than every prompt, and not a multiple of the block size,
            # so vLLM's own decode (whole blocks from the window's first block) sees extra keys.
            window, lengths = 12, (20, 29, 37)
            model = tf.MistralForCausalLM(tf.MistralConfig(sliding_window=window, **decoder))
        _save(model, path)
        prompts = random_prompts(rng, lengths)
        # 34 words of the last prompt (2 whole blocks of 16 and 2 more) and fresh tails.
        prefix = " ".join(prompts[-1].split()[:34])
        tails = random_prompts(rng, (3, 10))
        return TinyModel(
            name,
            path,
            "generate",
            prompts,
            window,
            prefix_prompts=tuple(f"{prefix} {tail}" for tail in tails) if window is None else (),
        )
    if name == "bart":
        # d_model 128 over 2 heads: head_size 64. vLLM's BART needs tied embeddings.
        config = tf.BartConfig(
            d_model=128,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=256,
            decoder_ffn_dim=256,
            max_position_embeddings=ENGINE_DEFAULTS["max_model_len"],
            decoder_start_token_id=EOS_ID,
            forced_bos_token_id=None,
            forced_eos_token_id=None,
            tie_word_embeddings=True,
            init_std=0.1,
            **{k: v for k, v in common.items() if k != "initializer_range"},
        )
        _save(tf.BartForConditionalGeneration(config), path)
        _drop_zero_tensor(path / "model.safetensors", "final_logits_bias")
        return TinyModel(name, path, "generate", random_prompts(rng, (7, 19, 26)))
    if name == "bert":
        config = tf.BertConfig(
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,  # head_size 64
            intermediate_size=256,
            max_position_embeddings=ENGINE_DEFAULTS["max_model_len"],
            **{k: v for k, v in common.items() if k not in ("bos_token_id", "eos_token_id")},
        )
        _save(tf.BertModel(config, add_pooling_layer=False), path)
        # Every token's final hidden state (pooling "ALL", not normalized): each output row
        # depends on the attention of its own token, a closer check than one pooled vector.
        return TinyModel(
            name,
            path,
            "embed",
            random_prompts(rng, (3, 16, 30)),
            engine_kwargs={"pooler": {"pooling_type": "ALL", "normalize": False}},
        )
    raise ValueError(f"{name=} is not one of 'llama', 'mistral_window', 'bart', 'bert'")


# ---------------------------------------------------------------------------------------------
# Engine


@contextlib.contextmanager
def attention_backend(qualname: str | None) -> Iterator[None]:
    """Make vLLM's CPU platform pick `qualname` for every attention layer built in the block
    (None: leave vLLM's own choice)."""
    if qualname is None:
        yield
        return
    from vllm.attention import selector
    from vllm.platforms.cpu import CpuPlatform

    resolve(qualname)  # fail here, clearly, if it does not import
    original = CpuPlatform.__dict__["get_attn_backend_cls"]

    def get_attn_backend_cls(cls, *args, **kwargs) -> str:
        # Same signature as vLLM's: (selected_backend, head_size, dtype, kv_cache_dtype,
        # block_size, use_v1, use_mla). MLA models (none here) keep vLLM's own answer.
        use_mla = kwargs["use_mla"] if "use_mla" in kwargs else args[6]
        return original.__func__(cls, *args, **kwargs) if use_mla else qualname

    selector._cached_get_attn_backend.cache_clear()
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    try:
        yield
    finally:
        CpuPlatform.get_attn_backend_cls = original
        selector._cached_get_attn_backend.cache_clear()


def resolve(qualname: str):
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)


@contextlib.contextmanager
def engine(model: TinyModel, backend: str | None = None, **overrides) -> Iterator:
    """A `vllm.LLM` for `model` whose attention runs `backend` (a qualname; None: vLLM's own),
    torn down on exit so the next engine in this process starts clean."""
    set_engine_env()
    import vllm
    from vllm.config import PoolerConfig
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    kwargs = ENGINE_DEFAULTS | {"task": model.task} | overrides
    if "pooler" in model.engine_kwargs:
        kwargs["override_pooler_config"] = PoolerConfig(**model.engine_kwargs["pooler"])
    llm = None
    try:
        with attention_backend(backend):
            llm = vllm.LLM(model=str(model.path), **kwargs)
            runner = llm.llm_engine.model_executor.driver_worker.model_runner
            wanted = resolve(backend or VLLM_TORCH_SDPA)
            if runner.attn_backend is not wanted:
                raise AssertionError(
                    f"the engine runs {runner.attn_backend}, not the requested {wanted}"
                )
            yield llm
    finally:
        del llm
        cleanup_dist_env_and_memory()
        gc.collect()


@dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]
    # per generated token: {token id: logprob} for the top-k and the chosen token
    logprobs: tuple[dict[int, float], ...]


def generate(
    model: TinyModel,
    prompts: Sequence[str] | Sequence[Sequence[str]],
    *,
    max_tokens: int = 8,
    logprobs: int = 5,
    backend: str | None = None,
    **engine_kwargs,
) -> list[list[Completion]]:
    """Greedy generation (temperature 0). `prompts` is one batch of strings, or a list of
    batches run one `generate` call after another on the same engine (what prefix caching
    needs to find cached blocks). Returns one list of completions per batch."""
    from vllm import SamplingParams

    batches = [prompts] if isinstance(prompts[0], str) else prompts
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=True
    )
    out = []
    with engine(model, backend, **engine_kwargs) as llm:
        for batch in batches:
            results = llm.generate(list(batch), params, use_tqdm=False)
            out.append([_completion(r.outputs[0]) for r in results])
    return out


def _completion(seq) -> Completion:
    return Completion(
        tuple(seq.token_ids),
        tuple({t: lp.logprob for t, lp in step.items()} for step in seq.logprobs),
    )


def encode(model: TinyModel, prompts: Sequence[str], *, backend: str | None = None):
    """Per-token final hidden states (`LLM.encode`, pooling "ALL"): one [n, hidden] array per
    prompt."""
    with engine(model, backend) as llm:
        results = llm.encode(list(prompts), use_tqdm=False)
        return [r.outputs.data.detach().to("cpu").double().numpy() for r in results]


# ---------------------------------------------------------------------------------------------
# Exact reference: the same saved model in transformers, float64, no KV cache


def hf_greedy(model: TinyModel, prompts: Sequence[str], *, max_tokens: int, logprobs: int = 5):
    """Greedy generation by full float64 forwards of the saved checkpoint in `transformers`
    (eager attention, the exact mask: causal and, for Mistral, the sliding window applied to
    every query at every step). No KV cache, so nothing is trimmed to blocks."""
    import torch
    import transformers as tf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model.path)
    hf = tf.AutoModelForCausalLM.from_pretrained(
        model.path, torch_dtype=torch.float64, attn_implementation="eager"
    ).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            gen, steps = [], []
            for _ in range(max_tokens):
                x = torch.tensor([ids + gen])
                lp = torch.log_softmax(hf(x).logits[0, -1], dim=-1)
                top = torch.topk(lp, logprobs)
                chosen = int(top.indices[0])
                steps.append(
                    {int(t): float(v) for t, v in zip(top.indices, top.values, strict=True)}
                )
                gen.append(chosen)
            out.append(Completion(tuple(gen), tuple(steps)))
    return out


# ---------------------------------------------------------------------------------------------
# Comparison


def compare_greedy(
    expected: Sequence[Completion],
    actual: Sequence[Completion],
    *,
    atol: float,
    label: str = "",
    min_tokens: int | None = None,
) -> dict:
    """Greedy tokens equal and the chosen tokens' logprobs within `atol`, per prompt.

    One divergence is allowed only where it is a near-tie, as in vLLM's own
    `check_logprobs_close`: at the first differing step each side's token must be in the other's
    top-k and the two candidates' logprobs, on both sides, within `atol` of each other. After it
    the continuations are different texts, so comparison stops there.
    At least `min_tokens` tokens must be compared (default: half the expected tokens, and never
    fewer than one): empty completions, or a near-tie at every prompt's first step, compare
    nothing and prove nothing.
    Returns {"tokens": compared tokens, "max_logprob_diff": float, "near_ties": int}.
    """
    assert len(expected) == len(actual), (label, len(expected), len(actual))
    tokens, worst, ties = 0, 0.0, 0
    for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
        where = f"{label} prompt {i}"
        for step, (te, ta) in enumerate(zip(e.token_ids, a.token_ids, strict=True)):
            le, la = e.logprobs[step], a.logprobs[step]
            if te != ta:
                if ta not in le or te not in la:
                    raise AssertionError(
                        f"{where}: step {step} chose {ta}, expected {te}; not a near-tie "
                        f"(expected top-k {le}, actual top-k {la})"
                    )
                gap = max(abs(le[te] - le[ta]), abs(la[te] - la[ta]))
                if gap > atol:
                    raise AssertionError(
                        f"{where}: step {step} chose {ta}, expected {te}; logprob gap {gap:.3g} "
                        f"> {atol} (expected {le}, actual {la}); tokens so far "
                        f"{e.token_ids[:step]}"
                    )
                ties += 1
                break
            diff = abs(le[te] - la[ta])
            worst = max(worst, diff)
            if diff > atol:
                raise AssertionError(
                    f"{where}: step {step} token {te}: logprob {la[ta]:.8f} vs expected "
                    f"{le[te]:.8f} (|diff| {diff:.3g} > {atol})"
                )
            tokens += 1
    if min_tokens is None:
        min_tokens = max(1, sum(len(e.token_ids) for e in expected) // 2)
    if tokens < min_tokens:
        raise AssertionError(
            f"{label}: compared {tokens} tokens, fewer than {min_tokens=} ({ties} near-ties "
            f"over {len(expected)} prompts)"
        )
    return {"tokens": tokens, "max_logprob_diff": worst, "near_ties": ties}


# One line per comparison made in this process, for the terminal summary (conftest.py).
FIGURES: list[str] = []


def record(what: str, figures: dict) -> None:
    FIGURES.append(f"{what}: {json.dumps(figures, default=float)}")

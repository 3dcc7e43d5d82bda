"""vLLM 0.32's engine with and without the plugin (JAX_ATTN_VLLM=1), on saved random-weight
tiny models (the vllm env; test_vllm_v1_plugin.py has the pieces without an engine).

Each side is one child process (vllm_v1_engine_run.py) started from a scratch directory with
the checkout off its path, so vLLM finds the plugin through the installed entry point as a user's
environment would, and runs these engines in turn (in-process engine core, one thread pool):

    llama-f32   block 32, prefix caching on, a step budget of 64 tokens: a 7-token prompt
                (plain), a 150-token one (chunked prefill, mixed with the others' decodes),
                then a prompt sharing its first 96 tokens (three cached blocks)
    window-f32  the same with a 24-token sliding window (Mistral), prompts of 60 and 100
    llama-bf16  round one of llama-f32 in bfloat16
    llama-fp8, llama-fp8-e5m2
                llama-f32's teacher-forced sequences in float32 over an e4m3 / e5m2 cache
    head512-f32 round one on a Llama with head size 512
    sinks-f32   round one on a gpt-oss (attention sinks, a 16-token window in every other
                layer, 4 experts)
    bert-f32    an encoder-only embedding model (BERT, vLLM's pooling runner): prompts of 1 to
                150 tokens in one step, attended non-causally, the keys read from the step's
                own fused qkv projection
    whisper-f32 an encoder/decoder model (Whisper, block 32): three clips of random audio with
                decoder prompts of 4 to 20 tokens in one step, then another clip alone with the
                first one's decoder prompt (what it generates tells the clips apart). Its decoder
                layers' cross-attention (ENCODER_DECODER) writes the encoder's 1500 keys into
                the layer's cache in a request's first step and attends over them without the
                causal mask in every step; the encoder's own self-attention is vLLM's
                multimodal encoder attention, not a CPU_ATTN layer
    spec-draft-f32, spec-ngram-f32
                round one of llama-f32 with speculative decoding, 3 draft tokens a step: drafted
                by the model itself (vLLM's draft-model method; its layers use the backend too)
                or by n-gram lookup (prompts that repeat), each step verifying every request's
                drafts as 4 new tokens over its cache
    llama-tp2-f32
                round one of llama-f32 on two tensor-parallel workers (vLLM's multiprocessing
                executor, each bound to a CPU of its own), in a child process of its own

float32 embeddings (normalized, pooled as vLLM pools BERT's; every key of a prompt reaches
them): within 1e-5 of vLLM's own in every element, where a causal mask in place of the
encoder's moves them by ~0.2.

float32: greedy tokens identical and logprobs within 1e-4 (a near tie, runner-up within 1e-4
in vLLM's own run, may end the comparison there), generated and teacher-forced (each round-one
prompt followed by 12 fixed tokens, scored through `prompt_logprobs`).

bfloat16 is judged against vLLM's own float32 run, teacher-forced, because an engine's logprobs
are not an attention output: they come through bf16 linear layers, norms and the sampler's
log-softmax, so the attention rule (`interop.tolerances`, which bounds one attention's output)
does not bound them. vLLM's own bf16 run strays from its f32 run by up to 0.19-0.34 in a
logprob (RMS 0.06-0.075; 7 seeds, 230 positions each), and the old bound (the attention rule
applied to a logprob: 0.05 at -0.7) failed at seed 996495217, where the plugin's and vLLM's
bf16 generated logprobs differed by 0.062. So:
- teacher-forced, per position, each bf16 run's distance from the f32 reference: the plugin's
  RMS within 1.25x vLLM's own (measured 0.93-1.06x) and its largest within 2x vLLM's largest
  (0.93-1.24x). A softmax scale off by 3% fails (RMS 1.31x).
- generated (the decode steps, where both runs see the same tokens until they part): tokens
  identical up to a near tie, logprobs within 2.5x the largest teacher-forced difference
  between the plugin's bf16 and vLLM's (the same two kernels' rounding, propagated; measured
  0.46-1.19x it). A decode that drops the query's own key fails (3.4x and 7.4x at two seeds),
  where vLLM's own distance from f32 as the bound let one of them through.

fp8 caches (llama-fp8 and llama-fp8-e5m2: round one's model in float32 over an e4m3 or e5m2
cache, teacher-forced only) are judged the same way against vLLM's own float32 run. The two
runs store different bytes: the plugin rounds x / scale to the nearest fp8 value, vLLM's write
lands some a step lower (benchmarks/backends.py), so their logprobs part by as much as either
strays from f32 (up to 2.5 apart). Measured over 6 model seeds, 2026-12-05: the plugin's RMS
distance 0.82-1.04x vLLM's own (e4m3) and 0.86-1.08x (e5m2), its largest 0.45-1.88x; hence
1.25x for the RMS. The largest is one position of two runs that round differently: at seed
648430011 (CI, 2026-12-05) the e5m2 run's was 2.55x vLLM's (7.6 against 3.0) with its RMS
within bounds, so the largest is held to 4x, against a blow-up at a position. Keys read at
twice their scale fail the RMS bound (2.5x and 1.7x vLLM's).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# vLLM 0.32 (the vllm env); elsewhere none, or vLLM 0.8.5 (the vllm085 env).
pytest.importorskip("vllm", minversion="0.32", reason="vLLM 0.32 is not installed here")

import torch

from torch_backends import native

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        native.unavailable_reason() is not None,
        reason=f"native torch ops not available: {native.unavailable_reason()}",
    ),
]

RUNNER = Path(__file__).with_name("vllm_v1_engine_run.py")
PLUGIN_IMPL = "torch_backends.vllm_v1.NativeCPUAttentionImpl"
VLLM_IMPL = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl"
VOCAB, WINDOW, MAX_TOKENS, SPEC_MAX_TOKENS = 512, 24, 12, 24
F32_LOGPROB_TOL = 1e-4
F32_EMBEDDING_TOL = 1e-5
BF16_RMS_RATIO, BF16_MAX_RATIO, BF16_GENERATED_RATIO = 1.25, 2.0, 2.5
FP8_RMS_RATIO, FP8_MAX_RATIO = 1.25, 4.0


def _save_model(path: Path, seed: int, **extra) -> str:
    """A random-weight 2-layer model (Hq 4, Hkv 2, D 32), weights wide enough that greedy
    choices are rarely near ties."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kind = "mistral" if "sliding_window" in extra else "llama"
    extra = dict(head_dim=32) | extra
    config = AutoConfig.for_model(
        kind, vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        initializer_range=0.2, **extra,
    )  # fmt: skip
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).float().save_pretrained(path)
    return str(path)


def _save_sinks_model(path: Path, seed: int) -> str:
    """A random-weight 2-layer gpt-oss (Hq 4, Hkv 2, D 64): every layer's attention has sinks
    (drawn wide, N(0, 2), so that they matter), the first a 16-token sliding window."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=16, max_position_embeddings=1024,
        layer_types=["sliding_attention", "full_attention"], initializer_range=0.2,
        architectures=["GptOssForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("self_attn.sinks"):
                p.normal_(0.0, 2.0)
    model.save_pretrained(path)
    return str(path)


def _save_bert(path: Path, seed: int) -> str:
    """A random-weight 2-layer BERT (Hq = Hkv 4, D 32) with a word-level tokenizer of its own
    vocabulary (vLLM's pooling runner loads one), saved as a user's checkpoint would be."""
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=512, initializer_range=0.2,
        architectures=["BertModel"],
    )  # fmt: skip
    torch.manual_seed(seed)
    BertModel(config).float().save_pretrained(path)
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = special + [f"w{i}" for i in range(VOCAB - len(special))]
    (path / "vocab.txt").write_text("\n".join(words) + "\n")
    (path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "BertTokenizer", "model_max_length": 512})
    )
    return str(path)


def _save_whisper(path: Path, seed: int) -> tuple[str, list[int]]:
    """A random-weight 2+2-layer Whisper (Hq = Hkv 4, D 32, 80 mel bins, 1500 encoder positions)
    with a processor of its own: the feature extractor's defaults and a byte-level tokenizer
    whose vocabulary is the 256 bytes and Whisper's task tokens (vLLM's audio prompts go through
    it). Returns the path and a transcription prompt's first tokens (start, English,
    transcribe, no timestamps)."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import (
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
        WhisperTokenizer,
    )

    path.mkdir(parents=True, exist_ok=True)
    end, *tasks = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|translate|>",
                   "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>",
                   "<|notimestamps|>"]  # fmt: skip
    vocab = {t: i for i, t in enumerate([*sorted(ByteLevel.alphabet()), end, *tasks])}
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n")
    config = WhisperConfig(
        vocab_size=len(vocab), num_mel_bins=80, d_model=128, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=256,
        decoder_ffn_dim=256, max_source_positions=1500, max_target_positions=448,
        pad_token_id=vocab[end], bos_token_id=vocab[end], eos_token_id=vocab[end],
        decoder_start_token_id=vocab["<|startoftranscript|>"], init_std=0.2,
    )  # fmt: skip
    torch.manual_seed(seed)
    WhisperForConditionalGeneration(config).float().save_pretrained(path)
    tokenizer = WhisperTokenizer(
        str(path / "vocab.json"), str(path / "merges.txt"),
        unk_token=end, bos_token=end, eos_token=end, pad_token=end,
    )  # fmt: skip
    tokenizer.add_special_tokens({"additional_special_tokens": tasks})
    features = WhisperFeatureExtractor(feature_size=config.num_mel_bins)
    WhisperProcessor(feature_extractor=features, tokenizer=tokenizer).save_pretrained(path)
    start = ["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"]
    return str(path), [vocab[t] for t in start]


def _spec(models: dict, rng: np.random.Generator) -> dict:
    def prompt(n):
        return rng.integers(0, VOCAB, n).tolist()

    def text(n):  # byte tokens after a Whisper transcription prompt's first four
        return models["whisper_start"] + rng.integers(0, 256, n).tolist()

    def repeating(n, period):  # n tokens, a random run of `period` over and over
        return (prompt(period) * (n // period + 1))[:n]

    long, start = prompt(150), text(0)
    round_one = [prompt(7), prompt(40), long]
    round_two = [long[:96] + prompt(20)]
    # Teacher-forced: round one's prompts, each followed by as many tokens as it generates.
    scored = [p + prompt(MAX_TOKENS) for p in round_one]
    engine = dict(block_size=32, max_model_len=512, max_num_batched_tokens=64)
    return {
        "runs": [
            dict(name="llama-f32", model=models["llama"], dtype="float32",
                 engine=engine | dict(enable_prefix_caching=True),
                 rounds=[round_one, round_two], max_tokens=MAX_TOKENS, scored=scored),
            dict(name="window-f32", model=models["window"], dtype="float32",
                 engine=engine | dict(enable_prefix_caching=False),
                 rounds=[[prompt(60), prompt(100)]], max_tokens=MAX_TOKENS),
            dict(name="llama-bf16", model=models["llama"], dtype="bfloat16",
                 engine=engine | dict(enable_prefix_caching=False),
                 rounds=[round_one], max_tokens=MAX_TOKENS, scored=scored),
            dict(name="llama-fp8", model=models["llama"], dtype="float32",
                 engine=engine | dict(enable_prefix_caching=False, kv_cache_dtype="fp8"),
                 rounds=[], scored=scored, max_tokens=MAX_TOKENS),
            dict(name="llama-fp8-e5m2", model=models["llama"], dtype="float32",
                 engine=engine | dict(enable_prefix_caching=False, kv_cache_dtype="fp8_e5m2"),
                 rounds=[], scored=scored, max_tokens=MAX_TOKENS),
            dict(name="head512-f32", model=models["head512"], dtype="float32",
                 engine=engine | dict(enable_prefix_caching=False),
                 rounds=[round_one], max_tokens=MAX_TOKENS),
            dict(name="sinks-f32", model=models["sinks"], dtype="float32",
                 engine=engine | dict(enable_prefix_caching=False),
                 rounds=[round_one], max_tokens=MAX_TOKENS),
            dict(name="spec-draft-f32", model=models["llama"], dtype="float32",
                 engine=engine | dict(enable_prefix_caching=False, speculative_config=dict(
                     method="draft_model", model=models["llama"], num_speculative_tokens=3)),
                 rounds=[round_one], max_tokens=SPEC_MAX_TOKENS),
            dict(name="spec-ngram-f32", model=models["llama"], dtype="float32",
                 engine=engine | dict(enable_prefix_caching=False, speculative_config=dict(
                     method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                     prompt_lookup_max=3)),
                 rounds=[[repeating(30, 5), repeating(45, 7), long]], max_tokens=SPEC_MAX_TOKENS),
            dict(name="bert-f32", model=models["bert"], dtype="float32", embed=True,
                 engine=dict(max_model_len=512), rounds=[[prompt(1), *round_one]]),
            dict(name="whisper-f32", model=models["whisper"], dtype="float32",
                 engine=dict(block_size=32, max_model_len=448, limit_mm_per_prompt={"audio": 1}),
                 audio=dict(seed=int(rng.integers(2**31)), seconds=[3, 7, 12, 5]),
                 rounds=[[start, text(16), text(5)], [start]], max_tokens=MAX_TOKENS),
        ]
    }  # fmt: skip


def _run_engines(spec_path: Path, out_path: Path, plugin: bool, scratch: Path, **more) -> dict:
    """Runs the spec's engines in a child process; `more`: environment variables over the
    defaults below."""
    env = dict(os.environ)
    env.pop("JAX_ATTN_VLLM", None)
    if plugin:
        env["JAX_ATTN_VLLM"] = "1"
    # The checkout off the path: the installed package (its entry point) is what vLLM sees.
    env.pop("PYTHONPATH", None)
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # the engine core in this process: one at a time
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB
        VLLM_CPU_OMP_THREADS_BIND="nobind",  # on a 2-core machine vLLM would keep one core
    )
    env.update(more)
    proc = subprocess.run(
        [sys.executable, str(RUNNER), str(spec_path), str(out_path)],
        cwd=scratch, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, f"engine run (plugin={plugin}) failed:\n{proc.stderr[-6000:]}"
    return json.loads(out_path.read_text())


@pytest.fixture(scope="module")
def engines(tmp_path_factory, run_seed):
    root = tmp_path_factory.mktemp("vllm_v1_engine")
    models = {
        "llama": _save_model(root / "llama", run_seed),
        "window": _save_model(root / "window", run_seed + 1, sliding_window=WINDOW),
        "head512": _save_model(root / "head512", run_seed + 4, head_dim=512),
        "sinks": _save_sinks_model(root / "sinks", run_seed + 2),
        "bert": _save_bert(root / "bert", run_seed + 3),
    }
    models["whisper"], models["whisper_start"] = _save_whisper(root / "whisper", run_seed + 5)
    spec = _spec(models, np.random.default_rng(run_seed))
    assert native.available()  # built once here, not inside either engine run
    # A speculative run in a process of its own: in vLLM 0.32 an engine started after one with
    # speculative decoding, in the same process, fails to start (its CPU platform rebinding
    # the drafter's kernels a second time: "'_lib_fn_wrapper' object has no attribute 'get'"),
    # with either backend.
    speculative = [r for r in spec["runs"] if "speculative_config" in r["engine"]]
    groups = [[r for r in spec["runs"] if r not in speculative]] + [[r] for r in speculative]
    plugin, own = {}, {}
    for i, runs in enumerate(groups):
        spec_path = root / f"spec{i}.json"
        spec_path.write_text(json.dumps({"runs": runs}))
        plugin |= _run_engines(spec_path, root / f"plugin{i}.json", True, root)
        own |= _run_engines(spec_path, root / f"own{i}.json", False, root)
    return plugin, own


@pytest.fixture(scope="module")
def tp_engines(tmp_path_factory, run_seed):
    """llama-f32's round one on two tensor-parallel workers (vLLM's multiprocessing executor),
    each bound to a CPU of its own as vLLM binds them on a CPU server: each worker's layers
    attend half of the model's heads (Hq 2, Hkv 1: MQA within a worker)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"two tensor-parallel workers need 2 CPUs; this process may run on {cpus}")
    root = tmp_path_factory.mktemp("vllm_v1_tp")
    rng = np.random.default_rng(run_seed + 6)
    engine = dict(block_size=32, max_model_len=512, max_num_batched_tokens=64,
                  tensor_parallel_size=2, distributed_executor_backend="mp")  # fmt: skip
    spec = {"runs": [dict(
        name="llama-tp2-f32", model=_save_model(root / "llama", run_seed + 6), dtype="float32",
        engine=engine, rounds=[[rng.integers(0, VOCAB, n).tolist() for n in (7, 40, 150)]],
        max_tokens=MAX_TOKENS,
    )]}  # fmt: skip
    spec_path = root / "spec.json"
    spec_path.write_text(json.dumps(spec))
    bind = f"{cpus[0]}|{cpus[1]}"
    plugin = _run_engines(
        spec_path, root / "plugin.json", True, root, VLLM_CPU_OMP_THREADS_BIND=bind
    )
    own = _run_engines(spec_path, root / "own.json", False, root, VLLM_CPU_OMP_THREADS_BIND=bind)
    return plugin["llama-tp2-f32"], own["llama-tp2-f32"]


def _compare(plugin: dict, own: dict, bound: float) -> None:
    """Greedy tokens identical and logprobs within `bound`, up to a near tie in vLLM's own run
    (its runner-up within `2 * bound` of the chosen token), where two correct runs may part,
    even at the first token; the plugin's choice there must score within `2 * bound` of vLLM's.
    A near tie ends that request's comparison (the runs then continue from different tokens);
    at least a third of all tokens are compared token for token."""
    compared = total = 0
    for i, (mine, theirs) in enumerate(zip(plugin, own, strict=True)):
        total += len(theirs["tokens"])
        for t, (a, b) in enumerate(zip(mine["tokens"], theirs["tokens"], strict=True)):
            lp_a, lp_b = mine["logprobs"][t], theirs["logprobs"][t]
            runner_up = theirs["runner_up"][t]
            if a != b:
                near_tie = runner_up is not None and lp_b - runner_up <= 2 * bound
                assert near_tie and abs(lp_a - lp_b) <= 2 * bound, (
                    f"request {i}: token {t} is {a} with the plugin, {b} without; logprobs "
                    f"{lp_a} vs {lp_b}, runner-up {runner_up} (bound {bound:.2e})"
                )
                break
            assert abs(lp_a - lp_b) <= bound, (
                f"request {i} token {t}: logprob {lp_a} with the plugin, {lp_b} without "
                f"(bound {bound:.2e})"
            )
            compared += 1
    assert total > 0 and 3 * compared >= total, f"{compared} of {total} tokens compared"


def _scored(run: dict) -> np.ndarray:
    """A run's teacher-forced logprobs, every scored position of every sequence."""
    return np.concatenate([np.asarray(lps, dtype=np.float64) for lps in run["scored"]])


def test_layers_hold_the_plugin_impl(engines):
    plugin, own = engines
    for name in plugin:
        assert {impl for impl, _ in plugin[name]["impls"]} == {PLUGIN_IMPL}, name
        assert {impl for impl, _ in own[name]["impls"]} == {VLLM_IMPL}, name


def test_plain_and_chunked_prefill_f32(engines):
    plugin, own = engines
    # Round one: a 7-token prompt, a 40-token one, and a 150-token one over a 64-token budget.
    _compare(plugin["llama-f32"]["rounds"][0], own["llama-f32"]["rounds"][0], F32_LOGPROB_TOL)


def test_teacher_forced_f32(engines):
    plugin, own = engines
    mine, theirs = _scored(plugin["llama-f32"]), _scored(own["llama-f32"])
    assert mine.shape == theirs.shape == (3 * MAX_TOKENS + 7 + 40 + 150 - 3,)
    worst = np.max(np.abs(mine - theirs))
    assert worst <= F32_LOGPROB_TOL, f"teacher-forced f32 logprobs differ by {worst:.2e}"


def test_prefix_caching_f32(engines):
    plugin, own = engines
    mine, theirs = plugin["llama-f32"]["rounds"][1], own["llama-f32"]["rounds"][1]
    assert mine[0]["cached_tokens"] == theirs[0]["cached_tokens"] == 96
    _compare(mine, theirs, F32_LOGPROB_TOL)


def test_sliding_window_f32(engines):
    plugin, own = engines
    assert plugin["window-f32"]["impls"] == [[PLUGIN_IMPL, WINDOW]]
    _compare(plugin["window-f32"]["rounds"][0], own["window-f32"]["rounds"][0], F32_LOGPROB_TOL)


def test_head_size_512_f32(engines):
    """CPU_ATTN's largest head size: the step's decodes stay in the ragged kernel's tiles."""
    plugin, own = engines
    _compare(plugin["head512-f32"]["rounds"][0], own["head512-f32"]["rounds"][0], F32_LOGPROB_TOL)


def _as_close_to_f32_as_vllms_own(plugin: dict, own: dict, name: str, ratios) -> None:
    """Run `name`'s teacher-forced logprobs, with the plugin and with vLLM's own CPU_ATTN,
    against vLLM's own float32 run: the plugin's distance from it within `ratios` (RMS,
    largest) of vLLM's own."""
    reference = _scored(own["llama-f32"])
    mine, theirs = _scored(plugin[name]), _scored(own[name])
    assert np.all(np.isfinite(mine)), f"non-finite teacher-forced logprobs with the plugin ({name})"
    mine_off, theirs_off = np.abs(mine - reference), np.abs(theirs - reference)

    def rms(x):
        return float(np.sqrt(np.mean(x**2)))

    rms_ratio, max_ratio = ratios
    assert rms(mine_off) <= rms_ratio * rms(theirs_off), (
        f"{name} logprobs' RMS distance from f32: {rms(mine_off):.3e} with the plugin, "
        f"{rms(theirs_off):.3e} with vLLM's own"
    )
    worst = int(np.argmax(mine_off))
    assert mine_off[worst] <= max_ratio * theirs_off.max(), (
        f"{name} logprob {worst} is {mine_off[worst]:.3e} from f32 with the plugin; vLLM's own "
        f"strays {theirs_off.max():.3e} at most"
    )


def test_bf16_as_close_to_f32_as_vllms_own(engines):
    plugin, own = engines
    _as_close_to_f32_as_vllms_own(plugin, own, "llama-bf16", (BF16_RMS_RATIO, BF16_MAX_RATIO))
    mine, theirs = _scored(plugin["llama-bf16"]), _scored(own["llama-bf16"])
    apart = float(np.max(np.abs(mine - theirs)))
    _compare(
        plugin["llama-bf16"]["rounds"][0],
        own["llama-bf16"]["rounds"][0],
        BF16_GENERATED_RATIO * apart,
    )


@pytest.mark.parametrize("name", ["llama-fp8", "llama-fp8-e5m2"])
def test_fp8_caches_as_close_to_f32_as_vllms_own(engines, name):
    plugin, own = engines
    _as_close_to_f32_as_vllms_own(plugin, own, name, (FP8_RMS_RATIO, FP8_MAX_RATIO))


def test_attention_sinks_f32(engines):
    plugin, own = engines
    assert plugin["sinks-f32"]["impls"] == [[PLUGIN_IMPL, 16], [PLUGIN_IMPL, None]]
    _compare(plugin["sinks-f32"]["rounds"][0], own["sinks-f32"]["rounds"][0], F32_LOGPROB_TOL)


def test_encoder_only_embeddings_f32(engines):
    plugin, own = engines
    assert plugin["bert-f32"]["impls"] == [[PLUGIN_IMPL, None]]
    assert plugin["bert-f32"]["attn_types"] == own["bert-f32"]["attn_types"] == ["encoder_only"]
    mine, theirs = (
        np.array([r["embedding"] for r in run["bert-f32"]["rounds"][0]]) for run in (plugin, own)
    )
    assert mine.shape == theirs.shape == (4, 128)
    assert np.all(np.isfinite(mine))
    assert np.ptp(theirs, axis=0).max() > 0.01  # the four prompts' embeddings are not alike
    worst = float(np.max(np.abs(mine - theirs)))
    assert worst <= F32_EMBEDDING_TOL, f"f32 embeddings differ by {worst:.2e}"


def test_encoder_decoder_cross_attention_f32(engines):
    plugin, own = engines
    assert plugin["whisper-f32"]["impls"] == [[PLUGIN_IMPL, None]]
    assert plugin["whisper-f32"]["attn_types"] == ["decoder", "encoder_decoder"]
    assert own["whisper-f32"]["attn_types"] == ["decoder", "encoder_decoder"]
    first, again = (own["whisper-f32"]["rounds"][r][0] for r in range(2))
    apart = max(abs(a - b) for a, b in zip(first["logprobs"], again["logprobs"], strict=False))
    assert first["tokens"] != again["tokens"] or apart > 1e-2, (
        "two clips with the same decoder prompt generate alike: the audio does not reach them"
    )
    for r in range(2):
        _compare(plugin["whisper-f32"]["rounds"][r], own["whisper-f32"]["rounds"][r],
                 F32_LOGPROB_TOL)  # fmt: skip


def test_tensor_parallel_f32(tp_engines):
    plugin, own = tp_engines
    for run, impl in ((plugin, PLUGIN_IMPL), (own, VLLM_IMPL)):
        assert [[i for i, _ in w["impls"]] for w in run["workers"]] == [[impl]] * 2
        assert [w["heads"] for w in run["workers"]] == [[[2, 1]]] * 2
    _compare(plugin["rounds"][0], own["rounds"][0], F32_LOGPROB_TOL)


@pytest.mark.parametrize("name", ["spec-draft-f32", "spec-ngram-f32"])
def test_speculative_decoding_f32(engines, name):
    """Speculative decoding's verify step: each request's drafts attend causally among
    themselves over its cache, 4 new tokens a request beside plain decodes and a chunked
    prefill. Greedy tokens and logprobs as vLLM's own; a model drafting for itself has its drafts
    accepted (its drafter's layers run the plugin too), and greedy speculation generates what
    plain decoding does."""
    plugin, own = engines
    for run, impl in ((plugin, PLUGIN_IMPL), (own, VLLM_IMPL)):
        layers = run[name]["all_impls"]
        assert {i for _, i in layers} == {impl}, layers
        drafter = [layer for layer, _ in layers if layer.startswith("draft_model.")]
        assert len(drafter) == (2 if name == "spec-draft-f32" else 0), layers
        assert run[name]["speculative"]["draft_tokens"] >= 9, run[name]["speculative"]
    _compare(plugin[name]["rounds"][0], own[name]["rounds"][0], F32_LOGPROB_TOL)
    if name == "spec-draft-f32":
        counters = plugin[name]["speculative"]
        assert counters["accepted_tokens"] >= 0.9 * counters["draft_tokens"], counters
        first = [dict(r, **{k: r[k][:MAX_TOKENS] for k in ("tokens", "logprobs", "runner_up")})
                 for r in plugin[name]["rounds"][0]]  # fmt: skip
        _compare(first, own["llama-f32"]["rounds"][0], F32_LOGPROB_TOL)

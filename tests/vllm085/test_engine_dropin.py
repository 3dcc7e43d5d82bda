"""Drop-in: each project backend replaces vLLM 0.8.5's own attention backend inside vLLM's V0
engine (`vllm.LLM`, CPU, float32, block size 16) on tiny random-weight models, and the engine
must produce what it produces with its own backend (engine_harness.py says how).

What each case is compared with:

- llama (GQA 4/2, D 64): vLLM's own TORCH_SDPA, same settings.
- llama with chunked prefill (a 16-token budget), and with prefix caching (two calls: whole and
  partial hits; one call whose prompts share blocks): vLLM's own, plain. vLLM's own CPU
  backend runs chunked prefill (and prefix caching, which its runner handles as chunked
  prefill) only through IPEX (test_vllm_own_chunked_prefill), and neither may change the
  result.
- mistral_window (window 12, shorter than every prompt): the exact answer, float64
  `transformers` with a full forward per step. vLLM's own decode is not exact under a window:
  its CPU runner trims a decode's block table to whole blocks, so a decode sees up to
  window + 15 keys. test_vllm_own_window shows that, and that vLLM's own prefill agrees with
  the float64 answer, which validates the oracle.
- bart (encoder, decoder, cross attention): vLLM's own.
- bert (encoder-only, every token's final hidden state): vLLM's own.

Greedy tokens must be equal and each chosen token's logprob within ATOL (a near-tie may flip
one choice: `engine_harness.compare_greedy`).
"""

import functools
import importlib.util

import engine_harness as h
import numpy as np
import pytest
from tolerances import TOLERANCES

pytestmark = pytest.mark.vllm085

BACKENDS = {
    "TORCH_SDPA": "torch_backends.torch_sdpa.TorchSDPABackend",
    "XFORMERS": "torch_backends.xformers.XFormersBackend",
    "JAX": "interop.torch_op.JaxAttnBackend",
}
# End to end through 2 layers, the final norm and a 512-word vocabulary: 5x the float32
# attention-output row. Backends that agree per attention call to ~1e-6 land ~1e-6 here.
ATOL = 5 * TOLERANCES["float32"][0]
MAX_TOKENS = 8
CHUNKED = dict(enable_chunked_prefill=True, max_num_batched_tokens=16)


class Models:
    """Each tiny model built on first use, once per module."""

    def __init__(self, root, seed: int):
        self.root, self.seed = root, seed

    @functools.cache  # noqa: B019 (one instance per module)
    def __getitem__(self, name: str) -> h.TinyModel:
        return h.build_model(name, self.root, seed=self.seed)


class Expected:
    """Each reference run made on first use, once per module."""

    def __init__(self, models: Models):
        self.models = models

    @functools.cache  # noqa: B019
    def vllm(self, name: str) -> dict[str, h.Completion]:
        """vLLM's own backend, named explicitly (so it goes through the same substitution as
        ours), on every prompt of the model in one batch: {prompt: completion}."""
        model = self.models[name]
        prompts = model.prompts + model.prefix_prompts
        (out,) = h.generate(model, prompts, max_tokens=MAX_TOKENS, backend=h.VLLM_TORCH_SDPA)
        return dict(zip(prompts, out, strict=True))

    @functools.cache  # noqa: B019
    def exact(self, name: str) -> dict[str, h.Completion]:
        model = self.models[name]
        out = h.hf_greedy(model, model.prompts, max_tokens=MAX_TOKENS)
        return dict(zip(model.prompts, out, strict=True))

    @functools.cache  # noqa: B019
    def hidden(self, name: str) -> list[np.ndarray]:
        model = self.models[name]
        return h.encode(model, model.prompts, backend=h.VLLM_TORCH_SDPA)


@pytest.fixture(scope="module")
def models(tmp_path_factory, run_seed) -> Models:
    return Models(tmp_path_factory.mktemp("vllm085_models"), run_seed)


@pytest.fixture(scope="module")
def expected(models) -> Expected:
    return Expected(models)


def _check(expected: dict, prompts, completions, what: str) -> None:
    figures = h.compare_greedy([expected[p] for p in prompts], completions, atol=ATOL, label=what)
    h.record(what, figures)


# ---------------------------------------------------------------------------------------------
# The harness itself, on vLLM's own backend


def test_vllm_own_deterministic(models, expected):
    """Two engines with vLLM's own backend give identical tokens and logprobs."""
    model = models["llama"]
    prompts = model.prompts + model.prefix_prompts
    (again,) = h.generate(model, prompts, max_tokens=MAX_TOKENS, backend=h.VLLM_TORCH_SDPA)
    figures = h.compare_greedy([expected.vllm("llama")[p] for p in prompts], again, atol=0.0)
    assert figures["near_ties"] == 0
    h.record("vLLM own vs vLLM own, llama", figures)


def test_compare_greedy_refuses_to_compare_nothing():
    """A comparison that compared no token (or too few) fails: empty completions, a near-tie
    at every prompt's first step. Half the expected tokens is the default minimum."""
    tie = {1: -0.5, 3: -0.5 - 1e-6}  # tokens 1 and 3 within atol: a near-tie
    ours = h.Completion((1, 2), (tie, {2: -0.1}))
    flipped = h.Completion((3, 2), (tie, {2: -0.1}))
    with pytest.raises(AssertionError, match="compared 0 tokens, fewer than min_tokens=1"):
        h.compare_greedy([h.Completion((), ())], [h.Completion((), ())], atol=1e-3)
    with pytest.raises(AssertionError, match="compared 0 tokens, fewer than min_tokens=1"):
        h.compare_greedy([ours], [flipped], atol=1e-3)
    with pytest.raises(AssertionError, match="compared 2 tokens, fewer than min_tokens=3"):
        h.compare_greedy([ours, ours], [ours, flipped], atol=1e-3, min_tokens=3)
    figures = h.compare_greedy([ours, ours], [ours, flipped], atol=1e-3)  # 2 of 4: half
    assert figures == {"tokens": 2, "max_logprob_diff": 0.0, "near_ties": 1}


def test_vllm_own_window(models, expected):
    """vLLM's own backend under a sliding window: its prefill (the first generated token) is
    the exact answer, and its decode is not (it attends over whole blocks from the window's
    first one). Both facts are what the window tests below rely on."""
    model = models["mistral_window"]
    own, exact = expected.vllm("mistral_window"), expected.exact("mistral_window")

    def first_step(runs):
        return [h.Completion(runs[p].token_ids[:1], runs[p].logprobs[:1]) for p in model.prompts]

    figures = h.compare_greedy(first_step(exact), first_step(own), atol=ATOL)
    h.record("vLLM own prefill vs exact float64, mistral_window", figures)
    with pytest.raises(AssertionError):  # greedy decode steps: not exact
        h.compare_greedy([exact[p] for p in model.prompts], [own[p] for p in model.prompts],
                         atol=ATOL)  # fmt: skip


def test_vllm_own_chunked_prefill(models, expected):
    """vLLM 0.8.5's own CPU backend runs chunked prefill and prefix caching only through IPEX's
    `flash_attn_varlen_func`: without IPEX the first step raises; with it, it must agree."""
    model = models["llama"]
    if importlib.util.find_spec("intel_extension_for_pytorch") is None:
        with pytest.raises(ModuleNotFoundError, match="intel_extension_for_pytorch"):
            h.generate(model, model.prompts, max_tokens=2, backend=h.VLLM_TORCH_SDPA, **CHUNKED)
        return
    (out,) = h.generate(model, model.prompts, max_tokens=MAX_TOKENS, backend=h.VLLM_TORCH_SDPA,
                        **CHUNKED)  # fmt: skip
    _check(expected.vllm("llama"), model.prompts, out, "vLLM own chunked vs unchunked, llama")


# ---------------------------------------------------------------------------------------------
# The project's backends in vLLM's engine


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropin_decoder(backend, models, expected):
    model = models["llama"]
    prompts = model.prompts + model.prefix_prompts
    (out,) = h.generate(model, prompts, max_tokens=MAX_TOKENS, backend=BACKENDS[backend])
    _check(expected.vllm("llama"), prompts, out, f"{backend} vs vLLM own, llama")


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropin_chunked_prefill(backend, models, expected):
    """Prompts of 5..40 tokens through a 16-token budget: prefills split into chunks over a
    cached prefix, batched with other sequences' decodes."""
    model = models["llama"]
    prompts = model.prompts + model.prefix_prompts
    (out,) = h.generate(model, prompts, max_tokens=MAX_TOKENS, backend=BACKENDS[backend],
                        **CHUNKED)  # fmt: skip
    _check(expected.vllm("llama"), prompts, out, f"{backend} chunked prefill vs vLLM own, llama")


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropin_prefix_caching(backend, models, expected):
    """Two calls on one engine with prefix caching; the second finds the first's blocks: the
    same prompts again (whole-prompt hits, where vLLM recomputes only the last token) and
    prompts sharing two blocks with one of them (partial hits)."""
    model = models["llama"]
    first, second = model.prompts, model.prompts + model.prefix_prompts
    out = h.generate(model, [first, second], max_tokens=MAX_TOKENS, backend=BACKENDS[backend],
                     enable_prefix_caching=True)  # fmt: skip
    _check(expected.vllm("llama"), first + second, out[0] + out[1],
           f"{backend} prefix caching vs vLLM own, llama")  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropin_prefix_caching_shared_blocks(backend, models, expected):
    """Prefix caching, one call with prompts that share two whole blocks: vLLM gives them the
    same physical blocks before any is computed, so one step's slot_mapping writes the same
    slots once per sharing prompt (with identical keys and values)."""
    model = models["llama"]
    prompts = model.prompts + model.prefix_prompts
    (out,) = h.generate(model, prompts, max_tokens=MAX_TOKENS, backend=BACKENDS[backend],
                        enable_prefix_caching=True)  # fmt: skip
    _check(expected.vllm("llama"), prompts, out,
           f"{backend} prefix caching, shared blocks in one step vs vLLM own, llama")  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropin_sliding_window(backend, models, expected):
    """Against the exact answer (float64 transformers), not vLLM's own: see test_vllm_own_window."""
    model = models["mistral_window"]
    (out,) = h.generate(model, model.prompts, max_tokens=MAX_TOKENS, backend=BACKENDS[backend])
    _check(expected.exact("mistral_window"), model.prompts, out,
           f"{backend} vs exact float64, mistral_window")  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropin_encoder_decoder(backend, models, expected):
    model = models["bart"]
    (out,) = h.generate(model, model.prompts, max_tokens=MAX_TOKENS, backend=BACKENDS[backend])
    _check(expected.vllm("bart"), model.prompts, out, f"{backend} vs vLLM own, bart")


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropin_encoder_only(backend, models, expected):
    model = models["bert"]
    got = h.encode(model, model.prompts, backend=BACKENDS[backend])
    want = expected.hidden("bert")
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape, (i, g.shape, w.shape)
        worst = max(worst, float(np.max(np.abs(g - w))))
        np.testing.assert_allclose(g, w, atol=ATOL, rtol=0, err_msg=f"prompt {i}")
    tokens = sum(len(w) for w in want)
    h.record(f"{backend} vs vLLM own, bert", {"tokens": tokens, "max_hidden_diff": worst})

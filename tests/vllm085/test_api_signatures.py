"""The torch backends' public surface against vLLM 0.8.5's own (`inspect.signature` and
dataclass fields), in the vllm085 environment.

For every class and function vLLM's V0 CPU path and its backend modules expose, ours must have
the same name, the same kind (staticmethod / classmethod / property / plain method), the same
parameters in the same order with the same kinds and defaults, and dataclasses the same fields
in the same order. Extensions are allowed only as keyword-only parameters (or keyword-only
fields) after vLLM's own.
"""

import dataclasses
import importlib
import inspect

import pytest

pytestmark = pytest.mark.vllm085

vllm = pytest.importorskip("vllm", reason="vLLM 0.8.5 is not installed (scripts/env.sh vllm085)")

# (vLLM module, vLLM name) -> (our module, our name)
SURFACE = {
    ("vllm.attention.backends.abstract", "AttentionBackend"): ("torch_backends.abstract", None),
    ("vllm.attention.backends.abstract", "AttentionMetadata"): ("torch_backends.abstract", None),
    ("vllm.attention.backends.abstract", "AttentionState"): ("torch_backends.abstract", None),
    ("vllm.attention.backends.abstract", "AttentionMetadataBuilder"): (
        "torch_backends.abstract",
        None,
    ),
    ("vllm.attention.backends.abstract", "AttentionImpl"): ("torch_backends.abstract", None),
    ("vllm.attention.backends.abstract", "is_quantized_kv_cache"): (
        "torch_backends.abstract",
        None,
    ),
    ("vllm.attention.backends.utils", "CommonAttentionState"): ("torch_backends.abstract", None),
    ("vllm.attention.backends.torch_sdpa", "TorchSDPABackend"): ("torch_backends.torch_sdpa", None),
    ("vllm.attention.backends.torch_sdpa", "TorchSDPAMetadata"): (
        "torch_backends.torch_sdpa",
        None,
    ),
    ("vllm.attention.backends.torch_sdpa", "TorchSDPAMetadataBuilder"): (
        "torch_backends.torch_sdpa",
        None,
    ),
    ("vllm.attention.backends.torch_sdpa", "TorchSDPABackendImpl"): (
        "torch_backends.torch_sdpa",
        None,
    ),
    ("vllm.attention.backends.torch_sdpa", "_make_alibi_bias"): ("torch_backends.torch_sdpa", None),
    ("vllm.attention.backends.torch_sdpa", "_make_sliding_window_bias"): (
        "torch_backends.torch_sdpa",
        None,
    ),
    ("vllm.attention.backends.xformers", "XFormersBackend"): ("torch_backends.xformers", None),
    ("vllm.attention.backends.xformers", "XFormersMetadata"): ("torch_backends.xformers", None),
    ("vllm.attention.backends.xformers", "XFormersMetadataBuilder"): (
        "torch_backends.xformers",
        None,
    ),
    ("vllm.attention.backends.xformers", "XFormersImpl"): ("torch_backends.xformers", None),
    ("vllm.attention.backends.ipex_attn", "IpexAttnBackend"): ("torch_backends.ipex_attn", None),
    ("vllm.attention.backends.ipex_attn", "IpexAttnMetadata"): ("torch_backends.ipex_attn", None),
    ("vllm.attention.backends.ipex_attn", "IpexAttnBackendImpl"): (
        "torch_backends.ipex_attn",
        None,
    ),
    ("vllm.attention.ops.paged_attn", "PagedAttention"): ("torch_backends.paged_attn", None),
    ("vllm.attention.ops.paged_attn", "PagedAttentionMetadata"): (
        "torch_backends.paged_attn",
        None,
    ),
    # The CPU ops file TORCH_SDPA uses (vLLM binds `PagedAttention` to `_PagedAttention`
    # without IPEX).
    ("vllm.attention.ops.ipex_attn", "_PagedAttention"): (
        "torch_backends.cpu_paged_attn",
        "PagedAttention",
    ),
}

# Modules whose import needs something this environment may lack (xformers, IPEX).
_OPTIONAL = {"torch_backends.xformers": "xformers", "torch_backends.ipex_attn": "IPEX"}


def _load(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as e:
        pytest.skip(f"{module} does not import here: {e}")


def _kind(owner, name: str) -> str:
    raw = inspect.getattr_static(owner, name)
    if isinstance(raw, staticmethod):
        return "staticmethod"
    if isinstance(raw, classmethod):
        return "classmethod"
    if isinstance(raw, property):
        return "property"
    return "method"


def _public_members(cls) -> list[str]:
    names = []
    for name in dir(cls):
        if name.startswith("_") and name not in ("__init__", "__post_init__"):
            continue
        if name.startswith("__") and name not in vars_chain(cls):
            continue
        raw = inspect.getattr_static(cls, name)
        if isinstance(raw, (staticmethod, classmethod, property)) or inspect.isfunction(raw):
            names.append(name)
    return names


def vars_chain(cls) -> set[str]:
    """Names defined by the class or its bases other than `object`."""
    return {n for c in cls.__mro__ if c is not object for n in vars(c)}


def _params(fn) -> list[inspect.Parameter]:
    return list(inspect.signature(fn).parameters.values())


def signature_problems(theirs, ours, where: str) -> list[str]:
    """Differences between two callables' parameters: ours must repeat vLLM's (name, kind,
    default) in order, then may add keyword-only extras."""
    tp, op = _params(theirs), _params(ours)
    problems = []
    for i, p in enumerate(tp):
        if i >= len(op):
            problems.append(f"{where}: missing parameter {p.name!r}")
            continue
        q = op[i]
        if q.name != p.name:
            problems.append(f"{where}: parameter {i} is {q.name!r}, vLLM has {p.name!r}")
        elif q.kind != p.kind:
            problems.append(
                f"{where}: {p.name!r} is {q.kind.description}, vLLM {p.kind.description}"
            )
        elif _default(q) != _default(p):
            problems.append(f"{where}: {p.name!r} defaults to {q.default!r}, vLLM {p.default!r}")
    for q in op[len(tp) :]:
        if q.kind not in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD):
            problems.append(f"{where}: extra parameter {q.name!r} must be keyword-only")
    return problems


def _default(p: inspect.Parameter):
    d = p.default
    # vLLM's AttentionType members are plain strings; ours is a str Enum equal to them.
    return d.value if hasattr(d, "value") and isinstance(d, str) else d


def field_problems(theirs, ours, where: str) -> list[str]:
    tf = [f for f in dataclasses.fields(theirs) if f.init]
    of = [f for f in dataclasses.fields(ours) if f.init]
    problems = []
    for i, f in enumerate(tf):
        if i >= len(of):
            problems.append(f"{where}: missing field {f.name!r}")
            continue
        g = of[i]
        if g.name != f.name:
            problems.append(f"{where}: field {i} is {g.name!r}, vLLM has {f.name!r}")
        elif (f.default is dataclasses.MISSING) != (g.default is dataclasses.MISSING):
            problems.append(f"{where}: field {f.name!r} default differs")
        elif f.default is not dataclasses.MISSING and f.default != g.default:
            problems.append(
                f"{where}: field {f.name!r} defaults to {g.default!r}, vLLM {f.default!r}"
            )
    for g in of[len(tf) :]:
        if not g.kw_only:
            problems.append(f"{where}: extra field {g.name!r} must be keyword-only")
    return problems


@pytest.mark.parametrize(
    "theirs_module, theirs_name",
    sorted(SURFACE),
    ids=[f"{m.rsplit('.', 1)[-1]}.{n}" for m, n in sorted(SURFACE)],
)
def test_same_surface_as_vllm(theirs_module, theirs_name):
    our_module, our_name = SURFACE[(theirs_module, theirs_name)]
    theirs = getattr(importlib.import_module(theirs_module), theirs_name)
    ours = _load(our_module, our_name or theirs_name)
    where = f"{our_module}.{our_name or theirs_name}"
    problems = []
    if inspect.isclass(theirs):
        if dataclasses.is_dataclass(theirs):
            problems += field_problems(theirs, ours, where)
        for name in _public_members(theirs):
            if not hasattr(ours, name):
                problems.append(f"{where}: missing {name}")
                continue
            kt, ko = _kind(theirs, name), _kind(ours, name)
            if kt != ko:
                problems.append(f"{where}.{name}: ours is a {ko}, vLLM's a {kt}")
            elif kt != "property" and not (dataclasses.is_dataclass(theirs) and name == "__init__"):
                problems += signature_problems(
                    getattr(theirs, name), getattr(ours, name), f"{where}.{name}"
                )
    else:
        problems += signature_problems(theirs, ours, where)
    assert not problems, "\n".join(problems)

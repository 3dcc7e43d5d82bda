"""vLLM 0.8.5's public V0 attention surface as data, and the comparison of ours against it.

`describe(obj)` turns a class or function into plain JSON data: a dataclass's `__init__`
fields in order (name, default, keyword-only), and every public member's kind (staticmethod,
classmethod, property, method) and parameters (name, kind, default). vLLM's surface is kept
in `vllm085_surface.json`, written from the installed vLLM 0.8.5 by
`python tests/torch/vllm_api_surface.py` in the vllm085 environment, and
tests/vllm085/test_surface_snapshot.py fails there when the file differs from the installed
vLLM, so it cannot drift. The comparison then runs wherever
our side imports: the main environment (TORCH_SDPA, XFORMERS, the ops files), the IPEX
environment (IPEX), the vllm085 environment (all of them but IPEX).

The rule (`problems`): ours repeats vLLM's parameters and fields in order, with the same
names, kinds and defaults; extensions come after them, keyword-only.
"""

import dataclasses
import enum
import importlib
import inspect
import json
import sys
from pathlib import Path

SNAPSHOT = Path(__file__).with_name("vllm085_surface.json")

# vLLM's (module, name) -> ours (module, name).
SURFACE = {
    "vllm.attention.backends.abstract:AttentionBackend": "torch_backends.abstract:AttentionBackend",
    "vllm.attention.backends.abstract:AttentionMetadata": (
        "torch_backends.abstract:AttentionMetadata"
    ),
    "vllm.attention.backends.abstract:AttentionState": "torch_backends.abstract:AttentionState",
    "vllm.attention.backends.abstract:AttentionMetadataBuilder": (
        "torch_backends.abstract:AttentionMetadataBuilder"
    ),
    "vllm.attention.backends.abstract:AttentionImpl": "torch_backends.abstract:AttentionImpl",
    "vllm.attention.backends.abstract:is_quantized_kv_cache": (
        "torch_backends.abstract:is_quantized_kv_cache"
    ),
    "vllm.attention.backends.utils:CommonAttentionState": (
        "torch_backends.abstract:CommonAttentionState"
    ),
    "vllm.attention.backends.torch_sdpa:TorchSDPABackend": (
        "torch_backends.torch_sdpa:TorchSDPABackend"
    ),
    "vllm.attention.backends.torch_sdpa:TorchSDPAMetadata": (
        "torch_backends.torch_sdpa:TorchSDPAMetadata"
    ),
    "vllm.attention.backends.torch_sdpa:TorchSDPAMetadataBuilder": (
        "torch_backends.torch_sdpa:TorchSDPAMetadataBuilder"
    ),
    "vllm.attention.backends.torch_sdpa:TorchSDPABackendImpl": (
        "torch_backends.torch_sdpa:TorchSDPABackendImpl"
    ),
    "vllm.attention.backends.torch_sdpa:_make_alibi_bias": (
        "torch_backends.torch_sdpa:_make_alibi_bias"
    ),
    "vllm.attention.backends.torch_sdpa:_make_sliding_window_bias": (
        "torch_backends.torch_sdpa:_make_sliding_window_bias"
    ),
    "vllm.attention.backends.xformers:XFormersBackend": "torch_backends.xformers:XFormersBackend",
    "vllm.attention.backends.xformers:XFormersMetadata": "torch_backends.xformers:XFormersMetadata",
    "vllm.attention.backends.xformers:XFormersMetadataBuilder": (
        "torch_backends.xformers:XFormersMetadataBuilder"
    ),
    "vllm.attention.backends.xformers:XFormersImpl": "torch_backends.xformers:XFormersImpl",
    "vllm.attention.backends.ipex_attn:IpexAttnBackend": "torch_backends.ipex_attn:IpexAttnBackend",
    "vllm.attention.backends.ipex_attn:IpexAttnMetadata": (
        "torch_backends.ipex_attn:IpexAttnMetadata"
    ),
    "vllm.attention.backends.ipex_attn:IpexAttnBackendImpl": (
        "torch_backends.ipex_attn:IpexAttnBackendImpl"
    ),
    "vllm.attention.ops.paged_attn:PagedAttention": "torch_backends.paged_attn:PagedAttention",
    "vllm.attention.ops.paged_attn:PagedAttentionMetadata": (
        "torch_backends.paged_attn:PagedAttentionMetadata"
    ),
    # The CPU ops file TORCH_SDPA uses (vLLM binds `PagedAttention` to `_PagedAttention`
    # when IPEX is absent).
    "vllm.attention.ops.ipex_attn:_PagedAttention": "torch_backends.cpu_paged_attn:PagedAttention",
    # The JAX backend behind the same API: TORCH_SDPA's metadata, vLLM's backend and impl
    # signatures.
    "vllm.attention.backends.torch_sdpa:TorchSDPABackend#JAX": "interop.torch_op:JaxAttnBackend",
    "vllm.attention.backends.torch_sdpa:TorchSDPABackendImpl#JAX": (
        "interop.torch_op:JaxAttnBackendImpl"
    ),
}

REQUIRED = "<required>"


def load(spec: str):
    module, name = spec.split("#")[0].split(":")
    return getattr(importlib.import_module(module), name)


def _default(value) -> str:
    if value is inspect.Parameter.empty or value is dataclasses.MISSING:
        return REQUIRED
    if isinstance(value, enum.Enum):  # our AttentionType members equal vLLM's strings
        value = value.value
    return repr(value)


def _params(fn) -> list[list[str]]:
    return [
        [p.name, p.kind.name, _default(p.default)]
        for p in inspect.signature(fn).parameters.values()
    ]


def _kind(cls, name: str) -> str:
    raw = inspect.getattr_static(cls, name)
    for kind in (staticmethod, classmethod, property):
        if isinstance(raw, kind):
            return kind.__name__
    return "method"


def _members(cls) -> list[str]:
    """Public methods and properties, `__init__` / `__post_init__`, from the class and its
    bases other than `object` and the typing / abc machinery."""
    own = {
        n for c in cls.__mro__ if c.__module__ not in ("builtins", "abc", "typing") for n in vars(c)
    }
    names = []
    for name in sorted(own):
        if name.startswith("_") and name not in ("__init__", "__post_init__"):
            continue
        raw = inspect.getattr_static(cls, name)
        if isinstance(raw, staticmethod | classmethod | property) or inspect.isfunction(raw):
            names.append(name)
    return names


def describe(obj) -> dict:
    if not inspect.isclass(obj):
        return {"params": _params(obj)}
    out: dict = {"members": {}}
    if dataclasses.is_dataclass(obj):
        out["fields"] = [
            [f.name, _default(f.default), bool(f.kw_only)]
            for f in dataclasses.fields(obj)
            if f.init
        ]
    for name in _members(obj):
        kind = _kind(obj, name)
        member = {"kind": kind}
        generated_init = name == "__init__" and dataclasses.is_dataclass(obj)
        if kind != "property" and not generated_init:
            member["params"] = _params(getattr(obj, name))
        out["members"][name] = member
    return out


def param_problems(theirs: list, ours: list, where: str) -> list[str]:
    problems = []
    for i, (name, kind, default) in enumerate(theirs):
        if i >= len(ours):
            problems.append(f"{where}: missing parameter {name!r}")
            continue
        o_name, o_kind, o_default = ours[i]
        if o_name != name:
            problems.append(f"{where}: parameter {i} is {o_name!r}, vLLM has {name!r}")
        elif o_kind != kind:
            problems.append(f"{where}: {name!r} is {o_kind}, vLLM's is {kind}")
        elif o_default != default:
            problems.append(f"{where}: {name!r} defaults to {o_default}, vLLM's to {default}")
    for o_name, o_kind, _ in ours[len(theirs) :]:
        if o_kind not in ("KEYWORD_ONLY", "VAR_KEYWORD"):
            problems.append(f"{where}: extra parameter {o_name!r} must be keyword-only")
    return problems


def problems(theirs: dict, ours: dict, where: str) -> list[str]:
    """What differs between vLLM's description and ours, by the rule above."""
    if "params" in theirs:
        return param_problems(theirs["params"], ours.get("params", []), where)
    found = []
    t_fields, o_fields = theirs.get("fields"), ours.get("fields", [])
    if t_fields is not None:
        for i, (name, default, _) in enumerate(t_fields):
            if i >= len(o_fields):
                found.append(f"{where}: missing field {name!r}")
            elif o_fields[i][0] != name:
                found.append(f"{where}: field {i} is {o_fields[i][0]!r}, vLLM has {name!r}")
            elif o_fields[i][1] != default:
                found.append(
                    f"{where}: field {name!r} defaults to {o_fields[i][1]}, vLLM's to {default}"
                )
        for name, _, kw_only in o_fields[len(t_fields) :]:
            if not kw_only:
                found.append(f"{where}: extra field {name!r} must be keyword-only")
    for name, member in theirs["members"].items():
        mine = ours["members"].get(name)
        if mine is None:
            found.append(f"{where}: missing {name}")
        elif mine["kind"] != member["kind"]:
            found.append(f"{where}.{name}: ours is a {mine['kind']}, vLLM's a {member['kind']}")
        elif "params" in member:
            found += param_problems(member["params"], mine.get("params", []), f"{where}.{name}")
    return found


def vllm_surface() -> dict:
    """vLLM's side of `SURFACE`, from the installed vLLM."""
    return {spec: describe(load(spec)) for spec in SURFACE if "#" not in spec}


if __name__ == "__main__":
    import vllm

    assert vllm.__version__.startswith("0.8.5"), vllm.__version__
    SNAPSHOT.write_text(json.dumps(vllm_surface(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT}", file=sys.stderr)

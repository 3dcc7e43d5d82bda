"""The torch backends' public surface against vLLM 0.8.5's (`api_surface.py`).

Every class and function vLLM's V0 CPU path uses, and its backend modules expose: same names,
kinds (static / class methods, properties), parameters in the same order with the same kinds
and defaults, dataclass fields in the same order; extensions only keyword-only after vLLM's.
vLLM's side comes from `vllm085_surface.json`, checked against the installed vLLM 0.8.5 in
the vllm085 environment (tests/vllm085/test_surface_snapshot.py); ours is compared with it in
every environment where our side imports (IPEX's classes in the IPEX environment).
"""

import importlib.util
import json

import pytest
from vllm_api_surface import SNAPSHOT, SURFACE, describe, load, problems

_OPTIONAL = {"torch_backends.xformers": "xformers", "torch_backends.ipex_attn": "ipex"}


def _param(spec: str):
    ours = SURFACE[spec]
    module = ours.split(":")[0]
    marks = [pytest.mark.ipex] if _OPTIONAL.get(module) == "ipex" else []
    return pytest.param(spec, marks=marks, id=ours.split(".")[-1].replace(":", "."))


@pytest.mark.parametrize("spec", [_param(s) for s in SURFACE])
def test_same_surface_as_vllm(spec):
    ours_spec = SURFACE[spec]
    module = ours_spec.split(":")[0]
    if module in _OPTIONAL:
        try:
            importlib.import_module(module)
        except ImportError as e:
            pytest.skip(f"{module} does not import here ({e}); its environment checks it")
    theirs = json.loads(SNAPSHOT.read_text())[spec.split("#")[0]]
    found = problems(theirs, describe(load(ours_spec)), ours_spec)
    assert not found, "\n".join(found)


def test_a_difference_is_caught():
    """The comparison can fail: a default changed, a field moved, an extra positional."""
    arg = "POSITIONAL_OR_KEYWORD"
    theirs = {
        "members": {"f": {"kind": "staticmethod", "params": [["a", arg, "<required>"]]}},
        "fields": [["x", "<required>", False], ["y", "None", False]],
    }
    ours = {
        "members": {
            "f": {"kind": "staticmethod", "params": [["a", arg, "1.0"], ["b", arg, "None"]]}
        },
        "fields": [["y", "None", False], ["x", "<required>", False]],
    }
    found = problems(theirs, ours, "X")
    assert any("'a' defaults to 1.0" in p for p in found)
    assert any("extra parameter 'b' must be keyword-only" in p for p in found)
    assert any("field 0 is 'y', vLLM has 'x'" in p for p in found)

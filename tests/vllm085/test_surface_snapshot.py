"""tests/torch/vllm085_surface.json (vLLM 0.8.5's API, which tests/torch/test_vllm_api.py
compares ours with in every environment) is what the installed vLLM 0.8.5 gives."""

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm085

sys.path.insert(0, str(Path(__file__).parents[1] / "torch"))
from vllm_api_surface import SNAPSHOT, vllm_surface  # noqa: E402


def test_snapshot_is_vllms():
    """Regenerate with `python tests/torch/vllm_api_surface.py` in the vllm085 environment."""
    assert json.loads(SNAPSHOT.read_text()) == json.loads(json.dumps(vllm_surface()))

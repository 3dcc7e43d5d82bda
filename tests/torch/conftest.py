"""Fixtures of the torch half's tests (tests/conftest.py has the project-wide ones)."""

import contextlib

import pytest


@pytest.fixture(params=[False, True], ids=["", "inference-mode"])
def inference_mode(request) -> bool:
    """The test runs twice: under no mode, and under `torch.inference_mode()` (serving code's
    usual mode: every tensor made inside is an inference tensor, which keeps no version
    counter). The value says which."""
    import torch  # not at import: this conftest is collected where torch may be missing

    with torch.inference_mode() if request.param else contextlib.nullcontext():
        yield request.param

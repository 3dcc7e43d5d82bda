"""Shared test configuration.

- JAX runs with strict dtype promotion and rank promotion raising, so an accidental upcast or
  broadcast in the core fails a test instead of silently costing memory or precision.
- Every test draws fresh random data: the run seed is random unless JAX_ATTN_TEST_SEED is set,
  and is printed in the header so a failure can be replayed.
- Test modules have unique basenames (no __init__.py: a `tests/jax` package would shadow jax).
"""

import hashlib
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # for `from tolerances import ...`

try:
    import jax

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_numpy_rank_promotion", "raise")
except ImportError:  # the torch-only tests run without JAX
    jax = None

RUN_SEED = int(os.environ.get("JAX_ATTN_TEST_SEED", random.SystemRandom().randrange(2**31)))


def pytest_report_header(config):
    return f"jax-attn test seed: {RUN_SEED} (replay with JAX_ATTN_TEST_SEED={RUN_SEED})"


def _test_seed(request) -> int:
    digest = hashlib.sha256(f"{RUN_SEED}:{request.node.nodeid}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


@pytest.fixture
def seed(request) -> int:
    """A per-test seed derived from the run seed and the test id."""
    return _test_seed(request)


@pytest.fixture
def rng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.fixture
def key(seed):
    if jax is None:
        pytest.skip("jax is not installed in this environment")
    return jax.random.key(seed)

"""The IPEX half of scripts/test.sh runs with JAX_ATTN_REQUIRE_IPEX=1: there IPEX must import
(this test fails instead of skipping), and tests/conftest.py fails the session when no `ipex`
test passed or one was skipped."""

import os

import pytest


@pytest.mark.ipex
def test_ipex_imports_where_required():
    if os.environ.get("JAX_ATTN_REQUIRE_IPEX") != "1":
        pytest.skip("not the IPEX half of scripts/test.sh (JAX_ATTN_REQUIRE_IPEX unset)")
    import intel_extension_for_pytorch  # noqa: F401

    from torch_backends import get_attn_backend

    assert get_attn_backend("IPEX").get_name() == "IPEX"

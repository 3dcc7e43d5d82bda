"""Without IPEX 2.8 (any environment whose torch is not 2.8), importing the backend fails
with an ImportError that says what is needed and how to get it."""

import pytest
import torch


@pytest.mark.skipif(
    torch.__version__.startswith("2.8"),
    reason="torch 2.8 here: the IPEX backend can import (tested in test_torch_ipex)",
)
def test_import_error_says_how_to_install():
    with pytest.raises(
        ImportError, match=r"requires torch 2\.8\.\*.*pip install 'jax-attn\[ipex\]'"
    ):
        import torch_backends.ipex_attn  # noqa: F401
    from torch_backends import get_attn_backend

    with pytest.raises(ImportError, match=r"intel_extension_for_pytorch 2\.8"):
        get_attn_backend("IPEX")

"""`python -m jax_attn.cpu.build`: build the native CPU kernels now (see `_build`)."""

import sys

from jax_attn.cpu._build import main

if __name__ == "__main__":
    sys.exit(main())

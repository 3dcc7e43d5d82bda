"""The benchmark suite that `jax-attn bench` runs (see `benchmarks/README.md`)."""

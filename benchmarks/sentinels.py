"""What `jax-attn bench`'s `--json` and `--check` hold when given without a value: shared by the
parser (`benchmarks.command`) and the CPU suite (`benchmarks.run`), which the command loads when
it runs, so neither imports the other."""

DEFAULT_JSON = "<default record path>"
CHECK_RUN = "<this run>"

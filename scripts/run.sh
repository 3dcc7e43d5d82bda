#!/usr/bin/env bash
# Usage: scripts/run.sh COMMAND [ARGS...]  -> runs COMMAND inside the main environment,
# e.g. `bash scripts/run.sh jax-attn check`. JAX_ATTN_ENV=ipex picks the IPEX environment.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$(bash "$root/scripts/env.sh" "${JAX_ATTN_ENV:-main}")
export PATH="$venv/bin:$PATH" PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
cd "$root"
exec "$@"

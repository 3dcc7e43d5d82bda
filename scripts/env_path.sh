#!/usr/bin/env bash
# Usage: scripts/env_path.sh main|ipex|gpu-aot|tpu-aot|vllm085|vllm  -> prints the path of that environment
# if it is already built and ready; exits 1 (saying what is missing on stderr) if it is not.
#
# Never builds anything, never installs, takes no lock: for callers that may only use an
# environment that exists (`jax-attn bench` looking for the vllm085 interpreter). The path is
# the one scripts/env.sh prints: the same cache directory, and the same key (the hash of the
# interpreter's version, the environment's dependency lists, scripts/env.sh and, for vllm085,
# its requirements and patch script, for vllm its requirements). Keep the two in step;
# tests/benchmarks checks that this script names the environment a test runs in.
set -euo pipefail
name=${1:?usage: scripts/env_path.sh main|ipex|gpu-aot|tpu-aot|vllm085|vllm}
root=$(cd "$(dirname "$0")/.." && pwd)
case "$name" in
main) extras="torch,xformers,test,notebooks,cli,lint" ;;
ipex) extras="ipex,test,cli" ;;
gpu-aot) extras="gpu-aot,test,cli" ;;
tpu-aot) extras="tpu-aot,test,cli" ;;
vllm085) extras="test,cli" ;;
vllm) extras="torch,test,cli" ;;
*)
    echo "unknown environment '$name' (known: main, ipex, gpu-aot, tpu-aot, vllm085, vllm)" >&2
    exit 2
    ;;
esac
py=${PYTHON:-python3.11}
command -v "$py" >/dev/null || py=python3
deps=$("$py" - "$root/pyproject.toml" "$extras" <<'PY'
import json, platform, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = project["optional-dependencies"]
deps = [project["dependencies"]] + [extras[e] for e in sys.argv[2].split(",")]
print(json.dumps([platform.python_version()] + deps))
PY
)
reqs=()
[ "$name" = vllm085 ] && reqs=("$root/scripts/requirements/vllm085.txt" "$root/scripts/vllm085_glibcxx.py")
[ "$name" = vllm ] && reqs=("$root/scripts/requirements/vllm.txt")
key=$(printf '%s\n' "$deps" | cat - "$root/scripts/env.sh" "${reqs[@]}" | sha256sum | cut -c1-12)
cache=${JAX_ATTN_ENV_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/jax-attn}
venv="$cache/$name-$key"
if [ ! -f "$venv/.ready" ]; then
    echo "the '$name' environment is not built ($venv/.ready is missing; scripts/env.sh $name builds it)" >&2
    exit 1
fi
echo "$venv"

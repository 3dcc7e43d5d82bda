#!/usr/bin/env bash
# Usage: scripts/env.sh main|ipex  -> prints the path of a ready virtual environment.
#
# Two environments, because IPEX 2.8 (Intel's last release) pins torch 2.8.* while xformers
# 0.0.35 needs torch >= 2.10:
#   main: torch 2.13.0 (the CPU wheel on this machine's disk), xformers, jax, test + notebook deps
#   ipex: torch 2.8.*, intel-extension-for-pytorch 2.8.0, jax, test deps
# Environments live in a cache keyed by the hash of pyproject.toml and this script, so fresh
# clones on the same machine reuse them and any change to the dependencies builds new ones.
set -euo pipefail
name=${1:?usage: scripts/env.sh main|ipex}
root=$(cd "$(dirname "$0")/.." && pwd)
key=$(cat "$root/pyproject.toml" "$root/scripts/env.sh" | sha256sum | cut -c1-12)
cache=${JAX_ATTN_ENV_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/jax-attn}
venv="$cache/$name-$key"
py=${PYTHON:-python3.11}
command -v "$py" >/dev/null || py=python3

if [ ! -f "$venv/.ready" ]; then
    echo "[env] building the '$name' environment in $venv (once per dependency change)" >&2
    rm -rf "$venv"
    mkdir -p "$cache"
    "$py" -m venv "$venv"
    pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
    "${pip[@]}" --upgrade "pip>=24" setuptools wheel >&2
    case "$name" in
    main)
        # Pin the on-disk CPU wheel first: an unpinned torch would pull a multi-GB CUDA build.
        "${pip[@]}" "torch==2.13.0" >&2
        "${pip[@]}" -e "$root[torch,xformers,test,notebooks,cli]" >&2
        ;;
    ipex)
        "${pip[@]}" "torch==2.8.*" "intel-extension-for-pytorch==2.8.0" >&2
        "${pip[@]}" -e "$root[ipex,test,cli]" >&2
        ;;
    *)
        echo "unknown environment '$name' (known: main, ipex)" >&2
        exit 2
        ;;
    esac
    touch "$venv/.ready"
fi
# Point the editable install (and the jax-attn console script) at this checkout.
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
    --no-build-isolation -e "$root" >&2
echo "$venv"

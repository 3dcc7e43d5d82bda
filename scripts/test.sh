#!/usr/bin/env bash
# The whole test suite: the main environment (JAX core, TORCH_SDPA, XFORMERS, interop,
# notebooks), then the IPEX environment for the tests that need IPEX's kernels.
# Extra arguments go to both pytest runs.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

echo "== main environment: full suite (tests/ and the notebooks, executed by nbmake)"
paths=(tests)
if compgen -G "notebooks/*.ipynb" >/dev/null; then
    paths+=(--nbmake notebooks)
fi
JAX_ATTN_ENV=main bash scripts/run.sh python -m pytest -n 2 --dist loadgroup "${paths[@]}" "$@"

echo "== IPEX environment (torch 2.8 + IPEX 2.8): tests marked ipex"
set +e
# JAX_ATTN_REQUIRE_IPEX=1: fail unless IPEX imports and ipex tests pass, none skipped
# (tests/conftest.py); pytest's exit 5 (nothing collected) fails too.
JAX_ATTN_REQUIRE_IPEX=1 JAX_ATTN_ENV=ipex bash scripts/run.sh python -m pytest -m ipex tests "$@"
rc=$?
set -e
# pytest exits 5 when it collected nothing; that would mean the IPEX tests vanished.
if [ "$rc" -ne 0 ]; then
    echo "IPEX run failed (pytest exit $rc)" >&2
    exit "$rc"
fi

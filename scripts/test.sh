#!/usr/bin/env bash
# The whole test suite. First the main environment (JAX core, TORCH_SDPA, XFORMERS, interop,
# notebooks, the bench's vllm085-TORCH_SDPA peer), while the other environments build in the
# background. Then the other five stages, two at a time, the longest first: the vllm085
# environment, where the torch backends run inside vLLM 0.8.5's own engine; the tpu-aot
# environment, which compiles the Pallas TPU kernels for a v5e, v6e and v5p description; the vllm
# environment (vLLM 0.32: the bench's vllm-cpu-attn peer and the V1 plugin's engine tests); the
# gpu-aot environment, which compiles the Pallas kernels for an H100 and an A100 description; and
# the IPEX environment for the tests that need IPEX's kernels.
# Extra arguments go to every pytest run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# Each stage's wall time (environment build included) and pytest's 15 slowest tests, for the
# suite's time budget (issue 37: 60 minutes on a fresh clone, 30 with the environments cached).
timing=(--durations=15)
logs=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$logs"' EXIT

# Every environment but main's builds in the background from the start (pip's downloads and
# unpacking wait on the network and the disk more than on the cores), each into its log, while
# the main stage builds its own. A stage's own `scripts/env.sh` call waits on that build's lock
# and finds it ready (or, had it failed, builds it again in the stage's own output).
for name in vllm085 ipex vllm gpu-aot tpu-aot; do
    bash scripts/env.sh "$name" >"$logs/env-$name.log" 2>&1 &
done

# stage TITLE COMMAND...: one stage, its wall time after it. Its exit status is the command's
# (pytest's 5, nothing collected, fails too: a stage's tests vanished).
stage() {
    local title=$1 start=$SECONDS rc=0
    shift
    echo "== $title"
    "$@" || rc=$?
    echo "-- $title: $((SECONDS - start)) s (exit $rc, total $SECONDS s)"
    return "$rc"
}

main_stage() {
    local paths=(tests)
    if compgen -G "notebooks/*.ipynb" >/dev/null; then
        paths+=(--nbmake notebooks)
    fi
    # The bench's vllm085-TORCH_SDPA peer (tests marked vllm085_peer) runs from this
    # environment through the vllm085 environment's interpreter, which the bench only finds,
    # never builds: built here, before the suite, so that this stage has it (the vllm085 stage
    # reuses it). The main environment first: it builds here while vllm085's builds in the
    # background.
    bash scripts/env.sh main >/dev/null || return
    bash scripts/env.sh vllm085 >/dev/null || return
    echo "-- environments main and vllm085 ready: $SECONDS s into the suite"
    # JAX_ATTN_REQUIRE_NATIVE=1: fail unless the native CPU kernels (the default on CPU) build
    # here, and fail if any test skipped for want of them; JAX_ATTN_REQUIRE_VLLM085_PEER=1: fail
    # if a vllm085_peer test skipped or none passed (the skip audit, tests/conftest.py).
    JAX_ATTN_REQUIRE_NATIVE=1 JAX_ATTN_REQUIRE_VLLM085_PEER=1 JAX_ATTN_ENV=main bash scripts/run.sh \
        python -m pytest -n 2 --dist loadgroup "${timing[@]}" "${paths[@]}" "$@"
}

ipex_stage() {
    # JAX_ATTN_REQUIRE_IPEX=1: fail unless IPEX imports and ipex tests pass, none skipped
    # (tests/conftest.py).
    JAX_ATTN_REQUIRE_IPEX=1 JAX_ATTN_ENV=ipex bash scripts/run.sh \
        python -m pytest -m ipex "${timing[@]}" tests "$@"
}

vllm085_stage() {
    # JAX_ATTN_REQUIRE_VLLM085=1: fail unless vLLM 0.8.5 imports and vllm085 tests pass, none
    # skipped (tests/vllm085/conftest.py); JAX_ATTN_REQUIRE_NATIVE=1: the native torch ops build
    # here against torch 2.6, so TORCH_SDPA's decode in the conformance and engine tests is our
    # kernel against vLLM's. One process, no -n: every test starts vLLM engines, and those share
    # the process-wide state that vLLM's engine keeps.
    JAX_ATTN_REQUIRE_VLLM085=1 JAX_ATTN_REQUIRE_NATIVE=1 JAX_ATTN_ENV=vllm085 bash scripts/run.sh \
        python -m pytest -m vllm085 "${timing[@]}" tests "$@"
}

vllm_stage() {
    # JAX_ATTN_REQUIRE_VLLM=1: fail unless vLLM 0.32's CPU attention kernels import and the
    # vllm tests (the bench's vllm-cpu-attn peer against jax-xla; the vLLM plugin's pieces and
    # its engine runs with and without JAX_ATTN_VLLM=1, tests/torch/test_vllm_v1_*.py) pass, none
    # skipped (tests/benchmarks/conftest.py, tests/conftest.py).
    JAX_ATTN_REQUIRE_VLLM=1 JAX_ATTN_ENV=vllm bash scripts/run.sh \
        python -m pytest -m vllm "${timing[@]}" tests "$@"
}

gpu_aot_stage() {
    # JAX_PLATFORMS=cpu before JAX starts: the CUDA plugin then registers compile-only devices
    # instead of failing to find a GPU. JAX_ATTN_REQUIRE_GPU_AOT turns "cannot compile here"
    # from a skip into a failure.
    JAX_ATTN_ENV=gpu-aot JAX_PLATFORMS=cpu JAX_ATTN_REQUIRE_GPU_AOT=1 bash scripts/run.sh \
        python -m pytest -n 2 -m gpu_aot "${timing[@]}" tests/jax/test_gpu_compile.py "$@"
}

tpu_aot_stage() {
    # JAX_PLATFORMS=cpu before JAX starts, and libtpu kept from looking for a TPU host (no
    # metadata server, one described worker) and from its one-process lockfile (two pytest
    # workers each load it): docs/tpu.md. JAX_ATTN_REQUIRE_TPU_AOT turns "cannot compile here"
    # into a failure.
    JAX_ATTN_ENV=tpu-aot JAX_PLATFORMS=cpu JAX_ATTN_REQUIRE_TPU_AOT=1 \
        TPU_SKIP_MDS_QUERY=1 TPU_ACCELERATOR_TYPE=v5litepod-4 TPU_WORKER_HOSTNAMES=localhost \
        TPU_WORKER_ID=0 ALLOW_MULTIPLE_LIBTPU_LOAD=1 bash scripts/run.sh \
        python -m pytest -n 2 -m tpu_aot "${timing[@]}" tests/jax/test_tpu_compile.py "$@"
}

stage "main environment: full suite (tests/ and the notebooks, executed by nbmake)" main_stage "$@"

# The other stages in two lanes at once: each is mostly one process (vLLM's engines, IPEX's
# ops, XLA's compiles), so two lanes keep both cores busy. The stages wait in one queue, the
# longest first (their times in the clean-clone runs of NOTES.md: vllm085 350-620 s, tpu-aot
# 350-430, vllm 200-240, gpu-aot 130-140, IPEX 100-160), and a lane that finishes one takes the
# next, so neither lane idles while the other still has two stages to run. A failed stage fails
# the suite; the lane goes on with the queue. Each lane's output goes to its log, printed when
# both are done.
queue=(vllm085 tpu_aot vllm gpu_aot ipex)
declare -A titles=(
    [vllm085]="vllm085 environment (vLLM 0.8.5 on torch 2.6): tests marked vllm085"
    [tpu_aot]="tpu-aot environment (libtpu, no TPU): kernels compiled for v5e, v6e and v5p"
    [vllm]="vllm environment (vLLM 0.32 on torch 2.13): tests marked vllm"
    [gpu_aot]="gpu-aot environment (JAX's CUDA plugin, no GPU): kernels compiled for H100 and A100"
    [ipex]="IPEX environment (torch 2.8 + IPEX 2.8): tests marked ipex"
)
echo 0 >"$logs/next"
take() {  # the queue's next index, one lane at a time
    (
        flock 8
        local n
        n=$(cat "$logs/next")
        echo $((n + 1)) >"$logs/next"
        echo "$n"
    ) 8>"$logs/next.lock"
}
lane() {
    local rc=0 i
    while i=$(take) && [ "$i" -lt "${#queue[@]}" ]; do
        stage "${titles[${queue[$i]}]}" "${queue[$i]}_stage" "$@" || rc=1
    done
    return "$rc"
}
lane "$@" >"$logs/lane-1.log" 2>&1 &
lane1=$!
lane "$@" >"$logs/lane-2.log" 2>&1 &
lane2=$!
rc1=0 rc2=0
wait "$lane1" || rc1=$?
wait "$lane2" || rc2=$?
cat "$logs/lane-1.log" "$logs/lane-2.log"
echo "-- all stages: $SECONDS s"
if [ "$rc1" -ne 0 ] || [ "$rc2" -ne 0 ]; then
    echo "a stage failed (lane exits $rc1, $rc2)" >&2
    exit 1
fi

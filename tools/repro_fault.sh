#!/usr/bin/env bash
# Session 66's unexplained illegal memory access (docs/results.md, "Correctness runs on the GPU"): generate's
# kept-step test, run after three leaderboard tests in one process, faulted 4 runs of 4 on one H100 (torch
# 2.11, DSL 4.3.5); alone it passes. Usage: tools/repro_fault.sh [MODE], MODE one of plain (the default),
# each, blocking, memcheck, memcheck-cached: plain runs the kept-step test alone (the control), then the four
# in order; each runs each of the three leaderboard tests alone before it (which one it takes); blocking the
# four with CUDA_LAUNCH_BLOCKING=1 (the faulting kernel named, if the fault survives it); memcheck the four
# under compute-sanitizer with one allocation a tensor (PYTORCH_NO_CUDA_MEMORY_CACHING=1: a read or write
# past a tensor is then past its allocation, which memcheck reports); memcheck-cached the four under memcheck
# with the caching allocator (the fault as it happens: a read past a segment's end, inside a graph too).
# Needs a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-plain}
if [[ $MODE == -h || $MODE == --help ]]; then sed -n '2,11p' "$0" | cut -c3-; exit 0; fi
KEPT="tests/model/test_generate.py::test_gpu_a_second_call_replays_the_kept_step_without_capturing"
ORDER=("tests/leaderboard/test_dynamic_tiles.py::test_every_tile_is_done_once_and_the_counters_end_at_zero[128-7168-200]"
       "tests/leaderboard/test_split_kernel.py::test_split_kernel_matches_float64[384-7168-2-tuning2-permuted-scales]"
       "tests/leaderboard/test_split_kernel.py::test_split_kernel_matches_float64[1024-2048-3-tuning9-permuted-scales]"
       "$KEPT")
PYTEST=(python -m pytest -q -p no:cacheprovider)
case $MODE in
    plain) echo "== control: $KEPT alone"; "${PYTEST[@]}" "$KEPT" | tail -n 1
           echo "== in order"; "${PYTEST[@]}" "${ORDER[@]}" | tail -n 3 ;;
    each) for t in "${ORDER[@]:0:3}"; do echo "== $t, then the kept step"; "${PYTEST[@]}" "$t" "$KEPT" | tail -n 1; done ;;
    blocking) export CUDA_LAUNCH_BLOCKING=1
              echo "== in order, CUDA_LAUNCH_BLOCKING=1"; "${PYTEST[@]}" "${ORDER[@]}" 2>&1 | grep -E "Error|error|passed|failed|skipped" | head -n 20 ;;
    memcheck) PYTORCH_NO_CUDA_MEMORY_CACHING=1 ${COMPUTE_SANITIZER:-compute-sanitizer} --tool memcheck \
                  --target-processes all "${PYTEST[@]}" "${ORDER[@]}" 2>&1 | tail -n 60 ;;
    memcheck-cached) ${COMPUTE_SANITIZER:-compute-sanitizer} --tool memcheck --target-processes all \
                         "${PYTEST[@]}" "${ORDER[@]}" 2>&1 | tail -n 60 ;;
    *) echo "usage: tools/repro_fault.sh [plain|each|blocking|memcheck|memcheck-cached] (--help: what each does)"; exit 2 ;;
esac

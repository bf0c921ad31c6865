#!/usr/bin/env bash
# Session 66's illegal memory access (docs/results.md, "Correctness runs on the GPU"; found in session 69: a
# W4A16 load of x hoisted past its guard, docs/design.md "Loads in inline asm"): generate's kept-step test, run
# after three leaderboard tests in one process, faulted 4 runs of 4 on one H100 (torch 2.11, DSL 4.3.5); alone
# it passed. Usage: tools/repro_fault.sh [MODE], MODE one of plain (the default), each, blocking, memcheck,
# memcheck-cached, memcheck-alone: plain runs the kept-step test alone (the control), then the four in order;
# each runs each of the three leaderboard tests alone before it (which one it takes); blocking the four with
# CUDA_LAUNCH_BLOCKING=1 (the faulting kernel named, if the fault survives it); memcheck the four under compute-
# sanitizer with one allocation a tensor (PYTORCH_NO_CUDA_MEMORY_CACHING=1: a read or write past a tensor is
# then past its allocation, which memcheck reports); memcheck-cached the four under memcheck with the caching
# allocator (the fault as it happens: a read past a segment's end, inside a graph too); memcheck-alone the
# generate tests that faulted (this one, and in session 68's suite the failed-capture test after other
# leaderboard tests) without the leaderboard tests, one allocation a tensor: a read past a tensor that only
# faults where the allocator's layout puts unmapped memory after it is reported whatever ran before (captures
# may fail there: generate then runs the step eagerly, which memcheck still sees). The memcheck modes print at
# most 20 errors and no tail: a run cut off by a timeout keeps what it printed. nocache runs the four with one
# allocation a tensor and no sanitizer; all runs every mode but memcheck at once, each its own process and log
# in LOGS (default repro-logs), plain with the DSL's launch too, and tools/repro_variant.py's other models and
# eager attention.
# Needs a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-plain}
if [[ $MODE == -h || $MODE == --help ]]; then sed -n '2,20p' "$0" | cut -c3-; exit 0; fi
KEPT="tests/model/test_generate.py::test_gpu_a_second_call_replays_the_kept_step_without_capturing"
CAPFAIL="tests/model/test_generate.py::test_gpu_a_step_that_cannot_be_captured_runs_eagerly"
CAPFAIL+="_warns_once_and_keeps_nothing"
MEMCHECK=(${COMPUTE_SANITIZER:-compute-sanitizer} --tool memcheck --print-limit 20 --target-processes all)
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
              echo "== in order, CUDA_LAUNCH_BLOCKING=1"; "${PYTEST[@]}" "${ORDER[@]}" 2>&1 | grep -v "^  warnings.warn" | tail -n 300 ;;
    memcheck) PYTORCH_NO_CUDA_MEMORY_CACHING=1 "${MEMCHECK[@]}" "${PYTEST[@]}" "${ORDER[@]}" 2>&1 ;;
    memcheck-cached) "${MEMCHECK[@]}" "${PYTEST[@]}" "${ORDER[@]}" 2>&1 ;;
    memcheck-alone) log=$(mktemp); trap 'rm -f "$log"' EXIT
                    PYTORCH_NO_CUDA_MEMORY_CACHING=1 "${MEMCHECK[@]}" "${PYTEST[@]}" "$KEPT" "$CAPFAIL" 2>&1 | tee "$log"
                    rc=${PIPESTATUS[0]}
                    # what counts: reads and writes out of bounds. Without the caching allocator a capture's
                    # cudaMalloc is refused (12 API errors, both tests fail: session 70), so the step runs eagerly
                    echo "== memory access errors printed (at most the print limit): $(grep -c 'Invalid __' "$log")"
                    exit "$rc" ;;
    nocache) echo "== in order, PYTORCH_NO_CUDA_MEMORY_CACHING=1"
             PYTORCH_NO_CUDA_MEMORY_CACHING=1 "${PYTEST[@]}" "${ORDER[@]}" 2>&1 | tail -n 3 ;;
    all) LOGS=${2:-repro-logs}; mkdir -p "$LOGS"  # every mode at once, one process each (~8 min on one H100)
         for m in blocking each plain nocache memcheck-alone memcheck-cached; do
             timeout "${SECS:-480}" "$0" "$m" > "$LOGS/$m.txt" 2>&1 &
         done
         NVFP4_GEMV_LAUNCH=dsl timeout "${SECS:-480}" "$0" plain > "$LOGS/plain-dsl.txt" 2>&1 &
         for v in bf16 w4a16 w4a16-fused "w4a16-fused-packed eager" "w4a16-fused-packed sdpa --alone"; do
             timeout "${SECS:-480}" python tools/repro_variant.py $v > "$LOGS/variant-${v// /-}.txt" 2>&1 &
         done
         wait; for f in "$LOGS"/*.txt; do echo "== $f"; tail -n 6 "$f"; done ;;
    *) echo "usage: tools/repro_fault.sh [plain|each|blocking|nocache|memcheck|memcheck-cached|memcheck-alone|all [LOGS]]" \
            "(--help: what each does)"; exit 2 ;;
esac

#!/usr/bin/env bash
# compute-sanitizer over the configuration pick_tuning chooses for every task.yml shape (benchmarks
# included) and three shapes of the streaming kernel's wide scale loads (each case names its kernel class):
# memcheck (plus fuzz shapes), racecheck (shared memory: CTA barriers, the bulk kernel's mbarriers, the wide
# loads' per-warp scratch) and synccheck; the experts' grouped kernel, the routing and the dequantize kernels under
# memcheck (in `all`), the first two under racecheck, the router under synccheck.
# Usage: tools/sanitize.sh   (needs a GPU and compute-sanitizer on PATH)
set -euo pipefail
cd "$(dirname "$0")/.."
SAN=${COMPUTE_SANITIZER:-compute-sanitizer}
run() { "$SAN" --tool "$1" --error-exitcode 9 --target-processes all python3 tools/sanitize_cases.py "${@:2}"; }
run memcheck all
run racecheck task
run synccheck task
run racecheck experts  # (memcheck all ran its cases)
run racecheck router
run synccheck router  # (its CTA barrier before the count, the last CTA's warp barrier)
# a read past a tensor inside one of the caching allocator's segments is invisible to memcheck: the model's
# decode and the W4A16 cases again with one allocation a tensor
PYTORCH_NO_CUDA_MEMORY_CACHING=1 run memcheck model
PYTORCH_NO_CUDA_MEMORY_CACHING=1 run memcheck w4a16
echo "compute-sanitizer: memcheck, racecheck and synccheck clean"

#!/usr/bin/env bash
# compute-sanitizer (memcheck) over every task.yml shape and a few fuzz shapes; shared memory hazards
# (CTA barrier, and the bulk kernel's mbarriers) with racecheck, barrier use with synccheck, on a few.
# Usage: tools/sanitize.sh   (needs a GPU and compute-sanitizer on PATH)
set -euo pipefail
cd "$(dirname "$0")/.."
SAN=${COMPUTE_SANITIZER:-compute-sanitizer}
run() { "$SAN" --tool "$1" --error-exitcode 9 --target-processes all python3 tools/sanitize_cases.py "${@:2}"; }
run memcheck all
run racecheck small
run synccheck small
echo "compute-sanitizer: memcheck, racecheck and synccheck clean"

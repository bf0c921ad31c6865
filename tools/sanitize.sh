#!/usr/bin/env bash
# compute-sanitizer (memcheck) over every task.yml shape and a few fuzz shapes; the kernel uses shared
# memory only behind a CTA barrier, checked with racecheck on a few shapes.
# Usage: tools/sanitize.sh   (needs a GPU and compute-sanitizer on PATH)
set -euo pipefail
cd "$(dirname "$0")/.."
SAN=${COMPUTE_SANITIZER:-compute-sanitizer}
run() { "$SAN" --tool "$1" --error-exitcode 9 --target-processes all python3 tools/sanitize_cases.py "${@:2}"; }
run memcheck all
run racecheck small
echo "compute-sanitizer: memcheck and racecheck clean"

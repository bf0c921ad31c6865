#!/usr/bin/env bash
# Times W4A16 kernel tunings on a few shapes (ours only, no floors): tools/sweep_w4a16.sh SHAPES NS TUNE...
# PARALLEL=1: one process a tuning, compiling at once and timing one at a time (bench_w4a16.py --lock);
# per-tuning outputs in $DIR (default a new temporary folder); a process that holds $LOCK (default
# /tmp/w4a16-sweep.lock) first, e.g. a test run, delays the timings. A tuning that fails leaves its
# traceback in its output.
shapes=$1; ns=$2; shift 2
run() {
    python tools/bench_w4a16.py --shapes "$shapes" --n "$ns" --reps 30 --no-floor --no-peers ${1:+--tune $1} $2 2>&1 \
        | grep -v -i warn
}
if [[ -z ${PARALLEL:-} ]]; then
    for t in "$@"; do echo "== tuning: ${t:-default}"; run "$t"; done
    exit 0
fi
dir=${DIR:-$(mktemp -d)}; mkdir -p "$dir"; i=0
lock=${LOCK:-/tmp/w4a16-sweep.lock}
# every process of this sweep compiles before any times (LOCK.ready/ counts them; a process that dies
# before it compiled holds the others until bench_w4a16's 30-minute limit). SWEEP_PROCS: the processes of
# all the sweeps that share the lock (default this sweep's); whoever sets it empties LOCK.ready/ first
[[ -z ${SWEEP_PROCS:-} ]] && rm -rf "$lock.ready"
for t in "$@"; do run "$t" "--lock $lock --barrier ${SWEEP_PROCS:-$#}" > "$dir/$i.txt" & i=$((i + 1)); done
wait
i=0
for t in "$@"; do echo "== tuning: ${t:-default}"; cat "$dir/$i.txt"; i=$((i + 1)); done

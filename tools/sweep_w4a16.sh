#!/usr/bin/env bash
# Times W4A16 kernel tunings on a few shapes (ours only, no floors): tools/sweep_w4a16.sh SHAPES NS TUNE...
shapes=$1; ns=$2; shift 2
for t in "$@"; do
    echo "== tuning: ${t:-default}"
    python tools/bench_w4a16.py --shapes "$shapes" --n "$ns" --reps 30 --no-floor --no-peers ${t:+--tune $t} 2>&1 \
        | grep -v -i warn
done

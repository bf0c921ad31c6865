"""What a read of N bytes costs under leaderboard timing: times the kernel, its memory side alone
(``probe=1``: loads kept, arithmetic dropped) and the bulk-copy kernel's memory side over a range of
M, with the L2 dirty (the leaderboard's flush) and clean, and fits ``t = t0 + bytes / BW`` to each.

    python tools/floor_fit.py --k 16384 --l 1 --ms 1024,2048,4096,7168,14336,28672,57344
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import reference  # noqa: E402
from nvfp4_gemv import leaderboard  # noqa: E402
from bench import bytes_moved, time_leaderboard  # noqa: E402

COLUMNS = {"kernel": None, "probe": (("probe", 1),), "bulk probe": (("bulk", 1), ("evict", 1), ("probe", 1))}


def fit(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=16384)
    p.add_argument("--l", type=int, default=1)
    p.add_argument("--ms", default="1024,2048,4096,7168,14336,28672,57344")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--fit-from", type=float, default=30e6, help="fit only sizes of at least this many bytes")
    args = p.parse_args()
    k, l = args.k, args.l
    rows = []
    print(f"K={k} L={l}: us (leaderboard timing, median of {args.reps}); 'clean' = L2 holds clean lines")
    print(f"{'M':>6} {'MB':>7} " + " ".join(f"{c + ' ' + d:>17}" for c in COLUMNS for d in ("dirty", "clean")))
    for m in (int(v) for v in args.ms.split(",")):
        data = reference.generate_input(m, k, l, 7)
        shape = leaderboard.check_inputs(data)
        times = []
        for tune in COLUMNS.values():
            def run(t=tune, d=data, shape=shape):
                return leaderboard.custom_kernel(d) if t is None else leaderboard.run_cute(d, *shape, tuning=t)
            times += [time_leaderboard(run, args.reps), time_leaderboard(run, args.reps, clean=True)]
        nbytes = bytes_moved(m, k, l)
        rows.append((nbytes, times))
        print(f"{m:>6} {nbytes / 1e6:7.1f} " + " ".join(f"{t:17.2f}" for t in times), flush=True)
        del data
    big = [r for r in rows if r[0] >= args.fit_from]
    if len(big) >= 2:
        print(f"fit over sizes >= {args.fit_from / 1e6:.0f} MB: t = t0 + bytes / BW")
        for i, name in enumerate(f"{c} {d}" for c in COLUMNS for d in ("dirty", "clean")):
            t0, slope = fit([r[0] for r in big], [r[1][i] for r in big])
            print(f"  {name:>17}: t0 {t0:6.2f} us, BW {1 / slope / 1e6:5.2f} TB/s")


if __name__ == "__main__":
    main()

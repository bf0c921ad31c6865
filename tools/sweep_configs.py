"""Times the kernel configurations that ``pick_tuning`` chooses between (streaming with two-byte or 16-byte
scale loads, latency configs, the split-row kernel's splits, the bulk kernel), per shape, the leaderboard's
way (L2 flushed, CUDA events, median of 50), each checked on signed random inputs.

    python tools/sweep_configs.py 256x7168x1,2432x4608x2
    python tools/sweep_configs.py 7168x16384x1 "bulk=1;bulk=1,warps=8,ctas=1"   # these tunings instead
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import inputs  # noqa: E402
import reference  # noqa: E402
from nvfp4_gemv import launch, leaderboard, streaming  # noqa: E402
from nvfp4_gemv.tuning import BULK_MIN_K, bulk_suits, make_op, pick_tuning  # noqa: E402
from bench import time_leaderboard  # noqa: E402

G = streaming.Nvfp4Gemv


def variants(m, k, l):
    chunks = k // 32
    g = min(32, chunks & -chunks)
    lat = {"batch": chunks // g, "group": g, "min_blocks": 2}
    out = [{"depth": 2}, lat, {**lat, "min_blocks": 3}, {**lat, "depth": 1}]
    if g == 32:
        out.append({"batch": 2 * chunks // g, "group": g // 2, "min_blocks": 2})
    per = G(k, False).per_lane
    if per % 3 == 0 and per > 3:
        out.append({"batch": 3, "min_blocks": 3})
    try:  # the streaming kernel with its scales in 16-byte loads, at 2-4 CTAs a SM
        G(k, False, sf_wide=1)
        out += [{"sf_wide": 1}, {"sf_wide": 1, "min_blocks": 2}, {"sf_wide": 1, "min_blocks": 3},
                {"sf_wide": 1, "min_blocks": 4}]
    except ValueError:
        pass
    # the split kernel: 2+ warps a row, <= 4 chunks a lane (the last one past the row where K % 1024 != 0)
    for split in (s for s in range(2, 33) if (s - 1) * 32 < chunks and -(-chunks // (32 * s)) <= 4):
        for rows in (1, 2, 4):
            if rows * 32 * split <= 1024:
                out.append({"split": split, "rows": rows, "min_blocks": max(1, 1024 // (rows * 32 * split))})
    if BULK_MIN_K <= k and bulk_suits(k):
        out.append({"bulk": 1})
    return out


def parse_tunings(text):
    return [{kv.split("=")[0]: int(kv.split("=")[1]) for kv in t.split(",") if kv} for t in text.split(";")]


def main():
    explicit = parse_tunings(sys.argv[2]) if len(sys.argv) > 2 else None
    for m, k, l in (tuple(int(v) for v in s.split("x")) for s in sys.argv[1].split(",")):
        data = reference.generate_input(m, k, l, 1111)
        signed = inputs.random_inputs(m, k, l, seed=5)
        shape = leaderboard.check_inputs(data)
        seen, res = set(), []
        for v in explicit or variants(m, k, l):
            t = tuple(sorted(v.items()))
            if t in seen:
                continue
            seen.add(t)
            try:
                make_op(k, False, **v)
            except ValueError:
                continue
            ok, _ = inputs.check_exact(
                signed, leaderboard.run_cute(inputs.poisoned(signed), *shape, tuning=t))
            us = time_leaderboard(lambda t=t: leaderboard.run_cute(data, *shape, tuning=t), 50)
            res.append((us, t, ok))
        chosen = dict(pick_tuning(k, m, l, launch.device_info(0)[1], False))
        print(f"{m}x{k}x{l}: custom_kernel {time_leaderboard(lambda: leaderboard.custom_kernel(data), 50):.2f} us"
              f" (chooses {chosen or 'the streaming default'})")
        for us, t, ok in sorted(res):
            print(f"   {us:7.2f} {'ok' if ok else 'WRONG'} {dict(t)}")


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):  # the docstring, and nothing run
        sys.exit(print(__doc__) or 0)
    main()

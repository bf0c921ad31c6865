"""Fuzzes nvfp4_gemv.gemv on the GPU against float64: random N, M, K, scale layouts, dtypes and alpha;
each output must be within half an ulp of its dtype plus 2^-14 of the sum of |terms| (NVFP4 x), or 2^-13
(``--w4a16``: bf16/fp16 x as it is, signed scales over the whole e4m3 range, subnormals included).

    python tools/fuzz_op.py --cases 300            # must print 'mismatches: 0'
    python tools/fuzz_op.py --cases 300 --w4a16 --jobs 6   # six processes (seeds seed .. seed + 5)

Each new configuration compiles on its first case (CPU-bound, seconds), so processes in parallel finish sooner.
"""

import argparse
import os
import random
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "tests", "op"))
import torch  # noqa: E402

import inputs  # noqa: E402
from nvfp4_gemv import gemv  # noqa: E402
from test_gemv_accuracy import assert_exact, blocked  # noqa: E402
from w4a16_inputs import w4a16_exact, w4a16_inputs, w4a16_violations  # noqa: E402

KS = (64, 256, 2048 + 320, 7168)  # few K values: each (K, N, layout) compiles once
NS = (1, 2, 3, 4, 6, 8, 11, 16, 20)
W4A16_KS = (64, 192, 1024, 4160, 14336)  # K % 128 == 64 among them
W4A16_NS = (1, 2, 5, 8, 9, 16, 17, 25, 32, 40)  # every 8-token half, both A tiles, two launches


def w4a16_case(rnd):
    """One W4A16 case: ``(description, violations, message)``."""
    n, k = rnd.choice(W4A16_NS), rnd.choice(W4A16_KS)
    m = 128 * rnd.randint(1, 24)
    x_dtype, out_dtype = rnd.choice((torch.bfloat16, torch.float16)), rnd.choice((torch.bfloat16, torch.float16))
    wb, has_alpha, cancel = rnd.random() < 0.3, rnd.random() < 0.8, rnd.random() < 0.2
    x, _, w, ws, a = w4a16_inputs(n, m, k, seed=rnd.randrange(1 << 30), dtype=x_dtype, blocked=wb, alpha=has_alpha,
                                  cancel=cancel)
    out = torch.full((n, m), float("nan"), dtype=out_dtype, device="cuda")
    gemv(x, None, w, ws, a, out=out)
    torch.cuda.synchronize()
    bad, msg = w4a16_violations(out, *w4a16_exact(x, w, ws, a, wb))
    return f"N={n} M={m} K={k} x {x_dtype} out {out_dtype} w_blocked={wb} alpha={has_alpha} cancel={cancel}", bad, msg


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", type=int, default=300)
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--w4a16", action="store_true", help="bf16/fp16 x (the W4A16 form)")
    p.add_argument("--jobs", type=int, default=1, help="processes, the cases split between them (seeds seed + i)")
    args = p.parse_args()
    if args.jobs > 1:
        return fan_out(args)
    rnd = random.Random(args.seed)
    bad = 0
    for i in range(args.cases):
        if i and i % 25 == 0:  # progress (each new configuration compiles first: a case can take seconds)
            print(f"{i} cases, {bad} with mismatches", flush=True)
        if args.w4a16:
            what, n_bad, msg = w4a16_case(rnd)
            if n_bad:
                bad += 1
                print(f"case {i}: {what}: {msg}")
            continue
        n, k = rnd.choice(NS), rnd.choice(KS)
        m = 128 * rnd.randint(1, 24)
        dtype = rnd.choice((torch.bfloat16, torch.float16))
        wb, xb, has_alpha = rnd.random() < 0.3, rnd.random() < 0.2, rnd.random() < 0.8
        x, xs, w, ws, a = inputs.op_inputs(n, m, k, seed=rnd.randrange(1 << 30), alpha=has_alpha)
        ops = (x, blocked(xs, n, k) if xb else xs, w, blocked(ws, m, k) if wb else ws, a)
        out = torch.full((n, m), float("nan"), dtype=dtype, device="cuda")
        gemv(*ops, out=out)
        torch.cuda.synchronize()
        try:
            assert_exact(ops, out, k)
        except AssertionError as e:
            bad += 1
            print(f"case {i}: N={n} M={m} K={k} {dtype} w_blocked={wb} x_blocked={xb} alpha={has_alpha}: {e}")
    print(f"cases: {args.cases}\nmismatches: {bad}")
    return 1 if bad else 0


def fan_out(args):
    """Runs ``--jobs`` copies of this script at once, each with its share of the cases and its own seed."""
    shares = [c for c in (args.cases // args.jobs + (i < args.cases % args.jobs) for i in range(args.jobs)) if c]
    procs = [subprocess.Popen([sys.executable, __file__, "--cases", str(c), "--seed", str(args.seed + i)]
                              + (["--w4a16"] if args.w4a16 else []), stdout=subprocess.PIPE, text=True)
             for i, c in enumerate(shares)]
    bad, failed = 0, 0
    for i, proc in enumerate(procs):
        out = proc.communicate()[0]
        lines = out.splitlines()
        print(f"-- seed {args.seed + i}, {shares[i]} cases, exit {proc.returncode}")
        print("\n".join(line for line in lines if line.startswith("case ")))
        done = [line for line in lines if line.startswith("mismatches: ")]
        if proc.returncode not in (0, 1) or not done:
            failed += 1
            print(out[-2000:])
        else:
            bad += int(done[-1].split()[1])
    print(f"cases: {args.cases}\nmismatches: {bad}" + (f"\nprocesses that did not finish: {failed}" if failed else ""))
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())

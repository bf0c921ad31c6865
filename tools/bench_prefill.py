"""W4A16 at prefill sizes (``DEQUANT_MIN_TOKENS`` tokens and more): the op's many-token path (the weight
dequantized by ``dequant_kernel``, then one ``torch.mm``), plain and packed, against bf16 ``torch.mm`` on the
same shapes (the peer), the path it replaced (``op_plan.dequantized``'s torch ops, then ``torch.mm``) and
the W4A16 kernel in passes of 32 tokens (what ``DEQUANT_MIN_TOKENS`` chooses against). The dequantizer alone
is reported in GB/s of its bytes (0.56 read + 2 written a value), its one-block and ``pair`` builds, beside
a bf16 ``copy_`` of the same output (2 + 2 bytes a value). Each result is first checked against the float64 product (the op's bound for
this path: half an ulp plus 2^-12 of the sum of |terms|). Timed the leaderboard's way (L2 flushed, CUDA
events, median).

    python tools/bench_prefill.py --out docs/bench-prefill-h100          # writes .md and .json
    python tools/bench_prefill.py --shapes 4096x4096 --n 256 --reps 10
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import torch  # noqa: E402

from bench import time_leaderboard  # noqa: E402
from nvfp4_gemv import gemv, gemv_packed, op_plan  # noqa: E402
from nvfp4_gemv import dequant_kernel  # noqa: E402
from nvfp4_gemv.dequant_kernel import dequantize_cuda  # noqa: E402
from nvfp4_gemv.packed import pack_weight  # noqa: E402
from w4a16_inputs import w4a16_exact, w4a16_inputs, w4a16_violations  # noqa: E402

SHAPES = "6144x4096,4096x4096,28672x4096,4096x14336"  # Llama-3-8B's layer, q/k/v and gate/up fused
NS = "129,256,512,1024"


def bench_case(m, k, n, reps, check):
    x, _, w, ws, a = w4a16_inputs(n, m, k, seed=n + m)
    wp = pack_weight(w, ws)
    wd = op_plan.dequantized(w, ws, k, False, torch.bfloat16)  # the peer's bf16 weight: the same values
    exact, terms = w4a16_exact(x, w, ws, a) if check else (None, None)
    out = torch.full((n, m), float("nan"), dtype=torch.bfloat16, device="cuda")
    row = {"M": m, "K": k, "N": n}
    for name, fn in (("ours", lambda: gemv(x, None, w, ws, a, out=out)),
                     ("ours_packed", lambda: gemv_packed(x, wp, a, out=out))):
        out.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        if check:
            row[f"{name}_violations"] = w4a16_violations(out, exact, terms, slack=2.0 ** -12)[0]
        row[f"{name}_us"] = time_leaderboard(fn, reps)

    def passes():
        for t0 in range(0, n, 32):
            gemv(x[t0:t0 + 32], None, w, ws, a, out=out[t0:t0 + 32])

    out.fill_(float("nan"))
    passes()
    torch.cuda.synchronize()
    if check:
        row["passes32_violations"] = w4a16_violations(out, exact, terms)[0]
    row["passes32_us"] = time_leaderboard(passes, reps)

    def before():  # session 70's path: torch ops, then torch.mm
        res = torch.mm(x, op_plan.dequantized(w, ws, k, False, x.dtype).T, out_dtype=torch.float32)
        out.copy_((res * a.reshape(())).to(torch.bfloat16))

    row["before_us"] = time_leaderboard(before, reps)
    row["bf16_mm_us"] = time_leaderboard(lambda: torch.mm(x, wd.T, out=out), reps)
    buf = torch.empty(m, k, dtype=torch.bfloat16, device="cuda")
    row["dequant_us"] = time_leaderboard(lambda: dequantize_cuda(w, ws, buf, k), reps)
    row["dequant_pair_us"] = time_leaderboard(lambda: dequantize_cuda(w, ws, buf, k, pair=True), reps)
    buf.fill_(float("nan"))
    dequantize_cuda(w, ws, buf, k, pair=True)
    row["dequant_pair_equal"] = bool(torch.equal(buf.view(torch.int16), wd.view(torch.int16)))  # bit for bit
    row["dequant_pair_built"] = any(key[-1] for key in dequant_kernel._kernels._kernels)  # the pair build ran
    row["copy_us"] = time_leaderboard(lambda: buf.copy_(wd), reps)
    row["dequant_GBps"] = m * k * (2 + 9 / 16) / row["dequant_us"] / 1e3
    row["dequant_pair_GBps"] = m * k * (2 + 9 / 16) / row["dequant_pair_us"] / 1e3
    row["copy_GBps"] = m * k * 4 / row["copy_us"] / 1e3
    row["ours_vs_bf16"] = row["bf16_mm_us"] / row["ours_us"]
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--n", default=NS)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None, help="path stem: writes STEM.md and STEM.json")
    args = p.parse_args(argv)
    rows = []
    for shape in args.shapes.split(","):
        m, k = (int(v) for v in shape.split("x"))
        for n in (int(v) for v in args.n.split(",")):
            row = bench_case(m, k, n, args.reps, n <= 256)  # float64 on the CPU: the small N only
            rows.append(row)
            print(json.dumps({key: round(v, 2) if isinstance(v, float) else v for key, v in row.items()}), flush=True)
    cols = ("M", "K", "N", "bf16_mm_us", "ours_us", "ours_packed_us", "before_us", "passes32_us", "dequant_us",
            "dequant_GBps", "dequant_pair_GBps", "dequant_pair_equal", "dequant_pair_built", "copy_GBps", "ours_violations", "ours_packed_violations", "passes32_violations")
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}; us, median of {args.reps} (L2 flushed)", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(f"{r[c]:.1f}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols) + " |"
              for r in rows]
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".md", "w") as f:
            f.write(text + "\n")
        with open(args.out + ".json", "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

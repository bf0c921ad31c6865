"""Mode "w4a4" of ``NVFP4Linear`` by its two routes, on the GPU, per weight shape and token count: the W4A4 op
(``quantize`` + ``gemv`` on NVFP4 x, w read once per 16 tokens) against the W4A16 op on x's quantized
values (``quantize_dequantized`` + ``gemv`` on bf16 x, w read once per 32 tokens, dequantized for one
``torch.mm`` from 129). Both compute the same exact value; this decides ``linear.W4A4_VIA_W4A16_FROM``.

Timed the leaderboard's way (L2 flushed before each run, CUDA events, median) and as back-to-back
CUDA-graph replays of the two kernels, next to the plain read of w's bytes (``tools/read_floor.py``) and
the dequantized quantize kernel alone. Before timing, both routes' results are checked against the float64
value of the exact W4A4 product (half an ulp plus 2^-13 of the sum of |terms|, the W4A16 op's bound; the
W4A4 op's is tighter), and the quantize kernel's dequantized output bit for bit against its reference.

    python tools/bench_w4a4_route.py --out docs/bench-w4a4-route-h200      # writes .md and .json
    python tools/bench_w4a4_route.py --shapes 4096x4096 --n 16,17,32 --reps 20
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import torch  # noqa: E402

from bench import time_graph, time_leaderboard  # noqa: E402
from nvfp4_gemv import gemv, quantize  # noqa: E402
from nvfp4_gemv.quant import quantize_dequantized, quantize_dequantized_reference  # noqa: E402
from w4a16_inputs import w4a16_exact, w4a16_inputs, w4a16_violations  # noqa: E402

SHAPES = "6144x4096,4096x4096,28672x4096,4096x14336,8192x28672,7168x16384,4096x7168"
NS = "16,17,24,32,64,128,256"


def bench_case(m, k, n, reps, floor):
    x, _, w, ws, _ = w4a16_inputs(n, m, k, seed=n + m, min_exp=1, max_exp=12)
    x = x * 0.01  # activations of a calibrated layer: |x| * gs within e4m3's range
    gs = torch.tensor([448 * 6 / x.abs().max().item()], device="cuda")  # 1 / input_scale of this x
    alpha = torch.tensor([0.003], device="cuda")
    out_a = torch.full((n, m), float("nan"), dtype=torch.bfloat16, device="cuda")
    out_b = torch.full_like(out_a, float("nan"))

    def w4a4():
        xq, xs = quantize(x, gs)
        return gemv(xq, xs, w, ws, alpha, out=out_a)

    def via_w4a16():
        return gemv(quantize_dequantized(x, gs), None, w, ws, alpha, out=out_b)

    w4a4()
    via_w4a16()
    xd = quantize_dequantized(x, gs)
    torch.cuda.synchronize()
    exact_xd = torch.equal(xd.cpu(), quantize_dequantized_reference(x.cpu(), gs.cpu()))
    if n <= 32 and m * k <= 8192 * 28672:
        exact, terms = w4a16_exact(xd, w, ws, alpha)  # x's quantized values: the exact W4A4 product
        bad_a, msg_a = w4a16_violations(out_a, exact, terms)
        bad, msg = w4a16_violations(out_b, exact, terms)
        bad, msg = bad + bad_a, ("w4a4: " + msg_a if bad_a else msg)
    else:
        bad, msg = 0, "bound not checked (size)"
    row = {"m": m, "k": k, "n": n, "floor_us": floor,
           "w4a4_us": time_leaderboard(w4a4, reps), "via_w4a16_us": time_leaderboard(via_w4a16, reps),
           "w4a4_graph_us": time_graph(w4a4, reps), "via_w4a16_graph_us": time_graph(via_w4a16, reps),
           "quantize_dequantized_us": time_leaderboard(lambda: quantize_dequantized(x, gs), reps),
           "dequantized_exact": exact_xd, "ok": bad == 0 and exact_xd, "check": msg}
    row["ratio"] = row["via_w4a16_us"] / row["w4a4_us"]
    row["ratio_graph"] = row["via_w4a16_graph_us"] / row["w4a4_graph_us"]
    print(f"{m}x{k} N={n:3d}: w4a4 {row['w4a4_us']:7.2f} us (graph {row['w4a4_graph_us']:7.2f}) | via w4a16 "
          f"{row['via_w4a16_us']:7.2f} (graph {row['via_w4a16_graph_us']:7.2f}) x{row['ratio']:.2f} | floor "
          f"{floor:6.2f} | qdq {row['quantize_dequantized_us']:5.2f} | "
          f"{'ok' if row['ok'] else msg + ('' if exact_xd else ', dequantized x NOT exact')}", flush=True)
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--n", default=NS)
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from read_floor import floor_us

    rows = []
    for shape in args.shapes.split(","):
        m, k = (int(v) for v in shape.split("x"))
        floor, _ = floor_us(m * k // 2 + m * k // 16, max(1, args.reps // 2), time_leaderboard)
        for n in (int(v) for v in args.n.split(",")):
            rows.append(bench_case(m, k, n, args.reps, floor))
    if args.out:
        import importlib.metadata as md

        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "cutlass_dsl": md.version("nvidia-cutlass-dsl"), "reps": args.reps}
        with open(args.out + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        lines = [f"GPU: {meta['gpu']}; torch {meta['torch']}; CuTe DSL {meta['cutlass_dsl']}. Leaderboard timing (L2 "
                 f"flushed, CUDA events, median of {meta['reps']}); graph: back-to-back CUDA-graph replays of the "
                 "route's two kernels. w4a4: quantize + gemv on NVFP4 x; via w4a16: quantize_dequantized + gemv on "
                 "bf16 x; qdq: quantize_dequantized alone.", "",
                 "| w (M x K) | N | w4a4 us | via w4a16 us | ratio | w4a4 graph | via w4a16 graph | ratio | "
                 "floor us | qdq us | check |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['m']} x {r['k']} | {r['n']} | {r['w4a4_us']:.2f} | {r['via_w4a16_us']:.2f} | "
                         f"{r['ratio']:.2f} | {r['w4a4_graph_us']:.2f} | {r['via_w4a16_graph_us']:.2f} | "
                         f"{r['ratio_graph']:.2f} | {r['floor_us']:.2f} | {r['quantize_dequantized_us']:.2f} | "
                         f"{'ok' if r['ok'] else r['check']} |")
        with open(args.out + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

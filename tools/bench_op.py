"""Per-N benchmark of nvfp4_gemv.gemv (the op for model code) on the GPU, timed the leaderboard's way
(L2 flushed before each run, CUDA events, median), next to its peers in the same run.

    python tools/bench_op.py --out docs/bench-op-h200

For each weight shape and N: ours, ours replayed from a CUDA graph, TB/s of w's bytes, fp8
``torch._scaled_mm`` (N padded to 16, per-tensor scales) and bf16 ``torch.mm`` on weights dequantized
beforehand; then the host cost of one ``gemv`` call next to one ``custom_kernel`` call and a bare torch
launch (busy GPU, best of 7 rounds).
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import torch  # noqa: E402

import inputs  # noqa: E402
import reference  # noqa: E402
from nvfp4_gemv import leaderboard  # noqa: E402
from bench import busy_host_us, host_diff_us, read_ceiling, time_graph, time_leaderboard  # noqa: E402
from nvfp4_gemv import gemv, op_plan  # noqa: E402


def w_bytes(m, k):
    return m * k // 2 + m * k // 16


def bench_shape(m, k, ns, reps):
    rows = []
    base = None
    w_fp8 = (torch.randn(m, k, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    x_fp8 = (torch.randn(16, k, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    fp8_out = torch.empty(m, 16, dtype=torch.bfloat16, device="cuda")
    fp8 = time_leaderboard(lambda: torch._scaled_mm(w_fp8, x_fp8.t(), one, one, out_dtype=torch.bfloat16,
                                                    out=fp8_out), reps)
    w_bf16 = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    for n in ns:
        args = inputs.op_inputs(n, m, k, seed=n)
        out = torch.empty(n, m, dtype=torch.bfloat16, device="cuda")
        gemv(*args, out=out)
        torch.cuda.synchronize()
        exact, terms = inputs.op_exact(*args)
        bad, msg = inputs.op_violations(out, exact, terms)
        ours = time_leaderboard(lambda: gemv(*args, out=out), reps)
        graph = time_graph(lambda: gemv(*args, out=out), reps)
        x_bf16 = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
        mm_out = torch.empty(n, m, dtype=torch.bfloat16, device="cuda")
        mm = time_leaderboard(lambda: torch.mm(x_bf16, w_bf16.t(), out=mm_out), reps)
        base = base or ours
        launches = len(op_plan._plans[next(reversed(op_plan._plans))].launches)
        rows.append({"m": m, "k": k, "n": n, "ours_us": ours, "graph_us": graph, "vs_n1": ours / base,
                     "w_TBps": w_bytes(m, k) / ours / 1e6, "fp8_scaled_mm_us": fp8, "bf16_mm_us": mm,
                     "launches": launches, "ok": bad == 0, "check": msg})
        print(f"{m}x{k} N={n:2d}: ours {ours:6.2f} us (graph {graph:6.2f}, x{ours / base:4.2f} of N=1, "
              f"{w_bytes(m, k) / ours / 1e6:4.2f} TB/s of w, {launches} launch) | fp8 {fp8:6.2f} | bf16 mm "
              f"{mm:6.2f} | {'ok' if bad == 0 else msg}", flush=True)
    return rows


def host_costs():
    args = inputs.op_inputs(4, 4096, 7168, seed=1)
    out = torch.empty(4, 4096, dtype=torch.bfloat16, device="cuda")
    data = reference.generate_input(4096, 7168, 1, 1)
    x = torch.ones(64, device="cuda")
    cases = {"gemv(out=)": lambda: gemv(*args, out=out), "gemv": lambda: gemv(*args),
             "custom_kernel": lambda: leaderboard.custom_kernel(data),
             "torch.cuda._sleep(0)": lambda: torch.cuda._sleep(0), "torch.add(x, x)": lambda: torch.add(x, x)}
    res = {}
    for name, fn in cases.items():
        us, valid = busy_host_us(fn)
        res[name] = us
        print(f"host {name:24s} {us:6.2f} us{'' if valid else ' (GPU went idle: upper bound)'}", flush=True)
    # single lines drift by microseconds on the lent hosts: the comparisons the issues set, alternated
    for a, b in (("custom_kernel", "torch.add(x, x)"), ("gemv(out=)", "custom_kernel"), ("gemv", "custom_kernel")):
        med, lo, hi, valid = host_diff_us(cases[a], cases[b])
        res[f"{a} - {b}"] = med
        print(f"host {a} - {b}: median {med:+.2f} us over 7 alternations ({lo:+.2f} .. {hi:+.2f})"
              f"{'' if valid else ' (GPU went idle: not valid)'}", flush=True)
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--n", default="1,2,4,8,16")
    p.add_argument("--shapes", default="7168x16384,4096x7168")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ns = [int(v) for v in args.n.split(",")]
    ceiling, _ = read_ceiling(20)
    rows = []
    for shape in args.shapes.split(","):
        m, k = (int(v) for v in shape.split("x"))
        rows += bench_shape(m, k, ns, args.reps)
    host = host_costs()
    import importlib.metadata as md

    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cutlass_dsl": md.version("nvidia-cutlass-dsl"), "read_ceiling_TBps": ceiling}
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows, "host_us": host}, f, indent=1)
        lines = [f"GPU: {meta['gpu']}; torch {meta['torch']}; CuTe DSL {meta['cutlass_dsl']}; DRAM read ceiling "
                 f"{ceiling:.2f} TB/s. Leaderboard timing (L2 flushed, CUDA events, median of {args.reps}).", "",
                 "| w (M x K) | N | ours us | graph us | x N=1 | TB/s of w | fp8 _scaled_mm us (N=16) | bf16 mm us |"
                 " launches | check |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['m']} x {r['k']} | {r['n']} | {r['ours_us']:.2f} | {r['graph_us']:.2f} | "
                         f"{r['vs_n1']:.2f} | {r['w_TBps']:.2f} | {r['fp8_scaled_mm_us']:.2f} | {r['bf16_mm_us']:.2f} | "
                         f"{r['launches']} | {'ok' if r['ok'] else r['check']} |")
        lines += ["", "Host cost of one call (busy GPU, best of 7 rounds of 200; differences: medians over 7 "
                  "alternations): " + ", ".join(f"{k} {v:.2f} us" for k, v in host.items())]
        with open(args.out + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

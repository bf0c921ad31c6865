"""Per-N benchmark of the W4A16 op (``nvfp4_gemv.gemv`` with bf16 x and NVFP4 weights) on the GPU, timed
the leaderboard's way (L2 flushed before each run, CUDA events, median) and as CUDA-graph replays, next to
its peers in the same run: bf16 ``F.linear`` on bf16 weights of the same shape, fp8 ``torch._scaled_mm``
(per-tensor scales, N padded to a multiple of 16), our W4A4 ``gemv`` (NVFP4 x), and the plain read of w's
bytes (``tools/read_floor.py``). Each W4A16 result is checked against float64 first. "packed" is
``gemv_packed`` on the same weight packed by ``pack_weight`` (checked bit for bit against ``gemv``'s result).

    python tools/bench_w4a16.py --out docs/bench-w4a16-h200      # writes .md and .json
    python tools/bench_w4a16.py --shapes 4096x4096 --n 1,16 --tune threads=512   # one configuration
    # one process a shape, compiling in parallel, timing one at a time; then one table
    python tools/bench_w4a16.py --shapes 4096x4096 --lock /tmp/lk --barrier 2 --out /tmp/a & ...
    python tools/bench_w4a16.py --merge /tmp/a.json,/tmp/b.json --out docs/bench-w4a16-h200
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

import inputs  # noqa: E402
from bench import time_graph, time_leaderboard  # noqa: E402
from nvfp4_gemv import gemv, gemv_packed, pack_weight, op_plan  # noqa: E402
from w4a16_inputs import w4a16_exact, w4a16_inputs, w4a16_violations  # noqa: E402

SHAPES = "6144x4096,4096x4096,28672x4096,4096x14336,8192x28672,7168x16384,4096x7168"


def w_bytes(m, k):
    return m * k // 2 + m * k // 16


def install_plan(x, w, ws, a, out, tuning):
    """Makes ``gemv`` take ``tuning`` (if any) for these tensors' metadata."""
    if tuning:
        from nvfp4_gemv.reference import check_args

        key = op_plan.w4a16_key(x, w, w_scale=ws, alpha=a, out=out, out_dtype=torch.bfloat16)
        op_plan._plans[key] = op_plan.W4A16Plan(x, w, ws, a, out, torch.bfloat16,
                                            check_args(x, None, w, ws, a, torch.bfloat16, out),
                                            tuning=tuple(sorted(tuning.items())))


def make_case(n, m, k, x_dtype, tuning):
    """One row's inputs and output, with ``gemv``'s plan for them taking ``tuning``."""
    x, _, w, ws, a = w4a16_inputs(n, m, k, seed=n, dtype=x_dtype, min_exp=1, max_exp=12)
    out = torch.empty(n, m, dtype=torch.bfloat16, device="cuda")
    install_plan(x, w, ws, a, out, tuning)
    return x, w, ws, a, out


def compile_all(shapes, ns, tuning, x_dtype):
    """Runs every (shape, N) once so that its kernels are compiled (the cache is per process)."""
    for m, k in shapes:
        for n in ns:
            x, w, ws, a, out = make_case(n, m, k, x_dtype, tuning)
            gemv(x, None, w, ws, a, out=out)
            if not tuning and k % 128 == 0:
                gemv_packed(x, pack_weight(w, ws), a, out=out)
    torch.cuda.synchronize()


def mark_ready(folder):
    """Counts this process as compiled: a file named by its pid in ``folder``."""
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, str(os.getpid())), "w").close()


def wait_for_peers(folder, count, timeout_s=1800):
    """Marks this process compiled (a file in ``folder``) and waits until ``count`` processes have."""
    import time

    mark_ready(folder)
    t0 = time.time()
    while len(os.listdir(folder)) < count:
        if time.time() - t0 > timeout_s:
            raise RuntimeError(f"bench_w4a16: {len(os.listdir(folder))} of {count} processes compiled in {timeout_s} s")
        time.sleep(0.5)


def bench_shape(m, k, ns, reps, tuning, floors, peers=True, x_dtype=torch.bfloat16):
    rows = []
    w_bf16 = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    w_fp8 = (torch.randn(m, k, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    if floors:
        from read_floor import floor_us

        floor, _ = floor_us(w_bytes(m, k), reps // 2, time_leaderboard)
    else:
        floor = float("nan")
    base = None
    for n in ns:
        x, w, ws, a, out = make_case(n, m, k, x_dtype, tuning)
        out.fill_(float("nan"))
        gemv(x, None, w, ws, a, out=out)
        torch.cuda.synchronize()
        if m * k <= 8192 * 28672 and n <= 32:
            exact, terms = w4a16_exact(x, w, ws, a)
            bad, msg = w4a16_violations(out, exact, terms)
        else:
            bad, msg = 0, "not checked"
        ours = time_leaderboard(lambda: gemv(x, None, w, ws, a, out=out), reps)
        graph = time_graph(lambda: gemv(x, None, w, ws, a, out=out), reps)
        packed = float("nan")
        if not tuning and k % 128 == 0:
            wp = pack_weight(w, ws)
            p_out = torch.full_like(out, float("nan"))
            gemv_packed(x, wp, a, out=p_out)
            if not torch.equal(p_out, out):
                bad, msg = bad + 1, "packed != gemv"
            packed = time_leaderboard(lambda: gemv_packed(x, wp, a, out=p_out), reps)
            del wp
        if not peers:
            base = base or ours
            print(f"{m}x{k} N={n:2d}: ours {ours:6.2f} us (graph {graph:6.2f}, x{ours / base:4.2f} of N=1, "
                  f"{100 * floor / ours:5.1f}% of floor) | packed {packed:6.2f} | {'ok' if bad == 0 else msg}", flush=True)
            continue
        xb = x.to(torch.bfloat16)
        lin_out = torch.empty(n, m, dtype=torch.bfloat16, device="cuda")
        lin = time_leaderboard(lambda: torch.mm(xb, w_bf16.t(), out=lin_out), reps)
        n16 = -(-n // 16) * 16
        x_fp8 = (torch.randn(n16, k, device="cuda") * 0.5).to(torch.float8_e4m3fn)
        fp8_out = torch.empty(m, n16, dtype=torch.bfloat16, device="cuda")
        fp8 = time_leaderboard(lambda: torch._scaled_mm(w_fp8, x_fp8.t(), one, one, out_dtype=torch.bfloat16,
                                                        out=fp8_out), reps)
        a4 = inputs.op_inputs(n, m, k, seed=n)
        a4_out = torch.empty(n, m, dtype=torch.bfloat16, device="cuda")
        w4a4 = time_leaderboard(lambda: gemv(*a4, out=a4_out), reps)
        base = base or ours
        row = {"m": m, "k": k, "n": n, "ours_us": ours, "graph_us": graph, "vs_n1": ours / base,
               "floor_us": floor, "pct_floor": 100 * floor / ours, "w_TBps": w_bytes(m, k) / ours / 1e6,
               "bf16_linear_us": lin, "fp8_scaled_mm_us": fp8, "w4a4_us": w4a4, "packed_us": packed,
               "packed_pct_floor": 100 * floor / packed, "ok": bad == 0, "check": msg}
        rows.append(row)
        print(f"{m}x{k} N={n:2d}: ours {ours:6.2f} us (graph {graph:6.2f}, x{ours / base:4.2f} of N=1, "
              f"{row['pct_floor']:5.1f}% of floor {floor:6.2f}, {row['w_TBps']:4.2f} TB/s of w) | bf16 {lin:6.2f} "
              f"| fp8 {fp8:6.2f} | w4a4 {w4a4:6.2f} | packed {packed:6.2f} | {'ok' if bad == 0 else msg}", flush=True)
    return rows


def bench_quantize(reps):
    """``nvfp4_gemv.quantize`` of R rows of 16384 values: leaderboard timing, and as CUDA-graph replays."""
    from nvfp4_gemv import quant

    rows = []
    for r in (1, 4, 16):
        x = torch.randn(r, 16384, dtype=torch.bfloat16, device="cuda")
        gs = torch.tensor([100.0], device="cuda")
        q, s = quant.quantize(x, gs)
        rq, rs = quant.quantize_reference(x, gs)
        ok = torch.equal(q, rq) and torch.equal(s.view(torch.uint8), rs.view(torch.uint8))
        lb = time_leaderboard(lambda: quant.quantize(x, gs), reps)
        gr = time_graph(lambda: quant.quantize(x, gs), reps)
        rows.append({"rows": r, "k": 16384, "us": lb, "graph_us": gr, "exact": ok})
        print(f"quantize {r}x16384: {lb:.2f} us (graph {gr:.2f}) | {'bit-exact' if ok else 'MISMATCH'}", flush=True)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--n", default="1,2,4,8,16,32")
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--tune", default="", help="kernel tuning for every launch, e.g. threads=512,groups=4; merged "
                   "over the route's (across=0 or groups=N to build without what the route adds)")
    p.add_argument("--no-floor", action="store_true", help="skip the plain-read floors (faster)")
    p.add_argument("--no-peers", action="store_true", help="time ours only (tuning sweeps)")
    p.add_argument("--quantize", action="store_true", help="also time nvfp4_gemv.quantize (1, 4, 16 rows of 16384)")
    p.add_argument("--x-dtype", default="bfloat16", choices=("bfloat16", "float16"), help="x's dtype (W4A16 rows)")
    p.add_argument("--lock", default=None, help="compile every build first, then check and time holding this "
                   "file's lock (several sweep processes: compiles in parallel, timings one at a time)")
    p.add_argument("--barrier", type=int, default=0, help="with --lock: wait until this many processes have "
                   "compiled (files in LOCK.ready/) before timing, so that no compile runs beside a timing")
    p.add_argument("--out", default=None)
    p.add_argument("--merge", default=None, help="write --out from these runs' .json files (comma-separated) and exit")
    args = p.parse_args()
    if args.merge:
        return merge(args.merge.split(","), args.out)
    ns = [int(v) for v in args.n.split(",")]
    tuning = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in args.tune.split(",") if kv}
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    if args.lock:
        import fcntl

        try:
            compile_all(shapes, ns, tuning, getattr(torch, args.x_dtype))
        except BaseException:
            if args.barrier:  # counted as compiled, so that the other processes do not wait for this one
                mark_ready(args.lock + ".ready")
            raise
        if args.barrier:
            wait_for_peers(args.lock + ".ready", args.barrier)
        lock = open(args.lock, "a")
        fcntl.flock(lock, fcntl.LOCK_EX)  # released at exit
    rows = []
    for m, k in shapes:
        rows += bench_shape(m, k, ns, args.reps, tuning, not args.no_floor, not args.no_peers,
                            getattr(torch, args.x_dtype))
    quant_rows = bench_quantize(args.reps) if args.quantize else []
    import importlib.metadata as md

    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cutlass_dsl": md.version("nvidia-cutlass-dsl"), "tuning": tuning, "reps": args.reps,
            "x_dtype": args.x_dtype}
    if args.out:
        write(args.out, meta, rows, quant_rows)


def merge(paths, out):
    """One table from several runs' .json (e.g. one process a shape under --lock), rows in the given order."""
    docs = []
    for path in paths:
        with open(path) as f:
            docs.append(json.load(f))
    write(out, docs[0]["meta"], [r for d in docs for r in d["rows"]], [q for d in docs for q in d["quantize"]])


def write(out, meta, rows, quant_rows):
    with open(out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows, "quantize": quant_rows}, f, indent=1)
    lines = [f"GPU: {meta['gpu']}; torch {meta['torch']}; CuTe DSL {meta['cutlass_dsl']}. Leaderboard timing "
             f"(L2 flushed, CUDA events, median of {meta['reps']}); graph: back-to-back CUDA-graph replays of one "
             "call, same timing. Floor: the plain read of w's bytes. bf16: torch.mm on bf16 weights; fp8: "
             "_scaled_mm with N padded to 16; W4A4: our gemv on NVFP4 x; packed: gemv_packed on the same "
             "weight packed once (pack_weight), its % of the floor in brackets.", "",
             "| w (M x K) | N | ours us | graph us | x N=1 | % of floor | TB/s of w | packed us | bf16 us | fp8 us | "
             "W4A4 us | check |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['m']} x {r['k']} | {r['n']} | {r['ours_us']:.2f} | {r['graph_us']:.2f} | "
                     f"{r['vs_n1']:.2f} | {r['pct_floor']:.1f} | {r['w_TBps']:.2f} | "
                     f"{r['packed_us']:.2f} ({r['packed_pct_floor']:.1f}) | {r['bf16_linear_us']:.2f} | "
                     f"{r['fp8_scaled_mm_us']:.2f} | {r['w4a4_us']:.2f} | {'ok' if r['ok'] else r['check']} |")
    if quant_rows:
        lines += ["", "nvfp4_gemv.quantize (bf16 rows of 16384, checked bit for bit against the reference): "
                  + "; ".join(f"{q['rows']} rows {q['us']:.2f} us (graph {q['graph_us']:.2f})" for q in quant_rows)]
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""Benchmark: the NVFP4 GEMV against the DRAM read ceiling and its peers, timed the leaderboard's way.

    python bench.py                         # task.yml benchmarks and tests, all peers, table on stdout
    python bench.py --out docs/bench-h200   # also writes docs/bench-h200.md and .json
    python bench.py --shapes 7168x16384x1 --no-peers --tune min_blocks=2,batch=4 --tune min_blocks=4

Leaderboard timing: before every run a 4 GiB buffer is filled (flushes the L2), then CUDA events around
the call; the median of ``--reps`` runs. Graph timing: the call captured once in a CUDA graph, the L2
flushed before each replay outside the timed window. The ceiling is the median DRAM read rate of an
fp32 ``torch.sum`` over a 2 GiB buffer, timed the same way.

The read floor of a case (``tools/read_floor.py``): the fastest plain streaming read of the same number of
bytes (one buffer, no arithmetic), tuned over grid, block and load width and timed the same way, after the
flush (``read_floor_us``, what the leaderboard's timing leaves in L2) and after a clean L2
(``read_floor_clean_us``); the table shows the floor's time as % of ours (``pct_of_read_floor``: 100% = as
fast as that read).
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import yaml

import reference
from nvfp4_gemv import leaderboard
from nvfp4_gemv.tuning import make_op
from utils import clear_l2_cache

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import inputs  # noqa: E402


def bytes_moved(m, k, l):
    """Fewest DRAM bytes: a and sfa read once, b and sfb once per batch, c written once."""
    return l * (m * k // 2 + m * k // 16 + k // 2 + k // 16 + 2 * m)


_clean = None


def time_leaderboard(fn, reps, clean=False, after_flush=None):
    """Median us of ``fn`` between CUDA events, the L2 flushed before each run. ``clean``: after the
    flush, read a 1 GiB buffer, so that L2 holds clean lines instead of the flush's dirty ones.
    ``after_flush``: called between the flush and the start event (untimed)."""
    global _clean
    times = []
    for _ in range(reps):
        clear_l2_cache()
        if clean:
            if _clean is None:
                _clean = torch.ones(256 * 1024 * 1024, device="cuda")
            _clean.sum()
        if after_flush is not None:
            after_flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def time_graph(fn, reps):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return time_leaderboard(g.replay, reps)


def read_ceiling(reps):
    x = torch.empty(512 * 1024 * 1024, dtype=torch.float32, device="cuda").uniform_()
    us = time_leaderboard(lambda: x.sum(), reps)
    return x.numel() * 4 / us / 1e6, us


def busy_host_us(fn, calls=200, rounds=7):
    """Host wall time of one call of ``fn``, the best of ``rounds`` rounds (the lent machines' CPUs are
    noisy). The GPU is held busy by a spin kernel meanwhile, so the calls only queue: back-to-back
    launches would otherwise measure the GPU's launch throughput. Returns ``(us, valid)``; ``valid`` is
    False if a spin ended before the last call of its round was queued."""
    fn()
    torch.cuda.synchronize()
    best, valid = float("inf"), True
    for _ in range(rounds):
        torch.cuda._sleep(100_000_000)  # ~50 ms at H200 clocks
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        done = torch.cuda.Event()
        done.record()
        valid = valid and not done.query()
        torch.cuda.synchronize()
        best = min(best, (t1 - t0) / calls * 1e6)
    return best, valid


def host_diff_us(fn_a, fn_b, alternations=7):
    """Host time of ``fn_a`` minus ``fn_b`` (``busy_host_us``, 3 rounds each), measured ``alternations``
    times in alternating order (ab, ba, ab, ...): ``(median, lowest, highest, valid)``. The lent hosts' CPUs
    drift by a microsecond or more between measurements taken one after the other; pairs in both orders
    cancel the drift. ``valid`` as ``busy_host_us``'s, for all of them."""
    diffs, valid = [], True
    for i in range(alternations):
        first, second = (fn_a, fn_b) if i % 2 == 0 else (fn_b, fn_a)
        t1, v1 = busy_host_us(first, rounds=3)
        t2, v2 = busy_host_us(second, rounds=3)
        diffs.append(t1 - t2 if i % 2 == 0 else t2 - t1)
        valid = valid and v1 and v2
    diffs.sort()
    return diffs[len(diffs) // 2], diffs[0], diffs[-1], valid


def host_cost_us(data):
    """``busy_host_us`` of one ``custom_kernel`` call."""
    return busy_host_us(lambda: leaderboard.custom_kernel(data))


def empty_kernel_us(reps):
    """Leaderboard-style time of an empty kernel (``torch.cuda._sleep(0)``): the fixed cost of any call."""
    return time_leaderboard(lambda: torch.cuda._sleep(0), reps)


# ------------------------------------------------------------------------------------------------ peers


def peer_sum_same_bytes(nbytes):
    """Not a GEMV: an fp32 ``torch.sum`` over as many bytes as the GEMV must read, the practical floor
    of a read of that size under this timing (launch, ramp-up and tail included)."""
    x = torch.ones(nbytes // 4, device="cuda")
    out = {}

    def run():
        out["s"] = x.sum()

    def check():
        return out["s"].item() == x.numel()

    return run, check


def peer_bulk_read(data):
    """Not a GEMV: the bulk-copy kernel with its arithmetic removed (``probe=1``), which streams exactly
    the GEMV's bytes the fastest way we have; its time is the floor of a read under this timing."""
    shape = leaderboard.check_inputs(data)
    tuning = (("bulk", 1), ("probe", 1))
    make_op(shape[1], False, **dict(tuning))  # raises ValueError where K % 256 != 0

    def run():
        leaderboard.run_cute(data, *shape, tuning=tuning)

    return run, lambda: True


def peer_fp8_scaled_mm(m, k, l):
    """fp8 e4m3 A (1 byte a value: twice fp4's bytes) times an fp8 vector padded to N = 16."""
    a = (torch.randn(l, m, k, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    b = (torch.randn(l, 16, k, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    out = torch.empty(l, m, 16, dtype=torch.float16, device="cuda")

    def run():
        for i in range(l):
            torch._scaled_mm(a[i], b[i].t(), one, one, out_dtype=torch.float16, out=out[i])

    def check():
        ref = a.double() @ b.double().transpose(1, 2)
        return torch.allclose(out.double(), ref, rtol=2e-3, atol=1e-1)

    return run, check


def peer_fp16_bmm(m, k, l):
    a = torch.randn(l, m, k, dtype=torch.float16, device="cuda")
    b = torch.randn(l, k, 1, dtype=torch.float16, device="cuda")
    out = torch.empty(l, m, 1, dtype=torch.float16, device="cuda")

    def run():
        torch.bmm(a, b, out=out)

    def check():
        return torch.allclose(out.double(), a.double() @ b.double(), rtol=1e-2, atol=1e-1)

    return run, check


def _dequant_dot(a_u8, b_u8, sfa, sfb, table):
    """Reads fp4 bytes, decodes with a table, scales per 16 values, dots in fp32: [L, M]."""
    lo, hi = table[(a_u8 & 15).int()], table[(a_u8 >> 4).int()]
    av = torch.stack((lo, hi), dim=-1).flatten(-2)
    blo, bhi = table[(b_u8 & 15).int()], table[(b_u8 >> 4).int()]
    bv = torch.stack((blo, bhi), dim=-1).flatten(-2)
    l, m, k = av.shape
    av = av.view(l, m, k // 16, 16) * sfa.float().unsqueeze(-1)
    bv = bv.view(l, 1, k // 16, 16) * sfb.float().unsqueeze(-1)
    return (av * bv).sum(dim=(-1, -2)).half()


_compiled_dequant = None


def peer_torch_compile(data):
    global _compiled_dequant
    if _compiled_dequant is None:
        _compiled_dequant = torch.compile(_dequant_dot, dynamic=True)
    a, b, sfa, sfb = data[:4]
    table = torch.tensor(reference.E2M1_VALUES, dtype=torch.float32, device="cuda")
    a_u8 = a.view(torch.uint8).permute(2, 0, 1)
    b_u8 = b.view(torch.uint8)[0:1].permute(2, 0, 1)
    sfa_l, sfb_l = sfa.permute(2, 0, 1), sfb[0:1].permute(2, 0, 1)
    box = {}

    def run():
        box["out"] = _compiled_dequant(a_u8, b_u8, sfa_l, sfb_l, table)

    def check():
        ok, _ = reference.check_implementation(data, box["out"].permute(1, 0).unsqueeze(1))
        return ok

    return run, check


def peer_fp4_scaled_mm(data):
    a, b, _, _, sfa_p, sfb_p, c = data
    out = c.clone()

    def run():
        for i in range(a.shape[2]):
            res = torch._scaled_mm(a[:, :, i], b[:, :, i].transpose(0, 1),
                                   leaderboard.blocked_from_permuted(sfa_p, i),
                                   leaderboard.blocked_from_permuted(sfb_p, i), out_dtype=torch.float16)
            out[:, 0, i] = res[:, 0]

    def check():
        return reference.check_implementation(data, out)[0]

    return run, check


# ------------------------------------------------------------------------------------------------ main


def parse_shapes(text):
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",")]


def task_shapes():
    with open(os.path.join(ROOT, "task.yml")) as f:
        spec = yaml.safe_load(f)
    seen, shapes = set(), []
    for case in spec["benchmarks"] + spec["tests"]:
        key = (case["m"], case["k"], case["l"])
        if key not in seen:
            seen.add(key)
            shapes.append(key)
    return shapes


def bench_case(m, k, l, args, ceiling, tunings):
    data = reference.generate_input(m, k, l, 1111)
    nbytes = bytes_moved(m, k, l)
    row = {"m": m, "k": k, "l": l, "bytes": nbytes, "floor_us": nbytes / ceiling / 1e6}
    variants = {}
    for tune in tunings:
        name = "ours" if not tune else "ours[" + ",".join(f"{k_}={v}" for k_, v in tune) + "]"
        shape = leaderboard.check_inputs(data)
        try:
            make_op(k, False, **dict(tune))
        except ValueError:
            continue

        def run(tune=tune, d=data):
            return leaderboard.run_cute(d, *shape, tuning=tune) if tune else leaderboard.custom_kernel(d)

        poisoned = inputs.poisoned(data)
        out = (leaderboard.run_cute(poisoned, *shape, tuning=tune) if tune else
               leaderboard.custom_kernel(poisoned))
        torch.cuda.synchronize()
        ok, msg = reference.check_implementation(data, out)
        signed = inputs.random_inputs(m, k, l, seed=7, device="cuda")
        got = (leaderboard.run_cute(signed, *shape, tuning=tune) if tune else
               leaderboard.custom_kernel(signed))
        ok_s, msg_s = reference.check_implementation(signed, got)
        us = time_leaderboard(lambda: run(), args.reps)
        clean_us = time_leaderboard(lambda: run(), args.reps, clean=True) if args.clean else None
        g_us = time_graph(lambda: run(), args.reps) if args.graph else None
        if dict(tune).get("probe"):
            ok = ok_s = True  # a probe skips the arithmetic: only its time means anything
        variants[name] = {"us": us, "graph_us": g_us, "clean_us": clean_us, "ok": ok and ok_s,
                          "msg": "" if ok and ok_s else (msg if not ok else "signed: " + msg_s)}
    best = min(variants, key=lambda n: variants[n]["us"])
    row.update(variants=variants, us=variants["ours"]["us"] if "ours" in variants else variants[best]["us"],
               graph_us=(variants.get("ours") or variants[best])["graph_us"],
               ok=all(v["ok"] for v in variants.values()))
    row["TBps"] = nbytes / row["us"] / 1e6
    row["pct_of_ceiling"] = 100 * row["TBps"] / ceiling
    if args.read_floor:
        import read_floor

        buf = read_floor.zero_buffer(nbytes)
        for state, clean in (("", False), ("_clean", True)):
            _, cfg = read_floor.floor_us(nbytes, max(10, args.reps // 5), time_leaderboard, clean=clean, buf=buf)
            row["read_floor" + state + "_us"] = time_leaderboard(read_floor.reader(buf, cfg[1], cfg[2], cfg[0], cfg[3]),
                                                                 args.reps, clean=clean)
            row["read_floor" + state + "_config"] = dict(zip(("ctas_per_sm", "threads", "width", "unroll"), cfg))
        del buf
        row["pct_of_read_floor"] = 100 * row["read_floor_us"] / row["us"]
    peers = {}
    if args.peers:
        makers = {"torch.sum of the same bytes": lambda: peer_sum_same_bytes(nbytes),
                  "bulk read, no math": lambda: peer_bulk_read(data),
                  "fp8 _scaled_mm (N=16)": lambda: peer_fp8_scaled_mm(m, k, l),
                  "fp16 cuBLAS bmm": lambda: peer_fp16_bmm(m, k, l),
                  "torch.compile dequant+dot": lambda: peer_torch_compile(data)}
        if reference.fp4_scaled_mm_supported("cuda"):
            makers["fp4 _scaled_mm"] = lambda: peer_fp4_scaled_mm(data)
        if args.peers_only:
            makers = {n: f for n, f in makers.items() if any(s in n for s in args.peers_only.split(","))}
        for pname, make in makers.items():
            try:
                prun, pcheck = make()
                prun()
                torch.cuda.synchronize()
                good = pcheck()
                peers[pname] = {"us": time_leaderboard(prun, args.reps), "ok": bool(good)}
            except Exception as e:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal
                peers[pname] = {"us": None, "ok": False, "error": f"{type(e).__name__}: {e}"[:200]}
            torch.cuda.empty_cache()
    row["peers"] = peers
    return row


def render(rows, ceiling, meta):
    peer_names = sorted({p for r in rows for p in r["peers"]})
    floor = any("read_floor_us" in r for r in rows)
    head = ["M", "K", "L", "floor us", "ours us", "graph us", "TB/s", "% ceiling"]
    head += ["read floor us", "% of read floor", "clean-L2 read floor us"] if floor else []
    head += ["ok"]
    head += [f"{p} us (x)" for p in peer_names]
    lines = [f"GPU: {meta['gpu']}; torch {meta['torch']}; CuTe DSL {meta['cutlass_dsl']}; "
             f"DRAM read ceiling {ceiling:.2f} TB/s; host cost of one call {meta['host_us_per_call']:.1f} us"
             f"{'' if meta['host_us_valid'] else ' (GPU idle before the end: an upper bound)'}; "
             f"an empty kernel timed the same way {meta['empty_kernel_us']:.1f} us", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["m"], r["k"], r["l"], f"{r['floor_us']:.2f}", f"{r['us']:.2f}",
                 f"{r['graph_us']:.1f}" if r["graph_us"] else "-", f"{r['TBps']:.2f}",
                 f"{r['pct_of_ceiling']:.0f}%"]
        if floor:
            cells += [f"{r['read_floor_us']:.2f}", f"{r['pct_of_read_floor']:.1f}%", f"{r['read_floor_clean_us']:.2f}"]
        cells.append("yes" if r["ok"] else "NO")
        for p in peer_names:
            pr = r["peers"].get(p)
            if pr and pr["us"]:
                cells.append(f"{pr['us']:.1f} ({pr['us'] / r['us']:.1f}x){'' if pr['ok'] else ' WRONG'}")
            else:
                cells.append("n/a")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    variant_rows = [(r, n, v) for r in rows for n, v in r["variants"].items() if len(r["variants"]) > 1]
    if variant_rows:
        lines += ["", "| M | K | L | variant | us | graph us | clean-L2 us | ok |", "|---|---|---|---|---|---|---|---|"]
        for r, n, v in variant_rows:
            g = f"{v['graph_us']:.1f}" if v["graph_us"] else "-"
            cl = f"{v['clean_us']:.1f}" if v.get("clean_us") else "-"
            lines.append(f"| {r['m']} | {r['k']} | {r['l']} | {n} | {v['us']:.1f} | {g} | {cl} | {v['ok']} |")
    bench_rows = [r for r in rows if (r["m"], r["k"], r["l"]) in BENCH_SHAPES]
    if len(bench_rows) == 3:
        geo = statistics.geometric_mean([r["us"] for r in bench_rows])
        lines += ["", f"Geometric mean of the three benchmark shapes: {geo:.2f} us"]
    return "\n".join(lines)


BENCH_SHAPES = {(7168, 16384, 1), (4096, 7168, 8), (7168, 2048, 4)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=parse_shapes, default=None, help="MxKxL,... (default: task.yml)")
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--no-peers", dest="peers", action="store_false")
    p.add_argument("--peers-only", default=None, help="comma-separated substrings of peer names to run")
    p.add_argument("--no-graph", dest="graph", action="store_false")
    p.add_argument("--clean", action="store_true", help="also time with a clean (read-only) L2 before each run")
    p.add_argument("--no-read-floor", dest="read_floor", action="store_false",
                   help="skip the plain streaming read of each case's bytes (tools/read_floor.py)")
    p.add_argument("--tune", action="append", default=[], help="a kernel variant, e.g. min_blocks=2,batch=4")
    p.add_argument("--out", default=None, help="path prefix for the .md and .json results")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.py needs a CUDA GPU")
    tunings = [()] + [tuple(sorted((kv.split("=")[0], int(kv.split("=")[1])) for kv in t.split(",")))
                      for t in args.tune]
    ceiling, _ = read_ceiling(max(20, args.reps // 2))
    print(f"DRAM read ceiling: {ceiling:.3f} TB/s", flush=True)
    rows = []
    for m, k, l in args.shapes or task_shapes():
        rows.append(bench_case(m, k, l, args, ceiling, tunings))
        r = rows[-1]
        print(f"{m}x{k}x{l}: " + ", ".join(f"{n} {v['us']:.2f} us{'' if v['ok'] else ' FAIL ' + v['msg']}"
                                           for n, v in r["variants"].items())
              + (f"; read floor {r['read_floor_us']:.2f} us ({r['pct_of_read_floor']:.1f}%)"
                 if "read_floor_us" in r else "")
              + "".join(f"; {pn} {pv['us']:.1f}" for pn, pv in r["peers"].items() if pv["us"]), flush=True)
    from importlib.metadata import version

    host_us, host_valid = host_cost_us(reference.generate_input(128, 256, 1, 1))
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cutlass_dsl": version("nvidia-cutlass-dsl"), "ceiling_TBps": ceiling,
            "host_us_per_call": host_us, "host_us_valid": host_valid,
            "empty_kernel_us": empty_kernel_us(max(20, args.reps // 2))}
    table = render(rows, ceiling, meta)
    print(table)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".md", "w") as f:
            f.write(f"# Benchmark results: `python bench.py`\n\n{table}\n")
        cases = [{"m": r["m"], "k": r["k"], "l": r["l"], "us": r["us"], "graph_us": r["graph_us"],
                  "TBps": r["TBps"], "pct_of_ceiling": r["pct_of_ceiling"], "ok": r["ok"],
                  **{key: r[key] for key in ("read_floor_us", "read_floor_clean_us", "pct_of_read_floor",
                                             "read_floor_config", "read_floor_clean_config") if key in r},
                  "peers": {n: v["us"] for n, v in r["peers"].items()}} for r in rows]
        with open(args.out + ".json", "w") as f:
            json.dump({**meta, "cases": cases}, f, indent=1)
    if not all(r["ok"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()

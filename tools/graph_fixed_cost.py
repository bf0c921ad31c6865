"""What one GEMV costs beyond its bytes when 32 run back to back in a CUDA graph (issue: the fixed cost).

The 32 linears of 8 Llama-3-8B-shaped layers (6144x4096 qkv, 4096x4096 o, 28672x4096 gate_up,
4096x14336 down; 981 MB of NVFP4 weights and scales, far beyond the L2), one token, captured once and
replayed back to back (CUDA events around each replay, median):

* ``read``: a plain streaming read of each weight's bytes (``tools/read_floor.py``, its fastest
  configuration for that size under the leaderboard's timing), 32 buffers: what the bytes alone cost in a
  graph, fixed costs included;
* ``empty``: 32 launches of the same reader on 16 bytes: a kernel boundary in a graph;
* ``w4a16``: ``gemv(x_bf16, None, w, w_scale, alpha)``; ``w4a4``: ``gemv(x_fp4, x_scale, w, ...)`` with x
  quantized beforehand (the GEMVs only, no quantizer).

Per kernel, "over bytes" is ``(graph - bytes / bw) / 32`` with ``bw`` the DRAM read rate given
(``--tbps``); "over read" is ``(graph - read graph) / 32``: what our kernel adds over a plain read of the
same bytes in the same place. The first layer's GEMVs are checked against float64 first.

    python tools/graph_fixed_cost.py --json docs/graph-fixed-cost-h200.json
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

SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # (out, in) of one layer's linears


def w_bytes(m, k):
    return m * k // 2 + m * k // 16


def graph_of(calls):
    """A CUDA graph of ``calls`` (zero-argument callables) in order, after one eager warm-up on a side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    return g


def layer_weights(layers, device, seed=0):
    """NVFP4 weights (uint8 values, plain e4m3 scales with exponent fields 1..11, both signs of values) for
    every linear of every layer, made on the GPU."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(layers):
        for m, k in SHAPES:
            w = torch.randint(0, 256, (m, k // 2), generator=g, dtype=torch.uint8, device=device)
            ws = torch.randint(0x08, 0x60, (m, k // 16), generator=g, dtype=torch.uint8, device=device)
            out.append((w, ws.view(torch.float8_e4m3fn)))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--tbps", type=float, default=4.3, help="DRAM read rate for 'over bytes' (TB/s)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from bench import time_leaderboard
    from bench_model import time_us
    from read_floor import floor_us, reader, zero_buffer
    from w4a16_inputs import w4a16_exact, w4a16_violations

    from nvfp4_gemv import gemv, quantize

    dev = torch.device("cuda")
    weights = layer_weights(args.layers, dev)
    alpha = torch.tensor([0.75], device=dev)
    n_k = len(weights)
    total_bytes = sum(w_bytes(w.shape[0], 2 * w.shape[1]) for w, _ in weights)

    xs, outs, q = {}, [], {}
    for m, k in SHAPES:
        xs[k] = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        q[k] = quantize(xs[k], torch.tensor([8.0], device=dev))
    for w, _ in weights:
        outs.append(torch.empty(1, w.shape[0], dtype=torch.bfloat16, device=dev))

    # the first layer's W4A16 GEMVs against float64 (the timed calls are the same kernels)
    checks = []
    for (w, ws), out in zip(weights[:len(SHAPES)], outs):
        k = 2 * w.shape[1]
        out.fill_(float("nan"))
        gemv(xs[k], None, w, ws, alpha, out=out)
        exact, terms = w4a16_exact(xs[k], w, ws, alpha)
        bad, msg = w4a16_violations(out, exact, terms)
        checks.append(f"{w.shape[0]}x{k}: {'ok' if bad == 0 else msg}")

    # the plain read of each size, its fastest configuration under the leaderboard's timing
    best = {}
    for m, k in SHAPES:
        _, best[(m, k)] = floor_us(w_bytes(m, k), 20, time_leaderboard)
    bufs = [zero_buffer(w_bytes(w.shape[0], 2 * w.shape[1])) for w, _ in weights]
    reads = []
    for (w, _), buf in zip(weights, bufs):
        cps, threads, width, unroll = best[(w.shape[0], 2 * w.shape[1])]
        reads.append(reader(buf, threads, width, cps, unroll))
    tiny = zero_buffer(16)
    empties = [reader(tiny, 128, 16, 1, 1) for _ in range(n_k)]

    def w4a16_call(i):
        (w, ws), out = weights[i], outs[i]
        x = xs[2 * w.shape[1]]
        return lambda: gemv(x, None, w, ws, alpha, out=out)

    def w4a4_call(i):
        (w, ws), out = weights[i], outs[i]
        xq, xsc = q[2 * w.shape[1]]
        return lambda: gemv(xq, xsc, w, ws, alpha, out=out)

    variants = {"read": reads, "empty": empties, "w4a16": [w4a16_call(i) for i in range(n_k)],
                "w4a4": [w4a4_call(i) for i in range(n_k)]}
    bytes_us = total_bytes / (args.tbps * 1e6)
    rows = {}
    for name, calls in variants.items():
        us = time_us(graph_of(calls).replay, args.reps, dev)  # replays back to back
        rows[name] = {"graph_us": us, "kernels": n_k}
    for name, r in rows.items():
        r["over_bytes_us"] = (r["graph_us"] - (0 if name == "empty" else bytes_us)) / n_k
        if name in ("w4a16", "w4a4"):
            r["over_read_us"] = (r["graph_us"] - rows["read"]["graph_us"]) / n_k
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
            "kernels": n_k, "bytes": total_bytes, "tbps": args.tbps, "bytes_us": bytes_us, "reps": args.reps,
            "read_configs": {f"{m}x{k}": best[(m, k)] for m, k in SHAPES}, "checks": checks}
    print(f"{n_k} kernels, {total_bytes / 1e6:.1f} MB: {bytes_us:.1f} us at {args.tbps} TB/s; checks: "
          + "; ".join(checks))
    for name, r in rows.items():
        extra = f", over a plain read {r['over_read_us']:+.2f} us" if "over_read_us" in r else ""
        print(f"{name:6s}: graph {r['graph_us']:8.1f} us; a kernel over its bytes {r['over_bytes_us']:6.2f} us{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

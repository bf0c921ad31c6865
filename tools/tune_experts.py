"""Times the experts' kernel alone, one launch at a time (a MoE layer's gate/up or down), over builds around
the one ``experts_op.launch_shape`` picks: each build knob varied alone (threads, CTAs a SM, groups of 8 rows
a CTA, ``across``, ``x_smem``, ``late``, ``even``, ``depth``, ``chains``) and the grid under other estimates
of the groups with an expert (``busy`` times 0.5, 2). Each build's output is first checked against float64
within a sanity bound (2^-12 of the sum of |terms|, 2^-8 more with the act, plus 2^-8 of |result|; the
tests hold the exact one).
Every build is captured once and timed once a round, ``--rounds`` rounds in turn (median). The read floor
is the fastest plain read of the launch's bytes (the experts hit, their scales), timed the same way.

    python tools/tune_experts.py                          # Qwen3-30B-A3B's experts at 1 token, on the GPU
    python tools/tune_experts.py --tokens 1,4 --out docs/tune-experts-h100
    python tools/tune_experts.py --tokens 16 --set threads=128 --rounds 3   # around another base build
    python tools/tune_experts.py --list                   # the candidates (no GPU needed), nothing timed

Qwen3-30B-A3B's shapes (``--experts 128 --top-k 8 --hidden 2048 --inter 768``): gate/up [2I, H] = 1536 x
2048, down [H, I] = 2048 x 768; the routing is uniform random, the groups as ``decode_forward`` makes them.
Timing is the leaderboard's (``bench.time_leaderboard``: L2 flushed, CUDA events around a graph replay,
median). The down launch is timed with ``act="silu"`` where ``decode_forward`` takes it
(``ACT_IN_KERNEL_MAX_TOKENS``), its x then ``[gate | up]`` rows.
"""

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "model")]

from nvfp4_gemv import experts_op  # noqa: E402
from nvfp4_gemv.launch import RecentPlans  # noqa: E402
from nvfp4_gemv.model.experts_forward import (ACT_IN_KERNEL_MAX_TOKENS, busy_groups, decode_groups,  # noqa: E402
                                              group_size)
from nvfp4_gemv.w4a16 import Nvfp4GemvW4A16  # noqa: E402
from nvfp4_gemv.w4a16_route import W4A16Route  # noqa: E402

VARY = {"threads": (128, 256, 512), "ctas": (1, 2, 4, 8), "groups": (2, 4, 8), "across": (0, 1), "x_smem": (0, 1),
        "late": (0, 1), "even": (0, 1), "depth": (2,), "chains": (2,)}  # (depth, chains: 1 by default)
BUSY_FACTORS = (0.5, 2.0)


def grid_for(nt, m, k, sms, groups, tuning, busy):
    """``launch_shape``'s grid for a build: the plain kernel's grid on ``busy * m`` rows, shared by the groups."""
    op = Nvfp4GemvW4A16(k, nt, groups, True, False, True, True, **dict(tuning))
    tiles = -(-(m // 8) // groups)
    return max(1, min(tiles, -(-op.grid_x(m * busy, sms) // busy)))


def candidates(nt, m, k, sms, busy, act, base_set=None):
    """``[(label, W4A16Route, grid_x)]``: the route's build first (``base_set``: knobs overriding its tuning,
    its grid then ``grid_for`` the result), then each knob varied alone, then the grid under other busy
    estimates; builds the kernel cannot take are left out."""
    base, grid = experts_op.launch_shape(nt, m, k, sms, busy)
    tuning = dict(experts_op.act_tuning(base.tuning, act))
    if base_set:
        tuning.update(base_set)
        grid = grid_for(nt, m, k, sms, base.groups, tuple(sorted(tuning.items())), busy)
    first = "route" if not base_set else "route+" + ",".join(f"{k}={v}" for k, v in sorted(base_set.items()))
    out, seen = [(first, W4A16Route(nt, base.groups, tuple(sorted(tuning.items()))), grid)], set()
    seen.add((base.groups, tuple(sorted(tuning.items())), grid))

    def add(label, groups, tune, b):
        key = tuple(sorted(tune.items()))
        if act is not None and not tune.get("x_smem", 1):
            return
        try:
            ok = Nvfp4GemvW4A16.can_implement(k, nt, groups, **tune)
            g = grid_for(nt, m, k, sms, groups, key, b) if ok else None
        except (ValueError, TypeError):
            ok = False
        if ok and (groups, key, g) not in seen:
            seen.add((groups, key, g))
            out.append((label, W4A16Route(nt, groups, key), g))

    for knob, values in VARY.items():
        for v in values:
            if knob == "groups":
                add(f"groups={v}", v, tuning, busy)
            elif tuning.get(knob) != v:
                add(f"{knob}={v}", base.groups, {**tuning, knob: v}, busy)
    for f in BUSY_FACTORS:
        b = max(1, round(busy * f))
        add(f"busy x{f:g}", base.groups, tuning, b)
    return out


def setup(t, e, k_top, h, inter, device, gen):
    """The two launches' inputs for ``t`` tokens: ``[(name, x, gid, w, ws, alpha, nt, busy, act)]``."""
    from test_experts_kernel import random_weights

    idx = torch.stack([torch.randperm(e, generator=gen)[:k_top] for _ in range(t)])
    nt = group_size(t, k_top, e)
    busy = busy_groups(t, k_top, e, nt)
    x = torch.randn(t, h, generator=gen).bfloat16()
    xg, gid, _, _ = decode_groups(x, idx, e, nt)
    w1, s1, a1 = random_weights(gen, e, 2 * inter, h)
    w2, s2, a2 = random_weights(gen, e, h, inter)
    act = "silu" if t <= ACT_IN_KERNEL_MAX_TOKENS else None
    hid = torch.randn(gid.shape[0] * nt, inter * (2 if act else 1), generator=gen).bfloat16()
    mv = lambda *ts: [v.to(device) for v in ts]  # noqa: E731
    return [("gate_up", *mv(xg, gid, w1, s1, a1), nt, busy, None), ("down", *mv(hid, gid, w2, s2, a2), nt, busy, act)]


def launch_bytes(gid, w, ws):
    """Bytes one launch reads at least: each expert its groups name, once a group (codes and scales)."""
    groups = int((gid >= 0).sum())
    return groups * (w[0].numel() + ws[0].numel())


def reference(x, gid, w, ws, alpha, nt, act):
    """float64 product and sum of |terms| on the launch's device (the tests' ``exact``, vectorized by group)."""
    from nvfp4_gemv.quant import dequantize

    k = w.shape[2] * 2
    if act is not None:
        xd = x.double()
        x = (xd[:, :k] / (1 + torch.exp(-xd[:, :k])) * xd[:, k:]).to(x.dtype)
    ref = torch.full((gid.shape[0] * nt, w.shape[1]), float("nan"), dtype=torch.float64, device=x.device)
    absum = torch.zeros_like(ref)
    for g, e in enumerate(gid.tolist()):
        if e >= 0:
            wv = dequantize(w[e], ws[e]).double() * float(alpha[e])
            rows = (x if x.shape[0] == 1 else x[g * nt:(g + 1) * nt]).double()  # (one token: every group's row)
            ref[g * nt:(g + 1) * nt] = rows @ wv.T
            absum[g * nt:(g + 1) * nt] = rows.abs() @ wv.abs().T
    return ref, absum


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sms", type=int, default=None, help="SM count for --list (default: the GPU's, else 132)")
    ap.add_argument("--list", action="store_true", help="print the candidates, time nothing")
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every candidate of a launch once a round, ROUNDS rounds in turn; the median of the rounds")
    ap.add_argument("--set", default="", help="KNOB=V,...: the base build's knobs overridden (e.g. threads=128)")
    args = ap.parse_args()
    base_set = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in args.set.split(",") if kv}
    cuda = torch.cuda.is_available() and not args.list
    sms = args.sms or (torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132)
    gen = torch.Generator().manual_seed(0)
    rows = []
    if cuda:
        from bench import time_leaderboard
        from tools.read_floor import floor_us
    for t in [int(v) for v in args.tokens.split(",")]:
        launches = setup(t, args.experts, args.top_k, args.hidden, args.inter, "cuda" if cuda else "cpu", gen)
        for name, x, gid, w, ws, alpha, nt, busy, act in launches:
            m, k = w.shape[1], w.shape[2] * 2
            cands = candidates(nt, m, k, sms, busy, act, base_set)
            if not cuda:
                for label, r, g in cands:
                    print(f"T={t} {name} {m}x{k} nt={nt} busy={busy} act={act}: {label:12s} groups={r.groups} "
                          f"grid={g} {dict(r.tuning)}")
                continue
            nbytes = launch_bytes(gid, w, ws)
            floor = floor_us(nbytes, args.reps, time_leaderboard)[0]
            ref, absum = reference(x, gid, w, ws, alpha, nt, act)
            live = ~ref.isnan()
            real = experts_op.launch_shape
            try:
                built = []  # (label, route, grid, graph, within bound): each captured once, timed in rounds
                for label, r, g in cands:
                    experts_op.launch_shape = lambda *a, r=r, g=g: (r, g)
                    experts_op._plans.clear()
                    experts_op._recent = RecentPlans()
                    y = experts_op.experts_gemv(x, gid, w, ws, alpha, nt, busy, act)
                    # the W4A16 bound held to 2^-12 of sum|terms| plus an output ulp; the act's flips, one ulp of
                    # an act value each, within 2^-8 of sum|terms| (a sanity check; the tests hold the exact bound)
                    tol = (2.0 ** -12 + (2.0 ** -8 if act else 0)) * absum + 2.0 ** -8 * ref.abs()
                    ok = bool(((y.double() - ref).abs() <= tol)[live].all())
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        experts_op.experts_gemv(x, gid, w, ws, alpha, nt, busy, act)
                    built.append((label, r, g, graph, ok))
                times = [[] for _ in built]
                for _ in range(args.rounds):  # (rounds in turn: a drift of the card's clocks meets every build)
                    for i, b in enumerate(built):
                        times[i].append(time_leaderboard(b[3].replay, args.reps))
                for (label, r, g, _, ok), ts in zip(built, times):
                    us = sorted(ts)[len(ts) // 2]
                    row = dict(tokens=t, launch=name, m=m, k=k, nt=nt, busy=busy, act=act, label=label,
                               groups=r.groups, grid=g, tuning=dict(r.tuning), us=us, rounds=ts, floor_us=floor,
                               pct_of_floor=100 * floor / us, bytes=nbytes, within_bound=ok)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                experts_op.launch_shape = real
                experts_op._plans.clear()
                experts_op._recent = RecentPlans()
    if not rows:
        return
    lines = ["| tokens | launch | build | groups | grid | us | % of floor | within bound |", "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['launch']} {r['m']}x{r['k']}{' act' if r['act'] else ''} | {r['label']} | "
                     f"{r['groups']} | {r['grid']} | {r['us']:.2f} | {r['pct_of_floor']:.1f}% | {r['within_bound']} |")
    print("\n".join(lines))
    if args.out:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, sms=sms, reps=args.reps)
        with open(args.out + ".json", "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(f"Experts' launches, {meta['device']}, {sms} SMs\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

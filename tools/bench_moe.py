"""Times one MoE block alone (transformers' ``Qwen3MoeSparseMoeBlock``: router + routed experts) in bf16
and with its experts as ``nvfp4_gemv.NVFP4Experts``, per token count, and reports the NVFP4 block against
the read floor of the bytes it must read: the active experts' NVFP4 weights and scales (each expert hit
read once) plus the router's bf16 weight.

    python tools/bench_moe.py                                  # Qwen3-30B-A3B's block on the GPU
    python tools/bench_moe.py --tokens 1,8,64 --mode w4a4 --out docs/bench-moe-h200
    python tools/bench_moe.py --device cpu --tiny              # smoke mode: a tiny block on the CPU

Qwen3-30B-A3B's block: hidden 2048, 128 experts, top 8, expert intermediate 768 (``--tiny``: 128, 8, 2,
64). Random weights (std 0.02), random tokens. On CUDA each variant is captured in a CUDA graph where it can
be (else timed eagerly, said in the table) and timed as the leaderboard times (``bench.time_leaderboard``:
L2 flushed, CUDA events, median); the read floor is ``tools/read_floor.py``'s fastest plain read of the
same bytes. On the CPU: wall-clock medians, no floor. On CUDA up to 64 tokens NVFP4Experts runs the experts'
kernel (nvfp4_gemv/experts_kernel.py); ``--fallback`` times its dequantize fallback too, ``--busy`` the
kernel's launch shape under other estimates of the groups with an expert. Where the down launch makes
``silu(gate) * up`` itself (``ACT_IN_KERNEL_MAX_TOKENS``) the block is timed with the act as torch ops too, and
at one token (CUDA) the block and its two kernels with the gate/up launch prefetching the down launch's bytes
(``PREFETCH_DOWN_MAX_TOKENS``, off by default) and without, three rounds alternating. The NVFP4 block's router is what
``quantize_model(fuse=True)`` makes of it (``fuse_routers``: ``TopKRouter``, one kernel up to 64 tokens on
CUDA); ``--hf-router`` keeps transformers' (the bf16 block always has transformers').
"""

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from nvfp4_gemv import NVFP4Experts  # noqa: E402
from nvfp4_gemv.model import experts_forward as experts_mod  # noqa: E402
from nvfp4_gemv.model.experts_forward import busy_groups  # noqa: E402

QWEN3_30B_A3B = dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
TINY = dict(hidden_size=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)


def block(tiny, device):
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = transformers.Qwen3MoeConfig(**(TINY if tiny else QWEN3_30B_A3B), norm_topk_prob=True)
    cfg._experts_implementation = "grouped_mm"  # transformers' default in a model (sync-free, capturable)
    torch.manual_seed(0)
    with torch.device(device):
        b = Qwen3MoeSparseMoeBlock(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in b.parameters():
            p.normal_(0, 0.02)
    return b, cfg


def nvfp4_bytes(cfg, experts_hit):
    """Bytes an ideal NVFP4 block reads: each expert hit once (values, e4m3 scales, its scalars) + router."""
    h, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    per_expert = 3 * i * h // 2 + 3 * i * h // 16 + 4 * 4
    return experts_hit * per_expert + e * h * 2


@contextlib.contextmanager
def patched(module, **values):
    """``module``'s attributes set to ``values`` for the block (a rule or a threshold timed another way), then
    put back."""
    saved = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


def timer(device, reps):
    if device.type == "cuda":
        from bench import time_leaderboard

        return lambda fn: time_leaderboard(fn, reps)

    def cpu(fn):
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
        return statistics.median(times)
    return cpu


def runnable(mod, x, device):
    """(a no-argument callable running mod(x), how): a CUDA graph replay where capture works, else eager.
    ``x`` None: ``mod`` takes no argument."""
    call = mod if x is None else (lambda: mod(x))
    with torch.no_grad():
        call()  # warm up (compiles, allocates)
        if device.type != "cuda":
            return call, "eager"
        torch.cuda.synchronize()
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                call()
            return g.replay, "graph"
        except Exception as err:  # e.g. transformers' eager experts loop (nonzero): not capturable
            torch.cuda.synchronize()
            return call, f"eager ({type(err).__name__})"


def kernels_only(experts, x, idx, prefetch=None):
    """A no-argument callable running just the experts' two kernel launches (gate/up, then down on stand-in
    activations, with the act inside where ``decode_forward`` puts it there) for this routing, as
    ``decode_forward`` groups it; ``prefetch`` True / False: the gate/up launch prefetching down's bytes or not
    (None: as ``decode_forward`` does)."""
    from nvfp4_gemv.experts_op import experts_gemv
    from nvfp4_gemv.model.experts_forward import (ACT_IN_KERNEL_MAX_TOKENS, PREFETCH_DOWN_MAX_TOKENS, busy_groups,
                                                  decode_groups, group_size, kernel_act)

    t, k = idx.shape
    (w1, s1, a1, q1), (w2, s2, a2, q2) = experts._mats()
    e = w1.shape[0]
    nt = group_size(t, k, e)
    busy = busy_groups(t, k, e, nt)
    xg, gid, _, _ = decode_groups(x, idx, e, nt)
    act = kernel_act(experts.act_fn) if q2 is None and t <= ACT_IN_KERNEL_MAX_TOKENS else None
    hid = torch.randn(gid.shape[0] * nt, w2.shape[2] * 2 * (2 if act else 1), device=x.device).to(x.dtype)
    pf = (w2, s2) if (t <= PREFETCH_DOWN_MAX_TOKENS if prefetch is None else prefetch) else None
    return lambda: (experts_gemv(xg, gid, w1, s1, a1, nt, busy, prefetch=pf),
                    experts_gemv(hid, gid, w2, s2, a2, nt, busy, act))


def profile_top(fn, n=12):
    """The CUDA kernels of one eager run of ``fn`` (after a warm-up), by GPU time: a table's text."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=n)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny block (smoke mode)")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64")
    ap.add_argument("--mode", default="w4a16", choices=("w4a16", "w4a4"))
    ap.add_argument("--reps", type=int, default=None, help="timed runs a case (default 30 on CUDA, 5 on the CPU)")
    ap.add_argument("--no-floor", action="store_true", help="skip the read floor (CUDA)")
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    ap.add_argument("--compile", action="store_true", help="torch.compile both blocks (as a compiled model runs "
                    "them) before the graph capture")
    ap.add_argument("--profile", action="store_true", help="print each token count's kernels of the NVFP4 block "
                    "(one eager run under torch.profiler)")
    ap.add_argument("--fallback", action="store_true", help="also time NVFP4Experts' dequantize fallback")
    ap.add_argument("--hf-router", action="store_true", help="keep transformers' router in the NVFP4 block "
                    "(default: fuse_routers, as quantize_model(fuse=True) does)")
    ap.add_argument("--busy", default="1", help="factors on the kernel's estimate of the groups with an expert "
                    "(its launch shape), each timed: e.g. 0.5,1,2")
    args = ap.parse_args()
    device = torch.device(args.device)
    reps = args.reps or (30 if device.type == "cuda" else 5)
    ref, cfg = block(args.tiny, device)
    ours = copy.deepcopy(ref)
    scales = None
    if args.mode == "w4a4":  # a stand-in calibration: tokens of unit scale
        e, s = cfg.num_experts, torch.full((), 4.0 / 2688, device=device)
        scales = (s.expand(e).clone(), (s / 8).expand(e).clone())
    ours.experts = NVFP4Experts.from_experts(ref.experts, mode=args.mode, input_scales=scales)
    if not args.hf_router:
        from nvfp4_gemv import fuse_routers

        fuse_routers(ours)
    if args.compile:
        # both blocks share one forward (one code object), recompiled for each token count and busy factor:
        # past dynamo's default limit of 8 the rest would run eagerly, unsaid
        torch._dynamo.config.recompile_limit = 256
        ref, ours = torch.compile(ref), torch.compile(ours)
    time_fn = timer(device, reps)
    floor = None
    if device.type == "cuda" and not args.no_floor:
        from bench import time_leaderboard
        from tools.read_floor import floor_us

        def floor(nbytes):
            return floor_us(nbytes, reps, time_leaderboard)[0]
    rows = []
    for t in [int(v) for v in args.tokens.split(",")]:
        x = torch.randn(1, t, cfg.hidden_size, device=device).to(torch.bfloat16)
        with torch.no_grad():
            _, _, idx = ref.gate(x.reshape(t, -1))
            want, got = ref(x), ours(x)
        hit = int(idx.unique().numel())
        err = float((got.float() - want.float()).norm() / want.float().norm())
        fb, how_b = runnable(ref, x, device)
        us_b = time_fn(fb)
        sweep = {}
        for f in [float(v) for v in args.busy.split(",")]:
            with patched(experts_mod, busy_groups=lambda *a, f=f: max(1, round(f * busy_groups(*a)))):
                fo, how_o = runnable(ours, x, device)
                sweep[f] = time_fn(fo)
        best = min(sweep, key=sweep.get)
        us_o = sweep[1.0] if 1.0 in sweep else sweep[best]
        act_ops_us = None
        if t <= experts_mod.ACT_IN_KERNEL_MAX_TOKENS:  # the act inside the down launch: time it as torch ops too
            with patched(experts_mod, ACT_IN_KERNEL_MAX_TOKENS=0):
                act_ops_us = time_fn(runnable(ours, x, device)[0])
        prefetch_us = no_prefetch_us = kernels_prefetch_us = kernels_no_prefetch_us = kernels_us = None
        if device.type == "cuda":
            fk, _ = runnable(kernels_only(ours.experts, x.reshape(t, -1), idx), None, device)
            kernels_us = time_fn(fk)
            if t == 1:  # the gate/up launch prefetching down's bytes (off by default): the block and the two
                # launches both ways, three rounds alternating between the four (medians of the rounds)
                ab = {}
                for pf in (1, 0):
                    with patched(experts_mod, PREFETCH_DOWN_MAX_TOKENS=pf):
                        ab[("block", pf)] = runnable(ours, x, device)[0]
                    ab[("kernels", pf)] = runnable(kernels_only(ours.experts, x.reshape(t, -1), idx, bool(pf)),
                                                   None, device)[0]
                runs = {key: [] for key in ab}
                for _ in range(3):
                    for key, fn in ab.items():
                        runs[key].append(time_fn(fn))
                prefetch_us, no_prefetch_us, kernels_prefetch_us, kernels_no_prefetch_us = (
                    statistics.median(runs[key]) for key in (("block", 1), ("block", 0), ("kernels", 1),
                                                             ("kernels", 0)))
            if args.profile:
                print(f"T={t}: kernels of the NVFP4 block (eager)\n" + profile_top(lambda: ours(x)), flush=True)
        fallback_us = None
        if args.fallback:
            with patched(experts_mod, DECODE_MAX_TOKENS=0):
                fallback_us = time_fn(runnable(ours, x, device)[0])
        nbytes = nvfp4_bytes(cfg, hit)
        fl = floor(nbytes) if floor else None
        rows.append(dict(tokens=t, experts_hit=hit, bf16_us=us_b, bf16_how=how_b, nvfp4_us=us_o, nvfp4_how=how_o,
                         nvfp4_bytes=nbytes, floor_us=fl, pct_of_floor=(100 * fl / us_o) if fl else None,
                         rel_err_vs_bf16=err, fallback_us=fallback_us, busy_sweep_us=sweep, act_as_ops_us=act_ops_us,
                         prefetch_us=prefetch_us, no_prefetch_us=no_prefetch_us,
                         kernels_prefetch_us=kernels_prefetch_us, kernels_no_prefetch_us=kernels_no_prefetch_us,
                         kernels_us=kernels_us, kernels_pct_of_floor=(100 * fl / kernels_us) if fl and kernels_us else None))
        print(f"T={t}: {hit} experts hit, bf16 {us_b:.1f} us ({how_b}), NVFP4 {args.mode} {us_o:.1f} us ({how_o}), "
              f"{nbytes / 1e6:.2f} MB" + (f", floor {fl:.1f} us ({100 * fl / us_o:.1f}%)" if fl else "")
              + f", rel. error vs bf16 {err:.3g}" + (f", the two kernels alone {kernels_us:.1f} us" if kernels_us else "")
              + (f", fallback {fallback_us:.1f} us" if fallback_us else "")
              + (f", the act as torch ops (not in the down launch) {act_ops_us:.1f} us" if act_ops_us else "")
              + (f", with / without the down prefetch {prefetch_us:.1f} / {no_prefetch_us:.1f} us" if prefetch_us else "")
              + (f" (the two kernels {kernels_prefetch_us:.1f} / {kernels_no_prefetch_us:.1f} us)"
                 if kernels_prefetch_us else "")
              + (f", busy factors {sweep}" if len(sweep) > 1 else ""), flush=True)
    head = ("| tokens | experts hit | bf16 us | NVFP4 us | speed-up | NVFP4 MB read | read floor us | % of floor "
            "| the two kernels alone us (% of floor) | fallback us |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        fl = f"{r['floor_us']:.1f} | {r['pct_of_floor']:.1f}%" if r["floor_us"] else "- | -"
        fb = f"{r['fallback_us']:.1f}" if r["fallback_us"] else "-"
        kn = (f"{r['kernels_us']:.1f}" + (f" ({r['kernels_pct_of_floor']:.1f}%)" if r["kernels_pct_of_floor"] else "")
              if r["kernels_us"] else "-")
        lines.append(f"| {r['tokens']} | {r['experts_hit']} | {r['bf16_us']:.1f} | {r['nvfp4_us']:.1f} | "
                     f"{r['bf16_us'] / r['nvfp4_us']:.2f}x | {r['nvfp4_bytes'] / 1e6:.2f} | {fl} | {kn} | {fb} |")
    print("\n".join(lines))
    if args.out:
        meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                    mode=args.mode, compiled=args.compile, router="transformers'" if args.hf_router else "TopKRouter", config={k: getattr(cfg, k) for k in QWEN3_30B_A3B}, reps=reps)
        with open(args.out + ".json", "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(f"MoE block ({meta['config']}), {meta['device']}, mode {args.mode}\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

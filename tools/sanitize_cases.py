"""Cases for tools/sanitize.sh: `task` = every task.yml shape (benchmarks included) and three shapes of the
streaming kernel's wide scale loads, each named with the kernel class and configuration ``pick_tuning`` gives
it; `all` = those plus fuzz shapes; `wide` = the three alone. All add the cases of the op's kernels
(``nvfp4_gemv.gemv``); `w4a16` = the W4A16 and quantize cases alone, `bulk` = W4A16's bulk builds alone,
`packed` = the W4A16 kernel on packed weights (``gemv_packed``) alone; `experts` = the experts' grouped kernel
(``experts_op.experts_gemv``) alone, `router` = the MoE routing kernel (``topk_route``) alone, `dequant` = the
prefill's dequantize kernel (``dequant_kernel``: plain, strided, packed, one and two blocks a thread) alone,
each of which `all` runs too; `model` = a tiny Llama's greedy decode, bf16 and with
our layers (W4A16 fused and packed, W4A16, W4A4), by ``generate`` and by ``model.generate`` (eager and static
cache as the GPU test that faulted; without CUDA graphs, so that it runs without the caching allocator too:
``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` gives each tensor its own allocation, where memcheck sees a read past
it; with the cache it lands in the same segment, unseen)."""

import os
import sys

if {"-h", "--help"} & set(sys.argv[1:]):  # the docstring, and nothing run
    sys.exit(print(__doc__) or 0)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "model")]

import torch  # noqa: E402
import yaml  # noqa: E402

import inputs  # noqa: E402
from nvfp4_gemv import leaderboard  # noqa: E402
from nvfp4_gemv.tuning import make_op, pick_tuning  # noqa: E402

with open(os.path.join(ROOT, "task.yml")) as f:
    spec = yaml.safe_load(f)
task = sorted({(c["m"], c["k"], c["l"]) for c in spec["tests"] + spec["benchmarks"]})
fuzz = [(128, 64, 1), (1152, 960, 5), (640, 2752, 3), (128, 32768, 2), (3968, 1600, 1)]
# the streaming kernel's 16-byte scale loads through the per-warp scratch (sf_wide) on its other unit shapes:
# 4 chunks over 8 lanes (K = 1024), 2 over 16 (K = 3072), 4 over 16 in two units a row (K = 4096); task.yml has
# only K = 2048 (4 over 16, one unit a row)
wide = [(4096, 1024, 2), (2048, 3072, 2), (1024, 4096, 4)]
# `task` = every task.yml shape (benchmarks included) and the wide ones, with the configuration pick_tuning gives it
section = sys.argv[1] if sys.argv[1:] else ""
shapes = {"all": task + wide + fuzz, "task": task + wide, "wide": wide, "w4a16": [], "bulk": [], "packed": [],
          "experts": [], "router": [], "dequant": [], "model": []}.get(section)
if shapes is None:
    raise SystemExit("usage: sanitize_cases.py all|task|wide|w4a16|bulk|packed|experts|router|dequant|model")
if section == "model":  # (session 66: an illegal address in the GPU suite after leaderboard tests, generate's test)
    from model.test_generate import hf, prompt, tiny_llama  # noqa: E402

    from nvfp4_gemv import calibrate_input_scales, generate, quantize_model  # noqa: E402

    ids = prompt(2, 5, "cuda")
    for name, kw in (("bf16", None), ("w4a16 fused packed", dict(fuse=True, pack=True)), ("w4a16", {}),
                     ("w4a4", dict(mode="w4a4"))):
        m = tiny_llama(device="cuda")
        if name == "w4a4":
            kw["input_scales"] = calibrate_input_scales(m, lambda model: model(input_ids=ids))
        if kw is not None:
            quantize_model(m, **kw)
        for how, run in (("generate", lambda: generate(m, ids, 12, cuda_graph=False)),
                         ("model.generate", lambda: hf(m, ids, 12))):
            out = run()
            torch.cuda.synchronize()
            print(f"model {name}: {how}, eager: {out.shape[1] - ids.shape[1]} new tokens", flush=True)
            assert out.shape == (2, 17)
    sys.exit(0)
sms = torch.cuda.get_device_properties(0).multi_processor_count
for m, k, l in shapes:
    for cpu_scales in (False, True):
        tuning = pick_tuning(k, m, l, sms, cpu_scales)
        kernel = type(make_op(k, cpu_scales, **dict(tuning))).__name__
        data = inputs.random_inputs(m, k, l, seed=m + k)
        if cpu_scales:
            data = (*data[:2], data[2].cpu(), data[3].cpu(), *data[4:])
        # the first call makes the plan; the second takes its cached hit path (guard, inlined launch)
        for call in ("plan", "hit"):
            out = leaderboard.custom_kernel(inputs.poisoned(data))
            torch.cuda.synchronize()
            ok, msg = inputs.check_exact(data, out)
            print(f"{m}x{k}x{l} cpu_scales={cpu_scales} {kernel} {dict(tuning)} {call}: "
                  f"{'ok' if ok else 'MISMATCH ' + msg}", flush=True)
            assert ok
if section in ("w4a16", "bulk", "packed", "experts", "router", "dequant"):  # only the W4A16 (bulk: its bulk builds; packed: packed weights) and
    shapes = None                           # quantize kernels (below)
# the op for model code: both kernels (tokens: dp4a with x in shared memory; mma: tensor cores, partials summed
# in shared memory after a barrier), plain and blocked scales, a tile moved back (M / 8 not a multiple of groups)
from nvfp4_gemv import op, op_plan  # noqa: E402

# and the bulk-copy dp4a kernel (a tuning: mbarrier stages, partials in shared memory read by the producer)
for n, m, k, mma, groups, blocked, bulk in () if shapes is None else ((4, 384, 2368, 0, None, False, 0), (16, 1152, 7168, 1, None, False, 0),
                                            (9, 384, 1024, 1, 5, True, 0), (20, 7168, 2048, 1, None, True, 0),
                                            (3, 512, 4096, 0, None, False, 1), (4, 384, 7168, 0, None, False, 1)):
    x, xs, w, ws, a = inputs.op_inputs(n, m, k, seed=n + m)
    args = (x, inputs.blocked_scales(xs, n, k) if blocked else xs, w, inputs.blocked_scales(ws, m, k) if blocked else ws, a)
    tuning = tuple(sorted({"mma": mma, **({"groups": groups} if groups else {}), **({"bulk": 1} if bulk else {})}.items()))
    out = torch.full((n, m), float("nan"), dtype=torch.bfloat16, device="cuda")
    plan = op_plan.W4A4Plan(*args, out, torch.bfloat16, tuning=tuning)
    plan(*args, out, torch.bfloat16)
    torch.cuda.synchronize()
    exact, terms = inputs.op_exact(x, xs, w, ws, a)
    bad, msg = inputs.op_violations(out, exact, terms)
    kernel = type(plan.launches[0][0].op).__name__
    print(f"op N={n} {m}x{k} blocked={blocked} {kernel} {dict(tuning)}: {'ok' if bad == 0 else 'MISMATCH ' + msg}",
          flush=True)
    assert bad == 0

# the routed op through gemv's own entry: the first call makes the plan, the later ones take its hit path
# (allocating and with out=); plain and blocked scales
for n, m, k, blocked in () if shapes is None else ((1, 256, 2048, False), (4, 384, 7168, True), (12, 1152, 4096, False)):
    x, xs, w, ws, a = inputs.op_inputs(n, m, k, seed=n + m)
    args = (x, inputs.blocked_scales(xs, n, k) if blocked else xs, w, inputs.blocked_scales(ws, m, k) if blocked else ws)
    exact, terms = inputs.op_exact(x, xs, w, ws, a)
    for call in ("plan", "hit", "hit out="):
        out = op.gemv(*args, a, out=torch.full((n, m), float("nan"), dtype=torch.bfloat16, device="cuda")
                      if call.endswith("out=") else None)
        torch.cuda.synchronize()
        bad, msg = inputs.op_violations(out, exact, terms)
        print(f"gemv N={n} {m}x{k} blocked={blocked} {call}: {'ok' if bad == 0 else 'MISMATCH ' + msg}", flush=True)
        assert bad == 0

# W4A16 (bf16/fp16 x): one token on 512 rows (x in registers), one token on 4352 rows (on 132 SMs the 4-CTA build,
# w as the A operand, late, dec, xpair, across), 2 tokens on the same rows (on 132 SMs the shared-x build of 2..4
# tokens, its copy of x in batches; at K = 8256 two CTAs of 4 groups), 1 and 3 tokens on 2048 rows (the 16-warp
# build of fewer rows), 6 tokens on 2048 rows (the same build at 5..8 tokens), 12 tokens on 8576 rows (x in
# shared memory from 9 tokens, 16 warps of 4 groups), K % 128 == 64 (4 tokens: w_a), two A tiles with blocked
# scales, the last tile moved back; then the quantize kernel (both dtypes, a strided x)
from w4a16_inputs import w4a16_exact, w4a16_inputs, w4a16_violations  # noqa: E402

from nvfp4_gemv import quant  # noqa: E402

# packed weights (gemv_packed): the one-token routes (x in registers on 512 rows, 4 CTAs of 2 groups on 4352,
# 4-warp CTAs in even rounds on 28672), shared x at 2 and 12 tokens, 32 tokens, and a view of the last 128 rows
# (its last piece ends where the buffer does), and a tiny Llama's prefill (10 tokens, K = 256: warps without slices,
# whose hoisted loads of x read past it before ptx.ldg_v4_if had side effects)
from nvfp4_gemv import gemv_packed, pack_weight  # noqa: E402

for n, m, k, rows in () if section in ("bulk", "experts", "router", "dequant") else ((1, 512, 4096, None), (1, 4352, 2048, None), (1, 28672, 4096, None),
                                                   (2, 4352, 8192, None), (12, 8576, 4096, None),
                                                   (32, 1152, 1024, None), (3, 1024, 2048, 128), (10, 512, 256, None)):
    x, _, w, ws, a = w4a16_inputs(n, m, k, seed=n + m + 2, dtype=torch.float16 if n == 12 else torch.bfloat16)
    wp = pack_weight(w, ws)
    if rows:
        wp, w, ws = wp[m - rows:], w[m - rows:], ws[m - rows:]
    out = gemv_packed(x, wp, a, out=torch.full((n, wp.shape[0]), float("nan"), dtype=torch.bfloat16, device="cuda"))
    torch.cuda.synchronize()
    bad, msg = w4a16_violations(out, *w4a16_exact(x, w, ws, a))
    print(f"w4a16 packed N={n} {wp.shape[0]}x{k}: {'ok' if bad == 0 else 'MISMATCH ' + msg}", flush=True)
    assert bad == 0
for n, m, k, dtype, blocked in () if section in ("bulk", "packed", "experts", "router", "dequant") else ((1, 512, 4096, torch.bfloat16, False), (1, 4352, 2048, torch.bfloat16, False),
                                (2, 4352, 2048, torch.float16, False), (2, 4352, 8256, torch.bfloat16, False),
                                (1, 2048, 4096, torch.bfloat16, False), (3, 2048, 4160, torch.float16, True),
                                (6, 2048, 4160, torch.bfloat16, True), (12, 8576, 4096, torch.float16, False),
                                (4, 384, 4160, torch.bfloat16, False),
                                (20, 640, 2112, torch.float16, True), (32, 1152, 1024, torch.bfloat16, False),
                                (10, 512, 256, torch.bfloat16, False)):
    x, _, w, ws, a = w4a16_inputs(n, m, k, seed=n + m, dtype=dtype, blocked=blocked)
    out = op.gemv(x, None, w, ws, a, out=torch.full((n, m), float("nan"), dtype=torch.bfloat16, device="cuda"))
    torch.cuda.synchronize()
    bad, msg = w4a16_violations(out, *w4a16_exact(x, w, ws, a, blocked))
    print(f"w4a16 N={n} {m}x{k} {dtype} blocked={blocked}: {'ok' if bad == 0 else 'MISMATCH ' + msg}", flush=True)
    assert bad == 0
# bulk (a measuring build, not routed): its stages on mbarriers, warp 0 copying while the warps read, one token
# (late, 4 CTAs of 2 groups, stages of 2 rounds) and 2 tokens (three stages of one round) over several tiles a CTA
from nvfp4_gemv.reference import check_args  # noqa: E402

late = {"threads": 256, "w_a": 1, "x_smem": 1, "xpair": 1, "late": 1, "dec": 1, "groups": 2, "ctas": 4}
for n, m, k, tune in () if section in ("packed", "experts", "router", "dequant") else ((1, 17536, 4096, {**late, "bulk": 2, "span": 2}),
                                                    (2, 17536, 3072, {**late, "late": 0, "bulk": 3})):
    x, _, w, ws, a = w4a16_inputs(n, m, k, seed=n + m + 1)
    out = torch.full((n, m), float("nan"), dtype=torch.bfloat16, device="cuda")
    plan = op_plan.W4A16Plan(x, w, ws, a, out, torch.bfloat16, check_args(x, None, w, ws, a, torch.bfloat16, out),
                           tuning=tuple(sorted(tune.items())))
    plan(x, w, ws, a, out, torch.bfloat16)
    torch.cuda.synchronize()
    bad, msg = w4a16_violations(out, *w4a16_exact(x, w, ws, a))
    print(f"w4a16 bulk N={n} {m}x{k}: {'ok' if bad == 0 else 'MISMATCH ' + msg}", flush=True)
    assert bad == 0
for rows, k, dtype in () if section in ("bulk", "packed", "experts", "router", "dequant") else ((3, 4096, torch.bfloat16), (5, 1024, torch.float16)):
    x = torch.randn(rows, 2 * k, dtype=dtype, device="cuda")[:, k:]
    gs = torch.tensor([7.0], device="cuda")
    q, s = quant.quantize(x, gs)
    rq, rs = quant.quantize_reference(x, gs)
    ok = torch.equal(q, rq) and torch.equal(s.view(torch.uint8), rs.view(torch.uint8))
    print(f"quantize {rows}x{k} {dtype}: {'ok' if ok else 'MISMATCH'}", flush=True)
    assert ok
    xd = quant.quantize_dequantized(x, gs)  # the dequantized build: 32-byte stores a block
    ok = torch.equal(xd, quant.quantize_dequantized_reference(x, gs))
    print(f"quantize_dequantized {rows}x{k} {dtype}: {'ok' if ok else 'MISMATCH'}", flush=True)
    assert ok

# the experts' grouped kernel: the fuzz's first 16 cases (1-16 experts, 128-512 rows, K 64-2048 including K % 128 == 64,
# 1-32 token rows a group, empty groups, repeated experts, one x row every group reads, rows that cancel; every
# fourth from the second on int64 ids, its empty groups' ids each kind outside [0, E)), each against float64
# within the kernel's bound
if section in ("all", "experts"):
    from model.test_experts_kernel import check_within_bound, exact, fuzz_case, random_weights  # noqa: E402

    from nvfp4_gemv.experts_op import experts_gemv  # noqa: E402

    for seed in range(16):
        (x, ids, w, ws, alpha, nt, busy), _ = fuzz_case(seed, "cuda")
        ref, absum = exact(x, ids, w, ws, alpha, nt)
        if seed % 4 == 1:  # int64 ids (a router's, as decode_groups passes them at one token): no expert as any
            bad = torch.tensor([w.shape[0], 2 ** 32 + 1, -(2 ** 63), 2 ** 31, -1])  # id outside [0, E)
            ids = torch.where(ids < 0, bad[torch.arange(ids.shape[0]) % 5], ids.long())
        args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in (x, ids, w, ws, alpha, nt, busy)]
        # even cases prefetch another experts weight's bytes (the op's option; decode_forward leaves it off)
        pf = None if seed % 2 else tuple(t.cuda() for t in random_weights(torch.Generator().manual_seed(seed),
                                                                             w.shape[0], 128 * (1 + seed % 3), 192)[:2])
        # the op allocates its output: NaN in the block the caching allocator will hand it (made after the
        # inputs' copies, which would otherwise take the freed block)
        poison = torch.full((ids.shape[0] * nt, w.shape[1]), float("nan"), dtype=x.dtype, device="cuda")
        del poison
        y = experts_gemv(*args, prefetch=pf)
        torch.cuda.synchronize()
        y = y.cpu()
        assert not y[~ref.isnan()].isnan().any(), f"experts case {seed}: rows of a group with an expert left unwritten"
        check_within_bound(y, ref, absum, x.shape[1], f"experts case {seed}")
        print(f"experts case {seed}: E={w.shape[0]} {w.shape[1]}x{x.shape[1]} nt={nt} ids={ids.tolist()}"
              f"{'' if pf is None else ', prefetch ' + str(tuple(pf[0].shape))}: ok", flush=True)
    # the down launch with act (x rows [gate | up], the act made while x is copied into shared memory)
    from model.test_experts_act import act_allowance, act_case, silu_mul_once  # noqa: E402

    for seed in range(8):
        x, ids, w, ws, alpha, nt = act_case(seed)
        h64, h = silu_mul_once(x)
        ref, absum = exact(h, ids, w, ws, alpha, nt)
        allow, _ = act_allowance(h64, h, ids, w, ws, alpha, nt, w.shape[1])
        y = experts_gemv(*[a.cuda() for a in (x, ids, w, ws, alpha)], nt, 2, act="silu")
        torch.cuda.synchronize()
        check_within_bound(y.cpu(), ref, absum + 2.0 ** 12 * allow, x.shape[1] // 2, f"experts act case {seed}")
        print(f"experts act case {seed}: {w.shape[1]}x{x.shape[1] // 2} nt={nt} {tuple(x.shape)}: ok", flush=True)
# the routing kernel: the GPU tests' shapes (E 32-1024, H 256-8192, k 1-32, 1-64 tokens, both dtypes, with and
# without renormalisation) and a strided x, each checked as its test does (top k of its own logits, stable order)
if section in ("all", "router"):
    from op.test_router_kernel import CASES as ROUTER_CASES, inputs as router_inputs, stable_top  # noqa: E402

    from nvfp4_gemv.router_op import kernel_takes, topk_route  # noqa: E402

    for t, e, h, k, dtype, norm in ROUTER_CASES:
        x, w = router_inputs(t, e, h, dtype, seed=t * 1000 + e + k)
        if t > 1:  # rows 2h apart: a strided x
            x = torch.cat([x, torch.zeros_like(x)], dim=1)[:, :h]
        assert kernel_takes(x, w, k)
        logits, weights, idx = topk_route(x, w, k, norm)
        torch.cuda.synchronize()
        want_i, _ = stable_top(logits, k, norm)
        assert torch.equal(idx, want_i), f"router {t}x{e}x{h} k={k}: indices differ from its logits' stable top k"
        print(f"router T={t} E={e} H={h} k={k} {dtype} norm={norm}: ok", flush=True)
# the dequantize kernel: every build (one and two blocks a thread; plain, strided, packed) bit for bit
if section in ("all", "dequant"):
    from op.test_dequant_kernel import exact as dq_exact, poisoned, weights as dq_weights  # noqa: E402

    from nvfp4_gemv import dequant_kernel  # noqa: E402
    from nvfp4_gemv.packed import pack_weight  # noqa: E402

    # (K % 32 == 0 takes the two-blocks-a-thread build where pair is asked; other K the one-block build)
    for m, k in ((1, 16), (3, 48), (130, 4112), (256, 4096), (130, 4128)):
        for dtype in (torch.bfloat16, torch.float16):
            for pair in (False, True):
                w, s = dq_weights(m, k, seed=m + k)
                want = dq_exact(w, s, dtype).view(torch.int16)
                out = poisoned(m, k, dtype)  # (each output poisoned: a kernel that wrote nothing fails)
                dequant_kernel.dequantize_cuda(w.cuda(), s.cuda(), out, k, pair=pair)
                # codes and scales as column slices of wider rows: both strided, 64 and 8 bytes in
                wide_w = torch.zeros(m, k // 2 + 128, dtype=torch.uint8)
                wide_w[:, 64:64 + k // 2] = w
                wide_s = torch.zeros(m, k // 16 + 16, dtype=torch.uint8)
                wide_s[:, 8:8 + k // 16] = s.view(torch.uint8)
                strided = poisoned(m, k, dtype)
                dequant_kernel.dequantize_cuda(wide_w.cuda()[:, 64:64 + k // 2],
                                               wide_s.cuda().view(s.dtype)[:, 8:8 + k // 16], strided, k, pair=pair)
                torch.cuda.synchronize()
                assert torch.equal(out.cpu().view(torch.int16), want), f"dequant {m}x{k}"
                assert torch.equal(strided.cpu().view(torch.int16), want), f"dequant strided {m}x{k}"
                if m % 128 == 0 and k % 128 == 0:
                    packed = poisoned(m, k, dtype)
                    dequant_kernel.dequantize_cuda(pack_weight(w.cuda(), s.cuda()), None, packed, k, packed=True, pair=pair)
                    torch.cuda.synchronize()
                    assert torch.equal(packed.cpu().view(torch.int16), want), f"dequant packed {m}x{k}"
                print(f"dequant {m}x{k} {dtype} pair={pair}: ok", flush=True)

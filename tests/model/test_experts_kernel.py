"""The experts' decode path (``experts_forward.decode_forward`` over ``experts_op.experts_gemv`` and its kernel,
``experts_kernel``): the slots' groups, the op's exact CPU path and its CUDA kernel against float64 (a fuzz of
300 cases: tokens, experts hit, duplicates, empty groups, K and M shapes) within the W4A16 kernel's bound, the
whole forward against each slot computed alone, sync-free, inside a CUDA graph and under torch.compile, and
bad arguments named."""

import pytest
import torch

from nvfp4_gemv.experts_op import can_implement, check_args, experts_gemv
from nvfp4_gemv.model.experts import NVFP4Experts
from nvfp4_gemv.model.experts_forward import (ACT_IN_KERNEL_MAX_TOKENS, DECODE_MAX_TOKENS, busy_groups,
                                              decode_forward, experts_kernel_takes, group_size, kernel_act,
                                              quantize_dequantized_rows, slot_groups)
from nvfp4_gemv.quant import dequantize
from sync_free import no_syncs

CUDA = pytest.mark.gpu


def random_weights(gen, e, m, k):
    w = torch.randint(0, 256, (e, m, k // 2), generator=gen, dtype=torch.uint8)
    # e4m3 bytes 0x08..0x5f: subnormal-free 2^-6 .. 2^3.9 and their mantissas
    ws = torch.randint(0x08, 0x60, (e, m, k // 16), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
    alpha = torch.exp2(torch.randint(-14, -2, (e,), generator=gen).float()) * (1 + torch.rand(e, generator=gen))
    return w, ws, alpha


def random_module(gen, e, h, i, mode):
    w, ws, a = random_weights(gen, e, 2 * i, h)
    mod = NVFP4Experts(e, h, i, torch.nn.SiLU(), mode, input_scale=mode == "w4a4")
    mod.gate_up_weight, mod.gate_up_weight_scale, mod.gate_up_weight_scale_2 = w, ws, a
    w, ws, a = random_weights(gen, e, h, i)
    mod.down_weight, mod.down_weight_scale, mod.down_weight_scale_2 = w, ws, a
    if mode == "w4a4":
        mod.gate_up_input_scale = torch.exp2(torch.empty(e).uniform_(-3, 2, generator=gen)) / 2688
        mod.down_input_scale = torch.exp2(torch.empty(e).uniform_(-3, 2, generator=gen)) / 2688 * 50
    return mod


def mats(mod):
    return ((mod.gate_up_weight, mod.gate_up_weight_scale, mod._gate_up_alpha, mod._gate_up_x_scale),
            (mod.down_weight, mod.down_weight_scale, mod._down_alpha, mod._down_x_scale))


def routing(gen, t, k, e, odd=0.08):
    idx = torch.randint(0, e, (t, k), generator=gen)  # duplicates within a token allowed
    bad = torch.rand(t, k, generator=gen) < odd  # transformers' EP sentinel E and out-of-range ids
    idx = torch.where(bad, torch.tensor([e, -1, e + 3])[torch.randint(0, 3, (t, k), generator=gen)], idx)
    return idx, torch.rand(t, k, generator=gen)


# ----------------------------------------------------------------------------------------------------
# The groups (device-agnostic torch ops)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_slot_groups_give_every_valid_slot_one_row_of_a_group_of_its_expert(seed):
    gen = torch.Generator().manual_seed(seed)
    e = int(torch.randint(1, 40, (1,), generator=gen))
    k = int(torch.randint(1, 9, (1,), generator=gen))
    t = int(torch.randint(1, DECODE_MAX_TOKENS + 1, (1,), generator=gen))
    nt = int(torch.randint(1, 33, (1,), generator=gen))
    idx, _ = routing(gen, t, k, e, odd=0.2)
    order, row, gid, valid = slot_groups(idx, e, nt)
    s = t * k
    assert sorted(order.tolist()) == list(range(s))
    assert len(set(row.tolist())) == s, "two slots share a row"
    assert gid.shape[0] == min(s, e + 1 + s // nt) and gid.dtype == torch.int32
    assert int(row.max()) < gid.shape[0] * nt
    flat = idx.reshape(-1)
    for sorted_i, slot in enumerate(order.tolist()):
        grp = int(row[sorted_i]) // nt
        want = int(flat[slot]) if bool(valid[slot]) else -1
        assert int(gid[grp]) == want, f"slot {slot} (id {int(flat[slot])}) placed in a group of expert {int(gid[grp])}"
    # an expert of c valid slots takes ceil(c / nt) groups: read once a group
    for ex in range(e):
        c = int((flat == ex).sum())
        assert int((gid == ex).sum()) == -(-c // nt)


def test_group_size_and_busy_groups_follow_their_rules():
    assert [group_size(t, 8, 128) for t in (1, 4, 8, 16, 64)] == [1, 4, 8, 8, 8]  # Qwen3-30B-A3B
    assert [group_size(t, 2, 8) for t in (1, 8, 16, 32, 64)] == [1, 8, 8, 16, 32]  # Mixtral
    assert busy_groups(1, 8, 128, 1) == 8
    assert 15 <= busy_groups(3, 8, 128, 4) <= 24  # 22 experts hit; under 4 tokens the estimate itself
    assert 35 <= busy_groups(16, 8, 128, 8) <= 45  # 128 (1 - (1 - 1/16)^16) = 82 experts hit, halved
    assert busy_groups(64, 2, 8, 32) == 4  # all 8 hit, halved


def test_kernel_takes_decode_shapes_the_kernel_builds_only():
    gen = torch.Generator().manual_seed(0)
    mod = random_module(gen, 4, 128, 64, "w4a16")
    gu, dn = mats(mod)
    assert experts_kernel_takes(1, gu, dn) and experts_kernel_takes(DECODE_MAX_TOKENS, gu, dn)
    assert not experts_kernel_takes(DECODE_MAX_TOKENS + 1, gu, dn)  # prefill: the fallback
    assert not experts_kernel_takes(1, (gu[0][:, :64], *gu[1:]), dn)  # a row slice (TP shard) is not contiguous
    odd = random_module(gen, 4, 128, 96, "w4a16")  # gate/up of 192 rows: not a multiple of 128
    assert not experts_kernel_takes(1, *mats(odd))
    assert can_implement(128, 64) and not can_implement(128, 96) and not can_implement(64, 128)
    assert not can_implement(128, 32768 + 64)


# ----------------------------------------------------------------------------------------------------
# The op against float64
# ----------------------------------------------------------------------------------------------------


def exact(x, ids, w, ws, alpha, nt):
    """float64 product and sum of |terms| of every row of a group with an expert (others NaN)."""
    g = ids.shape[0]
    m = w.shape[1]
    ref = torch.full((g * nt, m), float("nan"), dtype=torch.float64)
    absum = torch.zeros((g * nt, m), dtype=torch.float64)
    for grp, e in enumerate(ids.tolist()):
        if e < 0:
            continue
        wv = dequantize(w[e], ws[e]).double() * float(alpha[e])
        rows = (x if x.shape[0] == 1 else x[grp * nt:(grp + 1) * nt]).double()  # (one row every group reads)
        ref[grp * nt:(grp + 1) * nt] = rows @ wv.T
        absum[grp * nt:(grp + 1) * nt] = rows.abs() @ wv.abs().T
    return ref, absum


def half_ulp(y):
    """Half an ulp of each bf16 / fp16 value (its binade's; at a power of two the larger one, which bounds
    a rounding from either side), subnormals included."""
    bits, tiny = (8, 2.0 ** -133) if y.dtype == torch.bfloat16 else (11, 2.0 ** -24)
    a = y.double().abs()
    e = torch.floor(torch.log2(torch.where(a > 0, a, torch.ones_like(a))))
    return torch.maximum(torch.exp2(e - bits + 1), torch.full_like(a, tiny)) / 2


def check_within_bound(y, ref, absum, k, what):
    """The W4A16 kernel's bound with 16 warps, held to the op's 2^-12 of sum|terms| as the W4A16 tests do,
    plus half an ulp of the output."""
    live = ~ref.isnan()
    tol = half_ulp(y) + 2.0 ** -12 * absum
    err = (y.double() - ref).abs()
    bad = live & (err > tol)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {int(live.sum())} values off the bound, e.g. "
                           f"{y.double()[bad][:3].tolist()} against {ref[bad][:3].tolist()}")


def fuzz_case(seed, device):
    gen = torch.Generator().manual_seed(1000 + seed)
    e = int(torch.randint(1, 17, (1,), generator=gen))
    m = 128 * int(torch.randint(1, 5, (1,), generator=gen))
    k = 64 * [1, 2, 3, 4, 8, 12, 32][int(torch.randint(0, 7, (1,), generator=gen))]
    nt = [1, 2, 3, 4, 5, 8, 9, 16, 24, 32][int(torch.randint(0, 10, (1,), generator=gen))]
    g = int(torch.randint(1, 13, (1,), generator=gen))
    ids = torch.randint(-1, e, (g,), generator=gen, dtype=torch.int32)  # -1: an empty group; repeats allowed
    dtype = torch.bfloat16 if torch.rand(1, generator=gen) < 0.7 else torch.float16
    w, ws, alpha = random_weights(gen, e, m, k)
    x = (torch.randn(g * nt, k, generator=gen) * torch.exp2(torch.randint(-6, 7, (g * nt, 1), generator=gen))).to(dtype)
    if seed % 5 == 0:  # rows that cancel: each value and its negation
        x[:, k // 2:] = -x[:, :k // 2]
    if nt == 1 and seed % 2:  # one row every group reads (a token's experts)
        x = x[:1].contiguous()
    busy = int(torch.randint(1, 2 * g + 1, (1,), generator=gen))
    return (x, ids, w, ws, alpha, nt, busy), device


@pytest.mark.parametrize("seed", range(12))
def test_cpu_path_is_float64_rounded_once(seed):
    (x, ids, w, ws, alpha, nt, busy), _ = fuzz_case(seed, "cpu")
    y = experts_gemv(x, ids, w, ws, alpha, nt, busy)
    ref, _ = exact(x, ids, w, ws, alpha, nt)
    live = ~ref.isnan()
    from nvfp4_gemv.reference import round_to

    assert torch.equal(y[live], round_to(ref, x.dtype)[live])
    assert y[~live].isnan().all(), "rows of groups without an expert are NaN on the CPU"


def check_fuzz_case_on_cuda(seed):
    """Fuzz case ``seed`` through the kernel, its output poisoned first: every row of a group with an expert
    written and within the bound of float64."""
    (x, ids, w, ws, alpha, nt, busy), _ = fuzz_case(seed, "cuda")
    ref, absum = exact(x, ids, w, ws, alpha, nt)
    args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in (x, ids, w, ws, alpha, nt, busy)]
    # the op allocates its output: NaN in the block the caching allocator will hand it
    poison = torch.full((ids.shape[0] * nt, w.shape[1]), float("nan"), dtype=x.dtype, device="cuda")
    del poison
    y = experts_gemv(*args).cpu()
    live = ~ref.isnan()
    assert not y[live].isnan().any(), f"case {seed}: rows of a group with an expert left unwritten"
    check_within_bound(y, ref, absum, x.shape[1], f"case {seed} (E={w.shape[0]}, M={w.shape[1]}, "
                       f"K={x.shape[1]}, nt={nt}, busy={busy}, ids={ids.tolist()}, {x.dtype})")


@CUDA
@pytest.mark.parametrize("chunk", range(10))
def test_cuda_kernel_within_its_bound_of_float64(chunk):
    """300 random cases (30 a chunk): outputs poisoned first; rows of groups without an expert stay poisoned."""
    for seed in range(30 * chunk, 30 * (chunk + 1)):
        check_fuzz_case_on_cuda(seed)


# ----------------------------------------------------------------------------------------------------
# The forward
# ----------------------------------------------------------------------------------------------------


def silu_mul_once(g):
    """``silu(gate) * up`` of rows [gate | up] in float64, rounded once to g's dtype (the down launch's act)."""
    i = g.shape[1] // 2
    gate, up = g[:, :i].double(), g[:, i:].double()
    return (gate / (1 + torch.exp(-gate)) * up).to(g.dtype)


def per_slot(mod, x, idx, wts):
    """Each slot alone, the stages as decode_forward defines them (each product float64, rounded once; the
    act as torch ops, or inside the down launch up to ACT_IN_KERNEL_MAX_TOKENS tokens of W4A16 SiLU experts:
    float64, rounded once)."""
    (w1, s1, a1, q1), (w2, s2, a2, q2) = mats(mod)
    e = w1.shape[0]
    t, k = idx.shape
    in_kernel = q2 is None and t <= ACT_IN_KERNEL_MAX_TOKENS and kernel_act(mod.act_fn) is not None
    out = torch.zeros(t, x.shape[1], dtype=torch.float32)
    for ti in range(t):
        for j in range(k):
            ex = int(idx[ti, j])
            if not 0 <= ex < e:
                continue
            xr = x[ti:ti + 1]
            if q1 is not None:
                xr = quantize_dequantized_rows(xr, q1[ex:ex + 1])
            ids = torch.tensor([ex], dtype=torch.int32)
            g = experts_gemv(xr.contiguous(), ids, w1, s1, a1, 1)
            i = g.shape[1] // 2
            h = silu_mul_once(g) if in_kernel else mod.act_fn(g[:, :i]) * g[:, i:]
            if q2 is not None:
                h = quantize_dequantized_rows(h, q2[ex:ex + 1])
            d = experts_gemv(h.contiguous(), ids, w2, s2, a2, 1)
            out[ti] += d[0].float() * wts[ti, j].float()
    return out.to(x.dtype)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("t, k, e", [(1, 8, 16), (3, 2, 4), (16, 4, 8), (33, 2, 4)])
def test_cpu_forward_is_each_slot_alone_bit_for_bit(mode, t, k, e):
    gen = torch.Generator().manual_seed(t * 100 + k)
    mod = random_module(gen, e, 128, 64, mode)
    x = torch.randn(t, 128, generator=gen).bfloat16()
    idx, wts = routing(gen, t, k, e)
    got = decode_forward(x, idx, wts, *mats(mod), mod.act_fn)
    want = per_slot(mod, x, idx, wts)
    # the combine adds a token's k slots in fp32 in slot order in both
    assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_cpu_one_token_forward_takes_any_id_outside_the_experts_as_none(mode, dtype):
    """At one token the router's ids are the groups as they are (int64: no kernel makes int32 ids): every
    kind of id outside [0, E) is no expert, in the W4A4 stages' input-scale lookups too, bit for bit each
    valid slot alone."""
    gen = torch.Generator().manual_seed(11)
    e = 16
    mod = random_module(gen, e, 128, 64, mode)
    x = torch.randn(1, 128, generator=gen).bfloat16()
    bad = [e, -1, e + 3] + ([2 ** 32 + 2, -(2 ** 63)] if dtype == torch.int64 else [2 ** 31 - 1, -(2 ** 31)])
    idx = torch.tensor([[3] + bad + [12, 3]], dtype=dtype)
    wts = torch.rand(idx.shape, generator=gen)
    got = decode_forward(x, idx, wts, *mats(mod), mod.act_fn)
    assert torch.equal(got, per_slot(mod, x, idx, wts))


def test_cpu_forward_compiles_with_dynamic_token_counts_without_a_break():
    """Under torch.compile a model's second token count makes the count symbolic (automatic dynamic
    shapes): the group size and count are then SymInts the op's fake follows; the eager bits."""
    from torch._dynamo.utils import counters

    gen = torch.Generator().manual_seed(5)
    mod = random_module(gen, 8, 128, 64, "w4a4")
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(lambda x, i, w: decode_forward(x, i, w, *mats(mod), mod.act_fn), fullgraph=True,
                       backend="eager", dynamic=True)
    for t in (2, 3, 9, 1):
        x = torch.randn(t, 128, generator=gen).bfloat16()
        idx, wts = routing(gen, t, 2, 8)
        assert torch.equal(fn(x, idx, wts), decode_forward(x, idx, wts, *mats(mod), mod.act_fn))
    assert not counters["graph_break"]


@CUDA
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("t", [1, 4, 16, 64])
def test_cuda_forward_takes_the_kernel_and_agrees_with_the_cpu(mode, t):
    gen = torch.Generator().manual_seed(t)
    mod = random_module(gen, 16, 256, 128, mode)
    x = torch.randn(t, 256, generator=gen).bfloat16()
    idx, wts = routing(gen, t, 4, 16)
    want = decode_forward(x, idx, wts, *mats(mod), mod.act_fn)
    gpu = mod.cuda()
    calls = []
    import nvfp4_gemv.experts_op as op

    real = op._run
    op._run = lambda *a: calls.append(1) or real(*a)
    try:
        got = gpu(x.cuda(), idx.cuda(), wts.cuda()).cpu()
    finally:
        op._run = real
    assert len(calls) == 2, "gate/up and down: one kernel launch each"
    assert_forward_close(got, want, mode)


def assert_forward_close(got, want, mode):
    """The GPU's forward against the CPU's: the kernel's fp32 sums round an intermediate differently from
    float64 by an ulp here and there, which moves a w4a16 result by about an ulp; in w4a4 such an ulp can
    move an activation across an e2m1 rounding boundary (a step of up to a third of its value), so there
    the whole output is compared by norm."""
    if mode == "w4a16":
        torch.testing.assert_close(got, want, rtol=2 ** -6, atol=2 ** -7 * want.abs().max().item())
    else:
        rel = float((got.double() - want.double()).norm() / want.double().norm())
        assert rel < 2 ** -5, f"w4a4: relative error {rel:.3g} of the GPU's forward against the CPU's"


@CUDA
def test_cuda_forward_is_sync_free_capturable_and_compiles_without_a_break():
    gen = torch.Generator().manual_seed(3)
    mod = random_module(gen, 8, 256, 128, "w4a16").cuda()
    x, idx, w = torch.randn(4, 256).bfloat16().cuda(), torch.randint(0, 8, (4, 2)).cuda(), torch.rand(4, 2).cuda()
    first = mod(x, idx, w)
    with no_syncs():
        again = mod(x, idx, w)
    assert torch.equal(first, again)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mod(x, idx, w)
    x2 = torch.randn(4, 256).bfloat16().cuda()
    x.copy_(x2)
    idx.copy_(torch.randint(0, 8, (4, 2)))
    graph.replay()
    assert torch.equal(captured, mod(x, idx, w))
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    assert torch.equal(torch.compile(mod, fullgraph=True, backend="eager")(x, idx, w), mod(x, idx, w))
    assert not counters["graph_break"]
    # inductor fuses act_fn(gate) * up without rounding act_fn's result to bf16 in between: within an ulp or so
    torch._dynamo.reset()
    for t in (4, 3, 1, 16):  # new token counts: dynamic shapes after the first recompile
        xt, it, wt = x[:1].expand(t, -1).contiguous(), torch.randint(0, 8, (t, 2)).cuda(), torch.rand(t, 2).cuda()
        compiled = torch.compile(mod, fullgraph=True)
        assert_forward_close(compiled(xt, it, wt), mod(xt, it, wt), "w4a16")


# ----------------------------------------------------------------------------------------------------
# Bad arguments
# ----------------------------------------------------------------------------------------------------


def test_bad_arguments_are_named():
    gen = torch.Generator().manual_seed(0)
    w, ws, a = random_weights(gen, 4, 128, 64)
    x, ids = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int32)
    check_args(x, ids, w, ws, a, 1)
    cases = [
        ((x.float(), ids, w, ws, a, 1), "argument 'x': expected a contiguous bfloat16 or float16 tensor \\[2, 64\\]"),
        ((x, ids.short(), w, ws, a, 1), "argument 'ids': expected a contiguous int32 or int64"),
        ((x, ids, w[:, :, :16].contiguous(), ws, a, 1), "argument 'w': expected experts of M % 128"),
        ((x, ids, w, ws[:2], a, 1), "argument 'w_scale': expected a contiguous float8_e4m3fn or uint8 tensor \\[4, 128, 4\\]"),
        ((x, ids, w, ws, a[:3], 1), "argument 'alpha': expected a contiguous float32 tensor \\[4\\]"),
        ((x, ids, w, ws, a, 33), "argument 'n_tok': expected an int in 1..32"),
        ((x, ids, w, ws, a, 2), "argument 'x': expected .* \\[4, 64\\]"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            experts_gemv(*args)
    with pytest.raises(TypeError, match="argument 'alpha': expected a torch.Tensor"):
        experts_gemv(x, ids, w, ws, 1.0, 1)


@CUDA
def test_cuda_plan_validates_metadata_it_has_not_seen():
    """A plan is kept per metadata: a call whose alpha (or any tensor's shape, stride, dtype) differs from the
    cached plan's is validated again, never launched on the old plan."""
    gen = torch.Generator().manual_seed(0)
    w, ws, a = (t.cuda() for t in random_weights(gen, 4, 128, 64))
    x, ids = torch.zeros(2, 64, dtype=torch.bfloat16, device="cuda"), torch.zeros(2, dtype=torch.int32, device="cuda")
    experts_gemv(x, ids, w, ws, a, 1)
    with pytest.raises(ValueError, match="argument 'alpha'"):
        experts_gemv(x, ids, w, ws, a[:3], 1)
    with pytest.raises(ValueError, match="argument 'ids'"):
        experts_gemv(x, ids.short(), w, ws, a, 1)
    # after hits by w's identity: the same result, and a misaligned x is refused, not launched
    want = experts_gemv(x, ids, w, ws, a, 1)
    assert torch.equal(experts_gemv(x.clone(), ids, w, ws, a, 1), want)
    buf = torch.zeros(2 * 64 + 1, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="argument 'x': expected x and w at 16-byte aligned addresses"):
        experts_gemv(buf[1:].view(2, 64), ids, w, ws, a, 1)


def test_a_plans_hit_path_takes_only_its_own_metadata_at_aligned_addresses():
    """``ExpertsPlan.hit_path`` (the op's per-call check by w's identity, CPU-testable: the launch stubbed):
    exactly the plan's n_tok, busy, tensor metadata and aligned addresses reach the plan; anything else is None
    (and goes to the key, which validates)."""
    from nvfp4_gemv import experts_op
    from nvfp4_gemv.launch import _make_guard

    if _make_guard is None:
        pytest.skip("torch's TensorGuards is not usable here")
    gen = torch.Generator().manual_seed(0)
    w, ws, a = random_weights(gen, 4, 128, 64)
    x, ids = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int32)
    calls = []

    class Stub(experts_op.ExpertsPlan):
        def __init__(self):  # (no kernel: only the hit path's checks run)
            self.n_tok, self.busy, self.act, self.pf, self.variants = 1, 3, None, False, ()

        def __call__(self, *ts):
            calls.append(ts)
            return "launched"

    hit = Stub().hit_path(_make_guard((x, ids, w, ws, a)).check)
    assert hit(x, ids, w, ws, a, 1, 3, None) == "launched" and hit(x.clone(), ids, w, ws, a, 1, 3, None) == "launched"
    buf = torch.zeros(2 * 64 + 8, dtype=torch.bfloat16)
    wbuf = torch.zeros(ws.numel() + 1, dtype=torch.uint8).view(ws.dtype)
    assert hit(x, ids, w, ws, a, 1, 3, "silu") is None  # another act
    for args in [(x, ids, w, ws, a, 2, 3), (x, ids, w, ws, a, 1, 4),  # n_tok, busy
                 (x.half(), ids, w, ws, a, 1, 3), (x[:1], ids, w, ws, a, 1, 3), (x, ids.long(), w, ws, a, 1, 3),
                 (x, ids, w, ws, a[:3], 1, 3), (x, ids, w, ws.view(torch.uint8), a, 1, 3),
                 (x.t().contiguous().t(), ids, w, ws, a, 1, 3),  # strides
                 (buf[1:129].view(2, 64), ids, w, ws, a, 1, 3),  # x 2 bytes off 16
                 (x, ids, w, wbuf[1:].view(ws.shape), a, 1, 3),  # w_scale at an odd address
                 (x, ids, w, ws, 1.0, 1, 3)]:  # not a tensor
        assert hit(*args, None) is None
    assert len(calls) == 2

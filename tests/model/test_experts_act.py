"""The experts' down launch with ``act="silu"`` (``experts_op.experts_gemv``): x's rows are ``[gate | up]`` and
the product takes ``silu(gate) * up`` rounded once to x's dtype. The CPU path against its definition, the
kernel against float64 within the W4A16 bound plus the act's stated allowance (fuzzed: tokens a group, shared
rows, empty groups, K % 128 == 64, gate values far into both tails), the act's values bit for bit through
identity experts, which forwards take it
(``experts_forward.decode_forward``: W4A16 SiLU experts up to ``ACT_IN_KERNEL_MAX_TOKENS`` tokens), and bad
arguments named."""

import pytest
import torch

from nvfp4_gemv.experts_op import experts_gemv, launch_shape, sm_count
from nvfp4_gemv.model import experts_forward
from nvfp4_gemv.model.experts_forward import ACT_IN_KERNEL_MAX_TOKENS, decode_forward, kernel_act
from nvfp4_gemv.quant import dequantize
from test_experts_kernel import check_within_bound, exact, half_ulp, mats, random_module, random_weights, routing

CUDA = pytest.mark.gpu


def silu_mul_once(g):
    """``silu(gate) * up`` of rows [gate | up] in float64, and that rounded once to g's dtype."""
    i = g.shape[1] // 2
    gate, up = g[:, :i].double(), g[:, i:].double()
    h = gate / (1 + torch.exp(-gate)) * up
    return h, h.to(g.dtype)


def act_case(seed):
    """(g [rows, 2K], ids, w, ws, alpha, nt): gate values from -100 to 100 (both tails of silu, and 0), up
    values of many binades, signs mixed."""
    gen = torch.Generator().manual_seed(7000 + seed)
    e = int(torch.randint(1, 9, (1,), generator=gen))
    m = 128 * int(torch.randint(1, 4, (1,), generator=gen))
    k = 64 * [1, 2, 3, 5, 8, 12][int(torch.randint(0, 6, (1,), generator=gen))]
    nt = [1, 1, 2, 3, 4, 8, 16, 32][int(torch.randint(0, 8, (1,), generator=gen))]
    g = int(torch.randint(1, 9, (1,), generator=gen))
    ids = torch.randint(-1, e, (g,), generator=gen, dtype=torch.int32)
    dtype = torch.bfloat16 if seed % 3 else torch.float16
    w, ws, alpha = random_weights(gen, e, m, k)
    gate = torch.randn(g * nt, k, generator=gen) * torch.exp2(torch.randint(-4, 4, (g * nt, 1), generator=gen))
    tails = torch.rand(g * nt, k, generator=gen) < 0.05  # silu's tails: -> 0 and -> gate
    gate = torch.where(tails, torch.empty(g * nt, k).uniform_(-100, 100, generator=gen), gate)
    gate[:, :3] = torch.tensor([0.0, -0.0, 1e-3])
    up = torch.randn(g * nt, k, generator=gen) * torch.exp2(torch.randint(-6, 7, (g * nt, 1), generator=gen))
    x = torch.cat([gate, up], 1).to(dtype)
    if nt == 1 and seed % 4 == 1:  # one row every group reads
        x = x[:1].contiguous()
    return x, ids, w, ws, alpha, nt


def act_allowance(h64, h, ids, w, ws, alpha, nt, m):
    """The act's allowance beyond the W4A16 bound: where the float64 value lies within 2^-19 of itself of a
    rounding midpoint of x's dtype, the kernel's fp32 value may round to the other neighbour (one ulp of it)
    times the weights it meets."""
    ulp = 2 * half_ulp(h)
    near = ((h64 - h.double()).abs() - ulp / 2).abs() <= 2.0 ** -19 * h64.abs()
    extra = near * ulp
    out = torch.zeros((ids.shape[0] * nt, m), dtype=torch.float64)
    for grp, e in enumerate(ids.tolist()):
        if e >= 0:
            wv = dequantize(w[e], ws[e]).double().abs() * float(alpha[e])
            rows = extra if extra.shape[0] == 1 else extra[grp * nt:(grp + 1) * nt]
            out[grp * nt:(grp + 1) * nt] = rows @ wv.T
    return out, int(near.sum())


# ----------------------------------------------------------------------------------------------------
# The op on the CPU: its definition
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_cpu_act_is_the_product_of_silu_gate_times_up_rounded_once(seed):
    x, ids, w, ws, alpha, nt = act_case(seed)
    got = experts_gemv(x, ids, w, ws, alpha, nt, act="silu")
    _, h = silu_mul_once(x)
    want = experts_gemv(h, ids, w, ws, alpha, nt)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


def test_act_arguments_are_named():
    gen = torch.Generator().manual_seed(0)
    w, ws, a = random_weights(gen, 2, 128, 64)
    ids = torch.zeros(1, dtype=torch.int32)
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'act'"):
        experts_gemv(x, ids, w, ws, a, 1, act="gelu")
    with pytest.raises(ValueError, match=r"'x'.*\[1, 128\].*2K"):
        experts_gemv(x[:, :64].contiguous(), ids, w, ws, a, 1, act="silu")
    with pytest.raises(ValueError, match=r"'x'.*\[1, 64\]"):  # without act, [gate | up] rows are too wide
        experts_gemv(x, ids, w, ws, a, 1)


def test_kernel_act_names_silu_only():
    from transformers.activations import ACT2FN

    for fn in (torch.nn.SiLU(), torch.nn.functional.silu, ACT2FN["silu"], ACT2FN["swish"]):
        assert kernel_act(fn) == "silu"
    for fn in (torch.nn.GELU(), ACT2FN["gelu"], torch.relu, lambda t: torch.nn.functional.silu(t)):
        assert kernel_act(fn) is None


# ----------------------------------------------------------------------------------------------------
# Which forwards take it
# ----------------------------------------------------------------------------------------------------


def spy_acts(monkeypatch):
    """The ``act`` of each experts_gemv call decode_forward makes."""
    seen = []
    real = experts_forward.experts_gemv

    def spy(*a, **kw):
        seen.append(kw.get("act", a[7] if len(a) > 7 else None))
        return real(*a, **kw)

    monkeypatch.setattr(experts_forward, "experts_gemv", spy)
    return seen


@pytest.mark.parametrize("mode, act, t, fused", [
    ("w4a16", "silu", 1, True),
    ("w4a16", "silu", ACT_IN_KERNEL_MAX_TOKENS + 1, False),
    ("w4a4", "silu", 1, False),  # the down launch's x is quantized after the act
    ("w4a16", "gelu", 1, False),
])
def test_decode_forward_fuses_the_act_for_w4a16_silu_experts_at_few_tokens(monkeypatch, mode, act, t, fused):
    gen = torch.Generator().manual_seed(t)
    mod = random_module(gen, 8, 128, 64, mode)
    x = torch.randn(t, 128, generator=gen).bfloat16()
    idx, wts = routing(gen, t, 2, 8, odd=0)
    act_fn = torch.nn.SiLU() if act == "silu" else torch.nn.GELU()
    act_calls = []
    act_fn.register_forward_hook(lambda *a: act_calls.append(1))
    seen = spy_acts(monkeypatch)
    decode_forward(x, idx, wts, *mats(mod), act_fn)
    assert seen == ([None, "silu"] if fused else [None, None])
    assert act_calls == ([] if fused else [1]), "the act ran as torch ops where the kernel makes it, or not at all"


def test_cpu_forward_with_the_act_compiles_without_a_break():
    from torch._dynamo.utils import counters

    gen = torch.Generator().manual_seed(3)
    mod = random_module(gen, 8, 128, 64, "w4a16")
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(lambda x, i, w: decode_forward(x, i, w, *mats(mod), mod.act_fn), fullgraph=True,
                       backend="eager")
    x = torch.randn(1, 128, generator=gen).bfloat16()
    idx, wts = routing(gen, 1, 2, 8, odd=0)
    assert torch.equal(fn(x, idx, wts), decode_forward(x, idx, wts, *mats(mod), mod.act_fn))
    assert not counters["graph_break"]


# ----------------------------------------------------------------------------------------------------
# The kernel against float64
# ----------------------------------------------------------------------------------------------------


@CUDA
@pytest.mark.parametrize("chunk", range(4))
def test_cuda_act_within_its_bound_of_float64(chunk):
    """60 random cases (15 a chunk), outputs poisoned first: the W4A16 bound on the rounded float64 act, plus
    the act's allowance where fp32 may round it the other way. Asserts that the late route ran."""
    from nvfp4_gemv.experts_op import launch_shape

    flagged = late = 0
    for seed in range(15 * chunk, 15 * (chunk + 1)):
        x, ids, w, ws, alpha, nt = act_case(seed)
        h64, h = silu_mul_once(x)
        ref, absum = exact(h, ids, w, ws, alpha, nt)
        allow, n = act_allowance(h64, h, ids, w, ws, alpha, nt, w.shape[1])
        flagged += n
        # busy: the launch's shape (any value is correct); a one-token group on 4352 or more rows takes the
        # late route (x's row padded with zeros in shared memory), the Qwen3 down launch's at one token
        busy = 40 if nt == 1 and seed % 2 == 0 else int(torch.randint(1, 9, (1,), generator=torch.Generator().manual_seed(seed)))
        late += bool(dict(launch_shape(nt, w.shape[1], 2 * w.shape[2], torch.cuda.get_device_properties(0)
                                       .multi_processor_count, busy)[0].tuning).get("late"))
        args = [a.cuda() for a in (x, ids, w, ws, alpha)]
        # the op allocates its output: NaN in the block the caching allocator will hand it (inputs placed first)
        poison = torch.full((ids.shape[0] * nt, w.shape[1]), float("nan"), dtype=x.dtype, device="cuda")
        del poison
        y = experts_gemv(*args, nt, busy, act="silu").cpu()
        live = ~ref.isnan()
        assert not y[live].isnan().any(), f"case {seed}: rows of a group with an expert left unwritten"
        check_within_bound(y, ref, absum + 2.0 ** 12 * allow, x.shape[1] // 2,
                           f"act case {seed} (M={w.shape[1]}, K={x.shape[1] // 2}, nt={nt}, ids={ids.tolist()}, "
                           f"{x.dtype}, {tuple(x.shape)})")
    print(f"act values within 2^-19 of a midpoint: {flagged}")
    assert late, "no case took the late route"


def identity_experts(e, k):
    """NVFP4 experts whose every expert is the [K, K] identity (e2m1 code 2 = 1.0, e4m3 scales 1.0, alpha 1):
    the product returns the act's values themselves, exactly (one nonzero term a sum, and the act is already in
    x's dtype)."""
    w = torch.zeros(e, k, k // 2, dtype=torch.uint8)
    r = torch.arange(k)
    w[:, r, r // 2] = torch.where(r % 2 == 0, 0x02, 0x20).to(torch.uint8)  # the first code in the low nibble
    ws = torch.full((e, k, k // 16), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)
    return w, ws, torch.ones(e)


def test_identity_experts_are_the_identity():
    w, ws, alpha = identity_experts(2, 128)
    assert torch.equal(dequantize(w[1], ws[1]).float(), torch.eye(128)) and torch.equal(alpha, torch.ones(2))


@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nt, busy", [(1, 1), (1, 40), (3, 2), (16, 4)])
def test_cuda_act_values_are_silu_times_up_rounded_once(dtype, nt, busy):
    """Through identity experts the output is the kernel's act itself: bit for bit float64's
    ``silu(gate) * up`` rounded once to x's dtype, but where that value lies within 2^-19 of itself of a
    rounding midpoint (fp32's few-ulp error may round it the other way: one ulp allowed there). Gates in
    [-80, 80]: past -88.7 fp32's exp(-gate) overflows and the act is 0 where float64's is a tiny nonzero (as
    torch's own fp32 silu)."""
    k, e = 256, 3
    gen = torch.Generator().manual_seed(nt * 100 + busy)
    w, ws, alpha = identity_experts(e, k)
    rows = e * nt
    gate = torch.randn(rows, k, generator=gen) * torch.exp2(torch.randint(-8, 5, (rows, 1), generator=gen))
    gate[:, :16] = torch.linspace(-80, 80, 16)
    up = torch.randn(rows, k, generator=gen) * torch.exp2(torch.randint(-8, 8, (rows, 1), generator=gen))
    x = torch.cat([gate, up], 1).to(dtype)
    h64, h = silu_mul_once(x)
    ids = torch.arange(e, dtype=torch.int32)
    y = experts_gemv(x.cuda(), ids.cuda(), w.cuda(), ws.cuda(), alpha.cuda(), nt, busy, act="silu").cpu()
    assert torch.equal(experts_gemv(x, ids, w, ws, alpha, nt, busy, act="silu"), h), "the CPU path is not h"
    ulp = 2 * half_ulp(h)
    near = ((h64 - h.double()).abs() - ulp / 2).abs() <= 2.0 ** -19 * h64.abs()
    # below its route's range a product leaves fp32's normal range (w4a16.py): bf16 x below 2^-109, or on the
    # ``late`` route (x times 2^72, weights unscaled) below 2^-62; not exact there (the late route flushes to 0)
    late = dtype == torch.bfloat16 and dict(launch_shape(nt, k, k, sm_count(0), busy)[0].tuning).get("late")
    lim = 2.0 ** (-62 if late else -100)
    tiny = h64.abs() < lim
    diff = (y.double() - h.double()).abs()
    exact = ~near & ~tiny
    off = diff[exact] > 0
    assert not off.any(), (f"{int(off.sum())} act values off float64 rounded once, e.g. "
                           f"{y[exact][off][:4].tolist()} against {h[exact][off][:4].tolist()}")
    assert (diff[near] <= ulp[near]).all() and (diff[tiny] <= lim).all()


@CUDA
def test_cuda_one_token_forward_fused_agrees_with_the_act_as_torch_ops(monkeypatch):
    """Qwen3-30B-A3B's expert shapes at one token: the fused down launch against the unfused path (the act as
    torch ops, rounding silu(gate) first: an ulp here and there), and the act no longer runs as torch ops."""
    gen = torch.Generator().manual_seed(11)
    mod = random_module(gen, 16, 2048, 768, "w4a16").cuda()
    x = torch.randn(1, 2048, generator=gen).bfloat16().cuda()
    idx, wts = routing(gen, 1, 8, 16, odd=0)
    idx, wts = idx.cuda(), wts.cuda()
    fused = mod(x, idx, wts)
    monkeypatch.setattr(experts_forward, "ACT_IN_KERNEL_MAX_TOKENS", 0)
    plain = mod(x, idx, wts)
    torch.testing.assert_close(fused, plain, rtol=2 ** -6, atol=2 ** -7 * plain.abs().max().item())
    assert not torch.equal(fused, torch.zeros_like(fused))

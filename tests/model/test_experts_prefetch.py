"""The gate/up launch's prefetch of the down launch's bytes (``experts_gemv(..., prefetch=(w2, w2_scale))``,
used by ``decode_forward`` up to ``PREFETCH_DOWN_MAX_TOKENS`` tokens): a hint that changes no result (the GPU's
products with it equal those without, bit for bit, and stay within the kernel's bound of float64), taken where
the rule says, its plan and hit path kept apart from the plain launch's, and bad prefetch tensors named."""

import pytest
import torch

from nvfp4_gemv import experts_op
from nvfp4_gemv.experts_op import experts_gemv
from nvfp4_gemv.model import experts_forward
from nvfp4_gemv.model.experts_forward import decode_forward

from test_experts_kernel import check_within_bound, exact, random_module, random_weights, routing

CUDA = pytest.mark.gpu


def test_bad_prefetch_tensors_are_named():
    gen = torch.Generator().manual_seed(0)
    w, ws, a = random_weights(gen, 4, 128, 64)
    w2, s2, _ = random_weights(gen, 4, 256, 128)
    x, ids = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int32)
    experts_gemv(x, ids, w, ws, a, 1, prefetch=(w2, s2))  # takes it (a hint: the CPU path ignores it)
    cases = [
        ((w2, s2, w2), TypeError, "argument 'prefetch': expected None or a pair"),
        ((w2.float(), s2), ValueError, "argument 'prefetch\\[0\\]': expected a contiguous uint8 tensor \\[4, M2, K2/2\\]"),
        ((w2[:3].contiguous(), s2), ValueError, "argument 'prefetch\\[0\\]'"),  # another count of experts
        ((w2[:, :, :16].contiguous(), s2), ValueError, "argument 'prefetch\\[0\\]'"),  # K2 % 64
        ((w2, s2[:, :, :4].contiguous()), ValueError, "argument 'prefetch\\[1\\]': expected .* \\[4, 256, 8\\]"),
        ((w2, 1.0), TypeError, "argument 'prefetch\\[1\\]': expected a torch.Tensor"),
        ((torch.zeros(w2.numel() + 1, dtype=torch.uint8)[1:].view(w2.shape), s2), ValueError,
         "argument 'prefetch\\[0\\]': .* at a 16-byte aligned address"),
        ((w2[:, :0].contiguous(), s2[:, :0].contiguous()), ValueError, "argument 'prefetch\\[0\\]'"),  # M2 = 0
        ((w2, None), TypeError, "argument 'prefetch\\[1\\]': expected a torch.Tensor"),
    ]
    for pf, exc, match in cases:
        with pytest.raises(exc, match=match):
            experts_gemv(x, ids, w, ws, a, 1, prefetch=pf)


@pytest.mark.parametrize("limit", [0, 1, 2])
@pytest.mark.parametrize("t", [1, 2, 16])
def test_decode_forward_prefetches_down_up_to_its_token_count(t, limit, monkeypatch):
    """The gate/up launch carries down's weight and scales up to PREFETCH_DOWN_MAX_TOKENS tokens (0 by default,
    measured slower; others set here), never past it, and the down launch never prefetches."""
    monkeypatch.setattr(experts_forward, "PREFETCH_DOWN_MAX_TOKENS", limit)
    gen = torch.Generator().manual_seed(t)
    mod = random_module(gen, 8, 128, 64, "w4a16")
    seen = []

    def spy(x, ids, w, w_scale, alpha, n_tok, busy=1, act=None, prefetch=None):
        seen.append((w is mod.gate_up_weight, prefetch))
        return experts_op.experts_gemv(x, ids, w, w_scale, alpha, n_tok, busy, act, prefetch)

    monkeypatch.setattr(experts_forward, "experts_gemv", spy)
    idx, wts = routing(gen, t, 2, 8, odd=0)
    decode_forward(torch.randn(t, 128).bfloat16(), idx, wts, *mod._mats(), mod.act_fn)
    (gu, pf_gu), (down, pf_down) = seen
    assert gu and not down and pf_down is None
    if t <= limit:
        assert pf_gu[0] is mod.down_weight and pf_gu[1] is mod.down_weight_scale
    else:
        assert pf_gu is None


def test_a_prefetching_plans_hit_path_takes_only_its_own_prefetch_tensors():
    """``ExpertsPlan.hit_path`` of a prefetching plan (the launch stubbed): its guard covers the two prefetched
    tensors too; no prefetch, another shape, a misaligned one or a non-pair is None (the key then validates)."""
    from nvfp4_gemv.launch import _make_guard

    if _make_guard is None:
        pytest.skip("torch's TensorGuards is not usable here")
    gen = torch.Generator().manual_seed(0)
    w, ws, a = random_weights(gen, 4, 128, 64)
    w2, s2, _ = random_weights(gen, 4, 256, 128)
    x, ids = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int32)
    calls = []

    class Stub(experts_op.ExpertsPlan):
        def __init__(self):  # (no kernel: only the hit path's checks run)
            self.n_tok, self.busy, self.act, self.pf, self.variants = 1, 3, None, True, ()

        def __call__(self, *ts):
            calls.append(ts)
            return "launched"

    hit = Stub().hit_path(_make_guard((x, ids, w, ws, a, w2, s2)).check)
    assert hit(x, ids, w, ws, a, 1, 3, None, (w2, s2)) == "launched"
    assert hit(x, ids, w, ws, a, 1, 3, None, (w2.clone(), s2.clone())) == "launched"
    wbuf = torch.zeros(w2.numel() + 16, dtype=torch.uint8)
    for pf in [None, (w2[:, :128].contiguous(), s2[:, :128].contiguous()), (w2, s2.view(torch.uint8)),
               (wbuf[8:8 + w2.numel()].view(w2.shape), s2), (w2,), (w2, s2, s2), "w2"]:
        assert hit(x, ids, w, ws, a, 1, 3, None, pf) is None, pf
    assert len(calls) == 2


@CUDA
@pytest.mark.parametrize("seed", range(8))
def test_cuda_prefetch_changes_no_result(seed):
    """Random experts, groups (some without an expert), K and M; outputs poisoned first. With and without the
    prefetch (of another experts weight, itself or a larger one) the rows of groups with an expert are equal
    bit for bit and within the bound of float64; the plain and prefetching plans are kept apart."""
    gen = torch.Generator().manual_seed(100 + seed)
    e = int(torch.randint(2, 17, (1,), generator=gen))
    m = 128 * int(torch.randint(1, 9, (1,), generator=gen))
    k = 64 * int(torch.randint(1, 33, (1,), generator=gen))
    g = int(torch.randint(1, 9, (1,), generator=gen))
    w, ws, a = (t.cuda() for t in random_weights(gen, e, m, k))
    w2, s2, _ = (t.cuda() for t in random_weights(gen, e, 128 * int(torch.randint(1, 17, (1,), generator=gen)),
                                                   64 * int(torch.randint(1, 49, (1,), generator=gen))))
    ids = torch.randint(-1, e, (g,), generator=gen, dtype=torch.int32)
    x = (torch.randn(g, k, generator=gen) * 2).bfloat16()
    got = []
    xc, idc = x.cuda(), ids.cuda()
    # each twice in a row: the second call is a hit by w's identity (the plan's hit path, prefetching or not)
    for pf in (None, None, (w2, s2), (w2, s2), (w, ws), (w, ws), None):
        poison = torch.full((g, m), float("nan"), dtype=torch.bfloat16, device="cuda")
        del poison  # (the op's output takes the freed block: rows it does not write stay NaN)
        got.append(experts_gemv(xc, idc, w, ws, a, 1, prefetch=pf).cpu())
    keep = (ids >= 0).nonzero().flatten()
    for y in got[1:]:
        assert torch.equal(y[keep], got[0][keep])
    ref, absum = exact(x, ids, w.cpu(), ws.cpu(), a.cpu(), 1)
    check_within_bound(got[1][keep], ref[keep], absum[keep], k, f"seed {seed}")

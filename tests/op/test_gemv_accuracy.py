"""nvfp4_gemv.gemv on a CUDA GPU: the CuTe kernel against float64 within the op's accuracy contract (half
an ulp of the result's dtype plus 2^-14 of the sum of |terms|), every layout and token count, token groups,
out=, streams, CUDA graphs, opcheck and torch.compile. Outputs are poisoned before each run."""

import warnings

import pytest
import torch

import inputs
import nvfp4_gemv
from nvfp4_gemv import gemv, op_plan
from sync_free import no_syncs

pytestmark = pytest.mark.gpu


blocked = inputs.blocked_scales


def check(args, out_dtype=torch.bfloat16, **kw):
    x, xs, w, ws, alpha = args
    out = kw.pop("out", None)
    if out is not None:
        out.fill_(float("nan"))
    res = gemv(x, xs, w, ws, alpha, out_dtype=out_dtype, out=out, **kw)
    torch.cuda.synchronize()
    return res


def plain_of(args, k):
    """The same operands with plain scales (for the float64 check)."""
    x, xs, w, ws, alpha = args
    n, m = x.shape[0], w.shape[0]
    un = lambda s, r: op_plan.unswizzle_scales(s.view(torch.uint8), r, k).view(torch.float8_e4m3fn)  # noqa: E731
    return (x, un(xs, n) if xs.shape != (n, k // 16) else xs, w, un(ws, m) if ws.shape != (m, k // 16) else ws, alpha)


def assert_exact(args, out, k):
    x, xs, w, ws, alpha = plain_of(args, k)
    exact, terms = inputs.op_exact(x, xs, w, ws, alpha)
    bad, msg = inputs.op_violations(out, exact, terms)
    assert bad == 0, msg


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("m,k", [(128, 64), (256, 1024), (384, 7168), (128, 16384)])
def test_tokens_match_float64(n, m, k):
    args = inputs.op_inputs(n, m, k, seed=n * 131 + k)
    assert_exact(args, check(args), k)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("alpha", [True, False])
@pytest.mark.parametrize("x_blocked,w_blocked", [(False, True), (True, False), (True, True)])
def test_dtypes_alpha_and_blocked_scales(out_dtype, alpha, x_blocked, w_blocked):
    n, m, k = 5, 256, 2048 + 320  # 5 token rows: the blocked x scales pad them to 128
    x, xs, w, ws, a = inputs.op_inputs(n, m, k, seed=3, alpha=alpha)
    args = (x, blocked(xs, n, k) if x_blocked else xs, w, blocked(ws, m, k) if w_blocked else ws, a)
    out = check(args, out_dtype)
    assert out.dtype == out_dtype
    assert_exact(args, out, k)


@pytest.mark.parametrize("x_blocked", [False, True])
def test_token_groups_beyond_shared_memory(x_blocked):
    k = 16384
    n = nvfp4_gemv.tokens.Nvfp4GemvTokens.max_tokens(k) + 5
    x, xs, w, ws, a = inputs.op_inputs(n, 256, k, seed=4)
    args = (x, blocked(xs, n, k) if x_blocked else xs, w, ws, a)
    plan = op_plan.W4A4Plan(*args, None, torch.bfloat16)
    assert len(plan.launches) == 2
    assert_exact(args, check(args), k)


def test_uint8_operands_and_out_with_row_stride():
    x, xs, w, ws, a = inputs.op_inputs(4, 256, 512, seed=5)
    wide = torch.empty(4, 512, dtype=torch.bfloat16, device="cuda")
    wide.fill_(float("nan"))
    view = wide[:, 128:384]
    res = gemv(x.view(torch.uint8), xs.view(torch.uint8), w.view(torch.uint8), ws.view(torch.uint8), a, out=view)
    torch.cuda.synchronize()
    assert res is view
    assert_exact((x, xs, w, ws, a), view, 512)
    assert wide[:, :128].isnan().all() and wide[:, 384:].isnan().all()


def test_runs_on_the_current_stream():
    args = inputs.op_inputs(3, 1024, 4096, seed=6)
    out = torch.empty(3, 1024, dtype=torch.bfloat16, device="cuda")
    gemv(*args, out=out)  # compile and plan outside
    out.fill_(float("nan"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # (the poison first)
    with torch.cuda.stream(s):
        # keeps s busy for about half a second: the op must queue behind this, and the host must reach the
        # read below first even on a machine loaded by the sharded GPU suite (100M cycles, ~55 ms, was not)
        torch.cuda._sleep(1_000_000_000)
        gemv(*args, out=out)
    early = out.cpu()  # on the default stream, which does not wait for s
    assert torch.isnan(early).all(), "the op ran before the work queued on its stream"
    s.synchronize()
    assert_exact(args, out, 4096)


def test_no_syncs_raises_on_a_sync_and_resets_the_mode():
    with pytest.raises(RuntimeError, match="synchroniz"):
        with no_syncs():
            torch.ones(1, device="cuda").item()
    assert torch.cuda.get_sync_debug_mode() == 0


def test_new_plan_and_launch_never_sync():
    args = inputs.op_inputs(2, 384, 1024, seed=7)
    with no_syncs():
        out = gemv(*args)
        out2 = gemv(*args)
    torch.cuda.synchronize()
    assert_exact(args, out, 1024)
    assert torch.equal(out, out2)


def test_cuda_graph_replay_after_warm_up():
    x, xs, w, ws, a = inputs.op_inputs(4, 512, 2048, seed=8)
    out = torch.empty(4, 512, dtype=torch.bfloat16, device="cuda")
    gemv(x, xs, w, ws, a, out=out)  # warm-up outside the capture: compiles the kernel, builds the plan
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gemv(x, xs, w, ws, a, out=out)
    x2, xs2, w2, ws2, a2 = inputs.op_inputs(4, 512, 2048, seed=9)
    for dst, src in ((x, x2), (xs, xs2), (w, w2), (ws, ws2), (a, a2)):
        dst.copy_(src)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert_exact((x2, xs2, w2, ws2, a2), out, 2048)


def test_opcheck_on_cuda():
    x, xs, w, ws, a = inputs.op_inputs(3, 128, 256, seed=10)
    u8 = [t.view(torch.uint8) for t in (x, xs, w, ws)]
    torch.library.opcheck(torch.ops.nvfp4.gemv.default, (*u8, a, torch.bfloat16))
    out = torch.empty(3, 128, dtype=torch.float16, device="cuda")
    torch.library.opcheck(torch.ops.nvfp4.gemv_out.default, (*u8, a, out))


def test_torch_compile_fullgraph_matches_eager():
    args = inputs.op_inputs(8, 256, 1024, seed=11)
    bias = torch.randn(256, dtype=torch.bfloat16, device="cuda")
    torch._dynamo.reset()

    def layer(x, xs, w, ws, a, bias):
        y = gemv(x, xs, w, ws, a)
        return y, torch.nn.functional.silu(y + bias)

    eager = layer(*args, bias)
    compiled = torch.compile(layer, fullgraph=True)(*args, bias)
    torch.cuda.synchronize()
    assert torch.equal(compiled[0], eager[0])
    # inductor fuses the epilogue in fp32 (eager rounds y + bias to bf16 first): close, not equal
    torch.testing.assert_close(compiled[1], eager[1], rtol=1e-2, atol=1e-2)


def test_misaligned_rows_raise_naming_the_argument():
    x, xs, w, ws, a = inputs.op_inputs(2, 128, 256, seed=12)
    raw = torch.empty(2 * 128 + 8, dtype=torch.uint8, device="cuda")
    xm = raw[8:].view(2, 128)
    xm.copy_(x.view(torch.uint8))
    with pytest.raises(ValueError, match="argument 'x'"):
        gemv(xm, xs, w, ws, a)
    raw = torch.empty(128 * 128 + 8, dtype=torch.uint8, device="cuda")
    wm = raw[8:].view(128, 128)
    wm.copy_(w.view(torch.uint8))
    with pytest.raises(ValueError, match="argument 'w'"):
        gemv(x, xs, wm, ws, a)


def test_operands_on_different_devices_raise():
    x, xs, w, ws, a = inputs.op_inputs(2, 128, 256, seed=13)
    with pytest.raises(ValueError, match="argument 'alpha'"):
        gemv(x, xs, w, ws, a.cpu())
    with pytest.raises(ValueError, match="argument 'x'"):
        gemv(x.cpu(), xs, w, ws, a)


@pytest.mark.parametrize("n,m,k,expected", [(1, 4096, 256, "Nvfp4GemvTokens"), (1, 4096, 2048, "Nvfp4GemvTokensBulk"),
                                            (2, 512, 1024, "Nvfp4GemvTokensBulk"), (3, 4096, 7168, "Nvfp4GemvTokensBulk"),
                                            (4, 256, 16384, "Nvfp4GemvTokensBulk"),
                                            (2, 512, 2368, "Nvfp4GemvTokens"), (4, 4096, 7168, "Nvfp4GemvTokens"),
                                            (5, 4096, 256, "Nvfp4GemvMma"), (16, 2048, 256, "Nvfp4GemvMma"),
                                            (16, 256, 256, "Nvfp4GemvTokens")])
def test_kernel_choice(n, m, k, expected):
    """The bulk-copy dp4a kernel up to 3 tokens, 4 at K = 16384 (op_route.use_bulk: K % 1024 == 0, K <= 16384,
    K >= 2048 for one token), the tensor-core kernel from 5 tokens on where its 8-row groups fill the GPU
    (op_route.use_mma), else the dp4a kernel."""
    x, xs, w, ws, a = inputs.op_inputs(n, m, k, seed=n)
    plan = op_plan.W4A4Plan(x, xs, w, ws, a, None, torch.bfloat16)
    assert {type(kern.op).__name__ for kern, _, _ in plan.launches} == {expected}
    assert_exact((x, xs, w, ws, a), plan(x, xs, w, ws, a, None, torch.bfloat16), k)


def test_blocked_w_scales_take_the_dp4a_kernel():
    """Bulk copies read whole rows of w's plain scales: blocked scales go to the dp4a kernel."""
    x, xs, w, ws, a = inputs.op_inputs(2, 512, 2048, seed=3)
    wsb = inputs.blocked_scales(ws, 512, 2048)
    plan = op_plan.W4A4Plan(x, xs, w, wsb, a, None, torch.bfloat16)
    assert {type(kern.op).__name__ for kern, _, _ in plan.launches} == {"Nvfp4GemvTokens"}
    assert_exact((x, xs, w, ws, a), plan(x, xs, w, wsb, a, None, torch.bfloat16), 2048)


def test_w_scale_off_16_bytes_takes_the_dp4a_kernel_with_a_warning(monkeypatch):
    """A w_scale at an even address that 16 does not divide (addresses are no part of a plan's key): the
    bulk plan hands such calls to a dp4a plan, warning once; aligned calls keep the bulk kernel; all exact."""
    monkeypatch.setattr(op_plan.launch, "_warned", set())
    x, xs, w, ws, a = inputs.op_inputs(2, 512, 2048, seed=4)
    moved = inputs.misaligned(ws, 2)
    kernels = lambda plan: {type(kern.op).__name__ for kern, _, _ in plan.launches}  # noqa: E731
    plan = op_plan.W4A4Plan(x, xs, w, moved, a, None, torch.bfloat16)
    assert kernels(plan) == {"Nvfp4GemvTokensBulk"}
    with pytest.warns(RuntimeWarning, match="16-byte aligned"):
        out = plan(x, xs, w, moved, a, None, torch.bfloat16)
    fallback = plan.fallback
    assert kernels(fallback) == {"Nvfp4GemvTokens"}
    assert_exact((x, xs, w, ws, a), out, 2048)
    assert_exact((x, xs, w, ws, a), plan(x, xs, w, ws, a, None, torch.bfloat16), 2048)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_exact((x, xs, w, ws, a), plan(x, xs, w, moved, a, None, torch.bfloat16), 2048)
    assert plan.fallback is fallback


@pytest.mark.parametrize("n,tuning,expected", [(2, (("mma", 0),), "Nvfp4GemvTokensBulk"),
                                               (2, (("mma", 0), ("signed", 0)), "Nvfp4GemvTokens"),
                                               (2, (("bulk", 0),), "Nvfp4GemvTokens"),
                                               (2, (("bulk", 0), ("mma", 1)), "Nvfp4GemvMma"),
                                               (8, (("bulk", 1), ("rt", 2)), "Nvfp4GemvTokensBulk"),
                                               (8, (("signed", 0),), "Nvfp4GemvTokens"),
                                               (8, (), "Nvfp4GemvMma")])
def test_tuning_names_its_kernel(n, tuning, expected):
    """A kernel's own keys choose it over the routing (keys without ``bulk`` or ``mma`` are the dp4a
    kernel's); with none, the routing decides (8 tokens of 4096 rows: tensor cores)."""
    x, xs, w, ws, a = inputs.op_inputs(n, 4096, 2048, seed=5)
    plan = op_plan.W4A4Plan(x, xs, w, ws, a, None, torch.bfloat16, tuning=tuning)
    assert {type(kern.op).__name__ for kern, _, _ in plan.launches} == {expected}
    assert_exact((x, xs, w, ws, a), plan(x, xs, w, ws, a, None, torch.bfloat16), 2048)


def test_tuning_naming_two_kernels_raises():
    x, xs, w, ws, a = inputs.op_inputs(2, 512, 2048, seed=6)
    with pytest.raises(ValueError, match="one kernel"):
        op_plan.W4A4Plan(x, xs, w, ws, a, None, torch.bfloat16, tuning=(("bulk", 1), ("mma", 1)))

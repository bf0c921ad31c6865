"""The op's kernels, each forced through a launch plan, against float64 within the op's accuracy
contract: the dp4a kernel (``nvfp4_gemv.tokens``), the tensor-core kernel (``nvfp4_gemv.mma``) and the
bulk-copy dp4a kernel (``nvfp4_gemv.tokens_bulk``: the op's choice up to 3 tokens, 4 at K = 16384; forced here) over token counts, shapes (a last tile that passes M, several tiles a CTA, fewer K slices than warps), scale layouts,
strides and epilogues. Outputs are poisoned before each run."""

import warnings

import pytest
import torch

import inputs
from nvfp4_gemv import op_plan

pytestmark = pytest.mark.gpu

blocked = inputs.blocked_scales


def run_plan(args, kernel, out_dtype=torch.bfloat16, out=None, **tuning):
    x, xs, w, ws, alpha = args
    n, m = x.shape[0], w.shape[0]
    if out is None:
        out = torch.empty(n, m, dtype=out_dtype, device="cuda")
    out.fill_(float("nan"))
    tuning["mma"] = int(kernel.startswith("mma"))
    if not tuning["mma"]:  # the bulk-copy dp4a kernel (nvfp4_gemv.tokens_bulk) or the dp4a kernel
        tuning["bulk"] = int(kernel == "bulk")
    if kernel == "mma_async":  # the cp.async variant (a tuning, slower on H200): words through shared memory
        tuning["stages"] = 4
    plan = op_plan.W4A4Plan(x, xs, w, ws, alpha, out, out.dtype, tuning=tuple(sorted(tuning.items())))
    plan(x, xs, w, ws, alpha, out, out.dtype)
    torch.cuda.synchronize()
    return out, plan


def assert_exact(args, out, plain=None):
    x, xs, w, ws, alpha = plain or args
    exact, terms = inputs.op_exact(x, xs, w, ws, alpha)
    bad, msg = inputs.op_violations(out, exact, terms)
    assert bad == 0, msg


KERNELS = pytest.mark.parametrize("kernel", ["tokens", "mma", "mma_async"])
MMA_KERNELS = pytest.mark.parametrize("kernel", ["mma", "mma_async"])


@KERNELS
@pytest.mark.parametrize("n", [2, 3, 7, 8, 9, 15, 16, 17, 33])
def test_token_counts(kernel, n):
    args = inputs.op_inputs(n, 256, 2048, seed=7 * n)
    out, plan = run_plan(args, kernel)
    assert (plan.launches[0][0].op.__class__.__name__ == "Nvfp4GemvMma") == kernel.startswith("mma")
    assert_exact(args, out)


@pytest.mark.parametrize("m,k,groups", [(384, 7168, 5), (384, 1024, 8), (2176, 512, 1), (7168, 4096, 7),
                                        (128, 64, 3), (256, 320, 2)])
@pytest.mark.parametrize("n", [4, 16])
@MMA_KERNELS
def test_mma_tiles_and_slices(m, k, groups, n, kernel):
    """M/8 not a multiple of the groups (the last tile starts lower), more tiles than CTAs, K/64 below or
    not a multiple of the warps. ``out`` is a view with padding after each row and after the last: nothing
    outside [N, M] may be written."""
    args = inputs.op_inputs(n, m, k, seed=m + k + n)
    buf = torch.full((n + 1, m + 40), float("nan"), dtype=torch.bfloat16, device="cuda")
    out, _ = run_plan(args, kernel, out=buf[:n, :m], groups=groups)
    assert_exact(args, out)
    assert torch.isnan(buf[:, m:]).all() and torch.isnan(buf[n:]).all()


@KERNELS
@pytest.mark.parametrize("n", [20, 33])
def test_blocked_x_scales_beyond_one_launch(kernel, n, monkeypatch):
    """Blocked x scales with more tokens than a launch takes: the later launches start 16 * t0 bytes into the
    scales (20 tokens), or the plan unswizzles them on the host (33), which is slower and says so once.
    K = 16384: the dp4a kernel takes at most 11 tokens a launch there (``token_group``), the tensor-core
    kernel 16."""
    m, k = 256, 16384
    x, xs, w, ws, a = inputs.op_inputs(n, m, k, seed=n)
    args = (x, blocked(xs, n, k), w, ws, a)
    monkeypatch.setattr(op_plan.launch, "_warned", set())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out, plan = run_plan(args, kernel)
    assert len(plan.launches) >= 2
    assert plan.unswizzle_x == (n > 32)
    assert any("unswizzled on the host" in str(w.message) for w in seen) == (n > 32)
    assert_exact(args, out, plain=(x, xs, w, ws, a))


@KERNELS
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("x_blocked,w_blocked,alpha", [(False, False, False), (True, True, True),
                                                      (False, True, True), (True, False, False)])
def test_layouts_epilogues(kernel, out_dtype, x_blocked, w_blocked, alpha):
    n, m, k = 12, 512, 2048 + 320  # 12 token rows: the blocked x scales pad them to 128
    x, xs, w, ws, a = inputs.op_inputs(n, m, k, seed=11, alpha=alpha)
    args = (x, blocked(xs, n, k) if x_blocked else xs, w, blocked(ws, m, k) if w_blocked else ws, a)
    out, _ = run_plan(args, kernel, out_dtype)
    assert_exact(args, out, plain=(x, xs, w, ws, a))


@KERNELS
def test_row_strides_of_every_operand(kernel):
    """w and x rows and plain scale rows wider than K (views into bigger buffers); out with a row stride."""
    n, m, k = 6, 384, 1024
    x, xs, w, ws, a = inputs.op_inputs(n, m, k, seed=5)
    pad = lambda t, extra: torch.cat([t.view(torch.uint8), t.view(torch.uint8)[:, :extra]], 1)[:, : t.shape[1]]  # noqa: E731
    args = (pad(x, 16), pad(xs, 6).view(torch.float8_e4m3fn), pad(w, 32), pad(ws, 4).view(torch.float8_e4m3fn), a)
    assert args[2].stride(0) != k // 2 and args[3].stride(0) != k // 16
    out_buf = torch.full((n, m + 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    out, _ = run_plan(args, kernel, out=out_buf[:, :m])
    assert torch.isnan(out_buf[:, m:]).all()  # the pad between rows is not the kernel's to write
    assert_exact(args, out, plain=(x, xs, w, ws, a))


@pytest.mark.parametrize("min_exp,max_exp,out_dtype", [(0, 3, torch.float16), (12, 15, torch.bfloat16)])
@MMA_KERNELS
def test_mma_extreme_scales(min_exp, max_exp, out_dtype, kernel):
    """e4m3 subnormal scales (products down to 2^-24 of the f16 operands) and the largest ones."""
    args = inputs.op_inputs(16, 256, 1024, seed=min_exp, min_exp=min_exp, max_exp=max_exp)
    out, _ = run_plan(args, kernel, out_dtype)
    assert_exact(args, out)


@pytest.mark.parametrize("m,k", [(256, 2048), (384, 7168), (256, 16384), (512, 4096)])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 9])
def test_bulk_token_counts_and_tiles(m, k, n):
    """Up to 4 tokens a launch (more in equal groups); stages of 1-8 rows (4 rows a thread from 3 tokens at
    K = 16384), more tiles than CTAs on some."""
    args = inputs.op_inputs(n, m, k, seed=m + k + n)
    out, plan = run_plan(args, "bulk")
    assert {type(launch[0].op).__name__ for launch in plan.launches} == {"Nvfp4GemvTokensBulk"}
    assert len(plan.launches) == -(-n // 4)
    assert_exact(args, out)


@pytest.mark.parametrize("n", [3, 4])
def test_bulk_as_routed_with_four_rows_a_thread_over_many_tiles(n):
    """The op's own choice at K = 16384 and 3-4 tokens (one CTA a SM, 4 rows a thread): 2048 rows make ~4
    tiles a CTA, so the 3 stages wrap and the producer waits on consumers' empty barriers."""
    m, k = 2048, 16384
    x, xs, w, ws, a = args = inputs.op_inputs(n, m, k, seed=40 + n)
    out = torch.full((n, m), float("nan"), dtype=torch.bfloat16, device="cuda")
    plan = op_plan.W4A4Plan(x, xs, w, ws, a, out, out.dtype)
    kern = plan.launches[0][0].op
    assert type(kern).__name__ == "Nvfp4GemvTokensBulk" and (kern.rt, kern.ctas) == (4, 1)
    assert -(-(m // kern.rows) // plan.launches[0][2][-1]) > kern.stages  # tiles of the busiest CTA
    plan(x, xs, w, ws, a, out, out.dtype)
    torch.cuda.synchronize()
    assert_exact(args, out)


@pytest.mark.parametrize("rt,ctas", [(2, 1), (4, 1), (2, 2)])
@pytest.mark.parametrize("n", [1, 3, 4])
def test_bulk_rows_a_thread(rt, ctas, n):
    """Each thread on 2 or 4 rows of a stage (the warp sums scatter up to 16 values: 4 rows x 4 tokens): at
    K = 4096, 16-32 rows a stage of 384 rows."""
    m, k = 384, 4096
    args = inputs.op_inputs(n, m, k, seed=20 + rt + n)
    out, plan = run_plan(args, "bulk", rt=rt, ctas=ctas)
    assert plan.launches[0][0].op.rt == rt
    assert_exact(args, out)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("x_blocked,alpha", [(False, False), (True, True), (False, True), (True, False)])
def test_bulk_layouts_epilogues(out_dtype, x_blocked, alpha):
    n, m, k = 3, 512, 4096
    x, xs, w, ws, a = inputs.op_inputs(n, m, k, seed=13, alpha=alpha)
    args = (x, blocked(xs, n, k) if x_blocked else xs, w, ws, a)
    out, _ = run_plan(args, "bulk", out_dtype)
    assert_exact(args, out, plain=(x, xs, w, ws, a))


def test_bulk_row_strides():
    """w rows 32 bytes and w scale rows 16 bytes wider than K (bulk copies need 16-byte aligned rows), x and
    its scales padded too, out with a row stride."""
    n, m, k = 4, 384, 7168
    x, xs, w, ws, a = inputs.op_inputs(n, m, k, seed=6)
    pad = lambda t, extra: torch.cat([t.view(torch.uint8), t.view(torch.uint8)[:, :extra]], 1)[:, : t.shape[1]]  # noqa: E731
    args = (pad(x, 16), pad(xs, 6).view(torch.float8_e4m3fn), pad(w, 32), pad(ws, 16).view(torch.float8_e4m3fn), a)
    out_buf = torch.full((n, m + 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    out, _ = run_plan(args, "bulk", out=out_buf[:, :m])
    assert torch.isnan(out_buf[:, m:]).all()
    assert_exact(args, out, plain=(x, xs, w, ws, a))


def test_bulk_rejects_what_it_cannot_copy():
    x, xs, w, ws, a = inputs.op_inputs(2, 256, 2368, seed=1)  # K % 256 != 0
    with pytest.raises(ValueError, match="bulk-copy"):
        run_plan((x, xs, w, ws, a), "bulk")
    x, xs, w, ws, a = inputs.op_inputs(2, 256, 2048, seed=1)
    with pytest.raises(ValueError, match="bulk-copy"):
        run_plan((x, xs, w, blocked(ws, 256, 2048), a), "bulk")
    out, plan = run_plan((x, xs, w, ws, a), "bulk")
    moved = inputs.misaligned(ws.view(torch.uint8), 2).view(torch.float8_e4m3fn)  # even, not 16-byte aligned
    with pytest.raises(ValueError, match="w_scale"):
        plan(x, xs, w, moved, a, out, out.dtype)

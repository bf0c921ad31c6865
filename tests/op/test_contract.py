"""nvfp4_gemv.gemv's contract, on the CPU (its exact path): the result, dtypes, scale layouts, out=."""

import pytest
import torch

import inputs
import reference
from nvfp4_gemv import gemv, gemv_reference


def brute_force(x, xs, w, ws, alpha):
    """One float64 sum per output element, value by value."""
    xu, wu = x.view(torch.uint8), w.view(torch.uint8)
    xsv, wsv = xs.view(torch.float8_e4m3fn).double(), ws.view(torch.float8_e4m3fn).double()
    n, m, k = xu.shape[0], wu.shape[0], 2 * xu.shape[1]
    val = lambda u, r, j: reference.E2M1_VALUES[(int(u[r, j // 2]) >> (4 * (j % 2))) & 0xF]  # noqa: E731
    out = torch.empty(n, m, dtype=torch.float64)
    for i in range(n):
        for r in range(m):
            out[i, r] = sum(val(xu, i, j) * float(xsv[i, j // 16]) * val(wu, r, j) * float(wsv[r, j // 16])
                            for j in range(k))
    return out * (1.0 if alpha is None else float(alpha))


@pytest.mark.parametrize("n,m,k", [(1, 128, 64), (3, 128, 128), (16, 128, 64)])
def test_exact_path_matches_a_value_by_value_sum(n, m, k):
    x, xs, w, ws, alpha = inputs.op_inputs(n, m, k, seed=n + k, device="cpu")
    ref = brute_force(x, xs, w, ws, alpha)
    _, terms = inputs.op_exact(x, xs, w, ws, alpha)
    out = gemv(x, xs, w, ws, alpha)
    assert out.dtype == torch.bfloat16 and out.shape == (n, m)
    for got in (out, gemv_reference(x, xs, w, ws, alpha, torch.float16)):
        # rounded once from the exact value (the two float64 sums differ by a few 2^-53 at most)
        assert inputs.rounding_violations(got, ref, terms * 2.0 ** -50) == (0, "ok")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_result_is_the_exact_value_rounded_once(out_dtype):
    x, xs, w, ws, alpha = inputs.op_inputs(5, 256, 512, seed=7, device="cpu")
    exact, terms = inputs.op_exact(x, xs, w, ws, alpha)
    out = gemv(x, xs, w, ws, alpha, out_dtype=out_dtype)
    assert inputs.rounding_violations(out, exact, terms * 2.0 ** -50) == (0, "ok")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_rounding_from_float64_is_single(out_dtype):
    """torch's float64 -> bf16/fp16 cast rounds twice (through fp32); the op's does not."""
    from nvfp4_gemv.reference import round_to

    g = torch.Generator().manual_seed(3)
    v = torch.randn(100_000, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-20, 14, (100_000,), generator=g).double())
    zero = torch.zeros(v.shape[0], 1, dtype=torch.float64)
    assert inputs.rounding_violations(round_to(v, out_dtype).view(-1, 1), v.view(-1, 1), zero) == (0, "ok")
    # just above a tie of out_dtype, by less than half an fp32 ulp: the cast lands on the tie, then rounds
    # to even (down); once-rounding goes up
    step = torch.finfo(out_dtype).eps / 2  # half an ulp at 1
    v = torch.tensor([1 + step + 2.0 ** -30], dtype=torch.float64)
    assert v.to(out_dtype).item() == 1.0
    assert round_to(v, out_dtype).item() == 1 + 2 * step


def test_uint8_views_are_the_same_operands():
    x, xs, w, ws, alpha = inputs.op_inputs(4, 128, 256, seed=8, device="cpu")
    ref = gemv(x, xs, w, ws, alpha)
    u8 = [t.view(torch.uint8) for t in (x, xs, w, ws)]
    assert torch.equal(gemv(*u8, alpha), ref)
    assert torch.equal(gemv(u8[0], xs, w, u8[3], alpha), ref)


def test_alpha_none_is_one():
    x, xs, w, ws, _ = inputs.op_inputs(2, 128, 128, seed=9, device="cpu")
    assert torch.equal(gemv(x, xs, w, ws, None), gemv(x, xs, w, ws, torch.ones(1)))
    assert not torch.equal(gemv(x, xs, w, ws, None), gemv(x, xs, w, ws, torch.full((1,), 0.75)))


@pytest.mark.parametrize("form", ["flat", "torchao"])
@pytest.mark.parametrize("which", ["w_scale", "x_scale", "both"])
def test_blocked_scales_give_the_same_result(form, which):
    n, m, k = 3, 256, 320  # K/16 = 20 columns: the blocked layout pads them to 24
    x, xs, w, ws, alpha = inputs.op_inputs(n, m, k, seed=10, device="cpu")
    ref = gemv(x, xs, w, ws, alpha)

    def blocked(s, rows):
        return inputs.blocked_scales(s, rows, k, flat=form == "flat")

    if which in ("x_scale", "both"):
        xs = blocked(xs, n)
    if which in ("w_scale", "both"):
        ws = blocked(ws, m)
    assert torch.equal(gemv(x, xs, w, ws, alpha), ref)


def test_out_is_written_and_returned():
    x, xs, w, ws, alpha = inputs.op_inputs(4, 128, 256, seed=11, device="cpu")
    ref = gemv(x, xs, w, ws, alpha, out_dtype=torch.float16)
    out = torch.full((4, 128), float("nan"), dtype=torch.float16)
    assert gemv(x, xs, w, ws, alpha, out=out) is out
    assert torch.equal(out, ref)
    wide = torch.full((4, 256), float("nan"), dtype=torch.bfloat16)
    view = wide[:, 64:192]  # rows 256 elements apart
    assert gemv(x, xs, w, ws, alpha, out=view) is view
    assert torch.equal(view, gemv(x, xs, w, ws, alpha))
    assert wide[:, :64].isnan().all() and wide[:, 192:].isnan().all()


def test_non_contiguous_operands_on_the_exact_path():
    x, xs, w, ws, alpha = inputs.op_inputs(3, 128, 256, seed=12, device="cpu")
    ref = gemv(x, xs, w, ws, alpha)
    wt = w.view(torch.uint8).T.contiguous().T  # same values, column-major
    assert torch.equal(gemv(x, xs, wt, ws, alpha), ref)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_a_torch_dispatch_mode_sees_the_op(device):
    """Under a dispatch mode (a flop counter, a fake-tensor tracer) gemv goes through torch.ops.nvfp4,
    not the direct launch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    args = inputs.op_inputs(2, 128, 128, seed=4, device=device)
    ref = gemv(*args)
    with Log():
        out = gemv(*args)
    assert any("nvfp4.gemv" in name for name in seen), seen
    assert torch.equal(out.cpu(), ref.cpu())

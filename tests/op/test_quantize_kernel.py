"""The GPU kernel of nvfp4_gemv.quantize (``nvfp4_gemv.quant_kernel``) gives, byte for byte, what the exact
reference (``nvfp4_gemv.quant.quantize_reference``) gives: random rows of both dtypes over wide magnitude
ranges, ties of every e2m1 midpoint, values that saturate, zero blocks, blocks whose scale is an e4m3
subnormal, NaN and inf, -0.0, strided rows. Its ``dequantized`` build (``quantize_dequantized``) gives, bit
for bit, ``quantize_dequantized_reference`` on every one of those inputs (NaN where it is NaN). Outputs are
poisoned first."""

import pytest
import torch

from nvfp4_gemv import quant, quant_kernel
from sync_free import no_syncs

pytestmark = pytest.mark.gpu


def run_kernel(x, gs):
    rows, k = x.shape
    q = torch.full((rows, k // 2), 0xA5, dtype=torch.uint8, device="cuda")
    s = torch.full((rows, k // 16), 0x5A, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    quant_kernel.quantize_cuda(x, gs, q, s)
    torch.cuda.synchronize()
    return q, s


def run_dequantized(x, gs):
    out = torch.full(x.shape, 0x7BCD, dtype=torch.int16, device="cuda").view(x.dtype)  # poison: a finite value
    quant_kernel.quantize_dequantized_cuda(x, gs, out)
    torch.cuda.synchronize()
    return out


def assert_same(x, gs):
    q, s = run_kernel(x, gs)
    rq, rs = quant.quantize_reference(x.cpu(), gs.cpu())  # the exact reference on the CPU
    q, s = q.cpu(), s.cpu()
    assert torch.equal(s.view(torch.uint8), rs.view(torch.uint8)), (s.view(torch.uint8) != rs.view(torch.uint8)).nonzero()[:5]
    assert torch.equal(q, rq), (q != rq).nonzero()[:5]
    assert_same_dequantized(x, gs)


def assert_same_dequantized(x, gs):
    got = run_dequantized(x, gs).cpu()
    want = quant.quantize_dequantized_reference(x.cpu(), gs.cpu())
    same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
    assert bool(same.all()), [(tuple(i), got[tuple(i)].item(), want[tuple(i)].item()) for i in (~same).nonzero()[:5]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,k", [(1, 16), (1, 16384), (3, 4096), (16, 1024), (33, 7168)])
def test_random_rows_match_the_reference_bit_for_bit(dtype, rows, k):
    g = torch.Generator().manual_seed(rows * k)
    x = torch.randn(rows, k, generator=g) * torch.exp2(torch.randint(-6, 7, (rows, k // 16, 1), generator=g).float()).expand(
        rows, k // 16, 16).reshape(rows, k)
    gs = torch.tensor([448 * 6 / 7.5], dtype=torch.float32)  # 1 / input_scale of a calibration amax of 7.5
    assert_same(x.to(dtype).cuda(), gs.cuda())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_midpoints_saturation_zeros_and_specials(dtype):
    """Block 0 holds 6 (amax) and every e2m1 midpoint times the block scale 1 (gs = 1: s = 6 / 6); block 1
    values beyond what its scale reaches; block 2 zeros and -0.0; block 3 a NaN; block 4 an inf; block 5 tiny
    values whose scale is an e4m3 subnormal; block 6 amax * gs / 6 above 448 (saturating)."""
    k = 16 * 7
    x = torch.zeros(2, k)
    x[:, :16] = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -6])
    x[:, 16:32] = torch.linspace(-40, 40, 16)
    x[:, 32:48] = -0.0
    x[:, 48:64] = 1.0
    x[:, 50] = float("nan")
    x[:, 64:80] = 2.0
    x[:, 70] = float("inf")
    x[:, 80:96] = torch.linspace(-1, 1, 16) * 0.05  # amax / 6 = 0.0083 < 2^-6: an e4m3 subnormal scale at gs = 1
    x[:, 96:112] = 3000.0 if dtype == torch.bfloat16 else 600.0
    gs = torch.tensor([1.0], dtype=torch.float32)
    assert_same(x.to(dtype).cuda(), gs.cuda())
    assert_same(x.to(dtype).cuda(), torch.tensor([5.0], dtype=torch.float32).cuda())


def test_misaligned_and_strided_x_are_copied_first():
    """A contiguous x at an address 16 does not divide (``contiguous()`` would not move it), a transposed one,
    and rows 1024 values apart."""
    buf = torch.randn(4 * 1024 + 4, dtype=torch.bfloat16, device="cuda")
    x = buf[4:].view(4, 1024)
    assert x.is_contiguous() and x.data_ptr() % 16
    gs = torch.tensor([3.0], device="cuda")
    assert_same(x, gs)
    assert_same(torch.randn(1024, 8, dtype=torch.float16, device="cuda").t(), gs)
    assert_same(torch.randn(8, 2048, dtype=torch.bfloat16, device="cuda")[:, 1024:], gs)


def test_the_op_runs_the_kernel_on_cuda(recwarn, monkeypatch):
    calls = []
    real = quant_kernel.quantize_cuda
    monkeypatch.setattr(quant_kernel, "quantize_cuda", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(4, 1024, dtype=torch.bfloat16, device="cuda")
    gs = torch.tensor([2.0], device="cuda")
    q, s = quant.quantize(x, gs)
    assert calls == [1]
    rq, rs = quant.quantize_reference(x, gs)
    assert torch.equal(q, rq) and torch.equal(s.view(torch.uint8), rs.view(torch.uint8))
    assert not [w for w in recwarn if "could not be imported" in str(w.message)]


def test_the_dequantized_op_runs_its_kernel_in_a_cuda_graph_without_syncs(monkeypatch):
    calls = []
    real = quant_kernel.quantize_dequantized_cuda
    monkeypatch.setattr(quant_kernel, "quantize_dequantized_cuda", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(32, 4096, dtype=torch.bfloat16, device="cuda") * 3
    gs = torch.tensor([448 * 6 / 9.0], device="cuda")
    first = quant.quantize_dequantized(x, gs)  # compiles outside the capture
    assert calls == [1] and first.dtype == x.dtype and first.shape == x.shape
    assert torch.equal(first, quant.quantize_dequantized_reference(x, gs))
    g = torch.cuda.CUDAGraph()
    with no_syncs():
        with torch.cuda.graph(g):
            out = quant.quantize_dequantized(x, gs)
    x.copy_(torch.randn_like(x) * 100)
    out.fill_(7.0)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, quant.quantize_dequantized_reference(x, gs))

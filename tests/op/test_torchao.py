"""torchao interop: the tensors that torchao's NVFP4Tensor holds (qdata, scale swizzled or not,
per_tensor_scale) go into nvfp4_gemv.gemv as they are, and the result is torchao's own dequantized
product. Skips without torchao (the ``interop`` extra)."""

import pytest
import torch

import inputs
from nvfp4_gemv import gemv

nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def quantize(t, swizzled):
    pts = nvfp4.per_tensor_amax_to_scale(t.abs().max())
    return nvfp4.NVFP4Tensor.to_nvfp4(t, per_tensor_scale=pts, is_swizzled_scales=swizzled)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("x_swizzled", [False, True])
@pytest.mark.parametrize("w_swizzled", [False, True])
@pytest.mark.parametrize("n", [1, 4, 16])
def test_torchao_nvfp4_tensors_go_in_as_they_are(device, x_swizzled, w_swizzled, n):
    g = torch.Generator().manual_seed(n)
    w = torch.randn(256, 1024, generator=g).to(torch.bfloat16).to(device)
    x = (3 * torch.randn(n, 1024, generator=g)).to(torch.bfloat16).to(device)
    wq, xq = quantize(w, w_swizzled), quantize(x, x_swizzled)
    alpha = (xq.per_tensor_scale * wq.per_tensor_scale).float()
    out = gemv(xq.qdata, xq.scale, wq.qdata, wq.scale, alpha)
    xd = xq.dequantize(torch.float32).double().cpu()
    wd = wq.dequantize(torch.float32).double().cpu()
    # torchao's dequantized values are fp32 products (one rounding each): within 2^-14 of |terms|
    bad, msg = inputs.op_violations(out, xd @ wd.T, xd.abs() @ wd.abs().T)
    assert bad == 0, msg
    # and the layer's product is close to the unquantized one (quantization error, not ours)
    rel = (out.double().cpu() - x.double().cpu() @ w.double().cpu().T).norm() / (x.double() @ w.double().T).norm().cpu()
    assert rel < 0.2


TORCHAO_LAYER = """
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
from nvfp4_gemv import gemv

def nvfp4(t, swizzled=True):
    return NVFP4Tensor.to_nvfp4(t, per_tensor_scale=per_tensor_amax_to_scale(t.abs().max()),
                                is_swizzled_scales=swizzled)

wq = nvfp4(linear.weight.detach().to(torch.bfloat16))

def forward(x):
    xq = nvfp4(x, swizzled=False)
    return gemv(xq.qdata, xq.scale, wq.qdata, wq.scale, alpha=xq.per_tensor_scale * wq.per_tensor_scale)
"""


def test_torchao_nvfp4_tensors_feed_gemv_and_approximate_the_layer():
    """torchao's NVFP4Tensor fields (qdata, swizzled or plain scales, per-tensor scales) go into gemv as they
    are (once the README's example; ``nvfp4_gemv.quantize`` is the faster quantizer now)."""
    linear = torch.nn.Linear(1024, 256).requires_grad_(False)
    ns = {"linear": linear, "torch": torch}
    exec(TORCHAO_LAYER, ns)  # noqa: S102 - our own example
    x = torch.randn(4, 1024, dtype=torch.bfloat16)
    y = ns["forward"](x)
    ref = x.double() @ linear.weight.double().T
    assert y.shape == (4, 256) and y.dtype == torch.bfloat16
    assert (y.double() - ref).norm() / ref.norm() < 0.25  # NVFP4 quantization of both operands

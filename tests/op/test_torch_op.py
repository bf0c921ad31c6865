"""nvfp4_gemv.gemv as a torch op: opcheck, fake tensors, torch.compile(fullgraph=True), on the CPU."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import inputs
import nvfp4_gemv  # noqa: F401 - registers torch.ops.nvfp4
from nvfp4_gemv import gemv


def u8_ops(n, m, k, seed=1):
    # opcheck compares inputs before and after with allclose, which fp4/fp8 CPU tensors lack: their bytes
    x, xs, w, ws, alpha = inputs.op_inputs(n, m, k, seed, device="cpu")
    return x.view(torch.uint8), xs.view(torch.uint8), w.view(torch.uint8), ws.view(torch.uint8), alpha


@pytest.mark.parametrize("alpha", [True, False])
def test_opcheck_gemv(alpha):
    x, xs, w, ws, a = u8_ops(3, 128, 128)
    torch.library.opcheck(torch.ops.nvfp4.gemv.default, (x, xs, w, ws, a if alpha else None, torch.bfloat16))


def test_opcheck_gemv_out():
    x, xs, w, ws, a = u8_ops(2, 128, 64)
    out = torch.empty(2, 128, dtype=torch.float16)
    torch.library.opcheck(torch.ops.nvfp4.gemv_out.default, (x, xs, w, ws, a, out))


def test_fake_tensor_gives_shape_and_dtype_without_computing():
    with FakeTensorMode():
        x = torch.empty(5, 512, dtype=torch.uint8)
        xs = torch.empty(5, 64, dtype=torch.float8_e4m3fn)
        w = torch.empty(384, 512, dtype=torch.float4_e2m1fn_x2)
        ws = torch.empty(96, 256, dtype=torch.float8_e4m3fn)  # blocked, torchao's shape
        out = torch.ops.nvfp4.gemv(x, xs, w, ws, None, torch.float16)
        assert out.shape == (5, 384) and out.dtype == torch.float16
        with pytest.raises(ValueError, match="argument 'w_scale'"):
            torch.ops.nvfp4.gemv(x, xs, w, ws[:4], None, torch.float16)


@pytest.mark.parametrize("with_out", [False, True])
def test_compiles_fullgraph_with_the_same_result(with_out):
    x, xs, w, ws, a = inputs.op_inputs(4, 128, 256, seed=2, device="cpu")
    torch._dynamo.reset()

    def layer(x, xs, w, ws, a, bias):
        if with_out:
            out = torch.empty(4, 128, dtype=torch.bfloat16)
            return gemv(x, xs, w, ws, a, out=out) + bias
        return gemv(x, xs, w, ws, a) + bias

    bias = torch.randn(128, dtype=torch.bfloat16)
    eager = layer(x, xs, w, ws, a, bias)
    compiled = torch.compile(layer, fullgraph=True)(x, xs, w, ws, a, bias)
    assert torch.equal(compiled, eager)


def _counting(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("how", ["gemv", "gemv out=", "torch.ops gemv", "torch.ops gemv_out"])
def test_a_call_validates_its_arguments_once(monkeypatch, how):
    """Each eager call validates once (``nvfp4_gemv.library``): the function, or the op's implementation
    where the op is called directly; the computation after it does not validate again."""
    from nvfp4_gemv import op

    x, xs, w, ws, a = u8_ops(2, 128, 128)
    out = torch.empty(2, 128, dtype=torch.bfloat16)
    calls = _counting(monkeypatch, op, "check_args")
    {"gemv": lambda: gemv(x, xs, w, ws, a),
     "gemv out=": lambda: gemv(x, xs, w, ws, a, out=out),
     "torch.ops gemv": lambda: torch.ops.nvfp4.gemv(x, xs, w, ws, a, torch.bfloat16),
     "torch.ops gemv_out": lambda: torch.ops.nvfp4.gemv_out(x, xs, w, ws, a, out)}[how]()
    assert len(calls) == 1, how


def test_packed_and_quantize_calls_validate_once(monkeypatch):
    from nvfp4_gemv import op, packed, quant
    from nvfp4_gemv import gemv_packed, pack_weight, quantize
    from nvfp4_gemv.quant import quantize_dequantized

    x = torch.randn(2, 128).bfloat16()
    _, _, w, ws, a = inputs.op_inputs(2, 128, 128, 1, device="cpu")
    wp = pack_weight(w, ws)
    packed_calls = _counting(monkeypatch, packed, "check_packed_args")
    op_calls = _counting(monkeypatch, op, "check_args")
    gemv_packed(x, wp, a)
    gemv_packed(x, wp, a, out=torch.empty(2, 128, dtype=torch.bfloat16))
    assert (len(packed_calls), len(op_calls)) == (2, 0)
    q_calls = _counting(monkeypatch, quant, "check_quantize_args")
    gs = torch.tensor(1.0)
    quantize(x, gs)
    quantize_dequantized(x, gs)
    torch.ops.nvfp4.quantize(x, gs)
    assert len(q_calls) == 3

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


@pytest.mark.parametrize("how, checks", [("gemv", 2), ("gemv out=", 2), ("torch.ops gemv", 1),
                                         ("torch.ops gemv_out", 1)])
def test_a_call_validates_in_the_function_and_the_op_never_in_the_computation(monkeypatch, how, checks):
    """On the CPU a call goes through the op (``nvfp4_gemv.library``): the function validates (our messages),
    the op's implementation validates (it can be called directly) and hands the result on; the exact
    reference does not validate a third time."""
    from nvfp4_gemv import op

    x, xs, w, ws, a = u8_ops(2, 128, 128)
    out = torch.empty(2, 128, dtype=torch.bfloat16)
    calls = _counting(monkeypatch, op, "check_args")
    {"gemv": lambda: gemv(x, xs, w, ws, a),
     "gemv out=": lambda: gemv(x, xs, w, ws, a, out=out),
     "torch.ops gemv": lambda: torch.ops.nvfp4.gemv(x, xs, w, ws, a, torch.bfloat16),
     "torch.ops gemv_out": lambda: torch.ops.nvfp4.gemv_out(x, xs, w, ws, a, out)}[how]()
    assert len(calls) == checks, how


def test_packed_and_quantize_calls_validate_in_the_function_and_the_op(monkeypatch):
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
    assert (len(packed_calls), len(op_calls)) == (4, 0)  # the unpacked reference is not validated again
    q_calls = _counting(monkeypatch, quant, "check_quantize_args")
    gs = torch.tensor(1.0)
    quantize(x, gs)
    quantize_dequantized(x, gs)
    torch.ops.nvfp4.quantize(x, gs)
    assert len(q_calls) == 5


def test_the_dispatcher_is_skipped_only_for_plain_untraced_calls_autograd_does_not_track():
    from nvfp4_gemv.library import eager

    t = torch.ones(2)
    assert eager(t, t)
    assert not eager(t, torch.ones(2, requires_grad=True))
    with torch.no_grad():
        assert eager(t, torch.ones(2, requires_grad=True))
    assert torch.vmap(lambda v: torch.tensor(eager(v)))(torch.ones(3, 2)).eq(0).all()
    with FakeTensorMode():
        assert not eager(torch.empty(2))
    seen = []
    torch.jit.trace(lambda v: seen.append(eager(v)) or v * 2, (t,), check_trace=False)
    assert seen == [False]


def test_vmap_and_autograd_see_the_ops():
    """vmap reaches the ops' batching fallback; a gradient through them is an error, never silently missing."""
    from nvfp4_gemv import quantize
    from nvfp4_gemv.quant import quantize_dequantized

    xb = torch.randn(3, 2, 64).bfloat16()
    gs = torch.ones(())
    q, s = torch.vmap(lambda v: quantize(v, gs))(xb)
    assert q.shape == (3, 2, 32) and torch.equal(q[1], quantize(xb[1], gs)[0])
    assert torch.equal(torch.vmap(lambda v: quantize_dequantized(v, gs))(xb)[2], quantize_dequantized(xb[2], gs))
    x, xs, w, ws, a = u8_ops(2, 128, 128)
    xg = torch.randn(2, 128, requires_grad=True)
    y = gemv(xg.bfloat16(), None, w, ws, a)
    with pytest.raises(RuntimeError):
        y.float().sum().backward()


@pytest.mark.parametrize("op", ["gemv", "gemv_packed", "quantize", "quantize_dequantized", "experts_gemv"])
def test_each_functional_op_has_our_one_layer_autograd_kernel_on_cuda_and_the_cpu(op):
    """custom_op's autograd kernel and device kernel are two Python layers a call (about 11 us of dispatch on
    the CPU against 4 for ours: 128 calls a compiled Llama-3-8B step not replayed from a graph)."""
    import nvfp4_gemv.experts_op  # noqa: F401 - registers nvfp4::experts_gemv

    dump = torch._C._dispatch_dump(f"nvfp4::{op}")
    for key in ("AutogradCPU", "AutogradCUDA"):
        line = next(ln for ln in dump.splitlines() if ln.startswith(key + ":"))
        assert "nvfp4_gemv/library.py" in line, line


def test_a_plain_call_runs_the_function_once_and_other_calls_go_below_autograd(monkeypatch):
    """The fast kernel runs the op's function for plain untracked tensors (never going below autograd); a
    tracked input goes through the op's own kernels and gets a backward that raises; a fake tensor the fake
    kernel."""
    import contextlib

    import nvfp4_gemv.library as library

    below = []
    real = library._below_autograd

    @contextlib.contextmanager
    def counted():
        below.append(1)
        with real():
            yield

    monkeypatch.setattr(library, "_below_autograd", counted)
    x, xs, w, ws, a = u8_ops(1, 128, 128)
    xb = torch.randn(1, 128).bfloat16()
    with torch.no_grad():
        want = torch.ops.nvfp4.gemv(xb, None, w, ws, a, torch.bfloat16)
    assert not want.requires_grad and below == [], "a plain call went below autograd"
    xg = torch.randn(1, 128, requires_grad=True)
    got = torch.ops.nvfp4.gemv(xg.bfloat16(), None, w, ws, a, torch.bfloat16)
    assert got.requires_grad and below == [1]
    assert torch.equal(got.detach(), torch.ops.nvfp4.gemv(xg.detach().bfloat16(), None, w, ws, a, torch.bfloat16))
    with pytest.raises(RuntimeError, match="nvfp4::gemv: no backward"):
        got.float().sum().backward()
    with FakeTensorMode() as mode:
        fake = torch.ops.nvfp4.gemv(mode.from_tensor(xb), None, mode.from_tensor(w), mode.from_tensor(ws),
                                    mode.from_tensor(a), torch.float16)
        assert fake.shape == (1, 128) and fake.dtype == torch.float16

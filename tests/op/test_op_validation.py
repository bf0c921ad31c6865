"""nvfp4_gemv.gemv rejects what it cannot take with a TypeError/ValueError naming the argument."""

import pytest
import torch

import inputs
from nvfp4_gemv import gemv

pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")


def ops(n=2, m=128, k=128):
    return list(inputs.op_inputs(n, m, k, seed=1, device="cpu"))


BAD = [
    # (id, change to [x, x_scale, w, w_scale, alpha], kwargs, exception, argument)
    ("x not a tensor", lambda a: a.__setitem__(0, [1, 2]), {}, TypeError, "x"),
    ("x float", lambda a: a.__setitem__(0, torch.zeros(2, 64)), {}, TypeError, "x"),
    ("x 3-d", lambda a: a.__setitem__(0, a[0].view(torch.uint8).view(2, 8, 8)), {}, ValueError, "x"),
    ("x no tokens", lambda a: a.__setitem__(0, a[0][:0]), {}, ValueError, "x"),
    ("w other K", lambda a: a.__setitem__(2, a[2][:, :32]), {}, ValueError, "w"),
    ("w M % 128", lambda a: a.__setitem__(2, a[2][:64]), {}, ValueError, "w"),
    ("w int8", lambda a: a.__setitem__(2, a[2].view(torch.int8)), {}, TypeError, "w"),
    ("K % 64", lambda a: (a.__setitem__(0, a[0][:, :16]), a.__setitem__(2, a[2][:, :16])), {}, ValueError, "x"),
    ("x_scale shape", lambda a: a.__setitem__(1, a[1][:, :4]), {}, ValueError, "x_scale"),
    ("x_scale fp16", lambda a: a.__setitem__(1, torch.ones(2, 8, dtype=torch.float16)), {}, TypeError, "x_scale"),
    ("w_scale shape", lambda a: a.__setitem__(3, a[3][:64]), {}, ValueError, "w_scale"),
    ("w_scale blocked, strided", lambda a: a.__setitem__(3, torch.zeros(32, 64, dtype=torch.uint8)[:, ::2]),
     {}, ValueError, "w_scale"),  # torchao's blocked shape for M = K = 128 is (32, 32): only the strides are wrong
    ("alpha 3-d", lambda a: a.__setitem__(4, torch.ones(1, 1, 1)), {}, TypeError, "alpha"),
    ("alpha fp64", lambda a: a.__setitem__(4, torch.ones(1, dtype=torch.float64)), {}, TypeError, "alpha"),
    ("alpha two elements", lambda a: a.__setitem__(4, torch.ones(2)), {}, TypeError, "alpha"),
    ("alpha a float", lambda a: a.__setitem__(4, 0.5), {}, TypeError, "alpha"),
    ("out_dtype fp32", lambda a: None, {"out_dtype": torch.float32}, TypeError, "out_dtype"),
    ("out shape", lambda a: None, {"out": torch.empty(2, 64, dtype=torch.bfloat16)}, ValueError, "out"),
    ("out dtype", lambda a: None, {"out": torch.empty(2, 128, dtype=torch.float32)}, TypeError, "out"),
    ("x nested", lambda a: a.__setitem__(0, torch.nested.nested_tensor([a[0].view(torch.uint8)] * 2)), {},
     TypeError, "x"),
    ("w sparse", lambda a: a.__setitem__(2, a[2].view(torch.uint8).to_sparse()), {}, TypeError, "w"),
    ("w_scale sparse", lambda a: a.__setitem__(3, a[3].view(torch.uint8).to_sparse()), {}, TypeError, "w_scale"),
    ("alpha sparse", lambda a: a.__setitem__(4, torch.ones(1).to_sparse()), {}, TypeError, "alpha"),
    ("out nested", lambda a: None, {"out": torch.nested.nested_tensor([torch.empty(2, 128, dtype=torch.bfloat16)])},
     TypeError, "out"),
]


@pytest.mark.parametrize("change,kwargs,exc,name", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_argument_raises_naming_it(change, kwargs, exc, name):
    args = ops()
    change(args)
    with pytest.raises(exc, match=f"argument '{name}'"):
        gemv(*args, **kwargs)


def test_operands_on_two_devices_are_rejected():
    args = ops()
    args[1] = args[1].to("meta")
    with pytest.raises(ValueError, match="argument 'x_scale'"):
        gemv(*args)


@pytest.mark.parametrize("tuning,word", [({"groups": 0}, "groups=0"), ({"groups": 9}, "groups=9"),
                                         ({"threads": 100}, "threads=100")])
def test_tensor_core_kernel_rejects_bad_configurations(tuning, word):
    from nvfp4_gemv.mma import Nvfp4GemvMma

    args = dict(k=1024, n_tok=4, groups=4, w_blocked=False, x_blocked=False, has_alpha=True, out_bf16=True)
    args.update(tuning)
    with pytest.raises(ValueError, match=word):
        Nvfp4GemvMma(**args)


@pytest.mark.parametrize("form", ["w4a4", "w4a16"])
def test_cuda_plans_refuse_out_rows_that_overlap(form):
    """Both launch plans (``op_plan``) check out's rows before any kernel is fetched: rows closer than M
    apart would be written over each other by the CTAs of different tokens (here on CPU tensors, the checks
    being metadata only)."""
    from nvfp4_gemv import op_plan
    from nvfp4_gemv.reference import check_args

    x, xs, w, ws, a = ops(3, 256, 512)
    out = torch.empty(3 * 256, dtype=torch.bfloat16).as_strided((3, 256), (128, 1))
    with pytest.raises(ValueError, match="argument 'out': expected rows that do not overlap"):
        if form == "w4a4":
            op_plan.W4A4Plan(x, xs, w, ws, a, out, torch.bfloat16)
        else:
            xb = torch.ones(3, 512, dtype=torch.bfloat16)
            op_plan.W4A16Plan(xb, w, ws, a, out, torch.bfloat16, check_args(xb, None, w, ws, a, torch.bfloat16, out))

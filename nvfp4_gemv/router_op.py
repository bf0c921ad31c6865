"""``topk_route``: a mixture-of-experts softmax top-k router, transformers' ``Qwen3MoeTopKRouter.forward`` as one
op (``torch.ops.nvfp4.topk_route``, for torch.compile):

    logits = x @ weight.T   (in x's dtype);   p = softmax(logits, fp32);   v, i = topk(p, k)
    v = v / v.sum()  (norm);                  returns (logits, v in x's dtype, i int64)

On CUDA, for up to ``MAX_TOKENS`` tokens and shapes ``router_kernel.can_implement`` takes, one kernel (past
256 experts also the fill of its counters; ``router_kernel``: its docstring states how its rounding and tie
order may differ from the torch ops'); else, and on the CPU, the torch ops themselves, exactly transformers'
code. No host sync either way.
"""

import torch

from .launch import fail
from .library import eager, fast_autograd

MAX_TOKENS = 64  # the kernel reads the router's weight once a token (from L2 after the first): decode sizes
_DTYPES = (torch.bfloat16, torch.float16)
WHO = "nvfp4_gemv.topk_route"


def check_args(x, weight, top_k):
    """Metadata checks (no sync)."""
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            fail(TypeError, name, "a torch.Tensor", type(t).__name__, WHO)
    if weight.dim() != 2:
        fail(ValueError, "weight", "a 2-d tensor [E, H]", tuple(weight.shape), WHO)
    if x.dim() != 2 or x.shape[1] != weight.shape[1]:
        fail(ValueError, "x", f"a 2-d tensor [T, H] with H = weight.shape[1] ({tuple(weight.shape)})",
             tuple(x.shape), WHO)
    if x.dtype != weight.dtype or x.dtype not in (*_DTYPES, torch.float32):
        fail(TypeError, "x", "bfloat16, float16 or float32, the dtype of 'weight'", f"{x.dtype} and {weight.dtype}", WHO)
    if x.device != weight.device:
        fail(ValueError, "weight", f"a tensor on {x.device} (where x is)", f"one on {weight.device}", WHO)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= weight.shape[0]:
        fail(ValueError, "top_k", f"an int in 1..{weight.shape[0]} (the experts)", repr(top_k), WHO)


_shapes = {}  # (E, H, top_k) -> whether router_kernel builds it: asked once a shape, not every call


def _builds(e, h, k):
    got = _shapes.get((e, h, k))
    if got is None:
        from .router_kernel import can_implement  # (the DSL, imported where a CUDA call first needs it)

        got = _shapes[(e, h, k)] = can_implement(e, h, k)[0]
    return got


def kernel_takes(x, weight, top_k):
    """Whether a call runs the kernel (else the torch ops)."""
    return (x.is_cuda and x.dtype in _DTYPES and x.shape[0] <= MAX_TOKENS and _builds(*weight.shape, top_k)
            and x.stride(1) == 1 and (x.stride(0) * 2) % 16 == 0 and x.data_ptr() % 16 == 0
            and weight.is_contiguous() and weight.data_ptr() % 16 == 0)


def route_torch(x, weight, top_k, norm):
    """transformers' ``Qwen3MoeTopKRouter.forward`` (5.x), op for op."""
    logits = torch.nn.functional.linear(x, weight)
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    top, idx = torch.topk(probs, top_k, dim=-1)
    if norm:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), idx


def _run(x, weight, top_k, norm):
    if kernel_takes(x, weight, top_k):
        from .router_kernel import route_cuda

        return route_cuda(x, weight, top_k, norm)
    return route_torch(x, weight, top_k, norm)


@torch.library.custom_op("nvfp4::topk_route", mutates_args=())
def _topk_route_op(x: torch.Tensor, weight: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                                                              torch.Tensor]:
    logits, v, i = _run(x, weight, top_k, norm)
    return logits, v, i


@_topk_route_op.register_fake
def _topk_route_fake(x, weight, top_k, norm):
    check_args(x, weight, top_k)
    t = x.shape[0]
    return (x.new_empty((t, weight.shape[0])), x.new_empty((t, top_k)), x.new_empty((t, top_k), dtype=torch.int64))


fast_autograd(_topk_route_op)


def topk_route(x, weight, top_k, norm=True):
    """``(router_logits [T, E], top_k_weights [T, k], top_k_index int64 [T, k])`` of a softmax top-k router
    (module docstring).

    :param x: [T, H] hidden states (bf16 or fp16 for the kernel; float32 takes the torch ops).
    :param weight: [E, H] the router's weight, x's dtype.
    :param top_k: experts a token, 1..E.
    :param norm: renormalise the k probabilities to sum 1 (``norm_topk_prob``).
    """
    if eager(x, weight):
        check_args(x, weight, top_k)
        return _run(x, weight, top_k, bool(norm))
    if not torch.compiler.is_compiling():
        check_args(x, weight, top_k)
    return torch.ops.nvfp4.topk_route(x, weight, top_k, bool(norm))

"""How the public ops (``gemv``, ``gemv_packed``, ``quantize``, ``quantize_dequantized``) reach their
implementations: one pattern, here once.

* eager CUDA calls (``eager``: plain tensors; no torch.compile, jit or functorch tracing; no torch dispatch
  mode; no input autograd would track) skip the dispatcher, whose host time is a large part of a GEMV's:
  the launch plan validates once, when it is made for the tensors' metadata;
* everything else goes through the ``torch.library`` op (``through_library``): torch.compile sees the op
  and its fake, vmap its batching rule, autograd its missing formula (an error at backward, not a silently
  missing gradient), the profiler and modes such as flop counters the call. The CPU's exact reference takes
  this way too. Outside tracing the function validates first, so that bad input gets our error naming the
  argument rather than the dispatcher's; the op's implementation validates again (it must:
  ``torch.ops.nvfp4.*`` can be called directly) and hands what it found to the computation, which does not
  validate a third time.
"""

import torch

PLAIN = (torch.Tensor, torch.nn.Parameter)  # other subclasses (fake, functional) go through torch.ops
# (bound once: eager() runs on every eager call, and each lookup is host time)
_compiling, _grad = torch.compiler.is_compiling, torch.is_grad_enabled
_modes, _jit, _functorch = torch._C._len_torch_dispatch_stack, torch._C._is_tracing, torch._C._are_functorch_transforms_active


def eager(*tensors):
    """Whether a call on ``tensors`` (None entries ignored) may skip the dispatcher (module docstring)."""
    if _compiling():  # first: traced, each type() below would be a dynamo guard on every compiled call
        return False
    for t in tensors:
        if t is not None and (type(t) not in PLAIN or (t.requires_grad and _grad())):
            return False
    return not (_modes() or _jit() or _functorch())


def through_library(check, op, args, op_out=None, out=None):
    """``op(*args)`` after ``check()`` where not tracing; with ``out``, ``op_out`` on the same arguments but
    the last (the output dtype) replaced by ``out``, returning ``out``."""
    if not torch.compiler.is_compiling():
        check()
    if out is None:
        return op(*args)
    op_out(*args[:-1], out)
    return out

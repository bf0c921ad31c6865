"""How the public ops (``gemv``, ``gemv_packed``, ``quantize``, ``quantize_dequantized``) reach their
implementations: one pattern, here once.

* eager calls on plain tensors, outside tracing and outside any torch dispatch mode (``eager``), skip the
  dispatcher: the function validates once and runs the implementation (a cached launch plan on CUDA, the
  exact reference on the CPU);
* everything else goes through the ``torch.library`` op (``through_library``): tracing by torch.compile
  sees the op and its fake, modes such as flop counters see the call, fake tensors get metadata; outside
  tracing the arguments are validated first so that bad input gets our error naming the argument, not the
  dispatcher's.

Each op's implementation validates once a call (it must: ``torch.ops.nvfp4.*`` can be called directly) and
hands what it found to the computation, which does not validate again.
"""

import torch

PLAIN = (torch.Tensor, torch.nn.Parameter)  # other subclasses (fake, functional) go through torch.ops


def eager(*tensors):
    """Whether a call on ``tensors`` may skip the dispatcher (module docstring)."""
    return (all(type(t) in PLAIN for t in tensors) and not torch.compiler.is_compiling()
            and not torch._C._len_torch_dispatch_stack())


def through_library(check, op, args, op_out=None, out=None):
    """``op(*args)`` after ``check()`` where not tracing; with ``out``, ``op_out`` on the same arguments but
    the last (the output dtype) replaced by ``out``, returning ``out``."""
    if not torch.compiler.is_compiling():
        check()
    if out is None:
        return op(*args)
    op_out(*args[:-1], out)
    return out

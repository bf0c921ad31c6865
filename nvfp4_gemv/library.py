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


# ----------------------------------------------------------------------------------------------------
# The ops' autograd kernel on CUDA and the CPU
# ----------------------------------------------------------------------------------------------------

_below_autograd = torch._C._AutoDispatchBelowAutograd


class _NoBackward(torch.autograd.Function):
    """Carries an op's result with a backward that raises: the ops are inference-only, and a gradient
    through them must be an error, never silently missing."""

    @staticmethod
    def forward(ctx, name, out, *inputs):
        ctx.name = name
        return out.clone()

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"{ctx.name}: no backward (the NVFP4 ops are inference-only); run the model under "
                           "torch.no_grad() or detach the inputs")


def fast_autograd(op_def):
    """Registers the autograd kernel of a functional ``torch.library.custom_op`` (``op_def``) on CUDA and the
    CPU: a plain call (no input that autograd tracks, plain tensors, no dispatch mode, jit or functorch) runs
    the op's own function at once; anything else goes below autograd to the op's other kernels (fake
    tensors, modes), with a backward that raises where an input requires grad.

    Why: custom_op's autograd kernel and its device kernel are each a Python layer over the dispatcher;
    together about 9.5 us a call on the CPU against 2.7 us for this one kernel (measured 2026-12-06), and
    torch.compile's generated code calls the op through the dispatcher on every call of a step that is not
    replayed from a CUDA graph (128 GEMV calls a Llama-3-8B step: about 0.85 ms of host time)."""
    import warnings

    opov = op_def._opoverload
    fn = op_def._init_fn
    name = op_def._qualname  # "nvfp4::gemv"

    def kernel(*args):
        plain = True
        tracked = False
        grad = _grad()
        for a in args:
            if isinstance(a, torch.Tensor):
                if type(a) not in PLAIN:
                    plain = False
                if grad and a.requires_grad:
                    tracked = True
        if plain and not tracked and not (_modes() or _jit() or _functorch()):
            return fn(*args)
        with _below_autograd():
            out = opov(*args)
        if tracked:
            inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            if isinstance(out, torch.Tensor):
                if out.is_floating_point():
                    out = _NoBackward.apply(name, out, *inputs)
            else:  # a tuple of results (topk_route): each floating one raises on backward
                out = tuple(_NoBackward.apply(name, o, *inputs) if o.is_floating_point() else o for o in out)
        return out

    lib = torch.library.Library(op_def._namespace, "IMPL")
    with warnings.catch_warnings():  # ("Overriding a previously registered kernel": custom_op's, on purpose)
        warnings.simplefilter("ignore")
        for key in ("AutogradCUDA", "AutogradCPU"):
            lib.impl(op_def._name, kernel, key)
    _libs.append(lib)  # (a Library deregisters its kernels when collected)


_libs = []

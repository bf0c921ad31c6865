"""``nvfp4_gemv.gemv``: NVFP4 linear layers in decode, as a PyTorch op.

``out[n, m] = alpha * sum_k x[n, k] * x_scale[n, k // 16] * w[m, k] * w_scale[m, k // 16]``, the product
``(dequant(x) @ dequant(w).T) * alpha`` of an NVFP4 checkpoint's linear layer (alpha: the product of the
two per-tensor scales). With bf16/fp16 ``x`` and ``x_scale=None`` it is the weight-only (W4A16) product
``(x @ dequant(w).T) * alpha``, which ``nvfp4_gemv.w4a16`` computes on CUDA. For NVFP4 ``x``, on a CUDA GPU
(Hopper or Blackwell) one of three CuTe DSL kernels runs, chosen by ``nvfp4_gemv.op_route``:
``nvfp4_gemv.tokens_bulk`` (bulk copies of ``w`` rows into shared memory, dp4a on int8 copies of x held in
registers: 1-3 tokens, 4 at K = 16384), ``nvfp4_gemv.tokens`` (dp4a on int8 copies of x in shared memory,
``w`` read once for each group of tokens that fits) or ``nvfp4_gemv.mma`` (``mma.sync`` on exact f16 operands,
16 tokens a pass over ``w``, from 5 tokens on). Elsewhere a float64 implementation runs (exact products,
float64 sums, one rounding to the output dtype: ``reference.gemv_reference``).

The op is ``torch.ops.nvfp4.gemv`` (and ``torch.ops.nvfp4.gemv_out`` for ``out=``), with fake
implementations for tracing, so ``torch.compile(fullgraph=True)`` and CUDA graphs take it. Eager calls of
``gemv`` on CUDA skip the dispatcher (``nvfp4_gemv.library``): a cached launch plan per tensor metadata (``op_plan``).
"""

from typing import Optional

import torch

from . import launch
from . import op_plan
from . import packed
from .library import eager, fast_autograd, through_library
from .reference import OUT_DTYPES, check_args, fail_gemv, reference_product


# ----------------------------------------------------------------------------------------------------
# The product on w's device
# ----------------------------------------------------------------------------------------------------

# eager calls with a weight tensor of a recent call, whose tensors pass that plan's C++ guard (the same
# metadata), skip the key
_recent = launch.RecentPlans()


def _run(x, x_scale, w, w_scale, alpha, out, out_dtype, dims=None):
    """The product on w's device: a cached plan on CUDA (validated when the plan is made), the exact reference
    elsewhere (validated here unless the caller passes ``check_args``' ``dims``)."""
    if w.is_cuda and x_scale is None:
        return op_plan.run_w4a16(x, w, w_scale, alpha, out, out_dtype)
    if w.is_cuda:
        return op_plan.run_w4a4(x, x_scale, w, w_scale, alpha, out, out_dtype)
    if dims is None:
        dims = check_args(x, x_scale, w, w_scale, alpha, out_dtype, out)
    res = reference_product(dims, x, x_scale, w, w_scale, alpha, out_dtype)
    if out is None:
        return res
    out.copy_(res)
    return out


# ----------------------------------------------------------------------------------------------------
# torch.library ops
# ----------------------------------------------------------------------------------------------------


@torch.library.custom_op("nvfp4::gemv", mutates_args=())
def _gemv_op(x: torch.Tensor, x_scale: Optional[torch.Tensor], w: torch.Tensor, w_scale: torch.Tensor,
             alpha: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    return _run(x, x_scale, w, w_scale, alpha, None, out_dtype)


@_gemv_op.register_fake
def _gemv_fake(x, x_scale, w, w_scale, alpha, out_dtype):
    n, m, _, _, _ = check_args(x, x_scale, w, w_scale, alpha, out_dtype)
    return x.new_empty((n, m), dtype=out_dtype, device=w.device)


fast_autograd(_gemv_op)


@torch.library.custom_op("nvfp4::gemv_out", mutates_args=("out",))
def _gemv_out_op(x: torch.Tensor, x_scale: Optional[torch.Tensor], w: torch.Tensor, w_scale: torch.Tensor,
                 alpha: Optional[torch.Tensor], out: torch.Tensor) -> None:
    dims = check_args(x, x_scale, w, w_scale, alpha, out.dtype, out)
    _run(x, x_scale, w, w_scale, alpha, out, out.dtype, dims)


@_gemv_out_op.register_fake
def _gemv_out_fake(x, x_scale, w, w_scale, alpha, out):
    check_args(x, x_scale, w, w_scale, alpha, out.dtype, out)


def gemv(x, x_scale, w, w_scale, alpha=None, out_dtype=torch.bfloat16, out=None):
    """NVFP4 linear layer in decode: ``(x @ dequant(w).T) * alpha`` (W4A16) or ``(dequant(x) @ dequant(w).T)
    * alpha`` (W4A4).

    :param x: activations: [N, K] ``torch.bfloat16`` or ``torch.float16`` as they are (W4A16, the
        weight-only path: ``x_scale`` must be None; ``nvfp4_gemv.w4a16``), or NVFP4 [N, K/2]
        ``torch.float4_e2m1fn_x2`` / ``torch.uint8`` (two e2m1 values a byte, the first in the low nibble).
        ``w`` is read once per group of tokens (up to 32 for W4A16; for NVFP4 x up to 16 from N = 5 on),
        so more tokens cost far less than one call each (docs/results.md).
    :param x_scale: None for bf16/fp16 ``x``; for NVFP4 ``x`` its [N, K/16] ``torch.float8_e4m3fn`` (or
        uint8 bytes) scales, one per 16 values, or the 128x4 blocked layout (see ``w_scale``).
    :param w: weights [M, K/2], the same dtypes; M % 128 == 0, K % 64 == 0, K <= 32768.
    :param w_scale: [M, K/16] plain scales, or the 128x4 blocked ("swizzled") layout of cuBLAS, torchao
        and flashinfer (``to_blocked``): shape ``(ceil(M/128)*32, ceil(K/64)*16)`` as torchao's
        ``NVFP4Tensor`` keeps it, or that many elements flat. The two are told apart by shape.
    :param alpha: None (1) or a one-element fp32 tensor on the device (e.g. the product of the two
        per-tensor scales), read by the kernel: no host sync.
    :param out_dtype: ``torch.bfloat16`` (default) or ``torch.float16``.
    :param out: optional preallocated [N, M] bf16 or fp16 tensor (unit stride along M on CUDA), written
        and returned; its dtype is the result's (``out_dtype`` is then ignored).
    :return: [N, M] ``out_dtype``: ``out[n, m] = alpha * sum_k x[n,k] xs[n,k//16] w[m,k] ws[m,k//16]``
        (``xs`` = 1 for W4A16).
    :raises TypeError, ValueError: naming the argument, for inputs the op cannot take.
    """
    # the eager fast path (nvfp4_gemv.library): plain tensors, no tracing and no torch dispatch mode (a
    # FakeTensor has no data to launch on; modes such as flop counters must see the op), and a plan made for
    # exactly this metadata
    direct = eager(w, x, x_scale, w_scale, alpha)
    if direct and x_scale is None and w.is_cuda:  # W4A16 (check_args names a missing x_scale for fp4 x)
        if out is not None and (not isinstance(out, torch.Tensor) or out.dtype not in OUT_DTYPES):
            fail_gemv(TypeError, "out", "a torch.bfloat16 or torch.float16 tensor", getattr(out, "dtype", type(out).__name__))
        return op_plan.run_w4a16(x, w, w_scale, alpha, out, out_dtype if out is None else out.dtype)
    if direct:
        hit = _recent.hits.get(id(w))
        res = hit(x, x_scale, w, w_scale, alpha, out, out_dtype) if hit is not None else None
        if res is None:
            res = _recent.scan(w, hit, x, x_scale, w, w_scale, alpha, out, out_dtype)
        if res is not None:
            return res
        try:
            key = op_plan.w4a4_key(x, x_scale, w, w_scale, alpha, out, out_dtype if out is None else out.dtype)
            plan = op_plan._plans.get(key)
        except (AttributeError, TypeError, RuntimeError, NotImplementedError):  # strides of nested, CSR, ...
            key = plan = None
        if plan is not None:
            _recent.add(w, op_plan.W4A4Plan.hit_tensors(x, x_scale, w, w_scale, alpha, out), plan)
            return plan(x, x_scale, w, w_scale, alpha, out, out_dtype if out is None else out.dtype)
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype not in OUT_DTYPES:
            fail_gemv(TypeError, "out", "a torch.bfloat16 or torch.float16 tensor",
                      getattr(out, "dtype", type(out).__name__))
        out_dtype = out.dtype
    if not direct or not w.is_cuda:
        return through_library(lambda: check_args(x, x_scale, w, w_scale, alpha, out_dtype, out), torch.ops.nvfp4.gemv,
                               (x, x_scale, w, w_scale, alpha, out_dtype), torch.ops.nvfp4.gemv_out, out)
    return op_plan.run_w4a4(x, x_scale, w, w_scale, alpha, out, out_dtype)


# ----------------------------------------------------------------------------------------------------
# Packed weights (nvfp4_gemv.packed): W4A16 only
# ----------------------------------------------------------------------------------------------------


def _run_packed(x, w_packed, alpha, out, out_dtype, dims=None):
    """``_run`` for a packed weight (``dims``: ``packed.check_packed_args``' result, where the caller has it)."""
    if w_packed.is_cuda:
        return op_plan.run_w4a16_packed(x, w_packed, alpha, out, out_dtype)
    n, m, k = dims if dims is not None else packed.check_packed_args(x, w_packed, alpha, out_dtype, out)
    w, ws = packed.unpack_weight(w_packed)
    return _run(x, None, w, ws, alpha, out, out_dtype, (n, m, k, False, False))  # the exact CPU reference


@torch.library.custom_op("nvfp4::gemv_packed", mutates_args=())
def _gemv_packed_op(x: torch.Tensor, w_packed: torch.Tensor, alpha: Optional[torch.Tensor],
                    out_dtype: torch.dtype) -> torch.Tensor:
    return _run_packed(x, w_packed, alpha, None, out_dtype)


@_gemv_packed_op.register_fake
def _gemv_packed_fake(x, w_packed, alpha, out_dtype):
    n, m, _ = packed.check_packed_args(x, w_packed, alpha, out_dtype)
    return x.new_empty((n, m), dtype=out_dtype, device=w_packed.device)


fast_autograd(_gemv_packed_op)


@torch.library.custom_op("nvfp4::gemv_packed_out", mutates_args=("out",))
def _gemv_packed_out_op(x: torch.Tensor, w_packed: torch.Tensor, alpha: Optional[torch.Tensor],
                        out: torch.Tensor) -> None:
    dims = packed.check_packed_args(x, w_packed, alpha, out.dtype, out)
    _run_packed(x, w_packed, alpha, out, out.dtype, dims)


@_gemv_packed_out_op.register_fake
def _gemv_packed_out_fake(x, w_packed, alpha, out):
    packed.check_packed_args(x, w_packed, alpha, out.dtype, out)


def gemv_packed(x, w_packed, alpha=None, out_dtype=torch.bfloat16, out=None):
    """The W4A16 product ``(x @ dequant(w).T) * alpha`` with the weight packed by ``pack_weight(w, w_scale)``
    (``nvfp4_gemv.packed``: w and its scales in one buffer in the kernel's order, 5-9% faster than ``gemv``
    on the same weight at one token on H200). The same kernel, arithmetic and error bound as ``gemv``'s W4A16
    form, so the results are bit-identical to ``gemv(x, None, w, w_scale, alpha, ...)``.

    :param x: [N, K] ``torch.bfloat16`` or ``torch.float16`` activations as they are, K-contiguous rows.
    :param w_packed: ``pack_weight``'s uint8 [M, 9K/16] (or whole 8-row groups of it); M % 128 == 0,
        K % 128 == 0, K <= 32768.
    :param alpha: None (1) or a one-element fp32 tensor on the device (e.g. ModelOpt's ``weight_scale_2``).
    :param out_dtype, out: as ``gemv``'s.
    :return: [N, M] ``out_dtype``.
    :raises TypeError, ValueError: naming the argument, for inputs the op cannot take.
    """
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype not in OUT_DTYPES:
            fail_gemv(TypeError, "out", "a torch.bfloat16 or torch.float16 tensor", getattr(out, "dtype", type(out).__name__))
        out_dtype = out.dtype
    if eager(w_packed, x, alpha) and w_packed.is_cuda:  # (nvfp4_gemv.library)
        return _run_packed(x, w_packed, alpha, out, out_dtype)
    return through_library(lambda: packed.check_packed_args(x, w_packed, alpha, out_dtype, out),
                           torch.ops.nvfp4.gemv_packed, (x, w_packed, alpha, out_dtype), torch.ops.nvfp4.gemv_packed_out,
                           out)

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
``gemv`` on CUDA skip the dispatcher (``nvfp4_gemv.library``): a cached launch plan per tensor metadata.
"""

from typing import Optional

import torch

from . import launch
from . import packed
from . import w4a16_plan
from .mma import compile_mma
from .op_route import route
from .library import eager, fast_autograd, through_library
from .reference import OUT_DTYPES, check_args, fail_gemv, reference_product, unswizzle_scales
from .tokens import compile_tokens
from .tokens_bulk import compile_tokens_bulk



# ----------------------------------------------------------------------------------------------------
# Routing and launch plans
# ----------------------------------------------------------------------------------------------------

_plans = {}
# eager calls with a weight tensor of a recent call, whose tensors pass that plan's C++ guard (the same
# metadata), skip the key
_recent = launch.RecentPlans()


_sm_count = launch.sm_count  # a module name, so that tests can stand in another SM count


_kernels = launch.KernelCache(lambda key: {"mma": compile_mma, "tokens": compile_tokens,
                                             "bulk": compile_tokens_bulk}[key[0]](*key[2:-1], **dict(key[-1])))


def _get_kernel(device_index, key):
    return _kernels.get(device_index, key)


class _TokensPlan:
    """What the tensors' metadata fixes for a launch (kernels, grid, strides, token groups), so that a
    call only reads the data pointers and the stream."""

    variants = ()  # (guard, hit): C++ checks of tensor sets with this plan's key (launch.RecentPlans)

    def __init__(self, x, x_scale, w, w_scale, alpha, out, out_dtype, tuning=()):
        n, m, k, xb, wb = check_args(x, x_scale, w, w_scale, alpha, out_dtype, out)
        self.device = w.device
        self.dev = w.device.index
        self.out_shape = (n, m)
        # what the tensors' metadata leaves out: which optional tensors come, the result's dtype without out
        self.signature = (alpha is not None, out is not None, out_dtype)
        # the result is allocated each call (torch.empty): a device tensor kept here would be allocated in a
        # CUDA graph tree's pool where the plan is first made under torch.compile(mode="reduce-overhead"), and
        # stay alive there untracked (which that mode refuses)
        for t, name in ((x, "x"), (w, "w")):
            if t.stride(1) != 1 or t.stride(0) % 16 or t.data_ptr() % 16:
                fail_gemv(ValueError, name, "K-contiguous rows (stride(1) == 1) at 16-byte aligned addresses",
                          f"strides {t.stride()} at address {t.data_ptr():#x}")
        for t, name, blocked in ((x_scale, "x_scale", xb), (w_scale, "w_scale", wb)):
            if not blocked and (t.stride(1) != 1 or t.stride(0) % 2 or t.data_ptr() % 2):
                fail_gemv(ValueError, name, "K-contiguous scales (stride(1) == 1) at even addresses", f"strides {t.stride()}")
        out_rs = m
        if out is not None:
            if out.stride(1) != 1 and m > 1:
                fail_gemv(ValueError, "out", "unit stride along M", f"strides {out.stride()}")
            out_rs = out.stride(0)
        sms = _sm_count(self.dev)
        r = route(n, m, k, sms, not wb and w_scale.stride(0) % 16 == 0, tuning)  # (nvfp4_gemv.op_route)
        mma, g, groups, tuning = r.kernel == "mma", r.tokens, r.groups, r.tuning
        self.ws_mask = r.ws_mask
        self.args = (tuple(t for t in tuning if t[0] not in ("ctas", "rt")), mma, r.forced)
        self.fallback = None
        # blocked x scales: the kernel indexes tokens within one launch; rows below 32 of a tile are 16
        # bytes apart, so a later group starts 16 * t0 bytes in; beyond that the plan unswizzles on the host
        self.unswizzle_x = xb and g < n and n > 32
        if self.unswizzle_x:
            launch.warn_once("xs", "nvfp4_gemv.gemv: blocked x_scale for more than 32 tokens is unswizzled on the "
                             "host each call (extra torch kernels): pass plain x_scale")
            xb = False
        tile = 512 * (-(-(k // 16) // 4))  # bytes of a 128-row tile of blocked scales
        ws_rs = tile if wb else w_scale.stride(0)
        xs_rs = tile if xb else (k // 16 if self.unswizzle_x else x_scale.stride(0))
        self.k = k
        self.launches = []
        for t0 in range(0, n, g):
            nt = min(g, n - t0)
            if mma:
                shape = (k, nt, groups, wb, xb, alpha is not None, out_dtype == torch.bfloat16,
                         w.stride(0) == k // 2, not wb and w_scale.stride(0) == k // 16)
                key = ("mma", self.dev, *shape, tuning)
            else:
                key = (r.kernel, self.dev, k, nt, wb, xb, alpha is not None,
                       out_dtype == torch.bfloat16, tuning)
            kern = _get_kernel(self.dev, key)
            offsets = (t0 * x.stride(0), 16 * t0 if xb else t0 * xs_rs, t0 * out_rs * 2)
            self.launches.append((kern, offsets, (m, w.stride(0), ws_rs, x.stride(0), xs_rs, out_rs * 2,
                                                  kern.op.grid_x(m, sms))))

    def __call__(self, x, x_scale, w, w_scale, alpha, out, out_dtype):
        # addresses are not in the plan's key: checked on every call (the kernel reads 16-byte rows and
        # 2-byte scale pairs; a misaligned read would fault and break the CUDA context)
        px, pw, pxs, pws = x.data_ptr(), w.data_ptr(), x_scale.data_ptr(), w_scale.data_ptr()
        if (px | pw) & 15 or pxs & 1 or pws & self.ws_mask:
            bad = [n for n, p, mask in (("x", px, 15), ("w", pw, 15), ("x_scale", pxs, 1), ("w_scale", pws, 1))
                   if p & mask]
            if not bad:  # w_scale even but off 16 bytes, under a bulk-copy plan
                return self._unaligned(x, x_scale, w, w_scale, alpha, out, out_dtype)
            fail_gemv(ValueError, bad[0], "16-byte aligned rows of x and w, even addresses of the scales",
                      f"address {dict(x=px, w=pw, x_scale=pxs, w_scale=pws)[bad[0]]:#x}")
        if self.unswizzle_x:
            x_scale = unswizzle_scales(x_scale.view(torch.uint8), self.out_shape[0], self.k).contiguous()
            pxs = x_scale.data_ptr()
        if out is None:
            out = torch.empty(self.out_shape, dtype=out_dtype, device=self.device)
        pout = out.data_ptr()
        pa = alpha.data_ptr() if alpha is not None else 0
        dev_ok = launch.current_device() == self.dev
        stream = launch.current_stream(self.dev)
        for kern, (dx, dxs, dout), static in self.launches:
            if kern.ffi is not None and dev_ok:
                kern.ffi(pw, px + dx, pws, pxs + dxs, pout + dout, pa, *static, stream)
            else:
                with torch.cuda.device(self.dev):
                    kern.launch_dsl((pw, px + dx, pws, pxs + dxs, pout + dout, pa, *static), stream)
        return out

    def hit_path(self, check):
        """gemv's call for tensors with exactly this plan's metadata and signature: None where they differ
        (``check``, the plan's guard, rejects them). One TVM-FFI launch is inlined; any other plan runs
        ``self(...)``."""
        has_alpha, has_out, dtype = self.signature
        kern, (dx, dxs, dout), static = self.launches[0] if len(self.launches) == 1 else (None, (0, 0, 0), ())
        ffi = kern.ffi if kern is not None and not self.unswizzle_x else None
        dev, ws_mask, shape, device = self.dev, self.ws_mask, self.out_shape, self.device
        get_device, stream, empty = launch.current_device, launch.current_stream, torch.empty

        def call(x, x_scale, w, w_scale, alpha, out, out_dtype):
            if (alpha is None) == has_alpha or (out is None) == has_out or (out is None and out_dtype != dtype):
                return None
            try:
                # a strided nested tensor aborts the guard's stride read: tested first
                if x.is_nested or x_scale.is_nested or w.is_nested or w_scale.is_nested:
                    return None
                if has_alpha:
                    if alpha.is_nested or (has_out and out.is_nested):
                        return None
                    ok = check(x, x_scale, w, w_scale, alpha, out) if has_out else check(x, x_scale, w, w_scale, alpha)
                elif has_out:
                    ok = not out.is_nested and check(x, x_scale, w, w_scale, out)
                else:
                    ok = check(x, x_scale, w, w_scale)
            except (TypeError, AttributeError):  # not tensors
                return None
            if not ok:
                return None
            px, pw, pxs, pws = x.data_ptr(), w.data_ptr(), x_scale.data_ptr(), w_scale.data_ptr()
            if ffi is None or (px | pw) & 15 or pxs & 1 or pws & ws_mask or get_device() != dev:
                return self(x, x_scale, w, w_scale, alpha, out, dtype if out is None else out.dtype)
            if out is None:
                out = empty(shape, dtype=dtype, device=device)
            ffi(pw, px + dx, pws, pxs + dxs, out.data_ptr() + dout, alpha.data_ptr() if has_alpha else 0,
                *static, stream(dev))
            return out

        return call

    def _unaligned(self, x, x_scale, w, w_scale, alpha, out, out_dtype):
        """w_scale moved off 16 bytes since the plan chose the bulk-copy kernel (its address is no part of the
        key): the dp4a kernel takes it, from a second plan."""
        tuning, mma, forced = self.args
        if forced:
            fail_gemv(ValueError, "w_scale", "a 16-byte aligned address for the bulk-copy kernel", f"{w_scale.data_ptr():#x}")
        if self.fallback is None:
            launch.warn_once("ws16", "nvfp4_gemv.gemv: w_scale is not 16-byte aligned, so the bulk-copy kernel "
                             "cannot copy it; the dp4a kernel runs instead (up to 1.3x slower at 2 tokens on H200)")
            self.fallback = _TokensPlan(x, x_scale, w, w_scale, alpha, out, out_dtype,
                                        tuning=tuple(sorted({**dict(tuning), "mma": int(mma), "bulk": 0}.items())))
        return self.fallback(x, x_scale, w, w_scale, alpha, out, out_dtype)


def _key(x, x_scale, w, w_scale, alpha, out, out_dtype):
    """Everything a plan depends on; ``get_device()`` is -1 off CUDA, where no plan is ever made."""
    return (x.shape, x.stride(), x.dtype, x.get_device(), x_scale.shape, x_scale.stride(), x_scale.dtype,
            x_scale.get_device(), w.shape, w.stride(), w.dtype, w.get_device(), w_scale.shape, w_scale.stride(),
            w_scale.dtype, w_scale.get_device(),
            None if alpha is None else (alpha.shape, alpha.dtype, alpha.layout, alpha.get_device()),
            None if out is None else (out.shape, out.stride(), out.dtype, out.get_device()), out_dtype)


def _gemv_cuda(x, x_scale, w, w_scale, alpha, out, out_dtype, key=None):
    if key is None:
        try:
            key = _key(x, x_scale, w, w_scale, alpha, out, out_dtype)
        except (AttributeError, TypeError, RuntimeError, NotImplementedError):
            key = None
    plan = _plans.get(key)
    if plan is None:
        if w.device.type != "cuda":
            fail_gemv(ValueError, "w", "a CUDA tensor for the CUDA path", f"a tensor on {w.device}")
        plan = _TokensPlan(x, x_scale, w, w_scale, alpha, out, out_dtype)
        if key is not None:
            launch.keep_plan(_plans, key, plan)
    return plan(x, x_scale, w, w_scale, alpha, out, out_dtype)


def _run(x, x_scale, w, w_scale, alpha, out, out_dtype, dims=None):
    """The product on w's device: a cached plan on CUDA (validated when the plan is made), the exact reference
    elsewhere (validated here unless the caller passes ``check_args``' ``dims``)."""
    if w.is_cuda and x_scale is None:
        return w4a16_plan.run_cuda(x, w, w_scale, alpha, out, out_dtype, check_args)
    if w.is_cuda:
        return _gemv_cuda(x, x_scale, w, w_scale, alpha, out, out_dtype)
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
        return w4a16_plan.run_cuda(x, w, w_scale, alpha, out, out_dtype if out is None else out.dtype, check_args)
    if direct:
        hit = _recent.hits.get(id(w))
        res = hit(x, x_scale, w, w_scale, alpha, out, out_dtype) if hit is not None else None
        if res is None:
            res = _recent.scan(w, hit, x, x_scale, w, w_scale, alpha, out, out_dtype)
        if res is not None:
            return res
        try:
            key = _key(x, x_scale, w, w_scale, alpha, out, out_dtype if out is None else out.dtype)
            plan = _plans.get(key)
        except (AttributeError, TypeError, RuntimeError, NotImplementedError):  # strides of nested, CSR, ...
            key = plan = None
        if plan is not None:
            ts = (x, x_scale, w, w_scale) + ((alpha,) if alpha is not None else ()) + ((out,) if out is not None else ())
            _recent.add(w, ts, plan)
            return plan(x, x_scale, w, w_scale, alpha, out, out_dtype if out is None else out.dtype)
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype not in OUT_DTYPES:
            fail_gemv(TypeError, "out", "a torch.bfloat16 or torch.float16 tensor",
                      getattr(out, "dtype", type(out).__name__))
        out_dtype = out.dtype
    if not direct or not w.is_cuda:
        return through_library(lambda: check_args(x, x_scale, w, w_scale, alpha, out_dtype, out), torch.ops.nvfp4.gemv,
                               (x, x_scale, w, w_scale, alpha, out_dtype), torch.ops.nvfp4.gemv_out, out)
    return _gemv_cuda(x, x_scale, w, w_scale, alpha, out, out_dtype)


# ----------------------------------------------------------------------------------------------------
# Packed weights (nvfp4_gemv.packed): W4A16 only
# ----------------------------------------------------------------------------------------------------


def _run_packed(x, w_packed, alpha, out, out_dtype, dims=None):
    """``_run`` for a packed weight (``dims``: ``packed.check_packed_args``' result, where the caller has it)."""
    if w_packed.is_cuda:
        return w4a16_plan.run_cuda_packed(x, w_packed, alpha, out, out_dtype, packed.check_packed_args)
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

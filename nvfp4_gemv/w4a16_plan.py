"""The W4A16 op's host side on CUDA: a launch plan a tensors' metadata (``W4A16Plan``: kernels, grids,
strides, token groups), cached so that a call reads only data pointers and the stream, and the many-token
fallback (``dequant_mm``: w dequantized, then ``torch.mm``). ``run_cuda`` / ``run_cuda_packed`` are what the
op calls. The kernel is ``w4a16``, its routing ``w4a16_route``.
"""


import torch

from .launch import KernelCache, current_device, current_stream, keep_plan, sm_count
from .packed import fail_packed
from .reference import fail_gemv
from .w4a16 import MAX_TOKENS, compile_w4a16
from .w4a16_route import route

# from this many tokens on, w is dequantized into x's dtype and multiplied by torch.mm (cuBLAS, tensor cores):
# the kernel reads w once a group of 32 tokens, so prefill-sized N would read it N / 32 times
DEQUANT_MIN_TOKENS = 129

_plans = {}


_sm_count = sm_count  # a module name, so that tests can stand in another SM count


def _build(key):
    _, k, nt, groups, x_bf16, wb, has_alpha, out_bf16, tuning = key[1:]
    return compile_w4a16(k, nt, groups, x_bf16, wb, has_alpha, out_bf16, **dict(tuning))


_kernels = KernelCache(_build)


def _get_kernel(dev, key):
    return _kernels.get(dev, key)


class W4A16Plan:
    """What the tensors' metadata fixes for the W4A16 launches (kernels, grid, strides, token groups), so
    that a call only reads the data pointers and the stream. ``dims`` comes from ``reference.check_args``."""

    def __init__(self, x, w, w_scale, alpha, out, out_dtype, dims, tuning=(), packed=False):
        n, m, k, _, wb = dims
        self.dev = w.device.index
        self.out_shape = (n, m)
        self.device = w.device  # the result is allocated each call: see op._TokensPlan
        # packed (w_scale None): w is packed.py's [M, 9K/16] buffer, read in 576-byte pieces of 8 rows
        self.packed = bool(packed)
        for t, name, es in ((x, "x", 2),) + (() if packed else ((w, "w", 1),)):
            if t.stride(1) != 1 or (t.shape[0] > 1 and (t.stride(0) * es) % 16) or t.data_ptr() % 16:
                fail_gemv(ValueError, name, "K-contiguous rows (stride(1) == 1) at 16-byte aligned addresses",
                          f"strides {t.stride()} at address {t.data_ptr():#x}")
        if packed and (w.stride() != (w.shape[1], 1) or w.data_ptr() % 16):
            fail_packed(ValueError, "w_packed", "a contiguous tensor at a 16-byte aligned address (pack_weight's "
                        "output, or whole rows of it)", f"strides {w.stride()} at address {w.data_ptr():#x}")
        if not packed and not wb and (w_scale.stride(1) != 1 or w_scale.stride(0) % 2 or w_scale.data_ptr() % 2):
            fail_gemv(ValueError, "w_scale", "K-contiguous scales (stride(1) == 1) with even row strides at even "
                      "addresses", f"strides {w_scale.stride()} at address {w_scale.data_ptr():#x}")
        out_rs = m
        if out is not None:
            if out.stride(1) != 1 and m > 1:
                fail_gemv(ValueError, "out", "unit stride along M", f"strides {out.stride()}")
            if n > 1 and out.stride(0) < m:
                fail_gemv(ValueError, "out", f"rows that do not overlap (stride(0) >= {m})", f"strides {out.stride()}")
            out_rs = out.stride(0)
        self.dequant = n >= DEQUANT_MIN_TOKENS
        self.ws_mask = 1  # address bits of w_scale that must be 0 (checked each call; bulk's below)
        self.k = k
        self.wb = wb
        self.launches = []
        if self.dequant:
            return
        sms = _sm_count(self.dev)
        tuning = dict(tuning)
        g = -(-n // -(-n // MAX_TOKENS))
        tile = 512 * (-(-(k // 16) // 4))  # bytes of a 128-row tile of blocked scales
        ws_rs = 0 if packed else tile if wb else w_scale.stride(0)
        x_rs = x.stride(0) * 2

        for t0 in range(0, n, g):
            nt = min(g, n - t0)
            r = route(nt, m, k, sms, tuning.items(), packed)
            tune = dict(r.tuning)
            if tune.get("bulk"):  # (never routed) bulk copies 16-byte rows of plain scales
                if wb or (w_scale.data_ptr() | ws_rs) & 15:
                    fail_gemv(ValueError, "w_scale", "plain rows at 16-byte aligned addresses for bulk",
                              f"{'blocked scales' if wb else f'row stride {ws_rs}'} at address {w_scale.data_ptr():#x}")
                self.ws_mask = 15
            key = ("w4a16", self.dev, k, nt, r.groups, x.dtype == torch.bfloat16, wb, alpha is not None,
                   out_dtype == torch.bfloat16, r.tuning)
            kern = _get_kernel(self.dev, key)
            self.launches.append((kern, (t0 * x_rs, t0 * out_rs * 2),
                                  (m, w.stride(0), ws_rs, x_rs, 0, out_rs * 2, kern.op.grid_x(m, sms))))

    def __call__(self, x, w, w_scale, alpha, out, out_dtype):
        # addresses are not in the plan's key: checked on every call (the kernel reads 16-byte rows of x and
        # w and 2-byte scale pairs; a misaligned read would fault and break the CUDA context)
        px, pw, pws = x.data_ptr(), w.data_ptr(), 0 if self.packed else w_scale.data_ptr()
        if (px | pw) & 15 or pws & self.ws_mask:
            bad = [nm for nm, p, mask in (("x", px, 15), ("w", pw, 15), ("w_scale", pws, self.ws_mask)) if p & mask][0]
            if self.packed:
                fail_packed(ValueError, "w_packed" if bad == "w" else bad, "16-byte aligned rows of x and w_packed",
                            f"address {dict(x=px, w=pw)[bad]:#x}")
            fail_gemv(ValueError, bad, f"16-byte aligned rows of x and w, a w_scale address a multiple of "
                      f"{self.ws_mask + 1}", f"address {dict(x=px, w=pw, w_scale=pws)[bad]:#x}")
        if self.dequant:
            if self.packed:
                from .packed import unpack_weight

                w, w_scale = unpack_weight(w)  # prefill: a copy of the weight besides the dequantization's
            return dequant_mm(x, w, w_scale, alpha, out, out_dtype, self.k, self.wb)
        if out is None:
            out = torch.empty(self.out_shape, dtype=out_dtype, device=self.device)
        pout = out.data_ptr()
        pa = alpha.data_ptr() if alpha is not None else 0
        dev_ok = current_device() == self.dev
        stream = current_stream(self.dev)
        for kern, (dx, dout), static in self.launches:
            if kern.ffi is not None and dev_ok:
                kern.ffi(pw, px + dx, pws, 0, pout + dout, pa, *static, stream)
            else:
                with torch.cuda.device(self.dev):
                    kern.launch_dsl((pw, px + dx, pws, 0, pout + dout, pa, *static), stream)
        return out


def dequantized(w, w_scale, k, blocked, dtype):
    """``w * w_scale`` in ``dtype`` (bf16 or fp16: exact, e2m1 x e4m3 has at most 6 significant bits), by
    elementwise torch ops on w's device (no host sync; about 12 bytes of temporaries a weight value)."""
    from .quant import e2m1_decode
    from .reference import unswizzle_scales

    m = w.shape[0]
    s = w_scale.view(torch.float8_e4m3fn)
    if blocked:
        s = unswizzle_scales(s, m, k)
    v = e2m1_decode(w).view(m, k // 16, 16) * s.to(torch.float32).unsqueeze(-1)
    return v.view(m, k).to(dtype)


def dequant_mm(x, w, w_scale, alpha, out, out_dtype, k, blocked):
    """Many tokens (prefill): ``w`` dequantized into x's dtype, then one fp32-output ``torch.mm`` (cuBLAS
    tensor cores, fp32 accumulation in cuBLAS's order: its error bound is cuBLAS's, tested to 2^-12 of the
    sum of |terms|), ``alpha`` (one fp32 rounding) and the rounding to the output dtype. Besides the GEMM it
    costs the dequantization's torch kernels (tens of bytes of memory traffic a weight value; not yet
    measured, nor the 129-token threshold)."""
    wd = dequantized(w, w_scale, k, blocked, x.dtype)
    res = torch.mm(x, wd.T, out_dtype=torch.float32)
    if alpha is not None:
        res = res * alpha.reshape(())
    res = res.to(out_dtype)
    if out is None:
        return res
    out.copy_(res)
    return out


def _key(x, w, w_scale, alpha, out, out_dtype):
    return (x.shape, x.stride(), x.dtype, x.get_device(), w.shape, w.stride(), w.dtype, w.get_device(),
            w_scale.shape, w_scale.stride(), w_scale.dtype, w_scale.get_device(),
            None if alpha is None else (alpha.shape, alpha.dtype, alpha.layout, alpha.get_device()),
            None if out is None else (out.shape, out.stride(), out.dtype, out.get_device()), out_dtype)


def run_cuda(x, w, w_scale, alpha, out, out_dtype, check_args):
    """The W4A16 product on CUDA through a cached plan (``check_args``: the op's validation)."""
    try:
        key = _key(x, w, w_scale, alpha, out, out_dtype)
    except (AttributeError, TypeError, RuntimeError, NotImplementedError):
        key = None
    plan = _plans.get(key) if key is not None else None
    if plan is None:
        dims = check_args(x, None, w, w_scale, alpha, out_dtype, out)
        plan = W4A16Plan(x, w, w_scale, alpha, out, out_dtype, dims)
        if key is not None:
            keep_plan(_plans, key, plan)
    return plan(x, w, w_scale, alpha, out, out_dtype)


def run_cuda_packed(x, w_packed, alpha, out, out_dtype, check_args):
    """The W4A16 product with a packed weight (``packed.pack_weight``) on CUDA through a cached plan
    (``check_args``: ``packed.check_packed_args``)."""
    try:
        # whether the rows start at an 8-row group is in the key: checked (check_packed_weight) on a miss
        key = ("packed", w_packed.storage_offset() % (8 * w_packed.shape[1]) == 0) \
            + _key(x, w_packed, w_packed, alpha, out, out_dtype)
    except (AttributeError, TypeError, RuntimeError, NotImplementedError, IndexError, ZeroDivisionError):
        key = None
    plan = _plans.get(key) if key is not None else None
    if plan is None:
        n, m, k = check_args(x, w_packed, alpha, out_dtype, out)
        plan = W4A16Plan(x, w_packed, None, alpha, out, out_dtype, (n, m, k, False, False), packed=True)
        if key is not None:
            keep_plan(_plans, key, plan)
    return plan(x, w_packed, None, alpha, out, out_dtype)

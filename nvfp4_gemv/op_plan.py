"""The op's host side on CUDA: launch plans for ``gemv`` (NVFP4 x: W4A4; bf16/fp16 x: W4A16) and
``gemv_packed``, and the W4A16 fallback for many tokens.

A plan fixes once what the tensors' metadata decides (kernels, grids, strides, token groups), so that a call
reads only the data pointers and the stream: ``W4A4Plan`` launches ``tokens_bulk``, ``tokens`` or ``mma`` as
``op_route`` picks them, ``W4A16Plan`` the ``w4a16`` builds ``w4a16_route`` picks (or, from
``DEQUANT_MIN_TOKENS`` tokens, ``dequant_mm``). Plans live in one bounded cache (``launch.keep_plan``) keyed by
all the metadata they depend on, the kernels in one compile cache keyed by what changes their code.
Addresses are in no key: every call checks them (a misaligned read would fault and break the CUDA context).
The result is allocated each call (``torch.empty``): a device tensor kept in a plan would be allocated in a
CUDA graph tree's pool where the plan is first made under ``torch.compile(mode="reduce-overhead")``, and stay
alive there untracked (which that mode refuses).
"""

import torch

from . import launch
from .launch import current_device, current_stream
from .mma import compile_mma
from .op_route import route as w4a4_route
from .packed import check_packed_args, fail_packed
from .reference import check_args, fail_gemv, unswizzle_scales
from .tokens import compile_tokens
from .tokens_bulk import compile_tokens_bulk
from .w4a16 import MAX_TOKENS, compile_w4a16
from .w4a16_route import route as w4a16_route

# from this many tokens on, w is dequantized into x's dtype and multiplied by torch.mm (cuBLAS, tensor cores):
# the kernel reads w once a group of 32 tokens, so prefill-sized N would read it N / 32 times
DEQUANT_MIN_TOKENS = 129

_plans = {}  # the tensors' metadata (w4a4_key, w4a16_key) -> plan; bounded by launch.keep_plan

_sm_count = launch.sm_count  # a module name, so that tests can stand in another SM count

# a kernel's key: (name, device index, the compile function's arguments..., tuning items)
_COMPILE = {"mma": compile_mma, "tokens": compile_tokens, "bulk": compile_tokens_bulk, "w4a16": compile_w4a16}
_kernels = launch.KernelCache(lambda key: _COMPILE[key[0]](*key[2:-1], **dict(key[-1])))


def _get_kernel(device_index, key):
    return _kernels.get(device_index, key)


def _out_row_stride(out, n, m):
    """The result's row stride in elements: ``out``'s (checked: unit stride along M, rows apart), else M."""
    if out is None:
        return m
    if out.stride(1) != 1 and m > 1:
        fail_gemv(ValueError, "out", "unit stride along M", f"strides {out.stride()}")
    if n > 1 and out.stride(0) < m:
        fail_gemv(ValueError, "out", f"rows that do not overlap (stride(0) >= {m})", f"strides {out.stride()}")
    return out.stride(0)


# ----------------------------------------------------------------------------------------------------
# W4A4: NVFP4 x
# ----------------------------------------------------------------------------------------------------


class W4A4Plan:
    """gemv's launches for NVFP4 x (``op_route``'s kernel, grid and token groups) for one set of tensor
    metadata; validates the tensors when made (``check_args``)."""

    variants = ()  # (guard, hit): C++ checks of tensor sets with this plan's key (launch.RecentPlans)

    def __init__(self, x, x_scale, w, w_scale, alpha, out, out_dtype, tuning=()):
        n, m, k, xb, wb = check_args(x, x_scale, w, w_scale, alpha, out_dtype, out)
        self.device = w.device
        self.dev = w.device.index
        self.out_shape = (n, m)
        # what the tensors' metadata leaves out: which optional tensors come, the result's dtype without out
        self.signature = (alpha is not None, out is not None, out_dtype)
        for t, name in ((x, "x"), (w, "w")):
            if t.stride(1) != 1 or t.stride(0) % 16 or t.data_ptr() % 16:
                fail_gemv(ValueError, name, "K-contiguous rows (stride(1) == 1) at 16-byte aligned addresses",
                          f"strides {t.stride()} at address {t.data_ptr():#x}")
        for t, name, blocked in ((x_scale, "x_scale", xb), (w_scale, "w_scale", wb)):
            if not blocked and (t.stride(1) != 1 or t.stride(0) % 2 or t.data_ptr() % 2):
                fail_gemv(ValueError, name, "K-contiguous scales (stride(1) == 1) at even addresses", f"strides {t.stride()}")
        out_rs = _out_row_stride(out, n, m)
        sms = _sm_count(self.dev)
        r = w4a4_route(n, m, k, sms, not wb and w_scale.stride(0) % 16 == 0, tuning)
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
        pout, pa = out.data_ptr(), alpha.data_ptr() if alpha is not None else 0
        dev_ok = current_device() == self.dev
        stream = current_stream(self.dev)
        for kern, (dx, dxs, dout), static in self.launches:  # (written out in both plans: every call's path)
            if kern.ffi is not None and dev_ok:
                kern.ffi(pw, px + dx, pws, pxs + dxs, pout + dout, pa, *static, stream)
            else:
                with torch.cuda.device(self.dev):
                    kern.launch_dsl((pw, px + dx, pws, pxs + dxs, pout + dout, pa, *static), stream)
        return out

    @staticmethod
    def hit_tensors(x, x_scale, w, w_scale, alpha, out):
        """A call's tensors in the order ``hit_path`` checks them (what its guard is made of)."""
        return (x, x_scale, w, w_scale) + ((alpha,) if alpha is not None else ()) + ((out,) if out is not None else ())

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
            self.fallback = W4A4Plan(x, x_scale, w, w_scale, alpha, out, out_dtype,
                                     tuning=tuple(sorted({**dict(tuning), "mma": int(mma), "bulk": 0}.items())))
        return self.fallback(x, x_scale, w, w_scale, alpha, out, out_dtype)


def w4a4_key(x, x_scale, w, w_scale, alpha, out, out_dtype):
    """Everything a W4A4 plan depends on; ``get_device()`` is -1 off CUDA, where no plan is ever made."""
    return (x.shape, x.stride(), x.dtype, x.get_device(), x_scale.shape, x_scale.stride(), x_scale.dtype,
            x_scale.get_device(), w.shape, w.stride(), w.dtype, w.get_device(), w_scale.shape, w_scale.stride(),
            w_scale.dtype, w_scale.get_device(),
            None if alpha is None else (alpha.shape, alpha.dtype, alpha.layout, alpha.get_device()),
            None if out is None else (out.shape, out.stride(), out.dtype, out.get_device()), out_dtype)


def run_w4a4(x, x_scale, w, w_scale, alpha, out, out_dtype):
    """gemv's W4A4 product on CUDA through a cached plan (validated when the plan is made)."""
    try:
        key = w4a4_key(x, x_scale, w, w_scale, alpha, out, out_dtype)
    except (AttributeError, TypeError, RuntimeError, NotImplementedError):
        key = None
    plan = _plans.get(key)
    if plan is None:
        if w.device.type != "cuda":
            fail_gemv(ValueError, "w", "a CUDA tensor for the CUDA path", f"a tensor on {w.device}")
        plan = W4A4Plan(x, x_scale, w, w_scale, alpha, out, out_dtype)
        if key is not None:
            launch.keep_plan(_plans, key, plan)
    return plan(x, x_scale, w, w_scale, alpha, out, out_dtype)


# ----------------------------------------------------------------------------------------------------
# W4A16: bf16 or fp16 x (gemv's weight-only form, gemv_packed)
# ----------------------------------------------------------------------------------------------------


class W4A16Plan:
    """The W4A16 launches (``w4a16_route``'s builds, grids and token groups of at most 32) for one set of
    tensor metadata. ``dims`` comes from ``reference.check_args`` (``packed``: ``packed.check_packed_args``)."""

    def __init__(self, x, w, w_scale, alpha, out, out_dtype, dims, tuning=(), packed=False):
        n, m, k, _, wb = dims
        self.dev = w.device.index
        self.out_shape = (n, m)
        self.device = w.device
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
        out_rs = _out_row_stride(out, n, m)
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
            r = w4a16_route(nt, m, k, sms, tuning.items(), packed)
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
            return dequant_mm(x, w, w_scale, alpha, out, out_dtype, self.k, self.wb, self.packed)
        if out is None:
            out = torch.empty(self.out_shape, dtype=out_dtype, device=self.device)
        pout, pa = out.data_ptr(), alpha.data_ptr() if alpha is not None else 0
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
    elementwise torch ops on w's device (no host sync; about 12 bytes of temporaries a weight value, some
    twenty passes over them): the exact definition ``dequant_kernel`` is tested against, and the path off
    CUDA."""
    from .quant import e2m1_decode

    m = w.shape[0]
    s = w_scale.view(torch.float8_e4m3fn)
    if blocked:
        s = unswizzle_scales(s, m, k)
    v = e2m1_decode(w).view(m, k // 16, 16) * s.to(torch.float32).unsqueeze(-1)
    return v.view(m, k).to(dtype)


def dequant_mm(x, w, w_scale, alpha, out, out_dtype, k, blocked, packed=False):
    """Many tokens (prefill): ``w`` dequantized into x's dtype (on CUDA by ``dequant_kernel``, one pass: it
    reads 0.56 and writes 2 bytes a value; ``packed``: ``w`` is ``pack_weight``'s buffer, read in place), then
    one fp32-output ``torch.mm`` (cuBLAS tensor cores, fp32 accumulation in cuBLAS's order: its error bound is
    cuBLAS's, tested to 2^-12 of the sum of |terms|), ``alpha`` (one fp32 rounding) and the rounding to the
    output dtype. The dequantized copy is a temporary of 2 bytes a weight value (235 MB for Llama-3-8B's
    fused gate/up)."""
    if w.is_cuda:
        from .dequant_kernel import dequantize_cuda

        m = w.shape[0]
        if blocked:  # the swizzled layout to plain rows: a copy of the scales (1/16 of the values' count)
            w_scale = unswizzle_scales(w_scale.view(torch.uint8), m, k).contiguous()
        wd = dequantize_cuda(w, w_scale, torch.empty((m, k), dtype=x.dtype, device=w.device), k, packed)
    else:
        if packed:
            from .packed import unpack_weight

            w, w_scale = unpack_weight(w)
        wd = dequantized(w, w_scale, k, blocked, x.dtype)
    res = torch.mm(x, wd.T, out_dtype=torch.float32)
    if alpha is not None:
        res = res * alpha.reshape(())
    res = res.to(out_dtype)
    if out is None:
        return res
    out.copy_(res)
    return out


def w4a16_key(x, w, w_scale, alpha, out, out_dtype):
    """Everything a W4A16 plan depends on (``packed``: ``w_packed`` for both ``w`` and ``w_scale``)."""
    return (x.shape, x.stride(), x.dtype, x.get_device(), w.shape, w.stride(), w.dtype, w.get_device(),
            w_scale.shape, w_scale.stride(), w_scale.dtype, w_scale.get_device(),
            None if alpha is None else (alpha.shape, alpha.dtype, alpha.layout, alpha.get_device()),
            None if out is None else (out.shape, out.stride(), out.dtype, out.get_device()), out_dtype)


def run_w4a16(x, w, w_scale, alpha, out, out_dtype):
    """gemv's W4A16 product on CUDA through a cached plan (validated when the plan is made)."""
    try:
        key = w4a16_key(x, w, w_scale, alpha, out, out_dtype)
    except (AttributeError, TypeError, RuntimeError, NotImplementedError):
        key = None
    plan = _plans.get(key) if key is not None else None
    if plan is None:
        dims = check_args(x, None, w, w_scale, alpha, out_dtype, out)
        plan = W4A16Plan(x, w, w_scale, alpha, out, out_dtype, dims)
        if key is not None:
            launch.keep_plan(_plans, key, plan)
    return plan(x, w, w_scale, alpha, out, out_dtype)


def run_w4a16_packed(x, w_packed, alpha, out, out_dtype):
    """gemv_packed's product (``packed.pack_weight``'s weight) on CUDA through a cached plan (validated by
    ``packed.check_packed_args`` when the plan is made)."""
    try:
        # whether the rows start at an 8-row group is in the key: checked (check_packed_weight) on a miss
        key = ("packed", w_packed.storage_offset() % (8 * w_packed.shape[1]) == 0) \
            + w4a16_key(x, w_packed, w_packed, alpha, out, out_dtype)
    except (AttributeError, TypeError, RuntimeError, NotImplementedError, IndexError, ZeroDivisionError):
        key = None
    plan = _plans.get(key) if key is not None else None
    if plan is None:
        n, m, k = check_packed_args(x, w_packed, alpha, out_dtype, out)
        plan = W4A16Plan(x, w_packed, None, alpha, out, out_dtype, (n, m, k, False, False), packed=True)
        if key is not None:
            launch.keep_plan(_plans, key, plan)
    return plan(x, w_packed, None, alpha, out, out_dtype)

"""The op's contract on any device: argument checks (``check_args``) and the exact result (``gemv_reference``).

``nvfp4_gemv.gemv`` (``op.py``) validates with ``check_args`` before it launches, and runs ``gemv_reference`` where
no CUDA kernel applies (a CPU tensor): exact products of the decoded values, float64 sums, one rounding to the
output dtype. Also the scale layouts the op takes: plain ``[rows, K/16]``, or the 128x4 blocked ("swizzled")
layout of cuBLAS, torchao and flashinfer (``swizzled_scale_shape``, ``unswizzle_scales``).
"""

import functools

import torch

from .launch import MAX_K, fail

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_FP4 = (torch.float4_e2m1fn_x2, torch.uint8)
_FP8 = (torch.float8_e4m3fn, torch.uint8)
OUT_DTYPES = (torch.bfloat16, torch.float16)
fail_gemv = functools.partial(fail, who="nvfp4_gemv.gemv")  # the op's argument errors
ACT_DTYPES = (torch.bfloat16, torch.float16)  # x as it is: the W4A16 form (nvfp4_gemv.w4a16)


def is_activation(x):
    """Whether ``x`` is an unquantized bf16/fp16 activation tensor (the op's W4A16 form)."""
    return isinstance(x, torch.Tensor) and x.dtype in ACT_DTYPES


# ----------------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------------


def swizzled_scale_shape(rows, k):
    """Shape of the 128x4 blocked ("swizzled") scales of a [rows, K] operand as torchao keeps them:
    ``(ceil(rows / 128) * 32, ceil(K / 64) * 16)``; ``to_blocked``'s flat form has as many elements."""
    return (-(-rows // 128) * 32, -(-k // 64) * 16)


def _strided(t, name):
    if t.is_nested or t.layout != torch.strided:
        fail_gemv(TypeError, name, "a dense (strided) tensor", "a nested tensor" if t.is_nested else f"layout {t.layout}")


def _scale_layout(s, name, rows, k):
    """``False`` for plain [rows, K/16] scales, ``True`` for the blocked layout (told apart by shape)."""
    if not isinstance(s, torch.Tensor):
        fail_gemv(TypeError, name, "a torch.Tensor", type(s).__name__)
    _strided(s, name)
    if s.dtype not in _FP8:
        fail_gemv(TypeError, name, "dtype torch.float8_e4m3fn or torch.uint8", s.dtype)
    shape = tuple(s.shape)
    if shape == (rows, k // 16):
        return False
    swz = swizzled_scale_shape(rows, k)
    if shape in (swz, (swz[0] * swz[1],)):
        if not s.is_contiguous():
            fail_gemv(ValueError, name, "contiguous blocked scales", f"strides {s.stride()}")
        return True
    fail_gemv(ValueError, name, f"plain scales of shape {(rows, k // 16)}, or blocked ones of shape {swz} or "
              f"({swz[0] * swz[1]},)", shape)


def check_args(x, x_scale, w, w_scale, alpha, out_dtype, out=None):
    """Validates the op's arguments from metadata only (no device sync).

    :return: ``(n, m, k, x_blocked, w_blocked)``; raises ``TypeError``/``ValueError`` naming the argument.
    """
    act = is_activation(x)
    for t, name in ((x, "x"), (w, "w")):
        if not isinstance(t, torch.Tensor):
            fail_gemv(TypeError, name, "a torch.Tensor", type(t).__name__)
        _strided(t, name)
        if t.dtype not in _FP4 and not (t is x and act):
            fail_gemv(TypeError, name, "dtype torch.float4_e2m1fn_x2 or torch.uint8 (two e2m1 values a byte)"
                      + (", or torch.bfloat16 / torch.float16 activations" if t is x else ""), t.dtype)
        if t.dim() != 2:
            fail_gemv(ValueError, name, "a 2-d tensor [rows, K]" if t is x and act else "a 2-d tensor [rows, K/2]",
                      f"{t.dim()}-d")
    n, k2 = x.shape
    m = w.shape[0]
    if act:  # W4A16: x [N, K] as it is, no scales
        if x_scale is not None:
            fail_gemv(TypeError, "x_scale", f"None for {x.dtype} x (only NVFP4 x has scales)", type(x_scale).__name__)
        if k2 % 2:
            fail_gemv(ValueError, "x", "K (dim 1) a positive multiple of 64", k2)
        k2 //= 2
    elif x_scale is None:
        fail_gemv(TypeError, "x_scale", "[N, K/16] float8_e4m3fn scales for NVFP4 x (None only with bf16/fp16 x)",
                  "None")
    k = 2 * k2
    if n == 0:
        fail_gemv(ValueError, "x", "N (dim 0) >= 1", n)
    if w.shape[1] != k2:
        fail_gemv(ValueError, "w", f"K/2 = {k2} bytes a row, as x has" + (f" ({2 * k2} values)" if act else ""),
                  w.shape[1])
    if m == 0 or m % 128:
        fail_gemv(ValueError, "w", "M (dim 0) a positive multiple of 128", m)
    if k == 0 or k % 64:
        fail_gemv(ValueError, "x", ("K (dim 1)" if act else "K = 2 * dim 1") + " a positive multiple of 64", k)
    if k > MAX_K:
        fail_gemv(ValueError, "x", f"K <= {MAX_K}", k)
    x_blocked = False if act else _scale_layout(x_scale, "x_scale", n, k)
    w_blocked = _scale_layout(w_scale, "w_scale", m, k)
    if out_dtype not in OUT_DTYPES:
        fail_gemv(TypeError, "out_dtype", "torch.bfloat16 or torch.float16", out_dtype)
    dev = w.device
    for t, name in ((x, "x"), (x_scale, "x_scale"), (w_scale, "w_scale")):
        if t is not None and t.device != dev:
            fail_gemv(ValueError, name, f"a tensor on {dev} (where 'w' is)", f"a tensor on {t.device}")
    if alpha is not None:
        if not isinstance(alpha, torch.Tensor):
            fail_gemv(TypeError, "alpha", "None or a one-element torch.float32 tensor", type(alpha).__name__)
        _strided(alpha, "alpha")
        if alpha.dtype != torch.float32 or alpha.numel() != 1 or alpha.dim() > 1:
            fail_gemv(TypeError, "alpha", "a one-element torch.float32 tensor of 0 or 1 dimensions",
                      f"{alpha.dtype} of shape {tuple(alpha.shape)}")
        if alpha.device != dev:
            fail_gemv(ValueError, "alpha", f"a tensor on {dev} (where 'w' is), read there without a sync",
                      f"a tensor on {alpha.device}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            fail_gemv(TypeError, "out", "a torch.Tensor", type(out).__name__)
        _strided(out, "out")
        if out.dtype != out_dtype or tuple(out.shape) != (n, m):
            fail_gemv(ValueError, "out", f"a [{n}, {m}] {out_dtype} tensor", f"{tuple(out.shape)} {out.dtype}")
        if out.device != dev:
            fail_gemv(ValueError, "out", f"a tensor on {dev} (where 'w' is)", f"a tensor on {out.device}")
    return n, m, k, x_blocked, w_blocked


# ----------------------------------------------------------------------------------------------------
# Exact implementation (any device)
# ----------------------------------------------------------------------------------------------------


def _decode(q):
    u = q.view(torch.uint8)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=u.device)
    return torch.stack((table[(u & 0xF).long()], table[(u >> 4).long()]), dim=-1).reshape(u.shape[0], -1)


def unswizzle_scales(s, rows, k):
    """Plain [rows, K/16] scales from the 128x4 blocked layout (either of its shapes)."""
    r128, c4 = -(-rows // 128), -(-(k // 16) // 4)
    blocks = s.reshape(r128, c4, 32, 4, 4).permute(0, 3, 2, 1, 4)  # (tile r, group 4, row 32, tile c, col 4)
    return blocks.reshape(r128 * 128, c4 * 4)[:rows, : k // 16]


def _scales64(s, rows, k, blocked):
    s = s.view(torch.float8_e4m3fn)
    if blocked:
        s = unswizzle_scales(s, rows, k)
    return s.to(torch.float64).repeat_interleave(16, dim=1)


def round_to(v, dtype):
    """float64 ``v`` rounded once to ``dtype`` (bf16 or fp16). torch's cast goes through fp32, rounding
    twice (8880127.6 -> bf16 gives 8912896, not 8847360); rounding to fp32 by round-to-odd first makes
    the second rounding the only one (fp32 carries more than two extra bits over either)."""
    f = v.to(torch.float32)
    back = f.to(torch.float64)
    inexact = back != v
    toward_zero = inexact & (back.abs() > v.abs())  # round-to-nearest went away from zero: step back
    bits = f.view(torch.int32)
    bits = torch.where(toward_zero & f.isfinite(), bits - 1, bits)  # magnitude one ulp down, same sign
    bits = torch.where(inexact & f.isfinite(), bits | 1, bits)  # sticky bit: odd
    return bits.view(torch.float32).to(dtype)


def gemv_reference(x, x_scale, w, w_scale, alpha=None, out_dtype=torch.bfloat16):
    """The result from float64 sums of the decoded, scaled values (each product is exact; a sum rounds
    at most by 2^-53 of its running value), times ``alpha``, rounded once to ``out_dtype``. For bf16/fp16
    ``x`` (W4A16, ``x_scale`` None) the values of ``x`` as they are."""
    return reference_product(check_args(x, x_scale, w, w_scale, alpha, out_dtype), x, x_scale, w, w_scale, alpha,
                             out_dtype)


def reference_product(dims, x, x_scale, w, w_scale, alpha, out_dtype):
    """``gemv_reference`` of arguments ``check_args`` has passed (``dims``: what it returned)."""
    n, m, k, xb, wb = dims
    wv = _decode(w) * _scales64(w_scale, m, k, wb)
    xv = x.to(torch.float64) if x_scale is None else _decode(x) * _scales64(x_scale, n, k, xb)
    res = xv @ wv.T
    if alpha is not None:
        res = res * alpha.reshape(()).to(torch.float64)
    return round_to(res, out_dtype)

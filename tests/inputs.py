"""Inputs that exercise what the official generator does not: both nibbles, negative values, scales over
many binades (subnormal e4m3 included), and layouts the kernel must honour."""

import math

import torch

import reference
from utils import make_match_reference

_match_exact = make_match_reference(reference.portable_ref_kernel, rtol=1e-03, atol=1e-03)


def random_scales(shape, generator, device, min_exp=1, max_exp=9, signed=True):
    """e4m3fn bytes with exponent field in [min_exp, max_exp] (0 = subnormal), random mantissa and sign;
    never NaN (0x7F / 0xFF)."""
    e = torch.randint(min_exp, max_exp + 1, shape, generator=generator)
    mant = torch.randint(0, 8, shape, generator=generator)
    mant = torch.where(e == 15, mant.clamp(max=6), mant)  # 0x7F is NaN
    sign = torch.randint(0, 2, shape, generator=generator) if signed else torch.zeros(shape, dtype=torch.long)
    byte = (sign << 7) | (e << 3) | mant
    return byte.to(torch.uint8).view(torch.float8_e4m3fn).to(device)


def random_inputs(m, k, l, seed, device="cuda", min_exp=1, max_exp=9):
    """Random signed NVFP4 data in the generator's layouts (permuted scales consistent with plain ones)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, 256, (l, m, k // 2), generator=g, dtype=torch.uint8).permute(1, 2, 0)
    b = torch.randint(0, 256, (l, 128, k // 2), generator=g, dtype=torch.uint8).permute(1, 2, 0)
    sfk = k // 16
    sfa = random_scales((l, m, sfk), g, "cpu", min_exp, max_exp).permute(1, 2, 0)
    sfb = random_scales((l, 128, sfk), g, "cpu", min_exp, max_exp).permute(1, 2, 0)
    c = torch.full((l, m, 1), float("nan"), dtype=torch.float16).permute(1, 2, 0)
    data = [a.view(torch.float4_e2m1fn_x2), b.view(torch.float4_e2m1fn_x2), sfa, sfb,
            permute_scales(sfa), permute_scales(sfb), c]
    return tuple(t.to(device) for t in data)


def permute_scales(sf):
    """[mn, sf_k, l] -> [32, 4, mn/128, 4, sf_k/4, l] with the generator's memory layout."""
    mn, sfk, l = sf.shape
    out = torch.empty((l, mn // 128, sfk // 4, 32, 4, 4), dtype=torch.uint8, device=sf.device)
    out = out.permute(3, 4, 1, 5, 2, 0)
    u = sf.view(torch.uint8)
    out.copy_(u.reshape(mn // 128, 4, 32, sfk // 4, 4, l).permute(2, 1, 0, 4, 3, 5))
    return out.view(torch.float8_e4m3fn)


def expected(data):
    """float64 reference result for ``data`` (written into a copy of c)."""
    return reference.portable_ref_kernel((*data[:6], data[6].clone()))


def misaligned(t, offset):
    """A copy of ``t`` with the same shape, strides, dtype and device, ``offset`` bytes past an aligned
    address."""
    u = t.view(torch.uint8)
    buf = torch.zeros(u.untyped_storage().nbytes() + 64, dtype=torch.uint8, device=t.device)
    out = buf[offset:].as_strided(u.shape, u.stride())
    out.copy_(u)
    return out.view(t.dtype)


def poisoned(data):
    """``data`` with ``c`` replaced by a NaN-filled copy, so an unwritten element cannot pass."""
    c = torch.full_like(data[6], float("nan"))
    return (*data[:6], c)


def cancelling_inputs(m, k, l, seed, device="cuda"):
    """Rows whose second half is the exact negative of the first (all scales 448; ``b`` the same in both
    halves), but for one byte in a mirrored pair of ``a`` blocks whose scale is the smallest e4m3, 2^-9:
    the result is at most 144 * 448 / 512 while the running sum of the first half reaches ~1e9, where
    fp32 rounds to tens. A plain fp32 sum misses the tolerance, and so did the fp32 Kahan sums the kernels
    had (217-491 of 512 rows wrong: a compensation is only exact while the sum outweighs the term); fp64
    sums keep every row."""
    g = torch.Generator().manual_seed(seed)
    half = k // 4  # bytes in half a row
    a1 = torch.randint(0, 256, (l, m, half), generator=g, dtype=torch.uint8) & 0x77  # positive values
    a2 = a1 | 0x88  # the same magnitudes, negative
    j = torch.randint(0, half, (l, m), generator=g)  # the byte that does not cancel
    lm = torch.arange(l).view(l, 1), torch.arange(m).view(1, m)
    a2[lm[0], lm[1], j] = torch.randint(0, 256, (l, m), generator=g, dtype=torch.uint8)
    b1 = torch.randint(0, 256, (l, 128, half), generator=g, dtype=torch.uint8) & 0x77
    big, tiny = 0x7E, 0x01  # e4m3fn 448 and 2^-9
    sfa = torch.full((l, m, k // 16), big, dtype=torch.uint8)
    blk = j // 8  # the scale block of byte j, in both halves
    sfa[lm[0], lm[1], blk] = tiny
    sfa[lm[0], lm[1], blk + k // 32] = tiny
    sfb = torch.full((l, 128, k // 16), big, dtype=torch.uint8)
    a = torch.cat([a1, a2], dim=2).permute(1, 2, 0)
    b = torch.cat([b1, b1], dim=2).permute(1, 2, 0)
    sfa = sfa.permute(1, 2, 0).view(torch.float8_e4m3fn)
    sfb = sfb.permute(1, 2, 0).view(torch.float8_e4m3fn)
    c = torch.full((l, m, 1), float("nan"), dtype=torch.float16).permute(1, 2, 0)
    data = [a.view(torch.float4_e2m1fn_x2), b.view(torch.float4_e2m1fn_x2), sfa, sfb,
            permute_scales(sfa), permute_scales(sfb), c]
    return tuple(t.to(device) for t in data)


# ------------------------------------------------------------------------------------- the op (gemv)


def op_inputs(n, m, k, seed, device="cuda", min_exp=2, max_exp=10, alpha=True):
    """Random signed operands of ``nvfp4_gemv.gemv``: both nibbles, scales of either sign over
    2^-5..2^3 (exponent fields ``min_exp``..``max_exp``), alpha != 1. Returns ``(x, x_scale, w, w_scale,
    alpha)`` in the torch dtypes (fp4x2, e4m3, fp32)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    w = torch.randint(0, 256, (m, k // 2), generator=g, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    xs = random_scales((n, k // 16), g, "cpu", min_exp, max_exp)
    ws = random_scales((m, k // 16), g, "cpu", min_exp, max_exp)
    a = (0.5 + torch.rand(1, generator=g, dtype=torch.float32)) if alpha else None
    return tuple(t.to(device) if t is not None else None for t in (x, xs, w, ws, a))


def blocked_scales(s, rows, k, flat=False):
    """[rows, K/16] scales in the 128x4 blocked layout (the reference's ``to_blocked`` of the padded
    matrix), shaped as torchao keeps them, or ``flat``."""
    from nvfp4_gemv import swizzled_scale_shape

    padded = torch.zeros(-(-rows // 128) * 128, -(-(k // 16) // 4) * 4, dtype=torch.uint8, device=s.device)
    padded[:rows, : k // 16] = s.view(torch.uint8)
    out = reference.to_blocked(padded).view(torch.float8_e4m3fn)
    return out if flat else out.view(swizzled_scale_shape(rows, k))


def op_exact(x, xs, w, ws, alpha):
    """``(result, sum of |terms|)`` in float64 for plain scales, from the reference's decoder: decoded
    values times scales, products summed in float64 (on the CPU)."""
    def deq(q, s):
        v = reference.decode_fp4(q.view(torch.uint8).cpu().unsqueeze(-1).view(torch.float4_e2m1fn_x2))[..., 0]
        return v * s.view(torch.float8_e4m3fn).cpu().to(torch.float64).repeat_interleave(16, dim=1)

    xv, wv = deq(x, xs), deq(w, ws)
    a = 1.0 if alpha is None else float(alpha.item())
    return (xv @ wv.T) * a, (xv.abs() @ wv.abs().T) * abs(a)


def rounding_violations(out, exact, slack):
    """Elements of ``out`` farther from ``exact`` (float64) than half an ulp of ``out``'s dtype at the
    exact value plus ``slack``; NaN must stay NaN, and beyond the dtype's largest value plus half an ulp
    the correctly rounded result is +-inf. Returns ``(count, message)``."""
    fi = torch.finfo(out.dtype)
    mag = exact.abs().clamp(min=fi.smallest_normal)
    half_ulp = 0.5 * fi.eps * torch.exp2(torch.floor(torch.log2(mag)))
    half_ulp = half_ulp.clamp(min=0.5 * fi.smallest_normal * fi.eps)
    got = out.cpu().to(torch.float64).reshape(exact.shape)
    tol = half_ulp + slack
    bad = ~((got - exact).abs() <= tol)
    overflow_at = fi.max + 0.5 * fi.eps * 2.0 ** math.floor(math.log2(fi.max))
    bad &= ~(got.isinf() & (got.sign() == exact.sign()) & (exact.abs() + tol >= overflow_at))
    bad &= ~(got.isnan() & exact.isnan())
    if not bad.any():
        return 0, "ok"
    i = tuple(bad.nonzero()[0].tolist())
    return int(bad.sum()), (f"{int(bad.sum())} of {bad.numel()} outside the bound; first at {list(i)}: got "
                            f"{got[i].item()!r}, exact {exact[i].item()!r}, bound {tol[i].item():.3g}")


def op_violations(out, exact, terms):
    """The op's accuracy contract: half an ulp of ``out``'s dtype plus 2^-14 of the sum of |terms|."""
    return rounding_violations(out, exact, terms * 2.0 ** -14)


# ------------------------------------------------------------------ checks of custom_kernel's output


def exact_and_terms(data):
    """``(exact, sum of |terms|)``, float64 [M, L] on the CPU, for a 7-tuple with plain scales."""
    a, b, sfa, sfb = (t.cpu() for t in data[:4])
    m, _, l = a.shape
    exact = torch.empty(m, l, dtype=torch.float64)
    terms = torch.empty(m, l, dtype=torch.float64)
    for i in range(l):
        av = reference.decode_fp4(a[:, :, i : i + 1])[:, :, 0] * sfa[:, :, i].double().repeat_interleave(16, dim=1)
        bv = reference.decode_fp4(b[0:1, :, i : i + 1])[0, :, 0] * sfb[0, :, i].double().repeat_interleave(16)
        exact[:, i] = av @ bv
        terms[:, i] = av.abs() @ bv.abs()
    return exact, terms


def check_exact(data, out):
    """The official check (rtol = atol = 1e-3) against the exact float64 reference on every GPU: unlike
    ``reference.check_implementation``, never ``_scaled_mm`` (on sm_100 that is what ``custom_kernel``
    itself runs for L = 1, and it sums in fp32)."""
    return _match_exact((*data[:6], data[6].clone()), out)


def check_tight(data, out):
    """README's accuracy claim: the float64 result rounded to fp16, within half an fp16 ulp plus the
    fp64 sum's rounding (at most K/16 additions at 2^-53 of the sum of |terms|: 2^-40 of it covers K up
    to 2^17) and the fp64 -> fp32 -> fp16 double rounding (2^-24 of the result). One fp16 step off
    fails it; ``check_exact``'s 1e-3 does not notice."""
    exact, terms = exact_and_terms(data)
    return rounding_violations(out[:, 0, :], exact, terms * 2.0 ** -40 + exact.abs().nan_to_num(0) * 2.0 ** -24)


def padded(data, a_pad, sfa_pad):
    """``data`` with rows of ``a`` and ``sfa`` padded by the given bytes (views into larger buffers)."""
    a, b, sfa = data[0], data[1], data[2]
    m, k2, l = a.shape
    pa = torch.zeros(l, m, k2 + a_pad, dtype=torch.uint8, device="cuda")
    pa[:, :, :k2] = a.view(torch.uint8).permute(2, 0, 1)
    ps = torch.zeros(l, m, sfa.shape[1] + sfa_pad, dtype=torch.uint8, device="cuda")
    ps[:, :, :sfa.shape[1]] = sfa.view(torch.uint8).permute(2, 0, 1)
    return (pa[:, :, :k2].permute(1, 2, 0).view(torch.float4_e2m1fn_x2), b,
            ps[:, :, :sfa.shape[1]].permute(1, 2, 0).view(torch.float8_e4m3fn), *data[3:])


def interleaved(data):
    """``data`` with each row's scales stored right after its row of ``a`` in one buffer ([L, M, K/2 + K/16]
    bytes; ``a`` and ``sfa`` are views into it with row stride K/2 + K/16): the layout where a row and its
    scales share DRAM pages. Same values, so the same result."""
    a, b, sfa = data[0], data[1], data[2]
    m, k2, l = a.shape
    sfk = sfa.shape[1]
    buf = torch.zeros(l, m, k2 + sfk, dtype=torch.uint8, device=a.device)
    buf[:, :, :k2] = a.view(torch.uint8).permute(2, 0, 1)
    buf[:, :, k2:] = sfa.view(torch.uint8).permute(2, 0, 1)
    return (buf[:, :, :k2].permute(1, 2, 0).view(torch.float4_e2m1fn_x2), b,
            buf[:, :, k2:].permute(1, 2, 0).view(torch.float8_e4m3fn), *data[3:])

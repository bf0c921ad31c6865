"""Operands of the W4A16 op (bf16/fp16 x times NVFP4 w) and their float64 result, for tests and tools."""

import torch

import inputs


def w4a16_inputs(n, m, k, seed, dtype=torch.bfloat16, device="cuda", blocked=False, alpha=True, cancel=False,
                 min_exp=0, max_exp=15):
    """Random signed operands: x ~ N(0, 1) times 2^e per token (e in -8..8), both nibbles of w, e4m3 scales
    of either sign over the exponent fields ``min_exp``..``max_exp`` (0: subnormal scales; never NaN),
    alpha != 1. ``cancel``: the second half of each row of w is the first half negated and x's halves are
    equal, plus one small term, so that the sums cancel to a remainder far below their sum of |terms|.
    Returns ``(x, None, w, w_scale, alpha)``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-8, 9, (n, 1), generator=g).float())
    w = torch.randint(0, 256, (m, k // 2), generator=g, dtype=torch.uint8)
    ws = inputs.random_scales((m, k // 16), g, "cpu", min_exp, max_exp)
    if cancel:
        h = k // 2
        x[:, h:] = x[:, :h]
        w[:, h // 2:] = w[:, : h // 2] ^ 0x88  # each value's sign flipped
        ws[:, h // 16:] = ws[:, : h // 16]
        x[:, 0] *= 1.0078125  # the remainder: one term's 2^-7
    x = x.to(dtype)
    if blocked:
        ws = inputs.blocked_scales(ws, m, k)
    a = (0.5 + torch.rand(1, generator=g, dtype=torch.float32)) if alpha else None
    return tuple(t.to(device) if t is not None else None for t in (x, None, w, ws, a))


def w4a16_exact(x, w, ws, alpha, blocked=False):
    """``(result, sum of |terms|)`` in float64 on the CPU."""
    from nvfp4_gemv.reference import E2M1_VALUES, unswizzle_scales

    m, k = w.shape[0], x.shape[1]
    t = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    u = w.view(torch.uint8).cpu()
    s = ws.view(torch.float8_e4m3fn).cpu()
    if blocked:
        s = unswizzle_scales(s, m, k)
    wv = torch.stack((t[(u & 15).long()], t[(u >> 4).long()]), -1).reshape(m, k)
    wv = wv * s.to(torch.float64).repeat_interleave(16, 1)
    xv = x.cpu().to(torch.float64)
    a = 1.0 if alpha is None else float(alpha.item())
    return (xv @ wv.T) * a, (xv.abs() @ wv.abs().T) * abs(a)


def w4a16_violations(out, exact, terms, slack=2.0 ** -13):
    """Half an ulp of ``out``'s dtype plus ``slack`` of the sum of |terms| (the kernel's bound, 2^-13.9 at K = 32768)."""
    return inputs.rounding_violations(out, exact, terms * slack)

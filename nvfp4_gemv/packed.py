"""The packed weight layout of the W4A16 kernel: an NVFP4 weight and its scales in one buffer, in the order
the kernel reads them.

``pack_weight(w, w_scale)`` takes ModelOpt's pair (``w`` uint8 [M, K/2], two e2m1 codes a byte, the first in
the low nibble; ``w_scale`` float8_e4m3fn [M, K/16], plain) and returns one uint8 tensor [M, 9K/16]: for each
group of 8 rows and each slice of 128 values (64 bytes of a row, its 8 scale bytes), 576 bytes, the 8 rows'
64 bytes of ``w`` one after another, then their 8 scale bytes one after another; groups, and within a group
slices, follow each other. A row of the result is not one row of the weight: only whole groups of 8 rows
mean something, and rows ``8i .. 8j`` of a packed weight are the packed rows ``8i .. 8j`` of the weight (so a
fused group's row slices stay valid). ``unpack_weight`` inverts it exactly.

Why: the W4A16 kernel's warp reads, for each group and slice, 16 bytes of ``w`` a lane from 8 rows and 2 scale
bytes a lane from 8 more places; packed, that is one piece of 576 bytes, measured faster at every bench
shape and token count on H200 (docs/results.md, "W4A16").

Constraints: M % 128 == 0 (the op's), K % 128 == 0 (whole slices; the op takes K % 64 == 0 unpacked),
K <= 32768.
"""

import functools

import torch

from .launch import MAX_K, fail
from .reference import ACT_DTYPES, OUT_DTYPES

_fail_pack = functools.partial(fail, who="nvfp4_gemv.pack_weight")
fail_packed = functools.partial(fail, who="nvfp4_gemv.gemv_packed")

GROUP_ROWS = 8
SLICE = 128  # values of K a piece holds
PIECE = GROUP_ROWS * (SLICE // 2 + SLICE // 16)  # 576 bytes: 512 of w, 64 of scales


def packed_takes(in_features, out_features):
    """Whether a weight of this shape (out x in) can be packed and run packed."""
    return (in_features > 0 and in_features % SLICE == 0 and in_features <= MAX_K and out_features > 0
            and out_features % 128 == 0)


def packed_k(w_packed):
    """K of a packed weight [M, 9K/16] (its second dimension times 16 / 9)."""
    return w_packed.shape[1] * 16 // 9


def pack_weight(w, w_scale):
    """``w`` uint8 [M, K/2] (or float4_e2m1fn_x2) and plain ``w_scale`` float8_e4m3fn [M, K/16] (or uint8
    bytes) as one packed uint8 tensor [M, 9K/16] on their device (module docstring). Exact (a permutation of
    bytes); torch ops, no sync."""
    if not isinstance(w, torch.Tensor) or not isinstance(w_scale, torch.Tensor):
        bad = "w" if not isinstance(w, torch.Tensor) else "w_scale"
        _fail_pack(TypeError, bad, "a torch.Tensor", type(w if bad == "w" else w_scale).__name__)
    if w.dtype not in (torch.uint8, torch.float4_e2m1fn_x2) or w.dim() != 2:
        _fail_pack(TypeError, "w", "a 2-d uint8 (or float4_e2m1fn_x2) tensor [M, K/2]", f"{w.dtype} {tuple(w.shape)}")
    m, k = w.shape[0], 2 * w.shape[1]
    if not packed_takes(k, m):
        _fail_pack(ValueError, "w", f"M % 128 == 0 and K % {SLICE} == 0, K <= {MAX_K} to be packed",
                  f"M={m}, K={k}")
    if w_scale.dtype not in (torch.float8_e4m3fn, torch.uint8) or tuple(w_scale.shape) != (m, k // 16):
        _fail_pack(ValueError, "w_scale", f"plain float8_e4m3fn scales of shape {(m, k // 16)}",
                  f"{w_scale.dtype} {tuple(w_scale.shape)}")
    if w_scale.device != w.device:
        _fail_pack(ValueError, "w_scale", f"a tensor on {w.device} (where 'w' is)", f"a tensor on {w_scale.device}")
    s = k // SLICE
    wq = w.view(torch.uint8).reshape(m // GROUP_ROWS, GROUP_ROWS, s, SLICE // 2).permute(0, 2, 1, 3)
    sc = w_scale.view(torch.uint8).reshape(m // GROUP_ROWS, GROUP_ROWS, s, SLICE // 16).permute(0, 2, 1, 3)
    out = torch.empty(m // GROUP_ROWS, s, PIECE, dtype=torch.uint8, device=w.device)
    out[:, :, :512].view(m // GROUP_ROWS, s, GROUP_ROWS, SLICE // 2).copy_(wq)
    out[:, :, 512:].view(m // GROUP_ROWS, s, GROUP_ROWS, SLICE // 16).copy_(sc)
    return out.view(m, 9 * k // 16)


def unpack_weight(w_packed):
    """The inverse of ``pack_weight``: ``(w uint8 [M, K/2], w_scale float8_e4m3fn [M, K/16])``, new
    contiguous tensors on w_packed's device."""
    check_packed_weight(w_packed)
    m, k = w_packed.shape[0], packed_k(w_packed)
    s = k // SLICE
    p = w_packed.reshape(m // GROUP_ROWS, s, PIECE)
    w = p[:, :, :512].reshape(m // GROUP_ROWS, s, GROUP_ROWS, SLICE // 2).permute(0, 2, 1, 3).reshape(m, k // 2)
    sc = p[:, :, 512:].reshape(m // GROUP_ROWS, s, GROUP_ROWS, SLICE // 16).permute(0, 2, 1, 3).reshape(m, k // 16)
    return w.contiguous(), sc.contiguous().view(torch.float8_e4m3fn)


def check_packed_weight(w_packed, name="w_packed"):
    """Validates a packed weight's metadata; returns ``(M, K)``."""
    if not isinstance(w_packed, torch.Tensor):
        fail_packed(TypeError, name, "a torch.Tensor (pack_weight's output)", type(w_packed).__name__)
    _dense(w_packed, name)
    if w_packed.dtype != torch.uint8 or w_packed.dim() != 2:
        fail_packed(TypeError, name, "a 2-d uint8 tensor [M, 9K/16] (pack_weight's output)",
                    f"{w_packed.dtype} {tuple(w_packed.shape)}")
    m, c = w_packed.shape
    k = c * 16 // 9
    if c % 9 or not packed_takes(k, m):
        fail_packed(ValueError, name, f"shape [M, 9K/16] with M % 128 == 0, K % {SLICE} == 0, K <= {MAX_K}",
                    tuple(w_packed.shape))
    # whole rows of pack_weight's output from an 8-row group on (a view starting mid-group reads other rows)
    if w_packed.stride() != (c, 1) or w_packed.storage_offset() % (GROUP_ROWS * c):
        fail_packed(ValueError, name, "contiguous rows of pack_weight's output starting at a multiple of 8 rows",
                    f"strides {w_packed.stride()}, storage offset {w_packed.storage_offset()}")
    return m, k


def check_packed_args(x, w_packed, alpha, out_dtype, out=None):
    """Validates ``gemv_packed``'s arguments from metadata only (no sync); returns ``(N, M, K)``."""
    if not isinstance(x, torch.Tensor):
        fail_packed(TypeError, "x", "a torch.Tensor", type(x).__name__)
    _dense(x, "x")
    if x.dtype not in ACT_DTYPES or x.dim() != 2:
        fail_packed(TypeError, "x", "a 2-d torch.bfloat16 or torch.float16 tensor [N, K]",
                    f"{x.dtype} {tuple(x.shape)}")
    m, k = check_packed_weight(w_packed)
    n = x.shape[0]
    if x.shape[1] != k:
        fail_packed(ValueError, "x", f"K = {k} values a row, as w_packed holds", x.shape[1])
    if n == 0:
        fail_packed(ValueError, "x", "N (dim 0) >= 1", n)
    dev = w_packed.device
    if x.device != dev:
        fail_packed(ValueError, "x", f"a tensor on {dev} (where 'w_packed' is)", f"a tensor on {x.device}")
    if out_dtype not in OUT_DTYPES:
        fail_packed(TypeError, "out_dtype", "torch.bfloat16 or torch.float16", out_dtype)
    if alpha is not None:
        if not isinstance(alpha, torch.Tensor):
            fail_packed(TypeError, "alpha", "None or a one-element torch.float32 tensor", type(alpha).__name__)
        _dense(alpha, "alpha")
        if alpha.dtype != torch.float32 or alpha.numel() != 1 or alpha.dim() > 1:
            fail_packed(TypeError, "alpha", "a one-element torch.float32 tensor of 0 or 1 dimensions",
                         f"{alpha.dtype} of shape {tuple(alpha.shape)}")
        if alpha.device != dev:
            fail_packed(ValueError, "alpha", f"a tensor on {dev} (where 'w_packed' is), read there without a sync",
                         f"a tensor on {alpha.device}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            fail_packed(TypeError, "out", "a torch.Tensor", type(out).__name__)
        _dense(out, "out")
        if out.dtype != out_dtype or tuple(out.shape) != (n, m):
            fail_packed(ValueError, "out", f"a [{n}, {m}] {out_dtype} tensor", f"{tuple(out.shape)} {out.dtype}")
        if out.device != dev:
            fail_packed(ValueError, "out", f"a tensor on {dev} (where 'w_packed' is)", f"a tensor on {out.device}")
    return n, m, k


def _dense(t, name):
    if t.is_nested or t.layout != torch.strided:
        fail_packed(TypeError, name, "a dense (strided) tensor",
                    "a nested tensor" if t.is_nested else f"layout {t.layout}")

"""NVFP4 quantization: ``quantize`` for activations (the op ``torch.ops.nvfp4.quantize``), its exact
reference ``quantize_reference``, and ``quantize_weight``, NVIDIA's recipe for a checkpoint's weights.

The activation semantics are fixed here so that a GPU kernel can match them bit for bit. For x [R, K]
(bf16 or fp16, K % 16 == 0) and a global scale ``gs`` (a one-element fp32 tensor), every step one IEEE
fp32 operation rounded to nearest even, in this order, for each block of 16 values along K:

1. ``amax = max |x|`` over the block (exact in fp32);
2. ``s = e4m3((amax * gs) / 6.0)``: an fp32 product, then an fp32 division by 6.0, then the e4m3 value
   nearest to it (ties to an even mantissa), saturating at 448 (``satfinite``). A block whose
   ``(amax * gs) / 6`` is NaN (a NaN in x, or ``gs`` NaN) gets the scale byte 0x7F (NaN);
3. ``sd = float(s)``;
4. each value ``q = (x * gs) / sd``: an fp32 product, then an fp32 division; where ``sd == 0`` the block's
   values are 0;
5. the code: the e2m1 magnitude nearest to ``|q|`` in {0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to the even
   code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), saturating above 6 (inf
   included) to 6; a NaN ``q`` (only in a block whose scale is NaN) gets magnitude code 0. The sign bit
   (0x8) is x's sign bit, so -0.0 and negatives that round to 0 give 0x8;
6. two codes a byte along K, the first in the low nibble.

``gs`` is meant to be positive and finite (1 / ModelOpt's ``input_scale``); it is read on the device
only, never on the host.

``quantize_dequantized(x, gs)`` is the same quantization with the values the codes stand for as its
output, ``e2m1(code) * s`` in x's dtype (exact there: at most 6 significant bits, between 2^-10 and 2688),
i.e. ``dequantize(*quantize(x, gs))``, which is ``x * gs`` on the NVFP4 grid: what the W4A4 product
multiplies as ``x * x_scale``. ``NVFP4Linear``'s mode "w4a4" hands it to the W4A16 op where that reads the
weight fewer times than the W4A4 op would (``linear.W4A4_VIA_W4A16_FROM``).
"""


import torch

from .launch import warn_once
from .library import eager, fast_autograd, through_library

E2M1_MAX = 6.0
E4M3_MAX = 448.0
BLOCK = 16

# |q| thresholds between neighbouring e2m1 magnitudes: the code is the number of thresholds |q| passes.
# At a tie the even code wins: the step up to an even code is taken at the midpoint (>=), the step up to
# an odd code only above it (>).
_UP_AT_TIE = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))

_DTYPES = (torch.bfloat16, torch.float16)


def _fail(exc, fn, name, expected, got):
    raise exc(f"nvfp4_gemv.{fn}: argument '{name}': expected {expected}, got {got}")


def check_quantize_args(x, global_scale, fn="quantize"):
    """Validates ``quantize``'s arguments from metadata only (no device sync). :return: ``(rows, k)``."""
    if not isinstance(x, torch.Tensor):
        _fail(TypeError, fn, "x", "a torch.Tensor", type(x).__name__)
    if x.is_nested or x.layout != torch.strided:
        _fail(TypeError, fn, "x", "a dense (strided) tensor", "a nested tensor" if x.is_nested else f"layout {x.layout}")
    if x.dtype not in _DTYPES:
        _fail(TypeError, fn, "x", "dtype torch.bfloat16 or torch.float16", x.dtype)
    if x.dim() != 2:
        _fail(ValueError, fn, "x", "a 2-d tensor [rows, K]", f"{x.dim()}-d")
    rows, k = x.shape
    if k == 0 or k % BLOCK:
        _fail(ValueError, fn, "x", f"K (dim 1) a positive multiple of {BLOCK}", k)
    if not isinstance(global_scale, torch.Tensor):
        _fail(TypeError, fn, "global_scale", "a one-element torch.float32 tensor", type(global_scale).__name__)
    if global_scale.is_nested or global_scale.layout != torch.strided:
        _fail(TypeError, fn, "global_scale", "a dense (strided) tensor", f"layout {global_scale.layout}")
    if global_scale.dtype != torch.float32 or global_scale.numel() != 1 or global_scale.dim() > 1:
        _fail(TypeError, fn, "global_scale", "a one-element torch.float32 tensor of 0 or 1 dimensions",
              f"{global_scale.dtype} of shape {tuple(global_scale.shape)}")
    if global_scale.device != x.device:
        _fail(ValueError, fn, "global_scale", f"a tensor on {x.device} (where 'x' is), read there without a sync",
              f"a tensor on {global_scale.device}")
    return rows, k


# ----------------------------------------------------------------------------------------------------
# Exact building blocks (vectorized torch; any device)
# ----------------------------------------------------------------------------------------------------
# Divisions divide by tensors on the operands' device, never by a Python number: torch's CUDA division by
# a CPU scalar multiplies by its reciprocal, which is not the IEEE quotient.


def _e4m3_bytes(v):
    """fp32 ``v`` -> the e4m3 (fn) bytes nearest to it, ties to even, saturating at +-448; NaN -> 0x7F.
    torch's cast rounds to nearest even; the clamp makes the saturation explicit (casts of values from 464
    on have given NaN in some torch versions)."""
    s = v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(v.isnan(), torch.full_like(s, 0x7F), s)


def _e2m1_codes(q, negative):
    """Codes (uint8, 0..15) of fp32 ``q``'s magnitude, ties to even, saturating; sign bit from ``negative``."""
    a = q.abs()
    code = torch.zeros(q.shape, dtype=torch.uint8, device=q.device)
    for t, up_at_tie in _UP_AT_TIE:  # 7 comparisons of the whole tensor, not a loop per value
        code += (a >= t) if up_at_tie else (a > t)
    return code | (negative.to(torch.uint8) << 3)


def _pack(codes):
    """[R, K] codes -> [R, K/2] bytes, the even position in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _block_view(t):
    r, k = t.shape
    return t.reshape(r, k // BLOCK, BLOCK)


def quantize_reference(x, global_scale):
    """The exact result of ``quantize`` (the module docstring's steps), on x's device, in about 15 torch
    kernels. :return: ``(uint8 [R, K/2], float8_e4m3fn [R, K/16])``."""
    check_quantize_args(x, global_scale, "quantize_reference")
    return _quantize_rows(x, global_scale.reshape(()))


def _quantize_rows(x, gs):
    """``quantize_reference``'s steps with ``gs`` an fp32 global scale of shape () or one a row, [R, 1]
    (the experts' input scales); unchecked."""
    xf = x.to(torch.float32)  # exact
    amax = _block_view(xf).abs().amax(dim=-1)  # exact; NaN propagates
    six = torch.full((), E2M1_MAX, dtype=torch.float32, device=x.device)
    scale = _e4m3_bytes((amax * gs) / six)
    sd = scale.view(torch.float8_e4m3fn).to(torch.float32).unsqueeze(-1)
    q = _block_view(xf * gs) / sd
    q = torch.where(sd == 0, torch.zeros((), dtype=q.dtype, device=q.device), q).reshape(x.shape)
    codes = _e2m1_codes(q, torch.signbit(x))
    return _pack(codes), scale.view(torch.float8_e4m3fn)


def quantize_weight(w):
    """NVIDIA's recipe for a linear layer's weight [M, K] (ModelOpt's NVFP4 export), every step an fp32
    operation: ``weight_scale_2 = amax(|w|) / (6 * 448)``; per block of 16 the e4m3 scale nearest to
    ``(block amax / 6) / weight_scale_2`` (ties to even, saturating); each value the e2m1 code nearest to
    ``w / (scale * weight_scale_2)`` (ties to even). Blocks whose scale is 0 (all zero, or below e4m3's
    range) and weights that are all zero (``weight_scale_2 == 0``) get values 0.

    Not ``quantize_reference(w, 1 / weight_scale_2)``: that multiplies by a rounded reciprocal and divides
    by the scale alone, where the recipe divides by ``weight_scale_2`` and by ``scale * weight_scale_2``;
    the two can differ in the last bit of an fp32 quotient, so the recipe is written out here.

    :return: ``(weight uint8 [M, K/2], weight_scale float8_e4m3fn [M, K/16], weight_scale_2 fp32 0-dim)``.
    """
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() != 2:
        _fail(TypeError, "quantize_weight", "w", "a 2-d floating-point tensor [M, K]",
              getattr(w, "dtype", type(w).__name__))
    if w.shape[1] == 0 or w.shape[1] % BLOCK:
        _fail(ValueError, "quantize_weight", "w", f"K (dim 1) a positive multiple of {BLOCK}", w.shape[1])
    wf = w.detach().to(torch.float32)
    dev = wf.device
    ws2 = wf.abs().amax() / torch.full((), E2M1_MAX * E4M3_MAX, dtype=torch.float32, device=dev)
    zero = torch.zeros((), dtype=torch.float32, device=dev)
    six = torch.full((), E2M1_MAX, dtype=torch.float32, device=dev)
    block = _block_view(wf).abs().amax(dim=-1) / six
    scale = _e4m3_bytes(torch.where(ws2 == 0, zero, block / torch.where(ws2 == 0, six, ws2)))
    sd = scale.view(torch.float8_e4m3fn).to(torch.float32).unsqueeze(-1)
    denom = sd * ws2
    q = _block_view(wf) / torch.where(denom == 0, six, denom)
    q = torch.where(denom == 0, zero, q).reshape(w.shape)
    return _pack(_e2m1_codes(q, torch.signbit(wf))), scale.view(torch.float8_e4m3fn), ws2


def e2m1_decode(q):
    """fp32 values of the e2m1 nibbles of ``q`` (uint8 [R, B] -> [R, 2B], the low nibble first), computed
    from the codes' bits by elementwise ops on q's device: no lookup table, so no host-to-device copy (a
    sync) and nothing a CUDA graph capture would refuse."""
    u = q.view(torch.uint8)
    c = torch.stack((u & 0xF, u >> 4), dim=-1).reshape(u.shape[0], 2 * u.shape[1])  # (not -1: zero rows)
    e = ((c >> 1) & 3).to(torch.float32)
    m = (c & 1).to(torch.float32)
    v = torch.where(e == 0, 0.5 * m, torch.exp2(e - 1) * (1 + 0.5 * m))
    return torch.where((c & 8) != 0, -v, v)


def dequantize(q, scale, scale_2=None):
    """fp32 values of NVFP4 data: ``e2m1(q) * scale`` (exact in fp32), times ``scale_2`` (one rounding)
    where given. ``q`` [R, K/2] uint8, ``scale`` [R, K/16] float8_e4m3fn (plain layout). No host sync."""
    v = e2m1_decode(q)
    v = (_block_view(v) * scale.view(torch.float8_e4m3fn).to(torch.float32).unsqueeze(-1)).reshape(v.shape)
    if scale_2 is not None:
        v = v * scale_2.reshape(()).to(torch.float32)
    return v


def quantize_dequantized_reference(x, global_scale):
    """The exact result of ``quantize_dequantized``: ``dequantize(*quantize_reference(x, global_scale))`` in
    x's dtype (exact), on x's device."""
    check_quantize_args(x, global_scale, "quantize_dequantized_reference")
    return dequantize(*quantize_reference(x, global_scale)).to(x.dtype)


# ----------------------------------------------------------------------------------------------------
# The ops
# ----------------------------------------------------------------------------------------------------

def _cuda_kernel(dequantized=False):
    """The GPU kernel ``quantize_cuda(x, global_scale, out_q, out_s)`` (``dequantized``:
    ``quantize_dequantized_cuda(x, global_scale, out)``) of ``nvfp4_gemv.quant_kernel``, or None where it
    cannot be imported."""
    try:
        from .quant_kernel import quantize_cuda, quantize_dequantized_cuda
    except ImportError as e:
        warn_once("quantize-kernel", f"nvfp4_gemv.quantize: the GPU kernel could not be imported ({e}); the exact "
                  "reference runs on the GPU tensors instead, about 15 torch kernels a call")
        return None
    return quantize_dequantized_cuda if dequantized else quantize_cuda


def _quantize_impl(x, global_scale, checked=False):
    """The one place that picks the implementation: the GPU kernel on CUDA where there is one, else the
    exact reference (on x's device). Validates unless ``checked`` (the caller has)."""
    if not checked:
        check_quantize_args(x, global_scale)
    if x.is_cuda:
        kernel = _cuda_kernel()
        if kernel is not None:
            rows, k = x.shape
            out_q = torch.empty((rows, k // 2), dtype=torch.uint8, device=x.device)
            out_s = torch.empty((rows, k // BLOCK), dtype=torch.float8_e4m3fn, device=x.device)
            kernel(x, global_scale, out_q, out_s)
            return out_q, out_s
    return _quantize_rows(x, global_scale.reshape(()))


@torch.library.custom_op("nvfp4::quantize", mutates_args=())
def _quantize_op(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_impl(x, global_scale)


@_quantize_op.register_fake
def _quantize_fake(x, global_scale):
    rows, k = check_quantize_args(x, global_scale)
    return (x.new_empty((rows, k // 2), dtype=torch.uint8),
            x.new_empty((rows, k // BLOCK), dtype=torch.float8_e4m3fn))


fast_autograd(_quantize_op)


def quantize(x, global_scale):
    """NVFP4 quantization of activations with ModelOpt's semantics (this module's docstring, exactly).

    :param x: [R, K] ``torch.bfloat16`` or ``torch.float16``, K % 16 == 0.
    :param global_scale: one-element fp32 tensor on x's device (for a ModelOpt checkpoint,
        ``1 / input_scale``), read on the device: no host sync.
    :return: ``(uint8 [R, K/2]`` (two e2m1 codes a byte, the first in the low nibble),
        ``float8_e4m3fn [R, K/16])``, the inputs ``gemv`` takes as ``x`` and ``x_scale``.
    :raises TypeError, ValueError: naming the argument.
    """
    if eager(x, global_scale) and x.is_cuda:  # (nvfp4_gemv.library) validated once
        check_quantize_args(x, global_scale)
        return _quantize_impl(x, global_scale, checked=True)
    return through_library(lambda: check_quantize_args(x, global_scale), torch.ops.nvfp4.quantize, (x, global_scale))


def _quantize_dequantized_impl(x, global_scale, checked=False):
    if not checked:
        check_quantize_args(x, global_scale, "quantize_dequantized")
    if x.is_cuda:
        kernel = _cuda_kernel(dequantized=True)
        if kernel is not None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            kernel(x, global_scale, out)
            return out
    return dequantize(*_quantize_rows(x, global_scale.reshape(()))).to(x.dtype)


@torch.library.custom_op("nvfp4::quantize_dequantized", mutates_args=())
def _quantize_dequantized_op(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    return _quantize_dequantized_impl(x, global_scale)


@_quantize_dequantized_op.register_fake
def _quantize_dequantized_fake(x, global_scale):
    check_quantize_args(x, global_scale, "quantize_dequantized")
    return x.new_empty(x.shape)


fast_autograd(_quantize_dequantized_op)


def quantize_dequantized(x, global_scale):
    """``quantize(x, global_scale)`` with the values its codes stand for as the result: ``e2m1(code) *
    scale`` for each value, in x's dtype, exactly ``dequantize(*quantize(x, global_scale))`` (this module's
    docstring). One GPU kernel on CUDA (``nvfp4_gemv.quant_kernel``, ``dequantized`` build).

    :param x: [R, K] ``torch.bfloat16`` or ``torch.float16``, K % 16 == 0.
    :param global_scale: one-element fp32 tensor on x's device, read there: no host sync.
    :return: [R, K] in x's dtype (dense).
    :raises TypeError, ValueError: naming the argument.
    """
    if eager(x, global_scale) and x.is_cuda:  # (nvfp4_gemv.library) validated once
        check_quantize_args(x, global_scale, "quantize_dequantized")
        return _quantize_dequantized_impl(x, global_scale, checked=True)
    return through_library(lambda: check_quantize_args(x, global_scale, "quantize_dequantized"),
                           torch.ops.nvfp4.quantize_dequantized, (x, global_scale))

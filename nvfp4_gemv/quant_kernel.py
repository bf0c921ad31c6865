"""The GPU kernel of ``nvfp4_gemv.quantize``: NVFP4 quantization of bf16/fp16 activations, bit for bit the
semantics that ``nvfp4_gemv.quant`` states (every step one IEEE fp32 operation, round to nearest even).

Algorithm: one thread a block of 16 values. It loads the block's 32 bytes (two 16-byte loads), widens the
values to fp32 (exact), takes ``amax``, computes ``s = e4m3((amax * gs) / 6)`` with ``mul.rn.f32``,
``div.rn.f32`` (IEEE division, not the approximate one) and ``cvt.rn.satfinite.e4m3x2.f32`` (ties to even,
saturating at 448, NaN kept as 0x7F), decodes ``s`` back to fp32 (exact), and for each value
``q = (x * gs) / sd`` the same way. Hopper has no e2m1 conversion (``cvt ... e2m1x2`` is sm_100a+), so the
code is the number of the seven midpoints ``|q|`` passes (``>=`` where the step up reaches an even code,
``>`` where it reaches an odd one: ties to even), with x's sign bit; NaN passes none. Eight code bytes and
one scale byte are stored.

Inline PTX throughout: the DSL's arithmetic may be contracted or reassociated (an FMA of ``x * gs / sd``
would round once, not twice), and ``cute.arch`` has no e4m3 conversion of fp32 with ``satfinite``.

``dequantized`` build (``quant.quantize_dequantized``): the same steps up to the code, then instead of the
code the value it stands for, ``e2m1 magnitude * sd`` with the sign of ``x`` (xor that of ``sd``), stored in
x's dtype: the magnitude is the sum of the steps the thresholds pass (0.5 four times, 1 twice, 2), so it is
exact, and ``magnitude * sd`` has at most 2 + 4 significant bits between 2^-10 and 2688, exact in fp32, bf16
and fp16; a NaN scale gives NaN values. Sixteen values (32 bytes) are stored a block, no scale byte.

Layouts: x [R, K] K-contiguous with 16-byte aligned rows; codes [R, K/2] and scales [R, K/16] dense (or,
``dequantized``, values [R, K] in x's dtype, dense); ``gs`` one fp32 on the device (never read on the host).
``K % 16 == 0``; ``K`` is a compile-time constant.
"""

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cutlass_dsl import T, dsl_user_op

from cuda.bindings.driver import CUstream

from .launch import KernelCache, current_device, current_stream, dsl_compile, sm_count
from .ptx import asm as _asm
from .ptx import asm_store
from .ptx import ldg_f32, ldg_v4, stg_u8, stg_u32x2

THREADS = 256


@dsl_user_op
def widen8(v0, v1, v2, v3, bf16, *, loc=None, ip=None):
    """Eight bf16 or fp16 values (four words) to fp32, exactly."""
    if bf16:
        body = []
        for i in range(4):
            body += [f"shl.b32 ${2 * i}, ${8 + i}, 16;", f"and.b32 ${2 * i + 1}, ${8 + i}, 0xFFFF0000;"]
        text = "\n".join(body)
    else:
        body = ["{", ".reg .b16 lo, hi;"]
        for i in range(4):
            body += [f"mov.b32 {{lo, hi}}, ${8 + i};", f"cvt.f32.f16 ${2 * i}, lo;", f"cvt.f32.f16 ${2 * i + 1}, hi;"]
        body.append("}")
        text = "\n".join(body)
    r = _asm([T.f32()] * 8, [cutlass.Int32(v) for v in (v0, v1, v2, v3)], text, "=f," * 8 + "r,r,r,r", loc, ip)
    return [cutlass.Float32(x) for x in r]


@dsl_user_op
def block_scale(amax, gs, *, loc=None, ip=None):
    """``(e4m3 byte of (amax * gs) / 6, its fp32 value)``: IEEE mul and div, ``cvt.rn.satfinite`` (ties to
    even, saturating at 448, NaN -> 0x7F), decoded back exactly through f16."""
    r = _asm([T.i32(), T.f32()], [cutlass.Float32(amax), cutlass.Float32(gs)],
             "{\n.reg .f32 t, z;\n.reg .b16 h, lo, hi;\n.reg .b32 f;\nmul.rn.f32 t, $2, $3;\n"
             "div.rn.f32 t, t, 0f40C00000;\nmov.f32 z, 0f00000000;\ncvt.rn.satfinite.e4m3x2.f32 h, z, t;\n"
             "cvt.u32.u16 $0, h;\ncvt.rn.f16x2.e4m3x2 f, h;\nmov.b32 {lo, hi}, f;\ncvt.f32.f16 $1, lo;\n}",
             "=r,=f,f,f", loc, ip)
    return cutlass.Int32(r[0]), cutlass.Float32(r[1])


@dsl_user_op
def fmax_nan(a, b, *, loc=None, ip=None):
    """``max.NaN.f32``: a NaN operand gives NaN (``cute.arch.fmax``'s ``max.f32`` would drop it, and a NaN in
    a block must give the scale 0x7F)."""
    r = _asm([T.f32()], [cutlass.Float32(a), cutlass.Float32(b)], "max.NaN.f32 $0, $1, $2;", "=f,f,f", loc, ip)
    return cutlass.Float32(r[0])


@dsl_user_op
def e2m1_code(x, gs, sd, *, loc=None, ip=None):
    """The 4-bit code of ``q = (x * gs) / sd`` (IEEE mul and div; 0 where ``sd`` is 0), ties to even,
    saturating at 6, NaN -> magnitude 0, with x's sign bit."""
    t = ["{", ".reg .f32 q;", ".reg .pred p, z;", ".reg .b32 c, s;",
         "mul.rn.f32 q, $1, $2;", "div.rn.f32 q, q, $3;", "setp.eq.f32 z, $3, 0f00000000;",
         "@z mov.f32 q, 0f00000000;", "abs.f32 q, q;", "mov.b32 $0, 0;"]
    for thr, ge in ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False)):
        bits = {0.25: "3E800000", 0.75: "3F400000", 1.25: "3FA00000", 1.75: "3FE00000", 2.5: "40200000",
                3.5: "40600000", 5.0: "40A00000"}[thr]
        t += [f"setp.{'ge' if ge else 'gt'}.f32 p, q, 0f{bits};", "selp.b32 c, 1, 0, p;", "add.u32 $0, $0, c;"]
    t += ["mov.b32 s, $1;", "shr.u32 s, s, 31;", "shl.b32 s, s, 3;", "or.b32 $0, $0, s;", "}"]
    r = _asm([T.i32()], [cutlass.Float32(x), cutlass.Float32(gs), cutlass.Float32(sd)], "\n".join(t),
             "=r,f,f,f", loc, ip)
    return cutlass.Int32(r[0])


@dsl_user_op
def grid_pair(x0, x1, gs, sd, bf16, *, loc=None, ip=None):
    """Two values ``x0``, ``x1`` (fp32) quantized and dequantized in one word of x's dtype (``x0`` in the low
    half): for each, ``q = (x * gs) / sd`` as ``e2m1_code`` computes it, the magnitude of its code summed from
    the steps its thresholds pass (exact), times ``sd`` (exact), x's sign bit xored in, then converted
    (exact: at most 6 significant bits in range)."""
    cvt = "cvt.rn.bf16.f32" if bf16 else "cvt.rn.f16.f32"
    t = ["{", ".reg .f32 q, m, d;", ".reg .pred p, z;", ".reg .b32 s, b;", ".reg .b16 h0, h1;",
         "setp.eq.f32 z, $4, 0f00000000;"]
    # (|q| threshold 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 as fp32 bits; >= at a tie (up to an even code);
    # the step in magnitude it adds: 0.5, 0.5, 0.5, 0.5, 1, 1, 2): 0, 0.5, 1, 1.5, 2, 3, 4, 6
    steps = (("3E800000", False, "3F000000"), ("3F400000", True, "3F000000"), ("3FA00000", False, "3F000000"),
             ("3FE00000", True, "3F000000"), ("40200000", False, "3F800000"), ("40600000", True, "3F800000"),
             ("40A00000", False, "40000000"))
    for i in range(2):
        t += [f"mul.rn.f32 q, ${1 + i}, $3;", "div.rn.f32 q, q, $4;", "@z mov.f32 q, 0f00000000;", "abs.f32 q, q;",
              "mov.f32 m, 0f00000000;"]
        for bits, ge, step in steps:
            t += [f"setp.{'ge' if ge else 'gt'}.f32 p, q, 0f{bits};", f"selp.f32 d, 0f{step}, 0f00000000, p;",
                  "add.rn.f32 m, m, d;"]
        t += ["mul.rn.f32 m, m, $4;", f"mov.b32 s, ${1 + i};", "and.b32 s, s, 0x80000000;", "mov.b32 b, m;",
              "xor.b32 b, b, s;", "mov.b32 m, b;", f"{cvt} h{i}, m;"]
    t += ["mov.b32 $0, {h0, h1};", "}"]
    r = _asm([T.i32()], [cutlass.Float32(x0), cutlass.Float32(x1), cutlass.Float32(gs), cutlass.Float32(sd)],
             "\n".join(t), "=r,f,f,f,f", loc, ip)
    return cutlass.Int32(r[0])


@dsl_user_op
def stg_v4(addr, v0, v1, v2, v3, *, loc=None, ip=None):
    """``st.global.v4.u32`` at a 16-byte aligned 64-bit address."""
    asm_store([cutlass.Int64(addr), *[cutlass.Int32(v) for v in (v0, v1, v2, v3)]],
              "st.global.v4.u32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", loc, ip)


class Nvfp4Quantize:
    """One instance per (K, x dtype, output form): codes and scales, or (``dequantized``) the values they
    stand for in x's dtype."""

    def __init__(self, k: int, x_bf16: bool, dequantized: bool = False):
        if k <= 0 or k % 16:
            raise ValueError(f"nvfp4_gemv.quantize: K={k} is not a positive multiple of 16")
        self.k = k
        self.x_bf16 = bool(x_bf16)
        self.dequantized = bool(dequantized)

    @cute.jit
    def __call__(self, x_ptr: cutlass.Int64, gs_ptr: cutlass.Int64, q_ptr: cutlass.Int64, s_ptr: cutlass.Int64,
                 rows: cutlass.Int32, x_rs: cutlass.Int64, grid_x: cutlass.Int32, stream):
        self.kernel(x_ptr, gs_ptr, q_ptr, s_ptr, rows, x_rs).launch(grid=[grid_x, 1, 1], block=[THREADS, 1, 1],
                                                                  stream=stream)

    @cute.kernel
    def kernel(self, x_ptr: cutlass.Int64, gs_ptr: cutlass.Int64, q_ptr: cutlass.Int64, s_ptr: cutlass.Int64,
               rows: cutlass.Int32, x_rs: cutlass.Int64):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdimx, _, _ = cute.arch.grid_dim()
        per_row = self.k // 16
        gs = ldg_f32(gs_ptr)
        for b in cutlass.range(bidx * THREADS + tidx, rows * per_row, gdimx * THREADS, unroll=1):
            r = b // per_row
            c = b % per_row
            src = x_ptr + cutlass.Int64(r) * x_rs + cutlass.Int64(c) * 32
            w = ldg_v4(src) + ldg_v4(src + 16)
            v = widen8(*w[:4], self.x_bf16) + widen8(*w[4:], self.x_bf16)
            amax = cutlass.Float32(0.0)
            for i in cutlass.range_constexpr(16):
                amax = fmax_nan(amax, abs_f32(v[i]))
            sb, sd = block_scale(amax, gs)
            if cutlass.const_expr(self.dequantized):  # q_ptr: the values [R, K] in x's dtype, 32 bytes a block
                words = [grid_pair(v[2 * i], v[2 * i + 1], gs, sd, self.x_bf16) for i in range(8)]
                dst = q_ptr + cutlass.Int64(b) * 32
                stg_v4(dst, *words[:4])
                stg_v4(dst + 16, *words[4:])
            else:
                words = []
                for h in cutlass.range_constexpr(2):
                    word = cutlass.Int32(0)
                    for i in cutlass.range_constexpr(8):
                        word = word | (e2m1_code(v[8 * h + i], gs, sd) << (4 * i))
                    words.append(word)
                stg_u32x2(q_ptr + cutlass.Int64(b) * 8, words[0], words[1])
                stg_u8(s_ptr + cutlass.Int64(b), sb)


@dsl_user_op
def abs_f32(v, *, loc=None, ip=None):
    """``|v|`` (``abs.f32``; NaN stays NaN)."""
    r = _asm([T.f32()], [cutlass.Float32(v)], "abs.f32 $0, $1;", "=f,f", loc, ip)
    return cutlass.Float32(r[0])



def compile_quantize(k, x_bf16, options=None, tvm_ffi=None, dequantized=False):
    """``(op, compiled)`` (no GPU needed when ``options`` names ``--gpu-arch``)."""
    op = Nvfp4Quantize(k, x_bf16, dequantized)
    i64, i32 = cutlass.Int64(0), cutlass.Int32(1)
    return op, dsl_compile(op, (i64, i64, i64, i64, i32, i64, i32, CUstream(0)), options, tvm_ffi)


def quantize_cuda(x, global_scale, out_q, out_s):
    """Writes ``quantize(x, global_scale)`` into ``out_q`` (uint8 [R, K/2]) and ``out_s`` (e4m3 [R, K/16]) on
    torch's current stream."""
    _launch(x, global_scale, out_q, out_s, False)


def quantize_dequantized_cuda(x, global_scale, out):
    """Writes ``quant.quantize_dequantized(x, global_scale)`` into ``out`` (x's dtype, dense [R, K]) on torch's
    current stream."""
    _launch(x, global_scale, out, None, True)


_kernels = KernelCache(lambda key: compile_quantize(key[1], key[2], dequantized=key[3]))


def _launch(x, global_scale, out_q, out_s, dequantized):
    """Rows of x that are not 16-byte aligned and K-contiguous are copied first (a new allocation:
    ``contiguous()`` keeps a contiguous tensor at a misaligned address where it is)."""
    rows, k = x.shape
    if rows == 0:
        return
    if x.stride(1) != 1 or (rows > 1 and (x.stride(0) * 2) % 16) or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)  # a new, aligned allocation (contiguous() may not move)
    dev = x.device.index
    key = (dev, k, x.dtype == torch.bfloat16, dequantized)
    kern = _kernels.get(dev, key)
    sms = sm_count(dev)
    blocks = rows * (k // 16)
    grid = max(1, min(-(-blocks // THREADS), sms * 8))
    args = (x.data_ptr(), global_scale.data_ptr(), out_q.data_ptr(), 0 if out_s is None else out_s.data_ptr(), rows,
            x.stride(0) * 2, grid)
    stream = current_stream(dev)
    if kern.ffi is not None and current_device() == dev:
        kern.ffi(*args, stream)
    else:
        with torch.cuda.device(dev):
            kern.launch_dsl(args, stream)

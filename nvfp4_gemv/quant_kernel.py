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

Layouts: x [R, K] K-contiguous with 16-byte aligned rows; codes [R, K/2] and scales [R, K/16] dense;
``gs`` one fp32 on the device (never read on the host). ``K % 16 == 0``; ``K`` is a compile-time constant.
"""

import threading

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cutlass_dsl import T, dsl_user_op

from cuda.bindings.driver import CUstream

from .launch import Kernel, current_device, current_stream, dsl_compile
from .ptx import asm as _asm
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


class Nvfp4Quantize:
    """One instance per (K, x dtype)."""

    def __init__(self, k: int, x_bf16: bool):
        if k <= 0 or k % 16:
            raise ValueError(f"nvfp4_gemv.quantize: K={k} is not a positive multiple of 16")
        self.k = k
        self.x_bf16 = bool(x_bf16)

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


_compiled = {}
_sms = {}
_lock = threading.RLock()


def compile_quantize(k, x_bf16, options=None, tvm_ffi=None):
    """``(op, compiled)`` (no GPU needed when ``options`` names ``--gpu-arch``)."""
    op = Nvfp4Quantize(k, x_bf16)
    i64, i32 = cutlass.Int64(0), cutlass.Int32(1)
    return op, dsl_compile(op, (i64, i64, i64, i64, i32, i64, i32, CUstream(0)), options, tvm_ffi)


def quantize_cuda(x, global_scale, out_q, out_s):
    """Writes ``quantize(x, global_scale)`` into ``out_q`` (uint8 [R, K/2]) and ``out_s`` (e4m3 [R, K/16]) on
    torch's current stream. Rows of x that are not 16-byte aligned and K-contiguous are copied first (a new
    allocation: ``contiguous()`` keeps a contiguous tensor at a misaligned address where it is)."""
    rows, k = x.shape
    if rows == 0:
        return
    if x.stride(1) != 1 or (rows > 1 and (x.stride(0) * 2) % 16) or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)  # a new, aligned allocation (contiguous() may not move)
    dev = x.device.index
    key = (dev, k, x.dtype == torch.bfloat16)
    kern = _compiled.get(key)
    if kern is None:
        with _lock:
            kern = _compiled.get(key)
            if kern is None:
                op, fn = compile_quantize(k, key[2])
                kern = _compiled[key] = Kernel(fn, dev, op)
                kern.check_fast()
    sms = _sms.get(dev)
    if sms is None:
        sms = _sms[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    blocks = rows * (k // 16)
    grid = max(1, min(-(-blocks // THREADS), sms * 8))
    args = (x.data_ptr(), global_scale.data_ptr(), out_q.data_ptr(), out_s.data_ptr(), rows, x.stride(0) * 2, grid)
    stream = current_stream(dev)
    if kern.ffi is not None and current_device() == dev:
        kern.ffi(*args, stream)
    else:
        with torch.cuda.device(dev):
            kern.launch_dsl(args, stream)

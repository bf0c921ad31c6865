"""The GPU kernel behind W4A16's many-token path (``op_plan.dequant_mm``): NVFP4 weights to bf16 or fp16,
``out[r, j] = e2m1(w[r, j]) * e4m3(w_scale[r, j // 16])``, exact (an e2m1 value times an e4m3 scale has at
most 2 + 4 significant bits, between 2^-10 and 2688: bf16 and fp16 hold it), bit for bit what
``op_plan.dequantized``'s torch ops give (NaN where the scale is NaN, -0.0 for the code -0).

Algorithm: one thread a block of 16 values: one 8-byte load of its codes, one byte of scale, the decode of
the W4A16 kernel (``decode.scaled_bf16x8`` / ``scaled_f16x8``: ``v * s`` times 2^-7 (bf16) or 2^-14 (fp16),
exact, in pairs ``(i, i + 4)`` of a code word), one multiply by 2^7 or 2^14 (exact: the result is in range and
has at most 6 significant bits), ``prmt`` back to value order, two 16-byte stores. A grid-stride loop over
the blocks. It reads 0.56 and writes 2 bytes a value: a pass over the weight at about the card's copy
bandwidth, where the torch ops it replaces made some twenty passes over fp32 temporaries.

Layouts: ``plain``: codes [M, K/2] and scales [M, K/16] row-major with any row strides (codes' 8-byte
aligned); ``packed``: ``packed.pack_weight``'s [M, 9K/16] buffer (576-byte pieces: 8 rows x 64 code bytes,
then 8 rows x 8 scale bytes, K/128 pieces a group of 8 rows), walked piece by piece so that a warp reads
contiguous bytes. Out: dense [M, K] in the chosen dtype, 16-byte aligned. ``K % 16 == 0`` (packed: ``K %
128 == 0``); K is a compile-time constant.

The loads are side-effecting asm: LLVM may hoist inline asm without side effects above the loop's bound
check (session 66's fault in the W4A16 kernel was such a hoisted load), and this kernel gains nothing from
reordering them (a thread's one iteration is two loads then two stores).
"""

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cutlass_dsl import T, dsl_user_op

from .decode import scaled_bf16x8, scaled_f16x8
from .launch import KernelCache, current_device, current_stream, dsl_compile, sm_count
from .packed import GROUP_ROWS, PIECE, SLICE
from .ptx import asm as _asm
from .ptx import ldg_u8, ldg_u16, ldg_v2
from .quant_kernel import stg_v4

THREADS = 256
BLOCK = 16  # values a scale, and a thread's share of one iteration


@dsl_user_op
def ldg_stream_v4(addr, *, loc=None, ip=None):
    """``ld.global.nc.L1::no_allocate.v4.u32``, side-effecting: two blocks' codes (the ``pair`` build). The
    other loads are ``ptx``'s, asked ``volatile``."""
    r = _asm([T.i32()] * 4, [cutlass.Int64(addr)], "ld.global.nc.L1::no_allocate.v4.u32 {$0, $1, $2, $3}, [$4];",
             "=r,=r,=r,=r,l", loc, ip, volatile=True)
    return [cutlass.Int32(v) for v in r]


@dsl_user_op
def value_order(o0, o1, o2, o3, bf16, *, loc=None, ip=None):
    """A code word's four decoded pairs ``(0,4), (1,5), (2,6), (3,7)`` (``v * s`` times 2^-7 or 2^-14) to
    ``(0,1), (2,3), (4,5), (6,7)``, each times 2^7 (bf16) or 2^14 (fp16): exact."""
    mul, k = ("mul.rn.bf16x2", "0x43004300") if bf16 else ("mul.rn.f16x2", "0x74007400")
    body = ["{", ".reg .b32 a, b, c, d, k;", f"mov.b32 k, {k};", f"{mul} a, $4, k;", f"{mul} b, $5, k;",
            f"{mul} c, $6, k;", f"{mul} d, $7, k;", "prmt.b32 $0, a, b, 0x5410;", "prmt.b32 $1, c, d, 0x5410;",
            "prmt.b32 $2, a, b, 0x7632;", "prmt.b32 $3, c, d, 0x7632;", "}"]
    r = _asm([T.i32()] * 4, [cutlass.Int32(v) for v in (o0, o1, o2, o3)], "\n".join(body),
             "=r,=r,=r,=r,r,r,r,r", loc, ip)
    return [cutlass.Int32(v) for v in r]


class Nvfp4Dequantize:
    """One instance per (K, output dtype, layout, pair). ``pair``: two adjacent blocks of a row a thread and
    iteration (one 16-byte code load, one 2-byte scale load, 64 bytes stored): twice the bytes in flight a
    thread. Built for measurement (session 71: the one-block build ran at 67-78% of a copy's bandwidth,
    predicted latency-bound on its loads); not routed until measured."""

    def __init__(self, k: int, out_bf16: bool, packed: bool = False, pair: bool = False):
        ok, why = self.can_implement(k, packed, pair)
        if not ok:
            raise ValueError(f"nvfp4_gemv dequantize: {why}")
        self.k = k
        self.out_bf16 = bool(out_bf16)
        self.packed = bool(packed)
        self.pair = bool(pair)

    @staticmethod
    def can_implement(k, packed=False, pair=False):
        """``(ok, why not)`` for a weight's K."""
        step = SLICE if packed else 2 * BLOCK if pair else BLOCK
        if k <= 0 or k % step:
            return False, f"K={k} is not a positive multiple of {step}"
        return True, ""

    @cute.jit
    def __call__(self, w_ptr: cutlass.Int64, ws_ptr: cutlass.Int64, out_ptr: cutlass.Int64, rows: cutlass.Int32,
                 w_rs: cutlass.Int64, ws_rs: cutlass.Int64, grid_x: cutlass.Int32, stream):
        self.kernel(w_ptr, ws_ptr, out_ptr, rows, w_rs, ws_rs).launch(grid=[grid_x, 1, 1], block=[THREADS, 1, 1],
                                                                      stream=stream)

    @cute.kernel
    def kernel(self, w_ptr: cutlass.Int64, ws_ptr: cutlass.Int64, out_ptr: cutlass.Int64, rows: cutlass.Int32,
               w_rs: cutlass.Int64, ws_rs: cutlass.Int64):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdimx, _, _ = cute.arch.grid_dim()
        per_row = self.k // BLOCK
        nb = 2 if self.pair else 1  # blocks a thread and iteration (adjacent in a row)
        for u in cutlass.range(bidx * THREADS + tidx, rows * (per_row // nb), gdimx * THREADS, unroll=1):
            b = u * nb
            if cutlass.const_expr(self.packed):
                # b walks the pieces in memory order: piece p = b // 64 holds blocks (row, slice) of 8 rows
                # (GROUP_ROWS) x 8 blocks (SLICE / 16); its codes start p * 576 bytes in, its scales 512 later
                pieces_a_group = self.k // SLICE
                blocks_a_piece = GROUP_ROWS * (SLICE // BLOCK)
                p = b // blocks_a_piece
                i = b % blocks_a_piece
                r = (p // pieces_a_group) * GROUP_ROWS + i // (SLICE // BLOCK)
                c = (p % pieces_a_group) * (SLICE // BLOCK) + i % (SLICE // BLOCK)
                base = w_ptr + cutlass.Int64(p) * PIECE
                at_q = base + cutlass.Int64(i) * 8
                at_s = base + GROUP_ROWS * SLICE // 2 + cutlass.Int64(i)
            else:
                r = b // per_row
                c = b % per_row
                at_q = w_ptr + cutlass.Int64(r) * w_rs + cutlass.Int64(c) * 8
                at_s = ws_ptr + cutlass.Int64(r) * ws_rs + cutlass.Int64(c)
            if cutlass.const_expr(self.pair):
                q = ldg_stream_v4(at_q)
                s8 = ldg_u16(at_s, volatile=True)  # block c's byte low, c + 1's high
            else:
                q = ldg_v2(at_q, volatile=True)
                s8 = ldg_u8(at_s, volatile=True)
            dst = out_ptr + (cutlass.Int64(r) * self.k + cutlass.Int64(c) * BLOCK) * 2
            for j in cutlass.range_constexpr(nb):
                sj = s8 if j == 0 else s8 >> 8  # (the decodes read the scale register's low byte)
                if cutlass.const_expr(self.out_bf16):
                    o = scaled_bf16x8(q[2 * j], q[2 * j + 1], sj)
                else:
                    o = scaled_f16x8(q[2 * j], q[2 * j + 1], sj)
                words = value_order(*o[:4], self.out_bf16) + value_order(*o[4:], self.out_bf16)
                stg_v4(dst + 32 * j, *words[:4])
                stg_v4(dst + 32 * j + 16, *words[4:])


def compile_dequantize(k, out_bf16, packed=False, options=None, tvm_ffi=None, pair=False):
    """``(op, compiled)`` (no GPU needed when ``options`` names ``--gpu-arch``)."""
    op = Nvfp4Dequantize(k, out_bf16, packed, pair)
    i64, i32 = cutlass.Int64(0), cutlass.Int32(1)
    from cuda.bindings.driver import CUstream

    return op, dsl_compile(op, (i64, i64, i64, i32, i64, i64, i32, CUstream(0)), options, tvm_ffi)


_kernels = KernelCache(lambda key: compile_dequantize(key[1], key[2], key[3], pair=key[4]))


def dequantize_cuda(w, w_scale, out, k, packed=False, pair=False):
    """Writes the values of NVFP4 weight ``w`` into ``out`` (bf16 or fp16, dense [M, K], 16-byte aligned) on
    torch's current stream. ``w``: codes [M, K/2] with 8-byte aligned rows and ``w_scale`` float8_e4m3fn
    [M, K/16] plain (any row strides, unit column stride), or (``packed``) ``w`` is ``pack_weight``'s buffer
    and ``w_scale`` is None. The caller has checked the shapes (``reference.check_args`` /
    ``packed.check_packed_args``); this checks what only the kernel needs, without a sync."""
    m = out.shape[0]
    if out.dtype not in (torch.bfloat16, torch.float16) or out.shape != (m, k) or not out.is_contiguous() \
            or out.data_ptr() % 16:
        raise ValueError(f"nvfp4_gemv dequantize: out must be a dense 16-byte aligned bf16/fp16 [M, {k}] tensor, "
                         f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    if not packed and (w.stride(1) != 1 or (m > 1 and w.stride(0) % 8) or w.data_ptr() % 8
                       or w_scale.stride(1) != 1):
        raise ValueError(f"nvfp4_gemv dequantize: w must have unit column stride and 8-byte aligned rows, w_scale "
                         f"unit column stride; got strides {w.stride()} at {w.data_ptr():#x}, {w_scale.stride()}")
    if m == 0:
        return out
    if m * (k // BLOCK) >= 2 ** 31:  # the kernel counts blocks in Int32
        raise ValueError(f"nvfp4_gemv dequantize: {m} x {k} values is 2^35 or more; split the weight's rows")
    dev = w.device.index
    # pair (opt-in, for measurement): where K and the addresses allow 16-byte code and 2-byte scale loads
    pair = bool(pair) and Nvfp4Dequantize.can_implement(k, packed, True)[0] and w.data_ptr() % 16 == 0 and (
        packed or ((m == 1 or w.stride(0) % 16 == 0) and w_scale.data_ptr() % 2 == 0
                   and (m == 1 or w_scale.stride(0) % 2 == 0)))
    kern = _kernels.get(dev, (dev, k, out.dtype == torch.bfloat16, bool(packed), pair))
    blocks = m * (k // BLOCK) // (2 if pair else 1)
    grid = max(1, min(-(-blocks // THREADS), sm_count(dev) * 16))
    args = (w.data_ptr(), 0 if packed else w_scale.data_ptr(), out.data_ptr(), m,
            0 if packed else w.stride(0), 0 if packed else w_scale.stride(0), grid)
    stream = current_stream(dev)
    if kern.ffi is not None and current_device() == dev:
        kern.ffi(*args, stream)
    else:
        with torch.cuda.device(dev):
            kern.launch_dsl(args, stream)
    return out

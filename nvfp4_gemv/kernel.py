"""NVFP4 batched GEMV for the GPU MODE ``nvfp4_gemv`` problem, on Hopper (sm_90a) and Blackwell (sm_100a).

Computes ``c[m, 0, l] = sum_k a[m, k, l] * sfa[m, k // 16, l] * b[0, k, l] * sfb[0, k // 16, l]`` in fp16.

Algorithm (CuTe DSL kernel, both architectures):

* The fp4 (e2m1) values are read as integers: no fp4 instruction is needed, so the same code runs on
  sm_90a, which has none. ``2 * e2m1`` is an integer in [-12, 12], so a 16-value block's dot product is
  exact in int32: a ``prmt`` byte lookup turns four nibbles into four int8 magnitudes (a nibble with its
  sign bit set selects in sign-replicate mode and yields 0), a second lookup on the nibbles with their
  sign bits flipped yields the magnitudes of the negative ones, and two ``dp4a`` against the int8 copy of
  ``b`` give the positive and the negative part. Each block's integer dot is then scaled once by
  ``sfa * sfb / 4`` (exactly: the product fits fp32's mantissa) and added to an fp64 sum: each addition
  rounds by at most 2^-53 of the running sum, so rows whose blocks cancel keep their small remainder.
* One CTA works on one batch index ``l``. It first decodes ``b[:, l]`` to int8 and ``sfb[:, l]`` to fp32
  in shared memory. Then groups of ``G`` lanes each own one row of ``a`` at a time (grid-stride over the
  rows): lane ``j`` streams the 16-byte chunks ``j, j + G, ...`` of the row with non-caching 16-byte loads
  plus the chunk's two scale bytes, so each load instruction of a group is contiguous. The loads of the
  next work unit (``batch`` chunks of a lane) are in flight while the current one is computed. For units of
  4 chunks (also out of 8 or 12 a lane: K = 4096, 6144), and of 2 over 16 lanes, where the rows of ``sfa``
  are 16-byte aligned (plain scales), a unit's scales come in 16-byte loads by the group's first lanes and
  reach the others through shared memory: two-byte loads cost more than their bytes (``sf_wide``). A
  butterfly shuffle (fp64) combines the group's partials and one lane writes ``c``.
* Problems that fit in one wave (small ``M * L``) are latency-bound: what counts is the time after the
  last byte lands. Where a row has more than 1024 values, ``Nvfp4GemvSplit`` splits it over whole
  warps (one 16-byte chunk a lane where the wave fits, else up to four; where the split does not divide
  the row, the last chunk of some lanes lies past it and loads nothing), with ``b`` in registers and no
  loop; the warps' sums meet in shared memory. Shorter rows take the register kernel with up to a whole
  warp a row and each lane's share loaded in one unit (``Nvfp4Gemv.shape_tuning``), unless that unit has
  8+ chunks, CTAs outnumber SMs and the streaming units hold 3+ chunks.
* Long rows (``K >= 7168``) that the split-row kernel does not take go to ``Nvfp4GemvBulk``: a producer
  warp fetches whole rows of ``a`` and ``sfa`` into shared memory with bulk copies (``cp.async.bulk``,
  the TMA engine without a tensor map), three stages deep on mbarriers, with an L2 evict-first hint;
  consumer warps keep their share of ``b`` in registers. On H200 under the leaderboard's timing this
  streams the benchmark shapes about as fast as the same copies with no arithmetic at all
  (``pick_tuning`` chooses the kernel). Where a tile holds several rows, a CTA's tiles after its first
  three are claimed at run time from a counter a batch index (SMs are served unequally); the counters
  live in a small buffer a stream, zeroed again by each launch's last claim, and a launch inside a CUDA
  graph capture keeps the static schedule.
* ``K`` and the configuration are compile-time constants; ``M``, ``L`` and all strides are run-time
  values. Scales are read from the plain ``[M, K/16, L]`` tensors, or, when those are not on the GPU
  (older official generators kept them on the CPU), from the permuted cuBLAS-blocked tensors.

Host side: a launch plan is cached per tensor metadata (shapes, strides, dtypes, devices), validated
once; a call then reads five data pointers and the stream and calls the compiled launcher: through
TVM-FFI (``--enable-tvm-ffi``, where apache-tvm-ffi is installed), else with reused ctypes argument
storage where this DSL version's layout is the one checked for (the DSL's own argument conversion costs
far more than the launch; ``_Kernel``). Works with nvidia-cutlass-dsl 4.3 to 4.8.

On a GPU whose ``torch._scaled_mm`` supports fp4 (sm_100 family), ``L == 1`` goes to ``_scaled_mm``
instead, with its blocked scales taken from ``sfa_permuted``/``sfb_permuted`` by a permute and reshape.
Set ``NVFP4_GEMV_FORCE_CUTE=1`` to send every call to the CuTe DSL kernel.

Constraints: CUDA tensors; ``M % 128 == 0``; ``K % 64 == 0`` and ``K <= 32768``; ``a``/``b`` and the
plain scales contiguous along K; ``a`` rows 16-byte aligned. The bulk kernel also needs ``K % 256 == 0``
and 16-byte aligned rows of ``sfa``; where they are missing the choice among the others runs instead.
"""

import ctypes
import os
import struct
import threading
import warnings

import torch
input_t = output_t = tuple  # submission.py: the competition's own types, from task (tools/gen_submission.py)

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cuda.bindings.driver import CUstream as _CUstream

try:  # DSL 4.8 moved it; the old name warns there
    from cutlass.memory import SmemAllocator
except ImportError:
    from cutlass.utils import SmemAllocator

FORCE_CUTE_ENV = "NVFP4_GEMV_FORCE_CUTE"
E2M1_TIMES2_LO = 0x03020100  # 2 * e2m1 magnitude codes 0..3; codes 4..7 give 0x0C080604
MAX_K = 32768
BULK_MIN_K = 7168  # shorter rows: the register-streaming kernel is as fast (docs/perf-notes.md)
STAGE_EXTRA_BYTES = 128  # a bulk pipeline's shared memory after its stages: the decode table, a copy a lane


def _dsl_version():
    import importlib.metadata as md

    try:
        return tuple(int(v) for v in md.version("nvidia-cutlass-dsl").split(".")[:2])
    except (md.PackageNotFoundError, ValueError):
        return (0, 0)


DSL_VERSION = _dsl_version()  # (major, minor): one tuning rule differs by the code the DSL generates

# ----------------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------------

_NAMES = ("a", "b", "sfa", "sfb", "sfa_permuted", "sfb_permuted", "c")


def _fail(exc, name, expected, got):
    raise exc(f"nvfp4_gemv: argument '{name}': expected {expected}, got {got}")


def _check_dtype(t, name, dtype):
    if not isinstance(t, torch.Tensor):
        _fail(TypeError, name, "a torch.Tensor", type(t).__name__)
    if t.is_nested or t.layout != torch.strided:
        _fail(TypeError, name, "a dense (strided) tensor", "a nested tensor" if t.is_nested else t.layout)
    if t.dtype != dtype:
        _fail(TypeError, name, f"dtype {dtype}", t.dtype)


def _check_shape(t, name, shape):
    if tuple(t.shape) != tuple(shape):
        _fail(ValueError, name, f"shape {tuple(shape)}", tuple(t.shape))


def check_inputs(data):
    """Validates ``data`` from tensor metadata only (no device sync).

    :return: ``(m, k, l, scales_on_gpu)``; raises ``TypeError``/``ValueError`` naming the argument.
    """
    if not isinstance(data, (tuple, list)) or len(data) != 7:
        got = f"{type(data).__name__} of length {len(data)}" if isinstance(data, (tuple, list)) else type(data).__name__
        _fail(TypeError, "data", "a tuple of 7 tensors (a, b, sfa, sfb, sfa_permuted, sfb_permuted, c)", got)
    a, b, sfa, sfb, sfa_p, sfb_p, c = data
    fp4, fp8 = torch.float4_e2m1fn_x2, torch.float8_e4m3fn
    for t, name, dt in zip(data, _NAMES, (fp4, fp4, fp8, fp8, fp8, fp8, torch.float16)):
        _check_dtype(t, name, dt)
    if a.dim() != 3:
        _fail(ValueError, "a", "a 3-d tensor [M, K/2, L]", f"{a.dim()}-d")
    m, k2, l = a.shape
    k = 2 * k2
    if m == 0 or m % 128:
        _fail(ValueError, "a", "M (dim 0) a positive multiple of 128", m)
    if k == 0 or k % 64:
        _fail(ValueError, "a", "K = 2 * dim 1 a positive multiple of 64", k)
    if k > MAX_K:
        _fail(ValueError, "a", f"K <= {MAX_K}", k)
    if l == 0:
        _fail(ValueError, "a", "L (dim 2) >= 1", l)
    _check_shape(b, "b", (128, k2, l))
    _check_shape(c, "c", (m, 1, l))
    sfk = k // 16
    _check_shape(sfa, "sfa", (m, sfk, l))
    _check_shape(sfb, "sfb", (128, sfk, l))
    _check_shape(sfa_p, "sfa_permuted", (32, 4, m // 128, 4, sfk // 4, l))
    _check_shape(sfb_p, "sfb_permuted", (32, 4, 1, 4, sfk // 4, l))

    # the plain scales are used where they share a's device; else (older official generators keep them
    # on the CPU) the permuted ones, which are always made on the GPU
    scales_on_gpu = sfa.device == a.device and sfb.device == a.device
    if a.stride(1) != 1 or a.stride(0) % 16 or a.data_ptr() % 16 or (l > 1 and a.stride(2) % 16):
        _fail(ValueError, "a", "K-contiguous rows (stride(1) == 1) at 16-byte aligned addresses",
              f"strides {a.stride()} at address {a.data_ptr():#x}")
    if b.stride(1) != 1 or b.data_ptr() % 16 or (l > 1 and b.stride(2) % 16):
        _fail(ValueError, "b", "a K-contiguous, 16-byte aligned vector (stride(1) == 1)",
              f"strides {b.stride()} at address {b.data_ptr():#x}")
    if scales_on_gpu:
        for t, name in ((sfa, "sfa"), (sfb, "sfb")):
            if t.stride(1) != 1 or t.stride(0) % 2 or t.data_ptr() % 2 or (l > 1 and t.stride(2) % 2):
                _fail(ValueError, name, "K-contiguous scales (stride(1) == 1) at 2-byte aligned addresses",
                      f"strides {t.stride()}")
    else:
        for t, name in ((sfa_p, "sfa_permuted"), (sfb_p, "sfb_permuted")):
            s = t.stride()
            if ((s[0], s[1], s[3], s[4]) != (16, 4, 1, 512) or (t.shape[2] > 1 and s[2] != 512 * (sfk // 4))
                    or (l > 1 and s[5] % 2) or t.data_ptr() % 2):
                _fail(ValueError, name, f"the generator's layout, strides (16, 4, {512 * (sfk // 4)}, 1, 512, "
                      "even) at an even address", s)
    for dim, size in ((0, m), (2, l)):
        if size > 1 and c.stride(dim) <= 0:
            _fail(ValueError, "c", "a writable tensor (no zero or negative stride along M or L)", f"strides {c.stride()}")
    dev = a.device
    if dev.type != "cuda":
        _fail(ValueError, "a", "a CUDA tensor", f"a tensor on {dev}")
    for t, name in ((b, "b"), (c, "c"), (sfa_p, "sfa_permuted"), (sfb_p, "sfb_permuted")):
        if t.device != dev:
            _fail(ValueError, name, f"a tensor on {dev} (where 'a' is)", f"a tensor on {t.device}")
    if not scales_on_gpu:
        for t, name in ((sfa, "sfa"), (sfb, "sfb")):
            if t.device.type != "cpu" and t.device != dev:
                _fail(ValueError, name, f"a tensor on {dev} (where 'a' is) or on the CPU", f"a tensor on {t.device}")
    return m, k, l, scales_on_gpu


# ----------------------------------------------------------------------------------------------------
# Layout helpers
# ----------------------------------------------------------------------------------------------------


def blocked_from_permuted(sf_permuted, l_idx):
    """cuBLAS blocked scale layout (what the reference's ``to_blocked`` makes) of batch ``l_idx``, taken
    from the ``[32, 4, rest_m, 4, rest_k, L]`` tensor: its memory order is (rest_m, rest_k, 32, 4, 4)."""
    return sf_permuted[..., l_idx].permute(2, 4, 0, 1, 3).reshape(-1)


# ----------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------


def _asm(ret_types, operands, text, constraints, loc=None, ip=None, volatile=False):
    ret = ret_types[0] if len(ret_types) == 1 else llvm.StructType.get_literal(ret_types)
    res = llvm.inline_asm(ret, [o.ir_value(loc=loc, ip=ip) for o in operands], text, constraints,
                          has_side_effects=volatile, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                          loc=loc, ip=ip)
    if len(ret_types) == 1:
        return [res]
    return [llvm.extractvalue(t, res, [i], loc=loc, ip=ip) for i, t in enumerate(ret_types)]


def _asm_store(operands, text, constraints, loc=None, ip=None):
    llvm.inline_asm(None, [o.ir_value(loc=loc, ip=ip) for o in operands], text, constraints,
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                    loc=loc, ip=ip)


@dsl_user_op
def ldg_stream_v4_if(addr, pred, *, loc=None, ip=None):
    """16-byte global load that does not allocate in L1 (``a`` is read exactly once), done where
    ``pred`` is non-zero; else zeros and no memory access."""
    r = _asm([T.i32()] * 4, [cutlass.Int64(addr), cutlass.Int32(pred)],
             "{\n.reg .pred p;\nsetp.ne.s32 p, $5, 0;\nmov.b32 $0, 0;\nmov.b32 $1, 0;\nmov.b32 $2, 0;\n"
             "mov.b32 $3, 0;\n@p ld.global.nc.L1::no_allocate.v4.u32 {$0, $1, $2, $3}, [$4];\n}",
             "=r,=r,=r,=r,l,r", loc, ip)
    return [cutlass.Int32(v) for v in r]


@dsl_user_op
def ldg_u16_if(addr, pred, *, loc=None, ip=None):
    r = _asm([T.i32()], [cutlass.Int64(addr), cutlass.Int32(pred)],
             "{\n.reg .pred p;\nsetp.ne.s32 p, $2, 0;\nmov.b32 $0, 0;\n@p ld.global.nc.u16 $0, [$1];\n}",
             "=r,l,r", loc, ip)
    return cutlass.Int32(r[0])


@dsl_user_op
def ldg_v4(addr, *, loc=None, ip=None):
    r = _asm([T.i32()] * 4, [cutlass.Int64(addr)],
             "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", loc, ip)
    return [cutlass.Int32(v) for v in r]


@dsl_user_op
def ldg_u16(addr, *, loc=None, ip=None):
    r = _asm([T.i32()], [cutlass.Int64(addr)], "ld.global.nc.u16 $0, [$1];", "=r,l", loc, ip)
    return cutlass.Int32(r[0])


@dsl_user_op
def e4m3x2_to_f32x2(v, *, loc=None, ip=None):
    """Two e4m3 scale bytes (low 16 bits of ``v``) to two fp32, NaN kept."""
    r = _asm([T.f32(), T.f32()], [cutlass.Int32(v)],
             "{\n.reg .b16 s, lo, hi;\n.reg .b32 h;\ncvt.u16.u32 s, $2;\ncvt.rn.f16x2.e4m3x2 h, s;\n"
             "mov.b32 {lo, hi}, h;\ncvt.f32.f16 $0, lo;\ncvt.f32.f16 $1, hi;\n}", "=f,=f,r", loc, ip)
    return cutlass.Float32(r[0]), cutlass.Float32(r[1])


@dsl_user_op
def fp4x16_dot_i8(x0, x1, w0, w1, w2, w3, tbl, *, loc=None, ip=None):
    """Exact ``sum(2a * 2b)`` over 16 values: ``x0, x1`` hold 16 e2m1 nibbles of ``a`` (value order),
    ``w0..w3`` the 16 int8 values ``2b``; ``tbl`` is ``E2M1_TIMES2_LO``, passed in so that one register
    serves every lookup.

    ``prmt`` with the table {0,1,2,3,4,6,8,12} maps a nibble's magnitude to ``2|v|``; a nibble whose
    sign bit is set selects in sign-replicate mode and gives 0 (the table bytes are positive). So the
    lookup of ``x`` keeps the positive values, the lookup of ``x ^ 0x88888888`` the negative ones.
    """
    r = _asm([T.i32()], [cutlass.Int32(v) for v in (x0, x1, w0, w1, w2, w3, tbl)],
             "{\n.reg .b32 n0, n1, h, p, q, s;\n"
             "xor.b32 n0, $1, 0x88888888;\nxor.b32 n1, $2, 0x88888888;\n"
             "prmt.b32 s, $7, 0x0C080604, $1;\ndp4a.s32.s32 p, s, $3, 0;\n"
             "prmt.b32 s, $7, 0x0C080604, n0;\ndp4a.s32.s32 q, s, $3, 0;\n"
             "shr.b32 h, $1, 16;\nprmt.b32 s, $7, 0x0C080604, h;\ndp4a.s32.s32 p, s, $4, p;\n"
             "shr.b32 h, n0, 16;\nprmt.b32 s, $7, 0x0C080604, h;\ndp4a.s32.s32 q, s, $4, q;\n"
             "prmt.b32 s, $7, 0x0C080604, $2;\ndp4a.s32.s32 p, s, $5, p;\n"
             "prmt.b32 s, $7, 0x0C080604, n1;\ndp4a.s32.s32 q, s, $5, q;\n"
             "shr.b32 h, $2, 16;\nprmt.b32 s, $7, 0x0C080604, h;\ndp4a.s32.s32 p, s, $6, p;\n"
             "shr.b32 h, n1, 16;\nprmt.b32 s, $7, 0x0C080604, h;\ndp4a.s32.s32 q, s, $6, q;\n"
             "sub.s32 $0, p, q;\n}", "=r,r,r,r,r,r,r,r", loc, ip)
    return cutlass.Int32(r[0])


@dsl_user_op
def fp4x8_to_i8(x, *, loc=None, ip=None):
    """8 e2m1 nibbles to 8 signed int8 ``2v`` (two words), for the one-time decode of ``b``."""
    r = _asm([T.i32(), T.i32()], [cutlass.Int32(x)],
             "{\n.reg .b32 t0, t1, n, h, p, q;\n"
             "mov.b32 t0, 0x03020100;\nmov.b32 t1, 0x0C080604;\nxor.b32 n, $2, 0x88888888;\n"
             "prmt.b32 p, t0, t1, $2;\nprmt.b32 q, t0, t1, n;\n"
             "or.b32 p, p, 0x80808080;\nsub.u32 p, p, q;\nxor.b32 $0, p, 0x80808080;\n"
             "shr.b32 h, $2, 16;\nshr.b32 n, n, 16;\nprmt.b32 p, t0, t1, h;\nprmt.b32 q, t0, t1, n;\n"
             "or.b32 p, p, 0x80808080;\nsub.u32 p, p, q;\nxor.b32 $1, p, 0x80808080;\n}",
             "=r,=r,r", loc, ip)
    return cutlass.Int32(r[0]), cutlass.Int32(r[1])


@dsl_user_op
def lds_v4(addr, *, loc=None, ip=None):
    r = _asm([T.i32()] * 4, [cutlass.Int32(addr)],
             "ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r", loc, ip)
    return [cutlass.Int32(v) for v in r]


@dsl_user_op
def lds_f32x2(addr, *, loc=None, ip=None):
    r = _asm([T.f32(), T.f32()], [cutlass.Int32(addr)], "ld.shared.v2.f32 {$0, $1}, [$2];", "=f,=f,r", loc, ip)
    return cutlass.Float32(r[0]), cutlass.Float32(r[1])


@dsl_user_op
def sts_v4(addr, v0, v1, v2, v3, *, loc=None, ip=None):
    _asm_store([cutlass.Int32(v) for v in (addr, v0, v1, v2, v3)], "st.shared.v4.u32 [$0], {$1, $2, $3, $4};",
               "r,r,r,r,r", loc, ip)


@dsl_user_op
def lds_u32(addr, *, loc=None, ip=None):
    r = _asm([T.i32()], [cutlass.Int32(addr)], "ld.shared.u32 $0, [$1];", "=r,r", loc, ip)
    return cutlass.Int32(r[0])


@dsl_user_op
def sts_u32(addr, v, *, loc=None, ip=None):
    _asm_store([cutlass.Int32(addr), cutlass.Int32(v)], "st.shared.u32 [$0], $1;", "r,r", loc, ip)


@dsl_user_op
def sts_f32x2(addr, v0, v1, *, loc=None, ip=None):
    _asm_store([cutlass.Int32(addr), cutlass.Float32(v0), cutlass.Float32(v1)], "st.shared.v2.f32 [$0], {$1, $2};",
               "r,f,f", loc, ip)


@dsl_user_op
def stg_f16(addr, v, *, loc=None, ip=None):
    _asm_store([cutlass.Int64(addr), cutlass.Float32(v)],
               "{\n.reg .b16 h;\ncvt.rn.f16.f32 h, $1;\nst.global.b16 [$0], h;\n}", "l,f", loc, ip)


def blocked_row(base, row64, tile_stride):
    """Address of a row's first scale in the 128x4 blocked layout (``to_blocked``; the permuted scales'
    memory order) from ``base``: 128-row tiles ``tile_stride`` bytes apart, in a tile 32 rows of 16 bytes,
    the four 32-row groups 4 bytes apart."""
    return base + (row64 >> 7) * tile_stride + (row64 & 31) * 16 + ((row64 >> 5) & 3) * 4


def scale_offset(c, blocked):
    """Byte offset, from a row's first scale, of the two scales of its 16-byte chunk ``c`` (scales 2c and
    2c + 1): adjacent, and in the blocked layout in groups of four 512 bytes apart."""
    if blocked:
        return cutlass.Int64((c >> 1) * 512 + (c & 1) * 2)
    return cutlass.Int64(2 * c)


def scaled_chunk_dot(acc, x, s16, w, sb0, sb1, tbl):
    """``acc`` (fp64) plus the scaled dot of one 16-byte chunk of ``a`` (32 values, 2 blocks; ``x`` its
    words, ``s16`` its two scale bytes) with ``b`` (``w`` 8 words of int8 ``2b``, ``sb0``/``sb1`` its
    scales / 4). Each block's term is exact in fp32 (an int below 2^12 times a product of two e4m3
    scales), so a row's only roundings are those of its fp64 sum, each at most 2^-53 of the running sum:
    rows whose blocks cancel keep their small remainder (an fp32 Kahan sum did not:
    tests/test_gpu_accuracy.py)."""
    sa0, sa1 = e4m3x2_to_f32x2(s16)
    d0 = fp4x16_dot_i8(x[0], x[1], w[0], w[1], w[2], w[3], tbl)
    d1 = fp4x16_dot_i8(x[2], x[3], w[4], w[5], w[6], w[7], tbl)
    acc = acc + cutlass.Float64(cutlass.Float32(d0) * (sa0 * sb0))
    return acc + cutlass.Float64(cutlass.Float32(d1) * (sa1 * sb1))


def b_in_registers(b_base, sfb_base, first, step, n, scale_offset, last=None):
    """Chunks ``first, first + step, ...`` (``n`` of them) of ``b`` as int8 ``2b`` (8 words a chunk) and
    their two scales / 4 as fp32: the share of ``b`` a lane keeps in registers. With ``last`` (the row's
    last chunk), the final one is clamped to it: a tail lane reads real scales, which its zero ``a``
    words and scales then cancel (a read past the row could decode an e4m3 NaN)."""
    wb, sb = [], []
    for i in range(n):
        ch = first + i * step
        if last is not None and i == n - 1:
            ch = cutlass.min(ch, last)
        x = ldg_v4(b_base + cutlass.Int64(ch) * 16)
        for w in range(4):
            wb += list(fp4x8_to_i8(x[w]))
        s0, s1 = e4m3x2_to_f32x2(ldg_u16(sfb_base + scale_offset(ch)))
        sb += [s0 * 0.25, s1 * 0.25]
    return wb, sb


def probe_sum(acc, x, s16):
    """The probe's stand-in for the arithmetic: keeps the loads alive, computes nothing useful."""
    return acc + cutlass.Float64(cutlass.Float32(x[0] ^ x[1] ^ x[2] ^ x[3] ^ s16))


def group_sum(acc, offsets):
    """Butterfly fp64 sum over the lanes that ``offsets`` span; every lane gets the total."""
    for off in offsets:
        acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=off)
    return acc


@dsl_user_op
def sts_f64(addr, v, *, loc=None, ip=None):
    _asm_store([cutlass.Int32(addr), cutlass.Float64(v)], "st.shared.f64 [$0], $1;", "r,d", loc, ip)


# Reads of a pipeline stage are ordered after the barrier wait: side effects keep LLVM from hoisting them.
@dsl_user_op
def lds_stage_v4(addr, *, loc=None, ip=None):
    r = _asm([T.i32()] * 4, [cutlass.Int32(addr)],
             "ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r", loc, ip, volatile=True)
    return [cutlass.Int32(v) for v in r]


@dsl_user_op
def lds_stage_u32(addr, *, loc=None, ip=None):
    r = _asm([T.i32()], [cutlass.Int32(addr)], "ld.shared.u32 $0, [$1];", "=r,r", loc, ip, volatile=True)
    return cutlass.Int32(r[0])


@dsl_user_op
def lds_stage_u16(addr, *, loc=None, ip=None):
    r = _asm([T.i32()], [cutlass.Int32(addr)], "ld.shared.u16 $0, [$1];", "=r,r", loc, ip, volatile=True)
    return cutlass.Int32(r[0])


@dsl_user_op
def lds_stage_f64(addr, *, loc=None, ip=None):
    r = _asm([T.f64()], [cutlass.Int32(addr)], "ld.shared.f64 $0, [$1];", "=d,r", loc, ip, volatile=True)
    return cutlass.Float64(r[0])


@dsl_user_op
def mbar_init(addr, count, *, loc=None, ip=None):
    _asm_store([cutlass.Int32(addr), cutlass.Int32(count)], "mbarrier.init.shared::cta.b64 [$0], $1;", "r,r",
               loc, ip)


@dsl_user_op
def mbar_init_fence(*, loc=None, ip=None):
    _asm_store([], "fence.mbarrier_init.release.cluster;", "", loc, ip)


@dsl_user_op
def mbar_arrive(addr, *, loc=None, ip=None):
    _asm_store([cutlass.Int32(addr)], "mbarrier.arrive.shared::cta.b64 _, [$0];", "r", loc, ip)


@dsl_user_op
def mbar_arrive_expect_tx(addr, nbytes, *, loc=None, ip=None):
    _asm_store([cutlass.Int32(addr), cutlass.Int32(nbytes)],
               "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", "r,r", loc, ip)


@dsl_user_op
def mbar_wait(addr, parity, *, loc=None, ip=None):
    """Spins until the barrier's phase of parity ``parity`` has completed."""
    _asm_store([cutlass.Int32(addr), cutlass.Int32(parity)],
               "{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1;\n"
               "@!p bra WAIT;\n}", "r,r", loc, ip)


@dsl_user_op
def bulk_g2s(dst, src, nbytes, mbar, evict_first=False, *, loc=None, ip=None):
    """Bulk copy (the TMA engine, no tensor map) of ``nbytes`` contiguous bytes, 16-byte aligned, from
    global to shared memory; completion is counted on ``mbar``. ``evict_first``: the lines are the L2's
    first candidates for eviction."""
    ops = [cutlass.Int32(dst), cutlass.Int64(src), cutlass.Int32(nbytes), cutlass.Int32(mbar)]
    if evict_first:
        _asm_store(ops, "{\n.reg .b64 pol;\ncreatepolicy.fractional.L2::evict_first.b64 pol, 1.0;\n"
                   "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
                   " [$0], [$1], $2, [$3], pol;\n}", "r,l,r,r", loc, ip)
    else:
        _asm_store(ops, "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
                   "r,l,r,r", loc, ip)


@dsl_user_op
def atom_add_one(addr, *, loc=None, ip=None):
    r = _asm([T.i32()], [cutlass.Int64(addr)], "atom.global.add.u32 $0, [$1], 1;", "=r,l", loc, ip, volatile=True)
    return cutlass.Int32(r[0])


@dsl_user_op
def st_relaxed_u32(addr, v, *, loc=None, ip=None):
    """A strong store at GPU scope: with the claims' atomics (relaxed, GPU scope) to the same word it is
    morally strong, so the memory model orders it with them instead of calling it a data race."""
    _asm_store([cutlass.Int64(addr), cutlass.Int32(v)], "st.relaxed.gpu.global.u32 [$0], $1;", "l,r", loc, ip)


@dsl_user_op
def trap(*, loc=None, ip=None):
    _asm_store([], "trap;", "", loc, ip)


@cute.jit
def stage_buffers(tidx, stages: cutlass.Constexpr, stage_bytes: cutlass.Constexpr, part_bytes: cutlass.Constexpr,
                  smem_bytes: cutlass.Constexpr, consumers: cutlass.Constexpr):
    """The shared memory of a bulk-copy pipeline: ``stages`` tiles, then a partial-sum block a stage, then a
    ``full`` and an ``empty`` mbarrier a stage (``consumers`` arrivals empty one), initialised by thread 0
    before a CTA barrier, then the decode table, a copy a lane (``STAGE_EXTRA_BYTES``). Returns the four
    base addresses and the table, read back from shared memory: ptxas copies a constant or warp-uniform
    table from a uniform register into a fresh register before every ``prmt`` (50 of the 344 instructions
    of the K = 16384 loop); a lane's own copy is neither."""
    smem = SmemAllocator()
    s_buf = smem.allocate_tensor(cutlass.Int32, cute.make_layout(smem_bytes // 4), byte_alignment=128)
    s_tiles = s_buf.iterator.toint()
    s_part = s_tiles + stages * stage_bytes
    s_full = s_part + stages * part_bytes
    s_empty = s_full + 8 * stages
    s_tbl = s_empty + 8 * stages + 4 * (tidx % 32)
    if tidx == 0:
        for s in cutlass.range_constexpr(stages):
            mbar_init(s_full + 8 * s, 1)
            mbar_init(s_empty + 8 * s, consumers)
        mbar_init_fence()
    if tidx < 32:
        sts_u32(s_tbl, cutlass.Int32(E2M1_TIMES2_LO))
    cute.arch.sync_threads()
    return s_tiles, s_part, s_full, s_empty, lds_stage_u32(s_tbl)


@cute.jit
def copy_tile(lane, row0, dst, full, src, src_rs, sf_src, sf_rs, rows: cutlass.Constexpr, row_bytes: cutlass.Constexpr,
              sf_bytes: cutlass.Constexpr, evict: cutlass.Constexpr):
    """A producer warp's bulk copies of one tile: lane 0 announces the stage's bytes on its ``full``
    barrier, then lane ``i < rows`` copies row ``row0 + i`` and its scales to ``dst`` (the tile's rows, then
    their scales)."""
    cute.arch.sync_warp()
    if lane == 0:
        mbar_arrive_expect_tx(full, rows * (row_bytes + sf_bytes))
    cute.arch.sync_warp()
    if lane < rows:
        row = cutlass.Int64(row0 + lane)
        bulk_g2s(dst + lane * row_bytes, src + row * src_rs, row_bytes, full, evict)
        bulk_g2s(dst + rows * row_bytes + lane * sf_bytes, sf_src + row * sf_rs, sf_bytes, full, evict)


class _GemvLaunch:
    """What every kernel class shares: the 17 run-time arguments (five data addresses, the bulk kernel's
    tile counters, M, strides in bytes, the grid), one launch on ``stream`` with the subclass's block,
    shared memory and occupancy, and the typed kernel entry, which runs the subclass's ``body``."""

    @cute.jit
    def __call__(self, a_ptr: cutlass.Int64, b_ptr: cutlass.Int64, sfa_ptr: cutlass.Int64,
                 sfb_ptr: cutlass.Int64, c_ptr: cutlass.Int64, ctr_ptr: cutlass.Int64, m: cutlass.Int32,
                 a_rs: cutlass.Int64, a_ls: cutlass.Int64, b_ls: cutlass.Int64,
                 sfa_rs: cutlass.Int64, sfa_ls: cutlass.Int64, sfb_ls: cutlass.Int64,
                 c_rs: cutlass.Int64, c_ls: cutlass.Int64, grid_x: cutlass.Int32, num_l: cutlass.Int32,
                 stream):
        self.kernel(a_ptr, b_ptr, sfa_ptr, sfb_ptr, c_ptr, ctr_ptr, m, a_rs, a_ls, b_ls, sfa_rs, sfa_ls, sfb_ls,
                    c_rs, c_ls).launch(grid=[grid_x, num_l, 1], block=[self.threads, 1, 1],
                                       smem=self.smem_bytes, stream=stream, min_blocks_per_mp=self.min_blocks)

    @cute.kernel
    def kernel(self, a_ptr: cutlass.Int64, b_ptr: cutlass.Int64, sfa_ptr: cutlass.Int64,
               sfb_ptr: cutlass.Int64, c_ptr: cutlass.Int64, ctr_ptr: cutlass.Int64, m: cutlass.Int32,
               a_rs: cutlass.Int64, a_ls: cutlass.Int64, b_ls: cutlass.Int64,
               sfa_rs: cutlass.Int64, sfa_ls: cutlass.Int64, sfb_ls: cutlass.Int64,
               c_rs: cutlass.Int64, c_ls: cutlass.Int64):
        self.body(a_ptr, b_ptr, sfa_ptr, sfb_ptr, c_ptr, ctr_ptr, m, a_rs, a_ls, b_ls, sfa_rs, sfa_ls, sfb_ls, c_rs,
                  c_ls)


class Nvfp4Gemv(_GemvLaunch):
    """Batched NVFP4 GEMV; one instance per (K, scale layout, tuning): see the module docstring."""

    threads = 256
    min_blocks = 4  # caps registers at 64: 1024 threads a SM
    tail = False  # Nvfp4GemvSplit: lanes whose last chunk lies past the row (K % (1024 * split) != 0)
    sf_wide = 0  # the scales in 16-byte loads (streaming kernel only; __init__)

    def __init__(self, k: int, blocked_scales: bool, group=None, batch=None, min_blocks=None, depth=None,
                 probe=0, sf_wide=0):
        self.k = k
        self.blocked_scales = blocked_scales
        self.chunks = k // 32  # 16-byte chunks of a row: 32 values, 2 scale blocks
        self.group = group or self._group_size(self.chunks)
        self.per_lane = self.chunks // self.group
        self.row_lanes = self.group  # lanes that share a row (Nvfp4GemvSplit: several warps)
        # Chunks a lane loads per work unit; a whole short row at once (measured best for K = 2048),
        # else 2, or 3 where the row splits in threes (K = 4608: 11.1 us against 12.8 for 1).
        self.batch = batch or (4 if self.per_lane == 4 else 2 if self.per_lane % 2 == 0
                               else 3 if self.per_lane % 3 == 0 else 1)
        if self.chunks % self.group or self.per_lane % self.batch or 32 % self.group or self.group < 2:
            raise ValueError(f"nvfp4_gemv: K={k}: group {self.group} and batch {self.batch} must divide "
                             f"the {self.chunks} chunks of a row")
        self.rows_per_cta = self.threads // self.group
        self.shuffle_offsets = [self.group >> (i + 1) for i in range(self.group.bit_length() - 1)]
        # A lane's whole share of the row in one unit of 4 chunks (K = 256..2048) leaves b's share
        # loop-invariant: DSL 4.8 keeps it in registers and spills at 3 CTAs' 85 (K = 2048 on H200: 18.1
        # us against 16.3 with 2 CTAs); 2 CTAs measured the same as 3 on 4.3 (14.58 / 14.53 us).
        self.min_blocks = min_blocks or (2 if self.batch == self.per_lane == 4 else 3 if self.batch >= 3
                                         else self.min_blocks)
        self.depth = depth or 2  # work units in registers: depth - 1 in flight while one computes
        self.probe = probe  # 1: skip the arithmetic (measures the memory side alone; wrong results)
        self.smem_bytes = 40 * self.chunks + 16  # int8 b (32 B) + two fp32 sfb (8 B) a chunk; the table
        # sf_wide: a unit's scales (2 * batch * group bytes a row) come in 16-byte loads by its first lanes
        # and reach the others through shared memory (two buffers a warp, by unit parity)
        self.sf_wide = sf_wide
        self.sf_pieces = self.batch * self.group // 8
        self.sf_row_bytes = self.sf_warp_bytes = 0
        if sf_wide:
            if blocked_scales or self.group < 8 or self.sf_pieces > self.group:
                raise ValueError(f"nvfp4_gemv: K={k}: sf_wide needs the plain scales, 8+ lanes a row and a unit "
                                 f"of at most 8 chunks a lane (group {self.group}, batch {self.batch})")
            self.sf_row_bytes = 2 * self.batch * self.group  # a multiple of 16: 16-byte loads stay in the row
            self.sf_warp_bytes = 2 * (32 // self.group) * self.sf_row_bytes
            self.smem_bytes += (self.threads // 32) * self.sf_warp_bytes

    @staticmethod
    def _group_size(chunks):
        # Lanes per row: a power of two up to 16 that divides the chunk count (no tail), small enough
        # that each lane keeps >= 4 chunks when the row allows. 16 beat 32 on H200 (K = 7168: 41 us
        # against 49 for 4096 x 7168 x 8): two rows a warp, half the shuffles per byte.
        g = 2  # chunks is even (K % 64 == 0), and 256 // g rows a CTA then divides M
        while g < 16 and chunks % (2 * g) == 0 and chunks // (2 * g) >= 4:
            g *= 2
        return g

    @staticmethod
    def shape_tuning(k, m, l, sms):
        """Tuning for one problem size, ``()`` for the per-K streaming default.

        A problem that fits in one wave of CTAs is latency-bound, not bandwidth-bound: the streaming
        config gives a CTA 8-16 rows and each lane a chain of dependent units, which leaves most SMs
        idle on small M * L. There, up to a whole warp takes a row and every lane loads its share of
        the row in one unit, so a row costs one memory round trip."""
        chunks = k // 32
        group = min(32, chunks & -chunks)
        per_lane = chunks // group
        ctas = -(-m * group // Nvfp4Gemv.threads) * l
        if group < 2 or per_lane > 12 or ctas > 2 * sms:
            return ()
        # All of a lane's arithmetic waits for its last byte; with 8+ chunks a lane and two CTAs on some
        # SMs that tail costs more than the streaming kernel's overlap, where its units hold 3+ chunks
        # (K = 4608 and 2304 on 192-256 CTAs: 0.9-1.0 us; on 96-128 CTAs the latency config wins)
        if per_lane >= 8 and ctas > sms and Nvfp4Gemv(k, False).batch >= 3:
            return ()
        return (("batch", per_lane), ("group", group), ("min_blocks", 2))

    @staticmethod
    def wide_tuning(k, dsl=None):
        """The streaming default with ``sf_wide`` for the unit shapes where it measured faster, ``()``
        elsewhere: small scale loads cost the streaming kernel more than their bytes (4096x4096x4: 2.0 us for
        its 4.2 MB of ``sfa``). Units of 4 chunks (a lane's whole share of the row) then run 3 CTAs a SM:
        7168x2048x4 14.6 -> 14.2 us, 16384x2048x1 10.9 -> 10.8; 4 were faster on some shapes (10.5 there) but
        spill on DSL 4.8. Except over 8 lanes (K = 1024) on DSL 4.4+ (``dsl``, default the installed one):
        there 3 CTAs measured 0.4-1.4 us slower than 2 on 4.8.1 (7168x1024x4 10.8 against 10.2), faster on
        4.3.5 (9.9 against 10.2). Where a lane's share divides in fours over 16 lanes below the bulk kernel's K
        (K = 4096, 6144), units of 4 chunks (each row's scales in 128-byte pieces, not 64) at 3 CTAs: 4096x4096x4
        16.0 -> 15.4-15.5 us, 2048x6144x2 10.3 -> 9.4; 16384x4096x1 alone mixed (0.13-0.28 slower in one sweep,
        0.4 faster in another call; 2 CTAs there 0.45-0.7 faster than 3). Longer rows where the bulk kernel does not
        apply keep units of 2 (not measured). Units of 3 chunks (K = 4608) measured no gain; units of 1 were not
        measured."""
        try:
            op = Nvfp4Gemv(k, False, sf_wide=1)  # needs 8+ lanes a row: then K % 256 == 0 and sfa rows of 16 bytes
        except ValueError:
            return ()
        if op.batch == 4 and op.group == 8 and (dsl or DSL_VERSION) >= (4, 4):
            return (("sf_wide", 1),)  # the default for a lane's whole row share: 2 CTAs a SM
        if op.batch == 4:
            return (("min_blocks", 3), ("sf_wide", 1))
        if op.batch == 2 and op.group == 16:
            if op.per_lane % 4 == 0 and k < BULK_MIN_K:
                return (("batch", 4), ("min_blocks", 3), ("sf_wide", 1))
            return (("sf_wide", 1),)
        return ()

    def grid_x(self, m, l, sms):
        # one wave of CTAs spread over the batch, each with at least one warp of rows; rounded down, so that
        # no CTA waits for a second wave (4096x2048x8 at 3 a SM: 400 CTAs for 396 slots took 2 us more)
        return max(1, min(-(-m // self.rows_per_cta), sms * self.ctas_per_sm() // l))

    def ctas_per_sm(self):
        # 228 KiB of shared memory a SM on sm_90 and sm_100, 1 KiB of it reserved for each CTA
        return max(1, min(self.min_blocks, 233472 // (self.smem_bytes + 1024)))

    def _scale_offset(self, c):
        return scale_offset(c, self.blocked_scales)

    @cute.jit
    def _chunk_dot(self, acc, x, s16, c, s_b0, s_b1, s_sf, tbl):
        """``scaled_chunk_dot`` of chunk ``c`` with ``b`` read from shared memory."""
        if cutlass.const_expr(self.probe):
            return probe_sum(acc, x, s16)
        w = lds_v4(s_b0 + c * 16) + lds_v4(s_b1 + c * 16)
        sb0, sb1 = lds_f32x2(s_sf + c * 8)
        return scaled_chunk_dot(acc, x, s16, w, sb0, sb1, tbl)

    @cute.jit
    def body(self, a_ptr, b_ptr, sfa_ptr, sfb_ptr, c_ptr, ctr_ptr, m, a_rs, a_ls, b_ls, sfa_rs, sfa_ls, sfb_ls, c_rs,
             c_ls):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, _ = cute.arch.block_idx()
        gdimx, _, _ = cute.arch.grid_dim()
        G = self.group
        C = self.chunks
        nb = self.per_lane // self.batch

        smem = SmemAllocator()
        s_buf = smem.allocate_tensor(cutlass.Int32, cute.make_layout(self.smem_bytes // 4), byte_alignment=16)
        s_b0 = s_buf.iterator.toint()  # int8 b, first 16 values of each chunk, 16 B apart
        s_b1 = s_b0 + 16 * C  # last 16 values of each chunk
        s_sf = s_b1 + 16 * C  # sfb / 4 as fp32, 2 per chunk
        s_tbl = s_sf + 8 * C

        l_idx = cutlass.Int64(bidy)
        lane = tidx % G
        a_base = a_ptr + l_idx * a_ls
        sfa_base = sfa_ptr + l_idx * sfa_ls
        c_base = c_ptr + l_idx * c_ls
        step, n_units, row, pipe, irow, ibt = self._first_units(tidx, bidx, gdimx, m, lane, a_base, sfa_base,
                                                                a_rs, sfa_rs)
        bt = cutlass.Int32(0)

        b_base = b_ptr + l_idx * b_ls
        sfb_base = sfb_ptr + l_idx * sfb_ls
        for c in cutlass.range(tidx, C, self.threads):
            x = ldg_v4(b_base + cutlass.Int64(c) * 16)
            w0, w1 = fp4x8_to_i8(x[0])
            w2, w3 = fp4x8_to_i8(x[1])
            w4, w5 = fp4x8_to_i8(x[2])
            w6, w7 = fp4x8_to_i8(x[3])
            sts_v4(s_b0 + c * 16, w0, w1, w2, w3)
            sts_v4(s_b1 + c * 16, w4, w5, w6, w7)
            s0, s1 = e4m3x2_to_f32x2(ldg_u16(sfb_base + self._scale_offset(c)))
            sts_f32x2(s_sf + c * 8, s0 * 0.25, s1 * 0.25)
        if tidx == 0:
            sts_u32(s_tbl, cutlass.Int32(E2M1_TIMES2_LO))
        cute.arch.sync_threads()
        # Read back from shared memory, the table is opaque to ptxas: one register holds it, instead
        # of a copy from a uniform register before every prmt.
        tbl = lds_u32(s_tbl)

        acc = cutlass.Float64(0.0)
        s_scr = s_tbl + 16 + (tidx // 32) * self.sf_warp_bytes + ((tidx % 32) // G) * self.sf_row_bytes
        for _u in cutlass.range(n_units, unroll=1):
            pipe.append(self._load_unit(irow, ibt, irow < m, lane, a_base, sfa_base, a_rs, sfa_rs))
            irow, ibt = self._next_unit(irow, ibt, step)
            cur = pipe[0]
            c0 = lane + bt * (self.batch * G)
            if cutlass.const_expr(self.sf_wide):
                scr = s_scr + (_u & 1) * (self.sf_warp_bytes // 2)
                if lane < self.sf_pieces:
                    sw = cur[4 * self.batch:4 * self.batch + 4]
                    sts_v4(scr + lane * 16, sw[0], sw[1], sw[2], sw[3])
                cute.arch.sync_warp()
                s16s = [lds_stage_u16(scr + 2 * (lane + i * G)) for i in range(self.batch)]
            else:
                s16s = cur[4 * self.batch:5 * self.batch]
            for i in cutlass.range_constexpr(self.batch):
                acc = self._chunk_dot(acc, cur[4 * i:4 * i + 4], s16s[i], c0 + i * G, s_b0,
                                      s_b1, s_sf, tbl)
            if bt == nb - 1:
                acc = group_sum(acc, self.shuffle_offsets)
                if lane == 0:
                    stg_f16(c_base + cutlass.Int64(row) * c_rs, cutlass.Float32(acc))
                acc = cutlass.Float64(0.0)
            row, bt = self._next_unit(row, bt, step)
            pipe = pipe[1:]

    @cute.jit
    def _first_units(self, tidx, bidx, gdimx, m, lane, a_base, sfa_base, a_rs, sfa_rs):
        """``(step, n_units, row, pipe, irow, ibt)``: this thread's work units and the loads of the first
        ``depth - 1`` of them, issued. Work units are (row, batch of chunks); rows are grid-strided, so at
        any time the CTAs stream neighbouring rows. M % 128 == 0 makes the unit count warp-uniform, so the
        shuffles run with every lane of the warp. Software pipeline: the loads of units u + 1 .. u + depth
        - 1 are in flight while unit u is computed; the first ones also overlap the decode of b that
        follows. (irow, ibt) is the next unit to load."""
        step = gdimx * self.rows_per_cta
        warp_row0 = bidx * self.rows_per_cta + (tidx // 32) * (32 // self.group)
        n_units = cutlass.Int32(0)
        if warp_row0 < m:
            n_units = (m - warp_row0 + step - 1) // step * (self.per_lane // self.batch)
        row = bidx * self.rows_per_cta + tidx // self.group
        pipe = []
        irow = row
        ibt = cutlass.Int32(0)
        for _j in cutlass.range_constexpr(self.depth - 1):
            pipe.append(self._load_unit(irow, ibt, irow < m, lane, a_base, sfa_base, a_rs, sfa_rs))
            irow, ibt = self._next_unit(irow, ibt, step)
        return step, n_units, row, pipe, irow, ibt

    @cute.jit
    def _next_unit(self, row, bt, step):
        nrow = row
        nbt = bt + 1
        if nbt == self.per_lane // self.batch:
            nbt = cutlass.Int32(0)
            nrow = row + step
        return nrow, nbt

    @cute.jit
    def _load_unit(self, row, bt, valid, lane, a_base, sfa_base, a_rs, sfa_rs):
        """Issues the loads of one work unit: ``batch`` chunks of ``a`` (4 words each), then their scales.
        Past the last unit (``valid`` false) the loads are predicated off (zeros, unused)."""
        row64 = cutlass.Int64(0)
        pred = cutlass.Int32(0)
        if valid:
            row64 = cutlass.Int64(row)
            pred = cutlass.Int32(1)
        a_row = a_base + row64 * a_rs
        if cutlass.const_expr(self.blocked_scales):
            sfa_row = blocked_row(sfa_base, row64, sfa_rs)
        else:
            sfa_row = sfa_base + row64 * sfa_rs
        c0 = lane + bt * (self.batch * self.row_lanes)
        preds = [pred] * self.batch
        if cutlass.const_expr(self.tail):  # only the last chunk of a lane can lie past the row
            preds[-1] = pred & cutlass.Int32(c0 + (self.batch - 1) * self.row_lanes < self.chunks)
        words = []
        for i in cutlass.range_constexpr(self.batch):
            words += ldg_stream_v4_if(a_row + cutlass.Int64(c0 + i * self.row_lanes) * 16, preds[i])
        if cutlass.const_expr(self.sf_wide):
            words += ldg_stream_v4_if(sfa_row + bt * self.sf_row_bytes + lane * 16,
                                      pred & cutlass.Int32(lane < self.sf_pieces))
        else:
            for i in cutlass.range_constexpr(self.batch):
                words.append(ldg_u16_if(sfa_row + self._scale_offset(c0 + i * self.row_lanes), preds[i]))
        return words


class Nvfp4GemvSplit(Nvfp4Gemv):
    """Kernel for problems that fit in one wave of CTAs (or two, where no split fits one), where the time
    after the last byte lands counts: each row is split over ``split`` whole warps, so a lane has only
    ``n = ceil(K / (1024 * split))`` chunks of arithmetic and the SMs have many warps to issue it (where
    the split does not divide the row, the last chunk of the last lanes is predicated off). A CTA holds
    ``rows`` rows, once each (no grid-stride, no loop). A lane loads its chunks of ``a`` and ``sfa``
    first, then its chunks of ``b`` and ``sfb``, which stay in registers (no shared-memory staging, no
    barrier before the arithmetic). Warps add their lanes' terms with a butterfly and meet in shared
    memory."""

    def __init__(self, k: int, blocked_scales: bool, split=2, rows=1, min_blocks=4, probe=0):
        self.k = k
        self.blocked_scales = blocked_scales
        self.chunks = k // 32
        self.split = split
        self.row_lanes = 32 * split
        if split < 2 or self.row_lanes > 1024 or (split - 1) * 32 >= self.chunks:
            raise ValueError(f"nvfp4_gemv: K={k}: split {split} must be 2..32 warps a row, each with a "
                             f"chunk of its {self.chunks}")
        self.group = 32
        self.batch = self.per_lane = -(-self.chunks // self.row_lanes)
        self.tail = self.chunks % self.row_lanes != 0
        self.rows_per_cta = rows
        self.threads = rows * self.row_lanes
        self.min_blocks = min_blocks
        self.probe = probe
        self.shuffle_offsets = [16, 8, 4, 2, 1]
        self.smem_bytes = 8 * (self.threads // 32)

    @staticmethod
    def shape_tuning(k, m, l, sms, long_tails=False):
        """The split for a problem whose threads all fit on the GPU at once (one chunk a lane where
        possible, else up to four: more spill registers), ``()`` where none does or rows are shorter
        than two warps' chunks; the largest split whose CTAs all fit at the occupancy they ask for, else
        (CTAs whose threads do not fill the SM's) the largest whose threads fit, in two waves. Where the
        split does not divide the row, the last chunk of some lanes lies past it (512x1536x2: 6.30 us
        against 6.59 for the latency config, two-GPU H200). A CTA gets up to 512 threads (measured
        0.05-0.15 us faster than 256 on 384x7168x2 and 512x4096x2) or up to 256 where that puts fewer
        threads on the busiest SM and keeps two rows a CTA (768x11264x1: 192 CTAs of 512 leave 60 SMs
        two, 384 of 256 leave none more than three: 7.20 -> 6.72 us); the occupancy hint caps registers
        so that the threads fit. ``long_tails``: such a tail also at 2-4 chunks a lane, for pick_tuning
        where the alternative is the bulk kernel."""
        chunks = k // 32
        warps = -(-chunks // 32)  # warps a row at one chunk a lane
        two_waves = ()  # the largest split whose threads fit but whose CTAs take two waves
        for split in range(warps, 1, -1):
            n = -(-chunks // (32 * split))
            lanes = 32 * split
            threads_a_sm = 1536 if n == 1 else 1024  # more chunks a lane, more registers
            if n > 4 or m * l * lanes > sms * threads_a_sm:
                continue
            # A tail at several chunks a lane only as measured: against the bulk kernel (2048x7168x1 split
            # 2 7.62 us, bulk 7.81; 768x11264x1 split 4 7.46, bulk 7.90), with a power-of-two split (CTAs
            # of a power of two threads fill the 1024 a SM) and the row filling 85% of the lanes' chunks
            if n > 1 and chunks % lanes and (not long_tails or split & (split - 1)
                                             or chunks < 0.85 * n * lanes):
                continue
            best, first = None, None
            for cap in (512, 256):
                rows = 1 << max(0, (cap // lanes).bit_length() - 1)
                if cap == 256 and rows < 2:  # one-row CTAs each fetch b from L2 (128x7232x1: +0.16 us)
                    continue
                per_sm = max(1, threads_a_sm // (rows * lanes))
                tuning = (("min_blocks", per_sm), ("rows", rows), ("split", split))
                first = first or tuning
                busiest = -(-(-(-m // rows) * l) // sms)  # CTAs on the busiest SM, spread breadth-first
                if busiest <= per_sm and (best is None or busiest * rows < best[0]):  # ties: the larger CTA
                    best = (busiest * rows, tuning)
            if best:
                return best[1]
            # A smaller split may fit one wave (128x22528x3: split 8 7.26 us, split 11 7.52); where none
            # does, the two waves still beat the alternatives (384x4160x3: 5.92 us, streaming 38.5)
            two_waves = two_waves or first
        return two_waves

    def grid_x(self, m, l, sms):
        return -(-m // self.rows_per_cta)

    @cute.jit
    def body(self, a_ptr, b_ptr, sfa_ptr, sfb_ptr, c_ptr, ctr_ptr, m, a_rs, a_ls, b_ls, sfa_rs, sfa_ls, sfb_ls, c_rs,
             c_ls):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, _ = cute.arch.block_idx()
        n = self.per_lane
        tr = self.row_lanes
        l_idx = cutlass.Int64(bidy)
        jl = tidx % tr
        row = bidx * self.rows_per_cta + tidx // tr
        valid = row < m  # the same for a whole warp
        xw = self._load_unit(row, cutlass.Int32(0), valid, jl, a_ptr + l_idx * a_ls, sfa_ptr + l_idx * sfa_ls,
                             a_rs, sfa_rs)
        wb, sb = b_in_registers(b_ptr + l_idx * b_ls, sfb_ptr + l_idx * sfb_ls, jl, tr, n, self._scale_offset,
                                self.chunks - 1 if self.tail else None)
        tbl = cutlass.Int32(E2M1_TIMES2_LO)
        acc = cutlass.Float64(0.0)
        for i in cutlass.range_constexpr(n):
            x = xw[4 * i:4 * i + 4]
            s16 = xw[4 * n + i]
            if cutlass.const_expr(self.probe):
                acc = probe_sum(acc, x, s16)
            else:
                acc = scaled_chunk_dot(acc, x, s16, wb[8 * i:8 * i + 8], sb[2 * i], sb[2 * i + 1], tbl)
        acc = group_sum(acc, self.shuffle_offsets)
        smem = SmemAllocator()
        s_buf = smem.allocate_tensor(cutlass.Int32, cute.make_layout(self.smem_bytes // 4), byte_alignment=16)
        s_red = s_buf.iterator.toint()  # one fp64 a warp, a row's warps side by side
        if tidx % 32 == 0:
            sts_f64(s_red + (tidx // 32) * 8, acc)
        cute.arch.sync_threads()
        out_row = bidx * self.rows_per_cta + tidx
        if tidx < self.rows_per_cta and out_row < m:
            slot = s_red + tidx * (8 * self.split)
            acc = lds_stage_f64(slot)
            for w in cutlass.range_constexpr(1, self.split):
                acc = acc + lds_stage_f64(slot + 8 * w)
            stg_f16(c_ptr + l_idx * c_ls + cutlass.Int64(out_row) * c_rs, cutlass.Float32(acc))


class Nvfp4GemvBulk(_GemvLaunch):
    """Streaming kernel that feeds whole rows of ``a`` and ``sfa`` to shared memory with bulk copies
    (the TMA engine, no tensor map): tens of kilobytes a SM in flight for the cost of a few instructions.

    A CTA works on one batch index. One producer warp keeps ``stages`` tiles of ``rows`` rows in flight
    (one copy of a row's ``K/2`` bytes of ``a`` and one of its ``K/16`` scale bytes, counted on the
    stage's ``full`` barrier); ``warps`` consumer warps each own a fixed set of chunks of a tile (``tr``
    threads a row, ``n`` chunks a thread), so their part of ``b`` stays in registers for the whole
    kernel. A consumer writes its row's partial (fp64) to shared memory and
    arrives on the stage's ``empty`` barrier; the producer adds the parts, writes ``c`` and refills the
    stage. Needs the plain scales and ``K % 256 == 0`` (16-byte aligned rows of ``sfa``). ``dynamic``: tiles
    after each CTA's first ``stages`` are claimed at run time (``_produce_dynamic``)."""

    def __init__(self, k: int, blocked_scales: bool, bulk=1, warps=4, ctas=2, stages=3, max_n=4, evict=1,
                 probe=0, dynamic=0):
        if blocked_scales or k % 256:
            raise ValueError(f"nvfp4_gemv: the bulk-copy kernel needs the plain scales and K % 256 == 0, "
                             f"got K={k}, blocked={blocked_scales}")
        self.k = k
        self.blocked_scales = False
        self.chunks = c = k // 32
        self.warps = warps
        self.ctas = ctas
        self.probe = probe
        self.evict = evict
        nc = 32 * warps
        # threads a row: the fewest (>= 8, so that 8 lanes read 128 contiguous bytes) that leave each
        # thread at most max_n chunks (its share of b lives in registers), else the most that divide
        fits = [t for t in (8, 16, 32, 64, 128, 256) if t <= nc and c % t == 0]
        if not fits:
            raise ValueError(f"nvfp4_gemv: K={k}: no split of a row over {nc} threads")
        tr = next((t for t in fits if c // t <= max_n), fits[-1])
        self.tr = tr
        self.n = c // tr
        self.rows = nc // tr
        if 128 % self.rows:
            raise ValueError(f"nvfp4_gemv: {self.rows} rows a tile do not divide M")
        self.parts = max(1, tr // 32)
        self.group = min(tr, 32)
        self.shuffle_offsets = [self.group >> (i + 1) for i in range(self.group.bit_length() - 1)]
        self.row_a = k // 2
        self.row_sf = k // 16
        self.stage_bytes = self.rows * (self.row_a + self.row_sf)
        self.part_bytes = self.rows * self.parts * 8
        self.stages = stages
        self.dynamic = dynamic
        self.smem_bytes = self.stages * (self.stage_bytes + self.part_bytes + 16) + STAGE_EXTRA_BYTES
        if dynamic:  # the tile index of each stage
            self.smem_bytes += -(-4 * stages // 16) * 16
        if self.smem_bytes + 1024 > 233472 // ctas:
            raise ValueError(f"nvfp4_gemv: K={k}: {stages} stages of {self.stage_bytes} bytes exceed the "
                             f"shared memory of {ctas} CTAs a SM")
        self.threads = nc + 32
        self.min_blocks = ctas

    @staticmethod
    def suits(k):
        """Rows long enough for the bulk path to pay (K >= 7168, measured) that it can split evenly."""
        try:
            return k >= BULK_MIN_K and Nvfp4GemvBulk(k, False).n <= 12
        except ValueError:
            return False

    @staticmethod
    def claim_count(n_tiles, gdimx, stages, vmax=max, vmin=min):
        """The claims a dynamic launch makes on a batch index's counter: one a tile past the static ones,
        plus, for each CTA whose last static step has a tile, the one claim past the last tile that ends it."""
        dyn = stages * gdimx
        return vmax(n_tiles - dyn, 0) + vmin(vmax(n_tiles - dyn + gdimx, 0), gdimx)

    @staticmethod
    def strides_ok(a, sfa, l):
        """Bulk copies need 16-byte aligned rows of ``a`` and ``sfa`` (their base addresses are checked
        on every call)."""
        return a.stride(0) % 16 == 0 and sfa.stride(0) % 16 == 0 and (
            l == 1 or (a.stride(2) % 16 == 0 and sfa.stride(2) % 16 == 0))

    def grid_x(self, m, l, sms):
        return max(1, min(m // self.rows, sms * self.ctas // l))

    @cute.jit
    def body(self, a_ptr, b_ptr, sfa_ptr, sfb_ptr, c_ptr, ctr_ptr, m, a_rs, a_ls, b_ls, sfa_rs, sfa_ls, sfb_ls, c_rs,
             c_ls):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, _ = cute.arch.block_idx()
        gdimx, _, _ = cute.arch.grid_dim()
        S = self.stages
        R = self.rows
        # stage s: R rows of a, then R rows of sfa; fp64 partial per stage, row and part
        s_a, s_part, s_full, s_empty, tbl = stage_buffers(tidx, S, self.stage_bytes, self.part_bytes,
                                                          self.smem_bytes, 32 * self.warps)

        l_idx = cutlass.Int64(bidy)
        n_t = (m // R - bidx + gdimx - 1) // gdimx  # tiles bidx, bidx + gdimx, ... of this batch index
        warp = tidx // 32
        lane = tidx % 32
        if cutlass.const_expr(self.dynamic):
            s_tile = s_empty + 8 * S + STAGE_EXTRA_BYTES
            if warp == self.warps:
                self._produce_dynamic(m // R, bidx, gdimx, lane, s_a, s_part, s_full, s_empty, s_tile,
                                      a_ptr + l_idx * a_ls, a_rs, sfa_ptr + l_idx * sfa_ls, sfa_rs,
                                      c_ptr + l_idx * c_ls, c_rs, ctr_ptr, ctr_ptr + 4 * l_idx, tbl)
            else:
                self._consume(n_t, tidx, s_a, s_part, s_full, s_empty, b_ptr + l_idx * b_ls,
                              sfb_ptr + l_idx * sfb_ls, tbl, s_tile)
        elif warp == self.warps:
            self._produce(n_t, bidx, gdimx, lane, s_a, s_part, s_full, s_empty, a_ptr + l_idx * a_ls, a_rs,
                          sfa_ptr + l_idx * sfa_ls, sfa_rs, c_ptr + l_idx * c_ls, c_rs)
        else:
            self._consume(n_t, tidx, s_a, s_part, s_full, s_empty, b_ptr + l_idx * b_ls, sfb_ptr + l_idx * sfb_ls,
                          tbl)

    @cute.jit
    def _produce(self, n_t, bidx, gdimx, lane, s_a, s_part, s_full, s_empty, a_base, a_rs, sfa_base, sfa_rs,
                 c_base, c_rs):
        S = self.stages
        R = self.rows
        for j in cutlass.range(n_t + S, unroll=1):
            s = j % S
            if j >= S:
                mbar_wait(s_empty + 8 * s, (j // S - 1) & 1)
                if lane < R:
                    self._store_row(s, lane, lambda: bidx + (j - S) * gdimx, s_part, c_base, c_rs)
            if j < n_t:
                copy_tile(lane, (bidx + j * gdimx) * R, s_a + s * self.stage_bytes, s_full + 8 * s, a_base, a_rs,
                          sfa_base, sfa_rs, R, self.row_a, self.row_sf, self.evict)

    @cute.jit
    def _store_row(self, s, lane, tile_of, s_part, c_base, c_rs):
        """Producer lane ``lane`` adds its row's partials in stage ``s`` and writes the row of ``c``; the
        stage's tile index, ``tile_of()``, is read after the partials."""
        p = s_part + (s * self.rows + lane) * (8 * self.parts)
        acc = lds_stage_f64(p)
        for q in cutlass.range_constexpr(1, self.parts):
            acc = acc + lds_stage_f64(p + 8 * q)
        row = tile_of() * self.rows + lane
        stg_f16(c_base + cutlass.Int64(row) * c_rs, cutlass.Float32(acc))

    @cute.jit
    def _produce_dynamic(self, n_tiles, bidx, gdimx, lane, s_a, s_part, s_full, s_empty, s_tile, a_base, a_rs,
                         sfa_base, sfa_rs, c_base, c_rs, ctr, ctr_l, tbl):
        """``_produce`` with tiles claimed at run time: the first ``stages`` tiles of a CTA are static
        (``bidx + j * gdimx``), each later one comes from an atomic add on the batch index's counter at
        ``ctr_l``, issued a step before its use; SMs are served unequally (24-31 tiles a CTA measured where the
        static split gives 27-28), so a fixed split ends on its slowest SM. The first claim past the last
        tile ends the CTA: the stage gets tile index -1, which stops the consumers. Every CTA that claims
        makes exactly one such claim, so a launch makes a known number of claims; the CTA that gets the
        last one zeroes the counter (a strong store to the same word: ordered after every claim), and the
        next launch on the stream starts from zero. A claim past the last (a counter found past this
        launch's claims) traps, so such a counter fails the launch with a CUDA error rather than every
        launch after it; a smaller leftover would skip that many tiles once, then reset (neither can arise
        without two running launches sharing a counter, which ``tile_counters`` rules out). ``ctr == 0``
        (a launch inside a graph capture) keeps the static schedule."""
        S = self.stages
        R = self.rows
        dyn = S * gdimx  # tiles of the static steps
        last_claim = self.claim_count(n_tiles, gdimx, S, cutlass.max, cutlass.min) - 1
        n_t = cutlass.Int32(1 << 30)  # steps that copy a tile: known once a tile index is past the last
        nxt = bidx  # lane 0's tile index for the next step, less ``base``
        base = cutlass.Int32(0)
        j = cutlass.Int32(0)
        while j < n_t + S:
            s = j % S
            if j >= S:
                mbar_wait(s_empty + 8 * s, (j // S - 1) & 1)
                if lane < R:
                    self._store_row(s, lane, lambda: lds_stage_u32(s_tile + 4 * s), s_part, c_base, c_rs)
            if j < n_t:
                # the claim's result is read here, a step after its issue (also the warp's sync point)
                tile = cute.arch.shuffle_sync(nxt, 0) + base
                if base != 0:
                    if lane == 0:
                        if nxt == last_claim:
                            st_relaxed_u32(ctr_l, cutlass.Int32(0))
                        if nxt > last_claim:
                            # the counter was past this launch's claims at launch (only another launch
                            # sharing it could leave it so): no claim would reset it, and every later
                            # launch on the stream would skip its claimed tiles; fail loudly instead
                            trap()
                if tile < n_tiles:
                    nxt = bidx + (j + 1) * gdimx
                    base = cutlass.Int32(0)
                    if ctr != 0:
                        if j + 1 >= S:
                            got = cutlass.Int32(0)
                            if lane == 0:
                                # an address ptxas cannot see is warp-uniform (tbl >> 30 is 0): else it
                                # aggregates the atomic over the warp and waits for its result at once
                                got = atom_add_one(ctr_l + cutlass.Int64(tbl >> 30))
                            nxt = got
                            base = dyn
                    if lane == 0:
                        sts_u32(s_tile + 4 * s, tile)
                    copy_tile(lane, tile * R, s_a + s * self.stage_bytes, s_full + 8 * s, a_base, a_rs, sfa_base,
                              sfa_rs, R, self.row_a, self.row_sf, self.evict)
                else:
                    n_t = j
                    if lane == 0:
                        sts_u32(s_tile + 4 * s, cutlass.Int32(-1))
                        mbar_arrive(s_full + 8 * s)
            j = j + 1

    @cute.jit
    def _consume(self, n_t, tidx, s_a, s_part, s_full, s_empty, b_base, sfb_base, tbl, s_tile=None):
        """Consumer warps: ``n_t`` tiles, or with dynamic tiles until a stage's tile index is negative."""
        S = self.stages
        jl = tidx % self.tr
        wb, sb = b_in_registers(b_base, sfb_base, jl, self.tr, self.n, lambda ch: cutlass.Int64(ch) * 2)
        if cutlass.const_expr(self.dynamic):
            step = cutlass.Int32(0)
            go = cutlass.Int32(1)
            while go != 0:
                sd = step % S
                mbar_wait(s_full + 8 * sd, (step // S) & 1)
                if lds_stage_u32(s_tile + 4 * sd) < 0:
                    go = cutlass.Int32(0)
                else:
                    self._consume_stage(sd, tidx, s_a, s_part, s_empty, wb, sb, tbl)
                step = step + 1
        else:
            for j in cutlass.range(n_t, unroll=1):
                s = j % S
                mbar_wait(s_full + 8 * s, (j // S) & 1)
                self._consume_stage(s, tidx, s_a, s_part, s_empty, wb, sb, tbl)

    @cute.jit
    def _consume_stage(self, s, tidx, s_a, s_part, s_empty, wb, sb, tbl):
        R = self.rows
        r = tidx // self.tr
        jl = tidx % self.tr
        a_row = s_a + s * self.stage_bytes + r * self.row_a
        sf_row = s_a + s * self.stage_bytes + R * self.row_a + r * self.row_sf
        xs = []
        for i in cutlass.range_constexpr(self.n):
            xs.append(lds_stage_v4(a_row + (jl + i * self.tr) * 16))
        ss = []
        for i in cutlass.range_constexpr(self.n):
            ss.append(lds_stage_u16(sf_row + (jl + i * self.tr) * 2))
        acc = cutlass.Float64(0.0)
        for i in cutlass.range_constexpr(self.n):
            if cutlass.const_expr(self.probe):
                acc = probe_sum(acc, xs[i], ss[i])
            else:
                acc = scaled_chunk_dot(acc, xs[i], ss[i], wb[8 * i:8 * i + 8], sb[2 * i], sb[2 * i + 1], tbl)
        acc = group_sum(acc, self.shuffle_offsets)
        if jl % 32 == 0:
            sts_f64(s_part + ((s * R + r) * self.parts + jl // 32) * 8, acc)
        # every consumer thread releases its own reads of the stage (one arrive a warp after a
        # warp barrier measured 0.1-0.4 us faster, but compute-sanitizer's racecheck cannot see it)
        mbar_arrive(s_empty + 8 * s)


# ----------------------------------------------------------------------------------------------------
# Compile cache
# ----------------------------------------------------------------------------------------------------

LAUNCH_ENV = "NVFP4_GEMV_LAUNCH"  # "tvm-ffi", "direct" or "dsl": force one launch path (tests, measurements)
_warned = set()


def _warn_once(key, message):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _tvm_ffi_module():
    try:
        import tvm_ffi
    except ImportError:
        return None
    return tvm_ffi


def launch_kind(fn):
    """How a compiled kernel launches: ``"tvm-ffi"`` (compiled with ``--enable-tvm-ffi``), ``"direct"``
    (our ctypes storage matches this DSL version's) or ``"dsl"`` (the DSL's own argument conversion)."""
    tvm_ffi = _tvm_ffi_module()
    if tvm_ffi is not None and (isinstance(fn, tvm_ffi.Function) or hasattr(fn, "__tvm_ffi_object__")):
        return "tvm-ffi"
    return "direct" if _Kernel.layout_matches(fn) else "dsl"


def tvm_ffi_function(fn):
    """The C function behind a kernel compiled with ``--enable-tvm-ffi``, called with plain ints and no
    Python in between; None where there is none (compiled for another arch than this machine's). DSL
    4.3-4.7 return a ``tvm_ffi.Function`` subclass; 4.8 wraps one (``__tvm_ffi_object__``, the FFI's
    own protocol) in a keyword-argument layer that costs about 0.2 us a call."""
    tvm_ffi = _tvm_ffi_module()
    if tvm_ffi is None:
        return None
    if isinstance(fn, tvm_ffi.Function):
        return fn if fn.__chandle__() else None
    get = getattr(fn, "__tvm_ffi_object__", None)
    raw = get() if get is not None else None
    return raw if isinstance(raw, tvm_ffi.Function) else None


class _Kernel:
    """A compiled kernel on one device and its launch path, the fastest that this install offers:

    * ``tvm-ffi``: compiled with ``--enable-tvm-ffi`` (the DSL's public fast path, package
      apache-tvm-ffi); a call passes its values (18 for ``custom_kernel``'s kernels, 14 for the op's) as
      Python ints to a C function.
    * ``direct``: without apache-tvm-ffi (the leaderboard's image), ``custom_kernel``'s 18 values are
      written into ctypes storage and the compiled host function is called directly. This reads DSL
      internals, so the storage layout is checked once against the DSL's own conversion (it matches on
      4.3, not on 4.8; the op's kernel never takes this path).
    * ``dsl``: the DSL's own call, which converts every argument each time (about 100 us of host time a
      call, against 5-10 for the others); a warning says so once.
    """

    I32 = (6, 15, 16)  # m, grid_x, num_l; the others are int64 addresses and strides

    def __init__(self, fn, device_index, op):
        self.fn = fn
        self.device_index = device_index
        self.op = op
        self.kind = "dsl" if os.environ.get(LAUNCH_ENV) == "dsl" else launch_kind(fn)
        self.ffi = tvm_ffi_function(fn) if self.kind == "tvm-ffi" else None
        self.direct = self.kind == "direct"
        self.executor = None

    def check_fast(self):
        """Warns once where launches will go through the DSL's slow argument conversion."""
        if self.ffi is None and not self.direct:
            import importlib.metadata as md

            _warn_once("dsl", f"nvfp4_gemv: no fast launch path with nvidia-cutlass-dsl "
                       f"{md.version('nvidia-cutlass-dsl')} ({self.kind}): every call pays the DSL's "
                       "argument conversion, about 100 us of host time; pip install apache-tvm-ffi")

    @classmethod
    def layout_matches(cls, fn):
        probe = [1000 + i for i in range(17)] + [_CUstream(0x5EED)]
        try:
            exe, _ = fn.args_spec.generate_execution_args(probe, {})
            addr = [e.value if isinstance(e, ctypes.c_void_p) else e for e in exe]
            vals = [(ctypes.c_int32 if i in cls.I32 else ctypes.c_int64).from_address(addr[i]).value
                    for i in range(17)]
            return (len(exe) == 18 and vals == probe[:17]
                    and ctypes.c_void_p.from_address(addr[17]).value == 0x5EED)
        except Exception:  # noqa: BLE001 - any surprise: not this layout
            return False

    def _executor(self):
        if self.executor is None:
            with _lock:
                if self.executor is None:
                    ex = self.fn.to(self.device_index)
                    if not (callable(getattr(getattr(ex, "jit_module", None), "capi_func", None))
                            and hasattr(ex, "exec_context") and hasattr(ex, "cuda_result")):
                        self.direct = False
                    self.executor = ex
        return self.executor

    def args(self, static):
        """Argument storage for this kernel, ``(head, static values, packed, result, capi)``: ``head`` holds
        the six pointers and the stream side by side (one ``_HEAD.pack_into`` a call), the 11 values
        after the pointers are set to ``static``; the layout of the packed array is the DSL executor's."""
        ex = self._executor()
        head = (ctypes.c_int64 * 7)()
        values = [ctypes.c_int32(x) if i in self.I32 else ctypes.c_int64(x) for i, x in enumerate(static, 6)]
        result = type(ex.cuda_result)() if ex.cuda_result is not None else ctypes.c_int32()
        base = ctypes.addressof(head)
        ptrs = [base + 8 * i for i in range(6)] + [ctypes.addressof(v) for v in values] + [base + 48]
        if ex.cuda_result is not None:
            ptrs.append(ctypes.addressof(result))
        if ex.exec_context is not None:
            ptrs += [p.value for p in ex.exec_context.kernel_functions_ptrs]
        return head, values, (ctypes.c_void_p * len(ptrs))(*ptrs), result, ex.jit_module.capi_func

    def launch_dsl(self, values, stream_handle):
        self.fn(*values, stream_handle if self.kind == "tvm-ffi" else _CUstream(stream_handle))


_compiled = {}
_device_info = {}
_lock = threading.RLock()


def device_info(device_index):
    """(arch string, SM count, fp4 _scaled_mm usable) of a CUDA device, computed once."""
    info = _device_info.get(device_index)
    if info is None:
        major, minor = torch.cuda.get_device_capability(device_index)
        sms = torch.cuda.get_device_properties(device_index).multi_processor_count
        arch = f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"
        if major == 10 and torch.cuda.is_current_stream_capturing():
            return arch, sms, True  # no probe inside a graph capture: go by the architecture
        info = (arch, sms, _probe_scaled_mm_fp4(device_index) if major == 10 else False)
        _device_info[device_index] = info
    return info


def _probe_scaled_mm_fp4(device_index):
    dev = torch.device("cuda", device_index)
    try:
        a = torch.zeros(128, 32, dtype=torch.uint8, device=dev).view(torch.float4_e2m1fn_x2)
        s = torch.ones(128 * 4, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
        torch._scaled_mm(a, a.T, s, s, out_dtype=torch.float16)
        torch.cuda.synchronize(dev)
        return True
    except Exception:  # noqa: BLE001 - any failure means "not supported here"
        return False


def make_op(k, blocked_scales, **tuning):
    """The kernel object for a tuning: ``bulk=1`` picks the bulk-copy streaming kernel."""
    cls = Nvfp4GemvBulk if tuning.get("bulk") else Nvfp4GemvSplit if tuning.get("split") else Nvfp4Gemv
    return cls(k, blocked_scales, **tuning)


def compile_gemv(k, blocked_scales, arch, options=None, tvm_ffi=None, **tuning):
    """Compiles the kernel for ``k`` (no GPU needed when ``options`` names ``--gpu-arch``); ``tvm_ffi``
    (default: where apache-tvm-ffi is installed and ``NVFP4_GEMV_LAUNCH`` does not say otherwise) builds
    the TVM-FFI launcher."""
    i64, i32 = cutlass.Int64(0), cutlass.Int32(1)
    return dsl_compile(make_op(k, blocked_scales, **tuning), (*[i64] * 6, i32, *[i64] * 8, i32, i32, _CUstream(0)),
                       options, tvm_ffi)


def dsl_compile(op, args, options=None, tvm_ffi=None):
    """``cute.compile`` with ``launch_options``; where the TVM-FFI build fails (an apache-tvm-ffi this DSL
    does not work with), warns once and builds without it (the ctypes launcher or the DSL's call)."""
    opts = launch_options(options, tvm_ffi)
    try:
        return cute.compile(op, *args, options=opts)
    except Exception as e:  # noqa: BLE001 - any failure of the optional path: retry without it
        if "--enable-tvm-ffi" not in opts:
            raise
        _warn_once("tvm-ffi-compile", f"nvfp4_gemv: compiling with --enable-tvm-ffi failed ({type(e).__name__}: "
                   f"{str(e)[:200]}); compiled without it")
        return cute.compile(op, *args, options=launch_options(options, False))


def launch_options(options, tvm_ffi):
    """Compile options: ``options`` plus ``--enable-tvm-ffi`` where ``tvm_ffi`` says so (by default where
    apache-tvm-ffi is installed and ``NVFP4_GEMV_LAUNCH`` does not name another path)."""
    if tvm_ffi is None:
        tvm_ffi = os.environ.get(LAUNCH_ENV, "tvm-ffi") == "tvm-ffi" and _tvm_ffi_module() is not None
    return ((options or "") + (" --enable-tvm-ffi" if tvm_ffi else "")).strip()


def _get_kernel(device_index, k, blocked_scales, tuning):
    key = (device_index, k, blocked_scales, tuning)
    kern = _compiled.get(key)
    if kern is None:
        with _lock:
            kern = _compiled.get(key)
            if kern is None:
                kw = dict(tuning)
                fn = compile_gemv(k, blocked_scales, device_info(device_index)[0], **kw)
                kern = _Kernel(fn, device_index, make_op(k, blocked_scales, **kw))
                kern.check_fast()
                _compiled[key] = kern
    return kern


# ----------------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------------

_HEAD = struct.Struct("<7q")  # a launch's five data pointers, tile counters and stream: its arguments' head
_get_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_current_stream = (getattr(torch._C, "_cuda_getCurrentRawStream", None)
                   or (lambda device_index: torch.cuda.current_stream(device_index).cuda_stream))
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing
_counters = {}  # (device, stream[, thread]) -> (batch indices held, address, tensor)
_counters_kept = []  # counters replaced by larger ones: another thread may be launching with their address
CUDA_STREAM_PER_THREAD = 2  # cudaStreamPerThread: one handle, another stream in each thread
_thread = threading.local()
_threads_numbered = [0]


def _thread_number():
    # not threading.get_ident(): a new thread may get an ended one's, while the ended thread's launches run
    n = getattr(_thread, "n", None)
    if n is None:
        with _lock:
            _threads_numbered[0] += 1
            n = _thread.n = _threads_numbered[0]
    return n


def _new_counters(dev, n):
    return torch.zeros(n, dtype=torch.int32, device=torch.device("cuda", dev))


def tile_counters(dev, stream, l):
    """The address of the dynamic bulk kernel's tile counters for a launch on ``stream``: an int32 a batch
    index, zero between launches (each launch's last claim resets it), one set a stream (and thread, for the
    per-thread default stream), so that launches that may overlap never share one. 0 inside a graph capture:
    a graph can be replayed on any stream, beside eager launches on this one, so a captured launch keeps the
    static schedule. A set is allocated on its stream and never freed."""
    if _capturing():
        return 0
    key = (dev, stream) if stream != CUDA_STREAM_PER_THREAD else (dev, stream, _thread_number())
    got = _counters.get(key)
    if got is None or got[0] < l:
        with _lock:
            got = _counters.get(key)
            if got is None or got[0] < l:
                if got is not None:
                    _counters_kept.append(got[2])
                n = max(64, 1 << (l - 1).bit_length())
                t = _new_counters(dev, n)  # zeroed on the current stream, ``stream``
                got = _counters[key] = (n, t.data_ptr(), t)
    return got[1]


def _stream_and_counters(dev, dynamic):
    """A launch's stream (torch's current one) and tile counters (``dynamic``: the plan's batch indices; 0:
    a plan without dynamic tiles, which passes 0)."""
    stream = _current_stream(dev)
    return stream, (tile_counters(dev, stream, dynamic) if dynamic else 0)


class _CutePlan:
    """Everything about a CuTe launch that the tensors' metadata fixes (kernel, grid, strides), so
    that a call only reads the five data pointers and the stream."""

    variants = ()  # (guard, hit): C++ checks of tensor sets with this plan's key, newest first (_RecentPlans)

    def __init__(self, data, m, k, l, scales_on_gpu, tuning=None):
        a, b, sfa, sfb, sfa_p, sfb_p, c = data
        self.dev = a.device.index
        self.data_shape = (m, k, l, scales_on_gpu)
        sms = device_info(self.dev)[1]
        explicit = tuning is not None
        if not explicit:
            tuning = pick_tuning(k, m, l, sms, not scales_on_gpu)
        sfa16 = bool(dict(tuning).get("bulk") or dict(tuning).get("sf_wide"))  # 16-byte aligned sfa rows
        if sfa16 and not (scales_on_gpu and Nvfp4GemvBulk.strides_ok(a, sfa, l)):
            if explicit:
                raise ValueError("nvfp4_gemv: the bulk-copy kernel and sf_wide need the plain scales on the GPU "
                                 "and 16-byte aligned rows of a and sfa")
            tuning, sfa16 = pick_tuning(k, m, l, sms, True), False  # the choice without them
        self.kernel = kern = _get_kernel(self.dev, k, not scales_on_gpu, tuning)
        self.scale_idx = (2, 3) if scales_on_gpu else (4, 5)
        self.sfa_mask = 15 if sfa16 else 1
        self.fallback = None  # where 16-byte sfa rows are needed and a call misaligns sfa: the choice without them
        if scales_on_gpu:
            strides = (sfa.stride(0), sfa.stride(2), sfb.stride(2))
        else:
            strides = (sfa_p.stride(2), sfa_p.stride(5), sfb_p.stride(5))
        ctas_per_l = kern.op.grid_x(m, l, sms)
        self.dynamic = l if getattr(kern.op, "dynamic", 0) else 0  # batch indices to count tiles of
        self.static = (m, a.stride(0), a.stride(2), b.stride(2), *strides, c.stride(0) * 2, c.stride(2) * 2,
                       ctas_per_l, l)
        self.lock = threading.Lock()
        self.ffi = kern.ffi
        self.storage = None

    def hit_path(self, check):
        return _hit_path(check, self, self.ffi, self.static, self.dev, self.sfa_mask, self.scale_idx, self.dynamic)

    def __call__(self, data):
        a, b, c = data[0], data[1], data[6]
        pa, pb = a.data_ptr(), b.data_ptr()
        psa, psb = data[self.scale_idx[0]].data_ptr(), data[self.scale_idx[1]].data_ptr()
        if (pa | pb) & 15 or psa & self.sfa_mask or psb & 1:
            return self._unaligned(data)
        ffi = self.ffi
        if ffi is not None and _get_device() == self.dev:
            stream, ctr = _stream_and_counters(self.dev, self.dynamic)
            ffi(pa, pb, psa, psb, c.data_ptr(), ctr, *self.static, stream)
            return c
        storage = self.storage
        if not storage or _get_device() != self.dev:
            return self._launch_slow(data, (pa, pb, psa, psb, c.data_ptr()))
        head, _, packed, result, capi = storage
        stream, ctr = _stream_and_counters(self.dev, self.dynamic)
        with self.lock:  # one argument storage for all threads (the call releases the GIL)
            _HEAD.pack_into(head, 0, pa, pb, psa, psb, c.data_ptr(), ctr, stream)
            capi(packed)
            err = result.value
        if err:
            raise RuntimeError(f"nvfp4_gemv: kernel launch failed with CUDA error {err}")
        return c

    def _launch_slow(self, data, ptrs):
        """First call (builds the argument storage), the DSL's own launch where its layout differs, or
        a call from another current device (launches go to the current context)."""
        kern = self.kernel
        if self.storage is None and self.ffi is None:
            kern._executor()
            with self.lock:
                if self.storage is None:
                    self.storage = kern.args(self.static) if kern.direct else False
        with torch.cuda.device(self.dev):
            if self.ffi is not None or self.storage:
                return self(data)
            stream, ctr = _stream_and_counters(self.dev, self.dynamic)
            kern.launch_dsl(ptrs + (ctr,) + self.static, stream)
        return data[6]

    def _unaligned(self, data):
        check_inputs(data)  # raises, naming the misaligned argument
        if self.fallback is None:  # only the 16-byte sfa alignment (bulk kernel, sf_wide) is missing
            m, k, l, _ = self.data_shape
            self.fallback = _CutePlan(data, *self.data_shape,
                                      tuning=pick_tuning(k, m, l, device_info(self.dev)[1], True))
        return self.fallback(data)


class _ScaledMmPlan:
    """L == 1 on a GPU whose ``_scaled_mm`` takes fp4; ``NVFP4_GEMV_FORCE_CUTE=1`` sends it to the CuTe
    kernel, compiled only then."""

    variants = ()

    def __init__(self, shape):
        self.shape = shape  # (m, k, l, scales_on_gpu)
        self.cute = None

    def hit_path(self, check):
        return _hit_path(check, self)

    def __call__(self, data):
        if os.environ.get(FORCE_CUTE_ENV):
            if self.cute is None:
                self.cute = _CutePlan(data, *self.shape)
            return self.cute(data)
        return _run_scaled_mm(data)


def _run_scaled_mm(data):
    a, b, _, _, sfa_p, sfb_p, c = data
    res = torch._scaled_mm(a[:, :, 0], b[:, :, 0].transpose(0, 1), blocked_from_permuted(sfa_p, 0),
                           blocked_from_permuted(sfb_p, 0), bias=None, out_dtype=torch.float16)
    c[:, 0, 0] = res[:, 0]
    return c


_plans = {}
MAX_PLANS = 4096


def _guard_maker():
    """A maker of C++ checks of tensor metadata, or None. ``torch._C._dynamo.guards.TensorGuards`` (what
    torch.compile checks its inputs with: Python type, dispatch keys, dtype, device index, sizes, strides,
    requires_grad) matches a call's tensors against a plan's in about 0.6 us where the plan key takes 2.4
    (7 tensors, one CPU core). It is private API: used only where it passes this self-check, else a
    warning and the key alone (about 2 us more host time a call)."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        def make(ts):
            return TensorGuards(*ts, dynamic_dims_sizes=[list(t.shape) for t in ts],
                                dynamic_dims_strides=[list(t.stride()) for t in ts])

        t = torch.zeros(4, 2)
        g = make((t, t[:, :1]))
        if (g.check(torch.ones(4, 2), torch.ones(4, 2)[:, 1:]) and not g.check(t, t)
                and not g.check(t.t().contiguous().t(), t[:, :1]) and not g.check(t.half(), t[:, :1])
                and not g.check(t.to("meta"), t[:, :1]) and not g.check(t, 1)):
            return make
    except Exception:  # noqa: BLE001 - any failure means: not usable here
        pass
    _warn_once("guards", "nvfp4_gemv: torch._C._dynamo.guards.TensorGuards is missing or failed its self-check; "
                         "the per-call metadata check runs in Python (about 2 us more host time a call)")
    return None


_make_guard = _guard_maker()
# a guard keeps a borrowed pointer to each tensor's Python type: only types that live as long as torch
_GUARD_TYPES = (torch.Tensor, torch.nn.Parameter)


class _RecentPlans:
    """Recent calls' plans, so that a hit skips the Python key: first by the identity of one of the call's
    tensors (custom_kernel's ``a``; gemv's ``w``, which a model passes at every step), then the last few
    plans in turn (fresh tensors of a recent shape: the leaderboard's inputs, or ``w.detach()`` each call).
    A hit is a plan's call behind a C++ guard of all the call's tensor metadata, returning None where the
    guard rejects them (another plan's metadata, or a dead tensor's id reused: the guard makes both safe).
    A plan keeps a guard a variant of its key's tensors (``nn.Parameter`` or not, requires_grad, inference
    tensors: what the key does not hold), up to ``VARIANTS``."""

    SIZE = 4096  # ids, not tensors: nothing is kept alive
    RECENT = 8  # a decoder layer's distinct weight shapes, and then some
    VARIANTS = 4

    def __init__(self):
        self.hits = {}
        self.recent = ()  # the newest hits, newest first; one assignment: thread-safe reads

    def scan(self, anchor, tried, *args):
        """The result of the first recent hit other than ``tried`` that takes ``args``, filed under
        ``anchor`` for its next call; else None."""
        for hit in self.recent:
            if hit is not tried:
                res = hit(*args)
                if res is not None:
                    hits, key = self.hits, id(anchor)
                    if key in hits or len(hits) < self.SIZE:
                        hits[key] = hit
                    return res
        return None

    def add(self, anchor, ts, plan):
        """Files a hit of ``plan`` for ``ts`` (the call's tensors, in the order its hit path checks them)
        under ``anchor`` and first in ``recent``, with the plan's variant whose guard takes ``ts`` (a new one
        if none does); nothing for tensor subclasses or nested tensors."""
        if _make_guard is None or any(type(t) not in _GUARD_TYPES or t.is_nested or t.layout != torch.strided
                                      for t in ts):
            return
        try:
            hit = next((h for g, h in plan.variants if g.check(*ts)), None)
            if hit is None:
                guard = _make_guard(ts)
                hit = plan.hit_path(guard.check)
                plan.variants = ((guard, hit),) + plan.variants[: self.VARIANTS - 1]
        except (TypeError, RuntimeError):
            return
        hits, key = self.hits, id(anchor)
        if key not in hits and len(hits) >= self.SIZE:
            hits.clear()
        hits[key] = hit
        self.recent = (hit,) + tuple(h for h in self.recent if h is not hit)[: self.RECENT - 1]


def _hit_path(check, plan, ffi=None, static=(), dev=-1, sfa_mask=1, scale_idx=(2, 3), dynamic=0):
    """custom_kernel's call of ``plan`` for data with exactly its metadata: None where ``check`` (the plan's
    guard) rejects ``data`` or it is no 7 tensors. A TVM-FFI launch is inlined (about 0.5 us less host
    time than ``plan(data)``); without ``ffi``, and for what the launch does not take, ``plan(data)``.
    ``dynamic``: the batch indices of a dynamic bulk plan's tile counters, else 0."""
    get_device, stream, counters, plain = _get_device, _current_stream, tile_counters, scale_idx == (2, 3)

    def call(data):
        try:
            a, b, sfa, sfb, sfa_p, sfb_p, c = data
            # a strided nested tensor aborts the guard's stride read: tested first
            if (a.is_nested or b.is_nested or sfa.is_nested or sfb.is_nested or sfa_p.is_nested
                    or sfb_p.is_nested or c.is_nested or not check(a, b, sfa, sfb, sfa_p, sfb_p, c)):
                return None
        except (TypeError, ValueError, AttributeError):  # not 7 tensors
            return None
        if ffi is None:
            return plan(data)
        if plain:
            psa, psb = sfa.data_ptr(), sfb.data_ptr()
        else:
            psa, psb = sfa_p.data_ptr(), sfb_p.data_ptr()
        pa, pb = a.data_ptr(), b.data_ptr()
        if (pa | pb) & 15 or psa & sfa_mask or psb & 1 or get_device() != dev:
            return plan(data)
        st = stream(dev)  # the helper _stream_and_counters, inlined: this is every call's path
        ffi(pa, pb, psa, psb, c.data_ptr(), counters(dev, st, dynamic) if dynamic else 0, *static, st)
        return c

    return call


_recent = _RecentPlans()


def _metadata(data):
    # get_device() is -1 off CUDA, where check_inputs rejects all but the plain scales: those keep
    # their full device, as a CPU sfa and one elsewhere differ in what check_inputs says
    a, b, sfa, sfb, sfa_p, sfb_p, c = data
    return (a.shape, a.stride(), a.dtype, a.get_device(), b.shape, b.stride(), b.dtype, b.get_device(),
            sfa.shape, sfa.stride(), sfa.dtype, sfa.device, sfb.shape, sfb.stride(), sfb.dtype,
            sfb.device, sfa_p.shape, sfa_p.stride(), sfa_p.dtype, sfa_p.get_device(), sfb_p.shape,
            sfb_p.stride(), sfb_p.dtype, sfb_p.get_device(), c.shape, c.stride(), c.dtype, c.get_device())


def _new_plan(data, key):
    shape = check_inputs(data)
    if shape[2] == 1 and device_info(data[0].device.index)[2]:
        plan = _ScaledMmPlan(shape)
    else:
        plan = _CutePlan(data, *shape)
    if key is not None:
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    return plan


def pick_tuning(k, m, l, sms, blocked_scales):
    """The kernel and configuration for one problem size: rows split over warps where one wave of CTAs
    holds the problem and rows are long enough, else the bulk-copy kernel for long rows (where both
    apply it is as fast as the latency config or up to 2 us faster: 0-17% on 10 one-wave shapes with
    K >= 7168, docs/perf-notes.md), else the latency config for one wave, else the streaming default
    ``()``."""
    bulk = not blocked_scales and Nvfp4GemvBulk.suits(k)
    split = Nvfp4GemvSplit.shape_tuning(k, m, l, sms, long_tails=bulk)
    if split:
        return split
    if bulk:
        # tiles claimed at run time where a tile holds several rows (K = 7168 x 8: -0.85 us); one-row tiles
        # (K = 16384) turn too fast for a claim's round trip (+0.5 us), docs/perf-notes.md
        return (("bulk", 1), ("dynamic", 1)) if Nvfp4GemvBulk(k, False).rows >= 2 else (("bulk", 1),)
    tuning = Nvfp4Gemv.shape_tuning(k, m, l, sms)
    if not tuning and not blocked_scales:
        tuning = Nvfp4Gemv.wide_tuning(k)
    return tuning


def run_cute(data, m, k, l, scales_on_gpu, tuning=None):
    """Launches the CuTe DSL kernel on the current stream, bypassing the plan cache; ``tuning``
    (sorted ``(name, value)`` pairs) overrides the per-shape configuration, for experiments."""
    return _CutePlan(data, m, k, l, scales_on_gpu, tuning)(data)


def custom_kernel(data: input_t) -> output_t:
    """NVFP4 batched GEMV: writes ``c`` in place and returns it.

    :param data: ``(a, b, sfa, sfb, sfa_permuted, sfb_permuted, c)`` as the official ``generate_input``
        makes them: ``a`` [M, K/2, L] and ``b`` [128, K/2, L] ``float4_e2m1fn_x2`` (row 0 of ``b`` is the
        vector), ``sfa`` [M, K/16, L] / ``sfb`` [128, K/16, L] ``float8_e4m3fn``, their permuted
        [32, 4, rest, 4, K/64, L] forms, and ``c`` [M, 1, L] ``float16``.
    :return: ``c``
    :raises TypeError, ValueError: on malformed input, naming the argument.
    """
    key = None
    if type(data) is tuple or type(data) is list:
        if data:
            hit = _recent.hits.get(id(data[0]))
            c = hit(data) if hit is not None else None
            if c is None:
                c = _recent.scan(data[0], hit, data)
            if c is not None:
                return c
    if isinstance(data, (tuple, list)):  # anything else: check_inputs names it
        try:
            key = _metadata(data)
        except (TypeError, ValueError, AttributeError, RuntimeError):  # RuntimeError: strides of a nested tensor
            pass
    plan = _plans.get(key)
    if plan is None:
        plan = _new_plan(data, key)  # validates data in full; raises on malformed input
    if key is not None:
        _recent.add(data[0], data, plan)
    return plan(data)

"""Inline-PTX wrappers: one instruction (or a predicated one and its zero fill) each, on integer addresses.

Why not ``cute.arch``: the kernels compute addresses as plain integers (``Int64`` global, ``Int32`` shared:
one shared allocation and byte offsets into it), while ``cute.arch``'s memory and barrier operations take
typed ``Pointer``s, and DSL 4.3 (the leaderboard's) has no plain global load, store or atomic there at all
(``cute.arch.load``/``store``/``atomic_add`` came with 4.8). Beyond that each wrapper names what it needs
that no built-in gives: a cache hint (``.nc``, ``L1::no_allocate``, an L2 eviction policy), a predicate with
zero fill in the same asm, or side effects. ``*_stage_*`` reads are side-effecting (volatile) asm: a read of
what other threads wrote before a barrier or an mbarrier wait must stay after it, and LLVM moves inline asm
without side effects (it hoisted the tensor-core kernel's partial-sum read above the barrier once, with one
group, where the loop runs once; tests/compile_check.py counts shared reads above the first barrier).

Shared by every kernel: ``custom_kernel``'s (``streaming``, ``split``, ``bulk``) and the op's (``tokens``,
``tokens_bulk``, ``mma``).
"""

import cutlass
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

try:  # DSL 4.8 moved it; the old name warns there
    from cutlass.memory import SmemAllocator
except ImportError:
    from cutlass.utils import SmemAllocator

SMEM_A_SM = 233472  # 228 KiB of shared memory a SM on sm_90 and sm_100, 1 KiB of it reserved for each CTA


def asm(ret_types, operands, text, constraints, loc=None, ip=None, volatile=False):
    """Inline asm with results ``ret_types`` (a list of LLVM types): returns one IR value a result.
    ``volatile``: side effects (LLVM neither moves nor drops it)."""
    ret = ret_types[0] if len(ret_types) == 1 else llvm.StructType.get_literal(ret_types)
    res = llvm.inline_asm(ret, [o.ir_value(loc=loc, ip=ip) for o in operands], text, constraints,
                          has_side_effects=volatile, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                          loc=loc, ip=ip)
    if len(ret_types) == 1:
        return [res]
    return [llvm.extractvalue(t, res, [i], loc=loc, ip=ip) for i, t in enumerate(ret_types)]


def asm_store(operands, text, constraints, loc=None, ip=None):
    """Inline asm without results (stores, barriers, copies): always side-effecting."""
    llvm.inline_asm(None, [o.ir_value(loc=loc, ip=ip) for o in operands], text, constraints,
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                    loc=loc, ip=ip)


# ----------------------------------------------------------------------------------------------------
# Global loads (read-only: ``.nc``)
# ----------------------------------------------------------------------------------------------------


@dsl_user_op
def ldg_stream_v4_if(addr, pred, *, loc=None, ip=None):
    """``ld.global.nc.L1::no_allocate.v4.u32`` where ``pred`` is non-zero, else zeros and no access: a
    stream read once (no L1 line), predicated in the same asm."""
    r = asm([T.i32()] * 4, [cutlass.Int64(addr), cutlass.Int32(pred)],
            "{\n.reg .pred p;\nsetp.ne.s32 p, $5, 0;\nmov.b32 $0, 0;\nmov.b32 $1, 0;\nmov.b32 $2, 0;\n"
            "mov.b32 $3, 0;\n@p ld.global.nc.L1::no_allocate.v4.u32 {$0, $1, $2, $3}, [$4];\n}",
            "=r,=r,=r,=r,l,r", loc, ip)
    return [cutlass.Int32(v) for v in r]


@dsl_user_op
def ldg_u16_if(addr, pred, *, loc=None, ip=None):
    """``ld.global.nc.u16`` where ``pred`` is non-zero, else 0: two scale bytes, predicated in the same asm."""
    r = asm([T.i32()], [cutlass.Int64(addr), cutlass.Int32(pred)],
            "{\n.reg .pred p;\nsetp.ne.s32 p, $2, 0;\nmov.b32 $0, 0;\n@p ld.global.nc.u16 $0, [$1];\n}",
            "=r,l,r", loc, ip)
    return cutlass.Int32(r[0])


@dsl_user_op
def ldg_v4(addr, *, loc=None, ip=None):
    """``ld.global.nc.v4.u32``: 16 bytes read-only (``b``, ``x``), no built-in raw-address load on DSL 4.3."""
    r = asm([T.i32()] * 4, [cutlass.Int64(addr)],
            "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", loc, ip)
    return [cutlass.Int32(v) for v in r]


@dsl_user_op
def ldg_u16(addr, *, volatile=False, loc=None, ip=None):
    """``ld.global.nc.u16``: two scale bytes read-only, no built-in raw-address load on DSL 4.3.
    ``volatile``: side-effecting (LLVM neither hoists it above a bound check nor drops it)."""
    r = asm([T.i32()], [cutlass.Int64(addr)], "ld.global.nc.u16 $0, [$1];", "=r,l", loc, ip, volatile=volatile)
    return cutlass.Int32(r[0])


@dsl_user_op
def ldg_f32(addr, *, loc=None, ip=None):
    """``ld.global.nc.f32``: the op's ``alpha``, read on the device (no host sync); no built-in on DSL 4.3."""
    r = asm([T.f32()], [cutlass.Int64(addr)], "ld.global.nc.f32 $0, [$1];", "=f,l", loc, ip)
    return cutlass.Float32(r[0])


@dsl_user_op
def ldg_v2(addr, *, volatile=False, loc=None, ip=None):
    """``ld.global.nc.L1::no_allocate.v2.u32``: 8 bytes of a stream read once (no L1 line); ``volatile``:
    side-effecting."""
    r = asm([T.i32()] * 2, [cutlass.Int64(addr)], "ld.global.nc.L1::no_allocate.v2.u32 {$0, $1}, [$2];",
            "=r,=r,l", loc, ip, volatile=volatile)
    return [cutlass.Int32(v) for v in r]


@dsl_user_op
def ldg_u8(addr, *, volatile=False, loc=None, ip=None):
    """``ld.global.nc.u8``: one scale byte read-only, no built-in raw-address load on DSL 4.3; ``volatile``:
    side-effecting."""
    r = asm([T.i32()], [cutlass.Int64(addr)], "ld.global.nc.u8 $0, [$1];", "=r,l", loc, ip, volatile=volatile)
    return cutlass.Int32(r[0])


@dsl_user_op
def ldg_v2_if(addr, pred, *, loc=None, ip=None):
    """``ld.global.nc.v2.u32`` where ``pred`` is non-zero, else zeros: predicated in the same asm."""
    r = asm([T.i32()] * 2, [cutlass.Int64(addr), cutlass.Int32(pred)],
            "{\n.reg .pred p;\nsetp.ne.s32 p, $3, 0;\nmov.b32 $0, 0;\nmov.b32 $1, 0;\n"
            "@p ld.global.nc.v2.u32 {$0, $1}, [$2];\n}", "=r,=r,l,r", loc, ip)
    return [cutlass.Int32(v) for v in r]


@dsl_user_op
def ldg_u8_if(addr, pred, *, loc=None, ip=None):
    """``ld.global.nc.u8`` where ``pred`` is non-zero, else 0: predicated in the same asm."""
    r = asm([T.i32()], [cutlass.Int64(addr), cutlass.Int32(pred)],
            "{\n.reg .pred p;\nsetp.ne.s32 p, $2, 0;\nmov.b32 $0, 0;\n@p ld.global.nc.u8 $0, [$1];\n}",
            "=r,l,r", loc, ip)
    return cutlass.Int32(r[0])


# ----------------------------------------------------------------------------------------------------
# Shared memory (32-bit addresses; ``cute.arch`` has no raw-address shared load or store)
# ----------------------------------------------------------------------------------------------------


@dsl_user_op
def lds_v4(addr, *, loc=None, ip=None):
    """``ld.shared.v4.u32`` at a 32-bit shared address."""
    r = asm([T.i32()] * 4, [cutlass.Int32(addr)],
            "ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r", loc, ip)
    return [cutlass.Int32(v) for v in r]


@dsl_user_op
def lds_f32x2(addr, *, loc=None, ip=None):
    """``ld.shared.v2.f32`` at a 32-bit shared address."""
    r = asm([T.f32(), T.f32()], [cutlass.Int32(addr)], "ld.shared.v2.f32 {$0, $1}, [$2];", "=f,=f,r", loc, ip)
    return cutlass.Float32(r[0]), cutlass.Float32(r[1])


@dsl_user_op
def lds_u32(addr, *, loc=None, ip=None):
    """``ld.shared.u32`` at a 32-bit shared address."""
    r = asm([T.i32()], [cutlass.Int32(addr)], "ld.shared.u32 $0, [$1];", "=r,r", loc, ip)
    return cutlass.Int32(r[0])


@dsl_user_op
def sts_v4(addr, v0, v1, v2, v3, *, loc=None, ip=None):
    """``st.shared.v4.u32`` at a 32-bit shared address."""
    asm_store([cutlass.Int32(v) for v in (addr, v0, v1, v2, v3)], "st.shared.v4.u32 [$0], {$1, $2, $3, $4};",
              "r,r,r,r,r", loc, ip)


@dsl_user_op
def sts_u32(addr, v, *, loc=None, ip=None):
    """``st.shared.u32`` at a 32-bit shared address."""
    asm_store([cutlass.Int32(addr), cutlass.Int32(v)], "st.shared.u32 [$0], $1;", "r,r", loc, ip)


@dsl_user_op
def sts_f32x2(addr, v0, v1, *, loc=None, ip=None):
    """``st.shared.v2.f32`` at a 32-bit shared address."""
    asm_store([cutlass.Int32(addr), cutlass.Float32(v0), cutlass.Float32(v1)], "st.shared.v2.f32 [$0], {$1, $2};",
              "r,f,f", loc, ip)


@dsl_user_op
def sts_f32(addr, v, *, loc=None, ip=None):
    """``st.shared.f32`` at a 32-bit shared address."""
    asm_store([cutlass.Int32(addr), cutlass.Float32(v)], "st.shared.f32 [$0], $1;", "r,f", loc, ip)


@dsl_user_op
def sts_f64(addr, v, *, loc=None, ip=None):
    """``st.shared.f64`` at a 32-bit shared address."""
    asm_store([cutlass.Int32(addr), cutlass.Float64(v)], "st.shared.f64 [$0], $1;", "r,d", loc, ip)


@dsl_user_op
def sts_f32x4(addr, v, *, loc=None, ip=None):
    """``st.shared.v4.f32`` at a 32-bit shared address."""
    asm_store([cutlass.Int32(addr), *[cutlass.Float32(x) for x in v]],
              "st.shared.v4.f32 [$0], {$1, $2, $3, $4};", "r,f,f,f,f", loc, ip)


@dsl_user_op
def lds_stage_v4(addr, *, loc=None, ip=None):
    """``ld.shared.v4.u32``, side-effecting: a pipeline stage's read stays after its barrier wait."""
    r = asm([T.i32()] * 4, [cutlass.Int32(addr)],
            "ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r", loc, ip, volatile=True)
    return [cutlass.Int32(v) for v in r]


@dsl_user_op
def lds_stage_u32(addr, *, loc=None, ip=None):
    """``ld.shared.u32``, side-effecting: stays after the barrier or wait that orders it."""
    r = asm([T.i32()], [cutlass.Int32(addr)], "ld.shared.u32 $0, [$1];", "=r,r", loc, ip, volatile=True)
    return cutlass.Int32(r[0])


@dsl_user_op
def lds_stage_u16(addr, *, loc=None, ip=None):
    """``ld.shared.u16``, side-effecting: stays after the barrier or wait that orders it."""
    r = asm([T.i32()], [cutlass.Int32(addr)], "ld.shared.u16 $0, [$1];", "=r,r", loc, ip, volatile=True)
    return cutlass.Int32(r[0])


@dsl_user_op
def lds_stage_f64(addr, *, loc=None, ip=None):
    """``ld.shared.f64``, side-effecting: other warps' partials, read after the barrier or wait."""
    r = asm([T.f64()], [cutlass.Int32(addr)], "ld.shared.f64 $0, [$1];", "=d,r", loc, ip, volatile=True)
    return cutlass.Float64(r[0])


@dsl_user_op
def lds_stage_f32(addr, *, loc=None, ip=None):
    """``ld.shared.f32``, side-effecting: other warps' partials, read after the barrier or wait."""
    r = asm([T.f32()], [cutlass.Int32(addr)], "ld.shared.f32 $0, [$1];", "=f,r", loc, ip, volatile=True)
    return cutlass.Float32(r[0])


@dsl_user_op
def lds_stage_v2(addr, *, loc=None, ip=None):
    """``ld.shared.v2.u32``, side-effecting: a lane's ``cp.async`` copy, read after the copy wait."""
    r = asm([T.i32()] * 2, [cutlass.Int32(addr)], "ld.shared.v2.u32 {$0, $1}, [$2];", "=r,=r,r", loc, ip,
            volatile=True)
    return [cutlass.Int32(v) for v in r]


# ----------------------------------------------------------------------------------------------------
# Global stores and atomics
# ----------------------------------------------------------------------------------------------------


@dsl_user_op
def stg_f16(addr, v, *, loc=None, ip=None):
    """``cvt.rn.f16.f32`` and ``st.global.b16``: one fp16 result, rounded once, at a raw address."""
    asm_store([cutlass.Int64(addr), cutlass.Float32(v)],
              "{\n.reg .b16 h;\ncvt.rn.f16.f32 h, $1;\nst.global.b16 [$0], h;\n}", "l,f", loc, ip)


@dsl_user_op
def stg_as(addr, v, bf16, *, loc=None, ip=None):
    """``cvt.rn.bf16.f32`` (``bf16``) or ``cvt.rn.f16.f32``, then ``st.global.b16``, at a raw address."""
    cvt = "cvt.rn.bf16.f32" if bf16 else "cvt.rn.f16.f32"
    asm_store([cutlass.Int64(addr), cutlass.Float32(v)],
              "{\n.reg .b16 h;\n" + cvt + " h, $1;\nst.global.b16 [$0], h;\n}", "l,f", loc, ip)


@dsl_user_op
def atom_add_one(addr, *, loc=None, ip=None):
    """``atom.global.add.u32`` of 1, side-effecting: a tile claim (``cute.arch.atomic_add`` is DSL 4.8's)."""
    r = asm([T.i32()], [cutlass.Int64(addr)], "atom.global.add.u32 $0, [$1], 1;", "=r,l", loc, ip, volatile=True)
    return cutlass.Int32(r[0])


@dsl_user_op
def st_relaxed_u32(addr, v, *, loc=None, ip=None):
    """``st.relaxed.gpu.global.u32``: a strong store at GPU scope, which ``cute.arch`` does not offer.

    With the claims' atomics (relaxed, GPU scope) to the same word it is morally strong, so the memory model
    orders it with them instead of calling it a data race."""
    asm_store([cutlass.Int64(addr), cutlass.Int32(v)], "st.relaxed.gpu.global.u32 [$0], $1;", "l,r", loc, ip)


@dsl_user_op
def trap(*, loc=None, ip=None):
    """``trap``: fails the launch with a CUDA error; ``cute.arch`` has no trap."""
    asm_store([], "trap;", "", loc, ip)


# ----------------------------------------------------------------------------------------------------
# mbarriers and bulk copies (``cute.arch``'s mbarrier operations take a ``Pointer``, these the integer address)
# ----------------------------------------------------------------------------------------------------


@dsl_user_op
def mbar_init(addr, count, *, loc=None, ip=None):
    """``mbarrier.init.shared::cta.b64`` with ``count`` arrivals, at a 32-bit shared address."""
    asm_store([cutlass.Int32(addr), cutlass.Int32(count)], "mbarrier.init.shared::cta.b64 [$0], $1;", "r,r",
              loc, ip)


@dsl_user_op
def mbar_init_fence(*, loc=None, ip=None):
    """``fence.mbarrier_init.release.cluster``: the instruction ``cute.arch.mbarrier_init_fence`` also
    emits, kept here beside the other barrier asm (the code as measured; tools/sass_digest.py checks a change)."""
    asm_store([], "fence.mbarrier_init.release.cluster;", "", loc, ip)


@dsl_user_op
def mbar_arrive(addr, *, loc=None, ip=None):
    """``mbarrier.arrive.shared::cta.b64`` at a 32-bit shared address."""
    asm_store([cutlass.Int32(addr)], "mbarrier.arrive.shared::cta.b64 _, [$0];", "r", loc, ip)


@dsl_user_op
def mbar_arrive_expect_tx(addr, nbytes, *, loc=None, ip=None):
    """``mbarrier.arrive.expect_tx.shared::cta.b64``: arrives and announces ``nbytes`` of copies."""
    asm_store([cutlass.Int32(addr), cutlass.Int32(nbytes)],
              "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", "r,r", loc, ip)


@dsl_user_op
def mbar_wait(addr, parity, *, loc=None, ip=None):
    """Spins on ``mbarrier.try_wait.parity.shared::cta.b64`` until the phase of parity ``parity`` has
    completed: a 32-bit address and no time-limit hint (``cute.arch.mbarrier_wait`` passes one)."""
    asm_store([cutlass.Int32(addr), cutlass.Int32(parity)],
              "{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1;\n"
              "@!p bra WAIT;\n}", "r,r", loc, ip)


@dsl_user_op
def bulk_g2s(dst, src, nbytes, mbar, evict_first=False, *, loc=None, ip=None):
    """``cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes`` (the TMA engine without a
    tensor map): ``nbytes`` contiguous bytes, 16-byte aligned, global to shared, counted on ``mbar``.

    ``evict_first``: with an ``L2::cache_hint`` policy that makes the lines the L2's first candidates for eviction.
    ``cute.arch`` has no raw bulk copy (the DSL's TMA copies take tensor maps), and none with a cache policy."""
    ops = [cutlass.Int32(dst), cutlass.Int64(src), cutlass.Int32(nbytes), cutlass.Int32(mbar)]
    if evict_first:
        asm_store(ops, "{\n.reg .b64 pol;\ncreatepolicy.fractional.L2::evict_first.b64 pol, 1.0;\n"
                  "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
                  " [$0], [$1], $2, [$3], pol;\n}", "r,l,r,r", loc, ip)
    else:
        asm_store(ops, "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
                  "r,l,r,r", loc, ip)


# ----------------------------------------------------------------------------------------------------
# cp.async and tensor cores (the op's tensor-core kernel)
# ----------------------------------------------------------------------------------------------------


@dsl_user_op
def cp_async_8(dst, src, nbytes, *, loc=None, ip=None):
    """``cp.async.ca.shared.global`` of 8 bytes, ``nbytes`` of them read (8, or 0: zeros): the DSL's
    cp.async goes through copy atoms on tensors, not raw addresses."""
    asm_store([cutlass.Int32(dst), cutlass.Int64(src), cutlass.Int32(nbytes)],
              "cp.async.ca.shared.global [$0], [$1], 8, $2;", "r,l,r", loc, ip)


@dsl_user_op
def cp_async_commit(*, loc=None, ip=None):
    """``cp.async.commit_group``: the instruction of ``cute.arch.cp_async_commit_group``, as asm beside
    ``cp_async_8`` (the code as measured; tools/sass_digest.py checks a change)."""
    asm_store([], "cp.async.commit_group;", "", loc, ip)


@dsl_user_op
def cp_async_wait(pending, *, loc=None, ip=None):
    """``cp.async.wait_group pending`` (a constant): at most ``pending`` of this thread's copy groups in
    flight; the instruction of ``cute.arch.cp_async_wait_group``, as asm beside ``cp_async_8``."""
    asm_store([], f"cp.async.wait_group {int(pending)};", "", loc, ip)


@dsl_user_op
def mma_f16(a, b, c, *, loc=None, ip=None):
    """``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`` on plain registers (``a`` four, ``b`` two, fp32
    ``c`` four): the DSL's MMA atoms take fragments of tensors, the kernel's operands are decoded registers."""
    r = asm([T.f32()] * 4, [*[cutlass.Int32(v) for v in (*a, *b)], *[cutlass.Float32(v) for v in c]],
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
            "{$10, $11, $12, $13};", "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", loc, ip)
    return [cutlass.Float32(v) for v in r]


@dsl_user_op
def ldg_v4_if(addr, pred, *, volatile=True, loc=None, ip=None):
    """``ld.global.nc.v4`` where ``pred`` is non-zero, else zeros and no memory access (through the caches:
    W4A16's ``x``, read by every CTA, stays in L2). ``cute.arch`` has no predicated vector load.

    Volatile by default: an asm without side effects is pure to LLVM, which may hoist it above the branch
    that makes its address valid (W4A16's x read past its end that way: docs/design.md, "Loads in inline
    asm"). ``volatile=False`` only where every address the caller computes is in bounds whether or not a
    guard or clamp applies; then a move is harmless, and a hoist out of a loop may be what the caller wants."""
    r = asm([T.i32()] * 4, [cutlass.Int64(addr), cutlass.Int32(pred)],
             "{\n.reg .pred p;\nsetp.ne.s32 p, $5, 0;\nmov.b32 $0, 0;\nmov.b32 $1, 0;\nmov.b32 $2, 0;\n"
             "mov.b32 $3, 0;\n@p ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];\n}", "=r,=r,=r,=r,l,r", loc, ip,
             volatile=volatile)
    return [cutlass.Int32(v) for v in r]


@dsl_user_op
def lds_v4_if(addr, pred, *, loc=None, ip=None):
    """16-byte shared load where ``pred`` is non-zero, else zeros (``x`` rows past N are not stored);
    ordered after the barrier that follows the copy of ``x`` (side effects)."""
    r = asm([T.i32()] * 4, [cutlass.Int32(addr), cutlass.Int32(pred)],
             "{\n.reg .pred p;\nsetp.ne.s32 p, $5, 0;\nmov.b32 $0, 0;\nmov.b32 $1, 0;\nmov.b32 $2, 0;\n"
             "mov.b32 $3, 0;\n@p ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];\n}", "=r,=r,=r,=r,r,r", loc, ip,
             volatile=True)
    return [cutlass.Int32(v) for v in r]


@dsl_user_op
def ldg_w_v4(addr, *, loc=None, ip=None):
    """``ld.global.nc.L1::no_allocate.v4``: W4A16's ``w``, each byte read once (no ``cute.arch`` form takes
    the L1 hint)."""
    r = asm([T.i32()] * 4, [cutlass.Int64(addr)], "ld.global.nc.L1::no_allocate.v4.u32 {$0, $1, $2, $3}, [$4];",
             "=r,=r,=r,=r,l", loc, ip)
    return [cutlass.Int32(v) for v in r]


@dsl_user_op
def pair_halves(a, b, *, loc=None, ip=None):
    """Two ``prmt``: from ``a = (x0, x1)`` and ``b = (x4, x5)`` (16-bit halves) the pairs ``(x0, x4)`` and
    ``(x1, x5)``, the W4A16 A operand's value order (no ``cute.arch`` byte permute)."""
    r = asm([T.i32()] * 2, [cutlass.Int32(a), cutlass.Int32(b)],
             "prmt.b32 $0, $2, $3, 0x5410;\nprmt.b32 $1, $2, $3, 0x7632;", "=r,=r,r,r", loc, ip)
    return [cutlass.Int32(v) for v in r]


@dsl_user_op
def mma_16816(a, b, c, bf16, *, loc=None, ip=None):
    """``mma.sync.aligned.m16n8k16.row.col`` with bf16 or f16 operands (``a`` four registers, ``b`` two), fp32
    ``c``, on raw registers (``cute``'s MMA atoms take tensors in its fragment layouts, not these packed
    words)."""
    kind = "bf16.bf16" if bf16 else "f16.f16"
    r = asm([T.f32()] * 4, [*[cutlass.Int32(v) for v in (*a, *b)], *[cutlass.Float32(v) for v in c]],
             f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.f32 {{$0, $1, $2, $3}}, {{$4, $5, $6, $7}}, "
             "{$8, $9}, {$10, $11, $12, $13};", "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", loc, ip)
    return [cutlass.Float32(v) for v in r]


@dsl_user_op
def stg_u32x2(addr, v0, v1, *, loc=None, ip=None):
    """``st.global.v2.u32`` at a 64-bit address (``cute.arch`` stores take tensors, not raw addresses)."""
    asm_store([cutlass.Int64(addr), cutlass.Int32(v0), cutlass.Int32(v1)], "st.global.v2.u32 [$0], {$1, $2};",
              "l,r,r", loc, ip)


@dsl_user_op
def stg_u8(addr, v, *, loc=None, ip=None):
    """``st.global.u8`` of a register's low byte at a 64-bit address."""
    asm_store([cutlass.Int64(addr), cutlass.Int32(v)], "st.global.u8 [$0], $1;", "l,r", loc, ip)


@dsl_user_op
def div_rn(a, b, *, loc=None, ip=None):
    """``div.rn.f32`` (IEEE division, as torch's softmax and ``/=`` do)."""
    r = asm([T.f32()], [cutlass.Float32(a), cutlass.Float32(b)], "div.rn.f32 $0, $1, $2;", "=f,f,f", loc, ip)
    return cutlass.Float32(r[0])


@dsl_user_op
def fma_f32(a, b, c, *, loc=None, ip=None):
    """``fma.rn.f32``: ``a * b + c`` rounded once (an MMA block sum times its scale, into the running sum);
    the DSL's ``*`` and ``+`` are two roundings unless the compiler contracts them."""
    r = asm([T.f32()], [cutlass.Float32(a), cutlass.Float32(b), cutlass.Float32(c)],
            "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", loc, ip)
    return cutlass.Float32(r[0])


@dsl_user_op
def mul_bf16x2(a, b, *, loc=None, ip=None):
    """``mul.rn.bf16x2`` of two packed words (``x`` scaled by a power of two as it is copied; exact)."""
    r = asm([T.i32()], [cutlass.Int32(a), cutlass.Int32(b)], "mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", loc, ip)
    return cutlass.Int32(r[0])

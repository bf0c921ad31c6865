"""The experts' W4A16 kernel: one launch computes, for G groups of a mixture-of-experts layer's token rows,
each group's rows times the weight of its own expert,

    out[g * NT + n, r] = alpha[e_g] * sum_k x[g * NT + n, k] * w[e_g, r, k] * ws[e_g, r, k // 16]

for n < NT and every row r < M of the experts' [E, M, K] weights, where ``e_g = ids[g]``; a group whose id is
negative is skipped (its NT output rows are not written). The host (``experts_op``) sorts a call's
(token, expert) slots by expert and gives each expert hit one group of up to NT token rows, so an expert's
weights are read once for all the tokens routed to it (up to NT; past NT its tokens take another group).

It is ``w4a16.Nvfp4GemvW4A16`` (its arithmetic, tiles, tuning and error bound, unchanged) with a second
grid dimension: CTA ``(i, g)`` is CTA ``i`` of the plain kernel on group ``g``'s expert, x rows and out rows,
which it finds from ``ids[g]`` before anything else. The launch takes the op's 14 run-time values, two of
them in other roles: the activation-scale address (unused by W4A16) carries the address of ``ids`` (int32
[G]) and its row stride carries G, the grid's second dimension.

``ids64=E`` (a build for E experts) reads ``ids`` as int64 [G] instead, a router's ``top_k_index`` as it is,
and takes an id outside [0, E) (either 32-bit half: a negative one, transformers' sentinel E, any other) as
no expert: the one-token decode then needs no kernel to make int32 group ids (``decode_groups``).

``act="silu"`` (the down launch of a SwiGLU expert, ``x`` the gate/up launch's output) reads rows of 2K values,
``[gate | up]``, and takes ``h = silu(gate) * up`` as its x: the copy of x into shared memory (``x_smem``,
which ``act`` needs) computes, for each value, ``s = gate / (1 + exp(-gate))`` (the DSL's accurate ``exp``,
``div.rn``) and ``s * up`` in fp32, rounded once to x's dtype. That is ``F.silu(gate) * up`` as inductor
computes it (fp32 throughout, one rounding): the exact value rounded once, but within an ulp of it where
fp32's few-ulp error meets a rounding midpoint, and 0 for gates below about -88.7 (``exp(-gate)`` overflows
fp32; the exact value is below 2^-120 of ``up`` there), as torch's fp32 silu gives; eager torch rounds
``silu(gate)`` to x's dtype first (a second rounding). The products of ``h`` and ``w`` then have the plain kernel's bound.

``prefetch`` (for the gate/up launch of a SwiGLU expert at one token; measured slower there on an H100, so
``decode_forward`` leaves it off: docs/results.md): the launch takes two more addresses, the
down launch's ``w`` and ``ws``, and each CTA of group ``g`` first asks the L2 for its share of expert ``e_g``'s
down weight and scales (``cp.async.bulk.prefetch.L2``: a hint, nothing waits for it, no result), so that the
down launch's reads, which at one token are latency-bound (a CTA's few tiles, each a round trip), find their
bytes in the L2 and the DRAM reads of both launches overlap. The L2 is coherent: a prefetched line is never
stale, so the hint changes no result, only when bytes arrive.

Layouts: ``w`` uint8 [E, M, K/2] and ``ws`` e4m3 [E, M, K/16], each expert's rows following the previous
expert's (an expert's matrix is M row strides after the last); ``alpha`` fp32 [E]; ``x`` [G * NT, K] and
``out`` [G * NT, M] as the plain kernel takes them (16-byte aligned K-contiguous rows; unit stride along M);
with ``act`` ``x`` [G * NT, 2K].
"""

import cutlass
import cutlass.cute as cute
from cuda.bindings.driver import CUstream
from cutlass.cutlass_dsl import T, dsl_user_op

from .experts_op import ACTS
from .launch import dsl_compile
from .op_kernel import compile_op
from .ptx import asm, asm_store, div_rn
from .quant_kernel import widen8
from .w4a16 import Nvfp4GemvW4A16


@dsl_user_op
def pack_x2(lo, hi, bf16, *, loc=None, ip=None):
    """Two fp32 values rounded (to nearest even) to x's dtype, ``lo`` in the low half of the word."""
    cvt = "cvt.rn.bf16x2.f32" if bf16 else "cvt.rn.f16x2.f32"
    r = asm([T.i32()], [cutlass.Float32(lo), cutlass.Float32(hi)], f"{cvt} $0, $2, $1;", "=r,f,f", loc, ip)
    return cutlass.Int32(r[0])


@dsl_user_op
def prefetch_l2(addr, nbytes, *, loc=None, ip=None):
    """``cp.async.bulk.prefetch.L2.global``: ``nbytes`` (a multiple of 16) from ``addr`` (16-byte aligned)
    into the L2, a hint with no result (sm_90)."""
    asm_store([cutlass.Int64(addr), cutlass.Int32(nbytes)], "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r",
              loc, ip)


@dsl_user_op
def ldg_expert64(addr, n_experts, *, loc=None, ip=None):
    """``ld.global.nc`` of an int64 id: its low word where the id is in [0, n_experts) (high word 0, low word
    below n_experts unsigned), else -1."""
    r = asm([T.i32()], [cutlass.Int64(addr)],
            "{\n.reg .pred p, q;\n.reg .b32 lo, hi;\nld.global.nc.v2.b32 {lo, hi}, [$1];\nsetp.eq.b32 p, hi, 0;\n"
            f"setp.lt.and.u32 q, lo, {int(n_experts)}, p;\nselp.b32 $0, lo, -1, q;\n}}", "=r,l", loc, ip)
    return cutlass.Int32(r[0])


@dsl_user_op
def ldg_s32(addr, *, loc=None, ip=None):
    """``ld.global.nc.s32``: a group's expert id, written by the torch ops before the launch."""
    r = asm([T.i32()], [cutlass.Int64(addr)], "ld.global.nc.s32 $0, [$1];", "=r,l", loc, ip)
    return cutlass.Int32(r[0])


class Nvfp4ExpertsW4A16(Nvfp4GemvW4A16):
    """The W4A16 kernel over groups of token rows, each with its own expert (module docstring); one instance
    per the plain kernel's build (K, tokens a group, groups of 8 rows a CTA, dtypes, tuning). Plain scales,
    ``alpha`` always (one per expert)."""

    def __init__(self, k, n_tok, groups, x_bf16, out_bf16, act=None, prefetch=None, ids64=0, **tuning):
        if tuning.get("packed") or tuning.get("bulk"):
            raise ValueError("nvfp4_gemv: the experts' kernel takes neither packed weights nor bulk")
        if act is not None and act not in ACTS:
            raise ValueError(f"nvfp4_gemv: act={act!r}: the experts' kernel takes None or one of {ACTS}")
        super().__init__(k, n_tok, groups, x_bf16, False, True, out_bf16, **tuning)
        if act is not None and not self.x_smem:
            raise ValueError(f"nvfp4_gemv: act={act!r} needs x in shared memory (x_smem), not {tuning}")
        self.act = act
        # (bytes an expert of the prefetched weight, of its scales): the launch then takes their addresses too
        if prefetch is not None and (len(prefetch) != 2 or any(b <= 0 or b % 16 for b in prefetch)):
            raise ValueError(f"nvfp4_gemv: prefetch={prefetch!r}: two byte counts, positive multiples of 16")
        self.prefetch = prefetch
        if isinstance(ids64, bool) or not isinstance(ids64, int) or not 0 <= ids64 < 2 ** 31:
            raise ValueError(f"nvfp4_gemv: ids64={ids64!r}: 0 (int32 ids) or the count of experts (int64 ids)")
        self.ids64 = ids64

    def x_act(self, gate, up):
        """``silu(gate) * up`` for 8 values of x's dtype (four words each), in fp32, rounded once (module
        docstring): four words."""
        g = widen8(*gate, self.x_bf16)
        u = widen8(*up, self.x_bf16)
        h = [div_rn(g[i], cutlass.Float32(1.0) + cute.math.exp(-g[i])) * u[i] for i in range(8)]
        return [pack_x2(h[2 * i], h[2 * i + 1], self.x_bf16) for i in range(4)]

    @cute.jit
    def __call__(self, w_ptr: cutlass.Int64, x_ptr: cutlass.Int64, ws_ptr: cutlass.Int64, ids_ptr: cutlass.Int64,
                 out_ptr: cutlass.Int64, alpha_ptr: cutlass.Int64, m: cutlass.Int32, w_rs: cutlass.Int64,
                 ws_rs: cutlass.Int64, x_rs: cutlass.Int64, n_groups: cutlass.Int64, out_rs: cutlass.Int64,
                 grid_x: cutlass.Int32, stream):
        self.kernel(w_ptr, x_ptr, ws_ptr, ids_ptr, out_ptr, alpha_ptr, m, w_rs, ws_rs, x_rs, n_groups,
                    out_rs).launch(grid=[grid_x, cutlass.Int32(n_groups), 1], block=[self.threads, 1, 1],
                                   smem=self.smem_bytes, stream=stream, min_blocks_per_mp=self.min_blocks)

    @cute.kernel
    def kernel(self, w_ptr: cutlass.Int64, x_ptr: cutlass.Int64, ws_ptr: cutlass.Int64, ids_ptr: cutlass.Int64,
               out_ptr: cutlass.Int64, alpha_ptr: cutlass.Int64, m: cutlass.Int32, w_rs: cutlass.Int64,
               ws_rs: cutlass.Int64, x_rs: cutlass.Int64, n_groups: cutlass.Int64, out_rs: cutlass.Int64):
        self.group_body(w_ptr, x_ptr, ws_ptr, ids_ptr, out_ptr, alpha_ptr, m, w_rs, ws_rs, x_rs, out_rs,
                        cutlass.Int64(0), cutlass.Int64(0))

    @cute.jit
    def group_body(self, w_ptr, x_ptr, ws_ptr, ids_ptr, out_ptr, alpha_ptr, m, w_rs, ws_rs, x_rs, out_rs, pf_w_ptr,
                   pf_ws_ptr):
        bidx, grp, _ = cute.arch.block_idx()
        if cutlass.const_expr(self.ids64):
            e = ldg_expert64(ids_ptr + cutlass.Int64(grp) * 8, self.ids64)
        else:
            e = ldg_s32(ids_ptr + cutlass.Int64(grp) * 4)
        if e >= 0:  # (the same for the whole CTA: its barriers stay uniform)
            if cutlass.const_expr(self.prefetch is not None):
                # this CTA's share of expert e's prefetched weight and scales, 16-byte pieces, by thread 0
                tidx, _, _ = cute.arch.thread_idx()
                gdimx, _, _ = cute.arch.grid_dim()
                if tidx == 0:
                    for pf_ptr, per in ((pf_w_ptr, self.prefetch[0]), (pf_ws_ptr, self.prefetch[1])):
                        chunk = (cutlass.Int32(per // 16) + gdimx - 1) // gdimx * 16
                        off = bidx * chunk
                        if off < per:
                            prefetch_l2(pf_ptr + cutlass.Int64(e) * per + cutlass.Int64(off),
                                        cutlass.min(chunk, per - off))
            rows = cutlass.Int64(e) * cutlass.Int64(m)  # the expert's first row
            tok = cutlass.Int64(grp) * self.n_tok  # the group's first x and out row
            self.op_body(w_ptr + rows * w_rs, x_ptr + tok * x_rs, ws_ptr + rows * ws_rs, cutlass.Int64(0),
                         out_ptr + tok * out_rs, alpha_ptr + cutlass.Int64(e) * 4, m, w_rs, ws_rs, x_rs,
                         cutlass.Int64(0), out_rs)


class Nvfp4ExpertsW4A16Prefetch(Nvfp4ExpertsW4A16):
    """The experts' kernel with ``prefetch`` (module docstring): the launch's 13 values (six addresses, M, five
    row strides, the grid), then the two addresses of the weight and scales whose experts' bytes it
    prefetches, then the stream."""

    @cute.jit
    def __call__(self, w_ptr: cutlass.Int64, x_ptr: cutlass.Int64, ws_ptr: cutlass.Int64, ids_ptr: cutlass.Int64,
                 out_ptr: cutlass.Int64, alpha_ptr: cutlass.Int64, m: cutlass.Int32, w_rs: cutlass.Int64,
                 ws_rs: cutlass.Int64, x_rs: cutlass.Int64, n_groups: cutlass.Int64, out_rs: cutlass.Int64,
                 grid_x: cutlass.Int32, pf_w_ptr: cutlass.Int64, pf_ws_ptr: cutlass.Int64, stream):
        self.kernel(w_ptr, x_ptr, ws_ptr, ids_ptr, out_ptr, alpha_ptr, m, w_rs, ws_rs, x_rs, n_groups, out_rs,
                    pf_w_ptr, pf_ws_ptr).launch(grid=[grid_x, cutlass.Int32(n_groups), 1],
                                                block=[self.threads, 1, 1], smem=self.smem_bytes, stream=stream,
                                                min_blocks_per_mp=self.min_blocks)

    @cute.kernel
    def kernel(self, w_ptr: cutlass.Int64, x_ptr: cutlass.Int64, ws_ptr: cutlass.Int64, ids_ptr: cutlass.Int64,
               out_ptr: cutlass.Int64, alpha_ptr: cutlass.Int64, m: cutlass.Int32, w_rs: cutlass.Int64,
               ws_rs: cutlass.Int64, x_rs: cutlass.Int64, n_groups: cutlass.Int64, out_rs: cutlass.Int64,
               pf_w_ptr: cutlass.Int64, pf_ws_ptr: cutlass.Int64):
        self.group_body(w_ptr, x_ptr, ws_ptr, ids_ptr, out_ptr, alpha_ptr, m, w_rs, ws_rs, x_rs, out_rs, pf_w_ptr,
                        pf_ws_ptr)


def compile_experts_w4a16(k, n_tok, groups, x_bf16, out_bf16, options=None, tvm_ffi=None, act=None, prefetch=None,
                          ids64=0, **tuning):
    """Compiles the experts' kernel (no GPU needed when ``options`` names ``--gpu-arch``); with ``prefetch`` the
    launch takes two more addresses after the grid (``Nvfp4ExpertsW4A16Prefetch``)."""
    if prefetch is None:
        return compile_op(Nvfp4ExpertsW4A16(k, n_tok, groups, x_bf16, out_bf16, act=act, ids64=ids64, **tuning),
                          options, tvm_ffi)
    op = Nvfp4ExpertsW4A16Prefetch(k, n_tok, groups, x_bf16, out_bf16, act=act, prefetch=prefetch, ids64=ids64,
                                   **tuning)
    i64, i32 = cutlass.Int64(0), cutlass.Int32(1)
    return op, dsl_compile(op, (*[i64] * 6, i32, *[i64] * 5, i32, i64, i64, CUstream(0)), options, tvm_ffi)

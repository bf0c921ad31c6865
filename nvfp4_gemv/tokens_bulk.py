"""The op's bulk-copy kernel for a few tokens (``op_route.use_bulk``: up to 3, and 4 at K = 16384; more as a tuning).

``Nvfp4GemvBulk``'s pipeline with ``N`` token rows: a producer warp keeps ``stages`` tiles of ``rows`` rows
of ``w`` and their plain scales in flight with one ``cp.async.bulk`` a row (counted on the stage's ``full``
mbarrier); each consumer thread owns the same ``n`` chunks (16 bytes, 32 values) of every row of a tile, so
its share of the ``N`` token rows (int8 ``2x`` and scales / 4) is loaded once into registers. A chunk of
``w`` is decoded once into its byte lookups (from three tokens on, into signed int8) and each token then
costs four or eight ``dp4a`` a block, as in ``nvfp4_gemv.tokens``; nothing of ``x`` goes through shared
memory, which at four tokens would need more shared-memory bandwidth than the SM has. Sums are fp32 (the
op's accuracy contract): ``2n`` block terms a thread, a warp's sum over five shuffle levels (``scatter_sum``:
the tokens share the first levels), and the warps of a row added by the producer, which scales by
``alpha`` and stores bf16 or fp16.

Needs plain ``w`` scales with 16-byte aligned rows, ``K % 256 == 0`` with a row split into whole warps of at
most ``max_n`` chunks (so in effect ``K % 1024 == 0``), and ``n * N <= 8`` (registers).
"""

import cutlass
import cutlass.cute as cute

from .bulk import STAGE_EXTRA_BYTES, copy_tile, stage_buffers
from .decode import blocked_row, chunk_dots, chunk_lookups, e4m3x2_to_f32x2, fp4x8_to_i8, scale_offset
from .ptx import (
    SMEM_A_SM,
    ldg_f32,
    ldg_u16,
    ldg_v4,
    lds_stage_f32,
    lds_stage_u16,
    lds_stage_v4,
    mbar_arrive,
    mbar_wait,
    stg_as,
    sts_f32,
)
from .op_kernel import OpLaunch, compile_op


def scatter_sum(vals, lane):
    """Warp sums of ``len(vals)`` (a power of two up to 32: tokens x rows a thread) values a lane: lane ``l``
    gets the sum of value ``(l >> (5 - log2 len)) & (len - 1)``. Each of the first log2(len) levels halves the values a lane holds (it keeps one
    half and sends the other), so four tokens cost 6 shuffles and adds instead of a butterfly each (20)."""
    off = 16
    while len(vals) > 1:
        h = len(vals) // 2
        up = (lane & off) != 0
        keep = [cutlass.Float32(cutlass.select_(up, vals[h + i], vals[i])) for i in range(h)]
        send = [cutlass.Float32(cutlass.select_(up, vals[i], vals[h + i])) for i in range(h)]
        vals = [keep[i] + cute.arch.shuffle_sync_bfly(send[i], offset=off) for i in range(h)]
        off //= 2
    v = vals[0]
    while off >= 1:
        v = v + cute.arch.shuffle_sync_bfly(v, offset=off)
        off //= 2
    return v


class Nvfp4GemvTokensBulk(OpLaunch):
    """See the module docstring. ``threads`` is the consumer threads a CTA aims at (a power of two of whole
    rows' threads), ``max_n`` the most chunks a thread, ``rt`` the rows of a stage each thread takes (1, 2
    or 4: its share of x and the per-row work, the waits and the warp sums, serve ``rt`` rows)."""

    MAX_TOKENS = 4

    def __init__(self, k: int, n_tok: int, w_blocked: bool, x_blocked: bool, has_alpha: bool, out_bf16: bool,
                 bulk=1, threads=256, ctas=None, stages=None, max_n=None, evict=1, signed=None, rt=1):
        if w_blocked or k % 256:
            raise ValueError(f"nvfp4_gemv: the bulk-copy op kernel needs plain w scales and K % 256 == 0, "
                             f"got K={k}, blocked={w_blocked}")
        self.k = k
        self.n_tok = n_tok
        self.x_blocked = x_blocked
        self.has_alpha = has_alpha
        self.out_bf16 = out_bf16
        self.signed = n_tok >= 3 if signed is None else bool(signed)
        self.evict = evict
        self.chunks = c = k // 32
        max_n = max_n or (4 if n_tok == 1 else 2)
        # threads a row: whole warps (the butterfly spans a warp; the producer adds a row's warps), the
        # fewest that leave each thread at most max_n chunks
        fits = [t for t in range(32, min(c, 1024) + 1, 32) if c % t == 0 and c // t <= max_n]
        if not fits or n_tok * (c // fits[0]) > 8:
            raise ValueError(f"nvfp4_gemv: K={k}: no split of a row into whole warps with at most "
                             f"{max_n} chunks a thread for {n_tok} tokens")
        self.tr = tr = fits[0]
        self.n = c // tr
        if rt not in (1, 2, 4):
            raise ValueError(f"nvfp4_gemv: rows a thread must be 1, 2 or 4, got {rt}")
        self.rt = rt
        self.groups = 1 << max(0, (threads // tr).bit_length() - 1)  # thread groups of tr, one row each
        if self.groups * tr > 992:
            self.groups = 1
        self.rows = self.groups * rt  # rows a stage, a power of two: divides M % 128 == 0
        self.parts = tr // 32
        self.row_w = k // 2
        self.row_ws = k // 16
        self.stage_bytes = self.rows * (self.row_w + self.row_ws)
        self.part_bytes = -(-self.rows * self.parts * n_tok * 4 // 16) * 16
        # about 40 KB a CTA in flight, as the custom_kernel bulk kernel's best (3 stages of 4 rows at K = 7168)
        self.stages = stages or max(3, min(8, 40960 // self.stage_bytes))
        self.smem_bytes = self.stages * (self.stage_bytes + self.part_bytes + 16) + STAGE_EXTRA_BYTES
        self.threads = self.groups * tr + 32
        self.ctas = ctas or (2 if n_tok <= 2 else 1)
        if self.rows > 32 or self.threads > 1024:  # the producer's lanes each copy one row of a stage
            raise ValueError(f"nvfp4_gemv: K={k}: {self.rows} rows a stage (at most 32) and {self.threads} "
                             "threads a CTA (at most 1024)")
        if self.smem_bytes + 1024 > SMEM_A_SM // self.ctas:
            raise ValueError(f"nvfp4_gemv: K={k}: {self.stages} stages of {self.stage_bytes} bytes exceed the "
                             f"shared memory of {self.ctas} CTAs a SM")
        self.min_blocks = self.ctas

    @classmethod
    def can_implement(cls, k, n_tok, **tuning):
        """Whether this kernel builds for K = ``k`` and ``n_tok`` tokens a launch with ``tuning`` (its own
        checks: shared memory, whole warps, at most 32 registers' worth of x a thread; plain w scales)."""
        try:
            cls(k, n_tok, False, False, False, True, **tuning)
            return True
        except (ValueError, TypeError):  # (TypeError: a knob this kernel does not have)
            return False

    def grid_x(self, m, sms):
        return max(1, min(m // self.rows, sms * self.ctas))

    @cute.jit
    def op_body(self, w_ptr, x_ptr, ws_ptr, xs_ptr, out_ptr, alpha_ptr, m, w_rs, ws_rs, x_rs, xs_rs, out_rs):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdimx, _, _ = cute.arch.grid_dim()
        S = self.stages
        R = self.rows
        consumers = self.groups * self.tr
        # stage s: R rows of w, then R rows of its scales; fp32 partial per stage, row, warp of the row and token
        s_w, s_part, s_full, s_empty, tbl = stage_buffers(tidx, S, self.stage_bytes, self.part_bytes,
                                                          self.smem_bytes, consumers)

        n_t = (m // R - bidx + gdimx - 1) // gdimx  # tiles bidx, bidx + gdimx, ... of w
        if tidx >= consumers:
            self._produce(n_t, bidx, gdimx, tidx - consumers, s_w, s_part, s_full, s_empty, w_ptr, w_rs, ws_ptr,
                          ws_rs, out_ptr, out_rs, alpha_ptr)
        else:
            self._consume(n_t, tidx, s_w, s_part, s_full, s_empty, x_ptr, x_rs, xs_ptr, xs_rs, tbl)

    @cute.jit
    def _produce(self, n_t, bidx, gdimx, lane, s_w, s_part, s_full, s_empty, w_ptr, w_rs, ws_ptr, ws_rs, out_ptr,
                 out_rs, alpha_ptr):
        S = self.stages
        R = self.rows
        NT = self.n_tok
        alpha = cutlass.Float32(1.0)
        if cutlass.const_expr(self.has_alpha):
            alpha = ldg_f32(alpha_ptr)
        for j in cutlass.range(n_t + S, unroll=1):
            s = j % S
            if j >= S:
                mbar_wait(s_empty + 8 * s, (j // S - 1) & 1)
                if lane < R:
                    row = (bidx + (j - S) * gdimx) * R + lane
                    p = s_part + (s * R + lane) * (4 * self.parts * NT)
                    for t in cutlass.range_constexpr(NT):
                        acc = lds_stage_f32(p + 4 * t)
                        for q in cutlass.range_constexpr(1, self.parts):
                            acc = acc + lds_stage_f32(p + 4 * (q * NT + t))
                        stg_as(out_ptr + cutlass.Int64(t) * out_rs + cutlass.Int64(row) * 2, acc * alpha,
                               self.out_bf16)
            if j < n_t:
                copy_tile(lane, (bidx + j * gdimx) * R, s_w + s * self.stage_bytes, s_full + 8 * s, w_ptr, w_rs,
                          ws_ptr, ws_rs, R, self.row_w, self.row_ws, self.evict)

    @cute.jit
    def _consume(self, n_t, tidx, s_w, s_part, s_full, s_empty, x_ptr, x_rs, xs_ptr, xs_rs, tbl):
        S = self.stages
        R = self.rows
        NT = self.n_tok
        n = self.n
        r = tidx // self.tr
        jl = tidx % self.tr
        # this thread's share of every token row: 8 int8 words and two scales / 4 a chunk
        xw, xsc = [], []
        for t in cutlass.range_constexpr(NT):
            t64 = cutlass.Int64(t)
            if cutlass.const_expr(self.x_blocked):
                xs_row = blocked_row(xs_ptr, t64, xs_rs)
            else:
                xs_row = xs_ptr + t64 * xs_rs
            for i in cutlass.range_constexpr(n):
                ch = jl + i * self.tr
                v = ldg_v4(x_ptr + t64 * x_rs + cutlass.Int64(ch) * 16)
                words = []
                for q in cutlass.range_constexpr(4):
                    words += list(fp4x8_to_i8(v[q]))
                xw.append(words)
                s0, s1 = e4m3x2_to_f32x2(ldg_u16(xs_row + scale_offset(ch, self.x_blocked)))
                xsc.append((s0 * 0.25, s1 * 0.25))
        RT = self.rt
        NV = RT * NT
        NP = 1 << (NV - 1).bit_length()  # the rows' tokens padded to a power of two for the scatter
        lane = jl % 32
        for j in cutlass.range(n_t, unroll=1):
            s = j % S
            mbar_wait(s_full + 8 * s, (j // S) & 1)
            accs = []
            for q in cutlass.range_constexpr(RT):
                row = r * RT + q
                w_row = s_w + s * self.stage_bytes + row * self.row_w
                ws_row = s_w + s * self.stage_bytes + R * self.row_w + row * self.row_ws
                ws_ = []
                for i in cutlass.range_constexpr(n):
                    ws_.append(lds_stage_v4(w_row + (jl + i * self.tr) * 16))
                ss = []
                for i in cutlass.range_constexpr(n):
                    ss.append(lds_stage_u16(ws_row + (jl + i * self.tr) * 2))
                acc = [cutlass.Float32(0.0)] * NT
                for i in cutlass.range_constexpr(n):
                    sa0, sa1 = e4m3x2_to_f32x2(ss[i])
                    lk = chunk_lookups(ws_[i], tbl, self.signed)
                    for t in cutlass.range_constexpr(NT):
                        xv = xw[t * n + i]
                        sb0, sb1 = xsc[t * n + i]
                        d0, d1 = chunk_dots(lk, xv, self.signed)
                        acc[t] = acc[t] + d0 * (sa0 * sb0) + d1 * (sa1 * sb1)
                accs += acc
            total = scatter_sum(accs + [cutlass.Float32(0.0)] * (NP - NV), lane)
            p = s_part + (s * R + r * RT) * (4 * self.parts * NT) + (jl // 32) * (4 * NT)
            vi = lane // (32 // NP)  # value vi = q * NT + t: row r * RT + q, token t
            if lane % (32 // NP) == 0 and vi < NV:
                if cutlass.const_expr(RT > 1):
                    p = p + (vi // NT) * (4 * self.parts * NT) - 4 * (vi // NT) * NT
                sts_f32(p + 4 * vi, total)
            mbar_arrive(s_empty + 8 * s)


def compile_tokens_bulk(k, n_tok, w_blocked, x_blocked, has_alpha, out_bf16, options=None, tvm_ffi=None, **tuning):
    """Compiles the kernel (no GPU needed when ``options`` names ``--gpu-arch``)."""
    return compile_op(Nvfp4GemvTokensBulk(k, n_tok, w_blocked, x_blocked, has_alpha, out_bf16, **tuning), options,
                      tvm_ffi)

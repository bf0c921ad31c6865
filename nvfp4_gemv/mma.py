"""The model-code op's tensor-core kernel for up to 16 tokens (the op sends it 5 and more): ``out[n, m] = alpha * sum_k x[n, k] xs[n, k // 16]
w[m, k] ws[m, k // 16]``, with ``w`` read once and the products summed by ``mma.sync.m16n8k16`` (f16 in, fp32
accumulation), so that the arithmetic per value of ``w`` does not grow with the number of tokens.

Exact f16 operands: an e2m1 nibble ``s e1 e0 m`` placed as ``(s << 15) | (e1 e0 m << 9)`` is the f16 of
``v * 2^-14`` (subnormal for |v| = 0.5: exactly representable). One ``HMUL2`` by the block's e4m3 scale
(exact in f16) gives ``v * s * 2^-14``: a multiple of 2^-24 with at most 6 significant bits, exact again.
So every product in the tensor core is exact, and ``2^28 * alpha`` scales the fp32 sum at the end.

Tiles: ``x`` is the A operand (16 token rows, tokens 8..15 zero registers where ``N <= 8``), ``w`` the B
operand (8 rows of ``w``, "a group"). A lane with ``t = lane % 4`` owns 16 consecutive values (one scale block)
of a 64-value slice of K for its row (``g = lane // 4``); the four MMA k-steps of the slice take, in the
slots ``2t, 2t+1, 2t+8, 2t+9``, the value pairs ``(i, i + 4)`` of its two 8-value words. The dot product
does not depend on the order of k, and A and B use the same order, so the pairs need no shuffle. Each
lane decodes its own A fragment from global memory (no shared memory, no barrier in the main loop).

Work: a CTA owns ``groups`` groups (8 rows each) at a time, its warps split K into 64-value slices
(warp ``i`` takes slices ``i, i + W, ...``), loads of the next ``depth`` slices in flight. At the end the
warps' fp32 partials meet in shared memory and are added in a fixed order (deterministic), scaled, rounded
once to bf16/fp16 and stored. Sums: a warp adds K / (16 W) fp32 MMA results for an output, then W of those
are added: the error stays far below the op's 2^-14 of the sum of |terms|.

Layouts: as ``nvfp4_gemv.tokens`` (``w`` [M, K/2] and ``x`` [N, K/2] K-contiguous, 8-byte aligned rows;
scales plain [rows, K/16] K-contiguous or 128x4 blocked; ``out`` [N, M] unit stride along M).
"""

import cutlass
import cutlass.cute as cute

from .decode import blocked_row, scaled_f16x8
from .ptx import (
    SmemAllocator,
    cp_async_8,
    cp_async_commit,
    cp_async_wait,
    ldg_f32,
    ldg_u8,
    ldg_u8_if,
    ldg_v2,
    ldg_v2_if,
    lds_stage_f32,
    lds_stage_v2,
    mma_f16,
    stg_as,
    sts_f32x4,
)
from .op_kernel import OpLaunch, compile_op

TWO_POW_28 = 268435456.0
MAX_GROUPS = 8  # accumulators and loads in flight of a thread grow with it (registers)


class Nvfp4GemvMma(OpLaunch):
    """The op's tensor-core kernel; one instance per (K, tokens, groups, layouts, epilogue, tuning)."""

    @classmethod
    def can_implement(cls, k, n_tok, groups, **tuning):
        """Whether this kernel builds for K = ``k``, ``n_tok`` tokens a launch and ``groups`` groups of 8 rows a
        CTA with ``tuning`` (its own checks: 1..16 tokens, K % 64 == 0, the groups, whole warps)."""
        try:
            cls(k, n_tok, groups, False, False, False, True, **tuning)
            return True
        except (ValueError, TypeError):  # (TypeError: a knob this kernel does not have)
            return False

    def __init__(self, k: int, n_tok: int, groups: int, w_blocked: bool, x_blocked: bool, has_alpha: bool,
                 out_bf16: bool, w_contig: bool = True, ws_contig: bool = True, threads=None, depth=None, unroll=None,
                 stages=None):
        if not 1 <= n_tok <= 16:
            raise ValueError(f"nvfp4_gemv: the tensor-core kernel takes 1..16 tokens, not {n_tok}")
        if k % 64:
            raise ValueError(f"nvfp4_gemv: K={k} is not a multiple of 64")
        if not 1 <= groups <= MAX_GROUPS:  # M >= 128 holds 8 groups: the last tile can always move back
            raise ValueError(f"nvfp4_gemv: groups={groups}: expected 1..{MAX_GROUPS} groups of 8 rows a CTA")
        if threads is not None and (threads % 32 or not 32 <= threads <= 1024):
            raise ValueError(f"nvfp4_gemv: threads={threads}: expected whole warps, at most 1024")
        self.k = k
        self.n_tok = n_tok
        self.groups = groups
        self.w_blocked = w_blocked
        self.x_blocked = x_blocked
        self.has_alpha = has_alpha
        self.out_bf16 = out_bf16
        # rows of w (and of plain w scales) at their dense stride: compile-time offsets between the groups
        self.w_contig = bool(w_contig)
        self.ws_contig = bool(ws_contig) and not w_blocked
        # 16 warps, one slice in flight (at most 128 registers): faster than 8 warps with 2 (H200; docs/results.md)
        self.threads = threads or 512
        self.warps = self.threads // 32
        self.depth = depth or 1
        self.unroll = unroll or 1
        # stages > 0: the words of the next ``stages`` slices come through cp.async into the warp's own part
        # of shared memory (no registers held while they are in flight); the scale bytes stay loads into
        # registers, ``stages`` slices ahead. 0: every load into registers, ``depth`` slices ahead. On H200
        # stages = 2..4 measured slower than 0 at every N (docs/results.md): kept as a tuning.
        self.stages = int(stages or 0)
        self.items = (2 if n_tok > 8 else 1) + groups  # 8-byte words a lane loads a slice
        self.smem_bytes = max(self.warps * groups * 512, self.warps * self.stages * self.items * 256)
        self.min_blocks = 1

    def grid_x(self, m, sms):
        tiles = -(-(m // 8) // self.groups)
        return max(1, min(tiles, sms * self.min_blocks))

    def _w_rs(self, w_rs):
        return cutlass.Int64(self.k // 2) if cutlass.const_expr(self.w_contig) else w_rs

    def _ws_rs(self, ws_rs):
        return cutlass.Int64(self.k // 16) if cutlass.const_expr(self.ws_contig) else ws_rs

    def _slice_items(self, sl, g, t, row0, w_ptr, ws_ptr, x_ptr, xs_ptr, w_rs, ws_rs, x_rs, xs_rs):
        """What a lane reads for slice ``sl``: x (tokens g and g + 8), then each group's w row, each as
        (word address, scale address, predicate or None). Slices past the end and rows past M read the last
        ones instead (their results are never used), so that no w load needs a predicate; tokens past N
        read zeros."""
        NT = self.n_tok
        sl = cutlass.min(sl, self.k // 64 - 1)
        kb = cutlass.Int64(sl * 32 + t * 8)
        kbs = cutlass.Int64(sl * 512 + t) if cutlass.const_expr(self.x_blocked) else cutlass.Int64(sl * 4 + t)
        items = []
        for h in range(2 if NT > 8 else 1):
            tok = g + 8 * h
            tok64 = cutlass.Int64(cutlass.min(tok, NT - 1))
            if cutlass.const_expr(self.x_blocked):
                xs_addr = blocked_row(xs_ptr, tok64, xs_rs) + kbs
            else:
                xs_addr = xs_ptr + tok64 * xs_rs + kbs
            items.append((x_ptr + tok64 * x_rs + kb, xs_addr, cutlass.Int32(tok < NT)))
        w_rs = self._w_rs(w_rs)
        ws_rs = self._ws_rs(ws_rs)
        row64 = cutlass.Int64(row0 + g)
        w_row = w_ptr + row64 * w_rs + kb
        kws = cutlass.Int64(sl * 512 + t) if cutlass.const_expr(self.w_blocked) else cutlass.Int64(sl * 4 + t)
        ws_row = ws_ptr + row64 * ws_rs + kws
        for gr in range(self.groups):
            if cutlass.const_expr(self.w_blocked):
                ws_addr = blocked_row(ws_ptr, row64 + 8 * gr, ws_rs) + kws
            else:
                ws_addr = ws_row + ws_rs * (8 * gr)
            items.append((w_row + w_rs * (8 * gr), ws_addr, None))
        return items

    def _load_slice(self, *where):
        """Registers: per item its two words and its scale byte."""
        vals = []
        for word, sc, p in self._slice_items(*where):
            if p is None:
                vals += ldg_v2(word)
                vals.append(ldg_u8(sc))
            else:
                vals += ldg_v2_if(word, p)
                vals.append(ldg_u8_if(sc, p))
        return vals

    def _issue_slice(self, stage, lane, *where):
        """cp.async of every item's words into ``stage`` (item j at ``stage + 256 j + 8 lane``), one group;
        returns the scale bytes (register loads)."""
        scales = []
        for j, (word, sc, p) in enumerate(self._slice_items(*where)):
            if p is None:
                cp_async_8(stage + j * 256 + lane * 8, word, cutlass.Int32(8))
                scales.append(ldg_u8(sc))
            else:
                cp_async_8(stage + j * 256 + lane * 8, word, p * 8)
                scales.append(ldg_u8_if(sc, p))
        cp_async_commit()
        return scales

    def _slice_products(self, acc, cur, zero):
        """Adds one slice's products to the groups' accumulators; ``cur`` holds per item two words and a
        scale byte (x items first)."""
        XH = 2 if self.n_tok > 8 else 1
        xa = [scaled_f16x8(cur[3 * h], cur[3 * h + 1], cur[3 * h + 2]) for h in range(XH)]
        new_acc = []
        for gr in range(self.groups):
            o = 3 * (XH + gr)
            wb = scaled_f16x8(cur[o], cur[o + 1], cur[o + 2])
            c = acc[gr]
            for s in range(4):
                a1 = xa[1][2 * s] if XH == 2 else zero
                a3 = xa[1][2 * s + 1] if XH == 2 else zero
                c = mma_f16((xa[0][2 * s], a1, xa[0][2 * s + 1], a3), (wb[2 * s], wb[2 * s + 1]), c)
            new_acc.append(c)
        return new_acc

    @cute.jit
    def op_body(self, w_ptr, x_ptr, ws_ptr, xs_ptr, out_ptr, alpha_ptr, m, w_rs, ws_rs, x_rs, xs_rs, out_rs):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdimx, _, _ = cute.arch.grid_dim()
        NT = self.n_tok
        GR = self.groups
        W = self.warps
        D = self.depth
        S = self.stages
        n_slices = self.k // 64

        smem = SmemAllocator()
        s_buf = smem.allocate_tensor(cutlass.Float32, cute.make_layout(self.smem_bytes // 4), byte_alignment=16)
        s_red = s_buf.iterator.toint()

        wid = tidx // 32
        lane = tidx % 32
        g = lane // 4
        t = lane % 4
        my_slices = (n_slices - wid + W - 1) // W
        n_tiles = (m // 8 + GR - 1) // GR
        scale = cutlass.Float32(TWO_POW_28)
        if cutlass.const_expr(self.has_alpha):
            scale = scale * ldg_f32(alpha_ptr)
        zero = cutlass.Int32(0)

        for tile in cutlass.range(bidx, n_tiles, gdimx, unroll=1):
            # a last tile that would pass M starts lower instead: its first rows are the previous tile's again
            # (the same sums, stored twice)
            row0 = cutlass.min(tile * (GR * 8), m - GR * 8)
            ptrs = (w_ptr, ws_ptr, x_ptr, xs_ptr, w_rs, ws_rs, x_rs, xs_rs)
            acc = [[cutlass.Float32(0.0)] * 4 for _ in range(GR)]
            if cutlass.const_expr(S == 0):
                pipe = []
                for d in cutlass.range_constexpr(D):
                    pipe.append(self._load_slice(wid + d * W, g, t, row0, *ptrs))
                for i in cutlass.range(my_slices, unroll=self.unroll):
                    cur = pipe[0]
                    pipe = pipe[1:]
                    pipe.append(self._load_slice(wid + (i + D) * W, g, t, row0, *ptrs))
                    acc = self._slice_products(acc, cur, zero)
            else:
                stage_bytes = self.items * 256
                s_warp = s_red + wid * (S * stage_bytes)
                pipe = []
                for d in cutlass.range_constexpr(S):
                    pipe.append(self._issue_slice(s_warp + d * stage_bytes, lane, wid + d * W, g, t, row0, *ptrs))
                for i in cutlass.range(my_slices, unroll=self.unroll):
                    cp_async_wait(S - 1)  # this lane's copies of slice i (groups complete in order)
                    st = s_warp + (i % S) * stage_bytes
                    cur = []
                    for j in cutlass.range_constexpr(self.items):
                        cur += lds_stage_v2(st + j * 256 + lane * 8)
                        cur.append(pipe[0][j])
                    acc = self._slice_products(acc, cur, zero)
                    # the words are in registers and used: the stage takes slice i + S
                    pipe = pipe[1:]
                    pipe.append(self._issue_slice(st, lane, wid + (i + S) * W, g, t, row0, *ptrs))
                cp_async_wait(0)
                cute.arch.sync_threads()  # every warp's stages drained before the partials overwrite them

            for gr in cutlass.range_constexpr(GR):
                sts_f32x4(s_red + ((wid * GR + gr) * 32 + lane) * 16, acc[gr])
            cute.arch.sync_threads()
            for e in cutlass.range(tidx, GR * 128, self.threads, unroll=1):
                total = lds_stage_f32(s_red + e * 4)
                for w in cutlass.range_constexpr(1, W):
                    total = total + lds_stage_f32(s_red + (w * GR * 128 + e) * 4)
                gr = e // 128
                ln = (e // 4) % 32
                r = e % 4
                tok = ln // 4 + 8 * (r // 2)
                row = row0 + gr * 8 + 2 * (ln % 4) + r % 2
                if tok < NT:
                    stg_as(out_ptr + cutlass.Int64(tok) * out_rs + cutlass.Int64(row) * 2, total * scale,
                           self.out_bf16)
            cute.arch.sync_threads()


def compile_mma(k, n_tok, groups, w_blocked, x_blocked, has_alpha, out_bf16, w_contig=True, ws_contig=True,
                options=None, tvm_ffi=None, **tuning):
    """Compiles the kernel (no GPU needed when ``options`` names ``--gpu-arch``)."""
    return compile_op(Nvfp4GemvMma(k, n_tok, groups, w_blocked, x_blocked, has_alpha, out_bf16, w_contig, ws_contig,
                                   **tuning), options, tvm_ffi)

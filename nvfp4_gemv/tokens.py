"""The model-code op's kernel: ``out[n, m] = alpha * sum_k x[n, k] xs[n, k // 16] w[m, k] ws[m, k // 16]`` for
``N`` token rows ``x`` at once, so that the weights ``w`` (the bytes that bound the time) are read once.

It is the streaming kernel of ``nvfp4_gemv.streaming`` (``Nvfp4Gemv``: groups of lanes own a row of ``w`` at a
time, grid-strided over the rows, 16-byte loads in flight while the previous unit computes) with ``N``
vectors decoded into shared memory instead of one. A chunk of ``w`` (32 values) is decoded once into its
positive and negative byte lookups (from three tokens on, into signed int8); each token then costs eight
(four) ``dp4a`` a block against its int8 copy, one scaling and an fp32 fused multiply-add (the op's
accuracy contract allows fp32 sums: ``_chunk_dot_tokens``). ``N`` is a compile-time constant. Where ``N``
tokens' decoded copies do not fit in shared memory the op launches the kernel once per group of tokens
(``op_route.token_group``). The decode helpers it shares with ``tokens_bulk`` are in ``nvfp4_gemv.decode``.

Layouts: ``w`` [M, K/2] and ``x`` [N, K/2] K-contiguous with 16-byte aligned rows; each scale tensor plain
([rows, K/16], K-contiguous) or the 128x4 blocked layout of ``to_blocked`` (``w_blocked``/``x_blocked``);
``out`` [N, M] with unit stride along M; ``alpha`` one fp32 on the device, or none.
"""

import cutlass
import cutlass.cute as cute

from .decode import (
    E2M1_TIMES2_LO,
    blocked_row,
    chunk_dots,
    chunk_lookups,
    e4m3x2_to_f32x2,
    fp4x8_to_i8,
    group_sum,
    scale_offset,
)
from .op_kernel import OpLaunch, compile_op
from .ptx import (
    SMEM_A_SM,
    SmemAllocator,
    ldg_f32,
    ldg_u16,
    ldg_v4,
    lds_f32x2,
    lds_u32,
    lds_v4,
    stg_as,
    sts_f32x2,
    sts_u32,
    sts_v4,
)
from .streaming import Nvfp4Gemv


class Nvfp4GemvTokens(OpLaunch, Nvfp4Gemv):
    """``Nvfp4Gemv`` over ``n_tok`` token rows at once: see the module docstring."""

    def __init__(self, k: int, n_tok: int, w_blocked: bool, x_blocked: bool, has_alpha: bool, out_bf16: bool,
                 threads=None, min_blocks=None, depth=None, group=None, signed=None):
        # several tokens: 512 threads and one CTA a SM (up to 128 registers a thread) measured faster than
        # 256 x 2 at N = 2..16 on H200 (docs/results.md); one token keeps the streaming kernel's
        self.threads = threads or (256 if n_tok == 1 else 512)
        self.n_tok = n_tok
        self.x_blocked = x_blocked
        self.has_alpha = has_alpha
        self.out_bf16 = out_bf16
        # a signed int8 copy of a w block costs 12 instructions and saves 5 a token: from 3 tokens on
        self.signed = n_tok >= 3 if signed is None else bool(signed)
        super().__init__(k, w_blocked, depth=depth or 2, group=group)
        self.smem_bytes = 40 * self.chunks * n_tok + 16
        fit = SMEM_A_SM // (self.smem_bytes + 1024)
        if fit < 1:
            raise ValueError(f"nvfp4_gemv: K={k}: {n_tok} tokens do not fit in shared memory")
        self.min_blocks = max(1, min(fit, min_blocks or (4 if n_tok == 1 else 1)))

    @classmethod
    def can_implement(cls, k, n_tok, **tuning):
        """Whether this kernel builds for K = ``k`` and ``n_tok`` tokens a launch with ``tuning`` (its own
        checks: the streaming kernel's unit of K, the tokens' decoded copies in shared memory)."""
        try:
            cls(k, n_tok, False, False, False, True, **tuning)
            return True
        except (ValueError, TypeError):  # (TypeError: a knob this kernel does not have)
            return False

    @staticmethod
    def max_tokens(k):
        """The most tokens whose decoded copies fit one CTA's shared memory."""
        return (SMEM_A_SM - 1024 - 16) // (40 * (k // 32))

    @cute.jit
    def op_body(self, w_ptr, x_ptr, ws_ptr, xs_ptr, out_ptr, alpha_ptr, m, w_rs, ws_rs, x_rs, xs_rs, out_rs):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdimx, _, _ = cute.arch.grid_dim()
        G = self.group
        C = self.chunks
        NT = self.n_tok
        nb = self.per_lane // self.batch

        smem = SmemAllocator()
        s_buf = smem.allocate_tensor(cutlass.Int32, cute.make_layout(self.smem_bytes // 4), byte_alignment=16)
        s_b = s_buf.iterator.toint()  # token t: int8 x in two 16-byte halves a chunk, then its scales / 4
        s_tbl = s_b + 40 * C * NT

        lane = tidx % G
        step, n_units, row, pipe, irow, ibt = self._first_units(tidx, bidx, gdimx, m, lane, w_ptr, ws_ptr, w_rs,
                                                                ws_rs)
        bt = cutlass.Int32(0)

        for i in cutlass.range(tidx, C * NT, self.threads):
            t = i // C
            c = i - t * C
            t64 = cutlass.Int64(t)
            xw = ldg_v4(x_ptr + t64 * x_rs + cutlass.Int64(c) * 16)
            base = s_b + t * (40 * C)
            w0, w1 = fp4x8_to_i8(xw[0])
            w2, w3 = fp4x8_to_i8(xw[1])
            w4, w5 = fp4x8_to_i8(xw[2])
            w6, w7 = fp4x8_to_i8(xw[3])
            sts_v4(base + c * 16, w0, w1, w2, w3)
            sts_v4(base + 16 * C + c * 16, w4, w5, w6, w7)
            if cutlass.const_expr(self.x_blocked):
                xs_row = blocked_row(xs_ptr, t64, xs_rs)
            else:
                xs_row = xs_ptr + t64 * xs_rs
            xs_row = xs_row + scale_offset(c, self.x_blocked)
            s0, s1 = e4m3x2_to_f32x2(ldg_u16(xs_row))
            sts_f32x2(base + 32 * C + c * 8, s0 * 0.25, s1 * 0.25)
        if tidx == 0:
            sts_u32(s_tbl, cutlass.Int32(E2M1_TIMES2_LO))
        cute.arch.sync_threads()
        tbl = lds_u32(s_tbl)
        alpha = cutlass.Float32(1.0)
        if cutlass.const_expr(self.has_alpha):
            alpha = ldg_f32(alpha_ptr)

        acc = [cutlass.Float32(0.0)] * NT
        for _u in cutlass.range(n_units, unroll=1):
            pipe.append(self._load_unit(irow, ibt, irow < m, lane, w_ptr, ws_ptr, w_rs, ws_rs))
            irow, ibt = self._next_unit(irow, ibt, step)
            cur = pipe[0]
            c0 = lane + bt * (self.batch * G)
            for i in cutlass.range_constexpr(self.batch):
                acc = self._chunk_dot_tokens(acc, cur[4 * i:4 * i + 4], cur[4 * self.batch + i], c0 + i * G,
                                             s_b, tbl)
            if bt == nb - 1:
                for t in cutlass.range_constexpr(NT):
                    total = group_sum(acc[t], self.shuffle_offsets)
                    if lane == 0:
                        stg_as(out_ptr + cutlass.Int64(t) * out_rs + cutlass.Int64(row) * 2, total * alpha,
                               self.out_bf16)
                acc = [cutlass.Float32(0.0)] * NT
            row, bt = self._next_unit(row, bt, step)
            pipe = pipe[1:]

    @cute.jit
    def _chunk_dot_tokens(self, acc, x, s16, c, s_b, tbl):
        """Adds chunk ``c``'s terms (two blocks) to each token's fp32 sums. Each block's term is exact
        (an integer dot below 2^12 times two e4m3 scales); a lane adds K / (16 G) of them and the butterfly
        log2(G) more, so a result is within (K / (16 G) + log2 G) * 2^-24 of the sum of |terms|. G >= 2, so
        that is at most (K / 32 + 1) * 2^-24 <= 2^-14 for K <= 32768 (G = 2 where K / 64 is odd): the op's
        promise, with no room to spare at the largest K."""
        sa0, sa1 = e4m3x2_to_f32x2(s16)
        lk = chunk_lookups(x, tbl, self.signed)
        C = self.chunks
        out = []
        for t in cutlass.range_constexpr(self.n_tok):
            base = s_b + t * (40 * C)
            w = lds_v4(base + c * 16) + lds_v4(base + 16 * C + c * 16)
            sb0, sb1 = lds_f32x2(base + 32 * C + c * 8)
            d0, d1 = chunk_dots(lk, w, self.signed)
            a = acc[t] + d0 * (sa0 * sb0)
            out.append(a + d1 * (sa1 * sb1))
        return out

    def grid_x(self, m, sms):
        return max(1, min(-(-m // self.rows_per_cta), sms * self.ctas_per_sm()))


def compile_tokens(k, n_tok, w_blocked, x_blocked, has_alpha, out_bf16, options=None, tvm_ffi=None, **tuning):
    """Compiles the kernel (no GPU needed when ``options`` names ``--gpu-arch``)."""
    return compile_op(Nvfp4GemvTokens(k, n_tok, w_blocked, x_blocked, has_alpha, out_bf16, **tuning), options,
                      tvm_ffi)

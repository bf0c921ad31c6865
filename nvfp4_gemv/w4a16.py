"""W4A16: bf16 or fp16 activations times NVFP4 weights, ``out[n, m] = alpha * sum_k x[n, k] w[m, k] ws[m, k // 16]``.

This is the product Hopper serving runs for NVFP4 checkpoints (weight-only): ``x`` is taken as it is, no
quantization. One kernel (``Nvfp4GemvW4A16``) serves 1..32 tokens a launch with ``w`` read once; more
tokens launch once per group of at most 32. This module is the kernel; which build a shape takes is
``w4a16_route``, the host's launch plans ``op_plan``.

Exact operands for the tensor cores (``mma.sync.m16n8k16``, fp32 accumulation):

* fp16 ``x``: an e2m1 nibble placed as the f16 of ``v * 2^-14`` (``decode.scaled_f16x8``), times the block's
  e4m3 scale in one ``HMUL2``: ``v * s * 2^-14`` has at most 6 significant bits and is at least 2^-24
  (f16's least subnormal), so it is exact; ``2^14`` scales the sum back.
* bf16 ``x``: the nibble's three magnitude bits go to bf16 bits 6..8 and its sign to bit 15, which is the
  bf16 of ``v * 2^-126`` (0.5 lands on the subnormal 2^-127); one ``HMUL2`` by the bf16 of ``s * 2^119``
  gives ``v * s * 2^-7``, in [2^-17, 21]: normal and exact. ``2^7`` scales the sum back. With ``dec``
  the same bits come from ``decode.scaled_bf16_chunk`` (a chunk at once, three operations a pair).

The products ``x * w'`` are then exact in fp32 (8 + 6 or 11 + 6 significant bits), for bf16 ``x`` as long as
they stay in fp32's normal range (``|x| >= 2^-109``, far below any activation; ``|x| < 2^123``). An e4m3 NaN
scale byte (0x7F, 0xFF) makes its row's outputs NaN on both paths, as in the reference.

``late`` (one token on many rows): the weights decode unscaled, an MMA chain sums one scale block and one FFMA
scales it; bf16 ``x`` is copied times 2^72 (exact) so the sums stay normal for ``|x|`` in [2^-62, 2^56) (fp16:
any); the 2^54 (fp16: 2^14) that scales them back is folded into ``alpha`` (bf16 ``alpha`` < 2^74 there).

Error bound: the only roundings are the fp32 sums and the final store. A warp adds its ``K / (16 W)`` MMA
results for an output in order (with ``chains=2`` as two interleaved sums, then one addition), then the ``W``
warps' partials are added in a fixed order (deterministic), times ``2^7`` or ``2^14`` (exact) and ``alpha``
(one fp32 rounding), rounded once to the output dtype. Taking each MMA's fp32 accumulation (which truncates)
to be within 2^-22 of the sum of |terms| so far, the result differs from the exact one by at most half an ulp
of the output plus ``(K / (16 W) + W + 3) * 2^-22`` of ``sum |terms|``: 2^-13.9 at K = 32768 with 8 warps,
under the op's 2^-12. With ``late`` a block's 16 products pass 4 MMA accumulations, then one FFMA each
(scale and running sum, one rounding), the four lanes of a row 2 additions and the warps ``W - 1``: at most
``4 * 2^-22 + (K / (64 W) + W + 3) * 2^-24`` (2^-17.5 at K = 32768). The tests hold it to 2^-13 (random,
cancelling and subnormal-scale inputs).

Tiles and work (the operands' k-order, ``late``'s block-diagonal B operand, ``across``, ``x_smem``; how a
slice's instructions go: docs/design.md, "W4A16"): up to 8 tokens (``w_a``) ``w`` is the A operand (two
groups of 8 rows) and ``x`` the B operand (8 token columns); from 9 tokens ``x`` is the A operand (16 token
rows, a second tile past 16) and ``w`` the B operand (a group). A slice is 128 values of K: lane ``t`` of row
``g`` loads the row's 16-byte chunk ``4 * slice + t`` and its two scale bytes. A CTA owns ``groups`` groups
at a time; its ``W`` warps split K by slices with the next ``depth`` slices' loads in flight; ``x`` comes
with ``w`` (registers) or, with ``x_smem``, from shared memory copied once a CTA; the warps' partials meet in
shared memory in a fixed order. ``K % 128 == 64``: the last slice's lanes 2 and 3 read lane 1's chunk again
and take zeros for ``x``. Measuring builds (``probe``, ``bulk``; never routed): the same section.

Layouts: ``w`` [M, K/2] uint8 and ``x`` [N, K] K-contiguous with 16-byte aligned rows; ``ws`` plain [M, K/16]
K-contiguous with even row strides, or 128x4 blocked; ``out`` [N, M] unit stride along M; ``alpha`` one fp32
on the device, or none.
"""

import cutlass
import cutlass.cute as cute

from .decode import blocked_row, e4m3x2_to_f32x2, scale_offset, scaled_bf16_chunk, scaled_bf16x8, scaled_f16x8
from .ptx import (
    SMEM_A_SM, SmemAllocator, bulk_g2s, fma_f32, ldg_f32, ldg_u16, ldg_v4, ldg_v4_if, ldg_w_v4, lds_stage_f32,
    lds_stage_u16, lds_stage_v4, lds_v4_if, mbar_arrive, mbar_arrive_expect_tx, mbar_init, mbar_init_fence,
    mbar_wait, mma_16816, mul_bf16x2, pair_halves, stg_as, sts_f32x4, sts_v4,
)
from .op_kernel import OpLaunch, compile_op

MAX_TOKENS = 32  # tokens a launch takes: two A tiles of 16
MAX_GROUPS = 8
W_A_TOKENS = 8  # tokens up to which w is the A operand (x, as B, has 8 columns)
SMEM_CTA = SMEM_A_SM - 1024  # the most one CTA may use on sm_90 and sm_100 (1 KiB of a SM reserved a CTA)
BF16_SUM_SCALE = 128.0  # 2^7: undoes the 2^-7 of the bf16 weights
F16_SUM_SCALE = 16384.0  # 2^14: undoes the 2^-14 of the f16 weights
X_LATE_BF16X2 = 0x63806380  # bf16x2 of 2^72: late's bf16 x, so that x * v * 2^-126 * s stays normal
LATE_BF16_SUM_SCALE = 2.0 ** 54  # undoes late's 2^72 * 2^-126
XBATCH = 8  # copies of x (16 bytes each) a thread has in flight while x is copied into shared memory


class Nvfp4GemvW4A16(OpLaunch):
    """The W4A16 kernel; one instance per (K, tokens, groups, x dtype, scale layout, epilogue, tuning)."""

    # act (the experts' kernel sets it; needs x in shared memory): x's rows are [gate K | up K] and the copy
    # into shared memory stores ``self.x_act(gate, up)`` (four words of x's dtype) for each 16 bytes of x
    act = None

    @classmethod
    def can_implement(cls, k, n_tok, groups, **tuning):
        """Whether this kernel builds for K = ``k``, ``n_tok`` tokens a launch and ``groups`` groups of 8 rows a
        CTA with ``tuning`` (its own checks: 1..32 tokens, K % 64 == 0, the groups, shared memory, the knobs'
        combinations)."""
        try:
            cls(k, n_tok, groups, True, False, True, True, **tuning)
            return True
        except (ValueError, TypeError):  # (TypeError: a knob this kernel does not have)
            return False

    def __init__(self, k: int, n_tok: int, groups: int, x_bf16: bool, w_blocked: bool, has_alpha: bool,
                 out_bf16: bool, threads=None, depth=None, ctas=None, x_smem=None, chains=None, w_a=None,
                 dec=None, xpair=None, late=None, across=None, xbatch=None, probe=None, bulk=None, span=None, even=None, packed=None):
        if not 1 <= n_tok <= MAX_TOKENS:
            raise ValueError(f"nvfp4_gemv: the W4A16 kernel takes 1..{MAX_TOKENS} tokens, not {n_tok}")
        if k % 64 or k <= 0:
            raise ValueError(f"nvfp4_gemv: K={k} is not a positive multiple of 64")
        if not 1 <= groups <= MAX_GROUPS:
            raise ValueError(f"nvfp4_gemv: groups={groups}: expected 1..{MAX_GROUPS} groups of 8 rows a CTA")
        self.k = k
        self.n_tok = n_tok
        self.groups = groups
        self.x_bf16 = bool(x_bf16)
        self.w_blocked = bool(w_blocked)
        self.has_alpha = bool(has_alpha)
        self.out_bf16 = bool(out_bf16)
        self.n_slices = -(-k // 128)
        warps = min(16, self.n_slices)  # no warp without a slice
        if threads is not None:
            if threads % 32 or not 32 <= threads <= 1024:
                raise ValueError(f"nvfp4_gemv: threads={threads}: expected whole warps, at most 1024")
            warps = threads // 32
        self.warps = warps
        self.threads = 32 * warps
        self.depth = depth or 1
        # accumulators a group and A tile: with 2, even and odd k-steps add into separate registers (two
        # dependent HMMA chains of 4 a slice instead of one of 8), summed before the warps' partials meet
        self.chains = int(chains or 1)
        if self.chains not in (1, 2):
            raise ValueError(f"nvfp4_gemv: chains={chains}: expected 1 or 2")
        self.halves = -(-n_tok // 8)  # 8-token halves of the A tiles
        self.a_tiles = -(-self.halves // 2)
        # w_a: w is the A operand (two groups, 16 rows, an MMA) and x the B operand (8 tokens): 256 weights an
        # MMA instead of 128, for at most 8 tokens and an even number of groups
        self.w_a = bool(w_a)
        if self.w_a and (n_tok > W_A_TOKENS or groups % 2):
            raise ValueError(f"nvfp4_gemv: w_a takes at most 8 tokens and even groups, not {n_tok} and {groups}")
        self.units = groups // 2 if self.w_a else groups  # accumulator sets a warp holds (per A tile)
        self.red_bytes = self.warps * self.units * self.a_tiles * 512
        # x copied once into shared memory (rows of K values, 16 bytes apart more than K * 2 so that the rows
        # of a warp's lanes fall in other banks) where it fits: a slice then holds only w in registers
        self.x_row_bytes = 2 * k + 16
        # late (below) reads a row padded with zeros to whole slices, and 32 zero bytes (the last of the
        # padding where K % 128 == 64)
        self.late = bool(late)
        if self.late:
            self.x_row_bytes = 2 * k + (32 if k % 128 == 0 else 128)
        # bulk (measuring build, never routed; docs/design.md, "W4A16"): warp 0 keeps ``bulk`` stages of ``span``
        # rounds of W slices in shared memory (a cp.async.bulk a row for w and one for its scales, on mbarriers);
        # rows padded so that a quarter warp's two rows of 16-byte reads fall in other banks
        self.bulk = int(bulk or 0)
        self.span = int(span or 1)
        self.rows = 8 * groups
        self.row_w = self.warps * 64 * self.span
        self.row_w_pad = self.row_w + 64 if self.row_w % 128 == 0 else self.row_w
        self.row_s = self.warps * 8 * self.span
        self.row_s_pad = -(-self.row_s // 16) * 16 + (16 if self.row_s % 32 == 0 else 0)
        self.stage_bytes = self.rows * (self.row_w_pad + self.row_s_pad)
        self.rounds = self.n_slices // self.warps
        self.bulk_bytes = self.bulk * (self.stage_bytes + 16)  # the stages, then a full and an empty barrier each
        if self.bulk and not (2 <= self.bulk <= 8 and not w_blocked and k % (128 * self.warps) == 0
                              and self.rounds % self.span == 0 and self.row_s % 16 == 0 and self.rows <= 32):
            raise ValueError(f"nvfp4_gemv: bulk={bulk} takes 2..8 stages, plain scales, whole stages a tile "
                             f"(K % (128 x warps x span) == 0), scale rows of whole 16 bytes (warps x span even) "
                             f"and at most 4 groups (a lane copies a row), not K={k} with {self.warps} warps, span "
                             f"{self.span}, {groups} groups")
        fits = self.red_bytes + self.bulk_bytes + n_tok * self.x_row_bytes <= SMEM_CTA
        self.x_smem = fits if x_smem is None else bool(x_smem)
        if self.x_smem and not fits:
            raise ValueError(f"nvfp4_gemv: {n_tok} rows of x (K={k}) do not fit in shared memory")
        self.smem_bytes = self.red_bytes + self.bulk_bytes + (n_tok * self.x_row_bytes if self.x_smem else 0)
        # dec (bf16 x): a chunk's 32 values decoded at once, three operations a pair (``scaled_bf16_chunk``)
        # instead of ``scaled_bf16x8``'s four; ignored for fp16 x
        self.dec = bool(dec) and self.x_bf16
        # xpair (x in shared memory): x stored there already in the MMA's pair order, the ``prmt`` pairs made
        # once a CTA when it is copied instead of once a slice a lane
        self.xpair = bool(xpair) and self.x_smem
        # late (one token; the module docstring): block scales times the MMA's block sums, x block-diagonal in B
        if self.late and not (n_tok == 1 and self.w_a and self.x_smem and self.xpair):
            raise ValueError("nvfp4_gemv: late takes one token with w_a, x_smem and xpair")
        if self.late:
            self.chains = 1  # its own two chains, one a block
        # across: the last slices of a tile prefetch the next tile's first ones (no drained pipeline between
        # tiles); needs every warp with slices to have at least depth of them (any K at depth 1)
        self.across = bool(across) and not bulk  # bulk: its stages run on across tiles by themselves
        if self.across and self.depth > 1 and self.n_slices < self.depth * self.warps:
            raise ValueError(f"nvfp4_gemv: across at depth {self.depth} needs K > {128 * (self.depth * self.warps - 1)} "
                             f"(depth x warps slices), not {k}")
        # x_fixed: x's loads from registers are not volatile, so the compiler may hoist them out of the tile
        # loop. Only where every slice index _load_slice gets is below n_slices before its clamp (across, each
        # warp the same n_slices / warps slices, whole 128-value slices: the prefetch index
        # wid + (i + depth - my) x warps stays below n_slices), so that the loads are in bounds wherever they
        # go (docs/design.md, "Loads in inline asm"); x from registers (x_smem reads shared memory); and only
        # at 16 tokens (two whole 8-token halves: no token's address needs its clamp), the token count where
        # loading x once a CTA rather than once a tile measured faster (docs/results.md, W4A16, "x_fixed").
        self.x_fixed = (self.across and not self.x_smem and self.n_slices % self.warps == 0 and k % 128 == 0
                        and n_tok == 16)
        # xbatch (x in shared memory): 16-byte copies a thread has in flight while x is copied (unrolled)
        self.xbatch = XBATCH if xbatch is None else int(xbatch)
        if self.xbatch < 1:
            raise ValueError(f"nvfp4_gemv: xbatch={xbatch}: expected at least 1")
        # probe (measuring builds, never routed; wrong results): 1 the loads of w and its scales only (XOR-folded
        # into one sum), 2 the arithmetic only (words made from the slice and lane), 3 as 1 without the scales
        self.probe = int(probe or 0)
        if self.probe not in (0, 1, 2, 3):
            raise ValueError(f"nvfp4_gemv: probe={probe}: expected 0..3")
        if self.bulk and not self.x_smem:
            raise ValueError("nvfp4_gemv: bulk takes x in shared memory")
        # even (host side only): as many CTAs as take the tiles in the fewest rounds with every CTA's count
        # within one of the others' (1792 tiles on 1056 slots: 896 CTAs of 2 tiles instead of 1056 of 1 or 2)
        self.even = bool(even)
        # packed: w and its scales in one buffer, ``packed.py``'s layout (an 8-row group's slice: 512 bytes of w,
        # the 8 rows' 64 bytes one after another, then their 64 scale bytes), rows of 9K/16 bytes; ws_ptr unused
        self.packed = bool(packed)
        if self.packed and (k % 128 or w_blocked or bulk or probe):
            raise ValueError(f"nvfp4_gemv: packed takes K % 128 == 0 and none of blocked scales, bulk, probe (K={k})")
        self.min_blocks = int(ctas or 1)  # CTAs a SM (launch bound: registers a thread <= 64K / (ctas * threads))
        # undoes the weights' (and with late bf16 x's) power of two; with late bf16 2^54 * alpha, so alpha < 2^74
        self.sum_scale = F16_SUM_SCALE if not self.x_bf16 else LATE_BF16_SUM_SCALE if self.late else BF16_SUM_SCALE

    def grid_x(self, m, sms):
        tiles = -(-(m // 8) // self.groups)
        slots = sms * self.min_blocks
        if self.even:
            rounds = -(-tiles // slots)
            return max(1, -(-tiles // rounds))
        return max(1, min(tiles, slots))

    def _load_slice(self, sl, g, t, row0, w_ptr, ws_ptr, x_ptr, w_rs, ws_rs, x_rs):
        """What a lane reads for slice ``sl``: per group its 16-byte chunk of ``w`` (4 words) and the chunk's
        two scale bytes (one u16), then per 8-token half ``h`` its 32 values of ``x`` (token ``g + 8h``;
        16 words). Slices past the end read the last one (their results are never used); chunks past a
        ``K % 128 == 64`` row read the row's last chunk, and ``x`` there reads zeros."""
        NT = self.n_tok
        sl = cutlass.min(sl, self.n_slices - 1)
        chunk = sl * 4 + t
        vals = []
        if cutlass.const_expr(self.k % 128 == 0):
            c_w = chunk
            live = cutlass.Int32(1)
        else:
            c_w = cutlass.min(chunk, self.k // 32 - 1)
            live = cutlass.Int32(chunk < self.k // 32)
        row64 = cutlass.Int64(row0 + g)
        kb = cutlass.Int64(c_w) * 16
        ks = scale_offset(c_w, self.w_blocked)
        for gr in range(self.groups):
            r = row64 + 8 * gr
            if cutlass.const_expr(self.probe == 3):  # w's loads alone: the scale word made from the slice
                vals += ldg_w_v4(w_ptr + r * w_rs + kb)
                vals.append(cutlass.Int32((sl & 0x0707) | 0x3030))
                continue
            if cutlass.const_expr(self.probe == 2):
                v = cutlass.Int32(sl * 0x01030507 + (g * 8 + t * 2 + gr) * 0x11111111)
                vals += [v, v ^ 0x12345678, v ^ 0x3C3C3C3C, v ^ 0x0F0F0F0F, (v & 0x0707) | 0x3030]
                continue
            if cutlass.const_expr(self.packed):
                # the group's slice: one 576-byte piece, w_rs = 9K/16 (8 rows are 9K/2 bytes, 576 a slice)
                at = w_ptr + cutlass.Int64(row0 + 8 * gr) * w_rs + cutlass.Int64(sl) * 576
                vals += ldg_w_v4(at + cutlass.Int64(g * 64 + t * 16))
                vals.append(ldg_u16(at + cutlass.Int64(512 + g * 8 + t * 2)))
                continue
            vals += ldg_w_v4(w_ptr + r * w_rs + kb)
            if cutlass.const_expr(self.w_blocked):
                vals.append(ldg_u16(blocked_row(ws_ptr, r, ws_rs) + ks))
            else:
                vals.append(ldg_u16(ws_ptr + r * ws_rs + ks))
        kx = cutlass.Int64(chunk) * 64  # 32 values of 2 bytes
        for h in range(0 if self.x_smem else self.halves):
            tok = g + 8 * h
            p = cutlass.Int32(tok < NT) * live
            base = x_ptr + cutlass.Int64(cutlass.min(tok, NT - 1)) * x_rs + kx
            for j in range(4):
                vals += ldg_v4_if(base + 16 * j, p, volatile=not self.x_fixed)
        return vals

    @cute.jit
    def _bulk_stage(self, q, bidx, gdimx, n_tiles, lane, m, s_stage, s_full, s_empty, ptrs):
        """``bulk``, warp 0: stage ``q`` of this CTA (``span`` rounds: of its tiles the ``q // (rounds / span)``-th,
        there the ``q % (rounds / span)``-th stage) into slot ``q % bulk`` once the warps have used what it held
        (stage ``q - bulk``); nothing past the last tile. Lane 0 announces the bytes; lane ``i < rows`` copies
        row ``i``'s w and scales."""
        w_ptr, ws_ptr, x_ptr, w_rs, ws_rs, x_rs = ptrs
        B = self.bulk
        per_tile = self.rounds // self.span  # stages a tile
        tile = bidx + (q // per_tile) * gdimx
        if tile < n_tiles:
            rnd = q % per_tile
            slot = q % B
            if q >= B:
                mbar_wait(s_empty + 8 * slot, ((q - B) // B) & 1)
            full = s_full + 8 * slot
            dst = s_stage + slot * self.stage_bytes
            row0 = cutlass.min(tile * self.rows, m - self.rows)
            cute.arch.sync_warp()
            if lane == 0:
                mbar_arrive_expect_tx(full, self.rows * (self.row_w + self.row_s))
            cute.arch.sync_warp()
            if lane < self.rows:
                r = cutlass.Int64(row0 + lane)
                bulk_g2s(dst + lane * self.row_w_pad, w_ptr + r * w_rs + cutlass.Int64(rnd) * self.row_w,
                         self.row_w, full, True)
                bulk_g2s(dst + self.rows * self.row_w_pad + lane * self.row_s_pad,
                         ws_ptr + r * ws_rs + cutlass.Int64(rnd) * self.row_s, self.row_s, full, True)

    def _round_words(self, stage, u, wid, g, t):
        """``bulk``: a lane's slice of round ``u`` of ``stage``, in ``_load_slice``'s layout (per group the 16
        bytes of row ``g + 8 gr`` at the round's and warp's 64 and the lane's 16, then its 2 scale bytes)."""
        vals = []
        W = self.warps
        for gr in range(self.groups):
            row = g + 8 * gr
            vals += lds_stage_v4(stage + row * self.row_w_pad + (u * W + wid) * 64 + t * 16)
            vals.append(lds_stage_u16(stage + self.rows * self.row_w_pad + row * self.row_s_pad + (u * W + wid) * 8
                                      + t * 2))
        return vals

    def _x_words(self, s_x, sl, g, t):
        """A lane's 32 values of ``x`` for slice ``sl`` from shared memory (16 words a token half; zeros for
        tokens past N and for chunks past a ``K % 128 == 64`` row)."""
        chunk = sl * 4 + t
        live = cutlass.Int32(1) if cutlass.const_expr(self.k % 128 == 0) else cutlass.Int32(chunk < self.k // 32)
        words = []
        for h in range(self.halves):
            tok = g + 8 * h
            p = cutlass.Int32(tok < self.n_tok) * live
            base = s_x + cutlass.min(tok, self.n_tok - 1) * self.x_row_bytes + cutlass.min(chunk, self.k // 32 - 1) * 64
            for j in range(4):
                words += lds_v4_if(base + 16 * j, p)
        return words

    def _slice_products(self, acc, cur, zero, xw=None):
        """Adds one slice's products to the accumulators ``acc[u][a][c]`` (group, or with ``w_a`` group pair;
        A tile; chain); ``xw``: x's words
        where they come from shared memory, else they follow w's in ``cur``."""
        GR, H = self.groups, self.halves
        xo = 5 * GR
        if cutlass.const_expr(self.probe in (1, 3)):
            v = cur[0]
            for e in cur[1:xo]:
                v = v ^ e
            a0 = acc[0][0][0]
            return [[[[a0[0] + cutlass.Float32(v)] + list(a0[1:])] + list(acc[0][0][1:])] + list(acc[0][1:])] \
                + list(acc[1:])
        if xw is not None:
            cur = list(cur[:xo]) + list(xw)
        # x pairs: xa[h][blk][p], the A operand's order for block blk (its 16 values) of token half h
        xa = []
        for h in range(H):
            xs = cur[xo + 16 * h: xo + 16 * h + 16]
            per_blk = []
            for blk in range(2):
                r = xs[8 * blk: 8 * blk + 8]
                pairs = []
                for w in range(2):  # word w: values 8w .. 8w + 7 of the block, regs r[4w .. 4w + 3]
                    if cutlass.const_expr(self.xpair):
                        pairs += list(r[4 * w: 4 * w + 4])  # paired when copied
                        continue
                    p04, p15 = pair_halves(r[4 * w], r[4 * w + 2])
                    p26, p37 = pair_halves(r[4 * w + 1], r[4 * w + 3])
                    pairs += [p04, p15, p26, p37]
                per_blk.append(pairs)
            xa.append(per_blk)
        memo = {}  # dec: a chunk's decode, made at its first use in the slice
        if self.w_a:
            return self._slice_products_w_a(acc, cur, xa, memo)
        new_acc = []
        for gr in range(GR):
            acc_g = list(acc[gr])
            for blk in range(2):
                wb = self._decoded(cur, gr, blk, memo)
                for a in range(self.a_tiles):
                    h0, h1 = 2 * a, 2 * a + 1
                    cs = list(acc_g[a])
                    for s in range(4):
                        a0 = xa[h0][blk][2 * s]
                        a2 = xa[h0][blk][2 * s + 1]
                        a1 = xa[h1][blk][2 * s] if h1 < H else zero
                        a3 = xa[h1][blk][2 * s + 1] if h1 < H else zero
                        ch = s % self.chains
                        cs[ch] = mma_16816((a0, a1, a2, a3), (wb[2 * s], wb[2 * s + 1]), cs[ch], self.x_bf16)
                    acc_g[a] = cs
            new_acc.append(acc_g)
        return new_acc

    def _decoded(self, cur, gr, blk, memo):
        """Group ``gr``'s 16 values of block ``blk`` as eight scaled bf16x2 / f16x2 words (MMA-slot order);
        with ``dec`` both blocks decode together at the first call and ``memo`` keeps them for the second."""
        q = cur[5 * gr: 5 * gr + 4]
        sc = not self.late
        if cutlass.const_expr(self.dec):
            if gr not in memo:
                memo[gr] = scaled_bf16_chunk(*q, cur[5 * gr + 4], sc)
            return memo[gr][8 * blk: 8 * blk + 8]
        s8 = (cur[5 * gr + 4] >> (8 * blk)) & 0xFF
        if cutlass.const_expr(self.x_bf16):
            return scaled_bf16x8(q[2 * blk], q[2 * blk + 1], s8, sc)
        return scaled_f16x8(q[2 * blk], q[2 * blk + 1], s8, sc)

    def _slice_products_w_a(self, acc, cur, xa, memo):
        """``w_a``: groups ``2u`` and ``2u + 1`` are the A operand's rows ``g`` and ``g + 8``, token ``g``'s x
        pairs the B operand (the k-slots x's A registers take otherwise); the sums in ``acc[u][0]``."""
        new_acc = []
        if cutlass.const_expr(self.late):
            for u in range(self.units):
                a_g, z1, a_g8, z3 = acc[u][0][0]
                d = []
                for blk in range(2):
                    w0 = self._decoded(cur, 2 * u, blk, memo)
                    w1 = self._decoded(cur, 2 * u + 1, blk, memo)
                    c = [cutlass.Float32(0.0)] * 4
                    for s in range(4):
                        c = mma_16816((w0[2 * s], w1[2 * s], w0[2 * s + 1], w1[2 * s + 1]),
                                      (xa[0][blk][2 * s], xa[0][blk][2 * s + 1]), c, self.x_bf16)
                    d.append(c)
                # C: (row g, column 2t + blk) in c[0] / c[1], row g + 8 in c[2] / c[3]
                s0, s1 = e4m3x2_to_f32x2(cur[5 * (2 * u) + 4])
                s2, s3 = e4m3x2_to_f32x2(cur[5 * (2 * u + 1) + 4])
                a_g = fma_f32(d[1][1], s1, fma_f32(d[0][0], s0, a_g))
                a_g8 = fma_f32(d[1][3], s3, fma_f32(d[0][2], s2, a_g8))
                new_acc.append([[[a_g, z1, a_g8, z3]]])
            return new_acc
        for u in range(self.units):
            cs = list(acc[u][0])
            for blk in range(2):
                w0 = self._decoded(cur, 2 * u, blk, memo)
                w1 = self._decoded(cur, 2 * u + 1, blk, memo)
                for s in range(4):
                    ch = s % self.chains
                    cs[ch] = mma_16816((w0[2 * s], w1[2 * s], w0[2 * s + 1], w1[2 * s + 1]),
                                       (xa[0][blk][2 * s], xa[0][blk][2 * s + 1]), cs[ch], self.x_bf16)
            new_acc.append([cs])
        return new_acc

    @cute.jit
    def op_body(self, w_ptr, x_ptr, ws_ptr, xs_ptr, out_ptr, alpha_ptr, m, w_rs, ws_rs, x_rs, xs_rs, out_rs):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdimx, _, _ = cute.arch.grid_dim()
        NT = self.n_tok
        GR = self.groups
        AT = self.a_tiles
        W = self.warps
        D = self.depth

        smem = SmemAllocator()
        s_buf = smem.allocate_tensor(cutlass.Float32, cute.make_layout(self.smem_bytes // 4), byte_alignment=16)
        s_red = s_buf.iterator.toint()
        s_stages = s_red + self.red_bytes  # bulk's stages, then their barriers
        s_x = s_stages + self.bulk_bytes
        B = self.bulk
        s_full = s_stages + B * self.stage_bytes
        s_empty = s_full + 8 * B
        if cutlass.const_expr(B > 0):
            if tidx == 0:
                for bs in cutlass.range_constexpr(B):
                    mbar_init(s_full + 8 * bs, 1)
                    mbar_init(s_empty + 8 * bs, self.threads)
                mbar_init_fence()  # (the copy of x below ends with a CTA barrier)
        if cutlass.const_expr(self.x_smem):
            # x [N, K] into shared memory once, 16 bytes a copy (rows x_row_bytes apart), a thread's copies
            # xbatch at a time: the batch's loads all issue before its first store waits for one (a round trip
            # to L2, or to DRAM where x is not there yet, a batch instead of a copy)
            per_row = self.k // 8
            # late: the padded row (zeros past K) in one pass
            copies = self.x_row_bytes // 16 if self.late else NT * per_row
            iters = -(-copies // self.threads)
            # (names of their own, x...: the epilogue's dynamic loop assigns tok, e, ..., and a name bound here
            # too, outside a dynamic loop, would change type inside it)
            for xb0 in cutlass.range_constexpr(0, iters, self.xbatch):
                xgot = []
                for xit in cutlass.range_constexpr(xb0, min(xb0 + self.xbatch, iters)):
                    xc = tidx + xit * self.threads
                    if cutlass.const_expr((xit + 1) * self.threads > copies):
                        xc = cutlass.min(xc, copies - 1)  # a thread past the copies repeats the last one
                    xup = None
                    if cutlass.const_expr(self.late):
                        xtok, xj = 0, xc  # one padded row
                        xaddr = x_ptr + cutlass.Int64(cutlass.min(xc, per_row - 1)) * 16
                        xv = ldg_v4_if(xaddr, cutlass.Int32(xc < per_row))
                        if cutlass.const_expr(self.act is not None):  # (zeros past K: act(0) * 0 = 0)
                            xup = ldg_v4_if(xaddr + 2 * self.k, cutlass.Int32(xc < per_row))
                    else:
                        xtok, xj = xc // per_row, xc % per_row
                        xaddr = x_ptr + cutlass.Int64(xtok) * x_rs + cutlass.Int64(xj) * 16
                        xv = ldg_v4(xaddr)
                        if cutlass.const_expr(self.act is not None):
                            xup = ldg_v4(xaddr + 2 * self.k)
                    xgot.append((xtok, xj, xv, xup))
                for xtok, xj, xv, xup in xgot:
                    if cutlass.const_expr(self.act is not None):
                        xv = self.x_act(xv, xup)
                    if cutlass.const_expr(self.xpair):
                        xp04, xp15 = pair_halves(xv[0], xv[2])
                        xp26, xp37 = pair_halves(xv[1], xv[3])
                        xv = [xp04, xp15, xp26, xp37]
                    if cutlass.const_expr(self.late and self.x_bf16):
                        xv = [mul_bf16x2(xe, X_LATE_BF16X2) for xe in xv]
                    sts_v4(s_x + xtok * self.x_row_bytes + xj * 16, xv[0], xv[1], xv[2], xv[3])
            cute.arch.sync_threads()

        wid = tidx // 32
        lane = tidx % 32
        g = lane // 4
        t = lane % 4
        my_slices = (self.n_slices - wid + W - 1) // W
        n_tiles = (m // 8 + GR - 1) // GR
        zero = cutlass.Int32(0)
        if cutlass.const_expr(self.late):
            # lane (g, t) holds B's column g for lane t's k-slots: x's block g - 2t of lane t's chunk where
            # that is 0 or 1, else the zero bytes (step 0)
            s_zero = s_x + self.x_row_bytes - 32
            xb = s_x + (wid * 4 + t) * 64
            own0 = cutlass.Int32(g == 2 * t)
            own1 = cutlass.Int32(g == 2 * t + 1)
            x_lane = (s_zero + own0 * (xb - s_zero), s_zero + own1 * (xb + 32 - s_zero),
                      own0 * (W * 256), own1 * (W * 256))

        ptrs = (w_ptr, ws_ptr, x_ptr, w_rs, ws_rs, x_rs)
        if cutlass.const_expr(B > 0):
            # the first B - 1 stages; later ones come in as the warps use the rounds before them
            b_pos = cutlass.Int32(0)  # this CTA's rounds so far (all tiles)
            if wid == 0:
                for bq in cutlass.range_constexpr(B - 1):
                    self._bulk_stage(bq, bidx, gdimx, n_tiles, lane, m, s_stages, s_full, s_empty, ptrs)
        elif cutlass.const_expr(self.across):
            # the first tile's first slices; later tiles' come in with the previous tile's last slices
            pipe = []
            for d in cutlass.range_constexpr(D):
                pipe.append(self._load_slice(wid + d * W, g, t, cutlass.min(bidx * (GR * 8), m - GR * 8), *ptrs))
        else:
            # never read (each tile loads its own first slices): only so that the tile loop sees one type
            n_vals = 5 * GR + (0 if self.x_smem else 16 * self.halves)
            pipe = [[cutlass.Int32(0)] * n_vals for _ in range(D)]
        for tile in cutlass.range(bidx, n_tiles, gdimx, unroll=1):
            # a last tile that would pass M starts lower instead: its first rows are the previous tile's again
            # (the same sums, stored twice)
            row0 = cutlass.min(tile * (GR * 8), m - GR * 8)
            U = self.units
            acc = [[[[cutlass.Float32(0.0)] * 4 for _ in range(self.chains)] for _ in range(AT)] for _ in range(U)]
            if cutlass.const_expr(self.across):
                row_next = cutlass.min((tile + gdimx) * (GR * 8), m - GR * 8)  # past the last tile: read, unused
            elif cutlass.const_expr(B == 0):
                pipe = []
                for d in cutlass.range_constexpr(D):
                    pipe.append(self._load_slice(wid + d * W, g, t, row0, *ptrs))
            for i in cutlass.range(my_slices, unroll=1):
                if cutlass.const_expr(B > 0):
                    # at a stage's first round warp 0 refills the slot of the stage before it with the stage
                    # B - 1 on; every warp then waits for this round's stage
                    b_stage = b_pos // self.span
                    b_u = b_pos % self.span
                    if wid == 0 and b_u == 0:
                        self._bulk_stage(b_stage + B - 1, bidx, gdimx, n_tiles, lane, m, s_stages, s_full, s_empty,
                                         ptrs)
                    b_slot = b_stage % B
                    mbar_wait(s_full + 8 * b_slot, (b_stage // B) & 1)
                    cur = self._round_words(s_stages + b_slot * self.stage_bytes, b_u, wid, g, t)
                elif cutlass.const_expr(self.across):
                    cur = pipe[0]
                    pipe = pipe[1:]
                    # slice i + D of this tile, or past its end the next tile's first ones (my_slices >= D)
                    nx = cutlass.Int32(i + D >= my_slices)
                    pipe.append(self._load_slice(wid + (i + D - nx * my_slices) * W, g, t,
                                                 row0 + nx * (row_next - row0), *ptrs))
                else:
                    cur = pipe[0]
                    pipe = pipe[1:]
                    pipe.append(self._load_slice(wid + (i + D) * W, g, t, row0, *ptrs))
                if cutlass.const_expr(self.late):
                    a0 = x_lane[0] + i * x_lane[2]
                    a1 = x_lane[1] + i * x_lane[3]
                    xw = (lds_stage_v4(a0) + lds_stage_v4(a0 + 16) + lds_stage_v4(a1) + lds_stage_v4(a1 + 16))
                    acc = self._slice_products(acc, cur, zero, xw)
                elif cutlass.const_expr(self.x_smem):
                    xw = self._x_words(s_x, cutlass.min(wid + i * W, self.n_slices - 1), g, t)
                    acc = self._slice_products(acc, cur, zero, xw)
                else:
                    acc = self._slice_products(acc, cur, zero)
                if cutlass.const_expr(B > 0):
                    # every thread arrives once it has used the stage's last round (its words consumed)
                    if b_u == self.span - 1:
                        mbar_arrive(s_empty + 8 * b_slot)
                    b_pos = b_pos + 1

            for u in cutlass.range_constexpr(U):
                for a in cutlass.range_constexpr(AT):
                    part = acc[u][a][0]
                    if cutlass.const_expr(self.chains == 2):
                        part = [part[j] + acc[u][a][1][j] for j in range(4)]
                    if cutlass.const_expr(self.late):
                        # the four lanes of a row hold its chunks' sums: lane t = 0 gets the total (token 0's
                        # place in the C layout; the other places are never stored)
                        for j in (0, 2):
                            for off in (1, 2):
                                part[j] = part[j] + cute.arch.shuffle_sync_bfly(part[j], offset=off)
                    sts_f32x4(s_red + (((wid * U + u) * AT + a) * 32 + lane) * 16, part)
            cute.arch.sync_threads()
            # read here, not before the main loop: one value fewer live across it (the two-CTA one-token build
            # without dec/xpair, at 128 registers, spilled more before; tests/leaderboard/test_compile.py)
            scale = cutlass.Float32(self.sum_scale)
            if cutlass.const_expr(self.has_alpha):
                scale = scale * ldg_f32(alpha_ptr)
            per_warp = U * AT * 128
            for e in cutlass.range(tidx, per_warp, self.threads, unroll=1):
                total = lds_stage_f32(s_red + e * 4)
                for w in cutlass.range_constexpr(1, W):
                    total = total + lds_stage_f32(s_red + (w * per_warp + e) * 4)
                u = e // (AT * 128)
                a = (e // 128) % AT
                ln = (e // 4) % 32
                r = e % 4
                # C of an MMA: rows g, g + 8 (ln // 4) by columns 2t, 2t + 1 (ln % 4): tokens by w's rows, or
                # with w_a w's rows (groups 2u, 2u + 1) by tokens
                if cutlass.const_expr(self.w_a):
                    tok = 2 * (ln % 4) + r % 2
                    row = row0 + (2 * u + r // 2) * 8 + ln // 4
                else:
                    tok = a * 16 + ln // 4 + 8 * (r // 2)
                    row = row0 + u * 8 + 2 * (ln % 4) + r % 2
                if tok < NT:
                    stg_as(out_ptr + cutlass.Int64(tok) * out_rs + cutlass.Int64(row) * 2, total * scale,
                           self.out_bf16)
            cute.arch.sync_threads()


def compile_w4a16(k, n_tok, groups, x_bf16, w_blocked, has_alpha, out_bf16, options=None, tvm_ffi=None, **tuning):
    """Compiles the kernel (no GPU needed when ``options`` names ``--gpu-arch``)."""
    return compile_op(Nvfp4GemvW4A16(k, n_tok, groups, x_bf16, w_blocked, has_alpha, out_bf16, **tuning),
                      options, tvm_ffi)

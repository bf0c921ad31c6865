"""``Nvfp4Gemv``: the register-streaming kernel, ``custom_kernel``'s default, and what its kernels share.

One CTA works on one batch index ``l``. It first decodes ``b[:, l]`` to int8 and ``sfb[:, l]`` to fp32 in shared
memory. Then groups of ``G`` lanes each own one row of ``a`` at a time (grid-stride over the rows): lane ``j``
streams the 16-byte chunks ``j, j + G, ...`` of the row with non-caching 16-byte loads plus the chunk's two
scale bytes, so each load instruction of a group is contiguous. The loads of the next work unit (``batch``
chunks of a lane) are in flight while the current one is computed. A butterfly shuffle (fp64) combines the
group's partials and one lane writes ``c``.

``sf_wide``: where the rows of ``sfa`` are 16-byte aligned (plain scales), a unit's scales come in 16-byte loads
by the group's first lanes and reach the others through shared memory: two-byte loads cost more than their
bytes. ``tuning.py`` says where (``wide_tuning``), and where a problem small enough for one wave of CTAs takes
a lane's whole share of a row in one unit instead (``latency_tuning``).

``K`` and the configuration are compile-time constants; ``M``, ``L`` and all strides are run-time values.
Scales are read from the plain ``[M, K/16, L]`` tensors, or from the permuted cuBLAS-blocked ones
(``blocked_scales``).
"""

import cutlass
import cutlass.cute as cute

from .decode import (
    E2M1_TIMES2_LO,
    blocked_row,
    e4m3x2_to_f32x2,
    fp4x8_to_i8,
    group_sum,
    probe_sum,
    scale_offset,
    scaled_chunk_dot,
)
from .ptx import (
    SMEM_A_SM,
    SmemAllocator,
    ldg_stream_v4_if,
    ldg_u16,
    ldg_u16_if,
    ldg_v4,
    lds_f32x2,
    lds_stage_u16,
    lds_u32,
    lds_v4,
    stg_f16,
    sts_f32x2,
    sts_u32,
    sts_v4,
)


class GemvLaunch:
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


class Nvfp4Gemv(GemvLaunch):
    """Batched NVFP4 GEMV; one instance per (K, scale layout, configuration): see the module docstring."""

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
        # Chunks a lane loads per work unit: a whole short row at once, else 2, or 3 where the row splits in
        # threes (each measured fastest for its K on H200; docs/results.md).
        self.batch = batch or (4 if self.per_lane == 4 else 2 if self.per_lane % 2 == 0
                               else 3 if self.per_lane % 3 == 0 else 1)
        if self.chunks % self.group or self.per_lane % self.batch or 32 % self.group or self.group < 2:
            raise ValueError(f"nvfp4_gemv: K={k}: group {self.group} and batch {self.batch} must divide "
                             f"the {self.chunks} chunks of a row")
        self.rows_per_cta = self.threads // self.group
        self.shuffle_offsets = [self.group >> (i + 1) for i in range(self.group.bit_length() - 1)]
        # A lane's whole share of the row in one unit of 4 chunks (K = 256..2048) leaves b's share
        # loop-invariant: DSL 4.8 keeps it in registers and spills under 3 CTAs' register cap, so 2 CTAs (as
        # fast as 3 on DSL 4.3; docs/results.md)
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
        # that each lane keeps >= 4 chunks when the row allows. 16 beat 32 on H200 (docs/results.md): two rows
        # a warp, half the shuffles per byte.
        g = 2  # chunks is even (K % 64 == 0), and 256 // g rows a CTA then divides M
        while g < 16 and chunks % (2 * g) == 0 and chunks // (2 * g) >= 4:
            g *= 2
        return g

    def grid_x(self, m, l, sms):
        # one wave of CTAs spread over the batch, each with at least one warp of rows; rounded down, so that
        # no CTA waits for a second wave (CTAs past the slots measured slower on H200; docs/results.md)
        return max(1, min(-(-m // self.rows_per_cta), sms * self.ctas_per_sm() // l))

    def ctas_per_sm(self):
        return max(1, min(self.min_blocks, SMEM_A_SM // (self.smem_bytes + 1024)))

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

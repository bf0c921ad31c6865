"""``Nvfp4GemvSplit``: the split-row kernel, for problems that fit in one wave of CTAs.

Problems that fit in one wave (small ``M * L``) are latency-bound: what counts is the time after the last byte
lands. Where a row has more than 1024 values, this kernel splits it over whole warps (one 16-byte chunk a lane
where the wave fits, else up to four; where the split does not divide the row, the last chunk of some lanes lies
past it and loads nothing), with ``b`` in registers and no loop; the warps' sums meet in shared memory.
``tuning.split_tuning`` picks the split.
"""

import cutlass
import cutlass.cute as cute

from .decode import E2M1_TIMES2_LO, b_in_registers, group_sum, probe_sum, scaled_chunk_dot
from .ptx import SmemAllocator, lds_stage_f64, stg_f16, sts_f64
from .streaming import Nvfp4Gemv


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

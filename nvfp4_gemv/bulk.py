"""``Nvfp4GemvBulk``: the bulk-copy streaming kernel for long rows, and the stage pipeline it shares with the op.

Long rows (``K >= 7168``) that the split-row kernel does not take go to this kernel: a producer warp fetches
whole rows of ``a`` and ``sfa`` into shared memory with bulk copies (``cp.async.bulk``, the TMA engine without a
tensor map), three stages deep on mbarriers, with an L2 evict-first hint; consumer warps keep their share of
``b`` in registers. On H200 under the leaderboard's timing it streams the benchmark shapes about as fast as the
same copies with no arithmetic at all (docs/results.md). Where a tile holds several rows, a CTA's tiles after its
first three are claimed at run time from a counter a batch index (SMs are served unequally); the counters live
in a small buffer a stream (``launch.tile_counters``), zeroed again by each launch's last claim, and a launch
inside a CUDA graph capture keeps the static schedule.

Needs ``K % 256 == 0`` and 16-byte aligned rows of ``sfa`` (plain scales); where they are missing
``tuning.pick_tuning`` chooses among the other kernels. ``stage_buffers`` and ``copy_tile`` are the pipeline's
shared memory and producer copies, which the op's bulk-copy kernel (``tokens_bulk``) uses too.
"""

import cutlass
import cutlass.cute as cute

from .decode import E2M1_TIMES2_LO, b_in_registers, group_sum, probe_sum, scaled_chunk_dot
from .ptx import (
    SMEM_A_SM,
    SmemAllocator,
    atom_add_one,
    bulk_g2s,
    lds_stage_f64,
    lds_stage_u16,
    lds_stage_u32,
    lds_stage_v4,
    mbar_arrive,
    mbar_arrive_expect_tx,
    mbar_init,
    mbar_init_fence,
    mbar_wait,
    st_relaxed_u32,
    stg_f16,
    sts_f64,
    sts_u32,
    trap,
)
from .streaming import GemvLaunch

STAGE_EXTRA_BYTES = 128  # a bulk pipeline's shared memory after its stages: the decode table, a copy a lane


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


class Nvfp4GemvBulk(GemvLaunch):
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
        if self.smem_bytes + 1024 > SMEM_A_SM // ctas:
            raise ValueError(f"nvfp4_gemv: K={k}: {stages} stages of {self.stage_bytes} bytes exceed the "
                             f"shared memory of {ctas} CTAs a SM")
        self.threads = nc + 32
        self.min_blocks = ctas

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
        ``ctr_l``, issued a step before its use; SMs are served unequally (docs/results.md), so a fixed split
        ends on its slowest SM. The first claim past the last
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
        # every consumer thread releases its own reads of the stage (one arrive a warp after a warp barrier
        # measured faster, but compute-sanitizer's racecheck cannot see it; docs/results.md)
        mbar_arrive(s_empty + 8 * s)

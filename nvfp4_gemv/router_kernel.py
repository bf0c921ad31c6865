"""The GPU kernel of ``router_op.topk_route``: a mixture-of-experts router in one kernel, transformers'
``Qwen3MoeTopKRouter`` (softmax top-k) for a few tokens: ``logits = x @ W.T`` rounded to x's dtype, the
softmax of the logits in fp32, the top k of it, renormalised to sum 1 where asked, cast to x's dtype.

Algorithm. One row of W a warp: each lane loads 16-byte chunks of the row and of the token's x (all ``H / 256``
of them in flight), multiplies them in fp32 (exact widening, one ``fma.rn`` a product), the warp adds the
lanes' sums by a butterfly, and lane 0 rounds the sum to x's dtype (the logit, written out) and makes a
32-bit key ``ord16(logit) << 16 | (0xFFFF - e)``: the order of the keys is the logits' order, ties broken
to the lower expert, and the logit's 16 bits come back from the key (-0 is keyed as +0). The keys of a
token then meet in one warp, two ways:

* the cluster build (E <= 256): grid ``(8, T)`` in clusters of 8 CTAs (a token's), ``E / 8`` warps a CTA;
  every thread arrives at the cluster barrier (relaxed) on entry and waits before any store into another
  CTA's shared memory (all of the cluster's CTAs then run); lane 0 stores its key into the shared memory of
  the cluster's CTA 0 (``mapa``, ``st.shared::cluster``), every thread arrives at the cluster barrier
  again and waits (release and acquire: a ``MEMBAR.ALL.GPU`` before the arrive in the SASS), and warp 0 of
  CTA 0 reads the ``E`` keys from its shared memory. No scratch, no counter, no fill, no atomics.
* the counter build (E > 256): grid ``(E / 8, T)``, 8 warps a CTA; lane 0 stores its key to the token's
  scratch row and fences (``fence.acq_rel.gpu``), the CTA meets at a barrier, and thread 0 fences and counts
  the CTA done on its token's counter (``atom.add``). In the CTA that counts last (the counter reaches
  ``E / 8 - 1``) thread 0 fences again and warp 0 meets at a warp barrier, then reads the token's ``E`` keys
  with strong loads.

Then ``max`` = the largest logit, ``S = sum(exp(l - max))`` over all ``E``, then ``k`` rounds of a warp's
``max.u32`` over the keys not yet taken give the top k in order (value descending, lower expert first
among equals: ``torch.sort(stable=True)``'s order), ``p = exp(l - max) / S``, with ``norm``
``p / sum(p over the k)``, each rounded once to x's dtype. Lane ``i < k`` writes the i-th index (int64) and
weight. ``exp`` is the DSL's accurate ``exp`` (not ``fastmath``).

Differences from the torch ops, by design or by necessity: the logits' fp32 sums are added in another
order than cuBLAS's (a logit can differ by one ulp of x's dtype where the exact sum lies within fp32
rounding of a midpoint); ``S`` and the renormalising sum are added in another order than torch's
reductions (a weight can differ in its last bit). Ties among logits are broken to the lower expert (torch's
CUDA ``topk`` does not document its order). NaN logits are not handled (transformers' router would rank
them first).

Layouts: x [T, H] bf16 or fp16, rows ``x_rs`` bytes apart (16-byte aligned); W [E, H] the same dtype,
contiguous, 16-byte aligned; the counter build's ``keys`` int32 [T, E] scratch and ``counters`` int32 [T],
zero before the launch (the op allocates them zeroed each call, one buffer: the counters, then the keys 4T
bytes on; so launches on several streams or graph replays never share a counter; the cluster build takes
neither); ``logits`` [T, E], ``weights`` [T, k]
in x's dtype, ``indices`` int64 [T, k], dense.
Constraints (``can_implement``): ``E % 32 == 0``, ``E <= 1024``, ``H % 256 == 0``, ``H <= 8192``, ``1 <= k <= 32``
and ``k <= E``.
"""

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cutlass_dsl import T, dsl_user_op

from .launch import KernelCache, current_device, current_stream, dsl_compile
from .ptx import asm as _asm
from .ptx import SmemAllocator, asm_store, atom_add_one, div_rn, fma_f32, ldg_v4, lds_stage_u32, st_relaxed_u32, stg_u32x2
from .quant_kernel import widen8

WARPS = 8  # rows of W a CTA (one a warp), the counter build's
CLUSTER = 8  # CTAs a token in the cluster build (the portable cluster size), E / 8 rows (warps) each
CLUSTER_MAX_E = CLUSTER * 32  # the cluster build's most experts (32 warps a CTA); past it the counter build


def uses_cluster(e):
    """Whether the kernel for E experts is the cluster build (E <= 256) rather than the counter build."""
    return e <= CLUSTER_MAX_E


def can_implement(e, h, k):
    """``(ok, why not)`` for E experts, hidden size H and top k."""
    if e <= 0 or e % 32 or e > 1024:
        return False, f"E={e} experts: the kernel takes a multiple of 32 up to 1024"
    if h <= 0 or h % 256 or h > 8192:
        return False, f"hidden size {h}: the kernel takes a multiple of 256 up to 8192"
    if not 1 <= k <= min(32, e):
        return False, f"top_k={k}: the kernel takes 1..min(32, E)"
    return True, ""


@dsl_user_op
def fence_gpu(*, loc=None, ip=None):
    """``fence.acq_rel.gpu``: orders this thread's earlier stores before its later ones (and loads after)."""
    asm_store([], "fence.acq_rel.gpu;", "", loc, ip)


@dsl_user_op
def st_cluster_u32(addr, rank, v, *, loc=None, ip=None):
    """``st.shared::cluster.u32`` into CTA ``rank``'s shared memory at the offset of this CTA's 32-bit shared
    address ``addr`` (``mapa``)."""
    asm_store([cutlass.Int32(addr), cutlass.Int32(rank), cutlass.Int32(v)],
              "{\n.reg .b32 r;\nmapa.shared::cluster.u32 r, $0, $1;\nst.shared::cluster.u32 [r], $2;\n}", "r,r,r",
              loc, ip)


@dsl_user_op
def ld_relaxed_u32(addr, *, loc=None, ip=None):
    """``ld.relaxed.gpu.global.u32``: a strong load (what another SM stored, not a stale L1 line)."""
    r = _asm([T.i32()], [cutlass.Int64(addr)], "ld.relaxed.gpu.global.u32 $0, [$1];", "=r,l", loc, ip,
             volatile=True)
    return cutlass.Int32(r[0])


@dsl_user_op
def logit_key(v, e, bf16, *, loc=None, ip=None):
    """``(key, 16 bits of v rounded to x's dtype)``: key = ``ord16(bits) << 16 | (0xFFFF - e)``, where
    ``ord16`` maps the sign-magnitude 16 bits to an unsigned order (negatives: all bits flipped; others: the
    sign bit set), -0 taken as +0."""
    cvt = "cvt.rn.bf16.f32" if bf16 else "cvt.rn.f16.f32"
    # -0 keyed as +0 (equal values: the tie goes to the lower expert, as for any other pair of equal logits)
    body = ["{", ".reg .b16 h;", ".reg .b32 b, c, n, p;", ".reg .pred neg, mz;", f"{cvt} h, $2;", "cvt.u32.u16 b, h;",
            "setp.eq.u32 mz, b, 0x8000;", "selp.b32 c, 0, b, mz;",
            "setp.ge.u32 neg, c, 0x8000;", "xor.b32 n, c, 0xFFFF;", "or.b32 p, c, 0x8000;", "selp.b32 n, n, p, neg;",
            "shl.b32 n, n, 16;", "sub.u32 p, 0xFFFF, $3;", "or.b32 $0, n, p;", "mov.b32 $1, b;", "}"]
    r = _asm([T.i32(), T.i32()], [cutlass.Float32(v), cutlass.Int32(e)], "\n".join(body), "=r,=r,f,r", loc, ip)
    return cutlass.Int32(r[0]), cutlass.Int32(r[1])


@dsl_user_op
def key_value(key, bf16, *, loc=None, ip=None):
    """The logit a key stands for, in fp32 (exact)."""
    body = ["{", ".reg .b32 o, n, p;", ".reg .b16 h;", ".reg .pred pos;", "shr.u32 o, $1, 16;",
            "setp.ge.u32 pos, o, 0x8000;", "xor.b32 n, o, 0xFFFF;", "and.b32 p, o, 0x7FFF;", "selp.b32 o, p, n, pos;"]
    body += ["shl.b32 $0, o, 16;"] if bf16 else ["cvt.u16.u32 h, o;", "cvt.f32.f16 $0, h;"]
    body.append("}")
    r = _asm([T.f32()], [cutlass.Int32(key)], "\n".join(body), "=f,r", loc, ip)
    return cutlass.Float32(r[0])


@dsl_user_op
def max_u32(a, b, *, loc=None, ip=None):
    r = _asm([T.i32()], [cutlass.Int32(a), cutlass.Int32(b)], "max.u32 $0, $1, $2;", "=r,r,r", loc, ip)
    return cutlass.Int32(r[0])


@dsl_user_op
def taken_if(key, best, *, loc=None, ip=None):
    """``0`` where ``key == best`` (the key just taken), else ``key`` (0 is below every key)."""
    r = _asm([T.i32()], [cutlass.Int32(key), cutlass.Int32(best)],
             "{\n.reg .pred p;\nsetp.eq.u32 p, $1, $2;\nselp.b32 $0, 0, $1, p;\n}", "=r,r,r", loc, ip)
    return cutlass.Int32(r[0])


@dsl_user_op
def stg_b16(addr, v, *, loc=None, ip=None):
    """``st.global.b16`` of a register's low 16 bits."""
    asm_store([cutlass.Int64(addr), cutlass.Int32(v)], "{\n.reg .b16 h;\ncvt.u16.u32 h, $1;\nst.global.b16 [$0], h;\n}",
              "l,r", loc, ip)


@dsl_user_op
def cvt_bits(v, bf16, *, loc=None, ip=None):
    """The 16 bits of ``v`` rounded to bf16 or fp16 (round to nearest even), in a 32-bit register."""
    cvt = "cvt.rn.bf16.f32" if bf16 else "cvt.rn.f16.f32"
    r = _asm([T.i32()], [cutlass.Float32(v)], "{\n.reg .b16 h;\n" + cvt + " h, $1;\ncvt.u32.u16 $0, h;\n}",
             "=r,f", loc, ip)
    return cutlass.Int32(r[0])


class TopKRouter:
    """One instance per (E, H, k, x dtype, norm)."""

    def __init__(self, e: int, h: int, k: int, bf16: bool, norm: bool):
        ok, why = can_implement(e, h, k)
        if not ok:
            raise ValueError(f"nvfp4_gemv.topk_route: {why}")
        self.e, self.h, self.k = e, h, k
        self.bf16 = bool(bf16)
        self.norm = bool(norm)
        self.cluster = uses_cluster(e)
        self.warps = e // CLUSTER if self.cluster else WARPS  # rows of W a CTA

    @cute.jit
    def __call__(self, x_ptr: cutlass.Int64, w_ptr: cutlass.Int64, keys_ptr: cutlass.Int64, cnt_ptr: cutlass.Int64,
                 logits_ptr: cutlass.Int64, idx_ptr: cutlass.Int64, wt_ptr: cutlass.Int64, x_rs: cutlass.Int64,
                 tokens: cutlass.Int32, stream):
        if cutlass.const_expr(self.cluster):
            self.kernel(x_ptr, w_ptr, keys_ptr, cnt_ptr, logits_ptr, idx_ptr, wt_ptr, x_rs).launch(
                grid=[CLUSTER, tokens, 1], block=[32 * self.warps, 1, 1], cluster=[CLUSTER, 1, 1],
                smem=4 * self.e, stream=stream)
        else:
            self.kernel(x_ptr, w_ptr, keys_ptr, cnt_ptr, logits_ptr, idx_ptr, wt_ptr, x_rs).launch(
                grid=[self.e // WARPS, tokens, 1], block=[32 * WARPS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, x_ptr: cutlass.Int64, w_ptr: cutlass.Int64, keys_ptr: cutlass.Int64, cnt_ptr: cutlass.Int64,
               logits_ptr: cutlass.Int64, idx_ptr: cutlass.Int64, wt_ptr: cutlass.Int64, x_rs: cutlass.Int64):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, t, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        e = bidx * self.warps + warp
        t64 = cutlass.Int64(t)
        s_keys = cutlass.Int32(0)
        if cutlass.const_expr(self.cluster):
            smem = SmemAllocator()
            s_keys = smem.allocate_tensor(cutlass.Int32, cute.make_layout(self.e), byte_alignment=16).iterator.toint()
            # a CTA's shared memory may be written by another only once it runs: every thread arrives now and
            # waits before its store into CTA 0's (the loads of x and W below hide the round)
            cute.arch.cluster_arrive_relaxed()
        # -- the logit of row e: 16-byte chunks lane + 32 j of the row and of x, all in flight
        xrow = x_ptr + t64 * x_rs
        wrow = w_ptr + cutlass.Int64(e) * (self.h * 2)
        chunks = self.h // 256
        xs = [ldg_v4(xrow + (j * 32 + lane) * 16) for j in range(chunks)]
        ws = [ldg_v4(wrow + (j * 32 + lane) * 16) for j in range(chunks)]
        acc = cutlass.Float32(0.0)
        for j in cutlass.range_constexpr(chunks):
            xf = widen8(*xs[j], self.bf16)
            wf = widen8(*ws[j], self.bf16)
            for i in cutlass.range_constexpr(8):
                acc = fma_f32(xf[i], wf[i], acc)
        for off in (16, 8, 4, 2, 1):
            acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=off)
        if cutlass.const_expr(self.cluster):
            # -- the cluster build: each key into the leader CTA's (rank 0) shared memory; the cluster barrier
            # (arrive has release, wait acquire semantics) orders those stores before the leader's loads
            cute.arch.cluster_wait()
            if lane == 0:
                key, bits = logit_key(acc, e, self.bf16)
                stg_b16(logits_ptr + (t64 * self.e + cutlass.Int64(e)) * 2, bits)
                st_cluster_u32(s_keys + 4 * e, 0, key)
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            if bidx == 0:
                if warp == 0:
                    keys = [lds_stage_u32(s_keys + 4 * (lane + 32 * j)) for j in range(self.e // 32)]
                    self._top_k(keys, lane, t64, idx_ptr, wt_ptr)
        else:
            self._count_and_top_k(acc, e, lane, warp, t64, keys_ptr, cnt_ptr, logits_ptr, idx_ptr, wt_ptr)

    @cute.jit
    def _count_and_top_k(self, acc, e, lane, warp, t64, keys_ptr, cnt_ptr, logits_ptr, idx_ptr, wt_ptr):
        """The counter build: each key to the token's scratch row, and the CTA that counts last takes the top k."""
        if lane == 0:
            key, bits = logit_key(acc, e, self.bf16)
            stg_b16(logits_ptr + (t64 * self.e + cutlass.Int64(e)) * 2, bits)
            st_relaxed_u32(keys_ptr + (t64 * self.e + cutlass.Int64(e)) * 4, key)
            fence_gpu()
        cute.arch.sync_threads()
        # -- the CTA that finishes its token last takes the top k (warp 0). Thread 0 counts the CTA done after
        # a fence (the writers' fences and the barrier before it); in the last CTA it fences again after the
        # count (acquire), and the warp's barrier orders the other lanes' key loads after that fence
        if warp == 0:
            done = cutlass.Int32(0)
            if lane == 0:
                fence_gpu()
                done = atom_add_one(cnt_ptr + t64 * 4)
                fence_gpu()
            cute.arch.sync_warp()
            done = cute.arch.shuffle_sync(done, 0)
            if done == self.e // WARPS - 1:
                per = self.e // 32
                keys = [ld_relaxed_u32(keys_ptr + (t64 * self.e + cutlass.Int64(lane + 32 * j)) * 4) for j in range(per)]
                self._top_k(keys, lane, t64, idx_ptr, wt_ptr)

    @cute.jit
    def _top_k(self, keys, lane, t64, idx_ptr, wt_ptr):
        """Warp 0 of the CTA that has the token's keys (lane i holds keys i, i + 32, ...): the softmax's max and
        sum, the top k, their weights; lane i < k writes the i-th index and weight."""
        per = self.e // 32
        best = keys[0]
        for j in cutlass.range_constexpr(1, per):
            best = max_u32(best, keys[j])
        for off in (16, 8, 4, 2, 1):
            best = max_u32(best, cute.arch.shuffle_sync_bfly(best, offset=off))
        top = key_value(best, self.bf16)
        s = cutlass.Float32(0.0)
        for j in cutlass.range_constexpr(per):
            s = s + cute.math.exp(key_value(keys[j], self.bf16) - top)
        for off in (16, 8, 4, 2, 1):
            s = s + cute.arch.shuffle_sync_bfly(s, offset=off)
        mine = cutlass.Int32(0)
        for r in cutlass.range_constexpr(self.k):
            if cutlass.const_expr(r > 0):
                best = keys[0]
                for j in cutlass.range_constexpr(1, per):
                    best = max_u32(best, keys[j])
                for off in (16, 8, 4, 2, 1):
                    best = max_u32(best, cute.arch.shuffle_sync_bfly(best, offset=off))
            keys = [taken_if(kj, best) for kj in keys]
            if lane == r:
                mine = best
        p = cutlass.Float32(0.0)
        if lane < self.k:
            p = div_rn(cute.math.exp(key_value(mine, self.bf16) - top), s)
        if cutlass.const_expr(self.norm):
            tot = p
            for off in (16, 8, 4, 2, 1):
                tot = tot + cute.arch.shuffle_sync_bfly(tot, offset=off)
            p = div_rn(p, tot)
        if lane < self.k:
            slot = t64 * self.k + cutlass.Int64(lane)
            stg_u32x2(idx_ptr + slot * 8, 0xFFFF - (mine & 0xFFFF), 0)
            stg_b16(wt_ptr + slot * 2, cvt_bits(p, self.bf16))


def compile_router(e, h, k, bf16, norm, options=None, tvm_ffi=None):
    """``(op, compiled)`` (no GPU needed when ``options`` names ``--gpu-arch``)."""
    from cuda.bindings.driver import CUstream

    op = TopKRouter(e, h, k, bf16, norm)
    i64, i32 = cutlass.Int64(0), cutlass.Int32(1)
    return op, dsl_compile(op, (i64, i64, i64, i64, i64, i64, i64, i64, i32, CUstream(0)), options, tvm_ffi)


_kernels = KernelCache(lambda key: compile_router(*key[1:]))


def route_cuda(x, w, k, norm):
    """``(logits [T, E], weights [T, k], indices int64 [T, k])`` on torch's current stream (the op has checked
    the arguments)."""
    t, h = x.shape
    e = w.shape[0]
    dev = x.device
    logits = torch.empty((t, e), dtype=x.dtype, device=dev)
    weights = torch.empty((t, k), dtype=x.dtype, device=dev)
    indices = torch.empty((t, k), dtype=torch.int64, device=dev)
    if t == 0:
        return logits, weights, indices
    if uses_cluster(e):  # the keys meet in the leader CTA's shared memory: no scratch
        cnt = keys = 0
    else:
        # the counters [T] then the keys [T, E] (every key written before it is read), this call's own, in one
        # allocation and one fill (a memset node in a graph): two allocations cost the host a few us more a call
        scratch = torch.zeros(t * (e + 1), dtype=torch.int32, device=dev)
        cnt = scratch.data_ptr()
        keys = cnt + 4 * t
    kern = _kernels.get(dev.index, (dev.index, e, h, k, x.dtype == torch.bfloat16, bool(norm)))
    args = (x.data_ptr(), w.data_ptr(), keys, cnt, logits.data_ptr(),
            indices.data_ptr(), weights.data_ptr(), x.stride(0) * 2, t)
    stream = current_stream(dev.index)
    if kern.ffi is not None and current_device() == dev.index:
        kern.ffi(*args, stream)
    else:
        with torch.cuda.device(dev.index):
            kern.launch_dsl(args, stream)
    return logits, weights, indices

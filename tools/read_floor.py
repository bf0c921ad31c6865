"""The plain streaming read: the floor a GEMV of the same bytes is measured against (bench.py).

A CuTe DSL kernel that reads ``nbytes`` of one buffer and nothing else: each thread loads ``width``-byte
vectors (8 or 16) grid-strided, ``unroll`` of them in flight in every round (the last round's loads past
the end predicated off, so no round runs with fewer in flight), with an L1 eviction hint, XORs them into
one word and stores it only if it equals a value no buffer here holds (so the loads stay live).
``floor_us`` times every configuration of grid (CTAs a SM), block, load width and unroll the way the
leaderboard times (``bench.time_leaderboard``: L2 flushed before each run, CUDA events, median) and keeps
the fastest.

    python tools/read_floor.py 7168x16384x1 4096x7168x8    # prints each configuration's time
"""

import itertools
import os
import sys

import cutlass
import cutlass.cute as cute
import torch
from cuda.bindings.driver import CUstream
from cutlass.cutlass_dsl import T, dsl_user_op

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from nvfp4_gemv.launch import Kernel, current_stream, dsl_compile  # noqa: E402
from nvfp4_gemv.ptx import asm, asm_store  # noqa: E402

NEVER = 0x7E57ED01  # stored only if the XOR of the buffer equals it: the buffers here are zeros

GRIDS = (4, 8, 16)  # CTAs a SM
BLOCKS = (128, 256, 512)
WIDTHS = (8, 16)
UNROLLS = (2, 4, 8)


@dsl_user_op
def ldg_first(addr, width, pred, *, loc=None, ip=None):
    """One ``width``-byte load with the L1 evict-first hint, XOR-folded to one word; 0 and no access where
    ``pred`` is zero."""
    if width == 16:
        r = asm([T.i32()], [cutlass.Int64(addr), cutlass.Int32(pred)],
                "{\n.reg .b32 a, b, c, d;\n.reg .pred p;\nsetp.ne.s32 p, $2, 0;\nmov.b32 a, 0;\nmov.b32 b, 0;\n"
                "mov.b32 c, 0;\nmov.b32 d, 0;\n@p ld.global.nc.L1::evict_first.v4.u32 {a, b, c, d}, [$1];\n"
                "xor.b32 a, a, b;\nxor.b32 c, c, d;\nxor.b32 $0, a, c;\n}", "=r,l,r", loc, ip)
    else:
        r = asm([T.i32()], [cutlass.Int64(addr), cutlass.Int32(pred)],
                "{\n.reg .b32 a, b;\n.reg .pred p;\nsetp.ne.s32 p, $2, 0;\nmov.b32 a, 0;\nmov.b32 b, 0;\n"
                "@p ld.global.nc.L1::evict_first.v2.u32 {a, b}, [$1];\nxor.b32 $0, a, b;\n}", "=r,l,r", loc, ip)
    return cutlass.Int32(r[0])


@dsl_user_op
def stg_u32(addr, v, *, loc=None, ip=None):
    asm_store([cutlass.Int64(addr), cutlass.Int32(v)], "st.global.u32 [$0], $1;", "l,r", loc, ip)


@dsl_user_op
def red_xor(addr, v, *, loc=None, ip=None):
    asm_store([cutlass.Int64(addr), cutlass.Int32(v)], "red.global.xor.b32 [$0], $1;", "l,r", loc, ip)


class StreamRead:
    """``check``: every thread XORs its word into ``out`` (for tests: the XOR of the whole buffer comes out
    only if each vector was read exactly once); the timed kernel stores only the impossible value."""

    def __init__(self, threads, width, unroll=4, check=False):
        self.threads, self.width, self.unroll, self.check = threads, width, unroll, check

    @cute.jit
    def __call__(self, ptr: cutlass.Int64, n_vec: cutlass.Int32, out_ptr: cutlass.Int64, grid_x: cutlass.Int32,
                 stream):
        self.kernel(ptr, n_vec, out_ptr).launch(grid=[grid_x, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, ptr: cutlass.Int64, n_vec: cutlass.Int32, out_ptr: cutlass.Int64):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdimx, _, _ = cute.arch.grid_dim()
        step = gdimx * self.threads
        U = self.unroll
        acc = cutlass.Int32(0)
        for i in cutlass.range(bidx * self.threads + tidx, n_vec, step * U, unroll=1):
            for j in cutlass.range_constexpr(U):
                v = i + j * step
                acc = acc ^ ldg_first(ptr + cutlass.Int64(v) * self.width, self.width, cutlass.Int32(v < n_vec))
        if cutlass.const_expr(self.check):
            red_xor(out_ptr, acc)
        else:
            if acc == NEVER:
                stg_u32(out_ptr, acc)


_kernels = {}


def _kernel(threads, width, unroll, check=False):
    key = (threads, width, unroll, check)
    if key not in _kernels:
        op = StreamRead(threads, width, unroll, check)
        fn = dsl_compile(op, (cutlass.Int64(0), cutlass.Int32(1), cutlass.Int64(0), cutlass.Int32(1), CUstream(0)))
        _kernels[key] = Kernel(fn, torch.cuda.current_device(), op)
    return _kernels[key]


def reader(buf, threads, width, ctas_per_sm, unroll=4, check=False, out_init=0):
    """A callable that reads all of ``buf`` (a uint8 CUDA tensor, zeros for timing) once with this
    configuration; ``run.out`` is the kernel's one-word output (``check``: see ``StreamRead``)."""
    kern = _kernel(threads, width, unroll, check)
    n_vec = buf.numel() // width
    sms = torch.cuda.get_device_properties(buf.device).multi_processor_count
    grid = max(1, min(sms * ctas_per_sm, -(-n_vec // threads)))
    out = torch.full((1,), out_init, dtype=torch.int32, device=buf.device)
    args = (buf.data_ptr(), n_vec, out.data_ptr(), grid)
    dev = buf.device.index

    def run():
        stream = current_stream(dev)
        if kern.ffi is not None:
            kern.ffi(*args, stream)
        else:
            kern.launch_dsl(args, stream)

    run.out = out
    return run


def configs():
    return list(itertools.product(GRIDS, BLOCKS, WIDTHS, UNROLLS))


def zero_buffer(nbytes):
    return torch.zeros(-(-nbytes // 16) * 16, dtype=torch.uint8, device="cuda")


def floor_us(nbytes, reps, time_fn, clean=False, verbose=False, buf=None):
    """``(best us, (ctas_per_sm, threads, width, unroll))`` of a plain read of ``nbytes`` (rounded up to 16),
    in ``buf`` if given (``zero_buffer(nbytes)``)."""
    if buf is None:
        buf = zero_buffer(nbytes)
    best = (float("inf"), None)
    for cps, threads, width, unroll in configs():
        us = time_fn(reader(buf, threads, width, cps, unroll), reps, clean=clean)
        if verbose:
            print(f"  read {nbytes} B: {cps:2d} CTAs/SM x {threads:3d} threads, {width:2d}-byte loads x {unroll}: "
                  f"{us:7.2f} us", flush=True)
        best = min(best, (us, (cps, threads, width, unroll)))
    return best


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shapes", nargs="*", default=["7168x16384x1", "4096x7168x8", "7168x2048x4"],
                   help="M x K x L of the competition's tensors whose bytes are read (default: task.yml's benchmarks)")
    args = p.parse_args(argv)
    from bench import bytes_moved, time_leaderboard

    for spec in args.shapes:
        m, k, l = (int(v) for v in spec.split("x"))
        nbytes = bytes_moved(m, k, l)
        for clean in (False, True):
            us, cfg = floor_us(nbytes, 50, time_leaderboard, clean=clean, verbose=True)
            print(f"{spec} ({nbytes} B, {'clean' if clean else 'dirty'} L2): floor {us:.2f} us at {cfg}", flush=True)


if __name__ == "__main__":
    main()

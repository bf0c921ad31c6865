"""The base of the model-code op's kernels (``tokens``, ``tokens_bulk``, ``mma``, ``w4a16``): one launch
signature of 14 run-time values (six addresses, M, five row strides in bytes, the grid; then the stream) and
one compile call. A kernel class subclasses ``OpLaunch``, sets ``threads``, ``smem_bytes`` and
``min_blocks`` and writes ``op_body``; ``compile_op`` compiles an instance with the launch options of
``nvfp4_gemv.launch`` (TVM-FFI where it is installed). The host side that fills the 14 values is
``nvfp4_gemv.op_plan``.
"""

import cutlass
import cutlass.cute as cute
from cuda.bindings.driver import CUstream

from .launch import dsl_compile


class OpLaunch:
    """What the op's kernels share: the 14 run-time arguments (six addresses, M, five row strides in bytes,
    the grid, the stream), one launch with the subclass's block, shared memory and occupancy, and the
    kernel's signature; the subclass's ``op_body`` is the kernel."""

    @cute.jit
    def __call__(self, w_ptr: cutlass.Int64, x_ptr: cutlass.Int64, ws_ptr: cutlass.Int64, xs_ptr: cutlass.Int64,
                 out_ptr: cutlass.Int64, alpha_ptr: cutlass.Int64, m: cutlass.Int32, w_rs: cutlass.Int64,
                 ws_rs: cutlass.Int64, x_rs: cutlass.Int64, xs_rs: cutlass.Int64, out_rs: cutlass.Int64,
                 grid_x: cutlass.Int32, stream):
        self.kernel(w_ptr, x_ptr, ws_ptr, xs_ptr, out_ptr, alpha_ptr, m, w_rs, ws_rs, x_rs, xs_rs,
                    out_rs).launch(grid=[grid_x, 1, 1], block=[self.threads, 1, 1], smem=self.smem_bytes,
                                   stream=stream, min_blocks_per_mp=self.min_blocks)

    @cute.kernel
    def kernel(self, w_ptr: cutlass.Int64, x_ptr: cutlass.Int64, ws_ptr: cutlass.Int64, xs_ptr: cutlass.Int64,
               out_ptr: cutlass.Int64, alpha_ptr: cutlass.Int64, m: cutlass.Int32, w_rs: cutlass.Int64,
               ws_rs: cutlass.Int64, x_rs: cutlass.Int64, xs_rs: cutlass.Int64, out_rs: cutlass.Int64):
        self.op_body(w_ptr, x_ptr, ws_ptr, xs_ptr, out_ptr, alpha_ptr, m, w_rs, ws_rs, x_rs, xs_rs, out_rs)


def pick_groups(m, slots, counts):
    """The count of 8-row groups a CTA owns at a time, among ``counts``, with the least work on the busiest of
    ``slots`` CTAs running at once: rounds x (groups + 2), the 2 for what a tile costs besides its groups
    (decoding x, the partials' sum); ties to more groups. Both op kernels' routes ask it with their own
    candidates (``op_route``: 1..8; ``w4a16_route.w4a16_groups``: the registers' cap, even counts for
    ``w_a``). Without the 2, M = 14336 on 148 SMs would take one group in 13 rounds."""
    total = m // 8

    def cost(gr):
        tiles = -(-total // gr)
        return -(-tiles // slots) * (gr + 2), -gr

    return min(counts, key=cost)


def compile_op(op, options=None, tvm_ffi=None):
    """``(op, compiled)`` for one of the op's kernels (no GPU needed when ``options`` names ``--gpu-arch``)."""
    i64, i32 = cutlass.Int64(0), cutlass.Int32(1)
    return op, dsl_compile(op, (*[i64] * 6, i32, *[i64] * 5, i32, CUstream(0)), options, tvm_ffi)

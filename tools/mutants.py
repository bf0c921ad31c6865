"""Mutation check: deliberate breakages of the code, each of which some test must catch.

    python tools/mutants.py --cpu          # the CPU mutants (CI runs these; every one must be killed)
    python tools/mutants.py --gpu          # the GPU mutants (on a GPU machine)
    python tools/mutants.py --only NAME    # one mutant
    python tools/mutants.py --gpu --jobs 4 # four at a time (each its own pytest process and tree copy)

Each mutant replaces one exact piece of text (found exactly once) in a copy of the tree (tracked and
untracked, not ignored, files), regenerates ``submission.py`` there when one of its modules changed, runs
the tests named for it and prints a table: mutant, tests, killed or SURVIVED. A survivor is a missing
test, or a mutant that changes nothing (then drop it, saying why). Exit status 1 if any survived.
"""

import argparse
import concurrent.futures
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import gen_submission  # noqa: E402

STITCHED = set(gen_submission.sources())  # submission.py is made of these: regenerated where a mutant edits one
PTX = "nvfp4_gemv/ptx.py"
DECODE = "nvfp4_gemv/decode.py"
STREAMING = "nvfp4_gemv/streaming.py"
BULK = "nvfp4_gemv/bulk.py"
TUNING = "nvfp4_gemv/tuning.py"
LAUNCH = "nvfp4_gemv/launch.py"
ENTRY = "nvfp4_gemv/leaderboard.py"
OP = "nvfp4_gemv/op.py"
OP_ROUTE = "nvfp4_gemv/op_route.py"
REF = "nvfp4_gemv/reference.py"
TOK = "nvfp4_gemv/tokens.py"
MMA = "nvfp4_gemv/mma.py"
TOK_BULK = "nvfp4_gemv/tokens_bulk.py"
W4A16 = "nvfp4_gemv/w4a16.py"
W4A16_ROUTE = "nvfp4_gemv/w4a16_route.py"
OP_PLAN = "nvfp4_gemv/op_plan.py"
QUANT = "nvfp4_gemv/quant.py"
DQKERN = "nvfp4_gemv/dequant_kernel.py"
RKERN = "nvfp4_gemv/router_kernel.py"
QKERN = "nvfp4_gemv/quant_kernel.py"
LINEAR = "nvfp4_gemv/model/linear.py"
CONVERT = "nvfp4_gemv/model/convert.py"
MODELOPT = "nvfp4_gemv/model/modelopt.py"
FUSE = "nvfp4_gemv/model/fuse.py"
CHECKPOINT = "nvfp4_gemv/model/checkpoint.py"
PACKED = "nvfp4_gemv/packed.py"
TP = "nvfp4_gemv/model/tp.py"
EXPERTS = "nvfp4_gemv/model/experts.py"
EXPERTS_FORWARD = "nvfp4_gemv/model/experts_forward.py"
GENERATION = "nvfp4_gemv/model/generation.py"
EXPERTS_OP = "nvfp4_gemv/experts_op.py"
EXPERTS_KERNEL = "nvfp4_gemv/experts_kernel.py"
LIBRARY = "nvfp4_gemv/library.py"

# (name, file, old, new, tests, gpu)
MUTANTS = [
    # -- competition entry: validation (CPU) --
    ("check: M % 128 dropped", ENTRY, "if m == 0 or m % 128:", "if m == 0:", ["tests/leaderboard/test_validation.py"], False),
    ("check: K % 64 dropped", ENTRY, "if k == 0 or k % 64:", "if k == 0:", ["tests/leaderboard/test_validation.py"], False),
    ("check: K <= MAX_K dropped", ENTRY, "    if k > MAX_K:\n        fail", "    if False:\n        fail",
     ["tests/leaderboard/test_validation.py"], False),
    ("check: L == 0 accepted", ENTRY, "    if l == 0:\n", "    if l < 0:\n", ["tests/leaderboard/test_validation.py"], False),
    ("check: a layout dropped", ENTRY, "if a.stride(1) != 1 or a.stride(0) % 16 or a.data_ptr() % 16 or (l > 1 and a.stride(2) % 16):",
     "if False:",
     ["tests/leaderboard/test_validation.py"], False),
    ("check: b layout dropped", ENTRY, "if b.stride(1) != 1 or b.data_ptr() % 16", "if False",
     ["tests/leaderboard/test_validation.py"], False),
    ("check: plain scale layout dropped", ENTRY, "if t.stride(1) != 1 or t.stride(0) % 2 or t.data_ptr() % 2",
     "if False", ["tests/leaderboard/test_validation.py"], False),
    ("check: permuted scale layout dropped", ENTRY,
     "if ((s[0], s[1], s[3], s[4]) != (16, 4, 1, 512) or (t.shape[2] > 1 and s[2] != 512 * (sfk // 4))\n"
     "                    or (l > 1 and s[5] % 2) or t.data_ptr() % 2):", "if False:",
     ["tests/leaderboard/test_validation.py"], False),
    ("check: c writability dropped", ENTRY, "if size > 1 and c.stride(dim) <= 0:", "if False:",
     ["tests/leaderboard/test_validation.py"], False),
    ("check: a on the CPU accepted", ENTRY, 'if dev.type != "cuda":', 'if dev.type == "xla":',
     ["tests/leaderboard/test_validation.py"], False),
    # -- the op: validation and exact path (CPU) --
    ("op: M % 128 dropped", REF, "if m == 0 or m % 128:", "if m == 0:", ["tests/op/test_op_validation.py"], False),
    ("op: mismatched K accepted", REF, "if w.shape[1] != k2:", "if False:", ["tests/op/test_op_validation.py"], False),
    ("op: alpha dtype unchecked", REF, "if alpha.dtype != torch.float32 or alpha.numel() != 1 or alpha.dim() > 1:",
     "if alpha.numel() > 8:", ["tests/op/test_op_validation.py"], False),
    ("op: out shape unchecked", REF, "if out.dtype != out_dtype or tuple(out.shape) != (n, m):", "if False:",
     ["tests/op/test_op_validation.py"], False),
    ("op: blocked scales read as plain", REF, "    if shape in (swz, (swz[0] * swz[1],)):", "    if False:",
     ["tests/op/test_contract.py", "tests/op/test_op_validation.py"], False),
    ("op: unswizzle transposes the 4x4 groups", REF, "permute(0, 3, 2, 1, 4)", "permute(0, 2, 3, 1, 4)",
     ["tests/op/test_contract.py"], False),
    # (a nibble swap in the shared decoder is not here: it swaps the same pair of x and of w, which leaves
    # every product, and so the result, unchanged)
    ("op: scale signs lost", REF, "    return s.to(torch.float64).repeat_interleave(16, dim=1)",
     "    return s.to(torch.float64).abs().repeat_interleave(16, dim=1)", ["tests/op/test_contract.py"], False),
    ("op: alpha ignored on the exact path", REF, "        res = res * alpha.reshape(()).to(torch.float64)", "        res = res",
     ["tests/op/test_contract.py"], False),
    ("guard: a scan's hit not filed under its anchor", LAUNCH, "                    if key in hits or len(hits) < self.SIZE:\n                        hits[key] = hit\n",
     "", ["tests/leaderboard/test_plan_guard.py"], False),
    ("guard: alpha's layout not in gemv's key", OP_PLAN,
     "w_scale.stride(),\n            w_scale.dtype, w_scale.get_device(),\n            None if alpha is None else (alpha.shape, alpha.dtype, alpha.layout,",
     "w_scale.stride(),\n            w_scale.dtype, w_scale.get_device(),\n            None if alpha is None else (alpha.shape, alpha.dtype,", ["tests/leaderboard/test_plan_guard.py"], False),
    ("launch: an odd sfb launched", ENTRY, "if (pa | pb) & 15 or psa & sfa_mask or psb & 1 or get_device() != dev:",
     "if (pa | pb) & 15 or psa & sfa_mask or get_device() != dev:", ["tests/leaderboard/test_plan_guard.py"], False),
    ("launch: another current device launched", ENTRY, "if (pa | pb) & 15 or psa & sfa_mask or psb & 1 or get_device() != dev:",
     "if (pa | pb) & 15 or psa & sfa_mask or psb & 1:", ["tests/leaderboard/test_plan_guard.py"], False),
    ("op: nested and sparse tensors accepted", REF, "def _strided(t, name):\n    if t.is_nested or t.layout != torch.strided:",
     "def _strided(t, name):\n    if False:", ["tests/op/test_op_validation.py"], False),
    ("op: out= not written on the CPU", OP, "    out.copy_(res)\n    return out", "    return out",
     ["tests/op/test_contract.py"], False),
    # -- the plan caches' C++ guards (CPU) --
    ("guard: a recent plan taken unchecked", ENTRY, "or sfb_p.is_nested or c.is_nested or not check(a, b, sfa, sfb, sfa_p, sfb_p, c)):",
     "or sfb_p.is_nested or c.is_nested):", ["tests/leaderboard/test_plan_guard.py"], False),
    ("guard: nested tensors reach the guard", ENTRY, "            if (a.is_nested or b.is_nested or sfa.is_nested",
     "            if (False or b.is_nested or sfa.is_nested", ["tests/leaderboard/test_plan_guard.py"], False),
    ("guard: strides not compared (the self-check must refuse it)", LAUNCH,
     "dynamic_dims_strides=[list(t.stride()) for t in ts]", "dynamic_dims_strides=[[None] * t.dim() for t in ts]",
     ["tests/leaderboard/test_plan_guard.py"], False),
    ("guard: one guard a plan", LAUNCH, "hit = next((h for g, h in plan.variants if g.check(*ts)), None)",
     "hit = next((h for g, h in plan.variants[:1]), None)", ["tests/leaderboard/test_plan_guard.py"], False),
    ("guard: no scan of the recent plans", ENTRY, "                c = _recent.scan(data[0], hit, data)", "                c = None",
     ["tests/leaderboard/test_plan_guard.py"], False),
    ("guard: any container takes the cached path", ENTRY, "    if type(data) is tuple or type(data) is list:",
     "    if True:", ["tests/leaderboard/test_plan_guard.py"], False),
    ("launch: the hit path's scales from the other layout", ENTRY, "        if plain:\n            psa, psb",
     "        if not plain:\n            psa, psb", ["tests/leaderboard/test_plan_guard.py"], False),
    ("guard: tensor subclasses guarded", LAUNCH, "type(t) not in _GUARD_TYPES or t.is_nested", "t.is_nested",
     ["tests/leaderboard/test_plan_guard.py"], False),
    ("guard: nested x reaches gemv's guard", OP_PLAN, "if x.is_nested or x_scale.is_nested", "if x_scale.is_nested",
     ["tests/leaderboard/test_plan_guard.py"], False),
    ("guard: gemv's plan for any out dtype", OP_PLAN, " or (out is None and out_dtype != dtype):", ":",
     ["tests/leaderboard/test_plan_guard.py"], False),
    ("guard: gemv's plan without its alpha", OP_PLAN, "if (alpha is None) == has_alpha or ", "if ",
     ["tests/leaderboard/test_plan_guard.py"], False),
    ("guard: gemv's out not guarded", OP_PLAN,  # where the guard is made and both calls that check out
     (" + ((out,) if out is not None else ())", "check(x, x_scale, w, w_scale, alpha, out) if has_out else",
      "not out.is_nested and check(x, x_scale, w, w_scale, out)"),
     ("", "check(x, x_scale, w, w_scale, alpha) if has_out else", "not out.is_nested and check(x, x_scale, w, w_scale)"),
     ["tests/leaderboard/test_plan_guard.py"], False),
    ("check: nested and sparse tensors accepted", ENTRY, "    if t.is_nested or t.layout != torch.strided:\n",
     "    if False:\n", ["tests/leaderboard/test_plan_guard.py"], False),
    # -- build, launch, packaging, harness (CPU) --
    ("launch: no TVM-FFI", LAUNCH, '(" --enable-tvm-ffi" if tvm_ffi else "")', '""',
     ["tests/leaderboard/test_compile.py::test_kernel_compiles_without_gpu"], False),
    ("decode: an e2m1 conversion in the kernel", DECODE,
     '"{\\n.reg .b32 t0, t1, n, h, p, q;\\n"',
     '"{\\n.reg .b32 t0, t1, n, h, p, q;\\n.reg .b8 probe_in;\\n.reg .b32 probe_out;\\n'
     'cvt.u8.u32 probe_in, $2;\\ncvt.rn.f16x2.e2m1x2 probe_out, probe_in;\\n"',
     ["tests/leaderboard/test_compile.py::test_kernel_compiles_without_gpu[sm_100a-7168-False]"], False),  # sm_100a has it
    ("packaging: submission.py stale", LAUNCH, "MAX_K = 32768", "MAX_K = 32768  # edited, not regenerated",
     ["tests/tools/test_packaging.py::test_submission_is_generated_from_the_package"], False),
    ("packaging: generic modules installed", "pyproject.toml", 'packages = ["nvfp4_gemv", "nvfp4_gemv.model"]',
     'packages = ["nvfp4_gemv", "nvfp4_gemv.model"]\npy-modules = ["task", "utils"]', ["tests/tools/test_packaging.py"], False),
    ("harness: 'needs CUDA' for every case", "eval.py", "                return EXIT_FAIL\n            rows.append",
     "            rows.append", ["tests/leaderboard/test_eval_harness.py::test_cuda_only_submission_on_cpu_says_a_gpu_is_needed"],
     False),
    ("mma: partial sums read without side effects", PTX,
     '"ld.shared.f32 $0, [$1];", "=f,r", loc, ip, volatile=True)', '"ld.shared.f32 $0, [$1];", "=f,r", loc, ip)',
     ["tests/leaderboard/test_compile.py::test_op_tensor_core_kernel_compiles_without_gpu"], False),
    ("routing: bulk never chosen", TUNING, "    bulk = not blocked_scales and bulk_suits(k)\n", "    bulk = False\n",
     ["tests/leaderboard/test_config.py"], False),
    ("routing: the latency config never yields", TUNING,
     "    if per_lane >= 8 and ctas > sms and Nvfp4Gemv(k, False).batch >= 3:", "    if False:",
     ["tests/leaderboard/test_config.py"], False),
    ("routing: a tail at several chunks for any split", TUNING, "(not long_tails or split & (split - 1)",
     "(not long_tails", ["tests/leaderboard/test_config.py"], False),
    ("routing: K = 1024's wide units at 3 CTAs on every DSL", TUNING, "and (dsl or DSL_VERSION) >= (4, 4):",
     "and False:", ["tests/leaderboard/test_config.py"], False),
    ("routing: wide scales for every unit shape", TUNING, "    if op.batch == 2 and op.group == 16:\n",
     "    if True:\n", ["tests/leaderboard/test_config.py"], False),
    ("routing: K = 4096 and 6144 keep units of 2 chunks", TUNING, "        if op.per_lane % 4 == 0 and k < BULK_MIN_K:\n",
     "        if False:\n", ["tests/leaderboard/test_config.py"], False),
    ("routing: units of 4 chunks past the bulk kernel's K", TUNING, "if op.per_lane % 4 == 0 and k < BULK_MIN_K:",
     "if op.per_lane % 4 == 0:", ["tests/leaderboard/test_config.py"], False),
    ("routing: streaming grid rounded up past one wave", STREAMING, "sms * self.ctas_per_sm() // l))",
     "-(-sms * self.ctas_per_sm() // l)))", ["tests/leaderboard/test_config.py"], False),
    ("routing: split CTAs always up to 512 threads", TUNING, "        for cap in (512, 256):", "        for cap in (512,):",
     ["tests/leaderboard/test_config.py"], False),
    ("routing: the first split whose threads fit, one wave or not", TUNING, "        if best:\n            return best[1]",
     "        if first:\n            return first", ["tests/leaderboard/test_config.py"], False),
    # -- arithmetic, routing, streams (GPU) --
    ("store: fp16 rounds toward zero", PTX, "cvt.rn.f16.f32 h, $1", "cvt.rz.f16.f32 h, $1",
     ["tests/leaderboard/test_accuracy.py"], True),
    ("sum: fp32 instead of fp64", DECODE,
     "    acc = acc + cutlass.Float64(cutlass.Float32(d0) * (sa0 * sb0))\n    return acc + cutlass.Float64(cutlass.Float32(d1) * (sa1 * sb1))",
     "    acc = cutlass.Float64(cutlass.Float32(acc) + cutlass.Float32(d0) * (sa0 * sb0))\n"
     "    return cutlass.Float64(cutlass.Float32(acc) + cutlass.Float32(d1) * (sa1 * sb1))",
     ["tests/leaderboard/test_accuracy.py"], True),
    ("scales: blocked offset of the odd block", DECODE, "return cutlass.Int64((c >> 1) * 512 + (c & 1) * 2)",
     "return cutlass.Int64((c >> 1) * 512 + (c & 1) * 1)", ["tests/leaderboard/test_correctness.py"], True),
    ("wide scales: a lane reads its neighbour's scales", STREAMING, "lds_stage_u16(scr + 2 * (lane + i * G))",
     "lds_stage_u16(scr + 2 * (lane + i * G) + 2)", ["tests/leaderboard/test_wide_scales.py"], True),
    ("wide scales: sfa rows off 16 bytes reach the 16-byte loads", TUNING,
     "        return bool(self.sf_wide)", "        return False",
     ["tests/leaderboard/test_wide_scales.py"], True),
    ("cached plan: address check dropped", ENTRY, "if (pa | pb) & 15 or psa & self.sfa_mask or psb & 1:", "if False:",
     ["tests/leaderboard/test_correctness.py::test_cached_plan_still_rejects_a_misaligned_tensor"], True),
    ("split: a tail lane's last chunk not predicated off", STREAMING,
     "preds[-1] = pred & cutlass.Int32(c0 + (self.batch - 1) * self.row_lanes < self.chunks)", "preds[-1] = pred",
     ["tests/leaderboard/test_split_kernel.py"], True),
    ("split: a tail lane's b not clamped to the row", DECODE, "ch = cutlass.min(ch, last)", "ch = ch",
     ["tests/leaderboard/test_split_kernel.py::test_tail_lanes_read_nothing_past_the_row"], True),
    ("routing: split kernel never chosen", TUNING, "    split = split_tuning(k, m, l, sms, long_tails=bulk)\n",
     "    split = None\n", ["tests/leaderboard/test_split_kernel.py"], True),
    ("stream: the legacy default stream", ENTRY, "ffi(pa, pb, psa, psb, c.data_ptr(), ctr, *self.static, stream)",
     "ffi(pa, pb, psa, psb, c.data_ptr(), ctr, *self.static, 0)", ["tests/leaderboard/test_correctness.py", "tests/leaderboard/test_contexts.py"],
     True),
    ("op stream: W4A4 launches on the legacy default stream", OP_PLAN,
     "kern.ffi(pw, px + dx, pws, pxs + dxs, pout + dout, pa, *static, stream)",
     "kern.ffi(pw, px + dx, pws, pxs + dxs, pout + dout, pa, *static, 0)",
     ["tests/op/test_gemv_accuracy.py::test_runs_on_the_current_stream"], True),
    ("op stream: W4A16 launches on the legacy default stream", OP_PLAN,
     "kern.ffi(pw, px + dx, pws, 0, pout + dout, pa, *static, stream)",
     "kern.ffi(pw, px + dx, pws, 0, pout + dout, pa, *static, 0)",
     ["tests/op/test_w4a16_kernel.py::test_runs_on_the_current_stream"], True),
    ("W4A16: x's load free to move with slices past the last", W4A16,
     "self.x_fixed = (self.across and not self.x_smem and self.n_slices % self.warps == 0 and k % 128 == 0",
     "self.x_fixed = (self.across and not self.x_smem and k % 128 == 0",
     ["tests/op/test_w4a16.py::test_x_loads_are_volatile_unless_every_slice_index_is_in_range"], False),
    ("W4A16: x's load free to move at K % 128 == 64", W4A16,
     "self.n_slices % self.warps == 0 and k % 128 == 0\n", "self.n_slices % self.warps == 0\n",
     ["tests/op/test_w4a16.py::test_x_loads_are_volatile_unless_every_slice_index_is_in_range"], False),
    ("W4A16: x's predicated load without side effects (hoisted past its guard)", PTX,
     '"mov.b32 $3, 0;\\n@p ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];\\n}", "=r,=r,=r,=r,l,r", loc, ip,\n             volatile=volatile)',
     '"mov.b32 $3, 0;\\n@p ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];\\n}", "=r,=r,=r,=r,l,r", loc, ip)',
     ["tests/op/test_reads_in_bounds.py"], True),
    ("dynamic tiles: one counter set for every stream", LAUNCH,
     "    key = (dev, stream) if stream != CUDA_STREAM_PER_THREAD else (dev, stream, _thread_number())\n",
     "    key = (dev, 0)\n", ["tests/leaderboard/test_tile_counters.py"], False),
    ("dynamic tiles: one counter set for all threads on the per-thread default stream", LAUNCH,
     "    key = (dev, stream) if stream != CUDA_STREAM_PER_THREAD else (dev, stream, _thread_number())\n",
     "    key = (dev, stream)\n", ["tests/leaderboard/test_tile_counters.py"], False),
    ("dynamic tiles: no second look under the lock", LAUNCH,
     "            got = _counters.get(key)\n            if got is None or got[0] < l:\n",
     "            if True:\n", ["tests/leaderboard/test_tile_counters.py"], False),
    ("dynamic tiles: one claim a CTA too many counted", BULK,
     "        return vmax(n_tiles - dyn, 0) + vmin(vmax(n_tiles - dyn + gdimx, 0), gdimx)\n",
     "        return vmax(n_tiles - dyn, 0) + vmin(vmax(n_tiles - dyn + gdimx, 0), gdimx) + 1\n",
     ["tests/leaderboard/test_dynamic_claims.py"], False),
    ("dynamic tiles: the last claim leaves the counter set", BULK,
     "                            st_relaxed_u32(ctr_l, cutlass.Int32(0))\n", "                            pass\n",
     ["tests/leaderboard/test_dynamic_tiles.py::test_every_tile_is_done_once_and_the_counters_end_at_zero"], True),
    # (a count of claims off by one hangs instead: the reset then comes before the last claim, and the claims
    # start again from zero)
    ("dynamic tiles: claims skip a round of tiles", BULK, "                            base = dyn\n",
     "                            base = dyn + gdimx\n", ["tests/leaderboard/test_dynamic_tiles.py"], True),
    ("dynamic tiles: a claim past the last does not trap", BULK, "                            trap()\n",
     "                            pass\n",
     ["tests/leaderboard/test_dynamic_tiles.py::test_a_counter_left_past_the_claims_makes_the_launch_fail_loudly"], True),

    ("dynamic tiles: counters inside a graph capture", LAUNCH, "    if _capturing():\n        return 0\n", "",
     ["tests/leaderboard/test_dynamic_tiles.py::test_a_captured_launch_keeps_the_static_schedule_and_replays_beside_eager_ones"],
     True),
    ("op: alpha ignored in the kernel", TOK, "            alpha = ldg_f32(alpha_ptr)\n", "            alpha = cutlass.Float32(1.0)\n",
     ["tests/op/test_gemv_accuracy.py"], True),
    ("op: second token group at the first's x", OP_PLAN, "offsets = (t0 * x.stride(0),", "offsets = (0,",
     ["tests/op/test_gemv_accuracy.py::test_token_groups_beyond_shared_memory"], True),
    ("mma: odd nibbles' signs lost in the decode", DECODE, '"and.b32 u, t, 0x8E8E8E8E;"', '"and.b32 u, t, 0x0E0E0E0E;"',
     ["tests/op/test_each_kernel.py"], True),
    ("mma: the last tile not moved back", MMA, "row0 = cutlass.min(tile * (GR * 8), m - GR * 8)",
     "row0 = tile * (GR * 8)", ["tests/op/test_each_kernel.py"], True),
    ("mma: tokens 8..15 dropped", MMA, "a1 = xa[1][2 * s] if XH == 2 else zero", "a1 = zero",
     ["tests/op/test_each_kernel.py"], True),
    ("op: tensor-core kernel never chosen", OP_ROUTE, "    return n >= 5 and m // 8 >= sms", "    return False",
     ["tests/op/test_routing.py"], False),  # (on a GPU also tests/op/test_gemv_accuracy.py::test_kernel_choice)
    ("op: bulk-copy kernel never chosen", OP_ROUTE, "    return Nvfp4GemvTokensBulk.can_implement(k, n, **bulk_tuning(n, m, k))\n",
     "    return False\n", ["tests/op/test_routing.py"], False),
    ("op: 4 rows a thread never chosen", OP_ROUTE, '        return {"ctas": 1, "rt": 4}\n', '        return {"ctas": 1}\n',
     ["tests/op/test_routing.py"], False),
    ("op bulk: a thread's rows write one row's partials", TOK_BULK,
     "                    p = p + (vi // NT) * (4 * self.parts * NT) - 4 * (vi // NT) * NT\n",
     "                    p = p - 4 * (vi // NT) * NT\n", ["tests/op/test_each_kernel.py::test_bulk_rows_a_thread"], True),
    ("op: bf16 stored as fp16", PTX, 'cvt = "cvt.rn.bf16.f32" if bf16 else "cvt.rn.f16.f32"', 'cvt = "cvt.rn.f16.f32"',
     ["tests/op/test_gemv_accuracy.py"], True),
    # -- W4A16 (bf16/fp16 x): the contract on the CPU --
    ("w4a16: x_scale with bf16 x accepted", REF, "        if x_scale is not None:\n            fail_gemv(TypeError",
     "        if False:\n            fail_gemv(TypeError", ["tests/op/test_w4a16.py"], False),
    ("w4a16: missing x_scale of NVFP4 x not named", REF, "    elif x_scale is None:\n", "    elif False:\n",
     ["tests/op/test_w4a16.py"], False),
    ("w4a16: reference rounds x", REF, "xv = x.to(torch.float64) if x_scale is None",
     "xv = x.to(torch.float64).round() if x_scale is None", ["tests/op/test_w4a16.py"], False),
    ("w4a16: one-token tuning for two tokens", W4A16_ROUTE, "    if n_tok == 1 and m // 32 > sms:", "    if n_tok <= 2 and m // 32 > sms:",
     ["tests/op/test_w4a16.py"], False),
    ("w4a16: shared x for one token on any M", W4A16_ROUTE, "n_tok == 1 and m // 32 > sms", "n_tok == 1",
     ["tests/op/test_w4a16.py"], False),
    ("w4a16: groups cap of 32 tokens raised", W4A16_ROUTE, "4 if n_tok <= 24 else 2", "4",
     ["tests/op/test_w4a16.py"], False),
    ("w4a16: w as the A operand only up to 4 tokens", W4A16_ROUTE, 'w_a = {"w_a": 1} if n_tok <= W_A_TOKENS else {}',
     'w_a = {"w_a": 1} if n_tok <= 4 else {}', ["tests/op/test_w4a16.py"], False),
    ("w4a16: odd group counts for w_a", W4A16_ROUTE, "+ 1, 2 if even else 1))", "+ 1, 1))",
     ["tests/op/test_w4a16.py"], False),
    ("w4a16: the plan picks groups without even=", W4A16_ROUTE, 'w4a16_groups(n_tok, m, sms, even=bool(tune.get("w_a")))',
     "w4a16_groups(n_tok, m, sms)", ["tests/op/test_w4a16.py"], False),
    ("w4a16: the one-token route without late scales", W4A16_ROUTE, '"xpair": 1, "late": 1, **across,',
     '"xpair": 1, "late": 0, **across,', ["tests/op/test_w4a16.py"], False),
    ("w4a16: the one-token route without across", W4A16_ROUTE, 'across = {"across": 1} if k >= 1024 else {}',
     "across = {}", ["tests/op/test_w4a16.py"], False),
    ("w4a16: late accepted without one token, w_a and paired shared x", W4A16,
     "        if self.late and not (n_tok == 1 and self.w_a and self.x_smem and self.xpair):\n",
     "        if False:\n", ["tests/op/test_w4a16.py"], False),
    ("w4a16: across refused at depth 1 on short K", W4A16,
     "if self.across and self.depth > 1 and self.n_slices", "if self.across and self.n_slices",
     ["tests/op/test_w4a16.py"], False),
    ("w4a16: across below K = 1024", W4A16_ROUTE, 'across = {"across": 1} if k >= 1024 else {}',
     'across = {"across": 1}', ["tests/op/test_w4a16.py"], False),
    ("w4a16: bulk taken for scales off 16-byte rows", OP_PLAN, "if wb or (w_scale.data_ptr() | ws_rs) & 15:",
     "if wb:", ["tests/op/test_w4a16.py"], False),
    ("w4a16: bulk with more rows than a warp has lanes", W4A16, "and self.row_s % 16 == 0 and self.rows <= 32)",
     "and self.row_s % 16 == 0)", ["tests/op/test_w4a16.py"], False),
    ("w4a16: the dequantized plan without its address mask", OP_PLAN,
     "        self.ws_mask = 1  # address bits of w_scale that must be 0 (checked each call; bulk's below)\n", "",
     ["tests/op/test_w4a16.py"], False),
    ("w4a16: bulk's stages counted without their rounds", W4A16, "and self.rounds % self.span == 0 and",
     "and", ["tests/op/test_w4a16.py"], False),
    ("w4a16: 4-warp CTAs of one token on any rows", W4A16_ROUTE, " and m // 16 >= FOUR_WARPS_TILES * sms:",
     ":", ["tests/op/test_w4a16.py"], False),
    ("w4a16: 4-warp CTAs of one token at any K", W4A16_ROUTE, "if FOUR_WARPS_K[0] <= k <= FOUR_WARPS_K[1] and m // 16",
     "if m // 16", ["tests/op/test_w4a16.py"], False),
    ("w4a16: 4-warp CTAs of one token without even rounds", W4A16_ROUTE, '"ctas": 8, "even": 1,', '"ctas": 8,',
     ["tests/op/test_w4a16.py"], False),
    ("w4a16: even rounds that leave the grid whole", W4A16, "            return max(1, -(-tiles // rounds))\n",
     "            return max(1, min(tiles, slots))\n", ["tests/op/test_w4a16.py"], False),
    ("w4a16: five CTAs whenever they fit", W4A16_ROUTE, "ctas = 5 if fit >= 5 and 4 * sms < m // 16 <= 5 * sms else 4",
     "ctas = 5 if fit >= 5 else 4", ["tests/op/test_w4a16.py"], False),
    ("w4a16: five CTAs without their fit", W4A16_ROUTE, "ctas = 5 if fit >= 5 and 4 * sms", "ctas = 5 if fit >= 4 and 4 * sms",
     ["tests/op/test_w4a16.py"], False),
    ("w4a16: four CTAs a SM where their x does not fit", W4A16_ROUTE, "        if fit < 4:\n",
     "        if fit < 3:\n", ["tests/op/test_w4a16.py"], False),
    ("w4a16: the one-token route without the three-operation decode", W4A16_ROUTE,
     '"groups": 2, "dec": 1, "xpair": 1, "late": 1,', '"groups": 2, "dec": 0, "xpair": 1, "late": 1,',
     ["tests/op/test_w4a16.py"], False),
    ("w4a16: 16-warp CTAs of 1..4 tokens on any rows", W4A16_ROUTE, " and m // 16 >= sms - sms // 8\n", "\n",
     ["tests/op/test_w4a16.py"], False),
    ("w4a16: 16-warp CTAs of 1..4 tokens without their fit", W4A16_ROUTE,
     "            and _ctas_fit(2, k, n_tok, 2, threads=512)):", "            ):", ["tests/op/test_w4a16.py"], False),
    ("w4a16: 16-warp CTAs with late at every token count", W4A16_ROUTE, 'late = {"late": 1} if n_tok == 1 else {}',
     'late = {"late": 1}', ["tests/op/test_w4a16.py"], False),
    ("w4a16: 16-warp CTAs from K = 2048", W4A16_ROUTE, "FEW_ROWS_MIN_K = 4096", "FEW_ROWS_MIN_K = 2048",
     ["tests/op/test_w4a16.py"], False),
    ("w4a16: two CTAs of 4 groups at 3 tokens", W4A16_ROUTE, "if n_tok == 2 and SHARED_X_VALUES < n_tok * k",
     "if 2 <= n_tok <= 3 and SHARED_X_VALUES < n_tok * k", ["tests/op/test_w4a16.py"], False),
    ("w4a16: two CTAs of 4 groups within SHARED_X_VALUES", W4A16_ROUTE, "SHARED_X_VALUES < n_tok * k <= LONG_K_PAIR_VALUES",
     "n_tok * k <= LONG_K_PAIR_VALUES", ["tests/op/test_w4a16.py"], False),
    ("w4a16: the fit of shared-x CTAs raises where one CTA's x does not fit", W4A16_ROUTE,
     "    except ValueError:  # not even one CTA's x fits", "    except TypeError:  # not even one CTA's x fits",
     ["tests/op/test_w4a16.py"], False),
    ("w4a16: 16-warp CTAs of 5..8 tokens on any rows", W4A16_ROUTE, "and sms - sms // 8 <= m // 16\n", "\n",
     ["tests/op/test_w4a16.py"], False),
    ("w4a16: 16-warp CTAs of 5..8 tokens without their fit", W4A16_ROUTE, "            and _ctas_fit(2, k, n_tok, 2, 512)):",
     "            ):", ["tests/op/test_w4a16.py"], False),
    ("w4a16: 16-warp CTAs of 5..8 tokens from 2 tokens", W4A16_ROUTE, "if (SHARED_X_TOKENS < n_tok <= W_A_TOKENS",
     "if (1 < n_tok <= W_A_TOKENS", ["tests/op/test_w4a16.py"], False),
    ("w4a16: shared x of 9..16 tokens past the measured N x K", W4A16_ROUTE,
     "if n_tok * k <= MANY_TOKENS_X_VALUES and (k == ONE_SLICE_K", "if (k == ONE_SLICE_K",
     ["tests/op/test_w4a16.py"], False),
    ("w4a16: shared x of 9..16 tokens from K = 2048", W4A16_ROUTE, "(n_tok <= 16 and k >= FEW_ROWS_MIN_K)):",
     "(n_tok <= 16 and k >= 2048)):", ["tests/op/test_w4a16.py"], False),
    ("w4a16: shared x of 9..32 tokens at any K up to 2048", W4A16_ROUTE, "(k == ONE_SLICE_K or", "(k <= ONE_SLICE_K or",
     ["tests/op/test_w4a16.py"], False),
    ("w4a16: shared x of 17..32 tokens past K = 2048", W4A16_ROUTE, "(k == ONE_SLICE_K or", "(k >= ONE_SLICE_K or",
     ["tests/op/test_w4a16.py"], False),
    ("w4a16: shared x of 17..32 tokens in 4 groups on any rows", W4A16_ROUTE,
     '"groups": 4 if n_tok <= 16 else max(2, w4a16_groups(n_tok, m, sms, cap=4))}', '"groups": 4}',
     ["tests/op/test_w4a16.py"], False),
    ("w4a16: shared x of 17..32 tokens down to one group", W4A16_ROUTE, "else max(2, w4a16_groups(n_tok, m, sms, cap=4))}",
     "else w4a16_groups(n_tok, m, sms, cap=4)}", ["tests/op/test_w4a16.py"], False),
    ("w4a16: shared x of 9..16 tokens on many rows in as few groups as fill the SMs", W4A16_ROUTE,
     '"groups": 4 if n_tok <= 16 else max(2,', '"groups": 4 if n_tok <= 8 else max(2,',
     ["tests/op/test_w4a16.py"], False),
    ("w4a16: 16 warps up to 32 tokens", W4A16_ROUTE, "if n_tok <= 16 and k >= 2048 and m // 32 <= 2 * sms:",
     "if n_tok <= 32 and k >= 2048 and m // 32 <= 2 * sms:", ["tests/op/test_w4a16.py"], False),
    ("w4a16: 16 warps only where the 4-group tiles fill one round", W4A16_ROUTE, "and m // 32 <= 2 * sms:",
     "and m // 32 <= sms:", ["tests/op/test_w4a16.py"], False),
    ("w4a16: 16 warps on short K", W4A16_ROUTE, "if n_tok <= 16 and k >= 2048 and", "if n_tok <= 16 and",
     ["tests/op/test_w4a16.py"], False),
    ("w4a16: 16 warps of 6 groups", W4A16_ROUTE, '"x_smem": 0, "across": 1, "groups": w4a16_groups(n_tok, m, sms, cap=4)}',
     '"x_smem": 0, "across": 1, "groups": w4a16_groups(n_tok, m, sms, cap=6)}',
     ["tests/op/test_w4a16.py"], False),
    ("w4a16: 9..32 tokens keep the caps without across", W4A16_ROUTE, "w4a16_groups(n_tok, m, sms, cap=MAX_GROUPS)",
     "w4a16_groups(n_tok, m, sms)", ["tests/op/test_w4a16.py"], False),
    ("w4a16: 2..8 tokens without across", W4A16_ROUTE, '**w_a, **({"across": 1} if n_tok > 1 else {})}',
     "**w_a}", ["tests/op/test_w4a16.py"], False),
    ("w4a16: 2..4 tokens on many rows keep x in registers", W4A16_ROUTE,
     "if 2 <= n_tok <= SHARED_X_TOKENS and SHARED_X_MIN_K", "if False and SHARED_X_MIN_K", ["tests/op/test_w4a16.py"], False),
    ("w4a16: shared x for 2..4 tokens past N x K = 16384", W4A16_ROUTE, "and n_tok * k <= SHARED_X_VALUES and", "and",
     ["tests/op/test_w4a16.py"], False),
    ("w4a16: shared x for 2..4 tokens below K = 2048", W4A16_ROUTE, "SHARED_X_MIN_K <= k and", "",
     ["tests/op/test_w4a16.py"], False),
    ("w4a16: shared x for 2..4 tokens on few rows", W4A16_ROUTE, "n_tok * k <= SHARED_X_VALUES and m // 32 > sms:",
     "n_tok * k <= SHARED_X_VALUES:", ["tests/op/test_w4a16.py"], False),
    ("w4a16: x in shared memory without the fit check", W4A16,
     "fits = self.red_bytes + self.bulk_bytes + n_tok * self.x_row_bytes <= SMEM_CTA", "fits = True",
     ["tests/op/test_w4a16.py"], False),
    # -- quantize, NVFP4Linear, ModelOpt checkpoints (CPU) --
    ("quantize: 0.75 ties away from even", QUANT, "(0.75, True), (1.25", "(0.75, False), (1.25",
     ["tests/op/test_quantize.py"], False),
    ("linear: a reassigned scale leaves the derived scalars", LINEAR,
     'if name in ("input_scale", "weight_scale_2") and "_inv_input_scale" in self._buffers:', "if False:",
     ["tests/model/test_linear.py"], False),
    ("linear: in_features of x unchecked", LINEAR, "if x.dim() == 0 or x.shape[-1] != self.in_features:",
     "if x.dim() == 0:", ["tests/model/test_linear.py"], False),
    ("modelopt: any group size accepted", MODELOPT, "or group != GROUP_SIZE:", "or group < 0:",
     ["tests/model/test_modelopt.py"], False),
    ("modelopt: excluded parts not stacked into a fused dense module", MODELOPT, "                dense_fuse[k] = parts",
     "                pass", ["tests/model/test_modelopt.py"], False),
    ("modelopt: an excluded fused tensor not split into dense parts", MODELOPT, "                dense_split[k] = parts",
     "                pass", ["tests/model/test_modelopt.py"], False),
    ("fuse: a round's product kept after every part took its slice", FUSE,
     "if self._seen == self.full:  # the round is complete", "if False:  # the round is complete",
     ["tests/model/test_fuse.py"], False),
    ("fuse: a traced round's product kept after every part took its columns", FUSE,
     "sib._round = None if seen == (1 << len(r[2])) - 1 else (x, seen, r[2])", "sib._round = (x, seen, r[2])",
     ["tests/model/test_fuse.py"], False),
    ("fuse: a traced group's bias dropped", FUSE, "        if bias:\n            out = out + owner._buffers",
     "        if False:\n            out = out + owner._buffers", ["tests/model/test_fuse.py"], False),
    ("fuse: a traced round begun by a later part computes with that part's own buffers", FUSE,
     "owner = part if i == 0 else sib.owner", "owner = part", ["tests/model/test_fuse.py"], False),
    ("fuse: a part's second call of a round served the round's product", FUSE,
     "if self._x is not x or self._seen & bit:", "if self._x is not x:", ["tests/model/test_fuse.py"], False),
    ("fuse: the parts' global scales not compared", FUSE, "        if not ok:\n            continue",
     "        if False:\n            continue", ["tests/model/test_fuse.py"], False),
    ("fuse: a part's slice starts at column 0", FUSE, "out = self._out[:, lo:hi]", "out = self._out[:, :hi - lo]",
     ["tests/model/test_fuse.py"], False),
    ("fuse: the parts keep their own copies", FUSE, "            part._buffers[mine] = f[lo:hi]",
     "            pass", ["tests/model/test_fuse.py"], False),
    ("fuse: a module shared by two parents joins both groups", FUSE,
     "if _compatible(mods) is None and not taken & {id(m) for m in mods}:", "if _compatible(mods) is None:",
     ["tests/model/test_fuse.py"], False),
    ("fuse: modes across a group not compared", FUSE,
     'same = kernel is not None and all(p.__dict__.get("_kernel") is kernel for p in self.parts)',
     "same = kernel is not None", ["tests/model/test_fuse.py"], False),
    ("linear: a move leaves a fused part's copies", LINEAR,
     "        if sib is not None and sib.active:\n            sib.repoint(self)",
     "        if False:\n            sib.repoint(self)", ["tests/model/test_fuse.py"], False),
    ("linear: a load into a fused module keeps its group", LINEAR,
     "        if sib is not None and sib.active:\n            # the loaded",
     "        if False:\n            # the loaded", ["tests/model/test_fuse.py"], False),
    ("fuse: a replaced buffer not noticed", FUSE, "        if not self._intact(part):", "        if False:",
     ["tests/model/test_fuse.py"], False),
    ("linear: a part's buffer replaced by setattr keeps its group (compiled code then reads a stale product)", LINEAR,
     "if sib is not None and sib.active and name in _PART_BUFFERS and self._buffers.get(name) is not value:",
     "if False:", ["tests/model/test_fuse.py"], False),
    ("linear: the bias dropped from a fused group's eager product", LINEAR, "            out = out + bias.to(out.dtype)\n",
     "            pass\n", ["tests/model/test_fuse.py"], False),
    ("linear: a module alone drops its bias", LINEAR, '    if bias:\n        out = out + mod._buffers["bias"]',
     '    if False:\n        out = out + mod._buffers["bias"]', ["tests/model/test_linear.py"], False),
    ("linear: bias or packed reassigned keeps the old path", LINEAR, '        elif name in ("bias", "packed"):',
     "        elif False:", ["tests/model/test_linear.py", "tests/op/test_packed.py"], False),
    ("fuse: a dissolved group's parts keep the fused path", FUSE, "                    p._choose()  # each part's own GEMV",
     "                    pass  # ", ["tests/model/test_fuse.py"], False),
    ("fuse: an input changed in place between parts not noticed", FUSE,
     "and x._version != self._version:", "and False:", ["tests/model/test_fuse.py"], False),
    ("fuse: a concatenation on another device than the input used", FUSE,
     "        if owner._fused_weight.device != x2.device:", "        if False:", ["tests/model/test_fuse.py"], False),
    ("fuse: a dissolved group cannot be fused again", FUSE,
     "if any(m._siblings is not None and m._siblings.active for _, m in parts)",
     "if any(m._siblings is not None for _, m in parts)", ["tests/model/test_fuse.py"], False),
    ("linear: quantize_model(fuse=True) quantizes a group per linear", CONVERT,
     "        for names in _fusable_groups(model, targets, scales):", "        for names in []:",
     ["tests/model/test_fuse.py"], False),
    # -- tensor parallelism over gloo (CPU) --
    ("tp: an experts shard's up rows taken from its gate rows", TP,
     "t[:, big + rank * i:big + (rank + 1) * i]", "t[:, mine]", ["tests/model/test_tp.py"], False),
    ("tp: an experts shard's output not all-reduced", TP, 'if style in ("rowwise", EXPERTS):', 'if style == "rowwise":',
     ["tests/model/test_tp.py"], False),
    ("tp: an experts shard that cuts a scale group accepted", TP, "    if (i // world) % BLOCK:", "    if False:",
     ["tests/model/test_tp.py"], False),
    ("tp: a loaded experts shard's down columns taken from the first rank's", TP,
     "(slice(None), slice(rank * i // per, (rank + 1) * i // per))", "(slice(None), slice(0, i // per))",
     ["tests/model/test_tp.py"], False),
    # -- the experts' decode path (CPU: the groups and the op's exact path; GPU: the kernel) --
    ("experts: a slot's place counted from the first slot, not its expert's", EXPERTS_FORWARD,
     "place = (pos - first) % nt", "place = pos % nt", ["tests/model/test_experts_kernel.py"], False),
    ("experts: the slots' rows not put back in slot order", EXPERTS_FORWARD, "    at[order] = row\n", "    at = row\n",
     ["tests/model/test_experts_kernel.py"], False),
    ("experts: too few groups for the sentinel's slots", EXPERTS_FORWARD, "n_groups = min(s, e + 1 + s // nt)",
     "n_groups = min(s, e + s // nt)", ["tests/model/test_experts_kernel.py"], False),
    ("experts: invalid slots not masked in the combine", EXPERTS_FORWARD,
     "    c = torch.where(valid.unsqueeze(1), c, torch.zeros((), dtype=c.dtype, device=c.device))\n", "",
     ["tests/model/test_experts_kernel.py"], False),
    ("experts op: a group's rows read from the first group's", EXPERTS_OP,
     "            xr = x if x.shape[0] == 1 else x[rows]", "            xr = x[:n_tok]",
     ["tests/model/test_experts_kernel.py"], False),
    ("experts kernel: a group's x rows not offset", EXPERTS_KERNEL, "x_ptr + tok * x_rs,", "x_ptr,",
     ["tests/model/test_experts_kernel.py"], True),
    ("experts kernel: the expert's scales not offset", EXPERTS_KERNEL, "ws_ptr + rows * ws_rs,", "ws_ptr,",
     ["tests/model/test_experts_kernel.py"], True),
    ("experts kernel: a group without an expert computed with expert 0", EXPERTS_KERNEL, "        if e >= 0:  # (the same",
     "        e = cutlass.max(e, 0)\n        if e >= 0:  # (the same", ["tests/model/test_experts_kernel.py"], True),
    ("experts op: the shared x row read with a row stride", EXPERTS_OP, "0 if shared else x.shape[1] * 2",
     "x.shape[1] * 2", ["tests/model/test_experts_kernel.py"], True),
    # -- the launch shape's 4-warp rule (session 76) --
    ("experts launch shape: the 4-warp rule never taken", EXPERTS_OP,
     "    if n_tok == 8 and g <= FEW_CTAS_GRID and", "    if n_tok == 99 and g <= FEW_CTAS_GRID and",
     ["tests/model/test_experts_launch_shape.py"], False),
    ("experts launch shape: the 4-warp rule at any group size", EXPERTS_OP,
     "    if n_tok == 8 and g <= FEW_CTAS_GRID and", "    if n_tok >= 1 and g <= FEW_CTAS_GRID and",
     ["tests/model/test_experts_launch_shape.py"], False),
    ("experts launch shape: the 4-warp rule from 8 tokens a group up", EXPERTS_OP,
     "    if n_tok == 8 and g <= FEW_CTAS_GRID and", "    if n_tok >= 8 and g <= FEW_CTAS_GRID and",
     ["tests/model/test_experts_launch_shape.py"], False),
    ("experts launch shape: the 4-warp rule on wide grids", EXPERTS_OP,
     "and g <= FEW_CTAS_GRID and", "and g <= 10 ** 6 and", ["tests/model/test_experts_launch_shape.py"], False),
    ("experts launch shape: the 4-warp rule on any build", EXPERTS_OP,
     'and tune.get("threads") == 256 and not tune.get("x_smem"):', ":",
     ["tests/model/test_experts_launch_shape.py"], False),
    # -- the down launch's act (experts_kernel, w4a16's copy of x) --
    ("experts act: up read from the gate's chunk", W4A16, "xup = ldg_v4(xaddr + 2 * self.k)", "xup = ldg_v4(xaddr)",
     ["tests/model/test_experts_act.py"], True),
    # (not a mutant: late's padding reading up past K, session 73, survived on the GPU: the padding's gate is 0,
    # and silu(0) * up is 0 for any finite up, so the predicate on up's load changes nothing a finite row sees)
    ("experts act: a word's two values packed swapped", EXPERTS_KERNEL, "pack_x2(h[2 * i], h[2 * i + 1], self.x_bf16)",
     "pack_x2(h[2 * i + 1], h[2 * i], self.x_bf16)", ["tests/model/test_experts_act.py"], True),
    ("experts act: sigmoid's exp of +gate", EXPERTS_KERNEL, "cute.math.exp(-g[i])", "cute.math.exp(g[i])",
     ["tests/model/test_experts_act.py"], True),
    ("experts act: decode_forward fuses W4A4 experts too", EXPERTS_FORWARD,
     "act = kernel_act(act_fn) if x_scale is None and t <= ACT_IN_KERNEL_MAX_TOKENS else None",
     "act = kernel_act(act_fn) if t <= ACT_IN_KERNEL_MAX_TOKENS else None", ["tests/model/test_experts_act.py"], False),
    # -- the experts' kernel on int64 ids --
    ("experts ids64: the id's high word not checked", EXPERTS_KERNEL, "setp.eq.b32 p, hi, 0;", "setp.eq.b32 p, 0, 0;",
     ["tests/model/test_experts_ids64.py"], True),
    # (a signed compare of the low word is equivalent: a low word >= 2^31 passes it but is a negative int32,
    # which the kernel's `e >= 0` skips as it does -1; session 76 saw it survive once the test's poison held)
    ("experts ids64: decode_groups converts int64 ids at one token", EXPERTS_FORWARD,
     "        if ids.dtype == torch.int64:\n            gid = ids.contiguous()\n        else:\n", "        if True:\n",
     ["tests/model/test_experts_ids64.py"], False),
    # -- the gate/up launch's prefetch of down's bytes (a hint: no result shows it; the PTX and the rule do) --
    ("experts prefetch: the scales' share not asked for", EXPERTS_KERNEL,
     "for pf_ptr, per in ((pf_w_ptr, self.prefetch[0]), (pf_ws_ptr, self.prefetch[1])):",
     "for pf_ptr, per in ((pf_w_ptr, self.prefetch[0]),):",
     ["tests/leaderboard/test_compile.py::test_the_experts_prefetch_build_asks_the_l2_twice_and_the_plain_build_never"],
     False),
    ("experts prefetch: decode_forward never prefetches", EXPERTS_FORWARD,
     "pf = (down[0], down[1]) if t <= PREFETCH_DOWN_MAX_TOKENS else None", "pf = None",
     ["tests/model/test_experts_prefetch.py"], False),
    # -- generate's compiled prefill --
    ("generate: the compiled prefill's prompt length not marked dynamic", GENERATION,
     "            torch._dynamo.maybe_mark_dynamic(ids, 1)\n            torch._dynamo.maybe_mark_dynamic(positions, 0)\n",
     "            pass\n", ["tests/model/test_generate.py"], False),
    ("generate: the compiled prefill fullgraph (raises past the recompile limit)", GENERATION,
     "(torch.compile(_Decoder.prefill, dynamic=None) if prefill",
     "(torch.compile(_Decoder.prefill, fullgraph=True, dynamic=None) if prefill", ["tests/model/test_generate.py"], False),
    ("generate: the compiled prefill marks the caller's ids", GENERATION,
     "            ids = input_ids.clone()", "            ids = input_ids", ["tests/model/test_generate.py"], False),
    ("generate: the compiled prefill makes a fresh cache's tensors", GENERATION,
     "    if compiled and dec.cache_ready():", "    if compiled:", ["tests/model/test_generate.py"], False),
    # -- the ops' autograd kernel (CPU) --
    ("library: a tracked input's result without the raising backward", LIBRARY,
     "        if tracked:\n", "        if False:\n",
     ["tests/op/test_torch_op.py"], False),
    ("library: a tuple result's tensors without the raising backward", LIBRARY,
     "out = tuple(_NoBackward.apply(name, o, *inputs) if o.is_floating_point() else o for o in out)",
     "out = tuple(out)", ["tests/model/test_router.py::test_the_op_with_a_tracked_input_raises_on_backward"], False),
    ("library: plain calls go below autograd (the fast path unused)", LIBRARY,
     "        if plain and not tracked and not (_modes() or _jit() or _functorch()):", "        if False:",
     ["tests/op/test_torch_op.py"], False),
    ("library: the fast autograd kernel not registered", LIBRARY, '        for key in ("AutogradCUDA", "AutogradCPU"):',
     "        for key in ():", ["tests/op/test_torch_op.py"], False),
    # -- the packed layout (CPU) --
    ("packed: a group's scale bytes before its w", PACKED, "out[:, :, 512:].view(", "out[:, :, :64].view(",
     ["tests/op/test_packed.py"], False),
    ("packed: K % 128 not required", PACKED, "in_features % SLICE == 0 and ", "",
     ["tests/op/test_packed.py"], False),
    ("linear: a packed layer's state_dict keeps the packed buffer", LINEAR, "        if not self.packed:\n            return\n",
     "        if True:\n            return\n", ["tests/op/test_packed.py"], False),
    ("linear: a packed layer loads ModelOpt's weight unpacked", LINEAR,
     "            state_dict = self._packed_incoming(", "            state_dict = state_dict or self._packed_incoming(",
     ["tests/op/test_packed.py"], False),
    ("linear: quantize_model(pack=True) packs nothing", CONVERT, "        if pack and not new.packed and", "        if False and",
     ["tests/op/test_packed.py"], False),
    ("modelopt: load_modelopt(pack=True) packs nothing", MODELOPT, "        if pack and new._why_not_packable() is None:",
     "        if False:", ["tests/model/test_modelopt.py"], False),
    ("fuse: packed and unpacked parts fused", FUSE, '            return "one is packed, another not"', "            pass",
     ["tests/op/test_packed.py"], False),
    ("linear: a partial non-strict load into a packed layer is dropped", LINEAR,
     "        if w is None or ws is None:  # one half given (strict=False): the other stays as it is",
     "        if w is None or ws is None:\n            return sd\n        if False:",
     ["tests/op/test_packed.py"], False),
    ("linear: pack() packs a fused group whose part was replaced", LINEAR,
     "        if sib is not None and sib.active and not all(sib._intact(p) for p in sib.parts):",
     "        if False:", ["tests/op/test_packed.py"], False),
    ("packed: a view starting mid-group accepted", PACKED,
     "or w_packed.storage_offset() % (GROUP_ROWS * c):", ":", ["tests/op/test_packed.py"], False),
    ("packed: a view of part of its rows' columns accepted", PACKED,
     "if w_packed.stride() != (c, 1) or", "if", ["tests/op/test_packed.py"], False),
    # -- an audit's findings (CPU) --
    ("modelopt: an NVFP4Linear's scalars deduplicated by storage on save", MODELOPT,
     'ident = ("module", id(mod), leaf) if isinstance(mod, NVFP4Linear) else where', "ident = where",
     ["tests/model/test_modelopt.py"], False),
    ("modelopt: split parts share the fused scalars", MODELOPT, "else t.clone()", "else t",
     ["tests/model/test_modelopt.py"], False),
    ("modelopt: a meta tensor of the model copied into", MODELOPT,
     '        if t.device.type == "meta":  # a copy into it', '        if False:  # a copy into it',
     ["tests/model/test_modelopt.py"], False),
    ("modelopt: tied names' values not compared", MODELOPT,
     "            if not torch.equal(a, b.to(a.device)):", "            if False:",
     ["tests/model/test_modelopt.py"], False),
    ("checkpoint: an index naming a tensor its shard lacks", CHECKPOINT, "                if named - set(held):",
     "                if False:", ["tests/model/test_modelopt.py"], False),
    ("checkpoint: a shard's tensor the index omits", CHECKPOINT, "                if set(held) - named:",
     "                if False:", ["tests/model/test_modelopt.py"], False),
    ("modelopt: a model's module name in exclude_modules matched as a suffix", MODELOPT,
     "pats = [p for p in self.exclude_modules if p == name or p not in modules]", "pats = self.exclude_modules",
     ["tests/model/test_modelopt.py"], False),
    ("linear: skip patterns and input_scales that match nothing not warned", CONVERT,
     "    _warn_unmatched(model, tuple(p for p in skip if p not in skip_used), scales, targets)\n", "",
     ["tests/model/test_linear.py"], False),
    ("linear: input_scale numbers unchecked", LINEAR, "        if not math.isfinite(v) or v <= 0:", "        if False:",
     ["tests/model/test_linear.py"], False),
    ("linear: quantize_model places each module as it builds it", CONVERT,
     "                new = done[id(lin)] = NVFP4Linear.from_linear(lin, mode=mode, input_scale=scales.get(name))\n",
     "                new = done[id(lin)] = NVFP4Linear.from_linear(lin, mode=mode, input_scale=scales.get(name))\n"
     "                _set_submodule(model, name, new)\n", ["tests/model/test_linear.py"], False),
    ("linear: a format tensor of another dtype loaded by value", LINEAR,
     "        if not bad and not fp4:\n            return state_dict", "        if True:\n            return state_dict",
     ["tests/model/test_linear.py"], False),
    # -- mode "w4a4" through the W4A16 op (CPU) --
    ("linear: w4a4 never takes the W4A16 route", LINEAR,
     "    if W4A4_VIA_W4A16_FROM is not None and x2.shape[0] >= W4A4_VIA_W4A16_FROM:", "    if False:",
     ["tests/model/test_linear.py"], False),
    ("linear: the W4A16 route on x itself, not its quantized values", LINEAR,
     '        xd = quantize_dequantized(x2, b["_inv_input_scale"])',
     '        xd = quantize_dequantized(x2, b["_inv_input_scale"]) * 0 + x2 * b["_inv_input_scale"].to(x2.dtype)',
     ["tests/model/test_linear.py"], False),
    ("quant: dequantized values divided by the global scale", QUANT,
     "    return dequantize(*quantize_reference(x, global_scale)).to(x.dtype)",
     "    return (dequantize(*quantize_reference(x, global_scale)) / global_scale).to(x.dtype)",
     ["tests/op/test_quantize.py"], False),
    ("quant: e2m1 decode of zero rows", QUANT, "reshape(u.shape[0], 2 * u.shape[1])", "reshape(u.shape[0], -1)",
     ["tests/op/test_quantize.py"], False),
    # -- W4A16 and quantize kernels (GPU) --
    ("w4a16: bf16 decode drops a magnitude bit", DECODE, '            body.append("and.b32 a, a, 0x01C001C0;")',
     '            body.append("and.b32 a, a, 0x01C000C0;")', ["tests/op/test_w4a16_kernel.py"], True),
    ("w4a16: bf16 scale off by 2", DECODE, '"mul.rn.f32 f, f, 0f7B000000;", "cvt.rn.bf16x2.f32 p, f, f;"',
     '"mul.rn.f32 f, f, 0f7A800000;", "cvt.rn.bf16x2.f32 p, f, f;"', ["tests/op/test_w4a16_kernel.py"], True),
    ("w4a16 dec: block 1 takes block 0's scale", DECODE, '        p = "p0" if w < 2 else "p1"', '        p = "p0"',
     ["tests/op/test_w4a16_kernel.py"], True),
    ("w4a16 dec: pairs 2 and 3 from the unshifted word", DECODE, 'src = q if i < 2 else "w8"', "src = q",
     ["tests/op/test_w4a16_kernel.py"], True),
    ("w4a16 dec: the chunk decode drops a magnitude bit", DECODE, 'f"and.b32 {o}, t, 0x81C081C0;"',
     'f"and.b32 {o}, t, 0x81C001C0;"', ["tests/op/test_w4a16_kernel.py"], True),
    ("w4a16 dec: block 1 takes block 0's decode", W4A16, "return memo[gr][8 * blk: 8 * blk + 8]",
     "return memo[gr][0:8]", ["tests/op/test_w4a16_kernel.py"], True),
    ("w4a16 late: block 1's sums take block 0's scale", W4A16, "a_g = fma_f32(d[1][1], s1,", "a_g = fma_f32(d[1][1], s0,",
     ["tests/op/test_w4a16_kernel.py"], True),
    ("w4a16 late: a row's chunks summed over two lanes only", W4A16, "for off in (1, 2):", "for off in (1,):",
     ["tests/op/test_w4a16_kernel.py"], True),
    ("w4a16 late: bf16 x copied without its 2^72", W4A16, "xv = [mul_bf16x2(xe, X_LATE_BF16X2) for xe in xv]",
     "xv = list(xv)", ["tests/op/test_w4a16_kernel.py"], True),
    ("w4a16 late: lanes read the block of the other column", W4A16, "own0 = cutlass.Int32(g == 2 * t)\n",
     "own0 = cutlass.Int32(g == 2 * t + 1)\n", ["tests/op/test_w4a16_kernel.py"], True),
    ("w4a16 late: the padded row's zeros not written", W4A16, "xv = ldg_v4_if(xaddr, cutlass.Int32(xc < per_row))",
     "xv = ldg_v4_if(xaddr, cutlass.Int32(1))", ["tests/op/test_w4a16_kernel.py"], True),
    ("w4a16: the copy of x stores only a batch's first copy", W4A16, "for xtok, xj, xv, xup in xgot:",
     "for xtok, xj, xv, xup in xgot[:1]:", ["tests/op/test_w4a16_kernel.py"], True),
    ("w4a16: the copy of x drops a thread's last copy", W4A16,
     "for xit in cutlass.range_constexpr(xb0, min(xb0 + self.xbatch, iters)):",
     "for xit in cutlass.range_constexpr(xb0, min(xb0 + self.xbatch, iters - 1)):", ["tests/op/test_w4a16_kernel.py"], True),
    ("w4a16 across: the next tile's slices from this tile's rows", W4A16, "row0 + nx * (row_next - row0), *ptrs))",
     "row0, *ptrs))", ["tests/op/test_w4a16_kernel.py"], True),
    ("w4a16 across: past a tile's end its own slices again", W4A16, "wid + (i + D - nx * my_slices) * W",
     "wid + (i + D - nx * (my_slices - 1)) * W", ["tests/op/test_w4a16_kernel.py"], True),
    ("w4a16 xpair: x's pairs swapped at the copy", W4A16, "xp26, xp37 = pair_halves(xv[1], xv[3])",
     "xp26, xp37 = pair_halves(xv[3], xv[1])", ["tests/op/test_w4a16_kernel.py"], True),
    ("w4a16: w_a stores group 2u + 1's rows as 2u's", W4A16, "row = row0 + (2 * u + r // 2) * 8 + ln // 4",
     "row = row0 + (2 * u) * 8 + ln // 4", ["tests/op/test_w4a16_kernel.py"], True),
    ("w4a16: the second accumulator chain dropped", W4A16, "part = [part[j] + acc[u][a][1][j] for j in range(4)]",
     "part = [part[j] for j in range(4)]", ["tests/op/test_w4a16_kernel.py"], True),
    ("w4a16: K % 128 == 64 tail not zeroed", W4A16, "            live = cutlass.Int32(chunk < self.k // 32)\n",
     "            live = cutlass.Int32(1)\n", ["tests/op/test_w4a16_kernel.py"], True),
    ("w4a16 packed: scales read at the group's w", W4A16, "ldg_u16(at + cutlass.Int64(512 + g * 8 + t * 2))",
     "ldg_u16(at + cutlass.Int64(g * 8 + t * 2))", ["tests/op/test_packed.py::test_gpu_cancelling_sums_and_fp16_out_without_alpha"], True),
    ("w4a16 packed: groups a row apart", W4A16, "at = w_ptr + cutlass.Int64(row0 + 8 * gr) * w_rs",
     "at = w_ptr + cutlass.Int64(row0 + gr) * w_rs", ["tests/op/test_packed.py::test_gpu_cancelling_sums_and_fp16_out_without_alpha"], True),
    ("experts: the kernel reads the experts' rows in the wrong order", EXPERTS_FORWARD,
     "dequant_kernel.dequantize_cuda(w.reshape(p * n, half),", "dequant_kernel.dequantize_cuda(w.transpose(0, 1).reshape(p * n, half),",
     ["tests/model/test_experts.py::test_the_fallbacks_weights_through_the_dequantize_kernel_are_the_torch_ops_bits"],
     False),
    ("router op: renormalisation dropped on the CPU", "nvfp4_gemv/router_op.py",
     "    if norm:\n        top = top / top.sum", "    if False:\n        top = top / top.sum",
     ["tests/model/test_router.py::test_the_cpu_path_is_transformers_router_bit_for_bit"], False),
    ("TopKRouter: the op where autograd tracks the weight", "nvfp4_gemv/model/router.py",
     "if torch.is_grad_enabled() and (w.requires_grad or x.requires_grad):", "if False:",
     ["tests/model/test_router.py::test_gradients_flow_where_autograd_tracks_the_weight"], False),
    ("quantize kernel: 0.75 ties away from even", QKERN, "(0.75, True), (1.25", "(0.75, False), (1.25",
     ["tests/op/test_quantize_kernel.py"], True),
    ("quantize kernel: NaN dropped from amax", QKERN, '"max.NaN.f32 $0, $1, $2;"', '"max.f32 $0, $1, $2;"',
     ["tests/op/test_quantize_kernel.py"], True),
    ("quantize kernel dequantized: x's sign dropped", QKERN, '"and.b32 s, s, 0x80000000;"', '"and.b32 s, s, 0;"',
     ["tests/op/test_quantize_kernel.py"], True),
    ("quantize kernel dequantized: 1.75 ties down", QKERN, '("3FE00000", True, "3F000000")',
     '("3FE00000", False, "3F000000")', ["tests/op/test_quantize_kernel.py"], True),
    ("quantize kernel dequantized: pairs stored high half first", QKERN, '"mov.b32 $0, {h0, h1};"',
     '"mov.b32 $0, {h1, h0};"', ["tests/op/test_quantize_kernel.py"], True),
    ("quantize kernel dequantized: the last step 1 not 2", QKERN, '("40A00000", False, "40000000")',
     '("40A00000", False, "3F800000")', ["tests/op/test_quantize_kernel.py"], True),
    ("router kernel: ties to the higher expert", RKERN, '"sub.u32 p, 0xFFFF, $3;"', '"mov.b32 p, $3;"',
     ["tests/op/test_router_kernel.py"], True),
    ("router kernel: -0 keyed below +0", RKERN, '"setp.eq.u32 mz, b, 0x8000;", "selp.b32 c, 0, b, mz;",',
     '"setp.eq.u32 mz, b, 0x8000;", "mov.b32 c, b;",', ["tests/op/test_router_kernel.py"], True),
    ("router kernel: renormalisation dropped", RKERN, "if cutlass.const_expr(self.norm):",
     "if cutlass.const_expr(False):", ["tests/op/test_router_kernel.py"], True),
    ("router kernel: the first CTA to finish takes the top k", RKERN, "if done == self.e // WARPS - 1:",
     "if done == 0:", ["tests/op/test_router_kernel.py"], True),
    ("router kernel cluster: CTA 1 takes the top k from its own shared memory", RKERN, "            if bidx == 0:\n",
     "            if bidx == 1:\n", ["tests/op/test_router_kernel.py"], True),
    ("router kernel cluster: each key stored in the storing CTA's own shared memory", RKERN,
     "st_cluster_u32(s_keys + 4 * e, 0, key)", "st_cluster_u32(s_keys + 4 * e, bidx, key)",
     ["tests/op/test_router_kernel.py"], True),
    ("router kernel: fp16 keys decoded as bf16", RKERN, 'body += ["shl.b32 $0, o, 16;"] if bf16 else',
     'body += ["shl.b32 $0, o, 16;"] if True else', ["tests/op/test_router_kernel.py"], True),
    ("dequantize kernel pair: the second block takes the first's scale", DQKERN,
     "sj = s8 if j == 0 else s8 >> 8", "sj = s8", ["tests/op/test_dequant_kernel.py"], True),
    ("dequantize kernel: pairs (4,5) and (6,7) swapped", DQKERN, '"prmt.b32 $2, a, b, 0x7632;", "prmt.b32 $3, c, d, 0x7632;"',
     '"prmt.b32 $2, c, d, 0x7632;", "prmt.b32 $3, a, b, 0x7632;"', ["tests/op/test_dequant_kernel.py"], True),
    ("dequantize kernel: bf16 not scaled back by 2^7", DQKERN, '("mul.rn.bf16x2", "0x43004300")',
     '("mul.rn.bf16x2", "0x3F803F80")', ["tests/op/test_dequant_kernel.py"], True),
    ("dequantize kernel packed: scales read at the piece's codes", DQKERN,
     "at_s = base + GROUP_ROWS * SLICE // 2 + cutlass.Int64(i)", "at_s = base + cutlass.Int64(i)",
     ["tests/op/test_dequant_kernel.py"], True),
    ("dequantize kernel: scale row stride ignored", DQKERN, "at_s = ws_ptr + cutlass.Int64(r) * ws_rs",
     "at_s = ws_ptr + cutlass.Int64(r) * (self.k // BLOCK)", ["tests/op/test_dequant_kernel.py"], True),
]


def sites(old, new):
    """A mutant's (old, new) replacements: one, or tuples of them (each text once in the file)."""
    return list(zip(old, new)) if isinstance(old, tuple) else [(old, new)]


def stale_mutants():
    """The mutants whose texts do not each occur exactly once in their file (tests/tools/test_mutants_list.py)."""
    bad = []
    for m in MUTANTS:
        text = open(os.path.join(ROOT, m[1])).read()
        bad += [(m[0], text.count(old)) for old, _ in sites(m[2], m[3])]
    return [b for b in bad if b[1] != 1]


def tree_files():
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if os.path.isfile(os.path.join(ROOT, f))]


def run_mutant(name, path, old, new, tests, files):
    with tempfile.TemporaryDirectory(prefix="nvfp4_mutant_") as tmp:
        for f in files:
            os.makedirs(os.path.dirname(os.path.join(tmp, f)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), os.path.join(tmp, f))
        target = os.path.join(tmp, path)
        with open(target) as f:
            text = f.read()
        for o, n in sites(old, new):
            if text.count(o) != 1:
                return f"BAD MUTANT: the text occurs {text.count(o)} times in {path}"
            text = text.replace(o, n)
        with open(target, "w") as f:
            f.write(text)
        if path in STITCHED and name != "packaging: submission.py stale":
            subprocess.run([sys.executable, "tools/gen_submission.py"], cwd=tmp, check=True)
        env = dict(os.environ, PYTHONPATH=tmp, PYTHONDONTWRITEBYTECODE="1")
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests], cwd=tmp,
                              env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode in (1,):
            return "killed"
        if proc.returncode == 0:
            skipped = "skipped" in proc.stdout.splitlines()[-1] if proc.stdout else False
            return "SURVIVED" + (" (tests skipped: needs a GPU?)" if skipped else "")
        return f"ERROR (pytest exit {proc.returncode}): {proc.stdout[-300:]}"


def main():
    p = argparse.ArgumentParser()
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--cpu", action="store_true")
    g.add_argument("--gpu", action="store_true")
    g.add_argument("--only", action="append", help="a mutant's name (repeat for more)")
    p.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1)")
    args = p.parse_args()
    unknown = sorted(set(args.only or ()) - {m[0] for m in MUTANTS})
    if unknown:
        raise SystemExit(f"--only: no mutant named {unknown}; names: {[m[0] for m in MUTANTS]}")
    chosen = [m for m in MUTANTS if (args.only and m[0] in args.only) or (args.cpu and not m[5])
              or (args.gpu and m[5])]
    if not chosen:
        raise SystemExit(f"no mutant selected; names: {[m[0] for m in MUTANTS]}")
    files = tree_files()

    def one(m):
        name, path, old, new, tests, _ = m
        t0 = time.time()
        result = run_mutant(name, path, old, new, tests, files)
        print(f"{result:9s} {name}  ({time.time() - t0:.0f} s)", flush=True)
        return name, " ".join(t.replace("tests/", "") for t in tests), result

    # each mutant is a subprocess in its own copy of the tree, so threads are enough; rows keep the list's order
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        rows = list(pool.map(one, chosen))
    print("\n| mutant | tests run | result |\n|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")
    survived = [r for r in rows if r[2] != "killed"]
    print(f"\nmutants: {len(rows)}, killed: {len(rows) - len(survived)}, not killed: {len(survived)}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())

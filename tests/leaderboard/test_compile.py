"""The CuTe DSL kernel compiles for Hopper (sm_90a) and Blackwell (sm_100a) without a GPU.

Each compile runs in a subprocess (a compiler crash must not take pytest down); the cubin that comes back
must be a real ELF with the kernel in it."""

import json
import re
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_check(arch, k, tmp_path, *extra, env=None):
    """``tests/compile_check.py``'s JSON summary for one build (DeprecationWarnings are errors)."""
    cmd = [sys.executable, "-W", "error::DeprecationWarning", os.path.join(HERE, "compile_check.py"), arch, str(k),
           "--dump", str(tmp_path), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_op_build(info, spills=False):
    assert info["elf"] and info["bytes"] > 4096 and info["launch"] == "tvm-ffi", info
    assert info["ptx_bytes"] > 10000 and info["fp4_cvt"] == [], info
    assert info["lds_before_bar"] == 0, info
    assert (info["frame_bytes"] > 0) == spills, info  # registers spilled to local memory, or not


@pytest.mark.parametrize("arch,k,blocked", [("sm_90a", 7168, False), ("sm_100a", 7168, False),
                                            ("sm_90a", 256, True), ("sm_100a", 16384, True),
                                            ("sm_90a", 64, False)])
def test_kernel_compiles_without_gpu(arch, k, blocked, tmp_path):
    info = compile_check(arch, k, tmp_path, *(["--blocked"] if blocked else []))
    assert info["elf"] and info["bytes"] > 4096
    with open(info["cubin"], "rb") as f:
        cubin = f.read()
    assert cubin[:4] == b"\x7fELF" and b"kernel_cutlass_kernel" in cubin
    # the fp4 values are decoded with integer ops, never the e2m1 conversion (sm_100 only): read in the PTX
    assert info["ptx_bytes"] > 10000 and info["fp4_cvt"] == [], info
    assert info["lds_before_bar"] == 0, info
    # no registers spilled to local memory (DSL 4.8 did at K <= 2048 under 3 CTAs' register cap)
    assert info["frame_bytes"] == 0, info
    # a fast launch path: TVM-FFI where apache-tvm-ffi is installed (else each call pays the DSL's conversion)
    assert info["launch"] == "tvm-ffi", info


@pytest.mark.parametrize("arch,k,tune", [("sm_90a", 7168, "batch=7,group=32,min_blocks=2"),
                                          ("sm_90a", 16384, "bulk=1"), ("sm_100a", 7168, "bulk=1"),
                                          ("sm_90a", 7168, "bulk=1,dynamic=1"), ("sm_100a", 8192, "bulk=1,dynamic=1"),
                                          ("sm_90a", 7168, "split=7,min_blocks=6"),
                                          ("sm_100a", 4096, "split=2,rows=2,min_blocks=4"),
                                          ("sm_90a", 2048, "min_blocks=3,sf_wide=1"),
                                          ("sm_100a", 1024, "min_blocks=3,sf_wide=1"),
                                          ("sm_90a", 3072, "sf_wide=1"), ("sm_90a", 4096, "batch=4,min_blocks=3,sf_wide=1"),
                                          ("sm_100a", 6144, "batch=4,min_blocks=3,sf_wide=1")])
def test_latency_split_bulk_and_wide_scale_configs_compile_without_gpu(arch, k, tune, tmp_path):
    info = compile_check(arch, k, tmp_path, "--tune", tune)
    assert info["elf"] and info["launch"] == "tvm-ffi", info
    assert info["lds_before_bar"] == 0 and info["frame_bytes"] == 0, info


def test_without_tvm_ffi_the_leaderboards_dsl_keeps_the_direct_launcher(tmp_path):
    """The leaderboard's image may lack apache-tvm-ffi: on DSL 4.3 our ctypes launcher must still match
    (on later versions it does not, and the slow path warns)."""
    import importlib.metadata as md

    info = compile_check("sm_100a", 7168, tmp_path, env=dict(os.environ, NVFP4_GEMV_LAUNCH="direct"))
    expected = "direct" if md.version("nvidia-cutlass-dsl").startswith("4.3.") else "dsl"
    assert info["launch"] == expected, info


@pytest.mark.parametrize("arch,k,tokens,blocked", [("sm_90a", 7168, 1, False), ("sm_90a", 16384, 8, True),
                                                   ("sm_100a", 2048, 16, False), ("sm_100a", 4096, 2, True)])
def test_op_kernel_compiles_without_gpu(arch, k, tokens, blocked, tmp_path):
    # known: the dp4a kernel spills at 16 tokens (1-2.5 KB a thread); the op sends N >= 5 to the tensor-core
    # kernel, except for weights of fewer than 8 x SMs rows
    assert_op_build(compile_check(arch, k, tmp_path, "--tokens", str(tokens), *(["--blocked"] if blocked else [])),
                    spills=tokens == 16)


@pytest.mark.parametrize("arch,k,tokens,groups,extra", [("sm_90a", 16384, 16, 7, ()), ("sm_90a", 7168, 4, 4, ("--blocked",)),
                                                        ("sm_100a", 2048, 9, 8, ()), ("sm_100a", 64, 2, 1, ("--blocked",)),
                                                        ("sm_90a", 64, 4, 1, ()), ("sm_90a", 1024, 2, 2, ()),
                                                        ("sm_90a", 16384, 16, 7, ("--tune", "stages=4")),
                                                        ("sm_100a", 7168, 3, 4, ("--tune", "stages=2"))])
def test_op_tensor_core_kernel_compiles_without_gpu(arch, k, tokens, groups, extra, tmp_path):
    """Blocked scales, and the cp.async variant (``stages``), among the builds."""
    assert_op_build(compile_check(arch, k, tmp_path, "--tokens", str(tokens), "--mma", str(groups), *extra))


@pytest.mark.parametrize("arch,k,tokens,tune,blocked", [("sm_90a", 16384, 2, "ctas=2", False),
                                                        ("sm_90a", 7168, 4, "ctas=1", True),
                                                        ("sm_100a", 4096, 1, "ctas=2", False),
                                                        ("sm_100a", 7168, 3, "ctas=2", True),
                                                        ("sm_90a", 16384, 3, "ctas=1,rt=4", False),
                                                        ("sm_100a", 16384, 4, "ctas=1,rt=4", True)])
def test_op_bulk_kernel_compiles_without_gpu(arch, k, tokens, tune, blocked, tmp_path):
    """The bulk-copy dp4a kernel as the op configures it (``op_route.bulk_tuning``; 4 tokens at K = 7168 only as a
    tuning); ``--blocked`` blocks x's scales (w's stay plain)."""
    assert_op_build(compile_check(arch, k, tmp_path, "--tokens", str(tokens), "--tune", f"bulk=1,{tune}",
                                  *(["--blocked"] if blocked else [])))


@pytest.mark.parametrize("arch,k,tokens,groups,extra", [
    # the op's one-token tunings of many rows (x in shared memory, late: 4 or 5 CTAs a SM with across, or 2
    # where 4 do not fit)
    ("sm_90a", 16384, 1, 2, ("--tune", "threads=256,ctas=4,w_a=1,dec=1,xpair=1,late=1,across=1")),
    # known: DSL 4.8.1 spills 8 bytes a thread in the five-CTA build (4.3.5: none; not timed on 4.8.1)
    ("sm_90a", 8192, 1, 2, ("--tune", "threads=256,ctas=5,w_a=1,dec=1,xpair=1,late=1,across=1")),
    ("sm_90a", 28672, 1, 4, ("--tune", "threads=256,ctas=2,w_a=1,dec=1,xpair=1,late=1")),
    # K 2048..6144 on many rows: 4-warp CTAs, 8 a SM (K % 128 == 64 for sm_100a)
    ("sm_90a", 6144, 1, 2, ("--tune", "threads=128,ctas=8,w_a=1,dec=1,xpair=1,late=1,across=1,even=1")),
    ("sm_100a", 4160, 1, 2, ("--f16", "--tune", "threads=128,ctas=8,w_a=1,dec=1,xpair=1,late=1,across=1,even=1")),
    ("sm_100a", 4096, 1, 2, ("--f16", "--tune", "threads=256,ctas=4,w_a=1,dec=1,xpair=1,late=1,across=1")),
    # 2..4 tokens on many rows where N x K <= 16384: x in shared memory, 4 CTAs of 2 groups (the copy of x in
    # batches of 8; K % 128 == 64 for sm_100a)
    ("sm_90a", 4096, 4, 2, ("--tune", "threads=256,ctas=4,w_a=1,x_smem=1,dec=1,xpair=1,across=1")),
    ("sm_100a", 4160, 3, 2, ("--f16", "--tune", "threads=256,ctas=4,w_a=1,x_smem=1,dec=1,xpair=1,across=1")),
    # 1..4 tokens on fewer rows: 16 warps, 2 CTAs of 2 groups, x in shared memory (late at one token); 2 tokens
    # on many rows and long K: 2 CTAs of 4 groups
    ("sm_90a", 14336, 1, 2, ("--tune", "threads=512,ctas=2,w_a=1,x_smem=1,dec=1,xpair=1,late=1,across=1")),
    ("sm_100a", 4160, 3, 2, ("--f16", "--blocked", "--tune", "threads=512,ctas=2,w_a=1,x_smem=1,dec=1,xpair=1,across=1")),
    ("sm_90a", 16384, 2, 4, ("--tune", "threads=256,ctas=2,w_a=1,x_smem=1,dec=1,xpair=1,across=1")),
    # 5..8 tokens where two 16-warp CTAs' x fit (K = 6144 at 8 tokens); 9..16 tokens on many rows with x in
    # shared memory, one CTA of 16 warps and 4 groups
    ("sm_90a", 6144, 8, 2, ("--tune", "threads=512,ctas=2,w_a=1,x_smem=1,dec=1,xpair=1,across=1")),
    ("sm_100a", 4160, 5, 2, ("--f16", "--blocked", "--tune", "threads=512,ctas=2,w_a=1,x_smem=1,dec=1,xpair=1,across=1")),
    ("sm_90a", 4096, 16, 4, ("--tune", "threads=512,x_smem=1,across=1")),
    ("sm_100a", 4160, 9, 4, ("--f16", "--tune", "threads=512,x_smem=1,across=1")),
    # 17..32 tokens with x in shared memory at K = 2048
    ("sm_90a", 2048, 32, 4, ("--blocked", "--tune", "threads=512,x_smem=1,across=1")),
    ("sm_100a", 2048, 17, 2, ("--f16", "--tune", "threads=512,x_smem=1,across=1")),
    ("sm_90a", 4096, 8, 8, ("--tune", "threads=256,x_smem=0,w_a=1,across=1")),
    ("sm_100a", 7168, 2, 4, ("--f16", "--tune", "threads=256,x_smem=0,w_a=1,across=1")),
    # 16 warps of 4 groups (9..16 tokens); known: DSL 4.8.1 keeps 24 bytes a thread on the stack (4.3.5: none)
    ("sm_90a", 14336, 16, 4, ("--f16", "--blocked", "--tune", "threads=512,x_smem=0,across=1")),
    ("sm_90a", 28672, 32, 8, ("--tune", "threads=256,x_smem=0,across=1")),
    # K % 128 == 64, two A tiles; known: DSL 4.8.1 keeps 24 bytes a thread here for sm_100a (4.3.5: none)
    ("sm_100a", 4160, 32, 7, ("--tune", "threads=256,x_smem=0,across=1")),
    ("sm_100a", 64, 3, 2, ("--f16", "--tune", "threads=256,x_smem=0,w_a=1,across=1"))])
def test_w4a16_kernel_compiles_without_gpu_and_without_spills(arch, k, tokens, groups, extra, tmp_path):
    """The W4A16 kernel as the op routes it (``w4a16_route.default_tuning``, ``w4a16_groups``' caps): no stack frame
    (the one-token builds of many rows included: with ``dec`` and ``xpair`` they no longer keep an epilogue
    address on the stack, as the build without them did at 128 registers a thread; five CTAs a SM hold a
    thread to 51 registers)."""
    info = compile_check(arch, k, tmp_path, "--tokens", str(tokens), "--w4a16", str(groups), *extra)
    assert info["elf"] and info["launch"] == "tvm-ffi" and info["fp4_cvt"] == [], info
    new_dsl = not info["dsl"].startswith("4.3.")
    # DSL 4.8.1 keeps a few bytes a thread on the stack in three builds (measured: 24, 24 and 8; 4.3.5: none)
    known = 0
    if new_dsl:
        wide = (tokens == 32 and arch == "sm_100a") or "threads=512,x_smem=0" in extra[-1]
        known = 24 if wide else 8 if "ctas=5" in extra[-1] else 0
    assert info["lds_before_bar"] == 0 and info["frame_bytes"] <= known, info


ONE_TOKEN = "threads=256,ctas=4,w_a=1,dec=1,xpair=1,late=1"


@pytest.mark.parametrize("arch,k,tokens,groups,tune", [
    ("sm_90a", 4096, 1, 2, ONE_TOKEN + ",across=1,probe=1"), ("sm_100a", 4096, 1, 2, ONE_TOKEN + ",across=1,probe=3"),
    ("sm_90a", 16384, 1, 2, ONE_TOKEN + ",bulk=2,span=4"), ("sm_100a", 6144, 2, 2, ONE_TOKEN[:-7] + ",x_smem=1,bulk=3")])
def test_w4a16_measuring_builds_compile_without_gpu(arch, k, tokens, groups, tune, tmp_path):
    """The sweeps' measuring builds, never routed, still build on both archs (and in CI on both DSL versions):
    ``probe`` 1 and 3 (the loads kept, the arithmetic dropped; w's loads alone), ``bulk`` (stages of w and its
    scales by cp.async.bulk on mbarriers)."""
    info = compile_check(arch, k, tmp_path, "--tokens", str(tokens), "--w4a16", str(groups), "--tune", tune)
    assert info["elf"] and info["launch"] == "tvm-ffi" and info["fp4_cvt"] == [], info


def _experts_builds():
    """The experts' kernel builds Qwen3-30B-A3B's (E 128, top 8, H 2048, I 768) and Mixtral's (E 8, top 2, H 4096,
    I 14336) decode takes at 1, 4, 16 and 64 tokens (gate/up and down), as ``experts_op.launch_shape`` routes
    them on 132 SMs."""
    from nvfp4_gemv.experts_op import launch_shape
    from nvfp4_gemv.model.experts_forward import busy_groups, group_size

    builds = set()
    for e, top, h, i in ((128, 8, 2048, 768), (8, 2, 4096, 14336)):
        for t in (1, 4, 16, 64):
            nt = group_size(t, top, e)
            for m, k in ((2 * i, h), (h, i)):
                r, _ = launch_shape(nt, m, k, 132, busy_groups(t, top, e, nt))
                builds.add((k, nt, r.groups, ",".join(f"{a}={b}" for a, b in r.tuning)))
    return sorted(builds)


@pytest.mark.parametrize("k,tokens,groups,tune", _experts_builds())
def test_experts_kernel_compiles_without_gpu_and_without_spills(k, tokens, groups, tune, tmp_path):
    """The grouped build (a second grid dimension, the expert's offsets read first) keeps the W4A16 kernel's
    register budget: no stack frame, no shared-memory read before the first barrier."""
    info = compile_check("sm_90a", k, tmp_path, "--tokens", str(tokens), "--w4a16", str(groups), "--experts",
                         "--tune", tune)
    assert info["elf"] and info["fp4_cvt"] == [] and info["frame_bytes"] == 0 and info["lds_before_bar"] == 0, info


@pytest.mark.parametrize("arch,k,extra", [("sm_90a", 16384, ()), ("sm_100a", 4096, ("--f16",)),
                                          ("sm_90a", 16384, ("--dequantized",)),
                                          ("sm_100a", 4096, ("--dequantized", "--f16"))])
def test_quantize_kernel_compiles_without_gpu(arch, k, extra, tmp_path):
    """No e2m1 conversion (sm_90a has none): the codes (or, ``dequantized``, their values) come from
    comparisons; no stack frame."""
    info = compile_check(arch, k, tmp_path, "--quantize", *extra)
    assert info["elf"] and info["launch"] == "tvm-ffi" and info["fp4_cvt"] == [] and info["frame_bytes"] == 0, info



@pytest.mark.parametrize("arch,k,extra", [("sm_90a", 4096, ("--dequantize", "plain")),
                                          ("sm_100a", 14336, ("--dequantize", "packed", "--f16")),
                                          ("sm_90a", 14336, ("--dequantize", "plain", "--pair")),
                                          ("sm_100a", 4096, ("--dequantize", "packed", "--pair", "--f16")),
                                          ("sm_90a", 2048, ("--router", "128,8")),
                                          ("sm_100a", 8192, ("--router", "1024,32", "--f16"))])
def test_dequantize_and_router_kernels_compile_without_gpu(arch, k, extra, tmp_path):
    """W4A16's many-token dequantizer and the MoE router's kernel (the largest router build: 32 rounds over
    32 keys a lane): no e2m1 conversion, no stack frame, the fast launch path."""
    info = compile_check(arch, k, tmp_path, *extra)
    assert info["elf"] and info["launch"] == "tvm-ffi" and info["fp4_cvt"] == [] and info["frame_bytes"] == 0, info

@pytest.mark.parametrize("arch, k, tune", [
    ("sm_90a", 14336, "ctas=4,dec=1,late=1,threads=256,w_a=1,xpair=1,across=1"),  # Mixtral-8x7B's, one token
    ("sm_90a", 768, "ctas=4,dec=1,late=1,threads=256,w_a=1,xpair=1")])  # Qwen3-30B-A3B's
def test_the_experts_act_build_compiles_without_a_stack_frame(arch, k, tune, tmp_path):
    """The down launch with ``silu(gate) * up`` in its copy of x, on the route one token takes: gate and up in
    flight take twice a plain copy's registers, so ``act_tuning`` keeps 4 copies a thread in flight (at 8
    Mixtral's build spilled 48 bytes a thread)."""
    info = compile_check(arch, k, tmp_path, "--tokens", "1", "--w4a16", "2", "--experts", "--act", "--tune", tune)
    assert info["elf"] and info["launch"] == "tvm-ffi" and info["fp4_cvt"] == [] and info["frame_bytes"] == 0, info



@pytest.mark.parametrize("prefetch", [None, "786432,98304"])
def test_the_experts_prefetch_build_asks_the_l2_twice_and_the_plain_build_never(prefetch, tmp_path):
    """The gate/up launch that prefetches the down launch's bytes (Qwen3-30B-A3B's, one token): one bulk L2
    prefetch of the weight's share and one of its scales' (thread 0 of each CTA), no stack frame; without
    ``prefetch`` none (that build's code is the plain experts kernel's)."""
    extra = ("--prefetch", prefetch) if prefetch else ()
    info = compile_check("sm_90a", 2048, tmp_path, "--tokens", "1", "--w4a16", "2", "--experts", "--tune",
                         "across=1,ctas=8,dec=1,even=1,late=1,threads=128,w_a=1,xpair=1", *extra)
    assert info["elf"] and info["launch"] == "tvm-ffi" and info["frame_bytes"] == 0, info
    assert info["prefetch_l2"] == (2 if prefetch else 0), info



@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("launch, k, extra, tune", [
    ("gate/up", 2048, (), "across=1,ctas=8,dec=1,even=1,late=1,threads=128,w_a=1,xpair=1"),  # as decode_forward's
    ("gate/up, prefetching", 2048, ("--prefetch", "786432,98304"),  # (the op's option, off in decode_forward)
     "across=1,ctas=8,dec=1,even=1,late=1,threads=128,w_a=1,xpair=1"),
    ("down, act", 768, ("--act",), "ctas=4,dec=1,late=1,threads=256,w_a=1,xpair=1")])
def test_the_experts_int64_ids_builds_compile_without_a_stack_frame(arch, launch, k, extra, tune, tmp_path):
    """Qwen3-30B-A3B's one-token builds reading a router's int64 ids (128 experts): the gate/up launch (with and
    without the down prefetch) and the down launch making ``silu(gate) * up``, as ``decode_forward`` launches
    them at one token."""
    info = compile_check(arch, k, tmp_path, "--tokens", "1", "--w4a16", "2", "--experts", "--ids64", "128",
                         *extra, "--tune", tune)
    assert info["elf"] and info["launch"] == "tvm-ffi" and info["frame_bytes"] == 0, info


def _nvdisasm():
    import glob

    try:
        import nvidia
    except ImportError:
        return None
    found = [p for d in nvidia.__path__ for p in glob.glob(os.path.join(d, "*", "bin", "nvdisasm"))]
    return found[0] if found else None


@pytest.mark.parametrize("arch,k,extra", [("sm_90a", 16384, ("--tune", "bulk=1")),
                                          ("sm_100a", 7168, ("--tune", "bulk=1,dynamic=1")),
                                          ("sm_90a", 16384, ("--tokens", "4", "--tune", "bulk=1,ctas=1,rt=4")),
                                          ("sm_90a", 16384, ("--tokens", "1", "--tune", "bulk=1"))])
def test_bulk_loops_keep_the_decode_table_in_one_register(arch, k, extra, tmp_path):
    """ptxas kept a constant (or warp-uniform) ``prmt`` table in a uniform register and copied it into a
    fresh register before each ``prmt``: 10-18% of the bulk kernels' loop instructions, 4.6% of the op's
    N = 4 time on H200 (docs/history/perf-notes.md, sixth session). A lane's own copy from shared memory is neither."""
    nvdisasm = _nvdisasm()
    if nvdisasm is None:
        pytest.skip("nvdisasm not installed (the test extra has nvidia-cuda-nvdisasm)")
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools"))
    import sass_budget

    info = compile_check(arch, k, tmp_path, *extra)
    sass = subprocess.run([nvdisasm, "-c", info["cubin"]], capture_output=True, text=True, check=True).stdout
    body = max(sass_budget.loops(sass.splitlines()), key=lambda b: sum(sass_budget.opcode(t) == "IDP" for t in b))
    prmt = sum(sass_budget.opcode(t) == "PRMT" for t in body)
    copies = sum(bool(re.match(r"(IMAD\.U32 R\d+, RZ, RZ, UR\d+|MOV R\d+, UR\d+)", t)) for t in body)
    assert prmt >= 64 and copies <= 4, (prmt, copies)

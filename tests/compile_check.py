"""Compiles the CuTe DSL kernel for a GPU arch on a machine without a GPU; prints a JSON summary.

Usage: python tests/compile_check.py ARCH K [--blocked] [--dequantize plain|packed [--f16]] [--dump DIR] [--tune k=v,...] [--tokens N [--mma GROUPS |
--w4a16 GROUPS [--f16] [--experts]]]
(NVFP4_GEMV_LAUNCH=direct compiles without TVM-FFI)
Run it in a subprocess: a compiler crash must not take the caller down.
"""

import argparse
import json
import os
import struct
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def frame_bytes(cubin):
    """The largest per-thread stack frame of the cubin's functions (``EIATTR_FRAME_SIZE`` in ``.nv.info``):
    above 0 where ptxas spilled registers to local memory."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = secs[shstrndx][4]
    frame = 0
    for name, _, _, _, off, size, *_ in secs:
        if cubin[names + name:cubin.index(b"\0", names + name)] != b".nv.info":
            continue
        i = 0
        while i < size:
            fmt, attr = cubin[off + i], cubin[off + i + 1]
            n = struct.unpack_from("<H", cubin, off + i + 2)[0] if fmt == 4 else 0  # 4: attribute with a size
            if attr == 0x11:  # EIATTR_FRAME_SIZE: (function index, bytes)
                frame = max(frame, struct.unpack_from("<I", cubin, off + i + 8)[0])
            i += 4 + n
    return frame


def main():
    p = argparse.ArgumentParser()
    p.add_argument("arch")
    p.add_argument("k", type=int)
    p.add_argument("--blocked", action="store_true")
    p.add_argument("--dump", default=None)
    p.add_argument("--tune", default="", help="e.g. batch=4,min_blocks=3,group=16")
    p.add_argument("--tokens", type=int, default=0, help="compile the op's kernel for this many tokens")
    p.add_argument("--mma", type=int, default=0, help="with --tokens: the tensor-core kernel, this many 8-row groups")
    p.add_argument("--w4a16", type=int, default=0, help="with --tokens: the W4A16 kernel (bf16 x), this many groups")
    p.add_argument("--f16", action="store_true", help="with --w4a16: fp16 x")
    p.add_argument("--experts", action="store_true", help="with --w4a16: the experts' grouped build")
    p.add_argument("--act", action="store_true", help="with --experts: its down launch's silu(gate) * up build "
                   "(--tune then names the route's tuning; experts_op.act_tuning adds the act's own)")
    p.add_argument("--prefetch", default=None, metavar="WB,SB",
                   help="with --experts: the build that prefetches another weight's experts (WB, SB bytes each)")
    p.add_argument("--ids64", type=int, default=0, metavar="E",
                   help="with --experts: the build that reads int64 ids, E experts")
    p.add_argument("--quantize", action="store_true", help="the activation quantizer (bf16 x; --f16: fp16)")
    p.add_argument("--dequantized", action="store_true", help="with --quantize: its dequantized build")
    p.add_argument("--router", default=None, metavar="E,K",
                   help="the MoE router kernel for E experts, top K, hidden size the K argument (bf16; --f16)")
    p.add_argument("--dequantize", choices=("plain", "packed"), default=None,
                   help="the weights' dequantizer (W4A16's many-token path; bf16 out, --f16: fp16)")
    p.add_argument("--pair", action="store_true", help="with --dequantize: its two-blocks-a-thread build")
    args = p.parse_args()
    # CuTe DSL compiles for --gpu-arch only when CUTE_DSL_ARCH names another arch.
    os.environ["CUTE_DSL_ARCH"] = "sm_80" if args.arch != "sm_80" else "sm_86"
    import cutlass.cutlass_dsl.cutlass as dsl_impl

    # min_blocks_per_mp > 1 asks the driver for the SM's shared memory to set the carveout; answer
    # with Hopper's/Blackwell's 228 KiB so that no GPU is needed.
    dsl_impl.cuda_helpers.get_device_attribute = lambda attr, *a, **kw: 233472
    import submission

    dump = args.dump or tempfile.mkdtemp(prefix="nvfp4_cc_")
    os.makedirs(dump, exist_ok=True)
    tuning = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in args.tune.split(",") if kv}
    options = f"--gpu-arch {args.arch} --keep-cubin --keep-ptx --dump-dir {dump}"
    if args.router:  # nvfp4_gemv.router_kernel (renormalised top k)
        from nvfp4_gemv import router_kernel

        e, top = (int(v) for v in args.router.split(","))
        _, fn = router_kernel.compile_router(e, args.k, top, not args.f16, True, options=options)
    elif args.dequantize:  # nvfp4_gemv.dequant_kernel
        from nvfp4_gemv import dequant_kernel

        _, fn = dequant_kernel.compile_dequantize(args.k, not args.f16, args.dequantize == "packed", options=options,
                                                 pair=args.pair)
    elif args.quantize:  # nvfp4_gemv.quant_kernel
        from nvfp4_gemv import quant_kernel

        _, fn = quant_kernel.compile_quantize(args.k, not args.f16, options=options, dequantized=args.dequantized)
    elif args.tokens and args.w4a16 and args.experts:  # the experts' kernel (nvfp4_gemv.experts_kernel)
        from nvfp4_gemv import experts_kernel, experts_op

        act = "silu" if args.act else None
        prefetch = tuple(int(v) for v in args.prefetch.split(",")) if args.prefetch else None
        tuning = dict(experts_op.act_tuning(tuple(sorted(tuning.items())), act))
        _, fn = experts_kernel.compile_experts_w4a16(args.k, args.tokens, args.w4a16, not args.f16, True,
                                                     options=options, act=act, prefetch=prefetch, ids64=args.ids64,
                                                     **tuning)
    elif args.tokens and args.w4a16:  # the W4A16 kernel (nvfp4_gemv.w4a16), alpha and bf16 out
        from nvfp4_gemv import w4a16

        _, fn = w4a16.compile_w4a16(args.k, args.tokens, args.w4a16, not args.f16, args.blocked, True, True,
                                    options=options, **tuning)
    elif args.tokens and args.mma:  # the op's tensor-core kernel (nvfp4_gemv.mma), alpha and bf16 out
        from nvfp4_gemv import mma

        _, fn = mma.compile_mma(args.k, args.tokens, args.mma, args.blocked, args.blocked, True, True, options=options,
                                **tuning)
    elif args.tokens and tuning.get("bulk"):  # the op's bulk-copy kernel (nvfp4_gemv.tokens_bulk)
        from nvfp4_gemv import tokens_bulk

        _, fn = tokens_bulk.compile_tokens_bulk(args.k, args.tokens, False, args.blocked, True, True,
                                                options=options, **tuning)
    elif args.tokens:  # the op's kernel (nvfp4_gemv.tokens), alpha and bf16 out
        from nvfp4_gemv import tokens

        _, fn = tokens.compile_tokens(args.k, args.tokens, args.blocked, args.blocked, True, True, options=options,
                                      **tuning)
    else:
        fn = submission.compile_gemv(args.k, args.blocked, args.arch, options=options, **tuning)
    cubin = fn.artifacts.CUBIN
    path = os.path.join(dump, "kernel.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    import importlib.metadata as md

    import glob

    ptx = "".join(open(f).read() for f in glob.glob(os.path.join(dump, "*.ptx")))
    # the instruction names are in the PTX (a cubin holds none): no e2m1 conversion, which sm_90a lacks
    fp4_cvt = [line.strip() for line in ptx.splitlines() if "e2m1" in line and not line.lstrip().startswith("//")]
    # a shared-memory read placed above the first barrier reads another launch's leftovers (LLVM moves
    # inline asm without side effects: it did so once in the tensor-core kernel's epilogue); a lane's reads
    # of its own cp.async copies need only the copy wait
    body = [line.strip() for line in ptx.splitlines()]
    first_bar = next((i for i, line in enumerate(body)
                      if line.startswith(("bar.sync", "barrier.", "cp.async.wait_group"))), len(body))
    lds_before_bar = sum(line.startswith("ld.shared") for line in body[:first_bar])
    prefetch_l2 = sum(line.startswith("cp.async.bulk.prefetch.L2") for line in body)
    print(json.dumps({"arch": args.arch, "k": args.k, "cubin": path, "bytes": len(cubin), "ptx_bytes": len(ptx),
                      "fp4_cvt": fp4_cvt[:3], "lds_before_bar": lds_before_bar, "prefetch_l2": prefetch_l2, "frame_bytes": frame_bytes(cubin),
                      "elf": cubin[:4] == b"\x7fELF", "launch": submission.launch_kind(fn),
                      "dsl": md.version("nvidia-cutlass-dsl")}))


if __name__ == "__main__":
    main()

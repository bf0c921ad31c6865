"""One line a routed kernel configuration: its name, the arch and a hash of its SASS, compiled on the CPU.

    python tools/sass_digest.py [--arch sm_90a,sm_100a] [--list] [--only SUBSTRING] > digest.txt

Run it on two trees (or two DSL versions) and diff the outputs: a line that differs is a kernel whose code
changed. The configurations are the ones the code routes to, asked of the code itself:

* ``custom_kernel``'s kernels: ``pick_tuning`` for the task.yml shapes (the tests and the benchmarks, which
  bench.py times by default) and a few more that reach its other branches, with H200's 132 SMs for sm_90a and
  B200's 148 for sm_100a, for scales on the GPU (plain), on the CPU (the permuted ones, "blocked") and the
  plan's fallback where a call's ``sfa`` is off 16 bytes (plain scales, the blocked choice).
* the op's kernels (``nvfp4_gemv.gemv``: tokens, tokens_bulk, mma): the launch plan that ``gemv`` makes is built
  on CPU tensors for a grid of N (1..32), weight shapes, scale layouts and epilogues; each kernel it asks for
  is compiled.
* the W4A16 kernel: the builds ``default_tuning`` routes Llama-3-8B's linears to at 1..32 tokens, plain and
  packed weights (bf16 x and out, alpha).
* the experts' kernel: the builds Qwen3-30B-A3B's experts take at 1..64 tokens and Mixtral-8x7B's at one
  token, the down launch with and without ``act``.

The hash covers ``nvdisasm -c`` of the cubin with the kernel's symbol name replaced by ``KERNEL``: the DSL
names a kernel after its class's module (``kernel_cutlass_kernel_<module><class>_object_at_...``), so moving a
class to another module renames the symbol and nothing else. The PTX carries no line information (no
``.loc``), so no source position reaches the SASS. Also printed: the SASS instruction count and the largest
stack frame (spills), to read a difference by.

Needs nvidia-cuda-nvdisasm (the test extra). Works on the tree it is run from: the package's layout since
issue 32 (``nvfp4_gemv.leaderboard``/``tuning``), or the one before it (``nvfp4_gemv.kernel``), so that a
commit from before the move can be digested with this file copied into it.
"""

import argparse
import glob
import hashlib
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

SMS = {"sm_90a": 132, "sm_100a": 148}  # H200, B200
# beside task.yml's: shapes that reach the routing's other branches (wide scale units over 8 lanes at K = 1024,
# 2 chunks over 16 at K = 3072, 4 over 16 at K = 4096 and 6144, longer rows, splits with a tail, the bulk
# kernel's one-row tiles, a row too long for it)
EXTRA_SHAPES = [(4096, 1024, 2), (8192, 1024, 2), (2048, 3072, 2), (4096, 4096, 4), (16384, 4096, 1), (2048, 6144, 2),
                (16384, 2048, 1), (768, 11264, 1), (128, 22528, 3), (384, 4160, 3), (2048, 7168, 1), (4096, 8192, 4),
                (8192, 26624, 4), (128, 64, 1), (1152, 960, 5)]
# the op: (M, K) of weights, N tokens, (w blocked, x blocked), (alpha, bf16 out), w rows at their dense stride
OP_WEIGHTS = [(7168, 16384), (4096, 7168), (2048, 7168), (1024, 4096), (7168, 2048), (2048, 1024)]
OP_TOKENS = [1, 2, 3, 4, 5, 8, 16, 17, 32]
OP_LAYOUTS = [(False, False), (True, True)]
OP_EPILOGUES = [(True, True)]
OP_EXTRA = [  # (m, k, n, w blocked, x blocked, alpha, bf16, w dense): the other epilogue, mixed layouts, strided w
    (4096, 7168, 1, False, False, False, False, True), (4096, 7168, 8, False, False, False, False, True),
    (4096, 7168, 2, False, False, False, False, True), (7168, 16384, 3, False, True, True, True, True),
    (4096, 7168, 8, True, False, True, True, True), (4096, 7168, 8, False, False, True, True, False),
    (1024, 4096, 40, False, True, True, True, True)]


def _nvdisasm():
    import nvidia

    found = [p for d in nvidia.__path__ for p in glob.glob(os.path.join(d, "*", "bin", "nvdisasm"))]
    if not found:
        raise SystemExit("nvdisasm not found: pip install nvidia-cuda-nvdisasm")
    return found[0]


def _gemv_api():
    """``(compile_gemv, pick_tuning)`` of this tree."""
    try:
        from nvfp4_gemv.leaderboard import compile_gemv
        from nvfp4_gemv.tuning import pick_tuning
    except ImportError:  # before issue 32: one module
        from nvfp4_gemv.kernel import compile_gemv, pick_tuning
    return compile_gemv, pick_tuning


def gemv_configs(arch):
    """``[(label, build)]``: custom_kernel's routed kernels for ``arch``; ``build(options)`` compiles one."""
    import yaml

    compile_gemv, pick_tuning = _gemv_api()
    with open(os.path.join(ROOT, "task.yml")) as f:
        spec = yaml.safe_load(f)
    shapes = sorted({(c["m"], c["k"], c["l"]) for c in spec["tests"] + spec["benchmarks"]} | set(EXTRA_SHAPES))
    sms = SMS[arch]
    seen = {}
    for m, k, l in shapes:
        # scales on the GPU; on the CPU (permuted scales); plain scales with sfa off 16 bytes (the plan's fallback)
        for blocked, cpu_choice in ((False, False), (True, True), (False, True)):
            tuning = tuple(sorted(dict(pick_tuning(k, m, l, sms, cpu_choice)).items()))
            label = f"gemv k={k} blocked={int(blocked)} " + (",".join(f"{n}={v}" for n, v in tuning) or "default")
            seen.setdefault(label, (k, blocked, tuning))
    return [(label, lambda opts, c=c: compile_gemv(c[0], c[1], arch, options=opts, **dict(c[2])))
            for label, c in sorted(seen.items())]


class _Routed:
    """What the op's plan gets back for one kernel: the kernel object (its grid), no launcher."""

    ffi = None

    def __init__(self, op):
        self.op = op


def op_configs(arch):
    """``[(label, build)]``: the op kernels that ``gemv``'s launch plans ask for, on ``arch``'s SM count."""
    import torch

    from nvfp4_gemv import swizzled_scale_shape

    try:  # the W4A4 plan: op_plan.W4A4Plan since issue 57's last move, op._TokensPlan before (older trees)
        from nvfp4_gemv import op_plan
        plan_class = op_plan.W4A4Plan
    except ImportError:
        from nvfp4_gemv import op as op_plan
        plan_class = op_plan._TokensPlan
    from nvfp4_gemv.mma import Nvfp4GemvMma, compile_mma
    from nvfp4_gemv.tokens import Nvfp4GemvTokens, compile_tokens
    from nvfp4_gemv.tokens_bulk import Nvfp4GemvTokensBulk, compile_tokens_bulk

    classes = {"mma": (Nvfp4GemvMma, compile_mma), "tokens": (Nvfp4GemvTokens, compile_tokens),
               "bulk": (Nvfp4GemvTokensBulk, compile_tokens_bulk)}
    keys = set()

    def get_kernel(device_index, key):
        keys.add(key)
        return _Routed(classes[key[0]][0](*key[2:-1], **dict(key[-1])))

    cases = [(m, k, n, wb, xb, a, bf, True) for m, k in OP_WEIGHTS for n in OP_TOKENS for wb, xb in OP_LAYOUTS
             for a, bf in OP_EPILOGUES] + OP_EXTRA
    saved = op_plan._get_kernel, op_plan._sm_count
    op_plan._get_kernel, op_plan._sm_count = get_kernel, lambda device_index: SMS[arch]
    try:
        for m, k, n, wb, xb, alpha, bf16, dense in cases:
            x = torch.empty(n, k // 2, dtype=torch.uint8)
            w = torch.empty(m, k // 2 + (0 if dense else 16), dtype=torch.uint8)[:, : k // 2]
            xs = torch.empty(swizzled_scale_shape(n, k) if xb else (n, k // 16), dtype=torch.uint8)
            ws = torch.empty(swizzled_scale_shape(m, k) if wb else (m, k // 16), dtype=torch.uint8)
            a = torch.ones(1) if alpha else None
            plan_class(x, xs, w, ws, a, None, torch.bfloat16 if bf16 else torch.float16)
    finally:
        op_plan._get_kernel, op_plan._sm_count = saved
    out = []
    for key in sorted(keys, key=repr):
        kind, args, tuning = key[0], key[2:-1], key[-1]
        label = f"op {kind} " + " ".join(str(int(a) if isinstance(a, bool) else a) for a in args) + " " + (
            ",".join(f"{n}={v}" for n, v in tuning) or "default")
        out.append((label, lambda opts, kind=kind, args=args, tuning=tuning:
                    classes[kind][1](*args, options=opts, **dict(tuning))[1]))
    return out


# W4A16 (``gemv`` with bf16 x): Llama-3-8B's linears (fused q/k/v and gate/up too), the tokens the routing
# distinguishes; plain and packed weights
W4A16_WEIGHTS = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (14336, 4096), (1024, 4096), (2048, 2048)]
W4A16_TOKENS = [1, 2, 3, 4, 6, 8, 9, 16, 17, 32]


def w4a16_configs(arch):
    """``[(label, build)]``: the W4A16 builds that ``default_tuning`` routes the shapes above to on ``arch``'s
    SM count (from ``nvfp4_gemv.w4a16_route`` since issue 57, ``nvfp4_gemv.w4a16`` before; ``pick_groups`` was renamed ``w4a16_groups``)."""
    from nvfp4_gemv.w4a16 import compile_w4a16

    try:
        from nvfp4_gemv.w4a16_route import default_tuning, w4a16_groups as pick_groups
    except ImportError:
        try:
            from nvfp4_gemv.w4a16_route import default_tuning, pick_groups
        except ImportError:
            from nvfp4_gemv.w4a16 import default_tuning, pick_groups
    sms, keys = SMS[arch], set()
    for m, k in W4A16_WEIGHTS:
        for n in W4A16_TOKENS:
            for packed in (False, True):
                tune = {**default_tuning(n, m, sms, k), **({"packed": 1} if packed else {})}
                groups = tune.pop("groups", None) or pick_groups(n, m, sms, even=bool(tune.get("w_a")))
                keys.add((k, n, groups, True, False, True, True, tuple(sorted(tune.items()))))
    out = []
    for key in sorted(keys, key=repr):
        args, tuning = key[:-1], key[-1]
        label = "w4a16 " + " ".join(str(int(a) if isinstance(a, bool) else a) for a in args) + " " + (
            ",".join(f"{n}={v}" for n, v in tuning) or "default")
        out.append((label, lambda opts, args=args, tuning=tuning: compile_w4a16(*args, options=opts, **dict(tuning))[1]))
    return out


def experts_configs(arch):
    """``[(label, build)]``: the experts' kernel builds (``experts_op``) that Qwen3-30B-A3B's experts (gate/up
    1536 x 2048, down 2048 x 768, 128 experts, top 8) take at 1..64 tokens and Mixtral-8x7B's (28672 x 4096,
    4096 x 14336, 8 experts, top 2) at one token on ``arch``'s SM count, and the down launch's ``act`` builds
    (``experts_forward``'s groups and busy estimate, bf16)."""
    try:
        from nvfp4_gemv.experts_op import launch_shape
    except ImportError:  # a tree from before the experts' kernel
        return []
    try:
        from nvfp4_gemv.experts_op import act_tuning
        acts_down = (None, "silu")
    except ImportError:  # from before its act
        act_tuning, acts_down = (lambda tuning, act: tuning), (None,)
    from nvfp4_gemv.experts_kernel import compile_experts_w4a16
    from nvfp4_gemv.model.experts_forward import busy_groups, group_size

    sms, keys = SMS[arch], set()
    # (experts, top k, hidden, expert intermediate, token counts): Qwen3-30B-A3B's; Mixtral-8x7B's at one token
    for e, top, h, inter, counts in ((128, 8, 2048, 768, (1, 2, 4, 8, 16, 32, 64)), (8, 2, 4096, 14336, (1,))):
        for t in counts:
            nt = group_size(t, top, e)
            busy = busy_groups(t, top, e, nt)
            for m, k, acts in ((2 * inter, h, (None,)), (h, inter, acts_down)):
                r, _ = launch_shape(nt, m, k, sms, busy)
                for act in acts:
                    keys.add((k, nt, r.groups, act, act_tuning(r.tuning, act)))
    out = []
    for k, nt, groups, act, tuning in sorted(keys, key=repr):
        label = f"experts {k} {nt} {groups} act={act} " + (",".join(f"{n}={v}" for n, v in tuning) or "default")
        kw = {} if act is None else {"act": act}  # (a tree from before act has no such argument)
        out.append((label, lambda opts, a=(k, nt, groups, True, True), kw=kw, tuning=tuning:
                    compile_experts_w4a16(*a, options=opts, **kw, **dict(tuning))[1]))
    return out


def digest(cubin_path, nvdisasm):
    """``(sha256 of the SASS with the kernel's name replaced, instructions)``."""
    sass = subprocess.run([nvdisasm, "-c", cubin_path], capture_output=True, text=True, check=True).stdout
    sass = re.sub(r"kernel_cutlass_kernel_\w+", "KERNEL", sass)
    n = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M))
    return hashlib.sha256(sass.encode()).hexdigest()[:16], n


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="sm_90a,sm_100a")
    p.add_argument("--list", action="store_true", help="print the configurations, compile nothing")
    p.add_argument("--only", default="", help="only configurations whose label contains this")
    p.add_argument("--keep", default=None, help="keep each SASS text in this folder (to diff a difference)")
    args = p.parse_args()
    # CuTe DSL compiles for --gpu-arch only when CUTE_DSL_ARCH names another arch (tests/compile_check.py)
    os.environ["CUTE_DSL_ARCH"] = "sm_80"
    import importlib.metadata as md

    import cutlass.cutlass_dsl.cutlass as dsl_impl

    # min_blocks_per_mp > 1 asks the driver for the SM's shared memory: answer Hopper's/Blackwell's 228 KiB
    dsl_impl.cuda_helpers.get_device_attribute = lambda attr, *a, **kw: 233472
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from compile_check import frame_bytes

    nvdisasm = None if args.list else _nvdisasm()
    dsl = md.version("nvidia-cutlass-dsl")
    for arch in args.arch.split(","):
        configs = [c for c in gemv_configs(arch) + op_configs(arch) + w4a16_configs(arch) + experts_configs(arch)
                   if args.only in c[0]]
        for label, build in configs:
            if args.list:
                print(f"{label} | {arch}")
                continue
            with tempfile.TemporaryDirectory(prefix="nvfp4_sass_") as tmp:
                fn = build(f"--gpu-arch {arch} --keep-cubin --dump-dir {tmp}")
                path = os.path.join(tmp, "kernel.cubin")
                with open(path, "wb") as f:
                    f.write(fn.artifacts.CUBIN)
                h, n = digest(path, nvdisasm)
                if args.keep:
                    os.makedirs(args.keep, exist_ok=True)
                    name = re.sub(r"[^A-Za-z0-9=.,_-]+", "_", f"{arch}_{label}")
                    sass = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True).stdout
                    with open(os.path.join(args.keep, name + ".sass"), "w") as f:
                        f.write(re.sub(r"kernel_cutlass_kernel_\w+", "KERNEL", sass))
                print(f"{label} | {arch} | sass {h} | {n} instructions | frame {frame_bytes(fn.artifacts.CUBIN)} "
                      f"| dsl {dsl}", flush=True)


if __name__ == "__main__":
    main()

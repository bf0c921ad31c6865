"""Times configurations of the op's kernels on the GPU, leaderboard timing, each output checked against
float64. ``mma=0,bulk=0`` forces the dp4a kernel (nvfp4_gemv.tokens; any of its own keys without ``bulk``
does too), ``bulk=1`` the bulk-copy kernel (nvfp4_gemv.tokens_bulk, with ``ctas``, ``rt``, ``stages``,
``max_n``), ``mma=1`` the tensor-core kernel (nvfp4_gemv.mma, with ``groups``, ``threads``, ``depth``,
``unroll``); an empty tuning (or ``mma=0`` alone) leaves the choice to the op's routing.

    python tools/sweep_op.py 7168x16384 1,2,4,8 "mma=0,signed=0;mma=0,group=8;bulk=1,rt=2;mma=1,threads=512,depth=1"
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import torch  # noqa: E402

import inputs  # noqa: E402
from bench import time_leaderboard  # noqa: E402
from nvfp4_gemv import op_plan  # noqa: E402


def main():
    m, k = (int(v) for v in sys.argv[1].split("x"))
    ns = [int(v) for v in sys.argv[2].split(",")]
    tunings = [tuple(sorted((kv.split("=")[0], int(kv.split("=")[1])) for kv in t.split(",") if kv))
               for t in sys.argv[3].split(";")] if len(sys.argv) > 3 else [()]
    for n in ns:
        args = inputs.op_inputs(n, m, k, seed=n)
        exact, terms = inputs.op_exact(*args)
        for tuning in tunings:
            out = torch.full((n, m), float("nan"), dtype=torch.bfloat16, device="cuda")
            try:
                plan = op_plan.W4A4Plan(*args, out, torch.bfloat16, tuning=tuning)
            except (ValueError, TypeError) as e:
                print(f"{m}x{k} N={n:2d} {dict(tuning)}: {e}")
                continue
            plan(*args, out, torch.bfloat16)
            torch.cuda.synchronize()
            bad, msg = inputs.op_violations(out, exact, terms)
            us = time_leaderboard(lambda: plan(*args, out, torch.bfloat16), 40)
            print(f"{m}x{k} N={n:2d} {str(dict(tuning)):40s} {us:7.2f} us  {'ok' if bad == 0 else msg}", flush=True)


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):  # the docstring, and nothing run
        sys.exit(print(__doc__) or 0)
    main()

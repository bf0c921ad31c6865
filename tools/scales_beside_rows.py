"""Is the streaming kernel's scale cost where ``sfa`` lies in memory? Times ``custom_kernel`` on the same
values in two layouts: the generator's (``a`` and ``sfa`` in separate buffers) and ``inputs.interleaved``
(each row's scales right after its row of ``a``, one buffer). Both are checked against float64 on signed
inputs first. If the interleaved layout runs near the read floor of the same bytes, the cost is the two
separate regions, which the op for model code could avoid by repacking its constant weights once.

    python tools/scales_beside_rows.py 7168x2048x4,4096x4096x4,4096x7168x8

A third case times the generator's layout with ``sfa`` read into L2 after the flush (outside the timed
range): what the kernel would take if the scales cost nothing to fetch from DRAM.

Prints ``shape layout: us`` lines (median of 50 runs the leaderboard's way, three passes alternating the
layouts) and ``shape layout check: ok``. The thirteenth session's results are in docs/history/perf-notes.md: the layout
moves 0.1-0.5 us, ``sfa`` in L2 1.0-3.7 us.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import inputs  # noqa: E402
import reference  # noqa: E402
from nvfp4_gemv import leaderboard  # noqa: E402
import torch  # noqa: E402
from bench import time_leaderboard  # noqa: E402

LAYOUTS = {"separate": lambda d: d, "interleaved": inputs.interleaved}


def main():
    shapes = sys.argv[1] if len(sys.argv) > 1 else "7168x2048x4,4096x4096x4,7168x16384x1,4096x7168x8"
    for m, k, l in (tuple(int(v) for v in s.split("x")) for s in shapes.split(",")):
        data = {n: f(reference.generate_input(m, k, l, 1111)) for n, f in LAYOUTS.items()}
        for name, make in LAYOUTS.items():
            signed = make(inputs.random_inputs(m, k, l, seed=5))
            ok, msg = inputs.check_exact(signed, leaderboard.custom_kernel(inputs.poisoned(signed)))
            print(f"{m}x{k}x{l} {name} check: {'ok' if ok else 'WRONG ' + msg}", flush=True)
        times = {n: [] for n in (*LAYOUTS, "separate, sfa in L2")}
        for _ in range(3):
            for name, d in data.items():
                times[name].append(time_leaderboard(lambda d=d: leaderboard.custom_kernel(d), 50))
            sfa = data["separate"][2].view(torch.uint8)
            times["separate, sfa in L2"].append(time_leaderboard(
                lambda: leaderboard.custom_kernel(data["separate"]), 50,
                after_flush=lambda: sfa.sum(dtype=torch.int32)))
        for name, ts in times.items():
            print(f"{m}x{k}x{l} {name}: {min(ts):.2f} us (passes {' / '.join(f'{t:.2f}' for t in ts)})", flush=True)


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):  # the docstring, and nothing run
        sys.exit(print(__doc__) or 0)
    main()

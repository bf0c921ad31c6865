"""Times ``custom_kernel`` of two submission files side by side in one process, the leaderboard's way (L2
flushed, CUDA events), alternating blocks of runs so that drift of the GPU or host falls on both; each
output first checked against float64 on signed random inputs and against the reference on the official
ones.

    python tools/ab.py OLD_submission.py submission.py 7168x16384x1 4096x7168x8 7168x2048x4

Prints one line a shape and file: the median over all runs, and each block's median.
"""

import importlib.util
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import inputs  # noqa: E402
import reference  # noqa: E402
from bench import time_leaderboard  # noqa: E402

BLOCKS, REPS = 6, 25


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    paths = sys.argv[1:3]
    mods = [load(p, f"ab_submission_{i}") for i, p in enumerate(paths)]
    for spec in sys.argv[3:]:
        m, k, l = (int(v) for v in spec.split("x"))
        data = reference.generate_input(m, k, l, 1111)
        signed = inputs.random_inputs(m, k, l, seed=5)
        ok = []
        for mod in mods:
            out = mod.custom_kernel(inputs.poisoned(signed))
            good = inputs.check_exact(signed, out)[0] and inputs.check_tight(signed, out)[0] == 0
            out = mod.custom_kernel(inputs.poisoned(data))
            good = good and reference.check_implementation(data, out)[0]
            ok.append(good)
        times = [[] for _ in mods]
        for _ in range(BLOCKS):
            for i, mod in enumerate(mods):
                times[i].append(time_leaderboard(lambda mod=mod: mod.custom_kernel(data), REPS))
        for path, ts, good in zip(paths, times, ok):
            print(f"{spec:14s} {path:28s} {statistics.median(ts):7.2f} us  blocks "
                  f"{' '.join(f'{t:.2f}' for t in ts)}  {'ok' if good else 'WRONG'}", flush=True)


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):  # the docstring, and nothing run
        sys.exit(print(__doc__) or 0)
    main()

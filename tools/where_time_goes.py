"""Where custom_kernel's time goes against the read floor, in one process, the leaderboard's way (4 GiB flush,
so a dirty L2; CUDA events; median of 50): plain reads of all the bytes, of ``a``'s bytes alone and of ``sfa``'s
alone; the routed kernel and its probe (its configuration with ``probe=1``: the loads kept, the arithmetic
dropped, wrong results); and both again with ``sfa`` read into L2 between the flush and the start event.

    python tools/where_time_goes.py 7168x2048x4,16384x2048x1,7168x16384x1

Differences read off the lines: probe with ``sfa`` in L2 - floor of ``a`` = the kernel's way of streaming ``a``;
probe - probe with ``sfa`` in L2 = what fetching ``sfa`` costs the kernel, against floor of all - floor of ``a``
for a plain read; kernel - probe = arithmetic not hidden behind the loads. Three passes, alternating the cases;
prints each case's best and its passes. The floors here are the best of three reader configurations (``READERS``),
not ``read_floor.floor_us``'s full search, so they can sit a little above bench.py's.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]
import torch  # noqa: E402

import reference  # noqa: E402
from nvfp4_gemv import launch, leaderboard  # noqa: E402
from nvfp4_gemv.tuning import pick_tuning  # noqa: E402
from bench import bytes_moved, time_leaderboard  # noqa: E402
from read_floor import reader, zero_buffer  # noqa: E402

READERS = ((16, 128, 8), (16, 512, 4), (16, 128, 4))  # (CTAs a SM, threads, loads in flight): bench's usual best


def floor(nbytes):
    buf = zero_buffer(nbytes)
    runs = [reader(buf, threads, 16, cps, unroll) for cps, threads, unroll in READERS]
    return lambda: min(time_leaderboard(r, 50) for r in runs)


def cases(m, k, l):
    data = reference.generate_input(m, k, l, 1111)
    shape = leaderboard.check_inputs(data)
    tune = pick_tuning(k, m, l, launch.device_info(0)[1], False)
    probe = tuple(sorted(dict(tune, probe=1).items()))
    sfa = data[2].view(torch.uint8)

    def warm():
        sfa.sum(dtype=torch.int32)

    def kernel():
        leaderboard.custom_kernel(data)

    def probe_run():
        leaderboard.run_cute(data, *shape, tuning=probe)

    return dict(tune), {
        "floor, all bytes": floor(bytes_moved(m, k, l)),
        "floor, a's bytes": floor(m * k // 2 * l),
        "floor, sfa's bytes": floor(m * k // 16 * l),
        "kernel": lambda: time_leaderboard(kernel, 50),
        "kernel, sfa in L2": lambda: time_leaderboard(kernel, 50, after_flush=warm),
        "probe": lambda: time_leaderboard(probe_run, 50),
        "probe, sfa in L2": lambda: time_leaderboard(probe_run, 50, after_flush=warm),
    }


def main():
    for spec in (sys.argv[1] if len(sys.argv) > 1 else "7168x2048x4,16384x2048x1,7168x16384x1").split(","):
        m, k, l = (int(v) for v in spec.split("x"))
        tune, named = cases(m, k, l)
        times = {name: [] for name in named}
        for _ in range(3):
            for name, run in named.items():
                times[name].append(run())
        print(f"{spec} ({tune or 'the streaming default'}):", flush=True)
        for name, ts in times.items():
            print(f"   {name:20s} {min(ts):7.2f} us  ({' / '.join(f'{t:.2f}' for t in ts)})", flush=True)


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):  # the docstring, and nothing run
        sys.exit(print(__doc__) or 0)
    main()

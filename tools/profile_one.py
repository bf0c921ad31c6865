"""Runs one custom_kernel call (or a tuning variant) on one shape, for Nsight Compute:

    ncu --clock-control none -k regex:kernel_cutlass python tools/profile_one.py 7168 16384 1 [name=value,...]
"""

import os
import sys

if {"-h", "--help"} & set(sys.argv[1:]):  # the docstring, and nothing run
    sys.exit(print(__doc__) or 0)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import reference  # noqa: E402
from nvfp4_gemv import leaderboard  # noqa: E402

m, k, l = (int(v) for v in sys.argv[1:4])
tunes = [tuple(sorted((kv.split("=")[0], int(kv.split("=")[1])) for kv in t.split(",") if kv))
         for t in (sys.argv[4:] or [""])]
data = reference.generate_input(m, k, l, 1111)
shape = leaderboard.check_inputs(data)
for tune in tunes:
    leaderboard.run_cute(data, *shape, tuning=tune or None)  # compile outside the profiled range
torch.cuda.synchronize()
for tune in tunes:
    torch.cuda.profiler.start()
    leaderboard.run_cute(data, *shape, tuning=tune or None)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()

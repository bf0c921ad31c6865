"""Cases for tools/sanitize.sh: `all` = every task.yml shape plus fuzz shapes; `small` = a few."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402
import yaml  # noqa: E402

import inputs  # noqa: E402
import reference  # noqa: E402
import submission  # noqa: E402

with open(os.path.join(ROOT, "task.yml")) as f:
    spec = yaml.safe_load(f)
task = sorted({(c["m"], c["k"], c["l"]) for c in spec["tests"] + spec["benchmarks"]})
fuzz = [(128, 64, 1), (1152, 960, 5), (640, 2752, 3), (128, 32768, 2), (3968, 1600, 1)]
small = [(128, 256, 1), (512, 4096, 2), (640, 2752, 3), (1024, 16384, 1), (1536, 7168, 2)]  # last two: bulk kernel
shapes = task + fuzz if sys.argv[1:] == ["all"] else small
for m, k, l in shapes:
    for cpu_scales in (False, True):
        data = inputs.random_inputs(m, k, l, seed=m + k)
        if cpu_scales:
            data = (*data[:2], data[2].cpu(), data[3].cpu(), *data[4:])
        out = submission.custom_kernel(inputs.poisoned(data))
        torch.cuda.synchronize()
        ok, msg = reference.check_implementation(data, out)
        print(f"{m}x{k}x{l} cpu_scales={cpu_scales}: {'ok' if ok else 'MISMATCH ' + msg}", flush=True)
        assert ok

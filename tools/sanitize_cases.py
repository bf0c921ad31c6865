"""Cases for tools/sanitize.sh: `task` = every task.yml shape (benchmarks included), each named with the
kernel class and configuration ``pick_tuning`` gives it; `all` = those plus fuzz shapes."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402
import yaml  # noqa: E402

import inputs  # noqa: E402
import submission  # noqa: E402

with open(os.path.join(ROOT, "task.yml")) as f:
    spec = yaml.safe_load(f)
task = sorted({(c["m"], c["k"], c["l"]) for c in spec["tests"] + spec["benchmarks"]})
fuzz = [(128, 64, 1), (1152, 960, 5), (640, 2752, 3), (128, 32768, 2), (3968, 1600, 1)]
# `task` = every task.yml shape (benchmarks included) with the configuration pick_tuning gives it
shapes = {"all": task + fuzz, "task": task}.get(sys.argv[1] if sys.argv[1:] else "", None)
if shapes is None:
    raise SystemExit("usage: sanitize_cases.py all|task")
sms = torch.cuda.get_device_properties(0).multi_processor_count
for m, k, l in shapes:
    for cpu_scales in (False, True):
        tuning = submission.pick_tuning(k, m, l, sms, cpu_scales)
        kernel = type(submission.make_op(k, cpu_scales, **dict(tuning))).__name__
        data = inputs.random_inputs(m, k, l, seed=m + k)
        if cpu_scales:
            data = (*data[:2], data[2].cpu(), data[3].cpu(), *data[4:])
        out = submission.custom_kernel(inputs.poisoned(data))
        torch.cuda.synchronize()
        ok, msg = inputs.check_exact(data, out)
        print(f"{m}x{k}x{l} cpu_scales={cpu_scales} {kernel} {dict(tuning)}: {'ok' if ok else 'MISMATCH ' + msg}",
              flush=True)
        assert ok

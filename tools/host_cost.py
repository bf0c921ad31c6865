"""Host-side cost of one ``custom_kernel`` call and its parts, next to a bare torch launch, then each
comparison the issues ask for as the median difference over alternating measurements.

    python tools/host_cost.py

The GPU is held busy by a spin kernel while the calls are timed, so they only queue: back-to-back
launches on an idle GPU would measure its launch throughput instead of the host's work.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch  # noqa: E402

import reference  # noqa: E402
from nvfp4_gemv import launch, leaderboard  # noqa: E402
from bench import busy_host_us, host_diff_us  # noqa: E402


def busy_us(fn):
    us, valid = busy_host_us(fn)
    return f"{us:6.2f} us{'' if valid else ' (GPU went idle: upper bound)'}"


def main():
    import importlib.metadata as md

    data = reference.generate_input(128, 256, 1, 1)
    leaderboard.custom_kernel(data)
    plan = leaderboard._plans[leaderboard._metadata(data)]
    print(f"nvidia-cutlass-dsl {md.version('nvidia-cutlass-dsl')}, launch path: {plan.kernel.kind}")
    cases = [("custom_kernel", lambda: leaderboard.custom_kernel(data)),
             ("metadata key + plan lookup", lambda: leaderboard._plans.get(leaderboard._metadata(data))),
             ("plan's C++ guard alone (TensorGuards)", lambda: plan.variants[0][0].check(*data)),
             ("the plan's hit(data): the fast path, no wrapper", lambda: plan.variants[0][1](data)),
             ("plan(data): pointers, stream, launch", lambda: plan(data))]
    if plan.ffi is not None:
        args = (data[0].data_ptr(), data[1].data_ptr(), data[2].data_ptr(), data[3].data_ptr(),
                data[6].data_ptr(), 0, *plan.static, launch.current_stream(plan.dev))
        cases.append(("compiled launcher alone (TVM-FFI)", lambda: plan.ffi(*args)))
    elif plan.storage:
        _, _, packed, _, capi = plan.storage
        cases.append(("compiled launcher alone (ctypes)", lambda: capi(packed)))
    c = data[6]
    x = torch.ones(64, device="cuda")
    cases += [("torch.cuda._sleep(0): a bare torch launch", lambda: torch.cuda._sleep(0)),
              ("torch.add(x, x): a bare torch op", lambda: torch.add(x, x)),
              ("torch c.zero_()", lambda: c.zero_())]
    # the op: a call with and without out=, and what its allocation of the result costs each way
    from nvfp4_gemv import gemv

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import inputs

    op_args = inputs.op_inputs(4, 4096, 7168, seed=1)
    out = torch.empty(4, 4096, dtype=torch.bfloat16, device="cuda")
    w, dev = op_args[2], op_args[2].device
    cases += [("gemv(..., out=out), N = 4", lambda: gemv(*op_args, out=out)),
              ("gemv(...), N = 4 (allocates the result)", lambda: gemv(*op_args)),
              ("torch.empty(shape, dtype=, device=device)", lambda: torch.empty((4, 4096), dtype=torch.bfloat16,
                                                                                device=dev)),
              ("w.new_empty(shape, dtype=)", lambda: w.new_empty((4, 4096), dtype=torch.bfloat16))]
    template = torch.empty((1, 1), dtype=torch.bfloat16, device=dev).expand(4, 4096)
    cases.append(("torch.empty_like(zero-stride template)", lambda: torch.empty_like(template)))
    for name, fn in cases:
        print(f"{name:45s} {busy_us(fn)}")
    # the lent hosts' CPUs drift by a microsecond between lines: each comparison alternates its two calls
    fns = dict(cases)
    pairs = [("custom_kernel", "torch.add(x, x): a bare torch op"),
             ("custom_kernel", "torch.cuda._sleep(0): a bare torch launch"),
             ("gemv(..., out=out), N = 4", "custom_kernel"),
             ("gemv(...), N = 4 (allocates the result)", "custom_kernel")]
    for a, b in pairs:
        med, lo, hi, valid = host_diff_us(fns[a], fns[b])
        print(f"{a.split(':')[0]} - {b.split(':')[0]}: median {med:+.2f} us over 7 alternations "
              f"(range {lo:+.2f} .. {hi:+.2f}){'' if valid else ' (GPU went idle: not valid)'}")


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):  # the docstring, and nothing run
        sys.exit(print(__doc__) or 0)
    main()

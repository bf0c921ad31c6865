"""Local harness for the nvfp4_gemv task: the leaderboard's protocol, and a human view.

Protocol mode (POPCORN_FD set, or --protocol): ``python eval.py MODE TESTFILE`` with MODE one of test,
benchmark, leaderboard, profile; ``key: value`` lines go to the file descriptor POPCORN_FD. Exit codes:
0 all passed, 112 a case failed, 113 invalid test file, 111 protocol mode without POPCORN_FD, 2 bad
arguments.

Human mode: ``python eval.py [MODE] [TESTFILE] [--submission PATH] [--json F] [--plot F.png]`` prints
progress, then a table with the median time, achieved bandwidth and the speed-of-light time per case.
MODE defaults to benchmark; TESTFILE to task.yml's benchmarks (for benchmark, leaderboard, profile) or
tests (for test). The bandwidth column is a share of the DRAM read ceiling (an fp32 ``torch.sum`` over
2 GiB), not of the case's read floor: bench.py measures that floor with a CuTe DSL read kernel, which this
harness cannot assume. Without a CUDA device, a submission that imports the CuTe DSL (``cutlass``; ours
does) is refused before any case runs, with exit code 114; other submissions run on CPU inputs, and one
whose first case fails for want of CUDA stops there (exit code 112, the case's failure).

Every case runs in a spawned one-process pool, so a crash in the submission fails that case only.
"""

import argparse
import base64
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
import dataclasses
import hashlib
import importlib.util
import json
import math
import multiprocessing
import os
import platform
import re
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.abspath(__file__))
MODES = ("test", "benchmark", "leaderboard", "profile")
EXIT_FAIL, EXIT_NO_FD, EXIT_BAD_FILE = 112, 111, 113
EXIT_NO_CUDA = 114  # human mode only: the submission needs a CUDA GPU and this machine has none
BENCH_MAX_RUNS, LEADERBOARD_MAX_RUNS = 100, 1000
TIME_BUDGET_NS = 10e9
WALL_LIMIT_S = 120.0


class TestFileError(ValueError):
    pass


# ---------------------------------------------------------------------------------------------- inputs


def parse_test_file(text):
    """One case a line, ``key: value`` pairs separated by ``;`` (int or word values); blank lines skipped."""
    cases = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        case = {}
        for part in line.split(";"):
            if not part.strip():
                continue
            key, sep, value = part.partition(":")
            key, value = key.strip(), value.strip()
            if not sep or not key.isidentifier() or not value:
                raise TestFileError(f"line {n}: expected 'key: value' pairs separated by ';', got {part.strip()!r}")
            if value.lstrip("-").isdigit():
                case[key] = int(value)
            elif value.isidentifier():
                case[key] = value
            else:
                raise TestFileError(f"line {n}: value of {key!r} must be an integer or a word, got {value!r}")
        cases.append(case)
    return cases


def mix_seed(case_seed, global_seed):
    """The runner's seed combination (Cantor pairing): a + (a + b)(a + b + 1) / 2."""
    a, b = case_seed, global_seed
    return a + (a + b) * (a + b + 1) // 2


def spec_line(case):
    return "; ".join(f"{k}: {v}" for k, v in case.items())


def task_yml_cases(section):
    import yaml

    with open(os.path.join(ROOT, "task.yml")) as f:
        return [dict(c) for c in yaml.safe_load(f)[section]]


# ---------------------------------------------------------------------------------------------- worker


def _load_submission(path):
    spec = importlib.util.spec_from_file_location("submission", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["submission"] = module
    spec.loader.exec_module(module)
    return module.custom_kernel


def _clone(data):
    import torch

    return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in data)


def _setup_worker(submission_path):
    sys.path.insert(0, ROOT)
    import torch

    import reference

    cuda = torch.cuda.is_available()
    kernel = _load_submission(submission_path)
    return torch, reference, kernel, cuda


def _call(torch, kernel, data, cuda):
    if cuda:
        torch.cuda.nvtx.range_push("custom_kernel")
    try:
        return kernel(data)
    finally:
        if cuda:
            torch.cuda.nvtx.range_pop()


def _poison(torch, data):
    data = list(_clone(data))
    if data[-1].is_floating_point():
        data[-1].fill_(float("nan"))
    return tuple(data)


def _check(torch, reference, kernel, case, cuda):
    data = reference.generate_input(**case)
    out = _call(torch, kernel, _poison(torch, data), cuda)
    if cuda:
        torch.cuda.synchronize()
    return reference.check_implementation(data, out)


def _time_once(torch, kernel, data, cuda):
    if cuda:
        from utils import clear_l2_cache

        clear_l2_cache()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = _call(torch, kernel, data, cuda)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e6, out
    t0 = time.perf_counter_ns()
    out = _call(torch, kernel, data, cuda)
    return time.perf_counter_ns() - t0, out


def _stats(times):
    n = len(times)
    mean = sum(times) / n
    std = statistics.stdev(times) if n > 1 else 0.0
    s = sorted(times)
    return {"runs": n, "mean": mean, "std": std, "err": std / math.sqrt(n), "best": s[0], "worst": s[-1],
            "median": statistics.median(times), "p20": s[int(0.2 * (n - 1))], "p80": s[int(0.8 * (n - 1))]}


def worker_test(submission_path, case):
    torch, reference, kernel, cuda = _setup_worker(submission_path)
    ok, msg = _check(torch, reference, kernel, case, cuda)
    return {"ok": bool(ok), "message": msg}


def worker_benchmark(submission_path, case, leaderboard=False, warmup_only=False):
    torch, reference, kernel, cuda = _setup_worker(submission_path)
    ok, msg = _check(torch, reference, kernel, case, cuda)
    if not ok:
        return {"ok": False, "message": msg}
    if warmup_only:
        return {"ok": True}
    data = reference.generate_input(**case)
    _time_once(torch, kernel, _clone(data), cuda)  # untimed: first-use costs of this process stay out
    times, seed = [], case.get("seed", 0)
    start = time.perf_counter()
    max_runs = LEADERBOARD_MAX_RUNS if leaderboard else BENCH_MAX_RUNS
    while len(times) < max_runs:
        if leaderboard:
            seed += 13
            fresh = dict(case, seed=seed)
            data = reference.generate_input(**fresh)
            ns, out = _time_once(torch, kernel, _poison(torch, data), cuda)
            times.append(ns)
            good, why = reference.check_implementation(data, out)
            if not good:
                return {"ok": False, "message": f"seed {seed}: {why}"}
        else:
            times.append(_time_once(torch, kernel, data, cuda)[0])
        elapsed = time.perf_counter() - start
        if len(times) > 2 and elapsed > 0.1:
            st = _stats(times)
            if (st["err"] / st["mean"] < 0.001 or st["runs"] * st["mean"] > TIME_BUDGET_NS
                    or elapsed > WALL_LIMIT_S):
                break
    return {"ok": True, "stats": _stats(times)}


def worker_profile(submission_path, case):
    torch, reference, kernel, cuda = _setup_worker(submission_path)
    from torch.profiler import ProfilerActivity, profile

    data = reference.generate_input(**case)
    _call(torch, kernel, _clone(data), cuda)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        _call(torch, kernel, _clone(data), cuda)
        if cuda:
            torch.cuda.synchronize()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=20)
    return {"ok": True, "report": base64.b64encode(table.encode()).decode()}


def run_isolated(fn, *args):
    """Runs ``fn(*args)`` in a fresh spawned one-process pool; an exception, or the death of the process
    (a crash, a CUDA error that kills it), becomes a failed result instead of a harness crash."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(fn, *args).result()
        except BrokenProcessPool:
            return {"ok": False, "error": "the submission's process died (crash or abort)"}
        except Exception as e:  # noqa: BLE001 - the submission's failure is the case's result
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def run_case(mode, submission, case):
    if mode == "test":
        return run_isolated(worker_test, submission, case)
    if mode == "profile":
        return run_isolated(worker_profile, submission, case)
    return run_isolated(worker_benchmark, submission, case, mode == "leaderboard")


# ---------------------------------------------------------------------------------------------- protocol


class Output:
    def __init__(self, fd):
        self.f = os.fdopen(fd, "w", buffering=1)

    def line(self, key, value):
        self.f.write(f"{key}: {value}\n")


def protocol_main(mode, cases, submission, out):
    passed = True
    if mode == "test":
        out.line("test-count", len(cases))
        for i, case in enumerate(cases):
            out.line(f"test.{i}.spec", spec_line(case))
            r = run_case(mode, submission, case)
            if r.get("ok"):
                out.line(f"test.{i}.status", "pass")
                if r.get("message"):
                    out.line(f"test.{i}.message", r["message"])
            else:
                passed = False
                out.line(f"test.{i}.status", "fail")
                out.line(f"test.{i}.error", r.get("error") or r.get("message", ""))
        out.line("check", "pass" if passed else "fail")
        return 0 if passed else EXIT_FAIL
    if mode != "profile" and cases:
        run_isolated(worker_benchmark, submission, cases[0], False, True)  # untimed warm-up
    out.line("benchmark-count", len(cases))
    for i, case in enumerate(cases):
        out.line(f"benchmark.{i}.spec", spec_line(case))
        r = run_case(mode, submission, case)
        if not r.get("ok"):
            passed = False
            out.line(f"benchmark.{i}.status", "fail")
            out.line(f"benchmark.{i}.error", r.get("error") or r.get("message", ""))
            if mode == "leaderboard":
                break
            continue
        if mode == "profile":
            out.line(f"benchmark.{i}.report", r["report"])
            continue
        for key in ("runs", "mean", "std", "err", "best", "worst"):
            out.line(f"benchmark.{i}.{key}", r["stats"][key])
    out.line("check", "pass" if passed else "fail")
    return 0 if passed else EXIT_FAIL


# ---------------------------------------------------------------------------------------------- human view


def sol_us(nbytes, bw_tbps):
    """Time to read ``nbytes`` at the measured read ceiling, in us."""
    return nbytes / (bw_tbps * 1e12) * 1e6


def is_suspect(best_us, nbytes, bw_tbps):
    """A best time below the bytes' read time at the measured read ceiling: the kernel cannot have read them
    all (a cached result, an unwritten output, a timer around nothing)."""
    return best_us < sol_us(nbytes, bw_tbps)


def bytes_moved(case):
    m, k, l = case["m"], case["k"], case["l"]
    return l * (m * k // 2 + m * k // 16 + k // 2 + k // 16 + 2 * m)


def measure_read_bandwidth():
    """The DRAM read ceiling: the median read rate (TB/s) of an fp32 sum over 2 GiB, L2 flushed before each
    of 20 runs. Reads of a case's size (tens of MB) cannot reach it (launch, ramp-up and the flush's dirty L2
    cost microseconds), so a kernel's share of it is not its share of the case's read floor (bench.py)."""
    import torch

    from utils import clear_l2_cache

    x = torch.ones(512 * 1024 * 1024, device="cuda")
    times = []
    for _ in range(20):
        clear_l2_cache()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        x.sum()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    return x.numel() * 4 / statistics.median(times) / 1e12


def system_info(submission):
    info = {"python": platform.python_version(), "platform": platform.platform()}
    with open(submission, "rb") as f:
        info["submission_sha256"] = hashlib.sha256(f.read()).hexdigest()
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
            try:
                import subprocess

                info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                                capture_output=True, text=True, timeout=10).stdout.strip()
            except Exception:  # noqa: BLE001 - best effort
                info["driver"] = None
    except ImportError:
        pass
    try:
        from importlib.metadata import version

        info["cutlass_dsl"] = version("nvidia-cutlass-dsl")
    except Exception:  # noqa: BLE001 - not installed
        info["cutlass_dsl"] = None
    return info


@dataclasses.dataclass
class Row:
    case: dict
    status: str
    message: str = ""
    stats: dict = None
    tbps: float = None
    pct_of_ceiling: float = None
    sol_us: float = None
    suspect: bool = False


NEEDS_CUDA = ("This submission needs a CUDA GPU. Without one you can run the CPU tests (python -m pytest -q) "
              "or evaluate a CPU-capable submission, e.g.\n"
              "  python eval.py test --submission tests/submissions/cpu_ok.py")


def imports_cute_dsl(path):
    """Whether the submission imports the CuTe DSL (``cutlass``), whose kernels run only on a CUDA GPU."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return re.search(r"^\s*(import|from)\s+cutlass\b", f.read(), re.MULTILINE) is not None


def human_main(mode, cases, submission, args):
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        if imports_cute_dsl(submission):
            print(f"No CUDA device here, and {os.path.basename(submission)} imports the CuTe DSL.\n{NEEDS_CUDA}",
                  file=sys.stderr)
            return EXIT_NO_CUDA
        print("No CUDA device: inputs are made on the CPU and the submission (no CuTe DSL import) runs there.")
    bw = measure_read_bandwidth() if cuda and mode != "test" else None
    if bw:
        print(f"measured DRAM read ceiling: {bw:.2f} TB/s (fp32 torch.sum over 2 GiB)")
    rows = []
    for i, case in enumerate(cases):
        print(f"[{i + 1}/{len(cases)}] {spec_line(case)} ...", flush=True)
        r = run_case(mode, submission, case)
        if not r.get("ok"):
            msg = r.get("error") or r.get("message", "")
            if not cuda and "CUDA" in msg:
                # every other case would fail the same way: say it once and stop
                print(f"  FAIL: {msg}\n\n{NEEDS_CUDA}", file=sys.stderr)
                return EXIT_FAIL
            rows.append(Row(case, "FAIL", msg))
            print(f"  FAIL: {msg}")
            continue
        row = Row(case, "pass", r.get("message", ""))
        if "stats" in r:
            row.stats = {k: v / 1e3 for k, v in r["stats"].items() if k != "runs"} | {"runs": r["stats"]["runs"]}
            nbytes = bytes_moved(case)
            row.tbps = nbytes / (row.stats["median"] * 1e-6) / 1e12
            if bw:
                row.pct_of_ceiling = 100 * row.tbps / bw
                row.sol_us = sol_us(nbytes, bw)
                row.suspect = is_suspect(row.stats["best"], nbytes, bw)
        if "report" in r:
            print(base64.b64decode(r["report"]).decode())
        rows.append(row)
    print_table(rows, mode)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"system": system_info(submission), "mode": mode, "read_ceiling_TBps": bw,
                       "cases": [dataclasses.asdict(r) for r in rows]}, f, indent=1)
    if args.plot:
        plot(rows, bw, args.plot)
    return 0 if all(r.status == "pass" for r in rows) else EXIT_FAIL


def print_table(rows, mode):
    print()
    if mode == "test" or mode == "profile":
        for r in rows:
            print(f"{spec_line(r.case):45s} {r.status}{'  ' + r.message if r.message else ''}")
        return
    head = f"{'case':34s} {'status':6s} {'median':>8s} {'p20/p80':>15s} {'mean +- err':>16s} {'best':>8s} " \
           f"{'TB/s':>6s} {'% ceil':>6s} {'SOL':>7s}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        name = f"{r.case['m']}x{r.case['k']}x{r.case['l']} seed {r.case.get('seed', '')}"
        if not r.stats:
            print(f"{name:34s} {r.status:6s}  {r.message}")
            continue
        st = r.stats
        pct = f"{r.pct_of_ceiling:5.0f}%" if r.pct_of_ceiling else "     -"
        sol = f"{r.sol_us:7.2f}" if r.sol_us else "      -"
        flag = "  SUSPECT: faster than the read ceiling allows" if r.suspect else ""
        print(f"{name:34s} {r.status:6s} {st['median']:8.2f} {st['p20']:7.2f}/{st['p80']:<7.2f} "
              f"{st['mean']:8.2f} +- {st['err']:5.2f} {st['best']:8.2f} {r.tbps:6.2f} {pct} {sol}{flag}")
    print("(times in us; % ceil: TB/s as a share of the DRAM read ceiling; SOL: bytes / that ceiling)\n"
          "(reads of these sizes cannot reach the ceiling: python bench.py gives each case's share of its read floor)")


def plot(rows, bw, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.stats]
    names = [f"{r.case['m']}x{r.case['k']}x{r.case['l']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows) + 2), 4))
    ax.bar(names, [r.tbps for r in rows], color="#4472c4", label="achieved")
    if bw:
        ax.axhline(bw, color="#c00000", linestyle="--", label=f"DRAM read ceiling (torch.sum, 2 GiB) {bw:.2f} TB/s")
    ax.set_ylabel("TB/s")
    ax.set_title("nvfp4_gemv: achieved bandwidth per case")
    ax.legend(loc="lower right")
    plt.xticks(rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------------------------------------- main


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", default="benchmark", choices=MODES)
    p.add_argument("testfile", nargs="?", default=None)
    p.add_argument("--submission", default=os.path.join(ROOT, "submission.py"))
    p.add_argument("--protocol", action="store_true", help="protocol mode even without POPCORN_FD (then exit 111)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return 2 if e.code else 0
    fd = os.environ.get("POPCORN_FD")
    protocol = fd is not None or args.protocol
    if protocol and fd is None:
        print("protocol mode needs POPCORN_FD", file=sys.stderr)
        return EXIT_NO_FD
    if protocol and args.testfile is None:
        print("protocol mode needs MODE and TESTFILE", file=sys.stderr)
        return 2
    global_seed = os.environ.pop("POPCORN_SEED", None)
    if args.testfile:
        try:
            with open(args.testfile) as f:
                cases = parse_test_file(f.read())
        except (OSError, TestFileError) as e:
            print(f"invalid test file {args.testfile}: {e}", file=sys.stderr)
            return EXIT_BAD_FILE
    else:
        cases = task_yml_cases("tests" if args.mode == "test" else "benchmarks")
    if global_seed is not None:
        cases = [dict(c, seed=mix_seed(c["seed"], int(global_seed))) if "seed" in c else c for c in cases]
    if not os.path.exists(args.submission):
        print(f"no submission at {args.submission}", file=sys.stderr)
        return 2
    if protocol:
        return protocol_main(args.mode, cases, os.path.abspath(args.submission), Output(int(fd)))
    return human_main(args.mode, cases, os.path.abspath(args.submission), args)


if __name__ == "__main__":
    sys.exit(main())

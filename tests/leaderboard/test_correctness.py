"""custom_kernel on a CUDA GPU: every task.yml shape, official and random signed inputs, both scale
layouts, any stream. The output is poisoned with NaN before each run."""

import warnings

import pytest
import torch

import inputs
import reference
import submission
from conftest import task_cases

pytestmark = pytest.mark.gpu

TASK_SHAPES = sorted({c[:3] for c in task_cases("tests") + task_cases("benchmarks")})
EXTRA_SHAPES = [(128, 64, 1), (128, 128, 3), (256, 192, 2), (1152, 960, 5), (128, 32768, 1), (640, 2752, 3)]


def run_and_check(data, **kw):
    poisoned = inputs.poisoned(data)
    out = submission.custom_kernel(poisoned)
    torch.cuda.synchronize()
    assert out.data_ptr() == poisoned[6].data_ptr(), "c must be written in place and returned"
    ok, msg = inputs.check_exact(data, out)
    assert ok, msg
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("m,k,l,seed", task_cases("tests") + task_cases("benchmarks"))
def test_official_inputs_match_reference(m, k, l, seed):
    run_and_check(reference.generate_input(m, k, l, seed))


@pytest.mark.parametrize("m,k,l", TASK_SHAPES + EXTRA_SHAPES)
def test_random_signed_inputs_match_float64(m, k, l):
    run_and_check(inputs.random_inputs(m, k, l, seed=m + k + l))


@pytest.mark.parametrize("m,k,l", [(128, 256, 1), (2432, 4608, 2), (384, 7168, 2), (4096, 7168, 8)])
def test_permuted_scales_used_when_plain_scales_are_on_cpu(m, k, l):
    data = inputs.random_inputs(m, k, l, seed=3)
    data = (*data[:2], data[2].cpu(), data[3].cpu(), *data[4:])
    poisoned = inputs.poisoned(data)
    out = submission.custom_kernel(poisoned)
    ok, msg = inputs.check_exact(data, out)
    assert ok, msg


@pytest.mark.parametrize("m,k,l", [(128, 1536, 1), (512, 4096, 2)])
def test_cute_path_forced_for_l1(m, k, l, monkeypatch):
    monkeypatch.setenv(submission.FORCE_CUTE_ENV, "1")
    run_and_check(inputs.random_inputs(m, k, l, seed=11))


def test_runs_on_the_current_non_default_stream():
    data = inputs.random_inputs(7168, 2048, 4, seed=5)
    submission.custom_kernel(inputs.poisoned(data))  # compile outside: a compile after the sleep outlasts it
    poisoned = inputs.poisoned(data)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # (the poison first)
    with torch.cuda.stream(s):
        # keeps s busy for about half a second: the kernel must queue behind this, and the host must reach the
        # read below first even on a machine loaded by the sharded GPU suite (100M cycles, ~55 ms, was not)
        torch.cuda._sleep(1_000_000_000)
        out = submission.custom_kernel(poisoned)
    early = out.cpu()  # on the default stream, which does not wait for s
    assert torch.isnan(early).all(), "the kernel ran before the work queued on its stream"
    s.synchronize()
    ok, msg = inputs.check_exact(data, out)
    assert ok, msg


def test_scales_wide_range_and_subnormal():
    data = inputs.random_inputs(256, 4096, 2, seed=9, min_exp=0, max_exp=12)
    run_and_check(data)


@pytest.mark.parametrize("m,k,l", [(256, 1024, 3), (128, 7168, 2)])
def test_other_layouts_of_c_and_padded_rows_of_a(m, k, l):
    data = inputs.random_inputs(m, k, l, seed=17)
    # a with rows padded to 48 extra bytes (still 16-byte aligned), c row-major [m, 1, l]
    padded = torch.zeros(l, m, k // 2 + 48, dtype=torch.uint8, device="cuda")
    padded[:, :, : k // 2] = data[0].view(torch.uint8).permute(2, 0, 1)
    a = padded[:, :, : k // 2].permute(1, 2, 0).view(torch.float4_e2m1fn_x2)
    c = torch.full((m, 1, l), float("nan"), dtype=torch.float16, device="cuda")
    data = (a, *data[1:6], c)
    out = submission.custom_kernel(data)
    ok, msg = inputs.check_exact(data, out)
    assert ok, msg


@pytest.mark.parametrize("m,k,l", sorted({c[:3] for c in task_cases("tests")}) + [(128, 64, 1), (256, 4608, 1)])
@pytest.mark.parametrize("config", ["streaming", "latency"])
def test_both_kernel_configs_match_float64(m, k, l, config):
    """The per-shape choice only picks between two configurations; each must be right on its own."""
    tuning = ()
    if config == "latency":  # a lane's whole share in one unit, as latency_tuning gives one-wave shapes
        chunks = k // 32
        group = min(32, chunks & -chunks)
        tuning = (("batch", chunks // group), ("group", group), ("min_blocks", 2))
        op = submission.make_op(k, False, **dict(tuning))
        assert op.batch == op.per_lane, "one unit a lane: all of its loads in flight at once"
    data = inputs.random_inputs(m, k, l, seed=m + k)
    out = submission.run_cute(inputs.poisoned(data), *submission.check_inputs(data), tuning=tuning)
    ok, msg = inputs.check_exact(data, out)
    assert ok, msg


def test_cached_launch_plan_uses_the_new_tensors_of_each_call():
    """Calls with the same metadata reuse one launch plan; pointers are read afresh every call."""
    first = inputs.random_inputs(512, 4096, 2, seed=21)
    second = inputs.random_inputs(512, 4096, 2, seed=22)
    run_and_check(first)
    run_and_check(second)
    run_and_check(first)


@pytest.mark.parametrize("idx,name,offset", [(0, "a", 8), (1, "b", 8), (2, "sfa", 1)])
def test_cached_plan_still_rejects_a_misaligned_tensor(idx, name, offset):
    """The same shapes, strides, dtypes and devices hit the cached plan: only the per-call address check
    stands between a misaligned pointer and the kernel."""
    data = inputs.random_inputs(128, 256, 2, seed=23)
    run_and_check(data)
    moved = list(data)
    moved[idx] = inputs.misaligned(data[idx], offset)
    assert submission._metadata(moved) == submission._metadata(data)
    with pytest.raises(ValueError, match=f"'{name}'"):
        submission.custom_kernel(tuple(moved))


def test_operands_on_other_devices_are_named():
    data = list(inputs.random_inputs(128, 256, 1, seed=24))
    for idx, name, dev in ((1, "b", "cpu"), (6, "c", "cpu"), (4, "sfa_permuted", "cpu"), (2, "sfa", "meta")):
        d = list(data)
        d[idx] = d[idx].to(dev)
        with pytest.raises(ValueError, match=f"'{name}'"):
            submission.custom_kernel(tuple(d))


def test_dsl_launch_fallback_matches_float64(monkeypatch):
    """Where no fast launcher works (no apache-tvm-ffi and another DSL version's storage layout), launches
    go through the DSL's own call: that path must be right too."""
    data = inputs.random_inputs(384, 7168, 2, seed=31)
    plan = submission._CutePlan(data, *submission.check_inputs(data))
    monkeypatch.setattr(plan.kernel, "direct", False)
    monkeypatch.setattr(plan, "ffi", None)
    poisoned = inputs.poisoned(data)
    out = plan(poisoned)
    assert plan.storage is False
    ok, msg = inputs.check_exact(data, out)
    assert ok, msg


def test_launch_uses_tvm_ffi_where_installed():
    pytest.importorskip("tvm_ffi")
    data = inputs.random_inputs(256, 1024, 1, seed=32)
    plan = submission._CutePlan(data, *submission.check_inputs(data))
    assert plan.kernel.kind == "tvm-ffi" and plan.ffi is not None
    ok, msg = inputs.check_exact(data, plan(inputs.poisoned(data)))
    assert ok, msg


@pytest.mark.parametrize("path", ["direct", "dsl"])
def test_launch_paths_without_tvm_ffi_match_float64(path, monkeypatch):
    """The leaderboard's image may lack apache-tvm-ffi: its launch paths (our ctypes storage on DSL 4.3,
    else the DSL's own call, which warns once) must be right too."""
    import importlib.metadata as md

    monkeypatch.setenv(submission.LAUNCH_ENV, path)
    monkeypatch.setattr(submission, "_compiled", submission.KernelCache(submission._build))  # compiled anew
    monkeypatch.setattr(submission, "_warned", set())
    data = inputs.random_inputs(256, 2048, 2, seed=33)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plan = submission._CutePlan(data, *submission.check_inputs(data))
    dsl43 = md.version("nvidia-cutlass-dsl").startswith("4.3.")
    assert plan.kernel.kind == ("direct" if path == "direct" and dsl43 else "dsl")
    assert any("100 us" in str(w.message) for w in seen) == (plan.kernel.kind == "dsl")
    for seed in (34, 35):  # the first call builds the launch storage, the second reuses it
        d = inputs.random_inputs(256, 2048, 2, seed=seed)
        ok, msg = inputs.check_exact(d, plan(inputs.poisoned(d)))
        assert ok, msg
    # the bulk kernel's dynamic tiles: the tile counters' address in the launch's head
    d = inputs.random_inputs(2048, 7168, 4, seed=36)
    plan = submission._CutePlan(d, *submission.check_inputs(d))
    assert plan.kernel.op.dynamic and plan.kernel.kind == ("direct" if path == "direct" and dsl43 else "dsl")
    for _ in range(2):
        ok, msg = inputs.check_exact(d, plan(inputs.poisoned(d)))
        assert ok, msg


def test_scaled_mm_route_compiles_the_cute_kernel_only_when_forced(monkeypatch):
    """On an fp4 ``_scaled_mm`` GPU, L == 1 goes there; the CuTe kernel is built only for the override."""
    monkeypatch.setattr(submission, "_plans", {})
    monkeypatch.setattr(submission, "_recent", submission.RecentPlans())  # plans under the faked device_info
    info = submission.device_info(0)
    monkeypatch.setattr(submission, "device_info", lambda i: (info[0], info[1], True))
    routed = []

    def fake_scaled_mm(data):
        routed.append(1)
        data[6].copy_(inputs.expected(data))
        return data[6]

    monkeypatch.setattr(submission, "_run_scaled_mm", fake_scaled_mm)
    data = inputs.random_inputs(640, 1024, 1, seed=43)
    run_and_check(data)
    plan = next(iter(submission._plans.values()))
    assert routed == [1] and isinstance(plan, submission._ScaledMmPlan) and plan.cute is None
    monkeypatch.setenv(submission.FORCE_CUTE_ENV, "1")
    run_and_check(data)
    assert routed == [1] and plan.cute is not None

"""custom_kernel's fast path: a call whose tensors have the last call's metadata (checked in C++ by torch's
TensorGuards) reuses that plan without computing the key; anything the key tells apart, the guard does too.
Runs on the CPU (plans are faked where a GPU would build them)."""

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")

import inputs
import submission


def good():
    return list(inputs.random_inputs(256, 512, 2, seed=1, device="cpu"))


def column_major(t):
    u = t.view(torch.uint8)
    return u.transpose(0, 1).contiguous().transpose(0, 1).view(t.dtype)


def data_replaced(d, idx, t):
    t = d[idx].clone() if t is None else t
    return [*d[:idx], t, *d[idx + 1:]]


def test_the_guard_passes_its_self_check_on_this_torch():
    assert submission._make_guard is not None


def changed(d, idx):
    """Variants of ``d`` whose tensor ``idx`` differs in one piece of metadata the key holds."""
    t = d[idx]
    other = t.view(torch.bfloat16 if t.dtype == torch.float16 else torch.uint8)
    yield "dtype", data_replaced(d, idx, other)
    yield "shape", data_replaced(d, idx, t[:-1])
    if t.dim() >= 2 and t.shape[0] > 1 and t.shape[1] > 1:
        yield "strides", data_replaced(d, idx, column_major(t))
    yield "device", data_replaced(d, idx, t.to("meta"))
    moved = t.clone()
    moved.data = torch.cat([t, t], dim=-1)[..., : t.shape[-1]]  # the same object, other strides
    yield "t.data", data_replaced(d, idx, moved)


@pytest.mark.parametrize("idx", range(7))
def test_the_guard_rejects_what_the_key_tells_apart(idx):
    d = good()
    guard = submission._make_guard(d)
    assert guard.check(*[t.clone() for t in d])  # fresh tensors, the same metadata
    key = submission._metadata(d)
    for what, v in changed(d, idx):
        assert not guard.check(*v), f"{submission._NAMES[idx]}: {what}"
        if what != "device":  # off CUDA the key keeps only get_device() == -1: the guard is stricter there
            assert submission._metadata(v) != key, what


class FakePlan:
    guard = None

    def __init__(self, calls):
        self.calls = calls

    def __call__(self, data):
        self.calls.append("launch")
        return data[6]


def test_calls_with_a_recent_calls_metadata_skip_the_key(monkeypatch):
    calls = []
    key_of = submission._metadata
    monkeypatch.setattr(submission, "_plans", {})
    monkeypatch.setattr(submission, "_recent", submission._RecentPlans())
    monkeypatch.setattr(submission, "_new_plan", lambda data, key: calls.append("plan") or FakePlan(calls))
    monkeypatch.setattr(submission, "_metadata", lambda data: calls.append("key") or key_of(data))
    d = good()
    c = torch.empty_strided((256, 1, 2), (1, 512, 256), dtype=torch.float16)
    steps = [(tuple(d), ["key", "plan", "launch"]),
             (tuple(t.clone() for t in d), ["launch"]),                     # new tensors, the same metadata
             (tuple(data_replaced(d, 6, c)), ["key", "plan", "launch"]),    # other strides of c: a new plan
             (tuple(data_replaced(d, 6, c.clone())), ["launch"]),           # ... found by its guard now
             (tuple(d), ["launch"])]                                        # and the first one still
    for data, expected in steps:
        calls.clear()
        submission.custom_kernel(data)
        assert calls == expected


def test_only_the_newest_plans_are_kept():
    recent = submission._RecentPlans()
    plans = []
    for i in range(recent.SIZE + 2):
        d = list(inputs.random_inputs(128 * (i + 1), 512, 1, seed=i, device="cpu"))
        plans.append((d, FakePlan([])))
        recent.add(None, d, plans[-1][1])
    assert len(recent.entries) == recent.SIZE
    assert recent.find(None, plans[0][0]) is None and recent.find(None, plans[-1][0]) is plans[-1][1]
    assert recent.find("other tag", plans[-1][0]) is None


class Subclass(torch.Tensor):
    pass


def test_no_guard_for_tensor_subclasses_or_nested_tensors():
    """A guard keeps a borrowed pointer to each tensor's type: a subclass could be freed and its address
    reused; a strided nested tensor aborts the guard's stride read. Neither is ever guarded or checked."""
    recent = submission._RecentPlans()
    d = good()
    recent.add(None, data_replaced(d, 6, d[6].as_subclass(Subclass)), FakePlan([]))
    assert recent.entries == ()
    nested = torch.nested.nested_tensor([torch.zeros(3, 4)])
    recent.add(None, data_replaced(d, 0, nested), FakePlan([]))
    assert recent.entries == ()
    recent.add(None, d, FakePlan([]))
    assert recent.find(None, data_replaced(d, 0, nested)) is None


def closed_file(tmp_path):
    f = open(tmp_path / "f", "w")
    f.close()
    return f


def test_malformed_calls_after_a_cached_plan_still_raise_naming_the_argument(monkeypatch, tmp_path):
    class UnusablePlan:
        guard = None

        def __call__(self, data):
            pytest.fail("a malformed call reached the cached plan")

    d = good()
    recent = submission._RecentPlans()
    recent.add(None, d, UnusablePlan())
    monkeypatch.setattr(submission, "_recent", recent)
    nested = torch.nested.nested_tensor([torch.zeros(3, 4)])
    for bad, word in ((tuple(d[:6]), "'data'"), (torch.zeros(7), "'data'"), (5, "'data'"),
                      (closed_file(tmp_path), "'data'"),
                      (tuple(data_replaced(d, 0, d[0].view(torch.uint8))), "'a'"),
                      (tuple(data_replaced(d, 0, nested)), "'a'"),
                      (tuple(data_replaced(d, 6, d[6].to_sparse())), "'c'")):
        with pytest.raises(TypeError, match=word):
            submission.custom_kernel(bad)


def test_gemv_with_a_recent_calls_metadata_skips_the_key(monkeypatch):
    from nvfp4_gemv import op

    calls = []

    class OpPlan:
        guard = None

        def __call__(self, x, xs, w, ws, alpha, out, out_dtype):
            calls.append(("launch", out_dtype))
            return out

    args = inputs.op_inputs(2, 128, 256, seed=1, device="cpu")
    out = torch.empty(2, 128, dtype=torch.float16)
    key_of = op._key
    monkeypatch.setattr(op, "_plans", {key_of(*args, None, torch.bfloat16): OpPlan(),
                                       key_of(*args, out, torch.float16): OpPlan()})
    monkeypatch.setattr(op, "_recent", submission._RecentPlans())
    monkeypatch.setattr(op, "_key", lambda *a: calls.append("key") or key_of(*a))
    fresh = [t.clone() for t in args]
    steps = [(lambda: op.gemv(*args), ["key", ("launch", torch.bfloat16)]),
             (lambda: op.gemv(*fresh), [("launch", torch.bfloat16)]),
             (lambda: op.gemv(*args, out=out), ["key", ("launch", torch.float16)]),
             (lambda: op.gemv(*fresh, out=out.clone()), [("launch", torch.float16)]),
             # out of another dtype or layout than the plan's: the key (then the exact CPU path)
             (lambda: op.gemv(*args, out=torch.empty(2, 128, dtype=torch.bfloat16)), ["key"]),
             (lambda: op.gemv(*args, out=torch.empty(128, 2, dtype=torch.float16).t()), ["key"]),
             (lambda: op.gemv(*args, out_dtype=torch.float16), ["key"]),   # no plan for it on the CPU
             (lambda: op.gemv(*args[:4], None), ["key"])]                  # no alpha: another key
    for i, (call, expected) in enumerate(steps):
        calls.clear()
        try:
            call()
        except ValueError:  # the exact path rejects the transposed out: only the calls matter here
            pass
        assert calls == expected, i

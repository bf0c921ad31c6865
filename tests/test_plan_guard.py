"""custom_kernel's and gemv's fast path: a call whose tensors have the metadata of a recent call, found by
its anchor tensor (custom_kernel's a, gemv's w) or among the last few plans and checked in C++ by torch's
TensorGuards, reuses that plan without computing the key; anything the key tells apart, the guard does too.
Runs on the CPU (plans are faked where a GPU would build them)."""

import collections

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
    variants = ()
    hit_path = submission._ScaledMmPlan.hit_path  # the hit path through self(data)

    def __init__(self, calls):
        self.calls = calls

    def __call__(self, data):
        self.calls.append("launch")
        return data[6]


def test_calls_with_a_recent_calls_metadata_skip_the_key(monkeypatch):
    calls = []
    key_of = submission._metadata
    monkeypatch.setattr(submission, "_recent", submission._RecentPlans())
    plans = {}
    monkeypatch.setattr(submission, "_plans", plans)

    def new_plan(data, key):
        calls.append("plan")
        plans[key] = FakePlan(calls)
        return plans[key]

    monkeypatch.setattr(submission, "_new_plan", new_plan)
    monkeypatch.setattr(submission, "_metadata", lambda data: calls.append("key") or key_of(data))
    d = good()
    c = torch.empty_strided((256, 1, 2), (1, 512, 256), dtype=torch.float16)
    steps = [(tuple(d), ["key", "plan", "launch"]),
             (tuple(t.clone() for t in d), ["launch"]),                     # new tensors, the same metadata
             (tuple(data_replaced(d, 6, c)), ["key", "plan", "launch"]),    # other strides of c: a new plan
             (tuple(data_replaced(d, 6, c.clone())), ["launch"]),           # ... found by its guard now
             (tuple(d), ["launch"]),                                        # a's first plan: a recent one
             (tuple(t.clone() for t in d), ["launch"])]                     # and the newest plan again
    for data, expected in steps:
        calls.clear()
        submission.custom_kernel(data)
        assert calls == expected


def test_tensors_the_key_cannot_tell_from_the_plans_get_a_guard_of_their_own(monkeypatch):
    """A Parameter has the key of the plain tensor it wraps, not its guard: after one call through the key
    it has a guard of its own, instead of paying the key on every call."""
    calls = []
    key_of = submission._metadata
    plans = {}
    monkeypatch.setattr(submission, "_plans", plans)
    monkeypatch.setattr(submission, "_recent", submission._RecentPlans())

    def new_plan(data, key):
        calls.append("plan")
        plans[key] = FakePlan(calls)
        return plans[key]

    monkeypatch.setattr(submission, "_new_plan", new_plan)
    monkeypatch.setattr(submission, "_metadata", lambda data: calls.append("key") or key_of(data))
    d = good()
    p = data_replaced(d, 0, torch.nn.Parameter(d[0], requires_grad=False))
    fresh_p = lambda: data_replaced(d, 0, torch.nn.Parameter(d[0].clone(), requires_grad=False))  # noqa: E731
    for i, (data, expected) in enumerate(((d, ["key", "plan", "launch"]), (p, ["key", "launch"]), (p, ["launch"]),
                                          ([t.clone() for t in d], ["launch"]), (d, ["launch"]), (p, ["launch"]),
                                          # fresh anchors of both kinds, alternating: each kind's guard is kept
                                          (fresh_p(), ["launch"]), ([t.clone() for t in d], ["launch"]),
                                          (fresh_p(), ["launch"]))):
        calls.clear()
        submission.custom_kernel(data)
        assert calls == expected, i
    assert len(next(iter(plans.values())).variants) == 2


def test_fresh_anchors_of_alternating_shapes_find_their_plans_without_the_key(monkeypatch):
    """``w.detach()`` each call, or the leaderboard's fresh inputs: no anchor is ever seen twice, and the
    recent plans are tried in turn."""
    calls = []
    key_of = submission._metadata
    plans = {}
    monkeypatch.setattr(submission, "_plans", plans)
    monkeypatch.setattr(submission, "_recent", submission._RecentPlans())

    def new_plan(data, key):
        calls.append("plan")
        plans[key] = FakePlan(calls)
        return plans[key]

    monkeypatch.setattr(submission, "_new_plan", new_plan)
    monkeypatch.setattr(submission, "_metadata", lambda data: calls.append("key") or key_of(data))
    shapes = [list(inputs.random_inputs(128 * (i + 1), 512, 1, seed=i, device="cpu")) for i in range(4)]
    for i, d in enumerate(shapes + shapes):  # the second round: each shape's plan is found again
        calls.clear()
        submission.custom_kernel([t.clone() for t in d])
        assert calls == (["launch"] if i >= 4 else ["key", "plan", "launch"]), i


def test_the_inlined_launch_passes_the_checked_tensors_pointers(monkeypatch):
    """The TVM-FFI launch in the hit path, with a recorder for the launcher: the five pointers come from the
    tensors the guard checked (the plain or the permuted scales, as the plan reads), then the plan's static
    arguments and the stream; misaligned pointers go to the plan's own call."""
    monkeypatch.setattr(submission, "_get_device", lambda: 0)
    monkeypatch.setattr(submission, "_current_stream", lambda dev: 1234)
    d = good()
    for plain in (True, False):
        launched, slow = [], []

        class Plan:
            variants = ()

            def __call__(self, data):
                slow.append(1)
                return data[6]

        plan = Plan()
        guard = submission._make_guard(d)
        hit = submission._hit_path(guard.check, plan, lambda *a: launched.append(a), (7, 8), 0, 15,
                                   (2, 3) if plain else (4, 5))
        assert hit(d) is d[6] and not slow
        sa, sb = (d[2], d[3]) if plain else (d[4], d[5])
        assert launched == [(d[0].data_ptr(), d[1].data_ptr(), sa.data_ptr(), sb.data_ptr(), d[6].data_ptr(),
                             7, 8, 1234)]
        if plain:  # an sfa 2 bytes off its 16-byte alignment, same metadata: the plan's call
            base = torch.empty(d[2].numel() + 8, dtype=torch.uint8)
            off = (16 - base.data_ptr() % 16) % 16 + 2
            moved = base[off:off + d[2].numel()].view(d[2].dtype).view(d[2].shape)
            moved = torch.as_strided(moved, d[2].shape, d[2].stride())
            assert moved.data_ptr() % 16 == 2 and guard.check(*data_replaced(d, 2, moved))
            launched.clear()
            assert hit(data_replaced(d, 2, moved)) is d[6] and slow and not launched


def test_each_anchor_tensor_finds_its_own_plan_and_the_tables_stay_bounded():
    recent = submission._RecentPlans()
    recent.SIZE, recent.RECENT = 3, 2
    calls, made = [], []
    for i in range(4):
        d = list(inputs.random_inputs(128 * (i + 1), 512, 1, seed=i, device="cpu"))
        made.append((d, FakePlan(calls)))
        recent.add(d[0], d, made[-1][1])
        recent.add(d[0], d, made[-1][1])  # again: no second entry, no eviction
        assert len(recent.hits) == i % 3 + 1 and len(recent.recent) == min(i + 1, 2)
    d, plan = made[-1]
    hit = plan.variants[0][1]
    assert recent.recent[0] is hit and recent.hits[id(d[0])] is hit and hit(d) is d[6] and calls == ["launch"]
    assert made[0][1].variants[0][1](d) is None  # another plan's guard: another shape


class Subclass(torch.Tensor):
    pass


def test_no_guard_for_tensor_subclasses_or_nested_tensors():
    """A guard keeps a borrowed pointer to each tensor's type: a subclass could be freed and its address
    reused; a strided nested tensor aborts the guard's stride read. Neither is ever guarded (nor is a
    nested tensor checked: test_nested_tensors_never_reach_a_guard)."""
    recent = submission._RecentPlans()
    d = good()
    recent.add(d[0], data_replaced(d, 6, d[6].as_subclass(Subclass)), FakePlan([]))
    assert recent.hits == {} and recent.recent == ()
    nested = torch.nested.nested_tensor([torch.zeros(3, 4)])
    recent.add(nested, data_replaced(d, 0, nested), FakePlan([]))
    assert recent.hits == {} and recent.recent == ()


NESTED_CALLS = """
import warnings
warnings.simplefilter("ignore")
import torch, inputs, submission
from nvfp4_gemv import op

class Plan:
    variants = ()
    hit_path = submission._ScaledMmPlan.hit_path
    def __call__(self, data):
        raise SystemExit("reached the plan")

d = list(inputs.random_inputs(256, 512, 2, seed=1, device="cpu"))
submission._recent.add(d[0], d, Plan())
nested = torch.nested.nested_tensor([torch.zeros(3, 4)])
for i in range(7):
    assert submission._recent.recent[0]([*d[:i], nested, *d[i + 1:]]) is None

class OpPlan:
    variants = ()
    hit_path = op._TokensPlan.hit_path
    launches, unswizzle_x, dev, ws_mask, out_template = [], False, -1, 1, None
    signature = (True, True, torch.bfloat16)

args = list(inputs.op_inputs(2, 128, 256, seed=1, device="cpu")) + [torch.empty(2, 128, dtype=torch.bfloat16)]
op._recent.add(args[2], args, OpPlan())
for i in range(6):
    a = [*args[:i], nested, *args[i + 1:]]
    assert op._recent.recent[0](*a, torch.bfloat16) is None
print("ok")
"""


def test_nested_tensors_never_reach_a_guard():
    """Its stride read aborts the process on a strided nested tensor: a subprocess sees that."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.path.dirname(here)]))
    proc = subprocess.run([sys.executable, "-c", NESTED_CALLS], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stderr[-2000:])


def closed_file(tmp_path):
    f = open(tmp_path / "f", "w")
    f.close()
    return f


def test_malformed_calls_after_a_cached_plan_still_raise_naming_the_argument(monkeypatch, tmp_path):
    class UnusablePlan:
        variants = ()
        hit_path = submission._ScaledMmPlan.hit_path

        def __call__(self, data):
            pytest.fail("a malformed call reached the cached plan")

    d = good()
    recent = submission._RecentPlans()
    recent.add(d[0], d, UnusablePlan())
    monkeypatch.setattr(submission, "_recent", recent)
    nested = torch.nested.nested_tensor([torch.zeros(3, 4)])
    for bad, word in ((tuple(d[:6]), "'data'"), (torch.zeros(7), "'data'"), (5, "'data'"),
                      (closed_file(tmp_path), "'data'"), (collections.deque(d), "'data'"), ((), "'data'"),
                      (tuple(data_replaced(d, 0, d[0].view(torch.uint8))), "'a'"),
                      (tuple(data_replaced(d, 0, nested)), "'a'"),
                      (tuple(data_replaced(d, 6, d[6].to_sparse())), "'c'")):
        with pytest.raises(TypeError, match=word):
            submission.custom_kernel(bad)


def test_gemv_with_a_recent_calls_metadata_skips_the_key(monkeypatch):
    from nvfp4_gemv import op

    calls = []

    class OpPlan:
        """The real hit path over a plan that launches nothing."""
        variants = ()
        hit_path = op._TokensPlan.hit_path
        launches, unswizzle_x, dev, ws_mask, out_template = [], False, -1, 1, None

        def __init__(self, *signature):
            self.signature = signature

        def __call__(self, x, xs, w, ws, alpha, out, out_dtype):
            calls.append(("launch" if self.signature[0] else "launch without alpha", out_dtype))
            return torch.empty(0) if out is None else out

    args = inputs.op_inputs(2, 128, 256, seed=1, device="cpu")
    out = torch.empty(2, 128, dtype=torch.float16)
    key_of = op._key
    monkeypatch.setattr(op, "_plans", {key_of(*args, None, torch.bfloat16): OpPlan(True, False, torch.bfloat16),
                                       key_of(*args, out, torch.float16): OpPlan(True, True, torch.float16),
                                       key_of(*args[:4], None, None, torch.bfloat16): OpPlan(False, False, torch.bfloat16)})
    monkeypatch.setattr(op, "_recent", submission._RecentPlans())
    monkeypatch.setattr(op, "_key", lambda *a: calls.append("key") or key_of(*a))
    fresh = [t.clone() for t in args]
    steps = [(lambda: op.gemv(*args), ["key", ("launch", torch.bfloat16)]),
             (lambda: op.gemv(*fresh), [("launch", torch.bfloat16)]),       # the newest plan
             (lambda: op.gemv(*fresh, out_dtype=torch.float16), ["key"]),   # not for another result dtype
             (lambda: op.gemv(*args, out=out), ["key", ("launch", torch.float16)]),
             (lambda: op.gemv(*fresh, out=out.clone()), [("launch", torch.float16)]),
             # out of another dtype or layout than the plan's: the key (then the exact CPU path)
             (lambda: op.gemv(*args, out=torch.empty(2, 128, dtype=torch.bfloat16)), ["key"]),
             (lambda: op.gemv(*args, out=torch.empty(128, 2, dtype=torch.float16).t()), ["key"]),
             (lambda: op.gemv(*args, out_dtype=torch.float16), ["key"]),   # no plan for it on the CPU
             (lambda: op.gemv(*args[:4], None), ["key", ("launch without alpha", torch.bfloat16)]),
             (lambda: op.gemv(*fresh), [("launch", torch.bfloat16)])]  # the plan with alpha, not the newest
    for i, (call, expected) in enumerate(steps):
        calls.clear()
        try:
            call()
        except ValueError:  # the exact path rejects the transposed out: only the calls matter here
            pass
        assert calls == expected, i

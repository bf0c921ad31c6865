"""custom_kernel's and gemv's fast path: a call whose tensors have the metadata of a recent call, found by
its anchor tensor (custom_kernel's a, gemv's w) or among the last few plans and checked in C++ by torch's
TensorGuards, reuses that plan without computing the key; anything the key tells apart, the guard does too.
Runs on the CPU (plans are faked where a GPU would build them)."""

import collections
import threading

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


@pytest.fixture
def counted(monkeypatch):
    """custom_kernel with empty plan caches, fake plans, and a log of what each call did: ``"key"`` (the
    Python key computed), ``"plan"`` (a plan made), ``"launch"`` (a plan called). Returns ``(log, plans)``."""
    calls, plans = [], {}
    key_of = submission._metadata
    monkeypatch.setattr(submission, "_plans", plans)
    monkeypatch.setattr(submission, "_recent", submission.RecentPlans())

    def new_plan(data, key):
        calls.append("plan")
        plans[key] = FakePlan(calls)
        return plans[key]

    monkeypatch.setattr(submission, "_new_plan", new_plan)
    monkeypatch.setattr(submission, "_metadata", lambda data: calls.append("key") or key_of(data))
    return calls, plans


def test_calls_with_a_recent_calls_metadata_skip_the_key(counted):
    calls, _ = counted
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


def test_tensors_the_key_cannot_tell_from_the_plans_get_a_guard_of_their_own(counted):
    """A Parameter has the key of the plain tensor it wraps, not its guard: after one call through the key
    it has a guard of its own, instead of paying the key on every call."""
    calls, plans = counted
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


def test_tuple_subclasses_reuse_their_plan_through_the_key(counted):
    """A namedtuple of the 7 tensors is validated as a tuple: its plan is cached by key (the cached hit path
    takes exact tuples and lists only)."""
    calls, _ = counted
    Data = collections.namedtuple("Data", "a b sfa sfb sfa_p sfb_p c")
    d = Data(*good())
    for expected in (["key", "plan", "launch"], ["key", "launch"]):
        calls.clear()
        assert submission.custom_kernel(d) is d.c
        assert calls == expected


def test_fresh_anchors_of_alternating_shapes_find_their_plans_without_the_key(counted):
    """``w.detach()`` each call, or the leaderboard's fresh inputs: no anchor is ever seen twice, and the
    recent plans are tried in turn."""
    calls, _ = counted
    shapes = [list(inputs.random_inputs(128 * (i + 1), 512, 1, seed=i, device="cpu")) for i in range(4)]
    for i, d in enumerate(shapes + shapes):  # the second round: each shape's plan is found again
        calls.clear()
        submission.custom_kernel([t.clone() for t in d])
        assert calls == (["launch"] if i >= 4 else ["key", "plan", "launch"]), i


def moved_to(t, offset):
    """A tensor with ``t``'s metadata and contents at an address ``offset`` bytes past a 16-byte boundary."""
    extent = (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()
    base = torch.empty(extent + 32, dtype=torch.uint8)
    start = (16 - base.data_ptr() % 16) % 16 + offset
    out = torch.as_strided(base[start:start + extent].view(t.dtype), t.shape, t.stride())
    out.copy_(t)
    return out


@pytest.mark.parametrize("dynamic", [0, 3], ids=["static tiles", "dynamic tiles"])
@pytest.mark.parametrize("plain", [True, False], ids=["plain scales", "permuted scales"])
def test_the_inlined_launch_passes_the_checked_tensors_pointers(monkeypatch, plain, dynamic):
    """The TVM-FFI launch in the hit path, with a recorder for the launcher: the five pointers come from the
    tensors the guard checked (the plain or the permuted scales, as the plan reads), then the tile counters
    of the current stream (0 for a plan without dynamic tiles), the plan's static arguments and the stream;
    a pointer the kernel cannot take (a or b off 16 bytes, sfa off the plan's mask, sfb odd) or another
    current device goes to the plan's own call, as ``_CutePlan.__call__`` does."""
    device = [0]
    monkeypatch.setattr(submission, "current_device", lambda: device[0])
    monkeypatch.setattr(submission, "current_stream", lambda dev: 1234)
    monkeypatch.setattr(submission, "tile_counters", lambda dev, stream, l: (dev, stream, l))
    d = good()
    launched, slow = [], []

    class Plan:
        variants = ()

        def __call__(self, data):
            slow.append(1)
            return data[6]

    sfa_mask = 15 if plain else 1  # the bulk kernel's 16-byte sfa rows, else 2-byte reads
    i_a, i_b = (2, 3) if plain else (4, 5)
    guard = submission._make_guard(d)
    hit = submission._hit_path(guard.check, Plan(), lambda *a: launched.append(a), (7, 8), 0, sfa_mask, (i_a, i_b),
                               dynamic)
    assert hit(d) is d[6] and not slow
    assert launched == [(d[0].data_ptr(), d[1].data_ptr(), d[i_a].data_ptr(), d[i_b].data_ptr(), d[6].data_ptr(),
                         (0, 1234, 3) if dynamic else 0, 7, 8, 1234)]
    for idx, offset in ((0, 8), (1, 4), (i_a, 2 if plain else 1), (i_b, 1)):
        moved = data_replaced(d, idx, moved_to(d[idx], offset))
        assert guard.check(*moved), idx
        launched.clear(), slow.clear()
        assert hit(moved) is d[6] and slow == [1] and not launched, idx
    for idx in (i_a, i_b):  # offsets the kernel takes: launched from the moved tensor
        moved = data_replaced(d, idx, moved_to(d[idx], 16 if idx == i_a and plain else 2))
        launched.clear(), slow.clear()
        assert hit(moved) is d[6] and not slow and launched[0][2 + (idx == i_b)] == moved[idx].data_ptr(), idx
    device[0] = 1
    launched.clear(), slow.clear()
    assert hit(d) is d[6] and slow == [1] and not launched


@pytest.mark.parametrize("dynamic", [0, 3], ids=["static tiles", "dynamic tiles"])
@pytest.mark.parametrize("path", ["tvm-ffi", "direct", "dsl"])
def test_a_plans_own_call_passes_the_streams_tile_counters_on_every_launch_path(monkeypatch, path, dynamic):
    """``_CutePlan.__call__`` with a recorder in place of each launcher: the five pointers, the tile counters
    of the current stream (0 for a plan without dynamic tiles), the plan's static arguments, the stream."""
    import contextlib
    import ctypes

    monkeypatch.setattr(submission, "current_device", lambda: 0)
    monkeypatch.setattr(submission, "current_stream", lambda dev: 1234)
    monkeypatch.setattr(submission, "tile_counters", lambda dev, stream, l: 5000 + 100 * stream // 1234 + l)
    monkeypatch.setattr(submission.torch.cuda, "device", lambda dev: contextlib.nullcontext())
    d = good()
    launched = []

    class Kernel:
        def launch_dsl(self, values, stream):
            launched.append((*values, stream))

    plan = object.__new__(submission._CutePlan)
    plan.dev, plan.scale_idx, plan.sfa_mask, plan.static, plan.dynamic = 0, (2, 3), 1, (7, 8), dynamic
    plan.kernel, plan.lock, plan.ffi, plan.storage = Kernel(), threading.Lock(), None, False
    if path == "tvm-ffi":
        plan.ffi = lambda *a: launched.append(a)
    elif path == "direct":
        head = (ctypes.c_int64 * 7)()
        plan.storage = (head, None, None, ctypes.c_int32(0),
                        lambda packed: launched.append(tuple(submission._HEAD.unpack_from(head))))
    assert plan(d) is d[6]
    ptrs = (d[0].data_ptr(), d[1].data_ptr(), d[2].data_ptr(), d[3].data_ptr(), d[6].data_ptr())
    ctr = 5103 if dynamic else 0
    static = () if path == "direct" else (7, 8)  # the direct path's static values live in its storage
    assert launched == [(*ptrs, ctr, *static, 1234)]


def test_a_plan_keeps_a_few_guard_variants():
    """Tensor sets of one key that the guard tells apart (here a Parameter at one position or another) get
    guards of their own, at most ``VARIANTS`` a plan, the newest kept."""
    recent = submission.RecentPlans()
    plan = FakePlan([])
    d = good()
    sets = [d] + [data_replaced(d, i, torch.nn.Parameter(d[i], requires_grad=False)) for i in range(6)]
    for ts in sets:
        recent.add(ts[0], ts, plan)
    assert len(plan.variants) == recent.VARIANTS
    assert plan.variants[0][1](sets[-1]) is d[6] and plan.variants[-1][1](sets[-recent.VARIANTS]) is d[6]
    assert all(g.check(*d) is False for g, _ in plan.variants)


def test_a_hit_found_among_the_recent_plans_is_filed_under_its_anchor():
    """An anchor whose filed hit stops matching (a prefill's shape, then decode's) and whose new tensors
    match another recent plan gets that plan's hit, so its next call does not scan again."""
    recent = submission.RecentPlans()
    calls = []
    a, b = FakePlan(calls), FakePlan(calls)
    d1 = good()
    d2 = list(inputs.random_inputs(384, 512, 1, seed=3, device="cpu"))
    recent.add(d2[0], d2, b)
    recent.add(d1[0], d1, a)
    anchor = d1[0]
    e = [anchor] + [t.clone() for t in d2[1:]]  # d1's a: the wrong shape for plan b's guard
    recent.hits[id(anchor)] = b.variants[0][1]
    assert recent.hits[id(anchor)](d1) is None
    assert recent.scan(anchor, recent.hits[id(anchor)], d1) is d1[6] and recent.hits[id(anchor)] is a.variants[0][1]
    assert recent.scan(anchor, None, e) is None  # nothing takes it: nothing filed
    assert recent.hits[id(anchor)] is a.variants[0][1]
    recent.SIZE = len(recent.hits)  # a full table: a scan's hit is returned, but no new anchor is filed
    other = d1[0].clone()
    assert recent.scan(other, None, [other, *d1[1:]]) is d1[6] and id(other) not in recent.hits


def test_each_anchor_tensor_finds_its_own_plan_and_the_tables_stay_bounded():
    recent = submission.RecentPlans()
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
    recent = submission.RecentPlans()
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
from nvfp4_gemv import op, op_plan

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
    hit_path = op_plan.W4A4Plan.hit_path
    launches, unswizzle_x, dev, ws_mask, out_shape, device = [], False, -1, 1, None, None
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

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    recent = submission.RecentPlans()
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
    from nvfp4_gemv import op, op_plan

    calls = []

    class OpPlan:
        """The real hit path over a plan that launches nothing."""
        variants = ()
        hit_path = op_plan.W4A4Plan.hit_path
        launches, unswizzle_x, dev, ws_mask, out_shape, device = [], False, -1, 1, None, None

        def __init__(self, *signature):
            self.signature = signature

        def __call__(self, x, xs, w, ws, alpha, out, out_dtype):
            calls.append(("launch" if self.signature[0] else "launch without alpha", out_dtype))
            return torch.empty(0) if out is None else out

    args = inputs.op_inputs(2, 128, 256, seed=1, device="cpu")
    out = torch.empty(2, 128, dtype=torch.float16)
    key_of = op_plan.w4a4_key
    monkeypatch.setattr(op_plan, "_plans", {key_of(*args, None, torch.bfloat16): OpPlan(True, False, torch.bfloat16),
                                            key_of(*args, out, torch.float16): OpPlan(True, True, torch.float16),
                                            key_of(*args[:4], None, None, torch.bfloat16): OpPlan(False, False,
                                                                                                   torch.bfloat16)})
    monkeypatch.setattr(op, "_recent", op.launch.RecentPlans())
    monkeypatch.setattr(op_plan, "w4a4_key", lambda *a: calls.append("key") or key_of(*a))
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


def test_a_sparse_alpha_never_reaches_a_dense_alphas_plan(monkeypatch):
    """A COO tensor reports zero strides instead of raising: the key holds alpha's layout, so a sparse alpha
    of a cached plan's shape goes to the full validation (a TypeError naming alpha), never to the plan."""
    from nvfp4_gemv import op, op_plan

    class UnusablePlan:
        variants = ()
        hit_path = op_plan.W4A4Plan.hit_path
        launches, unswizzle_x, dev, ws_mask, out_shape, device = [], False, -1, 1, None, None
        signature = (True, False, torch.bfloat16)

        def __call__(self, *args):
            pytest.fail("a sparse alpha reached the cached plan")

    args = list(inputs.op_inputs(2, 128, 256, seed=1, device="cpu"))
    monkeypatch.setattr(op_plan, "_plans", {op_plan.w4a4_key(*args, None, torch.bfloat16): UnusablePlan()})
    monkeypatch.setattr(op, "_recent", op.launch.RecentPlans())
    with pytest.raises(TypeError, match="'alpha'"):
        op.gemv(*args[:4], args[4].to_sparse())



def test_gemv_inlined_launch_passes_the_checked_tensors_pointers(monkeypatch):
    """gemv's TVM-FFI launch in the hit path, with a recorder for the launcher: w, x (+ the group's offset),
    w_scale, x_scale (+ offset), out (+ offset), alpha, the plan's static arguments, the stream; the result
    allocated from the plan's template where no out is given; an odd x_scale goes to the plan's own call."""
    from nvfp4_gemv import launch, op, op_plan

    monkeypatch.setattr(launch, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "current_stream", lambda dev: 1234)
    launched, slow = [], []

    class Kern:
        ffi = staticmethod(lambda *a: launched.append(a))

    class Plan:
        variants = ()
        hit_path = op_plan.W4A4Plan.hit_path
        launches = [(Kern, (16, 2, 4), (7, 8))]
        unswizzle_x, dev, ws_mask = False, 0, 1
        signature = (True, False, torch.bfloat16)
        out_shape, device = (2, 128), torch.device("cpu")

        def __call__(self, *args):
            slow.append(1)
            return args[5]

    x, xs, w, ws, a = inputs.op_inputs(2, 128, 256, seed=1, device="cpu")
    hit = Plan().hit_path(launch._make_guard((x, xs, w, ws, a)).check)
    out = hit(x, xs, w, ws, a, None, torch.bfloat16)
    assert out.shape == (2, 128) and out.dtype == torch.bfloat16 and out.is_contiguous() and not slow
    assert launched == [(w.data_ptr(), x.data_ptr() + 16, ws.data_ptr(), xs.data_ptr() + 2, out.data_ptr() + 4,
                         a.data_ptr(), 7, 8, 1234)]
    odd = moved_to(xs, 1)
    launched.clear()
    hit(x, odd, w, ws, a, None, torch.bfloat16)
    assert slow == [1] and not launched

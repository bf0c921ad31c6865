"""custom_kernel's fast path: a call whose tensors have the last call's metadata (checked in C++ by torch's
TensorGuards) reuses that plan without computing the key; anything the key tells apart, the guard does too.
Runs on the CPU (plans are faked where a GPU would build them)."""

import pytest
import torch

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


def test_a_call_with_the_last_calls_metadata_skips_the_key(monkeypatch):
    calls = []

    class FakePlan:
        guard = None

        def __call__(self, data):
            calls.append("launch")
            return data[6]

    key_of = submission._metadata
    monkeypatch.setattr(submission, "_plans", {})
    monkeypatch.setattr(submission, "_last", None)
    monkeypatch.setattr(submission, "_new_plan", lambda data, key: calls.append("plan") or FakePlan())
    monkeypatch.setattr(submission, "_metadata", lambda data: calls.append("key") or key_of(data))
    d = good()
    submission.custom_kernel(tuple(d))
    assert calls == ["key", "plan", "launch"]
    calls.clear()
    submission.custom_kernel(tuple(t.clone() for t in d))
    assert calls == ["launch"]
    calls.clear()
    c = torch.empty_strided((256, 1, 2), (1, 512, 256), dtype=torch.float16)
    submission.custom_kernel(tuple(data_replaced(d, 6, c)))
    assert calls == ["key", "plan", "launch"]


def test_malformed_calls_after_a_cached_plan_still_raise_naming_the_argument(monkeypatch):
    d = good()
    monkeypatch.setattr(submission, "_last", (submission._make_guard(d), lambda data: pytest.fail("plan used")))
    for bad, word in ((tuple(d[:6]), "'data'"), (torch.zeros(7), "'data'"), (5, "'data'"),
                      (tuple(data_replaced(d, 0, d[0].view(torch.uint8))), "'a'")):
        with pytest.raises(TypeError, match=word):
            submission.custom_kernel(bad)


def test_gemv_with_the_last_calls_metadata_skips_the_key(monkeypatch):
    from nvfp4_gemv import op

    calls = []

    class FakePlan:
        guard = None

        def __call__(self, x, xs, w, ws, alpha, out, out_dtype):
            calls.append(("launch", out_dtype))
            return out

    args = inputs.op_inputs(2, 128, 256, seed=1, device="cpu")
    key_of = op._key
    monkeypatch.setattr(op, "_plans", {key_of(*args, None, torch.bfloat16): FakePlan()})
    monkeypatch.setattr(op, "_last", None)
    monkeypatch.setattr(op, "_key", lambda *a: calls.append("key") or key_of(*a))
    op.gemv(*args)
    assert calls == ["key", ("launch", torch.bfloat16)]
    calls.clear()
    op.gemv(*[t.clone() for t in args])
    assert calls == [("launch", torch.bfloat16)]
    calls.clear()
    res = op.gemv(*args, out_dtype=torch.float16)  # another key: no plan on the CPU, the exact path
    assert calls == ["key"] and res.dtype == torch.float16
    calls.clear()
    res = op.gemv(*args[:4], None)  # no alpha: another key
    assert calls == ["key"] and res.dtype == torch.bfloat16

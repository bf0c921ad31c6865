"""The launch path's choices, on the CPU (the paths themselves run in tests/leaderboard/test_correctness.py)."""

import pytest

import submission


def test_a_failing_tvm_ffi_build_falls_back_with_one_warning(monkeypatch):
    calls = []

    def fake_compile(op, *args, options=""):
        calls.append(options)
        if "--enable-tvm-ffi" in options:
            raise RuntimeError("this apache-tvm-ffi does not fit this DSL")
        return "built"

    monkeypatch.setattr(submission.cute, "compile", fake_compile)
    monkeypatch.setattr(submission, "_warned", set())
    with pytest.warns(RuntimeWarning, match="compiled without it"):
        assert submission.dsl_compile(object(), (), "--gpu-arch sm_90a", tvm_ffi=True) == "built"
    assert calls == ["--gpu-arch sm_90a --enable-tvm-ffi", "--gpu-arch sm_90a"]


def test_other_build_failures_raise(monkeypatch):
    def fake_compile(op, *args, options=""):
        raise RuntimeError("ptxas failed")

    monkeypatch.setattr(submission.cute, "compile", fake_compile)
    with pytest.raises(RuntimeError, match="ptxas"):
        submission.dsl_compile(object(), (), "", tvm_ffi=False)


@pytest.mark.parametrize("env,want", [(None, True), ("tvm-ffi", True), ("direct", False), ("dsl", False)])
def test_launch_env_picks_the_build(env, want, monkeypatch):
    pytest.importorskip("tvm_ffi")
    if env is None:
        monkeypatch.delenv(submission.LAUNCH_ENV, raising=False)
    else:
        monkeypatch.setenv(submission.LAUNCH_ENV, env)
    assert ("--enable-tvm-ffi" in submission.launch_options("", None)) == want


def test_objects_without_the_ffi_protocol_are_not_tvm_ffi():
    assert submission.tvm_ffi_function(object()) is None
    assert submission.launch_kind(object()) == "dsl"


def test_a_plan_cache_starts_again_past_max_plans_and_keeps_the_newest():
    plans = {}
    for i in range(submission.MAX_PLANS):
        assert submission.keep_plan(plans, i, str(i)) == str(i)
    assert len(plans) == submission.MAX_PLANS
    submission.keep_plan(plans, "new", "plan")
    assert plans == {"new": "plan"}

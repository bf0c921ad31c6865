"""The bulk kernel's dynamic tiles (``Nvfp4GemvBulk(dynamic=1)``) on a CUDA GPU: every tile done once,
the counters back at zero after each launch, one counter set a stream so that launches on two streams at
once stay right, and the static schedule inside a CUDA graph capture. Outputs are poisoned with NaN (a
tile that no CTA took stays NaN) and compared with the float64 reference on random signed inputs."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import inputs
import submission

pytestmark = pytest.mark.gpu

DYNAMIC = (("bulk", 1), ("dynamic", 1))
# rows a tile 4 (K = 7168, 9216, 11264) and 2 (K = 8192, 10240); claims for most tiles (4096 x 7168 x 8; 128
# x 7168 x 200: one CTA a batch index, 3 static tiles and 29 claimed), for none (512 x 9216 x 4, 640 x 7168 x 1:
# the static steps hold every tile), from some CTAs only (384 x 7168 x 8: 96 tiles, 33 CTAs on 132 SMs, 30
# reach the last static step), and past 64 batch indices (the counters grow)
SHAPES = [(4096, 7168, 8), (2048, 11264, 2), (512, 9216, 4), (1024, 8192, 4), (4096, 10240, 3), (128, 7168, 80),
          (128, 7168, 200), (640, 7168, 1), (384, 7168, 8)]


def plan_for(data, tuning=DYNAMIC):
    plan = submission._CutePlan(data, *submission.check_inputs(data), tuning=tuning)
    assert plan.kernel.op.dynamic and plan.dynamic == data[0].shape[2]
    return plan


def counters(stream=None):
    stream = stream or torch.cuda.current_stream()
    return submission._counters[(torch.cuda.current_device(), stream.cuda_stream)][2]


def assert_exact(data, out):
    ok, msg = inputs.check_exact(data, out)
    assert ok, msg


@pytest.mark.parametrize("m,k,l", SHAPES)
def test_every_tile_is_done_once_and_the_counters_end_at_zero(m, k, l):
    data = inputs.random_inputs(m, k, l, seed=m + k + l)
    plan = plan_for(data)
    for _ in range(3):  # a launch that left its counters dirty would make the next one skip tiles
        out = plan(inputs.poisoned(data))
        torch.cuda.synchronize()
        assert_exact(data, out)
        assert not counters().any(), counters()[:l].tolist()


@pytest.mark.parametrize("m,k,l", [(4096, 7168, 8), (7168, 7168, 1)])
def test_the_dispatcher_takes_dynamic_tiles_for_several_rows_a_tile(m, k, l):
    data = inputs.random_inputs(m, k, l, seed=3)
    plan = submission._CutePlan(data, *submission.check_inputs(data))
    assert type(plan.kernel.op) is submission.Nvfp4GemvBulk and plan.kernel.op.dynamic
    for _ in range(2):  # the first call builds the plan's launch storage, the second is the hit path
        out = submission.custom_kernel(inputs.poisoned(data))
        torch.cuda.synchronize()
        assert_exact(data, out)


def test_launches_on_two_streams_at_once_use_their_own_counters():
    data = [inputs.random_inputs(2048, 7168, 4, seed=s) for s in (1, 2)]
    plan = plan_for(data[0])
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = [[], []]
    torch.cuda.synchronize()
    for _ in range(8):  # no synchronisation between the streams: their launches overlap
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                d = inputs.poisoned(data[i])
                outs[i].append((d, plan(d)))
    torch.cuda.synchronize()
    for i in range(2):
        for d, out in outs[i]:
            assert_exact(data[i], out)
        assert not counters(streams[i]).any()


def test_a_captured_launch_keeps_the_static_schedule_and_replays_beside_eager_ones():
    data = inputs.random_inputs(4096, 7168, 2, seed=4)
    plan = plan_for(data)
    captured = inputs.poisoned(data)
    plan(captured)  # warm up: compiled and launch storage built outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=side):
        plan(captured)
    assert (torch.cuda.current_device(), side.cuda_stream) not in submission._counters, "no counters captured"
    captured[6].fill_(float("nan"))
    eager = [inputs.poisoned(data) for _ in range(4)]
    torch.cuda.synchronize()
    graph.replay()  # on the current stream, beside eager launches on another
    with torch.cuda.stream(side):
        for d in eager:
            plan(d)
    torch.cuda.synchronize()
    assert_exact(data, captured[6])
    for d in eager:
        assert_exact(data, d[6])
    assert not counters(side).any()


def test_static_tuning_runs_without_counters():
    data = inputs.random_inputs(4096, 7168, 2, seed=6)
    plan = submission._CutePlan(data, *submission.check_inputs(data), tuning=(("bulk", 1),))
    assert not plan.kernel.op.dynamic and plan.dynamic == 0
    out = plan(inputs.poisoned(data))
    torch.cuda.synchronize()
    assert_exact(data, out)


def test_a_counter_left_past_the_claims_makes_the_launch_fail_loudly():
    """A counter found past all of a launch's claims (only another launch sharing it could leave one so)
    would never be reset, and every later launch on the stream would skip its claimed tiles: the kernel
    traps and the caller gets a CUDA error. In a child process: a trap ends the CUDA context."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{os.path.dirname(here)!r}, {here!r}]
        import torch, inputs, submission
        data = inputs.random_inputs(4096, 7168, 2, seed=8)
        plan = submission._CutePlan(data, *submission.check_inputs(data), tuning=(("bulk", 1), ("dynamic", 1)))
        plan(data)
        torch.cuda.synchronize()
        print("first launch ok", flush=True)
        submission._counters[(torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream)][2][1] = 1 << 20
        try:
            plan(inputs.poisoned(data))
            torch.cuda.synchronize()
        except Exception as e:
            print("raised", type(e).__name__, str(e).splitlines()[0])
            sys.exit(0)
        sys.exit(1)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "first launch ok" in r.stdout and "raised" in r.stdout, r.stdout + r.stderr

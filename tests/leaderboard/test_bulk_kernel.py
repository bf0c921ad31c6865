"""The bulk-copy kernel (``Nvfp4GemvBulk``) on a CUDA GPU: every tile split it can take, its tuning
knobs, padded rows, and the fall back to the other kernels where its alignment needs are not met.
Outputs are poisoned with NaN and compared with the float64 reference on random signed inputs."""

import pytest
import torch

import inputs
import submission
from conftest import check_chosen_kernel, task_cases

pytestmark = pytest.mark.gpu

BULK = (("bulk", 1),)
# tile splits: 8 threads a row (K = 256, 16 rows a tile), 32 (K = 7168, n = 7), 64, 128 (4 warps a row,
# n = 8 at K = 32768), n = 9 and n = 11 (K = 9216, 11264)
SHAPES = sorted({c[:3] for c in task_cases("tests") + task_cases("benchmarks")}
                | {(128, 256, 2), (128, 32768, 1), (256, 9216, 3), (640, 11264, 2), (1024, 16384, 1),
                   (384, 8192, 2), (128, 2048, 9)})


def check(data, tuning=BULK):
    out = submission.run_cute(inputs.poisoned(data), *submission.check_inputs(data), tuning=tuning)
    torch.cuda.synchronize()
    ok, msg = inputs.check_exact(data, out)
    assert ok, msg
    return out


@pytest.mark.parametrize("m,k,l", SHAPES)
def test_bulk_kernel_matches_float64(m, k, l):
    check(inputs.random_inputs(m, k, l, seed=m + k + l + 1))


@pytest.mark.parametrize("tune", [{"stages": 2}, {"stages": 5}, {"warps": 8, "ctas": 1}, {"evict": 0},
                                  {"max_n": 8}, {"ctas": 3}])
@pytest.mark.parametrize("m,k,l", [(7168, 16384, 1), (1024, 7168, 3)])
def test_bulk_tuning_knobs_keep_results(m, k, l, tune):
    check(inputs.random_inputs(m, k, l, seed=5), BULK + tuple(sorted(tune.items())))


@pytest.mark.parametrize("m,k,l", [(7168, 16384, 1), (4096, 7168, 8)])
def test_benchmark_shapes_take_the_bulk_kernel(m, k, l):
    check_chosen_kernel(inputs.random_inputs(m, k, l, seed=7), submission.Nvfp4GemvBulk)


def test_padded_aligned_rows_stay_on_the_bulk_kernel():
    data = inputs.padded(inputs.random_inputs(2048, 16384, 2, seed=9), 32, 16)
    check_chosen_kernel(data, submission.Nvfp4GemvBulk)


def test_sfa_rows_off_16_bytes_take_the_streaming_kernel():
    data = inputs.padded(inputs.random_inputs(2048, 16384, 2, seed=10), 0, 2)
    check_chosen_kernel(data, submission.Nvfp4Gemv)
    with pytest.raises(ValueError, match="bulk"):
        submission.run_cute(data, *submission.check_inputs(data), tuning=BULK)


@pytest.mark.parametrize("m,k,l", [(512, 9216, 4), (2048, 11264, 1)])
def test_one_wave_long_rows_take_the_bulk_kernel_or_without_it_the_latency_config(m, k, l):
    check_chosen_kernel(inputs.random_inputs(m, k, l, seed=13), submission.Nvfp4GemvBulk)
    data = inputs.padded(inputs.random_inputs(m, k, l, seed=14), 0, 2)
    check_chosen_kernel(data, submission.Nvfp4Gemv)
    op = submission._CutePlan(data, *submission.check_inputs(data)).kernel.op
    assert op.batch == op.per_lane, "a lane's whole share in one unit"


def test_cached_bulk_plan_with_a_misaligned_sfa_falls_back():
    """Plans are keyed by metadata, not addresses: a same-shaped sfa at an 8-byte offset must not reach
    the bulk copies (which need 16-byte alignment); the call goes to the streaming kernel."""
    data = inputs.random_inputs(2048, 16384, 1, seed=12)
    assert isinstance(submission._CutePlan(data, *submission.check_inputs(data)).kernel.op,
                      submission.Nvfp4GemvBulk)
    submission.custom_kernel(inputs.poisoned(data))
    sfa = data[2]
    raw = torch.zeros(sfa.numel() + 8, dtype=torch.uint8, device="cuda")
    moved = raw[8:].as_strided(sfa.shape, sfa.stride()).view(torch.float8_e4m3fn)  # same metadata
    moved.copy_(sfa)
    data = (data[0], data[1], moved, *data[3:])
    out = submission.custom_kernel(inputs.poisoned(data))
    torch.cuda.synchronize()
    ok, msg = inputs.check_exact(data, out)
    assert ok, msg


def test_cached_one_wave_bulk_plan_with_a_misaligned_sfa_falls_back_to_the_latency_config():
    """The fallback is the choice without the bulk kernel: for this one-wave shape the latency config
    (a lane's whole share in one unit), not the streaming default."""
    data = inputs.random_inputs(512, 9216, 4, seed=15)
    plan = submission._CutePlan(data, *submission.check_inputs(data))
    assert isinstance(plan.kernel.op, submission.Nvfp4GemvBulk)
    sfa = data[2]
    raw = torch.zeros(sfa.numel() + 8, dtype=torch.uint8, device="cuda")
    moved = raw[8:].as_strided(sfa.shape, sfa.stride()).view(torch.float8_e4m3fn)  # same metadata
    moved.copy_(sfa)
    data = (data[0], data[1], moved, *data[3:])
    out = plan(inputs.poisoned(data))
    torch.cuda.synchronize()
    op = plan.fallback.kernel.op
    assert type(op) is submission.Nvfp4Gemv and op.batch == op.per_lane
    ok, msg = inputs.check_exact(data, out)
    assert ok, msg

"""The streaming kernel's wide scale loads (``sf_wide``: a unit's scales in 16-byte loads by its first
lanes, passed on through shared memory) on a CUDA GPU: the unit shapes the dispatcher gives them (4 chunks
over 8 or 16 lanes, 2 over 16), every occupancy, 1-8 batch indices, padded ``sfa`` rows, and the fall back
to two-byte scale loads where ``sfa``'s rows are not 16-byte aligned. Outputs are poisoned with NaN and
compared with the float64 reference on random signed inputs, through the plan that was checked."""

import pytest
import torch

import inputs
import submission

pytestmark = pytest.mark.gpu

# units of 4 chunks over 16 lanes: a lane's whole share (K = 2048) or half and a third of it (K = 4096, 6144);
# of 4 over 8 lanes (K = 1024); of 2 over 16 (K = 3072: 6 chunks a lane); 1, 2, 3, 4, 5, 8, 16 batch indices;
# last rounds that only some CTAs reach
SHAPES = [(7168, 2048, 4), (4096, 2048, 8), (3072, 2048, 5), (16384, 2048, 1), (1152, 1024, 3), (4096, 4096, 4),
          (16384, 4096, 1), (1024, 4096, 16), (8192, 1024, 2), (4096, 3072, 4), (2048, 6144, 2), (8192, 6144, 2)]


def plan_of(data):
    return submission._CutePlan(data, *submission.check_inputs(data))


def check(data, plan=None):
    out = (plan or submission.custom_kernel)(inputs.poisoned(data))
    torch.cuda.synchronize()
    ok, msg = inputs.check_exact(data, out)
    assert ok, msg


@pytest.mark.parametrize("m,k,l", SHAPES)
def test_wide_scale_loads_match_float64(m, k, l):
    data = inputs.random_inputs(m, k, l, seed=m + k + l)
    plan = plan_of(data)  # the CuTe plan even where custom_kernel would take fp4 _scaled_mm (L = 1, sm_100)
    assert type(plan.kernel.op) is submission.Nvfp4Gemv and plan.kernel.op.sf_wide == 1
    assert plan.kernel.op.batch == (2 if k == 3072 else 4)
    check(data, plan)


def test_padded_aligned_sfa_rows_keep_the_wide_loads():
    data = inputs.padded(inputs.random_inputs(2048, 2048, 2, seed=6), 32, 16)
    plan = plan_of(data)
    assert plan.kernel.op.sf_wide == 1
    check(data, plan)


@pytest.mark.parametrize("ctas", [2, 3, 4])
def test_wide_scale_loads_at_every_occupancy_match_float64(ctas):
    data = inputs.random_inputs(7168, 2048, 4, seed=ctas)
    out = submission.run_cute(inputs.poisoned(data), *submission.check_inputs(data),
                              tuning=(("min_blocks", ctas), ("sf_wide", 1)))
    torch.cuda.synchronize()
    ok, msg = inputs.check_exact(data, out)
    assert ok, msg


def test_sfa_rows_off_16_bytes_load_scales_two_bytes_at_a_time():
    data = inputs.padded(inputs.random_inputs(2048, 2048, 2, seed=3), 0, 2)
    plan = plan_of(data)
    assert type(plan.kernel.op) is submission.Nvfp4Gemv and plan.kernel.op.sf_wide == 0
    check(data, plan)
    with pytest.raises(ValueError, match="sf_wide"):
        submission.run_cute(data, *submission.check_inputs(data), tuning=(("sf_wide", 1),))


def test_cached_wide_plan_with_a_misaligned_sfa_falls_back():
    """Plans are keyed by metadata, not addresses: a same-shaped sfa at an 8-byte offset must not reach the
    16-byte scale loads; the call goes to the kernel with two-byte ones."""
    data = inputs.random_inputs(4096, 2048, 2, seed=4)
    plan = plan_of(data)
    assert plan.kernel.op.sf_wide == 1
    check(data, plan)
    sfa = data[2]
    raw = torch.zeros(sfa.numel() + 8, dtype=torch.uint8, device="cuda")
    moved = raw[8:].as_strided(sfa.shape, sfa.stride()).view(torch.float8_e4m3fn)  # same metadata
    moved.copy_(sfa)
    data = (data[0], data[1], moved, *data[3:])
    check(data, plan)
    assert plan.fallback.kernel.op.sf_wide == 0

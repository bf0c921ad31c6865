"""The per-shape kernel configuration: which problems take the latency config, and that every
configuration the heuristic can pick is a valid kernel (chunks split evenly, no tail)."""

import pytest

import submission
from conftest import task_cases

G = submission.Nvfp4Gemv
H200_SMS = 132


ONE_WAVE = [c for c in task_cases("tests") if c[:3] != (2432, 4608, 2)]


@pytest.mark.parametrize("m,k,l,seed", ONE_WAVE)
def test_small_test_shapes_take_the_latency_config(m, k, l, seed):
    tuning = dict(G.shape_tuning(k, m, l, H200_SMS))
    op = G(k, False, **tuning)
    assert tuning and op.per_lane == op.batch, "one unit a row: the lane's loads all in flight at once"


@pytest.mark.parametrize("m,k,l,seed", task_cases("benchmarks") + [(2432, 4608, 2, 0)])
def test_shapes_beyond_one_wave_stream(m, k, l, seed):
    assert G.shape_tuning(k, m, l, H200_SMS) == ()


@pytest.mark.parametrize("k", range(64, submission.MAX_K + 1, 64))
def test_every_k_gets_a_valid_config(k):
    for m, l in ((128, 1), (256, 2), (1024, 1), (4096, 8)):
        for sms in (132, 148):
            op = G(k, False, **dict(G.shape_tuning(k, m, l, sms)))
            assert op.group * op.per_lane == op.chunks and op.per_lane % op.batch == 0
            assert op.threads % op.group == 0 and 32 % op.group == 0


def test_bad_tuning_is_rejected():
    with pytest.raises(ValueError, match="K=7168"):
        G(7168, False, group=64)
    with pytest.raises(ValueError, match="K=4608"):
        G(4608, False, batch=4)

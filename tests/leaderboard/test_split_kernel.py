"""The split-row kernel (``Nvfp4GemvSplit``) on a CUDA GPU: every split and chunk count a lane it can
take, rows a CTA, both scale layouts, more rows than one wave, and the one-wave
task shapes choosing it. Outputs are poisoned with NaN and compared with the float64 reference."""

import pytest
import torch

import inputs
import submission
from conftest import check_chosen_kernel, task_cases

pytestmark = pytest.mark.gpu


def tune(**kw):
    return tuple(sorted({"min_blocks": 2, **kw}.items()))


CASES = [  # (m, k, l, tuning): one chunk a lane (split = K / 1024), 2-4 chunks, 1-8 rows a CTA
    (384, 7168, 2, tune(split=7)), (384, 7168, 2, tune(split=7, min_blocks=6)),
    (384, 7168, 2, tune(split=7, rows=2)), (512, 4096, 2, tune(split=4, rows=2)),
    (512, 4096, 2, tune(split=2, rows=4)), (128, 3072, 1, tune(split=3, rows=2)),
    (256, 16384, 1, tune(split=16)), (256, 16384, 1, tune(split=4, rows=2)),
    (128, 32768, 1, tune(split=32, min_blocks=1)), (1024, 2048, 3, tune(split=2, rows=8)),
    (640, 12288, 3, tune(split=4)), (4096, 7168, 2, tune(split=7)),  # many waves
    # a tail: the last chunk of some lanes lies past the row (K % (1024 * split) != 0)
    (128, 1536, 1, tune(split=2)), (512, 1536, 2, tune(split=2, rows=4)), (2432, 4608, 2, tune(split=3)),
    (256, 4608, 1, tune(split=5, rows=2)), (128, 7168, 3, tune(split=3)), (384, 1088, 1, tune(split=2)),
    (1024, 7168, 1, tune(split=4, rows=4)), (2048, 7168, 1, tune(split=2, rows=8)),  # as routed
    (768, 11264, 1, tune(split=4, rows=4)),
    # as routed (plain scales): CTAs of 256 threads where 512 would load the busiest SM more, the largest
    # split of one wave
    (768, 11264, 1, tune(split=4, rows=2, min_blocks=4)), (1536, 7168, 1, tune(split=2, rows=4, min_blocks=4)),
    (128, 1536, 1, tune(split=2, rows=4, min_blocks=6)), (128, 22528, 3, tune(split=8, rows=2)),
    (384, 4160, 3, tune(split=5, rows=2, min_blocks=4)),  # two waves: no split fits one
    # one-row CTAs (not routed): 9 CTAs a SM of 5 warps, 4 of 8 warps at 3 chunks a lane
    (128, 4160, 1, tune(split=5, min_blocks=9)), (128, 22528, 3, tune(split=8, min_blocks=4)),
]


@pytest.mark.parametrize("plain", [True, False], ids=["plain-scales", "permuted-scales"])
@pytest.mark.parametrize("m,k,l,tuning", CASES)
def test_split_kernel_matches_float64(m, k, l, tuning, plain):
    data = inputs.random_inputs(m, k, l, seed=m + k + l)
    out = submission.run_cute(inputs.poisoned(data), m, k, l, plain, tuning=tuning)
    torch.cuda.synchronize()
    ok, msg = inputs.check_exact(data, out)
    assert ok, msg


@pytest.mark.parametrize("m,k,l", sorted({c[:3] for c in task_cases("tests") if c[1] > 1024 and c[:3] != (2432, 4608, 2)}))
def test_one_wave_task_shapes_take_the_split_kernel(m, k, l):
    check_chosen_kernel(inputs.random_inputs(m, k, l, seed=3), submission.Nvfp4GemvSplit)


@pytest.mark.parametrize("m,k,l", [(2048, 7168, 1), (768, 11264, 1)])
def test_one_wave_long_rows_take_the_split_kernel_with_a_tail(m, k, l):
    check_chosen_kernel(inputs.random_inputs(m, k, l, seed=4), submission.Nvfp4GemvSplit)


@pytest.mark.parametrize("plain", [True, False], ids=["plain-scales", "permuted-scales"])
@pytest.mark.parametrize("m,k,l,tuning", [c for c in CASES if (c[1] // 32) % (32 * dict(c[3])["split"])])
def test_tail_lanes_read_nothing_past_the_row(m, k, l, tuning, plain):
    """Past the row lie b's padding rows, here with NaN scales (e4m3 0x7F): a tail lane must neither
    load a's next row nor meet a NaN of b. (Only the plain layout puts b's rows past the row: in the
    blocked one a read past the row lands in the next batch's real scales or past the storage.)"""
    data = list(inputs.random_inputs(m, k, l, seed=7))
    data[3].view(torch.uint8)[1:] = 0x7F
    data[5] = inputs.permute_scales(data[3])
    out = submission.run_cute(inputs.poisoned(tuple(data)), m, k, l, plain, tuning=tuning)
    torch.cuda.synchronize()
    ok, msg = inputs.check_exact(tuple(data), out)
    assert ok, msg

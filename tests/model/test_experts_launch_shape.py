"""``experts_op.launch_shape``: the plain W4A16 route's build for the experts' rows stacked, except where that
build is 8-warp CTAs with x in registers for 8 tokens a group and a group gets few CTAs: 4-warp CTAs there
(measured: docs/results.md, session 76)."""

import functools

import pytest

from nvfp4_gemv import experts_op
from nvfp4_gemv.experts_op import sm_count
from nvfp4_gemv.model.experts_forward import busy_groups, group_size
from nvfp4_gemv.w4a16 import Nvfp4GemvW4A16
from nvfp4_gemv.w4a16_route import route

from test_experts_kernel import check_fuzz_case_on_cuda, fuzz_case

QWEN3 = (128, 8, 2048, 768)  # experts, top k, hidden, expert intermediate
MIXTRAL = (8, 2, 4096, 14336)


def shapes(model, t):
    e, top, h, i = model
    nt = group_size(t, top, e)
    busy = busy_groups(t, top, e, nt)
    return [(nt, 2 * i, h, busy), (nt, h, i, busy)]  # gate/up, down


@pytest.mark.parametrize("t", [16, 64])
def test_eight_tokens_a_group_on_few_ctas_take_four_warps(t):
    for nt, m, k, busy in shapes(QWEN3, t):
        r, grid = experts_op.launch_shape(nt, m, k, 132, busy)
        assert nt == 8 and grid <= experts_op.FEW_CTAS_GRID
        assert dict(r.tuning)["threads"] == experts_op.FEW_CTAS_THREADS
        plain = route(nt, m * busy, k, 132)
        assert r.groups == plain.groups
        assert {a: b for a, b in r.tuning if a != "threads"} == {a: b for a, b in plain.tuning if a != "threads"}
        assert Nvfp4GemvW4A16.can_implement(k, nt, r.groups, **dict(r.tuning))


@pytest.mark.parametrize("model, t", [(QWEN3, 1), (QWEN3, 4), (MIXTRAL, 1), (MIXTRAL, 16), (MIXTRAL, 64)])
def test_other_launches_keep_the_plain_routes_build(model, t):
    """Fewer than 8 tokens a group, or a group's grid wider than FEW_CTAS_GRID (Mixtral's few experts)."""
    for nt, m, k, busy in shapes(model, t):
        r, grid = experts_op.launch_shape(nt, m, k, 132, busy)
        assert nt < 8 or grid > experts_op.FEW_CTAS_GRID
        assert r == route(nt, m * max(1, busy), k, 132)


@pytest.mark.parametrize("nt, m, k, busy", [(2, 2048, 768, 30), (4, 2048, 768, 60), (16, 2048, 768, 40),
                                           (16, 1536, 2048, 40), (8, 4096, 4096, 40)])
def test_unmeasured_builds_keep_the_plain_route_on_few_ctas_too(nt, m, k, busy):
    """Other group sizes than 8 (the plain route's 8 warps with x in registers, or 16 with x in shared
    memory), and 8 tokens a group on a 16-warp build with x in shared memory (K = 4096): not measured."""
    r, grid = experts_op.launch_shape(nt, m, k, 132, busy)
    assert grid <= experts_op.FEW_CTAS_GRID and r == route(nt, m * busy, k, 132)


@functools.lru_cache  # (1000 cases drawn on the CPU: once a process and SM count)
def few_cta_seeds(sms):
    """The cases of the experts' fuzz generator (``test_experts_kernel.fuzz_case``, seeds 0..999: its test
    draws 0..299) whose launch takes the 4-warp rule on ``sms`` SMs."""
    out = []
    for seed in range(1000):
        (x, ids, w, ws, alpha, nt, busy), _ = fuzz_case(seed, "cpu")
        r, _ = experts_op.launch_shape(nt, w.shape[1], x.shape[1], sms, busy)
        plain = route(nt, w.shape[1] * max(1, busy), x.shape[1], sms)
        if r != plain:
            out.append(seed)
    return tuple(out)


def test_the_fuzz_reaches_the_four_warp_rule():
    assert len(few_cta_seeds(132)) >= 20


@pytest.mark.gpu
@pytest.mark.parametrize("part", range(3))
def test_cuda_four_warp_launches_within_their_bound_of_float64(part):
    """The fuzz's cases the rule takes on this GPU's SM count, a third a part: outputs poisoned first, each row
    within the W4A16 bound of float64."""
    seeds = few_cta_seeds(sm_count(0))
    assert len(seeds) >= 20, f"only {len(seeds)} fuzz cases take the rule on {sm_count(0)} SMs"
    for seed in seeds[part::3]:
        check_fuzz_case_on_cuda(seed)

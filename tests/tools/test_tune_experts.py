"""``tools/tune_experts.py``'s candidates: the route's build first, each other one a build the experts' kernel
takes and differs from the route's, the down launch's builds with x in shared memory where it takes the act."""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import tune_experts  # noqa: E402

from nvfp4_gemv.experts_kernel import Nvfp4ExpertsW4A16  # noqa: E402
from nvfp4_gemv.experts_op import launch_shape  # noqa: E402


@pytest.mark.parametrize("nt, m, k, busy, act", [(1, 1536, 2048, 8, None), (1, 2048, 768, 8, "silu"),
                                                  (4, 2048, 768, 15, None), (8, 1536, 2048, 41, None)])
def test_candidates_start_at_the_route_and_are_buildable_and_distinct(nt, m, k, busy, act):
    cands = tune_experts.candidates(nt, m, k, 132, busy, act)
    route, grid = launch_shape(nt, m, k, 132, busy)
    label, first, g = cands[0]
    assert label == "route" and first.groups == route.groups and g == grid
    assert len(cands) > 5
    shapes = {(r.groups, r.tuning, g) for _, r, g in cands}
    assert len(shapes) == len(cands), "two candidates are the same build and grid"
    for _, r, g in cands:
        Nvfp4ExpertsW4A16(k, nt, r.groups, True, True, act=act, **dict(r.tuning))  # raises where it cannot build
        assert g >= 1


def test_a_set_base_build_comes_first_with_its_own_grid_and_the_route_among_the_others():
    """``--set threads=256`` at 16 tokens (Qwen3-30B-A3B's gate/up): the base is the route's build with the
    knob overridden; varying that knob back gives the route's own build."""
    route, grid = launch_shape(8, 1536, 2048, 132, 41)
    cands = tune_experts.candidates(8, 1536, 2048, 132, 41, None, {"threads": 256})
    label, first, g = cands[0]
    assert label == "route+threads=256" and dict(first.tuning)["threads"] == 256
    assert g == tune_experts.grid_for(8, 1536, 2048, 132, first.groups, first.tuning, 41)
    assert any(r.tuning == route.tuning and g == grid for _, r, g in cands[1:])


def test_the_float64_reference_reads_one_shared_row_for_every_group():
    """At one token every group reads x's one row (row stride 0), as ``decode_groups`` passes it."""
    from test_experts_kernel import exact, random_weights

    gen = torch.Generator().manual_seed(5)
    w, ws, a = random_weights(gen, 6, 128, 64)
    gid = torch.tensor([3, -1, 0, 5], dtype=torch.int32)
    x = torch.randn(1, 64, generator=gen).bfloat16()
    ref, absum = tune_experts.reference(x, gid, w, ws, a, 1, None)
    want, _ = exact(x.expand(4, -1), gid, w, ws, a, 1)
    assert torch.equal(ref.isnan(), want.isnan()) and torch.equal(ref[~ref.isnan()], want[~want.isnan()])


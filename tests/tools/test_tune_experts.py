"""``tools/tune_experts.py``'s candidates: the route's build first, each other one a build the experts' kernel
takes and differs from the route's, the down launch's builds with x in shared memory where it takes the act."""

import os
import sys

import pytest

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

"""The dynamic bulk kernel's claim protocol, simulated on the CPU: whatever order the CTAs' claims land
in, every tile is done exactly once and a launch makes exactly ``Nvfp4GemvBulk.claim_count`` claims, the
number the kernel resets its counter at (one claim more or less would leave it set, or reset it early and
start the claims over)."""

import random

import pytest

import submission


def simulate(n_tiles, gdimx, stages, rng):
    """Tiles done (with repeats) and claims made by one batch index's CTAs, their claims in random order."""
    dyn = stages * gdimx
    done, claimers = [], []
    for b in range(gdimx):
        for j in range(stages):  # static steps; the claim for the step after the last is issued at it
            if b + j * gdimx >= n_tiles:
                break
            done.append(b + j * gdimx)
        else:
            claimers.append(b)
    counter = 0
    while claimers:
        b = rng.choice(claimers)
        tile = counter + dyn
        counter += 1
        if tile < n_tiles:
            done.append(tile)
        else:
            claimers.remove(b)
    return done, counter


@pytest.mark.parametrize("seed", range(40))
def test_every_tile_once_and_the_claim_count_exact(seed):
    rng = random.Random(seed)
    for _ in range(50):
        gdimx, stages = rng.randint(1, 300), rng.randint(1, 6)
        n_tiles = rng.randint(gdimx, 12 * gdimx)  # grid_x never exceeds the tiles
        done, claims = simulate(n_tiles, gdimx, stages, rng)
        assert sorted(done) == list(range(n_tiles)), (n_tiles, gdimx, stages)
        assert claims == submission.Nvfp4GemvBulk.claim_count(n_tiles, gdimx, stages), (n_tiles, gdimx, stages)


@pytest.mark.parametrize("m,k,l", [(4096, 7168, 8), (128, 7168, 200), (640, 7168, 1), (4096, 10240, 3),
                                   (320, 7168, 8)])
def test_routed_grids_claim_as_simulated(m, k, l):
    op = submission.Nvfp4GemvBulk(k, False, dynamic=1)
    n_tiles, gdimx = m // op.rows, op.grid_x(m, l, 132)
    done, claims = simulate(n_tiles, gdimx, op.stages, random.Random(m + k + l))
    assert sorted(done) == list(range(n_tiles)) and claims == op.claim_count(n_tiles, gdimx, op.stages)

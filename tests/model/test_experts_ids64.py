"""The experts' kernel on int64 ids (``experts_gemv`` with a router's ``top_k_index`` as it is, which
``decode_groups`` passes at one token): an id outside [0, E) in either 32-bit half (negative, transformers'
sentinel E, 2^32 + a valid id) is no expert, its rows left as they were; every other group's rows equal the
int32 ids' launch bit for bit."""

import pytest
import torch

from nvfp4_gemv.experts_op import experts_gemv
from nvfp4_gemv.model.experts_forward import decode_groups

from test_experts_kernel import check_within_bound, exact, random_weights

CUDA = pytest.mark.gpu


def ids_case(gen, e, g):
    """int64 ids of g groups: valid ones and every kind of invalid one, and the int32 ids that mean the same."""
    ids = torch.randint(0, e, (g,), generator=gen, dtype=torch.int64)
    bad = [-1, e, e + 3, 2 ** 32, 2 ** 32 + 1, -(2 ** 32) + 1, 2 ** 31, -(2 ** 63)]
    pick = torch.rand(g, generator=gen) < 0.3
    for i in pick.nonzero().flatten().tolist():
        ids[i] = bad[int(torch.randint(0, len(bad), (1,), generator=gen))]
    want = torch.where((ids >= 0) & (ids < e), ids, torch.full_like(ids, -1)).to(torch.int32)
    return ids, want


def test_cpu_path_takes_an_id_outside_the_experts_as_none():
    gen = torch.Generator().manual_seed(0)
    w, ws, a = random_weights(gen, 4, 128, 64)
    ids, as32 = ids_case(gen, 4, 12)
    x = torch.randn(12, 64, generator=gen).bfloat16()
    got, want = experts_gemv(x, ids, w, ws, a, 1), experts_gemv(x, as32, w, ws, a, 1)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()])
    assert got[as32 < 0].isnan().all()


def test_cpu_path_does_not_hide_an_int32_id_past_the_experts():
    """int32 ids are -1 or an expert (the int32 CUDA build reads ids[g] < E as it is): the CPU path reads
    w[E] and fails, rather than taking it as no expert as it does an int64 id."""
    gen = torch.Generator().manual_seed(1)
    w, ws, a = random_weights(gen, 4, 128, 64)
    x = torch.randn(1, 64, generator=gen).bfloat16()
    with pytest.raises(IndexError):
        experts_gemv(x, torch.tensor([1, 4], dtype=torch.int32), w, ws, a, 1)


def test_one_token_groups_are_the_routers_int64_ids_as_they_are():
    idx = torch.tensor([[3, 0, 7, 5]])
    xg, gid, at, valid = decode_groups(torch.randn(1, 64).bfloat16(), idx, 6, 1)
    assert gid.dtype == torch.int64 and torch.equal(gid, idx.reshape(-1)) and at is None
    assert valid.tolist() == [True, True, False, True]
    _, gid32, _, _ = decode_groups(torch.randn(1, 64).bfloat16(), idx.int(), 6, 1)
    assert gid32.dtype == torch.int32 and gid32.tolist() == [3, 0, -1, 5]


@CUDA
@pytest.mark.parametrize("seed", range(8))
def test_cuda_int64_ids_equal_their_int32_meaning_bit_for_bit(seed):
    """Outputs poisoned first: the rows of an id outside [0, E) stay poisoned; the others equal the int32
    launch's bits and are within the bound of float64 (one x row every group reads, as at one token)."""
    gen = torch.Generator().manual_seed(300 + seed)
    e = int(torch.randint(2, 17, (1,), generator=gen))
    m = 128 * int(torch.randint(1, 5, (1,), generator=gen))
    k = 64 * int(torch.randint(1, 17, (1,), generator=gen))
    g = int(torch.randint(1, 13, (1,), generator=gen))
    w, ws, a = random_weights(gen, e, m, k)
    ids, as32 = ids_case(gen, e, g)
    x = (torch.randn(1, k, generator=gen) * 2).bfloat16()
    wc, wsc, ac, xc = w.cuda(), ws.cuda(), a.cuda(), x.cuda()
    got = []
    for i in (ids, as32, ids):  # (the third: a hit by w's identity)
        ic = i.cuda()  # (before the poison: the ids' small block must not take the freed poison's start)
        poison = torch.full((g, m), float("nan"), dtype=torch.bfloat16, device="cuda")
        del poison  # (the op's output takes the freed block: rows it does not write stay NaN)
        got.append(experts_gemv(xc, ic, wc, wsc, ac, 1, busy=max(1, g // 2)).cpu())
    keep = (as32 >= 0).nonzero().flatten()
    skip = (as32 < 0).nonzero().flatten()
    assert torch.equal(got[0][keep], got[1][keep]) and torch.equal(got[2][keep], got[1][keep])
    assert got[0][skip].isnan().all() and got[2][skip].isnan().all()
    ref, absum = exact(x, as32, w, ws, a, 1)
    check_within_bound(got[0][keep], ref[keep], absum[keep], k, f"seed {seed}")

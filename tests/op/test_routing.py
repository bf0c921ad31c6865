"""The op's routing and the tensor-core kernel's tiling, without a GPU: which kernel a call takes
(``op_route.route`` and its rules ``use_mma``, ``use_bulk``), the bulk-copy kernel's CTAs a SM and rows a
thread (``bulk_tuning``) and how many 8-row groups a CTA owns (``op_route.mma_groups``)."""

import pytest

import dataclasses

from nvfp4_gemv import op_route as op
from nvfp4_gemv.mma import MAX_GROUPS
from nvfp4_gemv.op_route import mma_groups
from nvfp4_gemv.op_route import OpRoute, route


@pytest.mark.parametrize("n,m,k,copyable,tuning,want", [
    (1, 4096, 7168, True, (), ("bulk", 1, (("ctas", 2),), False)),
    (3, 4096, 16384, True, (), ("bulk", 3, (("ctas", 1), ("rt", 4)), False)),
    (1, 4096, 7168, False, (), ("tokens", 1, (), False)),  # scales off 16-byte rows: no bulk copies
    (4, 4096, 7168, True, (), ("tokens", 4, (), False)),
    (8, 4096, 7168, True, (), ("mma", 8, (), False)),
    (40, 4096, 7168, True, (), ("mma", 14, (), False)),  # three launches of equal groups, at most 16 each
    (8, 1024, 7168, True, (), ("tokens", 8, (), False)),  # 128 row groups do not fill 132 SMs
    (30, 1024, 16384, True, (), ("tokens", 10, (), False)),  # 11 tokens' copies fit: three groups of 10
    (2, 4096, 7168, True, (("bulk", 1),), ("bulk", 2, (("ctas", 2),), True)),
    (8, 4096, 7168, True, (("mma", 0),), ("tokens", 8, (), False)),
    (2, 4096, 7168, True, (("threads", 256),), ("tokens", 2, (("threads", 256),), False)),  # a dp4a knob: dp4a
])
def test_route_names_the_kernel_tokens_a_launch_and_its_build(n, m, k, copyable, tuning, want):
    r = route(n, m, k, 132, copyable, tuning)
    assert isinstance(r, OpRoute) and (r.kernel, r.tokens, r.tuning, r.forced) == want
    assert r.groups == mma_groups(m, 132) and r.ws_mask == (15 if r.kernel == "bulk" else 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.kernel = "tokens"


@pytest.mark.parametrize("tuning, match", [((("bulk", 1), ("mma", 1)), "names one kernel"),
                                           ((("bulk", 1),), "bulk-copy kernel needs plain w scales"),
                                           ((("batch", 2),), "dp4a kernel cannot build"),
                                           ((("mma", 1), ("threads", 100)), "tensor-core kernel cannot build")])
def test_route_refuses_a_tuning_no_kernel_takes(tuning, match):
    with pytest.raises(ValueError, match=match):
        route(2, 4096, 7168, 132, False, tuning)


@pytest.mark.parametrize("n,m,sms,mma", [(1, 7168, 132, False), (4, 7168, 132, False), (5, 7168, 132, True),
                                         (16, 1056, 132, True), (16, 1024, 132, False), (64, 4096, 148, True)])
def test_tensor_core_kernel_from_five_tokens_where_groups_fill_the_gpu(n, m, sms, mma):
    assert op.use_mma(n, m, sms) == mma


@pytest.mark.parametrize("n,k,bulk", [(1, 1024, False), (1, 2048, True), (1, 16384, True), (2, 256, False),
                                      (2, 1024, True), (2, 2304, False), (3, 7168, True), (4, 7168, False),
                                      (4, 16384, True), (5, 16384, False), (2, 2368, False), (2, 64, False),
                                      (2, 20480, False), (3, 32768, False)])
def test_bulk_copy_kernel_up_to_three_tokens_and_four_at_16384_where_rows_split_into_warps(n, k, bulk):
    """K % 1024 == 0 (a row's 32-value chunks split over whole warps), K <= 16384 (measured; two-CTA builds
    spill above it), K >= 2048 at one token."""
    assert op.use_bulk(n, 4096, k) == bulk


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [128, 2048, 7168])
def test_every_routed_bulk_configuration_builds(n, m):
    """Where use_bulk says yes, the kernel class takes bulk_tuning's configuration (shared memory, at most 32
    rows a stage and 1024 threads), and its stages divide M."""
    from nvfp4_gemv.tokens_bulk import Nvfp4GemvTokensBulk

    for k in range(1024, 32769, 1024):
        if op.use_bulk(n, m, k):
            kern = Nvfp4GemvTokensBulk(k, n, False, False, True, True, **op.bulk_tuning(n, m, k))
            assert kern.rows <= 32 and kern.threads <= 1024 and m % kern.rows == 0


@pytest.mark.parametrize("n,m,k,tuning", [(1, 128, 4096, {"ctas": 2}), (2, 1024, 16384, {"ctas": 2}),
                                          (3, 1024, 4096, {"ctas": 1}), (3, 2048, 7168, {"ctas": 2}),
                                          (3, 7168, 16384, {"ctas": 1, "rt": 4}), (4, 256, 16384, {"ctas": 1, "rt": 4})])
def test_bulk_copy_kernel_configuration_as_measured(n, m, k, tuning):
    assert op.bulk_tuning(n, m, k) == tuning


@pytest.mark.parametrize("m,sms,groups", [(7168, 132, 7), (4096, 132, 4), (2048, 132, 2), (128, 132, 1),
                                          (14336, 148, 7)])
def test_groups_of_the_measured_shapes(m, sms, groups):
    assert mma_groups(m, sms) == groups


@pytest.mark.parametrize("sms", [1, 78, 114, 132, 148])
@pytest.mark.parametrize("m", [128, 384, 1152, 4096, 7168, 28672, 131072])
def test_groups_fit_m_and_balance_the_ctas(m, sms):
    gr = mma_groups(m, sms)
    assert 1 <= gr <= MAX_GROUPS and 8 * gr <= m
    rounds = -(-(-(-(m // 8) // gr)) // sms)
    best = min(-(-(-(-(m // 8) // g)) // sms) * (g + 2) for g in range(1, MAX_GROUPS + 1))
    assert rounds * (gr + 2) == best

"""The W4A16 form of nvfp4_gemv.gemv (bf16/fp16 x as it is, NVFP4 w), on the CPU (its exact path): the result,
the x_scale rule, validation, scale layouts, out=, the torch op (opcheck, fake tensors, torch.compile)."""

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import inputs
import reference
from nvfp4_gemv import gemv, gemv_reference, w4a16, op_plan, w4a16_route
from w4a16_inputs import w4a16_exact, w4a16_inputs


def brute_force(x, w, ws, alpha):
    """One float64 sum per output element, value by value."""
    wu, wsv = w.view(torch.uint8), ws.view(torch.float8_e4m3fn).double()
    n, m, k = x.shape[0], wu.shape[0], x.shape[1]
    val = lambda r, j: reference.E2M1_VALUES[(int(wu[r, j // 2]) >> (4 * (j % 2))) & 0xF]  # noqa: E731
    out = torch.empty(n, m, dtype=torch.float64)
    for i in range(n):
        for r in range(m):
            out[i, r] = sum(float(x[i, j]) * val(r, j) * float(wsv[r, j // 16]) for j in range(k))
    return out * (1.0 if alpha is None else float(alpha))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,m,k", [(1, 128, 64), (3, 128, 128)])
def test_exact_path_matches_a_value_by_value_sum(dtype, n, m, k):
    x, _, w, ws, a = w4a16_inputs(n, m, k, seed=n + k, dtype=dtype, device="cpu")
    ref = brute_force(x, w, ws, a)
    _, terms = w4a16_exact(x, w, ws, a)
    for out_dtype in (torch.bfloat16, torch.float16):
        got = gemv(x, None, w, ws, a, out_dtype=out_dtype)
        assert got.dtype == out_dtype and got.shape == (n, m)
        assert inputs.rounding_violations(got, ref, terms * 2.0 ** -50) == (0, "ok")


@pytest.mark.parametrize("flat", [False, True])
def test_blocked_scales_give_the_plain_result(flat):
    x, _, w, ws, a = w4a16_inputs(2, 256, 192, seed=3, device="cpu")
    blocked = inputs.blocked_scales(ws, 256, 192, flat=flat)
    assert torch.equal(gemv(x, None, w, blocked, a), gemv(x, None, w, ws, a))


def test_cancelling_sums_keep_their_remainder():
    x, _, w, ws, a = w4a16_inputs(2, 128, 512, seed=4, device="cpu", cancel=True)
    exact, terms = w4a16_exact(x, w, ws, a)
    assert (exact.abs() < terms * 2.0 ** -6).all()  # the inputs cancel
    assert inputs.rounding_violations(gemv(x, None, w, ws, a), exact, terms * 2.0 ** -50) == (0, "ok")


def test_out_is_written_and_returned_in_its_dtype():
    x, _, w, ws, a = w4a16_inputs(3, 128, 128, seed=5, device="cpu")
    out = torch.full((3, 128), float("nan"), dtype=torch.float16)
    assert gemv(x, None, w, ws, a, out=out) is out
    assert torch.equal(out, gemv_reference(x, None, w, ws, a, torch.float16))


def test_x_scale_must_be_none_for_bf16_x():
    x, _, w, ws, _ = w4a16_inputs(1, 128, 64, seed=6, device="cpu")
    with pytest.raises(TypeError, match=r"argument 'x_scale': expected None for torch.bfloat16 x"):
        gemv(x, torch.ones(1, 4, dtype=torch.float8_e4m3fn), w, ws)


def test_x_scale_must_be_given_for_nvfp4_x():
    x, _, w, ws, _ = inputs.op_inputs(1, 128, 64, seed=6, device="cpu")
    with pytest.raises(TypeError, match=r"argument 'x_scale': expected \[N, K/16\] float8_e4m3fn scales"):
        gemv(x, None, w, ws)


@pytest.mark.parametrize("bad,match", [
    (lambda x, w, ws: (x[:, :96], w, ws), r"argument 'w': expected K/2 = 48 bytes a row, as x has \(96 values\)"),
    (lambda x, w, ws: (x.float(), w, ws), r"argument 'x': expected dtype .*torch.bfloat16 / torch.float16"),
    (lambda x, w, ws: (x[0], w, ws), r"argument 'x': expected a 2-d tensor \[rows, K\]"),
    (lambda x, w, ws: (x[:, :63], w, ws), r"argument 'x': expected K \(dim 1\) a positive multiple of 64"),
    (lambda x, w, ws: (x, w, ws[:, :3]), r"argument 'w_scale'"),
    (lambda x, w, ws: (x, w.to(torch.bfloat16), ws), r"argument 'w': expected dtype torch.float4_e2m1fn_x2 or torch.uint8"),
    (lambda x, w, ws: (x[:, :96], w[:, :48], ws[:, :6]), r"argument 'x': expected K \(dim 1\) a positive multiple of 64, got 96"),
])
def test_bad_inputs_name_the_argument(bad, match):
    x, _, w, ws, _ = w4a16_inputs(2, 128, 128, seed=8, device="cpu")
    x, w, ws = bad(x, w, ws)
    with pytest.raises((TypeError, ValueError), match=match):
        gemv(x, None, w, ws)


def test_opcheck_gemv_with_bf16_x():
    x, _, w, ws, a = w4a16_inputs(3, 128, 128, seed=9, device="cpu")
    torch.library.opcheck(torch.ops.nvfp4.gemv.default, (x, None, w, ws.view(torch.uint8), a, torch.bfloat16))


def test_fake_tensor_gives_shape_and_dtype_without_computing():
    with FakeTensorMode():
        x = torch.empty(5, 1024, dtype=torch.float16)
        w = torch.empty(384, 512, dtype=torch.uint8)
        ws = torch.empty(384, 64, dtype=torch.float8_e4m3fn)
        out = torch.ops.nvfp4.gemv(x, None, w, ws, None, torch.float16)
        assert out.shape == (5, 384) and out.dtype == torch.float16


def test_compiles_fullgraph_with_the_same_result():
    x, _, w, ws, a = w4a16_inputs(4, 128, 256, seed=2, device="cpu")
    torch._dynamo.reset()

    def layer(x):
        return gemv(x, None, w, ws, a) * 2

    assert torch.equal(torch.compile(layer, fullgraph=True)(x), layer(x))


@pytest.mark.parametrize("m,shared_x", [(4096, True), (6144, True), (7168, True), (28672, True), (1024, False)])
def test_one_token_takes_x_in_shared_memory_only_where_its_tiles_fill_the_sms(m, shared_x):
    """One token: x in shared memory, several CTAs a SM where the 4-group tiles outnumber the SMs (H200: faster
    at 6144, 7168 and 28672 rows), or 16-warp CTAs where the 2-group tiles about fill them (4096 rows);
    otherwise (1024 rows), and from 5 tokens, x in registers, one CTA. Up to 8 tokens w is the MMA's A
    operand (docs/results.md)."""
    one = w4a16_route.default_tuning(1, m, 132, 4096)
    assert (one.get("x_smem", 1) == 1) == shared_x and one["w_a"] == 1
    if not shared_x:
        assert one == {"threads": 256, "x_smem": 0, "w_a": 1}
    # 5..8 tokens: the 16-warp shared-x build where two CTAs fit, from 1920 rows (a test below)
    assert w4a16_route.default_tuning(8, m, 132, 4096)["x_smem"] == shared_x
    assert w4a16_route.default_tuning(2, m, 132, 4096)["x_smem"] == shared_x
    for n in (9, 16, 32):
        tune = w4a16_route.default_tuning(n, m, 132, 4096)
        # 9..16 tokens on rows past two rounds of 4-group tiles: x in shared memory (a test below)
        assert tune["x_smem"] == (n <= 16 and m // 32 > 2 * 132) and tune["across"] == 1 and "w_a" not in tune


@pytest.mark.parametrize("n,m,k,shared_x", [
    (2, 28672, 4096, True), (4, 6144, 4096, True), (3, 14336, 4096, True), (2, 10240, 8192, True),
    (2, 8192, 8192, True), (4, 8704, 4096, True), (2, 4352, 2048, True),
    # N x K past 16384, K below 2048 (rows whose M / 32 does not pass the SMs: the next test)
    (3, 10240, 8192, False), (2, 8192, 28672, False), (4, 28672, 4160, False), (2, 28672, 1024, False)])
def test_two_to_four_tokens_on_many_rows_take_x_in_shared_memory_where_n_k_is_at_most_16384(n, m, k, shared_x):
    """2..4 tokens on many rows (``M / 32`` over the SMs) take the one-token route's 4 CTAs of 2 groups with x in
    shared memory (``dec``, ``xpair``, ``across``; no ``late``) where ``N x K <= 16384`` and ``K >= 2048`` (the
    measured range); four such CTAs fit a SM.
    Elsewhere x stays in registers (H200: with more shared memory the scale loads lost their L1 and it was
    slower; docs/results.md, "Seventh session")."""
    tune = w4a16_route.default_tuning(n, m, 132, k)
    if not shared_x:
        assert tune == {"threads": 256, "x_smem": 0, "w_a": 1, "across": 1}
        return
    assert tune == {"threads": 256, "ctas": 4, "groups": 2, "x_smem": 1, "dec": 1, "xpair": 1, "across": 1, "w_a": 1}
    tune.pop("groups")
    op = w4a16.Nvfp4GemvW4A16(k, n, 2, True, False, True, True, **tune)
    assert op.x_smem and not op.late and op.min_blocks * (op.smem_bytes + 1024) <= w4a16.SMEM_A_SM


FEW_ROWS = {"threads": 512, "ctas": 2, "groups": 2, "x_smem": 1, "dec": 1, "xpair": 1, "across": 1, "w_a": 1}


@pytest.mark.parametrize("n,m,k,taken", [
    (1, 4096, 4096, True), (1, 4096, 14336, True), (1, 2048, 8192, True), (1, 4224, 4096, True),
    (1, 4096, 32768, True), (2, 4096, 14336, True), (3, 4096, 14336, True), (4, 4096, 7168, True),
    (2, 3072, 4096, True), (1, 1920, 8192, True),  # the fewest rows: 120 tiles of 2 groups on 132 SMs
    # one CTA's x would fit a SM, not two (4 x 14336); not even one (4 x 32768); K below 4096; too few rows;
    # rows past 4224
    (4, 4096, 14336, False), (4, 4096, 32768, False), (1, 4096, 2048, False), (1, 1792, 8192, False),
    (1, 4352, 4096, False)])
def test_one_to_four_tokens_on_fewer_rows_take_16_warp_ctas_with_x_in_shared_memory(n, m, k, taken):
    """1..4 tokens where the 4-group tiles do not pass the SMs (``M / 32 <= SMs``) but the 2-group tiles nearly
    fill them (``M / 16 >= SMs - SMs / 8``), from K = 4096: CTAs of 16 warps, two a SM, 2 groups, x in shared
    memory (``late`` at one token) where two such CTAs fit a SM's shared memory (H200: 4096 x 14336 20.66 ->
    15.84 us at one token; docs/results.md, "Eighth session"). The class builds it within that memory."""
    tune = w4a16_route.default_tuning(n, m, 132, k)
    if not taken:
        assert tune.get("threads") != 512 or not tune.get("x_smem"), tune
        return
    assert tune == {**FEW_ROWS, **({"late": 1} if n == 1 else {})}
    tune.pop("groups")
    op = w4a16.Nvfp4GemvW4A16(k, n, 2, True, False, True, True, **tune)
    assert op.x_smem and op.warps == 16 and op.late == (n == 1)
    assert op.min_blocks * (op.smem_bytes + 1024) <= w4a16.SMEM_A_SM


@pytest.mark.parametrize("n,m,k,taken", [
    (5, 4096, 4096, True), (8, 4096, 4096, True), (6, 28672, 4096, True), (8, 28672, 4096, True),
    (8, 6144, 4096, True), (6, 4096, 7168, True), (7, 1920, 7168, True), (5, 57344, 10240, True),
    # two CTAs' x do not fit a SM (8 x 7168, 5 x 10752); K below 4096; too few rows; 4 and 9 tokens
    (8, 4096, 7168, False), (5, 28672, 10752, False), (8, 28672, 2048, False), (8, 1792, 4096, False),
    (9, 28672, 4096, False), (4, 28672, 8192, False)])
def test_five_to_eight_tokens_take_16_warp_ctas_with_x_in_shared_memory_where_two_fit(n, m, k, taken):
    """5..8 tokens from K = 4096 on rows whose 2-group tiles nearly fill the SMs or more (``M / 16 >= SMs -
    SMs / 8``): the 16-warp build of fewer rows (two CTAs a SM, 2 groups, x in shared memory, no ``late``) where
    two such CTAs fit a SM (H200: 28672 x 4096 N = 8 38.67 -> 29.04 us; docs/results.md, "Ninth session")."""
    tune = w4a16_route.default_tuning(n, m, 132, k)
    if not taken:
        assert not (tune.get("threads") == 512 and tune.get("ctas") == 2 and tune.get("x_smem")), tune
        return
    assert tune == FEW_ROWS
    tune.pop("groups")
    op = w4a16.Nvfp4GemvW4A16(k, n, 2, True, False, True, True, **tune)
    assert op.x_smem and op.warps == 16 and not op.late and op.w_a
    assert op.min_blocks * (op.smem_bytes + 1024) <= w4a16.SMEM_A_SM


@pytest.mark.parametrize("n,m,k,taken", [
    (9, 28672, 4096, True), (16, 28672, 4096, True), (12, 14336, 4096, True), (16, 8576, 4096, True),
    (13, 57344, 4992, True), (9, 28672, 7168, True), (16, 28672, 2048, True), (12, 16384, 2048, True),
    # N x K past 65536 (16 x 4160, 10 x 7168); K below 4096 other than 2048; rows whose 4-group tiles fill at
    # most two rounds (8448: 16 warps, x in registers); 8 tokens
    (16, 28672, 4160, False), (10, 28672, 7168, False), (16, 28672, 1984, False), (12, 28672, 3072, False),
    (16, 8448, 4096, False), (8, 28672, 4096, False)])
def test_nine_to_sixteen_tokens_on_many_rows_take_x_in_shared_memory_up_to_16_by_4096(n, m, k, taken):
    """9..16 tokens (x the A operand) on rows past two rounds of 4-group tiles (``M / 32 > 2 * SMs``), from
    K = 4096 with ``N x K <= 65536``, and at K = 2048: one CTA of 16 warps and 4 groups with x in shared memory,
    read once a CTA instead of once a tile (H200: 28672 x 4096 N = 16 46.98 -> 39.36 us, ninth session;
    28672 x 2048 28.02 -> 26.08, eleventh; docs/results.md)."""
    tune = w4a16_route.default_tuning(n, m, 132, k)
    if not taken:
        assert not (tune.get("x_smem") and not tune.get("w_a")), tune  # (x as B from shared memory: 8 tokens)
        return
    assert tune == {"threads": 512, "x_smem": 1, "across": 1, "groups": 4}
    tune.pop("groups")
    op = w4a16.Nvfp4GemvW4A16(k, n, 4, True, False, True, True, **tune)
    assert op.x_smem and op.warps == 16 and not op.w_a and op.smem_bytes <= w4a16.SMEM_CTA


@pytest.mark.parametrize("n,m,k,groups", [
    (24, 28672, 2048, 4), (32, 16384, 2048, 4), (32, 3072, 2048, 3), (32, 2048, 2048, 2), (17, 1152, 2048, 2),
    (20, 57344, 2048, 4), (32, 128, 2048, 2),
    # other K with N x K within 65536 (measured slower at 2688, level or faster at 3840), past it (32 x 4096); K
    # below 2048
    (17, 4096, 3840, None), (30, 1152, 2112, None), (24, 16384, 2688, None), (32, 28672, 4096, None),
    (32, 4096, 1024, None), (17, 28672, 1984, None)])
def test_seventeen_to_32_tokens_take_x_in_shared_memory_at_k_2048(n, m, k, groups):
    """17..32 tokens on any rows at K = 2048 (a slice for each of 16 warps): one CTA of 16 warps with x (the A
    operand, two tiles) in shared memory, read once a CTA instead of once a tile per warp, of as many groups
    (2 to 4) as fill the SMs evenly (H200, eleventh session: 28672 x 2048 N = 32 39.39 -> 28.58 us with 4
    groups, 2048 x 2048 10.61 -> 8.96 with 2, the best of 2, 3 and 4 on four row counts; 16384 x 2688 N = 24
    28.06 -> 33.04, so not past 2048; docs/results.md)."""
    tune = w4a16_route.default_tuning(n, m, 132, k)
    if groups is None:
        assert not tune["x_smem"] and tune["threads"] == 256, tune
        return
    assert tune == {"threads": 512, "x_smem": 1, "across": 1, "groups": groups}, tune
    tune.pop("groups")
    op = w4a16.Nvfp4GemvW4A16(k, n, groups, True, False, True, True, **tune)
    assert op.x_smem and op.warps == 16 and op.a_tiles == 2 and not op.w_a and op.smem_bytes <= w4a16.SMEM_CTA


@pytest.mark.parametrize("sms", [78, 132, 148])
def test_the_route_takes_every_token_count_row_count_and_k(sms):
    """``default_tuning`` answers for 1..32 tokens, rows from 128 to 57344 and K from 64 to 32768 without
    raising (a shared-x build whose x does not fit one CTA is not taken: 4 tokens at K = 32768 on 4096 rows
    once raised here), and every tuning it gives is one the class takes."""
    for k in (64, 1024, 2048, 4096, 8256, 14336, 16384, 26624, 32768):
        for m in (128, 1920, 2048, 4096, 4224, 4352, 7168, 28672, 57344):
            for n in range(1, 33):
                tune = dict(w4a16_route.default_tuning(n, m, sms, k))
                groups = tune.pop("groups", None) or w4a16_route.w4a16_groups(n, m, sms, even=bool(tune.get("w_a")))
                w4a16.Nvfp4GemvW4A16(k, n, groups, True, False, True, True, **tune)


@pytest.mark.parametrize("n,m,k,taken", [
    (2, 7168, 16384, True), (2, 6144, 16384, True), (2, 28672, 12288, True), (2, 8704, 8256, True),
    # within SHARED_X_VALUES (the 4-CTA route); 3 tokens; N x K past 32768 (K = 28672); rows below 4352;
    # K = 1024 (N x K within SHARED_X_VALUES, K below SHARED_X_MIN_K)
    (2, 7168, 8192, False), (3, 7168, 16384, False), (2, 8192, 28672, False), (2, 4096, 16384, False),
    (2, 28672, 1024, False)])
def test_two_tokens_on_many_rows_and_long_k_take_two_ctas_of_four_groups(n, m, k, taken):
    """2 tokens on many rows with ``16384 < N x K <= 32768``: two CTAs of 4 groups with x in shared memory
    (H200: 7168 x 16384 34.98 -> 29.36 us; slower at 3 and 4 tokens, and at K = 28672 where one CTA fits)."""
    tune = w4a16_route.default_tuning(n, m, 132, k)
    want = {"threads": 256, "ctas": 2, "groups": 4, "x_smem": 1, "dec": 1, "xpair": 1, "across": 1, "w_a": 1}
    if not taken:
        assert not (tune.get("ctas") == 2 and tune.get("groups") == 4 and tune.get("x_smem")), tune
        return
    assert tune == want
    tune.pop("groups")
    op = w4a16.Nvfp4GemvW4A16(k, n, 4, True, False, True, True, **tune)
    assert op.x_smem and not op.late and op.min_blocks * (op.smem_bytes + 1024) <= w4a16.SMEM_A_SM


def test_the_copy_of_x_refuses_batches_of_no_copies():
    """``xbatch`` (copies of x a thread has in flight) is at least 1; the default is ``XBATCH``."""
    with pytest.raises(ValueError, match="xbatch=0"):
        w4a16.Nvfp4GemvW4A16(4096, 1, 2, True, False, True, True, x_smem=1, xbatch=0)
    assert w4a16.Nvfp4GemvW4A16(4096, 1, 2, True, False, True, True, x_smem=1).xbatch == w4a16.XBATCH == 8


@pytest.mark.parametrize("n", [9, 16, 17, 24, 32])
@pytest.mark.parametrize("m,k,threads,groups", [
    (4096, 4096, 512, 4), (4096, 14336, 512, 4), (7168, 16384, 512, 4), (8192, 28672, 512, 4), (6144, 4096, 512, 3),
    (28672, 4096, 256, 7), (4096, 1024, 256, 4), (1024, 4096, 512, 1),
    # the edges: 4-group tiles of exactly two rounds (8448 rows) and one tile more; K = 2048 and one slice less
    (8448, 4096, 512, 4), (8576, 4096, 256, 5), (4096, 2048, 512, 4), (4096, 1984, 256, 4)])
def test_from_nine_tokens_the_tiles_take_as_many_groups_as_the_registers_hold(n, m, k, threads, groups):
    """x as the A operand is read once a tile per warp (N / (2 * groups) times w's bytes): 9..16 tokens take
    16 warps of up to 4 groups where the 4-group tiles fill at most two rounds of the SMs (and K has a slice
    for every warp), else, and from 17 tokens, 8 warps of up to 8 groups (H200: N = 32 at 7168 x 16384
    99.95 -> 54.40 us with 7 groups; 28672 x 4096 at N = 16: 7 groups 46.75 us, 16 warps of 6 spill)."""
    tune = w4a16_route.default_tuning(n, m, 132, k)
    if n > 16 and threads == 512:
        threads, groups = 256, {4096: 4, 7168: 7, 8192: 8, 6144: 6, 1024: 1, 8448: 8}[m]
    if n <= 16 and m // 32 > 2 * 132 and (k >= 4096 or k == 2048) and n * k <= 65536:  # shared x (tests above)
        threads, groups = 512, 4
    if n > 16 and k == 2048:  # x in shared memory (test above)
        threads, groups = 512, max(2, w4a16_route.w4a16_groups(n, m, 132, cap=4))
    assert (tune["threads"], tune["groups"], tune["across"]) == (threads, groups, 1), tune
    # what 16 warps of 128 registers hold without a stack (sm_90a, tests/leaderboard/test_compile.py)
    assert tune["groups"] <= (4 if tune["threads"] == 512 else w4a16.MAX_GROUPS)


@pytest.mark.parametrize("n", [1, 2, 8])
@pytest.mark.parametrize("m", [128, 4096, 7168, 28672])
def test_w_a_gets_an_even_group_count_within_the_rows(n, m):
    """``w_a`` pairs the groups (16 rows an MMA): the count the plan picks for it is even and never more than
    the rows hold; 7168 rows take 8 (112 tiles, one round) where the unrestricted count is 7."""
    gr = w4a16_route.w4a16_groups(n, m, 132, even=True)
    assert gr % 2 == 0 and 2 <= gr <= min(8, m // 8)
    if m == 7168:
        assert gr == 8


@pytest.mark.parametrize("n,cap", [(1, 8), (8, 8), (9, 6), (16, 6), (17, 4), (24, 4), (25, 2), (32, 2)])
def test_groups_stay_within_what_the_registers_hold(n, cap):
    assert all(1 <= w4a16_route.w4a16_groups(n, m, 132) <= cap for m in (128, 4096, 7168, 28672))
    if cap == 8:  # 7168 rows: 128 tiles of 7 groups, one round on 132 SMs
        assert w4a16_route.w4a16_groups(n, 7168, 132) == 7


def test_kernel_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match="1..32 tokens"):
        w4a16.Nvfp4GemvW4A16(4096, 33, 4, True, False, False, True)
    with pytest.raises(ValueError, match="do not fit in shared memory"):
        w4a16.Nvfp4GemvW4A16(32768, 32, 2, True, False, False, True, x_smem=1)
    assert not w4a16.Nvfp4GemvW4A16(32768, 32, 2, True, False, False, True).x_smem
    assert w4a16.Nvfp4GemvW4A16(16384, 1, 4, True, False, False, True).x_smem


def test_e2m1_decode_gives_every_code_without_a_table():
    """The dequantized product's decode (no host-to-device table, so no sync on CUDA) equals the e2m1 table,
    -0.0 included, for every byte."""
    from nvfp4_gemv.quant import e2m1_decode

    u = torch.arange(256, dtype=torch.uint8).view(2, 128)
    t = torch.tensor(reference.E2M1_VALUES, dtype=torch.float32)
    want = torch.stack((t[(u & 15).long()], t[(u >> 4).long()]), -1).reshape(2, 256)
    got = e2m1_decode(u)
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())


@pytest.mark.parametrize("blocked", [False, True])
def test_dequantized_weights_are_exact_in_both_dtypes(blocked):
    _, _, w, ws, _ = w4a16_inputs(1, 256, 1024, seed=12, device="cpu", blocked=blocked)
    exact = w4a16_exact(torch.eye(1024, dtype=torch.bfloat16), w, ws, None, blocked)[0].T  # [M, K]
    for dtype in (torch.bfloat16, torch.float16):
        got = op_plan.dequantized(w, ws, 1024, blocked, dtype)
        assert got.dtype == dtype and torch.equal(got.double(), exact)


@pytest.mark.parametrize("kw", [{"n_tok": 9, "groups": 2, "w_a": 1}, {"n_tok": 4, "groups": 3, "w_a": 1},
                                {"n_tok": 4, "groups": 2, "chains": 3}])
def test_experiment_tunings_refuse_what_they_cannot_run(kw):
    with pytest.raises(ValueError, match="w_a|chains"):
        w4a16.Nvfp4GemvW4A16(4096, kw.pop("n_tok"), kw.pop("groups"), True, False, True, True, **kw)


class _FakeKernel:
    def __init__(self, op):
        self.op = op


@pytest.mark.parametrize("m", [128, 4096, 7168, 28672])
def test_every_routed_plan_builds_kernels_the_class_accepts(m, monkeypatch):
    """The plan's route for 1..40 tokens (no GPU: the kernel objects are built, not compiled, on 132 SMs):
    every launch's tuning is one ``Nvfp4GemvW4A16`` takes (``w_a`` with an even group count), ``w_a`` exactly
    up to 8 tokens, and at most 32 tokens a launch."""
    monkeypatch.setattr(op_plan, "_sm_count", lambda dev: 132)
    monkeypatch.setattr(op_plan, "_get_kernel", lambda dev, key: _FakeKernel(
        w4a16.Nvfp4GemvW4A16(key[2], key[3], key[4], key[5], key[6], key[7], key[8], **dict(key[9]))))
    from nvfp4_gemv.reference import check_args

    k = 512
    w = torch.zeros(m, k // 2, dtype=torch.uint8)
    ws = torch.zeros(m, k // 16, dtype=torch.uint8).view(torch.float8_e4m3fn)
    for n in range(1, 41):
        x = torch.zeros(n, k, dtype=torch.bfloat16)
        plan = op_plan.W4A16Plan(x, w, ws, None, None, torch.bfloat16,
                               check_args(x, None, w, ws, None, torch.bfloat16, None))
        ops = [kern.op for kern, _, _ in plan.launches]
        assert sum(op.n_tok for op in ops) == n and all(op.n_tok <= 32 for op in ops)
        assert all(op.w_a == (op.n_tok <= 8) and (not op.w_a or op.groups % 2 == 0) for op in ops), n


@pytest.mark.parametrize("m,k,want", [
    (7168, 16384, {"groups": 2, "ctas": 4, "across": 1}), (6144, 4096, {"groups": 2, "ctas": 4, "across": 1}),
    (4352, 26560, {"groups": 2, "ctas": 4, "across": 1}),  # the largest K whose four CTAs' shared memory fits a SM
    (4352, 26624, {"groups": 4, "ctas": 2}), (8192, 28672, {"groups": 4, "ctas": 2}),
    (10240, 8192, {"groups": 2, "ctas": 5, "across": 1}),  # 640 tiles: one round of five CTAs a SM, not of four
    (8448, 8192, {"groups": 2, "ctas": 4, "across": 1}),  # 528 tiles: one round of four
    (8576, 8192, {"groups": 2, "ctas": 5, "across": 1}),  # 536 tiles
    (10496, 8192, {"groups": 2, "ctas": 5, "across": 1}),  # 656 tiles, the most (M % 128 == 0) in one round of five
    (10624, 8192, {"groups": 2, "ctas": 4, "across": 1}),  # 664 tiles
    (7168, 896, {"groups": 2, "ctas": 4}),  # K < 1024: warps without slices; across not taken
    (10240, 20992, {"groups": 2, "ctas": 4, "across": 1})])  # five CTAs' x do not fit (four do)
def test_one_token_route_of_many_rows_takes_four_ctas_where_their_x_fits(m, k, want):
    """One token, M / 32 over the SMs: x in shared memory, the three-operation decode, x in pair order and the
    scales after the MMA (``late``); 4 CTAs of 2 groups a SM where four such CTAs fit a SM's shared memory
    (5 where the tiles fill five in one round but not four, and five fit), with ``across``, else 2 of 4. The
    class builds it within that memory."""
    tune = w4a16_route.default_tuning(1, m, 132, k)
    assert tune == {"threads": 256, "w_a": 1, "dec": 1, "xpair": 1, "late": 1, **want}
    groups = tune.pop("groups")
    op = w4a16.Nvfp4GemvW4A16(k, 1, groups, True, False, True, True, **tune)
    assert op.x_smem and op.xpair and op.dec and op.late and op.min_blocks * (op.smem_bytes + 1024) <= w4a16.SMEM_A_SM


@pytest.mark.parametrize("m,k,taken", [
    (28672, 4096, True), (14336, 4096, True), (12288, 4096, True), (10752, 4096, True),  # 672 tiles: 5.1 a SM
    (10240, 4096, False), (8192, 4096, False), (6144, 4096, False),  # 640 / 512 / 384 tiles (5 CTAs; 4; 4)
    (28672, 2048, True), (28672, 3072, True), (14336, 5120, True), (28672, 6144, True), (28672, 4160, True),
    (28672, 1984, False), (28672, 6208, False), (28672, 8192, False)])  # measured 2048..6144 (level at 8192)
def test_one_token_from_k_2048_to_6144_on_many_rows_takes_four_warp_ctas_in_even_rounds(m, k, taken):
    """One token at K 2048..6144 where the 2-group tiles are at least 5 a SM: CTAs of 4 warps, 8 a SM, the
    grid cut to even rounds (H200: 28672 x 4096 27.68 -> 25.34 us, docs/results.md, "Twelfth session");
    elsewhere the 8-warp CTAs as before."""
    tune = w4a16_route.default_tuning(1, m, 132, k)
    assert (tune["threads"] == 128) == taken and (tune.get("even") == 1) == taken, tune
    if taken:
        assert tune == {"threads": 128, "ctas": 8, "groups": 2, "dec": 1, "xpair": 1, "late": 1, "across": 1,
                        "even": 1, "w_a": 1}
        groups = tune.pop("groups")
        op = w4a16.Nvfp4GemvW4A16(k, 1, groups, True, False, True, True, **tune)
        assert op.min_blocks * (op.smem_bytes + 1024) <= w4a16.SMEM_A_SM
        tiles = m // 16
        grid = op.grid_x(m, 132)
        rounds = -(-tiles // grid)
        # the fewest rounds, and the fewest CTAs that take them (one CTA fewer would need another round)
        assert grid <= 8 * 132 and rounds == -(-tiles // (8 * 132)) and (grid - 1) * rounds < tiles
        if m == 28672:
            assert (grid, rounds) == (896, 2)  # 896 CTAs of 2 tiles


def test_even_rounds_cut_the_grid_only_where_the_tiles_leave_a_partial_round():
    """``even`` (host side): the fewest rounds, then the fewest CTAs that take them; without it one CTA a slot."""
    kw = dict(threads=128, ctas=8, groups=2, dec=1, xpair=1, late=1, across=1, w_a=1)
    even = w4a16.Nvfp4GemvW4A16(4096, 1, 2, True, False, True, True, even=1, **{k: v for k, v in kw.items() if k != "groups"})
    plain = w4a16.Nvfp4GemvW4A16(4096, 1, 2, True, False, True, True, **{k: v for k, v in kw.items() if k != "groups"})
    for m, want_even, want_plain in ((28672, 896, 1056), (16384, 1024, 1024), (20480, 640, 1056), (128, 8, 8),
                                     (33792, 1056, 1056), (35840, 747, 1056)):
        assert (even.grid_x(m, 132), plain.grid_x(m, 132)) == (want_even, want_plain), m


@pytest.mark.parametrize("kw,k,message", [
    ({"late": 1, "w_a": 1, "xpair": 1, "x_smem": 1, "groups": 2, "n_tok": 2}, 4096, "late takes one token"),
    ({"late": 1, "w_a": 0, "xpair": 1, "x_smem": 1, "groups": 2}, 4096, "late takes one token"),
    ({"late": 1, "w_a": 1, "xpair": 1, "x_smem": 0, "groups": 2}, 4096, "late takes one token"),
    ({"across": 1, "depth": 2, "threads": 256, "groups": 2}, 1920, "across at depth 2 needs K > 1920"),
])
def test_late_and_across_refuse_builds_they_cannot_make(kw, k, message):
    """``late`` needs one token, ``w_a`` and x paired in shared memory; ``across`` at depth D needs every warp
    with slices to hold D of them (K = 2048 is the least at depth 2 with 8 warps; any K at depth 1)."""
    kw = dict(kw)
    n_tok, groups = kw.pop("n_tok", 1), kw.pop("groups")
    with pytest.raises(ValueError, match=message):
        w4a16.Nvfp4GemvW4A16(k, n_tok, groups, True, False, True, True, **kw)
    if "across" in kw:
        assert w4a16.Nvfp4GemvW4A16(k + 128, n_tok, groups, True, False, True, True, **kw).across
        assert w4a16.Nvfp4GemvW4A16(64, n_tok, groups, True, False, True, True, across=1, threads=256).across


def test_measuring_builds_refuse_what_they_cannot_run():
    """``probe`` (the measuring builds of ``tools/sweep_w4a16.sh``: loads only, arithmetic only, w's loads only)
    is 0..3."""
    with pytest.raises(ValueError, match="probe=4"):
        w4a16.Nvfp4GemvW4A16(4096, 1, 2, True, False, True, True, probe=4)
    assert w4a16.Nvfp4GemvW4A16(4096, 1, 2, True, False, True, True, probe=3).probe == 3


@pytest.mark.parametrize("kw,k,message", [({"bulk": 1}, 4096, "bulk=1"), ({"bulk": 9}, 4096, "bulk=9"),
                                          ({"bulk": 2, "w_blocked": True}, 4096, "plain scales"),
                                          ({"bulk": 2}, 4608, "whole stages"),
                                          ({"bulk": 2, "span": 3}, 4096, "whole stages"),
                                          ({"bulk": 2, "groups": 5}, 4096, "at most 4 groups"),
                                          ({"bulk": 2, "x_smem": 0}, 4096, "bulk takes x in shared memory")])
def test_bulk_refuses_builds_it_cannot_make(kw, k, message):
    """``bulk`` (rounds of W slices of the tile's rows copied into shared memory by cp.async.bulk) needs 2..8
    stages, plain scales, whole stages of ``span`` rounds (K % (128 W span) == 0), at most 4 groups (32 rows: a
    lane copies a row) and x in shared memory; it replaces across (its stages run on into the next tile)."""
    kw = {"threads": 256, "x_smem": 1, "w_blocked": False, "groups": 2, **kw}
    n_tok = 9 if kw["groups"] > 4 else 1  # (one token's w_a takes even groups)
    with pytest.raises(ValueError, match=message):
        w4a16.Nvfp4GemvW4A16(k, n_tok, kw.pop("groups"), True, kw.pop("w_blocked"), True, True, **kw)
    op = w4a16.Nvfp4GemvW4A16(3072, 1, 2, True, False, True, True, threads=256, x_smem=1, bulk=4, across=1)
    assert op.bulk == 4 and op.rounds == 3 and not op.across


def test_a_prefill_sized_plan_checks_addresses_then_takes_the_dequantized_product(monkeypatch):
    """From ``DEQUANT_MIN_TOKENS`` tokens the plan launches no kernel: a call checks the addresses as every call
    does, then hands its tensors to ``dequant_mm`` (stubbed: fp32-output ``torch.mm`` is CUDA's; its result is
    tested on the GPU)."""
    from nvfp4_gemv.reference import check_args

    n, m, k = op_plan.DEQUANT_MIN_TOKENS, 128, 256
    x = torch.zeros(n, k + 8, dtype=torch.bfloat16)
    w = torch.zeros(m, k // 2, dtype=torch.uint8)
    ws = torch.zeros(m, k // 16, dtype=torch.uint8).view(torch.float8_e4m3fn)
    plan = op_plan.W4A16Plan(x[:, :k], w, ws, None, None, torch.bfloat16,
                           check_args(x[:, :k], None, w, ws, None, torch.bfloat16, None))
    assert plan.dequant and not plan.launches
    got = []
    monkeypatch.setattr(op_plan, "dequant_mm", lambda *args: got.append(args) or "product")
    assert plan(x[:, :k], w, ws, None, None, torch.bfloat16) == "product" and got[0][6:] == (k, False, False)
    with pytest.raises(ValueError, match="argument 'x'"):
        plan(x[:, 4:k + 4], w, ws, None, None, torch.bfloat16)


@pytest.mark.parametrize("offset", [2, 4, 8])
def test_bulk_is_refused_for_scales_off_sixteen_byte_rows(offset, monkeypatch):
    """A tuning that asks for ``bulk`` (16-byte bulk copies of the scales' rows) is refused, naming
    ``w_scale``, for scales at an address off 16 bytes or with rows off 16 bytes (no GPU: the plan's kernels are
    built, not compiled); at an aligned one it builds, and a call with scales moved off 16 bytes (same shape and
    strides) is refused before any launch."""
    from nvfp4_gemv.reference import check_args

    monkeypatch.setattr(op_plan, "_sm_count", lambda dev: 132)
    monkeypatch.setattr(op_plan, "_get_kernel", lambda dev, key: _FakeKernel(
        w4a16.Nvfp4GemvW4A16(key[2], key[3], key[4], key[5], key[6], key[7], key[8], **dict(key[9]))))
    m, k = 1152, 4096
    x = torch.zeros(1, k, dtype=torch.bfloat16)
    w = torch.zeros(m, k // 2, dtype=torch.uint8)
    tune = {"threads": 256, "w_a": 1, "x_smem": 1, "xpair": 1, "late": 1, "groups": 2, "ctas": 4, "bulk": 2}
    base = torch.zeros(m * k // 16 + 16, dtype=torch.uint8)
    at = (-base.data_ptr()) % 16
    for off, ok in ((at, True), (at + offset, False)):
        ws = base[off: off + m * k // 16].view(m, k // 16).view(torch.float8_e4m3fn)
        args = (x, w, ws, None, None, torch.bfloat16, check_args(x, None, w, ws, None, torch.bfloat16, None))
        if ok:
            plan = op_plan.W4A16Plan(*args, tuning=tuple(sorted(tune.items())))
            assert plan.ws_mask == 15 and plan.launches[0][0].op.bulk == 2
            moved = base[off + offset: off + offset + m * k // 16].view(m, k // 16).view(torch.float8_e4m3fn)
            with pytest.raises(ValueError, match="argument 'w_scale'.*a multiple of 16"):
                plan(x, w, moved, None, None, torch.bfloat16)
        else:
            with pytest.raises(ValueError, match="argument 'w_scale'.*16-byte aligned"):
                op_plan.W4A16Plan(*args, tuning=tuple(sorted(tune.items())))
    wide = torch.zeros(m, k // 16 + 8, dtype=torch.uint8)[:, :k // 16].view(torch.float8_e4m3fn)  # rows 264 apart
    with pytest.raises(ValueError, match="argument 'w_scale'.*row stride 264"):
        op_plan.W4A16Plan(x, w, wide, None, None, torch.bfloat16, check_args(x, None, w, wide, None, torch.bfloat16, None),
                        tuning=tuple(sorted(tune.items())))


@pytest.mark.parametrize("packed", [False, True])
def test_route_is_the_rules_build_as_a_frozen_config(packed):
    """``w4a16_route.route`` gives each launch's build as a frozen ``W4A16Route``: the rules' tuning
    (``default_tuning``), the groups they name or ``w4a16_groups``, the packed layout where asked."""
    for n, m, k in [(1, 28672, 4096), (2, 4096, 4096), (4, 2048, 8192), (8, 14336, 4096), (16, 4096, 2048),
                    (32, 57344, 8192)]:
        r = w4a16_route.route(n, m, k, 132, (), packed)
        tune = {**w4a16_route.default_tuning(n, m, 132, k), **({"packed": 1} if packed else {})}
        groups = tune.pop("groups", None) or w4a16_route.w4a16_groups(n, m, 132, even=bool(tune.get("w_a")))
        assert (r.tokens, r.groups, r.tuning) == (n, groups, tuple(sorted(tune.items())))
        assert hash(r) == hash(w4a16_route.route(n, m, k, 132, (), packed))
        with pytest.raises(dataclasses.FrozenInstanceError):
            r.groups = 1


def test_route_asks_the_kernel_and_refuses_with_its_reason():
    assert w4a16.Nvfp4GemvW4A16.can_implement(4096, 1, 2, late=1, w_a=1, xpair=1, x_smem=1)
    assert not w4a16.Nvfp4GemvW4A16.can_implement(4096, 2, 2, late=1, w_a=1, xpair=1, x_smem=1)
    assert not w4a16.Nvfp4GemvW4A16.can_implement(4096, 1, 2, no_such_knob=1)
    with pytest.raises(ValueError, match=r"cannot build K=4096, 2 tokens a launch.*late takes one token"):
        w4a16_route.route(2, 4096, 4096, 132, (("late", 1), ("xpair", 1), ("x_smem", 1)))


def _slices_loaded(op):
    """Every slice index ``_load_slice`` gets in an ``across`` build, before its clamp: each warp's first
    ``depth`` slices, then in its loop over its slices the one ``depth`` ahead (past its last: the next tile's)."""
    W, D = op.warps, op.depth
    for wid in range(W):
        my = (op.n_slices - wid + W - 1) // W
        yield from (wid + d * W for d in range(D))
        for i in range(my):
            nx = int(i + D >= my)
            yield wid + (i + D - nx * my) * W


@pytest.mark.parametrize("k", [256, 512, 896, 1024, 1984, 2048, 2112, 4096, 6144, 14336])
@pytest.mark.parametrize("threads", [128, 256, 512])
@pytest.mark.parametrize("depth", [1, 2])
def test_x_loads_are_volatile_unless_every_slice_index_is_in_range(k, threads, depth):
    """``x_fixed`` (x's register loads not volatile, free to be hoisted) only where every slice index the
    build computes is below ``n_slices`` before the clamp: a load moved above its guard then still reads
    inside x (session 66's fault was such a load at K = 256, eight warps and two slices)."""
    try:
        op = w4a16.Nvfp4GemvW4A16(k, 16, 2, True, False, True, True, across=1, threads=threads, depth=depth,
                                  x_smem=0)
    except ValueError:
        pytest.skip("a build the class refuses")
    assert not op.x_fixed or all(sl < op.n_slices for sl in _slices_loaded(op))
    assert not op.x_fixed or k % 128 == 0  # (K % 128 == 64: the last slice's chunks past the row, kept by `live`)
    if k == 2048 and threads == 512:
        assert op.x_fixed  # (16 warps, one slice each: x loaded once a CTA)


@pytest.mark.parametrize("n,m,k,fixed", [(10, 512, 256, False), (2, 256, 512, False), (10, 2048, 2048, False),
                                         (16, 2048, 2048, True), (16, 512, 256, False)])
def test_routed_builds_load_x_volatile_where_warps_lack_slices(n, m, k, fixed, monkeypatch):
    """The tiny Llama's prefill (K = 256: eight warps, two slices) keeps x's loads volatile; 16 tokens on 16
    warps with a whole slice each (K = 2048) take the hoistable load; 10 tokens there stay volatile (measured
    faster) (docs/design.md, "Loads in inline asm")."""
    monkeypatch.setattr(op_plan, "_sm_count", lambda dev: 132)
    monkeypatch.setattr(op_plan, "_get_kernel", lambda dev, key: _FakeKernel(
        w4a16.Nvfp4GemvW4A16(key[2], key[3], key[4], key[5], key[6], key[7], key[8], **dict(key[9]))))
    from nvfp4_gemv.reference import check_args

    w = torch.zeros(m, k // 2, dtype=torch.uint8)
    ws = torch.zeros(m, k // 16, dtype=torch.uint8).view(torch.float8_e4m3fn)
    x = torch.zeros(n, k, dtype=torch.bfloat16)
    plan = op_plan.W4A16Plan(x, w, ws, None, None, torch.bfloat16, check_args(x, None, w, ws, None, torch.bfloat16, None))
    ops = [kern.op for kern, _, _ in plan.launches]
    for op in ops:
        if op.x_fixed:
            assert all(sl < op.n_slices for sl in _slices_loaded(op)) and not op.x_smem
    assert any(op.x_fixed for op in ops) == fixed, [(op.warps, op.n_slices, op.across, op.x_smem) for op in ops]

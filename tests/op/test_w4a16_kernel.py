"""The W4A16 kernel (``nvfp4_gemv.w4a16``: bf16/fp16 x times NVFP4 w) against float64, within its stated
bound (half an ulp of the output plus 2^-13 of the sum of |terms|), over token counts (each 8-token half
and both A tiles), K (one slice, fewer slices than warps, ``K % 128 == 64``), M (a last tile that passes M),
scale layouts, x and output dtypes, alpha, cancelling sums and subnormal scales. Outputs are poisoned first."""

import pytest
import torch

from nvfp4_gemv import gemv, gemv_packed, op_plan, pack_weight, w4a16_route
from w4a16_inputs import w4a16_exact, w4a16_inputs, w4a16_violations
from sync_free import no_syncs

pytestmark = pytest.mark.gpu


def check(n, m, k, seed, dtype=torch.bfloat16, out_dtype=torch.bfloat16, blocked=False, alpha=True, cancel=False,
          slack=2.0 ** -13, **kw):
    x, _, w, ws, a = w4a16_inputs(n, m, k, seed, dtype, blocked=blocked, alpha=alpha, cancel=cancel, **kw)
    out = torch.full((n, m), float("nan"), dtype=out_dtype, device="cuda")
    res = gemv(x, None, w, ws, a, out=out)
    torch.cuda.synchronize()
    assert res is out
    exact, terms = w4a16_exact(x, w, ws, a, blocked)
    bad, msg = w4a16_violations(out, exact, terms, slack)
    assert bad == 0, msg


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9, 15, 16, 17, 24, 25, 31, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_token_count_of_a_launch_matches_float64(n, dtype):
    check(n, 512, 1024, seed=n, dtype=dtype)


@pytest.mark.parametrize("m,k", [(128, 64), (128, 128), (256, 192), (384, 4160), (1152, 2048), (7168, 16384),
                                 (4096, 14336), (128, 32768)])
@pytest.mark.parametrize("n", [1, 4, 16, 32])
def test_shapes_match_float64(m, k, n):
    check(n, m, k, seed=m + k + n)


def one_token_rows():
    """The fewest rows (a multiple of 128) whose M / 32 is over this GPU's SMs: the one-token route with x in
    shared memory (4352 on an H200's 132)."""
    return 128 * (32 * torch.cuda.get_device_properties(0).multi_processor_count // 128 + 1)


@pytest.mark.parametrize("k,kw", [(16384, {}), (4160, {}), (28672, {}), (26560, {}), (2048, {"blocked": True}),
                                  (1024, {"min_exp": 0, "max_exp": 1, "alpha": False}), (8192, {"cancel": True})])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_one_token_route_of_many_rows_matches_float64(k, kw, dtype):
    """The one-token build of many rows (``dec``, ``xpair``, ``late``; 4 CTAs of 2 groups a SM, or at K = 28672 2 of 4):
    ``K % 128 == 64``, the largest K at 4 CTAs (26560), blocked scales, subnormal scales with the weights' 0.5,
    cancelling sums."""
    m = one_token_rows()
    tune = w4a16_route.default_tuning(1, m, torch.cuda.get_device_properties(0).multi_processor_count, k)
    assert tune["dec"] and tune["xpair"] and tune["late"] and tune["groups"] == (4 if k == 28672 else 2), tune
    check(1, m, k, seed=k + 3, dtype=dtype, **kw)


@pytest.mark.parametrize("m,kw", [(28672, {}), (12288, {"blocked": True}), (10752, {"cancel": True}),
                                  (14336, {"min_exp": 0, "max_exp": 1, "alpha": False})])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_token_on_many_rows_at_k_4096_takes_four_warp_ctas_in_even_rounds_and_matches_float64(m, kw, dtype):
    """One token at K = 4096 (the route's K run from 2048 to 6144) on rows whose 2-group tiles are at least 5 a SM: CTAs of 4 warps, 8 a SM, as many
    as take the tiles in even rounds (28672 rows: 896 CTAs of 2 tiles on an H200), each warp 8 slices a tile;
    blocked scales, cancelling sums, subnormal scales with the weights' 0.5."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tune = w4a16_route.default_tuning(1, m, sms, 4096)
    if m // 16 < w4a16_route.FOUR_WARPS_TILES * sms:
        pytest.skip(f"{m} rows are too few for the route on {sms} SMs")
    assert tune["threads"] == 128 and tune["ctas"] == 8 and tune["even"] == 1 and tune["late"], tune
    check(1, m, 4096, seed=m + 5, dtype=dtype, **kw)


@pytest.mark.parametrize("k", [4160, 2048, 6144, 8192])
@pytest.mark.parametrize("m", [28672, 8576])
def test_four_warp_ctas_in_even_rounds_match_float64_at_other_k_and_rows(k, m):
    """The same build forced at the route's ends and past them (``K % 128 == 64``: 33 slices on 4 warps; 2048:
    4 slices a warp; 8192, not routed) and on fewer tiles than slots (8576 rows: 536 tiles, one a CTA)."""
    tuning = {"threads": 128, "ctas": 8, "groups": 2, "dec": 1, "xpair": 1, "late": 1, "across": 1, "even": 1,
              "w_a": 1}
    bad, msg = w4a16_violations(*run_forced(tuning, 1, m, k, m + k, torch.bfloat16))
    assert bad == 0, msg


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("m,k,kw", [(17536, 4096, {}), (17536, 4160, {"blocked": True}), (8704, 2048, {"cancel": True}),
                                    (None, 4096, {"min_exp": 0, "max_exp": 1})])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_two_to_four_tokens_on_many_rows_take_shared_x_and_match_float64(n, m, k, kw, dtype):
    """The routed 2..4-token build of many rows (x in shared memory, 4 CTAs of 2 groups, ``dec``, ``xpair``,
    ``across``): several tiles a CTA, ``K % 128 == 64`` with blocked scales (a copy
    count that leaves the last batch of the copy of x part full), cancelling sums, subnormal scales; ``None``:
    the fewest rows that take the route on this GPU."""
    m = m or one_token_rows()
    tune = w4a16_route.default_tuning(n, m, torch.cuda.get_device_properties(0).multi_processor_count, k)
    if n * k > 16384:
        pytest.skip("N x K over 16384 keeps x in registers")
    assert tune["x_smem"] and tune["ctas"] == 4 and tune["groups"] == 2 and not tune.get("late"), tune
    check(n, m, k, seed=n + m + k, dtype=dtype, **kw)


def few_rows():
    """The most and the fewest rows (multiples of 128) that take the 16-warp route of 1..4 tokens on this GPU:
    ``M / 32`` within its SMs, ``M / 16`` at least SMs - SMs / 8 (4224 and 1920 on an H200's 132)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return 128 * (32 * sms // 128), 128 * -(-16 * (sms - sms // 8) // 128)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("rows,k,kw", [(0, 4096, {}), (1, 4160, {"blocked": True}), (0, 8192, {"cancel": True}),
                                       (1, 4096, {"min_exp": 0, "max_exp": 1}), (0, 32768, {})])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_to_four_tokens_on_fewer_rows_take_16_warp_ctas_and_match_float64(n, rows, k, kw, dtype):
    """The routed 16-warp build of 1..4 tokens on rows whose 4-group tiles do not pass the SMs (two CTAs a SM,
    2 groups, x in shared memory, ``late`` at one token): the most and the fewest such rows, ``K % 128 == 64``
    with blocked scales, cancelling sums, subnormal scales, the longest K (one token)."""
    m = few_rows()[rows]
    tune = w4a16_route.default_tuning(n, m, torch.cuda.get_device_properties(0).multi_processor_count, k)
    if not w4a16_route._ctas_fit(2, k, n, 2, threads=512):
        pytest.skip("two CTAs' x do not fit a SM: x in registers")
    assert tune["threads"] == 512 and tune["x_smem"] and tune["ctas"] == 2 and tune["groups"] == 2, tune
    assert bool(tune.get("late")) == (n == 1), tune
    check(n, m, k, seed=n + m + k, dtype=dtype, **kw)


@pytest.mark.parametrize("n", [5, 6, 8])
@pytest.mark.parametrize("k,kw", [(4096, {}), (4160, {"blocked": True}), (4096, {"cancel": True}),
                                  (4096, {"min_exp": 0, "max_exp": 1}), (6144, {})])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_five_to_eight_tokens_take_16_warp_ctas_and_match_float64(n, k, kw, dtype):
    """The routed 16-warp build of 5..8 tokens (two CTAs a SM, 2 groups, x in shared memory, no ``late``) on
    the fewest rows that take it and on many (several tiles a CTA): ``K % 128 == 64`` with blocked scales,
    cancelling sums, subnormal scales, K = 6144 (two CTAs' x fit up to K = 6656 at 8 tokens)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m in (few_rows()[1], 28672):
        tune = w4a16_route.default_tuning(n, m, sms, k)
        assert tune["threads"] == 512 and tune["x_smem"] and tune["ctas"] == 2 and not tune.get("late"), tune
        check(n, m, k, seed=n + m + k, dtype=dtype, **kw)


@pytest.mark.parametrize("n", [9, 12, 15, 16])
@pytest.mark.parametrize("k,kw", [(4096, {}), (4160, {"blocked": True}), (4096, {"cancel": True}),
                                  (4096, {"min_exp": 0, "max_exp": 1}), (2048, {})])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nine_to_sixteen_tokens_on_many_rows_take_shared_x_and_match_float64(n, k, kw, dtype):
    """The routed build of 9..16 tokens on rows past two rounds of 4-group tiles (one CTA of 16 warps, 4 groups,
    x as the A operand from shared memory): the fewest such rows and many, ``K % 128 == 64`` with blocked
    scales (up to the N x K it takes), cancelling sums, subnormal scales."""
    if n * k > w4a16_route.MANY_TOKENS_X_VALUES:
        pytest.skip("N x K past the shared-x range: x in registers")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m in (128 * (32 * (2 * sms + 1) // 128 + 1), 28672):
        tune = w4a16_route.default_tuning(n, m, sms, k)
        assert tune == {"threads": 512, "x_smem": 1, "across": 1, "groups": 4}, tune
        check(n, m, k, seed=n + m + k, dtype=dtype, **kw)


@pytest.mark.parametrize("n", [17, 24, 32])
@pytest.mark.parametrize("m,k,kw", [(28672, 2048, {}), (2048, 2048, {"blocked": True}), (3072, 2048, {"cancel": True}),
                                    (1152, 2048, {"min_exp": 0, "max_exp": 1}), (128, 2048, {})])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_seventeen_to_32_tokens_take_shared_x_and_match_float64(n, m, k, kw, dtype):
    """The routed build of 17..32 tokens at K = 2048 (one CTA of 16 warps, x as two A tiles from shared memory,
    2..4 groups): many rows and few (one tile a CTA or less; 128 rows: the floor of 2 groups), blocked scales,
    cancelling sums, subnormal scales."""
    tune = w4a16_route.default_tuning(n, m, torch.cuda.get_device_properties(0).multi_processor_count, k)
    assert tune["threads"] == 512 and tune["x_smem"] and 2 <= tune["groups"] <= 4, tune
    check(n, m, k, seed=n + m + k, dtype=dtype, **kw)


@pytest.mark.parametrize("k,kw", [(16384, {}), (12352, {"blocked": True}), (8256, {"cancel": True}),
                                  (16384, {"min_exp": 0, "max_exp": 1})])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_two_tokens_on_many_rows_and_long_k_take_two_ctas_of_four_groups_and_match_float64(k, kw, dtype):
    """The routed 2-token build of many rows with ``16384 < N x K <= 32768`` (two CTAs of 4 groups, x in shared
    memory, ``dec``, ``xpair``, ``across``): ``K % 128 == 64`` with blocked scales, cancelling sums, subnormal
    scales, on the fewest rows that pass the SMs and on several tiles a CTA."""
    for m in (one_token_rows(), 17536):
        tune = w4a16_route.default_tuning(2, m, torch.cuda.get_device_properties(0).multi_processor_count, k)
        assert tune["x_smem"] and tune["ctas"] == 2 and tune["groups"] == 4 and not tune.get("late"), tune
        check(2, m, k, seed=m + k, dtype=dtype, **kw)


@pytest.mark.parametrize("xbatch", [1, 3, 8, 32])
@pytest.mark.parametrize("n,tuning", [
    (3, {"threads": 256, "ctas": 4, "groups": 2, "x_smem": 1, "dec": 1, "xpair": 1, "across": 1, "w_a": 1}),
    (1, {"threads": 256, "ctas": 4, "groups": 2, "x_smem": 1, "dec": 1, "xpair": 1, "late": 1, "across": 1, "w_a": 1}),
    (16, {"threads": 256, "x_smem": 1, "groups": 2})])
def test_the_copy_of_x_in_batches_matches_float64(xbatch, n, tuning):
    """x copied into shared memory ``xbatch`` copies a thread at a time: one, a batch that leaves the last part
    full (K = 4160: 520 copies a row), the default, more than a thread's copies; with and without ``late``'s
    padded row, and with x as the A operand (16 tokens)."""
    bad, msg = w4a16_violations(*run_forced({**tuning, "xbatch": xbatch}, n, 17536, 4160, xbatch + n, torch.bfloat16))
    assert bad == 0, msg


@pytest.mark.parametrize("n", [1, 13, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_blocked_scales_match_float64(n, dtype):
    check(n, 640, 2112, seed=5 + n, dtype=dtype, blocked=True)


@pytest.mark.parametrize("dtype,out_dtype,alpha", [(torch.bfloat16, torch.float16, False),
                                                   (torch.float16, torch.bfloat16, True),
                                                   (torch.float16, torch.float16, False)])
def test_epilogues_match_float64(dtype, out_dtype, alpha):
    check(5, 256, 512, seed=3, dtype=dtype, out_dtype=out_dtype, alpha=alpha)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 20])
def test_cancelling_sums_stay_within_the_bound(dtype, n):
    check(n, 256, 8192, seed=11, dtype=dtype, cancel=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_subnormal_scales_and_half_values_are_exact(dtype):
    """Scales of exponent field 0 and 1 (e4m3 subnormals, 2^-9 .. 2^-6), the weights' 0.5 (bf16's subnormal
    2^-127 before scaling): a wrong decode shows as an error far above the bound."""
    check(16, 256, 1024, seed=7, dtype=dtype, min_exp=0, max_exp=1, alpha=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nan_byte", [0x7F, 0xFF])
@pytest.mark.parametrize("n", [3, 1])
def test_a_nan_scale_byte_makes_its_row_nan_as_the_reference_does(dtype, nan_byte, n):
    """One e4m3 NaN scale byte: that row's outputs are NaN for every token (the float64 reference's answer),
    every other output within the bound; one token on many rows takes ``late`` (the scale applied to the
    block sum). The output is poisoned with a finite value here, not NaN."""
    m, k, row = (256 if n > 1 else one_token_rows()), 1024, 77
    if n == 1:
        assert w4a16_route.default_tuning(1, m, torch.cuda.get_device_properties(0).multi_processor_count, k)["late"]
    x, _, w, ws, a = w4a16_inputs(n, m, k, seed=11, dtype=dtype)
    ws.view(torch.uint8)[row, 5] = nan_byte
    out = torch.full((n, m), 1234.0, dtype=torch.bfloat16, device="cuda")
    gemv(x, None, w, ws, a, out=out)
    exact, terms = w4a16_exact(x, w, ws, a)
    assert torch.isnan(exact[:, row]).all()
    got = out.cpu()
    assert torch.isnan(got[:, row]).all(), got[:, row]
    keep = torch.arange(m) != row
    bad, msg = w4a16_violations(out[:, keep], exact[:, keep], terms[:, keep])
    assert bad == 0, msg


def test_many_tokens_take_launches_of_32_then_the_dequantized_product():
    check(70, 256, 1024, seed=21)  # three launches of 24 (a group of at most 32)
    check(op_plan.DEQUANT_MIN_TOKENS, 256, 1024, seed=22, slack=2.0 ** -12)  # dequantize + torch.mm


def test_results_do_not_depend_on_the_run():
    x, _, w, ws, a = w4a16_inputs(9, 1024, 4096, 1)
    first = gemv(x, None, w, ws, a)
    assert all(torch.equal(first, gemv(x, None, w, ws, a)) for _ in range(3))


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_runs_on_the_current_stream(packed):
    x, _, w, ws, a = w4a16_inputs(3, 1024, 4096, 6)
    wp = pack_weight(w, ws) if packed else None
    out = torch.empty(3, 1024, dtype=torch.bfloat16, device="cuda")

    def run():
        return gemv_packed(x, wp, a, out=out) if packed else gemv(x, None, w, ws, a, out=out)

    run()  # compile and plan outside
    out.fill_(float("nan"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # (the poison first)
    with torch.cuda.stream(s):
        # keeps s busy for about half a second: the op must queue behind this, and the host must reach the
        # read below first even on a machine loaded by the sharded GPU suite (100M cycles, ~55 ms, was not)
        torch.cuda._sleep(1_000_000_000)
        run()
    early = out.cpu()  # on the default stream, which does not wait for s
    assert torch.isnan(early).all(), "the op ran before the work queued on its stream"
    s.synchronize()
    exact, terms = w4a16_exact(x, w, ws, a)
    assert w4a16_violations(out, exact, terms)[0] == 0


def test_a_cuda_graph_replays_the_kernel():
    x, _, w, ws, a = w4a16_inputs(4, 512, 2048, 2)
    out = torch.empty(4, 512, dtype=torch.bfloat16, device="cuda")
    gemv(x, None, w, ws, a, out=out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gemv(x, None, w, ws, a, out=out)
    x.copy_(torch.randn_like(x))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    exact, terms = w4a16_exact(x, w, ws, a)
    assert w4a16_violations(out, exact, terms)[0] == 0


def test_compiled_fullgraph_runs_the_op():
    x, _, w, ws, a = w4a16_inputs(3, 256, 512, 4)
    f = torch.compile(lambda x: gemv(x, None, w, ws, a), fullgraph=True)
    assert torch.equal(f(x), gemv(x, None, w, ws, a))


@pytest.mark.parametrize("form", ["w4a16", "w4a4"])
def test_reduce_overhead_compile_captures_the_op(form, monkeypatch):
    """torch.compile(mode="reduce-overhead") (CUDA graph trees, as transformers' static-cache generate uses)
    refuses device memory allocated in its pool that outlives a run: the op's launch plans, first made there
    (the plan caches are emptied first), must hold none (they once kept a result template)."""
    import inputs
    from nvfp4_gemv import op

    torch._dynamo.reset()
    monkeypatch.setattr(op_plan, "_plans", {})
    monkeypatch.setattr(op, "_recent", type(op._recent)())
    if form == "w4a16":
        x, xs, w, ws, a = w4a16_inputs(2, 384, 1024, 30)
        exact, terms = w4a16_exact(x, w, ws, a)
    else:
        x, xs, w, ws, a = inputs.op_inputs(2, 384, 1024, seed=30)
        exact, terms = inputs.op_exact(x, xs, w, ws, a)
    f = torch.compile(lambda x: gemv(x, xs, w, ws, a), mode="reduce-overhead")
    for _ in range(3):  # warm-up (the plan is made here, in the pool), recording, replay
        got = f(x).clone()
    torch.cuda.synchronize()
    assert w4a16_violations(got, exact, terms)[0] == 0


def test_prefill_sized_n_never_syncs_and_is_capturable():
    """From DEQUANT_MIN_TOKENS on, w is dequantized (dequant_kernel) for torch.mm: nothing may copy from the host (a sync) or
    break a CUDA graph capture."""
    n = op_plan.DEQUANT_MIN_TOKENS
    x, _, w, ws, a = w4a16_inputs(n, 256, 2048, 31)
    out = torch.empty(n, 256, dtype=torch.bfloat16, device="cuda")
    gemv(x, None, w, ws, a, out=out)  # the plan, outside
    with no_syncs():
        gemv(x, None, w, ws, a, out=out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gemv(x, None, w, ws, a, out=out)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    exact, terms = w4a16_exact(x, w, ws, a)
    assert w4a16_violations(out, exact, terms, slack=2.0 ** -12)[0] == 0


@pytest.mark.parametrize("n", [1, 5])
def test_strided_x_and_out_rows(n):
    """x rows K + 64 values apart, out rows M + 128 apart: the row strides reach the kernel."""
    xs_, _, w, ws, a = w4a16_inputs(n, 384, 1024, 32)
    x = torch.zeros(n, 1024 + 64, dtype=torch.bfloat16, device="cuda")[:, :1024]
    x.copy_(xs_)
    big = torch.full((n, 384 + 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = big[:, :384]
    gemv(x, None, w, ws, a, out=out)
    torch.cuda.synchronize()
    exact, terms = w4a16_exact(x, w, ws, a)
    assert w4a16_violations(out, exact, terms)[0] == 0
    assert big[:, 384:].isnan().all()  # nothing written between the rows


def test_overlapping_out_rows_are_refused():
    x, _, w, ws, a = w4a16_inputs(3, 256, 512, 33)
    out = torch.empty(3 * 256, dtype=torch.bfloat16, device="cuda").as_strided((3, 256), (128, 1))
    with pytest.raises(ValueError, match="argument 'out': expected rows that do not overlap"):
        gemv(x, None, w, ws, a, out=out)


@pytest.mark.parametrize("tuning", [
    {"w_a": 1, "groups": 2}, {"w_a": 1, "groups": 8}, {"w_a": 1, "groups": 4, "threads": 256, "ctas": 2},
    {"w_a": 1, "groups": 4, "x_smem": 0}, {"chains": 2, "w_a": 0}, {"chains": 2, "w_a": 1, "groups": 6},
    {"w_a": 0, "chains": 1, "groups": 3}, {"dec": 1, "w_a": 0, "groups": 3}, {"dec": 1, "x_smem": 1, "xpair": 1, "w_a": 0},
    {"dec": 1, "xpair": 1, "x_smem": 1, "w_a": 1, "groups": 2, "threads": 256, "ctas": 4, "chains": 2}])
@pytest.mark.parametrize("n,m,k", [(1, 1152, 4096), (3, 384, 4160), (8, 640, 2112)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tunings_on_and_off_the_route_match_float64(tuning, n, m, k, dtype):
    """``w_a`` (w as the MMA's A operand), ``chains`` (two accumulator chains), ``dec`` (the bf16 decode a chunk
    at once) and ``xpair`` (x paired in shared memory) on and off, whatever the route picks, forced through a plan; the last tile moved back (M / 8 not a multiple of the groups), ``K % 128 == 64``."""
    bad, msg = w4a16_violations(*run_forced(tuning, n, m, k, n * 31 + m, dtype))
    assert bad == 0, msg


# tuning key -> the kernel attribute it sets
BUILT_AS = {"w_a": "w_a", "groups": "groups", "threads": "threads", "ctas": "min_blocks", "x_smem": "x_smem",
            "chains": "chains", "dec": "dec", "xpair": "xpair", "late": "late", "depth": "depth", "across": "across",
            "xbatch": "xbatch", "bulk": "bulk", "span": "span", "even": "even"}


def assert_built_as(plan, tuning):
    """Every launch of ``plan`` runs a kernel built with ``tuning``'s values (``w_a`` off when not given; ``dec``
    is a bf16 decode, off for fp16 x)."""
    want = {"w_a": 0, **tuning}
    for kern, _, _ in plan.launches:
        got = {key: int(getattr(kern.op, BUILT_AS[key])) for key in want}
        exp = {key: 0 if key == "dec" and not kern.op.x_bf16 else int(v) for key, v in want.items()}
        assert got == exp, (got, exp)


def run_forced(tuning, n, m, k, seed, dtype, **kw):
    """Fresh inputs (``w4a16_inputs``' ``kw``) through a plan forced to ``tuning`` and checked to build it, the
    output poisoned with NaN first; returns ``(out, exact, terms)``."""
    from nvfp4_gemv.reference import check_args

    x, _, w, ws, a = w4a16_inputs(n, m, k, seed=seed, dtype=dtype, **kw)
    out = torch.full((n, m), float("nan"), dtype=torch.bfloat16, device="cuda")
    dims = check_args(x, None, w, ws, a, torch.bfloat16, out)
    plan = op_plan.W4A16Plan(x, w, ws, a, out, torch.bfloat16, dims, tuning=tuple(sorted(tuning.items())))
    assert_built_as(plan, tuning)
    plan(x, w, ws, a, out, torch.bfloat16)
    torch.cuda.synchronize()
    return (out, *w4a16_exact(x, w, ws, a, kw.get("blocked", False)))


@pytest.mark.parametrize("tuning", [
    {"threads": 256, "ctas": 4, "groups": 2, "chains": 2, "w_a": 1, "x_smem": 1, "dec": 1, "xpair": 1},  # route of s18
    {"threads": 256, "ctas": 2, "groups": 4, "chains": 2, "w_a": 1, "x_smem": 1},
    {"chains": 2, "w_a": 0, "groups": 4}])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_two_accumulator_chains_on_cancelling_sums_stay_within_the_bound(tuning, dtype):
    """Two chains add one more rounding an output; rows whose halves cancel to a remainder far below their
    sum of |terms| still meet the bound."""
    out, exact, terms = run_forced(tuning, 1, 256, 8192, 17, dtype, cancel=True)
    assert (exact.abs() < terms * 2.0 ** -6).float().mean() > 0.9  # the inputs do cancel
    bad, msg = w4a16_violations(out, exact, terms)
    assert bad == 0, msg


LATE = {"threads": 256, "w_a": 1, "x_smem": 1, "xpair": 1, "late": 1, "dec": 1}


@pytest.mark.parametrize("tuning", [{**LATE, "groups": 2, "ctas": 4}, {**LATE, "groups": 4, "ctas": 2},
                                    {**LATE, "groups": 2, "dec": 0}, {**LATE, "groups": 6, "ctas": 1}])
@pytest.mark.parametrize("m,k,kw", [(1152, 4096, {}), (384, 4160, {}), (640, 64, {}), (256, 8192, {"cancel": True}),
                                    (512, 2048, {"min_exp": 0, "max_exp": 1}), (1024, 3072, {"blocked": True})])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_late_scales_match_float64(tuning, m, k, kw, dtype):
    """``late`` (one token; the block scales multiply the MMA block sums, x block-diagonal in the B operand) with
    2, 4 and 6 groups, with and without ``dec``: ``K % 128 == 64`` (the zero-padded row), one chunk (K = 64),
    cancelling sums, subnormal scales with the weights' 0.5, blocked scales, the last tile moved back."""
    bad, msg = w4a16_violations(*run_forced(tuning, 1, m, k, m + k, dtype, **kw))
    assert bad == 0, msg


@pytest.mark.parametrize("tuning", [{**LATE, "groups": 2, "ctas": 4, "depth": 2, "across": 1},
                                    {**LATE, "groups": 4, "ctas": 2, "depth": 2, "across": 1},
                                    {**LATE, "groups": 2, "ctas": 5, "across": 1},
                                    {**LATE, "groups": 6, "ctas": 1, "across": 1}])
@pytest.mark.parametrize("m,k,kw", [(1152, 4096, {}), (17536, 4160, {}), (11264, 2048, {"cancel": True}),
                                    (6272, 3072, {"blocked": True}), (256, 8192, {"min_exp": 0, "max_exp": 1})])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_across_tiles_prefetch_matches_float64(tuning, m, k, kw, dtype):
    """``across`` (a tile's last slices prefetch the next tile's first ones) with one tile a CTA and several
    (17536 and 11264 rows: more tiles than CTAs on up to 137 SMs), the last tile moved back (6 groups: M / 8
    not a multiple of 6), ``K`` at its least (depth x warps slices: 2048 at depth 2) and ``K % 128 == 64``."""
    bad, msg = w4a16_violations(*run_forced(tuning, 1, m, k, m + k + 1, dtype, **kw))
    assert bad == 0, msg


@pytest.mark.parametrize("n,tuning", [(1, {"threads": 256, "x_smem": 0, "w_a": 1, "late": 0, "ctas": 1, "groups": 4,
                                           "across": 1}),
                                      (2, {"threads": 256, "x_smem": 0, "w_a": 1, "across": 1}),
                                      (8, {"threads": 256, "x_smem": 0, "w_a": 1, "across": 1}),
                                      (16, {"threads": 256, "x_smem": 0, "across": 1}),
                                      (16, {"threads": 256, "x_smem": 0, "groups": 8, "across": 1}),
                                      (32, {"threads": 256, "x_smem": 0, "across": 1}),
                                      (32, {"threads": 256, "x_smem": 0, "groups": 7, "across": 1}),
                                      (25, {"threads": 256, "x_smem": 0, "groups": 8, "across": 1})])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_across_on_the_registers_route_matches_float64(n, tuning, dtype):
    """``across`` on the builds with x in registers: w as the A operand up to 8 tokens, x as the A operand (one
    and two A tiles, up to 8 groups) from 16; 17536 rows give each CTA several tiles and a last tile moved back
    where the groups do not divide M / 8 (7 groups); ``K % 128 == 64``."""
    bad, msg = w4a16_violations(*run_forced(tuning, n, 17536, 4160, n + 70, dtype))
    assert bad == 0, msg


BULK_ROUTES = [(1, {**LATE, "groups": 2, "ctas": 4}), (1, {**LATE, "groups": 4, "ctas": 2}),
               (1, {**LATE, "threads": 512, "groups": 2, "ctas": 2}),
               (2, {"threads": 256, "ctas": 4, "groups": 2, "x_smem": 1, "dec": 1, "xpair": 1, "w_a": 1}),
               (8, {"threads": 512, "ctas": 2, "groups": 2, "x_smem": 1, "dec": 1, "xpair": 1, "w_a": 1}),
               (9, {"threads": 512, "x_smem": 1, "groups": 2})]


@pytest.mark.parametrize("bulk", [2, 3])
@pytest.mark.parametrize("n,tuning", BULK_ROUTES)
def test_bulk_rounds_on_every_shared_x_route_match_float64(bulk, n, tuning):
    """``bulk`` (warp 0 copies rounds of W slices of the tile's rows into shared memory, cp.async.bulk a row,
    mbarriers) on the builds with x in shared memory: 17536 rows (several tiles a CTA, the stages running on
    into the next tile, the last tile moved back), K = 6144 (6 rounds of 8 warps, 3 of 16)."""
    bad, msg = w4a16_violations(*run_forced({**tuning, "bulk": bulk}, n, 17536, 6144, n + bulk, torch.bfloat16))
    assert bad == 0, msg


@pytest.mark.parametrize("bulk,span,n,tuning", [
    (bulk, span, n, tuning) for bulk, span in ((2, 2), (3, 2), (2, 3), (2, 6)) for n, tuning in BULK_ROUTES
    if tuning.get("threads") != 512 and span * tuning["groups"] <= 12])  # (two stages of 6 x 4 groups: 226 KB)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bulk_stages_of_several_rounds_match_float64(bulk, span, n, tuning, dtype):
    """``span``: a stage holds that many rounds (one copy of ``span x W x 64`` bytes a row): K = 6144 (6 rounds
    of 8 warps: 3, 2 or 1 stages a tile), 17536 rows (the stages running on into the next tile)."""
    bad, msg = w4a16_violations(*run_forced({**tuning, "bulk": bulk, "span": span}, n, 17536, 6144, n + span, dtype))
    assert bad == 0, msg


@pytest.mark.parametrize("bulk", [2, 4])
@pytest.mark.parametrize("m,k,kw", [(1152, 4096, {"min_exp": 0, "max_exp": 1}), (640, 3072, {}),
                                    (256, 8192, {"cancel": True}), (11264, 1024, {})])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bulk_rounds_of_one_token_match_float64(bulk, m, k, kw, dtype):
    """``bulk`` on the one-token route (``late``): subnormal scales, 3 rounds (K = 3072), cancelling sums, one
    round a tile (K = 1024) over 704 tiles (on 132 SMs at most 2 a CTA: the stages past a CTA's last tile are
    not copied), both x dtypes."""
    tuning = {**LATE, "groups": 2, "ctas": 4, "bulk": bulk}
    bad, msg = w4a16_violations(*run_forced(tuning, 1, m, k, m + k + bulk, dtype, **kw))
    assert bad == 0, msg


def test_bulk_refuses_scales_off_sixteen_byte_rows():
    """Bulk copies take 16-byte aligned rows of plain scales: scales at an address 4 bytes off are refused for
    a tuning that asks for ``bulk``, naming ``w_scale``; the route for them goes without it."""
    from nvfp4_gemv.reference import check_args

    x, _, w, ws, a = w4a16_inputs(1, 1152, 4096, seed=6)
    wide = torch.zeros(1152 * 256 + 4, dtype=torch.uint8, device="cuda")
    off = wide[4:].view(1152, 256).view(torch.float8_e4m3fn)
    off.copy_(ws)
    out = torch.empty(1, 1152, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="argument 'w_scale'"):
        op_plan.W4A16Plan(x, w, off, a, out, torch.bfloat16, check_args(x, None, w, off, a, torch.bfloat16, out),
                        tuning=tuple(sorted({**LATE, "groups": 2, "ctas": 4, "bulk": 2}.items())))
    got = gemv(x, None, w, off, a)
    exact, terms = w4a16_exact(x, w, off, a)
    assert w4a16_violations(got, exact, terms)[0] == 0


@pytest.mark.parametrize("e", [-54, -40, 0, 30, 55])
def test_late_keeps_bf16_x_within_the_bound_from_tiny_to_huge_rows(e):
    """``late`` copies bf16 x times 2^72 (the unscaled weights are ``v * 2^-126``), exact for |x| in
    [2^-62, 2^56): rows whose largest |x| is 1.9 * 2^e, from e = -54 (most values near 2^-56, the least far
    below) to e = 55 (just under 2^56), stay within the bound; scales down to subnormal."""
    m = one_token_rows()
    x, _, w, ws, a = w4a16_inputs(1, m, 4096, seed=e + 100, min_exp=0, max_exp=15)
    x = (x.double() / x.double().abs().max() * 1.9 * 2.0 ** e).to(torch.bfloat16)  # |x| up to 1.9 * 2^e
    assert w4a16_route.default_tuning(1, m, torch.cuda.get_device_properties(0).multi_processor_count, 4096)["late"]
    out = torch.full((1, m), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemv(x, None, w, ws, a, out=out)
    torch.cuda.synchronize()
    exact, terms = w4a16_exact(x, w, ws, a)
    assert torch.isfinite(exact).all()
    bad, msg = w4a16_violations(out, exact, terms)
    assert bad == 0, msg

"""nvfp4_gemv.quantize and its exact reference: bit for bit against a scalar Python quantizer (ties,
saturation, zeros, subnormal scales, signs, NaN and inf, both dtypes), the weight recipe, the op's
contract (validation naming the argument, fakes, opcheck, torch.compile); ``quantize_dequantized`` likewise
against the scalar quantizer's codes decoded by table."""

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import nvfp4_scalar
from nvfp4_gemv import quant
from nvfp4_gemv.quant import (dequantize, quantize, quantize_dequantized, quantize_dequantized_reference,
                               quantize_reference, quantize_weight)

DTYPES = [torch.bfloat16, torch.float16]


def scalar_quantize(x, gs):
    bits = x.view(torch.int16)
    q, s = nvfp4_scalar.quantize(x.float().tolist(), (bits < 0).tolist(), float(gs))
    return torch.tensor(q, dtype=torch.uint8), torch.tensor(s, dtype=torch.uint8)


def assert_matches_scalar(x, gs):
    g = torch.tensor(gs, dtype=torch.float32)
    q, s = quantize_reference(x, g)
    eq, es = scalar_quantize(x, g.item())
    assert q.dtype == torch.uint8 and s.dtype == torch.float8_e4m3fn
    assert q.shape == (x.shape[0], x.shape[1] // 2) and s.shape == (x.shape[0], x.shape[1] // 16)
    assert torch.equal(s.view(torch.uint8), es), (s.view(torch.uint8), es)
    assert torch.equal(q, eq), (q, eq)


def block(values, dtype):
    """One row of 16 values (padded with zeros)."""
    values = list(values) + [0.0] * (16 - len(values))
    return torch.tensor([values], dtype=dtype)


# ----------------------------------------------------------------------------------------------------
# Bit for bit against the scalar quantizer
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gs", [1.0, 0.37, 1 / 0.0123, 3.0e4, 2.0 ** -20])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_rows_match_the_scalar_quantizer(dtype, gs, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(4, 64, generator=g) * torch.logspace(-3, 2, 64)).to(dtype)
    assert_matches_scalar(x, gs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_e2m1_ties_go_to_the_even_code(dtype):
    # amax 6 and gs 1: the scale is exactly 1, so q is x itself
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    x = block([6.0] + ties + [-t for t in ties] + [0.0], dtype)
    q, s = quantize_reference(x, torch.tensor(1.0))
    assert s.view(torch.uint8).flatten().tolist() == [0x38]  # 1.0
    codes = [(b >> (4 * i)) & 0xF for b in q[0].tolist() for i in (0, 1)]
    # 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5->4.0
    assert codes[1:8] == [0, 2, 2, 4, 4, 6, 6]
    assert codes[8:15] == [8, 10, 10, 12, 12, 14, 14]
    assert_matches_scalar(x, 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_values_just_off_the_ties_round_to_the_nearest(dtype):
    x = block([6.0, 0.2578125, 0.7421875, 1.2578125, 1.7421875, 2.515625, 3.484375, 5.0625], dtype)
    q, _ = quantize_reference(x, torch.tensor(1.0))
    codes = [(b >> (4 * i)) & 0xF for b in q[0].tolist() for i in (0, 1)]
    assert codes[1:8] == [1, 1, 3, 3, 5, 5, 7]
    assert_matches_scalar(x, 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_ties_go_to_the_even_mantissa(dtype):
    # (amax / 6) exactly between two e4m3 values: 1.0625 (1.0 | 1.125) -> 1.0; 1.1875 (1.125 | 1.25) -> 1.25
    for amax, expected in ((6.375, 0x38), (7.125, 0x3A)):
        q, s = quantize_reference(block([amax, -1.0], dtype), torch.tensor(1.0))
        assert s.view(torch.uint8).flatten().tolist() == [expected]
        assert_matches_scalar(block([amax, -1.0], dtype), 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_values_above_six_saturate_to_six(dtype):
    # amax 6.3 at gs 1: the scale rounds down to 1.0 (6.3/6 = 1.05), so q = 6.3 > 6 saturates to code 7
    x = block([6.3, -6.3, 6.0], dtype)
    q, s = quantize_reference(x, torch.tensor(1.0))
    assert s.view(torch.uint8).flatten().tolist() == [0x38]
    assert q[0, 0].item() == 0xF7 and q[0, 1].item() == 0x07
    assert_matches_scalar(x, 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_scales_saturate_at_448(dtype):
    x = block([60000.0, 3000.0, -100.0, 1.0], dtype)
    q, s = quantize_reference(x, torch.tensor(1.0))
    assert s.view(torch.uint8).flatten().tolist() == [0x7E]  # 448
    assert q[0, 0].item() & 0xF == 7
    assert_matches_scalar(x, 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("amax", [6 * 2.0 ** -7, 6 * 2.0 ** -9, 6 * 3 * 2.0 ** -10, 6 * 2.0 ** -10, 6 * 2.0 ** -11])
def test_subnormal_scales_and_scales_that_flush_to_zero(dtype, amax):
    # e4m3 subnormals are m * 2^-9; 2^-10 is half the smallest, a tie that rounds to 0 (even)
    x = block([amax, -amax / 3, amax / 7, -0.0], dtype)
    assert_matches_scalar(x, 1.0)
    _, s = quantize_reference(x, torch.tensor(1.0))
    sd = s.view(torch.uint8).item()
    assert (sd == 0) == (amax <= 6 * 2.0 ** -10)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_blocks_get_scale_zero_and_keep_sign_bits(dtype):
    x = block([0.0, -0.0, 0.0, -0.0], dtype)
    q, s = quantize_reference(x, torch.tensor(1.0))
    assert s.view(torch.uint8).flatten().tolist() == [0]
    assert q[0, :2].tolist() == [0x80, 0x80]
    assert_matches_scalar(x, 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_negatives_that_round_to_zero_keep_the_sign_bit(dtype):
    x = block([6.0, -0.1, 0.1, -0.25], dtype)
    q, _ = quantize_reference(x, torch.tensor(1.0))
    assert q[0, 0].item() >> 4 == 0x8 and q[0, 1].item() == 0x80
    assert_matches_scalar(x, 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_gives_a_nan_scale_and_zero_codes_in_its_block_only(dtype):
    x = torch.cat([block([1.0, float("nan"), -2.0], dtype), block([3.0, -1.5], dtype)], dim=1)
    q, s = quantize_reference(x, torch.tensor(1.0))
    assert s.view(torch.uint8).tolist() == [[0x7F, 0x30]]  # NaN; 0.5 for amax 3
    assert q[0, :8].tolist() == [0, 8] + [0] * 6  # -2.0's sign bit, magnitudes 0
    assert_matches_scalar(x, 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_inf_saturates_its_scale_and_its_code(dtype):
    x = block([float("inf"), 1.0, -float("inf")], dtype)
    q, s = quantize_reference(x, torch.tensor(1.0))
    assert s.view(torch.uint8).flatten().tolist() == [0x7E]
    assert q[0, 0].item() == 0x07 and q[0, 1].item() & 0xF == 0xF
    assert_matches_scalar(x, 1.0)


def nudged(v, steps):
    """fp32 ``v`` moved ``steps`` ulps (each element)."""
    for _ in range(abs(steps)):
        v = torch.nextafter(v, torch.full_like(v, math.inf if steps > 0 else -math.inf))
    return v


BF16_1_2 = torch.arange(0x3F80, 0x4000, dtype=torch.int16).view(torch.bfloat16).float()  # [1, 2)


def test_block_scale_is_two_fp32_roundings():
    """Inputs where the order of the scale's fp32 steps shows: ``(amax * gs) / 6`` rounded twice against
    the exact quotient rounded once, and against ``amax * (gs / 6)``; around e4m3 ties (9.375 / 6 = 1.5625
    lies between 1.5 and 1.625, 6.375 / 6 = 1.0625 between 1 and 1.125)."""
    six = torch.tensor(6.0)
    cases = []
    for target in (9.375, 6.375):
        for steps in range(-3, 4):
            gs = nudged(target / BF16_1_2, steps)
            spec = quant._e4m3_bytes((BF16_1_2 * gs) / six)
            exact = quant._e4m3_bytes((BF16_1_2.double() * gs.double() / 6).float())
            other = quant._e4m3_bytes(BF16_1_2 * (gs / six))
            for i in torch.nonzero((spec != exact) | (spec != other)).flatten().tolist()[:3]:
                cases.append((BF16_1_2[i].item(), gs[i].item()))
    assert len(cases) >= 4
    for amax, gs in cases:
        assert_matches_scalar(block([amax, -0.75], torch.bfloat16), gs)


def test_values_are_two_fp32_roundings():
    """Inputs where ``(x * gs) / sd`` and ``x * (gs / sd)`` give different e2m1 codes (sd = 1.125, x near
    the e2m1 ties): the reference takes the first, as the scalar quantizer does."""
    sd = torch.tensor(1.125)
    cases = []
    for tie in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
        for steps in (-2, -1, 1, 2):
            gs = nudged(tie * sd / BF16_1_2, steps)
            none = torch.zeros(BF16_1_2.shape, dtype=torch.bool)
            spec = quant._e2m1_codes((BF16_1_2 * gs) / sd, none)
            other = quant._e2m1_codes(BF16_1_2 * (gs / sd), none)
            for i in torch.nonzero(spec != other).flatten().tolist()[:1]:
                cases.append((BF16_1_2[i].item(), gs[i].item()))
    assert len(cases) >= 4
    for x, gs in cases:
        amax = torch.tensor(6.75 / gs).to(torch.bfloat16).item()  # a block scale of 1.125
        row = block([amax, x, -x], torch.bfloat16)
        assert quantize_reference(row, torch.tensor(gs))[1].view(torch.uint8).item() == 0x39
        assert_matches_scalar(row, gs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packing_puts_the_first_value_in_the_low_nibble(dtype):
    x = block([6.0, 1.0, -2.0, 0.5], dtype)
    q, _ = quantize_reference(x, torch.tensor(1.0))
    assert q[0, 0].item() == 0x27 and q[0, 1].item() == 0x1C


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_input_quantizes_like_its_contiguous_copy(dtype):
    x = torch.randn(64, 6, dtype=dtype).T  # [6, 64] with strides (1, 6)
    gs = torch.tensor(2.5)
    for a, b in zip(quantize_reference(x, gs), quantize_reference(x.contiguous(), gs)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_dequantized_values_are_within_the_e2m1_grid_of_x():
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    gs = torch.tensor(100.0)
    q, s = quantize_reference(x, gs)
    back = dequantize(q, s) / gs
    err = (back - x.float()).abs()
    amax = x.float().abs().reshape(8, 16, 16).amax(-1, keepdim=True).expand(8, 16, 16).reshape(8, 256)
    assert (err <= amax / 6 * 1.0625 + 1e-30).all()  # half the widest e2m1 step (2 between 4 and 6), rel. scale


# ----------------------------------------------------------------------------------------------------
# quantize_dequantized: the values the codes stand for, in x's dtype
# ----------------------------------------------------------------------------------------------------


def scalar_dequantized(x, gs):
    """The scalar quantizer's codes and scales, decoded by table: ``+-E2M1[code] * scale`` (sign bit 8 of the
    code; a NaN scale gives NaN), as Python floats."""
    bits = x.view(torch.int16)
    q_rows, s_rows = nvfp4_scalar.quantize(x.float().tolist(), (bits < 0).tolist(), float(gs))
    out = []
    for q_row, s_row in zip(q_rows, s_rows):
        codes = [c for byte in q_row for c in (byte & 15, byte >> 4)]
        row = []
        for i, c in enumerate(codes):
            sb = s_row[i // 16]
            sd = math.nan if sb & 0x7F == 0x7F else nvfp4_scalar.e4m3_value(sb)
            v = nvfp4_scalar.E2M1[c & 7] * sd
            row.append(-v if c & 8 else v)
        out.append(row)
    return out


def assert_dequantized_matches_scalar(x, gs):
    got = quantize_dequantized_reference(x, torch.tensor(gs, dtype=torch.float32))
    assert got.dtype == x.dtype and got.shape == x.shape
    want = torch.tensor(scalar_dequantized(x, gs), dtype=torch.float64)
    g = got.to(torch.float64)
    same = ((g == want) & (torch.signbit(g) == torch.signbit(want))) | (g.isnan() & want.isnan())
    assert bool(same.all()), [(tuple(i), g[tuple(i)].item(), want[tuple(i)].item()) for i in (~same).nonzero()[:5]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gs", [1.0, 0.37, 1 / 0.0123, 3.0e4, 2.0 ** -20])
def test_dequantized_values_are_the_scalar_quantizers_codes_times_scales(dtype, gs):
    g = torch.Generator().manual_seed(int(gs * 1000) % 7919)
    x = (torch.randn(3, 64, generator=g) * torch.logspace(-3, 2, 64)).to(dtype)
    x[0, 16:32] = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -6])
    x[1, :16] = -0.0
    x[1, 20] = float("nan")
    x[2, 40] = float("-inf")
    assert_dequantized_matches_scalar(x, gs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantized_values_are_exact_in_x_dtype(dtype):
    """The cast of ``dequantize``'s fp32 values to x's dtype loses nothing at the extremes: the largest
    magnitude 6 * 448 (a saturated scale), the least, half the least e4m3 subnormal scale (2^-10), and a
    value of 6 significant bits (1.5 times the scale 1.875)."""
    x = torch.zeros(3, 16)
    x[0, 0] = 1.0e4
    x[1, :2] = torch.tensor([6 * 2.0 ** -9, 0.5 * 2.0 ** -9])
    x[2, :2] = torch.tensor([11.25, 2.8125])
    x = x.to(dtype)
    gs = torch.tensor(1.0)
    got = quantize_dequantized_reference(x, gs).to(torch.float32)
    assert torch.equal(got, dequantize(*quantize_reference(x, gs)))
    assert got[0, 0] == 2688.0 and got[1, 1] == 2.0 ** -10 and got[2, 1] == 2.8125


def test_dequantized_is_the_reference_on_the_cpu_and_keeps_zero_rows():
    x = torch.randn(5, 128, dtype=torch.float16)
    gs = torch.tensor([7.0])
    assert torch.equal(quantize_dequantized(x, gs), quantize_dequantized_reference(x, gs))
    assert quantize_dequantized(torch.empty(0, 32, dtype=torch.bfloat16), torch.tensor(1.0)).shape == (0, 32)
    assert dequantize(torch.empty(0, 16, dtype=torch.uint8), torch.empty(0, 2, dtype=torch.float8_e4m3fn)).shape == (0, 32)


def test_dequantized_fake_opcheck_and_fullgraph():
    with FakeTensorMode():
        y = torch.ops.nvfp4.quantize_dequantized(torch.empty(3, 4096, dtype=torch.float16), torch.empty(()))
        assert y.shape == (3, 4096) and y.dtype == torch.float16
        with pytest.raises(ValueError, match="quantize_dequantized: argument 'x'"):
            torch.ops.nvfp4.quantize_dequantized(torch.empty(3, 40, dtype=torch.float16), torch.empty(()))
    x, gs = torch.randn(4, 64, dtype=torch.bfloat16), torch.tensor(3.0)
    torch.library.opcheck(torch.ops.nvfp4.quantize_dequantized.default, (x, gs))
    torch._dynamo.reset()
    f = torch.compile(lambda x, gs: quantize_dequantized(x * 2, gs) + 1, fullgraph=True, backend="aot_eager")
    assert torch.equal(f(x, gs), quantize_dequantized(x * 2, gs) + 1)


# ----------------------------------------------------------------------------------------------------
# The weight recipe
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("seed", [0, 3])
def test_weight_recipe_matches_the_scalar_recipe(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(6, 64, generator=g) * torch.logspace(-4, 0, 64)).to(dtype)
    w[1, :16] = 0  # an all-zero block
    q, s, ws2 = quantize_weight(w)
    wf = w.float()
    signs = (wf.view(torch.int32) < 0).tolist()
    eq, es, ews2 = nvfp4_scalar.quantize_weight(wf.tolist(), signs)
    assert ws2.dtype == torch.float32 and ws2.dim() == 0 and ws2.item() == ews2
    assert torch.equal(s.view(torch.uint8), torch.tensor(es, dtype=torch.uint8))
    assert torch.equal(q, torch.tensor(eq, dtype=torch.uint8))


def assert_weight_matches_scalar(w):
    q, s, ws2 = quantize_weight(w)
    wf = w.float()
    eq, es, ews2 = nvfp4_scalar.quantize_weight(wf.tolist(), (wf.view(torch.int32) < 0).tolist())
    assert ws2.item() == ews2
    assert torch.equal(s.view(torch.uint8), torch.tensor(es, dtype=torch.uint8))
    assert torch.equal(q, torch.tensor(eq, dtype=torch.uint8))


@pytest.mark.parametrize("amax", [0.0859375, 3.5, 0.01953125])
def test_weight_scales_divide_by_weight_scale_2(amax):
    """Block amaxes b where ``(b / 6) / weight_scale_2`` and ``(b / 6) * (1 / weight_scale_2)`` round to
    different e4m3 scales: the recipe divides."""
    b = torch.arange(0x3000, 0x4000, dtype=torch.int16).view(torch.bfloat16).float() * amax
    b = b[b <= amax]
    ws2, six = torch.tensor(amax) / 2688, torch.tensor(6.0)
    differ = quant._e4m3_bytes((b / six) / ws2) != quant._e4m3_bytes((b / six) * (1 / ws2))
    found = b[differ].tolist()
    assert found
    for v in found[:4]:
        assert_weight_matches_scalar(torch.tensor([[amax] + [0.0] * 15 + [v, -v / 3] + [0.0] * 14]))


@pytest.mark.parametrize("amax", [0.0859375, 3.5])
def test_weight_values_divide_by_the_product_of_the_scales(amax):
    """Values where ``w / (scale * weight_scale_2)`` and ``(w / scale) / weight_scale_2`` give different
    codes (they exist in blocks with subnormal scales): the recipe divides by the product."""
    ws2 = torch.tensor(amax) / 2688
    grid = torch.arange(0x3000, 0x4000, dtype=torch.int16).view(torch.bfloat16).float() * amax
    grid = grid[grid <= amax]
    cases = []
    for b in grid[::7]:
        sd = quant._e4m3_bytes((b / 6) / ws2).view(torch.float8_e4m3fn).float()
        w = grid[grid <= b]
        none = torch.zeros(w.shape, dtype=torch.bool)
        differ = quant._e2m1_codes(w / (sd * ws2), none) != quant._e2m1_codes((w / sd) / ws2, none)
        cases += [(b.item(), v) for v in w[differ].tolist()[:1]]
    assert len(cases) >= 4
    for b, v in cases[:6]:
        assert_weight_matches_scalar(torch.tensor([[amax] + [0.0] * 15 + [b, v, -v] + [0.0] * 13]))


def test_weight_recipe_gives_the_largest_block_scale_448():
    w = torch.randn(4, 64)
    _, s, ws2 = quantize_weight(w)
    assert s.float().max().item() == 448.0
    assert ws2.item() == pytest.approx(w.abs().max().item() / 2688, rel=1e-6)


def test_all_zero_weight_quantizes_to_zeros():
    q, s, ws2 = quantize_weight(torch.zeros(2, 32))
    assert ws2.item() == 0 and not s.float().any() and not q.any()


def test_weight_recipe_reconstructs_within_e2m1_rounding():
    w = torch.randn(16, 128)
    q, s, ws2 = quantize_weight(w)
    back = dequantize(q, s, ws2)
    amax = w.abs().reshape(16, 8, 16).amax(-1, keepdim=True).expand(16, 8, 16).reshape(16, 128)
    assert ((back - w).abs() <= amax / 6 * 1.07 + 1e-12).all()


# ----------------------------------------------------------------------------------------------------
# The op: validation, dispatch, fakes, compile
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [quantize, quantize_reference, quantize_dequantized, quantize_dequantized_reference])
@pytest.mark.parametrize("x, gs, exc, name", [
    (torch.randn(2, 32), torch.tensor(1.0), TypeError, "x"),  # fp32
    (torch.randn(32, dtype=torch.bfloat16), torch.tensor(1.0), ValueError, "x"),  # 1-d
    (torch.randn(2, 24, dtype=torch.bfloat16), torch.tensor(1.0), ValueError, "x"),  # K % 16
    (torch.randn(2, 0, dtype=torch.bfloat16), torch.tensor(1.0), ValueError, "x"),
    ([[1.0] * 16], torch.tensor(1.0), TypeError, "x"),
    (torch.randn(2, 32, dtype=torch.bfloat16), 1.0, TypeError, "global_scale"),
    (torch.randn(2, 32, dtype=torch.bfloat16), torch.tensor(1.0, dtype=torch.float64), TypeError, "global_scale"),
    (torch.randn(2, 32, dtype=torch.bfloat16), torch.ones(2), TypeError, "global_scale"),
    (torch.randn(2, 32, dtype=torch.bfloat16), torch.ones(1, 1), TypeError, "global_scale"),
    (torch.randn(2, 32, dtype=torch.bfloat16), torch.tensor(1.0, device="meta"), ValueError, "global_scale"),
])
def test_bad_arguments_raise_naming_the_argument(fn, x, gs, exc, name):
    with pytest.raises(exc, match=f"argument '{name}'"):
        fn(x, gs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_is_the_reference_on_the_cpu(dtype):
    x = torch.randn(5, 128, dtype=dtype)
    gs = torch.tensor([7.0])
    for a, b in zip(quantize(x, gs), quantize_reference(x, gs)):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_zero_rows_give_empty_results():
    q, s = quantize(torch.empty(0, 32, dtype=torch.bfloat16), torch.tensor(1.0))
    assert q.shape == (0, 16) and s.shape == (0, 2)


def test_dispatch_finds_no_gpu_kernel_until_there_is_one():
    try:
        import nvfp4_gemv.quant_kernel  # noqa: F401
    except ImportError:
        assert quant._cuda_kernel() is None
    else:
        assert callable(quant._cuda_kernel())


def test_fake_gives_shapes_and_dtypes_without_computing():
    with FakeTensorMode():
        x = torch.empty(3, 4096, dtype=torch.float16)
        q, s = torch.ops.nvfp4.quantize(x, torch.empty(()))
        assert q.shape == (3, 2048) and q.dtype == torch.uint8
        assert s.shape == (3, 256) and s.dtype == torch.float8_e4m3fn
        with pytest.raises(ValueError, match="argument 'x'"):
            torch.ops.nvfp4.quantize(torch.empty(3, 40, dtype=torch.float16), torch.empty(()))


def test_opcheck():
    torch.library.opcheck(torch.ops.nvfp4.quantize.default,
                          (torch.randn(4, 64, dtype=torch.bfloat16), torch.tensor(3.0)))


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiles_fullgraph_with_the_same_result(dynamic):
    torch._dynamo.reset()

    def f(x, gs):
        q, s = quantize(x * 2, gs)
        return q, s.view(torch.uint8) + 1

    x = torch.randn(3, 64, dtype=torch.bfloat16)
    gs = torch.tensor(5.0)
    eager = f(x, gs)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=dynamic)(x, gs)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, k", [(1, 16384), (4, 4096), (16, 14336), (33, 64)])
def test_gpu_quantize_matches_the_cpu_reference_bit_for_bit(dtype, rows, k):
    g = torch.Generator().manual_seed(rows + k)
    x = (torch.randn(rows, k, generator=g) * torch.logspace(-4, 3, k)).to(dtype)
    x[0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
    gs = torch.tensor(0.731)
    q, s = quantize(x.cuda(), gs.cuda())
    eq, es = quantize_reference(x, gs)
    assert torch.equal(q.cpu(), eq) and torch.equal(s.cpu().view(torch.uint8), es.view(torch.uint8))

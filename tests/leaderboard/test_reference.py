"""The reference (generator, layouts, exact result) and the scale handling of the L=1 _scaled_mm path,
all on the CPU."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import inputs
import reference
import submission

E2M1 = reference.E2M1_VALUES


def brute_force(data):
    """Loop-by-loop float64 definition of the task, exactly summed (math.fsum), rounded once to fp16."""
    a, b, sfa, sfb, _, _, c = data
    au, bu = a.view(torch.uint8), b.view(torch.uint8)
    m, k2, l = au.shape
    out = torch.empty(m, 1, l, dtype=torch.float16)
    sa, sb = sfa.float().double(), sfb.float().double()
    for li in range(l):
        bv = []
        for j in range(2 * k2):
            byte = int(bu[0, j // 2, li])
            bv.append(E2M1[(byte >> (4 * (j % 2))) & 15] * float(sb[0, j // 16, li]))
        for i in range(m):
            terms = []
            for j in range(2 * k2):
                byte = int(au[i, j // 2, li])
                terms.append(E2M1[(byte >> (4 * (j % 2))) & 15] * float(sa[i, j // 16, li]) * bv[j])
            out[i, 0, li] = math.fsum(terms)
    return out


@pytest.mark.parametrize("m,k,l,seed", [(128, 64, 1, 0), (128, 128, 2, 1), (256, 64, 1, 2), (128, 192, 3, 3)])
def test_portable_reference_equals_brute_force_loop(m, k, l, seed):
    data = inputs.random_inputs(m, k, l, seed, device="cpu", min_exp=0, max_exp=15)
    got = reference.portable_ref_kernel((*data[:6], data[6].clone()))
    want = brute_force(data)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-3, atol=0, equal_nan=True)


def test_brute_force_loop_sees_both_nibbles_and_signs():
    # one nonzero byte: low nibble 0b0011 (+1.5) and high nibble 0b1101 (-3); b = +1 everywhere
    data = inputs.random_inputs(128, 64, 1, 0, device="cpu")
    a = torch.zeros(128, 32, 1, dtype=torch.uint8)
    a[0, 0, 0] = 0xD3
    b = torch.full((128, 32, 1), 0x22, dtype=torch.uint8)  # 1.0, 1.0
    ones = torch.full((128, 4, 1), 1.0).to(torch.float8_e4m3fn)
    data = (a.view(torch.float4_e2m1fn_x2), b.view(torch.float4_e2m1fn_x2), ones, ones, *data[4:])
    assert brute_force(data)[0, 0, 0].item() == -1.5
    assert reference.portable_ref_kernel((*data[:6], data[6].clone()))[0, 0, 0].item() == -1.5


@pytest.mark.parametrize("m,k,l", [(128, 64, 1), (256, 512, 3), (384, 1536, 2), (1152, 4608, 1)])
def test_generate_input_structure_and_permuted_scales(m, k, l):
    a, b, sfa, sfb, sfa_p, sfb_p, c = reference.generate_input(m, k, l, seed=1111)
    assert (a.shape, b.shape, c.shape) == ((m, k // 2, l), (128, k // 2, l), (m, 1, l))
    assert a.dtype == b.dtype == torch.float4_e2m1fn_x2 and c.dtype == torch.float16
    assert a.stride() == (k // 2, 1, m * k // 2) and c.stride() == (1, 1, m)
    assert sfa.shape == (m, k // 16, l) and sfb.shape == (128, k // 16, l)
    assert sfa_p.shape == (32, 4, m // 128, 4, k // 64, l) and sfb_p.shape == (32, 4, 1, 4, k // 64, l)
    assert sfa_p.stride()[:5] == (16, 4, 512 * (k // 64), 1, 512)
    assert len({t.device for t in (a, b, sfa, sfb, sfa_p, sfb_p, c)}) == 1
    # the official generator's value ranges: bytes 0..3 (low nibble only), scales 0..2
    assert int(a.view(torch.uint8).max()) <= 3 and float(sfa.float().max()) <= 2.0
    for plain, perm in ((sfa, sfa_p), (sfb, sfb_p)):
        mn, sfk, _ = plain.shape
        i, j, bi = torch.meshgrid(torch.arange(mn), torch.arange(sfk), torch.arange(l), indexing="ij")
        u, p = plain.view(torch.uint8).cpu(), perm.view(torch.uint8).cpu()
        assert torch.equal(p[i % 32, (i % 128) // 32, i // 128, j % 4, j // 4, bi], u[i, j, bi])


def test_generate_input_is_deterministic_per_seed():
    x, y, z = (reference.generate_input(128, 256, 2, s) for s in (7, 7, 8))
    assert all(torch.equal(p.view(torch.uint8), q.view(torch.uint8)) for p, q in zip(x[:6], y[:6]))
    assert not torch.equal(x[0].view(torch.uint8), z[0].view(torch.uint8))


@pytest.mark.parametrize("m,k,l", [(128, 64, 1), (128, 256, 2), (256, 1536, 3), (512, 7168, 1), (384, 448 * 16, 2)])
def test_permute_reshape_of_permuted_scales_is_to_blocked(m, k, l):
    data = inputs.random_inputs(m, k, l, seed=m + k, device="cpu")
    for plain, perm in ((data[2], data[4]), (data[3], data[5])):
        for li in range(l):
            assert torch.equal(submission.blocked_from_permuted(perm, li).view(torch.uint8),
                               reference.to_blocked(plain[:, :, li]).view(torch.uint8))


def cublas_blocked_index(i, j, cols):
    """Position of scale (row i, column j) in cuBLAS's 1-d blocked layout: 128 x 4 tiles, row-major over
    tiles; inside a tile, row i lands at (i % 32) * 16 + (i % 128) // 32 * 4 and column j at j % 4."""
    return ((i // 128) * (cols // 4) + j // 4) * 512 + (i % 32) * 16 + (i % 128) // 32 * 4 + j % 4


def emulated_scaled_mm(a, b_t, scale_a, scale_b, bias=None, out_dtype=torch.float16):
    """What ``torch._scaled_mm`` computes for fp4 operands with blocked e4m3 scales (one per 16 values)."""
    assert bias is None
    av = reference.decode_fp4(a.unsqueeze(-1))[:, :, 0]
    bv = reference.decode_fp4(b_t.t().unsqueeze(-1))[:, :, 0]
    rows_a, rows_b, cols = av.shape[0], bv.shape[0], av.shape[1] // 16
    ia, ja = torch.meshgrid(torch.arange(rows_a), torch.arange(cols), indexing="ij")
    ib, jb = torch.meshgrid(torch.arange(rows_b), torch.arange(cols), indexing="ij")
    sa = scale_a.float().double()[cublas_blocked_index(ia, ja, cols)].repeat_interleave(16, dim=1)
    sb = scale_b.float().double()[cublas_blocked_index(ib, jb, cols)].repeat_interleave(16, dim=1)
    return ((av * sa) @ (bv * sb).t()).to(out_dtype)


@pytest.mark.parametrize("m,k", [(128, 64), (256, 512), (384, 1536)])
def test_scaled_mm_path_feeds_blocked_scales_it_expects(m, k, monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", emulated_scaled_mm)
    data = inputs.random_inputs(m, k, 1, seed=k, device="cpu")
    got = submission._run_scaled_mm(inputs.poisoned(data))
    ok, msg = reference.check_implementation(data, got)
    assert ok, msg


def test_check_implementation_reports_mismatches():
    data = inputs.random_inputs(128, 128, 1, seed=1, device="cpu")
    good = inputs.expected(data)
    ok, msg = reference.check_implementation(data, good)
    assert ok and "Maximum error" in msg
    bad = good.clone()
    bad[3, 0, 0] += 10
    bad[5, 0, 0] = float("nan")
    ok, msg = reference.check_implementation(data, bad)
    assert not ok and "Number of mismatched elements: 2" in msg and "(3, 0, 0)" in msg


@settings(max_examples=25, deadline=None)
@given(mb=st.integers(1, 3), kb=st.integers(1, 12), l=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_property_layouts_agree(mb, kb, l, seed):
    m, k = 128 * mb, 64 * kb
    data = inputs.random_inputs(m, k, l, seed, device="cpu")
    li = seed % l
    assert torch.equal(submission.blocked_from_permuted(data[4], li).view(torch.uint8),
                       reference.to_blocked(data[2][:, :, li]).view(torch.uint8))


@pytest.mark.parametrize("m,k,l", [(128, 256, 1), (256, 2048, 3), (128, 7168, 2)])
def test_interleaved_layout_holds_the_same_values_with_scales_beside_their_rows(m, k, l):
    data = inputs.random_inputs(m, k, l, seed=m + k + l, device="cpu")
    inter = inputs.interleaved(data)
    a, sfa = inter[0], inter[2]
    row = k // 2 + k // 16
    assert a.stride() == (row, 1, m * row) and sfa.stride() == (row, 1, m * row)
    assert sfa.data_ptr() - a.data_ptr() == k // 2 and a.data_ptr() % 16 == 0
    for t, u in ((a, data[0]), (sfa, data[2])):
        assert torch.equal(t.view(torch.uint8), u.view(torch.uint8))
    assert all(torch.equal(x, y) for x, y in zip(inputs.exact_and_terms(inter), inputs.exact_and_terms(data)))


@settings(max_examples=15, deadline=None)
@given(kb=st.integers(1, 4), l=st.integers(1, 2), seed=st.integers(0, 2**31 - 1))
def test_property_reference_matches_brute_force(kb, l, seed):
    data = inputs.random_inputs(128, 64 * kb, l, seed, device="cpu", min_exp=0, max_exp=12)
    got = reference.portable_ref_kernel((*data[:6], data[6].clone()))
    torch.testing.assert_close(got.float(), brute_force(data).float(), rtol=1e-3, atol=0, equal_nan=True)


def plain_fp32_sum(data):
    """The GEMV with each 16-value block's term exact in fp32 and the terms summed in fp32 in K order."""
    a, b, sfa, sfb, _, _, c = data
    m, k2, l = a.shape
    out = torch.empty(m, 1, l, dtype=torch.float16)
    for li in range(l):
        prod = reference.decode_fp4(a[:, :, li:li + 1])[:, :, 0] * reference.decode_fp4(b[0:1, :, li:li + 1])[0, :, 0]
        blocks = prod.view(m, -1, 16).sum(-1) * (sfa[:, :, li].double() * sfb[0, :, li].double())
        acc = torch.zeros(m, dtype=torch.float32)
        for t in blocks.float().unbind(1):
            acc = acc + t
        out[:, 0, li] = acc.half()
    return out


@pytest.mark.parametrize("k", [2048, 7168])
def test_cancelling_inputs_defeat_a_plain_fp32_sum(k):
    """The GPU tests on ``inputs.cancelling_inputs`` can fail: a plain fp32 sum misses most rows."""
    data = inputs.cancelling_inputs(128, k, 2, seed=k, device="cpu")
    want = inputs.expected(data)
    assert want.abs().max() <= 144 * 448 / 512 and want.abs().max() > 1
    naive = plain_fp32_sum(data)
    bad = ~torch.isclose(naive.double(), want.double(), rtol=1e-3, atol=1e-3)
    assert bad.float().mean() > 0.5
    ok, _ = reference.check_implementation(data, naive)
    assert not ok


def test_tight_check_fails_one_fp16_step_that_the_official_check_passes():
    data = inputs.random_inputs(256, 512, 2, seed=77, device="cpu")
    good = inputs.expected(data)
    assert inputs.check_tight(data, good) == (0, "ok")
    bad = good.clone()
    i = int(good[:, 0, 1].abs().argmax())
    bad[i, 0, 1] = torch.nextafter(good[i, 0, 1].float(), torch.tensor(float("inf"))).half()
    if bad[i, 0, 1] == good[i, 0, 1]:  # float32 nextafter rounds back: step in fp16 bits instead
        bad[i, 0, 1] = (good[i, 0, 1:2].view(torch.int16) + 1).view(torch.float16)[0]
    assert inputs.check_exact(data, bad)[0]  # 1e-3 relative: one step (2^-11 relative) passes
    count, msg = inputs.check_tight(data, bad)
    assert count == 1 and f"[{i}, 1]" in msg

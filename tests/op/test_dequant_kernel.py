"""The weights' dequantizer (``nvfp4_gemv.dequant_kernel``, W4A16's many-token path) gives, bit for bit, the
values NVFP4 weights stand for: ``e2m1(code) * e4m3(scale)`` computed in float64 from the e2m1 table and
rounded once to bf16 / fp16 (exact: at most 6 significant bits in range), and the same bits as the torch
ops it replaced (``op_plan.dequantized``). Every code byte 0..255 appears (both nibbles, negative values,
-0), scales over the whole e4m3 range (subnormals, 448, negative bytes), NaN scales give NaN exactly where
they are; plain rows with strides, the packed layout, K not a multiple of 128. Outputs are poisoned first.
The GEMV's many-token results through it are tested against float64 in ``test_w4a16_kernel.py``,
``test_packed.py`` and here (blocked scales)."""

import pytest
import torch

from nvfp4_gemv import dequant_kernel, op_plan
from nvfp4_gemv.packed import pack_weight
from nvfp4_gemv.reference import _decode, _scales64

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]


def weights(m, k, seed, nan_scales=False):
    """Codes with every byte value, scales over all finite e4m3 bytes of both signs (NaN bytes only when
    asked), on the CPU."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, generator=g)
    n = min(256, w.numel())
    w.view(-1)[:n] = torch.arange(n, dtype=torch.uint8)  # every byte at least once where there are 256
    s = torch.randint(0, 256, (m, k // 16), dtype=torch.uint8, generator=g)
    if not nan_scales:
        s = torch.where((s & 0x7F) == 0x7F, s ^ 1, s)  # 0x7F / 0xFF are e4m3fn's NaNs
    edge = torch.tensor([0x00, 0x01, 0x07, 0x08, 0x7E, 0x80, 0x81, 0xFE], dtype=torch.uint8)  # 0, subnormals, 448
    s.view(-1)[:min(8, s.numel())] = edge[:s.numel()]
    return w, s.view(torch.float8_e4m3fn)


def exact(w, s, dtype):
    """float64 values rounded once to dtype (exact for finite scales)."""
    m, k = w.shape[0], 2 * w.shape[1]
    return (_decode(w) * _scales64(s, m, k, False)).to(dtype)


def poisoned(m, k, dtype):
    return torch.full((m, k), 0x7BCD, dtype=torch.int16, device="cuda").view(dtype)  # a finite poison


def same_bits(got, want):
    g, wv = got.cpu().view(torch.int16), want.cpu().view(torch.int16)
    bad = (g != wv).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} values differ, first at {bad[:4].tolist()}"


@pytest.mark.parametrize("pair", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", [(1, 16), (3, 48), (128, 64), (256, 2048), (130, 4112), (1024, 8192)])
def test_plain_rows_equal_float64_and_the_torch_ops(m, k, dtype, pair):
    """(``pair``: the two-blocks-a-thread build where K % 32 == 0, the one-block build elsewhere.)"""
    w, s = weights(m, k, seed=m + k)
    out = poisoned(m, k, dtype)
    dequant_kernel.dequantize_cuda(w.cuda(), s.cuda(), out, k, pair=pair)
    torch.cuda.synchronize()
    same_bits(out, exact(w, s, dtype))
    same_bits(out, op_plan.dequantized(w, s, k, False, dtype))


@pytest.mark.parametrize("pair", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_of_codes_and_scales(dtype, pair):
    """Codes and scales as column slices of wider tensors: the row strides reach the kernel, and nothing
    beyond the slices is read into the result."""
    m, k = 256, 1024
    wide_w, wide_s = weights(m, k + 256, seed=5)
    w, s = wide_w[:, 64:64 + k // 2], wide_s[:, 8:8 + k // 16]
    out = poisoned(m, k, dtype)
    dequant_kernel.dequantize_cuda(wide_w.cuda()[:, 64:64 + k // 2], wide_s.cuda()[:, 8:8 + k // 16], out, k, pair=pair)
    torch.cuda.synchronize()
    same_bits(out, exact(w.contiguous(), s.contiguous(), dtype))


@pytest.mark.parametrize("pair", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", [(128, 128), (256, 4096), (384, 1152)])
def test_the_packed_layout_equals_the_plain_one(m, k, dtype, pair):
    w, s = weights(m, k, seed=3 * m + k)
    out = poisoned(m, k, dtype)
    dequant_kernel.dequantize_cuda(pack_weight(w.cuda(), s.cuda()), None, out, k, packed=True, pair=pair)
    torch.cuda.synchronize()
    same_bits(out, exact(w, s, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_scales_give_nan_exactly_in_their_blocks(dtype):
    m, k = 128, 256
    w, s = weights(m, k, seed=9, nan_scales=True)
    su = s.view(torch.uint8)
    su[5, 3], su[77, 0], su[127, 15] = 0x7F, 0xFF, 0x7F
    out = poisoned(m, k, dtype)
    dequant_kernel.dequantize_cuda(w.cuda(), s.cuda(), out, k)
    torch.cuda.synchronize()
    nan_blocks = ((su & 0x7F) == 0x7F).repeat_interleave(16, dim=1)
    got = out.cpu()
    assert torch.equal(got.isnan(), nan_blocks)
    same_bits(got[~nan_blocks], exact(w, s, dtype)[~nan_blocks])


def test_pair_is_taken_only_where_k_and_the_addresses_allow_it(monkeypatch):
    """The pair build for K % 32 == 0 and 16-byte code rows; K % 32 == 16 or code rows 8 bytes off take the
    one-block build (the kernel's key says which)."""
    keys = []
    real = dequant_kernel._kernels.get
    monkeypatch.setattr(dequant_kernel._kernels, "get", lambda dev, key: keys.append(key) or real(dev, key))
    for k, off in ((64, 0), (48, 0), (64, 8)):
        w, s = weights(128, k + 32, seed=k)  # code rows (k + 32) / 2 bytes apart: 16-byte multiples at k = 64
        wc, sc = w.cuda(), s.cuda()
        out = poisoned(128, k, torch.bfloat16)
        dequant_kernel.dequantize_cuda(wc[:, off:off + k // 2], sc[:, :k // 16], out, k, pair=True)
        torch.cuda.synchronize()
        same_bits(out, exact(w[:, off:off + k // 2].contiguous(), s[:, :k // 16].contiguous(), torch.bfloat16))
    assert [key[-1] for key in keys] == [True, False, False]


def test_k_that_the_layout_cannot_take_is_refused_by_name():
    with pytest.raises(ValueError, match="K=40 is not a positive multiple of 16"):
        dequant_kernel.Nvfp4Dequantize(40, True)
    with pytest.raises(ValueError, match="K=80 is not a positive multiple of 128"):
        dequant_kernel.Nvfp4Dequantize(80, True, packed=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_many_tokens_with_blocked_scales_equal_plain_scales(dtype):
    """From DEQUANT_MIN_TOKENS on, blocked (swizzled) w_scale is unswizzled and then dequantized: the product
    is bit for bit the plain scales' one (the same dequantized weight into the same torch.mm)."""
    from nvfp4_gemv import gemv
    from nvfp4_gemv.reference import swizzled_scale_shape

    n, m, k = op_plan.DEQUANT_MIN_TOKENS + 7, 256, 1024
    w, s = weights(m, k, seed=21)
    g = torch.Generator().manual_seed(22)
    x = (torch.randn(n, k, generator=g) * 3).to(dtype).cuda()
    r128, c4 = m // 128, k // 64
    blocked = s.view(torch.uint8).reshape(r128, 4, 32, c4, 4).permute(0, 3, 2, 1, 4).contiguous()
    blocked = blocked.reshape(swizzled_scale_shape(m, k)).view(torch.float8_e4m3fn)
    alpha = torch.tensor([0.37], device="cuda")
    plain = gemv(x, None, w.cuda(), s.cuda(), alpha, out_dtype=dtype)
    swz = gemv(x, None, w.cuda(), blocked.cuda(), alpha, out_dtype=dtype)
    torch.cuda.synchronize()
    same_bits(swz, plain)
    want = (x.double().cpu() @ exact(w, s, torch.float64).T) * 0.37
    err = (plain.double().cpu() - want).abs().max() / want.abs().max()
    assert err < 2.0 ** -6  # a coarse sanity check; the bound is tested in test_w4a16_kernel.py

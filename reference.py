"""Reference for the NVFP4 batched GEMV: input generation, the exact result, and the correctness check.

``generate_input`` makes, on CUDA, the very inputs of the official generator (same RNG calls in the same
order); without CUDA it makes the same structure on the CPU. ``ref_kernel`` is the official
``torch._scaled_mm`` computation where that supports fp4 (sm_100 family) and otherwise a portable exact
one: decode e2m1, apply the scales per 16 values, sum in float64, round to fp16.
"""

import torch

from task import input_t, output_t
from utils import make_match_reference

sf_vec_size = 16

# e2m1 code -> value; bit 3 is the sign, so codes 8..15 mirror 0..7
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def ceil_div(a, b):
    return (a + b - 1) // b


def to_blocked(input_matrix):
    """cuBLAS's blocked scale layout of an [rows, cols] scale matrix (rows % 128 == 0, cols % 4 == 0)."""
    rows, cols = input_matrix.shape
    blocks = input_matrix.view(ceil_div(rows, 128), 128, ceil_div(cols, 4), 4).permute(0, 2, 1, 3)
    return blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).flatten()


def decode_fp4(x: torch.Tensor) -> torch.Tensor:
    """[R, K/2, L] float4_e2m1fn_x2 -> [R, K, L] float64; the low nibble is the first value."""
    u = x.view(torch.uint8)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=u.device)
    lo, hi = table[(u & 0xF).long()], table[(u >> 4).long()]
    r, k2, l = u.shape
    return torch.stack((lo, hi), dim=2).reshape(r, 2 * k2, l)


def fp4_scaled_mm_supported(device) -> bool:
    """Whether ``torch._scaled_mm`` takes fp4 operands on ``device`` (the sm_100 family)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 10


def portable_ref_kernel(data: input_t) -> output_t:
    """Exact reference on any device: float64 sums of the decoded, scaled values, rounded to fp16."""
    a, b, sfa, sfb, _, _, c = data
    dev = a.device
    for l_idx in range(c.shape[2]):
        av = decode_fp4(a[:, :, l_idx : l_idx + 1])[:, :, 0]
        bv = decode_fp4(b[0:1, :, l_idx : l_idx + 1])[0, :, 0]
        sa = sfa[:, :, l_idx].to(device=dev, dtype=torch.float64).repeat_interleave(sf_vec_size, dim=1)
        sb = sfb[0, :, l_idx].to(device=dev, dtype=torch.float64).repeat_interleave(sf_vec_size)
        c[:, 0, l_idx] = ((av * sa) @ (bv * sb)).to(torch.float16)
    return c


def scaled_mm_ref_kernel(data: input_t) -> output_t:
    """The official computation: one fp4 ``torch._scaled_mm`` per batch index (needs sm_100)."""
    a, b, sfa, sfb, _, _, c = data
    for l_idx in range(c.shape[2]):
        res = torch._scaled_mm(
            a[:, :, l_idx],
            b[:, :, l_idx].transpose(0, 1),
            to_blocked(sfa[:, :, l_idx]).to(a.device),
            to_blocked(sfb[:, :, l_idx]).to(a.device),
            bias=None,
            out_dtype=torch.float16,
        )
        c[:, 0, l_idx] = res[:, 0]
    return c


def ref_kernel(data: input_t) -> output_t:
    """Writes the result into ``data``'s ``c`` and returns it, as the official reference does."""
    if fp4_scaled_mm_supported(data[0].device):
        return scaled_mm_ref_kernel(data)
    return portable_ref_kernel(data)


def create_scale_factor_tensors(l, mn, sf_k, device):
    """Plain ``[mn, sf_k, l]`` scales and the same values in the ``[32, 4, rest_mn, 4, rest_k, l]`` layout.

    The RNG calls (two ``randint``, in this order) are the official generator's."""
    plain = torch.randint(0, 3, (l, mn, sf_k), dtype=torch.int8, device=device)
    plain = plain.to(dtype=torch.float8_e4m3fn).permute(1, 2, 0)
    shape = (l, ceil_div(mn, 128), ceil_div(sf_k, 4), 32, 4, 4)
    permuted = torch.randint(0, 3, shape, dtype=torch.int8, device=device)
    permuted = permuted.to(dtype=torch.float8_e4m3fn).permute(3, 4, 1, 5, 2, 0)
    i, j, bi = torch.meshgrid(torch.arange(mn, device=device), torch.arange(sf_k, device=device),
                              torch.arange(l, device=device), indexing="ij")
    permuted[i % 32, (i % 128) // 32, i // 128, j % 4, j // 4, bi] = plain[i, j, bi]
    return plain, permuted


def generate_input(m: int, k: int, l: int, seed: int):
    """``(a, b, sfa, sfb, sfa_permuted, sfb_permuted, c)`` for an M x K x L problem; see the module doc.

    a: [m, k/2, l] and b: [128, k/2, l] float4_e2m1fn_x2 (b's row 0 is the vector, the rest pads N to
    128); sfa: [m, k/16, l], sfb: [128, k/16, l] float8_e4m3fn; the permuted scales
    [32, 4, ceil(rows/128), 4, ceil(k/64), l]; c: [m, 1, l] float16, all on one device.
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    a = torch.randint(0, 4, (l, m, k // 2), dtype=torch.uint8, device=device).permute(1, 2, 0)
    b = torch.randint(0, 4, (l, 128, k // 2), dtype=torch.uint8, device=device).permute(1, 2, 0)
    a = a.view(torch.float4_e2m1fn_x2)
    b = b.view(torch.float4_e2m1fn_x2)
    c = torch.randn((l, m, 1), dtype=torch.float16, device=device).permute(1, 2, 0)
    sf_k = ceil_div(k, sf_vec_size)
    sfa, sfa_permuted = create_scale_factor_tensors(l, m, sf_k, device)
    sfb, sfb_permuted = create_scale_factor_tensors(l, 128, sf_k, device)
    return (a, b, sfa, sfb, sfa_permuted, sfb_permuted, c)


_match = make_match_reference(ref_kernel, rtol=1e-03, atol=1e-03)


def check_implementation(data, output):
    """``(ok, message)`` at rtol = atol = 1e-3. The reference writes into a copy of ``c``, so ``output``
    may be ``data``'s own ``c`` (as ``custom_kernel`` returns it) without comparing it with itself."""
    return _match((*data[:6], data[6].clone()), output)

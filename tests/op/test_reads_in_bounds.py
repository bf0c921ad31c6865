"""The W4A16 kernel reads nothing past its tensors: each operand (x, w or the packed w, the scales, alpha, the
output) is copied to the very end of mapped pages of device memory with an unmapped page after it, so that a
read past it faults (the caching allocator would put a tensor inside a larger segment, where such a read goes
unseen; this is how session 66's fault went unseen alone: docs/results.md, "Correctness runs on the GPU"). The
shapes are those of a tiny Llama's prefill and decode (K of 256 and 512: fewer slices than warps) and
Llama-3-8B's. The products run in a child process, since a fault breaks the CUDA context; each case is checked
against float64 there."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (tokens, M, K): the tiny Llama's fused q/k/v, gate/up and down at its prefill (10 tokens) and decode (2), one
# token, a 4-token w_a build, Llama-3-8B's q/k/v and down shapes at 1, 10 and 32 tokens, and 2048 x 2048 at 9 and
# 16 tokens (one slice a warp; at 16 tokens x's load is not volatile, W4A16's x_fixed: x loaded once a CTA)
CASES = [(10, 512, 256), (10, 1024, 256), (10, 256, 512), (2, 512, 256), (2, 256, 512), (1, 512, 256),
         (4, 1024, 256), (1, 6144, 4096), (10, 6144, 4096), (32, 4096, 14336), (9, 2048, 2048), (16, 2048, 2048)]

CHILD = textwrap.dedent("""
    import sys
    import torch
    from cuda.bindings import driver as cu

    from nvfp4_gemv import gemv, gemv_packed, pack_weight
    from w4a16_inputs import w4a16_exact, w4a16_inputs, w4a16_violations

    torch.zeros(1, device="cuda")  # torch's context first: the driver calls below use it
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = torch.cuda.current_device()
    err, gran = cu.cuMemGetAllocationGranularity(prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
    assert err == 0, err
    access = cu.CUmemAccessDesc()
    access.location = prop.location
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    kept = []

    class _Raw:
        def __init__(self, ptr, nbytes):
            self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                             "version": 3}

    def at_page_end(t):
        # a copy of t that ends where its mapped pages end; the reserved page after them is never mapped
        nbytes = t.numel() * t.element_size()
        size = -(-nbytes // gran) * gran
        err, va = cu.cuMemAddressReserve(size + gran, 0, 0, 0)
        assert err == 0, err
        err, h = cu.cuMemCreate(size, prop, 0)
        assert err == 0, err
        assert cu.cuMemMap(va, size, 0, h, 0)[0] == 0
        assert cu.cuMemSetAccess(va, size, [access], 1)[0] == 0
        kept.append((va, size, h))
        raw = torch.as_tensor(_Raw(int(va) + size - nbytes, nbytes), device="cuda")
        out = raw.view(t.dtype).view(t.shape)
        out.copy_(t.contiguous())
        return out

    for n, m, k in CASES:
        x, _, w, ws, a = w4a16_inputs(n, m, k, seed=n + m + k)
        exact = w4a16_exact(x, w, ws, a)
        for how in ("plain", "packed"):
            print(f"{how} N={n} {m}x{k}", end=": ", flush=True)
            out = at_page_end(torch.full((n, m), float("nan"), dtype=torch.bfloat16, device="cuda"))
            if how == "plain":
                gemv(at_page_end(x), None, at_page_end(w), at_page_end(ws), at_page_end(a), out=out)
            else:
                gemv_packed(at_page_end(x), at_page_end(pack_weight(w, ws)), at_page_end(a), out=out)
            torch.cuda.synchronize()
            bad, msg = w4a16_violations(out, *exact)
            print("ok" if bad == 0 else "MISMATCH " + msg, flush=True)
            if bad:
                sys.exit(1)
    torch.cuda.synchronize()
    print("all in bounds", flush=True)
""")


def test_w4a16_reads_nothing_past_x_w_or_its_scales():
    pytest.importorskip("cuda.bindings")
    code = f"CASES = {CASES!r}\n" + CHILD
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0 and "all in bounds" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]

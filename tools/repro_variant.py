"""Session 66's fault with the model swapped: runs the three leaderboard tests of ``tools/repro_fault.sh``'s order
in this process (``--alone``: none, the control), then the kept-step test's calls of ``generate`` on the tiny
Llama of tests/model/test_generate.py as VARIANT (bf16, w4a16, w4a16-fused, w4a16-fused-packed) with the
attention implementation ATTN (sdpa, the default, or eager). If bf16 faults too, no kernel of ours is needed
for it; if eager attention does not, SDPA is the suspect. Prints "variant ... ok" or the error. Needs a GPU.

Usage: python tools/repro_variant.py VARIANT [ATTN] [--alone]
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORDER = ["tests/leaderboard/test_dynamic_tiles.py::test_every_tile_is_done_once_and_the_counters_end_at_zero[128-7168-200]",
         "tests/leaderboard/test_split_kernel.py::test_split_kernel_matches_float64[384-7168-2-tuning2-permuted-scales]",
         "tests/leaderboard/test_split_kernel.py::test_split_kernel_matches_float64[1024-2048-3-tuning9-permuted-scales]"]


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    name = argv[0]
    attn = argv[1] if len(argv) > 1 and not argv[1].startswith("--") else "sdpa"
    os.chdir(ROOT)
    import pytest
    import torch

    if "--alone" not in argv:
        rc = pytest.main(["-q", "-p", "no:cacheprovider", *ORDER])
        print("leaderboard tests: rc", int(rc), flush=True)
    sys.path[:0] = [os.path.join(ROOT, "tests", "model"), os.path.join(ROOT, "tests"), ROOT]
    from test_generate import hf, prompt, variant

    from nvfp4_gemv.model.generation import generate, release

    m = variant(name, "cuda")
    m.set_attn_implementation(attn)
    ids = prompt(2, 5, "cuda")
    a = generate(m, ids, 12)
    b = generate(m, ids, 12)
    ok = torch.equal(a, b) and torch.equal(a, hf(m, ids, 12))
    other = prompt(2, 8, "cuda", seed=4)
    c = generate(m, other, 20, max_cache_len=32)
    d = generate(m, ids, 12, max_cache_len=32)
    ok = ok and torch.equal(c, generate(m, other, 20, max_cache_len=32, cuda_graph=False))
    ok = ok and torch.equal(d, generate(m, ids, 12, max_cache_len=32, cuda_graph=False))
    release(m)
    torch.cuda.synchronize()
    print(f"variant {name} attn {attn}: {'ok' if ok else 'TOKENS DIFFER'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

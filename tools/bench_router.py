"""A MoE router's decode on the GPU: ``topk_route`` (one kernel; past 256 experts also its counters' fill) against
transformers' ``Qwen3MoeTopKRouter`` (the router's GEMV, softmax, ``torch.topk``'s kernels, the renormalisation)
on the same weight, eager ops captured in a CUDA graph and the same router under ``torch.compile`` (inductor,
no CUDA graphs of its own) captured likewise, at Qwen3-30B-A3B's shape (128 experts, hidden 2048, top 8) by
default. Each is one graph of ``--layers`` routers with different weights (as a model's step has), replayed;
us a router, median of the replays (L2 flushed before each). Reported beside the times, not asserted (the GPU
tests assert): for the first router, how many tokens' logits equal transformers' and whether the index sets
of those tokens are equal.

    python tools/bench_router.py --tokens 1,4,16,64 --out docs/bench-router-h100
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch  # noqa: E402

from bench import time_graph  # noqa: E402
from nvfp4_gemv import TopKRouter  # noqa: E402


def main(argv=None):
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,4,16,64")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--out", default=None)
    p.add_argument("--counter", action="store_true", help="the counter build at every E (router_kernel.CLUSTER_MAX_E "
                   "= 0 before any build): the cluster build's A/B, run as a process of its own")
    a = p.parse_args(argv)
    if a.counter:
        from nvfp4_gemv import router_kernel

        router_kernel.CLUSTER_MAX_E = 0
    cfg = transformers.Qwen3MoeConfig(hidden_size=a.hidden, num_experts=a.experts, num_experts_per_tok=a.top_k,
                                      norm_topk_prob=True)
    torch.manual_seed(0)
    hfs = []
    for _ in range(a.layers):
        r = Qwen3MoeTopKRouter(cfg)
        torch.nn.init.normal_(r.weight, std=0.02)
        hfs.append(r.to(torch.bfloat16).cuda().requires_grad_(False))
    ours = [TopKRouter.from_router(r) for r in hfs]
    compiled = [torch.compile(r, fullgraph=True) for r in hfs]
    rows = []
    with torch.no_grad():
        for t in (int(v) for v in a.tokens.split(",")):
            x = torch.randn(t, a.hidden, device="cuda").to(torch.bfloat16)
            want, got = hfs[0](x), ours[0](x)
            same = (want[0] == got[0]).all(-1)
            ok = bool(torch.equal(want[2][same].sort(-1).values, got[2][same].sort(-1).values))
            row = {"tokens": t, "checked_rows": int(same.sum()), "indices_equal": ok}
            for name, mods in (("transformers", hfs), ("transformers_compiled", compiled), ("ours", ours)):
                row[f"{name}_us"] = time_graph(lambda: [m(x) for m in mods], a.reps) / a.layers
            row["speedup"] = row["transformers_us"] / row["ours_us"]
            rows.append(row)
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if a.out:
        with open(a.out + ".json", "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(a),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""Dynamo's guards on a compiled decode step, and the host time they and dynamo's call cost (issue 55's
first target: a compiled step with our layers within 10% of bf16's guards and host time).

Builds a transformers ``LlamaForCausalLM`` of small dims (hidden 256, intermediate 512, 4 heads, 2 KV
heads; the layer count is what scales the guards), random weights, one variant per run: bf16 or ours
(``quantize_model`` with the variant's mode, fuse and pack). For its one-token forward with a static cache:

* ``guards``: ``torch._dynamo.explain``'s guard count (each is evaluated on every compiled call);
* ``per_layer``: the guards whose source lies in layer 1, by module (``--per-layer``);
* ``dynamo_us``: the median host time of a compiled call whose backend returns stored outputs (no kernel,
  no graph replay: dynamo's guards, argument gathering and side effects alone), over ``--calls`` calls.

CPU or GPU (on the CPU the kernels' exact reference runs once, while the backend records its outputs).

    python tools/guard_count.py --layers 32 --variants bf16,w4a16,w4a16-fused,w4a16-fused-packed,w4a4-fused
    python tools/guard_count.py --arch qwen3-moe --layers 48 --variants bf16,w4a16-fused --per-layer
"""

import argparse
import collections
import json
import os
import re
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = {  # name: quantize_model's arguments (None: bf16)
    "bf16": None,
    "w4a16": dict(mode="w4a16"),
    "w4a16-fused": dict(mode="w4a16", fuse=True),
    "w4a16-fused-packed": dict(mode="w4a16", fuse=True, pack=True),
    "w4a4": dict(mode="w4a4"),
    "w4a4-fused": dict(mode="w4a4", fuse=True),
}


def build(variant, layers, device, arch="llama"):
    import torch

    from nvfp4_gemv import calibrate_input_scales, quantize_model

    if arch == "qwen3-moe":  # Qwen3-MoE's structure at small dims: 8 experts, top 2 (issue 58's model)
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM as Model

        cfg = Qwen3MoeConfig(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=8,
                             num_experts_per_tok=2, num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=256,
                             norm_topk_prob=True, pad_token_id=0)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM as Model

        cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
    torch.manual_seed(0)
    model = Model(cfg).to(torch.bfloat16).to(device).eval()
    kw = VARIANTS[variant]
    if kw is not None:
        kw = dict(kw)
        if kw["mode"] == "w4a4":
            sample = torch.randint(1, 512, (1, 8), device=device)
            kw["input_scales"] = calibrate_input_scales(model, lambda m: m(sample))
        quantize_model(model, **kw)
    return cfg, model


def step_fn(cfg, model, device):
    import torch
    from transformers import StaticCache

    cache = StaticCache(config=cfg, max_cache_len=64)
    ids = torch.tensor([[5]], device=device)
    pos = torch.tensor([3], device=device)

    def step(ids, pos):
        return model(input_ids=ids, past_key_values=cache, cache_position=pos, use_cache=True).logits

    return step, (ids, pos)


def layer_of(name):
    """The module path inside layer 1 a guard's source names (``self_attn.q_proj``), or None."""
    m = re.search(r"\['layers'\]\._modules\['1'\](.*)", name)
    if m is None:
        return None
    parts = re.findall(r"\._modules\['(\w+)'\]", m.group(1))
    return ".".join(parts[:2]) or "(layer)"


def reduce_overhead_host(step, args, calls, top):
    """Under ``torch.compile(mode="reduce-overhead")`` (CUDA-graph trees), the host time of one step from a
    synced start until it returns (the GPU idle meanwhile: what a loop with a sync each token exposes), the
    median over ``calls``, and cProfile's ``top`` functions by own time over 5 more calls. (With transformers
    5.17's static cache the trees skip their graphs, "mutated inputs": the step then launches each kernel
    from inductor's code, as ``tools/bench_model.py --hf``'s step does.)"""
    import cProfile
    import io
    import pstats

    import torch

    torch._dynamo.reset()
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    times = []
    prof = cProfile.Profile()
    with torch.no_grad():
        for _ in range(3):  # warm-up, recording, first replays
            compiled(*args)
        for _ in range(calls):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            compiled(*args)
            times.append(time.perf_counter() - t0)
        for _ in range(5):  # profiled apart: cProfile's own cost would swell the timed calls
            torch.cuda.synchronize()
            prof.enable()
            compiled(*args)
            prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    torch._dynamo.reset()
    return {"host_us": round(1e6 * statistics.median(times), 1), "host_profile": text.getvalue()}


def measure(variant, layers, calls, device, per_layer, host=0, arch="llama"):
    import torch

    cfg, model = build(variant, layers, device, arch)
    step, args = step_fn(cfg, model, device)
    with torch.no_grad():
        ex = torch._dynamo.explain(step)(*args)
    out = dict(variant=variant, layers=layers, guards=len(ex.out_guards), graphs=ex.graph_count,
               graph_breaks=ex.graph_break_count)
    if per_layer:
        c = collections.Counter(layer_of(str(g.name)) for g in ex.out_guards)
        c.pop(None, None)
        out["per_layer"] = dict(sorted(c.items()))
        out["layer_guards"] = sum(c.values())
    torch._dynamo.reset()

    seen = {}

    def stored(gm, example_inputs):  # runs the graph once; every later call returns those outputs
        tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
        # inputs that are not static (parameters, buffers, module tensor attributes): the CUDA-graph trees
        # check and copy these on every replay
        seen["inputs"] = len(tensors)
        seen["dynamic_inputs"] = [tuple(t.shape) for t in tensors if not hasattr(t, "_dynamo_static_input_type")]
        outs = gm(*example_inputs)
        # tensors the graph returns (the CUDA-graph trees rebuild each on every replay)
        seen["outputs"] = sum(isinstance(o, torch.Tensor) for o in (outs if isinstance(outs, (list, tuple)) else [outs]))
        return lambda *a: outs

    compiled = torch.compile(step, backend=stored, fullgraph=True)
    with torch.no_grad():
        compiled(*args)
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            compiled(*args)
            times.append(time.perf_counter() - t0)
    out["dynamo_us"] = round(1e6 * statistics.median(times), 1)
    if host and device != "cpu":
        out.update(reduce_overhead_host(step, args, calls, host))
    out["graph_inputs"] = seen["inputs"]
    out["graph_outputs"] = seen["outputs"]
    out["dynamic_inputs"] = len(seen["dynamic_inputs"])
    out["dynamic_input_shapes"] = collections.Counter(map(str, seen["dynamic_inputs"])).most_common(6)
    torch._dynamo.reset()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--arch", choices=("llama", "qwen3-moe"), default="llama",
                    help="the model's structure (small dims either way)")
    ap.add_argument("--variants", default="bf16,w4a16,w4a16-fused,w4a16-fused-packed")
    ap.add_argument("--calls", type=int, default=50, help="compiled calls timed (median)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--per-layer", action="store_true", help="also count layer 1's guards by module")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--host", type=int, default=0, metavar="TOP",
                    help="on CUDA also the host time of a step under mode='reduce-overhead' (the GPU idle "
                    "meanwhile) and cProfile's TOP functions by own time")
    args = ap.parse_args()
    names = args.variants.split(",")
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        ap.error(f"--variants: unknown {bad}; choose from {sorted(VARIANTS)}")
    warnings.filterwarnings("ignore")
    rows = []
    for name in names:
        rows.append(measure(name, args.layers, args.calls, args.device, args.per_layer, args.host, args.arch))
        prof = rows[-1].pop("host_profile", None)
        print(json.dumps(rows[-1]), flush=True)
        if prof:
            print(prof, flush=True)
    base = next((r for r in rows if r["variant"] == "bf16"), None)
    print(f"\n| variant | guards ({args.layers} layers) | over bf16 | dynamo's part of a call (us) | host of a "
          "reduce-overhead step (us) |")
    print("|---|---|---|---|---|")
    for r in rows:
        over = f"{100 * (r['guards'] / base['guards'] - 1):+.1f}%" if base else "-"
        print(f"| {r['variant']} | {r['guards']:,} | {over} | {r['dynamo_us']} | {r.get('host_us', '-')} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""What torch.compile's CUDA-graph trees do during ``model.generate`` (issue 55's open question).

Builds Llama-3-8B's config with ``--layers`` layers (random weights), optionally runs bf16 generations first
(as ``bench_model.py --hf`` does, one process), quantizes to ours (W4A16, fused + packed) and times
``model.generate`` (static cache, greedy) twice. For each call it counts what the graph trees did:
recordings, eager warm-ups, replays, calls left to the compiled code without a graph (a skip), allocator
checkpoints, and the seconds each took; and whether the static cache's tensors kept their addresses.

    python tools/graph_probe.py --layers 8 --tokens 64 [--before-bf16] [--launch tvm-ffi|dsl]

``--launch`` sets ``NVFP4_GEMV_LAUNCH`` before anything compiles (``dsl``: as without apache-tvm-ffi).
GPU only; prints one JSON line a call.
"""

import argparse
import collections
import functools
import json
import os
import sys
import time


GRAPH_TREE_METHODS = ("run", "record_function", "run_eager", "execute_node",
                      "apply_checkpoint_execution_state_in_allocator", "try_end_curr_execution")
_STATS = None


def install_counters():
    """Wraps the CUDA-graph tree manager's methods (once a process) to count their calls and seconds in the
    Counter returned (``record_function``: recordings, ``run_eager``: warm-ups, ``execute_node``: replays; ``run``
    minus those three: calls left to the compiled code without a graph). Clear it before what you count."""
    global _STATS
    if _STATS is not None:
        return _STATS
    from torch._inductor import cudagraph_trees as ct

    stats = collections.Counter()

    def counted(name, fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                stats[name] += 1
                stats[name + "_s"] += time.perf_counter() - t0
        return wrapper

    M = ct.CUDAGraphTreeManager
    for name in GRAPH_TREE_METHODS:
        if hasattr(M, name):
            setattr(M, name, counted(name, getattr(M, name)))
    _STATS = stats
    return stats


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--before-bf16", action="store_true", help="two bf16 generations before quantizing")
    p.add_argument("--bf16-only", action="store_true", help="time bf16's generations only")
    p.add_argument("--launch", choices=("tvm-ffi", "dsl"), default=None)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--decoder", action="store_true",
                   help="before ours' generations, bench_model's compiled Decoder: warm-up, 8 steps, dynamo reset")
    p.add_argument("--ours-between", action="store_true",
                   help="nvfp4_gemv.generate(compile=True) between ours' model.generate calls")
    args = p.parse_args()
    if args.launch:
        os.environ["NVFP4_GEMV_LAUNCH"] = args.launch

    import torch
    from torch._dynamo.utils import counters

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_model import llama_config
    from transformers import LlamaForCausalLM

    from nvfp4_gemv import calibrate_input_scales, quantize_model

    stats = install_counters()

    cfg = llama_config(False)
    cfg.num_hidden_layers = args.layers
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    prompt = torch.randint(1, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1)).cuda()

    def cache_ptrs():
        c = getattr(model, "_cache", None)
        layers = getattr(c, "layers", None) or []
        return [int(t.data_ptr()) for t in (getattr(layers[0], "keys", None), getattr(layers[0], "values", None),
                                              getattr(layers[0], "cumulative_length", None)) if t is not None] if layers else []

    def calls(label, n, between=None):
        for i in range(n):
            stats.clear()
            skips0 = counters["inductor"]["cudagraph_skips"]
            captured0 = counters["stats"]["calls_captured"]
            before = cache_ptrs()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(prompt, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                                     cache_implementation="static", pad_token_id=0)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3
            after = cache_ptrs()
            row = {"variant": label, "call": i, "ms_a_token": round(ms / args.tokens, 3),
                   "cache_ptrs_kept": before == after if before else None,
                   "cudagraph_skips": counters["inductor"]["cudagraph_skips"] - skips0,
                   "compiled_in_call": counters["stats"]["calls_captured"] - captured0,
                   "launch": os.environ.get("NVFP4_GEMV_LAUNCH", "default"),
                   "tokens_sum": int(out.sum())}
            row.update({k: (round(v, 4) if isinstance(v, float) else v) for k, v in sorted(stats.items())})
            print(json.dumps(row), flush=True)
            if between is not None:
                between()

    if args.before_bf16 or args.bf16_only:
        calls("bf16", 2 if not args.bf16_only else args.calls)
    if args.bf16_only:
        return
    scales = calibrate_input_scales(model, lambda m: m(input_ids=prompt))
    quantize_model(model, mode="w4a16", input_scales=scales, fuse=True, pack=True)
    if args.decoder:
        from bench_model import Decoder

        dec = Decoder(model, 1, 16, 16 + 4 * args.tokens + 8, "compile", torch.device("cuda"))
        t0 = time.perf_counter()
        dec.warm_up()
        for _ in range(8):
            dec.step()
        torch.cuda.synchronize()
        print(json.dumps({"decoder_s": round(time.perf_counter() - t0, 2), "fullgraph": dec.fullgraph}), flush=True)
        del dec
        torch._dynamo.reset()
    between = None
    if args.ours_between:
        from nvfp4_gemv import generate

        def between():
            t0 = time.perf_counter()
            with torch.no_grad():
                generate(model, prompt, args.tokens, eos_token_id=[], compile=True)
            torch.cuda.synchronize()
            print(json.dumps({"ours_generate_compiled_s": round(time.perf_counter() - t0, 3)}), flush=True)
    calls("w4a16 fused packed", args.calls, between)
    print("counters:", json.dumps({k: dict(v) for k, v in counters.items() if k in ("inductor", "stats")}), flush=True)


if __name__ == "__main__":
    main()

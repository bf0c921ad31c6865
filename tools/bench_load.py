"""What ``load_modelopt`` costs over reading a checkpoint's bytes (issue target: the bytes plus a few seconds,
no Python loop per value).

A transformers ``LlamaForCausalLM`` of a given config (default: Llama-3.2-1B's shapes; random weights) is
quantized (``quantize_model``, a decoder layer at a time on ``--device``, so that no bf16 copy of the whole
model is ever made) and written (``save_modelopt``) once into a folder; then, each ``--reps``
times with the files in the page cache (a first read warms it, untimed):

* ``read``: every tensor of the export read by safetensors onto the device (``safe_open`` /
  ``get_tensor``; on the CPU, where that maps the file, a clone of each): the floor of a loader that
  materializes every tensor (``load_modelopt`` on the CPU keeps the quantized tensors as safetensors maps
  them, so it can come in under it);
* ``load``: ``load_modelopt`` into a model built from the export's config.json (the build is timed apart:
  it is the user's, not the loader's), with ``--mode``, ``--fuse``, ``--pack``.

Prints both and their difference; ``--json PATH`` writes them. ``--generate N`` then decodes N tokens with
the last loaded model (``nvfp4_gemv.generate``, greedy, a CUDA graph on a GPU) and reports ms a token, the
peak device memory of load and decode together, and whether every logit of the first step is finite.

    python tools/bench_load.py                         # CPU, Llama-3.2-1B shapes
    python tools/bench_load.py --device cuda --layers 32 --hidden 4096 --intermediate 14336 --heads 32 \\
        --kv-heads 8 --vocab 128256                    # Llama-3-8B shapes on a GPU machine
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch  # noqa: E402


def config(args):
    import transformers

    return transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                                    num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                    num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                                    tie_word_embeddings=args.tie, max_position_embeddings=256)


def _random_(module, gens):
    """transformers' Llama init, roughly: normal(0, 0.02) matrices, ones for the norms' vectors. The values
    are drawn on each parameter's device (one seeded generator a device type): the CPU draws Llama-3-70B's
    69e9 values in minutes, a GPU in a second."""
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                gen = gens.setdefault(p.device.type, torch.Generator(device=p.device).manual_seed(0))
                p.copy_(torch.randn(p.shape, generator=gen, device=p.device).mul_(0.02).to(p.dtype))


def export(args, device, path):
    """The quantized random model written with ``save_modelopt``, one decoder layer at a time: the model is
    built on the meta device, each layer made in bf16 on ``device``, quantized there and moved to the CPU, so
    no whole bf16 model exists anywhere (Llama-3-70B's is 141 GB; its NVFP4 export about 43 GB)."""
    import transformers

    from nvfp4_gemv import quantize_model, save_modelopt
    from nvfp4_gemv.model.linear import kernel_takes

    cfg = config(args)
    gens = {}
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    for layer in model.model.layers:
        layer.to_empty(device=device)
        _random_(layer, gens)
        if args.mode == "w4a4":  # one input scale for every linear the kernels take
            scales = {n: 0.01 for n, m in layer.named_modules()
                      if isinstance(m, torch.nn.Linear) and kernel_takes(m.in_features, m.out_features, "w4a4")}
            quantize_model(layer, mode="w4a4", input_scales=scales)
        else:
            quantize_model(layer)
        layer.to("cpu")
    rest = [model.model.embed_tokens, model.model.norm] + ([] if args.tie else [model.lm_head])
    for m in rest:  # drawn on the device too (Llama-3-70B's embedding and lm_head are 2.1e9 values)
        m.to_empty(device=device)
        _random_(m, gens)
        m.to("cpu")
    if args.tie:
        model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)  # its buffers were built on meta
    save_modelopt(model, path)


def read_all(path, device):
    """Every tensor of the export onto ``device`` through safetensors, as a loader reads them."""
    from safetensors import safe_open

    n = 0
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), framework="pt", device=str(device)) as h:
                for k in h.keys():
                    t = h.get_tensor(k)  # on the CPU a view of the mapped file: cloned, so its pages are read
                    n += (t.clone() if device.type == "cpu" else t).numel()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return n


def decode(model, n, device, base):
    """``nvfp4_gemv.generate`` of ``n`` greedy tokens after an 8-token prompt: a first call (its capture), then
    a timed second; the peak device memory over both, from ``base``; and whether the prompt's logits are
    all finite (random weights: the tokens themselves mean nothing)."""
    import nvfp4_gemv

    ids = torch.arange(1, 9, device=device).unsqueeze(0)
    with torch.no_grad():
        finite = bool(torch.isfinite(model(ids).logits).all())
        t0 = time.perf_counter()
        out = nvfp4_gemv.generate(model, ids, n, eos_token_id=[])  # n tokens whatever random weights emit
        if device.type == "cuda":
            torch.cuda.synchronize()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = nvfp4_gemv.generate(model, ids, n, eos_token_id=[])
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    assert out.shape == (1, 8 + n) and torch.equal(out, again), "greedy decode differs between two calls"
    return {"decode_tokens": n, "decode_ms_per_token": dt / n * 1e3, "first_call_s": first,
            "logits_finite": finite, "peak_decode_bytes":
                torch.cuda.max_memory_allocated() - base if device.type == "cuda" else None}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--tie", action="store_true", help="tied embeddings (Llama-3.2-1B ties them)")
    p.add_argument("--mode", default="w4a16", choices=("w4a16", "w4a4"))
    p.add_argument("--fuse", action="store_true")
    p.add_argument("--pack", action="store_true")
    p.add_argument("--loader", default="load_modelopt", choices=("load_modelopt", "from_pretrained"),
                   help="from_pretrained: the model built on meta, each tensor read once onto the device")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=None, help="export folder (default: a temporary one, removed at the end)")
    p.add_argument("--json", default=None)
    p.add_argument("--generate", type=int, default=0, metavar="N",
                   help="then decode N tokens with the last loaded model (nvfp4_gemv.generate, greedy)")
    args = p.parse_args(argv)
    if args.generate < 0:
        p.error(f"--generate: expected a number of tokens >= 0, got {args.generate}")
    from nvfp4_gemv import load_modelopt

    device = torch.device(args.device)
    path = args.dir or tempfile.mkdtemp(prefix="nvfp4_load_")
    try:
        t0 = time.perf_counter()
        export(args, device, path)
        t_export = time.perf_counter() - t0
        nbytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
        read_all(path, device)  # warms the page cache (untimed)
        reads, builds, loads, peaks = [], [], [], []
        for rep in range(args.reps):
            t0 = time.perf_counter()
            read_all(path, device)
            reads.append(time.perf_counter() - t0)
            import transformers

            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            if args.loader == "from_pretrained":
                from nvfp4_gemv import from_pretrained

                builds.append(0.0)
                t0 = time.perf_counter()
                fresh = from_pretrained(path, mode=args.mode, device=device, fuse=args.fuse, pack=args.pack)
            else:
                with torch.device(device):
                    fresh = transformers.AutoModelForCausalLM.from_config(
                        transformers.AutoConfig.from_pretrained(path)).to(torch.bfloat16)
                builds.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                load_modelopt(fresh, path, mode=args.mode, fuse=args.fuse, pack=args.pack)
            if device.type == "cuda":
                torch.cuda.synchronize()
            loads.append(time.perf_counter() - t0)
            if device.type == "cuda":
                peaks.append(torch.cuda.max_memory_allocated() - base)
            if rep < args.reps - 1:
                del fresh
        r = {"device": str(device), "bytes": nbytes, "export_s": t_export, "read_s": statistics.median(reads),
             "build_s": statistics.median(builds), "load_s": statistics.median(loads), "reads": reads,
             "loads": loads, "args": vars(args), "torch": torch.__version__,
             "peak_device_bytes": max(peaks) if peaks else None}
        r["over_read_s"] = r["load_s"] - r["read_s"]
        if args.generate:
            r.update(decode(fresh, args.generate, device, base if device.type == "cuda" else 0))
        del fresh
        print(f"{nbytes / 1e9:.2f} GB of safetensors on {device}: read {r['read_s']:.2f} s "
              f"({nbytes / r['read_s'] / 1e9:.2f} GB/s), load_modelopt {r['load_s']:.2f} s "
              f"(+{r['over_read_s']:.2f} s over the read; {args.loader}, mode {args.mode}, fuse {args.fuse}, "
              f"pack {args.pack}); peak device memory "
              + (f"{r['peak_device_bytes'] / 1e9:.2f} GB ({r['peak_device_bytes'] / nbytes:.3f}x the bytes); "
                 if peaks else "n/a; ") +
              f"the model's build {r['build_s']:.2f} s apart; medians of {args.reps}", flush=True)
        if args.generate:
            print(f"generate: {args.generate} tokens at {r['decode_ms_per_token']:.2f} ms a token (the first call, "
                  f"its capture included: {r['first_call_s']:.2f} s); first step's logits finite: "
                  f"{r['logits_finite']}; peak device memory of load and decode "
                  + (f"{r['peak_decode_bytes'] / 1e9:.2f} GB ({r['peak_decode_bytes'] / nbytes:.3f}x the bytes)"
                     if device.type == "cuda" else "n/a"), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(r, f, indent=1)
        return r
    finally:
        if args.dir is None:
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()

"""A model's decode step with NVFP4Linear against bf16, on the GPU.

(a) ``--step`` (the default): 8 layers shaped like Llama-3-8B's linears (qkv 6144x4096, o 4096x4096,
    gate_up 28672x4096, down 4096x14336) with RMSNorm before qkv and gate_up, SiLU(gate) * up between
    gate_up and down, and the residual adds; **attention is left out** (o_proj takes the first 4096 columns
    of qkv's output). Random weights; N tokens a step. Variants: bf16 dense ``nn.Linear``, ours W4A16 and
    W4A4 (``quantize_model``; W4A4's input scales calibrated on one step), and torchao's NVFP4 path where it
    runs; each eager, replayed from a CUDA graph, and under ``torch.compile(mode="reduce-overhead")``.
    Reported: us a step (median of CUDA-event timings of back-to-back steps) and the FP4 bytes floor (the
    NVFP4 weights' bytes / the read bandwidth: ``--floor-tbps``, 4.3 TB/s stated for H200 unless given) as a
    percentage of the step's time.
(b) ``--hf``: a transformers ``LlamaForCausalLM`` with Llama-3-8B's config (random weights, built on the GPU
    in bf16, 32 layers), greedy decode with a static cache, the decode step under
    ``torch.compile(mode="reduce-overhead")`` (or a hand-captured CUDA graph: ``--hf-capture graph``),
    batch 1, 4, 16: bf16 against ours (W4A16, W4A4 via ``quantize_model``): ms a token, tokens/s, the
    weights' memory. ``--arch qwen3-moe``: Qwen3-30B-A3B's config instead (48 layers, 128 experts, top 8;
    61 GB in bf16), its routed experts as ``NVFP4Experts`` (their input scales calibrated too); the int4
    peer keeps the experts in bf16.

A markdown table goes to stdout, everything to ``--json PATH``. ``--quick`` keeps one GPU call short
(N / batch 1 and 16, fewer repetitions, fewer decode tokens). ``--device cpu --tiny`` runs the same code
on small shapes on the CPU (eager only: the smoke test of this script).

    python tools/bench_model.py --step --json docs/bench-model-step-h200.json
    python tools/bench_model.py --hf --batches 1 --json docs/bench-model-hf-b1-h200.json
    python tools/bench_model.py --hf --arch qwen3-moe --batches 1,4,16 --hf-fuse --hf-no-step
"""

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch  # noqa: E402

from nvfp4_gemv import (NVFP4Experts, NVFP4Linear, TopKRouter, calibrate_expert_input_scales, calibrate_input_scales,  # noqa: E402
                        quantize_model)

LLAMA3_8B = dict(hidden=4096, qkv=6144, intermediate=14336)
TINY = dict(hidden=256, qkv=384, intermediate=512)
VARIANTS = ("bf16", "w4a16", "w4a4", "torchao")
MODES = ("eager", "graph", "compile")
GENERATES = ("generate_ms", "ours_generate_ms", "ours_generate_compiled_ms", "ours_generate_all_compiled_ms")


# ----------------------------------------------------------------------------------------------------
# (a) the step
# ----------------------------------------------------------------------------------------------------


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps=1e-5, device=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim, dtype=torch.bfloat16, device=device))
        self.eps = eps

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class Layer(torch.nn.Module):
    """One decoder layer's linears, norms and activation; attention left out (o_proj reads q's columns)."""

    def __init__(self, hidden, qkv, intermediate, device):
        super().__init__()
        lin = dict(bias=False, dtype=torch.bfloat16, device=device)
        self.input_layernorm = RMSNorm(hidden, device=device)
        self.qkv_proj = torch.nn.Linear(hidden, qkv, **lin)
        self.o_proj = torch.nn.Linear(hidden, hidden, **lin)
        self.post_attention_layernorm = RMSNorm(hidden, device=device)
        self.gate_up_proj = torch.nn.Linear(hidden, 2 * intermediate, **lin)
        self.down_proj = torch.nn.Linear(intermediate, hidden, **lin)
        self.hidden = hidden

    def forward(self, x):
        qkv = self.qkv_proj(self.input_layernorm(x))
        x = x + self.o_proj(qkv[..., : self.hidden])  # attention left out
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(torch.nn.functional.silu(gate) * up)


class Step(torch.nn.Module):
    def __init__(self, layers, hidden, qkv, intermediate, device):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(hidden, qkv, intermediate, device) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def build_step(layers, dims, device, seed=0):
    torch.manual_seed(seed)
    step = Step(layers, dims["hidden"], dims["qkv"], dims["intermediate"], device).eval()
    with torch.no_grad():
        for m in step.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.normal_(0, 0.02)
    return step


def fp4_bytes(model_or_shapes):
    """Bytes of NVFP4 weights (e2m1 values + e4m3 scales) of every linear: the bytes floor's numerator."""
    total = 0
    for m in model_or_shapes.modules():
        if isinstance(m, (torch.nn.Linear, NVFP4Linear)):
            total += m.out_features * m.in_features // 2 + m.out_features * m.in_features // 16
    return total


def weight_bytes(model):
    """Bytes of a model's persistent tensors (parameters and buffers), each storage once."""
    seen, total = set(), 0
    for t in model.state_dict().values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) if t.numel() else None
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def make_variant(step, variant, sample):
    """A copy of the bf16 step as ``variant``; None (and the reason) where it does not run."""
    import copy

    model = copy.deepcopy(step)
    if variant == "bf16":
        return model, None
    if variant == "w4a16":
        return quantize_model(model, mode="w4a16", skip=()), None
    if variant == "w4a4":
        scales = calibrate_input_scales(model, lambda m: m(sample), skip=())
        return quantize_model(model, mode="w4a4", skip=(), input_scales=scales), None
    try:  # torchao's NVFP4 path (its config names moved between versions)
        from torchao.prototype import mx_formats
        from torchao.quantization import quantize_
        for name in ("NVFP4DynamicActivationNVFP4WeightConfig", "NVFP4InferenceConfig"):
            cfg = getattr(mx_formats, name, None)
            if cfg is not None:
                quantize_(model, cfg())
                with torch.no_grad():
                    model(sample)
                if sample.is_cuda:
                    torch.cuda.synchronize()
                return model, None
        return None, "torchao has no NVFP4 config"
    except Exception as e:  # noqa: BLE001 - reported in the table
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def time_us(fn, reps, device):
    """Median us of one call of ``fn``: CUDA events around each of ``reps`` back-to-back calls (after 3
    warm-up calls); on the CPU, perf_counter."""
    for _ in range(3):
        fn()
    if device.type != "cuda":
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(ts)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in events:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in events)


def runner(model, x, mode):
    """A zero-argument callable running ``model(x)`` in ``mode``; None where the mode needs CUDA."""
    if mode == "eager":
        return lambda: model(x)
    if x.device.type != "cuda":
        return None
    if mode == "graph":
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                model(x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            model(x)
        return g.replay
    torch._dynamo.reset()  # each variant and N its own compile (no recompile limit reached across them)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    return lambda: compiled(x)


def bench_step(args, device):
    dims = TINY if args.tiny else LLAMA3_8B
    step = build_step(args.layers, dims, device)
    floor_bytes = fp4_bytes(step)
    floor_us = floor_bytes / (args.floor_tbps * 1e12) * 1e6
    rows = []
    for variant in args.variants:
        sample = torch.randn(1, dims["hidden"], dtype=torch.bfloat16, device=device)
        model, why = make_variant(step, variant, sample)
        for n in args.n:
            x = torch.randn(n, dims["hidden"], dtype=torch.bfloat16, device=device)
            row = {"variant": variant, "n": n}
            for mode in args.modes:
                if model is None:
                    row[mode] = None
                    row[f"{mode}_note"] = why if mode == args.modes[0] else "as above"
                    continue
                try:
                    with torch.no_grad():
                        fn = runner(model, x, mode)
                        row[mode] = None if fn is None else time_us(fn, args.reps, device)
                    if fn is None:
                        row[f"{mode}_note"] = "needs CUDA"
                except Exception as e:  # noqa: BLE001 - reported in the table
                    row[mode] = None
                    row[f"{mode}_note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            best = min((row[m] for m in args.modes if row.get(m)), default=None)
            row["floor_pct"] = None if best is None else 100 * floor_us / best
            rows.append(row)
            print(f"step {variant:7s} N={n:2d}: " + ", ".join(
                f"{m} {row[m]:.1f} us" if row.get(m) else f"{m} -" for m in args.modes), flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = {r["n"]: r for r in rows if r["variant"] == "bf16"}
    for r in rows:
        b = base.get(r["n"])
        for m in args.modes:
            r[f"{m}_vs_bf16"] = (b[m] / r[m]) if b and b.get(m) and r.get(m) else None
    meta = {"layers": args.layers, "dims": dims, "fp4_bytes": floor_bytes, "floor_tbps": args.floor_tbps,
            "floor_us": floor_us, "attention": "left out (o_proj takes qkv's first hidden columns)"}
    return {"meta": meta, "rows": rows}


def step_table(result, modes):
    m = result["meta"]
    shape = "Llama-3-8B-shaped" if m["dims"] == LLAMA3_8B else "tiny"
    lines = [f"{shape} step ({m['layers']} layers, hidden {m['dims']['hidden']}, attention left out); "
             f"FP4 bytes {m['fp4_bytes'] / 1e6:.2f} MB, floor {m['floor_us']:.1f} us at {m['floor_tbps']} TB/s",
             "", "| variant | N | " + " | ".join(f"{x} us" for x in modes) + " | best vs floor | "
             + " | ".join(f"{x} vs bf16" for x in modes) + " |",
             "|---|---|" + "---|" * (2 * len(modes) + 1)]
    for r in result["rows"]:
        cells = [f"{r[x]:.1f}" if r.get(x) else ("-" if not r.get(f"{x}_note") else f"n/a ({r[f'{x}_note']})")
                 for x in modes]
        vs = [f"{r[f'{x}_vs_bf16']:.2f}x" if r.get(f"{x}_vs_bf16") else "-" for x in modes]
        pct = f"{r['floor_pct']:.0f}%" if r.get("floor_pct") else "-"
        lines.append(f"| {r['variant']} | {r['n']} | " + " | ".join(cells) + f" | {pct} | " + " | ".join(vs) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# (b) transformers LlamaForCausalLM, Llama-3-8B's config
# ----------------------------------------------------------------------------------------------------


def llama_config(tiny):
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, rope_theta=500000.0,
                           bos_token_id=None, eos_token_id=None, pad_token_id=0)
    # Llama-3-8B's config.json (meta-llama/Meta-Llama-3-8B): facts, typed here
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                       pad_token_id=0)


def qwen3_moe_config(tiny):
    from transformers import Qwen3MoeConfig

    if tiny:
        return Qwen3MoeConfig(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=8,
                              num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=64, vocab_size=512, max_position_embeddings=256, bos_token_id=None,
                              eos_token_id=None, pad_token_id=0)
    # Qwen3-30B-A3B's config.json (Qwen/Qwen3-30B-A3B): facts, typed here (every layer sparse)
    return Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                          rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, decoder_sparse_step=1,
                          mlp_only_layers=[], bos_token_id=None, eos_token_id=None, pad_token_id=0)


ARCHS = {"llama3-8b": ("LlamaForCausalLM", llama_config), "qwen3-moe": ("Qwen3MoeForCausalLM", qwen3_moe_config)}


def build_llama(tiny, device, arch="llama3-8b"):
    """The ``--hf`` model: Llama-3-8B's config, or Qwen3-30B-A3B's (``arch="qwen3-moe"``), random weights built
    in bf16 on ``device``."""
    import transformers

    cls, config = ARCHS[arch]
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = getattr(transformers, cls)(config(tiny))
    finally:
        torch.set_default_dtype(prev)
    return model.to(torch.bfloat16).eval()


class Decoder:
    """Greedy decode of a batch with a static cache: prefill eagerly, then the decode step (eager, a
    CUDA graph, or ``torch.compile(mode="reduce-overhead")`` of the model's forward)."""

    def __init__(self, model, batch, prompt_len, max_len, capture, device):
        from transformers import StaticCache

        import inspect

        self.model, self.device, self.capture = model, device, capture
        # transformers 5.24 renamed forward's past_key_values to cache (the old name deprecated)
        self.cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.cache = StaticCache(config=model.config, max_cache_len=max_len, max_batch_size=batch,
                                 device=device, dtype=torch.bfloat16)
        g = torch.Generator().manual_seed(batch)
        prompt = torch.randint(1, model.config.vocab_size, (batch, prompt_len), generator=g).to(device)
        with torch.no_grad():
            out = model(input_ids=prompt, use_cache=True, cache_position=torch.arange(prompt_len, device=device),
                        **{self.cache_kw: self.cache})
        self.tok = out.logits[:, -1:].argmax(-1)
        self.pos = torch.tensor([prompt_len], device=device)
        self.forward = model.forward
        self.fullgraph = None
        if capture == "compile" and device.type == "cuda":
            self.fullgraph = True
            self.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        self.graph = None

    def warm_up(self, steps=3):
        """The first steps (compile, CUDA graph recording); a compile that fails with fullgraph=True is
        tried again with graph breaks allowed (``self.fullgraph`` then False)."""
        try:
            for _ in range(steps):
                self.step()
        except Exception:  # noqa: BLE001
            if not self.fullgraph:
                raise
            torch._dynamo.reset()
            self.fullgraph = False
            self.forward = torch.compile(self.model.forward, mode="reduce-overhead", fullgraph=False)
            for _ in range(steps):
                self.step()

    def _step(self):
        out = self.forward(input_ids=self.tok, use_cache=True, cache_position=self.pos, **{self.cache_kw: self.cache})
        return out.logits[:, -1:].argmax(-1)

    def step(self):
        """One decode token (the next input token and position kept on the device)."""
        with torch.no_grad():
            if self.capture == "graph" and self.device.type == "cuda":
                if self.graph is None:
                    s = torch.cuda.Stream()
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        self._warm = self._step()
                    torch.cuda.current_stream().wait_stream(s)
                    self.graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(self.graph):
                        nxt = self._step()
                        self.tok.copy_(nxt)
                        self.pos.add_(1)
                self.graph.replay()
                return self.tok
            nxt = self._step()
            self.tok = nxt.clone()
            self.pos = self.pos + 1
            return self.tok


class Int4Linear(torch.nn.Module):
    """The peer: torch's int4 weight-only kernel (``torch.ops.aten._weight_int4pack_mm``, "tinygemm", the
    kernel gpt-fast and torchao's int4 weight-only config run), asymmetric, one scale and zero per 128
    values: value = q * scale + min, stored as tinygemm takes it ((q - 8) * scale + zero)."""

    def __init__(self, linear, group=128, inner_k_tiles=8):
        super().__init__()
        w = linear.weight.detach().float()
        n, k = w.shape
        g = w.reshape(n, k // group, group)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = (hi - lo).clamp(min=1e-6) / 15
        q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
        self.register_buffer("w", torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8),
                                                                           inner_k_tiles))
        self.register_buffer("sz", torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous().to(torch.bfloat16))
        self.group, self.in_features, self.out_features = group, k, n
        self.bias = linear.bias

    def forward(self, x):
        y = torch.ops.aten._weight_int4pack_mm(x.reshape(-1, self.in_features), self.w, self.group, self.sz)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def swap_int4(model):
    """Replaces every nn.Linear but lm_head by ``Int4Linear``; returns what it replaced (to put back) and the
    relative error of one layer's product against its bf16 weight (a check of the peer's packing)."""
    done, err = [], None
    for name, m in list(model.named_modules()):
        if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head"):
            new = Int4Linear(m)
            if err is None:
                x = torch.randn(4, m.in_features, dtype=torch.bfloat16, device=m.weight.device)
                ref = (x.float() @ m.weight.float().T)
                err = float((new(x).float() - ref).norm() / ref.norm())
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, new)
            done.append((parent, child, m))
    return done, err


def unswap(model, done):
    for parent, child, m in done:
        setattr(model.get_submodule(parent), child, m)


def wall_ms(fn, device, reps=1):
    """Wall-clock ms of ``reps`` calls of ``fn`` (synced before and after)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def decode_timings(dec, tokens, device):
    """The step three ways: CUDA events around ``tokens`` steps (the host may run ahead), a loop with a
    sync after each step (what a user's loop that reads each token sees), and the host time of one step
    (from a synced start until the step returns, the GPU idle meanwhile: the host work exposed before
    the GPU has anything to run), median of ``tokens``."""
    out = {}
    if device.type == "cuda":
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(tokens):
            dec.step()
        z.record()
        torch.cuda.synchronize()
        out["events_ms"] = a.elapsed_time(z) / tokens
    t0 = time.perf_counter()
    for _ in range(tokens):
        dec.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    out["sync_ms"] = (time.perf_counter() - t0) * 1e3 / tokens
    host = []
    for _ in range(tokens):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dec.step()
        host.append((time.perf_counter() - t0) * 1e3)
    out["host_ms"] = statistics.median(host)
    return out


def call_profile(fn, calls, device, top=30):
    """cProfile of ``calls`` synced calls of ``fn``: the top functions by own time (text)."""
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def host_profile(dec, steps, device, top=30):
    """cProfile of ``steps`` synced decode steps: the top functions by own time (text)."""
    return call_profile(dec.step, steps, device, top)


def generate_timings(model, batch, prompt_len, tokens, device, which, prefill_profile=0):
    """ms a token of whole generations of ``tokens`` new tokens after a ``prompt_len`` prompt (prefill
    included, as a user times it), after one warm-up call: ``model.generate`` (static cache, greedy;
    transformers compiles the forward itself) and ``nvfp4_gemv.generate`` (the step in one CUDA graph,
    eager or compiled). For ``nvfp4_gemv.generate`` also ``..._prefill_ms``: a call of one new token with the
    same cache length (it replays nothing: the eager prefill, the token's selection, the kept step's checks,
    the call's syncs), the part of a call that its replays do not cover; ``prefill_profile``: cProfile's top
    functions by own time over that many such calls (``..._prefill_profile``)."""
    from nvfp4_gemv import generate

    g = torch.Generator().manual_seed(batch)
    prompt = torch.randint(1, model.config.vocab_size, (batch, prompt_len), generator=g).to(device)
    runs = {"generate_ms": lambda: model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                                  cache_implementation="static", pad_token_id=0),
            "ours_generate_ms": lambda: generate(model, prompt, tokens, eos_token_id=[]),
            "ours_generate_compiled_ms": lambda: generate(model, prompt, tokens, eos_token_id=[], compile=True),
            # the prefill compiled too (its rounding is not model.generate's eager prefill's: tokens may differ)
            "ours_generate_all_compiled_ms": lambda: generate(model, prompt, tokens, eos_token_id=[], compile=True,
                                                             compile_prefill=True)}
    out, toks = {}, {}
    graphs = None
    if device.type == "cuda":
        here = os.path.dirname(os.path.abspath(__file__))
        if here not in sys.path:
            sys.path.insert(0, here)
        from graph_probe import install_counters

        graphs = install_counters()
    for key, fn in runs.items():
        if key not in which:
            continue
        try:
            with torch.no_grad():
                first = []
                # the first call compiles and captures (its seconds reported beside); the timed one reuses
                out[key.replace("_ms", "_first_s")] = wall_ms(lambda: first.append(fn()), device) / 1e3
                toks[key] = first[0]
                if "all_compiled" in key:  # the capturing call prefills eagerly: the next compiles the prefill
                    out[key.replace("_ms", "_second_s")] = wall_ms(fn, device) / 1e3
                if graphs is not None:
                    graphs.clear()
                out[key] = wall_ms(fn, device) / tokens
                if graphs is not None:  # what torch.compile's graph trees did in the timed call
                    out[key.replace("_ms", "_graph_trees")] = {
                        k: graphs[k] for k in ("record_function", "run_eager", "execute_node", "run")}
                if key != "generate_ms":  # the same cache length: the kept step stays kept
                    one = lambda: generate(model, prompt, 1, eos_token_id=[], compile="compiled" in key,  # noqa: E731
                                           compile_prefill="all_compiled" in key, max_cache_len=prompt_len + tokens)
                    one()
                    out[key.replace("_ms", "_prefill_ms")] = statistics.median(wall_ms(one, device) for _ in range(3))
                    if prefill_profile:
                        out[key.replace("_ms", "_prefill_profile")] = call_profile(one, prefill_profile, device)
        except Exception as e:  # noqa: BLE001 - reported in the table
            out[key + "_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    if "generate_ms" in toks:
        for key in ("ours_generate_ms", "ours_generate_compiled_ms", "ours_generate_all_compiled_ms"):
            if key in toks:
                out[key.replace("_ms", "_same_tokens")] = bool(torch.equal(toks[key], toks["generate_ms"]))
    return out


def bench_hf(args, device):
    model = build_llama(args.tiny, device, args.arch)
    prompt_len = 16
    tokens = args.tokens
    max_len = prompt_len + 4 * tokens + 8
    rows = []
    if args.hf_pack and "w4a4" in args.hf_variants:
        raise SystemExit("--hf-pack: the packed layout runs mode w4a16 only (--hf-variants bf16,w4a16)")
    order = {"bf16": 0, "int4": 1, "w4a16": 2, "w4a4": 2}
    if [order[v] for v in args.hf_variants] != sorted(order[v] for v in args.hf_variants):
        raise SystemExit("--hf-variants: bf16 and int4 come first (the others quantize the model in place)")
    for variant in args.hf_variants:
        swapped, peer_err = [], None
        if variant == "int4":
            swapped, peer_err = swap_int4(model) if device.type == "cuda" else ([], None)
        elif variant != "bf16" and not any(isinstance(m, NVFP4Linear) for m in model.modules()):
            sample = torch.randint(1, model.config.vocab_size, (1, prompt_len), device=device)
            skip = () if args.hf_lm_head else ("lm_head",)  # lm_head bf16 unless --hf-lm-head
            scales = calibrate_input_scales(model, lambda m: m(input_ids=sample), skip=skip)
            scales.update(calibrate_expert_input_scales(model, lambda m: m(input_ids=sample)))  # MoE experts
            quantize_model(model, mode="w4a16", skip=skip, input_scales=scales, fuse=args.hf_fuse,
                           pack=args.hf_pack)
            if args.hf_routers:
                from nvfp4_gemv import fuse_routers

                fuse_routers(model)
        if variant in ("w4a16", "w4a4"):  # one quantized model, both modes (its layers keep the input scales)
            for m in model.modules():
                if isinstance(m, (NVFP4Linear, NVFP4Experts)):
                    m.mode = variant
        mem = weight_bytes(model)
        for b in args.batches:
            row = {"variant": variant, "batch": b, "weight_GB": mem / 1e9, "capture": args.hf_capture,
                   "fused": bool(args.hf_fuse) and variant in ("w4a16", "w4a4"),
                   "packed": bool(args.hf_pack) and variant in ("w4a16", "w4a4"),
                   "lm_head": bool(args.hf_lm_head) and variant in ("w4a16", "w4a4"),
                   "routers": variant in ("w4a16", "w4a4") and any(isinstance(m, TopKRouter) for m in model.modules())}
            if peer_err is not None:
                row["peer_rel_err"] = peer_err
            try:
                if variant == "int4" and device.type != "cuda":
                    raise RuntimeError("needs CUDA")
                if not args.hf_no_step:
                    dec = Decoder(model, b, prompt_len, max_len, args.hf_capture, device)
                    t0 = time.perf_counter()
                    dec.warm_up()
                    row["fullgraph"] = dec.fullgraph
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    row["warmup_s"] = time.perf_counter() - t0
                    row.update(decode_timings(dec, tokens, device))
                    row["ms_per_token"] = row.get("events_ms", row["sync_ms"])
                    row["tokens_per_s"] = 1e3 * b / row["ms_per_token"]
                    if args.hf_profile:
                        row["profile"] = profile_steps(dec, args.hf_profile, device)
                    if args.hf_host_profile:
                        row["host_profile"] = host_profile(dec, args.hf_host_profile, device)
                    del dec
                    if device.type == "cuda":
                        torch._dynamo.reset()
                row.update(generate_timings(model, b, prompt_len, tokens, device, args.hf_generate,
                                            args.hf_prefill_profile))
            except Exception as e:  # noqa: BLE001 - reported in the table
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            rows.append(row)
            if "profile" in row:
                print(profile_text(row), flush=True)
            if "host_profile" in row:
                print(f"host profile of {variant}{label(row)} batch {b}:\n" + row["host_profile"], flush=True)
            for k in [k for k in row if k.endswith("_prefill_profile")]:
                print(f"{k} of {variant}{label(row)} batch {b}:\n" + row[k], flush=True)
            print(f"hf {variant:6s}{label(row)} batch {b:2d}: " + ", ".join(
                f"{k} {row[k]:.3f}" if isinstance(row[k], float) else f"{k} {row[k]}"
                for k in ("events_ms", "sync_ms", "host_ms", "generate_ms", "ours_generate_ms",
                          "ours_generate_compiled_ms", "generate_first_s", "ours_generate_first_s",
                          "ours_generate_compiled_first_s", "error", "generate_ms_error", "ours_generate_ms_error",
                          "ours_generate_compiled_ms_error", "peer_rel_err", "generate_graph_trees",
                          "ours_generate_prefill_ms", "ours_generate_compiled_prefill_ms", "ours_generate_all_compiled_ms",
                          "ours_generate_all_compiled_first_s", "ours_generate_all_compiled_prefill_ms",
                          "ours_generate_all_compiled_ms_error") if k in row), flush=True)
            if device.type == "cuda":
                torch._dynamo.reset()
                torch.cuda.empty_cache()
        unswap(model, swapped)
    base = {r["batch"]: r for r in rows if r["variant"] == "bf16"}
    for r in rows:
        b = base.get(r["batch"])
        r["vs_bf16"] = b["ms_per_token"] / r["ms_per_token"] if b and "ms_per_token" in b and "ms_per_token" in r else None
        gen = [r[k] for k in ("ours_generate_compiled_ms", "ours_generate_ms", "generate_ms") if k in r]
        if "ms_per_token" not in r and gen:  # (--hf-no-step) the table's token figure from a generation
            r["ms_per_token"], r["tokens_per_s"] = min(gen), 1e3 * r["batch"] / min(gen)
        if b and "generate_ms" in b:
            for k in ("generate_ms", "ours_generate_ms", "ours_generate_compiled_ms", "ours_generate_all_compiled_ms"):
                if k in r:
                    r[k.replace("_ms", "_vs_bf16_generate")] = b["generate_ms"] / r[k]
    cfg = model.config
    meta = {"arch": args.arch, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size,
            "prompt_len": prompt_len, "decode_tokens": tokens, "capture": args.hf_capture, "fuse": bool(args.hf_fuse),
            "pack": bool(args.hf_pack), "lm_head": bool(args.hf_lm_head),
            "note": "random weights; greedy; static cache; embeddings bf16, lm_head too unless lm_head; generate "
                    "timings include the prefill of the prompt (the first call captures nvfp4_gemv.generate's "
                    "step, the timed one replays it); *_prefill_ms: a one-token call with the same cache length"}
    return {"meta": meta, "rows": rows}


def profile_steps(dec, steps, device, top=25):
    """Where a decode token's time goes: ``torch.profiler`` over ``steps`` more steps (CUDA kernels on a
    GPU, CPU ops otherwise), each kernel's time and count a step, the largest ``top``."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            dec.step()
        if cuda:
            torch.cuda.synchronize()
    agg = {}
    for e in prof.events():
        if cuda and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t = e.device_time_total if cuda else e.self_cpu_time_total
        n, us = agg.get(e.name, (0, 0.0))
        agg[e.name] = (n + 1, us + t)
    rows = sorted(agg.items(), key=lambda kv: -kv[1][1])
    return {"steps": steps, "kernels_a_step": sum(n for n, _ in agg.values()) / steps,
            "us_a_step": sum(us for _, us in agg.values()) / steps,
            "top": [{"name": k, "us_a_step": us / steps, "calls_a_step": n / steps} for k, (n, us) in rows[:top]]}


def profile_text(row):
    p = row["profile"]
    lines = [f"profile of {row['variant']}{label(row)} batch {row['batch']}: "
             f"{p['kernels_a_step']:.0f} kernels, {p['us_a_step']:.0f} us a step"]
    lines += [f"  {t['us_a_step']:9.1f} us {t['calls_a_step']:6.1f}x  {t['name'][:110]}" for t in p["top"]]
    return "\n".join(lines)


def label(row):
    return (" fused" if row.get("fused") else "") + (" packed" if row.get("packed") else "") + (
        " +lm_head" if row.get("lm_head") else "")


def hf_table(result):
    m = result["meta"]
    arch = m.get("arch", "llama3-8b")
    cls = ARCHS[arch][0]
    full = {"llama3-8b": "Llama-3-8B's config", "qwen3-moe": "Qwen3-30B-A3B's config (int4: experts stay bf16)"}[arch]
    name = full if m["hidden"] in (4096, 2048) and m["layers"] >= 32 else "a tiny config"
    lines = [f"{cls}, {name} ({m['layers']} layers, random weights), static cache, decode "
             f"of {m['decode_tokens']} tokens after a {m['prompt_len']}-token prompt; ms a token "
             f"(x: bf16's model.generate over this)", "",
             "| variant | batch | model.generate | nvfp4_gemv.generate | same, compiled step | same, prefill compiled too "
             "| loop, sync each token | events (host runs ahead) | host of a step | weights GB |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def cell(r, k, vs=None):
        if k not in r:
            return "n/a" if k + "_error" not in r else f"n/a ({r[k + '_error'][:40]})"
        return f"{r[k]:.2f}" + (f" ({r[vs]:.2f}x)" if vs and r.get(vs) else "")

    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['variant']}{label(r)} | {r['batch']} | n/a ({r['error'][:60]}) | | | | | | | {r['weight_GB']:.3g} |")
            continue
        lines.append(f"| {r['variant']}{label(r)} | {r['batch']} | {cell(r, 'generate_ms', 'generate_vs_bf16_generate')} | "
                     f"{cell(r, 'ours_generate_ms', 'ours_generate_vs_bf16_generate')} | "
                     f"{cell(r, 'ours_generate_compiled_ms', 'ours_generate_compiled_vs_bf16_generate')} | "
                     f"{cell(r, 'ours_generate_all_compiled_ms', 'ours_generate_all_compiled_vs_bf16_generate')} | "
                     f"{cell(r, 'sync_ms')} | {cell(r, 'events_ms')} | {cell(r, 'host_ms')} | {r['weight_GB']:.3g} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------


def ints(text):
    return [int(v) for v in text.split(",") if v]


def names(allowed):
    def parse(text):
        out = [v for v in text.split(",") if v]
        bad = [v for v in out if v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {allowed}")
        return out
    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step", action="store_true", help="(a) the 8-layer-shaped step (the default without --hf)")
    p.add_argument("--hf", action="store_true", help="(b) transformers LlamaForCausalLM decode")
    p.add_argument("--arch", choices=tuple(ARCHS), default="llama3-8b",
                   help="--hf model: Llama-3-8B's config, or Qwen3-30B-A3B's (MoE: experts as NVFP4Experts; the "
                        "int4 peer keeps them bf16)")
    p.add_argument("--quick", action="store_true", help="N / batch 1 and 16, 20 reps, 16 decode tokens")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small shapes (for --device cpu smoke tests)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--n", type=ints, default=None, help="tokens a step (default 1,4,16)")
    p.add_argument("--variants", type=names(VARIANTS), default=list(VARIANTS))
    p.add_argument("--modes", type=names(MODES), default=list(MODES))
    p.add_argument("--reps", type=int, default=None, help="timed steps (default 100, --quick 20)")
    p.add_argument("--floor-tbps", type=float, default=4.3, help="read bandwidth for the FP4 bytes floor (TB/s)")
    p.add_argument("--batches", type=ints, default=None, help="--hf batch sizes (default 1,4,16)")
    p.add_argument("--hf-variants", type=names(("bf16", "int4", "w4a16", "w4a4")),
                   default=["bf16", "int4", "w4a16", "w4a4"],
                   help="int4: torch's _weight_int4pack_mm, group 128 (the peer; CUDA only)")
    p.add_argument("--hf-generate", type=names(GENERATES), default=list(GENERATES[:3]),
                   help="--hf: whole generations timed (model.generate, nvfp4_gemv.generate eager step / compiled step; "
                   "ours_generate_all_compiled_ms: the prefill compiled too, not by default: one more compile a row)")
    p.add_argument("--hf-no-step", action="store_true",
                   help="--hf: whole generations only (no compiled step of our own: one compile fewer a row)")
    p.add_argument("--hf-host-profile", type=int, default=0, metavar="STEPS",
                   help="--hf: cProfile STEPS synced decode steps and print the top functions by own time")
    p.add_argument("--hf-prefill-profile", type=int, default=0, metavar="CALLS",
                   help="--hf: cProfile CALLS one-token calls of nvfp4_gemv.generate (its eager prefill) and print "
                   "the top functions by own time")
    p.add_argument("--hf-capture", choices=("compile", "graph"), default="compile")
    p.add_argument("--hf-profile", type=int, default=0, metavar="STEPS",
                   help="--hf: after timing, profile STEPS more decode steps (torch.profiler) and print the top kernels")
    p.add_argument("--hf-fuse", action="store_true",
                   help="--hf: quantize_model(fuse=True): one GEMV for q/k/v and one for gate/up a layer")
    p.add_argument("--hf-pack", action="store_true",
                   help="--hf: quantize_model(pack=True): weights in the W4A16 kernel's packed layout (w4a16 only)")
    p.add_argument("--hf-routers", action="store_true",
                   help="--hf: our variants also run MoE routers in one launch (nvfp4_gemv.fuse_routers; --hf-fuse does too)")
    p.add_argument("--hf-lm-head", action="store_true",
                   help="--hf: our variants quantize lm_head too (quantize_model(skip=()); bf16 by default)")
    p.add_argument("--tokens", type=int, default=None, help="--hf decode tokens timed (default 64, --quick 16)")
    p.add_argument("--w4a4-via-w4a16", type=int, default=None, metavar="N",
                   help="mode w4a4 from N tokens through quantize_dequantized and the W4A16 op "
                   "(nvfp4_gemv.model.linear.W4A4_VIA_W4A16_FROM; default: as the package sets it)")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    if not a.step and not a.hf:
        a.step = True
    a.n = a.n or ([1, 16] if a.quick else [1, 4, 16])
    a.batches = a.batches or ([1, 16] if a.quick else [1, 4, 16])
    a.reps = a.reps or (20 if a.quick else 100)
    a.tokens = a.tokens or (16 if a.quick else 64)
    return a


def _commit():
    """The tree's commit and how many tracked paths differ from it (the device machine's copy may hold both)."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        dirty = subprocess.run(["git", "status", "--short", "--untracked-files=no"], capture_output=True, text=True, timeout=10,
                               cwd=os.path.dirname(os.path.abspath(__file__))).stdout.count("\n")
        return f"{head} (+{dirty} paths differ)" if head else None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv=None):
    args = parse_args(argv)
    if args.w4a4_via_w4a16 is not None:
        import nvfp4_gemv.model.linear

        nvfp4_gemv.model.linear.W4A4_VIA_W4A16_FROM = args.w4a4_via_w4a16
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device (use --device cpu --tiny for a smoke test)")
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "commit": _commit(), "args": {k: v for k, v in vars(args).items()}}
    tables = []
    if args.step:
        result["step"] = bench_step(args, device)
        tables.append(step_table(result["step"], args.modes))
    if args.hf:
        import transformers
        result["transformers"] = transformers.__version__
        result["hf"] = bench_hf(args, device)
        tables.append(hf_table(result["hf"]))
    print("\n" + "\n\n".join(tables))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return result


if __name__ == "__main__":
    main()

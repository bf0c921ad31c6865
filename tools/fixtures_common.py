"""Shared by tools/fixtures_modelopt.py and tools/fixtures_llmcompressor.py (run by tools/make_fixtures.py,
each in its producer's own venv): the tiny model, the calibration and prompt tokens, and the reference
outputs computed from an EXPORTED checkpoint's tensors. Needs only torch, transformers and safetensors
(every producer venv has them); nothing here imports nvfp4_gemv.

The references (``reference.safetensors`` beside each checkpoint):

* dequantized weights, from the checkpoint's tensors: value = e2m1 code * float(e4m3 scale) * global, where
  global = ``weight_scale_2`` (ModelOpt) or 1 / ``weight_global_scale`` (compressed-tensors: value = code *
  scale / weight_global_scale); the byte's low nibble is the even column; computed in float32;
* ``logits_w4a16_fp32``: the model in float32 (every unquantized tensor upcast from the checkpoint), each
  quantized linear ``y = (x * pre_quant_scale) @ W_deq.T`` (``pre_quant_scale``: ModelOpt AWQ only);
* ``logits_w4a16_bf16``: the same model in bfloat16 (W_deq computed in float32, then rounded to bf16);
* ``greedy_tokens_fp32`` / ``greedy_tokens_bf16``: the prompt and 8 greedy tokens of those two models (a
  full forward each step, no KV cache; ties impossible in practice, the smallest top-1/top-2 gap is in
  fixture.json);
* ``logits_w4a4_fp32`` and ``greedy_tokens_w4a4_fp32`` (W4A4 checkpoints): float32, and each quantized
  linear's input (after pre_quant_scale) fake-quantized to NVFP4 with the checkpoint's input scale, in blocks
  of 16 along the last dimension, by the producer's semantics (``act_qdq_modelopt`` / ``act_qdq_ct`` below,
  or the producer's own function where it has one on the CPU).
"""

import json
import os

import torch

SEED = 0
# hidden 128 with head_dim 64: q_proj 128->256, k/v 128->128 (GQA, 2 kv heads), o_proj 256->128, mlp 128<->256:
# every quantized linear has out_features % 128 == 0 and in_features % 64 == 0, and a checkpoint is ~0.4 MB
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=256, max_position_embeddings=64,
            initializer_range=0.1,  # not 0.02: peakier logits, so greedy decoding has clear winners
            rms_norm_eps=1e-5, rope_theta=10000.0, pad_token_id=0, bos_token_id=None, eos_token_id=None,
            tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
CALIB_SEED, CALIB_SHAPE = 1, (4, 32)   # 4 calibration sequences of 32 random tokens
# The reference prompt batch: of 3000 random rows (torch.randint(1, 256, (3000, 8), generator seeded 12345)),
# rows 2722 and 1596, the two whose greedy decodes had the largest smallest top-1/top-2 logit gap over these
# fixtures' reference models (float32 and bfloat16 W4A16, float32 W4A4): 0.134 and 0.080, where a typical row
# has ~0.002 (a random model's logits are flat), so that another implementation's rounding does not flip a token
PROMPT = [[142, 113, 164, 83, 139, 205, 216, 39], [80, 21, 48, 53, 97, 87, 31, 2]]
NEW_TOKENS = 8

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def tokens(seed, shape, vocab=TINY["vocab_size"]):
    return torch.randint(1, vocab, shape, generator=torch.Generator().manual_seed(seed))


def calib_tokens():
    return tokens(CALIB_SEED, CALIB_SHAPE)


def prompt_tokens():
    return torch.tensor(PROMPT, dtype=torch.int64)


def dense_model(path):
    """The tiny random Llama (the same for every fixture) saved to ``path`` in bfloat16 and loaded back with
    from_pretrained(dtype=bfloat16), as a producer is given a real checkpoint: so its rotary inv_freq is float32,
    as in any model loaded that way (a model cast with .to(bfloat16) has it rounded to bf16)."""
    import transformers

    torch.manual_seed(SEED)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).to(torch.bfloat16).save_pretrained(path)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


def versions(*names):
    import importlib.metadata as md

    out = {}
    for n in ("torch", "transformers", "safetensors", "accelerate") + names:
        try:
            out[n] = md.version(n)
        except md.PackageNotFoundError:
            out[n] = None
    return out


# ----------------------------------------------------------------------------------------------------
# Reading an exported checkpoint
# ----------------------------------------------------------------------------------------------------


def read_tensors(path):
    from safetensors.torch import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for fn in files:
        tensors.update(load_file(os.path.join(path, fn)))
    return tensors


def unpack_e2m1(packed):
    """uint8 [..., n/2] -> float32 [..., n]; the low nibble is the even element."""
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)
    return E2M1[codes.long()]


def dequantize(packed, scale, global_mult):
    """code * float(e4m3 scale) * global_mult, float32 [out, in]; one scale per 16 consecutive inputs."""
    w = unpack_e2m1(packed)
    s = scale.float().repeat_interleave(16, dim=-1)
    return w * s * global_mult


def quantized_layers(tensors, fmt):
    """{module name: dict(weight=float32 W_deq, pre_quant_scale=tensor or None, act=dict or None)} and the
    set of checkpoint keys they consumed. fmt "modelopt" or "compressed-tensors"."""
    layers, used = {}, set()
    if fmt == "modelopt":
        for k, t in tensors.items():
            if k.endswith(".weight") and t.dtype == torch.uint8:
                p = k[: -len(".weight")]
                g = tensors[p + ".weight_scale_2"].float()
                layer = dict(weight=dequantize(t, tensors[p + ".weight_scale"], g),
                             pre_quant_scale=tensors.get(p + ".pre_quant_scale"), act=None)
                if p + ".input_scale" in tensors:
                    layer["act"] = dict(kind="modelopt", input_scale=tensors[p + ".input_scale"].float())
                layers[p] = layer
                used |= {p + s for s in (".weight", ".weight_scale", ".weight_scale_2", ".input_scale",
                                         ".pre_quant_scale")}
        # KV-cache scales (FP8 KV cache): recorded in the checkpoint, not applied by the references
        used |= {k for k in tensors if k.endswith((".k_scale", ".v_scale"))}
    elif fmt == "compressed-tensors":
        for k, t in tensors.items():
            if k.endswith(".weight_packed"):
                p = k[: -len(".weight_packed")]
                g = 1.0 / tensors[p + ".weight_global_scale"].float()
                layer = dict(weight=dequantize(t, tensors[p + ".weight_scale"], g), pre_quant_scale=None, act=None)
                if p + ".input_global_scale" in tensors:
                    layer["act"] = dict(kind="ct", input_global_scale=tensors[p + ".input_global_scale"].float())
                layers[p] = layer
                used |= {p + s for s in (".weight_packed", ".weight_scale", ".weight_global_scale",
                                         ".input_global_scale")}
    else:
        raise ValueError(fmt)
    return layers, used & set(tensors)


# ----------------------------------------------------------------------------------------------------
# NVFP4 activation fake-quantization, one function per producer's semantics (float32 in, float32 out)
# ----------------------------------------------------------------------------------------------------


def fp4_round(a):
    """|x| -> the nearest e2m1 magnitude, ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
    2.5 -> 2, 3.5 -> 4, 5 -> 4), anything above 5 -> 6 (saturating). Both producers round this way."""
    q = torch.zeros_like(a)
    for lo, strict, v in ((0.25, True, 0.5), (0.75, False, 1.0), (1.25, True, 1.5), (1.75, False, 2.0),
                          (2.5, True, 3.0), (3.5, False, 4.0), (5.0, True, 6.0)):
        q = torch.where(a > lo if strict else a >= lo, v, q)
    return q


def act_qdq_modelopt(x, input_scale):
    """ModelOpt's NVFP4 activation fake-quant (its GPU kernel ``fp4_fake_quant_block``, ported to torch; ModelOpt
    has no CPU path): gs = input_scale (= amax / (6 * 448)); per 16 values s = float(e4m3(min(bmax / (6 * gs),
    448))) * gs, s = 1 where s < 1e-5; y = sign(x) * fp4_round(|x| / s) * s."""
    shape = x.shape
    xb = x.float().reshape(*shape[:-1], shape[-1] // 16, 16)
    gs = torch.where(input_scale > 0, input_scale, torch.full_like(input_scale, 1e-12))
    bmax = xb.abs().amax(-1, keepdim=True)
    s = torch.clamp(bmax / (6.0 * gs), max=448.0).to(torch.float8_e4m3fn).float() * gs
    s = torch.where(s >= 1e-5, s, torch.ones_like(s))
    y = fp4_round(xb.abs() / s) * s
    return torch.where(xb >= 0, y, -y).reshape(shape).to(x.dtype)


def act_qdq_ct(x, input_global_scale):
    """compressed-tensors' NVFP4 activation fake-quant (dynamic "local" tensor_group, its
    ``compute_dynamic_scales_and_zp`` + ``fake_quantize``, restated): G = input_global_scale; per 16 values
    s = float(e4m3(clamp(bmax / 6 * G, +-448))), s = eps(e4m3) where 0; q = fp4_round(clamp(x / (s / G), +-6));
    y = q * (s / G)."""
    shape = x.shape
    xb = x.float().reshape(*shape[:-1], shape[-1] // 16, 16)
    bmax = xb.abs().amax(-1, keepdim=True)
    s = (bmax / 6.0 * input_global_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    s = torch.where(s == 0, torch.full_like(s, torch.finfo(torch.float8_e4m3fn).eps), s)
    eff = s / input_global_scale
    xs = (xb / eff).clamp(-6.0, 6.0)
    y = torch.sign(xs) * fp4_round(xs.abs()) * eff
    return y.reshape(shape).to(x.dtype)


ACT_QDQ = {"modelopt": lambda x, a: act_qdq_modelopt(x, a["input_scale"]),
           "ct": lambda x, a: act_qdq_ct(x, a["input_global_scale"])}


# ----------------------------------------------------------------------------------------------------
# The reference model
# ----------------------------------------------------------------------------------------------------


class RefLinear(torch.nn.Module):
    """y = act((x * pre_quant_scale)) @ weight.T (+ bias); act: None (W4A16) or a fake-quant function."""

    def __init__(self, weight, bias, pre_quant_scale, act):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.bias = bias
        self.pre_quant_scale, self.act = pre_quant_scale, act

    def forward(self, x):
        if self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale.to(x.dtype)
        if self.act is not None:
            x = self.act(x)
        return torch.nn.functional.linear(x, self.weight, self.bias)


def reference_model(path, fmt, dtype, w4a4=False, act_override=None):
    """The checkpoint at ``path`` as a plain transformers model in ``dtype`` whose quantized linears compute
    with dequantized weights (and, if ``w4a4``, fake-quantized inputs: ``act_override(x, layer_act)`` if given,
    else this file's port of the producer's semantics)."""
    import transformers

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    config = transformers.AutoConfig.for_model(**cfg)
    # built in ``dtype`` as from_pretrained(dtype=...) builds it (rotary inv_freq stays float32); the random
    # init is overwritten below
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = read_tensors(path)
    layers, used = quantized_layers(tensors, fmt)
    for name, layer in layers.items():
        parent, _, leaf = name.rpartition(".")
        act = None
        if w4a4:
            if layer["act"] is None:
                raise ValueError(f"{name}: no input scale in a checkpoint asked for W4A4 references")
            qdq = act_override or ACT_QDQ[layer["act"]["kind"]]
            act = (lambda q, a: (lambda x: q(x, a)))(qdq, layer["act"])
        bias = tensors.get(name + ".bias")
        if bias is not None:
            used.add(name + ".bias")
            bias = bias.to(dtype)
        pqs = layer["pre_quant_scale"]
        ref = RefLinear(layer["weight"].to(dtype), bias, None if pqs is None else pqs.to(dtype), act)
        setattr(model.get_submodule(parent), leaf, ref)
    rest = {k: v.to(dtype) for k, v in tensors.items() if k not in used}
    missing, unexpected = model.load_state_dict(rest, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint {path}: missing {missing}, unexpected {unexpected}")
    return model.eval(), sorted(layers)


@torch.no_grad()
def logits(model, ids):
    return model(input_ids=ids).logits


@torch.no_grad()
def greedy(model, ids, n=NEW_TOKENS):
    """Greedy decoding with a full forward each step; returns (prompt + n tokens, the smallest top1-top2 gap)."""
    gap = float("inf")
    for _ in range(n):
        last = model(input_ids=ids).logits[:, -1].float()
        top = last.topk(2, dim=-1).values
        gap = min(gap, (top[:, 0] - top[:, 1]).min().item())
        ids = torch.cat([ids, last.argmax(-1, keepdim=True)], dim=-1)
    return ids, gap


def write_references(path, fmt, w4a4, info, act_override=None, crosscheck_acts=None, producer_logits=None):
    """reference.safetensors and fixture.json for the checkpoint at ``path``; ``info``: the fixture.json fields
    the producer script knows (name, producer, scheme, config...). W4A4: ``act_override`` as in reference_model;
    ``crosscheck_acts`` {label: another activation fake-quant}: how far each lands from logits_w4a4_fp32 goes
    into fixture.json's checks; so does ``producer_logits`` {label: float32 logits of ``input_ids`` by the producer's
    own quantized model in memory} against logits_w4a4_fp32 (W4A4) or logits_w4a16_fp32."""
    from safetensors.torch import save_file

    ids = prompt_tokens()
    ref = {"input_ids": ids}
    desc = {"input_ids": "int64 [2, 8]: the prompt batch (no padding, no BOS; every row full length)"}
    m32, names = reference_model(path, fmt, torch.float32)
    m16, _ = reference_model(path, fmt, torch.bfloat16)
    ref["logits_w4a16_fp32"] = logits(m32, ids).float().contiguous()
    ref["logits_w4a16_bf16"] = logits(m16, ids).contiguous()
    g32, gap32 = greedy(m32, ids)
    g16, gap16 = greedy(m16, ids)
    ref["greedy_tokens_fp32"], ref["greedy_tokens_bf16"] = g32, g16
    desc["logits_w4a16_fp32"] = ("float32 [2, 8, vocab]: the model in float32 with every quantized linear's "
                                 "weight dequantized from the checkpoint (code * e4m3 scale * global), inputs "
                                 "unquantized (times pre_quant_scale where the checkpoint has one)")
    desc["logits_w4a16_bf16"] = ("bfloat16 [2, 8, vocab]: the same in bfloat16 (dequantized weights computed "
                                 "in float32 then rounded to bf16, the forward in bf16)")
    desc["greedy_tokens_fp32"] = (f"int64 [2, 8 + {NEW_TOKENS}]: the prompt and {NEW_TOKENS} greedy tokens of the "
                                  "float32 W4A16 model")
    desc["greedy_tokens_bf16"] = f"int64 [2, 8 + {NEW_TOKENS}]: the same with the bfloat16 W4A16 model"
    def maxdiff(a, b):
        return (a.float() - b.float()).abs().max().item()

    checks = {"greedy_min_top1_top2_gap_fp32": gap32, "greedy_min_top1_top2_gap_bf16": gap16,
              "greedy_fp32_equals_bf16": bool(torch.equal(g32, g16)),
              "max_abs_logits_w4a16_bf16_minus_fp32": maxdiff(ref["logits_w4a16_bf16"], ref["logits_w4a16_fp32"])}
    if w4a4:
        mq, _ = reference_model(path, fmt, torch.float32, w4a4=True, act_override=act_override)
        ref["logits_w4a4_fp32"] = logits(mq, ids).float().contiguous()
        desc["logits_w4a4_fp32"] = info.pop("w4a4_description")
        ref["greedy_tokens_w4a4_fp32"], checks["greedy_min_top1_top2_gap_w4a4_fp32"] = greedy(mq, ids)
        desc["greedy_tokens_w4a4_fp32"] = f"int64 [2, 8 + {NEW_TOKENS}]: the same with the float32 W4A4 model"
        checks["max_abs_logits_w4a4_minus_w4a16_fp32"] = maxdiff(ref["logits_w4a4_fp32"], ref["logits_w4a16_fp32"])
        for label, act in (crosscheck_acts or {}).items():
            other, _ = reference_model(path, fmt, torch.float32, w4a4=True, act_override=act)
            diff = maxdiff(logits(other, ids), ref["logits_w4a4_fp32"])
            checks[f"max_abs_logits_w4a4_{label}_minus_reference"] = diff
    for label, out in (producer_logits or {}).items():
        against = "logits_w4a4_fp32" if w4a4 else "logits_w4a16_fp32"
        checks[f"max_abs_{label}_minus_{against}"] = None if out is None else maxdiff(out, ref[against])
    save_file(ref, os.path.join(path, "reference.safetensors"))
    files = sorted(f for f in os.listdir(path) if f not in ("fixture.json",))
    fixture = dict(info)
    fixture.update(
        format=fmt, quantized_modules=names, files=files + ["fixture.json"],
        model=dict(TINY, dtype="bfloat16", seed=SEED, note="LlamaForCausalLM(LlamaConfig(**model)) after "
                   "torch.manual_seed(seed), cast to bfloat16"),
        calibration=dict(seed=CALIB_SEED, shape=list(CALIB_SHAPE), note="torch.randint(1, vocab, shape, "
                         "generator=torch.Generator().manual_seed(seed)), one sequence per forward"),
        prompt=dict(input_ids=PROMPT, note="picked for clear greedy winners (tools/fixtures_common.py)"),
        reference={k: desc[k] for k in ref}, checks=checks,
        dequantization=("value = e2m1[code] * float(weight_scale) * weight_scale_2" if fmt == "modelopt" else
                        "value = e2m1[code] * float(weight_scale) / weight_global_scale") +
        "; code = byte & 15 for even columns, byte >> 4 for odd; e2m1 = [0, .5, 1, 1.5, 2, 3, 4, 6] and "
        "their negatives for codes 8..15; one e4m3 scale per 16 consecutive inputs of a row",
    )
    with open(os.path.join(path, "fixture.json"), "w") as f:
        json.dump(fixture, f, indent=1)
        f.write("\n")
    return ref

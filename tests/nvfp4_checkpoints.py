"""Tiny NVFP4 checkpoints in each producer's layout, written from a ``save_modelopt`` export by renaming (no
producer installed), for tests/model/test_from_pretrained.py and tests/model/test_compressed_tensors.py; and the
references they are checked against.

* ``modelopt_export``: ``save_modelopt`` of the tiny Llama of model/test_modelopt.py (weight_scale_2 = 2^-15 and
  power-of-two input scales, so every reciprocal below is exact and each layout must give the same bits);
* ``to_compressed_tensors``: the same tensors as llm-compressor's ``nvfp4-pack-quantized`` layout
  (``weight_packed``, ``weight_global_scale = 1 / weight_scale_2`` and ``input_global_scale = 1 /
  input_scale`` as float32 [1]; config.json's ``quantization_config`` with ``config_groups``/``ignore``);
* ``with_awq``: ModelOpt NVFP4_AWQ: a ``pre_quant_scale`` per quantized linear;
* ``peak_cpu_bytes``: the most bytes torch's CPU allocator held at once while a function ran (the profiler's
  allocation events).
"""

import json
import os

import torch
from safetensors.torch import load_file, save_file

from nvfp4_gemv import load_modelopt, save_modelopt

NVFP4_ARGS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
              "dynamic": False, "observer": "minmax"}
NVFP4_INPUT = dict(NVFP4_ARGS, dynamic="local")


def modelopt_export(path, mode="w4a16", arch="llama", tie=False, shard=None, skip=None):
    """A tiny Llama (or ``arch``) quantized in ``mode`` and saved in ``path``; ``skip``: quantize_model's skip
    (mode "w4a16")."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "model"))  # tests/model/
    import test_modelopt as tm

    if tie or skip:
        torch.manual_seed(0)
        qmodel = tm.quantize_model(tm.tiny_model(tie=tie), skip=skip or ("lm_head",))
    else:
        qmodel, _ = tm.quantized(mode, arch)
    save_modelopt(qmodel, str(path), max_shard_bytes=shard, overwrite=True)
    return qmodel


def _state(src):
    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    state = {}
    for f in files:
        state.update(load_file(os.path.join(src, f)))
    return state


def _config(src):
    with open(os.path.join(src, "config.json")) as f:
        return json.load(f)


def write(dst, state, config, quant=None):
    os.makedirs(dst, exist_ok=True)
    save_file(state, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if quant is not None:
        with open(os.path.join(dst, "hf_quant_config.json"), "w") as f:
            json.dump(quant, f, indent=2)
    return str(dst)


def to_compressed_tensors(src, dst, activations=True, ignore=("lm_head",), targets=("Linear",), groups=None,
                          kv_scheme=None, edit=None):
    """The export ``src`` in compressed-tensors' NVFP4 layout in ``dst`` (scheme NVFP4, or NVFP4A16 without
    ``activations``); ``groups`` replaces the config's config_groups; ``edit(state, qc)`` changes both."""
    state = _state(src)
    out = {}
    for k, v in state.items():
        p, _, s = k.rpartition(".")
        if f"{p}.weight_scale" in state:
            if s == "weight":
                out[f"{p}.weight_packed"] = v
            elif s == "weight_scale_2":
                out[f"{p}.weight_global_scale"] = (1 / v.float()).reshape(1)
            elif s == "input_scale":
                if activations:
                    out[f"{p}.input_global_scale"] = (1 / v.float()).reshape(1)
            else:
                out[k] = v
        else:
            out[k] = v
    group = {"targets": list(targets), "weights": dict(NVFP4_ARGS),
             "input_activations": dict(NVFP4_INPUT) if activations else None, "output_activations": None,
             "format": "nvfp4-pack-quantized"}
    qc = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
          "config_groups": groups if groups is not None else {"group_0": group}, "ignore": list(ignore),
          "kv_cache_scheme": kv_scheme, "sparsity_config": {}, "transform_config": {}, "version": "0.12.2"}
    if edit is not None:
        edit(out, qc)
    cfg = dict(_config(src), quantization_config=qc)
    return write(dst, out, cfg)


def with_awq(src, dst, scales):
    """The export ``src`` as ModelOpt NVFP4_AWQ in ``dst``: ``scales`` ({linear name: [in] tensor}) as each
    layer's ``pre_quant_scale`` (bf16)."""
    state = _state(src)
    for p, s in scales.items():
        state[f"{p}.pre_quant_scale"] = s.to(torch.bfloat16)
    with open(os.path.join(src, "hf_quant_config.json")) as f:
        quant = json.load(f)
    quant["quantization"]["quant_algo"] = "NVFP4_AWQ"
    cfg = _config(src)
    cfg["quantization_config"]["quant_algo"] = "NVFP4_AWQ"
    return write(dst, state, cfg, quant)


def reference(path, mode):
    """``load_modelopt`` into transformers' own build of the config (bf16, rotary buffers in fp32, as
    transformers' from_pretrained leaves them): the model from_pretrained must equal bit for bit."""
    import transformers

    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path),
                                                          dtype=torch.bfloat16).eval()
    return load_modelopt(model, str(path), mode=mode)


def peak_cpu_bytes(fn):
    """(fn(), the most bytes torch's CPU allocator held at once above where it started, during fn)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
        stack.extend(e.children)
    cur = peak = 0
    for _, n in sorted(events):
        cur += n
        peak = max(peak, cur)
    return out, peak


def synthetic_export(config, path, seed=0):
    """A ModelOpt W4A16_NVFP4 checkpoint of transformers ``config`` with random codes and scales, written
    without building a bf16 model (fast at sizes where quantize_model is not): every nn.Linear but lm_head
    quantized, the rest random bf16 (norms ones)."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    state = {}
    for k, t in model.state_dict().items():
        owner, _, leaf = k.rpartition(".")
        if owner in linears and leaf == "weight":
            out_f, in_f = t.shape
            state[k] = torch.randint(0, 256, (out_f, in_f // 2), dtype=torch.uint8, generator=g)
            scale = torch.exp2(torch.randint(-3, 2, (out_f, in_f // 16), generator=g).float())
            state[f"{owner}.weight_scale"] = scale.to(torch.float8_e4m3fn)
            state[f"{owner}.weight_scale_2"] = torch.tensor(2.0 ** -8)
        elif "norm" in k:
            state[k] = torch.ones(t.shape, dtype=t.dtype)
        else:
            state[k] = (torch.randn(t.shape, generator=g) * 0.02).to(t.dtype)
    exclude = ["lm_head"]
    quant = {"producer": {"name": "modelopt", "version": "synthetic"},
             "quantization": {"quant_algo": "W4A16_NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                              "exclude_modules": exclude}}
    cfg = config.to_dict()
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "group_size": 16,
                                  "ignore": exclude}
    cfg.setdefault("architectures", [type(model).__name__])
    return write(path, state, cfg, quant)

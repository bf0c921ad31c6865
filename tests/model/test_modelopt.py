"""save_modelopt / load_modelopt on a tiny random Llama (hidden 128, 2 layers, vocab 256) on the CPU:
the config parsing, the round trip (logits and greedy generate with a static cache against the same
model with dequantized weights, in both modes), sharded and fused checkpoints, and every error path
naming its key or tensor, leaving the model as it was."""

import copy
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from safetensors.torch import load_file, save_file  # noqa: E402

from nvfp4_gemv import NVFP4Linear, calibrate_input_scales, dequantize, load_modelopt, quantize_model, save_modelopt  # noqa: E402
from nvfp4_gemv.model.modelopt import CheckpointError, parse_quant_config, read_quant_config  # noqa: E402
from nvfp4_gemv.quant import quantize_reference  # noqa: E402

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=256, max_position_embeddings=64, pad_token_id=0, bos_token_id=None,
            eos_token_id=None)
PROMPT = torch.tensor([[5, 17, 99, 3, 250, 42], [7, 7, 1, 200, 13, 64]])
A = 2688 * 2.0 ** -15  # each weight's amax: weight_scale_2 = 2^-15, so dequantized weights are exact in bf16


def tiny_model(arch="llama", seed=0, tie=False):
    torch.manual_seed(seed)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, tie_word_embeddings=tie))
    else:
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**TINY, tie_word_embeddings=tie))
    model = model.to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and name != "lm_head":
                m.weight.clamp_(-A, A)[0, 0] = A
    return model


def pow2(t):
    return torch.exp2(torch.round(torch.log2(t)))


def quantized(mode, arch="llama"):
    """(the quantized model, its dense twin). In mode "w4a4", input scales from a calibration pass, rounded
    to powers of two (so dequantized activations are exact in bf16 too); mode "w4a16" is weight-only."""
    model = tiny_model(arch)
    dense = copy.deepcopy(model)
    if mode == "w4a16":
        return quantize_model(model, mode=mode), dense
    scales = calibrate_input_scales(model, lambda m: m(PROMPT))
    scales = {k: pow2(v) for k, v in scales.items()}
    return quantize_model(model, mode=mode, input_scales=scales), dense


class FakeQuantLinear(torch.nn.Module):
    """The reference: a bf16 linear of the dequantized weight; in w4a4 mode x quantized and dequantized
    the same way first (exact in bf16 with power-of-two input scales)."""

    def __init__(self, q):
        super().__init__()
        self.weight = torch.nn.Parameter(dequantize(q.weight, q.weight_scale, q.weight_scale_2).to(torch.bfloat16))
        self.bias = q.bias
        self.mode, self.input_scale = q.mode, q.input_scale

    def forward(self, x):
        if self.mode == "w4a4":
            xq, xs = quantize_reference(x.reshape(-1, x.shape[-1]), torch.ones(()) / self.input_scale)
            x = (dequantize(xq, xs) * self.input_scale).to(x.dtype).reshape(x.shape)
        return torch.nn.functional.linear(x, self.weight, self.bias)


def dequantized_twin(qmodel):
    ref = copy.deepcopy(qmodel)
    for name, m in list(ref.named_modules()):
        if isinstance(m, NVFP4Linear):
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent), child, FakeQuantLinear(m))
    return ref


def state_bytes(model):
    return {k: v.reshape(-1).view(torch.uint8).clone() if v.dim() else v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module", params=["w4a16", "w4a4"])
def export(request, tmp_path_factory):
    mode = request.param
    qmodel, dense = quantized(mode)
    path = str(tmp_path_factory.mktemp(f"export-{mode}"))
    save_modelopt(qmodel, path)
    return mode, path, qmodel, dense


def fresh(path, arch=None):
    """A model with other random weights than the exported one's: of the export's config.json, or of
    ``arch``'s (another architecture with the same shapes)."""
    torch.manual_seed(123)
    if arch is None:
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path)) \
            .to(torch.bfloat16).eval()
    cfg = (transformers.LlamaConfig if arch == "llama" else transformers.Phi3Config)(**TINY)
    cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.Phi3ForCausalLM
    return cls(cfg).to(torch.bfloat16).eval()


def edit_checkpoint(src, dst, tensors=None, quant=None, config=None):
    """A copy of export ``src`` in ``dst`` with ``tensors(dict)``, ``quant(dict)``, ``config(dict)`` applied."""
    os.makedirs(dst, exist_ok=True)
    state = load_file(os.path.join(src, "model.safetensors"))
    if tensors:
        tensors(state)
    save_file(state, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    for name, fn in (("hf_quant_config.json", quant), ("config.json", config)):
        with open(os.path.join(src, name)) as f:
            doc = json.load(f)
        if fn:
            doc = fn(doc)
        if doc is not None:
            with open(os.path.join(dst, name), "w") as f:
                json.dump(doc, f)
    return dst


# ----------------------------------------------------------------------------------------------------
# The export
# ----------------------------------------------------------------------------------------------------


def test_export_has_modelopt_names_dtypes_and_config(export):
    mode, path, qmodel, _ = export
    state = load_file(os.path.join(path, "model.safetensors"))
    p = "model.layers.0.self_attn.q_proj"
    assert state[f"{p}.weight"].dtype == torch.uint8 and state[f"{p}.weight"].shape == (128, 64)
    assert state[f"{p}.weight_scale"].dtype == torch.float8_e4m3fn and state[f"{p}.weight_scale"].shape == (128, 8)
    assert state[f"{p}.weight_scale_2"].dtype == torch.float32 and state[f"{p}.weight_scale_2"].dim() == 0
    assert (f"{p}.input_scale" in state) == (mode == "w4a4")
    assert state["lm_head.weight"].dtype == torch.bfloat16 and "lm_head.weight_scale" not in state
    with open(os.path.join(path, "hf_quant_config.json")) as f:
        q = json.load(f)
    assert q["producer"]["name"] == "modelopt"
    assert q["quantization"] == {"quant_algo": "NVFP4" if mode == "w4a4" else "W4A16_NVFP4",
                                 "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": ["lm_head"]}
    assert transformers.AutoConfig.from_pretrained(path).hidden_size == 128


# ----------------------------------------------------------------------------------------------------
# The round trip
# ----------------------------------------------------------------------------------------------------


def test_load_gives_the_exported_model_exactly(export):
    mode, path, qmodel, _ = export
    model = load_modelopt(fresh(path), path, mode=mode)
    n = sum(isinstance(m, NVFP4Linear) for m in model.modules())
    assert n == 14 and all(m.mode == mode for m in model.modules() if isinstance(m, NVFP4Linear))
    with torch.no_grad():
        assert torch.equal(model(PROMPT).logits, qmodel(PROMPT).logits)


def test_logits_match_the_dequantized_model(export):
    mode, path, _, dense = export
    model = load_modelopt(fresh(path), path, mode=mode)
    ref = dequantized_twin(model)
    with torch.no_grad():
        got, want, orig = model(PROMPT).logits.float(), ref(PROMPT).logits.float(), dense(PROMPT).logits.float()
    # the same arithmetic but for fp32 accumulation in bf16 F.linear against exact sums: bf16 rounding
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    # and the quantized model is near the original (NVFP4's error)
    assert (got - orig).norm() <= 0.35 * orig.norm()


def test_greedy_generate_with_a_static_cache_gives_the_dequantized_models_tokens(export):
    mode, path, _, _ = export
    model = load_modelopt(fresh(path), path, mode=mode)
    ref = dequantized_twin(model)
    kw = dict(max_new_tokens=8, do_sample=False, cache_implementation="static")
    out = model.generate(PROMPT, **kw)
    assert out.shape == (2, 14)
    assert torch.equal(out, ref.generate(PROMPT, **kw))


@pytest.mark.parametrize("fuse", [False, True])
def test_load_with_pack_gives_packed_layers_of_the_same_values(export, fuse):
    """``pack=True``: every quantized layer packed (the tiny model's in_features are 128 and 256), fused groups
    too; the logits bit for bit those of the unpacked load (the CPU path unpacks to the same reference), the
    state_dict the checkpoint's."""
    mode, path, _, _ = export
    if mode != "w4a16":
        with pytest.raises(ValueError, match="'pack'.*'w4a16' only"):
            load_modelopt(fresh(path), path, mode=mode, pack=True)
        return
    plain = load_modelopt(fresh(path), path, mode=mode)
    packed = load_modelopt(fresh(path), path, mode=mode, fuse=fuse, pack=True)
    layers = [m for m in packed.modules() if isinstance(m, NVFP4Linear)]
    assert layers and all(m.packed and m.weight_scale is None for m in layers)
    assert all(m._siblings is not None for m in layers if m.out_features != 128) == fuse
    with torch.no_grad():
        assert torch.equal(packed(PROMPT).logits, plain(PROMPT).logits)
    got, want = state_bytes(packed), state_bytes(plain)
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_load_into_an_already_quantized_model(export):
    mode, path, qmodel, _ = export
    target = quantize_model(tiny_model(seed=5), mode="w4a16")
    load_modelopt(target, path, mode=mode)
    with torch.no_grad():
        assert torch.equal(target(PROMPT).logits, qmodel(PROMPT).logits)


def test_sharded_export_loads_the_same(tmp_path):
    qmodel, _ = quantized("w4a16")
    save_modelopt(qmodel, str(tmp_path), max_shard_bytes=40_000)
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 2
    model = load_modelopt(fresh(str(tmp_path)), str(tmp_path))
    with torch.no_grad():
        assert torch.equal(model(PROMPT).logits, qmodel(PROMPT).logits)


def test_tied_embeddings_are_written_once_and_loaded(tmp_path):
    torch.manual_seed(0)
    qmodel = quantize_model(tiny_model(tie=True))
    save_modelopt(qmodel, str(tmp_path))
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    model = load_modelopt(fresh(str(tmp_path)), str(tmp_path))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        assert torch.equal(model(PROMPT).logits, qmodel(PROMPT).logits)


def test_config_json_quantization_config_variants(export, tmp_path):
    mode, path, qmodel, _ = export
    algo = "NVFP4" if mode == "w4a4" else "W4A16_NVFP4"
    flat = {"quant_method": "modelopt", "quant_algo": algo, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16}}}}
    nested = {"quant_method": "modelopt", "quantization": {"quant_algo": algo, "group_size": 16,
                                                           "exclude_modules": ["lm_head"]}}
    for i, qc in enumerate((flat, nested)):
        dst = edit_checkpoint(path, str(tmp_path / str(i)), quant=lambda d: None,
                              config=lambda d, qc=qc: dict(d, quantization_config=qc))
        assert not os.path.exists(os.path.join(dst, "hf_quant_config.json"))
        model = load_modelopt(fresh(dst), dst, mode=mode)
        with torch.no_grad():
            assert torch.equal(model(PROMPT).logits, qmodel(PROMPT).logits)


def test_a_published_hf_quant_config_parses():
    doc = {"producer": {"name": "modelopt", "version": "0.41.0"},
           "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                            "exclude_modules": ["lm_head", "model.layers.0.self_attn*"]}}
    cfg = parse_quant_config(doc, "hf_quant_config.json")
    assert (cfg.quant_algo, cfg.group_size, cfg.kv_cache_quant_algo) == ("NVFP4", 16, None)
    assert cfg.excludes("lm_head") and cfg.excludes("model.layers.0.self_attn")
    assert cfg.excludes("model.layers.0.self_attn.q_proj") and not cfg.excludes("model.layers.1.self_attn.q_proj")


def test_kv_cache_scales_are_ignored_with_a_warning_when_the_config_names_a_kv_algo(export, tmp_path):
    mode, path, qmodel, _ = export

    def add(state):
        state["model.layers.0.self_attn.k_proj.k_scale"] = torch.tensor(1.0)
        state["model.layers.0.self_attn.v_proj.v_scale"] = torch.tensor(1.0)

    def kv(d):
        d["quantization"]["kv_cache_quant_algo"] = "FP8"
        return d

    dst = edit_checkpoint(path, str(tmp_path / "kv"), tensors=add, quant=kv)
    with pytest.warns(RuntimeWarning, match="2 KV-cache scales"):
        model = load_modelopt(fresh(dst), dst, mode=mode)
    with torch.no_grad():
        assert torch.equal(model(PROMPT).logits, qmodel(PROMPT).logits)
    dst = edit_checkpoint(path, str(tmp_path / "kv-no-algo"), tensors=add)
    with pytest.raises(CheckpointError, match="'model.layers.0.self_attn.k_proj.k_scale'.*no kv_cache_quant_algo"):
        load_modelopt(fresh(dst), dst, mode=mode)


# ----------------------------------------------------------------------------------------------------
# Fused modules
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_separate_qkv_and_gate_up_load_into_a_models_fused_modules(tmp_path, mode):
    qmodel, _ = quantized(mode)  # all weight_scale_2 equal (2^-15); q/k/v, gate/up see one input: one input_scale
    save_modelopt(qmodel, str(tmp_path))
    phi = load_modelopt(fresh(str(tmp_path), "phi3"), str(tmp_path), mode=mode)
    attn, mlp = phi.model.layers[0].self_attn, phi.model.layers[0].mlp
    assert isinstance(attn.qkv_proj, NVFP4Linear) and attn.qkv_proj.out_features == 384
    assert isinstance(mlp.gate_up_proj, NVFP4Linear) and mlp.gate_up_proj.out_features == 512
    src = qmodel.model.layers[0]
    parts = [src.self_attn.q_proj, src.self_attn.k_proj, src.self_attn.v_proj]
    assert torch.equal(attn.qkv_proj.weight, torch.cat([p.weight for p in parts]))
    ref = dequantized_twin(phi)
    kw = dict(max_new_tokens=6, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        got, want = phi(PROMPT).logits.float(), ref(PROMPT).logits.float()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    assert torch.equal(phi.generate(PROMPT, **kw), ref.generate(PROMPT, **kw))


def test_fusing_parts_with_different_global_scales_is_refused(tmp_path):
    qmodel, _ = quantized("w4a16")
    save_modelopt(qmodel, str(tmp_path / "src"))

    def unshare(state):
        state["model.layers.1.self_attn.k_proj.weight_scale_2"] = torch.tensor(2.0 ** -14)

    dst = edit_checkpoint(str(tmp_path / "src"), str(tmp_path / "dst"), tensors=unshare)
    model = fresh(dst, "phi3")
    before = state_bytes(model)
    with pytest.raises(CheckpointError, match=r"model.layers.1.self_attn.q_proj.weight_scale_2.*differ"):
        load_modelopt(model, dst)
    after = state_bytes(model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_fused_checkpoint_loads_into_a_models_separate_modules(tmp_path):
    torch.manual_seed(0)
    phi = quantize_model(tiny_model("phi3"))
    save_modelopt(phi, str(tmp_path))
    llama = load_modelopt(fresh(str(tmp_path), "llama"), str(tmp_path))
    attn = llama.model.layers[1].self_attn
    assert isinstance(attn.k_proj, NVFP4Linear)
    assert torch.equal(attn.k_proj.weight, phi.model.layers[1].self_attn.qkv_proj.weight[128:256])
    with torch.no_grad():
        got, want = llama(PROMPT).logits.float(), phi(PROMPT).logits.float()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


def test_excluded_modules_load_dense_into_fused_or_separate_modules_either_way(tmp_path):
    """Excluded (bf16) q/k/v and gate/up of a separate-module export stack into a fused model's dense
    qkv_proj and gate_up_proj, and that model's export splits back into separate dense modules."""
    torch.manual_seed(0)
    skip = ("lm_head", "model.layers.0.self_attn.*", "model.layers.1.mlp.*")
    llama = quantize_model(tiny_model("llama"), skip=skip)
    save_modelopt(llama, str(tmp_path / "llama"))
    phi = load_modelopt(fresh(str(tmp_path / "llama"), "phi3"), str(tmp_path / "llama"))
    attn, mlp = phi.model.layers[0].self_attn, phi.model.layers[1].mlp
    assert type(attn.qkv_proj) is torch.nn.Linear and type(mlp.gate_up_proj) is torch.nn.Linear
    assert isinstance(phi.model.layers[1].self_attn.qkv_proj, NVFP4Linear)
    src_attn, src_mlp = llama.model.layers[0].self_attn, llama.model.layers[1].mlp
    assert torch.equal(attn.qkv_proj.weight, torch.cat([src_attn.q_proj.weight, src_attn.k_proj.weight,
                                                        src_attn.v_proj.weight]))
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([src_mlp.gate_proj.weight, src_mlp.up_proj.weight]))
    with torch.no_grad():
        got, want = phi(PROMPT).logits.float(), llama(PROMPT).logits.float()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    save_modelopt(phi, str(tmp_path / "phi"))
    back = load_modelopt(fresh(str(tmp_path / "phi"), "llama"), str(tmp_path / "phi"))
    for name in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(getattr(back.model.layers[0].self_attn, name).weight, getattr(src_attn, name).weight)
    for name in ("gate_proj", "up_proj"):
        assert torch.equal(getattr(back.model.layers[1].mlp, name).weight, getattr(src_mlp, name).weight)


# ----------------------------------------------------------------------------------------------------
# Errors: each names the key or tensor, and the model is left as it was
# ----------------------------------------------------------------------------------------------------

Q = "model.layers.0.mlp.down_proj"


def drop(key):
    return lambda state: state.pop(key)


def put(key, value):
    return lambda state: state.__setitem__(key, value(state) if callable(value) else value)


def set_quant(**kw):
    def f(d):
        d["quantization"].update(kw)
        return d
    return f


ERRORS = [
    ("quant_algo FP8", dict(quant=set_quant(quant_algo="FP8")), r"quantization.quant_algo is 'FP8'"),
    ("quant_algo MIXED", dict(quant=set_quant(quant_algo="MIXED_PRECISION")), r"quant_algo is 'MIXED_PRECISION'"),
    ("group size 32", dict(quant=set_quant(group_size=32)), r"quantization.group_size is 32"),
    ("exclude not a list", dict(quant=set_quant(exclude_modules="lm_head")), r"quantization.exclude_modules"),
    ("no quantization key", dict(quant=lambda d: {"producer": d["producer"]}), r"key 'quantization'"),
    ("no quant config", dict(quant=lambda d: None, config=lambda d: {k: v for k, v in d.items()
                                                                   if k != "quantization_config"}),
     r"neither hf_quant_config.json nor"),
    ("not modelopt", dict(quant=lambda d: None, config=lambda d: dict(d, quantization_config={
        "quant_method": "compressed-tensors", "quant_algo": "NVFP4"})), r"'quant_method' is 'compressed-tensors'"),
    ("config_groups size", dict(quant=lambda d: None, config=lambda d: dict(d, quantization_config={
        "quant_method": "modelopt", "quant_algo": "NVFP4",
        "config_groups": {"g": {"weights": {"group_size": 32}}}})), r"group_size is 32"),
    ("missing weight_scale_2", dict(tensors=drop(f"{Q}.weight_scale_2")), rf"'{Q}.weight_scale_2'"),
    ("missing weight", dict(tensors=drop(f"{Q}.weight")), rf"'{Q}.weight'"),
    ("missing dense", dict(tensors=drop("model.norm.weight")), r"'model.norm.weight' of the model is not"),
    ("mis-shaped scale", dict(tensors=put(f"{Q}.weight_scale", lambda s: s[f"{Q}.weight_scale"][:, :8].contiguous())),
     rf"'{Q}.weight_scale'"),
    ("mis-typed scale", dict(tensors=put(f"{Q}.weight_scale", lambda s: s[f"{Q}.weight_scale"].view(torch.uint8))),
     rf"'{Q}.weight_scale'"),
    ("mis-shaped weight", dict(tensors=put(f"{Q}.weight", lambda s: s[f"{Q}.weight"][:, :64].contiguous())),
     rf"'{Q}.weight"),
    ("mis-shaped dense", dict(tensors=put("model.embed_tokens.weight", torch.zeros(255, 128, dtype=torch.bfloat16))),
     r"'model.embed_tokens.weight': shape \(255, 128\)"),
    ("unclaimed tensor", dict(tensors=put("model.layers.0.mlp.extra.weight", torch.zeros(2))),
     r"'model.layers.0.mlp.extra.weight' has no place"),
    ("unclaimed quantized", dict(tensors=put("model.layers.0.mlp.extra.weight_scale", torch.zeros(2))),
     r"'model.layers.0.mlp.extra.weight_scale': the model has no linear"),
    ("bias the model lacks", dict(tensors=put(f"{Q}.bias", torch.zeros(128, dtype=torch.bfloat16))), rf"'{Q}.bias'"),
    ("excluded yet quantized", dict(quant=set_quant(exclude_modules=["lm_head", "*.mlp.down_proj"])),
     rf"'{Q}' is quantized, but hf_quant_config.json excludes it"),
]


@pytest.mark.parametrize("what, edits, match", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_checkpoint_raises_naming_the_key_and_leaves_the_model_as_it_was(export, tmp_path, what, edits, match):
    mode, path, _, _ = export
    dst = edit_checkpoint(path, str(tmp_path / "bad"), **edits)
    model = fresh(path)
    before = state_bytes(model)
    with pytest.raises(CheckpointError, match=match):
        load_modelopt(model, dst, mode=mode)
    assert not any(isinstance(m, NVFP4Linear) for m in model.modules())
    after = state_bytes(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_w4a4_mode_needs_input_scales(export, tmp_path):
    mode, path, _, _ = export
    if mode == "w4a16":  # a weight-only export
        with pytest.raises(CheckpointError, match="'W4A16_NVFP4' has no input scales"):
            load_modelopt(fresh(path), path, mode="w4a4")
    else:
        dst = edit_checkpoint(path, str(tmp_path / "x"), tensors=drop(f"{Q}.input_scale"))
        with pytest.raises(CheckpointError, match=rf"missing tensor '{Q}.input_scale'"):
            load_modelopt(fresh(path), dst, mode="w4a4")
        load_modelopt(fresh(path), dst, mode="w4a16")  # weight-only loading needs none


def test_sharded_index_naming_a_missing_file_raises(tmp_path):
    qmodel, _ = quantized("w4a16")
    save_modelopt(qmodel, str(tmp_path), max_shard_bytes=40_000)
    first = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))[0]
    os.remove(tmp_path / first)
    with pytest.raises(CheckpointError, match=f"names '{first}'"):
        load_modelopt(fresh(str(tmp_path)), str(tmp_path))


def test_bad_mode_and_models_without_nvfp4_layers(tmp_path):
    with pytest.raises(ValueError, match="'mode'"):
        load_modelopt(tiny_model(), str(tmp_path), mode="fp8")
    with pytest.raises(ValueError, match="no NVFP4Linear"):
        save_modelopt(tiny_model(), str(tmp_path))


def test_read_quant_config_prefers_hf_quant_config_json(export):
    _, path, _, _ = export
    assert read_quant_config(path).source == "hf_quant_config.json"


# ----------------------------------------------------------------------------------------------------
# On the GPU (the lead's machine): the tiny Llama on the kernels
# ----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fuse, pack", [(False, False), (True, False), (True, True)])
def test_gpu_loaded_model_matches_the_cpu_one_in_logits_and_greedy_tokens(export, fuse, pack):
    mode, path, _, _ = export
    if pack and mode != "w4a16":
        pytest.skip("the packed layout runs mode 'w4a16' only")
    cpu = load_modelopt(fresh(path), path, mode=mode)
    gpu = load_modelopt(fresh(path).cuda(), path, mode=mode, fuse=fuse, pack=pack)
    assert all(m.weight.is_cuda and m.packed == pack for m in gpu.modules() if isinstance(m, NVFP4Linear))
    assert all((m._siblings is not None) == (fuse and name.rpartition(".")[2] != "o_proj"
                                             and name.rpartition(".")[2] != "down_proj")
               for name, m in gpu.named_modules() if isinstance(m, NVFP4Linear))
    with torch.no_grad():
        want, got = cpu(PROMPT).logits.float(), gpu(PROMPT.cuda()).logits.float().cpu()
    # the kernels' fp32 sums against exact ones: bf16 rounding of each linear's output
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    kw = dict(max_new_tokens=8, do_sample=False, cache_implementation="static")
    out_gpu, out_cpu = gpu.generate(PROMPT.cuda(), **kw).cpu(), cpu.generate(PROMPT, **kw)
    if mode == "w4a16":
        assert torch.equal(out_gpu, out_cpu)
    else:
        # W4A4 quantizes each step's activations: a logit difference that the fp32 sums leave can flip a
        # near-tie of this random model's greedy choice, and the sequences then part (seen on H200 after 3-4
        # tokens). So the GPU model reads the CPU's sequence (teacher forcing) and must pick the CPU's token
        # wherever the CPU's choice leads its runner-up by more than the logits' tolerance.
        assert out_gpu.shape == out_cpu.shape
        n = PROMPT.shape[1]
        with torch.no_grad():
            cpu_logits = cpu(out_cpu).logits.float()[:, n - 1:-1]
            gpu_logits = gpu(out_cpu.cuda()).logits.float().cpu()[:, n - 1:-1]
        top2 = cpu_logits.topk(2, dim=-1).values
        clear = (top2[..., 0] - top2[..., 1]) > 0.04 * cpu_logits.abs().amax()
        assert clear.any()
        assert torch.equal(gpu_logits.argmax(-1)[clear], out_cpu[:, n:][clear])


def test_the_readmes_example_runs(export):
    """README.md's "Use in a model" code, on a tiny export, on the CPU (its ``.cuda()`` calls dropped)."""
    import re

    mode, path, _, _ = export
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")) as f:
        code = re.search(r"## Use in a model.*?```python\n(.*?)```", f.read(), re.S).group(1)
    code = code.replace(".cuda()", "").replace('mode="w4a16"', f'mode="{mode}"')
    ns = {"path": path, "prompt_ids": PROMPT}
    exec(code, ns)  # noqa: S102 - our own README
    assert ns["out"].shape[0] == 2 and ns["out"].shape[1] > PROMPT.shape[1]
    assert any(isinstance(m, NVFP4Linear) for m in ns["model"].modules())


# ----------------------------------------------------------------------------------------------------
# More error paths and config forms (each test breaks if its check is removed from the loader or parser)
# ----------------------------------------------------------------------------------------------------


def test_a_model_bias_the_checkpoint_lacks_is_refused(tmp_path):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, attention_bias=True)).to(torch.bfloat16)
    save_modelopt(quantize_model(model), str(tmp_path / "src"))
    p = "model.layers.0.self_attn.q_proj"
    dst = edit_checkpoint(str(tmp_path / "src"), str(tmp_path / "dst"), tensors=drop(f"{p}.bias"))
    with pytest.raises(CheckpointError, match=rf"'{p}.bias': missing"):
        load_modelopt(fresh(dst), dst)


def test_a_quantized_linear_of_another_shape_is_refused(tmp_path):
    qmodel, _ = quantized("w4a16")
    save_modelopt(qmodel, str(tmp_path / "src"))

    def shrink(state):
        state[f"{Q}.weight"] = state[f"{Q}.weight"][:, :64].contiguous()
        state[f"{Q}.weight_scale"] = state[f"{Q}.weight_scale"][:, :8].contiguous()

    dst = edit_checkpoint(str(tmp_path / "src"), str(tmp_path / "dst"), tensors=shrink)
    with pytest.raises(CheckpointError, match=r"128x128 \(out x in\) weight for the model's 128x256"):
        load_modelopt(fresh(dst), dst)


def test_an_export_with_a_layer_lacking_input_scale_is_weight_only(tmp_path):
    qmodel, _ = quantized("w4a4")
    qmodel.model.layers[0].mlp.down_proj.input_scale = None
    save_modelopt(qmodel, str(tmp_path))
    with open(tmp_path / "hf_quant_config.json") as f:
        assert json.load(f)["quantization"]["quant_algo"] == "W4A16_NVFP4"
    assert not any(k.endswith(".input_scale") for k in load_file(str(tmp_path / "model.safetensors")))


def test_config_group_sizes_kv_scheme_and_algo_case():
    base = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    where = "config.json: quantization_config"
    groups = {"a": {"weights": {"group_size": 16}}, "b": {"weights": {"group_size": 32}}}
    with pytest.raises(CheckpointError, match="different group sizes"):
        parse_quant_config(dict(base, config_groups=groups), where)
    cfg = parse_quant_config(dict(base, group_size=16, kv_cache_scheme={"num_bits": 8, "type": "float"}), where)
    assert cfg.kv_cache_quant_algo == "FP8"
    doc = {"quantization": {"quant_algo": "nvfp4", "group_size": 16}}
    assert parse_quant_config(doc, "hf_quant_config.json").quant_algo == "NVFP4"


def test_a_trailing_dot_star_exclude_covers_the_path_itself():
    doc = {"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["model.layers.0.mlp.*"]}}
    cfg = parse_quant_config(doc, "hf_quant_config.json")
    assert cfg.excludes("model.layers.0.mlp") and cfg.excludes("model.layers.0.mlp.down_proj")
    assert not cfg.excludes("model.layers.0.mlpx") and not cfg.excludes("model.layers.1.mlp")


def test_a_fused_tensor_of_the_wrong_row_count_is_refused(tmp_path):
    torch.manual_seed(0)
    save_modelopt(quantize_model(tiny_model("phi3")), str(tmp_path / "src"))
    p = "model.layers.0.self_attn.qkv_proj"

    def cut(state):
        state[f"{p}.weight"] = state[f"{p}.weight"][:256].contiguous()
        state[f"{p}.weight_scale"] = state[f"{p}.weight_scale"][:256].contiguous()

    dst = edit_checkpoint(str(tmp_path / "src"), str(tmp_path / "dst"), tensors=cut)
    with pytest.raises(CheckpointError, match=rf"'{p}.weight': 256 rows"):
        load_modelopt(fresh(dst, "llama"), dst)


def test_a_dense_tensor_of_an_integer_dtype_is_refused(tmp_path):
    qmodel, _ = quantized("w4a16")
    save_modelopt(qmodel, str(tmp_path / "src"))
    dst = edit_checkpoint(str(tmp_path / "src"), str(tmp_path / "dst"),
                          tensors=put("model.norm.weight", torch.ones(128, dtype=torch.int32)))
    with pytest.raises(CheckpointError, match="'model.norm.weight': dtype"):
        load_modelopt(fresh(dst), dst)


# ----------------------------------------------------------------------------------------------------
# Round trips and refusals found by an audit (each test fails without its fix)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_a_split_fused_checkpoint_is_written_again_with_every_parts_scalars(tmp_path, mode):
    """A fused checkpoint loaded into separate modules, then saved: each part's weight_scale_2 (and
    input_scale) is written under its own name (the parts' scalars once shared storage, and the writer's
    tied-weight rule dropped all but the first), so the re-export loads."""
    torch.manual_seed(0)
    phi = tiny_model("phi3")
    scales = {k: pow2(v) for k, v in calibrate_input_scales(phi, lambda m: m(PROMPT)).items()} if mode == "w4a4" else None
    save_modelopt(quantize_model(phi, mode=mode, input_scales=scales), str(tmp_path / "a"))
    llama = load_modelopt(fresh(str(tmp_path / "a"), "llama"), str(tmp_path / "a"), mode=mode)
    attn = llama.model.layers[0].self_attn
    assert attn.q_proj.weight_scale_2.data_ptr() != attn.k_proj.weight_scale_2.data_ptr()  # a part's own
    save_modelopt(llama, str(tmp_path / "b"))
    keys = set(load_file(str(tmp_path / "b" / "model.safetensors")))
    want = {f"{n}.{s}" for n, m in llama.named_modules() if isinstance(m, NVFP4Linear)
            for s in ("weight_scale_2",) + (("input_scale",) if mode == "w4a4" else ())}
    assert want <= keys, sorted(want - keys)[:3]
    again = load_modelopt(fresh(str(tmp_path / "a"), "llama"), str(tmp_path / "b"), mode=mode)
    with torch.no_grad():
        assert torch.equal(again(PROMPT).logits, llama(PROMPT).logits)


def test_a_model_on_the_meta_device_is_refused_by_name_and_left_as_it_was(export):
    _, path, _, _ = export
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(CheckpointError, match="'model.embed_tokens.weight' of the model is on the meta device"):
        load_modelopt(model, path)
    assert {n: type(m) for n, m in model.named_modules()} == before


def test_tied_names_both_in_the_checkpoint_load_when_equal_and_are_refused_when_not(tmp_path):
    torch.manual_seed(0)
    qmodel = quantize_model(tiny_model(tie=True))
    save_modelopt(qmodel, str(tmp_path / "src"))
    emb = "model.embed_tokens.weight"
    edit_checkpoint(str(tmp_path / "src"), str(tmp_path / "same"), tensors=lambda s: s.update({"lm_head.weight": s[emb].clone()}))
    model = load_modelopt(fresh(str(tmp_path / "src")), str(tmp_path / "same"))
    assert torch.equal(model.lm_head.weight, qmodel.lm_head.weight)
    edit_checkpoint(str(tmp_path / "src"), str(tmp_path / "diff"),
                    tensors=lambda s: s.update({"lm_head.weight": s[emb] * 2}))
    model = fresh(str(tmp_path / "src"))
    before = state_bytes(model)
    with pytest.raises(CheckpointError, match=f"'{emb}' and 'lm_head.weight': the model ties them"):
        load_modelopt(model, str(tmp_path / "diff"))
    assert all(torch.equal(before[k], v) for k, v in state_bytes(model).items())


def test_a_sharded_index_that_disagrees_with_its_shards_is_refused_naming_the_tensor(tmp_path):
    qmodel, _ = quantized("w4a16")
    save_modelopt(qmodel, str(tmp_path), max_shard_bytes=40_000)
    index = tmp_path / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    wm = doc["weight_map"]
    moved, first = "model.norm.weight", sorted(set(wm.values()))[0]
    assert wm[moved] != first
    index.write_text(json.dumps({**doc, "weight_map": {**wm, moved: first}}))
    with pytest.raises(CheckpointError, match=f"tensor '{moved}' is mapped to '{first}', which does not hold it"):
        load_modelopt(fresh(str(tmp_path)), str(tmp_path))
    index.write_text(json.dumps({**doc, "weight_map": {k: v for k, v in wm.items() if k != moved}}))
    with pytest.raises(CheckpointError, match=f"tensor '{moved}' is in '.*' but not in model.safetensors.index.json"):
        load_modelopt(fresh(str(tmp_path)), str(tmp_path))
    index.write_text(json.dumps([wm]))
    with pytest.raises(CheckpointError, match="'weight_map' missing or not an object"):
        load_modelopt(fresh(str(tmp_path)), str(tmp_path))


def test_scalars_shared_by_two_nvfp4_layers_are_written_under_each_name(tmp_path):
    """Layers built by from_modelopt take tensors as they are, so two can hold one scalar tensor: the writer's
    tied-weight rule (one tensor, one name) must not apply to an NVFP4Linear's tensors."""
    qmodel, _ = quantized("w4a16")
    mlp = qmodel.model.layers[0].mlp
    mlp.up_proj.weight_scale_2 = mlp.gate_proj.weight_scale_2  # one tensor, two layers
    save_modelopt(qmodel, str(tmp_path))
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"model.layers.0.mlp.gate_proj.weight_scale_2", "model.layers.0.mlp.up_proj.weight_scale_2"} <= keys
    model = load_modelopt(fresh(str(tmp_path)), str(tmp_path))
    with torch.no_grad():
        assert torch.equal(model(PROMPT).logits, qmodel(PROMPT).logits)


def test_an_excluded_top_level_name_does_not_exclude_a_quantized_module_of_that_suffix(tmp_path):
    """save_modelopt writes full names: a top-level unquantized 'proj' (10 rows: no kernel shape) must not
    exclude the quantized 'block.proj' when the export is loaded again."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = torch.nn.Module()
            self.block.proj = torch.nn.Linear(256, 256, bias=False)
            self.proj = torch.nn.Linear(256, 10, bias=False)

        def forward(self, x):
            return self.proj(self.block.proj(x))

    torch.manual_seed(0)
    m = quantize_model(M().to(torch.bfloat16), skip=())
    assert isinstance(m.block.proj, NVFP4Linear) and not isinstance(m.proj, NVFP4Linear)
    save_modelopt(m, str(tmp_path))
    assert read_quant_config(str(tmp_path)).exclude_modules == ["proj"]
    torch.manual_seed(1)
    again = load_modelopt(M().to(torch.bfloat16), str(tmp_path))
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    assert torch.equal(again(x), m(x))
    assert read_quant_config(str(tmp_path)).excludes("block.proj")  # without the model's names: a suffix

"""compressed-tensors NVFP4 checkpoints (llm-compressor's nvfp4-pack-quantized layout) through
nvfp4_gemv.from_pretrained on the CPU: schemes NVFP4 and NVFP4A16 give the bits of the same tensors in
ModelOpt's layout (global scales inverted: the tiny export's scales are powers of two, so exactly),
config_groups targets by class and by ``re:`` pattern, ``ignore`` lists, mixed groups, KV-cache scales,
and each config or tensor it cannot load refused by name."""

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import nvfp4_checkpoints as ckpts  # noqa: E402
import test_modelopt as tm  # noqa: E402
from nvfp4_gemv import CheckpointError, NVFP4Linear, from_pretrained, load_modelopt  # noqa: E402
from nvfp4_gemv.model.compressed_tensors import matches  # noqa: E402

PROMPT = tm.PROMPT
ATTN0 = r"re:.*layers\.0\.self_attn\..*"


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("ct")
    out = {"w4a4": str(root / "w4a4"), "w4a16": str(root / "w4a16"), "skip": str(root / "skip")}
    ckpts.modelopt_export(out["w4a4"], "w4a4")
    ckpts.modelopt_export(out["w4a16"], "w4a16")
    ckpts.modelopt_export(out["skip"], skip=("lm_head", "model.layers.0.self_attn.*"))
    return out


def logits(model):
    with torch.no_grad():
        return model(PROMPT).logits


@pytest.mark.parametrize("scheme, mode", [("NVFP4", "w4a4"), ("NVFP4", "w4a16"), ("NVFP4A16", "w4a16")])
@pytest.mark.parametrize("targets", [("Linear",), (r"re:.*_proj$",)])
def test_a_compressed_tensors_checkpoint_gives_the_modelopt_layouts_bits(exports, tmp_path, scheme, mode, targets):
    src = exports["w4a4"]
    path = ckpts.to_compressed_tensors(src, tmp_path / "ct", activations=scheme == "NVFP4", targets=targets)
    assert not os.path.exists(os.path.join(path, "hf_quant_config.json"))
    model = from_pretrained(path, mode=mode, device="cpu")
    layers = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    assert len(layers) == 14 and all(m.mode == mode for m in layers)
    assert all((m.input_scale is not None) == (scheme == "NVFP4") for m in layers)
    assert torch.equal(logits(model), logits(ckpts.reference(src, mode)))
    kw = dict(max_new_tokens=5, do_sample=False, cache_implementation="static")
    assert torch.equal(model.generate(PROMPT, **kw), ckpts.reference(src, mode).generate(PROMPT, **kw))


def test_the_global_scales_are_inverted(exports, tmp_path):
    path = ckpts.to_compressed_tensors(exports["w4a4"], tmp_path / "ct")
    model = from_pretrained(path, mode="w4a4", device="cpu", fuse=False)
    ref = ckpts.reference(exports["w4a4"], "w4a4")
    q, r = model.model.layers[1].mlp.down_proj, ref.model.layers[1].mlp.down_proj
    assert torch.equal(q.weight_scale_2, r.weight_scale_2) and torch.equal(q.input_scale, r.input_scale)
    assert q.weight_scale_2.item() == 2.0 ** -15  # (1 / weight_global_scale)


def test_an_ignore_list_with_re_patterns_keeps_those_layers_dense(exports, tmp_path):
    src = exports["skip"]
    path = ckpts.to_compressed_tensors(src, tmp_path / "ct", activations=False, ignore=("lm_head", ATTN0))
    model = from_pretrained(path, device="cpu")
    attn = model.model.layers[0].self_attn
    assert type(attn.q_proj) is torch.nn.Linear and isinstance(model.model.layers[1].self_attn.q_proj, NVFP4Linear)
    assert torch.equal(logits(model), logits(ckpts.reference(src, "w4a16")))
    # the same checkpoint whose config targets those layers: refused, naming the layer
    bad = ckpts.to_compressed_tensors(src, tmp_path / "bad", activations=False, ignore=("lm_head",))
    with pytest.raises(CheckpointError, match="'model.layers.0.self_attn.q_proj' is stored unquantized, but .*"
                                              "group 'group_0' targets it"):
        from_pretrained(bad, device="cpu")


def test_mixed_groups_load_in_w4a16_and_name_the_layer_without_input_scales_in_w4a4(exports, tmp_path):
    attn = {"targets": ["re:.*self_attn.*"], "weights": dict(ckpts.NVFP4_ARGS), "input_activations": dict(ckpts.NVFP4_INPUT)}
    mlp = {"targets": ["re:.*mlp.*"], "weights": dict(ckpts.NVFP4_ARGS), "input_activations": None}

    def drop_mlp_inputs(state, qc):
        for k in [k for k in state if ".mlp." in k and k.endswith("input_global_scale")]:
            del state[k]

    path = ckpts.to_compressed_tensors(exports["w4a4"], tmp_path / "ct", groups={"attn": attn, "mlp": mlp},
                                       edit=drop_mlp_inputs)
    model = from_pretrained(path, mode="w4a16", device="cpu")
    assert model.model.layers[0].mlp.up_proj.input_scale is None
    assert model.model.layers[0].self_attn.q_proj.input_scale is not None
    assert torch.equal(logits(model), logits(ckpts.reference(exports["w4a4"], "w4a16")))
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.0.mlp.down_proj.input_global_scale'"):
        from_pretrained(path, mode="w4a4", device="cpu")


def test_kv_cache_scales_of_a_kv_scheme_are_ignored_with_a_warning(exports, tmp_path):
    def add(state, qc):
        state["model.layers.0.self_attn.k_scale"] = torch.tensor([1.0])
        state["model.layers.0.self_attn.v_scale"] = torch.tensor([1.0])

    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    path = ckpts.to_compressed_tensors(exports["w4a4"], tmp_path / "ct", kv_scheme=scheme, edit=add)
    with pytest.warns(RuntimeWarning, match="2 KV-cache scales \\(FP8\\) ignored"):
        model = from_pretrained(path, mode="w4a4", device="cpu")
    assert torch.equal(logits(model), logits(ckpts.reference(exports["w4a4"], "w4a4")))
    path = ckpts.to_compressed_tensors(exports["w4a4"], tmp_path / "nokv", edit=add)
    with pytest.raises(CheckpointError, match="'model.layers.0.self_attn.k_scale': a KV-cache scale"):
        from_pretrained(path, device="cpu")


def _weights(**kw):
    return lambda state, qc: qc["config_groups"]["group_0"]["weights"].update(kw)


def _qc(**kw):
    return lambda state, qc: qc.update(kw)


def _drop(suffix):
    def f(state, qc):
        del state[f"{tm.Q}.{suffix}"]
    return f


ERRORS = [
    ("8 bits", _weights(num_bits=8), r"group_0.weights.num_bits is 8"),
    ("int", _weights(type="int"), r"group_0.weights.type is 'int'"),
    ("group 32", _weights(group_size=32), r"group_0.weights.group_size is 32"),
    ("channel strategy", _weights(strategy="channel"), r"weights.strategy is 'channel'"),
    ("asymmetric", _weights(symmetric=False), r"weights.symmetric is False"),
    ("another format", _qc(format="float-quantized", config_groups={"group_0": {
        "targets": ["Linear"], "weights": dict(ckpts.NVFP4_ARGS)}}), r"format 'float-quantized'"),
    ("transforms", _qc(transform_config={"config_groups": {"u": {"type": "hadamard"}}}), r"transform_config is set"),
    ("frozen", _qc(quantization_status="frozen"), r"quantization_status is 'frozen'"),
    ("no groups", _qc(config_groups={}), r"config_groups: missing or empty"),
    ("ignore not a list", _qc(ignore="lm_head"), r"\.ignore: expected a list"),
    ("missing global scale", _drop("weight_global_scale"), f"missing tensor '{tm.Q}.weight_global_scale'"),
    ("missing block scales", _drop("weight_scale"), f"missing tensor '{tm.Q}.weight_scale'"),
    ("a zero point", lambda s, qc: s.__setitem__(f"{tm.Q}.weight_zero_point", torch.zeros(128, 16)),
     f"tensor '{tm.Q}.weight_zero_point': not a tensor of an NVFP4 linear"),
    ("ignored yet quantized", _qc(ignore=["lm_head", "re:.*down_proj"]), f"'{tm.Q}' is quantized, but .* ignores it"),
]


@pytest.mark.parametrize("what, edit, match", ERRORS, ids=[e[0] for e in ERRORS])
def test_a_config_or_tensor_it_cannot_load_is_refused_by_name(exports, tmp_path, what, edit, match):
    path = ckpts.to_compressed_tensors(exports["w4a4"], tmp_path / "ct", edit=edit)
    with pytest.raises(CheckpointError, match=match):
        from_pretrained(path, mode="w4a4", device="cpu")


def test_nvfp4a16_in_mode_w4a4_and_load_modelopt_are_refused_with_the_way(exports, tmp_path):
    path = ckpts.to_compressed_tensors(exports["w4a4"], tmp_path / "ct", activations=False)
    with pytest.raises(CheckpointError, match="'NVFP4A16' has no input scales"):
        from_pretrained(path, mode="w4a4", device="cpu")
    with pytest.raises(CheckpointError, match="'compressed-tensors'.*nvfp4_gemv.from_pretrained"):
        load_modelopt(tm.fresh(exports["w4a4"]), path)


def test_target_matching_follows_compressed_tensors():
    lin = torch.nn.Linear(2, 2)
    assert matches("model.layers.0.mlp.down_proj", lin, "Linear") and matches("x", lin, "Module")
    assert matches("model.layers.0.mlp.down_proj", lin, r"re:.*mlp\.down_proj")
    assert not matches("model.layers.0.mlp.down_proj", lin, r"re:mlp\.down_proj")  # re.match: from the start
    assert matches("model.layers.0.mlp.down_proj_x", lin, r"re:.*down_proj")  # ... not to the end
    assert matches("lm_head", lin, "lm_head") and not matches("model.lm_head", lin, "lm_head")

"""The committed producer fixtures (tests/fixtures/checkpoints/, built by tools/make_fixtures.py with
nvidia-modelopt and llm-compressor): that each is whole and in its producer's format, and that its references
follow from its tensors. CPU only, no producer installed; a reference of its own here (plain transformers,
weights dequantized by this file), independent of tools/fixtures_common.py that wrote the references."""

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from safetensors.torch import load_file  # noqa: E402

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "checkpoints")
# name: (format, scheme, W4A4)
FIXTURES = {
    "modelopt-nvfp4": ("modelopt", "NVFP4", True),
    "modelopt-w4a16": ("modelopt", "W4A16_NVFP4", False),
    "modelopt-nvfp4-awq": ("modelopt", "NVFP4_AWQ", True),
    "modelopt-nvfp4-fp8kv": ("modelopt", "NVFP4", True),
    "modelopt-nvfp4-sharded": ("modelopt", "NVFP4", True),
    "ct-nvfp4": ("compressed-tensors", "NVFP4", True),
    "ct-nvfp4a16": ("compressed-tensors", "NVFP4A16", False),
}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
CT_IGNORED = {"model.layers.1.mlp.down_proj"}  # by the recipe's "re:" pattern
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
BUDGET = 3 * 1024 * 1024


def fixture(name):
    path = os.path.join(HERE, name)
    with open(os.path.join(path, "fixture.json")) as f:
        meta = json.load(f)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    return path, meta, config


def tensors(path):
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.exists(index):
        return load_file(os.path.join(path, "model.safetensors"))
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    out = {}
    for shard in sorted(set(weight_map.values())):
        part = load_file(os.path.join(path, shard))
        assert all(weight_map[k] == shard for k in part), f"{shard} holds keys the index puts elsewhere"
        out.update(part)
    assert set(out) == set(weight_map)
    return out


def linear_shapes(config):
    """{module name: (out, in)} of every linear inside the decoder layers."""
    h, i, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    dims = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    return {f"model.layers.{n}.{lin}": dims[lin] for n in range(config["num_hidden_layers"]) for lin in LINEARS}


def expected_quantized(name, config):
    names = set(linear_shapes(config))
    return names - CT_IGNORED if name.startswith("ct-") else names


# ----------------------------------------------------------------------------------------------------
# Integrity and format
# ----------------------------------------------------------------------------------------------------


def test_every_fixture_is_there_and_small():
    assert sorted(d for d in os.listdir(HERE) if os.path.isdir(os.path.join(HERE, d))) == sorted(FIXTURES)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(HERE) for f in fs)
    assert total < BUDGET, f"fixtures take {total} bytes"


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixture_json(name):
    path, meta, config = fixture(name)
    fmt, scheme, w4a4 = FIXTURES[name]
    assert meta["name"] == name and meta["format"] == fmt and meta["scheme"] == scheme
    producer = {"modelopt": "nvidia-modelopt", "compressed-tensors": "llmcompressor"}[fmt]
    assert meta["producer"]["name"] == producer and meta["producer"]["version"]
    assert meta["producer"]["packages"][producer] == meta["producer"]["version"]
    assert sorted(meta["files"]) == sorted(os.listdir(path))
    assert sorted(meta["quantized_modules"]) == sorted(expected_quantized(name, config))
    ref = load_file(os.path.join(path, "reference.safetensors"))
    assert sorted(meta["reference"]) == sorted(ref)
    want = {"input_ids", "logits_w4a16_fp32", "logits_w4a16_bf16", "greedy_tokens_fp32", "greedy_tokens_bf16"}
    assert set(ref) == want | ({"logits_w4a4_fp32", "greedy_tokens_w4a4_fp32"} if w4a4 else set())
    b, t = ref["input_ids"].shape
    v = config["vocab_size"]
    assert ref["input_ids"].dtype == torch.int64 and (b, t) == (2, 8)
    for k, dtype in (("logits_w4a16_fp32", torch.float32), ("logits_w4a16_bf16", torch.bfloat16),
                     ("logits_w4a4_fp32", torch.float32)):
        if k in ref:
            assert ref[k].dtype == dtype and ref[k].shape == (b, t, v), k
    for k in ref:
        if k.startswith("greedy"):
            assert ref[k].dtype == torch.int64 and ref[k].shape == (b, t + 8)
            assert torch.equal(ref[k][:, :t], ref["input_ids"])
    # the producers' own quantized models in memory agreed with the references when they were written
    for k, val in meta["checks"].items():
        if k.endswith("_minus_reference") or "_forward_minus_" in k:
            assert val is not None and val < 1e-4, (k, val)


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_quant_config(name):
    path, meta, config = fixture(name)
    fmt, scheme, w4a4 = FIXTURES[name]
    qc = config["quantization_config"]
    if fmt == "modelopt":
        with open(os.path.join(path, "hf_quant_config.json")) as f:
            hf = json.load(f)
        assert hf["producer"] == {"name": "modelopt", "version": meta["producer"]["version"]}
        q = hf["quantization"]
        assert q["quant_algo"] == scheme and q["group_size"] == 16 and "lm_head" in q["exclude_modules"]
        assert q["kv_cache_quant_algo"] == ("FP8" if name.endswith("fp8kv") else None)
        assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == scheme
    else:
        assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "nvfp4-pack-quantized"
        assert set(qc["ignore"]) == {"lm_head"} | CT_IGNORED
        (group,) = qc["config_groups"].values()
        assert group["format"] == "nvfp4-pack-quantized" and group["targets"] == ["Linear"]
        for args in [group["weights"]] + ([group["input_activations"]] if w4a4 else []):
            got = (args["num_bits"], args["type"], args["strategy"], args["group_size"])
            assert got == (4, "float", "tensor_group", 16)
        assert (group["input_activations"] is not None) == w4a4


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_tensor_formats(name):
    path, meta, config = fixture(name)
    fmt, scheme, w4a4 = FIXTURES[name]
    t = tensors(path)
    shapes = linear_shapes(config)
    quantized = expected_quantized(name, config)
    if name.endswith("sharded"):
        with open(os.path.join(path, "model.safetensors.index.json")) as f:
            assert len(set(json.load(f)["weight_map"].values())) > 1
    packed, global_scale, input_scale = {"modelopt": ("weight", "weight_scale_2", "input_scale"),
                                         "compressed-tensors": ("weight_packed", "weight_global_scale",
                                                                "input_global_scale")}[fmt]
    scalar = () if fmt == "modelopt" else (1,)
    used = set()
    for p, (n, k) in shapes.items():
        if p not in quantized:
            assert t[p + ".weight"].dtype == torch.bfloat16 and t[p + ".weight"].shape == (n, k)
            used.add(p + ".weight")
            continue
        assert n % 128 == 0 and k % 64 == 0, p
        w, s, g = t[f"{p}.{packed}"], t[f"{p}.weight_scale"], t[f"{p}.{global_scale}"]
        assert w.dtype == torch.uint8 and w.shape == (n, k // 2), p
        assert s.dtype == torch.float8_e4m3fn and s.shape == (n, k // 16), p
        assert g.dtype == torch.float32 and g.shape == scalar and g.item() > 0, p
        assert torch.isfinite(s.float()).all() and (s.float() >= 0).all(), p
        used |= {f"{p}.{packed}", f"{p}.weight_scale", f"{p}.{global_scale}"}
        if w4a4:
            a = t[f"{p}.{input_scale}"]
            assert a.dtype == torch.float32 and a.shape == scalar and a.item() > 0, p
            used.add(f"{p}.{input_scale}")
        else:
            assert f"{p}.{input_scale}" not in t, p
        if f"{p}.pre_quant_scale" in t:
            pqs = t[f"{p}.pre_quant_scale"]
            assert pqs.shape == (k,) and pqs.dtype == torch.bfloat16 and (pqs > 0).all(), p
            used.add(f"{p}.pre_quant_scale")
    if name.endswith("awq"):
        assert any(k.endswith(".pre_quant_scale") for k in t), "an AWQ checkpoint with no pre_quant_scale left"
    kv = {k for k in t if k.endswith((".k_scale", ".v_scale"))}
    assert bool(kv) == name.endswith("fp8kv")
    for k in kv:
        assert t[k].dtype == torch.float32 and t[k].shape == () and t[k].item() > 0
    h, v = config["hidden_size"], config["vocab_size"]
    for k in ("model.embed_tokens.weight", "lm_head.weight"):
        assert t[k].dtype == torch.bfloat16 and t[k].shape == (v, h)
    rest = set(t) - used - kv
    assert all(k.endswith("norm.weight") or k in ("model.embed_tokens.weight", "lm_head.weight") for k in rest), rest
    assert all(t[k].dtype == torch.bfloat16 for k in rest)


# ----------------------------------------------------------------------------------------------------
# The references follow from the tensors
# ----------------------------------------------------------------------------------------------------


def dequantized_state(name, path, config):
    """The checkpoint as a plain float32 state dict, quantized weights decoded (code * scale * global, or
    / global for compressed-tensors; low nibble first); and {module: (pre_quant_scale or None, ("modelopt" |
    "ct", its input scale) or None)} for the input hooks."""
    fmt = FIXTURES[name][0]
    t = tensors(path)
    table = torch.tensor(E2M1 + [-x for x in E2M1])
    state, inputs = {}, {}
    for p in linear_shapes(config):
        if p not in expected_quantized(name, config):
            continue
        if fmt == "modelopt":
            kind, packed, g = "modelopt", t.pop(p + ".weight"), t.pop(p + ".weight_scale_2").item()
            a = t.pop(p + ".input_scale", None)
        else:
            kind, packed, g = "ct", t.pop(p + ".weight_packed"), 1.0 / t.pop(p + ".weight_global_scale").item()
            a = t.pop(p + ".input_global_scale", None)
        lo, hi = (packed & 15).long(), (packed >> 4).long()
        codes = torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)
        w = table[codes] * t.pop(p + ".weight_scale").float().repeat_interleave(16, dim=1) * g
        state[p + ".weight"] = w
        inputs[p] = (t.pop(p + ".pre_quant_scale", None), None if a is None else (kind, a.reshape(()).float()))
    for k in list(t):
        if k.endswith((".k_scale", ".v_scale")):
            del t[k]
    state.update({k: v.float() for k, v in t.items()})
    return state, inputs


def build(config, state, inputs, dtype, w4a4=False):
    """A transformers model of ``state`` in ``dtype``; each quantized linear's input multiplied by its
    pre_quant_scale (in ``dtype``) and, if ``w4a4``, fake-quantized."""
    cfg = {k: v for k, v in config.items() if k != "quantization_config"}
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg), dtype=dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    for p, (pqs, act) in inputs.items():
        def hook(mod, args, pqs=pqs, act=act):
            x = args[0]
            if pqs is not None:
                x = x * pqs.to(x.dtype)
            if w4a4:
                x = nvfp4_fake_quant(x, *act)
            return (x,)
        model.get_submodule(p).register_forward_pre_hook(hook)
    return model.eval()


def nvfp4_fake_quant(x, kind, scale):
    """16-value blocks along the last dim, nearest e2m1 (ties to even, saturating at 6); the block scale in
    e4m3: ModelOpt: s = e4m3(amax / 6 / input_scale) * input_scale; compressed-tensors:
    s = e4m3(amax / 6 * input_global_scale) / input_global_scale."""
    xb = x.reshape(*x.shape[:-1], -1, 16)
    amax = xb.abs().amax(-1, keepdim=True)
    if kind == "modelopt":
        s = (amax / (6 * scale)).clamp(max=448).to(torch.float8_e4m3fn).float() * scale
        s = torch.where(s < 1e-5, torch.ones_like(s), s)
    else:
        s = (amax / 6 * scale).to(torch.float8_e4m3fn).float()
        s = torch.where(s == 0, torch.full_like(s, 2.0 ** -3), s) / scale
    r = (xb.abs() / s).clamp(max=6)
    grid = torch.tensor(E2M1)
    mid = (grid[1:] + grid[:-1]) / 2
    down, up = torch.bucketize(r, mid), torch.bucketize(r, mid, right=True)  # differ only on a midpoint
    q = grid[torch.where(down % 2 == 0, down, up)]  # a tie goes to the even code
    return (torch.sign(xb) * q * s).reshape(x.shape)


@torch.no_grad()
def greedy(model, ids, n=8):
    for _ in range(n):
        ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=-1)
    return ids


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_references_follow_from_the_tensors(name):
    path, meta, config = fixture(name)
    ref = load_file(os.path.join(path, "reference.safetensors"))
    ids = ref["input_ids"]
    state, inputs = dequantized_state(name, path, config)
    with torch.no_grad():
        m32 = build(config, state, inputs, torch.float32)
        torch.testing.assert_close(m32(input_ids=ids).logits, ref["logits_w4a16_fp32"], rtol=0, atol=1e-4)
        assert torch.equal(greedy(m32, ids), ref["greedy_tokens_fp32"])
        m16 = build(config, state, inputs, torch.bfloat16)
        # bf16 rounding in another transformers version's ops: a few bf16 ulps of a logit (|logit| < 8)
        torch.testing.assert_close(m16(input_ids=ids).logits.float(), ref["logits_w4a16_bf16"].float(), rtol=0,
                                   atol=0.125)
        assert torch.equal(greedy(m16, ids), ref["greedy_tokens_bf16"])
        if FIXTURES[name][2]:
            mq = build(config, state, inputs, torch.float32, w4a4=True)
            # an activation whose scaled value sits on a rounding boundary may round the other way after last-bit
            # differences upstream (another transformers version): a loose max, a tight mean
            diff = (mq(input_ids=ids).logits - ref["logits_w4a4_fp32"]).abs()
            assert diff.max() < 0.05 and diff.mean() < 1e-3, (diff.max().item(), diff.mean().item())
            assert torch.equal(greedy(mq, ids), ref["greedy_tokens_w4a4_fp32"])

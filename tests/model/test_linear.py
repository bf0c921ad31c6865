"""NVFP4Linear's contract (ModelOpt buffer names, the weight recipe, both modes' forward, bad input naming
the tensor, state_dict, dtype moves, torch.compile) and quantize_model / calibrate_input_scales, on the
CPU (the ops' exact references)."""

import pytest
import torch

from nvfp4_gemv import (NVFP4Linear, calibrate_input_scales, dequantize, gemv_reference, input_scale_from,
                        quantize_model, quantize_reference, quantize_weight)
from nvfp4_gemv.model.select import name_matches
from nvfp4_gemv.model.linear import kernel_takes
from nvfp4_gemv.reference import round_to
from sync_free import no_syncs

DTYPES = [torch.bfloat16, torch.float16]


def linear(in_f=128, out_f=256, bias=True, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(in_f, out_f, bias=bias, dtype=dtype)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
        if bias:
            lin.bias.normal_(0, 0.5)
    return lin


def expected_w4a16(mod, x):
    """x @ dequant(w).T in float64, rounded once to x's dtype (+ bias)."""
    wd = dequantize(mod.weight, mod.weight_scale).double()
    res = round_to((x.reshape(-1, mod.in_features).double() @ wd.T) * mod.weight_scale_2.double(), x.dtype)
    if mod.bias is not None:
        res = res + mod.bias.to(x.dtype)
    return res.reshape(*x.shape[:-1], mod.out_features)


def expected_w4a4(mod, x):
    """x quantized with global scale 1 / input_scale, the W4A4 product with alpha = input_scale * ws2."""
    inv = torch.ones(()) / mod.input_scale
    xq, xs = quantize_reference(x.reshape(-1, mod.in_features), inv)
    res = gemv_reference(xq, xs, mod.weight, mod.weight_scale, mod.input_scale * mod.weight_scale_2, x.dtype)
    if mod.bias is not None:
        res = res + mod.bias.to(x.dtype)
    return res.reshape(*x.shape[:-1], mod.out_features)


def same_bytes(a, b):
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def ulps_apart(a, b):
    """|a - b| in units of the last place of the larger magnitude (a, b bf16/fp16)."""
    eps = torch.finfo(a.dtype).eps
    scale = torch.maximum(a.abs(), b.abs()).float().clamp_min(torch.finfo(a.dtype).tiny)
    return ((a.float() - b.float()).abs() / (scale * eps)).max().item()


# ----------------------------------------------------------------------------------------------------
# The module's buffers and the recipe
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
def test_buffers_have_the_modelopt_names_dtypes_and_shapes(bias):
    mod = NVFP4Linear.from_linear(linear(128, 256, bias=bias), input_scale=0.01)
    assert (mod.in_features, mod.out_features, mod.mode) == (128, 256, "w4a16")
    assert mod.weight.dtype == torch.uint8 and mod.weight.shape == (256, 64)
    assert mod.weight_scale.dtype == torch.float8_e4m3fn and mod.weight_scale.shape == (256, 8)
    assert mod.weight_scale_2.dtype == torch.float32 and mod.weight_scale_2.dim() == 0
    assert mod.input_scale.dtype == torch.float32 and mod.input_scale.dim() == 0
    assert mod.input_scale.item() == pytest.approx(0.01)
    expected = ["weight", "weight_scale", "weight_scale_2", "input_scale"] + (["bias"] if bias else [])
    assert list(mod.state_dict()) == expected
    assert list(mod.parameters()) == []


def test_from_linear_without_input_scale_has_none():
    mod = NVFP4Linear.from_linear(linear())
    assert mod.input_scale is None and "input_scale" not in mod.state_dict()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_from_linear_follows_the_weight_recipe(dtype):
    lin = linear(dtype=dtype)
    mod = NVFP4Linear.from_linear(lin)
    q, s, ws2 = quantize_weight(lin.weight)
    assert torch.equal(mod.weight, q) and torch.equal(mod.weight_scale.view(torch.uint8), s.view(torch.uint8))
    assert mod.weight_scale_2.item() == ws2.item()
    assert ws2.item() == torch.tensor(lin.weight.detach().float().abs().max().item() / 2688, dtype=torch.float32).item()
    assert torch.equal(mod.bias, lin.bias.detach()) and mod.bias.dtype == dtype


def test_from_linear_w4a4_needs_an_input_scale():
    with pytest.raises(ValueError, match="'input_scale' is required for mode 'w4a4'"):
        NVFP4Linear.from_linear(linear(), mode="w4a4")


@pytest.mark.parametrize("in_f, out_f", [(96, 128), (128, 64), (128, 192), (16, 128)])
def test_from_linear_rejects_shapes_the_kernels_do_not_take(in_f, out_f):
    with pytest.raises(ValueError, match="'linear'.*kernels do not take"):
        NVFP4Linear.from_linear(torch.nn.Linear(in_f, out_f))


def test_from_linear_rejects_non_finite_weights():
    lin = linear()
    with torch.no_grad():
        lin.weight[3, 5] = float("inf")
    with pytest.raises(ValueError, match="'linear.weight' has non-finite"):
        NVFP4Linear.from_linear(lin)


@pytest.mark.parametrize("bad, exc, match", [
    (dict(linear=torch.nn.Conv1d(1, 1, 1)), TypeError, "'linear'"),
    (dict(mode="w8a8"), ValueError, "'mode'"),
    (dict(input_scale="0.1"), TypeError, "'input_scale'"),
    (dict(input_scale=torch.ones(2)), ValueError, "'input_scale'"),
    (dict(input_scale=True), TypeError, "'input_scale'.*got bool"),
    (dict(input_scale=0.0), ValueError, "'input_scale'.*positive finite"),
    (dict(input_scale=-0.01), ValueError, "'input_scale'.*positive finite"),
    (dict(input_scale=float("nan")), ValueError, "'input_scale'.*positive finite"),
    (dict(input_scale=float("inf")), ValueError, "'input_scale'.*positive finite"),
])
def test_from_linear_bad_arguments_name_the_argument(bad, exc, match):
    args = dict(linear=linear(), mode="w4a16", input_scale=None) | bad
    with pytest.raises(exc, match=match):
        NVFP4Linear.from_linear(args.pop("linear"), **args)


@pytest.mark.parametrize("in_f, out_f, ok", [(64, 128, True), (4096, 6144, True), (32768, 128, True),
                                             (32832, 128, False), (64, 100, False), (80, 128, False)])
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_kernel_takes_follows_the_ops_validation(in_f, out_f, ok, mode):
    assert kernel_takes(in_f, out_f, mode) is ok


# ----------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(1,), (5,), (2, 3), ()])
def test_w4a16_forward_is_x_times_the_dequantized_weight(dtype, bias, lead):
    mod = NVFP4Linear.from_linear(linear(bias=bias))
    x = torch.randn(*lead, 128, dtype=dtype)
    out = mod(x)
    assert out.dtype == dtype and out.shape == (*lead, 256)
    assert ulps_apart(out, expected_w4a16(mod, x)) <= 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(1,), (7,), (2, 3)])
def test_w4a4_forward_quantizes_x_with_the_inverse_input_scale(dtype, bias, lead):
    x = torch.randn(*lead, 128, dtype=dtype)
    mod = NVFP4Linear.from_linear(linear(bias=bias), mode="w4a4", input_scale=input_scale_from(x))
    out = mod(x)
    assert out.dtype == dtype and out.shape == (*lead, 256)
    assert torch.equal(out, expected_w4a4(mod, x))
    # and it is close to the dense product (the quantization of x and w)
    dense = x.float() @ dequantize(mod.weight, mod.weight_scale, mod.weight_scale_2).T
    dense = dense + (mod.bias.float() if bias else 0)
    assert (out.float() - dense).abs().max() < 0.2 * dense.abs().max()


@pytest.fixture
def w4a4_via_w4a16(monkeypatch):
    """Mode "w4a4" from 17 tokens through quantize_dequantized and the W4A16 op; records which quantizer ran."""
    import nvfp4_gemv.model.linear as lin

    calls = []
    monkeypatch.setattr(lin, "W4A4_VIA_W4A16_FROM", 17)
    for name in ("quantize", "quantize_dequantized"):
        real = getattr(lin, name)
        monkeypatch.setattr(lin, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 16, 17, 32, 33, 200])
def test_w4a4_from_the_threshold_is_the_w4a16_op_on_the_quantized_values(w4a4_via_w4a16, dtype, n):
    """The same exact value either way (the CPU references sum exact products in float64), so the results are
    equal bit for bit; the quantizer that ran says which way it went."""
    x = torch.randn(n, 128, dtype=dtype) * 3
    mod = NVFP4Linear.from_linear(linear(), mode="w4a4", input_scale=input_scale_from(x))
    assert torch.equal(mod(x), expected_w4a4(mod, x))
    assert w4a4_via_w4a16 == ["quantize_dequantized" if n >= 17 else "quantize"]


@pytest.mark.parametrize("dynamic", [False, True])
def test_w4a4_via_w4a16_compiles_fullgraph_with_the_same_result(w4a4_via_w4a16, dynamic):
    torch._dynamo.reset()
    mod = NVFP4Linear.from_linear(linear(), mode="w4a4", input_scale=0.004)
    compiled = torch.compile(lambda x: mod(x * 2), fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for n in (3, 20):
        x = torch.randn(n, 128, dtype=torch.bfloat16)
        assert torch.equal(compiled(x), expected_w4a4(mod, x * 2))


def test_w4a4_forward_uses_the_precomputed_scalars():
    mod = NVFP4Linear.from_linear(linear(), mode="w4a4", input_scale=0.003)
    assert mod._inv_input_scale.item() == (torch.ones(()) / torch.tensor(0.003)).item()
    assert mod._alpha.item() == (torch.tensor(0.003) * mod.weight_scale_2).item()
    assert "_alpha" not in mod.state_dict() and "_inv_input_scale" not in mod.state_dict()


def test_zero_tokens_give_an_empty_result():
    mod = NVFP4Linear.from_linear(linear())
    out = mod(torch.empty(0, 3, 128, dtype=torch.bfloat16))
    assert out.shape == (0, 3, 256) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("x, exc, match", [
    (torch.randn(2, 127, dtype=torch.bfloat16), ValueError, r"'x'.*\[\.\.\., 128\]"),
    (torch.randn(2, 128), TypeError, "'x'.*dtype"),
    (torch.randn(2, 128, dtype=torch.bfloat16, device="meta"), ValueError, "'x'.*on cpu"),
    (torch.tensor(1.0, dtype=torch.bfloat16), ValueError, "'x'"),
    ([1.0] * 128, TypeError, "'x'"),
])
def test_bad_input_raises_naming_x(mode, x, exc, match):
    mod = NVFP4Linear.from_linear(linear(), mode=mode, input_scale=0.01)
    with pytest.raises(exc, match=match):
        mod(x)


def test_w4a4_mode_without_input_scale_raises_naming_it():
    mod = NVFP4Linear.from_linear(linear())
    mod.mode = "w4a4"
    with pytest.raises(ValueError, match="'input_scale'"):
        mod(torch.randn(1, 128, dtype=torch.bfloat16))


def test_extra_repr_names_the_shape_and_mode():
    text = repr(NVFP4Linear.from_linear(linear(), mode="w4a4", input_scale=0.1))
    assert "in_features=128, out_features=256, bias=True, mode='w4a4', input_scale=yes" in text


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_compiles_fullgraph_with_the_same_result(mode, dynamic):
    torch._dynamo.reset()
    mod = NVFP4Linear.from_linear(linear(), mode=mode, input_scale=0.004)

    def step(x):
        return torch.nn.functional.silu(mod(x * 2))

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for n in (1, 3):
        x = torch.randn(2, n, 128, dtype=torch.bfloat16)
        assert torch.equal(compiled(x), step(x))


# ----------------------------------------------------------------------------------------------------
# state_dict, from_modelopt, dtype moves
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_state_dict_round_trips_into_an_empty_layer(mode):
    src = NVFP4Linear.from_linear(linear(), mode=mode, input_scale=0.02)
    dst = NVFP4Linear(128, 256, bias=True, mode=mode)  # no input_scale yet: the checkpoint's is adopted
    dst.load_state_dict(src.state_dict())
    for k, v in src.state_dict().items():
        assert same_bytes(dst.state_dict()[k], v), k
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    assert torch.equal(dst(x), src(x))


def test_load_state_dict_refreshes_the_derived_scalars():
    mod = NVFP4Linear.from_linear(linear(), mode="w4a4", input_scale=0.02)
    sd = mod.state_dict()
    sd["input_scale"] = torch.tensor(0.5)
    mod.load_state_dict(sd)
    assert mod._inv_input_scale.item() == 2.0
    assert mod._alpha.item() == (torch.tensor(0.5) * mod.weight_scale_2).item()


def test_reassigning_a_scale_renews_the_derived_scalars():
    """``input_scale`` or ``weight_scale_2`` reassigned (a tensor, or None for input_scale): the scalars
    forward reads follow, and the forward equals a fresh layer's with those scales."""
    mod = NVFP4Linear.from_linear(linear(), mode="w4a4", input_scale=0.02)
    mod.input_scale = torch.tensor(0.5)
    assert mod._inv_input_scale.item() == 2.0
    mod.weight_scale_2 = mod.weight_scale_2 * 2
    assert mod._alpha.item() == (torch.tensor(0.5) * mod.weight_scale_2).item()
    fresh = NVFP4Linear.from_modelopt({n: getattr(mod, n) for n in ("weight", "weight_scale", "weight_scale_2",
                                                                    "input_scale")}, bias=mod.bias, mode="w4a4")
    x = torch.randn(3, mod.in_features, dtype=torch.bfloat16)
    assert torch.equal(mod(x), fresh(x))
    mod.input_scale = None
    assert mod._alpha is None and mod._inv_input_scale is None


def test_load_state_dict_refuses_format_tensors_of_another_dtype_by_name():
    """Module's loader converts by value: e4m3 bytes typed uint8 would load as numbers (0x38 as 56.0)."""
    src = NVFP4Linear.from_linear(linear())
    sd = src.state_dict()
    for key, bad in (("weight_scale", sd["weight_scale"].view(torch.uint8)), ("weight", sd["weight"].view(torch.int8)),
                     ("weight_scale", sd["weight_scale"].to(torch.bfloat16))):
        dst = NVFP4Linear(128, 256, bias=True)
        with pytest.raises(RuntimeError, match=f"'{key}': expected .*got {bad.dtype}") as e:
            dst.load_state_dict({**sd, key: bad})
        assert "Missing key" not in str(e.value)
        assert not dst.get_buffer(key).view(torch.uint8).any()  # left as built (zeros), not loaded as numbers
    dst = NVFP4Linear(128, 256, bias=True)
    dst.load_state_dict({**sd, "weight": sd["weight"].view(torch.float4_e2m1fn_x2)})  # taken as its bytes
    assert same_bytes(dst.weight, src.weight) and same_bytes(dst.weight_scale, src.weight_scale)


def test_load_state_dict_with_a_wrong_shape_fails():
    mod = NVFP4Linear(128, 256)
    sd = NVFP4Linear.from_linear(linear(128, 384, bias=False)).state_dict()
    with pytest.raises(RuntimeError, match="weight"):
        mod.load_state_dict(sd)


def modelopt_tensors(mode="w4a4"):
    src = NVFP4Linear.from_linear(linear(bias=False), input_scale=0.02)
    return dict(src.state_dict()), src


def test_from_modelopt_takes_the_tensors_as_they_are():
    tensors, src = modelopt_tensors()
    mod = NVFP4Linear.from_modelopt(tensors)
    assert mod.mode == "w4a4" and (mod.in_features, mod.out_features) == (128, 256)
    for k in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
        assert getattr(mod, k).data_ptr() == tensors[k].data_ptr(), k
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    src.mode = "w4a4"
    assert torch.equal(mod(x), src(x))


def test_from_modelopt_takes_scalars_of_shape_one_and_a_bias():
    tensors, _ = modelopt_tensors()
    tensors["weight_scale_2"] = tensors["weight_scale_2"].reshape(1)
    tensors["input_scale"] = tensors["input_scale"].reshape(1)
    mod = NVFP4Linear.from_modelopt(tensors, bias=torch.ones(256, dtype=torch.bfloat16))
    assert mod.weight_scale_2.dim() == 0 and mod.input_scale.dim() == 0 and mod.bias.sum().item() == 256


def test_from_modelopt_w4a16_needs_no_input_scale():
    tensors, _ = modelopt_tensors()
    del tensors["input_scale"]
    mod = NVFP4Linear.from_modelopt(tensors, mode="w4a16")
    assert mod.input_scale is None
    with pytest.raises(KeyError, match="missing tensor 'input_scale'"):
        NVFP4Linear.from_modelopt(tensors, mode="w4a4")


@pytest.mark.parametrize("name", ["weight", "weight_scale", "weight_scale_2"])
def test_from_modelopt_missing_tensor_raises_naming_it(name):
    tensors, _ = modelopt_tensors()
    del tensors[name]
    with pytest.raises(KeyError, match=f"missing tensor '{name}'"):
        NVFP4Linear.from_modelopt(tensors)


@pytest.mark.parametrize("name, bad", [
    ("weight", lambda t: t[:, :-1]),
    ("weight", lambda t: t.view(torch.int8)),
    ("weight", lambda t: t.reshape(-1)),
    ("weight_scale", lambda t: t[:-1]),
    ("weight_scale", lambda t: t.view(torch.uint8)),
    ("weight_scale_2", lambda t: t.reshape(1, 1)),
    ("weight_scale_2", lambda t: t.to(torch.bfloat16)),
    ("input_scale", lambda t: t.repeat(2)),
    ("input_scale", lambda t: t.to(torch.float64)),
    ("weight_scale", lambda t: t.to("meta")),
    ("input_scale", lambda t: t.to("meta")),
])
def test_from_modelopt_mis_shaped_or_mis_typed_tensor_raises_naming_it(name, bad):
    tensors, _ = modelopt_tensors()
    tensors[name] = bad(tensors[name])
    with pytest.raises(ValueError, match=f"tensor '{name}'"):
        NVFP4Linear.from_modelopt(tensors)


def test_from_modelopt_rejects_unknown_tensors_and_shapes_the_kernels_do_not_take():
    tensors, _ = modelopt_tensors()
    with pytest.raises(ValueError, match="unknown tensor.*'k_scale'"):
        NVFP4Linear.from_modelopt(dict(tensors, k_scale=torch.tensor(1.0)))
    with pytest.raises(ValueError, match="tensor 'bias'"):
        NVFP4Linear.from_modelopt(tensors, bias=torch.ones(255))
    small = NVFP4Linear.from_linear(linear(bias=False)).state_dict()
    small = {"weight": small["weight"][:64], "weight_scale": small["weight_scale"][:64],
             "weight_scale_2": small["weight_scale_2"]}
    with pytest.raises(ValueError, match="tensor 'weight'.*kernels do not take"):
        NVFP4Linear.from_modelopt(small, mode="w4a16")


@pytest.mark.parametrize("convert", [lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.float(),
                                     lambda m: m.to("cpu", torch.float16)])
def test_dtype_moves_keep_the_format_buffers(convert):
    mod = NVFP4Linear.from_linear(linear(), mode="w4a4", input_scale=0.0123)
    before = {k: v.clone() for k, v in mod.state_dict().items()}
    convert(mod)
    for k in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
        assert getattr(mod, k).dtype == before[k].dtype, k
        assert same_bytes(getattr(mod, k), before[k]), k
    assert mod._alpha.dtype == torch.float32
    mod(torch.randn(1, 128, dtype=torch.bfloat16))


# ----------------------------------------------------------------------------------------------------
# quantize_model, calibrate_input_scales
# ----------------------------------------------------------------------------------------------------


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(128, 256, bias=False, dtype=torch.bfloat16)
        self.block = torch.nn.ModuleDict({"down": torch.nn.Linear(256, 128, dtype=torch.bfloat16),
                                          "odd": torch.nn.Linear(128, 100, dtype=torch.bfloat16)})
        self.lm_head = torch.nn.Linear(128, 256, bias=False, dtype=torch.bfloat16)

    def forward(self, x):
        h = torch.nn.functional.silu(self.up(x))
        h = self.block["down"](h)
        return self.lm_head(h) + self.block["odd"](h).sum(-1, keepdim=True)


def test_quantize_model_replaces_the_linears_the_kernels_take_in_place():
    model = Tiny()
    up = model.up
    assert quantize_model(model) is model
    assert isinstance(model.up, NVFP4Linear) and isinstance(model.block["down"], NVFP4Linear)
    assert isinstance(model.lm_head, torch.nn.Linear)  # skipped by default
    assert isinstance(model.block["odd"], torch.nn.Linear)  # 100 outputs: not a kernel shape
    assert torch.equal(model.up.weight, NVFP4Linear.from_linear(up).weight)
    assert model.up.mode == "w4a16"
    model(torch.randn(2, 128, dtype=torch.bfloat16))


def test_a_failing_quantize_model_names_the_module_and_leaves_the_model_as_it_was():
    model = Tiny()
    with torch.no_grad():
        model.block["down"].weight[1, 2] = float("nan")  # quantized after 'up'
    with pytest.raises(ValueError, match="quantize_model: module 'block.down': .*non-finite"):
        quantize_model(model)
    assert not any(isinstance(m, NVFP4Linear) for m in model.modules())
    with torch.device("meta"):
        meta = Tiny()
    with pytest.raises(ValueError, match="'up.weight' is on the meta device"):
        quantize_model(meta)
    assert not any(isinstance(m, NVFP4Linear) for m in meta.modules())


@pytest.mark.parametrize("skip, kept", [
    ((), []),
    ("lm_head", ["lm_head"]),
    (("down",), ["block.down"]),
    (("block.*",), ["block.down"]),
    (("*up", "lm_head"), ["up", "lm_head"]),
    (("block",), []),  # a suffix matches whole names only, not a parent's (and a warning says so)
])
def test_quantize_model_skips_names_by_suffix_or_glob(skip, kept, recwarn):
    model = quantize_model(Tiny(), skip=skip)
    for name in ("up", "block.down", "lm_head"):
        assert isinstance(model.get_submodule(name), torch.nn.Linear) == (name in kept), name
    said = [str(w.message) for w in recwarn if "match no nn.Linear" in str(w.message)]
    assert said == (["quantize_model: skip pattern(s) ['block'] match no nn.Linear of the model (ignored)"]
                    if skip == ("block",) else [])


def test_quantize_model_warns_of_input_scales_naming_no_quantized_linear():
    with pytest.warns(UserWarning, match=r"input_scales name\(s\) \['lm_head', 'upp'\] no linear being quantized"):
        quantize_model(Tiny(), mode="w4a4", input_scales={"up": 0.01, "block.down": 0.01, "upp": 0.01, "lm_head": 0.01})


def test_name_matching_rules():
    assert name_matches("model.lm_head", ["lm_head"]) and name_matches("lm_head", ["lm_head"])
    assert not name_matches("model.my_lm_head", ["lm_head"])
    assert name_matches("model.layers.3.mlp.down_proj", ["mlp.down_proj"])
    assert name_matches("model.layers.0.self_attn.q_proj", ["model.layers.0.*"])
    assert not name_matches("model.layers.10.self_attn.q_proj", ["model.layers.1.*"])


def test_quantize_model_shares_one_replacement_for_a_shared_linear():
    model = Tiny()
    model.lm_head = model.up
    quantize_model(model, skip=())
    assert model.lm_head is model.up and isinstance(model.up, NVFP4Linear)


def test_quantize_model_w4a4_needs_input_scales_for_every_quantized_linear():
    with pytest.raises(ValueError, match="'input_scales' lacks.*'up'"):
        quantize_model(Tiny(), mode="w4a4")
    with pytest.raises(ValueError, match="'mode'"):
        quantize_model(Tiny(), mode="fp8")


def test_calibrate_then_quantize_w4a4():
    model = Tiny()
    xs = [torch.randn(3, 128, dtype=torch.bfloat16) * s for s in (1, 3, 2)]  # the largest not last
    expect_up = input_scale_from(*xs)
    def chain(m, x):  # the quantized linears' part of the model
        return m.block["down"](torch.nn.functional.silu(m.up(x)))

    dense = [chain(model, x) for x in xs]
    scales = calibrate_input_scales(model, lambda m: [m(x) for x in xs])
    assert set(scales) == {"up", "block.down"}
    assert scales["up"].item() == expect_up.item()
    assert not model.up._forward_pre_hooks  # hooks removed
    quantize_model(model, mode="w4a4", input_scales=scales)
    assert model.up.mode == "w4a4" and model.up.input_scale.item() == expect_up.item()
    for x, d in zip(xs, dense):
        out = chain(model, x).float()
        assert (out - d.float()).norm() < 0.25 * d.float().norm()  # two layers of 4-bit x and w


def test_input_scale_from_is_amax_over_6_times_448():
    a, b = torch.tensor([[1.0, -5.0]]), torch.tensor([2688.0])
    assert input_scale_from(a).item() == pytest.approx(5 / 2688)
    assert input_scale_from(a, b).item() == 1.0
    with pytest.raises(ValueError):
        input_scale_from()


# ----------------------------------------------------------------------------------------------------
# On the GPU (the lead's machine): kernels, no syncs, CUDA graphs
# ----------------------------------------------------------------------------------------------------


def call_without_syncs_and_in_a_graph(mod, x):
    """``mod(x)`` after a warm-up call (compiles, plans), under ``set_sync_debug_mode("error")``; a CUDA graph
    of the call must replay the same result. :return: the result."""
    mod(x)
    with no_syncs():
        out = mod(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = mod(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, out)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("n", [1, 4, 16, 33])
def test_gpu_forward_matches_the_cpu_layer_without_syncs_and_in_a_graph(mode, n):
    cpu = NVFP4Linear.from_linear(linear(4096, 6144), mode=mode, input_scale=0.004)
    gpu = NVFP4Linear.from_linear(linear(4096, 6144).cuda(), mode=mode, input_scale=0.004)
    x = torch.randn(n, 4096, dtype=torch.bfloat16)
    out = call_without_syncs_and_in_a_graph(gpu, x.cuda())
    assert ulps_apart(out.cpu(), cpu(x)) <= 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [17, 32, 33, 200])
def test_gpu_w4a4_via_w4a16_is_within_the_bound_of_the_exact_w4a4_value(w4a4_via_w4a16, monkeypatch, dtype, n):
    """From 17 tokens mode "w4a4" runs the dequantized quantize kernel and the W4A16 kernels (dequantize +
    torch.mm from 129): the result, and the W4A4 op's on the same layer, within half an ulp plus 2^-13 of
    the sum of |terms| of the exact W4A4 value (float64, from the reference's dequantized x); no syncs; a
    graph replays it. No bias: a bias added after the rounding can turn a one-ulp difference of the product
    near a midpoint into several ulps of the sum, which no bound on the product excludes."""
    import nvfp4_gemv.model.linear as lin
    from nvfp4_gemv.quant import quantize_dequantized_reference
    from w4a16_inputs import w4a16_exact, w4a16_violations

    gpu = NVFP4Linear.from_linear(linear(4096, 6144, bias=False).cuda(), mode="w4a4", input_scale=0.004)
    x = torch.randn(n, 4096, dtype=dtype).cuda()
    out = call_without_syncs_and_in_a_graph(gpu, x)
    assert w4a4_via_w4a16[-1] == "quantize_dequantized" and out.dtype == dtype
    xd = quantize_dequantized_reference(x.cpu(), gpu._inv_input_scale.cpu())
    exact, terms = w4a16_exact(xd, gpu.weight, gpu.weight_scale, gpu._alpha)
    bad, msg = w4a16_violations(out, exact, terms)
    assert bad == 0, msg
    monkeypatch.setattr(lin, "W4A4_VIA_W4A16_FROM", None)  # the W4A4 op on the same layer: the same value
    bad, msg = w4a16_violations(gpu(x), exact, terms)
    assert bad == 0 and w4a4_via_w4a16[-1] == "quantize", msg


# ----------------------------------------------------------------------------------------------------
# More argument checks (each test breaks if its check is removed)
# ----------------------------------------------------------------------------------------------------


def test_from_modelopt_takes_a_float4_typed_weight_as_uint8():
    t, _ = modelopt_tensors()
    t["weight"] = t["weight"].view(torch.float4_e2m1fn_x2)
    assert NVFP4Linear.from_modelopt(t).weight.dtype == torch.uint8


def test_from_modelopt_refuses_a_bias_given_twice_or_malformed_and_non_tensors():
    t, _ = modelopt_tensors()
    with pytest.raises(ValueError, match="'bias' given twice"):
        NVFP4Linear.from_modelopt(dict(t, bias=torch.zeros(256)), bias=torch.zeros(256))
    with pytest.raises(ValueError, match="tensor 'bias'"):
        NVFP4Linear.from_modelopt(t, bias=torch.zeros(256, dtype=torch.int32))
    with pytest.raises(ValueError, match="tensor 'bias'.*on"):
        NVFP4Linear.from_modelopt(t, bias=torch.zeros(256, device="meta"))
    with pytest.raises(TypeError, match="tensor 'weight_scale_2'"):
        NVFP4Linear.from_modelopt(dict(t, weight_scale_2=0.5))


def test_moving_and_casting_at_once_moves_the_format_buffers_and_casts_only_bias():
    mod = NVFP4Linear.from_linear(linear(), mode="w4a4", input_scale=0.01)
    mod.to("meta", torch.float16)
    for name in ("weight", "weight_scale", "weight_scale_2", "input_scale", "_alpha", "_inv_input_scale"):
        assert getattr(mod, name).device.type == "meta", name
    assert mod.weight_scale_2.dtype == torch.float32 and mod.bias.dtype == torch.float16


def test_quantize_weight_and_the_constructor_validate_their_arguments():
    with pytest.raises(ValueError, match="argument 'w'"):
        quantize_weight(torch.randn(2, 24))
    with pytest.raises(TypeError, match="argument 'w'"):
        quantize_weight(torch.randint(0, 3, (2, 32)))
    with pytest.raises(ValueError, match="'in_features'"):
        NVFP4Linear(100, 128)


@pytest.mark.parametrize("old", ["_run_alone", "_run_alone_bias"])
def test_a_whole_module_pickled_under_the_older_path_names_loads_and_chooses_its_path(old):
    """torch.save of a whole model before 2026-12-06 names a module's path ``linear._run_alone(_bias)``: the
    name still resolves, and the loaded module chooses its own path (here the packed kernel's)."""
    import pickle

    import nvfp4_gemv.model.linear as linear

    fn = pickle.loads(f"cnvfp4_gemv.model.linear\n{old}\n.".encode())  # how a pickle refers to the function
    lin = torch.nn.Linear(256, 128, bias=old.endswith("bias"), dtype=torch.bfloat16)
    m = NVFP4Linear.from_linear(lin).pack()
    state = dict(m.__dict__, _run=fn)
    new = object.__new__(NVFP4Linear)
    new.__setstate__(state)
    assert new._run is (linear._run_packed_bias if old.endswith("bias") else linear._run_packed)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    assert torch.equal(new(x), m(x))

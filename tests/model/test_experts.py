"""``NVFP4Experts`` (nvfp4_gemv/model/experts.py) on the CPU: the forward against float64 (a fuzz of 300 random
cases, stage by stage, within experts.py's bound), against transformers' own experts module holding the
dequantized weights, whole tiny Qwen3-MoE / Mixtral / Qwen2-MoE / DeepSeek-V3 models (logits, greedy generate),
torch.compile without a graph break, quantize_model / save_modelopt / load_modelopt / from_pretrained
round trips (ModelOpt's per-expert names, bit for bit), compressed-tensors' layout of the same experts,
calibration, and bad inputs named."""

import copy
import json
import os
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from safetensors.torch import load_file, save_file  # noqa: E402

import nvfp4_gemv  # noqa: E402
from nvfp4_gemv import (CheckpointError, NVFP4Experts, NVFP4Linear, TopKRouter, calibrate_expert_input_scales,  # noqa: E402
                        calibrate_input_scales, dequantize, from_pretrained, load_modelopt, quantize_model,
                        save_modelopt)
from nvfp4_gemv.model import experts_forward as experts_mod  # noqa: E402
from nvfp4_gemv.model.experts_forward import _products, grouped_forward, quantize_dequantized_rows  # noqa: E402
from nvfp4_gemv.quant import quantize_dequantized  # noqa: E402
from sync_free import no_syncs  # noqa: E402

PROMPT = torch.tensor([[5, 17, 99, 3, 250, 42], [7, 7, 1, 200, 13, 64]])
GEN = dict(max_new_tokens=6, do_sample=False, cache_implementation="static")
COMMON = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
              max_position_embeddings=64, initializer_range=0.1, pad_token_id=0, bos_token_id=None, eos_token_id=None)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These are many small ops: one thread runs them several times faster than two contending ones."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny(arch, seed=0):
    torch.manual_seed(seed)
    if arch == "qwen3":
        cfg = transformers.Qwen3MoeConfig(**COMMON, intermediate_size=256, moe_intermediate_size=64, head_dim=32,
                                          num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif arch == "mixtral":
        cfg = transformers.MixtralConfig(**COMMON, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(cfg)
    elif arch == "deepseek_v3":  # MLA attention, a shared expert, group-limited sigmoid routing, layer 0 dense
        cfg = transformers.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, intermediate_size=256,
                                            moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2,
                                            n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                                            q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=16,
                                            qk_nope_head_dim=32, v_head_dim=32)
        model = transformers.DeepseekV3ForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2MoeConfig(**COMMON, intermediate_size=256, moe_intermediate_size=64,
                                          shared_expert_intermediate_size=128, num_experts=8, num_experts_per_tok=2)
        model = transformers.Qwen2MoeForCausalLM(cfg)
    return model.to(torch.bfloat16).eval()


def experts_of(model):
    return [m for m in model.modules() if isinstance(m, NVFP4Experts)]


def quantized(arch, mode):
    """(model, dense twin) with every expert and linear the kernels take quantized; w4a4 scales calibrated."""
    model = tiny(arch)
    dense = copy.deepcopy(model)
    scales = None
    if mode == "w4a4":
        def loop(m):
            return m(PROMPT)
        scales = {**calibrate_input_scales(model, loop), **calibrate_expert_input_scales(model, loop)}
    return quantize_model(model, mode=mode, input_scales=scales), dense


def logits(model, prompt=PROMPT):
    with torch.no_grad():
        return model(prompt).logits


# ----------------------------------------------------------------------------------------------------
# float64 references
# ----------------------------------------------------------------------------------------------------


def eff_weights(w, ws, alpha, dtype):
    """Every expert's effective weight as experts.py defines it: dequantize * alpha, rounded to dtype."""
    return torch.stack([dequantize(w[e], ws[e], alpha[e]) for e in range(w.shape[0])]).to(dtype)


def half_ulp(y):
    a = y.abs()
    return (torch.nextafter(a, torch.full_like(a, float("inf"))) - a).double() / 2


def check_bound(y, exact, absum, n, what):
    tol = half_ulp(y) + (n + 2) * 2.0 ** -24 * absum
    bad = (y.double() - exact).abs() > tol
    assert not bad.any(), (f"{what}: {int(bad.sum())} values off the bound, e.g. {y.double()[bad][:3].tolist()} "
                           f"against {exact[bad][:3].tolist()}")


def check_products(xs, ids, valid, route, mats, what):
    """One stage (_products) against float64 with the rounded weights: ulp/2 + (K+2) 2^-24 sum|terms|, on
    the valid slots (the grouped route leaves the others' rows unwritten; the combine drops them)."""
    y = _products(xs, ids, route, *mats)
    w, ws, alpha, x_scale = mats
    xq = quantize_dequantized_rows(xs, x_scale[ids]) if x_scale is not None else xs
    weff = eff_weights(w, ws, alpha, xs.dtype).double()
    exact = torch.zeros(y.shape, dtype=torch.float64)
    absum = torch.zeros(y.shape, dtype=torch.float64)
    for e in ids[valid].unique().tolist():  # (broadcast products: torch's float64 matmul is slow on the CPU)
        sel = valid & (ids == e)
        terms = xq[sel].double().unsqueeze(1) * weff[e].unsqueeze(0)
        exact[sel], absum[sel] = terms.sum(-1), terms.abs().sum(-1)
    check_bound(y[valid], exact[valid], absum[valid], xs.shape[1], what)
    return y


def random_experts(gen, e, h, i, mode, dtype):
    def codes(*shape):
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)

    def scales(*shape):  # e4m3 bytes 0x20..0x57: 2^-4 .. 2^3 and their mantissas
        return torch.randint(0x20, 0x58, shape, generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)

    mod = NVFP4Experts(e, h, i, torch.nn.SiLU(), mode, input_scale=mode == "w4a4")
    mod.gate_up_weight, mod.gate_up_weight_scale = codes(e, 2 * i, h // 2), scales(e, 2 * i, h // 16)
    mod.down_weight, mod.down_weight_scale = codes(e, h, i // 2), scales(e, h, i // 16)
    mod.gate_up_weight_scale_2 = torch.exp2(torch.randint(-12, -3, (e,), generator=gen).float()) * \
        (1 + torch.rand(e, generator=gen))
    mod.down_weight_scale_2 = torch.exp2(torch.randint(-12, -3, (e,), generator=gen).float()) * \
        (1 + torch.rand(e, generator=gen))
    if mode == "w4a4":  # around each input's amax / 2688, some saturating
        mod.gate_up_input_scale = torch.exp2(torch.empty(e).uniform_(-3, 2, generator=gen)) / 2688
        mod.down_input_scale = torch.exp2(torch.empty(e).uniform_(-3, 2, generator=gen)) / 2688 * 50
    return mod


def one_case(gen, dtype_choice=None):
    e = int(torch.randint(1, 13, (1,), generator=gen))
    k = int(torch.randint(1, min(e, 8) + 1, (1,), generator=gen))
    t = int(torch.randint(1, 65, (1,), generator=gen))
    h = 16 * int(torch.randint(1, 9, (1,), generator=gen))
    i = 16 * int(torch.randint(1, 5, (1,), generator=gen))
    dtype = dtype_choice or (torch.bfloat16 if torch.rand(1, generator=gen) < 0.7 else torch.float16)
    mode = "w4a4" if torch.rand(1, generator=gen) < 0.4 else "w4a16"
    mod = random_experts(gen, e, h, i, mode, dtype)
    x = torch.randn(t, h, generator=gen).to(dtype)
    idx = torch.randint(0, e, (t, k), generator=gen)  # duplicates within a token allowed
    odd = torch.rand(t, k, generator=gen) < 0.08  # sentinels (E, transformers' EP mark) and out-of-range ids
    idx = torch.where(odd, torch.tensor([e, -1, e + 3])[torch.randint(0, 3, (t, k), generator=gen)], idx)
    wdt = torch.float32 if torch.rand(1, generator=gen) < 0.5 else dtype
    wts = torch.rand(t, k, generator=gen).to(wdt)
    return mod, x, idx, wts


# ----------------------------------------------------------------------------------------------------
# The forward against float64
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantize_dequantized_rows_is_the_op_row_by_row(dtype):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(40, 64, generator=gen) * torch.exp2(torch.randint(-8, 8, (40, 1), generator=gen).float())).to(dtype)
    x[3] = 0
    x[5, :16] = 0
    gs = torch.exp2(torch.empty(40).uniform_(-4, 12, generator=gen))
    gs[7] = 1e30  # saturating scales
    got = quantize_dequantized_rows(x, gs)
    for r in range(40):
        assert torch.equal(got[r:r + 1], quantize_dequantized(x[r:r + 1], gs[r].reshape(1))), r


@pytest.mark.parametrize("chunk", range(10))
def test_fuzz_each_stage_within_its_bound_of_float64(chunk):
    """300 random cases (30 a chunk): tokens 1..64, 1..12 experts, top-k 1..8 with duplicate experts,
    out-of-range and sentinel ids, experts no token hits, H 16..128, I 16..64, bf16/fp16, both modes, both
    routes (slots, grouped), fp32 or x-dtype routing weights. Each product within ulp/2 + (K+2) 2^-24
    sum|terms| of float64 (rounded weights), the combine within its bound, and grouped_forward equal to the
    stages composed."""
    gen = torch.Generator().manual_seed(1000 + chunk)
    for case in range(30):
        mod, x, idx, wts = one_case(gen)
        t, k = idx.shape
        e, h = mod.num_experts, mod.hidden_dim
        what = f"chunk {chunk} case {case} (T={t}, k={k}, E={e}, H={h}, I={mod.intermediate_dim}, {x.dtype}, {mod.mode})"
        gu = (mod.gate_up_weight, mod.gate_up_weight_scale, mod._gate_up_alpha, mod._gate_up_x_scale)
        dn = (mod.down_weight, mod.down_weight_scale, mod._down_alpha, mod._down_x_scale)
        flat = idx.reshape(-1)
        valid = (flat >= 0) & (flat < e)
        ids = torch.where(valid, flat, 0)
        key = torch.where(valid, ids, e)
        order = torch.argsort(key, stable=True)
        grouped = (order, torch.searchsorted(key[order], torch.arange(e), right=True).int(), torch.argsort(order))
        xs = x.unsqueeze(1).expand(t, k, h).reshape(-1, h)
        used = grouped if t * k >= e and x.dtype == torch.bfloat16 else None
        for route in ([None, grouped] if x.dtype == torch.bfloat16 else [None]):
            g = check_products(xs, ids, valid, route, gu, f"{what} gate_up route {route is not None}")
            i = g.shape[1] // 2
            hid = torch.nn.functional.silu(g[:, :i]) * g[:, i:]
            d = check_products(hid, ids, valid, route, dn, f"{what} down route {route is not None}")
            if route is used:
                d_used = d
        out = grouped_forward(x, idx, wts, gu, dn, mod.act_fn)
        c = d_used.double() * wts.reshape(-1, 1).double() * valid.reshape(-1, 1)
        exact = c.reshape(t, k, h).sum(1)
        check_bound(out, exact, c.abs().reshape(t, k, h).sum(1), k, f"{what} combine")
        cf = torch.where(valid.unsqueeze(1), d_used.float() * wts.reshape(-1, 1).float(), 0.0)
        assert torch.equal(out, cf.reshape(t, k, h).sum(1).to(x.dtype)), what
        if case == 0:
            assert torch.equal(mod(x, idx, wts), out), what


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_slot_path_works_in_chunks_of_bounded_temporaries(monkeypatch, dtype):
    """The slot path dequantizes in chunks of slots whose temporaries (about 12 bytes a weight) stay under
    SLOT_PATH_BYTES: an fp16 prefill would otherwise hold [slots, N, K] fp32 at once. Chunked, the result is
    the one-chunk result bit for bit."""
    mod = random_experts(torch.Generator().manual_seed(5), 4, 64, 32, "w4a16", dtype)
    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(6)).to(dtype)
    idx = torch.randint(0, 4, (24, 3), generator=torch.Generator().manual_seed(7))
    wts = torch.rand(24, 3, generator=torch.Generator().manual_seed(8))
    gu = (mod.gate_up_weight, mod.gate_up_weight_scale, mod._gate_up_alpha, mod._gate_up_x_scale)
    dn = (mod.down_weight, mod.down_weight_scale, mod._down_alpha, mod._down_x_scale)
    ids = idx.reshape(-1)
    xs = x.unsqueeze(1).expand(24, 3, 64).reshape(-1, 64)
    whole = experts_mod._products(xs, ids, None, *gu)
    sizes = []
    real = experts_mod._weights
    monkeypatch.setattr(experts_mod, "_weights", lambda w, *a: sizes.append(w.shape[0]) or real(w, *a))
    n, k = 2 * 32, 64  # gate_up rows, K
    monkeypatch.setattr(experts_mod, "SLOT_PATH_BYTES", 12 * n * k * 5)  # five slots a chunk
    assert torch.equal(experts_mod._products(xs, ids, None, *gu), whole)
    assert sizes == [5] * 14 + [2], sizes  # 72 slots
    assert max(sizes) * 12 * n * k <= experts_mod.SLOT_PATH_BYTES
    monkeypatch.setattr(experts_mod, "SLOT_PATH_BYTES", 1)  # a budget below one slot: one slot a chunk
    sizes.clear()
    assert torch.equal(experts_mod._products(xs, ids, None, *gu), whole)
    assert sizes == [1] * 72
    if dtype == torch.float16:  # fp16 never takes the grouped path, however many slots: bounded chunks
        values = []
        monkeypatch.setattr(experts_mod, "_weights", lambda w, *a: values.append(w.numel() * 2) or real(w, *a))
        monkeypatch.setattr(experts_mod, "SLOT_PATH_BYTES", 12 * n * k * 8)
        out = grouped_forward(x, idx, wts, gu, dn, mod.act_fn)
        assert out.dtype == torch.float16 and len(values) > 2
        assert max(values) * 12 <= experts_mod.SLOT_PATH_BYTES, values  # (two values a byte of w)


@pytest.mark.parametrize("arch", ["qwen3", "mixtral"])
@pytest.mark.parametrize("tokens", [1, 3, 40])  # slot path; grouped path from E slots on
def test_forward_is_transformers_experts_with_the_dequantized_weights(arch, tokens):
    model = tiny(arch)
    ref = model.model.layers[0].mlp.experts
    mod = NVFP4Experts.from_experts(ref)
    with torch.no_grad():
        ref.gate_up_proj.copy_(eff_weights(mod.gate_up_weight, mod.gate_up_weight_scale, mod.gate_up_weight_scale_2,
                                           torch.bfloat16))
        ref.down_proj.copy_(eff_weights(mod.down_weight, mod.down_weight_scale, mod.down_weight_scale_2, torch.bfloat16))
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 128, generator=gen).bfloat16()
    router = model.model.layers[0].mlp.gate
    with torch.no_grad():
        _, wts, idx = router(x)
        got, want = mod(x, idx, wts), ref(x, idx, wts)
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    # transformers rounds each expert's weighted output to bf16 (and adds in bf16): within 2 bf16 ulps
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())


def test_routing_weights_multiply_inside_and_bad_ids_add_nothing():
    mod = random_experts(torch.Generator().manual_seed(0), 4, 32, 16, "w4a16", torch.bfloat16)
    x = torch.randn(3, 32).bfloat16()
    idx = torch.tensor([[1, 4], [2, 2], [-1, 0]])  # 4 = E (transformers' EP sentinel), -1 out of range
    one = mod(x, idx, torch.ones(3, 2))
    assert torch.equal(mod(x, idx, torch.zeros(3, 2)), torch.zeros(3, 32, dtype=torch.bfloat16))
    assert torch.equal(mod(x[:1], idx[:1, :1], torch.ones(1, 1)), one[:1])  # the sentinel adds nothing
    half = mod(x, idx, torch.full((3, 2), 0.5))
    assert torch.allclose(half.float() * 2, one.float(), rtol=2 ** -7, atol=1e-6)
    assert mod(x[:0], idx[:0], torch.ones(0, 2)).shape == (0, 32)


# ----------------------------------------------------------------------------------------------------
# Whole models
# ----------------------------------------------------------------------------------------------------


class FakeQuantExperts(torch.nn.Module):
    """The reference: transformers' loop over slots in float64 with the effective (dequantized, rounded)
    weights; in w4a4 each slot's x quantized with its expert's input scale first (experts.py's definition)."""

    def __init__(self, q):
        super().__init__()
        self.q = q

    def forward(self, x, idx, wts):
        q, out = self.q, torch.zeros(x.shape, dtype=torch.float64)
        gu = eff_weights(q.gate_up_weight, q.gate_up_weight_scale, q._gate_up_alpha, x.dtype).double()
        dn = eff_weights(q.down_weight, q.down_weight_scale, q._down_alpha, x.dtype).double()
        for t in range(x.shape[0]):
            for j in range(idx.shape[1]):
                e = int(idx[t, j])
                xt = x[t:t + 1]
                if q._gate_up_x_scale is not None:
                    xt = quantize_dequantized(xt, q._gate_up_x_scale[e].reshape(1))
                g = (xt.double() @ gu[e].T).to(x.dtype)
                i = g.shape[1] // 2
                h = q.act_fn(g[:, :i]) * g[:, i:]
                if q._down_x_scale is not None:
                    h = quantize_dequantized(h, q._down_x_scale[e].reshape(1))
                out[t] += ((h.double() @ dn[e].T).to(x.dtype).double() * float(wts[t, j]))[0]
        return out.to(x.dtype)


def twin(qmodel):
    ref = copy.deepcopy(qmodel)
    for name, m in list(ref.named_modules()):
        if isinstance(m, NVFP4Experts):
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent), child, FakeQuantExperts(m))
    return ref


@pytest.mark.parametrize("arch", ["qwen3", "mixtral", "deepseek_v3"])
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_model_logits_and_greedy_tokens_match_the_dequantized_model(arch, mode):
    qmodel, _ = quantized(arch, mode)
    moe_layers = 1 if arch == "deepseek_v3" else 2  # (DeepSeek-V3's first layer is dense: first_k_dense_replace)
    assert len(experts_of(qmodel)) == moe_layers and all(m.mode == mode for m in experts_of(qmodel))
    ref = twin(qmodel)
    if mode == "w4a16":  # also transformers' own experts module holding the dequantized weights
        for name, m in list(ref.named_modules()):
            if isinstance(m, FakeQuantExperts):
                own = getattr(tiny(arch).get_submodule(name.rpartition(".")[0]), "experts")
                with torch.no_grad():
                    own.gate_up_proj.copy_(eff_weights(m.q.gate_up_weight, m.q.gate_up_weight_scale,
                                                       m.q.gate_up_weight_scale_2, torch.bfloat16))
                    own.down_proj.copy_(eff_weights(m.q.down_weight, m.q.down_weight_scale, m.q.down_weight_scale_2,
                                                    torch.bfloat16))
                setattr(ref.get_submodule(name.rpartition(".")[0]), "experts", own)
    got, want = logits(qmodel), logits(ref)
    torch.testing.assert_close(got, want, rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    tokens = qmodel.generate(PROMPT, **GEN)
    assert torch.equal(tokens, ref.generate(PROMPT, **GEN))
    assert torch.equal(nvfp4_gemv.generate(qmodel, PROMPT, 6), tokens)


def test_shared_experts_become_nvfp4_linears_and_the_router_keeps_its_weight():
    model = tiny("qwen2")
    weight = model.model.layers[0].mlp.gate.weight
    quantize_model(model, fuse=True)
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp.experts, NVFP4Experts)
    assert isinstance(mlp.shared_expert.gate_proj, NVFP4Linear) and isinstance(mlp.shared_expert.down_proj, NVFP4Linear)
    assert mlp.shared_expert.gate_proj._siblings is not None  # gate/up of the shared expert fused
    # the router is fused (one kernel, the same bf16 weight); the shared expert's gate stays a plain linear
    assert isinstance(mlp.gate, TopKRouter) and type(mlp.gate).__mro__[2].__name__ == "Qwen2MoeTopKRouter"
    assert mlp.gate.weight is weight
    assert type(mlp.shared_expert_gate) is torch.nn.Linear
    assert logits(model).isfinite().all()


def test_skip_leaves_experts_in_bf16_without_a_warning(recwarn):
    model = tiny("qwen3")
    quantize_model(model, skip=("lm_head", "mlp.experts"))
    assert not experts_of(model) and type(model.model.layers[0].mlp.experts).__name__ == "Qwen3MoeExperts"
    assert not [w for w in recwarn if "skip pattern" in str(w.message)]


@pytest.mark.parametrize("route", ["slots", "grouped"])
def test_torch_compile_fullgraph_has_no_graph_break_and_gives_the_eager_bits(route):
    from torch._dynamo.utils import counters

    mod = random_experts(torch.Generator().manual_seed(1), 6, 64, 32, "w4a4", torch.bfloat16)
    tokens = 2 if route == "slots" else 9
    x = torch.randn(tokens, 64).bfloat16()
    idx, wts = torch.randint(0, 6, (tokens, 2)), torch.rand(tokens, 2)
    torch._dynamo.reset()
    counters.clear()
    for mode in ("w4a4", "w4a16"):
        mod.mode = mode
        compiled = torch.compile(mod, fullgraph=True, backend="eager")
        assert torch.equal(compiled(x, idx, wts), mod(x, idx, wts))
    assert not counters["graph_break"]


# ----------------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[("qwen3", "w4a16"), ("mixtral", "w4a4")], ids=lambda p: "-".join(p))
def export(request, tmp_path_factory):
    arch, mode = request.param
    qmodel, dense = quantized(arch, mode)
    path = str(tmp_path_factory.mktemp(f"moe-{arch}-{mode}"))
    save_modelopt(qmodel, path)
    qmodel.dense = [dense]  # (kept out of the module tree)
    return arch, mode, path, qmodel


def state_bytes(model):
    return {k: v.reshape(-1).view(torch.uint8).clone() if v.dim() else v.clone() for k, v in model.state_dict().items()}


def test_export_has_modelopts_per_expert_names(export):
    arch, mode, path, qmodel = export
    state = load_file(os.path.join(path, "model.safetensors"))
    pre = "model.layers.1.mlp.experts.3"
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in state)
    i = qmodel.model.layers[1].mlp.experts.intermediate_dim
    assert state[f"{pre}.gate_proj.weight"].shape == (i, 64) and state[f"{pre}.gate_proj.weight"].dtype == torch.uint8
    assert state[f"{pre}.down_proj.weight_scale"].shape == (128, i // 16)
    assert torch.equal(state[f"{pre}.gate_proj.weight_scale_2"], state[f"{pre}.up_proj.weight_scale_2"])
    from nvfp4_gemv import quantize_weight

    q, s, ws2 = quantize_weight(qmodel.dense[0].model.layers[1].mlp.experts.gate_up_proj[3].detach())
    assert torch.equal(state[f"{pre}.gate_proj.weight"], q[:i]) and torch.equal(state[f"{pre}.up_proj.weight"], q[i:])
    assert torch.equal(state[f"{pre}.up_proj.weight_scale"].view(torch.uint8), s[i:].view(torch.uint8))
    assert torch.equal(state[f"{pre}.up_proj.weight_scale_2"].reshape(()), ws2)
    assert (f"{pre}.down_proj.input_scale" in state) == (mode == "w4a4")
    with open(os.path.join(path, "hf_quant_config.json")) as f:
        assert json.load(f)["quantization"]["quant_algo"] == ("NVFP4" if mode == "w4a4" else "W4A16_NVFP4")


def test_load_modelopt_and_from_pretrained_give_the_exported_model_bit_for_bit(export):
    arch, mode, path, qmodel = export
    fresh = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path),
                                                          dtype=torch.bfloat16).eval()
    load_modelopt(fresh, path, mode=mode)
    want = state_bytes(qmodel)
    got = state_bytes(fresh)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    model = from_pretrained(path, mode=mode, device="cpu")
    assert len(experts_of(model)) == 2 and all(m.mode == mode for m in experts_of(model))
    assert torch.equal(logits(model), logits(fresh))
    assert torch.equal(model.generate(PROMPT, **GEN), fresh.generate(PROMPT, **GEN))
    load_modelopt(fresh, path, mode=mode)  # into a model whose experts are NVFP4Experts already
    assert torch.equal(logits(model), logits(fresh))


def test_load_state_dict_round_trip_and_dtype_moves_keep_the_format():
    mod = random_experts(torch.Generator().manual_seed(2), 3, 32, 16, "w4a4", torch.bfloat16)
    sd = mod.state_dict()
    assert sorted(sd)[:4] == ["0.down_proj.input_scale", "0.down_proj.weight", "0.down_proj.weight_scale",
                              "0.down_proj.weight_scale_2"] and len(sd) == 3 * 3 * 4
    other = NVFP4Experts(3, 32, 16)
    assert other.load_state_dict(sd).missing_keys == [] and other.gate_up_input_scale is not None
    other.mode = "w4a4"
    x, idx, w = torch.randn(4, 32).bfloat16(), torch.randint(0, 3, (4, 2)), torch.rand(4, 2)
    assert torch.equal(other(x, idx, w), mod(x, idx, w))
    other.to(torch.float16)
    assert other.gate_up_weight_scale.dtype == torch.float8_e4m3fn and other.down_weight_scale_2.dtype == torch.float32
    bad = dict(sd)
    bad["1.up_proj.weight_scale_2"] = bad["1.up_proj.weight_scale_2"] * 2
    with pytest.raises(RuntimeError, match="'1.gate_proj.weight_scale_2' and '1.up_proj.weight_scale_2' differ"):
        other.load_state_dict(bad)
    bad = dict(sd)
    bad["2.down_proj.weight"] = bad["2.down_proj.weight"][:, :4]
    with pytest.raises(RuntimeError, match=r"'2.down_proj.weight': expected torch.uint8 \(32, 8\)"):
        other.load_state_dict(bad)
    with pytest.raises(RuntimeError, match='Unexpected key.*"5.gate_proj.weight"'):
        other.load_state_dict({**sd, "5.gate_proj.weight": sd["0.gate_proj.weight"]})


def _edit(src, dst, fn):
    os.makedirs(dst, exist_ok=True)
    state = load_file(os.path.join(src, "model.safetensors"))
    fn(state)
    save_file(state, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    for name in ("hf_quant_config.json", "config.json"):
        with open(os.path.join(src, name)) as f, open(os.path.join(dst, name), "w") as g:
            g.write(f.read())
    return dst


P1 = "model.layers.1.mlp.experts"


@pytest.mark.parametrize("what, edit, match", [
    ("missing", lambda s: s.pop(f"{P1}.2.down_proj.weight_scale"), f"missing tensor '{P1}.2.down_proj.weight_scale'"),
    ("shape", lambda s: s.__setitem__(f"{P1}.0.up_proj.weight", s[f"{P1}.0.up_proj.weight"][:8]),
     f"tensor '{P1}.0.up_proj.weight': expected torch.uint8 of shape"),
    ("scale2", lambda s: s.__setitem__(f"{P1}.1.up_proj.weight_scale_2", s[f"{P1}.1.up_proj.weight_scale_2"] * 2),
     f"'{P1}.1.gate_proj.weight_scale_2' and '{P1}.1.up_proj.weight_scale_2' differ"),
    ("expert", lambda s: s.__setitem__(f"{P1}.99.down_proj.weight", s[f"{P1}.0.down_proj.weight"].clone()),
     f"tensor '{P1}.99.down_proj.weight': not a tensor of experts 0..7"),
])
def test_a_bad_expert_tensor_is_named_and_nothing_loads(export, tmp_path, what, edit, match):
    arch, mode, path, qmodel = export
    if arch != "qwen3":
        pytest.skip("one architecture is enough")
    bad = _edit(path, str(tmp_path / what), edit)
    fresh = tiny(arch, seed=5)
    before = state_bytes(fresh)
    with pytest.raises(CheckpointError, match=match):
        load_modelopt(fresh, bad)
    after = state_bytes(fresh)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    with pytest.raises(CheckpointError, match=match):
        from_pretrained(bad, device="cpu")


@pytest.mark.parametrize("targets", [("Linear",), (r"re:.*_proj$",)])
def test_a_compressed_tensors_moe_checkpoint_loads_as_its_modelopt_twin(export, tmp_path, targets):
    """llm-compressor's layout of the same experts (``weight_packed``, ``weight_global_scale`` = 1 /
    ``weight_scale_2``, ``input_global_scale`` = 1 / ``input_scale``, ModelOpt's per-expert names, config
    groups targeting them by class or by pattern) gives the ModelOpt export's model: the experts' bits, logits
    and greedy tokens. The twin's global scales are rounded to powers of two first, so that the reciprocals
    are exact (otherwise 1 / (1 / s) may differ from s in its last bit)."""
    import nvfp4_checkpoints as ckpts

    arch, mode, path, _ = export

    def pow2(state):
        for k, v in state.items():
            if k.endswith(("weight_scale_2", "input_scale")):
                state[k] = torch.exp2(torch.round(torch.log2(v.float()))).to(v.dtype)

    twin_path = _edit(path, str(tmp_path / "pow2"), pow2)
    src = load_file(os.path.join(twin_path, "model.safetensors"))
    dense = sorted(k[:-len(".weight")] for k in src if k.endswith("_proj.weight") and k + "_scale" not in src)
    ct = ckpts.to_compressed_tensors(twin_path, tmp_path / "ct", activations=mode == "w4a4", targets=targets,
                                     ignore=("lm_head", *dense))  # (the linears the kernels do not take)
    assert "model.layers.1.mlp.experts.3.gate_proj.weight_packed" in load_file(os.path.join(ct, "model.safetensors"))
    model = from_pretrained(ct, mode=mode, device="cpu")
    twin = from_pretrained(twin_path, mode=mode, device="cpu")
    assert len(experts_of(model)) == 2 and all(m.mode == mode for m in experts_of(model))
    assert state_bytes(model).keys() == state_bytes(twin).keys()
    assert all(torch.equal(a, b) for a, b in zip(state_bytes(model).values(), state_bytes(twin).values()))
    assert torch.equal(logits(model), logits(twin))
    assert torch.equal(model.generate(PROMPT, **GEN), twin.generate(PROMPT, **GEN))


def test_a_deepseek_v3_export_round_trips_bit_for_bit(tmp_path):
    """DeepSeek-V3's routed experts (``DeepseekV3Experts``, beside MLA, a shared expert and its sigmoid router)
    through save_modelopt and from_pretrained: the model's bits, logits and greedy tokens."""
    qmodel, _ = quantized("deepseek_v3", "w4a4")
    save_modelopt(qmodel, str(tmp_path))
    state = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert f"{P1}.7.down_proj.input_scale" in state and "model.layers.0.mlp.experts.0.gate_proj.weight" not in state
    model = from_pretrained(str(tmp_path), mode="w4a4", device="cpu")
    assert len(experts_of(model)) == 1 and experts_of(model)[0].mode == "w4a4"
    assert all(torch.equal(a, b) for a, b in zip(state_bytes(experts_of(model)[0]).values(),
                                                 state_bytes(experts_of(qmodel)[0]).values()))
    # transformers keeps DeepSeek-V3's router in fp32 (its class's _keep_in_fp32_modules): as a model built
    # from the config and loaded by load_modelopt, not as the all-bf16 model that was exported
    fresh = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(tmp_path)),
                                                          dtype=torch.bfloat16).eval()
    load_modelopt(fresh, str(tmp_path), mode="w4a4")
    assert model.model.layers[1].mlp.gate.weight.dtype == fresh.model.layers[1].mlp.gate.weight.dtype
    want, got = state_bytes(fresh), state_bytes(model)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(logits(model), logits(fresh))
    assert torch.equal(model.generate(PROMPT, **GEN), fresh.generate(PROMPT, **GEN))


def test_a_compressed_tensors_expert_with_its_own_gate_and_up_global_scales_is_named(export, tmp_path):
    import nvfp4_checkpoints as ckpts

    arch, mode, path, _ = export
    src = load_file(os.path.join(path, "model.safetensors"))
    dense = sorted(k[:-len(".weight")] for k in src if k.endswith("_proj.weight") and k + "_scale" not in src)
    up = f"{P1}.2.up_proj.weight_global_scale"
    ct = ckpts.to_compressed_tensors(path, tmp_path / "ct", activations=mode == "w4a4", ignore=("lm_head", *dense),
                                     edit=lambda state, qc: state.__setitem__(up, state[up] * 2))
    with pytest.raises(CheckpointError, match=f"'{P1}.2.gate_proj.weight_global_scale' and '{up}' differ"):
        from_pretrained(ct, mode=mode, device="cpu")


def test_mixtral_w1_w3_w2_names_load_as_gate_up_down(export, tmp_path):
    arch, mode, path, qmodel = export
    if arch != "mixtral":
        pytest.skip("Mixtral's names")
    names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}

    def rename(state):
        for k in [k for k in state if ".experts." in k]:
            parts = k.split(".")
            parts[-2] = names.get(parts[-2], parts[-2])
            state[".".join(parts)] = state.pop(k)
    model = from_pretrained(_edit(path, str(tmp_path / "w123"), rename), mode=mode, device="cpu")
    assert torch.equal(logits(model), logits(from_pretrained(path, mode=mode, device="cpu")))


def test_transformers_door_refuses_moe_naming_from_pretrained(export):
    arch, mode, path, qmodel = export
    with pytest.raises(CheckpointError, match="MoE experts load with nvfp4_gemv.from_pretrained"):
        transformers.AutoModelForCausalLM.from_pretrained(path)


# ----------------------------------------------------------------------------------------------------
# Quantizing, calibrating, bad arguments
# ----------------------------------------------------------------------------------------------------


def test_from_experts_is_nvidias_recipe_an_expert_gate_and_up_together():
    from nvfp4_gemv import quantize_weight

    ex = tiny("mixtral").model.layers[0].mlp.experts
    mod = NVFP4Experts.from_experts(ex)
    for e in range(ex.num_experts):
        q, s, ws2 = quantize_weight(ex.gate_up_proj[e].detach())
        assert torch.equal(mod.gate_up_weight[e], q) and torch.equal(mod.gate_up_weight_scale_2[e], ws2)
        assert torch.equal(mod.gate_up_weight_scale[e].view(torch.uint8), s.view(torch.uint8))
        q, s, ws2 = quantize_weight(ex.down_proj[e].detach())
        assert torch.equal(mod.down_weight[e], q) and torch.equal(mod.down_weight_scale_2[e], ws2)


def test_calibration_gives_each_expert_the_amax_of_its_tokens_and_fills_the_unhit():
    model = tiny("qwen3")
    ex = model.model.layers[0].mlp.experts
    seen = {}

    def record(mod, args):
        seen.setdefault("x", (args[0].detach(), args[1].detach()))
    hook = ex.register_forward_pre_hook(record)
    scales = calibrate_expert_input_scales(model, lambda m: m(PROMPT[:1, :2]))  # 2 tokens: most experts unhit
    hook.remove()
    x, idx = seen["x"]
    hit = sorted(set(idx.flatten().tolist()))
    name = "model.layers.0.mlp.experts"
    for e in hit:
        want = x[(idx == e).any(1)].abs().amax().float() / 2688
        assert torch.equal(scales[f"{name}.{e}.gate_proj"], want) and torch.equal(scales[f"{name}.{e}.up_proj"], want)
    top = max(float(scales[f"{name}.{e}.gate_proj"]) for e in hit)
    unhit = [e for e in range(8) if e not in hit]
    assert unhit and all(float(scales[f"{name}.{e}.gate_proj"]) == top for e in unhit)
    assert len(scales) == 2 * 8 * 3


def test_w4a4_quantize_model_needs_every_experts_input_scales_and_leaves_the_model_as_it_was():
    model = tiny("qwen3")
    loop = lambda m: m(PROMPT)  # noqa: E731
    scales = {**calibrate_input_scales(model, loop), **calibrate_expert_input_scales(model, loop)}
    del scales["model.layers.1.mlp.experts.5.down_proj"]
    before = state_bytes(model)
    with pytest.raises(ValueError, match="lacks 'model.layers.1.mlp.experts.5.down_proj'"):
        quantize_model(model, mode="w4a4", input_scales=scales)
    assert not experts_of(model) and state_bytes(model).keys() == before.keys()


@pytest.mark.parametrize("bad, exc", [(0.0, ValueError), (True, TypeError), (torch.ones(2), ValueError)])
def test_an_experts_input_scale_that_is_not_a_positive_scalar_is_named(bad, exc):
    model = tiny("qwen3")
    loop = lambda m: m(PROMPT)  # noqa: E731
    scales = {**calibrate_input_scales(model, loop), **calibrate_expert_input_scales(model, loop)}
    scales["model.layers.1.mlp.experts.5.down_proj"] = bad  # 0 would make x_scale inf: w4a4 silently wrong
    with pytest.raises(exc, match=r"module 'model.layers.1.mlp.experts'.*'input_scales\['model.layers.1.mlp"
                                  r".experts.5.down_proj'\]'"):
        quantize_model(model, mode="w4a4", input_scales=scales)
    assert not experts_of(model)


def test_bad_arguments_are_named():
    mod = random_experts(torch.Generator().manual_seed(4), 4, 32, 16, "w4a16", torch.bfloat16)
    x, idx, w = torch.randn(2, 32).bfloat16(), torch.randint(0, 4, (2, 2)), torch.rand(2, 2)
    cases = [
        ((x.float(), idx, w), TypeError, "argument 'hidden_states': expected dtype torch.bfloat16"),
        ((x[:, :16], idx, w), ValueError, r"argument 'hidden_states': expected shape \[tokens, 32\]"),
        ((x, idx.float(), w), ValueError, "argument 'top_k_index': expected an int64 or int32"),
        ((x, idx[:1], w), ValueError, "argument 'top_k_index'"),
        ((x, idx, w[:, :1]), ValueError, "argument 'top_k_weights': expected a floating-point tensor"),
        ((x, idx, [0.5]), TypeError, "argument 'top_k_weights': expected a torch.Tensor"),
        ((x.to("meta"), idx, w), ValueError, "argument 'hidden_states': expected a tensor on cpu"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            mod(*args)
    mod.mode = "w4a4"
    with pytest.raises(ValueError, match="mode 'w4a4' needs input scales"):
        mod(x, idx, w)
    with pytest.raises(ValueError, match="'mode': expected one of"):
        mod.mode = "w8"
    with pytest.raises(ValueError, match="'hidden_dim': expected a positive multiple of 16"):
        NVFP4Experts(4, 40, 16)
    with pytest.raises(TypeError, match="'experts': expected a transformers experts module"):
        NVFP4Experts.from_experts(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="'input_scales': expected"):
        NVFP4Experts.from_experts(tiny("mixtral").model.layers[0].mlp.experts, mode="w4a4")
    sd = {k: v.clone() for k, v in mod.state_dict().items()}
    with pytest.raises(KeyError, match="missing tensor '3.down_proj.weight'"):
        NVFP4Experts.from_modelopt({k: v for k, v in sd.items() if k != "3.down_proj.weight"}, 4, 32, 16)
    with pytest.raises(KeyError, match="missing tensor '0.gate_proj.input_scale'.*mode 'w4a4'"):
        NVFP4Experts.from_modelopt(sd, 4, 32, 16, mode="w4a4")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_gpu_forward_is_sync_free_capturable_and_the_cpu_bits(mode):
    mod = random_experts(torch.Generator().manual_seed(6), 8, 128, 64, mode, torch.bfloat16)
    for tokens in (1, 16):  # slot path, grouped path
        x, idx, w = torch.randn(tokens, 128).bfloat16(), torch.randint(0, 8, (tokens, 4)), torch.rand(tokens, 4)
        want = mod(x, idx, w)
        gpu = copy.deepcopy(mod).cuda()
        xc, ic, wc = x.cuda(), idx.cuda(), w.cuda()
        gpu(xc, ic, wc)
        with no_syncs():
            out = gpu(xc, ic, wc)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = gpu(xc, ic, wc)
        xc.copy_(torch.randn(tokens, 128).bfloat16())
        graph.replay()
        assert torch.equal(captured, gpu(xc, ic, wc))
        # the GPU takes the experts' kernel (exact products, alpha at the end) where the CPU's fallback rounds
        # the weights first: within bf16 rounding in w4a16; in w4a4 an ulp can move an activation across an
        # e2m1 rounding boundary, so there the whole output is compared by norm
        if mode == "w4a16":
            torch.testing.assert_close(out.cpu(), want, rtol=2 ** -6, atol=2 ** -7 * want.abs().max().item())
        else:
            # (the fallback's weights differ by up to 2^-9 relative, moving about 1% of the down stage's
            # activations across a boundary, a step of 25-50% each: about 4% of the norm; measured 3.7%)
            rel = float((out.cpu().double() - want.double()).norm() / want.double().norm())
            assert rel < 2 ** -3, rel


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "mixtral", "deepseek_v3"])
def test_gpu_whole_model_takes_the_experts_kernel_and_generate_gives_model_generates_tokens(arch, monkeypatch):
    """A tiny quantized MoE model on the GPU (W4A16: the experts' kernel, its act at one token):
    ``nvfp4_gemv.generate`` (the step in one CUDA graph) gives ``model.generate``'s greedy tokens, and the
    decode steps call the experts' op (two launches a MoE layer a step), not the fallback."""
    from nvfp4_gemv import experts_op

    qmodel, _ = quantized(arch, "w4a16")
    model = qmodel.cuda()
    prompt = PROMPT[:1].cuda()  # (one row: the decode steps are one token each, where the act is in the kernel)
    calls = []
    real = experts_op._run
    monkeypatch.setattr(experts_op, "_run", lambda *a: calls.append(a[7] if len(a) > 7 else None) or real(*a))
    # (eager steps, as nvfp4_gemv.generate's graph replays: on CUDA transformers compiles a static cache's decode
    # steps unless told not to, and inductor's fused kernels round otherwise. Measured 2026-12-07, H100: these
    # tiny models' compiled tokens part from the eager ones at a near-tie, main and branch alike)
    want = model.generate(prompt, **GEN, disable_compile=True)
    assert calls and "silu" in calls, "the decode steps did not take the experts' kernel with its act"
    assert torch.equal(nvfp4_gemv.generate(model, prompt, GEN["max_new_tokens"]), want)


@pytest.mark.gpu
def test_gpu_forward_warns_once_where_it_takes_the_dequantizing_fallback():
    from nvfp4_gemv import launch

    launch._warned.discard("experts-fallback")
    mod = random_experts(torch.Generator().manual_seed(7), 4, 64, 32, "w4a16", torch.bfloat16).cuda()
    x, idx, w = torch.randn(2, 64).bfloat16().cuda(), torch.randint(0, 4, (2, 2)).cuda(), torch.rand(2, 2).cuda()
    with pytest.warns(RuntimeWarning, match="expert shapes it does not take"):
        mod(x, idx, w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mod(x, idx, w)


def test_plan_experts_names_a_format_it_cannot_read():
    from nvfp4_gemv.model.experts_convert import plan_experts

    with pytest.raises(TypeError, match="'fmt': expected a loader's format object"):
        plan_experts({}, [], {}, object(), "w4a16", "load_modelopt")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_fallbacks_weights_through_the_dequantize_kernel_are_the_torch_ops_bits(monkeypatch, dtype):
    """On CUDA the fallback's weights come from ``dequant_kernel`` (bf16 values, widened, times alpha): the same
    bits as the torch ops. Here the kernel's place is taken by its exact definition on the CPU
    (``op_plan.dequantized``, which the kernel equals bit for bit on the GPU: tests/op/test_dequant_kernel.py),
    so this checks the path's shapes, views and rounding; the GPU tests of the fallback run the kernel."""
    from nvfp4_gemv import dequant_kernel, op_plan

    mod = random_experts(torch.Generator().manual_seed(11), 5, 64, 48, "w4a16", torch.bfloat16)
    w, ws, alpha = mod.gate_up_weight, mod.gate_up_weight_scale, mod.gate_up_weight_scale_2
    want = experts_mod._weights(w, ws, alpha, dtype)
    calls = []

    def kernel(w2, ws2, out, k, packed=False):
        calls.append((tuple(w2.shape), tuple(ws2.shape), tuple(out.shape), k))
        out.copy_(op_plan.dequantized(w2, ws2, k, False, out.dtype))
        return out
    monkeypatch.setattr(experts_mod, "_kernel_reads", lambda w, ws: True)
    monkeypatch.setattr(dequant_kernel, "dequantize_cuda", kernel)
    got = experts_mod._weights(w, ws, alpha, dtype)
    e, n, half = w.shape
    assert calls == [((e * n, half), (e * n, half // 8), (e * n, 2 * half), 2 * half)]
    assert got.dtype == dtype and torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fallback_weights_from_the_dequantize_kernel_are_the_cpus_bits(dtype):
    """On the GPU the fallback's weights come from ``dequant_kernel``: bit for bit the CPU's torch ops, NaN
    scale bytes included (NaN where the CPU has NaN)."""
    mod = random_experts(torch.Generator().manual_seed(12), 6, 128, 64, "w4a16", torch.bfloat16)
    w, ws, alpha = mod.gate_up_weight, mod.gate_up_weight_scale.clone(), mod.gate_up_weight_scale_2
    ws.view(torch.uint8)[1, 3, 2] = 0x7F
    ws.view(torch.uint8)[4, 0, 0] = 0xFF
    want = experts_mod._weights(w, ws, alpha, dtype)
    wc, wsc = w.cuda(), ws.cuda()
    assert experts_mod._kernel_reads(wc, wsc)
    got = experts_mod._weights(wc, wsc, alpha.cuda(), dtype).cpu()
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any()
    assert torch.equal(got.view(torch.int16)[~got.isnan()], want.view(torch.int16)[~want.isnan()])


@pytest.mark.gpu
def test_gpu_prefill_fallback_is_capturable_and_the_cpu_bits_of_its_weights():
    """Past the experts' kernel's 64 tokens the fallback runs (the dequantize kernel, then torch._grouped_mm):
    captured in a CUDA graph it replays the eager result."""
    mod = random_experts(torch.Generator().manual_seed(13), 8, 128, 64, "w4a16", torch.bfloat16)
    gpu = copy.deepcopy(mod).cuda()
    x, idx, w = torch.randn(80, 128).bfloat16().cuda(), torch.randint(0, 8, (80, 2)).cuda(), torch.rand(80, 2).cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = gpu(x, idx, w)  # compiles the kernel outside the capture
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s), torch.cuda.graph(graph):
            captured = gpu(x, idx, w)
        torch.cuda.current_stream().wait_stream(s)
    captured.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, want)
    cpu = mod(x.cpu(), idx.cpu(), w.cpu())
    torch.testing.assert_close(want.cpu(), cpu, rtol=2 ** -6, atol=2 ** -7 * cpu.abs().max().item())

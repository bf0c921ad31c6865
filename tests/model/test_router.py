"""``TopKRouter`` / ``topk_route`` / ``fuse_routers`` (nvfp4_gemv/model/router.py, nvfp4_gemv/router_op.py) on the
CPU: transformers' router bit for bit (the CPU runs its torch ops), the same weight object and state_dict
names after ``fuse_routers``, whole tiny Qwen3-MoE and Qwen2-MoE models with the same logits and greedy
tokens, gradients where autograd tracks the weight, torch.compile(fullgraph=True) through the op's fake,
bad arguments named. The kernel compiles for sm_90a and sm_100a in tests/leaderboard/test_compile.py; its
results are tested on the GPU (tests/op/test_router_kernel.py)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import nvfp4_gemv  # noqa: E402
from nvfp4_gemv import TopKRouter, fuse_routers, quantize_model, topk_route, unfuse_routers  # noqa: E402
from nvfp4_gemv.model.router import ROUTER_CLASSES  # noqa: E402
from nvfp4_gemv.router_kernel import can_implement  # noqa: E402
from test_experts import GEN, PROMPT, tiny  # noqa: E402

def hf_router(e, h, k, norm, dtype, seed=0):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = transformers.Qwen3MoeConfig(hidden_size=h, num_experts=e, num_experts_per_tok=k, norm_topk_prob=norm)
    r = Qwen3MoeTopKRouter(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        r.weight.copy_(torch.randn(e, h, generator=g) * 0.05)
    return r.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("t", [1, 7, 70])
def test_the_cpu_path_is_transformers_router_bit_for_bit(t, norm, dtype):
    r = hf_router(128, 256, 8, norm, dtype)
    ours = TopKRouter.from_router(r)
    x = torch.randn(t, 256, generator=torch.Generator().manual_seed(t)).to(dtype)
    with torch.no_grad():
        want, got = r(x), ours(x)
    for name, a, b in zip(("logits", "scores", "indices"), want, got):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_ties_come_out_as_torch_topk_gives_them_on_the_cpu():
    """Equal rows of the weight give equal logits: the CPU path keeps torch.topk's choice among them."""
    r = hf_router(64, 256, 4, True, torch.bfloat16)
    with torch.no_grad():
        r.weight[40] = r.weight[3]
        r.weight[50] = r.weight[3]
    x = r.weight[3:4].float().sign().to(torch.bfloat16)  # row 3's logit the largest
    with torch.no_grad():
        want, got = r(x), TopKRouter.from_router(r)(x)
    assert torch.equal(want[2], got[2]) and {3, 40, 50} <= set(got[2][0].tolist())


def test_fuse_routers_keeps_the_weight_object_and_the_state_dict():
    model = tiny("qwen3")
    before = {k: v for k, v in model.state_dict().items()}
    weights = [m.mlp.gate.weight for m in model.model.layers]
    assert fuse_routers(model) == len(model.model.layers)
    assert all(isinstance(m.mlp.gate, TopKRouter) for m in model.model.layers)
    assert all(isinstance(m.mlp.gate, transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter)
               for m in model.model.layers)  # still transformers' class too (OutputRecorder matches by class)
    assert [m.mlp.gate.weight for m in model.model.layers] == weights  # the same Parameter objects
    after = model.state_dict()
    assert list(after) == list(before) and all(after[k] is before[k] or torch.equal(after[k], before[k]) for k in after)
    assert fuse_routers(model) == 0  # nothing left to replace


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_a_whole_model_gives_the_same_logits_and_tokens(arch):
    model = tiny(arch)
    with torch.no_grad():
        want = model(PROMPT).logits
    tokens = model.generate(PROMPT, **GEN)
    fuse_routers(model)
    with torch.no_grad():
        got = model(PROMPT).logits
    assert torch.equal(want, got)
    assert torch.equal(model.generate(PROMPT, **GEN), tokens)


def test_fuse_true_fuses_the_routers_and_fuse_false_leaves_them():
    """``quantize_model(fuse=True)`` makes every router a ``TopKRouter`` (the quantized model's logits those of
    transformers' routers, on the CPU); ``fuse=False`` leaves transformers' routers; ``unfuse_routers`` gives
    a fused model's routers their transformers class back (linear fusion kept)."""
    kept = quantize_model(tiny("qwen3"), fuse=False)
    assert all(type(m.mlp.gate).__name__ == "Qwen3MoeTopKRouter" for m in kept.model.layers)
    model = quantize_model(tiny("qwen3"), fuse=True)
    assert all(isinstance(m.mlp.gate, TopKRouter) for m in model.model.layers)
    assert fuse_routers(model) == 0  # nothing left to fuse
    with torch.no_grad():
        got = model(PROMPT).logits
    gates = [m.mlp.gate for m in model.model.layers]
    assert unfuse_routers(model) == len(gates) and unfuse_routers(model) == 0  # back to transformers' class
    assert all(type(g).__name__ == "Qwen3MoeTopKRouter" and not isinstance(g, TopKRouter) for g in gates)
    assert [m.mlp.gate for m in model.model.layers] == gates  # the same modules (and weights)
    with torch.no_grad():
        assert torch.equal(model(PROMPT).logits, got)


def test_output_router_logits_and_a_pickle_of_a_fused_model():
    import pickle

    from nvfp4_gemv.model import router as router_mod

    model = tiny("qwen3")
    with torch.no_grad():
        want = model(PROMPT, output_router_logits=True)
    fuse_routers(model)
    with torch.no_grad():
        got = model(PROMPT, output_router_logits=True)
    assert len(got.router_logits) == len(want.router_logits)
    assert all(torch.equal(a, b) for a, b in zip(want.router_logits, got.router_logits))
    assert torch.equal(want.aux_loss, got.aux_loss)
    model = tiny("qwen3")  # (the recorder's hooks above are transformers' local functions: not picklable)
    fuse_routers(model)
    with torch.no_grad():
        got = model(PROMPT)
    blob = pickle.dumps(model)
    name = type(model.model.layers[0].mlp.gate).__name__
    router_mod._fused.clear()  # as in a new process: the class is rebuilt from its name
    del router_mod.__dict__[name]
    again = pickle.loads(blob)
    assert type(again.model.layers[0].mlp.gate).__name__ == name
    with torch.no_grad():
        assert torch.equal(again(PROMPT).logits, got.logits)


def test_gradients_reach_the_input_of_a_frozen_router():
    r = hf_router(64, 256, 4, True, torch.float32).requires_grad_(False)
    ours = TopKRouter.from_router(r)
    x = torch.randn(3, 256, requires_grad=True)
    want = torch.autograd.grad(r(x)[1].sum() * 3 + r(x)[0].square().sum(), x)[0]
    got = torch.autograd.grad(ours(x)[1].sum() * 3 + ours(x)[0].square().sum(), x)[0]
    assert torch.equal(want, got)


def test_the_op_with_a_tracked_input_raises_on_backward():
    """The op itself has no backward: its floating results say so when a gradient reaches them (never a
    silently missing gradient); the indices carry none."""
    x = torch.randn(2, 256, requires_grad=True)
    logits, weights, idx = torch.ops.nvfp4.topk_route(x, torch.randn(64, 256), 4, True)
    assert logits.requires_grad and weights.requires_grad and not idx.requires_grad
    with pytest.raises(RuntimeError, match="nvfp4::topk_route: no backward"):
        (logits.sum() + weights.sum()).backward()


def test_gradients_flow_where_autograd_tracks_the_weight():
    r = hf_router(64, 256, 4, True, torch.float32)
    ours = TopKRouter.from_router(hf_router(64, 256, 4, True, torch.float32))
    x = torch.randn(3, 256)
    want = torch.autograd.grad(r(x)[1].sum() + r(x)[0].square().sum(), r.weight)[0]
    got = torch.autograd.grad(ours(x)[1].sum() + ours(x)[0].square().sum(), ours.weight)[0]
    assert torch.equal(want, got)


def test_compiles_in_one_graph_through_the_fake():
    r = TopKRouter.from_router(hf_router(128, 256, 8, True, torch.bfloat16))
    x = torch.randn(4, 256).to(torch.bfloat16)
    f = torch.compile(r, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        got, want = f(x), r(x)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("args,match", [
    ((torch.zeros(2, 256), torch.zeros(64, 128), 4), "argument 'x'"),
    ((torch.zeros(2, 256), torch.zeros(64, 256, dtype=torch.bfloat16), 4), "argument 'x'"),
    ((torch.zeros(2, 256), torch.zeros(64, 256), 0), "argument 'top_k'"),
    ((torch.zeros(2, 256), torch.zeros(64, 256), 65), "argument 'top_k'"),
    ((torch.zeros(2, 256), "w", 4), "argument 'weight'"),
    ((torch.zeros(2, 256), torch.zeros(256), 4), "argument 'weight'"),
])
def test_bad_arguments_are_named(args, match):
    with pytest.raises((TypeError, ValueError), match=match):
        topk_route(*args)


def test_what_the_kernel_takes():
    assert can_implement(128, 2048, 8)[0] and can_implement(32, 256, 1)[0] and can_implement(1024, 8192, 32)[0]
    assert not can_implement(60, 2048, 4)[0] and not can_implement(8, 4096, 2)[0]  # Qwen2-MoE's 60, Mixtral's 8
    assert not can_implement(128, 2000, 8)[0] and not can_implement(128, 2048, 33)[0]
    assert "Qwen3MoeTopKRouter" in ROUTER_CLASSES and "MixtralTopKRouter" not in ROUTER_CLASSES
    from nvfp4_gemv.router_op import _builds  # (the op's per-call answer, kept a shape)

    for shape in [(128, 2048, 8), (60, 2048, 4), (128, 2000, 8), (128, 2048, 33), (32, 256, 1)] * 2:
        assert _builds(*shape) == can_implement(*shape)[0]


def test_the_names_are_public():
    assert nvfp4_gemv.topk_route is topk_route and {"fuse_routers", "unfuse_routers"} <= set(nvfp4_gemv.__all__)


def test_a_quantized_model_with_fused_routers_compiles_in_one_graph():
    """A whole quantized Qwen3-MoE with ``fuse_routers`` under torch.compile(fullgraph=True): no graph break
    at the routers' changed class, and the eager logits."""
    model = quantize_model(tiny("qwen3"), fuse=True)
    fuse_routers(model)
    with torch.no_grad():
        want = model(PROMPT).logits
        got = torch.compile(model, backend="aot_eager", fullgraph=True)(PROMPT).logits
    assert torch.equal(want, got)

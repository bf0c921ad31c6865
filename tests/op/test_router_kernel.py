"""The MoE router's kernel (``nvfp4_gemv.router_kernel`` through ``topk_route``) on the GPU: its logits within
half an ulp plus its fp32 sums' rounding of the float64 product; its top k exactly the stable order (value
descending, lower expert first) of a softmax of its own logits, over E = 32..1024, H = 256..8192, k = 1..32,
1..64 tokens, bf16 and fp16, with and without renormalising; its weights within one ulp of that softmax in
fp32; ties, also at the k-th place, taken by the lower expert; the same results over many calls and CUDA-graph
replays (each call's counters are its own), no host sync; and transformers' router on the same GPU agreeing
wherever the two sets of logits agree (in order where no tie decides it); strided x rows, a zero input, all
experts without renormalising, and a weight the kernel cannot read (the torch ops)."""

import pytest
import torch

from inputs import rounding_violations
from nvfp4_gemv import TopKRouter, fuse_routers, topk_route
from nvfp4_gemv.router_op import kernel_takes, route_torch
from sync_free import no_syncs

pytestmark = pytest.mark.gpu

CASES = [  # (tokens, experts, hidden, top_k, dtype, norm)
    (1, 128, 2048, 8, torch.bfloat16, True), (4, 128, 2048, 8, torch.bfloat16, True),
    (16, 128, 2048, 8, torch.bfloat16, False), (64, 128, 2048, 8, torch.bfloat16, True),
    (1, 32, 256, 1, torch.bfloat16, True), (3, 32, 256, 32, torch.float16, True), (5, 64, 512, 6, torch.float16, False),
    (2, 256, 4096, 8, torch.bfloat16, True), (7, 1024, 8192, 32, torch.bfloat16, True), (9, 96, 768, 4, torch.float16, True),
]


def inputs(t, e, h, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g) * torch.exp2(torch.randint(-3, 4, (t, 1), generator=g).float())
    w = torch.randn(e, h, generator=g) * 0.05
    return x.to(dtype).cuda(), w.to(dtype).cuda()


def stable_top(logits, k, norm):
    """(indices, weights) of the stable order of a softmax of ``logits`` in fp32 (torch's ops on the GPU)."""
    p = torch.softmax(logits.float(), dim=-1)
    v, i = torch.sort(p, dim=-1, descending=True, stable=True)
    v, i = v[:, :k], i[:, :k]
    if norm:
        v = v / v.sum(dim=-1, keepdim=True)
    return i, v.to(logits.dtype)


def ulps_apart(a, b):
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max().item()


@pytest.mark.parametrize("t,e,h,k,dtype,norm", CASES)
def test_logits_topk_and_weights(t, e, h, k, dtype, norm):
    x, w = inputs(t, e, h, dtype, seed=t * 1000 + e + k)
    assert kernel_takes(x, w, k)
    logits, weights, idx = topk_route(x, w, k, norm)
    torch.cuda.synchronize()
    x64, w64 = x.double().cpu(), w.double().cpu()
    exact, terms = x64 @ w64.T, x64.abs() @ w64.abs().T
    bad, msg = rounding_violations(logits, exact, terms * (h / 32 + 6) * 2.0 ** -24)
    assert bad == 0, msg
    want_i, want_v = stable_top(logits, k, norm)
    assert idx.dtype == torch.int64 and torch.equal(idx, want_i)
    assert weights.dtype == dtype and ulps_apart(weights, want_v) <= 1


@pytest.mark.parametrize("k", [3, 2])
def test_ties_take_the_lower_expert_first_also_at_the_kth_place(k):
    x, w = inputs(2, 128, 2048, torch.bfloat16, seed=5)
    w[70] = w[5]
    w[100] = w[5]
    x[:] = w[5].sign() * 0.5  # row 5's logit (and its copies') the largest by far
    logits, weights, idx = topk_route(x, w, k, True)
    assert idx.tolist() == [[5, 70, 100][:k]] * 2
    assert torch.equal(weights[:, 0], weights[:, 1])


def test_many_calls_and_graph_replays_give_the_same_results_with_no_sync():
    x, w = inputs(4, 128, 2048, torch.bfloat16, seed=9)
    first = [r.clone() for r in topk_route(x, w, 8, True)]
    with no_syncs():
        for _ in range(100):
            got = topk_route(x, w, 8, True)
    assert all(torch.equal(a, b) for a, b in zip(first, got))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g):
        outs = [topk_route(x, w, 8, True) for _ in range(3)]
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(50):
        for o in outs:
            for t in o:
                t.fill_(-1) if t.dtype == torch.int64 else t.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for o in outs for a, b in zip(first, o))


@pytest.mark.parametrize("t", [1, 16, 64, 65])
def test_the_module_agrees_with_transformers_router_where_the_logits_agree(t):
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = transformers.Qwen3MoeConfig(hidden_size=2048, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)
    hf = Qwen3MoeTopKRouter(cfg).to(torch.bfloat16).cuda()
    x, w = inputs(t, 128, 2048, torch.bfloat16, seed=t)
    with torch.no_grad():
        hf.weight.copy_(w)
        want = hf(x)
        got = TopKRouter.from_router(hf)(x)
    x64, w64 = x.double().cpu(), w.double().cpu()
    exact, terms = x64 @ w64.T, x64.abs() @ w64.abs().T
    for logits in (want[0], got[0]):  # both within the rounding of an fp32 sum (in their own orders)
        assert rounding_violations(logits, exact, terms * (2048 / 32 + 6) * 2.0 ** -24)[0] == 0
    same_rows = (want[0] == got[0]).all(dim=-1)  # a row differs where the two fp32 sums straddle a midpoint
    if t >= 16:
        assert same_rows.float().mean() > 0.5
    for r in same_rows.nonzero().flatten().tolist():
        p = torch.softmax(got[0][r].float(), -1).sort(descending=True).values[:9]
        if (p[:-1] != p[1:]).all():  # no tie among the top k + 1: the order is determined, and must agree
            assert torch.equal(want[2][r], got[2][r])
            assert ulps_apart(want[1][r], got[1][r]) <= 1
        else:
            assert torch.equal(want[2][r].sort().values, got[2][r].sort().values) or p[7] == p[8]
    if t > 64:  # past MAX_TOKENS: the torch ops themselves
        assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_a_tiny_moe_model_generates_the_same_tokens_from_a_graph():
    transformers = pytest.importorskip("transformers")
    from nvfp4_gemv import generate, quantize_model

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=512, max_position_embeddings=64, intermediate_size=256,
                                      moe_intermediate_size=128, head_dim=64, num_experts=32, num_experts_per_tok=4,
                                      norm_topk_prob=True, initializer_range=0.1, pad_token_id=0, bos_token_id=None,
                                      eos_token_id=None)
    model = quantize_model(transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval().cuda(), fuse=True)
    # fuse=True made both routers TopKRouter (nothing left for fuse_routers)
    assert all(isinstance(m.mlp.gate, TopKRouter) for m in model.model.layers) and fuse_routers(model) == 0
    ids = torch.tensor([[5, 17, 99, 3, 250, 42]], device="cuda")
    want = model.generate(ids, max_new_tokens=12, do_sample=False, cache_implementation="static")
    assert torch.equal(generate(model, ids, 12), want)


def test_strided_rows_of_x_reach_the_kernel():
    x, w = inputs(5, 128, 2048, torch.bfloat16, seed=13)
    big = torch.zeros(5, 2048 + 512, dtype=torch.bfloat16, device="cuda")
    big[:, 256:256 + 2048] = x
    xs = big[:, 256:256 + 2048]
    assert kernel_takes(xs, w, 8)
    got, want = topk_route(xs, w, 8, True), topk_route(x, w, 8, True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_zero_input_gives_equal_logits_and_the_first_experts():
    """x = 0 (a padding row): every logit +0, so the top k are experts 0..k-1 in order, each 1/k."""
    x = torch.zeros(2, 2048, dtype=torch.bfloat16, device="cuda")
    w = inputs(1, 128, 2048, torch.bfloat16, seed=3)[1]
    logits, weights, idx = topk_route(x, w, 8, True)
    assert (logits == 0).all() and idx.tolist() == [list(range(8))] * 2
    assert (weights == torch.tensor(1 / 8, dtype=torch.bfloat16)).all()


def test_logits_rounded_to_minus_and_plus_zero_tie_and_go_to_the_lower_expert():
    """fp16 sums of -2^-30 and +2^-30 round to -0 and +0: equal logits, so the lower expert (the -0 one here)
    comes first, as for any other tie; every other logit is -2^-12."""
    x = torch.zeros(1, 256, dtype=torch.float16, device="cuda")
    x[0, 0] = 2.0 ** -12
    w = torch.zeros(32, 256, dtype=torch.float16, device="cuda")
    w[:, 0] = -1.0
    w[3, 0], w[7, 0] = -(2.0 ** -18), 2.0 ** -18
    logits, weights, idx = topk_route(x, w, 2, True)
    bits = logits.view(torch.int16)[0]
    assert bits[3].item() == -32768 and bits[7].item() == 0  # the logits themselves keep their signs
    assert idx.tolist() == [[3, 7]] and torch.equal(weights[0, 0], weights[0, 1])


def test_all_experts_without_renormalising_is_the_softmax():
    x, w = inputs(3, 32, 256, torch.float16, seed=4)
    logits, weights, idx = topk_route(x, w, 32, False)
    want_i, want_v = stable_top(logits, 32, False)
    assert torch.equal(idx, want_i) and ulps_apart(weights, want_v) <= 1


def test_a_weight_the_kernel_cannot_read_takes_the_torch_ops():
    x, w = inputs(3, 128, 2048, torch.bfloat16, seed=6)
    wt = w.T.contiguous().T  # the same values, column-major
    assert not kernel_takes(x, wt, 8)
    got, want = topk_route(x, wt, 8, True), route_torch(x, wt, 8, True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_route_torch_is_the_cpu_path():
    x, w = inputs(3, 64, 512, torch.bfloat16, seed=1)
    a = route_torch(x.cpu(), w.cpu(), 4, True)
    b = topk_route(x.cpu(), w.cpu(), 4, True)
    assert all(torch.equal(u, v) for u, v in zip(a, b))

"""fuse_linears: one GEMV for sibling linears that read one input (q/k/v, gate/up), on the CPU (the ops'
exact references, so a fused model must give the unfused model's outputs bit for bit) and on the GPU.

The contract: the state_dict keeps ModelOpt's names and shapes; the parts' buffers are views of one
concatenation (no second copy of a weight); one GEMV a group a forward, eager and under torch.compile
(no graph break); groups one GEMV cannot compute stay unfused; a call pattern that does not fit
dissolves the group with one warning and stays correct."""

import copy
import warnings

import pytest
import torch

import nvfp4_gemv.model.linear as linear_mod
from nvfp4_gemv import NVFP4Linear, fuse_linears, quantize_model, quantize_weight
from sync_free import no_syncs

ALONE_RUNS = set(linear_mod._ALONE_RUNS.values())  # the paths of a module computing alone


class Block(torch.nn.Module):
    """The two sibling groups of a decoder layer, called as transformers' Llama calls them."""

    def __init__(self, hidden=128, q=256, kv=128, inter=384, bias=False, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        lin = lambda i, o: torch.nn.Linear(i, o, bias=bias, dtype=torch.bfloat16)  # noqa: E731
        self.q_proj, self.k_proj, self.v_proj = lin(hidden, q), lin(hidden, kv), lin(hidden, kv)
        self.o_proj = lin(q, hidden)
        self.gate_proj, self.up_proj, self.down_proj = lin(hidden, inter), lin(hidden, inter), lin(inter, hidden)
        with torch.no_grad():
            for i, p in enumerate(self.parameters()):
                # each its own amax (so its own weight_scale_2): random draws alone can tie in bf16
                p.normal_(0, 0.05).clamp_(-0.15, 0.15).view(-1)[0] = 0.16 + 0.01 * i

    def forward(self, x):
        k, v = self.k_proj(x), self.v_proj(x)  # grouped heads: k and v repeated up to q's width
        a = self.q_proj(x) + torch.cat([k, v] * (self.q_proj.out_features // (2 * k.shape[-1])), dim=-1)
        h = x + self.o_proj(a)
        return h + self.down_proj(torch.nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


def pair(mode="w4a16", bias=False):
    """(unfused, fused) quantized copies of one Block with the same bytes (the fused one's group-wide
    global scales loaded into the unfused one)."""
    base = Block(bias=bias)
    scales = {n: torch.tensor(0.01) for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)}
    fused = quantize_model(copy.deepcopy(base), mode=mode, skip=(), input_scales=scales, fuse=True)
    plain = quantize_model(copy.deepcopy(base), mode=mode, skip=(), input_scales=scales)
    plain.load_state_dict(fused.state_dict())
    return plain, fused


def one_global_scale(model, value=2.0 ** -10):
    """Gives every NVFP4Linear of ``model`` the same weight_scale_2 (so that only the other rules decide)."""
    for mod in model.modules():
        if isinstance(mod, NVFP4Linear):
            mod.weight_scale_2 = torch.tensor(value)
    return model


def x_of(*lead, hidden=128, seed=1):
    torch.manual_seed(seed)
    return torch.randn(*lead, hidden, dtype=torch.bfloat16)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=200, head_dim=64)
    return LlamaForCausalLM(cfg).to(torch.bfloat16).eval(), cfg


def compile_recording(model):
    """``torch.compile(model, fullgraph=True)`` with a backend that keeps the FX graphs it is given."""
    graphs = []

    def backend(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(model, fullgraph=True, backend=backend), graphs


def gemv_nodes(graph_module):
    return [n for n in graph_module.graph.nodes if n.op == "call_function" and "nvfp4.gemv" in str(n.target)]


def ulps(got, want):
    """|got - want| in bf16 ulps of the larger magnitude (magnitudes under 2^-20 count as 2^-20)."""
    eps = torch.finfo(torch.bfloat16).eps
    scale = torch.maximum(got.abs(), want.abs()).float().clamp_min(2 ** -20)
    return ((got.float() - want.float()).abs() / (scale * eps)).max().item()


class CountGemv:
    """Counts calls of the op the module's forward makes."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = linear_mod.gemv

        def counted(*a, **k):
            self.n += 1
            return real(*a, **k)

        monkeypatch.setattr(linear_mod, "gemv", counted)


# ----------------------------------------------------------------------------------------------------
# What fusing does to the modules
# ----------------------------------------------------------------------------------------------------


def test_quantize_model_fuse_fuses_both_groups_and_names_them():
    base = Block()
    names = fuse_linears(quantize_model(copy.deepcopy(base), skip=()))  # per-linear global scales: no group
    assert names == []
    m = quantize_model(base, skip=(), fuse=True)
    assert m.q_proj._siblings is not None and m.gate_proj._siblings is not None
    assert m.o_proj._siblings is None and m.down_proj._siblings is None
    assert m.q_proj._siblings.name == "{q_proj,k_proj,v_proj}"
    assert fuse_linears(m) == []  # already fused


def test_a_group_is_quantized_with_one_global_scale_the_groups_amax():
    base = Block()
    w = torch.cat([base.q_proj.weight, base.k_proj.weight, base.v_proj.weight]).detach()
    q, s, ws2 = quantize_weight(w)
    m = quantize_model(base, skip=(), fuse=True)
    for name, lo, hi in (("q_proj", 0, 256), ("k_proj", 256, 384), ("v_proj", 384, 512)):
        part = getattr(m, name)
        assert torch.equal(part.weight_scale_2, ws2)
        assert torch.equal(part.weight, q[lo:hi])
        assert torch.equal(part.weight_scale.view(torch.uint8), s[lo:hi].view(torch.uint8))


def test_the_parts_buffers_are_row_views_of_the_owners_concatenation():
    _, m = pair(bias=True)
    owner = m.q_proj
    for name, lo in (("q_proj", 0), ("k_proj", 256), ("v_proj", 384)):
        part = getattr(m, name)
        for mine, fused, width in (("weight", "_fused_weight", 64), ("weight_scale", "_fused_weight_scale", 8),
                                   ("bias", "_fused_bias", 1)):
            t, f = getattr(part, mine), getattr(owner, fused)
            assert t.untyped_storage().data_ptr() == f.untyped_storage().data_ptr(), (name, mine)
            assert t.data_ptr() == f.data_ptr() + lo * width * f.element_size(), (name, mine)
    assert owner._fused_weight.shape == (512, 64)


def test_the_state_dict_keeps_the_checkpoint_names_and_shapes():
    plain, fused = pair(bias=True)
    a, b = plain.state_dict(), fused.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, k


@pytest.mark.parametrize("why, edit", [
    ("in_features", lambda blk: setattr(blk, "k_proj", torch.nn.Linear(64, 128, bias=False, dtype=torch.bfloat16))),
    ("bias", lambda blk: setattr(blk, "v_proj", torch.nn.Linear(128, 128, bias=True, dtype=torch.bfloat16))),
])
def test_siblings_one_gemv_cannot_compute_stay_unfused(why, edit):
    base = Block()
    edit(base)
    m = quantize_model(copy.deepcopy(base), skip=(), fuse=True)
    assert m.q_proj._siblings is None and m.k_proj._siblings is None, why
    assert m.gate_proj._siblings is not None
    m = one_global_scale(quantize_model(base, skip=()))  # fuse_linears' own check, with one global scale
    assert fuse_linears(m) == ["{gate_proj,up_proj}"], why


def test_a_group_with_a_part_left_in_bf16_stays_unfused():
    """fuse_linears asks each part whether it can join (``_why_not_fusable``); a plain ``nn.Linear`` cannot."""
    m = one_global_scale(quantize_model(Block(), skip=("q_proj",)))
    assert type(m.q_proj) is torch.nn.Linear
    assert fuse_linears(m) == ["{gate_proj,up_proj}"]
    assert m.k_proj._siblings is None and m.v_proj._siblings is None


def test_a_group_of_more_parts_than_part_paths_stays_unfused():
    """A part's path is one of ``fuse._PART_RUNS`` (16): a 17-part group stays unfused, a 16-part one fuses
    and gives its parts' results."""
    from nvfp4_gemv.model.fuse import _PART_RUNS

    names = tuple(f"p{i}" for i in range(len(_PART_RUNS) + 1))
    base = torch.nn.Module()
    torch.manual_seed(0)
    for n in names:
        setattr(base, n, torch.nn.Linear(128, 128, bias=False, dtype=torch.bfloat16))
    m = one_global_scale(quantize_model(base, skip=()))
    x = x_of(3)
    want = [getattr(m, n)(x) for n in names]
    over = copy.deepcopy(m)
    assert fuse_linears(over, groups=[names]) == []
    assert all(getattr(over, n)._siblings is None for n in names)
    assert fuse_linears(m, groups=[names[:-1]]) == ["{" + ",".join(names[:-1]) + "}"]
    assert all(torch.equal(getattr(m, n)(x), w) for n, w in zip(names[:-1], want))


def test_different_global_scales_or_input_scales_leave_a_group_unfused():
    base = Block()
    m = quantize_model(copy.deepcopy(base), skip=())  # each linear its own weight_scale_2
    assert fuse_linears(m) == []
    scales = {n: torch.tensor(0.01) for n, mod in base.named_modules() if isinstance(mod, torch.nn.Linear)}
    scales["k_proj"] = torch.tensor(0.02)
    m = quantize_model(copy.deepcopy(base), mode="w4a4", skip=(), input_scales=scales, fuse=True)
    assert m.q_proj._siblings is None and m.gate_proj._siblings is not None
    m = one_global_scale(quantize_model(base, mode="w4a4", skip=(), input_scales=scales))
    assert fuse_linears(m) == ["{gate_proj,up_proj}"]  # fuse_linears' own input_scale check


# ----------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead", [(1,), (5,), (2, 3)])
def test_a_fused_block_gives_the_unfused_blocks_result_bit_for_bit(mode, bias, lead):
    plain, fused = pair(mode, bias)
    x = x_of(*lead)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the normal call pattern warns of nothing
        for _ in range(2):  # a second forward starts a new round
            assert torch.equal(fused(x), plain(x))


def test_one_gemv_a_group_a_forward(monkeypatch):
    _, fused = pair()
    count = CountGemv(monkeypatch)
    fused(x_of(3))
    assert count.n == 4  # qkv, o, gate_up, down
    count.n = 0
    fused(x_of(3))
    assert count.n == 4


def test_each_part_returns_its_columns_of_the_one_product():
    plain, fused = pair()
    x = x_of(4)
    outs = [fused.q_proj(x), fused.k_proj(x), fused.v_proj(x)]
    for name, got in zip(("q_proj", "k_proj", "v_proj"), outs):
        assert torch.equal(got, getattr(plain, name)(x)), name
    assert fused.q_proj._siblings._x is None  # the round ended: nothing kept


def test_a_call_pattern_that_does_not_fit_dissolves_the_group_once_and_stays_correct(monkeypatch):
    plain, fused = pair()
    x, y = x_of(2), x_of(2, seed=5)
    with pytest.warns(UserWarning, match=r"\{q_proj,k_proj,v_proj\}: no longer fused"):
        fused.q_proj(x)
        got = fused.q_proj(y)  # q again before k and v took their part of x
    assert torch.equal(got, plain.q_proj(y))
    assert not fused.q_proj._siblings.active
    want = plain(x)
    count = CountGemv(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(fused(x), want)  # q, k, v alone now; gate/up still fused
    assert count.n == 6


def test_an_input_updated_in_place_between_calls_is_not_served_a_stale_result():
    plain, fused = pair()
    x = x_of(2)
    fused.q_proj(x)
    x.add_(1)  # the same object, new values: q's second call must not reuse the round's product
    with pytest.warns(UserWarning, match="no longer fused"):
        got = fused.q_proj(x)
    assert torch.equal(got, plain.q_proj(x))


def test_modes_that_differ_across_a_group_dissolve_it():
    plain, fused = pair("w4a4")
    fused.k_proj.mode = plain.k_proj.mode = "w4a16"
    x = x_of(2)
    with pytest.warns(UserWarning, match="modes differ"):
        got = fused(x)
    assert torch.equal(got, plain(x))


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("bias", [False, True])
def test_compiles_fullgraph_to_one_gemv_a_group(mode, bias):
    plain, fused = pair(mode, bias)
    f, graphs = compile_recording(fused)
    x = x_of(3)
    with torch.no_grad():
        assert torch.equal(f(x), plain(x))
        assert torch.equal(f(x_of(3, seed=2)), plain(x_of(3, seed=2)))
    assert len(graphs) == 1  # no recompile on the second round
    assert len(gemv_nodes(graphs[0])) == 4
    assert fused.q_proj._siblings._round is None  # a whole round keeps nothing


# ----------------------------------------------------------------------------------------------------
# Moves, loads, checkpoints
# ----------------------------------------------------------------------------------------------------


def test_a_device_move_re_points_every_part_at_the_moved_concatenation():
    _, fused = pair(bias=True)
    fused.to("meta")  # a real move (copies), on any machine
    owner = fused.q_proj
    assert owner._fused_weight.device.type == "meta" and owner._siblings.active
    for name in ("q_proj", "k_proj", "v_proj"):
        part = getattr(fused, name)
        assert part.weight._base is owner._fused_weight, name
        assert part.weight_scale._base is owner._fused_weight_scale, name
        assert part.bias._base is owner._fused_bias, name


def test_a_concatenation_moved_apart_from_the_input_ends_the_group():
    plain, fused = pair()
    fused.q_proj.to("meta")  # the owner alone: k and v stay on the CPU, the concatenation does not
    x = x_of(2)
    with pytest.warns(UserWarning, match="its concatenation is on meta"):
        got = fused.k_proj(x)
    assert torch.equal(got, plain.k_proj(x))


def test_a_module_shared_by_two_parents_joins_one_group():
    blk = Block()
    blk.extra = torch.nn.Module()
    blk.extra.q_proj, blk.extra.k_proj, blk.extra.v_proj = blk.q_proj, torch.nn.Linear(
        128, 128, bias=False, dtype=torch.bfloat16), blk.v_proj
    m = one_global_scale(quantize_model(blk, skip=()))
    names = fuse_linears(m)
    assert names == ["{q_proj,k_proj,v_proj}", "{gate_proj,up_proj}"]


@pytest.mark.parametrize("convert", [lambda m: m.half(), lambda m: m.to(torch.float32), lambda m: m.to("cpu")])
def test_dtype_and_device_moves_keep_the_views(convert):
    plain, fused = pair(bias=True)
    convert(fused)
    convert(plain)
    owner = fused.q_proj
    assert fused.k_proj.weight.untyped_storage().data_ptr() == owner._fused_weight.untyped_storage().data_ptr()
    assert owner._fused_weight_scale.dtype == torch.float8_e4m3fn
    assert fused.k_proj.bias.untyped_storage().data_ptr() == owner._fused_bias.untyped_storage().data_ptr()
    x = x_of(2).to(plain.q_proj.bias.dtype) if plain.q_proj.bias.dtype != torch.float32 else x_of(2)
    assert torch.equal(fused(x), plain(x))


def test_a_load_ends_the_groups_and_fuse_linears_fuses_them_again(monkeypatch):
    plain, fused = pair()
    scales = {n: torch.tensor(0.01) for n, m in fused.named_modules() if isinstance(m, NVFP4Linear)}
    other = quantize_model(Block(seed=3), skip=(), input_scales=scales, fuse=True)
    with pytest.warns(UserWarning, match="load_state_dict into a fused module"):
        fused.load_state_dict(other.state_dict())
    plain.load_state_dict(other.state_dict())
    x = x_of(2)
    assert not fused.q_proj._siblings.active
    assert torch.equal(fused(x), plain(x))
    assert fuse_linears(fused) == ["{q_proj,k_proj,v_proj}", "{gate_proj,up_proj}"]
    assert fused.k_proj.weight._base is fused.q_proj._fused_weight
    want = plain(x)
    count = CountGemv(monkeypatch)
    assert torch.equal(fused(x), want)
    assert count.n == 4


def test_a_load_that_gives_a_group_different_global_scales_leaves_it_unfused():
    plain, fused = pair()
    sd = fused.state_dict()
    sd["v_proj.weight_scale_2"] = sd["v_proj.weight_scale_2"] * 2
    with pytest.warns(UserWarning, match="load_state_dict"):
        fused.load_state_dict(sd)
    plain.load_state_dict(sd)
    assert fuse_linears(fused) == ["{gate_proj,up_proj}"]
    x = x_of(2)
    assert torch.equal(fused(x), plain(x))


@pytest.mark.parametrize("how", ["assign", "setattr", "functional_call"])
def test_a_buffer_replaced_by_any_route_ends_the_group_and_is_used(how):
    plain, fused = pair()
    x = x_of(2)
    sd = {k: v.clone() for k, v in plain.state_dict().items()}
    sd["k_proj.weight_scale_2"] = sd["k_proj.weight_scale_2"] * 2
    sd["v_proj.weight"] = torch.flip(sd["v_proj.weight"], dims=[0]).contiguous()
    ref = copy.deepcopy(plain)
    ref.load_state_dict(sd)
    with pytest.warns(UserWarning, match="no longer fused"):
        if how == "assign":
            fused.load_state_dict(sd, assign=True)
            got = fused(x)
        elif how == "setattr":
            fused.k_proj.weight_scale_2 = sd["k_proj.weight_scale_2"]
            fused.v_proj.weight = sd["v_proj.weight"]
            got = fused(x)
        else:
            got = torch.func.functional_call(fused, sd, (x,))
    assert torch.equal(got, ref(x))


def test_an_input_changed_in_place_between_two_parts_is_seen_by_the_second():
    plain, fused = pair()
    x = x_of(2)
    fused.q_proj(x)
    x.mul_(3)
    with pytest.warns(UserWarning, match="changed in place"):
        got = fused.k_proj(x)
    assert torch.equal(got, plain.k_proj(x))


def test_a_load_onto_the_meta_device_does_not_compare_values():
    _, fused = pair()
    sd = fused.state_dict()
    fused.to("meta")
    with pytest.warns(UserWarning, match="load_state_dict"):
        fused.load_state_dict(sd, assign=True)
    assert fused.k_proj.weight.device.type == "cpu"


class Twice(torch.nn.Module):
    """A parent whose q/k/v the model calls in a pattern one round cannot serve (q on two inputs)."""

    def __init__(self, blk):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = blk.q_proj, blk.k_proj, blk.v_proj

    def forward(self, x, y):
        return self.q_proj(x) + self.q_proj(y) + torch.cat([self.k_proj(x), self.v_proj(x)], dim=-1)


def test_under_compile_a_pattern_that_does_not_fit_warns_and_is_right():
    plain, fused = pair()
    torch._dynamo.reset()
    f = torch.compile(Twice(fused), fullgraph=True, backend="eager")
    x, y = x_of(2), x_of(2, seed=4)
    with pytest.warns(UserWarning, match="no longer fused"):
        got = f(x, y)
    assert torch.equal(got, Twice(plain)(x, y))
    # the group ended while traced; the first eager call gives each part its own GEMV, as the warning says
    assert torch.equal(Twice(fused)(x, y), Twice(plain)(x, y))
    assert all(m._run in ALONE_RUNS for m in (fused.q_proj, fused.k_proj, fused.v_proj))


def test_a_fused_llama_saves_loads_and_fuses_again(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from transformers import LlamaForCausalLM

    from nvfp4_gemv import load_modelopt, save_modelopt

    base, cfg = tiny_llama()
    fused = quantize_model(copy.deepcopy(base), fuse=True)
    assert sum(m._siblings is not None for m in fused.modules() if isinstance(m, NVFP4Linear)) == 10
    save_modelopt(fused, str(tmp_path))
    loaded = load_modelopt(LlamaForCausalLM(cfg).to(torch.bfloat16).eval(), str(tmp_path), fuse=True)
    plain = load_modelopt(LlamaForCausalLM(cfg).to(torch.bfloat16).eval(), str(tmp_path))
    assert sum(m._siblings is not None for m in loaded.modules() if isinstance(m, NVFP4Linear)) == 10
    ids = torch.randint(0, 200, (2, 5))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # transformers' layers call each group's parts once on one tensor
        want = fused(ids).logits
        assert torch.equal(loaded(ids).logits, want)
        assert torch.equal(plain(ids).logits, want)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_a_fused_llama_compiles_fullgraph_with_one_gemv_a_group(mode):
    pytest.importorskip("transformers")
    base, _ = tiny_llama()
    scales = {n: torch.tensor(0.01) for n, m in base.named_modules()
              if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    fused = quantize_model(copy.deepcopy(base), mode=mode, input_scales=scales, fuse=True)
    f, graphs = compile_recording(fused)
    ids = torch.randint(0, 200, (2, 5))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = f(input_ids=ids).logits
        want = fused(input_ids=ids).logits
    assert torch.equal(got, want)
    assert len(gemv_nodes(graphs[0])) == 2 * 4  # two layers of qkv, o, gate_up, down


# ----------------------------------------------------------------------------------------------------
# On the GPU: the kernels, no syncs, CUDA graphs
# ----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("n", [1, 4, 16])
def test_gpu_fused_block_matches_its_parts_without_syncs_and_in_a_graph(mode, n):
    # shapes the kernels route as a model's: 4096 -> q 4096, k/v 1024 (qkv 6144), gate/up 2 x 14336
    base = Block(hidden=4096, q=4096, kv=1024, inter=14336)
    scales = {nm: torch.tensor(0.004) for nm, m in base.named_modules() if isinstance(m, torch.nn.Linear)}
    fused = quantize_model(copy.deepcopy(base).cuda(), mode=mode, skip=(), input_scales=scales, fuse=True)
    plain = quantize_model(copy.deepcopy(base).cuda(), mode=mode, skip=(), input_scales=scales)
    plain.load_state_dict(fused.state_dict())
    assert fused.q_proj._siblings is not None and fused.gate_proj._siblings is not None
    x = x_of(n, hidden=4096).cuda()
    want = [plain.q_proj(x), plain.k_proj(x), plain.v_proj(x), plain.gate_proj(x), plain.up_proj(x)]
    fused(x)  # warm up (compiles, plans)
    with no_syncs():
        got = [fused.q_proj(x), fused.k_proj(x), fused.v_proj(x), fused.gate_proj(x), fused.up_proj(x)]
    for name, g, w in zip(("q", "k", "v", "gate", "up"), got, want):
        # different row counts may route to different kernels: each within the op's bound of the exact
        # sum, so within 2 ulps of each other (the ulp of the larger magnitude)
        assert ulps(g, w) <= 2, name
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fused(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, fused(x))


@pytest.mark.gpu
def test_gpu_a_block_fused_on_the_cpu_then_moved_keeps_one_copy_and_its_results():
    _, fused = pair(bias=True)
    x = x_of(3)
    parts = ("q_proj", "k_proj", "v_proj")
    want = [getattr(fused, n)(x) for n in parts]  # the exact CPU products
    fused.cuda()
    owner = fused.q_proj
    for name in parts:
        part = getattr(fused, name)
        assert part.weight.is_cuda and part.weight.untyped_storage().data_ptr() == \
            owner._fused_weight.untyped_storage().data_ptr(), name
    xg = x.cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = [getattr(fused, n)(xg).cpu() for n in parts]
    for name, g, w in zip(parts, got, want):
        assert ulps(g, w) <= 1, name


@pytest.mark.parametrize("how", ["setattr", "assign", "mode"])
def test_under_compile_a_change_after_compiling_ends_the_group_and_is_used(how):
    # compiled code does not check the parts' buffers each call: the change itself ends the group (or
    # re-chooses the path), and the compiled forward is guarded on the path chosen
    plain, fused = pair()
    f = torch.compile(fused, fullgraph=True, backend="eager")
    x = x_of(2)
    assert torch.equal(f(x), plain(x))
    sd = {k: v.clone() for k, v in plain.state_dict().items()}
    sd["v_proj.weight"] = torch.flip(sd["v_proj.weight"], dims=[0]).contiguous()
    with pytest.warns(UserWarning, match="no longer fused"):
        if how == "setattr":
            fused.v_proj.weight = sd["v_proj.weight"]
        elif how == "assign":
            fused.load_state_dict(sd, assign=True)
        else:  # one part's mode changed: one GEMV cannot serve the group
            fused.k_proj.mode = "w4a4"
            f(x)
    if how == "mode":
        plain.k_proj.mode = "w4a4"
    else:
        plain.load_state_dict(sd)
        # the end re-chose every part's path at once (what generate's kept capture and dynamo's guards read)
        assert all(m._run in ALONE_RUNS for m in (fused.q_proj, fused.k_proj, fused.v_proj))
    assert torch.equal(f(x), plain(x))


def test_a_fused_module_saved_whole_loads_and_computes_the_same():
    import io

    plain, fused = pair()
    x = x_of(2)
    buf = io.BytesIO()
    torch.save(fused, buf)  # the whole module pickled: its path functions by name
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    assert torch.equal(again(x), plain(x)) and again.q_proj._siblings.active


def test_a_module_pickled_before_the_path_was_chosen_once_still_runs_fused():
    """A pickle of the layout before this round ("mode" a plain attribute, no _run / _kernel; groups without
    _outs) loads, chooses its path and computes the same, still fused."""
    import io
    import pickle
    import types

    plain, fused = pair()
    x = x_of(2)
    sib = fused.q_proj._siblings

    class Old(pickle.Pickler):
        def reducer_override(self, obj):  # write each part and the group as the older code held them
            if isinstance(obj, NVFP4Linear):
                state = dict(obj.__dict__)
                state["mode"] = state.pop("_mode")
                del state["_run"], state["_kernel"]
                return (object.__new__, (NVFP4Linear,), state)
            if obj is sib:
                state = {k: v for k, v in obj.__dict__.items() if k != "_outs"}
                return (object.__new__, (type(obj),), state)
            return NotImplemented

    buf = io.BytesIO()
    torch.save(fused, buf, pickle_module=types.SimpleNamespace(Pickler=Old, __name__="pickle"))
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    assert again.q_proj.mode == "w4a16" and again.q_proj._siblings.active
    assert {p._run.__name__ for p in (again.q_proj, again.k_proj, again.v_proj)} == {"_run_part0", "_run_part1",
                                                                                     "_run_part2"}
    assert torch.equal(again(x), plain(x))


class HoldPart:
    """A forward hook that refers to another module (pickled with the module it hooks)."""

    def __init__(self, part):
        self.part = part

    def __call__(self, mod, args, out):
        return out


def test_a_copy_restored_part_before_its_owner_keeps_the_group():
    """Pickle (and deepcopy) may restore a part before its group's owner (here: a hook on the owner holds
    the part): the paths are chosen once every part's state is there."""
    import io

    plain, fused = pair()
    fused.q_proj.register_forward_hook(HoldPart(fused.k_proj))
    x = x_of(2)
    with torch.no_grad():
        want = plain(x)
        buf = io.BytesIO()
        torch.save(fused, buf)
        buf.seek(0)
        for copied in (copy.deepcopy(fused), torch.load(buf, weights_only=False)):
            assert copied.q_proj._siblings.active and copied.k_proj._run is linear_mod._PART_RUNS[1]
            assert torch.equal(copied(x), want)


def test_a_group_ended_while_traced_with_modes_that_differ_chooses_alone_paths_at_the_next_eager_call():
    plain, fused = pair()
    x = x_of(2)
    fused.k_proj.mode = "w4a4"  # the parts' kernels differ: each part's path ends the group at its call
    plain.k_proj.mode = "w4a4"
    assert fused.q_proj._run is linear_mod._run_mixed
    f = torch.compile(fused, fullgraph=True, backend="eager")
    with torch.no_grad(), pytest.warns(UserWarning, match="modes differ"):
        assert torch.equal(f(x), plain(x))
    fused.k_proj.mode = plain.k_proj.mode = "w4a16"
    with torch.no_grad():
        assert torch.equal(fused(x), plain(x))
    assert all(m._run in ALONE_RUNS for m in (fused.q_proj, fused.k_proj, fused.v_proj))


def test_a_fused_group_that_cannot_run_says_so_also_for_no_rows():
    fused = quantize_model(Block(), skip=(), fuse=True, pack=True)  # (no input scales)
    for m in (fused.q_proj, fused.k_proj, fused.v_proj, fused.o_proj):
        m.mode = "w4a4"  # neither packed nor without input scales can it: the group stays one (kernels agree)
    assert fused.q_proj._siblings.active
    for m in (fused.k_proj, fused.o_proj):  # a part of the group, a module alone
        for rows in (0, 2):
            with pytest.raises(ValueError, match="needs 'input_scale'"):
                m(x_of(rows, hidden=m.in_features))


def test_the_part_paths_keep_their_old_names_in_linear_for_pickles_made_before_they_moved():
    from nvfp4_gemv.model import fuse

    for i, run in enumerate(fuse._PART_RUNS):
        assert getattr(linear_mod, f"_run_part{i}") is run is getattr(fuse, f"_run_part{i}")
    assert linear_mod._run_mixed is fuse._run_mixed

"""shard_model (nvfp4_gemv.model.tp): tensor parallelism over gloo processes on the CPU (the ops' exact paths).

Each rank builds the same tiny Llama, quantizes it, keeps an unsharded copy and shards the other. Every
row-wise layer's output must be the fp32 sum of the ranks' partials rounded once (bit for bit) and within
the module docstring's bound of the unsharded layer on the gathered input; every column-wise layer's output
must be the unsharded layer's columns bit for bit; logits must agree within what those per-layer differences
give. Plans the model cannot take are refused by name at sharding time. A tiny Qwen3-MoE under transformers' own
plan: attention sharded, the experts (which the plan does not name) whole on every rank, logits as unsharded.
"""

import contextlib
import copy
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

transformers = pytest.importorskip("transformers")

from nvfp4_gemv import NVFP4Linear, calibrate_input_scales, quantize_model, shard_model  # noqa: E402

# every shard keeps out % 128 == 0 and in % 64 == 0 at world 2 and 4: q 1024, k/v 512, o in 1024, gate/up 512,
# down in 512 (a world-4 down shard: in 128, also packable)
DIMS = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
            num_hidden_layers=2, vocab_size=256, max_position_embeddings=64)


def _model(seed=0, **over):
    cfg = transformers.LlamaConfig(**{**DIMS, **over})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():  # larger than init's 0.02 so the products are not all tiny
        for name, p in model.named_parameters():
            if p.dim() == 2 and "proj" in name:
                p.mul_(4)
    return model


def _ids(seed=1, n=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, DIMS["vocab_size"], (2, n), generator=g)


def _quantized(mode, fuse, pack):
    model = _model()
    scales = None
    if mode == "w4a4":
        scales = calibrate_input_scales(model, lambda m: m(_ids(seed=7)))
    return quantize_model(model, mode=mode, input_scales=scales, fuse=fuse, pack=pack)


def _ulp(v):
    """bf16 spacing at |v| (0 at 0): 2**(floor(log2|v|) - 7)."""
    v = v.double()
    _, e = torch.frexp(v)
    return torch.where(v == 0, torch.zeros_like(v), torch.ldexp(torch.ones_like(v), e - 8))


def _gather(t, world):
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t.contiguous())
    return out


def _checks(model, ref, world, rank, stats):
    """Forward hooks on the sharded modules comparing each with the unsharded one on the gathered input."""
    hooks = []
    for name, mod in model.named_modules():
        style = getattr(mod, "tp_style", None)
        if style is None:
            continue
        full = ref.get_submodule(name)

        def check(mod, args, out, name=name, full=full, style=style):
            x = args[0]
            if style == "experts":  # every rank routes the same tokens over its slice of each expert
                ps = torch.stack(_gather(mod.forward(*args), world))
                assert torch.equal(out, ps.float().sum(0).to(out.dtype)), f"{name}: not round(fp32 sum of the partials)"
                y1 = full(*args)
                # each slot's down product is rounded on each rank before the slots combine: a few bf16 ulps
                err = (out.double() - y1.double()).abs().max().item()
                assert err <= 2.0 ** -6 * y1.double().abs().max().item(), f"{name}: |y_tp - y_1| = {err}"
                stats["experts"] += 1
                return
            if style == "colwise":
                y1 = full(x)
                n = y1.shape[-1] // world
                assert torch.equal(out, y1[..., rank * n:(rank + 1) * n]), f"{name}: colwise shard != its columns"
                stats["colwise"] += 1
                return
            p = mod.forward(x)  # this rank's partial (forward skips the all-reduce hook)
            ps = torch.stack(_gather(p, world))
            y1 = full(torch.cat(_gather(x, world), dim=-1))
            want = ps.float().sum(0).to(out.dtype)
            assert torch.equal(out, want), f"{name}: not round(fp32 sum of the partials): " \
                f"max diff {(out.double() - want.double()).abs().max().item()}"
            bound = 0.5 * _ulp(out) + 0.5 * _ulp(ps).sum(0) + 0.5 * _ulp(y1) + 2.0 ** -24 * ps.double().abs().sum(0)
            err = (out.double() - y1.double()).abs()
            assert bool((err <= bound).all()), f"{name}: |y_tp - y_1| exceeds the bound by {(err - bound).max().item()}"
            stats["rowwise"] += 1
            stats["rowwise_equal"] += int(torch.equal(out, y1))
        hooks.append(mod.register_forward_hook(check))
    return hooks


def _checked_logits(model, ref, world, rank):
    """The sharded model's logits on ``_ids()``, each sharded layer checked against ``ref``'s (``_checks``) on
    the way; and the checks' counts."""
    stats = {"colwise": 0, "rowwise": 0, "rowwise_equal": 0, "experts": 0}
    hooks = _checks(model, ref, world, rank, stats)
    try:
        with torch.no_grad():
            return model(_ids()).logits, stats
    finally:
        for h in hooks:
            h.remove()


def _assert_logits_agree(logits, want, mode, world, rank, label, extra=""):
    """The sharded logits within the tolerance of the unsharded ones, and the same on every rank. Each row-wise
    output is within ~1.5 ulp of the unsharded one (checked layer by layer); through 2 layers and the head
    that stays a few bf16 ulps of the logits' scale in mode w4a16. In mode w4a4 the next layer quantizes its
    input to e2m1: an ulp across a rounding boundary moves a value by a whole e2m1 step (up to 1/3 of its
    block's max), so only a coarse agreement is asked of the logits there."""
    scale = want.abs().max().item()
    diff = (logits.double() - want.double()).abs().max().item()
    tol = (2 ** -5 if mode == "w4a16" else 2 ** -2) * scale
    if rank == 0:
        print(f"{label}: max |logits diff| {diff:.4g} (scale {scale:.4g})" + (f", {extra}" if extra else ""))
    assert diff <= tol, f"{label}: logits differ by {diff} (scale {scale})"
    assert all(torch.equal(g, logits) for g in _gather(logits, world)), "ranks disagree on the logits"


def _report(errfile, rank, e):
    """A failing rank's reason, for _spawn to show."""
    import traceback

    with open(f"{errfile}.{rank}", "w") as f:
        f.write(f"rank {rank}: {e!r}\n{traceback.format_exc()}")


@contextlib.contextmanager
def _rank(rank, world, init, errfile):
    """This process as rank ``rank`` of a gloo group of ``world``: a failure inside is written to ``errfile``
    for _spawn (with the rank) and raised; the group is destroyed at the end."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        yield
    except BaseException as e:  # noqa: BLE001 (reported to the parent with its rank)
        _report(errfile, rank, e)
        raise
    finally:
        dist.destroy_process_group()


def _worker(rank, world, init, errfile, cases):
    with _rank(rank, world, init, errfile):
        for mode, fuse, pack in cases:
            ref = _quantized(mode, fuse, pack)
            model = _quantized(mode, fuse, pack)  # the same model again (seeded), to shard
            done = shard_model(model)  # rank, world from the process group; default plan from the config
            assert sorted(set(done.values())) == ["colwise", "rowwise"] and len(done) == 7 * DIMS["num_hidden_layers"]
            attn = model.model.layers[0].self_attn
            assert attn.q_proj.out_features == 1024 // world and attn.o_proj.in_features == 1024 // world
            if fuse:
                assert attn.q_proj._siblings is not None and attn.q_proj._siblings.active, "shards not fused again"
                assert model.model.layers[0].mlp.gate_proj._siblings.active
            if pack:
                assert attn.o_proj.packed and attn.q_proj.packed
            logits, stats = _checked_logits(model, ref, world, rank)
            with torch.no_grad():
                want = ref(_ids()).logits
            assert stats["rowwise"] == 2 * DIMS["num_hidden_layers"] and stats["colwise"] > 0, stats
            _assert_logits_agree(logits, want, mode, world, rank, f"tp{world} {mode} fuse={fuse} pack={pack}",
                                 f"row-wise outputs equal to unsharded: {stats['rowwise_equal']}/{stats['rowwise']}")


def _spawn(world, cases, tmp_path, worker=None, *args):
    """``worker(rank, world, init, errfile, *args, cases)`` (default ``_worker``) on ``world`` gloo processes.
    A rank that fails a check writes why (errfile) and fails the test; a rank lost without a word (seen
    in full-suite runs: gloo's threads abort, "terminate called without an active exception", before any check
    ran; once twice in a row) is tried up to twice more."""
    for attempt in range(3):
        init = f"file://{tmp_path / f'rendezvous{attempt}'}"
        errfile = str(tmp_path / f"error{attempt}")
        try:
            mp.spawn(worker or _worker, args=(world, init, errfile, *args, cases), nprocs=world, join=True)
            return
        except Exception as e:  # noqa: BLE001
            msgs = [open(f"{errfile}.{r}").read() for r in range(world) if os.path.exists(f"{errfile}.{r}")]
            if msgs or attempt == 2:
                pytest.fail("\n".join(msgs) or f"a rank failed: {type(e).__name__}: {e}")


def test_tp2_matches_unsharded(tmp_path):
    _spawn(2, [("w4a16", False, False), ("w4a16", True, False), ("w4a4", True, False),
               ("w4a16", True, True)], tmp_path)


def test_tp4_matches_unsharded(tmp_path):
    _spawn(4, [("w4a16", True, False), ("w4a4", False, False)], tmp_path)


# -- refusals: no processes needed (sharding communicates nothing) -------------------------------------


def _refused(model, world, match, plan=None, exc=ValueError):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(exc, match=match):
        shard_model(model, rank=0, world_size=world, plan=plan)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), "model changed"


def test_refuses_cut_scale_group():
    model = quantize_model(_model())
    # down_proj: in 512 over 64 ranks is 8 values a shard, half a scale group
    _refused(model, 64, r"'model\.layers\.0\.mlp\.down_proj'.*cut a 16-value scale group",
             plan={"model.layers.*.mlp.down_proj": "rowwise"})


def test_refuses_kernel_granularity():
    model = quantize_model(_model())
    # in 512 over 16 ranks: 32 a shard, whole scale groups but not in % 64 == 0
    _refused(model, 16, r"'model\.layers\.0\.mlp\.down_proj'.*kernels do not take.*in_features % 64",
             plan={"model.layers.*.mlp.down_proj": "rowwise"})
    # k_proj 512 rows over 8 ranks: 64 rows a shard, not out % 128 == 0 (and 4 KV heads over 8 ranks)
    _refused(model, 8, r"'model\.layers\.0\.self_attn\.k_proj'.*out_features % 128.*num_key_value_heads=4")


def test_refuses_indivisible_and_unsupported():
    model = quantize_model(_model())
    _refused(model, 3, r"down_proj': rowwise: in_features=512 is not divisible by world_size=3")
    _refused(model, 2, r"style 'colwise_gather_output' is not supported",
             plan={"lm_head": "colwise_gather_output"}, exc=NotImplementedError)
    packed = quantize_model(_model(), pack=True)
    # a packed row-wise shard of in 64 (down: 512 over 8) cannot be packed
    _refused(packed, 8, r"down_proj': rowwise: packed.*in_features % 128", plan={"model.layers.*.mlp.down_proj": "rowwise"})


def test_refuses_partly_sharded_fused_group():
    model = quantize_model(_model(), fuse=True)
    _refused(model, 2, r"fused group 'model\.layers\.0\.self_attn\.\{q_proj,k_proj,v_proj\}'",
             plan={"model.layers.*.self_attn.q_proj": "colwise"})


def test_world_one_is_a_no_op():
    model = quantize_model(_model())
    assert len(shard_model(model, rank=0, world_size=1)) == 14
    assert isinstance(model.model.layers[0].mlp.down_proj, NVFP4Linear)
    assert model.model.layers[0].mlp.down_proj.in_features == 512


def test_attention_modules_own_head_counts_are_divided():
    """Models whose attention modules keep their head counts (older transformers, other models) get them
    divided by the world size where q/k/v are sharded by rows; a bool of the same name stays as it is."""
    model = quantize_model(_model())
    attn = model.model.layers[0].self_attn
    attn.num_heads, attn.num_key_value_heads, attn.num_attention_heads = 8, 4, True
    shard_model(model, rank=1, world_size=2)
    assert (attn.num_heads, attn.num_key_value_heads, attn.num_attention_heads) == (4, 2, True)
    assert not hasattr(model.model.layers[1].mlp, "num_heads")


def test_replicated_entries_of_transformers_plans_stay_whole():
    """Qwen3's plan marks q_norm / k_norm "replicated_with_grad_allreduce": those stay as they are, the
    projections around them are sharded."""
    cfg = transformers.Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=4, head_dim=64, vocab_size=512)
    torch.manual_seed(0)
    model = quantize_model(transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval())
    norm = model.model.layers[0].self_attn.q_norm.weight
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no plan entry goes unused
        styles = shard_model(model, rank=0, world_size=2)
    assert "model.layers.0.self_attn.q_norm" not in styles and styles["model.layers.0.self_attn.q_proj"] == "colwise"
    assert model.model.layers[0].self_attn.q_norm.weight is norm
    assert model.model.layers[0].self_attn.q_proj.out_features == 128



# -- a mixture-of-experts model: transformers' plan shards attention; the experts stay whole -------------

MOE = dict(DIMS, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
           mlp_only_layers=[])


def _moe_quantized(mode):
    from nvfp4_gemv import NVFP4Experts

    cfg = transformers.Qwen3MoeConfig(**MOE)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and ("proj" in name or "experts" in name):
                p.mul_(4)
    scales = None
    if mode == "w4a4":
        from nvfp4_gemv import calibrate_expert_input_scales

        scales = {**calibrate_input_scales(model, lambda m: m(_ids(seed=7))),
                  **calibrate_expert_input_scales(model, lambda m: m(_ids(seed=7)))}
    quantize_model(model, mode=mode, input_scales=scales)
    assert all(isinstance(layer.mlp.experts, NVFP4Experts) for layer in model.model.layers)
    return model


def _moe_worker(rank, world, init, errfile, cases):
    with _rank(rank, world, init, errfile):
        from nvfp4_gemv.model.tp import default_plan

        layers = MOE["num_hidden_layers"]
        for mode, shard_experts in cases:
            ref, model = _moe_quantized(mode), _moe_quantized(mode)
            experts = [layer.mlp.experts for layer in model.model.layers]
            held = [dict(e.named_buffers()) for e in experts]
            plan = None
            if shard_experts:  # transformers' plan leaves the experts out: named here
                plan = {**default_plan(model), "model.layers.*.mlp.experts": "experts"}
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # every entry of transformers' plan applies, or is its own
                warnings.filterwarnings("ignore", message=r".*mlp\.(down|gate|up)_proj.*match no module")
                done = shard_model(model, plan=plan)
            want_done = {f"model.layers.{i}.self_attn.{p}" for i in range(layers)
                         for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
            if shard_experts:
                want_done |= {f"model.layers.{i}.mlp.experts" for i in range(layers)}
                e = model.model.layers[0].mlp.experts
                i = MOE["moe_intermediate_size"] // world
                assert e.intermediate_dim == i and tuple(e.gate_up_weight.shape) == (4, 2 * i, MOE["hidden_size"] // 2)
                assert tuple(e.down_weight_scale.shape) == (4, MOE["hidden_size"], i // 16)
            else:
                for e, h in zip(experts, held):  # replicated: the same module, its tensors untouched
                    assert all(t is h[n] for n, t in e.named_buffers())
            assert set(done) == want_done, sorted(done)
            logits, stats = _checked_logits(model, ref, world, rank)
            with torch.no_grad():
                want = ref(_ids()).logits
            assert stats["rowwise"] == layers and stats["colwise"] > 0, stats
            assert stats["experts"] == (layers if shard_experts else 0), stats
            # as for the Llama; the router's top-k can flip on an ulp only where two experts' scores tie that closely
            _assert_logits_agree(logits, want, mode, world, rank,
                                 f"moe tp{world} {mode} experts {'sharded' if shard_experts else 'whole'}")


def test_tp2_qwen3_moe_shards_attention_keeps_the_experts_whole_and_matches_unsharded(tmp_path):
    _spawn(2, [("w4a16", False), ("w4a4", False)], tmp_path, _moe_worker)


@pytest.mark.parametrize("world", [2, 4])
def test_qwen3_moe_experts_sharded_by_their_intermediate_dimension_match_unsharded(tmp_path, world):
    _spawn(world, [("w4a16", True), ("w4a4", True)], tmp_path, _moe_worker)


def test_an_entry_of_the_users_plan_that_matches_nothing_is_warned_of_by_name():
    # (a model's own plan is not: Qwen3-MoE's names dense mlp projections that an all-MoE model lacks)
    model = quantize_model(_model())
    with pytest.warns(UserWarning, match=r"plan entries \['model.layers.\*.mlp.dense'\] match no module"):
        shard_model(model, rank=0, world_size=2, plan={"model.layers.*.mlp.down_proj": "rowwise",
                                                       "model.layers.*.mlp.dense": "colwise"})


@pytest.mark.parametrize("plan, world, exc, match", [
    ({"model.layers.*.mlp.experts": "colwise"}, 2, NotImplementedError, r"experts': NVFP4Experts shard by style 'experts'"),
    ({"model.layers.*.self_attn.o_proj": "experts"}, 2, NotImplementedError, r"o_proj': style 'experts' shards NVFP4Experts only"),
    ({"model.layers.*.mlp.experts": "experts"}, 16, ValueError, r"experts': experts: a shard of intermediate_dim=8 would cut"),
    ({"model.layers.*.mlp.experts": "experts"}, 3, ValueError, r"intermediate_dim=128 is not divisible by world_size=3"),
])
def test_experts_plans_the_model_cannot_take_are_refused_by_name(plan, world, exc, match):
    _refused(_moe_quantized("w4a16"), world, match, plan=plan, exc=exc)


# -- from_pretrained(tp_plan=...): each rank reads its shards only --------------------------------------


@contextlib.contextmanager
def _counting_reads():
    """``Checkpoint.read`` patched (in this rank's process) to note the bytes each tensor arrives with in the
    dict it yields ({key: bytes}); put back at the end."""
    from nvfp4_gemv.model import checkpoint

    read, real = {}, checkpoint.Checkpoint.read

    def counting(self, keys, device, each=None, slices=None):
        def count(k, t):
            read[k] = t.numel() * t.element_size()
            return each(k, t)
        return real(self, keys, device, each=count, slices=slices)
    checkpoint.Checkpoint.read = counting
    try:
        yield read
    finally:
        checkpoint.Checkpoint.read = real


def _load_worker(rank, world, init, errfile, path, cases):
    from nvfp4_gemv import from_pretrained

    with _rank(rank, world, init, errfile), _counting_reads() as read:
        for mode, fuse, pack in cases:
            read.clear()
            model = from_pretrained(path, mode=mode, device="cpu", fuse=fuse, pack=pack, tp_plan="auto")
            ours = dict(read)
            read.clear()
            whole = from_pretrained(path, mode=mode, device="cpu", fuse=fuse, pack=pack)
            full = dict(read)
            # the quantized weights' bytes this rank read: its shard of each, 1/world of the whole
            wkeys = [k for k in full if k.endswith(".weight") and ".layers." in k and "norm" not in k]
            assert wkeys and all(ours[k] * world == full[k] for k in wkeys), "a rank read more than its shards"
            ref = copy.deepcopy(whole)
            shard_model(whole)  # the same shards made from the whole model
            attn = model.model.layers[0].self_attn
            assert attn.q_proj.tp_style == "colwise" and attn.o_proj.tp_style == "rowwise"
            assert attn.q_proj.out_features == 1024 // world and attn.o_proj.in_features == 1024 // world
            if fuse:
                assert attn.q_proj._siblings is not None and attn.q_proj._siblings.active
            if pack:
                assert attn.q_proj.packed and attn.o_proj.packed
            logits, stats = _checked_logits(model, ref, world, rank)
            with torch.no_grad():
                assert torch.equal(logits, whole(_ids()).logits), "loaded shards differ from shard_model's"
            assert stats["rowwise"] == 2 * DIMS["num_hidden_layers"], stats


def _export(tmp_path, mode):
    from nvfp4_gemv import save_modelopt

    model = _model()
    scales = calibrate_input_scales(model, lambda m: m(_ids(seed=7))) if mode == "w4a4" else None
    quantize_model(model, mode=mode, input_scales=scales, fuse=True)  # q/k/v and gate/up share weight_scale_2
    path = str(tmp_path / f"export-{mode}")
    save_modelopt(model, path)
    model.config.save_pretrained(path)
    return path


def _moe_load_worker(rank, world, init, errfile, path, cases):
    from nvfp4_gemv import from_pretrained
    from nvfp4_gemv.model.tp import default_plan

    with _rank(rank, world, init, errfile), _counting_reads() as read:
        for mode in cases:
            read.clear()
            whole = from_pretrained(path, mode=mode, device="cpu", fuse=False)
            full = dict(read)
            plan = {**default_plan(whole), "model.layers.*.mlp.experts": "experts"}
            read.clear()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r".*mlp\.(down|gate|up)_proj.*match no module")
                model = from_pretrained(path, mode=mode, device="cpu", fuse=False, tp_plan=plan)
            ours = dict(read)
            # every expert matrix's weight and scales: this rank read 1/world of each
            ekeys = [k for k in full if ".experts." in k and k.endswith((".weight", ".weight_scale"))]
            assert ekeys and all(ours[k] * world == full[k] for k in ekeys), "a rank read more than its experts' shards"
            ref = copy.deepcopy(whole)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r".*mlp\.(down|gate|up)_proj.*match no module")
                shard_model(whole, plan=plan)  # the same shards made from the whole model
            e = model.model.layers[0].mlp.experts
            assert e.tp_style == "experts" and e.intermediate_dim == MOE["moe_intermediate_size"] // world
            logits, stats = _checked_logits(model, ref, world, rank)
            with torch.no_grad():
                assert torch.equal(logits, whole(_ids()).logits), "loaded shards differ from shard_model's"
            assert stats["experts"] == MOE["num_hidden_layers"], stats


@pytest.mark.parametrize("world", [2, 4])
def test_from_pretrained_tp_reads_only_its_experts_shards_and_equals_shard_model(tmp_path, world):
    from nvfp4_gemv import save_modelopt

    path = str(tmp_path / "export-moe")
    model = _moe_quantized("w4a4")  # (input scales too: the checkpoint loads in both modes)
    save_modelopt(model, path)
    model.config.save_pretrained(path)
    _spawn(world, ["w4a16", "w4a4"], tmp_path, _moe_load_worker, path)


@pytest.mark.parametrize("world, export, cases", [(2, "w4a16", [("w4a16", False, False), ("w4a16", True, True)]),
                                                  (2, "w4a4", [("w4a4", True, False)]),
                                                  (4, "w4a16", [("w4a16", True, False)])])
def test_from_pretrained_tp_reads_only_its_shards_and_equals_shard_model(tmp_path, world, export, cases):
    _spawn(world, cases, tmp_path, _load_worker, _export(tmp_path, export))


def _fake_world(monkeypatch, world):
    """torch.distributed as a rank of ``world`` sees it, without processes (the checks communicate nothing)."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)


@pytest.mark.parametrize("world, plan, exc, match", [
    (64, {"model.layers.*.mlp.down_proj": "rowwise"}, ValueError, r"down_proj'.*cut a 16-value scale group"),
    (3, "auto", ValueError, r"in_features=512 is not divisible by world_size=3"),
    (2, {"lm_head": "colwise"}, NotImplementedError, r"'lm_head'.*stores it unquantized"),
    (2, {"model.layers.*.self_attn.q_proj": "colwise"}, ValueError, r"sharded partly or differently"),
    (2, {"model.layers.*.mlp.down_proj": "colwise_gather_output"}, NotImplementedError, r"not supported"),
])
def test_from_pretrained_tp_refuses_by_name_before_reading(tmp_path, monkeypatch, world, plan, exc, match):
    from nvfp4_gemv import from_pretrained
    from nvfp4_gemv.model import checkpoint

    path = _export(tmp_path, "w4a16")
    _fake_world(monkeypatch, world)
    monkeypatch.setattr(checkpoint.Checkpoint, "read", lambda *a, **k: pytest.fail("read before the checks"))
    with pytest.raises(exc, match=match):
        from_pretrained(path, device="cpu", tp_plan=plan)


@pytest.mark.parametrize("world, plan, exc, match", [
    (16, {"model.layers.*.mlp.experts": "experts"}, ValueError, r"experts': experts: a shard of intermediate_dim=8"),
    (2, {"model.layers.*.mlp.experts": "colwise"}, NotImplementedError, r"experts': NVFP4Experts shard by style"),
    (2, {"model.layers.*.self_attn.o_proj": "experts"}, NotImplementedError, r"o_proj': style 'experts' shards"),
])
def test_from_pretrained_tp_refuses_experts_plans_by_name_before_reading(tmp_path, monkeypatch, world, plan, exc, match):
    from nvfp4_gemv import from_pretrained, save_modelopt
    from nvfp4_gemv.model import checkpoint

    path = str(tmp_path / "export-moe")
    model = _moe_quantized("w4a16")
    save_modelopt(model, path)
    model.config.save_pretrained(path)
    _fake_world(monkeypatch, world)
    monkeypatch.setattr(checkpoint.Checkpoint, "read", lambda *a, **k: pytest.fail("read before the checks"))
    with pytest.raises(exc, match=match):
        from_pretrained(path, device="cpu", tp_plan=plan)


def test_from_pretrained_tp_needs_torch_distributed(tmp_path):
    from nvfp4_gemv import from_pretrained

    with pytest.raises(ValueError, match="'tp_plan' needs torch.distributed initialized"):
        from_pretrained(_export(tmp_path, "w4a16"), device="cpu", tp_plan="auto")

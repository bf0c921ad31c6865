"""Tensor parallelism for NVFP4 models with plain ``torch.distributed``: ``shard_model``.

``shard_model(model, rank, world_size, plan=None, group=None)`` shards, in place, the linears a
transformers-style TP plan names (``{"layers.*.self_attn.q_proj": "colwise", ...}``; by default the
model's ``config.base_model_tp_plan``, prefixed with the base model's name) as transformers' "colwise" and
"rowwise" styles shard an ``nn.Linear``; each rank keeps only its shard (no DTensor):

* ``"colwise"``: rank r keeps rows ``[r*out/W, (r+1)*out/W)`` of ``weight``, ``weight_scale`` (and ``bias``);
  ``weight_scale_2`` and ``input_scale`` are replicated (they scale every row). The output is this rank's
  columns of the full output; nothing is communicated (q/k/v give this rank's heads, gate/up its slice of
  the intermediate dimension).
* ``"rowwise"``: rank r keeps columns ``[r*in/W, (r+1)*in/W)`` of the weight, i.e. bytes ``in/(2W)`` and
  scale groups ``in/(16W)`` a row; the scalars are replicated. Its input is this rank's slice (what the
  colwise layers before it produce), its output a partial product that a forward hook all-reduces (SUM over
  ``group``) before the bias, held as the non-persistent buffer ``tp_bias``, is added once.
* ``"experts"`` (``NVFP4Experts``; transformers' plans leave experts out, so name them yourself, e.g.
  ``{**default_plan(model), "model.layers.*.mlp.experts": "experts"}``): every expert's intermediate
  dimension I is split, rank r keeping rows ``[r*I/W, (r+1)*I/W)`` of its gate and of its up (a column-wise
  split) and the same columns of its down (a row-wise split: bytes ``I/(2W)``, scale groups ``I/(16W)``);
  the global and input scales are replicated. Routing stays whole on every rank (hidden states and router
  are replicated), each rank computes every routed slot over its slice, and the module's output, a partial
  sum, is all-reduced like a row-wise layer's. A slot's down product is rounded to x's dtype on each rank
  before the slots are combined, so the bound is the row-wise one summed over a token's k slots.

Refused by name at sharding time (before the model changes), never at a forward: a dimension the world
size does not divide, a row-wise shard that would cut a 16-value scale group, a shard the kernels cannot
take (``linear.kernel_takes``: out % 128 == 0, in % 64 == 0 a shard; a packed layer also in % 128 == 0 a
row-wise shard), attention head counts (``num_attention_heads``, ``num_key_value_heads``) the world size
does not divide when q/k/v are sharded, an experts shard that would cut a scale group (I / W a multiple of
16), styles other than these three, "experts" on anything but ``NVFP4Experts`` or another style on one, and
modules other than ``NVFP4Linear`` / ``nn.Linear`` / ``NVFP4Experts`` (``NotImplementedError``). Experts
the plan does not name stay replicated, which is correct and costs their memory on every rank.

The all-reduce is in fp32. The ops return their product in the output dtype only (bf16/fp16:
``reference.OUT_DTYPES``; each accumulates in fp32 or better and rounds once), so a rank's partial ``p_r``
is already rounded once. Upcast to fp32, the W partials sum exactly in practice (W bf16 values of nearby
magnitudes fit fp32's 24 bits; at worst one fp32 rounding, ``2**-24`` relative), whatever order NCCL or
gloo reduce in, so every rank gets the same bits and a run is deterministic; one rounding to the output
dtype follows. Summing bf16 partials in bf16 instead adds a rounding per reduction step (W-1 of them, in an
order the backend chooses). Bound, with ``u(v) = ulp of v in the output dtype`` and ``E`` the exact
product: ``|y_tp - E| <= 0.5*u(y_tp) + sum_r 0.5*u(p_r)`` (+ fp32's ``2**-24 * sum_r |p_r|``), against
``|y_1 - E| <= 0.5*u(y_1)`` on one device; the extra ``sum_r 0.5*u(p_r)`` is the partials' own
rounding, which only an fp32 output of the ops would remove (a kernel change: the GPU half of issue #59).

Fused groups (``fuse_linears``, ``quantize_model(fuse=True)``): each part is sharded on its own and the
group fused again from the shards (the group's shared ``weight_scale_2`` is replicated, so the parts still
share it). A group whose parts the plan shards differently (or only some of) is refused.

Attention: transformers 5 infers the head count from the projection's width (``view(..., -1, head_dim)``)
and leaves ``config`` alone under TP, as this does; attention modules' own ``num_heads`` /
``num_attention_heads`` / ``num_key_value_heads`` attributes (older or other models) are divided by W.
``model.config`` keeps the full model's counts: a cache sized from them (eager ``StaticCache``
initialization) must divide the KV heads by W.

Loading a rank's shards only: ``from_pretrained(path, tp_plan=...)`` plans the checkpoint on the full model
(meta device), checks the plan here (``plan_load``, from the files' shapes, before any data is read) and
reads each sharded tensor's slice (``Checkpoint.read(slices=...)``: rows of a column-wise layer's
``weight`` / ``weight_scale`` / ``bias``; a row-wise layer's bytes, scale groups and AWQ ``pre_quant_scale``
of its K slice, its bias whole as ``tp_bias``; an experts module's gate and up rows and down columns of
its I slice, expert by expert); the shards then get the same attributes and hooks
(``finish_load``): the model equals ``shard_model`` of the whole one.

Not covered here: ``torch.compile`` of the all-reduce hook (plain ``dist.all_reduce``), saving a sharded
model's state_dict as one checkpoint, unquantized modules in a loading plan, expert parallelism.
"""

import fnmatch
import warnings

import torch
import torch.distributed as dist

from .convert import _set_submodule
from .linear import NVFP4Linear, kernel_takes
from ..packed import packed_takes, unpack_weight
from ..quant import BLOCK

STYLES = ("colwise", "rowwise")
EXPERTS = "experts"  # NVFP4Experts: every expert's intermediate dimension split (_shard_experts)
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads")


def default_plan(model):
    """The model's ``config.base_model_tp_plan`` (transformers' per-model plan, relative to the base model),
    with keys prefixed by the base model's qualified name in ``model`` (``"model."`` for ``LlamaForCausalLM``)."""
    cfg = getattr(model, "config", None)
    plan = getattr(cfg, "base_model_tp_plan", None)
    if not plan and cfg is not None and hasattr(cfg, "get_text_config"):
        plan = getattr(cfg.get_text_config(), "base_model_tp_plan", None)
    if not plan:
        raise ValueError("shard_model: no 'plan' given and the model has no config.base_model_tp_plan")
    base = getattr(model, "base_model", model)
    prefix = ""
    if base is not model:
        prefix = next((n + "." for n, m in model.named_modules() if m is base and n), "")
    return {prefix + k: v for k, v in plan.items()}


def _style_of(name, plan):
    hits = {s for p, s in plan.items() if name == p or fnmatch.fnmatchcase(name, p)}
    if len(hits) > 1:
        raise ValueError(f"shard_model: module '{name}' matches plan entries of different styles {sorted(hits)}")
    return hits.pop() if hits else None


def _plan_targets(model, plan, who, out_of, entries, stacklevel, first=None, warn_unused=True):
    """``[(name, module, style)]`` of the modules ``plan`` shards: transformers' "replicated*" entries (Qwen3's
    q_norm / k_norm: kept whole) left out, ``first(name, module)`` called on each before its style is
    checked, a style other than ``STYLES`` refused by name; plan entries that match no module are warned of
    (``stacklevel`` pointing at the user's call) where the user wrote the plan (``warn_unused``): a model's
    own plan names modules some of its configurations lack (Qwen3-MoE's dense ``mlp.*_proj``, absent where
    every layer is a MoE layer)."""
    targets, used = [], set()
    for name, mod in model.named_modules():
        style = _style_of(name, plan)
        if style is None:
            continue
        used |= {p for p in plan if name == p or fnmatch.fnmatchcase(name, p)}
        if isinstance(style, str) and style.startswith("replicated"):
            continue
        if first is not None:
            first(name, mod)
        if style not in STYLES + (EXPERTS,):
            raise NotImplementedError(f"{who}: module '{name}': style {style!r} is not supported (only "
                                      f"{STYLES + (EXPERTS,)}); leave it out of {out_of} to keep the module replicated")
        targets.append((name, mod, style))
    unused = sorted(set(plan) - used)
    if unused and warn_unused:
        warnings.warn(f"{who}: {entries} {unused} match no module (ignored)", UserWarning, stacklevel=stacklevel)
    return targets


def _nvfp4_tensors(mod):
    """ModelOpt's (weight, weight_scale) of an NVFP4Linear, packed or not."""
    if mod.packed:
        return unpack_weight(mod.weight.detach())
    return mod.weight.detach(), mod.weight_scale.detach()


def _check_nvfp4(name, mod, style, world):
    """Why ``mod`` cannot be sharded ``style`` over ``world`` ranks (a sentence naming it), or None."""
    return _check_dims(name, mod.out_features, mod.in_features, mod.mode, mod.packed, style, world)


def _check_dims(name, out_f, in_f, mode, packed, style, world):
    """``_check_nvfp4`` of an [out_f, in_f] NVFP4 layer in ``mode``, ``packed`` or not."""
    if style == "colwise":
        if out_f % world:
            return f"module '{name}': colwise: out_features={out_f} is not divisible by world_size={world}"
        if not kernel_takes(in_f, out_f // world, mode):
            return (f"module '{name}': colwise: a shard of {out_f // world}x{in_f} (out x in) that the kernels do "
                    f"not take (out_features % 128 == 0 a shard)")
        return None
    if in_f % world:
        return f"module '{name}': rowwise: in_features={in_f} is not divisible by world_size={world}"
    k = in_f // world
    if k % BLOCK:
        return (f"module '{name}': rowwise: a shard of in_features={k} would cut a {BLOCK}-value scale group "
                f"(in_features / world_size must be a multiple of {BLOCK})")
    if not kernel_takes(k, out_f, mode):
        return (f"module '{name}': rowwise: a shard of {out_f}x{k} (out x in) that the kernels do not take "
                f"(in_features % 64 == 0 a shard, in_features <= 32768)")
    if packed and not packed_takes(k, out_f):
        return (f"module '{name}': rowwise: packed, but a shard of in_features={k} cannot be packed "
                f"(in_features % 128 == 0 a shard); shard the unpacked model, or pack after sharding")
    return None


def _shard_nvfp4(mod, style, rank, world):
    w, ws = _nvfp4_tensors(mod)
    bias = mod.bias.detach() if mod.bias is not None else None
    if style == "colwise":
        n = mod.out_features // world
        rows = slice(rank * n, (rank + 1) * n)
        w, ws = w[rows], ws[rows]
        bias = bias[rows].clone() if bias is not None else None
        tail_bias = None
    else:
        k = mod.in_features // world
        w, ws = w[:, rank * k // 2:(rank + 1) * k // 2], ws[:, rank * k // BLOCK:(rank + 1) * k // BLOCK]
        tail_bias, bias = bias, None
    tensors = {"weight": w.clone().contiguous(), "weight_scale": ws.clone().contiguous(),
               "weight_scale_2": mod.weight_scale_2.detach().clone()}
    if mod.input_scale is not None:
        tensors["input_scale"] = mod.input_scale.detach().clone()
    new = NVFP4Linear.from_modelopt(tensors, bias=bias, mode=mod.mode)
    if mod.packed:
        new.pack()
    return new, tail_bias


def _shard_linear(mod, style, rank, world):
    w = mod.weight.detach()
    bias = mod.bias.detach() if mod.bias is not None else None
    if style == "colwise":
        n = mod.out_features // world
        w = w[rank * n:(rank + 1) * n]
        bias = bias[rank * n:(rank + 1) * n] if bias is not None else None
        tail_bias = None
    else:
        k = mod.in_features // world
        w = w[:, rank * k:(rank + 1) * k]
        tail_bias, bias = bias, None
    new = torch.nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        new.weight.copy_(w)
        if bias is not None:
            new.bias.copy_(bias)
    return new, tail_bias


def _check_experts(name, i, world):
    """Why experts of intermediate dimension ``i`` cannot be sharded over ``world`` ranks by it, or None: I /
    world must be whole and keep 16-value scale groups (down's K, what ``NVFP4Experts`` itself requires of its
    intermediate_dim; it has no GPU kernel whose granularity would ask more yet)."""
    if i % world:
        return f"module '{name}': experts: intermediate_dim={i} is not divisible by world_size={world}"
    if (i // world) % BLOCK:
        return (f"module '{name}': experts: a shard of intermediate_dim={i // world} would cut a {BLOCK}-value "
                f"scale group of down_proj (intermediate_dim / world_size must be a multiple of {BLOCK})")
    return None


def _shard_experts(mod, rank, world):
    """Rank ``rank``'s ``NVFP4Experts``: rows ``[r*i, (r+1)*i)`` of every expert's gate and of its up (``i =
    I / world``), the same columns (bytes ``i/2``, scale groups ``i/16``) of its down; the global and input
    scales replicated. The output is a partial sum over this rank's intermediate slice."""
    from .experts import NVFP4Experts

    i, big = mod.intermediate_dim // world, mod.intermediate_dim
    b = {n: t.detach() for n, t in mod._buffers.items() if t is not None}
    mine = slice(rank * i, (rank + 1) * i)
    new = NVFP4Experts(mod.num_experts, mod.hidden_dim, i, act_fn=mod.act_fn, mode=mod.mode,
                       input_scale=b.get("gate_up_input_scale") is not None, device=b["gate_up_weight"].device)
    with torch.no_grad():
        for n in ("gate_up_weight", "gate_up_weight_scale"):  # [E, 2I, .]: gate rows then up rows
            t = b[n]
            new._buffers[n] = torch.cat([t[:, mine], t[:, big + rank * i:big + (rank + 1) * i]], dim=1).contiguous()
        new._buffers["down_weight"] = b["down_weight"][:, :, rank * i // 2:(rank + 1) * i // 2].contiguous()
        new._buffers["down_weight_scale"] = b["down_weight_scale"][:, :, rank * i // BLOCK:(rank + 1) * i // BLOCK].contiguous()
        for p in ("gate_up", "down"):
            for f in ("weight_scale_2", "input_scale"):
                t = b.get(f"{p}_{f}")
                new._buffers[f"{p}_{f}"] = t.clone() if t is not None else None
    new._refresh()
    return new, None


def _check_heads(model, styles, world):
    """Attention heads: q/k/v sharded by rows must keep whole heads, as many on every rank (sentences)."""
    if not any(style == "colwise" and name.rpartition(".")[2] in ("q_proj", "k_proj", "v_proj")
               for name, style in styles):
        return []
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    return [f"config.{label}={n} is not divisible by world_size={world} (q/k/v are sharded by whole heads)"
            for label, n in (("num_attention_heads", heads), ("num_key_value_heads", kv))
            if n is not None and n % world]


def _divide_heads(model, names_styles, world):
    """Attention modules' own head-count attributes divided by ``world`` where q/k/v are sharded by rows."""
    attn = {name.rpartition(".")[0] for name, style in names_styles
            if style == "colwise" and name.rpartition(".")[2] in ("q_proj", "k_proj", "v_proj")}
    for pname in attn:
        parent = model.get_submodule(pname)
        for a in _HEAD_ATTRS:
            v = getattr(parent, a, None)
            if isinstance(v, int) and not isinstance(v, bool):
                setattr(parent, a, v // world)


def _mark(new, style, rank, world, tail_bias, group):
    """A shard's attributes; a row-wise one gets its bias (``tp_bias``) and the all-reduce hook."""
    new.tp_rank, new.tp_world, new.tp_style = rank, world, style
    if style in ("rowwise", EXPERTS):
        new.register_buffer("tp_bias", tail_bias, persistent=False)
        new._tp_hook = new.register_forward_hook(_AllReduce(group))


class _AllReduce:
    """Forward hook of a row-wise shard (or an experts shard): ``round(fp32 all-reduce SUM of the partials)``
    (+ ``tp_bias``)."""

    def __init__(self, group):
        self.group = group

    def __call__(self, mod, args, out):
        if not dist.is_initialized():
            raise RuntimeError("nvfp4_gemv.model.tp: a row-wise shard's forward needs torch.distributed initialized "
                               "(its output is a partial sum to all-reduce)")
        total = out.to(torch.float32)  # (a copy even for fp32 outputs: the hook does not write `out`)
        if total is out:
            total = out.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        y = total.to(out.dtype)
        bias = mod._buffers.get("tp_bias")
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y


def shard_model(model, rank=None, world_size=None, plan=None, group=None):
    """Shards ``model`` in place for tensor parallelism over ``world_size`` ranks, keeping rank ``rank``'s
    shards (module docstring): the modules ``plan`` names (fnmatch patterns of qualified names -> "colwise",
    "rowwise" or, for ``NVFP4Experts``, "experts"; default ``default_plan(model)``, transformers' ``base_model_tp_plan``) are replaced by
    their shards, row-wise ones with an fp32 all-reduce over ``group`` (default: the default process group)
    after them; attention modules' head-count attributes are divided. ``rank`` / ``world_size`` default to
    ``group``'s (``torch.distributed`` must then be initialized; sharding itself communicates nothing).
    Every shard is built and checked before the model changes: a plan the model cannot take raises
    ``ValueError`` (``NotImplementedError`` for ``NVFP4Experts`` and other module types) naming the module.
    :return: ``{qualified name: style}`` of the modules sharded."""
    from .experts import NVFP4Experts
    from .fuse import fuse_linears

    if world_size is None or rank is None:
        if not dist.is_initialized():
            raise ValueError("shard_model: give 'rank' and 'world_size', or initialize torch.distributed")
        world_size = dist.get_world_size(group) if world_size is None else world_size
        rank = dist.get_rank(group) if rank is None else rank
    if not isinstance(world_size, int) or world_size < 1 or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"shard_model: expected 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}")
    if dist.is_initialized() and dist.get_world_size(group) != world_size:
        raise ValueError(f"shard_model: world_size={world_size}, but the process group has "
                         f"{dist.get_world_size(group)} ranks")
    own_plan = plan is None
    plan = dict(default_plan(model) if own_plan else plan)
    for p, s in plan.items():
        if s not in STYLES and not isinstance(s, str):
            raise ValueError(f"shard_model: plan entry {p!r}: expected a style name, got {s!r}")

    def not_yet_sharded(name, mod):
        if getattr(mod, "tp_world", None) is not None:
            raise ValueError(f"shard_model: module '{name}' is already sharded")

    targets = []
    for name, mod, style in _plan_targets(model, plan, "shard_model", "the plan", "plan entries", 3,
                                         not_yet_sharded, warn_unused=not own_plan):
        if isinstance(mod, NVFP4Experts) != (style == EXPERTS):
            raise NotImplementedError(
                f"shard_model: module '{name}': " + (f"NVFP4Experts shard by style {EXPERTS!r} (every expert's "
                f"intermediate dimension), not {style!r}" if isinstance(mod, NVFP4Experts) else
                f"style {EXPERTS!r} shards NVFP4Experts only, not a {type(mod).__name__}"))
        if style == EXPERTS:
            targets.append((name, mod, style))
            continue
        if type(mod) is not NVFP4Linear and type(mod) is not torch.nn.Linear:
            raise NotImplementedError(f"shard_model: module '{name}': a {type(mod).__name__} cannot be sharded "
                                      "(NVFP4Linear and nn.Linear only)")
        targets.append((name, mod, style))
    if world_size == 1 or not targets:
        return {n: s for n, _, s in targets}

    errors = []
    for name, mod, style in targets:
        if style == EXPERTS:
            why = _check_experts(name, mod.intermediate_dim, world_size)
        elif type(mod) is NVFP4Linear:
            why = _check_nvfp4(name, mod, style, world_size)
        else:
            dim = mod.out_features if style == "colwise" else mod.in_features
            why = None if dim % world_size == 0 else \
                f"module '{name}': {style}: {'out' if style == 'colwise' else 'in'}_features={dim} is not divisible " \
                f"by world_size={world_size}"
        if why:
            errors.append(why)
    errors += _check_heads(model, [(name, style) for name, _, style in targets], world_size)
    # fused groups: every part sharded alike, then fused again from the shards
    by_id = {id(m): n for n, m, _ in targets}
    style_of = {id(m): s for _, m, s in targets}
    groups, seen = [], set()
    for name, mod, style in targets:
        sib = getattr(mod, "_siblings", None) if type(mod) is NVFP4Linear else None
        if sib is None or not sib.active or id(sib) in seen:
            continue
        seen.add(id(sib))
        if any(id(p) not in by_id or style_of[id(p)] != style for p in sib.parts):
            errors.append(f"fused group '{sib.name}': the plan shards some of its parts, or shards them "
                          "differently; shard every part alike, or shard before fuse_linears")
            continue
        names = [by_id[id(p)] for p in sib.parts]
        parent = names[0].rpartition(".")[0]
        groups.append((parent, tuple(n.rpartition(".")[2] for n in names)))
    if errors:
        raise ValueError("shard_model: cannot shard over world_size=%d: %s" % (world_size, "; ".join(errors)))

    shards = []
    for name, mod, style in targets:  # every shard built before the model changes
        try:
            if style == EXPERTS:
                new, tail_bias = _shard_experts(mod, rank, world_size)
            else:
                make = _shard_nvfp4 if type(mod) is NVFP4Linear else _shard_linear
                new, tail_bias = make(mod, style, rank, world_size)
        except (TypeError, ValueError) as e:
            raise type(e)(f"shard_model: module '{name}': {e}") from e
        shards.append((name, new, style, tail_bias))
    for name, new, style, tail_bias in shards:
        _mark(new, style, rank, world_size, tail_bias, group)
        _set_submodule(model, name, new)
    _divide_heads(model, [(name, style) for name, _, style in targets], world_size)
    for parent, kids in groups:
        if not fuse_linears(model.get_submodule(parent) if parent else model, groups=(kids,)):
            warnings.warn(f"shard_model: the shards of '{parent}.{{{','.join(kids)}}}' could not be fused again",
                          UserWarning, stacklevel=2)
    return {n: s for n, _, s in targets}


# ----------------------------------------------------------------------------------------------------
# Loading a rank's shards only: from_pretrained(..., tp_plan=...)
# ----------------------------------------------------------------------------------------------------


class ShardedLoad:
    """What ``from_pretrained(tp_plan=...)`` reads for one rank: ``styles`` ({layer: "colwise" | "rowwise"}),
    ``slices`` ({checkpoint key: index} of the parts of tensors this rank reads), ``tails`` ({checkpoint
    key of a row-wise layer's bias: layer}: read whole, added once after the all-reduce), and ``rank``,
    ``world``, ``group``."""

    def __init__(self, rank, world, group):
        self.rank, self.world, self.group = rank, world, group
        self.styles, self.slices, self.tails = {}, {}, {}


def plan_load(model, plan_, ckpt, tp_plan, group, fuse, who):
    """The ``ShardedLoad`` of the checkpoint ``plan_`` (``pretrained.Plan``, made on the full model on the
    meta device) for this process's rank of ``group``: the quantized layers ``tp_plan`` names ("auto":
    ``default_plan(model)``) are checked as ``shard_model`` checks unpacked layers, from the checkpoint's
    shapes, before anything is read (a shard that cannot be packed loads unpacked: ``shard_model`` of a packed
    model refuses it instead); what cannot be sharded raises ``ValueError`` (``NotImplementedError`` for
    unquantized modules, other styles, experts under another style than "experts") naming the module. Removes row-wise layers' biases from
    ``plan_.layers`` (they become ``tails``)."""
    from .fuse import FUSE_GROUPS

    if not dist.is_initialized():
        raise ValueError(f"{who}: 'tp_plan' needs torch.distributed initialized (each rank loads its own shards)")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    load = ShardedLoad(rank, world, group)
    own_plan = isinstance(tp_plan, str) and tp_plan == "auto"
    if own_plan:
        tp_plan = default_plan(model)
    if not isinstance(tp_plan, dict):
        raise TypeError(f"{who}: 'tp_plan': expected 'auto' or a dict of module patterns -> styles, got "
                        f"{type(tp_plan).__name__}")
    errors = []
    for name, mod, style in _plan_targets(model, tp_plan, who, "'tp_plan'", "tp_plan entries", 4,
                                         warn_unused=not own_plan):
        fields = plan_.layers.get(name)
        if fields is None:
            raise NotImplementedError(f"{who}: module '{name}': 'tp_plan' shards it, but the checkpoint stores it "
                                      "unquantized; loading shards NVFP4 layers only (load without tp_plan and call "
                                      "shard_model, or leave it out of the plan)")
        if hasattr(fields, "build") != (style == EXPERTS):
            raise NotImplementedError(
                f"{who}: module '{name}': " + (f"NVFP4Experts shard by style {EXPERTS!r} (every expert's "
                f"intermediate dimension), not {style!r}" if hasattr(fields, "build") else
                f"style {EXPERTS!r} shards NVFP4Experts only"))
        if style == EXPERTS:
            why = _check_experts(name, fields.dims[2], world)
            if why:
                errors.append(why)
            load.styles[name] = style
            continue
        out_f, half = ckpt.entries[fields["weight"][0]].shape
        why = _check_dims(name, out_f, 2 * half, plan_.mode, False, style, world)
        if why:
            errors.append(why)
        load.styles[name] = style
    errors += _check_heads(model, list(load.styles.items()), world)
    for pname, parent in model.named_modules() if fuse else ():  # a fused group's parts sharded alike
        for group_names in FUSE_GROUPS:
            names = [f"{pname + '.' if pname else ''}{n}" for n in group_names if hasattr(parent, n)]
            if len(names) == len(group_names) and len({load.styles.get(n) for n in names}) > 1:
                errors.append(f"the group '{pname}.{{{','.join(group_names)}}}' is sharded partly or differently "
                              "(fuse=True needs its parts alike)")
    if errors:
        raise ValueError(f"{who}: cannot load shards for world_size={world}: " + "; ".join(errors))
    if world == 1:
        load.styles = {}
        return load
    for name, style in load.styles.items():
        fields = plan_.layers[name]
        if style == EXPERTS:  # ModelOpt's per-expert tensors: gate / up rows, down columns of this rank's I slice
            e, h, big = fields.dims
            i = big // world
            for rel, (key, _) in fields.items():
                proj, f = rel.split(".")[1:]
                if f in ("weight", "weight_scale"):
                    per = 2 if f == "weight" else BLOCK  # values a byte / a scale
                    load.slices[key] = (slice(rank * i, (rank + 1) * i), slice(None)) if proj != "down_proj" else \
                        (slice(None), slice(rank * i // per, (rank + 1) * i // per))
            fields.dims = (e, h, i)  # what build() makes: this rank's NVFP4Experts
            continue
        out_f, half = ckpt.entries[fields["weight"][0]].shape
        k = 2 * half
        if style == "colwise":
            n = out_f // world
            rows = slice(rank * n, (rank + 1) * n)
            index = {"weight": (rows, slice(None)), "weight_scale": (rows, slice(None)), "bias": (rows,)}
        else:
            c = k // world
            index = {"weight": (slice(None), slice(rank * c // 2, (rank + 1) * c // 2)),
                     "weight_scale": (slice(None), slice(rank * c // BLOCK, (rank + 1) * c // BLOCK)),
                     "pre_quant_scale": (slice(rank * c, (rank + 1) * c),)}
            if "bias" in fields:
                load.tails[fields.pop("bias")[0]] = name
        for f, (key, _) in fields.items():
            if f in index:
                load.slices[key] = index[f]
    return load


def finish_load(model, load, tails):
    """After the shards are built: each gets ``shard_model``'s attributes, a row-wise one its bias
    (``tails``: {layer: tensor}) and all-reduce hook; attention modules' head counts are divided."""
    for name, style in load.styles.items():
        _mark(model.get_submodule(name), style, load.rank, load.world, tails.get(name), load.group)
    _divide_heads(model, list(load.styles.items()), load.world)

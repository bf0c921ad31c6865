"""MoE experts in whole models: ``quantize_model``'s part (``quantize_experts``), ModelOpt's max calibration
of the experts' input scales (``calibrate_expert_input_scales``), and the loaders' plan of an experts module's
per-expert checkpoint tensors (``ExpertFields``, ``plan_experts``). The module and its forward are
``nvfp4_gemv.model.experts``.
"""

import torch

from .select import name_matches, run_with_pre_hooks
from .experts import _KEY, ALIASES, FIELDS, PROJS, NVFP4Experts, is_experts_module
from .linear import _scalar
from ..quant import E2M1_MAX, E4M3_MAX

def _scale_keys(name, j):
    return [f"{name}.{j}.{p}" for p in PROJS]


def quantize_experts(model, mode, skip, scales):
    """``quantize_model``'s part for MoE experts: every experts module of ``model`` (``is_experts_module``)
    whose name ``skip`` does not match, built as ``NVFP4Experts.from_experts`` (checked; nothing changed
    here). Input scales come from ``scales`` under ModelOpt's per-expert names (``"{module}.{e}.gate_proj"``,
    ``up_proj`` (gate and up read one x: the larger of the two where both are given), ``down_proj``), as
    ``calibrate_expert_input_scales`` makes them; those keys are taken out of ``scales``. :return: ``([(name,
    NVFP4Experts)], the skip patterns that matched an experts module)``."""
    found, used = [], set()
    for name, m in model.named_modules():
        if not is_experts_module(m) or isinstance(m, NVFP4Experts):
            continue
        hit = [p for p in skip if name_matches(name, (p,))]
        if hit:
            used.update(hit)
            continue
        found.append((name, m))
    out = []
    for name, m in found:
        e = m.gate_up_proj.shape[0]
        mine = {k: scales.pop(k) for k in [k for k in scales if k.startswith(name + ".")]}
        if m.gate_up_proj.device.type == "meta":
            raise ValueError(f"quantize_model: '{name}.gate_up_proj' is on the meta device: materialize the model "
                             "first (its weights are quantized here)")
        input_scales = None
        if mode == "w4a4" or mine:
            dev = m.gate_up_proj.device
            gu, dn = [], []
            for j in range(e):
                g, u, d = (mine.get(k) for k in _scale_keys(name, j))
                if (g is None and u is None) or d is None:
                    missing = f"{name}.{j}.gate_proj" if g is None and u is None else f"{name}.{j}.down_proj"
                    raise ValueError(f"quantize_model: mode {mode!r} with input scales for '{name}' needs one for each "
                                     f"expert; 'input_scales' lacks '{missing}' (calibrate_expert_input_scales makes them)")
                try:  # linear._scalar's checks: a float > 0 or a one-element floating tensor
                    g, u = (_scalar(v, f"input_scales['{k}']", dev) if v is not None else None
                            for v, k in zip((g, u), _scale_keys(name, j)))
                    d = _scalar(d, f"input_scales['{_scale_keys(name, j)[2]}']", dev)
                except (TypeError, ValueError) as err:
                    raise type(err)(f"quantize_model: module '{name}': {err}") from err
                gu.append(torch.maximum(g, u) if g is not None and u is not None else (g if g is not None else u))
                dn.append(d)
            input_scales = (torch.stack(gu), torch.stack(dn))
        try:
            out.append((name, NVFP4Experts.from_experts(m, mode, input_scales)))
        except (TypeError, ValueError) as err:
            raise type(err)(f"quantize_model: module '{name}': {err}") from err
    return out, used


def calibrate_expert_input_scales(model, forward_loop, skip=()):
    """ModelOpt's max calibration for MoE experts: runs ``forward_loop(model)`` with hooks on its experts
    modules (bf16, ``is_experts_module``) and returns ``{"{module}.{e}.gate_proj" / "up_proj" / "down_proj":
    input_scale}``, each ``amax / (6 * 448)`` of what that expert's matrix read (gate/up: the tokens routed
    to it; down: ``act_fn(gate) * up`` of those). An expert that saw no token gets the largest of its layer's
    (as ModelOpt's export fills uncalibrated experts); a layer that saw none is left out. Syncs (calibration)."""
    amax = {}

    def hook(name):
        def record(mod, args):
            x, idx = args[0].detach(), args[1].detach()
            e, i = mod.gate_up_proj.shape[0], mod.gate_up_proj.shape[1] // 2
            got = amax.setdefault(name, torch.full((2, e), float("nan"), dtype=torch.float32, device=x.device))
            for j in idx.unique().tolist():
                if not 0 <= j < e:
                    continue
                xs = x[(idx == j).any(dim=1)]
                g = torch.nn.functional.linear(xs, mod.gate_up_proj[j])
                h = mod.act_fn(g[:, :i]) * g[:, i:]
                new = torch.stack([xs.abs().amax().float(), h.abs().amax().float()])
                got[:, j] = torch.fmax(got[:, j], new)
        return record

    run_with_pre_hooks(model, forward_loop, [(m, hook(name)) for name, m in model.named_modules()
                                             if is_experts_module(m) and not isinstance(m, NVFP4Experts)
                                             and not name_matches(name, skip)])
    out = {}
    for name, a in amax.items():
        if torch.isnan(a).all():
            continue
        fill = torch.nan_to_num(a, nan=0.0).amax(dim=1, keepdim=True)
        a = torch.where(torch.isnan(a), fill, a) / torch.full((), E2M1_MAX * E4M3_MAX, device=a.device)
        for j in range(a.shape[1]):
            out[f"{name}.{j}.gate_proj"] = out[f"{name}.{j}.up_proj"] = a[0, j].clone()
            out[f"{name}.{j}.down_proj"] = a[1, j].clone()
    return out


class ExpertFields(dict):
    """One experts module's checkpoint tensors, as ``pretrained.Plan.layers`` holds a linear's: {"{e}.{proj}.
    {field}": (checkpoint key, stored as the reciprocal)}; ``build`` makes the ``NVFP4Experts``."""

    def __init__(self, fields, dims, act_fn, device):
        super().__init__(fields)
        self.dims, self.act_fn, self.device = dims, act_fn, device

    def owners(self, name):
        """The module itself and the per-expert names its state_dict holds tensors under (a load skips them)."""
        return {name} | {f"{name}.{rel.rpartition('.')[0]}" for rel in self}

    def build(self, prefix, tensors, mode, who):
        """The module of ``prefix`` from ``tensors`` ({checkpoint key: tensor}); reciprocals on the device."""
        from .checkpoint import fail

        parts = {rel: (torch.reciprocal(tensors[k]) if inv else tensors[k]) for rel, (k, inv) in self.items()}
        names = {f"{j}.{p}.{f}": f"{prefix}.{j}.{p}.{f}" for j in range(self.dims[0]) for p in PROJS for f in FIELDS}
        try:
            return NVFP4Experts.from_modelopt(parts, *self.dims, act_fn=self.act_fn, mode=mode,
                                              names={**names, **{rel: k for rel, (k, _) in self.items()}})
        except (KeyError, ValueError, TypeError) as err:
            fail(who, f"module '{prefix}': {err.args[0] if err.args else err}")


def plan_experts(modules, keys, entries, fmt, mode, who):
    """The MoE part of a load plan: ``{experts module name: ExpertFields}`` for every experts module of the
    model (``modules``: its named modules; a transformers experts module or an ``NVFP4Experts``) that the
    checkpoint's ``keys`` hold per-expert tensors of (``"{module}.{e}.{gate_proj|up_proj|down_proj|w1|w3|w2}.
    {field}"``), checked on the headers (``entries``) as ``NVFP4Experts.from_modelopt`` takes them.
    ``fmt``: a loader's format object (``modelopt_format.ModelOptFormat``,
    ``compressed_tensors.CompressedTensorsConfig``). Raises ``CheckpointError`` naming the tensor."""
    from .checkpoint import fail

    if not hasattr(fmt, "layer_keys"):
        raise TypeError(f"plan_experts: 'fmt': expected a loader's format object (modelopt_format.ModelOptFormat "
                        f"wraps a ModelOpt QuantConfig), got {type(fmt).__name__}")
    prefixes = {}
    for k in keys:
        m = _KEY.match(k.rpartition(".")[0])
        if m and (is_experts_module(modules.get(m["mod"])) or isinstance(modules.get(m["mod"]), NVFP4Experts)):
            prefixes.setdefault(m["mod"], set()).add((int(m["e"]), m["proj"], k.rpartition(".")[0]))
    plans, probe = {}, torch.nn.Linear(1, 1, device="meta")  # (what a config's class targets see: a linear)
    quantized = fmt.quantized_prefixes(keys, entries)
    for name, found in sorted(prefixes.items()):
        mod = modules[name]
        dims = (mod.num_experts, mod.hidden_dim, mod.intermediate_dim) if isinstance(mod, NVFP4Experts) else \
            (mod.gate_up_proj.shape[0], mod.gate_up_proj.shape[2], mod.gate_up_proj.shape[1] // 2)
        fields = {}
        for e, proj, prefix in sorted(found):
            if prefix not in quantized:
                fail(who, f"tensor '{prefix}.weight': an unquantized expert (nvfp4_gemv loads NVFP4 experts only)")
            fmt.check_module(prefix, probe, True, who, modules)
            got, other = fmt.layer_keys(prefix, keys)
            if other or "pre_quant_scale" in got or "bias" in got:
                bad = other[0] if other else fmt.checkpoint_name(prefix, "pre_quant_scale" if "pre_quant_scale" in got
                                                                 else "bias")
                fail(who, f"tensor '{bad}': not a tensor of an NVFP4 expert")
            rel = f"{e}.{ALIASES.get(proj, proj)}"
            for f, (k, inv) in got.items():
                if f"{rel}.{f}" in fields:
                    fail(who, f"tensors '{fields[f'{rel}.{f}'][0]}' and '{k}': one expert matrix under two names")
                fields[f"{rel}.{f}"] = (k, inv)
        t = next((b for b in list(mod.parameters()) + list(mod.buffers())), None)
        device = torch.device("cpu") if t is None or t.is_meta else t.device
        plan = ExpertFields(fields, dims, mod.act_fn, device)
        metas = {k: entries[k].meta() for k, _ in plan.values()}
        plan.build(name, metas, mode, who)  # the checks, on meta tensors
        plans[name] = plan
    return plans

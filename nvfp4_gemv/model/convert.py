"""A whole model's linears to NVFP4: ``quantize_model`` swaps each ``nn.Linear`` the kernels take for an
``NVFP4Linear`` (and MoE experts for ``NVFP4Experts``), fusing sibling linears where asked;
``calibrate_input_scales`` records the activations' amax for mode "w4a4" (both pick modules by
``select.name_matches``). The layer itself is ``linear.NVFP4Linear``.
"""

import warnings

import torch

from .experts_convert import quantize_experts
from .linear import MODES, NVFP4Linear, _scalar, kernel_takes
from .select import name_matches, run_with_pre_hooks
from ..quant import E2M1_MAX, E4M3_MAX, quantize_weight


def _quantizable(model, skip, mode):
    """(qualified name, nn.Linear) of the linears ``quantize_model`` replaces in ``mode``."""
    out = []
    for name, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, torch.nn.Linear) and not name_matches(name, skip) \
                and kernel_takes(m.in_features, m.out_features, mode):
            out.append((name, m))
    return out


def _set_submodule(model, name, new):
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def quantize_model(model, mode="w4a16", skip=("lm_head",), input_scales=None, fuse=False, pack=False):
    """Replaces, in place, each ``nn.Linear`` of ``model`` whose weight shape the kernels take
    (``kernel_takes``) and whose name ``skip`` does not match (``name_matches``: equal, a ``.``-suffix, or
    an fnmatch glob) by ``NVFP4Linear.from_linear``; returns the model. Linears of other shapes stay as
    they are. Every replacement is built before the model changes, so a failure (naming the module) leaves
    it as it was; ``skip`` patterns that match no linear and ``input_scales`` keys that name none being
    replaced are ignored with a warning.

    :param input_scales: ``{qualified name: input_scale}`` (e.g. from ``calibrate_input_scales``): required
        for every replaced linear in mode "w4a4", stored (and ignored by forward) in mode "w4a16".
    :param fuse: also fuse sibling linears that read one input (q/k/v, gate/up: ``fuse_linears``) into one
        GEMV a forward, the fast path for transformers models. Each group is then quantized with one
        ``weight_scale_2`` (the group's amax, as ModelOpt exports the groups that serving fuses) instead of
        one a linear; groups whose input_scales differ are quantized and left unfused. MoE routers of the
        classes ``fuse_routers`` knows then run as one kernel each (``TopKRouter``; their weights unchanged;
        ``unfuse_routers`` undoes it).
    MoE experts modules (transformers 5's 3-d ``gate_up_proj`` / ``down_proj``) become ``NVFP4Experts``
    (``nvfp4_gemv.model.experts_convert.quantize_experts``; their ``input_scales`` under ModelOpt's per-expert names,
    ``"{module}.{e}.gate_proj"`` etc., from ``calibrate_expert_input_scales``).
    :param pack: also store each quantized weight whose shape allows it (in_features % 128 == 0) in the W4A16
        kernel's packed layout (``NVFP4Linear.pack``: 5-9% faster a GEMV; the state_dict is the same). Mode
        "w4a16" only.
    """
    if mode not in MODES:
        raise ValueError(f"quantize_model: 'mode': expected one of {MODES}, got {mode!r}")
    if pack and mode != "w4a16":
        raise ValueError(f"quantize_model: 'pack': the packed layout runs mode 'w4a16' only, not {mode!r}")
    if isinstance(skip, str):
        skip = (skip,)
    targets = _quantizable(model, skip, mode)
    scales = dict(input_scales or {})
    # MoE experts (3-d weights): built and checked here, set with the linears
    experts, skip_used = quantize_experts(model, mode, skip, scales)  # (takes their input_scales out of scales)
    _warn_unmatched(model, tuple(p for p in skip if p not in skip_used), scales, targets)
    if mode == "w4a4":
        missing = [n for n, _ in targets if n not in scales]
        if missing:
            raise ValueError(f"quantize_model: mode 'w4a4' needs an input_scale for each quantized linear; "
                             f"'input_scales' lacks {missing[:4]}{' ...' if len(missing) > 4 else ''} "
                             "(calibrate_input_scales(model, forward_loop) makes them)")
    for name, lin in targets:  # its values are quantized here: a meta model cannot be
        if lin.weight.device.type == "meta":
            raise ValueError(f"quantize_model: '{name}.weight' is on the meta device: materialize the model first "
                             "(its weights are quantized here)")
    done = {}
    if fuse:
        for names in _fusable_groups(model, targets, scales):
            lins = [model.get_submodule(n) for n in names]
            for lin in lins:
                if not bool(torch.isfinite(lin.weight).all()):
                    raise ValueError(f"quantize_model: '{names[lins.index(lin)]}.weight' has non-finite values")
            q, s, ws2 = quantize_weight(torch.cat([lin.weight.detach() for lin in lins]))  # one global scale
            lo = 0
            for n, lin in zip(names, lins):
                hi = lo + lin.out_features
                done[id(lin)] = NVFP4Linear._from_quantized(lin, q[lo:hi], s[lo:hi], ws2, mode, scales.get(n))
                lo = hi
    for name, lin in targets:  # every replacement built (and checked) before the model changes
        new = done.get(id(lin))
        if new is None:
            try:
                new = done[id(lin)] = NVFP4Linear.from_linear(lin, mode=mode, input_scale=scales.get(name))
            except (TypeError, ValueError) as e:
                raise type(e)(f"quantize_model: module '{name}': {e}") from e
        if pack and not new.packed and new._why_not_packable() is None:
            new.pack()
    for name, lin in targets:
        _set_submodule(model, name, done[id(lin)])
    for name, new in experts:
        _set_submodule(model, name, new)
    if fuse:
        from .fuse import fuse_linears
        from .router import fuse_routers

        fuse_linears(model)
        fuse_routers(model)
    return model


def _warn_unmatched(model, skip, scales, targets):
    """One warning naming the ``skip`` patterns that match no linear of the model (a typo would quantize what
    it meant to keep; the default ``"lm_head"`` is not named) and the ``input_scales`` keys that name no
    linear being replaced (ignored otherwise)."""
    linears = [n for n, m in model.named_modules(remove_duplicate=False) if isinstance(m, torch.nn.Linear)]
    unused = [p for p in skip if p != "lm_head" and not any(name_matches(n, (p,)) for n in linears)]
    names = {n for n, _ in targets}
    extra = sorted(k for k in scales if k not in names)
    parts = ([f"skip pattern(s) {unused} match no nn.Linear of the model"] if unused else []) + \
        ([f"input_scales name(s) {extra[:4]}{' ...' if len(extra) > 4 else ''} no linear being quantized"]
         if extra else [])
    if parts:
        warnings.warn("quantize_model: " + "; ".join(parts) + " (ignored)", UserWarning, stacklevel=3)


def _fusable_groups(model, targets, scales):
    """Qualified names of each sibling group (``fuse.FUSE_GROUPS``) whose linears are all being quantized,
    each once, with one in_features, bias or none, and equal input scales (compared: a sync a group)."""
    from .fuse import FUSE_GROUPS

    by_name = {n: m for n, m in targets}
    count = {}
    for _, m in targets:
        count[id(m)] = count.get(id(m), 0) + 1
    out = []
    for pname, parent in model.named_modules():
        kids = dict(parent.named_children())
        for group in FUSE_GROUPS:
            order = [c for c in kids if c in group]
            if len(order) != len(group):
                continue
            names = [f"{pname}.{c}" if pname else c for c in order]
            lins = [by_name.get(n) for n in names]
            if any(lin is None or count[id(lin)] != 1 for lin in lins) or len({id(lin) for lin in lins}) != len(lins):
                continue
            if len({lin.in_features for lin in lins}) != 1 or len({lin.bias is None for lin in lins}) != 1 \
                    or len({lin.weight.device for lin in lins}) != 1:
                continue
            given = [scales.get(n) for n in names]
            if any(g is not None for g in given):
                if any(g is None for g in given):
                    continue
                t = [_scalar(g, "input_scale", lins[0].weight.device) for g in given]
                if not all(torch.equal(t[0], u) for u in t[1:]):
                    continue
            out.append(names)
    return out


def calibrate_input_scales(model, forward_loop, skip=("lm_head",)):
    """ModelOpt's max calibration of activations: runs ``forward_loop(model)`` (which feeds it sample
    inputs) with hooks on the linears ``quantize_model`` would replace, and returns ``{name:
    input_scale}``, each ``amax(|x|) / (6 * 448)`` over everything that linear saw (fp32 0-dim, on the
    linear's device). Linears that saw nothing are left out."""
    if isinstance(skip, str):
        skip = (skip,)
    amax = {}

    def hook(name):
        def record(_mod, args):
            a = args[0].detach().abs().amax().to(torch.float32)
            amax[name] = a if name not in amax else torch.maximum(amax[name], a)
        return record

    run_with_pre_hooks(model, forward_loop, [(m, hook(name)) for name, m in _quantizable(model, skip, "w4a4")])
    return {n: a / torch.full((), E2M1_MAX * E4M3_MAX, dtype=torch.float32, device=a.device) for n, a in amax.items()}

"""``from_pretrained``: an NVFP4 checkpoint folder (ModelOpt or compressed-tensors) to a transformers model
on a device, built on the meta device so that nothing is allocated twice.

The way (docs/design.md, "Loading an NVFP4 checkpoint onto the meta device"):

1. the format, from ``hf_quant_config.json`` or config.json's ``quantization_config`` (``detect_format``);
   the safetensors' headers (``checkpoint.Checkpoint``: names, dtypes, shapes; no data read);
2. the model of config.json built on the meta device (no memory), in ``dtype``;
3. the plan (``plan``): each quantized linear of the checkpoint matched to an ``nn.Linear`` of the model,
   its tensors validated as ``NVFP4Linear.from_modelopt`` would take them (on meta tensors of the
   headers' dtypes and shapes), every other tensor matched by name, shape and kind of dtype, tied names
   grouped; anything that does not fit raises ``CheckpointError`` naming the tensor before any data is read;
4. the read (``materialize``): each tensor read once by safetensors straight onto ``device``; a dense
   tensor becomes the model's parameter or buffer (cast to the model's dtype where they differ), a
   quantized layer's tensors become an ``NVFP4Linear`` (taken as they are, no copy) as soon as they are all
   there, packed at once where asked; so a quantized weight never exists in bf16;
5. the rest (``finish``): buffers no checkpoint holds (RoPE's ``inv_freq``) computed by the module's own
   constructor and moved to the device, NVFP4_AWQ's ``pre_quant_scale`` folded into norms where the graph
   allows, FP8 KV-cache scales ignored with a warning (the static cache keeps the model's dtype), a check
   that nothing is left on the meta device, then ``fuse_linears`` and packing.
"""

import os
import warnings

import torch

from .checkpoint import KV_SCALES as _KV_SCALES
from .checkpoint import QUANT_CONFIG, Checkpoint, CheckpointError, check_folder, fail, read_json

WHO = "from_pretrained"


def detect_format(path, who=WHO):
    """The quantization format of checkpoint folder ``path``: a ``ModelOptFormat`` or a
    ``CompressedTensorsConfig``; anything else raises ``CheckpointError`` saying what it is."""
    from .compressed_tensors import CompressedTensorsConfig
    from .modelopt import parse_quant_config
    from .modelopt_format import ModelOptFormat

    path = check_folder(path, who)
    hf = os.path.join(path, QUANT_CONFIG)
    cj = os.path.join(path, "config.json")
    cfg = read_json(cj, who) if os.path.exists(cj) else None
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if isinstance(method, str) and method.lower() == "compressed-tensors":
        return CompressedTensorsConfig(qc, "config.json: quantization_config", who)
    if os.path.exists(hf):
        return ModelOptFormat(parse_quant_config(read_json(hf, who), QUANT_CONFIG, who=who))
    if qc is not None:
        if isinstance(method, str) and method.lower().startswith("modelopt"):
            return ModelOptFormat(parse_quant_config(qc, "config.json: quantization_config", who=who))
        fail(who, f"config.json: quantization_config.quant_method is {method!r}; nvfp4_gemv loads NVFP4 checkpoints "
                  "of ModelOpt ('modelopt') and compressed-tensors ('compressed-tensors', nvfp4-pack-quantized)")
    if cfg is None:
        fail(who, f"{path}: no config.json (the model is built from it) and no {QUANT_CONFIG}")
    fail(who, f"{path}: neither {QUANT_CONFIG} nor a 'quantization_config' in config.json: not a quantized checkpoint "
              "(load a bf16 model with transformers, then nvfp4_gemv.quantize_model)")


# ----------------------------------------------------------------------------------------------------
# The plan: what goes where, checked on the headers alone
# ----------------------------------------------------------------------------------------------------


class Plan:
    """``layers`` ({module name: {NVFP4Linear field: (checkpoint key, reciprocal)}}), ``dense`` ([[model
    names of one tensor], [the checkpoint keys among them]]), ``kv`` (ignored KV-cache scales), ``keys``
    (everything to read), ``fmt``, ``mode``, ``dtypes`` ({model name: the model's dtype})."""

    def __init__(self, fmt, mode):
        self.fmt, self.mode = fmt, mode
        self.layers, self.dense, self.kv, self.dtypes, self.shapes = {}, [], [], {}, {}

    def keys(self):
        out = [k for fields in self.layers.values() for k, _ in fields.values()]
        return out + [k for _, present in self.dense for k in present]


def _rename(msg, prefix, fmt):
    """A message of ``NVFP4Linear.from_modelopt`` with the layer's tensor names as the checkpoint has them."""
    from .modelopt_format import MODELOPT_FIELDS

    for field in MODELOPT_FIELDS:
        msg = msg.replace(f"tensor '{field}'", f"tensor '{fmt.checkpoint_name(prefix, field)}'")
    return msg


def plan(model, ckpt, fmt, mode, who=WHO):
    """The ``Plan`` of loading ``ckpt`` (a ``Checkpoint``) into ``model`` (on any device, meta included);
    raises ``CheckpointError`` naming the tensor for anything that does not fit. Reads no data."""
    from .linear import NVFP4Linear

    if mode == "w4a4" and not fmt.activations:
        fail(who, f"{fmt.source}: quant_algo {fmt.quant_algo!r} has no input scales, which mode 'w4a4' needs: use "
                  "mode 'w4a16'")
    p = Plan(fmt, mode)
    entries = ckpt.entries
    keys = set(entries)
    p.kv = sorted(k for k in keys if k.rpartition(".")[2] in _KV_SCALES)
    if p.kv and fmt.kv_cache_quant_algo is None:
        fail(who, f"tensor '{p.kv[0]}': a KV-cache scale, but {fmt.source} sets no KV-cache quantization")
    keys -= set(p.kv)
    modules = dict(model.named_modules(remove_duplicate=False))
    from .experts_convert import plan_experts
    p.layers.update(plan_experts(modules, keys, entries, fmt, mode, who))  # MoE experts: ExpertFields a module
    claimed = {k for fields in p.layers.values() for k, _ in fields.values()}
    keys -= claimed
    for prefix in sorted(fmt.quantized_prefixes(keys, entries)):
        mod = modules.get(prefix)
        fields, other = fmt.layer_keys(prefix, keys)
        first = next(iter(sorted(k for k, _ in fields.values())), prefix)
        if not isinstance(mod, (torch.nn.Linear, NVFP4Linear)):
            fail(who, f"tensor '{first}': the model ({type(model).__name__}) has no linear named '{prefix}' to load it "
                      "into")
        fmt.check_module(prefix, mod, True, who, modules)
        if other:
            fail(who, f"tensor '{other[0]}': not a tensor of an NVFP4 linear (its layer '{prefix}' is quantized)")
        meta = {f: entries[k].meta() for f, (k, _) in fields.items() if f != "pre_quant_scale"}
        try:
            built = NVFP4Linear.from_modelopt(meta, mode=mode)
        except (KeyError, ValueError, TypeError) as e:
            fail(who, _rename(str(e.args[0]) if e.args else str(e), prefix, fmt))
        if (built.in_features, built.out_features) != (mod.in_features, mod.out_features):
            fail(who, f"tensor '{fmt.checkpoint_name(prefix, 'weight')}': a {built.out_features}x{built.in_features} "
                      f"(out x in) weight for the model's {mod.out_features}x{mod.in_features} linear")
        if (mod.bias is not None) != ("bias" in fields):
            fail(who, f"tensor '{prefix}.bias': " + ("missing (the model's linear has a bias)" if mod.bias is not None
                                                     else "in the checkpoint, but the model's linear has no bias"))
        if "pre_quant_scale" in fields:
            e = entries[fields["pre_quant_scale"][0]]
            if e.shape != (mod.in_features,) or not (isinstance(e.dtype, torch.dtype) and e.dtype.is_floating_point):
                fail(who, f"tensor '{prefix}.pre_quant_scale': expected a floating-point [{mod.in_features}] tensor, "
                          f"got {e.dtype} {e.shape}")
        p.layers[prefix] = fields
        claimed.update(k for k, _ in fields.values())
    if fmt.kind == "compressed-tensors":
        for name, mod in modules.items():
            if isinstance(mod, torch.nn.Linear) and name not in p.layers and f"{name}.weight" in keys:
                fmt.check_module(name, mod, False, who)

    # dense: the model's tensors by name, less the replaced layers'; one tensor under several names loads once
    groups = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if name.rpartition(".")[0] in p.layers:
            continue
        groups.setdefault(id(t), []).append(name)
        p.dtypes[name], p.shapes[name] = t.dtype, tuple(t.shape)
    tied = getattr(model, "all_tied_weights_keys", None) or {}  # transformers ties these after its load
    for names in groups.values():
        present = [n for n in names if n in keys]
        if not present and all(n in tied and tied[n] in keys for n in names):
            continue  # (only where transformers builds the model untied: its own from_pretrained)
        if not present:
            fail(who, f"tensor '{names[0]}' of the model is not in the checkpoint"
                      + (f" (nor its tied names {names[1:]})" if len(names) > 1 else ""))
        for n in present:
            e, want = entries[n], p.shapes[n]
            if e.shape != want:
                fail(who, f"tensor '{n}': shape {e.shape} in the checkpoint, {want} in the model")
            src_float = isinstance(e.dtype, torch.dtype) and e.dtype.is_floating_point
            if not isinstance(e.dtype, torch.dtype) or (e.dtype != p.dtypes[n] and not (
                    src_float and p.dtypes[n].is_floating_point)):
                fail(who, f"tensor '{n}': dtype {e.dtype} in the checkpoint, {p.dtypes[n]} in the model")
        p.dense.append((names, present))
        claimed.update(present)
    unclaimed = sorted(keys - claimed)
    if unclaimed:
        fail(who, f"tensor '{unclaimed[0]}' has no place in the model ({type(model).__name__})"
                  + (f" (nor {len(unclaimed) - 1} more)" if len(unclaimed) > 1 else ""))
    return p


# ----------------------------------------------------------------------------------------------------
# Building the layers, placing the tensors
# ----------------------------------------------------------------------------------------------------


def build_layer(prefix, fields, tensors, plan_, dtype, who=WHO):
    """The ``NVFP4Linear`` (``PreScaledNVFP4Linear`` with a ``pre_quant_scale``) of ``prefix`` from its
    checkpoint tensors (``tensors``: {checkpoint key: tensor}), taken as they are; reciprocal scales
    (compressed-tensors' global scales) computed on their device."""
    from .awq import PreScaledNVFP4Linear
    from .linear import NVFP4Linear

    if hasattr(fields, "build"):  # MoE experts (experts_convert.ExpertFields)
        return fields.build(prefix, tensors, plan_.mode, who)
    parts = {}
    for f, (k, inv) in fields.items():
        t = tensors[k]
        parts[f] = torch.reciprocal(t) if inv else t
    pqs = parts.pop("pre_quant_scale", None)
    try:
        if pqs is None:
            return NVFP4Linear.from_modelopt(parts, mode=plan_.mode)
        return PreScaledNVFP4Linear.from_parts(parts, pqs, plan_.mode, dtype)
    except (KeyError, ValueError, TypeError) as e:
        fail(who, _rename(str(e.args[0]) if e.args else str(e), prefix, plan_.fmt))


def _set(model, name, value):
    """Puts ``value`` (a tensor) in the model's parameter or buffer ``name``; a Module for a module name."""
    owner, _, leaf = name.rpartition(".")
    mod = model.get_submodule(owner) if owner else model
    if isinstance(value, torch.nn.Module):
        setattr(mod, leaf, value)
    elif leaf in mod._parameters:
        old = mod._parameters[leaf]
        mod._parameters[leaf] = value if isinstance(value, torch.nn.Parameter) else \
            torch.nn.Parameter(value, requires_grad=old.requires_grad and value.is_floating_point())
    else:
        mod._buffers[leaf] = value


def materialize(model, ckpt, plan_, device, dtype, pack, who=WHO, sharded=None):
    """Reads every planned tensor once onto ``device`` and puts it in ``model`` (see the module's docstring).
    ``pack``: pack each plain layer as it is built (mode "w4a16", shapes that allow it). ``sharded``: a
    ``tp.ShardedLoad``: only this rank's parts of the sharded layers' tensors are read. :return: the row-wise
    shards' biases ({layer: tensor}, read whole; empty without ``sharded``)."""
    pending, owner_of, placed, tails = {}, {}, {}, {}
    tail_of = sharded.tails if sharded is not None else {}
    for prefix, fields in plan_.layers.items():
        for k, _ in fields.values():
            owner_of[k] = prefix
    dense_of = {k: names for names, present in plan_.dense for k in present}

    def take(k, t):
        if k in tail_of:
            tails[tail_of[k]] = t if t.dtype == dtype else t.to(dtype)
            return
        if k in owner_of:
            prefix = owner_of[k]
            got = pending.setdefault(prefix, {})
            got[k] = t
            fields = plan_.layers[prefix]
            if len(got) == len(fields):
                new = build_layer(prefix, fields, pending.pop(prefix), plan_, dtype, who)
                if pack and new._why_not_packable() is None:
                    new.pack()
                _set(model, prefix, new)
            return
        names = dense_of[k]
        want = plan_.dtypes[names[0]]
        first = placed.get(id(names))
        if first is not None:  # a tied tensor stored under two names: one value (compared: a sync)
            if not torch.equal(first, t.to(first.dtype)):
                fail(who, f"tensors '{names[0]}' and '{k}': the model ties them (one tensor), the checkpoint holds "
                          "different values under the two names")
            return
        t = t if t.dtype == want else t.to(want)
        param = None
        for n in names:
            owner, _, leaf = n.rpartition(".")
            mod = model.get_submodule(owner) if owner else model
            if leaf in mod._parameters:
                if param is None:
                    param = torch.nn.Parameter(t, requires_grad=mod._parameters[leaf].requires_grad
                                               and t.is_floating_point())
                mod._parameters[leaf] = param
            else:
                mod._buffers[leaf] = t
        placed[id(names)] = t

    ckpt.read(plan_.keys() + sorted(tail_of), device, each=take, slices=sharded.slices if sharded else None)
    if pending:  # (the plan counted every layer's tensors: cannot happen short of a file changing under us)
        fail(who, f"layer '{sorted(pending)[0]}': not all of its tensors were read")
    return tails


def _computed_buffers(model, device, who=WHO):
    """Buffers no checkpoint holds (non-persistent: RoPE's ``inv_freq``), still on the meta device: computed
    by the module's own constructor from its config on the CPU (as transformers computes them at a load),
    then moved to ``device``."""
    import inspect

    for name, mod in model.named_modules():
        metas = [b for b in mod._non_persistent_buffers_set
                 if isinstance(mod._buffers.get(b), torch.Tensor) and mod._buffers[b].is_meta]
        if not metas:
            continue
        cfg = getattr(mod, "config", None)
        try:
            params = inspect.signature(type(mod).__init__).parameters
        except (TypeError, ValueError):
            params = {}
        if cfg is None or "config" not in params or any(p.is_meta for p in mod.parameters(recurse=False)):
            fail(who, f"buffer '{name}.{metas[0]}' is not in checkpoints (computed at build) and nvfp4_gemv cannot "
                      f"compute it for a {type(mod).__name__}: load this model with transformers instead")
        with torch.device("cpu"):
            fresh = type(mod)(config=cfg)
        for b in metas:
            t = fresh._buffers.get(b)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(mod._buffers[b].shape):
                fail(who, f"buffer '{name}.{b}': {type(mod).__name__}'s constructor did not recompute it")
            mod._buffers[b] = t.to(device)


def finish(model, plan_, device, fuse, pack, fold=True, who=WHO):
    """After the tensors are placed: AWQ folding, KV-scale warning, the meta check, fusing and packing."""
    from .awq import fold_pre_quant_scales

    if fold:
        fold_pre_quant_scales(model)
    if plan_.kv:
        warnings.warn(f"{who}: {len(plan_.kv)} KV-cache scales ({plan_.fmt.kv_cache_quant_algo}) ignored: the cache "
                      "stays in the model's dtype (transformers' static cache takes no scales)", RuntimeWarning,
                      stacklevel=3)
    left = [n for n, t in list(model.named_parameters(remove_duplicate=False))
            + list(model.named_buffers(remove_duplicate=False)) if t.is_meta]
    if left:
        fail(who, f"tensor '{left[0]}' is still on the meta device after the load"
                  + (f" (and {len(left) - 1} more)" if len(left) > 1 else "") + ": nothing loaded or computed it")
    if pack:
        for m in model.modules():
            if getattr(m, "packed", True) is False and m._why_not_packable() is None:
                m.pack()
    if fuse:
        from .fuse import fuse_linears
        from .router import fuse_routers

        fuse_linears(model)
        fuse_routers(model)
    return model


# ----------------------------------------------------------------------------------------------------
# from_pretrained
# ----------------------------------------------------------------------------------------------------


def _model_class(config):
    import transformers

    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM


def _device(device):
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError):
        raise ValueError(f"{WHO}: 'device': expected a torch device (e.g. 'cuda', 'cuda:1', 'cpu'), got {device!r}")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type == "meta":
        raise ValueError(f"{WHO}: 'device': the model is loaded onto a real device, not 'meta'")
    return dev


def from_pretrained(path, mode="w4a16", device="cuda", fuse=True, pack=None, dtype=torch.bfloat16, tp_plan=None,
                    tp_group=None, _fold=True):
    """The transformers model of NVFP4 checkpoint folder ``path`` (its config.json), with each quantized
    linear an ``NVFP4Linear`` (mode ``"w4a16"`` or ``"w4a4"``), on ``device``; returns it in eval mode.

    Formats: ModelOpt (``hf_quant_config.json`` or config.json ``quant_method "modelopt"``; quant_algo
    NVFP4, W4A16_NVFP4, NVFP4_AWQ) and compressed-tensors (``quant_method "compressed-tensors"``, format
    nvfp4-pack-quantized: schemes NVFP4 and NVFP4A16), one safetensors file or shards with an index.

    The model is built on the meta device and every tensor is read once from the safetensors onto
    ``device``: a quantized weight is never held in bf16, and the device holds about the checkpoint's bytes
    (plus a layer while it is packed or fused). Everything is checked on the files' headers before any data
    is read; a checkpoint that does not fit raises ``CheckpointError`` naming the file or tensor.

    :param fuse: one GEMV for q/k/v and for gate/up (``fuse_linears``), one kernel a MoE router (``fuse_routers``).
    :param pack: the W4A16 kernel's packed layout (``NVFP4Linear.pack``); None: in mode "w4a16".
    :param dtype: the activations' dtype (bfloat16 or float16): the model's dense tensors are cast to it.
    :param tp_plan: tensor parallelism (``nvfp4_gemv.model.tp``): ``"auto"`` (the model's
        ``base_model_tp_plan``) or ``{module pattern: "colwise" | "rowwise"}``; with ``torch.distributed``
        initialized, each rank (of ``tp_group``, default the default group) reads only its shards of the
        layers named (rows of a column-wise layer's ``weight`` / ``weight_scale``; a row-wise layer's bytes
        and scale groups of its K slice) and gets the model ``shard_model`` would make of the whole one. Checked
        on the files' headers before any data is read. Quantized layers only; experts and unquantized modules
        in the plan raise ``NotImplementedError``. ``model.config`` keeps the full model's head counts.
    """
    from .linear import MODES

    if mode not in MODES:
        raise ValueError(f"{WHO}: 'mode': expected one of {MODES}, got {mode!r}")
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{WHO}: 'dtype': expected torch.bfloat16 or torch.float16, got {dtype!r}")
    if pack is None:
        pack = mode == "w4a16"
    if pack and mode != "w4a16":
        raise ValueError(f"{WHO}: 'pack': the packed layout runs mode 'w4a16' only, not {mode!r}")
    dev = _device(device)
    import transformers

    fmt = detect_format(path)
    path = os.fspath(path)
    if not os.path.exists(os.path.join(path, "config.json")):
        fail(WHO, f"{path}: no config.json (the model is built from it): copy the original model's config.json there")
    ckpt = Checkpoint(path, WHO)
    config = transformers.AutoConfig.from_pretrained(path)
    cls = _model_class(config)
    with torch.device("meta"):
        model = cls.from_config(config, dtype=dtype) if cls is transformers.AutoModelForCausalLM \
            else cls._from_config(config, dtype=dtype)
    p = plan(model, ckpt, fmt, mode)
    sharded = None
    if tp_plan is not None:
        from .tp import plan_load

        sharded = plan_load(model, p, ckpt, tp_plan, tp_group, fuse, WHO)
    tails = materialize(model, ckpt, p, dev, dtype, pack, sharded=sharded)
    _computed_buffers(model, dev)
    finish(model, p, dev, fuse, pack, fold=_fold)
    if sharded is not None and sharded.styles:
        from .tp import finish_load

        finish_load(model, sharded, tails)
    if os.path.exists(os.path.join(path, "generation_config.json")) and getattr(model, "can_generate", lambda: False)():
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    return model.eval()


__all__ = ["CheckpointError", "detect_format", "from_pretrained"]

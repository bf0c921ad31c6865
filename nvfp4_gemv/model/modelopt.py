"""NVIDIA ModelOpt NVFP4 checkpoints in the Hugging Face layout: ``load_modelopt`` fills a transformers
model (built from the checkpoint's config.json) from an export directory, ``save_modelopt`` writes one
from a ``quantize_model``-ed model. Needs the ``hf`` extra (safetensors; transformers for config.json).

The layout (ModelOpt's unified HF export, as vLLM and SGLang read it):

* safetensors (``model.safetensors``, or shards named by ``model.safetensors.index.json``'s
  ``weight_map``); each quantized linear ``P`` has ``P.weight`` (uint8 [out, in/2], two e2m1 codes a byte,
  the first in the low nibble), ``P.weight_scale`` (float8_e4m3fn [out, in/16]), ``P.weight_scale_2``
  (float32 scalar) and, for W4A4 checkpoints, ``P.input_scale`` (float32 scalar); every other tensor
  (embeddings, norms, excluded linears) as the unquantized model names it;
* ``hf_quant_config.json``: ``{"producer": {"name": "modelopt", "version": ...}, "quantization":
  {"quant_algo": "NVFP4", "kv_cache_quant_algo": null, "group_size": 16, "exclude_modules": ["lm_head"]}}``;
  or, without that file, config.json's ``quantization_config`` with ``"quant_method": "modelopt"`` and
  either the same ``quantization`` object or the flat keys ``quant_algo``, ``group_size`` (or
  ``config_groups.*.weights.group_size``) and ``ignore``.

``quant_algo`` "NVFP4" (W4A4: weights and input scales) and "W4A16_NVFP4" (weights only) are read; KV-cache
scales (``*.k_scale``, ``*.v_scale``) of a checkpoint with a ``kv_cache_quant_algo`` are ignored (the cache
stays in the model's dtype) with a warning. "NVFP4_AWQ" (a ``pre_quant_scale`` a layer) and compressed-tensors
checkpoints load with ``nvfp4_gemv.from_pretrained`` (``pretrained.py``), which builds the model itself.
The folder's safetensors are read and checked by ``checkpoint.py``.
"""

import fnmatch
import json
import os
import warnings

import torch

from .checkpoint import KV_SCALES as _KV_SCALES
from .checkpoint import INDEX, QUANT_CONFIG, Checkpoint, CheckpointError, check_folder, read_json
from .experts import NVFP4Experts
from .experts_convert import plan_experts
from .modelopt_format import ModelOptFormat
from .select import name_matches
from .linear import NVFP4Linear

QUANT_ALGOS = ("NVFP4", "W4A16_NVFP4", "NVFP4_AWQ")
GROUP_SIZE = 16
# a model's fused linear -> the checkpoint's separate parts, in the order the fused output stacks them
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_QUANT_SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale", "bias")


def _fail(msg, who="load_modelopt"):
    raise CheckpointError(f"{who}: {msg}")


# ----------------------------------------------------------------------------------------------------
# The quantization config
# ----------------------------------------------------------------------------------------------------


class QuantConfig:
    """What a checkpoint's quantization config says: ``quant_algo``, ``group_size``, ``exclude_modules``,
    ``kv_cache_quant_algo``, and ``source`` (the file and key it came from, for messages)."""

    def __init__(self, quant_algo, group_size, exclude_modules, kv_cache_quant_algo, source):
        self.quant_algo, self.group_size = quant_algo, group_size
        self.exclude_modules, self.kv_cache_quant_algo, self.source = exclude_modules, kv_cache_quant_algo, source

    def excludes(self, name, modules=frozenset()):
        """Whether module ``name`` is in ``exclude_modules`` (exact names, ``.``-suffixes, fnmatch globs,
        and a trailing ``.*`` also covering the path before it: ``"a.b.*"`` excludes ``"a.b"``). A pattern
        that is the full name of one of ``modules`` (the model's) names that module only, as
        ``save_modelopt`` writes them: a top-level ``"proj"`` does not exclude ``"block.proj"``."""
        pats = [p for p in self.exclude_modules if p == name or p not in modules]
        return name_matches(name, pats) or any(p.endswith(".*") and fnmatch.fnmatchcase(name, p[:-2]) for p in pats)

    def __repr__(self):
        return (f"QuantConfig(quant_algo={self.quant_algo!r}, group_size={self.group_size}, "
                f"exclude_modules={self.exclude_modules!r}, kv_cache_quant_algo={self.kv_cache_quant_algo!r}, "
                f"source={self.source!r})")


def _read_json(path):
    return read_json(path, "load_modelopt")


def parse_quant_config(cfg, source, who="load_modelopt"):
    """A QuantConfig from a parsed ``hf_quant_config.json`` (``source`` its name) or config.json's
    ``quantization_config`` (``source`` "config.json: quantization_config"); raises ``CheckpointError``
    naming the key for anything it cannot load (``who``: the function named in the message)."""
    def _fail(msg):
        raise CheckpointError(f"{who}: {msg}")

    if not isinstance(cfg, dict):
        _fail(f"{source}: expected a JSON object, got {type(cfg).__name__}")
    if source != QUANT_CONFIG:
        method = cfg.get("quant_method")
        if not isinstance(method, str) or not method.lower().startswith("modelopt"):
            hint = " (compressed-tensors NVFP4 loads with nvfp4_gemv.from_pretrained)" \
                if method == "compressed-tensors" else ""
            _fail(f"{source}: key 'quant_method' is {method!r}, not a ModelOpt checkpoint ('modelopt'){hint}")
    if "quantization" in cfg or source == QUANT_CONFIG:
        q = cfg.get("quantization")
        where = f"{source}: quantization."
        if not isinstance(q, dict):
            _fail(f"{source}: key 'quantization' missing or not an object")
        algo, group, exclude = q.get("quant_algo"), q.get("group_size"), q.get("exclude_modules", [])
        kv, exclude_key = q.get("kv_cache_quant_algo"), "exclude_modules"
    else:
        q, where = cfg, f"{source}."
        algo, group, exclude, exclude_key = q.get("quant_algo"), q.get("group_size"), q.get("ignore", []), "ignore"
        if group is None:
            groups = [g.get("weights", {}).get("group_size") for g in (q.get("config_groups") or {}).values()
                      if isinstance(g, dict) and isinstance(g.get("weights"), dict)]
            groups = [g for g in groups if g is not None]
            if groups:
                group, where_g = groups[0], f"{source}.config_groups.*.weights."
                if any(g != group for g in groups):
                    _fail(f"{where_g}group_size: different group sizes {groups}")
        scheme = q.get("kv_cache_scheme")
        kv = "FP8" if isinstance(scheme, dict) and scheme.get("num_bits") == 8 else (None if scheme is None else str(scheme))
    if not isinstance(algo, str) or algo.upper() not in QUANT_ALGOS:
        _fail(f"{where}quant_algo is {algo!r}; nvfp4_gemv loads {' or '.join(QUANT_ALGOS)}")
    if group is None:
        group = GROUP_SIZE
    if isinstance(group, bool) or not isinstance(group, int) or group != GROUP_SIZE:
        _fail(f"{where}group_size is {group!r}; NVFP4 has {GROUP_SIZE} values a scale")
    if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
        _fail(f"{where}{exclude_key}: expected a list of module names or patterns, got {exclude!r}")
    return QuantConfig(algo.upper(), group, list(exclude), kv, source)


def read_quant_config(path):
    """The QuantConfig of an export directory: ``hf_quant_config.json`` where there is one, else
    config.json's ``quantization_config``."""
    path = check_folder(path, "load_modelopt")
    hf = os.path.join(path, QUANT_CONFIG)
    if os.path.exists(hf):
        return parse_quant_config(_read_json(hf), QUANT_CONFIG)
    cj = os.path.join(path, "config.json")
    if os.path.exists(cj):
        cfg = _read_json(cj)
        if isinstance(cfg, dict) and "quantization_config" in cfg:
            return parse_quant_config(cfg["quantization_config"], "config.json: quantization_config")
    _fail(f"{path}: neither {QUANT_CONFIG} nor a 'quantization_config' in config.json: not a ModelOpt export")


# ----------------------------------------------------------------------------------------------------
# Reading tensors
# ----------------------------------------------------------------------------------------------------


def _weight_map(path):
    """{tensor name: safetensors file} of an export directory (one file, or shards by the index), the files'
    headers checked (``checkpoint.Checkpoint``); and the Checkpoint."""
    ckpt = Checkpoint(path, "load_modelopt")
    return {k: e.file for k, e in ckpt.entries.items()}, ckpt


def _load(ckpt, devices):
    """{name: tensor} for the names in ``devices`` ({name: device}), each file opened once a device."""
    by_dev = {}
    for k, dev in devices.items():
        by_dev.setdefault(str(dev), []).append(k)
    out = {}
    for dev, keys in by_dev.items():
        out.update(ckpt.read(keys, dev))
    return out


# ----------------------------------------------------------------------------------------------------
# load_modelopt
# ----------------------------------------------------------------------------------------------------


def _device(t):
    return torch.device("cpu") if t.device.type == "meta" else t.device


def _plan_quantized(model_modules, ckpt_quant):
    """Matches the checkpoint's quantized prefixes with the model's linears: ``[(module name, [checkpoint
    prefixes])]``, one prefix for a plain match, the parts of a fused module in order, or one fused prefix
    and a split (a list of (module name, rows))."""
    plans, used = [], set()
    for p in sorted(ckpt_quant):
        if p in used:
            continue
        mod = model_modules.get(p)
        if isinstance(mod, (torch.nn.Linear, NVFP4Linear)):
            plans.append(("one", p, [p]))
            used.add(p)
            continue
        parent, _, leaf = p.rpartition(".")
        pre = parent + "." if parent else ""
        fused = [f for f, parts in FUSED.items() if leaf in parts and isinstance(model_modules.get(pre + f),
                                                                               (torch.nn.Linear, NVFP4Linear))]
        if fused:
            parts = [pre + q for q in FUSED[fused[0]]]
            absent = [q for q in parts if q not in ckpt_quant]
            if absent:
                _fail(f"the model fuses {parts} into '{pre + fused[0]}', but the checkpoint has no quantized "
                      f"'{absent[0]}' (its tensor '{absent[0]}.weight_scale' is missing)")
            plans.append(("fuse", pre + fused[0], parts))
            used.update(parts)
            continue
        if leaf in FUSED and all(isinstance(model_modules.get(pre + q), (torch.nn.Linear, NVFP4Linear))
                                 for q in FUSED[leaf]):
            plans.append(("split", p, [pre + q for q in FUSED[leaf]]))
            used.add(p)
            continue
        _fail(f"tensor '{p}.weight_scale': the model has no linear named '{p}' to load it into")
    return plans


def _build(tensors, prefix, mode, expect_in, expect_out, expect_bias):
    """NVFP4Linear.from_modelopt on ``prefix``'s tensors, its errors naming the full key."""
    parts = {s: tensors[f"{prefix}.{s}"] for s in _QUANT_SUFFIXES if f"{prefix}.{s}" in tensors}
    try:
        mod = NVFP4Linear.from_modelopt(parts, mode=mode)
    except (KeyError, ValueError, TypeError) as e:
        msg = str(e.args[0]) if e.args else str(e)
        for s in _QUANT_SUFFIXES:
            msg = msg.replace(f"tensor '{s}'", f"tensor '{prefix}.{s}'")
        _fail(msg)
    if (mod.in_features, mod.out_features) != (expect_in, expect_out):
        _fail(f"tensor '{prefix}.weight': a {mod.out_features}x{mod.in_features} (out x in) weight for the "
              f"model's {expect_out}x{expect_in} linear")
    if expect_bias != (mod.bias is not None):
        _fail(f"tensor '{prefix}.bias': " + ("missing (the model's linear has a bias)" if expect_bias
                                               else "in the checkpoint, but the model's linear has no bias"))
    return mod


def _same(tensors, keys, what):
    present = [k for k in keys if k in tensors]
    if not present:
        return
    if len(present) != len(keys):
        _fail(f"tensor '{sorted(set(keys) - set(present))[0]}' missing (its siblings {present} are there)")
    first = tensors[present[0]].reshape(())
    for k in present[1:]:
        if not torch.equal(first, tensors[k].reshape(()).to(first.device)):
            _fail(f"tensors {present}: the model fuses these layers, which needs one {what}; they differ "
                  "(ModelOpt's export shares it across fused layers)")


def _fused_tensors(tensors, parts, fused_name):
    """The fused module's checkpoint tensors: rows stacked in the order of ``parts``, the shared scalars."""
    out = {}
    for s in ("weight", "weight_scale", "bias"):
        keys = [f"{p}.{s}" for p in parts]
        have = [k in tensors for k in keys]
        if any(have) and not all(have):
            _fail(f"tensor '{keys[have.index(False)]}' missing (the other parts of '{fused_name}' have '{s}')")
        if all(have):
            try:
                out[f"{fused_name}.{s}"] = torch.cat([tensors[k] for k in keys], dim=0)
            except RuntimeError as e:
                _fail(f"tensors {keys}: cannot stack the parts of '{fused_name}': {e}")
    for s, what in (("weight_scale_2", "weight_scale_2 (global weight scale)"), ("input_scale", "input_scale")):
        keys = [f"{p}.{s}" for p in parts]
        _same(tensors, keys, what)
        if keys[0] in tensors:
            out[f"{fused_name}.{s}"] = tensors[keys[0]]
    return out


def load_modelopt(model, path, mode="w4a16", fuse=False, pack=False):
    """Fills ``model`` (a transformers model of the checkpoint's architecture, e.g. built from its
    config.json, its parameters materialized) from the ModelOpt NVFP4 export directory ``path``: each
    quantized linear (a checkpoint prefix with a ``weight_scale``) becomes an ``NVFP4Linear`` (``mode``
    "w4a16" or "w4a4") built from the checkpoint's tensors on the device of the linear it replaces; every
    other tensor is copied into the model's tensor of that name. Returns the model.

    Everything is read and checked before the model changes: another ``quant_algo`` or a group size other
    than 16, missing, mis-shaped or mis-typed tensors, tensors the model has no place for, quantized
    modules that the config excludes, raise ``CheckpointError`` (a ValueError) naming the key or tensor,
    and leave the model as it was. Fused modules: a model's ``qkv_proj`` / ``gate_up_proj`` load from a
    checkpoint's separate ``q_proj``/``k_proj``/``v_proj`` (``gate_proj``/``up_proj``) when those share
    their global scales, as ModelOpt exports them (else the error says so); a checkpoint's fused module
    loads into a model's separate ones (rows split). Tied weights (one tensor under two names in the
    model) load from either name; a checkpoint holding both must hold one value under them (compared: a
    sync). The model's tensors must be materialized (a tensor on the meta device is refused by name, before
    anything changes). One sync per fused group (the scales' comparison); no Python loop per value.
    ``fuse=True`` then fuses the model's separate sibling linears (q/k/v, gate/up) whose global scales
    agree into one GEMV a forward (``fuse_linears``; one sync more) and each MoE router into one kernel (``fuse_routers``).
    ``pack=True`` (mode "w4a16") stores each quantized weight whose shape allows it in the W4A16 kernel's
    packed layout (``NVFP4Linear.pack``: 5-9% faster a GEMV), module by module as it is placed (the
    checkpoint's copy of that module is let go first, so a load holds about one extra layer at a time).
    """
    from .linear import MODES

    if mode not in MODES:
        raise ValueError(f"load_modelopt: 'mode': expected one of {MODES}, got {mode!r}")
    if pack and mode != "w4a16":
        raise ValueError(f"load_modelopt: 'pack': the packed layout runs mode 'w4a16' only, not {mode!r}")
    cfg = read_quant_config(path)
    if cfg.quant_algo == "NVFP4_AWQ":
        _fail(f"{cfg.source}: quant_algo 'NVFP4_AWQ' (a pre_quant_scale a layer): load it with "
              "nvfp4_gemv.from_pretrained, which folds or applies the scales")
    if mode == "w4a4" and cfg.quant_algo == "W4A16_NVFP4":
        _fail(f"{cfg.source}: quant_algo 'W4A16_NVFP4' has no input scales, which mode 'w4a4' needs: use mode 'w4a16'")
    weight_map, ckpt = _weight_map(path)
    keys = set(weight_map)

    kv_ignored = sorted(k for k in keys if k.rpartition(".")[2] in _KV_SCALES)
    if kv_ignored:
        if cfg.kv_cache_quant_algo is None:
            _fail(f"tensor '{kv_ignored[0]}': a KV-cache scale, but {cfg.source} sets no kv_cache_quant_algo")
        keys -= set(kv_ignored)

    modules = dict(model.named_modules(remove_duplicate=False))
    # MoE experts' per-expert tensors
    moe = plan_experts(modules, keys, ckpt.entries, ModelOptFormat(cfg), mode, "load_modelopt")
    keys -= {k for fields in moe.values() for k, _ in fields.values()}
    # a quantized layer: one with a weight_scale, a weight_scale_2 or a uint8 weight (so that a layer that lacks
    # one of its tensors is reported as lacking it, not as tensors with no place)
    ckpt_quant = {k.rpartition(".")[0] for k in keys if k.rpartition(".")[2] in ("weight_scale", "weight_scale_2")
                  or (k.endswith(".weight") and ckpt.entries[k].dtype == torch.uint8)}
    awq = sorted(k for k in keys if k.endswith(".pre_quant_scale"))
    if awq:
        _fail(f"tensor '{awq[0]}': an AWQ pre_quant_scale (ModelOpt NVFP4_AWQ): load it with nvfp4_gemv.from_pretrained")
    for p in sorted(ckpt_quant):
        if cfg.excludes(p, modules):
            _fail(f"tensor '{p}.weight_scale': module '{p}' is quantized, but {cfg.source} excludes it")
    plans = _plan_quantized(modules, ckpt_quant)

    # which checkpoint keys the quantized modules claim, and where each is loaded
    devices, claimed = {k: fields.device for fields in moe.values() for k, _ in fields.values()}, set()
    for kind, name, prefixes in plans:
        if kind == "split":
            dev = _device(modules[prefixes[0]].weight)
            srcs = [name]
        else:
            dev = _device(modules[name].weight)
            srcs = prefixes
        for p in srcs:
            for s in _QUANT_SUFFIXES:
                if f"{p}.{s}" in keys:
                    devices[f"{p}.{s}"] = dev
                    claimed.add(f"{p}.{s}")

    # everything else: the model's tensors by name, less those of the modules being replaced
    replaced = {o for name, fields in moe.items() for o in fields.owners(name)}
    for kind, name, prefixes in plans:
        replaced.update(prefixes if kind == "split" else [name])
    model_state = model.state_dict(keep_vars=True)
    dense = {}
    for k, t in model_state.items():
        owner = k.rpartition(".")[0]
        if owner in replaced:
            continue
        if t.device.type == "meta":  # a copy into it would do nothing, silently
            _fail(f"tensor '{k}' of the model is on the meta device: the checkpoint's tensors are copied into the "
                  "model's, so build it on a device first (or model.to_empty(device=...))")
        dense[k] = t
    # tied: a model tensor under several names is loaded once
    by_storage = {}
    for k, t in dense.items():
        if t.device.type != "meta" and t.numel():
            by_storage.setdefault((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)), []).append(k)
    tied_aliases = {k: names for names in by_storage.values() if len(names) > 1 for k in names}

    # dense tensors of fused/split modules that the checkpoint stores the other way
    dense_fuse, dense_split = {}, {}
    for k in sorted(set(dense) - keys):
        owner, _, s = k.rpartition(".")
        parent, _, leaf = owner.rpartition(".")
        pre = parent + "." if parent else ""
        if leaf in FUSED and s in ("weight", "bias"):
            parts = [f"{pre}{q}.{s}" for q in FUSED[leaf]]
            if all(p in keys for p in parts):
                dense_fuse[k] = parts
    for k in sorted(keys - set(dense) - claimed):
        owner, _, s = k.rpartition(".")
        parent, _, leaf = owner.rpartition(".")
        pre = parent + "." if parent else ""
        if leaf in FUSED and s in ("weight", "bias"):
            parts = [f"{pre}{q}.{s}" for q in FUSED[leaf]]
            if all(p in dense for p in parts):
                dense_split[k] = parts

    fused_src = {p for parts in dense_fuse.values() for p in parts}
    unclaimed = sorted(keys - claimed - set(dense) - fused_src - set(dense_split))
    if unclaimed:
        _fail(f"tensor '{unclaimed[0]}' (and {len(unclaimed) - 1} more) has no place in the model"
              if len(unclaimed) > 1 else f"tensor '{unclaimed[0]}' has no place in the model")
    split_dst = {p for parts in dense_split.values() for p in parts}
    missing = []
    for k in sorted(set(dense) - keys - set(dense_fuse) - split_dst):
        if any(a in keys for a in tied_aliases.get(k, ())):
            continue
        missing.append(k)
    if missing:
        _fail(f"tensor '{missing[0]}' of the model is not in the checkpoint"
              + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else ""))

    for k in set(keys) - claimed:
        dst = dense.get(k)
        if dst is None and k in dense_split:
            dst = dense[dense_split[k][0]]
        if dst is None:
            dst = dense[next(f for f, parts in dense_fuse.items() if k in parts)]
        devices[k] = _device(dst)
    tensors = _load(ckpt, devices)

    # tied: a checkpoint holding the tensor under two of its names must hold one value (a sync a group;
    # NaNs compare unequal, so such a pair is refused too)
    for names in by_storage.values():
        present = [k for k in names if k in tensors]
        for k in present[1:]:
            a, b = tensors[present[0]], tensors[k]
            if not torch.equal(a, b.to(a.device)):
                _fail(f"tensors '{present[0]}' and '{k}': the model ties them (one tensor), the checkpoint holds "
                      "different values under the two names")

    # dense: shapes and dtypes, as the model's
    assign = {}
    for k, t in dense.items():
        if k in dense_fuse:
            try:
                src = torch.cat([tensors[p] for p in dense_fuse[k]], dim=0)
            except RuntimeError as e:
                _fail(f"tensors {dense_fuse[k]}: cannot stack them into '{k}': {e}")
        elif k in split_dst:
            continue
        elif k in tensors:
            src = tensors[k]
        else:
            continue  # a tied alias
        assign[k] = src
    for k, parts in dense_split.items():
        rows = [dense[p].shape[0] for p in parts]
        if tensors[k].shape[0] != sum(rows):
            _fail(f"tensor '{k}': {tensors[k].shape[0]} rows, the model's {parts} have {sum(rows)}")
        for p, piece in zip(parts, torch.split(tensors[k], rows, dim=0)):
            assign[p] = piece
    for k, src in assign.items():
        t = dense[k]
        if tuple(src.shape) != tuple(t.shape):
            _fail(f"tensor '{k}': shape {tuple(src.shape)} in the checkpoint, {tuple(t.shape)} in the model")
        if src.dtype != t.dtype and not (src.is_floating_point() and t.is_floating_point()):
            _fail(f"tensor '{k}': dtype {src.dtype} in the checkpoint, {t.dtype} in the model")

    # quantized: build every replacement (validates them) before touching the model
    replacements = [(name, [], fields.build(name, tensors, mode, "load_modelopt")) for name, fields in moe.items()]
    for kind, name, prefixes in plans:
        if kind == "one":
            lin = modules[name]
            replacements.append((name, [name], _build(tensors, name, mode, lin.in_features, lin.out_features,
                                                      lin.bias is not None)))
        elif kind == "fuse":
            lin = modules[name]
            fused = _fused_tensors(tensors, prefixes, name)
            replacements.append((name, prefixes, _build(fused, name, mode, lin.in_features, lin.out_features,
                                                        lin.bias is not None)))
        else:
            whole = {f"{name}.{s}": tensors[f"{name}.{s}"] for s in _QUANT_SUFFIXES if f"{name}.{s}" in tensors}
            rows = [modules[p].out_features for p in prefixes]
            w = whole.get(f"{name}.weight")
            if w is None or w.shape[0] != sum(rows):
                _fail(f"tensor '{name}.weight': {None if w is None else w.shape[0]} rows, the model's "
                      f"{prefixes} have {sum(rows)}")
            for p, lo, n in zip(prefixes, [sum(rows[:i]) for i in range(len(rows))], rows):
                part = {}
                for s, t in whole.items():
                    suffix = s.rpartition(".")[2]
                    # rows of the fused tensors; the scalars copied (a part's own, as save_modelopt writes them)
                    part[f"{p}.{suffix}"] = t[lo:lo + n] if suffix in ("weight", "weight_scale", "bias") else t.clone()
                lin = modules[p]
                replacements.append((p, [name], _build(part, p, mode, lin.in_features, lin.out_features,
                                                       lin.bias is not None)))

    # all checked: now change the model
    with torch.no_grad():
        for k, src in assign.items():
            dense[k].copy_(src)
    for name, sources, new in replacements:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        if pack and new._why_not_packable() is None:
            for p in sources:  # the checkpoint's tensors of this module: only the module holds them now
                for s in _QUANT_SUFFIXES:
                    tensors.pop(f"{p}.{s}", None)
            new.pack()
    if kv_ignored:
        warnings.warn(f"load_modelopt: {len(kv_ignored)} KV-cache scales ({cfg.kv_cache_quant_algo}) ignored: "
                      "the cache stays in the model's dtype", RuntimeWarning, stacklevel=2)
    if fuse:
        from .fuse import fuse_linears
        from .router import fuse_routers

        fuse_linears(model)
        fuse_routers(model)
    return model


# ----------------------------------------------------------------------------------------------------
# save_modelopt
# ----------------------------------------------------------------------------------------------------


def _version():
    try:
        from importlib.metadata import version
        return version("nvfp4-gemv")
    except Exception:  # not installed (a source tree on sys.path)
        return "unknown"


def save_modelopt(model, path, max_shard_bytes=None, overwrite=False):
    """Writes ``model`` (its linears ``NVFP4Linear``, e.g. by ``quantize_model``) to directory ``path`` in
    ModelOpt's NVFP4 export layout: its state_dict in safetensors (``model.safetensors``, or shards of at
    most ``max_shard_bytes`` with ``model.safetensors.index.json``), ``hf_quant_config.json`` (producer
    name "modelopt", the name loaders key on; quant_algo "NVFP4" when every NVFP4Linear has an
    ``input_scale``, else "W4A16_NVFP4"; the unquantized ``nn.Linear`` modules as ``exclude_modules``),
    and config.json from ``model.config`` where the model has one. A tensor under two names (tied
    weights) is written once, under its first name; an ``NVFP4Linear``'s tensors are written under its own
    names even where they share storage with another module's (once for a module under several names).
    config.json also gets a ``quantization_config`` (``quant_method "modelopt"``), as ModelOpt writes it.

    A folder that already holds an export (safetensors, an index, ``hf_quant_config.json``) is refused
    (``FileExistsError``) unless ``overwrite=True``, which replaces the old export's files: the new ones are
    written under a temporary folder inside ``path`` and renamed into place after the old ones are removed,
    so that no reader sees old and new tensors together (``checkpoint.replace_export``).
    :return: ``path``."""
    from safetensors.torch import save_file

    quantized = [(n, m) for n, m in model.named_modules() if isinstance(m, (NVFP4Linear, NVFP4Experts))]
    if not quantized:
        raise ValueError("save_modelopt: 'model' has no NVFP4Linear (quantize_model(model) first)")
    with_scale = [m.input_scale is not None for _, m in quantized]
    algo = "NVFP4" if all(with_scale) else "W4A16_NVFP4"
    if algo != "NVFP4" and any(getattr(m, "pre_quant_scale", None) is not None for _, m in quantized):
        # NVFP4_AWQ is ModelOpt's W4A4 format: its readers (ours, vLLM) expect an input_scale for every layer
        missing = next(n for n, m in quantized if m.input_scale is None)
        raise ValueError(f"save_modelopt: 'model' has AWQ layers (pre_quant_scale) but '{missing}' has no "
                         "input_scale: ModelOpt's NVFP4_AWQ export carries one for every layer")
    exclude = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    modules = dict(model.named_modules(remove_duplicate=False))
    state, seen, written = {}, set(), set()
    for k, t in model.state_dict().items():
        owner, _, leaf = k.rpartition(".")
        mod = modules.get(owner)
        where = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype) if t.numel() else None
        # an NVFP4Linear's tensors under each of its names (two modules can hold one scalar tensor), once for
        # a module registered under several names; other tensors once (tied weights)
        ident = ("module", id(mod), leaf) if isinstance(mod, NVFP4Linear) else where
        if ident is not None:
            if ident in seen:
                continue
            seen.add(ident)
        t = t.detach().to("cpu").contiguous()
        if where is not None:
            if where in written:  # an NVFP4Linear's tensor written under another name: safetensors shares no memory
                t = t.clone()
            written.add(where)
        state[k] = t
    if algo == "W4A16_NVFP4":
        state = {k: v for k, v in state.items() if not k.endswith(".input_scale")}
    if any(getattr(m, "pre_quant_scale", None) is not None for _, m in quantized):
        algo = "NVFP4_AWQ"
    meta = {"format": "pt"}
    writers = {}
    if max_shard_bytes is None:
        writers["model.safetensors"] = lambda p: save_file(state, p, metadata=meta)
    else:
        shards, cur, size = [], {}, 0
        for k, v in state.items():
            nbytes = v.numel() * v.element_size()
            if cur and size + nbytes > max_shard_bytes:
                shards.append(cur)
                cur, size = {}, 0
            cur[k] = v
            size += nbytes
        shards.append(cur)
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            writers[name] = lambda p, shard=shard: save_file(shard, p, metadata=meta)
            weight_map.update({k: name for k in shard})
        total = sum(v.numel() * v.element_size() for v in state.values())
        writers[INDEX] = lambda p: _write_json(p, {"metadata": {"total_size": total}, "weight_map": weight_map})
    producer = {"name": "modelopt", "version": f"nvfp4_gemv-{_version()}"}
    quant = {"producer": producer, "quantization": {"quant_algo": algo, "kv_cache_quant_algo": None,
                                                    "group_size": GROUP_SIZE, "exclude_modules": exclude}}
    writers[QUANT_CONFIG] = lambda p: _write_json(p, quant)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_file"):
        def write_config(p):
            config.to_json_file(p)
            doc = read_json(p, "save_modelopt")
            # config.json's form of the same (ModelOpt's exports carry it: transformers keys its loader on it)
            doc["quantization_config"] = {"quant_method": "modelopt", "producer": producer, "quant_algo": algo,
                                          "group_size": GROUP_SIZE, "kv_cache_scheme": None, "ignore": exclude}
            _write_json(p, doc)
        writers["config.json"] = write_config
    from .checkpoint import replace_export

    return replace_export(path, writers, overwrite, "save_modelopt")


def _write_json(path, doc):
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)

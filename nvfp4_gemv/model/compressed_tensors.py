"""compressed-tensors NVFP4 checkpoints (llm-compressor's exports, ``quant_method "compressed-tensors"``,
format ``nvfp4-pack-quantized``): their config, and their tensors under ``NVFP4Linear``'s names.

The layout (compressed-tensors' documented NVFP4 format; facts, no code of theirs):

* config.json ``quantization_config``: ``quant_method "compressed-tensors"``, ``format
  "nvfp4-pack-quantized"`` (or ``"mixed-precision"`` with each group's own ``format``),
  ``quantization_status "compressed"``, ``config_groups`` ({name: {"targets": [...], "weights": {...},
  "input_activations": {...} or null, "format": ...}}), ``ignore`` ([...]), ``kv_cache_scheme``. Scheme
  "NVFP4A16" has weights only; "NVFP4" also ``input_activations`` (4-bit float, ``tensor_group``,
  group 16, dynamic "local": a static global scale, per-16 scales computed on the fly).
* a target or ignore entry is a module's full name, ``"re:<regex>"`` (``re.match`` on the name: anchored at
  the start only), or a class name (the module's class or a base of it: ``"Linear"``).
* each quantized linear ``P``: ``P.weight_packed`` (uint8 [out, in/2], two e2m1 codes a byte, the first
  in the low nibble: ModelOpt's order), ``P.weight_scale`` (float8_e4m3fn [out, in/16]: ModelOpt's
  layout), ``P.weight_global_scale`` (float32 [1], ``1 / weight_scale_2`` of ModelOpt: w = code *
  weight_scale / weight_global_scale) and, for scheme NVFP4, ``P.input_global_scale`` (float32 [1], ``1 /
  input_scale``). KV-cache scales (``*.k_scale``, ``*.v_scale``) where ``kv_cache_scheme`` is set.
"""

import re

from .checkpoint import fail

FORMAT = "nvfp4-pack-quantized"
# a quantized linear's tensors: checkpoint suffix -> (NVFP4Linear's name, stored as the reciprocal)
FIELDS = {"weight_packed": ("weight", False), "weight_scale": ("weight_scale", False),
          "weight_global_scale": ("weight_scale_2", True), "input_global_scale": ("input_scale", True),
          "bias": ("bias", False)}


def _args_ok(args, where, who, activations=False):
    """Refuses quantization args other than NVFP4's: 4-bit float, tensor_group, group 16, symmetric."""
    if not isinstance(args, dict):
        fail(who, f"{where}: expected an object, got {args!r}")
    want = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
    for k, v in want.items():
        if args.get(k) != v:
            fail(who, f"{where}.{k} is {args.get(k)!r}; NVFP4 has {v!r} (nvfp4_gemv loads NVFP4 and NVFP4A16 only)")
    if args.get("symmetric", True) is not True:
        fail(who, f"{where}.symmetric is {args.get('symmetric')!r}; NVFP4 is symmetric")
    if activations and args.get("dynamic") not in ("local", True):
        fail(who, f"{where}.dynamic is {args.get('dynamic')!r}; NVFP4 activations are 'local' (a static global "
                  "scale, block scales from each input)")
    if not activations and args.get("dynamic", False) is not False:
        fail(who, f"{where}.dynamic is {args.get('dynamic')!r}; stored weights are static")


def matches(name, module, target):
    """compressed-tensors' rule: ``re:`` -> ``re.match`` on the name; else the full name, or a class name of
    the module's class or its bases."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or any(c.__name__ == target for c in type(module).__mro__)


class CompressedTensorsConfig:
    """A compressed-tensors NVFP4 ``quantization_config``: ``groups`` ([(name, targets, has input
    activations)]), ``ignore``, ``kv_cache_quant_algo`` (None or a name), ``source`` (for messages), and
    ``activations`` (whether any group quantizes inputs: mode "w4a4" possible)."""

    kind = "compressed-tensors"

    def __init__(self, cfg, source, who):
        self.source = source
        if not isinstance(cfg, dict):
            fail(who, f"{source}: expected a JSON object, got {type(cfg).__name__}")
        status = cfg.get("quantization_status", "compressed")
        if status != "compressed":
            fail(who, f"{source}.quantization_status is {status!r}; a saved NVFP4 checkpoint is 'compressed' "
                      "(packed codes and scales)")
        for key in ("transform_config", "sparsity_config"):
            v = cfg.get(key)
            if v and not (key == "sparsity_config" and v.get("format", "dense") == "dense"):
                fail(who, f"{source}.{key} is set ({v!r}); nvfp4_gemv applies no transforms or sparsity "
                          "(its products would be wrong): load it with vLLM or transformers")
        top = cfg.get("format")
        groups = cfg.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            fail(who, f"{source}.config_groups: missing or empty (expected the quantization groups)")
        self.groups = []
        for gname, g in groups.items():
            where = f"{source}.config_groups.{gname}"
            if not isinstance(g, dict):
                fail(who, f"{where}: expected an object")
            fmt = g.get("format") or top
            if fmt != FORMAT:
                fail(who, f"{where}: format {fmt!r}; nvfp4_gemv loads {FORMAT!r} (NVFP4, NVFP4A16)")
            targets = g.get("targets")
            if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
                fail(who, f"{where}.targets: expected a list of module names, 're:' patterns or class names, "
                          f"got {targets!r}")
            _args_ok(g.get("weights"), f"{where}.weights", who)
            act = g.get("input_activations")
            if act is not None:
                _args_ok(act, f"{where}.input_activations", who, activations=True)
            if g.get("output_activations") is not None:
                fail(who, f"{where}.output_activations is set; nvfp4_gemv does not quantize outputs")
            self.groups.append((gname, list(targets), act is not None))
        ignore = cfg.get("ignore", []) or []
        if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
            fail(who, f"{source}.ignore: expected a list of module names, 're:' patterns or class names, got {ignore!r}")
        self.ignore = ignore
        kv = cfg.get("kv_cache_scheme")
        self.kv_cache_quant_algo = None if kv is None else (
            "FP8" if isinstance(kv, dict) and kv.get("num_bits") == 8 and kv.get("type") == "float" else str(kv))
        self.activations = any(a for _, _, a in self.groups)
        self.quant_algo = "NVFP4" if self.activations else "NVFP4A16"

    def group_of(self, name, module):
        """The group (name, targets, activations) that quantizes module ``name``, or None (ignored or not
        targeted). Name targets before class targets, as compressed-tensors orders them."""
        if any(matches(name, module, i) for i in self.ignore):
            return None
        for g in self.groups:
            if any(t == name or (t.startswith("re:") and matches(name, module, t)) for t in g[1]):
                return g
        for g in self.groups:
            if any(not t.startswith("re:") and matches(name, module, t) for t in g[1]):
                return g
        return None

    def quantized_prefixes(self, keys, entries=None):
        """Prefixes with a ``weight_packed`` or a global scale (a layer missing one of its tensors is still a
        quantized layer, and the error names the missing tensor)."""
        return {k.rpartition(".")[0] for k in keys
                if k.rpartition(".")[2] in ("weight_packed", "weight_global_scale", "input_global_scale")}

    def layer_keys(self, prefix, keys):
        """{NVFP4Linear name: (checkpoint key, reciprocal)} of quantized linear ``prefix``, and the keys of
        ``prefix.*`` that are not one of its tensors (for the caller's error)."""
        out, other = {}, []
        for k in keys:
            if k.startswith(prefix + ".") and "." not in k[len(prefix) + 1:]:
                suffix = k[len(prefix) + 1:]
                if suffix in FIELDS:
                    out[FIELDS[suffix][0]] = (k, FIELDS[suffix][1])
                else:
                    other.append(k)
        return out, other

    def check_module(self, name, module, quantized, who, modules=None):
        """Refuses a module the checkpoint quantizes that the config does not (or the reverse)."""
        g = self.group_of(name, module)
        if quantized and g is None:
            fail(who, f"tensor '{name}.weight_packed': module '{name}' is quantized, but {self.source} ignores it "
                      "or no config group targets it")
        if not quantized and g is not None:
            fail(who, f"tensor '{name}.weight': module '{name}' is stored unquantized, but {self.source}'s group "
                      f"'{g[0]}' targets it (expected '{name}.weight_packed')")

    def checkpoint_name(self, prefix, field):
        """The checkpoint's key of NVFP4Linear tensor ``field`` of ``prefix`` (for messages)."""
        for suffix, (f, _) in FIELDS.items():
            if f == field:
                return f"{prefix}.{suffix}"
        return f"{prefix}.{field}"

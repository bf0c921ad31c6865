"""``NVFP4Experts``: a mixture-of-experts layer's routed experts in NVFP4, a drop-in for transformers 5.x's
experts modules (``Qwen3MoeExperts``, ``Qwen2MoeExperts``, ``MixtralExperts``, ``DeepseekV3Experts``: 3-d
``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I], SwiGLU-style ``act_fn(gate) * up``), and what
``quantize_model``, ``save_modelopt``, ``load_modelopt`` and ``from_pretrained`` need to handle them.

The module and its forward live here; ``quantize_model``'s part, the experts' calibration and the
loaders' plan are ``nvfp4_gemv.model.experts_convert``.

The contract is transformers': ``forward(hidden_states [T, H], top_k_index [T, k] integer, top_k_weights
[T, k] floating) -> [T, H]`` in hidden_states' dtype, the routing weights multiplied inside (the router
and shared experts stay outside, as they are). A slot whose index is not in [0, E) adds nothing
(transformers' eager loop skips index E, its expert-parallel sentinel); duplicates add twice.

Storage (buffers; ModelOpt's tensors stacked over the experts, gate and up rows concatenated as in
``gate_up_proj``): ``gate_up_weight`` uint8 [E, 2I, H/2] (two e2m1 codes a byte, the first in the low
nibble), ``gate_up_weight_scale`` float8_e4m3fn [E, 2I, H/16], ``gate_up_weight_scale_2`` fp32 [E] (one
global scale an expert, shared by its gate and up rows), ``gate_up_input_scale`` fp32 [E] or None (mode
"w4a4"); ``down_weight`` [E, H, I/2], ``down_weight_scale`` [E, H, I/16], ``down_weight_scale_2`` [E],
``down_input_scale`` [E] or None. The state_dict holds ModelOpt's per-expert names instead:
``{e}.gate_proj.weight`` (rows 0..I of expert e), ``{e}.up_proj.weight`` (rows I..2I), ``{e}.down_proj.weight``,
each with ``weight_scale``, ``weight_scale_2`` and ``input_scale`` (the shared scalars written under both
names); loaders also take Mixtral's ``w1`` / ``w3`` / ``w2`` for gate / up / down.

The forward is ``experts_forward.grouped_forward`` (its formula, paths, cost and error bound are that
module's docstring).
"""

import re

import torch

from ..launch import warn_once
from ..quant import BLOCK, quantize_weight
from .experts_forward import DECODE_MAX_TOKENS, experts_kernel_takes, grouped_forward
# the computation's names, importable from here as before experts_forward (patch them there: these are copies)
from .experts_forward import (SLOT_PATH_BYTES, busy_groups, combine, decode_forward, decode_groups,  # noqa: F401
                              group_size, quantize_dequantized_rows, slot_groups)
from .linear import MODES, _X_DTYPES

PROJS = ("gate_proj", "up_proj", "down_proj")
ALIASES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # Mixtral's checkpoint names
FIELDS = ("weight", "weight_scale", "weight_scale_2", "input_scale")
_KEY = re.compile(r"^(?P<mod>.+)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)$")
_FORMAT_BUFFERS = tuple(f"{p}_{f}" for p in ("gate_up", "down") for f in FIELDS) + (
    "_gate_up_alpha", "_down_alpha", "_gate_up_x_scale", "_down_x_scale")


# ----------------------------------------------------------------------------------------------------
# The module
# ----------------------------------------------------------------------------------------------------


def is_experts_module(m):
    """Whether ``m`` is a transformers experts module this one replaces: 3-d ``gate_up_proj`` [E, 2I, H] and
    ``down_proj`` [E, H, I] parameters (concatenated gate/up, not transposed, no biases) and an ``act_fn``."""
    gu, dn = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or not isinstance(dn, torch.Tensor) or gu.dim() != 3 or dn.dim() != 3:
        return False
    if getattr(m, "is_transposed", False) or getattr(m, "has_bias", False) or not getattr(m, "has_gate", True) \
            or not getattr(m, "is_concatenated", True) or not callable(getattr(m, "act_fn", None)):
        return False
    e, two_i, h = gu.shape
    return two_i % 2 == 0 and tuple(dn.shape) == (e, h, two_i // 2)


def _fail(exc, fn, what, expected, got):
    raise exc(f"{fn}: {what}: expected {expected}, got {got}")


class NVFP4Experts(torch.nn.Module):
    """A MoE layer's routed experts in NVFP4 (module docstring: storage, state_dict names, forward, cost,
    bound). Attributes as transformers' experts: ``num_experts``, ``hidden_dim``, ``intermediate_dim``,
    ``act_fn``; and ``mode`` ("w4a16" or "w4a4"). Build with ``from_experts`` (quantize a transformers
    experts module: NVIDIA's recipe an expert, gate and up with one global scale) or ``from_modelopt`` (a
    checkpoint's per-expert tensors); the constructor makes zero-filled buffers (for ``load_state_dict``).
    The device scalars forward reads (alpha, 1 / input_scale) are computed on construction, a load, a mode
    change or a reassignment of a scale buffer, on the device (not after an in-place edit of one)."""

    def __init__(self, num_experts, hidden_dim, intermediate_dim, act_fn=None, mode="w4a16", input_scale=False,
                 device=None):
        super().__init__()
        fn = "NVFP4Experts"
        if mode not in MODES:
            _fail(ValueError, fn, "'mode'", f"one of {MODES}", repr(mode))
        for name, v in (("hidden_dim", hidden_dim), ("intermediate_dim", intermediate_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0 or v % BLOCK:
                _fail(ValueError, fn, f"'{name}'", f"a positive multiple of {BLOCK}", repr(v))
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
            _fail(ValueError, fn, "'num_experts'", "a positive int", repr(num_experts))
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_dim, intermediate_dim
        self.act_fn = act_fn if act_fn is not None else torch.nn.SiLU()
        self.__dict__["_mode"] = mode
        e, h, i, kw = num_experts, hidden_dim, intermediate_dim, dict(device=device)
        for p, rows, k in (("gate_up", 2 * i, h), ("down", h, i)):
            self.register_buffer(f"{p}_weight", torch.zeros(e, rows, k // 2, dtype=torch.uint8, **kw))
            self.register_buffer(f"{p}_weight_scale", torch.zeros(e, rows, k // BLOCK, dtype=torch.float8_e4m3fn, **kw))
            self.register_buffer(f"{p}_weight_scale_2", torch.ones(e, dtype=torch.float32, **kw))
            self.register_buffer(f"{p}_input_scale", torch.ones(e, dtype=torch.float32, **kw) if input_scale else None)
            self.register_buffer(f"_{p}_alpha", None, persistent=False)
            self.register_buffer(f"_{p}_x_scale", None, persistent=False)
        self._refresh()

    @property
    def mode(self):
        return self._mode

    @mode.setter
    def mode(self, value):
        if value not in MODES:
            _fail(ValueError, "NVFP4Experts", "'mode'", f"one of {MODES}", repr(value))
        self.__dict__["_mode"] = value
        self._refresh()

    @property
    def input_scale(self):
        """The gate/up input scales [E] (None: weight-only): ``save_modelopt`` picks quant_algo from it."""
        return self.gate_up_input_scale

    def _refresh(self):
        """alpha and 1 / input_scale of both matrices, on the device (no sync)."""
        if "_mode" not in self.__dict__:
            return
        with torch.no_grad():
            for p in ("gate_up", "down"):
                s, ws2 = self._buffers[f"{p}_input_scale"], self._buffers[f"{p}_weight_scale_2"]
                w4a4 = self._mode == "w4a4" and s is not None
                self._buffers[f"_{p}_alpha"] = s * ws2 if w4a4 else ws2
                self._buffers[f"_{p}_x_scale"] = torch.ones_like(s) / s if w4a4 else None

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name in _FORMAT_BUFFERS[:8] and "_mode" in self.__dict__:
            self._refresh()

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) / .half() convert floating buffers: the format's keep their dtype (moved only)
        before = {n: b for n, b in self._buffers.items() if b is not None and n in _FORMAT_BUFFERS}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(new.device)
        return self

    def extra_repr(self):
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, intermediate_dim="
                f"{self.intermediate_dim}, mode={self.mode!r}, input_scale="
                f"{'yes' if self.gate_up_input_scale is not None else 'no'}")

    def _why_not_packable(self):  # (the loaders ask every quantized module)
        return "NVFP4Experts has no packed layout"

    # -- construction --------------------------------------------------------------------------------

    @classmethod
    def from_experts(cls, experts, mode="w4a16", input_scales=None):
        """Quantizes a transformers experts module (``is_experts_module``) with NVIDIA's recipe
        (``quantize_weight``) an expert: gate and up rows together (one ``weight_scale_2``), down alone.
        ``input_scales``: ``(gate_up [E], down [E])`` fp32 tensors or None; required by mode "w4a4", kept in
        either. Syncs once (the weights' finiteness)."""
        fn = "NVFP4Experts.from_experts"
        if not is_experts_module(experts):
            _fail(TypeError, fn, "'experts'", "a transformers experts module (3-d gate_up_proj [E, 2I, H] and "
                  "down_proj [E, H, I], act_fn, no bias, not transposed)", type(experts).__name__)
        if mode not in MODES:
            _fail(ValueError, fn, "'mode'", f"one of {MODES}", repr(mode))
        gu, dn = experts.gate_up_proj.detach(), experts.down_proj.detach()
        e, two_i, h = gu.shape
        if gu.device.type == "meta":
            _fail(ValueError, fn, "'experts.gate_up_proj'", "a materialized tensor (it is quantized here)", "meta")
        if mode == "w4a4" and input_scales is None:
            _fail(ValueError, fn, "'input_scales'", "(gate_up [E], down [E]) for mode 'w4a4' (the global scales x "
                  "is quantized with: calibrate_expert_input_scales)", None)
        if not bool(torch.isfinite(gu).all() & torch.isfinite(dn).all()):
            _fail(ValueError, fn, "'experts'", "finite gate_up_proj and down_proj", "non-finite values")
        mod = cls(e, h, two_i // 2, experts.act_fn, mode, input_scales is not None, gu.device)
        with torch.no_grad():
            for j in range(e):
                for p, w in (("gate_up", gu[j]), ("down", dn[j])):
                    q, s, ws2 = quantize_weight(w)
                    mod._buffers[f"{p}_weight"][j].copy_(q)
                    mod._buffers[f"{p}_weight_scale"][j].copy_(s)
                    mod._buffers[f"{p}_weight_scale_2"][j].copy_(ws2)
            if input_scales is not None:
                for p, s in zip(("gate_up", "down"), input_scales):
                    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or tuple(s.shape) != (e,):
                        _fail(ValueError, fn, f"'input_scales' ({p})", f"an fp32 tensor [{e}]",
                              f"{getattr(s, 'dtype', type(s).__name__)} {tuple(getattr(s, 'shape', ()))}")
                    mod._buffers[f"{p}_input_scale"].copy_(s)
        mod._refresh()
        return mod

    @classmethod
    def from_modelopt(cls, tensors, num_experts, hidden_dim, intermediate_dim, act_fn=None, mode="w4a16",
                      names=None):
        """A module from a checkpoint's per-expert tensors ``tensors`` ({"{e}.{gate_proj|up_proj|down_proj}.
        {weight|weight_scale|weight_scale_2|input_scale}": tensor}, all on one device; meta tensors check
        the metadata alone). Every expert needs its three matrices' weight, weight_scale and
        weight_scale_2; input_scale everywhere or nowhere (required by mode "w4a4"); gate and up of an
        expert one weight_scale_2 and one input_scale (compared: a sync). ``names`` maps these keys to the
        checkpoint's, for messages. :raises KeyError, ValueError: naming the tensor."""
        fn, names = "NVFP4Experts.from_modelopt", names or {}
        e, h, i = num_experts, hidden_dim, intermediate_dim

        def nm(key):
            return names.get(key, key)

        unknown = sorted(k for k in tensors if k.split(".", 1)[-1] not in {f"{p}.{f}" for p in PROJS for f in FIELDS}
                         or not k.split(".")[0].isdigit() or int(k.split(".")[0]) >= e)
        if unknown:
            raise ValueError(f"{fn}: tensor '{nm(unknown[0])}': not a tensor of experts 0..{e - 1} "
                             f"({', '.join(PROJS)}; {', '.join(FIELDS)})")
        has_scale = [f"{j}.{p}.input_scale" in tensors for j in range(e) for p in PROJS]
        if any(has_scale) and not all(has_scale):
            k = next(f"{j}.{p}.input_scale" for j in range(e) for p in PROJS if f"{j}.{p}.input_scale" not in tensors)
            raise KeyError(f"{fn}: missing tensor '{nm(k)}' (other experts have an input_scale)")
        need = FIELDS if mode == "w4a4" else FIELDS[:3]
        for j in range(e):
            for p in PROJS:
                for f in need:
                    if f"{j}.{p}.{f}" not in tensors:
                        why = " (mode 'w4a4' quantizes x with it; a weight-only checkpoint loads in mode 'w4a16')" \
                            if f == "input_scale" else ""
                        raise KeyError(f"{fn}: missing tensor '{nm(f'{j}.{p}.{f}')}'{why}")
        dev = tensors["0.gate_proj.weight"].device
        for key, t in tensors.items():
            p, f = key.split(".")[1:]
            rows, k = (h, i) if p == "down_proj" else (i, h)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{fn}: tensor '{nm(key)}': expected a torch.Tensor, got {type(t).__name__}")
            want = {"weight": ((torch.uint8, torch.float4_e2m1fn_x2), [(rows, k // 2)]),
                    "weight_scale": ((torch.float8_e4m3fn,), [(rows, k // BLOCK)])}.get(f, ((torch.float32,), [(), (1,)]))
            if t.dtype not in want[0] or tuple(t.shape) not in want[1]:
                raise ValueError(f"{fn}: tensor '{nm(key)}': expected {want[0][0]} of shape {want[1][0]}, got "
                                 f"{t.dtype} {tuple(t.shape)}")
            if t.device != dev:
                raise ValueError(f"{fn}: tensor '{nm(key)}': expected a tensor on {dev}, got one on {t.device}")
        if dev.type != "meta":
            for f in ("weight_scale_2", "input_scale"):
                if f"0.gate_proj.{f}" not in tensors:
                    continue
                g = torch.stack([tensors[f"{j}.gate_proj.{f}"].reshape(()) for j in range(e)])
                u = torch.stack([tensors[f"{j}.up_proj.{f}"].reshape(()) for j in range(e)])
                if not torch.equal(g, u):
                    j = int((g != u).nonzero()[0, 0])
                    raise ValueError(f"{fn}: tensors '{nm(f'{j}.gate_proj.{f}')}' and '{nm(f'{j}.up_proj.{f}')}' "
                                     f"differ: the experts' gate and up rows share one {f} (ModelOpt exports them so)")
        mod = cls(e, h, i, act_fn, mode, any(has_scale), "meta")
        with torch.no_grad():
            def rows(p, f):
                return torch.stack([tensors[f"{j}.{p}.{f}"].view(torch.uint8) if f == "weight" else tensors[f"{j}.{p}.{f}"]
                                    for j in range(e)])

            for p, parts in (("gate_up", ("gate_proj", "up_proj")), ("down", ("down_proj",))):
                mod._buffers[f"{p}_weight"] = torch.cat([rows(q, "weight") for q in parts], dim=1)
                mod._buffers[f"{p}_weight_scale"] = torch.cat([rows(q, "weight_scale") for q in parts], dim=1)
                for f in ("weight_scale_2", "input_scale"):
                    if f"0.{parts[0]}.{f}" in tensors:
                        mod._buffers[f"{p}_{f}"] = rows(parts[0], f).reshape(e).clone()
        mod._refresh()
        return mod

    # -- state_dict: ModelOpt's per-expert names -----------------------------------------------------

    def _entries(self):
        """(state_dict name, buffer, expert, row slice) of every per-expert tensor, in ModelOpt's names."""
        i = self.intermediate_dim
        for j in range(self.num_experts):
            for p, buf, sl in (("gate_proj", "gate_up", slice(0, i)), ("up_proj", "gate_up", slice(i, 2 * i)),
                               ("down_proj", "down", slice(None))):
                for f in FIELDS:
                    yield f"{j}.{p}.{f}", f"{buf}_{f}", j, (sl if f in ("weight", "weight_scale") else None)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for key, buf, j, sl in self._entries():
            t = self._buffers[buf]
            if t is None:
                continue
            t = t if keep_vars else t.detach()
            # rows: views; the scalars: a tensor each (gate and up share one, written under both names)
            destination[prefix + key] = t[j, sl] if sl is not None else t[j].clone()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        mine = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)
                and not k[len(prefix):].startswith("act_fn.")}
        entries = {key: rest for key, *rest in self._entries()}
        unexpected_keys.extend(prefix + k for k in sorted(set(mine) - set(entries)))
        if self.gate_up_input_scale is None and any(k.endswith(".input_scale") and k in entries for k in mine):
            for p in ("gate_up", "down"):  # a checkpoint that has them
                self._buffers[f"{p}_input_scale"] = torch.ones_like(self._buffers[f"{p}_weight_scale_2"])
        copies, errors = [], []
        for key, (buf, j, sl) in entries.items():
            t = self._buffers[buf]
            if t is None:
                continue
            src = mine.get(key)
            if src is None:
                missing_keys.append(prefix + key)
                continue
            src = src.view(torch.uint8) if src.dtype == torch.float4_e2m1fn_x2 else src
            dst = t[j, sl] if sl is not None else t[j]
            if src.dtype != t.dtype or (tuple(src.shape) != tuple(dst.shape) if sl is not None else src.numel() != 1):
                errors.append(f"'{prefix}{key}': expected {t.dtype} {tuple(dst.shape) if sl is not None else '()'}, "
                              f"got {src.dtype} {tuple(src.shape)}")
                continue
            copies.append((dst, src))
        for f in ("weight_scale_2", "input_scale"):  # gate and up of an expert share these (a sync)
            pairs = [(j, mine[f"{j}.gate_proj.{f}"], mine[f"{j}.up_proj.{f}"]) for j in range(self.num_experts)
                     if f"{j}.gate_proj.{f}" in mine and f"{j}.up_proj.{f}" in mine]
            if pairs and not errors:
                g = torch.stack([a.reshape(()).to("cpu") for _, a, _ in pairs])
                u = torch.stack([b.reshape(()).to("cpu") for _, _, b in pairs])
                if not torch.equal(g, u):
                    j = pairs[int((g != u).nonzero()[0, 0])][0]
                    errors.append(f"'{prefix}{j}.gate_proj.{f}' and '{prefix}{j}.up_proj.{f}' differ: an expert's gate "
                                  f"and up rows share one {f}")
        if errors:
            error_msgs.extend(f"NVFP4Experts {prefix or '<root>'}: {m}" for m in errors)
            return
        with torch.no_grad():
            for dst, src in copies:
                dst.copy_(src.reshape(dst.shape))
        self._refresh()

    # -- forward -------------------------------------------------------------------------------------

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if not torch.compiler.is_compiling():
            self._check(hidden_states, top_k_index, top_k_weights)
            if hidden_states.is_cuda and not experts_kernel_takes(hidden_states.shape[0], *self._mats()):
                warn_once("experts-fallback", f"NVFP4Experts: {hidden_states.shape[0]} tokens a call (the "
                          f"experts' kernel takes 1..{DECODE_MAX_TOKENS}) or expert shapes it does not take "
                          "(rows M % 128 == 0, K % 64 == 0, contiguous): the experts run through dequantize + "
                          "bmm or torch._grouped_mm (bf16), several times the NVFP4 bytes' read time "
                          "(nvfp4_gemv/model/experts.py, 'Cost of the fallback')")
        if self._mode == "w4a4" and self.gate_up_input_scale is None:
            raise ValueError("NVFP4Experts: mode 'w4a4' needs input scales (None here): load or quantize with "
                             "them, or use mode 'w4a16'")
        return grouped_forward(hidden_states, top_k_index, top_k_weights, *self._mats(), self.act_fn)

    def _mats(self):
        """``grouped_forward``'s two matrices: (weight, weight_scale, alpha, x_scale) of gate/up and of down."""
        return ((self.gate_up_weight, self.gate_up_weight_scale, self._gate_up_alpha, self._gate_up_x_scale),
                (self.down_weight, self.down_weight_scale, self._down_alpha, self._down_x_scale))

    def _check(self, x, idx, w):
        fn, dev = "NVFP4Experts.forward", self.gate_up_weight.device
        for name, t in (("hidden_states", x), ("top_k_index", idx), ("top_k_weights", w)):
            if not isinstance(t, torch.Tensor):
                _fail(TypeError, fn, f"argument '{name}'", "a torch.Tensor", type(t).__name__)
            if t.device != dev:
                _fail(ValueError, fn, f"argument '{name}'", f"a tensor on {dev} (where the weights are)",
                      f"one on {t.device}")
        if x.dtype not in _X_DTYPES:
            _fail(TypeError, fn, "argument 'hidden_states'", "dtype torch.bfloat16 or torch.float16", x.dtype)
        if x.dim() != 2 or x.shape[1] != self.hidden_dim:
            _fail(ValueError, fn, "argument 'hidden_states'", f"shape [tokens, {self.hidden_dim}] (hidden_dim)",
                  tuple(x.shape))
        if idx.dtype not in (torch.int64, torch.int32) or idx.dim() != 2 or idx.shape[0] != x.shape[0]:
            _fail(ValueError, fn, "argument 'top_k_index'", f"an int64 or int32 tensor [{x.shape[0]}, k]",
                  f"{idx.dtype} {tuple(idx.shape)}")
        if not w.is_floating_point() or tuple(w.shape) != tuple(idx.shape):
            _fail(ValueError, fn, "argument 'top_k_weights'", f"a floating-point tensor of top_k_index's shape "
                  f"{tuple(idx.shape)}", f"{w.dtype} {tuple(w.shape)}")


_MOVED = ("ExpertFields", "calibrate_expert_input_scales", "plan_experts", "quantize_experts")


def __getattr__(name):
    """The whole-model helpers that lived here before ``experts_convert`` (``from nvfp4_gemv.experts import
    calibrate_expert_input_scales`` keeps working; a top-level import would be circular)."""
    if name in _MOVED:
        from . import experts_convert

        return getattr(experts_convert, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

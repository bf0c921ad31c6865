"""``NVFP4Linear``, an ``nn.Module`` holding one NVFP4 linear layer as NVIDIA ModelOpt's checkpoints name
its tensors (``convert.quantize_model`` swaps a model's ``nn.Linear`` modules for it).

Two modes:

* ``"w4a16"``: ``x @ dequant(w).T (+ bias)``, x as it comes (bf16/fp16): the W4A16 op
  ``gemv(x, None, weight, weight_scale, alpha=weight_scale_2)``.
* ``"w4a4"``, what a ModelOpt NVFP4 checkpoint was calibrated for (as vLLM's ModelOpt NVFP4 linear method
  computes it): x quantized with ``quantize(x, 1 / input_scale)``, then the W4A4 op with
  ``alpha = input_scale * weight_scale_2``. From ``W4A4_VIA_W4A16_FROM`` tokens on (where set), the same
  product as the W4A16 op on x's quantized values (``quantize_dequantized``: exact in x's dtype), since
  the W4A4 op reads the weight once per 16 tokens and the W4A16 op once per 32 (then dequantizes it
  for one ``torch.mm`` from 129): the same exact value, summed in that op's order (its error bound).

``NVFP4Linear.pack()`` (or ``quantize_model(pack=True)``, ``load_modelopt(pack=True)``) stores a "w4a16"
layer's weight in the W4A16 kernel's packed layout (``nvfp4_gemv.packed``: w and its scales in one buffer,
5-9% faster a GEMV); its state_dict keeps ModelOpt's keys and layout.
"""

import math

import torch

from .fuse import _PART_BUFFERS, _PART_RUNS, FUSED_BUFFERS, _run_mixed, as_rows
from ..op import gemv, gemv_packed
from ..packed import pack_weight, packed_takes, unpack_weight
from ..reference import check_args
from ..quant import BLOCK, E2M1_MAX, E4M3_MAX, quantize, quantize_dequantized, quantize_weight

MODES = ("w4a16", "w4a4")
# Mode "w4a4" from this many tokens a call: quantize_dequantized + the W4A16 op instead of quantize + the W4A4
# op (None: never). The W4A4 op's second pass over the weight starts at 17 tokens; on H200 the W4A16 op at 32
# tokens took 0.71-0.78x the W4A4 op's time on every bench shape (docs/results.md). Off until the
# dequantized quantize kernel has run on a GPU (written without one: docs/design.md, "Mode w4a4 from 17 tokens").
W4A4_VIA_W4A16_FROM = None
_X_DTYPES = (torch.bfloat16, torch.float16)
# buffers whose dtype is the format's: Module.to(dtype) / .half() must not convert them
_FORMAT_BUFFERS = ("weight", "weight_scale", "weight_scale_2", "input_scale", "_alpha", "_inv_input_scale",
                   "_fused_weight", "_fused_weight_scale")


def kernel_takes(in_features, out_features, mode="w4a16"):
    """Whether ``gemv`` takes a weight of this shape in ``mode``: the op's own validation
    (``reference.check_args``) run on meta tensors of the mode's form, so the rule is the op's (today M % 128 == 0,
    K % 64 == 0, K <= 32768 in both modes)."""
    if in_features <= 0 or out_features <= 0 or in_features % BLOCK:
        return False
    meta = dict(device="meta")
    if mode == "w4a16":
        x, xs = torch.empty(1, in_features, dtype=torch.bfloat16, **meta), None
    else:
        x = torch.empty(1, in_features // 2, dtype=torch.uint8, **meta)
        xs = torch.empty(1, in_features // BLOCK, dtype=torch.float8_e4m3fn, **meta)
    try:
        check_args(x, xs, torch.empty(out_features, in_features // 2, dtype=torch.uint8, **meta),
                   torch.empty(out_features, in_features // BLOCK, dtype=torch.float8_e4m3fn, **meta),
                   None, torch.bfloat16)
    except (TypeError, ValueError):
        return False
    return True


def _scalar(v, name, device):
    """A float or one-element tensor as an fp32 0-dim tensor on ``device``."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or not v.is_floating_point():
            raise ValueError(f"NVFP4Linear: '{name}': expected a one-element floating-point tensor, "
                             f"got {v.dtype} of shape {tuple(v.shape)}")
        return v.detach().reshape(()).to(device=device, dtype=torch.float32)
    if isinstance(v, bool):
        raise TypeError(f"NVFP4Linear: '{name}': expected a float or a one-element tensor, got bool")
    if isinstance(v, (int, float)):
        if not math.isfinite(v) or v <= 0:  # a number is checked here; a tensor's value would need a sync
            raise ValueError(f"NVFP4Linear: '{name}': expected a positive finite scale, got {v!r}")
        return torch.tensor(float(v), dtype=torch.float32, device=device)
    raise TypeError(f"NVFP4Linear: '{name}': expected a float or a one-element tensor, got {type(v).__name__}")


def input_scale_from(*activations):
    """ModelOpt's calibrated ``input_scale`` of sample activations: ``amax(|x|) / (6 * 448)`` over all of
    them, as an fp32 0-dim tensor on their device."""
    if not activations:
        raise ValueError("input_scale_from: give at least one activation tensor")
    amax = torch.stack([a.detach().abs().amax().to(torch.float32) for a in activations]).amax()
    return amax / torch.full((), E2M1_MAX * E4M3_MAX, dtype=torch.float32, device=amax.device)


class NVFP4Linear(torch.nn.Module):
    """An NVFP4 linear layer, ``y = x @ dequant(weight).T (+ bias)``; state_dict keys as in ModelOpt's
    checkpoints.

    Buffers: ``weight`` uint8 [out, in/2] (two e2m1 codes a byte, the first in the low nibble),
    ``weight_scale`` float8_e4m3fn [out, in/16], ``weight_scale_2`` fp32 0-dim (the global weight scale),
    ``input_scale`` fp32 0-dim or None (needed by mode "w4a4"), ``bias`` [out] or None. Attributes
    ``in_features``, ``out_features``, ``mode`` ("w4a16" or "w4a4").

    ``forward(x)``: x [..., in] bf16 or fp16 -> [..., out] in x's dtype, any number of tokens. The device
    scalars it needs (``1 / input_scale`` and ``input_scale * weight_scale_2``) are computed once, on the
    device, into non-persistent buffers (again after ``load_state_dict`` or a reassignment of
    ``input_scale`` / ``weight_scale_2``, not after an in-place edit of them), so a forward launches only
    the op(s) and never syncs; bad inputs raise from metadata alone.

    Construct with ``from_linear`` (quantize an ``nn.Linear``) or ``from_modelopt`` (a checkpoint's
    tensors); the constructor makes zero-filled buffers of the right shapes (for ``load_state_dict``).

    Packed (``pack()``, attribute ``packed``): ``weight`` is ``pack_weight``'s uint8 [out, 9*in/16] (the weight
    and its scales in the kernel's order) and ``weight_scale`` None; ``state_dict()`` still gives ModelOpt's
    ``weight`` and ``weight_scale`` (unpacked into new tensors on each call) and ``load_state_dict`` takes them.
    """

    packed = False  # (also for modules pickled before pack() existed)

    @property
    def mode(self):
        return self._mode

    @mode.setter
    def mode(self, value):
        if value not in MODES:
            raise ValueError(f"NVFP4Linear: 'mode': expected one of {MODES}, got {value!r}")
        self.__dict__["_mode"] = value
        self._choose()

    def __init__(self, in_features, out_features, bias=False, mode="w4a16", input_scale=False, device=None,
                 bias_dtype=torch.bfloat16):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"NVFP4Linear: 'mode': expected one of {MODES}, got {mode!r}")
        if in_features <= 0 or in_features % BLOCK or out_features <= 0:
            raise ValueError(f"NVFP4Linear: 'in_features': expected a positive multiple of {BLOCK} (and "
                             f"out_features > 0), got in_features={in_features}, out_features={out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.__dict__["_mode"] = mode
        self.register_buffer("weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.zeros(out_features, in_features // BLOCK,
                                                         dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_scale_2", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("input_scale", torch.ones((), dtype=torch.float32, device=device) if input_scale else None)
        self.register_buffer("bias", torch.zeros(out_features, dtype=bias_dtype, device=device) if bias else None)
        self.register_buffer("_alpha", None, persistent=False)
        self.register_buffer("_inv_input_scale", None, persistent=False)
        self._siblings, self._sibling_index = None, 0  # set by fuse_linears (nvfp4_gemv.model.fuse)
        self.packed = False  # pack(): weight holds packed.py's layout, weight_scale is None
        self._refresh()

    # -- construction --------------------------------------------------------------------------------

    @classmethod
    def from_linear(cls, linear, mode="w4a16", input_scale=None):
        """Quantizes an ``nn.Linear`` with NVIDIA's recipe (``quantize_weight``): ``weight_scale_2 =
        amax(w) / (6 * 448)``, per 16 values the e4m3 scale nearest ``block amax / 6 / weight_scale_2``,
        each value the e2m1 code nearest ``w / (scale * weight_scale_2)``. ``input_scale`` (a float or a
        one-element tensor, e.g. from ``input_scale_from`` or ``calibrate_input_scales``) is required by
        mode "w4a4" and kept in either mode. Syncs once (the finiteness check of the weight)."""
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"NVFP4Linear.from_linear: 'linear': expected a torch.nn.Linear, got {type(linear).__name__}")
        if mode not in MODES:
            raise ValueError(f"NVFP4Linear.from_linear: 'mode': expected one of {MODES}, got {mode!r}")
        if mode == "w4a4" and input_scale is None:
            raise ValueError("NVFP4Linear.from_linear: 'input_scale' is required for mode 'w4a4' (the global scale "
                             "x is quantized with: input_scale_from(sample activations) or calibrate_input_scales)")
        out_f, in_f = linear.weight.shape
        if not kernel_takes(in_f, out_f, mode):
            raise ValueError(f"NVFP4Linear.from_linear: 'linear': a weight of {out_f}x{in_f} (out x in) that the "
                             "kernels do not take (out_features % 128 == 0, in_features % 64 == 0, in_features <= 32768)")
        w = linear.weight.detach()
        if not bool(torch.isfinite(w).all()):
            raise ValueError("NVFP4Linear.from_linear: 'linear.weight' has non-finite values")
        return cls._from_quantized(linear, *quantize_weight(w), mode, input_scale)

    @classmethod
    def _from_quantized(cls, linear, q, s, ws2, mode, input_scale):
        """The module of ``linear`` (its shape, bias) with its weight already quantized (``q``, ``s``,
        ``ws2``: ``quantize_weight``'s outputs, or a fused group's rows of them)."""
        out_f, in_f = linear.weight.shape
        dev = linear.weight.device
        mod = cls(in_f, out_f, bias=linear.bias is not None, mode=mode, input_scale=input_scale is not None,
                  device=dev, bias_dtype=linear.bias.dtype if linear.bias is not None else torch.bfloat16)
        mod.weight.copy_(q)
        mod.weight_scale.copy_(s)
        mod.weight_scale_2.copy_(ws2)
        if input_scale is not None:
            mod.input_scale.copy_(_scalar(input_scale, "input_scale", dev))
        if linear.bias is not None:
            mod.bias.copy_(linear.bias.detach())
        mod._refresh()
        return mod

    @classmethod
    def from_modelopt(cls, tensors, bias=None, mode="w4a4"):
        """A layer from a ModelOpt NVFP4 checkpoint's tensors, taken as they are (no copy, on their device):
        ``tensors`` maps ``weight``, ``weight_scale``, ``weight_scale_2`` and (required by mode "w4a4")
        ``input_scale``, and optionally ``bias`` (or pass ``bias``). Scalars may be 0-dim or of shape [1].
        Missing, unknown, mis-typed or mis-shaped tensors raise naming the tensor."""
        fn = "NVFP4Linear.from_modelopt"
        if mode not in MODES:
            raise ValueError(f"{fn}: 'mode': expected one of {MODES}, got {mode!r}")
        known = {"weight", "weight_scale", "weight_scale_2", "input_scale", "bias"}
        unknown = sorted(set(tensors) - known)
        if unknown:
            raise ValueError(f"{fn}: unknown tensor(s) {unknown}; expected the keys {sorted(known)}")
        need = ["weight", "weight_scale", "weight_scale_2"] + (["input_scale"] if mode == "w4a4" else [])
        for name in need:
            if name not in tensors:
                why = " (mode 'w4a4' quantizes x with it; a weight-only checkpoint loads in mode 'w4a16')" \
                    if name == "input_scale" else ""
                raise KeyError(f"{fn}: missing tensor '{name}'{why}")
        if bias is not None and "bias" in tensors:
            raise ValueError(f"{fn}: 'bias' given twice (in tensors and as an argument)")
        bias = tensors.get("bias", bias)
        for name, t in list(tensors.items()) + [("bias", bias)]:
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError(f"{fn}: tensor '{name}': expected a torch.Tensor, got {type(t).__name__}")
        w, ws = tensors["weight"], tensors["weight_scale"]
        if w.dtype == torch.float4_e2m1fn_x2:
            w = w.view(torch.uint8)
        if w.dtype != torch.uint8 or w.dim() != 2:
            raise ValueError(f"{fn}: tensor 'weight': expected uint8 [out, in/2], got {w.dtype} {tuple(w.shape)}")
        out_f, in_f = w.shape[0], 2 * w.shape[1]
        if in_f == 0 or in_f % BLOCK:
            raise ValueError(f"{fn}: tensor 'weight': expected [out, in/2] with in a positive multiple of {BLOCK}, "
                             f"got {tuple(w.shape)}")
        if ws.dtype != torch.float8_e4m3fn or tuple(ws.shape) != (out_f, in_f // BLOCK):
            raise ValueError(f"{fn}: tensor 'weight_scale': expected float8_e4m3fn {(out_f, in_f // BLOCK)} "
                             f"for a weight of {tuple(w.shape)}, got {ws.dtype} {tuple(ws.shape)}")
        scalars = {}
        for name in ("weight_scale_2", "input_scale"):
            t = tensors.get(name)
            if t is None:
                continue
            if t.dtype != torch.float32 or tuple(t.shape) not in ((), (1,)):
                raise ValueError(f"{fn}: tensor '{name}': expected a float32 scalar (shape () or (1,)), "
                                 f"got {t.dtype} {tuple(t.shape)}")
            scalars[name] = t.reshape(())
        if bias is not None and (tuple(bias.shape) != (out_f,) or bias.dtype not in (torch.bfloat16, torch.float16,
                                                                                      torch.float32)):
            raise ValueError(f"{fn}: tensor 'bias': expected a floating-point [{out_f}] tensor, got "
                             f"{bias.dtype} {tuple(bias.shape)}")
        for name, t in (("weight_scale", ws), ("bias", bias), *scalars.items()):
            if t is not None and t.device != w.device:
                raise ValueError(f"{fn}: tensor '{name}': expected a tensor on {w.device} (where 'weight' is), "
                                 f"got one on {t.device}")
        if not kernel_takes(in_f, out_f, mode):
            raise ValueError(f"{fn}: tensor 'weight': a {out_f}x{in_f} (out x in) weight that the kernels do not "
                             "take (out_features % 128 == 0, in_features % 64 == 0, in_features <= 32768)")
        mod = cls(in_f, out_f, mode=mode, device="meta")  # buffers replaced below, nothing allocated
        mod.weight, mod.weight_scale, mod.weight_scale_2 = w, ws, scalars["weight_scale_2"]
        mod.input_scale = scalars.get("input_scale")  # __setattr__ computes the derived scalars
        mod.bias = bias
        return mod

    # -- state ---------------------------------------------------------------------------------------

    def _refresh(self):
        """The device scalars forward reads, from the persistent buffers (on their device, no sync)."""
        s = self.input_scale
        if s is None:
            self._alpha = self._inv_input_scale = None
        else:
            with torch.no_grad():
                self._inv_input_scale = torch.ones_like(s) / s
                self._alpha = s * self.weight_scale_2
        self._choose()

    def _choose(self):
        """Decides, once, what forward runs: the kernel of the mode and layout (``_kernel``) and the path
        (``_run``: alone, with or without bias, or a fused group's part). Called whenever one of those
        changes (construction, ``mode``, a load, ``pack``, ``fuse_linears`` and a group's end), so that a
        compiled forward reads one function attribute (a fused group's owner two: its kernel runs the
        group's product) instead of the state they are chosen from: fewer dynamo guards and graph inputs
        a layer (docs/design.md, "The host cost of a compiled step")."""
        d = self.__dict__
        if "_mode" not in d or "_buffers" not in d:
            return  # (during __init__)
        if self._mode == "w4a4" and self._buffers.get("_inv_input_scale") is None:
            kernel = _kernel_needs_input_scale
        elif self.packed:
            kernel = _kernel_packed if self._mode == "w4a16" else _kernel_packed_w4a4
        else:
            kernel = _kernel_w4a16 if self._mode == "w4a16" else _kernel_w4a4
        d["_kernel"] = kernel
        sib = d.get("_siblings")
        if sib is not None and getattr(sib, "active", False):  # (unpickling: the group's state may come later)
            sib.choose_runs()
        else:
            d["_run"] = _ALONE_RUNS[kernel, self._buffers.get("bias") is not None]

    def __setstate__(self, state):
        # a module pickled before the path was chosen once: "mode" was a plain attribute, no _run / _kernel
        if "mode" in state and "_mode" not in state:
            state = dict(state)
            state["_mode"] = state.pop("mode")
        super().__setstate__(state)
        sib = self.__dict__.get("_siblings")
        if sib is not None:
            sib.restored()
        self._choose()

    def __setattr__(self, name, value):
        sib = self.__dict__.get("_siblings")
        if sib is not None and sib.active and name in _PART_BUFFERS and self._buffers.get(name) is not value:
            # a part's buffer replaced: the group's concatenation is stale (a compiled forward no longer
            # checks the parts' buffers each call; it is guarded on the path this chooses)
            sib.dissolve(f"a buffer of '{sib.name}' was replaced (fuse_linears again to fuse it)")
        super().__setattr__(name, value)
        # a reassigned scale renews the scalars forward reads (an in-place edit of one, .copy_ or .fill_,
        # does not: reassign it, or load_state_dict, after one)
        if name in ("input_scale", "weight_scale_2") and "_inv_input_scale" in self._buffers:
            self._refresh()
        elif name in ("bias", "packed"):
            self._choose()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        sib = self._siblings
        if sib is not None and sib.active:
            # the loaded global scales may differ across the group, which one GEMV cannot compute (and
            # comparing them would sync): a fused group ends at a load, fuse_linears fuses it again
            sib.dissolve("load_state_dict into a fused module; call fuse_linears(model) after loading")
        if self.input_scale is None and prefix + "input_scale" in state_dict:  # a checkpoint that has one
            self.input_scale = torch.empty((), dtype=torch.float32, device=self.weight.device)
        given = state_dict
        if self.packed:
            state_dict = self._packed_incoming(state_dict, prefix, strict, missing_keys, error_msgs)
        else:
            state_dict = self._plain_incoming(state_dict, prefix, error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if state_dict is not given:
            for k in (prefix + "weight", prefix + "weight_scale"):
                if k in given and k not in state_dict and k in missing_keys:
                    missing_keys.remove(k)  # given, but not loadable as it is (reported as such)
        self._refresh()

    def _plain_incoming(self, state_dict, prefix, error_msgs):
        """``state_dict`` with this layer's ``weight`` and ``weight_scale`` checked by dtype: Module's loader
        converts by value, so e4m3 scale bytes typed uint8 would load as numbers (0x38, 1.0, as 56.0). A
        float4_e2m1fn_x2 weight is taken as its bytes; another dtype is reported by name and not loaded."""
        kw, ks = prefix + "weight", prefix + "weight_scale"
        w, ws = state_dict.get(kw), state_dict.get(ks)
        checks = ((kw, w, (torch.uint8, torch.float4_e2m1fn_x2), "uint8 (two e2m1 codes a byte) or float4_e2m1fn_x2"),
                  (ks, ws, (torch.float8_e4m3fn,), "float8_e4m3fn"))
        bad = [(k, t, want) for k, t, ok, want in checks if isinstance(t, torch.Tensor) and t.dtype not in ok]
        fp4 = isinstance(w, torch.Tensor) and w.dtype == torch.float4_e2m1fn_x2
        if not bad and not fp4:
            return state_dict
        sd = dict(state_dict)
        if fp4:
            sd[kw] = w.view(torch.uint8)
        for k, t, want in bad:
            error_msgs.append(f"NVFP4Linear {prefix or '<root>'}: '{k}': expected {want}, got {t.dtype}")
            del sd[k]
        return sd

    def _packed_incoming(self, state_dict, prefix, strict, missing_keys, error_msgs):
        """``state_dict`` with ModelOpt's ``weight`` and ``weight_scale`` of this (packed) layer replaced by
        their packed form, for Module's loader (which then copies it into ``weight``)."""
        kw, ks = prefix + "weight", prefix + "weight_scale"
        sd = dict(state_dict)
        w, ws = sd.pop(kw, None), sd.pop(ks, None)
        if w is None and ws is None:
            missing_keys.append(ks)  # (Module's loader reports 'weight')
            return sd
        if w is None or ws is None:  # one half given (strict=False): the other stays as it is
            missing_keys.append(kw if w is None else ks)
            have_w, have_ws = unpack_weight(self.weight.detach())
            w, ws = (have_w, ws) if w is None else (w, have_ws)
        shape_w, shape_s = (self.out_features, self.in_features // 2), (self.out_features, self.in_features // BLOCK)
        if w.dtype == torch.float4_e2m1fn_x2:
            w = w.view(torch.uint8)
        if w.dtype != torch.uint8 or tuple(w.shape) != shape_w or ws.dtype != torch.float8_e4m3fn \
                or tuple(ws.shape) != shape_s:
            error_msgs.append(f"NVFP4Linear (packed) {prefix or '<root>'}: expected '{kw}' uint8 {shape_w} and "
                              f"'{ks}' float8_e4m3fn {shape_s}, got {w.dtype} {tuple(w.shape)} and {ws.dtype} "
                              f"{tuple(ws.shape)}")
            return sd
        with torch.no_grad():
            sd[kw] = pack_weight(w, ws.to(w.device))
        return sd

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        n0 = len(destination)
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not self.packed:
            return
        # ModelOpt's keys and layout whatever the storage: this module's entries (the last ones added) again,
        # in the unpacked module's order
        mine = [destination.popitem() for _ in range(len(destination) - n0)][::-1]
        for k, t in mine:
            if k == prefix + "weight":
                w, ws = unpack_weight(t.detach())
                destination[k], destination[prefix + "weight_scale"] = w, ws
            else:
                destination[k] = t

    # -- packed storage ------------------------------------------------------------------------------

    def _why_not_fusable(self):  # (fuse_linears asks each part; awq.PreScaledNVFP4Linear says why not)
        return None

    def _why_not_packable(self):
        if self.mode != "w4a16":
            return f"the packed layout runs mode 'w4a16' only (this layer's mode is {self.mode!r})"
        if not packed_takes(self.in_features, self.out_features):
            return (f"a {self.out_features}x{self.in_features} (out x in) weight cannot be packed (in_features % 128 "
                    "== 0, out_features % 128 == 0, in_features <= 32768)")
        return None

    def pack(self):
        """Stores the weight in the W4A16 kernel's packed layout (``nvfp4_gemv.packed``), in place: ``weight``
        becomes ``pack_weight(weight, weight_scale)`` and ``weight_scale`` None (no second copy kept); the
        products are bit-identical, 5-9% faster a GEMV on H200. Mode "w4a16" only, ``in_features % 128 == 0``;
        a fused group (``fuse_linears``) packs as a whole, its parts' buffers row views of the packed
        concatenation. A packed layer stays packed (``state_dict`` unpacks, into new tensors). :return: self.
        :raises ValueError: naming the reason, for a layer (or a fused part) that cannot be packed."""
        if self.packed:
            return self
        sib = self._siblings
        if sib is not None and sib.active and not all(sib._intact(p) for p in sib.parts):
            # a part's buffer was replaced since fusing: the concatenation is stale, so the group ends here
            sib.dissolve(f"a buffer of '{sib.name}' was replaced (fuse_linears again to fuse it)")
        mods = sib.parts if sib is not None and sib.active else [self]
        for m in mods:
            why = m._why_not_packable()
            if why is not None:
                raise ValueError(f"NVFP4Linear.pack: {why}")
        with torch.no_grad():
            if sib is not None and sib.active:
                owner = sib.owner
                owner._buffers["_fused_weight"] = pack_weight(owner._fused_weight, owner._fused_weight_scale)
                owner._buffers["_fused_weight_scale"] = None
                for m in mods:
                    m.packed = True
                    m._buffers["weight_scale"] = None
                    sib.repoint(m)  # weight: the part's rows of the packed concatenation (whole 8-row groups)
            else:
                self._buffers["weight"] = pack_weight(self.weight, self.weight_scale)
                self._buffers["weight_scale"] = None
                self.packed = True
        return self

    def _apply(self, fn, recurse=True):
        # Module.to(dtype), .half(), .bfloat16() convert floating-point buffers: the format's keep their dtype
        # (moved to the new device from the original, so nothing is rounded); bias follows the model
        sib = self._siblings
        if sib is not None and not sib.active and self is sib.owner:  # a dissolved group's concatenations
            for name in FUSED_BUFFERS:                                 # are not moved along
                self._buffers[name] = None
        before = {n: self._buffers[n] for n in _FORMAT_BUFFERS if self._buffers.get(n) is not None}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(new.device)
        if sib is not None and sib.active:
            sib.repoint(self)
        return self

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"mode={self.mode!r}, input_scale={'yes' if self.input_scale is not None else 'no'}"
                + (", packed=True" if self.packed else ""))

    # -- forward -------------------------------------------------------------------------------------

    def forward(self, x):
        if not torch.compiler.is_compiling():  # (traced: the op's fake checks the same at trace time)
            self._check_x(x)
        return self._run(self, x)

    def _check_x(self, x):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"NVFP4Linear: argument 'x': expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in _X_DTYPES:
            raise TypeError(f"NVFP4Linear: argument 'x': expected dtype torch.bfloat16 or torch.float16, got {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"NVFP4Linear: argument 'x': expected shape [..., {self.in_features}] (in_features), "
                             f"got {tuple(x.shape)}")
        if x.device != self.weight.device:
            raise ValueError(f"NVFP4Linear: argument 'x': expected a tensor on {self.weight.device} (where 'weight' "
                             f"is), got one on {x.device}")

    def _product(self, x2, fused=False):
        """``x2 @ dequant(w).T (+ bias)`` in x2's dtype with this module's kernel: its own buffers, or (a
        fused group's owner, ``fused``) the group's concatenations."""
        if x2.shape[0] == 0:
            if self._kernel in (_kernel_needs_input_scale, _kernel_packed_w4a4):
                self._kernel(self, x2, fused)  # the module cannot run at all: said also for no rows, as alone
            rows = (self._fused_weight if fused else self.weight).shape[0]
            return x2.new_empty((0, rows))
        out = self._kernel(self, x2, fused)
        bias = self._buffers.get("_fused_bias" if fused else "bias")
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out


# What forward runs, chosen once by NVFP4Linear._choose: plain functions of (module, ...), so that a traced
# forward is guarded on which function a module holds, not on the attributes it was chosen from.


def _alone(mod, x, kernel, bias):
    x2 = as_rows(x)
    if not x2.shape[0]:
        return x.new_empty((*x.shape[:-1], mod.weight.shape[0]))
    out = kernel(mod, x2, False)
    if bias:
        out = out + mod._buffers["bias"].to(out.dtype)
    return out.reshape(*x.shape[:-1], out.shape[-1])


# A module alone runs one of these: one function for each kernel and bias, each its own code object (dynamo
# guards a function attribute by its code, so the kernel must be in the code, not in a closure's cell)
def _run_w4a16(mod, x):
    return _alone(mod, x, _kernel_w4a16, False)


def _run_w4a16_bias(mod, x):
    return _alone(mod, x, _kernel_w4a16, True)


def _run_packed(mod, x):
    return _alone(mod, x, _kernel_packed, False)


def _run_packed_bias(mod, x):
    return _alone(mod, x, _kernel_packed, True)


def _run_w4a4(mod, x):
    return _alone(mod, x, _kernel_w4a4, False)


def _run_w4a4_bias(mod, x):
    return _alone(mod, x, _kernel_w4a4, True)


def _run_packed_w4a4(mod, x):
    _kernel_packed_w4a4(mod, x, False)


def _run_needs_input_scale(mod, x):
    _kernel_needs_input_scale(mod, x, False)


# The kernels read the module's buffers from ``_buffers`` itself: ``mod.weight`` would go through
# ``Module.__getattr__``, which a traced forward guards on three dicts' types, on every compiled call.


def _kernel_w4a16(mod, x2, fused):
    b = mod._buffers
    w, ws = (b["_fused_weight"], b["_fused_weight_scale"]) if fused else (b["weight"], b["weight_scale"])
    return gemv(x2, None, w, ws, alpha=b["weight_scale_2"], out_dtype=x2.dtype)


def _kernel_packed(mod, x2, fused):
    b = mod._buffers
    return gemv_packed(x2, b["_fused_weight" if fused else "weight"], alpha=b["weight_scale_2"], out_dtype=x2.dtype)


def _kernel_packed_w4a4(mod, x2, fused):
    raise ValueError(f"NVFP4Linear: a packed weight runs mode 'w4a16' only, not {mod.mode!r}")


def _kernel_w4a4(mod, x2, fused):
    b = mod._buffers
    w, ws = (b["_fused_weight"], b["_fused_weight_scale"]) if fused else (b["weight"], b["weight_scale"])
    if W4A4_VIA_W4A16_FROM is not None and x2.shape[0] >= W4A4_VIA_W4A16_FROM:
        xd = quantize_dequantized(x2, b["_inv_input_scale"])  # the values quantize's codes stand for
        return gemv(xd, None, w, ws, alpha=b["_alpha"], out_dtype=x2.dtype)
    xq, xs = quantize(x2, b["_inv_input_scale"])
    return gemv(xq, xs, w, ws, alpha=b["_alpha"], out_dtype=x2.dtype)


def _kernel_needs_input_scale(mod, x2, fused):
    raise ValueError("NVFP4Linear: mode 'w4a4' needs 'input_scale' (None here): set it, or use mode 'w4a16'")


# a fused part's paths lived here before they moved to fuse.py: a whole module pickled then names them here
globals().update({f.__name__: f for f in (*_PART_RUNS, _run_mixed)})

# the alone paths' names before 2026-12-06: a whole module pickled then names them (its __setstate__ chooses
# its path again, so any function does here)
_run_alone, _run_alone_bias = _run_w4a16, _run_w4a16_bias

_ALONE_RUNS = {
    (_kernel_w4a16, False): _run_w4a16, (_kernel_w4a16, True): _run_w4a16_bias,
    (_kernel_packed, False): _run_packed, (_kernel_packed, True): _run_packed_bias,
    (_kernel_w4a4, False): _run_w4a4, (_kernel_w4a4, True): _run_w4a4_bias,
    (_kernel_packed_w4a4, False): _run_packed_w4a4, (_kernel_packed_w4a4, True): _run_packed_w4a4,
    (_kernel_needs_input_scale, False): _run_needs_input_scale, (_kernel_needs_input_scale, True): _run_needs_input_scale,
}

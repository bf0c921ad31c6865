"""ModelOpt's NVFP4_AWQ: a quantized linear with a ``pre_quant_scale`` ([in], the model's dtype) that
multiplies x per input channel before the product and before x is quantized (mode "w4a4"): ``y = W (x *
pre_quant_scale)``. Two ways to run it:

* folded (``fold_pre_quant_scales``): where the linears that share one norm's output all carry the same
  scale, the norm's weight takes it (``norm.weight * pre_quant_scale``, rounded once to the norm's dtype)
  and the linears become plain ``NVFP4Linear`` (fusable, packable): free at run time. Only for the
  decoder layers whose graph is known (``FOLD_RULES``: an RMSNorm ``y = weight * normalized(x)`` whose
  output feeds those linears and nothing else);
* in the layer (``PreScaledNVFP4Linear``): everything else (o_proj, down_proj: no norm before them), one
  elementwise product a call.
"""

import torch

from .linear import NVFP4Linear

# model_type -> [(the decoder layer's norm, the linears that read its output and nothing else reads)]
_LLAMA = (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
          ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")))
FOLD_RULES = {"llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA,
              "phi3": (("input_layernorm", ("self_attn.qkv_proj",)),
                       ("post_attention_layernorm", ("mlp.gate_up_proj",)))}


class PreScaledNVFP4Linear(NVFP4Linear):
    """``NVFP4Linear`` with ModelOpt AWQ's ``pre_quant_scale`` buffer ([in], floating point):
    ``forward(x) = NVFP4Linear.forward(x * pre_quant_scale)`` (the product in x's dtype). Not fused by
    ``fuse_linears`` (each part would scale x its own way)."""

    def __init__(self, in_features, out_features, *args, device=None, **kwargs):
        super().__init__(in_features, out_features, *args, device=device, **kwargs)
        self.register_buffer("pre_quant_scale", torch.ones(in_features, dtype=torch.bfloat16, device=device))

    @classmethod
    def from_parts(cls, tensors, pre_quant_scale, mode, dtype):
        """The layer of ``tensors`` (as ``NVFP4Linear.from_modelopt`` takes them, no copy) and its scale, cast
        to ``dtype`` (the activations' dtype)."""
        mod = cls.from_modelopt(tensors, mode=mode)
        if not isinstance(pre_quant_scale, torch.Tensor) or not pre_quant_scale.is_floating_point() \
                or tuple(pre_quant_scale.shape) != (mod.in_features,):
            raise ValueError(f"tensor 'pre_quant_scale': expected a floating-point [{mod.in_features}] tensor, got "
                             f"{getattr(pre_quant_scale, 'dtype', type(pre_quant_scale).__name__)} "
                             f"{tuple(getattr(pre_quant_scale, 'shape', ()))}")
        if pre_quant_scale.device != mod.weight.device:
            raise ValueError(f"tensor 'pre_quant_scale': expected a tensor on {mod.weight.device} (where 'weight' "
                             f"is), got one on {pre_quant_scale.device}")
        mod.pre_quant_scale = pre_quant_scale.to(dtype)
        return mod

    def plain(self):
        """The same layer without the scale (its tensors, not copies), for a scale moved elsewhere."""
        parts = {n: getattr(self, n) for n in ("weight", "weight_scale", "weight_scale_2", "input_scale", "bias")
                 if getattr(self, n) is not None}
        return NVFP4Linear.from_modelopt(parts, mode=self.mode)

    def forward(self, x):
        if not isinstance(x, torch.Tensor):
            return super().forward(x)  # (raises, naming the argument)
        s = self.pre_quant_scale
        return super().forward(x * (s if s.dtype == x.dtype else s.to(x.dtype)))

    def extra_repr(self):
        return super().extra_repr() + ", pre_quant_scale=yes"

    def _why_not_packable(self):
        # plain() hands its ModelOpt tensors to the norm's fold, and the packed layout would replace them
        return "an AWQ layer (pre_quant_scale) stays in ModelOpt's layout"

    def _why_not_fusable(self):
        return "an AWQ layer scales its own x (pre_quant_scale): each part would scale x its own way"


def fold_pre_quant_scales(model):
    """Moves each shared ``pre_quant_scale`` into the norm before it, where ``FOLD_RULES`` knows the model's
    graph (``model.config.model_type``) and every linear after that norm has the same scale (compared: one
    sync a group); those linears become plain ``NVFP4Linear``. Returns the names of the linears folded."""
    rules = FOLD_RULES.get(getattr(getattr(model, "config", None), "model_type", None))
    if not rules:
        return []
    done = []
    for lname, layer in list(model.named_modules()):
        for norm_name, lin_names in rules:
            norm = getattr(layer, norm_name, None)
            try:
                lins = [layer.get_submodule(n) for n in lin_names]
            except AttributeError:
                continue
            if norm is None or "RMSNorm" not in type(norm).__name__ or not all(
                    isinstance(m, PreScaledNVFP4Linear) for m in lins):
                continue
            w, s = getattr(norm, "weight", None), lins[0].pre_quant_scale
            if not isinstance(w, torch.Tensor) or tuple(w.shape) != tuple(s.shape):
                continue
            if not all(torch.equal(s, m.pre_quant_scale) for m in lins[1:]):
                continue  # scales that differ stay in their layers
            with torch.no_grad():
                w.copy_((w.float() * s.float()).to(w.dtype))
            for n, m in zip(lin_names, lins):
                parent, _, child = n.rpartition(".")
                setattr(layer.get_submodule(parent) if parent else layer, child, m.plain())
                done.append(f"{lname}.{n}" if lname else n)
    return done

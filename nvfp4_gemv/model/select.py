"""Which of a model's modules a name pattern picks (``name_matches``: the rule of ``quantize_model``'s
``skip``, ``input_scales`` keys and ModelOpt's ``exclude_modules``), and a forward with pre-hooks
(``run_with_pre_hooks``: what calibration runs). Below the linears' and the experts' converters, which both
use them.
"""

import fnmatch

import torch


def name_matches(name, patterns):
    """Whether a module's qualified name matches one of ``patterns``: equal to it, ending in ``"." +
    pattern`` (so ``"lm_head"`` matches ``"lm_head"`` and ``"model.lm_head"``, ``"mlp.down_proj"`` every
    layer's), or matching it as an ``fnmatch`` glob (``"*.self_attn.*"``, ``"model.layers.0.*"``)."""
    return any(name == p or name.endswith("." + p) or fnmatch.fnmatchcase(name, p) for p in patterns)


def run_with_pre_hooks(model, forward_loop, hooks):
    """``forward_loop(model)`` without autograd, with the forward pre-hooks ``[(module, fn)]`` registered for
    it and removed after, also when it raises."""
    handles = [m.register_forward_pre_hook(fn) for m, fn in hooks]
    try:
        with torch.no_grad():
            forward_loop(model)
    finally:
        for h in handles:
            h.remove()

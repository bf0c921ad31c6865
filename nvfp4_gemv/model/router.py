"""``TopKRouter``: a mixture-of-experts softmax top-k router whose decode runs as one kernel
(``nvfp4_gemv.topk_route``, plus the fill of its counters) in place of transformers' ``Qwen3MoeTopKRouter``
(four launches a layer on the GPU: the router's GEMV, softmax, and ``torch.topk``'s two; 15 us a layer of
Qwen3-30B-A3B's step on an H100).

The weight stays what it is (the model's dtype, named ``weight`` as in the checkpoint); the forward contract is
transformers': ``(router_logits, router_scores, router_indices)``. ``fuse_routers`` changes each router's class,
in place, to a subclass of both its own class and ``TopKRouter`` (so transformers' ``OutputRecorder`` still finds
it for ``output_router_logits``, and the module, its Parameter and hooks stay the same objects). ``fuse=True`` in
``quantize_model``, ``load_modelopt`` and ``from_pretrained`` calls it after ``fuse_linears`` (GPU-tested since
session 72: docs/design.md, "Mixture-of-experts layers"). Where autograd
would track the weight or the input (a forward with grad enabled), the torch ops run instead, so training
keeps every gradient.
"""

import importlib

import torch

from ..router_op import route_torch, topk_route

# transformers' routers whose __init__ and forward are Qwen3MoeTopKRouter's, line for line (read in transformers
# 5.25): softmax in fp32, topk, optional renormalisation, cast back; the weight [E, H] named "weight"
ROUTER_CLASSES = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "OlmoeTopKRouter", "FlexOlmoTopKRouter",
                  "Qwen3NextTopKRouter", "Qwen3OmniMoeThinkerTextTopKRouter", "Qwen3OmniMoeTalkerTextTopKRouter")
_FUSED_PREFIX = "OneKernel__"


class TopKRouter(torch.nn.Module):
    """A softmax top-k router (transformers' attribute names: ``weight``, ``top_k``, ``num_experts``,
    ``hidden_dim``, ``norm_topk_prob``) whose forward is ``topk_route``."""

    def __init__(self, weight, top_k, norm_topk_prob):
        super().__init__()
        self.weight = weight if isinstance(weight, torch.nn.Parameter) else torch.nn.Parameter(weight)
        self.top_k = int(top_k)
        self.num_experts, self.hidden_dim = self.weight.shape
        self.norm_topk_prob = bool(norm_topk_prob)

    @classmethod
    def from_router(cls, router):
        """A new module with the same Parameter (not a copy) and settings as a transformers router."""
        return cls(router.weight, router.top_k, router.norm_topk_prob)

    def extra_repr(self):
        return f"experts={self.num_experts}, hidden={self.hidden_dim}, top_k={self.top_k}, norm={self.norm_topk_prob}"

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, self.hidden_dim)
        w = self.weight
        if torch.is_grad_enabled() and (w.requires_grad or x.requires_grad):
            return route_torch(x, w, self.top_k, self.norm_topk_prob)
        return topk_route(x, w, self.top_k, self.norm_topk_prob)


_fused = {}


def fused_class(cls):
    """The subclass of ``TopKRouter`` and transformers' router class ``cls`` that ``fuse_routers`` gives its
    routers (one a class, named in this module so that pickle finds it)."""
    got = _fused.get(cls)
    if got is None:
        name = _FUSED_PREFIX + cls.__module__.replace(".", "__") + "__" + cls.__qualname__
        got = _fused[cls] = type(name, (TopKRouter, cls), {"__module__": __name__, "__qualname__": name})
        globals()[name] = got
    return got


def __getattr__(name):  # a fused class named by a pickle, before this process fused any router of its class
    if name.startswith(_FUSED_PREFIX):
        mod, _, qual = name[len(_FUSED_PREFIX):].rpartition("__")
        base = getattr(importlib.import_module(mod.replace("__", ".")), qual)
        return fused_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def fuse_routers(model):
    """Makes, in place, every router of a class in ``ROUTER_CLASSES`` a ``TopKRouter`` (``fused_class``: the
    same module object, weight and hooks); returns the number changed."""
    found = [m for m in model.modules() if type(m).__name__ in ROUTER_CLASSES]
    for m in found:
        m.__class__ = fused_class(type(m))
    return len(found)


def unfuse_routers(model):
    """Undoes ``fuse_routers`` in place (for ``fuse=True``'s linear fusion with transformers' own routers):
    every ``TopKRouter`` that ``fuse_routers`` made gets its transformers class back; returns the number
    changed."""
    found = [m for m in model.modules() if type(m).__name__.startswith(_FUSED_PREFIX) and isinstance(m, TopKRouter)]
    for m in found:
        m.__class__ = type(m).__mro__[2]  # (fused_class: (itself, TopKRouter, transformers' class, ...))
    return len(found)

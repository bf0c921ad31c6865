"""``TopKRouter``: a mixture-of-experts softmax top-k router whose decode runs in one launch
(``nvfp4_gemv.topk_route``), in place of transformers' ``Qwen3MoeTopKRouter`` (four launches a layer on the GPU:
the router's GEMV, softmax, and ``torch.topk``'s two; 15 us a layer of Qwen3-30B-A3B's step on an H100).

The weight stays what it is (the model's dtype, named ``weight`` as in the checkpoint); the forward contract is
transformers': ``(router_logits, router_scores, router_indices)``. ``fuse_routers`` swaps them in; opt-in:
the kernel was built and tested on the CPU side in session 71 but has not run on a GPU yet, so ``fuse=True``
in ``quantize_model`` and the loaders does not call it (docs/design.md, "Mixture-of-experts layers"). Where autograd would track the weight (a forward with
grad enabled on a weight that requires it), the torch ops run instead, so that training still gets gradients.
"""

import torch

from ..router_op import route_torch, topk_route

# transformers' routers whose __init__ and forward are Qwen3MoeTopKRouter's, line for line (read in transformers
# 5.25): softmax in fp32, topk, optional renormalisation, cast back; the weight [E, H] named "weight"
ROUTER_CLASSES = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "OlmoeTopKRouter", "FlexOlmoTopKRouter",
                  "Qwen3NextTopKRouter", "Qwen3OmniMoeThinkerTextTopKRouter", "Qwen3OmniMoeTalkerTextTopKRouter")


class TopKRouter(torch.nn.Module):
    def __init__(self, weight, top_k, norm_topk_prob):
        super().__init__()
        self.weight = weight if isinstance(weight, torch.nn.Parameter) else torch.nn.Parameter(weight)
        self.top_k = int(top_k)
        self.num_experts, self.hidden_dim = self.weight.shape
        self.norm_topk_prob = bool(norm_topk_prob)

    @classmethod
    def from_router(cls, router):
        """The same parameter (not a copy) and settings as a transformers router."""
        return cls(router.weight, router.top_k, router.norm_topk_prob)

    def extra_repr(self):
        return f"experts={self.num_experts}, hidden={self.hidden_dim}, top_k={self.top_k}, norm={self.norm_topk_prob}"

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, self.hidden_dim)
        w = self.weight
        if w.requires_grad and torch.is_grad_enabled():
            return route_torch(x, w, self.top_k, self.norm_topk_prob)
        return topk_route(x, w, self.top_k, self.norm_topk_prob)


def fuse_routers(model):
    """Replaces, in place, every router of a class in ``ROUTER_CLASSES`` by ``TopKRouter`` (the same weight);
    returns the number replaced."""
    found = [(n, m) for n, m in model.named_modules() if type(m).__name__ in ROUTER_CLASSES]
    for name, router in found:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, TopKRouter.from_router(router))
    return len(found)

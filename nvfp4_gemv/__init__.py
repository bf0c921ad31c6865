"""NVFP4 GEMV on Hopper and Blackwell.

``gemv`` (the op ``torch.ops.nvfp4.gemv``, ``nvfp4_gemv.op``) is an NVFP4 linear layer in decode, for model code:
W4A16 (bf16/fp16 activations as they are, ``nvfp4_gemv.w4a16``) or W4A4 (NVFP4 activations). ``gemv_packed``
(``torch.ops.nvfp4.gemv_packed``) is its W4A16 form on a weight packed once by ``pack_weight``
(``nvfp4_gemv.packed``), 5-9% faster.
``custom_kernel`` takes the GPU MODE ``nvfp4_gemv`` competition's 7-tuple (``nvfp4_gemv.leaderboard``; the
repository's ``submission.py`` is that module and the ones it imports, stitched into one file for the
leaderboard by tools/gen_submission.py).

For models: ``quantize`` (NVFP4 activations, ``nvfp4_gemv.quant``), ``NVFP4Linear`` and ``quantize_model``
(``nvfp4_gemv.model.linear``), ``NVFP4Experts`` (a MoE layer's routed experts, ``nvfp4_gemv.model.experts``), ``fuse_linears`` (one GEMV for q/k/v and for gate/up, ``nvfp4_gemv.model.fuse``), ``save_modelopt`` / ``load_modelopt`` (NVIDIA ModelOpt NVFP4 checkpoints in the
Hugging Face layout, ``nvfp4_gemv.model.modelopt``; needs the ``hf`` extra: safetensors, transformers), ``generate``
(decoding with the whole step in one CUDA graph, ``nvfp4_gemv.model.generation``).
``from_pretrained`` builds the model of an NVFP4 checkpoint folder (ModelOpt or compressed-tensors) on the
meta device and reads each tensor once onto the device (``nvfp4_gemv.model.pretrained``); after this import,
transformers' ``AutoModelForCausalLM.from_pretrained`` does the same for ModelOpt checkpoints
(``nvfp4_gemv.model.hf_quantizer``). ``CheckpointError``: what a checkpoint that cannot load raises.
"""

from .leaderboard import check_inputs, custom_kernel
from .op import gemv, gemv_packed
from .packed import pack_weight, unpack_weight
from .quant import dequantize, quantize, quantize_reference, quantize_weight
from .reference import gemv_reference, swizzled_scale_shape
from .model import hf_quantizer as _hf_quantizer
from .model.awq import PreScaledNVFP4Linear
from .model.checkpoint import CheckpointError
from .model.convert import calibrate_input_scales, quantize_model
from .model.experts import NVFP4Experts
from .model.experts_convert import calibrate_expert_input_scales
from .model.fuse import fuse_linears
from .model.generation import generate
from .model.linear import NVFP4Linear, input_scale_from
from .model.modelopt import load_modelopt, save_modelopt
from .model.pretrained import from_pretrained
from .model.router import TopKRouter, fuse_routers, unfuse_routers
from .router_op import topk_route
from .model.tp import shard_model

__all__ = ["CheckpointError", "NVFP4Experts", "NVFP4Linear", "PreScaledNVFP4Linear", "calibrate_expert_input_scales", "calibrate_input_scales", "check_inputs",
           "TopKRouter", "custom_kernel", "dequantize", "from_pretrained", "fuse_linears", "fuse_routers", "gemv", "gemv_packed", "gemv_reference", "generate", "unfuse_routers",
           "input_scale_from", "load_modelopt", "pack_weight", "quantize", "quantize_model", "quantize_reference",
           "quantize_weight", "save_modelopt", "shard_model", "swizzled_scale_shape", "topk_route", "unpack_weight"]

_hf_quantizer.install()  # transformers' "modelopt" quant_method, when transformers' quantizers are imported


def _alias_model_modules():
    """``nvfp4_gemv.model.linear`` and the model side's other flat module names from before ``nvfp4_gemv.model``
    (imports, and modules pickled under those names) name the same module objects."""
    import importlib
    import sys

    from .model import MODULES

    for name in MODULES:
        mod = importlib.import_module(f"{__name__}.model.{name}")
        sys.modules.setdefault(f"{__name__}.{name}", mod)
        globals().setdefault(name, mod)


_alias_model_modules()

"""ModelOpt's checkpoint layout as the loaders' format object (``ModelOptFormat``; ``pretrained.detect_format``
gives it, ``modelopt.load_modelopt`` wraps its ``QuantConfig`` in it), the counterpart of
``compressed_tensors.CompressedTensorsConfig``: which prefixes are quantized, a layer's tensors under
``NVFP4Linear``'s names (``MODELOPT_FIELDS``), the config's checks.
"""

import torch

from .checkpoint import fail

# a ModelOpt layer's tensors, as NVFP4Linear names them
MODELOPT_FIELDS = ("weight", "weight_scale", "weight_scale_2", "input_scale", "bias", "pre_quant_scale")


class ModelOptFormat:
    """ModelOpt's layout (``modelopt.py``'s docstring) seen as ``compressed_tensors.CompressedTensorsConfig``
    is (the loaders' format object, ``pretrained.detect_format``): which prefixes are quantized, their
    tensors under ``NVFP4Linear``'s names, the config's checks."""

    kind = "modelopt"

    def __init__(self, qc, modules=frozenset()):
        self.qc, self.source = qc, qc.source
        self.kv_cache_quant_algo, self.quant_algo = qc.kv_cache_quant_algo, qc.quant_algo
        self.activations = qc.quant_algo in ("NVFP4", "NVFP4_AWQ")

    def quantized_prefixes(self, keys, entries=None):
        """Prefixes with a ``weight_scale`` or ``weight_scale_2``, or a uint8 ``weight``: so a layer missing one
        of its tensors is still a quantized layer, and the error names the missing tensor."""
        out = set()
        for k in keys:
            p, _, s = k.rpartition(".")
            if s in ("weight_scale", "weight_scale_2", "pre_quant_scale") or \
                    (s == "weight" and entries is not None and entries[k].dtype == torch.uint8):
                out.add(p)
        return out

    def layer_keys(self, prefix, keys):
        out, other = {}, []
        for k in keys:
            if k.startswith(prefix + ".") and "." not in k[len(prefix) + 1:]:
                s = k[len(prefix) + 1:]
                (out.__setitem__(s, (k, False)) if s in MODELOPT_FIELDS else other.append(k))
        return out, other

    def check_module(self, name, module, quantized, who, modules=frozenset()):
        if quantized and self.qc.excludes(name, modules):
            fail(who, f"tensor '{name}.weight_scale': module '{name}' is quantized, but {self.source} excludes it")

    def checkpoint_name(self, prefix, field):
        return f"{prefix}.{field}"

"""transformers' own door: after ``import nvfp4_gemv``, ``AutoModelForCausalLM.from_pretrained(path,
device_map="cuda")`` loads a ModelOpt NVFP4 checkpoint (config.json ``quantization_config.quant_method
"modelopt"``) with ``NVFP4Linear`` layers, as ``nvfp4_gemv.from_pretrained`` does.

transformers (5.x) builds the model on the meta device, asks the quantizer registered for the config's
``quant_method`` to prepare it (``register_quantization_config`` / ``register_quantizer``), streams each
checkpoint tensor onto the device into the module attribute of its name, then asks the quantizer to finish.
Here: before the weights, the checkpoint is planned exactly as ``from_pretrained`` plans it
(``pretrained.plan``: every tensor checked on the files' headers, ``CheckpointError`` naming the one that
does not fit) and each quantized linear is replaced by a placeholder holding meta buffers of the
checkpoint's names, dtypes and shapes (so transformers reads each tensor once, as it is, onto the device);
after, each placeholder becomes an ``NVFP4Linear`` of its tensors (no copy), and ``pretrained.finish``
folds AWQ scales, checks that nothing is left on meta, fuses and packs (``OPTIONS``: mode "w4a16", fused,
packed; for mode "w4a4" use ``nvfp4_gemv.from_pretrained``). compressed-tensors checkpoints keep
transformers' own quantizer (which dequantizes them): load those with ``nvfp4_gemv.from_pretrained``.

Registration waits for transformers: importing ``transformers.quantizers.auto`` costs seconds, so
``install()`` (run by ``import nvfp4_gemv``) registers at once where it is already imported, else when it
is (an import hook that only watches for that one module). Where a transformers version brings a
"modelopt" quantizer of its own, it is kept (``registered()`` then says False) and
``nvfp4_gemv.from_pretrained`` is the way to these layers.
"""

import importlib.abc
import importlib.machinery
import os
import sys

import torch

TARGET = "transformers.quantizers.auto"
METHOD = "modelopt"
WHO = "from_pretrained (transformers, nvfp4_gemv's quantizer)"
OPTIONS = {"mode": "w4a16", "fuse": True, "pack": None}
_state = {"registered": False}


def registered():
    """Whether transformers' "modelopt" quant_method is nvfp4_gemv's quantizer."""
    return _state["registered"]


class _Pending(torch.nn.Module):
    """A quantized linear's checkpoint tensors (buffers of their names) until ``_finish`` builds the layer."""

    def __init__(self, metas):
        super().__init__()
        for name, t in metas.items():
            self.register_buffer(name, t)


def _define():
    from transformers.quantizers.base import HfQuantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin

    from .checkpoint import Checkpoint, CheckpointError
    from .experts_convert import ExpertFields
    from .pretrained import _device, _set, build_layer, detect_format, finish, plan

    class NVFP4GemvModelOptConfig(QuantizationConfigMixin):
        """config.json's ``quantization_config`` of a ModelOpt checkpoint, kept as it is."""

        def __init__(self, **kwargs):
            for k, v in kwargs.items():
                setattr(self, k, v)
            self.quant_method = METHOD

    class NVFP4GemvModelOptQuantizer(HfQuantizer):
        """Loads ModelOpt NVFP4 checkpoints into ``NVFP4Linear`` layers (module docstring)."""

        requires_calibration = True  # pre-quantized checkpoints only

        def validate_environment(self, device_map=None, **kwargs):
            devices = set(device_map.values()) if isinstance(device_map, dict) else {device_map}
            devices = {"cpu" if d is None else d for d in devices}
            if len(devices) != 1 or "disk" in devices:
                raise ValueError(f"{WHO}: device_map {device_map!r}: the layers load onto one device (e.g. "
                                 "device_map='cuda')")
            d = devices.pop()
            self.device = _device(torch.device("cuda", d) if isinstance(d, int) else d)

        def update_dtype(self, dtype):
            return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16

        def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
            if not checkpoint_files or not str(checkpoint_files[0]).endswith(".safetensors"):
                raise CheckpointError(f"{WHO}: expected safetensors files, got {checkpoint_files!r}")
            path = os.path.dirname(checkpoint_files[0])
            fmt = detect_format(path, WHO)
            if fmt.kind != "modelopt":
                raise CheckpointError(f"{WHO}: {path} is a {fmt.kind} checkpoint: use nvfp4_gemv.from_pretrained")
            ckpt = Checkpoint(path, WHO)
            self.plan = plan(model, ckpt, fmt, OPTIONS["mode"], WHO)
            moe = sorted(n for n, fields in self.plan.layers.items() if isinstance(fields, ExpertFields))
            if moe:  # (checked on the plan: nothing read, nothing replaced yet)
                raise CheckpointError(f"{WHO}: module '{moe[0]}': MoE experts load with nvfp4_gemv.from_pretrained "
                                      "(transformers' door does not take them yet)")
            for prefix, fields in self.plan.layers.items():
                _set(model, prefix, _Pending({f: ckpt.entries[k].meta() for f, (k, _) in fields.items()}))
            ignore = model._keys_to_ignore_on_load_unexpected or set()
            model._keys_to_ignore_on_load_unexpected = type(ignore)(ignore) | {r"\.(k|v)_scale$"} if \
                isinstance(ignore, set) else list(ignore) + [r"\.(k|v)_scale$"]  # (warned of at the end)

        def _process_model_after_weight_loading(self, model, **kwargs):
            p = self.plan
            dtype = next((t.dtype for t in model.parameters() if t.is_floating_point()), torch.bfloat16)
            for prefix, fields in p.layers.items():
                pending = model.get_submodule(prefix)
                tensors = {}
                for f, (k, _) in fields.items():
                    t = pending._buffers[f]
                    if t.is_meta or not getattr(t, "_is_hf_initialized", False):
                        raise CheckpointError(f"{WHO}: tensor '{k}' was not loaded by transformers")
                    tensors[k] = t
                _set(model, prefix, build_layer(prefix, fields, tensors, p, dtype, WHO))
            pack = OPTIONS["pack"] if OPTIONS["pack"] is not None else p.mode == "w4a16"
            return finish(model, p, self.device, OPTIONS["fuse"], pack, who=WHO)

        @property
        def is_serializable(self):
            return False  # nvfp4_gemv.save_modelopt writes these models

        @property
        def is_trainable(self):
            return False

    return NVFP4GemvModelOptConfig, NVFP4GemvModelOptQuantizer


def _register(auto):
    if METHOD in auto.AUTO_QUANTIZER_MAPPING or METHOD in auto.AUTO_QUANTIZATION_CONFIG_MAPPING:
        return  # transformers' own (or ours, registered already)
    config_cls, quantizer_cls = _define()
    auto.register_quantization_config(METHOD)(config_cls)
    auto.register_quantizer(METHOD)(quantizer_cls)
    _state["registered"] = True


class _Hook(importlib.abc.MetaPathFinder):
    """Registers when ``transformers.quantizers.auto`` has been executed (and then leaves sys.meta_path)."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _register(module)

        spec.loader.exec_module = exec_module
        return spec


def install():
    """Registers nvfp4_gemv's "modelopt" quantizer with transformers, now if its quantizers are imported,
    else when they are. Without transformers installed, nothing happens."""
    auto = sys.modules.get(TARGET)
    if auto is not None:
        _register(auto)
    elif not any(isinstance(f, _Hook) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook())

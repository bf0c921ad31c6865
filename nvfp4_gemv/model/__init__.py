"""The model side of nvfp4_gemv, one concern a module: ``linear`` (``NVFP4Linear``, one layer), ``fuse``
(one GEMV for a group of sibling layers), ``select`` (which modules a name pattern picks), ``convert``
(``quantize_model``, ``calibrate_input_scales``: whole models), ``experts`` / ``experts_convert`` (MoE
experts: the module, and their quantize, calibration and load plan), ``awq`` (ModelOpt's pre-quant scales),
``checkpoint`` / ``modelopt`` / ``modelopt_format`` / ``compressed_tensors`` / ``pretrained`` /
``hf_quantizer`` (checkpoint formats and the loaders), ``generation`` (``generate``), ``tp`` (tensor
parallelism) and ``router`` (MoE routers in one launch). They build on the kernel side (``nvfp4_gemv.op``, ``quant``, ``packed``, ...), never the other
way. Public names are imported from ``nvfp4_gemv``; ``nvfp4_gemv.model.linear`` and the other flat names of
these modules from before this sub-package stay importable (aliases made there, for every module in
``MODULES``).
"""

MODULES = ("linear", "fuse", "select", "convert", "experts", "experts_forward", "experts_convert", "awq", "checkpoint",
           "modelopt", "modelopt_format", "compressed_tensors", "pretrained", "hf_quantizer", "generation", "tp", "router")

"""NVFP4 GEMV on Hopper and Blackwell.

``gemv`` (the op ``torch.ops.nvfp4.gemv``) is an NVFP4 linear layer in decode, for model code
(``nvfp4_gemv.op``). ``custom_kernel`` takes the GPU MODE ``nvfp4_gemv`` competition's 7-tuple
(``nvfp4_gemv.kernel``; the repository's ``submission.py`` is that module, generated for the leaderboard
by tools/gen_submission.py).
"""

from .kernel import check_inputs, custom_kernel
from .op import gemv, gemv_reference, swizzled_scale_shape

__all__ = ["check_inputs", "custom_kernel", "gemv", "gemv_reference", "swizzled_scale_shape"]

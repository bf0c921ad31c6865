"""NVFP4 GEMV on Hopper and Blackwell.

``gemv`` (the op ``torch.ops.nvfp4.gemv``, ``nvfp4_gemv.op``) is an NVFP4 linear layer in decode, for model code.
``custom_kernel`` takes the GPU MODE ``nvfp4_gemv`` competition's 7-tuple (``nvfp4_gemv.leaderboard``; the
repository's ``submission.py`` is that module and the ones it imports, stitched into one file for the
leaderboard by tools/gen_submission.py).
"""

from .leaderboard import check_inputs, custom_kernel
from .op import gemv
from .reference import gemv_reference, swizzled_scale_shape

__all__ = ["check_inputs", "custom_kernel", "gemv", "gemv_reference", "swizzled_scale_shape"]

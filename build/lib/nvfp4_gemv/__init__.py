"""NVFP4 GEMV on Hopper and Blackwell: the GPU MODE ``nvfp4_gemv`` kernel as a library.

``custom_kernel`` takes the competition's 7-tuple (see ``nvfp4_gemv.kernel``); the repository's
``submission.py`` is the same module, generated for the leaderboard (tools/gen_submission.py).
"""

from .kernel import check_inputs, custom_kernel

__all__ = ["check_inputs", "custom_kernel"]

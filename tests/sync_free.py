"""``no_syncs()``: the GPU tests' check that a call never waits on the device."""

import contextlib

import torch


@contextlib.contextmanager
def no_syncs():
    """Inside, any host-device synchronization raises (``torch.cuda.set_sync_debug_mode("error")``); the work
    queued before is finished first, and the mode is reset on the way out whatever happens."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")

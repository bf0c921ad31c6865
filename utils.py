"""Helpers shared by the reference and the harness; the names are the competition's."""

import random
from typing import Tuple

import numpy as np
import torch


def set_seed(seed: int = 42):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def get_device(use_cuda: bool = True) -> torch.device:
    if use_cuda and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def _report(received, expected, mismatched, max_print):
    count = int(mismatched.count_nonzero().item())
    if count == 0:
        return None
    lines = [f"Number of mismatched elements: {count}"]
    for index in torch.nonzero(mismatched)[:max_print]:
        i = tuple(index.tolist())
        lines.append(f"ERROR at {i}: {received[i]} {expected[i]}")
    if count > max_print:
        lines.append(f"... and {count - max_print} more mismatched elements.")
    return lines


@torch.no_grad()
def verbose_allclose(received: torch.Tensor, expected: torch.Tensor, rtol=1e-05, atol=1e-08,
                     max_print=5) -> Tuple[bool, list]:
    """``|received - expected| <= atol + rtol * |expected|`` elementwise, NaN and +-Inf matched by
    position. Returns ``(ok, lines)``: the mismatch count and the first ``max_print`` indices with
    the received and expected values, or the maximum error."""
    if received.shape != expected.shape:
        return False, [f"SIZE MISMATCH: received {tuple(received.shape)}, expected {tuple(expected.shape)}"]
    r, e = received.to(torch.float32), expected.to(torch.float32)
    diff = torch.abs(r - e)
    mismatched = diff > atol + rtol * torch.abs(e)
    mismatched |= torch.isnan(r) ^ torch.isnan(e)
    mismatched |= torch.isposinf(r) ^ torch.isposinf(e)
    mismatched |= torch.isneginf(r) ^ torch.isneginf(e)
    lines = _report(received, expected, mismatched, max_print)
    if lines:
        return False, lines
    finite = diff[torch.isfinite(diff)]
    return True, [f"Maximum error: {finite.max().item() if finite.numel() else 0.0}"]


@torch.no_grad()
def verbose_allequal(received: torch.Tensor, expected: torch.Tensor, max_print: int = 5) -> Tuple[bool, list]:
    lines = _report(received, expected, torch.not_equal(received, expected), max_print)
    return (False, lines) if lines else (True, [])


def match_reference(data, output, reference: callable, rtol=1e-05, atol=1e-08):
    """The tasks' default ``check_implementation``: ``(ok, message)``."""
    expected = reference(data)
    good, reasons = verbose_allclose(output, expected, rtol=rtol, atol=atol)
    return good, "\\n".join(reasons)


def make_match_reference(reference: callable, **kwargs):
    def wrapped(data, output):
        return match_reference(data, output, reference=reference, **kwargs)

    return wrapped


def clear_l2_cache(device="cuda"):
    """Evicts the GPU's L2 by writing a buffer far larger than it (4 GiB, as the leaderboard does)."""
    dummy = torch.randn((1024, 1024, 1024), device=device, dtype=torch.float32)
    del dummy

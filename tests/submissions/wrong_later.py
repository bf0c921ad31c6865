"""Right for its first calls, then off by one: only a mode that checks every timed run catches it."""
import reference

calls = [0]


def custom_kernel(data):
    calls[0] += 1
    out = reference.portable_ref_kernel(data)
    if calls[0] > 4:
        out.add_(1.0)
    return out

"""A CPU-capable submission for the harness tests: the portable reference itself."""
import reference


def custom_kernel(data):
    return reference.portable_ref_kernel(data)

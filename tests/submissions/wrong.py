"""Writes zeros: must be reported as a failure."""


def custom_kernel(data):
    c = data[-1]
    c.zero_()
    return c

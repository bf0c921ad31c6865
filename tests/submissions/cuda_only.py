"""A submission that needs CUDA but does not import the CuTe DSL, so that eval.py finds out only by running
it (for the harness tests)."""


def custom_kernel(data):
    if not data[0].is_cuda:
        raise ValueError(f"a: expected a CUDA tensor, got one on {data[0].device}")
    raise AssertionError("only run without a GPU")

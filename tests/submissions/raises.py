def custom_kernel(data):
    raise RuntimeError("boom from the submission")

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def task_cases(section):
    import yaml

    with open(os.path.join(ROOT, "task.yml")) as f:
        return [(c["m"], c["k"], c["l"], c["seed"]) for c in yaml.safe_load(f)[section]]


def check_chosen_kernel(data, kernel_class):
    """The dispatcher's plan for ``data`` runs ``kernel_class`` and matches float64."""
    import inputs
    import submission

    plan = submission._CutePlan(data, *submission.check_inputs(data))
    assert type(plan.kernel.op) is kernel_class  # a subclass (the split kernel is an Nvfp4Gemv) is another kernel
    out = plan(inputs.poisoned(data))
    ok, msg = inputs.check_exact(data, out)
    assert ok, msg

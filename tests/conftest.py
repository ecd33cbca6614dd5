"""Test configuration.

Without a GPU, Triton kernels run under TRITON_INTERPRET=1 on the CPU; it must
be set before Triton is first imported, hence here and before torch. Tests
marked `gpu` need CUDA and are skipped only where no CUDA device exists.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)

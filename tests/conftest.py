"""Shared pytest setup.

* ``-m gpu`` tests need CUDA: without it they are skipped with a reason (the CPU CI lane), and the
  H200 lane runs them: ``source .device/on-device.sh && python3 -m pytest -m gpu``.
* Triton runs through its interpreter on machines without CUDA: ``TRITON_INTERPRET=1`` must be set
  before triton is first imported, so it is set here, before any test module imports a backend.
* The CuTe DSL compiles for Hopper on any machine once ``CUTE_DSL_ARCH=sm_90a`` is set before
  ``import cutlass``.
* ``word``: the CPU error word of the device-side data checks (``moe_spec.validate``), cleared
  before and after the test.
"""

import os

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run the GPU lane on the H200: python3 -m pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def word():
    """The CPU error word, cleared before and after."""
    from moe_spec.validate import error_word

    w = error_word("cpu")
    w.zero_()
    yield w
    w.zero_()

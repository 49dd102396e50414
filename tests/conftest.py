"""Shared pytest setup.

* ``-m gpu`` tests need CUDA: without it they are skipped with a reason (the CPU CI lane), and the
  H200 lane runs them: ``source .device/on-device.sh && python3 -m pytest -m gpu``.
* Triton runs through its interpreter on machines without CUDA: ``TRITON_INTERPRET=1`` must be set
  before triton is first imported, so it is set here, before any test module imports a backend.
* The CuTe DSL compiles for Hopper on any machine once ``CUTE_DSL_ARCH=sm_90a`` is set before
  ``import cutlass``.
* ``word``: the CPU error word of the device-side data checks (``moe_spec.validate``), cleared
  before and after the test.
* ``-n auto`` (pyproject's addopts, pytest-xdist): one worker per core on a CPU machine, and none
  where CUDA is present — the gpu tests share one device and several of them time it. The workers
  share the compile caches, which are safe for concurrent writers of the same kernel: Triton's
  (``TRITON_CACHE_DIR``, triton/runtime/cache.py) and the CuTe DSL's (``CUTE_DSL_CACHE_DIR``,
  cutlass/base_dsl/cache_helpers.py ``save_ir``) each write a file under a temporary name and
  ``os.replace`` it into place, and the DSL checks a CRC on load, recompiling on a mismatch; every
  other file a test writes is under its own ``tmp_path``.
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


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: serial with a GPU; otherwise xdist's own count (the cores, or PYTEST_XDIST_AUTO_NUM_WORKERS)."""
    return 0 if _HAS_CUDA else None


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

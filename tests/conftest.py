"""Shared pytest setup.

* ``-m gpu`` tests need CUDA: without it they are skipped with a reason (the CPU CI lane), and the
  H200 lane runs them: ``source .ci/on-device && python3 -m pytest -m gpu``.
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
* ``--gpu-part K/N``: only part K of N of the ``gpu`` tests, whole test files per part, the files dealt
  largest first to the part with the fewest tests so far (deterministic: every xdist worker and every
  machine deals the same parts). A device call runs at most 10 minutes and the whole lane takes longer,
  so the lane runs as N calls of one commit, e.g. ``python3 -m pytest -m gpu -n 4 --gpu-part 1/2`` and
  ``2/2``; the N parts together are the lane, each test in exactly one.
* ``gpu_exclusive``: a gpu test that needs most of the device's memory (a weight past 2³¹ elements): under
  xdist with CUDA its file holds the device alone (:mod:`gpu_lock`).
* ``--lane DIR``: the lane's record across calls (:mod:`lane_record`): every gpu test that passes is
  appended to ``DIR/<commit>.passed`` as it passes, and the gpu tests already there are deselected, so
  calls at one commit add up to the whole lane and a run stopped by its time limit loses nothing.
"""

import collections
import os

import gpu_lock
import lane_record
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


def pytest_addoption(parser):
    parser.addoption(
        "--gpu-part",
        default=None,
        metavar="K/N",
        help="run only part K (1..N) of N of the gpu tests: whole files per part, balanced by test count",
    )
    parser.addoption(
        "--lane",
        default=None,
        metavar="DIR",
        help="record each gpu test that passes in DIR/<commit>.passed and skip (deselect) those already there",
    )


def pytest_configure(config):
    lane_record.configure(config, config.getoption("--lane"))


def gpu_parts(counts: dict, n: int) -> list:
    """The files of ``counts`` (file -> its gpu tests) dealt into ``n`` parts: largest file first, each to
    the part with the fewest tests so far (the lower index on a tie). Returns ``n`` sets of files."""
    parts, loads = [set() for _ in range(n)], [0] * n
    for name, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        i = min(range(n), key=lambda j: (loads[j], j))
        parts[i].add(name)
        loads[i] += count
    return parts


def _parse_part(value: str) -> tuple:
    k, sep, n = value.partition("/")
    if not (sep and k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise pytest.UsageError(f"--gpu-part: expected K/N with 1 <= K <= N, e.g. 1/2; got {value!r}")
    return int(k), int(n)


def _file_of(item) -> str:
    return item.nodeid.split("::")[0]


def _keep_gpu_part(config, items) -> None:
    """Deselect the gpu tests outside ``--gpu-part``'s part; other tests are left as they are."""
    k, n = _parse_part(config.getoption("--gpu-part"))
    counts = collections.Counter(_file_of(item) for item in items if "gpu" in item.keywords)
    mine = gpu_parts(counts, n)[k - 1]
    kept, dropped = [], []
    for item in items:
        (dropped if "gpu" in item.keywords and _file_of(item) not in mine else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_collection_modifyitems(config, items):
    if config.getoption("--gpu-part"):
        _keep_gpu_part(config, items)
    lane_record.deselect_passed(config, items)
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run the GPU lane on the H200: python3 -m pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Around each gpu test under xdist with CUDA: the lane's device lock (:mod:`gpu_lock`)."""
    with gpu_lock.held(item, nextitem, _HAS_CUDA):
        yield


@pytest.fixture
def word():
    """The CPU error word, cleared before and after."""
    from moe_spec.validate import error_word

    w = error_word("cpu")
    w.zero_()
    yield w
    w.zero_()

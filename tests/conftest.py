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
* ``gpu_exclusive``: a gpu test that needs most of the device's memory (a weight past 2³¹ elements). Under
  xdist with CUDA, every gpu test holds a shared lock on one file of the run and returns its cached
  blocks (``torch.cuda.empty_cache``) before letting go; an exclusive test's file holds the lock alone,
  from its first test until its last (``--dist loadfile`` keeps the file on one worker), so the other
  workers wait instead of filling the memory it needs. Serial runs take no lock.
* ``--lane DIR``: the lane's record across calls (:mod:`lane_record`): every gpu test that passes is
  appended to ``DIR/<commit>.passed`` as it passes, and the gpu tests already there are deselected, so
  calls at one commit add up to the whole lane and a run stopped by its time limit loses nothing.
"""

import collections
import fcntl
import os
import tempfile

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


def _gpu_lock_path(config):
    """The lock file shared by this run's xdist workers, or None (serial, or no CUDA)."""
    workerinput = getattr(config, "workerinput", None)
    if not _HAS_CUDA or workerinput is None:
        return None
    return os.path.join(tempfile.gettempdir(), f"moe-gpu-lane-{workerinput['testrunuid']}.lock")


def _exclusive(item) -> bool:
    return item is not None and item.get_closest_marker("gpu_exclusive") is not None


_held = []  # the lock file this worker holds (at most one)


def _acquire(path: str, mode: int) -> None:
    # a turnstile: a worker waiting for the exclusive lock holds the gate, so shared requests queue
    # behind it instead of keeping the lock shared for ever (flock does not queue them itself)
    with open(path + ".gate", "a+") as gate:
        fcntl.flock(gate, fcntl.LOCK_EX)
        handle = open(path, "a+")  # noqa: SIM115 - held across tests, closed by _release
        fcntl.flock(handle, mode)
    _held.append(handle)


def _release() -> None:
    torch.cuda.empty_cache()  # this worker's cached blocks go back before another may take the memory
    handle = _held.pop()
    fcntl.flock(handle, fcntl.LOCK_UN)
    handle.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Around each gpu test under xdist: the shared lock; a ``gpu_exclusive`` file holds it alone, from its
    first test to its last (its module fixtures are torn down inside the last one)."""
    path = _gpu_lock_path(item.config)
    if path is None or "gpu" not in item.keywords:
        yield
        return
    exclusive = _exclusive(item)
    if not _held:
        _acquire(path, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    try:
        yield
    finally:
        more_of_this_file = exclusive and _exclusive(nextitem) and nextitem.fspath == item.fspath
        if not more_of_this_file:
            _release()


@pytest.fixture
def word():
    """The CPU error word, cleared before and after."""
    from moe_spec.validate import error_word

    w = error_word("cpu")
    w.zero_()
    yield w
    w.zero_()

"""The GPU lane's device lock under xdist (tests/conftest.py): ``gpu_exclusive`` files hold the device alone.

Every gpu test of an xdist run with CUDA holds a shared lock on one file of the run and returns its cached
blocks (``torch.cuda.empty_cache``) before letting go; a ``gpu_exclusive`` test's file (a weight past 2³¹
elements) holds the lock alone, from its first test until its last (``--dist loadfile`` keeps the file on
one worker; its module fixtures are torn down inside its last test), so the other workers wait instead of
filling the memory it needs. A turnstile keeps the shared requests from starving an exclusive one. Serial
runs and CPU runs take no lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile

_held = []  # the lock file this worker holds (at most one)


def lock_path(config, has_cuda: bool) -> str | None:
    """The lock file shared by this run's xdist workers, or None (serial, or no CUDA)."""
    workerinput = getattr(config, "workerinput", None)
    if not has_cuda or workerinput is None:
        return None
    return os.path.join(tempfile.gettempdir(), f"moe-gpu-lane-{workerinput['testrunuid']}.lock")


def exclusive(item) -> bool:
    return item is not None and item.get_closest_marker("gpu_exclusive") is not None


def acquire(path: str, mode: int) -> None:
    # a turnstile: a worker waiting for the exclusive lock holds the gate, so shared requests queue
    # behind it instead of keeping the lock shared for ever (flock does not queue them itself)
    with open(path + ".gate", "a+") as gate:
        fcntl.flock(gate, fcntl.LOCK_EX)
        handle = open(path, "a+")  # noqa: SIM115 - held across tests, closed by release
        fcntl.flock(handle, mode)
    _held.append(handle)


def release() -> None:
    import torch

    torch.cuda.empty_cache()  # this worker's cached blocks go back before another may take the memory
    handle = _held.pop()
    fcntl.flock(handle, fcntl.LOCK_UN)
    handle.close()


@contextlib.contextmanager
def held(item, nextitem, has_cuda: bool):
    """Around one test: the shared lock, or for a ``gpu_exclusive`` file the exclusive one, kept until the
    file's last test; nothing for a non-gpu test or where :func:`lock_path` is None."""
    path = lock_path(item.config, has_cuda)
    if path is None or "gpu" not in item.keywords:
        yield
        return
    mine = exclusive(item)
    if not _held:
        acquire(path, fcntl.LOCK_EX if mine else fcntl.LOCK_SH)
    try:
        yield
    finally:
        if not (mine and exclusive(nextitem) and nextitem.fspath == item.fspath):
            release()

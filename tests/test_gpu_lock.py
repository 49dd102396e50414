"""The GPU lane's lock under xdist (tests/gpu_lock.py): shared for gpu tests, exclusive for a
``gpu_exclusive`` file, with a turnstile so an exclusive request is not starved by shared ones."""

import select
import subprocess
import sys
import textwrap
import time

import pytest

fcntl = pytest.importorskip("fcntl")

_HOLD = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    import gpu_lock
    gpu_lock.acquire({path!r}, {mode})
    print("held", flush=True)
    sys.stdin.readline()
    """
)


def _holder(tests, path, mode):
    """A process that takes the lock with gpu_lock.acquire, says "held", and keeps it until its stdin ends."""
    code = _HOLD.format(tests=tests, path=path, mode=mode)
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _said(proc, seconds=20.0) -> str:
    """The holder's next line, or "" when it says nothing within ``seconds``."""
    ready, _, _ = select.select([proc.stdout], [], [], seconds)
    return proc.stdout.readline().strip() if ready else ""


def _wait_until(predicate, seconds=20.0):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _locked(path, mode=fcntl.LOCK_EX) -> bool:
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def test_an_exclusive_request_waits_for_the_shared_holder_and_shared_requests_queue_behind_it(tmp_path):
    tests = str(__import__("pathlib").Path(__file__).parent)
    path = str(tmp_path / "lane.lock")
    reader = _holder(tests, path, fcntl.LOCK_SH)
    assert _said(reader) == "held"
    writer = _holder(tests, path, fcntl.LOCK_EX)
    # the writer holds the gate while it waits for the shared holder to let go
    assert _wait_until(lambda: _locked(path + ".gate"))
    late_reader = _holder(tests, path, fcntl.LOCK_SH)
    assert _said(late_reader, 1.0) == ""  # queued at the gate behind the writer
    assert not _locked(path, fcntl.LOCK_SH)  # the lock itself is still only shared
    reader.stdin.close()  # the first reader lets go: the writer, not the late reader, gets the lock
    assert _said(writer) == "held"
    assert _locked(path, fcntl.LOCK_SH)  # exclusive now
    writer.stdin.close()
    assert _said(late_reader) == "held"
    late_reader.stdin.close()
    for p in (reader, writer, late_reader):
        assert p.wait(timeout=20) == 0

"""The GPU lane's record across calls: ``--lane DIR`` (tests/conftest.py).

A lent GPU runs a command for at most ten minutes and the lane takes longer, and a run stopped by its
time limit writes no junit report. So a run with ``--lane DIR`` appends the node id of every gpu test
that passes to ``DIR/<commit>.passed`` as it passes (one line, flushed), and deselects the gpu tests
that file already holds: the next call at the same commit runs only what is left, and a run that is
killed keeps what it had passed. The file is per commit, so a record never vouches for other code.

The commit is ``MOE_COMMIT`` (set it where the checkout has no ``.git``, as on the device) or
``git rev-parse --short HEAD``; with neither, ``--lane`` is refused by name. Only the process that
reports results writes (the xdist controller, or the one process of a serial run); workers only read.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from moe_spec.runinfo import git_commit

_COMMIT = re.compile(r"[0-9a-f]{7,40}")


def commit_of(root: Path) -> str:
    """The commit the run tests: ``MOE_COMMIT``, else git's short HEAD of ``root``. Raises ValueError
    (naming ``--lane``) when there is neither or it is not a hex commit id."""
    commit = os.environ.get("MOE_COMMIT", "").strip() or git_commit(root).removesuffix("+dirty")
    if not _COMMIT.fullmatch(commit):
        raise ValueError(
            f"--lane: the record is per commit, and this run's commit is unknown ({commit!r}): "
            "set MOE_COMMIT to the checkout's commit (the device's copy has no .git)"
        )
    return commit


def record_path(directory: str, commit: str) -> Path:
    return Path(directory) / f"{commit}.passed"


def passed(path: Path) -> set[str]:
    """The node ids recorded in ``path`` (none when it does not exist yet)."""
    if not path.exists():
        return set()
    return {line.strip() for line in path.read_text().splitlines() if line.strip()}


def append(path: Path, nodeid: str) -> None:
    """Add ``nodeid`` to the record, flushed at once (a killed run keeps every line written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(nodeid + "\n")
        f.flush()
        os.fsync(f.fileno())


def configure(config, directory: str | None) -> None:
    """``config.lane_record``: the record file of this run's commit under ``directory`` (None: no record);
    the reporting process registers the :class:`Recorder`.  An unknown commit is a usage error."""
    config.lane_record = None
    if not directory:
        return
    try:
        commit = commit_of(config.rootpath)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.lane_record = record_path(directory, commit)
    if not hasattr(config, "workerinput"):  # the xdist controller or a serial run
        config.pluginmanager.register(Recorder(config.lane_record), "lane-record")


def deselect_passed(config, items: list) -> None:
    """Deselect the gpu items the record holds (every other item is kept)."""
    if config.lane_record is None:
        return
    done = passed(config.lane_record)
    kept, dropped = [], []
    for item in items:
        (dropped if "gpu" in item.keywords and item.nodeid in done else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


class Recorder:
    """The pytest plugin of the reporting process: each gpu test's passing call goes into the record, and
    the terminal summary says how many the record holds."""

    def __init__(self, path: Path):
        self.path = path

    def pytest_runtest_logreport(self, report):
        if report.when == "call" and report.passed and "gpu" in report.keywords:
            append(self.path, report.nodeid)

    def pytest_terminal_summary(self, terminalreporter):
        n = len(passed(self.path))
        terminalreporter.write_line(f"lane record {self.path}: {n} gpu tests passed at this commit")

"""``--gpu-part K/N`` (tests/conftest.py): the GPU lane dealt into parts that together are the whole lane.

The parts are checked on the real collection: ``pytest -m gpu --collect-only`` with and without the option,
in subprocesses, on the CPU (collection does not need a GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import gpu_parts

ROOT = Path(__file__).resolve().parents[1]


def _pytest(*args: str) -> subprocess.CompletedProcess:
    """``pytest --collect-only`` in a subprocess, serial, at the repository root."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-n", "0", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def _collect(*extra: str) -> list[str]:
    done = _pytest("-m", "gpu", *extra)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_parts_deal_whole_files_largest_first_to_the_lightest_part():
    counts = {"a.py": 5, "b.py": 4, "c.py": 3, "d.py": 3, "e.py": 1}
    assert gpu_parts(counts, 2) == [{"a.py", "d.py"}, {"b.py", "c.py", "e.py"}]  # loads 8 and 8
    assert gpu_parts(counts, 1) == [set(counts)]
    assert gpu_parts({"a.py": 1}, 3) == [{"a.py"}, set(), set()]


@pytest.mark.slow
def test_the_parts_of_the_lane_are_the_whole_lane_each_test_once():
    whole = _collect()
    assert len(whole) > 100  # the GPU lane, not an empty collection
    parts = [_collect("--gpu-part", f"{k}/2") for k in (1, 2)]
    assert sorted(parts[0] + parts[1]) == sorted(whole)
    assert not set(parts[0]) & set(parts[1])
    files = [{t.split("::")[0] for t in p} for p in parts]
    assert not files[0] & files[1]  # whole files per part
    assert abs(len(parts[0]) - len(parts[1])) <= max(len(parts[0]), len(parts[1])) // 2


def test_a_bad_part_is_refused_naming_the_option():
    done = _pytest("--gpu-part", "3/2", "tests/test_gpu_parts.py")
    assert done.returncode != 0
    assert "--gpu-part" in done.stdout + done.stderr and "3/2" in done.stdout + done.stderr

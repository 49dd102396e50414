"""One run-metadata helper for the suite and both benchmarks; the benchmarks refuse a machine without a GPU."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moe_spec import runinfo

ROOT = Path(__file__).resolve().parents[1]


def test_run_info_names_date_device_commit_command():
    info = runinfo.run_info("python -m compare --tokens 8", cuda=False, commit="abc1234")
    assert list(info)[:4] == ["date", "device", "commit", "command"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", info["date"])
    assert info["device"].startswith("CPU (") and info["commit"] == "abc1234"
    assert info["command"] == "python -m compare --tokens 8" and info["torch"] != "not installed"
    assert runinfo.run_info("x", cuda=False, device="fake GPU")["device"] == "fake GPU"


def test_commit_is_the_checkout_and_says_dirty():
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        assert runinfo.git_commit() == "unknown"
        return
    assert re.fullmatch(re.escape(head.stdout.strip()) + r"(\+dirty)?", runinfo.git_commit())
    assert runinfo.git_commit("/") == "unknown"  # not a checkout


def test_command_line_can_be_pasted_back():
    assert (
        runinfo.command_line("python -m compare", ["--out", "my dir", "--tokens", "1,8"])
        == "python -m compare --out 'my dir' --tokens 1,8"
    )


def test_suite_and_benches_take_their_metadata_from_runinfo():
    from compare.cases import SuiteSpec
    from compare.suite import _meta

    meta = _meta(SuiteSpec(device="cpu", command="c", commit="abc"), None)
    assert {k: meta[k] for k in ("commit", "command")} == {"commit": "abc", "command": "c"}
    assert set(runinfo.run_info("c", cuda=False)) <= set(meta)
    for bench in ("cute_moe/lab/bench.py", "triton_moe/lab/bench.py"):
        source = (ROOT / bench).read_text()
        assert "run_info(command_line(" in source and "rev-parse" not in source, bench


@pytest.mark.parametrize("module", ["triton_moe.lab.bench", "cute_moe.lab.bench"])
def test_benches_without_a_gpu_say_so_in_one_line(module):
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"python -m {module}: error: needs a CUDA GPU (none is visible here); the CPU report is `python -m compare`"
    ]

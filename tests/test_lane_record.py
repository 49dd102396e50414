"""The lane's record across calls (``--lane DIR``, tests/lane_record.py): what passes is kept per commit
as it passes, the next run at that commit leaves it out, and a run whose commit is unknown is refused."""

import textwrap
from pathlib import Path

import lane_record
import pytest

pytest_plugins = ["pytester"]

# A project wired to the record as tests/conftest.py is (its option, configure, the deselection at collection).
CONFTEST = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import lane_record

    def pytest_addoption(parser):
        parser.addoption("--lane", default=None)

    def pytest_configure(config):
        config.addinivalue_line("markers", "gpu: a gpu test")
        lane_record.configure(config, config.getoption("--lane"))

    def pytest_collection_modifyitems(config, items):
        lane_record.deselect_passed(config, items)
    """
)

TESTS = textwrap.dedent(
    """
    import os
    import pytest

    @pytest.mark.gpu
    @pytest.mark.parametrize("i", range(4))
    def test_passes(i):
        pass

    @pytest.mark.gpu
    def test_fails_until_fixed():
        assert os.environ.get("FIXED") == "1"

    def test_not_gpu():
        pass
    """
)


@pytest.fixture
def project(pytester, monkeypatch):
    tests = str(Path(__file__).parent)
    pytester.makeconftest(CONFTEST.format(tests=tests))
    pytester.makepyfile(test_lane=TESTS)
    monkeypatch.setenv("MOE_COMMIT", "abc1234")
    monkeypatch.delenv("FIXED", raising=False)
    return pytester


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_the_record_keeps_what_passed_and_the_next_run_runs_the_rest(project, monkeypatch, workers):
    lane = project.path / "lane"
    first = project.runpytest_subprocess("-p", "no:cacheprovider", f"--lane={lane}", *workers)
    first.assert_outcomes(passed=5, failed=1)
    record = lane / "abc1234.passed"
    assert sorted(record.read_text().split()) == [f"test_lane.py::test_passes[{i}]" for i in range(4)]
    monkeypatch.setenv("FIXED", "1")
    second = project.runpytest_subprocess("-p", "no:cacheprovider", f"--lane={lane}", *workers)
    # the fixed gpu test and the non-gpu one (xdist's workers deselect: its controller counts none)
    second.assert_outcomes(passed=2, deselected=0 if workers else 4)
    assert len(record.read_text().split()) == 5  # each gpu test once
    monkeypatch.setenv("MOE_COMMIT", "def5678")  # another commit: its own record, every test runs
    project.runpytest_subprocess("-p", "no:cacheprovider", f"--lane={lane}", *workers).assert_outcomes(passed=6)


def test_a_run_whose_commit_is_unknown_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.delenv("MOE_COMMIT", raising=False)
    with pytest.raises(ValueError, match="--lane: .*MOE_COMMIT"):
        lane_record.commit_of(tmp_path)  # no .git there
    monkeypatch.setenv("MOE_COMMIT", "not a commit")
    with pytest.raises(ValueError, match="--lane"):
        lane_record.commit_of(tmp_path)


def test_the_commit_is_gits_head_where_there_is_one(monkeypatch):
    monkeypatch.delenv("MOE_COMMIT", raising=False)
    root = Path(__file__).parent.parent
    if not (root / ".git").exists():
        pytest.skip("this checkout has no .git")
    assert lane_record._COMMIT.fullmatch(lane_record.commit_of(root))

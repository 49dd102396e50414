"""The README's test command as a newcomer meets it: both cores used, no warning flood, and the versions the
README names are the ones setup installs and the published results used."""

import json
import re
import warnings
from pathlib import Path

import conftest
import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
INTERPRETER = "triton.runtime.interpreter"


def _pytest_options() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]


def _interpreted_call() -> None:
    """One triton_moe call on a tiny problem, through the Triton interpreter (the tests set TRITON_INTERPRET)."""
    import triton_moe
    from compare.cases import reduce_shape
    from moe_spec.problem import get_shape, make_inputs

    triton_moe.fused_moe(**make_inputs(reduce_shape(get_shape("mixtral-8x7b")), 1, None, seed=0).kwargs())


def _from_interpreter(caught) -> list:
    return [
        w
        for w in caught
        if issubclass(w.category, DeprecationWarning)
        and Path(w.filename).as_posix().endswith("triton/runtime/interpreter.py")
    ]


def test_the_interpreters_numpy_deprecation_is_filtered_by_pyproject():
    """The interpreter's NumPy DeprecationWarning (thousands per run) is filtered by pyproject's
    filterwarnings, which names its module; no test module needs its own mark for it."""
    with warnings.catch_warnings(record=True) as under_pytest:  # the filters pytest applies to this test
        _interpreted_call()
    assert not _from_interpreter(under_pytest)
    with warnings.catch_warnings(record=True) as unfiltered:
        warnings.simplefilter("always")
        _interpreted_call()
    assert _from_interpreter(unfiltered), "the interpreter no longer warns: drop the filter"
    assert any(INTERPRETER in f and f.startswith("ignore:") for f in _pytest_options()["filterwarnings"])


def test_the_test_command_uses_every_core():
    """pytest-xdist, pinned in the test extra; -n auto in addopts (the README's command stays as it is), serial
    where a GPU is (conftest), and each module's tests on one worker (its module-scoped fixtures run once)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(re.fullmatch(r"pytest-xdist==[\d.]+", dep) for dep in project["optional-dependencies"]["test"])
    opts = _pytest_options()["addopts"].split()
    assert opts[opts.index("-n") + 1] == "auto" and opts[opts.index("--dist") + 1] == "loadfile"
    assert re.search(r"^import .*\bxdist\b", (ROOT / ".ci" / "setup").read_text(), re.M)  # setup checks it is there
    saved = conftest._HAS_CUDA
    try:
        conftest._HAS_CUDA = True
        assert conftest.pytest_xdist_auto_num_workers(None) == 0
        conftest._HAS_CUDA = False
        assert conftest.pytest_xdist_auto_num_workers(None) is None  # xdist's count: the cores
    finally:
        conftest._HAS_CUDA = saved


def test_readme_names_the_torch_of_setup_and_of_the_published_results():
    """setup installs one torch everywhere; the H200 results the README shows were measured with another: the
    README says both, with the numbers of .ci/setup and of the report its results table is generated from."""
    readme = (ROOT / "README.md").read_text()
    installed = re.search(r'"torch==([\d.]+)"', (ROOT / ".ci" / "setup").read_text()).group(1)
    block = readme[readme.index("<!-- status:glance:begin -->") : readme.index("<!-- status:glance:end -->")]
    report = re.search(r"\]\((notes/results/[^)]+)\.md\)", block).group(1)
    published = json.loads((ROOT / f"{report}.json").read_text())["meta"]["torch"].split("+")[0]
    prose = readme.replace(block, "")
    assert f"torch {installed}" in prose and f"torch {published}" in prose
    if installed != published:  # then the README says the published numbers used another torch
        sentence = next(s for s in re.split(r"(?<=\.)\s", " ".join(prose.split())) if f"torch {published}" in s)
        assert "H200" in sentence or "published" in sentence, sentence

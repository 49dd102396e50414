"""ruff (configured in pyproject.toml, pinned in the ``test`` extra) passes on the whole tree: the
lint rules (``ruff check``) and the formatter (``ruff format --check``)."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "command", [["check", "--no-cache", "."], ["format", "--check", "--no-cache", "."]], ids=["check", "format"]
)
def test_ruff_passes(command):
    run = subprocess.run([sys.executable, "-m", "ruff", *command], cwd=ROOT, capture_output=True, text=True)
    assert "No module named ruff" not in run.stderr, "ruff is a test dependency: pip install -e '.[test]'"
    assert run.returncode == 0, f"ruff {' '.join(command)}:\n{run.stdout[-6000:]}{run.stderr[-2000:]}"

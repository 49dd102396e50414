"""What every result file names about the run that produced it: date, device, commit, command.

A number without its date, device, commit and command cannot be checked or reproduced, so the
compare suite (``python -m compare``) and both benchmarks (``python -m cute_moe.lab.bench``,
``python -m triton_moe.lab.bench``) take these fields from :func:`run_info`, spelled the same way:

=========  ==================================================================================
date       UTC, ``YYYY-MM-DD HH:MM UTC``
device     ``torch.cuda.get_device_name()`` (e.g. ``NVIDIA H200``), or ``CPU (<machine>)``
commit     the short hash of the checkout, ``+dirty`` when tracked files are modified; the
           caller's ``commit`` where given (a copy of the tree without ``.git``), else
           ``unknown``
command    the command line as a user would type it again (:func:`command_line`)
python, torch, triton   the versions that ran it
=========  ==================================================================================

:func:`require_cuda` is the one-line refusal of a GPU-only command on a machine without one.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def git_commit(cwd=REPO_ROOT) -> str:
    """Short hash of the checkout at ``cwd`` (``+dirty`` with modified tracked files), or "unknown"."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0 or not head.stdout.strip():
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(cuda: bool) -> str:
    """The GPU's name when ``cuda``, else ``CPU (<processor or machine>)``."""
    if cuda:
        import torch

        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()})"


def command_line(prog: str, argv: Sequence[str]) -> str:
    """``prog`` and its arguments, quoted so that the line can be pasted into a shell."""
    return " ".join([prog, *map(shlex.quote, argv)])


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def run_info(command: str, *, cuda: bool, commit: str | None = None, device: str | None = None) -> dict:
    """The fields above, in this order. ``device`` overrides the detected name (e.g. a stand-in clock)."""
    return {
        "date": utc_now(),
        "device": device or device_name(cuda),
        "commit": commit or git_commit(),
        "command": command,
        "python": platform.python_version(),
        "torch": _version("torch"),
        "triton": _version("triton"),
    }


def require_cuda(prog: str) -> None:
    """Exit with status 2 and one line on stderr when no CUDA GPU is visible (GPU-only commands)."""
    import torch

    if not torch.cuda.is_available():
        print(
            f"{prog}: error: needs a CUDA GPU (none is visible here); the CPU report is `python -m compare`",
            file=sys.stderr,
        )
        raise SystemExit(2)

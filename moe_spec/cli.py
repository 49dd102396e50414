"""The command lines of the project's tools (``python -m …``): errors in one line, exit status 2.

argparse answers a bad option with its whole usage block (3–12 lines) and names the program after
its file (``autotune.py``). Every tool of the four packages builds its parser from
:class:`ArgumentParser` instead: a usage error is the one line ``python -m <module>: error: <what>``
on stderr and exit status 2, and the program is called as it is run. :func:`needs_cuda` is the
refusal of a GPU-only tool on a machine without one — the same one line and status, before any
work (``tests/test_entry_points.py`` runs every entry point with no argument, ``--help`` and a bad
option and holds them to this).
"""

from __future__ import annotations

import argparse
import sys


def module_prog(default: str = "") -> str:
    """``python -m <module>`` for the module Python runs as ``__main__`` (``default`` when it runs
    otherwise, e.g. under a test calling ``main``)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None)
    if name:
        return f"python -m {name.removesuffix('.__main__')}"
    return default or "python"


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, ``<prog>: error: <message>``, and exit status 2;
    ``prog`` defaults to ``python -m <module>`` (:func:`module_prog`)."""

    def __init__(self, *args, prog: str | None = None, **kwargs):
        super().__init__(*args, prog=prog or module_prog(), **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def usage_error(prog: str, message: str) -> None:
    """Exit with status 2 after the one line ``<prog>: error: <message>`` on stderr."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def needs_cuda(prog: str, instead: str = "") -> None:
    """A GPU-only tool's refusal on a machine without a CUDA device: one line (with ``instead``, what
    runs on a CPU), exit status 2, before any work."""
    import torch

    if not torch.cuda.is_available():
        usage_error(prog, "needs a CUDA GPU (none is visible here)" + (f"; {instead}" if instead else ""))

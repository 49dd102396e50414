"""Where a run writes, checked before any work, and written so that runs never mix.

Both targets — the report directory (``--out``) and the routing table (``--write-router``) — are
checked when the command starts (:meth:`Outputs.check`): a path that is a file where a directory is
wanted (or the reverse), or that cannot be created, is refused in one line before a kernel runs.

The report is rendered into a staging directory beside the target (``.<name>.partial-*``, created
by :meth:`Outputs.stage`, which doubles as a real test that the parent is writable), then moved into
place by :meth:`Outputs.commit`:

* a target that does not exist yet is the staging directory renamed (one atomic step);
* into an existing directory, every file a report may contain (``owned``: the report's
  :data:`compare.report.OUTPUT_FILES`) that this run did not write is removed — so a CPU run never
  leaves an earlier GPU run's plots beside its report — and the new files are renamed in. Other
  files in the directory are left alone.

SIGINT is held back during the commit, so Ctrl-C leaves either the old report or the new one, never
a mix; a run stopped before the commit removes its staging directory (:meth:`Outputs.discard`) and
leaves the target as it was. The routing table is written the same way: a temporary file beside it,
renamed over it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from pathlib import Path


class OutputError(ValueError):
    """A target that cannot be written: reported as one line, exit status 2."""


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_creatable(option: str, path: Path) -> None:
    """The first existing ancestor of ``path`` must be a writable directory."""
    base = _nearest_existing(path.parent)
    if not base.is_dir():
        raise OutputError(f"{option}: cannot create {str(path)!r}: {str(base)!r} is not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise OutputError(f"{option}: cannot create {str(path)!r}: {str(base)!r} is not writable")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def _sigint_held():
    """Hold SIGINT back for the duration (delivered, as KeyboardInterrupt, right after)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class Outputs:
    """The report directory and the optional routing-table file of one command."""

    def __init__(self, out_dir, owned: tuple, router: str | None = None):
        self.out = Path(out_dir)
        self.owned = owned
        self.router = Path(router) if router else None
        self.staging: Path | None = None
        self.committed = False

    def check(self) -> Outputs:
        """Refuse targets that cannot be written (:class:`OutputError`, message naming the option)."""
        if self.out.exists() and not self.out.is_dir():
            raise OutputError(f"--out: {str(self.out)!r} exists and is not a directory")
        if self.out.is_dir() and not os.access(self.out, os.W_OK | os.X_OK):
            raise OutputError(f"--out: {str(self.out)!r} is not writable")
        if not self.out.exists():
            _check_creatable("--out", self.out)
        if self.router is not None:
            if self.router.is_dir():
                raise OutputError(f"--write-router: {str(self.router)!r} is a directory; expected a file path")
            if self.router.resolve().parent == self.out.resolve() and self.router.name in self.owned:
                raise OutputError(f"--write-router: {str(self.router)!r} is one of the report's own files")
            if self.router.exists() and not os.access(self.router, os.W_OK):
                raise OutputError(f"--write-router: {str(self.router)!r} is not writable")
            _check_creatable("--write-router", self.router)
        return self

    def stage(self) -> Path:
        """Create the staging directory beside the target (and the target's missing parents)."""
        target = self.out.absolute()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            self.staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
            self.staging.chmod(0o777 & ~_umask())  # the mode a plain mkdir gives, not mkdtemp's private 0700
        except OSError as exc:
            raise OutputError(f"--out: cannot create {str(self.out)!r}: {exc.strerror or exc}") from None
        return self.staging

    def discard(self) -> None:
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None

    def commit(self, router_table: str | None = None) -> None:
        """Move the staged report into place (and write the routing table): see the module docstring."""
        with _sigint_held():
            if not self.out.exists():
                os.rename(self.staging, self.out)
            else:
                new = {p.name for p in self.staging.iterdir()}
                for name in self.owned:
                    if name not in new and (self.out / name).is_file():
                        (self.out / name).unlink()
                for name in sorted(new):
                    os.replace(self.staging / name, self.out / name)
                self.staging.rmdir()
            self.staging = None
            if router_table is not None and self.router is not None:
                self.router.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=f".{self.router.name}.partial-", dir=self.router.parent)
                with os.fdopen(fd, "w") as f:
                    f.write(router_table)
                os.chmod(tmp, 0o666 & ~_umask())
                os.replace(tmp, self.router)
            self.committed = True

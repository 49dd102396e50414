"""Where a study command puts its results: ``--out``, a new or empty directory, files written whole.

The commands that measure on a GPU and leave a report (``python -m cute_moe.lab.crossover``,
``cute_moe.lab.bench_align``, ``triton_moe.lab.promotion``, ``triton_moe.lab.bench_align``,
``triton_moe.lab.bench_tma``) share three rules, kept here:

:func:`check_out`
    ``--out`` must be a new directory or an empty one, so that no directory mixes two runs. It
    is checked before any GPU work and nothing is created; a path that exists and is not a
    directory, a directory with anything in it, and a path whose nearest existing parent is not
    a writable directory are refused with :class:`OutError`, one line that names ``--out`` and
    says why. Each command turns it into its own usage error.
:func:`write_files`
    Each file is written as ``.<name>.partial`` beside it, then renamed over it
    (``os.replace``): a run cut off mid-write leaves the previous version whole, and a command
    that rewrites its report after every part never leaves half a file.
:func:`header_lines`
    The markdown lines that name the run — date, device, commit, command and, where the dict has
    them, the versions — from :func:`moe_spec.runinfo.run_info`'s fields.
:func:`run_cells`
    A timed study's loop: cells in order until the deadline, each row (or its error) written at
    once, the cells not run named in the report.

The command line itself, shared by those studies, ``python -m compare`` and
``python -m compare.studies.profile``: a bad option is a :class:`UsageError`, one line naming it
(:class:`Parser`, argparse's own errors included; :func:`split_list`, :func:`positive_ints`,
:func:`number`, :func:`shape_labels` for the values), and :func:`run_command` is the ``main``
around the work: a usage error is one line and exit status 2, Ctrl-C one line saying what was
written and 130, a closed stdout (``| head``) a quiet 1.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from moe_spec.cli import ArgumentParser


class UsageError(ValueError):
    """A bad option: one line naming it; the command exits with status 2 (:func:`run_command`)."""


class OutError(UsageError):
    """``--out`` refused: one line naming it and saying why."""


def _names(files: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    *rest, last = files
    return f"{', '.join(rest)} and {last}" if rest else last


def check_out(text: str | None, files: Sequence[str] = ()) -> Path:
    """``text`` as a Path when it names a new or empty directory (created by :func:`write_files`);
    :class:`OutError` otherwise. ``files`` names what the command writes there (for the message)."""
    if not text:
        raise OutError("--out: required: a new or empty directory" + (f" for {_names(files)}" if files else ""))
    out = Path(text)
    if out.exists() and not out.is_dir():
        raise OutError(f"--out: {text!r} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        raise OutError(f"--out: {text!r} is not empty; give a new or empty directory (no directory mixes two runs)")
    base = next(p for p in [out.absolute(), *out.absolute().parents] if p.exists())
    if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):
        raise OutError(f"--out: cannot create {text!r}: {str(base)!r} is not a writable directory")
    return out


def out_or_exit(prog: str, text: str | None, files: Sequence[str] = ()) -> Path:
    """:func:`check_out`, or one line ``<prog>: error: --out: …`` on stderr and exit status 2."""
    try:
        return check_out(text, files)
    except OutError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def write_files(out: Path, texts: Mapping[str, str]) -> None:
    """Write ``texts`` (file name -> text) into ``out`` (created with its parents), each file whole."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        partial = out / f".{name}.partial"
        partial.write_text(text)
        os.replace(partial, out / name)


def header_lines(info: Mapping) -> list[str]:
    """``- date: …``, ``- device: …``, ``- commit: `…```, ``- command: `…``` and, when ``info`` has
    python, torch and triton, ``- versions: python …, torch …, triton …``."""
    lines = [
        f"- date: {info['date']}",
        f"- device: {info['device']}",
        f"- commit: `{info['commit']}`",
        f"- command: `{info['command']}`",
    ]
    versions = [f"{k} {info[k]}" for k in ("python", "torch", "triton") if k in info]
    return lines + ([f"- versions: {', '.join(versions)}"] if versions else [])


def gpu_study_parser(
    prog: str,
    doc: str,
    files: Sequence[str],
    deadline_s: float,
    deadline_help: str = "no cell starts after this many seconds",
):
    """The options every timed GPU study shares: ``--out`` (a new or empty directory for ``files``),
    ``--deadline-s`` and ``--commit``; a study adds its own before :func:`start_gpu_study`."""
    p = ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    p.add_argument("--out", required=True, help=f"a new or empty directory for {_names(files)}")
    p.add_argument("--deadline-s", type=float, default=deadline_s, help=deadline_help)
    p.add_argument("--commit", default=None, help="git commit to record (when the checkout has no .git)")
    return p


def start_gpu_study(prog: str, parser, argv: Sequence[str], files: Sequence[str]):
    """Parse ``argv``; refuse a used ``--out``, a non-positive ``--deadline-s`` or a machine without
    CUDA, each in one line before any work; return (options, out directory, the run's record:
    date, device, commit, command — :func:`moe_spec.runinfo.run_info`)."""
    a = parser.parse_args(argv)
    out = out_or_exit(prog, a.out, files)
    if a.deadline_s <= 0:
        print(f"{prog}: error: --deadline-s: must be positive, got {a.deadline_s}", file=sys.stderr)
        raise SystemExit(2)
    from moe_spec.runinfo import command_line, require_cuda, run_info

    require_cuda(prog)
    return a, out, run_info(command_line(prog, argv), cuda=True, commit=a.commit)


def cell_label(cell: Mapping) -> str:
    """A cell's words in a report's "Not run" line: its values in order, T last as ``T=<n>``."""
    words = [str(v) for k, v in cell.items() if k != "T"]
    return " ".join(words + ([f"T={cell['T']}"] if "T" in cell else []))


def run_cells(
    results: dict,
    cells: Sequence[Mapping],
    measure: Callable[[Mapping], Mapping],
    write: Callable[[dict], None],
    *,
    deadline_s: float,
    cell_s: float,
    skip: Callable[[Mapping], bool] | None = None,
    after: Callable[[int], None] | None = None,
    shown: Callable[[dict], Mapping] | None = None,
) -> float:
    """A timed study's loop: each cell (a dict of its row's keys: shape, T, …) measured in order.

    A cell starts only while more than ``cell_s`` seconds are left before ``deadline_s`` (counted
    from this call) and ``skip(cell)`` is false; otherwise its :func:`cell_label` joins
    ``results["cut"]``. The row is the cell plus ``measure(cell)``'s fields, or plus ``error`` (the
    exception's repr) when it raises: one failing cell is a row, not the end of the run. Each row is
    appended to ``results["rows"]``, printed as one JSON line (``shown(row)`` where given) and
    written at once (``write(results)``), so a deadline or a crash cuts the tail, never the whole
    run; ``after(i)`` then runs (drop cached weights, empty the allocator's cache). Returns the
    seconds the loop took."""
    import json
    import time

    start = time.time()
    for i, cell in enumerate(cells):
        if (skip is not None and skip(cell)) or time.time() - start > deadline_s - cell_s:
            results["cut"].append(cell_label(cell))
            continue
        row = dict(cell)
        try:
            row.update(measure(cell))
        except Exception as exc:  # noqa: BLE001 — one failing cell is a row, not the end of the run
            row["error"] = repr(exc)[:300]
        results["rows"].append(row)
        print(json.dumps(row if shown is None else shown(row), default=str), flush=True)
        write(results)
        if after is not None:
            after(i)
    write(results)
    return time.time() - start


# --- the command line -----------------------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """argparse whose errors are a :class:`UsageError` (one line, no usage block, no exit)."""

    def error(self, message):
        raise UsageError(message)


def split_list(option: str, text: str) -> list[str]:
    """The items of a comma list, stripped; an empty list or item is a :class:`UsageError` naming ``option``."""
    items = [s.strip() for s in text.split(",")]
    if not text.strip() or any(not s for s in items):
        raise UsageError(f"{option}: empty item in list {text!r}")
    return items


def known_list(option: str, text: str, known: Sequence[str]) -> list[str]:
    """The items of a comma list (:func:`split_list`), each one of ``known``; another is a :class:`UsageError`
    naming ``option``, the unknown items and the known ones."""
    items = split_list(option, text)
    bad = [s for s in items if s not in known]
    if bad:
        raise UsageError(f"{option}: unknown {', '.join(bad)}; known: {', '.join(known)}")
    return items


def positive_ints(option: str, text: str, *, noun: str = "token count", example: str = "1,8,32") -> tuple:
    """A comma list of positive integers ("08" is 8), in the order given, repeats dropped."""
    values = []
    for s in split_list(option, text):
        if not s.isdigit() or int(s) < 1:
            raise UsageError(f"{option}: bad {noun} {s!r} in {text!r}: expected positive integers, e.g. {example}")
        values.append(int(s))
    return tuple(dict.fromkeys(values))


def number(option: str, text, *, lowest: float, allow_lowest: bool, what: str) -> float:
    """``text`` (or a float) as a finite number above ``lowest`` (or equal, with ``allow_lowest``)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < lowest or (value == lowest and not allow_lowest):
        raise UsageError(f"{option}: expected {what}, got {text!r}")
    return value


def shape_labels(option: str, text: str) -> tuple:
    """Catalog labels of a comma list, canonical ("QWEN3-30B-A3B" and "qwen3-30b-a3b:tp1" are
    "qwen3-30b-a3b"), repeats dropped."""
    from moe_spec.problem import get_shape

    labels = []
    for s in split_list(option, text):
        try:
            labels.append(get_shape(s).label)
        except ValueError as exc:
            raise UsageError(f"{option}: " + str(exc).removeprefix("shape: ")) from None
    return tuple(dict.fromkeys(labels))


def progress(prog: str) -> Callable[[str], None]:
    """``say(text)``: one line ``<prog>: <text>`` on stderr, flushed (a study's progress)."""

    def say(text: str) -> None:
        print(f"{prog}: {text}", file=sys.stderr, flush=True)

    return say


def _where(interrupted, options) -> str:
    if options is None:
        return "nothing written"
    if callable(interrupted):
        return interrupted(options)
    out = getattr(options, "out", None)
    return "nothing written" if out is None else interrupted.format(out=out)


def run_command(
    prog: str,
    argv: Sequence[str] | None,
    parse: Callable,
    run: Callable,
    *,
    interrupted="nothing written",
    errors: tuple = (),
) -> int:
    """A command's ``main``: ``run(parse(argv), argv)``, ``argv`` being ``sys.argv[1:]`` when None.

    A :class:`UsageError` (or one of ``errors``) is one line ``<prog>: error: …`` on stderr and exit
    status 2; a closed stdout (``| head``) ends with 1, no traceback; Ctrl-C is one line
    ``<prog>: interrupted (Ctrl-C); <where>`` and 130. ``where`` is ``interrupted(options)`` when it is
    a callable, else ``interrupted`` with ``{out}`` filled from ``options.out``; "nothing written"
    before the options are parsed or when they name no ``out``.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    options = None
    try:
        options = parse(argv)
        return run(options, argv)
    except (UsageError, *errors) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (Ctrl-C); {_where(interrupted, options)}", file=sys.stderr)
        return 130

"""Where the layer stands: the status tables of notes/targets.md and README.md, generated from a report.

Two tables are not written by hand. Each sits between marker comments in its file and is rendered
from one committed ``python -m compare`` report (``notes/results/compare_*.json``), whose file,
date, device, commit and command the block names:

* ``targets`` in ``notes/targets.md`` — every speed target of :data:`TARGETS` with the report's
  median µs, its % of the roofline floor, and whether it is met;
* ``glance`` in ``README.md`` — every (shape, format, T) of the report: cute_moe and triton_moe µs,
  the faster in bold.

``python -m compare.status --check`` says whether both blocks are what the newest committed report
(:func:`newest_report`: timed on an H200, the targets' machine, both backends on every shape of the targets)
renders (exit 1 and one line per stale block if not); ``--write`` rewrites them. ``--report FILE``
renders another report. A bad option is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "notes" / "results"

#: The machine the targets are set on (a report's device must name it to stand for the status).
TARGET_DEVICE = "H200"
#: The speed targets, CUDA-graph µs of one whole layer call (alignment included) on an H200:
#: (format, backend, shape) -> {T: µs}.
TARGETS = {
    ("bf16", "cute_moe", "qwen3-30b-a3b"): {1: 45, 8: 140, 128: 300, 4096: 750},
    ("bf16", "cute_moe", "deepseek-v3:tp8"): {1: 55, 32: 450, 1024: 850, 4096: 1250},
    ("bf16", "cute_moe", "mixtral-8x7b"): {128: 700, 4096: 4500},
    ("bf16", "triton_moe", "mixtral-8x7b"): {128: 700, 4096: 4800},
    ("bf16", "triton_moe", "qwen3-30b-a3b"): {1: 38, 4096: 700},
    ("bf16", "triton_moe", "deepseek-v3:tp8"): {1: 48, 4096: 1100},
    ("fp8_tensor", "triton_moe", "mixtral-8x7b"): {128: 420, 4096: 2900},
    ("fp8_tensor", "triton_moe", "qwen3-30b-a3b"): {4096: 520},
    ("fp8_tensor", "triton_moe", "deepseek-v3:tp8"): {1: 50, 4096: 950},
    ("fp8_tensor", "cute_moe", "mixtral-8x7b"): {4096: 2900},
    ("fp8_tensor", "cute_moe", "qwen3-30b-a3b"): {4096: 560},
    ("fp8_tensor", "cute_moe", "deepseek-v3:tp8"): {4096: 1000},
    ("fp8_block", "cute_moe", "deepseek-v3:tp8"): {4096: 1100},
    ("fp8_channel", "cute_moe", "mixtral-8x7b"): {4096: 3000},
}

#: Decode against the copy floor: (shape, format, T values, backend the target binds, % of floor it asks).
COPY_FLOOR_TARGET = ("mixtral-8x7b", "bf16", (1, 8, 32), "cute_moe", 95)
#: The alignment alone (the report's "align µs", bf16 rows): backend -> ((largest T, µs it may take), ...).
ALIGNMENT_TARGETS = {"triton_moe": ((128, 8.0),), "cute_moe": ((128, 10.0), (4096, 30.0))}

#: The blocks this module owns: name -> (file, path from that file to notes/results/).
BLOCKS = {"targets": ("notes/targets.md", "results/"), "glance": ("README.md", "notes/results/")}
GLANCE_BACKENDS = ("cute_moe", "triton_moe")


class StatusError(Exception):
    """A report or a file this module cannot use; the message names it."""


def _begin(name: str) -> str:
    return f"<!-- status:{name}:begin -->"


def _end(name: str) -> str:
    return f"<!-- status:{name}:end -->"


# --- reports --------------------------------------------------------------------------------------


def load_report(path) -> dict:
    """A ``python -m compare`` report (its JSON), with ``path`` kept under ``"_path"``."""
    path = pathlib.Path(path)
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise StatusError(f"report: cannot read {path}: {e}") from None
    if not isinstance(report, dict) or not {"meta", "rows"} <= report.keys():
        raise StatusError(f"report: {path} is not a compare report (no meta / rows)")
    report["_path"] = path
    return report


def report_time(report: dict) -> datetime.datetime:
    """The report's date ("2026-12-03 10:17 UTC") as a datetime."""
    text = report["meta"].get("date", "")
    try:
        return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M UTC")
    except ValueError:
        raise StatusError(
            f"report: {report['_path'].name} has no date of the form YYYY-MM-DD HH:MM UTC: {text!r}"
        ) from None


def covers_the_suite(report: dict) -> bool:
    """Whether a report can stand for where the layer stands: timed on an H200 (the machine of the
    targets; an H100's report is a result, not the status), both backends timed on every shape the
    targets name (a study's run over one shape or one backend cannot)."""
    meta = report["meta"]
    timed = {(r["backend"], r["shape"]) for r in report["rows"] if r.get("us") is not None}
    shapes = {shape for (_, _, shape) in TARGETS}
    return (
        meta.get("mode") == "gpu"
        and bool(meta.get("timed"))
        and TARGET_DEVICE in str(meta.get("device", ""))
        and all((b, s) in timed for b in GLANCE_BACKENDS for s in shapes)
    )


def newest_report(results=RESULTS) -> dict:
    """The newest committed compare report of ``results`` that covers the suite
    (:func:`covers_the_suite`), latest by its own date."""
    found = []
    for path in sorted(pathlib.Path(results).glob("compare_*.json")):
        report = load_report(path)
        if covers_the_suite(report):
            found.append((report_time(report), path.name, report))
    if not found:
        raise StatusError(
            f"report: no timed {TARGET_DEVICE} compare report covering both backends and the targets' shapes "
            f"in {results}"
        )
    return max(found, key=lambda f: f[:2])[2]


def rows_by_cell(report: dict) -> dict:
    """(backend, shape, format, T) -> the report's row."""
    return {(r["backend"], r["shape"], r["quant"], r["T"]): r for r in report["rows"]}


def target_met(us: float, target: float) -> bool:
    return us <= target


# --- rendering ------------------------------------------------------------------------------------


def _us(value: float) -> str:
    return f"{value:.1f}"


def source_line(report: dict, link_prefix: str) -> str:
    """The sentence naming the report: file (linked), date, device, commit, versions and command."""
    meta, md = report["meta"], report["_path"].with_suffix(".md").name
    return (
        f"Generated by `python -m compare.status --write` from [{md}]({link_prefix}{md}) (+ `.json`): "
        f"{meta['device']}, {meta['date']}, commit `{meta['commit']}`, torch {meta.get('torch', '?')}, "
        f"Triton {meta.get('triton', '?')}; command `{meta['command']}`. CUDA-graph replay, cold L2, "
        "median µs of one whole layer call (alignment included). Do not edit by hand."
    )


def render_targets(report: dict, link_prefix: str = "results/") -> str:
    """The speed targets against the report: µs, % of the roofline floor, met or not."""
    rows = rows_by_cell(report)
    lines = [
        source_line(report, link_prefix),
        "",
        "| backend | shape | format | T | target µs | µs | % of floor | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    absent = []
    for (quant, backend, shape), by_T in TARGETS.items():
        for T, target in by_T.items():
            row = rows.get((backend, shape, quant, T))
            if row is None or row.get("us") is None:
                absent.append(f"{backend} {shape} {quant} T = {T} (target {target})")
                continue
            met = "yes" if target_met(row["us"], target) else "**no**"
            pct = "–" if row.get("pct_floor") is None else f"{row['pct_floor']:.0f}"
            lines.append(f"| {backend} | {shape} | {quant} | {T} | {target} | {_us(row['us'])} | {pct} | {met} |")
    if absent:
        lines += ["", "Not in this report: " + "; ".join(absent) + "."]
    return "\n".join(lines + [""] + _copy_floor_lines(rows) + [""] + _alignment_lines(report, rows))


def _copy_floor_lines(rows: dict) -> list:
    shape, quant, tokens, bound, pct = COPY_FLOOR_TARGET
    lines = [
        f"{shape} {quant} decode, % of the copy floor ({bound}'s target: ≥ {pct} % at every T here):",
        "",
        "| backend | " + " | ".join(f"T = {T}" for T in tokens) + " | met |",
        "|---|" + "---|" * (len(tokens) + 1),
    ]
    for backend in GLANCE_BACKENDS:
        pcts = [rows.get((backend, shape, quant, T), {}).get("pct_floor") for T in tokens]
        if None in pcts:
            continue
        met = ("yes" if min(pcts) >= pct else "**no**") if backend == bound else "(no target)"
        lines.append(f"| {backend} | " + " | ".join(f"{p:.0f}" for p in pcts) + f" | {met} |")
    return lines


def _alignment_lines(report: dict, rows: dict) -> list:
    shapes = list(dict.fromkeys(r["shape"] for r in report["rows"]))
    lines = [
        'The alignment alone (the report\'s "align µs", bf16 rows): the largest µs of T ≤ the bound, per shape:',
        "",
        "| backend | bound | " + " | ".join(shapes) + " | target µs | met |",
        "|---|---|" + "---|" * (len(shapes) + 2),
    ]
    for backend, bounds in ALIGNMENT_TARGETS.items():
        low = 0
        for top, limit in bounds:
            worst = []
            for shape in shapes:
                found = [
                    r.get("prep_us")
                    for (b, s, q, T), r in rows.items()
                    if (b, s, q) == (backend, shape, "bf16") and low < T <= top
                ]
                worst.append(max(found) if found and None not in found else None)
            if None in worst:
                continue
            met = "yes" if max(worst) <= limit else "**no**"
            lines.append(
                f"| {backend} | {low + 1} ≤ T ≤ {top} | "
                + " | ".join(_us(w) for w in worst)
                + f" | {limit:g} | {met} |"
            )
            low = top
    return lines


def render_glance(report: dict, link_prefix: str = "notes/results/") -> str:
    """Every (shape, format) of the report: ``cute_moe / triton_moe`` µs per T, the faster in bold."""
    rows = rows_by_cell(report)
    groups = list(dict.fromkeys((r["shape"], r["quant"]) for r in report["rows"]))
    tokens = sorted({r["T"] for r in report["rows"]})
    lines = [
        source_line(report, link_prefix),
        "",
        "µs per call, `cute_moe / triton_moe`, the faster in bold:",
        "",
        "| shape | format | " + " | ".join(f"T = {T}" for T in tokens) + " |",
        "|---|---|" + "---|" * len(tokens),
    ]
    for shape, quant in groups:
        cells = []
        for T in tokens:
            us = [rows.get((b, shape, quant, T), {}).get("us") for b in GLANCE_BACKENDS]
            if None in us:
                cells.append("–")
                continue
            text = [_us(u) for u in us]
            best = min(range(len(us)), key=lambda i: us[i])
            text[best] = f"**{text[best]}**"
            cells.append(" / ".join(text))
        lines.append(f"| {shape} | {quant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


RENDER = {"targets": render_targets, "glance": render_glance}


# --- blocks in files ------------------------------------------------------------------------------


def read_block(text: str, name: str) -> str:
    """The text between the ``name`` markers (without them)."""
    m = re.search(_block_pattern(name), text, re.S)
    if m is None:
        raise StatusError(f"{BLOCKS[name][0]}: no {_begin(name)} … {_end(name)} block")
    return m.group(1) or ""


def _block_pattern(name: str) -> str:
    return re.escape(_begin(name)) + r"\n(?:(.*?)\n)?" + re.escape(_end(name))


def replace_block(text: str, name: str, body: str) -> str:
    read_block(text, name)  # refuses a file without the markers
    return re.sub(_block_pattern(name), lambda _: f"{_begin(name)}\n{body}\n{_end(name)}", text, count=1, flags=re.S)


def named_report(block: str, root=ROOT) -> pathlib.Path:
    """The report JSON a block names (its link to ``compare_*.md``)."""
    m = re.search(r"\]\((?:notes/)?results/(compare_[^)]+)\.md\)", block)
    if m is None:
        raise StatusError("block: names no compare report")
    return pathlib.Path(root) / "notes" / "results" / f"{m.group(1)}.json"


def stale_blocks(report: dict, root=ROOT) -> list:
    """One line per block that differs from what ``report`` renders (empty: all current)."""
    stale = []
    for name, (file, prefix) in BLOCKS.items():
        text = (pathlib.Path(root) / file).read_text()
        if read_block(text, name) != RENDER[name](report, prefix):
            stale.append(
                f"{file}: the {name} table is not what {report['_path'].name} renders "
                f"(python -m compare.status --write)"
            )
    return stale


def write_blocks(report: dict, root=ROOT) -> list:
    """Rewrite every block from ``report``; returns the files changed."""
    changed = []
    for name, (file, prefix) in BLOCKS.items():
        path = pathlib.Path(root) / file
        text = path.read_text()
        new = replace_block(text, name, RENDER[name](report, prefix))
        if new != text:
            path.write_text(new)
            changed.append(file)
    return changed


# --- command line ---------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv=None) -> int:
    parser = _Parser(
        prog="python -m compare.status",
        description="Generate or check the status tables of notes/targets.md and README.md.",
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 when a table differs from the report")
    mode.add_argument("--write", action="store_true", help="rewrite the tables from the report")
    parser.add_argument(
        "--report",
        metavar="FILE",
        help="a compare report JSON (default: the newest in notes/results/ timing both backends on every target shape)",
    )
    args = parser.parse_args(argv)
    try:
        report = load_report(args.report) if args.report else newest_report()
        if args.check:
            stale = stale_blocks(report)
            for line in stale:
                print(line)
            return 1 if stale else 0
        for file in write_blocks(report):
            print(f"wrote {file} from {report['_path'].name}")
        return 0
    except StatusError as e:
        print(f"python -m compare.status: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Below the kernel: Nsight Compute's counters for a layer's calls — ``python -m compare.studies.ncu --out DIR``.

The profile study (:mod:`compare.studies.profile`) says which kernel of a layer call takes the time;
this one says why, from the hardware counters: for every launch of a call, its duration, the DRAM
bytes it read and the rate it reached, the SM and issue activity, the warps resident and eligible
per scheduler, and the states its warps were stalled in (cycles per issued instruction, the
``WarpStateStats`` section's breakdown). That is what a missed bandwidth or tensor-core target needs:
whether a kernel streams at the copy rate, and if not, what its warps wait on.

A **cell** is the profile study's (backend, catalog shape, T, format), selected by the same options.
Per cell this command runs ``ncu`` on itself in a child process (``--target``: the problem built as
the suite builds it, :data:`WARMUP_CALLS` warm-up calls, then ``--calls`` calls between
``cudaProfilerStart`` and ``cudaProfilerStop``, so ncu sees those calls only). ncu serializes the
launches, flushes the caches before each (``--cache-control all``: a cold L2, as the suite's clock
wants it) and keeps the GPU's own clocks (``--clock-control none``), then replays each launch once
per counter pass; its durations are those of one launch alone, without its neighbours' overlap.
The report is read back as ncu's raw CSV (``--page raw --print-units base``), kept beside the
results as ``<cell>.csv``, and summarized by :func:`summarize` (pure; the CPU tests feed it text in
ncu's layout). ``--from DIR`` summarizes the CSVs of an earlier run again, with no GPU.

Writes ``ncu.json`` and ``ncu.md`` (date, device, commit, command) after every cell.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from compare.studies import profile
from moe_spec import runinfo, studyout
from moe_spec.studyout import UsageError

PROG = "python -m compare.studies.ncu"
FILES = ("ncu.json", "ncu.md")
CALLS = 2  # layer calls profiled per cell (each launch replayed once per counter pass)
WARMUP_CALLS = profile.WARMUP_CALLS
SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "LaunchStats", "Occupancy", "SchedulerStats", "WarpStateStats")
CELL_TIMEOUT_S = 300.0  # a cell's ncu run at most (and never past --deadline-s: run_ncu)
IMPORT_TIMEOUT_S = 120.0
MIN_CELL_S = 30.0  # a cell starts only with this much of --deadline-s left
TOP_STALLS = 4

#: The raw page's metrics each column reads (Nsight Compute's names; a metric missing is "—").
METRICS = {
    "duration": "gpu__time_duration.sum",
    "dram_rate": "dram__bytes.sum.per_second",  # read + written, over the launch's duration
    "dram_pct": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "sm_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "issue_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "warps_active": "smsp__warps_active.avg.per_cycle_active",
    "warps_eligible": "smsp__warps_eligible.avg.per_cycle_active",
    "occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "grid": "launch__grid_size",
    "block": "launch__block_size",
    "registers": "launch__registers_per_thread",
    "smem_dynamic": "launch__shared_mem_per_block_dynamic",
    "smem_static": "launch__shared_mem_per_block_static",
}
#: Warp states: cycles a warp spent in the state per instruction issued (``WarpStateStats``).
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")
_SCALE = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "m": 1e-3, "u": 1e-6, "n": 1e-9}
#: A unit's base and the spellings ncu uses for it (``ns``, ``nsecond``, ``usecond``; ``byte``, ``Kbyte``;
#: ``byte/s``, ``Gbyte/second``).
_BASES = {"second": ("second", "s"), "byte": ("byte",), "byte/second": ("byte/second", "byte/s")}


def _number(text: str) -> float | None:
    """ncu's value text (thousands separators allowed) as a float; None for empty or 'n/a'."""
    text = text.strip().replace(",", "")
    try:
        return float(text)
    except ValueError:
        return None


def _in_base(value: float | None, unit: str, base: str) -> float | None:
    """``value`` in ``unit`` (``ns``, ``nsecond``, ``Kbyte``, ``byte/block``, ``byte/s`` …) converted to
    ``base`` (``second``, ``byte`` or ``byte/second``); unchanged where there is no unit, None where the
    unit is of another family."""
    if value is None or not unit:  # no units row: the value as it is
        return value
    if base == "byte" and unit.endswith("/block"):  # shared memory per block
        unit = unit[: -len("/block")]
    for spelling in _BASES[base]:
        prefix = unit[: -len(spelling)] if unit.endswith(spelling) else None
        if prefix is not None and prefix in _SCALE:
            return value * _SCALE[prefix]
    return None  # a unit of another family: not a number of this column


def parse_raw(text: str) -> list[dict]:
    """ncu's ``--csv --page raw`` text as one dict per launch, in launch order: ``name`` and
    ``metrics`` (metric -> (value text, unit)). Lines before the header (ncu's own notes) are skipped;
    the units row, where present, follows the header (its ID field is empty)."""
    rows = [r for r in csv.reader(io.StringIO(text)) if r]
    start = next((i for i, r in enumerate(rows) if "Kernel Name" in r and "ID" in r), None)
    if start is None:
        raise ValueError("no ncu raw-page header (a row with 'ID' and 'Kernel Name') in the text")
    header = rows[start]
    body = rows[start + 1 :]
    id_col = header.index("ID")
    units = body.pop(0) if body and not body[0][id_col].strip() else [""] * len(header)
    name_col = header.index("Kernel Name")
    launches = []
    for r in body:
        if len(r) != len(header):
            continue
        launches.append({"name": r[name_col], "metrics": {h: (v, u) for h, v, u in zip(header, r, units)}})
    return launches


def _value(launch: dict, metric: str, base: str | None = None) -> float | None:
    text, unit = launch["metrics"].get(metric, ("", ""))
    value = _number(text)
    return _in_base(value, unit, base) if base else value


def launch_record(launch: dict) -> dict:
    """One launch's columns, in the units the report uses (µs, MB, TB/s, KiB, %)."""
    seconds = _value(launch, METRICS["duration"], "second")
    rate = _value(launch, METRICS["dram_rate"], "byte/second")
    smem = [_value(launch, METRICS[k], "byte") for k in ("smem_dynamic", "smem_static")]
    stalls = {}
    for metric in launch["metrics"]:
        m = STALL.match(metric)
        if m and (v := _value(launch, metric)) is not None:
            stalls[m.group(1)] = v
    return {
        "name": launch["name"],
        "us": None if seconds is None else seconds * 1e6,
        "dram_mb": None if rate is None or seconds is None else rate * seconds / 1e6,
        "dram_tbps": None if rate is None else rate / 1e12,
        **{k: _value(launch, METRICS[k]) for k in ("dram_pct", "sm_pct", "issue_pct", "occupancy_pct")},
        **{k: _value(launch, METRICS[k]) for k in ("warps_active", "warps_eligible", "grid", "block", "registers")},
        "smem_kib": None if any(s is None for s in smem) else sum(smem) / 1024,
        "stalls": dict(sorted(stalls.items(), key=lambda kv: -kv[1])),
    }


def _mean(values: Sequence) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize(launches: Sequence[dict], calls: int) -> dict:
    """Per launch position of a layer call (a kernel launched twice per call is two rows), the mean
    of each column over the ``calls`` calls; ``launches_per_call`` and ``us_per_call`` (the sum).
    When the launches do not divide into ``calls`` equal calls, one row per launch instead."""
    records = [launch_record(x) for x in launches]
    if not records:
        return {"launches_per_call": 0, "us_per_call": None, "kernels": [], "grouped": False}
    per_call, rest = divmod(len(records), calls)
    grouped = rest == 0 and all(
        records[c * per_call + i]["name"] == records[i]["name"] for c in range(calls) for i in range(per_call)
    )
    positions = (
        [[records[c * per_call + i] for c in range(calls)] for i in range(per_call)]
        if grouped
        else [[r] for r in records]
    )
    kernels = []
    for group in positions:
        row = {"name": group[0]["name"]}
        for key in group[0]:
            if key not in ("name", "stalls"):
                row[key] = _mean([g[key] for g in group])
        reasons = dict.fromkeys(r for g in group for r in g["stalls"])
        stalls = {r: _mean([g["stalls"].get(r) for g in group]) for r in reasons}
        row["stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1]))
        row["cycles_per_issue"] = sum(stalls.values()) if stalls else None
        kernels.append(row)
    us = [k["us"] for k in kernels]
    return {
        "launches_per_call": len(kernels) if grouped else len(records) / calls,
        "us_per_call": sum(us) if grouped and all(u is not None for u in us) else None,
        "kernels": kernels,
        "grouped": grouped,
    }


# --- the child: one cell's calls between cudaProfilerStart and cudaProfilerStop -------------------


def cell_key(cell: profile.Cell) -> str:
    return f"{cell.backend}/{cell.shape}/{cell.quant}/{cell.T}"


def parse_cell_key(text: str) -> profile.Cell:
    parts = text.split("/")
    if len(parts) != 4 or not parts[3].isdigit():
        raise UsageError(f"--target: expected backend/shape/format/T, got {text!r}")
    return profile.Cell(parts[0], parts[1], int(parts[3]), parts[2])


def slug(cell: profile.Cell) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{cell.backend}_{cell.shape}_{cell.quant}_T{cell.T}")


def run_target(cell: profile.Cell, calls: int, seed: int, env: profile.Env | None = None, profiler=None) -> dict:
    """In the child: build the cell, warm up, then ``calls`` calls inside the profiler range."""
    import torch

    cudart = profiler or torch.cuda.cudart()

    def measure(backend, sets, run):
        cudart.cudaProfilerStart()
        try:
            run(calls)
        finally:
            cudart.cudaProfilerStop()
        return {}

    return profile._on_cell(cell, env or profile.Env(), seed, "status", measure)


# --- the parent: ncu on the child, per cell ------------------------------------------------------


def ncu_command(ncu: str, cell: profile.Cell, report: Path, calls: int, seed: int) -> list[str]:
    sections = [a for s in SECTIONS for a in ("--section", s)]
    return [
        ncu,
        "--profile-from-start",
        "off",
        "--clock-control",
        "none",
        "--cache-control",
        "all",
        *sections,
        "--export",
        str(report),
        "--force-overwrite",
        sys.executable,
        "-m",
        "compare.studies.ncu",
        "--target",
        cell_key(cell),
        "--calls",
        str(calls),
        "--seed",
        str(seed),
    ]


def import_command(ncu: str, report: Path) -> list[str]:
    return [ncu, "--import", str(report), "--csv", "--page", "raw", "--print-units", "base"]


def _tail(text: str, n: int = 400) -> str:
    return " ".join(text.strip().split())[-n:]


def run_group(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` in a session of its own, its output captured; past ``timeout`` the whole process group is
    killed (ncu and the child it started, which would otherwise keep the GPU) and TimeoutExpired raised."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def _ncu_lines(*texts: str) -> str:
    """ncu's own ``==ERROR==`` and ``==WARNING==`` lines of its output, joined (empty when none)."""
    lines = [ln.strip() for t in texts for ln in (t or "").splitlines() if ln.startswith(("==ERROR==", "==WARNING=="))]
    return " ".join(lines)[-400:]


def profile_cell(
    cell: profile.Cell, out: Path, ncu: str, calls: int, seed: int, timeout_s: float = CELL_TIMEOUT_S, run=run_group
) -> dict:
    """ncu on the child for one cell (at most ``timeout_s``), its raw CSV kept as ``<slug>.csv`` in ``out``,
    and the summary."""
    row = {"cell": cell.title, "key": cell_key(cell), "csv": f"{slug(cell)}.csv"}
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "cell.ncu-rep"
        try:
            done = run(ncu_command(ncu, cell, report, calls, seed), timeout_s)
        except subprocess.TimeoutExpired:
            return {**row, "status": f"ncu did not finish within {timeout_s:.0f} s (stopped)"}
        child = next((ln for ln in done.stdout.splitlines() if ln.startswith("target status:")), None)
        if done.returncode != 0 or not report.exists():
            ncu_said = _ncu_lines(done.stdout, done.stderr)
            if child and child != "target status: ok":
                why = child  # the cell itself failed: that is the reason
            else:
                why = ncu_said or _tail(done.stderr or done.stdout)
            missing = "" if report.exists() else "no report written; "
            return {**row, "status": f"ncu rc={done.returncode}: {missing}{why}"}
        raw = run(import_command(ncu, report), IMPORT_TIMEOUT_S)
    if raw.returncode != 0:
        return {**row, "status": f"ncu --import rc={raw.returncode}: {_tail(raw.stderr)}"}
    studyout.write_files(out, {row["csv"]: raw.stdout})
    status = child.split(":", 1)[1].strip() if child else "ok"
    return {**row, "status": status, **summary_of(raw.stdout, calls)}


def summary_of(text: str, calls: int) -> dict:
    try:
        return {"profile": summarize(parse_raw(text), calls)}
    except ValueError as exc:
        return {"profile": None, "parse_error": str(exc)}


# --- the report ----------------------------------------------------------------------------------


def _f(v, fmt="{:.1f}") -> str:
    return "—" if v is None else fmt.format(v)


def _stalls(k: dict) -> str:
    # "selected" is the state of the warp that issues (about 1 cycle per issue), not a stall
    top = [(r, v) for r, v in k["stalls"].items() if r != "selected"][:TOP_STALLS]
    return ", ".join(f"{r} {v:.1f}" for r, v in top) if top else "—"


def to_markdown(result: dict) -> str:
    m = result["meta"]
    lines = [
        "# Below the kernel: Nsight Compute's counters per launch of a layer call",
        "",
        *studyout.header_lines(m),
        *([f"- summarized again from the kept CSVs: {m['summarized']}"] if m.get("summarized") else []),
        f"- ncu: `{m['ncu']}`; sections {', '.join(SECTIONS)}; `--cache-control all --clock-control none`; "
        f"{m['calls']} layer calls profiled after {WARMUP_CALLS} warm-up calls, each launch alone (serialized, "
        "cold L2), the columns the mean over the calls",
        "- columns: µs = gpu__time_duration; TB/s = dram__bytes (read + written) per second; DRAM MB = that × µs; "
        "DRAM % and SM % of peak sustained (elapsed); issue % = smsp__issue_active; warps = active / eligible per "
        "scheduler per cycle; stalls = the top warp states in cycles per issued instruction (WarpStateStats; their sum "
        "with 'selected' is cycles/issue, the cycles between two issues of a warp)",
        "",
        "| cell | status | launches/call | µs/call |",
        "|---|---|---|---|",
    ]
    for r in result["cells"]:
        p = r.get("profile") or {}
        lines.append(
            f"| {r['cell']} | {r['status'].replace('|', '/')} | {_f(p.get('launches_per_call'), '{:.3g}')} "
            f"| {_f(p.get('us_per_call'))} |"
        )
    for r in result["cells"]:
        p = r.get("profile")
        if not p or not p["kernels"]:
            continue
        lines += [
            "",
            f"## {r['cell']} ({_f(p['us_per_call'])} µs per call; raw: `{r['csv']}`)",
            "",
            "| # | kernel | µs | DRAM MB | TB/s | DRAM % | SM % | issue % | warps act / elig | occ % | regs "
            "| grid × block | smem KiB | cycles/issue | top stalls |",
            "|---" * 15 + "|",
        ]
        for i, k in enumerate(p["kernels"]):
            lines.append(
                f"| {i} | `{profile.short(k['name']).replace('|', '/')}` | {_f(k['us'])} | {_f(k['dram_mb'])} "
                f"| {_f(k['dram_tbps'], '{:.2f}')} | {_f(k['dram_pct'], '{:.0f}')} | {_f(k['sm_pct'], '{:.0f}')} "
                f"| {_f(k['issue_pct'], '{:.0f}')} | {_f(k['warps_active'], '{:.2f}')} / "
                f"{_f(k['warps_eligible'], '{:.2f}')} | {_f(k['occupancy_pct'], '{:.0f}')} "
                f"| {_f(k['registers'], '{:.0f}')} | {_f(k['grid'], '{:.0f}')} × {_f(k['block'], '{:.0f}')} "
                f"| {_f(k['smem_kib'])} | {_f(k['cycles_per_issue'])} | {_stalls(k)} |"
            )
    return "\n".join(lines) + "\n"


def write_outputs(result: dict, out: Path) -> None:
    studyout.write_files(out, dict(zip(FILES, (json.dumps(result, indent=1) + "\n", to_markdown(result)))))


def run_ncu(
    cells: Sequence[profile.Cell],
    out: Path,
    *,
    ncu: str,
    calls: int,
    seed: int,
    meta: dict,
    deadline_s: float,
    say: Callable = lambda text: None,
    cell_runner=profile_cell,
) -> dict:
    result = {"meta": {**meta, "ncu": ncu, "calls": calls, "sections": list(SECTIONS)}, "cells": []}
    start = time.monotonic()
    for cell in cells:
        left = deadline_s - (time.monotonic() - start)
        if left < MIN_CELL_S:
            result["cells"].append({"cell": cell.title, "key": cell_key(cell), "status": "skipped (deadline)"})
        else:
            say(f"{cell.title} …")
            result["cells"].append(cell_runner(cell, out, ncu, calls, seed, min(CELL_TIMEOUT_S, left)))
            say(f"{cell.title}: {result['cells'][-1]['status']}")
        write_outputs(result, out)
    return result


def resummarize(directory: Path, result: dict) -> dict:
    """``--from``: ``result``, the run's ncu.json, with each cell's summary rebuilt from its kept CSV."""
    for row in result["cells"]:
        path = directory / row.get("csv", "")
        if row.get("csv") and path.is_file():
            row.update(summary_of(path.read_text(), result["meta"]["calls"]))
    return result


def build_parser() -> argparse.ArgumentParser:
    p = studyout.Parser(prog=PROG, description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("--out", help="a new or empty directory for ncu.json, ncu.md and each cell's raw CSV")
    p.add_argument("--backends", help=f"cells of these backends: {', '.join(profile.BACKENDS)} or 'all'")
    p.add_argument("--shapes", help="cells of these catalog shapes, e.g. qwen3-30b-a3b,deepseek-v3:tp8")
    p.add_argument("--quants", help=f"cells of these formats: {', '.join(profile.QUANT_NAMES)} or 'all'")
    p.add_argument("--tokens", help="cells of these token counts T, e.g. 1,8 (required: every combination runs)")
    p.add_argument("--calls", type=int, default=CALLS, help="layer calls profiled per cell [%(default)s]")
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument(
        "--deadline-s",
        default="450",
        metavar="S",
        help="no cell runs past S seconds: one cut there is a row saying so, later ones 'skipped' [%(default)s]",
    )
    p.add_argument("--ncu", default=None, help="the ncu executable [the one on PATH]")
    p.add_argument("--commit", default=None, help="commit to record [git rev-parse of this checkout]")
    p.add_argument("--from", dest="from_dir", help="summarize an earlier run's directory again (no GPU)")
    p.add_argument("--target", help=argparse.SUPPRESS)  # the child ncu runs: backend/shape/format/T
    return p


def parse_args(argv: list) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.calls < 1:
        raise UsageError(f"--calls: expected a positive integer, got {args.calls}")
    if args.target:
        args.cell = parse_cell_key(args.target)
        return args
    if args.from_dir:
        if args.out or args.tokens:
            raise UsageError(
                "--from: summarizes an earlier run's directory in place; give it alone (no --out, --tokens)"
            )
        path = Path(args.from_dir) / "ncu.json"
        try:
            args.earlier = earlier = json.loads(path.read_text())
            if not isinstance(earlier["cells"], list) or int(earlier["meta"]["calls"]) < 1:
                raise ValueError("no cells or no call count")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"--from: {str(path)!r} is not an ncu.json of this study ({type(exc).__name__})") from None
        return args
    if not args.tokens:
        raise UsageError("--tokens: required (the cells are every combination of the lists)")
    args.cells = profile.select_cells(
        backends=profile.parse_names("--backends", args.backends, profile.BACKENDS) if args.backends else None,
        shapes=studyout.shape_labels("--shapes", args.shapes) if args.shapes else None,
        quants=profile.parse_names("--quants", args.quants, profile.QUANT_NAMES) if args.quants else None,
        tokens=studyout.positive_ints("--tokens", args.tokens),
        grid=True,
    )
    args.deadline_s = studyout.number(
        "--deadline-s", args.deadline_s, lowest=0.0, allow_lowest=False, what="a finite number of seconds > 0"
    )
    ncu = args.ncu or shutil.which("ncu")
    if not ncu or not shutil.which(ncu):
        raise UsageError(f"--ncu: no Nsight Compute executable {'on PATH' if not args.ncu else repr(args.ncu)}")
    args.ncu = ncu
    args.out = studyout.check_out(args.out, FILES)
    return args


def _run(args: argparse.Namespace, argv: list) -> int:
    if args.target:
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
        row = run_target(args.cell, args.calls, args.seed)
        print(f"target status: {row['status']}", flush=True)
        return 0 if row["status"] == "ok" else 1
    if args.from_dir:
        result = resummarize(Path(args.from_dir), args.earlier)
        result["meta"]["summarized"] = (
            f"{runinfo.utc_now()}, commit {args.commit or runinfo.git_commit()}, `{PROG} --from`"
        )
        write_outputs(result, Path(args.from_dir))
        print(f"rewrote {Path(args.from_dir) / 'ncu.md'} and ncu.json from the kept CSVs")
        return 0
    runinfo.require_cuda(PROG)
    meta = runinfo.run_info(runinfo.command_line(PROG, argv), cuda=True, commit=args.commit)
    result = run_ncu(
        args.cells,
        args.out,
        ncu=args.ncu,
        calls=args.calls,
        seed=args.seed,
        meta=meta,
        deadline_s=args.deadline_s,
        say=studyout.progress(PROG),
    )
    print("\n".join(to_markdown(result).splitlines()[:12]))
    print(f"wrote {args.out / 'ncu.md'} and {args.out / 'ncu.json'}")
    return 0


def main(argv=None) -> int:
    return studyout.run_command(PROG, argv, parse_args, _run, interrupted="the cells finished so far are in {out}")


if __name__ == "__main__":
    sys.exit(main())

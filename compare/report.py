"""Rendering a suite result: the terminal table, JSON, CSV, the markdown report and the plots.

The JSON (``results.json``, :mod:`compare.results`) is the complete record; everything else is
derived from it, so several runs (e.g. one H200 call per shape) can be merged and re-rendered
without re-running anything. :func:`write_all` writes every file into one directory (the CLI gives
it a staging directory, :mod:`compare.outputs`); :func:`problems` lists what ``--strict`` fails on.

The terminal shows a summary that fits 120 columns (:func:`compact_table`): per shape and format, one
line per T with the fastest correct backend, its µs, speedup and % of floor, and how many backends
passed, with a note number for the others (``2/4 ok [1]``); the notes, whole, follow with the meaning
of every column shown. Every (case, backend) row with every column is in report.md, the CSV and the JSON.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

from compare.backends import BASELINE, FALLBACK_BASELINE, KERNELS, OUR_KERNELS
from compare.markdown import markdown
from compare.peers import PEERS
from compare.plots import FIGURES
from compare.tables import EMPTY, STATUS_MEANING, TERMINAL_WIDTH, full_status, legend, num, status_parts, wrap
from compare.userkernel import is_user_kernel

#: Every file a report directory may hold (what a rerun into the same directory replaces).
OUTPUT_FILES = ("results.json", "results.csv", "report.md") + tuple(f"{name}.png" for name in FIGURES)
ROW_FIELDS = (
    "shape",
    "shape_note",
    "E",
    "K",
    "I",
    "top_k",
    "T",
    "quant",
    "backend",
    "status",
    "check",
    "config",
    "rel_l2",
    "max_abs",
    "max_ulp",
    "cosine",
    "deterministic",
    "batch_invariant",
    "xdiff",
    "xdiff_ok",
    "quant_error",
    "err_vs_bf16",
    "flagged_experts",
    "timing",
    "us",
    "p10_us",
    "p90_us",
    "prep_us",
    "eager_us",
    "eager_ratio",
    "compiled_us",
    "compiled_ratio",
    "compiled_rel_l2",
    "compiled_note",
    "separate_us",
    "fusion_speedup",
    "fused_bytes",
    "separate_bytes",
    "weight_tbps",
    "tflops",
    "pct_floor",
    "floor_us",
    "bound",
    "speedup",
    "vs_ours",
    "vs_ours_of",
    "vs_ours_ok",
    "converted",
)


# --- terminal table -----------------------------------------------------------------------------

BEST_WIDTH = 16  # a longer backend name (a kernel of yours given by its path) is shortened to its end


def _best(rows: list[dict]):
    """The fastest row that passed the tolerance policy and was timed, or None."""
    timed = [r for r in rows if r.get("status") == "ok" and isinstance(r.get("us"), (int, float))]
    return min(timed, key=lambda r: r["us"]) if timed else None


def _short(name: str, width: int = BEST_WIDTH) -> str:
    return name if len(name) <= width else "…" + name[-(width - 1) :]


def _worst_rel_l2(rows: list[dict]) -> str:
    ran = [r["rel_l2"] for r in rows if r.get("status") == "ok" and isinstance(r.get("rel_l2"), float)]
    return num(max(ran), ".1e") if ran else "-"


#: The summary's columns after T: (header, cell of a case's rows and its best row, meaning); a column empty
#: in every case is not shown (on the CPU nothing is timed: no best, µs, speedup or % of floor).
SUMMARY = (
    (
        "best",
        lambda rows, b: _short(b["backend"]) if b else "-",
        "the fastest backend that passed the tolerance policy (µs, speedup and % of floor are its)",
    ),
    (
        "µs",
        lambda rows, b: num(b.get("us"), ".1f") if b else "-",
        "median µs of one fused_moe call (CUDA-graph replays, cold L2)",
    ),
    (
        "speedup",
        lambda rows, b: num(b.get("speedup"), ".2f") if b else "-",
        f"over {BASELINE} (over {FALLBACK_BASELINE} where {BASELINE} was not timed)",
    ),
    (
        "%floor",
        lambda rows, b: num(b.get("pct_floor"), ".0f") if b else "-",
        "the roofline floor as a % of µs (this run's ceilings)",
    ),
    (
        "rel L2 ≤",
        lambda rows, b: _worst_rel_l2(rows),
        "the largest relative L2 error against the fp64 oracle among the backends that passed",
    ),
    (
        "xdiff",
        lambda rows, b: next((num(r.get("xdiff"), ".1e") for r in rows if r.get("xdiff") is not None), "-"),
        f"relative L2 difference between the {KERNELS[0]} and {KERNELS[1]} outputs (bound: twice the tolerance)",
    ),
)


def _status_cell(rows: list[dict], notes: dict) -> str:
    """``3/4 ok [1]``: how many backends passed, and a note for each other status (the note names the
    backends and says the status whole)."""
    ok = sum(r.get("status") == "ok" for r in rows)
    failed = sum(r.get("status") == "FAIL" for r in rows)
    refs = []
    for r in rows:
        if r.get("status") == "ok":
            continue
        kind, detail = status_parts(r)
        key = "FAIL: outside the tolerance policy (report.md gives each check)" if kind == "FAIL" else full_status(r)
        backends = notes.setdefault(key, [])
        if r["backend"] not in backends:
            backends.append(r["backend"])
        ref = list(notes).index(key) + 1
        if ref not in refs:
            refs.append(ref)
    cell = f"{ok}/{len(rows)} ok" + (f", {failed} FAIL" if failed else "")
    return cell + (" " + "".join(f"[{n}]" for n in refs) if refs else "")


def compact_table(result: dict) -> str:
    """The terminal summary, at most :data:`~compare.tables.TERMINAL_WIDTH` columns: per shape and
    format, one line per T with the best backend, its µs, speedup and % of floor, the worst numerics
    and the statuses; then the notes (each status whole) and the legend. Every backend's row, with
    every column, is in report.md and results.csv."""
    groups: dict = {}
    for r in result["rows"]:
        groups.setdefault((r["shape"], r["quant"]), {}).setdefault(r["T"], []).append(r)
    notes: dict = {}
    cells = {
        key: [
            (str(T), *(f(rows, _best(rows)) for _, f, _ in SUMMARY), _status_cell(rows, notes))
            for T, rows in cases.items()
        ]
        for key, cases in groups.items()
    }
    keep = [i for i in range(len(SUMMARY)) if any(line[1 + i] not in EMPTY for c in cells.values() for line in c)]
    head = ("T", *(SUMMARY[i][0] for i in keep), "status")
    table = {key: [(line[0], *(line[1 + i] for i in keep), line[-1]) for line in c] for key, c in cells.items()}
    widths = [max([len(head[j])] + [len(line[j]) for c in table.values() for line in c]) for j in range(len(head))]

    def fmt(line) -> str:  # numbers right-aligned, names left-aligned
        return (
            "  "
            + "  ".join(c.ljust(w) if h in ("best", "status") else c.rjust(w) for c, w, h in zip(line, widths, head))
        ).rstrip()

    backends = list(dict.fromkeys(r["backend"] for r in result["rows"]))
    out = wrap(
        f"Per shape and format, each T's {len(backends)} backends ({', '.join(backends)}) in one line; every "
        "row with every column: report.md, results.csv"
    ) + [""]
    for (shape, quant), lines in table.items():
        first = next(iter(groups[(shape, quant)].values()))[0]
        sizes = f"E={first['E']}, K={first['K']}, I={first['I']}, top_k={first['top_k']}"
        note = f" — {first['shape_note']}: {sizes}" if first.get("shape_note") else f" ({sizes})"
        out += wrap(f"{shape} · {quant}{note}") + [fmt(head)] + [fmt(line) for line in lines] + [""]
    for n, (status, backends) in enumerate(notes.items(), 1):
        out += wrap(f"[{n}] {', '.join(backends)}: {status}", indent="    ")
    if notes:
        out.append("")
    meanings = [(SUMMARY[i][0], SUMMARY[i][2]) for i in keep]
    meanings.append(
        (
            "status",
            "backends that passed of those in the case; [n]: the note saying why the others "
            f"did not ({STATUS_MEANING})",
        )
    )
    out += legend(meanings, TERMINAL_WIDTH)
    return "\n".join(out)


# --- JSON / CSV ---------------------------------------------------------------------------------


def _jsonable(x):
    if isinstance(x, float):
        return str(x) if math.isnan(x) or math.isinf(x) else float(f"{x:.6g}")
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def to_json(result: dict) -> str:
    """Readable and small: one line per row, case and JIT study; 6 significant digits."""
    parts = []
    for key, value in _jsonable(result).items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            body = ",\n  ".join(json.dumps(v) for v in value)
            parts.append(f"{json.dumps(key)}: [\n  {body}\n ]")
        else:
            parts.append(f"{json.dumps(key)}: {json.dumps(value)}")
    return "{\n " + ",\n ".join(parts) + "\n}"


def to_csv(result: dict) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=ROW_FIELDS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in result["rows"]:
        w.writerow({k: r.get(k) for k in ROW_FIELDS})
    return buf.getvalue()


def write_all(result: dict, out_dir, with_plots: bool = True) -> list:
    """Write results.json, results.csv, report.md and (unless told not to) the plots into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pngs = []
    if with_plots:
        try:
            from compare.plots import plots

            pngs = plots(result, out_dir)
        except ImportError as exc:  # matplotlib is a declared dependency; a missing one costs the plots only
            result["meta"]["plots"] = f"skipped: {exc}"
    written = [out_dir / "results.json", out_dir / "results.csv", out_dir / "report.md"]
    written[0].write_text(to_json(result) + "\n")
    written[1].write_text(to_csv(result))
    written[2].write_text(markdown(result, pngs))
    return written + pngs


def problems(result: dict) -> list:
    """Everything that broke the policy: a kernel's failed numerics (also inside transformers' experts
    module: hf_triton_moe, hf_cute_moe), any backend's crash, kernels that disagree, reruns that differ,
    recompilations, cases the time budget stopped or skipped. A torch baseline (or transformers' own
    hf_grouped_mm) outside the tolerance is not a problem of this project (``_scaled_grouped_mm``
    re-quantizes a bf16 intermediate by design, notes/numerics.md): the table shows it, ``--strict``
    does not fail on it. A kernel of yours (``--backends file.py:fn``) is held to the same policy as this
    project's kernels (a FAIL, or an output farther from ours than the kernels are allowed to be from each
    other); a peer's numerics and reruns are shown, not required (FlashInfer's fused finalize is not
    deterministic by design). Batch invariance is reported, not required (FP8 per tensor cannot have it)."""
    found = []
    for r in result["rows"]:
        case = f"{r['shape']} {r['quant']} T={r['T']} {r['backend']}"
        status = str(r.get("status", ""))
        if status == "FAIL" and (r["backend"] in OUR_KERNELS or is_user_kernel(r["backend"])):
            found.append(f"{case}: numerics {r.get('check')}")
        if status.startswith(("error", "stopped")):
            found.append(f"{case}: {status}")
        if str(r.get("timing", "")).startswith("error"):
            found.append(f"{case}: timing {r['timing']}")
        if r["backend"] in KERNELS and r.get("xdiff_ok") is False:
            found.append(f"{case}: CuTe vs Triton differ by {r['xdiff']:.2e}")
        if is_user_kernel(r["backend"]) and r.get("vs_ours_ok") is False:
            found.append(f"{case}: differs from {r.get('vs_ours_of')} by {r['vs_ours']:.2e}")
        if r.get("deterministic") is False and r["backend"] not in PEERS:
            found.append(f"{case}: not bitwise deterministic on rerun")
    skipped = {
        (r["shape"], r["quant"], r["T"])
        for r in result["rows"]
        if str(r.get("status", "")).startswith("skipped: time budget")
    }
    if skipped:
        found.append(f"{len(skipped)} case(s) not run: the time budget was spent")
    for j in result.get("jit") or []:
        if str(j.get("status", "")).startswith(("FAIL", "error", "stopped")):
            found.append(f"JIT {j['backend']} {j['quant']}: {j['status']}")
    return found

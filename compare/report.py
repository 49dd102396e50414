"""Rendering a suite result: the terminal table, JSON, CSV, the markdown report and the plots.

The JSON (``results.json``, :mod:`compare.results`) is the complete record; everything else is
derived from it, so several runs (e.g. one H200 call per shape) can be merged and re-rendered
without re-running anything. :func:`write_all` writes every file into one directory (the CLI gives
it a staging directory, :mod:`compare.outputs`); :func:`problems` lists what ``--strict`` fails on.

The terminal table keeps one line per (case, backend): a status is shown by its kind with a note
number (``not implemented [2]``), and the notes, whole, follow the table with the meaning of every
column shown.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

from compare.backends import KERNELS, OUR_KERNELS
from compare.markdown import markdown
from compare.peers import PEERS
from compare.plots import FIGURES
from compare.tables import COLUMNS, STATUS_MEANING, legend, shown, status_parts
from compare.userkernel import is_user_kernel

#: Every file a report directory may hold (what a rerun into the same directory replaces).
OUTPUT_FILES = ("results.json", "results.csv", "report.md") + tuple(f"{name}.png" for name in FIGURES)
ROW_FIELDS = ("shape", "shape_note", "E", "K", "I", "top_k", "T", "quant", "backend", "status", "check", "config",
              "rel_l2", "max_abs", "max_ulp", "cosine", "deterministic", "batch_invariant", "xdiff", "xdiff_ok",
              "quant_error", "err_vs_bf16", "flagged_experts", "timing", "us", "p10_us", "p90_us", "prep_us",
              "eager_us", "eager_ratio", "separate_us", "fusion_speedup", "fused_bytes", "separate_bytes",
              "weight_tbps", "tflops", "pct_floor", "floor_us", "bound", "speedup", "vs_ours", "vs_ours_of",
              "vs_ours_ok", "converted")


# --- terminal table -----------------------------------------------------------------------------


def compact_table(result: dict) -> str:
    """One line per (case, backend): numerics, time, config, status; then the notes and the legend."""
    rows = result["rows"]
    columns = shown([c for c in COLUMNS if c.terminal], rows)
    notes: dict = {}
    lines = [("shape", "quant", "T", "backend", *(c.short for c in columns), "status")]
    for r in rows:
        kind, detail = status_parts(r)
        if detail:
            kind += f" [{notes.setdefault(f'{kind}: {detail}', len(notes) + 1)}]"
        lines.append((r["shape"], r["quant"], str(r["T"]), r["backend"], *(c.cell(r) for c in columns), kind))
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    if notes:
        out += [""] + [f"[{n}] {note}" for note, n in notes.items()]
    out += [""] + legend([(c.short, c.meaning) for c in columns] + [("status", STATUS_MEANING)])
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
    skipped = {(r["shape"], r["quant"], r["T"]) for r in result["rows"]
               if str(r.get("status", "")).startswith("skipped: time budget")}
    if skipped:
        found.append(f"{len(skipped)} case(s) not run: the time budget was spent")
    for j in result.get("jit") or []:
        if str(j.get("status", "")).startswith(("FAIL", "error", "stopped")):
            found.append(f"JIT {j['backend']} {j['quant']}: {j['status']}")
    return found

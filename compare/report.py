"""Rendering a suite result: a compact terminal table, JSON, CSV, a markdown report and plots.

The JSON (``results.json``) is the complete record; everything else is derived from it, so several
runs (e.g. one H200 call per shape) can be merged (:func:`merge`) and re-rendered without
re-running anything. The markdown is meant to be read: each section opens with one sentence on
what it shows and how to read it.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import compare.metrics as metrics
from compare.backends import BASELINE, KERNELS

ROW_FIELDS = ("shape", "shape_note", "E", "K", "I", "top_k", "T", "quant", "backend", "status", "check", "config",
              "rel_l2", "max_abs", "max_ulp", "cosine", "deterministic", "xdiff", "xdiff_ok", "quant_error",
              "err_vs_bf16", "flagged_experts", "timing", "us", "p10_us", "p90_us", "prep_us", "weight_tbps",
              "tflops", "pct_floor", "floor_us", "bound", "speedup")


# --- number formatting --------------------------------------------------------------------------


def _num(v, spec: str, missing: str = "-") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return missing
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return format(v, spec)


def _yes(v) -> str:
    return "-" if v is None else ("yes" if v else "NO")


def _short_status(row: dict) -> str:
    s = row.get("status", "")
    return s if len(s) <= 70 else s[:67] + "..."


def _time_cell(row: dict) -> str:
    if row.get("us") is not None:
        return f"{row['us']:.1f}"
    return row.get("timing", "-") if str(row.get("timing", "")).startswith("skipped") else "-"


# --- terminal table -----------------------------------------------------------------------------


def compact_table(result: dict) -> str:
    """One line per (case, backend): numerics, then time, then config and status."""
    head = ("shape", "quant", "T", "backend", "rel_l2", "ulp", "det", "xdiff", "µs", "TB/s", "TFLOP/s", "%floor",
            f"×{BASELINE}", "config", "status")
    lines = [head]
    for r in result["rows"]:
        lines.append((r["shape"], r["quant"], str(r["T"]), r["backend"], _num(r.get("rel_l2"), ".1e"),
                      _num(r.get("max_ulp"), ".1f"), _yes(r.get("deterministic")), _num(r.get("xdiff"), ".1e"),
                      _time_cell(r), _num(r.get("weight_tbps"), ".2f"), _num(r.get("tflops"), ".0f"),
                      _num(r.get("pct_floor"), ".0f"), _num(r.get("speedup"), ".2f"), r.get("config", "")[:44],
                      _short_status(r)))
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
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


def merge(results: list[dict]) -> dict:
    """Several runs' results as one (rows, cases and JIT studies concatenated; meta of the first)."""
    if not results:
        raise ValueError("merge: no results given")
    merged = {k: (v.copy() if isinstance(v, (dict, list)) else v) for k, v in results[0].items()}
    merged["meta"] = dict(results[0]["meta"])
    merged["meta"]["merged_from"] = [r["meta"].get("command", "") for r in results]
    for key in ("rows", "cases", "jit"):
        merged[key] = [x for r in results for x in r.get(key) or []]
    for key in ("jit_demo", "cute_ptx", "ceilings"):
        merged[key] = next((r[key] for r in results if r.get(key)), None)
    merged["meta"]["shapes"] = sorted({r["shape"] for r in merged["rows"]})
    return merged


# --- markdown -----------------------------------------------------------------------------------


def _md_table(head: list, rows: list) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(out)


def _policy_md() -> str:
    rows = []
    for name, t in metrics.TOLERANCES.items():
        rows.append((name, f"{t.rel_l2:g}", f"{t.cosine:g}", _num(t.max_ulp, "g"), _num(t.quant_error, "g"),
                     f"{metrics.cross_backend_tolerance(None if name == 'bf16' else name):g}"))
    return _md_table(["format", "rel L2 ≤", "cosine ≥", "max ULP ≤", "quant error ≤", "CuTe vs Triton ≤"], rows)


def _results_md(result: dict) -> str:
    parts = []
    groups: dict = {}
    for r in result["rows"]:
        groups.setdefault((r["shape"], r["quant"]), []).append(r)
    for (shape, quant), rows in groups.items():
        note = rows[0].get("shape_note")
        dims = f"E={rows[0]['E']}, K={rows[0]['K']}, I={rows[0]['I']}, top_k={rows[0]['top_k']}"
        parts.append(f"#### {shape} · {quant}" + (f" · {note}" if note else "") + f" ({dims})\n")
        table = []
        for r in rows:
            table.append((r["T"], r["backend"], _short_status(r), _num(r.get("rel_l2"), ".2e"),
                          _num(r.get("max_ulp"), ".1f"), _num(r.get("cosine"), ".6f"), _yes(r.get("deterministic")),
                          _num(r.get("xdiff"), ".1e"), _num(r.get("err_vs_bf16"), ".3f"), _time_cell(r),
                          _num(r.get("p10_us"), ".1f") + "–" + _num(r.get("p90_us"), ".1f")
                          if r.get("us") is not None else "-",
                          _num(r.get("prep_us"), ".1f"), _num(r.get("weight_tbps"), ".2f"),
                          _num(r.get("tflops"), ".0f"), _num(r.get("pct_floor"), ".0f"),
                          _num(r.get("speedup"), ".2f"), r.get("config", "")))
        parts.append(_md_table(["T", "backend", "status", "rel L2", "max ULP", "cosine", "bitwise rerun",
                                "CuTe vs Triton", "err vs bf16", "µs (median)", "p10–p90", "align µs",
                                "weight TB/s", "TFLOP/s", "% of floor", f"× {BASELINE}", "config"], table))
        parts.append("")
    return "\n".join(parts)


def _experts_md(result: dict) -> str:
    rows = []
    for c in result["cases"]:
        experts = c["experts"]
        q = [e["quant_error"] for e in experts if e["quant_error"] is not None]
        flagged = [e for e in experts if e["flags"]]
        worst = max(experts, key=lambda e: e["quant_error"] or 0.0) if q else None
        rows.append((c["shape"], c["quant"], c["T"], c["experts_hit"], _num(c.get("quant_error"), ".4f"),
                     _num(c.get("median_expert_quant_error"), ".4f"),
                     f"{worst['expert']}: {worst['quant_error']:.4f}" if worst else "-",
                     "; ".join(f"e{e['expert']} ({', '.join(f'{k}: {v}' for k, v in e['flags'].items())})"
                               for e in flagged[:4]) + (" …" if len(flagged) > 4 else "") or "none"))
    return _md_table(["shape", "quant", "T", "experts hit", "quant error (layer)", "median expert",
                      "worst expert", "flagged"], rows)


def _jit_md(result: dict) -> str:
    parts = []
    if result.get("jit"):
        rows = []
        for j in result["jit"]:
            rows.append((j["backend"], j["shape"], j["quant"], j.get("status", ""),
                         _num(j.get("compilations_after_warmup"), "d"), _num(j.get("first_call_ms_max"), ".2f"),
                         _num(j.get("first_call_ms_median"), ".2f"), _num(j.get("steady_call_ms_median"), ".2f"),
                         j.get("mode", "")))
        parts.append(_md_table(["backend", "shape", "quant", "status", "compilations after warm-up",
                                "first call of a new T, max ms", "median ms", "steady call ms", "mode"], rows))
        sweep = result["jit"][0].get("sweep_T")
        parts.append(f"\nWarm-up: T = 1, 2, 4, …, 4096; then the never-seen T = {sweep}.\n")
    demo = result.get("jit_demo")
    if demo:
        parts.append(f"**The same Triton kernel, two ways** (`compare/jitdemo.py`, {demo['mode']}), T swept over "
                     f"{demo['sweep']}:\n")
        rows = []
        for name, v in demo["variants"].items():
            if "error" in v:
                rows.append((name, v["error"], "-", "-"))
                continue
            compiled_at = [p["T"] for p in v["per_T"] if p["compiled"]]
            rows.append((name, v["compilations"], ", ".join(map(str, compiled_at)),
                         _num(v.get("worst_first_call_ms"), ".1f")))
        parts.append(_md_table(["variant", "compilations", "compiled at T =", "worst first call (ms)"], rows))
    return "\n".join(parts) if parts else "JIT study not run (--no-jit)."


def _ptx_md(result: dict) -> str:
    ptx = result.get("cute_ptx")
    if not ptx:
        return ""
    if ptx.get("status") != "ok":
        return f"CuTe configs: {ptx['status']}\n"
    rows = []
    for c in ptx["configs"]:
        cfg = c["config"]
        tile = (f"{'swap-AB' if cfg.get('swap_ab') else 'normal'} M{cfg.get('tile_m')}×N{cfg.get('tile_n')}"
                f"×K{cfg.get('tile_k')}, {cfg.get('stages')} stages"
                + (", routing weight in the epilogue" if cfg.get("row_scale") else "")
                if isinstance(cfg, dict) else cfg)
        wg = "<br>".join(f"`{op}` ×{n}" for op, n in (c.get("wgmma") or {}).items()) or c.get("error", "-")
        used = ", ".join(c["used_by"][:3]) + (f" (+{len(c['used_by']) - 3})" if len(c["used_by"]) > 3 else "")
        rows.append((tile, wg, used, _num(c.get("compile_s"), ".1f")))
    return ("The configs `cute_moe` chooses for the GPU suite, compiled here on the CPU; the WGMMA "
            "instructions in their PTX show the tile each warpgroup issues (m64nNk16 for bf16: N is the "
            "token tile under swap-AB).\n\n"
            + _md_table(["config", "WGMMA instructions in the PTX", "used by", "compile s"], rows))


def _router_md(result: dict) -> str:
    from compare.router import build_table

    table = build_table(result["rows"], result["meta"])
    if not table["entries"]:
        return "No timed, correct rows: nothing to route (timing needs a GPU)."
    rows = [(e["shape"], e["quant"], e["T"], f"**{e['backend']}**",
             ", ".join(f"{b} {us:.1f}" for b, us in sorted(e["us"].items(), key=lambda kv: kv[1])))
            for e in table["entries"]]
    return _md_table(["shape", "quant", "T", "fastest correct", "candidates (µs)"], rows)


def markdown(result: dict, plots: list) -> str:
    m = result["meta"]
    ceil = result.get("ceilings")
    lines = [f"# MoE kernels compared: {m['device']}", "",
             f"- date: {m['date']}", f"- commit: `{m['commit']}`", f"- command: `{m['command']}`",
             f"- mode: {m['mode']}; torch {m['torch']}, triton {m['triton']}",
             f"- backends: {', '.join(m['backends'])}"]
    if m.get("merged_from"):
        lines.append(f"- merged from: {'; '.join(f'`{c}`' for c in m['merged_from'])}")
    if m.get("outlier_expert"):
        lines.append(f"- **outlier demo**: expert 0's W1 scaled by {m['outlier_expert']:g}")
    lines.append("")
    if ceil:
        lines += ["## Ceilings measured at the start of this run", "",
                  f"Copy bandwidth {ceil['copy_tbps']:.2f} TB/s (read + write); bf16 matmul "
                  f"{ceil['bf16_tflops']:.0f} TFLOP/s; fp8 matmul {_num(ceil.get('fp8_tflops'), '.0f')} TFLOP/s. "
                  "Every row's floor is max(bytes / bandwidth, FLOPs / rate) with these numbers, and "
                  "\"% of floor\" = floor / measured.", ""]
    else:
        lines += ["Timing: **skipped: no GPU**. Numerics ran through the Triton interpreter on reduced shapes "
                  "(E ≤ 8, top_k ≤ 4, K = 256, I = 128), labelled \"reduced (CPU interpreter)\".", ""]
    lines += ["## Results", "",
              "Numerics are against the fp64 oracle on each backend's own inputs (FP8: the quantized problem); "
              "\"err vs bf16\" is the same output against the unquantized problem (what a user sees). Time is the "
              "median of CUDA-graph replays over rotated input sets (cold L2); \"align µs\" is the "
              "alignment/permutation step timed alone (it is included in the total). Weight TB/s counts the "
              "weights of the experts that received tokens.", "", _results_md(result), "",
              "## Tolerance policy", "", "Reasoning in `notes/numerics.md`.", "", _policy_md(), "",
              "## Quantization error and per-expert check", "",
              "Quantization error is the oracle on the quantized problem against the oracle on the bf16 problem, "
              "for the layer and per expert (exact, from the oracle's per-(token, slot) outputs). A backend's error "
              "is attributed to an expert through the tokens routed to it. An expert is flagged when it stands out "
              "(over 3× (quant) or 4× (kernel) the median expert) or exceeds the format's bound.", "",
              _experts_md(result), "",
              "## JIT: compilations and first-call latency", "", _jit_md(result), ""]
    ptx = _ptx_md(result)
    if ptx:
        lines += ["## CuTe configs and their PTX", "", ptx, ""]
    lines += ["## Router", "", "Per case, the fastest backend that passed the tolerance policy "
              "(`compare.router.choose_backend`, `compare.router.fused_moe(..., backend=\"auto\")`).", "",
              _router_md(result), ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    return "\n".join(lines)


# --- plots --------------------------------------------------------------------------------------

_MARKERS = {"cute_moe": "o", "triton_moe": "s", "torch_grouped": "^", "torch_loop": "x"}


def plots(result: dict, out_dir: Path) -> list:
    """PNG files: numerics (always); roofline position and speedup vs the baseline (when timed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    rows = [r for r in result["rows"] if r.get("rel_l2") is not None]
    if rows:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        labels = sorted({(r["shape"], r["quant"], r["T"]) for r in rows}, key=lambda k: (k[0], k[1], k[2]))
        index = {k: i for i, k in enumerate(labels)}
        for name in _MARKERS:
            pts = [(index[(r["shape"], r["quant"], r["T"])], max(r["rel_l2"], 1e-8)) for r in rows
                   if r["backend"] == name]
            if pts:
                ax.scatter(*zip(*pts), marker=_MARKERS[name], label=name)
        for q in sorted({r["quant"] for r in rows}):
            ax.axhline(metrics.tolerance_for(None if q == "bf16" else q).rel_l2, ls="--", lw=0.8, color="gray")
        ax.set_yscale("log")
        ax.set_xticks(range(len(labels)), [f"{s} {q} T={t}" for s, q, t in labels], rotation=90, fontsize=6)
        ax.set_ylabel("relative L2 error vs fp64 oracle")
        ax.set_title("Numerics (dashed: tolerance per format)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(out_dir / "numerics.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

    timed = [r for r in result["rows"] if r.get("us")]
    ceil = result.get("ceilings")
    if timed and ceil:
        fig, ax = plt.subplots(figsize=(7, 5))
        xs = [10 ** (i / 10) for i in range(-10, 41)]
        for label, rate, style in (("bf16", ceil["bf16_tflops"], "-"), ("fp8", ceil.get("fp8_tflops"), "--")):
            if rate:
                ax.plot(xs, [min(rate, x * ceil["copy_tbps"]) for x in xs], style, color="gray", lw=1,
                        label=f"roof {label}")
        for name, marker in _MARKERS.items():
            pts = [(r["tflops"] / (r["weight_tbps"] or 1e-12) if r.get("weight_tbps") else None, r["tflops"])
                   for r in timed if r["backend"] == name]
            pts = [p for p in pts if p[0]]
            if pts:
                ax.scatter(*zip(*pts), marker=marker, label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("FLOPs per weight byte")
        ax.set_ylabel("achieved TFLOP/s")
        ax.set_title(f"Roofline position of every run ({result['meta']['device']})")
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(out_dir / "roofline.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

        groups = sorted({(r["shape"], r["quant"]) for r in timed})
        fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups), 3.4), squeeze=False, sharey=True)
        for ax, (shape, quant) in zip(axes[0], groups):
            for name, marker in _MARKERS.items():
                pts = sorted((r["T"], r["speedup"]) for r in timed
                             if r["backend"] == name and r["shape"] == shape and r["quant"] == quant and r.get("speedup"))
                if pts:
                    ax.plot(*zip(*pts), marker=marker, label=name)
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{shape}\n{quant}", fontsize=8)
            ax.set_xlabel("T")
        axes[0][0].set_ylabel(f"speedup vs {BASELINE}")
        axes[0][-1].legend(fontsize=6)
        fig.tight_layout()
        written.append(out_dir / "speedup.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def write_all(result: dict, out_dir, with_plots: bool = True) -> list:
    """Write results.json, results.csv, report.md and (unless told not to) the plots into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "results.json", out_dir / "results.csv"]
    written[0].write_text(to_json(result) + "\n")
    written[1].write_text(to_csv(result))
    pngs = []
    if with_plots:
        try:
            pngs = plots(result, out_dir)
        except ImportError as exc:  # matplotlib is a declared dependency; a missing one costs the plots only
            result["meta"]["plots"] = f"skipped: {exc}"
    report = out_dir / "report.md"
    report.write_text(markdown(result, pngs))
    return written + [report] + pngs


def problems(result: dict) -> list:
    """Everything that broke the policy: a kernel's failed numerics, any backend's crash, kernels that
    disagree, reruns that differ, recompilations. A torch baseline outside the tolerance is not a
    problem of this project (``_scaled_grouped_mm`` re-quantizes a bf16 intermediate by design,
    notes/numerics.md): the table shows it, ``--strict`` does not fail on it."""
    found = []
    for r in result["rows"]:
        case = f"{r['shape']} {r['quant']} T={r['T']} {r['backend']}"
        status = str(r.get("status", ""))
        if status == "FAIL" and r["backend"] in KERNELS:
            found.append(f"{case}: numerics {r.get('check')}")
        if status.startswith("error"):
            found.append(f"{case}: {status}")
        if str(r.get("timing", "")).startswith("error"):
            found.append(f"{case}: timing {r['timing']}")
        if r["backend"] in KERNELS and r.get("xdiff_ok") is False:
            found.append(f"{case}: CuTe vs Triton differ by {r['xdiff']:.2e}")
        if not r.get("deterministic", True):
            found.append(f"{case}: not bitwise deterministic on rerun")
    for j in result.get("jit") or []:
        if str(j.get("status", "")).startswith(("FAIL", "error")):
            found.append(f"JIT {j['backend']} {j['quant']}: {j['status']}")
    return found

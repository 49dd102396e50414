"""``report.md``: a suite result written to be read.

It opens with the banner (:func:`compare.tables.banner`: what the run did not do), then the run's
metadata and ceilings, then one section per question — results, tolerance policy, quantization
error per expert, JIT, CuTe PTX (CPU), router, plots — each opening with one sentence on what it
shows and how to read it. Statuses are written whole; a column empty in every row of a table is
left out; every column is explained once, under the results.
"""

from __future__ import annotations

from pathlib import Path

import compare.metrics as metrics
from compare.tables import (
    COLUMNS,
    EMPTY,
    PTX_SECTION,
    STATUS_MEANING,
    banner,
    batch_notes,
    full_status,
    num,
    shown,
    text,
)


def _md_table(head: list, rows: list, keep: int = 0) -> str:
    """A markdown table; with ``keep``, the columns after the first ``keep`` that are empty in every
    row are left out."""
    if keep:
        cols = [i for i in range(len(head)) if i < keep or any(str(row[i]) not in EMPTY for row in rows)]
        head, rows = [head[i] for i in cols], [[row[i] for i in cols] for row in rows]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(out)


def _policy_md() -> str:
    rows = []
    for name, t in metrics.TOLERANCES.items():
        rows.append(
            (
                name,
                f"{t.rel_l2:g}",
                f"{t.cosine:g}",
                num(t.max_ulp, "g"),
                num(t.quant_error, "g"),
                f"{metrics.cross_backend_tolerance(None if name == 'bf16' else name):g}",
            )
        )
    head = ["format", "rel L2 ≤", "cosine ≥", "max ULP ≤", "quant error ≤", "CuTe vs Triton ≤"]
    return _md_table(head, rows)


def _results_md(result: dict) -> str:
    parts, used = [], []
    groups: dict = {}
    for r in result["rows"]:
        groups.setdefault((r["shape"], r["quant"]), []).append(r)
    for (shape, quant), rows in groups.items():
        note = rows[0].get("shape_note")
        dims = f"E={rows[0]['E']}, K={rows[0]['K']}, I={rows[0]['I']}, top_k={rows[0]['top_k']}"
        parts.append(f"#### {shape} · {quant}" + (f" · {note}" if note else "") + f" ({dims})\n")
        columns = shown(COLUMNS, rows)
        used += [c for c in columns if c not in used]
        table = [(r["T"], r["backend"], full_status(r), *(c.cell(r) for c in columns)) for r in rows]
        parts.append(_md_table(["T", "backend", "status", *(c.long for c in columns)], table))
        parts.append("")
    ordered_used = [c for c in COLUMNS if c in used]
    parts.append(
        "Columns: " + "; ".join(f"**{c.long}**: {c.meaning}" for c in ordered_used) + f"; **status**: {STATUS_MEANING}."
    )
    parts += [f"\n{line}" for line in batch_notes(result["rows"])]
    return "\n".join(parts)


def _results_intro(result: dict) -> str:
    """What the results tables hold: numerics always; time only when this run timed something."""
    rows = result["rows"]
    text_ = "Numerics are against the fp64 oracle on each backend's own inputs (FP8: the quantized problem). "
    if any(isinstance(r.get("us"), (int, float)) for r in rows):
        text_ += "Time is the median of CUDA-graph replays over rotated input sets (cold L2)."
    else:
        text_ += (
            "Nothing was timed in this run (no GPU): the tables hold numerics only, and every row's timing "
            'field in results.json and results.csv says why (e.g. "skipped: no GPU"); a GPU run adds the '
            "µs, roofline and speedup columns."
        )
    if any(r.get("shape_note") for r in rows):
        text_ += (
            " The shapes are REDUCED for the Triton interpreter: each section's heading gives the sizes that "
            "ran, and the shape's name says only which catalog shape they stand for."
        )
    return text_


def _experts_md(result: dict) -> str:
    rows = []
    for c in result["cases"]:
        experts = c.get("experts") or []
        q = [e["quant_error"] for e in experts if e.get("quant_error") is not None]
        flagged = [e for e in experts if e.get("flags")]
        worst = max(experts, key=lambda e: e.get("quant_error") or 0.0) if q else None
        if flagged:
            flags = "; ".join(
                f"e{e['expert']} ({', '.join(f'{k}: {v}' for k, v in e['flags'].items())})" for e in flagged[:4]
            ) + (" …" if len(flagged) > 4 else "")
        elif c.get("flagged_experts"):  # a record that kept the ids only
            flags = ", ".join(f"e{i}" for i in c["flagged_experts"])
        else:
            flags = "none"
        rows.append(
            (
                c["shape"],
                c["quant"],
                c["T"],
                c.get("experts_hit", "-"),
                num(c.get("quant_error"), ".4f"),
                num(c.get("median_expert_quant_error"), ".4f"),
                f"{worst['expert']}: {worst['quant_error']:.4f}" if worst else "-",
                flags,
            )
        )
    return _md_table(
        ["shape", "quant", "T", "experts hit", "quant error (layer)", "median expert", "worst expert", "flagged"],
        rows,
        keep=4,
    )


def _jit_md(result: dict) -> str:
    parts = []
    if result.get("jit"):
        rows = []
        for j in result["jit"]:
            w = j.get("warmup") or {}
            dry = str(w.get("mode", "")).startswith("dry run")
            at = f" (T = {j['first_call_ms_max_at_T']})" if j.get("first_call_ms_max_at_T") is not None else ""
            rows.append(
                (
                    j["backend"],
                    j["shape"],
                    j["quant"],
                    j.get("status", ""),
                    num(w.get("compiled"), "d"),
                    "dry run" if dry else num(w.get("seconds"), ".2f"),
                    num(j.get("compilations_after_warmup"), "d"),
                    num(j.get("first_call_ms_max"), ".2f") + at,
                    num(j.get("first_call_ms_median"), ".2f"),
                    num(j.get("second_call_ms_median"), ".2f"),
                )
            )
        parts.append(
            _md_table(
                [
                    "backend",
                    "shape",
                    "quant",
                    "status",
                    "kernels the warm-up compiled",
                    "warm-up s",
                    "compilations after warm-up",
                    "first call of a new T, max ms",
                    "median ms",
                    "second call ms",
                ],
                rows,
                keep=4,
            )
        )
        sweep = next((j["sweep_T"] for j in result["jit"] if j.get("sweep_T")), None)
        if sweep:
            parts.append(
                f"\nEach case in a fresh process with empty Triton and CuTe caches: the backend's "
                f"`warmup(E, K, I, top_k, quant, max_tokens={sweep[1]})`, then {sweep[2]} token counts "
                f"T = {sweep[0]} … {sweep[1]} never seen before (powers of two, 2ᵏ ± 1, odd values between; "
                "`python -m compare.warm_study` for the whole study). A CPU run counts the keys Triton would "
                "compile (dry run) and compiles the CuTe kernels to PTX.\n"
            )
    demo = result.get("jit_demo")
    if demo and "variants" not in demo:
        parts.append(f"`do_not_specialize` demo: {demo.get('status', 'not run')}")
    elif demo:
        parts.append(
            f"**The same Triton kernel, two ways** (`compare/jitdemo.py`, {demo['mode']}), T swept over "
            f"{demo['sweep']}:\n"
        )
        rows = []
        for name, v in demo["variants"].items():
            if "error" in v:
                rows.append((name, v["error"], "-", "-"))
                continue
            compiled_at = [p["T"] for p in v["per_T"] if p["compiled"]]
            rows.append(
                (name, v["compilations"], ", ".join(map(str, compiled_at)), num(v.get("worst_first_call_ms"), ".1f"))
            )
        parts.append(_md_table(["variant", "compilations", "compiled at T =", "worst first call (ms)"], rows, keep=1))
    return "\n".join(parts) if parts else "JIT study not run (--no-jit)."


def _old_tile_text(cfg) -> str:
    """A config of a record written before the listing kept the backend's own description."""
    if not isinstance(cfg, dict):
        return str(cfg)
    return (
        f"{'swap-AB' if cfg.get('swap_ab') else 'normal'} M{cfg.get('tile_m')}×N{cfg.get('tile_n')}"
        f"×K{cfg.get('tile_k')}, {cfg.get('stages')} stages"
        + (", routing weight in the epilogue" if cfg.get("row_scale") else "")
    )


def _ptx_md(result: dict) -> str:
    ptx = result.get("cute_ptx")
    if not ptx:
        return ""
    if ptx.get("status") != "ok":
        return f"CuTe configs: {ptx.get('status')}\n"
    rows = []
    for c in ptx["configs"]:
        tile = c.get("describe") or _old_tile_text(c["config"])
        wg = "<br>".join(f"`{op}` ×{n}" for op, n in (c.get("wgmma") or {}).items()) or c.get("error", "-")
        used = ", ".join(c["used_by"][:3]) + (f" (+{len(c['used_by']) - 3})" if len(c["used_by"]) > 3 else "")
        rows.append((tile, wg, used, num(c.get("compile_s"), ".1f")))
    return (
        "The configs `cute_moe` chooses for the GPU suite (full catalog shapes, not the reduced ones), "
        "compiled here on the CPU; the WGMMA instructions in their PTX show the tile each warpgroup issues "
        "(m64nNk16 for bf16, m64nNk32 for FP8: N is the token tile under swap-AB). Each config is named as the "
        "results' config column names it (`cute_moe.plan(...).describe()`: W weight rows and T tokens per tile, "
        "k the K step, s the pipeline stages, then silu, gather, epi:… (the intermediate's quantization in "
        "GEMM1's epilogue), pingpong or clusterN where they apply; the config column's FP8 plans end in "
        "`xq:gather` where x is quantized where its rows are gathered).\n\n"
        + _md_table(["config", "WGMMA instructions in the PTX", "used by", "compile s"], rows)
        + "".join(f"\n`cute_moe.plan` refuses {q}: {why}\n" for q, why in (ptx.get("refused") or {}).items())
    )


def _router_md(result: dict) -> str:
    from compare.router import build_table

    table = build_table(result["rows"], result["meta"])
    if not table["entries"]:
        return "No timed, correct rows: nothing to route (timing needs a GPU)."
    rows = [
        (
            e["shape"],
            e["quant"],
            e["T"],
            f"**{e['backend']}**",
            ", ".join(f"{b} {us:.1f}" for b, us in sorted(e["us"].items(), key=lambda kv: kv[1])),
        )
        for e in table["entries"]
    ]
    return _md_table(["shape", "quant", "T", "fastest correct", "candidates (µs)"], rows)


def _ceilings_md(result: dict) -> list[str]:
    ceilings = result.get("ceilings")
    if not ceilings:
        return []
    lines = ["## Ceilings measured at the start of the run", ""]
    for ceil in ceilings if isinstance(ceilings, list) else [ceilings]:
        lines.append(
            f"{ceil.get('device', '')}: copy bandwidth {num(ceil.get('copy_tbps'), '.2f')} TB/s (read + "
            f"write); bf16 matmul {num(ceil.get('bf16_tflops'), '.0f')} TFLOP/s; fp8 matmul "
            f"{num(ceil.get('fp8_tflops'), '.0f')} TFLOP/s."
        )
    return lines + [
        "",
        "Every row's floor is max(bytes / bandwidth, FLOPs / rate) with these numbers, and "
        '"% of floor" = floor / measured.',
        "",
    ]


def markdown(result: dict, plots: list) -> str:
    m = result["meta"]
    lines = [f"# MoE kernels compared: {text(m.get('device', '?'))}", ""]
    lines += [line if line.startswith("* ") else f"**{line}**" for line in banner(result, "below")] + [""]
    lines += [
        f"- date: {text(m.get('date', '?'))}",
        f"- commit: `{text(m.get('commit', '?'))}`",
        f"- command: `{text(m.get('command', '?'))}`",
        f"- mode: {text(m.get('mode', '?'))}; torch {text(m.get('torch', '?'))}, triton {text(m.get('triton', '?'))}",
        f"- backends: {', '.join(map(str, m.get('backends') or []))}",
    ]
    if m.get("merged_from"):
        lines.append(f"- merged from: {'; '.join(f'`{c}`' for c in m['merged_from'])}")
    if m.get("outlier_expert"):
        lines.append(f"- **outlier demo**: expert 0's W1 scaled by {text(m['outlier_expert'])}")
    lines += [f"- note: {n}" for n in result.get("notes") or []] + [""]
    lines += _ceilings_md(result)
    lines += [
        "## Results",
        "",
        _results_intro(result),
        "",
        _results_md(result),
        "",
        "## Tolerance policy",
        "",
        "Reasoning in `notes/numerics.md`.",
        "",
        _policy_md(),
        "",
        "## Quantization error and per-expert check",
        "",
        "Quantization error is the oracle on the quantized problem against the oracle on the bf16 problem, "
        "for the layer and per expert (exact, from the oracle's per-(token, slot) outputs). A backend's error "
        "is attributed to an expert through the tokens routed to it. An expert is flagged when it stands out "
        "(over 3× (quant) or 4× (kernel) the median expert) or exceeds the format's bound.",
        "",
        _experts_md(result),
        "",
        "## JIT: compilations and first-call latency",
        "",
        _jit_md(result),
        "",
    ]
    ptx = _ptx_md(result)
    if ptx:
        lines += [f"## {PTX_SECTION}", "", ptx, ""]
    lines += [
        "## Router",
        "",
        "Per case, the fastest backend that passed the tolerance policy "
        '(`compare.router.choose_backend`, `compare.router.fused_moe(..., backend="auto")`).',
        "",
        _router_md(result),
        "",
    ]
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    return "\n".join(lines)

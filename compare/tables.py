"""What a reader is shown: the banner that says what a run did, and the columns of its tables.

Shared by the terminal table (:mod:`compare.report`) and the markdown report
(:mod:`compare.markdown`), so that both say the same thing in the same words:

* :func:`banner` — the first lines of stdout and of ``report.md``: what this run did *not* do
  (reduced shapes, a kernel that did not run, an equivalence not checked, timing skipped, a time
  budget spent) and where the CuTe PTX listing is;
* :data:`COLUMNS` — every numeric column with its header and a one-line explanation, printed once
  under each table for the columns it shows; a column empty in every row is not shown;
* :func:`status_parts` — a status split into its kind (ok, FAIL, not implemented, not available,
  error, skipped, stopped) and its detail, never truncated.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

from compare.backends import BASELINE, FALLBACK_BASELINE, KERNELS
from compare.cases import REDUCED_MAX_TOP_K

EMPTY = ("-", "")
PTX_SECTION = "CuTe configs and their PTX"
FULL_PTX_COMMAND = "python -m cute_moe.lab.explore --tokens-per-expert 2 --ptx-file kernel.ptx"


def num(v, spec: str, missing: str = "-") -> str:
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
        return missing
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return format(v, spec)


def yes(v) -> str:
    return "-" if v is None else ("yes" if v else "NO")


def text(v) -> str:
    """A metadata value; a merged record holds a list where its inputs differ."""
    return " + ".join(map(str, v)) if isinstance(v, list) else str(v)


def ordered(values) -> list:
    return list(dict.fromkeys(values))


def status_parts(row: dict) -> tuple[str, str]:
    """(kind, detail): "FAIL" with the failed bounds, "not implemented" with the backend's words, …"""
    status = str(row.get("status", ""))
    if status == "FAIL":
        return "FAIL", str(row.get("check", ""))
    kind, sep, detail = status.partition(": ")
    return (kind, detail) if sep else (status, "")


def full_status(row: dict) -> str:
    kind, detail = status_parts(row)
    return f"{kind}: {detail}" if detail else kind


# --- columns -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    short: str  # terminal header
    long: str  # markdown header
    cell: Callable[[dict], str]
    meaning: str
    terminal: bool = True


def _spread(r: dict) -> str:
    return f"{num(r.get('p10_us'), '.1f')}–{num(r.get('p90_us'), '.1f')}" if r.get("p10_us") is not None else "-"


def _pair_mb(fused, separate) -> str:
    return "-" if fused is None else f"{num(fused / 1e6, '.1f')} / {num(separate / 1e6, '.1f')}"


COLUMNS = (
    Column(
        "rel_l2",
        "rel L2",
        lambda r: num(r.get("rel_l2"), ".2e"),
        "relative L2 error against the fp64 oracle on the backend's own (for FP8: quantized) inputs",
    ),
    Column(
        "ulp",
        "max ULP",
        lambda r: num(r.get("max_ulp"), ".1f"),
        "the worst element's error in bf16 ULPs of the reference (magnitude floored at its RMS)",
    ),
    Column(
        "cosine",
        "cosine",
        lambda r: num(r.get("cosine"), ".6f"),
        "cosine similarity with the oracle's output",
        terminal=False,
    ),
    Column(
        "det",
        "bitwise rerun",
        lambda r: yes(r.get("deterministic")),
        "a second call on the same inputs gave the same bits",
    ),
    Column(
        "batch",
        "batch-invariant",
        lambda r: yes(r.get("batch_invariant")),
        "the batch's first and last token, each run alone (T = 1), gave the same bits as inside the "
        "batch ('-' at T = 1); a NO is explained under the results (expected for fp8_tensor and torch_loop)",
    ),
    Column(
        "xdiff",
        "CuTe vs Triton",
        lambda r: num(r.get("xdiff"), ".1e"),
        f"relative L2 difference between the {KERNELS[0]} and {KERNELS[1]} outputs (bound: twice the "
        "format's tolerance)",
    ),
    Column(
        "vs ours",
        "vs ours",
        lambda r: num(r.get("vs_ours"), ".1e"),
        "a kernel from outside this project (yours, a peer's): relative L2 difference from cute_moe's output "
        "(triton_moe's where cute_moe did not run) on the same inputs (bound: twice the format's tolerance)",
    ),
    Column(
        "vs_bf16",
        "err vs bf16",
        lambda r: num(r.get("err_vs_bf16"), ".3f"),
        "the output against the unquantized bf16 problem: quantization and kernel error together",
        terminal=False,
    ),
    Column(
        "µs",
        "µs (median)",
        lambda r: num(r.get("us"), ".1f"),
        "median time of one fused_moe call: CUDA-graph replays over rotated input sets (cold L2)",
    ),
    Column("p10–p90", "p10–p90", _spread, "10th and 90th percentile of the replays, µs", terminal=False),
    Column(
        "align",
        "align µs",
        lambda r: num(r.get("prep_us"), ".1f"),
        "the alignment/permutation step timed alone (included in µs)",
        terminal=False,
    ),
    Column(
        "eager",
        "eager µs",
        lambda r: num(r.get("eager_us"), ".1f"),
        "median µs per call of plain back-to-back calls (no graph; one synchronization per repeat): "
        "what a caller without CUDA graphs pays, host work included",
    ),
    Column(
        "×graph",
        "eager / graph",
        lambda r: num(r.get("eager_ratio"), ".2f"),
        "eager µs over the graph replay's µs: 1.0 when the host keeps up with the GPU",
        terminal=False,
    ),
    Column(
        "comp",
        "compiled µs",
        lambda r: num(r.get("compiled_us"), ".1f") if "compiled_note" not in r else r["compiled_note"].split(":")[0],
        "the hf backends with --hf-compiled: the same call with transformers' experts module under "
        "torch.compile(fullgraph=True), timed as eager µs is (the JSON's compiled_rel_l2: its output against "
        "the eager call's)",
        terminal=False,
    ),
    Column(
        "×eager",
        "compiled / eager",
        lambda r: num(r.get("compiled_ratio"), ".2f"),
        "compiled µs over eager µs: below 1 where compiling the module saves host time",
        terminal=False,
    ),
    Column(
        "sep",
        "separate µs",
        lambda r: num(r.get("separate_us"), ".1f"),
        'the same backend with scaling and aggregation as separate passes (cute_moe fusion="separate"), CUDA-graph µs',
        terminal=False,
    ),
    Column(
        "fused×",
        "fused speedup",
        lambda r: num(r.get("fusion_speedup"), ".3f"),
        "separate µs / fused µs: what fusing the scales and the routing weight into the GEMM buys",
        terminal=False,
    ),
    Column(
        "MB f/s",
        "MB fused / separate",
        lambda r: _pair_mb(r.get("fused_bytes"), r.get("separate_bytes")),
        "HBM traffic of the two pipelines, analytic from the shapes (MB)",
        terminal=False,
    ),
    Column(
        "TB/s",
        "weight TB/s",
        lambda r: num(r.get("weight_tbps"), ".2f"),
        "bytes of the weights of the experts that received tokens, per second",
    ),
    Column("TFLOP/s", "TFLOP/s", lambda r: num(r.get("tflops"), ".0f"), "the expert computation's FLOPs per second"),
    Column(
        "%floor",
        "% of floor",
        lambda r: num(r.get("pct_floor"), ".0f"),
        "the roofline floor (max of bytes / bandwidth and FLOPs / rate, this run's ceilings) as a % of µs",
    ),
    Column(
        f"×{BASELINE}",
        f"× {BASELINE}",
        lambda r: num(r.get("speedup"), ".2f"),
        f"speedup over {BASELINE} (over {FALLBACK_BASELINE} where {BASELINE} was not timed)",
    ),
    Column(
        "config",
        "config",
        lambda r: str(r.get("config") or ""),
        "the tile configuration the backend chose ('-': a kernel from outside this project exposes none)",
    ),
    Column(
        "converted",
        "converted",
        lambda r: str(r.get("converted") or ""),
        "what the adapter converted from the contract's inputs before calling a kernel from outside this project "
        "(done once per input set, outside the timed region, unless it says otherwise)",
        terminal=False,
    ),
)

STATUS_MEANING = (
    "ok / FAIL (outside the tolerance policy of notes/numerics.md) / not implemented (the backend "
    "declines the format) / not available (cannot run on this machine) / error / skipped or stopped "
    "(time budget)"
)


#: Why a backend's output can depend on the rest of the batch by design, per (backend or format).
BATCH_CAUSES = {
    "fp8_tensor": "the activation scale is one per tensor, the batch's amax: a token alone is quantized with its "
    "own amax, so its bits differ (every backend of this format, the fp32 torch_loop reference too, "
    "which models the same W8A8 quantization)",
    "torch_loop": "one matmul per expert over the rows routed to it: their number changes with the batch, and the "
    "BLAS library picks its kernel, and so its summation order, by the matrix sizes",
}


def batch_cause(row: dict) -> str:
    """Which of :data:`BATCH_CAUSES` explains a row that is not batch-invariant ("" when none does: a finding)."""
    if row.get("quant") == "fp8_tensor":
        return "fp8_tensor"
    return "torch_loop" if row.get("backend") == "torch_loop" else ""


def batch_notes(rows: list[dict]) -> list[str]:
    """One line per cause of the rows whose batch-invariance is NO: the expected ones with their reason,
    the others (a kernel whose bits depend on the batch) named as such."""
    causes: dict = {}
    for r in rows:
        if r.get("batch_invariant") is False:
            causes.setdefault(batch_cause(r), []).append(r)
    lines = []
    for cause, found in causes.items():
        where = ", ".join(ordered(f"{r['backend']} {r['quant']}" for r in found))
        if cause:
            lines.append(f"batch-invariant NO in {len(found)} row(s) ({where}): expected — {BATCH_CAUSES[cause]}.")
        else:
            lines.append(
                f"batch-invariant NO in {len(found)} row(s) ({where}): not explained by the format or by "
                "a per-expert matmul — this backend's bits depend on the rest of the batch."
            )
    return lines


def shown(columns, rows: list[dict]) -> list:
    """The columns with at least one non-empty cell."""
    return [c for c in columns if any(c.cell(r) not in EMPTY for r in rows)]


def legend(pairs, width: int = 0) -> list[str]:
    """One line per (header, meaning), the meanings aligned; with ``width``, each wrapped to it."""
    head = max((len(h) for h, _ in pairs), default=0)
    lines = [f"{h.ljust(head)}  {meaning}" for h, meaning in pairs]
    return [part for line in lines for part in wrap(line, width, " " * (head + 2))] if width else lines


#: The terminal output's width: every line the CLI prints fits it (the full tables are in report.md).
TERMINAL_WIDTH = 120


def wrap(line: str, width: int = TERMINAL_WIDTH, indent: str = "  ") -> list[str]:
    """``line`` as lines of at most ``width`` characters, continuation lines indented; a word longer
    than the width (a long path) is kept whole on its own line."""
    if len(line) <= width:
        return [line]
    return textwrap.wrap(line, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


# --- the banner ----------------------------------------------------------------------------------


def _count_cases(rows) -> int:
    return len({(r["shape"], r["quant"], r["T"]) for r in rows})


def _same_sizes(reduced: dict) -> str:
    """When every reduced shape has the same E, K and I, say that their cases differ only in top_k."""
    sizes = {(r["E"], r["K"], r["I"]) for r in reduced.values()}
    if len(sizes) != 1:
        return ""
    ((E, K, I),) = sizes  # noqa: E741
    rule = f"every catalog shape becomes E={E}, K={K}, I={I} here, top_k = min(its own, {REDUCED_MAX_TOP_K})"
    if len(reduced) == 1:
        return f" ({rule})"
    return f" — {rule}: these shapes' cases differ at most in top_k and in the random problem drawn"


def banner(result: dict, ptx_where: str) -> list[str]:
    """What this run is, and everything it did not do, as lines (``ptx_where``: where the report's
    PTX section is, e.g. a path to report.md, or "below")."""
    m, rows = result["meta"], result["rows"]
    lines = [
        f"What this run did — {text(m.get('device', '?'))}, {text(m.get('date', '?'))}, "
        f"commit {text(m.get('commit', '?'))}:"
    ]
    reduced = {r["shape"]: r for r in rows if r.get("shape_note")}
    if reduced:
        lines.append(
            "* shapes REDUCED for the Triton interpreter (no GPU): "
            + "; ".join(f"{s} → E={r['E']}, top_k={r['top_k']}, K={r['K']}, I={r['I']}" for s, r in reduced.items())
            + _same_sizes(reduced)
        )
    backends = ordered(r["backend"] for r in rows)

    def ran(backend):
        return any(r["backend"] == backend and r.get("status") in ("ok", "FAIL") for r in rows)

    for b in backends:
        if not ran(b):
            why: dict = {}
            for r in (r for r in rows if r["backend"] == b):
                why.setdefault(full_status(r), []).append(r["quant"])
            lines.append(
                f"* {b} was NOT executed: " + "; ".join(f"{', '.join(ordered(q))}: {w}" for w, q in why.items())
            )
    compared = [r for r in rows if r["backend"] == KERNELS[0] and r.get("xdiff") is not None]
    pair = f"CuTe-vs-Triton ({KERNELS[0]} vs {KERNELS[1]})"
    if not compared:
        absent = [k for k in KERNELS if k not in backends]
        idle = [k for k in KERNELS if k in backends and not ran(k)]
        reason = (
            f"{' and '.join(absent)} not among the backends"
            if absent
            else f"{' and '.join(idle)} did not run"
            if idle
            else "the two kernels never ran on the same case"
        )
        lines.append(f"* {pair} equivalence NOT checked: {reason}")
    else:
        off = sum(r.get("xdiff_ok") is False for r in compared)
        lines.append(
            f"* {pair} compared on {len(compared)} cases: "
            + ("all within the bound" if not off else f"{off} OUTSIDE the bound")
        )
    if not any(isinstance(r.get("us"), (int, float)) for r in rows):
        lines.append(
            "* timing SKIPPED: "
            + ("no GPU" if reduced or not m.get("timed", True) else "no row was timed")
            + " — no µs, roofline, speedup or router table"
        )
    budget = [r for r in rows if str(r.get("status", "")).startswith(("skipped: time budget", "stopped: time budget"))]
    if budget:
        lines.append(
            f"* time budget ({text(m.get('time_budget_s'))} s) spent: {_count_cases(budget)} of "
            f"{_count_cases(rows)} cases stopped or skipped"
        )
    ptx = result.get("cute_ptx")
    if isinstance(ptx, dict) and ptx.get("status") == "ok":
        lines.append(
            f"* the CuTe configs cute_moe would run, with their PTX WGMMA instructions: {ptx_where} "
            f'(section "{PTX_SECTION}"); one config\'s whole PTX: {FULL_PTX_COMMAND}'
        )
    elif isinstance(ptx, dict):
        lines.append(f"* CuTe PTX listing: {ptx.get('status')}")
    elif reduced and KERNELS[0] in backends:
        lines.append(f"* CuTe PTX listing not made in this run (--no-ptx); one config's PTX: {FULL_PTX_COMMAND}")
    return lines

"""The report's figures: numerics (always), roofline position and speedup (when timed).

Every figure follows the tables: cases in the order the tables list them, one colour and one marker
per backend in every panel of every figure (:data:`STYLE`), one legend per figure, and a title that
says when the shapes were reduced for the CPU interpreter. In the numerics figure each backend's points
sit side by side in their case's slot, so equal errors do not hide one backend under another; a figure
or panel with nothing to draw is left out.
"""

from __future__ import annotations

from pathlib import Path

import compare.metrics as metrics
from compare.backends import BACKEND_NAMES, BASELINE
from compare.cases import REDUCED_HIDDEN, REDUCED_INTERMEDIATE, REDUCED_MAX_EXPERTS

#: The figures, by file name (without .png), in the order the report shows them.
FIGURES = ("numerics", "roofline", "speedup")
#: backend -> (colour, marker), fixed across figures and runs; a backend not listed (a peer, a kernel of
#: yours) takes the next unused colour and marker in the order it first appears (:func:`_style`).
STYLE = {name: (f"C{i}", marker) for i, (name, marker) in enumerate(zip(BACKEND_NAMES, "os^xDv<"))}
_EXTRA_COLOURS = ("C7", "C8", "C9", "black", "tab:olive", "tab:brown")
_EXTRA_MARKERS = ">pP*hX8"
_extra: dict = {}


def _style(name: str):
    if name in STYLE:
        return STYLE[name]
    n = _extra.setdefault(name, len(_extra))
    return _EXTRA_COLOURS[n % len(_EXTRA_COLOURS)], _EXTRA_MARKERS[n % len(_EXTRA_MARKERS)]


def _offsets(backends: list) -> dict:
    """backend -> its x offset within a case's slot: each backend's points side by side, so none hides
    another's (two backends often have the same error: torch_grouped and torch_loop on the CPU)."""
    step = min(0.15, 0.8 / max(1, len(backends)))
    return {b: (i - (len(backends) - 1) / 2) * step for i, b in enumerate(backends)}


def _ordered(values) -> list:
    """Distinct values in order of first appearance (the tables' order)."""
    return list(dict.fromkeys(values))


def _title(result: dict, text: str) -> str:
    reduced = any(r.get("shape_note") for r in result["rows"])
    return text + (
        f" — shapes REDUCED for the CPU interpreter (E ≤ {REDUCED_MAX_EXPERTS}, K = {REDUCED_HIDDEN}, "
        f"I = {REDUCED_INTERMEDIATE})"
        if reduced
        else ""
    )


def _legend(fig, plt, backends: list) -> None:
    """One legend for the whole figure, below the panels, in table order."""
    handles = [plt.Line2D([], [], color=_style(b)[0], marker=_style(b)[1], ls="", label=b) for b in backends]
    fig.legend(handles=handles, loc="lower center", ncol=max(1, len(handles)), fontsize=8, frameon=False)


def _numerics(result: dict, plt):
    rows = [r for r in result["rows"] if isinstance(r.get("rel_l2"), (int, float))]
    if not rows:
        return None
    quants = _ordered(r["quant"] for r in rows)
    backends = _ordered(r["backend"] for r in rows)
    fig, axes = plt.subplots(1, len(quants), figsize=(max(5.0, 4.2 * len(quants)), 4.8), squeeze=False, sharey=True)
    for ax, quant in zip(axes[0], quants):
        mine = [r for r in rows if r["quant"] == quant]
        cases = _ordered((r["shape"], r["T"]) for r in mine)
        x = {c: i for i, c in enumerate(cases)}
        offset = _offsets(backends)
        for b in backends:
            pts = [(x[(r["shape"], r["T"])] + offset[b], max(r["rel_l2"], 1e-8)) for r in mine if r["backend"] == b]
            if pts:
                colour, marker = _style(b)
                ax.scatter(*zip(*pts), color=colour, marker=marker, s=22, label=b)
        ax.axhline(metrics.tolerance_for(None if quant == "bf16" else quant).rel_l2, ls="--", lw=0.8, color="gray")
        ax.set_yscale("log")
        ax.set_xlim(-0.5, len(cases) - 0.5)
        ax.set_xticks(range(len(cases)), [f"{s} T={t}" for s, t in cases], rotation=90, fontsize=6)
        ax.set_title(quant, fontsize=9)
    axes[0][0].set_ylabel("relative L2 error vs fp64 oracle")
    fig.suptitle(_title(result, "Numerics (dashed: the format's tolerance)"), fontsize=9)
    _legend(fig, plt, backends)
    return fig


def _roofline(result: dict, timed: list, ceil: dict, plt):
    timed = [r for r in timed if r.get("weight_tbps") and r.get("tflops")]
    if not timed:
        return None
    fig, ax = plt.subplots(figsize=(7, 5.4))
    xs = [10 ** (i / 10) for i in range(-10, 41)]
    for label, rate, style in (("bf16", ceil.get("bf16_tflops"), "-"), ("fp8", ceil.get("fp8_tflops"), "--")):
        if rate:
            ax.plot(xs, [min(rate, x * ceil["copy_tbps"]) for x in xs], style, color="gray", lw=1)
            ax.annotate(f"{label} roof", (xs[-1], rate), fontsize=7, ha="right", va="bottom", color="gray")
    backends = _ordered(r["backend"] for r in timed)
    for b in backends:
        pts = [
            (r["tflops"] / r["weight_tbps"], r["tflops"])
            for r in timed
            if r["backend"] == b and r.get("weight_tbps") and r.get("tflops")
        ]
        if pts:
            colour, marker = _style(b)
            ax.scatter(*zip(*pts), color=colour, marker=marker, s=22, label=b)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("FLOPs per weight byte")
    ax.set_ylabel("achieved TFLOP/s")
    device = result["meta"].get("device")
    ax.set_title(_title(result, f"Roofline position of every timed row ({device})"), fontsize=9)
    _legend(fig, plt, backends)
    return fig


def _speedup(result: dict, timed: list, plt):
    """One panel per (shape, format) that has a speedup (none where the baselines were not run), or None."""
    timed = [r for r in timed if isinstance(r.get("speedup"), (int, float))]
    if not timed:
        return None
    groups = _ordered((r["shape"], r["quant"]) for r in timed)
    backends = _ordered(r["backend"] for r in timed)
    fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups) + 0.5, 3.8), squeeze=False, sharey=True)
    for ax, (shape, quant) in zip(axes[0], groups):
        for b in backends:
            pts = sorted(
                (r["T"], r["speedup"])
                for r in timed
                if r["backend"] == b and r["shape"] == shape and r["quant"] == quant and r.get("speedup")
            )
            if pts:
                colour, marker = _style(b)
                ax.plot(*zip(*pts), color=colour, marker=marker, label=b)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{shape}\n{quant}", fontsize=8)
        ax.set_xlabel("T")
    axes[0][0].set_ylabel(f"speedup vs {BASELINE}")
    fig.suptitle(_title(result, "Speedup over the torch baseline"), fontsize=9)
    _legend(fig, plt, backends)
    return fig


def figures(result: dict) -> dict:
    """name -> matplotlib figure: numerics (when any row ran), roofline and speedup (when timed, and only
    with what there is to draw: a speedup panel per (shape, format) that has one, no figure without)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = {"numerics": _numerics(result, plt)}
    timed = [r for r in result["rows"] if isinstance(r.get("us"), (int, float))]
    ceilings = result.get("ceilings")
    ceil = ceilings[0] if isinstance(ceilings, list) else ceilings
    if timed and ceil:
        found.update(roofline=_roofline(result, timed, ceil, plt), speedup=_speedup(result, timed, plt))
    return {name: fig for name, fig in found.items() if fig is not None}


def plots(result: dict, out_dir) -> list:
    """Write the figures as PNG files into ``out_dir``; return their paths."""
    import matplotlib.pyplot as plt

    written = []
    for name, fig in figures(result).items():
        fig.tight_layout(rect=(0, 0.07, 1, 1))
        written.append(Path(out_dir) / f"{name}.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written

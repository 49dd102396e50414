"""The figures follow the tables: one colour per backend in every panel, one legend per figure, the tables'
order, and a title that says when the shapes were reduced."""

from pathlib import Path

import matplotlib
import pytest

from compare import plots, results

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
H200 = ROOT / "notes" / "results" / "compare_h200_2026-11-30.json"


@pytest.fixture(scope="module")
def h200():
    return results.load(str(H200))


def _backend_artists(fig):
    """Every plotted point set labelled with its backend, with its colour."""
    for ax in fig.axes:
        for a in ax.collections:
            if not a.get_label().startswith("_"):
                yield a.get_label(), tuple(a.get_facecolor()[0])
        for a in ax.lines:
            if not a.get_label().startswith("_"):
                yield a.get_label(), matplotlib.colors.to_rgba(a.get_color())


def _titles(fig) -> str:
    return " ".join([fig._suptitle.get_text() if fig._suptitle else ""] + [ax.get_title() for ax in fig.axes])


def test_one_colour_per_backend_one_legend_per_figure(h200):
    figs = plots.figures(h200)
    assert set(figs) == {"numerics", "roofline", "speedup"}
    for name, fig in figs.items():
        assert len(fig.legends) == 1 and not any(ax.get_legend() for ax in fig.axes), name
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert legend == ["cute_moe", "triton_moe", "torch_grouped", "torch_loop"], name  # the tables' order
        seen = set()
        for backend, colour in _backend_artists(fig):
            assert colour == pytest.approx(matplotlib.colors.to_rgba(plots.STYLE[backend][0])), (name, backend)
            seen.add(backend)
        assert seen == set(legend), name
        assert "REDUCED" not in _titles(fig)
        plt.close(fig)


def test_panels_follow_the_tables_order(h200):
    figs = plots.figures(h200)
    groups = list(dict.fromkeys((r["shape"], r["quant"]) for r in h200["rows"]))
    assert [ax.get_title() for ax in figs["speedup"].axes] == [f"{s}\n{q}" for s, q in groups]
    bf16 = figs["numerics"].axes[0]
    cases = list(dict.fromkeys(f"{r['shape']} T={r['T']}" for r in h200["rows"] if r["quant"] == "bf16"))
    assert bf16.get_title() == "bf16" and [t.get_text() for t in bf16.get_xticklabels()] == cases
    for fig in figs.values():
        plt.close(fig)


def test_the_title_says_when_shapes_are_reduced(h200):
    reduced = {
        **h200,
        "rows": [{**r, "shape_note": "reduced (CPU interpreter)"} for r in h200["rows"]],
        "ceilings": None,
    }
    figs = plots.figures(reduced)
    assert set(figs) == {"numerics"}  # nothing timed: no roofline, no speedup
    assert "shapes REDUCED for the CPU interpreter" in _titles(figs["numerics"])
    plt.close(figs["numerics"])


def _points(ax) -> dict:
    """backend -> its plotted (x, y) points in one panel."""
    return {
        a.get_label(): [tuple(p) for p in a.get_offsets()] for a in ax.collections if not a.get_label().startswith("_")
    }


def test_every_backend_of_the_numerics_legend_is_visible(h200):
    """Two backends with the same error in a case (torch_grouped and torch_loop on the CPU) are drawn side by
    side, not one over the other; every backend has its own marker."""
    loop = {(r["shape"], r["quant"], r["T"]): r["rel_l2"] for r in h200["rows"] if r["backend"] == "torch_loop"}
    same = {
        **h200,
        "rows": [
            {**r, "rel_l2": loop.get((r["shape"], r["quant"], r["T"]), r.get("rel_l2"))}
            if r["backend"] == "torch_grouped"
            else r
            for r in h200["rows"]
        ],
    }
    fig = plots.figures(same)["numerics"]
    for ax in fig.axes:
        points = _points(ax)
        assert {"torch_grouped", "torch_loop"} <= set(points)
        for a in points:
            for b in points:
                if a < b:
                    assert not set(points[a]) & set(points[b]), (ax.get_title(), a, b)  # none hides under another
        for backend, pts in points.items():  # each point stays in its case's slot
            assert all(abs(x - round(x)) < 0.5 for x, _ in pts), backend
    markers = [h.get_marker() for h in fig.legends[0].legend_handles]
    assert len(set(markers)) == len(markers)
    plt.close(fig)


def test_speedup_draws_only_the_panels_that_have_data(h200, tmp_path):
    """A record without baselines (here: cute_moe and triton_moe only) has no speedup figure, and the report
    embeds none; one shape and format without speedups loses its panel, the others keep their data's axes."""
    kernels_only = results.load(str(ROOT / "notes" / "results" / "compare_h200_2026-12-03_fd84fba.json"))
    figs = plots.figures(kernels_only)
    assert "speedup" not in figs and {"numerics", "roofline"} <= set(figs)
    for fig in figs.values():
        plt.close(fig)
    from compare import report

    written = {p.name for p in report.write_all(kernels_only, tmp_path)}
    assert "speedup.png" not in written and "![speedup]" not in (tmp_path / "report.md").read_text()

    gone = (h200["rows"][0]["shape"], "bf16")
    partial = {
        **h200,
        "rows": [{**r, "speedup": None} if (r["shape"], r["quant"]) == gone else r for r in h200["rows"]],
    }
    fig = plots.figures(partial)["speedup"]
    groups = list(dict.fromkeys((r["shape"], r["quant"]) for r in partial["rows"] if r.get("speedup")))
    assert gone not in groups and [ax.get_title() for ax in fig.axes] == [f"{s}\n{q}" for s, q in groups]
    for ax in fig.axes:
        xs = [x for line in ax.lines if not line.get_label().startswith("_") for x in line.get_xdata()]
        lo, hi = ax.get_xlim()
        assert xs and lo <= min(xs) and max(xs) <= hi and hi <= 4 * max(xs) and lo >= min(xs) / 4
    plt.close(fig)

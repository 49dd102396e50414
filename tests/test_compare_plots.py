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
    reduced = {**h200, "rows": [{**r, "shape_note": "reduced (CPU interpreter)"} for r in h200["rows"]],
               "ceilings": None}
    figs = plots.figures(reduced)
    assert set(figs) == {"numerics"}  # nothing timed: no roofline, no speedup
    assert "shapes REDUCED for the CPU interpreter" in _titles(figs["numerics"])
    plt.close(figs["numerics"])

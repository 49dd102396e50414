"""A small SVG writer for the layout pictures (standard library only).

The pictures are data first: every mark that shows a layout fact carries it in ``data-*``
attributes (the thread, the warp, the bank group …), so a test can parse the SVG back and compare
it with the layout it was drawn from.  Cells of a grid are drawn in *cell units* inside a scaled
group, so a rectangle's ``x``/``y``/``width``/``height`` are column, row and extents.
"""

from __future__ import annotations

from html import escape

# Eight distinguishable colours (Okabe–Ito), one per warp of the (up to two) consumer warpgroups.
WARP_COLOURS = ("#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7", "#999999")
# Eight bank groups (4 banks = 16 bytes each): a sequential light palette keyed by bank group.
BANK_COLOURS = ("#fde0dd", "#c6dbef", "#c7e9c0", "#fdd0a2", "#dadaeb", "#fcbba1", "#d9f0a3", "#e0e0e0")

BASE_CSS = (
    "text{font-family:DejaVu Sans Mono,Menlo,Consolas,monospace;font-size:11px;fill:#222}"
    ".c{text-anchor:middle}.t{font-size:14px;font-weight:bold}.s{font-size:10px;fill:#555}.l{font-size:8px}"
    ".frame{fill:none;stroke:#333;stroke-width:1}.grid{fill:none;stroke:#fff;stroke-width:.6}"
    ".pad{fill:#fff;fill-opacity:.72}.hi{fill:none;stroke:#c00;stroke-width:2}"
    + "".join(f".w{i}{{fill:{c}}}.s{i}{{stroke:{c}}}" for i, c in enumerate(WARP_COLOURS))
    + "".join(f".b{i}{{fill:{c}}}" for i, c in enumerate(BANK_COLOURS))
)


FONT_SIZES = {"t": 14, "s": 10, "l": 8}  # by class, as BASE_CSS sets them (11 px otherwise)


def text_width(s: str, size: float = 10) -> float:
    """Width of a line of monospace text (a glyph is about 0.61 of the font size wide)."""
    return 0.61 * size * len(s)


def num(v) -> str:
    """A coordinate, short: integers without a decimal point, others with at most two decimals."""
    if float(v).is_integer():
        return str(int(v))
    return f"{v:.2f}".rstrip("0").rstrip(".")


def _attrs(attrs: dict) -> str:
    out = []
    for k, v in attrs.items():
        if v is None:
            continue
        name = "class" if k == "cls" else k.replace("_", "-")
        out.append(f' {name}="{escape(num(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v))}"')
    return "".join(out)


class Svg:
    """An SVG document built element by element; ``render()`` returns its text (deterministic)."""

    def __init__(self, width: float, height: float, title: str, css: str = "", **data):
        self.width, self.height = width, height
        self.title = title
        self.css = BASE_CSS + css
        self.data = data
        self.parts: list[str] = []
        self.defs: list[str] = []

    def el(self, tag: str, content: str | None = None, **attrs) -> None:
        if content is None:
            self.parts.append(f"<{tag}{_attrs(attrs)}/>")
        else:
            self.parts.append(f"<{tag}{_attrs(attrs)}>{escape(content)}</{tag}>")

    def open(self, tag: str = "g", **attrs) -> None:
        self.parts.append(f"<{tag}{_attrs(attrs)}>")

    def close(self, tag: str = "g") -> None:
        self.parts.append(f"</{tag}>")

    def rect(self, x, y, w, h, **attrs) -> None:
        self.el("rect", x=x, y=y, width=w, height=h, **attrs)

    def text(self, x, y, s: str, **attrs) -> None:
        """A line of text; a left-aligned one widens the picture to fit it."""
        self.el("text", s, x=x, y=y, **attrs)
        if "text_anchor" not in attrs and " c" not in f" {attrs.get('cls', '')}":
            size = FONT_SIZES.get(str(attrs.get("cls", "")).split(" ")[0], 11)
            self.width = max(self.width, x + text_width(s, size) + 12)

    def lines(self, x, y, texts, step: float = 14, **attrs) -> float:
        """Several lines of text from (x, y) downwards; returns the y below the last one."""
        for t in texts:
            self.text(x, y, t, **attrs)
            y += step
        return y

    def cells(self, x0, y0, cw, ch, **attrs) -> None:
        """Open a group whose user unit is one cell (cw × ch pixels) with its origin at (x0, y0)."""
        self.open("g", transform=f"translate({num(x0)} {num(y0)}) scale({num(cw)} {num(ch)})", **attrs)

    def symbol(self, ident: str, *parts: str) -> None:
        """A reusable drawing (``<use href="#ident" x=… y=…/>`` places it)."""
        self.defs.append(f'<symbol id="{ident}" overflow="visible">{"".join(parts)}</symbol>')

    def render(self) -> str:
        head = (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{num(self.width)}" height="{num(self.height)}" '
            f'viewBox="0 0 {num(self.width)} {num(self.height)}"{_attrs(self.data)}>'
        )
        body = [
            head,
            f"<title>{escape(self.title)}</title>",
            f"<style>{self.css}</style>",
            f'<rect width="{num(self.width)}" height="{num(self.height)}" fill="#fff"/>',
        ]
        if self.defs:
            body.append("<defs>" + "".join(self.defs) + "</defs>")
        return "\n".join(body + self.parts + ["</svg>", ""])


def rect_runs(grid: dict, rows: int, cols: int) -> list[tuple[int, int, int, int, object]]:
    """Cover a grid ``{(row, col): value}`` with rectangles of one value: (x, y, w, h, value).

    Horizontal runs of equal value in a row, extended downwards while the next row repeats the
    same run exactly.  Cells missing from ``grid`` are left uncovered.
    """
    open_runs: dict[tuple[int, int, object], list[int]] = {}  # (x, w, value) -> [y, h]
    done = []
    for r in range(rows):
        runs, c = [], 0
        while c < cols:
            v = grid.get((r, c))
            start = c
            while c < cols and grid.get((r, c)) == v:
                c += 1
            if v is not None:
                runs.append((start, c - start, v))
        keys = set(runs)
        for key in list(open_runs):
            if key not in keys:
                y, h = open_runs.pop(key)
                done.append((key[0], y, key[1], h, key[2]))
        for key in runs:
            if key in open_runs:
                open_runs[key][1] += 1
            else:
                open_runs[key] = [r, 1]
    for key, (y, h) in open_runs.items():
        done.append((key[0], y, key[1], h, key[2]))
    return sorted(done, key=lambda t: (t[1], t[0]))


def warp_legend(svg: Svg, x: float, y: float, warps: int, label=lambda w: f"warp {w}") -> float:
    """A row of colour swatches naming each warp; returns the x after the last one."""
    for w in range(warps):
        svg.rect(x, y - 9, 10, 10, cls=f"w{w}")
        svg.text(x + 14, y, label(w))
        x += 14 + 7.2 * len(label(w)) + 12
    return x

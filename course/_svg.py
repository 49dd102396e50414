"""A minimal SVG writer for the course's figures (standard library only): rectangles and text whose
``data-*`` attributes carry the values drawn, so a test can read a picture back."""

from __future__ import annotations

from html import escape

COLOURS = ("#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7", "#999999")
CSS = (
    "text{font-family:DejaVu Sans Mono,Menlo,monospace;font-size:11px;fill:#222}.c{text-anchor:middle}"
    ".t{font-size:14px;font-weight:bold}.s{font-size:10px;fill:#555}.l{font-size:8px}"
    ".frame{fill:none;stroke:#333}.hi{fill:none;stroke:#c00;stroke-width:2}.ln{stroke:#555;stroke-width:1}"
    ".ev{font-size:9px;text-anchor:middle}.idle{fill:#eee}"
    + "".join(f".w{i}{{fill:{c}}}" for i, c in enumerate(COLOURS))
)


def _num(v) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:.2f}".rstrip("0").rstrip(".")


def _attrs(attrs: dict) -> str:
    out = []
    for k, v in attrs.items():
        name = "class" if k == "cls" else k.replace("_", "-")
        text = _num(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)
        out.append(f' {name}="{escape(text)}"')
    return "".join(out)


class Svg:
    """An SVG document built element by element; ``render()`` returns its text (deterministic)."""

    def __init__(self, width: float, height: float, title: str, **data):
        self.width, self.height, self.title, self.data, self.parts = width, height, title, data, []

    def rect(self, x, y, w, h, **attrs) -> None:
        self.parts.append(f"<rect{_attrs(dict(x=x, y=y, width=w, height=h, **attrs))}/>")

    def text(self, x, y, s: str, **attrs) -> None:
        self.parts.append(f"<text{_attrs(dict(x=x, y=y, **attrs))}>{escape(s)}</text>")
        if " c" not in f" {attrs.get('cls', '')}":  # left-aligned text widens the picture to fit
            self.width = max(self.width, x + 0.62 * 11 * len(s) + 12)

    def line(self, x1, y1, x2, y2, **attrs) -> None:
        self.parts.append(f"<line{_attrs(dict(x1=x1, y1=y1, x2=x2, y2=y2, **attrs))}/>")

    def lines(self, x, y, texts, step: float = 14, **attrs) -> None:
        for i, t in enumerate(texts):
            self.text(x, y + step * i, t, **attrs)

    def render(self) -> str:
        w, h = _num(self.width), _num(self.height)
        head = (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}"'
            f"{_attrs(self.data)}>"
        )
        return "\n".join(
            [
                head,
                f"<title>{escape(self.title)}</title>",
                f"<style>{CSS}</style>",
                f'<rect width="{w}" height="{h}" fill="#fff"/>',
                *self.parts,
                "</svg>",
                "",
            ]
        )

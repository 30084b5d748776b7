"""A small, dependency-free line-chart renderer: data in, an SVG string out.

What the report needs and nothing more: linear axes with "nice" ticks (1/2/5 x 10^k) and units,
several series with a legend, horizontal bands (the baseline +-5% band, shaded), vertical spans
(gaps between run segments, windows with findings), gaps in a series where a value is missing,
hollow markers for points that are provisional (a partial window). Output is deterministic (fixed
number formatting, no random ids) and every text is escaped, so a series named ``<script>`` is
just text.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from html import escape

__all__ = ["PALETTE", "Band", "Series", "Span", "empty_chart", "fmt_number", "line_chart", "nice_ticks"]

# Okabe-Ito: distinguishable with the common colour-vision deficiencies, and in greyscale by order.
PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442")
FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, 'DejaVu Sans', sans-serif"
CHAR_W = 6.2  # rough width of one 11px character, for layout only


@dataclass(frozen=True)
class Series:
    """One line. ``y`` None (or NaN/inf) leaves a gap; ``hollow`` x positions get open markers."""

    name: str
    x: Sequence[float]
    y: Sequence[float | None]
    color: str | None = None
    dash: bool = False
    markers: bool | None = None  # None: markers when there are few points
    hollow: frozenset[float] = field(default_factory=frozenset)


@dataclass(frozen=True)
class Band:
    """A shaded horizontal band ``lo..hi`` (the baseline +-threshold); ``center`` a dashed line."""

    lo: float
    hi: float
    label: str = ""
    color: str = PALETTE[0]
    center: float | None = None


@dataclass(frozen=True)
class Span:
    """A shaded vertical range ``x0..x1`` (a gap in observation, a window with a finding)."""

    x0: float
    x1: float
    label: str = ""
    color: str = "#999999"


def _finite(v: float | None) -> bool:
    return v is not None and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _num(v: float) -> str:
    """Coordinates: one decimal, no '-0.0'."""
    s = f"{v:.1f}"
    return "0.0" if s == "-0.0" else s


def nice_step(span: float, target: int = 5) -> float:
    """The 1/2/5 x 10^k step that cuts ``span`` into about ``target`` intervals."""
    if not _finite(span) or span <= 0:
        return 1.0
    raw = span / max(1, target)
    mag = 10.0 ** math.floor(math.log10(raw))
    for m in (1.0, 2.0, 5.0, 10.0):
        if raw <= m * mag * 1.0000001:
            return m * mag
    return 10.0 * mag  # pragma: no cover - the loop always returns


def nice_ticks(lo: float, hi: float, target: int = 5, *, integer: bool = False) -> tuple[float, float, list[float]]:
    """(axis lo, axis hi, ticks): the range widened to whole steps, ticks at each step."""
    if hi < lo:
        lo, hi = hi, lo
    step = nice_step(hi - lo, target)
    if integer:
        step = max(1.0, round(step))
    a = math.floor(lo / step + 1e-9) * step
    b = math.ceil(hi / step - 1e-9) * step
    if b <= a:
        b = a + step
    n = int(round((b - a) / step))
    ticks = [a + i * step for i in range(n + 1)]
    return a, b, ticks


def _decimals(step: float) -> int:
    if step >= 1 or step <= 0:
        return 0
    return min(6, max(0, -math.floor(math.log10(step) + 1e-9)))


def fmt_number(v: float, step: float | None = None) -> str:
    """A tick or value label: as many decimals as the step needs, k/M for large round numbers."""
    if not _finite(v):
        return "-"
    if step is None:
        a = abs(v)
        if a >= 1 or a == 0:
            step = 1.0 if a >= 100 or a == 0 else 0.1 if a >= 10 else 0.01
        else:
            step = 10 ** (math.floor(math.log10(a)) - 1)
    if abs(v) >= 100_000 and step >= 1000:
        if abs(v) >= 1_000_000 and step >= 100_000:
            return _trim(f"{v / 1e6:.{_decimals(step / 1e6)}f}") + "M"
        return _trim(f"{v / 1e3:.{_decimals(step / 1e3)}f}") + "k"
    s = f"{v:.{_decimals(step)}f}"
    return "0" if s.strip("-0.") == "" else s


def _trim(s: str) -> str:
    return s.rstrip("0").rstrip(".") if "." in s else s


def _text(x: float, y: float, s: str, *, anchor: str = "start", size: int = 11, weight: str | None = None,
          fill: str = "#333", cls: str | None = None, rotate: bool = False) -> str:
    attrs = [f'x="{_num(x)}"', f'y="{_num(y)}"', f'font-size="{size}"', f'fill="{fill}"']
    if anchor != "start":
        attrs.append(f'text-anchor="{anchor}"')
    if weight:
        attrs.append(f'font-weight="{weight}"')
    if cls:
        attrs.append(f'class="{cls}"')
    if rotate:
        attrs.append(f'transform="rotate(-90 {_num(x)} {_num(y)})"')
    return f"<text {' '.join(attrs)}>{escape(s)}</text>"


def _open(width: int, height: int, title: str, chart_id: str | None, desc: str) -> list[str]:
    ident = f' id="{escape(chart_id)}"' if chart_id else ""
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg"{ident} class="chart" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" font-family="{escape(FONT)}">',
        f"<title>{escape(title)}</title>",
        f"<desc>{escape(desc)}</desc>",
        f'<rect class="background" x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
    ]


def empty_chart(title: str, message: str = "no data", *, width: int = 640, height: int = 120,
                chart_id: str | None = None) -> str:
    """A placeholder with the chart's title and why there is nothing to draw."""
    out = _open(width, height, title, chart_id, message)
    out.append(_text(12, 20, title, size=13, weight="600", fill="#111"))
    out.append(f'<rect x="12" y="32" width="{width - 24}" height="{height - 44}" fill="#f6f6f6" stroke="#dddddd"/>')
    out.append(_text(width / 2, 32 + (height - 44) / 2 + 4, message, anchor="middle", size=12, fill="#666",
                     cls="empty"))
    out.append("</svg>")
    return "\n".join(out)


def line_chart(
    series: Sequence[Series],
    *,
    title: str,
    y_label: str = "",
    x_label: str = "",
    bands: Sequence[Band] = (),
    spans: Sequence[Span] = (),
    width: int = 640,
    height: int = 300,
    x_integer: bool = False,
    y_zero: bool = False,
    x_format: Callable[[float], str] | None = None,
    y_format: Callable[[float], str] | None = None,
    chart_id: str | None = None,
    empty_text: str = "no data",
) -> str:
    """Render ``series`` as an SVG line chart (see the module docstring)."""
    pts = [(float(x), float(y)) for s in series for x, y in zip(s.x, s.y, strict=False)
           if _finite(x) and _finite(y)]  # fmt: skip
    if not pts:
        return empty_chart(title, empty_text, width=width, chart_id=chart_id)

    # ---- ranges
    xs = [p[0] for p in pts] + [v for sp in spans for v in (sp.x0, sp.x1) if _finite(v)]
    ys = [p[1] for p in pts] + [v for b in bands for v in (b.lo, b.hi, b.center) if _finite(v)]
    x_lo, x_hi = min(xs), max(xs)
    if x_integer:
        x_lo, x_hi = x_lo - 0.5, x_hi + 0.5
    elif x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    else:  # room for the first and last markers
        pad = (x_hi - x_lo) * 0.02
        x_lo, x_hi = x_lo - pad, x_hi + pad
    y_lo, y_hi = min(ys), max(ys)
    if y_zero and y_lo >= 0:
        y_lo = 0.0
    min_span = 0.01 * max(abs(y_lo), abs(y_hi))  # noise of 0.001% is not drawn as a cliff
    if 0 < y_hi - y_lo < min_span:
        mid = (y_hi + y_lo) / 2
        y_lo, y_hi = mid - min_span / 2, mid + min_span / 2
    if y_hi == y_lo:
        pad = abs(y_hi) * 0.1 or 1.0
        y_lo, y_hi = y_lo - pad, y_hi + pad
        if y_zero and min(ys) >= 0:
            y_lo = max(0.0, y_lo)
    else:
        pad = (y_hi - y_lo) * 0.06
        y_hi += pad
        if not (y_zero and y_lo == 0.0):
            y_lo -= pad
    y_lo, y_hi, y_ticks = nice_ticks(y_lo, y_hi, 5)
    y_step = y_ticks[1] - y_ticks[0] if len(y_ticks) > 1 else 1.0
    if x_integer:
        _, _, x_ticks = nice_ticks(math.ceil(x_lo), math.floor(x_hi), 8, integer=True)
        x_ticks = [t for t in x_ticks if x_lo <= t <= x_hi]
    else:
        _, _, x_ticks = nice_ticks(x_lo, x_hi, 6)
        x_ticks = [t for t in x_ticks if x_lo - 1e-9 <= t <= x_hi + 1e-9]
    x_step = x_ticks[1] - x_ticks[0] if len(x_ticks) > 1 else 1.0
    fy = y_format or (lambda v: fmt_number(v, y_step))
    fx = x_format or (lambda v: fmt_number(v, x_step))

    # ---- legend (wraps), then the plot area under it
    legend: list[tuple[str, str, str]] = []  # (kind, label, color)
    colors: list[str] = []
    for i, s in enumerate(series):
        color = s.color or PALETTE[i % len(PALETTE)]
        colors.append(color)
        legend.append(("dash" if s.dash else "line", s.name, color))
    for b in bands:
        if b.label:
            legend.append(("band", b.label, b.color))
    for sp in spans:
        if sp.label and not any(k == "span" and lab == sp.label for k, lab, _ in legend):
            legend.append(("span", sp.label, sp.color))
    label_w = max(len(fy(t)) for t in y_ticks) * CHAR_W
    left = 18 + label_w + (14 if y_label else 0)
    right = 14
    rows: list[list[tuple[str, str, str, float]]] = [[]]
    cx = left
    for kind, lab, color in legend:
        w = 26 + len(lab) * CHAR_W + 14
        if rows[-1] and cx + w > width - right:
            rows.append([])
            cx = left
        rows[-1].append((kind, lab, color, cx))
        cx += w
    top = 28 + 16 * len(rows) + 6
    bottom = height - (34 if x_label else 22)
    plot_w = width - right - left
    plot_h = bottom - top

    def px(x: float) -> float:
        return left + (x - x_lo) / (x_hi - x_lo) * plot_w

    def py(y: float) -> float:
        return bottom - (y - y_lo) / (y_hi - y_lo) * plot_h

    desc = f"{len(series)} series; y: {y_label}; x: {x_label}"
    out = _open(width, height, title, chart_id, desc)
    out.append(_text(12, 18, title, size=13, weight="600", fill="#111", cls="title"))
    for r, row in enumerate(rows):
        ly = 28 + 16 * r + 8
        for kind, lab, color, lx in row:
            if kind == "band":
                out.append(f'<rect class="legend-band" x="{_num(lx)}" y="{_num(ly - 6)}" width="20" height="10" '
                           f'fill="{color}" fill-opacity="0.15" stroke="{color}" stroke-opacity="0.5"/>')
            elif kind == "span":
                out.append(f'<rect class="legend-span" x="{_num(lx)}" y="{_num(ly - 6)}" width="20" height="10" '
                           f'fill="{color}" fill-opacity="0.18"/>')
            else:
                dash = ' stroke-dasharray="5 3"' if kind == "dash" else ""
                out.append(f'<line x1="{_num(lx)}" y1="{_num(ly - 1)}" x2="{_num(lx + 20)}" y2="{_num(ly - 1)}" '
                           f'stroke="{color}" stroke-width="2.5"{dash}/>')
            out.append(_text(lx + 26, ly + 3, lab, cls="legend"))

    # ---- frame, grid, ticks
    out.append(f'<rect class="plot" x="{_num(left)}" y="{_num(top)}" width="{_num(plot_w)}" height="{_num(plot_h)}" '
               'fill="#fcfcfc" stroke="#cccccc"/>')
    for sp in spans:
        a, b = max(x_lo, min(sp.x0, sp.x1)), min(x_hi, max(sp.x0, sp.x1))
        if b > a:
            out.append(f'<rect class="span" x="{_num(px(a))}" y="{_num(top)}" width="{_num(px(b) - px(a))}" '
                       f'height="{_num(plot_h)}" fill="{sp.color}" fill-opacity="0.18"><title>{escape(sp.label)}'
                       "</title></rect>")
    for t in y_ticks:
        y = py(t)
        out.append(f'<line class="grid" x1="{_num(left)}" y1="{_num(y)}" x2="{_num(left + plot_w)}" y2="{_num(y)}" '
                   'stroke="#e6e6e6"/>')
        out.append(_text(left - 6, y + 4, fy(t), anchor="end", size=10, fill="#555", cls="ytick"))
    for t in x_ticks:
        x = px(t)
        out.append(f'<line x1="{_num(x)}" y1="{_num(bottom)}" x2="{_num(x)}" y2="{_num(bottom + 4)}" stroke="#888"/>')
        out.append(_text(x, bottom + 15, fx(t), anchor="middle", size=10, fill="#555", cls="xtick"))
    if y_label:
        out.append(_text(12, top + plot_h / 2, y_label, anchor="middle", size=11, fill="#444", cls="ylabel",
                         rotate=True))
    if x_label:
        out.append(_text(left + plot_w / 2, height - 6, x_label, anchor="middle", size=11, fill="#444",
                         cls="xlabel"))

    # ---- bands under the lines
    for b in bands:
        lo, hi = min(b.lo, b.hi), max(b.lo, b.hi)
        out.append(f'<rect class="band" x="{_num(left)}" y="{_num(py(hi))}" width="{_num(plot_w)}" '
                   f'height="{_num(max(0.5, py(lo) - py(hi)))}" fill="{b.color}" fill-opacity="0.12">'
                   f"<title>{escape(b.label or 'band')}: {escape(fmt_number(lo, y_step / 10))}.."
                   f"{escape(fmt_number(hi, y_step / 10))}</title></rect>")
        for edge in (lo, hi):
            out.append(f'<line class="band-edge" x1="{_num(left)}" y1="{_num(py(edge))}" x2="{_num(left + plot_w)}" '
                       f'y2="{_num(py(edge))}" stroke="{b.color}" stroke-opacity="0.35" stroke-dasharray="2 3"/>')
        if _finite(b.center):
            out.append(f'<line class="band-center" x1="{_num(left)}" y1="{_num(py(b.center))}" '
                       f'x2="{_num(left + plot_w)}" y2="{_num(py(b.center))}" stroke="{b.color}" '
                       'stroke-opacity="0.6" stroke-dasharray="6 4"/>')

    # ---- series
    for s, color in zip(series, colors, strict=True):
        runs: list[list[tuple[float, float]]] = [[]]
        for x, y in zip(s.x, s.y, strict=False):
            if _finite(x) and _finite(y):
                runs[-1].append((float(x), float(y)))
            elif runs[-1]:
                runs.append([])
        runs = [r for r in runs if r]
        n = sum(len(r) for r in runs)
        markers = s.markers if s.markers is not None else n <= 60
        dash = ' stroke-dasharray="6 4"' if s.dash else ""
        out.append(f'<g class="series" data-series="{escape(s.name)}">')
        for r in runs:
            if len(r) > 1:
                pts_s = " ".join(f"{_num(px(x))},{_num(py(y))}" for x, y in r)
                out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" stroke-linejoin="round" '
                           f'points="{pts_s}"{dash}/>')
            for x, y in r:
                hollow = x in s.hollow
                if markers or hollow or len(r) == 1:
                    fill = "#ffffff" if hollow else color
                    out.append(f'<circle cx="{_num(px(x))}" cy="{_num(py(y))}" r="{3.5 if hollow else 3}" '
                               f'fill="{fill}" stroke="{color}" stroke-width="1.5"/>')
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)

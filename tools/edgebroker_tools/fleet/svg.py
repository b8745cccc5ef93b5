"""Inline SVG charts for the fleet report: plain strings, no script, no external file."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from typing import Final

PALETTE: Final = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1")
FONT: Final = 'font-family="system-ui, sans-serif" font-size="12"'


@dataclass(frozen=True)
class Segment:
    """One piece of a bar."""

    value: float
    color: str
    label: str  # the tooltip (<title>)


@dataclass(frozen=True)
class Bar:
    label: str
    segments: Sequence[Segment]  # stacked left to right
    note: str = ""  # text right of the bar


def _fmt(v: float) -> str:
    if abs(v) >= 100 or v == int(v):
        return f"{v:,.0f}"
    return f"{v:.2f}"


def hbars(
    bars: Sequence[Bar],
    *,
    title: str,
    scale_max: float | None = None,
    marks: Sequence[tuple[float, str]] = (),
    percent: bool = False,
    width: int = 640,
    label_width: int = 170,
) -> str:
    """Horizontal (stacked) bars; marks are vertical reference lines (value, label)."""
    row = 22
    top = 28
    plot = width - label_width - 150  # room for the note right of the longest bar
    totals = [sum(s.value for s in b.segments) for b in bars] or [0.0]
    vmax = max([scale_max or 0.0, *totals, *(m for m, _ in marks)]) or 1.0
    height = top + row * max(len(bars), 1) + 26
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{escape(title)}" {FONT}>',
        f'<text x="0" y="16" font-weight="bold">{escape(title)}</text>',
    ]
    for i, b in enumerate(bars):
        y = top + i * row
        out.append(
            f'<text x="{label_width - 6}" y="{y + 14}" text-anchor="end">{escape(b.label)}</text>'
        )
        x = float(label_width)
        for s in b.segments:
            w = plot * s.value / vmax if vmax else 0.0
            if w > 0:
                out.append(
                    f'<rect x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="{row - 6}" '
                    f'fill="{s.color}"><title>{escape(s.label)}</title></rect>'
                )
            x += w
        total = sum(s.value for s in b.segments)
        text = b.note or (f"{100 * total:.0f}%" if percent else _fmt(total))
        out.append(f'<text x="{x + 4:.1f}" y="{y + 14}">{escape(text)}</text>')
    base = top + row * max(len(bars), 1)
    for value, label in marks:
        x = label_width + plot * value / vmax
        out.append(
            f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{base}" stroke="#555" '
            f'stroke-dasharray="4 3"/>'
            f'<text x="{x:.1f}" y="{base + 14}" text-anchor="middle" fill="#555">'
            f"{escape(label)}</text>"
        )
    out.append("</svg>")
    return "".join(out)


def histogram(
    counts: Sequence[int],
    bin_labels: Sequence[str],
    *,
    title: str,
    x_title: str = "",
    y_title: str = "count",
    color: str = PALETTE[0],
    highlight_from: int | None = None,
    width: int = 330,
    height: int = 200,
) -> str:
    """Vertical bars, one per bin, with both axes: a count above each bar, the bins'
    labels under the x axis, 0 and the largest count on the y axis. Bins from
    highlight_from on are drawn in red."""
    n = max(len(counts), 1)
    top, bottom, left, right = 34, 46, 40, 6
    plot_h = height - top - bottom
    plot_w = width - left - right
    bw = plot_w / n
    cmax = max(counts, default=0) or 1
    base = top + plot_h
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{escape(title)}" {FONT}>',
        f'<text x="0" y="14" font-weight="bold">{escape(title)}</text>',
        # y axis: line, 0 and the maximum, its title
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{base}" stroke="#888"/>',
        f'<text x="{left - 4}" y="{base + 4}" text-anchor="end" fill="#555">0</text>',
        f'<text x="{left - 4}" y="{top + 4}" text-anchor="end" fill="#555">{cmax:,}</text>',
        f'<line x1="{left - 3}" y1="{top}" x2="{left}" y2="{top}" stroke="#888"/>',
        f'<text x="4" y="{top + plot_h / 2:.1f}" fill="#555" font-size="10" '
        f'transform="rotate(-90 10 {top + plot_h / 2:.1f})" text-anchor="middle">'
        f"{escape(y_title)}</text>",
    ]
    for i, c in enumerate(counts):
        h = plot_h * c / cmax
        x = left + i * bw
        fill = PALETTE[2] if highlight_from is not None and i >= highlight_from else color
        label = bin_labels[i] if i < len(bin_labels) else str(i)
        out.append(
            f'<rect x="{x + 1:.1f}" y="{base - h:.1f}" width="{bw - 2:.1f}" '
            f'height="{h:.1f}" fill="{fill}"><title>{escape(label)}: {c:,}</title></rect>'
        )
        if c:
            out.append(
                f'<text x="{x + bw / 2:.1f}" y="{base - h - 3:.1f}" text-anchor="middle" '
                f'font-size="9">{c:,}</text>'
            )
        if i % 2 == 0 or i == n - 1:
            out.append(
                f'<text x="{x + bw / 2:.1f}" y="{base + 13}" text-anchor="middle" '
                f'font-size="9" fill="#555">{escape(label)}</text>'
            )
    out.append(f'<line x1="{left}" y1="{base}" x2="{width - right}" y2="{base}" stroke="#888"/>')
    if x_title:
        out.append(
            f'<text x="{left + plot_w / 2:.1f}" y="{height - 8}" text-anchor="middle" '
            f'fill="#555" font-size="10">{escape(x_title)}</text>'
        )
    out.append("</svg>")
    return "".join(out)


def sparkline(
    values: Sequence[float | int | None],
    *,
    title: str,
    percent: bool = False,
    width: int = 160,
    height: int = 34,
) -> str:
    """A small line over a series (oldest left), its first and last value as text."""
    pts = [(i, float(v)) for i, v in enumerate(values) if v is not None]
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{escape(title)}" font-family="system-ui, sans-serif" font-size="10">'
        f"<title>{escape(title)}</title>"
    ]

    def fmt(v: float) -> str:
        return f"{100 * v:.0f}%" if percent else _fmt(v)

    if pts:
        lo = min(v for _, v in pts)
        hi = max(v for _, v in pts)
        span = (hi - lo) or 1.0
        left, right, pad = 34, 40, 4
        n = max(len(values) - 1, 1)
        xy = [
            (
                left + (width - left - right) * i / n,
                pad + (height - 2 * pad) * (1 - (v - lo) / span),
            )
            for i, v in pts
        ]
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
        out.append(
            f'<polyline points="{path}" fill="none" stroke="{PALETTE[0]}" stroke-width="1.5"/>'
        )
        for x, y in xy:
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2" fill="{PALETTE[0]}"/>')
        out.append(
            f'<text x="{left - 3}" y="{height / 2 + 3:.1f}" text-anchor="end" fill="#555">'
            f"{escape(fmt(pts[0][1]))}</text>"
            f'<text x="{width - right + 3}" y="{height / 2 + 3:.1f}">'
            f"{escape(fmt(pts[-1][1]))}</text>"
        )
    else:
        out.append(f'<text x="2" y="{height / 2 + 3:.1f}" fill="#777">no data</text>')
    out.append("</svg>")
    return "".join(out)


def legend(items: Sequence[tuple[str, str]]) -> str:
    """A one-line legend (HTML, not SVG): (color, label)."""
    parts = [
        f'<span class="key"><span class="swatch" style="background:{c}"></span>'
        f"{escape(label)}</span>"
        for c, label in items
    ]
    return '<div class="legend">' + " ".join(parts) + "</div>"

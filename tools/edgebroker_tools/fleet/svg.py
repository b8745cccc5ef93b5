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
    edges_labels: Sequence[str],
    *,
    title: str,
    color: str = PALETTE[0],
    highlight_from: int | None = None,
    width: int = 300,
    height: int = 150,
) -> str:
    """Vertical bars, one per bin; bins from highlight_from on are drawn in red."""
    n = max(len(counts), 1)
    top, bottom, left = 24, 30, 8
    plot_h = height - top - bottom
    bw = (width - 2 * left) / n
    cmax = max(counts, default=0) or 1
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{escape(title)}" {FONT}>',
        f'<text x="0" y="14" font-weight="bold">{escape(title)}</text>',
    ]
    for i, c in enumerate(counts):
        h = plot_h * c / cmax
        x = left + i * bw
        fill = PALETTE[2] if highlight_from is not None and i >= highlight_from else color
        label = edges_labels[i] if i < len(edges_labels) else str(i)
        out.append(
            f'<rect x="{x + 1:.1f}" y="{top + plot_h - h:.1f}" width="{bw - 2:.1f}" '
            f'height="{h:.1f}" fill="{fill}"><title>{escape(label)}: {c}</title></rect>'
        )
    out.append(
        f'<line x1="{left}" y1="{top + plot_h}" x2="{width - left}" y2="{top + plot_h}" '
        f'stroke="#888"/>'
    )
    if edges_labels:
        out.append(
            f'<text x="{left}" y="{height - 12}" fill="#555">{escape(edges_labels[0])}</text>'
            f'<text x="{width - left}" y="{height - 12}" text-anchor="end" fill="#555">'
            f"{escape(edges_labels[-1])}</text>"
        )
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

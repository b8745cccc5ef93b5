"""Results: metrics with samples per broker, medians, ratios to a reference
broker, pass/fail targets; the table and the JSON."""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from edgebroker_tools.bench.common import BROKERS, EDGE, SHORT, BrokerName

TargetKind = Literal["ratio>=", "ratio<=", "<=", ">="]


@dataclass(frozen=True)
class Target:
    """A pass/fail threshold on one broker's median (absolute, or relative to
    the `ref` broker's median in the same run: mosquitto unless said)."""

    broker: BrokerName
    kind: TargetKind
    threshold: float
    unit: str = ""
    ref: BrokerName = "mosquitto"

    def describe(self) -> str:
        short = SHORT[self.broker]
        if self.kind.startswith("ratio"):
            op = self.kind[5:]
            if self.kind == "ratio>=":
                return f"{short}{op}{self.threshold:.0%} of {SHORT[self.ref]}"
            return f"{short}{op}{self.threshold:g}x {SHORT[self.ref]}"
        return f"{short}{self.kind}{fmt_value(self.threshold, self.unit)}"

    def check(self, metric: Metric) -> bool | None:
        value = (
            metric.ratio(self.broker, self.ref)
            if self.kind.startswith("ratio")
            else metric.median(self.broker)
        )
        if value is None:
            return None
        if self.kind in ("ratio>=", ">="):
            return value >= self.threshold
        return value <= self.threshold


@dataclass
class Metric:
    """One row: samples per broker, medians, ratios to mosquitto, targets."""

    scenario: str
    name: str
    unit: str
    ratio_mode: Literal["value", "none"] = "value"
    samples: dict[str, list[float]] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)
    note: str = ""

    def add(self, broker: str, value: float | None) -> None:
        if value is not None and math.isfinite(value):
            self.samples.setdefault(broker, []).append(value)
        else:
            self.samples.setdefault(broker, [])

    def median(self, broker: str) -> float | None:
        values = self.samples.get(broker)
        if not values:
            return None
        return float(statistics.median(values))

    def ratio(self, broker: str, against: str = "mosquitto") -> float | None:
        if self.ratio_mode == "none":
            return None
        mine = self.median(broker)
        ref = self.median(against)
        if mine is None or ref is None or ref == 0:
            return None
        return mine / ref


@dataclass
class Report:
    metrics: list[Metric] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def metric(
        self,
        scenario: str,
        name: str,
        unit: str,
        ratio_mode: Literal["value", "none"] = "value",
        targets: Sequence[Target] = (),
        note: str = "",
    ) -> Metric:
        for existing in self.metrics:
            if existing.scenario == scenario and existing.name == name:
                return existing
        created = Metric(scenario, name, unit, ratio_mode, {}, list(targets), note)
        self.metrics.append(created)
        return created

    def problem(self, text: str) -> None:
        if text in self.problems:
            return
        self.problems.append(text)
        first = text.splitlines()[0] if text else text
        print(f"  ! {first}", file=sys.stderr, flush=True)


def fmt_value(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "msg/s":
        return f"{value:,.0f}"
    if unit == "us":
        return f"{value:,.0f} us" if value >= 100 else f"{value:.1f} us"
    if unit == "s":
        return f"{value:.3f} s"
    if unit == "ms":
        return f"{value:.2f} ms"
    if unit == "/s":
        return f"{value:.1f}/s"
    if unit == "B":
        if abs(value) >= 10_240:
            return f"{value / 1024:,.1f} KB"
        return f"{value:,.0f} B"
    if unit == "kB":
        return f"{value:,.0f} kB"
    if unit == "count":
        return f"{value:,.0f}"
    if unit == "%":
        return f"{value:.1f}%"
    if unit == "x":
        return f"{value:.3f}"
    if unit == "B/msg":
        return f"{value:.1f} B"
    return f"{value:g}"


def fmt_ratio(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 0.1:
        return f"{value:.2f}x"
    return f"{value:.3f}x"


#: The ratio columns of the table: (broker, reference).
RATIOS: tuple[tuple[BrokerName, BrokerName], ...] = (
    ("cpython", "mosquitto"),
    ("cpython-async", "mosquitto"),
    ("micropython", "mosquitto"),
    ("micropython-async", "micropython"),
)


def render_table(report: Report, brokers: Sequence[BrokerName]) -> str:
    shown = [b for b in BROKERS if b in brokers]
    ratios = [(b, r) for b, r in RATIOS if b in brokers and r in brokers]
    header = ["scenario", "metric", *shown]
    header += [f"{SHORT[b]}/{SHORT[r]}" for b, r in ratios] + ["targets"]
    rows: list[list[str]] = []
    for metric in report.metrics:
        row = [metric.scenario, metric.name]
        for broker in shown:
            cell = fmt_value(metric.median(broker), metric.unit)
            count = len(metric.samples.get(broker, []))
            if metric.unit in ("msg/s", "us", "s", "ms") and count > 1:
                cell += f" ({count})"
            row.append(cell)
        row += [fmt_ratio(metric.ratio(b, r)) for b, r in ratios]
        marks = []
        for target in metric.targets:
            if target.broker not in brokers:
                continue
            ok = target.check(metric)
            mark = "n/a" if ok is None else ("PASS" if ok else "FAIL")
            marks.append(f"{target.describe()} {mark}")
        row.append("; ".join(marks))
        rows.append(row)
    widths = [len(h) for h in header]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        cells = [
            c.ljust(w) if i < 2 or i == len(row) - 1 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def report_json(report: Report, config: dict[str, Any]) -> dict[str, Any]:
    metrics = []
    for metric in report.metrics:
        metrics.append(
            {
                "scenario": metric.scenario,
                "metric": metric.name,
                "unit": metric.unit,
                "samples": metric.samples,
                "median": {b: metric.median(b) for b in metric.samples},
                "ratio_to_mosquitto": {b: metric.ratio(b) for b in EDGE if b in metric.samples},
                "ratio_async_to_poll": {
                    b: metric.ratio(b, b[: -len("-async")])
                    for b in EDGE
                    if b.endswith("-async") and b in metric.samples
                },
                "targets": [
                    {"target": t.describe(), "pass": t.check(metric)} for t in metric.targets
                ],
                "note": metric.note,
            }
        )
    return {
        "config": config,
        "metrics": metrics,
        "notes": report.notes,
        "problems": report.problems,
    }

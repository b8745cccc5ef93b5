"""`fleet report`: the warehouse as a terminal summary and one self-contained HTML page.

Reads the Parquet tables with pyarrow (no Spark: a report takes about a
second even for millions of fleet_state rows, reading only the columns it
needs). The page has no script and loads nothing: its charts are inline
SVG (utilisation against the profiles' limits per board, stale topics by
cause, limits advice per board) and its tables plain HTML.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any, Final, cast

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from edgebroker_tools.fleet import svg
from edgebroker_tools.fleet.schema import BUILD_LOG

STALE_REASONS: Final = ("gone", "expired", "gateway_silent")
STALE_COLORS: Final = {
    "fresh": "#59a14f",
    "gone": "#e15759",
    "expired": "#f28e2b",
    "gateway_silent": "#9c755f",
}
UTIL_METRICS: Final = (
    ("retained_util", "retained count / max_retained_messages"),
    ("bytes_util", "retained bytes / store_budget_bytes"),
    ("payload_util", "largest payload / max_payload_size"),
)
BINS: Final = 11  # 0-10%, ..., 90-100%, over 100%
LIMITS: Final = (
    ("max_retained_messages", "max_retained_messages"),
    ("max_payload_size", "max_payload_size"),
    ("store_budget_bytes", "store_budget_bytes"),
)


class ReportError(Exception):
    """The directory is not a built warehouse."""


@dataclass
class BoardUtil:
    board: str
    gateways: int
    near_limit: int
    low_heap: int
    refusing: int
    quantiles: dict[str, tuple[float, float, float]]  # metric -> (p50, p90, max)
    histograms: dict[str, list[int]]


@dataclass
class Data:
    warehouse: Path
    build: dict[str, Any]
    as_of: str | None
    collections: int
    gateways: int
    topics: int
    history_rows: int
    boards: list[BoardUtil] = field(default_factory=list)
    stale: dict[str, dict[str, int]] = field(default_factory=dict)  # board -> reason -> n
    stale_top: list[dict[str, Any]] = field(default_factory=list)
    near_top: list[dict[str, Any]] = field(default_factory=list)
    advice: list[dict[str, Any]] = field(default_factory=list)


def _table(warehouse: Path, name: str, columns: list[str] | None = None) -> pa.Table:
    path = warehouse / name
    if not path.is_dir():
        raise ReportError(f"{warehouse} has no {name} table: run `edgebroker fleet build` first")
    try:
        return pq.read_table(path, columns=columns)
    except (OSError, pa.ArrowException) as exc:
        raise ReportError(f"cannot read {path}: {exc}") from None


def _count_true(values: list[Any]) -> int:
    return sum(1 for v in values if v)


def _quantiles(values: pa.ChunkedArray[Any]) -> tuple[float, float, float]:
    valid = pc.drop_null(values)
    if len(valid) == 0:
        return (0.0, 0.0, 0.0)
    quantile = cast("Callable[..., pa.Array[Any]]", pc.quantile)  # stubs: q is one float
    q = cast(list[float], quantile(valid, q=[0.5, 0.9]).to_pylist())
    return (q[0], q[1], float(max(cast(list[float], valid.to_pylist()))))


def _hist(values: pa.ChunkedArray[Any]) -> list[int]:
    counts = [0] * BINS
    for v in cast(list[float], pc.drop_null(values).to_pylist()):
        counts[BINS - 1 if v > 1 else min(int(v * 10), BINS - 2)] += 1
    return counts


def load(warehouse: Path) -> Data:
    """Everything the report shows, aggregated with pyarrow."""
    if not warehouse.is_dir():
        raise ReportError(f"no such warehouse: {warehouse}")
    build: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        build = json.loads((warehouse / BUILD_LOG).read_text(encoding="utf-8"))
    health = _table(warehouse, "gateway_health")
    latest = health.filter(health.column("is_latest"))
    state = _table(
        warehouse, "fleet_state", ["gateway_id", "board", "topic", "stale_reason", "last_seen"]
    )
    history_rows = (
        pq.ParquetDataset(str(warehouse / "topic_history")).read(columns=["segment"]).num_rows
    )
    data = Data(
        warehouse=warehouse,
        build=build,
        as_of=cast("str | None", build.get("as_of")),
        collections=health.num_rows,
        gateways=latest.num_rows,
        topics=state.num_rows,
        history_rows=history_rows,
    )
    for board in sorted(cast(list[str], pc.unique(latest.column("board")).to_pylist())):
        rows = latest.filter(pc.equal(latest.column("board"), pa.scalar(board)))
        data.boards.append(
            BoardUtil(
                board=board,
                gateways=rows.num_rows,
                near_limit=_count_true(rows.column("near_limit").to_pylist()),
                low_heap=_count_true(rows.column("low_heap").to_pylist()),
                refusing=_count_true(
                    [(n or 0) > 0 for n in rows.column("retained_refusals").to_pylist()]
                ),
                quantiles={m: _quantiles(rows.column(m)) for m, _ in UTIL_METRICS},
                histograms={m: _hist(rows.column(m)) for m, _ in UTIL_METRICS},
            )
        )
    reasons = pc.fill_null(state.column("stale_reason"), pa.scalar("fresh"))
    counted = (
        pa.table({"board": state.column("board"), "reason": reasons})
        .group_by(["board", "reason"])
        .aggregate([("reason", "count")])
    )
    for row in counted.to_pylist():
        data.stale.setdefault(str(row["board"]), {})[str(row["reason"])] = int(row["reason_count"])
    stale = state.filter(pc.is_valid(state.column("stale_reason")))
    per_gw = (
        stale.group_by(["gateway_id", "board"])
        .aggregate([("topic", "count")])
        .sort_by([("topic_count", "descending"), ("gateway_id", "ascending")])
    )
    data.stale_top = per_gw.slice(0, 50).to_pylist()
    near = latest.filter(latest.column("near_limit")).select(
        ["gateway_id", "board", "retained_util", "bytes_util", "payload_util", "heap_free",
         "low_heap", "retained_refusals"]
    ).to_pylist()  # fmt: skip

    def worst(r: dict[str, Any]) -> float:
        return max(float(r[m] or 0.0) for m, _ in UTIL_METRICS)

    near.sort(key=lambda r: (-worst(r), str(r["gateway_id"])))
    data.near_top = [
        {**r, **{m: _pct(cast("float | None", r[m])) for m, _ in UTIL_METRICS}} for r in near[:50]
    ]
    advice = _table(warehouse, "limits_advice")
    data.advice = sorted(advice.to_pylist(), key=lambda r: str(r["board"]))
    return data


# ------------------------------------------------------------------- text
def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def text_summary(data: Data, top: int = 10) -> str:
    b = data.build
    lines = [
        f"warehouse {data.warehouse}  (as of {data.as_of or '-'})",
        f"  {data.gateways} gateways, {data.collections} collections, {data.topics} topics, "
        f"{data.history_rows} topic_history rows",
    ]
    if b:
        lines.append(
            f"  last build {b.get('build_id')}: {len(b.get('ingested', []))} file(s) ingested, "
            f"{len(b.get('skipped', []))} skipped, {b.get('seconds', 0):.1f} s"
        )
        for entry in b.get("skipped", []):
            lines.append(f"    skipped {entry.get('path')}: {entry.get('error')}")
    lines.append("")
    lines.append("utilisation (latest collection per gateway): p50 / p90 / max")
    lines.append(
        f"  {'board':<16}{'gws':>6}  {'retained':>18}  {'bytes':>18}  {'payload':>18}  "
        f"{'near':>5} {'heap':>5} {'refused':>7}"
    )
    for u in data.boards:
        cells = [" / ".join(_pct(x) for x in u.quantiles[m]) for m, _ in UTIL_METRICS]
        lines.append(
            f"  {u.board:<16}{u.gateways:>6}  {cells[0]:>18}  {cells[1]:>18}  {cells[2]:>18}  "
            f"{u.near_limit:>5} {u.low_heap:>5} {u.refusing:>7}"
        )
    lines.append("")
    lines.append("stale topics (fleet_state):")
    for board, counts in sorted(data.stale.items()):
        total = sum(counts.values())
        stale = total - counts.get("fresh", 0)
        detail = ", ".join(f"{r} {counts[r]}" for r in STALE_REASONS if counts.get(r))
        lines.append(f"  {board:<16}{stale:>8} of {total:<8} {detail}")
    if data.stale_top:
        lines.append(
            "  most stale topics: "
            + ", ".join(f"{r['gateway_id']} ({r['topic_count']})" for r in data.stale_top[:top])
        )
    lines.append("")
    lines.append("limits advice (edgebroker config apply BOARD WAREHOUSE/patches/BOARD.json):")
    for a in data.advice:
        lines.append(
            f"  {a['board']:<16}max_retained_messages {a['current_max_retained_messages']} -> "
            f"{a['suggested_max_retained_messages']}, max_payload_size "
            f"{a['current_max_payload_size']} -> {a['suggested_max_payload_size']}, "
            f"store_budget_bytes {a['current_store_budget_bytes']} -> "
            f"{a['suggested_store_budget_bytes']}  [{a['check_status']}]"
        )
        for err in a.get("check_errors") or []:
            lines.append(f"      {err}")
    return "\n".join(lines)


# ------------------------------------------------------------------- HTML
CSS: Final = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5em 0}td,th{padding:3px 8px;border-bottom:1px solid #eee;
text-align:right}td:first-child,th:first-child{text-align:left}th{background:#f5f5f5}
.grid{display:flex;flex-wrap:wrap;gap:12px}.chart{background:#fff}
.legend{margin:.3em 0}.key{margin-right:1em}.swatch{display:inline-block;width:10px;height:10px;
margin-right:4px}.bad{color:#c00}.ok{color:#080}.muted{color:#777}
"""


def _cell(v: Any) -> str:
    if v is None:
        return '<td class="muted">-</td>'
    if isinstance(v, float):
        return f"<td>{v:,.2f}</td>"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"<td>{v:,}</td>"
    return f"<td>{escape(str(v))}</td>"


def _html_table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    head = "".join(f"<th>{escape(title)}</th>" for _, title in columns)
    body = "".join("<tr>" + "".join(_cell(r.get(k)) for k, _ in columns) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _utilisation(data: Data) -> str:
    parts = [
        "<h2>Utilisation against limits</h2>",
        "<p>Latest collection of each gateway, against its profile's limits. Bars: p50, "
        "p90 and max; the dashed line is the near-limit threshold.</p>",
    ]
    for metric, title in UTIL_METRICS:
        bars = []
        for u in data.boards:
            p50, p90, mx = u.quantiles[metric]
            bars.append(
                svg.Bar(
                    u.board,
                    [
                        svg.Segment(p50, svg.PALETTE[0], f"p50 {_pct(p50)}"),
                        svg.Segment(max(p90 - p50, 0), svg.PALETTE[3], f"p90 {_pct(p90)}"),
                        svg.Segment(max(mx - p90, 0), svg.PALETTE[2], f"max {_pct(mx)}"),
                    ],
                    note=f"{_pct(p50)} / {_pct(p90)} / {_pct(mx)}",
                )
            )
        parts.append(
            svg.hbars(bars, title=title, scale_max=1.0, marks=[(0.9, "90%"), (1.0, "100%")])
        )
    parts.append(
        svg.legend([(svg.PALETTE[0], "p50"), (svg.PALETTE[3], "p90"), (svg.PALETTE[2], "max")])
    )
    labels = [f"{10 * i}-{10 * i + 10}%" for i in range(BINS - 1)] + [">100%"]
    parts.append("<div class='grid'>")
    for u in data.boards:
        parts.append(
            svg.histogram(
                u.histograms["retained_util"],
                labels,
                title=f"{u.board}: retained count / limit",
                highlight_from=9,
            )
        )
    parts.append("</div>")
    parts.append(
        _html_table(
            [vars(u) | {"gateways": u.gateways} for u in data.boards],
            [
                ("board", "board"),
                ("gateways", "gateways"),
                ("near_limit", "near a limit"),
                ("low_heap", "low heap"),
                ("refusing", "refusing retained"),
            ],
        )
    )
    if data.near_top:
        parts.append("<h3>Gateways nearest their limits</h3>")
        parts.append(
            _html_table(
                data.near_top[:20],
                [
                    ("gateway_id", "gateway"),
                    ("board", "board"),
                    ("retained_util", "retained"),
                    ("bytes_util", "bytes"),
                    ("payload_util", "payload"),
                    ("heap_free", "free heap"),
                    ("retained_refusals", "refusals"),
                ],
            )
        )
    return "".join(parts)


def _stale(data: Data, top: int) -> str:
    bars = []
    for board, counts in sorted(data.stale.items()):
        segs = [
            svg.Segment(float(counts.get(r, 0)), STALE_COLORS[r], f"{r} {counts.get(r, 0):,}")
            for r in ("fresh", *STALE_REASONS)
        ]
        stale = sum(counts.get(r, 0) for r in STALE_REASONS)
        total = sum(counts.values())
        bars.append(svg.Bar(board, segs, note=f"{stale:,} stale of {total:,}"))
    parts = [
        "<h2>Stale topics</h2>",
        "<p>fleet_state: a topic is stale when its latest value is gone from the gateway, "
        "expired, or the gateway has not been collected recently.</p>",
        svg.hbars(bars, title="topics per board by state"),
        svg.legend([(STALE_COLORS[r], r) for r in ("fresh", *STALE_REASONS)]),
    ]
    if data.stale_top:
        parts.append(f"<h3>Gateways with the most stale topics (top {top})</h3>")
        parts.append(
            _html_table(
                data.stale_top[:top],
                [("gateway_id", "gateway"), ("board", "board"), ("topic_count", "stale topics")],
            )
        )
    return "".join(parts)


def _advice(data: Data) -> str:
    parts = [
        "<h2>Limits advice per board</h2>",
        "<p>From the fleet's distributions (p99 and max of each gateway's latest "
        "collection, times the headroom). Each board's patch is in "
        "<code>patches/&lt;board&gt;.json</code>: "
        "<code>edgebroker config apply &lt;board&gt; patches/&lt;board&gt;.json</code> "
        "checks it against the heap and flash models.</p>",
        "<div class='grid'>",
    ]
    for key, title in LIMITS:
        bars = []
        for a in data.advice:
            cur = float(a.get(f"current_{key}") or 0)
            sug = float(a.get(f"suggested_{key}") or 0)
            bars.append(
                svg.Bar(
                    f"{a['board']} now", [svg.Segment(cur, svg.PALETTE[0], f"current {cur:,.0f}")]
                )
            )
            bars.append(
                svg.Bar(
                    f"{a['board']} advice",
                    [svg.Segment(sug, svg.PALETTE[1], f"suggested {sug:,.0f}")],
                )
            )
        parts.append(svg.hbars(bars, title=title, width=520, label_width=150))
    parts.append("</div>")
    parts.append(svg.legend([(svg.PALETTE[0], "current"), (svg.PALETTE[1], "suggested")]))
    rows = []
    for a in data.advice:
        errors = a.get("check_errors") or []
        status = escape(str(a.get("check_status")))
        cls = "ok" if a.get("check_status") == "ok" else "bad"
        rows.append(
            {**a, "check": status + (": " + "; ".join(errors) if errors else ""), "_cls": cls}
        )
    parts.append(
        _html_table(
            rows,
            [
                ("board", "board"),
                ("gateways", "gateways"),
                ("retained_count_p99", "count p99"),
                ("suggested_max_retained_messages", "count"),
                ("max_payload_max", "payload max"),
                ("suggested_max_payload_size", "payload"),
                ("retained_bytes_p99", "bytes p99"),
                ("suggested_store_budget_bytes", "budget"),
                ("check", "config check"),
            ],
        )
    )
    return "".join(parts)


def html_page(data: Data, top: int = 10) -> str:
    """The whole report as one HTML document (no external resources)."""
    b = data.build
    skipped = b.get("skipped", []) if b else []
    summary = (
        f"<p>{data.gateways:,} gateways, {data.collections:,} collections, "
        f"{data.topics:,} topics in fleet_state, {data.history_rows:,} topic_history rows; "
        f"as of {escape(str(data.as_of))}.</p>"
    )
    if skipped:
        summary += (
            "<p class='bad'>The last build skipped "
            + ", ".join(
                f"{escape(str(s.get('path')))} ({escape(str(s.get('error')))})" for s in skipped
            )
            + ".</p>"
        )
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>edgebroker fleet report</title><style>{CSS}</style></head><body>"
        f"<h1>edgebroker fleet report</h1>{summary}"
        f"{_utilisation(data)}{_stale(data, top)}{_advice(data)}"
        "</body></html>\n"
    )

"""`fleet report`: the warehouse as a terminal summary and one self-contained HTML page.

Reads the tables of the warehouse's latest commit (schema.py) with pyarrow
(no Spark: a report takes about a second even for millions of fleet_state
rows, reading only the columns it needs) from a local path or file://,
hdfs:// or s3:// URI. The page has no script and loads nothing: its charts
are inline SVG and its tables plain HTML. In reading order:

1. Gateways to look at first: every gateway's latest collection ranked by
   how close it is to its nearest limit (heap reserve, clients, retained
   count, store bytes, payload), with that limit named; any refusal puts a
   gateway at its limit. Refusals by cause and dropped messages beside.
2. Gateways that could not be collected (collect_status: the latest
   attempt failed), with the last error and the last success.
3. Low heap: gateways whose free heap is below twice the reserve, by name.
4. Trends over the collections of the worst gateways (sparklines).
5. Per board: histograms of each utilisation (gateways per bin, with axes).
6. Stale topics, 7. limits advice (with the reason for every suggestion).

check_html_target() checks the page's path before the warehouse is read and
write_html() writes it; either raises outputs.OutputError (one line naming
--html) instead of an OSError.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any, Final, cast

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from edgebroker_tools.fleet import hfs, outputs, svg
from edgebroker_tools.fleet.schema import COMMITS, PATCHES, latest_commit

STALE_REASONS: Final = ("gone", "expired", "gateway_silent")
STALE_COLORS: Final = {
    "fresh": "#59a14f",
    "gone": "#e15759",
    "expired": "#f28e2b",
    "gateway_silent": "#9c755f",
}
#: (column, limit named in the report, what it measures)
UTIL_METRICS: Final = (
    ("heap_util", "heap", "heap_reserve / free heap"),
    ("clients_util", "clients", "clients connected / max_clients"),
    ("retained_util", "retained count", "retained count / max_retained_messages"),
    ("bytes_util", "store bytes", "retained bytes / store_budget_bytes"),
    ("payload_util", "payload", "largest payload / max_payload_size"),
)
BINS: Final = 11  # 0-10%, ..., 90-100%, over 100%
BIN_LABELS: Final = (*(f"{10 * i}%" for i in range(BINS - 1)), ">100%")
LIMITS: Final = (
    ("max_retained_messages", "max_retained_messages"),
    ("max_payload_size", "max_payload_size"),
    ("store_budget_bytes", "store_budget_bytes"),
)
HEALTH_READ: Final = [
    "gateway_id", "board", "collected_at", "is_latest", "retained_count", "retained_bytes",
    "max_payload_bytes", "limit_max_retained_messages", "limit_max_payload_size",
    "limit_store_budget_bytes", "limit_heap_reserve", "limit_max_clients", "retained_util",
    "bytes_util", "payload_util", "heap_util", "clients_util", "sys_retained_count",
    "sys_retained_bytes", "heap_free", "clients_connected", "messages_dropped", "refusals",
    "refusals_total", "retained_refusals", "near_limit", "low_heap",
]  # fmt: skip
TREND_GATEWAYS: Final = 10
#: How a gateway whose snapshots named no board is shown (it gets no limits advice).
NO_BOARD: Final = "(unknown)"


class ReportError(Exception):
    """The location is not a built warehouse."""


@dataclass
class BoardUtil:
    board: str
    gateways: int
    near_limit: int
    low_heap: int
    refusing: int
    # metric -> (p50, p90, max); None when no gateway of the board sent it
    quantiles: dict[str, tuple[float | None, float | None, float | None]]
    histograms: dict[str, list[int]]


@dataclass
class Data:
    warehouse: str
    build: dict[str, Any]
    as_of: str | None
    collections: int
    gateways: int
    topics: int
    history_rows: int
    patches: str = PATCHES
    boards: list[BoardUtil] = field(default_factory=list)
    stale: dict[str, dict[str, int]] = field(default_factory=dict)  # board -> reason -> n
    stale_top: list[dict[str, Any]] = field(default_factory=list)
    attention: list[dict[str, Any]] = field(default_factory=list)  # ranked, worst first
    low_heap: list[dict[str, Any]] = field(default_factory=list)
    trends: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    failed: list[dict[str, Any]] = field(default_factory=list)
    advice: list[dict[str, Any]] = field(default_factory=list)


# ------------------------------------------------------------------- read
class _Warehouse:
    """A warehouse location through pyarrow's filesystems (local, file://, hdfs://, s3://)."""

    def __init__(self, location: str) -> None:
        self.location = location
        if hfs.is_local(location):
            self.fs: pafs.FileSystem = pafs.LocalFileSystem()
            self.root = os.path.abspath(hfs.local_path(location))  # noqa: PTH100
        else:
            try:
                self.fs, self.root = pafs.FileSystem.from_uri(location)
            except (pa.ArrowException, ValueError) as exc:
                raise ReportError(
                    f"cannot open {location}: {exc} (the report reads local, file://, "
                    "hdfs:// and s3:// warehouses)"
                ) from None
        info = self.fs.get_file_info(self.root)
        if info.type != pafs.FileType.Directory:
            raise ReportError(f"no such warehouse: {location}")
        self.commit = self._commit()

    def path(self, rel: str) -> str:
        return f"{self.root.rstrip('/')}/{rel}"

    def _commit(self) -> dict[str, Any]:
        sel = pafs.FileSelector(self.path(COMMITS), allow_not_found=True)
        names = [i.base_name for i in self.fs.get_file_info(sel)]
        name = latest_commit(names)
        if name is None:
            raise ReportError(
                f"{self.location} has no committed build: run `edgebroker fleet build` first"
            )
        with self.fs.open_input_stream(self.path(f"{COMMITS}/{name}")) as f:
            return cast(dict[str, Any], json.loads(f.read().decode("utf-8")))

    def table(self, name: str, columns: list[str] | None = None) -> pa.Table:
        rel = dict(self.commit.get("tables", {})).get(name)
        if rel is None:
            raise ReportError(f"{self.location}'s latest build has no {name} table")
        path = self.path(str(rel))
        try:
            if columns is not None:
                have = set(pq.ParquetDataset(path, filesystem=self.fs).schema.names)
                columns = [c for c in columns if c in have]
            return pq.read_table(path, columns=columns, filesystem=self.fs)
        except (OSError, pa.ArrowException) as exc:
            raise ReportError(f"cannot read {path}: {exc}") from None


def _count_true(values: list[Any]) -> int:
    return sum(1 for v in values if v)


def _quantiles(values: pa.ChunkedArray[Any]) -> tuple[float | None, float | None, float | None]:
    """(p50, p90, max) of the values sent; (None, None, None) when none was: no data, not 0%."""
    valid = cast(list[float], pc.drop_null(values).to_pylist())
    if not valid:
        return (None, None, None)
    valid.sort()

    def q(p: float) -> float:  # linear interpolation, like numpy's default
        pos = p * (len(valid) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(valid) - 1)
        return valid[lo] + (valid[hi] - valid[lo]) * (pos - lo)

    return (q(0.5), q(0.9), valid[-1])


def _hist(values: pa.ChunkedArray[Any]) -> list[int]:
    counts = [0] * BINS
    for v in cast(list[float], pc.drop_null(values).to_pylist()):
        counts[BINS - 1 if v > 1 else min(int(v * 10), BINS - 2)] += 1
    return counts


def _refusal_text(refusals: Any) -> str:
    pairs = dict(refusals) if refusals else {}
    return ", ".join(f"{k} {v:,}" for k, v in sorted(pairs.items()) if v) or ""


def _limit_detail(metric: str, r: dict[str, Any]) -> str:
    def n(v: Any) -> str:
        return "-" if v is None else f"{int(v):,}"

    count = r["sys_retained_count"] if r["sys_retained_count"] is not None else r["retained_count"]
    nbytes = r["sys_retained_bytes"] if r["sys_retained_bytes"] is not None else r["retained_bytes"]
    return {
        "heap_util": f"free {n(r['heap_free'])} B, reserve {n(r['limit_heap_reserve'])} B",
        "clients_util": f"{n(r['clients_connected'])} of {n(r['limit_max_clients'])} clients",
        "retained_util": f"{n(count)} of {n(r['limit_max_retained_messages'])} messages",
        "bytes_util": f"{n(nbytes)} of {n(r['limit_store_budget_bytes'])} B",
        "payload_util": f"{n(r['max_payload_bytes'])} of {n(r['limit_max_payload_size'])} B",
    }[metric]


def rank(latest: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Gateways by how close each is to its nearest limit, worst first, that limit named.

    Any refusal puts a gateway at least at its limit (it has already refused
    something); ties go to more refusals, then more drops, then less heap.
    """
    out = []
    for r in latest:
        utils = [(float(r[m]), m, name) for m, name, _ in UTIL_METRICS if r.get(m) is not None]
        score, metric, name = max(utils, default=(0.0, "", "-"))
        refused = int(r.get("refusals_total") or 0)
        detail = _limit_detail(metric, r) if metric else ""
        if refused and score < 1.0:
            score, name, detail = 1.0, "refusals", _refusal_text(r.get("refusals"))
        out.append(
            {
                "gateway_id": r["gateway_id"],
                "board": r["board"],
                "score": score,
                "nearest": f"{100 * score:.0f}%",
                "limit": name,
                "detail": detail,
                "heap_free": r.get("heap_free"),
                "clients": r.get("clients_connected"),
                "refusals": _refusal_text(r.get("refusals")),
                "refusals_total": refused,
                "dropped": int(r.get("messages_dropped") or 0),
                "low_heap": bool(r.get("low_heap")),
            }
        )
    out.sort(
        key=lambda a: (
            -a["score"],
            -a["refusals_total"],
            -a["dropped"],
            a["heap_free"] if a["heap_free"] is not None else 1 << 62,
            str(a["gateway_id"]),
        )
    )
    return out


def _named_boards(table: pa.Table) -> pa.Table:
    """A null board (a snapshot that named none) shown as NO_BOARD."""
    i = table.schema.get_field_index("board")
    if i < 0 or table.column(i).null_count == 0:
        return table
    named = cast(
        "pa.ChunkedArray[Any]", pc.fill_null(table.column(i), pa.scalar(NO_BOARD, pa.string()))
    )
    return table.set_column(i, pa.field("board", pa.string()), named)


def load(warehouse: str) -> Data:
    """Everything the report shows, aggregated with pyarrow."""
    wh = _Warehouse(str(warehouse))
    build = cast(dict[str, Any], wh.commit.get("build") or {})
    health = _named_boards(wh.table("gateway_health", HEALTH_READ))
    latest = health.filter(health.column("is_latest"))
    state = _named_boards(wh.table("fleet_state", ["gateway_id", "board", "topic", "stale_reason"]))
    history_rows = wh.table("topic_history", ["segment"]).num_rows
    data = Data(
        warehouse=str(warehouse),
        build=build,
        as_of=cast("str | None", build.get("as_of")),
        collections=health.num_rows,
        gateways=latest.num_rows,
        topics=state.num_rows,
        history_rows=history_rows,
        patches=str(wh.commit.get("patches") or PATCHES),
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
                quantiles={m: _quantiles(rows.column(m)) for m, _, _ in UTIL_METRICS},
                histograms={m: _hist(rows.column(m)) for m, _, _ in UTIL_METRICS},
            )
        )
    latest_rows = latest.to_pylist()
    data.attention = rank(latest_rows)
    data.low_heap = sorted(
        (r for r in latest_rows if r["low_heap"]),
        key=lambda r: (r["heap_free"] if r["heap_free"] is not None else 0, str(r["gateway_id"])),
    )
    worst = {str(a["gateway_id"]) for a in data.attention[:TREND_GATEWAYS]}
    if worst:
        mask = pc.is_in(health.column("gateway_id"), pa.array(sorted(worst)))
        picked = health.filter(mask).select(
            ["gateway_id", "collected_at", "retained_util", "bytes_util", "heap_free"]
        )
        for r in picked.sort_by(
            [("gateway_id", "ascending"), ("collected_at", "ascending")]
        ).to_pylist():
            data.trends.setdefault(str(r["gateway_id"]), []).append(r)
    status = wh.table("collect_status")
    data.failed = sorted(
        (r for r in status.to_pylist() if r["status"] != "ok"),
        key=lambda r: str(r["gateway_id"]),
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
    advice = wh.table("limits_advice")
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
    lines.append(f"gateways to look at first (nearest limit, top {top}):")
    for a in data.attention[:top]:
        extra = "; ".join(
            x
            for x in (
                a["detail"],
                f"refused {a['refusals']}" if a["refusals"] and a["limit"] != "refusals" else "",
                f"dropped {a['dropped']:,}" if a["dropped"] else "",
            )
            if x
        )
        lines.append(
            f"  {a['gateway_id']:<20}{a['board']:<16}{a['nearest']:>7} {a['limit']:<15}{extra}"
        )
    if data.failed:
        lines.append("")
        lines.append(f"could not be collected ({len(data.failed)}):")
        for f in data.failed:
            lines.append(
                f"  {f['gateway_id']:<20}{f['address'] or '-':<22} {f['last_error'] or '-'}"
                f" (last ok: {f['last_ok_collected_at'] or 'never'})"
            )
    if data.low_heap:
        lines.append("")
        lines.append(
            "low heap (free < 2 x heap_reserve): "
            + ", ".join(f"{r['gateway_id']} ({r['heap_free']:,} B)" for r in data.low_heap[:top])
        )
    lines.append("")
    lines.append("utilisation (latest collection per gateway): p50 / p90 / max")
    lines.append(
        f"  {'board':<16}{'gws':>6}  "
        + "  ".join(f"{name:>18}" for _, name, _ in UTIL_METRICS)
        + f"  {'near':>5} {'heap':>5} {'refused':>7}"
    )
    for u in data.boards:
        cells = [" / ".join(_pct(x) for x in u.quantiles[m]) for m, _, _ in UTIL_METRICS]
        lines.append(
            f"  {u.board:<16}{u.gateways:>6}  "
            + "  ".join(f"{c:>18}" for c in cells)
            + f"  {u.near_limit:>5} {u.low_heap:>5} {u.refusing:>7}"
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
    lines.append(
        f"limits advice (edgebroker config apply BOARD WAREHOUSE/{data.patches}/BOARD.json):"
    )
    for a in data.advice:
        if a.get("status") != "advice":
            lines.append(f"  {a['board']:<16}{a['why_max_retained_messages']}")
            continue
        lines.append(f"  {a['board']:<16}[{a['check_status']}]")
        for key, _ in LIMITS:
            lines.append(f"      {a[f'why_{key}']}")
        for err in a.get("check_errors") or []:
            lines.append(f"      {err}")
    unnamed = _unnamed(data)
    if unnamed:
        lines.append(f"  {NO_BOARD:<16}{unnamed}")
    return "\n".join(lines)


def _unnamed(data: Data) -> str:
    """Why the gateways without a board have no advice ("" when there are none)."""
    n = sum(u.gateways for u in data.boards if u.board == NO_BOARD)
    return f"no advice: {n:,} gateway(s) whose snapshots name no board" if n else ""


# ------------------------------------------------------------------- HTML
CSS: Final = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1150px;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5em 0}td,th{padding:3px 8px;border-bottom:1px solid #eee;
text-align:right;vertical-align:middle}td:first-child,th:first-child{text-align:left}
th{background:#f5f5f5}td.text{text-align:left}
.grid{display:flex;flex-wrap:wrap;gap:12px}.chart{background:#fff}
.legend{margin:.3em 0}.key{margin-right:1em}.swatch{display:inline-block;width:10px;height:10px;
margin-right:4px}.bad{color:#c00}.ok{color:#080}.muted{color:#777}
"""


def _cell(v: Any, raw: bool = False) -> str:
    if raw:
        return f"<td>{v}</td>"
    if v is None or v == "":
        return '<td class="muted">-</td>'
    if isinstance(v, float):
        return f"<td>{v:,.2f}</td>"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"<td>{v:,}</td>"
    return f'<td class="text">{escape(str(v))}</td>'


def _html_table(
    rows: list[dict[str, Any]],
    columns: list[tuple[str, str]],
    table_id: str = "",
    raw: frozenset[str] = frozenset(),
) -> str:
    head = "".join(f"<th>{escape(title)}</th>" for _, title in columns)
    body = "".join(
        "<tr>" + "".join(_cell(r.get(k), k in raw) for k, _ in columns) + "</tr>" for r in rows
    )
    ident = f' id="{table_id}"' if table_id else ""
    return f"<table{ident}><tr>{head}</tr>{body}</table>"


def _attention(data: Data, top: int) -> str:
    parts = [
        "<h2 id='attention'>Gateways to look at first</h2>",
        "<p>Each gateway's latest collection, ranked by how close it is to its nearest "
        "limit (the limit is named; heap: the broker refuses connections and new retained "
        "topics once free heap falls below <code>heap_reserve</code>). A gateway that "
        "has refused anything is at its limit already.</p>",
    ]
    if not data.attention:
        return "".join([*parts, "<p>No gateway in the warehouse.</p>"])
    parts.append(
        _html_table(
            data.attention[: max(top, 20)],
            [
                ("gateway_id", "gateway"),
                ("board", "board"),
                ("nearest", "nearest limit"),
                ("limit", "limit"),
                ("detail", "detail"),
                ("heap_free", "free heap (B)"),
                ("clients", "clients"),
                ("refusals", "refusals by cause"),
                ("dropped", "dropped"),
            ],
            table_id="attention-table",
        )
    )
    return "".join(parts)


def _failed(data: Data) -> str:
    parts = ["<h2 id='unreachable'>Gateways that could not be collected</h2>"]
    if not data.failed:
        parts.append("<p>Every gateway's latest collect attempt succeeded (collect_log).</p>")
        return "".join(parts)
    parts.append(
        f"<p>{len(data.failed)} gateway(s) whose latest collect attempt failed: their tables "
        "hold their last successful collection, if any.</p>"
    )
    parts.append(
        _html_table(
            data.failed,
            [
                ("gateway_id", "gateway"),
                ("board", "board"),
                ("address", "address"),
                ("last_error", "last error"),
                ("attempts", "attempts"),
                ("last_run_id", "last run"),
                ("failed_runs", "failed runs"),
                ("last_ok_collected_at", "last collected"),
            ],
            table_id="unreachable-table",
        )
    )
    return "".join(parts)


def _low_heap(data: Data, top: int) -> str:
    parts = ["<h2 id='low-heap'>Low heap</h2>"]
    if not data.low_heap:
        parts.append("<p>No gateway has less than twice its heap_reserve free.</p>")
        return "".join(parts)
    parts.append(
        f"<p>{len(data.low_heap)} gateway(s) with free heap below 2 x heap_reserve, "
        "least free first.</p>"
    )
    parts.append(
        _html_table(
            data.low_heap[: max(top, 20)],
            [
                ("gateway_id", "gateway"),
                ("board", "board"),
                ("heap_free", "free heap (B)"),
                ("limit_heap_reserve", "heap_reserve (B)"),
                ("clients_connected", "clients"),
                ("collected_at", "collected"),
            ],
            table_id="low-heap-table",
        )
    )
    return "".join(parts)


def _trends(data: Data) -> str:
    parts = [
        "<h2 id='trends'>Trends of the worst gateways</h2>",
        "<p>Every collection of the gateways at the top of the first table, oldest to newest.</p>",
    ]
    if not data.trends:
        return "".join(parts)
    rows = []
    for a in data.attention[:TREND_GATEWAYS]:
        series = data.trends.get(str(a["gateway_id"]), [])
        cells = {"gateway_id": a["gateway_id"], "collections": len(series)}
        for key, title in (("retained_util", "retained"), ("bytes_util", "store bytes")):
            vals = [r[key] for r in series]
            cells[key] = svg.sparkline(vals, title=f"{a['gateway_id']} {title}", percent=True)
        heap = [r["heap_free"] for r in series]
        cells["heap_free"] = svg.sparkline(heap, title=f"{a['gateway_id']} free heap")
        rows.append(cells)
    parts.append(
        _html_table(
            rows,
            [
                ("gateway_id", "gateway"),
                ("collections", "collections"),
                ("retained_util", "retained count / limit"),
                ("bytes_util", "store bytes / budget"),
                ("heap_free", "free heap (B)"),
            ],
            table_id="trends-table",
            raw=frozenset({"retained_util", "bytes_util", "heap_free"}),
        )
    )
    return "".join(parts)


def _utilisation(data: Data) -> str:
    parts = [
        "<h2 id='boards'>Utilisation per board</h2>",
        "<p>Latest collection of each gateway against its profile's limits. Bars: p50, "
        "p90 and max; the dashed lines are 90% and 100%.</p>",
    ]
    for metric, _, title in UTIL_METRICS:
        bars = []
        for u in data.boards:
            p50, p90, mx = u.quantiles[metric]
            if p50 is None or p90 is None or mx is None:  # no gateway of the board sent it
                bars.append(svg.Bar(u.board, [], note="no data"))
                continue
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
    for u in data.boards:
        parts.append(f"<h3>{escape(u.board)}: {u.gateways:,} gateways</h3><div class='grid'>")
        for metric, _, title in UTIL_METRICS:
            parts.append(
                svg.histogram(
                    u.histograms[metric],
                    BIN_LABELS,
                    title=title,
                    x_title="utilisation (bin start)",
                    y_title="gateways",
                    highlight_from=9,
                )
            )
        parts.append("</div>")
    parts.append(
        _html_table(
            [vars(u) for u in data.boards],
            [
                ("board", "board"),
                ("gateways", "gateways"),
                ("near_limit", "near a limit"),
                ("low_heap", "low heap"),
                ("refusing", "refusing retained"),
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
        "<h2 id='stale'>Stale topics</h2>",
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
        "<h2 id='advice'>Limits advice per board</h2>",
        "<p>From each board's gateways' latest collections (p99 or maximum, times the "
        "headroom; a board whose gateways refused messages at a limit is cut there, so the "
        "advice is at least that limit times the headroom). A board with too few gateways "
        "or collections gets no advice. Each advised board's patch is in "
        f"<code>{escape(data.patches)}/&lt;board&gt;.json</code>: "
        "<code>edgebroker config apply &lt;board&gt; &lt;patch&gt;</code> checks it against "
        "the heap and flash models.</p>",
        "<div class='grid'>",
    ]
    advised = [a for a in data.advice if a.get("status") == "advice"]
    for key, title in LIMITS:
        bars = []
        for a in advised:
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
        if bars:
            parts.append(svg.hbars(bars, title=title, width=520, label_width=150))
    parts.append("</div>")
    if advised:
        parts.append(svg.legend([(svg.PALETTE[0], "current"), (svg.PALETTE[1], "suggested")]))
    rows = []
    for a in data.advice:
        errors = a.get("check_errors") or []
        why = (
            "<br>".join(escape(str(a.get(f"why_{k}"))) for k, _ in LIMITS)
            if a.get("status") == "advice"
            else escape(str(a.get("why_max_retained_messages")))
        )
        check = escape(str(a.get("check_status"))) + (
            ": " + escape("; ".join(errors)) if errors else ""
        )
        rows.append(
            {
                **a,
                "why": f'<span class="text">{why}</span>',
                "check": check,
                "sample": f"{a.get('gateways') or 0:,} gateways, {a.get('collections') or 0:,} "
                "collections",
            }
        )
    if _unnamed(data):
        rows.append({"board": NO_BOARD, "status": "-", "why": escape(_unnamed(data))})
    parts.append(
        _html_table(
            rows,
            [
                ("board", "board"),
                ("status", "advice"),
                ("sample", "sample"),
                ("why", "why"),
                ("check", "config check"),
            ],
            table_id="advice-table",
            raw=frozenset({"why", "check"}),
        )
    )
    return "".join(parts)


def html_page(data: Data, top: int = 10) -> str:
    """The whole report as one HTML document (no external resources, no script)."""
    b = data.build
    skipped = b.get("skipped", []) if b else []
    summary = (
        f"<p id='summary'>{data.gateways:,} gateways, {data.collections:,} collections, "
        f"{data.topics:,} topics in fleet_state, {data.history_rows:,} topic_history rows; "
        f"as of {escape(str(data.as_of))}; {len(data.failed):,} could not be collected.</p>"
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
        f"{_attention(data, top)}{_failed(data)}{_low_heap(data, top)}{_trends(data)}"
        f"{_utilisation(data)}{_stale(data, top)}{_advice(data)}"
        "</body></html>\n"
    )


def check_html_target(path: Path) -> None:
    """Before the warehouse is read: --html names a file in a directory that
    exists (outputs.OutputError, one line, otherwise)."""
    outputs.check_file(path, "--html")


def write_html(path: Path, data: Data, top: int = 10) -> None:
    """The page at path; an unusable path is an outputs.OutputError naming --html."""
    outputs.write_text(path, html_page(data, top), "--html")

"""Snapshot rows from their two sources, on whichever machine runs this.

The Spark job runs ingest() on its executors (mapInArrow), one input file
at a time, so nothing here may depend on the driver: only pyarrow, the
standard library, props.py and lib/edgestore.py (shipped with the job).

    read_snapshot(data)           a snapshot Parquet file's bytes, checked and cast to
                                  SNAPSHOT_SCHEMA (missing optional columns: nulls)
    read_store(data, meta)        a flash store file's bytes decoded with edgestore's
                                  own reader (inspect: the broker's decisions at open,
                                  then each live record read and decoded)

The bytes come from Spark's binaryFile reader (the Hadoop FileSystem of the
job's configuration), so nothing here opens a path of its own.
    table_for(meta, messages)     the rows of one collection (collect uses it too)

A file that cannot be used raises DecodeError; ingest() turns that into a
status (the build log reports it) and yields no row of that file: a file is
taken whole or not at all.
"""

from __future__ import annotations

import importlib
import io
import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any, Final, cast

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from edgebroker_tools.commands import store_report
from edgebroker_tools.fleet import props
from edgebroker_tools.fleet.schema import (
    FACT_COLUMNS,
    INGEST_SCHEMA,
    LIMIT_KEYS,
    REQUIRED_COLUMNS,
    SNAPSHOT_SCHEMA,
    TOTAL_COLUMNS,
    utf8_text,
)

#: Rows per Arrow batch handed to Spark.
BATCH_ROWS: Final = 65536

KIND_PARQUET: Final = "parquet"
KIND_STORE: Final = "store"


class DecodeError(Exception):
    """An input file that is skipped, with the reason."""


@dataclass(frozen=True)
class CollectionMeta:
    """Who a collection came from and when (repeated on each of its rows)."""

    gateway_id: str
    board: str
    collected_at: datetime
    source: str
    run_id: str
    limits: dict[str, int | None] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {
                "gateway_id": self.gateway_id,
                "board": self.board,
                "collected_at": self.collected_at.astimezone(UTC).isoformat(),
                "source": self.source,
                "run_id": self.run_id,
                "limits": self.limits,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> CollectionMeta:
        try:
            data = json.loads(text)
            when = datetime.fromisoformat(str(data["collected_at"]).replace("Z", "+00:00"))
            limits_raw = data.get("limits") or {}
            limits: dict[str, int | None] = {}
            for key in LIMIT_KEYS:
                value = limits_raw.get(key)
                limits[key] = value if isinstance(value, int) else None
            return cls(
                gateway_id=str(data["gateway_id"]),
                board=str(data.get("board") or ""),
                collected_at=when if when.tzinfo else when.replace(tzinfo=UTC),
                source=str(data.get("source") or "store"),
                run_id=str(data.get("run_id") or ""),
                limits=limits,
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise DecodeError(f"bad store metadata: {exc}") from None


@dataclass(frozen=True)
class Message:
    """One retained message of a collection."""

    topic: str
    payload: bytes
    qos: int
    properties: props.Properties
    message_expiry: int | None  # seconds left at the collection; None: never


def table_for(meta: CollectionMeta, messages: Iterable[Message]) -> pa.Table:
    """The snapshot rows of one collection: its header row (null topic), then a row per message."""
    msgs = sorted(messages, key=lambda m: m.topic)
    n = len(msgs) + 1
    cols: dict[str, Any] = {
        "gateway_id": [meta.gateway_id] * n,
        "board": [meta.board] * n,
        "collected_at": [meta.collected_at.astimezone(UTC)] * n,
        "source": [meta.source] * n,
        "run_id": [meta.run_id] * n,
    }
    for key in LIMIT_KEYS:
        cols[f"limit_{key}"] = [meta.limits.get(key)] * n
    cols["topic"] = [None, *(m.topic for m in msgs)]
    cols["payload"] = [None, *(m.payload for m in msgs)]
    cols["payload_text"] = [None, *(utf8_text(m.payload) for m in msgs)]
    cols["qos"] = [None, *(m.qos for m in msgs)]
    cols["content_type"] = [None, *(m.properties.content_type for m in msgs)]
    cols["payload_format"] = [None, *(m.properties.payload_format for m in msgs)]
    cols["user_properties"] = [
        None,
        *([{"key": k, "value": v} for k, v in m.properties.user_properties] for m in msgs),
    ]
    cols["message_expiry"] = [None, *(m.message_expiry for m in msgs)]
    cols["props_bytes"] = [None, *(m.properties.stored_bytes for m in msgs)]
    return pa.Table.from_pydict(cols, schema=SNAPSHOT_SCHEMA)


def with_headers(table: pa.Table) -> pa.Table:
    """The table plus a header row for each collection in it that has none.

    The header (null topic) carries the collection's facts; the build reads
    them from the headers alone, so every collection must have one.
    """
    keys = ["gateway_id", "collected_at"]
    all_keys = table.select(keys).group_by(keys).aggregate([])
    headed = table.filter(pc.is_null(table.column("topic"))).select(keys)
    headed = headed.group_by(keys).aggregate([])
    missing = all_keys.join(headed, keys, join_type="left anti")
    if missing.num_rows == 0:
        return table
    facts = ["board", "source", "run_id", *(f"limit_{k}" for k in LIMIT_KEYS)]
    firsts = table.group_by(keys, use_threads=False).aggregate([(c, "first") for c in facts])
    firsts = firsts.rename_columns([c.removesuffix("_first") for c in firsts.column_names])
    heads = missing.join(firsts, keys, join_type="inner")
    cols = {
        f.name: heads.column(f.name)
        if f.name in heads.column_names
        else pa.nulls(heads.num_rows, f.type)
        for f in SNAPSHOT_SCHEMA
    }
    header_rows = pa.Table.from_pydict(cols, schema=SNAPSHOT_SCHEMA)
    return pa.concat_tables([header_rows, table])


def with_totals(table: pa.Table) -> pa.Table:
    """The table plus schema.TOTAL_COLUMNS: each collection's retained totals
    on its first header row, null on every other row.

    A retained row has a topic that is not $SYS. Bytes are topic + payload +
    stored property bytes; a row without a payload adds none (as the build's
    SQL did: a null length is skipped by its sum).
    """
    keys = ["gateway_id", "collected_at"]
    topic = table.column("topic")
    is_head = pc.is_null(topic)
    sys_rows = cast(
        "pa.ChunkedArray[Any]", pc.fill_null(pc.starts_with(topic, "$SYS"), pa.scalar(True))
    )
    kept = table.select([*keys, "topic", "payload", "props_bytes"]).filter(
        pc.and_(pc.invert(is_head), pc.invert(sys_rows))
    )
    plen = pc.cast(pc.binary_length(kept.column("payload")), pa.int64())
    props_bytes = cast(
        "pa.ChunkedArray[Any]",
        pc.fill_null(pc.cast(kept.column("props_bytes"), pa.int64()), pa.scalar(0, pa.int64())),
    )
    size = pc.add(
        pc.add(pc.cast(pc.binary_length(kept.column("topic")), pa.int64()), plen), props_bytes
    )
    per = (
        kept.select(keys)
        .append_column("_n", pa.repeat(pa.scalar(1, pa.int64()), kept.num_rows))
        .append_column("_size", size)
        .append_column("_plen", plen)
        .group_by(keys, use_threads=False)
        .aggregate([("_n", "sum"), ("_size", "sum"), ("_plen", "max")])
    )
    totals: dict[tuple[Any, Any], tuple[int, int, int]] = {}
    for r in per.to_pylist():
        totals[(r["gateway_id"], r["collected_at"])] = (
            int(r["_n_sum"] or 0), int(r["_size_sum"] or 0), int(r["_plen_max"] or 0)
        )  # fmt: skip
    seen: set[tuple[Any, Any]] = set()
    cols: list[list[int | None]] = [[], [], []]
    for h in table.select(keys).filter(is_head).to_pylist():  # a header per collection: few
        key = (h["gateway_id"], h["collected_at"])
        got = None if key in seen else totals.get(key, (0, 0, 0))
        seen.add(key)
        for i in range(3):
            cols[i].append(None if got is None else got[i])
    mask = cast("pa.ChunkedArray[Any]", is_head).combine_chunks()  # a column: chunked
    for name, values in zip(TOTAL_COLUMNS, cols, strict=True):
        # the header rows' values, in order, where mask is set
        col = pc.replace_with_mask(
            pa.nulls(table.num_rows, pa.int64()), mask, pa.array(values, pa.int64())
        )
        table = table.append_column(name, col)
    return table


def sys_text_only(table: pa.Table) -> pa.Table:
    """payload_text kept on the $SYS rows only, null on the others: the build
    reads it there (the statistics) and derives a retained row's text from
    its payload where it needs it (topic_history), so the observations carry
    and store no second copy of every payload. A $SYS row whose writer left
    its text out (null, the payload UTF-8) gets it from its payload: the
    build reads the statistics from the text."""
    sys_rows = cast(
        "pa.ChunkedArray[Any]",
        pc.fill_null(pc.starts_with(table.column("topic"), "$SYS"), pa.scalar(False)),
    )
    i = table.schema.get_field_index("payload_text")
    text = pc.if_else(sys_rows, table.column(i), pa.scalar(None, pa.string()))
    untold = pc.and_(pc.and_(sys_rows, pc.is_null(text)), pc.is_valid(table.column("payload")))
    if pc.any(untold).as_py():  # a few $SYS rows at most: decoded one by one
        payloads = cast(list["bytes | None"], table.column("payload").to_pylist())
        texts = cast(list["str | None"], text.to_pylist())
        for k in cast(list[int], pc.indices_nonzero(untold).to_pylist()):
            texts[k] = utf8_text(cast(bytes, payloads[k]))
        text = pa.chunked_array([pa.array(texts, pa.string())])
    return table.set_column(i, table.schema.field(i), text)


def facts_on_headers(table: pa.Table) -> pa.Table:
    """A collection's facts (board, source, run_id, the limits) and the
    stored property bytes kept on its header rows only, null on the others:
    the build reads the facts from the header rows alone (job.collections),
    and with_totals has already summed the property bytes, so the
    observations need not carry and store them once a row."""
    head = pc.is_null(table.column("topic"))
    for name in (*FACT_COLUMNS, "props_bytes"):
        i = table.schema.get_field_index(name)
        fld = table.schema.field(i)
        kept = pc.if_else(head, table.column(i), pa.scalar(None, fld.type))
        table = table.set_column(i, fld, kept)
    return table


# ---------------------------------------------------------------- Parquet
def conform(table: pa.Table, what: str) -> pa.Table:
    """A snapshot table cast to SNAPSHOT_SCHEMA; DecodeError when it cannot be."""
    missing = sorted(REQUIRED_COLUMNS - set(table.column_names))
    if missing:
        raise DecodeError(f"{what}: not a snapshot (missing column(s) {', '.join(missing)})")
    arrays: list[pa.Array[Any] | pa.ChunkedArray[Any]] = []
    for fld in SNAPSHOT_SCHEMA:
        col: pa.Array[Any] | pa.ChunkedArray[Any]
        if fld.name in table.column_names:
            col = table.column(fld.name)
            if col.type != fld.type:
                try:
                    col = col.cast(fld.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                    raise DecodeError(f"{what}: column {fld.name}: {exc}") from None
        elif fld.name == "payload_text":
            payloads = cast(list[bytes | None], table.column("payload").to_pylist())
            col = pa.array(
                [None if p is None else utf8_text(p) for p in payloads], type=pa.string()
            )
        else:
            col = pa.nulls(table.num_rows, type=fld.type)
        if not fld.nullable and col.null_count:
            raise DecodeError(f"{what}: {col.null_count} row(s) without {fld.name}")
        arrays.append(col)
    return pa.Table.from_arrays(arrays, schema=SNAPSHOT_SCHEMA)


def read_snapshot(data: bytes) -> pa.Table:
    """A snapshot Parquet file's bytes, read whole and conformed (DecodeError if unusable)."""
    try:
        table = pq.read_table(pa.BufferReader(data))
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise DecodeError(f"unreadable Parquet: {exc}") from None
    return with_headers(conform(table, "snapshot"))


# ------------------------------------------------------------ store files
def load_edgestore() -> ModuleType:
    """lib/edgestore.py: shipped with the job (importable as edgestore), or the repo's."""
    try:
        return importlib.import_module("edgestore")
    except ImportError:
        lib = str(Path(__file__).resolve().parents[3] / "lib")
        if lib not in sys.path:
            sys.path.append(lib)
        return importlib.import_module("edgestore")


class _BytesFs:
    """edgestore's filesystem interface over one file's bytes (read only)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def open(self, path: str, mode: str) -> io.BytesIO:
        if "r" not in mode or "+" in mode:
            raise OSError(f"read-only: {path}")
        return io.BytesIO(self.data)


def read_store(data: bytes, meta: CollectionMeta, keep_damaged: bool = False) -> pa.Table:
    """The live messages of a flash store file's bytes, as the broker would load them.

    store_report.inspect() makes the broker's decisions through
    edgeopen.replay() (torn tail, corrupt records, expiry at the
    collection time); each live record is then read
    with edgeopen.scan() and decoded with edgestore.decode_put(). A store
    that the broker would refuse (bad magic, future version) is skipped; one
    with a torn tail or a corrupt record too, unless keep_damaged, which
    takes what the broker would keep.
    """
    es = load_edgestore()
    eo = importlib.import_module("edgeopen")  # its reader, beside it
    now = meta.collected_at.timestamp()
    bfs = _BytesFs(data)
    try:
        report = store_report.inspect(es, "store", wall_now=now, data=data)
    except OSError as exc:
        raise DecodeError(f"unreadable store file: {exc.strerror or exc}") from None
    status = cast(str, report["status"])
    if report["header"]["kind"] != "ok":
        raise DecodeError(f"store file refused by the reader: {status}")
    if report["damaged"] and not keep_damaged:
        detail = []
        if report["torn_bytes"]:
            detail.append(f"torn tail of {report['torn_bytes']} bytes")
        if report["corrupt"]:
            detail.append(f"{report['corrupt']} corrupt record(s)")
        raise DecodeError(f"damaged store file ({', '.join(detail) or status})")
    messages: list[Message] = []
    with bfs.open("store", "rb") as f:
        size = f.seek(0, 2)
        for entry in cast(list[dict[str, Any]], report["live"]):
            off = cast(int, entry["offset"])
            _pos, _rt, data, st = next(iter(eo.scan(f, size, off)))
            decoded = es.decode_put(data, len(data) - 4) if st == 0 and data else None
            if decoded is None:
                raise DecodeError(f"store record at offset {off} changed while reading")
            _tb, qos, _flags, _rem, _st, _wall, raw_props, payload = decoded
            try:
                properties = props.decode(raw_props)
            except props.PropertyError:
                properties = props.Properties(stored_bytes=len(raw_props))
            properties.stored_bytes = len(raw_props)
            left = entry["remaining"]
            messages.append(
                Message(
                    topic=cast(str, entry["topic"]),
                    payload=bytes(payload),
                    qos=int(qos),
                    properties=properties,
                    message_expiry=None if left is None else int(left),
                )
            )
    return table_for(meta, messages)


# ------------------------------------------------------------------ ingest
@dataclass(frozen=True)
class FileStatus:
    """What became of one input file."""

    path: str
    kind: str
    rows: int
    error: str | None = None


def read_unit(kind: str, data: bytes, meta: str | None, keep_damaged: bool) -> pa.Table:
    """One input file's bytes -> its snapshot rows (DecodeError if unusable)."""
    if kind == KIND_PARQUET:
        return read_snapshot(data)
    if kind == KIND_STORE:
        if not meta:
            raise DecodeError("store file without its .json metadata")
        return read_store(data, CollectionMeta.from_json(meta), keep_damaged)
    raise DecodeError(f"unknown input kind {kind!r}")


def ingest(
    batches: Iterable[pa.RecordBatch], statuses: list[FileStatus]
) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: batches of (kind, path, content, meta, keep_damaged) -> INGEST_SCHEMA.

    Appends one FileStatus per input file to statuses (the job forwards them
    to the driver through an accumulator).
    """
    for table in ingest_tables(batches, statuses):
        yield from table.to_batches(max_chunksize=BATCH_ROWS)


def ingest_tables(
    batches: Iterable[pa.RecordBatch], statuses: list[FileStatus]
) -> Iterator[pa.Table]:
    """ingest() a whole file's table at a time (INGEST_SCHEMA), not cut into batches."""
    for batch in batches:
        units = batch.to_pylist()
        for unit in units:
            kind = str(unit["kind"])
            path = str(unit["path"])
            data = cast("bytes | None", unit.get("content")) or b""
            try:
                table = read_unit(kind, data, unit.get("meta"), bool(unit.get("keep_damaged")))
            except DecodeError as exc:
                statuses.append(FileStatus(path, kind, 0, str(exc)))
                continue
            except Exception as exc:  # a reader bug must not end the build either
                statuses.append(FileStatus(path, kind, 0, f"{type(exc).__name__}: {exc}"))
                continue
            statuses.append(FileStatus(path, kind, table.num_rows))
            table = table.append_column("_file", pa.repeat(pa.scalar(path), table.num_rows))
            yield facts_on_headers(with_totals(sys_text_only(table))).cast(INGEST_SCHEMA)

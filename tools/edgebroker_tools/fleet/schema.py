"""What the fleet pipeline reads and writes.

Snapshot directory (the input of `fleet build`; `fleet collect` and
`fleet synth` write it):

    SNAPSHOTS/retained/date=YYYY-MM-DD/<name>.parquet    snapshot rows (SNAPSHOT_SCHEMA)
    SNAPSHOTS/stores/date=YYYY-MM-DD/<name>.ebrs         flash store files pulled from boards
    SNAPSHOTS/stores/date=YYYY-MM-DD/<name>.ebrs.json    ... and who they came from (StoreMeta)
    SNAPSHOTS/collect_log.jsonl                          one line per gateway and collect run

A snapshot row is one retained message of one gateway at one collection
(gateway_id, collected_at). The collection's own facts (board, source, the
profile's limits) repeat on every row, so that each file stands alone: a
file lost or corrupt loses its collections and nothing else. `collect`
writes one file per gateway and run; `synth` puts many gateways into a file
(the layout of rows into files is free). The gateway's $SYS statistics are
rows too, with their $SYS/broker/... topics. Each collection also has one
header row with a null topic: the build reads a collection's facts from it
(cheaply) and sees a collection that held no retained message at all (and
so what went missing from it). A snapshot written without header rows gets
them when it is read (decode.with_headers).

A collection in several files. The build takes the files together
(job.dedupe()): a file changed or touched and ingested again replaces its
earlier copy (of each file path, the latest build's rows); files of one
collection that share a topic are copies or versions of each other (a file
under a second name, an older version), and only the one of the latest
build, then the largest file name, counts, whole; files that share no topic
are parts of the collection and their rows are merged (its retained rows in
one, its $SYS rows in another, say). So the parts of a split collection
must not repeat a topic, and a part ingested again must keep its name.

Warehouse (`fleet build` writes it, `fleet report` reads it). Its location
is a URI (file://, hdfs://, s3a://, viewfs://; a plain path is file://);
the build reaches it only through Spark and the Hadoop FileSystem API:

    WAREHOUSE/_commits/<seq>.json    one per committed build (seq: 20 digits, rising);
                                the highest is the warehouse's state (COMMIT below)
    WAREHOUSE/builds/<build_id>/fleet_state/     latest value per (gateway, topic)
    WAREHOUSE/builds/<build_id>/topic_history/   one row per value a topic held
    WAREHOUSE/builds/<build_id>/gateway_health/  one row per gateway and collection
    WAREHOUSE/builds/<build_id>/limits_advice/   one row per board
    WAREHOUSE/builds/<build_id>/collect_status/  one row per gateway in SNAPSHOTS/collect_log.jsonl:
                                its latest collect attempt (status, last error) and last success
    WAREHOUSE/builds/<build_id>/patches/<board>.json   the advice as
                                `edgebroker config apply` patches
    WAREHOUSE/_observations/batch=<build_id>/   the snapshot rows one build ingested (INGEST_SCHEMA:
                                a collection's facts on its header rows only, totals added)
                                (the tables are computed from all committed batches)

A commit record (JSON) names everything a reader needs:

    {"seq": 3, "format": 2, "build_id": "...",
     "tables": {"fleet_state": "builds/<id>/fleet_state", ...},
     "patches": "builds/<id>/patches", "batches": ["batch=<id>", ...],
     "files": {"retained/date=.../x.parquet": "<rel>|<size>|<mtime ms>", ...},
     "build": {the build log: inputs, ingested and skipped files, rows, steps, seconds}}

Nothing is referenced before its commit record exists, and a commit record
appears whole (written under a hidden name, then renamed to a new name), so
a reader that resolves the latest commit never sees half a build. A build
that dies leaves batches and builds/ directories no commit names: the next
build deletes them (and the tables of commits older than the previous one).
One build at a time per warehouse (two that race for the same sequence
number: the second fails and commits nothing).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any, Final

import pyarrow as pa

#: The limit keys of a board profile that the pipeline tracks, with the
#: snapshot column each is stored in.
LIMIT_KEYS: Final = (
    "max_retained_messages",
    "max_payload_size",
    "store_budget_bytes",
    "heap_reserve",
    "max_clients",
)
LIMIT_COLUMNS: Final = tuple(f"limit_{k}" for k in LIMIT_KEYS)
#: A collection's facts: on every snapshot row (a file stands alone), on
#: the header rows only in the observations (decode.facts_on_headers)
FACT_COLUMNS: Final = ("board", "source", "run_id", *LIMIT_COLUMNS)

USER_PROPERTY: Final = pa.struct([("key", pa.string()), ("value", pa.string())])
TIMESTAMP: Final = pa.timestamp("us", tz="UTC")

#: One row per retained message per collection (see the module docstring).
_SNAPSHOT_FIELDS: list[pa.Field[Any]] = [
    pa.field("gateway_id", pa.string(), nullable=False),
    pa.field("board", pa.string()),
    pa.field("collected_at", TIMESTAMP, nullable=False),
    pa.field("source", pa.string()),  # mqtt | store | synth
    pa.field("run_id", pa.string()),
    pa.field("limit_max_retained_messages", pa.int64()),
    pa.field("limit_max_payload_size", pa.int64()),
    pa.field("limit_store_budget_bytes", pa.int64()),
    pa.field("limit_heap_reserve", pa.int64()),
    pa.field("limit_max_clients", pa.int64()),
    pa.field("topic", pa.string()),  # null: the marker row of an empty collection
    pa.field("payload", pa.binary()),
    pa.field("payload_text", pa.string()),  # the payload when it is UTF-8
    pa.field("qos", pa.int32()),
    pa.field("content_type", pa.string()),
    pa.field("payload_format", pa.int32()),  # null: no Payload Format Indicator
    pa.field("user_properties", pa.list_(USER_PROPERTY)),
    pa.field("message_expiry", pa.int64()),  # seconds left at collected_at; null: never
    pa.field("props_bytes", pa.int32()),  # stored MQTT 5 property bytes
]
SNAPSHOT_SCHEMA: Final = pa.schema(_SNAPSHOT_FIELDS)

#: Columns a snapshot file must have; the others are filled with nulls when absent.
REQUIRED_COLUMNS: Final = frozenset({"gateway_id", "collected_at", "topic", "payload"})

#: Per collection and input file, on its first header row (null on every
#: other row): the retained rows' count, bytes (topic + payload + stored
#: property bytes) and largest payload. The build reads a collection's facts
#: from its header rows alone instead of aggregating every row.
TOTAL_COLUMNS: Final = ("_retained_count", "_retained_bytes", "_max_payload_bytes")
#: The executors' output: a snapshot row, the input file it came from, the totals.
INGEST_SCHEMA: Final = pa.schema(
    [
        *_SNAPSHOT_FIELDS,
        pa.field("_file", pa.string()),
        *(pa.field(c, pa.int64()) for c in TOTAL_COLUMNS),
    ]
)
#: The warehouse's layout version, in every commit record. The batches of a
#: commit with another (or none: version 1, before the totals) are not
#: reused: the next build ingests every snapshot again.
WAREHOUSE_FORMAT: Final = 2

RETAINED_DIR: Final = "retained"
STORES_DIR: Final = "stores"
COLLECT_LOG: Final = "collect_log.jsonl"

TABLES: Final = (
    "fleet_state", "topic_history", "gateway_health", "limits_advice", "collect_status",
)  # fmt: skip
OBSERVATIONS: Final = "_observations"
PATCHES: Final = "patches"
COMMITS: Final = "_commits"
BUILDS: Final = "builds"
#: A commit record's file name: the sequence number, zero-padded so names sort.
COMMIT_RE: Final = re.compile(r"^([0-9]{20})\.json$")


def commit_name(seq: int) -> str:
    return f"{seq:020d}.json"


def latest_commit(names: list[str]) -> str | None:
    """The latest commit record among directory entry names (None: never built)."""
    found = sorted(n for n in names if COMMIT_RE.match(n))
    return found[-1] if found else None


SOURCES: Final = frozenset({"mqtt", "store", "synth"})

#: Gateway ids become file names: letters, digits and . _ - only.
GATEWAY_ID_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def stamp(when: datetime) -> str:
    """A file-name-safe UTC time with microseconds: 20250601T120000123456Z."""
    return when.astimezone(UTC).strftime("%Y%m%dT%H%M%S%fZ")


def date_dir(when: datetime) -> str:
    """The partition directory of a collection time: date=YYYY-MM-DD (UTC)."""
    return "date=" + when.astimezone(UTC).strftime("%Y-%m-%d")


def utf8_text(payload: bytes) -> str | None:
    """The payload as text when it is valid UTF-8, else None."""
    try:
        return payload.decode("utf-8")
    except UnicodeDecodeError:
        return None

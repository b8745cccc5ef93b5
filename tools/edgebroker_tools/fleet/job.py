"""The fleet build: snapshots -> fleet tables (PySpark). Also a spark-submit entry:

    spark-submit --master local[2] tools/edgebroker_tools/fleet/job.py \\
        --snapshots SNAPSHOTS/ --out WAREHOUSE/

Steps (table columns: the *_COLUMNS lists below; layout: schema.py):

1. Inputs: SNAPSHOTS/retained/**/*.parquet and SNAPSHOTS/stores/**/*.ebrs
   (with their .json). Files already in WAREHOUSE/_manifest.json (same
   path, size and mtime) were ingested by an earlier build and are not read.
2. Ingest, on the executors: decode.ingest() reads each new file whole
   (pyarrow for snapshots, edgestore's reader for store files), or reports
   why not (an accumulator brings the per-file status back); the rows are
   written as a new batch of WAREHOUSE/_observations.
3. Everything else is recomputed from all batches, so the tables depend on
   the set of rows ingested, never on the order of builds: a build over the
   same input gives the same tables, and a build with new snapshots merges
   them in (a late, older snapshot too). A collection (gateway, collected_at)
   that arrived twice counts once (the latest batch's copy).
4. Tables are written to a staging directory and moved into place at the
   end; the manifest and _build.json last.

Definitions:
- Retained state is every topic except $SYS/... (the broker's statistics,
  which gateway_health reads); a collection's facts come from its header row.
- A topic's value is (payload, qos, content type, payload format, user
  properties). A *segment* (a topic_history row) is a run of collections
  of that gateway in which the topic held the same value. It ends
  (valid_to) at the first collection where the value differed
  (ended_by "changed") or the topic was missing ("gone"; "expired" when
  its Message Expiry had run out by then). valid_to is null while it holds.
- as_of is the latest collected_at of the whole input (not the wall clock:
  the tables must not change when nothing new came in).
- fleet_state.stale: the latest value is gone or expired, or expires_at <=
  as_of, or the gateway's last collection is older than as_of - stale_after.
- change_count: segments - 1 (value changes, a reappearance included).
- Utilisation: retained count / max_retained_messages, retained bytes
  (topic + payload + stored properties, the broker's own measure; its $SYS
  figures when present) / store_budget_bytes, largest payload /
  max_payload_size. near_* flags: utilisation >= near (0.9). low_heap:
  free heap below 2 x heap_reserve (where the broker refuses connections).
- limits_advice, per board, over each gateway's latest collection:
  max_retained_messages = max(p99 x headroom, max), to a multiple of 8;
  max_payload_size = largest payload x headroom, to a multiple of 64;
  store_budget_bytes = max(p99 x headroom, max), to a multiple of 4096.
  A board whose gateways refused retained messages (retained_full,
  retained_too_large) was cut at its limit, so its data understates the
  need: the advice is then at least the current limit x headroom. Each
  patch is checked like `edgebroker config apply` does (heap, flash).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # spark-submit runs this file as a script
    _here = str(Path(__file__).resolve().parent)
    if _here in sys.path:
        sys.path.remove(_here)  # its siblings (spark.py, schema.py, ...) are not top-level modules
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import argparse
import json
import math
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final, cast

import pyarrow as pa
from pyspark import StorageLevel
from pyspark.accumulators import AccumulatorParam
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F  # noqa: N812 (the usual name)
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DoubleType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from edgebroker_tools.fleet import decode
from edgebroker_tools.fleet.job_args import Options, add_arguments, options_from
from edgebroker_tools.fleet.schema import (
    BUILD_LOG,
    LIMIT_KEYS,
    MANIFEST,
    OBSERVATIONS,
    PATCHES,
    RETAINED_DIR,
    STORES_DIR,
    TABLES,
    stamp,
)

USER_PROPS_TYPE: Final = ArrayType(
    StructType([StructField("key", StringType()), StructField("value", StringType())])
)
INGEST_STRUCT: Final = StructType(
    [
        StructField("gateway_id", StringType(), False),
        StructField("board", StringType()),
        StructField("collected_at", TimestampType(), False),
        StructField("source", StringType()),
        StructField("run_id", StringType()),
        *(StructField(f"limit_{k}", LongType()) for k in LIMIT_KEYS),
        StructField("topic", StringType()),
        StructField("payload", BinaryType()),
        StructField("payload_text", StringType()),
        StructField("qos", IntegerType()),
        StructField("content_type", StringType()),
        StructField("payload_format", IntegerType()),
        StructField("user_properties", USER_PROPS_TYPE),
        StructField("message_expiry", LongType()),
        StructField("props_bytes", IntegerType()),
        StructField("_file", StringType()),
    ]
)
UNITS_STRUCT: Final = StructType(
    [
        StructField("kind", StringType()),
        StructField("path", StringType()),
        StructField("meta", StringType()),
        StructField("keep_damaged", BooleanType()),
    ]
)
#: A payload that is a number (JSON/C syntax, surrounding blanks allowed).
NUMBER_RE: Final = r"^\s*[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?\s*$"
SYS_PREFIX: Final = "$SYS/broker/"
_REFUSALS_TYPE: Final = ArrayType(
    StructType([StructField("cause", StringType()), StructField("count", LongType())])
)
RETAINED_REFUSALS: Final = ("retained_full", "retained_too_large", "retained_heap")

HISTORY_COLUMNS: Final = (
    "gateway_id", "board", "topic", "segment", "valid_from", "valid_to", "last_seen",
    "observations", "ended_by", "payload", "payload_text", "value", "payload_bytes", "qos",
    "content_type", "payload_format", "user_properties", "message_expiry", "expires_at",
    "is_latest", "first_seen",
)  # fmt: skip
STATE_COLUMNS: Final = (
    "gateway_id", "board", "topic", "payload", "payload_text", "value", "payload_bytes",
    "qos", "content_type", "payload_format", "user_properties", "first_seen", "last_changed",
    "last_seen", "change_count", "expires_at", "present", "stale", "stale_reason",
    "gateway_last_collected", "as_of",
)  # fmt: skip
HEALTH_COLUMNS: Final = (
    "gateway_id", "board", "collected_at", "source", "run_id", "is_latest",
    "retained_count", "retained_bytes", "max_payload_bytes",
    "limit_max_retained_messages", "limit_max_payload_size", "limit_store_budget_bytes",
    "limit_heap_reserve", "retained_util", "bytes_util", "payload_util",
    "sys_retained_count", "sys_retained_bytes", "heap_free", "heap_alloc",
    "clients_connected", "uptime_s", "messages_received", "messages_sent",
    "messages_dropped", "broker_version", "refusals", "refusals_total",
    "retained_refusals", "near_retained_limit", "near_payload_limit", "near_store_budget",
    "low_heap", "near_limit",
)  # fmt: skip
ADVICE_STRUCT: Final = StructType(
    [
        StructField("board", StringType(), False),
        StructField("gateways", LongType()),
        StructField("current_max_retained_messages", LongType()),
        StructField("current_max_payload_size", LongType()),
        StructField("current_store_budget_bytes", LongType()),
        StructField("retained_count_p50", DoubleType()),
        StructField("retained_count_p90", DoubleType()),
        StructField("retained_count_p99", DoubleType()),
        StructField("retained_count_max", LongType()),
        StructField("max_payload_p99", DoubleType()),
        StructField("max_payload_max", LongType()),
        StructField("retained_bytes_p50", DoubleType()),
        StructField("retained_bytes_p99", DoubleType()),
        StructField("retained_bytes_max", LongType()),
        StructField("refusals_retained_full", LongType()),
        StructField("refusals_retained_too_large", LongType()),
        StructField("headroom", DoubleType()),
        StructField("suggested_max_retained_messages", LongType()),
        StructField("suggested_max_payload_size", LongType()),
        StructField("suggested_store_budget_bytes", LongType()),
        StructField("patch_file", StringType()),
        StructField("check_status", StringType()),
        StructField("check_errors", ArrayType(StringType())),
    ]
)


class BuildError(Exception):
    """The build cannot run (bad paths); bad input files are reported, not raised."""


@dataclass
class Result:
    build_id: str
    as_of: str | None
    inputs: int
    new_files: int
    ingested: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    rows: dict[str, int] = field(default_factory=dict)
    steps: dict[str, float] = field(default_factory=dict)  # seconds per step
    seconds: float = 0.0

    def step(self, name: str, since: float) -> float:
        now = time.monotonic()
        self.steps[name] = round(now - since, 3)
        return now

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


# ------------------------------------------------------------------ inputs
@dataclass(frozen=True)
class InputFile:
    kind: str
    path: Path
    rel: str
    size: int
    mtime_ns: int

    @property
    def key(self) -> str:
        return f"{self.rel}|{self.size}|{self.mtime_ns}"


def list_inputs(snapshots: Path) -> list[InputFile]:
    """Snapshot Parquet files and store files, sorted by path (dot-files skipped)."""
    out: list[InputFile] = []
    for kind, sub, pattern in (
        (decode.KIND_PARQUET, RETAINED_DIR, "*.parquet"),
        (decode.KIND_STORE, STORES_DIR, "*.ebrs"),
    ):
        root = snapshots / sub
        if not root.is_dir():
            continue
        for path in sorted(root.rglob(pattern)):
            if path.name.startswith(".") or not path.is_file():
                continue
            st = path.stat()
            rel = str(path.relative_to(snapshots))
            out.append(InputFile(kind, path.resolve(), rel, st.st_size, st.st_mtime_ns))
    return out


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)


class _ListParam(AccumulatorParam[list[dict[str, Any]]]):
    def zero(self, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return []

    def addInPlace(  # noqa: N802 (pyspark's name)
        self, value1: list[dict[str, Any]], value2: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        value1.extend(value2)
        return value1


# ------------------------------------------------------------------ ingest
def ingest(
    spark: SparkSession, files: Sequence[InputFile], keep_damaged: bool, target: Path
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Decode the files on the executors into a Parquet batch at target.

    Returns (ingested, skipped): one dict per file (path, kind, rows / error).
    """
    skipped: list[dict[str, Any]] = []
    units: list[tuple[str, str, str | None, bool]] = []
    for f in files:
        meta = None
        if f.kind == decode.KIND_STORE:
            side = f.path.with_name(f.path.name + ".json")
            try:
                meta = side.read_text(encoding="utf-8")
            except OSError:
                skipped.append({"path": f.rel, "kind": f.kind, "error": f"no metadata {side.name}"})
                continue
        units.append((f.kind, str(f.path), meta, keep_damaged))
    if not units:
        return [], skipped
    sc = spark.sparkContext
    acc = sc.accumulator(cast(list[dict[str, Any]], []), _ListParam())

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        statuses: list[decode.FileStatus] = []
        try:
            yield from decode.ingest(batches, statuses)
        finally:
            acc.add([asdict(s) for s in statuses])

    slices = max(1, min(len(units), sc.defaultParallelism * 4))
    df = spark.createDataFrame(units, UNITS_STRUCT).repartition(slices)
    df.mapInArrow(run, INGEST_STRUCT).write.mode("overwrite").parquet(str(target))
    by_path: dict[str, dict[str, Any]] = {}
    for status in acc.value:  # a retried task reports twice: one per path
        by_path[str(status["path"])] = status
    rel = {str(f.path): f.rel for f in files}
    ingested: list[dict[str, Any]] = []
    for path, status in sorted(by_path.items()):
        entry = {"path": rel.get(path, path), "kind": status["kind"]}
        if status["error"]:
            skipped.append({**entry, "error": status["error"]})
        else:
            ingested.append({**entry, "rows": status["rows"]})
    return ingested, skipped


def _empty(spark: SparkSession) -> DataFrame:
    schema = StructType([*INGEST_STRUCT.fields, StructField("batch", StringType())])
    return spark.createDataFrame([], schema)


def load_base(spark: SparkSession, out: Path, new_batch: Path | None, build_id: str) -> DataFrame:
    """Every ingested row, with its batch id."""
    frames: list[DataFrame] = []
    base = out / OBSERVATIONS
    if base.is_dir() and any(base.glob("batch=*")):
        frames.append(spark.read.schema(INGEST_STRUCT).parquet(str(base)))
    if new_batch is not None and new_batch.is_dir():
        frames.append(
            spark.read.schema(INGEST_STRUCT)
            .parquet(str(new_batch))
            .withColumn("batch", F.lit(build_id))
        )
    if not frames:
        return _empty(spark)
    df = frames[0]
    for other in frames[1:]:
        df = df.unionByName(other)
    return df


# ----------------------------------------------------------------- tables
def _sys(name: str) -> Column:
    return F.max(
        F.when(F.col("topic") == SYS_PREFIX + name, F.col("payload_text").try_cast("long"))
    )


def dedupe(base: DataFrame) -> DataFrame:
    """One copy of each collection: the latest batch's (then the largest file name).

    A collection is in more than one (batch, file) only when a file was
    copied or changed and ingested again: a small aggregate finds those, and
    only then are the rows filtered (a broadcast join with the few keys).
    """
    key = F.struct(F.col("batch"), F.col("_file"))
    h = F.xxhash64("batch", "_file")  # cheap to compare; the exact key decides below
    keys = base.groupBy("gateway_id", "collected_at").agg(
        F.min(h).alias("_lo"), F.max(h).alias("_hi")
    )
    suspects = keys.where(F.col("_lo") != F.col("_hi")).select("gateway_id", "collected_at")
    if not suspects.take(1):
        return base
    dups = (
        base.join(F.broadcast(suspects), ["gateway_id", "collected_at"])
        .groupBy("gateway_id", "collected_at")
        .agg(F.max(key).alias("_keep"))
    )
    return (
        base.join(F.broadcast(dups), ["gateway_id", "collected_at"], "left")
        .where(F.col("_keep").isNull() | (key == F.col("_keep")))
        .drop("_keep")
    )


def collections(obs: DataFrame) -> DataFrame:
    """One row per (gateway, collection): its facts, retained totals and $SYS statistics.

    Two aggregates joined: one over every row (cheap expressions only) and
    one over the few $SYS rows (the statistics).
    """
    topic = F.col("topic")
    state = topic.isNotNull() & ~topic.startswith("$SYS")
    size = (
        F.octet_length(topic)
        + F.octet_length("payload")
        + F.coalesce(F.col("props_bytes"), F.lit(0))
    )
    # A collection's facts come from its header row (decode.with_headers
    # makes sure there is one): an aggregate over all rows with strings in
    # it would sort every row; this one is numeric and hash-based.
    facts = (
        obs.where(topic.isNull())
        .groupBy("gateway_id", "collected_at")
        .agg(
            *(F.max(c).alias(c) for c in ("board", "source", "run_id")),
            *(F.max(f"limit_{k}").alias(f"limit_{k}") for k in LIMIT_KEYS),
        )
    )
    main = obs.groupBy("gateway_id", "collected_at").agg(
        F.count(F.when(state, 1)).alias("retained_count"),
        F.coalesce(F.sum(F.when(state, size)), F.lit(0)).cast("long").alias("retained_bytes"),
        F.coalesce(F.max(F.when(state, F.octet_length("payload"))), F.lit(0))
        .cast("long")
        .alias("max_payload_bytes"),
    )
    refusal = F.when(
        topic.startswith(SYS_PREFIX + "refusals/"),
        F.struct(
            F.substring(topic, len(SYS_PREFIX) + len("refusals/") + 1, 1000).alias("cause"),
            F.col("payload_text").try_cast("long").alias("count"),
        ),
    )
    stats = (
        obs.where(topic.startswith(SYS_PREFIX))
        .groupBy("gateway_id", "collected_at")
        .agg(
            _sys("retained/count").alias("sys_retained_count"),
            _sys("retained/bytes").alias("sys_retained_bytes"),
            _sys("heap/free").alias("heap_free"),
            _sys("heap/alloc").alias("heap_alloc"),
            _sys("clients/connected").alias("clients_connected"),
            _sys("uptime").alias("uptime_s"),
            _sys("messages/received").alias("messages_received"),
            _sys("messages/sent").alias("messages_sent"),
            _sys("messages/dropped").alias("messages_dropped"),
            F.max(F.when(topic == SYS_PREFIX + "version", F.col("payload_text"))).alias(
                "broker_version"
            ),
            F.array_sort(F.collect_list(refusal)).alias("_refusals"),
        )
    )
    keys = ["gateway_id", "collected_at"]
    return (facts.join(main, keys).join(stats, keys, "left")).withColumn(
        "_refusals", F.coalesce(F.col("_refusals"), F.array().cast(_REFUSALS_TYPE))
    )


def health(coll: DataFrame, near: float) -> DataFrame:
    """gateway_health: collections with utilisation and flags."""
    latest = F.max("collected_at").over(Window.partitionBy("gateway_id"))
    refusals = F.map_from_entries(F.filter("_refusals", lambda r: r["count"].isNotNull()))
    total = F.aggregate(
        "_refusals", F.lit(0).cast("long"), lambda acc, r: acc + F.coalesce(r["count"], F.lit(0))
    )
    retained_refused = F.aggregate(
        "_refusals",
        F.lit(0).cast("long"),
        lambda acc, r: (
            acc
            + F.when(
                r["cause"].isin(*RETAINED_REFUSALS), F.coalesce(r["count"], F.lit(0))
            ).otherwise(0)
        ),
    )

    def util(used: Column, limit: str) -> Column:
        lim = F.col(limit)
        return F.when(lim > 0, used / lim)

    count = F.coalesce(F.col("sys_retained_count"), F.col("retained_count"))
    nbytes = F.coalesce(F.col("sys_retained_bytes"), F.col("retained_bytes"))
    df = (
        coll.withColumn("is_latest", F.col("collected_at") == latest)
        .withColumn("refusals", refusals)
        .withColumn("refusals_total", total)
        .withColumn("retained_refusals", retained_refused)
        .withColumn("retained_util", util(count, "limit_max_retained_messages"))
        .withColumn("bytes_util", util(nbytes, "limit_store_budget_bytes"))
        .withColumn("payload_util", util(F.col("max_payload_bytes"), "limit_max_payload_size"))
        .withColumn("near_retained_limit", F.coalesce(F.col("retained_util") >= near, F.lit(False)))
        .withColumn("near_payload_limit", F.coalesce(F.col("payload_util") >= near, F.lit(False)))
        .withColumn("near_store_budget", F.coalesce(F.col("bytes_util") >= near, F.lit(False)))
        .withColumn(
            "low_heap",
            F.coalesce(F.col("heap_free") < 2 * F.col("limit_heap_reserve"), F.lit(False)),
        )
    )
    df = df.withColumn(
        "near_limit",
        F.col("near_retained_limit")
        | F.col("near_payload_limit")
        | F.col("near_store_budget")
        | F.col("low_heap")
        | (F.col("retained_refusals") > 0),
    )
    return df.select(*HEALTH_COLUMNS)


def history(obs: DataFrame, coll: DataFrame) -> DataFrame:
    """topic_history: one shuffle by (gateway, topic) and one sort by collected_at.

    Window functions over each topic's observations mark where a segment
    starts (value differs from the previous observation, or the previous
    observation's next collection is not this one: the topic was missing in
    between); the last observation of each segment becomes its row, so no
    aggregation (and no second sort) is needed.
    """
    topic = F.col("topic")
    nxt = coll.select(
        "gateway_id",
        "collected_at",
        F.lead("collected_at")
        .over(Window.partitionBy("gateway_id").orderBy("collected_at"))
        .alias("_next_at"),
    )
    rows = (
        obs.where(topic.isNotNull() & ~topic.startswith("$SYS"))
        .select(
            "gateway_id",
            "collected_at",
            "topic",
            "payload",
            "qos",
            "content_type",
            "payload_format",
            "user_properties",
            "message_expiry",
        )
        .join(F.broadcast(nxt), ["gateway_id", "collected_at"])
    )
    boards = coll.groupBy("gateway_id").agg(F.max_by("board", "collected_at").alias("board"))
    # The hash first: the sort then compares longs, not long common prefixes.
    # _vh stands for the value's qos and properties (one lag, not four); the
    # payload itself is compared exactly.
    rows = rows.withColumn("_k", F.xxhash64("gateway_id", "topic")).withColumn(
        "_vh", F.xxhash64("qos", "content_type", "payload_format", "user_properties")
    )
    w = Window.partitionBy("_k", "gateway_id", "topic").orderBy("collected_at")
    running = w.rowsBetween(Window.unboundedPreceding, Window.currentRow)
    start = (
        (F.row_number().over(w) == 1)
        | ~F.lag("_next_at").over(w).eqNullSafe(F.col("collected_at"))
        | ~F.lag("payload").over(w).eqNullSafe(F.col("payload"))
        | ~F.lag("_vh").over(w).eqNullSafe(F.col("_vh"))
    )
    rows = rows.select(
        "*",
        start.cast("int").alias("_start"),
        F.row_number().over(w).alias("_rn"),
        F.lead("collected_at").over(w).alias("_next_obs"),
    )
    rows = rows.select(
        "*",
        F.sum("_start").over(running).alias("segment"),
        F.max(F.when(F.col("_start") == 1, F.col("_rn"))).over(running).alias("_seg_rn"),
        F.max(F.when(F.col("_start") == 1, F.col("collected_at")))
        .over(running)
        .alias("valid_from"),
        F.min("collected_at").over(running).alias("first_seen"),
        F.lead("_start").over(w).alias("_next_start"),
    )
    # the last observation of each segment
    rows = rows.where(F.col("_next_start").isNull() | (F.col("_next_start") == 1))
    expires = F.when(
        F.col("message_expiry").isNotNull(),
        F.timestamp_add("SECOND", F.col("message_expiry"), F.col("collected_at")),
    )
    valid_to = F.col("_next_at")
    text = F.try_validate_utf8(F.col("payload").cast("string"))
    rows = rows.join(F.broadcast(boards), ["gateway_id"])
    return rows.select(
        "gateway_id",
        "board",
        "topic",
        F.col("segment").cast("long").alias("segment"),
        "valid_from",
        valid_to.alias("valid_to"),
        F.col("collected_at").alias("last_seen"),
        (F.col("_rn") - F.col("_seg_rn") + 1).cast("long").alias("observations"),
        F.when(valid_to.isNull(), F.lit(None).cast("string"))
        .when(F.col("_next_obs").eqNullSafe(valid_to), F.lit("changed"))
        .when(expires <= valid_to, F.lit("expired"))
        .otherwise(F.lit("gone"))
        .alias("ended_by"),
        "payload",
        text.alias("payload_text"),
        F.when(text.rlike(NUMBER_RE), F.trim(text)).try_cast("double").alias("value"),
        F.octet_length("payload").cast("long").alias("payload_bytes"),
        "qos",
        "content_type",
        "payload_format",
        "user_properties",
        "message_expiry",
        expires.alias("expires_at"),
        F.col("_next_obs").isNull().alias("is_latest"),
        "first_seen",
    )


def fleet_state(
    hist: DataFrame, coll: DataFrame, as_of: datetime, stale_after: timedelta
) -> DataFrame:
    """The latest segment of every (gateway, topic) (topic_history's is_latest rows)."""
    last = coll.groupBy("gateway_id").agg(F.max("collected_at").alias("gateway_last_collected"))
    as_of_lit = F.lit(as_of).cast("timestamp")
    silent_before = F.lit(as_of - stale_after).cast("timestamp")
    reason = (
        F.when(F.col("ended_by") == "expired", F.lit("expired"))
        .when(F.col("valid_to").isNotNull(), F.lit("gone"))
        .when(F.col("expires_at") <= as_of_lit, F.lit("expired"))
        .when(F.col("gateway_last_collected") < silent_before, F.lit("gateway_silent"))
    )
    df = (
        hist.where("is_latest")
        .join(F.broadcast(last), ["gateway_id"])
        .withColumn("last_changed", F.col("valid_from"))
        .withColumn("change_count", F.col("segment") - 1)
        .withColumn("present", F.col("valid_to").isNull())
        .withColumn("stale_reason", reason)
        .withColumn("stale", F.col("stale_reason").isNotNull())
        .withColumn("as_of", as_of_lit)
    )
    return df.select(*STATE_COLUMNS)


# ------------------------------------------------------------------ advice
def _round_up(value: float, step: int) -> int:
    return int(math.ceil(max(value, 1.0) / step) * step)


def advice_stats(gh: DataFrame) -> list[dict[str, Any]]:
    """Per board, the distributions over each gateway's latest collection."""
    latest = gh.where("is_latest")
    count = F.coalesce(F.col("sys_retained_count"), F.col("retained_count"))
    nbytes = F.coalesce(F.col("sys_retained_bytes"), F.col("retained_bytes"))
    q = F.array(F.lit(0.5), F.lit(0.9), F.lit(0.99))
    rows = (
        latest.groupBy("board")
        .agg(
            F.count(F.lit(1)).alias("gateways"),
            F.max("limit_max_retained_messages").alias("current_max_retained_messages"),
            F.max("limit_max_payload_size").alias("current_max_payload_size"),
            F.max("limit_store_budget_bytes").alias("current_store_budget_bytes"),
            F.percentile(count, q).alias("count_q"),
            F.max(count).alias("retained_count_max"),
            F.percentile("max_payload_bytes", q).alias("payload_q"),
            F.max("max_payload_bytes").alias("max_payload_max"),
            F.percentile(nbytes, q).alias("bytes_q"),
            F.max(nbytes).alias("retained_bytes_max"),
            F.sum(F.coalesce(F.col("refusals")["retained_full"], F.lit(0))).alias("rf"),
            F.sum(F.coalesce(F.col("refusals")["retained_too_large"], F.lit(0))).alias("rtl"),
        )
        .orderBy("board")
        .collect()
    )
    return [r.asDict() for r in rows]


def advise(
    stats: list[dict[str, Any]], headroom: float, boards: Path | None
) -> tuple[list[dict[str, Any]], dict[str, dict[str, int]]]:
    """Suggested limits per board and the profile patches (checked when the board is known)."""
    from edgebroker_tools import profiles

    out: list[dict[str, Any]] = []
    patches: dict[str, dict[str, int]] = {}
    for s in stats:
        board = str(s["board"])
        cq = cast(list[float], s["count_q"] or [0.0, 0.0, 0.0])
        pq_ = cast(list[float], s["payload_q"] or [0.0, 0.0, 0.0])
        bq = cast(list[float], s["bytes_q"] or [0.0, 0.0, 0.0])
        cur_ret = cast("int | None", s["current_max_retained_messages"])
        cur_pay = cast("int | None", s["current_max_payload_size"])
        cur_bud = cast("int | None", s["current_store_budget_bytes"])
        ret = _round_up(max(cq[2] * headroom, float(s["retained_count_max"] or 0)), 8)
        if s["rf"] and cur_ret:  # refused at the limit: the data is cut there
            ret = max(ret, _round_up(cur_ret * headroom, 8))
        pay = _round_up(float(s["max_payload_max"] or 0) * headroom, 64)
        if s["rtl"] and cur_pay:
            pay = max(pay, _round_up(cur_pay * headroom, 64))
        bud = _round_up(max(bq[2] * headroom, float(s["retained_bytes_max"] or 0)), 4096)
        if s["rf"] and cur_bud:
            bud = max(bud, _round_up(cur_bud * headroom, 4096))
        patch = {"max_retained_messages": ret, "max_payload_size": pay, "store_budget_bytes": bud}
        patches[board] = patch
        status, errors = _check(board, patch, boards, profiles)
        out.append(
            {
                "board": board,
                "gateways": s["gateways"],
                "current_max_retained_messages": cur_ret,
                "current_max_payload_size": cur_pay,
                "current_store_budget_bytes": cur_bud,
                "retained_count_p50": float(cq[0]),
                "retained_count_p90": float(cq[1]),
                "retained_count_p99": float(cq[2]),
                "retained_count_max": s["retained_count_max"],
                "max_payload_p99": float(pq_[2]),
                "max_payload_max": s["max_payload_max"],
                "retained_bytes_p50": float(bq[0]),
                "retained_bytes_p99": float(bq[2]),
                "retained_bytes_max": s["retained_bytes_max"],
                "refusals_retained_full": int(s["rf"] or 0),
                "refusals_retained_too_large": int(s["rtl"] or 0),
                "headroom": headroom,
                "suggested_max_retained_messages": ret,
                "suggested_max_payload_size": pay,
                "suggested_store_budget_bytes": bud,
                "patch_file": f"{PATCHES}/{board}.json",
                "check_status": status,
                "check_errors": errors,
            }
        )
    return out, patches


def _check(
    board: str, patch: dict[str, int], boards: Path | None, profiles: Any
) -> tuple[str, list[str]]:
    """`edgebroker config apply`'s check of the patched profile, on the driver."""
    try:
        path = (boards / f"{board}.json") if boards else profiles.resolve_board(board)
        if not path.is_file():
            return "not checked: no profile for this board", []
        profile = profiles.load_profile(path)
        merged = profiles.merge_patch(profile, patch)
        report = profiles.check_profile(
            merged, profiles.load_schema(), profiles.load_costs(), board
        )
    except Exception as exc:  # the advice is still written; the check says why it could not run
        return f"not checked: {exc}", []
    errors = [str(i) for i in report.errors]
    return ("ok" if not errors else "fails the profile check"), errors


# ------------------------------------------------------------------- build
def _swap(staging: Path, out: Path, name: str) -> None:
    src = staging / name
    if not src.exists():
        return
    dest = out / name
    if dest.exists():
        old = staging / ("old-" + name)
        dest.replace(old)
    src.replace(dest)


def build(spark: SparkSession, opts: Options) -> Result:
    """Run the whole build (see the module docstring); returns what _build.json holds."""
    t0 = time.monotonic()
    if not opts.snapshots.is_dir():
        raise BuildError(f"no such snapshot directory: {opts.snapshots}")
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    build_id = stamp(datetime.now(UTC))
    staging = out / f".staging-{build_id}"
    staging.mkdir()
    try:
        return _build(spark, opts, build_id, staging, t0)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _build(spark: SparkSession, opts: Options, build_id: str, staging: Path, t0: float) -> Result:
    from edgebroker_tools.fleet import spark as fleet_spark

    fleet_spark.apply_required(spark)
    out = opts.out
    inputs = list_inputs(opts.snapshots)
    manifest = _read_json(out / MANIFEST) or {}
    done = cast(dict[str, Any], manifest.get("files", {}))
    new = [f for f in inputs if done.get(f.rel) != f.key]
    result = Result(build_id, None, len(inputs), len(new))
    batch: Path | None = None
    tick = time.monotonic()
    if new:
        fleet_spark.ship_code(spark)
        batch = staging / "batch"
        result.ingested, result.skipped = ingest(spark, new, opts.keep_damaged_stores, batch)
        if not result.ingested:
            batch = None
    tick = result.step("ingest", tick)
    base = load_base(spark, out, batch, build_id)
    obs = dedupe(base)
    coll = collections(obs).persist(StorageLevel.MEMORY_AND_DISK)
    as_of_row = coll.agg(F.max("collected_at")).first()
    as_of = cast("datetime | None", as_of_row[0] if as_of_row else None)
    result.as_of = as_of.astimezone(UTC).isoformat() if as_of else None
    tick = result.step("collections", tick)
    gh = health(coll, opts.near)
    gh.write.parquet(str(staging / "gateway_health"))
    tick = result.step("gateway_health", tick)
    history(obs, coll).select(*HISTORY_COLUMNS).write.parquet(str(staging / "topic_history"))
    tick = result.step("topic_history", tick)
    hist = spark.read.parquet(str(staging / "topic_history"))
    state = fleet_state(hist, coll, as_of or datetime.now(UTC), opts.stale_after)
    state.write.parquet(str(staging / "fleet_state"))
    tick = result.step("fleet_state", tick)
    gh_written = spark.read.parquet(str(staging / "gateway_health"))
    advice, patches = advise(advice_stats(gh_written), opts.headroom, opts.boards)
    coll.unpersist()
    spark.createDataFrame(advice, ADVICE_STRUCT).coalesce(1).write.parquet(
        str(staging / "limits_advice")
    )
    (staging / PATCHES).mkdir()
    for board, patch in patches.items():
        _write_json(staging / PATCHES / f"{board}.json", patch)
    tick = result.step("limits_advice", tick)
    for name in TABLES:
        result.rows[name] = spark.read.parquet(str(staging / name)).count()
    tick = result.step("count", tick)
    # move everything into place; the manifest last
    if batch is not None:
        (out / OBSERVATIONS).mkdir(exist_ok=True)
        batch.replace(out / OBSERVATIONS / f"batch={build_id}")
    for name in (*TABLES, PATCHES):
        _swap(staging, out, name)
    files = dict(done)
    by_rel = {f.rel: f for f in new}
    for entry in result.ingested:
        files[entry["path"]] = by_rel[entry["path"]].key
    _write_json(out / MANIFEST, {"files": files})
    result.seconds = round(time.monotonic() - t0, 3)
    _write_json(out / BUILD_LOG, json.loads(result.to_json()))
    return result


# ------------------------------------------------------------ spark-submit
def summary(result: Result) -> str:
    lines = [
        f"build {result.build_id}: {result.inputs} input file(s), {result.new_files} new, "
        f"{len(result.ingested)} ingested, {len(result.skipped)} skipped, as_of {result.as_of}",
    ]
    for entry in result.skipped:
        lines.append(f"  skipped {entry['path']}: {entry['error']}")
    lines.append("  " + ", ".join(f"{k} {v} rows" for k, v in result.rows.items()))
    steps = ", ".join(f"{k} {v:.1f}" for k, v in result.steps.items())
    lines.append(f"  {result.seconds:.1f} s ({steps})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """spark-submit entry: the master and resources come from spark-submit."""
    from edgebroker_tools.fleet import spark as fleet_spark

    parser = argparse.ArgumentParser(prog="fleet-job", description="The fleet build (PySpark).")
    add_arguments(parser)
    parser.add_argument("--master", default=None, help="only when not run by spark-submit")
    args = parser.parse_args(argv)
    session, owned = fleet_spark.session(cast("str | None", args.master))
    try:
        result = build(session, options_from(args))
    except BuildError as exc:
        print(f"fleet-job: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if owned:
            session.stop()
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The fleet build: snapshots -> fleet tables (PySpark). Also a spark-submit entry:

    spark-submit --master local[2] tools/edgebroker_tools/fleet/job.py \\
        --snapshots SNAPSHOTS/ --out WAREHOUSE/

SNAPSHOTS and WAREHOUSE are URIs (file://, hdfs://, s3a://, viewfs://; a
plain path is file://). Every read, write, listing and rename of either
goes through Spark's readers and writers or the Hadoop FileSystem API of
the session's configuration (hfs.py): nothing here assumes a local disk.

Steps (table columns: the *_COLUMNS lists below; warehouse layout and the
commit protocol: schema.py):

1. Inputs: SNAPSHOTS/retained/**/*.parquet and SNAPSHOTS/stores/**/*.ebrs
   (with their .json), listed by Spark's binaryFile source. Files the
   latest commit names (same path, size and mtime) were ingested by an
   earlier build and are not read.
2. Ingest, on the executors: binaryFile hands each new file's bytes to
   decode.ingest(), which takes the file whole (pyarrow for snapshots,
   edgestore's reader for store files) or reports why not (an accumulator
   brings the per-file status back). A tiny input (TINY_INPUT_BYTES) is
   decoded the same way on the driver, from the same reader's bytes, and
   handed to Spark as Arrow: no Python worker starts. The rows are written
   once, as this build's batch of _observations, and the steps below read
   that batch back (Parquet: each step reads only its columns). Caching the
   decoded rows instead cost more than the reads it saved (6.3 M rows:
   ingest 28.8 -> 16.7 s, the tables 4 s slower). A tiny input stays in
   memory (its rows are a local Arrow table already). The decoder puts
   each collection's retained totals on its header row, keeps
   payload_text for $SYS rows only, and the collection's facts (board,
   source, run_id, limits) on its header rows only (decode.with_totals,
   sys_text_only, facts_on_headers): no step aggregates every row, no
   payload is stored twice, and no fact is converted and written once a
   row (6.3 M rows: the ingest step 21.1 -> 18.9 s, two cold pairs).
3. Everything else is recomputed from all committed batches plus this
   one, so the tables depend on the set of rows ingested, never on the
   order of builds: a build over the same input gives the same tables, and
   a build with new snapshots merges them in (a late, older snapshot too).
   A collection (gateway, collected_at) that arrived twice counts once,
   and one split over several files is merged (dedupe(); schema.py, "A
   collection in several files"): of each input file, the latest batch
   that ingested it; of files that share a topic (a copy under a second
   name, an earlier version), the latest (batch, file name) only; files
   that share no topic are parts, and their rows are merged.
4. Tables go to WAREHOUSE/builds/<build_id>/; then the commit record that
   names them (and the batches and input files) is written under a hidden
   name and renamed into WAREHOUSE/_commits/: until that rename readers see
   the previous build, after it the new one. Then the tables of older
   commits are deleted. A build killed at any point leaves the previous
   commit intact; the next build deletes what the dead one left.
5. Row counts come from observed metrics of the writes (no extra pass),
   and a reporter thread prints the step, Spark's running stage and each
   table's rows on stderr while it works.

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
  store_budget_bytes = max(p99 x headroom, max), to a multiple of 4096
  (the products exact, of the decimals the figures print as: 400 x 1.1 is
  440, not the float 440.00000000000006 and so 448). Gateways whose
  snapshots name no board get no advice (no row, no patch).
  A board whose gateways refused retained messages (retained_full,
  retained_too_large) was cut at its limit, so its data understates the
  need: the advice is then at least the current limit x headroom. Each
  patch is checked like `edgebroker config apply` does (heap, flash).
  A board with fewer than --min-gateways gateways (5) or --min-collections
  collections (10) gets "not enough data" and no patch; every suggestion
  says why (the percentile or maximum it comes from, the refusals).
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
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from typing import Any, Final, cast
from urllib.parse import urlsplit

import pyarrow as pa
from pyspark import StorageLevel
from pyspark.accumulators import AccumulatorParam
from pyspark.sql import Column, DataFrame, Observation, SparkSession, Window
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

from edgebroker_tools.commands import CommandError
from edgebroker_tools.fleet import decode
from edgebroker_tools.fleet.hfs import Hfs, join
from edgebroker_tools.fleet.job_args import Options, add_arguments, options_from
from edgebroker_tools.fleet.schema import (
    BUILDS,
    COLLECT_LOG,
    COMMIT_RE,
    COMMITS,
    INGEST_SCHEMA,
    LIMIT_KEYS,
    OBSERVATIONS,
    PATCHES,
    RETAINED_DIR,
    STORES_DIR,
    TABLES,
    TOTAL_COLUMNS,
    WAREHOUSE_FORMAT,
    commit_name,
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
        *(StructField(c, LongType()) for c in TOTAL_COLUMNS),
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
    "limit_heap_reserve", "limit_max_clients", "retained_util", "bytes_util", "payload_util",
    "heap_util", "clients_util",
    "sys_retained_count", "sys_retained_bytes", "heap_free", "heap_alloc",
    "clients_connected", "uptime_s", "messages_received", "messages_sent",
    "messages_dropped", "broker_version", "refusals", "refusals_total",
    "retained_refusals", "near_retained_limit", "near_payload_limit", "near_store_budget",
    "low_heap", "near_limit",
)  # fmt: skip
ADVICE_STRUCT: Final = StructType(
    [
        StructField("board", StringType(), False),
        StructField("status", StringType()),  # advice | not enough data
        StructField("gateways", LongType()),
        StructField("collections", LongType()),
        StructField("min_gateways", LongType()),
        StructField("min_collections", LongType()),
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
        StructField("why_max_retained_messages", StringType()),
        StructField("why_max_payload_size", StringType()),
        StructField("why_store_budget_bytes", StringType()),
        # patches/<board>.json: beside the tables (the commit record's "patches")
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
    uri: str  # qualified, as Spark's binaryFile reader names it
    rel: str  # relative to the snapshot location (the commit's "files" key)
    size: int
    mtime_ms: int

    @property
    def key(self) -> str:
        return f"{self.rel}|{self.size}|{self.mtime_ms}"


def _binary_files(spark: SparkSession, root: str, glob: str) -> DataFrame:
    """Spark's binaryFile source: path, modificationTime, length, content (read lazily).

    Like every Spark file source it skips names that start with '.' or '_'.
    """
    return (
        spark.read.format("binaryFile")
        .option("recursiveFileLookup", "true")
        .option("pathGlobFilter", glob)
        .load(root)
    )


def list_inputs(spark: SparkSession, fs: Hfs, snapshots: str) -> list[InputFile]:
    """Snapshot Parquet files and store files, sorted by path (one Spark listing)."""
    frames: list[DataFrame] = []
    for kind, sub, glob in (
        (decode.KIND_PARQUET, RETAINED_DIR, "*.parquet"),
        (decode.KIND_STORE, STORES_DIR, "*.ebrs"),
    ):
        root = join(snapshots, sub)
        if fs.is_dir(root):
            frames.append(
                _binary_files(spark, root, glob).select(
                    F.lit(kind).alias("kind"),
                    "path",
                    "length",
                    F.unix_millis("modificationTime").alias("mtime"),
                )
            )
    if not frames:
        return []
    df = frames[0] if len(frames) == 1 else frames[0].unionByName(frames[1])
    prefix = snapshots.rstrip("/") + "/"
    out = [
        InputFile(
            str(r["kind"]),
            str(r["path"]),
            str(r["path"])[len(prefix) :] if str(r["path"]).startswith(prefix) else str(r["path"]),
            int(r["length"]),
            int(r["mtime"]),
        )
        for r in df.collect()
    ]
    return sorted(out, key=lambda f: f.rel)


def store_metadata(spark: SparkSession, fs: Hfs, snapshots: str) -> dict[str, str]:
    """The .json beside each store file, by the store file's URI."""
    root = join(snapshots, STORES_DIR)
    if not fs.is_dir(root):
        return {}
    rows = _binary_files(spark, root, "*.ebrs.json").select("path", "content").collect()
    out: dict[str, str] = {}
    for r in rows:
        try:
            out[str(r["path"]).removesuffix(".json")] = bytes(r["content"]).decode("utf-8")
        except UnicodeDecodeError:
            continue  # reported as missing metadata
    return out


class _ListParam(AccumulatorParam[list[dict[str, Any]]]):
    def zero(self, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return []

    def addInPlace(  # noqa: N802 (pyspark's name)
        self, value1: list[dict[str, Any]], value2: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        value1.extend(value2)
        return value1


# ------------------------------------------------------------------ ingest
#: Files handed to the Python decoder at once (each is a whole file's bytes).
FILES_PER_ARROW_BATCH: Final = 4


@dataclass
class Ingest:
    """A new batch: its rows (decoded on the executors or the driver) and each file's fate."""

    rows: DataFrame | None  # None: no usable file
    statuses: Any  # the accumulator (read after the first action on rows), or the list
    units: dict[str, InputFile]
    skipped: list[dict[str, Any]]

    def outcome(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(ingested, skipped): one dict per file (path, kind, rows / error)."""
        by_uri: dict[str, dict[str, Any]] = {}
        seen = getattr(self.statuses, "value", self.statuses) or []
        for status in cast(list[dict[str, Any]], seen):
            by_uri[str(status["path"])] = status  # a retried task reports twice
        ingested: list[dict[str, Any]] = []
        skipped = list(self.skipped)
        for uri, status in sorted(by_uri.items()):
            f = self.units.get(uri)
            entry = {"path": f.rel if f else uri, "kind": status["kind"]}
            if status["error"]:
                skipped.append({**entry, "error": status["error"]})
            else:
                ingested.append({**entry, "rows": status["rows"]})
        return ingested, sorted(skipped, key=lambda e: str(e["path"]))


def ingest(
    spark: SparkSession,
    fs: Hfs,
    snapshots: str,
    files: Sequence[InputFile],
    keep_damaged: bool,
    on_driver: bool = False,
) -> Ingest:
    """The new files' rows, decoded on the executors from Spark's binaryFile reader.

    Nothing runs until the caller's first action on .rows (the batch write).
    on_driver (a tiny input): the bytes come from the same reader, but are
    decoded here and handed back to Spark as Arrow, so that no Python worker
    starts (its start, about 1.5 s in a fresh JVM, is most of a tiny ingest).
    """
    skipped: list[dict[str, Any]] = []
    metas = (
        store_metadata(spark, fs, snapshots)
        if any(f.kind == decode.KIND_STORE for f in files)
        else {}
    )
    units: dict[str, InputFile] = {}
    for f in files:
        if f.kind == decode.KIND_STORE and f.uri not in metas:
            name = f.uri.rsplit("/", 1)[-1] + ".json"
            skipped.append({"path": f.rel, "kind": f.kind, "error": f"no metadata {name}"})
            continue
        units[f.uri] = f
    if not units:
        return Ingest(None, None, units, skipped)
    kinds = {uri: f.kind for uri, f in units.items()}
    unit_metas = {uri: metas.get(uri) for uri in units}

    def units_of(paths: list[str], content: Any) -> pa.RecordBatch:
        return pa.RecordBatch.from_pydict(
            {
                "kind": [kinds.get(p, decode.KIND_PARQUET) for p in paths],
                "path": paths,
                "content": content,
                "meta": [unit_metas.get(p) for p in paths],
                "keep_damaged": [keep_damaged] * len(paths),
            }
        )

    raw = spark.read.format("binaryFile").load(list(units)).select("path", "content")
    if on_driver:
        got = raw.collect()
        statuses: list[decode.FileStatus] = []
        unit = units_of([str(r["path"]) for r in got], [bytes(r["content"]) for r in got])
        # whole tables, not ingest()'s slices (pyspark cannot convert a sliced
        # list column with nulls), and one chunk at least (nor no chunks)
        out = list(decode.ingest_tables([unit], statuses))
        table = pa.concat_tables([INGEST_SCHEMA.empty_table(), *out]).combine_chunks()
        done = [asdict(st) for st in statuses]
        return Ingest(spark.createDataFrame(table, INGEST_STRUCT), done, units, skipped)
    acc = spark.sparkContext.accumulator(cast(list[dict[str, Any]], []), _ListParam())

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        statuses: list[decode.FileStatus] = []
        try:
            yield from decode.ingest(
                (
                    units_of(cast(list[str], b.column("path").to_pylist()), b.column("content"))
                    for b in batches
                ),
                statuses,
            )
        finally:
            acc.add([asdict(s) for s in statuses])

    rows = raw.mapInArrow(run, INGEST_STRUCT)
    return Ingest(rows, acc, units, skipped)


def _ingest_conf(spark: SparkSession, files: Sequence[InputFile]) -> dict[str, str | None]:
    """Settings for the ingest action (whole files per Arrow batch, files spread over cores);
    returns the previous values for _restore()."""
    total = sum(f.size for f in files)
    cores = spark.sparkContext.defaultParallelism
    split = max(1 << 20, total // max(1, 3 * cores))
    wanted = {
        "spark.sql.execution.arrow.maxRecordsPerBatch": str(FILES_PER_ARROW_BATCH),
        "spark.sql.files.maxPartitionBytes": str(min(split, 128 << 20)),
        "spark.sql.files.openCostInBytes": str(min(4 << 20, split)),
    }
    before = {k: spark.conf.get(k, None) for k in wanted}
    for k, v in wanted.items():
        spark.conf.set(k, v)
    return before


def _restore(spark: SparkSession, before: dict[str, str | None]) -> None:
    for k, v in before.items():
        if v is None:
            spark.conf.unset(k)
        else:
            spark.conf.set(k, v)


def _empty(spark: SparkSession) -> DataFrame:
    schema = StructType([*INGEST_STRUCT.fields, StructField("batch", StringType())])
    return spark.createDataFrame([], schema)


def load_base(
    spark: SparkSession, out: str, batches: Sequence[str], new: DataFrame | None, build_id: str
) -> DataFrame:
    """Every ingested row with its batch id: the committed batches and this build's rows."""
    frames: list[DataFrame] = []
    if batches:
        root = join(out, OBSERVATIONS)
        frames.append(
            spark.read.schema(INGEST_STRUCT)
            .option("basePath", root)
            .parquet(*(join(root, b) for b in batches))
        )
    if new is not None:
        frames.append(new.withColumn("batch", F.lit(build_id)))
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
    """A collection in more than one (batch, file), made one (schema.py, "A
    collection in several files"):

    1. of each input file (_file, its path) only the rows of the latest batch
       that ingested it: a file changed or touched and ingested again replaces
       its earlier copy;
    2. of files of the collection that share a topic (a copy under another
       name, an earlier version), only the latest (batch, file name) is kept,
       whole: a file that shares a topic with a later one is dropped;
    3. files that share no topic are parts of the collection: merged (their
       header rows' totals add up, as they count disjoint rows).

    collections() flags such a collection (its _lo/_hi columns differ), and
    only then does the build call this: small aggregates over the header
    rows and the flagged collections' rows, then broadcast joins.
    """
    keys = ["gateway_id", "collected_at"]
    topic = F.col("topic")
    h = _file_hash()
    heads = base.where(topic.isNull()).select(*keys, "batch", "_file")
    suspects = (
        heads.groupBy(*keys)
        .agg(F.min(h).alias("_lo"), F.max(h).alias("_hi"))
        .where(F.col("_lo") != F.col("_hi"))
        .select(*keys)
    )
    # 1. each file's latest batch (every file of a collection has its header rows)
    latest = (
        heads.join(F.broadcast(suspects), keys)
        .groupBy(*keys, "_file")
        .agg(F.max("batch").alias("_file_batch"))
    )
    current = F.col("_file_batch").isNull() | (F.col("batch") == F.col("_file_batch"))
    rows = (
        base.where(topic.isNotNull())
        .select(*keys, "topic", "batch", "_file")
        .join(F.broadcast(latest), [*keys, "_file"])
        .where(current)
    )
    # 2. a file that shares a topic with a later (batch, file name) is dropped
    version = F.struct(F.col("batch"), F.col("_file"))
    top = rows.groupBy(*keys, "topic").agg(F.max(version).alias("_top"))
    dropped = (
        rows.join(top, [*keys, "topic"])
        .where(version < F.col("_top"))
        .select(*keys, "batch", "_file")
        .distinct()
        .withColumn("_dropped", F.lit(True))
    )
    return (
        base.join(F.broadcast(latest), [*keys, "_file"], "left")
        .where(current)
        .join(F.broadcast(dropped), [*keys, "batch", "_file"], "left")
        .where(F.col("_dropped").isNull())
        .drop("_file_batch", "_dropped")
    )


def _file_hash() -> Column:
    return F.xxhash64("batch", "_file")  # cheap to compare; the exact key decides in dedupe()


def collections(obs: DataFrame) -> DataFrame:
    """One row per (gateway, collection): its facts, retained totals and $SYS statistics.

    One aggregate over the header rows and the $SYS rows only (about 5% of
    the rows): the decoder put each collection's retained totals on its
    header row (decode.with_totals), so no aggregate reads every row.
    """
    topic = F.col("topic")
    head = topic.isNull()

    def fact(name: str) -> Column:
        return F.max(F.when(head, F.col(name))).alias(name)

    refusal = F.when(
        topic.startswith(SYS_PREFIX + "refusals/"),
        F.struct(
            F.substring(topic, len(SYS_PREFIX) + len("refusals/") + 1, 1000).alias("cause"),
            F.col("payload_text").try_cast("long").alias("count"),
        ),
    )
    # one entry per cause, with a count (the largest, should a cause come
    # twice: a collection not yet deduped, which the build writes again,
    # or a file that repeats a row), so that health()'s map has no
    # repeated key (Spark refuses those)
    counted = F.filter(F.collect_list(refusal), lambda r: r["count"].isNotNull())
    causes = F.array_sort(F.array_distinct(F.transform(counted, lambda r: r["cause"])))
    refusals = F.transform(
        causes,
        lambda c: F.struct(
            c.alias("cause"),
            F.array_max(
                F.transform(F.filter(counted, lambda r: r["cause"] == c), lambda r: r["count"])
            ).alias("count"),
        ),
    )
    return (
        obs.where(head | topic.startswith(SYS_PREFIX))
        .groupBy("gateway_id", "collected_at")
        .agg(
            *(fact(c) for c in ("board", "source", "run_id")),
            *(fact(f"limit_{k}") for k in LIMIT_KEYS),
            # in two (batch, file)s: every file of a collection has its header row
            F.min(F.when(head, _file_hash())).alias("_lo"),
            F.max(F.when(head, _file_hash())).alias("_hi"),
            F.coalesce(F.sum("_retained_count"), F.lit(0)).cast("long").alias("retained_count"),
            F.coalesce(F.sum("_retained_bytes"), F.lit(0)).cast("long").alias("retained_bytes"),
            F.coalesce(F.max("_max_payload_bytes"), F.lit(0))
            .cast("long")
            .alias("max_payload_bytes"),
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
            refusals.alias("_refusals"),
        )
    )


def health(coll: DataFrame, near: float) -> DataFrame:
    """gateway_health: collections with utilisation and flags."""
    latest = F.max("collected_at").over(Window.partitionBy("gateway_id"))
    refusals = F.map_from_entries("_refusals")  # a cause once, its count not null: collections()
    total = F.aggregate("_refusals", F.lit(0).cast("long"), lambda acc, r: acc + r["count"])
    retained_refused = F.aggregate(
        "_refusals",
        F.lit(0).cast("long"),
        lambda acc, r: acc + F.when(r["cause"].isin(*RETAINED_REFUSALS), r["count"]).otherwise(0),
    )

    def util(used: Column, limit: str) -> Column:
        lim = F.col(limit)
        return F.when(lim > 0, used / lim)

    count = F.coalesce(F.col("sys_retained_count"), F.col("retained_count"))
    nbytes = F.coalesce(F.col("sys_retained_bytes"), F.col("retained_bytes"))
    # three layers of withColumns: one analysis of the plan each, not one
    # per column (a column may only use those of an earlier layer)
    df = coll.withColumns(
        {
            "is_latest": F.col("collected_at") == latest,
            "refusals": refusals,
            "refusals_total": total,
            "retained_refusals": retained_refused,
            "retained_util": util(count, "limit_max_retained_messages"),
            "bytes_util": util(nbytes, "limit_store_budget_bytes"),
            "payload_util": util(F.col("max_payload_bytes"), "limit_max_payload_size"),
            "clients_util": util(F.col("clients_connected"), "limit_max_clients"),
            # heap: the reserve over what is free (100%: the broker refuses connections)
            "heap_util": F.when(
                F.col("heap_free").isNotNull() & (F.col("limit_heap_reserve") > 0),
                F.col("limit_heap_reserve") / F.greatest(F.col("heap_free"), F.lit(1)),
            ),
            "low_heap": F.coalesce(
                F.col("heap_free") < 2 * F.col("limit_heap_reserve"), F.lit(False)
            ),
        }
    )
    df = df.withColumns(
        {
            "near_retained_limit": F.coalesce(F.col("retained_util") >= near, F.lit(False)),
            "near_payload_limit": F.coalesce(F.col("payload_util") >= near, F.lit(False)),
            "near_store_budget": F.coalesce(F.col("bytes_util") >= near, F.lit(False)),
        }
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
    """topic_history: one shuffle by gateway and one sort by (gateway, topic, collected_at).

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
    # Hashes first: the sort then compares longs, not long common prefixes.
    # Shuffled by the gateway's hash (_g) and sorted by it first, every
    # gateway's segments are together in one file: its gateway_id, board and
    # collection times compress to almost nothing (the table is half the
    # size, written and read back faster) and a reader's gateway filter
    # skips row groups. _k orders a gateway's topics. _vh stands for the
    # value's qos and properties (one lag, not four); the payload itself is
    # compared exactly.
    rows = rows.withColumns(
        {
            "_g": F.xxhash64("gateway_id"),
            "_k": F.xxhash64("gateway_id", "topic"),
            "_vh": F.xxhash64("qos", "content_type", "payload_format", "user_properties"),
        }
    ).repartition("_g")
    w = Window.partitionBy("_g", "_k", "gateway_id", "topic").orderBy("collected_at")
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
    earliest = datetime.min.replace(tzinfo=as_of.tzinfo)  # pyspark's as_of is naive
    since = as_of - stale_after if as_of - earliest > stale_after else earliest
    silent_before = F.lit(since).cast("timestamp")
    reason = (
        F.when(F.col("ended_by") == "expired", F.lit("expired"))
        .when(F.col("valid_to").isNotNull(), F.lit("gone"))
        .when(F.col("expires_at") <= as_of_lit, F.lit("expired"))
        .when(F.col("gateway_last_collected") < silent_before, F.lit("gateway_silent"))
    )
    df = (
        hist.where("is_latest")
        .join(F.broadcast(last), ["gateway_id"])
        .withColumns(
            {
                "last_changed": F.col("valid_from"),
                "change_count": F.col("segment") - 1,
                "present": F.col("valid_to").isNull(),
                "stale_reason": reason,
                "stale": reason.isNotNull(),
                "as_of": as_of_lit,
            }
        )
    )
    return df.select(*STATE_COLUMNS)


COLLECT_LOG_STRUCT: Final = StructType(
    [
        StructField("run_id", StringType()),
        StructField("gateway_id", StringType()),
        StructField("address", StringType()),
        StructField("board", StringType()),
        StructField("status", StringType()),
        StructField("attempts", LongType()),
        StructField("error", StringType()),
        StructField("collected_at", StringType()),
    ]
)
COLLECT_STATUS_COLUMNS: Final = (
    "gateway_id", "board", "address", "status", "last_run_id", "attempts", "last_error",
    "failed_runs", "last_ok_run_id", "last_ok_collected_at",
)  # fmt: skip


def collect_status(log: DataFrame) -> DataFrame:
    """collect_status: per gateway, its latest collect attempt and its last success."""
    ok = F.col("status") == "ok"
    latest = F.max_by(F.struct("status", "attempts", "error", "address", "board"), F.col("run_id"))
    return (
        log.where(F.col("gateway_id").isNotNull())
        .groupBy("gateway_id")
        .agg(
            latest.alias("_last"),
            F.max("run_id").alias("last_run_id"),
            F.count(F.when(~ok, 1)).alias("failed_runs"),
            F.max(F.when(ok, F.col("run_id"))).alias("last_ok_run_id"),
            F.max(F.when(ok, F.col("collected_at"))).alias("last_ok_collected_at"),
        )
        .select(
            "gateway_id",
            F.col("_last.board").alias("board"),
            F.col("_last.address").alias("address"),
            F.col("_last.status").alias("status"),
            "last_run_id",
            F.col("_last.attempts").alias("attempts"),
            F.col("_last.error").alias("last_error"),
            "failed_runs",
            "last_ok_run_id",
            F.to_timestamp("last_ok_collected_at").alias("last_ok_collected_at"),
        )
    )


# ------------------------------------------------------------------ advice
def _exact(value: float) -> Fraction:
    """A float as the decimal it prints as (400.0, 1.1): the products of the
    advice are then exact (400 x 1.1 = 440, not 440.00000000000006)."""
    return Fraction(repr(float(value)))


def _round_up(value: float | Fraction, step: int) -> int:
    """value (at least 1) up to a multiple of step; a float is taken as the decimal it prints as."""
    exact = value if isinstance(value, Fraction) else _exact(value)
    return int(math.ceil(max(exact, Fraction(1)) / step) * step)


def advice_stats(gh: DataFrame) -> list[dict[str, Any]]:
    """Per board, the distributions over each gateway's latest collection (one aggregate
    over gateway_health, which the build holds in memory)."""
    latest = F.col("is_latest")

    def last(c: Column | str) -> Column:
        return F.when(latest, c if isinstance(c, Column) else F.col(c))

    count = last(F.coalesce(F.col("sys_retained_count"), F.col("retained_count")))
    nbytes = last(F.coalesce(F.col("sys_retained_bytes"), F.col("retained_bytes")))
    payload = last("max_payload_bytes")
    q = F.array(F.lit(0.5), F.lit(0.9), F.lit(0.99))
    rows = (
        gh.groupBy("board")
        .agg(
            F.count(F.when(latest, 1)).alias("gateways"),
            F.count(F.lit(1)).alias("collections"),
            F.max(last("limit_max_retained_messages")).alias("current_max_retained_messages"),
            F.max(last("limit_max_payload_size")).alias("current_max_payload_size"),
            F.max(last("limit_store_budget_bytes")).alias("current_store_budget_bytes"),
            F.percentile(count, q).alias("count_q"),
            F.max(count).alias("retained_count_max"),
            F.percentile(payload, q).alias("payload_q"),
            F.max(payload).alias("max_payload_max"),
            F.percentile(nbytes, q).alias("bytes_q"),
            F.max(nbytes).alias("retained_bytes_max"),
            F.sum(last(F.coalesce(F.col("refusals")["retained_full"], F.lit(0)))).alias("rf"),
            F.sum(last(F.coalesce(F.col("refusals")["retained_too_large"], F.lit(0)))).alias("rtl"),
        )
        .where(F.col("gateways") > 0)
        .orderBy("board")
        .collect()
    )
    return [r.asDict() for r in rows]


def _suggest(
    key: str,
    p99: float,
    observed_max: float,
    current: int | None,
    refused: int,
    cause: str,
    headroom: float,
    step: int,
    use_p99: bool = True,
) -> tuple[int, str]:
    """One suggested limit and why: the observation it comes from and any refusals."""
    scaled = _exact(p99 if use_p99 else observed_max) * _exact(headroom)
    base = max(scaled, _exact(observed_max)) if use_p99 else scaled
    value = _round_up(base, step)
    if use_p99:
        why = (
            f"p99 {p99:,.0f} x {headroom:g} = {float(scaled):,.0f}"
            if scaled >= _exact(observed_max)
            else f"max {observed_max:,.0f} (above p99 {p99:,.0f} x {headroom:g})"
        )
    else:
        why = f"largest {observed_max:,.0f} x {headroom:g} = {float(scaled):,.0f}"
    if refused and current:
        floor = _round_up(current * _exact(headroom), step)
        if floor > value:
            value = floor
            why = (
                f"{refused:,} refused ({cause}) at the limit {current:,}, so the data is cut "
                f"there: limit x {headroom:g}"
            )
        else:
            why += f"; {refused:,} refused ({cause})"
    why += f", to a multiple of {step:,} -> {value:,}"
    if current:
        change = "raise" if value > current else "lower" if value < current else "keep"
        why = f"{change} {key} {current:,} -> {value:,}: {why}"
    return value, why


def advise(
    stats: list[dict[str, Any]],
    headroom: float,
    boards: Path | None,
    min_gateways: int = 5,
    min_collections: int = 10,
    patch_dir: str = PATCHES,
) -> tuple[list[dict[str, Any]], dict[str, dict[str, int]]]:
    """Suggested limits per board and the profile patches (checked when the board is known).

    A board with fewer than min_gateways gateways or min_collections
    collections gets no suggestion ("not enough data") and no patch; the
    gateways without a board (a snapshot that names none) get no row.
    """
    from edgebroker_tools import profiles

    out: list[dict[str, Any]] = []
    patches: dict[str, dict[str, int]] = {}
    for s in stats:
        if s["board"] is None:
            continue  # gateways whose snapshots name no board: no limits to advise
        board = str(s["board"])
        cq = cast(list[float], s["count_q"] or [0.0, 0.0, 0.0])
        pq_ = cast(list[float], s["payload_q"] or [0.0, 0.0, 0.0])
        bq = cast(list[float], s["bytes_q"] or [0.0, 0.0, 0.0])
        cur_ret = cast("int | None", s["current_max_retained_messages"])
        cur_pay = cast("int | None", s["current_max_payload_size"])
        cur_bud = cast("int | None", s["current_store_budget_bytes"])
        gateways, colls = int(s["gateways"] or 0), int(s["collections"] or 0)
        rf, rtl = int(s["rf"] or 0), int(s["rtl"] or 0)
        row: dict[str, Any] = {
            "board": board,
            "gateways": gateways,
            "collections": colls,
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
            "refusals_retained_full": rf,
            "refusals_retained_too_large": rtl,
            "headroom": headroom,
            "min_gateways": min_gateways,
            "min_collections": min_collections,
        }
        short = []
        if gateways < min_gateways:
            short.append(f"{gateways} gateway(s), minimum {min_gateways}")
        if colls < min_collections:
            short.append(f"{colls} collection(s), minimum {min_collections}")
        if short:
            why = "not enough data: " + "; ".join(short)
            out.append(
                row
                | {
                    "status": "not enough data",
                    "suggested_max_retained_messages": None,
                    "suggested_max_payload_size": None,
                    "suggested_store_budget_bytes": None,
                    "why_max_retained_messages": why,
                    "why_max_payload_size": why,
                    "why_store_budget_bytes": why,
                    "patch_file": None,
                    "check_status": "not checked: not enough data",
                    "check_errors": [],
                }
            )
            continue
        ret, why_ret = _suggest(
            "max_retained_messages", cq[2], float(s["retained_count_max"] or 0), cur_ret, rf,
            "retained_full", headroom, 8,
        )  # fmt: skip
        pay, why_pay = _suggest(
            "max_payload_size", pq_[2], float(s["max_payload_max"] or 0), cur_pay, rtl,
            "retained_too_large", headroom, 64, use_p99=False,
        )  # fmt: skip
        bud, why_bud = _suggest(
            "store_budget_bytes", bq[2], float(s["retained_bytes_max"] or 0), cur_bud, rf,
            "retained_full", headroom, 4096,
        )  # fmt: skip
        patch = {"max_retained_messages": ret, "max_payload_size": pay, "store_budget_bytes": bud}
        patches[board] = patch
        status, errors = _check(board, patch, boards, profiles)
        out.append(
            row
            | {
                "status": "advice",
                "suggested_max_retained_messages": ret,
                "suggested_max_payload_size": pay,
                "suggested_store_budget_bytes": bud,
                "why_max_retained_messages": why_ret,
                "why_max_payload_size": why_pay,
                "why_store_budget_bytes": why_bud,
                "patch_file": f"{patch_dir}/{board}.json",
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
#: EDGEBROKER_FLEET_FAIL_AT=<step>: the build process exits hard (os._exit) right
#: after that step, as if killed there (the fault tests use it).
FAIL_ENV: Final = "EDGEBROKER_FLEET_FAIL_AT"
FAIL_EXIT: Final = 86
#: The steps, in order; each is a point where the fault hook can end the process.
STEPS: Final = (
    "ingest", "gateway_health", "topic_history", "fleet_state", "limits_advice", "patches",
    "manifest", "swap",
)  # fmt: skip
#: Committed builds whose tables are kept (the latest and the one before, so that a
#: reader that resolved the previous commit just before can finish).
KEEP_COMMITS: Final = 2
#: Input below this many bytes: one shuffle partition per core (fixed costs dominate).
SMALL_INPUT_BYTES: Final = 64 << 20
#: Input below this many bytes (a few hundred thousand rows at most): the
#: build is all fixed cost, so the files are decoded on the driver (no
#: Python worker starts), expressions are interpreted rather than compiled,
#: adaptive execution is off (no re-planning between query stages), and
#: as_of and the duplicate check ride on the gateway_health write instead of
#: a pass of their own. Above it, compiled code and the
#: separate pass (which fills the collections cache before two writes share
#: it) are faster: 6.3 M rows (35 MB of snapshots) took 108 s the tiny way,
#: 76 s the other.
TINY_INPUT_BYTES: Final = 4 << 20


def checkpoint(step: str) -> None:
    """The fault hook (see FAIL_ENV); a no-op unless the variable names this step."""
    if os.environ.get(FAIL_ENV) == step:
        sys.stderr.write(f"fleet-job: {FAIL_ENV}={step}: exiting hard\n")
        sys.stderr.flush()
        os._exit(FAIL_EXIT)


@dataclass(frozen=True)
class Commit:
    """A commit record (schema.py): what a reader of the warehouse resolves."""

    seq: int
    data: dict[str, Any]

    @property
    def build_id(self) -> str:
        return str(self.data["build_id"])

    @property
    def batches(self) -> list[str]:
        return [str(b) for b in self.data.get("batches", [])]

    @property
    def files(self) -> dict[str, str]:
        return {str(k): str(v) for k, v in dict(self.data.get("files", {})).items()}

    @property
    def format(self) -> int:
        """The warehouse layout it was written with (schema.WAREHOUSE_FORMAT; 1 if unnamed)."""
        return int(self.data.get("format", 1))


def commits(fs: Hfs, out: str) -> list[Commit]:
    """The warehouse's commit records, oldest first (the last is its state)."""
    found: list[Commit] = []
    for st in fs.list(join(out, COMMITS)):
        m = COMMIT_RE.match(st.name)
        if m and not st.is_dir:
            found.append(Commit(int(m.group(1)), json.loads(fs.read(st.path))))
    return found


def cleanup(fs: Hfs, out: str, kept: Sequence[Commit]) -> list[str]:
    """Delete what no kept commit names: a dead build's batch, builds/ and temporary
    files, and the tables of older commits. Returns the URIs removed."""
    removed: list[str] = []
    keep_builds = {c.build_id for c in kept}
    keep_batches = set(kept[-1].batches) if kept else set()
    keep_commits = {commit_name(c.seq) for c in kept}
    for st in fs.list(join(out, BUILDS)):
        if st.name not in keep_builds and fs.delete(st.path):
            removed.append(st.path)
    for st in fs.list(join(out, OBSERVATIONS)):
        if st.name not in keep_batches and fs.delete(st.path):
            removed.append(st.path)
    for st in fs.list(join(out, COMMITS)):
        if st.name not in keep_commits and fs.delete(st.path):
            removed.append(st.path)
    return removed


class _Reporter:
    """Progress on stderr while the build works: the step, Spark's running stage
    (tasks done / all) every few seconds, and each step's rows and seconds."""

    def __init__(self, spark: SparkSession, enabled: bool, every: float = 3.0) -> None:
        self.enabled = enabled
        self.t0 = time.monotonic()
        self.step = "start"
        self._tracker = spark.sparkContext.statusTracker()
        self._stop = threading.Event()
        self._every = every
        self._thread = threading.Thread(target=self._poll, name="fleet-progress", daemon=True)
        if enabled:
            self._thread.start()

    def say(self, text: str) -> None:
        if self.enabled:
            sys.stderr.write(f"  [{time.monotonic() - self.t0:6.1f} s] {text}\n")
            sys.stderr.flush()

    def begin(self, step: str) -> None:
        self.step = step

    def _poll(self) -> None:
        last = ""
        while not self._stop.wait(self._every):
            try:
                infos = [self._tracker.getStageInfo(s) for s in self._tracker.getActiveStageIds()]
            except Exception:  # the session is stopping
                return
            running = [i for i in infos if i is not None]
            if not running:
                continue
            text = ", ".join(
                f"stage {i.stageId} {i.numCompletedTasks}/{i.numTasks} tasks" for i in running
            )
            if text != last:
                last = text
                self.say(f"{self.step}: {text}")

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


#: A Java I/O exception's message in a failed write (the JVM's, through Py4J).
_IO_FAILURE: Final = re.compile(
    r"(?:java\.io\.IOException|java\.nio\.file\.\w+Exception"
    r"|org\.apache\.hadoop\.[\w.$]*Exception): ([^\n]+)"
)


def _save(df: DataFrame, uri: str, name: str) -> None:
    """df written as Parquet at uri. A write that fails for the warehouse
    location (an I/O exception about a path under uri: no permission, no
    space, a directory that cannot be made) is a BuildError line, not a
    Py4J traceback; any other failure (reading the input, a bug) is raised
    as it is."""
    try:
        df.write.parquet(uri)
    except Exception as exc:  # the JVM's, through Py4J
        where = urlsplit(uri).path or uri
        found = next((m for m in _IO_FAILURE.finditer(str(exc)) if where in m.group(1)), None)
        if found is None:
            raise
        raise BuildError(f"cannot write {uri} ({name}): {found.group(1).strip()}") from None


def _write(df: DataFrame, uri: str, name: str) -> tuple[DataFrame, Observation]:
    """df observed for its row count (no extra pass), and written as Parquet at uri."""
    obs = Observation(name)
    observed = df.observe(obs, F.count(F.lit(1)).alias("rows"))
    _save(observed, uri, name)
    return observed, obs


def _rows(obs: Observation) -> int:
    return int(obs.get.get("rows") or 0)


def build(spark: SparkSession, opts: Options) -> Result:
    """Run the whole build (see the module docstring); returns the build log."""
    from edgebroker_tools.fleet import spark as fleet_spark

    t0 = time.monotonic()
    fleet_spark.apply_required(spark)
    fs = Hfs(spark)
    try:
        snapshots = fs.qualify(opts.snapshots)
        found = fs.is_dir(snapshots)
    except Exception as exc:  # the JVM's (through Py4J): no FileSystem for its scheme, ...
        raise BuildError(
            f"--snapshots {opts.snapshots}: cannot be read: {fleet_spark._reason(exc)}"
        ) from None
    if not found:
        raise BuildError(f"no such snapshot directory: {opts.snapshots}")
    try:
        out = fs.qualify(opts.out)
        if not fs.is_dir(out):
            fs.mkdirs(out)  # a file there: Hadoop refuses (FileAlreadyExistsException)
        made = fs.is_dir(out)  # a local mkdirs that fails returns false, it does not raise
    except Exception as exc:  # the JVM's: a file there, no permission, ...
        raise BuildError(
            f"--out {opts.out}: cannot be used as the warehouse directory: "
            f"{fleet_spark._reason(exc)}"
        ) from None
    if not made:
        raise BuildError(
            f"--out {opts.out}: cannot be used as the warehouse directory: "
            f"the directory {out} could not be created"
        )
    history_ = commits(fs, out)
    last = history_[-1] if history_ else None
    cleanup(fs, out, history_[-KEEP_COMMITS:])  # what a killed build left behind
    build_id = stamp(datetime.now(UTC))
    reporter = _Reporter(spark, opts.progress)
    try:
        return _build(_Run(spark, fs, opts, snapshots, out, last, build_id, reporter, t0))
    finally:
        reporter.close()


@dataclass(frozen=True)
class _Run:
    """What every step of one build works with."""

    spark: SparkSession
    fs: Hfs
    opts: Options
    snapshots: str
    out: str
    last: Commit | None
    build_id: str
    rep: _Reporter
    t0: float

    @property
    def reusable(self) -> bool:
        """The previous commit's batches are of this layout: the build adds to them."""
        return self.last is not None and self.last.format == WAREHOUSE_FORMAT

    @property
    def done(self) -> dict[str, str]:
        """The input files the previous commit saw (path -> size|mtime key)."""
        return self.last.files if self.last and self.reusable else {}

    @property
    def batches(self) -> list[str]:
        """The observation batches the previous commit names."""
        return self.last.batches if self.last and self.reusable else []


def _build(run: _Run) -> Result:
    from edgebroker_tools.fleet import spark as fleet_spark

    spark, fs, snapshots, build_id, rep = run.spark, run.fs, run.snapshots, run.build_id, run.rep
    done = run.done
    rep.begin("list")
    if run.last is not None and not run.reusable:
        rep.say(
            f"warehouse format {run.last.format} -> {WAREHOUSE_FORMAT}: "
            "every snapshot is ingested again"
        )
    inputs = list_inputs(spark, fs, snapshots)
    new = [f for f in inputs if done.get(f.rel) != f.key]
    result = Result(build_id, None, len(inputs), len(new))
    rep.say(f"{len(inputs)} input file(s), {len(new)} new")
    if not fleet_spark.user_set(spark, "spark.sql.shuffle.partitions"):
        seen = sum(int(k.rsplit("|", 2)[1]) for k in done.values() if k.count("|") >= 2)
        total = seen + sum(f.size for f in new)
        if total < SMALL_INPUT_BYTES:
            cores = spark.sparkContext.defaultParallelism
            spark.conf.set("spark.sql.shuffle.partitions", str(cores))
    tiny = sum(f.size for f in inputs) < TINY_INPUT_BYTES
    before = _small_conf(spark) if tiny else {}
    try:
        return _build_inputs(run, tiny, new, result)
    finally:
        _restore(spark, before)


def _small_conf(spark: SparkSession) -> dict[str, str | None]:
    """A tiny input (the build's fixed costs dominate): expressions are
    interpreted rather than compiled, and adaptive query execution is off.
    Compiling the generated Java of each of the build's plans costs seconds
    in a fresh JVM, and re-planning after each query stage a few tenths;
    neither saves anything on a few thousand rows. Returns the previous
    values for _restore()."""
    wanted = {
        "spark.sql.codegen.wholeStage": "false",
        "spark.sql.codegen.factoryMode": "NO_CODEGEN",
        "spark.sql.adaptive.enabled": "false",
        "spark.sql.autoBroadcastJoinThreshold": "-1",
    }
    from edgebroker_tools.fleet import spark as fleet_spark

    wanted = {k: v for k, v in wanted.items() if not fleet_spark.user_set(spark, k)}
    before = {k: spark.conf.get(k, None) for k in wanted}
    for k, v in wanted.items():
        spark.conf.set(k, v)
    return before


def _build_inputs(run: _Run, tiny: bool, new: list[InputFile], result: Result) -> Result:
    from edgebroker_tools.fleet import spark as fleet_spark

    spark, fs, opts, snapshots, out, build_id, rep = (
        run.spark, run.fs, run.opts, run.snapshots, run.out, run.build_id, run.rep
    )  # fmt: skip
    batches = run.batches
    tables = join(out, BUILDS, build_id)
    tick = time.monotonic()
    rep.begin("ingest")
    new_rows: DataFrame | None = None
    if new:
        if not tiny:
            fleet_spark.ship_code(spark)
        got = ingest(spark, fs, snapshots, new, opts.keep_damaged_stores, on_driver=tiny)
        if got.rows is not None:
            before = _ingest_conf(spark, new)
            batch_uri = join(out, OBSERVATIONS, f"batch={build_id}")
            try:
                rows = got.rows.persist(StorageLevel.MEMORY_AND_DISK) if tiny else got.rows
                _obs, count = _write(rows, batch_uri, "ingest")
                result.rows["ingested"] = _rows(count)
            finally:
                _restore(spark, before)
            new_rows = rows if tiny else spark.read.schema(INGEST_STRUCT).parquet(batch_uri)
        result.ingested, result.skipped = got.outcome()
        if not result.ingested:
            new_rows = None
    tick = result.step("ingest", tick)
    rep.say(f"ingest: {len(result.ingested)} file(s), {result.rows.get('ingested', 0):,} rows, "
            f"{len(result.skipped)} skipped")  # fmt: skip
    checkpoint("ingest")
    rep.begin("collections")
    base = load_base(spark, out, batches, new_rows, build_id)
    obs = base
    coll = collections(obs).persist(StorageLevel.MEMORY_AND_DISK)
    deduped = False
    if not tiny:
        # a large input: one pass fills the collections cache before the
        # table writes share it (two writes at once would each compute it)
        # and finds a collection that is in two files
        probe = coll.agg(F.max(_in_two_files())).first()
        if probe is not None and probe[0]:
            obs, coll = _deduped(base, coll)
            deduped = True
    # The tables that do not depend on each other are written at once, from
    # threads of this driver (Spark runs jobs of one session concurrently):
    # on a small fleet each write is mostly fixed driver-side cost (planning,
    # task launch, the commit protocol) that overlaps; on a large one they
    # share the cores. The fault checkpoints stay in order, each after the
    # writes it names have finished.
    pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix="fleet-write")
    try:
        try:
            return _tables(run, result, obs, coll, deduped, new, new_rows, tables, tick, pool)
        except _DuplicateCollectionsError:
            # a tiny input's gateway_health write saw it: write them again
            obs, coll = _deduped(base, coll)
            return _tables(run, result, obs, coll, True, new, new_rows, tables, tick, pool)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _in_two_files() -> Column:
    """1 for a collection that is in two (batch, file)s (collections()' _lo/_hi)."""
    return (F.col("_lo") != F.col("_hi")).cast("int")


def _deduped(base: DataFrame, coll: DataFrame) -> tuple[DataFrame, DataFrame]:
    """A collection in two files (a file copied or changed and ingested
    again): one copy of each kept, the collections made again from it."""
    coll.unpersist()
    obs = dedupe(base)
    return obs, collections(obs).persist(StorageLevel.MEMORY_AND_DISK)


class _DuplicateCollectionsError(Exception):
    """gateway_health saw a collection in two files: dedupe and write again."""


def _tables(
    run: _Run,
    result: Result,
    obs: DataFrame,
    coll: DataFrame,
    deduped: bool,
    new: list[InputFile],
    new_rows: DataFrame | None,
    tables: str,
    tick: float,
    pool: ThreadPoolExecutor,
) -> Result:
    spark, fs, opts, snapshots, out, last, build_id, rep, t0 = (
        run.spark, run.fs, run.opts, run.snapshots, run.out, run.last, run.build_id, run.rep,
        run.t0,
    )  # fmt: skip
    done, batches = run.done, run.batches

    def write(df: DataFrame, name: str) -> Future[int]:
        def run() -> int:
            _obs, count = _write(df, join(tables, name), name)
            return _rows(count)

        return pool.submit(run)

    def then(fut: Future[int], name: str) -> None:
        result.rows[name] = fut.result()
        rep.say(f"{name}: {result.rows[name]:,} rows")

    rep.begin("gateway_health, topic_history")
    # as_of and the duplicate check are observed while gateway_health is
    # written (no separate pass over the collections)
    probe = Observation("collections")
    checked = coll.observe(
        probe,
        F.max("collected_at").alias("as_of"),
        F.max(_in_two_files()).alias("dup"),
    )
    # topic_history first: the longest write, its small broadcast jobs then
    # run before gateway_health's tasks, not behind them
    hist_f = write(history(obs, coll).select(*HISTORY_COLUMNS), "topic_history")
    gh = health(checked, opts.near).persist(StorageLevel.MEMORY_AND_DISK)
    gh_f = write(gh, "gateway_health")
    log_uri = join(snapshots, COLLECT_LOG)
    if fs.exists(log_uri):
        status = collect_status(spark.read.schema(COLLECT_LOG_STRUCT).json(log_uri))
    else:
        # no collect log (synth, copied snapshots): the table's columns and no
        # row. limit(0) makes the plan an empty local relation (Spark's
        # OptimizeLimitZero), so no aggregation runs over an empty Python
        # RDD (3.2 s of task time in a cold JVM in one build's event log;
        # the build's wall time did not move beyond its noise)
        status = collect_status(spark.createDataFrame([], COLLECT_LOG_STRUCT)).limit(0)
    status_f = write(status.coalesce(1), "collect_status")
    # limits advice needs only gateway_health (in memory): aggregated while
    # topic_history is written
    stats: Future[list[dict[str, Any]]] = pool.submit(_after, gh_f, lambda: advice_stats(gh))
    then(gh_f, "gateway_health")
    seen = probe.get
    if seen.get("dup") and not deduped:
        for f in (hist_f, status_f, stats):
            f.exception()  # finished, whatever it did: the tables are written again
        gh.unpersist()
        fs.delete(tables)
        raise _DuplicateCollectionsError
    as_of = cast("datetime | None", seen.get("as_of"))
    result.as_of = as_of.astimezone(UTC).isoformat() if as_of else None
    then(status_f, "collect_status")
    tick = result.step("gateway_health", tick)
    checkpoint("gateway_health")
    then(hist_f, "topic_history")
    tick = result.step("topic_history", tick)
    checkpoint("topic_history")
    rep.begin("fleet_state, limits_advice")
    # fleet_state is topic_history's latest segments: read back (column pruning and
    # one filter) rather than computing the windows again or caching every segment
    hist = spark.read.parquet(join(tables, "topic_history"))
    state = fleet_state(hist, coll, as_of or datetime.now(UTC), opts.stale_after)
    state_f = write(state, "fleet_state")
    advice, patches = advise(
        stats.result(), opts.headroom, opts.boards, opts.min_gateways, opts.min_collections
    )  # fmt: skip
    advice_f = pool.submit(
        lambda: _save(
            spark.createDataFrame(advice, ADVICE_STRUCT).coalesce(1),
            join(tables, "limits_advice"),
            "limits_advice",
        )
    )
    then(state_f, "fleet_state")
    tick = result.step("fleet_state", tick)
    checkpoint("fleet_state")
    advice_f.result()
    coll.unpersist()
    gh.unpersist()
    result.rows["limits_advice"] = len(advice)
    checkpoint("limits_advice")
    for board, patch in patches.items():
        fs.write(join(tables, PATCHES, f"{board}.json"), _json_bytes(patch))
    tick = result.step("limits_advice", tick)
    checkpoint("patches")
    if new_rows is not None:
        new_rows.unpersist()
    # the commit: one record that names the new tables; written whole, then published
    files = dict(done)
    by_rel = {f.rel: f for f in new}
    for entry in result.ingested:
        files[entry["path"]] = by_rel[entry["path"]].key
    seq = (last.seq if last else 0) + 1
    result.seconds = round(time.monotonic() - t0, 3)
    record = {
        "seq": seq,
        "format": WAREHOUSE_FORMAT,
        "build_id": build_id,
        "tables": {name: f"{BUILDS}/{build_id}/{name}" for name in TABLES},
        "patches": f"{BUILDS}/{build_id}/{PATCHES}",
        "batches": sorted({*batches, *([f"batch={build_id}"] if result.ingested else [])}),
        "files": files,
        "build": json.loads(result.to_json()),
    }
    tmp = join(out, COMMITS, f".{commit_name(seq)}.{build_id}.tmp")
    fs.write(tmp, _json_bytes(record))
    checkpoint("manifest")
    if not fs.rename(tmp, join(out, COMMITS, commit_name(seq))):
        fs.delete(tmp)
        raise BuildError(f"another build committed {commit_name(seq)} first: nothing committed")
    checkpoint("swap")
    kept = commits(fs, out)[-KEEP_COMMITS:]
    cleanup(fs, out, kept)
    result.step("commit", tick)
    result.seconds = round(time.monotonic() - t0, 3)
    rep.say(f"committed {commit_name(seq)} ({result.seconds:.1f} s)")
    return result


def _after(first: Future[Any], then: Callable[[], Any]) -> Any:
    """then(), once first has finished (its result is wanted first)."""
    first.result()
    return then()


def _json_bytes(data: Any) -> bytes:
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode("utf-8")


def table_uris(fs: Hfs, warehouse: str) -> dict[str, str]:
    """The current tables' URIs (and "patches"), from the latest commit record."""
    out = fs.qualify(warehouse)
    found = commits(fs, out)
    if not found:
        raise BuildError(f"{warehouse} has no committed build: run `edgebroker fleet build` first")
    data = found[-1].data
    uris = {name: join(out, rel) for name, rel in dict(data["tables"]).items()}
    uris[PATCHES] = join(out, str(data["patches"]))
    return uris


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
    try:
        opts = options_from(args)
        session, owned = fleet_spark.session(cast("str | None", args.master))
    except CommandError as exc:  # a --boards that is no directory, a Spark that did not start
        print(f"fleet-job: error: {exc}", file=sys.stderr)
        return 2
    try:
        result = build(session, opts)
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

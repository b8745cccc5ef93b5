"""`fleet synth`: realistic synthetic snapshots, fast (numpy + pyarrow, no Python loop per row).

N gateways (boards esp32 45%, rp2040_picow 25%, esp32s3 20%, rp2350_pico2w
10%, with those profiles' limits), each with M retained topics, collected K
times `interval` apart. Topic slots have kinds that behave like a real
gateway's: sensor readings (temperature, humidity, power) that change at
most collections, status words and firmware versions that rarely change,
JSON configuration, binary blobs (not UTF-8, some near esp32's 512-byte
payload limit), alerts with a Message Expiry. Between collections a topic
is sometimes replaced by a new one (deleted + created: the old one shows up
as gone), and a gateway is sometimes unreachable (it misses a collection).
Every collection also has the gateway's $SYS/broker/... statistics rows
(uptime, clients, heap, retained count/bytes, refusals by cause).

Rows are written in files of `per_file` gateways per collection round:
SNAPSHOTS/retained/date=<day>/synth-<k>-<chunk>.parquet. Same seed, same rows.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final, cast

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from edgebroker_tools import profiles
from edgebroker_tools.fleet import outputs, props
from edgebroker_tools.fleet.schema import (
    LIMIT_KEYS,
    RETAINED_DIR,
    SNAPSHOT_SCHEMA,
    TIMESTAMP,
    USER_PROPERTY,
    date_dir,
)

Ints = npt.NDArray[np.int64]
Floats = npt.NDArray[np.float64]
Bools = npt.NDArray[np.bool_]

BOARDS: Final = (
    ("esp32", 0.45),
    ("rp2040_picow", 0.25),
    ("esp32s3", 0.20),
    ("rp2350_pico2w", 0.10),
)
DEFAULT_START: Final = datetime(2025, 6, 1, tzinfo=UTC)
#: Each gateway's collection is up to this much after the round's time.
JITTER_US: Final = 300_000_000
LAST_TIME: Final = datetime.max.replace(tzinfo=UTC)


def check_times(start: datetime, interval: timedelta, snapshots: int) -> None:
    """ValueError unless every collection (start + k x interval, plus the jitter)
    is a time Python and Parquet can hold (up to 9999-12-31T23:59:59Z)."""
    span = (snapshots - 1) * interval.total_seconds() + JITTER_US / 1e6
    if span <= (LAST_TIME - start).total_seconds():
        return
    whole = math.ceil(span)
    room = (LAST_TIME - datetime.min.replace(tzinfo=UTC)).total_seconds()
    latest = (
        f"expected --start <= {LAST_TIME - timedelta(seconds=whole):%Y-%m-%dT%H:%M:%SZ}"
        if whole < room
        else "expected fewer --snapshots or a shorter --interval"
    )
    raise ValueError(
        f"with --snapshots {snapshots} and --interval {interval.total_seconds():g} s the "
        f"last collection would be after {LAST_TIME:%Y-%m-%dT%H:%M:%SZ}; {latest}"
    )


def _join(left: pa.Array[Any], right: pa.Array[Any], sep: str) -> pa.Array[Any]:
    """Element-wise string concatenation with a separator."""
    # the stubs want the separator to be an array like the strings; pyarrow takes a str
    join = cast("Callable[..., pa.Array[Any]]", pc.binary_join_element_wise)
    return join(left, right, sep)


def _numpy(values: pa.Array[Any], fill: int | bool = 0) -> npt.NDArray[Any]:
    """An Arrow array as numpy, nulls replaced by fill."""
    filled = cast("pa.Array[Any]", pc.fill_null(values, pa.scalar(fill)))
    return np.asarray(filled.to_numpy(zero_copy_only=False))


def _lengths(values: pa.Array[Any]) -> npt.NDArray[Any]:
    """Byte length of each string or binary value."""
    lengths = pc.binary_length(cast("pa.StringArray | pa.BinaryArray", values))
    return _numpy(cast("pa.Array[Any]", lengths))


@dataclass(frozen=True)
class Kind:
    """A kind of topic slot."""

    name: str
    change: float  # probability that the value changes between two collections
    qos: int
    content_type: str | None
    payload_format: int | None
    unit: str | None = None


# Kinds 0-2 are numbers (float, float, int); 3-5 and 7 pick from TEXTS; 6 from BLOBS.
KINDS: Final = (
    Kind("temperature", 0.8, 0, None, 1, "C"),
    Kind("humidity", 0.6, 0, None, 1, "%"),
    Kind("power", 0.9, 1, None, 1, "W"),
    Kind("status", 0.05, 1, "text/plain", 1),
    Kind("config", 0.02, 1, "application/json", 1),
    Kind("firmware", 0.01, 1, "text/plain", 1),
    Kind("blob", 0.1, 1, "application/octet-stream", 0),
    Kind("alert", 0.5, 1, "text/plain", 1),
)
#: Slot j has kind SLOT_KINDS[j % len]: mostly sensors, a few of the others.
SLOT_KINDS: Final = (0, 1, 2, 0, 3, 0, 1, 2, 4, 0, 6, 1, 2, 7, 0, 5)
TEXTS: Final = {
    3: ("online", "offline", "degraded", "maintenance"),
    4: tuple(
        json.dumps({"interval": i, "mode": m, "thresholds": list(range(i % 7))})
        for i in (10, 30, 60, 300)
        for m in ("eco", "normal", "boost")
    ),
    5: ("1.4.2", "1.4.3", "1.5.0", "1.5.1", "2.0.0-rc1"),
    7: ("door open", "door closed", "battery low", "leak detected", "tamper"),
}
VERSION: Final = "0.1.0"
BLOB_SIZES: Final = (48, 96, 160, 256, 320, 400, 470, 500)
SYS_STATS: Final = (
    "version",
    "uptime",
    "clients/connected",
    "messages/received",
    "messages/sent",
    "messages/dropped",
    "retained/count",
    "retained/bytes",
    "heap/free",
    "heap/alloc",
    "refusals/retained_full",
    "refusals/retained_too_large",
    "refusals/memory",
)


@dataclass(frozen=True)
class Result:
    rows: int  # retained-topic rows
    sys_rows: int  # $SYS statistics rows
    files: int
    seconds: float


def _limits(board: str, schema: dict[str, Any]) -> dict[str, int | None]:
    try:
        profile = profiles.load_profile(profiles.resolve_board(board))
    except profiles.ProfileError:
        profile = {}
    eff = profiles.effective(profile, schema)
    return {k: eff.get(k) if isinstance(eff.get(k), int) else None for k in LIMIT_KEYS}


def _blobs(rng: np.random.Generator) -> pa.Array[Any]:
    out = []
    for size in BLOB_SIZES:
        raw = bytes(rng.integers(0, 256, size, dtype=np.uint8))
        out.append(b"\xff\xfe" + raw[2:])  # never valid UTF-8
    return pa.array(out, type=pa.binary())


def _kind_table(rng: np.random.Generator) -> dict[str, Any]:
    """Per-kind dictionaries: qos, content type, ... and the text variants."""
    text_values: list[str] = []
    text_base = np.zeros(len(KINDS), dtype=np.int64)
    text_count = np.ones(len(KINDS), dtype=np.int64)
    for k, values in TEXTS.items():
        text_base[k] = len(text_values)
        text_count[k] = len(values)
        text_values.extend(values)
    user_props = [[{"key": "unit", "value": kind.unit}] if kind.unit else [] for kind in KINDS]
    props_bytes = [
        len(
            props.encode(
                payload_format=kind.payload_format,
                content_type=kind.content_type,
                user_properties=[("unit", kind.unit)] if kind.unit else [],
            )
        )
        for kind in KINDS
    ]
    return {
        "qos": pa.array([k.qos for k in KINDS], pa.int32()),
        "content_type": pa.array([k.content_type for k in KINDS], pa.string()),
        "payload_format": pa.array([k.payload_format for k in KINDS], pa.int32()),
        "user_properties": pa.array(user_props, pa.list_(USER_PROPERTY)),
        "props_bytes": pa.array(props_bytes, pa.int32()),
        "props_numpy": np.array(props_bytes, dtype=np.int64),
        "change": np.array([k.change for k in KINDS]),
        "texts": pa.array(text_values, pa.string()),
        "text_base": text_base,
        "text_count": text_count,
        "blobs": _blobs(rng),
    }


class Fleet:
    """The synthetic fleet's state, advanced one collection at a time."""

    def __init__(self, gateways: int, topics: int, seed: int, missing: float) -> None:
        self.n = gateways
        self.m = topics
        self.missing = missing
        self.rng = np.random.default_rng(seed)
        rng = self.rng
        schema = profiles.load_schema()
        names = [b for b, _ in BOARDS]
        weights = np.array([w for _, w in BOARDS])
        self.board_idx = rng.choice(len(names), size=gateways, p=weights / weights.sum())
        self.boards = pa.array(names, pa.string())
        limits = [_limits(b, schema) for b in names]
        self.limits = {k: pa.array([lim[k] for lim in limits], pa.int64()) for k in LIMIT_KEYS}
        self.ids = pa.array([f"gw-{g:06d}" for g in range(gateways)], pa.string())
        prefixes = pa.array([f"site-{g % 97:02d}/gw-{g:06d}" for g in range(gateways)], pa.string())
        slot_kind = np.array([SLOT_KINDS[j % len(SLOT_KINDS)] for j in range(topics)])
        slots = pa.array(
            [f"{KINDS[slot_kind[j]].name}/{j:03d}" for j in range(topics)], pa.string()
        )
        self.kt = _kind_table(rng)
        rows = gateways * topics
        self.g_of_row = np.repeat(np.arange(gateways, dtype=np.int64), topics)
        self.kind = np.tile(slot_kind, gateways).astype(np.int64)
        self.base_topic = _join(
            prefixes.take(self.g_of_row), slots.take(np.tile(np.arange(topics), gateways)), "/"
        )
        # value state per (gateway, slot)
        self.gen = np.zeros(rows, dtype=np.int64)  # topic generation (rotation suffix)
        self.num = np.where(
            self.kind == 0,
            rng.normal(21.0, 3.0, rows),
            np.where(self.kind == 1, rng.uniform(30, 70, rows), rng.uniform(5, 900, rows)),
        )
        self.variant = rng.integers(0, 1 << 30, rows)
        self.expiry = rng.integers(60, 7200, rows)
        self.uptime = rng.integers(3600, 30 * 86400, gateways)
        self.counters = rng.integers(1000, 100000, gateways)
        self.pressure = rng.random(gateways) < 0.04  # gateways that hit limits
        self.first = True

    def advance(self, seconds: int) -> None:
        """The fleet between two collections: values change, topics rotate, boards reboot."""
        rng = self.rng
        rows = self.n * self.m
        change = rng.random(rows) < self.kt["change"][self.kind]
        self.num = np.where(change, self.num + rng.normal(0.0, 1.5, rows), self.num)
        self.num = np.where(change & (self.kind == 2), rng.uniform(5, 900, rows), self.num)
        self.variant = np.where(change, rng.integers(0, 1 << 30, rows), self.variant)
        self.expiry = np.where(change, rng.integers(60, 7200, rows), self.expiry - seconds)
        self.gen += rng.random(rows) < 0.005
        reboot = rng.random(self.n) < 0.05
        self.uptime = np.where(reboot, rng.integers(60, 3600, self.n), self.uptime + seconds)
        self.counters += rng.integers(100, 5000, self.n)

    def collection(self, when: datetime) -> tuple[pa.Table, Bools, Ints]:
        """One collection round: (rows sorted by gateway, gateway present?, gateway of each row)."""
        rng = self.rng
        n, m = self.n, self.m
        present = np.ones(n, dtype=bool) if self.first else rng.random(n) >= self.missing
        self.first = False
        kind = self.kind
        kt = self.kt
        suffix = pa.array([""] + [f"/r{i}" for i in range(1, 64)], pa.string())
        topic = _join(self.base_topic, suffix.take(np.minimum(self.gen, 63)), "")
        floats = pc.cast(pc.round(pa.array(self.num), 1), pa.string())
        ints = pc.cast(pa.array(np.round(self.num).astype(np.int64)), pa.string())
        text_idx = kt["text_base"][kind] + self.variant % kt["text_count"][kind]
        texts = kt["texts"].take(text_idx)
        is_blob = kind == 6
        text = pc.if_else(pa.array(kind <= 1), floats, pc.if_else(pa.array(kind == 2), ints, texts))
        text = pc.if_else(pa.array(is_blob), pa.nulls(len(text), pa.string()), text)
        blobs = kt["blobs"].take(self.variant % len(BLOB_SIZES))
        payload = pc.if_else(pa.array(is_blob), blobs, pc.cast(text, pa.binary()))
        expiry = pa.array(
            np.maximum(self.expiry, 1), pa.int64(), mask=pa.array(kind != 7).to_numpy(False)
        )
        jitter = rng.integers(0, JITTER_US, n)  # microseconds, per gateway
        at_us = int(when.timestamp() * 1_000_000) + jitter
        run_id = f"synth-{when:%Y%m%dT%H%M%SZ}"
        cols: dict[str, pa.Array[Any]] = {
            "gateway_id": self.ids.take(self.g_of_row),
            "board": self.boards.take(self.board_idx[self.g_of_row]),
            "collected_at": pa.array(at_us[self.g_of_row], TIMESTAMP),
            "source": pa.repeat(pa.scalar("synth"), n * m),
            "run_id": pa.repeat(pa.scalar(run_id), n * m),
        }
        for key in LIMIT_KEYS:
            cols[f"limit_{key}"] = self.limits[key].take(self.board_idx[self.g_of_row])
        cols.update(
            topic=topic,
            payload=payload,
            payload_text=text,
            qos=kt["qos"].take(kind),
            content_type=kt["content_type"].take(kind),
            payload_format=kt["payload_format"].take(kind),
            user_properties=kt["user_properties"].take(kind),
            message_expiry=expiry,
            props_bytes=kt["props_bytes"].take(kind),
        )
        state = pa.Table.from_pydict(cols, schema=SNAPSHOT_SCHEMA)
        sizes = _lengths(topic) + _lengths(payload) + np.asarray(kt["props_numpy"])[kind]
        nbytes = np.bincount(self.g_of_row, weights=sizes, minlength=n).astype(np.int64)
        sys_tab, sys_g = self._sys(at_us, nbytes, run_id)
        heads = self._headers(at_us, run_id)
        gid = np.concatenate([np.arange(n, dtype=np.int64), self.g_of_row, sys_g])
        order = np.argsort(gid, kind="stable")
        table = pa.concat_tables([heads, state, sys_tab]).take(order)
        return table, present, gid[order]

    def _headers(self, at_us: Ints, run_id: str) -> pa.Table:
        """One header row per gateway: the collection's facts, null topic."""
        n = self.n
        cols: dict[str, pa.Array[Any]] = {
            "gateway_id": self.ids,
            "board": self.boards.take(self.board_idx),
            "collected_at": pa.array(at_us, TIMESTAMP),
            "source": pa.repeat(pa.scalar("synth"), n),
            "run_id": pa.repeat(pa.scalar(run_id), n),
        }
        for key in LIMIT_KEYS:
            cols[f"limit_{key}"] = self.limits[key].take(self.board_idx)
        for fld in SNAPSHOT_SCHEMA:
            if fld.name not in cols:
                cols[fld.name] = pa.nulls(n, fld.type)
        return pa.Table.from_pydict(cols, schema=SNAPSHOT_SCHEMA)

    def _sys(self, at_us: Ints, nbytes: Ints, run_id: str) -> tuple[pa.Table, Ints]:
        rng = self.rng
        n = self.n
        s = len(SYS_STATS)
        heap_total = np.array([110000, 160000, 7864320, 400000])[self.board_idx]
        heap_free = (heap_total * rng.uniform(0.15, 0.6, n)).astype(np.int64)
        heap_free = np.where(self.pressure, rng.integers(1000, 6000, n), heap_free)
        cap = np.asarray(self.limits["max_retained_messages"].to_pylist())[self.board_idx]
        full = self.pressure & (self.m >= cap)  # retained_full happens at the limit only
        values = np.stack(
            [
                np.zeros(n, dtype=np.int64),  # version: text, below
                self.uptime,
                # clients connected: up to the profile's max_clients
                np.minimum(
                    rng.integers(0, 5, n),
                    np.asarray(self.limits["max_clients"].fill_null(4).to_pylist())[self.board_idx],
                ),
                self.counters,
                self.counters * 2,
                rng.integers(0, 3, n),
                np.full(n, self.m),
                nbytes,
                heap_free,
                heap_total - heap_free,
                np.where(full, rng.integers(1, 50, n), 0),
                np.where(rng.random(n) < 0.02, rng.integers(1, 10, n), 0),
                np.where(rng.random(n) < 0.01, 1, 0),
            ],
            axis=1,
        ).reshape(-1)
        g = np.repeat(np.arange(n), s)
        stat = np.tile(np.arange(s), n)
        keep = (stat < 10) | (values > 0)  # a refusal cause is published once it happened
        g, stat, values = g[keep], stat[keep], values[keep]
        text = pc.cast(pa.array(values), pa.string())
        text = pc.if_else(pa.array(stat == 0), pa.scalar(VERSION), text)
        names = pa.array([f"$SYS/broker/{name}" for name in SYS_STATS], pa.string())
        rows = len(g)
        cols: dict[str, pa.Array[Any]] = {
            "gateway_id": self.ids.take(g),
            "board": self.boards.take(self.board_idx[g]),
            "collected_at": pa.array(at_us[g], TIMESTAMP),
            "source": pa.repeat(pa.scalar("synth"), rows),
            "run_id": pa.repeat(pa.scalar(run_id), rows),
        }
        for key in LIMIT_KEYS:
            cols[f"limit_{key}"] = self.limits[key].take(self.board_idx[g])
        cols.update(
            topic=names.take(stat),
            payload=pc.cast(text, pa.binary()),
            payload_text=text,
            qos=pa.repeat(pa.scalar(0, pa.int32()), rows),
            content_type=pa.nulls(rows, pa.string()),
            payload_format=pa.nulls(rows, pa.int32()),
            user_properties=pa.nulls(rows, pa.list_(USER_PROPERTY)),
            message_expiry=pa.nulls(rows, pa.int64()),
            props_bytes=pa.repeat(pa.scalar(0, pa.int32()), rows),
        )
        return pa.Table.from_pydict(cols, schema=SNAPSHOT_SCHEMA), g


def generate(
    out: Path,
    gateways: int,
    topics: int,
    snapshots: int,
    *,
    seed: int = 1,
    start: datetime = DEFAULT_START,
    interval: timedelta = timedelta(hours=6),
    per_file: int = 1000,
    missing: float = 0.01,
) -> Result:
    """Write the synthetic snapshots under out/retained/; see the module docstring.

    An `out` that cannot be created or written is an OutputError (one line,
    naming --out), and collections past the last representable time a
    ValueError (check_times), both checked before any data is made."""
    t0 = time.monotonic()
    check_times(start, interval, snapshots)
    outputs.make_dir(out, "--out")
    fleet = Fleet(gateways, topics, seed, missing)
    files = rows = sys_rows = 0
    for k in range(snapshots):
        when = start + k * interval
        if k:
            fleet.advance(int(interval.total_seconds()))
        table, present, gid = fleet.collection(when)
        keep = present[gid]
        folder = outputs.make_dir(out / RETAINED_DIR / date_dir(when), "--out")
        bounds = np.searchsorted(gid, np.arange(0, gateways + per_file, per_file))
        for c in range(len(bounds) - 1):
            lo, hi = int(bounds[c]), int(bounds[c + 1])
            if lo >= hi:
                continue
            part = table.slice(lo, hi - lo).filter(pa.array(keep[lo:hi]))
            if part.num_rows == 0:
                continue
            topic = part.column("topic")
            n_sys = int(
                np.count_nonzero(
                    _numpy(cast("pa.Array[Any]", pc.starts_with(topic, "$SYS")), fill=False)
                )
            )
            sys_rows += n_sys
            rows += part.num_rows - topic.null_count - n_sys
            name = folder / f"synth-{k:03d}-{c:05d}.parquet"
            try:
                pq.write_table(part, name, compression="zstd", row_group_size=256 * 1024)
            except OSError as exc:  # pyarrow's errors are OSErrors: read-only, disk full
                raise outputs.OutputError(f"--out {out}: cannot write {name}: {exc}") from None
            files += 1
    return Result(rows, sys_rows, files, time.monotonic() - t0)

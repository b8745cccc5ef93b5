"""`fleet collect`: every inventory gateway's retained state -> snapshot files.

At most `concurrency` gateways are read at once (asyncio, one connection
each). A gateway gets `timeout` seconds per attempt and `retries` more
attempts after a failure (backoff 0.5 s, 1 s, 2 s, ...); one that still
fails is recorded in the collect log and the run goes on. Each success
writes SNAPSHOTS/retained/date=<day>/<gateway>__<time>.parquet (written
under a temporary name, then renamed: a reader never sees half a file).
Store-file entries are copied to SNAPSHOTS/stores/date=<day>/ with a .json
beside them saying whose they are; the build decodes them on its executors.

The collect log (SNAPSHOTS/collect_log.jsonl) gets one JSON line per
gateway and run, as each finishes: run_id, gateway_id, address, board,
status (ok | failed), attempts, error, retained and $SYS message counts,
the file written, collected_at, seconds taken.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import pyarrow.parquet as pq

from edgebroker_tools.fleet import decode, mqtt5, outputs
from edgebroker_tools.fleet.inventory import Gateway
from edgebroker_tools.fleet.progress import Progress
from edgebroker_tools.fleet.schema import COLLECT_LOG, RETAINED_DIR, STORES_DIR, date_dir, stamp


@dataclass(frozen=True)
class Options:
    concurrency: int = 32
    timeout: float = 30.0
    connect_timeout: float = 5.0
    quiet: float = 1.0
    retries: int = 2
    backoff: float = 0.5


@dataclass
class Outcome:
    """One gateway's result in one collect run (a collect log line)."""

    gateway: Gateway
    run_id: str
    ok: bool = False
    attempts: int = 0
    error: str | None = None
    file: str | None = None
    retained: int = 0
    sys: int = 0
    collected_at: str | None = None
    seconds: float = 0.0

    def log_entry(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "gateway_id": self.gateway.id,
            "address": self.gateway.address,
            "board": self.gateway.board,
            "status": "ok" if self.ok else "failed",
            "attempts": self.attempts,
            "error": self.error,
            "retained": self.retained,
            "sys": self.sys,
            "file": self.file,
            "collected_at": self.collected_at,
            "seconds": round(self.seconds, 3),
        }


def _atomic_parquet(table: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("." + path.name + ".tmp")
    pq.write_table(table, tmp, compression="zstd")
    tmp.replace(path)


def _write_snapshot(
    gw: Gateway, got: mqtt5.Gathered, out: Path, run_id: str
) -> tuple[Path, datetime, int, int]:
    when = datetime.fromtimestamp(got.collected_at, UTC)
    meta = decode.CollectionMeta(gw.id, gw.board, when, "mqtt", run_id, dict(gw.limits))
    messages = [
        decode.Message(m.topic, m.payload, m.qos, m.properties, m.properties.message_expiry)
        for m in got.messages.values()
    ]
    path = out / RETAINED_DIR / date_dir(when) / f"{gw.id}__{stamp(when)}.parquet"
    _atomic_parquet(decode.table_for(meta, messages), path)
    n_sys = sum(1 for m in messages if m.topic.startswith("$SYS"))
    return path, when, len(messages) - n_sys, n_sys


def _copy_store(gw: Gateway, out: Path, run_id: str) -> tuple[Path, datetime]:
    src = gw.store
    if src is None:
        raise ValueError("not a store entry")
    when = gw.collected_at or datetime.fromtimestamp(src.stat().st_mtime, UTC)
    meta = decode.CollectionMeta(gw.id, gw.board, when, "store", run_id, dict(gw.limits))
    dest = out / STORES_DIR / date_dir(when) / f"{gw.id}__{stamp(when)}.ebrs"
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name("." + dest.name + ".tmp")
    shutil.copyfile(src, tmp)
    side = dest.with_name(dest.name + ".json")
    side_tmp = side.with_name("." + side.name + ".tmp")
    side_tmp.write_text(meta.to_json() + "\n", encoding="utf-8")
    side_tmp.replace(side)  # metadata first: a store file never lacks it
    tmp.replace(dest)
    return dest, when


async def collect_one(gw: Gateway, out: Path, run_id: str, opts: Options) -> Outcome:
    """Read one gateway with retries; never raises for the gateway's faults."""
    result = Outcome(gw, run_id)
    start = time.monotonic()
    for attempt in range(1, opts.retries + 2):
        result.attempts = attempt
        try:
            if gw.store is not None:
                path, when = await asyncio.to_thread(_copy_store, gw, out, run_id)
            else:
                got = await mqtt5.gather_retained(
                    _require_host(gw.host),
                    gw.port,
                    username=gw.username,
                    password=gw.password,
                    quiet=opts.quiet,
                    timeout=opts.timeout,
                    connect_timeout=opts.connect_timeout,
                )
                path, when, result.retained, result.sys = await asyncio.to_thread(
                    _write_snapshot, gw, got, out, run_id
                )
        except (mqtt5.CollectError, OSError) as exc:
            result.error = str(exc) if isinstance(exc, mqtt5.CollectError) else f"I/O: {exc}"
            if attempt <= opts.retries:
                await asyncio.sleep(opts.backoff * 2 ** (attempt - 1))
            continue
        result.ok = True
        result.error = None
        result.file = str(path.relative_to(out))
        result.collected_at = when.isoformat()
        break
    result.seconds = time.monotonic() - start
    return result


def _require_host(host: str | None) -> str:
    if host is None:
        raise mqtt5.CollectError("no host")
    return host


async def collect_all(
    gateways: list[Gateway], out: Path, opts: Options, progress: Progress, log: TextIO
) -> list[Outcome]:
    """Every gateway, at most opts.concurrency at a time; the log gets a line per gateway."""
    run_id = "collect-" + stamp(datetime.now(UTC))
    sem = asyncio.Semaphore(max(1, opts.concurrency))

    async def one(gw: Gateway) -> Outcome:
        async with sem:
            result = await collect_one(gw, out, run_id, opts)
        log.write(json.dumps(result.log_entry(), sort_keys=True) + "\n")
        log.flush()
        progress.advance(result.ok)
        return result

    return list(await asyncio.gather(*(one(gw) for gw in gateways)))


def run(
    gateways: list[Gateway], out: Path, opts: Options, show_progress: bool = True
) -> list[Outcome]:
    """Collect into out (created); the collect log is appended to.

    An `out` that is not a directory and cannot be made one, or whose
    collect log cannot be opened, is an OutputError (one line, naming
    --out) before any gateway is contacted."""
    outputs.make_dir(out, "--out")
    try:
        log = (out / COLLECT_LOG).open("a", encoding="utf-8")
    except OSError as exc:
        raise outputs.OutputError(
            f"--out {out}: cannot open the collect log {out / COLLECT_LOG}: {exc.strerror or exc}"
        ) from None
    with log, Progress(len(gateways), "collect", enabled=show_progress) as bar:
        return asyncio.run(collect_all(gateways, out, opts, bar, log))

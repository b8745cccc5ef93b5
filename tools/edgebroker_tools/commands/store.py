"""`edgebroker store`: look into a retained-store file (storage_type disc/disc_only)
or a bridge queue file (data/bridge-<name>.ebrq).

    edgebroker store inspect FILE [--json] [--now UNIX_SECONDS]
    edgebroker store check FILE

A file that starts with the bridge queue's magic (EBRQ) is read by
bridge_inspect.queue_report() instead, with lib/edgebridge.py's record
reader: cursor, backlog, dead bytes, torn and corrupt records, QoS 2
messages past PUBREC.

Both read the file with lib/edgestore.py's own reader (store_report.inspect()
over edgestore.replay(), the decisions FlashStore makes when it opens a
store) and never change it.
`inspect` prints the header, every live message (topic, qos, payload size,
lifetime left and when it ends), dead bytes, torn and corrupt records;
--json prints the whole report for machines. `check` prints one line and
exits 0 for a clean store, 1 for a damaged one (torn tail, corrupt record,
bad magic, future version, cut header); unknown record types are reported
but are not damage (a newer writer may add them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Final, cast

from edgebroker_tools.bridge_inspect import (
    bridge_problems,
    format_bridge_report,
    is_bridge_queue,
    read_bridge_report,
)
from edgebroker_tools.commands import CommandError
from edgebroker_tools.commands.store_report import Report, inspect, load_edgestore

if TYPE_CHECKING:
    from edgebroker_tools.commands import Subparsers

EXIT_CLEAN: Final = 0
EXIT_DAMAGED: Final = 1


def read_report(path: Path, now: float | None) -> Report:
    """store_report.inspect() of a store file, or a CommandError."""
    if path.is_dir():
        raise CommandError(
            f"{path} is a directory: give a store file in it (retained.ebrs, bridge-<name>.ebrq)"
        )
    if not path.is_file():
        raise CommandError(f"no such store file: {path}")
    edgestore = load_edgestore()
    try:
        return inspect(edgestore, str(path), wall_now=now)
    except OSError as exc:
        raise CommandError(f"cannot read {path}: {exc.strerror or exc}") from None


def _emit(text: str) -> None:
    """Print text; a reader that went away (`| head`) ends the output quietly.

    The rest of the output is dropped (stdout is pointed at /dev/null, so
    that the interpreter's own flush at exit cannot raise either)."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _unix_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid time {text!r}: expected Unix seconds") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"invalid time {value}: expected Unix seconds > 0")
    return value


def register(subparsers: Subparsers) -> None:
    """Add the `store` subcommand and its actions."""
    parser = subparsers.add_parser(
        "store",
        help="inspect or check a retained-store or bridge queue file",
        description=(
            "Read a flash retained-store file (.ebrs) or a bridge queue file "
            "(.ebrq) without changing it."
        ),
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    inspect = actions.add_parser(
        "inspect",
        help="header, live messages, dead/torn/corrupt bytes",
        description=(
            "Print what a store file holds: header, live messages (topic, qos, "
            "payload size, lifetime left and its end), dead bytes, torn and "
            "corrupt records. Lifetimes are counted with the store's runtime "
            "clock and, where a record has a wall time, the host clock (--now)."
        ),
    )
    inspect.add_argument("file", type=Path, metavar="FILE", help="the store or queue file")
    inspect.add_argument("--json", action="store_true", help="the whole report as JSON")
    inspect.add_argument(
        "--now",
        type=_unix_seconds,
        default=None,
        metavar="UNIX_SECONDS",
        help="wall-clock time for lifetimes left (default: this machine's clock)",
    )
    inspect.set_defaults(handler=handle_inspect)
    check = actions.add_parser(
        "check",
        help="exit 0 if clean, 1 if damaged",
        description=(
            "Exit 0 for a clean store file, 1 for a damaged one (torn tail, corrupt "
            "record, bad magic, future version, cut header). Prints one line."
        ),
    )
    check.add_argument("file", type=Path, metavar="FILE", help="the store or queue file")
    check.set_defaults(handler=handle_check)


def _when(unix: int | None) -> str:
    if not unix:
        return "-"
    return datetime.fromtimestamp(unix, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _magic(hexed: str) -> str:
    raw = bytes.fromhex(hexed)
    text = "".join(chr(b) if 32 <= b < 127 else "." for b in raw)
    return f"{hexed} {text!r}"


def _expiry(entry: Report) -> str:
    left = entry["remaining"]
    if left is None:
        return "never"
    text = f"{left} s left"
    if entry["expires_at"]:
        text += f" (ends {_when(entry['expires_at'])})"
    return text


def problems(report: Report) -> list[str]:
    """What makes a store damaged, one phrase each (empty: clean)."""
    status = cast(str, report["status"])
    header = cast(Report, report["header"])
    out: list[str] = []
    if status in ("bad_magic", "bad_version", "future_version", "partial"):
        names = {
            "bad_magic": f"bad magic {_magic(header['magic'])} (not an edgebroker store)",
            "bad_version": f"bad format version {header['version']}",
            "future_version": f"format version {header['version']} is newer than this reader",
            "partial": "header cut short (creation interrupted)",
        }
        out.append(names[status])
    if report["torn_bytes"]:
        out.append(f"torn tail of {report['torn_bytes']} bytes at offset {report['torn_offset']}")
    if report["corrupt"]:
        offsets = ", ".join(str(o) for o in report["corrupt_offsets"])
        out.append(f"{report['corrupt']} corrupt record(s) at offset {offsets}")
    return out


def format_report(report: Report) -> str:
    """The human-readable form of an inspect report."""
    header = cast(Report, report["header"])
    size = cast(int, report["file_bytes"])
    lines = [
        f"store    {report['path']}",
        f"size     {size} bytes",
        f"header   magic {_magic(header['magic'])}, version {header['version']} ({header['kind']})",
    ]
    damage = problems(report)
    lines.append("status   " + ("ok" if not damage else "DAMAGED: " + "; ".join(damage)))
    if header["kind"] != "ok":
        return "\n".join(lines)
    by_type = cast(dict[str, int], report["by_type"])
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(by_type.items()))
    live = cast(list[Report], report["live"])
    expired = cast(list[Report], report["expired"])
    dead = cast(int, report["dead_bytes"])
    share = f" ({100 * dead / size:.1f}% of the file)" if size else ""
    clock = cast(Report, report["clock"])
    lines += [
        f"records  {report['records']}" + (f" ({kinds})" if kinds else ""),
        f"live     {len(live)} message(s), {report['live_bytes']} bytes",
        f"dead     {dead} bytes{share}",
        f"torn     {report['torn_bytes']} bytes",
        f"corrupt  {report['corrupt']} record(s)",
        f"unknown  {report['skipped_unknown']} record(s) skipped"
        + (f" (types {', '.join(report['unknown_types'])})" if report["unknown_types"] else ""),
        f"clock    runtime {clock['stime']} s, wall {_when(clock['wall'])}",
    ]
    if expired:
        lines.append(f"expired  {len(expired)} ({', '.join(str(e['topic']) for e in expired)})")
    if live:
        lines.append("")
        lines.append(f"{'OFFSET':>8}  QOS  {'PAYLOAD':>7}  {'PROPS':>5}  {'EXPIRY':<40}  TOPIC")
        for e in live:
            lines.append(
                f"{e['offset']:>8}  {e['qos']:>3}  {e['payload_bytes']:>7}  "
                f"{e['props_bytes']:>5}  {_expiry(e):<40}  {e['topic']}"
            )
    return "\n".join(lines)


def handle_inspect(args: argparse.Namespace) -> int:
    """Print the report; exit 0 (a damaged store is reported, not an error)."""
    path = cast(Path, args.file)
    if is_bridge_queue(path):
        queue = read_bridge_report(path)
        _emit(json.dumps(queue, indent=2) if args.json else format_bridge_report(queue))
        return EXIT_CLEAN
    now = cast("float | None", args.now)
    report = read_report(cast(Path, args.file), time.time() if now is None else now)
    if args.json:
        _emit(json.dumps(report, indent=2, ensure_ascii=False))
    else:
        _emit(format_report(report))
    return EXIT_CLEAN


def handle_check(args: argparse.Namespace) -> int:
    """One line; exit 0 when clean, 1 when damaged."""
    path = cast(Path, args.file)
    if is_bridge_queue(path):
        queue = read_bridge_report(path)
        trouble = bridge_problems(queue)
        if trouble:
            _emit(f"{path}: damaged: " + "; ".join(trouble))
            return EXIT_DAMAGED
        _emit(
            f"{path}: ok (bridge queue: {queue['backlog']} message(s) in the backlog, "
            f"{queue['dead_bytes']} dead bytes)"
        )
        return EXIT_CLEAN
    report = read_report(path, None)
    damage = problems(report)
    if damage:
        _emit(f"{path}: damaged: " + "; ".join(damage))
        return EXIT_DAMAGED
    note = ""
    if report["skipped_unknown"]:
        note = f", {report['skipped_unknown']} unknown record(s) skipped"
    live = len(report["live"])
    _emit(f"{path}: ok ({live} live message(s), {report['dead_bytes']} dead bytes{note})")
    return EXIT_CLEAN

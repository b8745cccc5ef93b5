"""A bridge queue file (<data_dir>/bridge-<name>.ebrq) for `edgebroker store inspect`.

    if is_bridge_queue(path):
        report = read_bridge_report(path)
        print(format_bridge_report(report))      # or json.dumps(report)
        damaged = bool(bridge_problems(report))  # `store check`

The report is lib/edgebridge.py's own inspect() (the decisions the bridge
makes when it opens its queue): cursor, backlog messages and bytes, the
first queued messages, dead bytes before the cursor, torn tail, corrupt
records, QoS 2 messages past PUBREC. The file is never changed.
"""

from __future__ import annotations

import importlib
import sys
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any, Final, cast

from edgebroker_tools import runner
from edgebroker_tools.commands import CommandError

MAGIC: Final = b"EBRQ"

Report = dict[str, Any]


def is_bridge_queue(path: Path) -> bool:
    """True when the file starts with the bridge queue's magic."""
    try:
        with path.open("rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def load_edgebridge() -> ModuleType:
    """lib/edgebridge.py (it imports lib/edgebroker.py beside it)."""
    lib = str(runner.lib_path().resolve().parent)
    if lib not in sys.path:
        sys.path.insert(0, lib)
    try:
        return importlib.import_module("edgebridge")
    except ImportError as exc:
        raise CommandError(f"cannot import edgebridge from {lib}: {exc}") from None


def read_bridge_report(path: Path, limit: int = 20) -> Report:
    """edgebridge.inspect() of a queue file, or a CommandError."""
    if not path.is_file():
        raise CommandError(f"no such queue file: {path}")
    try:
        report = load_edgebridge().inspect(str(path), limit)
    except OSError as exc:
        raise CommandError(f"cannot read {path}: {exc.strerror or exc}") from None
    return cast(Report, report)


def bridge_problems(report: Report) -> list[str]:
    """What makes a queue file damaged, one phrase each (empty: clean)."""
    out: list[str] = []
    kind = cast(str, report["kind"])
    if kind != "ok":
        out.append(kind.replace("_", " "))
    if report["torn_bytes"]:
        out.append(f"torn tail of {report['torn_bytes']} bytes at offset {report['torn_offset']}")
    if report["corrupt"]:
        offsets = ", ".join(str(o) for o in report["corrupt_offsets"])
        out.append(f"{report['corrupt']} corrupt record(s) at offset {offsets}")
    return out


def _when(unix: int | None) -> str:
    if not unix:
        return "-"
    return datetime.fromtimestamp(unix, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def format_bridge_report(report: Report) -> str:
    """The human-readable form of a queue report."""
    size = cast(int, report["file_bytes"])
    damage = bridge_problems(report)
    lines = [
        f"queue    {report['path']}",
        f"size     {size} bytes",
        "status   " + ("ok" if not damage else "DAMAGED: " + "; ".join(damage)),
    ]
    if report["kind"] != "ok":
        return "\n".join(lines)
    by_type = cast(dict[str, int], report["by_type"])
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(by_type.items()))
    dead = cast(int, report["dead_bytes"])
    share = f" ({100 * dead / size:.1f}% of the file)" if size else ""
    lines += [
        f"records  {report['records']}" + (f" ({kinds})" if kinds else ""),
        f"cursor   offset {report['cursor']}, next message number {report['next_seq']}",
        f"backlog  {report['backlog']} message(s), {report['backlog_bytes']} bytes",
        f"dead     {dead} bytes{share}",
        f"qos 2    {report['released']} past PUBREC (PUBREL pending)",
    ]
    first = cast(list[Report], report["first"])
    if first:
        lines.append("")
        lines.append(f"{'OFFSET':>8}  {'SEQ':>6}  QOS  {'PAYLOAD':>7}  {'QUEUED AT':<20}  TOPIC")
        for e in first:
            flags = (" retain" if e["retain"] else "") + (" latest" if e["latest"] else "")
            lines.append(
                f"{e['offset']:>8}  {e['seq']:>6}  {e['qos']:>3}  {e['payload_bytes']:>7}  "
                f"{_when(e['wall']):<20}  {e['topic']}{flags}"
            )
        if report["backlog"] > len(first):
            lines.append(f"... {report['backlog'] - len(first)} more")
    return "\n".join(lines)

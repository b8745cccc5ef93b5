"""A bridge queue file (<data_dir>/bridge-<name>.ebrq) for `edgebroker store inspect`.

    if is_bridge_queue(path):
        report = read_bridge_report(path)
        print(format_bridge_report(report))      # or json.dumps(report)
        damaged = bool(bridge_problems(report))  # `store check`

The report reads the file with lib/edgebridge.py's own record reader
(read_record, decode_msg) and makes the decisions the bridge's Queue makes
when it opens the file: cursor, backlog messages and bytes, the first
queued messages, dead bytes before the cursor, torn tail, corrupt records,
QoS 2 messages past PUBREC. The file is never changed. It lives here, not
in lib/, so that the board does not carry it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from struct import unpack_from
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
    try:
        return runner.lib_module("edgebridge")
    except ImportError as exc:
        raise CommandError(
            f"cannot import edgebridge from {runner.lib_path().parent}: {exc}"
        ) from None


def read_bridge_report(path: Path, limit: int = 20) -> Report:
    """queue_report() of a queue file, or a CommandError."""
    if not path.is_file():
        raise CommandError(f"no such queue file: {path}")
    try:
        return queue_report(load_edgebridge(), str(path), limit)
    except OSError as exc:
        raise CommandError(f"cannot read {path}: {exc.strerror or exc}") from None


def queue_report(b: ModuleType, path: str, limit: int = 20) -> Report:
    """A read-only report of a queue file: header, cursor, backlog (messages,
    bytes, the first `limit`), dead bytes before the cursor, torn tail and
    corrupt records, QoS 2 messages past PUBREC. b is lib/edgebridge.py."""
    hdr = len(b.HEADER)
    try:
        size = Path(path).stat().st_size
    except OSError:
        size = -1
    rep: Report = {
        "path": path,
        "file_bytes": max(size, 0),
        "kind": "missing",
        "records": 0,
        "by_type": {},
        "cursor": hdr,
        "next_seq": 0,
        "backlog": 0,
        "backlog_bytes": 0,
        "dead_bytes": 0,
        "torn_offset": None,
        "torn_bytes": 0,
        "corrupt": 0,
        "corrupt_offsets": [],
        "released": 0,
        "sync_again": False,
        "first": [],
    }
    if size < 0:
        return rep
    cur = hdr
    seq = 0
    marked = False
    rel: set[int] = set()
    with Path(path).open("rb") as f:
        head = f.read(hdr)
        if size < hdr:
            rep["kind"] = "partial" if head == b.HEADER[:size] else "bad_magic"
            return rep
        if head[:4] != b.MAGIC:
            rep["kind"] = "bad_magic"
            return rep
        if head[4] != b.VERSION:
            rep["kind"] = "future_version" if head[4] > b.VERSION else "bad_version"
            return rep
        rep["kind"] = "ok"
        by = cast(dict[str, int], rep["by_type"])
        pos = hdr
        while pos < size:
            rt, body, nxt = b.read_record(f, pos, size)
            if rt is None:
                rep["torn_offset"] = pos
                rep["torn_bytes"] = size - pos
                break
            rep["records"] += 1
            if rt == -1:
                rep["corrupt"] += 1
                rep["corrupt_offsets"].append(pos)
                pos = nxt
                continue
            k = chr(rt) if 32 < rt < 127 else f"0x{rt:02x}"
            by[k] = by.get(k, 0) + 1
            if rt == b.T_CURSOR and len(body) == 8:
                cur, s2 = unpack_from(">II", body, 0)
                seq = max(seq, s2)
                marked = True
            elif rt == b.T_MSG and len(body) >= 4:
                seq = max(seq, unpack_from(">I", body, 0)[0] + 1)
            elif rt == b.T_REL and len(body) == 4:
                rel.add(unpack_from(">I", body, 0)[0])
            elif rt == b.T_REL and not body:
                rel.clear()  # a new upstream session: the earlier exchanges are gone
            pos = nxt
        # the backlog: from the cursor on
        n = nb = 0
        first: list[Report] = []
        end = rep["torn_offset"] if rep["torn_offset"] is not None else size
        p2 = cur
        while p2 < end:
            rt, body, nxt = b.read_record(f, p2, end)
            if rt is None:
                break
            if rt == b.T_MSG:
                m = b.decode_msg(body)
                if m is not None:
                    n += 1
                    nb += nxt - p2
                    if len(first) < limit:
                        first.append(
                            {
                                "offset": p2,
                                "seq": m[7],
                                "qos": m[0],
                                "retain": bool(m[1] & b.F_RETAIN),
                                "latest": bool(m[1] & b.F_LATEST),
                                "topic": str(m[4], "utf-8"),
                                "payload_bytes": len(m[6]),
                                "props_bytes": len(m[5]),
                                "wall": m[3] or None,
                                "released": m[7] in rel,
                            }
                        )
            p2 = nxt
    rep.update(
        cursor=cur,
        next_seq=seq,
        backlog=n,
        backlog_bytes=nb,
        dead_bytes=cur - hdr,
        released=len(rel),
        # the broker's rule (Queue._open): a file with the "K" rule's flag
        # and no cursor record is new, its retained sync is done again
        sync_again=bool(head[5] & 1) and not marked,
        first=first,
    )
    return rep


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
    if report["sync_again"]:
        lines.append("sync     not done whole: the broker queues its retained sync again at start")
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

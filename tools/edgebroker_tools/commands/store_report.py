"""Reading a retained-store file on the host: lib/edgestore.py's own replay.

    es = load_edgestore()
    report = inspect(es, "data/retained.ebrs", wall_now=time.time())

inspect() used to live in lib/edgestore.py, a second copy of the open logic
shipped to every board; it is host-only, so it lives here and makes every
decision through replay() (lib/edgeopen.py), the generator FlashStore's open uses
(torn tail, corrupt records, resynchronisation after a bad length, unknown
record types, the runtime clock). `edgebroker store`, the fleet pipeline and
the tests read store files through it.
"""

from __future__ import annotations

import binascii
import importlib
import io
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from edgebroker_tools import runner
from edgebroker_tools.commands import CommandError

Report = dict[str, Any]


def load_edgeopen() -> ModuleType:
    """lib/edgeopen.py, the store's file reader (replay(), scan(),
    header_kind()), from where edgestore came: load_edgestore() first."""
    load_edgestore()
    return importlib.import_module("edgeopen")


def load_edgestore() -> ModuleType:
    """lib/edgestore.py (beside the broker runner.lib_path() finds, else the repo's), imported."""
    try:
        return importlib.import_module("edgestore")
    except ImportError:
        pass
    dirs = [runner.lib_path().resolve().parent, runner.repo_root() / "lib"]
    for lib in dirs:
        if (lib / "edgestore.py").is_file():
            if str(lib) not in sys.path:
                sys.path.insert(0, str(lib))
            try:
                return importlib.import_module("edgestore")
            except ImportError as exc:
                raise CommandError(f"cannot import edgestore from {lib}: {exc}") from None
    raise CommandError(f"cannot find edgestore.py in {' or '.join(str(d) for d in dirs)}")


def _entry(off: int, size: int, fields: tuple[Any, ...], topic: str) -> Report:
    _tb, qos, flags, _rem, _stime, _wall, props, payload = fields
    return {
        "topic": topic,
        "offset": off,
        "record_bytes": size,
        "qos": qos,
        "payload_bytes": len(payload),
        "props_bytes": len(props),
        "own_expiry": bool(flags & 1),
        "remaining_at_write": None,
        "remaining": None,
        "expires_at": None,
    }


def inspect(
    es: ModuleType, path: str, wall_now: float | None = None, data: bytes | None = None
) -> Report:
    """A read-only report of a store file as plain values (JSON ready):
    header, every live message (topic, qos, sizes, expiry), dead, torn and
    corrupt bytes. Decides exactly as FlashStore's open does (its replay()),
    but never changes the file. Raises OSError when the file cannot be read.
    With `data`, the file's bytes are given (a warehouse file read through
    Spark) and `path` only names it."""
    eo = load_edgeopen()
    rep: Report = {
        "path": path,
        "status": "ok",
        "damaged": False,
        "file_bytes": 0,
        "header": {"magic": "", "version": None, "kind": "missing"},
        "records": 0,
        "by_type": {},
        "live": [],
        "expired": [],
        "live_bytes": 0,
        "dead_bytes": 0,
        "torn_bytes": 0,
        "torn_offset": None,
        "corrupt": 0,
        "corrupt_offsets": [],
        "skipped_unknown": 0,
        "unknown_types": [],
        "clock": {"stime": 0, "wall": 0},
    }
    with io.BytesIO(data) if data is not None else Path(path).open("rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        head = f.read(8)
        rep["file_bytes"] = size
        kind = str(eo.header_kind(head, size))
        rep["header"] = {
            "magic": binascii.hexlify(head[:4]).decode("ascii"),
            "version": head[4] if len(head) > 4 else None,
            "kind": kind,
        }
        if kind != "ok":
            rep["status"] = kind
            rep["damaged"] = True
            return rep
        # topic bytes (compared as FlashStore compares them) -> (offset,
        # record bytes, fields, topic); the report sorts by offset
        live: dict[bytes, tuple[int, int, tuple[Any, ...], str]] = {}
        t_end = 0
        wall_end = 0
        names = {es.T_PUT: "PUT", es.T_DEL: "DEL", es.T_CLOCK: "CLOCK"}
        end = size
        for ev_kind, off, n, x in eo.replay(f, size, True):
            if ev_kind == es.EV_TORN:
                end = off
                break
            if ev_kind == es.EV_BAD:
                rep["corrupt"] += 1
                rep["corrupt_offsets"].append(off)
                continue
            rep["records"] += 1
            name = names.get(ev_kind, f"0x{ev_kind:02x}")
            if ev_kind == es.T_CLOCK and x is None:
                name = f"0x{ev_kind:02x}"  # too short for a CLOCK: unknown
            rep["by_type"][name] = rep["by_type"].get(name, 0) + 1
            if ev_kind == es.T_PUT:
                fields, topic = x
                # the store's runtime clock: the largest stime recorded (E4)
                if fields[4] > t_end:
                    t_end = fields[4]
                    wall_end = fields[5] or wall_end
                live.pop(fields[0], None)
                live[fields[0]] = (off, n, fields, topic)
            elif ev_kind == es.T_DEL:
                live.pop(bytes(x), None)
            elif ev_kind == es.T_CLOCK and x is not None:
                stime, wall = x
                if stime >= t_end:
                    t_end = stime
                    wall_end = wall or wall_end
            else:
                rep["skipped_unknown"] += 1
                if name not in rep["unknown_types"]:
                    rep["unknown_types"].append(name)
    if end < size:
        rep["torn_bytes"] = size - end
        rep["torn_offset"] = end
    rep["clock"] = {"stime": t_end, "wall": wall_end}
    live_bytes = 0
    for off, rsize, fields, topic in sorted(live.values(), key=lambda e: e[0]):
        ent = _entry(off, rsize, fields, topic)
        flags, rem, stime, wall = fields[2], fields[3], fields[4], fields[5]
        if flags & es.F_EXP:
            left = stime + rem - t_end
            if wall and wall_now:
                lw = wall + rem - int(wall_now)
                left = min(left, lw)
            ent["remaining_at_write"] = rem
            ent["remaining"] = left
            ent["expires_at"] = wall + rem if wall else None
            if left <= 0:
                rep["expired"].append(ent)
                continue
        live_bytes += rsize
        rep["live"].append(ent)
    rep["live_bytes"] = live_bytes
    rep["dead_bytes"] = end - len(es.HEADER) - live_bytes
    if rep["torn_bytes"]:
        rep["status"] = "torn"
    elif rep["corrupt"]:
        rep["status"] = "corrupt"
    rep["damaged"] = rep["status"] != "ok"
    return rep

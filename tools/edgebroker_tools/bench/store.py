"""The flash retained store (lib/edgestore.py; `make bench-store` runs these
four): write amplification, open time, heap per message, and 20,000 retained
messages to a Receive Maximum 10 subscriber.

The store is driven by small scripts (bench/scripts/store_*.py, package
data) run in their own interpreter process (CPython or the MicroPython unix
port), never imported here: this package stays typed and the numbers come
from the interpreter a board runs. Each script reads its parameters from the
JSON file its one argument names and prints one line "RESULT <json>"; they
use only what both interpreters have.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from edgebroker_tools.bench.common import EDGE, BenchError
from edgebroker_tools.bench.loadgen import preload_retained, run_rm10_subscriber
from edgebroker_tools.bench.report import Target

if TYPE_CHECKING:
    from edgebroker_tools.bench.suite import Bench

RESULT_PREFIX: Final = "RESULT "
STORE_FILE: Final = "retained.ebrs"
STORE_EDGE_EXTRA: Final[dict[str, object]] = {
    "storage_type": "disc_only",
    "max_retained_messages": 0,
    "store_budget_bytes": 64 * 1024 * 1024,
}
# The heap script holds up to `heap_messages` RAM-store messages (~350 B
# each): more than the unix port's 2 MB default heap.
HEAP_SCRIPT_HEAP: Final = "64m"
OPEN_SCRIPT_DISC_HEAP: Final = "16m"


def script_path(name: str) -> Path:
    """A script of bench/scripts (package data) as a file path."""
    return Path(__file__).resolve().parent / "scripts" / name


def run_script(
    argv: Sequence[str], script: str, params: dict[str, Any], workdir: Path, timeout: float
) -> Any:
    """Run bench/scripts/`script` with the interpreter command `argv` and its
    parameters in a JSON file (the unix port's argv takes no long argument);
    returns the JSON of its RESULT line. BenchError (with the output's tail)
    otherwise."""
    name = script.removesuffix(".py")
    try:
        res = subprocess.run(
            [*argv, str(script_path(script)), str(params_file(workdir, name, params))],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=str(workdir),
        )
    except subprocess.TimeoutExpired:
        raise BenchError(f"{name}: no result within {timeout:.0f} s") from None
    except OSError as exc:
        raise BenchError(f"{name}: cannot run {argv[0]}: {exc}") from None
    return result_of(name, res.stdout, res.stderr, res.returncode)


def params_file(workdir: Path, name: str, params: dict[str, Any]) -> Path:
    path = workdir / f"{name}-params.json"
    path.write_text(json.dumps(params), encoding="utf-8")
    return path


def result_of(name: str, stdout: str, stderr: str, code: int | None) -> Any:
    for line in stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            try:
                return json.loads(line[len(RESULT_PREFIX) :])
            except json.JSONDecodeError as exc:
                raise BenchError(f"{name}: bad RESULT line: {exc}") from None
    tail = "\n".join((stdout + stderr).splitlines()[-8:])
    raise BenchError(f"{name}: exit code {code}, no RESULT line\n{tail}")


def as_float(data: Any, *keys: str) -> float:
    """data[k1][k2]... as a float; BenchError if it is not a number."""
    value = data
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            raise BenchError(f"result has no {'.'.join(keys)}")
        value = value[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BenchError(f"result {'.'.join(keys)} is not a number: {value!r}")
    return float(value)


def scenario_store_wear(b: Bench) -> None:
    s = b.sizes
    workdir = Path(tempfile.mkdtemp(prefix="store-wear-", dir=b.tmp))
    name = f"{s.wear_updates:,} updates on {s.wear_topics:,} topics"
    amp = b.report.metric(
        "store wear",
        f"write amplification, record bytes ({name})",
        "x",
        ratio_mode="none",
        targets=[Target("cpython", "<=", 2.0, "x")],
    )
    per_payload = b.report.metric(
        "store wear",
        f"flash bytes per payload byte ({s.wear_payload} B payloads)",
        "x",
        ratio_mode="none",
    )
    per_update = b.report.metric("store wear", "flash bytes per update", "B", "none")
    compactions = b.report.metric("store wear", "compactions", "count", "none")
    params: dict[str, Any] = {
        "lib": str(b.lib_dir()),
        "path": str(workdir / STORE_FILE),
        "topics": s.wear_topics,
        "updates": s.wear_updates,
        "payload": s.wear_payload,
        "group": 16,
    }
    try:
        res = run_script([str(b.tools.python)], "store_wear.py", params, workdir, 600.0)
        written = as_float(res, "fs_written")
        store_written = as_float(res, "store_written")
        records = as_float(res, "record_bytes")
        payload = as_float(res, "payload_bytes")
        updates = as_float(res, "updates")
        ncomp = as_float(res, "compactions")
    except BenchError as exc:
        b.report.problem(f"store-wear: {exc}")
        return
    if written != store_written:
        b.report.problem(
            f"store-wear: FlashStore.bytes_written says {store_written:,.0f} B, "
            f"the file layer counted {written:,.0f} B"
        )
    amp.add("cpython", written / records)
    per_payload.add("cpython", written / payload)
    per_update.add("cpython", written / updates)
    compactions.add("cpython", ncomp)
    print(
        f"  store-wear {updates:,.0f} updates: {written:,.0f} B written "
        f"(records {records:,.0f} B, payloads {payload:,.0f} B), "
        f"{ncomp:.0f} compactions",
        file=sys.stderr,
        flush=True,
    )
    b.report.notes.append(
        f"store wear: lib/edgestore.py FlashStore driven directly under CPython (the "
        f"file format and compaction are the same bytes on a board): "
        f"{s.wear_updates:,} retained updates, round robin over {s.wear_topics:,} "
        f"topics, {s.wear_payload}-byte payloads, commit every 16 updates (the broker's "
        f"group commit with 16 PUBLISHes in flight), default compaction (ratio 0.5, "
        f"4096 B minimum). Amplification = every byte written to the store files "
        f"(appends and compaction's .new; counted by a file layer, checked against "
        f"FlashStore.bytes_written) / the bytes of the PUT records of the updates "
        f"(29 B + topic + payload each); the second row divides by payload bytes."
    )


def scenario_store_open(b: Bench) -> None:
    s = b.sizes
    n = s.open_messages
    workdir = Path(tempfile.mkdtemp(prefix="store-open-", dir=b.tmp))
    rows: list[tuple[str, str, int, str | None, list[Target]]] = [
        (
            f"open {n:,} messages, disc_only",
            "disc_only",
            0,
            None,
            [Target("micropython", "<=", 1.0, "s")],
        ),
        (
            f"open {n:,} + {s.open_dead:,} dead records, disc_only",
            "disc_only",
            s.open_dead,
            None,
            [],
        ),
        (
            f"open {n:,} messages, disc (-X heapsize={OPEN_SCRIPT_DISC_HEAP})",
            "disc",
            0,
            OPEN_SCRIPT_DISC_HEAP,
            [],
        ),
    ]
    if b.tools.micropython is None or "micropython" not in b.brokers:
        for label, _mode, _dead, _heap, targets in rows:
            b.report.metric("store open", label, "s", "none", targets).add("micropython", None)
        return
    files: dict[int, Path] = {}
    for _label, _mode, dead, _heap, _t in rows:
        if dead in files:
            continue
        path = workdir / f"open-{dead}.ebrs"
        params = {"lib": str(b.lib_dir()), "path": str(path), "live": n, "dead": dead}
        try:
            built = run_script([str(b.tools.python)], "store_build.py", params, workdir, 300)
            size = as_float(built, "file_bytes")
        except BenchError as exc:
            b.report.problem(f"store-open: building the store file: {exc}")
            return
        files[dead] = path
        print(
            f"  store-open built {path.name}: {n:,} live + {dead:,} dead, {size:,.0f} B",
            file=sys.stderr,
            flush=True,
        )
    for label, mode, dead, heap, targets in rows:
        metric = b.report.metric("store open", label, "s", "none", targets)
        argv = b.mpy_argv(heap)
        if argv is None:
            metric.add("micropython", None)
            continue
        # a fresh copy each time: close() appends a CLOCK marker
        path = workdir / f"run-{mode}-{dead}.ebrs"
        shutil.copyfile(files[dead], path)
        params = {
            "lib": str(b.lib_dir()),
            "path": str(path),
            "mode": mode,
            "capacity": n,
            "repeat": 3,
        }
        try:
            res = run_script(argv, "store_open.py", params, workdir, 300)
            times = res.get("times") if isinstance(res, dict) else None
            count = as_float(res, "count")
        except BenchError as exc:
            b.report.problem(f"store-open ({label}): {exc}")
            metric.add("micropython", None)
            continue
        if not isinstance(times, list) or not times:
            b.report.problem(f"store-open ({label}): no times in {res!r}")
            continue
        if count != n:
            b.report.problem(f"store-open ({label}): opened {count:.0f} of {n} messages")
        best = min(float(t) for t in times)
        metric.add("micropython", best)
        print(
            f"  store-open {label}: {', '.join(f'{float(t):.3f}' for t in times)} s",
            file=sys.stderr,
            flush=True,
        )
    b.report.notes.append(
        f"store open: `FlashStore(path, mode, capacity={n})` timed inside the MicroPython "
        f"unix port (time.ticks_us, best of 3; the import is not counted), on a file "
        f"written by FlashStore under CPython: {n:,} retained messages (24-32 B "
        f"payloads, one in ten with a Message Expiry, one in four with a Content Type), "
        f"and a second file with {s.open_dead:,} superseded records on top. "
        f"disc_only runs in the port's default heap; disc keeps every message in RAM "
        f"and gets -X heapsize={OPEN_SCRIPT_DISC_HEAP}."
    )


def scenario_store_heap(b: Bench) -> None:
    s = b.sizes
    count = s.heap_messages
    metrics = {
        mode: b.report.metric(
            "store heap",
            f"heap per retained message, {mode} ({count // 2:,} to {count:,} x 64 B)",
            "B/msg",
            "none",
            [Target("micropython", "<=", 4.0, "B/msg")] if mode == "disc_only" else [],
        )
        for mode in ("ram", "disc", "disc_only")
    }
    fixed = b.report.metric(
        "store heap", "fixed part, disc_only (store object, buffers)", "B", "none"
    )
    argv = b.mpy_argv(HEAP_SCRIPT_HEAP)
    if argv is None or "micropython" not in b.brokers:
        for metric in metrics.values():
            metric.add("micropython", None)
        fixed.add("micropython", None)
        return
    workdir = Path(tempfile.mkdtemp(prefix="store-heap-", dir=b.tmp))
    params = {"lib": str(b.lib_dir()), "tmp": str(workdir), "count": count}
    try:
        res = run_script(argv, "store_heap.py", params, workdir, 600)
        values = {mode: as_float(res, mode, "per_message") for mode in metrics}
        counts = {mode: as_float(res, mode, "count") for mode in metrics}
        fixed_only = as_float(res, "disc_only", "fixed")
    except BenchError as exc:
        b.report.problem(f"store-heap: {exc}")
        return
    for mode, metric in metrics.items():
        if counts[mode] != count:
            b.report.problem(f"store-heap {mode}: {counts[mode]:.0f} of {count} stored")
        metric.add("micropython", values[mode])
    fixed.add("micropython", fixed_only)
    print(
        "  store-heap " + "  ".join(f"{mode} {value:.1f} B/msg" for mode, value in values.items()),
        file=sys.stderr,
        flush=True,
    )
    b.report.notes.append(
        f"store heap: gc.mem_alloc() after gc.collect() inside the MicroPython unix port "
        f"(64-bit) before the store is made and after it is full, for {count // 2:,} and "
        f"{count:,} retained messages: the slope is the cost of a message, the rest at "
        f"{count:,} the store's fixed part; each message made as the broker makes one (its "
        f"topic's bytes, no str, its own 64-byte payload), capacity = the message count "
        f"(max_retained_messages); ram = edgeram.RamStore, disc/disc_only = "
        f"edgestore.FlashStore. Run with -X heapsize={HEAP_SCRIPT_HEAP} so that ram and "
        f"disc fit."
    )


def scenario_retained_rm10(b: Bench) -> None:
    s = b.sizes
    n = s.rm10_count
    window = 10
    got = b.report.metric(
        "retained rm10",
        f"delivered of {n:,} (Receive Maximum {window})",
        "count",
        "none",
        [Target(k, ">=", float(n)) for k in EDGE],
        note="edgebroker storage_type disc_only (MicroPython's 2 MB default heap holds "
        "about 5,400 RAM-store messages, not 20,000); mosquitto with its defaults",
    )
    took = b.report.metric("retained rm10", "time to the last one delivered", "s", "none")
    for kind in b.brokers:
        extra = STORE_EDGE_EXTRA if kind != "mosquitto" else None
        broker = b.start(kind, f"{kind}-rm10", extra)
        if broker is None:
            got.add(kind, None)
            continue
        try:
            rate = preload_retained(broker.port, n, s.retained_payload, "bench/rm/", kind)
            print(
                f"  rm10 pre-load {kind:<11} {n:,} in {n / rate:.1f} s",
                file=sys.stderr,
                flush=True,
            )
            res = run_rm10_subscriber(broker.port, n, b"bench/rm/", window, 3.0, 120.0, kind)
        except (BenchError, OSError) as exc:
            b.report.problem(f"retained-rm10 on {broker.label}: {exc}")
            got.add(kind, None)
            continue
        finally:
            b.stop(broker)
        got.add(kind, res["delivered"])
        took.add(kind, res["time"])
        if res["dups"] or res["not_retained"]:
            b.report.problem(
                f"retained-rm10 on {broker.label}: {res['dups']:.0f} duplicates, "
                f"{res['not_retained']:.0f} without RETAIN"
            )
        print(
            f"  rm10   {kind:<11} {res['delivered']:,.0f}/{n:,} in {res['time']:.2f} s",
            file=sys.stderr,
            flush=True,
        )
    b.report.notes.append(
        f"retained rm10: {n:,} retained QoS 1 messages on distinct topics (pre-loaded "
        f"16 in flight), then a 5.0 client with Receive Maximum {window} subscribes '#' "
        f"at QoS 1 and acknowledges each PUBLISH as it arrives; counted until nothing "
        f"new comes for 3 s. mosquitto runs with its defaults (max_queued_messages 1000, "
        f"max_inflight_messages 20)."
    )

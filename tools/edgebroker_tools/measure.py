"""Measure what the broker costs in heap, under the MicroPython unix port.

    python -m edgebroker_tools.measure [--out boards/memory_costs.json] [--quick]
    make measure-memory

Writes boards/memory_costs.json, which `edgebroker config check` reads for
its worst-case heap sum (edgebroker_tools.profiles.heap_breakdown).

How: a small MicroPython harness (HARNESS below) imports the .mpy build of
lib/edgebroker.py (runner.compile_mpy), starts it with the public API
(edgebroker.start(), then serve_async(), as a board runs it: the board
build has no poll server) and subscribes locally
(broker.subscribe) to the topic `probe/mem`: a PUBLISH there runs
gc.collect() and prints gc.mem_alloc() on stdout. This process drives it with real
sockets (edgebroker_tools.mqttclient): it opens connections, subscribes,
queues and retains messages, waits until the broker has acknowledged all of
it (CONNACK, SUBACK, PUBACK, every PUBLISH received), then sends the probe
on a control connection. Each cost is a slope between two such calm points
(e.g. 8 and 32 idle connections), so one-off allocations (the first dict
of a kind, the store's index) do not count as per-item costs; they land in
the fixed figures.

Import costs come from separate interpreter runs: the .mpy from the
filesystem (bytecode copied into the heap, as on a board without ROMFS),
the .py source (the compiler's peak: the smallest -X heapsize that still
imports it, found by bisection), and a ROMFS image (built with
`mpremote romfs build`, mounted with vfs.VfsRom; the image itself is
subtracted, as on a board it lives in flash).

The unix port is 64-bit: pointers are 8 bytes and a GC block is 32 bytes
(16 on the 32-bit boards). The figures are recorded as measured, with
`pointer_bytes: 8`; the checker uses them unscaled (conservative: object
overheads on a 32-bit board are smaller), so that `edgebroker emulate`,
which runs this same 64-bit interpreter with the board's heap, is a test
of the check.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from edgebroker_tools import profiles, runner
from edgebroker_tools.mqttclient import Client, MqttError

DEFAULT_OUT: Final = Path("boards") / "memory_costs.json"
MEASURE_HEAP: Final = "32m"

#: The shapes the costs are measured at (recorded in the output).
CLIENT_ID: Final = "gw-sensor-{:06d}"  # 16 bytes
#: Subscription i: 4 levels, 33 bytes, the first three shared with i ^ 1 only.
#: The most a 4-level subscription costs in the topic tree: a branch of one
#: filter is a tail, a shared level a dict, and a pair shares the dicts the
#: least (lib/edgebroker.py, TopicTree).
FILTER: Final = "s{1:04d}/device-{1:04d}/sensor{1:04d}/v{0:04d}"
QUEUED_TOPIC: Final = "q/sensor-0001/temperature"  # 25 bytes
RETAINED_TOPIC: Final = "r/sensor-{:05d}/state"  # 20 bytes
PAYLOAD: Final = 64

#: The MicroPython harness. PARAMS is replaced by a JSON object literal. It
#: starts the broker through the public API, edgebroker.start() with a full
#: profile (the flash store opened as storage_type says), and adds the
#: measuring points as a local subscription: a PUBLISH to `probe/mem` calls
#: back here, from the broker's loop, which collects and prints the heap.
#: Nothing of the broker is replaced or patched.
HARNESS: Final = r"""
import gc
import sys
import json
import micropython
P = json.loads(PARAMS)


def point(label):
    gc.collect()
    gc.collect()
    micropython.qstr_info()  # "qstr pool: ..., n_total_bytes=N": the interned names
    print("point %s %d %d" % (label, gc.mem_alloc(), gc.mem_free()))
    flush()


def flush():
    try:
        sys.stdout.flush()
    except AttributeError:
        pass


point("boot")
sys.path.insert(0, P["mpy_dir"])
import edgebroker
point("imported")
if P["store"] != "ram":
    import edgestore
# the RAM store's module, in every run: a baseline (nostore) runs the RAM
# store, and a figure taken against it must hold the same code
import edgeram
point("imported_store")
f = open(P["profile_path"])
profile = json.load(f)
f.close()
broker = edgebroker.start(profile, "127.0.0.1", P["port"], P["data_dir"])
profile = None
f = None
point("started")


def probe(topic, payload, retained, properties):
    # a measuring point, not a message: it is not stored or forwarded
    label = payload.decode()
    if label == "sys":
        broker.engine.publish_sys()
    point(label)


broker.subscribe("probe/mem", probe)
print("edgebroker listening on 127.0.0.1:%d" % P["port"])
flush()
import asyncio
try:
    asyncio.run(broker.serve_async())
except KeyboardInterrupt:
    pass
broker.shutdown()
"""

#: Imports one module list from a directory and prints the cost of each.
#: Modules that import edgebroker or edgestore (measured after them, their
#: min heap beside them), in the order a profile loads them.
DEPENDENT_MODULES: Final = ("edgeopen", "edgeram", "edgeauth", "edgebridge")

IMPORT_SCRIPT: Final = r"""
import gc
import sys
gc.collect()
a = gc.mem_alloc()
sys.path.insert(0, DIR)
for name in NAMES:
    __import__(name)
    gc.collect()
    b = gc.mem_alloc()
    print("import %s %d" % (name, b - a))
    a = b
"""

#: The same from a ROMFS image mounted with vfs.VfsRom: the image (read into
#: the heap first, as flash stands in for it on a board) is not counted.
ROMFS_SCRIPT: Final = r"""
import gc
import sys
import vfs
f = open(IMAGE, "rb")
img = f.read()
f.close()
vfs.mount(vfs.VfsRom(img), "/rom")
sys.path.insert(0, "/rom")
gc.collect()
a = gc.mem_alloc()
for name in NAMES:
    __import__(name)
    gc.collect()
    b = gc.mem_alloc()
    print("import %s %d" % (name, b - a))
    a = b
"""

#: The profile the measuring broker runs with: bounds far above what is measured.
MEASURE_PROFILE: Final[dict[str, Any]] = {
    "board": "measure",
    "max_clients": 500,
    "max_subscriptions": 1000,
    "max_inflight": 1000,
    "max_queued": 1000,
    "max_sessions": 1000,
    "max_packet_size": 16384,
    "max_outbuf": 65536,
    "max_payload_size": 65536,
    "io_chunk": 4096,
    "heap_reserve": 0,
    "store_budget_bytes": 0,
    "sys_interval": 0,
    "backlog": 64,
    "log_level": "error",
}


#: A growth of the qstr pools (bytes) within one figure's run that
#: `make measure-memory` points out: a new pool, not a few names.
QSTR_POOL_NOTE: Final = 2048


class MeasureError(Exception):
    """The measurement could not be made (reported as one line)."""


@dataclass(frozen=True)
class QstrInfo:
    """`micropython.qstr_info()`'s figures at one point: the names interned
    at run time, their characters, and the heap their pools and character
    chunks take."""

    names: int
    chars: int
    total: int

    @classmethod
    def parse(cls, line: str) -> QstrInfo:
        f = dict(kv.split("=", 1) for kv in line.split(":", 1)[1].replace(" ", "").split(","))
        return cls(int(f["n_qstr"]), int(f["n_str_data_bytes"]), int(f["n_total_bytes"]))

    def names_cost(self, before: QstrInfo, pointer: int) -> int:
        """The heap the names interned since `before` take themselves: their
        characters (with the terminating zero) and one pool entry each
        (pointer, 2-byte hash, 1-byte length). Not the pools: those grow by
        doubling, and where a growth falls (which figure's run) depends on
        every name interned before, not on the one that tipped it."""
        n = self.names - before.names
        return self.chars - before.chars + n * (pointer + 3)


@dataclass
class Harness:
    """One measuring broker process and its stdout points."""

    proc: subprocess.Popen[str]
    port: int
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    points: dict[str, int] = field(default_factory=dict)
    #: the interpreter's qstr pools (interned names) at each point
    qstr: dict[str, QstrInfo] = field(default_factory=dict)
    qstr_last: QstrInfo = field(default_factory=lambda: QstrInfo(0, 0, 0))

    def start_reader(self) -> None:
        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.put(line.rstrip("\n"))
            self.lines.put("")  # EOF marker

        threading.Thread(target=read, daemon=True).start()

    def wait_line(self, prefix: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self.lines.get(timeout=max(left, 0.01))
            except queue.Empty:
                raise MeasureError(f"harness: no line {prefix!r} within {timeout} s") from None
            if line == "" and self.proc.poll() is not None:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                raise MeasureError(f"harness exited ({self.proc.returncode}): {err.strip()}")
            if line.startswith("qstr pool:"):
                self.qstr_last = QstrInfo.parse(line)
            if line.startswith("point "):
                _, label, alloc, _free = line.split()
                self.points[label] = int(alloc)
                self.qstr[label] = self.qstr_last
            if line.startswith(prefix):
                return line

    def alloc(self, label: str) -> int:
        if label not in self.points:
            self.wait_line(f"point {label} ")
        return self.points[label]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(2)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@contextlib.contextmanager
def harness(
    mpy_dir: Path,
    store: str = "ram",
    profile: dict[str, Any] | None = None,
    nostore: bool = False,
) -> Iterator[Harness]:
    """A measuring broker under micropython -X heapsize=MEASURE_HEAP.

    The profile is the schema's defaults with MEASURE_PROFILE and `profile`
    over them and storage_type `store`; nostore imports the store module for
    `store` but runs the RAM store (a baseline with the same code)."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="edgebroker-measure-") as tmpname:
        tmp = Path(tmpname)
        full = profiles.defaults(profiles.load_schema())
        full.update(MEASURE_PROFILE)
        full.update(profile or {})
        full["storage_type"] = "ram" if nostore else store
        profile_path = tmp / "profile.json"
        profile_path.write_text(json.dumps(full), encoding="utf-8")
        params = {
            "mpy_dir": str(mpy_dir),
            "store": store,
            "data_dir": str(tmp),
            "profile_path": str(profile_path),
            "port": port,
        }
        code = HARNESS.replace("PARAMS", repr(json.dumps(params)))
        argv = [
            str(runner.micropython_executable()),
            "-X",
            f"heapsize={MEASURE_HEAP}",
            "-c",
            code,
        ]
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        h = Harness(proc, port)
        h.start_reader()
        try:
            h.wait_line("edgebroker listening on")
            yield h
        finally:
            h.stop()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Control:
    """The control connection: sends `probe/mem` PUBLISHes and reads the point."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.client = Client(h.port, "probe-control-01")
        if self.client.connect() != 0:
            raise MeasureError("the measuring broker refused the control connection")

    def point(self, label: str, settle: float = 0.0) -> int:
        if settle:
            time.sleep(settle)
        self.client.publish("probe/mem", label.encode())
        return self.h.alloc(label)


def connect(port: int, cid: str, clean: bool = True) -> Client:
    c = Client(port, cid)
    rc = c.connect(clean=clean)
    if rc != 0:
        raise MeasureError(f"{cid}: CONNACK {rc}")
    return c


def slope(a: int, b: int, n: int) -> int:
    """Bytes per item between two points n items apart, rounded up."""
    return -(-(b - a) // n)


# ---------------------------------------------------------------- scenarios
def measure_serving(mpy_dir: Path, quick: bool) -> dict[str, Any]:
    """Idle broker, $SYS set, connections, subscriptions, sessions, queued and inflight."""
    n1, n2 = (4, 12) if quick else (8, 32)
    s1, s2 = (16, 48) if quick else (32, 128)
    m1, m2 = (16, 64) if quick else (32, 160)
    out: dict[str, Any] = {}
    with harness(mpy_dir) as h:
        ctl = Control(h)
        port = h.port
        out["broker_started"] = h.alloc("started") - h.alloc("imported_store")
        base = ctl.point("base")
        # $SYS messages are made on demand (lib: sys_msgs), so none stand in
        # the heap: the figure is 0 up to measuring noise
        out["sys_retained"] = max(0, ctl.point("sys") - base)

        # idle connections (3.1.1, clean session, 16-byte client id)
        clients = [connect(port, CLIENT_ID.format(i)) for i in range(n1)]
        a = ctl.point("conn_a")
        clients += [connect(port, CLIENT_ID.format(i)) for i in range(n1, n2)]
        b = ctl.point("conn_b")
        out["per_connection"] = slope(a, b, n2 - n1)
        for c in clients:
            c.disconnect()
        out["leak_after_disconnect"] = ctl.point("conn_gone", settle=0.5) - base

        # subscriptions of one client: 4-level filters, pairs sharing three
        sub = connect(port, "subscriber-00001")
        filters = [FILTER.format(i, i // 2) for i in range(s2)]
        for i in range(0, s1, 16):
            sub.subscribe([(f, 1) for f in filters[i : i + 16]])
        a = ctl.point("sub_a")
        for i in range(s1, s2, 16):
            sub.subscribe([(f, 1) for f in filters[i : i + 16]])
        b = ctl.point("sub_b")
        out["per_subscription"] = slope(a, b, s2 - s1)
        sub.disconnect()

        # offline persistent sessions (no subscriptions)
        for i in range(n1):
            connect(port, f"offline-{i:07d}", clean=False).disconnect()
        a = ctl.point("off_a", settle=0.3)
        for i in range(n1, n2):
            connect(port, f"offline-{i:07d}", clean=False).disconnect()
        b = ctl.point("off_b", settle=0.3)
        out["per_offline_session"] = slope(a, b, n2 - n1)

        pub = connect(port, "publisher-000001")
        # queued QoS 1 messages of an offline session, two payload sizes
        for size, key in ((PAYLOAD, "per_queued_message"), (256, "per_queued_message_256")):
            q = connect(port, f"queue-{size:010d}", clean=False)
            q.subscribe([(f"q{size}/#", 1)])
            q.disconnect()
            topic = f"q{size}/" + QUEUED_TOPIC[2:]
            payload = b"x" * size
            pub.publish_many((topic, payload) for _ in range(m1))
            a = ctl.point(f"{key}_a", settle=0.2)
            pub.publish_many((topic, payload) for _ in range(m2 - m1))
            b = ctl.point(f"{key}_b")
            out[key] = slope(a, b, m2 - m1)

        # inflight QoS 1 messages: a connected subscriber that never acknowledges
        inf = connect(port, "inflight-000001")
        inf.subscribe([("i/#", 1)])
        topic = "i/" + QUEUED_TOPIC[2:]
        payload = b"x" * PAYLOAD
        pub.publish_many((topic, payload) for _ in range(m1))
        for _ in range(m1):
            inf.receive(ack=False)
        a = ctl.point("inf_a")
        pub.publish_many((topic, payload) for _ in range(m2 - m1))
        for _ in range(m2 - m1):
            inf.receive(ack=False)
        b = ctl.point("inf_b")
        out["per_inflight_message"] = slope(a, b, m2 - m1)
        inf.close()
        pub.disconnect()
        ctl.client.disconnect()
    return out


def measure_retained(mpy_dir: Path, store: str, capacity: int) -> tuple[int, QstrInfo]:
    """Heap of a broker holding `capacity` retained messages in a store of that
    capacity, and the bytes of its qstr pools then."""
    with harness(mpy_dir, store=store, profile={"max_retained_messages": capacity}) as h:
        ctl = Control(h)
        pub = connect(h.port, "retainer-0000001")
        payload = b"r" * PAYLOAD
        pub.publish_many(
            ((RETAINED_TOPIC.format(i), payload) for i in range(capacity)), retain=True
        )
        full = ctl.point("full", settle=0.2)
        pub.disconnect()
        ctl.client.disconnect()
        return full, h.qstr.get("full", QstrInfo(0, 0, 0))


def import_costs(directory: Path, names: Sequence[str], heap: str = "8m") -> dict[str, int]:
    code = IMPORT_SCRIPT.replace("DIR", repr(str(directory))).replace("NAMES", repr(list(names)))
    return _run_import(code, heap)


def _run_import(code: str, heap: str) -> dict[str, int]:
    argv = [str(runner.micropython_executable()), "-X", f"heapsize={heap}", "-c", code]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if r.returncode != 0:
        raise MeasureError(f"import run failed: {r.stderr.strip()[-500:]}")
    out: dict[str, int] = {}
    for line in r.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "import":
            out[parts[1]] = int(parts[2])
    return out


def imports_ok(directory: Path, names: Sequence[str], heap: int) -> bool:
    code = IMPORT_SCRIPT.replace("DIR", repr(str(directory))).replace("NAMES", repr(list(names)))
    argv = [str(runner.micropython_executable()), "-X", f"heapsize={heap}", "-c", code]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    return r.returncode == 0


def min_heap(directory: Path, names: Sequence[str], hi: int = 1 << 20) -> int:
    """The smallest -X heapsize (1 KB steps) at which the modules import."""
    lo = 4096
    if not imports_ok(directory, names, hi):
        raise MeasureError(f"cannot import {names} from {directory} even with {hi} bytes")
    while hi - lo > 1024:
        mid = (lo + hi) // 2
        if imports_ok(directory, names, mid):
            hi = mid
        else:
            lo = mid
    return hi


def _min_heaps(directory: Path, names: Sequence[str]) -> dict[str, int]:
    # each module alone; those that import edgebroker are done by measure()
    return {n: min_heap(directory, [n]) for n in names if n not in DEPENDENT_MODULES}


#: The firmware's heap: gateway.py (resident), then gwboot.py (the boot steps)
#: imported, dropped as gateway.main() drops it, and what stays of it (its
#: names stay in the qstr pool) counted with the gateway.
FIRMWARE_SCRIPT: Final = r"""
import gc
import sys
sys.path.insert(0, DIR)
import network
gc.collect()
a = gc.mem_alloc()
import gateway
gc.collect()
b = gc.mem_alloc()
import gwboot
gc.collect()
print("import gwboot %d" % (gc.mem_alloc() - b))
del gwboot
sys.modules.pop("gwboot")
gc.collect()
print("import gateway %d" % (gc.mem_alloc() - a))
"""


def firmware_cost(firmware: Path, tmp: Path) -> dict[str, int]:
    """Heap kept by the firmware's modules (.mpy) while the broker serves:
    gateway.py and what its dropped boot steps (gwboot.py) leave; gwboot's own
    figure is its peak while booting. `network` stubbed (the unix port has
    none; the modules only name it at import)."""
    fw_dir = tmp / "firmware"
    fw_dir.mkdir(exist_ok=True)
    for name in ("gateway", "gwboot"):
        runner.compile_mpy(firmware / f"{name}.py", fw_dir, board=True)
    (fw_dir / "network.py").write_text("# stand-in: the unix port has no network module\n")
    return _run_import(FIRMWARE_SCRIPT.replace("DIR", repr(str(fw_dir))), "8m")


def romfs_costs(mpy_files: Sequence[Path], names: Sequence[str], tmp: Path) -> dict[str, int]:
    src = tmp / "romfs-src"
    src.mkdir(exist_ok=True)
    for f in mpy_files:
        shutil.copy(f, src / f.name)
    image = tmp / "image.romfs"
    mpremote = Path(sys.executable).parent / "mpremote"
    exe = str(mpremote) if mpremote.exists() else "mpremote"
    r = subprocess.run(
        [exe, "romfs", "--no-mpy", "-o", str(image), "build", str(src)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if r.returncode != 0 or not image.exists():
        raise MeasureError(f"mpremote romfs build failed: {(r.stderr or r.stdout).strip()}")
    code = ROMFS_SCRIPT.replace("IMAGE", repr(str(image))).replace("NAMES", repr(list(names)))
    costs = _run_import(code, "8m")
    costs["image_bytes"] = image.stat().st_size
    return costs


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def interpreter_facts() -> tuple[str, int]:
    """(version text, pointer size in bytes) of the measuring interpreter."""
    r = subprocess.run(
        [
            str(runner.micropython_executable()),
            "-c",
            "import sys; print(sys.version); print(sys.maxsize > 1 << 32)",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    lines = r.stdout.split("\n")
    if r.returncode != 0 or len(lines) < 2:
        raise MeasureError(f"cannot run micropython: {r.stderr.strip()}")
    return "MicroPython unix port " + lines[0].strip(), 8 if lines[1].strip() == "True" else 4


# ------------------------------------------------------------------- main
def measure(quick: bool = False, log: bool = True) -> dict[str, Any]:
    """Every figure of boards/memory_costs.json (see the module docstring)."""

    def say(text: str) -> None:
        if log:
            print(f"measure: {text}", file=sys.stderr, flush=True)

    root = runner.repo_root()
    lib = root / "lib"
    with tempfile.TemporaryDirectory(prefix="edgebroker-measure-") as tmpname:
        tmp = Path(tmpname)
        mpy_dir = tmp / "mpy"
        sources = [lib / "edgebroker.py"]
        # the profile check: imported at boot, after edgebroker (imports nothing of it)
        sources.append(lib / "edgeconf.py")
        have_store = (lib / "edgestore.py").is_file()
        if have_store:
            sources.append(lib / "edgestore.py")
        # these import edgebroker (edgeopen: edgestore): measured after it
        for dependent in DEPENDENT_MODULES:
            if (lib / f"{dependent}.py").is_file():
                sources.append(lib / f"{dependent}.py")
        digests = {s.name: sha256(s) for s in sources}  # what is measured (lib/ may change)
        mpys = [runner.compile_mpy(s, mpy_dir, board=True) for s in sources]  # the board build
        names = [s.stem for s in sources]

        say("import costs (.mpy, .py, ROMFS)")
        costs: dict[str, Any] = {
            "import_mpy": import_costs(mpy_dir, names),
            "import_py": import_costs(lib, names),
            "import_romfs": romfs_costs(mpys, names, tmp),
            "min_heap_import_mpy": _min_heaps(mpy_dir, names),
            "min_heap_import_py": _min_heaps(lib, names),
            "mpy_file_bytes": {p.stem: p.stat().st_size for p in mpys},
        }
        for dependent in DEPENDENT_MODULES:
            if dependent not in names:
                continue
            # its min heap: imported after the modules before it, less what
            # those keep (config check adds them back: start_heap)
            upto = names[: names.index(dependent) + 1]
            for kind, src in (("min_heap_import_mpy", mpy_dir), ("min_heap_import_py", lib)):
                before = costs[kind.replace("min_heap_", "")]
                costs[kind][dependent] = min_heap(src, upto) - sum(
                    before[n] for n in upto if n != dependent
                )

        firmware = root / "firmware"
        if (firmware / "gateway.py").is_file():
            costs["import_mpy_firmware"] = firmware_cost(firmware, tmp)

        say("serving broker: connections, subscriptions, sessions, queues")
        serving = measure_serving(mpy_dir, quick)
        io_chunk = int(MEASURE_PROFILE["io_chunk"])
        costs["broker_idle"] = serving["broker_started"] - io_chunk
        for key in (
            "sys_retained",
            "per_connection",
            "per_subscription",
            "per_offline_session",
            "per_queued_message",
            "per_queued_message_256",
            "per_inflight_message",
            "leak_after_disconnect",
        ):
            costs[key] = serving[key]
        topic = len(QUEUED_TOPIC)
        costs["message_overhead"] = max(
            serving["per_queued_message"] - PAYLOAD - topic,
            serving["per_inflight_message"] - PAYLOAD - topic,
        )

        retained: dict[str, dict[str, int]] = {}
        pointer = interpreter_facts()[1]
        c1, c2 = (128, 384) if quick else (256, 1024)
        modes = ["ram", "disc", "disc_only"] if have_store else ["ram"]
        for mode in modes:
            # disc_only keeps an array('I') word a message: measured across a
            # wider span and rounded to the nearest byte, since the few
            # hundred bytes the collector leaves either way would turn 4
            # into 5 when rounded up over 768 messages
            hi = 4 * c2 if mode == "disc_only" else c2
            say(f"retained store {mode}: {c1} and {hi} messages")
            a, qa = measure_retained(mpy_dir, mode, c1)
            b, _ = measure_retained(mpy_dir, mode, hi)
            per = round((b - a) / (hi - c1)) if mode == "disc_only" else slope(a, b, hi - c1)
            base, qbase = _baseline(mpy_dir, mode)
            # The store's open interns names (edgeopen's, kept for good): it
            # is charged those names, not the pool growth they may tip
            # (docs/boards.md, "a qstr pool can move 7 KB")
            pools = qa.total - qbase.total
            name_bytes = qa.names_cost(qbase, pointer)
            fixed = max(a - c1 * per - base - pools + name_bytes, 0)
            entry = {"per_message": per, "fixed": fixed}
            if pools > QSTR_POOL_NOTE:
                say(
                    f"note: the qstr pools grew by {pools} B while the {mode} store opened; "
                    f"its fixed figure ({fixed} B) counts its {qa.names - qbase.names} "
                    f"names ({name_bytes} B), not the pools"
                )
            if mode != "disc_only":
                entry["overhead"] = per - PAYLOAD - len(RETAINED_TOPIC.format(0))
            retained[mode] = entry
        costs["retained"] = retained

    version, pointer = interpreter_facts()
    return {
        "about": (
            "Heap costs of lib/edgebroker.py measured by `make measure-memory` "
            "(edgebroker_tools.measure) under the MicroPython unix port; read by "
            "`edgebroker config check`. Bytes of gc.mem_alloc() after gc.collect() at calm "
            "points; per-item figures are slopes between two points."
        ),
        "interpreter": version,
        "pointer_bytes": pointer,
        "gc_block_bytes": 4 * pointer,
        "scaling": (
            "by word size: config check uses these 64-bit figures for word_bytes 8 and "
            "scales every heap figure by 278.9/429.8 (x0.649, the object-size ratio "
            "measured on four 32-bit builds) for word_bytes 4 boards; file sizes are not "
            "scaled. `edgebroker emulate` gives this interpreter the board's heap x1.54."
        ),
        "lib_sha256": digests,
        "conditions": {
            "client_id_bytes": len(CLIENT_ID.format(0)),
            "filter": FILTER.format(0, 0)
            + " (4 levels, the first three shared with one other filter)",
            "queued_topic_bytes": len(QUEUED_TOPIC),
            "retained_topic_bytes": len(RETAINED_TOPIC.format(0)),
            "payload_bytes": PAYLOAD,
            "protocol": "MQTT 3.1.1 clients, QoS 1",
            "io_chunk": io_chunk,
        },
        "notes": {
            "import_mpy": "heap kept after importing the .mpy from a filesystem (bytecode in RAM)",
            "import_py": "heap kept after importing the .py source (compiled on the device)",
            "import_romfs": "heap kept after importing the .mpy from a ROMFS image "
            "(bytecode runs in place; image_bytes: the image, in flash on a board)",
            "min_heap_import_mpy": "smallest -X heapsize (1 KB steps) that imports the .mpy",
            "min_heap_import_py": "smallest -X heapsize that imports the .py (compiler peak)",
            "mpy_file_bytes": "size of the .mpy files on the board's filesystem",
            "import_mpy_firmware": "heap kept by the firmware as .mpy while the broker "
            "serves (network stubbed): gateway, with what its boot steps (gwboot, "
            "dropped before serving) leave; gwboot: their peak while booting. It is "
            "loaded before the broker, so it comes out of heap_bytes (measured on the "
            "board after it) and is not in config check's sum",
            "broker_idle": "Broker() + listen() without the io_chunk receive buffer, "
            "RAM store empty, no client",
            "sys_retained": "the $SYS/broker/... retained set after one publish_sys()",
            "per_connection": "one idle client: socket, Conn, Session, client id",
            "per_subscription": "one subscription (see conditions.filter)",
            "per_offline_session": "a persistent session kept after its client left, "
            "no subscriptions",
            "per_queued_message": "a QoS 1 message in an offline session's queue "
            "(conditions: topic and payload sizes)",
            "per_queued_message_256": "the same with a 256-byte payload",
            "per_inflight_message": "a QoS 1 message sent and not acknowledged",
            "message_overhead": "per queued/inflight message beyond its payload and its "
            "topic (bytes), the larger of the two",
            "retained": "per store type: per_message (slope between two full stores of "
            "different capacity, index included: 256 and 1,024 messages, rounded up; "
            "disc_only 256 and 4,096, rounded to the nearest byte), fixed, overhead "
            "(beyond payload and topic; ram and disc keep the message in RAM)",
            "leak_after_disconnect": "heap still held after the idle clients left: the "
            "high-water size of the broker's dicts and poll table (the same after every "
            "round of connecting and leaving, not a leak)",
        },
        "costs": costs,
    }


def _baseline(mpy_dir: Path, mode: str) -> tuple[int, QstrInfo]:
    """The heap of an idle measuring broker with the same imports but the RAM store
    (empty), plus the control and publisher connections: subtracted so that
    `fixed` is the store's own (index, buffers, file)."""
    with harness(mpy_dir, store=mode, profile={"max_retained_messages": 1}, nostore=True) as h:
        ctl = Control(h)
        pub = connect(h.port, "retainer-0000001")
        base = ctl.point("base")
        pub.disconnect()
        ctl.client.disconnect()
        return base, h.qstr.get("base", QstrInfo(0, 0, 0))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m edgebroker_tools.measure",
        description="Measure the broker's heap costs under the MicroPython unix port.",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"output JSON (default: <repo>/{DEFAULT_OUT}); '-' prints it",
    )
    parser.add_argument("--quick", action="store_true", help="fewer items per slope (faster)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = measure(quick=bool(args.quick))
    except (MeasureError, MqttError, runner.RunnerError) as exc:
        print(f"measure: error: {exc}", file=sys.stderr)
        return 1
    out: Path | None = args.out
    target = out if out is not None else runner.repo_root() / DEFAULT_OUT
    if str(target) != "-" and target.is_file():
        # the 32-bit figures are edgebroker_tools.measure32's: kept as they are
        old = json.loads(target.read_text(encoding="utf-8"))
        if "costs_32bit" in old:
            result["costs_32bit"] = old["costs_32bit"]
    text = json.dumps(result, indent=2) + "\n"
    if str(target) == "-":
        sys.stdout.write(text)
        return 0
    target.write_text(text, encoding="utf-8")
    print(f"measure: wrote {target}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

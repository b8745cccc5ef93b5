"""Helpers shared by test_pubsub.py, test_retained.py and test_mqtt5_props.py.

Built on mqtt_helpers (raw codec, RawClient, paho wrapper); this module only
adds what those three files need beyond it:

- ``start_broker``: broker_factory with profile overrides, and in mosquitto
  mode (EDGEBROKER_TEST_BROKER=mosquitto) a mosquitto started with the
  equivalent mosquitto.conf lines when the test names them, so that tests
  needing a profile setting mosquitto also has (retain_available, max_qos,
  sys_interval...) still validate against the reference broker; tests whose
  setting has no mosquitto equivalent are skipped there.
- raw-client conveniences: acknowledge / collect PUBLISHes, drain.
- ``SlowReader``: a raw client with a tiny socket receive buffer that does
  not read (slow consumer).
- ``SysWatcher``: a $SYS/# subscriber that keeps the latest value per topic.
"""

import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from mqtt_helpers import (
    HOST,
    PUBACK,
    PUBCOMP,
    PUBLISH,
    PUBREC,
    PUBREL,
    RawClient,
    free_port,
    is_mosquitto_mode,
    parse_ack,
    parse_publish,
    puback,
    pubcomp,
    pubrec,
    pubrel,
    raw_connect,
)

MOSQUITTO = "/usr/sbin/mosquitto"


# ---------------------------------------------------------------------------
# broker start with overrides (and a mosquitto equivalent when there is one)


class _MosqProc:
    """Minimal BrokerProc look-alike for a mosquitto started here."""

    interp = "mosquitto"
    is_mosquitto = True

    def __init__(self, port, proc, log_path):
        self.host = HOST
        self.port = port
        self.proc = proc
        self.log_path = log_path
        self.profile = {}

    def alive(self):
        return self.proc.poll() is None

    def log_text(self):
        try:
            return Path(self.log_path).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, timeout=5.0):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode

    kill = stop


def start_broker(broker_factory, request, mosq=None, **overrides):
    """Start the broker under test with profile ``overrides``.

    In mosquitto mode: when ``mosq`` (a list of mosquitto.conf lines that
    give the same behaviour) is None and there are overrides, the test is
    skipped; otherwise mosquitto is started with those lines."""
    if not is_mosquitto_mode():
        return broker_factory(**overrides)
    if mosq is None:
        if overrides:
            pytest.skip("mosquitto mode: needs profile overrides %s" % sorted(overrides))
        return broker_factory()
    tmp = request.getfixturevalue("tmp_path")
    port = free_port()
    conf = tmp / ("mosq-extra-%d.conf" % port)
    conf.write_text(
        "listener %d %s\nallow_anonymous true\npersistence false\nlog_dest stderr\n"
        "log_type all\nmax_keepalive 65535\n%s\n" % (port, HOST, "\n".join(mosq))
    )
    log_path = tmp / ("mosq-extra-%d.log" % port)
    with Path(log_path).open("wb") as logf:
        proc = subprocess.Popen(
            [MOSQUITTO, "-c", str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=logf,
        )
    b = _MosqProc(port, proc, log_path)
    request.addfinalizer(b.stop)
    deadline = time.monotonic() + 10
    while True:
        if proc.poll() is not None:
            pytest.fail("mosquitto exited: %s" % b.log_text(), pytrace=False)
        try:
            socket.create_connection((HOST, port), timeout=0.5).close()
            return b
        except OSError:
            if time.monotonic() > deadline:
                pytest.fail("mosquitto not listening", pytrace=False)
            time.sleep(0.05)


def edgebroker_only(broker):
    return not getattr(broker, "is_mosquitto", False)


# ---------------------------------------------------------------------------
# raw client conveniences


def ack_publish(c, p):
    """Complete the receiver side of the QoS flow for PUBLISH ``p``."""
    if p.qos == 1:
        c.send(puback(p.pid, c.version))
    elif p.qos == 2:
        c.send(pubrec(p.pid, c.version))
        rel = c.expect(PUBREL)
        assert rel.flags == 0x02, "PUBREL fixed-header flags must be 0010 (MQTT-3.6.1-1)"
        assert parse_ack(rel.body, c.version)[0] == p.pid
        c.send(pubcomp(p.pid, c.version))


def recv_publishes(c, n, timeout=5.0, ack=True):
    """Read ``n`` PUBLISH packets (acknowledging them when ``ack``); returns
    the parsed Publish tuples. AssertionError with what arrived on timeout."""
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError()
            p = c.expect_publish(remaining)
        except TimeoutError:
            raise AssertionError(  # noqa: B904 - the timeout is the message
                "expected %d PUBLISH within %.1fs, got %d: %r"
                % (n, timeout, len(got), [(x.topic, x.payload[:20]) for x in got][:20])
            )
        got.append(p)
        if ack:
            ack_publish(c, p)
    return got


def drain_publishes(c, wait=0.3, ack=True, limit=100000):
    """Read PUBLISHes until none arrives for ``wait`` s; returns them."""
    got = []
    while len(got) < limit:
        if c.stash:
            p = parse_publish(*c.stash.pop(0)[1:], version=c.version)
        else:
            try:
                raw = c.read_packet(wait)
            except TimeoutError:
                break
            if raw is None:
                break
            if raw.ptype != PUBLISH:
                continue
            p = parse_publish(raw.flags, raw.body, c.version)
        got.append(p)
        if ack:
            ack_publish(c, p)
    return got


def pub_qos(c, topic, payload, qos, pid, retain=False, props=b""):
    """Publish from a raw client with an explicit packet id, completing the flow."""
    return c.publish(topic, payload, qos=qos, retain=retain, pid=pid, props=props)


def subscriber(port, flt, qos=0, version=5, client_id="", props=b"", sub_props=b"", **kw):
    """Raw client connected and subscribed to one filter (options byte ``qos``)."""
    c = (
        raw_connect(port, client_id, version=version, props=props, **kw)
        if version == 5
        else raw_connect(port, client_id, version=version, **kw)
    )
    codes = c.subscribe([(flt, qos)], props=sub_props)
    assert codes == [qos & 3], "SUBACK for %r: %r" % (flt, codes)
    return c


def sync_marker(port, publisher, topic, version=5):
    """Publish a QoS 1 marker and wait for its PUBACK: everything the
    ``publisher`` (RawClient) sent before is then processed by the broker."""
    assert publisher.publish(topic, b"marker", qos=1, pid=65000) in (0, 0x10)


# ---------------------------------------------------------------------------
# a subscriber that does not read


class SlowReader(RawClient):
    """RawClient whose socket has a tiny receive buffer (set before connect)
    and that the test simply never reads from."""

    def __init__(self, port, rcvbuf=2048, host=HOST, timeout=5.0, version=5):
        self.host = host
        self.port = port
        self.version = version
        self.timeout = timeout
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.settimeout(timeout)
        s.connect((host, port))
        self.sock = s
        self._buf = bytearray()
        self.eof = False
        self.seen = []
        self.stash = []


# ---------------------------------------------------------------------------
# $SYS watcher


class Collector:
    """A raw client subscribed to one filter (QoS 0) that reads in a
    background thread; ``got`` lists the (topic, payload bytes) of the
    PUBLISHes it received."""

    def __init__(self, port, flt, version=4, client_id=""):
        self.c = raw_connect(port, client_id, version=version)
        self.got = []
        self._cond = threading.Condition()
        self._stop = False
        assert self.c.subscribe([(flt, 0)]) == [0]
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _take(self, m):
        self.got.append((m.topic, bytes(m.payload)))

    def _run(self):
        while not self._stop:
            try:
                p = self.c.read_packet(0.2)
            except TimeoutError:
                continue
            except (OSError, EOFError, ValueError):
                return
            if p is None:
                return
            if p.ptype != PUBLISH:
                continue
            m = parse_publish(p.flags, p.body, self.c.version)
            with self._cond:
                self._take(m)
                self._cond.notify_all()

    def wait_got(self, pred, timeout):
        """Wait (bounded) until pred(got) holds; returns whether it did."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not pred(self.got):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def snapshot(self):
        with self._cond:
            return list(self.got)

    def close(self):
        self._stop = True
        self._t.join(2)
        self.c.close()


class SysWatcher(Collector):
    """Raw 3.1.1 client subscribed to ``$SYS/#`` in a background thread;
    ``values`` maps topic -> latest payload (str); ``retain_flags`` maps
    topic -> RETAIN flag of the first copy received."""

    def __init__(self, port, flt="$SYS/#"):
        self.values = {}
        self.history = {}
        self.retain_flags = {}
        Collector.__init__(self, port, flt)

    def _take(self, m):
        v = m.payload.decode("ascii", "replace")
        self.retain_flags.setdefault(m.topic, m.retain)
        self.values[m.topic] = v
        self.history.setdefault(m.topic, []).append(v)

    def wait(self, pred, timeout=5.0):
        """Wait until pred(values) is truthy; returns a copy of the values."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not pred(self.values):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(
                        "$SYS condition not met within %.1fs; values: %r"
                        % (timeout, dict(self.values))
                    )
                self._cond.wait(remaining)
            return dict(self.values)



def sys_int(values, name):
    """Integer value of $SYS/broker/<name> in a SysWatcher snapshot, or None."""
    v = values.get("$SYS/broker/" + name)
    return None if v is None else int(v)


def publish_batched(c, items, window=1, qos=1, retain=False, props=b""):
    """Publish ``items`` ([(topic, payload)]) from RawClient ``c`` at QoS 1
    or 2, ``window`` PUBLISHes in flight at a time (never more than the
    broker's Receive Maximum, MQTT-3.3.4-7). Returns the ack reason codes.

    window=1 is the fast choice on loopback: with several small acks in
    flight, Nagle on the broker's socket and delayed ACK on ours cost 40 ms
    per batch (seen with mosquitto and edgebroker alike)."""
    from mqtt_helpers import publish_packet

    reasons = []
    pid = 0
    for start in range(0, len(items), window):
        batch = items[start : start + window]
        pids = []
        data = bytearray()
        for topic, payload in batch:
            pid = pid % 65535 + 1
            pids.append(pid)
            data += publish_packet(
                topic, payload, qos=qos, retain=retain, pid=pid, props=props, version=c.version
            )
        c.send(data)
        if qos == 1:
            for p in pids:
                rpid, reason, _ = c.expect_ack(PUBACK, 10)
                assert rpid == p
                reasons.append(reason)
        else:
            for p in pids:
                rpid, reason, _ = c.expect_ack(PUBREC, 10)
                assert rpid == p
                reasons.append(reason)
            rel = bytearray()
            for p in pids:
                rel += pubrel(p, c.version)
            c.send(rel)
            for p in pids:
                assert c.expect_ack(PUBCOMP, 10)[0] == p
    return reasons

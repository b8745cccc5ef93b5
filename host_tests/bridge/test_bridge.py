"""The bridge to an upstream broker (lib/edgebridge.py, issue 10), against a
real upstream: Debian's mosquitto on a free loopback port with persistence
in tmp_path. The gateway is edgebroker with `bridges` in its profile, under
both interpreters.

The bridge's link is an asyncio task, so these tests run the gateway with
the asyncio server only: `interp` is parametrised here with the async ids
(cpython-async, micropython-async), which overrides conftest's
interp x server parametrisation for this module (the poll server refuses a
profile with bridges: test_poll_server_refuses_bridges).
"""

import getpass
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mqtt_helpers import make_certs
from mqtt_helpers import free_port, raw_connect, wait_for

from edgebroker_tools.mqttclient import split_packets

MOSQUITTO = "/usr/sbin/mosquitto"
REPO = Path(__file__).resolve().parents[2]

# EDGEBROKER_TEST_INTERP restricts the interpreters as everywhere else; the
# server is always the asyncio one (EDGEBROKER_TEST_SERVER does not apply).
_ONLY = [i.strip() for i in os.environ.get("EDGEBROKER_TEST_INTERP", "").split(",") if i.strip()]
ASYNC = pytest.mark.parametrize(
    "interp", [i + "-async" for i in (_ONLY or ["cpython", "micropython"])], indirect=True)


# ----------------------------------------------------------------- upstream
class Upstream:
    """mosquitto on a fixed loopback port, persistence in its own dir;
    stop() and start() again keep the port and the persisted sessions."""

    def __init__(self, tmp_path, extra=""):
        self.port = free_port()
        self.dir = tmp_path / ("upstream-%d" % self.port)
        self.dir.mkdir()
        self.conf = self.dir / "mosquitto.conf"
        self.conf.write_text(
            "listener %d 127.0.0.1\n"
            # started as root, mosquitto would switch to its own user, which
            # cannot write its database into tmp_path: stay who we are
            "user %s\n"
            "allow_anonymous true\n"
            "persistence true\n"
            "persistence_location %s/\n"
            "max_queued_messages 0\n"
            "max_keepalive 65535\n"
            "log_dest stderr\n"
            "log_type error\nlog_type warning\nlog_type notice\nlog_type information\n"
            "%s" % (self.port, getpass.getuser(), self.dir, extra))
        self.proc = None
        self.runs = 0

    def start(self):
        self.runs += 1
        log = open(self.dir / ("log-%d.txt" % self.runs), "wb")
        self.proc = subprocess.Popen([MOSQUITTO, "-c", str(self.conf)], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=log)
        log.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise AssertionError("mosquitto did not start")

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: mosquitto saves its database
            self.proc.wait(10)
        self.proc = None

    def log(self):
        return "".join(p.read_text(errors="replace") for p in sorted(self.dir.glob("log-*.txt")))


@pytest.fixture
def upstream(tmp_path):
    made = []

    def make(extra=""):
        u = Upstream(tmp_path, extra)
        made.append(u)
        return u.start()

    yield make
    for u in made:
        u.stop()


class Collector:
    """A paho client on the upstream with a persistent session subscribed
    to '#' at QoS 1: it reconnects by itself across upstream restarts and
    the upstream keeps what arrives meanwhile."""

    def __init__(self, port, topic="#", qos=1, client_id="collector"):
        import paho.mqtt.client as mqtt
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        self.msgs = []
        self.lock = threading.Lock()
        self.topic = topic
        self.qos = qos
        c = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
                        client_id=client_id, protocol=mqtt.MQTTv5)
        c.reconnect_delay_set(0.1, 0.5)
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 3600
        self.ready = threading.Event()
        c.on_connect = self._on_connect
        c.on_message = self._on_message
        c.on_subscribe = lambda *a: self.ready.set()
        # a clean session once, then the same one across upstream restarts
        c.connect("127.0.0.1", port, keepalive=30, clean_start=mqtt.MQTT_CLEAN_START_FIRST_ONLY,
                  properties=props)
        self.c = c
        c.loop_start()
        assert self.ready.wait(5), "collector did not subscribe"

    def _on_connect(self, client, userdata, flags, rc, properties=None):
        client.subscribe(self.topic, self.qos)

    def _on_message(self, client, userdata, msg):
        with self.lock:
            self.msgs.append((msg.topic, msg.payload, msg.retain, msg.qos))

    def get(self):
        with self.lock:
            return list(self.msgs)

    def close(self):
        self.c.loop_stop()
        try:
            self.c.disconnect()
        except Exception:
            pass


@pytest.fixture
def collector():
    made = []

    def make(port, **kw):
        c = Collector(port, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


# -------------------------------------------------------------- the proxy
# (split_packets: the tools' client's, shared with the load generators)
class Proxy:
    """A loopback TCP proxy between the gateway and the upstream that the
    test controls: freeze() stops forwarding without closing (a silent
    link); it parses the gateway's MQTT stream to count the QoS 1/2
    PUBLISHes in flight (sent, not yet PUBACK/PUBCOMP'd) and keeps the
    largest count seen."""

    def __init__(self, target_port):
        self.target = target_port
        self.ls = socket.socket()
        self.ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.ls.bind(("127.0.0.1", 0))
        self.ls.listen(4)
        self.port = self.ls.getsockname()[1]
        self.frozen = False
        self.cutting = False  # cut(): the proxy's thread closes every pair
        self.drop_acks = 0  # PUBACKs from the upstream to drop (not forwarded)
        self.refuse = False  # accept and close at once (the upstream is away)
        self.accepts = 0     # connection attempts that reached the proxy
        self.stopped = False
        self.pairs = []
        self.inflight = set()
        self.max_inflight = 0
        self.connections = 0
        self.lock = threading.Lock()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def freeze(self):
        self.frozen = True

    def thaw(self):
        self.frozen = False

    def cut(self):
        """Closes every relayed connection (from the proxy's own thread)."""
        self.cutting = True
        assert wait_for(lambda: not self.cutting, 5)

    def close(self):
        self.stopped = True
        self.t.join(3)
        self.ls.close()
        for a, b, *_ in self.pairs:
            a.close()
            b.close()

    def _parse(self, buf, upward):
        # complete packets only; returns the bytes left
        pkts, rest = split_packets(buf)
        with self.lock:
            for first, j, end in pkts:
                t = first >> 4
                body = buf[j:end]
                if upward and t == 3 and first >> 1 & 3:
                    tl = body[0] << 8 | body[1]
                    self.inflight.add(body[2 + tl] << 8 | body[3 + tl])
                    self.max_inflight = max(self.max_inflight, len(self.inflight))
                elif not upward and t in (4, 7):
                    self.inflight.discard(body[0] << 8 | body[1])
                elif upward and t == 1:
                    self.inflight.clear()  # a new connection
        return buf[rest:]

    def _drop_acks(self, pair, data):
        # the downward bytes packet by packet while PUBACKs are to be dropped
        # (a held partial packet goes on with the next read)
        held = pair[4]
        buf = held + data
        pkts, rest = split_packets(buf)
        out = bytearray()
        start = 0  # packets are back to back from the start of buf
        for first, _j, end in pkts:
            if first >> 4 == 4 and self.drop_acks:
                self.drop_acks -= 1
            else:
                out += buf[start:end]
            start = end
        held[:] = buf[rest:]
        return bytes(out)

    def _run(self):
        while not self.stopped:
            if self.cutting:
                for a, b, *_ in self.pairs:
                    a.close()
                    b.close()
                self.pairs = []
                self.cutting = False
            socks = [self.ls] + [p[0] for p in self.pairs] + [p[1] for p in self.pairs]
            r, _, _ = select.select(socks, [], [], 0.05)
            for s in r:
                if s is self.ls:
                    a, _ = self.ls.accept()
                    self.accepts += 1
                    if self.refuse:
                        a.close()
                        continue
                    try:
                        b = socket.create_connection(("127.0.0.1", self.target))
                    except OSError:
                        a.close()
                        continue
                    self.connections += 1
                    self.pairs.append((a, b, bytearray(), bytearray(), bytearray()))
                    continue
                if self.frozen:
                    continue
                for p in list(self.pairs):
                    a, b, ua, db, _ = p
                    if s is a or s is b:
                        try:
                            data = s.recv(65536)
                        except OSError:
                            data = b""
                        if not data:
                            a.close()
                            b.close()
                            self.pairs.remove(p)
                            break
                        if s is b and self.drop_acks:
                            data = self._drop_acks(p, data)
                        try:
                            (b if s is a else a).sendall(data)
                        except OSError:
                            # the other side has gone (an upstream stopped
                            # under traffic): the pair ends, the proxy goes on
                            a.close()
                            b.close()
                            self.pairs.remove(p)
                            break
                        if s is a:
                            ua += data
                            ua[:] = self._parse(ua, True)
                        else:
                            db += data
                            db[:] = self._parse(db, False)
            if self.frozen:
                time.sleep(0.05)


@pytest.fixture
def proxy():
    made = []

    def make(port):
        p = Proxy(port)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


# -------------------------------------------------------------- the gateway
def bridge(port, topics, **kw):
    b = {"name": "cloud", "host": "127.0.0.1", "port": port, "keepalive": 10,
         "retry_min": 1, "retry_max": 2, "attempts_per_minute": 60, "topics": topics}
    b.update(kw)
    return b


OUT = [{"pattern": "sensors/#", "direction": "out", "qos": 1, "remote_prefix": "site1/gw1/"}]


def gateway(broker_factory, bridges, **kw):
    prof = {"storage_type": "disc_only", "max_inflight": 64, "max_queued": 4096,
            "bridges": bridges}
    prof.update(kw)
    return broker_factory(**prof)


def publish_many(port, msgs, qos=1, client_id="pub", window=64, timeout=60):
    """Publishes (topic, payload) pairs through paho with `window` in flight
    and returns once every one is acknowledged by the gateway."""
    import paho.mqtt.client as mqtt

    c = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                    protocol=mqtt.MQTTv5)
    c.max_inflight_messages_set(window)
    c.max_queued_messages_set(0)
    c.connect("127.0.0.1", port, keepalive=60)
    c.loop_start()
    try:
        infos = [c.publish(t, p, qos) for t, p in msgs]
        deadline = time.monotonic() + timeout
        for i in infos:
            i.wait_for_publish(max(0.1, deadline - time.monotonic()))
            assert i.is_published(), "not acknowledged locally"
    finally:
        c.disconnect()
        c.loop_stop()


def wait_connected(gw, n=1, timeout=15):
    ok = gw.wait_log(lambda t: t.count("bridge cloud: connected") >= n, timeout)
    assert ok, gw.log_text()[-3000:]


def go_down(gw, up, px):
    """The upstream stops; the proxy turns the bridge away until come_back()."""
    px.refuse = True
    up.stop()
    assert gw.wait_log("bridge cloud: link down", 15), gw.log_text()[-2000:]


def come_back(gw, up, px, col, n=2):
    """The upstream starts, the collector reconnects first, then the bridge."""
    up.start()
    assert wait_for(lambda: col.c.is_connected(), 10)
    px.refuse = False
    wait_connected(gw, n, timeout=20)


def arrived(col):
    """Distinct (topic, payload) pairs the collector got, status excluded."""
    return {(t, p) for t, p, *_ in col.get() if not t.endswith("/status")}


def check_all_in_order(got, sent):
    """Every sent (topic, payload) arrived (at least once) and, per topic,
    the first arrivals are in publish order."""
    first = {}
    for i, (t, p) in enumerate((t, p) for t, p, *_ in got):
        first.setdefault((t, p), i)
    missing = [m for m in sent if m not in first]
    assert not missing, "%d of %d lost, first: %r" % (len(missing), len(sent), missing[:3])
    last = {}
    for t, p in sent:
        i = first[(t, p)]
        assert i > last.get(t, -1), "order broken on %s at %r" % (t, p)
        last[t] = i


# ------------------------------------------------------------------- tests
@ASYNC
def test_forwarding_and_mapping_both_directions(broker_factory, upstream, collector):
    from mqtt_helpers import paho_client

    up = upstream()
    col = collector(up.port)
    rules = OUT + [
        {"pattern": "cmd/#", "direction": "in", "qos": 1, "remote_prefix": "site1/gw1/",
         "local_prefix": "local/"},
        {"pattern": "echo/#", "direction": "both", "qos": 1, "remote_prefix": "site1/gw1/"},
        {"pattern": "fast/#", "direction": "out", "qos": 0, "remote_prefix": "site1/gw1/"},
        {"pattern": "exact/#", "direction": "out", "qos": 2, "remote_prefix": "site1/gw1/"},
    ]
    gw = gateway(broker_factory, [bridge(up.port, rules)])
    wait_connected(gw)
    local = paho_client(gw.port, "local")
    local.subscribe_wait("#", qos=1)
    publish_many(gw.port, [("sensors/t1", b"21.5"), ("other/x", b"not bridged"),
                           ("echo/a", b"e1"), ("fast/f", b"q0")])
    publish_many(gw.port, [("exact/e", b"two"), ("sensors/t2", b"q2 down to 1")], qos=2)
    assert wait_for(lambda: len(col.get()) >= 6, 10), col.get()
    got = {(t, p) for t, p, r, q in col.get() if not t.endswith("status")}
    assert got == {("site1/gw1/sensors/t1", b"21.5"), ("site1/gw1/echo/a", b"e1"),
                   ("site1/gw1/fast/f", b"q0"), ("site1/gw1/exact/e", b"two"),
                   ("site1/gw1/sensors/t2", b"q2 down to 1")}
    # inbound: upstream -> local with the prefixes swapped
    cloud = paho_client(up.port, "cloud")
    cloud.publish_wait("site1/gw1/cmd/reboot", b"now", qos=1)
    cloud.publish_wait("site1/gw1/echo/b", b"from cloud", qos=1)
    assert wait_for(lambda: any(m.topic == "local/cmd/reboot" for m in local.get_messages()), 10)
    assert wait_for(lambda: any(m.topic == "echo/b" for m in local.get_messages()), 10)
    time.sleep(1.0)
    # no loops: echo/b came in from upstream and is not sent back; echo/a went
    # up once and did not come back down (No Local)
    ups = [(t, p) for t, p, r, q in col.get()]
    assert ups.count(("site1/gw1/echo/b", b"from cloud")) == 1, ups
    assert ups.count(("site1/gw1/echo/a", b"e1")) == 1, ups
    downs = [(m.topic, m.payload) for m in local.get_messages()]
    assert downs.count(("echo/a", b"e1")) == 1 and downs.count(("echo/b", b"from cloud")) == 1
    local.close()
    cloud.close()


@ASYNC
def test_a_link_out_of_heap_tries_again(broker_factory, upstream, collector):
    """The link's first two attempts run out of heap, and so does the log
    line that would report each (host_tests/portable/oom_link_broker.py
    patches only the bridge): the link task goes on, the third attempt
    connects, and messages published meanwhile are forwarded. Before, a
    MemoryError inside the report ended the link task for good."""
    up = upstream()
    col = collector(up.port)
    script = Path(__file__).resolve().parents[1] / "portable" / "oom_link_broker.py"
    gw = broker_factory(script=str(script), storage_type="disc_only", max_inflight=64,
                        max_queued=4096, bridges=[bridge(up.port, OUT)])
    publish_many(gw.port, [("sensors/t", b"before")])
    wait_connected(gw, timeout=20)
    publish_many(gw.port, [("sensors/t", b"after")])
    want = {("site1/gw1/sensors/t", b"before"), ("site1/gw1/sensors/t", b"after")}
    assert wait_for(lambda: arrived(col) >= want, 10), col.get()
    assert "Traceback" not in gw.log_text() and gw.alive(), gw.log_text()[-3000:]


@ASYNC
def test_outbound_rules_match_as_topic_filters_MQTT_4_7_1(broker_factory, upstream, collector):
    """An out rule "p/#" is matched by prefix (no split per message): it
    takes "p" itself and everything below it and nothing else (4.7.1.2);
    a rule with "+" goes the general way; the remote topic is made from
    the topic's bytes, so a local prefix with a multi-byte character is cut
    at its byte length."""
    up = upstream()
    col = collector(up.port)
    rules = [
        {"pattern": "sensors/#", "qos": 1, "remote_prefix": "site1/gw1/"},
        {"pattern": "a/+/c", "qos": 1, "remote_prefix": "site1/gw1/"},
        {"pattern": "x/#", "qos": 1, "local_prefix": "l\u00e9/", "remote_prefix": "site1/gw1/"},
    ]
    gw = gateway(broker_factory, [bridge(up.port, rules)])
    wait_connected(gw)
    publish_many(gw.port, [
        ("sensors", b"parent"), ("sensors/t/1", b"below"), ("sensorsX/1", b"no"),
        ("sensors2", b"no"), ("a/b/c", b"plus"), ("a/b/d", b"no"), ("a/b/c/d", b"no"),
        ("l\u00e9/x", b"lparent"), ("l\u00e9/x/1", b"lbelow"), ("l\u00e9/y", b"no"),
        ("x/1", b"no"),
    ])
    want = {("site1/gw1/sensors", b"parent"), ("site1/gw1/sensors/t/1", b"below"),
            ("site1/gw1/a/b/c", b"plus"), ("site1/gw1/x", b"lparent"),
            ("site1/gw1/x/1", b"lbelow")}
    assert wait_for(lambda: arrived(col) >= want, 10), arrived(col)
    time.sleep(0.5)
    assert arrived(col) == want


@ASYNC
def test_inbound_and_outbound_at_once_lose_nothing(broker_factory, upstream, collector):
    """Inbound PUBLISHes arrive while local traffic is forwarded: the link is
    then serviced between local packets (Bridge.pump), which takes only
    acknowledgements and leaves an inbound PUBLISH to the link task. Every
    message arrives both ways, in order per topic."""
    import threading

    from mqtt_helpers import paho_client

    up = upstream()
    col = collector(up.port)
    rules = OUT + [{"pattern": "cmd/#", "direction": "in", "qos": 1, "remote_prefix": "site1/gw1/"}]
    gw = gateway(broker_factory, [bridge(up.port, rules)])
    wait_connected(gw)
    local = paho_client(gw.port, "local")
    local.subscribe_wait("cmd/#", qos=1)
    cloud = paho_client(up.port, "cloud")
    inbound = [("site1/gw1/cmd/%d" % (i % 3), b"in %d" % i) for i in range(150)]
    sent = [("sensors/%d" % (i % 4), b"out %d" % i) for i in range(600)]

    def from_cloud():
        for t, p in inbound:
            cloud.publish_wait(t, p, qos=1)

    th = threading.Thread(target=from_cloud)
    th.start()
    publish_many(gw.port, sent)
    th.join(60)
    want = {("site1/gw1/" + t, p) for t, p in sent}
    assert wait_for(lambda: want <= arrived(col), 30), len(want - arrived(col))
    check_all_in_order(col.get(), [("site1/gw1/" + t, p) for t, p in sent])
    assert wait_for(lambda: len(local.get_messages()) >= len(inbound), 30), len(
        local.get_messages())
    downs = [(m.topic, m.payload) for m in local.get_messages()]
    assert downs == [(t[len("site1/gw1/"):], p) for t, p in inbound]
    local.close()
    cloud.close()


def backlog_after_outage(broker_factory, up, collector, proxy, sent, **kw):
    """A gateway bridged to `up` through a proxy; the upstream stops, `sent`
    is published locally (the bridge's backlog), the upstream starts again
    and the link comes back (the proxy turns connections away until the
    collector is back, so nothing depends on the upstream queueing for an
    offline subscriber; its in-flight count starts at 0 there). Returns
    (gateway, collector, proxy)."""
    col = collector(up.port)
    px = proxy(up.port)
    gw = gateway(broker_factory, [bridge(px.port, OUT, **kw)])
    wait_connected(gw)
    go_down(gw, up, px)
    publish_many(gw.port, sent)
    assert bridge_state(gw.port)["backlog"] == len(sent)
    with px.lock:
        px.max_inflight = 0
    come_back(gw, up, px, col)
    return gw, col, px


@ASYNC
def test_outage_2000_messages_all_arrive_in_order(broker_factory, upstream, collector, proxy):
    """The upstream stops while 2,000 QoS 1 messages are published locally
    (every one acknowledged locally), then starts again: every one arrives,
    per-topic order kept. The bridge reaches the upstream through a proxy
    that turns connections away until the collector is back, so the test
    does not depend on the upstream queueing for an offline subscriber."""
    sent = [("sensors/s%d" % (i % 7), b"%d" % i) for i in range(2000)]
    gw, col, _px = backlog_after_outage(broker_factory, upstream(), collector, proxy, sent)
    want = [("site1/gw1/" + t, p) for t, p in sent]
    assert wait_for(lambda: len(arrived(col)) >= len(want), 40), (len(arrived(col)), bridge_state(gw.port))
    check_all_in_order([m for m in col.get() if not m[0].endswith("status")], want)


@ASYNC
@pytest.mark.parametrize("qos", [1, 2])
def test_live_messages_are_not_starved_behind_a_paced_backlog(broker_factory, upstream,
                                                              collector, proxy, qos):
    """Issue 10 item 2: a backlog drained at replay_rate does not hold back
    the messages published after the reconnect: those on topics with
    nothing in the backlog go at once (the live lane); those on a backlog
    topic wait their turn (per-topic order). Nothing is lost; a power cut
    during the paced drain loses nothing either."""
    up = upstream()
    col = collector(up.port)
    px = proxy(up.port)
    rules = [dict(OUT[0], qos=qos)]
    b = bridge(px.port, rules, replay_rate=40)
    gw = gateway(broker_factory, [b])
    wait_connected(gw)
    go_down(gw, up, px)
    backlog = [("sensors/b%d" % (i % 3), b"%d" % i) for i in range(600)]
    publish_many(gw.port, backlog, qos=qos)
    come_back(gw, up, px, col)
    t0 = time.monotonic()
    live = [("sensors/live", b"L%d" % i) for i in range(30)]
    late = [("sensors/b0", b"after the backlog %d" % i) for i in range(3)]
    publish_many(gw.port, live + late, qos=qos, client_id="pub-live")
    want_live = {("site1/gw1/" + t, p) for t, p in live}
    # 600 at 40/s is 15 s of drain: the live ones come long before it ends
    # (within 10 s even on a loaded test machine)
    assert wait_for(lambda: want_live <= arrived(col), 10), (len(arrived(col)), bridge_state(gw.port))
    took = time.monotonic() - t0
    n_backlog = len([m for m in arrived(col) if m[0].startswith("site1/gw1/sensors/b")])
    assert n_backlog < len(backlog), "the backlog was not paced (%d arrived in %.1f s)" % (
        n_backlog, took)
    st = bridge_state(gw.port)
    assert st["live_sent"] >= len(live) and st["pacing"] is True, st
    # a power cut in the middle of the paced drain, then everything arrives
    gw.kill()
    gw = gateway(broker_factory, [b], port=gw.port)
    want = [("site1/gw1/" + t, p) for t, p in backlog + live + late]
    assert wait_for(lambda: set(want) <= arrived(col), 60), (len(arrived(col)), bridge_state(gw.port))
    got = [m for m in col.get() if not m[0].endswith("status")]
    check_all_in_order(got, want)
    if qos == 2:
        # exactly once through the cut (persistent upstream session, PUBREC records)
        ups = [(t, p) for t, p, *_ in got]
        assert len(ups) == len(set(ups)), "duplicates: %d" % (len(ups) - len(set(ups)))
    # the lanes join again once nothing is queued (at the link's next turn)
    assert wait_for(lambda: bridge_state(gw.port)["backlog"] == 0, 10)
    assert wait_for(lambda: bridge_state(gw.port)["pacing"] is False, 5), bridge_state(gw.port)


@ASYNC
@pytest.mark.parametrize("qos", [1, 2])
def test_power_cut_mid_drain_loses_nothing(broker_factory, upstream, collector, proxy, qos):
    """SIGKILL in the middle of the backlog drain, restart on the same data
    directory: every locally acknowledged message arrives upstream, at least
    once with QoS 1, exactly once with QoS 2 (the upstream keeps the
    bridge's session), per-topic order of first arrivals kept."""
    up = upstream()
    col = collector(up.port, qos=qos)
    px = proxy(up.port)
    px.freeze()
    rules = [dict(OUT[0], qos=qos)]
    b = bridge(px.port, rules, replay_rate=400, keepalive=30)
    gw = gateway(broker_factory, [b])
    sent = [("sensors/p%d" % (i % 5), b"%d" % i) for i in range(1500)]
    publish_many(gw.port, sent, qos=qos)
    px.thaw()
    assert wait_for(lambda: len(col.get()) >= 200, 20), len(col.get())
    gw.kill()
    assert len(col.get()) < len(sent)  # killed mid-drain
    gw2 = gateway(broker_factory, [b], port=gw.port)
    want = [("site1/gw1/" + t, p) for t, p in sent]
    assert wait_for(lambda: len(arrived(col)) >= len(want), 40), \
        len(col.get())
    got = [m for m in col.get() if not m[0].endswith("status")]
    check_all_in_order(got, want)
    if qos == 2:
        time.sleep(1.0)
        got = [(t, p) for t, p, *_ in col.get() if not t.endswith("status")]
        assert len(got) == len(want), "%d duplicates" % (len(got) - len(want))
    assert gw2.alive()


@ASYNC
def test_receive_maximum_2_is_respected(broker_factory, upstream, collector, proxy):
    up = upstream("max_inflight_messages 2\n")
    col = collector(up.port)
    px = proxy(up.port)
    gw = gateway(broker_factory, [bridge(px.port, OUT, max_inflight=50)])
    wait_connected(gw)
    sent = [("sensors/r", b"%d" % i) for i in range(300)]
    publish_many(gw.port, sent)
    want = [("site1/gw1/" + t, p) for t, p in sent]
    # (the status message is not one of them: counted, it let the check run
    # one message early)
    assert wait_for(lambda: len(arrived(col)) >= len(want), 30), len(arrived(col))
    check_all_in_order([m for m in col.get() if not m[0].endswith("status")], want)
    assert 1 <= px.max_inflight <= 2, px.max_inflight
    assert px.connections == 1  # the upstream never cut the link (0x93)


@ASYNC
@pytest.mark.parametrize(
    "granted, max_inflight, low, high",
    [("max_inflight_messages 0\n", 1000, 100, 1000), ("max_inflight_messages 5\n", 50, 5, 5)],
    ids=["no-limit-granted", "5-granted"],
)
def test_a_backlog_fills_the_window_and_never_more(
    broker_factory, upstream, collector, proxy, granted, low, high, max_inflight
):
    """A backlog of 3,000 queued during an outage goes out when the link
    comes back with the status PUBLISH ("online", QoS 1) of that connect:
    together never more in flight than the window, min(the upstream's
    Receive Maximum, max_inflight) (MQTT-3.3.4-9; the status message once
    made it one more), and the window is used: hundreds in flight when the
    upstream grants no limit (max_inflight_messages 0: 65,535) and the bridge
    allows 1,000, all 5 when it grants 5. Every message once and in order;
    the acknowledgements of each read leave the window together and the
    cursor reaches the end (backlog 0)."""
    sent = [("sensors/w%d" % (i % 5), b"%d" % i) for i in range(3000)]
    gw, col, px = backlog_after_outage(
        broker_factory, upstream(granted), collector, proxy, sent, max_inflight=max_inflight
    )
    want = [("site1/gw1/" + t, p) for t, p in sent]
    assert wait_for(lambda: len(arrived(col)) >= len(want), 60), len(arrived(col))
    check_all_in_order([m for m in col.get() if not m[0].endswith("status")], want)
    assert low <= px.max_inflight <= high, px.max_inflight
    assert px.connections == 2  # the upstream never cut the link (0x93)
    assert wait_for(lambda: bridge_state(gw.port)["backlog"] == 0, 10), bridge_state(gw.port)


@ASYNC
def test_a_resumed_session_resends_within_a_smaller_receive_maximum(
    broker_factory, upstream, collector, proxy
):
    """20 QoS 1 messages in flight (the proxy holds them) when the link is
    cut; the upstream comes back granting 3 and the bridge's session with
    it: the 20 are sent again (MQTT-4.4.0-1) as the window of 3 allows,
    never all at once (MQTT-3.3.4-9), then the rest; every message arrives,
    per-topic order kept."""
    up = upstream("max_inflight_messages 20\n")
    col = collector(up.port)
    px = proxy(up.port)
    gw = gateway(broker_factory, [bridge(px.port, OUT, max_inflight=20)])
    wait_connected(gw)
    px.freeze()
    sent = [("sensors/v%d" % (i % 3), b"%d" % i) for i in range(50)]
    publish_many(gw.port, sent)
    time.sleep(0.5)  # the bridge sends its window of 20 into the held proxy
    px.refuse = True
    px.cut()
    px.thaw()
    assert gw.wait_log("bridge cloud: link down", 15), gw.log_text()[-2000:]
    up.stop()
    up.conf.write_text(
        up.conf.read_text().replace("max_inflight_messages 20", "max_inflight_messages 3")
    )
    with px.lock:
        px.max_inflight = 0
    come_back(gw, up, px, col)
    assert gw.wait_log("session present, receive maximum 3", 5), gw.log_text()[-2000:]
    want = [("site1/gw1/" + t, p) for t, p in sent]
    assert wait_for(lambda: len(arrived(col)) >= len(want), 30), len(arrived(col))
    check_all_in_order([m for m in col.get() if not m[0].endswith("status")], want)
    assert 1 <= px.max_inflight <= 3, px.max_inflight


@ASYNC
@pytest.mark.parametrize("lost", ["status", "message"])
def test_a_lost_acknowledgement_does_not_stall_the_drain(
    broker_factory, upstream, collector, proxy, lost
):
    """One PUBACK from the upstream never reaches the bridge (the proxy
    drops it: the status message's, or the first queued message's) while
    the link stays alive (PINGRESPs come) and max_inflight is 1: after a
    keep-alive period with no acknowledgement the bridge connects again,
    resumes the session and sends what was in flight again (DUP); every
    message arrives, in order, and the drain goes on (mosquitto's bridge
    stalls for good here, its issue #2176)."""
    up = upstream()
    col = collector(up.port)
    px = proxy(up.port)
    if lost == "status":
        px.drop_acks = 1  # the first PUBACK on the link: the status message's
    gw = gateway(broker_factory, [bridge(px.port, OUT, max_inflight=1, keepalive=5)])
    wait_connected(gw)
    if lost == "message":
        assert wait_for(lambda: bridge_state(gw.port)["connected"], 5)
        time.sleep(0.5)  # the status message's PUBACK has come
        px.drop_acks = 1
    sent = [("sensors/a", b"%d" % i) for i in range(10)]
    publish_many(gw.port, sent)
    assert gw.wait_log("no acknowledgement from upstream in 5 s", 15), gw.log_text()[-2000:]
    wait_connected(gw, 2, timeout=15)
    want = [("site1/gw1/" + t, p) for t, p in sent]
    assert wait_for(lambda: len(arrived(col)) >= len(want), 20), len(arrived(col))
    check_all_in_order([m for m in col.get() if not m[0].endswith("status")], want)
    assert wait_for(lambda: bridge_state(gw.port)["backlog"] == 0, 10), bridge_state(gw.port)
    assert px.drop_acks == 0


@ASYNC
def test_silent_link_is_detected_and_nothing_is_lost(broker_factory, upstream, collector, proxy):
    up = upstream()
    col = collector(up.port)
    px = proxy(up.port)
    gw = gateway(broker_factory, [bridge(px.port, OUT, keepalive=5)])
    wait_connected(gw)
    px.freeze()
    sent = [("sensors/k", b"%d" % i) for i in range(100)]
    publish_many(gw.port, sent)
    assert gw.wait_log("keep alive: nothing", 15), gw.log_text()[-2000:]
    px.thaw()
    wait_connected(gw, 2, timeout=20)
    want = [("site1/gw1/" + t, p) for t, p in sent]
    assert wait_for(lambda: len(arrived(col)) >= len(want), 20)
    check_all_in_order([m for m in col.get() if not m[0].endswith("status")], want)


@ASYNC
@pytest.mark.parametrize("storage", ["disc", "disc_only"])
def test_newer_format_files_are_kept_as_they_are(broker_factory, storage, tmp_path):
    """A firmware rolled back to this version finds a newer format's retained
    store and bridge queue (upgrade audit): it moved them aside as .bad and
    started empty files, which the newer firmware, flashed again, opened
    instead: months of state left in a .bad the next one replaces. They are
    kept byte for byte; the store runs read-only from RAM (acknowledged at
    once, not durable: it says so, and $SYS/broker/retained/degraded says
    why) and that bridge does not run, each with one error line."""
    data = tmp_path / "data"
    data.mkdir()
    store = data / "retained.ebrs"
    queue = data / "bridge-cloud.ebrq"
    store.write_bytes(b"EBRS\x02\x00\x00\x00" + b"a version 2 store")
    queue.write_bytes(b"EBRQ\x02\x00\x00\x00" + b"a version 2 queue")
    before = (store.read_bytes(), queue.read_bytes())
    cloud = bridge(9, [{"pattern": "#"}])
    b = broker_factory(storage_type=storage, bridges=[cloud])  # the asyncio server (module)
    assert b.wait_log("bridge does not run", timeout=5)
    log = b.log_text()
    assert "retained.ebrs: format version 2 is newer than this firmware's (1), kept as it is" in log
    assert "bridge-cloud.ebrq: format version 2 is newer" in log
    c = raw_connect(b.port, "w", version=5)
    assert c.publish("v/t", b"in ram", qos=1, retain=True) == 0
    c.disconnect()
    r = raw_connect(b.port, "", version=5)
    r.subscribe([("v/#", 1)])
    m = r.expect_publish(5)
    assert (m.topic, m.payload, m.retain) == ("v/t", b"in ram", True)
    r.disconnect()
    s = raw_connect(b.port, "sys", version=5)
    s.subscribe([("$SYS/broker/retained/degraded", 0)])
    m = s.expect_publish(5)
    assert b"version 2 is newer" in m.payload
    s.disconnect()
    b.stop()
    assert "Traceback" not in b.log_text()
    assert (store.read_bytes(), queue.read_bytes()) == before
    assert sorted(p.name for p in data.iterdir()) == ["bridge-cloud.ebrq", "retained.ebrs"]


@ASYNC
def test_local_clients_are_not_delayed_while_upstream_is_down(broker_factory, upstream):
    """A local QoS 1 pair keeps working (every message through, promptly)
    while the upstream is down and the bridge retries."""
    from mqtt_helpers import paho_client

    up = upstream()
    gw = gateway(broker_factory, [bridge(up.port, OUT, retry_min=1, retry_max=1)])
    wait_connected(gw)
    up.stop()
    sub = paho_client(gw.port, "sub")
    sub.subscribe_wait("sensors/#", qos=1)
    pub = paho_client(gw.port, "pubq")
    worst = 0.0
    for i in range(40):
        t0 = time.monotonic()
        pub.publish_wait("sensors/l", b"%d" % i, qos=1, timeout=5)
        assert sub.wait_messages(i + 1, timeout=5)
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.05)
    # a bound far above a loopback round trip, far below a connect timeout
    assert worst < 2.0, worst
    sub.close()
    pub.close()


@pytest.mark.parametrize("which", ["cpython", "micropython"])
def test_poll_server_refuses_bridges(tmp_path, which):
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"storage_type": "disc_only",
                                "bridges": [bridge(free_port(), OUT)]}))
    from conftest import micropython_exe

    exe = [sys.executable] if which == "cpython" else [micropython_exe()]
    r = subprocess.run(exe + ["lib/edgebroker.py", "--board", str(prof), "--port", str(free_port()),
                              "--data-dir", str(tmp_path / "d"), "--server", "poll"],
                       cwd=str(REPO), capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "need the asyncio server" in r.stderr
    assert "listening" not in r.stdout  # refused before anything listens


@ASYNC
def test_credentials_come_from_the_secrets_file(broker_factory, upstream, collector, tmp_path):
    """Issue 10 item 1: username/password from the secrets file (the
    board's /secrets.json; --secrets on the host), not the profile. The
    upstream checks a password file: the right secret connects as that user
    (its log names it) and forwards; a wrong one is refused and named in
    the bridge's state."""
    pw = tmp_path / "passwords"
    subprocess.run(["mosquitto_passwd", "-b", "-c", str(pw), "gw-user", "s3cret"], check=True,
                   capture_output=True, timeout=30)
    up = upstream("password_file %s\n" % pw)
    col = collector(up.port)
    good = tmp_path / "secrets.json"
    good.write_text(json.dumps({"bridges": {"cloud": {"username": "gw-user",
                                                      "password": "s3cret"}}}))
    gw = gateway(broker_factory, [bridge(up.port, OUT)], extra_args=("--secrets", str(good)))
    wait_connected(gw)
    publish_many(gw.port, [("sensors/s", b"with credentials")])
    assert wait_for(lambda: ("site1/gw1/sensors/s", b"with credentials")
                    in [(t, p) for t, p, r, q in col.get()], 10), col.get()
    assert wait_for(lambda: "u'gw-user'" in up.log(), 5), up.log()[-2000:]
    gw.stop()
    bad = tmp_path / "bad-secrets.json"
    bad.write_text(json.dumps({"bridges": {"cloud": {"username": "gw-user",
                                                     "password": "wrong"}}}))
    gw = gateway(broker_factory, [bridge(up.port, OUT)], extra_args=("--secrets", str(bad)))
    # mosquitto answers 0x86 or 0x87 (Not authorized) for a wrong password
    assert wait_for(lambda: "(bad user name or password)" in bridge_state(gw.port)["last_error"]
                    or "(not authorized)" in bridge_state(gw.port)["last_error"], 15), \
        bridge_state(gw.port)
    assert not bridge_state(gw.port)["connected"]


@pytest.mark.parametrize("which", ["cpython", "micropython"])
def test_secrets_for_a_bridge_the_profile_lacks_are_refused(tmp_path, which):
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"storage_type": "disc_only",
                                "bridges": [bridge(free_port(), OUT)]}))
    sec = tmp_path / "s.json"
    sec.write_text(json.dumps({"bridges": {"clod": {"username": "u", "password": "p"}}}))
    from conftest import micropython_exe

    exe = [sys.executable] if which == "cpython" else [micropython_exe()]
    r = subprocess.run(exe + ["lib/edgebroker.py", "--board", str(prof), "--port", str(free_port()),
                              "--data-dir", str(tmp_path / "d"), "--server", "async",
                              "--secrets", str(sec)],
                       cwd=str(REPO), capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "secrets bridges.clod: the profile has no bridge named 'clod'" in r.stderr
    # the host tool says the same before it starts anything
    host = json.loads((REPO / "boards" / "host.json").read_text())
    host.update(json.loads(prof.read_text()), fs_reserve_bytes=131072)  # room for edgebridge.mpy
    prof.write_text(json.dumps(host))
    tool = Path(sys.executable).parent / "edgebroker"
    r = subprocess.run([str(tool), "run", "--board", str(prof), "--port", str(free_port()),
                        "--secrets", str(sec), "--data-dir", str(tmp_path / "d")],
                       cwd=str(REPO), capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "bridges.clod: the profile has no bridge named 'clod' (it has 'cloud')" in r.stderr


def bridge_state(port, name="cloud"):
    """The gateway's $SYS/broker/bridge/<name>/state, as a dict."""
    from mqtt_helpers import paho_client

    c = paho_client(port, "state-reader-%d" % time.monotonic_ns())
    try:
        c.subscribe_wait("$SYS/broker/bridge/%s/state" % name, qos=0)
        assert c.wait_messages(1, timeout=5)
        m = c.get_messages()[0]
        assert m.retain  # made on demand for a new subscriber, like every $SYS topic
        return json.loads(m.payload)
    finally:
        c.close()


@ASYNC
def test_status_topics_local_and_upstream(broker_factory, upstream, collector):
    up = upstream()
    col = collector(up.port)
    gw = gateway(broker_factory, [bridge(up.port, OUT)])
    wait_connected(gw)
    st = bridge_state(gw.port)
    assert st["connected"] is True and st["backlog"] == 0 and st["drops"] == 0
    assert wait_for(lambda: ("site1/gw1/status", b"online") in [(t, p) for t, p, *_ in col.get()], 5)
    # the upstream publishes the will when the gateway dies
    gw.kill()
    assert wait_for(lambda: col.get()[-1][:2] == ("site1/gw1/status", b"offline"), 10), col.get()
    # the offline state is retained upstream
    from mqtt_helpers import paho_client

    late = paho_client(up.port, "late")
    late.subscribe_wait("site1/gw1/status", qos=1)
    assert late.wait_messages(1, timeout=5)
    m = late.get_messages()[0]
    assert (m.payload, m.retain) == (b"offline", True)
    late.close()
    # down: the local state says so, with the backlog and its age
    gw2 = gateway(broker_factory, [bridge(up.port, OUT)], port=gw.port)
    wait_connected(gw2)
    up.stop()
    assert gw2.wait_log("bridge cloud: link down", 15)
    publish_many(gw2.port, [("sensors/a", b"1"), ("sensors/b", b"2")])
    st = bridge_state(gw2.port)
    assert st["connected"] is False and st["backlog"] == 2 and st["backlog_bytes"] > 0
    assert st["oldest_age"] is not None and 0 <= st["oldest_age"] < 60
    assert st["last_error"]


@ASYNC
def test_latest_mode_sends_only_the_newest_per_topic(broker_factory, upstream, collector, proxy):
    up = upstream()
    col = collector(up.port)
    px = proxy(up.port)
    rules = [{"pattern": "state/#", "qos": 1, "remote_prefix": "gw/", "mode": "latest"}] + OUT
    gw = gateway(broker_factory, [bridge(px.port, rules)])
    wait_connected(gw)
    go_down(gw, up, px)
    msgs = []
    for i in range(50):
        msgs += [("state/a", b"a%d" % i), ("state/b", b"b%d" % i), ("sensors/q", b"%d" % i)]
    publish_many(gw.port, msgs)
    come_back(gw, up, px, col)
    assert wait_for(lambda: sum(1 for m in col.get() if m[0] == "site1/gw1/sensors/q") >= 50, 20)
    time.sleep(0.5)
    got = [(t, p) for t, p, *_ in col.get()]
    # queue mode keeps all 50; latest keeps only the newest of each topic
    assert [p for t, p in got if t == "site1/gw1/sensors/q"] == [b"%d" % i for i in range(50)]
    assert [p for t, p in got if t == "gw/state/a"] == [b"a49"]
    assert [p for t, p in got if t == "gw/state/b"] == [b"b49"]
    assert bridge_state(gw.port)["latest_skipped"] == 98


@ASYNC
def test_retained_state_and_offline_delete_propagate(broker_factory, upstream):
    from mqtt_helpers import paho_client

    up = upstream()
    gw = gateway(broker_factory, [bridge(up.port, OUT)])
    wait_connected(gw)
    pub = paho_client(gw.port, "rpub")
    pub.publish_wait("sensors/keep", b"v1", qos=1, retain=True)
    pub.publish_wait("sensors/gone", b"old", qos=0, retain=True)
    assert wait_for(lambda: retained_upstream(up.port, "site1/gw1/sensors/#") == {
        ("site1/gw1/sensors/keep", b"v1"), ("site1/gw1/sensors/gone", b"old")}, 10)
    up.stop()
    assert gw.wait_log("bridge cloud: link down", 15)
    pub.publish_wait("sensors/gone", b"", qos=0, retain=True)  # deleted while offline
    pub.publish_wait("sensors/keep", b"v2", qos=1, retain=True)
    pub.close()
    up.start()
    wait_connected(gw, 2, timeout=20)
    want = {("site1/gw1/sensors/keep", b"v2")}
    assert wait_for(lambda: retained_upstream(up.port, "site1/gw1/sensors/#") == want, 10), \
        retained_upstream(up.port, "site1/gw1/sensors/#")


def retained_upstream(port, filt):
    """The retained messages a new subscriber gets from the upstream."""
    from mqtt_helpers import paho_client

    c = paho_client(port, "retained-check-%d" % time.monotonic_ns())
    try:
        c.subscribe_wait(filt, qos=1)
        time.sleep(0.3)
        return {(m.topic, m.payload) for m in c.get_messages() if m.retain}
    finally:
        c.close()


@ASYNC
@pytest.mark.parametrize("when_full", ["drop_oldest", "refuse"])
def test_full_queue_policy_holds_and_counts_drops(broker_factory, upstream, collector, proxy, when_full):
    up = upstream()
    col = collector(up.port)
    px = proxy(up.port)
    gw = gateway(broker_factory, [bridge(px.port, OUT, queue_bytes=4096, when_full=when_full)])
    wait_connected(gw)
    go_down(gw, up, px)
    sent = [("sensors/f", b"%04d" % i + b"x" * 60) for i in range(200)]
    publish_many(gw.port, sent)  # every one acknowledged locally all the same
    st = bridge_state(gw.port)
    assert st["backlog_bytes"] <= 4096
    assert st["drops"] == 200 - st["backlog"] and st["backlog"] > 10
    n = st["backlog"]
    come_back(gw, up, px, col)
    assert wait_for(lambda: len([m for m in col.get() if m[0] == "site1/gw1/sensors/f"]) >= n, 20)
    time.sleep(0.3)
    got = [p for t, p, *_ in col.get() if t == "site1/gw1/sensors/f"]
    want = [p for t, p in sent]
    # drop_oldest keeps the newest n, refuse the first n
    assert got == (want[-n:] if when_full == "drop_oldest" else want[:n])


@ASYNC
def test_queue_file_is_compacted_after_a_drain(broker_factory, upstream, collector, proxy):
    up = upstream()
    col = collector(up.port)
    px = proxy(up.port)
    gw = gateway(broker_factory, [bridge(px.port, OUT)], compact_min_bytes=4096)
    wait_connected(gw)
    go_down(gw, up, px)
    sent = [("sensors/c", b"%d" % i + b"y" * 200) for i in range(500)]
    publish_many(gw.port, sent)
    qf = Path(gw.data_dir) / "bridge-cloud.ebrq"
    assert qf.stat().st_size > 500 * 200
    come_back(gw, up, px, col)
    assert wait_for(lambda: len([m for m in col.get() if m[0] == "site1/gw1/sensors/c"]) >= 500, 30)
    # the acknowledged prefix is dropped: the file shrinks to a few records
    assert wait_for(lambda: qf.stat().st_size < 8192, 10), qf.stat().st_size
    assert qf.read_bytes()[:5] == b"EBRQ\x01"


@ASYNC
@pytest.mark.parametrize("client_cert", [False, True])
def test_tls_forwarding_and_inbound(broker_factory, upstream, collector, tmp_path, client_cert):
    """TLS to the upstream with certificates made at test time: the upstream
    verified against the CA (and, with client_cert, the gateway verified by
    its certificate); forwarding both ways works as over plain TCP."""
    from mqtt_helpers import paho_client

    certs = make_certs(tmp_path / "certs")
    tls_port = free_port()
    extra = ("listener %d 127.0.0.1\ncafile %s\ncertfile %s\nkeyfile %s\n"
             % (tls_port, certs / "ca.pem", certs / "server.pem", certs / "server.key"))
    if client_cert:
        extra += "require_certificate true\n"
    up = upstream(extra)
    col = collector(up.port)
    tls = {"ca": str(certs / "ca.pem"), "server_hostname": "localhost"}
    if client_cert:
        tls.update(cert=str(certs / "client.pem"), key=str(certs / "client.key"))
    rules = OUT + [{"pattern": "cmd/#", "direction": "in", "qos": 1, "remote_prefix": "site1/gw1/"}]
    gw = gateway(broker_factory, [bridge(tls_port, rules, tls=tls)])
    wait_connected(gw)
    local = paho_client(gw.port, "local")
    local.subscribe_wait("cmd/#", qos=1)
    sent = [("sensors/tls", b"%d" % i) for i in range(200)]
    publish_many(gw.port, sent)
    want = [("site1/gw1/" + t, p) for t, p in sent]
    assert wait_for(lambda: len(arrived(col)) >= len(want), 20), len(arrived(col))
    check_all_in_order([m for m in col.get() if not m[0].endswith("status")], want)
    cloud = paho_client(up.port, "cloud")
    cloud.publish_wait("site1/gw1/cmd/x", b"over tls", qos=1)
    assert local.wait_messages(1, timeout=10)
    assert local.get_messages()[0].payload == b"over tls"
    local.close()
    cloud.close()


@ASYNC
def test_tls_with_the_wrong_ca_never_connects(broker_factory, upstream, tmp_path):
    certs = make_certs(tmp_path / "certs")
    other = make_certs(tmp_path / "other")
    tls_port = free_port()
    up = upstream("listener %d 127.0.0.1\ncafile %s\ncertfile %s\nkeyfile %s\n"
                  % (tls_port, certs / "ca.pem", certs / "server.pem", certs / "server.key"))
    assert up
    gw = gateway(broker_factory, [bridge(tls_port, OUT, tls={
        "ca": str(other / "ca.pem"), "server_hostname": "localhost"})])
    assert gw.wait_log("bridge cloud: link down", 15)
    publish_many(gw.port, [("sensors/x", b"1")])
    st = bridge_state(gw.port)
    assert st["connected"] is False and st["backlog"] == 1 and st["last_error"]
    assert "bridge cloud: connected" not in gw.log_text()


@ASYNC
def test_a_tls_file_that_cannot_be_read_is_named_in_the_log(broker_factory, upstream, tmp_path):
    """tls.ca names a file the gateway does not have: each attempt fails
    with a line naming it (before: `OSError(2,)` on MicroPython, naming
    nothing), the link retries, and local clients are served."""
    import socket

    missing = str(tmp_path / "no-such-ca.pem")
    srv = socket.socket()  # takes the TCP connection (the kernel's backlog)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    try:
        gw = gateway(broker_factory, [bridge(srv.getsockname()[1], OUT, tls={"ca": missing})])
        assert gw.wait_log("tls: cannot load " + missing, 15), gw.log_text()[-2000:]
        publish_many(gw.port, [("sensors/x", b"1")])
        assert bridge_state(gw.port)["backlog"] == 1
    finally:
        srv.close()


@ASYNC
def test_a_tls_upstream_that_trickles_its_handshake_never_holds_the_broker(broker_factory,
                                                                          tmp_path):
    """An upstream that accepts the connection and then sends its TLS
    handshake a byte every 0.3 s (a record header announcing 16 KB first):
    the attempt ends within connect_timeout, and local clients are served
    all the while (before, on MicroPython: the blocking wrap_socket was
    bounded per read only, so the whole broker stalled for as long as the
    bytes kept coming)."""
    import socket
    import threading

    from mqtt_helpers import paho_client

    certs = make_certs(tmp_path / "certs")
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.settimeout(0.2)
    stop = threading.Event()

    def trickle():
        conns = []
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            conns.append(c)
            threading.Thread(target=drip, args=(c,), daemon=True).start()
        for c in conns:
            c.close()

    def drip(c):
        data = b"\x16\x03\x03\x40\x00" + bytes(16384)
        for i in range(len(data)):
            if stop.wait(0.3):
                return
            try:
                c.send(data[i:i + 1])
            except OSError:
                return
    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        gw = gateway(broker_factory, [bridge(srv.getsockname()[1], OUT, connect_timeout=2, tls={
            "ca": str(certs / "ca.pem"), "server_hostname": "localhost"})])
        time.sleep(1.0)  # the first attempt is under way
        local = paho_client(gw.port, "local-while-tls")
        local.subscribe_wait("probe/#", qos=1)
        worst = 0.0
        deadline = time.monotonic() + 6
        i = 0
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            local.publish_wait("probe/x", b"%d" % i, qos=1, timeout=10)
            worst = max(worst, time.monotonic() - t0)
            i += 1
            time.sleep(0.05)
        local.close()
        assert worst < 1.5, "a local publish waited %.1f s for the bridge's handshake" % worst
        assert gw.wait_log("bridge cloud: link down", 5), gw.log_text()[-2000:]
    finally:
        stop.set()
        t.join(5)
        srv.close()


@ASYNC
def test_mqtt_311_link_forwards_both_ways_without_echo(broker_factory, upstream, collector):
    """protocol 4 (MQTT 3.1.1 upstream): forwarding out and in works; with
    no No Local in 3.1.1, a `both` topic's own message coming back from the
    upstream is not published locally a second time."""
    from mqtt_helpers import paho_client

    up = upstream()
    col = collector(up.port)
    rules = OUT + [
        {"pattern": "cmd/#", "direction": "in", "qos": 1, "remote_prefix": "site1/gw1/"},
        {"pattern": "echo/#", "direction": "both", "qos": 1, "remote_prefix": "site1/gw1/"},
    ]
    gw = gateway(broker_factory, [bridge(up.port, rules, protocol=4)])
    wait_connected(gw)
    local = paho_client(gw.port, "local4")
    local.subscribe_wait("#", qos=1)
    publish_many(gw.port, [("sensors/a", b"1"), ("echo/e", b"mine")])
    assert wait_for(lambda: {("site1/gw1/sensors/a", b"1"), ("site1/gw1/echo/e", b"mine")}
                    <= arrived(col), 10), col.get()
    cloud = paho_client(up.port, "cloud4")
    cloud.publish_wait("site1/gw1/cmd/go", b"now", qos=1)
    assert wait_for(lambda: any(m.topic == "cmd/go" for m in local.get_messages()), 10)
    time.sleep(1.0)
    downs = [(m.topic, m.payload) for m in local.get_messages()]
    assert downs.count(("echo/e", b"mine")) == 1, downs
    assert [(t, p) for t, p, *_ in col.get()].count(("site1/gw1/echo/e", b"mine")) == 1
    local.close()
    cloud.close()


@ASYNC
def test_message_expiry_counts_the_time_in_the_queue(broker_factory, upstream, collector, proxy):
    """A queued message whose Message Expiry passes during the outage is
    never sent; one with time left goes up with the time left."""
    from mqtt_helpers import paho_client

    up = upstream()
    col = collector(up.port)
    px = proxy(up.port)
    gw = gateway(broker_factory, [bridge(px.port, OUT)])
    wait_connected(gw)
    go_down(gw, up, px)
    pub = paho_client(gw.port, "exp-pub")
    pub.publish_wait("sensors/short", b"gone", qos=1, properties={"MessageExpiryInterval": 1})
    pub.publish_wait("sensors/long", b"kept", qos=1, properties={"MessageExpiryInterval": 3600})
    pub.close()
    time.sleep(2.5)
    come_back(gw, up, px, col)
    assert wait_for(lambda: ("site1/gw1/sensors/long", b"kept") in arrived(col), 10)
    time.sleep(0.5)
    assert ("site1/gw1/sensors/short", b"gone") not in arrived(col)
    assert bridge_state(gw.port)["expired"] == 1  # counted, as every message not sent


@ASYNC
def test_reconnect_attempts_back_off_and_are_bounded_per_minute(broker_factory, upstream, proxy):
    """An upstream that closes every connection at once: the bridge backs
    off and never attempts more than attempts_per_minute in a minute."""
    up = upstream()
    px = proxy(up.port)
    px.refuse = True
    gw = gateway(broker_factory, [bridge(px.port, OUT, retry_min=1, retry_max=1,
                                         attempts_per_minute=3)])
    time.sleep(6.0)
    assert 2 <= px.accepts <= 3, px.accepts
    assert gw.log_text().count("bridge cloud: link down") == px.accepts
    px.refuse = False
    time.sleep(3.0)
    assert "bridge cloud: connected" not in gw.log_text()  # the minute is not over yet


@ASYNC
def test_inbound_larger_than_max_packet_size_is_not_sent_to_the_gateway(broker_factory, upstream):
    """The bridge tells the upstream its Maximum Packet Size (5.0): a larger
    message is dropped by the upstream, the link stays up, the next one comes."""
    from mqtt_helpers import paho_client

    up = upstream()
    rules = [{"pattern": "cmd/#", "direction": "in", "qos": 1, "remote_prefix": "site1/gw1/"}]
    gw = gateway(broker_factory, [bridge(up.port, rules)], max_packet_size=1024)
    wait_connected(gw)
    local = paho_client(gw.port, "local-big")
    local.subscribe_wait("cmd/#", qos=1)
    cloud = paho_client(up.port, "cloud-big")
    cloud.publish_wait("site1/gw1/cmd/big", b"x" * 4000, qos=1)
    cloud.publish_wait("site1/gw1/cmd/small", b"ok", qos=1)
    assert local.wait_messages(1, timeout=10)
    time.sleep(0.5)
    assert [(m.topic, m.payload) for m in local.get_messages()] == [("cmd/small", b"ok")]
    assert "link down" not in gw.log_text()
    local.close()
    cloud.close()


@ASYNC
def test_outbound_over_the_upstream_maximum_packet_size_is_skipped(broker_factory, upstream,
                                                                   collector):
    up = upstream("max_packet_size 300\n")
    col = collector(up.port)
    gw = gateway(broker_factory, [bridge(up.port, OUT)])
    wait_connected(gw)
    publish_many(gw.port, [("sensors/big", b"y" * 1000), ("sensors/small", b"ok")])
    assert wait_for(lambda: ("site1/gw1/sensors/small", b"ok") in arrived(col), 10)
    # the upstream's PUBACK for it may still be on its way when it arrives
    assert wait_for(lambda: bridge_state(gw.port)["backlog"] == 0, 10)
    st = bridge_state(gw.port)
    assert st["too_large"] == 1 and st["backlog"] == 0 and st["connected"] is True
    assert "link down" not in gw.log_text()


# A CPython broker whose fdatasync calls are traced: the file's inode, its
# size when the call began and the monotonic time it returned (the clock
# is system-wide, so the test process can compare its own readings).
TRACED_BROKER = r'''
import os, runpy, sys, time
_real = os.fdatasync
_log = open(%r, "a", buffering=1)


def _traced(fd):
    st = os.fstat(fd)
    _real(fd)
    _log.write("%%d %%d %%.6f\n" %% (st.st_ino, st.st_size, time.monotonic()))


os.fdatasync = _traced
sys.path.insert(0, %r)
runpy.run_path(%r, run_name="__main__")
'''


@pytest.mark.parametrize("interp", ["cpython-async"], indirect=True)
def test_no_puback_leaves_before_its_message_is_fsynced(broker_factory, tmp_path):
    """Acknowledged means on flash (MQTT-4.3.2-2: the PUBACK transfers
    ownership). Under CPython the bridge queue's fsync runs in a thread
    beside the loop (pipelined group commit, Engine.commit); every PUBACK
    must still come after an fsync that covered its message's record. The
    upstream is not there, so the queue only grows (no compaction moves a
    record). CPython only: the MicroPython unix port has no fsync (its
    commit is a flush; on a board, littlefs syncs on flush)."""
    import paho.mqtt.client as mqtt

    sys.path.insert(0, str(REPO / "lib"))
    import edgebridge

    trace = tmp_path / "fsync.txt"
    script = tmp_path / "traced_broker.py"
    script.write_text(TRACED_BROKER % (str(trace), str(REPO / "lib"),
                                       str(REPO / "lib" / "edgebroker.py")))
    gw = gateway(broker_factory, [bridge(free_port(), OUT)], script=script)
    acked = {}
    c = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2, client_id="pub",
                    protocol=mqtt.MQTTv5)
    c.on_publish = lambda cl, ud, mid, rc, props: acked.setdefault(mid, time.monotonic())
    c.max_inflight_messages_set(64)
    c.max_queued_messages_set(0)
    c.connect("127.0.0.1", gw.port, keepalive=60)
    c.loop_start()
    try:
        mids = {}
        for i in range(3):  # bursts: several commits in flight while more arrive
            infos = [c.publish("sensors/x", b"m%04d" % (i * 400 + k), 1) for k in range(400)]
            for k, info in enumerate(infos):
                info.wait_for_publish(30)
                assert info.is_published()
                mids[info.mid] = b"m%04d" % (i * 400 + k)
    finally:
        c.disconnect()
        c.loop_stop()
    gw.stop()
    qpath = tmp_path / "data" / "bridge-cloud.ebrq"
    ino = os.stat(qpath).st_ino
    syncs = []
    for line in trace.read_text().splitlines():
        i, size, t = line.split()
        if int(i) == ino:
            syncs.append((float(t), int(size)))
    ends = {}
    with open(qpath, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        pos = edgebridge._HDR
        while pos < size:
            rt, body, nxt = edgebridge.read_record(f, pos, size)
            if rt is None:
                break
            if rt == edgebridge.T_MSG:
                ends[bytes(edgebridge.decode_msg(body)[6])] = nxt
            pos = nxt
    assert len(ends) == 1200
    early = [p for mid, p in mids.items()
             if not any(t <= acked[mid] and s >= ends[p] for t, s in syncs)]
    assert early == [], "PUBACK before its record was fsynced: %r" % early[:5]

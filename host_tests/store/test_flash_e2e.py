"""Retained messages on flash, end to end: the broker process with
storage_type "disc" / "disc_only" (lib/edgestore.py, FlashStore), driven by
real clients over loopback, stopped cleanly (SIGINT) or killed (SIGKILL) and
restarted on the same data directory (broker_factory shares
tmp_path/"data" between the starts of one test).

Rules (docs/retained.md), named in every test:

  durability  "Durability": in disc and disc_only the PUBACK (QoS 1) /
              PUBREC (QoS 2) of a retained PUBLISH goes out only after the
              change is in the store file; a SIGKILL mid-stream loses nothing
              acknowledged and garbles nothing. (Power cuts at every byte
              are test_store_crash.py's.)
  S8          retained messages survive a restart (S6: with their QoS and
              properties).
  E4          expiry holds across a restart: with the wall clock set, the
              downtime counts; without it (board never got NTP), a message
              may outlive its lifetime by at most the downtime, never more.
  L2 L3 L4    max_retained_messages, max_payload_size, store_budget_bytes
              with a flash store, before and after a restart.
  D9          20,000 retained messages to one '#' subscriber with Receive
              Maximum 10 that reads slowly, while live messages keep
              arriving: every one once, no burst beyond the window; the
              store compacting under a paced delivery; live traffic
              overflowing the session queue during one.

The store file is read with edgestore's own reader (replay(), through
the host tools' store_report.inspect(), and decode_put()) on a snapshot
copy, never with a second parser. Every test
runs under CPython and the MicroPython unix port (the interp fixture).
"""

import binascii
import math
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers_pubsub import (
    SysWatcher,
    drain_publishes,
    recv_publishes,
    subscriber,
    sys_int,
)
from mqtt_helpers import (
    CONTENT_TYPE,
    CORRELATION_DATA,
    MESSAGE_EXPIRY_INTERVAL,
    PAYLOAD_FORMAT_INDICATOR,
    PUBACK,
    PUBCOMP,
    PUBREC,
    RECEIVE_MAXIMUM,
    RESPONSE_TOPIC,
    USER_PROPERTY,
    mosquitto_pub,
    paho_client,
    parse_ack,
    prop_bin,
    prop_byte,
    prop_pair,
    prop_str,
    prop_u16,
    prop_u32,
    puback,
    publish_packet,
    pubrel,
    raw_connect,
    requires_edgebroker,
    subscribe_packet,
)

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "lib") not in sys.path:
    sys.path.insert(0, str(REPO / "lib"))

import edgestore as es  # noqa: E402

sys.path.insert(0, str(REPO / "tools"))
from edgebroker_tools.commands import store_report  # noqa: E402

STORE_FILE = "retained.ebrs"
FLASH = pytest.mark.parametrize("storage", ["disc", "disc_only"])
BIG = {"max_retained_messages": 0, "store_budget_bytes": 64 * 1024 * 1024}


@pytest.fixture(autouse=True)
def _edgebroker_only(interp):
    requires_edgebroker(interp, "the flash store is edgebroker's")


# ---------------------------------------------------------------------------
# helpers


def store_path(b):
    return Path(b.data_dir) / STORE_FILE


def stored_values(path, tmp_dir):
    """{topic: (qos, flags, remaining, stime, wall, props, payload)} of the
    live messages of a store file, decoded by edgestore itself: the file is
    copied first (the broker may append or compact meanwhile), inspect()
    finds the live records, decode_put() decodes each. {} if no file."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return {}
    snap = Path(tmp_dir) / "snapshot.ebrs"
    snap.write_bytes(data)
    rep = store_report.inspect(es, str(snap))
    assert rep["header"]["kind"] == "ok", rep
    out = {}
    for ent in rep["live"] + rep["expired"]:
        off = ent["offset"]
        blen = ent["record_bytes"] - 9
        assert data[off] == es.T_PUT
        p = es.decode_put(data[off + 5:off + 5 + blen], blen)
        assert p is not None and p[0].decode() == ent["topic"]
        out[ent["topic"]] = p[1:]
    return out


def retained_now(port, flt="#", qos=2, wait=0.5, client_id=""):
    """What a new clean 5.0 subscriber to ``flt`` gets at subscribe time
    (each acknowledged, until nothing arrives for ``wait`` s): (list of
    Publish, monotonic time of the SUBSCRIBE)."""
    c = raw_connect(port, client_id, version=5)
    c.send(subscribe_packet(1, [(flt, qos)]))
    t_sub = time.monotonic()
    assert c.expect_suback()[1] == [qos]
    got = drain_publishes(c, wait)
    c.disconnect()
    return got, t_sub


def topics_payloads(msgs):
    return {m.topic: m.payload for m in msgs}


def stop_or_kill(b, how):
    if how == "sigkill":
        b.kill()
    else:
        assert b.stop() == 0, "SIGINT must stop the broker with exit code 0 (contract)"


def sliding_publish(c, items, window=16, timeout=60.0):
    """Publishes ``items`` ([(topic, payload, props)]) as retained QoS 1
    with ``window`` unacknowledged at a time (the broker's Receive Maximum
    is max_inflight = 16); every PUBACK is checked. Returns the count."""
    deadline = time.monotonic() + timeout
    nxt = 0
    inflight = {}
    acked = 0
    while acked < len(items):
        assert time.monotonic() < deadline, "only %d of %d acknowledged" % (acked, len(items))
        data = bytearray()
        while len(inflight) < window and nxt < len(items):
            topic, payload, props = items[nxt]
            pid = nxt % 65535 + 1
            data += publish_packet(topic, payload, qos=1, retain=True, pid=pid, props=props)
            inflight[pid] = topic
            nxt += 1
        if data:
            c.send(data)
        pid, reason, _ = c.expect_ack(PUBACK, 30)
        assert reason in (0, 0x10) and pid in inflight, (pid, reason)
        del inflight[pid]
        acked += 1
    return acked


# ---------------------------------------------------------------------------
# a. SIGKILL mid-stream: nothing acknowledged is lost, nothing is torn

def value_payload(topic, seq):
    """Self-checking payload: topic, value number, filler, CRC-32 of it all."""
    body = b"%s|%d|%s" % (topic.encode(), seq, b"f" * ((seq * 13 + len(topic)) % 50))
    return body + b"|%08x" % (binascii.crc32(body) & 0xFFFFFFFF)


def parse_value(payload):
    """(topic, seq) of a value_payload(); AssertionError if garbled."""
    body, _, crc = bytes(payload).rpartition(b"|")
    assert crc == b"%08x" % (binascii.crc32(body) & 0xFFFFFFFF), "garbled payload %r" % payload[:80]
    topic, seq, _ = body.split(b"|", 2)
    return topic.decode(), int(seq)


def value_expiry(i, seq):
    """Message Expiry of value ``seq`` of topic number ``i``: none for a
    third of the topics, long fixed or per-value lifetimes for the rest."""
    if i % 3 == 0:
        return None
    if i % 3 == 1:
        return 3600
    return 1800 + seq


def value_props(i, topic, seq):
    p = prop_str(CONTENT_TYPE, "text/x-val;seq=%d" % seq)
    p += prop_pair("topic", topic) + prop_pair("seq", str(seq))
    exp = value_expiry(i, seq)
    if exp is not None:
        p += prop_u32(MESSAGE_EXPIRY_INTERVAL, exp)
    return p


class KillMidStream:
    """One stream of retained QoS 1 publishes (16 in flight) that another
    thread ends with a SIGKILL of the broker once ``kill_at`` PUBACKs have
    arrived, while the publisher keeps sending. ``seqs`` are the value
    numbers to send to every topic; ``history`` (topic -> [...]) carries
    what earlier streams acknowledged and sent."""

    def __init__(self, b, seqs, kill_at, history, window=16):
        self.b = b
        self.kill_at = kill_at
        self.window = window
        self.plan = [(t, seq) for seq in seqs for t in TOPICS]
        self.h = history
        self.n_acked = 0
        self.t_dead = None
        self._go = threading.Event()
        self._killer = threading.Thread(target=self._kill, daemon=True)

    def _kill(self):
        if self._go.wait(60):
            self.b.kill()
            self.t_dead = time.monotonic()  # every in-flight PUBLISH was read before this

    def run(self, timeout=60.0):
        h = self.h
        self._killer.start()
        c = raw_connect(self.b.port, "fk-pub", version=5)
        deadline = time.monotonic() + timeout
        inflight = {}
        nxt = 0
        try:
            while time.monotonic() < deadline:
                data = bytearray()
                while len(inflight) < self.window and nxt < len(self.plan):
                    topic, seq = self.plan[nxt]
                    pid = nxt % 65535 + 1
                    props = value_props(INDEX[topic], topic, seq)
                    data += publish_packet(topic, value_payload(topic, seq), qos=1, retain=True,
                                           pid=pid, props=props)
                    inflight[pid] = (topic, seq)
                    h["sent"][topic] = seq
                    h["send_time"][(topic, seq)] = time.monotonic()
                    nxt += 1
                if data:
                    c.send(data)
                p = c.read_packet(10)
                if p is None:
                    break  # killed
                if p.ptype != PUBACK:
                    continue
                pid, reason, _ = parse_ack(p.body, 5)
                assert reason in (0, 0x10), "PUBACK reason %#x" % reason
                topic, seq = inflight.pop(pid)
                h["acked"][topic] = seq
                h["ack_time"][(topic, seq)] = time.monotonic()
                self.n_acked += 1
                if self.n_acked >= self.kill_at:
                    self._go.set()
        except (OSError, EOFError):
            pass  # the connection died with the broker
        finally:
            c.close()
            self._go.set()
            self._killer.join(10)
        assert self.t_dead is not None, "the broker was not killed"
        assert self.n_acked >= self.kill_at
        assert nxt < len(self.plan), "killed after the last publish: not mid-stream"
        for pid in inflight:
            h["dead_time"][inflight[pid]] = self.t_dead


N_TOPICS = 300
TOPICS = ["fk/%02d/t%03d" % (i % 17, i) for i in range(N_TOPICS)]
INDEX = {t: i for i, t in enumerate(TOPICS)}


def check_file_after_kill(path, h, tmp_path):
    """Every acknowledged value (or a later one) is in the file the killed
    broker left behind: the PUBACK waited for the write."""
    on_file = stored_values(path, tmp_path)
    lost = []
    for topic, seq in h["acked"].items():
        have = on_file.get(topic)
        if have is None or parse_value(have[-1])[1] < seq:
            lost.append((topic, seq, have and parse_value(have[-1])[1]))
    assert not lost, (
        "acknowledged retained values missing from the store file after SIGKILL "
        "(topic, acked value, value on file): %r" % lost[:10]
    )


def check_restarted(port, h):
    """What a '#' subscriber gets from the restarted broker, against the
    history: see the test's docstring."""
    got, _ = retained_now(port, "#", qos=1, wait=0.8)
    t_recv = time.monotonic()
    problems = []
    seen = set()
    for m in got:
        if m.topic not in INDEX:
            problems.append("unexpected topic %r" % m.topic)
            continue
        if m.topic in seen:
            problems.append("duplicate %r" % m.topic)
        seen.add(m.topic)
        topic, seq = parse_value(m.payload)
        if topic != m.topic:
            problems.append("%s carries the payload of %s" % (m.topic, topic))
            continue
        if not (m.retain and m.qos == 1):
            problems.append("%s: retain %s qos %d" % (topic, m.retain, m.qos))
        if seq < h["acked"].get(topic, -1):
            problems.append("%s: value %d older than the acknowledged %d"
                            % (topic, seq, h["acked"][topic]))
        if seq > h["sent"].get(topic, -1):
            problems.append("%s: value %d never sent" % (topic, seq))
        p = m.props
        if p.get(CONTENT_TYPE) != "text/x-val;seq=%d" % seq:
            problems.append("%s: content type %r for value %d" % (topic, p.get(CONTENT_TYPE), seq))
        if p.get(USER_PROPERTY) != [("topic", topic), ("seq", str(seq))]:
            problems.append("%s: user properties %r" % (topic, p.get(USER_PROPERTY)))
        exp = value_expiry(INDEX[topic], seq)
        left = p.get(MESSAGE_EXPIRY_INTERVAL)
        if exp is None:
            if left is not None:
                problems.append("%s: expiry %r on a message without one" % (topic, left))
            continue
        if left is None:
            problems.append("%s: Message Expiry lost (%d s)" % (topic, exp))
            continue
        # the broker read the value before its PUBACK, or before it died
        t_ref = h["ack_time"].get((topic, seq), h["dead_time"].get((topic, seq)))
        t_sent = h["send_time"][(topic, seq)]
        # whole seconds: the broker rounds up (MQTT-3.3.2-6) and the file
        # keeps whole-second wall times: 1 s of slack
        if t_ref is not None and left > math.ceil(exp - (t_recv - t_ref)) + 1:
            problems.append("%s: remaining expiry %d > %d - %.1f s elapsed (E4)"
                            % (topic, left, exp, t_recv - t_ref))
        if left < math.floor(exp - (t_recv - t_sent)) - 2:
            problems.append("%s: remaining expiry %d < %d - %.1f s: dies early"
                            % (topic, left, exp, t_recv - t_sent))
    missing = sorted(set(h["acked"]) - seen)
    assert not problems and not missing, (
        "%d problems after SIGKILL + restart, e.g. %r; acked but not delivered: %r"
        % (len(problems), problems[:10], missing[:10])
    )
    return len(got)


@FLASH
@pytest.mark.timeout(120)
def test_sigkill_mid_stream_keeps_every_acked_value_no_torn_record_durability_S8_E4(
    broker_factory, tmp_path, storage
):
    """Durability / S8 / S6 / E4: a 5.0 publisher sends 6 values to each of
    300 topics (retained QoS 1, Content Type, User Properties, Message
    Expiry on two thirds of them), 16 in flight; the broker is SIGKILLed
    from another thread after 45% of the PUBACKs while the stream goes on
    (the store has compacted by then). It is restarted 2 s later on the
    same data dir, a second stream of 6 values per topic follows and is
    killed after 70% of its PUBACKs, and the broker is restarted again.
    Each time:

    - the file left behind (read with edgestore's reader) already holds,
      for every topic, the last acknowledged value or a later one (the
      PUBACK waited for the write);
    - a '#' subscriber of the restarted broker gets for every topic with an
      acknowledged value exactly one message: that value or a later one
      that was in flight, never an older one, never a garbled payload, with
      the properties of that very value, RETAIN=1, QoS 1, and a remaining
      Message Expiry no larger than the original minus the time since its
      PUBACK (E4: the host's wall clock is set, so the downtime counts) and
      not shorter than the real remainder; no unknown topic, no duplicate.

    (SIGKILL ends the process between two write() calls, so it tests what
    the broker acknowledged, not torn records: power cuts at every byte are
    test_store_crash.py's job.)"""
    h = {"acked": {}, "ack_time": {}, "sent": {}, "send_time": {}, "dead_time": {}}
    b = broker_factory(storage_type=storage, **BIG)
    KillMidStream(b, range(0, 6), int(N_TOPICS * 6 * 0.45), h).run()
    check_file_after_kill(store_path(b), h, tmp_path)
    time.sleep(2.0)  # downtime: counts against expiry (E4, wall clock set)
    b2 = broker_factory(storage_type=storage, **BIG)
    check_restarted(b2.port, h)
    KillMidStream(b2, range(6, 12), int(N_TOPICS * 6 * 0.7), h).run()
    check_file_after_kill(store_path(b2), h, tmp_path)
    b3 = broker_factory(storage_type=storage, **BIG)
    assert check_restarted(b3.port, h) == N_TOPICS
    assert b3.stop() == 0


# ---------------------------------------------------------------------------
# b. restart (S8) and expiry across it (E4)


S6_PROPS = (
    prop_byte(PAYLOAD_FORMAT_INDICATOR, 1)
    + prop_str(CONTENT_TYPE, "application/json")
    + prop_str(RESPONSE_TOPIC, "s8/reply")
    + prop_bin(CORRELATION_DATA, b"\x00\xffcorr")
    + prop_pair("k", "v1")
    + prop_pair("a", "b")
    + prop_pair("k", "v0")
)


def check_s6_props(p):
    assert p.get(PAYLOAD_FORMAT_INDICATOR) == 1
    assert p.get(CONTENT_TYPE) == "application/json"
    assert p.get(RESPONSE_TOPIC) == "s8/reply"
    assert p.get(CORRELATION_DATA) == b"\x00\xffcorr"
    assert p.get(USER_PROPERTY) == [("k", "v1"), ("a", "b"), ("k", "v0")]


@pytest.mark.parametrize("storage", ["ram", "disc", "disc_only"])
def test_retained_survive_clean_restart_with_qos_and_properties_S8_S6(
    broker_factory, storage
):
    """S8 (with S1, S3, S6): retained messages published by paho (5.0, QoS
    0/1/2, all forwarded properties), mosquitto_pub (3.1.1) and a raw client
    - one replaced, one deleted - are all there after a clean stop (SIGINT)
    and restart on the same data dir, with their QoS and properties; the
    restarted store keeps working (replace, delete, add) and a second
    restart shows exactly those changes. storage_type "ram" is the control:
    it is RAM only, so nothing survives (docs/retained.md, "Storage types")."""
    b = broker_factory(storage_type=storage)
    paho = paho_client(b.port, "s8-paho", protocol=5)
    props = {
        "PayloadFormatIndicator": 1,
        "ContentType": "application/json",
        "ResponseTopic": "s8/reply",
        "CorrelationData": b"\x00\xffcorr",
        "UserProperty": [("k", "v1"), ("a", "b"), ("k", "v0")],
    }
    for qos in (0, 1, 2):
        paho.publish_wait("s8/paho/q%d" % qos, b'{"q": %d}' % qos, qos=qos, retain=True,
                          properties=props)
    paho.publish_wait("s8/paho/gone", b"x", qos=1, retain=True)
    paho.publish_wait("s8/paho/gone", b"", qos=1, retain=True)  # S3: deletes
    paho.disconnect()
    mosquitto_pub(b.port, ["-t", "s8/mosq", "-m", "from-mosquitto", "-q", "1", "-r"], version=4)
    raw = raw_connect(b.port, "s8-raw", version=5)
    raw.publish("s8/raw", b"old", qos=2, retain=True, pid=1)
    raw.publish("s8/raw", b"new", qos=1, retain=True, pid=2, props=S6_PROPS)  # S1: replaces
    raw.publish("s8/q0", b"qos0", qos=0, retain=True)
    raw.ping()
    raw.disconnect()
    before, _ = retained_now(b.port, "s8/#")
    assert b.stop() == 0
    b2 = broker_factory(storage_type=storage)
    after, _ = retained_now(b2.port, "s8/#")
    if storage == "ram":
        assert len(before) == 6 and after == []
        return
    expect = {
        "s8/paho/q0": (b'{"q": 0}', 0),
        "s8/paho/q1": (b'{"q": 1}', 1),
        "s8/paho/q2": (b'{"q": 2}', 2),
        "s8/mosq": (b"from-mosquitto", 1),
        "s8/raw": (b"new", 1),
        "s8/q0": (b"qos0", 0),
    }
    for got in (before, after):
        assert {m.topic: (m.payload, m.qos) for m in got} == expect
        assert len(got) == len(expect) and all(m.retain for m in got)
        for m in got:
            if m.topic.startswith("s8/paho/q") or m.topic == "s8/raw":
                check_s6_props(m.props)
            else:
                assert USER_PROPERTY not in m.props and CONTENT_TYPE not in m.props
    # the reopened store goes on: replace, delete, add; a second restart keeps that
    c = raw_connect(b2.port, "s8-raw2", version=5)
    c.publish("s8/raw", b"newer", qos=1, retain=True, pid=1)
    c.publish("s8/mosq", b"", qos=2, retain=True, pid=2)
    c.publish("s8/added", b"added", qos=2, retain=True, pid=3)
    c.disconnect()
    assert b2.stop() == 0
    b3 = broker_factory(storage_type=storage)
    third, _ = retained_now(b3.port, "s8/#")
    expect.pop("s8/mosq")
    expect["s8/raw"] = (b"newer", 1)
    expect["s8/added"] = (b"added", 2)
    assert {m.topic: (m.payload, m.qos) for m in third} == expect
    assert len(third) == len(expect)


@FLASH
@pytest.mark.parametrize("how", ["sigint", "sigkill"])
@pytest.mark.timeout(60)
def test_expiry_counts_downtime_across_restart_with_wall_clock_E4(
    broker_factory, storage, how
):
    """E4 with the wall clock set (the host's): a retained message with a
    2 s Message Expiry is published (PUBACK received), the broker is
    stopped (SIGINT) or killed (SIGKILL), and restarted 3 s after the
    publish: it is not delivered. One with 3600 s is, with a remaining
    expiry no larger than 3600 minus the time since its PUBACK (whole
    seconds) and not below the real remainder; one without an expiry is
    delivered without one."""
    b = broker_factory(storage_type=storage)
    pub = raw_connect(b.port, "e4w-pub", version=5)
    t_send = time.monotonic()
    pub.publish("e4w/short", b"s", qos=1, retain=True, pid=1,
                props=prop_u32(MESSAGE_EXPIRY_INTERVAL, 2))
    pub.publish("e4w/long", b"l", qos=1, retain=True, pid=2,
                props=prop_u32(MESSAGE_EXPIRY_INTERVAL, 3600))
    pub.publish("e4w/none", b"n", qos=1, retain=True, pid=3)
    t_ack = time.monotonic()
    pub.close()
    stop_or_kill(b, how)
    time.sleep(max(0.0, t_send + 3.0 - time.monotonic()))
    b2 = broker_factory(storage_type=storage)
    got, _ = retained_now(b2.port, "e4w/#")
    t_recv = time.monotonic()
    by = {m.topic: m for m in got}
    assert sorted(by) == ["e4w/long", "e4w/none"], (
        "after %.1f s (2 s lifetime, %s, restart): %r" % (t_recv - t_send, how, sorted(by)))
    left = by["e4w/long"].props.get(MESSAGE_EXPIRY_INTERVAL)
    assert left is not None
    assert left <= math.ceil(3600 - (t_recv - t_ack)) + 1, (left, t_recv - t_ack)
    assert left >= math.floor(3600 - (t_recv - t_send)) - 2, (left, t_recv - t_send)
    assert MESSAGE_EXPIRY_INTERVAL not in by["e4w/none"].props


NO_WALL_CLOCK = """\
# edgebroker with a board clock that was never set (no NTP): its wall clock
# function returns None, as the firmware's does before NTP (E4).
import sys
sys.path.insert(0, %r)
import edgebroker
edgebroker._wallclock = lambda: None
edgebroker.main(["edgebroker.py"] + sys.argv[1:])
"""


@pytest.fixture
def no_clock_script(tmp_path):
    p = tmp_path / "edgebroker_no_clock.py"
    p.write_text(NO_WALL_CLOCK % str(REPO / "lib"))
    return str(p)


@FLASH
@pytest.mark.timeout(60)
def test_expiry_without_wall_clock_outlives_lifetime_by_at_most_the_downtime_E4(
    broker_factory, storage, no_clock_script
):
    """E4 without a wall clock (the broker's wall clock returns None, as on
    a board that never got NTP; the documented choice: only running time
    counts, so a message may outlive its lifetime by at most the downtime,
    never die early). A 3 s and a 3600 s message are published, the broker
    is stopped cleanly 0.5 s later and restarted after 2 s off:

    - at once: the 3600 s message is delivered with a remaining expiry no
      larger than 3600 minus the running time before the stop (+1 s for
      whole seconds) and not below the real remainder; the 3 s one may be
      there (the downtime is unknown), with at most 3 s minus that running
      time left;
    - once its lifetime plus the measured downtime (SIGINT to listening
      again) plus 1.2 s (whole seconds) has passed: the 3 s one is gone."""
    b = broker_factory(storage_type=storage, script=no_clock_script)
    pub = raw_connect(b.port, "e4n-pub", version=5)
    t_send = time.monotonic()
    pub.publish("e4n/short", b"s", qos=1, retain=True, pid=1,
                props=prop_u32(MESSAGE_EXPIRY_INTERVAL, 3))
    pub.publish("e4n/long", b"l", qos=1, retain=True, pid=2,
                props=prop_u32(MESSAGE_EXPIRY_INTERVAL, 3600))
    t_ack = time.monotonic()
    pub.disconnect()
    time.sleep(0.5)
    t_stop = time.monotonic()
    assert b.stop() == 0
    ran = t_stop - t_ack  # at least this much running time passed after the PUBACK
    time.sleep(2.0)
    b2 = broker_factory(storage_type=storage, script=no_clock_script)
    t_up = time.monotonic()
    down = t_up - t_stop  # an upper bound of the time the store was closed
    got, _ = retained_now(b2.port, "e4n/#", wait=0.3)
    t_recv = time.monotonic()
    by = {m.topic: m for m in got}
    assert "e4n/long" in by, sorted(by)
    left = by["e4n/long"].props[MESSAGE_EXPIRY_INTERVAL]
    assert left <= math.ceil(3600 - ran) + 1, (left, ran)
    assert left >= math.floor(3600 - (t_recv - t_send)) - 2, (left, t_recv - t_send)
    if "e4n/short" in by:
        short = by["e4n/short"].props[MESSAGE_EXPIRY_INTERVAL]
        assert short <= math.ceil(3 - ran) + 1, (short, ran)
    time.sleep(max(0.0, t_ack + 3 + down + 1.2 - time.monotonic()))
    got, _ = retained_now(b2.port, "e4n/#", wait=0.3)
    assert sorted(m.topic for m in got) == ["e4n/long"], (
        "%.1f s after the publish (3 s lifetime + %.1f s downtime): %r"
        % (time.monotonic() - t_send, down, sorted(m.topic for m in got)))


@FLASH
@pytest.mark.parametrize(
    "clock,how", [("wall", "sigkill"), ("none", "sigkill"), ("none", "sigint")]
)
@pytest.mark.timeout(60)
def test_message_expired_while_running_stays_expired_after_restart_E4_E1(
    broker_factory, storage, clock, how, no_clock_script
):
    """E4 + E1: a retained message with a 2 s Message Expiry expires while
    the broker runs (a new subscriber 3.5 s later does not get it); the
    broker is then SIGKILLed or stopped cleanly (SIGINT) and restarted at
    once (downtime well under 1 s). The message must not come back: it is
    already past its lifetime by more than the downtime. With the wall
    clock set (clock=wall) and without (clock=none: the broker's wall clock
    returns None, as on a board without NTP)."""
    script = no_clock_script if clock == "none" else None
    b = broker_factory(storage_type=storage, script=script)
    pub = raw_connect(b.port, "e4k-pub", version=5)
    t_send = time.monotonic()
    pub.publish("e4k/short", b"s", qos=1, retain=True, pid=1,
                props=prop_u32(MESSAGE_EXPIRY_INTERVAL, 2))
    pub.publish("e4k/keep", b"k", qos=1, retain=True, pid=2)
    pub.disconnect()
    time.sleep(max(0.0, t_send + 3.5 - time.monotonic()))
    running, _ = retained_now(b.port, "e4k/#", wait=0.3)
    assert sorted(m.topic for m in running) == ["e4k/keep"]  # E1 while running
    t_kill = time.monotonic()
    stop_or_kill(b, how)
    b2 = broker_factory(storage_type=storage, script=script)
    down = time.monotonic() - t_kill
    got, _ = retained_now(b2.port, "e4k/#", wait=0.3)
    late = time.monotonic() - t_send - 2
    assert sorted(m.topic for m in got) == ["e4k/keep"], (
        "a message that had expired while the broker ran (%.1f s before the stop) is "
        "delivered again after a restart: %.1f s past its 2 s lifetime with "
        "%.1f s of downtime (E4: never more than the downtime; E1); got %r"
        % (t_kill - t_send - 2, late, down,
           [(m.topic, m.props.get(MESSAGE_EXPIRY_INTERVAL)) for m in got]))


# ---------------------------------------------------------------------------
# c. limits with a flash store: L2, L3, L4, before and after a restart


@FLASH
def test_max_retained_messages_on_flash_before_and_after_restart_L2(broker_factory, storage):
    """L2 with a flash store, max_retained_messages=3: a 4th topic is
    forwarded to live subscribers but not stored; a stored topic can be
    replaced and deleted, and a deletion frees a place. After a clean
    restart the same three are there and the limit still counts them (a
    new topic is refused, a replacement is not); after a SIGKILL and
    restart the replacement is there too."""
    b = broker_factory(storage_type=storage, max_retained_messages=3)
    live = subscriber(b.port, "l2/#", 1, version=5, client_id="l2live")
    pub = raw_connect(b.port, "l2pub", version=5)
    for i in range(1, 5):
        assert pub.publish("l2/%d" % i, b"v1", qos=1, retain=True, pid=i) == 0
    assert [m.topic for m in recv_publishes(live, 4)] == ["l2/1", "l2/2", "l2/3", "l2/4"]
    assert sorted(topics_payloads(retained_now(b.port, "l2/#")[0])) == ["l2/1", "l2/2", "l2/3"]
    pub.publish("l2/1", b"v2", qos=1, retain=True, pid=5)  # replace: allowed
    pub.publish("l2/2", b"", qos=1, retain=True, pid=6)  # delete: allowed
    pub.publish("l2/5", b"v1", qos=1, retain=True, pid=7)  # fits again
    pub.publish("l2/6", b"v1", qos=1, retain=True, pid=8)  # full again
    expect = {"l2/1": b"v2", "l2/3": b"v1", "l2/5": b"v1"}
    assert topics_payloads(retained_now(b.port, "l2/#")[0]) == expect
    live.disconnect()
    pub.disconnect()
    assert b.stop() == 0
    b2 = broker_factory(storage_type=storage, max_retained_messages=3)
    assert topics_payloads(retained_now(b2.port, "l2/#")[0]) == expect
    live = subscriber(b2.port, "l2/#", 0x21, version=5, client_id="l2live2")  # Retain Handling 2
    pub = raw_connect(b2.port, "l2pub2", version=5)
    pub.publish("l2/7", b"v1", qos=1, retain=True, pid=1)  # full after the restart too
    pub.publish("l2/3", b"v3", qos=1, retain=True, pid=2)  # replace: allowed
    assert [(m.topic, m.payload) for m in recv_publishes(live, 2)] == [
        ("l2/7", b"v1"), ("l2/3", b"v3")]
    expect["l2/3"] = b"v3"
    assert topics_payloads(retained_now(b2.port, "l2/#")[0]) == expect
    pub.close()
    live.close()
    b2.kill()
    b3 = broker_factory(storage_type=storage, max_retained_messages=3)
    assert topics_payloads(retained_now(b3.port, "l2/#")[0]) == expect


@FLASH
def test_max_payload_size_on_flash_forwarded_not_stored_old_value_dropped_durably_L3(
    broker_factory, storage, tmp_path
):
    """L3 with a flash store, max_payload_size=100: a 101-byte retained
    message (QoS 1 and QoS 0) is forwarded to live subscribers but not
    stored, and the topic's older stored value is dropped - on the file as
    well by the time of the PUBACK (durability), so that after a SIGKILL and
    a restart the old value does not come back; a 100-byte one is stored."""
    b = broker_factory(storage_type=storage, max_payload_size=100)
    live = subscriber(b.port, "l3/#", 1, version=5, client_id="l3live")
    pub = raw_connect(b.port, "l3pub", version=5)
    pub.publish("l3/t", b"small", qos=1, retain=True, pid=1)
    pub.publish("l3/u", b"x" * 100, qos=1, retain=True, pid=2)  # exactly the limit: stored
    pub.publish("l3/v", b"old-v", qos=1, retain=True, pid=3)
    assert sorted(topics_payloads(retained_now(b.port, "l3/#")[0])) == ["l3/t", "l3/u", "l3/v"]
    pub.publish("l3/t", b"L" * 101, qos=1, retain=True, pid=4)
    assert "l3/t" not in stored_values(store_path(b), tmp_path), (
        "PUBACK of an oversized retained PUBLISH came before its old value was "
        "dropped from the file")
    pub.publish("l3/v", b"Q" * 101, qos=0, retain=True)
    pub.ping()
    got = recv_publishes(live, 5)
    assert [(m.topic, len(m.payload)) for m in got] == [
        ("l3/t", 5), ("l3/u", 100), ("l3/v", 5), ("l3/t", 101), ("l3/v", 101)]
    assert sorted(topics_payloads(retained_now(b.port, "l3/#")[0])) == ["l3/u"]
    pub.publish("l3/marker", b"m", qos=1, retain=True, pid=5)  # commits the QoS 0 drop too
    live.close()
    pub.close()
    b.kill()
    b2 = broker_factory(storage_type=storage, max_payload_size=100)
    assert topics_payloads(retained_now(b2.port, "l3/#")[0]) == {
        "l3/u": b"x" * 100, "l3/marker": b"m"}
    # and the limit holds after the restart: the old value goes again
    pub = raw_connect(b2.port, "l3pub2", version=5)
    pub.publish("l3/u", b"y" * 150, qos=1, retain=True, pid=1)
    assert topics_payloads(retained_now(b2.port, "l3/#")[0]) == {"l3/marker": b"m"}
    pub.disconnect()
    assert b2.stop() == 0
    b3 = broker_factory(storage_type=storage, max_payload_size=100)
    assert topics_payloads(retained_now(b3.port, "l3/#")[0]) == {"l3/marker": b"m"}


@FLASH
def test_store_budget_bytes_on_flash_before_and_after_restart_L4(broker_factory, storage):
    """L4 with a flash store, store_budget_bytes=1000 and 200-byte payloads:
    at most 4 are stored, the rest forwarded but not stored (as L2). After a
    restart the same set is there, $SYS retained/count and retained/bytes
    are what they were (the budget is counted from the file) and still at
    most 1000, a new topic is still refused, and a deletion frees room."""
    kw = {"storage_type": storage, "store_budget_bytes": 1000, "sys_interval": 1}
    b = broker_factory(**kw)
    live = subscriber(b.port, "l4/#", 1, version=5, client_id="l4live")
    pub = raw_connect(b.port, "l4pub", version=5)
    for i in range(10):
        pub.publish("l4/%d" % i, (b"%d" % i) * 200, qos=1, retain=True, pid=i + 1)
    assert len(recv_publishes(live, 10)) == 10
    stored = topics_payloads(retained_now(b.port, "l4/#")[0])
    assert 1 <= len(stored) <= 4, sorted(stored)
    w = SysWatcher(b.port)
    try:
        v = w.wait(lambda v: sys_int(v, "retained/count") == len(stored), timeout=3.5)
        count, nbytes = sys_int(v, "retained/count"), sys_int(v, "retained/bytes")
        assert 0 < nbytes <= 1000
    finally:
        w.close()
    live.close()
    pub.close()
    assert b.stop() == 0
    b2 = broker_factory(**kw)
    assert topics_payloads(retained_now(b2.port, "l4/#")[0]) == stored
    w = SysWatcher(b2.port)
    try:
        v = w.wait(lambda v: sys_int(v, "retained/count") is not None, timeout=3.5)
        assert (sys_int(v, "retained/count"), sys_int(v, "retained/bytes")) == (count, nbytes)
    finally:
        w.close()
    pub = raw_connect(b2.port, "l4pub2", version=5)
    pub.publish("l4/new", b"N" * 200, qos=1, retain=True, pid=1)  # still full
    assert topics_payloads(retained_now(b2.port, "l4/#")[0]) == stored
    first = sorted(stored)[0]
    pub.publish(first, b"", qos=1, retain=True, pid=2)  # frees room
    pub.publish("l4/new", b"N" * 200, qos=1, retain=True, pid=3)
    expect = dict(stored)
    del expect[first]
    expect["l4/new"] = b"N" * 200
    assert topics_payloads(retained_now(b2.port, "l4/#")[0]) == expect
    pub.close()
    b2.kill()
    b3 = broker_factory(**kw)
    assert topics_payloads(retained_now(b3.port, "l4/#")[0]) == expect


# ---------------------------------------------------------------------------
# d. D9 at scale: 20,000 retained messages, Receive Maximum 10, slow reader

D9_N = 20000
D9_WINDOW = 10


def load_retained_fast(port, n, prefix):
    """n retained QoS 1 messages on distinct topics, 16 in flight (the
    broker's Receive Maximum); QoS 1 so that the delivery is paced by the
    subscriber's Receive Maximum (a QoS 0 retained message is delivered at
    QoS 0, D2, and would not be)."""
    c = raw_connect(port, "d9-load", version=5)
    items = [("%s%05d" % (prefix, i), b"v%05d" % i, b"") for i in range(n)]
    assert sliding_publish(c, items, window=16, timeout=90) == n
    c.disconnect()


@pytest.mark.parametrize("storage", ["ram", "disc", "disc_only"])
@pytest.mark.timeout(120)
def test_20000_retained_to_slow_receive_maximum_10_subscriber_with_live_traffic_D9(
    broker_factory, interp, storage
):
    """D9 at scale: 20,000 retained QoS 1 messages on distinct topics reach
    a 5.0 '#' subscriber with Receive Maximum 10 that reads slowly (it
    holds the window full, sleeps 1 ms, then acks half of it; twice it
    stops reading for 0.5 s), each exactly once with RETAIN=1 and QoS 1,
    never more than 10 unacknowledged (MQTT-3.3.4-9), while 49 live QoS 1
    messages published to it during the delivery arrive each once with
    RETAIN=0, each within 50 retained messages of its PUBACK to the
    publisher (live traffic goes first, the retained set waits). Bounded:
    delivery within 60 s.

    Under MicroPython, ram and disc (a RAM copy of every message, ~350 B
    each) get a 16 MB heap: the unix port's 2 MB default holds ~5,400 such
    messages (measured), disc_only holds 20,000 in its default heap."""
    heap = "16m" if interp == "micropython" and storage != "disc_only" else None
    b = broker_factory(heap=heap, storage_type=storage, **BIG)
    load_retained_fast(b.port, D9_N, "d9/")
    pub = raw_connect(b.port, "d9-live", version=5)
    sub = raw_connect(b.port, "d9-sub", version=5, props=prop_u16(RECEIVE_MAXIMUM, D9_WINDOW))
    sub.send(subscribe_packet(1, [("#", 1)]))
    assert sub.expect_suback()[1] == [1]
    t0 = time.monotonic()
    seen = {}
    live_got = {}
    live_sent = {}  # live topic -> number of retained received when its PUBACK came
    outstanding = []
    dup = []
    not_retained = []
    live_pid = 0

    def publish_live(k):
        nonlocal live_pid
        live_pid += 1
        pub.publish("live/%02d" % k, b"now", qos=1, pid=live_pid)
        live_sent["live/%02d" % k] = len(seen)

    while len(seen) < D9_N or len(live_got) < len(live_sent) or len(live_sent) < 49:
        assert time.monotonic() - t0 < 60, "D9: %d of %d retained, %d of %d live in 60 s" % (
            len(seen), D9_N, len(live_got), len(live_sent))
        m = sub.expect_publish(10)
        outstanding.append(m.pid)
        assert m.qos == 1, m
        assert len(outstanding) <= D9_WINDOW, "more than Receive Maximum unacknowledged"
        if m.topic.startswith("live/"):
            if m.retain:
                not_retained.append(m.topic)
            live_got[m.topic] = len(seen)
        else:
            if m.topic in seen:
                dup.append(m.topic)
            if not m.retain:
                not_retained.append(m.topic)
            seen[m.topic] = len(seen)
            n = len(seen)
            if n % 1000 == 0 and n < D9_N:
                publish_live(len(live_sent))
                if n == 10000:
                    for _ in range(30):
                        publish_live(len(live_sent))
            if n in (5000, 15000):
                time.sleep(0.5)  # not reading at all for a while
        if len(outstanding) == D9_WINDOW or len(seen) == D9_N:
            time.sleep(0.001)
            k = len(outstanding) // 2 if len(seen) < D9_N else len(outstanding)
            sub.send(b"".join(puback(p) for p in outstanding[:k]))
            del outstanding[:k]
    sub.send(b"".join(puback(p) for p in outstanding))
    elapsed = time.monotonic() - t0
    assert not dup and not not_retained, (dup[:5], not_retained[:5])
    assert sorted(seen) == ["d9/%05d" % i for i in range(D9_N)]
    assert sorted(live_got) == sorted(live_sent)
    late = {t: live_got[t] - live_sent[t] for t in live_sent if live_got[t] - live_sent[t] > 50}
    assert not late, "live messages held behind the retained set: %r" % late
    assert sub.no_publish(0.3), "more than the set"
    sub.disconnect()
    pub.disconnect()
    print("D9 %s/%s: 20,000 retained + 49 live in %.1f s" % (interp, storage, elapsed))


def hold_window(sub, n_retained, window, prefix):
    """Reads retained PUBLISHes, acknowledging all but the last ``window``,
    until ``n_retained`` have arrived: the window is then full and the
    broker must hold the rest. Returns {topic: payload} received."""
    got = {}
    outstanding = []
    while len(got) < n_retained:
        m = sub.expect_publish(10)
        assert m.retain and m.topic.startswith(prefix) and m.topic not in got, m
        got[m.topic] = m.payload
        outstanding.append(m.pid)
        if len(outstanding) > window:
            raise AssertionError("more than Receive Maximum %d unacknowledged" % window)
        if len(outstanding) == window and len(got) < n_retained:
            sub.send(puback(outstanding.pop(0)))
    assert sub.no_publish(0.2), "a PUBLISH beyond the window"
    return got, outstanding


@FLASH
@pytest.mark.timeout(90)
def test_compaction_during_paced_delivery_keeps_every_topic_once_D9_S1_S3(
    broker_factory, storage, tmp_path
):
    """D9 with a flash store that compacts under a paced delivery: 3,000
    retained messages go to a '#' subscriber (Receive Maximum 5, No Local);
    after 500 it holds its window full and, on the same connection (so No
    Local keeps the live copies away from it), rewrites every topic twice
    and deletes every tenth one (S1, S3): 6,300 changes, enough for the
    store to compact (checked on the file). It then acknowledges and reads
    on: every topic not deleted and not yet delivered arrives exactly once
    with RETAIN=1 and the last value, deleted ones do not arrive (at most
    one message may have been taken from the store before the change)."""
    n, window = 3000, 5
    # a board sets max_retained_messages: the index is then allocated at open
    b = broker_factory(storage_type=storage, max_retained_messages=n,
                       store_budget_bytes=64 * 1024 * 1024)
    topics = ["cd/%02d/%04d" % (i % 40, i) for i in range(n)]
    c = raw_connect(b.port, "cd-load", version=5)
    sliding_publish(c, [(t, b"v0", b"") for t in topics])
    c.disconnect()
    size_before = store_path(b).stat().st_size
    sub = raw_connect(b.port, "cd-sub", version=5, props=prop_u16(RECEIVE_MAXIMUM, window))
    sub.send(subscribe_packet(1, [("#", 0x05)]))  # QoS 1, No Local
    assert sub.expect_suback()[1] == [1]
    before, outstanding = hold_window(sub, 500, window, "cd/")
    ahead = [t for t in topics if t not in before]
    deleted = set(ahead[::10])
    changes = [(t, b"v1", b"") for t in ahead] + [(t, b"v2", b"") for t in ahead]
    changes += [(t, b"", b"") for t in sorted(deleted)]
    sliding_publish(sub, changes)  # PUBLISHes arriving meanwhile are stashed, not acked
    rep = store_report.inspect(es, str(store_path(b)))
    assert rep["records"] < n + len(changes) and rep["file_bytes"] < size_before * 2, (
        "no compaction happened: %d records, %d bytes" % (rep["records"], rep["file_bytes"]))
    for pid in outstanding:
        sub.send(puback(pid))
    after = drain_publishes(sub, 1.0)
    assert all(m.retain for m in after), [m.topic for m in after if not m.retain][:5]
    dup = [m.topic for m in after if m.topic in before]
    counts = {}
    for m in after:
        counts[m.topic] = counts.get(m.topic, 0) + 1
    twice = [t for t, k in counts.items() if k > 1]
    stale = [(m.topic, m.payload) for m in after if m.topic in deleted or m.payload != b"v2"]
    missing = sorted(set(ahead) - deleted - set(counts))
    assert not dup and not twice and not missing and len(stale) <= 1, (
        "after compaction under the delivery: delivered again %r, twice %r, never %r, "
        "stale %r" % (dup[:5], twice[:5], missing[:5], stale[:5]))
    sub.disconnect()


@pytest.mark.parametrize("storage", ["ram", "disc_only"])
@pytest.mark.timeout(60)
def test_live_queue_overflow_never_drops_a_pending_retained_message_D9(broker_factory, storage):
    """D9 (docs/retained.md: every matching message is delivered): a
    '#' subscriber with Receive Maximum 5 holds its window full after 100
    of 1,000 retained messages; meanwhile 200 live QoS 1 messages are
    published to it, more than its session queue holds (max_queued=64:
    flow control holds the publisher at half of it; before flow control the
    oldest queued live messages were dropped). When it acknowledges and
    reads on, all 1,000 retained topics arrive: live traffic filling the
    queue must not take a retained message that was waiting for the window
    with it."""
    b = broker_factory(storage_type=storage, max_queued=64, **BIG)
    n, window = 1000, 5
    topics = ["qo/%04d" % i for i in range(n)]
    c = raw_connect(b.port, "qo-load", version=5)
    sliding_publish(c, [(t, b"r", b"") for t in topics])
    sub = raw_connect(b.port, "qo-sub", version=5, props=prop_u16(RECEIVE_MAXIMUM, window))
    sub.send(subscribe_packet(1, [("#", 1)]))
    assert sub.expect_suback()[1] == [1]
    before, outstanding = hold_window(sub, 100, window, "qo/")
    # sent without waiting for the PUBACKs: flow control holds them back
    c.send(b"".join(publish_packet("live/%03d" % k, b"now", qos=1, pid=k + 1)
                    for k in range(200)))
    time.sleep(0.3)
    for pid in outstanding:
        sub.send(puback(pid))
    after = drain_publishes(sub, 1.0)
    retained = {m.topic for m in after if m.retain} | set(before)
    live = [m.topic for m in after if not m.retain]
    missing = sorted(set(topics) - retained)
    assert not missing, (
        "retained messages never delivered after the session queue overflowed with live "
        "traffic (%d live delivered of 200): %r" % (len(live), missing[:10]))
    sub.disconnect()
    c.disconnect()


# ---------------------------------------------------------------------------
# e. durability ordering: the ack comes after the record is in the file


@FLASH
def test_retained_ack_only_after_record_is_in_the_file_durability(
    broker_factory, storage, tmp_path
):
    """Durability (docs/retained.md): with disc and disc_only, right
    after each PUBACK (QoS 1) or PUBREC (QoS 2, before PUBREL) of a retained
    PUBLISH, the store file read with edgestore's reader already holds that
    value (or a later one); after the PUBACK of an empty retained PUBLISH
    (S3) the topic is gone from the file. Pipelined too: 16 PUBLISHes on
    distinct topics in one write, each PUBACK checked as it comes."""
    b = broker_factory(storage_type=storage)
    path = store_path(b)
    pub = raw_connect(b.port, "dur-pub", version=5)
    bad = []
    pid = 0
    for k in range(40):
        topic = "dur/%d" % (k % 5)
        payload = b"value-%03d" % k
        qos = 1 + k % 2
        pid += 1
        pub.send(publish_packet(topic, payload, qos=qos, retain=True, pid=pid,
                                props=prop_str(CONTENT_TYPE, "k%d" % k)))
        rpid, reason, _ = pub.expect_ack(PUBACK if qos == 1 else PUBREC)
        assert (rpid, reason) == (pid, 0)
        on_file = stored_values(path, tmp_path).get(topic)
        if on_file is None or on_file[-1] != payload:
            bad.append((topic, payload, on_file and on_file[-1]))
        if qos == 2:
            pub.send(pubrel(pid))
            pub.expect_ack(PUBCOMP)
    assert not bad, "acknowledged before the value was in the file: %r" % bad[:5]
    for k in range(5):
        pid += 1
        topic = "dur/%d" % k
        assert pub.publish(topic, b"", qos=1, retain=True, pid=pid) == 0
        assert topic not in stored_values(path, tmp_path), (
            "PUBACK of a retained delete before the deletion was in the file")
    # pipelined: 16 at once (the broker's Receive Maximum)
    data = bytearray()
    want = {}
    for k in range(16):
        pid += 1
        want[pid] = ("durp/%02d" % k, b"p%02d" % k)
        data += publish_packet(want[pid][0], want[pid][1], qos=1, retain=True, pid=pid)
    pub.send(data)
    for _ in range(16):
        rpid, reason, _ = pub.expect_ack(PUBACK)
        topic, payload = want.pop(rpid)
        on_file = stored_values(path, tmp_path).get(topic)
        assert on_file is not None and on_file[-1] == payload, (
            "pipelined PUBACK %d for %s before the value was in the file" % (rpid, topic))
    pub.disconnect()

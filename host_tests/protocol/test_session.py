"""Sessions: Clean Session / Clean Start, Session Expiry, session present,
offline queue, resend of unacknowledged messages, takeover, expiry."""

import time

import pytest
from mqtt_helpers import (
    DISCONNECT,
    PUBLISH,
    PUBREL,
    SESSION_EXPIRY_INTERVAL,
    disconnect_packet,
    mosquitto_pub,
    paho_client,
    parse_disconnect,
    parse_publish,
    prop_u32,
    puback,
    pubcomp,
    pubrec,
    raw_connect,
    requires_edgebroker,
    wait_for,
)


def persistent(port, cid, version, expiry=60, **kw):
    """Connect with a session that outlives the connection (3.1.1 clean=0,
    5.0 Clean Start 0 + Session Expiry Interval)."""
    props = prop_u32(SESSION_EXPIRY_INTERVAL, expiry) if version == 5 else b""
    return raw_connect(port, cid, version=version, clean=False, props=props, **kw)


def publish_acked(port, topic, payloads, qos=1, retain=False):
    """Publish with a separate 5.0 client, waiting for each acknowledgement."""
    p = raw_connect(port, "", version=5)
    for i, pl in enumerate(payloads):
        p.publish(topic, pl, qos=qos, pid=i + 1 if qos else None, retain=retain)
    p.disconnect()


VERSIONS = pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])


# ---------------------------------------------------------------------------
# session present / clean start


@VERSIONS
def test_session_present_and_subscriptions_survive_reconnect_MQTT_3_2_2_2(broker, version):
    """Reconnecting to an existing session: CONNACK session present = 1
    (MQTT-3.2.2-2 / 5.0 MQTT-3.2.2-2) and the subscription still works
    without re-subscribing."""
    c = persistent(broker.port, "keep-%d" % version, version)
    assert not c.connack.session_present
    assert c.subscribe([("keep/t", 1)]) == [1]
    c.disconnect()
    c = persistent(broker.port, "keep-%d" % version, version)
    assert c.connack.session_present
    publish_acked(broker.port, "keep/t", [b"after-reconnect"])
    m = c.expect_publish()
    assert m.payload == b"after-reconnect"
    c.send(puback(m.pid, version))
    c.disconnect()


@VERSIONS
def test_clean_start_discards_existing_session_MQTT_3_1_2_4(broker, version):
    """Clean Session / Clean Start = 1 discards the previous session:
    session present 0 (MQTT-3.2.2-1) and the old subscription is gone
    (3.1.1 MQTT-3.1.2-6, 5.0 MQTT-3.1.2-4)."""
    cid = "clean-%d" % version
    c = persistent(broker.port, cid, version)
    assert c.subscribe([("clean/t", 1)]) == [1]
    c.disconnect()
    c = raw_connect(broker.port, cid, version=version, clean=True)
    assert not c.connack.session_present
    publish_acked(broker.port, "clean/t", [b"nobody"])
    assert c.no_publish(0.4)
    c.disconnect()
    if version == 4:
        # the clean session ended at disconnect: nothing to resume
        c = persistent(broker.port, cid, version)
        assert not c.connack.session_present
        c.disconnect()


def test_session_expiry_zero_ends_session_at_disconnect_MQTT_3_1_2_23(broker):
    """5.0: Clean Start 0 without Session Expiry Interval (= 0): the session
    ends when the connection closes; no session present on reconnect."""
    c = raw_connect(broker.port, "exp0", version=5, clean=False)
    assert c.subscribe([("exp0/t", 1)]) == [1]
    c.disconnect()
    c = raw_connect(broker.port, "exp0", version=5, clean=False)
    assert not c.connack.session_present
    publish_acked(broker.port, "exp0/t", [b"x"])
    assert c.no_publish(0.4)
    c.disconnect()


def test_paho_persistent_session_receives_offline_message_MQTT_3_1_2_5(broker):
    """paho 5.0 client with Session Expiry; message published with
    mosquitto_pub while it is offline is delivered on resume."""
    props = {"SessionExpiryInterval": 60}
    a = paho_client(broker.port, "paho-sess", protocol=5, clean_start=False, properties=props)
    assert a.subscribe_wait("ps/t", 1) == [1]
    a.disconnect()
    mosquitto_pub(broker.port, ["-t", "ps/t", "-m", "while-away", "-q", "1"])
    b = paho_client(broker.port, "paho-sess", protocol=5, clean_start=False, properties=props)
    try:
        assert b.session_present
        m = b.wait_messages(1)[0]
        assert m.payload == b"while-away" and m.qos == 1
    finally:
        b.close()


# ---------------------------------------------------------------------------
# offline queue


@VERSIONS
def test_offline_qos1_qos2_messages_delivered_on_resume_in_order_MQTT_3_1_2_5(broker, version):
    """QoS 1 and QoS 2 messages published while the client is offline are
    part of the session state and delivered on resume, in publication
    order (MQTT-3.1.2-5 / 4.6)."""
    cid = "off-%d" % version
    c = persistent(broker.port, cid, version)
    assert c.subscribe([("off/#", 2)]) == [2]
    c.disconnect()
    pub = raw_connect(broker.port, "off-pub-%d" % version, version=5)
    pub.publish("off/a", b"m1", qos=1, pid=1)
    pub.publish("off/b", b"m2", qos=2, pid=2)
    pub.publish("off/a", b"m3", qos=1, pid=3)
    pub.publish("off/b", b"m4", qos=2, pid=4)
    pub.disconnect()
    c = persistent(broker.port, cid, version)
    assert c.connack.session_present
    got = []
    for _ in range(4):
        m = c.expect_publish()
        got.append((m.payload, m.qos))
        if m.qos == 1:
            c.send(puback(m.pid, version))
        else:
            c.send(pubrec(m.pid, version))
            pid, _, _ = c.expect_ack(PUBREL)
            assert pid == m.pid
            c.send(pubcomp(m.pid, version))
    assert got == [(b"m1", 1), (b"m2", 2), (b"m3", 1), (b"m4", 2)]
    assert c.no_publish(0.3)
    c.disconnect()


def test_offline_queue_bounded_by_max_queued_oldest_dropped(broker_factory):
    """max_queued=5 (contract: oldest queued QoS 1/2 message dropped and
    counted in $SYS/broker/messages/dropped): 8 offline messages -> the
    newest 5 are delivered, in order."""
    b = broker_factory(max_queued=5, sys_interval=1)
    requires_edgebroker(b)
    c = persistent(b.port, "bounded", 5)
    assert c.subscribe([("bq/t", 1)]) == [1]
    c.disconnect()
    publish_acked(b.port, "bq/t", [b"m%d" % i for i in range(8)])
    c = persistent(b.port, "bounded", 5)
    assert c.connack.session_present
    got = []
    for _ in range(5):
        m = c.expect_publish()
        got.append(m.payload)
        c.send(puback(m.pid))
    assert got == [b"m3", b"m4", b"m5", b"m6", b"m7"]
    assert c.no_publish(0.3)
    # the drops are counted
    s = raw_connect(b.port, "sysreader", version=5)
    assert s.subscribe([("$SYS/broker/messages/dropped", 0)]) == [0]

    def dropped():
        m = s.expect_publish(3)
        return int(m.payload) >= 3

    assert wait_for(dropped, timeout=4), "dropped counter did not reach 3"
    s.disconnect()
    c.disconnect()


# ---------------------------------------------------------------------------
# resend of unacknowledged messages


@VERSIONS
def test_unacked_qos1_resent_with_dup_on_resume_MQTT_4_4_0_1(broker, version):
    """An outbound QoS 1 PUBLISH not acknowledged before the connection
    dropped is resent on resume with its original Packet Identifier and
    DUP=1 (MQTT-4.4.0-1, MQTT-3.3.1-1)."""
    cid = "dup1-%d" % version
    c = persistent(broker.port, cid, version)
    assert c.subscribe([("dup/t", 1)]) == [1]
    publish_acked(broker.port, "dup/t", [b"unacked"])
    first = c.expect_publish()
    assert first.qos == 1 and not first.dup and first.payload == b"unacked"
    c.close()  # no PUBACK, abnormal close
    c = persistent(broker.port, cid, version)
    assert c.connack.session_present
    again = c.expect_publish()
    assert again.payload == b"unacked" and again.qos == 1
    assert again.dup, "resent QoS 1 PUBLISH must have DUP=1 (MQTT-3.3.1-1)"
    assert again.pid == first.pid, "original Packet Identifier (MQTT-4.4.0-1)"
    c.send(puback(again.pid, version))
    assert c.no_publish(0.4), "acknowledged message must not be sent again"
    c.disconnect()


@VERSIONS
def test_resend_on_resume_paced_in_order_before_new_messages_MQTT_4_4_0_1(broker_factory, version):
    """More unacknowledged QoS 1 messages than the send buffer holds
    (max_outbuf 256, 6 x 200 bytes): on resume every one comes again, with
    DUP=1 and its Packet Identifier, in the order first sent (the broker
    resends them as its buffer drains), and a message published while the
    client was away only after them (4.6)."""
    b = broker_factory(max_outbuf=256)
    requires_edgebroker(b)
    cid = "pace-%d" % version
    c = persistent(b.port, cid, version)
    assert c.subscribe([("pace/t", 1)]) == [1]
    payloads = [b"%d" % i + b"." * 200 for i in range(6)]
    publish_acked(b.port, "pace/t", payloads)
    first = [c.expect_publish() for _ in payloads]
    assert [m.payload for m in first] == payloads
    c.close()  # none acknowledged
    publish_acked(b.port, "pace/t", [b"new"])
    c = persistent(b.port, cid, version)
    assert c.connack.session_present
    again = [c.expect_publish() for _ in payloads]
    assert [(m.payload, m.pid, bool(m.dup)) for m in again] == [
        (m.payload, m.pid, True) for m in first
    ]
    for m in again:
        c.send(puback(m.pid, version))
    new = c.expect_publish()
    assert new.payload == b"new" and not new.dup
    c.send(puback(new.pid, version))
    assert c.no_publish(0.3)
    c.disconnect()


@VERSIONS
def test_unacked_qos2_publish_and_pubrel_resent_on_resume_MQTT_4_4_0_1(broker, version):
    """QoS 2: an unacknowledged PUBLISH is resent with DUP=1; a PUBLISH
    that was PUBRECed but whose PUBREL was not completed gets its PUBREL
    resent (not the PUBLISH) on resume (MQTT-4.4.0-1)."""
    cid = "dup2-%d" % version
    c = persistent(broker.port, cid, version)
    assert c.subscribe([("dup2/t", 2)]) == [2]
    publish_acked(broker.port, "dup2/t", [b"recd", b"not-recd"], qos=2)
    m1 = c.expect_publish()
    m2 = c.expect_publish()
    assert (m1.payload, m2.payload) == (b"recd", b"not-recd")
    c.send(pubrec(m1.pid, version))
    pid, _, _ = c.expect_ack(PUBREL)
    assert pid == m1.pid
    c.close()  # no PUBCOMP for m1, nothing for m2
    c = persistent(broker.port, cid, version)
    assert c.connack.session_present
    pkts = []
    while len(pkts) < 2:
        p = c.read_packet(5)
        assert p is not None, "connection closed while waiting for resends"
        pkts.append(p)
    kinds = sorted(p.ptype for p in pkts)
    assert kinds == [PUBLISH, PUBREL], [p.name for p in pkts]
    for p in pkts:
        if p.ptype == PUBREL:
            assert p.flags == 0x02
            assert int.from_bytes(p.body[:2], "big") == m1.pid
            c.send(pubcomp(m1.pid, version))
        else:
            m = parse_publish(p.flags, p.body, version)
            assert m.payload == b"not-recd" and m.dup and m.pid == m2.pid and m.qos == 2
            c.send(pubrec(m.pid, version))
            rp, _, _ = c.expect_ack(PUBREL)
            assert rp == m.pid
            c.send(pubcomp(m.pid, version))
    assert c.no_publish(0.4), "recd must not be delivered twice"
    c.disconnect()


# ---------------------------------------------------------------------------
# takeover


def test_session_takeover_5_old_gets_disconnect_0x8E_MQTT_3_1_4_3(broker):
    """A second connection with the same Client Identifier takes the
    session over: the old one receives DISCONNECT 0x8E (Session taken over)
    and is closed (MQTT-3.1.4-3); the new one has session present = 1 and
    inherits the subscription; the old connection's clean-up must not remove
    the new session."""
    a = persistent(broker.port, "twin", 5)
    assert a.subscribe([("twin/t", 1)]) == [1]
    b = persistent(broker.port, "twin", 5)
    assert b.connack.session_present
    closed, pkts = a.read_until_closed(3)
    assert closed, "old connection not closed on takeover"
    discs = [parse_disconnect(p.body)[0] for p in pkts if p.ptype == DISCONNECT]
    if discs or not broker.is_mosquitto:  # mosquitto 2.0.11 closes silently
        assert discs == [0x8E], [p.name for p in pkts]
    time.sleep(0.2)  # let the old connection's clean-up run
    publish_acked(broker.port, "twin/t", [b"to-new"])
    m = b.expect_publish()
    assert m.payload == b"to-new"
    b.send(puback(m.pid))
    b.ping()
    b.disconnect()
    c = persistent(broker.port, "twin", 5)
    assert c.connack.session_present, "session was removed by the old connection's clean-up"
    c.disconnect()


def test_session_takeover_311_old_closed_MQTT_3_1_4_2(broker):
    """3.1.1: the existing connection with the same Client Identifier is
    closed (MQTT-3.1.4-2); the new connection keeps working."""
    a = persistent(broker.port, "twin4", 4)
    assert a.subscribe([("twin4/t", 1)]) == [1]
    b = persistent(broker.port, "twin4", 4)
    assert b.connack.session_present
    assert a.closed(3)
    time.sleep(0.2)
    publish_acked(broker.port, "twin4/t", [b"x"])
    m = b.expect_publish()
    assert m.payload == b"x"
    b.send(puback(m.pid, 4))
    b.ping()
    b.disconnect()


@VERSIONS
def test_takeover_with_clean_start_new_session_survives_old_cleanup(broker, version):
    """Takeover with Clean Start = 1: the new session is fresh (session
    present 0, old subscription gone) and its own subscription is not
    removed by the old connection's clean-up (BeehiveMQTT regression)."""
    cid = "twinc-%d" % version
    a = persistent(broker.port, cid, version)
    assert a.subscribe([("old/t", 1)]) == [1]
    b = raw_connect(broker.port, cid, version=version, clean=True)
    assert not b.connack.session_present
    assert a.closed(3)
    assert b.subscribe([("new/t", 1)]) == [1]
    time.sleep(0.3)
    publish_acked(broker.port, "old/t", [b"old"])
    publish_acked(broker.port, "new/t", [b"new"])
    m = b.expect_publish()
    assert m.payload == b"new" and m.topic == "new/t"
    b.send(puback(m.pid, version))
    assert b.no_publish(0.3)
    b.disconnect()


# ---------------------------------------------------------------------------
# expiry


def test_session_expiry_discards_session_MQTT_3_1_2_23(broker):
    """Session Expiry Interval 1 s: after it elapses the session is
    discarded (session present 0, no queued message delivered)."""
    c = persistent(broker.port, "short", 5, expiry=1)
    assert c.subscribe([("short/t", 1)]) == [1]
    c.disconnect()
    publish_acked(broker.port, "short/t", [b"queued"])
    time.sleep(2.3)
    c = persistent(broker.port, "short", 5, expiry=60)
    assert not c.connack.session_present
    assert c.no_publish(0.3)
    c.disconnect()


def test_session_expiry_set_to_zero_on_disconnect_MQTT_3_14_2_2(broker):
    """DISCONNECT with Session Expiry Interval 0 ends a session that was
    created with a non-zero expiry."""
    c = persistent(broker.port, "dz", 5, expiry=60)
    assert c.subscribe([("dz/t", 1)]) == [1]
    c.send(disconnect_packet(0, 5, prop_u32(SESSION_EXPIRY_INTERVAL, 0)))
    assert c.closed(3)
    c = persistent(broker.port, "dz", 5)
    assert not c.connack.session_present
    c.disconnect()


def test_session_expiry_clamped_to_max_session_expiry(broker_factory):
    """Client asks for 3600 s, max_session_expiry=1: CONNACK carries Session
    Expiry Interval 1 (5.0 3.2.2.3.2) and the session is gone after it."""
    b = broker_factory(max_session_expiry=1)
    requires_edgebroker(b)
    c = persistent(b.port, "clamp", 5, expiry=3600)
    assert c.connack.props.get(SESSION_EXPIRY_INTERVAL) == 1
    assert c.subscribe([("clamp/t", 1)]) == [1]
    c.disconnect()
    time.sleep(2.3)
    c = persistent(b.port, "clamp", 5, expiry=60)
    assert not c.connack.session_present
    c.disconnect()


# ---------------------------------------------------------------------------
# flow control on resume, session limits, will on takeover


def test_resume_respects_client_receive_maximum_MQTT_3_3_4_7(broker):
    """6 messages queued offline, the client resumes with Receive Maximum 2:
    at most 2 unacknowledged QoS 1 PUBLISHes are in flight (MQTT-3.3.4-7),
    and every PUBACK lets the next queued one out (none lost)."""
    props = prop_u32(SESSION_EXPIRY_INTERVAL, 60) + bytes([0x21, 0, 2])  # Receive Maximum 2
    c = raw_connect(broker.port, "rmax", version=5, clean=False, props=props)
    assert c.subscribe([("rmax/t", 1)]) == [1]
    c.disconnect()
    publish_acked(broker.port, "rmax/t", [b"m%d" % i for i in range(6)])
    c = raw_connect(broker.port, "rmax", version=5, clean=False, props=props)
    assert c.connack.session_present
    first = [c.expect_publish(3), c.expect_publish(3)]
    assert c.no_publish(0.4), "more than Receive Maximum (2) unacknowledged PUBLISHes in flight"
    got = [m.payload for m in first]
    pending = list(first)
    while len(got) < 6:
        m = pending.pop(0)
        c.send(puback(m.pid))
        n = c.expect_publish(3)
        got.append(n.payload)
        pending.append(n)
    for m in pending:
        c.send(puback(m.pid))
    assert got == [b"m%d" % i for i in range(6)]
    assert c.no_publish(0.3)
    c.disconnect()


def test_resend_on_resume_keeps_to_the_new_receive_maximum_MQTT_3_3_4_9(broker):
    """5 QoS 1 messages delivered and not acknowledged; the client resumes
    with Receive Maximum 2: the broker resends 2 (DUP=1), then one more as
    each is acknowledged, never more than 2 unacknowledged (MQTT-3.3.4-9
    holds for the resends of MQTT-4.4.0-1 too), and all 5 come, in order."""
    if broker.is_mosquitto:
        pytest.xfail("mosquitto 2.0.11 resends every in-flight message at once")
    props = prop_u32(SESSION_EXPIRY_INTERVAL, 60)
    c = raw_connect(broker.port, "rsmax", version=5, clean=False, props=props)
    assert c.subscribe([("rsmax/t", 1)]) == [1]
    payloads = [b"r%d" % i for i in range(5)]
    publish_acked(broker.port, "rsmax/t", payloads)
    assert [c.expect_publish(3).payload for _ in payloads] == payloads
    c.close()  # none acknowledged
    c = raw_connect(broker.port, "rsmax", version=5, clean=False,
                    props=props + bytes([0x21, 0, 2]))  # Receive Maximum 2
    assert c.connack.session_present
    pending = [c.expect_publish(3), c.expect_publish(3)]
    assert c.no_publish(0.4), "more than Receive Maximum (2) unacknowledged resends"
    got = [m.payload for m in pending]
    while len(got) < 5:
        m = pending.pop(0)
        c.send(puback(m.pid))
        n = c.expect_publish(3)
        assert n.dup
        got.append(n.payload)
        pending.append(n)
        assert c.no_publish(0.2), "more than Receive Maximum (2) unacknowledged resends"
    for m in pending:
        c.send(puback(m.pid))
    assert got == payloads
    assert c.no_publish(0.3)
    c.disconnect()


def test_disconnect_session_expiry_after_a_cap_to_zero_MQTT_3_14_2_2(broker_factory):
    """max_session_expiry 0 caps a CONNECT's Session Expiry of 100 to 0; the
    client's DISCONNECT with Session Expiry 50 is then no Protocol Error
    (MQTT-3.14.2-2 forbids it only after a CONNECT that sent 0): the
    broker closes the connection without a DISCONNECT of its own and
    without the Will; the session still ends (0 is the cap). After a
    CONNECT that did send 0, the same DISCONNECT is a Protocol Error
    (0x82)."""
    b = broker_factory(max_session_expiry=0)
    requires_edgebroker(b)
    w = raw_connect(b.port, "", version=5)
    assert w.subscribe([("secap/will", 1)]) == [1]
    c = raw_connect(b.port, "secap", version=5, clean=False,
                    props=prop_u32(SESSION_EXPIRY_INTERVAL, 100),
                    will=dict(topic="secap/will", payload=b"w", qos=1, retain=False, props=b""))
    assert c.connack.props.get(SESSION_EXPIRY_INTERVAL) == 0
    c.send(disconnect_packet(0, 5, props=prop_u32(SESSION_EXPIRY_INTERVAL, 50)))
    assert c.read_packet(3) is None, "the broker answered a valid DISCONNECT"
    assert w.no_publish(0.5), "will published after a normal DISCONNECT"
    c = raw_connect(b.port, "secap", version=5, clean=False)
    assert not c.connack.session_present
    c.send(disconnect_packet(0, 5, props=prop_u32(SESSION_EXPIRY_INTERVAL, 50)))
    p = c.read_packet(3)
    assert p is not None and p.ptype == DISCONNECT
    assert parse_disconnect(p.body)[0] == 0x82
    w.disconnect()


def test_max_sessions_discards_longest_disconnected(broker_factory):
    """max_sessions=2 (contract: the longest-disconnected session is
    discarded): three offline sessions -> the oldest is gone."""
    b = broker_factory(max_sessions=2)
    requires_edgebroker(b)
    for cid in ("ms1", "ms2", "ms3"):
        c = persistent(b.port, cid, 5)
        assert c.subscribe([("ms/" + cid, 1)]) == [1]
        c.disconnect()
        time.sleep(1.05)  # distinct disconnect times (1 s clock on boards)
    c3 = persistent(b.port, "ms3", 5)
    c2 = persistent(b.port, "ms2", 5)
    c1 = persistent(b.port, "ms1", 5)
    assert c3.connack.session_present and c2.connack.session_present
    assert not c1.connack.session_present, "oldest offline session should have been discarded"
    for c in (c1, c2, c3):
        c.disconnect()


@pytest.mark.parametrize("clean", [False, True])
def test_a_takeover_does_not_count_against_max_sessions(broker_factory, clean):
    """max_sessions=2 with two sessions offline, one holding an acknowledged
    QoS 1 message: a connected persistent client taken over by a new
    connection (a reconnect after a NAT drop) is not an offline session,
    so nothing is discarded: the other sessions resume, the message is
    delivered (before: the session disconnected longest was discarded,
    its acknowledged message lost)."""
    b = broker_factory(max_sessions=2)
    requires_edgebroker(b)
    for cid in ("tkx", "tky"):
        c = persistent(b.port, cid, 5)
        assert c.subscribe([("tk/" + cid, 1)]) == [1]
        c.disconnect()
        time.sleep(1.05)  # distinct disconnect times (1 s clock on boards)
    p = raw_connect(b.port, "tk-pub", version=5)
    p.publish("tk/tkx", b"for x", qos=1)
    t = persistent(b.port, "tkt", 5)
    t2 = persistent(b.port, "tkt", 5) if not clean else raw_connect(
        b.port, "tkt", version=5, clean=True, props=prop_u32(SESSION_EXPIRY_INTERVAL, 60))
    x = persistent(b.port, "tkx", 5)
    assert x.connack.session_present, "a session was discarded below max_sessions"
    m = x.expect_publish(3)
    assert m.payload == b"for x"
    x.send(puback(m.pid))
    for c in (x, t2, p):
        c.disconnect()
    t.close()


def test_expired_queued_messages_hold_no_place_in_an_offline_queue_MQTT_3_3_2_5(broker_factory):
    """max_queued=3, the subscriber offline: A (no expiry), then B and C
    with a 1 s Message Expiry; 2.5 s later D. B and C are deleted once
    expired (MQTT-3.3.2-5), wherever they are in the queue, so D takes a
    free place and A, acknowledged to its publisher, is kept: the resumed
    subscriber gets A and D (before: A was dropped as the oldest while the
    expired B and C kept their places until delivery was tried)."""
    b = broker_factory(max_queued=3)
    requires_edgebroker(b)
    c = persistent(b.port, "eq-sub", 5)
    assert c.subscribe([("eq/#", 1)]) == [1]
    c.disconnect()
    p = raw_connect(b.port, "eq-pub", version=5)
    p.publish("eq/t", b"A", qos=1)
    for i, pl in enumerate((b"B", b"C")):
        p.publish("eq/t", pl, qos=1, pid=2 + i, props=prop_u32(0x02, 1))
    time.sleep(2.5)
    p.publish("eq/t", b"D", qos=1, pid=4)
    p.disconnect()
    c = persistent(b.port, "eq-sub", 5)
    got = []
    for _ in range(2):
        m = c.expect_publish(3)
        got.append(m.payload)
        c.send(puback(m.pid))
    assert got == [b"A", b"D"] and c.no_publish(0.5), got
    c.disconnect()


def test_takeover_clean_start_publishes_old_will_MQTT_3_1_3_9(broker):
    """5.0 3.1.3.2.2: on takeover the Will of the exited connection is sent
    unless the new connection has Clean Start 0 and the Will Delay > 0."""
    w = raw_connect(broker.port, "", version=5)
    assert w.subscribe([("tw/#", 1)]) == [1]
    # (a) Clean Start 1 takeover: will published
    a = raw_connect(broker.port, "tw-a", version=5,
                    will=dict(topic="tw/a", payload=b"a-will", qos=1))
    a2 = raw_connect(broker.port, "tw-a", version=5, clean=True)
    m = w.expect_publish(3)
    assert m.payload == b"a-will"
    w.send(puback(m.pid))
    # (b) Clean Start 0 takeover with Will Delay 5 s: not published
    wprops = prop_u32(0x18, 5)
    sp = prop_u32(SESSION_EXPIRY_INTERVAL, 60)
    b = raw_connect(broker.port, "tw-b", version=5, clean=False, props=sp,
                    will=dict(topic="tw/b", payload=b"b-will", qos=1, props=wprops))
    b2 = raw_connect(broker.port, "tw-b", version=5, clean=False, props=sp)
    assert b2.connack.session_present
    assert w.no_publish(1.0), "will published although the session was resumed within its delay"
    for c in (a, b):
        c.close()
    a2.disconnect()
    b2.disconnect()
    w.disconnect()

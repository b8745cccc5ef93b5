"""Retained messages: the rules of docs/retained.md, one or more tests per
rule, each naming its rule (S1..S7, D1..D9, E1..E3, L1..L5) and the spec
statement it holds.

Not here: S8 (survives a restart on flash) and E4 (expiry across a restart)
need the flash store: test_flash_e2e.py.

Spec statements are MQTT 5.0 unless marked 3.1.1. Every test runs under
both interpreters. Profile keys: docs/contract.md.
"""

import threading
import time

import pytest
from helpers_pubsub import (
    SysWatcher,
    ack_publish,
    drain_publishes,
    publish_batched,
    recv_publishes,
    start_broker,
    subscriber,
    sys_int,
)
from mqtt_helpers import (
    CONTENT_TYPE,
    CORRELATION_DATA,
    DISCONNECT,
    HOST,
    MAXIMUM_PACKET_SIZE,
    MESSAGE_EXPIRY_INTERVAL,
    PAYLOAD_FORMAT_INDICATOR,
    RECEIVE_MAXIMUM,
    RESPONSE_TOPIC,
    RETAIN_AVAILABLE,
    SESSION_EXPIRY_INTERVAL,
    SUBSCRIPTION_IDENTIFIER,
    TOPIC_ALIAS,
    USER_PROPERTY,
    mosquitto_pub,
    mosquitto_sub,
    paho_client,
    parse_disconnect,
    prop_bin,
    prop_byte,
    prop_pair,
    prop_str,
    prop_u16,
    prop_u32,
    prop_varint,
    puback,
    publish_packet,
    raw_connect,
    requires_edgebroker,
    run_async,
    subscribe_packet,
    unsubscribe_packet,
)

VERSIONS = pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])


def retained_of(port, flt, version=5, qos=2, wait=0.4, props=b"", sub_props=b"", client_id=""):
    """What a NEW subscriber to ``flt`` receives at subscribe time: a fresh
    clean client subscribes, collects (and acks) PUBLISHes for ``wait`` s."""
    kw = {"props": props} if version == 5 else {}
    c = raw_connect(port, client_id, version=version, **kw)
    codes = c.subscribe([(flt, qos)], props=sub_props)
    assert codes == [qos & 3], codes
    got = drain_publishes(c, wait)
    c.disconnect()
    return got


def tpr(msgs):
    """(topic, payload, retain) of each message."""
    return [(m.topic, m.payload, m.retain) for m in msgs]


# ---------------------------------------------------------------------------
# 1. storing and deleting


@VERSIONS
def test_retained_replaced_at_most_one_per_topic_S1_MQTT_3_3_1_5(broker, version):
    """S1: a retained PUBLISH replaces the topic's retained message; a new
    subscriber gets only the last one, once (MQTT-3.3.1-5, 3.1.1 MQTT-3.3.1-5)."""
    pub = raw_connect(broker.port, "s1-%d" % version, version=version)
    pub.publish("s1/t", b"v1", qos=1, retain=True, pid=1)
    pub.publish("s1/t", b"v2", qos=1, retain=True, pid=2)
    pub.publish("s1/t", b"v3", qos=2, retain=True, pid=3)
    assert tpr(retained_of(broker.port, "s1/t", version)) == [("s1/t", b"v3", True)]
    pub.disconnect()


@VERSIONS
def test_qos0_retained_message_is_stored_S2_MQTT_3_3_1_5(broker, version):
    """S2: a QoS 0 retained message is stored (5.0 MQTT-3.3.1-5; 3.1.1
    MQTT-3.3.1-7 SHOULD) and replaces an older QoS 1 one - it does not
    merely clear it (Moquette's old behaviour)."""
    pub = raw_connect(broker.port, "s2-%d" % version, version=version)
    pub.publish("s2/t", b"old-q1", qos=1, retain=True, pid=1)
    pub.publish("s2/t", b"new-q0", qos=0, retain=True)
    pub.publish("s2/u", b"only-q0", qos=0, retain=True)
    pub.ping()  # QoS 0 has no ack: the PINGRESP shows both were read
    got = retained_of(broker.port, "s2/+", version)
    assert sorted((m.topic, m.payload, m.qos, m.retain) for m in got) == [
        ("s2/t", b"new-q0", 0, True),
        ("s2/u", b"only-q0", 0, True),
    ]
    pub.disconnect()


@VERSIONS
def test_retained_empty_payload_forwarded_and_deletes_S3_MQTT_3_3_1_6(broker, version):
    """S3: RETAIN=1 with an empty payload is forwarded as a normal message
    to current subscribers and deletes the retained message (5.0
    MQTT-3.3.1-6, 3.1.1 MQTT-3.3.1-10); the empty message is not stored
    (MQTT-3.3.1-7, 3.1.1 MQTT-3.3.1-11)."""
    live = subscriber(broker.port, "s3/#", 1, version=version, client_id="s3live-%d" % version)
    pub = raw_connect(broker.port, "s3pub-%d" % version, version=version)
    pub.publish("s3/t", b"value", qos=1, retain=True, pid=1)
    pub.publish("s3/t", b"", qos=1, retain=True, pid=2)
    pub.publish("s3/never", b"", qos=1, retain=True, pid=3)  # deleting nothing is harmless
    got = recv_publishes(live, 3)
    assert [(m.topic, m.payload, m.retain) for m in got] == [
        ("s3/t", b"value", False),
        ("s3/t", b"", False),
        ("s3/never", b"", False),
    ]
    assert retained_of(broker.port, "s3/#", version) == []
    live.disconnect()
    pub.disconnect()


@VERSIONS
def test_non_retained_publish_never_stores_replaces_or_deletes_S4_MQTT_3_3_1_8(broker, version):
    """S4: RETAIN=0 never stores, replaces or removes a retained message
    (5.0 MQTT-3.3.1-8, 3.1.1 MQTT-3.3.1-12) - not even with an empty payload."""
    pub = raw_connect(broker.port, "s4-%d" % version, version=version)
    pub.publish("s4/t", b"kept", qos=1, retain=True, pid=1)
    pub.publish("s4/t", b"live-only", qos=1, retain=False, pid=2)
    pub.publish("s4/t", b"", qos=1, retain=False, pid=3)
    pub.publish("s4/other", b"not-stored", qos=2, retain=False, pid=4)
    assert tpr(retained_of(broker.port, "s4/#", version)) == [("s4/t", b"kept", True)]
    pub.disconnect()


def test_retained_survives_publisher_disconnect_and_session_end_S5(broker):
    """S5: a retained message is not part of the publisher's session: it
    survives a normal disconnect (paho 5.0, Session Expiry 0), an abrupt
    close (3.1.1 raw), and the end of a persistent session (Clean Start)."""
    a = paho_client(broker.port, "s5-paho", protocol=5)
    a.publish_wait("s5/paho", b"from-paho", qos=1, retain=True)
    a.disconnect()
    b = raw_connect(broker.port, "s5-raw", version=4)
    b.publish("s5/raw", b"from-raw", qos=1, retain=True, pid=1)
    b.close()  # no DISCONNECT
    c = raw_connect(
        broker.port, "s5-sess", version=5, clean=False, props=prop_u32(SESSION_EXPIRY_INTERVAL, 60)
    )
    c.publish("s5/sess", b"from-session", qos=2, retain=True, pid=1)
    c.disconnect()
    c = raw_connect(broker.port, "s5-sess", version=5, clean=True)  # discards that session
    c.disconnect()
    got = retained_of(broker.port, "s5/#")
    assert sorted(tpr(got)) == [
        ("s5/paho", b"from-paho", True),
        ("s5/raw", b"from-raw", True),
        ("s5/sess", b"from-session", True),
    ]


def test_retained_keeps_qos_and_properties_not_alias_or_sub_id_S6(broker):
    """S6 (5.0 3.3.2.3): the stored message keeps its QoS and the forwarded
    properties - Payload Format Indicator, Content Type, Response Topic,
    Correlation Data, User Properties (order kept, MQTT-3.3.2-18) and its
    expiry; it is stored under the topic name a Topic Alias resolved to,
    never with the alias, and carries only the receiving subscription's
    Subscription Identifier (none when it has none)."""
    pub = raw_connect(broker.port, "s6pub", version=5)
    pub.publish("s6/t", b"first", qos=1, retain=True, pid=1, props=prop_u16(TOPIC_ALIAS, 1))
    props = (
        prop_byte(PAYLOAD_FORMAT_INDICATOR, 1)
        + prop_str(CONTENT_TYPE, "text/plain")
        + prop_str(RESPONSE_TOPIC, "s6/reply")
        + prop_bin(CORRELATION_DATA, b"\x00\x01corr")
        + prop_pair("k", "v1")
        + prop_pair("a", "b")
        + prop_pair("k", "v0")
        + prop_u32(MESSAGE_EXPIRY_INTERVAL, 300)
        + prop_u16(TOPIC_ALIAS, 1)
    )
    pub.publish("", b"second", qos=2, retain=True, pid=2, props=props)
    got = retained_of(broker.port, "s6/#", sub_props=prop_varint(SUBSCRIPTION_IDENTIFIER, 9))
    assert len(got) == 1
    m = got[0]
    assert (m.topic, m.payload, m.qos, m.retain) == ("s6/t", b"second", 2, True)
    p = m.props
    assert p.get(PAYLOAD_FORMAT_INDICATOR) == 1
    assert p.get(CONTENT_TYPE) == "text/plain"
    assert p.get(RESPONSE_TOPIC) == "s6/reply"
    assert p.get(CORRELATION_DATA) == b"\x00\x01corr"
    assert p.get(USER_PROPERTY) == [("k", "v1"), ("a", "b"), ("k", "v0")]
    assert 290 <= p.get(MESSAGE_EXPIRY_INTERVAL, 0) <= 300
    assert TOPIC_ALIAS not in p
    assert p.get(SUBSCRIPTION_IDENTIFIER) == [9]
    # no identifier on a subscription without one; lower granted QoS applies (D2)
    m2 = retained_of(broker.port, "s6/t", qos=1)[0]
    assert SUBSCRIPTION_IDENTIFIER not in m2.props and m2.qos == 1
    assert m2.props.get(USER_PROPERTY) == [("k", "v1"), ("a", "b"), ("k", "v0")]
    # a 3.1.1 subscriber gets the message without properties
    m3 = retained_of(broker.port, "s6/t", version=4)[0]
    assert (m3.payload, m3.retain) == (b"second", True)
    pub.disconnect()


@VERSIONS
def test_will_with_will_retain_stored_as_retained_S7_MQTT_3_1_2_17(broker, version):
    """S7: a Will Message with Will Retain=1 is published as a retained
    message (5.0 MQTT-3.1.2-17, 3.1.1 MQTT-3.1.2-17) when the connection
    is lost; a later subscriber receives it with RETAIN=1 (and, 5.0, with
    its will properties)."""
    topic = "s7/%d" % version
    watcher = subscriber(broker.port, "s7/#", 1, version=5, client_id="s7watch-%d" % version)
    will = {"topic": topic, "payload": b"gone", "qos": 1, "retain": True}
    if version == 5:
        will["props"] = prop_str(CONTENT_TYPE, "text/x-will")
    c = raw_connect(broker.port, "s7-%d" % version, version=version, will=will)
    c.close()  # abnormal: the will is published
    live = recv_publishes(watcher, 1)[0]
    assert (live.topic, live.payload) == (topic, b"gone")
    got = retained_of(broker.port, topic)
    assert tpr(got) == [(topic, b"gone", True)]
    assert got[0].qos == 1
    if version == 5:
        assert got[0].props.get(CONTENT_TYPE) == "text/x-will"
    watcher.disconnect()


# ---------------------------------------------------------------------------
# 2. delivering


def test_retained_sent_on_subscribe_for_matching_filters_D1_MQTT_3_3_1_9(broker):
    """D1: on SUBSCRIBE every retained message whose topic matches the filter
    (wildcards included) is sent, with RETAIN=1, once each (5.0
    MQTT-3.3.1-9, 3.1.1 MQTT-3.3.1-6/8)."""
    topics = ["d1", "d1/a", "d1/b", "d1/a/x", "oth/a"]
    pub = raw_connect(broker.port, "d1pub", version=5)
    for i, t in enumerate(topics):
        pub.publish(t, t.encode(), qos=1, retain=True, pid=i + 1)
    expect = {
        "d1/+": ["d1/a", "d1/b"],
        "d1/#": ["d1", "d1/a", "d1/a/x", "d1/b"],
        "+/a": ["d1/a", "oth/a"],
        "#": sorted(topics),
        "d1/a/x": ["d1/a/x"],
        "d1/nothing/#": [],
    }
    for version in (4, 5):
        for flt, want in expect.items():
            got = retained_of(broker.port, flt, version=version, wait=0.25)
            assert sorted(m.topic for m in got) == want, (version, flt)
            assert all(m.retain and m.payload == m.topic.encode() for m in got)
    pub.disconnect()


@VERSIONS
def test_retained_sent_at_min_of_stored_and_granted_qos_D2(broker, version):
    """D2: a retained message goes out at min(stored QoS, granted QoS)
    (5.0 MQTT-3.8.4-8, 3.1.1 MQTT-3.8.4-6), RETAIN=1."""
    pub = raw_connect(broker.port, "d2pub", version=5)
    for q in (0, 1, 2):
        pub.publish("d2/%d" % q, b"q%d" % q, qos=q, retain=True, pid=q + 1 if q else None)
    pub.ping()
    for granted in (0, 1, 2):
        got = retained_of(broker.port, "d2/+", version=version, qos=granted, wait=0.3)
        assert sorted((m.topic, m.qos, m.retain) for m in got) == [
            ("d2/%d" % q, min(q, granted), True) for q in (0, 1, 2)
        ], granted
    pub.disconnect()


def test_live_forward_clears_retain_unless_retain_as_published_D3_MQTT_3_3_1_12(broker):
    """D3: forwarding a live retained publication to an existing subscription
    clears RETAIN for 3.1.1 (MQTT-3.3.1-9) and for 5.0 without Retain As
    Published (MQTT-3.3.1-12); with Retain As Published it keeps the
    received flag (MQTT-3.3.1-13). Retained messages sent at subscribe time
    always have RETAIN=1."""
    v4 = subscriber(broker.port, "d3/#", 1, version=4, client_id="d3v4")
    v5 = subscriber(broker.port, "d3/#", 1, version=5, client_id="d3v5")
    rap = raw_connect(broker.port, "d3rap", version=5)
    assert rap.subscribe([("d3/#", 1 | 0x08)]) == [1]
    pub = raw_connect(broker.port, "d3pub", version=5)
    pub.publish("d3/t", b"r", qos=1, retain=True, pid=1)
    pub.publish("d3/t", b"n", qos=1, retain=False, pid=2)
    assert [(m.payload, m.retain) for m in recv_publishes(v4, 2)] == [(b"r", False), (b"n", False)]
    assert [(m.payload, m.retain) for m in recv_publishes(v5, 2)] == [(b"r", False), (b"n", False)]
    assert [(m.payload, m.retain) for m in recv_publishes(rap, 2)] == [(b"r", True), (b"n", False)]
    # at subscribe time: RETAIN=1 with or without Retain As Published
    rap.send(subscribe_packet(5, [("d3/t", 1 | 0x08)]))
    rap.expect_suback()
    assert [(m.payload, m.retain) for m in drain_publishes(rap, 0.3)] == [(b"r", True)]
    assert tpr(retained_of(broker.port, "d3/t", version=4)) == [("d3/t", b"r", True)]
    for c in (v4, v5, rap, pub):
        c.disconnect()


def test_retain_handling_0_1_2_and_3_is_protocol_error_D4_MQTT_3_3_1_9_to_11(broker):
    """D4 (5.0): Retain Handling 0 sends retained messages on every
    SUBSCRIBE (MQTT-3.3.1-9); 1 only when the subscription did not exist
    (MQTT-3.3.1-10); 2 never at subscribe (MQTT-3.3.1-11); 3 is a Protocol
    Error (3.8.3.1) -> DISCONNECT."""
    pub = raw_connect(broker.port, "d4pub", version=5)
    pub.publish("d4/t", b"kept", qos=1, retain=True, pid=1)
    c = raw_connect(broker.port, "d4", version=5)

    def sub(pid, rh):
        assert c.subscribe([("d4/t", 1 | (rh << 4))], pid=pid) == [1]
        return [(m.payload, m.retain) for m in drain_publishes(c, 0.3)]

    assert sub(1, 0) == [(b"kept", True)]
    assert sub(2, 0) == [(b"kept", True)]  # again: RH 0 re-sends
    assert sub(3, 1) == []  # exists already: nothing
    c.send(unsubscribe_packet(4, ["d4/t"]))
    c.expect_unsuback()
    assert sub(5, 1) == [(b"kept", True)]  # new subscription: sent
    assert sub(6, 2) == []  # RH 2: never at subscribe
    c.send(unsubscribe_packet(7, ["d4/t"]))
    c.expect_unsuback()
    assert sub(8, 2) == []
    # the RH 2 subscription still gets live messages
    pub.publish("d4/t", b"live", qos=1, pid=2)
    assert [(m.payload, m.retain) for m in drain_publishes(c, 0.3)] == [(b"live", False)]
    c.disconnect()
    # RH 3: Protocol Error
    bad = raw_connect(broker.port, "d4bad", version=5)
    bad.send(subscribe_packet(1, [("d4/t", 1 | (3 << 4))]))
    p = bad.read_packet(3)
    assert p is None or p.ptype == DISCONNECT, "expected DISCONNECT, got %r" % (p,)
    if p is not None:
        assert parse_disconnect(p.body)[0] in (0x81, 0x82)
    assert bad.closed(3)
    pub.disconnect()


def test_retain_handling_1_existing_subscription_of_resumed_session_D4_MQTT_3_3_1_10(broker):
    """D4: Retain Handling 1 looks at the session, not the connection: a
    subscription made before a disconnect still exists in the resumed
    session, so repeating it with RH 1 sends nothing (MQTT-3.3.1-10), while
    RH 0 sends again (MQTT-3.3.1-9)."""
    pub = raw_connect(broker.port, "d4spub", version=5)
    pub.publish("d4s/t", b"kept", qos=1, retain=True, pid=1)
    sess = prop_u32(SESSION_EXPIRY_INTERVAL, 60)
    c = raw_connect(broker.port, "d4s", version=5, clean=True, props=sess)
    assert c.subscribe([("d4s/t", 1 | (1 << 4))], pid=1) == [1]
    assert [m.payload for m in drain_publishes(c, 0.3)] == [b"kept"]
    c.disconnect()
    c = raw_connect(broker.port, "d4s", version=5, clean=False, props=sess)
    assert c.connack.session_present
    assert c.subscribe([("d4s/t", 1 | (1 << 4))], pid=2) == [1]
    assert drain_publishes(c, 0.3) == []
    assert c.subscribe([("d4s/t", 1)], pid=3) == [1]
    assert [m.payload for m in drain_publishes(c, 0.3)] == [b"kept"]
    c.disconnect()
    pub.disconnect()


@VERSIONS
def test_resubscribe_resends_retained_without_interrupting_flow_D5_MQTT_3_8_4_4(broker, version):
    """D5: a SUBSCRIBE repeating an existing filter replaces it and re-sends
    the matching retained messages (3.1.1 MQTT-3.8.4-3, 5.0 MQTT-3.8.4-3/4,
    RH 0) while publications keep flowing: none of a live QoS 1 stream
    published around the re-subscribe is lost or duplicated."""
    pub = raw_connect(broker.port, "d5pub", version=5)
    pub.publish("d5/r", b"kept", qos=1, retain=True, pid=1)
    c = raw_connect(broker.port, "d5-%d" % version, version=version)
    assert c.subscribe([("d5/#", 1)], pid=1) == [1]
    got = []
    stop = threading.Event()
    errors = []

    def stream():
        try:
            p2 = raw_connect(broker.port, "d5stream", version=5)
            for i in range(60):
                p2.publish("d5/live", b"%d" % i, qos=1, pid=i + 1)
            p2.disconnect()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
        finally:
            stop.set()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    # read some of the stream, then re-subscribe in the middle of it
    while len([m for m in got if m.topic == "d5/live"]) < 20:
        m = c.expect_publish()
        ack_publish(c, m)
        got.append(m)
    c.send(subscribe_packet(2, [("d5/#", 1)], version=version))
    c.expect_suback()
    t.join(10)
    assert not errors, errors
    got += drain_publishes(c, 0.4)
    live = [m.payload for m in got if m.topic == "d5/live"]
    kept = [m for m in got if m.topic == "d5/r"]
    assert live == [b"%d" % i for i in range(60)]
    assert [(m.payload, m.retain) for m in kept] == [(b"kept", True), (b"kept", True)]
    c.disconnect()
    pub.disconnect()


def test_wildcard_filters_do_not_return_dollar_retained_D6_MQTT_4_7_2_1(broker_factory, request):
    """D6: '#' and '+/...' do not return retained messages whose topic starts
    with '$' ($SYS/... published by the broker, '$app/x' by a client),
    while '$SYS/#' and '$app/#' do (MQTT-4.7.2-1)."""
    b = start_broker(broker_factory, request, mosq=["sys_interval 1"], sys_interval=1)
    pub = raw_connect(b.port, "d6pub", version=5)
    pub.publish("$app/x", b"dollar", qos=1, retain=True, pid=1)
    pub.publish("app/x", b"plain", qos=1, retain=True, pid=2)
    w = SysWatcher(b.port)
    try:
        w.wait(lambda v: len(v) >= 3, timeout=3.5)
    finally:
        w.close()
    assert tpr(retained_of(b.port, "#")) == [("app/x", b"plain", True)]
    assert tpr(retained_of(b.port, "+/x")) == [("app/x", b"plain", True)]
    assert retained_of(b.port, "+/broker/#") == []
    assert tpr(retained_of(b.port, "$app/#")) == [("$app/x", b"dollar", True)]
    sys_msgs = retained_of(b.port, "$SYS/#")
    # the retained $SYS set, then possibly a live sys_interval update
    # (RETAIN 0 when forwarded live, MQTT-3.3.1-9): all of it under $SYS
    assert any(m.retain for m in sys_msgs)
    assert all(m.topic.startswith("$SYS/") for m in sys_msgs)
    pub.disconnect()


def test_retained_carries_subscription_id_and_remaining_expiry_D7_MQTT_3_3_2_6(broker):
    """D7: the retained copy sent to a 5.0 subscriber carries the
    Subscription Identifier of the subscription that matched and the
    remaining Message Expiry Interval (MQTT-3.3.2-6)."""
    pub = raw_connect(broker.port, "d7pub", version=5)
    pub.publish(
        "d7/t", b"x", qos=1, retain=True, pid=1, props=prop_u32(MESSAGE_EXPIRY_INTERVAL, 60)
    )
    pub.publish("d7/forever", b"y", qos=1, retain=True, pid=2)
    time.sleep(1.2)
    got = retained_of(broker.port, "d7/#", sub_props=prop_varint(SUBSCRIPTION_IDENTIFIER, 4242))
    by = {m.topic: m for m in got}
    assert set(by) == {"d7/t", "d7/forever"}
    assert by["d7/t"].props.get(SUBSCRIPTION_IDENTIFIER) == [4242]
    assert by["d7/forever"].props.get(SUBSCRIPTION_IDENTIFIER) == [4242]
    assert 55 <= by["d7/t"].props[MESSAGE_EXPIRY_INTERVAL] <= 59
    assert MESSAGE_EXPIRY_INTERVAL not in by["d7/forever"].props
    pub.disconnect()


def test_retained_larger_than_client_maximum_packet_size_not_sent_D8_MQTT_3_1_2_25(broker):
    """D8: a retained message larger than the client's Maximum Packet Size is
    not sent to that client (MQTT-3.1.2-24/25); the smaller ones are, and
    a client without the limit gets all."""
    pub = raw_connect(broker.port, "d8pub", version=5)
    pub.publish("d8/big", b"B" * 2000, qos=1, retain=True, pid=1)
    pub.publish("d8/small", b"s", qos=1, retain=True, pid=2)
    small = retained_of(broker.port, "d8/#", props=prop_u32(MAXIMUM_PACKET_SIZE, 512))
    assert tpr(small) == [("d8/small", b"s", True)]
    assert sorted(m.topic for m in retained_of(broker.port, "d8/#")) == ["d8/big", "d8/small"]
    pub.disconnect()


@pytest.mark.timeout(90)
def test_2000_retained_paced_by_receive_maximum_live_keeps_flowing_D9(broker_factory, request):
    """D9: a '#' subscriber with Receive Maximum 5 gets all 2,000 retained
    messages (QoS 1, RETAIN=1, each once), never more than 5 unacknowledged
    (MQTT-3.3.4-9) while it acks one at a time, with max_queued=100 so the
    set cannot simply be copied into the session queue; live publications
    to it keep flowing during the delivery. Bounded: 40 s at most.
    (mosquitto truncates at queue + inflight - its issue #2196 - so it runs
    here with max_queued_messages 0 = unlimited.)"""
    b = start_broker(
        broker_factory, request, mosq=["max_queued_messages 0"], max_queued=100, max_inflight=8
    )
    n, window = 2000, 5
    pub = raw_connect(b.port, "d9pub", version=5)
    publish_batched(pub, [("d9/%04d" % i, b"v%d" % i) for i in range(n)], retain=True)
    t0 = time.monotonic()
    sub = raw_connect(b.port, "d9sub", version=5, props=prop_u16(RECEIVE_MAXIMUM, window))
    sub.send(subscribe_packet(1, [("#", 1)]))
    assert sub.expect_suback()[1] == [1]
    seen = {}
    live_at = {}
    outstanding = []
    order = 0
    live_sent = False
    checks = 0
    while len(seen) < n or len(live_at) < 3:
        assert time.monotonic() - t0 < 40, "D9 delivery too slow: %d retained, %d live in 40 s" % (
            len(seen),
            len(live_at),
        )
        m = sub.expect_publish(5)
        order += 1
        assert m.qos == 1
        outstanding.append(m.pid)
        assert len(outstanding) <= window, "more than Receive Maximum unacknowledged (MQTT-3.3.4-9)"
        if m.topic.startswith("d9/"):
            assert m.retain and m.topic not in seen, m.topic
            seen[m.topic] = order
        elif m.topic.startswith("live/"):
            live_at[m.topic] = order
        if len(seen) == 500 and not live_sent:
            live_sent = True
            for k in range(3):
                pub.publish("live/%d" % k, b"now", qos=1, pid=60000 + k)
        if len(outstanding) == window:
            if checks < 5 and len(seen) % 400 == 0:
                checks += 1
                if not sub.no_publish(0.1):
                    if b.is_mosquitto:
                        pytest.xfail("mosquitto 2.0.11 exceeds Receive Maximum (MQTT-3.3.4-9)")
                    raise AssertionError("a PUBLISH beyond the window")
            sub.send(puback(outstanding.pop(0)))
    for pid in outstanding:
        sub.send(puback(pid))
    assert sorted(seen) == ["d9/%04d" % i for i in range(n)]
    if not b.is_mosquitto:
        # flowing *during* delivery, not held until the 2,000 are through
        assert max(live_at.values()) < max(seen.values()), (live_at, max(seen.values()))
    sub.disconnect()
    pub.disconnect()


@pytest.mark.timeout(90)
def test_2000_retained_qos2_to_311_subscriber_within_broker_window_D9(broker_factory, request):
    """D9 for a 3.1.1 subscriber (no Receive Maximum): 2,000 QoS 2 retained
    messages reach a '#' QoS 2 subscriber, each once with RETAIN=1 at QoS 2
    through the full PUBREC/PUBREL/PUBCOMP flow, never more than the
    broker's window (max_inflight=8, contract) unacknowledged."""
    b = start_broker(
        broker_factory,
        request,
        mosq=["max_queued_messages 0", "max_inflight_messages 8"],
        max_queued=100,
        max_inflight=8,
    )
    n, window = 2000, 8
    pub = raw_connect(b.port, "d9q2pub", version=5)
    publish_batched(pub, [("q2/%04d" % i, b"v") for i in range(n)], qos=2, retain=True)
    t0 = time.monotonic()
    sub = raw_connect(b.port, "d9q2sub", version=4)
    assert sub.subscribe([("#", 2)]) == [2]
    seen = set()
    outstanding = []
    while len(seen) < n:
        assert time.monotonic() - t0 < 40, "only %d of %d in 40 s" % (len(seen), n)
        m = sub.expect_publish(5)
        assert m.retain and m.qos == 2 and m.topic not in seen, m
        seen.add(m.topic)
        outstanding.append(m)
        if len(outstanding) > window:
            if b.is_mosquitto:
                pytest.xfail("mosquitto 2.0.11 exceeds its inflight window")
            raise AssertionError("more than max_inflight=8 unacknowledged")
        if len(outstanding) == window or len(seen) == n:
            ack_publish(sub, outstanding.pop(0))
    for m in outstanding:
        ack_publish(sub, m)
    assert len(seen) == n
    sub.disconnect()
    pub.disconnect()


@pytest.mark.timeout(60)
def test_paced_retained_delivery_reads_the_live_store_D9_S1_S3(broker_factory):
    """D9 with S1/S3 (and L3's 'never a value older than the last one
    published'): while a paced '#' delivery of 1,000 retained messages is
    under way (Receive Maximum 5, window full), 150 not-yet-delivered topics
    are replaced and 150 deleted; from then on the retained copies carry the
    new value, deleted topics are not delivered, and every other topic
    still is. At most one message may already have been taken from the
    store into the session queue when the change lands."""
    # max_queued=800: its high water (400, where flow control would hold the
    # publisher) is above the 300 live forwards that arrive while the window
    # is full, still below the 1,000 retained
    b = broker_factory(max_queued=800)
    requires_edgebroker(b, "mosquitto copies the matching set into the queue at subscribe")
    n, window = 1000, 5
    topics = ["lv/%04d" % i for i in range(n)]
    pub = raw_connect(b.port, "lvpub", version=5)
    publish_batched(pub, [(t, b"old") for t in topics], retain=True)
    sub = raw_connect(b.port, "lvsub", version=5, props=prop_u16(RECEIVE_MAXIMUM, window))
    assert sub.subscribe([("#", 1)]) == [1]
    before = []
    outstanding = []
    while True:
        m = sub.expect_publish(5)
        before.append(m)
        outstanding.append(m.pid)
        if len(outstanding) == window:
            if len(before) >= 100:
                break
            sub.send(puback(outstanding.pop(0)))
    assert sub.no_publish(0.1)
    done = {m.topic for m in before}
    ahead = [t for t in topics if t not in done]
    replaced, deleted = set(ahead[0:300:2]), set(ahead[1:300:2])
    publish_batched(pub, [(t, b"new") for t in sorted(replaced)], retain=True)
    publish_batched(pub, [(t, b"") for t in sorted(deleted)], retain=True)
    for pid in outstanding:
        sub.send(puback(pid))
    after = drain_publishes(sub, 1.0)
    retained_after = [m for m in after if m.retain]
    stale = [
        (m.topic, m.payload)
        for m in retained_after
        if m.topic in deleted or (m.topic in replaced and m.payload != b"new")
    ]
    assert len(stale) <= 1, "stale retained values delivered after the change: %r" % stale[:10]
    delivered = done | {m.topic for m in retained_after}
    missing = set(topics) - deleted - delivered
    assert not missing, "never delivered: %r; received for them: %r" % (
        sorted(missing)[:10],
        [(m.topic, m.payload, m.retain) for m in before + after if m.topic in missing][:10],
    )
    live = [m for m in after if not m.retain]
    assert len(live) == 300  # the replacements and deletions, forwarded live
    sub.disconnect()
    pub.disconnect()


@pytest.mark.timeout(60)
def test_paced_retained_delivery_resumes_with_the_session_D1_D9_MQTT_4_4_0_1(
    broker_factory, request
):
    """D1/D9 across a reconnect: a persistent-session subscriber (Receive
    Maximum 5) that drops its connection after 100 of 1,000 retained
    messages gets, on resuming the session (Clean Start 0, no new
    SUBSCRIBE), the unacknowledged ones again (MQTT-4.4.0-1) and the rest
    of the matching set: every retained message is delivered at least once."""
    b = start_broker(broker_factory, request, mosq=["max_queued_messages 0"], max_queued=100)
    n, window = 1000, 5
    topics = ["rs9/%04d" % i for i in range(n)]
    pub = raw_connect(b.port, "rs9pub", version=5)
    publish_batched(pub, [(t, b"v") for t in topics], retain=True)
    sess = prop_u32(SESSION_EXPIRY_INTERVAL, 60) + prop_u16(RECEIVE_MAXIMUM, window)
    sub = raw_connect(b.port, "rs9sub", version=5, clean=True, props=sess)
    assert sub.subscribe([("rs9/#", 1)]) == [1]
    seen = set()
    outstanding = []
    while len(seen) < 100:
        m = sub.expect_publish(5)
        seen.add(m.topic)
        outstanding.append(m.pid)
        if len(outstanding) == window:
            sub.send(puback(outstanding.pop(0)))
    sub.close()  # dropped, 5 unacknowledged
    sub = raw_connect(b.port, "rs9sub", version=5, clean=False, props=sess)
    assert sub.connack.session_present
    t0 = time.monotonic()
    while len(seen) < n and time.monotonic() - t0 < 20:
        got = drain_publishes(sub, 1.0, limit=200)
        if not got:
            break
        seen.update(m.topic for m in got)
    missing = sorted(set(topics) - seen)
    assert not missing, "%d retained messages never delivered after the resume, e.g. %r" % (
        len(missing),
        missing[:5],
    )
    sub.disconnect()
    pub.disconnect()


def test_unsubscribe_stops_pending_retained_delivery_MQTT_3_10_4_2_D9(broker_factory):
    """UNSUBSCRIBE in the middle of a paced retained delivery (D9): the
    UNSUBACK is not held back by the full window (MQTT-3.3.4-10), the
    messages already sent complete normally (MQTT-3.10.4-3), and no further
    retained messages are added for the removed filter (MQTT-3.10.4-2) -
    at most one already taken into the session queue."""
    b = broker_factory(max_queued=100)
    requires_edgebroker(b, "mosquitto queues the whole matching set at subscribe")
    n, window = 1000, 5
    pub = raw_connect(b.port, "uspub", version=5)
    publish_batched(pub, [("us9/%04d" % i, b"v") for i in range(n)], retain=True)
    sub = raw_connect(b.port, "ussub", version=5, props=prop_u16(RECEIVE_MAXIMUM, window))
    assert sub.subscribe([("us9/#", 1)]) == [1]
    got = []
    outstanding = []
    while True:
        m = sub.expect_publish(5)
        got.append(m)
        outstanding.append(m.pid)
        if len(outstanding) == window:
            if len(got) >= 50:
                break
            sub.send(puback(outstanding.pop(0)))
    sub.send(unsubscribe_packet(9, ["us9/#"]))
    pid, codes, _ = sub.expect_unsuback(3)
    assert (pid, codes) == (9, [0])
    for p in outstanding:
        sub.send(puback(p))
    extra = drain_publishes(sub, 0.5)
    assert len(extra) <= 1, "%d retained messages delivered after UNSUBSCRIBE" % len(extra)
    sub.ping()
    sub.disconnect()
    pub.disconnect()


# ---------------------------------------------------------------------------
# 3. expiry


def test_retained_expires_after_its_interval_E1(broker):
    """E1: a retained message with Message Expiry Interval 1 s is delivered
    before it expires and not to subscribers after (5.0 3.3.2.3.3,
    MQTT-3.3.2-5); one without an interval stays."""
    pub = raw_connect(broker.port, "e1pub", version=5)
    pub.publish(
        "e1/short", b"x", qos=1, retain=True, pid=1, props=prop_u32(MESSAGE_EXPIRY_INTERVAL, 1)
    )
    pub.publish("e1/keep", b"y", qos=1, retain=True, pid=2)
    got = retained_of(broker.port, "e1/#", wait=0.2)
    assert sorted(m.topic for m in got) == ["e1/keep", "e1/short"]
    time.sleep(2.1)
    assert tpr(retained_of(broker.port, "e1/#")) == [("e1/keep", b"y", True)]
    pub.disconnect()


def test_retained_copy_carries_interval_minus_wait_E2_MQTT_3_3_2_6(broker):
    """E2: the copy sent carries the received interval minus the time it
    waited in the broker (MQTT-3.3.2-6): 10 s published, ~2 s later <= 8."""
    pub = raw_connect(broker.port, "e2pub", version=5)
    pub.publish(
        "e2/t", b"x", qos=1, retain=True, pid=1, props=prop_u32(MESSAGE_EXPIRY_INTERVAL, 10)
    )
    first = retained_of(broker.port, "e2/t")[0].props[MESSAGE_EXPIRY_INTERVAL]
    assert 9 <= first <= 10
    time.sleep(2.05)
    later = retained_of(broker.port, "e2/t")[0].props[MESSAGE_EXPIRY_INTERVAL]
    assert 6 <= later <= 8
    pub.disconnect()


def test_board_expiry_interval_is_default_own_interval_wins_E3(broker_factory, request):
    """E3: board expiry_interval=1 is the lifetime of retained messages
    without their own interval; a message's own interval (60 s, or 1 s on a
    board default of 60) always wins; 0 means never (default elsewhere)."""
    b = start_broker(broker_factory, request, expiry_interval=1)
    pub = raw_connect(b.port, "e3pub", version=5)
    pub.publish("e3/default", b"d", qos=1, retain=True, pid=1)
    pub.publish(
        "e3/own", b"o", qos=1, retain=True, pid=2, props=prop_u32(MESSAGE_EXPIRY_INTERVAL, 60)
    )
    b2 = start_broker(broker_factory, request, expiry_interval=60)
    pub2 = raw_connect(b2.port, "e3pub2", version=5)
    pub2.publish(
        "e3/own-short", b"s", qos=1, retain=True, pid=1, props=prop_u32(MESSAGE_EXPIRY_INTERVAL, 1)
    )
    pub2.publish("e3/default", b"d", qos=1, retain=True, pid=2)
    assert sorted(m.topic for m in retained_of(b.port, "e3/#", wait=0.2)) == [
        "e3/default",
        "e3/own",
    ]
    time.sleep(2.1)
    assert [m.topic for m in retained_of(b.port, "e3/#")] == ["e3/own"]
    assert [m.topic for m in retained_of(b2.port, "e3/#")] == ["e3/default"]
    pub.disconnect()
    pub2.disconnect()


# ---------------------------------------------------------------------------
# 4. limits and switches


@VERSIONS
def test_retain_available_false_refuses_retained_publish_L1_MQTT_3_2_2_14(
    broker_factory, request, version
):
    """L1: retain_available false -> CONNACK Retain Available = 0 (5.0); a
    PUBLISH with RETAIN=1 then gets DISCONNECT 0x9A Retain not supported
    (5.0) / the connection closed (3.1.1); nothing is stored, and
    non-retained publishing works."""
    b = start_broker(
        broker_factory, request, mosq=["retain_available false"], retain_available=False
    )
    ok = raw_connect(b.port, "l1ok", version=5)
    assert ok.connack.props.get(RETAIN_AVAILABLE) == 0
    assert ok.publish("l1/t", b"plain", qos=1, pid=1) in (0x00, 0x10)  # 0x10: no subscribers
    c = raw_connect(b.port, "l1-%d" % version, version=version)
    c.send(publish_packet("l1/t", b"retained", qos=1, retain=True, pid=2, version=version))
    if version == 5:
        assert c.expect_disconnect()[0] == 0x9A
    assert c.closed(3)
    assert retained_of(b.port, "l1/#", version=4) == []
    ok.disconnect()


def test_max_retained_messages_full_forwards_but_does_not_store_L2(broker_factory, request):
    """L2: max_retained_messages=3: a 4th topic's retained message is
    forwarded to current subscribers as normal but not stored; an existing
    topic can still be replaced and deleted, and a deletion frees a place."""
    b = start_broker(broker_factory, request, max_retained_messages=3)
    live = subscriber(b.port, "l2/#", 1, version=5, client_id="l2live")
    pub = raw_connect(b.port, "l2pub", version=5)
    for i in range(1, 5):
        assert pub.publish("l2/%d" % i, b"v1", qos=1, retain=True, pid=i) == 0
    assert [m.topic for m in recv_publishes(live, 4)] == ["l2/1", "l2/2", "l2/3", "l2/4"]
    assert sorted(m.topic for m in retained_of(b.port, "l2/#")) == ["l2/1", "l2/2", "l2/3"]
    pub.publish("l2/1", b"v2", qos=1, retain=True, pid=5)  # replace: allowed
    pub.publish("l2/2", b"", qos=1, retain=True, pid=6)  # delete: allowed
    pub.publish("l2/5", b"v1", qos=1, retain=True, pid=7)  # fits again
    pub.publish("l2/6", b"v1", qos=1, retain=True, pid=8)  # full again
    got = {m.topic: m.payload for m in retained_of(b.port, "l2/#")}
    assert got == {"l2/1": b"v2", "l2/3": b"v1", "l2/5": b"v1"}
    assert len(recv_publishes(live, 4)) == 4
    live.disconnect()
    pub.disconnect()


@pytest.mark.parametrize("storage_type", ["ram", "disc_only"])
def test_expired_retained_messages_do_not_keep_places_in_a_full_store_L2_E1(
    broker_factory, request, storage_type
):
    """L2 / E1 (MQTT-3.3.2-5: a retained message whose Message Expiry
    Interval has passed is no longer the topic's retained message).

    Defect (soak audit F4): expired retained messages kept their places in
    max_retained_messages until the once-a-second sweep (64 entries a
    second) reached them, so a store full of expired-but-unswept messages
    refused new retained topics (refusals/retained_full, message not
    stored) although none of its messages was alive. Fixed: a full store
    sweeps its expired messages before it refuses.

    max_retained_messages=400 (far more than the sweep's 64 a second can
    reach in the wait: with 50 the regular sweep alone would empty it): 400
    retained topics with Message Expiry Interval 1 s, ~2.5 s later 400 NEW
    retained topics: every one is stored (a new subscriber to # gets
    exactly the 400 new ones, no expired one; $SYS retained/count is 400)
    and no retained_full refusal is counted ($SYS) or logged. RAM store
    and flash store (disc_only, compaction held off: a compaction also
    drops every expired message, and one starting at the sweep's second
    pass hid the defect there)."""
    n = 400
    extra = {}
    if storage_type == "disc_only":
        # no compaction (it drops every expired message at once, and the
        # 2nd sweep's DELs would start one): the sweep alone frees places
        extra["compact_min_bytes"] = 1073741824
    b = start_broker(broker_factory, request, max_retained_messages=n, sys_interval=1,
                     storage_type=storage_type, **extra)
    requires_edgebroker(b)
    pub = raw_connect(b.port, "xfpub", version=5)
    exp1 = prop_u32(MESSAGE_EXPIRY_INTERVAL, 1)
    # QoS 0 in bulk, then a QoS 1 PUBLISH: its PUBACK says all were taken
    pub.send(b"".join(publish_packet("xold/%d" % i, b"old", qos=0, retain=True, props=exp1)
                      for i in range(n)))
    assert pub.publish("xmark", b"m", qos=1, pid=1) == 0
    assert len(retained_of(b.port, "xold/#", qos=0, wait=0.5)) == n  # precondition: all stored
    time.sleep(2.5)  # every one has expired
    pub.send(b"".join(publish_packet("xnew/%d" % i, b"new", qos=0, retain=True)
                      for i in range(n)))
    assert pub.publish("xmark", b"m", qos=1, pid=2) == 0
    got = sorted(m.topic for m in retained_of(b.port, "#", qos=0, wait=0.5))
    want = sorted("xnew/%d" % i for i in range(n))
    missing = sorted(set(want) - set(got), key=lambda t: int(t.split("/")[1]))
    assert not missing, "%d new retained topics not stored, e.g. %r" % (len(missing), missing[:5])
    assert got == want, [t for t in got if not t.startswith("xnew/")][:5]
    w = SysWatcher(b.port, "$SYS/broker/#")
    try:
        # two $SYS passes begun: the first one's values have all arrived
        v = w.wait(lambda v: len(w.history.get("$SYS/broker/uptime", ())) >= 2, timeout=5.0)
    finally:
        w.close()
    assert sys_int(v, "retained/count") == n, v
    assert sys_int(v, "refusals/retained_full") is None, v
    assert "retained_full" not in b.log_text()
    pub.disconnect()


def test_max_payload_size_larger_retained_forwarded_not_stored_old_dropped_L3(
    broker_factory, request
):
    """L3: max_payload_size=100: a larger retained message is forwarded as a
    normal message and not stored, and the topic's older retained value is
    dropped too (never hand out a value older than the last published)."""
    b = start_broker(broker_factory, request, max_payload_size=100)
    live = subscriber(b.port, "l3/#", 1, version=5, client_id="l3live")
    pub = raw_connect(b.port, "l3pub", version=5)
    pub.publish("l3/t", b"small", qos=1, retain=True, pid=1)
    pub.publish("l3/u", b"x" * 100, qos=1, retain=True, pid=2)  # exactly the limit: stored
    assert sorted(m.topic for m in retained_of(b.port, "l3/#")) == ["l3/t", "l3/u"]
    pub.publish("l3/t", b"L" * 101, qos=1, retain=True, pid=3)
    got = recv_publishes(live, 3)
    assert [(m.topic, len(m.payload)) for m in got] == [("l3/t", 5), ("l3/u", 100), ("l3/t", 101)]
    assert [m.topic for m in retained_of(b.port, "l3/#")] == ["l3/u"]
    live.disconnect()
    pub.disconnect()


def test_store_budget_bytes_full_behaves_like_L2_L4(broker_factory, request):
    """L4: store_budget_bytes=1000 with 200-byte payloads: some messages are
    stored (at most 4), the rest forwarded but not stored (as L2); a stored
    topic can be replaced with an equal-sized value and deleted, which
    frees room; $SYS retained/bytes never exceeds the budget."""
    b = start_broker(broker_factory, request, store_budget_bytes=1000, sys_interval=1)
    live = subscriber(b.port, "l4/#", 1, version=5, client_id="l4live")
    pub = raw_connect(b.port, "l4pub", version=5)
    for i in range(10):
        pub.publish("l4/%d" % i, (b"%d" % i) * 200, qos=1, retain=True, pid=i + 1)
    assert len(recv_publishes(live, 10)) == 10
    stored = sorted(m.topic for m in retained_of(b.port, "l4/#"))
    assert 1 <= len(stored) <= 4, stored
    first = stored[0]
    pub.publish(first, b"R" * 200, qos=1, retain=True, pid=20)
    got = {m.topic: m.payload for m in retained_of(b.port, "l4/#")}
    assert sorted(got) == stored and got[first] == b"R" * 200
    pub.publish(first, b"", qos=1, retain=True, pid=21)
    pub.publish("l4/new", b"N" * 200, qos=1, retain=True, pid=22)
    got = sorted(m.topic for m in retained_of(b.port, "l4/#"))
    assert got == sorted(set(stored) - {first} | {"l4/new"})
    w = SysWatcher(b.port)
    try:
        v = w.wait(lambda v: sys_int(v, "retained/count") == len(got), timeout=3.5)
        assert 0 < sys_int(v, "retained/bytes") <= 1000
    finally:
        w.close()
    live.disconnect()
    pub.disconnect()


def test_retained_refusals_counted_in_sys_and_logged_once_per_cause_L5(broker_factory, request):
    """L5: every retained refusal is counted under $SYS/broker/refusals/<cause>
    (docs/contract.md; or $SYS/broker/retained/...) and logged once per
    cause: max_retained_messages=1 -> 2 'full' refusals, max_payload_size=10
    -> 1 'too large' refusal, sys_interval=1."""
    b = start_broker(
        broker_factory, request, max_retained_messages=1, max_payload_size=10, sys_interval=1
    )
    pub = raw_connect(b.port, "l5pub", version=5)
    pub.publish("l5/a", b"ok", qos=1, retain=True, pid=1)
    pub.publish("l5/b", b"full1", qos=1, retain=True, pid=2)
    pub.publish("l5/c", b"full2", qos=1, retain=True, pid=3)
    pub.publish("l5/a", b"x" * 50, qos=1, retain=True, pid=4)

    def refusal_counters(v):
        out = {}
        for t, val in v.items():
            if t.startswith("$SYS/broker/refusals/") or (
                t.startswith("$SYS/broker/retained/")
                and t.rsplit("/", 1)[1] not in ("count", "bytes")
            ):
                out[t] = int(val)
        return out

    w = SysWatcher(b.port)
    try:
        v = w.wait(lambda v: sorted(refusal_counters(v).values()) == [1, 2], timeout=3.5)
    finally:
        w.close()
    counters = refusal_counters(v)
    assert len(counters) == 2, counters
    log = b.log_text().splitlines()
    refusal_lines = [line for line in log if "refus" in line.lower()]
    assert len(refusal_lines) == 2, "expected one log line per cause: %r" % refusal_lines
    pub.disconnect()


# ---------------------------------------------------------------------------
# real clients


def test_retained_with_mosquitto_pub_and_mosquitto_sub_S1_S3_D1(broker):
    """mosquitto_pub -r stores (S1), mosquitto_sub receives it with the
    retained flag at the stored QoS (D1, D2), mosquitto_pub -r -n deletes
    it (S3); both protocol versions."""
    mosquitto_pub(broker.port, ["-t", "mq/r", "-m", "hello", "-q", "1", "-r"], version=4)
    mosquitto_pub(broker.port, ["-t", "mq/r", "-m", "hello2", "-q", "1", "-r"], version=5)
    for version in (4, 5):
        lines = mosquitto_sub(
            broker.port,
            ["-t", "mq/#", "-q", "2", "-F", "%r %q %t %p"],
            count=1,
            timeout=3,
            version=version,
        )
        assert lines == ["1 1 mq/r hello2"]
    mosquitto_pub(broker.port, ["-t", "mq/r", "-r", "-n"], version=5)
    assert mosquitto_sub(broker.port, ["-t", "mq/#", "--retained-only"], count=1, timeout=1) == []


def test_retained_with_aiomqtt_properties_and_qos_S6_D2(broker):
    """aiomqtt 5.0 publishes a retained QoS 1 message with a User Property;
    an aiomqtt 5.0 subscriber (QoS 2) and an aiomqtt 3.1.1 subscriber
    (QoS 0) receive it with retain=True at QoS 1 / 0, the 5.0 one with the
    property (S6, D2)."""
    import aiomqtt
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    async def run():
        props = Properties(PacketTypes.PUBLISH)
        props.UserProperty = [("sensor", "t1")]
        async with aiomqtt.Client(
            HOST, broker.port, identifier="aio-rpub", protocol=aiomqtt.ProtocolVersion.V5
        ) as p:
            await p.publish("aio/r", b"21.5", qos=1, retain=True, properties=props)
        out = []
        for ident, proto, q in (
            ("aio-r5", aiomqtt.ProtocolVersion.V5, 2),
            ("aio-r4", aiomqtt.ProtocolVersion.V311, 0),
        ):
            async with aiomqtt.Client(HOST, broker.port, identifier=ident, protocol=proto) as c:
                await c.subscribe("aio/#", qos=q)
                async for m in c.messages:
                    up = getattr(m.properties, "UserProperty", None) if m.properties else None
                    out.append((m.topic.value, bytes(m.payload), bool(m.retain), m.qos, up))
                    break
        return out

    got = run_async(run(), 20)
    assert got[0] == ("aio/r", b"21.5", True, 1, [("sensor", "t1")])
    assert got[1][:4] == ("aio/r", b"21.5", True, 0)

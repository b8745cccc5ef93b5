"""Publish / subscribe: QoS flows, inflight window, topic matching, the
subscription table (replace, unsubscribe, limits, refusals), ordering,
fan-out and slow consumers.

Every test runs under both interpreters (``interp`` via ``broker`` /
``broker_factory``). Spec statements are MQTT 5.0 unless marked 3.1.1.
Profile keys and refusal codes: docs/contract.md.
"""

import subprocess
import threading
import time
from pathlib import Path

import pytest
from helpers_pubsub import (
    SlowReader,
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
    DISCONNECT,
    HOST,
    PUBACK,
    PUBCOMP,
    PUBREC,
    PUBREL,
    RECEIVE_MAXIMUM,
    SUBSCRIPTION_IDENTIFIER,
    mosquitto_sub_bg,
    paho_client,
    parse_ack,
    parse_suback,
    prop_u16,
    prop_varint,
    puback,
    pubcomp,
    publish_packet,
    pubrec,
    pubrel,
    raw_connect,
    requires_edgebroker,
    run_async,
    subscribe_packet,
    unsubscribe_packet,
)

VERSIONS = pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])


# ---------------------------------------------------------------------------
# QoS 0 / 1 / 2 in both directions


@VERSIONS
@pytest.mark.parametrize("sub_qos", [0, 1, 2], ids=["sub0", "sub1", "sub2"])
@pytest.mark.parametrize("pub_qos", [0, 1, 2], ids=["pub0", "pub1", "pub2"])
def test_qos_flows_and_downgrade_to_min_MQTT_3_8_4_8(broker, version, pub_qos, sub_qos):
    """Publisher -> broker at each QoS (no ack / PUBACK / PUBREC-PUBREL-PUBCOMP,
    MQTT-3.3.4-1, MQTT-4.3.2-4, MQTT-4.3.3-8/11) and broker -> subscriber at
    min(publish QoS, granted QoS) (5.0 MQTT-3.8.4-8, 3.1.1 MQTT-3.8.4-6),
    with a non-zero packet id for QoS > 0 (MQTT-2.2.1-4), none for QoS 0
    (MQTT-2.2.1-2) and DUP=0 on a first delivery (MQTT-4.3.1-1, 4.3.2-2, 4.3.3-2)."""
    sub = subscriber(broker.port, "qos/t", sub_qos, version=version, client_id="qs-%d" % version)
    pub = raw_connect(broker.port, "qp-%d" % version, version=version)
    pid = 4242
    pub.send(
        publish_packet("qos/t", b"m", qos=pub_qos, pid=pid if pub_qos else None, version=version)
    )
    if pub_qos == 1:
        rpid, reason, _ = pub.expect_ack(PUBACK)
        assert (rpid, reason) == (pid, 0)
    elif pub_qos == 2:
        rpid, reason, _ = pub.expect_ack(PUBREC)
        assert (rpid, reason) == (pid, 0)
        pub.send(pubrel(pid, version))
        rpid, reason, _ = pub.expect_ack(PUBCOMP)
        assert (rpid, reason) == (pid, 0)
    m = sub.expect_publish()
    want = min(pub_qos, sub_qos)
    assert (m.topic, m.payload, m.qos, m.dup, m.retain) == ("qos/t", b"m", want, False, False)
    if want:
        assert m.pid and 0 < m.pid <= 65535
    else:
        assert m.pid is None
    ack_publish(sub, m)
    assert sub.no_publish(0.2), "message delivered more than once"
    pub.disconnect()
    sub.disconnect()


def test_qos2_end_to_end_with_paho_aiomqtt_and_mosquitto_clients(broker):
    """Real clients at QoS 2 both ways: paho (5.0) -> aiomqtt (5.0) and
    mosquitto_pub (3.1.1) -> mosquitto_sub (5.0); each message exactly once
    at QoS 2 (MQTT-4.3.3)."""
    import aiomqtt

    msub = mosquitto_sub_bg(
        broker.port, ["-t", "e2e/#", "-q", "2", "-F", "%q %t %p"], count=2, timeout=8
    )
    msub.wait_subscribed()
    ready = threading.Event()

    async def aio_sub():
        async with aiomqtt.Client(
            HOST, broker.port, identifier="aio-e2e", protocol=aiomqtt.ProtocolVersion.V5
        ) as c:
            await c.subscribe("e2e/#", qos=2)
            ready.set()
            got = []
            async for msg in c.messages:
                got.append((msg.qos, msg.topic.value, bytes(msg.payload)))
                if len(got) == 2:
                    return got
        return None

    result = {}
    t = threading.Thread(
        target=lambda: result.setdefault("aio", run_async(aio_sub(), 15)), daemon=True
    )
    t.start()
    assert ready.wait(10), "aiomqtt did not subscribe"
    p = paho_client(broker.port, "paho-e2e", protocol=5)
    try:
        p.publish_wait("e2e/paho", b"from-paho", qos=2)
    finally:
        p.close()
    r = subprocess.run(
        [
            "mosquitto_pub",
            "-h",
            HOST,
            "-p",
            str(broker.port),
            "-V",
            "mqttv311",
            "-t",
            "e2e/mosq",
            "-m",
            "from-mosq",
            "-q",
            "2",
        ],
        capture_output=True,
        timeout=10,
    )
    assert r.returncode == 0, r.stderr
    t.join(15)
    assert sorted(result["aio"]) == [(2, "e2e/mosq", b"from-mosq"), (2, "e2e/paho", b"from-paho")]
    rc, lines = msub.result()
    assert rc == 0 and sorted(lines) == ["2 e2e/mosq from-mosq", "2 e2e/paho from-paho"]


# ---------------------------------------------------------------------------
# inbound QoS 2: exactly once


@VERSIONS
def test_inbound_qos2_resent_publish_with_dup_not_delivered_twice_MQTT_4_3_3_10(broker, version):
    """A PUBLISH resent with DUP=1 and the same packet id before PUBREL is
    acknowledged with PUBREC again and not delivered a second time
    (5.0 MQTT-4.3.3-10, 3.1.1 MQTT-4.3.3-2); after PUBCOMP the same packet
    id starts a new message (MQTT-4.3.3-12)."""
    sub = subscriber(broker.port, "x2/t", 2, version=5, client_id="x2sub")
    pub = raw_connect(broker.port, "x2pub-%d" % version, version=version)
    pub.send(publish_packet("x2/t", b"once", qos=2, pid=5, version=version))
    assert pub.expect_ack(PUBREC)[:2] == (5, 0)
    pub.send(publish_packet("x2/t", b"once", qos=2, pid=5, dup=True, version=version))
    assert pub.expect_ack(PUBREC)[:2] == (5, 0)
    pub.send(pubrel(5, version))
    assert pub.expect_ack(PUBCOMP)[0] == 5
    got = drain_publishes(sub, 0.4)
    assert [p.payload for p in got] == [b"once"]
    # MQTT-4.3.3-12: after PUBCOMP, packet id 5 is a new publication
    pub.publish("x2/t", b"again", qos=2, pid=5)
    got = drain_publishes(sub, 0.4)
    assert [p.payload for p in got] == [b"again"]
    pub.disconnect()
    sub.disconnect()


@VERSIONS
def test_inbound_qos2_repeated_pubrel_answered_not_redelivered_MQTT_4_3_3_11(broker, version):
    """A repeated PUBREL (after the PUBCOMP) is answered with PUBCOMP
    (MQTT-4.3.3-11; 5.0 may say 0x92 Packet Identifier not found) and does
    not deliver the message again."""
    sub = subscriber(broker.port, "rel/t", 2, version=5, client_id="relsub")
    pub = raw_connect(broker.port, "relpub-%d" % version, version=version)
    pub.send(publish_packet("rel/t", b"one", qos=2, pid=9, version=version))
    assert pub.expect_ack(PUBREC)[0] == 9
    pub.send(pubrel(9, version))
    assert pub.expect_ack(PUBCOMP)[:2] == (9, 0)
    pub.send(pubrel(9, version))
    rpid, reason, _ = pub.expect_ack(PUBCOMP)
    assert rpid == 9 and reason in (0x00, 0x92)
    pub.send(pubrel(9, version))
    assert pub.expect_ack(PUBCOMP)[0] == 9
    got = drain_publishes(sub, 0.4)
    assert [p.payload for p in got] == [b"one"]
    assert pub.is_open(0.2)
    pub.disconnect()
    sub.disconnect()


@VERSIONS
def test_inbound_qos2_state_released_after_20_publishes_MQTT_4_3_3_12(
    broker_factory, request, version
):
    """20 QoS 2 publishes (distinct packet ids, more than the broker's
    Receive Maximum of 4 here, then one id reused) each complete; afterwards
    the same client still publishes and receives at QoS 1 and 2: the
    per-packet-id state is released at PUBREL (MQTT-4.3.3-12), not leaked
    (BeehiveMQTT stopped delivering after 10)."""
    b = start_broker(broker_factory, request, mosq=[], max_inflight=4)
    other = subscriber(b.port, "many/in", 2, version=5, client_id="many-other")
    c = raw_connect(b.port, "many-%d" % version, version=version)
    assert c.subscribe([("many/echo", 2)]) == [2]
    for i in range(20):
        assert c.publish("many/in", b"%d" % i, qos=2, pid=i + 1) == 0
    for i in range(20, 25):
        assert c.publish("many/in", b"%d" % i, qos=2, pid=7) == 0
    got = recv_publishes(other, 25)
    assert [p.payload for p in got] == [b"%d" % i for i in range(25)]
    assert other.no_publish(0.2)
    # the same client still works at QoS 1 and 2, both directions
    assert c.publish("many/echo", b"q1", qos=1, pid=300) == 0
    m = c.expect_publish()
    assert (m.payload, m.qos) == (b"q1", 1)
    ack_publish(c, m)
    assert c.publish("many/echo", b"q2", qos=2, pid=301) == 0
    m = c.expect_publish()
    assert (m.payload, m.qos) == (b"q2", 2)
    ack_publish(c, m)
    c.disconnect()
    other.disconnect()


# ---------------------------------------------------------------------------
# outbound QoS 2 and the inflight window


@VERSIONS
def test_outbound_qos2_flow_pubrec_pubrel_pubcomp_MQTT_4_3_3_4(broker, version):
    """Broker as QoS 2 sender: PUBLISH (DUP=0, MQTT-4.3.3-2) -> PUBREC from the
    client -> PUBREL with the same packet id and flags 0010 (MQTT-4.3.3-4,
    MQTT-3.6.1-1) -> PUBCOMP; the PUBLISH is not re-sent after the PUBREL
    (MQTT-4.3.3-6); the next message then flows."""
    sub = subscriber(broker.port, "o2/t", 2, version=version, client_id="o2sub-%d" % version)
    pub = raw_connect(broker.port, "o2pub", version=5)
    pub.publish("o2/t", b"first", qos=2, pid=1)
    m = sub.expect_publish()
    assert (m.payload, m.qos, m.dup) == (b"first", 2, False) and m.pid
    # nothing else before our PUBREC
    assert sub.no_publish(0.2)
    sub.send(pubrec(m.pid, version))
    rel = sub.expect(PUBREL)
    assert rel.flags == 0x02
    assert parse_ack(rel.body, version)[:2] == (m.pid, 0)
    assert sub.no_publish(0.3), "PUBLISH re-sent after PUBREL (MQTT-4.3.3-6)"
    sub.send(pubcomp(m.pid, version))
    pub.publish("o2/t", b"second", qos=2, pid=2)
    m2 = sub.expect_publish()
    assert (m2.payload, m2.qos) == (b"second", 2)
    ack_publish(sub, m2)
    assert sub.no_publish(0.2)
    pub.disconnect()
    sub.disconnect()


def test_outbound_window_follows_receive_maximum_2_MQTT_3_3_4_9_MQTT_4_9_0_2(broker):
    """A 5.0 subscriber with Receive Maximum 2 that does not acknowledge gets
    exactly 2 QoS 1 messages (MQTT-3.3.4-9, MQTT-4.9.0-2); other packets are
    still answered while the quota is zero (MQTT-4.9.0-3, MQTT-3.3.4-10);
    each PUBACK lets exactly one more out, and all N arrive in order
    (MQTT-4.6.0-5) - none is stranded in a queue while the client stays
    connected."""
    n = 10
    sub = raw_connect(broker.port, "rm2", version=5, props=prop_u16(RECEIVE_MAXIMUM, 2))
    assert sub.subscribe([("win/t", 1)]) == [1]
    pub = raw_connect(broker.port, "rm2pub", version=5)
    for i in range(n):
        assert pub.publish("win/t", b"%d" % i, qos=1, pid=i + 1) == 0
    outstanding = [sub.expect_publish(), sub.expect_publish()]
    received = list(outstanding)
    assert sub.no_publish(0.4), "a third QoS 1 PUBLISH exceeded Receive Maximum 2"
    sub.ping()  # MQTT-4.9.0-3: PINGRESP despite a zero send quota
    while len(received) < n:
        done = outstanding.pop(0)
        sub.send(puback(done.pid))
        p = sub.expect_publish()
        outstanding.append(p)
        received.append(p)
        if len(received) < n and not sub.no_publish(0.15):
            if broker.is_mosquitto:
                pytest.xfail("mosquitto 2.0.11 releases two PUBLISHes per PUBACK (MQTT-3.3.4-9)")
            raise AssertionError("more than one PUBLISH released by one PUBACK")
    for p in outstanding:
        sub.send(puback(p.pid))
    assert [p.payload for p in received] == [b"%d" % i for i in range(n)]
    assert all(p.qos == 1 and not p.dup for p in received)
    assert len({p.pid for p in received[:2]}) == 2
    assert sub.no_publish(0.2)
    pub.disconnect()
    sub.disconnect()


# ---------------------------------------------------------------------------
# topic tree

TOPICS = ["a", "b", "ab", "a/b", "a/", "a/b/c", "a/b/d", "/a", "y/x", "$x/x", "$foo", "$foo/bar"]
NON_DOLLAR = {t for t in TOPICS if not t.startswith("$")}
MATCHES = {
    "a/#": {"a", "a/", "a/b", "a/b/c", "a/b/d"},  # '#' includes the parent level (4.7.1.2)
    "a/+": {"a/b", "a/"},  # '+' matches an empty level
    "+": {"a", "b", "ab"},
    "+/+": {"a/b", "a/", "/a", "y/x"},
    "+/+/+": {"a/b/c", "a/b/d"},
    "a/+/c": {"a/b/c"},
    "/+": {"/a"},
    "+/x": {"y/x"},  # not $x/x (MQTT-4.7.2-1)
    "#": NON_DOLLAR,  # no $-topics (MQTT-4.7.2-1)
    "+/#": NON_DOLLAR,
    "$x/+": {"$x/x"},
    "$foo/#": {"$foo", "$foo/bar"},
    "a/b/c": {"a/b/c"},
}


def test_topic_filter_matching_wildcards_MQTT_4_7_1_MQTT_4_7_2_1(broker):
    """'+' and '#' matching (4.7.1): 'a/#' matches 'a'; '+' matches one
    (possibly empty) level; filters starting with a wildcard do not match
    topics starting with '$' (MQTT-4.7.2-1: '#' not '$foo', '+/x' not '$x/x'),
    while explicit '$x/+' and '$foo/#' do. One subscriber per filter; every
    topic published once at QoS 1, then an end marker."""
    subs = {}
    for i, flt in enumerate(MATCHES):
        c = raw_connect(broker.port, "tm%d" % i, version=4)
        assert c.subscribe([(flt, 0), ("zz/end", 0)]) == [0, 0]
        subs[flt] = c
    pub = raw_connect(broker.port, "tm-pub", version=4)
    for k, t in enumerate(TOPICS):
        assert pub.publish(t, t.encode(), qos=1, pid=k + 1) == 0
    pub.publish("zz/end", b"end", qos=1, pid=999)
    problems = []
    for flt, c in subs.items():
        got = []
        while True:
            p = c.expect_publish(5)
            if p.topic == "zz/end":
                break
            got.append(p.topic)
        if set(got) != MATCHES[flt] or len(got) != len(set(got)):
            problems.append("%r got %r, expected %r" % (flt, sorted(got), sorted(MATCHES[flt])))
        c.disconnect()
    assert not problems, "\n".join(problems)
    pub.disconnect()


def test_wildcards_do_not_match_sys_topics_MQTT_4_7_2_1(broker_factory, request):
    """'#' and '+/broker/#' never deliver $SYS/... (retained or live), while
    '$SYS/#' does (MQTT-4.7.2-1; sys_interval 1 so $SYS is published)."""
    b = start_broker(broker_factory, request, mosq=["sys_interval 1"], sys_interval=1)
    hash_sub = subscriber(b.port, "#", 0, version=5, client_id="hash")
    plus_sub = subscriber(b.port, "+/broker/#", 0, version=4, client_id="plus")
    w = SysWatcher(b.port)
    try:
        w.wait(lambda v: len(v) >= 3, timeout=3.5)
        time.sleep(1.1)  # one more $SYS round while everyone is subscribed
        assert [p.topic for p in drain_publishes(hash_sub, 0.2)] == []
        assert [p.topic for p in drain_publishes(plus_sub, 0.2)] == []
    finally:
        w.close()
    hash_sub.disconnect()
    plus_sub.disconnect()


# ---------------------------------------------------------------------------
# overlapping subscriptions, No Local, Retain As Published


@VERSIONS
def test_overlapping_subscriptions_max_qos_and_all_ids_MQTT_3_3_4_2_to_5(broker, version):
    """A message matching several subscriptions of one session is delivered
    respecting the maximum QoS of the matches (MQTT-3.3.4-2; 3.1.1
    MQTT-3.3.5-1), carrying every matching Subscription Identifier: all in
    one copy (MQTT-3.3.4-3/4) or one per copy (MQTT-3.3.4-5). edgebroker
    documents one copy per session at the highest QoS (lib/edgebroker.py,
    publish()): asserted exactly for it."""
    c = raw_connect(broker.port, "ov-%d" % version, version=version)
    if version == 5:
        assert c.subscribe([("ov/+", 0)], pid=1, props=prop_varint(SUBSCRIPTION_IDENTIFIER, 1)) == [
            0
        ]
        assert c.subscribe([("ov/#", 2)], pid=2, props=prop_varint(SUBSCRIPTION_IDENTIFIER, 2)) == [
            2
        ]
    else:
        assert c.subscribe([("ov/+", 0)], pid=1) == [0]
        assert c.subscribe([("ov/#", 2)], pid=2) == [2]
    assert c.subscribe([("ov/x", 1)], pid=3) == [1]  # no identifier
    pub = raw_connect(broker.port, "ov-pub", version=5)
    pub.publish("ov/x", b"ov", qos=2, pid=1)
    copies = drain_publishes(c, 0.5)
    assert copies, "no copy delivered"
    assert all(p.payload == b"ov" and p.topic == "ov/x" for p in copies)
    if broker.is_mosquitto and version == 4 and max(p.qos for p in copies) != 2:
        pytest.xfail(
            "mosquitto 2.0.11 sends one 3.1.1 copy at a QoS below the maximum (MQTT-3.3.5-1)"
        )
    assert max(p.qos for p in copies) == 2
    if version == 5:
        ids = [p.props.get(SUBSCRIPTION_IDENTIFIER, []) for p in copies]
        if len(copies) == 1:
            assert sorted(ids[0]) == [1, 2]
        else:
            assert all(len(i) <= 1 for i in ids)
            assert sorted(x for i in ids for x in i) == [1, 2]
    if not broker.is_mosquitto:
        assert len(copies) == 1, "edgebroker sends one copy per session: %r" % (copies,)
    c.disconnect()
    pub.disconnect()


def test_no_local_publisher_not_echoed_MQTT_3_8_3_3(broker):
    """No Local=1: the publisher's own messages are not forwarded back to it
    (MQTT-3.8.3-3); another client's messages still are; a second client
    without No Local gets both."""
    a = paho_client(broker.port, "nl-a", protocol=5)
    b = paho_client(broker.port, "nl-b", protocol=5)
    try:
        assert a.subscribe_wait("nl/t", qos=1, no_local=True) == [1]
        assert b.subscribe_wait("nl/t", qos=1) == [1]
        a.publish_wait("nl/t", b"from-a", qos=1)
        b.publish_wait("nl/t", b"from-b", qos=1)
        assert [m.payload for m in b.wait_messages(2)] == [b"from-a", b"from-b"]
        assert [m.payload for m in a.wait_messages(1)] == [b"from-b"]
        assert a.no_message(0.3)
    finally:
        a.close()
        b.close()


def test_retain_as_published_keeps_received_flag_D3_MQTT_3_3_1_13(broker):
    """aiomqtt subscriber with Retain As Published=1 (D3): a live message
    keeps the RETAIN flag it was published with - 1 for a retained
    publication, 0 for a normal one (MQTT-3.3.1-13); the same messages to a
    subscription without the option arrive with RETAIN=0 (MQTT-3.3.1-12)."""
    import aiomqtt
    from paho.mqtt.subscribeoptions import SubscribeOptions

    ready = threading.Event()

    async def run():
        async with aiomqtt.Client(
            HOST, broker.port, identifier="aio-rap", protocol=aiomqtt.ProtocolVersion.V5
        ) as c:
            await c.subscribe("rap/#", options=SubscribeOptions(qos=1, retainAsPublished=True))
            ready.set()
            got = []
            async for m in c.messages:
                got.append((m.topic.value, bytes(m.payload), bool(m.retain)))
                if len(got) == 2:
                    return got
        return None

    res = {}
    t = threading.Thread(target=lambda: res.setdefault("v", run_async(run(), 15)), daemon=True)
    t.start()
    assert ready.wait(10)
    plain = paho_client(broker.port, "rap-plain", protocol=5)
    pub = paho_client(broker.port, "rap-pub", protocol=5)
    try:
        assert plain.subscribe_wait("rap/#", qos=1) == [1]
        pub.publish_wait("rap/live", b"normal", qos=1, retain=False)
        pub.publish_wait("rap/kept", b"retained", qos=1, retain=True)
        t.join(15)
        assert res["v"] == [("rap/live", b"normal", False), ("rap/kept", b"retained", True)]
        got = [(m.topic, m.payload, bool(m.retain)) for m in plain.wait_messages(2)]
        assert got == [("rap/live", b"normal", False), ("rap/kept", b"retained", False)]
        pub.publish_wait("rap/kept", b"", qos=1, retain=True)  # clean up the retained message
    finally:
        plain.close()
        pub.close()


# ---------------------------------------------------------------------------
# the subscription table


@VERSIONS
def test_repeated_subscribe_replaces_subscription_qos_updated_MQTT_3_8_4_3(broker, version):
    """SUBSCRIBE with an existing filter replaces that subscription
    (MQTT-3.8.4-3): the new granted QoS applies, the message is delivered
    once (not once per SUBSCRIBE), and one UNSUBSCRIBE removes it."""
    c = raw_connect(broker.port, "rs-%d" % version, version=version)
    pub = raw_connect(broker.port, "rs-pub", version=5)
    assert c.subscribe([("rs/t", 0)], pid=1) == [0]
    pub.publish("rs/t", b"a", qos=2, pid=1)
    got = drain_publishes(c, 0.3)
    assert [(p.payload, p.qos) for p in got] == [(b"a", 0)]
    assert c.subscribe([("rs/t", 2)], pid=2) == [2]
    pub.publish("rs/t", b"b", qos=2, pid=2)
    got = drain_publishes(c, 0.3)
    assert [(p.payload, p.qos) for p in got] == [(b"b", 2)]
    assert c.subscribe([("rs/t", 1)], pid=3) == [1]
    pub.publish("rs/t", b"c", qos=2, pid=3)
    got = drain_publishes(c, 0.3)
    assert [(p.payload, p.qos) for p in got] == [(b"c", 1)]
    c.send(unsubscribe_packet(4, ["rs/t"], version=version))
    pid, codes, _ = c.expect_unsuback()
    assert pid == 4 and codes == ([0] if version == 5 else [])
    pub.publish("rs/t", b"d", qos=2, pid=4)
    assert c.no_publish(0.3)
    c.disconnect()
    pub.disconnect()


@VERSIONS
def test_unsubscribe_reason_codes_0x00_and_0x11_MQTT_3_11_3_1(broker, version):
    """UNSUBACK: same packet id (MQTT-3.10.4-5), one reason code per filter
    in order (MQTT-3.11.3-1): 0x00 Success, 0x11 No subscription existed
    (5.0; 3.1.1 UNSUBACK has no payload). Filters compare character by
    character (MQTT-3.10.4-1); no new messages after it (MQTT-3.10.4-2)."""
    c = raw_connect(broker.port, "us-%d" % version, version=version)
    assert c.subscribe([("us/a", 1), ("us/+", 1)]) == [1, 1]
    c.send(unsubscribe_packet(77, ["us/a", "us/none", "us/#", "us/+"], version=version))
    pid, codes, _ = c.expect_unsuback()
    assert pid == 77
    assert codes == ([0x00, 0x11, 0x11, 0x00] if version == 5 else [])
    pub = raw_connect(broker.port, "us-pub", version=5)
    pub.publish("us/a", b"x", qos=1, pid=1)
    assert c.no_publish(0.3)
    c.send(unsubscribe_packet(78, ["us/a"], version=version))
    pid, codes, _ = c.expect_unsuback()
    assert pid == 78 and codes == ([0x11] if version == 5 else [])
    c.disconnect()
    pub.disconnect()


@VERSIONS
def test_max_subscriptions_extra_filter_refused_0x97(broker_factory, version):
    """max_subscriptions=2 (contract: SUBACK 0x97 for the extra filter;
    3.1.1: 0x80). Replacing an existing filter is not an extra one; after an
    UNSUBSCRIBE the slot is free again; granted ones keep working."""
    b = broker_factory(max_subscriptions=2)
    requires_edgebroker(b)
    refused = 0x97 if version == 5 else 0x80
    c = raw_connect(b.port, "ms-%d" % version, version=version)
    assert c.subscribe([("ms/1", 1), ("ms/2", 1), ("ms/3", 1)], pid=1) == [1, 1, refused]
    assert c.subscribe([("ms/4", 0)], pid=2) == [refused]
    assert c.subscribe([("ms/1", 2)], pid=3) == [2]
    c.send(unsubscribe_packet(4, ["ms/2"], version=version))
    c.expect_unsuback()
    assert c.subscribe([("ms/3", 0)], pid=5) == [0]
    pub = raw_connect(b.port, "ms-pub", version=5)
    for t in ("ms/1", "ms/2", "ms/3", "ms/4"):
        pub.publish(t, t.encode(), qos=1, pid=1)
    got = drain_publishes(c, 0.3)
    assert sorted(p.topic for p in got) == ["ms/1", "ms/3"]
    c.disconnect()
    pub.disconnect()


@VERSIONS
def test_maximum_qos_1_subscription_granted_qos1_MQTT_3_2_2_10(broker_factory, request, version):
    """maximum_qos=1: a SUBSCRIBE asking QoS 2 is accepted (MQTT-3.2.2-10)
    and granted QoS 1 (MQTT-3.8.4-7); messages arrive at QoS 1."""
    b = start_broker(broker_factory, request, mosq=["max_qos 1"], maximum_qos=1)
    c = raw_connect(b.port, "mq-%d" % version, version=version)
    assert c.subscribe([("mq/t", 2), ("mq/z", 0)]) == [1, 0]
    pub = raw_connect(b.port, "mq-pub", version=5)
    pub.publish("mq/t", b"x", qos=1, pid=1)
    m = c.expect_publish()
    assert (m.payload, m.qos) == (b"x", 1)
    ack_publish(c, m)
    c.disconnect()
    pub.disconnect()


@VERSIONS
def test_invalid_filters_suback_0x8F_or_0x80_MQTT_4_7_1_1(broker, version):
    """Invalid Topic Filters ('#' not last: 'a/#/b', '#/a'; wildcard not a
    whole level: 'a+', '+a/b', 'a/b#'; empty: MQTT-4.7.3-1) are refused per
    filter: 5.0 SUBACK 0x8F, 3.1.1 0x80 (contract); a valid filter in the
    same SUBSCRIBE is granted (MQTT-3.8.4-5) and works. (A server may also
    close the connection; mosquitto does, which skips this test there.)"""
    bad = ["a/#/b", "#/a", "a+", "+a/b", "a/b#", ""]
    c = raw_connect(broker.port, "inv-%d" % version, version=version)
    c.send(subscribe_packet(3, [("inv/ok", 1)] + [(f, 0) for f in bad], version=version))
    p = c.read_packet(5)
    if broker.is_mosquitto and (p is None or p.ptype == DISCONNECT):
        pytest.skip("mosquitto closes the connection on an invalid filter (allowed)")
    assert p is not None and p.ptype == 9, "expected SUBACK, got %r" % (p,)
    pid, codes, _ = parse_suback(p.body, version)
    refused = 0x8F if version == 5 else 0x80
    assert pid == 3 and codes == [1] + [refused] * len(bad)
    pub = raw_connect(broker.port, "inv-pub", version=5)
    pub.publish("a/x/b", b"no", qos=1, pid=1)
    pub.publish("inv/ok", b"yes", qos=1, pid=2)
    got = drain_publishes(c, 0.3)
    assert [p.payload for p in got] == [b"yes"]
    c.disconnect()
    pub.disconnect()


# ---------------------------------------------------------------------------
# ordering, fan-out, slow consumers


def test_message_order_per_topic_preserved_MQTT_4_6_0_5(broker):
    """200 QoS 1 messages from one paho publisher arrive in publication
    order at subscribers granted QoS 0, 1 and 2 (MQTT-4.6.0-5/6)."""
    n = 200
    subs = [
        subscriber(broker.port, "ord/t", q, version=5, client_id="ord%d" % q) for q in (0, 1, 2)
    ]
    pub = paho_client(broker.port, "ord-pub", protocol=5)
    try:
        infos = [pub.client.publish("ord/t", b"%d" % i, qos=1) for i in range(n)]
        for info in infos:
            info.wait_for_publish(10)
    finally:
        pub.close()
    for q, s in zip((0, 1, 2), subs, strict=True):
        got = recv_publishes(s, n, timeout=10)
        assert [p.payload for p in got] == [b"%d" % i for i in range(n)], "QoS %d subscriber" % q
        assert {p.qos for p in got} == {min(q, 1)}
        s.disconnect()


def test_fan_out_to_many_subscribers(broker):
    """One mosquitto_pub -l (5 lines, QoS 1) reaches 20 subscribers
    (3.1.1 and 5.0 mixed), each getting all 5 in order."""
    subs = [
        subscriber(broker.port, "fan/#", 1, version=4 if i % 2 else 5, client_id="fan%d" % i)
        for i in range(20)
    ]
    lines = "".join("m%d\n" % i for i in range(5))
    r = subprocess.run(
        ["mosquitto_pub", "-h", HOST, "-p", str(broker.port), "-q", "1", "-t", "fan/out", "-l"],
        input=lines.encode(),
        capture_output=True,
        timeout=10,
    )
    assert r.returncode == 0, r.stderr
    for s in subs:
        got = recv_publishes(s, 5, timeout=5)
        assert [p.payload for p in got] == [b"m%d" % i for i in range(5)]
        s.disconnect()


def test_qos1_queued_behind_a_full_buffer_leaves_when_the_reader_drains_MQTT_4_6(
    broker_factory, request
):
    """A QoS 1 message that waits in a subscriber's queue only because the
    broker's send buffer to it is over max_outbuf, with nothing of it in
    flight (so no PUBACK will come to move the queue), is sent once the
    subscriber reads again and the buffer drains. (Defect: it waited for
    some later event; engine vector test_regression_6.)"""
    from mqtt_helpers import PUBLISH, parse_publish

    b = start_broker(broker_factory, request, mosq=[], max_outbuf=256)
    slow = SlowReader(b.port, rcvbuf=2048, version=4)
    pub = raw_connect(b.port, "fill-pub", version=4)
    try:
        assert slow.connect("slowq").reason == 0
        assert slow.subscribe([("f/#", 0), ("q/t", 1)]) == [0, 1]
        # QoS 0 until loopback's buffers and the broker's are full (the
        # rest is dropped, counted): bounded, 6.5 MB
        big = b"." * 8192
        for _ in range(800):
            pub.send(publish_packet("f/t", big, version=4))
        assert pub.publish("q/t", b"queued", qos=1, pid=9) == 0
        got = None
        deadline = time.monotonic() + 30
        while got is None and time.monotonic() < deadline:
            p = slow.read_packet(max(0.1, deadline - time.monotonic()))
            if p is None:
                break
            if p.ptype == PUBLISH:
                m = parse_publish(p.flags, p.body, 4)
                if m.topic == "q/t":
                    got = m
        assert got is not None and got.payload == b"queued" and got.qos == 1
    finally:
        pub.close()
        slow.close()


OOM_ENGINE = Path(__file__).resolve().parents[1] / "portable" / "oom_engine_broker.py"


def test_acks_after_a_commit_out_of_heap_still_leave_in_order_MQTT_4_6(broker_factory):
    """Retained QoS 1 PUBLISHes on a flash store: their PUBACKs wait for the
    commit; writing the first one runs out of heap (oom_engine_broker.py
    --fault puback patches only that). All three still arrive, in order
    (MQTT-4.6.0-2), to a real client. Before, the rest of that client's
    acks were lost and every later turn raised (no ack for anyone)."""
    b = broker_factory(script=str(OOM_ENGINE), extra_args=("--fault", "puback"),
                       storage_type="disc")
    requires_edgebroker(b)
    c = raw_connect(b.port, "acks", version=5)
    try:
        for pid in (1, 2, 3):
            c.send(publish_packet("ack/%d" % pid, b"v", qos=1, retain=True, pid=pid, version=5))
        got = []
        for _ in range(3):
            p = c.read_packet(5)
            assert p is not None and p.ptype == PUBACK, (p, got)
            got.append(parse_ack(p.body, 5)[0])
        assert got == [1, 2, 3]
        c.send(publish_packet("ack/4", b"v", qos=1, retain=True, pid=4, version=5))
        assert parse_ack(c.expect(PUBACK, 5).body, 5)[0] == 4
    finally:
        c.close()
    assert "refused (memory)" in b.log_text() and "Traceback" not in b.log_text()


def test_a_pump_out_of_heap_stalls_no_subscriber(broker_factory):
    """A subscriber whose send buffer drained has its queue pumped at the
    turn; that pump runs out of heap (oom_engine_broker.py --fault pump).
    Its queued QoS 1 messages still arrive, without an acknowledgement from
    it to move them (a real client that acks nothing until it has them
    all). Before, the turn dropped it (and the sessions after it) from its
    list and the messages waited for the next event on that session."""
    b = broker_factory(script=str(OOM_ENGINE), extra_args=("--fault", "pump"), max_outbuf=256)
    requires_edgebroker(b)
    s = raw_connect(b.port, "oom-pump", version=4)
    pub = raw_connect(b.port, "oom-pump-pub", version=4)
    try:
        assert s.subscribe([("pq/#", 1)]) == [1]
        # in one write: routed in one read, before the first is flushed, so
        # the second and third wait in the queue for the buffer to drain
        pub.send(b"".join(publish_packet("pq/t", b"m%d" % k + b"." * 200, qos=1, pid=k + 1,
                                         version=4) for k in range(3)))
        assert [pub.expect_ack(PUBACK, 5)[0] for _ in range(3)] == [1, 2, 3]
        got = recv_publishes(s, 3, timeout=10, ack=False)
        assert [m.payload[:2] for m in got] == [b"m0", b"m1", b"m2"]
    finally:
        pub.close()
        s.close()
    assert "refused (memory)" in b.log_text() and "Traceback" not in b.log_text()


def test_a_flush_to_a_full_socket_out_of_heap_loses_no_buffered_byte(broker_factory, request):
    """The first flush made while a subscriber's socket was full (the async
    writer task, or the poll server's POLLOUT) runs out of heap
    (host_tests/portable/oom_writer_broker.py patches only that flush). What
    the broker buffered for the subscriber still reaches it once it reads:
    every QoS 0 message was delivered or dropped and counted
    ($SYS/broker/messages/dropped), none stuck. Before, the writer task
    died (async) or the server stopped (poll), and the buffered bytes
    waited for a later message to the same client."""
    from mqtt_helpers import PUBLISH, parse_publish

    script = Path(__file__).resolve().parents[1] / "portable" / "oom_writer_broker.py"
    b = broker_factory(script=str(script), max_outbuf=16384)
    requires_edgebroker(b)
    n, size = 800, 8192
    slow = SlowReader(b.port, rcvbuf=2048, version=4)
    pub = raw_connect(b.port, "oom-pub", version=4)
    try:
        assert slow.connect("oom-slow").reason == 0
        assert slow.subscribe([("f/#", 0)]) == [0]
        # bounded: 6.5 MB, more than loopback and max_outbuf take together
        for i in range(n):
            pub.send(publish_packet("f/t", (b"%05d" % i).ljust(size, b"."), version=4))
        pub.send(b"\xc0\x00")
        assert pub.expect(13, 30)                            # all of it routed
        got = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                p = slow.read_packet(3.0)                    # quiet for 3 s: done
            except TimeoutError:
                break
            if p is None:
                break
            if p.ptype == PUBLISH:
                got.append(int(parse_publish(p.flags, p.body, 4).payload[:5]))
        assert got == sorted(got) and len(set(got)) == len(got)
        sysc = raw_connect(b.port, "oom-sys", version=4)
        assert sysc.subscribe([("$SYS/broker/messages/dropped", 0)]) == [0]
        dropped = int(sysc.expect_publish(5).payload)
        sysc.disconnect()
        assert len(got) + dropped == n, (len(got), dropped)
        assert 0 < len(got) < n
        assert b.alive() and "Traceback" not in b.log_text(), b.log_text()[-3000:]
    finally:
        pub.close()
        slow.close()


def test_slow_qos0_reader_bounded_other_subscriber_unaffected(broker_factory, request):
    """A subscriber that never reads (tiny socket buffer) does not stall
    the broker or other clients: with max_outbuf=16384 the QoS 0 messages
    it cannot take are dropped (contract: dropped and counted), while a
    normal subscriber to the same topic receives all of them in order."""
    b = start_broker(broker_factory, request, mosq=[], max_outbuf=16384, sys_interval=1)
    # loopback TCP absorbs ~2 MB for a reader that never reads (the sender's
    # buffer autotunes), so ~5 MB are needed to reach max_outbuf
    n, size = 600, 8192
    slow = SlowReader(b.port, rcvbuf=2048)
    assert slow.connect("slowpoke").reason == 0
    assert slow.subscribe([("slow/#", 0)]) == [0]
    fast = paho_client(b.port, "fast", protocol=5)
    pub = raw_connect(b.port, "slow-pub", version=5)
    try:
        assert fast.subscribe_wait("slow/#", qos=0) == [0]
        t0 = time.monotonic()
        publish_batched(pub, [("slow/t", (b"%05d" % i).ljust(size, b".")) for i in range(n)])
        msgs = fast.wait_messages(n, timeout=20)
        assert [m.payload[:5] for m in msgs] == [b"%05d" % i for i in range(n)]
        assert time.monotonic() - t0 < 20
        # the broker still serves new clients
        late = raw_connect(b.port, "late", version=5)
        assert late.subscribe([("late/t", 0)]) == [0]
        late.disconnect()
        if not b.is_mosquitto:
            w = SysWatcher(b.port)
            try:
                v = w.wait(lambda v: (sys_int(v, "messages/dropped") or 0) > 0, timeout=3.5)
                assert sys_int(v, "messages/dropped") < n
            finally:
                w.close()
    finally:
        fast.close()
        pub.close()
        slow.close()

"""CONNECT / CONNACK behaviour (MQTT 3.1.1 and 5.0 on one listener).

Profile keys and refusal codes: docs/contract.md.
"""

import hashlib

import pytest
from mqtt_helpers import (
    ASSIGNED_CLIENT_IDENTIFIER,
    AUTHENTICATION_DATA,
    AUTHENTICATION_METHOD,
    CONNACK,
    DISCONNECT,
    MAXIMUM_PACKET_SIZE,
    MAXIMUM_QOS,
    RECEIVE_MAXIMUM,
    RETAIN_AVAILABLE,
    SERVER_KEEP_ALIVE,
    SHARED_SUBSCRIPTION_AVAILABLE,
    SUBSCRIPTION_IDENTIFIER_AVAILABLE,
    TOPIC_ALIAS_MAXIMUM,
    WILDCARD_SUBSCRIPTION_AVAILABLE,
    ConnectRefused,
    RawClient,
    auth_packet,
    connect_packet,
    mosquitto_pub,
    mosquitto_sub_bg,
    paho_client,
    parse_connack,
    parse_disconnect,
    prop_bin,
    prop_str,
    publish_packet,
    raw_connect,
    requires_edgebroker,
    run_async,
    wait_for,
)


def _refused(port, version, client_id="x", **kw):
    """Connect raw, return (CONNACK reason/rc, closed-afterwards)."""
    with RawClient(port, version=version) as c:
        ack = c.connect(client_id, **kw)
        closed = c.closed(3)
    return ack, closed


# ---------------------------------------------------------------------------
# both protocol versions on one listener


def test_mqtt311_and_mqtt5_clients_on_one_listener(broker):
    """MQTT 3.1.1 (level 4) and 5.0 (level 5) clients connect to the same
    port and exchange messages both ways (3.1.1 MQTT-3.1.2-2 / 5.0 3.1.2.2)."""
    c4 = raw_connect(broker.port, "v4-raw", version=4)
    c5 = raw_connect(broker.port, "v5-raw", version=5)
    # CONNACK shapes: 3.1.1 is exactly 2 bytes (3.2.1); 5.0 carries a property block
    raw4 = RawClient(broker.port, version=4)
    raw4.send(connect_packet("v4-shape", version=4))
    p = raw4.expect(CONNACK)
    assert p.flags == 0 and p.body == b"\x00\x00", p
    raw4.disconnect()
    assert c4.connack.reason == 0 and not c4.connack.session_present
    assert c5.connack.reason == 0 and not c5.connack.session_present
    assert c4.subscribe([("mix/+", 1)]) == [1]
    assert c5.subscribe([("mix/+", 1)]) == [1]
    assert c5.publish("mix/from5", b"five", qos=1) == 0
    assert c4.publish("mix/from4", b"four", qos=1) == 0
    got4 = {c4.expect_publish().payload for _ in range(2)}
    got5 = {c5.expect_publish().payload for _ in range(2)}
    assert got4 == {b"five", b"four"} and got5 == {b"five", b"four"}
    c4.disconnect()
    c5.disconnect()


def test_paho_311_and_5_interoperate(broker):
    """paho 3.1.1 publisher -> paho 5.0 subscriber and back."""
    a = paho_client(broker.port, "paho4", protocol=4)
    b = paho_client(broker.port, "paho5", protocol=5)
    try:
        assert a.subscribe_wait("pi/#", 1) == [1]
        assert b.subscribe_wait("pi/#", 1) == [1]
        a.publish_wait("pi/a", b"from4", qos=1)
        b.publish_wait("pi/b", b"from5", qos=1)
        assert sorted(m.payload for m in a.wait_messages(2)) == [b"from4", b"from5"]
        assert sorted(m.payload for m in b.wait_messages(2)) == [b"from4", b"from5"]
    finally:
        a.close()
        b.close()


def test_mosquitto_clients_311_to_5(broker):
    """mosquitto_pub -V mqttv311 reaches mosquitto_sub -V mqttv5 and vice versa."""
    sub5 = mosquitto_sub_bg(broker.port, ["-t", "mq/5", "-q", "1"], count=1, version=5)
    sub4 = mosquitto_sub_bg(broker.port, ["-t", "mq/4", "-q", "1"], count=1, version=4)
    sub5.wait_subscribed()
    sub4.wait_subscribed()
    mosquitto_pub(broker.port, ["-t", "mq/5", "-m", "hello-5", "-q", "1"], version=4)
    mosquitto_pub(broker.port, ["-t", "mq/4", "-m", "hello-4", "-q", "1"], version=5)
    assert sub5.result() == (0, ["hello-5"])
    assert sub4.result() == (0, ["hello-4"])


def test_aiomqtt_connects_with_both_versions(broker):
    """aiomqtt (asyncio) client, 3.1.1 and 5.0."""
    import aiomqtt

    async def one(version, ident):
        async with aiomqtt.Client("127.0.0.1", broker.port, identifier=ident, protocol=version) as c:
            await c.subscribe("aio/" + ident, qos=1)
            await c.publish("aio/" + ident, b"ping-" + ident.encode(), qos=1)
            async for m in c.messages:
                return m.payload

    assert run_async(one(aiomqtt.ProtocolVersion.V5, "a5"), 15) == b"ping-a5"
    assert run_async(one(aiomqtt.ProtocolVersion.V311, "a4"), 15) == b"ping-a4"


# ---------------------------------------------------------------------------
# CONNACK properties tell the truth (MQTT 5.0 3.2.2.3)


def test_connack_properties_tell_the_truth_MQTT_3_2_2_3(broker_factory):
    """Retain/Wildcard/Subscription Identifier available, Shared Subscription
    Available = 0 (not supported), Maximum QoS (only when < 2, MQTT-3.2.2-9),
    Maximum Packet Size, Topic Alias Maximum, Receive Maximum = max_inflight,
    no Server Keep Alive when server_keep_alive = 0."""
    b = broker_factory(max_packet_size=5000, topic_alias_maximum=7, max_inflight=5, maximum_qos=2,
                       retain_available=True, server_keep_alive=0)
    requires_edgebroker(b)
    c = raw_connect(b.port, "props", version=5)
    p = c.connack.props
    assert p.get(RETAIN_AVAILABLE, 1) == 1
    assert p.get(WILDCARD_SUBSCRIPTION_AVAILABLE, 1) == 1
    assert p.get(SUBSCRIPTION_IDENTIFIER_AVAILABLE, 1) == 1
    assert p.get(SHARED_SUBSCRIPTION_AVAILABLE, 1) == 1, "shared subscriptions are supported"
    assert MAXIMUM_QOS not in p, "Maximum QoS must be absent when QoS 2 is supported"
    assert p.get(MAXIMUM_PACKET_SIZE) == 5000
    assert p.get(TOPIC_ALIAS_MAXIMUM) == 7
    assert p.get(RECEIVE_MAXIMUM) == 5
    assert SERVER_KEEP_ALIVE not in p
    # wildcard subscriptions really work
    assert c.subscribe([("truth/#", 0)]) == [0]
    c.disconnect()


@pytest.mark.parametrize("maxq", [0, 1])
def test_connack_maximum_qos_and_retain_unavailable_MQTT_3_2_2_9(broker_factory, maxq):
    """maximum_qos=0|1 -> CONNACK Maximum QoS (MQTT-3.2.2-9) and a QoS 2
    subscription is granted at most that (MQTT-3.2.2-10: the Server still
    accepts SUBSCRIBE with QoS 2); retain_available=false -> Retain
    Available 0 (MQTT-3.2.2-14 L1); server_keep_alive -> Server Keep Alive."""
    b = broker_factory(maximum_qos=maxq, retain_available=False, server_keep_alive=7)
    requires_edgebroker(b)
    c = raw_connect(b.port, "mq1", version=5, keepalive=60)
    p = c.connack.props
    assert p.get(MAXIMUM_QOS) == maxq
    assert p.get(RETAIN_AVAILABLE) == 0
    assert p.get(SERVER_KEEP_ALIVE) == 7
    codes = c.subscribe([("mq/x", 2)])
    assert codes[0] <= maxq, "granted QoS above maximum_qos: %r" % codes
    c.disconnect()


def test_publish_above_maximum_qos_is_disconnected_0x9B_MQTT_3_2_2_11(broker_factory):
    """A QoS 2 PUBLISH when Maximum QoS is 1: DISCONNECT 0x9B (QoS not supported)."""
    b = broker_factory(maximum_qos=1)
    requires_edgebroker(b)
    c = raw_connect(b.port, "mq1p", version=5)
    c.send(publish_packet("q/2", b"x", qos=2, pid=3))
    reason, _ = c.expect_disconnect()
    assert reason == 0x9B
    assert c.closed(3)


# ---------------------------------------------------------------------------
# client identifiers


def test_empty_client_id_gets_assigned_client_identifier_MQTT_3_2_2_16(broker):
    """5.0: a zero-length Client Identifier is accepted and the Server returns
    an Assigned Client Identifier, unique per connection (MQTT-3.1.3-6)."""
    a = raw_connect(broker.port, "", version=5)
    b = raw_connect(broker.port, "", version=5)
    ida = a.connack.props.get(ASSIGNED_CLIENT_IDENTIFIER)
    idb = b.connack.props.get(ASSIGNED_CLIENT_IDENTIFIER)
    assert ida and idb and ida != idb
    # and not guessable from each other (mosquitto: auto-<random UUID>): the
    # ids of two connections in a row differ in more than a counter and a
    # clock (before: edgebroker-1-12345, then edgebroker-2-12346)
    assert sum(x != y for x, y in zip(ida, idb)) >= 8, (ida, idb)
    # both stay usable
    assert a.subscribe([("anon/t", 0)]) == [0]
    b.publish("anon/t", b"x")
    assert a.expect_publish().payload == b"x"
    a.disconnect()
    b.disconnect()


def test_long_client_id_accepted_MQTT_3_1_3_5(broker):
    """Client identifiers longer than 23 bytes and outside [0-9a-zA-Z] MAY be
    accepted; a 64-byte UTF-8 id works on both versions."""
    cid = "sensor-\u00e9\u00e8-" + "x" * 50
    for v in (4, 5):
        c = raw_connect(broker.port, cid + str(v), version=v)
        c.ping()
        c.disconnect()


def test_311_empty_client_id_with_clean_session_accepted_MQTT_3_1_3_7(broker):
    c = raw_connect(broker.port, "", version=4, clean=True)
    assert c.connack.reason == 0
    c.ping()
    c.disconnect()


def test_311_empty_client_id_without_clean_session_refused_rc2_MQTT_3_1_3_8(broker):
    ack, closed = _refused(broker.port, 4, client_id="", clean=False)
    assert ack.reason == 2, "expected CONNACK rc 2 (identifier rejected), got %r" % (ack,)
    assert closed


# ---------------------------------------------------------------------------
# authentication

SHA_PW = "hunter2"
USERS = {"alice": "secret", "bob": "sha256:" + hashlib.sha256(SHA_PW.encode()).hexdigest()}


@pytest.fixture
def auth_broker(broker_factory):
    b = broker_factory(users=USERS, allow_anonymous=False)
    requires_edgebroker(b)
    return b


@pytest.mark.parametrize("user,pw", [
    ("alice", b"wrong"),
    ("mallory", b"secret"),
    ("bob", USERS["bob"].encode()),  # the stored hash is not the password
    (None, None),                  # anonymous while allow_anonymous is false
    ("alice", None),               # username without password
])
def test_bad_credentials_refused_5_0x86_311_rc4_MQTT_3_1_4_2(auth_broker, user, pw):
    """Bad credentials: 5.0 CONNACK 0x86 Bad User Name or Password, 3.1.1 rc 4;
    the connection is then closed (MQTT-3.2.2-7 / 5.0 MQTT-3.2.2-7)."""
    ack5, closed5 = _refused(auth_broker.port, 5, "c5", username=user, password=pw)
    assert ack5.reason == 0x86 and closed5
    ack4, closed4 = _refused(auth_broker.port, 4, "c4", username=user, password=pw)
    assert ack4.reason == 4 and closed4
    assert auth_broker.alive()


def test_good_credentials_accepted_plain_and_sha256(auth_broker):
    """Plain stored password and "sha256:<hex>" stored password are accepted
    (raw 5.0, raw 3.1.1, paho, mosquitto_pub)."""
    for version in (5, 4):
        c = raw_connect(auth_broker.port, "al%d" % version, version=version, username="alice", password=b"secret")
        c.disconnect()
        c = raw_connect(auth_broker.port, "bo%d" % version, version=version, username="bob", password=SHA_PW.encode())
        c.disconnect()
    p = paho_client(auth_broker.port, "paho-bob", protocol=5, username="bob", password=SHA_PW)
    try:
        assert p.subscribe_wait("auth/t", 1) == [1]
        mosquitto_pub(auth_broker.port, ["-u", "alice", "-P", "secret", "-t", "auth/t", "-m", "ok", "-q", "1"])
        assert p.wait_messages(1)[0].payload == b"ok"
    finally:
        p.close()
    with pytest.raises(ConnectRefused) as e:
        paho_client(auth_broker.port, "paho-bad", protocol=5, username="bob", password="nope")
    assert e.value.rc == 0x86


def test_authentication_method_not_supported_0x8C_MQTT_4_12_0_1(broker):
    """CONNECT with an Authentication Method the Server does not support:
    CONNACK 0x8C Bad authentication method, then close (MQTT-4.12.0-1)."""
    props = prop_str(AUTHENTICATION_METHOD, "SCRAM-SHA-1") + prop_bin(AUTHENTICATION_DATA, b"client-first")
    ack, closed = _refused(broker.port, 5, "authm", props=props)
    assert ack.reason == 0x8C
    assert closed


def test_auth_packet_without_authentication_method_is_protocol_error_MQTT_3_15(broker):
    """An AUTH packet from a client that did not ask for enhanced
    authentication: DISCONNECT (0x82 Protocol Error, or 0x8C) and close."""
    c = raw_connect(broker.port, "authp", version=5)
    c.send(auth_packet(0x19, prop_str(AUTHENTICATION_METHOD, "SCRAM-SHA-1")))
    closed, pkts = c.read_until_closed(3)
    assert closed
    discs = [parse_disconnect(p.body)[0] for p in pkts if p.ptype == DISCONNECT]
    if discs or not broker.is_mosquitto:  # mosquitto closes without DISCONNECT (a SHOULD, 4.13.1)
        assert discs and discs[0] in (0x82, 0x8C), pkts
    assert broker.alive()
    raw_connect(broker.port, "after-auth", version=5).disconnect()


# ---------------------------------------------------------------------------
# protocol name / level


def test_311_unsupported_protocol_level_rc1_MQTT_3_1_2_2(broker):
    """Protocol level 3 ("MQIsdp", MQTT 3.1) when unsupported, or another
    level: CONNACK rc 0x01 and close. mosquitto supports 3.1, so it is
    checked with level 2 too."""
    for name, level in (("MQTT", 2), ("MQTT", 9)):
        with RawClient(broker.port, version=4) as c:
            c.send(connect_packet("lvl", version=4, protocol_name=name, level=level))
            p = c.read_packet(5)
            assert p is not None and p.ptype == CONNACK, "level %d: expected CONNACK, got %r" % (level, p)
            assert p.body[1] in (0x01, 0x84), "level %d: rc %#x" % (level, p.body[1])
            assert c.closed(3)
    assert broker.alive()


def test_5_unsupported_protocol_version_0x84_MQTT_3_1_2_2(broker):
    """A 5.0-shaped CONNECT (with properties) carrying level 6: CONNACK
    0x84 Unsupported Protocol Version (or 3.1.1 rc 1) and close."""
    with RawClient(broker.port, version=5) as c:
        c.send(connect_packet("lvl6", version=5, level=6))
        p = c.read_packet(5)
        assert p is not None and p.ptype == CONNACK, p
        assert p.body[1] in (0x84, 0x01)
        if p.body[1] == 0x84:
            ack = parse_connack(p.body, 5)
            assert not ack.session_present
        assert c.closed(3)


def test_wrong_protocol_name_closes_MQTT_3_1_2_1(broker):
    """Protocol Name other than "MQTT": the Server MAY send CONNACK 0x84
    (5.0) and MUST close the connection without processing further."""
    with RawClient(broker.port, version=4) as c:
        c.send(connect_packet("pn", version=4, protocol_name="MQTX"))
        closed, pkts = c.read_until_closed(3)
        assert closed
        for p in pkts:
            assert p.ptype == CONNACK and p.body[1] != 0
    assert broker.alive()


# ---------------------------------------------------------------------------
# max_clients


def test_max_clients_refuses_extra_client_0x97_rc3(broker_factory):
    """max_clients=3: a 4th client is refused (5.0 CONNACK 0x97 Quota
    exceeded, 3.1.1 rc 3 Server unavailable) and closed, while the three
    connected clients keep working; after one leaves a new client fits."""
    b = broker_factory(max_clients=3, sys_interval=1)
    requires_edgebroker(b)
    clients = [raw_connect(b.port, "mc%d" % i, version=5 if i % 2 else 4) for i in range(3)]
    ack, closed = _refused(b.port, 5, "extra5")
    assert ack.reason == 0x97 and closed
    ack, closed = _refused(b.port, 4, "extra4")
    assert ack.reason == 3 and closed
    # the connected ones still work
    assert clients[0].subscribe([("mc/t", 1)]) == [1]
    clients[1].publish("mc/t", b"still-here", qos=1)
    assert clients[0].expect_publish().payload == b"still-here"
    clients[2].ping()
    # one leaves, a newcomer is accepted (the slot is released)
    clients[2].disconnect()

    def try_connect():
        c = RawClient(b.port, version=5)
        ack = c.connect("newcomer")
        if ack.reason == 0:
            return c
        c.close()
        return None

    newcomer = wait_for(try_connect, timeout=5, interval=0.1)
    assert newcomer, "slot of a disconnected client was not released"
    # the refusals are counted under $SYS/broker/refusals/<cause> (contract)
    assert newcomer.subscribe([("$SYS/broker/refusals/+", 0)]) == [0]
    counts = {}

    def counted():
        m = newcomer.expect_publish(2)
        counts[m.topic] = int(m.payload)
        return any(v >= 2 for v in counts.values())

    assert wait_for(counted, timeout=4), "no $SYS refusal counter reached 2: %r" % counts
    newcomer.disconnect()
    for c in clients[:2]:
        c.disconnect()

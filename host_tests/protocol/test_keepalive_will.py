"""Keep Alive enforcement and Will Messages."""

import socket
import time
from pathlib import Path

import pytest
from mqtt_helpers import (
    CONTENT_TYPE,
    CORRELATION_DATA,
    DISCONNECT,
    MESSAGE_EXPIRY_INTERVAL,
    PAYLOAD_FORMAT_INDICATOR,
    RESPONSE_TOPIC,
    SESSION_EXPIRY_INTERVAL,
    USER_PROPERTY,
    WILL_DELAY_INTERVAL,
    disconnect_packet,
    mosquitto_sub,
    mosquitto_sub_bg,
    paho_client,
    parse_disconnect,
    prop_u32,
    puback,
    pubcomp,
    publish_packet,
    pubrec,
    raw_connect,
    requires_edgebroker,
    run_async,
)

VERSIONS = pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])


def watcher(port, flt="will/#", qos=2):
    w = raw_connect(port, "", version=5)
    assert w.subscribe([(flt, qos)]) == [qos]
    return w


def ack(w, m, version=5):
    if m.qos == 1:
        w.send(puback(m.pid, version))
    elif m.qos == 2:
        w.send(pubrec(m.pid, version))
        w.expect(6)  # PUBREL
        w.send(pubcomp(m.pid, version))


def will(topic, payload, qos=0, retain=False, props=b""):
    return dict(topic=topic, payload=payload, qos=qos, retain=retain, props=props)


# ---------------------------------------------------------------------------
# keep alive


@VERSIONS
def test_keepalive_enforced_at_one_and_a_half_MQTT_3_1_2_24(broker, version):
    """Keep Alive 1 s: a silent client is disconnected after 1.5 x Keep Alive
    (MQTT-3.1.2-24), while a client sending PINGREQ (answered with PINGRESP,
    MQTT-3.12.4-1), a client sending PUBLISHes, and a Keep Alive 0 client
    (no timeout) stay connected over the same window."""
    silent = raw_connect(broker.port, "silent-%d" % version, version=version, keepalive=1)
    t0 = time.monotonic()
    pinger = raw_connect(broker.port, "pinger-%d" % version, version=version, keepalive=1)
    talker = raw_connect(broker.port, "talker-%d" % version, version=version, keepalive=1)
    idle0 = raw_connect(broker.port, "ka0-%d" % version, version=version, keepalive=0)
    closed_at = None
    window = 8.0 if broker.is_mosquitto else 3.2  # mosquitto checks keepalive coarsely
    while time.monotonic() - t0 < window:
        pinger.ping(2)
        talker.send(publish_packet("ka/talk", b".", version=version))
        if closed_at is None:
            if not silent.is_open(0.25):  # returns early on EOF
                closed_at = time.monotonic() - t0
        else:
            time.sleep(0.25)
    assert closed_at is not None, "silent client with Keep Alive 1 s not disconnected within %.1f s" % window
    assert 1.0 <= closed_at <= window - 0.2, "closed after %.2f s (expected about 1.5 s)" % closed_at
    if version == 5:
        discs = [parse_disconnect(p.body)[0] for p in silent.seen if p.ptype == DISCONNECT]
        assert discs in ([], [0x8D]), discs  # Keep Alive timeout
    pinger.ping(2)
    talker.ping(2)
    idle0.ping(2)
    for c in (pinger, talker, idle0):
        c.disconnect()


def test_server_keep_alive_overrides_client_MQTT_3_2_2_21(broker_factory):
    """server_keep_alive=1: CONNACK Server Keep Alive 1 and the Server uses it
    instead of the client's 60 s (MQTT-3.2.2-21)."""
    b = broker_factory(server_keep_alive=1)
    requires_edgebroker(b)
    c = raw_connect(b.port, "ska", version=5, keepalive=60)
    assert c.connack.props.get(0x13) == 1
    t0 = time.monotonic()
    assert c.closed(3.5), "not disconnected after the Server Keep Alive"
    assert time.monotonic() - t0 >= 1.0


# ---------------------------------------------------------------------------
# will on abnormal close / keepalive timeout / not on DISCONNECT


@VERSIONS
def test_will_published_on_abnormal_close_MQTT_3_1_2_8(broker, version):
    """Network connection closed without DISCONNECT: the Will Message is
    published (MQTT-3.1.2-8) at its Will QoS, with RETAIN=0 when Will
    Retain is 0."""
    w = watcher(broker.port)
    c = raw_connect(broker.port, "dying-%d" % version, version=version,
                    will=will("will/dying", b"gone-%d" % version, qos=1))
    c.close()
    m = w.expect_publish(5)
    assert (m.topic, m.payload, m.qos, m.retain) == ("will/dying", b"gone-%d" % version, 1, False)
    ack(w, m)
    assert w.no_publish(0.3), "will published twice"
    w.disconnect()


def test_will_published_on_protocol_error_MQTT_3_1_2_8(broker):
    """The Server closing the connection because of a protocol error also
    publishes the Will (MQTT-3.1.2-8)."""
    w = watcher(broker.port)
    c = raw_connect(broker.port, "bad-one", version=4, will=will("will/bad", b"malformed", qos=0))
    c.send(b"\x00\x00")  # packet type 0 is reserved: malformed
    assert c.closed(3)
    m = w.expect_publish(5)
    assert (m.topic, m.payload) == ("will/bad", b"malformed")
    w.disconnect()


@VERSIONS
def test_will_published_on_keepalive_timeout_MQTT_3_1_2_8(broker, version):
    """A Keep Alive timeout is an abnormal close: the Will is published,
    seen here by mosquitto_sub."""
    limit = 8.0 if broker.is_mosquitto else 4.0  # mosquitto checks keepalive coarsely
    sub = mosquitto_sub_bg(broker.port, ["-t", "will/ka", "-q", "1"], count=1, timeout=limit + 2)
    sub.wait_subscribed()
    c = raw_connect(broker.port, "ka-will-%d" % version, version=version, keepalive=1,
                    will=will("will/ka", b"timed-out", qos=1))
    t0 = time.monotonic()
    rc, lines = sub.result()
    assert lines == ["timed-out"], (rc, lines)
    assert time.monotonic() - t0 <= limit
    c.close()


@VERSIONS
def test_will_not_published_on_normal_disconnect_MQTT_3_1_2_10(broker, version):
    """DISCONNECT (reason 0x00): the Will Message is deleted, not published
    (3.1.1 MQTT-3.1.2-10 / 5.0 MQTT-3.1.2-10, MQTT-3.14.4-3)."""
    w = watcher(broker.port)
    c = raw_connect(broker.port, "polite-%d" % version, version=version,
                    will=will("will/polite", b"should-not-see", qos=1))
    c.disconnect()
    assert w.no_publish(0.8)
    w.disconnect()


def test_disconnect_with_will_message_0x04_publishes_will_MQTT_3_14_2_1(broker):
    """5.0 DISCONNECT with Reason Code 0x04 (Disconnect with Will Message):
    the Server publishes the Will."""
    w = watcher(broker.port)
    c = raw_connect(broker.port, "w04", version=5, will=will("will/04", b"asked-for", qos=1))
    c.send(disconnect_packet(0x04, 5))
    assert c.closed(3)
    m = w.expect_publish(5)
    assert (m.topic, m.payload, m.qos) == ("will/04", b"asked-for", 1)
    ack(w, m)
    w.disconnect()


@pytest.mark.parametrize("reason", [0x80, 0x83], ids=["0x80", "0x83"])
def test_disconnect_with_an_error_reason_publishes_will_MQTT_3_14_4_3(broker, reason):
    """Only DISCONNECT with 0x00 discards the Will (MQTT-3.14.4-3): a client
    that ends with an error code (0x80 Unspecified error, 0x83
    Implementation specific error) has its Will published, as after any
    close that is not a normal one (MQTT-3.1.2-8)."""
    if broker.is_mosquitto:
        pytest.xfail("mosquitto 2.0.11 discards the will on any DISCONNECT but 0x04")
    w = watcher(broker.port)
    c = raw_connect(broker.port, "werr", version=5, will=will("will/err", b"failed", qos=1))
    c.send(disconnect_packet(reason, 5))
    assert c.closed(3)
    m = w.expect_publish(5)
    assert (m.topic, m.payload) == ("will/err", b"failed")
    ack(w, m)
    w.disconnect()


def test_paho_will_on_drop_not_on_disconnect(broker):
    """paho clients (3.1.1 and 5.0) with will_set: dropped connection -> will;
    paho disconnect() -> no will."""
    w = watcher(broker.port)
    a = paho_client(broker.port, "paho-drop", protocol=5, will=dict(topic="will/paho", payload=b"dropped", qos=1))
    b = paho_client(broker.port, "paho-clean", protocol=4, will=dict(topic="will/paho", payload=b"clean", qos=1))
    b.disconnect()
    a.drop()
    m = w.expect_publish(5)
    assert m.payload == b"dropped"
    ack(w, m)
    assert w.no_publish(0.5)
    w.disconnect()


# ---------------------------------------------------------------------------
# will QoS / retain / properties


@VERSIONS
def test_will_retain_is_stored_as_retained_S7_MQTT_3_1_2_17(broker, version):
    """Will Retain = 1: the Will is published as a retained message
    (MQTT-3.1.2-17, retained rule S7): a subscriber arriving later gets it
    with RETAIN=1 (raw client, mosquitto_sub, and aiomqtt)."""
    topic = "will/retained-%d" % version
    c = raw_connect(broker.port, "wr-%d" % version, version=version,
                    will=will(topic, b"last-words", qos=2, retain=True))
    c.close()
    late = raw_connect(broker.port, "late-%d" % version, version=version)

    def get():
        assert late.subscribe([(topic, 2)]) == [2]
        return late.expect_publish(3)

    m = get()
    assert (m.payload, m.retain, m.qos) == (b"last-words", True, 2)
    ack(late, m, version)
    late.disconnect()
    assert mosquitto_sub(broker.port, ["-t", topic, "-q", "1"], count=1, timeout=3) == ["last-words"]

    import aiomqtt

    async def aio():
        async with aiomqtt.Client("127.0.0.1", broker.port, identifier="aio-late-%d" % version) as ac:
            await ac.subscribe(topic, qos=1)
            async for msg in ac.messages:
                return msg.payload, msg.retain, msg.qos

    assert run_async(aio(), 10) == (b"last-words", True, 1)


def test_will_qos2_delivered_at_qos2_MQTT_3_1_2_14(broker):
    """Will QoS 2 to a QoS 2 subscription arrives as QoS 2; to a QoS 0
    subscription as QoS 0 (granted QoS caps it)."""
    w2 = watcher(broker.port, "will/q2", 2)
    w0 = watcher(broker.port, "will/q2", 0)
    c = raw_connect(broker.port, "wq2", version=5, will=will("will/q2", b"two", qos=2))
    c.close()
    m = w2.expect_publish(5)
    assert (m.payload, m.qos) == (b"two", 2)
    ack(w2, m)
    m0 = w0.expect_publish(5)
    assert (m0.payload, m0.qos) == (b"two", 0)
    w2.disconnect()
    w0.disconnect()


def test_will_properties_forwarded_MQTT_3_1_3_10(broker):
    """Will Properties set by a paho 5.0 client (Payload Format Indicator,
    Content Type, Response Topic, Correlation Data, User Properties,
    Message Expiry) reach the subscriber with the Will Message."""
    w = watcher(broker.port)
    props = dict(PayloadFormatIndicator=1, ContentType="text/plain", ResponseTopic="will/reply",
                 CorrelationData=b"\x01\x02corr", UserProperty=[("k1", "v1"), ("k2", "v2")],
                 MessageExpiryInterval=120)
    p = paho_client(broker.port, "paho-wp", protocol=5,
                    will=dict(topic="will/props", payload=b"with-props", qos=1, properties=props))
    p.drop()
    m = w.expect_publish(5)
    assert m.payload == b"with-props"
    pr = m.props
    assert pr.get(PAYLOAD_FORMAT_INDICATOR) == 1
    assert pr.get(CONTENT_TYPE) == "text/plain"
    assert pr.get(RESPONSE_TOPIC) == "will/reply"
    assert pr.get(CORRELATION_DATA) == b"\x01\x02corr"
    assert pr.get(USER_PROPERTY) == [("k1", "v1"), ("k2", "v2")]
    assert 110 <= pr.get(MESSAGE_EXPIRY_INTERVAL, 0) <= 120
    ack(w, m)
    w.disconnect()


def test_will_expiry_counts_from_its_publication_3_1_3_2_4(broker):
    """A Will with Message Expiry Interval 2 s whose client stays connected
    3 s: the Will is still published when the client drops, with a Message
    Expiry of at most 2 s left, because its lifetime starts when the Server
    publishes it (3.1.3.2.4: "sent as the Publication Expiry Interval when
    the Server publishes the Will Message"), not at CONNECT."""
    w = watcher(broker.port)
    c = raw_connect(broker.port, "wexp", version=5,
                    will=will("will/exp", b"late", qos=1, props=prop_u32(MESSAGE_EXPIRY_INTERVAL, 2)))
    time.sleep(3.0)
    c.close()
    m = w.expect_publish(5)
    assert m.payload == b"late"
    assert 1 <= m.props.get(MESSAGE_EXPIRY_INTERVAL, 0) <= 2, m.props
    ack(w, m)
    w.disconnect()


# ---------------------------------------------------------------------------
# will delay


def _will_delay_client(port, cid, delay, expiry=60):
    wprops = prop_u32(WILL_DELAY_INTERVAL, delay)
    return raw_connect(port, cid, version=5, clean=False, props=prop_u32(SESSION_EXPIRY_INTERVAL, expiry),
                       will=will("will/delayed", b"late-" + cid.encode(), qos=1, props=wprops))


def test_will_delay_interval_delays_will_MQTT_3_1_3_9(broker):
    """Will Delay Interval 2 s (session expiry 60 s): the Will is not
    published at once but after the delay."""
    w = watcher(broker.port)
    c = _will_delay_client(broker.port, "wd", 2)
    c.close()
    t0 = time.monotonic()
    assert w.no_publish(1.2), "will published before its delay"
    m = w.expect_publish(4)
    dt = time.monotonic() - t0
    assert m.payload == b"late-wd"
    assert 1.5 <= dt <= 4.5, dt
    ack(w, m)
    w.disconnect()


def test_will_delay_cancelled_by_reconnect_MQTT_3_1_3_9(broker):
    """A new connection to the session before the Will Delay Interval has
    passed: the Will is not sent (MQTT-3.1.3-9)."""
    w = watcher(broker.port)
    c = _will_delay_client(broker.port, "wdc", 2)
    c.close()
    time.sleep(0.3)
    c2 = raw_connect(broker.port, "wdc", version=5, clean=False, props=prop_u32(SESSION_EXPIRY_INTERVAL, 60))
    assert c2.connack.session_present
    assert w.no_publish(2.8), "will sent although the client came back within the delay"
    c2.disconnect()
    w.disconnect()


def test_will_delay_longer_than_session_expiry_sent_when_session_ends_MQTT_3_1_3_9(broker):
    """Will Delay 30 s but Session Expiry 0: the session ends at the close,
    so the Will is published then ("whichever happens first").
    (mosquitto 2.0.11 waits for the full delay: known deviation.)"""
    if broker.is_mosquitto:
        pytest.xfail("mosquitto 2.0.11 ignores the session end for the will delay")
    w = watcher(broker.port)
    c = _will_delay_client(broker.port, "wde", 30, expiry=0)
    c.close()
    m = w.expect_publish(3)
    assert m.payload == b"late-wde"
    ack(w, m)
    w.disconnect()


def test_wills_are_published_when_the_broker_stops_MQTT_3_1_2_8(broker_factory):
    """A clean stop (SIGTERM) closes every connection without a DISCONNECT
    from its client and ends every session: a connected client's retained
    will and a will still waiting for its Will Delay are published and kept
    in the store (MQTT-3.1.2-8, 3.1.3.2.2; mosquitto does the same), so a
    device's status does not read "online" after the restart (before: no
    will at all at a stop)."""
    b = broker_factory(storage_type="disc")
    requires_edgebroker(b)
    a = raw_connect(b.port, "dev-a", version=5, will=will("st/a", b"offline", qos=1, retain=True))
    a.publish("st/a", b"online", qos=1, retain=True)
    d = raw_connect(b.port, "dev-d", version=5, clean=False,
                    props=prop_u32(SESSION_EXPIRY_INTERVAL, 3600),
                    will=will("st/d", b"offline", qos=1, retain=True,
                              props=prop_u32(WILL_DELAY_INTERVAL, 30)))
    d.publish("st/d", b"online", qos=1, retain=True)
    d.close()  # its will waits 30 s
    time.sleep(0.3)
    b.stop()
    b2 = broker_factory(storage_type="disc", port=b.port)
    got = mosquitto_sub(b2.port, ["-t", "st/#", "-v"], count=2, timeout=5)
    assert sorted(got) == ["st/a offline", "st/d offline"], got


F32_CLOCK = Path(__file__).resolve().parents[1] / "portable" / "f32_clock_broker.py"


@pytest.mark.parametrize("days", [1, 400])
def test_keepalive_after_a_long_uptime_on_single_precision_floats_MQTT_3_1_2_24(
        broker_factory, days):
    """ESP32 and RP2040 MicroPython have single-precision floats: the
    broker's seconds (MonoClock) step by 4 s once a board has been up 2**25 s
    (388 days). Each step looked like a loop held over 2 s (Broker._turn),
    which postponed the once-a-second tick every time: from then on no keep
    alive, no connect timeout, no expiry and no $SYS, for good. The held loop
    is measured in ticks now. The broker runs here with its clock rounded to
    float32 from an uptime of `days` (f32_clock_broker.py): a silent Keep
    Alive 2 s client is still disconnected (1.5 x Keep Alive, to the clock's
    steps: docs/boards.md) and a client that never sends CONNECT is dropped
    (connect_timeout 2 s)."""
    b = broker_factory(script=str(F32_CLOCK), extra_args=("--fault", str(days * 86400)),
                       connect_timeout=2)
    requires_edgebroker(b)
    silent = raw_connect(b.port, "silent", version=5, keepalive=2)
    mute = socket.create_connection(("127.0.0.1", b.port), timeout=2)
    mute.settimeout(0.1)
    t0 = time.monotonic()
    closed = mute_closed = None
    while time.monotonic() - t0 < 14 and (closed is None or mute_closed is None):
        if closed is None and not silent.is_open(0.2):
            closed = time.monotonic() - t0
        if mute_closed is None:
            try:
                if mute.recv(16) == b"":
                    mute_closed = time.monotonic() - t0
            except socket.timeout:
                pass
            except OSError:
                mute_closed = time.monotonic() - t0
        else:
            time.sleep(0.1)
    mute.close()
    assert closed is not None, "a silent Keep Alive 2 s client was never disconnected"
    assert mute_closed is not None, "a client without CONNECT was never dropped"
    if days == 1:  # the clock's steps are 8 ms: on time
        assert 2.5 <= closed <= 5, closed

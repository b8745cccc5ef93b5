"""The local API (issue 8): code beside the broker publishes and subscribes
with no socket and no client slot. The broker runs in
host_tests/portable/local_app.py, a small application that calls
edgebroker.start() and serves (serve_async() or serve(), per the `server`
fixture), under CPython and MicroPython; the test drives its local client
through the control topic app/ctl and reads what it did on app/result/<id>
and app/seen/<tag>, with paho-mqtt 2 clients on the other side.

Spec statements are MQTT 5.0; the local-API contract is the lead's engine
API notes (publish/subscribe/unsubscribe, ValueError naming the argument).
"""

import binascii
import itertools
import json

import pytest
from mqtt_helpers import paho_client

APP = "host_tests/portable/local_app.py"
_ids = itertools.count(1)


class App:
    """The application's control channel: one paho client that sends
    commands and collects answers and reports."""

    def __init__(self, port):
        self.c = paho_client(port, "app-driver")
        assert self.c.subscribe_wait("app/result/#", 1) == [1]
        assert self.c.subscribe_wait("app/seen/#", 1) == [1]

    def do(self, **cmd):
        cmd["id"] = n = next(_ids)
        self.c.publish_wait("app/ctl", json.dumps(cmd).encode(), qos=1)
        topic = "app/result/%d" % n

        def have():
            return [m for m in self.c.get_messages() if m.topic == topic]
        deadline = 10.0
        self.c._wait(lambda: bool(have()), deadline)
        got = have()
        assert got, "no answer to %r" % (cmd,)
        return json.loads(got[0].payload)

    def seen(self, tag, n, timeout=5.0):
        topic = "app/seen/" + tag

        def have():
            return [json.loads(m.payload) for m in self.c.get_messages() if m.topic == topic]
        self.c._wait(lambda: len(have()) >= n, timeout)
        got = have()
        assert len(got) >= n, "local subscriber %s: %d of %d: %r" % (tag, len(got), n, got)
        return got

    def close(self):
        self.c.close()


def start_app(broker_factory, **profile):
    b = broker_factory(script=APP, **profile)
    return b, App(b.port)


PROPS = {
    "payload_format_indicator": 1,
    "content_type": "application/json",
    "response_topic": "loc/reply",
    "correlation_data_hex": "00ff10",
    "user_properties": [["k", "v1"], ["k", "v2"], ["x", "y"]],
    "message_expiry_interval": 300,
}


def test_local_publish_reaches_paho_subscriber_qos_0_1_2_with_properties_MQTT_3_3_2_17_to_20(
        broker_factory):
    """broker.publish() from the application reaches a network subscriber
    at min(QoS, granted), with its properties unaltered (MQTT-3.3.2-17..20:
    Response Topic, Correlation Data, User Properties in order, Content
    Type) and the Message Expiry Interval (MQTT-3.3.2-6); a retained one
    reaches a later subscriber with RETAIN 1 (MQTT-3.3.1-9)."""
    b, app = start_app(broker_factory)
    sub = paho_client(b.port, "net-sub")
    try:
        assert sub.subscribe_wait("loc/#", 2) == [2]
        for q in (0, 1, 2):
            r = app.do(op="publish", topic="loc/q%d" % q, payload="p%d" % q, qos=q,
                       properties=dict(PROPS))
            assert r == {"ok": True}, r
        got = sorted(sub.wait_messages(3), key=lambda m: m.topic)
        assert [(m.topic, m.payload, m.qos) for m in got] == [
            ("loc/q0", b"p0", 0), ("loc/q1", b"p1", 1), ("loc/q2", b"p2", 2)]
        for m in got:
            p = m.properties
            assert p.PayloadFormatIndicator == 1
            assert p.ContentType == "application/json"
            assert p.ResponseTopic == "loc/reply"
            assert p.CorrelationData == b"\x00\xff\x10"
            assert p.UserProperty == [("k", "v1"), ("k", "v2"), ("x", "y")]
            assert 295 <= p.MessageExpiryInterval <= 300
        r = app.do(op="publish", topic="loc/ret", payload="kept", qos=1, retain=True)
        assert r == {"ok": True}
        late = paho_client(b.port, "late")
        try:
            late.subscribe_wait("loc/ret", 1)
            m = late.wait_messages(1)[0]
            assert (m.payload, m.retain, m.qos) == (b"kept", True, 1)
        finally:
            late.close()
    finally:
        sub.close()
        app.close()


def test_paho_publisher_reaches_local_callback_qos_0_1_2_with_properties(broker_factory):
    """A network PUBLISH at each QoS completes its flow (PUBACK, PUBREC/
    PUBREL/PUBCOMP) and reaches a local subscription's callback with
    topic, payload, retained=False and its properties by name."""
    b, app = start_app(broker_factory)
    assert app.do(op="subscribe", filter="net/#", qos=2, tag="net") == {"ok": True}
    pub = paho_client(b.port, "net-pub")
    try:
        for q in (0, 1, 2):
            pub.publish_wait("net/q%d" % q, b"\x00n%d" % q, qos=q, properties={
                "ContentType": "text/x", "ResponseTopic": "net/re", "CorrelationData": b"\x01\x02",
                "UserProperty": [("a", "1"), ("b", "2")], "MessageExpiryInterval": 120,
                "PayloadFormatIndicator": 0})
        seen = sorted(app.seen("net", 3), key=lambda d: d["topic"])
        assert [(d["topic"], binascii.unhexlify(d["payload"]), d["retained"]) for d in seen] == [
            ("net/q0", b"\x00n0", False), ("net/q1", b"\x00n1", False),
            ("net/q2", b"\x00n2", False)]
        for d in seen:
            p = d["properties"]
            assert p["content_type"] == "text/x" and p["response_topic"] == "net/re"
            assert p["correlation_data_hex"] == "0102"
            assert p["user_properties"] == [["a", "1"], ["b", "2"]]
            assert 115 <= p["message_expiry_interval"] <= 120
    finally:
        pub.close()
        app.close()


def test_local_subscribe_gets_retained_first_as_retain_handling_0_MQTT_3_3_1_9(broker_factory):
    """A local subscription is like a new MQTT subscription with Retain
    Handling 0: the retained messages that match come first, retained=True,
    then live ones with retained=False."""
    b, app = start_app(broker_factory)
    pub = paho_client(b.port, "ret-pub")
    try:
        pub.publish_wait("ret/a", b"A", qos=1, retain=True)
        pub.publish_wait("ret/b/c", b"BC", qos=1, retain=True)
        pub.publish_wait("other", b"O", qos=1, retain=True)
        assert app.do(op="subscribe", filter="ret/#", tag="ret") == {"ok": True}
        first = app.seen("ret", 2)
        assert sorted((d["topic"], d["retained"]) for d in first) == [
            ("ret/a", True), ("ret/b/c", True)]
        pub.publish_wait("ret/live", b"L", qos=1)
        seen = app.seen("ret", 3)
        assert len(seen) == 3 and (seen[2]["topic"], seen[2]["retained"]) == ("ret/live", False)
    finally:
        pub.close()
        app.close()


def test_raising_callback_is_logged_other_local_and_network_subscribers_served(broker_factory):
    """A callback that raises is logged and counted (engine.app_errors); the
    other local subscriber and the network subscriber of the same topic
    get every message, and the broker goes on."""
    b, app = start_app(broker_factory)
    assert app.do(op="subscribe", filter="boom/#", tag="bad", **{"raise": True}) == {"ok": True}
    assert app.do(op="subscribe", filter="boom/#", tag="good") == {"ok": True}
    net = paho_client(b.port, "boom-net")
    pub = paho_client(b.port, "boom-pub")
    try:
        net.subscribe_wait("boom/#", 1)
        for i in range(3):
            pub.publish_wait("boom/%d" % i, b"%d" % i, qos=1)
        assert [d["topic"] for d in app.seen("good", 3)] == ["boom/0", "boom/1", "boom/2"]
        assert [m.payload for m in net.wait_messages(3)] == [b"0", b"1", b"2"]
        assert app.do(op="stats") == {"ok": {"app_errors": 3}}
        assert b.wait_log("raised", 5), b.log_text()[-2000:]
        assert "application bug in bad" in b.log_text()
        assert b.alive()
    finally:
        net.close()
        pub.close()
        app.close()


def test_retained_local_publish_on_disc_is_on_disk_when_publish_returns(broker_factory):
    """storage_type disc: a retained broker.publish() returns after the
    store commit. The application opens the store file a second time right
    after publish() returned and finds the message; the broker is then
    killed (SIGKILL: no shutdown, no flush) and a new one on the same
    data dir serves the message to a new subscriber."""
    b, app = start_app(broker_factory, storage_type="disc")
    try:
        r = app.do(op="publish", topic="disk/one", payload="durable", qos=1, retain=True,
                   check_disk=True)
        assert r == {"ok": binascii.hexlify(b"durable").decode()}, r
        r = app.do(op="publish", topic="disk/two", payload="too", qos=0, retain=True,
                   check_disk=True)
        assert r == {"ok": binascii.hexlify(b"too").decode()}, r
    finally:
        app.close()
    b.kill()
    b2 = broker_factory(script=APP, storage_type="disc")
    sub = paho_client(b2.port, "after-kill")
    try:
        sub.subscribe_wait("disk/#", 1)
        got = sorted((m.topic, m.payload, m.retain) for m in sub.wait_messages(2))
        assert got == [("disk/one", b"durable", True), ("disk/two", b"too", True)]
    finally:
        sub.close()


@pytest.mark.parametrize("cmd, arg", [
    ({"op": "publish", "topic": "a/+", "payload": "x"}, "topic"),
    ({"op": "publish", "topic": "a/#", "payload": "x"}, "topic"),
    ({"op": "publish", "topic": "", "payload": "x"}, "topic"),
    ({"op": "publish", "topic": "$SYS/broker/x", "payload": "x"}, "topic"),
    ({"op": "publish", "topic": "a", "payload": "x", "qos": 3}, "qos"),
    ({"op": "publish", "topic": "a", "payload": "x", "properties": {"nope": 1}}, "properties"),
    ({"op": "subscribe", "filter": "a/#/b"}, "topic_filter"),
    ({"op": "subscribe", "filter": "a", "qos": 3}, "qos"),
    ({"op": "publish", "topic": "a", "payload": 5}, "payload"),
    ({"op": "subscribe", "filter": "a", "no_callback": True}, "callback"),
    ({"op": "unsubscribe", "handle": 12345}, "handle"),
], ids=["plus", "hash", "empty", "sys", "qos3", "property", "filter", "subqos3", "payload-int",
        "no-callback", "bad-handle"])
def test_bad_arguments_raise_value_error_naming_the_argument(broker_factory, cmd, arg):
    """Bad arguments to publish()/subscribe() raise ValueError whose text
    starts with the argument's name; nothing is published and the broker
    goes on."""
    b, app = start_app(broker_factory)
    net = paho_client(b.port, "bad-net")
    try:
        net.subscribe_wait("#", 0)
        net.clear_messages()
        r = app.do(**dict(cmd))
        assert r.get("error") == "ValueError", r
        assert r["text"].startswith(arg), r
        assert [m.topic for m in net.get_messages() if not m.topic.startswith("app/")] == []
        assert app.do(op="publish", topic="still/ok", payload="y") == {"ok": True}
        assert b.alive()
    finally:
        net.close()
        app.close()

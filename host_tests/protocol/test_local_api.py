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
        assert app.do(op="stats")["ok"]["app_errors"] == 3
        assert b.wait_log("raised", 5), b.log_text()[-2000:]
        assert "application bug in bad" in b.log_text()
        assert b.alive()
    finally:
        net.close()
        pub.close()
        app.close()


def test_an_async_def_callback_is_an_error_said_and_counted(broker_factory):
    """subscribe() with an `async def` callback: calling it makes a coroutine
    that nothing would await, so the message would vanish silently (before:
    not even counted). It is logged naming the mistake and counted in
    app_errors, like a callback that raises; the broker goes on."""
    b, app = start_app(broker_factory)
    pub = paho_client(b.port, "co-pub")
    try:
        assert app.do(op="subscribe", filter="co/#", tag="co", **{"async": True}) == {"ok": True}
        pub.publish_wait("co/x", b"1", qos=1)
        assert b.wait_log("callback is async def", 5), b.log_text()[-2000:]
        assert app.do(op="stats")["ok"]["app_errors"] == 1
        assert b.alive()
    finally:
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
    # a string property longer than its 2-byte length can say, or holding
    # U+0000 (MQTT-1.5.4-2); values of the wrong type (before: a malformed
    # PUBLISH went out, or TypeError/IndexError)
    ({"op": "publish", "topic": "a", "properties": {"content_type": "c" * 70000}}, "properties"),
    ({"op": "publish", "topic": "a", "properties": {"content_type": "a\u0000b"}}, "properties"),
    ({"op": "publish", "topic": "a", "properties": {"content_type": 5}}, "properties"),
    ({"op": "publish", "topic": "a", "properties": {"correlation_data": 5}}, "properties"),
    ({"op": "publish", "topic": "a", "properties": {"response_topic": 5}}, "properties"),
    ({"op": "publish", "topic": "a", "properties": {"user_properties": [["a"]]}}, "properties"),
    ({"op": "publish", "topic": "a", "properties": {"user_properties": [["a", 5]]}},
     "properties"),
    ({"op": "publish", "topic": "a", "properties": {"message_expiry_interval": True}},
     "properties"),
], ids=["plus", "hash", "empty", "sys", "qos3", "property", "filter", "subqos3", "payload-int",
        "no-callback", "bad-handle", "prop-too-long", "prop-nul", "prop-int", "corr-int",
        "response-int", "user-one", "user-int", "expiry-bool"])
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


def test_a_local_subscriber_gets_every_acknowledged_message_of_a_burst(broker_factory, server):
    """Four clients send 300 QoS 1 PUBLISHes each at once to a local QoS 1
    subscriber (max_queued 16: its bound is 64 waiting): every acknowledged
    message reaches the callback, nothing is dropped. A local subscriber
    with max_queued callbacks waiting is at high water like a session
    queue, and the PUBLISHes that reach it wait unread until the loop runs
    them (before: the oldest were dropped, counted, acknowledged all the
    same). With the asyncio server, a task of the application's own that
    publishes 300 without awaiting gets all of them to the callback too
    (the callbacks run in publish() once max_queued wait)."""
    import socket
    import threading

    b, app = start_app(broker_factory, max_queued=16)
    try:
        assert app.do(op="subscribe", filter="burst/#", qos=1, count=True, tag="n") == {"ok": True}
        acks = {}

        def blast(k, n=300):
            s = socket.create_connection(("127.0.0.1", b.port))
            cid = b"c%d" % k
            body = b"\x00\x04MQTT\x04\x02\x00\x3c" + len(cid).to_bytes(2, "big") + cid
            s.sendall(bytes((0x10, len(body))) + body)
            s.settimeout(10)
            buf = b""
            while len(buf) < 4:
                buf += s.recv(4 - len(buf))
            t = b"burst/%d" % k
            pkts = []
            for i in range(n):
                pb = len(t).to_bytes(2, "big") + t + (i + 1).to_bytes(2, "big") + b"x%d" % i
                pkts.append(bytes((0x32, len(pb))) + pb)
            s.sendall(b"".join(pkts))
            got = b""
            try:
                while got.count(b"\x40\x02") < n:
                    d = s.recv(65536)
                    if not d:
                        break
                    got += d
            except OSError:
                pass
            acks[k] = got.count(b"\x40\x02")
            s.close()
        ts = [threading.Thread(target=blast, args=(k,)) for k in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        assert sum(acks.values()) == 1200, acks
        want = 1200
        if server == "async":
            assert app.do(op="burst", topic="burst/own", n=300, qos=1) == {"ok": True}
            want += 300
        st = {}
        for _ in range(50):
            st = app.do(op="stats")["ok"]
            if st["counts"]["n"] >= want:
                break
        assert st["counts"]["n"] == want and st["dropped"] == 0, st
    finally:
        app.close()


UNSERVED = """
import sys
sys.path.insert(0, %(lib)r)
import edgebroker
b = edgebroker.start({"storage_type": "disc"}, "127.0.0.1", %(port)d, %(data)r)
b.publish("kept/t", "v", 1, True)
# the application's own setup fails here, before serve_async(): it stops
b.stop()
again = edgebroker.start({"storage_type": "disc"}, "127.0.0.1", %(port)d, %(data)r)
print("again", again.engine.store.get("kept/t")[1])
again.stop()
"""


@pytest.mark.parametrize("interp", ["cpython", "micropython"])
def test_stop_releases_a_broker_that_never_served(interp, tmp_path):
    """start(), then the application fails before serving and calls stop():
    the port and the store are released at once (before: only a server's
    end shut them, so a second start() on the port failed with EADDRINUSE
    and the store stayed open), and what was published is kept."""
    import subprocess
    import sys
    from pathlib import Path

    from mqtt_helpers import free_port

    repo = Path(__file__).resolve().parents[2]
    code = UNSERVED % {"lib": str(repo / "lib"), "port": free_port(),
                       "data": str(tmp_path)}
    exe = sys.executable if interp == "cpython" else str(Path(sys.executable).parent / "micropython")
    r = subprocess.run([exe, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["again", "b'v'"], r.stdout


NO_DIR = """
import sys
sys.path.insert(0, %(lib)r)
import edgebroker
for kind in ("disc", "disc_only"):
    try:
        edgebroker.start({"storage_type": kind}, "127.0.0.1", %(port)d)
        print("started", kind)
    except ValueError as e:
        print("refused", str(e).split(":")[0])
"""


@pytest.mark.parametrize("interp", ["cpython", "micropython"])
def test_start_refuses_a_flash_store_without_data_dir(interp):
    """storage_type disc or disc_only without a data_dir raises ValueError
    naming data_dir (before: a RAM store without a word, so that a retained
    publish() said kept was gone at the next start)."""
    import subprocess
    import sys
    from pathlib import Path

    from mqtt_helpers import free_port

    repo = Path(__file__).resolve().parents[2]
    code = NO_DIR % {"lib": str(repo / "lib"), "port": free_port()}
    exe = sys.executable if interp == "cpython" else str(Path(sys.executable).parent / "micropython")
    r = subprocess.run([exe, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[:2] == ["refused data_dir", "refused data_dir"], r.stdout

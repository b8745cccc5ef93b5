"""A failed store commit (flash full, I/O error) acknowledges nothing: the
publisher waiting for its PUBACK is disconnected (5.0: DISCONNECT 0x80;
3.1.1: closed) so that it resends on reconnect (MQTT-4.4.0-1), the failure
is counted under $SYS/broker/refusals/store_io, and the broker goes on
serving everyone else (docs/retained.md "Durability")."""

from pathlib import Path

import pytest

from mqtt_helpers import (DISCONNECT, PUBCOMP, PUBREC, SESSION_EXPIRY_INTERVAL, RawClient,
                          prop_u32, publish_packet, pubrel, raw_connect, requires_edgebroker)

SCRIPT = Path(__file__).resolve().parents[1] / "portable" / "failing_store_broker.py"


@pytest.mark.parametrize("version", [5, 4], ids=["v5", "v311"])
def test_failed_commit_never_acknowledges_and_broker_goes_on(broker_factory, interp, version):
    b = broker_factory(script=str(SCRIPT))
    requires_edgebroker(b)
    other = raw_connect(b.port, "bystander", version=5)
    assert other.subscribe([("#", 1)]) == [1]
    pub = RawClient(b.port, version=version)
    assert pub.connect("pub-%d" % version).reason == 0
    pub.send(publish_packet("fail/t", b"v1", qos=1, retain=True, pid=9, version=version))
    closed, seen = pub.read_until_closed(5)
    assert closed, "the publisher was not disconnected"
    # no PUBACK for the change that never became durable
    assert [p.ptype for p in seen if p.ptype == 4] == []
    if version == 5:
        d = [p for p in seen if p.ptype == DISCONNECT]
        assert d and d[0].body[0] == 0x80
    # the broker goes on: a durable change to another topic is acknowledged
    ok = raw_connect(b.port, "pub-ok", version=5)
    ok.publish("good/t", b"v2", qos=1, retain=True, pid=3)
    m = other.expect_publish(5)
    while m.topic != "good/t":
        m = other.expect_publish(5)
    assert m.payload == b"v2"
    assert b.wait_log("store_io", timeout=3)
    for c in (other, ok):
        c.disconnect()


@pytest.mark.parametrize("version", [5, 4], ids=["v5", "v311"])
def test_qos2_resend_after_a_failed_commit_is_stored_and_delivered_once(broker_factory, interp,
                                                                       version):
    """A retained QoS 2 PUBLISH whose commit fails gets no PUBREC (the
    store undid it) and its publisher is disconnected; the client's resend
    on its resumed session (DUP, same packet identifier) is stored, then
    PUBREC, PUBREL, PUBCOMP, and a new subscriber gets the retained message.
    The subscriber that had the message the first time does not get it
    again (MQTT-4.3.3-10). Before, the resend was taken for a duplicate:
    PUBREC and PUBCOMP for a message the store never kept."""
    b = broker_factory(script=str(SCRIPT))
    requires_edgebroker(b)
    other = raw_connect(b.port, "bystander", version=5)
    assert other.subscribe([("fail/#", 2)]) == [2]
    props = prop_u32(SESSION_EXPIRY_INTERVAL, 600) if version == 5 else b""
    pub = RawClient(b.port, version=version)
    assert pub.connect("pub2-%d" % version, clean=False, props=props).reason == 0
    pub.send(publish_packet("fail/q2", b"v", qos=2, retain=True, pid=7, version=version))
    closed, seen = pub.read_until_closed(5)
    assert closed and [p for p in seen if p.ptype == PUBREC] == []
    first = other.expect_publish(5)
    assert (first.topic, first.payload) == ("fail/q2", b"v")
    other.send(bytes((0x50, 2)) + first.pid.to_bytes(2, "big"))  # PUBREC
    pub = RawClient(b.port, version=version)
    ack = pub.connect("pub2-%d" % version, clean=False, props=props)
    assert ack.reason == 0 and ack.session_present
    pub.send(publish_packet("fail/q2", b"v", qos=2, retain=True, pid=7, dup=True,
                            version=version))
    pid, _, _ = pub.expect_ack(PUBREC)
    assert pid == 7
    pub.send(pubrel(7, version))
    pid, _, _ = pub.expect_ack(PUBCOMP)
    assert pid == 7
    late = raw_connect(b.port, "late", version=5)
    assert late.subscribe([("fail/#", 1)]) == [1]
    m = late.expect_publish(5)
    assert (m.topic, m.payload, m.retain) == ("fail/q2", b"v", True)
    assert other.no_publish(0.5), "delivered twice"
    for c in (other, pub, late):
        c.disconnect()

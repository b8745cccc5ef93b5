"""A failed store commit (flash full, I/O error) acknowledges nothing: the
publisher waiting for its PUBACK is disconnected (5.0: DISCONNECT 0x80;
3.1.1: closed) so that it resends on reconnect (MQTT-4.4.0-1), the failure
is counted under $SYS/broker/refusals/store_io, and the broker goes on
serving everyone else (docs/retained.md "Durability")."""

from pathlib import Path

import pytest

from mqtt_helpers import (DISCONNECT, RawClient, publish_packet, raw_connect,
                          requires_edgebroker)

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

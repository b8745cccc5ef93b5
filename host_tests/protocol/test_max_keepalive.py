"""max_keepalive (issue 11, item 5): an MQTT 5 client asking for a longer
keep alive, or none, gets Server Keep Alive = max_keepalive in its CONNACK
(3.2.2.3.14) and is held to it (1.5 x, MQTT-3.1.2-22); a 3.1.1 client,
which cannot be told, is refused with return code 2 (as mosquitto does).
paho MQTT 5 and raw clients, both interpreters, both servers."""

import threading
import time

import paho.mqtt.client as mqtt

from mqtt_helpers import RawClient, requires_edgebroker

SERVER_KEEP_ALIVE = 0x13


def test_paho_5_is_told_server_keep_alive_and_held_to_it_MQTT_3_2_2_21(broker_factory):
    b = broker_factory(max_keepalive=2)
    requires_edgebroker(b)
    seen = {}
    done = threading.Event()

    def on_connect(client, userdata, flags, rc, props=None):
        seen["ska"] = getattr(props, "ServerKeepAlive", None)
        done.set()

    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="mk-paho", protocol=mqtt.MQTTv5)
    c.on_connect = on_connect
    c.connect("127.0.0.1", b.port, keepalive=60)
    c.loop_start()
    assert done.wait(10)
    assert seen["ska"] == 2
    c.disconnect()
    c.loop_stop()


def test_silent_5_client_dropped_after_one_and_a_half_max_keepalive(broker_factory):
    """Keep alive 0 (none) asked, max_keepalive 1: Server Keep Alive 1, and
    a client that then stays silent is disconnected within about 1.5 s
    (0x8D, MQTT-3.1.2-22)."""
    b = broker_factory(max_keepalive=1)
    requires_edgebroker(b)
    with RawClient(b.port, version=5) as r:
        ack = r.connect("mk-silent", keepalive=0)
        assert ack.reason == 0 and ack.props.get(SERVER_KEEP_ALIVE) == 1
        t0 = time.monotonic()
        reason, _ = r.expect_disconnect(6)
        assert reason == 0x8D
        assert time.monotonic() - t0 < 4.5


def test_311_client_over_max_keepalive_refused_rc_2(broker_factory):
    b = broker_factory(max_keepalive=30)
    requires_edgebroker(b)
    with RawClient(b.port, version=4) as r:
        assert r.connect("mk-311", keepalive=60).reason == 2
    with RawClient(b.port, version=4) as r:
        assert r.connect("mk-311-ok", keepalive=20).reason == 0


def test_311_client_over_max_keepalive_refused_rc_2_with_server_keep_alive_set(broker_factory):
    """server_keep_alive wins for 5.0 clients, which it can be told to; a
    3.1.1 client cannot be told it, so max_keepalive still refuses one asking
    for more or for none (before: accepted with its own keep alive 0 and
    never disconnected while silent)."""
    b = broker_factory(max_keepalive=10, server_keep_alive=3)
    requires_edgebroker(b)
    for ka in (0, 11):
        with RawClient(b.port, version=4) as r:
            assert r.connect("mk-ska-%d" % ka, keepalive=ka).reason == 2
    with RawClient(b.port, version=4) as r:
        assert r.connect("mk-ska-ok", keepalive=10).reason == 0

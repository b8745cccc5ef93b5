"""Shared subscriptions (issue 11, item 5; MQTT 5 4.8.2): $share/{name}/
{filter} gives each message to one member of the group, round robin over
the connected members; groups with different names each get every message;
a member's own options (QoS) apply; no retained messages at subscribe; an
invalid ShareName is refused (0x8F, MQTT-4.8.2-1/-2) and No Local on a
shared subscription is a Protocol Error (MQTT-3.8.3-4). Real paho clients
and a raw client, both interpreters, both servers."""

import time

import paho.mqtt.client as mqtt

from mqtt_helpers import (
    raw_connect,
    requires_edgebroker,
    subscribe_packet,
)


def _paho(port, cid, got):
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=cid, protocol=mqtt.MQTTv5)
    c.on_message = lambda cl, u, m: got.append((cid, m.topic, m.payload, m.qos, m.retain))
    c.connect("127.0.0.1", port)
    c.loop_start()
    return c


def _wait(cond, timeout=10):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return cond()


def test_each_message_goes_to_one_member_round_robin_MQTT_4_8_2(broker_factory):
    """Three paho members of $share/workers/jobs/# and one of another group
    $share/audit/jobs/#: 30 QoS 1 messages; the workers get each message
    exactly once between them, 10 each (round robin over connected
    members); the audit member gets all 30; a retained message published
    before the subscriptions is not sent at subscribe."""
    b = broker_factory()
    requires_edgebroker(b)
    got = []
    pub = _paho(b.port, "sh-pub", [])
    pub.publish("jobs/old", b"retained", qos=1, retain=True).wait_for_publish(10)
    workers = [_paho(b.port, "sh-w%d" % k, got) for k in range(3)]
    audit = _paho(b.port, "sh-audit", got)
    for w in workers:
        w.subscribe("$share/workers/jobs/#", qos=1)
    audit.subscribe("$share/audit/jobs/#", qos=1)
    time.sleep(0.5)
    for k in range(30):
        pub.publish("jobs/%d" % k, b"job %d" % k, qos=1).wait_for_publish(10)
    assert _wait(lambda: len(got) >= 60), got
    time.sleep(0.3)
    work = [g for g in got if g[0] != "sh-audit"]
    audit_got = [g for g in got if g[0] == "sh-audit"]
    assert sorted(g[2] for g in work) == sorted(b"job %d" % k for k in range(30))
    assert sorted(g[2] for g in audit_got) == sorted(b"job %d" % k for k in range(30))
    per = {}
    for g in work:
        per[g[0]] = per.get(g[0], 0) + 1
    assert per == {"sh-w0": 10, "sh-w1": 10, "sh-w2": 10}
    assert all(not g[4] and g[1] != "jobs/old" for g in got), "retained sent at shared subscribe"
    for c in workers + [audit, pub]:
        c.disconnect()
        c.loop_stop()


def test_a_member_that_leaves_gets_nothing_more_and_the_rest_get_all(broker_factory):
    """One of two members unsubscribes: every later message goes to the
    other one; its QoS (0) is its own."""
    b = broker_factory()
    requires_edgebroker(b)
    got = []
    a = _paho(b.port, "sh-a", got)
    c = _paho(b.port, "sh-c", got)
    a.subscribe("$share/g/t/+", qos=1)
    c.subscribe("$share/g/t/+", qos=0)
    time.sleep(0.5)
    a.unsubscribe("$share/g/t/+")
    time.sleep(0.3)
    pub = _paho(b.port, "sh-pub2", [])
    for k in range(6):
        pub.publish("t/%d" % k, b"%d" % k, qos=1).wait_for_publish(10)
    assert _wait(lambda: len(got) >= 6)
    time.sleep(0.2)
    assert {g[0] for g in got} == {"sh-c"} and len(got) == 6
    assert all(g[3] == 0 for g in got)
    for x in (a, c, pub):
        x.disconnect()
        x.loop_stop()


def test_invalid_share_name_refused_and_no_local_is_a_protocol_error(broker_factory):
    """'$share//t', '$share/g+/t' and '$share/g' -> SUBACK 0x8F
    (MQTT-4.8.2-1/-2) beside a granted plain filter; No Local on a shared
    subscription -> DISCONNECT 0x82 (MQTT-3.8.3-4)."""
    b = broker_factory()
    requires_edgebroker(b)
    c = raw_connect(b.port, "sh-bad", version=5)
    assert c.subscribe([("$share//t", 1), ("$share/g+/t", 1), ("$share/g", 1), ("ok/t", 1)]) \
        == [0x8F, 0x8F, 0x8F, 1]
    c.send(subscribe_packet(2, [("$share/g/t", 1 | 4)]))
    reason, _ = c.expect_disconnect(5)
    assert reason == 0x82

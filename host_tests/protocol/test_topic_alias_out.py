"""Topic aliases on outbound PUBLISH (issue 11, item 5; MQTT 5 3.3.2.3.4):
when a client's CONNECT allows aliases (Topic Alias Maximum > 0), the
broker maps a topic on its first PUBLISH and then sends an empty topic with
the alias, never more aliases than min(client's maximum,
topic_alias_maximum), and never changes a mapping. A raw client checks the
bytes; paho-mqtt 2, which has no alias support, is never sent one. Both
interpreters, both servers."""

import socket
import time

import paho.mqtt.client as mqtt

from mqtt_helpers import (
    connect_packet,
    decode_varint,
    parse_props,
    prop_u16,
    publish_packet,
    requires_edgebroker,
    subscribe_packet,
)

TOPICS = ["site/line-%d/temperature" % i for i in range(6)]


def _read_publishes(s, count, timeout=10):
    """(topic bytes, alias or None, payload) of the next `count` PUBLISHes."""
    s.settimeout(timeout)
    buf = b""
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < count and time.monotonic() < deadline:
        buf += s.recv(65536)
        while len(buf) >= 2:
            rl, j = decode_varint(buf, 1)
            if len(buf) < j + rl:
                break
            first, body = buf[0], buf[j:j + rl]
            buf = buf[j + rl:]
            if first >> 4 != 3:
                continue
            n = body[0] << 8 | body[1]
            topic = body[2:2 + n]
            k = 2 + n + (2 if first & 6 else 0)
            plen, k2 = decode_varint(body, k)
            props = parse_props(body[k2:k2 + plen])
            out.append((topic, props.get(0x23), body[k2 + plen:]))
    return out


def _pair(broker_factory, cid, props):
    """A raw subscriber to site/# (CONNECT properties ``props``) and a raw
    publisher, on a broker with topic_alias_maximum 10."""
    b = broker_factory(topic_alias_maximum=10)
    requires_edgebroker(b)
    s = socket.create_connection(("127.0.0.1", b.port), timeout=10)
    s.sendall(connect_packet(cid + "-sub", version=5, props=props))
    s.recv(64)
    s.sendall(subscribe_packet(1, [("site/#", 0)], version=5))
    s.recv(64)
    p = socket.create_connection(("127.0.0.1", b.port), timeout=10)
    p.sendall(connect_packet(cid + "-pub", version=5))
    p.recv(64)
    return s, p


def test_aliases_map_on_first_use_then_replace_the_topic_bounded_by_the_client(broker_factory):
    """Topic Alias Maximum 3 from the client, 6 topics each published twice:
    the first three topics get aliases 1..3 (topic sent once with it, then
    empty topic + alias), the other three are always sent in full."""
    s, p = _pair(broker_factory, "ta", prop_u16(0x22, 3))
    for rnd in range(2):
        for t in TOPICS:
            p.sendall(publish_packet(t, b"%d" % rnd, qos=0, version=5))
    got = _read_publishes(s, 12)
    assert len(got) == 12
    first, second = got[:6], got[6:]
    for i, (topic, alias, _) in enumerate(first):
        assert topic == TOPICS[i].encode()
        assert alias == (i + 1 if i < 3 else None)
    for i, (topic, alias, _) in enumerate(second):
        if i < 3:
            assert topic == b"" and alias == i + 1
        else:
            assert topic == TOPICS[i].encode() and alias is None
    s.close()
    p.close()


def test_no_alias_without_the_clients_consent(broker_factory):
    """No Topic Alias Maximum in CONNECT (0, the default): never an alias."""
    s, p = _pair(broker_factory, "ta-none", b"")
    for rnd in range(2):
        p.sendall(publish_packet(TOPICS[0], b"x", qos=0, version=5))
    got = _read_publishes(s, 2)
    assert [(t, a) for t, a, _ in got] == [(TOPICS[0].encode(), None)] * 2
    s.close()
    p.close()


def test_paho_which_has_no_alias_support_gets_every_topic_in_full(broker_factory):
    """paho-mqtt 2 has no topic alias support and so never sends a Topic
    Alias Maximum: QoS 1 messages on 6 topics, three rounds, all reach its
    callback with their topic (an alias would arrive as an empty topic)."""
    b = broker_factory(topic_alias_maximum=10)
    requires_edgebroker(b)
    got = []
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="ta-paho", protocol=mqtt.MQTTv5)
    c.on_message = lambda cl, u, m: got.append((m.topic, m.payload))
    c.connect("127.0.0.1", b.port)
    c.loop_start()
    c.subscribe("site/#", qos=1)
    time.sleep(0.5)
    pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="ta-paho-pub", protocol=mqtt.MQTTv5)
    pub.connect("127.0.0.1", b.port)
    pub.loop_start()
    want = []
    for rnd in range(3):
        for t in TOPICS:
            pub.publish(t, b"%s %d" % (t.encode(), rnd), qos=1).wait_for_publish(10)
            want.append((t, b"%s %d" % (t.encode(), rnd)))
    deadline = time.monotonic() + 10
    while len(got) < len(want) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(got) == sorted(want)
    for x in (c, pub):
        x.disconnect()
        x.loop_stop()

"""Order between connections (README, "What the broker does": "Order";
docs/design.md, "Servers").

MQTT orders the messages of one connection only (MQTT 3.1.1 4.6, 5.0 4.6):
a subscriber that has its SUBACK receives what is published after it, on
every server and interpreter (test_pubsub covers that). Without waiting for
the SUBACK it depends on which socket the broker serves first when both are
ready. The host build under CPython serves sockets in the order their bytes
came (epoll on Linux; asyncio's selector is epoll too), as mosquitto does,
so a SUBSCRIBE sent before another client's PUBLISH takes effect first: the
Eclipse Paho interoperability suite (client_test5.py test_subscribe_options,
test_request_response) relies on it. Before the poll server used epoll it
served the older connection first and the subscriber missed the message
every time.

MicroPython's poll has no arrival order (its poller reports ready sockets in
the order of its own table), so this is a property of the CPython host build
and of mosquitto, the reference this test also runs against; a board's
clients wait for the SUBACK, which every server honours.
"""

import pytest

from mqtt_helpers import publish_packet, raw_connect, subscribe_packet

ROUNDS = 10


@pytest.mark.parametrize("interp", ["cpython", "cpython-async", "mosquitto"], indirect=True)
def test_a_subscribe_sent_before_another_clients_publish_is_served_first(broker):
    missed = []
    for i in range(ROUNDS):
        topic = "order/%d" % i
        # the publisher connects first: the older connection, and the lower
        # descriptor, which poll used to report first
        pub = raw_connect(broker.port, "order-pub-%d" % i)
        sub = raw_connect(broker.port, "order-sub-%d" % i)
        try:
            sub.send(subscribe_packet(1, [(topic, 1)]))
            pub.send(publish_packet(topic, b"m%d" % i, qos=0))
            _, codes, _ = sub.expect_suback()
            assert codes[0] == 1, codes
            try:
                m = sub.expect_publish(timeout=2.0)
            except TimeoutError:
                missed.append(i)
                continue
            assert (m.topic, m.payload) == (topic, b"m%d" % i)
        finally:
            pub.close()
            sub.close()
    assert not missed, (
        "the PUBLISH was served before the SUBSCRIBE sent before it in rounds %s" % missed
    )

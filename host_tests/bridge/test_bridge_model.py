"""The bridge under a random schedule of faults (issue 10: "0 lost in every
fault test"): seeded runs in which a local publisher's QoS 1/2 messages are
acknowledged by the gateway while the upstream (Debian's mosquitto, with
persistence) stops and starts, the link is cut, one acknowledgement from
the upstream is lost, and the gateway itself is killed (SIGKILL) and
started again on the same data directory, in any order. At the end, with
everything up: every message the gateway acknowledged has reached the
upstream's subscriber, the first arrivals of each topic in publication
order, and with QoS 2 each exactly once (4.3.3; the upstream keeps the
bridge's session). Both interpreters, the asyncio server (test_bridge.py).
"""

import random
import time

import pytest
from mqtt_helpers import PUBACK, PUBCOMP, PUBREC, pubrel, publish_packet, raw_connect, wait_for
from test_bridge import (  # noqa: F401 (fixtures)
    ASYNC,
    OUT,
    arrived,
    bridge,
    bridge_state,
    check_all_in_order,
    collector,
    gateway,
    proxy,
    upstream,
)


def publish(port, msgs, qos, pid0):
    """Publishes and waits for each acknowledgement (the message is then
    the gateway's: on flash, disc_only)."""
    c = raw_connect(port, "", version=5)
    pid = pid0
    for topic, payload in msgs:
        pid = pid % 65535 + 1
        c.send(publish_packet(topic, payload, qos=qos, pid=pid))
        if qos == 1:
            assert c.expect_ack(PUBACK, 10)[:2] == (pid, 0)
        else:
            assert c.expect_ack(PUBREC, 10)[:2] == (pid, 0)
            c.send(pubrel(pid))
            assert c.expect_ack(PUBCOMP, 10)[0] == pid
    c.disconnect()
    return pid


@ASYNC
@pytest.mark.timeout(240)
@pytest.mark.parametrize("seed,qos", [(1, 1), (2, 2), (3, 1), (4, 2)])
def test_random_faults_lose_nothing(broker_factory, upstream, collector, proxy, seed, qos):
    rng = random.Random(seed)
    up = upstream()
    col = collector(up.port, qos=qos)
    px = proxy(up.port)
    rules = [dict(OUT[0], qos=qos)]
    b = bridge(px.port, rules, keepalive=5, replay_rate=rng.choice((0, 500)))
    gw = gateway(broker_factory, [b])
    sent = []
    running = True
    lost_ack = False
    pid = 0
    log = []
    for _ in range(50):
        r = rng.random()
        if r < 0.35:
            k = rng.randint(1, 60)
            msgs = [("sensors/p%d" % rng.randint(0, 4), b"%d" % (len(sent) + i)) for i in range(k)]
            pid = publish(gw.port, msgs, qos, pid)
            sent += msgs
            log.append("publish %d" % k)
        elif r < 0.45:
            if running:
                # the upstream goes away: the link is cut and connects are
                # turned down first, so that nothing is acknowledged by a
                # mosquitto being stopped (in the first runs of this test,
                # mosquitto 2.0.11 acknowledged the last message before its
                # SIGTERM within 2 ms of it, and its subscriber never got
                # that message after the restart). The cut does not end an
                # exchange that was under way: a PUBREL or PUBLISH that
                # reached mosquitto just before it is acknowledged as the
                # link goes, so mosquitto gets a moment before its SIGTERM.
                # (Once, in a full make test on a loaded machine, seed 2
                # lost message 108 on both interpreters with the bridge's
                # backlog empty, i.e. the upstream had acknowledged it: it
                # was in flight when the batch before this step ended.
                # mosquitto 2.0.11 alone, this fixture's configuration, a
                # raw QoS 2 publisher and a paho subscriber that reconnects,
                # SIGTERM and restart after each message: 1 of 20-30
                # acknowledged messages never reached the subscriber, with
                # or without 0.3 s before the SIGTERM; so the moment makes
                # this rarer, not impossible: a loss here with the bridge's
                # backlog empty is the upstream's.)
                px.refuse = True
                px.cut()
                time.sleep(0.3)
                up.stop()
                log.append("upstream down")
            else:
                up.start()
                assert wait_for(lambda: col.c.is_connected(), 10)
                px.refuse = False
                log.append("upstream up")
            running = not running
        elif r < 0.55:
            if running:
                px.cut()
                log.append("link cut")
        elif r < 0.67:
            gw.kill()
            gw = gateway(broker_factory, [b], port=gw.port)
            log.append("gateway killed and started")
        elif r < 0.72:
            if running and not lost_ack:
                # the next PUBACK from the upstream never reaches the bridge:
                # a keep-alive period later it connects again and resends
                px.drop_acks = 1
                lost_ack = True
                log.append("an acknowledgement lost")
        else:
            time.sleep(rng.uniform(0.1, 0.6))  # the link works meanwhile
            log.append("pause")
    if not running:
        up.start()
        assert wait_for(lambda: col.c.is_connected(), 10)
        px.refuse = False
    want = [("site1/gw1/" + t, p) for t, p in sent]
    if not wait_for(lambda: len(arrived(col)) >= len(set(want)), 90):
        missing = sorted(set(want) - arrived(col), key=want.index)
        # what tells whose loss it is: the bridge's backlog (empty: the
        # upstream acknowledged every message) and the upstream's own log
        try:
            state = bridge_state(gw.port)
        except Exception as e:  # (the report must not hide the failure)
            state = "unreadable: %r" % (e,)
        raise AssertionError("%d of %d arrived, missing %r; schedule: %s\nbridge state: %s\n"
                             "gateway log:\n%s\nupstream log:\n%s" % (
                                 len(arrived(col)), len(set(want)), missing[:10], log, state,
                                 gw.log_text()[-3000:], up.log()[-3000:]))
    got = [m for m in col.get() if not m[0].endswith("/status")]
    check_all_in_order(got, want)
    if qos == 2:
        time.sleep(1.0)
        got = [(t, p) for t, p, *_ in col.get() if not t.endswith("/status")]
        assert len(got) == len(want), "%d duplicates; schedule: %s" % (len(got) - len(want), log)
    assert gw.alive()

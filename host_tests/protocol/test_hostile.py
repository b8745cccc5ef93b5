"""Hostile clients: regression tests for the defects an adversarial campaign
found (each failed before its fix). Every test runs per interpreter and per
server (conftest's ``interp`` ids).

- idle TCP connections that never send CONNECT (MicroPython crashed in
  select.poll once they had exhausted a board heap)
- a client id taken by another user (session takeover across users)
- wills that skipped the topic checks ($SYS, max_topic_length/levels)
- quadratic parsing (huge User Property counts, partial large packets)
- in-flight entries that could never be resent holding the window for good
- one session's queue bounded in bytes, not only in messages
- a client that sends and never reads grew its send buffer without bound
"""

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mqtt_helpers import (
    PUBACK,
    RawClient,
    board_heap_64,
    connect_packet,
    free_port,
    mpy_build,
    prop_pair,
    prop_u32,
    puback,
    publish_packet,
    requires_edgebroker,
)

REPO = Path(__file__).resolve().parents[2]


def _mpy_script(interp, tmp_path):
    """Under MicroPython the broker runs as a board runs it: .mpy files,
    no compiler heap (like test_malformed's esp32 test)."""
    if interp != "micropython":
        return None
    return mpy_build(tmp_path / "mpy", store="edgeopen")


def test_300_idle_sockets_then_a_real_client_esp32_profile(broker_factory, interp, tmp_path):
    """Defect 1: 300 TCP connections that never send CONNECT, against the
    esp32 profile with its board heap under MicroPython. Before: MemoryError
    for new connections, then SIGSEGV in poll. Now pre-CONNECT connections
    are bounded (the oldest dropped for a new one), accept pauses when the
    heap is low, and a real client then connects and works."""
    prof = json.loads((REPO / "boards" / "esp32.json").read_text())
    heap = board_heap_64(prof) if interp == "micropython" else None
    b = broker_factory(heap=heap, board="boards/esp32.json", script=_mpy_script(interp, tmp_path))
    requires_edgebroker(b)
    idle = []
    try:
        # Non-blocking connects, as an attacker would: the board profile's
        # backlog (2) is far smaller than the flood, so the kernel retries
        # SYNs while the broker accepts.
        for _ in range(300):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", b.port))
            idle.append(s)
        time.sleep(4.0)
        assert b.alive(), b.log_text()[-3000:]
        with RawClient(b.port) as c:
            ack = c.connect("real-client")
            assert ack.reason == 0
            assert c.subscribe([("t/#", 1)]) == [1]
            assert c.publish("t/1", b"x", qos=1, pid=3) == 0
            m = c.expect_publish(5)
            assert m.payload == b"x"
            c.send(puback(m.pid))
    finally:
        for s in idle:
            s.close()
    assert b.alive()
    assert "refused (pre_connect)" in b.log_text()


@pytest.mark.parametrize("version", [5, 4])
def test_client_id_belongs_to_its_user(broker_factory, interp, version):
    """Defect 4: user B connecting with user A's client id (clean start 0)
    is refused (5.0 0x85 Client Identifier not valid, 3.1.1 rc 2) and A's
    session is untouched: A, online, stays connected; offline, A resumes
    with session present and gets what was queued."""
    b = broker_factory(allow_anonymous=False, users={"alice": "a-pass", "bob": "b-pass"},
                       max_session_expiry=3600)
    requires_edgebroker(b)
    props = prop_u32(0x11, 600) if version == 5 else b""
    a = RawClient(b.port, version=version)
    assert a.connect("shared-id", clean=False, username="alice", password=b"a-pass",
                     props=props).reason == 0
    assert a.subscribe([("q/#", 1)]) == [1]
    with RawClient(b.port, version=version) as thief:
        ack = thief.connect("shared-id", clean=False, username="bob", password=b"b-pass", props=props)
        assert ack.reason == (0x85 if version == 5 else 2)
        assert not ack.session_present
        assert thief.closed(3)
    assert a.is_open(0.3), "the owner must not be taken over"
    a.disconnect()
    with RawClient(b.port, version=5) as pub:
        pub.connect("pub", username="alice", password=b"a-pass")
        assert pub.publish("q/1", b"queued-for-alice", qos=1, pid=2) == 0
    with RawClient(b.port, version=version) as thief:
        ack = thief.connect("shared-id", clean=False, username="bob", password=b"b-pass", props=props)
        assert ack.reason == (0x85 if version == 5 else 2)
        assert thief.no_publish(0.3)
    with RawClient(b.port, version=version) as a2:
        ack = a2.connect("shared-id", clean=False, username="alice", password=b"a-pass", props=props)
        assert ack.reason == 0 and ack.session_present
        assert a2.expect_publish(5).payload == b"queued-for-alice"


@pytest.mark.parametrize("version", [5, 4])
def test_clean_start_of_another_user_takes_the_client_id_over(broker_factory, interp, version):
    """Whoever takes a client id first does not lock its owner out: another
    user's Clean Start 1 resumes nothing, so it is accepted (MQTT-3.1.4-3,
    3.1.1 MQTT-3.1.4-2): the old session is discarded (session present 0,
    nothing of its queue delivered), the new user's ACL applies, and a
    connection of the other user is taken over (5.0 DISCONNECT 0x8E). Its
    Clean Start 0 stays refused (test_client_id_belongs_to_its_user).
    Before: every CONNECT of another user was refused, 0x85 / rc 2."""
    acl = [{"who": "user:alice", "access": "readwrite", "topic": "a/#"},
           {"who": "user:bob", "access": "readwrite", "topic": "q/#"}]
    b = broker_factory(allow_anonymous=False, users={"alice": "a-pass", "bob": "b-pass"},
                       max_session_expiry=3600, acl=acl)
    requires_edgebroker(b)
    props = prop_u32(0x11, 600) if version == 5 else b""
    with RawClient(b.port, version=version) as squat:
        assert squat.connect("owned-id", clean=False, username="bob", password=b"b-pass",
                             props=props).reason == 0
        assert squat.subscribe([("q/#", 1)]) == [1]
        squat.disconnect()
    with RawClient(b.port, version=5) as pub:
        pub.connect("pub", username="bob", password=b"b-pass")
        assert pub.publish("q/1", b"queued-for-bob", qos=1, pid=2) == 0
    a = RawClient(b.port, version=version)
    ack = a.connect("owned-id", clean=True, username="alice", password=b"a-pass", props=props)
    assert ack.reason == 0 and not ack.session_present
    assert a.no_publish(0.3), "the discarded session's queue was delivered"
    denied = 0x87 if version == 5 else 0x80
    assert a.subscribe([("q/#", 1), ("a/#", 1)]) == [denied, 1]
    with RawClient(b.port, version=version) as thief:
        ack = thief.connect("owned-id", clean=False, username="bob", password=b"b-pass", props=props)
        assert ack.reason == (0x85 if version == 5 else 2)
    assert a.is_open(0.3)
    with RawClient(b.port, version=version) as bob:
        ack = bob.connect("owned-id", clean=True, username="bob", password=b"b-pass")
        assert ack.reason == 0 and not ack.session_present
        if version == 5:
            assert a.expect_disconnect(3)[0] == 0x8E
        assert a.closed(3)
    a.close()


@pytest.mark.parametrize("version", [5, 4])
def test_will_checked_like_publish(broker_factory, interp, version):
    """Defect 5: a will is checked at CONNECT like a PUBLISH: not on $SYS
    (5.0 0x87 / 3.1.1 rc 5), not over max_topic_length or max_topic_levels
    (5.0 0x90 / 3.1.1 closed), so it can never forge $SYS or store a retained
    message no PUBLISH could delete."""
    b = broker_factory(max_topic_length=64, max_topic_levels=8)
    requires_edgebroker(b)
    cases = [
        ("$SYS/broker/uptime", 0x87, 5),
        ("a/" + "x" * 100, 0x90, None),
        ("/".join(["l"] * 20), 0x90, None),
    ]
    for topic, rc5, rc3 in cases:
        with RawClient(b.port, version=version) as c:
            c.send(connect_packet("w-%d" % len(topic), version=version,
                                  will={"topic": topic, "payload": b"forged", "retain": True}))
            if version == 5 or rc3 is not None:
                ack = c.expect_connack(3)
                assert ack.reason == (rc5 if version == 5 else rc3), topic
            assert c.closed(3)
    # nothing was stored: a '#' and a '$SYS/#' subscriber see no forged value
    with RawClient(b.port) as s:
        s.connect("check")
        s.subscribe([("a/#", 0), ("l/#", 0)])
        assert s.no_publish(0.5)
    assert b.alive()


def test_huge_user_property_count_refused_and_others_unharmed(broker_factory, interp):
    """Defect 6: a packet with a huge number of User Properties is refused
    (a CONNECT over the pre-CONNECT size bound with 0x95, a PUBLISH over
    max_user_properties with 0x83) without stalling other clients; 64
    properties are still fine."""
    b = broker_factory(max_packet_size=2 * 1024 * 1024, max_user_properties=64)
    requires_edgebroker(b)
    # 200,000 empty User Properties in a CONNECT (about 1 MB)
    many = prop_pair(0x26, "", "") * 200000
    with RawClient(b.port) as c:
        t0 = time.monotonic()
        c.send_nowait(connect_packet("props", props=many))
        # CONNACK 0x95 as soon as the fixed header says the size; a client
        # still writing may see the close as a reset (graceful close, which
        # drains first, is the no-loss issue's)
        try:
            ack = c.expect_connack(5)
            assert ack.reason == 0x95
        except (AssertionError, OSError) as e:
            assert "CONNACK" in str(e) or isinstance(e, OSError), e
        assert c.closed(5)
        assert time.monotonic() - t0 < 10
    with RawClient(b.port) as ok, RawClient(b.port) as sub:
        assert sub.connect("sub").reason == 0
        sub.subscribe([("p/#", 0)])
        assert ok.connect("pub").reason == 0
        assert ok.publish("p/ok", b"64 props", qos=1, props=prop_pair(0x26, "k", "v") * 64) == 0
        assert sub.expect_publish(5).payload == b"64 props"
        ok.send(publish_packet("p/bad", b"x", qos=1, pid=2, props=prop_pair(0x26, "", "") * 5000))
        assert ok.expect_disconnect(5)[0] == 0x83
        assert sub.no_publish(0.3)
        sub.send(b"\xc0\x00")  # PINGREQ: still answered
        assert sub.expect(13, 3)


def test_large_packet_in_small_pieces_is_assembled(broker_factory, interp):
    """Defect 6: a 192 KB PUBLISH sent in 1,000 pieces is assembled without
    re-copying what came before (linear), delivered whole."""
    b = broker_factory(max_packet_size=1024 * 1024)
    requires_edgebroker(b)
    payload = bytes(range(256)) * 768
    with RawClient(b.port) as sub, RawClient(b.port) as pub:
        sub.connect("big-sub")
        sub.subscribe([("big/#", 0)])
        pub.connect("big-pub")
        pkt = publish_packet("big/1", payload, qos=1, pid=7)
        step = len(pkt) // 1000 + 1
        for k in range(0, len(pkt), step):
            pub.send(pkt[k:k + step])
        assert pub.expect_ack(PUBACK, 10)[0] == 7
        assert sub.expect_publish(10).payload == payload


def test_expired_inflight_released_on_resume_receive_maximum_1(broker_factory, interp):
    """Defect 8: a QoS 1 message in flight when the client dropped, which
    expires before the client resumes, is not resent (MQTT-3.3.2-5) and no
    longer holds the Receive Maximum 1 window: later messages arrive."""
    b = broker_factory(max_session_expiry=3600)
    requires_edgebroker(b)
    props = prop_u32(0x11, 600) + bytes((0x21, 0, 1))  # Session Expiry, Receive Maximum 1
    s = RawClient(b.port)
    assert s.connect("stuck", clean=True, props=props).reason == 0
    s.subscribe([("x/#", 1)])
    with RawClient(b.port) as pub:
        pub.connect("stuck-pub")
        pub.publish("x/short", b"short-lived", qos=1, pid=1, props=prop_u32(0x02, 1))
        m = s.expect_publish(5)
        assert m.payload == b"short-lived"
        s.close()  # never acknowledged
        time.sleep(2.2)
        for k in range(5):
            pub.publish("x/later", b"later-%d" % k, qos=1, pid=10 + k)
    with RawClient(b.port) as s2:
        ack = s2.connect("stuck", clean=False, props=props)
        assert ack.session_present
        got = []
        for _ in range(5):
            m = s2.expect_publish(5)
            got.append(m.payload)
            s2.send(puback(m.pid))
        assert got == [b"later-%d" % k for k in range(5)]


def test_inflight_too_large_for_new_maximum_packet_size_released(broker_factory, interp):
    """Defect 8: an in-flight message larger than the Maximum Packet Size
    the client reconnects with is released (MQTT-3.1.2-25), not kept
    holding the window."""
    b = broker_factory(max_session_expiry=3600)
    requires_edgebroker(b)
    props = prop_u32(0x11, 600) + bytes((0x21, 0, 1))
    s = RawClient(b.port)
    assert s.connect("big-stuck", props=props).reason == 0
    s.subscribe([("y/#", 1)])
    with RawClient(b.port) as pub:
        pub.connect("big-pub2")
        pub.publish("y/big", b"B" * 2000, qos=1, pid=1)
        assert s.expect_publish(5).payload == b"B" * 2000
        s.close()
        pub.publish("y/small", b"small", qos=1, pid=2)
    with RawClient(b.port) as s2:
        ack = s2.connect("big-stuck", clean=False, props=props + prop_u32(0x27, 512))
        assert ack.session_present
        m = s2.expect_publish(5)
        assert m.payload == b"small"
        s2.send(puback(m.pid))


def test_offline_queue_bounded_in_bytes(broker_factory, interp):
    """Defect 10: one non-reading persistent session holds at most
    max_queued_bytes of queued messages (oldest dropped, counted), not
    max_queued x the largest message."""
    b = broker_factory(max_queued=1000, max_queued_bytes=20000, max_session_expiry=3600)
    requires_edgebroker(b)
    props = prop_u32(0x11, 600)
    s = RawClient(b.port)
    assert s.connect("hoarder", props=props).reason == 0
    s.subscribe([("h/#", 1)])
    s.disconnect()
    with RawClient(b.port) as pub:
        pub.connect("h-pub")
        for k in range(20):
            pub.publish("h/%d" % k, bytes([k]) * 4000, qos=1, pid=k + 1)
    with RawClient(b.port) as s2:
        ack = s2.connect("hoarder", clean=False, props=props)
        assert ack.session_present
        got = []
        while True:
            try:
                m = s2.expect_publish(1.0)
            except (TimeoutError, AssertionError):
                break
            got.append(m.payload[0])
            s2.send(puback(m.pid))
        # 4,000-byte payloads in 20,000 bytes: the newest four, in order
        assert 3 <= len(got) <= 4, got
        assert got == list(range(20 - len(got), 20))
    assert "refused (queue_full)" in b.log_text()


def test_sys_subscribe_storm_does_not_collect_each_time(broker_factory, interp):
    """Defect 10: every $SYS SUBSCRIBE used to trigger a full garbage
    collection; now the heap figures are refreshed at most every
    max(5 s, sys_interval): 200 SUBSCRIBEs in a row all get the same
    heap/free value (MicroPython; CPython has no heap figures)."""
    b = broker_factory(sys_interval=30)
    requires_edgebroker(b)
    values = set()
    with RawClient(b.port) as c:
        c.connect("sys-storm")
        for k in range(200):
            c.subscribe([("$SYS/broker/heap/free", 0)], pid=k + 1)
            if interp == "micropython":
                values.add(c.expect_publish(5).payload)
        c.send(b"\xc0\x00")
        assert c.expect(13, 5)
    if interp == "micropython":
        assert len(values) == 1, values
    assert b.alive()


def test_will_user_properties_bounded(broker_factory, interp):
    """The will's own User Properties are bounded by max_user_properties
    too (5.0 CONNACK 0x83)."""
    b = broker_factory(max_user_properties=4)
    requires_edgebroker(b)
    with RawClient(b.port) as c:
        will = {"topic": "w/ok", "payload": b"bye", "props": prop_pair(0x26, "k", "v") * 5}
        c.send(connect_packet("wp", will=will))
        assert c.expect_connack(3).reason == 0x83
        assert c.closed(3)


def test_client_that_never_reads_is_closed_at_its_buffer_bound(broker_factory, interp):
    """Defect 10: a client that keeps sending PINGREQs and never reads kept
    every PINGRESP in the broker's send buffer: the bound was checked only
    when the socket took bytes, which for such a client it never does (the
    CPython broker grew by 76 MB in 20 s). Now the buffer is bounded at
    max(max_outbuf, max_packet_size) + max_outbuf (what `config check` counts) and the
    client is closed, counted under refusals slow_reader; others are served."""
    b = broker_factory(max_outbuf=256, max_packet_size=1024)
    requires_edgebroker(b)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(5)
    s.connect(("127.0.0.1", b.port))
    try:
        s.sendall(connect_packet("never-reads", version=4))
        pings = b"\xc0\x00" * 8192
        refusal = "refused (slow_reader) client never-reads not reading, closed"
        sent = 0
        t0 = time.monotonic()
        # loopback buffers take a few MB of PINGRESP before the broker's own
        # buffer fills; bounded in bytes and time
        while sent < 256 * 1024 * 1024 and time.monotonic() - t0 < 60:
            try:
                s.sendall(pings)
            except OSError:  # reset: closed already
                break
            sent += len(pings)
            if sent % (64 * len(pings)) == 0 and refusal in b.log_text():
                break
        assert refusal in b.log_text(), "not closed after %d bytes of PINGREQ" % sent
        # a closed connection is drained for at most 2 s (graceful close),
        # then it is gone: a send fails
        closed = False
        t1 = time.monotonic()
        while not closed and time.monotonic() - t1 < 10:
            try:
                s.sendall(pings)
                time.sleep(0.05)
            except OSError:
                closed = True
        assert closed
        assert b.alive()
    finally:
        s.close()
    with RawClient(b.port) as c:
        assert c.connect("after").reason == 0
        c.send(b"\xc0\x00")
        assert c.expect(13, 5)


LINGER_SCRIPT = r"""
import sys, time, socket, gc, micropython
sys.path.insert(0, LIB)
import edgebroker as eb

addr = socket.getaddrinfo("127.0.0.1", PORT)[0][-1]
lst = socket.socket()
lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
lst.bind(addr)
lst.listen(1)
c = socket.socket()
c.connect(addr)
s = lst.accept()[0]
s.setblocking(False)
c.send(b"still writing")  # unread bytes: the close would linger
time.sleep(0.2)
b = eb.start({"max_clients": 2}, "127.0.0.1", PORT2, None)
b._async = True  # the board's server
gc.collect()
micropython.heap_lock()
try:
    r = b._linger(s, True, False)
finally:
    micropython.heap_unlock()
print("LINGER", r, len(b.draining))
s.close()
c.close()
lst.close()
b._async = False  # never served: nothing of asyncio to release
b.shutdown()
"""


def test_a_close_without_heap_for_its_linger_closes_at_once_micropython():
    """Seen on the ESP32 port (MicroPython 1.16, emulated): a connection
    closed because the heap ran out went on to its graceful close, whose
    entry and drain task need heap too; the MemoryError escaped the
    connection's reader task and its socket was never closed (a board has
    ten). With the heap locked (micropython.heap_lock(): every allocation
    fails, a real MemoryError) the graceful close now gives up: the caller
    closes the socket at once, and nothing is left in the drain list.
    MicroPython only: CPython has no way to make a small allocation fail."""
    mp = Path(sys.executable).parent / "micropython"
    code = (LINGER_SCRIPT.replace("LIB", repr(str(REPO / "lib")))
            .replace("PORT2", str(free_port())).replace("PORT", str(free_port())))
    r = subprocess.run([str(mp), "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "LINGER False 0" in r.stdout, r.stdout + r.stderr


def test_a_client_that_floods_after_its_protocol_error_does_not_hold_the_broker(
        broker_factory):
    """A client closed for a protocol error is drained for up to 2 s (the
    graceful close, so that it reads the reason code rather than a reset).
    One that keeps sending all that time must not keep the broker from
    serving the others: another client's PINGREQs are answered meanwhile,
    each well within a second (the drain yields after every read)."""
    b = broker_factory()
    requires_edgebroker(b)
    s = socket.create_connection(("127.0.0.1", b.port), timeout=5)
    s.sendall(connect_packet("flooder", version=5))
    assert s.recv(64)[:1] == b"\x20"  # CONNACK
    s.sendall(b"\x30\x03\x00\x09a")  # its topic runs past the packet: malformed
    stop = time.monotonic() + 2.5

    def flood():
        chunk = b"\xc0\x00" * 2048
        while time.monotonic() < stop:
            try:
                s.sendall(chunk)
            except OSError:
                return

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    try:
        with RawClient(b.port) as c:
            c.send(connect_packet("pinger", version=5))
            assert c.read_packet().ptype == 2
            worst = 0.0
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                t0 = time.monotonic()
                c.send(b"\xc0\x00")
                p = c.read_packet(timeout=5)
                assert p is not None and p.ptype == 13, p
                worst = max(worst, time.monotonic() - t0)
                time.sleep(0.05)
    finally:
        t.join(5)
        s.close()
    assert worst < 1.0, "a PINGREQ waited %.2f s behind the drain" % worst
    assert b.alive()

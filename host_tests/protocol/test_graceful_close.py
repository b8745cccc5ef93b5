"""Graceful close (issue 11, item 4): after a protocol error the broker
sends DISCONNECT with the reason code, then reads and drops what the client
still sends, for a bounded time, before it closes. A client that keeps
writing after its malformed packet reads the reason instead of a reset.
Real sockets, both interpreters, both servers."""

import socket
import time

from mqtt_helpers import connect_packet, requires_edgebroker


def _connected(port, cid):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(connect_packet(cid, version=5))
    data = s.recv(64)
    assert data[:1] == b"\x20" and data[3] == 0, data  # CONNACK, success
    return s


def test_client_still_writing_after_a_protocol_error_reads_the_reason_code(broker_factory):
    """A PUBLISH with QoS 3 is malformed (0x81, MQTT-3.3.1-4); the client
    then writes 64 KB more in small pieces, as a client that has not noticed
    yet would. Every write succeeds (no EPIPE/ECONNRESET: the broker is
    still reading), and the client reads DISCONNECT 0x81."""
    b = broker_factory()
    requires_edgebroker(b)
    s = _connected(b.port, "gc-writer")
    s.sendall(b"\x36\x05\x00\x01tab")  # PUBLISH, QoS bits 11: malformed
    junk = b"\x30\x0e\x00\x04junkpayload!!!" * 32  # well-formed QoS 0 PUBLISHes
    sent = 0
    deadline = time.monotonic() + 1.0
    while sent < 65536 and time.monotonic() < deadline:
        s.sendall(junk)  # raises on a reset
        sent += len(junk)
        time.sleep(0.002)
    data = b""
    s.settimeout(5)
    while True:
        try:
            chunk = s.recv(4096)
        except ConnectionResetError:
            raise AssertionError("reset before the DISCONNECT was read (got %r)" % data)
        if not chunk:
            break
        data += chunk
    s.close()
    assert data[:1] == b"\xe0", data
    assert data[2] == 0x81, data


def test_closing_sockets_are_bounded_and_the_broker_serves_on(broker_factory):
    """Many clients hit a protocol error at once and go silent without
    closing: the broker keeps at most max(2, max_clients/2) of them draining,
    closes each within 2 s, and serves a new client meanwhile."""
    b = broker_factory(max_clients=8)
    requires_edgebroker(b)
    socks = []
    for i in range(8):
        s = _connected(b.port, "gc-%d" % i)
        s.sendall(b"\x36\x05\x00\x01tab")
        socks.append(s)
    ok = _connected(b.port, "gc-fine")
    ok.close()
    t0 = time.monotonic()
    for s in socks:
        s.settimeout(5)
        data = b""
        while True:
            try:
                chunk = s.recv(4096)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
        assert data[:1] == b"\xe0" and data[2] == 0x81, data
        s.close()
    assert time.monotonic() - t0 < 4.5, "draining sockets were not closed in time"

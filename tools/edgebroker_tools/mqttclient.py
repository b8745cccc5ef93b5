"""A small blocking MQTT 3.1.1 client for the host tools (measure, emulate, bench, fleet).

Only what the tools need: CONNECT (clean or persistent session), SUBSCRIBE,
PUBLISH at QoS 0/1 (pipelined: send many, then collect the PUBACKs), reading
PUBLISHes with or without acknowledging them, DISCONNECT. MQTT 3.1.1 is
enough here: a persistent session is CleanSession=0 (the broker clamps its
lifetime to max_session_expiry), and no tool needs 5.0 properties.

The benchmark's load generator drives its hot loops on the raw sockets with
packets pre-encoded here; for that there are also a stream splitter
(split_packets, publish_fields), a CONNECT with a given packet
(Client.connect_with: MQTT 5.0 with connect_v5_packet) and the 5.0
SUBSCRIBE it needs.

Errors are MqttError (a timeout, a closed connection, a refusal).
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

HOST: Final = "127.0.0.1"

CONNACK: Final = 2
PUBLISH: Final = 3
PUBACK: Final = 4
SUBACK: Final = 9
PINGRESP: Final = 13


class MqttError(Exception):
    """The broker refused, closed the connection, or did not answer in time."""


@dataclass(frozen=True)
class Message:
    """One PUBLISH received from the broker."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    pid: int


def varint(n: int) -> bytes:
    """MQTT Variable Byte Integer (1.5.5)."""
    if not 0 <= n < 268_435_456:
        raise ValueError(f"remaining length out of range: {n}")
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def mqtt_str(text: str | bytes) -> bytes:
    """UTF-8 string (or binary data) with its 2-byte length prefix."""
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("!H", len(raw)) + raw


def connect_packet(client_id: str, clean: bool = True, keepalive: int = 0) -> bytes:
    """CONNECT, protocol level 4 (3.1.1), no will, no credentials."""
    body = mqtt_str("MQTT") + bytes((4, 0x02 if clean else 0x00))
    body += struct.pack("!H", keepalive) + mqtt_str(client_id)
    return b"\x10" + varint(len(body)) + body


def subscribe_packet(pid: int, filters: Sequence[tuple[str, int]]) -> bytes:
    """SUBSCRIBE with one (filter, requested QoS) per entry."""
    body = struct.pack("!H", pid)
    for topic, qos in filters:
        body += mqtt_str(topic) + bytes((qos,))
    return b"\x82" + varint(len(body)) + body


def publish_packet(
    topic: str, payload: bytes, qos: int = 0, retain: bool = False, pid: int = 0
) -> bytes:
    """PUBLISH (3.1.1: no properties)."""
    body = mqtt_str(topic)
    if qos:
        body += struct.pack("!H", pid)
    body += payload
    return bytes((0x30 | qos << 1 | (1 if retain else 0),)) + varint(len(body)) + body


def puback_packet(pid: int) -> bytes:
    return struct.pack("!BBH", 0x40, 2, pid)


def connect_v5_packet(
    client_id: str, clean: bool = True, keepalive: int = 0, receive_maximum: int | None = None
) -> bytes:
    """CONNECT, protocol level 5, no will, no credentials; a Receive Maximum
    property (3.1.2.11.3) if given."""
    props = b"" if receive_maximum is None else b"\x21" + struct.pack("!H", receive_maximum)
    body = mqtt_str("MQTT") + bytes((5, 0x02 if clean else 0x00)) + struct.pack("!H", keepalive)
    body += varint(len(props)) + props + mqtt_str(client_id)
    return b"\x10" + varint(len(body)) + body


def subscribe_v5_packet(pid: int, filters: Sequence[tuple[str, int]]) -> bytes:
    """5.0 SUBSCRIBE (no properties) with one (filter, options byte) per entry."""
    body = struct.pack("!H", pid) + b"\x00"
    for topic, options in filters:
        body += mqtt_str(topic) + bytes((options,))
    return b"\x82" + varint(len(body)) + body


def split_packets(
    buf: bytes | bytearray, limit: int = 1 << 30
) -> tuple[list[tuple[int, int, int]], int]:
    """The complete packets at the front of buf, at most `limit`:
    ([(first byte, body start, body end)], bytes used). MqttError on a
    malformed Remaining Length."""
    out: list[tuple[int, int, int]] = []
    pos = 0
    end = len(buf)
    while end - pos >= 2 and len(out) < limit:
        length = 0
        shift = 0
        i = pos + 1
        complete = False
        for _ in range(4):
            if i >= end:
                break
            byte = buf[i]
            i += 1
            length |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                complete = True
                break
        else:
            raise MqttError("malformed remaining length from the broker")
        if not complete or i + length > end:
            break
        out.append((buf[pos], i, i + length))
        pos = i + length
    return out, pos


def publish_fields(
    buf: bytes | bytearray, first: int, start: int, end: int
) -> tuple[bytes, int, int]:
    """(topic, packet id or 0, payload start) of the 3.1.1 PUBLISH body at buf[start:end]."""
    if end - start < 2:
        raise MqttError("malformed PUBLISH from the broker")
    tlen = buf[start] << 8 | buf[start + 1]
    topic = bytes(buf[start + 2 : start + 2 + tlen])
    pos = start + 2 + tlen
    pid = 0
    if first & 0x06:
        if pos + 2 > end:
            raise MqttError("malformed PUBLISH from the broker")
        pid = buf[pos] << 8 | buf[pos + 1]
        pos += 2
    if pos > end:
        raise MqttError("malformed PUBLISH from the broker")
    return topic, pid, pos


class Client:
    """One MQTT 3.1.1 connection over a blocking socket with timeouts."""

    def __init__(self, port: int, client_id: str, host: str = HOST) -> None:
        self.port = port
        self.host = host
        self.client_id = client_id
        self.sock: socket.socket | None = None
        self.buf = bytearray()
        self.session_present = False
        self._pid = 0

    # -- connection
    def connect(self, clean: bool = True, keepalive: int = 0, timeout: float = 10.0) -> int:
        """TCP connect + CONNECT; returns the CONNACK return code (0 = accepted).

        A refused connection is closed by the broker; the socket is closed here too.
        """
        return self.connect_with(connect_packet(self.client_id, clean, keepalive), timeout)

    def connect_with(self, packet: bytes, timeout: float = 10.0) -> int:
        """TCP connect + the CONNECT packet given (3.1.1 or 5.0); returns the
        CONNACK return / reason code (0 = accepted; the socket is closed otherwise)."""
        try:
            sock = socket.create_connection((self.host, self.port), timeout=timeout)
        except OSError as exc:
            raise MqttError(f"{self.client_id}: TCP connect to port {self.port}: {exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.send(packet)
        first, body = self.read_packet(timeout)
        if first >> 4 != CONNACK or len(body) < 2:
            self.close()
            raise MqttError(f"{self.client_id}: expected CONNACK, got packet type {first >> 4}")
        self.session_present = bool(body[0] & 1)
        if body[1] != 0:
            self.close()
        return body[1]

    def send(self, data: bytes) -> None:
        if self.sock is None:
            raise MqttError(f"{self.client_id}: not connected")
        try:
            self.sock.sendall(data)
        except OSError as exc:
            raise MqttError(f"{self.client_id}: send failed: {exc}") from None

    def disconnect(self) -> None:
        """DISCONNECT (the session stays if it was persistent), then close."""
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.sendall(b"\xe0\x00")
        self.close()

    def close(self) -> None:
        """Close the socket without DISCONNECT (the broker publishes a will)."""
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
            self.sock = None

    # -- reading
    def _fill(self, timeout: float) -> bool:
        sock = self.sock
        if sock is None:
            raise MqttError(f"{self.client_id}: not connected")
        readable, _, _ = select.select([sock], [], [], max(timeout, 0.0))
        if not readable:
            return False
        try:
            data = sock.recv(65536)
        except OSError as exc:
            raise MqttError(f"{self.client_id}: connection error: {exc}") from None
        if not data:
            raise MqttError(f"{self.client_id}: connection closed by the broker")
        self.buf += data
        return True

    def _take(self) -> tuple[int, bytes] | None:
        buf = self.buf
        if len(buf) < 2:
            return None
        length = 0
        shift = 0
        i = 1
        while True:
            if i >= len(buf):
                return None
            byte = buf[i]
            i += 1
            length |= (byte & 0x7F) << shift
            if byte < 0x80:
                break
            shift += 7
            if shift > 21:
                raise MqttError(f"{self.client_id}: malformed remaining length from the broker")
        if i + length > len(buf):
            return None
        first = buf[0]
        body = bytes(buf[i : i + length])
        del buf[: i + length]
        return first, body

    def read_packet(self, timeout: float = 10.0) -> tuple[int, bytes]:
        """The next packet (first byte, body); MqttError on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            packet = self._take()
            if packet is not None:
                return packet
            left = deadline - time.monotonic()
            if left <= 0:
                raise MqttError(f"{self.client_id}: no packet within {timeout:.1f} s")
            self._fill(left)

    def poll_packet(self, timeout: float) -> tuple[int, bytes] | None:
        """The next packet if one arrives within timeout, else None."""
        packet = self._take()
        if packet is not None:
            return packet
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._fill(left):
                return self._take()
            packet = self._take()
            if packet is not None:
                return packet

    # -- operations
    def next_pid(self) -> int:
        self._pid = self._pid + 1 if self._pid < 65535 else 1
        return self._pid

    def subscribe(self, filters: Sequence[tuple[str, int]], timeout: float = 10.0) -> list[int]:
        """SUBSCRIBE and wait for its SUBACK; PUBLISHes before it are acknowledged
        (QoS 1) and dropped. Returns the granted QoS / failure codes."""
        pid = self.next_pid()
        self.send(subscribe_packet(pid, filters))
        deadline = time.monotonic() + timeout
        while True:
            first, body = self.read_packet(max(deadline - time.monotonic(), 0.0))
            kind = first >> 4
            if kind == SUBACK and body[:2] == struct.pack("!H", pid):
                return list(body[2:])
            if kind == PUBLISH:
                self.ack(parse_publish(first, body))

    def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> int:
        """Send one PUBLISH (no wait); returns its packet id (0 for QoS 0)."""
        pid = self.next_pid() if qos else 0
        self.send(publish_packet(topic, payload, qos, retain, pid))
        return pid

    def publish_many(
        self,
        items: Iterable[tuple[str, bytes]],
        qos: int = 1,
        retain: bool = False,
        window: int = 32,
        timeout: float = 30.0,
    ) -> int:
        """QoS 1 PUBLISHes, at most `window` unacknowledged; waits for every PUBACK.

        Returns the number sent. Other packets that arrive meanwhile are dropped.
        """
        if qos != 1:
            n = 0
            for topic, payload in items:
                self.publish(topic, payload, qos, retain)
                n += 1
            return n
        deadline = time.monotonic() + timeout
        waiting: set[int] = set()
        n = 0
        for topic, payload in items:
            while len(waiting) >= window:
                self._collect_acks(waiting, deadline)
            waiting.add(self.publish(topic, payload, 1, retain))
            n += 1
        while waiting:
            self._collect_acks(waiting, deadline)
        return n

    def _collect_acks(self, waiting: set[int], deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise MqttError(f"{self.client_id}: {len(waiting)} PUBACKs missing")
        first, body = self.read_packet(left)
        if first >> 4 == PUBACK and len(body) >= 2:
            waiting.discard(body[0] << 8 | body[1])

    def ack(self, msg: Message) -> None:
        if msg.qos == 1:
            self.send(puback_packet(msg.pid))

    def receive(self, timeout: float = 10.0, ack: bool = True) -> Message:
        """The next PUBLISH (other packets are skipped); acknowledged unless ack=False."""
        deadline = time.monotonic() + timeout
        while True:
            first, body = self.read_packet(max(deadline - time.monotonic(), 0.0))
            if first >> 4 == PUBLISH:
                msg = parse_publish(first, body)
                if ack:
                    self.ack(msg)
                return msg

    def ping(self, timeout: float = 10.0) -> None:
        """PINGREQ and wait for PINGRESP: everything sent before it was handled.

        PUBLISHes that arrive meanwhile are acknowledged and dropped."""
        self.send(b"\xc0\x00")
        deadline = time.monotonic() + timeout
        while True:
            first, body = self.read_packet(max(deadline - time.monotonic(), 0.0))
            if first >> 4 == PINGRESP:
                return
            if first >> 4 == PUBLISH:
                self.ack(parse_publish(first, body))


def parse_publish(first: int, body: bytes) -> Message:
    """A 3.1.1 PUBLISH body (no properties)."""
    if len(body) < 2:
        raise MqttError("malformed PUBLISH from the broker")
    tlen = body[0] << 8 | body[1]
    pos = 2 + tlen
    qos = first >> 1 & 3
    pid = 0
    if qos:
        if len(body) < pos + 2:
            raise MqttError("malformed PUBLISH from the broker")
        pid = body[pos] << 8 | body[pos + 1]
        pos += 2
    topic = body[2 : 2 + tlen].decode("utf-8", "replace")
    return Message(topic, body[pos:], qos, bool(first & 1), pid)

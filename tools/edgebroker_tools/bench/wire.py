"""The generator's connections: set up with the shared host client
(edgebroker_tools.mqttclient), then driven on their raw non-blocking sockets.

mqttclient does the CONNECT / CONNACK handshake and encodes every packet; the
timed loops (loadgen) send pre-built batches of them and parse what comes
back in bulk, so the generator is not what is measured.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Sequence
from typing import Final

from edgebroker_tools import mqttclient
from edgebroker_tools.bench.common import HOST, BenchError
from edgebroker_tools.mqttclient import MqttError, split_packets, subscribe_packet

PINGREQ: Final = b"\xc0\x00"
DISCONNECT: Final = b"\xe0\x00"
T_CONNACK: Final = mqttclient.CONNACK
T_PUBLISH: Final = mqttclient.PUBLISH
T_PUBACK: Final = mqttclient.PUBACK
T_SUBACK: Final = mqttclient.SUBACK
T_PINGRESP: Final = mqttclient.PINGRESP


class Conn:
    """One MQTT connection over a non-blocking socket (setup and control traffic)."""

    def __init__(self, sock: socket.socket, name: str, buf: bytearray | None = None) -> None:
        self.sock = sock
        self.name = name
        self.buf = buf if buf is not None else bytearray()

    @classmethod
    def connect(
        cls,
        port: int,
        client_id: str,
        timeout: float = 5.0,
        keepalive: int = 0,
        connect: bytes | None = None,
    ) -> Conn:
        """TCP connect, CONNECT (3.1.1, or the `connect` packet given), CONNACK 0
        (mqttclient.Client); BenchError otherwise. Returns it non-blocking."""
        client = mqttclient.Client(port, client_id, HOST)
        packet = (
            connect
            if connect is not None
            else mqttclient.connect_packet(client_id, True, keepalive)
        )
        try:
            code = client.connect_with(packet, timeout)
        except MqttError as exc:
            client.close()
            raise BenchError(str(exc)) from None
        if code != 0 or client.sock is None:
            client.close()
            raise BenchError(f"{client_id}: CONNACK return code {code}")
        sock = client.sock
        sock.setblocking(False)
        return cls(sock, client_id, client.buf)

    def send_all(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        for _ in range(1_000_000):
            if not view:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BenchError(f"{self.name}: send timed out")
            try:
                sent = self.sock.send(view)
            except BlockingIOError:
                select.select([], [self.sock], [], min(remaining, 0.5))
                continue
            except OSError as exc:
                raise BenchError(f"{self.name}: send failed: {exc}") from None
            view = view[sent:]
        raise BenchError(f"{self.name}: send did not complete")

    def fill(self, timeout: float) -> int:
        """Receive what is there (waiting up to timeout); 0 if nothing came."""
        readable, _, _ = select.select([self.sock], [], [], max(timeout, 0.0))
        if not readable:
            return 0
        try:
            data = self.sock.recv(262_144)
        except BlockingIOError:
            return 0
        except OSError as exc:
            raise BenchError(f"{self.name}: connection error: {exc}") from None
        if not data:
            raise BenchError(f"{self.name}: connection closed by the broker")
        self.buf += data
        return len(data)

    def take_packet(self) -> tuple[int, bytes] | None:
        try:
            packets, _used = split_packets(self.buf, limit=1)
        except MqttError as exc:
            raise BenchError(f"{self.name}: {exc}") from None
        if not packets:
            return None
        b0, start, end = packets[0]
        body = bytes(self.buf[start:end])
        del self.buf[:end]
        return b0, body

    def read_packet(self, deadline: float) -> tuple[int, bytes]:
        for _ in range(1_000_000):
            packet = self.take_packet()
            if packet is not None:
                return packet
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BenchError(f"{self.name}: timed out waiting for a packet")
            self.fill(min(remaining, 0.5))
        raise BenchError(f"{self.name}: no complete packet")

    def subscribe(self, filters: Sequence[tuple[str, int]], timeout: float = 5.0) -> list[int]:
        """SUBSCRIBE and wait for the SUBACK (other packets before it are dropped)."""
        deadline = time.monotonic() + timeout
        self.send_all(subscribe_packet(1, filters), deadline)
        for _ in range(100_000):
            b0, body = self.read_packet(deadline)
            if b0 >> 4 == T_SUBACK:
                granted = list(body[2:])
                bad = [g for g in granted if g >= 0x80]
                if bad:
                    raise BenchError(f"{self.name}: SUBSCRIBE refused: {granted}")
                return granted
        raise BenchError(f"{self.name}: no SUBACK")

    def close(self, graceful: bool = True) -> None:
        if graceful:
            with contextlib.suppress(OSError):
                self.sock.send(DISCONNECT)
        with contextlib.suppress(OSError):
            self.sock.close()


def close_all(conns: Sequence[Conn]) -> None:
    for conn in conns:
        conn.close()

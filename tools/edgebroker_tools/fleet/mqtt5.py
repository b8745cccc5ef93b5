"""A small asyncio MQTT 5.0 client that gathers a broker's retained messages.

    result = await gather_retained("10.0.0.5", 1883, username=..., password=...,
                                   quiet=1.0, timeout=30.0)

CONNECT (clean start, Receive Maximum 65535), SUBSCRIBE to `#` and `$SYS/#`
at QoS 2 with Retain Handling 0 (send the retained messages now), then read
PUBLISH packets, acknowledging QoS 1 (PUBACK) and QoS 2 (PUBREC, PUBCOMP on
PUBREL), keeping those with RETAIN=1 (MQTT-3.3.1-8: only the retained
messages sent because of the new subscription carry it), until no retained
message has come for `quiet` seconds. Live traffic (RETAIN=0) is
acknowledged and ignored. The whole exchange must finish within `timeout`,
else CollectError: a partial snapshot is never returned (the build would
read the missing topics as deleted).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import time
from dataclasses import dataclass, field
from typing import Final

from edgebroker_tools.fleet import props
from edgebroker_tools.mqttclient import mqtt_str, varint

CONNACK: Final = 2
PUBLISH: Final = 3
PUBREL: Final = 6
SUBACK: Final = 9
DISCONNECT: Final = 14

#: SUBSCRIBE options byte: maximum QoS 2, No Local 0, Retain As Published 0,
#: Retain Handling 0 (send retained messages at subscribe time).
SUB_OPTIONS: Final = 0x02
FILTERS: Final = ("#", "$SYS/#")
MAX_PACKET: Final = 16 * 1024 * 1024


class CollectError(Exception):
    """The gateway could not be read: refused, closed, timed out, misbehaved."""


@dataclass(frozen=True)
class Retained:
    """One retained message as received."""

    topic: str
    payload: bytes
    qos: int
    properties: props.Properties


@dataclass
class Gathered:
    """What one gateway returned."""

    collected_at: float  # Unix time the subscription was acknowledged
    messages: dict[str, Retained] = field(default_factory=dict)
    sys_granted: bool = True  # False: the broker refused `$SYS/#`
    live_ignored: int = 0  # non-retained PUBLISHes acknowledged and dropped


def _packet(first: int, body: bytes) -> bytes:
    return bytes((first,)) + varint(len(body)) + body


def connect_packet(
    client_id: str, username: str | None, password: str | None, keepalive: int
) -> bytes:
    """CONNECT, protocol level 5, clean start, Receive Maximum 65535."""
    flags = 0x02
    if username is not None:
        flags |= 0x80
    if password is not None:
        flags |= 0x40
    properties = props.encode(receive_maximum=65535)
    body = mqtt_str("MQTT") + bytes((5, flags)) + struct.pack(">H", keepalive)
    body += varint(len(properties)) + properties + mqtt_str(client_id)
    if username is not None:
        body += mqtt_str(username)
    if password is not None:
        body += mqtt_str(password)
    return _packet(0x10, body)


def subscribe_packet(pid: int, filters: tuple[str, ...]) -> bytes:
    body = struct.pack(">H", pid) + b"\x00"
    for topic in filters:
        body += mqtt_str(topic) + bytes((SUB_OPTIONS,))
    return _packet(0x82, body)


class Connection:
    """One MQTT 5 connection over asyncio streams."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def read_packet(self) -> tuple[int, bytes]:
        """(first byte, body) of the next packet; CollectError on a closed connection."""
        try:
            head = await self.reader.readexactly(1)
            length = 0
            for shift in (0, 7, 14, 21):
                byte = (await self.reader.readexactly(1))[0]
                length |= (byte & 0x7F) << shift
                if not byte & 0x80:
                    break
            else:
                raise CollectError("malformed remaining length from the gateway")
            if length > MAX_PACKET:
                raise CollectError(f"packet of {length} bytes from the gateway")
            body = await self.reader.readexactly(length)
        except asyncio.IncompleteReadError:
            raise CollectError("the gateway closed the connection") from None
        except ConnectionError as exc:
            raise CollectError(f"connection lost: {exc}") from None
        return head[0], body

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()
            await asyncio.wait_for(self.writer.wait_closed(), 1.0)


def parse_publish(first: int, body: bytes) -> tuple[Retained, int, bool]:
    """(message, packet id or 0, retain flag) of a PUBLISH body."""
    qos = first >> 1 & 3
    retain = bool(first & 1)
    if qos == 3:
        raise CollectError("PUBLISH with QoS 3 from the gateway")
    if len(body) < 2:
        raise CollectError("PUBLISH cut short")
    (tlen,) = struct.unpack_from(">H", body, 0)
    pos = 2 + tlen
    try:
        topic = body[2:pos].decode("utf-8")
    except UnicodeDecodeError:
        raise CollectError("PUBLISH topic is not UTF-8") from None
    pid = 0
    if qos:
        if pos + 2 > len(body):
            raise CollectError("PUBLISH cut short")
        (pid,) = struct.unpack_from(">H", body, pos)
        pos += 2
    try:
        plen, pos = props.read_varint(body, pos)
        if pos + plen > len(body):
            raise props.PropertyError("properties cut short")
        decoded = props.decode(memoryview(body)[pos : pos + plen])
    except props.PropertyError as exc:
        raise CollectError(f"PUBLISH on {topic!r}: {exc}") from None
    pos += plen
    return Retained(topic, body[pos:], qos, decoded), pid, retain


async def gather_retained(
    host: str,
    port: int,
    *,
    username: str | None = None,
    password: str | None = None,
    quiet: float = 1.0,
    timeout: float = 30.0,
    connect_timeout: float = 5.0,
    client_id: str | None = None,
) -> Gathered:
    """Every retained message of the broker at host:port (see the module docstring)."""
    deadline = time.monotonic() + timeout
    cid = client_id or "edgebroker-fleet-" + os.urandom(4).hex()
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port), min(connect_timeout, timeout)
        )
    except TimeoutError:
        raise CollectError(f"connect to {host}:{port} timed out") from None
    except OSError as exc:
        raise CollectError(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None
    conn = Connection(reader, writer)
    try:
        return await asyncio.wait_for(
            _session(conn, cid, username, password, quiet, deadline),
            max(0.0, deadline - time.monotonic()),
        )
    except TimeoutError:
        raise CollectError(f"no quiet period within {timeout:g} s") from None
    finally:
        await conn.close()


async def _session(
    conn: Connection,
    cid: str,
    username: str | None,
    password: str | None,
    quiet: float,
    deadline: float,
) -> Gathered:
    await conn.send(connect_packet(cid, username, password, keepalive=60))
    first, body = await conn.read_packet()
    if first >> 4 != CONNACK or len(body) < 2:
        raise CollectError(f"expected CONNACK, got packet type {first >> 4}")
    if body[1] != 0:
        raise CollectError(f"connection refused, reason code 0x{body[1]:02x}")
    await conn.send(subscribe_packet(1, FILTERS))
    gathered: Gathered | None = None
    early: list[tuple[int, bytes]] = []
    while gathered is None:
        first, body = await conn.read_packet()
        if first >> 4 == SUBACK:
            if len(body) < 3 or struct.unpack_from(">H", body, 0)[0] != 1:
                raise CollectError("SUBACK for another packet id")
            plen, pos = props.read_varint(body, 2)
            codes = body[pos + plen :]
            if len(codes) != len(FILTERS):
                raise CollectError(f"SUBACK with {len(codes)} reason codes for 2 filters")
            if codes[0] >= 0x80:
                raise CollectError(f"subscription to '#' refused, reason code 0x{codes[0]:02x}")
            gathered = Gathered(time.time(), sys_granted=codes[1] < 0x80)
        else:
            early.append((first, body))  # retained delivery may start before the SUBACK
    for first, body in early:
        await _handle(conn, first, body, gathered)
    last = time.monotonic()
    while True:
        wait = last + quiet - time.monotonic()
        if wait <= 0:
            break
        if time.monotonic() >= deadline:
            raise TimeoutError
        try:
            first, body = await asyncio.wait_for(conn.read_packet(), wait)
        except TimeoutError:
            break
        if await _handle(conn, first, body, gathered):
            last = time.monotonic()
    with contextlib.suppress(Exception):
        await conn.send(b"\xe0\x00")  # DISCONNECT, normal
    return gathered


async def _handle(conn: Connection, first: int, body: bytes, gathered: Gathered) -> bool:
    """Acknowledge one packet; True when it was a retained PUBLISH."""
    kind = first >> 4
    if kind == PUBLISH:
        msg, pid, retain = parse_publish(first, body)
        if msg.qos == 1:
            await conn.send(b"\x40\x02" + struct.pack(">H", pid))  # PUBACK
        elif msg.qos == 2:
            await conn.send(b"\x50\x02" + struct.pack(">H", pid))  # PUBREC
        if retain:
            gathered.messages[msg.topic] = msg
            return True
        gathered.live_ignored += 1
        return False
    if kind == PUBREL:
        if len(body) < 2:
            raise CollectError("PUBREL cut short")
        await conn.send(b"\x70\x02" + body[:2])  # PUBCOMP
        return False
    if kind == DISCONNECT:
        code = body[0] if body else 0
        raise CollectError(f"the gateway disconnected, reason code 0x{code:02x}")
    return False  # PINGRESP and anything else harmless

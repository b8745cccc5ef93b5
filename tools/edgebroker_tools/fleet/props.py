"""MQTT 5.0 properties (section 2.2.2): decode the property bytes of a PUBLISH.

Used by the collector (properties as received) and by the store decoder
(the property bytes a flash store keeps with each retained message). Only
the standard library: the executors import this module.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Final

from edgebroker_tools.mqttclient import mqtt_str

PAYLOAD_FORMAT: Final = 0x01
MESSAGE_EXPIRY: Final = 0x02
CONTENT_TYPE: Final = 0x03
RESPONSE_TOPIC: Final = 0x08
CORRELATION_DATA: Final = 0x09
SUBSCRIPTION_ID: Final = 0x0B
TOPIC_ALIAS: Final = 0x23
USER_PROPERTY: Final = 0x26

# Properties that belong to one delivery, not to the stored message: the
# broker does not count them against store_budget_bytes.
_PER_DELIVERY: Final = frozenset({MESSAGE_EXPIRY, SUBSCRIPTION_ID, TOPIC_ALIAS})

# Value kinds: byte, two-byte int, four-byte int, variable int, UTF-8 string,
# binary data, string pair (2.2.2.2).
_BYTE, _U16, _U32, _VAR, _STR, _BIN, _PAIR = range(7)
_KINDS: Final = {
    0x01: _BYTE, 0x02: _U32, 0x03: _STR, 0x08: _STR, 0x09: _BIN, 0x0B: _VAR,
    0x11: _U32, 0x12: _STR, 0x13: _U16, 0x15: _STR, 0x16: _BIN, 0x17: _BYTE,
    0x18: _U32, 0x19: _BYTE, 0x1A: _STR, 0x1C: _STR, 0x1F: _STR, 0x21: _U16,
    0x22: _U16, 0x23: _U16, 0x24: _BYTE, 0x25: _BYTE, 0x26: _PAIR, 0x27: _U32,
    0x28: _BYTE, 0x29: _BYTE, 0x2A: _BYTE,
}  # fmt: skip


class PropertyError(ValueError):
    """Property bytes that do not decode (unknown id, cut short, bad UTF-8)."""


@dataclass
class Properties:
    """The properties of one PUBLISH that the snapshot keeps."""

    payload_format: int | None = None
    message_expiry: int | None = None
    content_type: str | None = None
    user_properties: list[tuple[str, str]] = field(default_factory=list)
    stored_bytes: int = 0  # property bytes the broker stores with the message


def read_varint(data: bytes | memoryview, pos: int) -> tuple[int, int]:
    """A Variable Byte Integer at pos: (value, position after it)."""
    value = 0
    for shift in (0, 7, 14, 21):
        if pos >= len(data):
            raise PropertyError("variable byte integer cut short")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
    raise PropertyError("variable byte integer longer than 4 bytes")


def _utf8(raw: bytes | memoryview) -> str:
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise PropertyError("property string is not UTF-8") from None


def decode(data: bytes | memoryview) -> Properties:
    """Decode property bytes (without their length prefix)."""
    out = Properties()
    pos = 0
    end = len(data)
    while pos < end:
        start = pos
        ident, pos = read_varint(data, pos)
        kind = _KINDS.get(ident)
        if kind is None:
            raise PropertyError(f"unknown property 0x{ident:02x}")
        value: int | str | bytes | tuple[str, str]
        if kind == _BYTE:
            if pos + 1 > end:
                raise PropertyError("property cut short")
            value = data[pos]
            pos += 1
        elif kind in (_U16, _U32):
            size = 2 if kind == _U16 else 4
            if pos + size > end:
                raise PropertyError("property cut short")
            value = int.from_bytes(bytes(data[pos : pos + size]), "big")
            pos += size
        elif kind == _VAR:
            value, pos = read_varint(data, pos)
        else:
            parts: list[bytes] = []
            for _ in range(2 if kind == _PAIR else 1):
                if pos + 2 > end:
                    raise PropertyError("property cut short")
                (size,) = struct.unpack_from(">H", data, pos)
                pos += 2
                if pos + size > end:
                    raise PropertyError("property cut short")
                parts.append(bytes(data[pos : pos + size]))
                pos += size
            if kind == _BIN:
                value = parts[0]
            elif kind == _STR:
                value = _utf8(parts[0])
            else:
                value = (_utf8(parts[0]), _utf8(parts[1]))
        if ident not in _PER_DELIVERY:
            out.stored_bytes += pos - start
        if ident == PAYLOAD_FORMAT and isinstance(value, int):
            out.payload_format = value
        elif ident == MESSAGE_EXPIRY and isinstance(value, int):
            out.message_expiry = value
        elif ident == CONTENT_TYPE and isinstance(value, str):
            out.content_type = value
        elif ident == USER_PROPERTY and isinstance(value, tuple):
            out.user_properties.append(value)
    return out


def encode(
    *,
    payload_format: int | None = None,
    message_expiry: int | None = None,
    content_type: str | None = None,
    user_properties: tuple[tuple[str, str], ...] | list[tuple[str, str]] = (),
    receive_maximum: int | None = None,
    session_expiry: int | None = None,
) -> bytes:
    """Property bytes (without the length prefix) for the properties given."""
    out = bytearray()
    if payload_format is not None:
        out += bytes((PAYLOAD_FORMAT, payload_format))
    if message_expiry is not None:
        out += bytes((MESSAGE_EXPIRY,)) + struct.pack(">I", message_expiry)
    if content_type is not None:
        out += bytes((CONTENT_TYPE,)) + mqtt_str(content_type)
    if session_expiry is not None:
        out += bytes((0x11,)) + struct.pack(">I", session_expiry)
    if receive_maximum is not None:
        out += bytes((0x21,)) + struct.pack(">H", receive_maximum)
    for key, value in user_properties:
        out += bytes((USER_PROPERTY,)) + mqtt_str(key) + mqtt_str(value)
    return bytes(out)

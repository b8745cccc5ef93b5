# edgebroker: an MQTT 3.1.1 + 5.0 broker for MicroPython gateways and CPython hosts.
#
# One file, sectioned like a table of contents:
#   1. compat            the only place that knows there are two interpreters
#   2. constants         packet types, reason codes, property ids
#   3. limits            every limit with its default (the board profile overrides)
#   4. codec             reading and writing the wire format
#   5. topics            validation and the subscription tree
#   6. retained store    the narrow store interface and its RAM backend
#   7. client state      Conn (one socket) and Session (outlives sockets)
#   8. broker            packet handlers, routing, delivery, housekeeping
#   9. loops             connection I/O, accept loop, serve loop
#  10. stats             $SYS/broker/... statistics
#  11. main              command line entry point (host build and emulator)
#
# Nothing happens at import: the limits, store and clock are handed to Broker().
# Comments cite the OASIS specifications: MQTT-x.y.z-n statements are MQTT 5.0
# unless marked 3.1.1. Bytecode drops the comments, so they are free on a board.

# ---------------------------------------------------------------- 1. compat
import gc
import os
import sys
import time
import select
import socket

try:
    from micropython import const
except ImportError:  # CPython
    def const(x):
        return x

try:  # MicroPython: a wrapping millisecond tick
    from time import ticks_ms as _ticks_ms, ticks_diff as _ticks_diff
except ImportError:  # CPython
    def _ticks_ms():
        return int(time.monotonic() * 1000)

    def _ticks_diff(a, b):
        return a - b

try:  # MicroPython heap figures and collection threshold; CPython has none
    _mem_free = gc.mem_free
    _mem_alloc = gc.mem_alloc
    _gc_threshold = gc.threshold
except AttributeError:
    _mem_free = None
    _mem_alloc = None
    _gc_threshold = None

_IMPL = sys.implementation.name

# Unix seconds from the wall clock, or None while it was never set (a board
# without NTP starts near its epoch: 2000 on ESP32, 1970 elsewhere, so any
# time before 2020 means "not set"). Boards pass their own to open_store().
_EPOCH_2000 = 946684800 if time.gmtime(0)[0] == 2000 else 0


def _wallclock():
    t = time.time() + _EPOCH_2000
    return int(t) if t > 1577836800 else None

if hasattr(select.poll(), "ipoll"):
    # MicroPython: ipoll yields (socket, event) without allocating a result
    # list; sockets are registered and looked up by object.
    def _poll(p, timeout):
        return p.ipoll(timeout)

    def _key(sock):
        return sock

    def _recv_into(sock, mv):
        # readinto returns None when no data is waiting on a non-blocking socket
        n = sock.readinto(mv)
        return -1 if n is None else n
else:
    def _poll(p, timeout):
        return p.poll(timeout)

    def _key(sock):
        return sock.fileno()

    def _recv_into(sock, mv):
        try:
            return sock.recv_into(mv)
        except BlockingIOError:
            return -1

# MicroPython's decoder accepts UTF-16 surrogates and overlong forms that
# MQTT-1.5.4-1 forbids; an extra byte check runs only where it is lax.
try:
    str(b"\xed\xa0\x80", "utf-8")
    _LAX_UTF8 = True
except UnicodeError:
    _LAX_UTF8 = False

try:  # MicroPython (its default file is stdout: logs go to stderr)
    _pe = sys.print_exception

    def _print_exc(e):
        _pe(e, sys.stderr)
except AttributeError:  # CPython
    def _print_exc(e):
        import traceback
        traceback.print_exception(e)

try:  # CPython: SIGTERM stops the broker the way SIGINT does
    import signal as _signal

    def _on_sigterm(signum, frame):
        raise KeyboardInterrupt

    def _install_signals():
        _signal.signal(_signal.SIGTERM, _on_sigterm)
        # a shell starts background jobs with SIGINT ignored; we want it
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)
except ImportError:  # MicroPython: SIGINT raises KeyboardInterrupt already
    def _install_signals():
        pass

# MicroPython's socket module names neither; these are Linux and lwIP values
_IPPROTO_TCP = getattr(socket, "IPPROTO_TCP", 6)
_TCP_NODELAY = getattr(socket, "TCP_NODELAY", 1)

_EAGAIN = (11, 35)  # EAGAIN on Linux / macOS-style EWOULDBLOCK
_EMFILE = (23, 24)  # ENFILE, EMFILE: no socket can be accepted right now

# ------------------------------------------------------------- 2. constants
VERSION = "0.1.0"

_CONNECT = const(1)
_CONNACK = const(2)
_PUBLISH = const(3)
_PUBACK = const(4)
_PUBREC = const(5)
_PUBREL = const(6)
_PUBCOMP = const(7)
_SUBSCRIBE = const(8)
_SUBACK = const(9)
_UNSUBSCRIBE = const(10)
_UNSUBACK = const(11)
_PINGREQ = const(12)
_PINGRESP = const(13)
_DISCONNECT = const(14)
_AUTH = const(15)

# MQTT 5.0 reason codes (2.4)
_RC_SUCCESS = const(0x00)
_RC_NO_SUBSCRIPTION = const(0x11)
_RC_DISCONNECT_WITH_WILL = const(0x04)
_RC_UNSPECIFIED = const(0x80)
_RC_MALFORMED = const(0x81)
_RC_PROTOCOL = const(0x82)
_RC_IMPL_SPECIFIC = const(0x83)
_RC_BAD_VERSION = const(0x84)
_RC_BAD_CLIENT_ID = const(0x85)
_RC_BAD_AUTH = const(0x86)
_RC_NOT_AUTHORIZED = const(0x87)
_RC_SERVER_BUSY = const(0x89)
_RC_BAD_AUTH_METHOD = const(0x8C)
_RC_KEEPALIVE = const(0x8D)
_RC_TAKEN_OVER = const(0x8E)
_RC_BAD_FILTER = const(0x8F)
_RC_BAD_TOPIC = const(0x90)
_RC_PID_NOT_FOUND = const(0x92)
_RC_RECV_MAX = const(0x93)
_RC_ALIAS_INVALID = const(0x94)
_RC_TOO_LARGE = const(0x95)
_RC_QUOTA = const(0x97)
_RC_RETAIN_UNSUPPORTED = const(0x9A)
_RC_QOS_UNSUPPORTED = const(0x9B)
_RC_SHARED_UNSUPPORTED = const(0x9E)

# 3.1.1 CONNACK return codes (3.2.2.3)
_RC3_BAD_VERSION = const(1)
_RC3_BAD_ID = const(2)
_RC3_UNAVAILABLE = const(3)
_RC3_BAD_AUTH = const(4)

# Property identifiers (2.2.2.2) and their wire types
_P_PAYLOAD_FORMAT = const(0x01)
_P_MESSAGE_EXPIRY = const(0x02)
_P_CONTENT_TYPE = const(0x03)
_P_RESPONSE_TOPIC = const(0x08)
_P_CORRELATION = const(0x09)
_P_SUB_ID = const(0x0B)
_P_SESSION_EXPIRY = const(0x11)
_P_ASSIGNED_ID = const(0x12)
_P_SERVER_KEEPALIVE = const(0x13)
_P_AUTH_METHOD = const(0x15)
_P_AUTH_DATA = const(0x16)
_P_REQ_PROBLEM = const(0x17)
_P_WILL_DELAY = const(0x18)
_P_REQ_RESPONSE = const(0x19)
_P_REASON_STRING = const(0x1F)
_P_RECEIVE_MAX = const(0x21)
_P_ALIAS_MAX = const(0x22)
_P_ALIAS = const(0x23)
_P_MAX_QOS = const(0x24)
_P_RETAIN_AVAILABLE = const(0x25)
_P_USER = const(0x26)
_P_MAX_PACKET = const(0x27)
_P_WILDCARD_AVAILABLE = const(0x28)
_P_SUB_ID_AVAILABLE = const(0x29)
_P_SHARED_AVAILABLE = const(0x2A)

_T_BYTE = const(1)
_T_U16 = const(2)
_T_U32 = const(3)
_T_VBI = const(4)
_T_STR = const(5)
_T_BIN = const(6)
_T_PAIR = const(7)

# Wire type of each property id (index = id, 0 = no such property): a
# 43-byte table instead of a dict, which costs more heap.
_PROP_TYPES = b'\x00\x01\x03\x05\x00\x00\x00\x00\x05\x06\x00\x04\x00\x00\x00\x00\x00\x03\x05\x02\x00\x05\x06\x01\x03\x01\x05\x00\x05\x00\x00\x05\x00\x02\x02\x02\x01\x01\x07\x03\x01\x01\x01'
# Properties a PUBLISH carries to subscribers unchanged (3.3.2.3); Message
# Expiry is re-encoded with the remaining time, Topic Alias and Subscription
# Identifier are never forwarded.
_FORWARDED = (_P_PAYLOAD_FORMAT, _P_CONTENT_TYPE, _P_RESPONSE_TOPIC,
              _P_CORRELATION, _P_USER)

_MAX_VBI = const(268435455)
_NO_LIMIT_PACKET = const(268435460)

# --------------------------------------------------------------- 3. limits
# Every limit a board profile may set: key -> default. README.md and
# boards/schema.json document unit and consequence; the tools validate.
DEFAULTS = {
    "board": "host",
    "max_clients": 16,
    "max_packet_size": 16384,
    "max_subscriptions": 32,
    "max_topic_length": 256,
    "max_topic_levels": 16,
    "max_inflight": 16,
    "max_queued": 64,
    "max_outbuf": 16384,
    "max_sessions": 32,
    "topic_alias_maximum": 10,
    "server_keep_alive": 0,
    "max_session_expiry": 86400,
    "maximum_qos": 2,
    "heap_reserve": 16384,
    "allow_anonymous": True,
    "users": {},
    "retain_available": True,
    "max_retained_messages": 1000,
    "max_payload_size": 4096,
    "expiry_interval": 0,
    "store_budget_bytes": 262144,
    "storage_type": "ram",
    "compact_ratio": 0.5,
    "compact_min_bytes": 4096,
    "sys_interval": 10,
    "backlog": 16,
    "io_chunk": 4096,
    "connect_timeout": 10,
    "log_level": "info",
}


def limits(profile=None):
    """The effective limits: DEFAULTS overridden by a profile dict. Only
    the keys the broker reads are kept (a profile also carries board facts
    for the host tools); the tools reject unknown keys, the broker ignores
    them."""
    cfg = dict(DEFAULTS)
    if profile:
        for k in DEFAULTS:
            if k in profile:
                cfg[k] = profile[k]
    return cfg


_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}


class MqttError(Exception):
    """A protocol violation: the connection ends with this reason code
    (5.0 DISCONNECT) or is closed (3.1.1). Raised only from handlers."""

    def __init__(self, code, text):
        self.code = code
        self.text = text


# ---------------------------------------------------------------- 4. codec
def vbi(n):
    """Variable Byte Integer (1.5.5)."""
    if n < 128:
        return bytes((n,))
    out = bytearray()
    while True:
        d = n & 0x7F
        n >>= 7
        if n:
            out.append(d | 0x80)
        else:
            out.append(d)
            return bytes(out)


def read_vbi(b, i, end):
    """Returns (value, next index). At most 4 bytes (MQTT-1.5.5-1)."""
    v = 0
    shift = 0
    while True:
        if i >= end:
            raise MqttError(_RC_MALFORMED, "truncated variable byte integer")
        d = b[i]
        i += 1
        v |= (d & 0x7F) << shift
        if not d & 0x80:
            return v, i
        shift += 7
        if shift > 21:
            raise MqttError(_RC_MALFORMED, "variable byte integer over 4 bytes")


def u16(n):
    return bytes((n >> 8 & 0xFF, n & 0xFF))


def u32(n):
    return bytes((n >> 24 & 0xFF, n >> 16 & 0xFF, n >> 8 & 0xFF, n & 0xFF))


def mqstr(s):
    """UTF-8 Encoded String (1.5.4) from str or bytes."""
    if isinstance(s, str):
        s = s.encode()
    return u16(len(s)) + s


def _need(i, k, end):
    if i + k > end:
        raise MqttError(_RC_MALFORMED, "packet shorter than its fields")


def read_u16(b, i, end):
    _need(i, 2, end)
    return b[i] << 8 | b[i + 1], i + 2


def read_bin(b, i, end):
    n, i = read_u16(b, i, end)
    _need(i, n, end)
    return bytes(b[i:i + n]), i + n


def check_utf8(raw):
    """Decodes an MQTT string; malformed if not well-formed UTF-8 or if it
    holds U+0000 (MQTT-1.5.4-1, MQTT-1.5.4-2)."""
    try:
        s = str(raw, "utf-8")
    except UnicodeError:
        raise MqttError(_RC_MALFORMED, "invalid UTF-8")
    if "\x00" in s:
        raise MqttError(_RC_MALFORMED, "U+0000 in a string")
    if _LAX_UTF8 and len(s) != len(raw):
        _strict_utf8(raw)
    return s


def _strict_utf8(raw):
    # Overlong forms (C0, C1, E0 80-9F, F0 80-8F) and surrogates (ED A0-BF).
    n = len(raw)
    i = 0
    while i < n:
        c = raw[i]
        if c < 0x80:
            i += 1
            continue
        nxt = raw[i + 1] if i + 1 < n else 0
        if c in (0xC0, 0xC1) or (c == 0xE0 and nxt < 0xA0) \
                or (c == 0xED and nxt >= 0xA0) or (c == 0xF0 and nxt < 0x90):
            raise MqttError(_RC_MALFORMED, "invalid UTF-8")
        i += 2 if c < 0xE0 else 3 if c < 0xF0 else 4


def read_str(b, i, end):
    raw, i = read_bin(b, i, end)
    return check_utf8(raw), i


def read_props(b, i, end):
    """Properties (2.2.2): returns (dict id -> value, raw forwardable bytes,
    next index). User Properties collect in a list under P_USER; a repeated
    property that may appear once is a Protocol Error."""
    plen, i = read_vbi(b, i, end)
    stop = i + plen
    if stop > end:
        raise MqttError(_RC_MALFORMED, "properties longer than the packet")
    props = {}
    fwd = None
    while i < stop:
        start = i
        pid = b[i]
        i += 1
        t = _PROP_TYPES[pid] if pid < len(_PROP_TYPES) else 0
        if t == 0:
            raise MqttError(_RC_MALFORMED, "unknown property 0x%02x" % pid)
        if t == _T_BYTE:
            _need(i, 1, stop)
            v = b[i]
            i += 1
        elif t == _T_U16:
            v, i = read_u16(b, i, stop)
        elif t == _T_U32:
            _need(i, 4, stop)
            v = b[i] << 24 | b[i + 1] << 16 | b[i + 2] << 8 | b[i + 3]
            i += 4
        elif t == _T_VBI:
            v, i = read_vbi(b, i, stop)
        elif t == _T_STR:
            v, i = read_str(b, i, stop)
        elif t == _T_BIN:
            v, i = read_bin(b, i, stop)
        else:
            k, i = read_str(b, i, stop)
            v, i = read_str(b, i, stop)
            v = (k, v)
        if pid == _P_USER:
            lst = props.get(_P_USER)
            if lst is None:
                props[_P_USER] = [v]
            else:
                lst.append(v)
        elif pid in props:
            raise MqttError(_RC_PROTOCOL, "property 0x%02x repeated" % pid)
        else:
            props[pid] = v
        if pid in _FORWARDED:
            fwd = bytes(b[start:i]) if fwd is None else fwd + bytes(b[start:i])
    return props, fwd or b"", stop


def prop_byte(pid, v):
    return bytes((pid, v))


def prop_u16(pid, v):
    return bytes((pid,)) + u16(v)


def prop_u32(pid, v):
    return bytes((pid,)) + u32(v)


def prop_str(pid, s):
    return bytes((pid,)) + mqstr(s)


def packet(ptype, flags, body):
    """A whole packet: fixed header (2.1) + body."""
    return bytes((ptype << 4 | flags,)) + vbi(len(body)) + body


# ---------------------------------------------------------------- 5. topics
def valid_topic_name(t):
    # MQTT-4.7.3-1: at least one character; MQTT-3.3.2-2: no wildcards.
    return len(t) > 0 and "+" not in t and "#" not in t


def valid_filter(f):
    """MQTT-4.7.1-1/2/3: '#' alone and last; '+' occupies a whole level."""
    if not f:
        return False
    levels = f.split("/")
    last = len(levels) - 1
    for i, lv in enumerate(levels):
        if "#" in lv and (lv != "#" or i != last):
            return False
        if "+" in lv and lv != "+":
            return False
    return True


def topic_matches(flevels, topic):
    """Does a filter (split into levels) match a topic name? Leading
    wildcards never match '$' topics (MQTT-4.7.2-1). Loop, no recursion."""
    if topic[:1] == "$" and flevels[0] in ("+", "#"):
        return False
    if flevels[0] == "#":
        return True  # the whole-set delivery: no split per message
    tlevels = topic.split("/")
    n = len(tlevels)
    i = 0
    for lv in flevels:
        if lv == "#":
            return True
        if i >= n:
            return False
        if lv != "+" and lv != tlevels[i]:
            return False
        i += 1
    return i == n


class TopicTree:
    """Subscriptions by level: a node is [children dict, subscribers dict].
    A publish walks only the branches its levels select ('+', '#' and the
    literal level), never every subscription (mosquitto's subs.c does the
    same). The subscribers dict maps session -> (options byte, sub id)."""

    def __init__(self):
        self.root = [{}, None]

    def add(self, filt, sess, opts, sid):
        node = self.root
        for lv in filt.split("/"):
            ch = node[0]
            nxt = ch.get(lv)
            if nxt is None:
                nxt = [{}, None]
                ch[lv] = nxt
            node = nxt
        if node[1] is None:
            node[1] = {}
        node[1][sess] = (opts, sid)

    def remove(self, filt, sess):
        node = self.root
        path = []
        for lv in filt.split("/"):
            nxt = node[0].get(lv)
            if nxt is None:
                return False
            path.append((node, lv))
            node = nxt
        subs = node[1]
        if subs is None or sess not in subs:
            return False
        del subs[sess]
        if not subs:
            node[1] = None
        # prune empty branches, deepest first
        while path:
            parent, lv = path.pop()
            child = parent[0][lv]
            if child[1] is None and not child[0]:
                del parent[0][lv]
            else:
                break
        return True

    def match(self, levels, dollar):
        """Yields the subscribers dicts of every node matching a topic."""
        n = len(levels)
        stack = [(self.root, 0)]
        while stack:
            node, i = stack.pop()
            ch = node[0]
            wild = not (dollar and i == 0)
            if i == n:
                if node[1]:
                    yield node[1]
                h = ch.get("#")  # 'a/#' matches 'a' (4.7.1.2)
                if h is not None and h[1] and wild:
                    yield h[1]
                continue
            if ch:
                if wild:
                    h = ch.get("#")
                    if h is not None and h[1]:
                        yield h[1]
                    p = ch.get("+")
                    if p is not None:
                        stack.append((p, i + 1))
                nx = ch.get(levels[i])
                if nx is not None:
                    stack.append((nx, i + 1))


# --------------------------------------------------------- 6. retained store
# A message is a tuple, immutable once made, shared by every queue it is in:
#   (topic str, topic bytes, payload bytes, qos, forwarded 5.0 property bytes,
#    expiry deadline in broker seconds or 0, own-expiry flag)
_M_TOPIC = const(0)
_M_TB = const(1)
_M_PAYLOAD = const(2)
_M_QOS = const(3)
_M_PROPS = const(4)
_M_EXP = const(5)
_M_OWNEXP = const(6)


def msg_size(m):
    return len(m[_M_TB]) + len(m[_M_PAYLOAD]) + len(m[_M_PROPS])


_PARTS = const(32)    # slot partitions, chosen by a hash of the first level
_CH = const(32)       # slots per chunk, chunks per page


class RamStore:
    """The retained-store interface, RAM backend (storage_type 'ram').

    Interface (the flash store implements the same):
      get(topic) -> msg or None     put(topic, msg)     delete(topic)
      match(filter levels) -> iterator of msgs, safe while the store changes
      count, nbytes                 durable (acks wait for commit() if True)
      commit()                      expire(now, budget) -> removed
      close()

    Memory: on MicroPython a large contiguous block is what fails first (a
    growing dict or list needs one twice its size: design.md), so nothing
    here grows as one piece. The index is a power of two of small dicts, about 16 topics each at the
    expected capacity (max_retained_messages) (topic -> location);
    messages sit in 32 partitions of pages of 32 chunks of 32 slots. So no
    allocation grows past 32 pointers or a small dict, however many messages. A deleted slot holds the
    number of the next free slot (a free list threaded through the holes, no
    list of its own), and an iterator walks slots by number, so puts and
    deletes during a long delivery never invalidate it and nothing is copied.
    A filter with a literal first level walks one partition, not the set."""

    durable = False

    def __init__(self, capacity=1000):
        nb = 16
        while nb < 1024 and nb * 16 < (capacity or 16384):
            nb *= 2
        self.nb = nb
        self.index = None   # made at the first put: an idle broker pays nothing
        self.parts = None   # [chunks, first free slot or -1] per partition
        self.count = 0
        self.nbytes = 0
        self._sweep = None

    def get(self, topic):
        if self.index is None:
            return None
        d = self.index[hash(topic) % self.nb]
        loc = None if d is None else d.get(topic)
        if loc is None:
            return None
        i = loc // _PARTS
        return self.parts[loc % _PARTS][0][i >> 10][i >> 5 & 31][i & 31]

    def put(self, topic, msg):
        if self.index is None:
            self.index = [None] * self.nb
            self.parts = [None] * _PARTS
        h = hash(topic) % self.nb
        d = self.index[h]
        if d is None:
            d = self.index[h] = {}
        loc = d.get(topic)
        if loc is not None:
            i = loc // _PARTS
            ch = self.parts[loc % _PARTS][0][i >> 10][i >> 5 & 31]
            self.nbytes += msg_size(msg) - msg_size(ch[i & 31])
            ch[i & 31] = msg
            return
        pn = hash(_first(topic)) % _PARTS
        p = self.parts[pn]
        if p is None:
            p = self.parts[pn] = [[], -1]
        pages = p[0]
        i = p[1]
        if i >= 0:
            ch = pages[i >> 10][i >> 5 & 31]
            p[1] = ch[i & 31]
            ch[i & 31] = msg
        else:
            page = pages[-1] if pages else None
            if page is None or (len(page) == _CH and len(page[-1]) == _CH):
                page = []
                pages.append(page)
            if not page or len(page[-1]) == _CH:
                page.append([])
            ch = page[-1]
            i = (len(pages) - 1) * 1024 + (len(page) - 1) * 32 + len(ch)
            ch.append(msg)
        d[topic] = i * _PARTS + pn
        self.count += 1
        self.nbytes += msg_size(msg)

    def delete(self, topic):
        if self.index is None:
            return False
        d = self.index[hash(topic) % self.nb]
        loc = None if d is None else d.pop(topic, None)
        if loc is None:
            return False
        p = self.parts[loc % _PARTS]
        i = loc // _PARTS
        ch = p[0][i >> 10][i >> 5 & 31]
        self.nbytes -= msg_size(ch[i & 31])
        self.count -= 1
        ch[i & 31] = p[1]
        p[1] = i
        return True

    def match(self, flevels):
        first = flevels[0]
        every = first == "+" or first == "#"
        if not every and "+" not in flevels and "#" not in flevels:
            m = self.get("/".join(flevels))
            if m is not None:
                yield m
            return
        # One generator walking slots by number (the paced hot path of D9:
        # a delivery resumes one frame per message, not three).
        pn = 0 if every else hash(first) % _PARTS
        i = 0
        while self.parts is not None:
            p = self.parts[pn]
            ch = None
            if p is not None:
                pages = p[0]
                if i >> 10 < len(pages):
                    page = pages[i >> 10]
                    if i >> 5 & 31 < len(page):
                        ch = page[i >> 5 & 31]
                        if i & 31 >= len(ch):
                            ch = None
            if ch is None:  # this partition is done
                if not every or pn + 1 >= _PARTS:
                    return
                pn += 1
                i = 0
                continue
            m = ch[i & 31]
            i += 1
            if type(m) is tuple and topic_matches(flevels, m[_M_TOPIC]):
                yield m

    def _slots(self, pn):
        # every message of a partition, by slot number; holes are ints
        i = 0
        while self.parts is not None:
            p = self.parts[pn]
            if p is None:
                return
            pages = p[0]
            if i >> 10 >= len(pages):
                return
            page = pages[i >> 10]
            if i >> 5 & 31 >= len(page):
                return
            ch = page[i >> 5 & 31]
            k = i & 31
            if k >= len(ch):
                return
            i += 1
            m = ch[k]
            if type(m) is tuple:
                yield m

    def expire(self, now, budget):
        """Deletes expired messages, looking at `budget` slots a call and
        resuming where the last call stopped: bounded work per second."""
        removed = 0
        sw = self._sweep
        if sw is None:
            sw = self._sweep = self._sweeper()
        for _ in range(budget):
            try:
                m = next(sw)
            except StopIteration:
                self._sweep = None
                break
            if m[_M_EXP] and m[_M_EXP] <= now and self.get(m[_M_TOPIC]) is m:
                self.delete(m[_M_TOPIC])
                removed += 1
        return removed

    def _sweeper(self):
        for pn in range(_PARTS):
            yield from self._slots(pn)

    def commit(self):
        pass

    def close(self):
        pass


def _first(topic):
    i = topic.find("/")
    return topic if i < 0 else topic[:i]


class MonoClock:
    """Broker seconds: monotonic, never wrapping (ticks_ms wraps after
    ~12 days on a board), unaffected by NTP setting the wall clock. One is
    shared by the broker and its store."""

    def __init__(self):
        self._t = _ticks_ms()
        self._ms = 0

    def __call__(self):
        t = _ticks_ms()
        self._ms += _ticks_diff(t, self._t)
        self._t = t
        return self._ms / 1000


def open_store(cfg, data_dir=None, clock=None, wallclock=None, log=None):
    """The retained store cfg["storage_type"] asks for: 'ram' (or no
    data_dir) -> RamStore; 'disc' / 'disc_only' -> edgestore.FlashStore at
    <data_dir>/retained.ebrs. The flash module is imported only here, so a
    RAM-only build need not carry it."""
    kind = cfg["storage_type"]
    if kind == "ram" or not data_dir:
        return RamStore(cfg["max_retained_messages"])
    if kind not in ("disc", "disc_only"):
        raise ValueError("storage_type must be ram, disc or disc_only")
    import edgestore
    return edgestore.FlashStore(
        data_dir + "/retained.ebrs", mode=kind, capacity=cfg["max_retained_messages"],
        clock=clock, wallclock=wallclock, compact_ratio=cfg["compact_ratio"],
        compact_min_bytes=cfg["compact_min_bytes"], log=log)


# ---------------------------------------------------------- 7. client state
class Session:
    """What outlives a connection (4.1): subscriptions, outbound messages not
    yet acknowledged, the offline queue, inbound QoS 2 packet ids."""

    def __init__(self, cid, ver):
        self.cid = cid
        self.ver = ver
        self.conn = None
        self.subs = {}       # filter -> (options byte, subscription id)
        self.inflight = []   # [pid, msg, qos, retain, sids, released], send order
        self.queue = []      # [msg, qos, retain, sids], oldest first
        self.rq = []         # pending retained deliveries: [iterator, opts, sid, filter, held msg]
        self.in2 = {}        # inbound QoS 2 pids awaiting PUBREL (MQTT-4.3.3-x)
        self.pid = 0
        self.expiry = 0      # Session Expiry Interval, seconds
        self.gone = 0        # broker seconds when the last connection closed


class Conn:
    """One network connection; `sess` is set once CONNECT is accepted."""

    def __init__(self, sock, key, now):
        self.sock = sock
        self.key = key
        self.ver = 0
        self.sess = None
        self.pend = None      # bytes of an incomplete packet
        self.out = None       # bytearray waiting to be sent
        self.pollout = False
        self.ka = 0           # keep alive in seconds (0 = off)
        self.last = now       # broker seconds of the last packet received
        self.born = now
        self.will = None      # (msg, retain, delay seconds)
        self.maxpkt = _NO_LIMIT_PACKET
        self.window = 0       # outbound inflight window
        self.aliases = None   # inbound Topic Alias -> topic name
        self.problem = True   # Request Problem Information
        self.defer = None     # acks waiting for a durable store commit
        self.closed = False
        self.cid = ""

    def out_len(self):
        o = self.out
        return 0 if o is None else len(o)


# ---------------------------------------------------------------- 8. broker
class Broker:
    """The broker. Give it limits (see limits()), a retained store (see
    open_store()) and the clock the store was opened with (a MonoClock: a
    function returning seconds that only grow); then listen() and serve()."""

    def __init__(self, cfg, store=None, clock=None, log=None):
        self.cfg = cfg
        self.store = store if store is not None else RamStore(cfg["max_retained_messages"])
        self.now = clock if clock is not None else MonoClock()
        self._loglevel = _LEVELS.get(cfg["log_level"], 20)
        self._logf = log
        self.conns = {}
        self.sessions = {}
        self.tree = TopicTree()
        self.dirty = []       # connections with bytes waiting to be sent
        self.busy = []        # sessions with deliveries that can go on now
        self.deferred = []    # connections with acks waiting for commit()
        self.sdirty = False   # the store changed since the last commit()
        self._puts = 0        # new retained topics, to pace the heap check
        self.wills = []       # [deadline, session, msg, retain] delayed wills
        self.lsock = None
        self.poller = None
        self.running = False
        self.connected = 0
        self.started = 0
        self.n_in = 0
        self.n_out = 0
        self.n_dropped = 0
        self.refusals = {}
        self._logged = {}
        self._next_id = 0
        self._last_tick = 0
        self._last_sys = 0
        self._accept_pause = 0
        self.rmv = None       # the shared receive buffer, through a memoryview
        self.now_s = 0
        c = cfg
        self.max_packet = c["max_packet_size"]
        self.max_outbuf = c["max_outbuf"]
        self.max_inflight = c["max_inflight"]
        self.max_queued = c["max_queued"]

    # -- logging: level-gated, formatted only when it will be printed
    def log(self, level, fmt, *args):
        if _LEVELS[level] < self._loglevel:
            return
        text = fmt % args if args else fmt
        if self._logf is not None:
            self._logf(level, text)
        else:
            print("edgebroker: %s %s" % (level, text), file=sys.stderr)

    def refuse(self, cause, fmt="", *args):
        """Counts a refusal by cause (L5); logs the first of each cause."""
        n = self.refusals.get(cause, 0)
        if n == 0 and len(self.refusals) >= 64:
            cause = "other"
            n = self.refusals.get(cause, 0)
        self.refusals[cause] = n + 1
        if n == 0:
            self.log("warning", "refused (%s) %s" % (cause, fmt % args if args else fmt))

    # ------------------------------------------------------------ writing
    def outbuf(self, conn):
        """The connection's send buffer; a connection with bytes waiting is
        listed once in `dirty`, flushed at the end of the loop turn."""
        o = conn.out
        if o is None:
            o = conn.out = bytearray()
            self.dirty.append(conn)
        elif not o:
            self.dirty.append(conn)
        return o

    def write(self, conn, data):
        if not conn.closed:
            self.outbuf(conn).extend(data)

    def send_ack(self, conn, data):
        # PUBACK/PUBREC leave in the order the PUBLISHes came (4.6); once one
        # waits for a durable commit, the ones after it wait too.
        if conn.defer is not None:
            conn.defer.append(data)
        else:
            self.write(conn, data)

    def disconnect(self, conn, code, text=None):
        """Ends a connection for a protocol reason: 5.0 DISCONNECT with the
        reason code (MQTT-4.13.1-1), 3.1.1 just closes."""
        if conn.closed:
            return
        if conn.ver == 5 and code is not None:
            p = prop_str(_P_REASON_STRING, text) if text and conn.problem else b""
            if conn.sess is None:
                # a refused CONNECT is answered by CONNACK (MQTT-3.2.2-7)
                body = bytes((0, code)) + vbi(len(p)) + p
                self.write(conn, packet(_CONNACK, 0, body))
            else:
                body = bytes((code,)) + vbi(len(p)) + p
                self.write(conn, packet(_DISCONNECT, 0, body))
        self.close(conn, True)

    # ------------------------------------------------------------ reading
    def feed(self, conn, data, n):
        """Parses every complete packet in data[:n] (a memoryview) and keeps
        the incomplete tail. Oversize is refused from the fixed header, before
        the body is read (MQTT-3.1.2-24 reverse direction: 0x95)."""
        pend = conn.pend
        if pend is not None:
            data = memoryview(pend + bytes(data[:n]))
            n = len(data)
            conn.pend = None
        i = 0
        while i < n and not conn.closed:
            if n - i < 2:
                break
            # fixed header: type/flags byte + remaining length (1-4 bytes)
            rl = 0
            shift = 0
            j = i + 1
            ok = False
            while j < n:
                d = data[j]
                j += 1
                rl |= (d & 0x7F) << shift
                if not d & 0x80:
                    ok = True
                    break
                shift += 7
                if shift > 21:
                    raise MqttError(_RC_MALFORMED, "remaining length over 4 bytes")
            if not ok:
                break
            if j - i + rl > self.max_packet:
                raise MqttError(_RC_TOO_LARGE, "packet larger than Maximum Packet Size")
            if j + rl > n:
                break
            self.handle(conn, data[i], data, j, j + rl)
            i = j + rl
        if i < n and not conn.closed:
            conn.pend = bytes(data[i:n])

    def handle(self, conn, first, b, i, end):
        ptype = first >> 4
        flags = first & 0x0F
        conn.last = self.now_s
        if conn.sess is None:
            if ptype != _CONNECT:
                # MQTT-3.1.0-1: the first packet must be CONNECT
                raise MqttError(_RC_PROTOCOL, "first packet is not _CONNECT")
            return self.on_connect(conn, flags, b, i, end)
        if ptype == _PUBLISH:
            return self.on_publish(conn, flags, b, i, end)
        if ptype in (_PUBACK, _PUBREC, _PUBREL, _PUBCOMP):
            need = 2 if ptype == _PUBREL else 0
            if flags != need:  # MQTT-3.6.1-1 and 2.1.3 reserved flags
                raise MqttError(_RC_MALFORMED, "reserved flags")
            return self.on_ack(conn, ptype, b, i, end)
        if ptype == _SUBSCRIBE:
            if flags != 2:  # MQTT-3.8.1-1
                raise MqttError(_RC_MALFORMED, "_SUBSCRIBE flags not 0010")
            return self.on_subscribe(conn, b, i, end)
        if ptype == _UNSUBSCRIBE:
            if flags != 2:  # MQTT-3.10.1-1
                raise MqttError(_RC_MALFORMED, "_UNSUBSCRIBE flags not 0010")
            return self.on_unsubscribe(conn, b, i, end)
        if ptype == _PINGREQ:
            if flags or end != i:
                raise MqttError(_RC_MALFORMED, "bad _PINGREQ")
            self.write(conn, b"\xd0\x00")
            return
        if ptype == _DISCONNECT:
            if flags:
                raise MqttError(_RC_MALFORMED, "reserved flags")
            return self.on_disconnect(conn, b, i, end)
        if ptype == _CONNECT:
            raise MqttError(_RC_PROTOCOL, "second _CONNECT")  # MQTT-3.1.0-2
        if ptype == _AUTH and conn.ver == 5:
            # No Authentication Method was accepted in CONNECT, so any AUTH
            # is a Protocol Error (4.12): enhanced auth is not supported.
            raise MqttError(_RC_PROTOCOL, "_AUTH not supported")
        if ptype == 0:
            raise MqttError(_RC_MALFORMED, "reserved packet type 0")
        raise MqttError(_RC_PROTOCOL, "packet type %d not sent by clients" % ptype)

    # ------------------------------------------------------------ CONNECT
    def on_connect(self, conn, flags, b, i, end):
        if flags:
            raise MqttError(_RC_MALFORMED, "_CONNECT reserved flags")
        name, i = read_bin(b, i, end)
        _need(i, 4, end)
        level = b[i]
        cflags = b[i + 1]
        ka = b[i + 2] << 8 | b[i + 3]
        i += 4
        if name != b"MQTT" or level not in (4, 5):
            # MQTT-3.1.2-2: unacceptable protocol level -> return code 1
            if name in (b"MQTT", b"MQIsdp"):
                self.write(conn, b"\x20\x02\x00\x01")
            self.refuse("protocol_version", "level %d", level)
            self.close(conn, False)
            return
        conn.ver = level
        if cflags & 1:  # MQTT-3.1.2-3 reserved flag
            raise MqttError(_RC_MALFORMED, "_CONNECT reserved flag set")
        clean = cflags & 2
        will_flag = cflags & 4
        will_qos = cflags >> 3 & 3
        will_retain = cflags & 0x20
        has_pw = cflags & 0x40
        has_user = cflags & 0x80
        if will_qos == 3 or (not will_flag and (will_qos or will_retain)):
            raise MqttError(_RC_MALFORMED, "bad will flags")  # MQTT-3.1.2-11..15
        if level == 4 and has_pw and not has_user:
            raise MqttError(_RC_MALFORMED, "password without user name")  # 3.1.1 MQTT-3.1.2-22
        props = {}
        if level == 5:
            props, _, i = read_props(b, i, end)
        cid, i = read_str(b, i, end)
        will = None
        if will_flag:
            wprops = {}
            wfwd = b""
            if level == 5:
                wprops, wfwd, i = read_props(b, i, end)
            wtopic, i = read_str(b, i, end)
            wpayload, i = read_bin(b, i, end)
            if not valid_topic_name(wtopic):
                raise MqttError(_RC_BAD_TOPIC, "invalid will topic")
            exp = wprops.get(_P_MESSAGE_EXPIRY, 0)
            will = (wtopic, wpayload, will_qos, wfwd, exp,
                    bool(will_retain), wprops.get(_P_WILL_DELAY, 0))
        user = None
        pw = None
        if has_user:
            user, i = read_str(b, i, end)
        if has_pw:
            pw, i = read_bin(b, i, end)
        if i != end:
            raise MqttError(_RC_MALFORMED, "bytes after _CONNECT payload")
        v5 = level == 5
        if v5:
            rm = props.get(_P_RECEIVE_MAX, 65535)
            mp = props.get(_P_MAX_PACKET, _NO_LIMIT_PACKET)
            if rm == 0 or mp == 0:
                raise MqttError(_RC_PROTOCOL, "zero Receive Maximum or Maximum Packet Size")
            conn.maxpkt = mp
            conn.window = min(rm, self.max_inflight)
            conn.problem = props.get(_P_REQ_PROBLEM, 1) == 1
        else:
            conn.window = self.max_inflight
        cfg = self.cfg
        # -- refusals, in the order a client can act on them
        if v5 and _P_AUTH_METHOD in props:
            return self.connack_refuse(conn, _RC_BAD_AUTH_METHOD, _RC3_BAD_AUTH,
                                       "auth", "enhanced authentication not supported")
        assigned = None
        if not cid:
            if not clean and not v5:
                # 3.1.1 MQTT-3.1.3-8: empty id needs CleanSession=1
                return self.connack_refuse(conn, _RC_BAD_CLIENT_ID, _RC3_BAD_ID,
                                           "client_id", "empty client id without clean session")
            cid = assigned = self.new_client_id()
        elif len(cid) > 256:
            return self.connack_refuse(conn, _RC_BAD_CLIENT_ID, _RC3_BAD_ID,
                                       "client_id", "client id too long")
        if not self.authenticate(user, pw):
            return self.connack_refuse(conn, _RC_BAD_AUTH, _RC3_BAD_AUTH,
                                       "auth", "bad user name or password")
        old = self.sessions.get(cid)
        takeover = old is not None and old.conn is not None
        if self.connected >= cfg["max_clients"] and not takeover:
            return self.connack_refuse(conn, _RC_QUOTA, _RC3_UNAVAILABLE,
                                       "max_clients", "max_clients reached")
        if _mem_free is not None and _mem_free() < cfg["heap_reserve"]:
            gc.collect()
            if _mem_free() < cfg["heap_reserve"]:
                return self.connack_refuse(conn, _RC_QUOTA, _RC3_UNAVAILABLE,
                                           "heap_reserve", "free heap below heap_reserve")
        if will is not None and will[5] and not cfg["retain_available"]:
            # MQTT-3.2.2-13: will retain without retain support -> 0x9A
            return self.connack_refuse(conn, _RC_RETAIN_UNSUPPORTED, _RC3_UNAVAILABLE,
                                       "retain_unavailable", "will retain not supported")
        if will is not None and will[2] > cfg["maximum_qos"]:
            return self.connack_refuse(conn, _RC_QOS_UNSUPPORTED, _RC3_UNAVAILABLE,
                                       "qos", "will QoS above Maximum QoS")
        # -- accepted: take over, then find or make the session
        if takeover:
            # MQTT-3.1.4-3: the existing connection is closed, 5.0 with 0x8E
            self.disconnect(old.conn, _RC_TAKEN_OVER, "session taken over")
            old = self.sessions.get(cid)
        if v5:
            sexp = props.get(_P_SESSION_EXPIRY, 0)
        else:
            sexp = 0 if clean else 0xFFFFFFFF
        capped = sexp > cfg["max_session_expiry"]
        if capped:
            sexp = cfg["max_session_expiry"]
        present = False
        if old is not None and clean:
            self.end_session(old)
            old = None
        if old is not None:
            sess = old
            sess.ver = level
            present = True
            self.cancel_will(sess)
        else:
            sess = self.new_session(cid, level)
        sess.expiry = sexp
        sess.conn = conn
        conn.sess = sess
        conn.cid = cid
        self.connected += 1
        if v5 and cfg["server_keep_alive"]:
            ka = cfg["server_keep_alive"]  # MQTT-3.2.2-21: the client uses ours
        conn.ka = ka
        if will is not None:
            wt, wp, wq, wf, we, wr, wd = will
            conn.will = (self.make_msg(wt, wp, wq, wf, we), wr, wd)
        # -- CONNACK (3.2)
        if v5:
            p = bytearray()
            if capped:
                p += prop_u32(_P_SESSION_EXPIRY, sexp)
            p += prop_u16(_P_RECEIVE_MAX, min(self.max_inflight, 65535))
            if cfg["maximum_qos"] < 2:
                p += prop_byte(_P_MAX_QOS, cfg["maximum_qos"])
            p += prop_byte(_P_RETAIN_AVAILABLE, 1 if cfg["retain_available"] else 0)
            p += prop_u32(_P_MAX_PACKET, self.max_packet)
            if assigned is not None:
                p += prop_str(_P_ASSIGNED_ID, assigned)
            p += prop_u16(_P_ALIAS_MAX, cfg["topic_alias_maximum"])
            p += prop_byte(_P_WILDCARD_AVAILABLE, 1)
            p += prop_byte(_P_SUB_ID_AVAILABLE, 1)
            p += prop_byte(_P_SHARED_AVAILABLE, 0)
            if cfg["server_keep_alive"]:
                p += prop_u16(_P_SERVER_KEEPALIVE, ka)
            self.write(conn, packet(_CONNACK, 0, bytes((1 if present else 0, 0)) + vbi(len(p)) + p))
        else:
            self.write(conn, bytes((0x20, 2, 1 if present else 0, 0)))
        self.log("debug", "connected %s v%d", cid, level)
        # MQTT-4.4.0-1: resend unacknowledged PUBLISH (DUP=1) and PUBREL
        for ent in sess.inflight:
            if ent[5]:
                self.write(conn, bytes((0x62, 2)) + u16(ent[0]))
            else:
                self.encode_publish(conn, ent[1], ent[2], ent[3], ent[0], ent[4], True)
        self.pump(sess)

    def connack_refuse(self, conn, rc5, rc3, cause, text):
        self.refuse(cause, text)
        if conn.ver == 5:
            body = bytes((0, rc5))
            p = prop_str(_P_REASON_STRING, text) if conn.problem else b""
            self.write(conn, packet(_CONNACK, 0, body + vbi(len(p)) + p))
        else:
            self.write(conn, bytes((0x20, 2, 0, rc3)))
        self.close(conn, False)

    def authenticate(self, user, pw):
        users = self.cfg["users"]
        if user is None:
            return bool(self.cfg["allow_anonymous"])
        want = users.get(user)
        if want is None:
            # a user name the profile does not know is only accepted when
            # anonymous access is allowed and no users are configured
            return bool(self.cfg["allow_anonymous"]) and not users
        if pw is None:
            return False
        if want.startswith("sha256:"):
            import hashlib
            import binascii
            return binascii.hexlify(hashlib.sha256(pw).digest()).decode() == want[7:].lower()
        return pw == want.encode()

    def new_client_id(self):
        self._next_id += 1
        return "edgebroker-%d-%d" % (self._next_id, _ticks_ms() & 0xFFFF)

    def new_session(self, cid, ver):
        s = Session(cid, ver)
        self.sessions[cid] = s
        return s

    def bound_offline(self):
        """max_sessions bounds the sessions kept without a connection: past
        it, the one disconnected longest is discarded (documented policy)."""
        offline = 0
        oldest = None
        for s in self.sessions.values():
            if s.conn is None:
                offline += 1
                if oldest is None or s.gone < oldest.gone:
                    oldest = s
        if offline > self.cfg["max_sessions"] and oldest is not None:
            self.refuse("max_sessions", "session %s discarded", oldest.cid)
            self.end_session(oldest)

    def end_session(self, sess):
        """The session ends (4.1): subscriptions and queues go; a will still
        waiting for its delay is published now (3.1.2.5)."""
        for f in sess.subs:
            self.tree.remove(f, sess)
        sess.subs = {}
        sess.queue = []
        sess.inflight = []
        self.drop_rq(sess)
        if self.sessions.get(sess.cid) is sess:
            del self.sessions[sess.cid]
        for w in self.wills:
            if w[1] is sess:
                self.wills.remove(w)
                self.publish(w[2], w[3], None)
                break

    def cancel_will(self, sess):
        for w in self.wills:
            if w[1] is sess:
                self.wills.remove(w)
                return

    # ------------------------------------------------------------ PUBLISH
    def make_msg(self, topic, payload, qos, fwd, exp_interval):
        exp = self.now_s + exp_interval if exp_interval else 0
        return (topic, topic.encode(), payload, qos, fwd, exp, 1 if exp_interval else 0)

    def on_publish(self, conn, flags, b, i, end):
        qos = flags >> 1 & 3
        dup = flags & 8
        retain = flags & 1
        if qos == 3:
            raise MqttError(_RC_MALFORMED, "QoS 3")  # MQTT-3.3.1-4
        if qos == 0 and dup:
            raise MqttError(_RC_MALFORMED, "DUP set on QoS 0")  # MQTT-3.3.1-2
        tb, i = read_bin(b, i, end)
        topic = check_utf8(tb)
        pid = 0
        if qos:
            pid, i = read_u16(b, i, end)
            if pid == 0:
                raise MqttError(_RC_PROTOCOL, "packet identifier 0")  # MQTT-2.2.1-3
        fwd = b""
        exp = 0
        if conn.ver == 5:
            props, fwd, i = read_props(b, i, end)
            if props:
                if _P_SUB_ID in props:
                    raise MqttError(_RC_PROTOCOL, "Subscription Identifier from a client")
                alias = props.get(_P_ALIAS)
                if alias is not None:
                    topic = self.resolve_alias(conn, alias, topic)
                    tb = None
                exp = props.get(_P_MESSAGE_EXPIRY, 0)
                rt = props.get(_P_RESPONSE_TOPIC)
                if rt is not None and not valid_topic_name(rt):
                    raise MqttError(_RC_PROTOCOL, "wildcard in Response Topic")
        if not valid_topic_name(topic):
            raise MqttError(_RC_BAD_TOPIC, "invalid topic name")  # MQTT-3.3.2-2
        cfg = self.cfg
        if len(tb if tb is not None else topic.encode()) > cfg["max_topic_length"] \
                or topic.count("/") >= cfg["max_topic_levels"]:
            raise MqttError(_RC_BAD_TOPIC, "topic over max_topic_length or max_topic_levels")
        if qos > cfg["maximum_qos"]:
            raise MqttError(_RC_QOS_UNSUPPORTED, "QoS above Maximum QoS")  # MQTT-3.2.2-11
        if retain and not cfg["retain_available"]:
            raise MqttError(_RC_RETAIN_UNSUPPORTED, "retain not available")  # MQTT-3.2.2-14
        payload = bytes(b[i:end])
        self.n_in += 1
        sess = conn.sess
        if topic[:4] == "$SYS":
            # $SYS belongs to the broker: a client cannot publish there. 5.0
            # refuses with 0x87, which ends a QoS 2 exchange at PUBREC (4.3.3)
            self.refuse("sys_publish", "client %s published to %s", conn.cid, topic)
            if qos:
                body = u16(pid) + (b"\x87" if conn.ver == 5 else b"")
                self.send_ack(conn, bytes((0x40 if qos == 1 else 0x50, len(body))) + body)
            return
        if qos == 2:
            in2 = sess.in2
            if pid in in2:
                # MQTT-4.3.3-10: a resent PUBLISH (DUP) before PUBREL is not
                # delivered again; answer with PUBREC once more
                self.send_ack(conn, bytes((0x50, 2)) + u16(pid))
                return
            if len(in2) >= self.max_inflight:
                raise MqttError(_RC_RECV_MAX, "Receive Maximum exceeded")  # MQTT-3.3.4-9
            in2[pid] = 1
        msg = (topic, tb if tb is not None else topic.encode(), payload, qos, fwd,
               self.now_s + exp if exp else 0, 1 if exp else 0)
        wait = self.publish(msg, retain, sess)
        if qos:
            ack = bytes((0x40 if qos == 1 else 0x50, 2)) + u16(pid)
            if wait and conn.defer is None:
                conn.defer = []
                self.deferred.append(conn)
            self.send_ack(conn, ack)

    def resolve_alias(self, conn, alias, topic):
        # 3.3.2.3.4: alias 0 or above our Topic Alias Maximum is an error
        if alias == 0 or alias > self.cfg["topic_alias_maximum"]:
            raise MqttError(_RC_ALIAS_INVALID, "Topic Alias invalid")
        al = conn.aliases
        if topic:
            if al is None:
                al = conn.aliases = {}
            al[alias] = topic
            return topic
        t = None if al is None else al.get(alias)
        if t is None:
            raise MqttError(_RC_PROTOCOL, "unknown Topic Alias")
        return t

    def publish(self, msg, retain, origin):
        """Stores (if retained) and routes one message. Returns True when an
        acknowledgement must wait for the store's commit (durability)."""
        wait = False
        if retain:
            wait = self.retain(msg)
        topic = msg[_M_TOPIC]
        levels = topic.split("/")
        matched = None
        for subs in self.tree.match(levels, topic[:1] == "$"):
            for sess in subs:
                opts, sid = subs[sess]
                if opts & 4 and sess is origin:  # No Local (MQTT-3.8.3-3)
                    continue
                if matched is None:
                    matched = {}
                cur = matched.get(sess)
                if cur is None:
                    matched[sess] = [opts & 3, opts & 8, [sid] if sid else None]
                else:
                    if opts & 3 > cur[0]:
                        cur[0] = opts & 3
                    cur[1] |= opts & 8
                    if sid:
                        if cur[2] is None:
                            cur[2] = [sid]
                        else:
                            cur[2].append(sid)
        if matched is not None:
            # MQTT-3.3.4-2: one copy per session at the highest granted QoS,
            # carrying every matching Subscription Identifier (MQTT-3.3.4-3)
            for sess in matched:
                q, rap, sids = matched[sess]
                # 3.1.1 MQTT-3.3.1-9 / 5.0 MQTT-3.3.1-12/13: RETAIN is kept
                # on forwarding only with Retain As Publish
                self.deliver(sess, msg, q, 1 if (retain and rap) else 0, sids)
        return wait

    def retain(self, msg):
        wait = self._retain(msg)
        if wait:
            self.sdirty = True
        return wait

    def unstore(self, topic):
        """Drops a topic's retained message; True if a durable store changed
        (then the acknowledgement waits for the commit)."""
        return self.store.delete(topic) and self.store.durable

    def _retain(self, msg):
        """Rules S1-S4 and L2-L4 of docs: store, replace or delete."""
        topic = msg[_M_TOPIC]
        if topic[:4] == "$SYS":
            return False  # made on demand by sys_msgs(), never stored
        store = self.store
        payload = msg[_M_PAYLOAD]
        if not payload:
            # S3 (MQTT-3.3.1-6/7): empty payload deletes, is never stored
            return self.unstore(topic)
        cfg = self.cfg
        if len(payload) > cfg["max_payload_size"]:
            # L3: forwarded but not stored, and the older value goes too
            self.refuse("retained_too_large", "%s (%d bytes)", topic, len(payload))
            return self.unstore(topic)
        old = store.get(topic)
        size = msg_size(msg)
        budget = cfg["store_budget_bytes"]
        if old is None:
            cap = cfg["max_retained_messages"]
            if (cap and store.count >= cap) or (budget and store.nbytes + size > budget):
                # L2/L4: a new topic is forwarded but not stored
                self.refuse("retained_full", "%s not stored", topic)
                return False
        elif budget and store.nbytes - msg_size(old) + size > budget:
            self.refuse("retained_full", "%s not stored", topic)
            return self.unstore(topic)
        if msg[_M_EXP] == 0 and cfg["expiry_interval"]:
            # E3: the board's default lifetime for messages without their own
            m = msg
            msg = (m[0], m[1], m[2], m[3], m[4], self.now_s + cfg["expiry_interval"], 0)
        if old is None and _mem_free is not None:
            # The heap reserve is for connections. gc.mem_free() walks the
            # whole allocation table (about 1 ms on a 16 MB heap), so it is
            # asked every 16th new topic; the MemoryError catch below is the
            # backstop in between.
            self._puts += 1
            if self._puts & 15 == 0 and _mem_free() < cfg["heap_reserve"]:
                gc.collect()
                if _mem_free() < cfg["heap_reserve"]:
                    self.refuse("retained_heap", "%s not stored: free heap below heap_reserve",
                                topic)
                    self._puts -= 1  # ask again at the next new topic
                    return False
        try:
            store.put(topic, msg)
        except MemoryError:
            gc.collect()
            self.refuse("retained_heap", "%s not stored: MemoryError", topic)
            return self.unstore(topic)
        return store.durable

    # ------------------------------------------------------------ delivery
    def deliver(self, sess, msg, qos, retain, sids):
        if msg[_M_QOS] < qos:
            qos = msg[_M_QOS]
        conn = sess.conn
        if conn is None:
            if qos:
                self.enqueue(sess, [msg, qos, retain, sids])
            return
        if qos == 0:
            if conn.out_len() > self.max_outbuf:
                # a slow reader loses QoS 0 messages, counted; others unaffected
                self.n_dropped += 1
                self.refuse("slow_reader", "client %s", conn.cid)
                return
            self.encode_publish(conn, msg, 0, retain, 0, sids, False)
            return
        if sess.queue or len(sess.inflight) >= conn.window or conn.out_len() > self.max_outbuf:
            self.enqueue(sess, [msg, qos, retain, sids])
            return
        self.send_inflight(sess, conn, msg, qos, retain, sids)

    def enqueue(self, sess, ent):
        q = sess.queue
        if len(q) >= self.max_queued:
            # documented policy: the oldest queued message is dropped
            q.pop(0)
            self.n_dropped += 1
            self.refuse("queue_full", "session %s", sess.cid)
        q.append(ent)

    def send_inflight(self, sess, conn, msg, qos, retain, sids):
        pid = self.next_pid(sess)
        if not self.encode_publish(conn, msg, qos, retain, pid, sids, False):
            return  # too large for the client or expired: treated as done
        sess.inflight.append([pid, msg, qos, retain, sids, False])

    def next_pid(self, sess):
        pid = sess.pid
        inflight = sess.inflight
        while True:
            pid = pid + 1 if pid < 65535 else 1
            for e in inflight:
                if e[0] == pid:
                    break
            else:
                sess.pid = pid
                return pid

    def encode_publish(self, conn, msg, qos, retain, pid, sids, dup):
        """Writes one PUBLISH straight into the connection's buffer. Returns
        False if it was not sent: expired (E1, MQTT-3.3.2-5) or larger than
        the client's Maximum Packet Size (MQTT-3.1.2-25, D8)."""
        if conn.closed:
            return False
        exp = msg[_M_EXP]
        tb = msg[_M_TB]
        payload = msg[_M_PAYLOAD]
        props = None
        if exp:
            left = exp - self.now_s
            if left <= 0:
                self.n_dropped += 1
                return False
        if conn.ver == 5:
            props = msg[_M_PROPS]
            if sids:
                for s in sids:
                    props = props + bytes((_P_SUB_ID,)) + vbi(s)
            if exp and msg[_M_OWNEXP]:
                # MQTT-3.3.2-6: the interval left after waiting here
                props = props + prop_u32(_P_MESSAGE_EXPIRY, int(left + 0.999))
            plen = len(props)
            rl = 2 + len(tb) + (2 if qos else 0) + len(vbi(plen)) + plen + len(payload)
        else:
            rl = 2 + len(tb) + (2 if qos else 0) + len(payload)
        if rl + 5 > conn.maxpkt and rl + len(vbi(rl)) + 1 > conn.maxpkt:
            self.refuse("client_max_packet", "client %s", conn.cid)
            return False
        o = self.outbuf(conn)
        # straight into the connection's buffer: no packet built on the side
        o.append(0x30 | (8 if dup else 0) | qos << 1 | retain)
        o.extend(vbi(rl))
        n = len(tb)
        o.append(n >> 8)
        o.append(n & 0xFF)
        o.extend(tb)
        if qos:
            o.append(pid >> 8)
            o.append(pid & 0xFF)
        if props is not None:
            o.extend(vbi(len(props)))
            o.extend(props)
        o.extend(payload)
        self.n_out += 1
        return True

    def pump(self, sess):
        """Lets waiting messages out while the window and the buffer allow:
        the queue first (live traffic), then pending retained deliveries,
        which are read from the store's iterator one message at a time (D9)."""
        conn = sess.conn
        if conn is None or conn.closed:
            return
        q = sess.queue
        inflight = sess.inflight
        limit = self.max_outbuf
        while q and len(inflight) < conn.window and conn.out_len() <= limit:
            msg, qos, retain, sids = q.pop(0)
            self.send_inflight(sess, conn, msg, qos, retain, sids)
        rq = sess.rq
        while rq and conn.out_len() <= limit and not q:
            ent = rq[0]
            m = ent[4]
            if m is None:
                try:
                    m = next(ent[0])
                except StopIteration:
                    rq.pop(0)[0].close()
                    continue
                if m[_M_EXP] and m[_M_EXP] <= self.now_s:
                    continue  # its lifetime has passed (E1)
            qos = m[_M_QOS] if m[_M_QOS] < ent[1] & 3 else ent[1] & 3
            sids = [ent[2]] if ent[2] else None
            if qos:
                if len(inflight) >= conn.window:
                    # waits here for the window, outside the bounded queue,
                    # so live traffic can never push it out (D9)
                    ent[4] = m
                    return
                self.send_inflight(sess, conn, m, qos, 1, sids)
            else:
                self.encode_publish(conn, m, 0, 1, 0, sids, False)
            ent[4] = None
        # with rq left, delivery resumes when flush() has drained the buffer

    def on_ack(self, conn, ptype, b, i, end):
        pid, i = read_u16(b, i, end)
        rc = b[i] if i < end else 0
        sess = conn.sess
        if ptype == _PUBREL:
            # MQTT-4.3.3-11: release the packet id, answer PUBCOMP
            if sess.in2.pop(pid, None) is None and conn.ver == 5:
                self.write(conn, bytes((0x70, 3)) + u16(pid) + bytes((_RC_PID_NOT_FOUND,)))
            else:
                self.write(conn, bytes((0x70, 2)) + u16(pid))
            return
        inflight = sess.inflight
        for k in range(len(inflight)):
            e = inflight[k]
            if e[0] == pid:
                break
        else:
            if ptype == _PUBREC:
                self.write(conn, bytes((0x62, 3 if conn.ver == 5 else 2)) + u16(pid)
                           + (bytes((_RC_PID_NOT_FOUND,)) if conn.ver == 5 else b""))
            return
        if ptype == _PUBACK:
            if e[2] != 1:
                raise MqttError(_RC_PROTOCOL, "_PUBACK for a QoS 2 message")
            inflight.pop(k)
        elif ptype == _PUBREC:
            if e[2] != 2:
                raise MqttError(_RC_PROTOCOL, "_PUBREC for a QoS 1 message")
            if rc >= 0x80:
                inflight.pop(k)  # 4.3.3: an error PUBREC ends the exchange
            else:
                e[5] = True
                e[1] = None  # the message itself is no longer needed
                self.write(conn, bytes((0x62, 2)) + u16(pid))
                return
        else:  # PUBCOMP
            if not e[5]:
                raise MqttError(_RC_PROTOCOL, "_PUBCOMP before _PUBREL")
            inflight.pop(k)
        self.pump(sess)

    # ---------------------------------------------------------- SUBSCRIBE
    def on_subscribe(self, conn, b, i, end):
        pid, i = read_u16(b, i, end)
        if pid == 0:
            raise MqttError(_RC_PROTOCOL, "packet identifier 0")
        v5 = conn.ver == 5
        sid = 0
        if v5:
            props, _, i = read_props(b, i, end)
            sid = props.get(_P_SUB_ID, 0)
            if _P_SUB_ID in props and sid == 0:
                raise MqttError(_RC_PROTOCOL, "Subscription Identifier 0")
        if i >= end:
            raise MqttError(_RC_PROTOCOL, "_SUBSCRIBE with no filters")  # MQTT-3.8.3-3
        sess = conn.sess
        cfg = self.cfg
        codes = bytearray()
        todo = []
        why = None
        while i < end:
            filt, i = read_str(b, i, end)
            _need(i, 1, end)
            opts = b[i]
            i += 1
            if v5:
                if opts & 0xC0:
                    raise MqttError(_RC_MALFORMED, "reserved subscription option bits")
                if opts >> 4 & 3 == 3:
                    raise MqttError(_RC_PROTOCOL, "Retain Handling 3")
            elif opts & 0xFC:
                raise MqttError(_RC_MALFORMED, "reserved subscription option bits")  # 3.1.1 MQTT-3.8.3-4
            if opts & 3 == 3:
                raise MqttError(_RC_MALFORMED, "QoS 3 in _SUBSCRIBE")
            if filt[:7] == "$share/":
                codes.append(_RC_SHARED_UNSUPPORTED if v5 else 0x80)
                why = "shared subscriptions not supported"
                continue
            if not valid_filter(filt) or len(filt.encode()) > cfg["max_topic_length"] \
                    or filt.count("/") >= cfg["max_topic_levels"]:
                codes.append(_RC_BAD_FILTER if v5 else 0x80)
                why = "invalid topic filter"
                continue
            existed = filt in sess.subs
            if not existed and len(sess.subs) >= cfg["max_subscriptions"]:
                self.refuse("max_subscriptions", "client %s", conn.cid)
                codes.append(_RC_QUOTA if v5 else 0x80)
                why = "max_subscriptions reached"
                continue
            granted = opts & 3
            if granted > cfg["maximum_qos"]:
                granted = cfg["maximum_qos"]
            opts = opts & 0xFC | granted
            # MQTT-3.8.4-3: a repeated filter replaces the subscription
            sess.subs[filt] = (opts, sid)
            self.tree.add(filt, sess, opts, sid)
            codes.append(granted)
            rh = opts >> 4 & 3
            if cfg["retain_available"] and (rh == 0 or (rh == 1 and not existed)):
                todo.append((filt, opts, sid))
        p = b""
        if v5:
            p = prop_str(_P_REASON_STRING, why) if why and conn.problem else b""
            p = vbi(len(p)) + p
        self.write(conn, packet(_SUBACK, 0, u16(pid) + p + codes))
        for filt, opts, sid in todo:
            # D1, D4, D5: matching retained messages follow the SUBACK, paced
            flevels = filt.split("/")
            if flevels[0] == "$SYS":
                it = self.sys_iter(flevels)
            else:
                it = self.store.match(flevels)
            # a repeated filter restarts its delivery (D5): no duplicates
            self.drop_rq(sess, filt)
            sess.rq.append([it, opts, sid, filt, None])
        if todo:
            self.pump(sess)

    def drop_rq(self, sess, filt=None):
        """Ends pending retained deliveries: all of them, or one filter's."""
        keep = []
        for ent in sess.rq:
            if filt is None or ent[3] == filt:
                ent[0].close()
            else:
                keep.append(ent)
        sess.rq = keep

    def sys_iter(self, flevels):
        for m in self.sys_msgs():
            if topic_matches(flevels, m[_M_TOPIC]):
                yield m

    def on_unsubscribe(self, conn, b, i, end):
        pid, i = read_u16(b, i, end)
        if pid == 0:
            raise MqttError(_RC_PROTOCOL, "packet identifier 0")
        v5 = conn.ver == 5
        if v5:
            _, _, i = read_props(b, i, end)
        if i >= end:
            raise MqttError(_RC_PROTOCOL, "_UNSUBSCRIBE with no filters")  # MQTT-3.10.3-2
        sess = conn.sess
        codes = bytearray()
        while i < end:
            filt, i = read_str(b, i, end)
            if sess.subs.pop(filt, None) is not None:
                self.tree.remove(filt, sess)
                # MQTT-3.10.4-2: no new messages for it, retained included
                self.drop_rq(sess, filt)
                codes.append(_RC_SUCCESS)
            else:
                codes.append(_RC_NO_SUBSCRIPTION)
        if v5:
            self.write(conn, packet(_UNSUBACK, 0, u16(pid) + b"\x00" + codes))
        else:
            self.write(conn, bytes((0xB0, 2)) + u16(pid))

    # --------------------------------------------------------- DISCONNECT
    def on_disconnect(self, conn, b, i, end):
        rc = 0
        if conn.ver == 5 and i < end:
            rc = b[i]
            i += 1
            if i < end:
                props, _, i = read_props(b, i, end)
                se = props.get(_P_SESSION_EXPIRY)
                if se is not None:
                    if conn.sess.expiry == 0 and se:
                        # MQTT-3.14.2-2
                        raise MqttError(_RC_PROTOCOL, "Session Expiry set after 0")
                    conn.sess.expiry = min(se, self.cfg["max_session_expiry"])
        # MQTT-3.14.4-3: a normal DISCONNECT discards the will; 0x04 keeps it
        self.close(conn, rc == _RC_DISCONNECT_WITH_WILL)

    # -------------------------------------------------------------- close
    def close(self, conn, will):
        if conn.closed:
            return
        conn.closed = True
        if conn.out:
            try:  # best effort for a final CONNACK or DISCONNECT
                conn.sock.send(conn.out)
            except OSError:
                pass
        self.conns.pop(conn.key, None)
        try:
            self.poller.unregister(conn.sock)
        except (OSError, ValueError, KeyError):
            pass
        try:
            conn.sock.close()
        except OSError:
            pass
        conn.out = None
        conn.pend = None
        sess = conn.sess
        if sess is None or sess.conn is not conn:
            return
        self.connected -= 1
        sess.conn = None
        # a persistent session keeps its pending retained deliveries: they
        # go on when it reconnects (D1, D9); end_session() drops them
        sess.gone = self.now_s
        w = conn.will
        conn.will = None
        if sess.expiry == 0:
            self.end_session(sess)
        else:
            self.bound_offline()
        if will and w is not None:
            msg, retain, delay = w
            if delay and sess.expiry and self.sessions.get(sess.cid) is sess:
                # 5.0 3.1.3.2.2: published after the Will Delay Interval or
                # when the session ends, whichever comes first
                self.wills.append([self.now_s + min(delay, sess.expiry), sess, msg, retain])
            else:
                self.publish(msg, retain, None)
        self.log("debug", "closed %s", conn.cid)

    # ------------------------------------------------------------ 9. loops
    def flush(self, conn):
        o = conn.out
        if not o:
            return
        try:
            n = conn.sock.send(o)
        except OSError as e:
            if e.args[0] in _EAGAIN:
                n = 0
            else:
                self.close(conn, True)
                return
        if n >= len(o):
            conn.out = None
            if conn.pollout:
                conn.pollout = False
                self.poller.modify(conn.sock, select.POLLIN)
            sess = conn.sess
            if sess is not None and sess.rq and sess not in self.busy:
                self.busy.append(sess)  # drained: paced delivery goes on
            return
        if n:
            o[0:n] = b""
        if len(o) > 4 * self.max_outbuf + self.max_packet:
            # a client that does not read its acks and pings is cut off
            self.refuse("slow_reader", "client %s not reading, closed", conn.cid)
            self.close(conn, True)
            return
        if not conn.pollout:
            conn.pollout = True
            self.poller.modify(conn.sock, select.POLLIN | select.POLLOUT)

    def on_readable(self, conn):
        mv = self.rmv
        try:
            n = _recv_into(conn.sock, mv)
        except OSError:
            n = 0
        if n < 0:
            return
        if n == 0:
            if conn.pend is not None:
                self.log("info", "client %s closed mid-packet (%d bytes)",
                         conn.cid or "?", len(conn.pend))
            self.close(conn, True)  # abnormal close: will published
            return
        self.feed(conn, mv, n)

    def accept(self):
        """Own accept loop: MicroPython's start_server task dies for good on
        one MemoryError (design.md); here a failure closes that one socket,
        collects, and the next accept goes on."""
        for _ in range(16):
            try:
                s, _a = self.lsock.accept()
            except OSError as e:
                if e.args[0] in _EMFILE:
                    self.refuse("sockets", "no free socket, accept paused")
                    self._accept_pause = self.now_s + 0.5
                    self.poller.unregister(self.lsock)
                return
            except MemoryError:
                gc.collect()
                self.refuse("memory", "MemoryError in accept")
                return
            try:
                s.setblocking(False)
                try:
                    # Nagle + the client's delayed ACK would hold a lone
                    # small packet (a SUBACK's first retained message) ~40 ms
                    s.setsockopt(_IPPROTO_TCP, _TCP_NODELAY, 1)
                except OSError:
                    pass
                k = _key(s)
                c = Conn(s, k, self.now_s)
                self.conns[k] = c
                self.poller.register(s, select.POLLIN)
            except MemoryError:
                try:
                    s.close()
                except OSError:
                    pass
                gc.collect()
                self.refuse("memory", "MemoryError for a new connection")

    def listen(self, host, port):
        ai = socket.getaddrinfo(host, port)[0]
        s = socket.socket(ai[0], socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(ai[-1])
        s.listen(self.cfg["backlog"])
        s.setblocking(False)
        self.lsock = s
        self.poller = select.poll()
        self.poller.register(s, select.POLLIN)
        if _gc_threshold is not None:
            # MicroPython collects only when an allocation fails, so between
            # collections the allocator walks the whole heap and leaves the
            # long-lived small objects (one per retained message) sprinkled
            # over all of it: then a 3 KB block cannot be had with most of
            # the heap free (measured: 12.8 MB free, largest hole 1 KB).
            # Collecting after 1/16 of the heap keeps allocation low and the
            # rest of the heap in one piece.
            _gc_threshold(max(32768, _mem_free() // 16))
        self.rmv = memoryview(bytearray(self.cfg["io_chunk"]))
        self.now_s = self.now()
        self.started = self.now_s
        self._last_tick = self.now_s
        self._last_sys = self.now_s - self.cfg["sys_interval"]
        self.running = True

    def serve(self, on_tick=None):
        """Runs until stop() or KeyboardInterrupt. on_tick, if given, is
        called about once a second (firmware feeds its watchdog there)."""
        lkey = _key(self.lsock)
        poller = self.poller
        conns = self.conns
        try:
            while self.running:
                timeout = 0 if self.busy else 200
                for ev in _poll(poller, timeout):
                    k = ev[0]
                    self.now_s = self.now()
                    if k == lkey:
                        self.accept()
                        continue
                    conn = conns.get(k)
                    if conn is None:
                        continue
                    try:
                        e = ev[1]
                        if e & select.POLLOUT:
                            self.flush(conn)
                            if not conn.out and conn.sess is not None:
                                self.pump(conn.sess)
                        if e & (select.POLLIN | select.POLLHUP | select.POLLERR) and not conn.closed:
                            self.on_readable(conn)
                    except MqttError as err:
                        self.protocol_error(conn, err)
                    except MemoryError:
                        self.close(conn, True)
                        gc.collect()
                        self.refuse("memory", "MemoryError serving %s", conn.cid)
                    except Exception as err:  # a bug must not stop the broker
                        self.log("error", "internal error with %s: %r", conn.cid, err)
                        _print_exc(err)
                        self.close(conn, True)
                self.now_s = self.now()
                try:
                    self.turn(on_tick)
                except MemoryError:
                    gc.collect()
                    self.refuse("memory", "MemoryError between packets")
                except Exception as err:  # a bug must not stop the broker
                    self.log("error", "internal error: %r", err)
                    _print_exc(err)
        finally:
            self.shutdown()

    def turn(self, on_tick):
        """The end of a loop turn: paced deliveries, the group commit and the
        acks that waited for it, flushing, and the once-a-second tick."""
        if self.busy:
            busy = self.busy
            self.busy = []
            for sess in busy:
                self.pump(sess)
        if self.sdirty:
            # group commit: one per loop turn, then the acks that waited for
            # it (durability: never acknowledged earlier)
            self.sdirty = False
            try:
                self.store.commit()
            except (OSError, MemoryError) as err:
                self.store_failed(err)
        if self.deferred:
            for conn in self.deferred:
                d = conn.defer
                conn.defer = None
                for a in d:
                    self.write(conn, a)
            self.deferred = []
        if self.dirty:
            dirty = self.dirty
            self.dirty = []
            for conn in dirty:
                if not conn.closed and conn.out:
                    self.flush(conn)
        if self.now_s - self._last_tick >= 1:
            self.tick()
            if on_tick is not None:
                on_tick(self)

    def store_failed(self, err):
        """A commit failed (flash full, I/O error): what it held is not
        durable, so its acknowledgements are never sent. The clients that
        wait for them are disconnected (5.0: 0x80) and resend on reconnect
        (MQTT-4.4.0-1); the broker goes on."""
        self.log("error", "retained store commit failed: %r", err)
        self.refuse("store_io", "commit failed")
        for conn in self.deferred:
            conn.defer = None
            self.disconnect(conn, _RC_UNSPECIFIED, "retained store write failed")
        self.deferred = []

    def protocol_error(self, conn, err):
        self.log("info", "client %s: %s (0x%02x)", conn.cid or "?", err.text, err.code)
        self.refuse("protocol", "%s", err.text)
        self.disconnect(conn, err.code, err.text)

    def tick(self):
        """Once a second: keep alive, connect timeout, delayed wills, session
        and retained expiry, $SYS."""
        now = self.now_s
        self._last_tick = now
        if self._accept_pause and now >= self._accept_pause:
            self._accept_pause = 0
            self.poller.register(self.lsock, select.POLLIN)
        ct = self.cfg["connect_timeout"]
        for conn in list(self.conns.values()):
            if conn.sess is None:
                if now - conn.born > ct:
                    self.close(conn, False)
            elif conn.ka and now - conn.last > conn.ka * 1.5:
                # MQTT-3.1.2-22: 1.5 times the Keep Alive without a packet
                self.log("info", "client %s keep alive timeout", conn.cid)
                self.disconnect(conn, _RC_KEEPALIVE, "keep alive timeout")
        if self.wills:
            for w in list(self.wills):
                if w[0] <= now:
                    self.wills.remove(w)
                    self.publish(w[2], w[3], None)
        for sess in list(self.sessions.values()):
            if sess.conn is None and sess.expiry != 0xFFFFFFFF and now - sess.gone >= sess.expiry:
                self.end_session(sess)
            elif sess.queue and sess.conn is None:
                q = sess.queue
                while q and q[0][0][_M_EXP] and q[0][0][_M_EXP] <= now:
                    q.pop(0)
        if self.store.expire(now, 64) and self.store.durable:
            self.sdirty = True
        si = self.cfg["sys_interval"]
        if si and now - self._last_sys >= si:
            self._last_sys = now
            self.publish_sys()

    # ------------------------------------------------------------ 10. stats
    def publish_sys(self):
        # Live $SYS subscribers get fresh values every sys_interval; a new
        # one gets them at SUBSCRIBE, RETAIN=1 (sys_iter). They are made on
        # demand, so an idle broker holds no $SYS messages in its heap.
        if self.tree.root[0].get("$SYS") is None:
            if _mem_free is not None:
                gc.collect()  # a calm point all the same
            return
        for m in self.sys_msgs():
            self.publish(m, 1, None)

    def sys_msgs(self):
        st = self.store
        vals = [
            ("version", VERSION),
            ("uptime", int(self.now_s - self.started)),
            ("clients/connected", self.connected),
            ("messages/received", self.n_in),
            ("messages/sent", self.n_out),
            ("messages/dropped", self.n_dropped),
            ("retained/count", st.count),
            ("retained/bytes", st.nbytes),
        ]
        for cause in self.refusals:
            vals.append(("refusals/" + cause, self.refusals[cause]))
        if _mem_free is not None:
            gc.collect()  # a calm point: once per sys_interval
            vals.append(("heap/free", _mem_free()))
            vals.append(("heap/alloc", _mem_alloc()))
        for name, v in vals:
            yield self.make_msg("$SYS/broker/" + name, str(v).encode(), 0, b"", 0)

    def stop(self):
        self.running = False

    def shutdown(self):
        for conn in list(self.conns.values()):
            self.close(conn, False)
        for sess in self.sessions.values():
            self.drop_rq(sess)  # leave no generator half-run at exit
        try:
            self.poller.unregister(self.lsock)
        except (OSError, ValueError, KeyError, AttributeError):
            pass
        if self.lsock is not None:
            self.lsock.close()
            self.lsock = None
        self.store.close()


# --------------------------------------------------------------- 11. main
def _parse_value(v):
    import json
    try:
        return json.loads(v)
    except ValueError:
        return v


def main(argv):
    """Host build and emulator: `edgebroker.py --board F --port N
    [--bind A] [--data-dir D] [--set key=value]...` (docs/contract.md)."""
    import json
    board = None
    port = 1883
    bind = "127.0.0.1"
    data_dir = None
    sets = []
    i = 1
    while i < len(argv):
        a = argv[i]
        v = argv[i + 1] if i + 1 < len(argv) else None
        if v is None:
            print("edgebroker: error: %s needs a value" % a, file=sys.stderr)
            sys.exit(2)
        if a == "--board":
            board = v
        elif a == "--port":
            port = int(v)
        elif a == "--bind":
            bind = v
        elif a == "--data-dir":
            data_dir = v
        elif a == "--set":
            if "=" not in v:
                print("edgebroker: error: --set needs key=value", file=sys.stderr)
                sys.exit(2)
            sets.append(v)
        else:
            print("edgebroker: error: unknown option %s" % a, file=sys.stderr)
            sys.exit(2)
        i += 2
    profile = {}
    if board is not None:
        with open(board) as f:
            profile = json.load(f)
    for kv in sets:
        k, v = kv.split("=", 1)
        profile[k] = _parse_value(v)
    cfg = limits(profile)
    profile = None  # the board facts in it are the tools' business
    clock = MonoClock()
    if data_dir:
        try:
            os.mkdir(data_dir)
        except OSError:
            pass  # exists
    lvl = _LEVELS.get(cfg["log_level"], 20)

    def log(level, text):
        if _LEVELS[level] >= lvl:
            print("edgebroker: %s %s" % (level, text), file=sys.stderr)
    # the store reports recovery (torn tail, corrupt records, moved aside)
    store = open_store(cfg, data_dir, clock, _wallclock, log)
    broker = Broker(cfg, store, clock)
    _install_signals()
    broker.listen(bind, port)
    if _mem_alloc is not None:
        gc.collect()
        log("info", "heap after start: %d allocated, %d free" % (_mem_alloc(), _mem_free()))
    print("edgebroker listening on %s:%d (%s)" % (bind, port, _IMPL))
    try:
        sys.stdout.flush()
    except AttributeError:
        pass
    try:
        broker.serve()
    except KeyboardInterrupt:
        pass
    except MemoryError:
        # The unix port raises KeyboardInterrupt from its signal handler; one
        # that lands inside a garbage collection leaves the heap locked, and
        # shutdown cannot allocate. What was acknowledged is on flash already
        # (acks wait for commit), so stop here without more work.
        return
    gc.collect()
    print("edgebroker: info stopped", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv)

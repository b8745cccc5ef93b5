# edgebridge: edgebroker's bridge to an upstream (cloud) broker, with
# store-and-forward on flash. Loaded by edgebroker.start() only when the
# profile's `bridges` list is not empty; nothing happens at import.
#
# Sections:
#   1. compat       files, clocks, the few record helpers (own copy: the queue
#                   file is not the retained store's)
#   2. config       a bridge item checked, ValueError naming bridges[i].key
#   3. Queue        the append-only flash log of outbound QoS >= 1 messages
#   4. Bridge       engine sink (put/commit), topic mapping, the upstream
#                   MQTT 3.1.1/5.0 client driven by asyncio, status
#   5. attach()     what edgebroker.start() calls
#
# ------------------------------------------------------------------ FORMAT
# <data_dir>/bridge-<name>.ebrq, big-endian, edgestore's conventions:
#   header   45 42 52 51 "EBRQ" | 01 version | flags (1: 0x01 the "K" rule
#            below holds; files written before it have 00, and a reader
#            that knows only the version still reads them) | 00 00 reserved
#   records  type (1) | length (4) | body | crc (4, CRC-32 of type+length+body)
#     "M" 0x4D message: seq (4, its number: the upstream packet id is
#              seq % 65000 + 1, the same in every run) |
#              qos (1) | flags (1: 0x01 retain, 0x02 has expiry,
#              0x04 `latest` rule: only the newest of its topic is sent) |
#              expiry (4, seconds left at the write) | wall (4, Unix seconds
#              of the write, 0 = clock not set) | topic length (2) |
#              props length (4) | topic (the upstream topic, UTF-8) |
#              props (5.0 forwarded property bytes) | payload (the rest)
#     "K" 0x4B cursor: offset (4) of the first message not acknowledged
#              upstream; every "M" before it was acknowledged (PUBACK, or
#              PUBCOMP for QoS 2) | next seq (4). The last "K" wins. A
#              new file's first commit (the retained sync) ends with one:
#              a file with flag 0x01 and without any "K" is new, its sync is
#              done again (without the flag, a file made before the rule: a
#              backlog never acknowledged has no "K" either, and its sync was
#              done).
#     "R" 0x52 released: seq (4) of a QoS 2 message the upstream answered
#              with PUBREC, written and fsynced before our PUBREL leaves: after
#              a restart it gets PUBREL again, never a second PUBLISH
#              (exactly once with the upstream's persistent session).
#              An empty "R": the upstream lost our session, every earlier
#              "R" is void. Those are also rewritten in place as "r" 0x72
#              (same length), which no reader acts on: a reader older than
#              the empty "R" (a firmware rolled back) would take them as
#              valid and send a PUBREL for a message the upstream never got.
#   Any other type is skipped (length-prefixed). Append only, but for that.
#   A newer version's file is left as it is and its bridge does not run
#   (a firmware rolled back; the newer one reads it again).
#
# ------------------------------------------------------------ DURABILITY
# put() appends to a RAM write buffer while the engine routes a PUBLISH;
# the engine then holds the publisher's PUBACK/PUBREC until commit() has
# written, flushed and fsynced it (group commit, with the retained store).
# Only committed records are sent upstream. The cursor moves when the
# upstream acknowledges; "K" records are written at most every 0.2 s and
# not fsynced: losing one only means resending (at least once, never lost).
# A torn tail (power cut mid-write) is ignored at open and the file is
# rewritten from the cursor before its next write. Compaction streams the
# records from the cursor into <file>.new, fsyncs, renames it over the file,
# when the dead prefix passes compact_ratio of the file (and
# compact_min_bytes): the retained store's rule.
#
# ---------------------------------------------------------------- MEMORY
# RAM holds no message of the backlog: the write buffer (one loop turn of
# appends), the in-flight window (max_inflight entries of 6 small ints) and,
# for `latest` rules, a fixed index of latest_topics (hash, offset) pairs.
import binascii
import os
from struct import pack, unpack_from

import edgebroker as eb

try:
    import socket
except ImportError:  # a port without a network stack (qemu, WebAssembly):
    socket = None  # importable; a bridge needs sockets to connect

try:
    from micropython import const
except ImportError:  # CPython

    def const(x):
        return x


try:
    import random

    def _jitter(n):
        return random.getrandbits(16) * n / 65536
except ImportError:  # a port without random: no jitter beyond the clock

    def _jitter(n):
        return 0


# ---------------------------------------------------------------- 1. compat
_crc32 = binascii.crc32
_PREP_BYTES = eb._PREP_BYTES
_ticks_us = eb._ticks_us
_ticks_diff = eb._ticks_diff
# CPython: fdatasync where there is one (Linux): the data and the file size,
# not the timestamps; MicroPython: flush() syncs (littlefs)
_fsync = getattr(os, "fdatasync", None) or getattr(os, "fsync", None)
_rename = getattr(os, "replace", os.rename)

MAGIC = b"EBRQ"
VERSION = 1
HEADER = b"EBRQ\x01\x01\x00\x00"
T_MSG = const(0x4D)
T_CURSOR = const(0x4B)
T_REL = const(0x52)
T_VOID = const(0x72)  # an "R" made void in place (new_session)
_PIDS = const(65000)  # queue packet ids 1..65000; the link's own above
F_RETAIN = const(1)
F_EXP = const(2)
F_LATEST = const(4)
_HDR = const(8)
_MHEAD = const(20)  # message body bytes before topic, props, payload
_U32 = const(0xFFFFFFFF)
_RA = const(8192)  # read-ahead of the drain (bytes of heap while it runs)
# put() services the link (pump) when this long has passed since it last
# did: the upstream's acknowledgements are answered within about this
# delay while local packets keep the loop busy (see pump)
_PUMP_US = const(30)


def record(rt, body):
    """One record: type, length, body, CRC-32 over all three."""
    h = pack(">BI", rt, len(body))
    return h + body + pack(">I", _crc32(body, _crc32(h)) & _U32)


def decode_view(body):
    """(qos, flags, expiry, wall, topic, props, payload, seq) or None; topic,
    props and payload are views into body (a memoryview): the drain's path,
    which copies them once, into the output buffer."""
    n = len(body)
    if n < _MHEAD:
        return None
    seq, qos, flags, exp, wall, tl, pl = unpack_from(">IBBIIHI", body, 0)
    j = _MHEAD + tl
    if j + pl > n or qos > 2:
        return None
    return qos, flags, exp, wall, body[_MHEAD:j], body[j : j + pl], body[j + pl :], seq


def decode_msg(body):
    """decode_view() with topic, props and payload as bytes."""
    m = decode_view(memoryview(body))
    if m is None:
        return None
    return m[0], m[1], m[2], m[3], bytes(m[4]), bytes(m[5]), bytes(m[6]), m[7]


def read_record(f, pos, size):
    """(type, body, next offset) of the record at pos, ('torn', ...) cases:
    (None, None, pos) for a torn or unreadable tail, (-1, None, next) for a
    record whose CRC is bad but whose length leads somewhere plausible."""
    if size - pos < 9:
        return None, None, pos
    f.seek(pos)
    h = f.read(5)
    if len(h) != 5:
        return None, None, pos
    blen = unpack_from(">I", h, 1)[0]
    end = pos + 9 + blen
    if end > size:
        return None, None, pos
    rest = f.read(blen + 4)
    if len(rest) != blen + 4:
        return None, None, pos
    body = memoryview(rest)[:blen]
    if _crc32(body, _crc32(h)) & _U32 != unpack_from(">I", rest, blen)[0]:
        return -1, None, end
    return h[0], body, end


def _sync(f):
    f.flush()
    if _fsync is not None:
        _fsync(f.fileno())


def _size(path):
    try:
        return os.stat(path)[6]
    except OSError:
        return -1


def _remove(path):
    try:
        os.remove(path)
    except OSError:
        pass


# ---------------------------------------------------------------- 2. config
# Every key of a bridge item: default, then (min, max) or allowed words.
ITEM = {
    "name": (None, None),
    "host": (None, None),
    "port": (1883, (1, 65535)),
    "client_id": ("", None),
    "username": ("", None),
    "password": ("", None),
    "tls": ({}, None),
    "keepalive": (60, (5, 65535)),
    "protocol": (5, (4, 5)),
    "topics": (None, None),
    "queue_bytes": (1048576, (4096, 1073741824)),
    "when_full": ("drop_oldest", ("drop_oldest", "refuse")),
    "replay_rate": (0, (0, 1000000)),
    "max_inflight": (16, (1, 65535)),
    "connect_timeout": (10, (1, 300)),
    "retry_min": (1, (1, 3600)),
    "retry_max": (60, (1, 3600)),
    "attempts_per_minute": (6, (1, 60)),
    "latest_topics": (256, (1, 65535)),
    "status": (True, None),
}
RULE = {
    "pattern": (None, None),
    "direction": ("out", ("out", "in", "both")),
    "qos": (1, (0, 2)),
    "local_prefix": ("", None),
    "remote_prefix": ("", None),
    "mode": ("queue", ("queue", "latest")),
}
TLS_KEYS = ("ca", "cert", "key", "server_hostname")


def _fill(where, item, spec):
    if not isinstance(item, dict):
        raise ValueError("%s: %r is not an object" % (where, item))
    out = {}
    for k in item:
        if k not in spec:
            raise ValueError("%s.%s: unknown key" % (where, k))
    for k in spec:
        d, allowed = spec[k]
        v = item.get(k, d)
        name = "%s.%s" % (where, k)
        if v is None:
            raise ValueError("%s: required" % name)
        if isinstance(d, bool) or k == "status":
            if not isinstance(v, bool):
                raise ValueError("%s: %r is not true or false" % (name, v))
        elif isinstance(d, int) and not isinstance(d, bool):
            if not isinstance(v, int) or isinstance(v, bool) or not allowed[0] <= v <= allowed[1]:
                raise ValueError("%s: %r (allowed %s..%s)" % (name, v, allowed[0], allowed[1]))
        elif isinstance(allowed, tuple) and isinstance(allowed[0], str):
            if v not in allowed:
                raise ValueError("%s: %r (allowed %s)" % (name, v, ", ".join(allowed)))
        elif k in ("tls", "topics"):
            pass
        elif not isinstance(v, str):
            raise ValueError("%s: %r is not a string" % (name, v))
        out[k] = v
    return out


def check(items, board="edgebroker"):
    """The bridges list with defaults filled in; a bad value raises
    ValueError naming bridges[i].key (like every other profile key)."""
    if not isinstance(items, list):
        raise ValueError("bridges: %r is not a list" % (items,))
    out = []
    names = []
    for i, item in enumerate(items):
        w = "bridges[%d]" % i
        c = _fill(w, item, ITEM)
        if (
            c["name"] in names
            or not c["name"]
            or len(c["name"]) > 32
            or not all(ch.isalpha() or ch.isdigit() or ch in "_-" for ch in c["name"])
        ):
            raise ValueError(
                "%s.name: %r (a unique name of letters, digits, _ and -)" % (w, c["name"])
            )
        names.append(c["name"])
        if not c["host"]:
            raise ValueError("%s.host: required" % w)
        if c["retry_min"] > c["retry_max"]:
            raise ValueError(
                "%s.retry_min: %r (at most retry_max %r)" % (w, c["retry_min"], c["retry_max"])
            )
        tls = c["tls"]
        if not isinstance(tls, dict):
            raise ValueError("%s.tls: %r is not an object" % (w, tls))
        for k in tls:
            if k not in TLS_KEYS or not isinstance(tls[k], str):
                raise ValueError("%s.tls.%s: unknown key or not a string" % (w, k))
        if tls and "ca" not in tls:
            raise ValueError("%s.tls.ca: required with TLS" % w)
        rules = c["topics"]
        if not isinstance(rules, list) or not rules or len(rules) > 32:
            raise ValueError("%s.topics: %r (a list of 1..32 rules)" % (w, rules))
        cr = []
        for j, r in enumerate(rules):
            rw = "%s.topics[%d]" % (w, j)
            r = _fill(rw, r, RULE)
            for k in ("local_prefix", "remote_prefix"):
                # a prefix is part of every topic name the rule makes: a
                # wildcard there is a PUBLISH the upstream must refuse
                # (MQTT-3.3.2-2), and the link would go down on it for good
                if "+" in r[k] or "#" in r[k] or "\x00" in r[k]:
                    raise ValueError("%s.%s: %r (a topic prefix: no +, # or NUL)" % (rw, k, r[k]))
            if not eb.valid_filter(r["local_prefix"] + r["pattern"]) or not eb.valid_filter(
                r["remote_prefix"] + r["pattern"]
            ):
                raise ValueError(
                    "%s.pattern: %r is not a topic filter under its prefixes" % (rw, r["pattern"])
                )
            cr.append(r)
        c["topics"] = cr
        if not c["client_id"]:
            c["client_id"] = board
        out.append(c)
    return out


def _remap(topic, strip, add):
    # mosquitto's topic mapping: the prefix is taken off when the topic
    # starts with it ("l/#" also matches "l", which keeps its name), then the
    # other side's prefix is put on
    if topic.startswith(strip):
        topic = topic[len(strip) :]
    return add + topic


# ---------------------------------------------------------------- 3. Queue
class Queue:
    """The bridge's flash log: appends (put), commit (write + fsync), a
    cursor that moves on upstream acknowledgements, compaction. Offsets are
    file offsets; compaction shifts them down by the dead prefix (moved())."""

    def __init__(self, path, budget, drop_oldest, ratio, min_bytes, log):
        self.path = path
        self.budget = budget
        self.drop_oldest = drop_oldest
        self.ratio = ratio
        self.min_bytes = min_bytes
        # an eighth of the budget, at most 1 MB, and at most what the
        # flash model allows beyond it (budget x ratio: config check). A
        # compaction copies only what is queued, so its cost (a new file,
        # fsync, rename) is per compaction: with a large budget, a link that
        # keeps up compacts every 12,000 short messages, not every 700
        self.slack = min(budget >> 3, 1048576, int(budget * ratio))
        self._log = log
        self.f = None
        self.wb = bytearray()  # appended, not yet written
        self.fend = _HDR  # written (committed) end
        self.cursor = _HDR
        self.count = 0  # messages at or after the cursor
        self.drops = 0
        self.corrupt = 0
        self.kdirty = False  # cursor moved since the last "K" record
        self.unsynced = False  # written by commit(False) and not fsynced since
        self.moved = None  # callback(delta) after a compaction
        self.created = False  # a new file (no earlier state to resume)
        self.rb = None  # read-ahead: bytes of the file from rb_off
        self.rbv = None  # a memoryview of rb (one, not one per record)
        self.rb_off = 0
        self.rb_ok = False  # rb is what this process wrote (no CRC check)
        self.seq = 0  # the next message's number
        self.rel = {}  # seqs of QoS 2 messages past PUBREC ("R" records)
        self._open()

    @property
    def end(self):
        return self.fend + len(self.wb)

    @property
    def nbytes(self):
        # the backlog's flash bytes: everything from the cursor on
        return self.fend + len(self.wb) - self.cursor

    def _open(self):
        path = self.path
        new = path + ".new"
        if _size(path) < 0 and _size(new) >= _HDR:
            _rename(new, path)  # a compaction cut between remove and rename
        _remove(new)
        size = _size(path)
        if size < _HDR:
            self._create()
            return
        f = open(path, "r+b")
        head = f.read(_HDR)
        if head[:4] == MAGIC and head[4] > VERSION:
            f.close()
            raise ValueError(
                "bridge queue %s: format version %d is newer than this firmware's (%d): "
                "left as it is, the bridge does not run" % (path, head[4], VERSION)
            )
        if head[:4] != MAGIC or head[4] != VERSION:
            f.close()
            self._log(
                "error",
                "bridge queue %s: not a version %d queue file, moved to .bad" % (path, VERSION),
            )
            _remove(path + ".bad")
            _rename(path, path + ".bad")
            self._create()
            return
        self.f = f
        pos = _HDR
        cur = _HDR
        torn = False
        mark = False  # a cursor record: a first commit got through whole
        while pos < size:
            rt, body, nxt = read_record(f, pos, size)
            if rt is None:
                torn = True
                break
            if rt == -1:
                self.corrupt += 1
            elif rt == T_CURSOR and len(body) == 8:
                cur, seq = unpack_from(">II", body, 0)
                mark = True
                if seq > self.seq:
                    self.seq = seq
            elif rt == T_MSG and len(body) >= 4:
                seq = unpack_from(">I", body, 0)[0] + 1
                if seq > self.seq:
                    self.seq = seq
            pos = nxt
        self.fend = pos
        if cur > pos:
            cur = pos
        self.cursor = cur
        self._count()
        # The retained sync a new file is made for (Bridge._retained_sync)
        # ends with a cursor record in its commit: a file without one was
        # made by a run whose first commit never got through whole (a power
        # cut tore it, or none came), so the sync is done again (its copies
        # are retained messages: one sent twice is the same state). Not a
        # file made before that rule (no flag): its sync was done, and doing
        # it again after its backlog could push that out of a full queue
        rule = head[5] & 1
        self.created = not mark and rule == 1
        if torn:
            self._log("warning", "bridge queue %s: torn tail at %d ignored" % (path, pos))
            self.compact(mark or not rule)  # the copy has the flag

    def _count(self):
        n = 0
        pos = self.cursor
        f = self.f
        while pos < self.fend:
            rt, body, nxt = read_record(f, pos, self.fend)
            if rt is None:
                break
            if rt == T_MSG:
                n += 1
            elif rt == T_REL:
                if len(body) == 4:
                    self.rel[unpack_from(">I", body, 0)[0]] = 1
                elif not body:
                    self.rel = {}  # a new upstream session (new_session)
            pos = nxt
        self.count = n

    def _create(self):
        self.created = True
        g = open(self.path, "wb")
        g.write(HEADER)
        _sync(g)
        g.close()
        self.f = open(self.path, "r+b")
        self.fend = _HDR
        self.cursor = _HDR

    # -------------------------------------------------------------- writing
    def append(self, qos, flags, exp, wall, topic_b, props, payload):
        """Appends one message; False when the full policy refused it."""
        tl = len(topic_b)
        pl = len(props)
        blen = _MHEAD + tl + pl + len(payload)
        # room for the record and the cursor record the next commit may add
        n = blen + 26
        if self.fend + len(self.wb) - self.cursor + n > self.budget:  # nbytes, in line
            if not self.drop_oldest or n > self.budget:
                self.drops += 1
                return False
            while self.cursor < self.end and self.nbytes + n > self.budget:
                self._drop_first()
        # record(T_MSG, body) written in place: no copies (the CRC
        # of type, length and body in one pass is the chained one)
        wb = self.wb
        i = len(wb)
        wb += pack(">BIIBBIIHI", T_MSG, blen, self.seq, qos, flags, exp, wall, tl, pl)
        wb += topic_b
        if pl:
            wb += props
        wb += payload
        c = _crc32(memoryview(wb)[i:]) & _U32
        wb += pack(">I", c)
        self.count += 1
        self.seq = (self.seq + 1) & 0x3FFFFFFF
        return True

    def _drop_first(self):
        # when_full drop_oldest: the cursor skips the oldest message (one
        # in flight is forgotten: its acknowledgement moves nothing)
        pos = self.cursor
        while pos < self.end:
            rt, body, nxt = self.read(pos)
            if rt is None:
                break
            pos = nxt
            if rt == T_MSG:
                break
        self.advance(pos, 1)
        self.drops += 1

    def read(self, pos):
        """(type, body, next) of the record at pos, committed or buffered."""
        if pos >= self.fend:
            i = pos - self.fend
            wb = self.wb
            if len(wb) - i < 9:
                return None, None, pos
            blen = unpack_from(">I", wb, i + 1)[0]
            return wb[i], memoryview(wb)[i + 5 : i + 5 + blen], pos + 9 + blen
        rb = self.rb
        i = pos - self.rb_off
        if rb is not None and 0 <= i and i + 5 <= len(rb):
            blen = unpack_from(">I", rb, i + 1)[0]
            end = i + 9 + blen
            if end <= len(rb):
                body = self.rbv[i + 5 : i + 5 + blen]
                if (
                    not self.rb_ok
                    and _crc32(body, _crc32(self.rbv[i : i + 5])) & _U32
                    != unpack_from(">I", rb, i + 5 + blen)[0]
                ):
                    return -1, None, pos + 9 + blen
                return rb[i], body, pos + 9 + blen
        # read ahead: the drain reads the file front to back, and one read
        # of a few KB costs less than two small reads per record
        n = min(_RA, self.fend - pos)
        if n >= 9:
            f = self.f
            f.seek(pos)
            self.rb = f.read(n)
            self.rbv = memoryview(self.rb)
            self.rb_off = pos
            self.rb_ok = False
            blen = unpack_from(">I", self.rb, 1)[0]
            if 9 + blen <= len(self.rb):
                return self.read(pos)
        return read_record(self.f, pos, self.fend)

    def advance(self, pos, n):
        """The upstream acknowledged everything before pos (n messages)."""
        if pos <= self.cursor:
            return
        self.cursor = pos
        self.count -= n
        if self.count < 0 or pos >= self.end:
            self.count = 0
        self.kdirty = True

    def commit(self, sync=True):
        """Writes the buffer (and a cursor record when it moved), flushes,
        fsyncs when sync: OSError on failure (the held acks are not sent)."""
        drained = self.cursor >= self.end  # (before the cursor record below)
        if self.kdirty:
            self.kdirty = False
            self.wb.extend(record(T_CURSOR, pack(">II", self.cursor, self.seq)))
        f = self.f
        if not self.wb:
            if sync and self.unsynced:
                # the link's cursor commit (commit(False)) wrote messages that
                # an acknowledgement may wait for: they are fsynced now
                _sync(f)
                self.unsynced = False
            return
        f.seek(self.fend)
        n = len(self.wb)
        r = f.write(self.wb)
        if r is not None and r != n:
            raise OSError(5)
        if sync:
            _sync(f)
        else:
            f.flush()
        self.unsynced = not sync
        if n <= 2 * _RA:
            # what was just written is what the link sends next: keep it as
            # the read-ahead (trusted: it never left RAM, no CRC to check)
            self.rb = self.wb
            self.rbv = memoryview(self.wb)
            self.rb_off = self.fend
            self.rb_ok = True
        self.fend += n
        self.wb = bytearray()
        # Compaction copies what is still queued: a drained queue goes as
        # soon as min_bytes are dead (nothing to copy); with messages queued
        # it also waits for `slack` dead bytes, so that a link that keeps up
        # does not rewrite the file (fsync, rename) every few KB of flash
        dead = self.cursor - _HDR - 17
        if dead >= self.min_bytes and (
            drained or (dead >= self.ratio * self.fend and dead >= self.slack)
        ):
            self.compact()

    def compact(self, mark=True):
        """Streams the records from the cursor into <file>.new, then renames
        it over the file. Offsets move down by cursor - header (moved()).
        mark False: no cursor record first (the file had none: _open)."""
        if self.wb:
            self.commit()
        path = self.path
        new = path + ".new"
        g = open(new, "wb")
        g.write(HEADER)
        k = _HDR + 17 if mark else _HDR
        if mark:
            # the message numbering goes on from where it was (packet ids)
            g.write(record(T_CURSOR, pack(">II", k, self.seq)))
        f = self.f
        pos = self.cursor
        while pos < self.fend:
            # record by record: an old cursor record holds an old offset, so
            # it is rewritten (same length: offsets move by one delta)
            rt, body, nxt = read_record(f, pos, self.fend)
            if rt is None:
                break
            if rt == T_CURSOR and len(body) == 8:
                g.write(record(T_CURSOR, pack(">II", k, self.seq)))
            else:
                f.seek(pos)
                g.write(f.read(nxt - pos))
            pos = nxt
        _sync(g)
        g.close()
        f.close()
        _rename(new, path)
        self.unsynced = False  # every live record is in the synced copy
        self.rb = self.rbv = None
        delta = self.cursor - k
        self.f = open(path, "r+b")
        self.fend -= delta
        self.cursor = k
        self.kdirty = False
        if self.moved is not None and delta:
            self.moved(delta)
        return delta

    def new_session(self):
        # an empty "R" record: the upstream session the earlier "R"s were
        # part of is gone (read by _count, and by store inspect). The
        # earlier ones are made void in place first (FORMAT): the empty
        # "R" alone is lost on a reader that predates it
        if self.rel:
            self.commit(True)
            f = self.f
            pos = self.cursor
            while pos < self.fend:
                rt, body, nxt = read_record(f, pos, self.fend)
                if rt is None:
                    break
                if rt == T_REL and len(body) == 4:
                    f.seek(pos)
                    f.write(record(T_VOID, bytes(body)))
                pos = nxt
            self.rb = self.rbv = None  # the read-ahead held the old bytes
        self.wb.extend(record(T_REL, b""))
        self.rel = {}
        self.commit(True)

    def released(self, seq):
        # PUBREC came for QoS 2 message seq: recorded before PUBREL goes
        self.wb.extend(record(T_REL, pack(">I", seq)))
        self.rel[seq] = 1

    def close(self):
        if self.f is not None:
            try:
                self.commit()
            except OSError:
                pass
            self.f.close()
            self.f = None


# ---------------------------------------------------------------- 4. Bridge
# An in-flight entry (Bridge.inflight, send order), a list read by slot:
_I_PID = const(0)
_I_OFF = const(1)  # record offset in the queue file
_I_END = const(2)  # offset after it
_I_ACK = const(3)  # 0 sent, 1 acknowledged, 2 PUBREC came (QoS 2: PUBREL sent)
_I_N = const(4)  # messages it accounts for (itself + skipped ones before it)
_I_QOS = const(5)
_I_SEQ = const(6)
_I_LIVE = const(7)  # 1: sent by the live lane

_BMAP = const(256)  # bytes of the slow-lane topic bitmap (2,048 bits)


class _Down(Exception):
    """The link ended (closed by the peer, keep alive, protocol)."""


class Bridge:
    """One upstream link. The engine calls put() while routing every
    PUBLISH and commit() in its group commit; run() is the asyncio task."""

    def __init__(self, broker, c, data_dir):
        self.broker = broker
        self.eng = broker.engine
        self.c = c
        self.name = c["name"]
        self.v5 = c["protocol"] == 5
        cfg = broker.cfg
        self.durable = cfg["storage_type"] in ("disc", "disc_only")
        # outbound rules: (local filter levels, rule, prefix, remote prefix
        # bytes, local prefix length in bytes, the rule's qos, latest mode):
        # put() reads all but the rule per message; prefix is "a/b/" for a
        # filter "a/b/#" without "+" (put() matches it by startswith, no
        # split per message: the same topics, MQTT-4.7.1), else None
        self.outr = []
        self.inr = []  # inbound rules: (remote filter, remote filter levels, rule)
        for r in c["topics"]:
            if r["direction"] in ("out", "both"):
                f = r["local_prefix"] + r["pattern"]
                pre = None
                if len(f) > 2 and f[-2:] == "/#" and "+" not in f and f[-3] != "/":
                    pre = f[:-1]
                rb = r["remote_prefix"].encode()
                self.outr.append(
                    (
                        f.split("/"),
                        r,
                        pre,
                        rb,
                        len(r["local_prefix"].encode()),
                        r["qos"],
                        r["mode"] == "latest",
                    )
                )
            if r["direction"] in ("in", "both"):
                f = r["remote_prefix"] + r["pattern"]
                self.inr.append((f, f.split("/"), r))
        self.q = Queue(
            data_dir + "/bridge-" + self.name + ".ebrq",
            c["queue_bytes"],
            c["when_full"] == "drop_oldest",
            cfg["compact_ratio"],
            cfg["compact_min_bytes"],
            broker.log,
        )
        self.q.moved = self._moved
        self.up = False  # CONNACK accepted, link usable
        self.sock = None
        self.out = bytearray()  # bytes for upstream not yet sent
        self.inflight = []
        self.pids = {}  # packet id -> in-flight entry
        self.next_pid = 0
        self.sendpos = self.q.cursor
        self.hiwater = self.q.end  # records before it may have been sent: DUP
        # Packets made ahead (_prep): (offset, next offset, qos, packet id,
        # message number, packet) for the records from sendpos on, in order
        self.pre = []
        self.preb = 0  # their bytes
        self.skipn = 0  # messages skipped since the last in-flight entry
        # Two lanes (see _fill): the slow lane is the file in order; while a
        # backlog is paced by replay_rate, the live lane sends the messages
        # queued since the connect whose topic has nothing in the slow lane.
        self.sfront = self.q.cursor  # slow lane: acknowledged up to here
        self.lstart = 0  # queued before this connect (paced) below it
        self.split = False  # the live lane runs
        self.sstart = 0  # where the split began: lanes by topic from here
        self.lpos = 0  # live lane: next record to look at
        self.lfront = 0  # live lane: its messages acknowledged up to here
        self.linf = []  # live lane in-flight entries, send order
        self.lskipn = 0
        # topics (CRC-32 bit) with a message in the slow lane: set while no
        # split runs, frozen during one, cleared when nothing is queued. A
        # shared bit only sends a message the slow way (never out of order).
        # (only with a replay_rate: unpaced, the file goes in order at link
        # speed and no message needs to pass another)
        self.pace = c["replay_rate"]
        self.bmap = bytearray(_BMAP)
        self.bset = False
        self.lsent = 0  # messages the live lane sent (status)
        self.window = c["max_inflight"]
        # the status PUBLISH ("online", QoS 1): its packet id while in
        # flight, -1 while it waits for room in the window, else 0. It
        # counts against the upstream's Receive Maximum like any PUBLISH
        # (MQTT-3.3.4-9): a full window plus it was one too many
        self.spid = 0
        # in-flight entries of a resumed session not yet sent again: they go
        # as the window allows, the upstream's Receive Maximum may be lower
        # than what was in flight before (MQTT-3.3.4-9)
        self.rwait = []
        self.in2 = {}  # inbound QoS 2 packet ids waiting for PUBREL
        self.inbound = False  # publishing an upstream message locally
        self.ev = None
        self.last_rx = 0
        self.last_tx = 0
        self.last_k = 0
        self.tokens = 0.0
        self.t_rate = 0
        self.fails = 0
        self.attempts = []  # attempt times within the last minute
        self.addr = None  # last resolved address
        self.err = ""
        self.sent = 0
        self.acked = 0
        self.ack_seen = 0  # acked when last_ack was last set (_serve)
        self.last_ack = 0  # when an acknowledgement last came, or nothing was in flight
        self.dropped0 = 0  # QoS 0 messages dropped while the link was down
        self.lskip = 0  # queued messages skipped: a newer one of their topic (latest)
        self.latest = {}  # latest mode: topic hash -> newest record offset
        self.lfull = 0  # latest topics beyond latest_topics
        self.looped = 0  # 3.1.1: inbound messages dropped as possible echoes
        self.toolarge = 0  # queued messages over the upstream's Maximum Packet Size
        self.indrop = 0  # inbound messages not published locally (too large, refused)
        self.expired = 0  # queued messages whose Message Expiry ran out before they went
        self.uprefused = 0  # PUBACK/PUBREC with a reason code >= 0x80 (5.0): not taken
        self.skip = 0  # bytes of a too large inbound packet still to drop
        self.upmax = 268435460
        self._rebuild_latest()
        self.relq = []  # PUBRELs waiting for their "R" records' commit
        self.connects = 0  # successful connections this run
        self.maxqos = 2
        self.rtok = 1  # the upstream has retained messages (Retain Available)
        self.last_ping = 0
        self.last_state = 0
        self.rerr = None
        self.rmv = None  # the link's receive buffer (a session's)
        self.sacks = False  # a lane has acknowledged entries to settle
        self.lacks = False
        self.tpump = 0  # _ticks_us() of put()'s last pump
        self.wnow = -1.0  # the engine's now_s when wall was read
        self.wall = 0
        self.rbuf = bytearray()
        self.connack = None
        self.sfrom = -1  # queue offset where the last retained sync began (-1: none)
        self.syncing = False  # put() called by _retained_sync
        if self.q.created:
            self._retained_sync()  # last: put() reads the state above

    def log(self, level, fmt, *args):
        self.eng.log(level, "bridge %s: " % self.name + fmt, *args)

    # ------------------------------------------------------- engine sink
    def put(self, msg, retain, origin, topic):
        """Routing calls this for every PUBLISH (topic: the str of its topic
        bytes); True when the message went into the flash queue (its PUBACK
        then waits for commit())."""
        if self.inbound:
            return False  # came from upstream: never sent back (no loop)
        for flev, _r, pre, rb, ll, rq, latest in self.outr:  # noqa: B007 (read after the break)
            if pre is not None:
                # "a/b/#" matches "a/b" and everything below it (4.7.1.2);
                # the parent compared without slicing pre (no string a message)
                if topic.startswith(pre) or (len(topic) == len(pre) - 1 and pre.startswith(topic)):
                    break
            elif eb.topic_matches(flev, topic):
                break
        else:
            return False
        # the remote topic, from the topic's bytes: the local prefix swapped
        # for the remote one, or the remote one added to the parent ("l" of
        # "l/#"), which does not start with it (mosquitto's mapping)
        tb = msg[0]
        tb = rb + (tb[ll:] if len(tb) >= ll else tb)
        qos = msg[2]
        if qos > rq:
            qos = rq
        exp = 0
        flags = F_RETAIN if retain else 0
        if msg[4]:
            exp = int(msg[4] - self.eng.now_s + 0.999)
            if exp <= 0:
                return False
            flags |= F_EXP
        if retain and rq:
            qos = qos or 1  # retained state must arrive: deletes included
        if qos == 0:
            if self.up and len(self.out) < self.eng.max_outbuf:
                self._publish(
                    tb, qos, retain, 0, msg[3], exp if flags & F_EXP else -1, msg[1], False
                )
                self._kick()
            else:
                self.dropped0 += 1
            return False
        q = self.q
        if self.pace and not self.split:
            self._mark(tb)
        if self.syncing:
            latest = False  # a sync's copy (_retained_sync)
        if latest:
            flags |= F_LATEST
            pos = q.end  # where its record goes
        now = self.eng.now_s
        if now != self.wnow:
            # the wall clock once per turn (whole seconds: the queue's unit)
            self.wnow = now
            self.wall = eb._wallclock() or 0
        if not q.append(qos, flags, exp, self.wall, tb, msg[3], msg[1]):
            return False
        if latest:
            self._latest_at(tb, pos)

        if not self.durable:
            self.eng.sdirty = True  # written at the turn's commit, not waited for
        t = _ticks_us()
        d = _ticks_diff(t, self.tpump)
        # d < 0: the last pump was over half of ticks_us' period ago (about
        # 9 minutes on MicroPython, whose ticks wrap every 2**30 us): then
        # every put() pumped no more until the wrap came round again
        if d >= _PUMP_US or d < 0:
            self.tpump = t
            self.pump()
        return True  # sendable after the commit, which wakes the link

    def commit(self, syncer=None):
        # syncer (the engine's, CPython): the queue is written and flushed
        # here and its fsync runs beside the loop; the acknowledgements wait
        # for it in Engine.commit()
        q = self.q
        if syncer is None or not self.durable:
            q.commit(self.durable)
        else:
            q.commit(False)
            if q.unsynced:
                syncer.add(q.f)
                q.unsynced = False
        self.pump()  # what came during the write and fsync
        self._kick()

    def _kick(self):
        if self.ev is not None:
            self.ev.set()

    def _moved(self, delta):
        # compaction moved every offset down by delta
        self._unprep()
        self.sendpos -= delta
        self.hiwater = max(0, self.hiwater - delta)
        self.sfront = max(_HDR, self.sfront - delta)
        self.lstart = max(0, self.lstart - delta)
        if self.sfrom > 0:
            self.sfrom = max(0, self.sfrom - delta)
        self.sstart = max(0, self.sstart - delta)
        self.lpos = max(_HDR, self.lpos - delta)
        self.lfront = max(_HDR, self.lfront - delta)
        for e in self.inflight + self.linf:
            e[_I_OFF] -= delta
            e[_I_END] -= delta
        lx = self.latest
        for h in list(lx):
            if lx[h] < delta + _HDR + 17:
                del lx[h]  # before the cursor: gone with the dead prefix
            else:
                lx[h] -= delta

    # ------------------------------------------------------- latest mode
    # A fixed index: CRC-32 of the upstream topic -> offset of its newest
    # queued record, at most latest_topics entries. A record of a `latest`
    # rule is sent only if it is that newest one; a hash shared by two
    # topics is told apart by reading the newer record's topic.
    def _latest_at(self, tb, pos):
        h = _crc32(tb)
        lx = self.latest
        if h not in lx and len(lx) >= self.c["latest_topics"]:
            self.lfull += 1  # untracked: queued and sent like `queue` mode
            return
        lx[h] = pos

    def _superseded(self, tb, pos, retain):
        # a retained record gives way only to a newer retained one: the
        # upstream's retained state must become the local one (a change or
        # a delete followed by a plain message of the topic is still sent)
        h = _crc32(tb)
        at = self.latest.get(h)
        if at is None or at == pos:
            if at is not None:
                del self.latest[h]  # the newest goes now; a later one re-enters
            return False
        if at < pos:
            return False
        rt, body, nxt = self.q.read(at)
        m = decode_msg(body) if rt == T_MSG else None
        return m is not None and m[4] == tb and (not retain or m[1] & F_RETAIN)

    def _rebuild_latest(self):
        q = self.q
        pos = q.cursor
        while pos < q.end:
            rt, body, nxt = q.read(pos)
            if rt is None:
                break
            if rt == T_MSG:
                m = decode_msg(body)
                if m is not None:
                    if self.pace:
                        self._mark(m[4])  # the backlog's topics: slow lane
                    if m[1] & F_LATEST:
                        self._latest_at(m[4], pos)
            pos = nxt

    def _retained_sync(self):
        # the upstream gets the retained state of the outbound topics: for
        # a new queue file, and when the upstream has no session of ours
        # (it lost its state, e.g. restarted without persistence); later
        # changes, deletes included, follow through the queue. Its copies
        # are sent like `queue` mode: in latest mode an older retained copy
        # placed after a newer plain message must not supersede it
        self.sfrom = self.q.end
        self.syncing = True
        store = self.eng.store
        for o in self.outr:
            r = o[1]
            for m in store.match(o[0]):
                topic = m[0].decode()
                for o2 in self.outr:  # noqa: B007 (o2 is read after the break)
                    if eb.topic_matches(o2[0], topic):
                        break
                if o2[1] is r:
                    self.put(m, 1, None, topic)
        self.syncing = False
        q = self.q
        # its commit ends with a cursor record (what Queue._open looks for)
        q.wb.extend(record(T_CURSOR, pack(">II", q.cursor, q.seq)))
        self.eng.sdirty = True  # committed at the first turn

    # ------------------------------------------------------------ writing
    def _publish(self, tb, qos, retain, pid, props, exp, payload, dup, o=None):
        # written straight into the output buffer (the drain's hot path), or
        # into o (_prep: sent later, counted then)
        plen = len(props)
        if self.v5:
            if exp >= 0:
                plen += 5  # Message Expiry Interval (3.3.2.3.3), the time left
            pv = eb.vbi(plen) if plen > 127 else bytes((plen,))
        else:
            pv = b""
            plen = 0
        tl = len(tb)
        n = 2 + tl + (2 if qos else 0) + len(pv) + plen + len(payload)
        if o is None:
            o = self.out
            self.sent += 1
        # retained only where the upstream has them (MQTT-3.2.2-14)
        first = 0x30 | qos << 1 | (8 if dup else 0) | (1 if retain and self.rtok else 0)
        if n < 128:
            o += pack(">BBH", first, n, tl)  # the usual short packet: one pack
        else:
            o.append(first)
            o += eb.vbi(n)
            o += pack(">H", tl)
        o += tb
        if qos:
            o += pack(">H", pid)
        if pv:
            o += pv
            if exp >= 0:
                o += pack(">BI", 0x02, exp)
            o += props
        o += payload

    def _pid(self):
        # the link's own packet ids (status, SUBSCRIBE): 65001..65535
        p = self.next_pid
        while True:
            p = p + 1 if _PIDS < p < 65535 else _PIDS + 1
            if p not in self.pids:
                self.next_pid = p
                return p

    def _mark(self, tb):
        h = _crc32(tb) & 2047
        self.bmap[h >> 3] |= 1 << (h & 7)
        self.bset = True

    def _slow(self, tb):
        # True when tb's bit is set: a message of the slow lane
        h = _crc32(tb) & 2047
        return bool(self.bmap[h >> 3] & (1 << (h & 7)))

    def _fill(self, now):
        """Sends queue records while the window has room. Per-topic order
        holds: the slow lane sends the file in order; the live lane (only
        while a split runs) sends the messages queued since the split began
        whose topic has no bit in bmap, i.e. nothing waiting in the slow
        lane. replay_rate paces what was queued before this connect (the
        backlog), so that live messages are not starved behind it."""
        if self.rwait:
            self._resends()
        if self.spid < 0:
            self._status()
        q = self.q
        rate = self.pace
        if rate:
            self.tokens = min(rate, self.tokens + (now - self.t_rate) * rate)
            self.t_rate = now
        c = q.cursor
        if self.sendpos < c:
            self.sendpos = c  # drop_oldest moved the cursor
        if self.sfront < c:
            self.sfront = c
        if self.split:
            if self.lpos < c:
                self.lpos = c
            if self.lfront < c:
                self.lfront = c
            self.lpos = self._lane(True, self.lpos, rate)
        self.sendpos = self._lane(False, self.sendpos, rate)
        if (
            self.bset
            and not self.inflight
            and not self.linf
            and self.sendpos >= q.end
            and (not self.split or self.lpos >= q.end)
        ):
            # nothing queued, nothing in flight: every topic is free again
            if self.split:
                self.split = False
                self.sendpos = self.sfront = max(self.sendpos, self.lpos)
                q.advance(self.sfront, 0)
            self.bmap = bytearray(_BMAP)
            self.bset = False

    def _lane(self, live, pos, rate):
        # one lane's records from pos; returns where it stopped
        q = self.q
        inf = self.linf if live else self.inflight
        split = self.split
        wall = None
        room = self.window - self._flight()
        pre = None if live else self.pre
        while room > 0 and pos < q.fend:
            paced = rate and pos < self.lstart
            if paced and self.tokens < 1:
                break
            if len(self.out) > 65536:
                break  # the socket is behind: fill again when it drains
            at = pos
            pkt = None
            if pre:
                x = pre[0]
                if x[0] == at:
                    # made ahead by _prep: checked and encoded already
                    nxt, qos, pid, seq, pkt = x[1], x[2], x[3], x[4], x[5]
                else:
                    self._unprep()  # the position moved (drop_oldest): made again later
                    pre = None
            if pkt is None:
                rt, body, nxt = q.read(at)
                if rt is None:
                    pos = q.fend  # unreadable: nothing more to send
                    break
                pos = nxt
                if rt != T_MSG:
                    continue
                m = decode_view(body)
                if m is None:
                    self._skip(live, inf)
                    continue
                qos, flags, exp, w, tb, props, payload, seq = m
                if split and (live or at >= self.sstart) and self._slow(tb) == live:
                    # the other lane's message (it counts it): a slow-lane topic
                    # seen by the live lane or the reverse; with nothing in
                    # flight here, this lane's front passes it
                    if not inf:
                        if live:
                            self.lfront = pos
                        else:
                            self.sfront = pos
                    continue
                if len(tb) + len(props) + len(payload) + 16 > self.upmax:
                    # MQTT-3.1.2-24: never sent (it would end the link for good)
                    self.toolarge += 1
                    self._skip(live, inf, pos)
                    continue
                if flags & F_LATEST and self._superseded(bytes(tb), at, flags & F_RETAIN):
                    self.lskip += 1
                    self._skip(live, inf, pos)
                    continue
                if flags & F_EXP:
                    if wall is None:
                        wall = eb._wallclock() or 0
                    if w and wall:
                        exp -= wall - w  # its lifetime went on while queued
                    if exp <= 0:
                        self.expired += 1
                        self._skip(live, inf, pos)  # expired in the queue: never sent
                        continue
                else:
                    exp = -1
                if qos > self.maxqos:
                    # the upstream's Maximum QoS (MQTT-3.2.2-11; mosquitto's
                    # bridge downgrades too); at 0 it is sent and done
                    qos = self.maxqos
                    if not qos:
                        self._publish(tb, 0, flags & F_RETAIN, 0, props, exp, payload, False)
                        self._skip(live, inf, pos)
                        continue
                pid = seq % _PIDS + 1
            if pid in self.pids:
                pos = at  # its id is still in flight: wait for the ack
                break
            pos = nxt
            if live:
                e = [pid, at, nxt, 0, self.lskipn + 1, qos, seq, 1]
                self.lskipn = 0
                self.lsent += 1
            else:
                e = [pid, at, nxt, 0, self.skipn + 1, qos, seq, 0]
                self.skipn = 0
            inf.append(e)
            room -= 1
            self.pids[pid] = e
            if pkt is not None:
                pre.pop(0)
                self.preb -= len(pkt)
                self.out += pkt
                self.sent += 1
            elif qos == 2 and seq in q.rel:
                # PUBREC came before a restart: only PUBREL is left (4.3.3)
                e[_I_ACK] = 2
                self.out += b"\x62\x02" + eb.u16(pid)
            else:
                self._publish(
                    tb, qos, flags & F_RETAIN, pid, props, exp, payload, at < self.hiwater
                )
            if paced:
                self.tokens -= 1
        return pos

    # >>> host only: _PREP_BYTES is 0 on a board, which never calls it
    def _prep(self):
        """Encodes the packets of the next records while the window is full,
        so that the acknowledgements that open it are answered without
        encoding first: the refill of a window is on the path of every
        round trip, and the upstream waits while it runs. Only what a refill
        would send unchanged: not with lanes or pacing, nor a latest-mode or
        expiring record (their fate is decided when they go), nor a QoS 2
        record past PUBREC. Bounded by _PREP_BYTES and by the window."""
        pre = self.pre
        if self.split or self.pace or self.preb >= _PREP_BYTES:
            return
        q = self.q
        pos = pre[-1][1] if pre else self.sendpos
        while pos < q.fend and self.preb < _PREP_BYTES and len(pre) < self.window:
            rt, body, nxt = q.read(pos)
            if rt != T_MSG:
                return
            m = decode_view(body)
            if m is None:
                return
            qos, flags, exp, w, tb, props, payload, seq = m
            if flags & (F_LATEST | F_EXP) or (qos == 2 and seq in q.rel) or qos > self.maxqos:
                return
            if len(tb) + len(props) + len(payload) + 16 > self.upmax:
                return
            o = bytearray()
            pid = seq % _PIDS + 1
            self._publish(tb, qos, flags & F_RETAIN, pid, props, -1, payload, pos < self.hiwater, o)
            pre.append((pos, nxt, qos, pid, seq, o))
            self.preb += len(o)
            pos = nxt

    # <<< host only
    def _unprep(self):
        self.pre = []
        self.preb = 0

    def _skip(self, live, inf, pos=0):
        # a message of this lane that is never sent: counted as done with
        # the next entry, or now when nothing is in flight
        if live:
            self.lskipn += 1
        else:
            self.skipn += 1
        if not inf and pos:
            self._ack_upto(live, pos)

    def _ack_upto(self, live, pos):
        # nothing in flight in this lane: its front follows its position
        if live:
            n = self.lskipn
            self.lskipn = 0
            self.lfront = pos
        else:
            n = self.skipn
            self.skipn = 0
            self.sfront = pos
        if n:
            self._cur(n)

    def _cur(self, n):
        # n messages done; the cursor is the lower lane front
        f = self.sfront
        if not self.split:
            self.q.advance(f, n)
            return
        if self.lfront < f:
            f = self.lfront
        q = self.q
        q.count = max(0, q.count - n)
        q.advance(f, 0)

    def _acked(self, pid, comp):
        e = self.pids.get(pid)
        if e is None:
            return
        if pid == self.spid:
            # the status PUBLISH: its slot in the window is free again
            del self.pids[pid]
            self.spid = 0
            self.ack_seen = -1  # an acknowledgement came (_serve's timeout)
            return
        if e[_I_QOS] == 2 and not comp:
            # PUBREC: release it (MQTT-4.3.3) once the "R" record is on
            # flash (see _parsed); the cursor waits for PUBCOMP
            if e[_I_ACK] == 0:
                e[_I_ACK] = 2
                self.q.released(e[_I_SEQ])
            self.relq.append(pid)
            return
        del self.pids[pid]
        if e[_I_QOS] == 2:
            self.q.rel.pop(e[_I_SEQ], None)
        e[_I_ACK] = 1
        self.acked += 1
        if e[_I_LIVE]:
            self.lacks = True
        else:
            self.sacks = True

    def _settle(self):
        # after a read's acknowledgements: each lane's acknowledged front
        # entries leave, and the cursor moves once (not once per message)
        if self.sacks:
            self.sacks = False
            self._front(0)
        if self.lacks:
            self.lacks = False
            self._front(1)

    def _front(self, live):
        inf = self.linf if live else self.inflight
        n = 0
        end = 0
        k = 0
        m = len(inf)
        while k < m and inf[k][_I_ACK] == 1:
            x = inf[k]
            n += x[_I_N]
            end = x[_I_END]
            k += 1
        if k:
            # one slice deletion for the read's acknowledgements: pop(0)
            # moved the whole window down once per message
            del inf[:k]
        if n:
            pos = self.lpos if live else self.sendpos
            if not inf and pos > end:
                # the lane's skipped messages after it are done too
                end = pos
                if live:
                    n += self.lskipn
                    self.lskipn = 0
                else:
                    n += self.skipn
                    self.skipn = 0
            if live:
                self.lfront = end
            else:
                self.sfront = end
            self._cur(n)

    # ------------------------------------------------------------- the link
    def status_topic(self):
        rules = self.outr[0][1] if self.outr else self.c["topics"][0]
        return rules["remote_prefix"] + "status"

    def _connect_packet(self):
        c = self.c
        ver = c["protocol"]
        # A persistent session (MQTT-3.1.2-4/5): in-flight QoS 2 exchanges
        # and subscriptions survive outages and restarts; packet ids come
        # from the queue's message numbers, the same in every run
        flags = 0
        body = bytearray(eb.mqstr("MQTT") + bytes((ver,)))
        payload = bytearray(eb.mqstr(c["client_id"]))
        if c["status"]:
            # the upstream publishes "offline" retained when the link dies
            # will, QoS 1, retain
            flags |= 0x04 | (0x08 if self.maxqos else 0) | (0x20 if self.rtok else 0)
            if ver == 5:
                payload += b"\x00"  # will properties
            payload += eb.mqstr(self.status_topic()) + eb.mqstr(b"offline")
        if c["username"]:
            flags |= 0x80
            payload += eb.mqstr(c["username"])
        if c["password"]:
            flags |= 0x40
            payload += eb.mqstr(c["password"])
        body.append(flags)
        body += eb.u16(c["keepalive"])
        if ver == 5:
            # Session Expiry: the upstream keeps our session (its in-flight
            # QoS 2 state, our subscriptions) across outages; Receive
            # Maximum: what we accept inbound
            # Maximum Packet Size: the upstream drops what would not fit
            # here (MQTT-3.1.2-25) instead of sending it
            p = (
                eb.prop_u32(0x11, 0xFFFFFFFF)
                + eb.prop_u16(0x21, 64)
                + eb.prop_u32(0x27, self.eng.max_packet)
            )
            body += eb.vbi(len(p)) + p
        return eb.packet(1, 0, bytes(body + payload))

    async def run(self):
        """The link task: connect, serve, back off, again, until stopped."""
        aio = eb._asyncio()
        self.ev = aio.Event()
        clock = self.broker.clock
        self._state()
        try:
            while self.broker.running:
                await self._backoff(aio, clock)
                try:
                    await self._session(aio, clock)
                    self.fails = 0
                except Exception as e:  # down, refused, or a bug: it tries again
                    self.fails += 1
                    self._failed(e)
                finally:
                    try:
                        self._close()
                        self._state()
                    except MemoryError:
                        pass  # the socket is closed first; the state goes out at its next change
        finally:
            self._close()
            self.q.close()

    def _failed(self, e):
        # Never raises: the link must try again whatever ended it, a
        # MemoryError included (then its report may not fit either).
        try:
            self.err = _why(e)
            if isinstance(e, (OSError, _Down, eb.MqttError, ValueError)):
                self.log("warning", "link down: %s", self.err)
            else:
                self.log("error", "link failed: %s", self.err)
                eb._print_exc(e)
        except MemoryError:
            self.err = "MemoryError"

    async def _backoff(self, aio, clock):
        c = self.c
        if self.fails:
            d = min(c["retry_max"], c["retry_min"] * (1 << min(self.fails - 1, 16)))
            d = d / 2 + _jitter(d / 2)  # up to 50% jitter: gateways do not reconnect in step
            await aio.sleep(d)
        # a board attempts only while its Wi-Fi is up (DNS and connect
        # would fail anyway, and block on MicroPython)
        while self.broker.net_up is not None and not self.broker.net_up():
            await aio.sleep(1)
        # at most attempts_per_minute attempts in any minute
        now = clock()
        a = [t for t in self.attempts if now - t < 60]
        if len(a) >= c["attempts_per_minute"]:
            await aio.sleep(60 - (now - a[0]))
            now = clock()
            a = [t for t in a if now - t < 60]
        a.append(now)
        self.attempts = a

    async def _session(self, aio, clock):
        c = self.c
        try:
            # DNS is a blocking call on MicroPython: once per attempt; the
            # last address serves when resolution fails
            ai = socket.getaddrinfo(c["host"], c["port"], 0, socket.SOCK_STREAM)[0]
            self.addr = ai
        except OSError:
            if self.addr is None:
                raise
            ai = self.addr
        s = socket.socket(ai[0], socket.SOCK_STREAM)
        self.sock = s
        s.setblocking(False)
        _start_connect(s, ai[-1])
        await aio.wait_for(_writable(s), c["connect_timeout"])
        err = _so_error(s)
        if err:
            raise OSError(err)
        try:
            s.setsockopt(eb._IPPROTO_TCP, eb._TCP_NODELAY, 1)
        except (OSError, AttributeError):
            pass
        if c["tls"]:
            s = self.sock = await self._tls(aio, s, clock() + c["connect_timeout"])
        self.rbuf = bytearray()
        self.skip = 0
        self.connack = None
        self.relq = []
        self.out = bytearray(self._connect_packet())
        self.last_rx = self.last_tx = self.last_ping = self.last_ack = clock()
        rd = aio.create_task(self._reader(s, clock))
        try:
            deadline = clock() + c["connect_timeout"]
            while self.connack is None:
                self._flush()
                if rd.done():
                    raise _Down("closed before CONNACK")
                if clock() > deadline:
                    raise _Down("no CONNACK in connect_timeout")
                await self._wait(aio, 0.2)
            self._connected(clock)
            tk = aio.create_task(self._ticker(aio))
            try:
                await self._serve(aio, clock, rd)
            finally:
                tk.cancel()
        finally:
            rd.cancel()
            try:
                await rd
            except BaseException:
                pass

    async def _ticker(self, aio):
        # wakes the link for keep alive, the cursor record and the replay
        # rate: one sleeping task instead of a timeout per wait
        rate = self.pace
        period = 0.5 if not rate else max(0.01, min(0.5, 1 / rate))
        while True:
            await aio.sleep(period)
            self.ev.set()

    def _connected(self, clock):
        sp, rc, props = self.connack
        if rc:
            # the common refusals named (MQTT 5 table 3-1; 3.1.1 codes 4, 5)
            why = {
                4: "bad user name or password",
                5: "not authorized",
                0x86: "bad user name or password",
                0x87: "not authorized",
                0x85: "client identifier not valid",
                0x8A: "banned",
                0x88: "server unavailable",
                0x84: "unsupported protocol version",
                0x9A: "retain not supported: the next will is not retained",
                0x9B: "QoS not supported: the next will is QoS 0",
            }
            # our will asked for what the upstream lacks (MQTT-3.2.2-12/13):
            # the next CONNECT's will does without
            if rc == 0x9A:
                self.rtok = 0
            elif rc == 0x9B:
                self.maxqos = 0
            raise _Down("CONNACK refused 0x%02x (%s)" % (rc, why.get(rc, "see the upstream's log")))
        self.window = min(self.c["max_inflight"], props.get(0x21, 65535))
        self.maxqos = props.get(0x24, 2)
        self.rtok = props.get(0x25, 1)
        self.upmax = props.get(0x27, 268435460)  # the upstream's Maximum Packet Size
        self._unprep()  # made for the last connection (its DUP flags, its limits)
        self.up = True
        self.connects += 1
        self.err = ""
        self.log(
            "info",
            "connected to %s:%d (session %s, receive maximum %d)",
            self.c["host"],
            self.c["port"],
            "present" if sp else "new",
            self.window,
        )
        self.spid = 0
        if sp:
            # MQTT-4.4.0-1: resend what is in flight with the same packet
            # identifiers (PUBREL for QoS 2 past PUBREC): exactly once, in
            # order, within this connection's window (_resends)
            self.rwait = [e for e in self.inflight + self.linf if e[_I_ACK] != 1]
            self._resends()
        else:
            # (the inbound QoS 2 ids we took belong to the session: kept over
            # a reconnect that resumes it, so a resent PUBLISH (DUP) is not
            # published twice, 4.3.3; cleared with it at the CONNACK)
            if self.q.rel:
                # QoS 2 messages past PUBREC: the exchange died with the
                # session, so they go again as PUBLISH (at least once: the
                # upstream may have delivered them), recorded first
                self.q.new_session()
            self._restart()
            if self.q.cursor > self.sfrom:
                # no session of ours upstream: it may have lost its retained
                # messages too (restarted without persistence). Again once
                # part of the last sync was acknowledged (by an upstream
                # that then lost it); not while all of it still waits (a new
                # queue's first connect, a link that keeps coming back new
                # without taking anything); on flash now, before the session
                # this connect made can answer present to the next one
                self._retained_sync()
                self.q.commit(self.durable)
        if self.c["status"]:
            self.spid = -1
            self._status()
        subs = bytearray()
        for f, _fl, r in self.inr:
            # No Local (MQTT-3.8.3-3): our own publishes never come back;
            # Retain As Published: a retained upstream message stays retained
            # Retain Handling 1 (3.8.3.1): retained messages only for a new
            # subscription; a resumed session's (ours, sent on every
            # connect) would bring back our own retained messages, older
            # than what the queue still holds for them
            opts = r["qos"] | (0x04 | 0x08 | 0x10 if self.c["protocol"] == 5 else 0)
            subs += eb.mqstr(f) + bytes((opts,))
        if subs:
            p = b"\x00" if self.c["protocol"] == 5 else b""
            self.out += eb.packet(8, 2, eb.u16(self._pid_status()) + p + bytes(subs))
        self.t_rate = clock()
        self.tokens = 1.0
        q = self.q
        self.lstart = q.end  # queued before this connect: paced by replay_rate
        if self.pace and not self.split and self._more(self.sendpos):
            # a backlog to pace: messages queued from now on whose topic
            # has nothing in it go by the live lane
            self.split = True
            self.sstart = self.lpos = self.lfront = q.end
            self.linf = []
            self.lskipn = 0
        self._state()

    def _more(self, pos):
        # a message record at or after pos: cursor and release records
        # after the last message (written when acknowledgements came) are
        # no backlog
        q = self.q
        while pos < q.end:
            rt, body, nxt = q.read(pos)
            if rt is None:
                return False
            if rt == T_MSG:
                return True
            pos = nxt
        return False

    def _flight(self):
        # the QoS 1/2 PUBLISHes the window counts (MQTT-3.3.4-9): both
        # lanes' entries (resends still waiting included: the safe side)
        # and the status message while it is in flight
        return len(self.inflight) + len(self.linf) + (1 if self.spid > 0 else 0)

    def _resends(self):
        # the waiting resends, while the window has room: a message still
        # waiting here counts as not in flight, one acknowledged and not
        # yet dropped from the front still does (the window's count stays
        # on the safe side); _connected, then _fill
        rw = self.rwait
        n = len(rw)
        busy = self._flight() - n
        k = 0
        while k < n and busy < self.window:
            e = rw[k]
            k += 1
            if e[_I_ACK] == 2:
                self.out += b"\x62\x02" + eb.u16(e[_I_PID])
            elif e[_I_ACK] == 0:
                self._resend(e)
            busy += 1
        if k:
            del rw[:k]  # one deletion (a resumed window may be thousands)

    def _status(self):
        # the waiting status PUBLISH goes once the window has room (a
        # resumed session may have filled it): _connected, then _fill
        if not self.maxqos:
            self.spid = 0  # the upstream's Maximum QoS 0: no acknowledgement to wait for
            self._publish(self.status_topic().encode(), 0, 1, 0, b"", -1, b"online", False)
        elif self._flight() < self.window:
            p = self.spid = self._pid_status()
            self._publish(self.status_topic().encode(), 1, 1, p, b"", -1, b"online", False)

    def _pid_status(self):
        # a packet id outside the queue's: its acks match no entry
        p = self._pid()
        self.pids[p] = [p, 0, 0, 1, 0, 0, 0, 0]
        return p

    def _restart(self):
        # a new upstream session: everything from the cursor goes again
        self.hiwater = max(self.hiwater, self.sendpos, self.lpos)
        self.inflight = []
        self.rwait = []
        self.pids = {}
        self.skipn = 0
        self.sendpos = self.sfront = self.q.cursor
        if self.split:
            # the live lane's topics are not in bmap: every topic goes the
            # slow way (in file order) until the queue is empty again
            self.split = False
            self.linf = []
            self.lskipn = 0
            self.bmap = bytearray(b"\xff" * _BMAP)
            self.bset = True

    def _resend(self, e):
        rt, body, nxt = self.q.read(e[_I_OFF])
        m = decode_msg(body) if rt == T_MSG else None
        if m is None:
            e[_I_ACK] = 1
            return
        qos, flags, exp, w, tb, props, payload, seq = m
        qos = e[_I_QOS]
        if flags & F_EXP:
            # MQTT-3.3.2-6: what is left of its lifetime, the time since the
            # write counted as on the first send; gone by now, it still goes
            # (its delivery began: MQTT-4.4.0-1), with the least there is
            wall = eb._wallclock() or 0
            if w and wall:
                exp -= wall - w
            if exp < 1:
                exp = 1
        else:
            exp = -1
        rf = flags & F_RETAIN
        big = len(tb) + len(props) + len(payload) + 16 > self.upmax
        if qos > self.maxqos or big:
            # the resumed session's upstream now grants less (its CONNACK:
            # Maximum QoS, Maximum Packet Size; MQTT-3.2.2-11, 3.1.2-24)
            if big:
                self.toolarge += 1
                qos = e[_I_QOS] = 0
            else:
                qos = e[_I_QOS] = self.maxqos
                if qos:
                    self._publish(tb, qos, rf, e[_I_PID], props, exp, payload, True)
                    return
                self._publish(tb, 0, rf, 0, props, exp, payload, False)
            self._acked(e[_I_PID], True)  # done: sent at QoS 0, or never
            return
        self._publish(tb, qos, rf, e[_I_PID], props, exp, payload, True)

    async def _wait(self, aio, t):
        ev = self.ev
        ev.clear()
        if self.out and self.sock is not None:
            # the socket is full: wait for room (or an event, or the timeout)
            try:
                await aio.wait_for(_writable(self.sock), t)
            except aio.TimeoutError:
                pass
            return
        try:
            await aio.wait_for(ev.wait(), t)
        except aio.TimeoutError:
            pass

    async def _serve(self, aio, clock, rd):
        c = self.c
        ka = c["keepalive"]
        ev = self.ev
        while self.broker.running:
            ev.clear()  # what happens from here on wakes the wait below
            if rd.done() or self.rerr is not None:
                e = self.rerr
                raise e if e is not None else _Down("closed by upstream")
            if self.rbuf:
                self._took(0, clock)  # what pump() left (an inbound PUBLISH)
            now = clock()
            if now - self.last_rx >= ka:
                # a PINGREQ went at keepalive/2 and nothing came back since:
                # the link is silent (a dead NAT entry, a stuck proxy)
                raise _Down("keep alive: nothing from upstream in %d s" % ka)
            if now - self.last_rx >= ka / 2 and now - self.last_ping >= ka / 2:
                self.out += b"\xc0\x00"
                self.last_ping = now
            if self.acked != self.ack_seen or not self._flight():
                self.ack_seen = self.acked
                self.last_ack = now
            elif now - self.last_ack >= ka:
                # messages in flight and no acknowledgement for a keep-alive
                # period on a live link (an upstream that lost one: with a
                # small window the drain would stall for good). A new
                # connection resumes the session and sends them again
                # (MQTT-4.4.0-1, DUP)
                raise _Down("no acknowledgement from upstream in %d s" % ka)
            self._fill(now)
            self._flush()
            if self.q.kdirty and now - self.last_k >= 0.2:
                self.last_k = now
                self.q.commit(False)
            if now - self.last_state >= 5:
                self._state()
            if self.out:
                # the socket is full: wait for room (or the ticker's wake)
                try:
                    await aio.wait_for(_writable(self.sock), 0.5)
                except aio.TimeoutError:
                    pass
            else:
                await ev.wait()

    async def _tls(self, aio, s, deadline):
        """TLS over the connected socket, the upstream verified against the
        profile's CA. CPython: a non-blocking handshake driven by the event
        loop. MicroPython: its ssl module has no do_handshake(); the
        handshake is deferred to the first reads and writes of the CONNECT
        exchange on the non-blocking socket (do_handshake_on_connect False),
        so it runs on the event loop within that exchange's connect_timeout.
        (A blocking wrap_socket was bounded per read only: an upstream that
        sent its handshake a byte at a time held the whole broker.)"""
        import ssl

        t = self.c["tls"]
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.verify_mode = ssl.CERT_REQUIRED
        name = t.get("server_hostname") or self.c["host"]
        mp = not hasattr(ssl, "SSLWantReadError")  # MicroPython
        try:
            if mp:
                # its mbedtls may be built without PEM: DER from the files
                ctx.load_verify_locations(cadata=eb._der(t["ca"]))
                if t.get("cert"):
                    ctx.load_cert_chain(eb._der(t["cert"]), eb._der(t.get("key") or t["cert"]))
            else:
                ctx.load_verify_locations(cafile=t["ca"])
                if t.get("cert"):
                    ctx.load_cert_chain(t["cert"], t.get("key"))
        except (OSError, ValueError) as e:
            # a file tls names that cannot be read or used: named (a bare
            # OSError(2,) said nothing), retried with backoff as any fault
            files = t["ca"] + " " + (t.get("cert") or "")
            raise _Down("tls: cannot load %s: %r" % (files, e)) from None
        ss = ctx.wrap_socket(s, server_hostname=name, do_handshake_on_connect=False)
        if mp:
            return ss
        while True:
            try:
                ss.do_handshake()
                return ss
            except ssl.SSLWantReadError:
                w = False
            except ssl.SSLWantWriteError:
                w = True
            left = deadline - self.broker.clock()
            try:
                if left <= 0:
                    raise aio.TimeoutError()
                await aio.wait_for(_wait_io(ss, w), left)
            except aio.TimeoutError:
                raise _Down("TLS handshake over connect_timeout") from None

    def _flush(self):
        o = self.out
        if not o or self.sock is None:
            return
        try:
            n = self.sock.send(o)
        except OSError as e:
            if _blocked(e):
                return
            raise
        if n:
            self.out = o[n:]  # MicroPython's bytearray has no slice deletion

    async def _reader(self, s, clock):
        self.rerr = None
        self.rmv = mv = memoryview(bytearray(4096))
        pending = getattr(s, "pending", None)  # CPython TLS: bytes decrypted, not yet read
        try:
            while True:
                if pending is None or not pending():
                    await eb._io_wait(s, False)
                if self.rerr is not None:
                    raise self.rerr  # pump() met it first
                try:
                    n = eb._recv_into(s, mv)
                except OSError as e:
                    if not _blocked(e):
                        raise
                    n = -1  # pump() took what woke us
                if n is None or n < 0:
                    continue
                if n == 0:
                    raise _Down("closed by upstream")
                self._took(n, clock)
                self._kick()
        except Exception as e:
            self.rerr = e
            self._kick()

    def _took(self, n, clock, acks=False):
        # n bytes arrived in rmv: handled (acks: only up to the first packet
        # that is not an acknowledgement), then the window refilled
        if n:
            self.last_rx = clock()
            self.rbuf += self.rmv[:n]
        self._parse(acks)
        if self.relq:
            # the "R" records reach flash before any PUBREL leaves
            self.q.commit(True)
            for pid in self.relq:
                self.out += b"\x62\x02" + eb.u16(pid)
            self.relq = []
        if self.up:
            # acknowledgements opened the window: refill it now
            # rather than one scheduling round later in _serve
            self._fill(clock())
            self._flush()
            if _PREP_BYTES:
                self._prep()  # while the upstream works on what just left

    def pump(self):
        """Services the link between local packets: takes what the upstream
        sent without waiting for the event loop, and refills the window.
        Under load the window is full nearly all the time, so forwarding
        runs at window / round trip; a long batch of local packets would
        otherwise add its whole duration to every round trip."""
        s = self.sock
        if not self.up or s is None or self.rerr is not None:
            return
        try:
            n = eb._recv_into(s, self.rmv)
            if n is not None and n > 0:
                # called while a local PUBLISH is routed: an inbound PUBLISH
                # (routed too) waits for the link task (_serve)
                self._took(n, self.broker.clock, True)
                if self.rbuf:
                    self._kick()
        except Exception as e:
            if isinstance(e, OSError) and _blocked(e):
                return
            self.rerr = e  # the reader ends the session with it
            self._kick()

    def _parse(self, acks=False):
        b = self.rbuf
        i = 0
        n = len(b)
        if self.skip:
            # the rest of an inbound PUBLISH too large to take (below)
            i = min(self.skip, n)
            self.skip -= i
        while n - i >= 2:
            if acks and b[i] >> 4 not in (4, 5, 7, 13):
                break  # PUBACK, PUBREC, PUBCOMP, PINGRESP only
            j = i + 1
            ln = 0
            sh = 0
            while True:
                if j >= n:
                    ln = -1
                    break
                d = b[j]
                j += 1
                ln |= (d & 0x7F) << sh
                if not d & 0x80:
                    break
                sh += 7
                if sh > 21:
                    raise _Down("malformed length")
            if ln > self.eng.max_packet:
                # a 3.1.1 upstream knows no Maximum Packet Size: never buffer
                # more than max_packet_size for one packet. A PUBLISH is
                # acknowledged and dropped unread (its session would send it
                # again on every connect), anything else ends the link
                if acks or b[i] >> 4 != 3:
                    raise _Down("packet of %d bytes from upstream over max_packet_size" % ln)
                if j + 2 > n:
                    break
                qos = b[i] >> 1 & 3
                h = 2 + (b[j] << 8 | b[j + 1]) + (2 if qos else 0)
                if h > self.eng.max_packet:
                    raise _Down("packet of %d bytes from upstream over max_packet_size" % ln)
                if j + h > n:
                    break  # its packet identifier is still to come
                if qos:
                    pid = b[j + h - 2] << 8 | b[j + h - 1]
                    self.out += (b"\x40\x02" if qos == 1 else b"\x50\x02") + eb.u16(pid)
                    if qos == 2:
                        self.in2[pid] = 1  # its PUBREL gets the PUBCOMP
                self.indrop += 1
                self.log("warning", "inbound PUBLISH of %d bytes over max_packet_size: dropped", ln)
                if j + ln > n:
                    self.skip = j + ln - n
                    i = n
                    break
                i = j + ln
                continue
            if ln < 0 or j + ln > n:
                break
            self._handle(b[i], b, j, j + ln)
            i = j + ln
        if i:
            self.rbuf = b[i:]
        self._settle()

    def _handle(self, first, b, i, end):
        t = first >> 4
        if t == 4 or t == 7:  # PUBACK, PUBCOMP (the drain's path: first)
            if t == 4 and end - i > 2 and b[i + 2] >= 0x80:
                self.uprefused += 1  # refused (5.0 reason code): done, counted
            self._acked(b[i] << 8 | b[i + 1], True)
        elif t == 5:  # PUBREC
            pid = b[i] << 8 | b[i + 1]
            if end - i > 2 and b[i + 2] >= 0x80:
                self.uprefused += 1
                self._acked(pid, True)  # refused: the exchange ends (4.3.3)
            else:
                self._acked(pid, False)
        elif t == 3:
            self._inbound(first, b, i, end)
        elif t == 6:  # PUBREL for an inbound QoS 2 message
            pid = b[i] << 8 | b[i + 1]
            self.in2.pop(pid, None)
            self.out += b"\x70\x02" + eb.u16(pid)
        elif t == 2:  # CONNACK
            props = {}
            if self.v5 and end - i > 2:
                props, _, _ = eb.read_props(b, i + 2, end)
            self.connack = (b[i] & 1, b[i + 1], props)
            if not b[i] & 1 and not b[i + 1]:
                # a new upstream session: the inbound QoS 2 ids we took were
                # the old one's. Cleared here, before the packets that
                # follow the CONNACK in this read (a PUBLISH the upstream
                # sent at once), not in _connected() after them: that
                # cleared the id of a QoS 2 PUBLISH just taken, and its
                # resend after a reconnect was published again (4.3.3)
                self.in2 = {}
        elif t == 14:
            raise _Down("DISCONNECT 0x%02x from upstream" % (b[i] if end > i else 0))
        elif t == 9:  # SUBACK
            pid = b[i] << 8 | b[i + 1]
            self.pids.pop(pid, None)
            if end > i + 2 and b[end - 1] >= 0x80:
                self.log("warning", "upstream refused a subscription (0x%02x)", b[end - 1])
        # PINGRESP (13): last_rx is all it does

    def _inbound(self, first, b, i, end):
        qos = first >> 1 & 3
        tl = b[i] << 8 | b[i + 1]
        i += 2
        topic = str(bytes(b[i : i + tl]), "utf-8")
        i += tl
        pid = 0
        if qos:
            pid = b[i] << 8 | b[i + 1]
            i += 2
        props = None
        if self.c["protocol"] == 5:
            pr, fwd, i = eb.read_props(b, i, end)
            props = eb.decode_props(fwd) if fwd else {}
            if 0x02 in pr:
                props["message_expiry_interval"] = pr[0x02]
        payload = bytes(b[i:end])
        if qos == 2:
            if pid in self.in2:
                self.out += b"\x50\x02" + eb.u16(pid)
                return
        ok = self._deliver(topic, payload, qos, first & 1, props)
        if qos == 1:
            self.out += b"\x40\x02" + eb.u16(pid)
        elif qos == 2:
            if ok:
                self.in2[pid] = 1
            self.out += b"\x50\x02" + eb.u16(pid)

    def _deliver(self, topic, payload, qos, retain, props):
        for f, fl, r in self.inr:  # noqa: B007 (read after the break)
            if eb.topic_matches(fl, topic):
                break
        else:
            return False
        local = _remap(topic, r["remote_prefix"], r["local_prefix"])
        if self.c["protocol"] == 4:
            # 3.1.1 has no No Local: a topic the bridge also sends up may be
            # our own message coming back, so it is not published locally
            for o in self.outr:
                r2 = o[1]
                if (
                    eb.topic_matches(o[0], local)
                    and _remap(local, r2["local_prefix"], r2["remote_prefix"]) == topic
                ):
                    self.looped += 1
                    return True
        self.inbound = True
        try:
            self.broker.publish(local, payload, min(qos, r["qos"]), bool(retain), props or None)
        except (ValueError, OSError) as e:
            self.indrop += 1
            self.log("warning", "inbound %s not published: %s", local, _why(e))
            return False
        finally:
            self.inbound = False
        return True

    def _close(self):
        s = self.sock
        if s is None:
            return
        self.sock = None
        was = self.up
        self.up = False
        # the socket first: what follows allocates (and _session() starts
        # from fresh state again if it could not)
        eb._io_forget(s)
        try:
            s.close()
        except OSError:
            pass
        self.out = bytearray()
        self.relq = []
        if was:
            self.hiwater = max(self.hiwater, self.sendpos, self.lpos)
            self.log("info", "disconnected: %s", self.err or "-")

    # ------------------------------------------------------------- status
    def state_msg(self):
        """$SYS/broker/bridge/<name>/state: a JSON object (connected,
        backlog messages and bytes, oldest backlog age in seconds or null
        when the wall clock is not set, drops, last error)."""
        import json

        q = self.q
        age = None
        if q.count and q.cursor < q.end:
            now = eb._wallclock()
            pos = q.cursor
            # the first message at or after the cursor (a "K" may come first)
            for _ in range(4):
                rt, body, nxt = q.read(pos)
                if rt is None:
                    break
                if rt == T_MSG:
                    m = decode_msg(body)
                    if m is not None and m[3] and now:
                        age = max(0, now - m[3])
                    break
                pos = nxt
        d = {
            "connected": self.up,
            "backlog": q.count,
            "backlog_bytes": q.nbytes,
            "oldest_age": age,
            "drops": q.drops,
            "dropped_qos0": self.dropped0,
            "latest_skipped": self.lskip,
            "echo_dropped": self.looped,
            "too_large": self.toolarge,
            "latest_untracked": self.lfull,
            "inbound_dropped": self.indrop,
            "expired": self.expired,
            "refused_upstream": self.uprefused,
            "sent": self.sent,
            "acked": self.acked,
            "live_sent": self.lsent,
            "pacing": self.split,
            "last_error": self.err,
        }
        return self.eng.make_msg(
            "$SYS/broker/bridge/%s/state" % self.name, json.dumps(d).encode(), 0, b"", 0
        )

    def _state(self):
        # retained on the local side: $SYS messages are made on demand for
        # a new subscriber (see attach()), live ones go out now
        self.last_state = self.broker.clock()
        eng = self.eng
        eng.now_s = self.last_state
        eng.publish(self.state_msg(), 1, None)
        self.broker._kick()


def _why(e):
    if isinstance(e, _Down):
        return e.args[0] if e.args else "down"
    if isinstance(e, eb.MqttError):
        return e.text
    return repr(e)


async def _writable(s):
    await eb._io_wait(s, True)


async def _wait_io(s, write):
    await eb._io_wait(s, write)


def _blocked(e):
    # would block: EAGAIN, or TLS wanting to read or write first (CPython)
    return (e.args and e.args[0] in eb._EAGAIN) or type(e).__name__ in (
        "SSLWantReadError",
        "SSLWantWriteError",
    )


# MicroPython's socket module has no SO_ERROR: there the first send reports
# a refused connect instead
_SO_ERROR = getattr(socket, "SO_ERROR", None)


def _start_connect(s, addr):
    # A non-blocking connect is under way (EINPROGRESS, by name: 115 on
    # Linux, 119 on the ESP32) or, on lwIP ports, may complete at once and
    # return; anything else is the link's error.
    try:
        s.connect(addr)
    except OSError as e:
        if not e.args or e.args[0] not in eb._EINPROGRESS:
            raise


def _so_error(s):
    if _SO_ERROR is None:
        return 0
    try:
        return s.getsockopt(socket.SOL_SOCKET, _SO_ERROR)
    except (AttributeError, OSError):
        return 0


# ---------------------------------------------------------------- 5. attach
def attach(broker, items, data_dir):
    """Called by edgebroker.start() when the profile has bridges: checks
    them, opens each queue file, registers the sinks and the link tasks."""
    if not data_dir:
        raise ValueError("bridges: need a data directory for the queue files (--data-dir)")
    eb._asyncio()
    out = []
    for c in check(items, broker.cfg["board"]):
        try:
            b = Bridge(broker, c, data_dir)
        except ValueError as e:  # a newer version's queue file (Queue._open)
            broker.log("error", str(e))
            continue
        broker.engine.sinks.append(b)
        broker.extras.append(b.run)
        out.append(b)
    eng = broker.engine
    if eb._Syncer is not None and eng.syncer is None and any(b.durable for b in out):
        eng.syncer = eb._Syncer()  # CPython: the queues' fsyncs beside the loop
    made = eng.sys_msgs

    def sys_msgs():
        # the engine makes $SYS on demand (a new $SYS subscriber, every
        # sys_interval): the bridges' state topics are part of that set
        for m in made():
            yield m
        for b in out:
            yield b.state_msg()

    eng.sys_msgs = sys_msgs
    return out

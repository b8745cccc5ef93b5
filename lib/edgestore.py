# edgestore: the flash-backed retained store of edgebroker (storage_type
# "disc" and "disc_only"). One module, the same file on MicroPython boards and
# on CPython hosts (the broker, the host tools, the fleet pipeline). Nothing
# happens at import; the broker opens a FlashStore through its open_store().
#
# Sections:
#   1. compat        the only place that knows there are two interpreters
#   2. format        constants, record encoding and the shared file reader
#   3. FlashStore    the store (RamStore's interface plus open/compaction)
#   4. inspect       a read-only report of a store file (host tools)
#
# ------------------------------------------------------------------ FORMAT
# A store file, readable in a hex dump (all integers big-endian):
#
#   header   45 42 52 53 "EBRS"   magic
#            01                   format version (the major: a reader refuses
#                                 a higher one and moves the file aside)
#            00 00 00             reserved, written 0, ignored on read
#   records, appended one after another until the next compaction:
#            type    1 byte       "P" 0x50 PUT, "D" 0x44 DEL, "C" 0x43 CLOCK;
#                                 any other type is skipped (length-prefixed)
#            length  4 bytes      of the body
#            body    length bytes
#            crc     4 bytes      binascii.crc32 over type + length + body
#
#   PUT body   topic length (2) | topic (UTF-8) | qos (1) | flags (1) |
#              remaining (4) | stime (4) | wall (4) | props length (4) |
#              props | payload (the rest of the body)
#              flags: 0x01 own Message Expiry (the message's own interval,
#              not the board default), 0x02 has a lifetime.
#              remaining: seconds of lifetime left at stime (0 with 0x02 set
#              means already expired); stime: the store's runtime clock at
#              the write; wall: Unix seconds of the write, 0 = clock not set.
#              props: the MQTT 5.0 property bytes forwarded with the message.
#              A PUT record is 29 bytes + topic + props + payload.
#   DEL body   topic (UTF-8)
#   CLOCK body stime (4) | wall (4, 0 = not set)
#
# The store's runtime clock ("stime") counts seconds the store has been open,
# over all its runs: a run starts at the largest stime recorded in the file
# and adds the broker's monotonic clock. PUT records and CLOCK markers carry
# it, so a reader knows how much running time passed after each PUT.
# (Instead of "runtime since this file's last open", a cumulative clock needs
# no run boundaries in the file; the information is the same.)
#
# ------------------------------------------------------ EXPIRY ACROSS RESTARTS
# Rule E4. At open, a PUT with a lifetime has
#     left = stime + remaining - T            (runtime: T = last stime in file)
# and, when the wall clock is set now AND the record has a wall time,
#     left = min(left, wall + remaining - now_wall)
# A message with left <= 0 is dropped (its bytes are dead); the others get the
# RAM deadline clock() + left. Runtime only counts time the store was open, so
# without a set clock the time between the last CLOCK marker and the next
# open (power-off time, plus at most mark_interval = 60 s of running time
# before an unclean stop; clean close() records it exactly) is unknown and
# not counted: a message may live past its lifetime by at most that downtime,
# never more, and never dies early except by rounding (< 1 s). With a set
# clock it is exact to the second; taking the smaller of the two estimates
# means a clock set wrongly into the past cannot extend a lifetime either.
# CLOCK markers cost wear only while a message with a lifetime is held: one
# 17-byte record per commit (or per expire() sweep) at most every 60 s, and
# one at close(). Messages the broker expires at runtime are dropped from the
# index without a DEL record: the next open recomputes them as expired.
#
# ------------------------------------------------------------- CRASH SAFETY
# put()/delete() append records to a small RAM buffer; commit() writes it,
# flushes and fsyncs (where os.fsync exists; on littlefs flush is the sync)
# and only then does the broker send the PUBACKs that waited (group commit).
# A power cut at any byte leaves: a complete file prefix, whose last record
# may be torn. Opening keeps every record before the torn one, ignores the
# rest and rewrites the file (a compaction) before its next write, so a
# torn tail is never followed by good records. A record with a bad CRC whose
# length still leads to a good record (or the end) is skipped and counted;
# otherwise everything from it on counts as a torn tail (no byte-by-byte
# resync: a payload may itself contain a well-formed record, and recovery
# must never invent one).
# Compaction streams every live record (one at a time) into <path>.new,
# appends a CLOCK marker, flushes, fsyncs, closes, then renames it over the
# file (atomic on littlefs and POSIX; CPython also fsyncs the directory). A
# leftover .new at open is deleted: the old file is intact. If rename cannot
# replace (FAT), the old file is removed first; at open a missing file with a
# complete .new means exactly that cut, and the .new is adopted.
# A file that cannot be read at all (bad magic, a future version) is renamed
# to <path>.bad and the store starts empty, saying so through log; opening
# never raises on a bad file. A 0..7 byte file that is a prefix of the header
# is a store whose creation was cut: it starts empty quietly.
#
# ---------------------------------------------------------------- MEMORY
# Slots are numbered; slot s lives in chunk s >> 8 of an index made of
# array('I') chunks of 256 slots x 3 words: topic hash (30 bits: 10 bits of
# the first level's hash above 20 bits of the topic's hash), file offset of
# the record (bit 29 = the message has a lifetime) and the hash-chain link.
# Buckets (about 4 slots each) are array('I') chunks too. Nothing grows as
# one large block: on MicroPython a large contiguous allocation is what fails
# first. Chunks are preallocated for `capacity` at open (when the heap is
# calm) and added one at a time beyond it. "disc_only" keeps only this index:
# 12 bytes per slot + about 1 for its bucket (measured: 14.6 bytes of heap
# per retained message at 2,000, 64-bit unix port); a get() reads the record
# (verifying topic and CRC). "disc" adds one list chunk per 256
# slots holding the message tuples, so reads never touch flash.
# Iterators walk slot numbers, so puts, deletes, bucket growth and even
# compaction (which changes offsets, never slots) during a long delivery
# never invalidate them: an entry present throughout keeps its slot and is
# yielded once; one added behind the cursor is missed (it went out live).
# So compaction needs no open-iterator count and is never deferred.
# A filter with a literal first level reads only the records whose
# first-level hash matches; a leading wildcard reads them all.

# ---------------------------------------------------------------- 1. compat
import binascii
import os
from array import array
from struct import pack, pack_into, unpack_from

try:
    from micropython import const
except ImportError:  # CPython
    def const(x):
        return x

_crc32 = binascii.crc32
_fsync = getattr(os, "fsync", None)       # CPython; MicroPython flush() syncs
_rename = getattr(os, "replace", os.rename)  # CPython's os.rename may not replace

try:  # MicroPython: an array from raw zero bytes (no list of ints made)
    array("I", bytes(4))

    def _zeros(n):
        return array("I", bytes(n * 4))
except TypeError:  # CPython refuses bytes for 'I'
    def _zeros(n):
        return array("I", [0]) * n

if _fsync is not None and hasattr(os, "O_RDONLY"):
    def _sync_dir(path):
        # a rename is durable only once its directory is (POSIX)
        i = path.rfind("/")
        d = path[:i] if i > 0 else ("/" if i == 0 else ".")
        try:
            fd = os.open(d, os.O_RDONLY)
        except OSError:
            return
        try:
            _fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)
else:  # MicroPython: littlefs commits a rename before returning
    def _sync_dir(path):
        pass

try:  # MicroPython: wrapping milliseconds, unwrapped here
    from time import ticks_diff as _ticks_diff
    from time import ticks_ms as _ticks_ms

    def _default_clock():
        st = [_ticks_ms(), 0]

        def clock():
            t = _ticks_ms()
            st[1] += _ticks_diff(t, st[0])
            st[0] = t
            return st[1] / 1000
        return clock
except ImportError:  # CPython
    from time import monotonic as _monotonic

    def _default_clock():
        return _monotonic


def _no_wall():
    return None


class Fs:
    """Every filesystem call the store makes. Pass another object with the
    same methods as FlashStore(fs=...) to simulate power cuts (the crash
    tests do): the store has no test-only branches."""

    def open(self, path, mode):
        return open(path, mode)

    def sync(self, f):
        f.flush()
        if _fsync is not None:
            _fsync(f.fileno())

    def rename(self, src, dst):
        _rename(src, dst)

    def remove(self, path):
        os.remove(path)

    def exists(self, path):
        try:
            os.stat(path)
            return True
        except OSError:
            return False

    def sync_dir(self, path):
        _sync_dir(path)


# ---------------------------------------------------------------- 2. format
MAGIC = b"EBRS"
VERSION = 1
HEADER = b"EBRS\x01\x00\x00\x00"
T_PUT = const(0x50)    # "P"
T_DEL = const(0x44)    # "D"
T_CLOCK = const(0x43)  # "C"
F_OWN = const(1)       # PUT flags: own Message Expiry
F_EXP = const(2)       # has a lifetime
PUT_OVERHEAD = const(29)  # record bytes beyond topic + props + payload
CLOCK_SIZE = const(17)

_HDR = const(8)
_OK = const(0)
_BAD = const(1)
_TORN = const(2)

_CH = const(256)       # slots per index chunk
_CH2 = const(512)
_BCH = const(1024)     # buckets per bucket chunk
_OEXP = const(0x20000000)  # offset word: the message has a lifetime
_OFFM = const(0x1FFFFFFF)  # offset word: file offset (files up to 512 MB)
_U32 = const(0xFFFFFFFF)


def _buckets(nb):
    # hash buckets as 1,024-word array chunks: no large contiguous block
    if nb <= _BCH:
        return [_zeros(nb)]
    return [_zeros(_BCH) for _ in range(nb // _BCH)]


def topic_hash(tb):
    """30-bit stable hash of topic bytes: 10 bits of the first level's
    CRC-32 above 20 bits of the whole topic's. CRC-32 runs in C on both
    interpreters and, unlike a per-byte FNV loop, makes no big ints on
    32-bit boards; values stay below 2**30 (MicroPython small ints)."""
    i = tb.find(b"/")
    if i < 0:
        c = f = _crc32(tb)
    else:
        f = _crc32(tb[:i])
        c = _crc32(tb[i:], f)  # crc32 of the whole topic, continued
    return (f & 0x3FF) << 20 | (c & 0xFFFFF)


def _first_hash(level):
    return _crc32(level.encode()) & 0x3FF


def header_kind(head, size):
    """'ok', 'partial' (a cut creation: a 0..7 byte prefix of the header),
    'future_version', 'bad_version' or 'bad_magic'."""
    if size >= _HDR and head[:4] == MAGIC:
        v = head[4]
        if v == VERSION:
            return "ok"
        return "future_version" if v > VERSION else "bad_version"
    if size < _HDR and head == HEADER[:size]:
        return "partial"
    return "bad_magic"


def encode(rt, parts):
    """One whole record (bytearray) of type rt whose body is the parts."""
    blen = 0
    for p in parts:
        blen += len(p)
    b = bytearray(blen + 9)
    _fill(b, 0, rt, blen, parts)
    return b


def _fill(b, p0, rt, blen, parts):
    mv = memoryview(b)
    pack_into(">BI", b, p0, rt, blen)
    q = p0 + 5
    for p in parts:
        n = len(p)
        mv[q:q + n] = p
        q += n
    pack_into(">I", b, q, _crc32(mv[p0:q]) & _U32)


def put_parts(tb, qos, flags, remaining, stime, wall, props, payload):
    """The body of a PUT record, as parts for encode()."""
    return (pack(">H", len(tb)), tb,
            pack(">BBIIII", qos, flags, remaining, stime, wall, len(props)),
            props, payload)


def decode_put(b, blen):
    """(topic bytes, qos, flags, remaining, stime, wall, props, payload) of a
    PUT body (bytes or memoryview), or None when its fields do not fit."""
    if blen < 20:
        return None
    tl = b[0] << 8 | b[1]
    if 20 + tl > blen:
        return None
    qos, flags, rem, st, wall, pl = unpack_from(">BBIIII", b, 2 + tl)
    j = 20 + tl
    if j + pl > blen or qos > 2:
        return None
    # bytes() copies a memoryview's slice and returns a bytes slice as it is
    return (bytes(b[2:2 + tl]), qos, flags, rem, st, wall, bytes(b[j:j + pl]),
            bytes(b[j + pl:blen]))


def _put_topic(b, blen):
    """decode_put() and the topic as text: (fields, topic), or None for a
    record that is not a well-formed PUT (open and inspect skip it alike)."""
    p = decode_put(b, blen)
    if p is not None:
        try:
            return p, str(p[0], "utf-8")
        except UnicodeError:
            pass
    return None


def _valid_at(f, pos, size):
    # is there a whole record with a good CRC at pos?
    if size - pos < 9:
        return False
    f.seek(pos)
    h = f.read(5)
    blen = unpack_from(">I", h, 1)[0]
    if pos + 9 + blen > size:
        return False
    rest = f.read(blen + 4)
    if len(rest) != blen + 4:
        return False
    return _crc32(memoryview(rest)[:blen], _crc32(h)) & _U32 == unpack_from(">I", rest, blen)[0]


def scan(f, size, pos=_HDR):
    """The one reader of store files (FlashStore's open and inspect()).
    Yields (offset, type, data, status) from pos to size: status _OK with
    data = body + crc (the body is data[:len(data) - 4]); _BAD for a record
    with a bad CRC that is skipped (data None); _TORN last, for the torn
    tail or the unreadable rest of the file (data None). It seeks before
    every read, so the caller may read elsewhere between records."""
    while pos < size:
        if size - pos < 9:
            yield pos, 0, None, _TORN
            return
        f.seek(pos)
        h = f.read(5)
        if len(h) != 5:
            yield pos, 0, None, _TORN
            return
        rt = h[0]
        blen = unpack_from(">I", h, 1)[0]
        end = pos + 9 + blen
        if end > size:
            yield pos, rt, None, _TORN
            return
        rest = f.read(blen + 4)
        if len(rest) != blen + 4:
            yield pos, rt, None, _TORN
            return
        if _crc32(memoryview(rest)[:blen], _crc32(h)) & _U32 == unpack_from(">I", rest, blen)[0]:
            yield pos, rt, rest, _OK
            pos = end
        elif end == size or _valid_at(f, end, size):
            yield pos, rt, None, _BAD
            pos = end
        else:
            yield pos, rt, None, _TORN
            return


def _matches(flevels, topic):
    # topic filter matching (MQTT-4.7): the broker's topic_matches, kept here
    # so host tools import this module without the broker
    if topic[:1] == "$" and flevels[0] in ("+", "#"):
        return False  # MQTT-4.7.2-1
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


# ------------------------------------------------------------ 3. FlashStore
class FlashStore:
    """The retained store on flash: RamStore's interface (see edgebroker.py
    section 6), durable.

      get(topic) -> msg or None       put(topic, msg)     delete(topic) -> bool
      match(filter levels) -> iterator of msgs, safe while the store changes
      count, nbytes                   durable = True
      commit()                        expire(now, budget) -> removed
      close()
    and beyond it: compact(), messages(), stats(), open_stats (what opening
    found: records, live, dead_bytes, torn_bytes, corrupt, skipped_unknown,
    expired, moved_aside, created), bytes_written (every byte written to
    flash, compaction included), compactions, dead_bytes, file_bytes.

    A message is the broker's tuple: (topic str, topic bytes, payload bytes,
    qos, forwarded 5.0 property bytes, expiry deadline in `clock` seconds or
    0, own-expiry flag 0/1). `clock` must be the broker's clock.

    mode: "disc" (RAM copy of every message + file) or "disc_only" (RAM
    holds only the index). capacity: max_retained_messages (0 = no limit;
    the index grows in chunks). wallclock(): Unix seconds, or None while the
    board clock was never set. log(level, text): where open and compaction
    report. fs: filesystem calls (Fs). mark_interval: seconds between CLOCK
    markers. buffer_size: the write buffer (bigger records go straight out).
    A write error marks the file as torn: the next write rewrites it."""

    durable = True

    def __init__(self, path, mode="disc", capacity=1000, clock=None, wallclock=None,
                 compact_ratio=0.5, compact_min_bytes=4096, log=None, fs=None,
                 mark_interval=60, buffer_size=1024):
        if mode != "disc" and mode != "disc_only":
            raise ValueError("mode must be 'disc' or 'disc_only'")
        self.path = path
        self.mode = mode
        self._fs = fs if fs is not None else Fs()
        self._clock = clock if clock is not None else _default_clock()
        self._wallf = wallclock if wallclock is not None else _no_wall
        self._ratio = compact_ratio
        self._min = compact_min_bytes
        self._logf = log
        self._mark_every = mark_interval
        self.count = 0
        self.nbytes = 0
        self.bytes_written = 0
        self.compactions = 0
        self._live = 0          # bytes of live PUT records
        self._nexp = 0          # live messages with a lifetime
        self._f = None
        self._fend = _HDR       # logical end of the file's good records
        self._wb = bytearray(buffer_size)
        self._wn = 0            # bytes waiting in _wb (offsets _fend + i)
        self._unsynced = False
        self._torn = False      # bytes after _fend: rewrite before writing
        self._skip = 0          # dead bytes below which compaction waits (after a failure)
        self._flen = 0          # body length of the record _find last verified
        self._sweep = 0
        # the index
        # Board capacities (hundreds to a few thousand) are preallocated in
        # full at this calm moment; a host-sized one (100,000) is not: its
        # first 4,096 slots are, the rest come a chunk at a time, and buckets
        # stop at 16,384 (longer chains past 65,536 messages).
        nb = 16
        while nb * 4 < capacity and nb < 16384:
            nb *= 2
        self._nb = nb
        self._bk = None
        self._alloc_buckets()
        self._ix = []
        self._msgs = [] if mode == "disc" else None
        for _ in range((min(capacity, 4096) + _CH - 1) // _CH):
            self._add_chunk()
        self._hi = 0            # slots ever used
        self._free = 0          # first free slot + 1 (a list through the link words)
        self._open()

    # ------------------------------------------------------------ helpers
    def _log(self, level, text):
        if self._logf is not None:
            self._logf(level, text)

    def _alloc_buckets(self):
        self._bk = _buckets(self._nb)

    def _add_chunk(self):
        # both allocations first: a MemoryError leaves the index as it was
        c = _zeros(3 * _CH)
        m = [None] * _CH if self._msgs is not None else None
        self._ix.append(c)
        if m is not None:
            self._msgs.append(m)

    def _wall(self):
        w = self._wallf()
        if w is None or w <= 0:
            return 0
        w = int(w)
        return w if w <= _U32 else _U32

    def _stime(self):
        # the store's runtime clock, whole seconds (floored)
        return self._t0 + int(self._clock() - self._c0)

    def _left(self, st, rem, wall):
        # seconds of lifetime left at this run's open (E4, module comment)
        left = st + rem - self._t0
        if wall and self._wall0:
            lw = wall + rem - self._wall0
            if lw < left:
                left = lw
        return left

    def _deadline(self, st, rem, wall):
        d = self._c0 + self._left(st, rem, wall)
        return d if d else -1  # 0 would mean "no lifetime"

    def _pread(self, off, n):
        # n bytes at a logical offset: from the file or the write buffer
        if off >= self._fend:
            i = off - self._fend
            return bytes(memoryview(self._wb)[i:i + n])
        f = self._f
        f.seek(off)
        return f.read(n)

    def _raw(self, off, blen=-1):
        # (header, body + crc) of the record at off, or None on a bad CRC;
        # one read when the body length is known (_find just read it)
        if blen >= 0:
            r = self._pread(off, blen + 9)
            if len(r) != blen + 9:
                return None
            h = r[:5]
            rest = memoryview(r)[5:]
            if unpack_from(">I", h, 1)[0] != blen:
                return None
        else:
            h = self._pread(off, 5)
            if len(h) != 5:
                return None
            blen = unpack_from(">I", h, 1)[0]
            rest = self._pread(off + 5, blen + 4)
            if len(rest) != blen + 4:
                return None
        if _crc32(memoryview(rest)[:blen], _crc32(h)) & _U32 != unpack_from(">I", rest, blen)[0]:
            return None
        return h, rest

    def _head(self, off):
        # (record length, flags, remaining, stime, wall) of a PUT, two small reads
        h = self._pread(off, 7)
        tl = h[5] << 8 | h[6]
        _, flags, rem, st, wall = unpack_from(">BBIII", self._pread(off + 7 + tl, 14), 0)
        return unpack_from(">I", h, 1)[0] + 9, flags, rem, st, wall

    def _find(self, tb, th):
        # slot of topic bytes tb (hash th) or -1; disc_only leaves the
        # record's body length in _flen
        b = th & (self._nb - 1)
        s = self._bk[b >> 10][b & 1023] - 1
        ix = self._ix
        msgs = self._msgs
        tl = len(tb)
        while s >= 0:
            c = ix[s >> 8]
            k = s & 255
            if c[k] == th:
                if msgs is not None:
                    if msgs[s >> 8][k][1] == tb:
                        return s
                else:
                    off = c[_CH + k] & _OFFM
                    h = self._pread(off, 7 + tl)
                    if len(h) == 7 + tl and h[5] << 8 | h[6] == tl and h[7:] == tb:
                        self._flen = unpack_from(">I", h, 1)[0]
                        return s
            s = c[_CH2 + k] - 1
        return -1

    def _size_of(self, s):
        # record bytes of the live slot s
        if self._msgs is not None:
            m = self._msgs[s >> 8][s & 255]
            return PUT_OVERHEAD + len(m[1]) + len(m[2]) + len(m[4])
        h = self._pread(self._ix[s >> 8][_CH + (s & 255)] & _OFFM, 5)
        return unpack_from(">I", h, 1)[0] + 9

    def _new_slot(self, th):
        s = self._free - 1
        if s >= 0:
            self._free = self._ix[s >> 8][_CH2 + (s & 255)]
        else:
            s = self._hi
            if s >> 8 >= len(self._ix):
                self._add_chunk()
            self._hi = s + 1
        c = self._ix[s >> 8]
        k = s & 255
        c[k] = th
        b = th & (self._nb - 1)
        bc = self._bk[b >> 10]
        c[_CH2 + k] = bc[b & 1023]
        bc[b & 1023] = s + 1
        return s

    def _unlink(self, s):
        # takes slot s out of its chain and onto the free list
        ix = self._ix
        c = ix[s >> 8]
        k = s & 255
        b = c[k] & (self._nb - 1)
        bc = self._bk[b >> 10]
        nxt = c[_CH2 + k]
        p = bc[b & 1023] - 1
        if p == s:
            bc[b & 1023] = nxt
        else:
            while p >= 0:
                pc = ix[p >> 8]
                n = pc[_CH2 + (p & 255)] - 1
                if n == s:
                    pc[_CH2 + (p & 255)] = nxt
                    break
                p = n
        c[k] = 0
        c[_CH + k] = 0
        c[_CH2 + k] = self._free
        self._free = s + 1
        if self._msgs is not None:
            self._msgs[s >> 8][k] = None

    def _forget(self, s, size):
        # the slot's message is gone (delete, expiry, drop): counters + unlink
        if self._ix[s >> 8][_CH + (s & 255)] & _OEXP:
            self._nexp -= 1
        self._unlink(s)
        self.count -= 1
        self._live -= size
        self.nbytes -= size - PUT_OVERHEAD

    def _rethread(self):
        # rebuilds every chain and the free list from the hash and offset
        # words (after compaction used the link words, or the buckets grew)
        for bc in self._bk:
            for j in range(len(bc)):
                bc[j] = 0
        ix = self._ix
        bk = self._bk
        m = self._nb - 1
        free = 0
        for s in range(self._hi - 1, -1, -1):
            c = ix[s >> 8]
            k = s & 255
            if c[_CH + k]:
                b = c[k] & m
                bc = bk[b >> 10]
                c[_CH2 + k] = bc[b & 1023]
                bc[b & 1023] = s + 1
            else:
                c[_CH2 + k] = free
                free = s + 1
        self._free = free

    def _grow_buckets(self):
        bk = _buckets(self._nb * 2)  # may raise MemoryError: nothing changed yet
        self._nb *= 2
        self._bk = bk
        self._rethread()

    # ------------------------------------------------------------ writing
    def _write(self, data):
        f = self._f
        if f is None:
            raise OSError(9)  # EBADF: closed
        n = len(data)
        ok = False
        try:
            f.seek(self._fend)
            r = f.write(data)
            ok = r is None or r == n
        finally:
            if not ok:
                self._torn = True  # unknown bytes after _fend now
        if not ok:
            raise OSError(5)  # EIO: short write
        self._fend += n
        self.bytes_written += n
        self._unsynced = True

    def _flush_buf(self):
        if self._wn:
            self._write(memoryview(self._wb)[:self._wn])
            self._wn = 0

    def _emit(self, rt, parts):
        # appends a record; returns its logical offset
        blen = 0
        for p in parts:
            blen += len(p)
        n = blen + 9
        wb = self._wb
        if self._wn + n > len(wb):
            self._flush_buf()
        if n > len(wb):
            off = self._fend
            self._write(encode(rt, parts))
            return off
        off = self._fend + self._wn
        _fill(wb, self._wn, rt, blen, parts)
        self._wn += n
        return off

    def _clock_record(self):
        st = self._stime()
        self._emit(T_CLOCK, (pack(">II", st, self._wall()),))
        self._tmark = st

    def _parts(self, msg, st):
        dl = msg[5]
        flags = 0
        rem = 0
        if dl:
            flags = F_EXP | (F_OWN if msg[6] else 0)
            rem = int(dl - (self._c0 + st - self._t0))  # floored: never late
            if rem < 0:
                rem = 0
            elif rem > _U32:
                rem = _U32
        elif msg[6]:
            flags = F_OWN
        return put_parts(msg[1], msg[3], flags, rem, st, self._wall(), msg[4], msg[2]), flags

    def _ready(self):
        if self._f is None:
            raise OSError(9)  # EBADF: closed
        if self._torn:
            self.compact()  # never append after unknown bytes

    # ------------------------------------------------------------ interface
    def get(self, topic):
        if self._f is None:
            return None
        tb = topic.encode()
        s = self._find(tb, topic_hash(tb))
        if s < 0:
            return None
        return self._load(s, -1 if self._msgs is not None else self._flen)

    def put(self, topic, msg):
        self._ready()
        tb = msg[1]
        th = topic_hash(tb)
        s = self._find(tb, th)
        old = -1
        if s >= 0:
            old = self._size_of(s) if self._msgs is not None else self._flen + 9
        if s < 0 and self._free == 0 and self._hi >> 8 >= len(self._ix):
            self._add_chunk()  # before anything is written (MemoryError-safe)
        parts, flags = self._parts(msg, self._stime())
        off = self._emit(T_PUT, parts)
        size = PUT_OVERHEAD + len(tb) + len(msg[4]) + len(msg[2])
        if s >= 0:
            c = self._ix[s >> 8]
            if c[_CH + (s & 255)] & _OEXP:
                self._nexp -= 1
            self._live += size - old
            self.nbytes += size - old
        else:
            s = self._new_slot(th)
            c = self._ix[s >> 8]
            self.count += 1
            self._live += size
            self.nbytes += size - PUT_OVERHEAD
        c[_CH + (s & 255)] = off | (_OEXP if flags & F_EXP else 0)
        if flags & F_EXP:
            self._nexp += 1
        if self._msgs is not None:
            self._msgs[s >> 8][s & 255] = msg
        if self.count > 4 * self._nb and self._nb < 0x100000:
            try:
                self._grow_buckets()
            except MemoryError:
                pass  # longer hash chains, nothing lost; tried again later

    def delete(self, topic):
        self._ready()
        tb = topic.encode()
        s = self._find(tb, topic_hash(tb))
        if s < 0:
            return False  # nothing written: no wear for a no-op
        size = self._size_of(s) if self._msgs is not None else self._flen + 9
        self._emit(T_DEL, (tb,))
        self._forget(s, size)
        return True

    def match(self, flevels):
        first = flevels[0]
        if first == "+" or first == "#":
            fh = -1
        elif "+" in flevels or "#" in flevels:
            fh = _first_hash(first)
        else:
            m = self.get("/".join(flevels))
            if m is not None:
                yield m
            return
        s = 0
        while self._f is not None and s < self._hi:
            c = self._ix[s >> 8]
            k = s & 255
            if c[_CH + k] and (fh < 0 or c[k] >> 20 == fh):
                m = self._load(s)
                if m is not None and _matches(flevels, m[0]):
                    yield m
            s += 1

    def messages(self):
        """Every message, in slot order (same safety as match())."""
        s = 0
        while self._f is not None and s < self._hi:
            if self._ix[s >> 8][_CH + (s & 255)]:
                m = self._load(s)
                if m is not None:
                    yield m
            s += 1

    def _load(self, s, blen=-1):
        if self._msgs is not None:
            return self._msgs[s >> 8][s & 255]
        r = self._raw(self._ix[s >> 8][_CH + (s & 255)] & _OFFM, blen)
        if r is None:
            self._log("error", "retained record of slot %d unreadable (bad CRC)" % s)
            return None
        rest = r[1]
        p = decode_put(rest, len(rest) - 4)
        if p is None or r[0][0] != T_PUT:
            return None
        tb, qos, flags, rem, st, wall, props, payload = p
        try:
            topic = str(tb, "utf-8")
        except UnicodeError:
            return None
        return (topic, tb, payload, qos, props,
                self._deadline(st, rem, wall) if flags & F_EXP else 0, flags & F_OWN)

    def expire(self, now, budget):
        """Drops messages whose deadline has passed, looking at `budget`
        slots per call and resuming where the last call stopped (bounded
        work per call; disc_only reads the head of flagged records only).
        It also makes pending writes durable and records a CLOCK marker when
        one is due, so QoS 0 retained changes reach flash within a tick."""
        removed = 0
        if self._f is None:
            return 0
        s = self._sweep
        ix = self._ix
        msgs = self._msgs
        for _ in range(budget):
            if s >= self._hi:
                s = 0
                break
            o = ix[s >> 8][_CH + (s & 255)]
            if o & _OEXP:
                if msgs is not None:
                    m = msgs[s >> 8][s & 255]
                    gone = m[5] <= now
                    size = PUT_OVERHEAD + len(m[1]) + len(m[2]) + len(m[4])
                else:
                    size, flags, rem, st, wall = self._head(o & _OFFM)
                    gone = self._deadline(st, rem, wall) <= now
                    m = self._load(s) if gone else None
                if gone:
                    # a DEL makes the expiry durable: without a set clock a
                    # reopen could not tell that the lifetime had passed (E4)
                    if m is not None:
                        self._emit(T_DEL, (m[1],))
                    self._forget(s, size)
                    removed += 1
            s += 1
        self._sweep = s
        if (self._wn or self._unsynced or self._torn
                or (self._nexp and self._stime() - self._tmark >= self._mark_every)):
            try:
                self.commit()
            except OSError as e:
                self._log("error", "retained store write failed: %r" % (e,))
        return removed

    def commit(self):
        """Makes every put/delete so far durable: writes the buffer, flushes
        and fsyncs. Compacts afterwards when dead bytes pass the ratio."""
        if self._f is None:
            return
        if self._torn:
            self.compact()  # a complete rewrite: durable when it returns
            return
        if self._nexp and self._stime() - self._tmark >= self._mark_every:
            self._clock_record()
        self._flush_buf()
        if self._unsynced:
            self._fs.sync(self._f)
            self._unsynced = False
        size = self._fend
        dead = size - _HDR - self._live
        if size > self._min and dead > self._ratio * size and dead >= self._skip:
            try:
                self.compact()
            except OSError as e:
                if self._f is None:
                    raise
                # everything is durable already; try again after more churn
                self._skip = dead + self._min
                self._log("error", "compaction failed: %r" % (e,))

    def close(self):
        f = self._f
        if f is None:
            return
        try:
            if self._nexp and not self._torn:
                self._clock_record()  # the exact runtime, for E4
            if self._torn:
                self.compact()
            else:
                self._flush_buf()
                if self._unsynced:
                    self._fs.sync(f)
                    self._unsynced = False
        finally:
            if self._f is not None:
                self._f.close()
            self._f = None

    # ------------------------------------------------------------ compaction
    def compact(self):
        """Writes every live record to <path>.new (streaming, one record at
        a time), appends a CLOCK marker, syncs, closes and renames it over
        the file. Offsets change, slots do not: open iterators stay valid.
        Expired messages and unreadable records are dropped on the way."""
        f = self._f
        if f is None:
            raise OSError(9)
        fs = self._fs
        path = self.path
        new = path + ".new"
        ix = self._ix
        msgs = self._msgs
        now = self._clock()
        g = fs.open(new, "wb")
        ok = False
        try:
            g.write(HEADER)
            pos = _HDR
            for s in range(self._hi):
                c = ix[s >> 8]
                k = s & 255
                o = c[_CH + k]
                if not o:
                    continue
                r = self._raw(o & _OFFM)
                if r is None and msgs is not None:
                    # flash rot under a RAM copy: write the copy again
                    r = (encode(T_PUT, self._parts(msgs[s >> 8][k], self._stime())[0]), b"")
                    o = (o & _OFFM) | (_OEXP if msgs[s >> 8][k][5] else 0)
                    c[_CH + k] = o
                if r is None:
                    self._log("error", "retained record of slot %d unreadable: dropped" % s)
                    self._drop_marked(s)
                    continue
                if o & _OEXP:
                    if msgs is not None:
                        dl = msgs[s >> 8][k][5]
                    else:
                        rest = r[1]
                        tl = rest[0] << 8 | rest[1]
                        _, _, rem, st, wall = unpack_from(">BBIII", rest, 2 + tl)
                        dl = self._deadline(st, rem, wall)
                    if dl <= now:
                        self._drop_marked(s)
                        continue
                g.write(r[0])
                g.write(r[1])
                c[_CH2 + k] = pos  # the new offset, until the chains are rebuilt
                pos += len(r[0]) + len(r[1])
            live = pos - _HDR
            st = self._stime()
            g.write(encode(T_CLOCK, (pack(">II", st, self._wall()),)))
            pos += CLOCK_SIZE
            fs.sync(g)
            g.close()
            g = None
            ok = True
        finally:
            if not ok:
                if g is not None:
                    try:
                        g.close()
                    except Exception:
                        pass
                try:
                    fs.remove(new)
                except Exception:
                    pass
                self._rethread()
        self.bytes_written += pos
        renamed = False
        try:
            self._f = None
            f.close()
            try:
                fs.rename(new, path)
            except OSError:
                # FAT cannot rename over a file: remove, then rename; an open
                # that finds only a complete .new adopts it
                fs.remove(path)
                fs.rename(new, path)
            renamed = True
            for s in range(self._hi):
                c = ix[s >> 8]
                k = s & 255
                o = c[_CH + k]
                if o:
                    c[_CH + k] = c[_CH2 + k] | (o & _OEXP)
            self._fend = pos
            self._wn = 0
            self._torn = False
            self._unsynced = False
            self._live = live
            self._tmark = st
            self._skip = 0
            self.compactions += 1
            fs.sync_dir(path)
            self._f = fs.open(path, "r+b")
        finally:
            self._rethread()
            if not renamed:
                try:
                    self._f = fs.open(path, "r+b")
                except Exception:
                    self._f = None

    def _drop_marked(self, s):
        # compaction drops a slot; the chains are rebuilt afterwards
        c = self._ix[s >> 8]
        k = s & 255
        size = self._size_of(s) if self._msgs is not None else self._head(c[_CH + k] & _OFFM)[0]
        if c[_CH + k] & _OEXP:
            self._nexp -= 1
        c[k] = 0
        c[_CH + k] = 0
        if self._msgs is not None:
            self._msgs[s >> 8][k] = None
        self.count -= 1
        self._live -= size
        self.nbytes -= size - PUT_OVERHEAD

    # ------------------------------------------------------------ stats
    @property
    def file_bytes(self):
        return self._fend + self._wn

    @property
    def dead_bytes(self):
        return self._fend + self._wn - _HDR - self._live

    def stats(self):
        return {"count": self.count, "nbytes": self.nbytes, "file_bytes": self.file_bytes,
                "live_bytes": self._live, "dead_bytes": self.dead_bytes,
                "bytes_written": self.bytes_written, "compactions": self.compactions,
                "expiring": self._nexp}

    # ------------------------------------------------------------ opening
    def _open(self):
        fs = self._fs
        path = self.path
        new = path + ".new"
        self._c0 = self._clock()
        self._wall0 = self._wall()
        self._t0 = 0
        self._tmark = 0
        st = self.open_stats = {
            "records": 0, "live": 0, "dead_bytes": 0, "torn_bytes": 0, "corrupt": 0,
            "skipped_unknown": 0, "expired": 0, "moved_aside": False, "created": False,
        }
        if fs.exists(new):
            if fs.exists(path) or not self._complete(new):
                fs.remove(new)  # the rename never happened: the old file is intact
            else:
                fs.rename(new, path)  # cut between remove and rename (FAT)
                self._log("warning", "%s: adopted the compacted %s" % (path, new))
        if not fs.exists(path):
            self._create()
            return
        f = fs.open(path, "r+b")
        self._f = f
        kind = "bad_magic"
        try:
            size = f.seek(0, 2)
            f.seek(0)
            kind = header_kind(f.read(_HDR), size)
            if kind == "ok":
                self._load_all(f, size)
        except MemoryError:
            raise
        except Exception as e:  # a bad file must not stop the broker
            self._log("error", "%s: unreadable (%r)" % (path, e))
            kind = "unreadable"
        if kind == "ok":
            return
        self._f = None
        f.close()
        self._reset()
        if kind == "partial":
            fs.remove(path)
            self._log("info", "%s: creation was cut, starting empty" % path)
        else:
            bad = path + ".bad"
            if fs.exists(bad):
                fs.remove(bad)
            fs.rename(path, bad)
            st["moved_aside"] = True
            self._log("warning", "%s: %s, moved aside to %s; retained store starts empty"
                      % (path, kind, bad))
        self._create()

    def _complete(self, path):
        # a .new is complete once it has a good header (it is synced before
        # the old file is removed)
        try:
            g = self._fs.open(path, "rb")
            try:
                head = g.read(_HDR)
            finally:
                g.close()
            return header_kind(head, len(head)) == "ok"
        except OSError:
            return False

    def _reset(self):
        for c in self._ix:
            for j in range(len(c)):
                c[j] = 0
        if self._msgs is not None:
            for ch in self._msgs:
                for j in range(_CH):
                    ch[j] = None
        for bc in self._bk:
            for j in range(len(bc)):
                bc[j] = 0
        self._hi = 0
        self._free = 0
        self.count = 0
        self.nbytes = 0
        self._live = 0
        self._nexp = 0
        self._torn = False
        self._t0 = 0

    def _create(self):
        fs = self._fs
        g = fs.open(self.path, "wb")
        try:
            g.write(HEADER)
            fs.sync(g)
        finally:
            g.close()
        fs.sync_dir(self.path)
        self.bytes_written += _HDR
        self._fend = _HDR
        self._f = fs.open(self.path, "r+b")
        self.open_stats["created"] = True

    def _load_all(self, f, size):
        st = self.open_stats
        msgs = self._msgs
        end = size
        t0 = 0
        self._fend = size  # _pread reads the file below this
        for off, rt, b, status in scan(f, size):
            if status == _TORN:
                end = off
                break
            if status == _BAD:
                st["corrupt"] += 1
                self._log("warning", "%s: corrupt record at %d skipped" % (self.path, off))
                continue
            st["records"] += 1
            blen = len(b) - 4
            if rt == T_PUT:
                pt = _put_topic(b, blen)
                if pt is None:
                    st["corrupt"] += 1
                    self._log("warning", "%s: malformed record at %d skipped" % (self.path, off))
                    continue
                p, topic = pt
                tb, qos, flags, rem, stime, wall, props, payload = p
                if stime > t0:
                    t0 = stime
                th = topic_hash(tb)
                s = self._find(tb, th)
                size_r = blen + 9
                if s >= 0:
                    self._forget(s, self._size_of(s) if msgs is not None else self._flen + 9)
                s = self._new_slot(th)
                self.count += 1
                self._live += size_r
                self.nbytes += size_r - PUT_OVERHEAD
                if flags & F_EXP:
                    self._nexp += 1
                self._ix[s >> 8][_CH + (s & 255)] = off | (_OEXP if flags & F_EXP else 0)
                if msgs is not None:
                    # the deadline waits for the end of the scan (T is not known yet)
                    msgs[s >> 8][s & 255] = (topic, tb, payload, qos, props,
                                             (stime, rem, wall) if flags & F_EXP else 0,
                                             flags & F_OWN)
                if self.count > 4 * self._nb and self._nb < 0x100000:
                    self._grow_buckets()
            elif rt == T_DEL:
                tb = bytes(b[:blen])
                s = self._find(tb, topic_hash(tb))
                if s >= 0:
                    self._forget(s, self._size_of(s) if msgs is not None else self._flen + 9)
            elif rt == T_CLOCK and blen >= 8:
                stime = unpack_from(">I", b, 0)[0]
                if stime > t0:
                    t0 = stime
            else:
                st["skipped_unknown"] += 1
        self._fend = end
        if end < size:
            st["torn_bytes"] = size - end
            self._torn = True
            self._log("warning", "%s: torn tail of %d bytes at %d ignored"
                      % (self.path, size - end, end))
        self._t0 = t0
        self._tmark = t0
        # E4: lifetimes left, now that the last runtime T is known
        expired = 0
        if self._nexp:
            ix = self._ix
            for s in range(self._hi):
                o = ix[s >> 8][_CH + (s & 255)]
                if not o & _OEXP:
                    continue
                if msgs is not None:
                    m = msgs[s >> 8][s & 255]
                    stime, rem, wall = m[5]
                    size_r = PUT_OVERHEAD + len(m[1]) + len(m[2]) + len(m[4])
                else:
                    size_r, _, rem, stime, wall = self._head(o & _OFFM)
                left = self._left(stime, rem, wall)
                if left <= 0:
                    self._forget(s, size_r)
                    expired += 1
                elif msgs is not None:
                    d = self._c0 + left
                    msgs[s >> 8][s & 255] = (m[0], m[1], m[2], m[3], m[4], d if d else -1, m[6])
        st["expired"] = expired
        st["live"] = self.count
        st["dead_bytes"] = end - _HDR - self._live


# ------------------------------------------------------------ 4. inspect
def inspect(path, wall_now=None, fs=None):
    """A read-only report of a store file as a dict of plain values (JSON
    ready): header, every live message (topic, qos, sizes, expiry), dead,
    torn and corrupt bytes. Decides exactly as FlashStore's open does, but
    never changes the file. For host tools; it builds lists in RAM."""
    fs = fs if fs is not None else Fs()
    rep = {
        "path": path, "status": "ok", "damaged": False, "file_bytes": 0,
        "header": {"magic": "", "version": None, "kind": "missing"},
        "records": 0, "by_type": {}, "live": [], "expired": [], "live_bytes": 0,
        "dead_bytes": 0, "torn_bytes": 0, "torn_offset": None, "corrupt": 0,
        "corrupt_offsets": [], "skipped_unknown": 0, "unknown_types": [],
        "clock": {"stime": 0, "wall": 0},
    }
    f = fs.open(path, "rb")
    try:
        size = f.seek(0, 2)
        f.seek(0)
        head = f.read(_HDR)
        rep["file_bytes"] = size
        kind = header_kind(head, size)
        rep["header"] = {"magic": str(binascii.hexlify(head[:4]), "ascii"),
                         "version": head[4] if len(head) > 4 else None, "kind": kind}
        if kind != "ok":
            rep["status"] = kind
            rep["damaged"] = True
            return rep
        live = {}
        t_end = 0
        wall_end = 0
        names = {T_PUT: "PUT", T_DEL: "DEL", T_CLOCK: "CLOCK"}
        end = size
        for off, rt, b, status in scan(f, size):
            if status == _TORN:
                end = off
                break
            if status == _BAD:
                rep["corrupt"] += 1
                rep["corrupt_offsets"].append(off)
                continue
            rep["records"] += 1
            name = names.get(rt, "0x%02x" % rt)
            rep["by_type"][name] = rep["by_type"].get(name, 0) + 1
            blen = len(b) - 4
            if rt == T_PUT:
                pt = _put_topic(b, blen)
                if pt is None:
                    rep["corrupt"] += 1
                    rep["corrupt_offsets"].append(off)
                    continue
                p, topic = pt
                if p[4] > t_end:
                    t_end = p[4]
                    wall_end = p[5] or wall_end
                live[topic] = (off, blen + 9, p)
            elif rt == T_DEL:
                try:
                    live.pop(str(bytes(b[:blen]), "utf-8"), None)
                except UnicodeError:
                    pass
            elif rt == T_CLOCK and blen >= 8:
                stime, wall = unpack_from(">II", b, 0)
                if stime >= t_end:
                    t_end = stime
                    wall_end = wall or wall_end
            else:
                rep["skipped_unknown"] += 1
                if name not in rep["unknown_types"]:
                    rep["unknown_types"].append(name)
        if end < size:
            rep["torn_bytes"] = size - end
            rep["torn_offset"] = end
        rep["clock"] = {"stime": t_end, "wall": wall_end}
        live_bytes = 0
        for topic in sorted(live, key=lambda t: live[t][0]):
            off, rsize, p = live[topic]
            tb, qos, flags, rem, stime, wall, props, payload = p
            ent = {"topic": topic, "offset": off, "record_bytes": rsize, "qos": qos,
                   "payload_bytes": len(payload), "props_bytes": len(props),
                   "own_expiry": bool(flags & F_OWN), "remaining_at_write": None,
                   "remaining": None, "expires_at": None}
            if flags & F_EXP:
                left = stime + rem - t_end
                if wall and wall_now:
                    lw = wall + rem - int(wall_now)
                    if lw < left:
                        left = lw
                ent["remaining_at_write"] = rem
                ent["remaining"] = left
                ent["expires_at"] = wall + rem if wall else None
                if left <= 0:
                    rep["expired"].append(ent)
                    continue
            live_bytes += rsize
            rep["live"].append(ent)
        rep["live_bytes"] = live_bytes
        rep["dead_bytes"] = end - _HDR - live_bytes
        if rep["torn_bytes"]:
            rep["status"] = "torn"
        elif rep["corrupt"]:
            rep["status"] = "corrupt"
        rep["damaged"] = rep["status"] != "ok"
        return rep
    finally:
        f.close()

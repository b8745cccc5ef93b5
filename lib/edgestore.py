# edgestore: the flash-backed retained store of edgebroker (storage_type
# "disc" and "disc_only"). One module, the same file on MicroPython boards and
# on CPython hosts (the broker, the host tools, the fleet pipeline). Nothing
# happens at import; the broker opens a FlashStore through its open_store().
#
# Sections:
#   1. compat        the only place that knows there are two interpreters
#   2. format        constants, record encoding; the one file reader,
#                    replay(), and the open of a FlashStore are in
#                    lib/edgeopen.py (boot-only: FlashStore._open() loads
#                    and drops it; the host tools' inspect reads through it)
#   3. FlashStore    the store (RamStore's interface plus compaction)
#
# ------------------------------------------------------------------ FORMAT
# A store file, readable in a hex dump (all integers big-endian):
#
#   header   45 42 52 53 "EBRS"   magic
#            01                   format version (the major: a reader leaves
#                                 a higher one as it is, read-only: FAILURES)
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
# length still leads to a good record (or the end) is skipped and counted.
# A bad length (a record running past the end, or one whose end leads
# nowhere) is resynchronised: the first later offset where a record of a
# known type starts whose chain of good records reaches the end of the file
# exactly. A payload may itself hold well-formed records, but a chain of
# them cannot end exactly at the end of the file (the record holding them
# ends with its own CRC), so recovery never invents a record. The search is
# bounded (about twice the bytes after the bad record, plus 64 KB); what it
# cannot place counts as a torn tail. The skipped bytes count as corrupt.
# Reading never allocates by a length field before the CRC vouches for it:
# records longer than 512 bytes are checked through 512-byte reads (a
# 4-byte corruption used to make a MicroPython start fail by MemoryError,
# a boot loop).
# Bytes opening could not parse (corrupt records, resynchronised gaps, a
# torn tail longer than the write buffer, which one cut write cannot leave)
# are never compacted away without a copy: the first compaction after such
# an open renames the old file to <path>.bad (replacing an older one)
# before renaming the new one in; a cut between the two renames is the FAT
# case below.
# Compaction streams every live record (one at a time) into <path>.new,
# appends a CLOCK marker, flushes, fsyncs, closes, then renames it over the
# file (atomic on littlefs and POSIX; CPython also fsyncs the directory). A
# leftover .new at open is deleted: the old file is intact. If rename cannot
# replace (FAT), the old file is removed first; at open a missing file with a
# complete .new means exactly that cut, and the .new is adopted.
# A file that cannot be opened at all (bad magic, an older version, a
# MemoryError while loading it, a directory in its place) is renamed to
# <path>.bad and the store starts empty, saying so through log; opening
# never raises on a bad file. A 0..7 byte file that is a prefix of the
# header is a store whose creation was cut: it starts empty quietly.
#
# ---------------------------------------------------------------- FAILURES
# A write that fails (flash full, I/O error) at put(), delete(), expire() or
# commit(): put() and delete() never raise OSError (the broker would cut the
# client without a reason code); the error waits, and the next commit()
# raises it, which the broker handles by never sending the acknowledgements
# that waited and disconnecting those clients (5.0: 0x80), who resend
# (MQTT-4.4.0-1). Until that commit, puts are dropped and deletes report
# True (their acknowledgement waits for the failing commit). Before raising,
# commit() rolls the store back to its last durable state: every index
# change since the last successful commit is undone from a small undo list
# (newest first), the counters are restored, and the file handle is opened
# again (CPython's buffered file would retry the failed write at every
# seek, failing every read). The bytes after the durable end are unknown,
# so the next write rewrites the file (compaction) first; while the disk
# stays full each commit fails the same way, and the first one after space
# returns succeeds: nothing acknowledged is lost, nothing unacknowledged is
# half kept.
# A data directory that cannot be written (a read-only filesystem: OSError
# 30; no space to create the file) opens the store read_only: what the file
# holds is loaded into RAM (as "disc" mode, whatever the mode), changes
# stay in RAM, nothing is written, durable is False (the broker acknowledges
# at once, as with "ram") and degraded names the cause; it logs one error
# line. The broker reports it in its log and under $SYS.
# A file of a newer format version (a firmware rolled back) opens the
# store the same way, its file left untouched: the newer firmware, flashed
# again, reads it; moved aside, an empty file in its place would be read.
#
# -------------------------------------------------------------- INDEX HASH
# The index hash is keyed: the first 3 bytes of SHA-256(key + topic), with
# a key of 8 random bytes drawn at every open (os.urandom). The hash lives
# only in RAM (the index is rebuilt from the records at every open), so the
# key is never written and the format does not change; a new key at every
# start also means a set of topics tuned against one run is ordinary for
# the next. (Format 1 used CRC-32, which anyone can make collide: 7,500
# colliding retained topics took 262 s of broker CPU, and a restart with
# them 127 s, because every put and every open re-read each earlier record
# with the same hash.) With a keyed hash a lookup reads as many records as
# chance puts beside its topic (below), whatever topics are chosen. SHA-256
# is in hashlib on every MicroPython port's default build and in C:
# 1.2 us a topic on the unix port (CRC-32: 0.25 us). A build without
# hashlib falls back to CRC-32, whose collisions no key hides.
#
# ---------------------------------------------------------------- MEMORY
# The index is one array of entries sorted by hash, one entry per retained
# message and nothing else per message: "disc_only" costs 4 bytes of heap
# a message on every port (an array('I') word, the same on 32 and 64 bits).
# An entry is  tag << 22 | file offset << 1 | lifetime flag  (a small int
# on a 32-bit port: below 2 ** 30): 8 bits of the topic's hash, the offset
# of its PUT record (21 bits: files below 2 MB) and whether the message has
# a lifetime. A directory of 256 groups (another 8 bits of the hash) holds
# where each group starts: 1 KB whatever the capacity. A lookup goes to its
# group, binary-searches the tag and reads the record of each entry with
# that tag (the topic and length, then the CRC on a get): 16 bits of hash
# in all, so at 5,000 messages about one lookup in 13 reads a record of
# another topic. A new topic's entry goes in at the end of its tag run
# (a memmove of the entries behind it, in C, plus one add per later group);
# a replaced one moves to the end of its run: inside a group the entries
# stay in (tag, offset) order. The whole array is preallocated for
# `capacity` at open (when the heap is calm), so it never asks for a large
# block later; a capacity from 16,384 on (a host) starts at 16,384 entries,
# 0 (no limit) at 1,024, and both grow by half (a file holding more than
# capacity also grows it, once, to what its first records predict). There
# the entries are array('Q') words with a 20-bit tag, one group and 40
# offset bits; a narrow index whose file passes 2 MB is widened the same way.
# "disc" adds a list of the message tuples in index order (preallocated too:
# a list grown by appends asks for a block twice its size), so reads never
# touch flash.
# Iterators (match, messages) walk the index in order; when the store
# changed while the caller held a message, the walk finds its place again by
# the tag run of the last entry it gave, skipping the topics of that run it
# gave already. So puts, deletes and compaction (which rewrites offsets and
# keeps the order) during a long delivery never make it miss an entry
# present throughout or give one twice; one added behind the cursor is
# missed (it went out live). Compaction needs no open-iterator count and is
# never deferred. A filter with a wildcard reads each record's topic (two
# small reads) and the whole record only when the topic matches.

# ---------------------------------------------------------------- 1. compat
import binascii
import os
import sys
from array import array
from struct import pack, pack_into, unpack_from

try:
    from gc import collect as _collect  # a calm heap while the index grows

    from micropython import const

    _BOOT_ONLY = sys.modules  # edgeopen leaves the heap once a store is open
except ImportError:  # CPython

    def const(x):
        return x

    def _collect():
        pass

    # edgeopen stays: importing it again for every open would cost more
    # time than its memory is worth on a host (tests open stores by the
    # thousand)
    _BOOT_ONLY = {}


_crc32 = binascii.crc32

try:  # keyed index hash (INDEX HASH); hashlib is in every port's default build
    from hashlib import sha256 as _sha256
except ImportError:
    _sha256 = None


def _new_key():
    # 8 random bytes: the index hash key of one open store
    try:
        return os.urandom(8)
    except (AttributeError, OSError, NotImplementedError):
        pass
    try:
        import random

        return pack(">II", random.getrandbits(30), random.getrandbits(30))
    except (ImportError, AttributeError):
        return pack(">d", _default_clock()())


_fsync = getattr(os, "fsync", None)  # CPython; MicroPython flush() syncs
_rename = getattr(os, "replace", os.rename)  # CPython's os.rename may not replace

_probe = array("I")
_probe.extend(memoryview(bytes(4)))
if len(_probe) == 1:  # MicroPython: extend() takes raw bytes as words

    def _zeros(n, wide=False):
        # an array grown from raw zero bytes, 1 KB at a time: no list of
        # ints, and no temporary as large as the array (the index is one
        # block of up to 64 KB, made at open while the heap is calm)
        a = array("Q" if wide else "I")
        z = memoryview(bytes(1024))
        k = n * (8 if wide else 4)
        while k > 0:
            c = 1024 if k > 1024 else k
            a.extend(z[:c])
            k -= c
        return a
else:  # CPython: extend() takes bytes as ints

    def _zeros(n, wide=False):
        return array("Q" if wide else "I", [0]) * n


del _probe

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

    def isdir(self, path):
        try:
            return os.stat(path)[0] & 0o170000 == 0o040000
        except OSError:
            return False


# ---------------------------------------------------------------- 2. format
MAGIC = b"EBRS"
VERSION = 1
HEADER = b"EBRS\x01\x00\x00\x00"
T_PUT = const(0x50)  # "P"
T_DEL = const(0x44)  # "D"
T_CLOCK = const(0x43)  # "C"
F_OWN = const(1)  # PUT flags: own Message Expiry
F_EXP = const(2)  # has a lifetime
PUT_OVERHEAD = const(29)  # record bytes beyond topic + props + payload
CLOCK_SIZE = const(17)

EV_BAD = const(-1)  # replay() events beyond the record types
EV_TORN = const(-2)

# A message, as the broker hands it over and takes it back: a tuple whose
# slots are edgebroker's _M_* (the same names and numbers; a test pins them).
_M_TB = const(0)  # the topic's UTF-8 bytes (no str: edgebroker, section 6)
_M_PAYLOAD = const(1)
_M_QOS = const(2)
_M_PROPS = const(3)  # encoded properties forwarded with it
_M_EXP = const(4)  # expiry, broker seconds (0: none)
_M_OWNEXP = const(5)  # 1: the publisher set Message Expiry Interval

_HDR = const(8)
_OK = const(0)  # scan() statuses
_BAD = const(1)
_TORN = const(2)
_CRC = const(3)  # _check(): a whole record with a bad CRC
_PAST = const(4)  # _check(): its length runs past the end
_CHUNK = const(512)  # the largest read made before a CRC vouches for a length

_GROUPS = const(256)  # index directory groups (capacities below _BIG)
_BIG = const(16384)  # a capacity from here on (or 0) gets one group, wide entries
_NARROW = const(21)  # offset bits of an entry in array('I'): files below 2 MB
_WIDE = const(40)  # offset bits of an entry in array('Q')
_U32 = const(0xFFFFFFFF)


if _sha256 is not None:

    def _kh(key, b):
        """24-bit keyed hash of bytes b (module comment, INDEX HASH): the
        first bytes of SHA-256(key + b), a small int on every port."""
        h = _sha256(key)
        h.update(b)
        d = h.digest()
        return d[0] << 16 | d[1] << 8 | d[2]
else:  # a build without hashlib: CRC-32, unkeyed in effect (INDEX HASH)

    def _kh(key, b):
        return _crc32(b, key[0] << 8 | key[1]) & 0xFFFFFF


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
        mv[q : q + n] = p
        q += n
    pack_into(">I", b, q, _crc32(mv[p0:q]) & _U32)


def put_parts(tb, qos, flags, remaining, stime, wall, props, payload):
    """The body of a PUT record, as parts for encode()."""
    return (
        pack(">H", len(tb)),
        tb,
        pack(">BBIIII", qos, flags, remaining, stime, wall, len(props)),
        props,
        payload,
    )


def decode_put(b, blen, head=False):
    """(topic bytes, qos, flags, remaining, stime, wall, props, payload) of a
    PUT body (bytes or memoryview) of blen bytes, or None when its fields do
    not fit. head: b may hold only the first 20 + topic length bytes; props
    and payload are then None (their lengths are checked all the same)."""
    if blen < 20 or len(b) < 2:
        return None
    tl = b[0] << 8 | b[1]
    if 20 + tl > blen or 20 + tl > len(b):
        return None
    qos, flags, rem, st, wall, pl = unpack_from(">BBIIII", b, 2 + tl)
    j = 20 + tl
    if j + pl > blen or qos > 2:
        return None
    if head:
        return bytes(b[2 : 2 + tl]), qos, flags, rem, st, wall, None, None
    if len(b) < blen:
        return None
    # bytes() copies a memoryview's slice and returns a bytes slice as it is
    return (
        bytes(b[2 : 2 + tl]),
        qos,
        flags,
        rem,
        st,
        wall,
        bytes(b[j : j + pl]),
        bytes(b[j + pl : blen]),
    )


def _check(f, pos, size):
    """Is there a whole record with a good CRC at pos (file length size)?
    (status, type, body length, data): status _OK, _CRC (whole, bad CRC)
    or _PAST (its length runs past size, or < 9 bytes are left). data is
    body + crc when the record fits one _CHUNK read, else None: a longer one
    is checked through _CHUNK-byte reads. So however wrong a length field
    is, nothing larger than _CHUNK is allocated before the CRC vouches for
    it (issue 14: a 4-byte corruption must not make open fail by
    MemoryError on a board, a boot loop)."""
    if size - pos < 9:
        return _PAST, 0, 0, None
    f.seek(pos)
    h = f.read(5)
    if len(h) != 5:
        return _PAST, 0, 0, None
    rt = h[0]
    blen = unpack_from(">I", h, 1)[0]
    if blen > size - pos - 9:
        return _PAST, rt, blen, None
    crc = _crc32(h)
    if blen + 4 <= _CHUNK:
        data = f.read(blen + 4)
        if len(data) != blen + 4:
            return _PAST, rt, blen, None
        if _crc32(memoryview(data)[:blen], crc) & _U32 == unpack_from(">I", data, blen)[0]:
            return _OK, rt, blen, data
        return _CRC, rt, blen, None
    left = blen
    while left:
        n = left if left < _CHUNK else _CHUNK
        b = f.read(n)
        if len(b) != n:
            return _PAST, rt, blen, None
        crc = _crc32(b, crc)
        left -= n
    b = f.read(4)
    if len(b) != 4:
        return _PAST, rt, blen, None
    if crc & _U32 == unpack_from(">I", b, 0)[0]:
        return _OK, rt, blen, None
    return _CRC, rt, blen, None


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
    """The retained store on flash: RamStore's interface (see edgeram.py
    section 6), durable.

      get(topic) -> msg or None       put(topic, msg)     delete(topic) -> bool
      match(filter levels) -> iterator of msgs, safe while the store changes
      count, nbytes                   durable
      commit()                        expire(now, budget) -> removed
      close()
    and beyond it: compact(), messages(), stats(), open_stats (what opening
    found: records, live, dead_bytes, torn_bytes, corrupt, skipped_unknown,
    expired, moved_aside, created), bytes_written (every byte
    written to flash, compaction included), compactions, dead_bytes,
    file_bytes, read_only and degraded (below).

    A message is the broker's tuple: (topic bytes, payload bytes, qos,
    forwarded 5.0 property bytes, expiry deadline in `clock` seconds or 0,
    own-expiry flag 0/1); get(), put() and delete() take the topic as a
    str. `clock` must be the broker's clock.

    mode: "disc" (RAM copy of every message + file) or "disc_only" (RAM
    holds only the index). capacity: max_retained_messages (0 = no limit;
    the index grows in chunks). wallclock(): Unix seconds, or None while the
    board clock was never set. log(level, text): where open and compaction
    report. fs: filesystem calls (Fs). mark_interval: seconds between CLOCK
    markers. buffer_size: the write buffer (bigger records go straight out).

    Failures (FAILURES in the module comment): put() and delete() never
    raise OSError; a failed write makes the next commit() raise it, after
    rolling the store back to its last durable state. A data directory that
    cannot be written opens read_only: durable is then False, the messages
    live in RAM, degraded names the cause (for the broker's log and $SYS)."""

    durable = True
    read_only = False
    degraded = None

    def __init__(
        self,
        path,
        mode="disc",
        capacity=1000,
        clock=None,
        wallclock=None,
        compact_ratio=0.5,
        compact_min_bytes=4096,
        log=None,
        fs=None,
        mark_interval=60,
        buffer_size=1024,
    ):
        if mode != "disc" and mode != "disc_only":
            raise ValueError("mode must be 'disc' or 'disc_only'")
        self.path = path
        self.mode = mode
        self._fs = fs if fs is not None else Fs()
        self._clock = clock if clock is not None else _default_clock()
        self._wallf = wallclock if wallclock is not None else _no_wall
        # (compact_ratio, compact_min_bytes, mark_interval): one attribute,
        # not three (a MicroPython instance's attribute table grows in steps)
        self._cfg = (compact_ratio, compact_min_bytes, mark_interval)
        self._logf = log
        self._key = _new_key()  # the index hash key (INDEX HASH)
        self.count = 0
        self.nbytes = 0
        self.bytes_written = 0
        self.compactions = 0
        self._live = 0  # bytes of live PUT records
        self._nexp = 0  # live messages with a lifetime
        self._f = None
        self._fend = _HDR  # logical end of the file's good records
        self._wb = bytearray(buffer_size)
        self._wn = 0  # bytes waiting in _wb (offsets _fend + i)
        self._unsynced = False
        self._torn = False  # bytes after _fend: rewrite before writing
        self._fail = None  # the write error since the last commit
        # changes since the last durable point, None while there are none:
        # [(count, nbytes, _live, _nexp, _fend) there, undo entries...]
        self._undo = None
        self._skip = 0  # dead bytes below which compaction waits (after a failure)
        self._flen = 0  # body length of the record _find last verified
        self._sweep = 0  # expire()'s next position
        # the index (MEMORY): sorted entries in one array, a directory of
        # groups. A board's capacity (up to 16,383) is preallocated in full
        # at this calm moment; a larger one starts at 16,384 entries, 0 (no
        # limit) at 1,024, and both grow by half when full.
        if 0 < capacity < _BIG:
            self._dir = _zeros(_GROUPS + 1)
            self._ob = _NARROW
            self._tsh = 16  # tag: hash bits 16-23 (the group: bits 0-7)
            self._tmask = 255
            n = capacity
        else:
            self._dir = _zeros(2)  # one group: the tag is the whole hash
            self._ob = _WIDE
            self._tsh = 4  # tag: hash bits 4-23 (entries stay below 2 ** 61)
            self._tmask = 0xFFFFF
            n = _BIG if capacity else 1024
        self._ix = _zeros(n, self._ob > _NARROW)
        self._ixv = memoryview(self._ix)
        self._n = 0  # entries in use
        self._mods = 0  # changes of positions or entries (iterators resync)
        # "disc": the messages, in index order, in a list preallocated like
        # the index (a list grown by appends asks for a block twice its size:
        # what a fragmented MicroPython heap cannot give)
        self._msgs = [None] * n if mode == "disc" else None
        self._ro = 0  # read_only: the last fake offset handed out
        self._open()

    # ------------------------------------------------------------ helpers
    def _log(self, level, text):
        if self._logf is not None:
            self._logf(level, text)

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
            return bytes(memoryview(self._wb)[i : i + n])
        f = self._f
        f.seek(off)
        return f.read(n)

    def _raw(self, off, blen=-1):
        # (header, body + crc) of the record at off, or None when it is not
        # a whole record with a good CRC (of body length blen if given).
        # Nothing beyond _CHUNK is allocated before the CRC is checked.
        if 0 <= blen <= _CHUNK - 9:  # one read, as get() has the length
            r = self._pread(off, blen + 9)
            if len(r) != blen + 9 or unpack_from(">I", r, 1)[0] != blen:
                return None
            rest = memoryview(r)[5:]
            crc = _crc32(rest[:blen], _crc32(memoryview(r)[:5])) & _U32
            if crc != unpack_from(">I", rest, blen)[0]:
                return None
            return r[:5], rest
        if off >= self._fend:  # in the write buffer: written by this run
            h = self._pread(off, 5)
            if len(h) != 5:
                return None
            n = unpack_from(">I", h, 1)[0]
            if (blen >= 0 and n != blen) or off + 9 + n > self._fend + self._wn:
                return None
            rest = self._pread(off + 5, n + 4)
            if _crc32(memoryview(rest)[:n], _crc32(h)) & _U32 != unpack_from(">I", rest, n)[0]:
                return None
            return h, rest
        st, rt, n, data = _check(self._f, off, self._fend)
        if st != _OK or (blen >= 0 and n != blen):
            return None
        if data is None:
            self._f.seek(off + 5)
            data = self._f.read(n + 4)
        return pack(">BI", rt, n), data

    def _head(self, off):
        # (record length, flags, remaining, stime, wall) of a PUT, two small reads
        h = self._pread(off, 7)
        tl = h[5] << 8 | h[6]
        _, flags, rem, st, wall = unpack_from(">BBIII", self._pread(off + 7 + tl, 14), 0)
        return unpack_from(">I", h, 1)[0] + 9, flags, rem, st, wall

    def _th(self, tb):
        """24-bit keyed hash of topic bytes (INDEX HASH)."""
        return _kh(self._key, tb)

    def _lb(self, g, v):
        # first position of group g whose entry is >= v (a group's entries
        # are in increasing order: by tag, then by file offset)
        ix = self._ix
        lo = self._dir[g]
        hi = self._dir[g + 1]
        while lo < hi:
            mid = (lo + hi) >> 1
            if ix[mid] < v:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _group(self, p):
        # the group holding position p: the first g with dir[g + 1] > p
        d = self._dir
        lo = 0
        hi = len(d) - 2
        while lo < hi:
            mid = (lo + hi) >> 1
            if d[mid + 1] > p:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _off(self, e):
        # the file offset of entry e
        return e >> 1 & ((1 << self._ob) - 1)

    def _find(self, tb):
        """Position of topic bytes tb, or -1. Leaves the topic's group and
        tag in _fg/_ft and, when absent, where its entry would go in _fp
        (the end of its tag run); disc_only also the record's body length
        in _flen."""
        h = self._th(tb)
        g = h & (len(self._dir) - 2)
        t = h >> self._tsh & self._tmask
        ts = self._ob + 1
        self._fg = g
        self._ft = t
        p = self._lb(g, t << ts)
        end = self._dir[g + 1]
        ix = self._ix
        msgs = self._msgs
        tl = len(tb)
        while p < end:
            e = ix[p]
            if e >> ts != t:
                break
            if msgs is not None:
                if msgs[p][_M_TB] == tb:
                    return p
            else:
                r = self._pread(self._off(e), 7 + tl)
                if len(r) == 7 + tl and r[5] << 8 | r[6] == tl and r[7:] == tb:
                    self._flen = unpack_from(">I", r, 1)[0]
                    return p
            p += 1
        self._fp = p
        return -1

    def _entry(self, off, exp):
        # the entry of the topic _find() last looked for, its record at off
        return self._ft << (self._ob + 1) | off << 1 | exp

    def _size_of(self, p):
        # record bytes of the entry at position p
        if self._msgs is not None:
            m = self._msgs[p]
            return PUT_OVERHEAD + len(m[_M_TB]) + len(m[_M_PAYLOAD]) + len(m[_M_PROPS])
        h = self._pread(self._off(self._ix[p]), 5)
        return unpack_from(">I", h, 1)[0] + 9

    def _found_size(self, p):
        # record bytes of the entry _find() just returned (disc_only: the
        # length it read while verifying the topic; no read again)
        return self._size_of(p) if self._msgs is not None else self._flen + 9

    def _room(self, end, want=0):
        """Before a write that may reach file offset end: one more entry
        fits (growing to `want` entries, or by half), and end fits an
        entry's offset bits. May raise MemoryError; nothing has changed
        then."""
        if self._n >= len(self._ix):
            n = len(self._ix)
            self._resize(max(n + (n >> 1), want), self._ob)
        if end >> self._ob and self._ob == _NARROW:
            self._resize(len(self._ix), _WIDE)

    def _resize(self, n, ob):
        # a new entry array of n entries and ob offset bits (same order)
        wide = ob > _NARROW
        a = _zeros(n, wide)  # MemoryError here: nothing changed
        k = self._n
        if ob == self._ob:
            memoryview(a)[:k] = self._ixv[:k]
        else:
            ix = self._ix
            lo = (1 << (self._ob + 1)) - 1
            sh = ob - self._ob
            for i in range(k):
                e = ix[i]
                a[i] = (e & ~lo) << sh | (e & lo)
            u = self._undo  # its entry values too (rollback finds entries by value)
            if u is not None:
                for i in range(1, len(u)):
                    g, new, old, m = u[i]
                    if new >= 0:
                        new = (new & ~lo) << sh | (new & lo)
                    if old >= 0:
                        old = (old & ~lo) << sh | (old & lo)
                    u[i] = (g, new, old, m)
        if self._msgs is not None and n > len(self._msgs):
            self._msgs.extend([None] * (n - len(self._msgs)))
        self._ix = a
        self._ixv = memoryview(a)
        self._ob = ob

    def _insert(self, p, g, e, m):
        # entry e (message m in "disc") goes in at position p of group g;
        # _room() made space for it
        n = self._n
        v = self._ixv
        if p < n:
            v[p + 1 : n + 1] = v[p:n]  # memmove (overlap-safe on both)
        self._ix[p] = e
        self._n = n + 1
        d = self._dir
        for j in range(g + 1, len(d)):
            d[j] += 1
        if self._msgs is not None:
            self._msgs.pop()  # a spare None off the end: the list never grows here
            self._msgs.insert(p, m)
        self._mods += 1

    def _remove(self, p, g):
        # takes the entry at position p (of group g) out
        n = self._n - 1
        v = self._ixv
        if p < n:
            v[p:n] = v[p + 1 : n + 1]
        self._ix[n] = 0
        self._n = n
        d = self._dir
        for j in range(g + 1, len(d)):
            d[j] -= 1
        if self._msgs is not None:
            self._msgs.pop(p)
            self._msgs.append(None)
        self._mods += 1

    def _set(self, p, g, e, m):
        # the entry at p (group g) becomes e: the same tag and a later
        # record, so it moves to the end of its tag run (the order holds)
        ix = self._ix
        msgs = self._msgs
        end = self._dir[g + 1]
        ts = self._ob + 1
        t = e >> ts
        while p + 1 < end and ix[p + 1] >> ts == t:
            ix[p] = ix[p + 1]
            if msgs is not None:
                msgs[p] = msgs[p + 1]
            p += 1
        ix[p] = e
        if msgs is not None:
            msgs[p] = m
        self._mods += 1

    def _forget(self, p, g, size):
        # the entry's message is gone (delete, expiry, drop): counters + out
        if self._ix[p] & 1:
            self._nexp -= 1
        self._remove(p, g)
        self.count -= 1
        self._live -= size
        self.nbytes -= size - PUT_OVERHEAD

    def _begin(self):
        # the first change since the durable point: remember that point
        if self._undo is None:
            self._undo = [(self.count, self.nbytes, self._live, self._nexp, self._fend)]

    def _note(self, g, new, old, m):
        # how to undo a change in group g (FAILURES): the entry is now new
        # (-1: gone) and was old (-1: absent) with message m ("disc"). Not
        # read_only: nothing is written, so nothing is undone (the list
        # grew by every change for as long as the broker ran)
        if self.read_only:
            return
        self._begin()
        self._undo.append((g, new, old, m))

    def _durable(self):
        # everything in RAM is in the file, synced: the rollback point
        self._undo = None

    def _rollback(self):
        """Back to the last durable state after a failed write: the index
        (undone change by change, newest first, by entry value: positions
        move), the counters, the logical end of the file. The bytes after
        it are unknown (torn): the next write rewrites the file first. The
        file is opened again, so that nothing a failed write left buffered
        is retried (CPython's buffered files retry it at every seek, which
        made reads fail)."""
        u = self._undo
        self._undo = None
        if u is None:
            u = [(self.count, self.nbytes, self._live, self._nexp, self._fend)]
        i = len(u)
        while i > 1:
            i -= 1
            g, new, old, m = u[i]
            if new >= 0:
                p = self._lb(g, new)
                if p < self._dir[g + 1] and self._ix[p] == new:
                    self._remove(p, g)
            if old >= 0:
                self._insert(self._lb(g, old), g, old, m)
        self.count, self.nbytes, self._live, self._nexp, self._fend = u[0]
        self._wn = 0
        self._torn = True
        self._unsynced = False
        self._fail = None
        f = self._f
        if f is not None and f is not True:
            try:
                f.close()
            except Exception:
                pass  # the failed write once more: the fd is closed all the same
            self._f = None
            try:
                self._f = self._fs.open(self.path, "r+b")
            except OSError as e:
                self._log("error", "%s: cannot reopen (%r)" % (self.path, e))

    def _topic_at(self, e):
        # disc_only: the topic bytes of entry e's record (two small reads)
        off = self._off(e)
        h = self._pread(off, 7)
        if len(h) != 7:
            return None
        return self._pread(off + 7, h[5] << 8 | h[6])

    def _walk(self):
        """(position, topic bytes) of every entry in index order, safe while
        the store changes between steps (MEMORY): after a change the walk
        starts again at its tag run and skips the topics of the run it gave
        already."""
        g = 0
        p = 0
        mods = self._mods
        t = -1  # the tag of the run being walked
        done = []  # its topics given so far
        msgs = self._msgs
        while self._f is not None:
            d = self._dir
            ts = self._ob + 1
            if mods != self._mods:
                mods = self._mods
                if t >= 0:
                    p = self._lb(g, t << ts)
            while g < len(d) - 1 and p >= d[g + 1]:
                g += 1
                t = -1
            if g >= len(d) - 1:
                return
            e = self._ix[p]
            p += 1
            tb = msgs[p - 1][_M_TB] if msgs is not None else self._topic_at(e)
            if e >> ts != t:
                t = e >> ts
                done = []
            elif tb in done:
                continue
            if tb is not None:
                done.append(tb)
                yield p - 1, tb

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
            self._write(memoryview(self._wb)[: self._wn])
            self._wn = 0

    def _emit(self, rt, parts):
        # appends a record; returns its logical offset, or -1 when it cannot
        # be written (the error waits in _fail for commit(): FAILURES)
        if self.read_only:
            self._ro += 1  # RAM only: an offset never read, unique, increasing
            return self._fend + self._ro
        if self._fail is not None:
            return -1
        blen = 0
        for p in parts:
            blen += len(p)
        n = blen + 9
        wb = self._wb
        self._begin()
        if self._wn + n > len(wb):
            try:
                if self._torn:
                    self.compact()  # never append after unknown bytes
                    self._begin()
                self._flush_buf()
                if n > len(wb):
                    off = self._fend
                    self._write(encode(rt, parts))
                    return off
            except OSError as e:
                self._fail = e
                self._torn = True
                return -1
        off = self._fend + self._wn
        _fill(wb, self._wn, rt, blen, parts)
        self._wn += n
        return off

    def _clock_record(self):
        st = self._stime()
        if self._emit(T_CLOCK, (pack(">II", st, self._wall()),)) >= 0:
            self._tmark = st

    def _parts(self, msg, st):
        dl = msg[_M_EXP]
        flags = 0
        rem = 0
        if dl:
            flags = F_EXP | (F_OWN if msg[_M_OWNEXP] else 0)
            rem = int(dl - (self._c0 + st - self._t0))  # floored: never late
            if rem < 0:
                rem = 0
            elif rem > _U32:
                rem = _U32
        elif msg[_M_OWNEXP]:
            flags = F_OWN
        tb, qos, props, payload = msg[_M_TB], msg[_M_QOS], msg[_M_PROPS], msg[_M_PAYLOAD]
        return put_parts(tb, qos, flags, rem, st, self._wall(), props, payload), flags

    # ------------------------------------------------------------ interface
    def get(self, topic):
        if self._f is None:
            return None
        p = self._find(topic.encode())
        if p < 0:
            return None
        return self._load(p, -1 if self._msgs is not None else self._flen)

    def put(self, topic, msg):
        if self._f is None:
            raise OSError(9)  # EBADF: closed
        if self._fail is not None:
            return  # refused: commit() raises the write error (FAILURES)
        tb = msg[_M_TB]
        size = PUT_OVERHEAD + len(tb) + len(msg[_M_PROPS]) + len(msg[_M_PAYLOAD])
        # room first: a MemoryError leaves nothing half done
        self._room(self._fend + self._wn + self._ro + size)
        nc = self.compactions
        p = self._find(tb)
        parts, flags = self._parts(msg, self._stime())
        off = self._emit(T_PUT, parts)
        if off < 0:
            return
        if nc != self.compactions:
            p = self._find(tb)  # _emit compacted first (a torn tail): entries moved
        e = self._entry(off, 1 if flags & F_EXP else 0)
        if p >= 0:
            self._note(self._fg, e, self._ix[p], self._msgs[p] if self._msgs is not None else None)
        else:
            self._note(self._fg, e, -1, None)
        self._place(p, e, msg, size)

    def _place(self, p, e, m, size):
        # entry e (message m in "disc", a record of size bytes) for the topic
        # _find() last looked for: it replaces the entry at p, or (p < 0) goes
        # in where _find() said; the counters follow (put, and open's replay)
        g = self._fg
        if p >= 0:
            old = self._found_size(p)
            if self._ix[p] & 1:
                self._nexp -= 1
            self._set(p, g, e, m)
            self._live += size - old
            self.nbytes += size - old
        else:
            self._insert(self._fp, g, e, m)
            self.count += 1
            self._live += size
            self.nbytes += size - PUT_OVERHEAD
        self._nexp += e & 1

    def delete(self, topic):
        if self._f is None:
            raise OSError(9)  # EBADF: closed
        if self._fail is not None:
            return True  # refused: the acknowledgement waits for commit(), which raises
        tb = topic.encode()
        p = self._find(tb)
        if p < 0:
            return False  # nothing written: no wear for a no-op
        size = self._found_size(p)
        nc = self.compactions
        if self._emit(T_DEL, (tb,)) < 0:
            return True
        if nc != self.compactions:
            p = self._find(tb)  # _emit compacted first (a torn tail): entries moved
            if p < 0:
                return True  # compaction dropped it (expired)
            size = self._found_size(p)
        g = self._fg
        self._note(g, -1, self._ix[p], self._msgs[p] if self._msgs is not None else None)
        self._forget(p, g, size)
        return True

    def match(self, flevels):
        if "+" not in flevels and "#" not in flevels:
            m = self.get("/".join(flevels))
            if m is not None:
                yield m
            return
        msgs = self._msgs
        for p, tb in self._walk():
            if msgs is not None:
                m = msgs[p]
                if _matches(flevels, m[_M_TB].decode()):
                    yield m
                continue
            try:
                topic = str(tb, "utf-8")
            except UnicodeError:
                continue
            if _matches(flevels, topic):  # the record is read only then
                m = self._load(p)
                if m is not None:
                    yield m

    def messages(self):
        """Every message, in index order (same safety as match())."""
        for p, _ in self._walk():
            m = self._load(p)
            if m is not None:
                yield m

    def _load(self, p, blen=-1):
        if self._msgs is not None:
            return self._msgs[p]
        off = self._off(self._ix[p])
        r = self._raw(off, blen)
        if r is None:
            self._log("error", "retained record at %d unreadable (bad CRC)" % off)
            return None
        rest = r[1]
        q = decode_put(rest, len(rest) - 4)
        if q is None or r[0][0] != T_PUT:
            return None
        tb, qos, flags, rem, st, wall, props, payload = q
        return (  # a message: slots _M_TB .. _M_OWNEXP
            tb,
            payload,
            qos,
            props,
            self._deadline(st, rem, wall) if flags & F_EXP else 0,
            flags & F_OWN,
        )

    def expire(self, now, budget):
        """Drops messages whose deadline has passed, looking at `budget`
        entries per call and resuming where the last call stopped (bounded
        work per call; disc_only reads the head of flagged records only).
        It also makes pending writes durable and records a CLOCK marker when
        one is due, so QoS 0 retained changes reach flash within a tick;
        that commit's OSError is raised, as commit() raises it (rolled back:
        the changes since the last durable commit are undone)."""
        removed = 0
        if self._f is None:
            return 0
        p = self._sweep
        msgs = self._msgs
        for _ in range(budget):
            if p >= self._n:
                p = 0
                break
            o = self._ix[p]
            if o & 1:
                if msgs is not None:
                    m = msgs[p]
                    gone = m[_M_EXP] <= now
                    size = PUT_OVERHEAD + len(m[_M_TB]) + len(m[_M_PAYLOAD]) + len(m[_M_PROPS])
                else:
                    size, flags, rem, st, wall = self._head(self._off(o))
                    gone = self._deadline(st, rem, wall) <= now
                    m = self._load(p) if gone else None
                if gone:
                    # a DEL makes the expiry durable: without a set clock a
                    # reopen could not tell that the lifetime had passed (E4)
                    nc = self.compactions
                    if m is not None:
                        self._emit(T_DEL, (m[_M_TB],))
                    if nc != self.compactions:
                        break  # compacted first: the expired are gone, positions moved
                    g = self._group(p)
                    self._note(g, -1, o, m if msgs is not None else None)
                    self._forget(p, g, size)
                    removed += 1
                    continue  # the next entry moved to p
            p += 1
        self._sweep = p
        if (
            self._wn
            or self._unsynced
            or self._torn
            or self._fail is not None
            or (self._nexp and self._stime() - self._tmark >= self._cfg[2])
        ):
            # raises OSError after rolling back: the caller's acks for the
            # changes undone must not leave (Engine.tick -> store_failed)
            self.commit()
        return removed

    def commit(self):
        """Makes every put/delete so far durable: writes the buffer, flushes
        and fsyncs. Compacts afterwards when dead bytes pass the ratio.
        Raises OSError when that fails (or a put/delete since the last
        commit could not be written), after rolling back to the last
        durable state (FAILURES)."""
        if self._f is None:
            return
        if self.read_only:
            return
        try:
            if self._fail is not None:
                raise self._fail
            if self._torn:
                self.compact()  # a complete rewrite: durable when it returns
            else:
                if self._nexp and self._stime() - self._tmark >= self._cfg[2]:
                    self._clock_record()
                    if self._fail is not None:
                        raise self._fail
                self._flush_buf()
                if self._unsynced:
                    self._fs.sync(self._f)
                    self._unsynced = False
        except OSError:
            if self._f is not None:
                self._rollback()
            raise
        self._durable()
        size = self._fend
        dead = size - _HDR - self._live
        ratio, least, _ = self._cfg
        if size > least and dead > ratio * size and dead >= self._skip:
            try:
                self.compact()
            except OSError as e:
                if self._f is None:
                    raise
                # everything is durable already; try again after more churn
                self._skip = dead + least
                self._log("error", "compaction failed: %r" % (e,))

    def close(self):
        """Makes pending changes durable (a CLOCK marker too: E4) and closes.
        A write that fails here is logged: nothing pending was acknowledged."""
        f = self._f
        if f is None:
            return
        try:
            if not self.read_only:
                if self._nexp and not self._torn and self._fail is None:
                    self._clock_record()  # the exact runtime, for E4
                self.commit()
        except OSError as e:
            self._log(
                "error", "%s: changes since the last commit lost at close (%r)" % (self.path, e)
            )
        finally:
            if self._f is not None and self._f is not True:
                self._f.close()
            self._f = None

    # ------------------------------------------------------------ compaction
    def compact(self):
        """Writes every live record to <path>.new (streaming, one record at
        a time), appends a CLOCK marker, syncs, closes and renames it over
        the file. Offsets change, the order of the index does not; expired
        messages and unreadable records are dropped on the way (open
        iterators find their place again: MEMORY).
        When opening found bytes it could not parse, the old file is kept as
        <path>.bad instead of being replaced (never drop them without a copy)."""
        f = self._f
        if f is None:
            raise OSError(9)
        if self.read_only:
            return
        fs = self._fs
        path = self.path
        new = path + ".new"
        msgs = self._msgs
        now = self._clock()
        d = self._dir
        g = fs.open(new, "wb")
        ok = False
        try:
            g.write(HEADER)
            pos = _HDR
            p = 0
            grp = 0
            while p < self._n:
                while p >= d[grp + 1]:
                    grp += 1
                o = self._ix[p]
                r = self._raw(self._off(o))
                if r is None and msgs is not None:
                    # flash rot under a RAM copy: write the copy again
                    r = (encode(T_PUT, self._parts(msgs[p], self._stime())[0]), b"")
                    o = (o & ~1) | (1 if msgs[p][_M_EXP] else 0)
                    self._ix[p] = o
                if r is None:
                    self._log("error", "retained record at %d unreadable: dropped" % self._off(o))
                    self._drop(p, grp)
                    continue
                if o & 1:
                    if msgs is not None:
                        dl = msgs[p][_M_EXP]
                    else:
                        rest = r[1]
                        tl = rest[0] << 8 | rest[1]
                        _, _, rem, st, wall = unpack_from(">BBIII", rest, 2 + tl)
                        dl = self._deadline(st, rem, wall)
                    if dl <= now:
                        self._drop(p, grp)
                        continue
                self._wr(g, r[0])
                self._wr(g, r[1])
                pos += len(r[0]) + len(r[1])
                p += 1
            live = pos - _HDR
            st = self._stime()
            self._wr(g, encode(T_CLOCK, (pack(">II", st, self._wall()),)))
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
        self.bytes_written += pos
        renamed = False
        bad = None
        try:
            self._f = None
            f.close()
            keep = self._keep()
            if keep:
                # the old file holds bytes opening could not parse: kept
                bad = path + ".bad"
                if fs.exists(bad):
                    fs.remove(bad)
                fs.rename(path, bad)
                fs.rename(new, path)
            else:
                try:
                    fs.rename(new, path)
                except OSError:
                    # FAT cannot rename over a file: remove, then rename; an
                    # open that finds only a complete .new adopts it
                    fs.remove(path)
                    fs.rename(new, path)
            renamed = True
            self._fend = pos
            self._wn = 0
            self._torn = False
            self._unsynced = False
            self._live = live
            self._tmark = st
            self._skip = 0
            self.compactions += 1
            if keep:
                self._log(
                    "warning",
                    "%s: compacted; the old file, with the bytes that "
                    "could not be read, is kept as %s" % (path, bad),
                )
            fs.sync_dir(path)
            self._f = fs.open(path, "r+b")
            try:
                self._reoffset()
            except OSError as e:
                # the index cannot learn the new offsets: open the file again,
                # as a restart would (E4 holds across opens)
                self._log("error", "%s: rereading after compaction failed (%r)" % (path, e))
                self._f.close()
                self._f = None
                self._reset()
                self._open()
        finally:
            if not renamed:
                if bad is not None and not fs.exists(path):
                    try:
                        fs.rename(bad, path)
                    except Exception:
                        pass
                try:
                    self._f = fs.open(path, "r+b")
                except Exception:
                    self._f = None
        self._durable()

    def _keep(self):
        # does the file hold bytes opening could not parse, not yet kept as
        # .bad? Corrupt records, or a torn tail longer than the write buffer
        # (more than one cut write can leave); the first compaction keeps it
        o = self.open_stats
        return self.compactions == 0 and (o["corrupt"] or o["torn_bytes"] > len(self._wb))

    def _wr(self, g, data):
        # one write into the compaction file; a short one is an error
        n = len(data)
        r = g.write(data)
        if r is not None and r != n:
            raise OSError(5)  # EIO: short write

    def _drop(self, p, g):
        # compaction drops the entry at p of group g (expired, unreadable)
        o = self._ix[p]
        msgs = self._msgs
        size = self._size_of(p) if msgs is not None else self._head(self._off(o))[0]
        self._note(g, -1, o, msgs[p] if msgs is not None else None)
        self._forget(p, g, size)

    def _reoffset(self):
        # after a compaction: the p-th entry's record is the p-th of the
        # new file (records were copied in index order, so the order holds)
        ix = self._ix
        lo = (1 << (self._ob + 1)) - 1
        pos = _HDR
        for p in range(self._n):
            h = self._pread(pos, 5)
            if len(h) != 5:
                raise OSError(5)  # EIO: the file just written is short
            e = ix[p]
            ix[p] = (e & ~lo) | pos << 1 | (e & 1)
            pos += unpack_from(">I", h, 1)[0] + 9
        self._mods += 1

    # ------------------------------------------------------------ stats
    @property
    def file_bytes(self):
        return self._fend + self._wn

    @property
    def dead_bytes(self):
        return self._fend + self._wn - _HDR - self._live

    def stats(self):
        return {
            "count": self.count,
            "nbytes": self.nbytes,
            "file_bytes": self.file_bytes,
            "live_bytes": self._live,
            "dead_bytes": self.dead_bytes,
            "bytes_written": self.bytes_written,
            "compactions": self.compactions,
            "expiring": self._nexp,
        }

    # ------------------------------------------------------------ opening
    def _open(self):
        # recover and load the file: lib/edgeopen.py, boot-only code,
        # imported for this and, on MicroPython, dropped again (its
        # bytecode is not heap while the broker runs)
        import edgeopen

        try:
            edgeopen._open(self)
        finally:
            _BOOT_ONLY.pop("edgeopen", None)

    def _reset(self):
        d = self._dir
        for j in range(len(d)):
            d[j] = 0
        self._n = 0
        self._mods += 1
        msgs = self._msgs
        if msgs is not None:
            for j in range(len(msgs)):
                msgs[j] = None
        self._sweep = 0
        self.count = 0
        self.nbytes = 0
        self._live = 0
        self._nexp = 0
        self._torn = False
        self._t0 = 0

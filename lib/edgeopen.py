# edgeopen: how edgestore opens a store file: the one reader of store files
# (replay(): torn tails, corrupt records, resynchronisation) and the open of
# a FlashStore (recover, load the index, move a bad file aside, fall back to
# read-only). Boot-only on a board: FlashStore._open() imports it and drops
# it again, so its bytecode is not heap while the broker runs (it comes
# back, from flash, when a failed compaction reopens the file). The host
# tools read store files through replay() and scan(). _open() and what it
# calls are FlashStore's own methods, kept in another file: they take the
# store as self and keep the methods' names (names are interned for good on
# a board: new ones would cost heap after this module is gone).
# Runs unchanged on MicroPython and CPython. Nothing happens at import.
from struct import unpack_from

from edgestore import (
    EV_BAD,
    EV_TORN,
    F_EXP,
    F_OWN,
    HEADER,
    MAGIC,
    PUT_OVERHEAD,
    T_CLOCK,
    T_DEL,
    T_PUT,
    VERSION,
    _check,
    _collect,
    const,
    decode_put,
)

# edgestore's consts of the same names and values (MicroPython folds a
# const whose name starts with "_" away: it cannot be imported; a test pins
# them to edgestore's)
_HDR = const(8)
_OK = const(0)  # scan() statuses
_BAD = const(1)
_TORN = const(2)
_CRC = const(3)
_CHUNK = const(512)
# where a record may start, by its type byte (_resync)
_KNOWN = (bytes((T_PUT,)), bytes((T_DEL,)), bytes((T_CLOCK,)))
# message slots: edgebroker's _M_* (a test pins them)
_M_TB = const(0)
_M_PAYLOAD = const(1)
_M_QOS = const(2)
_M_PROPS = const(3)
_M_EXP = const(4)
_M_OWNEXP = const(5)


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


def _chain(f, pos, size, budget):
    # (reaches the end, bytes read): do whole records with good CRCs lead
    # from pos exactly to the end of the file?
    used = 0
    while pos < size:
        st, _, blen, _ = _check(f, pos, size)
        used += blen + 9 if st == _OK else 9
        if st != _OK or used > budget:
            return False, used
        pos += blen + 9
    return True, used


def _resync(f, pos, size):
    """The first offset after pos where a record of a known type starts
    whose chain of good records reaches the end of the file exactly, or -1.
    A payload may itself hold well-formed records; a chain of them cannot
    end exactly at the end of the file (the record holding them ends with
    its own CRC), so recovery never invents a record. Bounded work: about
    twice the bytes after pos, plus 64 KB, are read; then it gives up (the
    rest counts as torn, and the file is kept as .bad before any
    compaction drops it)."""
    budget = 2 * (size - pos) + 65536
    q = pos + 1
    while size - q >= 9 and budget > 0:
        f.seek(q)
        w = f.read(_CHUNK)
        budget -= len(w)
        lim = len(w) - 4  # a header needs 5 bytes of the window
        if lim <= 0:
            break
        i = 0
        while i < lim:
            j = -1
            for t in _KNOWN:
                k = w.find(t, i, lim)
                if k >= 0 and (j < 0 or k < j):
                    j = k
            if j < 0:
                break
            c = q + j
            if unpack_from(">I", w, j + 1)[0] <= size - c - 9:
                ok, used = _chain(f, c, size, budget)
                budget -= used
                if ok:
                    return c
                if budget <= 0:
                    return -1
            i = j + 1
        q += lim
    return -1


def scan(f, size, pos=_HDR):
    """The raw record walk: yields (offset, type, data, status) from pos to
    size: status _OK with data = body + crc (the body is data[:len(data) -
    4]); _BAD for a record with a bad CRC whose length leads to a good
    record or the end (skipped, data None); _TORN last, for the rest of the
    file when neither holds (data None). No resynchronisation: replay()
    adds it. It seeks before every read, so the caller may read elsewhere
    between records."""
    while pos < size:
        st, rt, blen, data = _check(f, pos, size)
        end = pos + 9 + blen
        if st == _OK:
            if data is None:  # checked: its length is now trusted
                f.seek(pos + 5)
                data = f.read(blen + 4)
            yield pos, rt, data, _OK
            pos = end
        elif st == _CRC and (end == size or _check(f, end, size)[0] == _OK):
            yield pos, rt, None, _BAD
            pos = end
        else:
            yield pos, rt, None, _TORN
            return


def replay(f, size, full=True):
    """The one reader of store files: FlashStore's open and the host tools'
    inspect decide everything through it. Yields events (kind, offset,
    bytes, x) in file order:
      T_PUT    x = (fields, topic str): fields as decode_put(); props and
               payload are None unless full (disc_only never reads them)
      T_DEL    x = topic bytes
      T_CLOCK  x = (stime, wall)
      any other type of a good record: x = None (an unknown record, skipped)
      EV_BAD   bytes that are not a good record: a record with a bad CRC
               whose length leads to a good one (or the end), a malformed
               PUT, or the bytes skipped to resynchronise after a bad length
               (the next record whose chain of good records reaches the end)
      EV_TORN  the rest of the file, last: a torn tail (or what could not be
               resynchronised within its bounded work)"""
    pos = _HDR
    while pos < size:
        st, rt, blen, data = _check(f, pos, size)
        end = pos + 9 + blen
        if st == _OK:
            yield _event(f, pos, rt, blen, data, full)
            pos = end
            continue
        if st == _CRC and (end == size or _check(f, end, size)[0] == _OK):
            yield EV_BAD, pos, blen + 9, None
            pos = end
            continue
        q = _resync(f, pos, size)
        if q < 0:
            yield EV_TORN, pos, size - pos, None
            return
        yield EV_BAD, pos, q - pos, None
        pos = q


def _event(f, pos, rt, blen, data, full):
    # one replay() event for the good record at pos (its CRC vouches for
    # its length: reading by it is safe now)
    n = blen + 9
    if rt == T_PUT:
        if data is None:
            f.seek(pos + 5)
            if full:
                data = f.read(blen + 4)
            else:  # the head only: 20 + topic length bytes
                h = f.read(2)
                tl = h[0] << 8 | h[1] if len(h) == 2 else blen
                f.seek(pos + 5)
                data = f.read(20 + tl if 20 + tl <= blen else 2)
        p = decode_put(data, blen, not full)
        if p is not None:
            try:
                return T_PUT, pos, n, (p, str(p[0], "utf-8"))
            except UnicodeError:
                pass
        return EV_BAD, pos, n, None
    if rt == T_DEL:
        if data is None:
            f.seek(pos + 5)
            data = f.read(blen)
        return T_DEL, pos, n, bytes(data[:blen])
    if rt == T_CLOCK and blen >= 8:
        return T_CLOCK, pos, n, unpack_from(">II", data, 0)
    return rt, pos, n, None


def _open(self):
    fs = self._fs
    path = self.path
    new = path + ".new"
    self._c0 = self._clock()
    self._wall0 = self._wall()
    self._t0 = 0
    self._tmark = 0
    self.open_stats = {
        "records": 0,
        "live": 0,
        "dead_bytes": 0,
        "torn_bytes": 0,
        "corrupt": 0,
        "skipped_unknown": 0,
        "expired": 0,
        "moved_aside": False,
        "created": False,
    }
    try:
        if fs.exists(new):
            if fs.exists(path) or not _complete(self, new):
                fs.remove(new)  # the rename never happened: the old file is intact
            else:
                fs.rename(new, path)  # cut between remove and rename (FAT)
                self._log("warning", "%s: adopted the compacted %s" % (path, new))
        if fs.isdir(path):
            _move_aside(self, "a directory")
        if not fs.exists(path):
            _create(self)
            self._durable()
            return
        f = fs.open(path, "r+b")
    except OSError as e:
        _open_read_only(self, e)
        return
    self._f = f
    kind = "bad_magic"
    try:
        size = f.seek(0, 2)
        f.seek(0)
        head = f.read(_HDR)
        kind = header_kind(head, size)
        if kind == "ok":
            _load_all(self, f, size)
    except MemoryError:
        # a store too big for this heap: moved aside, the broker starts
        # (a boot loop is the alternative); the file is kept whole
        self._log("error", "%s: MemoryError while opening" % path)
        kind = "unopenable (MemoryError)"
    except Exception as e:  # a bad file must not stop the broker
        self._log("error", "%s: unreadable (%r)" % (path, e))
        kind = "unreadable"
    if kind == "ok":
        self._durable()
        return
    self._f = None
    f.close()
    self._reset()
    if kind == "future_version":
        # a newer firmware's file (this one was rolled back): moving it
        # aside would start an empty file that the newer one, flashed
        # again, takes over; kept as it is, the store runs read-only
        why = "format version %d is newer than this firmware's (%d), kept as it is"
        _open_read_only(self, None, why % (head[4], VERSION))
        return
    try:
        if kind == "partial":
            fs.remove(path)
            self._log("info", "%s: creation was cut, starting empty" % path)
        else:
            _move_aside(self, kind)
        _create(self)
    except OSError as e:
        _open_read_only(self, e)
        return
    self._durable()


def _move_aside(self, why):
    path = self.path
    bad = path + ".bad"
    if self._fs.exists(bad):
        self._fs.remove(bad)
    self._fs.rename(path, bad)
    self.open_stats["moved_aside"] = True
    self._log(
        "warning", "%s: %s, moved aside to %s; retained store starts empty" % (path, why, bad)
    )


def _open_read_only(self, err, why=None):
    """The data directory cannot be written (a read-only filesystem,
    no space to create the file, ...), or why (the file is a newer
    format): serve from RAM (FAILURES). What the file holds is loaded
    as in "disc" mode (a RAM copy of every message, whatever the mode;
    nothing if it is not this format), changes stay in RAM, nothing is
    written; durable is False so the broker acknowledges at once."""
    self.read_only = True
    self.durable = False
    if why is None:
        why = "cannot be written (%r)" % (err,)
        self.degraded = "read-only data dir (%r)" % (err,)
    else:
        self.degraded = why
    self._f = None
    self._reset()
    if self._msgs is None:
        self._msgs = [None] * len(self._ix)
    self._log(
        "error",
        "%s: %s: retained store is read-only, "
        "served from RAM; changes are NOT kept across a restart" % (self.path, why),
    )
    try:
        f = self._fs.open(self.path, "rb")
    except OSError:
        self._f = True  # open, no file: nothing to read
        return
    self._f = f
    try:
        size = f.seek(0, 2)
        f.seek(0)
        if header_kind(f.read(_HDR), size) == "ok":
            _load_all(self, f, size)
    except (OSError, MemoryError) as e:
        self._reset()
        self._log("error", "%s: unreadable (%r): retained store starts empty" % (self.path, e))


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
    for ev in replay(f, size, msgs is not None):
        kind, off, n, x = ev
        if kind == T_PUT:
            st["records"] += 1
            if msgs is not None and not st["records"] & 127:
                # MicroPython, "disc": collect before the garbage of
                # reading spreads the messages kept over the whole heap,
                # which leaves no block for the next index chunk
                # (measured: MemoryError for 3 KB with 1.1 MB free).
                # "disc_only" keeps no object per message: no need.
                _collect()
            p = x[0]  # (x[1]: its topic as a str, which replay() checked decodes)
            tb, qos, flags, rem, stime, wall, props, payload = p
            if stime > t0:
                t0 = stime
            # a file holding more than capacity: one growth to what the
            # records so far say the whole file holds (few large blocks)
            self._room(off + n, self._n * size // (off + n) + 64)
            q = self._find(tb)
            e = self._entry(off, 1 if flags & F_EXP else 0)
            m = None
            if msgs is not None:
                # the deadline waits for the end of the scan (T is not known yet)
                m = (  # slots _M_TB .. _M_OWNEXP
                    tb,
                    payload,
                    qos,
                    props,
                    (stime, rem, wall) if flags & F_EXP else 0,
                    flags & F_OWN,
                )
            self._place(q, e, m, n)
        elif kind == T_DEL:
            st["records"] += 1
            q = self._find(x)
            if q >= 0:
                size_r = self._found_size(q)
                self._forget(q, self._fg, size_r)
        elif kind == T_CLOCK and x is not None:
            st["records"] += 1
            if x[0] > t0:
                t0 = x[0]
        elif kind == EV_BAD:
            st["corrupt"] += 1
            self._log("warning", "%s: %d unreadable bytes at %d skipped" % (self.path, n, off))
        elif kind == EV_TORN:
            end = off
        else:
            st["records"] += 1
            st["skipped_unknown"] += 1
    self._fend = end
    if end < size:
        st["torn_bytes"] = size - end
        self._torn = True
        self._log(
            "warning", "%s: torn tail of %d bytes at %d ignored" % (self.path, size - end, end)
        )
    self._t0 = t0
    self._tmark = t0
    # E4: lifetimes left, now that the last runtime T is known
    expired = 0
    if self._nexp:
        q = 0
        while q < self._n:
            o = self._ix[q]
            if not o & 1:
                q += 1
                continue
            if msgs is not None:
                m = msgs[q]
                stime, rem, wall = m[_M_EXP]  # during open: the record's clock
                size_r = PUT_OVERHEAD + len(m[_M_TB]) + len(m[_M_PAYLOAD]) + len(m[_M_PROPS])
            else:
                size_r, _, rem, stime, wall = self._head(self._off(o))
            left = self._left(stime, rem, wall)
            if left <= 0:
                self._forget(q, self._group(q), size_r)
                expired += 1
                continue  # the next entry moved to q
            if msgs is not None:
                d = self._c0 + left
                # the same message with its expiry in broker seconds (slot order: _M_*)
                exp = d if d else -1
                own = m[_M_OWNEXP]
                msgs[q] = (
                    m[_M_TB],
                    m[_M_PAYLOAD],
                    m[_M_QOS],
                    m[_M_PROPS],
                    exp,
                    own,
                )
            q += 1
    st["expired"] = expired
    st["live"] = self.count
    st["dead_bytes"] = end - _HDR - self._live

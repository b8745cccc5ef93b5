# Unit tests of the flash retained store (lib/edgestore.py), written so the
# same file runs under CPython (pytest, via test_unit.py) and under the
# MicroPython unix port (mp_runner.py). Plain functions, plain asserts.
# Every test that names a mode runs both "disc" and "disc_only". Names cite
# the rules of docs/retained.md (S8, E1, E4, D1, D6, ...).
import os
import sys

import edgestore as es

MODES = ("disc", "disc_only")
MICROPYTHON = sys.implementation.name == "micropython"
_DATA = __file__.rsplit("/", 2)[0] + "/data" if "/" in __file__ else "../data"
_seq = [0]


# ------------------------------------------------------------------ helpers
class Clock:
    """A fake broker clock (monotonic seconds) and board wall clock."""

    def __init__(self, now=1000, wall=None):
        self.now = now
        self.wall = wall

    def __call__(self):
        return self.now

    def wallclock(self):
        return self.wall


def _tmpdir():
    try:
        import tempfile
        return tempfile.mkdtemp(prefix="edgestore-")
    except ImportError:  # MicroPython
        import time
        _seq[0] += 1
        d = "/tmp/edgestore-%d-%d" % (time.ticks_us(), _seq[0])
        os.mkdir(d)
        return d


def _rmtree(d):
    for n in os.listdir(d):
        os.remove(d + "/" + n)
    os.rmdir(d)


def _exists(p):
    try:
        os.stat(p)
        return True
    except OSError:
        return False


def _read(p):
    with open(p, "rb") as f:
        return f.read()


def _write(p, data):
    with open(p, "wb") as f:
        f.write(data)


def M(topic, payload, qos=1, props=b"", deadline=0, own=0):
    return (topic, topic.encode(), payload, qos, props, deadline, own)


def _open(d, mode, clock=None, **kw):
    clock = clock if clock is not None else Clock()
    kw.setdefault("capacity", 100)
    return es.FlashStore(d + "/r.ebrs", mode, clock=clock, wallclock=clock.wallclock, **kw)


def _contents(st):
    # topic -> (payload, qos, props, deadline, own) of every message
    out = {}
    for m in st.messages():
        assert m[0] not in out, "yielded twice: " + m[0]
        out[m[0]] = (m[2], m[3], m[4], m[5], m[6])
    return out


def _each_mode(fn):
    for mode in MODES:
        d = _tmpdir()
        try:
            fn(d, mode)
        finally:
            _rmtree(d)


class CountingFs(es.Fs):
    """Counts reads (calls and bytes) of the files it opens."""

    def __init__(self):
        self.reads = 0

    def open(self, path, mode):
        return _CountingFile(open(path, mode), self)


class _CountingFile:
    def __init__(self, f, fs):
        self.f = f
        self.fs = fs

    def read(self, n=-1):
        self.fs.reads += 1
        return self.f.read(n)

    def write(self, b):
        return self.f.write(b)

    def seek(self, *a):
        return self.f.seek(*a)

    def flush(self):
        self.f.flush()

    def fileno(self):
        return self.f.fileno()

    def close(self):
        self.f.close()


class FailingFs(es.Fs):
    """Raises OSError on the writes numbered in `fail` (counted from 1)."""

    def __init__(self, fail):
        self.fail = fail
        self.n = 0
        self.reads = 0

    def open(self, path, mode):
        return _FailingFile(open(path, mode), self)


class _FailingFile(_CountingFile):
    def write(self, b):
        self.fs.n += 1
        if self.fs.n in self.fs.fail:
            self.f.write(bytes(b)[:len(b) // 2])  # half of it reaches the disk
            raise OSError(28)  # ENOSPC
        return self.f.write(b)


# ------------------------------------------------------------ basic interface
def test_put_get_replace_delete_S1_S3():
    def run(d, mode):
        st = _open(d, mode)
        assert st.durable is True and st.count == 0 and st.nbytes == 0
        assert st.get("a/b") is None
        st.put("a/b", M("a/b", b"1"))
        st.put("a/c", M("a/c", b"22", qos=2, props=b"\x01\x01"))
        assert st.get("a/b")[2] == b"1" and st.count == 2
        st.put("a/b", M("a/b", b"333", qos=0))  # S1: one per topic, replaced
        m = st.get("a/b")
        assert m[0] == "a/b" and m[1] == b"a/b" and m[2] == b"333" and m[3] == 0
        assert st.get("a/c")[4] == b"\x01\x01"
        assert st.count == 2 and st.nbytes == (3 + 3) + (3 + 2 + 2)
        assert st.delete("a/b") is True      # S3: deletes
        assert st.delete("a/b") is False
        assert st.delete("never") is False
        assert st.get("a/b") is None and st.count == 1 and st.nbytes == 7
        st.close()
    _each_mode(run)


def test_delete_of_missing_topic_writes_nothing():
    def run(d, mode):
        st = _open(d, mode)
        st.commit()
        size = st.file_bytes
        assert st.delete("x") is False
        st.commit()
        assert st.file_bytes == size
        st.close()
    _each_mode(run)


def test_disc_get_returns_the_stored_tuple():
    d = _tmpdir()
    try:
        st = _open(d, "disc")
        m = M("t", b"v")
        st.put("t", m)
        assert st.get("t") is m
        st.close()
    finally:
        _rmtree(d)


def test_match_wildcards_and_dollar_topics_D1_D6_MQTT_4_7_2_1():
    def run(d, mode):
        st = _open(d, mode)
        for t in ("a/b", "a/c", "a/b/c", "a", "x/b", "$SYS/x", "$app/y", "/lead"):
            st.put(t, M(t, t.encode()))

        def got(f):
            return sorted(m[0] for m in st.match(f.split("/")))
        assert got("a/+") == ["a/b", "a/c"]
        assert got("a/#") == ["a", "a/b", "a/b/c", "a/c"]  # 'a/#' matches 'a'
        assert got("+/b") == ["a/b", "x/b"]
        assert got("#") == ["/lead", "a", "a/b", "a/b/c", "a/c", "x/b"]  # no $ topics
        assert got("+") == ["a"]
        assert got("+/+") == ["/lead", "a/b", "a/c", "x/b"]
        assert got("$SYS/#") == ["$SYS/x"]
        assert got("$app/+") == ["$app/y"]
        assert got("a/b") == ["a/b"]
        assert got("nope/+") == []
        assert got("+/lead") == ["/lead"]
        st.close()
    _each_mode(run)


def test_literal_first_level_filter_does_not_read_every_message():
    d = _tmpdir()
    try:
        fs = CountingFs()
        st = _open(d, "disc_only", fs=fs, capacity=600)
        for g in range(20):
            for i in range(25):
                t = "g%d/%d" % (g, i)
                st.put(t, M(t, b"v"))
        st.commit()
        fs.reads = 0
        got = [m[0] for m in st.match(["g7", "+"])]
        assert len(got) == 25
        # two reads a record; 500 messages; only g7's group (plus a rare
        # first-level hash collision) is read
        assert fs.reads <= 2 * 50, fs.reads
        fs.reads = 0
        assert len(list(st.match(["+", "3"]))) == 20
        assert fs.reads >= 2 * 500  # a leading wildcard reads them all
        st.close()
    finally:
        _rmtree(d)


def test_hash_collisions_are_told_apart():
    # two topics with the same 30-bit hash (found once by a birthday search);
    # this also pins topic_hash: it must stay the same on every interpreter
    pair = ("c/e31b7480-632", "c/833abbd5-1324")
    assert es.topic_hash(pair[0].encode()) == es.topic_hash(pair[1].encode())

    def run(d, mode):
        a, b = pair
        st = _open(d, mode)
        st.put(a, M(a, b"A"))
        st.put(b, M(b, b"B"))
        assert st.get(a)[2] == b"A" and st.get(b)[2] == b"B" and st.count == 2
        st.put(b, M(b, b"BB"))
        assert st.get(a)[2] == b"A" and st.get(b)[2] == b"BB" and st.count == 2
        st.commit()
        st.close()
        st = _open(d, mode)
        assert st.get(a)[2] == b"A" and st.get(b)[2] == b"BB"
        assert st.delete(a) and st.get(a) is None and st.get(b)[2] == b"BB"
        st.close()
    _each_mode(run)


def test_iterator_safe_under_puts_deletes_and_compaction():
    # entries present throughout are yielded exactly once, whatever changes
    def run(d, mode):
        st = _open(d, mode, compact_min_bytes=0, capacity=0)
        keep = []
        for i in range(300):
            t = "k/%d" % i
            st.put(t, M(t, b"v%d" % i))
            if i % 3 == 0:
                keep.append(t)
        st.commit()
        it = st.match(["k", "#"])
        seen = {}
        n = 0
        for m in it:
            seen[m[0]] = seen.get(m[0], 0) + 1
            n += 1
            j = n * 7 % 300
            t = "k/%d" % j
            if j % 3:
                # churn on topics not in keep: delete, re-add, new ones
                if st.get(t) is not None:
                    st.delete(t)
                else:
                    st.put(t, M(t, b"again"))
            if n < 200:  # new entries land ahead of the cursor: bounded
                st.put("k/new%d" % n, M("k/new%d" % n, b"n"))
            for t in keep[:5]:
                st.put(t, M(t, b"replaced"))  # replaced in place
            if n % 50 == 0:
                st.commit()
                st.compact()  # offsets move, slots do not
        for t in keep:
            assert seen.get(t) == 1, (t, seen.get(t))
        for t in seen:
            # never deleted: added behind the cursor may be missed, never twice
            if t.startswith("k/new"):
                assert seen[t] == 1, t
        assert st.compactions >= 1
        st.close()
    _each_mode(run)


def test_iterator_close_and_store_close_end_iteration():
    def run(d, mode):
        st = _open(d, mode)
        for i in range(10):
            st.put("t/%d" % i, M("t/%d" % i, b"x"))
        it = st.match(["t", "+"])
        next(it)
        it.close()  # the broker closes iterators it abandons
        it = st.match(["#"])
        next(it)
        st.close()
        assert list(it) == []
    _each_mode(run)


# ------------------------------------------------------------- durability
def test_reopen_keeps_everything_committed_S8():
    def run(d, mode):
        st = _open(d, mode)
        st.put("a", M("a", b"1"))
        st.put("b/c", M("b/c", b"2" * 3000, qos=2, props=b"\x03\x00\x01x"))  # > buffer
        st.put("a", M("a", b"11"))
        st.put("d", M("d", b"4"))
        st.delete("d")
        st.commit()
        want = _contents(st)
        count, nbytes = st.count, st.nbytes
        st.close()
        st = _open(d, mode)
        assert _contents(st) == want
        assert st.count == count and st.nbytes == nbytes
        o = st.open_stats
        assert o["records"] == 5 and o["live"] == 2 and o["corrupt"] == 0 and o["torn_bytes"] == 0
        st.close()
    _each_mode(run)


def test_uncommitted_changes_reach_flash_at_close_and_expire():
    def run(d, mode):
        st = _open(d, mode)
        st.put("a", M("a", b"1"))
        st.close()
        st = _open(d, mode)
        assert st.get("a")[2] == b"1"
        st.put("b", M("b", b"2"))
        st.expire(0, 8)  # a tick makes pending writes durable
        assert not st._wn and not st._unsynced
        st.close()
    _each_mode(run)


def test_write_error_then_rewrite_keeps_committed_data():
    # a failed (half) write leaves unknown bytes: the next commit rewrites
    def run(d, mode):
        fs = FailingFs((3,))
        st = _open(d, mode, fs=fs)
        st.put("a", M("a", b"1"))
        st.commit()                       # write 2 (write 1 is the header)
        st.put("b", M("b", b"2"))
        try:
            st.commit()                   # write 3 fails half way
            raise AssertionError("no error")
        except OSError:
            pass
        st.put("c", M("c", b"3"))         # compacts first: never after garbage
        st.commit()
        assert st.compactions == 1
        st.close()
        st = _open(d, mode)
        assert sorted(_contents(st)) == ["a", "b", "c"]
        assert st.open_stats["torn_bytes"] == 0 and st.open_stats["corrupt"] == 0
        st.close()
    _each_mode(run)


# ------------------------------------------------------------------ expiry
def test_expire_removes_passed_deadlines_with_bounded_work_E1():
    def run(d, mode):
        c = Clock(now=100)
        st = _open(d, mode, clock=c)
        for i in range(20):
            t = "e/%d" % i
            st.put(t, M(t, b"x", deadline=110 if i % 2 else 0, own=1))
        assert st.expire(105, 100) == 0
        assert st.expire(110, 5) <= 5  # at most `budget` slots looked at
        total = 0
        for _ in range(10):
            total += st.expire(110, 5)
        assert st.count == 10
        want = sorted("e/%d" % i for i in range(0, 20, 2))
        assert sorted(m[0] for m in st.match(["e", "+"])) == want
        st.close()
    _each_mode(run)


def test_expiry_across_restart_without_wallclock_E4():
    # No set clock: the runtime recorded by CLOCK markers is subtracted; the
    # power-off time is unknown and not counted (documented bound).
    def run(d, mode):
        c = Clock(now=1000)
        st = _open(d, mode, clock=c)
        st.put("a", M("a", b"1", deadline=1000 + 100, own=1))  # 100 s to live
        st.put("b", M("b", b"2", deadline=1000 + 500))          # board default
        st.put("c", M("c", b"3"))                               # forever
        st.commit()
        c.now = 1070
        st.commit()            # >= 60 s since the last marker: CLOCK 70
        c.now = 1090
        st.close()             # close records the exact runtime: 90
        c.now = 5              # a new run: the broker clock starts again
        st = _open(d, mode, clock=c)
        a, b = st.get("a"), st.get("b")
        assert a[5] == 5 + 10 and a[6] == 1    # 100 - 90 left
        assert b[5] == 5 + 410 and b[6] == 0
        assert st.get("c")[5] == 0
        c.now = 15
        st.close()             # 10 more seconds of runtime (total 100)
        c.now = 0
        st = _open(d, mode, clock=c)
        assert st.get("a") is None, "lived past its lifetime"
        assert st.get("b")[5] == 400
        assert st.open_stats["expired"] == 1
        st.close()
    _each_mode(run)


def test_expiry_after_power_cut_is_late_by_at_most_the_unrecorded_time_E4():
    # a cut (no close): runtime after the last marker is lost, nothing more
    def run(d, mode):
        c = Clock(now=0)
        st = _open(d, mode, clock=c, mark_interval=60)
        st.put("a", M("a", b"1", deadline=200, own=1))
        st.commit()
        for t in range(1, 181):
            c.now = t
            st.expire(t, 16)   # the broker's tick: markers every 60 s
        # power cut at runtime 180: no close(); the last marker says 180
        st._f.close()
        st._f = None
        c.now = 0
        st = _open(d, mode, clock=c)
        assert st.get("a")[5] == 20  # 200 - 180: exact, the cut fell on a marker
        st.close()
    _each_mode(run)


def test_expiry_across_restart_with_wallclock_E4():
    # The clock is set: the downtime is known, the lifetime is exact.
    def run(d, mode):
        c = Clock(now=50, wall=1700000000)
        st = _open(d, mode, clock=c)
        st.put("a", M("a", b"1", deadline=50 + 1000, own=1))
        st.put("b", M("b", b"2", deadline=50 + 5000, own=1))
        st.commit()
        st.close()                 # runtime 0 s; then 3,000 s powered off
        c.now = 7
        c.wall = 1700003000
        st = _open(d, mode, clock=c)
        assert st.get("a") is None and st.open_stats["expired"] == 1
        assert st.get("b")[5] == 7 + 2000
        st.close()
        # a clock set wrongly into the past cannot extend a lifetime: the
        # runtime estimate is a floor on the time that passed
        c.now = 0
        c.wall = 1600000000
        st = _open(d, mode, clock=c)
        assert st.get("b")[5] == 5000
        st.close()
    _each_mode(run)


def test_expiry_deadlines_round_down_never_late_E2():
    def run(d, mode):
        c = Clock(now=10.75)
        st = _open(d, mode, clock=c)
        st.put("a", M("a", b"1", deadline=30.5, own=1))
        m = st.get("a")
        assert 29.5 < m[5] <= 30.5
        st.close()
    _each_mode(run)


def test_clock_markers_bounded_wear():
    def run(d, mode):
        c = Clock(now=0)
        st = _open(d, mode, clock=c)
        st.put("p", M("p", b"1"))  # no lifetime: markers are useless
        for t in range(0, 600, 10):
            c.now = t
            st.commit()
            st.expire(t, 4)
        size = st.file_bytes
        assert size == 8 + 29 + 2
        st.put("q", M("q", b"1", deadline=10000))
        for t in range(600, 1200, 10):
            c.now = t
            st.put("p", M("p", b"%d" % t))
            st.commit()
        # ten minutes with a lifetime held: a marker per minute, no more
        r = es.inspect(d + "/r.ebrs")
        assert r["by_type"]["CLOCK"] == 10, r["by_type"]
        st.close()
    _each_mode(run)


# ---------------------------------------------------------------- recovery
def test_torn_tail_is_ignored_then_rewritten():
    def run(d, mode):
        st = _open(d, mode)
        st.put("a", M("a", b"1"))
        st.put("b", M("b", b"2"))
        st.close()
        p = d + "/r.ebrs"
        good = _read(p)
        torn = es.encode(es.T_PUT, es.put_parts(b"c", 1, 0, 0, 0, 0, b"", b"3"))
        for cut in (1, 8, len(torn) - 1):
            _write(p, good + bytes(torn[:cut]))
            st = _open(d, mode)
            assert sorted(_contents(st)) == ["a", "b"]
            assert st.open_stats["torn_bytes"] == cut
            st.put("d", M("d", b"4"))  # the first write drops the torn tail
            st.commit()
            st.close()
            st = _open(d, mode)
            assert sorted(_contents(st)) == ["a", "b", "d"]
            assert st.open_stats["torn_bytes"] == 0
            st.delete("d")
            st.close()
    _each_mode(run)


def test_corrupt_record_is_skipped_and_counted():
    def run(d, mode):
        st = _open(d, mode)
        for t in ("a", "b", "c"):
            st.put(t, M(t, b"payload-" + t.encode()))
        st.close()
        p = d + "/r.ebrs"
        raw = bytearray(_read(p))
        i = bytes(raw).find(b"payload-b")
        raw[i] ^= 0xFF
        _write(p, raw)
        logs = []
        st = _open(d, mode, log=lambda lv, text: logs.append(lv))
        assert sorted(_contents(st)) == ["a", "c"]
        assert st.open_stats["corrupt"] == 1 and st.open_stats["torn_bytes"] == 0
        assert "warning" in logs
        st.close()
    _each_mode(run)


def test_unknown_record_type_is_skipped():
    def run(d, mode):
        st = _open(d, mode)
        st.put("a", M("a", b"1"))
        st.close()
        p = d + "/r.ebrs"
        _write(p, _read(p) + es.encode(0x7A, (b"from the future",))
               + es.encode(es.T_PUT, es.put_parts(b"b", 0, 0, 0, 0, 0, b"", b"2")))
        st = _open(d, mode)
        assert sorted(_contents(st)) == ["a", "b"]
        assert st.open_stats["skipped_unknown"] == 1 and st.open_stats["corrupt"] == 0
        st.close()
    _each_mode(run)


def test_unreadable_store_moved_aside_to_bad():
    def run(d, mode):
        p = d + "/r.ebrs"
        for head in (b"EBRX\x01\x00\x00\x00", b"EBRS\x02\x00\x00\x00", b"junk"):
            _write(p, head + b"whatever follows")
            _write(p + ".bad", b"an older .bad")
            logs = []
            st = _open(d, mode, log=lambda lv, text, logs=logs: logs.append((lv, text)))
            assert st.open_stats["moved_aside"] is True and st.count == 0
            assert _read(p + ".bad") == head + b"whatever follows"  # replaced the older
            assert logs and logs[0][0] == "warning" and ".bad" in logs[0][1]
            st.put("a", M("a", b"1"))
            st.close()
            st = _open(d, mode)
            assert sorted(_contents(st)) == ["a"] and not st.open_stats["moved_aside"]
            st.close()
    _each_mode(run)


def test_cut_creation_starts_empty_quietly():
    def run(d, mode):
        p = d + "/r.ebrs"
        for n in range(8):
            _write(p, es.HEADER[:n])
            st = _open(d, mode)
            assert st.count == 0 and not st.open_stats["moved_aside"]
            st.close()
            assert _read(p) == es.HEADER and not _exists(p + ".bad")
    _each_mode(run)


# --------------------------------------------------------------- compaction
def test_compaction_triggered_contents_identical():
    def run(d, mode):
        c = Clock(now=0)
        st = _open(d, mode, clock=c, compact_min_bytes=2048, capacity=64)
        for rnd in range(40):
            for i in range(10):
                t = "c/%d" % i
                st.put(t, M(t, b"%d-%d" % (rnd, i), qos=i % 3,
                            deadline=5000 if i == 3 else 0, own=1))
            st.delete("c/9")
            st.commit()
            assert st.dead_bytes <= 0.5 * st.file_bytes or st.file_bytes <= 2048
        assert st.compactions >= 1
        want = _contents(st)
        written = st.bytes_written
        assert written > st.file_bytes
        st.close()
        st = _open(d, mode, clock=Clock(now=0))
        assert _contents(st) == want
        assert not _exists(d + "/r.ebrs.new")
        st.close()
    _each_mode(run)


def test_compaction_reclaims_expired_messages():
    def run(d, mode):
        c = Clock(now=0)
        st = _open(d, mode, clock=c)
        st.put("gone", M("gone", b"x", deadline=10, own=1))
        st.put("stay", M("stay", b"y"))
        c.now = 20
        st.compact()
        assert st.count == 1 and st.get("gone") is None and st.get("stay")[2] == b"y"
        assert st.dead_bytes == es.CLOCK_SIZE
        st.close()
    _each_mode(run)


def test_leftover_new_file_removed_at_open():
    def run(d, mode):
        st = _open(d, mode)
        st.put("a", M("a", b"1"))
        st.close()
        p = d + "/r.ebrs"
        _write(p + ".new", es.HEADER + b"half a compaction")
        st = _open(d, mode)
        assert not _exists(p + ".new") and sorted(_contents(st)) == ["a"]
        st.close()
        # a complete .new and no file: the cut fell between remove and rename
        # (FAT cannot rename over a file): the .new is adopted
        os.rename(p, p + ".new")
        st = _open(d, mode)
        assert not _exists(p + ".new") and sorted(_contents(st)) == ["a"]
        st.close()
    _each_mode(run)


def test_unlimited_capacity_grows_in_chunks():
    def run(d, mode):
        st = _open(d, mode, capacity=0)
        for i in range(1500):
            t = "u/%d" % i
            st.put(t, M(t, b"%d" % i))
        assert st.count == 1500 and st._nb >= 1500 // 4
        assert st.get("u/777")[2] == b"777"
        st.commit()
        st.close()
        st = _open(d, mode, capacity=10)  # the file holds more than capacity
        assert st.count == 1500 and st.get("u/1499")[2] == b"1499"
        st.close()
    _each_mode(run)


def test_bytes_written_counts_everything():
    def run(d, mode):
        st = _open(d, mode)
        assert st.bytes_written == 8
        st.put("a", M("a", b"1"))
        st.commit()
        assert st.bytes_written == 8 + 31
        st.compact()
        assert st.bytes_written == 8 + 31 + 8 + 31 + es.CLOCK_SIZE
        st.close()
    _each_mode(run)


# ------------------------------------------------------------- heap (board)
def test_disc_only_heap_per_retained_message_at_most_16_bytes():
    # MicroPython only: gc.mem_alloc() per retained message over 2,000
    if not MICROPYTHON:
        return
    import gc
    d = _tmpdir()
    try:
        gc.collect()
        a0 = gc.mem_alloc()
        st = es.FlashStore(d + "/h.ebrs", "disc_only", capacity=2000, clock=Clock())
        for i in range(2000):
            t = "sensors/%d/temperature" % i
            st.put(t, (t, t.encode(), b"x" * 64, 1, b"", 0, 0))
            if i % 64 == 0:
                st.commit()
        st.commit()
        gc.collect()
        per = (gc.mem_alloc() - a0) / 2000
        st.close()
        assert per <= 16, "%.1f bytes per retained message" % per
    finally:
        _rmtree(d)


# ------------------------------------------------------------- golden files
# What host_tests/data/make_golden.py wrote; opening must keep reading it so.
GOOD = {
    "sensors/t1": (b"22.0", 2, b"", 0),
    "config/mode": (b"auto", 1, b"\x03\x00\x0atext/plain", 0),
    "alerts/door": (b"open", 1, b"", 1),
    "$app/version": (b"1.2", 1, b"", 0),
    "caf\u00e9/\u6c34": (b"\x00\x01\xff", 1, b"", 0),
}


def _golden(name, mode, wall=None):
    d = _tmpdir()
    p = d + "/r.ebrs"
    _write(p, _read(_DATA + "/" + name))
    c = Clock(now=1000, wall=wall)
    st = es.FlashStore(p, mode, capacity=16, clock=c, wallclock=c.wallclock)
    got = {}
    for m in st.messages():
        got[m[0]] = (m[2], m[3], m[4], m[6])
    deadline = None
    m = st.get("alerts/door")
    if m is not None:
        deadline = m[5]
    o = st.open_stats
    st.close()
    return d, got, o, deadline


def _check_golden(name, want, stats, wall=None, deadline=None):
    for mode in MODES:
        d, got, o, dl = _golden(name, mode, wall)
        try:
            assert got == want, (name, mode, got)
            for k in stats:
                assert o[k] == stats[k], (name, mode, k, o[k], stats[k])
            if deadline is not None:
                assert dl == deadline, (name, mode, dl)
        finally:
            _rmtree(d)


def test_golden_good():
    # runtime clock: alerts/door written at 30 with 3600 s, last marker 300
    _check_golden("good.ebrs", GOOD, {"records": 10, "live": 5, "dead_bytes": 164,
                                      "torn_bytes": 0, "corrupt": 0, "skipped_unknown": 0,
                                      "expired": 1, "moved_aside": False},
                  deadline=1000 + 3330)


def test_golden_good_with_wallclock_E4():
    # wall clock set: 1700000000 + 3600 - 1700000500 = 3100 left
    _check_golden("good.ebrs", GOOD, {"live": 5, "expired": 1},
                  wall=1700000500, deadline=1000 + 3100)


def test_golden_empty():
    _check_golden("empty.ebrs", {}, {"records": 0, "live": 0, "dead_bytes": 0,
                                     "torn_bytes": 0, "moved_aside": False, "created": False})


def test_golden_torn_tail():
    _check_golden("torn_tail.ebrs", GOOD, {"records": 10, "live": 5, "dead_bytes": 164,
                                           "torn_bytes": 20, "corrupt": 0})


def test_golden_corrupt_record():
    want = dict(GOOD)
    del want["config/mode"]
    _check_golden("corrupt_record.ebrs", want, {"records": 9, "live": 4, "dead_bytes": 221,
                                                "torn_bytes": 0, "corrupt": 1})


def test_golden_unknown_record():
    _check_golden("unknown_record.ebrs", GOOD, {"records": 11, "live": 5, "dead_bytes": 193,
                                                "skipped_unknown": 1, "corrupt": 0})


def test_golden_bad_magic_and_future_version_moved_aside():
    for name in ("bad_magic.ebrs", "future_version.ebrs"):
        for mode in MODES:
            d, got, o, _ = _golden(name, mode)
            try:
                assert got == {} and o["moved_aside"] is True and o["created"] is True
                assert _read(d + "/r.ebrs.bad") == _read(_DATA + "/" + name)
                assert _read(d + "/r.ebrs") == es.HEADER
            finally:
                _rmtree(d)


def test_golden_good_is_what_flashstore_writes():
    # The scripted history of make_golden.py, replayed through FlashStore,
    # gives good.ebrs byte for byte: the writer and the golden files agree.
    ct = b"\x03\x00\x0atext/plain"
    for mode in MODES:
        d = _tmpdir()
        try:
            c = Clock(now=0)
            st = _open(d, mode, clock=c)
            script = (
                (10, None, "sensors/t1", b"21.5", 1, b"", 0, 0),
                (12, None, "sensors/t2", b"19.0", 0, b"", 0, 0),
                (20, None, "sensors/t1", b"22.0", 2, b"", 0, 0),
                (25, None, "config/mode", b"auto", 1, ct, 0, 0),
                (30, 1700000000, "alerts/door", b"open", 1, b"", 30 + 3600, 1),
                (40, None, "status/boot", b"ok", 0, b"", 40 + 100, 0),
                (45, None, "sensors/t2", None, 0, b"", 0, 0),
                (50, None, "$app/version", b"1.2", 1, b"", 0, 0),
                (60, None, "caf\u00e9/\u6c34", b"\x00\x01\xff", 1, b"", 0, 0),
            )
            for now, wall, t, payload, qos, props, dl, own in script:
                c.now = now
                c.wall = wall
                if payload is None:
                    st.delete(t)
                else:
                    st.put(t, M(t, payload, qos, props, dl, own))
            c.now = 300.5
            c.wall = 1700000270
            st.commit()  # the CLOCK marker (300, wall) goes before the sync
            st._f.close()  # a power cut: no close() marker
            st._f = None
            assert _read(d + "/r.ebrs") == _read(_DATA + "/good.ebrs"), mode
        finally:
            _rmtree(d)


def test_inspect_reports_like_open():
    r = es.inspect(_DATA + "/torn_tail.ebrs", wall_now=1700000500)
    assert r["status"] == "torn" and r["damaged"] is True and r["torn_offset"] == 401
    assert [e["topic"] for e in r["live"]] == [
        "sensors/t1", "config/mode", "alerts/door", "$app/version", "caf\u00e9/\u6c34"]
    door = r["live"][2]
    assert door["remaining"] == 3100 and door["expires_at"] == 1700003600
    assert [e["topic"] for e in r["expired"]] == ["status/boot"]
    r = es.inspect(_DATA + "/good.ebrs")
    assert r["status"] == "ok" and not r["damaged"] and r["dead_bytes"] == 164
    assert r["live"][2]["remaining"] == 3330
    assert es.inspect(_DATA + "/bad_magic.ebrs")["status"] == "bad_magic"
    assert es.inspect(_DATA + "/future_version.ebrs")["status"] == "future_version"
    assert es.inspect(_DATA + "/corrupt_record.ebrs")["corrupt_offsets"] == [137]

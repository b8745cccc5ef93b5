# Crash safety of the flash retained store on littlefs v2, at every block
# write (docs/retained.md "Crash safety", rule S8). MicroPython only:
#
#   micropython lfs_crash.py LIBDIR [--torn]
#
# A RAM block device (extended interface: readblocks/writeblocks with an
# offset, ioctl erase) is formatted with vfs.VfsLfs2 and mounted at /flash;
# a scripted sequence of puts, deletes, commits, CLOCK markers and
# compactions runs against FlashStore("/flash/r.ebrs"). The run is counted
# in device write operations (prog + erase). Then, for every cut point K,
# the sequence runs again on a fresh device that keeps only its first K
# write operations (the next one raises OSError(EIO), like a brown-out);
# with --torn the (K+1)-th prog also lands half of its bytes first. The
# surviving image is mounted again and the store reopened: it must open,
# hold every change whose commit() returned, hold a prefix of the sequence
# (no torn record, no corrupt one), and keep working (a put + commit +
# reopen). Prints "N passed, N failed".
import sys

import vfs

sys.path.insert(0, sys.argv[1])
import edgestore as es

TORN = "--torn" in sys.argv
BS = 512         # littlefs needs blocks of at least 128 bytes
NB = 48          # 24 KB: the store file, its .new and littlefs metadata
MOUNT = "/flash"
PATH = MOUNT + "/r.ebrs"


class Cut(Exception):
    pass


class RamDev:
    """A block device in RAM that keeps only its first `limit` writes."""

    def __init__(self, image, limit=-1):
        self.data = bytearray(image)
        self.limit = limit
        self.writes = 0
        self.dead = False   # after the run: nothing reads or writes any more

    def _op(self, buf=None, a=0):
        if 0 <= self.limit <= self.writes:
            if TORN and buf is not None and self.writes == self.limit:
                n = len(buf) // 2
                self.data[a:a + n] = buf[:n]
                self.writes += 1
            # The power is gone: nothing after the cut reaches the device,
            # as on a board that lost power (later writes are dropped, reads
            # answer nothing). Failing every later write instead sent
            # littlefs down its error paths again and again while the store
            # cleaned up, and the MicroPython 1.29 unix port crashed there
            # (SIGSEGV) in about one run in 80 (2026-11-26).
            self.dead = True
            raise OSError(5)  # EIO
        self.writes += 1

    def readblocks(self, block, buf, off=0):
        if self.dead:
            return  # a finalizer of a dead file, maybe with the heap locked
        a = block * BS + off
        buf[:] = memoryview(self.data)[a:a + len(buf)]

    def writeblocks(self, block, buf, off=None):
        if self.dead:
            return
        a = block * BS + (off or 0)
        self._op(buf, a)
        self.data[a:a + len(buf)] = buf

    def ioctl(self, op, arg):
        if op == 4:   # block count
            return NB
        if op == 5:   # block size
            return BS
        if op == 6:   # erase: littlefs v2 does not rely on erased values
            if not self.dead:
                self._op()
            return 0
        return 0


class Clock:
    def __init__(self):
        self.now = 0

    def __call__(self):
        return self.now


def msg(topic, payload, deadline=0):
    return (topic.encode(), payload, 1, b"", deadline, 1 if deadline else 0)


def script():
    ops = [("put", "life", b"long", 1000000)]
    for r in range(40):
        ops.append(("put", "t/%d" % (r % 4), b"v%d-" % r + b"x" * (r % 5) * 20, 0))
        if r % 4 == 3:
            ops.append(("delete", "t/%d" % ((r + 1) % 4)))
        if r == 9:
            ops.append(("put", "big", b"B" * 700, 0))  # several blocks
        if r % 2:
            ops.append(("commit",))
    ops.append(("commit",))
    return ops


def states(ops):
    cur = {}
    out = [dict(cur)]
    for op in ops:
        if op[0] == "put":
            cur[op[1]] = op[2]
        elif op[0] == "delete":
            cur.pop(op[1], None)
        else:
            continue
        out.append(dict(cur))
    return out


def open_store(mode, clock):
    return es.FlashStore(PATH, mode, capacity=16, clock=clock, compact_min_bytes=900,
                         buffer_size=256)


def mount(dev):
    vfs.mount(vfs.VfsLfs2(dev), MOUNT)


def umount():
    try:
        vfs.umount(MOUNT)
    except Exception:
        pass


def run(mode, ops, dev):
    """Runs ops until done or cut: (committed, attempted, compactions)."""
    clock = Clock()
    committed = attempted = done = 0
    comp = 0
    st = None
    try:
        mount(dev)
        st = open_store(mode, clock)
        for op in ops:
            clock.now += 9
            if op[0] == "commit":
                st.commit()
                if st.durable:  # not a store that fell back to RAM (read_only)
                    committed = done
                comp = st.compactions
                continue
            attempted += 1
            if op[0] == "put":
                st.put(op[1], msg(op[1], op[2], op[3] and clock.now + op[3]))
            else:
                st.delete(op[1])
            done += 1
        st.close()
        if st.durable:
            committed = done
    except OSError:
        # the image is final: later writes (file finalizers, the dead
        # store's close) are dropped, later reads answer nothing
        dev.dead = True
        if st is not None and st._f is not None:
            try:
                st._f.close()
            except OSError:
                pass
    umount()
    dev.dead = True  # the image is final (a store's close() logs a failed write)
    return committed, attempted, comp


def contents(st):
    out = {}
    for m in st.messages():
        if m[0].decode() in out:
            raise Cut("yielded twice: " + m[0].decode())
        out[m[0].decode()] = m[1]
    return out


def check(mode, image, allowed):
    dev = RamDev(image)
    try:
        mount(dev)
    except OSError as e:
        return "littlefs does not mount: %r" % (e,)
    try:
        st = open_store(mode, Clock())
        got = contents(st)
        if got not in allowed:
            return "recovered %r, allowed %r" % (sorted(got), [sorted(a) for a in allowed])
        o = st.open_stats
        if o["corrupt"] or o["moved_aside"]:
            return "open stats %r" % (o,)
        st.put("post", msg("post", b"p"))
        st.commit()
        st.close()
        st = open_store(mode, Clock())
        got2 = contents(st)
        st.close()
        want = dict(got)
        want["post"] = b"p"
        if got2 != want:
            return "after a write: %r" % (sorted(got2),)
        return None
    finally:
        umount()


def main():
    base = RamDev(bytes(NB * BS))
    vfs.VfsLfs2.mkfs(base)
    image = bytes(base.data)
    ops = script()
    sts = states(ops)
    passed = failed = 0
    for mode in ("disc", "disc_only"):
        dev = RamDev(image)
        committed, attempted, comp = run(mode, ops, dev)
        total = dev.writes
        err = check(mode, dev.data, [sts[-1]])
        if err is not None or comp < 2:
            print("FAIL %s full run: %s (compactions %d)" % (mode, err, comp))
            failed += 1
        print("%s: %d block writes, %d compactions%s" % (mode, total, comp,
                                                          " (torn progs)" if TORN else ""))
        for k in range(total + 1):
            dev = RamDev(image, k)
            committed, attempted, _ = run(mode, ops, dev)
            try:
                err = check(mode, dev.data, sts[committed:attempted + 1])
            except Exception as e:  # report, go on
                err = "raised %r" % (e,)
            if err is None:
                passed += 1
            else:
                failed += 1
                print("FAIL %s cut after %d writes (committed %d, attempted %d): %s"
                      % (mode, k, committed, attempted, err))
    print("%d passed, %d failed" % (passed, failed))
    sys.exit(1 if failed else 0)


main()

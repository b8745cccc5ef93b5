# A seeded mutation fuzzer over the broker's sans-IO Engine, in process (no
# sockets), unchanged under CPython and the MicroPython unix port:
#   python|micropython fuzz_engine.py LIBDIR --count N --seed S [--quiet]
# prints "fuzz: N inputs, E internal errors, R s, seed S" and exits 1 when an
# internal error, an exception out of the engine, a broken well-formed client
# afterwards or growing memory was seen; every failing input is printed as
# "FAIL seed=S input=K hex=..." so that it can become a regression vector.
#
# The corpus is every packet type a client sends, in 5.0 and 3.1.1, with
# every property a client may send; an input is one to four corpus packets
# after a connection's CONNECT (or none), mutated (bit flips, bytes set,
# inserted, deleted, length fields rewritten, a span duplicated, another
# packet spliced in, truncated) and fed in random-sized chunks, so partial
# packets and huge claimed lengths are part of it.
import gc
import sys

if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])
    here = sys.argv[0].rsplit("/", 1)[0] if "/" in sys.argv[0] else "."
    sys.path.insert(0, here)

import edgebroker as eb  # noqa: E402
import unit_engine as ue  # noqa: E402


class Rng:
    """xorshift32: the same sequence on both interpreters for a seed."""

    def __init__(self, seed):
        self.x = (seed * 2654435761 + 1) & 0xFFFFFFFF or 1

    def next(self):
        x = self.x
        x ^= (x << 13) & 0xFFFFFFFF
        x ^= x >> 17
        x ^= (x << 5) & 0xFFFFFFFF
        self.x = x
        return x

    def below(self, n):
        return self.next() % n


def corpus():
    props5 = (
        ue.p_u32(0x11, 3600)
        + ue.p_u16(0x21, 5)
        + ue.p_u32(0x27, 65536)
        + ue.p_u16(0x22, 4)
        + b"\x19\x01\x17\x01"
        + ue.p_user("k", "v")
    )
    wprops = ue.p_u32(0x18, 2) + b"\x01\x01" + ue.p_u32(0x02, 60) + ue.p_str(0x03, "text/plain")
    wprops += ue.p_str(0x08, "resp/t") + b"\x09" + ue.s(b"corr") + ue.p_user("a", "b")
    pprops = b"\x01\x01" + ue.p_u32(0x02, 30) + ue.p_u16(0x23, 1) + ue.p_str(0x08, "r/t")
    pprops += b"\x09" + ue.s(b"cd") + ue.p_user("x", "y") + ue.p_str(0x03, "json")
    c = [
        ue.connect("fz", 5, props=props5, will=("w/t", b"bye", 1, True, wprops), user="u", pw=b"p"),
        ue.connect("fz", 4, clean=False, will=("w/t", b"bye", 2, False, b""), user="u", pw=b"p"),
        ue.connect("", 5, ka=0),
        ue.publish("a/b", b"x", 0),
        ue.publish("a/b", b"y" * 40, 1, pid=7, retain=True, props=pprops),
        ue.publish("a/c", b"z", 2, pid=9, props=pprops),
        ue.publish("", b"alias", 1, pid=8, props=ue.p_u16(0x23, 1)),
        ue.publish("a/b", b"", 1, pid=3, retain=True),
        ue.publish("a/b", b"v4", 1, pid=4, v=4),
        ue.subscribe(1, [("a/#", 1), ("+/b", 2), ("$share/g/a/+", 1)], ue.p_u16(0x0B, 5) + b"\x0b\x07"),
        ue.subscribe(2, [("a/b", 0x2E)]),
        ue.subscribe(3, [("#", 1)], v=4),
        ue.unsubscribe(4, ["a/#", "$share/g/a/+"]),
        ue.unsubscribe(5, ["#"], v=4),
        ue.ack(4, 1, 0),
        ue.ack(5, 2, 0x10),
        ue.ack(6, 9),
        ue.ack(7, 2),
        b"\xc0\x00",
        b"\xe0\x00",
        b"\xe0\x05\x04\x03\x11\x00\x00",
        b"\xf0\x05\x18\x03\x15\x00\x00",
    ]
    return c


def mutate(r, data, pool):
    b = bytearray(data)
    for _ in range(1 + r.below(4)):
        k = r.below(9)
        n = len(b)
        if k == 0 and n:
            b[r.below(n)] ^= 1 << r.below(8)
        elif k == 1 and n:
            b[r.below(n)] = r.below(256)
        elif k == 2:
            i = r.below(n + 1)
            b[i:i] = bytes((r.below(256),))
        elif k == 3 and n:
            i = r.below(n)
            b[i : i + 1 + r.below(4)] = b""
        elif k == 4 and n > 1:
            # a length field: the remaining length or a string length
            i = 1 if r.below(2) else r.below(n)
            b[i] = (0x80 | r.below(128)) if r.below(3) == 0 else r.below(256)
        elif k == 5 and n:
            i = r.below(n)
            j = i + r.below(16)
            b[j:j] = b[i:j]
        elif k == 6:
            p = pool[r.below(len(pool))]
            i = r.below(n + 1)
            b[i:i] = p[: 1 + r.below(len(p))]
        elif k == 7 and n:
            b[r.below(n) :] = b""
        elif k == 8:
            # a huge count of empty user properties in a PUBLISH
            b += ue.pk(0x30, ue.s("h") + ue.pr(b"\x26\x00\x00\x00\x00" * (1 + r.below(300))))
    return bytes(b)


def internal_errors():
    n = 0
    for level, text in ue.LOG:
        if "internal error" in text:
            n += 1
    return n


def well_formed_client_works(eng, k):
    sub = ue.Peer(eng, "okS%d" % k)
    sub.sub("ok/%d" % k, 1)
    pub = ue.Peer(eng, "okP%d" % k)
    pub.send(ue.publish("ok/%d" % k, b"fine", 1, pid=1))
    acks = pub.packets()
    if not acks or acks[0][0] != 0x40:
        return False
    eng.turn(eng.now_s)
    got = sub.msgs()
    ok = len(got) == 1 and got[0].payload == b"fine"
    eng.lost(sub.c, eng.now_s)
    eng.lost(pub.c, eng.now_s)
    return ok


def run(seed, count, quiet=True, per_engine=400):
    r = Rng(seed)
    pool = corpus()
    fails = 0
    eng = None
    now = 1000.0
    mem0 = None
    for k in range(count):
        if k % per_engine == 0:
            if eng is not None:
                eng.shutdown()
            del ue.LOG[:]
            eng = ue.mk(max_sessions=20, max_queued=20, max_inflight=5, max_user_properties=64)
            if mem0 is None and k >= count // 4:
                # after a quarter: the heap has reached its working size
                gc.collect()
                mem0 = _mem()
        now += 0.05 + r.below(100) / 1000.0
        eng.now_s = now
        stream = b""
        first = r.below(4)
        if first:
            stream = pool[first - 1] if first <= 3 else b""
        for _ in range(1 + r.below(4)):
            stream += pool[r.below(len(pool))]
        data = mutate(r, stream, pool) if r.below(8) else stream
        before = internal_errors()
        c = eng.open(None, now, "fz:1")
        try:
            i = 0
            while i < len(data) and not c.closed:
                step = 1 + r.below(64) if r.below(3) else len(data)
                chunk = data[i : i + step]
                eng.receive(c, memoryview(chunk), len(chunk), now)
                i += step
                if c.out:
                    eng.sent(c, len(c.out))
            eng.turn(now)
            if not c.closed:
                eng.lost(c, now)
            eng.turn(now + 1.1)
            bad = internal_errors() > before
        except Exception as e:  # out of the engine: a bug by definition
            bad = True
            if not quiet:
                print("exception %r" % (e,))
        if bad or (k % 97 == 0 and not well_formed_client_works(eng, k)):
            fails += 1
            print("FAIL seed=%d input=%d hex=%s" % (seed, k, _hex(data)))
            if fails > 20:
                break
    growth = 0
    if mem0 is not None:
        # measured as mem0 was: right after a new engine replaced the last
        eng.shutdown()
        eng = None
        del ue.LOG[:]
        eng = ue.mk(max_sessions=20, max_queued=20, max_inflight=5, max_user_properties=64)
        gc.collect()
        growth = _mem() - mem0
    return fails, growth


def _mem():
    try:
        return gc.mem_alloc()  # MicroPython
    except AttributeError:
        return 0


def _hex(b):
    return "".join("%02x" % x for x in b)


def main(argv):
    count, seed, quiet = 10000, 1, "--quiet" in argv
    for i in range(len(argv) - 1):
        if argv[i] == "--count":
            count = int(argv[i + 1])
        elif argv[i] == "--seed":
            seed = int(argv[i + 1])
    import time

    t0 = time.time()
    fails, growth = run(seed, count, quiet)
    dt = time.time() - t0
    print(
        "fuzz: %d inputs, %d failures, %.1f s (%d inputs/s), heap growth %d B, seed %d, %s"
        % (count, fails, dt, count / dt if dt else 0, growth, seed, sys.implementation.name)
    )
    # from a quarter of the run to its end the heap stays flat: at most one
    # engine's worth of sessions and retained messages more
    return 1 if fails or growth > 65536 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

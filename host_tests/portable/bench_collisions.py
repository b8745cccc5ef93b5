# Cost of topics that collide under the old CRC-32 index hash (issue 14 #3),
# against ordinary topics, on either interpreter:
#
#   python3 bench_collisions.py LIBDIR N [disc_only|disc]
#   micropython bench_collisions.py LIBDIR N [disc_only|disc]
#
# Stores N retained messages (put + a commit every 64, as a busy broker
# does) whose topics all have the same format-1 hash, then reopens the
# store; the same for N ordinary topics. Prints seconds (CPU time on
# CPython, elapsed on MicroPython, which is single-threaded here). LIBDIR
# may hold an older lib/edgestore.py, to compare.
import os
import sys

sys.path.insert(0, sys.argv[1])
here = sys.argv[0].rsplit("/", 1)[0] if "/" in sys.argv[0] else "."
sys.path.insert(0, here)
import edgestore as es  # noqa: E402
import unit_store  # noqa: E402

try:
    from time import process_time as _now
except ImportError:  # MicroPython
    from time import ticks_diff, ticks_ms

    _T0 = ticks_ms()

    def _now():
        return ticks_diff(ticks_ms(), _T0) / 1000


def run(topics, mode, d):
    p = d + "/b.ebrs"
    t0 = _now()
    st = es.FlashStore(p, mode, capacity=len(topics))
    for i, t in enumerate(topics):
        st.put(t, (t.encode(), b"v", 1, b"", 0, 0))
        if i % 64 == 63:
            st.commit()
    st.close()
    t1 = _now()
    st = es.FlashStore(p, mode, capacity=len(topics))
    n = st.count
    st.close()
    t2 = _now()
    os.remove(p)
    return t1 - t0, t2 - t1, n


def main():
    n = int(sys.argv[2])
    mode = sys.argv[3] if len(sys.argv) > 3 else "disc_only"
    d = unit_store._tmpdir()
    try:
        bad = unit_store.crc_collisions(n)
        ok = ["sensors/%d/value" % i for i in range(n)]
        for name, topics in (("ordinary", ok), ("colliding", bad)):
            store_s, open_s, count = run(topics, mode, d)
            print("%s %s %d topics: store %.2f s, reopen %.2f s (%d live)"
                  % (mode, name, n, store_s, open_s, count))
    finally:
        unit_store._rmtree(d)


main()

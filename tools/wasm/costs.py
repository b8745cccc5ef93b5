# In-process heap costs of the broker, the same script on two MicroPythons:
# the 32-bit WebAssembly port (under Node, tools/wasm/run.mjs) and the 64-bit
# unix port. edgebroker_tools.measure32 runs it on both and records, per
# figure, the 32-bit bytes and their ratio to the 64-bit bytes, which
# `config check` applies to the unix port's socket-level figures for a board
# with word_bytes 4.
#
# No sockets (the WebAssembly port has none): the Engine is driven through
# its sans-IO seam (open / receive / sent), so a figure here is the
# engine's part of a cost. The modules come from /lib (WebAssembly) or the
# directory the tool puts first on sys.path, as .mpy files: importing them
# keeps their bytecode in the heap, as on a board without ROMFS.
# Prints one line: "COSTS {json}".
#
# The steps are a generator, resumed once per call (run.mjs calls _step()
# until _DONE; the unix port loops over it): every figure is read with
# gc.mem_alloc() at the start of a step. The WebAssembly port's collector
# scans its C stack conservatively, and an object made earlier in the same
# call can stay pinned by a stale word there; at the start of a new call
# there is none.
import gc
import json
import os
import sys

if "/lib" not in sys.path:
    sys.path.insert(0, "/lib")
import _costs_cfg as CFG  # noqa: E402 (DATA: a directory for the flash store)


def alloc():
    gc.collect()
    gc.collect()
    return gc.mem_alloc()


def log(level, text):
    pass


def vbi(n):
    b = bytearray()
    while True:
        d = n & 0x7F
        n >>= 7
        b.append(d | (0x80 if n else 0))
        if not n:
            return bytes(b)


def s(x):
    if isinstance(x, str):
        x = x.encode()
    return bytes((len(x) >> 8, len(x) & 255)) + x


def pk(first, body):
    return bytes((first,)) + vbi(len(body)) + body


def connect(cid, clean=True):
    return pk(0x10, s("MQTT") + bytes((4, 0x02 if clean else 0, 0, 60)) + s(cid))


def subscribe(pid, filt, qos=1):
    return pk(0x82, bytes((pid >> 8, pid & 255)) + s(filt) + bytes((qos,)))


def publish(topic, payload, qos=1, pid=1, retain=False):
    body = s(topic) + (bytes((pid >> 8, pid & 255)) if qos else b"") + payload
    return pk(0x30 | qos << 1 | (1 if retain else 0), body)


def feed(eng, c, data):
    # one packet, then the end of a loop turn (its group commit: the
    # acknowledgements that wait for the store go out)
    eng.receive(c, memoryview(data), len(data), eng.now_s)
    eng.turn(eng.now_s)


def drain(eng, c):
    o = c.out
    if o:
        eng.sent(c, len(o))


def client(eng, cid, clean=True):
    c = eng.open(None, eng.now_s, "t:1")
    feed(eng, c, connect(cid, clean))
    drain(eng, c)
    return c


def slope(x1, y1, x2, y2):
    return round((y2 - y1) / (x2 - x1))


def cid(i):
    return "c%015d" % i  # 16 bytes, as the socket-level measurement


T0 = 1000.0
LIMITS = {
    "max_clients": 200,
    "max_subscriptions_per_client": 200,
    "max_queued": 1000,
    "max_inflight": 100,
    "max_retained_messages": 2000,
    "store_budget_bytes": 4000000,
    "heap_reserve": 0,
}
QTOPIC = "queued/topic/0000/abcdefg"  # 25 bytes, as the socket-level measurement
ITOPIC = "inflight/topic/00/abcdefg"  # 25 bytes too
RTOPIC = "retained/t%09d"  # 19 bytes


# the modules in the order a profile loads them (edgebroker.load_modules),
# with their figure's name: literals, so that no key is made between reads
MODULES = (
    ("edgebroker", "import_mpy.edgebroker"),
    ("edgeconf", "import_mpy.edgeconf"),  # boot-only: the profile check
    ("edgestore", "import_mpy.edgestore"),
    ("edgeopen", "import_mpy.edgeopen"),  # boot-only: the flash store's open
    ("edgeram", "import_mpy.edgeram"),  # an Engine without a store makes a RamStore
    ("edgeauth", "import_mpy.edgeauth"),
    ("edgebridge", "import_mpy.edgebridge"),
)


def steps(out):
    yield
    a = alloc()
    i = 0
    while i < len(MODULES):  # (by index: a for loop's iterator is heap too)
        __import__(MODULES[i][0])
        yield
        b = alloc()
        out[MODULES[i][1]] = b - a
        a = b
        i += 1
    # the flash store's open leaves, as on a board (FlashStore._open drops
    # it): left loaded, the first store opened below would free it inside a
    # figure. (edgeconf stays: limits() is called for every figure.)
    sys.modules.pop("edgeopen", None)
    import edgebroker as eb

    cfg = eb.limits(LIMITS)
    yield
    a = alloc()
    eng = eb.Engine(cfg, None, log)
    eng.start(T0)

    yield
    out["engine_idle"] = alloc() - a
    # connections: the slope between 8 and 32 idle clients
    conns = []
    pts = {}
    for n in (8, 32):
        while len(conns) < n:
            conns.append(client(eng, cid(len(conns))))
        yield
        pts[n] = alloc()
    out["per_connection"] = slope(8, pts[8], 32, pts[32])
    # subscriptions on one client: 4 levels, the first three shared by pairs
    # (the measure's FILTER: the most a subscription costs in the tree)
    c0 = conns[0]
    subs = 0
    for n in (8, 32):
        while subs < n:
            g = subs // 2
            f = "s%04d/device-%04d/sensor%04d/v%04d" % (g, g, g, subs)
            feed(eng, c0, subscribe(subs + 1, f))
            drain(eng, c0)
            subs += 1
        yield
        pts[n] = alloc()
    out["per_subscription"] = slope(8, pts[8], 32, pts[32])
    # offline persistent sessions (no subscriptions)
    made = 0
    for n in (8, 32):
        while made < n:
            c = client(eng, "o%015d" % made, clean=False)
            feed(eng, c, b"\xe0\x00")  # DISCONNECT: the session stays
            drain(eng, c)
            made += 1
        c = None
        yield
        pts[n] = alloc()
    out["per_offline_session"] = slope(8, pts[8], 32, pts[32])
    # queued: an offline session subscribed at QoS 1, 64-byte payloads
    q = client(eng, "q%015d" % 0, clean=False)
    feed(eng, q, subscribe(1, QTOPIC))
    drain(eng, q)
    feed(eng, q, b"\xe0\x00")
    drain(eng, q)
    q = None
    pub = conns[1]
    sent = 0
    for n in (8, 32):
        while sent < n:
            feed(eng, pub, publish(QTOPIC, b"x" * 64, 1, pid=sent + 1))
            drain(eng, pub)
            sent += 1
        yield
        pts[n] = alloc()
    out["per_queued_message"] = slope(8, pts[8], 32, pts[32])
    # in flight: an online QoS 1 subscriber that does not acknowledge
    sub = conns[2]
    feed(eng, sub, subscribe(1, ITOPIC))
    drain(eng, sub)
    sent = 0
    for n in (8, 32):
        while sent < n:
            feed(eng, pub, publish(ITOPIC, b"x" * 64, 1, pid=sent + 100))
            drain(eng, pub)
            drain(eng, sub)  # written to the socket; the PUBACK never comes
            sent += 1
        yield
        pts[n] = alloc()
    out["per_inflight_message"] = slope(8, pts[8], 32, pts[32])
    eng = conns = c0 = pub = sub = None
    # retained messages: full stores of two capacities, each filled twice;
    # the smaller reading of each counts (a word pinned on the C stack
    # can only add garbage: about 1 KB either way was seen on this port).
    # Filled a step at a time: one long step left up to 1.4 KB of garbage
    # pinned (4,096 messages), which read as 0.3 B a message more. The
    # disc_only index is measured between 1,024 and 4,096 messages: its
    # 4 B a message against the noise of 3,072 messages, not 768 (the
    # socket-level figure spans 256 -> 4,096 for the same reason).
    # (No new names here: each is a qstr, and the interned strings' pool
    # growth lands on whichever module imports then, docs/boards.md.)
    for kind, n in (("ram", 256), ("disc_only", 1024)):
        used = {}
        for rep, capacity in enumerate((n, 4 * n, n, 4 * n)):
            lim = dict(LIMITS)
            lim["storage_type"] = kind
            lim["max_retained_messages"] = capacity
            cfg = eb.limits(lim)
            d = CFG.DATA + "/%s-%d-%d" % (kind, capacity, rep)
            try:
                os.mkdir(d)
            except OSError:
                pass  # there already
            yield
            a = alloc()
            store = eb.open_store(cfg, d, eb.MonoClock(), _no_wall, log)
            e = eb.Engine(cfg, store, log)
            e.start(T0)
            c = client(e, "r%015d" % 0)
            for i in range(capacity):
                # 19-byte topics (the socket-level measurement's are 20: each
                # figure's overhead subtracts its own)
                feed(e, c, publish(RTOPIC % i, b"x" * 64, 0, retain=True))
                drain(e, c)
                if i & 127 == 127:
                    yield
            c = None
            yield
            u = alloc() - a
            used[capacity] = min(used.get(capacity, u), u)
            store.close()
            e = store = None
        out["retained.%s.per_message" % kind] = round((used[4 * n] - used[n]) / (3 * n), 1)
    # The overheads: what a message costs beyond its payload and its topic
    # (its bytes: a message keeps no str), the part made of pointers and
    # heap blocks. The payload and topic bytes are the same on every port,
    # so a total's 32/64 ratio would understate how much the overhead
    # itself shrinks.
    body = 64 + len(QTOPIC)
    out["message_overhead"] = max(out["per_queued_message"], out["per_inflight_message"]) - body
    rbody = 64 + len(RTOPIC % 0)
    out["retained.ram.overhead"] = round(out["retained.ram.per_message"] - rbody, 1)
    print("COSTS " + json.dumps(out))


def _no_wall():
    return 0


STEPS = steps({})
_DONE = False


def _step():
    global _DONE
    try:
        next(STEPS)
    except StopIteration:
        _DONE = True


if sys.platform != "webassembly":
    while not _DONE:
        _step()

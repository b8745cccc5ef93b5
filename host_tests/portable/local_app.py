# An application beside the broker, as a board runs one: it calls
# edgebroker.start(), serves with serve_async() (or serve()), and uses the
# local client (publish / subscribe) from its own code. For
# test_local_api.py and test_coexistence.py; runs unchanged under CPython
# and MicroPython. Arguments as lib/edgebroker.py's main (--board, --port,
# --bind, --data-dir, --server) plus --app api|timer.
#
# --app api: the test drives the local client through the control topic
#   app/ctl (JSON commands, one a message):
#     {"id": n, "op": "publish", "topic", "payload", "qos", "retain",
#      "properties" (correlation_data as "correlation_data_hex"),
#      "check_disk": true -> after publish() returns, the store file is
#      opened a second time and the topic looked up there}
#     {"id": n, "op": "subscribe", "filter", "qos", "tag", "raise": bool}
#       every message the callback gets is reported on app/seen/<tag>
#       (topic, payload hex, retained, properties); "raise" makes it raise
#       "count": true instead counts them (the "stats" answer has them);
#       "async": true gives an async def callback (a mistake: never awaited)
#     {"id": n, "op": "burst", "topic", "n", "qos"}: a task of the app's own
#       publishes n messages without awaiting in between (asyncio server)
#     {"id": n, "op": "stats"}
#   and answers on app/result/<id>: {"ok": ...} or {"error": class, "text"}.
# --app timer|idle: with a user task that wakes every 10 ms (timer) or
#   none (idle); the engine's loop turns and the event loop's wakeups are
#   counted (class Timer). Results on app/timer when app/ctl gets
#   {"op": "timer"} (reset by {"op": "timer_reset"}).
# As a board runs it (a small heap): compile this file, edgebroker and
# edgestore with mpy-cross into one directory, then
#   micropython -X heapsize=H -c "import sys; sys.path.insert(0, DIR);
#   import local_app; local_app.main(['local_app.py', '--port', ...])"
import sys

if __name__ == "__main__":
    here = sys.argv[0].rsplit("/", 1)[0] if "/" in sys.argv[0] else "."
    sys.path.insert(0, here + "/../../lib")
import binascii  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import edgebroker  # noqa: E402

try:
    from time import ticks_diff, ticks_ms
except ImportError:  # CPython
    def ticks_ms():
        return int(time.monotonic() * 1000)

    def ticks_diff(a, b):
        return a - b


def log(level, text):
    print("edgebroker: %s %s" % (level, text), file=sys.stderr)


def parse(argv):
    opts = {"--bind": "127.0.0.1", "--server": "poll", "--app": "api", "--data-dir": None}
    i = 1
    while i < len(argv):
        if argv[i] == "--stop-on-eof":  # a flag: stop when stdin ends
            opts[argv[i]] = True
            i += 1
            continue
        if i + 1 < len(argv):
            opts[argv[i]] = argv[i + 1]
        i += 2
    return opts


def hexs(b):
    return binascii.hexlify(b).decode()


class Api:
    def __init__(self, broker, data_dir):
        self.b = broker
        self.data_dir = data_dir
        self.counts = {}  # tag -> messages a counting subscriber got
        broker.subscribe("app/ctl", self.ctl, 1)

    def answer(self, cid, d):
        self.b.publish("app/result/%s" % cid, json.dumps(d), 1)

    def ctl(self, topic, payload, retained, props):
        if retained:
            return
        c = json.loads(payload)
        cid = c.get("id", 0)
        try:
            self.answer(cid, {"ok": self.run(c)})
        except Exception as e:
            self.answer(cid, {"error": type(e).__name__, "text": str(e)})

    def run(self, c):
        op = c["op"]
        if op == "publish":
            props = c.get("properties")
            if props is not None and "correlation_data_hex" in props:
                props["correlation_data"] = binascii.unhexlify(props.pop("correlation_data_hex"))
            self.b.publish(c["topic"], c.get("payload", ""), c.get("qos", 0),
                           c.get("retain", False), props)
            if c.get("check_disk"):
                return self.on_disk(c["topic"])
            return True
        if op == "subscribe":
            if c.get("count"):
                cb = self.counter(c.get("tag", "t"))
            elif c.get("async"):
                async def cb(topic, payload, retained, props):  # the user's mistake
                    pass
            elif c.get("no_callback"):
                cb = None
            else:
                cb = self.reporter(c.get("tag", "t"), c.get("raise"))
            self.b.subscribe(c["filter"], cb, c.get("qos", 0))
            return True
        if op == "burst":
            # the application's own task publishes n messages without
            # awaiting in between (asyncio server only)
            import asyncio

            asyncio.create_task(self.burst(c["topic"], c["n"], c.get("qos", 1)))
            return True
        if op == "unsubscribe":  # with whatever handle the test gives
            self.b.unsubscribe(c["handle"])
            return True
        if op == "stats":
            return {"app_errors": self.b.engine.app_errors, "counts": self.counts,
                    "dropped": self.b.engine.n_dropped}
        raise ValueError("op: %r unknown" % (op,))

    def counter(self, tag):
        counts = self.counts
        counts[tag] = 0

        def cb(topic, payload, retained, props):
            counts[tag] += 1
        return cb

    async def burst(self, topic, n, qos):
        for i in range(n):
            self.b.publish(topic, "%d" % i, qos)

    def reporter(self, tag, boom):
        b = self.b

        def cb(topic, payload, retained, props):
            if boom:
                raise RuntimeError("application bug in %s" % tag)
            p = dict(props)
            if "correlation_data" in p:
                p["correlation_data_hex"] = hexs(p.pop("correlation_data"))
            b.publish("app/seen/" + tag, json.dumps({
                "topic": topic, "payload": hexs(payload), "retained": retained,
                "properties": p}), 1)
        return cb

    def on_disk(self, topic):
        # a second reader of the store file: what it finds is on disk. It
        # writes nothing: opening a clean file only reads, and close() adds
        # a CLOCK record only when messages with an expiry were read.
        import edgestore
        st = edgestore.FlashStore(self.data_dir + "/retained.ebrs", "disc", 100)
        try:
            m = st.get(topic)
            return None if m is None else hexs(m[1])
        finally:
            st.close()


class Timer:
    """The user's own work (--app timer): a task that sleeps 10 ms at a
    time and records how late each wake is. Both --app timer and --app
    idle count the broker's loop turns (Broker._turn, wrapped on this
    script's broker object) and the event loop's waits for I/O that may
    sleep (the scheduler's poller on MicroPython, the selector on CPython,
    wrapped here; a zero-timeout look between ready tasks is not counted):
    each such wait ends in one wakeup of the process. lib is not patched."""

    def __init__(self, broker, task):
        self.b = broker
        self.task = task
        self.turns = 0
        self.polls = 0
        self.reset()
        turn = broker._turn

        def counted():
            self.turns += 1
            turn()
        broker._turn = counted
        broker.subscribe("app/ctl", self.ctl, 0)

    def reset(self):
        self.wakes = 0
        self.worst = 0
        self.late = 0      # wakes more than 100 ms after they were due
        self.t0 = ticks_ms()
        self.turns0 = self.turns
        self.polls0 = self.polls

    def ctl(self, topic, payload, retained, props):
        c = json.loads(payload)
        if c.get("op") == "timer_reset":
            self.reset()
        elif c.get("op") == "block":
            # the application's own mistake: a callback that blocks the
            # loop (shows the timer catches what a blocking broker would do)
            time.sleep(c["ms"] / 1000)
        elif c.get("op") == "timer":
            self.b.publish("app/timer", json.dumps({
                "wakes": self.wakes, "worst_ms": self.worst, "late": self.late,
                "ms": ticks_diff(ticks_ms(), self.t0), "turns": self.turns - self.turns0,
                "polls": self.polls - self.polls0, "dropped": self.b.engine.n_dropped}), 0)

    def count_polls(self, aio):
        t = self
        try:  # MicroPython: the scheduler's poller, one wait per loop wakeup
            q = aio.core._io_queue
            f = q.wait_io_event

            def wait(dt):
                if dt != 0:  # a wait that can sleep, not a look between tasks
                    t.polls += 1
                return f(dt)
            q.wait_io_event = wait
        except AttributeError:  # CPython: the loop's selector
            sel = aio.get_running_loop()._selector
            g = sel.select

            def select(timeout=None):
                if timeout != 0:
                    t.polls += 1
                return g(timeout)
            sel.select = select

    async def run(self, aio):
        while True:
            t = ticks_ms()
            if hasattr(aio, "sleep_ms"):
                await aio.sleep_ms(10)
            else:
                await aio.sleep(0.01)
            lag = ticks_diff(ticks_ms(), t) - 10
            self.wakes += 1
            if lag > self.worst:
                self.worst = lag
            if lag > 100:
                self.late += 1


def main(argv):
    o = parse(argv)
    profile = {}
    if o.get("--board"):
        with open(o["--board"]) as f:
            profile = json.load(f)
    port = int(o["--port"])
    broker = edgebroker.start(profile, o["--bind"], port, o["--data-dir"], log)
    if o.get("--stop-on-eof"):
        broker.stop_stream = getattr(sys.stdin, "buffer", sys.stdin)
    if o["--app"] == "api":
        app = Api(broker, o["--data-dir"])
    else:
        app = Timer(broker, o["--app"] == "timer")
    print("edgebroker listening on %s:%d (%s, %s server)" % (
        o["--bind"], port, sys.implementation.name, o["--server"]))
    try:
        sys.stdout.flush()
    except AttributeError:
        pass
    try:
        if o["--server"] == "async":
            import asyncio

            async def board():
                if isinstance(app, Timer):
                    app.count_polls(asyncio)
                    if app.task:
                        asyncio.create_task(app.run(asyncio))
                await broker.serve_async()
            asyncio.run(board())
        else:
            broker.serve()
    except KeyboardInterrupt:
        pass
    broker.shutdown()


if __name__ == "__main__":
    main(sys.argv)

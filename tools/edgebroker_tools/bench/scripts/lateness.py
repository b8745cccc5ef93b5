"""A user task beside the broker: edgebroker.start() + serve_async() and a
task that sleeps `period_ms` in a loop and records how late it wakes.

Run as `<interpreter> lateness.py <params.json>` (CPython or MicroPython;
P["lib"] holds edgebroker.mpy or edgebroker.py). Prints the ready line, then
serves. The load generator publishes "start" and "stop" to `bench/ctl`
around its load; the broker hands them to a local subscription here, and
the task records lateness only between them (at most P["max_samples"]).
After "stop" the broker stops and one line "RESULT <json>" follows:
lateness p50/p99/max in ms, the number of samples and of periods.

Lateness = the time the task runs again - (the time it went to sleep +
the period): what a 10 ms control loop on a board would see.
"""

import gc
import json
import sys

try:
    import asyncio
except ImportError:
    import uasyncio as asyncio
import time

with open(sys.argv[1]) as f:
    P = json.load(f)
sys.path.insert(0, P["lib"])
import edgebroker  # noqa: E402

if hasattr(time, "ticks_us"):
    now_us = time.ticks_us
    diff_us = time.ticks_diff
else:

    def now_us():
        return time.perf_counter_ns() // 1000

    def diff_us(a, b):
        return a - b


if hasattr(asyncio, "sleep_ms"):
    sleep_ms = asyncio.sleep_ms
else:

    def sleep_ms(ms):
        return asyncio.sleep(ms / 1000)


state = {"on": False, "done": False, "periods": 0}
late = []
LIMIT = P["max_samples"]
broker = edgebroker.start(P["profile"], "127.0.0.1", P["port"], P.get("data_dir"))


def control(topic, payload, retained, properties):
    if payload == b"start":
        while late:
            late.pop()
        state["on"] = True
    elif payload == b"stop":
        state["on"] = False
        state["done"] = True
        broker.stop()


async def periodic():
    period = P["period_ms"]
    while not state["done"]:
        t0 = now_us()
        await sleep_ms(period)
        lag = diff_us(now_us(), t0) - period * 1000
        if state["on"] and len(late) < LIMIT:
            late.append(lag)
            state["periods"] += 1


async def main():
    task = asyncio.create_task(periodic())
    print("edgebroker listening on 127.0.0.1:%d (lateness driver)" % P["port"])
    try:
        sys.stdout.flush()
    except AttributeError:
        pass
    await broker.serve_async()
    state["done"] = True
    await task


broker.subscribe("bench/ctl", control)
asyncio.run(main())
late.sort()
n = len(late)
res = {"samples": n, "periods": state["periods"]}
if n:
    res["p50_ms"] = late[n // 2] / 1000
    res["p99_ms"] = late[min(n - 1, n * 99 // 100)] / 1000
    res["max_ms"] = late[-1] / 1000
    res["min_ms"] = late[0] / 1000
gc.collect()
print("RESULT " + json.dumps(res))

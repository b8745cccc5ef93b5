"""Benchmark edgebroker (CPython and MicroPython unix port) against mosquitto.

    .venv/bin/python -m edgebroker_tools.bench [--quick] [--only NAME[,NAME]]
        [--brokers cpython,cpython-async,micropython,micropython-async,mosquitto]
        [--repeat R] [--json OUT] [--board boards/host.json] [--mpy-heap 8m]

All brokers run in the same benchmark run, each as a subprocess on its own
free loopback port: edgebroker under CPython and under the MicroPython unix
port, each with its poll server (the host default) and with its asyncio
server (``--server async``, the board way; the ``-async`` columns), and
mosquitto. The load generator is several OS processes (fan-in publishers in
``gen_processes`` workers, the QoS 1 publisher in one, the subscriber in the
main process; connections set up with edgebroker_tools.mqttclient, then raw
non-blocking sockets with pre-built packets), and its CPU is shown beside the
broker's, so the brokers never share a process with the client side and the
generator is seen not to be the bottleneck.

Modules: common (names, sizes), wire (connections), procs (broker
processes), loadgen (the generator), memory, store (the flash store
scenarios, scripts/ holds the interpreter scripts they run), suite (the
run's scenarios), report (rows, table, JSON), cli (options, main).

Scenarios (``--only`` names):

fanin
    QoS 0 fan-in (issue 8 S1): P publisher connections send small QoS 0 PUBLISHes on
    ``bench/in/<i>`` to one subscriber on ``bench/in/+``. Publishers send
    pre-built batches, each followed by a PINGREQ, and may have at most
    ``depth`` batches without PINGRESP; the whole generator also caps the
    messages sent but not yet received by the subscriber, so the broker, not
    its socket buffers, is measured. The subscriber counts bytes (every
    message has the same length; the first byte of each is checked) and uses
    SO_RCVLOWAT so that it wakes per 16 KB, not per broker write. Rate =
    messages received / (last receive - first send); the delivered fraction
    and the lost count are reported beside it.
qos1
    QoS 1 end to end (issue 8 S2): one publisher keeps a window of W QoS 1 PUBLISHes that
    are not yet acknowledged end to end (PUBACK to the publisher AND arrival
    at the subscriber: brokers PUBACK on receipt, so a publisher-side window
    alone lets the publisher run ahead and measures the broker's queue); one
    QoS 1 subscriber acknowledges every message. Rate as above; latency =
    receive time at the subscriber - send time carried in the payload
    (time.perf_counter_ns, same process); the first 5% of the messages (at
    most 200) are left out of the percentiles as warm-up.

Both throughput scenarios first pass one warm-up message and only then start
the clock: the first packet a broker writes after SUBACK typically waits
~40 ms (Nagle on the broker's socket while the client's kernel delays its
ACK of the SUBACK). That delay is reported as its own row.
lateness
    A 10 ms periodic user task beside ``serve_async()`` (scripts/lateness.py:
    edgebroker.start() + serve_async() + the task), with and without full
    QoS 1 load from the generator: lateness p50/p99/max. Target (MicroPython):
    p99 <= 5 ms, max <= 20 ms under load.
idle
    Wake-ups per second of an idle broker (context switches of its process),
    with no client and with a few idle connections. Target (asyncio server):
    <= 10/s.
retained
    Fresh broker instances are pre-loaded with N retained messages on
    distinct topics ``bench/r/<i>`` (QoS 1, every PUBACK awaited); then a
    QoS 1 ``#`` subscriber (clean session, acks every message) is timed until
    it has all N. mosquitto runs with ``max_queued_messages 10000`` and
    ``set_tcp_nodelay true`` for the comparison (without the latter its time
    is dominated by the ~40 ms Nagle stall above), and a second mosquitto
    with its defaults shows how many of the N it delivers (its queue +
    inflight limits truncate the set).
memory
    Fresh instances. MicroPython: ``$SYS/broker/heap/alloc`` (published
    after gc.collect() every sys_interval = 1 s) right after start, and
    before/after opening C idle connections and storing R retained 64-byte
    messages. mosquitto's own ``$SYS/broker/heap/current`` is shown beside
    it. All brokers: VmRSS from /proc/<pid>/status at the same points.

The flash retained store (lib/edgestore.py; ``make bench-store`` runs just
these four). The store is driven by small scripts run in their own CPython
or MicroPython process, so the numbers come from the interpreter a board runs:

store-wear
    Write amplification: 100,000 retained updates on 1,000 topics through
    FlashStore (CPython; the bytes are the same on a board), commit every
    16 updates, default compaction. Every byte written to the store files
    (appends and compaction) / the bytes of the updates' records, and / their
    payload bytes. Target: <= 2.0.
store-open
    Time to open a 10,000-message store file under MicroPython (the file is
    written by FlashStore under CPython first): ``FlashStore(...)`` timed
    inside the interpreter, disc_only (target <= 1 s) and disc, and a file
    with superseded records still in it.
store-heap
    Heap per retained message under MicroPython for ram (RamStore), disc and
    disc_only (FlashStore): gc.mem_alloc() before and after 10,000 messages.
    Target: disc_only <= 4 B (issue 12: 32-bit and 64-bit alike).
retained-rm10
    20,000 retained QoS 1 messages, then a 5.0 subscriber with Receive
    Maximum 10 on '#': how many arrive, from edgebroker (CPython and
    MicroPython, disc_only) and mosquitto with its defaults, in one run.
    Target: all of them from edgebroker.

Brokers are alternated per scenario: each repetition runs the scenario on
every broker in turn (the order rotates between repetitions) and the table
shows medians. Ratios are edgebroker / mosquitto (micropython-async: / the
MicroPython poll server); targets are marked PASS or FAIL next to them. A
failing broker run is reported as n/a and listed under "problems"; it never
stops the other brokers' measurements.

Importing this module has no side effects.
"""

from __future__ import annotations

from edgebroker_tools.bench.cli import main

__all__ = ["main"]

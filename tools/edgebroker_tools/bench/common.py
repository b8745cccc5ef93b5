"""Names, sizes and the error type shared by the benchmark's modules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

#: The brokers of a run: edgebroker under each interpreter with each of its
#: two servers (``--server poll|async``), and mosquitto.
BrokerName = Literal["cpython", "cpython-async", "micropython", "micropython-async", "mosquitto"]
BROKERS: Final[tuple[BrokerName, ...]] = (
    "cpython",
    "cpython-async",
    "micropython",
    "micropython-async",
    "mosquitto",
)
EDGE: Final[tuple[BrokerName, ...]] = (
    "cpython",
    "cpython-async",
    "micropython",
    "micropython-async",
)
SHORT: Final[dict[str, str]] = {
    "cpython": "cpy",
    "cpython-async": "cpy-a",
    "micropython": "mpy",
    "micropython-async": "mpy-a",
    "mosquitto": "mosq",
}
SCENARIOS: Final[tuple[str, ...]] = (
    "fanin",
    "qos1",
    "lateness",
    "idle",
    "retained",
    "memory",
    "store-wear",
    "store-open",
    "store-heap",
    "retained-rm10",
)

HOST: Final = "127.0.0.1"
READY_LINE: Final = "edgebroker listening on "
MOSQUITTO_QUEUE: Final = 10000
# The retained comparison runs mosquitto with room for the whole set and
# without Nagle: by default its first packets after SUBACK wait ~40 ms for the
# client's delayed ACK, which would dominate a 5,000-message delivery.
MOSQUITTO_RETAINED_CONF: Final = (f"max_queued_messages {MOSQUITTO_QUEUE}", "set_tcp_nodelay true")
SYS_INTERVAL: Final = 1


def interpreter_of(kind: str) -> Literal["cpython", "micropython"] | None:
    """The interpreter an edgebroker kind runs on; None for mosquitto."""
    if kind.startswith("cpython"):
        return "cpython"
    if kind.startswith("micropython"):
        return "micropython"
    return None


def server_of(kind: str) -> Literal["poll", "async"]:
    return "async" if kind.endswith("-async") else "poll"


class BenchError(Exception):
    """A scenario could not complete against one broker (reported, not fatal)."""


# --------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """Counts and time caps of one benchmark mode (--quick or full)."""

    repeats: int
    fanin_publishers: int
    gen_processes: int  # load generator processes for the publishers (+1 subscriber)
    fanin_messages: int  # in total, over all publishers
    fanin_batch: int  # messages per pre-built batch (one sendall + PINGREQ)
    fanin_depth: int  # batches a publisher may have without PINGRESP
    fanin_inflight: int  # messages sent but not yet received by the subscriber
    fanin_payload: int
    fanin_cap_s: float
    qos1_messages: int
    qos1_window: int
    qos1_payload: int
    qos1_cap_s: float
    retained_count: int
    retained_repeats: int  # each run is short (tens of ms): more runs, steadier median
    retained_payload: int
    retained_idle_s: float  # no new message for this long: delivery is over
    retained_cap_s: float
    mem_connections: int
    mem_retained: int
    mem_payload: int
    drain_idle_s: float  # after the last send: wait this long without progress
    wear_updates: int  # store-wear: retained updates driven through FlashStore
    wear_topics: int
    wear_payload: int
    open_messages: int  # store-open: messages in the store file opened
    open_dead: int  # store-open: superseded records in the second file
    heap_messages: int  # store-heap: messages per storage type
    rm10_count: int  # retained-rm10: retained messages to deliver
    lateness_s: float  # lateness: seconds of QoS 1 load while the 10 ms task runs
    idle_s: float  # idle: seconds over which wake-ups are counted
    idle_conns: int  # idle: connections open (keep alive off) during the second count


FULL: Final = Sizes(
    repeats=5,
    fanin_publishers=4,
    gen_processes=2,
    fanin_messages=300_000,
    fanin_batch=200,
    fanin_depth=2,
    fanin_inflight=4000,
    fanin_payload=16,
    fanin_cap_s=4.0,
    qos1_messages=100_000,
    qos1_window=16,
    qos1_payload=16,
    qos1_cap_s=4.0,
    retained_count=5000,
    retained_repeats=15,
    retained_payload=16,
    retained_idle_s=2.0,
    retained_cap_s=30.0,
    mem_connections=50,
    mem_retained=1000,
    mem_payload=64,
    drain_idle_s=1.0,
    wear_updates=100_000,
    wear_topics=1000,
    wear_payload=32,
    open_messages=10_000,
    open_dead=6_000,
    heap_messages=10_000,
    rm10_count=20_000,
    lateness_s=10.0,
    idle_s=10.0,
    idle_conns=8,
)

QUICK: Final = Sizes(
    repeats=1,
    fanin_publishers=4,
    gen_processes=2,
    fanin_messages=40_000,
    fanin_batch=200,
    fanin_depth=2,
    fanin_inflight=4000,
    fanin_payload=16,
    fanin_cap_s=1.5,
    qos1_messages=10_000,
    qos1_window=16,
    qos1_payload=16,
    qos1_cap_s=1.5,
    retained_count=1000,
    retained_repeats=3,
    retained_payload=16,
    retained_idle_s=1.0,
    retained_cap_s=10.0,
    mem_connections=10,
    mem_retained=100,
    mem_payload=64,
    drain_idle_s=0.5,
    wear_updates=20_000,
    wear_topics=200,
    wear_payload=32,
    open_messages=2_000,
    open_dead=1_200,
    heap_messages=2_000,
    rm10_count=3_000,
    lateness_s=3.0,
    idle_s=3.0,
    idle_conns=4,
)

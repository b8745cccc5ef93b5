"""`python -m edgebroker_tools.bench`: options, the run, the table."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from edgebroker_tools import runner
from edgebroker_tools.bench import store
from edgebroker_tools.bench.common import (
    BROKERS,
    FULL,
    MOSQUITTO_RETAINED_CONF,
    QUICK,
    SCENARIOS,
    SYS_INTERVAL,
    BrokerName,
    Sizes,
)
from edgebroker_tools.bench.procs import Tools, find_tools
from edgebroker_tools.bench.report import render_table, report_json
from edgebroker_tools.bench.suite import Bench, say


def file_sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def mosquitto_version(path: Path | None) -> str:
    if path is None:
        return "mosquitto (not found)"
    try:
        out = subprocess.run(
            [str(path), "-h"], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "mosquitto"
    first = out.splitlines()[0] if out else "mosquitto"
    return first.strip()


def setup_notes(tools: Tools, sizes: Sizes, only: Sequence[str]) -> list[str]:
    """How each broker was run and what the generator did, for the output."""
    notes = [
        f"edgebroker: lib/edgebroker.py --board {tools.board.name} --set sys_interval="
        f"{SYS_INTERVAL} --set log_level=warning (retained/memory: also "
        "max_retained_messages=0 store_budget_bytes=64 MiB; memory: max_clients=C+16); "
        "micropython with "
        + (f"-X heapsize={tools.mpy_heap}" if tools.mpy_heap else "the unix port's default heap"),
        f"{mosquitto_version(tools.mosquitto)}: listener on 127.0.0.1, allow_anonymous true, "
        f"persistence false, sys_interval {SYS_INTERVAL}, log errors/warnings; "
        "otherwise its defaults",
        f"load generator: fan-in publishers in {sizes.gen_processes} worker processes and "
        "the QoS 1 publisher in one, the subscriber in this process; connections set up "
        "with edgebroker_tools.mqttclient, then raw non-blocking sockets with pre-encoded "
        "MQTT 3.1.1 packets; brokers are subprocesses; the 'cpu:' lines on stderr and the "
        "'generator CPU' rows show the generator's CPU (all its processes) beside the "
        "broker's over each timed run",
        "edgebroker -async columns: the same broker with --server async (the asyncio "
        "server, the board way); the others run the poll server (the host default)",
    ]
    if "fanin" in only:
        notes.append(
            f"fanin: {sizes.fanin_publishers} publishers x {sizes.fanin_payload}-byte "
            f"payloads, batches of {sizes.fanin_batch} + PINGREQ, at most "
            f"{sizes.fanin_depth} batches per publisher without PINGRESP and "
            f"{sizes.fanin_inflight} messages not yet at the subscriber; "
            f"{sizes.fanin_messages:,} messages or {sizes.fanin_cap_s:g} s; one warm-up "
            "message per publisher before the clock starts"
        )
    if "qos1" in only:
        notes.append(
            f"qos1: a message is outstanding until PUBACKed to the publisher AND received "
            f"by the subscriber (brokers PUBACK on receipt, so a publisher-side window "
            f"alone would measure queueing); {sizes.qos1_messages:,} messages or "
            f"{sizes.qos1_cap_s:g} s; p50/p99 leave out the first 5% (max 200); the "
            "'1st message' row is one warm-up message right after SUBACK, typically "
            "~40 ms on all three: the broker's socket has Nagle on and the client's "
            "kernel delays its ACK of the SUBACK"
        )
    return notes


def run_bench(
    tools: Tools, sizes: Sizes, brokers: list[BrokerName], only: list[str], tmp: Path
) -> Bench:
    bench = Bench(tools, sizes, brokers, tmp)
    window = sizes.qos1_window
    try:
        profile = runner.load_board(tools.board)
    except runner.RunnerError:
        profile = {}
    inflight = profile.get("max_inflight", 16)
    if isinstance(inflight, int) and 0 < inflight < window:
        # More would exceed edgebroker's advertised inbound window; the same
        # window for every broker keeps the comparison fair.
        bench.report.notes.append(f"qos1: window {inflight} (the board's max_inflight)")
        for kind in BROKERS:
            bench.qos1_window[kind] = inflight
    bench.report.notes.extend(setup_notes(tools, sizes, only))
    try:
        if "fanin" in only or "qos1" in only:
            say("main instances:")
            instances = bench.main_instances()
            try:
                if "fanin" in only:
                    say("scenario fanin:")
                    bench.scenario_fanin(instances)
                if "qos1" in only:
                    say("scenario qos1:")
                    bench.scenario_qos1(instances)
            finally:
                for broker in instances.values():
                    if broker is not None:
                        bench.stop(broker)
        for name, run in (
            ("lateness", bench.scenario_lateness),
            ("idle", bench.scenario_idle),
            ("retained", bench.scenario_retained),
            ("memory", bench.scenario_memory),
            ("store-wear", lambda: store.scenario_store_wear(bench)),
            ("store-open", lambda: store.scenario_store_open(bench)),
            ("store-heap", lambda: store.scenario_store_heap(bench)),
            ("retained-rm10", lambda: store.scenario_retained_rm10(bench)),
        ):
            if name in only:
                say(f"scenario {name}:")
                run()
    finally:
        bench.stop_all()
    return bench


def parse_list(text: str, allowed: Sequence[str], what: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    bad = [item for item in items if item not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {', '.join(bad) or '(none)'}: choose from {', '.join(allowed)}"
        )
    return items


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m edgebroker_tools.bench",
        description=(
            "Benchmark edgebroker under CPython and MicroPython, with its poll and its "
            "asyncio server, against mosquitto (QoS 0 fan-in, QoS 1 end to end, a 10 ms "
            "user task's lateness, idle wake-ups, '#' over retained, memory) and the flash "
            "retained store (write amplification, open time, heap per message, delivery "
            "of 20,000 retained messages to a Receive Maximum 10 subscriber)."
        ),
    )
    parser.add_argument("--quick", action="store_true", help="small counts (smoke test)")
    parser.add_argument(
        "--only",
        type=lambda t: parse_list(t, SCENARIOS, "scenario"),
        default=list(SCENARIOS),
        help=f"comma-separated scenarios: {','.join(SCENARIOS)}",
    )
    parser.add_argument(
        "--brokers",
        type=lambda t: parse_list(t, BROKERS, "broker"),
        default=list(BROKERS),
        help=f"comma-separated brokers: {','.join(BROKERS)}",
    )
    parser.add_argument("--repeat", type=int, default=None, help="repetitions per scenario")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write results")
    parser.add_argument("--board", type=Path, default=None, help="board profile for edgebroker")
    parser.add_argument(
        "--mpy-heap", default=None, help="micropython -X heapsize (default: the port's own)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    root = runner.repo_root()
    board: Path = args.board if args.board is not None else root / "boards" / "host.json"
    tools = find_tools(root, board, args.mpy_heap)
    sizes = QUICK if args.quick else FULL
    if args.repeat is not None:
        if args.repeat < 1:
            print("--repeat must be >= 1", file=sys.stderr)
            return 2
        sizes = replace(sizes, repeats=args.repeat, retained_repeats=args.repeat)
    brokers: list[BrokerName] = [b for b in BROKERS if b in args.brokers]
    only: list[str] = args.only
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="edgebroker-bench-") as tmpdir:
        bench = run_bench(tools, sizes, brokers, only, Path(tmpdir))
    elapsed = time.monotonic() - t0
    report = bench.report
    mode = "quick" if args.quick else "full"
    print()
    print(
        f"edgebroker benchmark ({mode}, {sizes.repeats} repetition(s), medians; "
        f"{os.cpu_count()} CPUs, {platform.python_version()} generator; {elapsed:.0f} s)"
    )
    print(render_table(report, brokers))
    notes = list(report.notes)
    notes += [f"{m.scenario} / {m.name}: {m.note}" for m in report.metrics if m.note]
    if notes:
        print()
        print("notes:")
        for note in notes:
            print(textwrap.fill(note, 100, initial_indent="  - ", subsequent_indent="    "))
    if report.problems:
        print()
        print("problems:")
        for problem in report.problems:
            print("  - " + problem.replace("\n", "\n    "))
    if args.json is not None:
        config: dict[str, Any] = {
            "mode": mode,
            "sizes": sizes.__dict__,
            "brokers": brokers,
            "scenarios": only,
            "board": str(board),
            "mpy_heap": args.mpy_heap,
            "elapsed_s": elapsed,
            "cpus": os.cpu_count(),
            "mosquitto_retained_conf": list(MOSQUITTO_RETAINED_CONF),
            "mosquitto": mosquitto_version(tools.mosquitto),
            "edgebroker_sha256": file_sha256(runner.lib_path()),
            "sys_interval": SYS_INTERVAL,
        }
        args.json.write_text(
            json.dumps(report_json(report, config), indent=2) + "\n", encoding="utf-8"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`edgebroker fleet`: collect many gateways' retained state and build fleet tables.

    edgebroker fleet collect --inventory FLEET.json --out SNAPSHOTS/ [--secrets FILE]
                             [--concurrency 32] [--timeout 30] [--retries 2] [--quiet 1]
    edgebroker fleet build --snapshots SNAPSHOTS/ --out WAREHOUSE/ [--master local[*]]
    edgebroker fleet report WAREHOUSE/ [--html FILE] [--top 10]
    edgebroker fleet synth --gateways N --topics M --snapshots K --out SNAPSHOTS/ [--seed 1]

The layout of SNAPSHOTS/ and WAREHOUSE/ and every table's columns are
described in edgebroker_tools.fleet.schema and .job. pyspark is imported
only by `build` (the others start in well under a second).

Exit codes: 0 done; 1 collect: some gateway failed (see the collect log);
2 bad input (inventory, paths, options).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Final, cast

from edgebroker_tools.commands import CommandError
from edgebroker_tools.fleet import job_args

if TYPE_CHECKING:
    from edgebroker_tools.commands import Subparsers

EXIT_PARTIAL = 1


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


#: The largest --timeout, --connect-timeout and --quiet of collect (a day).
MAX_WAIT_S: Final = 86400.0
#: The largest --interval of synth (a year).
MAX_INTERVAL_S: Final = 365 * 86400.0


def _seconds_up_to(limit: float) -> Callable[[str], float]:
    """An argparse type: seconds, 0 < s <= limit (nan and inf refused)."""

    def seconds(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid time {text!r}: expected seconds") from None
        if not 0 < value <= limit:
            raise argparse.ArgumentTypeError(f"{value:g}: expected 0 < seconds <= {limit:.0f}")
        return value

    return seconds


_seconds = _seconds_up_to(MAX_WAIT_S)


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value}: expected an integer >= 0")
    return value


def register(subparsers: Subparsers) -> None:
    """Add `fleet` and its actions."""
    parser = subparsers.add_parser(
        "fleet",
        help="collect gateways' retained state; build and report fleet tables (PySpark)",
        description="The fleet pipeline: collect -> snapshots -> build (PySpark) -> report.",
    )
    sub = parser.add_subparsers(dest="fleet_command", metavar="ACTION", required=True)

    collect = sub.add_parser(
        "collect",
        help="read every gateway of an inventory into snapshot files",
        description="Connect to every gateway of the inventory over MQTT 5 (at most "
        "--concurrency at once), gather its retained messages and $SYS statistics, and "
        "write one Parquet snapshot per gateway under OUT/retained/date=<day>/. Store-file "
        "entries are copied to OUT/stores/. A gateway that fails after its retries is "
        "recorded in OUT/collect_log.jsonl; the run goes on (exit 1 at the end).",
    )
    collect.add_argument("--inventory", type=Path, required=True, metavar="FLEET.json")
    collect.add_argument("--out", type=Path, required=True, metavar="SNAPSHOTS/")
    collect.add_argument(
        "--secrets", type=Path, default=None, help="secrets file (default: the inventory's)"
    )
    collect.add_argument("--concurrency", type=_positive_int, default=32)
    collect.add_argument(
        "--timeout", type=_seconds, default=30.0, help="seconds per attempt (default 30)"
    )
    collect.add_argument("--connect-timeout", type=_seconds, default=5.0)
    collect.add_argument(
        "--quiet",
        type=_seconds,
        default=1.0,
        help="done when no retained message came for this long (default 1 s)",
    )
    collect.add_argument("--retries", type=int, default=2, help="more attempts after a failure")
    collect.add_argument("--no-progress", action="store_true", help="no progress bar")
    collect.set_defaults(handler=handle_collect)

    build = sub.add_parser(
        "build",
        help="the PySpark job: snapshots -> fleet_state, topic_history, gateway_health, "
        "limits_advice",
        description="Ingest new snapshot and store files and (re)compute the fleet tables "
        "under OUT/ (Parquet). Running it again over the same input gives the same tables; "
        "new snapshots are merged in. Bad input files are reported and skipped.",
    )
    job_args.add_arguments(build)
    build.add_argument(
        "--master",
        default="local[*]",
        help="Spark master (default local[*]; e.g. local[2], local-cluster[2,1,1024])",
    )
    build.add_argument("--driver-memory", default="4g", help="for a local master (default 4g)")
    build.set_defaults(handler=handle_build)

    report = sub.add_parser(
        "report",
        help="summary in the terminal and a self-contained HTML page",
        description="Read the warehouse tables and print a summary; write an HTML page "
        "with inline SVG charts (utilisation against limits, stale topics, advice per board).",
    )
    report.add_argument(
        "warehouse", metavar="WAREHOUSE", help="a path or a file://, hdfs:// or s3:// URI"
    )
    report.add_argument(
        "--html", type=Path, default=None, help="page to write (default WAREHOUSE/report.html)"
    )
    report.add_argument("--top", type=_positive_int, default=10, help="rows in top-N lists")
    report.set_defaults(handler=handle_report)

    synth = sub.add_parser(
        "synth",
        help="write realistic synthetic snapshots (scale tests, benchmark)",
        description="N gateways x M retained topics x K collections, with the $SYS rows of "
        "each collection, written under OUT/retained/ (numpy + pyarrow).",
    )
    synth.add_argument("--gateways", type=_positive_int, required=True, metavar="N")
    synth.add_argument("--topics", type=_positive_int, required=True, metavar="M")
    synth.add_argument("--snapshots", type=_positive_int, required=True, metavar="K")
    synth.add_argument("--out", type=Path, required=True, metavar="SNAPSHOTS/")
    synth.add_argument("--seed", type=_seed, default=1, help="0 or more (default 1)")
    synth.add_argument(
        "--start", default="2025-06-01T00:00:00Z", help="first collection (ISO 8601, UTC)"
    )
    synth.add_argument(
        "--interval",
        type=_seconds_up_to(MAX_INTERVAL_S),
        default=6 * 3600.0,
        help="seconds between collections (default 21600, at most a year)",
    )
    synth.add_argument(
        "--per-file", type=_positive_int, default=1000, help="gateways per file and collection"
    )
    synth.add_argument(
        "--missing", type=float, default=0.01, help="chance a gateway misses a collection"
    )
    synth.set_defaults(handler=handle_synth)


def handle_collect(args: argparse.Namespace) -> int:
    from edgebroker_tools.fleet import collect
    from edgebroker_tools.fleet.inventory import InventoryError, load_inventory

    try:
        gateways = load_inventory(cast(Path, args.inventory), cast("Path | None", args.secrets))
    except InventoryError as exc:
        raise CommandError(str(exc)) from None
    if args.retries < 0:
        raise CommandError(f"--retries {args.retries}: expected 0 or more")
    opts = collect.Options(
        concurrency=int(args.concurrency),
        timeout=float(args.timeout),
        connect_timeout=float(args.connect_timeout),
        quiet=float(args.quiet),
        retries=int(args.retries),
    )
    out = cast(Path, args.out)
    results = collect.run(gateways, out, opts, show_progress=not args.no_progress)
    failed = [r for r in results if not r.ok]
    retained = sum(r.retained for r in results)
    print(
        f"collected {len(results) - len(failed)}/{len(results)} gateway(s), "
        f"{retained} retained message(s) -> {out}"
    )
    for r in failed:
        print(
            f"  failed {r.gateway.id} ({r.gateway.address}) after {r.attempts} attempt(s): "
            f"{r.error}"
        )
    if failed:
        print(f"  see {out / 'collect_log.jsonl'}", file=sys.stderr)
        return EXIT_PARTIAL
    return 0


def handle_build(args: argparse.Namespace) -> int:
    from edgebroker_tools.fleet import hfs, job, spark

    t0 = time.monotonic()
    opts = job_args.options_from(args)
    local = hfs.local_path(opts.snapshots) if hfs.is_local(opts.snapshots) else None
    if local is not None and not Path(local).is_dir():  # before Spark takes seconds to start
        raise CommandError(f"no such snapshot directory: {opts.snapshots}")
    if opts.progress:
        print(f"fleet build: starting Spark ({args.master})", file=sys.stderr, flush=True)
    session, owned = spark.session(str(args.master), driver_memory=str(args.driver_memory))
    if opts.progress:
        print(
            f"fleet build: Spark up in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True
        )
    try:
        result = job.build(session, opts)
    except job.BuildError as exc:
        raise CommandError(str(exc)) from None
    finally:
        if owned:
            session.stop()
    print(job.summary(result))
    print(f"  {time.monotonic() - t0:.1f} s in all (Spark's start and stop included)")
    return 0


def handle_report(args: argparse.Namespace) -> int:
    from edgebroker_tools.fleet import hfs, report

    warehouse = str(args.warehouse)
    html_path = cast("Path | None", args.html)
    if html_path is None:
        if not hfs.is_local(warehouse):
            raise CommandError(f"{warehouse} is not a local path: give --html FILE")
        html_path = Path(hfs.local_path(warehouse)) / "report.html"
    try:
        data = report.load(warehouse)
    except report.ReportError as exc:
        raise CommandError(str(exc)) from None
    report.check_html_target(html_path)  # before the summary: one line, no traceback
    print(report.text_summary(data, int(args.top)))
    report.write_html(html_path, data, int(args.top))
    print(f"\nHTML report: {html_path}")
    return 0


def handle_synth(args: argparse.Namespace) -> int:
    from edgebroker_tools.fleet import synth
    from edgebroker_tools.fleet.inventory import InventoryError, parse_time

    try:
        start = parse_time(str(args.start))
    except InventoryError as exc:
        raise CommandError(f"--start: {exc}") from None
    if not 0 <= args.missing < 1:
        raise CommandError(f"--missing {args.missing}: expected 0 <= p < 1")
    interval = timedelta(seconds=float(args.interval))
    try:
        synth.check_times(start, interval, int(args.snapshots))
    except ValueError as exc:
        raise CommandError(f"--start {args.start}: {exc}") from None
    result = synth.generate(
        cast(Path, args.out),
        int(args.gateways),
        int(args.topics),
        int(args.snapshots),
        seed=int(args.seed),
        start=start,
        interval=interval,
        per_file=int(args.per_file),
        missing=float(args.missing),
    )
    rate = (result.rows + result.sys_rows) / result.seconds if result.seconds else 0.0
    print(
        f"synth: {result.rows} retained rows + {result.sys_rows} $SYS rows in "
        f"{result.files} file(s), {result.seconds:.1f} s ({rate:,.0f} rows/s) -> {args.out}"
    )
    return 0

"""The build's options, without importing pyspark (the CLI parser loads this)."""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Final, cast

from edgebroker_tools.commands import CommandError
from edgebroker_tools.fleet import hfs


@dataclass(frozen=True)
class Options:
    snapshots: str  # a URI (file://, hdfs://, s3a://, viewfs://) or a plain path
    out: str
    keep_damaged_stores: bool = False
    near: float = 0.9
    headroom: float = 1.25
    stale_after: timedelta = timedelta(hours=24)
    boards: Path | None = None  # board profiles for checking the advice (default: repo's)
    min_gateways: int = 5  # per board, below which the advice is "not enough data"
    min_collections: int = 10
    progress: bool = False  # stage and rows on stderr while it works


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value}: expected 0 < x <= 1")
    return value


def _factor(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not 1 <= value <= 10:
        raise argparse.ArgumentTypeError(f"{value}: expected 1 <= x <= 10")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: expected 1 or more")
    return value


#: --stale-after's largest value: 100 years (a timedelta, and as_of minus it, must exist).
MAX_STALE_HOURS: Final = 100 * 8760


def _hours(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not 0 < value <= MAX_STALE_HOURS:  # nan and inf too
        raise argparse.ArgumentTypeError(
            f"{value:g}: expected 0 < hours <= {MAX_STALE_HOURS} (100 years)"
        )
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The build's options (`edgebroker fleet build` and `spark-submit .../job.py`)."""
    parser.add_argument(
        "--snapshots",
        required=True,
        metavar="SNAPSHOTS",
        help="snapshot location: a path or a URI (file://, hdfs://, s3a://, viewfs://)",
    )
    parser.add_argument(
        "--out",
        required=True,
        metavar="WAREHOUSE",
        help="warehouse location: a path or a URI (file://, hdfs://, s3a://, viewfs://)",
    )
    parser.add_argument(
        "--keep-damaged-stores",
        action="store_true",
        help="ingest what the broker would keep of a store file with a torn tail or "
        "corrupt record (default: report and skip it)",
    )
    parser.add_argument(
        "--near", type=_fraction, default=0.9, help="utilisation that flags a limit (0.9)"
    )
    parser.add_argument(
        "--headroom", type=_factor, default=1.25, help="advice headroom factor (1.25)"
    )
    parser.add_argument(
        "--stale-after",
        type=_hours,
        default=24.0,
        metavar="HOURS",
        help="a gateway silent this long before as_of makes its topics stale (24)",
    )
    parser.add_argument(
        "--min-gateways",
        type=_count,
        default=5,
        metavar="N",
        help="gateways a board needs before its limits are advised (5)",
    )
    parser.add_argument(
        "--min-collections",
        type=_count,
        default=10,
        metavar="N",
        help="collections a board needs before its limits are advised (10)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    parser.add_argument(
        "--boards",
        type=Path,
        default=None,
        metavar="DIR",
        help="board profiles to check the advice against (default: the repo's boards/)",
    )


class OptionError(CommandError):
    """A build option that cannot be used (one line, exit 2)."""


def check_boards(boards: Path | None) -> Path | None:
    """--boards: a directory that exists (the advice's patches are checked
    against its <board>.json); checked before Spark starts."""
    if boards is not None and not boards.is_dir():
        what = "not a directory" if boards.exists() else "no such directory"
        raise OptionError(
            f"--boards {boards}: {what} (expected a directory of board profiles, "
            "<board>.json; default: the repo's boards/)"
        )
    return boards


def _cannot_make_dir_in(directory: Path) -> str | None:
    """Why no directory can be made in `directory` (the OS's reason), or
    None when one can: one is made and removed again. os.access() is not
    enough: it says yes to root for a directory root cannot write in either
    (/proc, a read-only mount)."""
    try:
        made = tempfile.mkdtemp(prefix=".edgebroker-out-check-", dir=directory)
    except OSError as exc:
        return exc.strerror or str(exc)
    with contextlib.suppress(OSError):
        Path(made).rmdir()
    return None


def check_out(out: str) -> str:
    """--out on the driver's disk (a plain path or file:// URI): a directory
    the build can write in, or one that can be made there (its nearest
    existing ancestor is a directory a directory can be made in); checked
    before Spark starts. Another scheme is checked by the build (job.build:
    one line too)."""
    if not hfs.is_local(out):
        return out
    path = Path(hfs.local_path(out)).absolute()
    if path.is_dir():
        why = _cannot_make_dir_in(path)
        if why is not None:
            raise OptionError(
                f"--out {out}: cannot write in the directory: {why} "
                "(expected a warehouse directory the build can write in)"
            )
        return out
    if path.exists():
        raise OptionError(
            f"--out {out}: exists and is not a directory "
            "(expected the warehouse directory, created when missing)"
        )
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise OptionError(
            f"--out {out}: cannot create the directory: {parent} is not a directory "
            "(expected the warehouse directory, created when missing)"
        )
    why = _cannot_make_dir_in(parent)
    if why is not None:
        raise OptionError(
            f"--out {out}: cannot create the directory in {parent}: {why} "
            "(expected the warehouse directory, created when missing)"
        )
    return out


def options_from(args: argparse.Namespace) -> Options:
    """The build's options; OptionError for a --boards that is no directory
    or an --out that cannot be one."""
    return Options(
        snapshots=str(args.snapshots),
        out=check_out(str(args.out)),
        keep_damaged_stores=bool(args.keep_damaged_stores),
        near=float(args.near),
        headroom=float(args.headroom),
        stale_after=timedelta(hours=float(args.stale_after)),
        boards=check_boards(cast("Path | None", args.boards)),
        min_gateways=int(args.min_gateways),
        min_collections=int(args.min_collections),
        progress=not args.no_progress,
    )

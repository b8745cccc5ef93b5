"""`edgebroker run`: start the broker in the foreground on this machine.

Builds the command with edgebroker_tools.runner.broker_command (the process
interface of docs/contract.md), passes the child's stdout/stderr through,
forwards SIGINT/SIGTERM to it as SIGINT and exits with its exit code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, cast

from edgebroker_tools import runner
from edgebroker_tools.commands import CommandError, add_set_option, port_arg

if TYPE_CHECKING:
    from edgebroker_tools.commands import Subparsers

DEFAULT_BOARD = "boards/host.json"
DEFAULT_PORT = 1883
DEFAULT_BIND = "127.0.0.1"


def _heap(text: str) -> str:
    try:
        runner.parse_heap(text)
    except runner.RunnerError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def register(subparsers: Subparsers) -> None:
    """Add the `run` subcommand."""
    parser = subparsers.add_parser(
        "run",
        help="run the broker in the foreground (host build)",
        description=(
            "Run lib/edgebroker.py in the foreground under CPython or the MicroPython "
            "unix port. Ctrl-C or SIGTERM stops it cleanly; the exit code is the broker's."
        ),
    )
    parser.add_argument(
        "--board",
        type=Path,
        default=Path(DEFAULT_BOARD),
        metavar="FILE",
        help=(
            f"board profile (JSON; default: {DEFAULT_BOARD}); "
            "a relative path not found here is looked up in the repo"
        ),
    )
    parser.add_argument(
        "--port",
        type=port_arg,
        default=DEFAULT_PORT,
        help=f"TCP port to listen on (default: {DEFAULT_PORT})",
    )
    parser.add_argument(
        "--bind",
        default=DEFAULT_BIND,
        metavar="ADDR",
        help=f"address to bind (default: {DEFAULT_BIND})",
    )
    parser.add_argument(
        "--interpreter",
        choices=runner.INTERPRETERS,
        default="cpython",
        help="cpython (default): this Python; micropython: the venv's MicroPython unix port",
    )
    parser.add_argument(
        "--heap",
        type=_heap,
        default=None,
        metavar="SIZE",
        help="MicroPython heap size, e.g. 96k, 2m, 131072 (ignored with cpython)",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="directory for the retained store (default: ./data/<board name>)",
    )
    add_set_option(parser)
    parser.set_defaults(handler=handle)


def _find_board(path: Path) -> Path:
    """The board file as given, or for a relative path missing here, the repo's copy."""
    if path.exists() or path.is_absolute():
        return path
    in_repo = runner.repo_root() / path
    return in_repo if in_repo.exists() else path


def handle(args: argparse.Namespace) -> int:
    """Start the broker and wait for it; returns its exit code."""
    board = _find_board(cast(Path, args.board))
    profile = runner.load_board(board)
    interpreter = cast(runner.Interpreter, args.interpreter)
    heap = cast("str | None", args.heap)
    if heap is not None and interpreter == "cpython":
        print(
            "edgebroker run: note: --heap is ignored with --interpreter cpython",
            file=sys.stderr,
        )
        heap = None

    data_dir = cast("Path | None", args.data_dir)
    if data_dir is None:
        data_dir = Path("data") / runner.board_name(board, profile)
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CommandError(f"cannot create data dir {data_dir}: {exc.strerror or exc}") from None

    lib = runner.lib_path()
    if not lib.is_file():
        raise CommandError(f"broker script not found: {lib} (override with ${runner.LIB_ENV})")

    argv = runner.broker_command(
        board=board,
        port=cast(int, args.port),
        bind=cast(str, args.bind),
        interpreter=interpreter,
        heap=heap,
        data_dir=data_dir,
        overrides=cast("list[str]", args.overrides),
        lib=lib,
    )
    return runner.run_foreground(argv)

"""`edgebroker run`: start the broker in the foreground on this machine.

Checks the profile with the checker of `config check` (profiles.load_checked:
a bad value is one line naming the key, the value and the allowed range, exit
2) and that the address is free, builds the command with
edgebroker_tools.runner.broker_command (the process interface of
docs/contract.md), passes the child's stdout/stderr through, forwards
SIGINT/SIGTERM to it as SIGINT and exits with its exit code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, cast

from edgebroker_tools import profiles, runner
from edgebroker_tools.commands import (
    CommandError,
    add_set_option,
    port_arg,
    refuse_address_overrides,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

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
        default=DEFAULT_BOARD,
        metavar="BOARD|FILE",
        help=(
            f"board profile: a name in boards/ (esp32) or a JSON file (default: {DEFAULT_BOARD}); "
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
        help=(
            "MicroPython heap size, e.g. 256k, 2m, 131072 (default: the profile's heap_bytes, "
            "a 32-bit board's scaled to the 64-bit port, at least 2m; ignored with cpython)"
        ),
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="directory for the retained store (default: ./data/<board name>)",
    )
    parser.add_argument(
        "--server",
        choices=("poll", "async"),
        default="poll",
        help="poll (default: the host's fastest) or async (the asyncio server, as on a board)",
    )
    parser.add_argument(
        "--secrets",
        type=Path,
        default=None,
        metavar="FILE",
        help=(
            'a secrets file like the board\'s /secrets.json: "users" and "bridges" '
            '{"<name>": {"username", "password"}} are merged into the profile'
        ),
    )
    add_set_option(parser)
    parser.set_defaults(handler=handle)


def _secrets(path: Path | None, profile: dict[str, object]) -> Path | None:
    """The --secrets file, checked here like `flash` checks it (one line
    naming the key): its bridges against the profile's, its users like a
    profile's (a password entry is a string; an unsalted sha256 hash is
    refused, as `config check` refuses it); the broker merges it
    (edgebroker.with_secrets)."""
    if path is None:
        return None
    from edgebroker_tools.commands.flash import check_secret_credentials, read_secrets

    for warning in check_secret_credentials(path, read_secrets(path), profile):
        # a plain-text password, as `flash` warns
        print(f"edgebroker run: warning: secrets file {path}: {warning}", file=sys.stderr)
    return path.resolve()


#: The unix port's own heap when no -X heapsize is given (2 MB, measured:
#: gc.mem_free() + gc.mem_alloc() of MicroPython 1.2x's unix port).
UNIX_DEFAULT_HEAP: Final = 2 * 1024 * 1024


def default_heap(cfg: Mapping[str, Any]) -> str:
    """The MicroPython heap `run` gives a profile without --heap: the heap
    its `config check` budgets (heap_bytes, a 32-bit board's scaled to the
    64-bit unix port), never less than the port's own 2 MB. (Without it the
    host profile, whose max_packet_size is 1 MB, dropped a client that sent
    a 700 KB PUBLISH: MemoryError in the port's 2 MB.)"""
    want = int(cfg["heap_bytes"])
    if int(cfg["word_bytes"]) == 4:
        want = runner.unix_heap(want)
    return str(max(UNIX_DEFAULT_HEAP, want))


def handle(args: argparse.Namespace) -> int:
    """Check the profile and the address, start the broker and wait for it;
    returns its exit code."""
    bind = cast(str, args.bind)
    port = cast(int, args.port)
    overrides = cast("list[str]", args.overrides)
    refuse_address_overrides(overrides, "run")
    # the checker of `config check`: a bad value stops here, in one line
    checked = profiles.load_checked(cast(str, args.board), overrides)
    for issue in profiles.host_warnings(checked.report, bind):
        print(f"edgebroker run: {issue}", file=sys.stderr)
    runner.check_listen(bind, port)
    interpreter = cast(runner.Interpreter, args.interpreter)
    heap = cast("str | None", args.heap)
    if heap is not None and interpreter == "cpython":
        print(
            "edgebroker run: note: --heap is ignored with --interpreter cpython",
            file=sys.stderr,
        )
        heap = None
    elif heap is None and interpreter == "micropython":
        heap = default_heap(checked.report.profile)

    data_dir = cast("Path | None", args.data_dir)
    if data_dir is None:
        data_dir = Path("data") / checked.name
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CommandError(f"cannot create data dir {data_dir}: {exc.strerror or exc}") from None

    lib = runner.lib_path()
    if not lib.is_file():
        raise CommandError(f"broker script not found: {lib} (override with ${runner.LIB_ENV})")

    argv = runner.broker_command(
        board=checked.path,
        port=port,
        bind=bind,
        interpreter=interpreter,
        heap=heap,
        data_dir=data_dir,
        overrides=overrides,
        lib=lib,
        server=cast(str, args.server),
        secrets=_secrets(cast("Path | None", args.secrets), checked.profile),
    )
    return runner.run_foreground(argv, stop_by_eof=interpreter == "micropython")

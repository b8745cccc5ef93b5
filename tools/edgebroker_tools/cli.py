"""`edgebroker`: the host command line.

    edgebroker run [--board boards/host.json] [--port 1883] ...
    edgebroker store inspect FILE [--json] | edgebroker store check FILE
    edgebroker fleet collect|build|report|synth ...
    edgebroker passwd USER [--file secrets.json]

Subcommands are separate modules under edgebroker_tools.commands (see its
docstring); this module only assembles them and turns their errors into
one-line messages and exit codes (2 for bad input; a closed stdout,
`edgebroker ... | head`, ends the command quietly).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final

from edgebroker_tools import __version__
from edgebroker_tools.commands import (
    CommandError,
    build,
    config,
    emulate,
    flash,
    fleet,
    passwd,
    run,
    store,
)
from edgebroker_tools.profiles import ProfileError

if TYPE_CHECKING:
    from edgebroker_tools.commands import Subparsers

#: Registration functions, one per subcommand module, in help order.
COMMANDS: Final[tuple[Callable[[Subparsers], None], ...]] = (
    run.register,
    emulate.register,
    config.register,
    build.register,
    flash.register,
    passwd.register,
    store.register,
    fleet.register,
)

EXIT_USAGE: Final = 2
#: Exit code when stdout's reader has gone (as Python itself does on EPIPE).
EXIT_BROKEN_PIPE: Final = 1


def build_parser() -> argparse.ArgumentParser:
    """The full parser: global options plus every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="edgebroker",
        description="Host tools for the edgebroker MQTT broker.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in COMMANDS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `edgebroker` console script; returns the exit code."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # a pipe's buffer: a gone reader shows here, not at exit
        return code
    except BrokenPipeError:
        # The reader went away (`edgebroker store inspect --json | head`): stop
        # quietly. stdout is pointed at /dev/null so that the interpreter's
        # final flush does not fail again (the recipe of the Python docs,
        # "Note on SIGPIPE" in the signal module).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = args.handler
    try:
        code = handler(args)
    except (CommandError, ProfileError) as exc:
        sys.stdout.flush()
        print(f"edgebroker {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    if not isinstance(code, int):
        raise TypeError(f"handler for {args.command!r} returned {code!r}, not an exit code")
    return code


if __name__ == "__main__":
    sys.exit(main())

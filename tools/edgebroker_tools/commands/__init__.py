"""One module per `edgebroker` subcommand.

Each module exposes

    def register(subparsers: Subparsers) -> None

which adds its parser with `subparsers.add_parser(...)` and sets the
handler with `parser.set_defaults(handler=<Handler>)`. A handler takes the
parsed namespace and returns the process exit code. It raises
edgebroker_tools.commands.CommandError for an input or environment problem;
the CLI prints that as one line without a traceback and exits with 2.
To add a command: write the module, then list it in cli.COMMANDS.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

from edgebroker_tools.runner import RunnerError, check_override

if TYPE_CHECKING:
    Subparsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

Handler: TypeAlias = Callable[[argparse.Namespace], int]

#: The error a command raises for bad input; runner errors are the same class.
CommandError = RunnerError


def port_arg(text: str) -> int:
    """argparse type: a TCP port, 1..65535."""
    try:
        port = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: expected 1..65535") from None
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"invalid port {port}: expected 1..65535")
    return port


def override_arg(text: str) -> str:
    """argparse type: one `--set key=value` item (the broker parses the value)."""
    try:
        return check_override(text)
    except RunnerError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_set_option(parser: argparse.ArgumentParser) -> None:
    """`--set KEY=VALUE`, repeatable: one profile key overridden (run, emulate, build)."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        type=override_arg,
        default=[],
        metavar="KEY=VALUE",
        help="override one profile key (value parsed as JSON, else string); repeatable",
    )


def refuse_address_overrides(overrides: list[str], command: str) -> None:
    """`--set port=...` or `--set bind=...`: refused in one line. On the host
    the address comes from --port and --bind (a board profile's port and
    bind are the board's); silently listening elsewhere would mislead."""
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key in ("port", "bind"):
            raise CommandError(
                f"--set {item}: {command} listens where --port and --bind say; "
                f"use --{key} (the profile's {key} is the board's)"
            )


__all__ = [
    "CommandError",
    "Handler",
    "Subparsers",
    "add_set_option",
    "override_arg",
    "port_arg",
    "refuse_address_overrides",
]

"""Output locations of the fleet commands, checked before any work is done.

    out = make_dir(Path("snapshots/"), "--out")     # created (parents too) or OutputError
    check_file(Path("r.html"), "--html")            # its directory exists, it is no directory
    write_text(Path("r.html"), page, "--html")      # OutputError instead of an OSError

OutputError is the commands' CommandError: the CLI prints it as one line
naming the option, the value and what it needs, and exits with 2 (no
traceback). Only the standard library: the CLI loads this without pyarrow.
"""

from __future__ import annotations

from pathlib import Path

from edgebroker_tools.commands import CommandError


class OutputError(CommandError):
    """An output location that cannot be used (one line, exit 2)."""


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)


def make_dir(path: Path, option: str) -> Path:
    """The directory `path` (created with its parents when missing)."""
    if path.exists() and not path.is_dir():
        raise OutputError(
            f"{option} {path}: exists and is not a directory "
            "(expected a directory, created when missing)"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{option} {path}: cannot create the directory: {_why(exc)}") from None
    return path


def check_file(path: Path, option: str) -> None:
    """A file about to be written: not a directory, in a directory that exists."""
    if path.is_dir():
        raise OutputError(f"{option} {path}: is a directory (expected a file name)")
    parent = path.parent
    if not parent.is_dir():
        raise OutputError(
            f"{option} {path}: no such directory {parent} (expected a file in an existing "
            "directory)"
        )


def write_text(path: Path, text: str, option: str) -> None:
    """Write a UTF-8 text file; an OSError becomes one OutputError line."""
    check_file(path, option)
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise OutputError(f"{option} {path}: cannot write the file: {_why(exc)}") from None

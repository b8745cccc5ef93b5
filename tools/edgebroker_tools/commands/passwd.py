"""`edgebroker passwd USER`: add or change a user's password entry.

    edgebroker passwd sensor-1                              # firmware/secrets.json
    edgebroker passwd sensor-1 --file boards/mine.json      # a profile's users
    printf 's3cret\\n' | edgebroker passwd sensor-1 --file secrets.json   # scripts
    edgebroker passwd sensor-1 --print                      # the entry only

The password is read twice from the terminal (not echoed), or once from
stdin when stdin is not a terminal (one line; the newline is not part of
it). The entry is edgebroker_tools.passwords' salted, iterated form,
`pbkdf2_sha256:<iterations>:<salt hex>:<derived key hex>`, which the broker
verifies. The file's `users` object gets the entry (created if missing,
the file too); every other key is kept. The file is replaced atomically.

Exit codes: 0 written, 2 bad input (passwords differ, empty password, a
file that is not a JSON object, iterations out of range).
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, cast

from edgebroker_tools import passwords, profiles, runner
from edgebroker_tools.commands import CommandError

if TYPE_CHECKING:
    from edgebroker_tools.commands import Subparsers

#: The file `edgebroker flash` copies to the board as /secrets.json.
DEFAULT_FILE: Final = Path("firmware") / "secrets.json"
#: The broker's limit on a users value (boards/schema.json users).
MAX_USER_BYTES: Final = 256


def _iterations(text: str) -> int:
    lo, hi = passwords.MIN_ITERATIONS, passwords.MAX_ITERATIONS
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid iterations {text!r}: must be {lo}..{hi}"
        ) from None
    if not lo <= value <= hi:
        raise argparse.ArgumentTypeError(f"iterations {value}: must be {lo}..{hi}")
    return value


def register(subparsers: Subparsers) -> None:
    """Add the `passwd` subcommand."""
    parser = subparsers.add_parser(
        "passwd",
        help="add or change a user's password (salted PBKDF2 entry) in a secrets file or profile",
        description=(
            "Read a password (twice from the terminal, or once from stdin) and write the "
            "user's salted, iterated entry (pbkdf2_sha256:ITERATIONS:SALT:KEY) into the "
            "file's users object."
        ),
    )
    parser.add_argument("user", metavar="USER", help="the MQTT user name")
    parser.add_argument(
        "--file",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"secrets file or board profile to update (default: <repo>/{DEFAULT_FILE}, "
        "which `edgebroker flash` copies to the board)",
    )
    parser.add_argument(
        "--iterations",
        type=_iterations,
        default=passwords.DEFAULT_ITERATIONS,
        metavar="N",
        help=f"PBKDF2 iterations, {passwords.MIN_ITERATIONS}..{passwords.MAX_ITERATIONS} "
        f"(default {passwords.DEFAULT_ITERATIONS}: the board computes it at each CONNECT)",
    )
    parser.add_argument(
        "--print",
        dest="print_only",
        action="store_true",
        help="print the entry instead of writing a file",
    )
    parser.set_defaults(handler=handle)


def read_password() -> str:
    """Twice from a terminal (must match), else one line from stdin."""
    if sys.stdin.isatty():
        first = getpass.getpass("Password: ")
        second = getpass.getpass("Password again: ")
        if first != second:
            raise CommandError("the passwords differ: nothing written")
        password = first
    else:
        line = sys.stdin.readline()
        password = line[:-1] if line.endswith("\n") else line
        password = password.removesuffix("\r")
    if not password:
        raise CommandError("empty password: nothing written")
    return password


def _read(path: Path) -> dict[str, Any]:
    """The file's JSON object ({} when there is no file yet). A file that is
    not UTF-8 or not JSON, or JSON past the tools' limits (nested too deep,
    a number too large), is one line naming it (profiles.read_json)."""
    try:
        path.stat()
    except FileNotFoundError:
        return {}
    except OSError:
        pass  # read_json says what it is, in one line
    try:
        data = profiles.read_json(path, "file")
    except profiles.ProfileError as exc:
        raise CommandError(str(exc)) from None
    if not isinstance(data, dict):
        raise CommandError(f"{path} must hold a JSON object")
    users = data.get("users", {})
    if not isinstance(users, dict):
        raise CommandError(f'{path}: "users" must be an object, not {type(users).__name__}')
    return data


def write_entry(path: Path, user: str, entry: str) -> bool:
    """Put users[user] = entry into the JSON file; True if the user was new."""
    data = _read(path)
    users = dict(data.get("users") or {})
    new = user not in users
    users[user] = entry
    data["users"] = users
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # secrets: readable by the owner only when the file is new
        mode = path.stat().st_mode & 0o777 if path.exists() else 0o600
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CommandError(f"cannot write {path}: {exc.strerror or exc}") from None
    return new


def handle(args: argparse.Namespace) -> int:
    user = cast(str, args.user)
    if not user or len(user.encode("utf-8")) > 65535:
        raise CommandError("USER must be 1..65535 bytes (an MQTT user name)")
    path = cast("Path | None", args.file) or runner.repo_root() / DEFAULT_FILE
    if not args.print_only:
        _read(path)  # a file that cannot take the entry fails before the prompt
    password = read_password()
    entry = passwords.make_entry(password, cast(int, args.iterations))
    if len(entry) > MAX_USER_BYTES:
        raise CommandError(f"the entry is {len(entry)} bytes, over the broker's {MAX_USER_BYTES}")
    if args.print_only:
        print(entry)
        return 0
    new = write_entry(path, user, entry)
    print(f"{path}: {'added' if new else 'changed'} user {user}", file=sys.stderr)
    return 0

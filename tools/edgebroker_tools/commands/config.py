"""`edgebroker config`: check, show, patch board profiles; write their reference page.

    edgebroker config check BOARD|FILE... [--all] [-v] [--costs FILE]
    edgebroker config show BOARD|FILE [--only-set]
    edgebroker config apply BOARD|FILE PATCH.json [--write]
    edgebroker config reference [--out FILE] [--check]   # + docs/contract.md's key table

BOARD is a name (esp32 -> boards/esp32.json) or a path. The schema is
boards/schema.json, the measured costs boards/memory_costs.json; the checks
are edgebroker_tools.profiles.check_profile (docs/board-reference.md, "How
config check adds it up").

Exit codes: 0 valid (warnings allowed), 1 a profile failed its checks (each
error on its own line: the key, the value and the allowed range), 2 bad
input (a missing or non-JSON file, an unknown board).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from edgebroker_tools import profiles, reference
from edgebroker_tools.commands import CommandError
from edgebroker_tools.profiles import ProfileError, Report

if TYPE_CHECKING:
    from edgebroker_tools.commands import Subparsers

EXIT_INVALID = 1


def register(subparsers: Subparsers) -> None:
    """Add the `config` subcommand and its own subcommands."""
    parser = subparsers.add_parser(
        "config",
        help="check, show and patch board profiles",
        description="Validate board profiles against boards/schema.json and the board's "
        "limits (sockets, flash, heap), show them with defaults, patch them, and "
        "generate docs/board-reference.md.",
    )
    sub = parser.add_subparsers(dest="config_command", metavar="ACTION", required=True)

    check = sub.add_parser(
        "check",
        help="validate profiles: schema, sockets, flash, worst-case heap",
        description="Validate each profile; every error is listed (key, value, allowed "
        "range). Exit 1 if any profile fails.",
    )
    check.add_argument("boards", nargs="*", metavar="BOARD|FILE")
    check.add_argument("--all", action="store_true", help="every profile in boards/")
    check.add_argument(
        "-v", "--verbose", action="store_true", help="print the heap and flash sums item by item"
    )
    check.add_argument(
        "--costs",
        type=Path,
        default=None,
        metavar="FILE",
        help="memory cost file (default: boards/memory_costs.json)",
    )
    check.set_defaults(handler=handle_check)

    show = sub.add_parser(
        "show",
        help="print the effective profile (defaults filled in) as JSON",
        description="Print the profile with every default filled in, in schema order. "
        "Schema errors go to stderr (exit 1) after the JSON.",
    )
    show.add_argument("board", metavar="BOARD|FILE")
    show.set_defaults(handler=handle_show)

    apply = sub.add_parser(
        "apply",
        help="merge a JSON patch into a profile and check the result",
        description="Merge PATCH.json (RFC 7386 merge patch: null removes a key, so it "
        "takes its default) into the profile and run the full check. Without --write the "
        "merged profile is printed; with --write the file is rewritten, only if it passes.",
    )
    apply.add_argument("board", metavar="BOARD|FILE")
    apply.add_argument("patch", type=Path, metavar="PATCH.json")
    apply.add_argument("--write", action="store_true", help="write the merged profile back")
    apply.set_defaults(handler=handle_apply)

    ref = sub.add_parser(
        "reference",
        help="write docs/board-reference.md and docs/contract.md's key table from the schema",
        description="Generate the board profile reference page, and the table of keys the "
        "broker reads in docs/contract.md, from boards/schema.json.",
    )
    ref.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write the reference page here instead (docs/contract.md is then left alone)",
    )
    ref.add_argument(
        "--check", action="store_true", help="do not write: exit 1 if the page is out of date"
    )
    ref.set_defaults(handler=handle_reference)


# ----------------------------------------------------------------- helpers
def _load(spec: str) -> tuple[Path, dict[str, Any]]:
    try:
        path = profiles.resolve_board(spec)
        return path, profiles.load_profile(path)
    except ProfileError as exc:
        raise CommandError(str(exc)) from None


def _schema() -> dict[str, Any]:
    try:
        return profiles.load_schema()
    except ProfileError as exc:
        raise CommandError(str(exc)) from None


def _costs(path: Path | None) -> dict[str, Any]:
    try:
        return profiles.load_costs(path)
    except ProfileError as exc:
        raise CommandError(str(exc)) from None


def _name(path: Path, profile: dict[str, Any]) -> str:
    board = profile.get("board")
    return board if isinstance(board, str) and board else path.stem


def _check(
    path: Path, profile: dict[str, Any], schema: dict[str, Any], costs: dict[str, Any]
) -> Report:
    try:
        return profiles.check_profile(profile, schema, costs, _name(path, profile))
    except ProfileError as exc:
        raise CommandError(str(exc)) from None


def print_report(label: str, report: Report, verbose: bool, out: Any = None) -> None:
    """The check's findings: one summary line, then each issue on its own line."""
    stream = out if out is not None else (sys.stderr if report.errors else sys.stdout)
    cfg = report.profile
    if report.errors:
        n = len(report.errors)
        print(f"{label}: {n} error{'s' if n > 1 else ''}", file=stream)
    else:
        print(f"{label}: ok", file=stream)
    for issue in report.issues:
        print(f"  {issue}", file=stream)
    for note in report.notes:
        print(f"  note: {note}", file=stream)
    if report.heap:
        total = report.heap_total
        heap = int(cfg["heap_bytes"])
        room = int(cfg["sockets"]) - 1 - int(cfg["spare_sockets"])
        print(
            f"  heap: worst case {total} of heap_bytes {heap} ({heap - total} spare); "
            f"max_clients {cfg['max_clients']} (the sockets allow {room})",
            file=stream,
        )
        if verbose:
            for item in report.heap:
                print(f"    {item.name:<13} {item.bytes:>11}  {item.how}", file=stream)
    if report.flash:
        total = report.flash_total
        print(f"  flash: peak {total} of fs_bytes {cfg['fs_bytes']}", file=stream)
        if verbose:
            for item in report.flash:
                print(f"    {item.name:<16} {item.bytes:>11}  {item.how}", file=stream)


def _dump(profile: dict[str, Any]) -> str:
    return json.dumps(profile, indent=2, ensure_ascii=False) + "\n"


# ---------------------------------------------------------------- handlers
def handle_check(args: argparse.Namespace) -> int:
    specs = cast("list[str]", args.boards)
    if args.all:
        specs = specs + [str(p) for p in profiles.board_files()]
    if not specs:
        raise CommandError("name at least one BOARD or FILE, or give --all")
    schema = _schema()
    costs = _costs(cast("Path | None", args.costs))
    failed = 0
    for spec in specs:
        path, profile = _load(spec)
        report = _check(path, profile, schema, costs)
        label = f"{path} ({report.name})"
        print_report(label, report, bool(args.verbose))
        if report.errors:
            failed += 1
    return EXIT_INVALID if failed else 0


def handle_show(args: argparse.Namespace) -> int:
    path, profile = _load(cast(str, args.board))
    schema = _schema()
    sys.stdout.write(_dump(profiles.effective(profile, schema)))
    issues = profiles.validate(profile, schema)
    for issue in issues:
        print(f"{path}: {issue}", file=sys.stderr)
    return EXIT_INVALID if issues else 0


def handle_apply(args: argparse.Namespace) -> int:
    path, profile = _load(cast(str, args.board))
    patch_path = cast(Path, args.patch)
    try:
        patch = profiles.load_profile(patch_path)
    except ProfileError as exc:
        raise CommandError(str(exc).replace("board profile", "patch")) from None
    merged = profiles.merge_patch(profile, patch)
    schema = _schema()
    costs = _costs(None)
    report = _check(path, merged, schema, costs)
    label = f"{path} + {patch_path} ({report.name})"
    if not args.write:
        sys.stdout.write(_dump(merged))
        print_report(label, report, False, out=sys.stderr)
        return EXIT_INVALID if report.errors else 0
    if report.errors:
        print_report(label, report, False)
        print(f"{path}: not written", file=sys.stderr)
        return EXIT_INVALID
    try:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(_dump(merged), encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        raise CommandError(f"cannot write {path}: {exc.strerror or exc}") from None
    print_report(label, report, False)
    print(f"{path}: written", file=sys.stderr)
    return 0


def handle_reference(args: argparse.Namespace) -> int:
    schema = _schema()
    given = cast("Path | None", args.out)
    pages = [(given or reference.reference_path(), reference.render(schema))]
    if given is None:  # the repo's pages: docs/contract.md's key table too
        path = reference.contract_path()
        try:
            current = path.read_text(encoding="utf-8")
            pages.append((path, reference.update_contract(current, schema)))
        except (OSError, ValueError) as exc:
            raise CommandError(f"cannot update {path}: {exc}") from None
    if args.check:
        stale = 0
        for out, text in pages:
            try:
                current = out.read_text(encoding="utf-8")
            except OSError:
                current = ""
            if current != text:
                stale += 1
                print(
                    f"{out} is out of date: run `edgebroker config reference` "
                    "(make board-reference)",
                    file=sys.stderr,
                )
            else:
                print(f"{out}: up to date")
        return EXIT_INVALID if stale else 0
    for out, text in pages:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text, encoding="utf-8")
        except OSError as exc:
            raise CommandError(f"cannot write {out}: {exc.strerror or exc}") from None
        print(f"wrote {out}")
    return 0

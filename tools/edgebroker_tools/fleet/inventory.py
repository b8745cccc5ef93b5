"""The fleet inventory and its secrets file.

Inventory (JSON; relative paths are relative to the inventory file):

    {
      "secrets": "fleet-secrets.json",          optional; --secrets overrides it
      "defaults": {"port": 1883, "board": "esp32"},
      "gateways": [
        {"id": "gw-001", "host": "10.0.0.5", "port": 1883, "board": "esp32",
         "credentials": "site-a"},
        {"id": "gw-002", "host": "10.0.0.6", "board": "rp2040_picow",
         "overrides": {"max_retained_messages": 300}},
        {"id": "gw-003", "board": "boards/custom.json",
         "store": "pulled/gw-003.ebrs", "collected_at": "2025-06-01T12:00:00Z"}
      ]
    }

A gateway is read over MQTT (host, port) or, with "store", from a flash
store file pulled from the board (collected_at: when it was pulled; the
file's modification time when absent). "board" is a board name
(boards/<name>.json) or a profile file; "overrides" are profile keys that
gateway runs with on top of it (a JSON Merge Patch: null removes a key).
The profile with its overrides must pass the checker of `edgebroker config
check` (profiles.check_profile: types, ranges, unknown keys, the cross-key
checks); a gateway whose profile does not is an inventory error naming the
gateway, the key, the value and what is allowed, before anything is
collected. The limits the pipeline compares against are the effective
profile's (schema defaults filled in).

Every file (inventory, secrets, board profile) must be UTF-8 JSON; one that
is not, or that holds a number or nesting Python's json cannot take (more
than sys.get_int_max_str_digits() digits, nesting deeper than the recursion
limit), is an InventoryError too.

Secrets (JSON, never committed): {"site-a": {"username": "u", "password": "p"}}.
"credentials" names an entry; a missing entry is an inventory error.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from edgebroker_tools import profiles, runner
from edgebroker_tools.fleet.schema import GATEWAY_ID_RE, LIMIT_KEYS

GATEWAY_KEYS: Final = frozenset(
    {"id", "host", "port", "board", "credentials", "overrides", "store", "collected_at"}
)


class InventoryError(Exception):
    """An inventory or secrets file that cannot be used (one line)."""


@dataclass(frozen=True)
class Gateway:
    """One inventory entry, resolved."""

    id: str
    board: str  # the profile's "board" name
    limits: dict[str, int | None]
    host: str | None = None
    port: int = 1883
    username: str | None = None
    password: str | None = None
    store: Path | None = None
    collected_at: datetime | None = None

    @property
    def address(self) -> str:
        return str(self.store) if self.store is not None else f"{self.host}:{self.port}"


def _read(path: Path, what: str) -> Any:
    """A JSON file's content; InventoryError (one line) for anything else."""
    try:
        text = profiles.read_text(path, what)  # missing, unreadable, not UTF-8
    except profiles.ProfileError as exc:
        raise InventoryError(str(exc)) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InventoryError(
            f"{what} {path} is not valid JSON: {exc.msg} (line {exc.lineno})"
        ) from None
    except RecursionError:
        raise InventoryError(
            f"{what} {path} is not usable JSON: arrays or objects nested deeper than "
            f"Python's recursion limit ({sys.getrecursionlimit()}) allows"
        ) from None
    except ValueError:  # int("1" * 5000): more digits than Python converts
        raise InventoryError(
            f"{what} {path} is not usable JSON: a number with more than "
            f"{sys.get_int_max_str_digits()} digits"
        ) from None


def load_secrets(path: Path) -> dict[str, dict[str, str]]:
    data = _read(path, "secrets file")
    if not isinstance(data, dict):
        raise InventoryError(f"secrets file {path} must hold a JSON object")
    out: dict[str, dict[str, str]] = {}
    for name, entry in data.items():
        if not isinstance(entry, dict) or not all(
            isinstance(entry.get(k), str) for k in ("username", "password") if k in entry
        ):
            raise InventoryError(f"secrets entry {name!r}: expected {{username, password}}")
        out[name] = {k: v for k, v in entry.items() if isinstance(v, str)}
    return out


def parse_time(text: str) -> datetime:
    """An ISO 8601 time; naive times are UTC."""
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise InventoryError(f"invalid time {text!r}: expected ISO 8601") from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


class _Limits:
    """Board name or profile path (+ overrides) -> (board name, limits), cached.

    The profile with the overrides is checked as `edgebroker config check`
    checks one (profiles.check_profile, with the memory costs when the
    checkout has them); any error is an InventoryError."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.schema = profiles.load_schema()
        try:
            self.costs: dict[str, Any] | None = profiles.load_costs()
        except profiles.ProfileError:
            self.costs = None  # a checkout without measured costs: as load_checked does
        self.cache: dict[str, tuple[str, Path, dict[str, Any]]] = {}
        self.checked: dict[tuple[str, str], dict[str, int | None]] = {}

    def resolve(self, spec: str) -> tuple[str, Path, dict[str, Any]]:
        if spec not in self.cache:
            candidate = self.base / spec
            path = candidate if candidate.is_file() else profiles.resolve_board(spec)
            profile = _read(path, "board profile")
            if not isinstance(profile, dict):
                raise InventoryError(f"board profile {path} must hold a JSON object")
            self.cache[spec] = (runner.board_name(path, profile), path, profile)
        return self.cache[spec]

    def limits(
        self, spec: str, overrides: dict[str, Any], where: str
    ) -> tuple[str, dict[str, int | None]]:
        """(board name, limits) of the checked effective profile."""
        board, path, profile = self.resolve(spec)
        try:
            key = (spec, json.dumps(overrides, sort_keys=True))
            if key not in self.checked:
                merged = profiles.merge_patch(profile, overrides)
                report = profiles.check_profile(merged, self.schema, self.costs, board)
                if report.errors:
                    source = f"{path} with its overrides" if overrides else str(path)
                    texts = "; ".join(_short(issue.text) for issue in report.errors)
                    raise InventoryError(f"{where}: board profile {source}: {texts}")
                self.checked[key] = _limit_values(report.profile)
        except RecursionError:
            raise InventoryError(
                f"{where}: 'overrides' or board profile {path}: nested too deeply"
            ) from None
        return board, self.checked[key]


#: An issue longer than this (a huge or deeply nested value shown whole) is
#: cut in the middle, so that the error stays one readable line.
LONG_ISSUE: Final = 600


def _short(text: str) -> str:
    if len(text) <= LONG_ISSUE:
        return text
    return f"{text[:200]} ... {text[-250:]}"


def _limit_values(eff: dict[str, Any]) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for key in LIMIT_KEYS:
        value = eff.get(key)
        out[key] = value if isinstance(value, int) and not isinstance(value, bool) else None
    return out


def load_inventory(path: Path, secrets_path: Path | None = None) -> list[Gateway]:
    """Every gateway of the inventory, validated; InventoryError names the first problem."""
    data = _read(path, "inventory")
    if not isinstance(data, dict) or not isinstance(data.get("gateways"), list):
        raise InventoryError(f"inventory {path} must be an object with a 'gateways' list")
    base = path.resolve().parent
    if secrets_path is None and isinstance(data.get("secrets"), str):
        secrets_path = base / data["secrets"]
    secrets = load_secrets(secrets_path) if secrets_path is not None else {}
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict):
        raise InventoryError("inventory 'defaults' must be an object")
    try:
        resolver = _Limits(base)
    except profiles.ProfileError as exc:
        raise InventoryError(str(exc)) from None
    out: list[Gateway] = []
    seen: set[str] = set()
    for n, raw in enumerate(data["gateways"]):
        if not isinstance(raw, dict):
            raise InventoryError(f"gateway #{n + 1}: expected an object")
        entry = {**defaults, **raw}
        gid = entry.get("id")
        if not isinstance(gid, str) or not GATEWAY_ID_RE.match(gid):
            raise InventoryError(
                f"gateway #{n + 1}: id {gid!r} must be 1-64 letters, digits, '.', '_' or '-'"
            )
        where = f"gateway {gid}"
        if gid in seen:
            raise InventoryError(f"{where}: duplicate id")
        seen.add(gid)
        unknown = sorted(set(entry) - GATEWAY_KEYS)
        if unknown:
            raise InventoryError(f"{where}: unknown key(s) {', '.join(unknown)}")
        out.append(_gateway(gid, entry, where, base, secrets, resolver))
    return out


def _gateway(
    gid: str,
    entry: dict[str, Any],
    where: str,
    base: Path,
    secrets: dict[str, dict[str, str]],
    resolver: _Limits,
) -> Gateway:
    spec = entry.get("board")
    if not isinstance(spec, str) or not spec:
        raise InventoryError(f"{where}: 'board' (a board name or profile file) is required")
    overrides = entry.get("overrides", {})
    if not isinstance(overrides, dict):
        raise InventoryError(f"{where}: 'overrides' must be an object")
    try:
        board, limits = resolver.limits(spec, overrides, where)
    except (profiles.ProfileError, InventoryError) as exc:
        text = str(exc)  # the profile check's errors name the gateway already
        named = text if text.startswith(f"{where}: ") else f"{where}: {text}"
        raise InventoryError(named) from None
    username = password = None
    cred = entry.get("credentials")
    if cred is not None:
        if not isinstance(cred, str) or cred not in secrets:
            raise InventoryError(f"{where}: credentials {cred!r} not in the secrets file")
        username = secrets[cred].get("username")
        password = secrets[cred].get("password")
    store = entry.get("store")
    if store is not None:
        if not isinstance(store, str):
            raise InventoryError(f"{where}: 'store' must be a file path")
        when = entry.get("collected_at")
        if when is not None and not isinstance(when, str):
            raise InventoryError(f"{where}: 'collected_at' must be an ISO 8601 string")
        return Gateway(
            gid,
            board,
            limits,
            store=base / store,
            collected_at=parse_time(when) if when else None,
        )
    host = entry.get("host")
    port = entry.get("port", 1883)
    if not isinstance(host, str) or not host:
        raise InventoryError(f"{where}: 'host' (or 'store') is required")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise InventoryError(f"{where}: port {port!r} must be 1..65535")
    return Gateway(gid, board, limits, host=host, port=port, username=username, password=password)

"""Board profiles: schema validation, defaults, patches and the cross-key checks.

    schema = load_schema()
    costs = load_costs()
    report = check_profile(profile, schema, costs, name="esp32")
    report.errors       # [Issue(key, text)], all of them, not just the first
    report.heap         # the worst-case heap, item by item (HeapItem)

The schema is boards/schema.json (JSON Schema draft 2020-12). Only the
subset it uses is implemented here (no new dependency): type, enum,
minimum/maximum, minLength/maxLength, pattern, properties,
additionalProperties (false or a schema), maxProperties. One deliberate
difference: 4.0 is not an "integer" (the broker would get a float). Custom
keywords: x-unit, x-consequence, x-group, x-read-by (the reference page
shows them).

The cross-key checks (sockets, flash, heap, code) and the models behind
them are described in MODEL_TEXT, which docs/board-reference.md repeats, so
that the page and the code cannot disagree.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from edgebroker_tools import passwords, runner
from edgebroker_tools.commands.store_report import load_edgestore

Profile = dict[str, Any]
Schema = dict[str, Any]
Level = Literal["error", "warning"]

_EDGESTORE = load_edgestore()

#: Flash store facts, imported from lib/edgestore.py (FORMAT) so that they
#: cannot drift: a PUT record is PUT_OVERHEAD (29) bytes plus topic,
#: properties and payload; the file starts with a FILE_HEADER (8) byte
#: header; a CLOCK record is CLOCK_RECORD (17) bytes.
PUT_OVERHEAD: Final[int] = int(_EDGESTORE.PUT_OVERHEAD)
FILE_HEADER: Final[int] = len(_EDGESTORE.HEADER)
CLOCK_RECORD: Final[int] = int(_EDGESTORE.CLOCK_SIZE)

#: littlefs allocates whole blocks (4 KB on ESP32 and RP2), so each of the
#: two files (store and .new) may waste up to one (a filesystem fact).
FS_BLOCK: Final = 4096

#: edgestore preallocates its whole index for a capacity below this (above
#: it, this many entries first, then growth by half).
INDEX_PREALLOC: Final[int] = int(_EDGESTORE._BIG)

#: $SYS/broker/refusals/<cause> topics the heap check allows for. The broker
#: makes $SYS messages on demand, so the measured standing cost
#: (sys_retained) is 0 today; the term stays in case that changes.
SYS_REFUSAL_TOPICS: Final = 6
# Bridge heap (lib/edgebridge.py), per bridge: the link's objects and task,
# its send and receive buffers and, with TLS, one client's handshake and
# record buffers (MicroPython's mbedtls: about 40 KB).
BRIDGE_FIXED: Final = 8192
BRIDGE_TLS: Final = 40960
BRIDGE_INDEX_ENTRY: Final = 8
BRIDGE_SMALL_HEAP: Final = 1048576


class ProfileError(Exception):
    """A profile, schema or cost file that cannot be read (one line, no traceback)."""


@dataclass(frozen=True)
class Issue:
    """One finding: the key it is about and a sentence naming value and allowed range."""

    key: str
    text: str
    level: Level = "error"

    def __str__(self) -> str:
        return f"{self.level}: {self.text}"


@dataclass(frozen=True)
class HeapItem:
    """One line of the worst-case heap sum."""

    name: str
    bytes: int
    how: str


@dataclass
class Report:
    """What check_profile found."""

    name: str
    profile: Profile
    issues: list[Issue] = field(default_factory=list)
    heap: list[HeapItem] = field(default_factory=list)
    flash: list[HeapItem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def errors(self) -> list[Issue]:
        return [i for i in self.issues if i.level == "error"]

    @property
    def warnings(self) -> list[Issue]:
        return [i for i in self.issues if i.level == "warning"]

    @property
    def heap_total(self) -> int:
        return sum(item.bytes for item in self.heap)

    @property
    def flash_total(self) -> int:
        return sum(item.bytes for item in self.flash)

    def error(self, key: str, text: str) -> None:
        self.issues.append(Issue(key, text, "error"))

    def warn(self, key: str, text: str) -> None:
        self.issues.append(Issue(key, text, "warning"))


# ------------------------------------------------------------------ files
def boards_dir() -> Path:
    return runner.repo_root() / "boards"


def schema_path() -> Path:
    return boards_dir() / "schema.json"


def costs_path() -> Path:
    return boards_dir() / "memory_costs.json"


#: Files in boards/ that are not board profiles.
NOT_PROFILES: Final = frozenset({"schema.json", "memory_costs.json", "secrets.json"})


def board_files() -> list[Path]:
    """Every committed board profile: boards/*.json except the schema and costs."""
    return sorted(p for p in boards_dir().glob("*.json") if p.name not in NOT_PROFILES)


def resolve_board(spec: str) -> Path:
    """A board name (esp32 -> boards/esp32.json) or a path to a profile file."""
    path = Path(spec)
    if path.suffix == ".json" or "/" in spec or path.exists():
        if path.exists() or path.is_absolute():
            return path
        in_repo = runner.repo_root() / path
        return in_repo if in_repo.exists() else path
    candidate = boards_dir() / f"{spec}.json"
    if candidate.exists() and candidate.name not in NOT_PROFILES:
        return candidate
    known = ", ".join(p.stem for p in board_files())
    raise ProfileError(f"unknown board {spec!r}: expected a file or one of {known}")


#: How deep arrays and objects may nest in a JSON file or `--set` value the
#: tools read. A profile nests 5 levels (bridges[i].topics[j].key), the
#: schema 10; a deeper value is refused in one line before any parser or
#: check recurses into it (Python's own JSON reader stops near 1,000 levels
#: with a RecursionError, the checks sooner).
MAX_JSON_DEPTH: Final = 32
#: The most digits an integer in a JSON file or `--set` value may have:
#: Python's default limit for reading one (sys.get_int_max_str_digits());
#: no profile value comes near it.
MAX_INT_DIGITS: Final = 4300

#: A JSON string (escapes included), or one of the characters that open,
#: close or separate arrays and objects.
_JSON_TOKEN: Final = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}:,]')


class JsonLimitError(ProfileError):
    """JSON the tools refuse to read (nested too deep, a number too large):
    `text` names the key, the value and the limit, without the file."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


class _UndecodableError(ValueError):
    """Not JSON at all (the reason is the message)."""


class _TooLarge(str):
    """Stands in for a number the reader refuses while it parses (so that
    the key holding it can be named): the number's own text."""


def _abbrev(text: str, keep: int = 16) -> str:
    text = text.strip()
    return text if len(text) <= keep + 8 else f"{text[:keep]}..."


def _too_deep(text: str, root: str) -> str | None:
    """The key (or root) whose value nests past MAX_JSON_DEPTH, with its
    value abbreviated, or None. A scan of the text, without recursion."""
    depth = 0
    last = ""
    key = root
    start = 0
    for m in _JSON_TOKEN.finditer(text):
        tok = m.group()
        if tok in ("[", "{"):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return f"{key or 'the value'} = {_abbrev(text[start:])}"
        elif tok in ("]", "}"):
            depth -= 1
        elif tok == ":" and depth == 1 and not root:
            try:
                key = str(json.loads(last))
            except ValueError:
                key = last
            start = m.end()
        elif tok.startswith('"'):
            last = tok
    return None


def _sub_schema(
    schema: Mapping[str, Any] | None, parts: list[str | int]
) -> Mapping[str, Any] | None:
    """The schema of the value at a key path (names and indexes), if known."""
    node: Any = schema
    for part in parts:
        if not isinstance(node, Mapping):
            return None
        if isinstance(part, int):
            node = node.get("items")
            continue
        props = node.get("properties")
        extra = node.get("additionalProperties")
        if isinstance(props, Mapping) and part in props:
            node = props[part]
        elif isinstance(extra, Mapping):
            node = extra
        else:
            return None
    return node if isinstance(node, Mapping) else None


def _find_too_large(data: Any) -> tuple[list[str | int], _TooLarge] | None:
    """The first _TooLarge in decoded JSON and its key path (no recursion:
    the depth is bounded by MAX_JSON_DEPTH already, but a stack is as short)."""
    stack: list[tuple[list[str | int], Any]] = [([], data)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, _TooLarge):
            return path, node
        if isinstance(node, dict):
            items: list[tuple[str | int, Any]] = list(node.items())
        elif isinstance(node, list):
            items = list(enumerate(node))
        else:
            continue
        stack.extend(([*path, k], v) for k, v in reversed(items))
    return None


def _path_text(root: str, parts: list[str | int]) -> str:
    out = root
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or "the value"


def decode_json(text: str, root: str = "", schema: Mapping[str, Any] | None = None) -> Any:
    """json.loads for input the tools are given (profiles, patches, secrets,
    `--set` values), with limits that make a bad one a one-line error:

    - arrays and objects nested deeper than MAX_JSON_DEPTH, an integer of
      more than MAX_INT_DIGITS digits, a number beyond a float's range:
      JsonLimitError naming the key (root is the key of a `--set` value),
      the value abbreviated and what is allowed (from schema, the profile
      schema, when given);
    - anything that is not JSON (NaN and Infinity included): _UndecodableError."""
    deep = _too_deep(text, root)
    if deep is not None:
        raise JsonLimitError(
            f"{deep}: nested more than {MAX_JSON_DEPTH} levels deep; must be at most "
            f"{MAX_JSON_DEPTH} levels of arrays and objects"
        )
    made: list[bool] = []

    def parse_int(s: str) -> Any:
        if len(s.lstrip("-")) > MAX_INT_DIGITS:
            made.append(True)
            return _TooLarge(s)
        return int(s)

    def parse_float(s: str) -> Any:
        value = float(s)
        if not math.isfinite(value):
            made.append(True)
            return _TooLarge(s)
        return value

    def parse_constant(s: str) -> Any:
        raise _UndecodableError(f"{s} is not a JSON value")

    try:
        data = json.loads(
            text, parse_int=parse_int, parse_float=parse_float, parse_constant=parse_constant
        )
    except json.JSONDecodeError as exc:
        raise _UndecodableError(f"{exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:  # not reached below MAX_JSON_DEPTH; kept as a guard
        raise JsonLimitError(
            f"{root or 'the value'}: nested too deeply; must be at most {MAX_JSON_DEPTH} levels"
        ) from None
    except ValueError as exc:  # the hooks', or int()'s own digit limit
        raise _UndecodableError(str(exc)) from None
    if made:
        found = _find_too_large(data)
        if found is not None:
            parts, number = found
            raise JsonLimitError(_too_large_text(_path_text(root, parts), number, parts, schema))
    return data


def _too_large_text(
    key: str, number: str, parts: list[str | int], schema: Mapping[str, Any] | None
) -> str:
    digits = len(number.lstrip("-"))
    if re.fullmatch(r"-?[0-9]+", number):
        shown = f"{number[:12]}...{number[-4:]} ({digits} digits)"
        limit = f"at most {MAX_INT_DIGITS} digits"
    else:
        shown = _abbrev(number, 24)
        limit = f"within +-{sys.float_info.max:.4g}"
    sub = _sub_schema(schema, parts)
    want = sub.get("type") if sub is not None else None
    if sub is not None and isinstance(want, str):
        return f"{key} = {shown}: must be {_allowed(want, sub)}"
    return f"{key} = {shown}: too large to read; a number must be {limit}"


def read_text(path: Path, what: str) -> str:
    """A UTF-8 text file, or ProfileError in one line naming it."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProfileError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise ProfileError(f"{what} {path} is a directory, not a file") from None
    except OSError as exc:
        raise ProfileError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        byte = exc.object[exc.start : exc.start + 1].hex()
        raise ProfileError(
            f"{what} {path} is not UTF-8 text: byte 0x{byte} at offset {exc.start} "
            "(JSON files must be UTF-8)"
        ) from None


def read_json(path: Path, what: str, schema: Mapping[str, Any] | None = None) -> Any:
    """A JSON file through decode_json: every problem is one ProfileError
    line naming the file (and the key, for a value past a limit)."""
    text = read_text(path, what)
    try:
        return decode_json(text, schema=schema)
    except JsonLimitError as exc:
        raise JsonLimitError(f"{what} {path}: {exc.text}") from None
    except _UndecodableError as exc:
        raise ProfileError(f"{what} {path} is not valid JSON: {exc}") from None


def load_profile(path: Path) -> Profile:
    try:
        data = read_json(path, "board profile")
    except JsonLimitError:
        # a number too large: read again with the schema, to say its key's range
        try:
            schema: Schema | None = load_schema()
        except ProfileError:
            schema = None
        data = read_json(path, "board profile", schema)
    if not isinstance(data, dict):
        raise ProfileError(f"board profile {path} must hold a JSON object, not {_jtype(data)}")
    return data


def load_schema(path: Path | None = None) -> Schema:
    data = read_json(path or schema_path(), "schema")
    if not isinstance(data, dict) or not isinstance(data.get("properties"), dict):
        raise ProfileError(f"schema {path or schema_path()} has no properties")
    return data


def load_costs(path: Path | None = None) -> dict[str, Any]:
    target = path or costs_path()
    try:
        data = read_json(target, "memory cost file")
    except ProfileError as exc:
        raise ProfileError(f"{exc} (run `make measure-memory`)") from None
    if not isinstance(data, dict) or not isinstance(data.get("costs"), dict):
        raise ProfileError(f"memory cost file {target} has no costs (run `make measure-memory`)")
    return data


# ------------------------------------------------------------ validation
def _jtype(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _type_ok(value: Any, want: str) -> bool:
    # Stricter than JSON Schema in one place: 4.0 is not an integer here, since
    # the broker would get a float where it calls bytearray(n) or range(n).
    got = _jtype(value)
    if want == "number":
        return got in ("integer", "number")
    return got == want


def show(value: Any) -> str:
    """A value as it would be written in the profile (JSON)."""
    return json.dumps(value, ensure_ascii=False)


def _unit(sub: Mapping[str, Any]) -> str:
    unit = sub.get("x-unit")
    if isinstance(unit, str) and unit not in ("bool", "enum", "name"):
        return f" {unit}"
    return ""


def secret_key(key: str) -> bool:
    """A key whose value is a credential: a password of any kind (a
    bridge's, the Wi-Fi's, the access point's) or a users entry."""
    last = key.rsplit(".", 1)[-1]
    return "password" in last or key.startswith("users.")


def show_secret(key: str, value: Any) -> str:
    """show(value), except for a credential: its size or type only, so that
    an error line never repeats a password."""
    if not secret_key(key):
        return show(value)
    if isinstance(value, str):
        return f"<{len(value.encode('utf-8'))} bytes, not shown>"
    return f"<{_jtype(value)}, not shown>"


def validate_value(key: str, value: Any, sub: Mapping[str, Any]) -> list[Issue]:
    """Schema checks for one key; every failure is its own Issue."""
    issues: list[Issue] = []
    shown = f"{key} = {show_secret(key, value)}"
    want = sub.get("type")
    if isinstance(want, str) and not _type_ok(value, want):
        issues.append(Issue(key, f"{shown}: must be {_allowed(want, sub)}, not {_jtype(value)}"))
        return issues
    enum = sub.get("enum")
    if isinstance(enum, list) and value not in enum:
        allowed = ", ".join(show(v) for v in enum)
        issues.append(Issue(key, f"{shown}: must be one of {allowed}"))
    if _jtype(value) in ("integer", "number"):
        lo = sub.get("minimum")
        hi = sub.get("maximum")
        span = _range_text(sub)
        if (isinstance(lo, (int, float)) and value < lo) or (
            isinstance(hi, (int, float)) and value > hi
        ):
            issues.append(Issue(key, f"{shown}: must be {span}{_unit(sub)}"))
    if isinstance(value, str):
        n = len(value.encode("utf-8"))
        lo_len = sub.get("minLength")
        hi_len = sub.get("maxLength")
        if isinstance(lo_len, int) and len(value) < lo_len:
            issues.append(Issue(key, f"{shown}: must be at least {lo_len} characters"))
        if isinstance(hi_len, int) and n > hi_len:
            issues.append(Issue(key, f"{shown}: must be at most {hi_len} bytes"))
        pattern = sub.get("pattern")
        if isinstance(pattern, str) and re.search(pattern, value) is None:
            issues.append(Issue(key, f"{shown}: must match {pattern}"))
    if isinstance(value, list):
        issues += _validate_items(key, value, sub)
    if isinstance(value, dict):
        for name in sub.get("required", ()):
            if name not in value:
                issues.append(Issue(f"{key}.{name}", f"{key}.{name}: required"))
        most = sub.get("maxProperties")
        if isinstance(most, int) and len(value) > most:
            issues.append(Issue(key, f"{key}: {len(value)} entries, must be at most {most}"))
        props = sub.get("properties")
        props = props if isinstance(props, dict) else {}
        extra = sub.get("additionalProperties", True)
        for name, item in value.items():
            child = f"{key}.{name}"
            if name in props:
                issues += validate_value(child, item, props[name])
            elif extra is False:
                issues.append(Issue(child, f"{child}: unknown key"))
            elif isinstance(extra, dict):
                issues += validate_value(child, item, extra)
    return issues


def _allowed(want: str, sub: Mapping[str, Any]) -> str:
    """What a key accepts, for a wrong-type message: the type and its range."""
    enum = sub.get("enum")
    if isinstance(enum, list):
        return "one of " + ", ".join(show(v) for v in enum)
    if want == "boolean":
        return "a boolean (true or false)"
    article = "an" if want[0] in "aeiou" else "a"
    if want in ("integer", "number") and ("minimum" in sub or "maximum" in sub):
        return f"{article} {want} in {_range_text(sub)}{_unit(sub)}"
    return f"{article} {want}"


def _validate_items(key: str, value: list[Any], sub: Mapping[str, Any]) -> list[Issue]:
    """An array's length bounds and each item against `items`, named key[i]."""
    issues: list[Issue] = []
    lo = sub.get("minItems")
    hi = sub.get("maxItems")
    if isinstance(lo, int) and len(value) < lo:
        issues.append(Issue(key, f"{key}: {len(value)} items, must be at least {lo}"))
    if isinstance(hi, int) and len(value) > hi:
        issues.append(Issue(key, f"{key}: {len(value)} items, must be at most {hi}"))
    items = sub.get("items")
    if isinstance(items, dict):
        for i, item in enumerate(value):
            issues += validate_value(f"{key}[{i}]", item, items)
    return issues


def _range_text(sub: Mapping[str, Any]) -> str:
    lo = sub.get("minimum")
    hi = sub.get("maximum")
    if lo is not None and hi is not None:
        return f"{_num(lo)}..{_num(hi)}"
    if lo is not None:
        return f">= {_num(lo)}"
    if hi is not None:
        return f"<= {_num(hi)}"
    return "any"


def _num(v: Any) -> str:
    return show(v)


def did_you_mean(key: str, known: Iterable[str]) -> str | None:
    """The known key closest to a misspelt one, if any is close."""
    hint = difflib.get_close_matches(key, list(known), n=1)
    return hint[0] if hint else None


def validate(profile: Mapping[str, Any], schema: Schema) -> list[Issue]:
    """Every schema violation of a profile: unknown keys, types, ranges, enums."""
    props: dict[str, Any] = schema["properties"]
    issues: list[Issue] = []
    for key, value in profile.items():
        sub = props.get(key)
        if sub is None:
            hint = did_you_mean(key, props)
            more = f" (did you mean {hint}?)" if hint else ""
            issues.append(Issue(key, f"{key} = {show(value)}: unknown key{more}"))
            continue
        issues += validate_value(key, value, sub)
    return issues


def defaults(schema: Schema) -> Profile:
    """Every key with its default, in schema order."""
    out: Profile = {}
    for key, sub in schema["properties"].items():
        out[key] = json.loads(json.dumps(sub.get("default")))
    return out


def effective(profile: Mapping[str, Any], schema: Schema) -> Profile:
    """The profile with defaults filled in, in schema order (unknown keys last)."""
    out = defaults(schema)
    for key, value in profile.items():
        out[key] = value
    return out


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON Merge Patch: objects merge recursively, null removes a key."""
    if not isinstance(patch, dict):
        return patch
    result: dict[str, Any] = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# ------------------------------------------------------------- the models
MODEL_TEXT: Final = """\
### Sockets

    max_clients <= sockets - 1 (the listener) - spare_sockets
    backlog     <= sockets - 1

### Code

    code = import cost of lib/edgebroker.py + lib/edgestore.py (lib/edgeram.py when
           storage_type is ram)
           (+ lib/edgeauth.py when users or acl is not empty or allow_anonymous is false)
           (+ lib/edgebridge.py when bridges is not empty)
           .mpy from the filesystem (bytecode in RAM) when romfs is false,
           the ROMFS figure (bytecode in place, module objects in RAM) when romfs is true,
           the frozen figure (module objects only, measured on a Cortex-M
           build: FROZEN_32, scaled by the module's .mpy growth since) when
           frozen is true
           (not lib/edgeconf.py, the profile check, nor lib/edgeopen.py, the flash
           store's open: imported while the broker is built and dropped before it
           serves; counted in the boot peak, start_heap)
    code <= code_budget_bytes
    fs_reserve_bytes >= the .mpy files' size when romfs and frozen are false (they live
                        on the filesystem)

### Heap

The worst case the broker can reach with the profile's counts, with live
messages sized by typical_topic_bytes and typical_payload_bytes (the
broker bounds how many messages it holds, not their size). Every cost is
measured (boards/memory_costs.json, `make measure-memory`) on the 64-bit
MicroPython unix port; for a board with word_bytes 4 a module's .mpy
import is the one measured on the 32-bit port (the 64-bit figures carry the
unix port's qstr pools, which fall to whichever module imports when one
grows), and every other heap cost is scaled by the 32-bit/64-bit ratio of
its kind, measured on the npm
WebAssembly MicroPython (32-bit) and the unix port with the same
in-process script (`costs_32bit`, edgebroker_tools.measure32: about x0.77
for code, x0.5-0.6 for clients, subscriptions and messages; an import
figure by the ratio of all the modules' imports together), or by
278.9/429.8 (x0.649) for a figure of no measured kind; file sizes and the
disc_only index entry (an array('I') word, 4 bytes on every port) are not
scaled. `edgebroker emulate` runs the 64-bit port
with heap_bytes scaled the other way (x1.54) and tests it.

    message   = message_overhead + typical_payload_bytes + typical_topic_bytes
                (a queued or inflight QoS 1/2 message: the queue entry, the message
                tuple, the payload, the topic's bytes)
    q         = max_queued, or 0 when max_queued_total > 0 (the queues are
                counted once, below)
    client    = per_connection
              + max_subscriptions x per_subscription
              + (max_inflight + q + 1 will) x message
              + max(max_outbuf, max_packet_size)
              + max_outbuf                     (output buffer: a delivery goes into an
                                                empty buffer, or one it leaves within
                                                max_outbuf, so deliveries hold at most
                                                max(max_outbuf, one packet); acks
                                                and ping responses have max_outbuf more;
                                                a client past it all is closed)
              + max_packet_size                (an inbound packet still incomplete)
    session   = per_offline_session + max_subscriptions x per_subscription
              + (max_inflight + q) x message
    queues    = min(max_queued_total, (max_clients + max_sessions) x max_queued)
                x message                      (when max_queued_total > 0)
    retained  = ram, disc:  store fixed + n x overhead
                            + min(store_budget_bytes, n x (max_payload_size + max_topic_length))
                disc_only:  store fixed + n x per_message (the index only, preallocated
                            for n at open; x2 when max_retained_messages is 0 or
                            16,384 or more: wide entries)
                n = max_retained_messages (0: store_budget_bytes / 2, every message at
                least 2 bytes)
    heap      = code
              + broker_idle + sys_retained (+ 6 refusal topics) when sys_interval > 0
              + io_chunk
              + 2 x max_packet_size            (the packet being parsed: assembly + payload copy)
              + max_clients x client
              + max_sessions x session
              + queues
              + retained
              + heap_reserve
              + bridges                        (each: BRIDGE_FIXED 8192 + 2 x max_packet_size
                                                + (latest_topics + max_inflight) x 8
                                                + 40960 with tls)
    heap <= heap_bytes
    bridges: at most 1 when heap_bytes < 1 MB (one TLS client is what such a board affords)

### Flash (storage_type disc and disc_only)

The store appends records and compacts when dead bytes pass compact_ratio
of the file (lib/edgestore.py, commit()), so just before a compaction the
file holds live / (1 - compact_ratio) bytes, and the compaction writes a
second copy of the live records to <file>.new before the rename.

    live   = 8 (header) + store_budget_bytes + n x 29 (record headers) + 17 (clock record)
    file   = max(live / (1 - compact_ratio), compact_min_bytes + live)
             + max_clients x (io_chunk + max_packet_size)   (one loop's writes before the check)
    peak   = file + live (.new) + 2 x 4096 (littlefs blocks)
    peak + fs_reserve_bytes <= fs_bytes
    store_budget_bytes > 0

### Flash, bridges (any storage_type)

Each bridge's queue file data/bridge-<name>.ebrq is compacted by the same
rule (compact_ratio, compact_min_bytes), and while messages are still queued
only once min(queue_bytes / 8, 1 MB, queue_bytes x compact_ratio) bytes
are dead (a link that keeps up does not rewrite the file every few KB; a
drained queue is emptied at compact_min_bytes). Counted with the store's
peak:

    queue  = max(queue_bytes / (1 - compact_ratio), compact_min_bytes + queue_bytes)
             + queue_bytes (.new)
"""


def _cost(costs: Mapping[str, Any], *path: str) -> int:
    node: Any = costs["costs"]
    for part in path:
        if not isinstance(node, dict) or part not in node:
            raise ProfileError(
                f"memory cost file has no {'.'.join(path)} (run `make measure-memory`)"
            )
        node = node[part]
    if not isinstance(node, int):
        raise ProfileError(f"memory cost {'.'.join(path)} is not an integer")
    return node


#: Heap a frozen module's import keeps on a 32-bit port: its module objects
#: (globals, a function object per def, the classes, module-level tables);
#: its bytecode, strings and names stay in flash. Measured on MicroPython's
#: Cortex-M qemu port (v1.29.0-preview, commit 1c3c201, MPS2_AN385), the
#: modules frozen in with firmware/freeze/manifest.py, gc.mem_alloc() around
#: each import, 2026-11-26 (docs/boards.md). No port from a registry can
#: freeze a module, so `make measure-memory` cannot remeasure them: each is
#: kept with the module's .mpy size of that day, and `config check` scales it
#: by how that .mpy (measured with every other cost) has grown since.
FROZEN_32: Final = {
    # module: (bytes kept, .mpy bytes then)
    "edgebroker": (6368, 34804),
    "edgestore": (2464, 11217),
    "edgeram": (560, 1744),
    "edgeauth": (256, 1747),
    "edgebridge": (3152, 19094),
    "edgeconf": (848, 2756),
    "edgeopen": (704, 4026),
}


def code_cost(cfg: Mapping[str, Any], costs: Mapping[str, Any], module: str) -> int:
    """The heap one module's import keeps, the way the profile loads code:
    frozen into the firmware, from a ROMFS image, or as .mpy in RAM."""
    if cfg.get("frozen") is True:
        kept, then = FROZEN_32[module]
        scale = _cost(costs, "mpy_file_bytes", module) / then
        if int(cfg["word_bytes"]) == 8:
            scale /= WORD4_PER_WORD8
        return round(kept * scale)
    return _cost(costs, "import_romfs" if cfg["romfs"] else "import_mpy", module)


def code_where(cfg: Mapping[str, Any]) -> str:
    """How the profile's code is loaded, in a few words."""
    if cfg.get("frozen") is True:
        return "frozen"
    return "ROMFS" if cfg["romfs"] else ".mpy in RAM"


def code_in_place(cfg: Mapping[str, Any]) -> bool:
    """The bytecode runs from flash (ROMFS or frozen): nothing is copied
    into the heap at import and lib/*.mpy take no filesystem space."""
    return bool(cfg["romfs"]) or cfg.get("frozen") is True


#: Bytes a 32-bit MicroPython uses for what the 64-bit unix port uses one
#: byte for, on average: 278.9 B against 429.8 B per object, the same on four
#: 32-bit builds (unix port, Cortex-M qemu, ESP32 v1.16, the npm WebAssembly
#: port). Used for a figure of no measured kind (costs_32bit below).
WORD4_PER_WORD8: Final = 278.9 / 429.8
#: Cost entries that are file sizes, not heap: never scaled.
_FILE_SIZES: Final = ("mpy_file_bytes", "image_bytes")
#: Figures that are the same on every port by construction, never scaled:
#: the disc_only index entry is an array('I') word, 4 bytes on 32 and 64
#: bits (4.00 B a message on a 32-bit unix port between stores of 256 and
#: 5,000, docs/boards.md). The WebAssembly port's reading of it (4.0 since
#: its stores are filled a step at a time; 4.0-5.6 before, garbage pinned
#: by one long step) is recorded, not used.
_WORD_SIZE_FREE: Final = ("retained.disc_only.per_message",)
#: Which measured 32-bit ratio (memory_costs.json "costs_32bit", made by
#: edgebroker_tools.measure32 on the npm WebAssembly MicroPython) scales a
#: 64-bit figure: its own kind where measured (import_mpy.edgebroker,
#: per_connection, message_overhead, ...), every import figure of a module by
#: that module's import ratio, and these by a kind alike. An overhead (a
#: message beyond its payload and topic bytes) has a ratio of its own, not
#: its total's: the bytes of payload and topic do not shrink on 32 bits.
_ALIKE: Final = {
    "import_mpy_firmware.gateway": "import_mpy.edgebroker",
    "import_mpy_firmware.gwboot": "import_mpy.edgebroker",
    "broker_idle": "engine_idle",
    "per_queued_message_256": "per_queued_message",
    "retained.disc.per_message": "retained.ram.per_message",
    "retained.disc.overhead": "retained.ram.overhead",
}
_IMPORT_FIGURES: Final = ("import_py", "import_romfs", "min_heap_import_mpy", "min_heap_import_py")


def ratio_32(costs: Mapping[str, Any], path: str) -> float:
    """The measured 32-bit/64-bit ratio for a figure path, or WORD4_PER_WORD8.
    An import figure of any module takes the ratio of all the modules'
    imports together: the qstr pool grows by doubling, and each growth falls
    to whichever module imports then, on each port at another module
    (a module's own ratio was seen anywhere from 0.36 to 1.1; the sum's
    stays at 0.75-0.76)."""
    figures = costs.get("costs_32bit", {}).get("figures", {})
    head = path.partition(".")[0]
    if head in _IMPORT_FIGURES:
        b32 = b64 = 0.0
        for k, v in figures.items():
            if k.startswith("import_mpy.") and isinstance(v, dict):
                b32 += float(v.get("bytes_32", 0))
                b64 += float(v.get("bytes_64", 0))
        return b32 / b64 if b32 > 0 and b64 > 0 else WORD4_PER_WORD8
    ratio = figures.get(_ALIKE.get(path, path), {}).get("ratio")
    return float(ratio) if isinstance(ratio, int | float) and ratio > 0 else WORD4_PER_WORD8


def for_word_size(costs: Mapping[str, Any], cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The costs as a board with cfg's word_bytes pays them: the 64-bit
    figures as measured for 8; for 4, a module's .mpy import as measured on
    the 32-bit port (costs_32bit: the 64-bit socket-level figures of the
    modules carry the unix port's qstr pools, which grow by doubling and
    fall to whichever module is importing then: 5-7 KB moved between
    modules), every other figure scaled by its kind's measured 32-bit ratio
    (ratio_32), else by WORD4_PER_WORD8."""
    if int(cfg.get("word_bytes", 4)) == 8:
        return costs
    figures = costs.get("costs_32bit", {}).get("figures", {})

    def scale(node: Any, path: str) -> Any:
        if isinstance(node, dict):
            return {
                k: (v if k in _FILE_SIZES else scale(v, f"{path}.{k}" if path else k))
                for k, v in node.items()
            }
        if isinstance(node, int) and not isinstance(node, bool):
            if path in _WORD_SIZE_FREE:
                return node
            direct = (
                figures.get(path, {}).get("bytes_32") if path.startswith("import_mpy.") else None
            )
            if isinstance(direct, int | float) and direct > 0:
                return round(direct)
            return round(node * ratio_32(costs, path))
        return node

    out = dict(costs)
    out["costs"] = scale(costs["costs"], "")
    return out


def needs_auth(cfg: Mapping[str, Any]) -> bool:
    """Whether the profile loads edgeauth (passwords and topic ACLs): the
    rule of edgebroker's _auth_needed(), on a profile whose keys may be
    missing (a missing key has the broker's default)."""
    return bool(cfg.get("users")) or bool(cfg.get("acl")) or cfg.get("allow_anonymous") is False


def shipped_modules(cfg: Mapping[str, Any]) -> list[str]:
    """Every module the board gets for this profile, in import order:
    modules_for() and the boot-only ones, which a board imports while the
    broker is built and drops before it serves: edgeconf, the profile check
    (edgebroker.load_modules drops it), right after edgebroker, and for a
    flash store edgeopen, its file reader and open (FlashStore._open drops
    it), last. They are counted in the boot peak (start_heap) and the
    files, not in the code the running broker keeps (heap_breakdown)."""
    mods = modules_for(cfg)
    out = [mods[0], "edgeconf", *mods[1:]]
    return [*out, "edgeopen"] if "edgestore" in mods else out


def modules_for(cfg: Mapping[str, Any]) -> list[str]:
    """The modules the running broker keeps (its code heap), in import order."""
    mods = ["edgebroker", "edgeram" if cfg["storage_type"] == "ram" else "edgestore"]
    if needs_auth(cfg):
        mods.append("edgeauth")
    return [*mods, "edgebridge"] if _bridges(cfg) else mods


def retained_count(cfg: Mapping[str, Any]) -> int | None:
    """How many retained messages the store can hold, or None when unbounded."""
    n = int(cfg["max_retained_messages"])
    if n:
        return n
    budget = int(cfg["store_budget_bytes"])
    return budget // 2 if budget else None


def heap_breakdown(cfg: Mapping[str, Any], costs: Mapping[str, Any]) -> list[HeapItem]:
    """The worst-case heap of an effective profile, item by item (MODEL_TEXT, Heap)."""
    items: list[HeapItem] = []
    mods = modules_for(cfg)
    code = sum(code_cost(cfg, costs, m) for m in mods)
    items.append(HeapItem("code", code, f"{' + '.join(mods)} ({code_where(cfg)})"))

    idle = _cost(costs, "broker_idle")
    if cfg["sys_interval"]:
        sys_set = _cost(costs, "sys_retained")
        per_topic = -(-sys_set // 10)
        idle += sys_set + SYS_REFUSAL_TOPICS * per_topic
        items.append(HeapItem("broker", idle, "idle broker + $SYS retained set"))
    else:
        items.append(HeapItem("broker", idle, "idle broker ($SYS off)"))
    items.append(HeapItem("io_chunk", int(cfg["io_chunk"]), "shared receive buffer"))
    packet = int(cfg["max_packet_size"])
    items.append(HeapItem("parsing", 2 * packet, "2 x max_packet_size"))

    msg = (
        _cost(costs, "message_overhead")
        + int(cfg["typical_payload_bytes"])
        + int(cfg["typical_topic_bytes"])
    )
    subs = int(cfg["max_subscriptions"]) * _cost(costs, "per_subscription")
    total = int(cfg["max_queued_total"])
    per_q = 0 if total else int(cfg["max_queued"])
    window = int(cfg["max_inflight"]) + per_q
    client = (
        _cost(costs, "per_connection")
        + subs
        + (window + 1) * msg
        + max(int(cfg["max_outbuf"]), packet)
        + int(cfg["max_outbuf"])
        + packet
    )
    n_clients = int(cfg["max_clients"])
    items.append(
        HeapItem(
            "clients",
            n_clients * client,
            f"{n_clients} x {client} (connection, {cfg['max_subscriptions']} subscriptions, "
            f"{window + 1} messages of {msg}, output buffer, inbound packet)",
        )
    )
    session = _cost(costs, "per_offline_session") + subs + window * msg
    n_sessions = int(cfg["max_sessions"])
    items.append(
        HeapItem(
            "sessions",
            n_sessions * session,
            f"{n_sessions} offline x {session} (subscriptions, {window} messages)",
        )
    )
    if total:
        n_q = min(total, (n_clients + n_sessions) * int(cfg["max_queued"]))
        what = f"{n_q} queued messages of {msg}, all sessions (max_queued_total)"
        items.append(HeapItem("queues", n_q * msg, what))

    store = str(cfg["storage_type"])
    n = retained_count(cfg)
    if not cfg["retain_available"]:
        items.append(HeapItem("retained", 0, "retain_available is false"))
    elif n is None:
        items.append(HeapItem("retained", 0, "unbounded (see errors)"))
    elif store == "disc_only":
        cap = int(cfg["max_retained_messages"])
        slots = n if 0 < cap < INDEX_PREALLOC else max(n, INDEX_PREALLOC)
        fixed = _cost(costs, "retained", store, "fixed")
        per = _cost(costs, "retained", store, "per_message")
        if not 0 < cap < INDEX_PREALLOC:
            per *= 2  # wide entries (array 'Q'): no limit, or 16,384 and more
        items.append(
            HeapItem(
                "retained",
                fixed + slots * per,
                f"fixed {fixed} + index of {slots} entries x {per} ({store})",
            )
        )
    else:
        fixed = _cost(costs, "retained", store, "fixed")
        over = _cost(costs, "retained", store, "overhead")
        topic = int(cfg["max_topic_length"])
        data = n * (int(cfg["max_payload_size"]) + topic)
        budget = int(cfg["store_budget_bytes"])
        if budget:
            data = min(data, budget)
        total = fixed + n * over + data
        items.append(
            HeapItem(
                "retained",
                total,
                f"fixed {fixed} + {n} messages x {over} + {data} data bytes, in RAM ({store})",
            )
        )
    for b in _bridges(cfg):
        per = (
            BRIDGE_FIXED
            + 2 * packet
            + (int(b.get("latest_topics", 256)) + int(b.get("max_inflight", 16)))
            * BRIDGE_INDEX_ENTRY
        )
        tls = BRIDGE_TLS if b.get("tls") else 0
        items.append(
            HeapItem(
                f"bridge {b.get('name')}",
                per + tls,
                "link, buffers, index" + (" + one TLS client" if tls else ""),
            )
        )
    items.append(HeapItem("heap_reserve", int(cfg["heap_reserve"]), "kept free"))
    return items


def start_heap(cfg: Mapping[str, Any], costs: Mapping[str, Any]) -> int:
    """The smallest MicroPython heap the broker's build imports and listens
    in (measured costs): the import peak of the .mpy modules, or the code
    kept plus the idle broker, its receive buffer and the empty flash store,
    whichever is larger.
    With romfs or frozen the bytecode runs in place (emulate adds the image
    itself)."""
    mods = modules_for(cfg)
    idle = _cost(costs, "broker_idle") + int(cfg["io_chunk"])
    store = str(cfg["storage_type"])
    if store != "ram" and cfg["retain_available"]:
        idle += _cost(costs, "retained", store, "fixed")  # the store opens before listen()
        if store == "disc_only":
            n = retained_count(cfg) or INDEX_PREALLOC
            idle += min(n, INDEX_PREALLOC) * _cost(costs, "retained", store, "per_message")
    if code_in_place(cfg):
        return sum(code_cost(cfg, costs, m) for m in mods) + idle
    peak = 0
    kept = 0
    for m in mods:
        peak = max(peak, kept + _cost(costs, "min_heap_import_mpy", m))
        kept += _cost(costs, "import_mpy", m)
        if m == "edgebroker":
            # the profile is checked (edgeconf), then dropped
            peak = max(peak, kept + _cost(costs, "min_heap_import_mpy", "edgeconf"))
    if "edgestore" in mods:
        # the flash store opens (edgeopen) with its index made, then drops it
        peak = max(peak, kept + idle + _cost(costs, "min_heap_import_mpy", "edgeopen"))
    return max(peak, kept + idle)


def _bridges(cfg: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    raw = cfg.get("bridges")
    return [b for b in raw if isinstance(b, dict)] if isinstance(raw, list) else []


def bridge_flash(cfg: Mapping[str, Any]) -> list[HeapItem]:
    """Peak flash of the bridges' queue files (MODEL_TEXT, Flash, bridges)."""
    ratio = float(cfg["compact_ratio"])
    out = []
    for b in _bridges(cfg):
        q = int(b.get("queue_bytes", 1048576))
        grown = max(math.ceil(q / (1 - ratio)), int(cfg["compact_min_bytes"]) + q)
        out.append(HeapItem(f"bridge {b.get('name')}", grown + q, "queue file + .new copy"))
    return out


def flash_breakdown(cfg: Mapping[str, Any]) -> list[HeapItem]:
    """Peak filesystem use of the flash store (MODEL_TEXT, Flash); [] for ram."""
    if cfg["storage_type"] == "ram":
        return []
    n = retained_count(cfg) or 0
    live = FILE_HEADER + int(cfg["store_budget_bytes"]) + n * PUT_OVERHEAD + CLOCK_RECORD
    ratio = float(cfg["compact_ratio"])
    by_ratio = math.ceil(live / (1 - ratio))
    floor = int(cfg["compact_min_bytes"])
    grown = max(by_ratio, floor + live)
    how = (
        f"live {live} / (1 - {ratio}) before compaction"
        if by_ratio >= floor + live
        else f"compact_min_bytes {floor} + live {live} before compaction"
    )
    group = int(cfg["max_clients"]) * (int(cfg["io_chunk"]) + int(cfg["max_packet_size"]))
    return [
        HeapItem("file", grown, how),
        HeapItem("writes", group, "one loop's writes before the compaction check"),
        HeapItem(".new", live, "compaction copy"),
        HeapItem("blocks", 2 * FS_BLOCK, "littlefs block rounding"),
        HeapItem("fs_reserve_bytes", int(cfg["fs_reserve_bytes"]), "code, firmware, profile"),
    ]


#: The least heap_bytes a profile with a TLS listener (tls_cert) may have.
TLS_MIN_HEAP: Final = 200_000


def check_profile(
    profile: Mapping[str, Any],
    schema: Schema,
    costs: Mapping[str, Any] | None,
    name: str = "",
) -> Report:
    """Schema validation plus every cross-key check; all issues, not just the first."""
    cfg = effective(profile, schema)
    board = name or str(cfg.get("board"))
    report = Report(board, cfg)
    if costs is not None and cfg.get("word_bytes") in (4, 8):
        costs = for_word_size(costs, cfg)
    report.issues += validate(profile, schema)
    # the cross checks run on well-typed values: a check is skipped when a key
    # it reads failed the schema (unknown keys do not matter to them)
    bad = {i.key.split(".")[0] for i in report.errors} & set(schema["properties"])

    def ok(*keys: str) -> bool:
        return not bad.intersection(keys)

    on = f" on {board}"

    # -- sockets
    if ok("max_clients", "sockets", "spare_sockets"):
        sockets = int(cfg["sockets"])
        spare = int(cfg["spare_sockets"])
        room = sockets - 1 - spare
        if cfg["max_clients"] > room:
            report.error(
                "max_clients",
                f"max_clients = {cfg['max_clients']}: must be <= {room} "
                f"(sockets {sockets} - listener 1 - spare {spare}){on}",
            )
    if ok("backlog", "sockets") and cfg["backlog"] > cfg["sockets"] - 1:
        report.error(
            "backlog",
            f"backlog = {cfg['backlog']}: must be <= {cfg['sockets'] - 1} "
            f"(sockets {cfg['sockets']} - listener 1){on}",
        )

    # -- TLS: mbedTLS needs about 40 KB of heap for one handshake
    if ok("tls_cert", "heap_bytes") and cfg.get("tls_cert") and cfg["heap_bytes"] < TLS_MIN_HEAP:
        report.error(
            "tls_cert",
            f"tls_cert = {show(cfg['tls_cert'])}: a TLS listener needs heap_bytes >= "
            f"{TLS_MIN_HEAP} (a handshake takes about 40 KB); heap_bytes is "
            f"{cfg['heap_bytes']}{on} (a board with PSRAM, e.g. esp32s3)",
        )

    # -- client certificates are asked for only by a TLS listener (tls_cert):
    # without one the broker would listen in plain text and never use the CA
    if ok("tls_client_ca", "tls_cert") and cfg.get("tls_client_ca") and not cfg.get("tls_cert"):
        report.error(
            "tls_client_ca",
            f"tls_client_ca = {show(cfg['tls_client_ca'])}: needs tls_cert (client "
            f"certificates are checked only by a TLS listener); tls_cert is empty{on}",
        )
    # -- a key without its certificate would be silently unused the same way
    if ok("tls_key", "tls_cert") and cfg.get("tls_key") and not cfg.get("tls_cert"):
        report.error(
            "tls_key",
            f"tls_key = {show(cfg['tls_key'])}: needs tls_cert (the key of the TLS "
            f"listener's certificate); tls_cert is empty{on}",
        )

    # -- sizes that must be consistent
    if (
        ok("typical_topic_bytes", "max_topic_length")
        and cfg["typical_topic_bytes"] > cfg["max_topic_length"]
    ):
        report.error(
            "typical_topic_bytes",
            f"typical_topic_bytes = {cfg['typical_topic_bytes']}: must be <= "
            f"max_topic_length {cfg['max_topic_length']}",
        )
    if (
        ok("typical_topic_bytes", "typical_payload_bytes", "max_packet_size")
        and cfg["typical_topic_bytes"] + cfg["typical_payload_bytes"] + 7 > cfg["max_packet_size"]
    ):
        report.error(
            "typical_payload_bytes",
            f"typical_payload_bytes = {cfg['typical_payload_bytes']}: a typical message "
            f"(+ topic {cfg['typical_topic_bytes']} + 7 header bytes) must fit "
            f"max_packet_size {cfg['max_packet_size']}",
        )
    if (
        ok("retain_available", "max_payload_size", "max_packet_size")
        and cfg["retain_available"]
        and cfg["max_payload_size"] > cfg["max_packet_size"]
    ):
        report.warn(
            "max_payload_size",
            f"max_payload_size = {cfg['max_payload_size']}: larger than max_packet_size "
            f"{cfg['max_packet_size']}, so no retained payload can reach it",
        )
    if ok("users"):
        check_users(report, cfg["users"], "users")
    if ok("bind", "allow_anonymous"):
        exposed = open_to_network(str(cfg["bind"]), cfg)
        if exposed is not None:
            report.issues.append(exposed)
    if ok("watchdog_ms") and 0 < int(cfg["watchdog_ms"]) < 1000:
        report.error(
            "watchdog_ms",
            f"watchdog_ms = {cfg['watchdog_ms']}: must be 0 (off) or >= 1000 "
            "(the loop feeds it once a second)",
        )

    if ok("acl") and not any(i.key.startswith("acl") for i in report.errors):
        _check_acl(report, cfg)
    if ok("bridges"):
        _check_bridges(report, cfg, on)

    if bad:
        report.notes.append("code, flash and heap checks skipped until the errors above are fixed")
        return report
    if costs is None:
        report.notes.append("no memory cost file: heap and code checks skipped")
        return report
    _check_code(report, cfg, costs, on)
    _check_flash(report, cfg, on)
    _check_heap(report, cfg, costs, on)
    return report


def _check_bridges(report: Report, cfg: Profile, on: str) -> None:
    bridges = _bridges(cfg)
    if len(bridges) > 1 and int(cfg["heap_bytes"]) < BRIDGE_SMALL_HEAP:
        report.error(
            "bridges",
            f"bridges: {len(bridges)} bridges, at most 1 with heap_bytes "
            f"{cfg['heap_bytes']} < {BRIDGE_SMALL_HEAP}{on}",
        )
    names = [b.get("name") for b in bridges]
    for i, name in enumerate(names):
        if name in names[:i]:
            report.error(f"bridges[{i}].name", f"bridges[{i}].name = {show(name)}: used twice")
    for i, b in enumerate(bridges):
        if int(b.get("retry_min", 1)) > int(b.get("retry_max", 60)):
            report.error(
                f"bridges[{i}].retry_min",
                f"bridges[{i}].retry_min = {b.get('retry_min')}: must be <= retry_max "
                f"{b.get('retry_max', 60)}",
            )
    if not any(i.key.startswith("bridges") for i in report.errors):
        # what the schema cannot say (topic filters under their prefixes):
        # the broker's own check, so that nothing it would refuse at start
        # passes here
        try:
            runner.lib_module("edgebridge").check(list(bridges), str(cfg.get("board", "")))
        except ValueError as exc:
            key = str(exc).split(":", 1)[0]
            report.error(key, f"{exc}{on}")


#: What an acl rule's topic may be (lib/edgeauth.py check_acl, with
#: lib/edgebroker.py valid_filter).
ACL_TOPIC_ALLOWED: Final = (
    "must be a topic filter (+ and # only as a whole level, # only as the last one; "
    "%u and %c stand for the user name and the client id)"
)


def _check_acl(report: Report, cfg: Profile) -> None:
    """What the schema cannot say about the acl (a topic that is not a
    topic filter): the broker's own check, so that no acl it would refuse at
    start passes here."""
    rules = cfg.get("acl")
    if not isinstance(rules, list) or not rules:
        return
    try:
        runner.lib_module("edgeauth").check_acl(list(rules))
    except ValueError as exc:
        key = str(exc).split(":", 1)[0]
        m = re.fullmatch(r"acl\[([0-9]+)\]\.topic", key)
        if m and int(m.group(1)) < len(rules) and isinstance(rules[int(m.group(1))], dict):
            topic = rules[int(m.group(1))].get("topic")
            report.error(key, f"{key} = {show(topic)}: {ACL_TOPIC_ALLOWED}")
        else:
            report.error(key, str(exc))


def _check_code(report: Report, cfg: Profile, costs: Mapping[str, Any], on: str) -> None:
    mods = modules_for(cfg)
    if cfg["romfs"] and cfg.get("frozen") is True:
        report.error(
            "frozen",
            f"frozen = true: romfs is true too{on}; choose one (frozen modules are found "
            "before a ROMFS image's, which would then only take flash)",
        )
    parts = [(m, code_cost(cfg, costs, m)) for m in mods]
    code = sum(c for _, c in parts)
    budget = int(cfg["code_budget_bytes"])
    if code > budget:
        detail = " + ".join(f"{m} {c}" for m, c in parts)
        where = {"frozen": "frozen", "ROMFS": "from ROMFS"}.get(
            code_where(cfg), "as .mpy in RAM (romfs false)"
        )
        report.error(
            "code_budget_bytes",
            f"code_budget_bytes = {budget}: must be >= {code}, the code {where} ({detail}){on}",
        )
    if not code_in_place(cfg):
        files = [(m, _cost(costs, "mpy_file_bytes", m)) for m in shipped_modules(cfg)]
        size = sum(c for _, c in files)
        if cfg["fs_reserve_bytes"] < size:
            report.error(
                "fs_reserve_bytes",
                f"fs_reserve_bytes = {cfg['fs_reserve_bytes']}: must be >= {size}, the .mpy "
                f"files on the filesystem (romfs false){on}",
            )
        if cfg["fs_bytes"] < cfg["fs_reserve_bytes"]:
            report.error(
                "fs_bytes",
                f"fs_bytes = {cfg['fs_bytes']}: must be >= fs_reserve_bytes "
                f"{cfg['fs_reserve_bytes']}{on}",
            )
    # importing needs more than what stays: the first module's load peak
    peak = 0
    kept = 0
    for m in mods:
        need = kept + _cost(costs, "min_heap_import_mpy", m)
        peak = max(peak, need)
        kept += _cost(costs, "import_mpy", m)
    if not code_in_place(cfg) and peak > cfg["heap_bytes"]:
        report.error(
            "heap_bytes",
            f"heap_bytes = {cfg['heap_bytes']}: importing the .mpy build needs {peak}{on}",
        )


def _check_flash(report: Report, cfg: Profile, on: str) -> None:
    if cfg["storage_type"] == "ram" or not cfg["retain_available"]:
        queues = bridge_flash(cfg)
        if queues:
            reserve = HeapItem("fs_reserve_bytes", int(cfg["fs_reserve_bytes"]), "code, firmware")
            report.flash = [*queues, reserve]
            need = report.flash_total
            if need > int(cfg["fs_bytes"]):
                report.error(
                    "bridges",
                    f"bridges: the queue files' flash peak + fs_reserve_bytes = {need} must "
                    f"be <= fs_bytes {cfg['fs_bytes']}{on} (lower queue_bytes)",
                )
        return
    store = cfg["storage_type"]
    if not cfg["store_budget_bytes"]:
        report.error(
            "store_budget_bytes",
            f"store_budget_bytes = 0: must be > 0 with storage_type {show(store)} "
            f"(0 = no limit: the store could fill the filesystem)",
        )
        return
    report.flash = flash_breakdown(cfg) + bridge_flash(cfg)
    need = report.flash_total
    fs = int(cfg["fs_bytes"])
    if need > fs and bridge_flash(cfg):
        report.error(
            "bridges",
            f"bridges: the store's and the queue files' flash peak + fs_reserve_bytes = "
            f"{need} must be <= fs_bytes {fs}{on} (lower queue_bytes or store_budget_bytes)",
        )
    elif need > fs:
        store_part = need - int(cfg["fs_reserve_bytes"])
        ratio = float(cfg["compact_ratio"])
        report.error(
            "store_budget_bytes",
            f"store_budget_bytes = {cfg['store_budget_bytes']}: the store's flash peak "
            f"{store_part} (live / (1 - compact_ratio {ratio}) + .new copy) + fs_reserve_bytes "
            f"{cfg['fs_reserve_bytes']} = {need} must be <= fs_bytes {fs}{on}",
        )


def _check_heap(report: Report, cfg: Profile, costs: Mapping[str, Any], on: str) -> None:
    if cfg["retain_available"] and retained_count(cfg) is None:
        report.error(
            "max_retained_messages",
            "max_retained_messages = 0 and store_budget_bytes = 0: the retained store is "
            "unbounded; set either",
        )
    report.heap = heap_breakdown(cfg, costs)
    total = report.heap_total
    heap = int(cfg["heap_bytes"])
    if total > heap:
        big = sorted(report.heap, key=lambda i: -i.bytes)[:3]
        top = ", ".join(f"{i.name} {i.bytes}" for i in big)
        hint = ""
        if not code_in_place(cfg) and int(cfg["word_bytes"]) == 4:
            # the code is the largest item of a small board: say what a
            # firmware with the broker frozen in would leave
            frozen = sum(i.bytes for i in heap_breakdown(dict(cfg, frozen=True), costs))
            if frozen <= heap:
                hint = (
                    f"; with the broker frozen into the firmware (frozen: true, "
                    f"firmware/freeze/manifest.py) it would be {frozen}"
                )
        report.error(
            "heap_bytes",
            f"heap_bytes = {heap}: the worst-case heap is {total}, {total - heap} over{on} "
            f"(largest: {top}; lower max_clients, max_subscriptions, max_inflight, "
            f"max_queued (or set max_queued_total), max_sessions or the retained limits"
            f"{hint})",
        )
    lib = runner.repo_root() / "lib"
    measured = costs.get("lib_sha256")
    if isinstance(measured, dict):
        import hashlib

        for fname, digest in measured.items():
            f = lib / str(fname)
            if f.is_file() and hashlib.sha256(f.read_bytes()).hexdigest() != digest:
                report.notes.append(
                    f"memory costs were measured for another lib/{fname}: "
                    "`make measure-memory` refreshes them"
                )


#: Addresses that listen on every interface.
ANY_ADDRESS: Final = frozenset({"0.0.0.0", "::", ""})


def open_to_network(bind: str, cfg: Mapping[str, Any]) -> Issue | None:
    """The warning for a broker on every interface that lets anyone in."""
    if bind not in ANY_ADDRESS or cfg.get("allow_anonymous") is not True:
        return None
    return Issue(
        "allow_anonymous",
        f"allow_anonymous = true with bind {show(bind)}: any client that reaches the "
        "network can connect without a password; set allow_anonymous false and add "
        "users (`edgebroker passwd USER`), or bind one address",
        "warning",
    )


def host_warnings(report: Report, bind: str) -> list[Issue]:
    """The check's warnings for a broker run on this machine (`run`,
    `emulate`): the profile's bind is the board's, the tools' --bind is used
    here, so the open-to-the-network warning is made for that one instead."""
    out = [i for i in report.warnings if i.key != "allow_anonymous"]
    exposed = open_to_network(bind, report.profile)
    if exposed is not None:
        out.append(exposed)
    return out


def check_secret_bridges(secrets: Any, profile: Mapping[str, Any]) -> str | None:
    """The "bridges" map of a secrets file ({"<bridge name>": {"username",
    "password"}} for bridges the profile has), checked by the broker's own
    merge (lib/edgebroker.py with_secrets()): one line naming the key when
    it is wrong, else None."""
    edgebroker = runner.lib_module("edgebroker")
    try:
        merged = edgebroker.with_secrets(dict(profile), {"bridges": secrets.get("bridges")})
    except ValueError as exc:
        return str(exc).removeprefix("secrets ")
    # the merged credentials are held to the profile's own bounds (a
    # password over the schema's 256 bytes passed here, and not in a profile)
    item = load_schema()["properties"]["bridges"]["items"]["properties"]
    bridges = merged.get("bridges") if isinstance(merged, dict) else None
    for i, b in enumerate(bridges if isinstance(bridges, list) else []):
        for k in ("username", "password"):
            if isinstance(b, dict) and k in b and k in item:
                issues = validate_value(f"bridges[{i}].{k}", b[k], item[k])
                if issues:
                    return issues[0].text
    return None


def check_merged_users(report: Report, users: Any, profile: Mapping[str, Any]) -> None:
    """A secrets file's users join the profile's (with_secrets): together
    they are held to the schema's bound on users, which each one alone
    passes."""
    if not isinstance(users, dict):
        return
    own = profile.get("users")
    names = set(users) | (set(own) if isinstance(own, dict) else set())
    most = int(load_schema()["properties"]["users"]["maxProperties"])
    if len(names) > most:
        report.error(
            "users",
            f"users: {len(names)} with the profile's, must be at most {most} "
            "(the profile's and the secrets file's together)",
        )


def check_users(report: Report, users: Any, where: str) -> None:
    """Each password entry: pbkdf2 well formed (error), bare sha256 (error),
    plain text (warning). Messages never repeat a password."""
    if not isinstance(users, dict):
        return
    for name, entry in users.items():
        key = f"{where}.{name}"
        if not isinstance(entry, str):
            continue  # the schema reports the type
        what = passwords.kind(entry)
        if what == "sha256":
            report.error(
                key,
                f'{key} = "sha256:...": an unsalted sha256 hash is not accepted; '
                f"make a salted entry with `edgebroker passwd {name}`",
            )
        elif what == "pbkdf2":
            try:
                passwords.parse_entry(entry)
            except ValueError as exc:
                report.error(key, f'{key} = "{passwords.SCHEME}:...": {exc}')
        else:
            report.warn(
                key,
                f"{key}: plain-text password; store it salted with "
                f"`edgebroker passwd {name} --file FILE`",
            )


def parse_override(item: str, schema: Mapping[str, Any] | None = None) -> tuple[str, Any]:
    """One `--set key=value`: the value is JSON if it parses, else the string
    (as lib/edgebroker.py reads it). JSON past the reader's limits (nested
    too deep, a number too large) is refused in one line naming the key and,
    from schema (the profile schema's properties) when given, its range."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ProfileError(f"invalid --set {_abbrev(item, 40)!r}: expected key=value")
    try:
        value: Any = decode_json(text, key, schema.get(key) if schema else None)
    except JsonLimitError as exc:
        raise ProfileError(f"--set {exc.text}") from None
    except _UndecodableError:
        value = text
    return key, value


@dataclass(frozen=True)
class Checked:
    """A profile that passed `config check`: its file, name, content (with the
    --set overrides, as the broker or board gets it) and the check's report
    (report.profile is the effective profile, defaults filled in)."""

    path: Path
    name: str
    profile: Profile
    report: Report


def load_checked(
    spec: str,
    overrides: Iterable[str] = (),
    extra: Mapping[str, Any] | None = None,
) -> Checked:
    """Resolve, read, apply overrides (then extra), and run check_profile,
    the checker of `config check`. Any error raises ProfileError with one
    line naming each failing key, its value and the allowed range."""
    path = resolve_board(spec)
    profile = load_profile(path)
    schema = load_schema()
    sets = list(overrides)
    for item in sets:
        key, value = parse_override(item, schema["properties"])
        profile[key] = value
    if extra:
        profile.update(extra)
    try:
        costs: dict[str, Any] | None = load_costs()
    except ProfileError:
        costs = None  # a checkout without measured costs: schema and sockets only
    name = runner.board_name(path, profile)
    report = check_profile(profile, schema, costs, name)
    if report.errors:
        source = f"{path} with --set" if sets else str(path)
        texts = "; ".join(issue.text for issue in report.errors)
        raise ProfileError(f"{source}: {texts}")
    return Checked(path, name, profile, report)


def issues_text(issues: Iterable[Issue]) -> list[str]:
    return [str(i) for i in issues]

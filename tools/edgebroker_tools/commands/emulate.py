"""`edgebroker emulate BOARD`: the broker as the board would run it, on this machine.

    edgebroker emulate esp32 [--port 1883] [--interpreter micropython|cpython]
                       [--heap SIZE] [--data-dir DIR] [--fresh] [--sys-interval S]
                       [--status-every N] [--no-monitor] [--app FILE] [--set key=value ...]

What it runs:
  - the MicroPython unix port with exactly the board's heap
    (`-X heapsize=heap_bytes`, or --heap), importing the .mpy build as the
    board does (runner.compile_mpy); with `romfs: true` the .mpy files are
    put in a ROMFS image mounted with vfs.VfsRom, read into the heap before
    anything else with the heap enlarged by the image's size, so the broker
    sees heap_bytes and runs its bytecode in place, as from a ROMFS partition;
  - the profile's limits: the effective profile (defaults filled in, --set
    and --sys-interval applied) is written to <data-dir>/profile.json and
    handed to the broker, as the board receives its validated profile;
  - a store directory standing in for flash (default data/emulate/<board>):
    for storage_type disc/disc_only the broker opens lib/edgestore.py's
    FlashStore at <data-dir>/retained.ebrs (edgebroker.open_store); without
    lib/edgestore.py the RAM store is used and a note says so;
  - the asyncio server (`await broker.serve_async()`), as on a board;
  - with --app FILE, your app beside it: FILE is copied to <data-dir>/app.py
    and its `async def main(broker)` runs as a task next to the broker
    through firmware/userapp.py, as firmware/gateway.py runs /app.py on a
    board (a crash is printed and counted, the broker goes on);
  - a monitor: an MQTT client subscribed to $SYS/broker/# that prints one
    status line every --status-every seconds (heap free/alloc, which the
    broker publishes retained every sys_interval seconds after gc.collect(),
    clients, retained, messages, refusals). It is a real client: it takes one
    of max_clients (--no-monitor leaves them all to others).

Ctrl-C, SIGTERM and SIGHUP stop the broker cleanly (forwarded as SIGINT
to CPython, as the end of its stdin to MicroPython: runner.start_broker);
the exit code is the broker's. `--interpreter cpython` runs the same
launcher under CPython: no heap limit and no heap figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Final, cast

from edgebroker_tools import profiles, runner
from edgebroker_tools.commands import (
    CommandError,
    add_set_option,
    port_arg,
    refuse_address_overrides,
)
from edgebroker_tools.mqttclient import Client, MqttError, parse_publish

if TYPE_CHECKING:
    from edgebroker_tools.commands import Subparsers

STORE_FILE: Final = "retained.ebrs"
PROFILE_FILE: Final = "profile.json"
ROMFS_FILE: Final = "romfs.img"
MONITOR_ID: Final = "edgebroker-emulate-monitor"

#: Runs under MicroPython and CPython alike. Placeholders: ROMFS (path of an
#: image or None), PATHS (module directories), ARGV (edgebroker.main's), APP
#: (the directory holding app.py, or None), PROFILE, BIND, PORT, DATA.
#: Without an app: edgebroker.main with the asyncio server, as on a board.
#: With one: the same through the public API (edgebroker.start), and
#: firmware/userapp.py runs app.py's main(broker) beside the broker, as
#: firmware/gateway.py does on a board.
LAUNCHER: Final = r"""
import sys
ROMFS = @ROMFS@
if ROMFS:
    import os
    import vfs
    _img = bytearray(os.stat(ROMFS)[6])
    with open(ROMFS, "rb") as _f:
        _f.readinto(_img)
    vfs.mount(vfs.VfsRom(_img), "/rom")
    sys.path.insert(0, "/rom")
for _p in @PATHS@:
    sys.path.insert(0, _p)
import edgebroker
APP = @APP@
if APP is None:
    edgebroker.main(@ARGV@)
else:
    import asyncio
    import json
    import userapp
    sys.path.append(APP)  # app.py is imported as `app`, as from a board's /
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # CPython: the app's prints at once

    def _say(text):
        print("edgebroker: " + text)

    with open(@PROFILE@) as _f:
        _profile = json.load(_f)
    try:
        _b = edgebroker.start(_profile, @BIND@, @PORT@, @DATA@)
    except (ValueError, OSError) as _e:
        print("edgebroker: error: cannot start the broker: %r" % (_e,), file=sys.stderr)
        sys.exit(2)
    if "--stop-on-eof" in @ARGV@:
        _b.stop_stream = getattr(sys.stdin, "buffer", sys.stdin)
    print("edgebroker listening on %s:%d (%s, async server, with app.py)"
          % (@BIND@, @PORT@, sys.implementation.name))

    async def _serve():
        _t = asyncio.create_task(userapp.run(_b, _say))
        try:
            await _b.serve_async()
        finally:
            _t.cancel()

    try:
        asyncio.run(_serve())
        _b.shutdown()
    except KeyboardInterrupt:
        _b.shutdown()
    except MemoryError:
        pass  # as edgebroker.main: a Ctrl-C inside a collection locked the heap
"""


def _heap(text: str) -> str:
    try:
        runner.parse_heap(text)
    except runner.RunnerError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: must be > 0")
    return value


def _seconds(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid seconds {text!r}: expected 0..86400") from None
    if not 0 <= value <= 86400:
        raise argparse.ArgumentTypeError(f"invalid seconds {value}: expected 0..86400")
    return value


def register(subparsers: Subparsers) -> None:
    """Add the `emulate` subcommand."""
    parser = subparsers.add_parser(
        "emulate",
        help="run the broker with a board's heap, limits and flash store, with a heap monitor",
        description="Run the broker under the MicroPython unix port with the board's heap "
        "(heap_bytes), its profile and a directory standing in for its flash; print heap "
        "figures from $SYS every few seconds. Ctrl-C or SIGTERM stops it cleanly.",
    )
    parser.add_argument("board", metavar="BOARD|FILE", help="board name (esp32) or profile file")
    parser.add_argument("--port", type=port_arg, default=1883, help="TCP port (default: 1883)")
    parser.add_argument("--bind", default="127.0.0.1", metavar="ADDR", help="address to bind")
    parser.add_argument(
        "--interpreter",
        choices=runner.INTERPRETERS,
        default="micropython",
        help="micropython (default): the board's heap; cpython: no heap limit",
    )
    parser.add_argument(
        "--heap", type=_heap, default=None, metavar="SIZE", help="heap instead of heap_bytes"
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="directory standing in for the board's flash (default: data/emulate/<board>)",
    )
    parser.add_argument("--fresh", action="store_true", help="start with an empty retained store")
    parser.add_argument(
        "--sys-interval",
        type=_seconds,
        default=None,
        metavar="S",
        help="override the profile's sys_interval (how often heap figures are published)",
    )
    parser.add_argument(
        "--status-every",
        type=_positive,
        default=5.0,
        metavar="N",
        help="seconds between status lines (default: 5)",
    )
    parser.add_argument(
        "--no-monitor",
        action="store_true",
        help="no status lines (the monitor is an MQTT client: it takes one of max_clients)",
    )
    parser.add_argument(
        "--app",
        type=Path,
        default=None,
        metavar="FILE",
        help="your app.py: its `async def main(broker)` runs beside the broker, as on a "
        "board (copied to the data dir as app.py)",
    )
    parser.add_argument(
        "--server",
        choices=("async", "poll"),
        default=None,
        help="the broker's server: async (default, as on a board; always with --app) or poll",
    )
    add_set_option(parser)
    parser.set_defaults(handler=handle)


# ------------------------------------------------------------------ setup
def prepare_profile(
    spec: str, overrides: list[str], sys_interval: int | None, bind: str = "127.0.0.1"
) -> tuple[str, dict[str, Any], list[str]]:
    """(board name, effective profile, notes). The profile with --set and
    --sys-interval goes through the checker of `config check`: an error is
    ProfileError (one line: key, value, allowed range), warnings are notes."""
    extra = {"sys_interval": sys_interval} if sys_interval is not None else None
    checked = profiles.load_checked(spec, overrides, extra)
    notes = [f"config check: {i.text}" for i in profiles.host_warnings(checked.report, bind)]
    return checked.name, checked.report.profile, notes


def launcher_argv(
    cfg: dict[str, Any],
    interpreter: runner.Interpreter,
    heap: str | None,
    data_dir: Path,
    port: int,
    bind: str,
    app: Path | None = None,
    server: str | None = None,
) -> tuple[list[str], list[str]]:
    """(argv, notes) of the broker process. app: the app.py to run beside
    the broker (a copy in data_dir, see install_app). server: async or poll
    (None: the default, see --server)."""
    notes: list[str] = []
    lib = runner.repo_root() / "lib"
    # the modules the board gets (config check counts the same ones); each
    # compiled afresh, so none runs stale bytecode from the shared .mpy cache
    sources = []
    for mod in profiles.shipped_modules(cfg):
        src = lib / f"{mod}.py"
        if mod == "edgestore" and not src.is_file():
            notes.append(
                f"lib/edgestore.py not found: storage_type {cfg['storage_type']} runs on the "
                "RAM store"
            )
            src = lib / "edgeram.py"
        sources.append(src)
    profile_path = data_dir / PROFILE_FILE
    profile_path.write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    main_argv = [
        "edgebroker.py",
        "--board",
        str(profile_path),
        "--port",
        str(port),
        "--bind",
        bind,
        "--data-dir",
        str(data_dir),
        "--server",
        # The board runs the asyncio server (the app's tasks beside it), and
        # so does emulate unless --server poll. (It once ran the poll server
        # without an app: a scheduler fault seen there in 1 run of 5 was the
        # unix port's asynchronous SIGINT at the stop, see runner.start_broker;
        # 0 in 65 full-load runs since.)
        server or "async",
    ]
    if interpreter == "micropython":
        main_argv.append(runner.STOP_ON_EOF)  # stopped by closing stdin: runner.start_broker
    if app is not None:
        sources.append(runner.repo_root() / "firmware" / "userapp.py")
    romfs: str | None = None
    if interpreter == "cpython":
        paths = [str(lib), str(runner.repo_root() / "firmware")]
        argv = [sys.executable, "-c"]
    else:
        mpys = [runner.compile_mpy(s) for s in sources]
        # the board is 32-bit, this interpreter 64-bit: the same objects and
        # bytecode take about 1.54x the bytes here. --heap is a board heap
        # too (instead of heap_bytes), scaled the same way
        board = board_heap(cfg, heap)
        size = runner.unix_heap(board)
        notes.append(
            f"heap: the board's {board:,} bytes (32-bit{', --heap' if heap else ''}) are "
            f"{size:,} bytes on this 64-bit unix port (x{runner.HEAP_64_PER_32:.2f}, "
            "the measured object-size ratio)"
        )
        if profiles.code_in_place(cfg):
            image = build_romfs(mpys, data_dir)
            romfs = str(image)
            paths = []
            # the image is read into the heap first: add its size so that
            # the broker still finds heap_bytes (on a board it is in flash)
            size += image.stat().st_size + 1024
            notes.append(
                f"romfs: bytecode runs in place from {image.name} ({image.stat().st_size} "
                "bytes, outside the board's heap)"
            )
            if cfg.get("frozen") is True:
                # frozen: the nearest this port comes is a ROMFS import, which
                # keeps more (names, function records): that much more heap
                more = frozen_extra(cfg)
                size += more
                notes.append(
                    f"frozen: emulated as a ROMFS import, with the {more:,} bytes it keeps "
                    "beyond a frozen module added to the heap (boards/memory_costs.json)"
                )
        else:
            paths = [str(mpys[0].parent)]
        argv = [
            str(runner.micropython_executable()),
            "-X",
            f"heapsize={runner.heap_option(size)}",
            "-c",
        ]
    code = (
        LAUNCHER.replace("@ROMFS@", repr(romfs))
        .replace("@PATHS@", repr(paths))
        .replace("@ARGV@", repr(main_argv))
        .replace("@APP@", repr(str(app.parent) if app is not None else None))
        .replace("@PROFILE@", repr(str(profile_path)))
        .replace("@BIND@", repr(bind))
        .replace("@PORT@", repr(port))
        .replace("@DATA@", repr(str(data_dir)))
    )
    return [*argv, code], notes


def install_app(app: Path | None, data_dir: Path) -> Path | None:
    """--app FILE, checked as `edgebroker flash --app` checks it, copied to
    <data_dir>/app.py: the data directory stands in for the board's
    filesystem, where the app is /app.py. None without --app."""
    if app is None:
        return None
    from edgebroker_tools.commands import flash

    for warning in flash.check_app(app):
        print(f"emulate: warning: {warning}", file=sys.stderr, flush=True)
    target = data_dir / "app.py"
    try:
        shutil.copyfile(app, target)
    except OSError as exc:
        raise CommandError(f"cannot copy {app} to {target}: {exc.strerror or exc}") from None
    return target


def frozen_extra(cfg: Mapping[str, Any]) -> int:
    """What importing the profile's modules from ROMFS keeps beyond frozen
    modules (profiles.FROZEN_32), both as this 64-bit port pays them."""
    costs = profiles.load_costs()  # the 64-bit figures, as measured
    frozen = dict(cfg, word_bytes=8)
    romfs = dict(frozen, frozen=False, romfs=True)
    return max(
        0,
        sum(
            profiles.code_cost(romfs, costs, m) - profiles.code_cost(frozen, costs, m)
            for m in profiles.modules_for(cfg)
        ),
    )


def build_romfs(mpys: list[Path], data_dir: Path) -> Path:
    """A ROMFS image of the .mpy files (mpremote romfs build)."""
    src = data_dir / "romfs-src"
    if src.exists():
        shutil.rmtree(src)
    src.mkdir()
    for f in mpys:
        shutil.copy(f, src / f.name)
    image = data_dir / ROMFS_FILE
    mpremote = Path(sys.executable).parent / "mpremote"
    exe = str(mpremote) if mpremote.exists() else "mpremote"
    r = subprocess.run(
        [exe, "romfs", "--no-mpy", "-o", str(image), "build", str(src)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    shutil.rmtree(src, ignore_errors=True)
    if r.returncode != 0 or not image.exists():
        raise CommandError(f"mpremote romfs build failed: {(r.stderr or r.stdout).strip()}")
    return image


# ---------------------------------------------------------------- monitor
class Status:
    """The latest $SYS/broker/... values, and the status line made of them."""

    def __init__(
        self, board: str, cfg: dict[str, Any], interpreter: str, heap: int | None = None
    ) -> None:
        """heap: the 64-bit port's -X heapsize ($SYS heap/free and heap/alloc
        are of that heap, not of the board's 32-bit heap_bytes)."""
        self.board = board
        self.cfg = cfg
        self.interpreter = interpreter
        self.heap = heap
        self.values: dict[str, str] = {}

    def update(self, topic: str, payload: bytes) -> None:
        if topic.startswith("$SYS/broker/"):
            self.values[topic[12:]] = payload.decode("ascii", "replace")

    def line(self) -> str:
        v = self.values
        if "heap/free" in v:
            total = (
                f"{self.heap} (64-bit port; board {self.cfg['heap_bytes']})"
                if self.heap is not None
                else str(self.cfg["heap_bytes"])
            )
            part = f"heap free {v['heap/free']} alloc {v.get('heap/alloc', '?')} of {total}"
        elif self.interpreter == "cpython":
            part = "heap n/a (cpython)"
        elif not v:
            si = self.cfg["sys_interval"]
            return (
                f"emulate {self.board}: waiting for $SYS (sys_interval {si} s)"
                if si
                else f"emulate {self.board}: sys_interval is 0: no $SYS figures"
            )
        else:
            part = "heap ?"
        refusals = [f"{k[9:]} {val}" for k, val in sorted(v.items()) if k.startswith("refusals/")]
        return (
            f"emulate {self.board}: {part} | clients {v.get('clients/connected', '?')}"
            f"/{self.cfg['max_clients']} | retained {v.get('retained/count', '?')} "
            f"({v.get('retained/bytes', '?')} B) | messages in {v.get('messages/received', '?')} "
            f"out {v.get('messages/sent', '?')} dropped {v.get('messages/dropped', '?')}"
            f" | refusals: {', '.join(refusals) if refusals else 'none'}"
        )


def monitor(
    port: int,
    status: Status,
    every: float,
    stop: threading.Event,
    child: subprocess.Popen[str],
) -> None:
    """Print a status line every `every` seconds until stop is set or the child exits."""
    client = Client(port, MONITOR_ID)
    try:
        rc = client.connect()
        if rc != 0:
            print(f"emulate: monitor refused (CONNACK {rc}): no status lines", flush=True)
            return
        client.subscribe([("$SYS/broker/#", 0)])
    except MqttError as exc:
        print(f"emulate: monitor: {exc}", flush=True)
        return
    next_line = time.monotonic() + min(every, 1.0)
    try:
        while not stop.is_set() and child.poll() is None:
            left = next_line - time.monotonic()
            if left <= 0:
                print(status.line(), flush=True)
                next_line = time.monotonic() + every
                continue
            packet = client.poll_packet(min(left, 0.2))
            if packet is not None and packet[0] >> 4 == 3:
                msg = parse_publish(*packet)
                status.update(msg.topic, msg.payload)
    except MqttError:
        pass  # the broker stopped
    finally:
        client.disconnect()


# ----------------------------------------------------------------- handler
def handle(args: argparse.Namespace) -> int:
    interpreter = cast(runner.Interpreter, args.interpreter)
    refuse_address_overrides(cast("list[str]", args.overrides), "emulate")
    name, cfg, notes = prepare_profile(
        cast(str, args.board),
        cast("list[str]", args.overrides),
        args.sys_interval,
        cast(str, args.bind),
    )
    data_dir = cast("Path | None", args.data_dir) or Path("data") / "emulate" / name
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        if args.fresh:
            for f in (STORE_FILE, STORE_FILE + ".new", STORE_FILE + ".bad"):
                (data_dir / f).unlink(missing_ok=True)
    except OSError as exc:
        raise CommandError(f"cannot prepare data dir {data_dir}: {exc.strerror or exc}") from None
    app = install_app(cast("Path | None", args.app), data_dir)
    heap = cast("str | None", args.heap)
    if heap is not None and interpreter == "cpython":
        notes.append("--heap is ignored with --interpreter cpython")
        heap = None
    if interpreter == "micropython":
        check_heap(name, cfg, heap)
    runner.check_listen(cast(str, args.bind), cast(int, args.port))
    argv, more = launcher_argv(
        cfg,
        interpreter,
        heap,
        data_dir,
        cast(int, args.port),
        cast(str, args.bind),
        app,
        cast("str | None", args.server),
    )
    notes += more
    size = heap or str(cfg["heap_bytes"])
    where = f"heap {size} bytes" if interpreter == "micropython" else "CPython, no heap limit"
    print(
        f"emulate {name}: {where}, storage {cfg['storage_type']}, data {data_dir}, "
        f"max_clients {cfg['max_clients']}",
        file=sys.stderr,
        flush=True,
    )
    for note in notes:
        print(f"emulate: note: {note}", file=sys.stderr, flush=True)
    return run(argv, name, cfg, interpreter, args)


def heap_size(argv: list[str]) -> int | None:
    """The -X heapsize a MicroPython argv gives, in bytes (None: none)."""
    for item in argv:
        if item.startswith("heapsize="):
            return runner.parse_heap(item[len("heapsize=") :])
    return None


def _board_bytes(unix: int) -> int:
    """A 64-bit port's heap bytes as the board's (32-bit), rounded up."""
    return math.ceil(unix / runner.HEAP_64_PER_32)


def board_heap(cfg: dict[str, Any], heap: str | None) -> int:
    """The board heap emulated: --heap (32-bit bytes, like heap_bytes) or heap_bytes."""
    return runner.parse_heap(heap) if heap is not None else int(cfg["heap_bytes"])


def minimum_heap(cfg: dict[str, Any]) -> int | None:
    """profiles.start_heap with the measured costs (this 64-bit port's),
    None without them; compare it with runner.unix_heap(board heap)."""
    try:
        return profiles.start_heap(cfg, profiles.load_costs())
    except profiles.ProfileError:
        return None


def check_heap(name: str, cfg: dict[str, Any], heap: str | None) -> None:
    """A --heap the build cannot start in: one line with the minimum.
    (heap_bytes itself went through config check, which says the same.)"""
    if heap is None:
        return
    size = runner.parse_heap(heap)
    least = minimum_heap(cfg)
    if least is not None and runner.unix_heap(size) < least:
        raise CommandError(
            f"--heap {heap} ({size:,} bytes) is too small for the {name} build: the broker "
            f"needs at least {_board_bytes(least):,} bytes of board heap to import and listen "
            f"({least:,} on this 64-bit port; boards/memory_costs.json)"
        )


def out_of_memory(name: str, cfg: dict[str, Any], heap: str | None, held: list[str]) -> str:
    """The one line for a broker that died of MemoryError before listening."""
    size = board_heap(cfg, heap)
    least = minimum_heap(cfg)
    if least is None:
        need = ""
    elif least > runner.unix_heap(size):
        need = f": give at least {_board_bytes(least):,} bytes"
    else:
        need = (
            f"; boards/memory_costs.json puts the minimum at {_board_bytes(least):,} bytes, "
            "so its figures "
            "are out of date for this lib/ (`make measure-memory`)"
        )
    last = held[-1].strip() if held else "MemoryError"
    return (
        f"heap of {size:,} bytes is too small for the {name} build: the broker ran out of "
        f"memory while starting ({last}){need}"
    )


def run(
    argv: list[str],
    name: str,
    cfg: dict[str, Any],
    interpreter: str,
    args: argparse.Namespace,
) -> int:
    """Start the broker, echo its stdout, run the monitor, forward stop signals."""
    stop = threading.Event()
    listening = threading.Event()
    child: subprocess.Popen[str] | None = None
    received = 0

    def forward(signum: int, _frame: FrameType | None) -> None:
        nonlocal received
        received += 1
        stop.set()
        if child is None or child.poll() is not None:
            return
        if received >= 3:
            child.kill()
        else:
            runner.ask_stop(child)

    previous = {sig: signal.signal(sig, forward) for sig in runner.FORWARDED_SIGNALS}
    try:
        try:
            child = runner.start_broker(
                argv,
                stop_by_eof=interpreter == "micropython",
                with_parent=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        except runner.RunnerError as exc:
            raise CommandError(str(exc)) from None
        if received:
            runner.ask_stop(child)

        def echo() -> None:
            assert child is not None and child.stdout is not None
            for line in child.stdout:
                # the unix port prints an uncaught exception's traceback here
                if held_out or (not listening.is_set() and line.startswith("Traceback")):
                    held_out.append(line)
                    continue
                sys.stdout.write(line)
                sys.stdout.flush()
                if line.startswith("edgebroker listening on"):
                    listening.set()

        def echo_err() -> None:
            # log lines pass through; a traceback before the broker listens is
            # held: a MemoryError there becomes one line (the heap is too small)
            assert child is not None and child.stderr is not None
            for line in child.stderr:
                if held_err or (not listening.is_set() and line.startswith("Traceback")):
                    held_err.append(line)
                    continue
                sys.stderr.write(line)
                sys.stderr.flush()

        held_out: list[str] = []
        held_err: list[str] = []
        reader = threading.Thread(target=echo, daemon=True)
        reader.start()
        err_reader = threading.Thread(target=echo_err, daemon=True)
        err_reader.start()
        if not args.no_monitor:
            while not listening.wait(0.1):
                if child.poll() is not None or stop.is_set():
                    break
            if listening.is_set() and not stop.is_set():
                status = Status(name, cfg, interpreter, heap_size(argv))
                monitor(cast(int, args.port), status, cast(float, args.status_every), stop, child)
        code = child.wait()
        reader.join(2.0)
        err_reader.join(2.0)
        held = held_out + held_err
        if not listening.is_set() and any(x.startswith("MemoryError") for x in held):
            heap = cast("str | None", args.heap) if interpreter == "micropython" else None
            raise CommandError(out_of_memory(name, cfg, heap, held))
        sys.stdout.writelines(held_out)
        sys.stderr.writelines(held_err)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if child is not None and child.poll() is None:
            with contextlib.suppress(OSError):
                child.kill()
            child.wait(5)
    return 128 - code if code < 0 else code

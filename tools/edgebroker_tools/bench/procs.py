"""Broker processes: find the interpreters and mosquitto, start a broker on a
free loopback port and wait until it listens, read its CPU, RSS and
context switches from /proc, stop it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from edgebroker_tools import runner
from edgebroker_tools.bench.common import (
    HOST,
    READY_LINE,
    SYS_INTERVAL,
    BenchError,
    BrokerName,
    interpreter_of,
    server_of,
)


@dataclass(frozen=True)
class Tools:
    """Where the brokers and the broker script are."""

    root: Path
    python: Path
    micropython: Path | None
    mosquitto: Path | None
    board: Path
    mpy_heap: str | None


def find_tools(root: Path, board: Path, mpy_heap: str | None) -> Tools:
    venv_python = root / ".venv" / "bin" / "python"
    python = venv_python if venv_python.exists() else Path(sys.executable)
    mpy: Path | None = root / ".venv" / "bin" / "micropython"
    if mpy is None or not mpy.exists():
        found = shutil.which("micropython")
        mpy = Path(found) if found else None
    mosq: Path | None = Path("/usr/sbin/mosquitto")
    if mosq is None or not mosq.exists():
        found = shutil.which("mosquitto")
        mosq = Path(found) if found else None
    return Tools(root, python, mpy, mosq, board, mpy_heap)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def rss_kb(pid: int) -> int | None:
    """VmRSS of a process in kB, None if unreadable."""
    try:
        with Path(f"/proc/{pid}/status").open(encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process in seconds (from /proc/<pid>/stat), None if unreadable."""
    try:
        with Path(f"/proc/{pid}/stat").open(encoding="ascii", errors="replace") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12])) / ticks
    except (OSError, ValueError, IndexError):
        return None


def context_switches(pid: int) -> int | None:
    """Voluntary + involuntary context switches of every thread of a process:
    each time it went to sleep and was woken (or preempted). None if unreadable."""
    total = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            text = (task / "status").read_text(encoding="ascii", errors="replace")
        except OSError:
            continue  # a thread that ended meanwhile
        for line in text.splitlines():
            if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                total += int(line.split()[1])
    return total


@dataclass
class BrokerProcess:
    """A started broker: kind, label, port, process and its log files."""

    kind: BrokerName
    label: str
    port: int
    proc: subprocess.Popen[bytes]
    workdir: Path
    argv: list[str]
    started_s: float = 0.0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 12) -> str:
        out: list[str] = []
        for name in ("stdout.txt", "stderr.txt"):
            try:
                text = (self.workdir / name).read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
            out.extend(f"{name[:6]}: {line}" for line in text.splitlines()[-lines:])
        return "\n".join(out)

    def stderr_text(self) -> str:
        try:
            return (self.workdir / "stderr.txt").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 5.0) -> int | None:
        """The clean stop (runner.ask_stop), then SIGTERM, then SIGKILL; returns
        the exit code."""
        if self.proc.poll() is not None:
            return self.proc.returncode
        runner.ask_stop(self.proc)
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None:
                try:
                    self.proc.send_signal(sig)
                except ProcessLookupError:
                    break
            try:
                return self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                continue
        return self.proc.poll()


def edge_sets(extra: dict[str, object]) -> list[str]:
    """--set items for edgebroker: quiet logs, $SYS every second, plus extra."""
    sets: dict[str, object] = {"sys_interval": SYS_INTERVAL, "log_level": "warning"}
    sets.update(extra)
    return [f"{key}={json.dumps(value)}" for key, value in sets.items()]


def mosquitto_conf(port: int, extra: Sequence[str]) -> str:
    lines = [
        f"listener {port} {HOST}",
        "allow_anonymous true",
        "persistence false",
        f"sys_interval {SYS_INTERVAL}",
        "log_dest stderr",
        "log_type error",
        "log_type warning",
        *extra,
    ]
    return "\n".join(lines) + "\n"


def wait_port(port: int, deadline: float, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(10_000):
        if proc.poll() is not None:
            raise BenchError(f"exited with code {proc.returncode} before listening")
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    raise BenchError(f"port {port} not accepting connections in time")


def edge_argv(
    kind: BrokerName, tools: Tools, port: int, data_dir: Path, overrides: Sequence[str]
) -> list[str]:
    """The argv of edgebroker `kind`: runner.broker_command for the interpreter
    (MicroPython: the .mpy build), plus `--server async` for the -async kinds."""
    interp = interpreter_of(kind)
    if interp is None:
        raise BenchError(f"{kind} is not an edgebroker kind")
    script = runner.lib_path()
    if not script.exists():
        raise BenchError(f"{script} does not exist (yet)")
    if interp == "micropython" and tools.micropython is None:
        raise BenchError("micropython not found")
    try:
        argv = runner.broker_command(
            board=tools.board,
            port=port,
            bind=HOST,
            interpreter=interp,
            heap=tools.mpy_heap if interp == "micropython" else None,
            data_dir=data_dir,
            overrides=overrides,
            lib=script,
        )
    except runner.RunnerError as exc:
        raise BenchError(str(exc)) from None
    if interp == "cpython":
        argv[0] = str(tools.python)
    elif tools.micropython is not None:
        argv[0] = str(tools.micropython)
    if server_of(kind) == "async":
        if interp == "cpython":
            argv += ["--server", "async"]
        else:
            # the launcher passes its argv list to main(): add to that list
            code = argv[-1]
            at = code.rfind("])")
            if at < 0:
                raise BenchError("unexpected MicroPython launcher")
            argv[-1] = code[:at] + ", '--server', 'async'" + code[at:]
    return argv


def start_broker(
    kind: BrokerName,
    tools: Tools,
    label: str,
    tmp: Path,
    edge_extra: dict[str, object] | None = None,
    mosq_extra: Sequence[str] = (),
    timeout: float = 60.0,
) -> BrokerProcess:
    """Start one broker and wait until it listens; BenchError if it does not."""
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=tmp))
    argv: list[str]
    if kind == "mosquitto":
        if tools.mosquitto is None:
            raise BenchError("mosquitto not found")
        conf = workdir / "mosquitto.conf"
        conf.write_text(mosquitto_conf(port, mosq_extra), encoding="utf-8")
        argv = [str(tools.mosquitto), "-c", str(conf)]
    else:
        data_dir = workdir / "data"
        data_dir.mkdir()
        argv = edge_argv(kind, tools, port, data_dir, edge_sets(edge_extra or {}))
    stdout = (workdir / "stdout.txt").open("wb")
    stderr = (workdir / "stderr.txt").open("wb")
    try:
        proc = runner.start_broker(
            argv,
            stop_by_eof=interpreter_of(kind) == "micropython",
            cwd=str(tools.root),
            stdout=stdout,
            stderr=stderr,
        )
    except runner.RunnerError as exc:
        raise BenchError(str(exc)) from None
    finally:
        stdout.close()
        stderr.close()
    broker = BrokerProcess(kind, label, port, proc, workdir, argv)
    t0 = time.monotonic()
    deadline = t0 + timeout
    try:
        if kind == "mosquitto":
            wait_port(port, deadline, proc)
        else:
            wait_ready_line(broker, deadline)
    except BenchError as exc:
        tail = broker.log_tail()
        broker.stop()
        raise BenchError(f"{label} did not start: {exc}\n{tail}") from None
    broker.started_s = time.monotonic() - t0
    return broker


def wait_ready_line(broker: BrokerProcess, deadline: float) -> None:
    """The ready line names the interpreter and the server: both are checked."""
    path = broker.workdir / "stdout.txt"
    want = f"({interpreter_of(broker.kind)}, {server_of(broker.kind)} server)"
    for _ in range(100_000):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            text = ""
        for line in text.splitlines():
            if line.startswith(READY_LINE):
                if want not in line:
                    raise BenchError(f"unexpected ready line {line!r} (wanted {want})")
                return
        if broker.proc.poll() is not None:
            raise BenchError(f"exited with code {broker.proc.returncode} before listening")
        if time.monotonic() > deadline:
            raise BenchError(f"no {READY_LINE!r} line in time")
        time.sleep(0.02)
    raise BenchError("no ready line")

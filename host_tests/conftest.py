"""Shared pytest fixtures for the edgebroker black-box tests.

Every integration test takes the ``interp`` fixture (directly or through
``broker`` / ``broker_factory``), so it runs once per interpreter:

    cpython      python3 lib/edgebroker.py ...
    micropython  .venv/bin/micropython [-X heapsize=H] lib/edgebroker.py ...

Environment switches:

    EDGEBROKER_TEST_BROKER=mosquitto   run the suite against /usr/sbin/mosquitto
                                       (validates the tests themselves; profile
                                       overrides are ignored, tests that need
                                       them skip via requires_edgebroker()).
    EDGEBROKER_TEST_INTERP=cpython|micropython
                                       restrict the interpreter parametrisation.

Default per-test timeout is 60 s (pytest-timeout) unless --timeout or an ini
``timeout`` is given.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from mqtt_helpers import (  # noqa: E402,F401
    STOP_ON_EOF,
    broker_popen,
    free_port,
    is_mosquitto_mode,
    requires_edgebroker,
    stop_process,
)

REPO = HERE.parent
BROKER_SCRIPT = os.environ.get("EDGEBROKER_TEST_SCRIPT", "lib/edgebroker.py")
MOSQUITTO = "/usr/sbin/mosquitto"
READY_PREFIX = "edgebroker listening on"
START_TIMEOUT = 15.0
DEFAULT_TEST_TIMEOUT = 60


SERVERS = ("poll", "async")


def _interp_params():
    """Each integration test runs per interpreter and per server: the poll
    server (the host default) and the asyncio server (the board's), e.g.
    ids cpython, micropython, cpython-async, micropython-async."""
    if is_mosquitto_mode():
        return ["mosquitto"]
    only = os.environ.get("EDGEBROKER_TEST_INTERP", "").strip()
    interps = [p.strip() for p in only.split(",") if p.strip()] if only else ["cpython", "micropython"]
    want = os.environ.get("EDGEBROKER_TEST_SERVER", "").strip()
    servers = [s.strip() for s in want.split(",") if s.strip()] if want else list(SERVERS)
    out = []
    for server in servers:
        for i in interps:
            out.append(i if server == "poll" else i + "-" + server)
    return out


def micropython_exe():
    cand = Path(sys.executable).parent / "micropython"
    if cand.exists():
        return str(cand)
    cand = REPO / ".venv" / "bin" / "micropython"
    if cand.exists():
        return str(cand)
    import shutil

    found = shutil.which("micropython")
    if found:
        return found
    return str(REPO / ".venv" / "bin" / "micropython")


# --------------------------------------------------------------------------
# pytest configuration hooks


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: test takes several seconds (keepalive/expiry)")


def pytest_collection_modifyitems(config, items):
    # The server dimension only matters where a test starts a broker through
    # broker_factory; elsewhere (CLI, emulator, unit tests) the async ids
    # would repeat the poll ones.
    keep = []
    dropped = []
    for item in items:
        cs = getattr(item, "callspec", None)
        p = cs.params.get("interp", "") if cs is not None else ""
        if "-" in p and "broker_factory" not in getattr(item, "fixturenames", ()):
            dropped.append(item)
        else:
            keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    # default timeout of 60 s per test unless configured otherwise
    try:
        opt = config.getoption("timeout")
    except ValueError:
        return  # pytest-timeout not installed
    try:
        ini = config.getini("timeout")
    except ValueError:
        ini = None
    if opt is None and not ini:
        for item in items:
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(DEFAULT_TEST_TIMEOUT))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
    if rep.when == "call" and rep.failed:
        for b in getattr(item, "_edgebroker_brokers", []):
            try:
                text = b.log_text()
            except Exception as e:  # pragma: no cover
                text = "<cannot read log: %r>" % (e,)
            rc = b.proc.poll()
            rep.sections.append(
                ("broker %s port %d (exit %s) log" % (b.interp, b.port, rc), text[-20000:] or "<empty>")
            )


# --------------------------------------------------------------------------
# broker process wrapper


class BrokerProc:
    """One broker subprocess (edgebroker under an interpreter, or mosquitto)."""

    def __init__(self, interp, host, port, proc, log_path, profile, data_dir, cmd):
        self.interp = interp
        self.host = host
        self.port = port
        self.proc = proc
        self.log_path = Path(log_path)
        self.profile = profile
        self.data_dir = data_dir
        self.cmd = cmd
        self.stdout_lines = []
        self.expected_exit = False  # set by stop()/kill()
        self._ready = threading.Event()
        self._reader = None

    # -- info
    @property
    def is_mosquitto(self):
        return self.interp == "mosquitto"

    @property
    def pid(self):
        return self.proc.pid

    def alive(self):
        return self.proc.poll() is None

    def log_text(self):
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_log(self, needle, timeout=3.0, start=0):
        """Wait until the stderr log (from char offset ``start``) contains
        ``needle`` (str, or a callable(text)->bool). Returns True/False."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.log_text()[start:]
            ok = needle(text) if callable(needle) else (needle in text)
            if ok:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    # -- lifecycle
    def _start_reader(self):
        def run():
            try:
                for raw in self.proc.stdout:
                    line = raw.decode("utf-8", "replace").rstrip("\r\n")
                    self.stdout_lines.append(line)
                    if line.startswith(READY_PREFIX):
                        self._ready.set()
            except Exception:
                pass

        if self.proc.stdout is not None:
            self._reader = threading.Thread(target=run, daemon=True)
            self._reader.start()

    def _wait_ready(self, timeout):
        deadline = time.monotonic() + timeout
        if self.is_mosquitto:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    return False
                try:
                    s = socket.create_connection((self.host, self.port), timeout=0.5)
                    s.close()
                    return True
                except OSError:
                    time.sleep(0.05)
            return False
        while time.monotonic() < deadline:
            if self._ready.wait(0.05):
                return True
            if self.proc.poll() is not None:
                # give the reader a moment to see the final lines
                return self._ready.wait(0.2)
        return False

    def stop(self, timeout=10.0):
        """The clean stop (SIGINT; MicroPython: end of stdin, see
        mqtt_helpers.broker_popen), wait up to ``timeout`` s, then kill.
        Returns the exit code."""
        self.expected_exit = True
        if self.proc.poll() is None:
            stop_process(self.proc, timeout)
        self._close_pipes()
        return self.proc.returncode

    def kill(self):
        self.expected_exit = True
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self._close_pipes()
        return self.proc.returncode

    def _close_pipes(self):
        if self._reader is not None:
            self._reader.join(1.0)
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            if self.proc.stdout:
                self.proc.stdout.close()
        except Exception:
            pass

    def __repr__(self):
        return "<BrokerProc %s %s:%d pid=%d>" % (self.interp, self.host, self.port, self.proc.pid)


# --------------------------------------------------------------------------
# fixtures


@pytest.fixture(params=_interp_params(), ids=lambda p: p)
def interp(request):
    name = request.param.split("-")[0]
    if name == "micropython" and not Path(micropython_exe()).exists():
        pytest.skip("micropython interpreter not found")
    return name


@pytest.fixture
def server(request, interp):
    """The server the test's broker runs: poll or async (from the interp id)."""
    p = request.node.callspec.params.get("interp", "")
    return p.split("-")[1] if "-" in p else "poll"


def _load_board(board):
    if board is None:
        return {}
    if isinstance(board, dict):
        return dict(board)
    p = Path(board)
    if not p.is_absolute():
        p = REPO / p
    if not p.exists():
        if Path(board).name == "host.json":
            return {}  # host profile = all defaults
        raise FileNotFoundError("board profile %s not found" % p)
    with open(p) as f:
        return json.load(f)


@pytest.fixture
def broker_factory(interp, server, tmp_path, request):
    started = []
    request.node._edgebroker_brokers = started
    counter = [0]

    def start(heap=None, board="boards/host.json", port=None, extra_args=(), script=None, **overrides):
        """Start a broker. ``overrides`` are profile keys merged over the
        board file. ``port``: fixed port (e.g. to restart on the same one);
        ``extra_args``: more CLI arguments; ``script``: another broker
        script (micropython: a .mpy is imported and its main(argv) called).
        A free port another test worker took between free_port() and the
        broker's bind ("address in use") is retried with a new one."""
        for attempt in range(3):
            b = start_once(heap, board, port, extra_args, script, **overrides)
            if b is not None:
                return b
        pytest.fail("no free port after 3 attempts", pytrace=False)

    def start_once(heap, board, port, extra_args, script, **overrides):
        fixed = port is not None
        counter[0] += 1
        n = counter[0]
        host = "127.0.0.1"
        if port is None:
            port = free_port()
        data_dir = tmp_path / "data"
        data_dir.mkdir(exist_ok=True)
        log_path = tmp_path / ("broker-%d.log" % n)
        profile = _load_board(board)
        profile.update(overrides)
        if interp == "mosquitto":
            conf = tmp_path / ("mosquitto-%d.conf" % n)
            conf.write_text(
                "listener %d %s\n"
                "allow_anonymous true\n"
                "persistence false\n"
                "log_dest stderr\n"
                "log_type all\n"
                "max_keepalive 65535\n" % (port, host)
            )
            cmd = [MOSQUITTO, "-c", str(conf)]
            stdout = subprocess.DEVNULL
        else:
            prof_path = tmp_path / ("profile-%d.json" % n)
            prof_path.write_text(json.dumps(profile, indent=1))
            script_path = str(script or BROKER_SCRIPT)
            args = [
                script_path,
                "--board", str(prof_path),
                "--port", str(port),
                "--bind", host,
                "--data-dir", str(data_dir),
            ] + list(extra_args)
            if server != "poll" and "--server" not in args:
                args += ["--server", server]
            if interp == "cpython":
                cmd = [sys.executable] + args
            elif interp == "micropython":
                args.append(STOP_ON_EOF)
                cmd = [micropython_exe()]
                if heap:
                    cmd += ["-X", "heapsize=%s" % (heap,)]
                if script_path.endswith(".mpy"):
                    sp = Path(script_path)
                    if not sp.is_absolute():
                        sp = REPO / sp
                    code = "import sys\nsys.path.insert(0, %r)\nimport %s\n%s.main(%r)\n" % (
                        str(sp.parent), sp.stem, sp.stem, [sp.stem + ".py"] + args[1:])
                    cmd += ["-c", code]
                else:
                    cmd += args
            else:
                raise ValueError("unknown interp %r" % (interp,))
            stdout = subprocess.PIPE
        logf = open(log_path, "wb")
        try:
            proc = broker_popen(cmd, interp, cwd=str(REPO), stdout=stdout, stderr=logf)
        finally:
            logf.close()
        b = BrokerProc(interp, host, port, proc, log_path, profile, data_dir, cmd)
        started.append(b)
        b._start_reader()
        if not b._wait_ready(START_TIMEOUT):
            alive = b.alive()
            b.kill()
            if not fixed and not alive and "address in use" in b.log_text():
                started.remove(b)
                return None
            pytest.fail(
                "broker did not become ready within %.0f s (%s, exit %s)\ncmd: %s\nstdout: %s\nstderr:\n%s"
                % (START_TIMEOUT, "still running" if alive else "died", b.proc.returncode,
                   " ".join(cmd), b.stdout_lines, b.log_text()[-8000:]),
                pytrace=False,
            )
        return b

    yield start

    problems = []
    for b in started:
        if not b.expected_exit and b.proc.poll() is not None:
            problems.append(
                "broker %s port %d died during the test (exit %s)\ncmd: %s\n--- log ---\n%s"
                % (b.interp, b.port, b.proc.returncode, " ".join(b.cmd), b.log_text()[-20000:])
            )
    for b in started:
        if b.proc.poll() is None:
            b.stop()
            rc = b.proc.returncode
            if not b.is_mosquitto and rc not in (0, None) and not problems:
                problems.append(
                    "broker %s port %d did not exit cleanly on SIGINT (exit %s; contract: 0)\n--- log ---\n%s"
                    % (b.interp, b.port, rc, b.log_text()[-20000:])
                )
        else:
            b._close_pipes()
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)


@pytest.fixture
def broker(broker_factory):
    return broker_factory()

"""The compat block on other ports' terms (issue 12, item 4): errno values
are looked up by name, never by number (EINPROGRESS is 115 on Linux and 119
on the ESP32's newlib), and a non-blocking connect that completes at once
(lwIP loopback) is as good as one in progress. No board port runs here, so
an ESP32-like errno module and fake sockets stand in for what no real socket
on this machine does."""

import importlib.util
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LIB = REPO / "lib"


class _Blocked:
    """A meta-path finder under which importing the given names fails, as on
    a port without those modules."""

    def __init__(self, names):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name in self.names:
            raise ImportError("no module named %r" % name)
        return None


def _fresh_with(name, replace):
    """lib/<name>.py imported anew with sys.modules[k] = v for its import;
    v None: importing k fails."""
    saved = {k: sys.modules.get(k) for k in replace}
    blocker = _Blocked([k for k, v in replace.items() if v is None])
    sys.meta_path.insert(0, blocker)
    for k, v in replace.items():
        if v is None:
            sys.modules.pop(k, None)
        else:
            sys.modules[k] = v
    try:
        spec = importlib.util.spec_from_file_location(name + "_under_test", LIB / (name + ".py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.meta_path.remove(blocker)
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def _fresh(name, errno_module):
    """lib/<name>.py imported anew, with ``errno`` replaced for its import."""
    return _fresh_with(name, {"errno": errno_module})


def _esp32_errno():
    # newlib's numbers, as MicroPython's ESP32 port has them; like that
    # module it names no EMFILE, ENFILE or EWOULDBLOCK
    return types.SimpleNamespace(EAGAIN=11, EINPROGRESS=119, EADDRINUSE=112, ECONNREFUSED=104,
                                 ENOMEM=12, ETIMEDOUT=116)


def test_errno_values_come_from_the_ports_errno_module_by_name():
    eb = _fresh("edgebroker", _esp32_errno())
    assert eb._EINPROGRESS == (119,)
    assert eb._EADDRINUSE == (112,)
    assert eb._EAGAIN == (11,)
    # names the module lacks fall back to Linux/lwIP numbers
    assert eb._EMFILE == (24, 23)


def test_errno_values_on_this_interpreter_match_its_errno_module():
    import errno

    sys.path.insert(0, str(LIB))
    try:
        import edgebroker as eb
    finally:
        sys.path.remove(str(LIB))
    assert errno.EINPROGRESS in eb._EINPROGRESS
    assert errno.EAGAIN in eb._EAGAIN and errno.EWOULDBLOCK in eb._EAGAIN
    assert errno.EADDRINUSE in eb._EADDRINUSE
    assert errno.EMFILE in eb._EMFILE and errno.ENFILE in eb._EMFILE


class _Sock:
    def __init__(self, outcome):
        self.outcome = outcome
        self.addr = None

    def connect(self, addr):
        self.addr = addr
        if self.outcome is not None:
            raise OSError(self.outcome)


@pytest.fixture
def esp32_bridge():
    eb = _fresh("edgebroker", _esp32_errno())
    saved = sys.modules.get("edgebroker")
    sys.modules["edgebroker"] = eb  # edgebridge reaches the broker as `edgebroker`
    try:
        yield _fresh("edgebridge", _esp32_errno())
    finally:
        if saved is None:
            del sys.modules["edgebroker"]
        else:
            sys.modules["edgebroker"] = saved


def test_connect_in_progress_by_the_ports_own_number(esp32_bridge):
    s = _Sock(119)  # EINPROGRESS on the ESP32
    esp32_bridge._start_connect(s, ("10.0.0.1", 8883))
    assert s.addr == ("10.0.0.1", 8883)


def test_connect_complete_at_once_is_accepted(esp32_bridge):
    s = _Sock(None)  # lwIP: a loopback connect returns at once
    esp32_bridge._start_connect(s, ("127.0.0.1", 1883))
    assert s.addr == ("127.0.0.1", 1883)


def test_linux_einprogress_number_is_an_error_on_the_esp32(esp32_bridge):
    # 115 is ETIMEDOUT-like territory on newlib, not "in progress": a number
    # compared as Linux's would have hidden a failed connect
    with pytest.raises(OSError):
        esp32_bridge._start_connect(_Sock(115), ("10.0.0.1", 8883))
    with pytest.raises(OSError):
        esp32_bridge._start_connect(_Sock(104), ("10.0.0.1", 8883))


# ---- ports without a network stack or a wall clock (MicroPython's Cortex-M
# qemu port at its default settings; the WebAssembly port has no socket
# either, and make test's 32-bit measurement imports the modules there)
def _qemu_time():
    # the qemu port's time module: sleep and ticks only
    import time

    return types.SimpleNamespace(sleep=time.sleep, sleep_ms=lambda ms: time.sleep(ms / 1000),
                                 monotonic=time.monotonic)


def test_broker_imports_and_its_engine_runs_without_socket_and_wall_clock(tmp_path):
    eb = _fresh_with("edgebroker", {"socket": None, "time": _qemu_time()})
    assert eb.socket is None
    assert eb._wallclock() is None  # never set: what a board says before NTP
    cfg = eb.limits({"max_clients": 2})
    sys.path.insert(0, str(LIB))
    try:
        import edgeram
    finally:
        sys.path.remove(str(LIB))
    e = eb.Engine(cfg, edgeram.RamStore(16), lambda level, text: None)
    e.start(0.0)
    c = e.open(None, 0.0, "t:1")  # the sans-IO seam: no socket behind it
    # CONNECT (3.1.1, clean session, keep alive 60, client id "q"): CONNACK 0
    data = bytes([0x10, 13, 0, 4]) + b"MQTT" + bytes([4, 2, 0, 60, 0, 1]) + b"q"
    e.receive(c, memoryview(data), len(data), 0.0)
    e.turn(0.0)
    assert bytes(c.out)[:4] == b"\x20\x02\x00\x00"


def test_bridge_module_imports_without_socket():
    eb = _fresh_with("edgebroker", {"socket": None})
    saved = sys.modules.get("edgebroker")
    sys.modules["edgebroker"] = eb
    try:
        br = _fresh_with("edgebridge", {"socket": None})
        assert br.socket is None
    finally:
        if saved is None:
            del sys.modules["edgebroker"]
        else:
            sys.modules["edgebroker"] = saved


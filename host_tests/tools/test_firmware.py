"""firmware/ (boot.py, main.py, gateway.py): type-checked against the ESP32
and RP2 stubs, and run under the MicroPython unix port.

- mypy --strict with micropython-esp32-stubs / micropython-rp2-stubs as the
  typeshed (tools/firmware_typecheck/; the stubs live in .venv/stubs/<port>,
  installed by `make venv`).
- gateway functions under MicroPython with the stand-in network/machine
  (backoff, bounded Wi-Fi retries, background reconnects, wallclock epochs).
- the real boot.py + main.py booting on the stand-in board
  (host_tests/standin_board.py): Wi-Fi failures and retries with backoff, NTP
  failure, access point mode, missing secrets, a crash loop ending in safe
  mode and its repair, the watchdog across Ctrl-C and soft resets.

The stand-in board's files are placed directly in its sandbox from an
`edgebroker build` (test_flash.py covers copying them with mpremote).
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1]  # host_tests
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from mqtt_helpers import free_port, paho_client  # noqa: E402
from standin_board import STANDIN_DIR, StandinBoard, micropython_exe  # noqa: E402

VENV_BIN = Path(sys.executable).parent
STUBS = REPO / ".venv" / "stubs"
MYPY_INI = REPO / "tools" / "firmware_typecheck" / "mypy.ini"
PORTS = ("esp32", "rp2")


# ---------------------------------------------------------------- type checking
@pytest.mark.parametrize("port", PORTS)
def test_firmware_typechecks_against_port_stubs(port):
    """mypy --strict over firmware/ and the example app with the port's
    MicroPython stubs as typeshed."""
    stubs = STUBS / port
    if not (stubs / "stdlib" / "VERSIONS").is_file() or not (stubs / "machine.pyi").is_file():
        pytest.fail("MicroPython %s stubs missing in %s: run `make venv` (tools/setup.sh installs "
                    "tools/firmware_typecheck/%s.txt there)" % (port, stubs, port), pytrace=False)
    env = dict(os.environ)
    env["MYPYPATH"] = os.pathsep.join([str(stubs), str(REPO / "lib"), str(REPO / "firmware")])
    res = subprocess.run(
        [str(VENV_BIN / "mypy"), "--config-file", str(MYPY_INI), "--custom-typeshed-dir",
         str(stubs), "--no-incremental", "firmware/", "examples/app.py"],
        cwd=str(REPO), env=env, capture_output=True, text=True, timeout=240,
    )
    assert res.returncode == 0, "mypy (%s stubs):\n%s%s" % (port, res.stdout, res.stderr)
    assert "Success" in res.stdout


def test_firmware_imports_machine_and_network_only_in_firmware():
    """design: `machine` and `network` are imported only in firmware/."""
    for path in sorted((REPO / "lib").glob("*.py")):
        for line in path.read_text().splitlines():
            words = line.strip().split()
            if words[:1] in (["import"], ["from"]) and len(words) > 1:
                assert words[1].split(".")[0] not in ("machine", "network"), (path, line)


# ---------------------------------------------------------------- gateway under MicroPython
PRELUDE = """
import sys
sys.path.insert(0, %r)
import fake_machine, fake_network, fake_ntptime
sys.modules['machine'] = fake_machine
sys.modules['network'] = fake_network
sys.modules['ntptime'] = fake_ntptime
sys.path.insert(0, %r)
import gateway
import gwboot
""" % (str(STANDIN_DIR), str(REPO / "firmware"))


def mpy_run(code, env=None, timeout=30):
    """Run code (after PRELUDE) under the MicroPython unix port; its stdout."""
    e = dict(os.environ)
    e.update(env or {})
    res = subprocess.run([micropython_exe(), "-c", PRELUDE + code], capture_output=True,
                         text=True, timeout=timeout, env=e)
    assert res.returncode == 0, "micropython failed:\n%s\n%s" % (res.stdout, res.stderr)
    return res.stdout


def test_backoff_doubles_and_is_capped():
    out = mpy_run("print([gateway.backoff_ms(n, 1000, 30000) for n in range(1, 8)])")
    assert out.strip() == "[1000, 2000, 4000, 8000, 16000, 30000, 30000]"


def test_wifi_fails_twice_then_connects_with_backoff():
    """Two failed attempts, waits of base and 2*base between them, then connected."""
    out = mpy_run(
        "waits = []\n"
        "w = fake_network.WLAN(fake_network.STA_IF)\n"
        "ok = gwboot.connect_wifi(w, 'lab', 'pw', waits.append, attempts=5, base_ms=300,"
        " max_ms=1000, timeout_ms=2000)\n"
        "print('RESULT', ok, [x for x in waits if x != gwboot.WIFI_POLL_MS],"
        " len(fake_network.connects))\n",
        env={"STANDIN_WIFI_FAILS": "2", "STANDIN_WIFI_DELAY_MS": "0"},
    )
    assert "RESULT True [300, 600] 3" in out, out
    assert "wifi connecting to 'lab' (attempt 1 of 5)" in out
    assert "wifi attempt 1 failed (no access point found), retrying in 300 ms" in out
    assert "wifi attempt 2 failed (no access point found), retrying in 600 ms" in out
    assert "wifi connected 127.0.0.1" in out


def test_wifi_attempts_are_bounded():
    """A network that never answers: exactly `attempts` tries, capped delays, then False."""
    out = mpy_run(
        "waits = []\n"
        "w = fake_network.WLAN(fake_network.STA_IF)\n"
        "ok = gwboot.connect_wifi(w, 'lab', 'pw', waits.append, attempts=4, base_ms=300,"
        " max_ms=700, timeout_ms=1000)\n"
        "print('RESULT', ok, [x for x in waits if x != gwboot.WIFI_POLL_MS],"
        " len(fake_network.connects))\n",
        env={"STANDIN_WIFI_SSID": "other", "STANDIN_WIFI_DELAY_MS": "0"},
    )
    assert "RESULT False [300, 600, 700] 4" in out, out
    assert "wifi not connected after 4 attempts: starting the broker anyway" in out


def test_wifi_wrong_password_is_named():
    out = mpy_run(
        "w = fake_network.WLAN(fake_network.STA_IF)\n"
        "print('RESULT', gwboot.connect_wifi(w, 'lab', 'bad', lambda ms: None, attempts=1))\n",
        env={"STANDIN_WIFI_PASSWORD": "good", "STANDIN_WIFI_DELAY_MS": "0"},
    )
    assert "wifi attempt 1 failed (wrong password)" in out
    assert "RESULT False" in out


def test_background_reconnect_backs_off():
    """Link lost: reconnects from the housekeeping task, no more often than the backoff allows."""
    out = mpy_run(
        "import time\n"
        "w = fake_network.WLAN(fake_network.STA_IF)\n"
        "w.active(True)\n"
        "r = gateway.Reconnector(w, 'lab', 'pw', True, base_ms=1000, max_ms=4000)\n"
        "t0 = time.ticks_ms()\n"
        "for ms in range(0, 12000, 250):\n"  # link down all along: simulated clock
        "    r.poll(time.ticks_add(t0, ms))\n"
        "print('RESULT', len(fake_network.connects))\n",
        env={"STANDIN_WIFI_FAILS": "1000", "STANDIN_WIFI_DELAY_MS": "100000"},
    )
    # tries at 0, 1000, 3000 (+2000), 7000 (+4000), 11000 (+4000 cap)
    assert "RESULT 5" in out, out
    assert "wifi lost, reconnecting to 'lab'" in out


def test_wallclock_epochs_and_unset_clock():
    """Unix seconds from a 2000-epoch (ESP32) or 1970-epoch RTC; None when never set."""
    out = mpy_run(
        "import time\n"
        "print('E2000', gateway.unix_seconds(0, gateway.UNIX_2000))\n"
        "print('E1970', gateway.unix_seconds(1700000000, 0))\n"
        "print('OFFSET', gateway.EPOCH_OFFSET)\n"
        "t = gateway.wallclock()\n"
        "print('SET', t is not None and abs(t - time.time()) < 5)\n"
        "gateway.MIN_CLOCK_YEAR = 3000\n"
        "print('UNSET', gateway.wallclock())\n"
        "gateway._clock_synced = True\n"
        "print('SYNCED', gateway.wallclock() is not None)\n"
    )
    assert "E2000 946684800" in out
    assert "E1970 1700000000" in out
    assert "OFFSET 0" in out  # the unix port counts from 1970
    assert "SET True" in out
    assert "UNSET None" in out
    assert "SYNCED True" in out


# ---------------------------------------------------------------- boots on the stand-in board
def _paths(tmp_path):
    # the firmware's files moved into tmp_path (never the host's /crashes)
    return (
        "gateway.CRASHES_PATH = %r\n"
        "gateway.LAST_CRASH_PATH = %r\n"
        "gateway.OLD_CRASH_PATH = %r\n"
        "gateway.SAFE_FLAG_PATH = %r\n"
        % tuple(str(tmp_path / n) for n in ("crashes", "last_crash.txt", "last_crash.old.txt",
                                             "safe_mode"))
    )


def _board_json(tmp_path, **over):
    prof = json.loads((REPO / "boards" / "host.json").read_text())
    prof.update(over)
    path = tmp_path / "board.json"
    path.write_text(json.dumps(prof))
    return path


def test_a_counter_that_cannot_be_written_does_not_stop_the_boot(tmp_path):
    """A full (here: missing) filesystem place for /crashes: prepare() says
    so and the boot goes on (it stopped with OSError 28 before the broker
    started on a full littlefs without /crashes)."""
    board = _board_json(tmp_path)
    out = mpy_run(
        _paths(tmp_path / "no-such-dir")
        + "gw = gwboot.prepare(%r, %r, 30)\n" % (str(board), str(tmp_path / "secrets.json"))
        + "print('GATEWAY', gw is not None)\n"
    )
    assert "GATEWAY True" in out, out
    assert "cannot write %s" % (tmp_path / "no-such-dir" / "crashes") in out, out


def test_a_bad_safe_mode_crashes_value_is_named_and_the_default_used(tmp_path):
    board = _board_json(tmp_path, safe_mode_crashes="three")
    out = mpy_run(
        _paths(tmp_path)
        + "gw = gwboot.prepare(%r, %r, 30)\n" % (str(board), str(tmp_path / "secrets.json"))
        + "print('LIMIT', gw.safe_limit)\n"
    )
    assert "safe_mode_crashes 'three' is not an integer (0..100): using 3" in out, out
    assert "LIMIT 3" in out, out


def test_a_secrets_file_that_is_no_json_object_is_not_called_missing(tmp_path):
    bad = tmp_path / "secrets.json"
    bad.write_text('{"wifi_ssid": "lab", ')
    out = mpy_run(
        _paths(tmp_path)
        + "s = gwboot.load_secrets(%r)\n" % str(bad)
        + "gw = gateway.Gateway({'wifi_mode': 'sta'}, s)\n"
        + "print('UP', gwboot.network_up(gw), s)\n"
    )
    assert "is not valid JSON" in out and "UP False {}" in out, out
    assert "no /secrets.json" not in out, out
    assert 'needs "wifi_ssid"' in out, out


def test_an_app_crash_with_safe_mode_off_announces_no_safe_mode(tmp_path):
    out = mpy_run(
        _paths(tmp_path)
        + "import asyncio\n"
        + "class _App:\n"
        + "    @staticmethod\n"
        + "    async def run(broker, say):\n"
        + "        return ValueError('boom')\n"
        + "sys.modules['userapp'] = _App\n"
        + "gw = gateway.Gateway({}, {}, 30, 0)\n"
        + "asyncio.run(gw.app(None))\n"
    )
    assert "safe mode off: safe_mode_crashes 0" in out, out
    assert "counts toward safe mode" not in out, out


def test_safe_mode_shows_only_a_crash_since_the_last_boot_that_served(tmp_path):
    """A boot that serves clear_after_s moves the last crash aside: safe mode
    reached later by watchdog resets (which record nothing) says so instead
    of giving that older crash as the reason."""
    (tmp_path / "last_crash.txt").write_text("OldBugError: fixed last month\n")
    board = _board_json(tmp_path, safe_mode_crashes=3)
    out = mpy_run(
        _paths(tmp_path)
        + "gw = gateway.Gateway({}, {}, 0)\n"
        + "gw.tick()\n"  # served clear_after_s (0 here): the counter is cleared
        + "for _ in range(3):\n"
        + "    gwboot.prepare(%r, %r, 30)\n" % (str(board), str(tmp_path / "secrets.json"))
        + "print('SAFE', gwboot.prepare(%r, %r, 30))\n" % (str(board), str(tmp_path / "x"))
    )
    assert "crash counter cleared" in out and "SAFE None" in out, out
    assert "SAFE MODE" in out and "OldBugError" not in out, out
    assert "no crash recorded since the last boot that served 30 s" in out, out
    assert "an older one is in %s" % (tmp_path / "last_crash.old.txt") in out, out
    assert (tmp_path / "last_crash.old.txt").read_text() == "OldBugError: fixed last month\n"


def test_a_missing_gwboot_is_named_at_the_repl(tmp_path):
    out = mpy_run(_paths(tmp_path) + "del sys.modules['gwboot']\nsys.path.remove(%r)\n"
                  "gateway.main()\nprint('AT THE REPL')\n" % str(REPO / "firmware"))
    assert "cannot import gwboot" in out and "run `edgebroker flash` again" in out, out
    assert "AT THE REPL" in out


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """One `edgebroker build host` for the module (placed on each board)."""
    root = tmp_path_factory.mktemp("dist")
    res = subprocess.run([str(VENV_BIN / "edgebroker"), "build", "host", "--dist", str(root)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    return root / "host"


def place(board_root, dist_dir, profile=None, secrets=None, extra=None):
    """Put a build on a board's filesystem as flash would (without mpremote)."""
    board_root.mkdir(parents=True, exist_ok=True)
    for name in ("boot.py", "main.py", "lib"):
        src = dist_dir / name
        if src.is_dir():
            shutil.copytree(src, board_root / name, dirs_exist_ok=True)
        else:
            shutil.copyfile(src, board_root / name)
    prof = json.loads((dist_dir / "board.json").read_text())
    prof.update({"bind": "127.0.0.1", "port": free_port()})
    prof.update(profile or {})
    (board_root / "board.json").write_text(json.dumps(prof))
    if secrets is not None:
        (board_root / "secrets.json").write_text(json.dumps(secrets))
    for name, text in (extra or {}).items():
        (board_root / name).write_text(text)
    return prof


SECRETS = {"wifi_ssid": "lab", "wifi_password": "pw-12345678", "ap_password": "ap-12345678"}


@pytest.fixture
def boards(tmp_path):
    started = []

    def start(name="board", **kw):
        b = StandinBoard(tmp_path / name, log_path=tmp_path / (name + ".log"), **kw).start()
        started.append(b)
        return b

    yield start
    for b in started:
        b.stop()


def mpremote(board, *args, timeout=30):
    """`mpremote connect URL resume ARGS...`; failures show the board's console."""
    try:
        res = subprocess.run([str(VENV_BIN / "mpremote"), "connect", board.url, "resume", *args],
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail("mpremote %s: no result in %d s; board console:\n%s"
                    % (args, timeout, board.console()[-4000:]), pytrace=False)
    assert res.returncode == 0, "mpremote %s: %s%s\nconsole:\n%s" % (
        args, res.stdout, res.stderr, board.console()[-4000:])
    return res.stdout


def test_boot_wifi_retries_with_backoff_ntp_fails_broker_serves(boards, dist, tmp_path):
    """main.py: Wi-Fi fails twice (backoff 1 s, 2 s), NTP fails, the broker
    still starts and serves MQTT; the clock is reported unset."""
    prof = place(tmp_path / "board", dist, {"ntp": True}, SECRETS)
    b = boards(env={"STANDIN_WIFI_FAILS": "2", "STANDIN_NTP": "fail"})
    assert b.wait_console("edgebroker listening on", timeout=20), b.console()
    text = b.console()
    assert "edgebroker: boot (power-on reset)" in text
    assert "wifi attempt 1 failed (no access point found), retrying in 1000 ms" in text
    assert "wifi attempt 2 failed (no access point found), retrying in 2000 ms" in text
    assert "wifi connecting to 'lab' (attempt 3 of 6)" in text
    assert "edgebroker: wifi connected 127.0.0.1" in text
    assert "clock not set: ntp pool.ntp.org failed" in text
    c = paho_client(prof["port"], client_id="fw-check")
    try:
        c.publish_wait("fw/x", b"1", qos=1)
    finally:
        c.close()
    assert (tmp_path / "board" / "crashes").read_text() == "1"  # cleared after 30 s of serving


def test_boot_access_point_mode(boards, dist, tmp_path):
    place(tmp_path / "board", dist, {"wifi_mode": "ap", "ap_ssid": "gw-test"}, SECRETS)
    b = boards()
    assert b.wait_console("edgebroker listening on", timeout=15), b.console()
    assert "access point 'gw-test' up, address 127.0.0.1" in b.console()
    assert "wifi connecting" not in b.console()


def test_boot_without_secrets_stays_at_repl(boards, dist, tmp_path):
    """No /secrets.json: a clear message, radio off, no broker, no crash
    counted, and the REPL answers (the documented choice)."""
    prof = place(tmp_path / "board", dist, {}, secrets=None)
    b = boards()
    assert b.wait_console(lambda t: t.rstrip().endswith(">>>"), timeout=15), b.console()
    text = b.console()
    assert "edgebroker: no /secrets.json: Wi-Fi stays off and the broker is not started." in text
    assert "copy firmware/secrets.example.json to firmware/secrets.json" in text
    assert "listening" not in text
    assert (tmp_path / "board" / "crashes").read_text() == "0"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", prof["port"]), timeout=1).close()
    assert "42" in mpremote(b, "exec", "print(6 * 7)")


def test_crash_loop_ends_in_safe_mode_and_repairs(boards, dist, tmp_path):
    """The broker cannot start (its port is taken): crash, reset, crash,
    reset, then safe mode at the limit: no broker, the REPL answers and says
    why. gateway.clear() and a reset bring the broker back once the cause is gone."""
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(1)
    port = blocker.getsockname()[1]
    place(tmp_path / "board", dist, {"port": port, "safe_mode_crashes": 2}, SECRETS)
    try:
        b = boards()
        assert b.wait_console("SAFE MODE", timeout=30), b.console()
        assert b.wait_console(lambda t: t.rstrip().endswith(">>>"), timeout=5)
        text = b.console()
        assert text.count("edgebroker: crashed (OSError(98") == 2, text
        assert [c for _m, c in b.boots] == ["power", "hard", "hard"]
        assert ("SAFE MODE: broker not started: 2 boots in a row ended before the broker had "
                "served 30 s, or their app.py crashed in that time (safe_mode_crashes 2)") in text
        assert "last crash (/last_crash.txt):" in text
        assert "EADDRINUSE" in (tmp_path / "board" / "last_crash.txt").read_text()
        assert len(b.boots) == 3  # safe mode broke the loop
    finally:
        blocker.close()
    # the cause is gone: leave safe mode from the REPL and reset
    out = mpremote(b, "exec", "import gateway; gateway.clear()")
    assert "safe mode cleared" in out
    n = b.console_len()
    mpremote(b, "exec", "--no-follow", "import machine; machine.reset()")  # as `mpremote reset`
    assert b.wait_console("edgebroker listening on", timeout=20, start=n), b.console(n)
    assert "edgebroker: boot (hard reset)" in b.console(n)


def test_watchdog_survives_ctrl_c_and_fires_after_a_raw_soft_reset(boards, dist, tmp_path):
    """watchdog_ms on: fed by the housekeeping task while serving; after Ctrl-C a timer
    keeps feeding it (mpremote works); a soft reset from the raw REPL stops
    that timer, the watchdog fires, and the board boots the broker again."""
    place(tmp_path / "board", dist, {"watchdog_ms": 2500}, SECRETS)
    b = boards()
    assert b.wait_console("edgebroker listening on", timeout=15), b.console()
    assert "edgebroker: watchdog 2500 ms" in b.console()
    time.sleep(3.5)  # longer than the timeout: the housekeeping task feeds it
    assert len(b.boots) == 1
    out = mpremote(b, "exec", "import time; time.sleep(3.5); print('still here')")
    assert "still here" in out  # Ctrl-C stopped the broker; the timer fed the watchdog
    assert len(b.boots) == 1
    text = b.console()
    assert "edgebroker: stopped by Ctrl-C; at the REPL" in text
    assert "fed for 600 s (maintenance)" in text
    assert (tmp_path / "board" / "crashes").read_text() == "0"  # Ctrl-C is not a crash
    n = b.console_len()
    res = subprocess.run([str(VENV_BIN / "mpremote"), "connect", b.url, "soft-reset"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr
    assert b.wait_console("standin: watchdog reset", timeout=10, start=n), b.console(n)
    assert b.wait_console("edgebroker listening on", timeout=15, start=n), b.console(n)
    assert "edgebroker: boot (watchdog reset)" in b.console(n)
    assert [c for _m, c in b.boots] == ["power", "soft", "wdt"]


# ---------------------------------------------------------------- the user's app (/app.py)
# main.py as flashed, but with a 2 s boot window (gateway.main's clear_after_s)
# so that "at boot" and "later" both happen within a test.
SHORT_BOOT_MAIN = "import gateway\ngateway.main(clear_after_s=2)\n"

APP_RAISES_AT_START = """
async def main(broker):
    raise ValueError("boom at start")
"""

APP_RAISES_LATER = """
import asyncio

async def report(broker):
    # beside the app: publishes the engine's app error count after the crash
    while True:
        broker.publish("test/app_errors", str(broker.engine.app_errors), retain=True)
        await asyncio.sleep(0.2)

async def main(broker):
    broker.publish("sensors/gw1/temperature", "21.50", qos=1, retain=True)
    asyncio.create_task(report(broker))
    for _ in range(100):  # past the 2 s boot window: until the gateway cleared the counter
        await asyncio.sleep(0.2)
        with open("/crashes") as f:
            if f.read() == "0":
                break
    raise RuntimeError("boom later")
"""


def reset_board(board):
    """A hard reset from outside (reset button, power cut): no Ctrl-C first."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.sendto(b"reset", ("127.0.0.1", board.ctl_port))
    finally:
        s.close()


def retained_payload(port, topic, client_id="fw-sub"):
    c = paho_client(port, client_id=client_id)
    try:
        c.subscribe_wait(topic, qos=1)
        msg = c.wait_messages(1, timeout=5)[0]
        assert msg.retain, topic
        return msg.payload
    finally:
        c.close()


def test_app_crash_at_boot_keeps_the_broker_and_counts_toward_safe_mode(boards, dist, tmp_path):
    """/app.py whose main() raises at once: traceback and message on the
    console, the broker serves (a real client round-trips a retained
    message), the crash counter is not cleared after the boot window, and
    safe_mode_crashes such boots in a row (reset from outside) end in safe mode
    with the app's traceback as the last crash."""
    prof = place(tmp_path / "board", dist, {"safe_mode_crashes": 2}, SECRETS,
                 extra={"main.py": SHORT_BOOT_MAIN, "app.py": APP_RAISES_AT_START})
    b = boards()
    assert b.wait_console("crash counter stays 1", timeout=20), b.console()
    text = b.console()
    assert "edgebroker: app: starting app.py main()" in text
    assert "ValueError: boom at start" in text  # the traceback
    assert ("edgebroker: app: app.py crashed (ValueError('boom at start',)); the broker goes on, "
            "app errors 1") in text, text  # MicroPython's repr of an exception
    assert ("edgebroker: app.py crashed at boot: this boot counts toward safe mode (crash "
            "counter 1, safe mode at 2)") in text
    assert "crash counter cleared" not in text
    assert (tmp_path / "board" / "crashes").read_text() == "1"
    assert "boom at start" in (tmp_path / "board" / "last_crash.txt").read_text()
    pub = paho_client(prof["port"], client_id="fw-pub")
    try:
        pub.publish_wait("fw/state", b"up", qos=1, retain=True)
    finally:
        pub.close()
    assert retained_payload(prof["port"], "fw/state") == b"up"

    n = b.console_len()
    reset_board(b)  # second boot: the app crashes at boot again
    assert b.wait_console("crash counter stays 2", timeout=20, start=n), b.console(n)
    n = b.console_len()
    reset_board(b)  # third boot: safe mode
    assert b.wait_console("SAFE MODE", timeout=20, start=n), b.console(n)
    assert b.wait_console(lambda t: t.rstrip().endswith(">>>"), timeout=5, start=n)
    text = b.console(n)
    assert ("SAFE MODE: broker not started: 2 boots in a row ended before the broker had "
            "served 2 s, or their app.py crashed in that time (safe_mode_crashes 2)") in text
    assert "boom at start" in text  # the last crash shown
    assert "app: starting" not in text and "listening" not in text
    assert [c for _m, c in b.boots] == ["power", "hard", "hard"]


def test_app_crash_later_is_counted_and_not_restarted(boards, dist, tmp_path):
    """/app.py that publishes a retained reading, then raises after the boot
    window: the crash is printed and counted in broker.engine.app_errors,
    the crash counter is cleared as usual, the app is not restarted, and the
    broker keeps serving: a new client gets the app's retained reading."""
    prof = place(tmp_path / "board", dist, {}, SECRETS,
                 extra={"main.py": SHORT_BOOT_MAIN, "app.py": APP_RAISES_LATER})
    b = boards()
    assert b.wait_console("app.py is not restarted until the next reset", timeout=20), b.console()
    text = b.console()
    assert "up 2 s: crash counter cleared" in text
    assert "RuntimeError: boom later" in text
    assert "the broker goes on, app errors 1" in text
    assert "crashed at boot" not in text
    assert text.count("app: starting app.py main()") == 1
    assert (tmp_path / "board" / "crashes").read_text() == "0"
    assert not (tmp_path / "board" / "last_crash.txt").exists()
    assert retained_payload(prof["port"], "sensors/gw1/temperature") == b"21.50"
    assert retained_payload(prof["port"], "test/app_errors", "fw-sub2") == b"1"
    assert len(b.boots) == 1


def test_no_app_file_runs_the_broker_alone(boards, dist, tmp_path):
    """Without /app.py nothing about an app is printed and nothing is counted."""
    prof = place(tmp_path / "board", dist, {}, SECRETS)
    b = boards()
    assert b.wait_console("edgebroker listening on", timeout=15), b.console()
    pub = paho_client(prof["port"], client_id="fw-pub")
    try:
        pub.publish_wait("fw/x", b"1", qos=1)
    finally:
        pub.close()
    assert "app:" not in b.console()


APP_LOOKS_AT_THE_BOOT = """
import sys

async def main(broker):
    print("app: gwboot loaded", "gwboot" in sys.modules, "gateway loaded", "gateway" in sys.modules)
"""


def test_the_boot_steps_are_dropped_before_the_broker_serves(boards, dist, tmp_path):
    """firmware/gwboot.py (the profile, safe mode, secrets, the first Wi-Fi
    connect, starting the broker) is gone from sys.modules once the broker
    serves: its bytecode is heap on a board. The app, beside the serving
    broker, sees gateway loaded and gwboot not, and the broker serves."""
    prof = place(tmp_path / "board", dist, {}, SECRETS, extra={"app.py": APP_LOOKS_AT_THE_BOOT})
    b = boards()
    assert b.wait_console("app: gwboot loaded", timeout=15), b.console()
    assert "app: gwboot loaded False gateway loaded True" in b.console()
    pub = paho_client(prof["port"], client_id="fw-pub")
    try:
        pub.publish_wait("fw/x", b"1", qos=1)
    finally:
        pub.close()


def test_manifest_freezes_every_board_module():
    """Issue 12 item 2: firmware/freeze/manifest.py (FROZEN_MANIFEST for a firmware
    build) names the port's manifest and every module the board imports,
    with paths that exist. Read with stand-ins for the manifest functions
    of MicroPython's tools/manifestfile.py."""
    manifest = REPO / "firmware" / "freeze" / "manifest.py"
    seen = []
    includes = []

    def module(path, base_path=".", opt=None):
        seen.append((manifest.parent / base_path / path).resolve())

    def include(path, **kw):
        includes.append(path)

    exec(compile(manifest.read_text(), str(manifest), "exec"),
         {"module": module, "include": include, "package": None, "require": None})
    assert includes == ["$(PORT_DIR)/boards/manifest.py"]
    missing = [p for p in seen if not p.is_file()]
    assert not missing, missing
    names = {p.name for p in seen}
    assert {p.name for p in (REPO / "lib").glob("*.py")} <= names
    # every firmware module but the entry points, which stay on the filesystem
    board = {p.name for p in (REPO / "firmware").glob("*.py")} - {"boot.py", "main.py"}
    assert board == {"gateway.py", "gwboot.py", "userapp.py"}
    assert board <= names
    assert not {"boot.py", "main.py"} & names  # they stay on the filesystem


def test_flash_knows_every_secrets_key_the_firmware_reads():
    """`edgebroker flash` refuses a secrets file key it does not know (was:
    any key, any type): its list must hold every key the example ships,
    the gateway reads (gwboot: s.get("...")) and the broker merges
    (edgeconf.with_secrets: users, bridges), with the example's types."""
    sys.path.insert(0, str(REPO / "tools"))
    from edgebroker_tools.commands import flash

    example = json.loads((REPO / "firmware" / "secrets.example.json").read_text())
    assert set(example) == set(flash.SECRET_KEYS)
    assert flash.secrets_issues(example) == []
    read = set(re.findall(r'\bs\.get\("(\w+)"\)', (REPO / "firmware" / "gwboot.py").read_text()))
    assert read and read <= set(flash.SECRET_KEYS), read
    assert {"users", "bridges"} <= set(flash.SECRET_KEYS)
    assert flash.secrets_issues({"wifi_ssid": 5, "bogus": 1}) == [
        "wifi_ssid = 5: must be a string, not integer",
        "bogus = 1: unknown key (a secrets file has wifi_ssid, wifi_password, ap_password, "
        "users, bridges)",
    ]


def test_ntp_due_while_wifi_is_down_for_days_syncs_when_it_is_back():
    """An NTP sync due while Wi-Fi is down left its deadline (a ticks_ms
    value) to fall behind; past half of ticks_ms' period (2**29 ms, 6.2 days
    on a board) ticks_diff reads it as ahead, and the sync waited up to
    6 days more once Wi-Fi was back (soak audit, from reading). A due sync
    now stays due at the current tick while Wi-Fi is down. The board's
    ticks (30 bits, wrapping) are stood in for, a day a tick."""
    out = mpy_run(
        "import time as _rt\n"
        "class T:\n"
        "    now = 0\n"
        "    gmtime = _rt.gmtime\n"
        "    time = _rt.time\n"
        "    @staticmethod\n"
        "    def ticks_ms():\n"
        "        return T.now & 0x3FFFFFFF\n"
        "    @staticmethod\n"
        "    def ticks_diff(a, b):\n"
        "        d = (a - b) & 0x3FFFFFFF\n"
        "        return d - 0x40000000 if d >= 0x20000000 else d\n"
        "    @staticmethod\n"
        "    def ticks_add(a, d):\n"
        "        return (a + d) & 0x3FFFFFFF\n"
        "gateway.time = T\n"
        "class W:\n"
        "    up = False\n"
        "    def poll(self, now):\n"
        "        pass\n"
        "g = gateway.Gateway({}, None)\n"
        "g.boot_over = True\n"
        "g.wifi = W()\n"
        "g.ntp = True\n"
        "n = len(fake_ntptime.calls)\n"
        "for day in range(1, 8):  # due from the start, Wi-Fi down 7 days\n"
        "    T.now = day * 86400000\n"
        "    g.tick()\n"
        "g.wifi.up = True\n"
        "T.now += 1000\n"
        "g.tick()\n"
        "print('RESULT', len(fake_ntptime.calls) - n)\n"
    )
    assert "RESULT 1" in out, out

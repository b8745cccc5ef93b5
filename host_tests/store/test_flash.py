"""`edgebroker build` and `edgebroker flash`, end to end without hardware.

The board is host_tests/standin_board.py: the MicroPython unix port behind a
raw-REPL bridge on socket://127.0.0.1:N. The real `edgebroker flash` runs
the real mpremote against it (copy, sha256 verification on the board, soft
reset), the flashed main.py boots the broker inside that interpreter, and
a real MQTT client (paho) publishes a retained message and gets it back.
esptool is not run (no chip here): its command lines are checked through
--dry-run and esptool_commands().
"""

import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1]  # host_tests
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tools"))

from mqtt_helpers import free_port, mosquitto_sub, paho_client, wait_for  # noqa: E402
from standin_board import STANDIN_DIR, StandinBoard, micropython_exe  # noqa: E402

from edgebroker_tools.commands import build as build_cmd  # noqa: E402
from edgebroker_tools.commands import flash as flash_cmd  # noqa: E402

VENV_BIN = Path(sys.executable).parent
EDGEBROKER = str(VENV_BIN / "edgebroker")
EXAMPLE_APP = REPO / "examples" / "app.py"
SECRETS = {"wifi_ssid": "lab", "wifi_password": "pw-12345678", "users": {}}


def edgebroker(*args, timeout=180):
    res = subprocess.run([EDGEBROKER, *args], capture_output=True, text=True, timeout=timeout,
                         cwd=str(REPO))
    return res


@pytest.fixture
def board(tmp_path):
    b = StandinBoard(tmp_path / "board", log_path=tmp_path / "board.log").start()
    yield b
    b.stop()


@pytest.fixture
def secrets(tmp_path):
    p = tmp_path / "secrets.json"
    p.write_text(json.dumps(SECRETS))
    return p


def flash(board, profile, port, secrets, dist, *extra):
    res = edgebroker("flash", profile, "--port", board.url, "--dist", str(dist),
                     "--secrets", str(secrets), "--set", "port=%d" % port,
                     "--set", "bind=127.0.0.1", *extra)
    assert res.returncode == 0, "flash failed (%d):\n%s\n%s\nconsole:\n%s" % (
        res.returncode, res.stdout, res.stderr, board.console()[-4000:])
    return res.stdout


def retained_roundtrip(port, topic, payload):
    """Publish retained (QoS 1), then a new client subscribes and gets it."""
    pub = paho_client(port, client_id="flash-pub")
    try:
        pub.publish_wait(topic, payload, qos=1, retain=True)
    finally:
        pub.close()
    return retained_of(port, topic)


def retained_of(port, topic):
    sub = paho_client(port, client_id="flash-sub")
    try:
        sub.subscribe_wait(topic, qos=1)
        msg = sub.wait_messages(1, timeout=5)[0]
        assert msg.retain
        return msg.payload
    finally:
        sub.close()


# ---------------------------------------------------------------- end to end
def test_flash_host_profile_end_to_end(board, secrets, tmp_path):
    """Empty stand-in board -> `edgebroker flash host --port socket://...`:
    build, mpremote copy, sha256 verify, soft reset, broker up; a retained
    message goes in and comes back. Then a tampered file is caught by the
    verification step."""
    port = free_port()
    dist = tmp_path / "dist"
    out = flash(board, "host", port, secrets, dist)
    assert "edgebroker build: host ->" in out  # nothing built yet: built first
    # the host profile keeps its retained messages in RAM: edgeram, not edgestore
    for f in ("lib/edgebroker.mpy", "lib/edgeconf.mpy", "lib/edgeram.mpy", "lib/gateway.mpy",
              "lib/gwboot.mpy", "lib/userapp.mpy", "boot.py", "main.py", "board.json",
              "secrets.json"):
        assert "copy %s" % f in out, out
    assert "verified 10 files by sha256" in out
    assert "board | edgebroker: wifi connected 127.0.0.1" in out
    assert "board | edgebroker listening on 127.0.0.1:%d (micropython)" % port in out
    assert "host flashed, verified, broker running" in out
    assert "[########################] 100%" in out
    assert set(board.files()) >= {"boot.py", "main.py", "board.json", "secrets.json", "crashes",
                                  "lib/edgebroker.mpy", "lib/edgeconf.mpy", "lib/edgeram.mpy",
                                  "lib/gateway.mpy", "lib/gwboot.mpy", "lib/userapp.mpy"}
    assert "lib/edgestore.mpy" not in board.files()
    assert "safe_mode" not in board.files() and "app.py" not in board.files()
    on_board = json.loads((board.root / "board.json").read_text())
    assert on_board["port"] == port and on_board["bind"] == "127.0.0.1"
    assert (board.root / "lib" / "gateway.mpy").read_bytes() == (
        dist / "host" / "lib" / "gateway.mpy").read_bytes()

    assert retained_roundtrip(port, "site/a/temp", b"21.5") == b"21.5"

    # verification compares hashes computed on the board
    (board.root / "lib" / "gateway.mpy").write_bytes(b"M\x06\x00\x1fdamaged")
    target = build_cmd.load_target("host", ["port=%d" % port, "bind=127.0.0.1"])
    plan = flash_cmd.make_plan(target, board.url, dist, secrets, None, None, False, 0)
    bad = flash_cmd.verify_on_board(plan)
    assert [p for p, _h in bad] == ["/lib/gateway.mpy"]


def test_flash_frozen_profile_needs_a_firmware_with_the_broker_frozen_in(board, secrets, tmp_path):
    """frozen: true ships none of the frozen modules, so a firmware without
    them (the stand-in board: the MicroPython unix port, nothing of ours
    frozen) is refused before anything is written: one line saying what to
    flash, no file copied, no safe-mode marker left behind."""
    res = edgebroker("flash", "host", "--port", board.url, "--dist", str(tmp_path / "dist"),
                     "--secrets", str(secrets), "--set", "frozen=true")
    assert res.returncode != 0, res.stdout + res.stderr
    assert "frozen = true, but the firmware on %s has no frozen edgebroker" % board.url in (
        res.stderr), res.stderr
    assert "firmware/freeze/manifest.py" in res.stderr
    files = set(board.files())
    assert "safe_mode" not in files and "board.json" not in files, files
    assert not [f for f in files if f.startswith("lib/")], files


def test_reflash_running_esp32_gateway_keeps_retained_on_flash(secrets, tmp_path):
    """The esp32 profile (board-sized heap, watchdog, flash store) flashed,
    then flashed again while its broker runs: mpremote's Ctrl-C stops it, the
    watchdog is fed meanwhile, unchanged files are skipped, and the retained
    message stored on flash survives the reboot."""
    prof = json.loads((REPO / "boards" / "esp32.json").read_text())
    b = StandinBoard(tmp_path / "board", heap="%dw" % prof["heap_bytes"],  # in 32-bit words
                     log_path=tmp_path / "board.log").start()
    try:
        port = free_port()
        dist = tmp_path / "dist"
        flash(b, "esp32", port, secrets, dist, "--set", "watchdog_ms=3000")
        assert "edgebroker: watchdog 3000 ms" in b.console()
        assert "clock set by ntp pool.ntp.org" in b.console()
        assert retained_roundtrip(port, "site/b/state", b"open") == b"open"
        assert (b.root / "data" / "retained.ebrs").is_file()

        out = flash(b, "esp32", port, secrets, dist, "--set", "watchdog_ms=3000",
                    "--set", "log_level=warning")
        assert "edgebroker build: esp32 ->" in out  # the profile changed: rebuilt
        assert "same lib/edgebroker.mpy" in out  # mpremote skipped what the board has
        assert "copy board.json" in out
        # the bar counts what was done: each file once, copied or skipped,
        # and it reaches 100% at the last step only
        bars = bar_lines(out)
        files = [label.split()[1] for _pct, label in bars
                 if label.startswith(("copy ", "same "))]
        assert sorted(files) == sorted(["lib/edgebroker.mpy", "lib/edgeconf.mpy",
                                        "lib/edgestore.mpy", "lib/edgeopen.mpy", "lib/gateway.mpy",
                                        "lib/gwboot.mpy", "lib/userapp.mpy", "boot.py", "main.py",
                                        "board.json", "secrets.json"]), bars
        pcts = [pct for pct, _label in bars]
        assert pcts == sorted(set(pcts)) and pcts[-1] == 100 and pcts[-2] < 100, bars
        assert "edgebroker: stopped by Ctrl-C" in b.console()
        assert "wdt" not in [cause for _mode, cause in b.boots], b.boots
        assert retained_of(port, "site/b/state") == b"open"
    finally:
        b.stop()


def bar_lines(out):
    """(percent, label) of each progress bar line of a flash's output."""
    found = []
    for line in out.splitlines():
        m = re.match(r"^\[[#-]+\] +(\d+)% (.*)$", line)
        if m:
            found.append((int(m.group(1)), m.group(2)))
    return found


def test_copy_progress_counts_each_file_once(tmp_path):
    """mpremote prints "cp SRC :DEST" before each file and "Up to date: DEST"
    after it when the board's copy matched: one step per file, "same" or
    "copy", never both, so the bar is not full before the last step."""
    copies = [flash_cmd.CopyItem(tmp_path / n, r, size) for n, r, size in (
        ("a.mpy", "/lib/a.mpy", 100), ("main.py", "/main.py", 20), ("board.json", "/board.json", 5))]
    fake = tmp_path / "fake_mpremote.py"
    fake.write_text(
        "print('cp %s :/lib/a.mpy')\n"
        "print('Up to date: /lib/a.mpy')\n"
        "print('cp %s :/main.py')\n"
        "print('cp %s :/board.json')\n" % (copies[0].local, copies[1].local, copies[2].local))
    out = io.StringIO()
    progress = flash_cmd.Progress(len(copies) + 2, out)  # + prepare, verify
    progress.step("prepare")
    flash_cmd.run_copy([sys.executable, str(fake)], copies, progress)
    assert [label for _pct, label in bar_lines(out.getvalue())] == [
        "prepare", "same lib/a.mpy (100 bytes)", "copy main.py (20 bytes)",
        "copy board.json (5 bytes)"]
    assert [pct for pct, _label in bar_lines(out.getvalue())] == [20, 40, 60, 80]


def test_flash_app_runs_the_example_and_is_kept_by_a_flash_without_app(secrets, tmp_path):
    """`flash esp32 --app examples/app.py` on a board-sized heap: the app is
    copied to /app.py and verified; its retained reading reaches a real
    subscriber (paho) and mosquitto_sub, and a command a real client
    publishes reaches it. Flashing again without --app keeps /app.py as it
    was, and the app runs again after the reset."""
    prof = json.loads((REPO / "boards" / "esp32.json").read_text())
    b = StandinBoard(tmp_path / "board", heap="%dw" % prof["heap_bytes"],  # in 32-bit words
                     log_path=tmp_path / "board.log").start()
    try:
        port = free_port()
        dist = tmp_path / "dist"
        out = flash(b, "esp32", port, secrets, dist, "--app", str(EXAMPLE_APP))
        assert "copy app.py" in out, out
        assert (b.root / "app.py").read_bytes() == EXAMPLE_APP.read_bytes()
        assert b.wait_console("edgebroker: app: starting app.py main()", timeout=10), b.console()

        sub = paho_client(port, client_id="app-sub")
        try:
            sub.subscribe_wait("sensors/gw1/temperature", qos=1)
            first = sub.wait_messages(1, timeout=5)[0]
            assert first.retain and 15.0 <= float(first.payload) <= 30.0
            sub.wait_messages(3, timeout=10)  # live readings follow, one a second
            sub.subscribe_wait("state/gw1/led", qos=1)
            sub.clear_messages()
            pub = paho_client(port, client_id="app-cmd")
            try:
                pub.publish_wait("cmd/gw1/led", b"on", qos=1)
            finally:
                pub.close()
            assert wait_for(lambda: any(m.topic == "state/gw1/led" for m in sub.get_messages()),
                            timeout=5), sub.get_messages()
            led = [m for m in sub.get_messages() if m.topic == "state/gw1/led"]
            assert led[0].payload == b"on"
        finally:
            sub.close()
        assert b.wait_console("app: led on", timeout=5), b.console()
        got = mosquitto_sub(port, ["-t", "sensors/gw1/temperature"], count=1)
        assert 15.0 <= float(got[0]) <= 30.0, got

        n = b.console_len()
        out = flash(b, "esp32", port, secrets, dist)  # no --app: /app.py stays
        assert "app.py" not in out.replace("board | ", ""), out
        assert (b.root / "app.py").read_bytes() == EXAMPLE_APP.read_bytes()
        assert b.wait_console("edgebroker: app: starting app.py main()", timeout=10, start=n)
        assert retained_of(port, "state/gw1/led") == b"on"
        assert "crashed" not in b.console()
    finally:
        b.stop()


def test_flash_app_is_checked_before_the_board_is_touched(tmp_path):
    """--app with a syntax error, an empty file or a missing file: exit 2,
    one line, nothing run; the dry run copies a good one to /app.py."""
    bad = tmp_path / "bad.py"
    bad.write_text("async def main(broker)\n    pass\n")
    res = edgebroker("flash", "host", "--port", "/dev/ttyUSB9", "--app", str(bad), "--dry-run")
    assert res.returncode == 2 and "mpy-cross failed on" in res.stderr, res.stderr
    empty = tmp_path / "empty.py"
    empty.write_text("\n")
    res = edgebroker("flash", "host", "--port", "/dev/ttyUSB9", "--app", str(empty), "--dry-run")
    assert res.returncode == 2 and "is empty" in res.stderr, res.stderr
    res = edgebroker("flash", "host", "--port", "/dev/ttyUSB9", "--app",
                     str(tmp_path / "nope.py"), "--dry-run")
    assert res.returncode == 2 and "app file not found" in res.stderr, res.stderr
    nomain = tmp_path / "nomain.py"
    nomain.write_text("x = 1\n")
    lines, err = dry_run_lines("host", "--port", "/dev/ttyUSB9", "--app", str(nomain),
                               "--dist", str(tmp_path / "dist"))
    assert "has no `async def main(broker)`" in err
    copy = shlex.split(next(x for x in lines if " fs cp " in x))
    assert copy[copy.index(":/app.py") - 1] == str(nomain)
    lines, _err = dry_run_lines("host", "--port", "/dev/ttyUSB9", "--dist", str(tmp_path / "d2"))
    assert not any(":/app.py" in x for x in lines)  # without --app nothing touches /app.py


# ---------------------------------------------------------------- dry run, esptool
def dry_run_lines(*args):
    """The dry run's output as commands: one per line, or more lines where a
    quoted argument (the MicroPython code given to `mpremote exec`) spans them."""
    res = edgebroker("flash", *args, "--dry-run")
    assert res.returncode == 0, res.stdout + res.stderr
    cmds, acc = [], ""
    for line in res.stdout.splitlines():
        acc = acc + "\n" + line if acc else line
        try:
            shlex.split(acc, comments=True)
        except ValueError:  # inside a quoted multi-line argument
            continue
        cmds.append(acc)
        acc = ""
    assert not acc, "unterminated quoting in the dry run: %r" % acc
    return cmds, res.stderr


def test_dry_run_esp32_prints_esptool_then_mpremote(tmp_path):
    lines, _err = dry_run_lines("esp32", "--port", "/dev/ttyUSB9", "--firmware", "fw.bin",
                                "--erase", "--dist", str(tmp_path))
    cmds = [shlex.split(x, comments=True) for x in lines if not x.startswith("#")]
    esptool = [c for c in cmds if "esptool" in Path(c[0]).name]
    assert [c[1:] for c in esptool] == [
        ["--chip", "esp32", "--port", "/dev/ttyUSB9", "erase-flash"],
        ["--chip", "esp32", "--port", "/dev/ttyUSB9", "--baud", "460800", "write-flash", "-z",
         "0x1000", "fw.bin"],
    ]
    mp = [c for c in cmds if Path(c[0]).name == "mpremote"]
    assert all(c[1:4] == ["connect", "/dev/ttyUSB9", "resume"] for c in mp)
    copy = next(c for c in mp if c[4:6] == ["fs", "cp"])
    assert ":/lib/edgebroker.mpy" in copy and ":/main.py" in copy and ":/board.json" in copy
    assert any("hashlib" in " ".join(c) for c in mp)  # the verification step
    assert any(x.startswith("edgebroker build") for x in lines)  # no build yet in tmp_path
    assert not (tmp_path / "esp32").exists()  # a dry run builds nothing


def test_dry_run_esp32s3_offset_is_zero(tmp_path):
    lines, _err = dry_run_lines("esp32s3", "--port", "socket://127.0.0.1:9", "--firmware",
                                "s3.bin", "--dist", str(tmp_path))
    write = [shlex.split(x, comments=True) for x in lines if "write-flash" in x]
    assert len(write) == 1 and write[0][-2:] == ["0x0", "s3.bin"]
    assert ["--chip", "esp32s3"] == write[0][1:3]
    assert not any("erase-flash" in x for x in lines)


@pytest.mark.parametrize("chip,offset", [("esp32", "0x1000"), ("esp32s2", "0x1000"),
                                         ("esp32s3", "0x0"), ("esp32c3", "0x0"),
                                         ("esp32c6", "0x0")])
def test_esptool_commands_per_chip(chip, offset):
    cmds = flash_cmd.esptool_commands(chip, "COM3", Path("mp.bin"), erase=True, baud=921600)
    assert cmds == [
        ["esptool", "--chip", chip, "--port", "COM3", "erase-flash"],
        ["esptool", "--chip", chip, "--port", "COM3", "--baud", "921600", "write-flash", "-z",
         offset, "mp.bin"],
    ]
    assert flash_cmd.esptool_commands(chip, "COM3", Path("mp.bin"), erase=False)[0][5] == "--baud"


def test_rp2_firmware_gets_the_bootsel_message():
    res = edgebroker("flash", "rp2040_picow", "--port", "/dev/ttyACM9", "--firmware", "mp.uf2",
                     "--dry-run")
    assert res.returncode == 2
    assert "BOOTSEL" in res.stderr and ".uf2" in res.stderr


def test_flash_refuses_a_tcp_port_number_and_erase_without_firmware():
    res = edgebroker("flash", "esp32", "--port", "1883", "--dry-run")
    assert res.returncode == 2 and "looks like a TCP port number" in res.stderr
    res = edgebroker("flash", "esp32", "--port", "/dev/ttyUSB9", "--erase", "--dry-run")
    assert res.returncode == 2 and "--erase needs --firmware" in res.stderr


def test_missing_secrets_file_is_a_warning_or_copied(tmp_path):
    lines, err = dry_run_lines("host", "--port", "/dev/ttyUSB9", "--dist", str(tmp_path))
    copy = next(x for x in lines if " fs cp " in x)
    if (REPO / "firmware" / "secrets.json").is_file():
        assert ":/secrets.json" in copy
    else:
        assert "warning: no secrets file" in err
        assert ":/secrets.json" not in copy
    res = edgebroker("flash", "host", "--port", "/dev/ttyUSB9", "--secrets",
                     str(tmp_path / "nope.json"), "--dry-run")
    assert res.returncode == 2 and "secrets file not found" in res.stderr


# ---------------------------------------------------------------- build
def test_build_reports_sizes_and_fails_over_budget(tmp_path):
    res = edgebroker("build", "esp32", "--dist", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "lib/edgebroker.mpy" in res.stdout and "code_budget_bytes" in res.stdout
    man = json.loads((tmp_path / "esp32" / "manifest.json").read_text())
    assert man["bytecode_bytes"] == sum(
        (tmp_path / "esp32" / f["path"]).stat().st_size for f in man["files"]
        if f["path"].endswith(".mpy"))
    assert not (tmp_path / "esp32" / "romfs.img").exists()
    # a budget config check refuses stops both commands before they build or copy
    for cmd in (["build", "esp32"], ["flash", "esp32", "--port", "/dev/ttyUSB9"]):
        res = edgebroker(*cmd, "--dist", str(tmp_path / "refused"), "--set",
                         "code_budget_bytes=1000")
        assert res.returncode == 2, res.stderr
        assert "code_budget_bytes = 1000: must be >= " in res.stderr
        assert not (tmp_path / "refused").exists()
    # the .mpy files themselves over the budget (a build made without that check)
    target = build_cmd.load_target("esp32")
    target = build_cmd.Target(target.path, target.name, dict(target.profile, code_budget_bytes=1000))
    result = build_cmd.build(target, tmp_path / "over")
    assert result.over_budget
    assert "OVER BUDGET" in build_cmd.report(result)


def test_the_passwords_module_ships_only_with_a_profile_that_authenticates(tmp_path):
    """lib/edgeauth.py (passwords and topic ACLs) is heap on a board: the
    build ships it for a profile with users, an acl or no anonymous access,
    and a secrets file that brings users to a profile without it is refused
    in one line before the board is touched (the board would stop at boot)."""
    def shipped(*overrides):
        target = build_cmd.load_target("esp32", list(overrides))
        return {s.remote for s in build_cmd.sources(target.profile)}

    assert "lib/edgeauth.mpy" not in shipped()  # anonymous clients, no acl
    assert "lib/edgeauth.mpy" in shipped("allow_anonymous=false")
    secrets = tmp_path / "secrets.json"
    key = "pbkdf2_sha256:1000:%s:%s" % ("00" * 16, "0" * 64)
    secrets.write_text(json.dumps(dict(SECRETS, users={"ann": key})))
    res = edgebroker("flash", "esp32", "--port", "/dev/ttyUSB9", "--secrets", str(secrets),
                     "--dist", str(tmp_path / "dist"), "--dry-run")
    assert res.returncode == 2
    refusal = [x for x in res.stderr.splitlines() if "has users" in x]
    assert len(refusal) == 1 and '"allow_anonymous": false' in refusal[0], res.stderr
    res = edgebroker("flash", "esp32", "--port", "/dev/ttyUSB9", "--secrets", str(secrets),
                     "--dist", str(tmp_path / "dist"), "--set", "allow_anonymous=false",
                     "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "lib/edgeauth.mpy" in res.stdout


def test_build_is_current_until_an_input_changes(tmp_path):
    target = build_cmd.load_target("host")
    assert not build_cmd.is_current(target, tmp_path / "host")
    build_cmd.build(target, tmp_path)
    assert build_cmd.is_current(target, tmp_path / "host")
    assert not build_cmd.is_current(build_cmd.load_target("host", ["max_clients=3"]),
                                    tmp_path / "host")
    (tmp_path / "host" / "main.py").write_text("# changed on disk\n")
    assert not build_cmd.is_current(target, tmp_path / "host")


def test_build_refuses_to_empty_a_foreign_directory(tmp_path):
    (tmp_path / "host").mkdir()
    (tmp_path / "host" / "precious.txt").write_text("keep me")
    res = edgebroker("build", "host", "--dist", str(tmp_path))
    assert res.returncode == 2 and "not removing" in res.stderr
    assert (tmp_path / "host" / "precious.txt").read_text() == "keep me"


def test_romfs_image_mounts_and_imports(tmp_path):
    """romfs: true -> dist/<board>/romfs.img, which the unix port mounts as
    VfsRom at /rom and imports the broker and the gateway from."""
    res = edgebroker("build", "host", "--dist", str(tmp_path), "--set", "romfs=true")
    assert res.returncode == 0, res.stdout + res.stderr
    img = tmp_path / "host" / "romfs.img"
    assert img.is_file() and "romfs.img" in res.stdout
    code = (
        "import sys, vfs, os\n"
        "sys.path.insert(0, %r)\n"
        "import fake_machine, fake_network\n"
        "sys.modules['machine'] = fake_machine\n"
        "sys.modules['network'] = fake_network\n"
        "vfs.mount(vfs.VfsRom(open(%r, 'rb').read()), '/rom')\n"
        "sys.path[:] = ['/rom/lib']\n"
        "import edgebroker, edgeconf, edgeram, gateway\n"
        "print('ROM', sorted(os.listdir('/rom/lib')), edgebroker.VERSION,"
        " edgebroker.__file__, gateway.__file__)\n"
    ) % (str(STANDIN_DIR), str(img))
    out = subprocess.run([micropython_exe(), "-c", code], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    assert ("ROM ['edgebroker.mpy', 'edgeconf.mpy', 'edgeram.mpy', 'gateway.mpy', 'gwboot.mpy',"
            " 'userapp.mpy']" in out.stdout)
    assert "/rom/lib/edgebroker.mpy" in out.stdout
    # flash deploys the image instead of copying lib/*.mpy, and verifies it under /rom
    target = build_cmd.load_target("host", ["romfs=true"])
    plan = flash_cmd.make_plan(target, "/dev/null", tmp_path, None, None, None, False, 0)
    assert plan.romfs_image == img
    assert not [c for c in plan.copies if c.remote.startswith("/lib/")]
    assert "/rom/lib/edgebroker.mpy" in plan.verify


# ---------------------------------------------------------------- mip package
def test_package_json_installs_with_mpremote_mip(tmp_path):
    """package.json at the repo root: mpremote's own mip code installs the
    broker's modules from it (files written to a recording transport)."""
    from mpremote import mip

    pkg = json.loads((REPO / "package.json").read_text())
    version = None
    for line in (REPO / "lib" / "edgebroker.py").read_text().splitlines():
        if line.startswith("VERSION = "):
            version = line.split("=", 1)[1].strip().strip('"')
    assert pkg["version"] == version

    class Recorder:
        def __init__(self):
            self.files = {}
            self.dirs = set()

        def fs_exists(self, p):
            return p in self.dirs or p in self.files

        def fs_mkdir(self, p):
            self.dirs.add(p)

        def fs_hashfile(self, p, algo):
            raise FileNotFoundError(p)

        def fs_writefile(self, p, data, progress_callback=None):
            self.files[p] = data

    t = Recorder()
    mip._install_package(t, str(REPO / "package.json"), "unused-index", "/lib", None, False)
    # every module of lib/ (the broker imports the ones a profile uses)
    lib = sorted(p.name for p in (REPO / "lib").glob("*.py"))
    assert set(t.files) == {"/lib/" + name for name in lib}
    for name in lib:
        assert t.files["/lib/" + name] == (REPO / "lib" / name).read_bytes()

"""Bad input to the host commands: one line on stderr, no traceback, exit 2.

- a profile value that `config check` refuses, wherever it enters (`--set`,
  `--board FILE`, a board name) stops `run`, `emulate`, `build` and `flash`
  before anything starts or is written, naming the key, the value and the
  allowed range;
- a port already in use (`run` and `emulate`, both interpreters), and the
  broker's own one-line error passed through unchanged;
- a heap too small for the build (`emulate`), saying the minimum;
- a serial port that does not exist (`flash`);
- a profile file that is not UTF-8, an integer of 5,000 digits or arrays
  nested thousands deep, in a file or a `--set` value (every command);
- a --dist that is a file or cannot be made (`build`, `flash`);
- a --watch out of range, a secrets file with an unknown key or a wrong
  type (`flash`);
- a reader that goes away (`... | head`): the command stops quietly.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EDGEBROKER = Path(sys.executable).parent / "edgebroker"
INTERPRETERS = ["cpython", "micropython"]


def edgebroker(*args, env=None, timeout=60, **kw):
    return subprocess.run([str(EDGEBROKER), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env, **kw)


def one_line_error(r, command):
    """The result's stderr is exactly one `edgebroker COMMAND: error: ...` line, exit 2."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    errors = [x for x in lines if ": error: " in x]
    assert len(errors) == 1, r.stderr
    assert errors[0].startswith("edgebroker %s: error: " % command), r.stderr
    return errors[0]


@pytest.fixture
def busy_port():
    """A port with a listener on 127.0.0.1 for the whole test."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


# ------------------------------------------------------- profile values
@pytest.mark.parametrize("interp", INTERPRETERS)
def test_run_set_max_clients_abc(interp, tmp_path):
    """Was: the broker started and every CONNECT died in a TypeError."""
    r = edgebroker("run", "--set", "max_clients=abc", "--interpreter", interp,
                   "--data-dir", str(tmp_path / "d"))
    line = one_line_error(r, "run")
    assert 'max_clients = "abc": must be an integer in 1..65535' in line, line
    assert not (tmp_path / "d").exists()  # stopped before anything was made


@pytest.mark.parametrize("interp", INTERPRETERS)
def test_run_set_storage_type_flash(interp):
    """Was: a traceback."""
    r = edgebroker("run", "--set", "storage_type=flash", "--interpreter", interp)
    line = one_line_error(r, "run")
    assert 'storage_type = "flash": must be one of "ram", "disc", "disc_only"' in line


@pytest.mark.parametrize("interp", INTERPRETERS)
def test_run_board_file_out_of_range_and_unknown_key(interp, tmp_path):
    """Was: it started. Every error is on the one line."""
    prof = json.loads((REPO / "boards" / "host.json").read_text())
    prof.update({"max_clients": -1, "max_clientz": 4})
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(prof))
    r = edgebroker("run", "--board", str(path), "--interpreter", interp)
    line = one_line_error(r, "run")
    assert "mine.json" in line
    assert "max_clients = -1: must be 1..65535" in line
    assert "max_clientz = 4: unknown key (did you mean max_clients?)" in line


def test_build_set_max_clients_abc_writes_nothing(tmp_path):
    """Was: exit 0, with "abc" written into dist/esp32/board.json."""
    r = edgebroker("build", "esp32", "--set", "max_clients=abc", "--dist", str(tmp_path))
    line = one_line_error(r, "build")
    assert "esp32.json with --set" in line
    assert 'max_clients = "abc": must be an integer in 1..65535' in line
    assert list(tmp_path.iterdir()) == []


def test_build_refuses_what_config_check_refuses(tmp_path):
    """Cross-key checks too: more clients than the esp32's sockets allow."""
    r = edgebroker("build", "esp32", "--set", "max_clients=12", "--dist", str(tmp_path))
    line = one_line_error(r, "build")
    assert "max_clients = 12: must be <= 8 (sockets 10 - listener 1 - spare 1) on esp32" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("interp", INTERPRETERS)
def test_emulate_set_bad_value(interp, tmp_path):
    r = edgebroker("emulate", "esp32", "--set", "max_inflight=lots", "--interpreter", interp,
                   "--data-dir", str(tmp_path / "d"))
    line = one_line_error(r, "emulate")
    assert 'max_inflight = "lots": must be an integer in ' in line
    assert not (tmp_path / "d").exists()


def test_flash_set_bad_value(tmp_path):
    r = edgebroker("flash", "esp32", "--port", "/dev/ttyUSB9", "--set", "maximum_qos=3",
                   "--dist", str(tmp_path), "--dry-run")
    line = one_line_error(r, "flash")
    assert "maximum_qos = 3: must be 0..2" in line
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------- files the tools cannot read
DEEP = "[" * 50000 + "]" * 50000  # ~100 KB: an argument may be 128 KB
DIGITS = "9" * 5000  # past Python's 4,300-digit limit for reading an integer

#: Every command that reads a board profile, with what it needs besides.
PROFILE_COMMANDS = [
    (["run", "--interpreter", "cpython", "--board"], []),
    (["emulate"], []),
    (["build"], ["--dist", "{tmp}/dist"]),
    (["flash"], ["--port", "/dev/ttyUSB9", "--dry-run", "--dist", "{tmp}/dist"]),
    (["config", "check"], []),
    (["config", "show"], []),
    (["config", "apply", "esp32"], []),  # the file is the patch here
]
UNREADABLE = [
    ("not-utf8", b"\xff\xfe{}", ["is not UTF-8 text: byte 0xff at offset 0"]),
    ("5000-digits", ('{"max_clients": %s}' % DIGITS).encode(),
     ["max_clients = 999999999999...9999 (5000 digits): must be an integer in 1..65535"]),
    ("nested-50000", ('{"acl": %s}' % DEEP).encode(),
     ["acl = [[[[", "nested more than 32 levels deep; must be at most 32 levels"]),
]


@pytest.mark.parametrize("cmd,extra", PROFILE_COMMANDS, ids=lambda c: "-".join(c) if c else "")
@pytest.mark.parametrize("name,content,says", UNREADABLE, ids=[u[0] for u in UNREADABLE])
def test_unreadable_profile_file_is_one_line(tmp_path, cmd, extra, name, content, says):
    """Was: a UnicodeDecodeError, ValueError or RecursionError traceback, exit 1."""
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    args = [a.format(tmp=tmp_path) for a in extra]
    r = edgebroker(*cmd, str(path), *args)
    line = one_line_error(r, cmd[0])
    assert str(path) in line, line
    for text in says:
        assert text in line, line
    assert len(line) < 400, line  # the value is shortened, not repeated whole
    assert not (tmp_path / "dist").exists()


@pytest.mark.parametrize("cmd", [
    ["run", "--interpreter", "cpython"],
    ["emulate", "esp32"],
    ["build", "esp32"],
    ["flash", "esp32", "--port", "/dev/ttyUSB9", "--dry-run"],
], ids=lambda c: c[0])
@pytest.mark.parametrize("value,says", [
    ("acl=" + DEEP, "--set acl = [[[[[[[[[[[[[[[[...: nested more than 32 levels deep"),
    ("max_clients=" + DIGITS,
     "--set max_clients = 999999999999...9999 (5000 digits): must be an integer in 1..65535"),
    ('acl=[{"who": "all", "access": "read", "topic": %s}]' % DIGITS,
     "--set acl[0].topic = 999999999999...9999 (5000 digits): must be a string"),
], ids=["nested-50000", "5000-digits", "5000-digits-in-acl"])
def test_set_value_past_the_json_limits_is_one_line(tmp_path, cmd, value, says):
    """Was: a RecursionError traceback, or the 5,000 digits read as a string."""
    r = edgebroker(*cmd, "--set", value, "--dist" if cmd[0] in ("build", "flash") else
                   "--data-dir", str(tmp_path / "out"))
    line = one_line_error(r, cmd[0])
    assert says in line, line
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ --dist
@pytest.mark.parametrize("cmd", [["build"], ["flash", "--port", "/dev/ttyUSB9", "--dry-run"]],
                         ids=lambda c: c[0])
def test_dist_that_is_a_file(tmp_path, cmd):
    """Was: NotADirectoryError (build); flash printed a plan that could not work."""
    afile = tmp_path / "bad1.json"
    afile.write_text("{}")
    for dist, says in ((afile, "is a file, not a directory"),
                       (afile / "sub", "is inside %s, which is a file" % afile)):
        r = edgebroker(cmd[0], "esp32", *cmd[1:], "--dist", str(dist))
        line = one_line_error(r, cmd[0])
        assert "--dist %s: %s" % (dist, says) in line, line
        assert "must be a directory, or a path where one can be made" in line
    assert afile.read_text() == "{}"


def test_build_dist_that_cannot_be_made():
    """Was: FileNotFoundError traceback."""
    r = edgebroker("build", "esp32", "--dist", "/proc/nope")
    line = one_line_error(r, "build")
    assert "cannot make /proc/nope/esp32: No such file or directory (choose another --dist)" \
        in line, line


# ------------------------------------------------------- flash options, secrets
_FLASH_OPTIONS = {
    "watch": "must be 0..3600 seconds (0: do not reset)",
    "baud": "must be an integer baud rate in 9600..4000000",
}


@pytest.mark.parametrize("option, value", [
    *(("watch", v) for v in ("-1", "nan", "inf", "3601", "soon")),
    *(("baud", v) for v in ("-1", "0", "9599", "4000001", "fast")),
])
def test_flash_option_out_of_range(tmp_path, option, value):
    """Was: --watch -1 accepted; --baud -1 accepted (handed to esptool)."""
    r = edgebroker("flash", "esp32", "--port", "/dev/ttyUSB9", "--dry-run",
                   "--dist", str(tmp_path), "--%s=%s" % (option, value))
    line = one_line_error(r, "flash")
    assert line.startswith("edgebroker flash: error: argument --%s: " % option)
    assert value in line and _FLASH_OPTIONS[option] in line, line


def test_flash_watch_in_range(tmp_path):
    r = edgebroker("flash", "esp32", "--port", "/dev/ttyUSB9", "--dry-run",
                   "--dist", str(tmp_path), "--watch", "0")
    assert r.returncode == 0, r.stderr
    assert "soft reset" not in r.stdout


def test_flash_secrets_unknown_key_and_wrong_type(tmp_path):
    """Was: {"wifi_ssid": 5, "bogus": 1} accepted, only the port refused."""
    secrets = tmp_path / "s.json"
    secrets.write_text(json.dumps({"wifi_ssid": 5, "bogus": 1, "wifi_pasword": "pw",
                                   "users": {"ann": 7}, "bridges": []}))
    r = edgebroker("flash", "esp32", "--port", str(tmp_path / "ttyUSB9"), "--secrets",
                   str(secrets), "--dist", str(tmp_path / "dist"))
    line = one_line_error(r, "flash")
    assert "secrets file %s: " % secrets in line
    assert "wifi_ssid = 5: must be a string, not integer" in line
    assert "bogus = 1: unknown key (a secrets file has wifi_ssid, wifi_password, " \
        "ap_password, users, bridges)" in line
    assert 'wifi_pasword = "pw": unknown key (did you mean wifi_password?' in line
    assert "users.ann = <integer, not shown>: must be a string, not integer" in line
    assert "bridges = []: must be an object, not array" in line
    assert "serial port" not in line  # refused before the port is looked at
    assert not (tmp_path / "dist").exists()


def test_flash_secrets_bridge_password_held_to_the_profiles_bound(tmp_path):
    """A bridge password from the secrets file is held to the bound the
    profile's own is held to (256 bytes), and the line does not repeat it
    (before: a 300-byte one passed, while the same value in the profile was
    refused)."""
    prof = json.loads((REPO / "boards" / "esp32.json").read_text())
    prof.update(romfs=True, bridges=[{"name": "cloud", "host": "mqtt.example.com",
                                      "queue_bytes": 65536, "latest_topics": 16,
                                      "topics": [{"pattern": "sensors/#"}]}])
    pf = tmp_path / "bridged.json"
    pf.write_text(json.dumps(prof))
    secrets = tmp_path / "s.json"
    secrets.write_text(json.dumps({"bridges": {"cloud": {"username": "gw",
                                                         "password": "Sx" * 150}}}))
    r = edgebroker("flash", str(pf), "--port", str(tmp_path / "ttyUSB9"), "--secrets",
                   str(secrets), "--dist", str(tmp_path / "dist"))
    line = one_line_error(r, "flash")
    assert "bridges[0].password = <300 bytes, not shown>: must be at most 256 bytes" in line
    assert "SxSx" not in r.stderr + r.stdout


@pytest.mark.parametrize("content,says", [
    (b"\xff\xfe{}", "is not UTF-8 text"),
    (('{"wifi_ssid": %s}' % DEEP).encode(), "wifi_ssid = [[[["),
    (('{"wifi_ssid": %s}' % DIGITS).encode(), "wifi_ssid = 999999999999...9999 (5000 digits)"),
], ids=["not-utf8", "nested-50000", "5000-digits"])
def test_flash_unreadable_secrets_file(tmp_path, content, says):
    secrets = tmp_path / "s.json"
    secrets.write_bytes(content)
    r = edgebroker("flash", "esp32", "--port", "/dev/ttyUSB9", "--secrets", str(secrets),
                   "--dist", str(tmp_path / "dist"), "--dry-run")
    line = one_line_error(r, "flash")
    assert "secrets file %s" % secrets in line and says in line, line


# ------------------------------------------------------------ port in use
@pytest.mark.parametrize("interp", INTERPRETERS)
def test_run_port_in_use(interp, busy_port, tmp_path):
    """`run --board esp32` (a board name, as `make run BOARD=esp32` passes
    it) on a port another process listens on."""
    r = edgebroker("run", "--board", "esp32", "--port", str(busy_port), "--interpreter", interp,
                   "--data-dir", str(tmp_path / "d"))
    line = one_line_error(r, "run")
    assert line == "edgebroker run: error: cannot listen on 127.0.0.1:%d: address in use" % busy_port


@pytest.mark.parametrize("interp", INTERPRETERS)
def test_emulate_port_in_use(interp, busy_port, tmp_path):
    r = edgebroker("emulate", "esp32", "--port", str(busy_port), "--interpreter", interp,
                   "--data-dir", str(tmp_path / "d"))
    line = one_line_error(r, "emulate")
    assert line.endswith("cannot listen on 127.0.0.1:%d: address in use" % busy_port)


def test_run_passes_the_brokers_one_line_error_through(tmp_path):
    """If the port is taken after the tools' own check, the broker's line
    (docs/contract.md) and its exit code 2 reach the user unchanged.
    $EDGEBROKER_LIB (the hook for testing the tools) stands for the broker."""
    script = tmp_path / "taken.py"
    script.write_text(
        "import sys\n"
        "port = sys.argv[sys.argv.index('--port') + 1]\n"
        "print('edgebroker: error: cannot listen on 127.0.0.1:%s: address in use' % port,"
        " file=sys.stderr)\n"
        "sys.exit(2)\n")
    env = dict(os.environ, EDGEBROKER_LIB=str(script))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # free for the tools' check
    r = edgebroker("run", "--port", str(port), "--data-dir", str(tmp_path / "d"), env=env)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "edgebroker: error: cannot listen on 127.0.0.1:%d: address in use" % port]


# ---------------------------------------------------------- heap too small
def test_emulate_heap_too_small_says_the_minimum(tmp_path):
    r = edgebroker("emulate", "esp32", "--heap", "20k", "--port", "1",
                   "--data-dir", str(tmp_path / "d"))
    line = one_line_error(r, "emulate")
    assert "--heap 20k (20,480 bytes) is too small for the esp32 build" in line
    assert "needs at least" in line


# ------------------------------------------------------------ serial port
def test_flash_missing_serial_port(tmp_path):
    secrets = tmp_path / "s.json"
    secrets.write_text(json.dumps({"wifi_ssid": "lab", "wifi_password": "pw-12345678"}))
    r = edgebroker("flash", "host", "--port", str(tmp_path / "ttyUSB9"), "--secrets", str(secrets),
                   "--dist", str(tmp_path / "dist"))
    line = one_line_error(r, "flash")
    assert "serial port %s not found" % (tmp_path / "ttyUSB9") in line
    assert not (tmp_path / "dist").exists()  # nothing built for a board that is not there


# ------------------------------------------------------------ broken pipe
@pytest.mark.parametrize("args", [
    ["config", "show", "esp32"],
    ["store", "inspect", "host_tests/data/good.ebrs", "--json"],
    ["--help"],
], ids=["config-show", "store-inspect-json", "help"])
def test_closed_stdout_ends_quietly(args):
    """`edgebroker ... | head`: the reader is gone before the first write."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        r = subprocess.run([str(EDGEBROKER), *args], cwd=REPO, stdout=write_end,
                           stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert r.stderr == "", r.stderr
    assert r.returncode in (0, 1), r.returncode

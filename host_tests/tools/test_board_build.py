"""The board build drops host-only code (runner.board_source): the CPython
branches of edgebroker's compat block and its command line. Blanked, not
deleted, so that a `--lines` build's tracebacks give the source's line
numbers; the default build (runner.BOARD_OPT) keeps none, and its
tracebacks name the functions. The stripped
module is MicroPython-only by construction, so it is served here under
MicroPython only, with real clients on 127.0.0.1; the whole module (host,
emulator, every other test) runs under both interpreters."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mqtt_helpers import free_port, served_retained

from edgebroker_tools import runner
from edgebroker_tools.commands import build as build_cmd

REPO = Path(__file__).resolve().parents[2]
MP = Path(sys.executable).parent / "micropython"


def test_board_source_blanks_host_only_blocks_and_keeps_line_numbers():
    text = (
        "a = 1\n"
        "# >>> host only: why\n"
        "b = 2\n"
        "# <<< host only\n"
        "if a:\n"
        "    c = 3\n"
        "    # >>> host only\n"
        "else:\n"
        "    c = 4\n"
        "    # <<< host only\n"
    )
    out = runner.board_source(text)
    assert out.count("\n") == text.count("\n")
    assert out.splitlines() == ["a = 1", "", "", "", "if a:", "    c = 3", "", "", "", ""]
    ns: dict[str, int] = {}
    exec(out, ns)
    assert ns["c"] == 3 and "b" not in ns


@pytest.mark.parametrize(
    "text",
    [
        "# >>> host only\nx = 1\n",  # never closed
        "x = 1\n# <<< host only\n",  # an end without a start
        "# >>> host only\n# >>> host only\n# <<< host only\n",  # opened again
    ],
)
def test_board_source_refuses_unbalanced_markers(text):
    with pytest.raises(runner.RunnerError, match="host-only"):
        runner.board_source(text, "mod.py")


def test_every_board_module_has_balanced_markers():
    for p in [*sorted((REPO / "lib").glob("*.py")), *sorted((REPO / "firmware").glob("*.py"))]:
        runner.board_source(p.read_text(), str(p))


def test_broker_board_build_leaves_out_the_command_line_cpython_branches_and_poll_server(tmp_path):
    full = runner.compile_mpy(REPO / "lib" / "edgebroker.py", tmp_path / "full")
    board = runner.compile_mpy(REPO / "lib" / "edgebroker.py", tmp_path / "board", board=True)
    assert board.stat().st_size < full.stat().st_size - 2000
    code = (
        "import sys\n"
        "sys.path.insert(0, %r)\n"
        "import edgebroker\n"
        "print(hasattr(edgebroker, 'main'), hasattr(edgebroker, '_install_signals'),"
        " hasattr(edgebroker, '_tls_wants'), hasattr(edgebroker.Broker, 'serve'),"
        " hasattr(edgebroker.Broker, '_stop_read'), hasattr(edgebroker.Broker, 'serve_async'))\n"
    )
    r = subprocess.run([str(MP), "-c", code % str(board.parent)], capture_output=True,
                       text=True, timeout=60)
    # the poll server too: a board runs serve_async()
    assert r.stdout.split() == ["False"] * 5 + ["True"], r.stdout + r.stderr
    r = subprocess.run([str(MP), "-c", code % str(full.parent)], capture_output=True,
                       text=True, timeout=60)
    assert r.stdout.split() == ["True"] * 6, r.stdout + r.stderr


def test_edgebroker_build_ships_the_board_build(tmp_path):
    # `edgebroker build`'s compile step is the same stripping
    out = tmp_path / "edgebroker.mpy"
    build_cmd.compile_mpy(REPO / "lib" / "edgebroker.py", out)
    board = runner.compile_mpy(REPO / "lib" / "edgebroker.py", tmp_path / "b", board=True)
    assert out.read_bytes() == board.read_bytes()


TRACEBACK_SRC = """def inner(x):
    y = x + 1
    return y / 0


def outer():
    return inner(2)
"""


def _traceback(mpy_dir: Path) -> str:
    code = "import sys\nsys.path.insert(0, %r)\nimport tbmod\ntbmod.outer()\n" % str(mpy_dir)
    r = subprocess.run([str(MP), "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    return r.stdout + r.stderr


def test_board_build_tracebacks_name_functions_and_lines_builds_give_lines(tmp_path):
    """mpy-cross -O3 (runner.BOARD_OPT) leaves the line numbers out: on the
    board a traceback still names each function; `--lines` (opt 0) keeps
    the source's line numbers, host-only blocks blanked, not deleted."""
    src = tmp_path / "tbmod.py"
    src.write_text("# >>> host only\nimport os\n# <<< host only\n" + TRACEBACK_SRC)
    build_cmd.compile_mpy(src, tmp_path / "default" / "tbmod.mpy")
    build_cmd.compile_mpy(src, tmp_path / "lines" / "tbmod.mpy", opt=0)
    plain = _traceback(tmp_path / "default")
    assert 'File "tbmod.py", line 1, in outer' in plain, plain
    assert 'File "tbmod.py", line 1, in inner' in plain, plain
    assert "ZeroDivisionError" in plain
    lines = _traceback(tmp_path / "lines")
    assert 'File "tbmod.py", line 10, in outer' in lines, lines
    assert 'File "tbmod.py", line 6, in inner' in lines, lines
    assert (tmp_path / "default" / "tbmod.mpy").stat().st_size < (
        tmp_path / "lines" / "tbmod.mpy"
    ).stat().st_size


def test_build_lines_is_its_own_build(tmp_path):
    """`edgebroker build --lines`: a build of its own (the manifest says so, and a
    default build is not current for it), with larger bytecode and a report line
    saying what config check does not count."""
    plain = build_cmd.load_target("esp32")
    debug = build_cmd.load_target("esp32", lines=True)
    small = build_cmd.build(plain, tmp_path)
    assert build_cmd.is_current(plain, tmp_path / "esp32")
    assert not build_cmd.is_current(debug, tmp_path / "esp32")
    man = json.loads((tmp_path / "esp32" / build_cmd.MANIFEST).read_text())
    assert man["line_numbers"] is False
    big = build_cmd.build(debug, tmp_path)
    man = json.loads((tmp_path / "esp32" / build_cmd.MANIFEST).read_text())
    assert man["line_numbers"] is True
    assert big.bytecode_bytes > small.bytecode_bytes * 1.05
    assert "--lines: tracebacks give line numbers" in build_cmd.report(big)
    assert "--lines" not in build_cmd.report(small)


def test_frozen_build_ships_no_frozen_module(tmp_path):
    """frozen: true: the modules firmware/freeze/manifest.py freezes are in
    the firmware (found before /lib), so the build ships none of them: the
    entry points and the profile only, and its report says why."""
    frozen = build_cmd.frozen_modules()
    assert {"edgebroker", "edgestore", "edgeconf", "gateway"} <= frozen
    target = build_cmd.load_target("esp32", ["frozen=true"])
    res = build_cmd.build(target, tmp_path)
    shipped = sorted(f.remote for f in res.files)
    assert not [r for r in shipped if r.startswith("lib/") and Path(r).stem in frozen], shipped
    assert {"boot.py", "main.py", build_cmd.PROFILE_FILE} <= set(shipped)
    assert "frozen: the modules of firmware/freeze/manifest.py" in build_cmd.report(res)
    plain = build_cmd.build(build_cmd.load_target("esp32"), tmp_path / "plain")
    assert "lib/edgebroker.mpy" in {f.remote for f in plain.files}


@pytest.mark.parametrize("content", [b"\xff\xfe{}", b"[" * 50000 + b"]" * 50000,
                                     b'{"files": ' + b"9" * 5000 + b"}"],
                         ids=["not-utf8", "nested-50000", "5000-digits"])
def test_an_unreadable_manifest_is_a_stale_build(tmp_path, content):
    """dist/<board>/manifest.json that cannot be read (was: a traceback for
    the nested one): the build is stale and made again."""
    (tmp_path / "esp32").mkdir()
    (tmp_path / "esp32" / build_cmd.MANIFEST).write_bytes(content)
    assert build_cmd.read_manifest(tmp_path / "esp32") is None
    assert not build_cmd.is_current(build_cmd.load_target("esp32"), tmp_path / "esp32")


def test_build_into_a_directory_it_cannot_make(tmp_path):
    """--dist checked before the build (a file, or inside one), and a
    directory the build cannot make: one CommandError line, not an OSError."""
    afile = tmp_path / "bad1.json"
    afile.write_text("{}")
    for dist in (afile, afile / "sub"):
        with pytest.raises(build_cmd.CommandError, match="must be a directory, or a path"):
            build_cmd.check_dist(dist)
    build_cmd.check_dist(tmp_path / "new" / "dist")  # made when built
    with pytest.raises(build_cmd.CommandError, match=r"cannot make .*bad1.json/esp32"):
        build_cmd.build(build_cmd.load_target("esp32"), afile)


def test_set_value_past_the_json_limits():
    """A --set value as the broker reads it (JSON, else the string), and one
    past the reader's limits refused naming the key."""
    assert build_cmd.parse_value("[1, 2]") == [1, 2]
    assert build_cmd.parse_value("abc") == "abc"
    with pytest.raises(build_cmd.profiles.ProfileError, match="nested more than 32 levels"):
        build_cmd.parse_value("[" * 50000 + "]" * 50000)
    with pytest.raises(build_cmd.profiles.ProfileError, match=r"\(5000 digits\)"):
        build_cmd.parse_value("9" * 5000)


LAUNCH = r"""
import sys
sys.path.insert(0, %(dir)r)
import asyncio
import json
import edgebroker
b = edgebroker.start(json.loads(%(profile)r), "127.0.0.1", %(port)d, %(data)r)
print("ready", flush=True) if hasattr(print, "flush") else print("ready")
try:
    asyncio.run(b.serve_async())
finally:
    b.shutdown()
"""


def test_board_build_serves_retained_on_flash_under_micropython(tmp_path):
    """The gateway's way in (start() + serve_async(), as firmware/gateway.py),
    from the board build's .mpy: a retained QoS 1 message reaches a paho
    subscriber, and the flash store holds it."""
    board = runner.compile_mpy(REPO / "lib" / "edgebroker.py", tmp_path / "b", board=True)
    for mod in ("edgeconf", "edgestore", "edgeopen"):
        runner.compile_mpy(REPO / "lib" / (mod + ".py"), tmp_path / "b", board=True)
    port = free_port()
    data = tmp_path / "data"
    profile = {"storage_type": "disc_only", "max_retained_messages": 64}
    code = LAUNCH % {"dir": str(board.parent), "profile": json.dumps(profile), "port": port,
                     "data": str(data)}
    line, m = served_retained([str(MP), "-c", code], "ready", port, "site/board/temp", b"21.5",
                              "site/+/temp", "board")
    assert line == "ready", line
    assert (m.topic, m.payload, m.retain) == ("site/board/temp", b"21.5", True)
    store = (data / "retained.ebrs").read_bytes()
    assert b"site/board/temp" in store and b"21.5" in store


def test_board_build_runs_the_esp32_full_load_in_its_heap(tmp_path):
    """What a board gets, run the gateway's way: the board build of
    edgebroker and edgestore (`mpy-cross -O3`, host-only lines blanked; no
    edgeram: a flash-store profile is not shipped the RAM store), started with
    start() + serve_async() in the esp32 profile's heap_bytes (scaled to this
    64-bit port, runner.unix_heap), runs the profile's full load
    (test_emulate.full_load: max_clients x max_subscriptions, full inflight
    and queues, the retained set in disc_only): no MemoryError, no refusal,
    no drop. (`emulate` runs the whole module; this is the shipped one.)"""
    from test_emulate import effective, full_load

    mpy = tmp_path / "b"
    for mod in ("edgebroker", "edgeconf", "edgestore", "edgeopen"):
        runner.compile_mpy(REPO / "lib" / (mod + ".py"), mpy, board=True)
    cfg = effective("esp32")
    cfg["sys_interval"] = 1  # the heap figures at the peak, for the report
    port = free_port()
    data = tmp_path / "data"
    code = LAUNCH % {"dir": str(mpy), "profile": json.dumps(cfg), "port": port,
                     "data": str(data)}
    log = tmp_path / "board.log"
    heap = runner.unix_heap(cfg["heap_bytes"])
    with open(log, "w") as err:
        proc = subprocess.Popen([str(MP), "-X", "heapsize=%d" % heap, "-c", code],
                                stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready", log.read_text()
            report = full_load(port, cfg, True)
            assert proc.poll() is None, log.read_text()
        finally:
            proc.send_signal(2)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
    text = log.read_text()
    assert "MemoryError" not in text and "refused" not in text, text
    assert report.get("retained_delivered") == cfg["max_retained_messages"]
    assert report.get("refusals") == {} and report.get("dropped") == "0", report
